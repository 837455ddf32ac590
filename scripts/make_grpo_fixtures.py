#!/usr/bin/env python3
"""GRPO references for ferrotune's `dev/grpo_full_finetune_distributed`, computed with torchtune's own
GRPO code (`torchtune/dev/grpo/loss.py` and `rewards.py`, read from torchtune's repository: its
0.6.1 package leaves `torchtune.dev` out) and 0.6.1's `rlhf` functions, on transformers models,
step by step as torchtune's `generate_trajectory` and `grpo_step` run them.

Model: the tiny Llama (tests/fixtures/llama3/model) is the policy and the reference. The completions
are fixed (sampling is ferrotune's generator, not torch's): two prompts (answers "72" and "5"), three
completions each, written with the fixture's tokenizer so that the shaped reward takes each of its
levels (100, 20, 10; `<<…>>` calculator notes; a completion that never stops; one that stops at
once; a stop followed by more tokens). Also the GSM8K builders' samples of six rows with a
partition (tests/fixtures/grpo/gsm8k.jsonl; prompts from torchtune's gsm8k module, tokenized as
its tokenizers do). Recorded (tests/fixtures/grpo/golden.json): the trajectory
(log probabilities, reference log probabilities, rewards, successes, advantages, masks), then two
optimizer steps (ppo_epochs: 2) with AdamW and gradient clipping for each loss (GRPOSimpleLoss and
the clipped GRPOLoss, each from the fresh model; and GRPOSimpleLoss with LoRA: the PEFT adapter of
tests/fixtures/llama3/adapter trained, the reference being the model with the adapter disabled):
their statistics, a few parameters' gradients (grads_{case}_epoch{1,2}.safetensors) and values after
each step (params_{case}_epoch{1,2}).

Run from the repository root with torch, transformers, safetensors installed, torchtune 0.6.1's
source at /tmp/tt/src and torchtune's git repository at TORCHTUNE_REPO:
    TORCHTUNE_REPO=/path/to/torchtune.git python3 scripts/make_grpo_fixtures.py
"""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import types

import torch

from torchtune_source import use_torchtune_source

use_torchtune_source()
from torchtune import rlhf  # noqa: E402

# loss.py imports rlhf.masked_sum, which 0.6.1 lacks (only GRPOCompletionLoss uses it).
if not hasattr(rlhf, "masked_sum"):
    rlhf.masked_sum = lambda x, mask, dim=None: (x * mask).sum(dim)
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

REPO = os.environ.get("TORCHTUNE_REPO", "/work/.mirror/pytorch+torchtune/repo")


def torchtune_dev_module(path, name):
    """A module of torchtune's repository at HEAD, loaded on its own."""
    text = subprocess.run(
        ["git", "-C", REPO, "show", f"HEAD:{path}"], capture_output=True, text=True, check=True
    ).stdout
    f = tempfile.NamedTemporaryFile("w", suffix=".py", delete=False)
    f.write(text)
    f.close()
    spec = importlib.util.spec_from_file_location(name, f.name)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


grpo_loss = torchtune_dev_module("torchtune/dev/grpo/loss.py", "tt_grpo_loss")
grpo_rewards = torchtune_dev_module("torchtune/dev/grpo/rewards.py", "tt_grpo_rewards")
# gsm8k.py imports `.data` relatively: load both as a package of their own.
_pkg = types.ModuleType("tt_grpo")
_pkg.__path__ = []
sys.modules["tt_grpo"] = _pkg
sys.modules["tt_grpo.data"] = torchtune_dev_module("torchtune/dev/grpo/data.py", "tt_grpo.data")
grpo_gsm8k = torchtune_dev_module("torchtune/dev/grpo/gsm8k.py", "tt_grpo.gsm8k")

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
POLICY = os.path.join(ROOT, "llama3", "model")
OUT = os.path.join(ROOT, "grpo")
PAD = 3
EOS = 2
STOPS = [EOS]
TEMPERATURE = 0.8
KL_COEFF = 0.05
EPSILON = 0.02
LR = 2e-3
CLIP = 1.0
PROMPTS = [[40, 41, 42, 43, 44], [50, 51]]
ANSWERS = ["72", "5"]
G = 3
TRACKED = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]


class Decoder:
    """torchtune's tokenizer interface as batch_shaped_correctness_reward uses it."""

    def __init__(self, hf):
        self.hf = hf

    def decode(self, ids):
        return self.hf.decode(ids, skip_special_tokens=True)


def completions(tok):
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    return [
        enc("x</think> <answer>72</answer>") + [EOS, 60, 61],  # right: 100, stop then more tokens
        enc("so <answer>$72</answer>") + [EOS],  # contains the answer: 20
        enc("no tags, and no stop either"),  # 10, never stops
        enc("<answer><<5>></answer>") + [EOS],  # calculator notes removed: 100
        enc("<answer>6</answer>") + [EOS],  # wrong: 10
        [EOS],  # stops at once: 10
    ]


