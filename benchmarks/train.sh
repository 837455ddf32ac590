#!/usr/bin/env bash
# LoRA training throughput on SmolLM2-135M-Instruct (Q4_1 GGUF dequantized to f32), ferrotune beside
# HF transformers + PEFT (benchmarks/hf_lora.py), same settings, same machine, alternating runs
# (HF, ferrotune, HF, ferrotune, ...) so that both see the same machine; medians reported.
# Usage: benchmarks/train.sh [SEQ=256] [BATCH=4] [STEPS=5] [RUNS=3] [extra ferrotune bench flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
SEQ=${1:-256}; BATCH=${2:-4}; STEPS=${3:-5}; RUNS=${4:-3}; shift $(( $# < 4 ? $# : 4 ))
assets=$(scripts/fetch-assets.sh)
gguf="$assets/SmolLM2-135M-Instruct.Q4_1.gguf"
cargo build --release --quiet -p ferrotune-cli
field() { python3 -c "import json,sys; print(json.loads(sys.stdin.read().strip().splitlines()[-1])['$1'])"; }
median() { python3 -c "import sys,statistics; print(statistics.median(float(x) for x in sys.argv[1:]))" "$@"; }

hf_tps=(); hf_step=(); hf_mem=(); ft_tps=(); ft_step=(); ft_mem=()
for r in $(seq "$RUNS"); do
  hf=$(python3 benchmarks/hf_lora.py --gguf "$gguf" --seq "$SEQ" --batch "$BATCH" --steps "$STEPS" 2>/dev/null | tail -1)
  ft=$(./target/release/ferrotune bench train --model "$gguf" --seq "$SEQ" --batch "$BATCH" --lora-rank 8 \
    --steps "$STEPS" --json "$@" 2>/dev/null | tail -1)
  hf_tps+=("$(echo "$hf" | field tokens_per_s)"); hf_step+=("$(echo "$hf" | field step_s)"); hf_mem+=("$(echo "$hf" | field peak_rss_mb)")
  ft_tps+=("$(echo "$ft" | field tokens_per_s)"); ft_step+=("$(echo "$ft" | field step_s)"); ft_mem+=("$(echo "$ft" | field peak_mem_mb)")
  echo "run $r: HF ${hf_tps[-1]} tok/s, ferrotune ${ft_tps[-1]} tok/s" >&2
done
h=$(median "${hf_tps[@]}"); f=$(median "${ft_tps[@]}")
printf '\n%s, %s CPUs, LoRA r=8 (q,k,v,o,gate,up,down), seq %s, batch %s, %s timed steps after 2 warm-up, median of %s alternating runs\n' \
  "$(date -u +%F)" "$(nproc)" "$SEQ" "$BATCH" "$STEPS" "$RUNS"
printf '%-28s %12s %10s %14s\n' "" "tokens/s" "step s" "peak RSS MB"
printf '%-28s %12.1f %10.2f %14.0f\n' "HF transformers + PEFT" "$h" "$(median "${hf_step[@]}")" "$(median "${hf_mem[@]}")"
printf '%-28s %12.1f %10.2f %14.0f\n' "ferrotune $*" "$f" "$(median "${ft_step[@]}")" "$(median "${ft_mem[@]}")"
printf '%-28s %12.2f\n' "ferrotune / HF" "$(python3 -c "print($f/$h)")"
