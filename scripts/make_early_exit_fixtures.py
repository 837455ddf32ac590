#!/usr/bin/env python3
"""References for ferrotune's `dev/early_exit_finetune_distributed` (LayerSkip), computed with
torchtune 0.6.1's own pieces: its Llama TransformerDecoder (weights converted from a transformers
checkpoint with `convert_weights.hf_to_tune`), `prepare_layer_dropout`, the early-exit curricula,
`early_exit_loss` and torch.optim.AdamW, run step by step as the recipe's training loop runs them
(loss × tokens summed over the micro-batches, gradients scaled by 1 / tokens, optimizer step,
curriculum step).

Model: a tiny Llama of 4 layers (tests/fixtures/early_exit/model, random weights). Data: 12 rows of
random token ids of different lengths (right-padded, the first two tokens of each masked).
Cases (tests/fixtures/early_exit/golden.json):
  rotational — layers "0::2", RotationalEarlyExitCurriculum, sum_l_loss_scale, scale 0.7, layer
               dropout prob 0.6 linear over every layer; 3 steps of 2 micro-batches of 2 rows.
  gradual    — layers ":", GradualEarlyExitCurriculum, linear_l_loss_scale, no layer dropout,
               4 steps (the curriculum's span) of one micro-batch of 3 rows.
  dropout    — no early exit, layer dropout prob 0.9 exp on layers "1:"; 2 steps of 2 × 2 rows.
Recorded per step: the exit layers, each layer's kept rows per micro-batch (from torch.bernoulli's
draws), the logged loss, and a few parameters after the step (params_{case}_step{N}.safetensors,
transformers names); the first step's gradients of those parameters (grads_{case}.safetensors).

Run from the repository root with torch, transformers, safetensors and torchtune 0.6.1's source at
/tmp/tt/src (TORCHTUNE_SRC):
    python3 scripts/make_early_exit_fixtures.py
"""
import json
from pathlib import Path

import torch

from torchtune_source import use_torchtune_source

use_torchtune_source()
from torchtune.models import convert_weights  # noqa: E402
from torchtune.models.llama2._component_builders import llama2  # noqa: E402
from torchtune.modules import early_exit_loss as eel  # noqa: E402
from torchtune.modules.common_utils import slice_str_to_array  # noqa: E402
from torchtune.modules.layer_dropout import prepare_layer_dropout  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

OUT = Path("tests/fixtures/early_exit")
LAYERS, HIDDEN, HEADS, KV, FFN, VOCAB = 4, 32, 4, 2, 64, 128
WATCH = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.gate_proj.weight",
    "model.layers.2.input_layernorm.weight",
    "model.layers.3.self_attn.o_proj.weight",
    "model.layers.3.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]


def hf_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=64,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, initializer_range=0.2,
    )
    m = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:  # norms away from 1, so that their gradients matter
                p.copy_(1 + 0.1 * torch.randn_like(p))
    (OUT / "model").mkdir(parents=True, exist_ok=True)
    m.save_pretrained(OUT / "model", safe_serialization=True)
    return m


def tune_model(hf):
    m = llama2(vocab_size=VOCAB, num_layers=LAYERS, num_heads=HEADS, num_kv_heads=KV,
               embed_dim=HIDDEN, max_seq_len=64, intermediate_dim=FFN, norm_eps=1e-5)
    sd = convert_weights.hf_to_tune(
        {k: v.clone() for k, v in hf.state_dict().items()},
        num_heads=HEADS, num_kv_heads=KV, dim=HIDDEN)
    m.load_state_dict(sd)
    return m.float()


def hf_names(tune):
    sd = convert_weights.tune_to_hf(
        {k: v for k, v in tune.items()}, num_heads=HEADS, num_kv_heads=KV, dim=HIDDEN)
    return sd


def rows():
    g = torch.Generator().manual_seed(7)
    out = []
    for i in range(12):
        n = 6 + (i * 5) % 7
        ids = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        out.append(ids)
    return out


def micro_batch(rs):
    """torchtune's tokens and shifted labels, and ferrotune's unshifted labels."""
    t = max(len(r) for r in rs)
    tokens, tt_labels, labels = [], [], []
    for r in rs:
        masked = [True, True] + [False] * (len(r) - 2)
        lab = [-100 if m else x for x, m in zip(r, masked)]
        pad = t - len(r)
        tokens.append(r + [0] * pad)
        labels.append(lab + [-100] * pad)
        tt_labels.append(lab[1:] + [-100] + [-100] * pad)
    return torch.tensor(tokens), torch.tensor(tt_labels), tokens, labels


