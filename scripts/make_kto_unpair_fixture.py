#!/usr/bin/env python3
"""The row order of TRL's `unpair_preference_dataset` (trl 1.16.0), for ferrotune's
`kto::unpaired_order`: 2,345 preference pairs (so three `datasets.map` batches of 1000, the last
partial) unpaired by TRL, each output row recorded as `[pair index, label]`.

Writes tests/fixtures/kto/unpair_order.json. Run from the repository root:
    "$(scripts/fetch-trl.sh)/bin/python" scripts/make_kto_unpair_fixture.py
The tests read the committed output; they do not run this script.
"""
import json
import os

import trl
from datasets import Dataset
from trl.data_utils import unpair_preference_dataset

PAIRS = 2345
OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "kto", "unpair_order.json")

pairs = Dataset.from_dict(
    {
        "prompt": [f"p{i}" for i in range(PAIRS)],
        "chosen": [f"c{i}" for i in range(PAIRS)],
        "rejected": [f"r{i}" for i in range(PAIRS)],
    }
)
rows = unpair_preference_dataset(pairs)
order = []
for row in rows:
    i = int(row["prompt"][1:])
    want = ("c" if row["label"] else "r") + str(i)
    assert row["completion"] == want, (row, want)
    order.append([i, bool(row["label"])])
with open(OUT, "w") as f:
    json.dump({"trl_version": trl.__version__, "pairs": PAIRS, "rows": order}, f, separators=(",", ":"))
    f.write("\n")
print(f"wrote {OUT}: {len(order)} rows (trl {trl.__version__})")
