"""Checks that the `adapter_model.pt` a ferrotune LoRA/DoRA run saves under a torchtune
checkpointer is what torchtune 0.6.1 loads: its LoRA model for the same settings takes the file
with `load_state_dict(strict=True)` (base converted by torchtune's own converter) and computes the
logits transformers + PEFT compute with the PEFT adapter saved beside it.

    python3 scripts/check_torchtune_adapter.py [path/to/ferrotune]

Needs torch, transformers, peft, safetensors and torchtune 0.6.1's source (`TORCHTUNE_SRC`,
default /tmp/tt/src). Runs ferrotune on the tiny Llama 2 (LoRA and DoRA on q/k/v/o and the MLP)
and Phi-3 (fused qkv_proj / gate_up_proj) fixtures for two AdamW steps.
"""

import json
import os
import subprocess
import sys
import tempfile

import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torchtune_source import use_torchtune_source  # noqa: E402

use_torchtune_source()

import peft.tuners.lora.torchao as peft_torchao  # noqa: E402
from torchtune.models import convert_weights  # noqa: E402

# torchtune wants an older torchao than PEFT accepts; PEFT's torchao dispatch is not needed here.
peft_torchao.is_torchao_available = lambda: False
from torchtune.models.llama2 import lora_llama2  # noqa: E402
from torchtune.models.phi3 import lora_phi3  # noqa: E402
from torchtune.models.phi3._convert_weights import phi3_hf_to_tune  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
FERROTUNE = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "target/release/ferrotune")

CONFIG = """
output_dir: {out}
model:
  lora_attn_modules: [q_proj, k_proj, v_proj, output_proj]
  apply_lora_to_mlp: true
  lora_rank: 4
  lora_alpha: 8
  use_dora: {dora}
tokenizer:
  path: {model}
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {model}
  output_dir: ${{output_dir}}
dataset:
  _component_: torchtune.datasets.tokenized_dataset
  source: json
  data_files: {data}
seed: 3
shuffle: false
batch_size: 2
epochs: 1
max_steps_per_epoch: 2
optimizer:
  _component_: torch.optim.AdamW
  lr: 3e-2
lr_scheduler: null
loss:
  _component_: torch.nn.CrossEntropyLoss
device: cpu
dtype: fp32
"""


def run(base, dora, tmp):
    model_dir = os.path.join(REPO, "tests/fixtures/models", base, "model")
    golden = json.load(open(os.path.join(REPO, "tests/fixtures/models", base, "golden.json")))
    data = os.path.join(tmp, "rows.jsonl")
    with open(data, "w") as f:
        for ids, labels in zip(golden["input_ids"] * 2, golden["labels"] * 2):
            f.write(json.dumps({"input_ids": ids, "labels": labels}) + "\n")
    out = os.path.join(tmp, f"{base}-{dora}")
    cfg = os.path.join(tmp, f"{base}-{dora}.yaml")
    open(cfg, "w").write(CONFIG.format(out=out, model=model_dir, data=data,
                                       dora=str(dora).lower()))
    subprocess.run([FERROTUNE, "run", "lora_finetune_single_device", "--config", cfg],
                   check=True, capture_output=True)
    saved = os.path.join(out, "epoch_0")
    ids = torch.tensor(golden["input_ids"])

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = hf(ids).logits
        # PeftModel wraps `hf` in place: the base logits are taken first.
        peft_logits = PeftModel.from_pretrained(hf, saved).eval()(ids).logits

    cfg_json = json.load(open(os.path.join(model_dir, "config.json")))
    heads, kv, dim = (cfg_json["num_attention_heads"], cfg_json["num_key_value_heads"],
                      cfg_json["hidden_size"])
    kwargs = dict(
        lora_attn_modules=["q_proj", "k_proj", "v_proj", "output_proj"], apply_lora_to_mlp=True,
        lora_rank=4, lora_alpha=8.0, use_dora=dora, vocab_size=cfg_json["vocab_size"],
        num_layers=cfg_json["num_hidden_layers"], num_heads=heads, num_kv_heads=kv,
        embed_dim=dim, intermediate_dim=cfg_json["intermediate_size"], max_seq_len=64,
        norm_eps=cfg_json["rms_norm_eps"],
    )
    sd = load_file(os.path.join(model_dir, "model.safetensors"))
    if base == "phi3":
        model = lora_phi3(**kwargs)
        sd = phi3_hf_to_tune(sd, num_heads=heads, num_kv_heads=kv, dim=dim)
    else:
        model = lora_llama2(**kwargs)
        sd = convert_weights.hf_to_tune(sd, num_heads=heads, num_kv_heads=kv, dim=dim)
    sd.update(torch.load(os.path.join(saved, "adapter_model.pt"), weights_only=True))
    model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        tt_logits = model.eval()(ids)
        err = (tt_logits - peft_logits).abs().max().item()
        moved = (tt_logits - base_logits).abs().max().item()
    print(f"{base:7} dora={dora!s:5}  torchtune vs PEFT max |Δlogit| {err:.2e}   "
          f"(the adapter moves them by {moved:.5f})")
    return err < 1e-4 and moved > 1e-2


def main():
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for base in ["llama2", "phi3"]:
            for dora in [False, True]:
                ok &= run(base, dora, tmp)
    print("OK" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
