#!/usr/bin/env python3
"""TRL's reference-free and IPO preference losses (ORPO, SimPO, CPO, IPO) as references for
ferrotune's tests, on the DPO fixture (tests/fixtures/dpo/pairs.jsonl: two pairs of unequal
lengths, right-padded as torchtune's padded_collate_dpo) with the tiny Llama and its PEFT adapter
(tests/fixtures/llama3/{model,adapter}) as the policy and, for IPO, the same model with the
adapter disabled as the reference.

The loss formulas are TRL 1.16.0's (pip download trl==1.16.0 --no-deps), transcribed literally:
TRL does not import here (its trainers import pandas, which is not installed), so its functions
cannot be called. Each transcription names its source:
- ORPO: trl/experimental/orpo/orpo_trainer.py `log1mexp`, `ORPOTrainer.odds_ratio_loss`,
  `get_batch_logps(average_log_prob=True)`, `concatenated_forward` (the chosen rows' NLL over the
  whole prompt and response: labels = input_ids where the attention mask is 1), and
  `get_batch_loss_metrics` (loss = nll - mean(beta * logsigmoid(log_odds))).
- CPO / SimPO: trl/experimental/cpo/cpo_trainer.py `cpo_loss` (loss_type "sigmoid" / "simpo",
  alpha 0), `get_batch_logps(average_log_prob=loss_type in ["ipo", "simpo"])`, the NLL over the
  chosen rows' labels, loss = mean(losses) + cpo_alpha * nll.
- IPO: trl/trainer/dpo_trainer.py `_compute_loss` loss_type "ipo": token-summed log ratios divided
  by the completion tokens, (delta - 1/(2 beta))**2, rewards beta * summed log ratios.

tests/fixtures/prefloss/golden.json: per loss, its parameters, the loss and TRL's metrics.
tests/fixtures/prefloss/{orpo,simpo,cpo,ipo}_grads.safetensors: d loss / d adapter parameter.

Run from the repository root with torch, transformers, peft and safetensors installed:
python3 scripts/make_prefloss_fixtures.py
"""
import json
import os

import torch
import torch.nn.functional as F
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
OUT = os.path.join(ROOT, "prefloss")
PAD = 3  # the tiny Llama's pad_token_id

LOSSES = {
    "orpo": {"beta": 0.3},
    "simpo": {"beta": 0.7, "simpo_gamma": 0.4, "label_smoothing": 0.1, "cpo_alpha": 0.5},
    "cpo": {"beta": 0.2, "label_smoothing": 0.15, "cpo_alpha": 0.8},
    "ipo": {"beta": 0.4},
}


def batch():
    rows = [json.loads(l) for l in open(os.path.join(ROOT, "dpo", "pairs.jsonl"))]
    seqs = [r["chosen_input_ids"] for r in rows] + [r["rejected_input_ids"] for r in rows]
    labs = [r["chosen_labels"] for r in rows] + [r["rejected_labels"] for r in rows]
    t = max(map(len, seqs))
    ids = torch.tensor([s + [PAD] * (t - len(s)) for s in seqs])
    labels = torch.tensor([l + [-100] * (t - len(l)) for l in labs])
    mask = torch.tensor([[1] * len(s) + [0] * (t - len(s)) for s in seqs])
    return ids, labels, mask, len(rows)


def get_batch_logps(logits, labels, average_log_prob):
    """TRL's get_batch_logps (decoder-only)."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != -100
    labels[labels == -100] = 0
    per_token = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    if average_log_prob:
        return (per_token * loss_mask).sum(-1) / loss_mask.sum(-1)
    return (per_token * loss_mask).sum(-1)


def cross_entropy_loss(logits, labels):
    """TRL's concatenated_forward cross_entropy_loss (decoder-only)."""
    logits = logits[..., :-1, :].contiguous()
    labels = labels[..., 1:].contiguous()
    return torch.nn.CrossEntropyLoss()(logits.view(-1, logits.shape[-1]), labels.view(-1))


def log1mexp(x):
    t = -0.6931471805599453
    return torch.where(x < t, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def main():
    os.makedirs(OUT, exist_ok=True)
    ids, labels, mask, n = batch()
    out = {}
    for kind, p in LOSSES.items():
        base = AutoModelForCausalLM.from_pretrained(
            os.path.join(ROOT, "llama3", "model"), dtype=torch.float32
        )
        model = PeftModel.from_pretrained(
            base, os.path.join(ROOT, "llama3", "adapter"), is_trainable=True
        )
        model.train()
        # No attention mask, as ferrotune's DPO batches (torchtune's recipe): padding is on the
        # right, so causal attention never lets a real token see it.
        logits = model(input_ids=ids).logits
        beta = p["beta"]
        m = {}
        if kind == "orpo":
            full = torch.where(mask == 1, ids, -100)
            nll = cross_entropy_loss(logits[:n], full[:n])
            logps = get_batch_logps(logits, labels, True)
            pc, pr = logps[:n].float(), logps[n:].float()
            log_odds = (pc - pr) - (log1mexp(pc) - log1mexp(pr))
            ratio = F.logsigmoid(log_odds)
            losses = beta * ratio
            cr, rr = beta * pc.detach(), beta * pr.detach()
            loss = nll - losses.mean()
            m = {"nll_loss": nll.item(), "log_odds_ratio": ratio.mean().item(),
                 "log_odds_chosen": log_odds.mean().item()}
        elif kind in ("simpo", "cpo"):
            ls, alpha = p["label_smoothing"], p["cpo_alpha"]
            nll = cross_entropy_loss(logits[:n], labels[:n])
            logps = get_batch_logps(logits, labels, kind == "simpo")
            pc, pr = logps[:n], logps[n:]
            z = pc - pr
            if kind == "simpo":
                z = z - p["simpo_gamma"] / beta
            losses = -F.logsigmoid(beta * z) * (1 - ls) - F.logsigmoid(-beta * z) * ls
            cr, rr = beta * pc.detach(), beta * pr.detach()
            loss = losses.mean() + alpha * nll
            m = {"nll_loss": nll.item()}
        else:
            logps = get_batch_logps(logits, labels, False)
            with torch.no_grad(), model.disable_adapter():
                ref = get_batch_logps(model(input_ids=ids).logits, labels, False)
            lens = (labels[:, 1:] != -100).sum(-1).clamp(min=1)
            pc, pr = logps[:n], logps[n:]
            cs, rs = pc - ref[:n], pr - ref[n:]
            delta = cs / lens[:n] - rs / lens[n:]
            losses = (delta - 1 / (2 * beta)) ** 2
            cr, rr = beta * cs.detach(), beta * rs.detach()
            loss = losses.mean()
        loss.backward()
        grads = {
            k.replace(".default", ""): q.grad.detach().clone().contiguous()
            for k, q in model.named_parameters()
            if q.requires_grad and q.grad is not None
        }
        save_file(grads, os.path.join(OUT, f"{kind}_grads.safetensors"))
        out[kind] = {
            **p,
            "loss": loss.item(),
            "rewards/chosen": cr.mean().item(),
            "rewards/rejected": rr.mean().item(),
            "rewards/accuracies": (cr > rr).float().mean().item(),
            "rewards/margins": (cr - rr).mean().item(),
            **m,
        }
        print(kind, out[kind])
    json.dump(out, open(os.path.join(OUT, "golden.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
