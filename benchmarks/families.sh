#!/usr/bin/env bash
# The 2026 families on CPU, ferrotune beside transformers + PEFT in the same run: LoRA training
# tokens/s (`ferrotune bench train --model DIR` / `hf_family.py train`) and greedy decode tokens/s
# at batch 1 (`ferrotune bench decode --model DIR` / `hf_family.py decode`) on a small
# random-weight checkpoint of each family that `hf_family.py make` writes once (shapes there).
# Runs alternate (transformers, ferrotune, transformers, ...) so both see the same machine;
# medians are reported.
# Usage: benchmarks/families.sh [SEQ=256] [BATCH=2] [STEPS=3] [RUNS=3] [FAMILIES...]
#   FAMILIES default: qwen3_5 qwen3_5_moe qwen3_next gpt_oss deepseek_v3
#   FERROTUNE_BENCH_DIR: where the checkpoints go (default /tmp/ferrotune-families-bench)
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ=${1:-256}; BATCH=${2:-2}; STEPS=${3:-3}; RUNS=${4:-3}; shift $(( $# < 4 ? $# : 4 ))
FAMILIES=("$@"); [ ${#FAMILIES[@]} -gt 0 ] || FAMILIES=(qwen3_5 qwen3_5_moe qwen3_next gpt_oss deepseek_v3)
DIR=${FERROTUNE_BENCH_DIR:-/tmp/ferrotune-families-bench}
mkdir -p "$DIR"
cargo build --release --quiet -p ferrotune-cli
ft=./target/release/ferrotune
field() { python3 -c "import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['$1'])"; }
median() { python3 -c "import sys,statistics; print(statistics.median(float(x) for x in sys.argv[1:]))" "$@"; }

rows=()
for fam in "${FAMILIES[@]}"; do
  [ -f "$DIR/$fam/config.json" ] || python3 benchmarks/hf_family.py make "$fam" "$DIR/$fam" >&2
  ht=(); hm=(); ftt=(); fm=(); hd=(); fd=()
  for r in $(seq "$RUNS"); do
    h=$(python3 benchmarks/hf_family.py train "$DIR/$fam" --seq "$SEQ" --batch "$BATCH" --steps "$STEPS" 2>/dev/null | tail -1)
    f=$($ft bench train --model "$DIR/$fam" --seq "$SEQ" --batch "$BATCH" --lora-rank 8 --steps "$STEPS" --json 2>/dev/null | tail -1)
    ht+=("$(echo "$h" | field tokens_per_s)"); hm+=("$(echo "$h" | field peak_rss_mb)")
    ftt+=("$(echo "$f" | field tokens_per_s)"); fm+=("$(echo "$f" | field peak_mem_mb)")
    h=$(python3 benchmarks/hf_family.py decode "$DIR/$fam" --prompt 64 --new-tokens 64 --runs 3 2>/dev/null | tail -1)
    f=$($ft bench decode --model "$DIR/$fam" --prompt 64 --new-tokens 64 --runs 3 --json 2>/dev/null | tail -1)
    hd+=("$(echo "$h" | field tokens_per_s)"); fd+=("$(echo "$f" | field decode_tokens_per_s)")
    echo "$fam run $r: train HF ${ht[-1]} / ferrotune ${ftt[-1]} tok/s; decode HF ${hd[-1]} / ferrotune ${fd[-1]} tok/s" >&2
  done
  rows+=("$(printf '| %s | %.1f | %.1f | %.2f× | %.0f | %.0f | %.1f | %.1f | %.2f× |' "$fam" \
    "$(median "${ht[@]}")" "$(median "${ftt[@]}")" "$(python3 -c "print($(median "${ftt[@]}")/$(median "${ht[@]}"))")" \
    "$(median "${hm[@]}")" "$(median "${fm[@]}")" \
    "$(median "${hd[@]}")" "$(median "${fd[@]}")" "$(python3 -c "print($(median "${fd[@]}")/$(median "${hd[@]}"))")")")
done
printf '\n%s, %s CPUs, f32, LoRA r 8 on q/k/v/o/gate/up/down, seq %s, batch %s, %s timed steps after 2 warm-up; decode: prompt 64 + 64 greedy tokens, batch 1; median of %s alternating runs\n\n' \
  "$(date -u +%F)" "$(nproc)" "$SEQ" "$BATCH" "$STEPS" "$RUNS"
echo "| family | train tok/s transformers | ferrotune | ratio | peak RSS MB transformers | ferrotune | decode tok/s transformers | ferrotune | ratio |"
echo "|---|---|---|---|---|---|---|---|---|"
printf '%s\n' "${rows[@]}"
