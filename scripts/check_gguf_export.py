#!/usr/bin/env python3
"""Checks `ferrotune export-gguf` against the two GGUF readers users run: llama.cpp (through
llama-cpp-python) and transformers' GGUF loader. For each tiny fixture model, exports f32 and
q8_0 GGUFs, then compares each reader's logits of the golden input with transformers' logits of
the original checkpoint (tests/fixtures/models/<name>/golden.safetensors).

  python scripts/check_gguf_export.py target/release/ferrotune

Needs: torch, transformers, gguf, safetensors, llama-cpp-python."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "fixtures" / "models"


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def llama_cpp_logits(path, ids):
    from llama_cpp import Llama

    # An f32 KV cache (llama.cpp's default is f16), so that the comparison sees the weights.
    llm = Llama(model_path=str(path), logits_all=True, n_ctx=64, verbose=False, n_threads=2,
                type_k=0, type_v=0)
    rows = []
    for row in ids:
        llm.reset()
        llm.eval(row)
        rows.append(np.array(llm.scores[: len(row)], dtype=np.float32))
    return np.stack(rows)


def transformers_logits(path, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def main():
    binary = Path(sys.argv[1]).resolve()
    out = Path(tempfile.mkdtemp())
    print(f"{'model':14} {'outtype':8} {'llama.cpp':>10} {'transformers':>13}")
    for name in ["llama2", "llama3_2", "smollm2_like", "mistral", "qwen2_5", "qwen3"]:
        golden = json.loads((MODELS / name / "golden.json").read_text())
        want = load_file(str(MODELS / name / "golden.safetensors"))["logits"]
        ids = golden["input_ids"]
        for outtype in ["f32", "q8_0"]:
            path = out / f"{name}-{outtype}.gguf"
            subprocess.run([binary, "export-gguf", MODELS / name / "model", path, "--outtype", outtype],
                           check=True, capture_output=True)
            cells = []
            for reader in (llama_cpp_logits, transformers_logits):
                try:
                    cells.append(f"{rel_l2(reader(path, ids), want):.2e}")
                except Exception as e:  # a reader refusing the file is a result too
                    cells.append(f"error: {str(e).splitlines()[0][:60]}")
            print(f"{name:14} {outtype:8} {cells[0]:>10} {cells[1]:>13}", flush=True)


if __name__ == "__main__":
    main()
