#!/usr/bin/env python3
"""Random tiny models of every supported family, checked against transformers (+ PEFT) through the
`ferrotune` binary: the fixture tests cover chosen configurations, this draws others (head sizes,
GQA ratios, tied heads, biases, rope scalings, sliding windows, softcaps, partial rotary, expert
counts) to find the combinations nobody wrote down.

  python3 scripts/sweep_random_configs.py forward [--seed 1] [--trials 3] [--types llama,phi]
  python3 scripts/sweep_random_configs.py lora    ...   # one SGD step (lr 1) from a PEFT adapter
  python3 scripts/sweep_random_configs.py full    ...   # one full fine-tuning SGD step
  python3 scripts/sweep_random_configs.py gguf    ...   # export-gguf f32, run by llama.cpp
  python3 scripts/sweep_random_configs.py gguf-lora ... # a PEFT adapter as llama.cpp's LoRA GGUF
  python3 scripts/sweep_random_configs.py packed  ...   # packed rows train as the samples alone
  python3 scripts/sweep_random_configs.py moe-peft ...  # PEFT adapters on fused experts, both ways

- forward: `run eval`'s loss against transformers' (relative 1e-5) and 10 greedy tokens of
  `generate` against `model.generate`.
- lora: a PEFT adapter on all linear layers, half the time the token embedding too, at times the
  head (tied or not; sometimes DoRA, sometimes rsLoRA, B non-zero), saved with PEFT's defaults;
  ferrotune's saved adapter after one SGD step with lr 1 is `start − PEFT's gradient` (1e-4).
- full: the saved checkpoint after one SGD step with lr 1 is `start − torch's gradient` (1e-4),
  with exactly the checkpoint's tensors.
- gguf: `export-gguf --outtype f32` run by llama.cpp (llama-cpp-python, in a child process: a
  crash is reported, not fatal) against transformers' logits (1e-5 relative L2; 1e-3 for Gemma
  and Phi-2, whose GELU llama.cpp takes from an f16 table); a refusal with its reason counts as
  agreeing (the config is one llama.cpp cannot run), as does a note that llama.cpp cannot run
  the file (a Gemma 3 of fewer than six layers, on which llama.cpp crashes).
- packed: six samples of 5 to 20 tokens, once one per row (a batch of six) and once packed
  into one row of 128 (`packed: true`): the first step's loss is the same (1e-5), and so is the model after one SGD step
  (relative 1e-4 of how far it moved) — block-causal masks, restarted positions, windows,
  softcaps and partial rotary included.
- moe-peft (mixtures of experts only): a PEFT adapter made on transformers 5 with
  `target_parameters` (fused experts, the router) gives ferrotune's `run eval` PEFT's loss (1e-5);
  and ferrotune's LoRA on every expert, one SGD step, written as `transformers5/`, gives PEFT on
  transformers 5 the loss ferrotune computes with its own per-expert adapter (1e-5).
- gguf-lora: a PEFT adapter on all linear layers (rsLoRA at times, the token embedding half the
  time), exported with `export-gguf
  ADAPTER --base MODEL`, run by llama.cpp on the base's f32 GGUF, against transformers + PEFT.

Llama 4 (`llama4_text`) draws NoPE layers, chunk sizes, the L2 q/k norm, the query temperature,
top-1 or top-2 sigmoid routing and which layers are sparse; its fused experts carry the
checkpoint's names, so the lora and full modes check it too (PEFT's names reach the attention,
dense MLPs and shared experts; its router is left out, which PEFT cannot wrap).

Needs torch, transformers, peft, safetensors (and llama-cpp-python for gguf); `--binary`
(default target/release/ferrotune). Found so far: a tied head's own bias (Phi-2 with
tie_word_embeddings) dropped on load, save and in full fine-tuning; GGUF files of an untied
Gemma / Gemma 2, which llama.cpp refuses (now refused by export-gguf with the reason).
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
TOK = os.path.join(ROOT, "tests", "fixtures", "tiny_tokenizer")
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "vaultgemma", "gemma3_text", "phi3", "phi",
            "smollm3", "mixtral", "qwen2_moe", "qwen3_moe", "phimoe", "llama4_text", "gemma4_text"]
# transformers 5 keeps experts as fused parameters (saved under per-expert names), which PEFT's
# LoRA cannot target as ferrotune's per-expert modules and whose gradients do not carry the
# checkpoint's names: the MoE families are checked by the forward sweep only (their fixtures
# hold per-expert gradients).
MOE = {"mixtral", "qwen2_moe", "qwen3_moe", "phimoe"}
# Vision-language checkpoints ferrotune runs as their text family (mrope on text alone is plain
# RoPE; Llama 3.2 Vision's cross-attention layers are skipped on text alone); checked by the
# forward and packed sweeps.
VL = {"qwen2_5_vl": "qwen2", "qwen3_vl": "qwen3", "mllama": "llama"}
FAMILIES += list(VL)


def random_config(rng, mt):
    if mt == "mllama":
        # Llama 3.2 Vision: head_dim is hidden / heads, no biases, an untied head (the embedding
        # has 8 more rows); cross-attention layers (skipped on text alone) among the text layers.
        c = random_config(rng, "llama")
        for k in ("head_dim", "attention_bias", "mlp_bias"):
            c.pop(k, None)
        c["tie_word_embeddings"] = False
        cross = rng.choice([1, 2])
        c["num_hidden_layers"] += cross
        c["cross_attention_layers"] = sorted(rng.sample(range(c["num_hidden_layers"]), cross))
        return c
    if mt in VL:
        c = random_config(rng, VL[mt])
        hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        half = hd // 2
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": c["rope_parameters"]["rope_theta"],
                                "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}
        if mt == "qwen3_vl":
            c["rope_parameters"]["mrope_interleaved"] = True
        return c
    heads = rng.choice([2, 4])
    kv = rng.choice([k for k in [1, 2, 4] if heads % k == 0])
    hd = rng.choice([8, 16])
    c = dict(vocab_size=512, hidden_size=rng.choice([32, 48]),
             intermediate_size=rng.choice([64, 96]), num_hidden_layers=rng.choice([2, 3]),
             num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
             tie_word_embeddings=rng.random() < 0.5, rms_norm_eps=1e-5, pad_token_id=3,
             bos_token_id=0, eos_token_id=2)
    rp = {"rope_theta": rng.choice([10000.0, 500000.0]), "rope_type": "default"}
    r = rng.random()
    if r < 0.2:
        rp.update(rope_type="linear", factor=2.0)
    elif r < 0.35:
        rp.update(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
    elif r < 0.5 and mt in ("llama", "llama4_text"):
        # Llama 4 Scout's takes low = high frequency factor (no smoothed band).
        high = rng.choice([1.0, 4.0]) if mt == "llama4_text" else 4.0
        rp.update(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=high,
                  original_max_position_embeddings=32)
    elif r < 0.6:
        rp.update(rope_type="dynamic", factor=2.0)
    if mt in ("llama", "mistral", "qwen3", "gemma", "gemma2", "vaultgemma", "gemma3_text", "gemma4_text", "smollm3", "mixtral",
              "qwen3_moe", "llama4_text"):
        c["head_dim"] = hd
    if mt == "llama":
        c["attention_bias"] = rng.random() < 0.3
        c["mlp_bias"] = rng.random() < 0.3
    if mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        c["use_sliding_window"] = False
    if mt == "mistral":
        c["sliding_window"] = rng.choice([None, 6])
    if mt in ("gemma2", "vaultgemma", "gemma3_text"):
        c["sliding_window"] = rng.choice([4, 8])
        c["query_pre_attn_scalar"] = rng.choice([hd, 24])
        c["hidden_activation"] = "gelu_pytorch_tanh"
    if mt in ("gemma2", "vaultgemma"):
        c["attn_logit_softcapping"] = rng.choice([None, 20.0])
        c["final_logit_softcapping"] = rng.choice([None, 15.0])
    if mt in MOE:
        c.update(num_local_experts=4, num_experts=4, num_experts_per_tok=2,
                 moe_intermediate_size=32, shared_expert_intermediate_size=48)
        if mt == "qwen3_moe":
            c["norm_topk_prob"] = rng.random() < 0.5
    if mt == "phimoe":
        # Sparsemixer thresholds from "mask almost everything" to "mask little"; Phi-3.5-MoE takes
        # default or longrope (with its short/long mscale) only.
        c.update(router_jitter_noise=rng.choice([0.01, 0.2, 0.5]), input_jitter_noise=0.0,
                 attention_bias=rng.random() < 0.5, lm_head_bias=rng.random() < 0.5)
        if rp["rope_type"] != "default":
            half = hd // 2 if "head_dim" in c else c["hidden_size"] // heads // 2
            rp = {"rope_theta": 10000.0, "rope_type": "longrope",
                  "short_factor": [1.0 + 0.3 * rng.random() for _ in range(half)],
                  "long_factor": [2.0 + rng.random() for _ in range(half)],
                  "short_mscale": 1.0 + 0.3 * rng.random(), "long_mscale": 1.0 + 0.3 * rng.random(),
                  "original_max_position_embeddings": rng.choice([8, 64])}
    if mt == "llama4_text":
        # Llama 4: NoPE layers (with the query temperature, from early positions when floor_scale
        # is small), chunked attention on the RoPE layers, the L2 q/k norm, sigmoid top-k experts
        # (fused) with a shared expert, dense layers with intermediate_size_mlp.
        layers = rng.choice([2, 3, 4])
        c["num_hidden_layers"] = layers
        c["intermediate_size_mlp"] = c["intermediate_size"]
        c["intermediate_size"] = rng.choice([16, 32])
        c["num_local_experts"] = rng.choice([2, 4])
        c["num_experts_per_tok"] = rng.choice([1, 2])
        if rng.random() < 0.5:
            c["no_rope_layers"] = [rng.choice([0, 1]) for _ in range(layers)]
        else:
            c["no_rope_layer_interval"] = rng.choice([2, 3, 4])
        if rng.random() < 0.5:
            c["moe_layers"] = sorted(rng.sample(range(layers), rng.randint(0, layers)))
        else:
            c["interleave_moe_layer_step"] = rng.choice([1, 2])
        c["attention_chunk_size"] = rng.choice([4, 7, 8192])
        c["use_qk_norm"] = rng.random() < 0.7
        c["attn_temperature_tuning"] = rng.random() < 0.8
        c["floor_scale"] = rng.choice([2, 5, 8192])
        c["attn_scale"] = rng.choice([0.1, 0.5])
    if mt == "gemma4_text":
        # Gemma 4: sliding and full layers (the last full), the full ones with their own head size
        # and, with attention_k_eq_v, values from the key projection and their own key/value heads;
        # the proportional rope there (a part of the pairs rotating, scaled by a factor); at times
        # per-layer embeddings, and the last layers reusing earlier layers' keys and values (with
        # double-wide MLPs), a final softcap, attention biases, a mixture of experts.
        layers = rng.choice([3, 4, 5])
        types = [rng.choice(["sliding_attention", "full_attention"]) for _ in range(layers - 1)]
        types.append("full_attention")
        c.update(num_hidden_layers=layers, layer_types=types, sliding_window=rng.choice([4, 8]),
                 hidden_activation="gelu_pytorch_tanh", global_head_dim=rng.choice([hd, 24, 32]),
                 attention_k_eq_v=rng.random() < 0.5,
                 num_global_key_value_heads=rng.choice([k for k in [1, 2] if heads % k == 0]),
                 final_logit_softcapping=rng.choice([None, 15.0]), attention_bias=rng.random() < 0.3,
                 hidden_size_per_layer_input=0, num_kv_shared_layers=0)
        # transformers' generate needs per-layer embeddings where layers share keys and values.
        if rng.random() < 0.6:
            c.update(hidden_size_per_layer_input=rng.choice([4, 8]), vocab_size_per_layer_input=512)
            unshared = [i for i in range(1, layers)
                        if set(types[:i]) == set(types)]
            if unshared and rng.random() < 0.7:
                c["num_kv_shared_layers"] = layers - rng.choice(unshared)
                c["use_double_wide_mlp"] = rng.random() < 0.5
        # At times the mixture of experts beside every MLP (the 26B-A4B shape).
        if rng.random() < 0.4:
            experts = rng.choice([3, 4, 6])
            c.update(enable_moe_block=True, num_experts=experts, top_k_experts=rng.choice([1, 2]),
                     moe_intermediate_size=rng.choice([8, 16]))
        rp = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
              "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                 "partial_rotary_factor": rng.choice([0.25, 0.5, 1.0]),
                                 "factor": rng.choice([1.0, 2.0])}}
    if mt in ("phi3", "phi"):
        partial = rng.choice([1.0, 0.5]) if mt == "phi3" else 0.5
        c["partial_rotary_factor"] = partial
        if mt == "phi":
            c["layer_norm_eps"] = 1e-5
        if rp["rope_type"] != "default":
            # Phi-3 takes longrope only; Phi-2 is tested with plain and dynamic.
            if mt == "phi3" or rp["rope_type"] != "dynamic":
                rp = {"rope_theta": 10000.0, "rope_type": "default"}
        rp["partial_rotary_factor"] = partial
    c["rope_parameters"] = rp
    return c


def make_model(rng, mt, folder):
    """A random model of family `mt` saved with the tiny tokenizer: (config dict, model dir)."""
    cfgd = random_config(rng, mt)
    torch.manual_seed(rng.randrange(1 << 30))
    if mt == "mllama":
        vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_global_layers=1,
                      attention_heads=2, image_size=28, patch_size=14, max_num_tiles=1, vision_output_dim=32,
                      intermediate_layers_indices=[0], supported_aspect_ratios=[[1, 1]])
        cfg = AutoConfig.for_model(mt, text_config=cfgd, vision_config=vision, image_token_index=513)
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    elif mt in VL:
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                      out_hidden_size=cfgd["hidden_size"])
        vision.update(fullatt_block_indexes=[0]) if mt == "qwen2_5_vl" else vision.update(
            deepstack_visual_indexes=[0])
        cfg = AutoConfig.for_model(mt, text_config=cfgd, vision_config=vision,
                                   tie_word_embeddings=cfgd["tie_word_embeddings"])
        model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    else:
        cfg = AutoConfig.for_model(mt, **cfgd)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Norms away from 1 and larger weights, so that a mistake shows in the logits.
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
            else:
                p.mul_(3.0)
    mdir = os.path.join(folder, "model")
    model.save_pretrained(mdir)
    for f in os.listdir(TOK):
        shutil.copy(os.path.join(TOK, f), mdir)
    return cfgd, mdir


def rows(rng, folder, n=2, t=20, pad=False):
    ids = [[rng.randrange(4, 512) for _ in range(t)] for _ in range(n)]
    if pad:
        # The pad token (3) as an input: its embedding row takes no gradient.
        ids[0][5] = 3
    labels = [[-100] * 3 + r[3:] for r in ids]
    data = os.path.join(folder, "rows.jsonl")
    with open(data, "w") as f:
        for i, lab in zip(ids, labels):
            f.write(json.dumps({"input_ids": i, "labels": lab}) + "\n")
    return ids, labels, data


def config(folder, mdir, data, extra=""):
    path = os.path.join(folder, "config.yaml")
    with open(path, "w") as f:
        f.write(f"""
