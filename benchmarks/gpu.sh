#!/usr/bin/env bash
# Everything measured on the GPU (packed by benchmarks/gpu-pack.sh, run on the GPU machine from
# .gpu/), in one call per mode; logs go to $OUT and a short summary is printed last.
#   decode: the GPU kernel tests (training and decode kernels), the decode step against the
#           forward's ops and its CUDA graph replays against kernel launches for every tiny
#           family, `bench decode` on the Llama-3.1-8B shape (graphs, kernels without graphs and
#           forward ops, against the bandwidth bound) beside HF transformers (hf_decode.py:
#           dynamic cache) and the previous build (ferrotune_old.xz, when packed), one round of
#           LoRA training beside HF + PEFT, then in the time left a 3900-token prompt and
#           transformers' static cache + torch.compile, and the LoRA step with the chunked
#           attention (FERROTUNE_ATTN=chunked) for a before/after of the flash kernels; decode
#           without programmatic dependent launch (FERROTUNE_PDL=0) for a before/after of it.
#           Sized for one device call.
#   train:  the loss of a small shape in f32 and bf16 (to set beside the CPU f32 run); NCCL at world
#           size 1 against single device (LoRA and full fine-tuning); `bench ops`; ferrotune beside
#           HF + PEFT (hf_lora.py) on the Llama-3.1-8B shape, alternating; activation checkpointing
#           and full fine-tuning per layer (for docs/src/distributed.md).
#   all:    both.
MODE=${1:-decode}
cd "$(dirname "$0")"
ROOT=$(cd .. && pwd)
for f in ferrotune ferrotune_old cuda_kernels decode_step ferrotune_nccl; do
  [ -f $f.xz ] || continue
  [ -x $f ] || python3 -c "import lzma,shutil;shutil.copyfileobj(lzma.open('$f.xz'),open('$f','wb'))"; chmod +x $f
done
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
# The tiny checkpoints the decode-step test reads: packed into .gpu/fixtures when the working tree
# is sent without tests/fixtures (the device tool's 64 MiB limit), else the repository's.
FIXTURES=$ROOT/tests/fixtures; [ -d fixtures ] && FIXTURES=$PWD/fixtures
R=./run-on-gpu.sh; F="$R ./ferrotune"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/gpu.txt
timeout 120 $R ./cuda_kernels cuda_kernels:: --test-threads=1 --nocapture > $OUT/kernels.log 2>&1; krc=$?; echo "kernels rc=$krc" >> $OUT/kernels.log
# If the kernels fail: this build without its newest parts (the flash kernels, programmatic
# dependent launch) when that passes, else a previous, verified build (ferrotune_old.xz, if packed).
if [ $krc -ne 0 ]; then
  FERROTUNE_ATTN=chunked FERROTUNE_PDL=0 timeout 120 $R ./cuda_kernels cuda_kernels:: --test-threads=1 --nocapture > $OUT/kernels_chunked.log 2>&1
  if [ $? -eq 0 ]; then export FERROTUNE_ATTN=chunked FERROTUNE_PDL=0; echo "USING FERROTUNE_ATTN=chunked FERROTUNE_PDL=0" >> $OUT/kernels.log
  elif [ -x ferrotune_old ]; then F="$R ./ferrotune_old"; echo "USING ferrotune_old" >> $OUT/kernels.log; fi
