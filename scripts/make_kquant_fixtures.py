#!/usr/bin/env python3
"""References for ferrotune's k-quant GGUF export, from llama.cpp itself (the libggml and libllama
that llama-cpp-python ships):

1. tests/fixtures/gguf_export/kquants.json "blocks": rows of test values (normal, all-positive,
   outliers, an all-zero and a constant superblock, tiny and large magnitudes) and ggml's
   `ggml_quantize_chunk` bytes of them as Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (no importance matrix:
   the reference quantizers `llama-quantize` runs).
2. "mixes": small models whose weights come from a fixed integer hash (so the Rust test rebuilds
   them exactly): a Llama with untied head and rows that are not whole superblocks
   (intermediate 320), a Llama with tied embeddings, a Phi-3 (fused qkv), and the mixtures of
   experts Mixtral (8 experts), Qwen2-MoE (shared expert) and Qwen3-MoE, a Gemma 3 and a SmolLM3
   (its fourth layer without RoPE). Each is exported by
   ferrotune as f32 GGUF, then quantized by `llama_model_quantize` to Q4_K_M, Q5_K_M and Q6_K; the
   type and sha256 of every tensor of llama.cpp's file are recorded.
3. "smollm2_types": the types llama.cpp's Q4_K_M, Q5_K_M, Q4_K_S and Q4_0 give each tensor of
   SmolLM2-135M-Instruct (30 layers: the per-layer rules at depth), and "llama80_types" those of
   Q4_K_M and Q4_K_S for an 80-layer Llama (llama.cpp's 70B rule).

  python scripts/make_kquant_fixtures.py target/release/ferrotune
  python scripts/make_kquant_fixtures.py target/release/ferrotune --new-architectures

The second adds (replacing their earlier entries) the "mixes" of the architectures of 2026 —
Qwen3.5 (`qwen35`), Qwen3.5-MoE (`qwen35moe`), Qwen3-Next (`qwen3next`), gpt-oss (`gpt-oss`,
float experts), DeepSeek-V3 (8 experts) and -V2 (`deepseek2`) — in Q4_K_M, Q5_K_M, Q6_K, Q4_K_S
and Q4_0, their tensors as transformers' `save_pretrained` names and shapes them, quantized by
llama-cpp-python 0.3.36 built from source (`"$(scripts/fetch-llamacpp.sh)/bin/python"`), and
"gpt_oss_mxfp4": the Q4_K_M and Q6_K files it makes, allowed to requantize, from ferrotune's
f32 export of a gpt-oss with OpenAI's MXFP4 experts; it leaves the rest of the fixture as
recorded.

Needs numpy, gguf, safetensors, llama-cpp-python."""

import ctypes
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "gguf_export" / "kquants.json"
TOKENIZER = ROOT / "tests" / "fixtures" / "llama3" / "model"

GGML_TYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q4_k": 12, "q5_k": 13, "q6_k": 14}
FTYPES = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "q4_k_s": 14, "q5_k_s": 16, "q4_0": 2,
          "q4_1": 3, "q5_0": 8, "q5_1": 9}
MASK64 = (1 << 64) - 1


def ggml_lib():
    import llama_cpp

    lib_dir = Path(llama_cpp.__file__).parent / "lib"
    lib = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
        ctypes.c_int64, ctypes.c_void_p,
    ]
    lib.ggml_row_size.restype = ctypes.c_size_t
    lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    return lib


def block_rows():
    rng = np.random.default_rng(7)
    n = 512
    rows = [
        rng.standard_normal(n) * 0.05,
        np.abs(rng.standard_normal(n)) * 0.3 + 0.01,  # all positive: the minimum is clamped to 0
        np.where(rng.random(n) < 0.02, 4.0, 1.0) * rng.standard_normal(n) * 0.02,  # outliers
        np.concatenate([np.zeros(256), rng.standard_normal(256) * 0.1]),  # a zero superblock
        np.concatenate([np.full(256, 0.75), -np.abs(rng.standard_normal(256))]),  # constant
        rng.standard_normal(n) * 1e-20,  # below the k-quants' scale epsilon
        rng.standard_normal(n) * 1e4,  # large
        np.round(rng.standard_normal(n) * 8) / 8,  # exact ties for the rounding
    ]
    return [r.astype(np.float32) for r in rows]


