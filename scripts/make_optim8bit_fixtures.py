#!/usr/bin/env python3
"""References for ferrotune's quantized AdamW optimizers (crates/ferrotune-train/tests/it/optim_quant.rs).

tests/fixtures/optim_quant/steps.safetensors, for each optimizer (prefix `torchao8`: torchao's
`torchao.optim.AdamW8bit`; `torchao4`: `AdamW4bit`; `bnb8`: bitsandbytes' `bnb.optim.AdamW8bit`
on the CPU):
- `params.{name}`: the three f32 starting parameters (shared): `w` [32, 256] (quantized by all
  three), `u` [4100] (bnb quantizes it, 17 blocks the last one partial; torchao keeps f32 state:
  4100 is no multiple of its block size) and `b` [300] (below every min size: f32 state);
- `grads.{k}.{name}`: the gradient of step k (k = 1..STEPS), shared;
- `{opt}.{k}.{name}`: the parameter after step k;
- `{opt}.state.{name}.{moment}.codes` / `.absmax` (quantized moments: u8 codes, 4-bit ones packed
  two to a byte with the first in the high nibble as torchao packs them; f32 block scales) or
  `{opt}.state.{name}.{moment}` (f32 moments) after the last step, moment = exp_avg / exp_avg_sq;
- `bnb8lib.{k}.{name}`: bitsandbytes' parameters as its CPU library computes them. Its native
  quantizer (`cquantize_blockwise_cpu_fp32`) searches the map with an approximate fast binary
  search that, for small values, can land several codes from the nearest entry; `bnb8` is the
  same optimizer with that one function replaced by bitsandbytes' own pure-PyTorch quantizer
  (`backends/default/ops.py`: the nearest entry of `value * (1 / absmax)`), copied below;
- `qmap.{signed8,unsigned8,signed4,unsigned4}`: the quantization maps as built;
- `bnb8.qmap1` / `bnb8.qmap2`: the maps bitsandbytes' optimizer holds after its steps (its CPU
  quantizer sets the first entry to -1.0 in place before searching).
Hyperparameters: lr 1e-2, betas (0.9, 0.999), eps 1e-8, weight_decay 0.01.

Run from the repository root: "$(scripts/fetch-optim-refs.sh)/bin/python" scripts/make_optim8bit_fixtures.py
"""
import os

import torch
from safetensors.torch import save_file

import bitsandbytes as bnb
from torchao.optim import AdamW4bit, AdamW8bit
from torchao.optim import subclass_4bit, subclass_8bit

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "optim_quant")
STEPS = 5
HP = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
SHAPES = {"w": (32, 256), "u": (4100,), "b": (300,)}


def bnb_default_quantize(A_fp32, code, absmax_out, out_uint8, blocksize):
    # bitsandbytes 0.50.2 backends/default/ops.py, `quantize_blockwise` ("default" kernel).
    A_flat = A_fp32.reshape(-1).float()
    n = A_flat.numel()
    rem = n % blocksize
    full = n - rem
    blocks = full // blocksize
    A_com = A_flat[:full].reshape(blocks, blocksize)
    absmax = A_com.abs().max(dim=-1)[0]
    scaled = torch.clamp(A_com * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if rem:
        am = A_flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, am.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(A_flat[full:] / am, -1, 1)])
    bounds = (code[:-1] + code[1:]) / 2
    q = torch.bucketize(scaled, bounds, out_int32=True).to(torch.uint8)
    out_uint8.copy_(q.reshape(A_fp32.shape))
    absmax_out.copy_(absmax)


def main():
    gen = torch.Generator().manual_seed(43)
    start = {n: torch.randn(s, generator=gen) * 0.1 for n, s in SHAPES.items()}
    grads = []
    for k in range(STEPS):
        # Gradients whose scale varies by block and step, so block scales differ.
        g = {}
        for n, s in SHAPES.items():
            x = torch.randn(s, generator=gen)
            scale = torch.exp(torch.randn(x.numel() // 50 + 1, generator=gen)).repeat_interleave(50)
            g[n] = (x.reshape(-1) * scale[: x.numel()] * 10 ** (-k % 3)).reshape(s)
        grads.append(g)
    out = {f"params.{n}": t.clone() for n, t in start.items()}
    for k, g in enumerate(grads, 1):
        for n, t in g.items():
            out[f"grads.{k}.{n}"] = t.clone()
    import bitsandbytes.backends.cpu.ops as bnb_cpu

    native = bnb_cpu._quant_blockwise_fp32_direct
    for prefix, make in [
        ("torchao8", lambda ps: AdamW8bit(ps, **HP)),
        ("torchao4", lambda ps: AdamW4bit(ps, **HP)),
        ("bnb8lib", lambda ps: bnb.optim.AdamW8bit(ps, **HP)),
        ("bnb8", lambda ps: bnb.optim.AdamW8bit(ps, **HP)),
    ]:
        bnb_cpu._quant_blockwise_fp32_direct = bnb_default_quantize if prefix == "bnb8" else native
        params = {n: torch.nn.Parameter(t.clone()) for n, t in start.items()}
        opt = make(list(params.values()))
        for k, g in enumerate(grads, 1):
            for n, p in params.items():
                p.grad = g[n].clone()
            opt.step()
            for n, p in params.items():
                out[f"{prefix}.{k}.{n}"] = p.detach().clone()
        if prefix == "bnb8lib":
            continue
        for n, p in params.items():
            st = opt.state[p]
            for moment, bnb_key in [("exp_avg", "1"), ("exp_avg_sq", "2")]:
                key = f"{prefix}.state.{n}.{moment}"
                if prefix == "bnb8":
                    if f"qmap{bnb_key}" in st:
                        out[f"bnb8.qmap{bnb_key}"] = st[f"qmap{bnb_key}"].clone()
                    s = st[f"state{bnb_key}"]
                    if s.dtype == torch.uint8:
                        out[f"{key}.codes"] = s.clone().reshape(-1)
                        out[f"{key}.absmax"] = st[f"absmax{bnb_key}"].clone()
                    else:
                        out[key] = s.clone()
                else:
                    s = st[moment]
                    if hasattr(s, "codes"):
                        out[f"{key}.codes"] = s.codes.clone().reshape(-1)
                        out[f"{key}.absmax"] = s.scale.clone()
                    else:
                        out[key] = s.clone()
    out["qmap.signed8"] = torch.tensor(subclass_8bit.get_qmap_signed(), dtype=torch.float32)
    out["qmap.unsigned8"] = torch.tensor(subclass_8bit.get_qmap_unsigned(), dtype=torch.float32)
    out["qmap.signed4"] = torch.tensor(subclass_4bit.get_qmap_signed(), dtype=torch.float32)
    out["qmap.unsigned4"] = torch.tensor(subclass_4bit.get_qmap_unsigned(), dtype=torch.float32)
    assert torch.equal(out["qmap.signed8"], bnb.functional.create_dynamic_map(signed=True))
    assert torch.equal(out["qmap.unsigned8"], bnb.functional.create_dynamic_map(signed=False))
    os.makedirs(ROOT, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(ROOT, "steps.safetensors"))
    print(f"wrote {len(out)} tensors")


if __name__ == "__main__":
    main()
