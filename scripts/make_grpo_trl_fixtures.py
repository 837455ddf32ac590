#!/usr/bin/env python3
"""GRPO references from TRL's own `GRPOTrainer` (trl 1.16.0, transformers 5.24, torch 2.15) for
ferrotune's TRL loss family (`loss.loss_type` grpo, dr_grpo, dapo, bnpo; `epsilon`/`epsilon_high`;
`importance_sampling_level: sequence` (GSPO); `beta`; `scale_rewards`; `reward_weights`).

For each case a real `GRPOTrainer` is built on the tiny Llama (tests/fixtures/llama3/model, f32, CPU)
with two reward functions and `reward_weights`; its `_generate` is replaced by one returning fixed
completions (two prompts of equal length, three completions each, cut after their first EOS as TRL's
generation cuts them), so sampling does not enter. TRL's `_generate_and_score_completions` then
scores them (rewards per function, weighted sum, `scale_rewards`, advantages) and TRL's
`_compute_loss` computes the loss, whose gradient is taken with `loss.backward()`. The "old" (sampling)
and reference log probabilities are injected, as tables the current policy's log probabilities plus a
fixed pattern, so that ratios differ from 1 (clipping happens) and the KL term is not zero; the
golden records them, and ferrotune's test injects the same tables.

Recorded in tests/fixtures/grpo_trl/golden.json: the prompts, completions, per-function rewards, and
per case its settings, TRL's advantages, `num_items_in_batch`, the injected tables, the loss; and
tests/fixtures/grpo_trl/grads_{case}.safetensors: a few parameters' gradients.

Run from the repository root (TRL in a venv that keeps the system torch/transformers):
    "$(scripts/fetch-trl.sh)/bin/python" scripts/make_grpo_trl_fixtures.py
The tests read the committed outputs; they do not run this script.
"""
import json
import math
import os
import tempfile

import torch
import trl
from datasets import Dataset
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
POLICY = os.path.join(ROOT, "llama3", "model")
OUT = os.path.join(ROOT, "grpo_trl")
EOS = 2
G = 3
TEMPERATURE = 0.8
PROMPTS = [[40, 41, 42, 43, 44], [50, 51, 52, 53, 54]]
MAX_COMPLETION_LENGTH = 40
REWARD_WEIGHTS = [1.0, 0.5]
TRACKED = [
    "model.embed_tokens.weight",
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.down_proj.weight",
    "model.norm.weight",
    "lm_head.weight",
]
CASES = {
    "grpo": dict(loss_type="grpo", beta=0.04, epsilon=0.2, scale_rewards="group"),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.04, epsilon=0.2, scale_rewards="none"),
    "dapo": dict(loss_type="dapo", beta=0.0, epsilon=0.2, scale_rewards="group"),
    "bnpo": dict(loss_type="bnpo", beta=0.04, epsilon=0.2, scale_rewards="batch"),
    "clip_higher": dict(loss_type="dapo", beta=0.04, epsilon=0.2, epsilon_high=0.28, scale_rewards="group"),
    # β large enough that the loss is not a near-cancelling sum of ± advantages (whose relative
    # error is the log probabilities' rounding over a value near 0).
    "gspo": dict(loss_type="grpo", beta=0.5, epsilon=0.05, epsilon_high=0.08,
                 importance_sampling_level="sequence", scale_rewards="group"),
}


def a_count(prompts, completions, **kwargs):
    """Reward 1: how many times 'a' occurs in the completion."""
    return [float(c.count("a")) for c in completions]


def length(prompts, completions, **kwargs):
    """Reward 2: minus the completion's length in characters, over 10."""
    return [-len(c) / 10.0 for c in completions]


