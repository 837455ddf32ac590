#!/usr/bin/env python3
"""PEFT references for training `modules_to_save` (the token embedding and/or output head trained
in full beside LoRA adapters): the layout of tests/fixtures/embedding_lora (see
scripts/make_embedding_lora_fixtures.py), under tests/fixtures/modules_to_save_training/<name>/.
`lora_grads.safetensors` holds the saved modules' gradients too, under PEFT's parameter names
(`...embed_tokens.modules_to_save.weight`); the adapter file holds them as PEFT saves them
(`...embed_tokens.weight`).
Run from the repository root: python3 scripts/make_modules_to_save_training_fixtures.py [CASE ...]
"""
import os
import sys

from make_embedding_lora_fixtures import ROOT, run_cases

OUT = os.path.join(ROOT, "modules_to_save_training")

CASES = {
    # Both modules of an untied model.
    "llama3_embed_head": ("llama3/model", dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"],
                                                modules_to_save=["embed_tokens", "lm_head"])),
    # The embedding of a model whose head is tied to it: PEFT trains a copy of the embedding, and
    # the head keeps the base weights.
    "qwen2_tied_embed": ("qwen2/model", dict(r=2, lora_alpha=4, target_modules=["k_proj"],
                                              modules_to_save=["embed_tokens"])),
}


if __name__ == "__main__":
    run_cases(OUT, CASES, sys.argv[1:])