def quantize_blocks(lib):
    rows = block_rows()
    out = {"values": [[float(v) for v in r] for r in rows]}
    for name, ty in GGML_TYPES.items():
        hexes = []
        for r in rows:
            src = np.ascontiguousarray(r)
            size = lib.ggml_row_size(ty, len(r))
            dst = ctypes.create_string_buffer(size)
            written = lib.ggml_quantize_chunk(ty, src.ctypes.data, dst, 0, 1, len(r), None)
            assert written == size
            hexes.append(dst.raw.hex())
        out[name] = hexes
    return out


def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def fnv1a(s):
    h = 0xCBF29CE484222325
    for b in s.encode():
        h = ((h ^ b) * 0x100000001B3) & MASK64
    return h


def tensor_values(name, shape):
    """The hash-defined weights (the Rust test computes the same): uniform in ±0.1 times a
    per-row factor 1..5; norms 1 + that."""
    numel = int(np.prod(shape))
    seed = fnv1a(name)
    idx = np.arange(numel, dtype=np.uint64)
    # splitmix64 vectorized in uint64 arithmetic (wrapping).
    x = (np.uint64(seed) ^ (idx * np.uint64(0x9E3779B97F4A7C15))) + np.uint64(0x9E3779B97F4A7C15)
    z = x
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(40)).astype(np.float32) / np.float32(16777216.0) - np.float32(0.5)
    v = u * np.float32(0.2)
    cols = shape[-1]
    factor = (1 + (np.arange(numel) // cols) % 5).astype(np.float32)
    v = v * factor
    if name.endswith("norm.weight"):
        v = v + np.float32(1.0)
    return v.reshape(shape).astype(np.float32)


def llama_tensors(cfg):
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out = [("model.embed_tokens.weight", [cfg["vocab_size"], h]), ("model.norm.weight", [h])]
    if not cfg["tie_word_embeddings"]:
        out.append(("lm_head.weight", [cfg["vocab_size"], h]))
    mt = cfg["model_type"]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", [h]), (f"{p}.post_attention_layernorm.weight", [h])]
        if mt in ("mixtral", "qwen2_moe", "qwen3_moe"):
            out += [(f"{p}.self_attn.q_proj.weight", [q, h]), (f"{p}.self_attn.k_proj.weight", [kv, h]),
                    (f"{p}.self_attn.v_proj.weight", [kv, h]), (f"{p}.self_attn.o_proj.weight", [h, q])]
            if mt == "qwen2_moe":
                out += [(f"{p}.self_attn.q_proj.bias", [q]), (f"{p}.self_attn.k_proj.bias", [kv]),
                        (f"{p}.self_attn.v_proj.bias", [kv])]
            if mt == "qwen3_moe":
                out += [(f"{p}.self_attn.q_norm.weight", [hd]), (f"{p}.self_attn.k_norm.weight", [hd])]
            experts = cfg.get("num_local_experts") or cfg["num_experts"]
            if mt == "mixtral":
                ff, block, names = inter, "block_sparse_moe", ("w1", "w3", "w2")
            else:
                ff, block, names = cfg["moe_intermediate_size"], "mlp", ("gate_proj", "up_proj", "down_proj")
            out.append((f"{p}.{block}.gate.weight", [experts, h]))
            for e in range(experts):
                out += [(f"{p}.{block}.experts.{e}.{names[0]}.weight", [ff, h]),
                        (f"{p}.{block}.experts.{e}.{names[1]}.weight", [ff, h]),
                        (f"{p}.{block}.experts.{e}.{names[2]}.weight", [h, ff])]
            if mt == "qwen2_moe":
                sff = cfg["shared_expert_intermediate_size"]
                out += [(f"{p}.mlp.shared_expert.gate_proj.weight", [sff, h]),
                        (f"{p}.mlp.shared_expert.up_proj.weight", [sff, h]),
                        (f"{p}.mlp.shared_expert.down_proj.weight", [h, sff]),
                        (f"{p}.mlp.shared_expert_gate.weight", [1, h])]
            continue
        if mt == "gemma3_text":
            out += [(f"{p}.pre_feedforward_layernorm.weight", [h]),
                    (f"{p}.post_feedforward_layernorm.weight", [h]),
                    (f"{p}.self_attn.q_norm.weight", [hd]), (f"{p}.self_attn.k_norm.weight", [hd])]
        if cfg["model_type"] == "phi3":
            out += [(f"{p}.self_attn.qkv_proj.weight", [q + 2 * kv, h]),
                    (f"{p}.mlp.gate_up_proj.weight", [2 * inter, h])]
        else:
            out += [(f"{p}.self_attn.q_proj.weight", [q, h]), (f"{p}.self_attn.k_proj.weight", [kv, h]),
                    (f"{p}.self_attn.v_proj.weight", [kv, h]), (f"{p}.mlp.gate_proj.weight", [inter, h]),
                    (f"{p}.mlp.up_proj.weight", [inter, h])]
        out += [(f"{p}.self_attn.o_proj.weight", [h, q]), (f"{p}.mlp.down_proj.weight", [h, inter])]
    return out


def model_configs():
    llama = json.loads((TOKENIZER / "config.json").read_text())
    llama.update(hidden_size=256, intermediate_size=320, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64, num_hidden_layers=4,
                 tie_word_embeddings=False)
    tied = dict(llama, intermediate_size=512, num_hidden_layers=2, tie_word_embeddings=True)
    phi3 = json.loads((ROOT / "tests/fixtures/models/phi3/model/config.json").read_text())
    phi3.update(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                num_key_value_heads=4, num_hidden_layers=3, head_dim=64)
    models = ROOT / "tests/fixtures/models"
    dims = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                num_hidden_layers=2)
    mixtral = json.loads((models / "mixtral/model/config.json").read_text())
    mixtral.update(dims, intermediate_size=256, num_local_experts=8)
    qwen2_moe = json.loads((models / "qwen2_moe/model/config.json").read_text())
    qwen2_moe.update(dims, intermediate_size=512, moe_intermediate_size=256,
                     shared_expert_intermediate_size=512)
    qwen3_moe = json.loads((models / "qwen3_moe/model/config.json").read_text())
    qwen3_moe.update(dims, intermediate_size=512, moe_intermediate_size=256, mlp_only_layers=[])
    gemma3 = json.loads((models / "gemma3/model/config.json").read_text())
    gemma3.update(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=1, head_dim=64, num_hidden_layers=6, query_pre_attn_scalar=64,
                  sliding_window=4, layer_types=["sliding_attention"] * 5 + ["full_attention"])
    gemma3.pop("_sliding_window_pattern", None)
    smollm3 = json.loads((models / "smollm3/model/config.json").read_text())
    smollm3.update(dims, intermediate_size=512, num_hidden_layers=4, no_rope_layers=[1, 1, 1, 0])
    return {"llama_untied": llama, "llama_tied": tied, "phi3": phi3, "mixtral": mixtral,
            "qwen2_moe": qwen2_moe, "qwen3_moe": qwen3_moe, "gemma3": gemma3, "smollm3": smollm3}


def new_model_configs():
    """The architectures of 2026 (llama.cpp's qwen35, qwen35moe, qwen3next, gpt-oss, deepseek2),
    their fixtures' configs widened so that most rows are whole superblocks (hidden 256) and some
    are not (intermediate 320; MLA's 64-wide key halves)."""
    models = ROOT / "tests/fixtures/models"

    def fixture(name, **update):
        cfg = json.loads((models / name / "model/config.json").read_text())
        cfg.update(update)
        return cfg

    dims = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
    delta = dict(dims, intermediate_size=320, linear_key_head_dim=64, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_value_head_dim=64)
    moe = dict(moe_intermediate_size=256, shared_expert_intermediate_size=320, num_experts=4)
    mla = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=4, head_dim=32,
               intermediate_size=320, moe_intermediate_size=256, kv_lora_rank=256,
               qk_nope_head_dim=64, qk_rope_head_dim=32, qk_head_dim=96, v_head_dim=64,
               rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    # llama.cpp's gpt-oss fixes the clamped SwiGLU's limit at 7.
    gpt_oss = fixture("gpt_oss", **dims, intermediate_size=320, swiglu_limit=7.0)
    gpt_oss["rope_parameters"].pop("truncate")
    return {
        "qwen3_5": fixture("qwen3_5", **delta),
        "qwen3_5_moe": fixture("qwen3_5_moe", **delta, **moe),
        # llama.cpp's qwen3next: every layer sparse, top-k weights renormalized.
        "qwen3_next": fixture("qwen3_next", **delta, **moe, mlp_only_layers=[],
                              norm_topk_prob=True),
        "gpt_oss": gpt_oss,
        # 8 experts: llama.cpp's 8-expert rules (value projections Q8_0, attn_output Q5_K).
        "deepseek_v3": fixture("deepseek_v3", **mla, q_lora_rank=256, n_routed_experts=8),
        # With a q_lora_rank: llama.cpp 0.3.36 reads a deepseek2 file without one only at
        # DeepSeek-V2-Lite's layer counts (26, 27).
        "deepseek_v2": fixture("deepseek_v2", **mla, q_lora_rank=256, n_group=1, topk_group=1,
                               topk_method="greedy"),
    }


def transformers_tensors(cfg):
    """[name, shape] of every tensor transformers' `save_pretrained` writes for `cfg`."""
    import torch
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    work = Path(tempfile.mkdtemp())
    config = AutoConfig.for_model(**cfg)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(work)
    with safe_open(str(work / "model.safetensors"), "np") as f:
        out = [(n, list(f.get_slice(n).get_shape())) for n in f.keys()]
    shutil.rmtree(work)
    return sorted(out)


def write_model(folder, cfg, tensor_list=None):
    folder.mkdir(parents=True)
    tensors = {n: tensor_values(n, s) for n, s in (tensor_list or llama_tensors(cfg))}
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(TOKENIZER / f, folder / f)


def gguf_tensors(path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {
        t.name: {"type": int(t.tensor_type), "sha256": hashlib.sha256(t.data.tobytes()).hexdigest()}
        for t in reader.tensors
    }


def quantize_models(binary, configs, tensors_of=llama_tensors, ftypes=FTYPES):
    import llama_cpp

    llama_cpp.llama_backend_init()
    work = Path(tempfile.mkdtemp())
    mixes = {}
    for name, cfg in configs.items():
        folder = work / name
        tensor_list = tensors_of(cfg)
        write_model(folder, cfg, tensor_list)
        f32 = work / f"{name}.f32.gguf"
        subprocess.run([str(binary), "export-gguf", str(folder), str(f32), "--outtype", "f32"],
                       check=True)
        per_type = {}
        for mix, ftype in ftypes.items():
            out = work / f"{name}.{mix}.gguf"
            params = llama_cpp.llama_model_quantize_default_params()
            params.ftype = ftype
            params.nthread = 1
            rc = llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(),
                                                ctypes.byref(params))
            assert rc == 0, f"llama_model_quantize {name} {mix}: {rc}"
            per_type[mix] = gguf_tensors(out)
        mixes[name] = {"config": cfg, "tensors": tensor_list, "quantized": per_type}
    shutil.rmtree(work)
    return mixes


def smollm2_types(binary):
    """The tensor types llama.cpp's Q4_K_M and Q5_K_M give SmolLM2-135M-Instruct (30 layers, tied
    embeddings; the weights from the GGUF that scripts/fetch-assets.sh caches, through
    transformers): names, GGUF dimensions and types, for the layer-counting rules at depth."""
    import os

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assets = Path(os.environ.get("FERROTUNE_ASSETS", Path.home() / ".cache/ferrotune/assets"))
    gguf_name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    work = Path(tempfile.mkdtemp())
    model = AutoModelForCausalLM.from_pretrained(assets, gguf_file=gguf_name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), strict=False)
    plain.save_pretrained(work / "hf")
    AutoTokenizer.from_pretrained(assets, gguf_file=gguf_name).save_pretrained(work / "hf")
    f32 = work / "f32.gguf"
    subprocess.run([str(binary), "export-gguf", str(work / "hf"), str(f32), "--outtype", "f32"],
                   check=True)
    out = mix_types(f32, work, ["q4_k_m", "q5_k_m", "q4_k_s", "q4_0"])
    shutil.rmtree(work)
    return out


