#!/usr/bin/env bash
# Builds the `ferrotune` wheel (pyproject.toml: maturin's `bin` bindings) and checks it as a user
# gets it: installed with pip into a fresh virtual environment, `ferrotune --version`,
# `ferrotune env` and two steps of `smollm2/135M_lora_single_device` on the fetched SmolLM2.
# maturin comes from PyPI at a pinned version, installed once into a venv in the tools cache
# (~/.cache/ferrotune/tools, or $FERROTUNE_TOOLS), as scripts/book.sh caches mdbook. The build
# reuses target/release (the same profile and features as `cargo build --release`).
# Usage: scripts/check-wheel.sh   (scripts/test.sh runs it; prints the wheel and its size)
set -euo pipefail
cd "$(dirname "$0")/.."
MATURIN_VERSION=1.16.0
TOOLS=${FERROTUNE_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrotune/tools}
venv="$TOOLS/maturin-$MATURIN_VERSION"
if [ ! -x "$venv/bin/maturin" ]; then
  echo "installing maturin $MATURIN_VERSION from PyPI into $venv (once)..." >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "maturin==$MATURIN_VERSION"
fi
assets=$(scripts/fetch-assets.sh)
model="$assets/SmolLM2-135M-Instruct.Q4_1.gguf"

rm -rf target/wheels
"$venv/bin/maturin" build --release --quiet --out target/wheels >&2
wheel=$(ls target/wheels/ferrotune-*.whl)
size=$(stat -c %s "$wheel")

tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python3 -m venv "$tmp/venv"
"$tmp/venv/bin/python" -m pip install --quiet --disable-pip-version-check --no-index "$wheel"
ft="$tmp/venv/bin/ferrotune"
"$ft" --version
"$ft" env --no-measure | grep -q "^CPU" || { echo "ferrotune env: no CPU section" >&2; exit 1; }
"$ft" run lora_finetune_single_device --config smollm2/135M_lora_single_device \
  "checkpointer.checkpoint_dir=$model" "tokenizer.path=$model" "output_dir=$tmp/out" \
  epochs=1 max_steps_per_epoch=2 batch_size=2 >"$tmp/run.log" 2>&1 \
  || { cat "$tmp/run.log" >&2; exit 1; }
steps=$(wc -l < "$tmp/out/logs/metrics.jsonl")
[ "$steps" = 2 ] || { echo "expected 2 logged steps, got $steps" >&2; exit 1; }
[ -s "$tmp/out/epoch_0/adapter_model.safetensors" ] || { echo "no adapter written" >&2; exit 1; }
echo "wheel: $wheel ($(( size / 1024 / 1024 )) MiB, $size bytes): --version, env and 2 LoRA steps OK"