output_dir: {folder}/out
tokenizer:
  path: {mdir}
checkpointer:
  checkpoint_dir: {mdir}
  output_dir: {folder}/out
dataset:
  _component_: torchtune.datasets.tokenized_dataset
  source: json
  data_files: {data}
batch_size: 2
epochs: 1
max_steps_per_epoch: 1
shuffle: false
optimizer:
  _component_: torch.optim.SGD
  lr: 1.0
lr_scheduler: null
clip_grad_norm: null
loss:
  _component_: torch.nn.CrossEntropyLoss
device: cpu
dtype: fp32
{extra}""")
    return path


def run(binary, *args):
    r = subprocess.run([binary, *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr.strip().splitlines()[-1][:300])
    return r.stdout


def check_forward(rng, binary, mt, folder):
    cfgd, mdir = make_model(rng, mt, folder)
    auto = AutoModelForImageTextToText if mt in VL else AutoModelForCausalLM
    model = auto.from_pretrained(mdir, dtype=torch.float32).eval()
    ids, labels, data = rows(rng, folder)
    with torch.no_grad():
        want = model(torch.tensor(ids), labels=torch.tensor(labels)).loss.item()
        prompt = ids[0][:8]
        greedy = model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                eos_token_id=None, pad_token_id=3)[0, 8:].tolist()
    out = run(binary, "run", "eval", "--config", config(folder, mdir, data))
    got = json.loads(out.strip().splitlines()[-1])["loss"]
    out = run(binary, "generate", "--model", mdir, "--prompt-ids", ",".join(map(str, prompt)),
              "--max-new-tokens", "10", "--ignore-eos", "--json")
    tokens = json.loads(out.strip().splitlines()[-1])["new_token_ids"]
    rel = abs(got - want) / abs(want)
    return cfgd, rel < 1e-5 and tokens == greedy, f"loss rel {rel:.1e}, greedy {'same' if tokens == greedy else 'DIFFERENT'}"


def linear_targets(model):
    """PEFT's "all-linear" as a list: every linear layer's name but the head's."""
    # Llama 4's router is a Linear whose forward returns (scores, logits): PEFT cannot wrap it.
    return sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and not n.endswith(("lm_head", "feed_forward.router"))})


