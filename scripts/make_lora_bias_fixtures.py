#!/usr/bin/env python3
"""PEFT references for `lora_bias=True` (a bias on lora_B, scaled with the adapter's output and
added to the base layer's bias when merged).

Same layout as tests/fixtures/embedding_lora (see scripts/make_embedding_lora_fixtures.py), under
tests/fixtures/lora_bias/<name>/. PEFT cannot merge a LoRA bias into a layer without a bias: for
such cases golden.json holds `merge_error` and there are no merged files.
Run from the repository root: python3 scripts/make_lora_bias_fixtures.py
"""
import os
import sys

from make_embedding_lora_fixtures import ROOT, run_cases

OUT = os.path.join(ROOT, "lora_bias")

CASES = {
    # Qwen2's q/k/v have biases: the adapter's bias merges into them.
    "qwen2_qkv": ("qwen2/model", dict(r=2, lora_alpha=4, lora_bias=True, target_modules=["q_proj", "k_proj", "v_proj"])),
    # Phi-2 has biases everywhere, its head included; rsLoRA scales the bias too.
    "phi2_all": (
        "models/phi2/model",
        dict(r=3, lora_alpha=6, use_rslora=True, lora_bias=True, target_modules=["dense", "fc1", "fc2", "lm_head"]),
    ),
    # Llama has no biases: the adapter runs, but PEFT cannot merge it.
    "llama3_unmergeable": (
        "llama3/model",
        dict(r=2, lora_alpha=8, lora_bias=True, target_modules=["q_proj", "gate_proj", "down_proj", "lm_head"]),
    ),
}


if __name__ == "__main__":
    run_cases(OUT, CASES, sys.argv[1:])
