"""The anchor for `ferrotune run dev/grpo_full_finetune_distributed`: TRL's GRPOTrainer on the same
model, prompts, group size, completion length, loss and reward, whole process.

Usage: python3 benchmarks/grpo_trl.py HF_MODEL_DIR GSM8K.jsonl [--steps 3] [--prompts 2] [--group 4]
       [--max-tokens 32]

The prompts are torchtune's GRPO text (`... User: {question}. Assistant: <think>`, the question from
the JSON Lines file's `question` column, the reference answer after `#### ` in `answer`); the reward
is torchtune's shaped correctness reward (100 / 20 / 10); the loss TRL's `grpo` with beta 0.01 and
one optimizer step per batch (torchtune's GRPOSimpleLoss is this loss), AdamW lr 1e-5, float32, CPU.
Prints the seconds of each phase and the mean completion length.
"""
import argparse
import json
import re
import time

t0 = time.perf_counter()
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

PROMPT = (
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it. "
    "The assistant first thinks about the reasoning process in the mind and then provides the user with the answer. "
    "The reasoning process and answer are enclosed within <think></think> and <answer></answer> tags, respectively, "
    "i.e., <think>reasoning process here</think> <answer>answer here</answer>. User: %s. Assistant: <think>"
)


def shaped_reward(completions, answer, **_):
    out = []
    for text, ans in zip(completions, answer):
        text = "<think>" + text.replace("<<", "").replace(">>", "")
        m = re.search(r"<answer>(.*?)</answer>", text, re.DOTALL)
        attempt = m.group(1).strip() if m else ""
        if attempt == ans:
            out.append(100.0)
        else:
            out.append(10.0 + (10.0 if ans in attempt else 0.0))
    return out


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self.t = [], None

    def on_step_begin(self, *a, **k):
        self.t = time.perf_counter()

    def on_step_end(self, *a, **k):
        self.times.append(time.perf_counter() - self.t)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    rows = [json.loads(line) for line in open(args.data)]
    ds = Dataset.from_list(
        [{"prompt": PROMPT % r["question"], "answer": r["answer"].split("#### ")[1]} for r in rows]
    )
    t1 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(args.model)
    cfg = GRPOConfig(
        output_dir="/tmp/grpo-trl-bench",
        num_generations=args.group,
        per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1,
        max_completion_length=args.max_tokens,
        max_steps=args.steps,
        learning_rate=1e-5,
        beta=0.01,
        loss_type="grpo",
        num_iterations=1,
        temperature=1.0,
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        shuffle_dataset=False,
        seed=1,
    )
    times = StepTimes()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=shaped_reward,
        args=cfg,
        train_dataset=ds,
        processing_class=tok,
        callbacks=[times],
    )
    t2 = time.perf_counter()
    trainer.train()
    t3 = time.perf_counter()
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    print(
        f"imports {t1 - t0:.2f} s, load {t2 - t1:.2f} s, train {t3 - t2:.2f} s; "
        f"steps {', '.join(f'{t:.2f}' for t in times.times)} s; "
        f"mean completion length {sum(lengths) / max(len(lengths), 1):.1f}"
    )


if __name__ == "__main__":
    main()
