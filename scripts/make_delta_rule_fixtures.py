#!/usr/bin/env python3
"""transformers 5.24's gated delta rule (Qwen3.5's `torch_chunk_gated_delta_rule` and
`torch_recurrent_gated_delta_rule`) on random inputs, with torch autograd's gradients: what
ferrotune's chunked and recurrent forms must equal.

tests/fixtures/delta_rule/golden.safetensors (float32; transformers' layout, `[b, t, h, d]`):
- inputs `q`, `k` (already L2-normalized per head: the functions run with
  `use_qk_l2norm_in_kernel=False` and scale the queries by `d_k^-1/2` themselves), `v`, `g` (the
  log decay, `[b, t, h]`, negative), `beta` (`[b, t, h]`), `state0` (`[b, h, d_k, d_v]`), and the
  loss weights `w_out` (`[b, t, h, d_v]`) and `w_state` (`[b, h, d_k, d_v]`);
- per form (`chunk_`, `recurrent_`): `out`, `state` (the final state), and the gradients of
  `sum(out * w_out) + sum(state * w_state)` with respect to every input: `grad_q`, `grad_k`,
  `grad_v`, `grad_g`, `grad_beta`, `grad_state0`.
140 positions: two full chunks of 64 and a padded third.

tests/fixtures/delta_rule/long_<case>.safetensors, for the qwen3_5, qwen3_5_moe and qwen3_next model fixtures on one
row of 150 tokens (the model's prefill and training take the chunked form from 64 positions on):
`input_ids` (`[1, 150]`, i64), `loss` (`[1]`, transformers' mean cross-entropy over every next
token), `rows` (`[6]`, i64: positions 0, 63, 64, 127, 128, 149) and `logits` at those positions
(`[6, vocab]`).

Run from the repository root: python3 scripts/make_delta_rule_fixtures.py
"""
import os

import torch
from safetensors.torch import save_file
from transformers.models.qwen3_5 import modeling_qwen3_5 as m

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "delta_rule")

B, T, H, DK, DV = 1, 140, 2, 8, 12


def main():
    g = torch.Generator().manual_seed(41)
    r = lambda *s: torch.randn(*s, generator=g)
    q = torch.nn.functional.normalize(r(B, T, H, DK), dim=-1)
    k = torch.nn.functional.normalize(r(B, T, H, DK), dim=-1)
    inputs = dict(
        q=q, k=k, v=r(B, T, H, DV),
        # Decays as the layer makes them: -exp(A_log) * softplus(a + dt_bias).
        g=-torch.exp(0.5 * r(H)) * torch.nn.functional.softplus(r(B, T, H)),
        beta=torch.sigmoid(r(B, T, H)),
        state0=0.5 * r(B, H, DK, DV),
    )
    w_out, w_state = r(B, T, H, DV), r(B, H, DK, DV)
    tensors = dict(inputs, w_out=w_out, w_state=w_state)
    for name, fn in [("chunk", m.torch_chunk_gated_delta_rule), ("recurrent", m.torch_recurrent_gated_delta_rule)]:
        x = {n: t.clone().requires_grad_(True) for n, t in inputs.items()}
        out, state = fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["state0"],
                        output_final_state=True, use_qk_l2norm_in_kernel=False)
        ((out * w_out).sum() + (state * w_state).sum()).backward()
        tensors[f"{name}_out"] = out.detach()
        tensors[f"{name}_state"] = state.detach()
        for n, t in x.items():
            tensors[f"{name}_grad_{n}"] = t.grad
    os.makedirs(OUT, exist_ok=True)
    save_file({n: t.float().contiguous() for n, t in tensors.items()}, os.path.join(OUT, "golden.safetensors"))
    os.chmod(os.path.join(OUT, "golden.safetensors"), 0o644)
    d = (tensors["chunk_out"] - tensors["recurrent_out"]).abs().max()
    print(f"chunk vs recurrent: out max abs diff {d:.2e}")


def long_sequences():
    from transformers import AutoModelForCausalLM
    root = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "models")
    for case in ["qwen3_5", "qwen3_5_moe", "qwen3_next"]:
        model = AutoModelForCausalLM.from_pretrained(os.path.join(root, case, "model"), dtype=torch.float32).eval()
        exact = AutoModelForCausalLM.from_pretrained(os.path.join(root, case, "model"), dtype=torch.float64,
                                                     experts_implementation="eager").eval()
        # Inputs on which no token's routing is a near tie (second and third expert within 1e-4 in
        # probability, in float64): float32 rounding would pick either, and every later position's
        # logits would show it.
        for seed in range(150, 200):
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(4, model.config.vocab_size, (1, 150), generator=g)
            with torch.no_grad():
                routers = exact(input_ids=ids, output_router_logits=True).router_logits \
                    if getattr(exact.config, "num_experts", 0) else ()
            gaps = [float((p[:, 1] - p[:, 2]).min()) for p in
                    (torch.softmax(r, -1).sort(-1, descending=True).values for r in routers or ())]
            if min(gaps, default=1.0) >= 1e-4:
                break
        rows = torch.tensor([0, 63, 64, 127, 128, 149])
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids)
        path = os.path.join(OUT, f"long_{case}.safetensors")
        save_file(dict(input_ids=ids, loss=out.loss.reshape(1).float(), rows=rows,
                       logits=out.logits[0, rows].float().contiguous()), path)
        os.chmod(path, 0o644)
        print(case, "seed", seed, float(out.loss))


if __name__ == "__main__":
    main()
    long_sequences()
