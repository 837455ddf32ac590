#!/usr/bin/env python3
"""Writes the reference data that crates/ferrotune-models/tests/it/gguf.rs checks our GGUF loader against.

  tests/fixtures/gguf/smollm2_reference.safetensors + smollm2_reference.json
      SmolLM2-135M-Instruct.Q4_1.gguf loaded by transformers (AutoModelForCausalLM with gguf_file=...,
      float32): selected rows of a few weights (each `NAME` with its row indices in `NAME.rows`) and
      the config values transformers derived from the GGUF metadata.
  tests/fixtures/gguf/gemma2_tiny.gguf, gemma3_tiny.gguf + *_reference.safetensors
      Tiny random Gemma 2 / Gemma 3 checkpoints written as llama.cpp's convert_hf_to_gguf.py does (F32,
      llama.cpp tensor names, norm weights stored as 1 + w, softcaps and rope scaling in the metadata), with
      `input_ids` and the source (safetensors) model's `logits` for them. transformers loads the Gemma 2 file
      to the same logits (checked here); for Gemma 3 its GGUF loader drops the rope scaling (linear 8 on the
      global layers), which llama.cpp applies, so the reference is the source model.
  tests/fixtures/gguf/{mixtral,mixtral_legacy,mixtral_q8,qwen2_moe,qwen3_moe,phi2,phi2_qkv}_tiny.gguf
      The tiny Mixtral, Qwen2-MoE, Qwen3-MoE and Phi-2 checkpoints of tests/fixtures/models as GGUF (stacked,
      per-expert and Q8_0 gate+up experts; separate and fused Phi-2 qkv), with the source models' logits.
  tests/fixtures/gguf/smollm3_tiny.gguf + smollm3_tiny_reference.safetensors
      A tiny 4-layer SmolLM3 (default NoPE pattern) as GGUF, with the source model's logits.
  tests/fixtures/gguf/deepseek_v2_tiny.gguf, deepseek_v3_tiny.gguf, gpt_oss_tiny.gguf + *_reference.safetensors
      The tiny DeepSeek-V2/V3 and gpt-oss checkpoints (changed where a `deepseek2` file cannot carry them: see
      deepseek2_ggufs) through llama.cpp's own convert_hf_to_gguf.py (LLAMA_CPP names its folder), with
      the changed checkpoints' logits.
  tests/fixtures/gguf/qwen3_5_tiny.gguf (and Q8_0: qwen3_5_q8_tiny.gguf), qwen3_5_moe_tiny.gguf, qwen3_next_tiny.gguf
  + *_reference.safetensors
      The tiny Qwen3.5 (dense, MoE) and Qwen3-Next checkpoints through llama.cpp's own convert_hf_to_gguf.py
      (`qwen35`, `qwen35moe`, `qwen3next`; Qwen3-Next's every layer made sparse with renormalized
      top-k weights, as llama.cpp computes it: see qwen35_ggufs), with the (changed) checkpoints' logits and
      greedy tokens.
  tests/fixtures/gguf/gpt_oss_mxfp4_tiny.gguf + gpt_oss_mxfp4_tiny_reference.safetensors
      tests/fixtures/gpt_oss_mxfp4/model (gpt-oss with OpenAI's MXFP4 experts, `*_blocks` / `*_scales`),
      changed as gpt_oss is for llama.cpp, through llama.cpp's convert_hf_to_gguf.py, which repacks the
      experts as GGML type 39 MXFP4; with transformers' logits of the changed checkpoint (it dequantizes them).
  tests/fixtures/gguf/mxfp4_reference.safetensors
      `raw`: random MXFP4 blocks (scale bytes 0..252, the subnormal halves among them) and `expected`:
      gguf-py's `gguf.quants.dequantize` of them (ggml's kvalues_mxfp4 and half-scale convention).
  tests/fixtures/gguf/mxfp4_moe_reference.safetensors
      llama-quantize's MXFP4_MOE of the converter's f32 file of tests/fixtures/gpt_oss_mxfp4/model dequantized
      (float experts), made with gguf-py's quantizers: the experts (3-D `ffn_*_exps.weight`) MXFP4, every other
      matrix named `weight` Q8_0 but the router (`ffn_gate_inp`), vectors and biases as they are; per tensor its
      bytes (`NAME`) and GGML type (`NAME.type`).
  tests/fixtures/gguf/quant_reference.safetensors
      For each ggml type, `TYPE.raw` (the bytes of a [4, 256] tensor in that type) and
      `TYPE.expected` (what the python `gguf` package's `gguf.quants.dequantize` makes of them).

Usage: python3 scripts/make_gguf_fixtures.py [--gemma-only | --moe-phi-only | --smollm3-only | --deepseek2-only | --qwen35-only | --mxfp4-only]   (needs torch, transformers, accelerate, gguf, numpy, safetensors;
the GGUF comes from scripts/fetch-assets.sh, FERROTUNE_ASSETS overrides its folder)
"""

