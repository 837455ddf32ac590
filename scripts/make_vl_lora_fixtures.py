#!/usr/bin/env python3
"""PEFT LoRA adapters trained on whole vision-language models (Qwen2.5-VL, Qwen3-VL, Llama 3.2 Vision, Llama 4), whose text
model ferrotune runs: target names that also reach the vision tower (Qwen2.5-VL's vision blocks
have `mlp.gate_proj` / `down_proj`, Qwen3-VL's `linear_fc1`), so the adapter file holds tensors
ferrotune must leave out.

Same layout as tests/fixtures/embedding_lora (see scripts/make_embedding_lora_fixtures.py), under
tests/fixtures/vl_lora/<name>/; names are transformers 5's (`model.language_model.*`,
`model.visual.*`), and `merged.safetensors` is PEFT's merged state dict of the whole model.
Run from the repository root: python3 scripts/make_vl_lora_fixtures.py [CASE ...]
"""
import os
import sys

from transformers import AutoModelForImageTextToText

from make_embedding_lora_fixtures import ROOT, run_cases

OUT = os.path.join(ROOT, "vl_lora")

CASES = {
    "qwen2_5_vl": (
        "models/qwen2_5_vl_multimodal/model",
        dict(r=2, lora_alpha=4, target_modules=["q_proj", "gate_proj", "down_proj"],
             auto_class=AutoModelForImageTextToText),
    ),
    "qwen3_vl": (
        "models/qwen3_vl_multimodal/model",
        dict(r=3, lora_alpha=6, use_rslora=True, target_modules=["k_proj", "up_proj", "linear_fc1"],
             auto_class=AutoModelForImageTextToText),
    ),
    # Llama 3.2 Vision: q_proj / v_proj / down_proj also reach the cross-attention layers (0 and 2:
    # `cross_attn.q_proj`, their MLPs) and the vision tower, which text alone never runs.
    "mllama": (
        "models/mllama_multimodal/model",
        dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"],
             auto_class=AutoModelForImageTextToText),
    ),
    # Llama 4: every projection name; PEFT adapts the attention, the dense layers' MLPs and the MoE
    # layers' shared experts (`feed_forward.shared_expert.*`): the fused experts are no linear modules.
    # The names reach the vision tower too (its attention and `mlp.fc1`-less projections).
    "llama4": (
        "models/llama4_multimodal/model",
        dict(r=2, lora_alpha=4,
             target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
             auto_class=AutoModelForImageTextToText),
    ),
}


if __name__ == "__main__":
    run_cases(OUT, CASES, sys.argv[1:])
