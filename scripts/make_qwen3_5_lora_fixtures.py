#!/usr/bin/env python3
"""PEFT LoRA adapters on the Qwen3.5 fixture (tests/fixtures/models/qwen3_5): every linear module PEFT's
target_modules reach in it — the Gated DeltaNet's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a and
out_proj, the gated full attention's q_proj (query + gate), k_proj, v_proj, o_proj, and the MLP;
on the Qwen3.5-MoE fixture (tests/fixtures/models/qwen3_5_moe) also the shared expert, its gate
(shared_expert_gate), and through target_parameters the fused routed experts (gate_up_proj,
down_proj: no modules on transformers 5, and PEFT 0.21 does not turn the MLP names into parameter
targets for this model) and the router's bare weight (mlp.gate.weight); on the Qwen3-Next fixture
(tests/fixtures/models/qwen3_next) the same with the DeltaNet's fused in_proj_qkvz and in_proj_ba, and
the dense layer's MLP.

Same layout as tests/fixtures/embedding_lora (see scripts/make_embedding_lora_fixtures.py), under
tests/fixtures/qwen3_5_lora/<name>/. Run from the repository root:
python3 scripts/make_qwen3_5_lora_fixtures.py [CASE ...]
"""
import contextlib
import inspect
import os
import sys

import transformers.models.qwen3_5.modeling_qwen3_5 as modeling_qwen3_5
from make_embedding_lora_fixtures import ROOT, make_case

OUT = os.path.join(ROOT, "qwen3_5_lora")

CASES = {
    "qwen3_5": (
        "models/qwen3_5/model",
        dict(r=2, lora_alpha=4, target_modules=[
            "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
        ]),
    ),
    # DoRA on the Gated DeltaNet's projections (in_proj_qkv, in_proj_z, out_proj), the gated attention's q_proj
    # (query + gate) and the MLP's gate_proj.
    "qwen3_5_dora": (
        "models/qwen3_5/model",
        dict(r=2, lora_alpha=4, use_dora=True,
             target_modules=["in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "gate_proj"],
             # PyTorch's own float32 logits of this case are 8.4e-5 from its float64 ones.
             float64_reference=True),
    ),
    # DoRA on the Gated DeltaNet's in_proj_b alone (beta's projection, one row per value head), against a
    # reference float64 end to end (see all_float64). With in_proj_b added to qwen3_5_dora's targets instead
    # (issue 41), transformers' float64 model, with its float32 casts, is 7.2e-4 from the all-float64 one on
    # layer 0's in_proj_b magnitude gradient (PyTorch's float32: 6.1e-4; ferrotune: 8.2e-4 from the former,
    # 1.0e-4 from the latter). Here PyTorch's float32 is 2.0e-5 from this reference, ferrotune 1.7e-4: see
    # docs/src/models.md (qwen3_5_text) for what is left open.
    "qwen3_5_dora_in_proj_b": (
        "models/qwen3_5/model",
        dict(r=2, lora_alpha=4, use_dora=True, target_modules=["in_proj_b"],
             float64_reference=True, all_float64=True),
    ),
    "qwen3_5_moe": (
        "models/qwen3_5_moe/model",
        dict(r=2, lora_alpha=4, target_modules=[
            "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate",
        ], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]),
    ),
    "qwen3_next": (
        "models/qwen3_next/model",
        dict(r=2, lora_alpha=4, target_modules=[
            "in_proj_qkvz", "in_proj_ba", "out_proj",
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate",
        ], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"],
            # PyTorch's own float32 gradients of this case are up to 6.3e-4 (relative L2, layer 0's
            # in_proj_qkvz) from its float64 ones: the reference is float64.
            float64_reference=True),
    ),
}


@contextlib.contextmanager
def all_float64():
    """transformers' Qwen3.5 modeling with its float32 casts made float64 (the delta rule, the
    norms, RoPE, the softmax: no-ops in a float32 model, kept for bfloat16 ones), for a float64
    reference that is float64 end to end; the module as it was afterwards."""
    saved = dict(modeling_qwen3_5.__dict__)
    src = (inspect.getsource(modeling_qwen3_5)
           .replace("torch.float32", "torch.float64")
           .replace(".float()", ".double()")
           .replace("dtype=torch.float)", "dtype=torch.float64)"))
    exec(compile(src, modeling_qwen3_5.__file__, "exec"), modeling_qwen3_5.__dict__)
    try:
        yield
    finally:
        modeling_qwen3_5.__dict__.clear()
        modeling_qwen3_5.__dict__.update(saved)


if __name__ == "__main__":
    for name, (base, kwargs) in CASES.items():
        if not sys.argv[1:] or name in sys.argv[1:]:
            kwargs = dict(kwargs)
            with all_float64() if kwargs.pop("all_float64", False) else contextlib.nullcontext():
                make_case(OUT, name, base, kwargs)
