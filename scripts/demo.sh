#!/usr/bin/env bash
# The main job: fine-tune SmolLM2-135M-Instruct on this CPU to rewrite dates as ISO 8601
# (data/README.md), printing the base model's and the fine-tuned model's answers to held-out
# prompts. Writes the LoRA adapter and the merged model under $FERROTUNE_DEMO_OUT
# (default /tmp/ferrotune/smollm2_135M/lora_single_device).
# Usage: scripts/demo.sh [extra key=value overrides for the recipe, e.g. epochs=1]
set -euo pipefail
cd "$(dirname "$0")/.."
assets=$(scripts/fetch-assets.sh)
model="$assets/SmolLM2-135M-Instruct.Q4_1.gguf"
out=${FERROTUNE_DEMO_OUT:-/tmp/ferrotune/smollm2_135M/lora_single_device}
shown=${FERROTUNE_DEMO_SHOW:-8}
cargo build --release --quiet -p ferrotune-cli
ft=./target/release/ferrotune

# Held-out prompts and answers (one JSON object per line: {"input": ..., "output": ...}).
mapfile -t inputs < <(sed -E 's/.*"input": "([^"]*)".*/\1/' data/iso_dates_heldout.jsonl)
mapfile -t answers < <(sed -E 's/.*"output": "([^"]*)".*/\1/' data/iso_dates_heldout.jsonl)
prompt_args=()
for p in "${inputs[@]}"; do prompt_args+=(--prompt "$p"); done

answer_all() { # $@: extra generate flags; prints one answer per line, in prompt order
  "$ft" generate --model "$model" --chat "${prompt_args[@]}" --max-new-tokens 16 "$@" 2>/dev/null \
    | sed -nE 's/^\[[0-9]+\] ?//p'
}

echo "== Before: SmolLM2-135M-Instruct on ${#inputs[@]} held-out prompts"
mapfile -t before < <(answer_all)

echo "== Fine-tuning (LoRA, CPU): ferrotune run lora_finetune_single_device --config smollm2/135M_lora_single_device"
start=$(date +%s)
# The demo trains afresh each time: an earlier demo's checkpoints are replaced, not resumed.
"$ft" run lora_finetune_single_device --config smollm2/135M_lora_single_device \
  "checkpointer.checkpoint_dir=$model" "tokenizer.path=$model" "output_dir=$out" \
  overwrite_output_dir=true "$@" 2>&1 \
  | grep -v '^  \|^Running\|^$' || true
final=$(ls -d "$out"/epoch_* 2>/dev/null | sort -V | tail -1)
[ -n "$final" ] || { echo "training wrote no checkpoint" >&2; exit 1; }
echo "   trained in $(( $(date +%s) - start )) s"

echo "== After: the same prompts with the adapter"
mapfile -t after < <(answer_all --adapter "$final")

ok_before=0; ok_after=0
printf '\n%-52s %-12s %-24s %s\n' "held-out prompt" "expected" "before" "after"
for i in "${!inputs[@]}"; do
  b=$(echo "${before[$i]:-}" | tr -d '\n' | cut -c1-22); a=$(echo "${after[$i]:-}" | tr -d ' \n')
  [ "$(echo "${before[$i]:-}" | tr -d ' ')" = "${answers[$i]}" ] && ok_before=$((ok_before + 1))
  [ "$a" = "${answers[$i]}" ] && ok_after=$((ok_after + 1))
  if [ "$i" -lt "$shown" ]; then
    printf '%-52s %-12s %-24s %s\n' "${inputs[$i]#Convert to ISO date: }" "${answers[$i]}" "$b" "$a"
  fi
done
echo
echo "exact match on ${#inputs[@]} held-out prompts: before $ok_before, after $ok_after"
echo "adapter (PEFT):        $final"
echo "merged model (HF):     $final/merged"
echo "metrics:               $out/logs/metrics.jsonl   (ferrotune plot $out)"