def llama80_types(binary):
    """The types llama.cpp's Q4_K_M and Q4_K_S give an 80-layer grouped-query Llama (its 70B
    rule widens `attn_v`): names, GGUF dimensions and types."""
    cfg = json.loads((TOKENIZER / "config.json").read_text())
    cfg.update(hidden_size=256, intermediate_size=256, num_attention_heads=4,
               num_key_value_heads=1, head_dim=64, num_hidden_layers=80,
               tie_word_embeddings=False)
    work = Path(tempfile.mkdtemp())
    write_model(work / "hf", cfg)
    f32 = work / "f32.gguf"
    subprocess.run([str(binary), "export-gguf", str(work / "hf"), str(f32), "--outtype", "f32"],
                   check=True)
    out = mix_types(f32, work, ["q4_k_m", "q4_k_s"])
    shutil.rmtree(work)
    return out


def mix_types(f32, work, mixes):
    """llama_model_quantize of `f32` to each mix: every tensor's [name, GGUF dims, type]."""
    import llama_cpp
    from gguf import GGUFReader

    out = {}
    for mix in mixes:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[mix]
        params.nthread = 2
        q = work / f"{mix}.gguf"
        assert llama_cpp.llama_model_quantize(str(f32).encode(), str(q).encode(),
                                              ctypes.byref(params)) == 0
        out[mix] = [[t.name, [int(d) for d in t.shape], int(t.tensor_type)]
                    for t in GGUFReader(str(q)).tensors]
    return out


