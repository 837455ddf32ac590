"""Anchor for the 2026 families (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, gpt-oss, DeepSeek-V3) beside
`ferrotune bench train --model DIR` and `ferrotune bench decode --model DIR`, on CPU.

  python hf_family.py make FAMILY DIR      # a small random-weight checkpoint of FAMILY (seeded)
  python hf_family.py train DIR --seq 256 --batch 2 --steps 5
  python hf_family.py decode DIR --prompt 64 --new-tokens 64 --runs 3

`make` writes a transformers 5 checkpoint (f32 safetensors) of a small shape of each family: the
same layer kinds as the released models (DeltaNet and gated full-attention layers in 3:1, routed
and shared experts, sinks and sliding layers, latent attention with group-limited routing), a
few hundred MB at most so that a CPU step takes seconds. Both sides read that folder.

`train` runs what `bench train` runs: LoRA r 8, alpha 16, dropout 0 on the modules named q, k, v,
o, gate, up, down projections (PEFT's suffix match; fused experts are no modules and DeltaNet's
projections have other names, so neither side adapts them), random ids with labels = ids, AdamW
lr 1e-4, 2 warm-up steps then --steps timed. `decode` runs greedy decoding at batch 1 through the
model's cache (transformers' dynamic cache, which for Qwen3.5 holds the DeltaNet states), random
prompt, tokens after the first over the time after the prefill, median of --runs. Each prints one
JSON line (tokens_per_s, step_s or decode time, peak_rss_mb)."""
import argparse, json, resource, statistics, sys, time

import torch

VOCAB = 32000


def make(family, out):
    import transformers as tf
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        linear = dict(linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_num_key_heads=4,
                      linear_num_value_heads=8, linear_value_head_dim=64,
                      layer_types=["linear_attention"] * 3 + ["full_attention"],
                      intermediate_size=1536)
        linear["layer_types"] = linear["layer_types"] * 2
        moe = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=384,
                   shared_expert_intermediate_size=512)
        if family == "qwen3_5":
            cfg = tf.Qwen3_5TextConfig(**common, **linear)
            model = tf.Qwen3_5ForCausalLM(cfg)
        elif family == "qwen3_5_moe":
            cfg = tf.Qwen3_5MoeTextConfig(**common, **linear, **moe)
            model = tf.Qwen3_5MoeForCausalLM(cfg)
        else:
            cfg = tf.Qwen3NextConfig(**common, **linear, **moe)
            model = tf.Qwen3NextForCausalLM(cfg)
    elif family == "gpt_oss":
        cfg = tf.GptOssConfig(**common, intermediate_size=512, num_local_experts=8,
                              num_experts_per_tok=2, sliding_window=128)
        model = tf.GptOssForCausalLM(cfg)
    elif family == "deepseek_v3":
        c = dict(common)
        c.update(num_key_value_heads=8, head_dim=32)  # transformers: head_dim is the rope head
        cfg = tf.DeepseekV3Config(**c, intermediate_size=1536, q_lora_rank=256, kv_lora_rank=128,
                                  qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
                                  n_routed_experts=8, num_experts_per_tok=2, n_group=4,
                                  topk_group=2, n_shared_experts=1, moe_intermediate_size=384,
                                  first_k_dense_replace=1, num_nextn_predict_layers=0)
        model = tf.DeepseekV3ForCausalLM(cfg)
    else:
        sys.exit(f"unknown family {family}")
    # transformers' own initialisation (seeded above): speed does not depend on the values.
    model.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    print(json.dumps({"family": family, "params": n, "dir": out}))


def load(d):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)


def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def train(a):
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    m = load(a.dir)
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=names))
    m.train()
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, m.config.vocab_size, (a.batch, a.seq))
    times = []
    for i in range(2 + a.steps):
        t = time.perf_counter()
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t)
    step = statistics.median(times)
    print(json.dumps({"tokens_per_s": a.batch * a.seq / step, "step_s": step,
                      "peak_rss_mb": rss_mb(), "loss": loss.item()}))


@torch.no_grad()
def decode(a):
    torch.manual_seed(1)
    m = load(a.dir).eval()
    ids = torch.randint(3, m.config.vocab_size, (1, a.prompt))
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)

    def gen(n):
        t = time.perf_counter()
        m.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
        return time.perf_counter() - t

    gen(a.new_tokens)  # warm-up
    rates = []
    for _ in range(a.runs):
        prefill = gen(1)
        total = gen(a.new_tokens)
        rates.append((a.new_tokens - 1) / max(total - prefill, 1e-9))
    print(json.dumps({"tokens_per_s": statistics.median(rates), "peak_rss_mb": rss_mb()}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["make", "train", "decode"])
    ap.add_argument("arg1")
    ap.add_argument("arg2", nargs="?")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    if a.mode == "make":
        make(a.arg1, a.arg2)
    else:
        a.dir = a.arg1
        train(a) if a.mode == "train" else decode(a)


if __name__ == "__main__":
    main()
