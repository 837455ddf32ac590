#!/usr/bin/env bash
# Fetches, once, the llama.cpp sources the GGUF converter checks run: convert_hf_to_gguf.py, its
# conversion/ package, gguf-py/, src/ (read for layouts) and models/templates/ (the chat templates
# of real models, e.g. Meta's Llama 3.1 template with tools), taken from the llama.cpp copy inside
# llama-cpp-python's source package on PyPI (pinned below; the HF hub and GitHub are not needed).
# Used by scripts/make_gguf_fixtures.py --deepseek2-only and scripts/check_gguf_converter.py
# through LLAMA_CPP; the tests read the committed outputs, not this.
# Usage: export LLAMA_CPP="$(scripts/fetch-llamacpp-src.sh)"   (FERROTUNE_LLAMACPP_SRC overrides
# the folder)
set -euo pipefail
PIN="llama-cpp-python==0.3.36"
DEST=${FERROTUNE_LLAMACPP_SRC:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrotune/llamacpp-src}
stamp="$DEST/.ferrotune-pin"
if [ ! -f "$DEST/convert_hf_to_gguf.py" ] || [ ! -d "$DEST/models/templates" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$PIN" ]; then
  echo "fetching llama.cpp's converter sources into $DEST ($PIN)..." >&2
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # The sdist itself, from the package index's simple API: `pip download` would try to build its
  # metadata (scikit-build-core, a compiler) just to download it.
  sdist=$(python3 "$(dirname "$0")/pypi_sdist.py" "$tmp" "${PIN%%==*}" "${PIN##*==}")
  tar xzf "$sdist" -C "$tmp"
  root=$(ls -d "$tmp"/llama_cpp_python-*/vendor/llama.cpp)
  rm -rf "$DEST.partial" && mkdir -p "$DEST.partial"
  cp -r "$root/convert_hf_to_gguf.py" "$root/conversion" "$root/gguf-py" "$root/src" "$DEST.partial/"
  mkdir -p "$DEST.partial/models" && cp -r "$root/models/templates" "$DEST.partial/models/"
  echo "$PIN" > "$DEST.partial/.ferrotune-pin"
  rm -rf "$DEST" && mv "$DEST.partial" "$DEST"
fi
echo "$DEST"
