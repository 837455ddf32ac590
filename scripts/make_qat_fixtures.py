#!/usr/bin/env python3
"""Quantization-aware training references for ferrotune's tests, from torchao's
`Int8DynActInt4WeightQATQuantizer` (what torchtune's QAT recipes use), group size 32:

tests/fixtures/qat/ops.safetensors: random activations `x` [7, 64] and weights `w` [16, 64] in
f32 and bf16, their fake-quantized values (`fq_x`, `fq_w`, torchao's IntxFakeQuantizer with the
quantizer's activation and weight configs) and the gradients of `sum(fq · probe)`.
tests/fixtures/qat/full_grads.safetensors + golden.json "full": the tiny Llama
(tests/fixtures/llama3/model) after `quantizer.prepare()` (every linear with its input count a
multiple of 32, the output head included): the golden batch's loss and every parameter's gradient
(qat_distributed).
tests/fixtures/qat/lora_grads.safetensors + golden.json "lora": the same model with its PEFT
adapter (tests/fixtures/llama3/adapter) where only the adapted layers' base is fake-quantized, as
torchtune's QATLoRALinear (input and weight of the base product; the adapter sees the input as
is): the loss and every adapter gradient (qat_lora_finetune_distributed).

Run from the repository root with torch, torchao, transformers, peft and safetensors installed:
python3 scripts/make_qat_fixtures.py
"""
import json
import os

import torch
from peft import PeftModel
from safetensors.torch import save_file
from torchao.quantization.qat import Int8DynActInt4WeightQATQuantizer
from torchao.quantization.qat.linear import (
    Int8DynActInt4WeightQATLinear,
    _get_8da4w_activation_config,
    _get_8da4w_weight_config,
)
from torchao.quantization.qat.fake_quantizer import IntxFakeQuantizer
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
OUT = os.path.join(ROOT, "qat")
GROUP = 32


def ops():
    torch.manual_seed(0)
    out = {}
    act = IntxFakeQuantizer(_get_8da4w_activation_config(torch.float32))
    wq = IntxFakeQuantizer(_get_8da4w_weight_config(GROUP, torch.float32))
    for name, dtype in [("f32", torch.float32), ("bf16", torch.bfloat16)]:
        x = (torch.randn(7, 64) * torch.linspace(0.1, 3.0, 7)[:, None]).to(dtype)
        x[2] = x[2].abs()  # a row without negatives: min clamps to 0
        w = (torch.randn(16, 64) * 0.05).to(dtype)
        for key, t, fq in [("x", x, act), ("w", w, wq)]:
            t = t.clone().requires_grad_(True)
            y = fq(t)
            probe = torch.randn(y.shape).to(dtype)
            (y.float() * probe.float()).sum().backward()
            out[f"{name}_{key}"] = t.detach().contiguous()
            out[f"{name}_fq_{key}"] = y.detach().contiguous()
            out[f"{name}_probe_{key}"] = probe.contiguous()
            out[f"{name}_grad_{key}"] = t.grad.detach().contiguous()
    save_file(out, os.path.join(OUT, "ops.safetensors"))


def swap_base_layers(model):
    """torchtune's QATLoRALinear: the adapted layers' base product fake-quantized."""
    for name, module in list(model.named_modules()):
        if hasattr(module, "base_layer") and isinstance(module.base_layer, torch.nn.Linear):
            base = module.base_layer
            qat = Int8DynActInt4WeightQATLinear(
                base.in_features, base.out_features, bias=base.bias is not None, groupsize=GROUP
            )
            qat.weight = base.weight
            qat.bias = base.bias
            module.base_layer = qat


def main():
    os.makedirs(OUT, exist_ok=True)
    ops()
    golden = json.load(open(os.path.join(ROOT, "llama3", "golden.json")))
    ids = torch.tensor(golden["input_ids"])
    labels = torch.tensor(golden["labels"])
    result = {"group_size": GROUP}

    model = AutoModelForCausalLM.from_pretrained(
        os.path.join(ROOT, "llama3", "model"), dtype=torch.float32
    )
    Int8DynActInt4WeightQATQuantizer(groupsize=GROUP).prepare(model)
    swapped = [n for n, m in model.named_modules() if isinstance(m, Int8DynActInt4WeightQATLinear)]
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.detach().contiguous() for n, p in model.named_parameters()}
    save_file(grads, os.path.join(OUT, "full_grads.safetensors"))
    result["full"] = {"loss": loss.item(), "fake_quantized": swapped}
    print("full", loss.item(), len(swapped))

    base = AutoModelForCausalLM.from_pretrained(
        os.path.join(ROOT, "llama3", "model"), dtype=torch.float32
    )
    model = PeftModel.from_pretrained(
        base, os.path.join(ROOT, "llama3", "adapter"), is_trainable=True
    )
    swap_base_layers(model)
    model.train()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {
        n.replace(".default", ""): p.grad.detach().contiguous()
        for n, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    save_file(grads, os.path.join(OUT, "lora_grads.safetensors"))
    result["lora"] = {"loss": loss.item()}
    print("lora", loss.item())
    json.dump(result, open(os.path.join(OUT, "golden.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
