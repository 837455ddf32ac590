#!/usr/bin/env python3
"""PPO references for ferrotune's `ppo_full_finetune_single_device`, computed with torchtune 0.6.1's
own `rlhf` functions and `PPOLoss` on transformers models, step by step as torchtune's
`generate_trajectory` and `ppo_step` run them.

Models: the tiny Llama (tests/fixtures/llama3/model) is the policy and the reference; a tiny
`LlamaForSequenceClassification` of the same shape (num_labels 1, random weights, written here to
tests/fixtures/ppo/reward) is the reward model and the value model's starting point, as torchtune's
config starts the value model from the reward model.

The responses are fixed (sampling is ferrotune's generator, not torch's): four left-padded prompts
and six-token responses covering a stop at the start, in the middle and at the last token, a second
stop token, and none at all. Recorded (tests/fixtures/ppo/golden.json): the trajectory (log
probabilities, reference log probabilities, values, scores after penalties, masks, indices),
rewards, KL, advantages and returns; then two PPO epochs with one AdamW over policy and value
model (the first on the whole batch, the second as two micro-batches of gradient accumulation),
their statistics, a few parameters' gradients (grads_epoch{1,2}.safetensors) and values after
each step (params_epoch{1,2}.safetensors).

Run from the repository root with torch, transformers, safetensors installed and torchtune's
source at /tmp/tt/src (its NF4 import stubbed): python3 scripts/make_ppo_fixtures.py
"""
import json
import os
import sys

import torch

from torchtune_source import use_torchtune_source

use_torchtune_source()
from torchtune import rlhf  # noqa: E402
from torchtune.rlhf.loss import PPOLoss  # noqa: E402
import importlib.util  # noqa: E402

# torchtune.training's package import pulls in torchao's quantization API of its day: load the one
# file needed on its own.
_spec = importlib.util.spec_from_file_location(
    "tt_pooling", os.path.join(sys.path[0], "torchtune", "training", "pooling.py")
)
_pooling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_pooling)
get_unmasked_sequence_lengths = _pooling.get_unmasked_sequence_lengths
from safetensors.torch import save_file  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForSequenceClassification,
)

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
POLICY = os.path.join(ROOT, "llama3", "model")
OUT = os.path.join(ROOT, "ppo")
REWARD = os.path.join(OUT, "reward")
PAD = 3
STOPS = [2, 17]
TEMPERATURE = 0.7
MAX_GEN = 6
MIN_RESPONSE_LENGTH = 2
REWARD_PENALTY = -3.0
KL_COEFF = 0.05
GAMMA = 1.0
LMBDA = 0.95
EPSILON = 0.1
VALUE_CLIP = 0.05
VALUE_COEFF = 0.5
LR = 1.5e-4
PROMPTS = [
    [40, 41, 42, 43, 44, 45, 46],
    [50, 51, 52],
    [60, 61, 62, 63, 64],
    [70],
]
RESPONSES = [
    [100, 101, 2, 102, 17, 103],  # stops at index 2, a later stop is cut too
    [110, 111, 112, 113, 114, 115],  # never stops: penalised
    [17, 120, 121, 122, 123, 124],  # stops at once (second stop token): too short, penalised
    [130, 131, 132, 133, 134, 2],  # stops at the last token
]
# A few parameters to compare after each PPO epoch (policy's, and the value model's `value.*`).
TRACKED = [
    "model.embed_tokens.weight",
    "value.model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
    "value.model.layers.0.self_attn.v_proj.weight",
    "value.model.layers.1.mlp.gate_proj.weight",
    "value.score.weight",
]


def make_reward_model():
    cfg = json.load(open(os.path.join(POLICY, "config.json")))
    for k in ["architectures", "dtype", "transformers_version", "use_cache"]:
        cfg.pop(k, None)
    config = LlamaConfig(**cfg, num_labels=1)
    torch.manual_seed(7)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        # Scores of a useful size: the random head alone gives values near 0.
        model.score.weight.mul_(20.0)
    model.save_pretrained(REWARD)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        with open(os.path.join(POLICY, f)) as src, open(os.path.join(REWARD, f), "w") as dst:
            dst.write(src.read())


def layout(ids):
    mask = ids != PAD
    positions = ((mask.cumsum(-1) - 1) * mask).long()
    return mask.long(), positions


def lm_logits(model, ids):
    mask, pos = layout(ids)
    return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()


def per_position_scores(model, ids):
    mask, pos = layout(ids)
    hidden = model.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
    return model.score(hidden).float()


def logprobs_of(model, query_responses, ctx):
    logits = rlhf.truncate_sequence_for_logprobs(lm_logits(model, query_responses), ctx)
    return rlhf.logits_to_logprobs(logits, query_responses[:, ctx:], TEMPERATURE)


def values_of(model, query_responses, ctx):
    v = per_position_scores(model, query_responses)
    return rlhf.truncate_sequence_for_logprobs(v, ctx).squeeze(-1)


def tolist(t):
    return t.detach().cpu().tolist()


