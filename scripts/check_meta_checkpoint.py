#!/usr/bin/env python3
"""Checks a Meta-format checkpoint folder ferrotune saved (a run under torchtune's
`FullModelMetaCheckpointer`) with torchtune's own checkpointer: `torch.load(weights_only=True,
mmap=True)` reads the file, torchtune's `FullModelMetaCheckpointer` loads it (Meta → torchtune
names) and saves it again with the same tensors, and the tensors equal `--source` (Meta's
`consolidated.00.pth`) within `--atol` (0: a run with lr 0 must save the source unchanged).

    python3 scripts/check_meta_checkpoint.py --saved OUTPUT_DIR/epoch_0 --model-type LLAMA3_2 \
        [--source MODEL/consolidated.00.pth] [--atol 0]

Needs torch, torchao 0.10 and torchtune 0.6.1's source (scripts/torchtune_source.py). Prints one
JSON line; exit 1 on any mismatch.
"""
import argparse
import json
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchtune_source import use_torchtune_source  # noqa: E402

use_torchtune_source()
from torchtune.training.checkpointing import FullModelMetaCheckpointer  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--saved", required=True)
ap.add_argument("--model-type", required=True)
ap.add_argument("--source")
ap.add_argument("--atol", type=float, default=0.0)
a = ap.parse_args()

FILE = "model-00001-of-00001.bin"
ours = torch.load(os.path.join(a.saved, FILE), weights_only=True, mmap=True)
report = {"tensors": len(ours)}
ok = True
if "output.weight" in ours and a.model_type == "LLAMA3_2":
    # torch.save of one tensor under two names keeps one storage.
    report["tied_head_shares_storage"] = (
        ours["output.weight"].data_ptr() == ours["tok_embeddings.weight"].data_ptr()
    )
    ok &= report["tied_head_shares_storage"]
with tempfile.TemporaryDirectory() as out:
    ckpt = FullModelMetaCheckpointer(
        checkpoint_dir=a.saved,
        checkpoint_files=[FILE],
        model_type=a.model_type,
        output_dir=out,
    )
    state = ckpt.load_checkpoint()["model"]
    report["torchtune_loaded"] = len(state)
    ckpt.save_checkpoint({"model": dict(state)}, epoch=0)
    again = torch.load(os.path.join(out, "epoch_0", FILE), weights_only=True)
    same = sorted(again) == sorted(ours) and all(torch.equal(again[k], ours[k]) for k in ours)
    report["torchtune_resaves_the_same"] = same
    ok &= same
if a.source:
    src = torch.load(a.source, weights_only=True)
    src.pop("rope.freqs", None)
    if "output.weight" not in src:
        src["output.weight"] = src["tok_embeddings.weight"]
    if sorted(src) != sorted(ours):
        report["names_differ"] = sorted(set(src) ^ set(ours))
        ok = False
    else:
        worst = max((src[k].float() - ours[k].float()).abs().max().item() for k in src)
        report["max_abs_diff_to_source"] = worst
        ok &= worst <= a.atol
report["ok"] = bool(ok)
print(json.dumps(report))
sys.exit(0 if ok else 1)
