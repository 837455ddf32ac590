#!/usr/bin/env python3
"""Extra LoRA references for ferrotune's tests: PEFT adapters on tests/fixtures/llama3/model exercising
rsLoRA, rank_pattern/alpha_pattern with a regex target_modules, an lm_head adapter, and
layers_to_transform. For each variant under tests/fixtures/lora_variants/<name>/: `adapter/` (PEFT's
save_pretrained), `golden.json` (`lora_loss`), `golden.safetensors` (`lora_logits`) and
`lora_grads.safetensors` (d lora_loss / d param, PEFT parameter names).

Inputs and labels are those of tests/fixtures/llama3/golden.json. CPU, float32.
Run from the repository root: python3 scripts/make_lora_fixtures.py
"""
import json
import os

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
BASE = os.path.join(ROOT, "llama3", "model")
OUT = os.path.join(ROOT, "lora_variants")

VARIANTS = {
    "rslora_patterns": dict(
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=r".*\.(q_proj|v_proj|down_proj)",
        rank_pattern={"q_proj": 2, "layers.1.mlp.down_proj": 6},
        alpha_pattern={r"model\.layers\.0\.self_attn\.v_proj": 3, "down_proj": 5},
    ),
    "lm_head": dict(r=2, lora_alpha=16, target_modules=["k_proj", "gate_proj", "lm_head"]),
    "layers_to_transform": dict(
        r=3, lora_alpha=6, target_modules=["q_proj", "up_proj"], layers_to_transform=[1]
    ),
}


def main():
    golden = json.load(open(os.path.join(ROOT, "llama3", "golden.json")))
    ids = torch.tensor(golden["input_ids"])
    labels = torch.tensor(golden["labels"])
    for name, kwargs in VARIANTS.items():
        torch.manual_seed(1234)
        model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
        cfg = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, init_lora_weights=False, **kwargs)
        model = get_peft_model(model, cfg)
        # Non-zero A and B of moderate size, so that every part of the adapter shows in the outputs.
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if "lora_" in pname:
                    p.copy_(torch.randn_like(p) * 0.2)
        model.train()
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        # Parameter names without the adapter name, as in PEFT's saved files and the shared fixtures.
        grads = {
            n.replace(".default", ""): p.grad.detach().clone().contiguous()
            for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None
        }
        d = os.path.join(OUT, name)
        os.makedirs(d, exist_ok=True)
        # Only the adapter: the lm_head variant would otherwise also store the whole base lm_head weight.
        model.save_pretrained(os.path.join(d, "adapter"), save_embedding_layers=False)
        os.remove(os.path.join(d, "adapter", "README.md"))
        save_file({"lora_logits": out.logits.detach().contiguous()}, os.path.join(d, "golden.safetensors"))
        save_file(grads, os.path.join(d, "lora_grads.safetensors"))
        json.dump({"lora_loss": out.loss.item()}, open(os.path.join(d, "golden.json"), "w"), indent=1)
        print(name, out.loss.item(), len(grads))


if __name__ == "__main__":
    main()
