"""ferrotune's fine-tuning recipes beside torchtune's own (0.6.1's `recipes/*.py`, run on the CPU as
torchtune runs them: the distributed ones under torchrun as one rank, gloo, FSDP2): the same model,
rows, batches, loss and optimizer, whole process each; each step's loss from both logs.

Usage: python3 benchmarks/torchtune_recipes.py --ferrotune target/release/ferrotune \
           --model HF_LLAMA_DIR [--recipe RECIPE] [--torchtune-src /tmp/tt/src] [--steps 4] [--rounds 2]

RECIPE: dev/early_exit_finetune_distributed (the default), full_finetune_single_device,
full_finetune_distributed, lora_finetune_single_device (0.6.1's lora_finetune_distributed
initializes NCCL whatever the device, so it cannot run on a CPU).
HF_LLAMA_DIR: a Llama-architecture HF folder (model.safetensors, tokenizer.json), e.g.
SmolLM2-135M-Instruct as f32. Rows: 64 TOPv2-style requests (utterance -> semantic parse),
tokenized with the model's tokenizer.json, the utterance masked; given to both sides already
tokenized (torchtune: a small dataset module written here; ferrotune:
`torchtune.datasets.tokenized_dataset`), in order (no shuffling). Both: batch 8, float32, AdamW
(weight decay 0.01), activation checkpointing, `--steps` optimizer steps, the final checkpoint
written. The early-exit recipe takes the settings of torchtune's llama2/7B_full_early_exit (early
exits on layers "0::4" with the rotational curriculum and sum_l_loss_scale, layer dropout 0.2 with
the exp scale, lr 2e-5); full fine-tuning lr 2e-5; LoRA r=8, alpha 16 on q, v, o and the MLP, lr
3e-4 with torchtune's cosine schedule (2 warm-up steps). torchtune's model is its llama3_2 (or
lora_llama3_2) builder with the checkpoint's dimensions (scale_factor 1: plain RoPE), read by its
FullModelHFCheckpointer. Its recipes need CPU shims (their setup logs accelerator memory, which
torchtune refuses on a CPU; 0.6.1 imports torchao names later torchao moved; see SITECUSTOMIZE) and
the early-exit one `fsdp_reshard_after_forward: false` (its early-exit loss calls the root's norm
and head outside the root's forward, where FSDP2 would otherwise leave them sharded). LoRA's A
matrices start from each side's own random draws, so only the first step's loss (B = 0: the base
model's) can agree exactly; later ones agree to the draws' effect.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SITECUSTOMIZE = '''
# torchtune 0.6.1 imports torchao names that later torchao releases moved; this recipe quantizes
# nothing, so the two modules are stubbed (the NF4 one by scripts/torchtune_source.py).
import sys, types
try:
    import torchao.dtypes.nf4tensor  # noqa: F401
except Exception:
    sys.path.insert(0, SCRIPTS_DIR)
    from torchtune_source import install_nf4_stub
    install_nf4_stub()
try:
    import torchao.dtypes
    torchao.dtypes.TensorCoreTiledLayout  # noqa: B018
except Exception:
    q = types.ModuleType("torchtune.training.quantization")
    q.get_quantizer_mode = lambda quantizer: None
    sys.modules["torchtune.training.quantization"] = q
# The recipe logs accelerator memory at setup unconditionally, which torchtune refuses on a CPU,
# and resets device memory statistics before training, which torch.cpu lacks: CPU no-ops.
import gc  # noqa: E402
import torchtune.training as _training  # noqa: E402
_training.get_memory_stats = lambda device, reset_stats=True: {}
_training.log_memory_stats = lambda *a, **k: None
_training.cleanup_before_training = gc.collect
'''

DATA_MODULE = '''
import json
import torch


class _Rows(torch.utils.data.Dataset):
    def __init__(self, path):
        self.rows = [json.loads(line) for line in open(path)]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def rows_dataset(tokenizer, path):
    """Pre-tokenized rows: `tokens` and `labels` (unshifted, as 0.6.1's SFTDataset makes them: its
    recipes shift them)."""
    return _Rows(path)


class _PadOnly:
    def __init__(self, pad_id):
        self.pad_id = pad_id


def pad_tokenizer(pad_id):
    """All the recipe reads of its tokenizer when the rows come tokenized: the padding id."""
    return _PadOnly(pad_id)
'''

VERBS = ["set an alarm for", "remind me to call", "what is the weather in", "navigate to",
         "how long will it take to get to", "wake me up at"]
PLACES = ["7 am", "mom", "Boston", "the office", "downtown", "6:30 tomorrow", "Paris", "noon"]


def rows(tokenizer_json):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = 2
    out = []
    for i in range(64):
        verb, place = VERBS[i % len(VERBS)], PLACES[(i * 3) % len(PLACES)]
        utterance = f"{verb} {place}"
        intent = verb.split()[0].upper()
        parse = f"[IN:{intent} [SL:ARG {place} ] ]"
        prompt = tok.encode(utterance + "\n", add_special_tokens=False).ids
        answer = tok.encode(parse, add_special_tokens=False).ids + [eos]
        ids = prompt + answer
        labels = [-100] * len(prompt) + answer
        out.append((ids, labels))
    return out


def peak(stderr):
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", stderr)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    secs = 0.0
    for part in wall.group(1).split(":"):
        secs = secs * 60 + float(part)
    return secs, int(rss.group(1)) / 1e6


# Each recipe: torchtune's script (under 0.6.1's recipes/), whether torchrun launches it, the model
# builder (lora_ or not), ferrotune's built-in config to start from (None: written here), the loss
# and optimizer settings, and extra top-level YAML.
RECIPES = {
    "dev/early_exit_finetune_distributed": dict(
        script="dev/early_exit_finetune_distributed.py", torchrun=True, lora=False,
        builtin="llama2/7B_full_early_exit", lr="2e-5", scheduler=False,
        extra="""
