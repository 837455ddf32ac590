#!/usr/bin/env python3
"""PEFT references for `target_parameters` (PEFT's `lora.ParamWrapper`): LoRA on the fused 3-D
expert parameters transformers 5 keeps for mixtures of experts (`mlp.experts.gate_up_proj`
`[experts, 2 * inter, hidden]`, `mlp.experts.down_proj` `[experts, hidden, inter]`) and on 2-D
parameters such as the router's `mlp.gate.weight` (a plain parameter, not an `nn.Linear`, in
transformers 5).

Same layout as tests/fixtures/embedding_lora (see scripts/make_embedding_lora_fixtures.py), under
tests/fixtures/target_parameters/<name>/. The module names are transformers 5's (Mixtral's
`block_sparse_moe` is `mlp` there). `merged.safetensors` is PEFT's merged state dict in
transformers 5's in-memory names (fused experts).
Run from the repository root: python3 scripts/make_target_parameters_fixtures.py [CASE ...]
"""
import os
import sys

from transformers import AutoModelForImageTextToText

from make_embedding_lora_fixtures import ROOT, run_cases

OUT = os.path.join(ROOT, "target_parameters")

CASES = {
    # Both expert parameters (PEFT nests the wrappers: gate_up_proj's keys get `.base_layer`),
    # the router, and the attention by module name; a rank pattern on down_proj.
    "mixtral": (
        "models/mixtral/model",
        dict(
            r=2,
            lora_alpha=4,
            target_modules=["q_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"],
            rank_pattern={"down_proj": 3},
        ),
    ),
    # gate_up_proj alone (no nesting) beside a LoRA on the shared expert, rsLoRA.
    "qwen2_moe": (
        "models/qwen2_moe/model",
        dict(
            r=3,
            lora_alpha=6,
            use_rslora=True,
            target_modules=["shared_expert.up_proj"],
            target_parameters=["experts.gate_up_proj"],
        ),
    ),
    # down_proj alone on the sparse layer (layer 0 is dense), and a dense layer's 2-D weight as a
    # parameter target.
    "qwen3_moe": (
        "models/qwen3_moe/model",
        dict(r=2, lora_alpha=8, target_modules=[], target_parameters=["experts.down_proj", "layers.0.mlp.up_proj.weight"]),
    ),
    # Phi-3.5-MoE: both expert parameters and its router, which transformers 5 names `mlp.router`
    # (an nn.Linear subclass returning the routing, so only a parameter target can adapt it).
    "phimoe": (
        "models/phimoe/model",
        dict(
            r=2,
            lora_alpha=6,
            target_modules=["q_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.router.weight"],
            eval_grads=True,
        ),
    ),
    # Llama 4: its fused experts are `[experts, in, out]` (`gate_up_proj` `[experts, hidden,
    # 2 * inter]`), which PEFT adapts with the factors' roles swapped (lora_A `[r * E, 2 * inter]`,
    # lora_B `[hidden, r * E]`); both wrappers nested, a rank pattern on down_proj, the router's
    # weight (`Llama4Router` returns a tuple, which PEFT's module wrapper cannot run) and q_proj.
    "llama4": (
        "models/llama4/model",
        dict(
            r=2,
            lora_alpha=6,
            target_modules=["q_proj"],
            target_parameters=[
                "feed_forward.experts.gate_up_proj",
                "feed_forward.experts.down_proj",
                "feed_forward.router.weight",
            ],
            rank_pattern={"down_proj": 3},
        ),
    ),
    # The whole Llama 4 (vision tower too) with only gate_up_proj targeted, rsLoRA, beside the
    # shared expert's down_proj.
    "llama4_multimodal": (
        "models/llama4_multimodal/model",
        dict(
            r=3,
            lora_alpha=5,
            use_rslora=True,
            target_modules=["shared_expert.down_proj"],
            target_parameters=["experts.gate_up_proj"],
            auto_class=AutoModelForImageTextToText,
        ),
    ),
    # Gemma 4's experts beside the dense MLP (`model.layers.N.experts.gate_up_proj`, Qwen's layout): both
    # parameters (nested), a rank pattern on down_proj, beside q_proj, the dense MLP's gate_proj (which on
    # Gemma 4 is no expert name) and the router's projection (`router.proj`, an nn.Linear).
    "gemma4_moe": (
        "models/gemma4_moe/model",
        dict(
            r=2,
            lora_alpha=6,
            target_modules=["q_proj", "gate_proj", "proj"],
            target_parameters=["experts.gate_up_proj", "experts.down_proj"],
            rank_pattern={"down_proj": 3},
        ),
    ),
    # gpt-oss: its fused experts are `[experts, in, out]` and say so (`is_transposed`), so PEFT keeps the
    # factors' natural roles (lora_A `[r * E, hidden]`, lora_B `[2 * inter, r * E]` on `gate_up_proj`, gate
    # and up columns interleaved); both parameters (nested), a rank pattern on down_proj, beside q/o_proj.
    # The biases (`*_proj_bias`) stay untouched.
    "gpt_oss": (
        "models/gpt_oss/model",
        dict(
            r=2,
            lora_alpha=6,
            target_modules=["q_proj", "o_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            rank_pattern={"down_proj": 3},
        ),
    ),
    # No parameter targets, module names as on transformers 4: on transformers 5 the experts are
    # no modules, so PEFT adapts the shared expert's gate/up/down_proj (and q_proj) only.
    "qwen2_moe_modules": (
        "models/qwen2_moe/model",
        dict(r=2, lora_alpha=4, target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"]),
    ),
}


if __name__ == "__main__":
    run_cases(OUT, CASES, sys.argv[1:])
