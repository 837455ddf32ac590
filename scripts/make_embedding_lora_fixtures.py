#!/usr/bin/env python3
"""PEFT references for LoRA/DoRA on the token embedding (`target_modules` naming `embed_tokens`), and
for trainable tokens (`trainable_token_indices`).

For each case under tests/fixtures/embedding_lora/<name>/:
- `adapter/`: PEFT's save_pretrained with its defaults (lora_embedding_A/B, DoRA's
  lora_magnitude_vector, and the base weights of the adapted embedding and head,
  `*.base_layer.weight`).
- `golden.json`: `input_ids`, `labels` (they include the pad token, whose embedding row PEFT's
  `F.embedding(..., padding_idx=pad)` keeps out of lora_embedding_A's gradient), `lora_loss`, and
  `merged_equals_adapter` (False where PEFT's merge changes the outputs: a head tied to the embedding
  takes the merged delta too).
- `golden.safetensors`: `lora_logits` (the adapter in train mode) and `merged_logits` (after
  PEFT's merge_and_unload).
- `lora_grads.safetensors`: d lora_loss / d param, PEFT parameter names without the adapter name.
- `merged.safetensors`: the merged model's state dict (PEFT's merge_and_unload).

Adapter values are random (A and B non-zero), so every part shows in the outputs. CPU, float32.
Run from the repository root: python3 scripts/make_embedding_lora_fixtures.py
"""
import json
import os
import sys

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
OUT = os.path.join(ROOT, "embedding_lora")