fi
if [ "$MODE" = decode ] || [ "$MODE" = all ]; then
  # The acceptance numbers first (ferrotune, then transformers on the same GPU), then the decode
  # step's checks against the forward, then whatever fits in the time left (the device tool's
  # budget is one call of under 10 minutes, machine start included).
  DEC="bench decode --shape llama3_1_8b --device cuda --dtype bf16 --prompt 128 --new-tokens 128 --runs 3 --json"
  timeout 150 $F $DEC > $OUT/decode_1.log 2>&1
  # If that failed outright: the same without programmatic launch, without graphs, then with the
  # forward's ops, to see which part broke.
  if [ $? -ne 0 ]; then
    if FERROTUNE_PDL=0 timeout 100 $F $DEC > $OUT/decode_nopdl.log 2>&1; then export FERROTUNE_PDL=0
    else FERROTUNE_CUDA_GRAPHS=0 timeout 100 $F $DEC > $OUT/decode_nographs.log 2>&1 ||
      FERROTUNE_DECODE_KERNELS=0 timeout 100 $F $DEC > $OUT/decode_ops.log 2>&1; fi
  fi
  timeout 150 python3 hf_decode.py --shape llama3_1_8b --device cuda --dtype bfloat16 --prompt 128 --new-tokens 128 > $OUT/hf_decode_1.log 2>&1
  # The previous build (ferrotune_old.xz, when packed) on the same GPU, for a before/after.
  [ -x ferrotune_old ] && timeout 120 $R ./ferrotune_old $DEC > $OUT/decode_old.log 2>&1
  # This build without programmatic dependent launch (before/after), unless run above already.
  [ -f $OUT/decode_nopdl.log ] || FERROTUNE_PDL=0 timeout 100 $F $DEC > $OUT/decode_nopdl.log 2>&1
  FERROTUNE_TEST_FIXTURES=$FIXTURES timeout 150 $R ./decode_step decode_step:: --test-threads=1 --nocapture > $OUT/decode_step.log 2>&1
  echo "decode_step rc=$?" >> $OUT/decode_step.log
  # LoRA training beside HF + PEFT once (the train mode measures it twice, alternating).
  if [ "$MODE" = decode ] && [ $SECONDS -lt 300 ]; then
    timeout 90 $F bench train --shape llama3_1_8b --device cuda --dtype bf16 --seq 2048 --batch 2 --steps 5 --json > $OUT/ft_lora_1.log 2>&1
    timeout 120 python3 hf_lora.py --shape llama3_1_8b --device cuda --dtype bfloat16 --seq 2048 --batch 2 > $OUT/hf_lora_1.log 2>&1
    # The same step with the chunked attention instead of the flash kernels (before/after).
    [ $SECONDS -lt 360 ] && FERROTUNE_ATTN=chunked timeout 90 $F bench train --shape llama3_1_8b --device cuda \
      --dtype bf16 --seq 2048 --batch 2 --steps 5 --json > $OUT/ft_lora_chunked.log 2>&1
  fi
  # A long cache (split attention over 4096 positions), if time is still left.
  [ $SECONDS -lt 420 ] && timeout $((500 - SECONDS)) $F bench decode --shape llama3_1_8b \
    --device cuda --dtype bf16 --prompt 3900 --new-tokens 64 --runs 1 > $OUT/decode_long.log 2>&1
  [ -x ferrotune_old ] && [ $SECONDS -lt 440 ] && timeout $((500 - SECONDS)) $R ./ferrotune_old bench decode \
    --shape llama3_1_8b --device cuda --dtype bf16 --prompt 3900 --new-tokens 64 --runs 1 > $OUT/decode_long_old.log 2>&1
  # transformers' fastest decode (static cache, CUDA graphs through torch.compile), in the time left.
  [ "$MODE" = decode ] && [ $SECONDS -lt 400 ] && timeout $((520 - SECONDS)) python3 hf_decode.py --shape llama3_1_8b \
    --device cuda --dtype bfloat16 --prompt 128 --new-tokens 128 --runs 2 --cache static --compile > $OUT/hf_decode_static.log 2>&1
fi
if [ "$MODE" = train ] || [ "$MODE" = all ]; then
for d in "cuda f32" "cuda bf16"; do set -- $d
  timeout 240 $F bench train --shape smollm2_135m --device $1 --dtype $2 --seq 256 --batch 2 --steps 1 --json > $OUT/loss_lora_$1_$2.log 2>&1
  timeout 240 $F bench train --shape smollm2_135m --full --device $1 --dtype $2 --seq 256 --batch 2 --steps 1 --json > $OUT/loss_full_$1_$2.log 2>&1
done
# NCCL (world size 1) against single device, LoRA and full fine-tuning, sharding full.
if [ -x ferrotune_nccl ]; then
  D=$PWD/nccl; sed -e "s|MODEL|$D/model|g; s|DATA|$D/rows.jsonl|g" nccl/config.yaml > /tmp/nccl_cfg.yaml
  N="$R ./ferrotune_nccl"
  for kind in lora full; do
    timeout 120 $N run ${kind}_finetune_single_device --config /tmp/nccl_cfg.yaml output_dir=/tmp/n_${kind}_single > $OUT/nccl_${kind}_single.log 2>&1
    FERROTUNE_DIST_BACKEND=nccl timeout 120 $N run ${kind}_finetune_distributed --config /tmp/nccl_cfg.yaml output_dir=/tmp/n_${kind}_dist fsdp_sharding=full > $OUT/nccl_${kind}_dist.log 2>&1
    FERROTUNE_DIST_BACKEND=nccl timeout 120 $N run --nproc-per-node 1 ${kind}_finetune_distributed --config /tmp/nccl_cfg.yaml output_dir=/tmp/n_${kind}_dist1 fsdp_sharding=none > $OUT/nccl_${kind}_dist1.log 2>&1
    python3 - $kind >> $OUT/nccl_compare.txt <<'PY'
import json,sys
k=sys.argv[1]
def L(d):
    try: return [json.loads(l)['loss'] for l in open(f'/tmp/n_{k}_{d}/logs/metrics.jsonl')]
    except Exception as e: return str(e)