def layout(ids):
    mask = ids != PAD
    positions = ((mask.cumsum(-1) - 1) * mask).long()
    return mask.long(), positions


def logprobs_of(model, query_responses, ctx):
    mask, pos = layout(query_responses)
    logits = model(input_ids=query_responses, attention_mask=mask, position_ids=pos).logits.float()
    logits = rlhf.truncate_sequence_for_logprobs(logits, ctx)
    return rlhf.logits_to_logprobs(logits, query_responses[:, ctx:], TEMPERATURE)


def tolist(t):
    return t.detach().cpu().tolist()


def lora_steps(query_responses, ctx):
    """GRPOSimpleLoss with LoRA: the tiny Llama with the PEFT adapter of tests/fixtures/llama3/adapter
    (trainable) as the policy, the same model with its adapter disabled as the reference; two
    optimizer steps on the adapter weights. Writes grads_lora_epoch{1,2} and params_lora_epoch{1,2}
    (PEFT's names without the adapter's `.default`)."""
    from peft import PeftModel

    load = dict(dtype=torch.float32, attn_implementation="eager")
    base = AutoModelForCausalLM.from_pretrained(POLICY, **load)
    model = PeftModel.from_pretrained(base, os.path.join(ROOT, "llama3", "adapter"), is_trainable=True)
    model.eval()
    loss_fn = grpo_loss.GRPOSimpleLoss(epsilon=EPSILON, kl_coeff=KL_COEFF)
    tok = AutoTokenizer.from_pretrained(POLICY)
    with torch.no_grad():
        logprobs = logprobs_of(model, query_responses, ctx)
        with model.disable_adapter():
            ref_logprobs = logprobs_of(model, query_responses, ctx)
        padding, cut = rlhf.truncate_sequence_at_first_stop_token(
            query_responses[:, ctx:].clone(), torch.tensor(STOPS), PAD
        )
        rewards, _ = grpo_rewards.batch_shaped_correctness_reward(
            Decoder(tok), cut.reshape(len(PROMPTS), G, -1), ANSWERS
        )
        advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4)
        advantages = advantages.reshape(-1)
        logprobs[padding] = 1.0
        ref_logprobs[padding] = 1.0
    named = {k.replace(".default", ""): p for k, p in model.named_parameters() if p.requires_grad}
    tracked = [k for k in named if "layers.0.self_attn.q_proj" in k or "layers.1.mlp.down_proj" in k]
    opt = torch.optim.AdamW([p for p in named.values()], lr=LR)
    steps = []
    for epoch in (1, 2):
        pi = logprobs_of(model, query_responses, ctx)
        pi[padding] = 1.0
        loss, policy_loss, kl_loss, ratios, clipfrac = loss_fn(
            logprobs, pi, ref_logprobs, advantages, padding_masks=~padding
        )
        loss.backward()
        with torch.no_grad():
            approx_kl = (0.5 * (pi - logprobs).pow(2)).mean()
        save_file({k: named[k].grad.detach().clone() for k in tracked},
                  os.path.join(OUT, f"grads_lora_epoch{epoch}.safetensors"))
        norm = torch.nn.utils.clip_grad_norm_(list(named.values()), max_norm=CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        save_file({k: named[k].detach().clone() for k in tracked},
                  os.path.join(OUT, f"params_lora_epoch{epoch}.safetensors"))
        steps.append({"loss": loss.item(), "policy_loss": policy_loss.item(), "kl_loss": kl_loss.item(),
                      "ratios": ratios.item(), "clipfrac": clipfrac.item(),
                      "approx_policy_kl": approx_kl.item(), "grad_norm": norm.item()})
    return {"ref_logprobs": tolist(ref_logprobs), "logprobs": tolist(logprobs), "steps": steps}


GSM8K_ROWS = [
    {"question": f"Ann has {i} apples and buys {i + 2} more. How many now?",
     "answer": f"She has {i} + {i + 2} = <<{i}+{i + 2}={2 * i + 2}>>{2 * i + 2} apples.\n#### {2 * i + 2}"}
    for i in range(6)
]
PARTITION = "1-2/4"


def gsm8k_cases(tok):
    """torchtune's gsm8k_dataset / gsm8k_sft samples of GSM8K_ROWS (written to gsm8k.jsonl) with
    PARTITION, their prompts from torchtune's module, tokenized as torchtune's tokenizers encode
    (BOS, no EOS for a prompt; no BOS, EOS for the trained part)."""
    with open(os.path.join(OUT, "gsm8k.jsonl"), "w") as f:
        for r in GSM8K_ROWS:
            f.write(json.dumps(r) + "\n")
    start, end, total = 1, 2, 4
    kept = [r for i, r in enumerate(GSM8K_ROWS) if start <= i % total <= end]
    eos = tok.eos_token_id
    # "BOS" is what the tokenizer's own post-processor puts first (ferrotune's rule for every
    # builder; this tokenizer adds none).
    with_bos = lambda s: tok.encode(s, add_special_tokens=True)  # noqa: E731
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    rl, sft = [], []
    for r in kept:
        p = grpo_gsm8k.normalize_gsm(r)
        question = sys.modules["tt_grpo.data"].BASE_PROMPT % p["question"]
        rl.append({"prompt_ids": with_bos(question), "answer": p["answer"]})
        t = grpo_gsm8k.sft_gsm_transform(r)
        pre, trained = with_bos(t["preamble"]), enc(t["trainable"]) + [eos]
        sft.append({"input_ids": pre + trained, "labels": [-100] * len(pre) + trained})
    return {"partition": PARTITION, "problems": rl, "sft": sft}


def main():
    os.makedirs(OUT, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(POLICY)
    load = dict(dtype=torch.float32, attn_implementation="eager")
    reference = AutoModelForCausalLM.from_pretrained(POLICY, **load).eval()

    width = max(len(p) for p in PROMPTS)
    prompts = torch.tensor([[PAD] * (width - len(p)) + p for p in PROMPTS])
    ctx = width
    comps = completions(tok)
    resp_width = max(len(c) for c in comps)
    responses = torch.tensor([c + [PAD] * (resp_width - len(c)) for c in comps])
    query_responses = torch.cat([prompts.repeat_interleave(G, dim=0), responses], dim=1)

    golden = {
        "prompts": PROMPTS,
        "answers": ANSWERS,
        "grpo_samples": G,
        "completions": comps,
        "pad_id": PAD,
        "stop_token_ids": STOPS,
        "temperature": TEMPERATURE,
        "kl_coeff": KL_COEFF,
        "epsilon": EPSILON,
        "lr": LR,
        "clip_grad_norm": CLIP,
        "tracked": TRACKED,
    }
    for name, loss_fn in [
        ("simple", grpo_loss.GRPOSimpleLoss(epsilon=EPSILON, kl_coeff=KL_COEFF)),
        ("clipped", grpo_loss.GRPOLoss(epsilon=EPSILON, kl_coeff=KL_COEFF)),
    ]:
        policy = AutoModelForCausalLM.from_pretrained(POLICY, **load).eval()
        # ---- generate_trajectory (after generation)
        with torch.no_grad():
            logprobs = logprobs_of(policy, query_responses, ctx)
            ref_logprobs = logprobs_of(reference, query_responses, ctx)
            padding, cut = rlhf.truncate_sequence_at_first_stop_token(
                query_responses[:, ctx:].clone(), torch.tensor(STOPS), PAD
            )
            rewards, successes = grpo_rewards.batch_shaped_correctness_reward(
                Decoder(tok), cut.reshape(len(PROMPTS), G, -1), ANSWERS
            )
            advantages = (rewards - rewards.mean(1, keepdim=True)) / (
                rewards.std(1, keepdim=True) + 1e-4
            )
            advantages = advantages.reshape(-1)
            logprobs[padding] = 1.0
            ref_logprobs[padding] = 1.0
        if name == "simple":
            golden["trajectory"] = {
                "logprobs": tolist(logprobs),
                "ref_logprobs": tolist(ref_logprobs),
                "response_padding": tolist(padding),
                "rewards": tolist(rewards.reshape(-1)),
                "successes": tolist(successes.reshape(-1)),
                "advantages": tolist(advantages),
            }
        # ---- grpo_step, ppo_epochs times, each an optimizer step
        opt = torch.optim.AdamW(policy.parameters(), lr=LR)
        steps = []
        for epoch in (1, 2):
            pi = logprobs_of(policy, query_responses, ctx)
            pi[padding] = 1.0
            loss, policy_loss, kl_loss, ratios, clipfrac = loss_fn(
                logprobs, pi, ref_logprobs, advantages, padding_masks=~padding
            )
            loss.backward()
            with torch.no_grad():
                approx_kl = (0.5 * (pi - logprobs).pow(2)).mean()
            grads = {k: p.grad.detach().clone() for k, p in policy.named_parameters() if k in TRACKED}
            norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm=CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            save_file(grads, os.path.join(OUT, f"grads_{name}_epoch{epoch}.safetensors"))
            params = {k: p.detach().clone() for k, p in policy.named_parameters() if k in TRACKED}
            save_file(params, os.path.join(OUT, f"params_{name}_epoch{epoch}.safetensors"))
            steps.append(
                {
                    "loss": loss.item(),
                    "policy_loss": policy_loss.item(),
                    "kl_loss": kl_loss.item(),
                    "ratios": ratios.item(),
                    "clipfrac": clipfrac.item(),
                    "approx_policy_kl": approx_kl.item(),
                    "grad_norm": norm.item(),
                }
            )
        golden[f"steps_{name}"] = steps
    golden["steps_lora"] = lora_steps(query_responses, ctx)
    golden["gsm8k"] = gsm8k_cases(tok)
    with open(os.path.join(OUT, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)
    print(json.dumps({k: golden[k] for k in ["steps_simple", "steps_clipped"]}, indent=1))
    print("rewards", golden["trajectory"]["rewards"])


if __name__ == "__main__":
    main()
