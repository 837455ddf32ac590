#!/usr/bin/env bash
# Preference and reward-model training on SmolLM2-135M-Instruct, CPU: ferrotune's recipes beside
# TRL's trainers (benchmarks/posttrain_trl.py, TRL from scripts/fetch-trl.sh's venv), the same model
# folder, rows, LoRA, optimizer and step count on both sides, each method's two sides run one after
# the other, ROUNDS times. Builds nothing: target/release/ferrotune must be built already.
#   DPO  : lora_dpo_single_device, DPOLoss (sigmoid)   | DPOTrainer(loss_type=["sigmoid"])
#   ORPO : lora_dpo_single_device, ORPOLoss            | trl.experimental.orpo.ORPOTrainer
#   KTO  : lora_dpo_single_device, KTOLoss + unpaired  | KTOTrainer on unpair_preference_dataset
#   RM   : lora_reward_model_single_device             | RewardTrainer (SEQ_CLS LoRA + score head)
# Rows: data/iso_dates_pairs.jsonl in file order (no shuffling), batch 2, STEPS optimizer steps.
# Reported per run: steps/s after the first 2 steps (from the end time of each step: TRL's
# on_step_end callback, ferrotune's StdoutLogger line per step, read as it is written), the wall
# time and peak RSS of the whole process (/usr/bin/time). Medians over the rounds, last, as a table.
# Usage: benchmarks/posttrain.sh [STEPS=10] [ROUNDS=2] [METHODS="dpo orpo kto reward"]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-10}; ROUNDS=${2:-2}; METHODS=${3:-"dpo orpo kto reward"}
WARM=2
FT=./target/release/ferrotune
[ -x "$FT" ] || { echo "build ferrotune first: cargo build --release -p ferrotune-cli" >&2; exit 1; }
PY="$(scripts/fetch-trl.sh)/bin/python"
assets=$(scripts/fetch-assets.sh)
DIR=${FERROTUNE_BENCH_DIR:-/tmp/ferrotune-posttrain-bench}
HF="$DIR/smollm2_hf"
DATA=$PWD/data/iso_dates_pairs.jsonl
mkdir -p "$DIR"

# The model both sides read: the Q4_1 GGUF dequantized to f32 by transformers, as an HF folder
# (weights, config, tokenizer and chat template), written once.
if [ ! -s "$HF/model.safetensors" ]; then
  echo "writing $HF (the GGUF dequantized by transformers)..." >&2
  "$PY" - "$assets/SmolLM2-135M-Instruct.Q4_1.gguf" "$HF" <<'PY' 2>/dev/null
import os, sys, torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
gguf, out = sys.argv[1], sys.argv[2]
d, f = os.path.dirname(gguf), os.path.basename(gguf)
tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
m = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
os.makedirs(out, exist_ok=True)
tied = m.config.tie_word_embeddings
sd = {k: v.contiguous() for k, v in m.state_dict().items() if not (tied and k == "lm_head.weight")}
save_file(sd, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
if hasattr(m.config, "quantization_config"):
    del m.config.quantization_config
m.config.architectures = [type(m).__name__]
m.config.save_pretrained(out)
tok.save_pretrained(out)
PY
fi

# ferrotune's side: the SmolLM2 DPO demo config (LoRA r 8, alpha 16 on q, k, v, o and the MLP; the
# pairs file's {input, chosen, rejected} as prompt, chosen, rejected) with TRL's settings above.
common=(checkpointer.checkpoint_dir="$HF" tokenizer.path="$HF" tokenizer.max_seq_len=null
  device=cpu dtype=fp32 batch_size=2 gradient_accumulation_steps=1 epochs=1 max_steps_per_epoch="$STEPS"
  shuffle=false seed=42 optimizer.lr=1e-4 optimizer.weight_decay=0.0 lr_scheduler=null clip_grad_norm=1.0
  enable_activation_checkpointing=false save_adapter_weights_only=true log_every_n_steps=1
  log_peak_memory_stats=false metric_logger._component_=torchtune.training.metric_logging.StdoutLogger
  '~metric_logger.log_dir')
ft_cmd() { # METHOD OUTDIR
  local dpo=(lora_dpo_single_device --config smollm2/135M_lora_dpo_single_device "${common[@]}" output_dir="$2")
  case $1 in
    dpo) echo "${dpo[@]}" loss._component_=torchtune.rlhf.loss.DPOLoss loss.beta=0.1 ;;
    orpo) echo "${dpo[@]}" loss._component_=torchtune.rlhf.loss.ORPOLoss loss.beta=0.1 '~loss.label_smoothing' ;;
    kto) echo "${dpo[@]}" loss._component_=torchtune.rlhf.loss.KTOLoss loss.beta=0.1 '~loss.label_smoothing' \
      dataset._component_=ferrotune.datasets.unpaired_dataset '~dataset.train_on_input' ;;
    reward) echo lora_reward_model_single_device --config llama3_2/1B_lora_reward_model "${common[@]}" output_dir="$2" \
      model._component_=torchtune.models.smollm2.lora_smollm2_135m model.lora_rank=8 model.lora_alpha=16 \
      tokenizer._component_=torchtune.models.smollm2.smollm2_tokenizer '~checkpointer.checkpoint_files' \
      dataset.source=json dataset.data_files="$DATA" dataset.column_map.prompt=input '~dataset.split' ;;
  esac
}