def save_random_adapter(base, config, folder):
    """A PEFT adapter of `config` on `base` whose B (the embedding's A) is random, so that it
    changes the model, saved with PEFT's defaults under `folder/adapter`; returns that folder."""
    from peft import get_peft_model

    model = get_peft_model(base, config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n or "lora_embedding_A" in n:
                p.copy_(torch.randn_like(p) * 0.1)
    adir = os.path.join(folder, "adapter")
    model.save_pretrained(adir)
    return adir


def check_lora(rng, binary, mt, folder):
    import peft.tuners.lora.torchao as peft_torchao
    from peft import LoraConfig, PeftModel

    peft_torchao.is_torchao_available = lambda: False  # an old torchao would stop PEFT
    cfgd, mdir = make_model(rng, mt, folder)
    dora, rslora, embed, head = (rng.random() < 0.3, rng.random() < 0.3, rng.random() < 0.5,
                                 rng.random() < 0.3)
    # PEFT takes no LoRA bias with DoRA or on the embedding.
    bias = not dora and not embed and rng.random() < 0.4
    base = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32)
    targets = linear_targets(base)
    if embed:
        targets.append("embed_tokens")
    if head:
        targets.append("lm_head")
    adir = save_random_adapter(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                use_dora=dora, use_rslora=rslora, lora_bias=bias),
                             folder)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32),
                                      adir, is_trainable=True)
    ids, labels, data = rows(rng, folder, t=16, pad=embed)
    model(torch.tensor(ids), labels=torch.tensor(labels)).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    run(binary, "run", "lora_finetune_single_device", "--config",
        config(folder, mdir, data, f"model:\n  lora_rank: 4\n  lora_alpha: 8\n"),
        f"checkpointer.adapter_checkpoint={adir}")
    saved = load_file(os.path.join(folder, "out/epoch_0/adapter_model.safetensors"))
    start = load_file(os.path.join(adir, "adapter_model.safetensors"))
    worst, at = 0.0, None
    for k, s in start.items():
        param = (k.replace(".lora_A.weight", ".lora_A.default.weight")
                  .replace(".lora_B.weight", ".lora_B.default.weight")
                  .replace(".lora_B.bias", ".lora_B.default.bias")
                  .replace(".lora_magnitude_vector", ".lora_magnitude_vector.default.weight"))
        if ".lora_embedding_" in k:
            param = k + ".default"
        if ".base_layer." in k:
            # The base weights PEFT saves beside an adapted embedding: frozen, saved as read.
            if not torch.equal(saved[k], s):
                worst, at = float("inf"), k
            continue
        want = s - grads[param]
        e = ((saved[k] - want).norm() / want.norm()).item()
        if e > worst:
            worst, at = e, k
    return cfgd, worst < 1e-4 and set(saved) == set(start), f"dora={dora} rslora={rslora} embed={embed} head={head} bias={bias} worst {worst:.1e} ({at})"


