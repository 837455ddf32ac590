"""tests/fixtures/cat/expected.json: what `tune cat` prints (PyYAML's yaml.dump of yaml.safe_load, as torchtune's
cat command calls it: default_flow_style=False, indent=4, width=80, allow_unicode=True), in file order and sorted,
for the tricky synthetic.yaml beside it and a few built-in configs.

Usage: python3 scripts/make_cat_fixtures.py   (PyYAML 6)
"""
import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "fixtures" / "cat"
CASES = ["synthetic.yaml", "generation", "llama3_1/8B_lora", "gemma2/9B_full", "phi4/14B_lora_single_device",
         "qwen2/1.5_to_0.5B_KD_lora_single_device", "llama3_1/8B_lora_dpo"]


def main():
    expected = {}
    for case in CASES:
        path = OUT / case if case.endswith(".yaml") else REPO / "configs" / f"{case}.yaml"
        data = yaml.safe_load(path.read_text())
        expected[case] = {
            str(sort).lower(): yaml.dump(data, default_flow_style=False, sort_keys=sort, indent=4, width=80,
                                         allow_unicode=True)
            for sort in (False, True)
        }
    (OUT / "expected.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