# name: (base model folder under tests/fixtures, LoraConfig keyword arguments)
CASES = {
    # Llama, untied head: the embedding and two projections.
    "llama3": ("llama3/model", dict(r=2, lora_alpha=8, target_modules=["embed_tokens", "q_proj", "down_proj", "lm_head"])),
    # DoRA on the embedding: the magnitude is per hidden unit (the embedding as a linear map from
    # the one-hot vocabulary).
    "llama3_dora": ("llama3/model", dict(r=3, lora_alpha=6, use_dora=True, target_modules=["embed_tokens", "v_proj"])),
    # rsLoRA and a regex target that matches the embedding.
    "llama3_regex_rslora": (
        "llama3/model",
        dict(r=4, lora_alpha=4, use_rslora=True, target_modules=r".*(embed_tokens|o_proj)"),
    ),
    # Qwen2 ties its head to the embedding: the head keeps the base weight while the adapter is on.
    "qwen2_tied": ("qwen2/model", dict(r=2, lora_alpha=4, target_modules=["embed_tokens", "o_proj"])),
    # Gemma scales the embeddings by sqrt(hidden) (the adapter's output too) and ties its head.
    # ... and the head, tied to the embedding, adapted too.
    "gemma": ("models/gemma/model", dict(r=2, lora_alpha=8, target_modules=["embed_tokens", "k_proj", "lm_head"])),
    "gemma3_dora": ("models/gemma3/model", dict(r=2, lora_alpha=8, use_dora=True, target_modules=["embed_tokens", "up_proj"])),
    # ensure_weight_tying: the tied head shares the embedding's adapter (its lora_A is the
    # embedding's lora_embedding_B transposed, its lora_B lora_embedding_A transposed). PEFT's own
    # merge then adds the delta twice to the shared weight.
    "qwen2_tied_ensure": (
        "qwen2/model",
        dict(r=2, lora_alpha=4, target_modules=["embed_tokens", "o_proj"], ensure_weight_tying=True),
    ),
    # A vocabulary resized for the adapter (`resize_token_embeddings(520)`, `resize_to` here): PEFT
    # then saves the whole embedding and head (`model.embed_tokens.weight`, `lm_head.weight`)
    # beside a LoRA on the projections; the inputs use the new tokens.
    "resized_llama3": ("llama3/model", dict(r=2, lora_alpha=8, target_modules=["q_proj"], resize_to=520)),
    "resized_qwen2_tied": ("qwen2/model", dict(r=2, lora_alpha=4, target_modules=["v_proj"], resize_to=520)),
    # PEFT's trainable tokens: the listed rows of the embedding replaced by trained values
    # (`trainable_tokens_delta`), the pad token among them; a tied head uses the same rows.
    # OLMo 2 (no pre-norms, q/k norms over the whole projection): the embedding and every
    # projection, so that the gradients pass through both norms of each block.
    "olmo2": (
        "models/olmo2/model",
        dict(
            r=2,
            lora_alpha=8,
            target_modules=["embed_tokens", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
    ),
    "tokens_llama3": ("llama3/model", dict(r=2, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[3, 17, 300])),
    "tokens_qwen2_tied": (
        "qwen2/model",
        dict(r=2, lora_alpha=4, target_modules=["v_proj"], trainable_token_indices={"embed_tokens": [5, 100, 511]}),
    ),
}


def inputs(vocab, pad):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (2, 12), generator=g)
    # The pad token as a real input in both rows, and as padding at the end of the second.
    ids[0, 3] = pad
    ids[1, 9:] = pad
    labels = ids.clone()
    labels[1, 9:] = -100
    return ids, labels


def make_case(out, name, base, kwargs):
    """Writes the case `name` (base model folder `base`, LoraConfig keyword arguments `kwargs`)
    under `out/name`. Where PEFT cannot merge the adapter (`lora_bias` on a layer without a bias)
    the merged files are left out and golden.json says why (`merge_error`)."""
    torch.manual_seed(1234)
    kwargs = dict(kwargs)
    # Vision-language models (Qwen2.5-VL, Qwen3-VL) are no AutoModelForCausalLM in transformers 5.
    auto = kwargs.pop("auto_class", AutoModelForCausalLM)
    # Where PyTorch's own float32 run is not exact enough to compare against (its gradients far
    # from its float64 ones), the reference is computed in float64 (adapter values rounded to
    # float32 first, so that the saved float32 adapter is exactly the one used) and saved as float32.
    f64 = kwargs.pop("float64_reference", False)
    model = auto.from_pretrained(os.path.join(ROOT, base), dtype=torch.float64 if f64 else torch.float32,
                                 **({"experts_implementation": "eager"} if f64 else {}))
    resize_to = kwargs.pop("resize_to", None)
    # Phi-3.5-MoE's sparsemixer samples experts in training mode: its gradients are taken in
    # evaluation mode (deterministic routing), as ferrotune routes.
    eval_grads = kwargs.pop("eval_grads", False)
    if resize_to:
        model.resize_token_embeddings(resize_to)
    text_config = model.config.get_text_config()
    ids, labels = inputs(text_config.vocab_size, text_config.pad_token_id)
    if resize_to:
        ids[0, 6] = labels[0, 6] = resize_to - 3
    assert model.get_input_embeddings().padding_idx == text_config.pad_token_id
    cfg = LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, init_lora_weights=False, **kwargs)
    model = get_peft_model(model, cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_" in pname and "magnitude" not in pname:
                p.copy_(torch.randn_like(p) * 0.2)
            elif "trainable_tokens_delta" in pname:
                p.copy_(torch.randn_like(p))
            elif "magnitude" in pname:
                p.mul_(1 + 0.1 * torch.randn_like(p))
            if f64 and p.requires_grad:
                p.copy_(p.float().double())
    model.eval() if eval_grads else model.train()
    out_ = model(input_ids=ids, labels=labels)
    out_.loss.backward()
    grads = {
        n.replace(".default", ""): p.grad.detach().clone().contiguous()
        for n, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    d = os.path.join(out, name)
    os.makedirs(d, exist_ok=True)
    # PEFT's default save_embedding_layers="auto": with embed_tokens (or lm_head) among the
    # targets, the adapted embedding's and head's base weights are saved beside the adapter.
    model.save_pretrained(os.path.join(d, "adapter"))
    os.remove(os.path.join(d, "adapter", "README.md"))
    model.eval()
    golden = {"lora_logits": None}
    merge_error = None
    with torch.no_grad():
        lora_logits = model(input_ids=ids).logits
        golden["lora_logits"] = lora_logits.contiguous()
        try:
            merged = model.merge_and_unload()
        except RuntimeError as e:
            merge_error = str(e)
    if merge_error is None:
        with torch.no_grad():
            merged_logits = merged(input_ids=ids).logits
        golden["merged_logits"] = merged_logits.contiguous()
        state = {k: v.detach().clone().contiguous() for k, v in merged.state_dict().items()}
        # Multimodal configs without the flag (Llama 3.2 Vision's) are untied.
        if getattr(merged.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, os.path.join(d, "merged.safetensors"))
    save_file(golden, os.path.join(d, "golden.safetensors"))
    save_file(grads, os.path.join(d, "lora_grads.safetensors"))
    meta = {
        "base": base,
        "input_ids": ids.tolist(),
        "labels": labels.tolist(),
        "lora_loss": out_.loss.item(),
    }
    if merge_error is None:
        meta["merged_equals_adapter"] = bool(torch.allclose(lora_logits, merged_logits, atol=1e-4))
    else:
        meta["merge_error"] = merge_error
    if f64:
        meta["reference_dtype"] = "float64"
        for f in ("golden.safetensors", "lora_grads.safetensors", "merged.safetensors",
                  os.path.join("adapter", "adapter_model.safetensors")):
            path = os.path.join(d, f)
            if os.path.exists(path):
                save_file({k: v.float().contiguous() for k, v in load_file(path).items()}, path)
    json.dump(meta, open(os.path.join(d, "golden.json"), "w"), indent=1)
    print(name, out_.loss.item(), sorted(grads), "merge:", meta.get("merged_equals_adapter", merge_error))


def run_cases(out, cases, only=()):
    """Writes the cases of `cases` ({name: (base model folder, LoraConfig keyword arguments)})
    under `out`: those named in `only`, or all of them."""
    for name, (base, kwargs) in cases.items():
        if not only or name in only:
            make_case(out, name, base, kwargs)


if __name__ == "__main__":
    run_cases(OUT, CASES, sys.argv[1:])
