#!/usr/bin/env python3
"""Reward-model references from TRL's own `RewardTrainer` (trl 1.16.0) for ferrotune's
`full_reward_model_single_device` and `lora_reward_model_single_device`.

The model is the tiny `LlamaForSequenceClassification` of tests/fixtures/ppo/reward (num_labels 1,
pad_token_id 3, f32, CPU) with the tokenizer and chat template of tests/fixtures/llama3/model. A real
`RewardTrainer` trains it for one step of SGD (lr 1, no clipping, constant schedule, no weight
decay, dropout off as TRL's `disable_dropout` leaves it) on three preference rows, one device batch
of chosen rows then rejected rows, right-padded with the pad id; the reward of a row is the `score`
head at its last token that is not the pad id (transformers' `GenericForSequenceClassification`).

Cases (tests/fixtures/reward_model/golden.json, per case: the rows, the collated ids TRL trained
on, TRL's logged loss and metrics of that step, and transformers' rewards of the collated rows
after the step):
  full: every weight; text rows with an explicit prompt (TRL appends the EOS to the responses, then
        tokenizes prompt + response with the tokenizer's special tokens), a `margin` column and
        `center_rewards_coefficient` 0.01. Weights after the step: full_after.safetensors.
  grpo: the start model as a GRPO reward function (TRL's GRPOTrainer: prompt + completion
        encoded without special tokens, right-padded, logits[:, 0]) on three rows: its rewards.
  lora: a PEFT LoRA adapter (task_type SEQ_CLS, r 4, alpha 8, q_proj and v_proj, random A and B,
        written first to lora_start/) with `score` trained in full (PEFT's modules_to_save for
        SEQ_CLS); conversational rows (prompt and responses as messages, rendered with the chat
        template, no EOS added). The adapter after the step, PEFT's saved names:
        lora_after.safetensors.

Run from the repository root (TRL in a venv that keeps the system torch/transformers/peft):
    "$(scripts/fetch-trl.sh)/bin/python" scripts/make_reward_model_fixtures.py
The tests read the committed outputs; they do not run this script.

With two arguments it checks ferrotune's checkpoints of the two cases instead (the `epoch_0` folders
of a full and a LoRA run of crates/ferrotune-cli/tests/it/reward_model.rs): transformers loads the
full one as LlamaForSequenceClassification, PEFT the adapter as PeftModelForSequenceClassification,
and both score TRL's rows as TRL's weights do:
    "$(scripts/fetch-trl.sh)/bin/python" scripts/make_reward_model_fixtures.py FULL_DIR LORA_DIR
"""
import json
import os
import sys
import tempfile

import peft
import torch
import transformers
import trl
from datasets import Dataset
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from trl import RewardConfig, RewardTrainer
from trl_one_step import load_f32, one_step_config

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
START = os.path.join(ROOT, "ppo", "reward")
TOKENIZER = os.path.join(ROOT, "llama3", "model")
OUT = os.path.join(ROOT, "reward_model")

TEXT_ROWS = {
    "prompt": ["The sky is", "Two plus two is", "A cat says"],
    "chosen": [" five, surely not four", " four", " meow, then it sleeps"],
    "rejected": [" blue today", " a low heat of ten", " woof"],
    "margin": [0.5, 0.0, 1.25],
}
CHAT_ROWS = {
    "prompt": [
        [{"role": "user", "content": "What color is the sky?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Two plus two?"}],
        [{"role": "user", "content": "What does a cat say?"}],
    ],
    "chosen": [
        [{"role": "assistant", "content": "Blue."}],
        [{"role": "assistant", "content": "Five."}],
        [{"role": "assistant", "content": "Meow, mostly."}],
    ],
    "rejected": [
        [{"role": "assistant", "content": "Green, with purple dots."}],
        [{"role": "assistant", "content": "Four."}],
        [{"role": "assistant", "content": "Woof."}],
    ],
}
GRPO_ROWS = {
    "prompts": ["The sky is", "The sky is", "Two plus two is"],
    "completions": [" blue", " green and very loud today", " four"],
}
LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def load_start():
    return load_f32(AutoModelForSequenceClassification, START, num_labels=1)


def train(model, rows, tok, settings):
    dataset = Dataset.from_dict(rows)
    with tempfile.TemporaryDirectory() as out:
        args = one_step_config(RewardConfig, out, len(rows["chosen"]), **settings)
        trainer = RewardTrainer(model=model, args=args, train_dataset=dataset, processing_class=tok)
        n = len(rows["chosen"])
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(n)])
        trainer.train()
        log = trainer.state.log_history[0]
    model.eval()
    with torch.no_grad():
        after = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return batch, log, after.squeeze(-1).tolist()