def check_full(rng, binary, mt, folder):
    cfgd, mdir = make_model(rng, mt, folder)
    model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32).train()
    ids, labels, data = rows(rng, folder, t=16)
    model(torch.tensor(ids), labels=torch.tensor(labels)).loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    run(binary, "run", "full_finetune_single_device", "--config", config(folder, mdir, data))
    saved = load_file(os.path.join(folder, "out/epoch_0/model.safetensors"))
    start = load_file(os.path.join(mdir, "model.safetensors"))
    worst, at = 0.0, None
    for k, s in start.items():
        # Buffers (Gemma 4's layer_scalar) are saved as they are.
        want = s - grads[k] if k in grads else s
        e = ((saved.get(k, torch.zeros_like(s)) - want).norm() / want.norm()).item()
        if e > worst:
            worst, at = e, k
    return cfgd, worst < 1e-4 and set(saved) == set(start), f"worst {worst:.1e} ({at})"


LLAMA_CPP = """
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
from check_gguf_export import llama_cpp_logits
np.save(sys.argv[5], llama_cpp_logits(sys.argv[2], json.loads(sys.argv[4]), sys.argv[3] or None))
"""


def llama_cpp_agrees(folder, mt, gguf, ids, want, lora=""):
    """Whether llama.cpp's logits of `ids` through `gguf` (+ the adapter `lora`) are `want`'s,
    and the line saying how close; run in a child process, so that a crash is an exit code, not
    the sweep's end. Gemma's and Phi-2's GELU llama.cpp takes from an f16 table (1e-3)."""
    import numpy as np

    npy = os.path.join(folder, "logits.npy")
    scripts = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", LLAMA_CPP, scripts, gguf, lora, json.dumps(ids), npy],
                       capture_output=True, text=True)
    if r.returncode != 0:
        last = " | ".join(l for l in r.stderr.strip().splitlines() if "error" in l.lower() or "failed" in l.lower())[-400:]
        return False, f"llama.cpp failed (exit {r.returncode}): {last}"
    got = np.load(npy)
    rel = float(np.linalg.norm(got - want) / np.linalg.norm(want))
    tol = 1e-3 if mt in ("gemma", "gemma2", "gemma3_text", "phi") else 1e-5
    return rel < tol, f"llama.cpp rel {rel:.1e}"