def mxfp4_experts(binary):
    """gpt-oss with OpenAI's MXFP4 experts (tests/fixtures/gpt_oss_mxfp4, its config given
    llama.cpp's SwiGLU limit and a rounded YaRN range): ferrotune's f32 export keeps the experts
    MXFP4, which `llama_model_quantize` requantizes only when allowed (`--allow-requantize`); the
    type and sha256 of every tensor of its Q4_K_M and Q6_K files."""
    import llama_cpp

    llama_cpp.llama_backend_init()
    work = Path(tempfile.mkdtemp())
    folder = work / "model"
    shutil.copytree(ROOT / "tests/fixtures/gpt_oss_mxfp4/model", folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["swiglu_limit"] = 7.0
    cfg["swiglu_alpha"] = 1.702
    cfg["rope_parameters"]["truncate"] = True
    (folder / "config.json").write_text(json.dumps(cfg))
    f32 = work / "f32.gguf"
    subprocess.run([str(binary), "export-gguf", str(folder), str(f32), "--outtype", "f32"],
                   check=True)
    out = {}
    for mix in ["q4_k_m", "q6_k"]:
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = FTYPES[mix]
        params.nthread = 1
        params.allow_requantize = True
        q = work / f"{mix}.gguf"
        assert llama_cpp.llama_model_quantize(str(f32).encode(), str(q).encode(),
                                              ctypes.byref(params)) == 0
        out[mix] = gguf_tensors(q)
    shutil.rmtree(work)
    return out


def main():
    binary = Path(sys.argv[1]).resolve()
    if sys.argv[2:] == ["--new-architectures"]:
        # Only the 2026 architectures' mixes, from llama-cpp-python 0.3.36 (scripts/
        # fetch-llamacpp.sh), added to the fixture; the rest stays as recorded (mid-2025
        # llama.cpp, whose fused `attn_qkv` rule Phi-3's mixes keep).
        fixture = json.loads(OUT.read_text())
        ftypes = {k: FTYPES[k] for k in ["q4_k_m", "q5_k_m", "q6_k", "q4_k_s", "q4_0"]}
        fixture["mixes"].update(quantize_models(binary, new_model_configs(),
                                                transformers_tensors, ftypes))
        fixture["gpt_oss_mxfp4"] = mxfp4_experts(binary)
    else:
        lib = ggml_lib()
        fixture = {"blocks": quantize_blocks(lib), "mixes": quantize_models(binary, model_configs()),
                   "smollm2_types": smollm2_types(binary), "llama80_types": llama80_types(binary)}
    OUT.write_text(json.dumps(fixture) + "\n")
    for name, m in fixture["mixes"].items():
        for mix, tensors in m["quantized"].items():
            types = sorted({t["type"] for t in tensors.values()})
            print(f"{name:14} {mix:7} ggml types {types}")
    print("wrote", OUT)


if __name__ == "__main__":
    main()
