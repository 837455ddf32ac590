#!/usr/bin/env python3
"""Checks `ferrotune export-gguf ADAPTER_DIR OUT.gguf` (a PEFT LoRA adapter as llama.cpp's LoRA
GGUF) with llama.cpp itself: llama-cpp-python runs the base model's GGUF (exported f32 by
ferrotune) with the adapter GGUF (`lora_path`), and its logits of the golden input are compared
with transformers + PEFT running the PEFT adapter on the original checkpoint.

  python scripts/check_gguf_adapter.py target/release/ferrotune

Cases: the Llama 3 fixture's adapter (q/k rows in llama.cpp's order, GQA), its rsLoRA adapter
with rank and alpha patterns (scales folded into B), the Qwen2 fixture's adapter, an adapter on
Llama 3's token embedding and head (PEFT's lora_embedding_A/B), and a PEFT adapter made here on
the Phi-3 fixture (fused qkv_proj / gate_up_proj).

Needs: torch, transformers, peft, safetensors, llama-cpp-python."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import peft.tuners.lora.torchao as peft_torchao
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

# PEFT refuses an older torchao when one is installed (torchtune's checks want 0.10); its torchao
# dispatch is not used here.
peft_torchao.is_torchao_available = lambda: False

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(ROOT / "scripts"))
from check_gguf_export import llama_cpp_logits  # noqa: E402


def peft_logits(base, adapter, ids):
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(adapter)).eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def base_logits(base, ids):
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def phi3_adapter(out):
    base = FIX / "models" / "phi3" / "model"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8,
                        target_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"])
    model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    model.save_pretrained(str(out))
    return base, out


def main():
    binary = Path(sys.argv[1]).resolve()
    tmp = Path(tempfile.mkdtemp())
    cases = [
        ("llama3", FIX / "llama3" / "model", FIX / "llama3" / "adapter",
         FIX / "llama3" / "golden.json"),
        ("llama3 rslora+patterns", FIX / "llama3" / "model",
         FIX / "lora_variants" / "rslora_patterns" / "adapter", FIX / "llama3" / "golden.json"),
        ("qwen2", FIX / "qwen2" / "model", FIX / "qwen2" / "adapter", FIX / "qwen2" / "golden.json"),
        # The token embedding and the head adapted too (lora_embedding_A/B; PEFT's default save
        # with the base weights beside the adapter).
        ("llama3 embed+head", FIX / "llama3" / "model", FIX / "embedding_lora" / "llama3" / "adapter",
         FIX / "embedding_lora" / "llama3" / "golden.json"),
    ]
    base, adapter = phi3_adapter(tmp / "phi3_adapter")
    cases.append(("phi3 (fused)", base, adapter, FIX / "models" / "phi3" / "golden.json"))
    ok = True
    print(f"{'case':24} {'llama.cpp vs PEFT':>18} {'adapter effect':>15}")
    for i, (name, base, adapter, golden) in enumerate(cases):
        ids = json.loads(golden.read_text())["input_ids"]
        base_gguf, lora_gguf = tmp / f"base{i}.gguf", tmp / f"lora{i}.gguf"
        subprocess.run([binary, "export-gguf", base, base_gguf, "--outtype", "f32"], check=True,
                       capture_output=True)
        subprocess.run([binary, "export-gguf", adapter, lora_gguf, "--base", base], check=True,
                       capture_output=True)
        want = peft_logits(base, adapter, ids)
        got = llama_cpp_logits(base_gguf, ids, lora_gguf)
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        effect = float(np.linalg.norm(want - base_logits(base, ids)) / np.linalg.norm(want))
        print(f"{name:24} {err:18.2e} {effect:15.2e}")
        ok &= err < 1e-5 and effect > 1e-2
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
