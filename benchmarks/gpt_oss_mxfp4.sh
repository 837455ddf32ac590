#!/usr/bin/env bash
# QLoRA on gpt-oss with its MXFP4 experts held packed against the same run with them dequantized
# on load (FERROTUNE_MXFP4_PACKED=0), alternating, ROUNDS rounds: peak RSS (/usr/bin/time), the
# "QLoRA:" weight lines and tokens/s of the steps after the first (metrics.jsonl).
#
#   cargo build --release -p ferrotune-cli
#   python3 benchmarks/make_gpt_oss_mxfp4_shape.py /tmp/ferrotune-gpt-oss-mxfp4-bench
#   benchmarks/gpt_oss_mxfp4.sh [/tmp/ferrotune-gpt-oss-mxfp4-bench] [ROUNDS] [STEPS] [OVERRIDES...]
#
# (OVERRIDES: config overrides for both runs, e.g. model.target_parameters=null for LoRA on the
# attention only.)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODEL=${1:-/tmp/ferrotune-gpt-oss-mxfp4-bench}
ROUNDS=${2:-2}
STEPS=${3:-4}
shift $(($# < 3 ? $# : 3))
EXTRA=("$@")
BIN=${BIN:-$ROOT/target/release/ferrotune}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
python3 - "$WORK/data.jsonl" <<'PY'
import json, random, sys
rng = random.Random(1)
with open(sys.argv[1], "w") as f:
    for _ in range(64):
        ids = [rng.randrange(4, 512) for _ in range(256)]
        f.write(json.dumps({"input_ids": ids, "labels": ids}) + "\n")
PY
cat > "$WORK/config.yaml" <<YAML
output_dir: $WORK/out
model:
  lora_attn_modules: [q_proj, v_proj]
  lora_rank: 8
  lora_alpha: 16
  quantize_base: true
  target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]
tokenizer:
  path: $MODEL
checkpointer:
  checkpoint_dir: $MODEL
  output_dir: \${output_dir}
dataset:
  _component_: torchtune.datasets.tokenized_dataset
  source: json
  data_files: $WORK/data.jsonl
seed: 7
shuffle: false
batch_size: 2
epochs: 1
max_steps_per_epoch: $STEPS
save_adapter_weights_only: true
optimizer:
  _component_: torch.optim.AdamW
  lr: 1e-4
lr_scheduler: null
loss:
  _component_: torch.nn.CrossEntropyLoss
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: \${output_dir}/logs
log_every_n_steps: 1
log_peak_memory_stats: true
device: cpu
dtype: fp32
YAML
run() { # name, packed switch
    rm -rf "$WORK/out"
    FERROTUNE_MXFP4_PACKED=$2 /usr/bin/time -v "$BIN" run lora_finetune_single_device \
        --config "$WORK/config.yaml" ${EXTRA[@]+"${EXTRA[@]}"} >"$WORK/log" 2>&1 || { cat "$WORK/log"; exit 1; }
    python3 - "$1" "$WORK" <<'PY'
import json, re, sys
name, work = sys.argv[1], sys.argv[2]
log = open(f"{work}/log").read()
rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", log).group(1)) / 1024
lines = [json.loads(l) for l in open(f"{work}/out/logs/metrics.jsonl") if '"loss"' in l]
tps = [l["tokens_per_second"] for l in lines[1:] if "tokens_per_second" in l]
loss = [round(l["loss"], 5) for l in lines]
qlora = "; ".join(m.strip() for m in re.findall(r"QLoRA: ([^\n]*)", log))
print(f"{name:12s} peak RSS {rss:7.0f} MB  tokens/s {sum(tps)/max(len(tps),1):7.1f}  losses {loss}  [{qlora}]")
PY
}
for r in $(seq "$ROUNDS"); do
    run packed 1
    run dequantized 0
done
