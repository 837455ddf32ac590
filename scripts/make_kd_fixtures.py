#!/usr/bin/env python3
"""Knowledge-distillation references for ferrotune's tests: torchtune's KD losses (ForwardKL,
ReverseKL, SymmetricKL, as in torchtune.modules.loss.kd_losses) between the tiny Llama student
(tests/fixtures/llama3/model with its PEFT adapter tests/fixtures/llama3/adapter) and a tiny
teacher of the same vocabulary.

tests/fixtures/kd/teacher/: the teacher (a different Llama: 2 layers, hidden 64, tied embeddings).
tests/fixtures/kd/golden.json: for each loss, kd_ratio 0.3, on the llama3 golden batch: the
cross-entropy mean (`class_loss`), the distillation mean (`kd_loss`) and the mixed loss
(`loss` = 0.7 · class + 0.3 · kd), the means over the shifted target positions.
tests/fixtures/kd/{forward,reverse,symmetric}_grads.safetensors: d loss / d adapter parameter
(PEFT names), for one micro-batch: the gradient of `loss`.

Run from the repository root with torch, transformers, peft and safetensors installed:
python3 scripts/make_kd_fixtures.py
"""
import json
import os

import torch
import torch.nn.functional as F
from peft import PeftModel
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
OUT = os.path.join(ROOT, "kd")
RATIO = 0.3
SYM_RATIO = 0.3


def kd_rows(student, teacher, kind):
    """Per-row distillation terms, as torchtune's losses compute them before masking rows."""
    s_logp = F.log_softmax(student, dim=-1, dtype=torch.float32)
    t_logp = F.log_softmax(teacher, dim=-1, dtype=torch.float32)
    if kind == "forward":
        inf = torch.isinf(student)
        prod = torch.masked_fill(t_logp.exp() * s_logp, inf, 0)
        return -prod.sum(-1)
    if kind == "reverse":
        p_s = s_logp.exp()
        inf = torch.isinf(student) | torch.isinf(teacher)
        prod = torch.masked_fill(p_s * t_logp, inf, 0) - torch.masked_fill(p_s * s_logp, inf, 0)
        return -prod.sum(-1)
    return SYM_RATIO * kd_rows(student, teacher, "forward") + (1 - SYM_RATIO) * kd_rows(
        student, teacher, "reverse"
    )


def main():
    golden = json.load(open(os.path.join(ROOT, "llama3", "golden.json")))
    ids = torch.tensor(golden["input_ids"])
    labels = torch.tensor(golden["labels"])
    torch.manual_seed(4321)
    teacher_cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_hidden_layers=2,
        vocab_size=512,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=3,
    )
    teacher = LlamaForCausalLM(teacher_cfg)
    # Larger weights than the default init, so that the teacher's distribution is far from flat.
    with torch.no_grad():
        for p in teacher.parameters():
            if p.dim() == 2:
                p.mul_(4.0)
    teacher.save_pretrained(os.path.join(OUT, "teacher"))
    teacher.eval()
    with torch.no_grad():
        t_logits = teacher(input_ids=ids).logits

    # torchtune shifts the labels (the last position scores nothing) and keeps every position.
    shifted = torch.cat([labels[:, 1:], torch.full((labels.shape[0], 1), -100)], dim=1).reshape(-1)
    mask = shifted != -100
    out = {}
    for kind in ["forward", "reverse", "symmetric"]:
        base = AutoModelForCausalLM.from_pretrained(
            os.path.join(ROOT, "llama3", "model"), dtype=torch.float32
        )
        model = PeftModel.from_pretrained(base, os.path.join(ROOT, "llama3", "adapter"), is_trainable=True)
        model.train()
        logits = model(input_ids=ids).logits
        v = logits.shape[-1]
        flat = logits.reshape(-1, v)
        class_loss = F.cross_entropy(flat.float(), shifted, ignore_index=-100)
        kd = (kd_rows(flat, t_logits.reshape(-1, v), kind) * mask).sum() / mask.sum()
        loss = (1 - RATIO) * class_loss + RATIO * kd
        loss.backward()
        grads = {
            n.replace(".default", ""): p.grad.detach().clone().contiguous()
            for n, p in model.named_parameters()
            if p.requires_grad and p.grad is not None
        }
        save_file(grads, os.path.join(OUT, f"{kind}_grads.safetensors"))
        out[kind] = {"class_loss": class_loss.item(), "kd_loss": kd.item(), "loss": loss.item()}
        print(kind, out[kind])
    out["kd_ratio"] = RATIO
    out["sym_kd_ratio"] = SYM_RATIO
    json.dump(out, open(os.path.join(OUT, "golden.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
