"""Writes tests/fixtures/torchtune_adapter/: LoRA/DoRA adapters as torchtune 0.6.1 saves them
(`adapter_model.pt`: its module names, q/k rows in its layout) on the tiny model fixtures, with
the logits torchtune's own LoRA model computes with them.

For each case, torchtune's `lora_*` builder is made at the fixture's size, the HF base is loaded
through torchtune's converter for that model type, every adapter parameter is set to random
values (B non-zero, a DoRA magnitude away from the weight norms), and
- `adapter_model.pt` is `torch.save` of `get_adapter_params(model)` (what the checkpointer saves),
- `golden.json` holds the builder's LoRA settings and `input_ids`,
- `golden.safetensors` holds torchtune's `logits` for `input_ids`,
- except for Phi-3, `adapter_config.json` and `adapter_model.safetensors` are the PEFT files
  torchtune's `FullModelHFCheckpointer` writes beside the `.pt` (`tune_to_peft_adapter_config`
  of the recipe's adapter config, `tune_to_peft_adapter_weights`) — wrong for Qwen2's q/k and
  DoRA's q/k magnitudes in torchtune 0.6.1, which is what the tests show ferrotune working around.

Needs torch, safetensors and torchtune 0.6.1's source (`TORCHTUNE_SRC`, default /tmp/tt/src:
`pip download --no-deps torchtune==0.6.1` and unzip it).

    python3 scripts/make_torchtune_adapter_fixtures.py
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchtune_source import use_torchtune_source  # noqa: E402

use_torchtune_source()

from torchtune.models import convert_weights  # noqa: E402
from torchtune.models.gemma import lora_gemma  # noqa: E402
from torchtune.models.llama2 import lora_llama2  # noqa: E402
from torchtune.models.phi3 import lora_phi3  # noqa: E402
from torchtune.models.phi3._convert_weights import phi3_hf_to_tune  # noqa: E402
from torchtune.models.qwen2 import lora_qwen2  # noqa: E402
from torchtune.models.qwen2._convert_weights import qwen2_hf_to_tune  # noqa: E402
from torchtune.modules.peft import get_adapter_params, get_lora_module_names  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures")
OUT = os.path.join(ROOT, "torchtune_adapter")

# case name -> (base fixture, LoRA settings)
CASES = {
    # Llama kind: q/k rows permuted; DoRA's magnitude follows the rows.
    "llama2_dora": ("llama2", dict(modules=["q_proj", "k_proj", "v_proj"], mlp=False,
                                   output=True, rank=4, alpha=8.0, dora=True)),
    # Gemma: explicit head_dim (32 with hidden 32 and 4 heads), one kv head, tied head.
    "gemma": ("gemma", dict(modules=["q_proj", "k_proj", "v_proj", "output_proj"], mlp=True,
                            output=False, rank=4, alpha=16.0, dora=False)),
    # Qwen2: names only, no permutation.
    "qwen2_5": ("qwen2_5", dict(modules=["q_proj", "k_proj", "output_proj"], mlp=True,
                                output=True, rank=2, alpha=4.0, dora=False)),
    # Phi-3: torchtune splits the fused qkv_proj / gate_up_proj, so q, k, v (and w1, w3) each
    # have their own A; only q and v here, to leave k's rows unadapted.
    "phi3": ("phi3", dict(modules=["q_proj", "v_proj", "output_proj"], mlp=True,
                          output=False, rank=4, alpha=8.0, dora=False)),
    "phi3_dora": ("phi3", dict(modules=["q_proj", "k_proj", "v_proj"], mlp=True,
                               output=False, rank=2, alpha=4.0, dora=True)),
}


def build(base, cfg, lora):
    common = dict(
        lora_attn_modules=lora["modules"],
        apply_lora_to_mlp=lora["mlp"],
        lora_rank=lora["rank"],
        lora_alpha=lora["alpha"],
        use_dora=lora["dora"],
        vocab_size=cfg["vocab_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        embed_dim=cfg["hidden_size"],
        intermediate_dim=cfg["intermediate_size"],
        max_seq_len=64,
        norm_eps=cfg["rms_norm_eps"],
    )
    rope = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 10000.0))
    heads, kv, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    sd = load_file(os.path.join(ROOT, "models", base, "model", "model.safetensors"))
    if base == "llama2":
        model = lora_llama2(apply_lora_to_output=lora["output"], **common)
        sd = convert_weights.hf_to_tune(sd, num_heads=heads, num_kv_heads=kv, dim=dim)
    elif base == "gemma":
        model = lora_gemma(head_dim=cfg["head_dim"], rope_base=rope, **common)
        sd = convert_weights.hf_to_tune(sd, num_heads=heads, num_kv_heads=kv, dim=dim,
                                        head_dim=cfg["head_dim"])
    elif base == "qwen2_5":
        model = lora_qwen2(apply_lora_to_output=lora["output"], rope_base=rope,
                           tie_word_embeddings=cfg["tie_word_embeddings"], **common)
        sd = qwen2_hf_to_tune(sd, num_heads=heads, num_kv_heads=kv, dim=dim,
                              tie_word_embeddings=cfg["tie_word_embeddings"])
    elif base == "phi3":
        model = lora_phi3(apply_lora_to_output=lora["output"], rope_base=rope, **common)
        sd = phi3_hf_to_tune(sd, num_heads=heads, num_kv_heads=kv, dim=dim)
    else:
        raise ValueError(base)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected, unexpected
    assert all("lora" in k or "magnitude" in k for k in missing), missing
    return model


def main():
    torch.manual_seed(0)
    for case, (base, lora) in CASES.items():
        cfg = json.load(open(os.path.join(ROOT, "models", base, "model", "config.json")))
        golden = json.load(open(os.path.join(ROOT, "models", base, "golden.json")))
        model = build(base, cfg, lora).eval()
        params = get_adapter_params(model)
        with torch.no_grad():
            for name, p in params.items():
                if "magnitude" in name:
                    continue
                p.copy_(torch.randn_like(p) * 0.3)
            for m in model.modules():
                if hasattr(m, "initialize_dora_magnitude"):
                    m.initialize_dora_magnitude()
            for name, p in params.items():
                if "magnitude" in name:
                    p.mul_(1 + 0.2 * torch.randn_like(p))
        ids = torch.tensor(golden["input_ids"])
        with torch.no_grad():
            logits = model(ids).float()
        out = os.path.join(OUT, case)
        os.makedirs(out, exist_ok=True)
        state = {k: v.detach().clone().contiguous() for k, v in get_adapter_params(model).items()}
        torch.save(state, os.path.join(out, "adapter_model.pt"))
        json.dump(
            {
                "base": f"models/{base}/model",
                "lora_attn_modules": lora["modules"],
                "apply_lora_to_mlp": lora["mlp"],
                "apply_lora_to_output": lora["output"],
                "lora_rank": lora["rank"],
                "lora_alpha": lora["alpha"],
                "use_dora": lora["dora"],
                "input_ids": golden["input_ids"],
                "tensors": sorted(state),
            },
            open(os.path.join(out, "golden.json"), "w"),
            indent=1,
        )
        save_file({"logits": logits.contiguous()}, os.path.join(out, "golden.safetensors"))
        if base != "phi3":
            # What the checkpointer writes for PEFT (the recipe's adapter config, converted).
            peft_config = convert_weights.tune_to_peft_adapter_config(
                {
                    "r": lora["rank"],
                    "lora_alpha": lora["alpha"],
                    "target_modules": get_lora_module_names(
                        lora["modules"], lora["mlp"], lora["output"]
                    ),
                    "peft_type": "LORA",
                }
            )
            json.dump(peft_config, open(os.path.join(out, "adapter_config.json"), "w"))
            peft = convert_weights.tune_to_peft_adapter_weights(
                state, num_heads=cfg["num_attention_heads"],
                num_kv_heads=cfg["num_key_value_heads"], dim=cfg["hidden_size"],
                head_dim=cfg.get("head_dim"),
            )
            save_file({k: v.contiguous() for k, v in peft.items()},
                      os.path.join(out, "adapter_model.safetensors"), metadata={"format": "pt"})
        print(case, len(state), "tensors, logits", tuple(logits.shape))


if __name__ == "__main__":
    main()
