"""PEFT adapters with `modules_to_save` (fully trained extra modules), as PEFT saves and loads them.

Usage: python3 scripts/make_modules_to_save_fixtures.py   (PyTorch 2.x, transformers 5.x, PEFT 0.21)

Cases in tests/fixtures/peft_modules_to_save/<case>/:
    adapter/              what PeftModel.save_pretrained writes (adapter_config.json + adapter_model.safetensors,
                          or adapter_model.bin for `bin`)
    golden.safetensors    logits [2, 16, vocab] of PeftModel.from_pretrained(base, adapter) on golden.json's input_ids
    golden.json           input_ids, and the base fixture the adapter belongs to
- untied: tests/fixtures/models/llama2, LoRA on q/v and modules_to_save [lm_head, embed_tokens]
- resized: the same base after resize_token_embeddings(520) (8 new tokens, as when a chat format adds some),
  modules_to_save [embed_tokens, lm_head]
- tied: tests/fixtures/models/smollm2_like (tied head), modules_to_save [embed_tokens]: PEFT trains a copy of
  the embedding while the head keeps the original (ensure_weight_tying false, its default)
- bin: `untied` saved with safe_serialization=False (adapter_model.bin)
Every trained tensor is random (not PEFT's init), so that each one changes the logits.
"""
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "tests" / "fixtures" / "models"
OUT = REPO / "tests" / "fixtures" / "peft_modules_to_save"

CASES = {
    "untied": ("llama2", ["lm_head", "embed_tokens"], None, True),
    "resized": ("llama2", ["embed_tokens", "lm_head"], 520, True),
    "tied": ("smollm2_like", ["embed_tokens"], None, True),
    "bin": ("llama2", ["lm_head", "embed_tokens"], None, False),
}


@torch.no_grad()
def main():
    torch.manual_seed(0)
    for case, (base, modules, resize, safe) in CASES.items():
        out = OUT / case
        if out.exists():
            shutil.rmtree(out)
        model = AutoModelForCausalLM.from_pretrained(MODELS / base / "model", dtype=torch.float32)
        if resize:
            model.resize_token_embeddings(resize)
        cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=modules)
        pm = get_peft_model(model, cfg)
        g = torch.Generator().manual_seed(len(case))
        for name, p in pm.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "lora" in name else 0.5))
        pm.save_pretrained(out / "adapter", safe_serialization=safe)
        # Reload as a user would: the base (resized the same way) + the saved adapter.
        fresh = AutoModelForCausalLM.from_pretrained(MODELS / base / "model", dtype=torch.float32)
        if resize:
            fresh.resize_token_embeddings(resize)
        loaded = PeftModel.from_pretrained(fresh, out / "adapter").eval()
        golden = json.loads((MODELS / base / "golden.json").read_text())
        ids = torch.tensor(golden["input_ids"])
        if resize:
            ids[:, -1] = resize - 1  # one of the added tokens
        logits = loaded(input_ids=ids).logits.float().contiguous()
        save_file({"logits": logits}, str(out / "golden.safetensors"))
        (out / "golden.json").write_text(json.dumps({"base": base, "input_ids": ids.tolist()}) + "\n")
        print(case, sorted(f.name for f in (out / "adapter").iterdir()), tuple(logits.shape))


if __name__ == "__main__":
    main()
