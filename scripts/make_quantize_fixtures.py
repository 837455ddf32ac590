"""Fixtures for the `quantize` recipe: what torchtune's quantize recipe saves for tiny models, made by torchao.

Usage: python3 scripts/make_quantize_fixtures.py [--torchtune-src /tmp/tt/src]
(PyTorch 2.x, torchao 0.18; torchtune 0.6.1's source for its weight converters)

For each case, the HF checkpoint of tests/fixtures/models/<model> is converted to torchtune's names by
torchtune's own converter (the one its FullModelHFCheckpointer applies for the model type), loaded in `dtype`
into a module tree with those names (the nn.Linear layers where torchtune's models have them), and run
through torchao's Int8DynActInt4WeightQATQuantizer(groupsize).prepare + convert, as torchtune's quantize
recipe does for `8da4w-qat`. The resulting state dict is what `torch.save` writes:
    tests/fixtures/quantize/<case>/model/model-8da4w.pt   (+ the model's config.json beside it)
with each quantized linear as Int8DynActInt4WeightLinear buffers (`weight` int8 codes, `scales` and `zeros`
float32), and linears whose input size is not a multiple of the group size left as they were.

For the Llama and Qwen cases, golden.safetensors holds the logits of the quantized model on the model fixture's golden
input_ids: transformers' model with each quantized nn.Linear replaced by torchao's Int8DynActInt4WeightLinear
holding those buffers (rows back in HF's order), i.e. int8 per-token dynamic activations times the dequantized
int4 weights, as torchtune's generate and eleuther_eval run the file; in the case's dtype (bf16 cases: the model
and the modules' precision bf16, the scales float32 as loaded from the file).
"""

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file
from torchao.quantization.qat import Int8DynActInt4WeightQATQuantizer

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "tests" / "fixtures" / "models"
OUT = REPO / "tests" / "fixtures" / "quantize"

CASES = {
    # case: (model fixture, torchtune converter, dtype, groupsize)
    "llama3_2_gs32": ("llama3_2", "llama", torch.float32, 32),
    "llama3_2_bf16_gs64": ("llama3_2", "llama", torch.bfloat16, 64),
    "qwen2_5_gs32": ("qwen2_5", "qwen2", torch.float32, 32),
    "qwen2_5_bf16_gs16": ("qwen2_5", "qwen2", torch.bfloat16, 16),
    "phi3_gs16": ("phi3", "phi3", torch.bfloat16, 16),
}


def load_module(src: Path, rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, src / rel)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def converters(src: Path):
    # qwen2's and phi3's converters import get_mapped_key from torchtune.models.convert_weights.
    import types
    cw = load_module(src, "torchtune/models/convert_weights.py", "torchtune.models.convert_weights")
    for pkg in ["torchtune", "torchtune.models"]:
        sys.modules.setdefault(pkg, types.ModuleType(pkg))
    sys.modules["torchtune.models"].convert_weights = cw
    qwen2 = load_module(src, "torchtune/models/qwen2/_convert_weights.py", "tt_qwen2_convert")
    phi3 = load_module(src, "torchtune/models/phi3/_convert_weights.py", "tt_phi3_convert")
    return cw, qwen2, phi3


class Tree(torch.nn.Module):
    """A module tree holding `state` under its dotted names: `*.weight` of a linear layer of torchtune's
    decoder (attention projections, MLP w1/w2/w3, output) as an nn.Linear, everything else as a parameter."""

    def __init__(self, state):
        super().__init__()
        linear = ("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")
        is_linear = lambda name: name.endswith(linear) or name == "output.weight"

        def owner(parts):
            mod = self
            for p in parts:
                if not hasattr(mod, p):
                    mod.add_module(p, torch.nn.Module())
                mod = getattr(mod, p)
            return mod

        for name, t in state.items():  # linear layers first, their biases next, the rest last
            if is_linear(name):
                parts = name.split(".")
                lin = torch.nn.Linear(t.shape[1], t.shape[0], bias=False, dtype=t.dtype)
                lin.weight = torch.nn.Parameter(t.clone(), requires_grad=False)
                owner(parts[:-2]).add_module(parts[-2], lin)
        for name, t in state.items():
            parts = name.split(".")
            if is_linear(name):
                continue
            if name.endswith(".bias") and is_linear(name[: -len("bias")] + "weight"):
                getattr(owner(parts[:-2]), parts[-2]).bias = torch.nn.Parameter(t.clone(), requires_grad=False)
            else:
                owner(parts[:-1]).register_parameter(parts[-1], torch.nn.Parameter(t.clone(), requires_grad=False))


HF_MODULES = {"attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj",
              "attn.v_proj": "self_attn.v_proj", "attn.output_proj": "self_attn.o_proj",
              "mlp.w1": "mlp.gate_proj", "mlp.w2": "mlp.down_proj", "mlp.w3": "mlp.up_proj"}


