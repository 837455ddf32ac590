#!/usr/bin/env python3
"""NF4 (QLoRA) references for ferrotune's tests, from torchao's `to_nf4` (what torchtune's
`qlora_*` models quantize their frozen base with).

tests/fixtures/nf4/quantize.safetensors: for bf16, f16 and f32 weights of two shapes, the input
(`{case}.weight`, in its dtype), torchao's `quantized_data` (`.codes`), `quantized_scalers` (`.scalers`,
as i64), `quantization_factor` (`.factor`, as f32), `scaler_mean` (`.mean`) and the dequantized
weight (`.dequantized`, in the case's dtype).

tests/fixtures/nf4/qlora/: a tiny Llama whose layer shapes torchao accepts (`model/`, bf16 on
disk, with the tiny Llama's tokenizer), and a QLoRA reference in f32: every decoder-layer linear
replaced by its NF4 round trip (as torchtune's `FrozenNF4Linear` / `LoRALinear(quantize_base=True)` compute it), a PEFT LoRA
adapter on q_proj, v_proj and down_proj only (the other projections stay NF4 without an adapter),
its `adapter/`, `golden.json` (input_ids, labels, loss) and `lora_grads.safetensors`.

Run from the repository root with torch, torchao, transformers, peft and safetensors installed:
python3 scripts/make_nf4_fixtures.py
"""
import json
import os
import shutil

import torch
from safetensors.torch import save_file

try:  # torchao < 0.15 (what torchtune 0.6 imports)
    from torchao.dtypes.nf4tensor import to_nf4
except ImportError:  # torchao >= 0.15 moved it
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

ROOT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "nf4")


def quantize_cases():
    out = {}
    gen = torch.Generator().manual_seed(7)
    for dtype, name in [(torch.bfloat16, "bf16"), (torch.float16, "f16"), (torch.float32, "f32")]:
        for shape in [(128, 256), (96, 512)]:
            w = torch.randn(shape, generator=gen) * 0.05
            # An outlier row, values exactly on levels' midpoints, and a constant block (all
            # maxima equal within the block; distances tie often in 16-bit types).
            w[3] *= 40.0
            w[5, :64] = 0.0123
            w[7, :64] = torch.linspace(-1, 1, 64)
            w = w.to(dtype)
            q = to_nf4(w)
            case = f"{name}_{shape[0]}x{shape[1]}"
            out[f"{case}.weight"] = w
            out[f"{case}.codes"] = q.quantized_data.contiguous()
            out[f"{case}.scalers"] = q.quantized_scalers.to(torch.int64)
            out[f"{case}.factor"] = q.quantization_factor.float()
            out[f"{case}.mean"] = q.scaler_mean.float().reshape(1)
            out[f"{case}.dequantized"] = q.get_original_weight()
    os.makedirs(ROOT, exist_ok=True)
    save_file(out, os.path.join(ROOT, "quantize.safetensors"))
    print("quantize cases:", len(out) // 6)


def qlora_reference():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    d = os.path.join(ROOT, "qlora")
    torch.manual_seed(1234)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
        num_hidden_layers=2,
        vocab_size=256,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    base = LlamaForCausalLM(config).to(torch.bfloat16)
    base.save_pretrained(os.path.join(d, "model"))
    # The recipes want a tokenizer beside the weights: the tiny Llama's (its ids cover these).
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(ROOT, "..", "llama3", "model", f), os.path.join(d, "model", f))

    model = LlamaForCausalLM.from_pretrained(os.path.join(d, "model"), dtype=torch.float32)
    with torch.no_grad():
        for name, module in model.named_modules():
            if ".layers." in name and isinstance(module, torch.nn.Linear):
                module.weight.copy_(to_nf4(module.weight.data).get_original_weight())
    cfg = LoraConfig(
        task_type="CAUSAL_LM",
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj", "down_proj"],
        init_lora_weights=False,
    )
    model = get_peft_model(model, cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "lora_" in pname:
                p.copy_(torch.randn_like(p) * 0.2)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 256, (2, 16), generator=gen)
    labels = ids.clone()
    labels[0, :5] = -100
    labels[1, :3] = -100
    model.train()
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    grads = {
        n.replace(".default", ""): p.grad.detach().clone().contiguous()
        for n, p in model.named_parameters()
        if p.requires_grad and p.grad is not None
    }
    model.save_pretrained(os.path.join(d, "adapter"))
    readme = os.path.join(d, "adapter", "README.md")
    if os.path.exists(readme):
        os.remove(readme)
    save_file(grads, os.path.join(d, "lora_grads.safetensors"))
    golden = {"input_ids": ids.tolist(), "labels": labels.tolist(), "loss": out.loss.item()}
    json.dump(golden, open(os.path.join(d, "golden.json"), "w"), indent=1)
    print("qlora loss", out.loss.item(), "grads", len(grads))


if __name__ == "__main__":
    quantize_cases()
    qlora_reference()