import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "gguf"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def assets_dir() -> Path:
    if os.environ.get("FERROTUNE_ASSETS"):
        return Path(os.environ["FERROTUNE_ASSETS"])
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "ferrotune" / "assets"


def smollm2_reference() -> None:
    import torch
    import transformers
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    folder = assets_dir()
    if not (folder / GGUF_NAME).is_file():
        sys.exit(f"{folder / GGUF_NAME} is missing: run scripts/fetch-assets.sh")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.float32)
    sd = model.state_dict()
    cfg = model.config

    # Rows chosen to cross head boundaries: q/k rows are un-permuted per head (head_dim 64), so rows
    # 0..4 and 30..34 of head 0 and the first rows of later heads all come from different GGUF rows.
    picks = {"model.embed_tokens.weight": [0, 1, 2, 100, 49151], "model.norm.weight": None}
    for layer in (0, 29):
        p = f"model.layers.{layer}"
        picks.update({
            f"{p}.self_attn.q_proj.weight": [0, 1, 2, 3, 30, 31, 32, 33, 64, 127, 575],
            f"{p}.self_attn.k_proj.weight": [0, 1, 2, 3, 31, 32, 65, 191],
            f"{p}.self_attn.v_proj.weight": [0, 1, 2, 3],
            f"{p}.self_attn.o_proj.weight": [0, 1, 2, 3],
            f"{p}.mlp.gate_proj.weight": [0, 1],
            f"{p}.mlp.up_proj.weight": [0, 1],
            f"{p}.mlp.down_proj.weight": [0, 1, 2, 3],
            f"{p}.input_layernorm.weight": None,
            f"{p}.post_attention_layernorm.weight": None,
        })
    tensors = {}
    for name, rows in picks.items():
        t = sd[name].detach().to(torch.float32).numpy()
        if rows is None:
            tensors[name] = np.ascontiguousarray(t)
        else:
            tensors[name] = np.ascontiguousarray(t[rows])
            tensors[name + ".rows"] = np.asarray(rows, dtype=np.int64)
    OUT.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT / "smollm2_reference.safetensors"))

    rope = getattr(cfg, "rope_parameters", None) or {}
    config = {
        "transformers_version": transformers.__version__,
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": rope.get("rope_theta", getattr(cfg, "rope_theta", None)),
        "rope_type": rope.get("rope_type", "default"),
        "hidden_act": cfg.hidden_act,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "tensor_names": sorted(sd.keys()),
    }
    (OUT / "smollm2_reference.json").write_text(json.dumps(config, indent=1) + "\n")


# Byte offsets of the f16 scale fields in one block of each type (ggml's block layouts); the rest
# of each block is random bits, so every code path of the dequantizer is exercised.
F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
}


def quant_reference() -> None:
    from gguf import GGMLQuantizationType as T
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    rng = np.random.default_rng(1234)
    rows, cols = 4, 256
    out = {}
    for name in ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                 "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]:
        qtype = T[name]
        block, size = GGML_QUANT_SIZES[qtype]
        n_blocks = rows * cols // block
        if name in ("F32", "F16"):
            vals = rng.standard_normal(rows * cols).astype(np.float32 if name == "F32" else np.float16)
            raw = vals.view(np.uint8)
        elif name == "BF16":
            vals = rng.standard_normal(rows * cols).astype(np.float32)
            raw = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        else:
            raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
            for off in F16_FIELDS[name]:
                # Scales of either sign, small enough that the values stay near [-10, 10].
                scale = (rng.uniform(0.005, 0.05, n_blocks) * rng.choice([-1, 1], n_blocks))
                raw[:, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
            raw = raw.reshape(-1)
        raw = np.ascontiguousarray(raw.reshape(rows, -1))
        expected = dequantize(raw, qtype).astype(np.float32).reshape(rows, cols)
        assert np.isfinite(expected).all(), name
        out[f"{name}.raw"] = raw
        out[f"{name}.expected"] = np.ascontiguousarray(expected)
    OUT.mkdir(parents=True, exist_ok=True)
    save_file(out, str(OUT / "quant_reference.safetensors"))


# The prompt every GGUF fixture's reference logits are computed for.
INPUT_IDS = [[5, 9, 44, 7, 100, 13, 250, 17, 300, 21, 66, 77, 480, 11]]

# llama.cpp's names for transformers' top-level tensors and decoder-layer modules (`blk.N.*`), as
# convert_hf_to_gguf.py maps them. Gemma 2/3 name their four norms differently (GEMMA_NORMS).
GGUF_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm",
                  "model.final_layernorm": "output_norm", "lm_head": "output"}
GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.dense": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
    "mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp"}
GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_tensor_name(hf_name: str, layer_names: dict) -> str:
    """The GGUF name of a transformers tensor (not an expert's)."""
    mod, suffix = hf_name.rsplit(".", 1)
    if mod in GGUF_TOP_NAMES:
        return f"{GGUF_TOP_NAMES[mod]}.{suffix}"
    _, _, i, rest = mod.split(".", 3)
    return f"blk.{i}.{layer_names[rest]}.{suffix}"


def llama_cpp_permute(w, n_head):
    """convert_hf_to_gguf.py's q/k row permutation for llama.cpp's interleaved RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def start_gguf(path: Path, arch: str, name: str, c):
    """A GGUF writer with the metadata every fixture starts with: name, sizes, heads."""
    import gguf
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny {name}")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    return w


def finish_gguf(w, path: Path, tensors, quantized=()) -> None:
    """Ends what start_gguf began: the special token ids, `tensors` ((name, array) pairs, written
    as F32 in order) and `quantized` ((name, Q8_0 bytes) pairs); writes the file world-readable."""
    import gguf
    w.add_bos_token_id(0)
    w.add_eos_token_id(2)
    w.add_pad_token_id(3)
    for g, a in tensors:
        w.add_tensor(g, np.ascontiguousarray(a, dtype=np.float32))
    for g, q in quantized:
        w.add_tensor(g, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.chmod(path, 0o644)


def save_reference(kind: str, logits, extra=None) -> None:
    """`{kind}_tiny_reference.safetensors`: INPUT_IDS and the source model's logits for them (and
    `extra` tensors)."""
    import torch
    from safetensors.torch import save_file
    ref = OUT / f"{kind}_tiny_reference.safetensors"
    save_file({"input_ids": torch.tensor(INPUT_IDS, dtype=torch.int64), "logits": logits,
               **(extra or {})}, str(ref))
    os.chmod(ref, 0o644)  # safetensors writes 0600 files


def gemma_family_ggufs() -> None:
    import tempfile

    import gguf
    import torch
    from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

    sys.path.insert(0, str(ROOT / "scripts"))
    import make_model_fixtures as mf

    def build(kind):
        common = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=0,
                      eos_token_id=2, pad_token_id=3, tie_word_embeddings=True, sliding_window=5,
                      hidden_activation="gelu_pytorch_tanh")
        if kind == "gemma2":
            # head_dim 256 and the default caps: what transformers' GGUF loader assumes (it reads neither
            # query_pre_attn_scalar nor the caps), so its load of the file is a second reference.
            cfg = Gemma2Config(num_hidden_layers=2, head_dim=256, query_pre_attn_scalar=256,
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)
        else:
            # Six layers: the default pattern makes layer 5 full attention (global rope, linear 8).
            cfg = Gemma3TextConfig(num_hidden_layers=6, head_dim=32, query_pre_attn_scalar=32,
                                   rope_parameters={
                                       "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                                   **common)
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        mf.init_weights(m, 7 if kind == "gemma2" else 8, gemma_norm=True, embed_std=mf.EMBED_STD_SANDWICH)
        return m

    names = {**GGUF_LAYER_NAMES, **GEMMA_NORMS}

    def write(m, kind, path):
        c = m.config
        w = start_gguf(path, kind, kind, c)
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_sliding_window(c.sliding_window)
        w.add_vocab_size(c.vocab_size)
        if kind == "gemma2":
            w.add_rope_freq_base(10000.0)
            w.add_float32("gemma2.attn_logit_softcapping", 50.0)
            w.add_float32("gemma2.final_logit_softcapping", 30.0)
        else:
            w.add_rope_freq_base(1e6)
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(8.0)
        tensors = []
        for n, t in m.state_dict().items():
            if n == "lm_head.weight":
                continue  # tied
            a = t.float().numpy().copy()
            if n.endswith("norm.weight"):
                a = a + 1.0
            tensors.append((gguf_tensor_name(n, names), a))
        finish_gguf(w, path, tensors)

    ids = torch.tensor(INPUT_IDS)
    for kind in ["gemma2", "gemma3"]:
        m = build(kind)
        path = OUT / f"{kind}_tiny.gguf"
        write(m, kind, path)
        with torch.no_grad():
            logits = m(ids).logits.float().contiguous()
        if kind == "gemma2":
            with tempfile.TemporaryDirectory() as tmp:
                import shutil
                shutil.copy(path, Path(tmp) / path.name)
                hf = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=path.name, dtype=torch.float32).eval()
                with torch.no_grad():
                    err = (hf(ids).logits - logits).abs().max().item()
            assert err <= 1e-5, f"transformers' load of {path.name} differs by {err}"
        save_reference(kind, logits)
        print(f"{path.name}: {path.stat().st_size / 1024:.0f} KB, logit std {logits.std():.3f}")


def moe_and_phi2_ggufs() -> None:
    """Mixtral, Qwen2-MoE, Qwen3-MoE and Phi-2 GGUFs written from the tiny HF fixtures in
    tests/fixtures/models as convert_hf_to_gguf.py writes them (F32): stacked expert tensors
    (`ffn_{gate,up,down}_exps`, [experts, out, in] in PyTorch order), the router `ffn_gate_inp`,
    Qwen2-MoE's shared expert (`ffn_*_shexp`, its gate `ffn_gate_inp_shexp` as a vector), dense
    layers of a sparse model (Qwen3-MoE's `mlp_only_layers`) as plain `ffn_*`; Mixtral as
    `llama` with q/k rows permuted; Phi-2 with LayerNorm biases and `ffn_up`/`ffn_down` for
    fc1/fc2. Two older layouts are written too: Mixtral with one tensor per expert
    (`ffn_gate.E`, llama.cpp before April 2024) and Phi-2 with a fused `attn_qkv`. The reference
    is each source checkpoint's logits for `input_ids` (transformers' GGUF loader reads neither
    moe_intermediate_size nor the shared expert's size, so it cannot load these)."""
    import gguf
    import torch
    from transformers import AutoModelForCausalLM

    def write(kind, arch, src, path, variant=""):
        legacy = variant in ("legacy", "qkv")
        m = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        c = m.config
        # The checkpoint's own tensors (per-expert, as on the Hub), not transformers 5's fused experts.
        from safetensors.numpy import load_file
        sd = {k: v.astype(np.float32) for k, v in load_file(str(Path(src) / "model.safetensors")).items()}
        w = start_gguf(path, arch, kind, c)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        rope = c.rope_parameters
        w.add_rope_freq_base(rope["rope_theta"])
        if kind == "phi2":
            w.add_layer_norm_eps(c.layer_norm_eps)
            w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim))
        else:
            w.add_layer_norm_rms_eps(c.rms_norm_eps)
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
            if arch == "llama":
                w.add_rope_dimension_count(head_dim)
            w.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
            w.add_expert_used_count(c.num_experts_per_tok)
            if kind != "mixtral":
                w.add_expert_feed_forward_length(c.moe_intermediate_size)
            if kind == "qwen2_moe":
                w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
        w.add_vocab_size(c.vocab_size)
        out = {}
        expert_parts = {"w1": "gate", "w3": "up", "w2": "down",
                        "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
        experts = {}
        for n, a in sd.items():
            if ".experts." in n:
                i = n.split(".")[2]
                e, part = n.split(".experts.")[1].split(".")[:2]
                experts.setdefault((int(i), expert_parts[part]), {})[int(e)] = a
                continue
            if n.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")) and arch == "llama":
                a = llama_cpp_permute(a, c.num_attention_heads)
            if n.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")) and arch == "llama":
                a = llama_cpp_permute(a, c.num_key_value_heads)
            if n.endswith("mlp.shared_expert_gate.weight"):
                a = a.reshape(-1)
            out[gguf_tensor_name(n, GGUF_LAYER_NAMES)] = a
        quantized = {}
        for (i, part), per in experts.items():
            if legacy:
                for e, a in per.items():
                    out[f"blk.{i}.ffn_{part}.{e}.weight"] = a
            elif variant == "q8" and part != "down":
                # Gate and up of every expert as one Q8_0 `ffn_gate_up_exps` (gate rows first);
                # the reference model gets the dequantized values.
                if part == "gate":
                    up = experts[(i, "up")]
                    both = np.stack([np.concatenate([per[e], up[e]]) for e in sorted(per)])
                    q = gguf.quants.quantize(both, gguf.GGMLQuantizationType.Q8_0)
                    quantized[f"blk.{i}.ffn_gate_up_exps.weight"] = q
                    deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(both.shape)
                    half = both.shape[1] // 2
                    prefix = f"model.layers.{i}.block_sparse_moe.experts"
                    for e in sorted(per):
                        sd[f"{prefix}.{e}.w1.weight"] = deq[e, :half]
                        sd[f"{prefix}.{e}.w3.weight"] = deq[e, half:]
            else:
                out[f"blk.{i}.ffn_{part}_exps.weight"] = np.stack([per[e] for e in sorted(per)])
        if legacy and kind == "phi2":
            for i in range(c.num_hidden_layers):
                for s in ("weight", "bias"):
                    parts = [out.pop(f"blk.{i}.attn_{x}.{s}") for x in "qkv"]
                    out[f"blk.{i}.attn_qkv.{s}"] = np.concatenate(parts, axis=0)
        finish_gguf(w, path, sorted(out.items()), sorted(quantized.items()))
        if quantized:
            import shutil
            import tempfile
            from safetensors.numpy import save_file as save_np
            with tempfile.TemporaryDirectory() as tmp:
                shutil.copy(Path(src) / "config.json", tmp)
                save_np({k: np.ascontiguousarray(v) for k, v in sd.items()}, str(Path(tmp) / "model.safetensors"))
                m = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
        return m

    ids = torch.tensor(INPUT_IDS)
    models = ROOT / "tests" / "fixtures" / "models"
    for kind, arch, src, variant in [("mixtral", "llama", "mixtral", ""),
                                     ("mixtral_legacy", "llama", "mixtral", "legacy"),
                                     ("mixtral_q8", "llama", "mixtral", "q8"),
                                     ("qwen2_moe", "qwen2moe", "qwen2_moe", ""),
                                     ("qwen3_moe", "qwen3moe", "qwen3_moe", ""),
                                     ("phi2", "phi2", "phi2", ""),
                                     ("phi2_qkv", "phi2", "phi2", "qkv")]:
        path = OUT / f"{kind}_tiny.gguf"
        m = write(src, arch, models / src / "model", path, variant)
        with torch.no_grad():
            logits = m(ids).logits.float().contiguous()
        if variant in ("", "q8"):  # the older layouts share their source's reference
            save_reference(kind, logits)
        print(f"{path.name}: {path.stat().st_size / 1024:.0f} KB, logit std {logits.std():.3f}")



def smollm3_gguf() -> None:
    """A tiny SmolLM3 GGUF as convert_hf_to_gguf.py writes it (architecture `smollm3`, llama's
    tensor names with q/k rows permuted, F32), from a 4-layer checkpoint with SmolLM3's default
    NoPE pattern (every fourth layer without RoPE, which llama.cpp assumes: GGUF has no key for
    it), and the source model's logits for `input_ids`."""
    import torch
    from transformers import AutoModelForCausalLM, SmolLM3Config

    sys.path.insert(0, str(ROOT / "scripts"))
    import make_model_fixtures as mf

    cfg = SmolLM3Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=2, pad_token_id=3,
                        tie_word_embeddings=True,
                        rope_parameters={"rope_type": "default", "rope_theta": 5e6})
    assert list(cfg.no_rope_layers) == [1, 1, 1, 0], cfg.no_rope_layers
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    mf.init_weights(m, 9, gemma_norm=False, embed_std=mf.EMBED_STD_TIED)

    path = OUT / "smollm3_tiny.gguf"
    w = start_gguf(path, "smollm3", "smollm3", cfg)
    w.add_rope_freq_base(5e6)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_vocab_size(cfg.vocab_size)
    tensors = []
    for n, t in m.state_dict().items():
        if n == "lm_head.weight":
            continue  # tied
        a = t.float().numpy().copy()
        if n.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            a = llama_cpp_permute(a, cfg.num_attention_heads)
        elif n.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            a = llama_cpp_permute(a, cfg.num_key_value_heads)
        tensors.append((gguf_tensor_name(n, GGUF_LAYER_NAMES), a))
    finish_gguf(w, path, tensors)
    with torch.no_grad():
        logits = m(torch.tensor(INPUT_IDS)).logits.float().contiguous()
    save_reference("smollm3", logits)
    print(f"{path.name}: {path.stat().st_size / 1024:.0f} KB, logit std {logits.std():.3f}")