def main():
    os.makedirs(OUT, exist_ok=True)
    make_reward_model()
    load = dict(dtype=torch.float32, attn_implementation="eager")
    policy = AutoModelForCausalLM.from_pretrained(POLICY, **load)
    reference = AutoModelForCausalLM.from_pretrained(POLICY, **load)
    value = LlamaForSequenceClassification.from_pretrained(REWARD, **load)
    reward = LlamaForSequenceClassification.from_pretrained(REWARD, **load)
    for m in [policy, reference, value, reward]:
        m.eval()  # no dropout anywhere (torchtune disables it)

    width = max(len(p) for p in PROMPTS)
    prompts = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    ctx = width
    query_responses = torch.cat([prompts, torch.tensor(RESPONSES)], dim=1)

    # ---- generate_trajectory (after generation)
    with torch.no_grad():
        logprobs = logprobs_of(policy, query_responses, ctx)
        ref_logprobs = logprobs_of(reference, query_responses, ctx)
        values = values_of(value, query_responses, ctx)
        responses = query_responses[:, ctx:].clone()
        response_padding_masks, responses = rlhf.truncate_sequence_at_first_stop_token(
            responses, torch.tensor(STOPS), PAD
        )
        scores = per_position_scores(reward, torch.cat([prompts, responses], dim=1))
        seq_lens = get_unmasked_sequence_lengths(response_padding_masks)
        scores = scores.gather(1, (seq_lens + ctx)[:, None, None]).squeeze((-1, -2))
        raw_scores = scores.clone()
        penalty = rlhf.get_reward_penalty_mask(
            response_padding_masks, seq_lens, True, MIN_RESPONSE_LENGTH
        )
        scores[penalty] = REWARD_PENALTY
        logprobs[response_padding_masks] = 1.0
        ref_logprobs[response_padding_masks] = 1.0
        value_seq_idxs = torch.where(
            (seq_lens > 0) & (seq_lens < MAX_GEN - 1), seq_lens + 1, seq_lens
        )
        value_padding_masks = response_padding_masks.clone().scatter_(
            1, value_seq_idxs.unsqueeze(-1), False
        )
        values[value_padding_masks] = 0.0

        rewards, kl, kl_rewards = rlhf.get_rewards_ppo(
            scores, logprobs, ref_logprobs, KL_COEFF, value_seq_idxs
        )
        advantages, returns = rlhf.estimate_advantages(
            values, rewards, GAMMA, LMBDA, masks=~response_padding_masks
        )

    golden = {
        "prompts": PROMPTS,
        "responses": RESPONSES,
        "pad_id": PAD,
        "stop_token_ids": STOPS,
        "temperature": TEMPERATURE,
        "max_generated_tokens": MAX_GEN,
        "min_response_length": MIN_RESPONSE_LENGTH,
        "reward_penalty": REWARD_PENALTY,
        "kl_coeff": KL_COEFF,
        "gamma": GAMMA,
        "lmbda": LMBDA,
        "epsilon": EPSILON,
        "value_clip_range": VALUE_CLIP,
        "value_coeff": VALUE_COEFF,
        "lr": LR,
        "query_responses": tolist(query_responses),
        "logprobs": tolist(logprobs),
        "ref_logprobs": tolist(ref_logprobs),
        "values": tolist(values),
        "raw_scores": tolist(raw_scores),
        "scores": tolist(scores),
        "response_padding": tolist(response_padding_masks),
        "value_padding": tolist(value_padding_masks),
        "value_seq_idxs": tolist(value_seq_idxs),
        "seq_lens": tolist(seq_lens),
        "rewards": tolist(rewards),
        "kl": tolist(kl),
        "kl_rewards": tolist(kl_rewards),
        "advantages": tolist(advantages),
        "returns": tolist(returns),
        "epochs": [],
    }

    # ---- PPO epochs: one AdamW over policy then value parameters, torch's defaults but lr
    loss_fn = PPOLoss(epsilon=EPSILON, value_clip_range=VALUE_CLIP, value_coeff=VALUE_COEFF)
    optimizer = torch.optim.AdamW(list(policy.parameters()) + list(value.parameters()), lr=LR)
    named = {n: p for n, p in policy.named_parameters()}
    named.update({"value." + n: p for n, p in value.named_parameters()})
    for epoch, groups in enumerate([[[0, 1, 2, 3]], [[0, 1], [2, 3]]], start=1):
        grad_accum = len(groups)
        stats = []
        for rows in groups:
            idx = torch.tensor(rows)
            qr = query_responses[idx]
            pi_logprobs = logprobs_of(policy, qr, ctx)
            pi_logprobs[response_padding_masks[idx]] = 1.0
            phi_values = values_of(value, qr, ctx)
            phi_values[value_padding_masks[idx]] = 0.0
            loss, policy_loss, value_loss, ratios, clipfrac = loss_fn(
                logprobs[idx],
                pi_logprobs,
                advantages[idx],
                values[idx],
                phi_values,
                returns[idx],
                padding_masks=~response_padding_masks[idx],
                value_padding_masks=~value_padding_masks[idx],
            )
            loss = loss / grad_accum
            loss.backward()
            with torch.no_grad():
                approx_kl = (0.5 * (pi_logprobs - logprobs[idx]).pow(2)).mean()
            stats.append(
                [
                    loss.item(),
                    policy_loss.item() / grad_accum,
                    value_loss.item() / grad_accum,
                    ratios.item() / grad_accum,
                    clipfrac.item() / grad_accum,
                    approx_kl.item() / grad_accum,
                ]
            )
        save_file(
            {k: named[k].grad.detach().contiguous() for k in TRACKED},
            os.path.join(OUT, f"grads_epoch{epoch}.safetensors"),
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        summed = [sum(col) for col in zip(*stats)]
        keys = ["loss", "policy_loss", "value_loss", "ratios", "clipfrac", "approx_policy_kl"]
        golden["epochs"].append({"groups": groups, **dict(zip(keys, summed))})
        save_file(
            {k: named[k].detach().contiguous() for k in TRACKED},
            os.path.join(OUT, f"params_epoch{epoch}.safetensors"),
        )
        print(f"epoch {epoch}:", dict(zip(keys, summed)))

    with open(os.path.join(OUT, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
    print("scores", golden["raw_scores"], "->", golden["scores"])


if __name__ == "__main__":
    main()