def check_gguf(rng, binary, mt, folder):
    cfgd, mdir = make_model(rng, mt, folder)
    ids = [[rng.randrange(4, 512) for _ in range(12)] for _ in range(2)]
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32)
        want = model(torch.tensor(ids)).logits.numpy()
    gguf = os.path.join(folder, "model.gguf")
    r = subprocess.run([binary, "export-gguf", mdir, gguf, "--outtype", "f32"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return cfgd, True, "refused: " + r.stderr.strip().splitlines()[-1][:140]
    if "llama.cpp cannot run it" in r.stderr:
        return cfgd, True, "noted: " + r.stderr.strip().splitlines()[0][:140]
    ok, line = llama_cpp_agrees(folder, mt, gguf, ids, want)
    return cfgd, ok, line


def check_gguf_lora(rng, binary, mt, folder):
    import peft.tuners.lora.torchao as peft_torchao
    from peft import LoraConfig, PeftModel

    peft_torchao.is_torchao_available = lambda: False
    cfgd, mdir = make_model(rng, mt, folder)
    rslora, embed = rng.random() < 0.3, rng.random() < 0.5
    base = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32)
    # At times the token embedding too (refused on a tied base, which counts as agreeing).
    targets = linear_targets(base) + (["embed_tokens"] if embed else [])
    adir = save_random_adapter(base, LoraConfig(r=rng.choice([2, 4]), lora_alpha=8,
                                                target_modules=targets, use_rslora=rslora), folder)
    ids = [[rng.randrange(4, 512) for _ in range(12)] for _ in range(2)]
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32), adir).eval()
        want = peft_model(torch.tensor(ids)).logits.numpy()
    base, lora = os.path.join(folder, "base.gguf"), os.path.join(folder, "lora.gguf")
    r = subprocess.run([binary, "export-gguf", mdir, base, "--outtype", "f32"],
                       capture_output=True, text=True)
    if r.returncode != 0 or "llama.cpp cannot run it" in r.stderr:
        return cfgd, True, "base refused or noted: " + r.stderr.strip().splitlines()[-1][:120]
    r = subprocess.run([binary, "export-gguf", adir, lora, "--base", mdir],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return cfgd, True, "adapter refused: " + r.stderr.strip().splitlines()[-1][:120]
    ok, line = llama_cpp_agrees(folder, mt, base, ids, want, lora)
    return cfgd, ok, f"rslora={rslora} {line}"


def text_model_tensors(cfgd, tensors):
    """A checkpoint's tensors under the names of the text model ferrotune saves: Qwen3-VL's
    `model.language_model.*` and Mllama's `language_model.model.*` become `model.*`; Mllama's
    cross-attention layers (which text alone skips) are left out, the others renumbered, and its
    embedding keeps the text vocabulary's rows."""
    cross = cfgd.get("cross_attention_layers", [])
    out = {}
    for k, v in tensors.items():
        k = k.replace("model.language_model.", "model.").replace("language_model.model.", "model.")
        k = k.replace("language_model.lm_head.", "lm_head.")
        if not (k.startswith("model.") or k.startswith("lm_head.")) or k.startswith("model.vision"):
            continue
        if k.startswith("model.layers."):
            i, rest = k[len("model.layers."):].split(".", 1)
            if int(i) in cross:
                continue
            k = f"model.layers.{int(i) - sum(c < int(i) for c in cross)}.{rest}"
        if k == "model.embed_tokens.weight":
            v = v[: cfgd["vocab_size"]]
        out[k] = v
    return out


def check_packed(rng, binary, mt, folder):
    cfgd, mdir = make_model(rng, mt, folder)
    samples = []
    for _ in range(6):
        n = rng.randrange(5, 21)
        ids = [rng.randrange(4, 512) for _ in range(n)]
        samples.append((ids, [-100] * 2 + ids[2:]))
    data = os.path.join(folder, "rows.jsonl")
    with open(data, "w") as f:
        for ids, labels in samples:
            f.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")
    results = []
    for packed in (False, True):
        sub = os.path.join(folder, "packed" if packed else "plain")
        os.makedirs(sub)
        # One packed row of 128 holds all six samples (at most 120 tokens): one step, as the
        # unpacked batch of six.
        extra = "  packed: true\n  max_seq_len: 128\n" if packed else ""
        cfg = config(sub, mdir, data)
        text = open(cfg).read().replace(f"  data_files: {data}\n", f"  data_files: {data}\n{extra}")
        text = text.replace("batch_size: 2", "batch_size: 1" if packed else "batch_size: 6")
        open(cfg, "w").write(text)
        run(binary, "run", "full_finetune_single_device", "--config", cfg)
        loss = json.loads(open(os.path.join(sub, "out/logs/metrics.jsonl")).readline())["loss"]
        results.append((loss, load_file(os.path.join(sub, "out/epoch_0/model.safetensors"))))
    (l0, w0), (l1, w1) = results
    # What ferrotune saves of a vision-language checkpoint is its text model.
    start = text_model_tensors(cfgd, load_file(os.path.join(mdir, "model.safetensors")))
    # A key bias shifts every score of a query row alike, which the softmax cancels: its true
    # gradient is zero, so how far it moved is rounding noise, and so is its relative difference.
    moved = lambda k: ((w0[k] - w1[k]).norm() / ((w0[k] - start[k]).norm() + 1e-30)).item()
    # Gemma 4's router: with one expert per token its renormalized weight is 1, so the router's
    # projection and scale have a zero true gradient too; otherwise their gradients (and the
    # per-expert scales') are sums of per-token terms that largely cancel, leaving f32 noise of a
    # few 1e-4 of them (the `full` mode checks them against PyTorch).
    router = lambda k: ".router." in k
    zero = lambda k: k.endswith("k_proj.bias") or (
        router(k) and cfgd.get("top_k_experts") == 1 and not k.endswith("per_expert_scale"))
    worst = max((moved(k) / (10 if router(k) else 1), k) for k in w0 if not zero(k))
    rel = abs(l0 - l1) / abs(l0)
    return cfgd, rel < 1e-5 and worst[0] < 1e-4, f"loss rel {rel:.1e}, step worst {worst[0]:.1e} ({worst[1]})"


def eval_loss(binary, folder, mdir, data, adapter):
    """`run eval`'s loss of `mdir` with the adapter folder `adapter` on the rows `data`."""
    sub = tempfile.mkdtemp(dir=folder)
    out = run(binary, "run", "eval", "--config", config(sub, mdir, data),
              f"checkpointer.adapter_checkpoint={adapter}")
    return json.loads(out.strip().splitlines()[-1])["loss"]


def peft_loss(mdir, adapter, ids, labels):
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).eval()
    with torch.no_grad():
        return model(torch.tensor(ids), labels=torch.tensor(labels)).loss.item()