@torch.no_grad()
def quantized_logits(model_dir: Path, kind: str, sd: dict, input_ids: torch.Tensor, dtype=torch.float32):
    """Logits of transformers' model with torchao's Int8DynActInt4WeightLinear in place of each quantized
    linear of the torchtune state dict `sd`."""
    from transformers import AutoModelForCausalLM
    from torchao.quantization.linear_quant_modules import Int8DynActInt4WeightLinear

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads

    def hf_rows(t, n):  # torchtune's interleaved rotary rows back to HF's halves (tune_to_hf's permute)
        x = t.shape[1]
        return t.view(n, head_dim // 2, 2, x).transpose(1, 2).reshape(n * head_dim, x).contiguous()

    modules = dict(model.named_modules())
    bases = sorted(k[: -len(".scales")] for k in sd if k.endswith(".scales"))
    assert kind in ("llama", "qwen2"), kind
    for base in bases:
        codes, scales, zeros = sd[f"{base}.weight"], sd[f"{base}.scales"], sd[f"{base}.zeros"]
        if base == "output":
            hf = "lm_head"
        else:
            layer, tail = base.removeprefix("layers.").split(".", 1)
            hf = f"model.layers.{layer}.{HF_MODULES[tail]}"
            if kind == "llama" and tail in ("attn.q_proj", "attn.k_proj"):
                n = heads if tail == "attn.q_proj" else kv
                codes, scales, zeros = hf_rows(codes, n), hf_rows(scales, n), hf_rows(zeros, n)
        old = modules[hf]
        gs = codes.shape[1] // scales.shape[1]
        lin = Int8DynActInt4WeightLinear(old.in_features, old.out_features, bias=old.bias is not None,
                                         groupsize=gs, precision=dtype, scales_precision=torch.float32)
        lin.weight, lin.scales, lin.zeros = codes, scales, zeros
        if old.bias is not None:
            lin.bias = old.bias.detach().clone()
        parent, _, child = hf.rpartition(".")
        setattr(modules[parent] if parent else model, child, lin)
    return model(input_ids=input_ids).logits.float().contiguous()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--torchtune-src", default="/tmp/tt/src")
    args = ap.parse_args()
    cw, qwen2, phi3 = converters(Path(args.torchtune_src))
    OUT.mkdir(parents=True, exist_ok=True)
    summary = {}
    for case, (model, kind, dtype, gs) in CASES.items():
        cfg = json.loads((MODELS / model / "model" / "config.json").read_text())
        hf = {k: v.to(dtype) for k, v in load_file(str(MODELS / model / "model" / "model.safetensors")).items()}
        heads, kv, dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
        if kind == "llama":
            tune = cw.hf_to_tune(hf, num_heads=heads, num_kv_heads=kv, dim=dim, head_dim=cfg.get("head_dim"))
        elif kind == "qwen2":
            tune = qwen2.qwen2_hf_to_tune(hf, num_heads=heads, num_kv_heads=kv, dim=dim,
                                          tie_word_embeddings=cfg["tie_word_embeddings"])
        else:
            gqa = heads != kv
            tune = phi3.phi3_hf_to_tune(hf, num_heads=heads if gqa else None, num_kv_heads=kv if gqa else None,
                                        dim=dim if gqa else None)
        tree = Tree(tune)
        assert set(tree.state_dict()) == set(tune), sorted(set(tree.state_dict()) ^ set(tune))
        q = Int8DynActInt4WeightQATQuantizer(groupsize=gs)
        tree = q.convert(q.prepare(tree))
        sd = {k: v.contiguous() for k, v in tree.state_dict().items()}
        case_dir = OUT / case
        (case_dir / "model").mkdir(parents=True, exist_ok=True)
        torch.save(sd, case_dir / "model" / "model-8da4w.pt")
        (case_dir / "model" / "config.json").write_text((MODELS / model / "model" / "config.json").read_text())
        if kind in ("llama", "qwen2"):
            golden = json.loads((MODELS / model / "golden.json").read_text())
            ids = torch.tensor(golden["input_ids"])
            logits = quantized_logits(MODELS / model / "model", kind, sd, ids, dtype)
            from safetensors.torch import save_file
            save_file({"logits": logits}, str(case_dir / "golden.safetensors"))
            (case_dir / "golden.json").write_text(json.dumps({"input_ids": golden["input_ids"]}) + "\n")
        n_q = sum(1 for k in sd if k.endswith(".scales"))
        summary[case] = {"model": model, "dtype": str(dtype).removeprefix("torch."), "groupsize": gs,
                         "quantized_linears": n_q, "tensors": len(sd)}
        print(case, summary[case])
    (OUT / "cases.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