# Stamps each "Step N |" line of ferrotune's StdoutLogger with the seconds since the first line
# the process wrote (its start), as it arrives; prints the step end times as JSON at the end.
stamp='import sys, time, json
t0 = time.perf_counter(); ends = []
for line in sys.stdin:
    if line.startswith("Step "): ends.append(time.perf_counter() - t0)
    sys.stderr.write(line)
print(json.dumps({"step_ends_s": ends}))'

# Steps/s after the warm-up steps, from step end times in a JSON line.
rate() { python3 -c "import json,sys; e=json.loads(sys.argv[1])['step_ends_s']; w=$WARM
print(f'{(len(e)-w)/(e[-1]-e[w-1]):.3f}' if len(e) > w else 'nan')" "$1"; }

declare -A R
for round in $(seq "$ROUNDS"); do
  for m in $METHODS; do
    for side in trl ferrotune; do
      out="$DIR/out-$side-$m"; rm -rf "$out"; log="$DIR/$side-$m-$round.log"
      if [ "$side" = trl ]; then
        /usr/bin/time -f '%e %M' -o "$DIR/time" "$PY" benchmarks/posttrain_trl.py "$m" "$HF" "$DATA" \
          --steps "$STEPS" --out "$out" >"$log" 2>&1 || { tail -20 "$log" >&2; exit 1; }
        json=$(grep '^{"side"' "$log" | tail -1)
      else
        # shellcheck disable=SC2046
        /usr/bin/time -f '%e %M' -o "$DIR/time" sh -c '"$@" | python3 -c "$0"' "$stamp" \
          "$FT" run $(ft_cmd "$m" "$out") >"$log" 2>&1 || { tail -20 "$log" >&2; exit 1; }
        json=$(grep '^{"step_ends_s"' "$log" | tail -1)
        n=$(grep -c '^Step ' "$log" || true)
        [ "$n" = "$STEPS" ] || { echo "ferrotune $m logged $n steps, not $STEPS" >&2; exit 1; }
      fi
      read -r wall rss <"$DIR/time"
      sps=$(rate "$json")
      R[$side,$m,$round]="$sps $wall $((rss / 1024))"
      echo "round $round $m $side: $sps steps/s, wall ${wall} s, peak RSS $((rss / 1024)) MB" >&2
    done
  done
done

median() { python3 -c "import sys,statistics; print(statistics.median(float(x) for x in sys.argv[1:]))" "$@"; }
col() { # SIDE METHOD FIELD(1 steps/s, 2 wall, 3 rss)
  local v=(); for r in $(seq "$ROUNDS"); do v+=("$(echo "${R[$1,$2,$r]}" | cut -d' ' -f"$3")"); done; median "${v[@]}"; }
printf '\n%s, %s CPUs, SmolLM2-135M-Instruct f32, LoRA r 8, batch 2, %s steps (steps/s over steps %s-%s), median of %s rounds\n' \
  "$(date -u +%F)" "$(nproc)" "$STEPS" $((WARM + 1)) "$STEPS" "$ROUNDS"
printf '%-8s %10s %10s %9s %10s %10s %9s %8s %8s\n' method "TRL st/s" "wall s" "RSS MB" "ft st/s" "wall s" "RSS MB" "st/s x" "wall x"
for m in $METHODS; do
  ts=$(col trl "$m" 1); tw=$(col trl "$m" 2); tr=$(col trl "$m" 3)
  fs=$(col ferrotune "$m" 1); fw=$(col ferrotune "$m" 2); fr=$(col ferrotune "$m" 3)
  printf '%-8s %10.3f %10.1f %9.0f %10.3f %10.1f %9.0f %8.2f %8.2f\n' "$m" "$ts" "$tw" "$tr" "$fs" "$fw" "$fr" \
    "$(python3 -c "print($fs/$ts)")" "$(python3 -c "print($tw/$fw)")"
done
