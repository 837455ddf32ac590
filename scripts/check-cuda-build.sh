#!/usr/bin/env bash
# Checks that the CUDA build is one binary for the CPU and NVIDIA GPUs: it builds
# `--features cuda` (FEATURES=nccl for the NCCL build) and checks that the binary needs no CUDA
# library to start (none in its ELF NEEDED list: cudarc loads the driver, cuBLAS, cuBLASLt, cuRAND,
# NVRTC and NCCL at run time, and the CUDA runtime is linked statically), then, with
# LD_LIBRARY_PATH unset:
#   - on a machine without the NVIDIA driver: `--version`, `env` (which must say there is no
#     driver), `generate` and two steps of `smollm2/135M_lora_single_device` on the CPU, and the
#     same generate and recipe with `device: cuda`, which must fail with a one-line error naming
#     libcuda.so.1 and what to install (no panic);
#   - on a machine with the driver (and the CUDA libraries on the loader path): `env`, and the
#     generate and the two recipe steps with `device: cuda`.
# Slow (a clean CUDA build compiles candle's kernels: 10+ minutes on 2 cores), so it is a
# developer check, not part of scripts/test.sh (CI builds and tests the default, CPU-only build).
# Needs a CUDA 13 toolkit to build (CUDA_HOME, default /tmp/cu/cuda13; CUDA_COMPUTE_CAP, default
# 90) and the SmolLM2 GGUF scripts/fetch-assets.sh fetches. No GPU needed.
# Usage: scripts/check-cuda-build.sh   (builds under target/cuda, or $CUDA_TARGET_DIR, as
#        benchmarks/gpu-pack.sh does; BUILD=0 checks an existing binary, FT=path checks that one)
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_HOME=${CUDA_HOME:-/tmp/cu/cuda13} CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export PATH=$CUDA_HOME/bin:$PATH
T=${CUDA_TARGET_DIR:-target/cuda}
FEATURES=${FEATURES:-cuda}
if [ "${BUILD:-1}" = 1 ]; then
  cargo build --release -p ferrotune-cli --features "$FEATURES" --target-dir "$T"
fi
ft=$(realpath "${FT:-$T/release/ferrotune}")
fail() { echo "FAIL: $*" >&2; exit 1; }
assets=$(scripts/fetch-assets.sh)
model="$assets/SmolLM2-135M-Instruct.Q4_1.gguf"
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# 1. No CUDA library is needed to start.
needed=$(readelf -d "$ft" | grep NEEDED || true)
echo "$needed" | grep -Eq 'lib(cuda|cudart|cublas|cublasLt|curand|nvrtc|nccl)\.so' &&
  fail "the binary links CUDA libraries at build time:"$'\n'"$needed"
echo "ok: no CUDA library in the binary's NEEDED list ($(echo "$needed" | wc -l) entries)"

unset LD_LIBRARY_PATH
run() { # $1: device; runs the CLI steps, output under $tmp/$1.*
  local dev=$1 rc=0
  "$ft" generate --model "$model" --prompt "The capital of France is" --max-new-tokens 8 \
    --device "$dev" >"$tmp/$dev.gen.out" 2>"$tmp/$dev.gen.err" || rc=$?
  echo "$rc" >"$tmp/$dev.gen.rc"
  rc=0
  "$ft" run lora_finetune_single_device --config smollm2/135M_lora_single_device \
    "checkpointer.checkpoint_dir=$model" "tokenizer.path=$model" "output_dir=$tmp/out-$dev" \
    epochs=1 max_steps_per_epoch=2 batch_size=2 "device=$dev" >"$tmp/$dev.run.out" 2>"$tmp/$dev.run.err" || rc=$?
  echo "$rc" >"$tmp/$dev.run.rc"
}
two_steps() { # $1: device; the recipe ran two logged steps and wrote its adapter
  [ "$(cat "$tmp/$1.run.rc")" = 0 ] || { cat "$tmp/$1.run.err" >&2; fail "recipe on $1 failed"; }
  [ "$(wc -l <"$tmp/out-$1/logs/metrics.jsonl")" = 2 ] || fail "recipe on $1: expected 2 logged steps"
  [ -s "$tmp/out-$1/epoch_0/adapter_model.safetensors" ] || fail "recipe on $1: no adapter written"
  echo "ok: two LoRA steps on $1 ($(tail -1 "$tmp/out-$1/logs/metrics.jsonl"))"
}
generated() { # $1: device
  [ "$(cat "$tmp/$1.gen.rc")" = 0 ] && [ -s "$tmp/$1.gen.out" ] ||
    { cat "$tmp/$1.gen.err" >&2; fail "generate on $1 failed"; }
  echo "ok: generate on $1: $(tr '\n' ' ' <"$tmp/$1.gen.out")"
}

"$ft" --version
"$ft" env --no-measure >"$tmp/env.out" || fail "ferrotune env failed"
grep -q "features: cuda yes" "$tmp/env.out" || fail "env: not a CUDA build"
if grep -q "NVIDIA driver: none found" "$tmp/env.out"; then
  grep -q "device cuda: not available: the NVIDIA driver (libcuda.so.1) not found" "$tmp/env.out" ||
    fail "env does not say that device cuda is unavailable:"$'\n'"$(cat "$tmp/env.out")"
  echo "ok: env says: $(grep -E 'NVIDIA driver|device cuda' "$tmp/env.out" | tr -s ' ' | paste -sd'|')"
  run cpu
  generated cpu
  two_steps cpu
  run cuda
  for step in gen run; do
    err="$tmp/cuda.$step.err"
    [ "$(cat "$tmp/cuda.$step.rc")" != 0 ] || fail "$step with device cuda succeeded without a driver"
    grep -q panicked "$err" && fail "$step with device cuda panicked:"$'\n'"$(cat "$err")"
    [ "$(grep -c '^error:' "$err")" = 1 ] || fail "$step with device cuda: not one error line:"$'\n'"$(cat "$err")"
    line=$(grep '^error:' "$err")
    [[ $line == *libcuda.so.1*"install the NVIDIA driver"* ]] ||
      fail "$step with device cuda: the error does not name libcuda.so.1 and the driver: $line"
    echo "ok: $step with device cuda exits $(cat "$tmp/cuda.$step.rc"): $line"
  done
else
  # A machine with the driver: the GPU is used (run by the session that has a GPU: issue 45).
  grep -E "NVIDIA driver|cuda:|device cuda|cuBLAS|NCCL" "$tmp/env.out"
  grep -q "device cuda: the driver and CUDA libraries load" "$tmp/env.out" ||
    fail "a driver is there but device cuda cannot load its libraries"
  run cuda
  generated cuda
  two_steps cuda
fi
echo "check-cuda-build: all checks passed ($ft)"
