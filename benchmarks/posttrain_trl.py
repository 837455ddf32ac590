"""The anchor for ferrotune's preference and reward-model recipes on CPU: TRL's own trainers on the
same model, rows, LoRA and optimizer settings as benchmarks/posttrain.sh gives ferrotune, whole process.

Usage: python3 benchmarks/posttrain_trl.py METHOD HF_MODEL_DIR PAIRS.jsonl [--steps 10] [--batch 2]
       [--out DIR]
METHOD: dpo (DPOTrainer, loss_type sigmoid), orpo (ORPOTrainer), kto (KTOTrainer), reward
(RewardTrainer on a sequence classifier).

The rows are PAIRS.jsonl's {"input", "chosen", "rejected"} (data/iso_dates_pairs.jsonl), in file
order; as ferrotune reads them: DPO and ORPO as conversations (the prompt a user message, each
response an assistant message, through the chat template, as ferrotune's
`stack_exchange_paired_dataset` renders them), KTO and the reward model as text (`prompt`,
`chosen`, `rejected`; KTO's rows unpaired by TRL's `unpair_preference_dataset`). Both sides: LoRA
r 8, alpha 16, dropout 0 on q, k, v, o, gate, up and down (the reward model's `score` head trained
in full beside them), float32, CPU, batch 2 (pairs, or KTO's unpaired rows), no gradient
accumulation, AdamW lr 1e-4 without weight decay, constant learning rate, gradient clipping at
1.0, beta 0.1, no evaluation, the adapter saved once at the end.

Prints one JSON line last: the seconds of imports, load and train, the end time of each optimizer
step (seconds since the start of training), the losses, the first step's logged metrics and the
mean number of tokens per tokenized column over the rows the steps saw.
"""
import argparse
import json
import os
import time

t0 = time.perf_counter()
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainerCallback,
)

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class StepEnds(TrainerCallback):
    """The time at which each optimizer step ends (the same points ferrotune logs a step at)."""

    def __init__(self):
        self.start, self.ends = None, []

    def on_train_begin(self, *a, **k):
        self.start = time.perf_counter()

    def on_step_end(self, *a, **k):
        self.ends.append(time.perf_counter() - self.start)


def rows(path, conversational):
    out = []
    for line in open(path):
        r = json.loads(line)
        if conversational:
            out.append(
                {
                    "prompt": [{"role": "user", "content": r["input"]}],
                    "chosen": [{"role": "assistant", "content": r["chosen"]}],
                    "rejected": [{"role": "assistant", "content": r["rejected"]}],
                }
            )
        else:
            out.append({"prompt": r["input"], "chosen": r["chosen"], "rejected": r["rejected"]})
    return Dataset.from_list(out)


def common(args):
    """The trainer settings both sides share (TrainingArguments' names)."""
    return dict(
        output_dir=args.out,
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        learning_rate=1e-4,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        eval_strategy="no",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=42,
        dataloader_num_workers=0,
        train_sampling_strategy="sequential",  # file order, as ferrotune's `shuffle: false`
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("method", choices=["dpo", "orpo", "kto", "reward"])
    ap.add_argument("model")
    ap.add_argument("data")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--out", default="/tmp/posttrain-trl-bench")
    args = ap.parse_args()
    t1 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(args.model)
    lora = dict(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS)
    ends = StepEnds()
    m = args.method
    if m == "reward":
        from trl import RewardConfig, RewardTrainer

        model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=1, dtype=torch.float32)
        cfg = RewardConfig(**common(args))
        trainer = RewardTrainer(
            model=model,
            args=cfg,
            train_dataset=rows(args.data, conversational=False),
            processing_class=tok,
            peft_config=LoraConfig(task_type="SEQ_CLS", **lora),
            callbacks=[ends],
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        peft = LoraConfig(task_type="CAUSAL_LM", **lora)
        if m == "dpo":
            from trl import DPOConfig, DPOTrainer

            cfg = DPOConfig(loss_type=["sigmoid"], beta=0.1, **common(args))
            trainer = DPOTrainer(
                model=model,
                args=cfg,
                train_dataset=rows(args.data, conversational=True),
                processing_class=tok,
                peft_config=peft,
                callbacks=[ends],
            )
        elif m == "orpo":
            from trl.experimental.orpo import ORPOConfig, ORPOTrainer

            cfg = ORPOConfig(beta=0.1, **common(args))
            trainer = ORPOTrainer(
                model=model,
                args=cfg,
                train_dataset=rows(args.data, conversational=True),
                processing_class=tok,
                peft_config=peft,
                callbacks=[ends],
            )
        else:
            from trl import KTOConfig, KTOTrainer
            from trl.data_utils import unpair_preference_dataset

            cfg = KTOConfig(beta=0.1, desirable_weight=1.0, undesirable_weight=1.0, **common(args))
            trainer = KTOTrainer(
                model=model,
                args=cfg,
                train_dataset=unpair_preference_dataset(rows(args.data, conversational=False)),
                processing_class=tok,
                peft_config=peft,
                callbacks=[ends],
            )
    t2 = time.perf_counter()
    trainer.train()
    trainer.save_model(os.path.join(args.out, "adapter"))
    t3 = time.perf_counter()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    # The rows the timed steps saw: mean tokens per tokenized column (prompt, chosen, ...).
    seen = trainer.train_dataset.select(range(min(len(trainer.train_dataset), args.steps * args.batch)))
    lengths = {
        c: round(sum(len(x) for x in seen[c]) / len(seen), 1)
        for c in seen.column_names
        if c.endswith("input_ids") or c.endswith("_ids")
    }
    print(
        json.dumps(
            {
                "side": "trl",
                "method": m,
                "imports_s": round(t1 - t0, 3),
                "load_s": round(t2 - t1, 3),
                "train_s": round(t3 - t2, 3),
                "step_ends_s": [round(t, 4) for t in ends.ends],
                "losses": [h["loss"] for h in logs],
                "first_step": logs[0] if logs else None,
                "mean_tokens": lengths,
            }
        )
    )


if __name__ == "__main__":
    main()