def check(full_dir, lora_dir):
    """transformers (full) and PEFT (LoRA) load ferrotune's saved reward models and score TRL's
    collated rows as the goldens say TRL's weights score them."""
    golden = json.load(open(os.path.join(OUT, "golden.json")))
    full = AutoModelForSequenceClassification.from_pretrained(full_dir, dtype=torch.float32)
    base = load_start()
    base.config.pad_token_id = golden["pad_token_id"]
    lora = PeftModel.from_pretrained(base, lora_dir)
    assert type(lora).__name__ == "PeftModelForSequenceClassification"
    for name, model in (("full", full), ("lora", lora)):
        batch = golden[name]["batch"]
        model.eval()
        with torch.no_grad():
            got = model(input_ids=torch.tensor(batch["input_ids"]),
                        attention_mask=torch.tensor(batch["attention_mask"])).logits[:, 0]
        want = torch.tensor(golden[name]["rewards_after"])
        print(name, "ferrotune's checkpoint:", got.tolist(), "TRL's weights:", want.tolist())
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), name


def main():
    if len(sys.argv) == 3:
        return check(sys.argv[1], sys.argv[2])
    os.makedirs(OUT, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    golden = {
        "trl": trl.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "torch": torch.__version__,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
    }

    # Full: every weight.
    torch.manual_seed(0)
    model = load_start()
    settings = dict(center_rewards_coefficient=0.01)
    batch, log, after = train(model, TEXT_ROWS, tok, settings)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()},
              os.path.join(OUT, "full_after.safetensors"))
    golden["full"] = {**settings, "rows": TEXT_ROWS, "batch": {k: v.tolist() for k, v in batch.items()},
                      "log": log, "rewards_after": after}
    print("full", log)

    # LoRA: random A and B (so that both get a gradient), score trained in full.
    torch.manual_seed(1)
    base = load_start()
    model = get_peft_model(base, LoraConfig(task_type="SEQ_CLS", init_lora_weights=False, **LORA))
    start_dir = os.path.join(OUT, "lora_start")
    model.save_pretrained(start_dir)
    # The adapter's base is the classifier the tests name; PEFT records the folder it came from.
    cfg_path = os.path.join(start_dir, "adapter_config.json")
    cfg = json.load(open(cfg_path))
    cfg["base_model_name_or_path"] = None
    cfg["target_modules"] = sorted(cfg["target_modules"])  # a set: its order varies by run
    json.dump(cfg, open(cfg_path, "w"), indent=2, sort_keys=True)
    if os.path.exists(os.path.join(start_dir, "README.md")):
        os.remove(os.path.join(start_dir, "README.md"))
    batch, log, after = train(model, CHAT_ROWS, tok, {})
    adapter = {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}
    save_file(adapter, os.path.join(OUT, "lora_after.safetensors"))
    golden["lora"] = {"lora": LORA, "rows": CHAT_ROWS, "batch": {k: v.tolist() for k, v in batch.items()},
                      "log": log, "rewards_after": after}
    print("lora", log, sorted(adapter))

    # GRPO with the reward model as a reward function: TRL's GRPOTrainer joins prompt and
    # completion (text), encodes without special tokens, right-pads and takes logits[:, 0].
    reward_tok = AutoTokenizer.from_pretrained(START)
    model = load_start()
    model.config.pad_token_id = reward_tok.pad_token_id
    texts = [p + c for p, c in zip(GRPO_ROWS["prompts"], GRPO_ROWS["completions"])]
    inputs = reward_tok(text=texts, return_tensors="pt", padding=True, padding_side="right",
                        add_special_tokens=False)
    with torch.no_grad():
        scores = model(**inputs).logits[:, 0]
    golden["grpo"] = {**GRPO_ROWS, "input_ids": inputs["input_ids"].tolist(), "rewards": scores.tolist()}
    print("grpo", scores.tolist())

    json.dump(golden, open(os.path.join(OUT, "golden.json"), "w"), indent=1)
    with open(os.path.join(OUT, "text.jsonl"), "w") as f:
        for i in range(len(TEXT_ROWS["chosen"])):
            f.write(json.dumps({k: v[i] for k, v in TEXT_ROWS.items()}) + "\n")
    with open(os.path.join(OUT, "chat.jsonl"), "w") as f:
        for i in range(len(CHAT_ROWS["chosen"])):
            f.write(json.dumps({k: v[i] for k, v in CHAT_ROWS.items()}) + "\n")


if __name__ == "__main__":
    main()
