"""Adds torchtune 0.6.1's built-in text-model configs that ferrotune does not ship yet to configs/.

Usage: python3 scripts/import_torchtune_configs.py TORCHTUNE_SRC [NAME ...]

TORCHTUNE_SRC is an unpacked torchtune wheel (holding recipes/configs and torchtune/_recipe_registry.py).
The values stay torchtune's; the header's commands become ferrotune's (`tune` -> `ferrotune`), booleans are
written lowercase, and the torch profiler section (nothing ferrotune runs) is dropped. Each config is added to
configs/index.yaml under its recipe, after the configs already there. Existing files are never overwritten.
"""

import ast
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def registry(src: Path):
    tree = ast.parse((src / "torchtune" / "_recipe_registry.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Recipe":
            kw = {k.arg: k.value for k in node.keywords}
            for c in kw["configs"].elts:
                ck = {k.arg: k.value for k in c.keywords}
                yield kw["name"].value, ck["name"].value, ck["file_path"].value


def convert(text: str, recipe: str, name: str) -> str:
    lines = text.split("\n")
    out = []
    in_profiler = False
    for i, line in enumerate(lines):
        if line.startswith("# Profiler") or line.startswith("profiler:"):
            in_profiler = True
            continue
        if in_profiler:
            if line == "" or line.startswith(" ") or line.startswith("#"):
                continue
            in_profiler = False
        if line.startswith("#"):
            line = re.sub(r"\btune (run|download|cp|ls|validate)\b", r"ferrotune \1", line)
            line = re.sub(r"in (\w+)\.py\b", r"with ferrotune's \1 recipe", line)
        else:
            line = re.sub(r":\s*True\b", ": true", line)
            line = re.sub(r":\s*False\b", ": false", line)
            line = re.sub(r"# True ", "# true ", line)
        out.append(line)
    while out and out[-1] == "":
        out.pop()
    header_end = next((i for i, l in enumerate(out) if not l.startswith("#")), 0)
    out.insert(header_end, f"# (the values of torchtune's {name})")
    return "\n".join(out) + "\n"


def main():
    src = Path(sys.argv[1])
    wanted = set(sys.argv[2:])
    index_path = REPO / "configs" / "index.yaml"
    index = index_path.read_text()
    added = []
    for recipe, name, file_path in registry(src):
        if wanted and name not in wanted:
            continue
        # Vision models are not supported; of torchtune's dev/ recipes ferrotune runs the
        # generate_v2 pair; the quantize configs were written by hand.
        if "vision" in name or recipe == "quantize":
            continue
        if recipe.startswith("dev/") and recipe not in ("dev/generate_v2", "dev/generate_v2_distributed"):
            continue
        dst = REPO / "configs" / f"{name}.yaml"
        if dst.exists() or f"    - {name}\n" in index:
            continue
        text = (src / "recipes" / "configs" / file_path).read_text()
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text(convert(text, recipe, name))
        # Append to the recipe's list in index.yaml.
        m = re.search(rf"^- {re.escape(recipe)}:\n((?:    - .*\n)*)", index, re.M)
        if not m:
            sys.exit(f"{recipe} is not in configs/index.yaml")
        index = index[: m.end()] + f"    - {name}\n" + index[m.end():]
        added.append((recipe, name))
    index_path.write_text(index)
    for recipe, name in added:
        print(f"{recipe:<32} {name}")


if __name__ == "__main__":
    main()
