"""tests/fixtures/torch_save/state.pt: what torch.save writes for a state dict that shares storages.

Usage: python3 scripts/make_torch_save_fixture.py   (PyTorch 2.x)

Holds: `w` (f32 3x4), `tied` (the same tensor: one storage, two keys), `row` (a view of `w`'s second row: a
storage offset), `p` (an nn.Parameter: _rebuild_parameter), `codes` (int8), `zeros` (int32), `half` (bf16).
The expected values are in state.json.
"""
import json
from pathlib import Path

import torch

out = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "torch_save"
out.mkdir(parents=True, exist_ok=True)
w = torch.arange(12, dtype=torch.float32).reshape(3, 4) / 4 - 1
sd = {
    "w": w,
    "tied": w,
    "row": w[1],
    "p": torch.nn.Parameter(torch.tensor([0.5, -0.25])),
    "codes": torch.tensor([[-8, 7], [3, -1]], dtype=torch.int8),
    "zeros": torch.tensor([0, -3, 70000], dtype=torch.int32),
    "half": (w * 1.1).bfloat16(),
}
torch.save(sd, out / "state.pt")
expect = {k: {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
              "values": v.detach().float().flatten().tolist()} for k, v in sd.items()}
(out / "state.json").write_text(json.dumps(expect, indent=1) + "\n")
