#!/usr/bin/env python3
"""PEFT LoRA/DoRA adapters on the DeepSeek fixtures (tests/fixtures/models/deepseek_v3, deepseek_v2):
every linear module PEFT's target_modules reach in these models — multi-head latent attention's
projections (q_a_proj, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj), the dense layer's
MLP and the MoE layers' shared experts — and the fused routed experts: on transformers 5 PEFT turns the
names gate_proj / up_proj / down_proj into target_parameters of the experts (gate_up_proj, down_proj),
dropping them as module targets.

Same layout as tests/fixtures/embedding_lora (see scripts/make_embedding_lora_fixtures.py), under
tests/fixtures/deepseek_lora/<name>/. Run from the repository root:
python3 scripts/make_deepseek_lora_fixtures.py [CASE ...]
"""
import os
import sys

from make_embedding_lora_fixtures import ROOT, run_cases

OUT = os.path.join(ROOT, "deepseek_lora")

MLP = ["gate_proj", "up_proj", "down_proj"]

CASES = {
    "deepseek_v3": (
        "models/deepseek_v3/model",
        dict(r=2, lora_alpha=4, target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] + MLP),
    ),
    # rsLoRA on V2's plain q_proj.
    "deepseek_v2": (
        "models/deepseek_v2/model",
        dict(r=3, lora_alpha=6, use_rslora=True,
             target_modules=["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] + MLP),
    ),
    # DoRA on the latent projections.
    "deepseek_v3_dora": (
        "models/deepseek_v3/model",
        dict(r=2, lora_alpha=4, use_dora=True, target_modules=["q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"]),
    ),
}


if __name__ == "__main__":
    run_cases(OUT, CASES, sys.argv[1:])
