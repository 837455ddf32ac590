#!/usr/bin/env python3
"""transformers' batched greedy generation with left padding on the Qwen3.5 fixtures: what the
linear-attention cache (conv and recurrent states) must reproduce (Qwen3.5, Qwen3.5-MoE, Qwen3-Next).

For each case, tests/fixtures/qwen3_5_generate/<case>/:
- `golden.json`: `model` (the fixture folder under tests/fixtures), `pad_token_id`, `prompts`
  (ids of unequal lengths, left-padded to the longest in one batch), `new_tokens` (16 greedy
  tokens per row from `generate()` with its cache), `min_top2_margin`.
- `scores.safetensors`: `scores` `[steps, rows, vocab]`, the logits `generate()` chose from.

CPU, float32. Run from the repository root: python3 scripts/make_qwen3_5_generate_fixtures.py [CASE ...]
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
OUT = os.path.join(ROOT, "qwen3_5_generate")
NEW_TOKENS = 16

# name: fixture model folder under tests/fixtures
CASES = {
    "qwen3_5": "models/qwen3_5/model",
    "qwen3_5_moe": "models/qwen3_5_moe/model",
    "qwen3_next": "models/qwen3_next/model",
}

PROMPTS = [
    [17, 301, 45, 99, 12, 250, 7, 480, 66],
    [5, 222, 310, 41],
    [128, 9, 77, 402, 19, 33],
]


@torch.no_grad()
def run(case: str):
    model_dir = os.path.join(ROOT, CASES[case])
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    longest = max(map(len, PROMPTS))
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in PROMPTS])
    out = model.generate(ids, attention_mask=mask, do_sample=False, num_beams=1, max_new_tokens=NEW_TOKENS,
                         eos_token_id=None, pad_token_id=pad, output_scores=True, return_dict_in_generate=True)
    new = out.sequences[:, longest:].tolist()
    scores = torch.stack(out.scores).float().contiguous()  # [steps, rows, vocab]
    top2 = torch.topk(scores, 2, dim=-1).values
    margin = float((top2[..., 0] - top2[..., 1]).min())
    d = os.path.join(OUT, case)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "golden.json"), "w") as f:
        json.dump(dict(model=CASES[case], pad_token_id=pad, prompts=PROMPTS, new_tokens=new,
                       min_top2_margin=margin), f, indent=1)
    save_file({"scores": scores}, os.path.join(d, "scores.safetensors"))
    print(case, new, f"margin {margin:.4f}")


if __name__ == "__main__":
    for c in sys.argv[1:] or ["qwen3_5"]:
        run(c)
