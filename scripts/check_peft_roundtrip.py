#!/usr/bin/env python3
"""Checks that an adapter ferrotune saved loads in PEFT and generates what `ferrotune generate
--adapter` generates (greedy), and that the merged checkpoint in its `merged/` subfolder loads in
transformers and generates the same.

    python3 scripts/check_peft_roundtrip.py --base MODEL_DIR_OR_GGUF --adapter OUTPUT_DIR/epoch_0 \
        [--prompt-ids 1,2,3 | --prompt TEXT --chat] [--max-new-tokens 16]

Needs `pip install torch transformers peft gguf`. Prints one JSON line; exit 1 on any mismatch.
"""
import argparse
import json
import os
import subprocess
import sys

import torch
from peft import PeftModel, set_peft_model_state_dict
from peft.utils import load_peft_weights
from transformers import AutoModelForCausalLM, AutoTokenizer

ap = argparse.ArgumentParser()
ap.add_argument("--base", required=True)
ap.add_argument("--adapter", required=True)
ap.add_argument("--prompt-ids")
ap.add_argument("--prompt")
ap.add_argument("--chat", action="store_true")
ap.add_argument("--max-new-tokens", type=int, default=16)
ap.add_argument("--ferrotune", default="target/release/ferrotune")
a = ap.parse_args()


def load_base(path):
    if path.endswith(".gguf"):
        return AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
        )
    if json.load(open(os.path.join(path, "config.json"))).get("model_type") == "mllama":
        # Llama 3.2 Vision: ferrotune saves its adapters under the whole model's names, and PEFT
        # loads them there.
        from transformers import AutoModelForImageTextToText

        return AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


base = load_base(a.base)
model = PeftModel.from_pretrained(base, a.adapter)
# Reload the weights explicitly to see PEFT's own missing/unexpected report.
weights = load_peft_weights(a.adapter)
result = set_peft_model_state_dict(model, weights)
unexpected = list(result.unexpected_keys)
missing = [k for k in result.missing_keys if "lora_" in k]
model.eval()

if a.prompt_ids:
    ids = [int(x) for x in a.prompt_ids.split(",")]
    fargs = ["--prompt-ids", a.prompt_ids]
else:
    tok_src = a.adapter if os.path.isfile(os.path.join(a.adapter, "tokenizer.json")) else a.base
    tok = AutoTokenizer.from_pretrained(tok_src)
    if a.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": a.prompt}], add_generation_prompt=True)
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        fargs = ["--prompt", a.prompt, "--chat"]
    else:
        ids = tok(a.prompt)["input_ids"]
        fargs = ["--prompt", a.prompt]

with torch.no_grad():
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=a.max_new_tokens, do_sample=False,
        eos_token_id=None, pad_token_id=0,
    )
peft_new = out[0, len(ids):].tolist()

proc = subprocess.run(
    [a.ferrotune, "generate", "--model", a.base, "--adapter", a.adapter, *fargs,
     "--max-new-tokens", str(a.max_new_tokens), "--ignore-eos", "--json"],
    capture_output=True, text=True,
)
if proc.returncode != 0:
    print(proc.stderr, file=sys.stderr)
    sys.exit(1)
ours = json.loads(proc.stdout.strip().splitlines()[-1])["new_token_ids"]

merged_ok = None
merged_dir = os.path.join(a.adapter, "merged")
if os.path.isfile(os.path.join(merged_dir, "config.json")):
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        mo = merged.generate(torch.tensor([ids]), max_new_tokens=a.max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    merged_ok = mo[0, len(ids):].tolist() == peft_new

report = {
    "missing_lora_keys": missing,
    "unexpected_keys": unexpected,
    "peft_tokens": peft_new,
    "ferrotune_tokens": ours,
    "tokens_equal": peft_new == ours,
    "merged_checkpoint_generates_the_same": merged_ok,
}
print(json.dumps(report))
ok = not missing and not unexpected and peft_new == ours and merged_ok in (None, True)
sys.exit(0 if ok else 1)
