#!/usr/bin/env python3
"""FP8 block-quantized checkpoints (transformers' FineGrainedFP8Config format, as DeepSeek-V3 / R1,
Kimi-K2 and Qwen3's -FP8 releases ship them): each quantized linear's `weight` stored F8_E4M3 beside
a float32 `weight_scale_inv` [ceil(out / b0), ceil(in / b1)], `quantization_config` fp8 with
`weight_block_size` [b0, b1]. Writes tests/fixtures/fp8/:

- `synthetic.safetensors`: `bytes` u8 0..255 and `values`, torch's float8_e4m3fn reading of each
  (NaN included); `weight` (F8_E4M3 [40, 50]) and `scale_inv` (f32 [3, 3], blocks [16, 24]: partial
  blocks on both axes) with `want_f32` / `want_bf16`, transformers' `_dequantize_fp8_weight` of them
  in float32 (the f32 product) and that cast to bfloat16.
- `deepseek_v3/`: tests/fixtures/models/deepseek_v3's weights quantized in blocks [16, 24] (so that
  most matrices end in partial blocks; the embedding, lm_head and the router `mlp.gate` stay float as
  transformers leaves them), `golden.json` (its input_ids, 16 greedy tokens) and `golden.safetensors`
  (logits). transformers' own `dequantize=True` loading derives each block from the scale grid
  (`rows // scale_rows`) and refuses partial blocks, so the reference model is the float model
  holding transformers' `_dequantize_fp8_weight` (float32) of every weight, the dequantization its
  FP8 layers apply for partial blocks.
- `qwen3/`: tests/fixtures/models/qwen3's weights in blocks [16, 16] (every dimension a multiple:
  no partial block), whose reference is transformers loading it with
  `FineGrainedFP8Config(dequantize=True)` on the CPU, float32.

Run from the repository root with the system's torch + transformers 5.24:
python3 scripts/make_fp8_fixtures.py
"""
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, FineGrainedFP8Config
from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
OUT = os.path.join(ROOT, "fp8")
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max


def quantize(w, block, g):
    """Block quantization as Fp8Quantize does (scale_inv = amax / 448 per block), the edge blocks
    partial; the amax scaled by a random factor in [1, 1.5) so that values fall on all of e4m3."""
    rows, cols = w.shape
    b0, b1 = block
    sr, sc = -(-rows // b0), -(-cols // b1)
    scale_inv = torch.empty(sr, sc, dtype=torch.float32)
    q = torch.empty(rows, cols, dtype=FP8)
    for i in range(sr):
        for j in range(sc):
            blk = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float()
            amax = blk.abs().amax().item()
            s = (amax if amax > 0 else 1.0) / FP8_MAX * (1.0 + 0.5 * torch.rand((), generator=g).item())
            scale_inv[i, j] = s
            q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (blk / scale_inv[i, j]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale_inv


def quantized_names(sd, keep):
    return sorted(k for k, v in sd.items() if k.endswith(".weight") and v.dim() == 2 and not any(s in k for s in keep))


def write_model(name, block, keep, seed):
    src = os.path.join(ROOT, "models", name, "model")
    out = os.path.join(OUT, name)
    model_dir = os.path.join(out, "model")
    shutil.copytree(src, model_dir)
    sd = load_file(os.path.join(src, "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    packed, deq = {}, {}
    names = set(quantized_names(sd, keep))
    for k, v in sd.items():
        if k in names:
            q, s = quantize(v, block, g)
            packed[k] = q
            packed[k[: -len("weight")] + "weight_scale_inv"] = s
            deq[k] = _dequantize_fp8_weight(q, s, list(block), torch.float32)
        else:
            packed[k] = v
            deq[k] = v
    save_file(packed, os.path.join(model_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg_path = os.path.join(model_dir, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["quantization_config"] = {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": list(block),
    }
    json.dump(cfg, open(cfg_path, "w"), indent=2, sort_keys=True)
    return out, model_dir, deq


def golden(out, model, name):
    src = json.load(open(os.path.join(ROOT, "models", name, "golden.json")))
    ids = torch.tensor(src["input_ids"])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        prompt = torch.tensor([src["greedy_prompt"]])
        gen = model.generate(prompt, max_new_tokens=16, do_sample=False, min_new_tokens=16,
                             eos_token_id=None, pad_token_id=0)
    new = gen[0, prompt.shape[1]:].tolist()
    save_file({"logits": logits.contiguous()}, os.path.join(out, "golden.safetensors"))
    json.dump({"input_ids": src["input_ids"], "greedy_prompt": src["greedy_prompt"], "greedy_new_tokens": new,
               "reference": {"transformers": __import__("transformers").__version__, "torch": torch.__version__.split("+")[0],
                             "device": "cpu", "compute_dtype": "float32"}},
              open(os.path.join(out, "golden.json"), "w"), indent=1)
    print(name, "logits std", float(logits.std()), "greedy", new)


def main():
    if os.path.exists(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(808)
    b = torch.arange(256, dtype=torch.uint8)
    w = torch.randn(40, 50, generator=g) * torch.logspace(-3, 2, 50)
    q, s = quantize(w, (16, 24), g)
    want = _dequantize_fp8_weight(q, s, [16, 24], torch.float32)
    assert torch.equal(want, q.float() * s.repeat_interleave(16, 0)[:40].repeat_interleave(24, 1)[:, :50])
    save_file({"bytes": b, "values": b.view(FP8).float(), "weight": q, "scale_inv": s,
               "want_f32": want, "want_bf16": want.to(torch.bfloat16)},
              os.path.join(OUT, "synthetic.safetensors"))

    # DeepSeek-V3: partial blocks; the reference is the float model holding the dequantized weights.
    out, model_dir, deq = write_model("deepseek_v3", (16, 24), ["embed_tokens", "lm_head", "mlp.gate.weight"], 909)
    try:
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                             quantization_config=FineGrainedFP8Config(dequantize=True))
        raise SystemExit("transformers now reads partial FP8 blocks with dequantize=True: use it as the reference")
    except RuntimeError as e:  # the report of its ValueError "Weight shape (72, 12) not divisible by ..."
        assert "conversion" in str(e), e
        print("deepseek_v3: transformers' dequantize=True refuses the partial blocks")
    ref_dir = os.path.join("/tmp", "ferrotune-fp8-deepseek-ref")
    shutil.rmtree(ref_dir, ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "models", "deepseek_v3", "model"), ref_dir)
    save_file(deq, os.path.join(ref_dir, "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    golden(out, model, "deepseek_v3")

    # Qwen3: whole blocks; the reference is transformers' own dequantize=True loading.
    out, model_dir, deq = write_model("qwen3", (16, 16), ["embed_tokens", "lm_head"], 910)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    got = model.state_dict()
    for k, v in deq.items():
        assert torch.equal(got[k], v), k
    golden(out, model, "qwen3")
    for root, _, files in os.walk(OUT):
        for f in files:
            os.chmod(os.path.join(root, f), 0o644)


if __name__ == "__main__":
    main()
