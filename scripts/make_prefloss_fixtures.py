#!/usr/bin/env python3
"""TRL's reference-free and IPO preference losses (ORPO, SimPO, CPO, IPO) as references for
ferrotune's tests, on the DPO fixture (tests/fixtures/dpo/pairs.jsonl: two pairs of unequal
lengths, right-padded as torchtune's padded_collate_dpo) with the tiny Llama and its PEFT adapter
(tests/fixtures/llama3/{model,adapter}) as the policy and, for IPO, the same model with the
adapter disabled as the reference.

ORPO, SimPO and CPO call TRL 1.16.0's own functions (trl/experimental/orpo/orpo_trainer.py,
trl/experimental/cpo/cpo_trainer.py), unbound, with a stand-in `self` holding the settings they
read (`beta`, `loss_type`, `simpo_gamma`, `label_smoothing`, `alpha` = AlphaPO's, 0 as
`CPOConfig`'s default, and the accelerator's device):
- ORPO: `ORPOTrainer.get_batch_logps(average_log_prob=True)` and `ORPOTrainer.odds_ratio_loss`;
  the chosen rows' NLL over the whole prompt and response (labels = input_ids where the attention
  mask is 1) is `concatenated_forward`'s local `cross_entropy_loss`, transcribed, and the loss
  `get_batch_loss_metrics`' nll - mean(beta * logsigmoid(log_odds)).
- CPO / SimPO: `CPOTrainer.get_batch_logps(average_log_prob=loss_type in ["ipo", "simpo"])` and
  `CPOTrainer.cpo_loss` (loss_type "sigmoid" / "simpo"); the NLL over the chosen rows' labels
  (the local `cross_entropy_loss`, transcribed), loss = mean(losses) + cpo_alpha * nll.
- IPO: a real `DPOTrainer` (loss_type ["ipo"]) and its `_compute_loss` on its collator's batch of
  the fixture pairs (prompt, chosen and rejected ids), the reference being the model with the
  adapter disabled (TRL's "ref" copy of a pretrained adapter deleted), its logged rewards.
The values these give equal the earlier fully transcribed script's to float32 rounding (loss to
1.5e-7 relative, gradients to 1e-6 relative L2).

tests/fixtures/prefloss/golden.json: per loss, its parameters, the loss and TRL's metrics.
tests/fixtures/prefloss/{orpo,simpo,cpo,ipo}_grads.safetensors: d loss / d adapter parameter.

Run from the repository root with TRL in a venv that keeps the system torch/transformers/peft
(scripts/fetch-trl.sh creates it once, pinned):
    "$(scripts/fetch-trl.sh)/bin/python" scripts/make_prefloss_fixtures.py
"""
import json
import os
import tempfile
from types import SimpleNamespace

import torch
from peft import PeftModel
from safetensors.torch import save_file
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer
from trl.experimental.cpo import CPOTrainer
from trl.experimental.orpo import ORPOTrainer

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


def ipo_from_dpo_trainer(model, beta):
    """IPO from TRL's own `DPOTrainer` (loss_type ["ipo"]): its collator on the fixture's pairs
    split into prompt, chosen and rejected ids, its `_compute_loss` (the reference: the model with
    the adapter disabled, TRL's path once its "ref" copy of a pretrained adapter is deleted) and
    its logged rewards."""
    rows = [json.loads(l) for l in open(os.path.join(ROOT, "dpo", "pairs.jsonl"))]
    examples = []
    for r in rows:
        k = next(i for i, l in enumerate(r["chosen_labels"]) if l != -100)
        assert r["chosen_input_ids"][:k] == r["rejected_input_ids"][:k]
        assert all(l == -100 for l in r["rejected_labels"][:k]) and r["rejected_labels"][k] != -100
        examples.append({"prompt_ids": r["chosen_input_ids"][:k],
                         "chosen_ids": r["chosen_input_ids"][k:],
                         "rejected_ids": r["rejected_input_ids"][k:]})
    tok = AutoTokenizer.from_pretrained(os.path.join(ROOT, "llama3", "model"))
    with tempfile.TemporaryDirectory() as out:
        args = DPOConfig(output_dir=out, loss_type=["ipo"], beta=beta, report_to=[], use_cpu=True,
                         per_device_train_batch_size=len(examples))
        # The dataset is not read: the batch is the collated fixture pairs.
        dummy = Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]})
        trainer = DPOTrainer(model=model, args=args, train_dataset=dummy, processing_class=tok)
    if "ref" in trainer.model.peft_config:
        trainer.model.delete_adapter("ref")
        trainer.model.set_adapter("default")
    trainer.model.train()
    loss = trainer._compute_loss(trainer.model, trainer.data_collator(examples), False)
    logged = {k: sum(v) / len(v) for k, v in trainer._metrics["train"].items()}
    keys = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"]
    return trainer.model, loss, {k: logged[k] for k in keys}


def trl_self(**settings):
    """The attributes TRL's loss methods read of their trainer."""
    return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device("cpu")), **settings)


def cross_entropy_loss(logits, labels):
    """TRL's concatenated_forward cross_entropy_loss (decoder-only)."""
    logits = logits[..., :-1, :].contiguous()
    labels = labels[..., 1:].contiguous()
    return torch.nn.CrossEntropyLoss()(logits.view(-1, logits.shape[-1]), labels.view(-1))


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
            logps = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
            losses, cr, rr, ratio, log_odds = ORPOTrainer.odds_ratio_loss(
                trl_self(beta=beta), logps[:n], logps[n:]
            )
            loss = nll - losses.mean()
            m = {"nll_loss": nll.item(), "log_odds_ratio": ratio.item(),
                 "log_odds_chosen": log_odds.item()}
        elif kind in ("simpo", "cpo"):
            ls, alpha = p["label_smoothing"], p["cpo_alpha"]
            nll = cross_entropy_loss(logits[:n], labels[:n])
            logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=kind == "simpo")
            losses, cr, rr = CPOTrainer.cpo_loss(
                trl_self(beta=beta, alpha=0.0, label_smoothing=ls,
                         loss_type="simpo" if kind == "simpo" else "sigmoid",
                         simpo_gamma=p.get("simpo_gamma")),
                logps[:n], logps[n:],
            )
            loss = losses.mean() + alpha * nll
            m = {"nll_loss": nll.item()}
        else:
            model, loss, m = ipo_from_dpo_trainer(model, beta)
        loss.backward()
        grads = {
            k.replace(".default", ""): q.grad.detach().clone().contiguous()
            for k, q in model.named_parameters()
            if q.requires_grad and q.grad is not None
        }
        save_file(grads, os.path.join(OUT, f"{kind}_grads.safetensors"))
        if kind != "ipo":
            m = {
                "rewards/chosen": cr.mean().item(),
                "rewards/rejected": rr.mean().item(),
                "rewards/accuracies": (cr > rr).float().mean().item(),
                "rewards/margins": (cr - rr).mean().item(),
                **m,
            }
        out[kind] = {**p, "loss": loss.item(), **m}
        print(kind, out[kind])
    json.dump(out, open(os.path.join(OUT, "golden.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