s,a,b=L('single'),L('dist'),L('dist1')
ok=lambda x: isinstance(x,list) and isinstance(s,list) and len(x)==len(s) and max(abs(p-q)/abs(q) for p,q in zip(x,s))<=1e-5
print(k, 'steps', len(s) if isinstance(s,list) else s, 'nccl(full) equal:', ok(a), 'nccl(none,launcher) equal:', ok(b))
print(' single', s); print(' nccl  ', a); print(' nccl1 ', b)
PY
    grep -h 'NCCL\|nccl\|backend' $OUT/nccl_${kind}_dist.log | head -3 >> $OUT/nccl_compare.txt
  done
fi
timeout 120 $F bench ops --device cuda --dtype bf16 > $OUT/ops.log 2>&1
FERROTUNE_ATTN=chunked timeout 120 $F bench ops --device cuda --dtype bf16 > $OUT/ops_chunked.log 2>&1
for i in 1 2; do
  timeout 200 $F bench train --shape llama3_1_8b --device cuda --dtype bf16 --seq 2048 --batch 2 --steps 5 --json > $OUT/ft_lora_$i.log 2>&1
  timeout 200 python3 hf_lora.py --shape llama3_1_8b --device cuda --dtype bfloat16 --seq 2048 --batch 2 > $OUT/hf_lora_$i.log 2>&1
done
timeout 200 $F bench train --shape llama3_1_8b --device cuda --dtype bf16 --seq 2048 --batch 2 --steps 3 --activation-checkpointing --json > $OUT/ft_lora_ckpt.log 2>&1
timeout 300 $F bench train --shape llama3_1_8b --qlora --device cuda --dtype bf16 --seq 2048 --batch 2 --steps 3 --json > $OUT/ft_qlora.log 2>&1
for l in 4 8; do
  timeout 200 $F bench train --shape llama3_1_8b --layers $l --full --device cuda --dtype bf16 --seq 2048 --batch 2 --steps 3 --json > $OUT/ft_full_$l.log 2>&1
  timeout 200 $F bench train --shape llama3_1_8b --layers $l --full --activation-checkpointing --device cuda --dtype bf16 --seq 2048 --batch 2 --steps 3 --json > $OUT/ft_full_ckpt_$l.log 2>&1
done
fi
echo "== kernels"; grep -E 'panicked|test result|rc=' -A2 $OUT/kernels.log | head -20
if [ "$MODE" = decode ] || [ "$MODE" = all ]; then
  echo "== decode step vs forward ops"; grep -E 'panicked|test result|rc=|differ' $OUT/decode_step.log | head -10
  echo "== decode 8B bf16 (ferrotune | HF dynamic cache), then HF static + compile"
  grep -v '^\s*$' $OUT/decode_1.log | tail -n 9
  [ -f $OUT/decode_old.log ] && { echo "-- previous build"; grep -E 'decode  |of bound' $OUT/decode_old.log; }
  for f in nopdl nographs ops; do [ -f $OUT/decode_$f.log ] && { echo "-- decode_$f"; grep -v '^\s*$' $OUT/decode_$f.log | tail -n 9; }; done
  echo "-- warnings"; grep -ih 'warn\|error\|panic' $OUT/decode_*.log | head -8
  tail -n 1 $OUT/hf_decode_1.log; tail -n 2 $OUT/hf_decode_static.log 2>/dev/null
  echo "== decode 8B bf16, prompt 3900 (split attention)"; grep -v '^\s*$' $OUT/decode_long.log 2>/dev/null | tail -n 9
  [ -f $OUT/decode_long_old.log ] && { echo "-- previous build"; grep -E 'decode  |of bound' $OUT/decode_long_old.log; }
fi
if [ "$MODE" = decode ] && [ -f $OUT/ft_lora_1.log ]; then
  echo "== 8B LoRA seq 2048 batch 2 (ferrotune | HF+PEFT | ferrotune, chunked attention)"; tail -n 1 $OUT/ft_lora_1.log; tail -n 1 $OUT/hf_lora_1.log
  [ -f $OUT/ft_lora_chunked.log ] && tail -n 1 $OUT/ft_lora_chunked.log
fi
[ "$MODE" = decode ] && exit 0
echo "== losses (last loss: cuda f32 / cuda bf16; lora then full)"; for f in lora full; do grep -h 'last loss' $OUT/loss_${f}_cuda_f32.log $OUT/loss_${f}_cuda_bf16.log | paste -sd' '; done
echo "== nccl"; cat $OUT/nccl_compare.txt 2>/dev/null | head -20
echo "== ops"; cat $OUT/ops.log
echo "-- attention, chunked"; grep -i attention $OUT/ops_chunked.log
echo "== 8B LoRA seq 2048 batch 2 (ferrotune | HF+PEFT)"; for i in 1 2; do tail -n 1 $OUT/ft_lora_$i.log; tail -n 1 $OUT/hf_lora_$i.log; done
echo "== ckpt, QLoRA, full (layers 4, 8; plain then ckpt)"; for f in ft_lora_ckpt ft_qlora ft_full_4 ft_full_ckpt_4 ft_full_8 ft_full_ckpt_8; do echo "$f $(tail -n 1 $OUT/$f.log)"; done