# The recipe's early-exit loss runs the root module's norm and head outside its forward: under
# FSDP2 with resharding after forward they are still sharded there, and it fails.
fsdp_reshard_after_forward: false
early_exit_loss:
  layers: "0::4"
  curriculum: torchtune.modules.early_exit_loss.RotationalEarlyExitCurriculum
  scale_fn: torchtune.modules.early_exit_loss.sum_l_loss_scale
  scale: 1.0
layer_dropout:
  prob: 0.2
  layers: ":"
  layers_scale: "exp"
  disable_on_eval: true
"""),
    "full_finetune_single_device": dict(
        script="full_finetune_single_device.py", torchrun=False, lora=False, builtin=None,
        lr="2e-5", scheduler=False, extra=""),
    "full_finetune_distributed": dict(
        script="full_finetune_distributed.py", torchrun=True, lora=False, builtin=None,
        lr="2e-5", scheduler=False, extra=""),
    "lora_finetune_single_device": dict(
        script="lora_finetune_single_device.py", torchrun=False, lora=True, builtin=None,
        lr="3e-4", scheduler=True, extra=""),
    # lora_finetune_distributed is left out: 0.6.1's initializes NCCL whatever the device.
}

LORA_KEYS = """  lora_attn_modules: [q_proj, v_proj, output_proj]
  apply_lora_to_mlp: true
  apply_lora_to_output: false
  lora_rank: 8
  lora_alpha: 16
  lora_dropout: 0.0
"""


def common_yaml(spec, out, steps):
    """The settings both sides share, after `model`, `tokenizer`, `dataset` and `checkpointer`."""
    scheduler = """lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 2
""" if spec["scheduler"] else ""
    return f"""resume_from_checkpoint: false
batch_size: 8
epochs: 1
seed: 42
shuffle: false
optimizer:
  _component_: torch.optim.AdamW
  fused: true
  lr: {spec["lr"]}
  weight_decay: 0.01
{scheduler}loss:
  _component_: torch.nn.CrossEntropyLoss
max_steps_per_epoch: {steps}
gradient_accumulation_steps: 1
clip_grad_norm: null
compile: false
optimizer_in_bwd: false
device: cpu
enable_activation_checkpointing: true
enable_activation_offloading: false
dtype: fp32
save_adapter_weights_only: false
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: {out}/logs
log_every_n_steps: 1
log_peak_memory_stats: false
profiler:
  _component_: torchtune.training.setup_torch_profiler
  enabled: false
{spec["extra"]}"""


def torchtune_run(args, spec, work, model_dir, data, steps, c, pad):
    out = work / "tt_out"
    theta = c.get("rope_theta") or c.get("rope_parameters", {}).get("rope_theta", 10000.0)
    builder = "lora_llama3_2" if spec["lora"] else "llama3_2"
    cfg = f"""output_dir: {out}
tokenizer:
  _component_: eebench_data.pad_tokenizer
  pad_id: {pad}
dataset:
  _component_: eebench_data.rows_dataset
  path: {data}
model:
  _component_: torchtune.models.llama3_2._component_builders.{builder}
  vocab_size: {c["vocab_size"]}
  num_layers: {c["num_hidden_layers"]}
  num_heads: {c["num_attention_heads"]}
  num_kv_heads: {c["num_key_value_heads"]}
  embed_dim: {c["hidden_size"]}
  max_seq_len: 2048
  intermediate_dim: {c["intermediate_size"]}
  rope_base: {int(theta)}
  norm_eps: {c["rms_norm_eps"]}
  scale_factor: 1
  tie_word_embeddings: {str(c.get("tie_word_embeddings", False)).lower()}
{LORA_KEYS if spec["lora"] else ""}checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {model_dir}
  checkpoint_files: [model.safetensors]
  recipe_checkpoint: null
  output_dir: {out}
  model_type: LLAMA3_2
