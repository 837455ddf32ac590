#!/usr/bin/env bash
# Runs the CUDA kernels (decode step, training elementwise kernels, flash attention) on the CPU:
# compiles kernels.cu with HIP-CPU (a header-only HIP runtime that runs kernels as fibers) against
# a C++ reference of each kernel (harness.cpp), for a
# machine without a GPU. Not part of the test suite: it needs HIP-CPU's sources (github.com/ROCm/HIP-CPU,
# header-only) and oneTBB (Debian: libtbb-dev).
#   scripts/emulate-kernels.sh /path/to/HIP-CPU
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
hip="${1:?usage: $0 /path/to/HIP-CPU}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
g++ -std=c++17 -O2 -fno-strict-aliasing -DNDEBUG -I "$here/emulate-kernels" -I "$hip/include" \
  "$here/emulate-kernels/harness.cpp" -o "$out/harness" -ltbb -lpthread
"$out/harness" "${@:2}"   # a second argument "flash" runs only the flash-attention cases
