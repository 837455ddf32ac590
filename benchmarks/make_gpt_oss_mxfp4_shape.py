"""A random gpt-oss checkpoint with MXFP4 experts, as OpenAI ships them, of a size to measure
QLoRA with packed against dequantized experts (benchmarks/gpt_oss_mxfp4.sh).

Python's standard library only. Writes OUT/ (default /tmp/ferrotune-gpt-oss-mxfp4-bench):
config.json (tests/fixtures/gpt_oss_mxfp4's, resized: 4 layers, 32 experts top-4, hidden 1024,
experts 1024 wide, 16 heads of 64, 4 key/value heads), model.safetensors (f32 attention, norms,
router and biases; the experts' `*_blocks` random bytes, `*_scales` 2^-8 .. 2^-5) and the
fixture's tokenizer files (vocabulary 512).

    python3 benchmarks/make_gpt_oss_mxfp4_shape.py [OUT]
"""

import array
import json
import os
import random
import shutil
import struct
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "gpt_oss_mxfp4", "model")
LAYERS, EXPERTS, TOP_K, HIDDEN, INTER, HEADS, KV, HEAD_DIM, VOCAB = 4, 32, 4, 1024, 1024, 16, 4, 64, 512


def floats(n, std, rng):
    return array.array("f", (rng.gauss(0.0, std) for _ in range(n))).tobytes()


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/ferrotune-gpt-oss-mxfp4-bench"
    os.makedirs(out, exist_ok=True)
    rng = random.Random(0)
    tensors = []  # (name, dtype, shape, bytes)

    def f32(name, shape, std):
        n = 1
        for d in shape:
            n *= d
        tensors.append((name, "F32", shape, floats(n, std, rng) if std else bytes(4 * n)))

    def ones(name, n):
        tensors.append((name, "F32", [n], array.array("f", [1.0] * n).tobytes()))

    f32("model.embed_tokens.weight", [VOCAB, HIDDEN], 0.02)
    f32("lm_head.weight", [VOCAB, HIDDEN], 0.02)
    ones("model.norm.weight", HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        ones(f"{p}.input_layernorm.weight", HIDDEN)
        ones(f"{p}.post_attention_layernorm.weight", HIDDEN)
        for proj, rows in [("q", HEADS * HEAD_DIM), ("k", KV * HEAD_DIM), ("v", KV * HEAD_DIM)]:
            f32(f"{p}.self_attn.{proj}_proj.weight", [rows, HIDDEN], 0.02)
            f32(f"{p}.self_attn.{proj}_proj.bias", [rows], 0.0)
        f32(f"{p}.self_attn.o_proj.weight", [HIDDEN, HEADS * HEAD_DIM], 0.02)
        f32(f"{p}.self_attn.o_proj.bias", [HIDDEN], 0.0)
        f32(f"{p}.self_attn.sinks", [HEADS], 0.1)
        f32(f"{p}.mlp.router.weight", [EXPERTS, HIDDEN], 0.02)
        f32(f"{p}.mlp.router.bias", [EXPERTS], 0.0)
        for name, rows, inp in [("gate_up_proj", 2 * INTER, HIDDEN), ("down_proj", HIDDEN, INTER)]:
            groups = inp // 32
            blocks = os.urandom(EXPERTS * rows * groups * 16)
            scales = bytes(rng.randrange(119, 123) for _ in range(EXPERTS * rows * groups))
            tensors.append((f"{p}.mlp.experts.{name}_blocks", "U8", [EXPERTS, rows, groups, 16], blocks))
            tensors.append((f"{p}.mlp.experts.{name}_scales", "U8", [EXPERTS, rows, groups], scales))
            f32(f"{p}.mlp.experts.{name}_bias", [EXPERTS, rows], 0.0)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape, data in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(os.path.join(out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for _, _, _, data in tensors:
            f.write(data)
    with open(os.path.join(FIXTURE, "config.json")) as f:
        config = json.load(f)
    config.update(
        num_hidden_layers=LAYERS,
        layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
        num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        head_dim=HEAD_DIM,
        sliding_window=128,
        vocab_size=VOCAB,
    )
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    for name in ["tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"]:
        shutil.copy(os.path.join(FIXTURE, name), out)
    print(out)


if __name__ == "__main__":
    main()
