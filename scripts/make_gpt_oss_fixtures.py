#!/usr/bin/env python3
"""gpt-oss references beyond tests/fixtures/models/gpt_oss: a PEFT LoRA adapter on that model with
target_modules "all-linear" (on gpt-oss that is q/k/v/o_proj alone: the router and the experts are no
nn.Linear), and its logits, loss and gradients in training mode; and MXFP4 experts as OpenAI ships them.

Writes tests/fixtures/gpt_oss_lora/all_linear/: `adapter/` (PEFT's save_pretrained), `golden.json` (`base`,
`input_ids`, `labels`, `lora_loss`, `target_modules` as PEFT resolved them), `golden.safetensors`
(`lora_logits`) and `lora_grads.safetensors` (d lora_loss / d param, PEFT parameter names).

Inputs and labels are those of tests/fixtures/models/gpt_oss/golden.json. CPU, float32, eager attention.

Writes tests/fixtures/gpt_oss_mxfp4/: `synthetic.safetensors` (`blocks` u8 [2, 3, 2, 16], `scales` u8 [2, 3, 2]
and `want`, transformers' `convert_moe_packed_tensors` of them in float32: [2, 64, 3]); `model/`, a tiny gpt-oss
(intermediate 32, MXFP4 needing widths that are multiples of 32) whose experts are stored as
`mlp.experts.{gate_up_proj,down_proj}_{blocks,scales}` with `quantization_config` mxfp4, and `golden.json` /
`golden.safetensors` (`input_ids`, `logits`) from transformers loading it on the CPU (which dequantizes it).
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
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

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
    adapter_cfg["target_modules"] = sorted(adapter_cfg["target_modules"])  # PEFT writes a set's order
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


def mxfp4():
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    import make_model_fixtures as mmf
    from safetensors.torch import load_file

    out = os.path.join(ROOT, "gpt_oss_mxfp4")
    if os.path.exists(out):
        shutil.rmtree(out)
    os.makedirs(out)
    g = torch.Generator().manual_seed(4242)
    blocks = torch.randint(0, 256, (2, 3, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 160, (2, 3, 2), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    save_file({"blocks": blocks, "scales": scales, "want": want.contiguous()},
              os.path.join(out, "synthetic.safetensors"))

    config = mmf.cfg_gpt_oss()
    config.intermediate_size = 32
    config.architectures = None
    torch.manual_seed(4343)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    mmf.init_weights(model, 4343, gemma_norm=False)
    model_dir = os.path.join(out, "model")
    model.save_pretrained(model_dir)
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    packed = {}
    for k, v in sd.items():
        if k.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inp, outp = v.shape  # [experts, in, out]; MXFP4 holds [experts, out, in / 32, 16]
            packed[k + "_blocks"] = torch.randint(0, 256, (experts, outp, inp // 32, 16), generator=g,
                                                  dtype=torch.uint8)
            # Powers of two 2^-8 .. 2^-2, so that the experts' outputs stay of the other layers' size.
            packed[k + "_scales"] = torch.randint(119, 126, (experts, outp, inp // 32), generator=g,
                                                  dtype=torch.uint8)
        else:
            packed[k] = v
    save_file(packed, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg_path = os.path.join(model_dir, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"],
    }
    json.dump(cfg, open(cfg_path, "w"), indent=2, sort_keys=True)
    for f in mmf.TOKENIZER_FILES:
        shutil.copyfile(mmf.TOKENIZER_DIR / f, os.path.join(model_dir, f))
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    experts = loaded.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.shape == (4, 32, 64), experts
    golden = json.load(open(os.path.join(ROOT, "models", "gpt_oss", "golden.json")))
    ids = torch.tensor(golden["input_ids"])
    with torch.no_grad():
        logits = loaded(input_ids=ids).logits
    save_file({"logits": logits.contiguous()}, os.path.join(out, "golden.safetensors"))
    json.dump({"input_ids": golden["input_ids"]}, open(os.path.join(out, "golden.json"), "w"), indent=1)
    for root, _, files in os.walk(out):
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)
    print("mxfp4", float(logits.std()))


if __name__ == "__main__":
    main()
    mxfp4()