def check_moe_peft(rng, binary, mt, folder):
    import peft.tuners.lora.torchao as peft_torchao
    from peft import LoraConfig

    peft_torchao.is_torchao_available = lambda: False
    cfgd, mdir = make_model(rng, mt, folder)
    ids, labels, data = rows(rng, folder, t=16)
    # 1. A PEFT adapter on transformers 5's fused experts / router (`target_parameters`), maybe
    # beside the attention by module name: ferrotune's eval loss is PEFT's.
    params = [p for p, keep in (("mlp.experts.gate_up_proj", rng.random() < 0.7),
                                ("mlp.experts.down_proj", rng.random() < 0.7),
                                (f"mlp.{'router' if mt == 'phimoe' else 'gate'}.weight",
                                 rng.random() < 0.3)) if keep]
    params = params or ["mlp.experts.down_proj"]
    r = rng.choice([2, 3, 4])
    lc = LoraConfig(r=r, lora_alpha=2 * r, use_rslora=rng.random() < 0.3,
                    target_modules=["q_proj"] if rng.random() < 0.5 else [],
                    target_parameters=params,
                    rank_pattern={"down_proj": r + 1} if rng.random() < 0.3 else {})
    base = AutoModelForCausalLM.from_pretrained(mdir, dtype=torch.float32)
    adir = save_random_adapter(base, lc, folder)
    want = peft_loss(mdir, adir, ids, labels)
    got = eval_loss(binary, folder, mdir, data, adir)
    rel1 = abs(got - want) / abs(want)
    # 2. ferrotune's LoRA on every expert (and the attention), one SGD step from a fresh adapter,
    # written for transformers 5 (`transformers5/`): PEFT there gives the loss ferrotune gives with
    # its own per-expert adapter.
    run(binary, "run", "lora_finetune_single_device", "--config",
        config(folder, mdir, data, f"model:\n  lora_rank: {r}\n  lora_alpha: {2 * r}\n"
                                   "  lora_attn_modules: [q_proj, v_proj]\n  apply_lora_to_mlp: true\n"))
    saved = os.path.join(folder, "out/epoch_0")
    ours = eval_loss(binary, folder, mdir, data, saved)
    theirs = peft_loss(mdir, os.path.join(saved, "transformers5"), ids, labels)
    rel2 = abs(ours - theirs) / abs(theirs)
    return cfgd, rel1 < 1e-5 and rel2 < 1e-5, (f"target_parameters {params} r={r}: loss rel {rel1:.1e}; "
                                               f"transformers5/: loss rel {rel2:.1e}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["forward", "lora", "full", "gguf", "gguf-lora", "packed", "moe-peft"])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--types", default=",".join(FAMILIES))
    ap.add_argument("--binary", default=os.path.join(ROOT, "target", "release", "ferrotune"))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    check = {"forward": check_forward, "lora": check_lora, "full": check_full,
             "gguf": check_gguf, "gguf-lora": check_gguf_lora, "packed": check_packed,
             "moe-peft": check_moe_peft}[args.mode]
    bad = total = 0
    for mt in args.types.split(","):
        if args.mode in ("lora", "full", "gguf-lora") and mt in MOE:
            continue
        if args.mode == "moe-peft" and mt not in MOE:
            continue
        if args.mode not in ("forward", "packed") and mt in VL:
            continue
        for trial in range(args.trials):
            folder = tempfile.mkdtemp()
            try:
                cfgd, ok, line = check(rng, args.binary, mt, folder)
            except RuntimeError as e:
                cfgd, ok, line = None, False, f"ferrotune failed: {e}"
            total += 1
            bad += not ok
            print(f"{mt:12} {trial} {line}" + ("" if ok else f"   <-- {json.dumps(cfgd)}"), flush=True)
            shutil.rmtree(folder)
    print(f"{total - bad}/{total} agree")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
