#!/usr/bin/env python3
"""Writes tests/fixtures/datasets/torchtune_packing.json: what torchtune 0.6.1's own
`text_completion_dataset` and `PackedDataset` make of small local files, for the packing tests.

torchtune's model tokenizers are replaced by a thin wrapper over the HF tokenizer (what ferrotune
reads), so the ids are the same on both sides and the test checks what torchtune adds: the
truncation of a text to `max_seq_len - 1` tokens, and packing (with and without
`split_across_pack`): each pack's tokens, labels, `input_pos` and `seq_lens`.

Needs: torch, transformers, datasets, omegaconf, sentencepiece, tiktoken and the torchtune 0.6.1
sources (`pip download torchtune==0.6.1 --no-deps` and unzip; TORCHTUNE_SRC points at them). Its
NF4 import is stubbed: torchao releases after 0.10 moved it, and packing does not use it.
"""

import json
import os
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "fixtures" / "datasets"
ASSETS = Path(os.environ.get("FERROTUNE_ASSETS") or Path.home() / ".cache/ferrotune/assets")

nf4 = types.ModuleType("torchao.dtypes.nf4tensor")
nf4.NF4Tensor = type("NF4Tensor", (), {})
nf4.linear_nf4 = nf4.to_nf4 = lambda *a, **k: None
sys.modules["torchao.dtypes.nf4tensor"] = nf4
sys.path.insert(0, os.environ.get("TORCHTUNE_SRC", "/tmp/tt/src"))

import datasets  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from torchtune.datasets import text_completion_dataset  # noqa: E402

datasets.disable_progress_bars()


class HfTokenizer:
    """The part of torchtune's ModelTokenizer that text completion uses: BOS when the HF
    tokenizer adds one, the text without special tokens, EOS on request."""

    def __init__(self, name, max_seq_len):
        self.tok = AutoTokenizer.from_pretrained(str(ASSETS / "tokenizers" / name))
        self.max_seq_len = max_seq_len
        with_ = self.tok("a")["input_ids"]
        without = self.tok("a", add_special_tokens=False)["input_ids"]
        self.bos = with_[: len(with_) - len(without)]

    def encode(self, text, add_bos=True, add_eos=True):
        ids = (self.bos if add_bos else []) + self.tok(text, add_special_tokens=False)["input_ids"]
        return ids + ([self.tok.eos_token_id] if add_eos else [])


def main():
    cases = {
        "truncated": ({"source": "json", "data_files": "alpaca/data.jsonl", "column": "output"},
                      12, {}),
        "packed_split": ({"source": "json", "data_files": "alpaca/data.jsonl",
                          "column": "output"}, 24, {"packed": True}),
        "packed_no_split": ({"source": "json", "data_files": "alpaca/data.jsonl",
                             "column": "output"}, 24,
                            {"packed": True, "split_across_pack": False}),
        "text_packed_split": ({"source": "text", "data_files": "text.txt"}, 10,
                              {"packed": True}),
    }
    out = {}
    for case, (section, max_len, packing) in cases.items():
        expected = {}
        for name in ["llama2", "qwen3"]:
            tok = HfTokenizer(name, max_len)
            ds = text_completion_dataset(
                tok, source=section["source"], column=section.get("column", "text"),
                data_files=str(DATA / section["data_files"]), **packing)
            rows = []
            for i in range(len(ds)):
                row = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in ds[i].items()}
                rows.append(row)
            expected[name] = rows
        ferrotune_section = {"_component_": "text_completion_dataset", **section,
                             "max_seq_len": max_len, **packing}
        out[case] = {"section": ferrotune_section, "expected": expected}
    path = DATA / "torchtune_packing.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("wrote", path)


if __name__ == "__main__":
    main()