def run_case(hf, name, ee, dropout, steps, ga, bs, data):
    model = tune_model(hf)
    model.train()
    if dropout:
        prepare_layer_dropout(model.layers, prob_max=dropout["prob"],
                              prob_layer_scale=dropout["layers_scale"],
                              layers_str=dropout["layers"], disable_on_eval=True)
    loss_fn = torch.nn.CrossEntropyLoss()
    # eps 1e-5: with torch's 1e-8 AdamW's first step turns a gradient element that is rounding
    # noise (|g| ~ 1e-9, either sign) into a step of a quarter of lr, and the comparison with it.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    curriculum = None
    do_out = None
    if ee:
        do_out = slice_str_to_array(ee["layers"], LAYERS)
        if ee["curriculum"]:
            curriculum = getattr(eel, ee["curriculum"])(
                do_output_hidden_states=do_out, max_steps=steps, train_last_layer=True,
                last_step=0, verbose=False)
            do_out = curriculum.get()
        else:
            do_out[LAYERS - 1] = True
        model.output_hidden_states = [i for i in range(LAYERS) if do_out[i]]
    # Which rows each layer keeps: torch.bernoulli's draws as LayerDropout makes them.
    draws = []
    real_bernoulli = torch.bernoulli

    def recording_bernoulli(p, generator=None):
        out = real_bernoulli(p, generator=generator)
        draws.append(out.clone())
        return out

    torch.bernoulli = recording_bernoulli
    record = {"steps": []}
    scale_fn = getattr(eel, ee["scale_fn"]) if ee else None
    for step in range(steps):
        running, num_tokens = 0.0, 0
        step_rec = {"exits": list(model.output_hidden_states), "kept": [], "batches": []}
        for micro in range(ga):
            first = (step * ga + micro) * bs
            tokens, tt_labels, ft_tokens, ft_labels = micro_batch(data[first:first + bs])
            step_rec["batches"].append({"input_ids": ft_tokens, "labels": ft_labels})
            draws.clear()
            cur = (tt_labels != -100).sum()
            num_tokens += cur
            outputs = model(tokens)
            if model.output_hidden_states:
                logits = outputs.pop(-1)
                hidden = {i: h for i, h in zip(model.output_hidden_states, outputs)}
                loss = eel.early_exit_loss(model, hidden, tt_labels.reshape(-1), loss_fn,
                                           ee["scale"], scale_fn) * cur
            else:
                loss = loss_fn(outputs.reshape(-1, VOCAB), tt_labels.reshape(-1)) * cur
            running += loss
            loss.backward()
            # Draws in layer order (layers with probability 0 draw nothing).
            kept = []
            it = iter(draws)
            for layer in model.layers:
                p = layer.dropout.prob if dropout else 0.0
                if p == 0:
                    kept.append(None)
                else:
                    skip = next(it)
                    kept.append([j for j in range(bs) if skip[j] == 0])
            step_rec["kept"].append(kept)
        for p in model.parameters():
            if p.grad is not None:
                p.grad *= 1 / num_tokens
        if step == 0:
            grads = {k: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                     for k, p in model.state_dict(keep_vars=True).items()}
            no_grad = [k for k, p in model.state_dict(keep_vars=True).items() if p.grad is None]
            hf_grads = hf_names(grads)
            save_file({k: hf_grads[k].contiguous() for k in WATCH},
                      OUT / f"grads_{name}.safetensors")
            step_rec["no_grad"] = sorted(hf_names(
                {k: torch.zeros_like(model.state_dict()[k]) for k in no_grad}).keys())
        opt.step()
        opt.zero_grad(set_to_none=True)
        step_rec["loss"] = (running.detach().item() / num_tokens.item())
        sd = hf_names({k: v.detach().clone() for k, v in model.state_dict().items()})
        save_file({k: sd[k].contiguous() for k in WATCH},
                  OUT / f"params_{name}_step{step + 1}.safetensors")
        if curriculum:
            curriculum.step()
            do_out = curriculum.get()
            model.output_hidden_states = [i for i in range(LAYERS) if do_out[i]]
        record["steps"].append(step_rec)
    torch.bernoulli = real_bernoulli
    record.update({"early_exit": ee, "layer_dropout": dropout, "steps_total": steps,
                   "gradient_accumulation_steps": ga, "batch_size": bs})
    return record


def main():
    hf = hf_model()
    tm = tune_model(hf)
    ids = torch.tensor([rows()[0]])
    with torch.no_grad():
        diff = (tm(ids) - hf(ids).logits).abs().max().item()
    assert diff < 1e-4, f"torchtune and transformers disagree: {diff}"
    data = rows()
    golden = {"lr": 1e-2, "eps": 1e-5, "weight_decay": 0.01, "watch": WATCH, "cases": {}}
    golden["cases"]["rotational"] = run_case(
        hf, "rotational",
        {"layers": "0::2", "curriculum": "RotationalEarlyExitCurriculum",
         "scale_fn": "sum_l_loss_scale", "scale": 0.7},
        {"prob": 0.6, "layers_scale": "linear", "layers": ":"}, steps=3, ga=2, bs=2, data=data)
    golden["cases"]["gradual"] = run_case(
        hf, "gradual",
        {"layers": ":", "curriculum": "GradualEarlyExitCurriculum",
         "scale_fn": "linear_l_loss_scale", "scale": 1.0},
        None, steps=4, ga=1, bs=3, data=data)
    golden["cases"]["dropout"] = run_case(
        hf, "dropout", None, {"prob": 0.9, "layers_scale": "exp", "layers": "1:"},
        steps=2, ga=2, bs=2, data=data)
    (OUT / "golden.json").write_text(json.dumps(golden, indent=1))
    for name, c in golden["cases"].items():
        print(name, [(s["exits"], round(s["loss"], 5)) for s in c["steps"]])
        print("   kept", [s["kept"] for s in c["steps"]])
        print("   no grad at step 1:", c["steps"][0].get("no_grad"))


if __name__ == "__main__":
    main()
