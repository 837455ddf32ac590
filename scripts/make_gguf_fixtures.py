#!/usr/bin/env python3
"""Writes the reference data that crates/ferrotune-models/tests/gguf.rs checks our GGUF loader against.

  tests/fixtures/gguf/smollm2_reference.safetensors + smollm2_reference.json
      SmolLM2-135M-Instruct.Q4_1.gguf loaded by transformers (AutoModelForCausalLM with gguf_file=...,
      float32): selected rows of a few weights (each `NAME` with its row indices in `NAME.rows`) and
      the config values transformers derived from the GGUF metadata.
  tests/fixtures/gguf/quant_reference.safetensors
      For each ggml type, `TYPE.raw` (the bytes of a [4, 256] tensor in that type) and
      `TYPE.expected` (what the python `gguf` package's `gguf.quants.dequantize` makes of them).

Usage: python3 scripts/make_gguf_fixtures.py   (needs torch, transformers, gguf, numpy, safetensors;
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


if __name__ == "__main__":
    quant_reference()
    smollm2_reference()
    for f in sorted(OUT.iterdir()):
        print(f"{f.relative_to(ROOT)}: {f.stat().st_size} bytes")
