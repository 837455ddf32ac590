#!/usr/bin/env python3
"""Writes the fuzzer's checked-in seeds (corpus/<target>/) and the fixed files its targets read
beside an input (fixtures/), from the repository's test fixtures and the fetched real tokenizers.

Run from anywhere: python3 crates/ferrotune-fuzz/gen_seeds.py   (needs numpy, the `ferrotune`
release binary for export-gguf, and scripts/fetch-assets.sh's cache for the real chat templates).
The outputs are checked in; rerun only to change them. Seeds are kept small (the whole corpus is
well under 1 MB): a mutation fuzzer spends its time on headers and structure, not on weights.
"""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.normpath(os.path.join(HERE, "..", ".."))
FIX = os.path.join(ROOT, "tests", "fixtures")
CORPUS = os.path.join(HERE, "corpus")
FIXTURES = os.path.join(HERE, "fixtures")
ASSETS = os.environ.get("FERROTUNE_ASSETS") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ferrotune", "assets")


def out(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    with open(os.path.join(d, name), mode) as f:
        f.write(data)


def safetensors_bytes(tensors, metadata=None):
    """A safetensors file of (name, numpy array) pairs, written by hand (the format is 8 bytes of
    header length, the JSON header, then the data)."""
    header, data = {}, b""
    dtypes = {np.float32: "F32", np.float16: "F16", np.int32: "I32", np.int64: "I64", np.int8: "I8"}
    for name, a in tensors:
        raw = a.tobytes()
        header[name] = {"dtype": dtypes[a.dtype.type], "shape": list(a.shape),
                        "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def tiny_llama():
    """A one-layer Llama small enough to load in a millisecond: hidden 32, 4 heads of 8, 2 KV heads,
    MLP 64, the tiny tokenizer's 512 tokens, tied embeddings."""
    rng = np.random.default_rng(0)
    cfg = json.load(open(os.path.join(FIX, "models", "smollm2_like", "model", "config.json")))
    cfg.update(num_hidden_layers=1, intermediate_size=64)
    h, ffn, v, kv = 32, 64, cfg["vocab_size"], cfg["num_key_value_heads"] * cfg["head_dim"]

    def w(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    p = "model.layers.0."
    shard1 = [("model.embed_tokens.weight", w(v, h)), ("model.norm.weight", np.ones(h, np.float32))]
    shard2 = [(p + "self_attn.q_proj.weight", w(h, h)), (p + "self_attn.k_proj.weight", w(kv, h)),
              (p + "self_attn.v_proj.weight", w(kv, h)), (p + "self_attn.o_proj.weight", w(h, h)),
              (p + "mlp.gate_proj.weight", w(ffn, h)), (p + "mlp.up_proj.weight", w(ffn, h)),
              (p + "mlp.down_proj.weight", w(h, ffn)),
              (p + "input_layernorm.weight", np.ones(h, np.float32)),
              (p + "post_attention_layernorm.weight", np.ones(h, np.float32))]
    return cfg, shard1, shard2


def main():
    shutil.rmtree(CORPUS, ignore_errors=True)
    shutil.rmtree(FIXTURES, ignore_errors=True)
    cfg, shard1, shard2 = tiny_llama()
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]

    # The folder an index input is read in: config.json and the two shards it may list.
    model = os.path.join(FIXTURES, "tiny_llama")
    os.makedirs(model)
    json.dump(cfg, open(os.path.join(model, "config.json"), "w"), indent=2)
    for name, shard in zip(names, (shard1, shard2)):
        open(os.path.join(model, name), "wb").write(safetensors_bytes(shard))

    # safetensors_index: the index the shards come with, and variants.
    weight_map = {n: names[0] for n, _ in shard1} | {n: names[1] for n, _ in shard2}
    out("safetensors_index", "index.json", json.dumps(
        {"metadata": {"total_size": 0}, "weight_map": weight_map}, indent=2))
    out("safetensors_index", "one_shard.json", json.dumps({"weight_map": {"x": names[0]}}))

    # safetensors: small files of each dtype, with and without metadata.
    out("safetensors", "shard.safetensors", safetensors_bytes(shard2[:3], {"format": "pt"}))
    out("safetensors", "dtypes.safetensors", safetensors_bytes([
        ("a", np.arange(6, dtype=np.float16).reshape(2, 3)), ("b", np.arange(4, dtype=np.int32)),
        ("c", np.arange(3, dtype=np.int64)), ("d", np.arange(5, dtype=np.int8)),
        ("e", np.zeros((0, 4), np.float32))]))

    # gguf: the tiny model written by ferrotune's own exporter (f32 and q8_0 blocks), with the
    # tiny tokenizer's vocabulary and chat template in its metadata; and a tokenizer-only file.
    with tempfile.TemporaryDirectory() as tmp:
        hf = os.path.join(tmp, "hf")
        os.makedirs(hf)
        json.dump(cfg, open(os.path.join(hf, "config.json"), "w"))
        open(os.path.join(hf, "model.safetensors"), "wb").write(safetensors_bytes(shard1 + shard2))
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(os.path.join(FIX, "tiny_tokenizer", f), hf)
        exe = os.path.join(ROOT, "target", "release", "ferrotune")
        for outtype in ("f32", "q8_0"):
            dst = os.path.join(tmp, outtype + ".gguf")
            subprocess.run([exe, "export-gguf", "--outtype", outtype, hf, dst], check=True,
                           stdout=subprocess.DEVNULL)
            out("gguf", f"tiny_llama_{outtype}.gguf", open(dst, "rb").read())
    shutil.copy(os.path.join(FIX, "gguf_tokenizers", "bpe_qwen2.gguf"),
                os.path.join(CORPUS, "gguf", "bpe_qwen2_tokenizer.gguf"))

    # torch_pickle: a torch.save file (zip), and its pickle alone (the target wraps a non-zip
    # input into the same zip, so that mutations reach the unpickler past the zip's CRCs).
    state = os.path.join(FIX, "torch_save", "state.pt")
    out("torch_pickle", "state.pt", open(state, "rb").read())
    with zipfile.ZipFile(state) as z:
        out("torch_pickle", "state_data.pkl", z.read("state/data.pkl"))
        os.makedirs(os.path.join(FIXTURES, "torch_storages"))
        for info in z.infolist():
            if info.filename.startswith("state/data/"):
                dst = os.path.join(FIXTURES, "torch_storages", info.filename.rsplit("/", 1)[1])
                open(dst, "wb").write(z.read(info))

    # config: real recipe configs (interpolation, components), and one with overrides (`#! ` lines).
    for src in ("configs/smollm2/135M_lora_single_device.yaml", "configs/llama3_2/1B_qat_lora.yaml",
                "configs/generation.yaml"):
        out("config", src.replace("configs/", "").replace("/", "_"), open(os.path.join(ROOT, src)).read())
    out("config", "interpolation.yaml", """name: run
base: /tmp/${name}
output_dir: ${base}/out
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: ${base}/tokenizer.model
  max_seq_len: 512
batch_size: 2
epochs: 1
optimizer:
  _component_: torch.optim.AdamW
  lr: 3e-4
seed: ${oc.env:FERROTUNE_SEED,42}
list: [${batch_size}, "${tokenizer.max_seq_len}"]
#! batch_size=4
#! optimizer.lr=1e-3
#! ~epochs
#! tokenizer=torchtune.models.qwen2.qwen2_tokenizer
""")

    # tokenized_jsonl: rows, and preference pairs.
    out("tokenized_jsonl", "rows.jsonl", open(os.path.join(FIX, "datasets", "tokenized.jsonl")).read())
    out("tokenized_jsonl", "pairs.jsonl", "\n".join(json.dumps(r) for r in [
        {"chosen_input_ids": [1, 2, 3], "chosen_labels": [-100, 2, 3],
         "rejected_input_ids": [1, 4], "rejected_labels": [-100, 4]},
        {"chosen_input_ids": [5], "rejected_input_ids": [6, 7]}]) + "\n")

    # chat_template: the real templates of the fetched tokenizers, and the fixtures'.
    for name in ("llama3_1", "qwen3", "gemma3"):
        cfg_path = os.path.join(ASSETS, "tokenizers", name, "tokenizer_config.json")
        tpl = json.load(open(cfg_path)).get("chat_template")
        if isinstance(tpl, list):
            tpl = tpl[0]["template"]
        out("chat_template", name + ".jinja", tpl)
    shutil.copy(os.path.join(FIX, "tiny_tokenizer", "chat_template.jinja"),
                os.path.join(CORPUS, "chat_template", "chatml.jinja"))
    total = sum(os.path.getsize(os.path.join(d, f)) for base in (CORPUS, FIXTURES)
                for d, _, fs in os.walk(base) for f in fs)
    print(f"corpus and fixtures: {total} bytes", file=sys.stderr)


if __name__ == "__main__":
    main()
