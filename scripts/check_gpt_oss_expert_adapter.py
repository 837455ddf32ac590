#!/usr/bin/env python3
"""Checks an adapter ferrotune trained and saved on gpt-oss's fused experts (`target_parameters`)
against PEFT: PEFT loads the folder on the base model, and its logits equal transformers' logits
of ferrotune's merged model (`merged/`); PEFT's own merge of the folder equals ferrotune's merged
tensors; PEFT's greedy tokens are printed for `ferrotune generate --adapter` to compare.

    python3 scripts/check_gpt_oss_expert_adapter.py BASE_MODEL SAVED_EPOCH_DIR
(SAVED_EPOCH_DIR: the `out/epoch_0` of `ferrotune run lora_finetune_single_device` with
`model.target_parameters`.) Exits non-zero when a check fails. CPU, float32.
"""
import os
import sys

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main(base, saved):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]])
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft = PeftModel.from_pretrained(model, saved).eval()
    params = [n for n, _ in peft.named_parameters() if "lora_" in n and "experts" in n]
    assert params, "PEFT put no adapter on the experts"
    with torch.no_grad():
        peft_logits = peft(input_ids=ids).logits
        tokens = peft.generate(input_ids=ids[:1, :4], max_new_tokens=12, do_sample=False)[0, 4:].tolist()
    merged_model = AutoModelForCausalLM.from_pretrained(os.path.join(saved, "merged"), dtype=torch.float32)
    with torch.no_grad():
        merged_logits = merged_model(input_ids=ids).logits
    logits_err = (peft_logits - merged_logits).abs().max().item()
    ours = load_file(os.path.join(saved, "merged", "model.safetensors"))
    state = peft.merge_and_unload().state_dict()
    merge_err = max((state[k] - v).abs().max().item() for k, v in ours.items())
    print(f"experts' adapter parameters in PEFT: {len(params)}")
    print(f"PEFT(base + ferrotune's adapter) vs transformers(ferrotune's merged): max abs logits {logits_err:.3g}")
    print(f"PEFT's merge of the adapter vs ferrotune's merged tensors: max abs {merge_err:.3g}")
    print("PEFT greedy tokens after [5, 6, 7, 8]:", tokens)
    if logits_err > 1e-4 or merge_err > 1e-5:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