# What a tiny DeepSeek checkpoint changes so that a `deepseek2` file can say what transformers
# computes (see deepseek2_ggufs).
DEEPSEEK2_EDITS = {
    "deepseek_v2": {"topk_method": "greedy", "n_group": 1, "topk_group": 1},
    "deepseek_v3": {"scoring_func": "sigmoid", "topk_method": "noaux_tc"},
}

# What the tiny gpt-oss checkpoint changes so that a `gpt-oss` file can say what transformers
# computes: llama.cpp fixes the SwiGLU's limit at 7 and rounds YaRN's correction range.
GPT_OSS_EDITS = {"swiglu_limit": 7.0, "swiglu_alpha": 1.702}


def deepseek2_source(kind: str, tmp: Path) -> Path:
    """A copy of tests/fixtures/models/<kind>/model under `tmp` with DEEPSEEK2_EDITS (or, for
    gpt_oss, GPT_OSS_EDITS and a truncated YaRN) applied and `mscale` set to `mscale_all_dim`."""
    import shutil
    model_dir = tmp / kind
    src = ROOT / "tests" / "fixtures" / ("gpt_oss_mxfp4" if kind == "gpt_oss_mxfp4" else f"models/{kind}") / "model"
    shutil.copytree(src, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(DEEPSEEK2_EDITS[kind] if kind in DEEPSEEK2_EDITS else GPT_OSS_EDITS)
    rope = cfg.get("rope_parameters", {})
    if kind.startswith("gpt_oss"):
        rope["truncate"] = True
    if "mscale_all_dim" in rope:
        rope["mscale"] = rope["mscale_all_dim"]
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return model_dir


def run_llama_cpp_converter(src: str, model_dir: Path, out: Path, tmp: Path, outtype: str = "f32",
                            extra: tuple = ()) -> None:
    """llama.cpp's convert_hf_to_gguf.py (from the llama.cpp folder `src`), unchanged but for the
    tiny fixtures' unknown BPE pre-tokenizer, reported as "default"."""
    import subprocess
    shim = tmp / "llama_cpp_shim.py"
    shim.write_text(
        "import sys, runpy\n"
        "src = sys.argv.pop(1)\n"
        "sys.path.insert(0, src)\n"
        "sys.argv[0] = src + '/convert_hf_to_gguf.py'\n"
        "import conversion.base as base\n"
        "base.TextModel.get_vocab_base_pre = lambda self, tok: 'default'\n"
        "runpy.run_path(src + '/convert_hf_to_gguf.py', run_name='__main__')\n"
    )
    subprocess.run([sys.executable, str(shim), src, str(model_dir), "--outtype", outtype,
                    "--outfile", str(out), *extra], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def deepseek2_ggufs() -> None:
    """DeepSeek-V2 and -V3 as llama.cpp's own convert_hf_to_gguf.py writes them (architecture
    `deepseek2`, F32: `attn_kv_b` split into `attn_k_b` (transposed) and `attn_v_b`, stacked
    experts, `exp_probs_b`), run on copies of the tiny checkpoints in tests/fixtures/models changed
    only where a `deepseek2` file cannot say what transformers computes: V2 routes `greedy` (llama.cpp
    ranks expert groups by their two best scores' sum, V2's `group_limited_greedy` by its best), V3's
    config names `scoring_func: sigmoid` (as the released configs do; without it the converter writes
    no gating function and llama.cpp routes by softmax) and `mscale` equals `mscale_all_dim` (llama.cpp
    assumes so). gpt-oss too (`gpt-oss`: gate/up split out of the fused interleaved experts,
    sinks, biases), with llama.cpp's fixed SwiGLU limit 7 and YaRN's rounded correction range
    (`truncate`), which its file cannot say otherwise. The reference logits are the changed
    checkpoints' in transformers.

    The converter is llama.cpp's (LLAMA_CPP=<a llama.cpp checkout: convert_hf_to_gguf.py,
    conversion/, gguf-py/>), run unchanged but for the tiny fixtures' unknown BPE pre-tokenizer,
    reported as "default" (tensors and hyperparameters do not depend on it)."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    src = os.environ.get("LLAMA_CPP")
    if not src or not (Path(src) / "convert_hf_to_gguf.py").is_file():
        sys.exit("set LLAMA_CPP to a llama.cpp source folder (convert_hf_to_gguf.py, conversion/, gguf-py/): export LLAMA_CPP=\"$(scripts/fetch-llamacpp-src.sh)\"")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in [*DEEPSEEK2_EDITS, "gpt_oss"]:
            model_dir = deepseek2_source(kind, Path(tmp))
            path = OUT / f"{kind}_tiny.gguf"
            run_llama_cpp_converter(src, model_dir, path, Path(tmp))
            os.chmod(path, 0o644)
            m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            with torch.no_grad():
                logits = m(torch.tensor(INPUT_IDS)).logits.float().contiguous()
            save_reference(kind, logits)
            print(f"{path.name}: {path.stat().st_size / 1024:.0f} KB, logit std {logits.std():.3f}")


# The Qwen3.5 / Qwen3-Next fixtures and llama.cpp's architecture for each.
QWEN35_KINDS = {"qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next"}
# Greedy decoding in the Qwen3.5 references: prompt length, new tokens.
QWEN35_PROMPT, QWEN35_NEW = 6, 8


def qwen35_source(kind: str, tmp: Path) -> Path:
    """tests/fixtures/models/<kind>/model, or for qwen3_next a copy under `tmp` that llama.cpp's
    `qwen3next` can say: every layer sparse (the dense `mlp_only_layers` layer 1 takes layer 0's
    experts, router and shared expert) and the top-k weights renormalized (`norm_topk_prob`), as
    llama.cpp always computes it. The Rust tests make the same copy."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    src = ROOT / "tests" / "fixtures" / "models" / kind / "model"
    if kind != "qwen3_next":
        return src
    model_dir = tmp / kind
    shutil.copytree(src, model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update({"mlp_only_layers": [], "norm_topk_prob": True})
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    w = load_file(str(model_dir / "model.safetensors"))
    for n in [n for n in w if n.startswith("model.layers.1.mlp.")]:
        del w[n]
    for n in [n for n in w if n.startswith("model.layers.0.mlp.")]:
        w[n.replace("model.layers.0.", "model.layers.1.")] = w[n].clone()
    save_file({n: t.contiguous() for n, t in w.items()}, str(model_dir / "model.safetensors"),
              metadata={"format": "pt"})
    return model_dir


def qwen35_ggufs() -> None:
    """Qwen3.5 (dense and MoE) and Qwen3-Next as llama.cpp's own convert_hf_to_gguf.py writes them
    (`qwen35`, `qwen35moe`, `qwen3next`, F32, `--no-mtp`: the tiny checkpoints have no
    multi-token-prediction layers): norms as 1 + w, `ssm_a = -exp(A_log)`, Qwen3.5's value heads
    tiled, Qwen3-Next's `in_proj_qkvz` split, stacked experts. Qwen3-Next's checkpoint is changed
    as qwen35_source says. The reference logits are the (changed) checkpoints' in transformers."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    src = os.environ.get("LLAMA_CPP")
    if not src or not (Path(src) / "convert_hf_to_gguf.py").is_file():
        sys.exit("set LLAMA_CPP to a llama.cpp source folder (convert_hf_to_gguf.py, conversion/, gguf-py/): export LLAMA_CPP=\"$(scripts/fetch-llamacpp-src.sh)\"")
    with tempfile.TemporaryDirectory() as tmp:
        for kind in QWEN35_KINDS:
            model_dir = qwen35_source(kind, Path(tmp))
            path = OUT / f"{kind}_tiny.gguf"
            run_llama_cpp_converter(src, model_dir, path, Path(tmp), extra=("--no-mtp",))
            os.chmod(path, 0o644)
            if kind == "qwen3_5":
                # The reader's Q8_0 blocks (the converter quantizes the matrices).
                q8 = OUT / f"{kind}_q8_tiny.gguf"
                run_llama_cpp_converter(src, model_dir, q8, Path(tmp), "q8_0", extra=("--no-mtp",))
                os.chmod(q8, 0o644)
            m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            with torch.no_grad():
                logits = m(torch.tensor(INPUT_IDS)).logits.float().contiguous()
                # Greedy decoding from the first QWEN35_PROMPT ids, each step over the whole
                # sequence; the smallest gap between the best two logits says how safe it is.
                seq, margin = list(INPUT_IDS[0][:QWEN35_PROMPT]), float("inf")
                for _ in range(QWEN35_NEW):
                    last = m(torch.tensor([seq])).logits[0, -1].float()
                    top = torch.topk(last, 2).values
                    margin = min(margin, float(top[0] - top[1]))
                    seq.append(int(last.argmax()))
            save_reference(kind, logits, {"greedy": torch.tensor([seq], dtype=torch.int64)})
            print(f"{path.name}: {path.stat().st_size / 1024:.0f} KB, logit std {logits.std():.3f}, "
                  f"greedy {seq[QWEN35_PROMPT:]} (smallest top-2 margin {margin:.4f})")


def mxfp4_reference() -> None:
    """`mxfp4_reference.safetensors`: `raw` (u8, 64 MXFP4 blocks of 17 bytes: the E8M0 scale byte, then
    16 bytes of nibbles) and `expected` (f32, 64 * 32 values): gguf-py's dequantization of them."""
    import gguf
    import torch
    from safetensors.torch import save_file
    rng = np.random.default_rng(3939)
    blocks = rng.integers(0, 256, size=(64, 17), dtype=np.uint8)
    blocks[:, 0] = rng.integers(0, 253, size=64, dtype=np.uint8)
    blocks[:4, 0] = [0, 1, 2, 252]  # the subnormal halves and the largest scale whose values stay finite
    raw = blocks.reshape(-1)
    expected = gguf.quants.dequantize(raw.reshape(1, -1), gguf.GGMLQuantizationType.MXFP4).reshape(-1)
    assert np.isfinite(expected).all()
    path = OUT / "mxfp4_reference.safetensors"
    save_file({"raw": torch.from_numpy(raw.copy()), "expected": torch.from_numpy(expected.astype(np.float32))},
              str(path))
    os.chmod(path, 0o644)
    print(f"{path.name}: {len(raw)} bytes of MXFP4")


def gpt_oss_mxfp4_gguf() -> None:
    """tests/fixtures/gpt_oss_mxfp4/model (MXFP4 experts as OpenAI ships them), changed as gpt_oss is
    (GPT_OSS_EDITS, truncated YaRN), through llama.cpp's convert_hf_to_gguf.py (f32: the experts are
    repacked as MXFP4 whatever the outtype), with transformers' logits of the changed checkpoint."""
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    src = os.environ.get("LLAMA_CPP")
    if not src or not (Path(src) / "convert_hf_to_gguf.py").is_file():
        sys.exit("set LLAMA_CPP to a llama.cpp source folder: export LLAMA_CPP=\"$(scripts/fetch-llamacpp-src.sh)\"")
    with tempfile.TemporaryDirectory() as tmp:
        kind = "gpt_oss_mxfp4"
        model_dir = deepseek2_source(kind, Path(tmp))
        path = OUT / f"{kind}_tiny.gguf"
        run_llama_cpp_converter(src, model_dir, path, Path(tmp))
        os.chmod(path, 0o644)
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with torch.no_grad():
            logits = m(torch.tensor(INPUT_IDS)).logits.float().contiguous()
        save_reference(kind, logits)
        print(f"{path.name}: {path.stat().st_size / 1024:.0f} KB, logit std {logits.std():.3f}")


def mxfp4_moe_reference() -> None:
    """`mxfp4_moe_reference.safetensors`: llama-quantize's MXFP4_MOE (llama_tensor_get_type: the experts,
    3-D `ffn_*_exps.weight`, MXFP4; the output head and every other matrix named `weight` Q8_0; the router
    and anything else unquantized) of the f32 file llama.cpp's converter writes from
    tests/fixtures/gpt_oss_mxfp4/model dequantized by transformers and saved in float32 (changed as gpt_oss
    is), quantized by gguf-py. Per tensor its bytes (`NAME`) and GGML type (`NAME.type`)."""
    import tempfile

    import gguf
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    src = os.environ.get("LLAMA_CPP")
    if not src or not (Path(src) / "convert_hf_to_gguf.py").is_file():
        sys.exit("set LLAMA_CPP to a llama.cpp source folder: export LLAMA_CPP=\"$(scripts/fetch-llamacpp-src.sh)\"")
    T = gguf.GGMLQuantizationType
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = deepseek2_source("gpt_oss_mxfp4", Path(tmp))
        m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        plain = Path(tmp) / "plain"
        m.save_pretrained(plain)
        for f in os.listdir(model_dir):
            if f.startswith("tokenizer") or f.endswith(".jinja"):
                import shutil
                shutil.copy(model_dir / f, plain / f)
        cfg = json.loads((plain / "config.json").read_text())
        assert "quantization_config" not in cfg, cfg.get("quantization_config")
        f32 = Path(tmp) / "f32.gguf"
        run_llama_cpp_converter(src, plain, f32, Path(tmp))
        r = gguf.GGUFReader(str(f32))
        for t in r.tensors:
            assert t.tensor_type == T.F32, t.name
            values = np.asarray(t.data, dtype=np.float32)
            matrix = len(t.shape) >= 2 and t.name.endswith("weight") and "ffn_gate_inp" not in t.name
            ty = T.MXFP4 if matrix and len(t.shape) == 3 and int(t.shape[2]) > 1 else T.Q8_0 if matrix else T.F32
            raw = values if ty == T.F32 else gguf.quants.quantize(values, ty)
            out[t.name] = torch.from_numpy(np.ascontiguousarray(raw).view(np.uint8).reshape(-1).copy())
            out[t.name + ".type"] = torch.tensor([int(ty)], dtype=torch.int32)
    path = OUT / "mxfp4_moe_reference.safetensors"
    save_file(out, str(path))
    os.chmod(path, 0o644)
    print(f"{path.name}: {len(out) // 2} tensors")

if __name__ == "__main__":
    if sys.argv[1:] == ["--mxfp4-only"]:
        mxfp4_reference()
        gpt_oss_mxfp4_gguf()
        mxfp4_moe_reference()
        sys.exit(0)
    if sys.argv[1:] == ["--qwen35-only"]:
        qwen35_ggufs()
        sys.exit(0)
    if sys.argv[1:] == ["--deepseek2-only"]:
        deepseek2_ggufs()
        sys.exit(0)
    if sys.argv[1:] == ["--gemma-only"]:
        gemma_family_ggufs()
        sys.exit(0)
    if sys.argv[1:] == ["--moe-phi-only"]:
        moe_and_phi2_ggufs()
        sys.exit(0)
    if sys.argv[1:] == ["--smollm3-only"]:
        smollm3_gguf()
        sys.exit(0)
    quant_reference()
    smollm2_reference()
    gemma_family_ggufs()
    moe_and_phi2_ggufs()
    smollm3_gguf()
    deepseek2_ggufs()
    qwen35_ggufs()
    for f in sorted(OUT.iterdir()):
        print(f"{f.relative_to(ROOT)}: {f.stat().st_size} bytes")
