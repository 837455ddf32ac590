#!/usr/bin/env python3
"""KTO references from TRL's own `KTOTrainer` (trl 1.16.0) for ferrotune's `KTOLoss`.

A real `KTOTrainer` trains the tiny Llama (tests/fixtures/llama3/model, f32, CPU) with its PEFT
adapter (tests/fixtures/llama3/adapter; the reference is the model with the adapter disabled: TRL's
"ref" copy of a pretrained adapter is deleted after the trainer is built, so TRL takes its own
adapters-disabled path) for one step of SGD (lr 1, no clipping, constant
schedule, no weight decay) on four unpaired rows (prompt, completion, label), one device batch:
TRL's collator builds the KL rows by rotating the completions by +1 within the batch.

Recorded in tests/fixtures/kto/golden.json, per case (loss_type, beta, desirable_weight,
undesirable_weight): the collated ids and masks TRL trained on (main and KL rows), the labels,
TRL's logged loss and metrics of that step; and tests/fixtures/kto/{case}_adapter.safetensors:
the adapter after the step (PEFT names without `.default`).

Full fine-tuning (case `full_kto`): the same step with every weight trained against a frozen copy of
the model as TRL's `ref_model`; tests/fixtures/kto/full_kto_model.safetensors holds the weights after
the step (transformers' names).

Conversational rows (`conversational` in golden.json): a paired conversational dataset (prompt,
chosen, rejected as message lists) as `KTOTrainer` prepares it: unpaired by
`unpair_preference_dataset`, tokenized through the model's chat template; TRL's prompt and
completion ids and labels, in its order. The same for paired rows without a prompt column, text
and conversational (`implicit_text`, `implicit_conversational`: TRL's `extract_prompt` first).

Run from the repository root (TRL in a venv that keeps the system torch/transformers):
    "$(scripts/fetch-trl.sh)/bin/python" scripts/make_kto_fixtures.py
The tests read the committed outputs; they do not run this script.
"""
import json
import os
import tempfile

import torch
import trl
from datasets import Dataset
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import KTOConfig, KTOTrainer
from trl_one_step import load_f32, one_step_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
POLICY = os.path.join(ROOT, "llama3", "model")
ADAPTER = os.path.join(ROOT, "llama3", "adapter")
OUT = os.path.join(ROOT, "kto")

ROWS = {
    "prompt": ["The sky is", "Two plus two is", "A cat says", "Water boils at"],
    # Chosen so that the KL estimate is positive (TRL clamps it at 0).
    "completion": [" five, surely not four", " blue today", " meow", " a low heat of ten"],
    "label": [True, False, True, False],
}
CASES = {
    "kto": dict(loss_type="kto", beta=0.3, desirable_weight=1.0, undesirable_weight=1.0),
    "kto_weighted": dict(loss_type="kto", beta=0.7, desirable_weight=1.3, undesirable_weight=0.6),
    "apo_zero_unpaired": dict(loss_type="apo_zero_unpaired", beta=0.4, desirable_weight=1.0,
                              undesirable_weight=0.8),
}


def run_case(name, settings, tok, golden):
    torch.manual_seed(0)
    base = load_f32(AutoModelForCausalLM, POLICY)
    model = PeftModel.from_pretrained(base, ADAPTER, is_trainable=True)
    dataset = Dataset.from_dict(ROWS)
    with tempfile.TemporaryDirectory() as out:
        args = one_step_config(KTOConfig, out, len(ROWS["label"]), **settings)
        trainer = KTOTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok)
        # TRL copies a pretrained adapter into a "ref" adapter and uses it as the reference; with it
        # gone, TRL's own fallback (the path of an adapter it creates from `peft_config`) runs the
        # reference with every adapter disabled, as ferrotune's LoRA recipes (torchtune's) do.
        trainer.model.delete_adapter("ref")
        trainer.model.set_adapter("default")
        assert "ref" not in trainer.model.peft_config
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(ROWS["label"]))])
        trainer.train()
        log = trainer.state.log_history[0]
        adapter = {
            k.replace(".default", ""): p.detach().clone().contiguous()
            for k, p in trainer.model.named_parameters()
            if p.requires_grad
        }
    save_file(adapter, os.path.join(OUT, f"{name}_adapter.safetensors"))
    golden[name] = {
        **settings,
        "batch": {k: v.tolist() for k, v in batch.items() if isinstance(v, torch.Tensor)},
        "log": log,
    }
    print(name, {k: v for k, v in log.items()})


