#!/usr/bin/env python3
"""Reference values for crates/ferrotune-train (loss, optimizers, grad clipping, LR schedules).

Writes small safetensors/JSON files into crates/ferrotune-train/tests/fixtures/train/. Everything
is computed with PyTorch's own implementations (F.cross_entropy, torch.optim.AdamW/SGD with
foreach=False, torch.nn.utils.clip_grad_norm_) so the Rust tests compare against the real thing.
The cosine schedule is torchtune's `get_cosine_schedule_with_warmup` lambda, copied verbatim
(torchtune is not a dependency), the linear one Hugging Face's, both driven through torch's LambdaLR.

Usage: python3 scripts/make_train_fixtures.py
"""

import json
import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(__file__), "..", "crates", "ferrotune-train", "tests", "fixtures", "train")


def loss_fixtures():
    g = torch.Generator().manual_seed(0)
    b, t, v = 2, 7, 11
    logits = torch.randn(b, t, v, generator=g) * 3.0
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, 2] = -100
    labels[1, 5] = -100
    labels[1, 6] = -100
    out = {"logits": logits, "labels": labels}

    # Shifted (causal-LM) loss, f32 logits.
    x = logits.clone().requires_grad_(True)
    s = F.cross_entropy(x[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
    s.backward()
    out["shift_sum"] = s.detach().reshape(1)
    out["shift_count"] = torch.tensor([(labels[:, 1:] != -100).sum().item()], dtype=torch.float32)
    out["shift_grad_sum"] = x.grad.clone()
    x.grad = None
    m = F.cross_entropy(x[:, :-1].reshape(-1, v), labels[:, 1:].reshape(-1), ignore_index=-100)
    m.backward()
    out["shift_mean"] = m.detach().reshape(1)
    out["shift_grad_mean"] = x.grad.clone()

    # Already-shifted labels: logits[:, i] predicts labels[:, i].
    x = logits.clone().requires_grad_(True)
    s = F.cross_entropy(x.reshape(-1, v), labels.reshape(-1), ignore_index=-100, reduction="sum")
    s.backward()
    out["noshift_sum"] = s.detach().reshape(1)
    out["noshift_grad_sum"] = x.grad.clone()

    # bf16 logits: torchtune upcasts to f32 before the loss; the grad comes back in bf16.
    xb = logits.to(torch.bfloat16).requires_grad_(True)
    s = F.cross_entropy(xb[:, :-1].float().reshape(-1, v), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
    s.backward()
    out["bf16_logits"] = xb.detach().clone()
    out["bf16_shift_sum"] = s.detach().reshape(1)
    out["bf16_shift_grad_sum"] = xb.grad.clone()
    save_file({k: t.contiguous() for k, t in out.items()}, os.path.join(OUT, "loss.safetensors"))


SHAPES = {"a": (3, 5), "b": (7,), "c": (2, 3, 4)}
STEPS = 5


def make_params_grads(seed):
    g = torch.Generator().manual_seed(seed)
    params = {k: torch.randn(*s, generator=g) for k, s in SHAPES.items()}
    grads = {}
    for step in range(STEPS):
        for k, s in SHAPES.items():
            # "b" gets no grad at step 2: torch skips it entirely (no step count, no decay).
            if k == "b" and step == 2:
                continue
            grads[f"{k}.grad{step}"] = torch.randn(*s, generator=g) * 0.1
    return params, grads


def run_optim(make_opt, params, grads):
    ps = {k: torch.nn.Parameter(v.clone()) for k, v in params.items()}
    opt = make_opt(list(ps.values()))
    out = {}
    for step in range(STEPS):
        for k, p in ps.items():
            key = f"{k}.grad{step}"
            p.grad = grads[key].clone() if key in grads else None
        opt.step()
        for k, p in ps.items():
            out[f"{k}.step{step}"] = p.detach().clone()
    for k, p in ps.items():
        for sk, sv in opt.state[p].items():
            out[f"{k}.state.{sk}"] = sv.detach().clone().reshape(-1) if sv.dim() == 0 else sv.detach().clone()
    return out


def optim_fixtures():
    params, grads = make_params_grads(1)
    out = {f"{k}.init": v for k, v in params.items()}
    out.update(grads)
    adamw = run_optim(
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False),
        params,
        grads,
    )
    out.update({f"adamw.{k}": v for k, v in adamw.items()})
    sgd = run_optim(
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, foreach=False),
        params,
        grads,
    )
    out.update({f"sgd.{k}": v for k, v in sgd.items()})
    nesterov = run_optim(
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01, foreach=False),
        params,
        grads,
    )
    out.update({f"nesterov.{k}": v for k, v in nesterov.items()})
    plain = run_optim(lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=False), params, grads)
    out.update({f"plain.{k}": v for k, v in plain.items()})
    save_file({k: t.contiguous() for k, t in out.items()}, os.path.join(OUT, "optim.safetensors"))