def completions(tok):
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    return [
        enc("x</think> <answer>72</answer>") + [EOS],
        enc("so a banana <answer>$72</answer>") + [EOS],
        # Never stops: the longest row, as a sampled completion that runs to the limit is.
        enc("no tags, and no stop either: it runs on and on, past every other completion here"),
        enc("<answer><<5>></answer> aaa") + [EOS],
        enc("<answer>6</answer>") + [EOS],
        [EOS],
    ]


def pattern(rows, cols, a, b, scale):
    return torch.tensor([[scale * math.sin(a * i + b * j + 0.3) for j in range(cols)] for i in range(rows)])


def run_case(name, settings, tok, comps, golden):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(POLICY, dtype=torch.float32, attn_implementation="eager")
    texts = [tok.decode(c, skip_special_tokens=True) for c in comps]
    prompt_texts = [tok.decode(p) for p in PROMPTS]
    dataset = Dataset.from_dict({"prompt": prompt_texts})
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=len(comps),
            num_generations=G,
            max_completion_length=MAX_COMPLETION_LENGTH,
            temperature=TEMPERATURE,
            reward_weights=REWARD_WEIGHTS,
            report_to=[],
            use_cpu=True,
            bf16=False,
            **settings,
        )
        trainer = GRPOTrainer(
            model=model, reward_funcs=[a_count, length], args=args, train_dataset=dataset, processing_class=tok
        )

    def fixed_generate(prompts):
        prompt_ids = [list(PROMPTS[i // G]) for i in range(len(comps))]
        return prompt_ids, [list(c) for c in comps], None, texts, None, {}, None, None

    trainer._generate = fixed_generate
    trainer.current_gradient_accumulation_steps = 1
    model = trainer.model
    model.train()
    inputs = [{"prompt": prompt_texts[i // G]} for i in range(len(comps))]
    scored = trainer._generate_and_score_completions(inputs)
    # The current policy's log probabilities, then the injected old and reference tables.
    with torch.no_grad():
        ids = torch.cat([scored["prompt_ids"], scored["completion_ids"]], 1)
        mask = torch.cat([scored["prompt_mask"], scored["completion_mask"]], 1)
        current, _, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, scored["completion_ids"].size(1)
        )
    rows, cols = current.shape
    old = current + pattern(rows, cols, 1.7, 0.9, 0.25)
    ref = current + pattern(rows, cols, 1.3, 0.7, 0.2)
    scored["old_per_token_logps"] = old
    scored["ref_per_token_logps"] = ref
    model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(model, scored)
    loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if k in TRACKED}
    save_file(grads, os.path.join(OUT, f"grads_{name}.safetensors"))
    cmask = scored["completion_mask"].bool()
    golden["cases"][name] = {
        "settings": settings,
        "advantages": scored["advantages"].tolist(),
        "num_items_in_batch": int(scored["num_items_in_batch"].item()),
        "old_logprobs": old.masked_fill(~cmask, 0.0).tolist(),
        "ref_logprobs": ref.masked_fill(~cmask, 0.0).tolist(),
        "current_logprobs": current.masked_fill(~cmask, 0.0).tolist(),
        "loss": loss.item(),
    }
    print(name, loss.item(), scored["advantages"].tolist())


def main():
    os.makedirs(OUT, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(POLICY)
    comps = completions(tok)
    texts = [tok.decode(c, skip_special_tokens=True) for c in comps]
    golden = {
        "trl_version": trl.__version__,
        "prompts": PROMPTS,
        "grpo_samples": G,
        "completions": comps,
        "completion_texts": texts,
        "temperature": TEMPERATURE,
        "max_completion_length": MAX_COMPLETION_LENGTH,
        "reward_weights": REWARD_WEIGHTS,
        "rewards_per_func": [a_count(None, texts), length(None, texts)],
        "tracked": TRACKED,
        "cases": {},
    }
    for name, settings in CASES.items():
        run_case(name, settings, tok, comps, golden)
    with open(os.path.join(OUT, "golden.json"), "w") as f:
        json.dump(golden, f, indent=1)


if __name__ == "__main__":
    main()
