#!/usr/bin/env python3
"""Held-out check of DeepSeek-V3 / V2 through the CLI: two random tiny checkpoints unlike the
fixtures (V3 with plain rotary halves — rope_interleave false —, a plain q_proj, tied embeddings,
3 groups all kept, no renormalization; V2 with low-rank queries, YaRN with mscale_all_dim, experts
in every layer, values narrower than keys) made with transformers, and `ferrotune generate`'s 16
greedy tokens compared with transformers' generate(). Run from the repository root after
`cargo build --release -p ferrotune-cli`: python3 scripts/check_deepseek_heldout.py
"""
import json, subprocess, sys, torch
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV2Config
torch.manual_seed(5)
cases = {
 "v3_plain_rope": DeepseekV3Config(vocab_size=300, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
    num_attention_heads=6, num_key_value_heads=6, n_shared_experts=1, n_routed_experts=6, routed_scaling_factor=1.7, kv_lora_rank=20,
    q_lora_rank=None, qk_rope_head_dim=6, v_head_dim=14, qk_nope_head_dim=10, n_group=3, topk_group=3, num_experts_per_tok=2,
    first_k_dense_replace=2, norm_topk_prob=False, rope_interleave=False, rope_parameters={"rope_type":"default","rope_theta":5000.0},
    max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True),
 "v2_linear_mscale": DeepseekV2Config(vocab_size=300, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
    num_attention_heads=4, n_shared_experts=2, n_routed_experts=8, routed_scaling_factor=16.0, kv_lora_rank=24, q_lora_rank=20,
    qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=16, topk_method="greedy", num_experts_per_tok=3, first_k_dense_replace=0,
    rope_parameters={"rope_type":"yarn","rope_theta":10000.0,"factor":8.0,"original_max_position_embeddings":16,"mscale":0.707,"mscale_all_dim":0.707},
    max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2),
}
for name, cfg in cases.items():
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n: p.copy_(1 + 0.2 * torch.randn_like(p))
            elif "embed" in n: p.copy_(torch.randn_like(p))
            else: p.copy_(1.5 * torch.randn_like(p) / p.shape[-1] ** 0.5)
        for n, b in m.named_buffers():
            if n.endswith("e_score_correction_bias"): b.copy_(0.3 * torch.randn_like(b))
    m.eval()
    d = f"/tmp/ferrotune-deepseek-heldout/{name}"
    m.save_pretrained(d)
    import shutil
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(f"tests/fixtures/models/deepseek_v3/model/{f}", d)
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    prompt = [5, 77, 123, 9, 250, 31, 8]
    out = m.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    ft = subprocess.run(["target/release/ferrotune", "generate", "--model", d, "--prompt-ids", ",".join(map(str, prompt)),
                         "--max-new-tokens", "16", "--json"], capture_output=True, text=True)
    line = [l for l in ft.stdout.splitlines() if l.startswith("{")]
    got = json.loads(line[-1])["new_token_ids"] if line else ft.stderr[-300:]
    print(name, "transformers", out, "\n   ferrotune  ", got, "EQUAL" if got == out else "DIFFER")
    if got != out:
        sys.exit(1)
