#!/usr/bin/env python3
"""Writes tests/fixtures/gguf_export/q8_0.json: random values (some blocks all zero, some with
exact halves) and gguf-py's Q8_0 encoding of them (`gguf.quants.quantize`, llama.cpp's own Python
package), for the byte-exact test of ferrotune's Q8_0 writer. Needs: numpy, gguf."""

import json
from pathlib import Path

import gguf
import numpy as np

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gguf_export"

rng = np.random.default_rng(1234)
values = (rng.standard_normal(32 * 12) * 3).astype(np.float32)
values[32:64] = 0.0  # a zero block
# Scale exactly 1 (max 127): every other value a tie, which Q8_0 rounds away from zero.
values[64:96] = np.concatenate([[127.0], np.arange(31, dtype=np.float32) - 15.5]).astype(np.float32)
values[96:128] *= 1e-6  # tiny scale
quantized = gguf.quants.quantize(values.reshape(12, 32), gguf.GGMLQuantizationType.Q8_0)
OUT.mkdir(parents=True, exist_ok=True)
(OUT / "q8_0.json").write_text(json.dumps({
    "gguf_version": gguf.__version__ if hasattr(gguf, "__version__") else "unknown",
    "values": [float(v) for v in values],
    "q8_0_hex": quantized.tobytes().hex(),
}) + "\n")
print("wrote", OUT / "q8_0.json")