""" + common_yaml(spec, out, steps)
    (work / "tt.yaml").write_text(cfg)
    env = dict(os.environ, PYTHONPATH=f"{work}:{args.torchtune_src}",
               OMP_NUM_THREADS=str(os.cpu_count()))
    script = str(Path(args.torchtune_src) / "recipes" / spec["script"])
    if spec["torchrun"]:
        launch = [str(Path(sys.executable).parent / "torchrun"), "--standalone",
                  "--nproc_per_node", "1", script]
    else:
        launch = [sys.executable, script]
    p = subprocess.run(["/usr/bin/time", "-v", *launch, "--config", str(work / "tt.yaml")],
                       env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"torchtune failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    log = next((out / "logs").glob("*.txt")).read_text()
    losses = [float(m.group(1)) for m in re.finditer(r"loss:([0-9.eE+-]+)", log)]
    return losses, *peak(p.stderr)


def ferrotune_run(args, spec, work, model_dir, data, steps):
    out = work / "ft_out"
    if spec["builtin"]:
        cfg = spec["builtin"]
        extra = [f"checkpointer.checkpoint_dir={model_dir}", "~checkpointer.checkpoint_files",
                 f"tokenizer.path={model_dir}",
                 "dataset._component_=torchtune.datasets.tokenized_dataset", "dataset.source=json",
                 f"dataset.data_files={data}", "~dataset.column_map", "device=cpu", "dtype=fp32",
                 "shuffle=false", "seed=42", f"max_steps_per_epoch={steps}",
                 "log_peak_memory_stats=false"]
    else:
        model = "lora_llama3_2_1b" if spec["lora"] else "llama3_2_1b"
        text = f"""output_dir: {out}
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: {model_dir}
dataset:
  _component_: torchtune.datasets.tokenized_dataset
  source: json
  data_files: {data}
model:
  _component_: torchtune.models.llama3_2.{model}
{LORA_KEYS if spec["lora"] else ""}checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {model_dir}
  output_dir: {out}
  model_type: LLAMA3_2
""" + common_yaml(spec, out, steps)
        cfg = str(work / "ft.yaml")
        Path(cfg).write_text(text)
        extra = []
    cmd = [args.ferrotune, "run", args.recipe, "--config", cfg, f"output_dir={out}", *extra]
    p = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"ferrotune failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    lines = [json.loads(l) for l in (out / "logs/metrics.jsonl").read_text().splitlines()]
    return [l["loss"] for l in lines], *peak(p.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferrotune", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--torchtune-src", default="/tmp/tt/src")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--recipe", default="dev/early_exit_finetune_distributed", choices=RECIPES)
    args = ap.parse_args()
    spec = RECIPES[args.recipe]
    model_dir = Path(args.model).resolve()
    c = json.loads((model_dir / "config.json").read_text())
    pad = c.get("pad_token_id") if c.get("pad_token_id") is not None else 0
    work = Path(tempfile.mkdtemp(prefix="tt-bench-"))
    scripts = Path(__file__).resolve().parent.parent / "scripts"
    (work / "sitecustomize.py").write_text(SITECUSTOMIZE.replace("SCRIPTS_DIR", repr(str(scripts))))
    (work / "eebench_data.py").write_text(DATA_MODULE)
    rs = rows(model_dir / "tokenizer.json")
    ft_data, tt_data = work / "rows_ferrotune.jsonl", work / "rows_torchtune.jsonl"
    ft_data.write_text("".join(json.dumps({"input_ids": i, "labels": l}) + "\n" for i, l in rs))
    tt_data.write_text("".join(
        json.dumps({"tokens": i, "labels": l}) + "\n" for i, l in rs))
    results = []
    for r in range(args.rounds):
        for side in ("torchtune", "ferrotune"):
            for d in ("tt_out", "ft_out"):
                subprocess.run(["rm", "-rf", str(work / d)])
            if side == "torchtune":
                res = torchtune_run(args, spec, work, model_dir, tt_data, args.steps, c, pad)
            else:
                res = ferrotune_run(args, spec, work, model_dir, ft_data, args.steps)
            results.append((r + 1, side, *res))
            print(f"round {r + 1} {side}: wall {res[1]:.1f} s, peak RSS {res[2]:.2f} GB, "
                  f"losses {[round(x, 6) for x in res[0]]}", flush=True)
    print("\n| round | side | wall | peak RSS | losses per step |")
    print("|---|---|---|---|---|")
    for r, side, losses, wall, rss in results:
        print(f"| {r} | {side} | {wall:.1f} s | {rss:.2f} GB | "
              f"{', '.join(f'{x:.5f}' for x in losses)} |")


if __name__ == "__main__":
    main()
