"""Runs every built-in config end to end on the tiny fixture model of its family (one optimizer step,
CPU, f32, a local 8-row dataset holding every column the builders read): a smoke test that each
config torchtune ships works as shipped apart from paths, device and size.

Usage: python3 scripts/smoke_builtin_configs.py [NAME-or-RECIPE ...]   (after `cargo build --release`)

Skipped: eleuther_eval (its tasks come from the hub), PPO (needs classifier checkpoints; tests/it/ppo.rs)
and the SmolLM2 demos (run by their own tests). Prints one line per config and the failures' output.
"""
import json, re, subprocess, sys, time
from pathlib import Path
REPO = Path(__file__).resolve().parent.parent
BIN = str(REPO / "target" / "release" / "ferrotune")
FIX = REPO / "tests" / "fixtures" / "models"
WORK = Path("/tmp/ferrotune-smoke")
OUT = WORK / "out"; OUT.mkdir(parents=True, exist_ok=True)
data = WORK / "data.jsonl"
rows = []
for i in range(8):
    rows.append({"instruction": f"say {i}", "input": "" if i % 2 else "x y", "output": f"ok {i} done",
                 "text": f"the quick brown fox {i}", "utterance": f"wake me at {i}", "semantic_parse": f"[IN:ALARM {i} ]", "question": f"q {i}?", "response_j": "good answer",
                 "response_k": "bad", "prompt": f"p {i}", "answer": f"{i} + 1 = <<{i}+1={i+1}>>{i+1}\n#### {i+1}",
                 "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "good"}],
                 "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "bad"}]})
data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
FAM = {"llama2": "llama2", "code_llama2": "llama2", "llama3": "llama2", "llama3_1": "llama2", "llama3_3": "llama2",
       "llama3_2": "llama3_2", "mistral": "mistral", "qwen2": "qwen2_5", "qwen2_5": "qwen2_5", "qwen3": "qwen3",
       "gemma": "gemma", "gemma2": "gemma2", "phi3": "phi3", "phi4": "phi3", "smollm2": "smollm2_like",
       "deepseek_v2": "deepseek_v2",
       "gpt_oss": "gpt_oss", "qwen3_5": "qwen3_5"}
ls = subprocess.run([BIN, "ls"], capture_output=True, text=True).stdout.splitlines()[1:]
pairs = []; recipe = None
for line in ls:
    parts = line.split()
    if len(parts) == 2: recipe, cfg = parts
    else: cfg = parts[0]
    pairs.append((recipe, cfg))
only = sys.argv[1:]
fails = []
for recipe, cfg in pairs:
    if only and not any(o in cfg or o == recipe for o in only): continue
    if recipe in ("eleuther_eval", "ppo_full_finetune_single_device"): continue
    text = open(REPO / "configs" / f"{cfg}.yaml").read()
    m = re.search(r"^model:\s*\n\s*_component_: torchtune\.models\.(\w+)\.", text, re.M)
    # Configs of families torchtune has no builder for (DeepSeek's, gpt-oss) name none: their
    # folder names the family.
    fam = m.group(1) if m else cfg.split("/")[0] if cfg.split("/")[0] in FAM else "smollm2"
    meta = "FullModelMetaCheckpointer" in text
    model = FIX / ("llama2_meta" if meta else FAM[fam]) / "model"
    out = OUT / cfg.replace("/", "_")
    ov = [f"output_dir={out}", f"checkpointer.checkpoint_dir={model}", "device=cpu", "dtype=fp32"]
    if meta: ov.append("checkpointer.checkpoint_files=[consolidated.00.pth]")
    elif re.search(r"^checkpointer:(\n\s+.*)*\n\s+checkpoint_files:", text, re.M): ov.append("~checkpointer.checkpoint_files")
    if re.search(r"^\s+vocab_path:", text, re.M):
        ov += [f"tokenizer.vocab_path={model if not meta else FIX/'llama2/model'}", "~tokenizer.merges_path"]
    else:
        ov.append(f"tokenizer.path={model if not meta else FIX/'llama2/model'}")
    if recipe in ("generate", "dev/generate_v2", "dev/generate_v2_distributed", "quantize", "eval"):
        if "generate" in recipe: ov += ["max_new_tokens=4"]
        if recipe == "quantize": ov += ["quantizer.groupsize=16"]
    else:
        ov += [f"dataset.source=json", f"dataset.data_files={data}", "dataset.split=train", "max_steps_per_epoch=1",
               "epochs=1", "batch_size=2", "gradient_accumulation_steps=1", "tokenizer.max_seq_len=64"]
        if "quantizer:" in text: ov.append("quantizer.groupsize=16")
        if "teacher_checkpointer" in text:
            tm = re.search(r"teacher_model:\s*\n\s*_component_: torchtune\.models\.(\w+)\.", text)
            ov += [f"teacher_checkpointer.checkpoint_dir={FIX / FAM[tm.group(1)] / 'model'}", "~teacher_checkpointer.checkpoint_files"]
        if "ref_checkpointer" in text:
            ov += [f"ref_checkpointer.checkpoint_dir={model}", "~ref_checkpointer.checkpoint_files"]
        if "partition:" in text: ov.append("dataset.partition=0-9/10")
        if recipe == "dev/grpo_full_finetune_distributed":
            ov += ["grpo_samples=2", "max_generated_tokens=4", "num_steps=1", "forward_batch_size=1"]
    if "smollm2" in cfg and recipe != "quantize": continue  # demo configs: tested elsewhere
    cmd = [BIN, "run", recipe, "--config", cfg] + ov
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=str(WORK), timeout=600)
    dt = time.time() - t0
    status = "ok" if p.returncode == 0 else "FAIL"
    print(f"{status} {dt:5.1f}s {recipe} {cfg}", flush=True)
    if p.returncode != 0:
        fails.append((recipe, cfg, (p.stderr or p.stdout)[-400:]))
for r, c, e in fails:
    print("=====", r, c); print(e)
