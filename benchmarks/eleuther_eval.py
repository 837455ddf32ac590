"""eleuther_eval beside lm-evaluation-harness on the same documents and model, one process each.

Builds a workload from the fixture documents (tests/fixtures/eleuther/data: each document
repeated `--copies` times, each copy's question numbered so that no two requests are the same), writes task YAMLs
for both sides (the harness's own task files included, the documents read from local JSON Lines),
then times, alternately `--rounds` times:
  - lm-eval 0.4.x's HFLM (transformers, f32, the GGUF dequantized) with batch size 8, as
    torchtune's recipe drives it;
  - `ferrotune run eleuther_eval` on the same GGUF with batch size 8.
Prints each side's wall time, its evaluation time (its own report) and the metrics.

Run: /tmp/hfenv/bin/python benchmarks/eleuther_eval.py --ferrotune target/release/ferrotune \
       --gguf ~/.cache/ferrotune/assets/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import lm_eval

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "tests", "fixtures", "eleuther", "data")
TASKS_DIR = os.path.join(os.path.dirname(lm_eval.__file__), "tasks")
GENERATION_TASKS = {"gsm8k": ("gsm8k/gsm8k.yaml", "test", "gsm8k_test")}
TASKS = {
    "truthfulqa_mc2": ("truthfulqa/truthfulqa_mc2.yaml", "validation", "truthfulqa_mc"),
    "hellaswag": ("hellaswag/hellaswag.yaml", "validation", "hellaswag"),
    "arc_easy": ("arc/arc_easy.yaml", "test", "arc_easy"),
}


# Which field of each dataset varies between copies, so that no two requests are the same
# (the harness computes identical requests once).
VARIED = ("question", "ctx_a")


def distinct(doc, k):
    doc = dict(doc)
    for key in VARIED:
        if key in doc:
            doc[key] = f"{doc[key]} ({k + 1})"
    return doc


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ferrotune", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--copies", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--generation",
        action="store_true",
        help="GSM8K instead: 5 examples drawn from the train split, greedy generation, filters",
    )
    args = ap.parse_args()
    tasks = GENERATION_TASKS if args.generation else TASKS
    gguf = os.path.abspath(os.path.expanduser(args.gguf))
    work = tempfile.mkdtemp()
    harness_dir, ours_dir = os.path.join(work, "harness"), os.path.join(work, "ours")
    os.makedirs(harness_dir)
    os.makedirs(ours_dir)
    for task, (yaml_rel, split, stem) in tasks.items():
        docs = [json.loads(l) for l in open(os.path.join(DATA, stem + ".jsonl"))]
        path = os.path.join(work, stem + ".jsonl")
        with open(path, "w") as f:
            for k in range(args.copies):
                for d in docs:
                    f.write(json.dumps(distinct(d, k)) + "\n")
        other = "validation" if split == "test" else "test"
        if args.generation:
            # Few-shot examples from the fixture's train split.
            train = os.path.join(DATA, "gsm8k_train.jsonl")
            body = (
                f"task: bench_{task}\ntag: []\ndataset_path: json\ndataset_name: null\n"
                f"dataset_kwargs:\n  data_files:\n    train: {train}\n    {split}: {path}\n"
            )
        else:
            body = (
                f"task: bench_{task}\ntag: []\ndataset_path: json\ndataset_name: null\n"
                f"dataset_kwargs:\n  data_files:\n    {split}: {path}\n"
                f"training_split: null\n{other}_split: null\n{split}_split: {split}\n"
            )
        with open(os.path.join(harness_dir, f"bench_{task}.yaml"), "w") as f:
            f.write(f"include: {os.path.join(TASKS_DIR, yaml_rel)}\n" + body)
        with open(os.path.join(ours_dir, f"bench_{task}.yaml"), "w") as f:
            f.write(f"include: {task}\n" + body)
    names = [f"bench_{t}" for t in tasks]

    harness_script = f"""
import time, json
t0 = time.time()
from lm_eval.evaluator import evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
lm = HFLM(pretrained={os.path.dirname(gguf)!r}, gguf_file={os.path.basename(gguf)!r},
          dtype="float32", batch_size=8, device="cpu", max_length=4096)
tasks = TaskManager(include_path={harness_dir!r}).load({names!r})
for task in tasks["tasks"].values():
    task.set_fewshot_seed(seed=1234)
t1 = time.time()
out = evaluate(lm, tasks, bootstrap_iters=0)
t2 = time.time()
print("RESULT", json.dumps({{"eval_s": t2 - t1, "metrics": {{k: {{m.replace(",none", ""): v for m, v in r.items() if "," in m and "stderr" not in m}} for k, r in out["results"].items()}}}}))
"""
    cfg = os.path.join(work, "cfg.yaml")
    with open(cfg, "w") as f:
        f.write(
            f"output_dir: {work}\ncheckpointer:\n  checkpoint_dir: {gguf}\n  output_dir: {work}\n"
            f"tokenizer:\n  path: {gguf}\ndevice: cpu\ndtype: fp32\nseed: 1234\n"
            f"tasks: {json.dumps(names)}\nlimit: null\nmax_seq_length: 4096\nbatch_size: 8\n"
            f"include_path: {ours_dir}\nquantizer: null\n"
        )

    rows = []
    for r in range(args.rounds):
        t0 = time.time()
        p = subprocess.run([sys.executable, "-c", harness_script], capture_output=True, text=True)
        wall = time.time() - t0
        line = next((l for l in p.stdout.splitlines() if l.startswith("RESULT ")), None)
        if line is None:
            sys.exit(p.stderr[-3000:])
        res = json.loads(line[7:])
        rows.append(("lm-eval HFLM", r + 1, wall, res["eval_s"], res["metrics"]))

        t0 = time.time()
        p = subprocess.run([args.ferrotune, "run", "eleuther_eval", "--config", cfg], capture_output=True, text=True)
        wall = time.time() - t0
        if p.returncode != 0:
            sys.exit(p.stderr[-3000:])
        eval_s = float(re.search(r"Eval completed in ([0-9.]+) seconds", p.stderr).group(1))
        metrics = json.loads(p.stdout.strip().splitlines()[-1])
        metrics = {k: {m: v for m, v in d.items() if m != "samples" and "stderr" not in m} for k, d in metrics.items()}
        rows.append(("ferrotune", r + 1, wall, eval_s, metrics))

    n_docs = sum(len(open(os.path.join(DATA, s + ".jsonl")).read().splitlines()) for _, _, s in tasks.values()) * args.copies
    print(f"{n_docs} documents ({', '.join(tasks)}), SmolLM2-135M f32, batch 8, CPU threads: {os.cpu_count()}")
    print("| side | round | wall s | eval s | metrics |")
    print("|---|---|---|---|---|")
    for side, r, wall, ev, m in rows:
        short = "; ".join(f"{t.removeprefix('bench_')} " + ", ".join(f"{k} {float(v):.4f}" for k, v in sorted(d.items())) for t, d in sorted(m.items()))
        print(f"| {side} | {r} | {wall:.1f} | {ev:.1f} | {short} |")


if __name__ == "__main__":
    main()
