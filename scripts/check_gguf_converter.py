#!/usr/bin/env python3
"""Checks `ferrotune export-gguf` of DeepSeek-V2/V3, gpt-oss, Qwen3.5 (dense, MoE) and Qwen3-Next
against llama.cpp's own convert_hf_to_gguf.py: for the tiny DeepSeek and gpt-oss checkpoints
(changed as scripts/make_gguf_fixtures.py's deepseek2_ggufs changes them, so that a `deepseek2`
file can say what transformers computes) and the Qwen3.5 / Qwen3-Next ones (qwen35_source), both
write f32 and f16 GGUFs of the same folder (the Qwen ones bf16, q8_0 and auto too, and bf16 and
f16 copies of the dense Qwen3.5), and gguf-py compares them: the same tensor names, shapes and types,
the same values (f16: the same bytes), the same metadata keys and values, but for the differences
listed in EXPECTED (printed).

  LLAMA_CPP="$(scripts/fetch-llamacpp-src.sh)" python3 scripts/check_gguf_converter.py target/release/ferrotune

Needs: torch, transformers, gguf, numpy, safetensors."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import make_gguf_fixtures as mg  # noqa: E402

# Keys expected to differ, and why.
EXPECTED = {
    # The converter writes none when the config lacks `scoring_func` (transformers 5's V2 configs
    # never have it); llama.cpp then takes softmax, which ferrotune writes out.
    "deepseek2.expert_gating_func": "ferrotune always writes the gating function",
    "general.name": "the converter names the model from its config, ferrotune from the folder",
    "general.size_label": "the converter's own label",
    "general.type": "the converter's own key",
    "tokenizer.ggml.add_bos_token": "tokenizer keys: from each tool's tokenizer reading",
    "tokenizer.ggml.add_eos_token": "tokenizer keys",
    "tokenizer.ggml.add_sep_token": "tokenizer keys",
    "tokenizer.ggml.merges": "tokenizer keys",
    "tokenizer.ggml.token_type": "tokenizer keys",
    "tokenizer.ggml.tokens": "tokenizer keys",
    "tokenizer.ggml.padding_token_id": "tokenizer keys",
    "tokenizer.ggml.bos_token_id": "tokenizer keys",
    "tokenizer.ggml.eos_token_id": "tokenizer keys",
    "tokenizer.ggml.pre": "tokenizer keys",
    "tokenizer.chat_template": "tokenizer keys",
}


def fields(r):
    out = {}
    for name, f in r.fields.items():
        if name.startswith("GGUF."):
            continue
        v = f.contents()
        out[name] = v
    return out


def compare(ours_path, theirs_path, what):
    import gguf

    ours, theirs = gguf.GGUFReader(str(ours_path)), gguf.GGUFReader(str(theirs_path))
    ot = {t.name: t for t in ours.tensors}
    tt = {t.name: t for t in theirs.tensors}
    bad = []
    if set(ot) != set(tt):
        bad.append(f"tensor names differ: only ours {sorted(set(ot) - set(tt))}, "
                   f"only the converter's {sorted(set(tt) - set(ot))}")
    worst = 0.0
    for name in sorted(set(ot) & set(tt)):
        a, b = ot[name], tt[name]
        if list(a.shape) != list(b.shape) or a.tensor_type != b.tensor_type:
            bad.append(f"{name}: {a.tensor_type.name}{list(a.shape)} vs "
                       f"{b.tensor_type.name}{list(b.shape)}")
            continue
        x, y = np.asarray(a.data), np.asarray(b.data)
        if x.dtype.kind == "f":
            worst = max(worst, float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64)))))
        elif not np.array_equal(x, y):
            bad.append(f"{name}: bytes differ")
    of, tf = fields(ours), fields(theirs)
    differ = []
    for key in sorted(set(of) | set(tf)):
        a, b = of.get(key), tf.get(key)
        same = a == b if not isinstance(a, float) else (b is not None and abs(a - b) <= 1e-7 * max(1, abs(b)))
        if not same:
            if key in EXPECTED:
                differ.append(key)
            else:
                bad.append(f"metadata {key}: ours {str(a)[:60]!r}, the converter's {str(b)[:60]!r}")
    print(f"{what}: {len(ot)} tensors (converter {len(tt)}), largest value difference {worst:.3g}; "
          f"{len(of)} keys (converter {len(tf)}), expected differences: {', '.join(differ) or 'none'}")
    if worst != 0.0:
        bad.append(f"values differ by up to {worst}")
    return bad


def stored_as(tmp: Path, dtype: str) -> Path:
    """The dense Qwen3.5 fixture with its weights stored in `dtype` ("bfloat16", "float16")."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file
    out = tmp / f"qwen3_5_{dtype}"
    shutil.copytree(ROOT / "tests" / "fixtures" / "models" / "qwen3_5" / "model", out)
    w = load_file(str(out / "model.safetensors"))
    save_file({k: v.to(getattr(torch, dtype)).contiguous() for k, v in w.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def main():
    exe = sys.argv[1] if len(sys.argv) > 1 else str(ROOT / "target" / "release" / "ferrotune")
    src = os.environ.get("LLAMA_CPP")
    if not src:
        sys.exit("set LLAMA_CPP to a llama.cpp source folder (convert_hf_to_gguf.py, conversion/, gguf-py/): export LLAMA_CPP=\"$(scripts/fetch-llamacpp-src.sh)\"")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for kind in [*mg.DEEPSEEK2_EDITS, "gpt_oss", "gpt_oss_mxfp4"]:
            model_dir = mg.deepseek2_source(kind, tmp)
            for outtype in ["f32", "f16"]:
                ours, theirs = tmp / f"{kind}_{outtype}_ours.gguf", tmp / f"{kind}_{outtype}_theirs.gguf"
                subprocess.run([exe, "export-gguf", str(model_dir), str(ours), "--outtype", outtype],
                               check=True, stdout=subprocess.DEVNULL)
                mg.run_llama_cpp_converter(src, model_dir, theirs, tmp, outtype)
                failures += [f"{kind} {outtype}: {b}" for b in compare(ours, theirs, f"{kind} {outtype}")]
        # The multimodal Qwen3.5 checkpoint: its text model, as the converter writes it; bf16 and
        # f16 copies of the dense one (the converter computes -exp(A_log) and 1 + w in f32 from
        # bf16, in f16 from f16).
        stored = {"qwen3_5_bf16": "bfloat16", "qwen3_5_f16": "float16"}
        for kind in [*mg.QWEN35_KINDS, "qwen3_5_multimodal", *stored]:
            model_dir = (stored_as(tmp, stored[kind]) if kind in stored
                         else mg.qwen35_source(kind, tmp))
            for outtype in ["f32", "f16", "bf16", "q8_0", "auto"]:
                ours, theirs = tmp / f"{kind}_{outtype}_ours.gguf", tmp / f"{kind}_{outtype}_theirs.gguf"
                subprocess.run([exe, "export-gguf", str(model_dir), str(ours), "--outtype", outtype],
                               check=True, stdout=subprocess.DEVNULL)
                mg.run_llama_cpp_converter(src, model_dir, theirs, tmp, outtype, extra=("--no-mtp",))
                failures += [f"{kind} {outtype}: {b}" for b in compare(ours, theirs, f"{kind} {outtype}")]
    for f in failures:
        print("FAIL", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
