#!/usr/bin/env python3
"""Direct Preference Optimization references for ferrotune's tests, computed as torchtune 0.6.1's
`lora_dpo_single_device` does (padded_collate_dpo, rlhf.get_batch_log_probs, DPOLoss / RSOLoss),
with the tiny Llama (tests/fixtures/llama3/model) and its PEFT adapter (tests/fixtures/llama3/
adapter) as the policy and the same model with the adapter disabled as the reference.

tests/fixtures/dpo/pairs.jsonl: two preference pairs, pre-tokenized as torchtune's
PreferenceDataset yields them (`chosen_input_ids`, `chosen_labels`, `rejected_input_ids`,
`rejected_labels`; the shared prompt labelled -100). Chosen and rejected responses differ in
length, so the batch is padded.
tests/fixtures/dpo/golden.json: per loss, the loss (mean over the pairs) and the metrics the
recipe logs (rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
log_probs/chosen, log_probs/rejected, logits/chosen, logits/rejected).
tests/fixtures/dpo/{dpo,rso}_grads.safetensors: d loss / d adapter parameter (PEFT names).

Run from the repository root with torch, transformers, peft and safetensors installed:
python3 scripts/make_dpo_fixtures.py
"""
import json
import os

import torch
import torch.nn.functional as F
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
OUT = os.path.join(ROOT, "dpo")
PAD = 3  # the tiny Llama's pad_token_id
BETA = 0.3
LABEL_SMOOTHING = 0.2
GAMMA = 0.4


def pairs():
    """Two pairs from the llama3 golden rows: a shared 6-token prompt, the chosen response the
    row's own continuation, the rejected one another row's, cut to another length."""
    golden = json.load(open(os.path.join(ROOT, "llama3", "golden.json")))
    rows = golden["input_ids"]
    out = []
    for i, (chosen_len, rejected_len) in enumerate([(18, 11), (9, 16)]):
        prompt = rows[i][:6]
        chosen = rows[i][6 : 6 + chosen_len]
        rejected = rows[1 - i][6 : 6 + rejected_len]
        out.append(
            {
                "chosen_input_ids": prompt + chosen,
                "chosen_labels": [-100] * len(prompt) + chosen,
                "rejected_input_ids": prompt + rejected,
                "rejected_labels": [-100] * len(prompt) + rejected,
            }
        )
    return out


def collate(batch):
    """torchtune's padded_collate_dpo: chosen rows, then rejected rows, right-padded."""
    ids = [torch.tensor(x["chosen_input_ids"]) for x in batch] + [
        torch.tensor(x["rejected_input_ids"]) for x in batch
    ]
    labels = [torch.tensor(x["chosen_labels"]) for x in batch] + [
        torch.tensor(x["rejected_labels"]) for x in batch
    ]
    pad = torch.nn.utils.rnn.pad_sequence
    return pad(ids, batch_first=True, padding_value=PAD), pad(
        labels, batch_first=True, padding_value=-100
    )


def batch_log_probs(logits, labels):
    """torchtune's rlhf.get_batch_log_probs (sum over the response tokens)."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    mask = labels != -100
    labels[labels == -100] = 0
    per_token = torch.gather(F.log_softmax(logits, dim=-1), 2, labels.unsqueeze(2)).squeeze(2)
    return (per_token * mask).sum(-1)


def main():
    os.makedirs(OUT, exist_ok=True)
    batch = pairs()
    with open(os.path.join(OUT, "pairs.jsonl"), "w") as f:
        for row in batch:
            f.write(json.dumps(row) + "\n")
    ids, labels = collate(batch)
    n = len(batch)
    out = {"beta": BETA, "label_smoothing": LABEL_SMOOTHING, "gamma": GAMMA}
    for kind in ["dpo", "rso"]:
        base = AutoModelForCausalLM.from_pretrained(
            os.path.join(ROOT, "llama3", "model"), dtype=torch.float32
        )
        model = PeftModel.from_pretrained(
            base, os.path.join(ROOT, "llama3", "adapter"), is_trainable=True
        )
        model.train()
        # No attention mask, as torchtune's recipe: padding is on the right, so causal attention
        # never lets a real token see it.
        logits = model(input_ids=ids).logits
        logps = batch_log_probs(logits, labels)
        with torch.no_grad(), model.disable_adapter():
            ref = batch_log_probs(model(input_ids=ids).logits, labels)
        pc, pr, rc, rr = logps[:n], logps[n:], ref[:n], ref[n:]
        z = (pc - pr) - (rc - rr)
        if kind == "dpo":
            losses = -F.logsigmoid(BETA * z) * (1 - LABEL_SMOOTHING) - F.logsigmoid(
                -BETA * z
            ) * LABEL_SMOOTHING
            scale = BETA
        else:
            losses = torch.relu(1 - GAMMA * z)
            scale = GAMMA
        chosen_rewards = scale * (pc - rc).detach()
        rejected_rewards = scale * (pr - rr).detach()
        loss = losses.mean()
        loss.backward()
        grads = {
            k.replace(".default", ""): p.grad.detach().clone().contiguous()
            for k, p in model.named_parameters()
            if p.requires_grad and p.grad is not None
        }
        save_file(grads, os.path.join(OUT, f"{kind}_grads.safetensors"))
        logits = logits.detach()
        out[kind] = {
            "loss": loss.item(),
            "rewards/chosen": chosen_rewards.mean().item(),
            "rewards/rejected": rejected_rewards.mean().item(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean().item(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean().item(),
            "log_probs/chosen": pc.detach().mean().item(),
            "log_probs/rejected": pr.detach().mean().item(),
            "logits/chosen": logits[:n].mean().item(),
            "logits/rejected": logits[n:].mean().item(),
        }
        print(kind, out[kind])
    json.dump(out, open(os.path.join(OUT, "golden.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