def run_full(tok, golden):
    name, settings = "full_kto", CASES["kto"]
    torch.manual_seed(0)
    load = lambda: load_f32(AutoModelForCausalLM, POLICY)
    model, ref = load(), load()
    dataset = Dataset.from_dict(ROWS)
    with tempfile.TemporaryDirectory() as out:
        args = one_step_config(KTOConfig, out, len(ROWS["label"]), **settings)
        trainer = KTOTrainer(model=model, ref_model=ref, args=args, train_dataset=dataset, processing_class=tok)
        trainer.train()
        log = trainer.state.log_history[0]
        weights = {k: p.detach().clone().contiguous() for k, p in trainer.model.named_parameters()}
    save_file(weights, os.path.join(OUT, f"{name}_model.safetensors"))
    golden[name] = {**settings, "log": log}
    print(name, log)


CONVERSATIONAL = {
    "prompt": [[{"role": "user", "content": "The sky is"}], [{"role": "user", "content": "A cat says"}]],
    "chosen": [[{"role": "assistant", "content": "blue"}], [{"role": "assistant", "content": "meow"}]],
    "rejected": [[{"role": "assistant", "content": "five"}], [{"role": "assistant", "content": "a low heat"}]],
}


# Implicit prompts (no prompt column): TRL's `extract_prompt` takes the longest common prefix of
# chosen and rejected (messages, or characters, less a trailing space).
IMPLICIT = {
    "implicit_text": {
        "chosen": ["The sky is blue", "A cat says meow"],
        "rejected": ["The sky is green", "A cat says woof"],
    },
    "implicit_conversational": {
        "chosen": [
            [{"role": "user", "content": "The sky is"}, {"role": "assistant", "content": "blue"}],
            [{"role": "user", "content": "A cat says"}, {"role": "assistant", "content": "meow"}],
        ],
        "rejected": [
            [{"role": "user", "content": "The sky is"}, {"role": "assistant", "content": "five"}],
            [{"role": "user", "content": "A cat says"}, {"role": "assistant", "content": "a low heat"}],
        ],
    },
}


def prepared(tok, rows):
    """The rows as `KTOTrainer` prepares them: TRL's prompt and completion ids and labels."""
    base = load_f32(AutoModelForCausalLM, POLICY)
    with tempfile.TemporaryDirectory() as out:
        args = KTOConfig(output_dir=out, per_device_train_batch_size=2, report_to=[], use_cpu=True,
                         train_sampling_strategy="sequential")
        trainer = KTOTrainer(model=base, args=args, train_dataset=Dataset.from_dict(rows), processing_class=tok)
        ds = trainer.train_dataset
        return {
            "rows": rows,
            "prompt_ids": [r["prompt_ids"] for r in ds],
            "completion_ids": [r["completion_ids"] for r in ds],
            "label": [r["label"] for r in ds],
        }


def conversational(tok, golden):
    golden["conversational"] = prepared(tok, CONVERSATIONAL)
    for name, rows in IMPLICIT.items():
        golden[name] = prepared(tok, rows)


def main():
    os.makedirs(OUT, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(POLICY)
    golden = {"trl": trl.__version__, "rows": ROWS, "eos_token_id": tok.eos_token_id,
              "pad_token_id": tok.pad_token_id}
    for name, settings in CASES.items():
        run_case(name, settings, tok, golden)
    run_full(tok, golden)
    conversational(tok, golden)
    json.dump(golden, open(os.path.join(OUT, "golden.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
