#!/usr/bin/env bash
# Builds the CUDA variant here (no GPU needed) and packs what benchmarks/gpu.sh runs on the GPU
# machine into .gpu/ (git-ignored): the stripped, xz-compressed `ferrotune` (--features cuda),
# the NCCL build, the GPU kernel tests, ../shared/gpu's run-on-gpu.sh and CUDA headers, the HF +
# PEFT anchor, the HF decode anchor, the decode-step model test (it reads tests/fixtures, which the
# device tool carries with the working tree), and a tiny
# model + rows for the NCCL check. Then, with the device tool: run `bash .gpu/gpu.sh decode` (or
# `train`, or `all`) carrying [".gpu"].
# Needs the CUDA 13 toolkit: ../shared/gpu/setup-cuda13-toolkit.sh /tmp/cu
set -euo pipefail
cd "$(dirname "$0")/.."
export CUDA_HOME=${CUDA_HOME:-/tmp/cu/cuda13} CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
export PATH=$CUDA_HOME/bin:$PATH
# Under target/ (git-ignored), so a later session builds incrementally.
T=${CUDA_TARGET_DIR:-target/cuda}; TN=${NCCL_TARGET_DIR:-target/nccl}
cargo build --release -p ferrotune-cli --features cuda --target-dir "$T"
# SKIP_NCCL=1 leaves the NCCL build out (only the train mode's NCCL check needs it).
[ "${SKIP_NCCL:-0}" = 1 ] || cargo build --release -p ferrotune-cli --features nccl --target-dir "$TN"
# The path of test binary $3 of package $1 built with features $2.
test_binary() {
  cargo test --release -p "$1" --features "$2" --target-dir "$T" --test "$3" --no-run --message-format=json |
    python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]==sys.argv[1]: print(m["executable"])' "$3" | tail -1
}
# Each crate has one test binary, `it`; gpu.sh runs it filtered to the module it is packed for.
kernels=$(test_binary ferrotune-core cuda it)
decode_step=$(test_binary ferrotune-models cuda it)
mkdir -p .gpu/nccl
strip -o .gpu/ferrotune "$T/release/ferrotune"
[ "${SKIP_NCCL:-0}" = 1 ] || strip -o .gpu/ferrotune_nccl "$TN/release/ferrotune"
strip -o .gpu/cuda_kernels "$kernels"
strip -o .gpu/decode_step "$decode_step"
xz -T0 -6 -f .gpu/ferrotune .gpu/cuda_kernels .gpu/decode_step
[ -f .gpu/ferrotune_nccl ] && xz -T0 -6 -f .gpu/ferrotune_nccl
cp ../shared/gpu/run-on-gpu.sh ../shared/gpu/cuda13-include.tar.xz ../shared/bench/hf_lora.py \
  benchmarks/hf_decode.py benchmarks/gpu.sh .gpu/
# The tiny checkpoints the decode-step test reads (gpu.sh points it at .gpu/fixtures): the
# device tool sends at most 64 MiB, and tests/fixtures alone is more, so send the tree without it
# (`git rm -r --cached -q tests/fixtures`, add it to .git/info/exclude; `git reset` afterwards).
# Gemma 4's multimodal checkpoints stay out: the decode step refuses Gemma 4 anyway.
rm -rf .gpu/fixtures
for d in tests/fixtures/llama3/model tests/fixtures/qwen2/model tests/fixtures/models/*/model; do
  case $d in *gemma4*multimodal*) continue ;; esac
  mkdir -p ".gpu/fixtures/${d#tests/fixtures/}" && cp -r "$d/." ".gpu/fixtures/${d#tests/fixtures/}/"
done
rm -rf .gpu/nccl/model && cp -r tests/fixtures/llama3/model .gpu/nccl/model
python3 - <<'PY'
import json
rows=[]
for i in range(16):
    n=6+(i*5)%9
    ids=[(i*37+j*11)%500+3 for j in range(n)]
    rows.append(json.dumps({"input_ids":ids,"labels":[-100 if j<i%3 else t for j,t in enumerate(ids)]}))
open('.gpu/nccl/rows.jsonl','w').write("\n".join(rows)+"\n")
PY
cp benchmarks/gpu-nccl-config.yaml .gpu/nccl/config.yaml
du -sh .gpu