def clip_fixtures():
    g = torch.Generator().manual_seed(2)
    grads = {k: torch.randn(*s, generator=g) for k, s in SHAPES.items()}
    out = {f"{k}.grad": v.clone() for k, v in grads.items()}
    for name, max_norm in (("clip", 1.0), ("noclip", 100.0)):
        ps = [torch.nn.Parameter(torch.zeros(*SHAPES[k])) for k in SHAPES]
        for p, k in zip(ps, SHAPES):
            p.grad = grads[k].clone()
        total = torch.nn.utils.clip_grad_norm_(ps, max_norm, foreach=False)
        out[f"{name}.total_norm"] = total.reshape(1)
        for p, k in zip(ps, SHAPES):
            out[f"{name}.{k}"] = p.grad.clone()
    save_file({k: t.contiguous() for k, t in out.items()}, os.path.join(OUT, "clip.safetensors"))


def get_cosine_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, num_cycles=0.5, last_epoch=-1):
    # Verbatim from torchtune/training/lr_schedulers.py.
    def lr_lambda(current_step: int) -> float:
        # linear warmup phase
        if current_step < num_warmup_steps:
            return current_step / max(1, num_warmup_steps)

        # cosine
        progress = (current_step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)

        cosine_lr_multiple = 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress))
        return max(0.0, cosine_lr_multiple)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda, last_epoch)


def get_linear_schedule_with_warmup(optimizer, num_warmup_steps, num_training_steps, last_epoch=-1):
    # Hugging Face transformers' lambda (optimization.py), copied.
    def lr_lambda(current_step: int):
        if current_step < num_warmup_steps:
            return float(current_step) / float(max(1, num_warmup_steps))
        return max(
            0.0, float(num_training_steps - current_step) / float(max(1, num_training_steps - num_warmup_steps))
        )

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda, last_epoch)


def schedule_fixtures():
    base_lr = 3e-4
    cases = []
    for warmup, total, cycles in ((10, 100, 0.5), (0, 50, 0.5), (5, 40, 1.0), (3, 3, 0.5)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
        sched = get_cosine_schedule_with_warmup(opt, warmup, total, cycles)
        lrs = []
        for _ in range(total + 10):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        cases.append({"warmup": warmup, "total": total, "num_cycles": cycles, "base_lr": base_lr, "lrs": lrs})
    linear = []
    for warmup, total in ((10, 100), (0, 20), (5, 5)):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base_lr)
        sched = get_linear_schedule_with_warmup(opt, warmup, total)
        lrs = []
        for _ in range(total + 10):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        linear.append({"warmup": warmup, "total": total, "base_lr": base_lr, "lrs": lrs})
    with open(os.path.join(OUT, "schedule.json"), "w") as f:
        json.dump({"cosine": cases, "linear": linear}, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    loss_fixtures()
    optim_fixtures()
    clip_fixtures()
    schedule_fixtures()
