#!/usr/bin/env bash
# Decode speed of SmolLM2-135M-Instruct (Q4_1 GGUF), ferrotune beside HF transformers (f32) and, when
# the llama_cpp python package is installed, llama.cpp — same prompt, same machine, same run.
# Usage: benchmarks/decode.sh [NEW_TOKENS=128] [RUNS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-128}; RUNS=${2:-3}
assets=$(scripts/fetch-assets.sh)
gguf="$assets/SmolLM2-135M-Instruct.Q4_1.gguf"
prompt="Write a short story about a robot learning to paint."
cargo build --release --quiet -p ferrotune-cli
median() { python3 -c "import sys,statistics; print(statistics.median(float(x) for x in sys.argv[1:]))" "$@"; }

pre=(); dec=()
./target/release/ferrotune generate --model "$gguf" --chat --prompt "$prompt" --max-new-tokens 8 >/dev/null 2>&1 # warm-up
for _ in $(seq "$RUNS"); do
  line=$(./target/release/ferrotune generate --model "$gguf" --chat --prompt "$prompt" \
    --max-new-tokens "$N" --ignore-eos --json 2>/dev/null | tail -1)
  pre+=("$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin)["prefill_tokens_per_s"])')")
  dec+=("$(echo "$line" | python3 -c 'import json,sys; print(json.load(sys.stdin)["decode_tokens_per_s"])')")
done
ft_pre=$(median "${pre[@]}"); ft_dec=$(median "${dec[@]}")

hf=$(python3 benchmarks/hf_generate.py --gguf "$gguf" --prompt "$prompt" --max-new-tokens "$N" --runs "$RUNS" --json 2>/dev/null | tail -1)
hf_pre=$(echo "$hf" | python3 -c 'import json,sys; print(json.load(sys.stdin)["prefill_tokens_per_s"])')
hf_dec=$(echo "$hf" | python3 -c 'import json,sys; print(json.load(sys.stdin)["decode_tokens_per_s"])')

lc_pre=n/a; lc_dec=n/a
if python3 -c "import llama_cpp" 2>/dev/null; then
  lc=$(python3 benchmarks/llamacpp_generate.py --gguf "$gguf" --prompt "$prompt" --max-new-tokens "$N" --runs "$RUNS" 2>/dev/null | tail -1)
  lc_pre=$(echo "$lc" | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["prefill_tokens_per_s"],1))')
  lc_dec=$(echo "$lc" | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["decode_tokens_per_s"],1))')
fi

printf '\n%s, %s cores, %s new tokens, median of %s runs\n' "$(date -u +%F)" "$(nproc)" "$N" "$RUNS"
printf '%-34s %14s %14s\n' "SmolLM2-135M-Instruct Q4_1" "prefill tok/s" "decode tok/s"
printf '%-34s %14.1f %14.1f\n' "HF transformers (f32)" "$hf_pre" "$hf_dec"
printf '%-34s %14s %14s\n' "llama.cpp (llama-cpp-python)" "$lc_pre" "$lc_dec"
printf '%-34s %14.1f %14.1f\n' "ferrotune (f32 numerics)" "$ft_pre" "$ft_dec"
printf '%-34s %14.2f %14.2f\n' "ferrotune / HF" "$(python3 -c "print($ft_pre/$hf_pre)")" "$(python3 -c "print($ft_dec/$hf_dec)")"
