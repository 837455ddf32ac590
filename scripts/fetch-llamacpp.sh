#!/usr/bin/env bash
# Builds, once, a Python virtual environment with llama-cpp-python 0.3.36 compiled from its source
# package on PyPI (the same pinned llama.cpp as scripts/fetch-llamacpp-src.sh: qwen35, qwen35moe,
# qwen3next, gpt-oss, deepseek2). The k-quant references (scripts/make_kquant_fixtures.py: its
# libllama's `llama_model_quantize`, libggml's `ggml_quantize_chunk`) and the run-in-llama.cpp check
# (scripts/check_gguf_export.py --llamacpp) use it; the tests read the committed outputs, not this.
# The build is kept small: no -march=native (the same library on any x86-64 with AVX2), no tests,
# examples, tools or server, no libcurl; it runs at low priority (`nice`). --system-site-packages
# reuses the system's numpy, torch, transformers and gguf; --no-deps keeps pip from replacing them.
# Re-running is a no-op once the venv holds this pin.
# Usage: LLAMACPP_PY="$(scripts/fetch-llamacpp.sh)/bin/python"   (prints the venv's folder last;
# FERROTUNE_LLAMACPP_VENV overrides it; FERROTUNE_LLAMACPP_JOBS the build's parallelism, default 2)
set -euo pipefail
PIN="llama-cpp-python==0.3.36"
EXTRA="diskcache==5.6.3"
VENV=${FERROTUNE_LLAMACPP_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/ferrotune/llamacpp-venv}
stamp="$VENV/.ferrotune-pins"
if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$PIN $EXTRA" ]; then
  echo "building llama-cpp-python into $VENV ($PIN, from source: this takes a while)..." >&2
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  # The sdist itself, from the package index (scripts/pypi_sdist.py).
  sdist=$(python3 "$(dirname "$0")/pypi_sdist.py" "$tmp" "${PIN%%==*}" "${PIN##*==}")
  rm -rf "$VENV"
  python3 -m venv --system-site-packages "$VENV"
  export CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF -DLLAVA_BUILD=OFF \
-DLLAMA_BUILD_COMMON=ON"
  export CMAKE_BUILD_PARALLEL_LEVEL=${FERROTUNE_LLAMACPP_JOBS:-2}
  nice -n 10 "$VENV/bin/python" -m pip install --disable-pip-version-check --no-deps \
    --no-cache-dir "$sdist" $EXTRA >&2
  echo "$PIN $EXTRA" > "$stamp"
fi
echo "$VENV"
