#!/usr/bin/env python3
"""gpt-oss references beyond tests/fixtures/models/gpt_oss: a PEFT LoRA adapter on that model with
target_modules "all-linear" (on gpt-oss that is q/k/v/o_proj alone: the router and the experts are no
nn.Linear), and its logits, loss and gradients in training mode.

Writes tests/fixtures/gpt_oss_lora/all_linear/: `adapter/` (PEFT's save_pretrained), `golden.json` (`base`,
`input_ids`, `labels`, `lora_loss`, `target_modules` as PEFT resolved them), `golden.safetensors`
(`lora_logits`) and `lora_grads.safetensors` (d lora_loss / d param, PEFT parameter names).

Inputs and labels are those of tests/fixtures/models/gpt_oss/golden.json. CPU, float32, eager attention.
Run from the repository root after make_model_fixtures.py --only gpt_oss:
    python3 scripts/make_gpt_oss_fixtures.py
"""
import json
import os
import shutil

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
BASE = "models/gpt_oss/model"
OUT = os.path.join(ROOT, "gpt_oss_lora")


def main():
    golden = json.load(open(os.path.join(ROOT, "models", "gpt_oss", "golden.json")))
    ids = torch.tensor(golden["input_ids"])
    labels = torch.tensor(golden["labels"])
    torch.manual_seed(4141)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, BASE), dtype=torch.float32)
    cfg = LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                     target_modules="all-linear")
    model = get_peft_model(model, cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_" in pname:
                p.copy_(torch.randn_like(p) * 0.2)
    model.train()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {
        n.replace(".default", ""): p.grad.detach().clone().contiguous()
        for n, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    d = os.path.join(OUT, "all_linear")
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    model.save_pretrained(os.path.join(d, "adapter"))
    os.remove(os.path.join(d, "adapter", "README.md"))
    # The base as the fixtures name it, not this machine's path.
    cfg_path = os.path.join(d, "adapter", "adapter_config.json")
    adapter_cfg = json.load(open(cfg_path))
    adapter_cfg["base_model_name_or_path"] = BASE
    json.dump(adapter_cfg, open(cfg_path, "w"), indent=2, sort_keys=True)
    save_file({"lora_logits": out.logits.detach().contiguous()}, os.path.join(d, "golden.safetensors"))
    save_file(grads, os.path.join(d, "lora_grads.safetensors"))
    targets = sorted(model.peft_config["default"].target_modules)
    json.dump({"base": BASE, "input_ids": golden["input_ids"], "labels": golden["labels"],
               "lora_loss": out.loss.item(), "target_modules": targets},
              open(os.path.join(d, "golden.json"), "w"), indent=1)
    for root, _, files in os.walk(d):
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)  # safetensors writes 0600 files
    print("all_linear", out.loss.item(), len(grads), targets)


if __name__ == "__main__":
    main()
