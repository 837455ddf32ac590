#!/usr/bin/env python3
"""Router load-balancing loss references for ferrotune's tests: the tiny Mixtral, Qwen2-MoE,
Qwen3-MoE, Phi-3.5-MoE and gpt-oss models of tests/fixtures/models/ run by transformers with `output_router_logits=True`
and `router_aux_loss_coef=0.05`, so that their loss is `cross-entropy mean + 0.05 · aux_loss`
(transformers' `load_balancing_loss_func`, over every sparse layer's router).

On each model's golden batch with the second row's last 5 tokens as right padding
(attention_mask 0, labels -100; the auxiliary loss leaves them out):
tests/fixtures/moe_aux/golden.json: per case, `loss`, `aux_loss`, and the padding length.
tests/fixtures/moe_aux/{case}_grads.safetensors: d loss / d parameter of full fine-tuning.

Run from the repository root with torch, transformers and safetensors installed:
python3 scripts/make_moe_aux_fixtures.py
"""
import json
import os
import tempfile

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
OUT = os.path.join(ROOT, "moe_aux")
COEF = 0.05
PAD = 5


def main():
    os.makedirs(OUT, exist_ok=True)
    out = {"router_aux_loss_coef": COEF, "padding": PAD}
    for case in ["mixtral", "qwen2_moe", "qwen3_moe", "phimoe", "gpt_oss"]:
        path = os.path.join(ROOT, "models", case, "model")
        golden = json.load(open(os.path.join(ROOT, "models", case, "golden.json")))
        ids = torch.tensor(golden["input_ids"])
        labels = torch.tensor(golden["labels"])
        mask = torch.ones_like(ids)
        mask[1, -PAD:] = 0
        labels[1, -PAD:] = -100
        config = AutoConfig.from_pretrained(path)
        config.output_router_logits = True
        config.router_aux_loss_coef = COEF
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32)
        # Phi-3.5-MoE's sparsemixer samples experts in training mode: evaluation mode routes as
        # ferrotune does (the auxiliary loss is added either way).
        model.eval() if case == "phimoe" else model.train()
        res = model(input_ids=ids, attention_mask=mask, labels=labels)
        res.loss.backward()
        # Written through save_pretrained, so that the gradients carry the checkpoint's tensor
        # names (experts are 3D parameters in memory but per-expert matrices on disk).
        with torch.no_grad():
            for _, p in model.named_parameters():
                p.copy_(p.grad)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            grads = {
                k: v.float().contiguous()
                for k, v in load_file(os.path.join(tmp, "model.safetensors")).items()
            }
        save_file(grads, os.path.join(OUT, f"{case}_grads.safetensors"))
        out[case] = {"loss": res.loss.item(), "aux_loss": res.aux_loss.item()}
        print(case, out[case])
    json.dump(out, open(os.path.join(OUT, "golden.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
