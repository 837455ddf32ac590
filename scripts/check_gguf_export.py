#!/usr/bin/env python3
"""Checks `ferrotune export-gguf` against the two GGUF readers users run: llama.cpp (through
llama-cpp-python) and transformers' GGUF loader. For each tiny fixture model, exports f32 and
q8_0 GGUFs, then compares each reader's logits of the golden input with transformers' logits of
the original checkpoint (tests/fixtures/models/<name>/golden.safetensors).

  python scripts/check_gguf_export.py target/release/ferrotune

Needs: torch, transformers, gguf, safetensors, llama-cpp-python.

  "$(scripts/fetch-llamacpp.sh)/bin/python" scripts/check_gguf_export.py target/release/ferrotune \
      --new-architectures

runs the architectures of 2026 in llama.cpp (llama-cpp-python 0.3.36 built from source: qwen35,
qwen35moe, qwen3next, gpt-oss, deepseek2) instead: models of the k-quant fixtures' configs
(scripts/make_kquant_fixtures.py: hidden size 256) exported as
f32, Q8_0, Q6_K and Q4_K_M, llama.cpp's logits against transformers' of the checkpoint (relative
L2 over all positions), and llama.cpp's greedy continuation (8 tokens) against transformers'.
Their weights are transformers' own initialization (seeded), the configs those of the k-quant
fixtures: the tiny model fixtures of these families use settings llama.cpp does not compute
(DeltaNet key and value heads of different sizes, gpt-oss's SwiGLU limit 2, DeepSeek's
group-limited V2 routing, `mscale` ≠ `mscale_all_dim`, a V2 without `q_lora_rank` at other than
V2-Lite's layer counts)."""

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

ROOT = Path(__file__).resolve().parent.parent
MODELS = ROOT / "tests" / "fixtures" / "models"


def rel_l2(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def llama_cpp_logits(path, ids, lora=None):
    """llama.cpp's logits of each row of `ids` through the GGUF `path` (with the LoRA adapter
    GGUF `lora`, if given)."""
    from llama_cpp import Llama

    # An f32 KV cache (llama.cpp's default is f16), so that the comparison sees the weights.
    llm = Llama(model_path=str(path), lora_path=str(lora) if lora else None, logits_all=True,
                n_ctx=64, verbose=False, n_threads=2, type_k=0, type_v=0)
    rows = []
    for row in ids:
        llm.reset()
        llm.eval(row)
        rows.append(np.array(llm.scores[: len(row)], dtype=np.float32))
    return np.stack(rows)


def transformers_logits(path, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def main():
    binary = Path(sys.argv[1]).resolve()
    out = Path(tempfile.mkdtemp())
    print(f"{'model':14} {'outtype':8} {'llama.cpp':>10} {'transformers':>13}")
    for name in ["llama2", "llama3_2", "smollm2_like", "mistral", "qwen2_5", "qwen3", "gemma", "phi2",
                 "phi3", "phi3_longrope", "mixtral", "qwen2_moe"]:
        golden = json.loads((MODELS / name / "golden.json").read_text())
        want = load_file(str(MODELS / name / "golden.safetensors"))["logits"]
        ids = golden["input_ids"]
        for outtype in ["f32", "q8_0"]:
            path = out / f"{name}-{outtype}.gguf"
            subprocess.run([binary, "export-gguf", MODELS / name / "model", path, "--outtype", outtype],
                           check=True, capture_output=True)
            cells = []
            for reader in (llama_cpp_logits, transformers_logits):
                try:
                    cells.append(f"{rel_l2(reader(path, ids), want):.2e}")
                except Exception as e:  # a reader refusing the file is a result too
                    cells.append(f"error: {str(e).splitlines()[0][:60]}")
            print(f"{name:14} {outtype:8} {cells[0]:>10} {cells[1]:>13}", flush=True)
    gemma_cases(binary, out)
    sentencepiece_case(binary, out)


def gemma_cases(binary, out):
    """Gemma 2 with the score scale llama.cpp fixes (the fixture's config edited: scaled by the
    head size), against transformers' logits of the edited checkpoint."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    edits = {
        "gemma2": {"query_pre_attn_scalar": 16},
    }
    for name, edit in edits.items():
        model_dir = out / f"{name}-edited"
        shutil.copytree(MODELS / name / "model", model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        config.update(edit)
        (model_dir / "config.json").write_text(json.dumps(config))
        ids = json.loads((MODELS / name / "golden.json").read_text())["input_ids"]
        with torch.no_grad():
            want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(
                torch.tensor(ids)).logits.numpy()
        path = out / f"{name}-edited.gguf"
        subprocess.run([binary, "export-gguf", model_dir, path, "--outtype", "f32"], check=True,
                       capture_output=True)
        print(f"{name + ' (edited)':14} {'f32':8} {rel_l2(llama_cpp_logits(path, ids), want):10.2e}",
              flush=True)


def sentencepiece_case(binary, out):
    """Llama 2's real tokenizer (SentencePiece-style BPE, 32 000 tokens) on a small random Llama:
    llama.cpp's tokenization of sample texts (it merges by the exported scores) and its logits
    against transformers'."""
    import os
    import shutil

    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    assets = Path(os.environ.get("FERROTUNE_ASSETS") or Path.home() / ".cache/ferrotune/assets")
    model_dir = out / "llama2-spm"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.2)
    model.save_pretrained(model_dir)
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(assets / "tokenizers" / "llama2" / f, model_dir / f)
    path = out / "llama2-spm.gguf"
    subprocess.run([binary, "export-gguf", model_dir, path, "--outtype", "f32"], check=True,
                   capture_output=True)
    hf = AutoTokenizer.from_pretrained(model_dir)
    llm = Llama(model_path=str(path), n_ctx=256, verbose=False, logits_all=True, type_k=0, type_v=0)
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog.",
             "Numbers 12345 and émojis 🙂 ünïcödé", "def f(x):\n    return x**2\n",
             "Ceci n'est pas une pipe. Ça va? 你好，世界！", "mixed   internal   spaces\ttabs",
             "URL: https://example.com/a?b=c&d=e", "The year 1999 was—arguably—odd."]
    same = sum(hf.encode(t) == llm.tokenize(t.encode(), add_bos=True, special=True) for t in texts)
    ids = hf.encode(texts[1])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)(
            torch.tensor([ids])).logits[0].numpy()
    llm.reset()
    llm.eval(ids)
    got = np.array(llm.scores[: len(ids)], dtype=np.float32)
    print(f"llama2 tokenizer (SentencePiece): llama.cpp tokenizes {same}/{len(texts)} texts as "
          f"transformers; logits relative L2 {rel_l2(got, want):.2e}")


def new_architectures(binary):
    """The k-quant fixtures' models of llama.cpp's 2026 architectures through llama.cpp (see the
    module's doc)."""
    import shutil

    import torch
    from llama_cpp import Llama
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "scripts"))
    import make_kquant_fixtures as kq

    out = Path(tempfile.mkdtemp())
    ids = [[5, 40, 41, 42, 100, 7, 300, 12, 9, 77, 3, 64]]
    steps = 8
    print(f"{'model':12} {'outtype':8} {'logits rel L2':>14} {'max |diff|':>11}  greedy tokens")
    for name, cfg in kq.new_model_configs().items():
        folder = out / name
        # transformers' own initialization (seeded), so that the logits are those of a model
        # in a sane range rather than of the k-quant fixture's hash weights.
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg), dtype=torch.float32)
        model.save_pretrained(folder)
        for f in ["tokenizer.json", "tokenizer_config.json"]:
            shutil.copy(kq.TOKENIZER / f, folder / f)
        with torch.no_grad():
            want = model(torch.tensor(ids)).logits.numpy()
            # Greedy by whole forwards (as llama.cpp's below): `generate`'s processors would
            # keep it from the end-of-sequence token.
            toks = list(ids[0])
            for _ in range(steps):
                toks.append(int(model(torch.tensor([toks])).logits[0, -1].argmax()))
            greedy = toks[len(ids[0]):]
        for outtype in ["f32", "q8_0", "q6_k", "q4_k_m"]:
            path = out / f"{name}-{outtype}.gguf"
            subprocess.run([binary, "export-gguf", folder, path, "--outtype", outtype],
                           check=True, capture_output=True)
            try:
                got = llama_cpp_logits(path, ids)
                llm = Llama(model_path=str(path), logits_all=True, n_ctx=64, verbose=False,
                            n_threads=2, type_k=0, type_v=0)
                toks = list(ids[0])
                for _ in range(steps):
                    llm.reset()
                    llm.eval(toks)
                    toks.append(int(np.argmax(llm.scores[len(toks) - 1])))
                cont = toks[len(ids[0]):]
                same = sum(a == b for a, b in zip(cont, greedy))
                print(f"{name:12} {outtype:8} {rel_l2(got, want):14.2e} "
                      f"{float(np.abs(got - want).max()):11.2e}  {same}/{steps} as transformers'",
                      flush=True)
            except Exception as e:  # llama.cpp refusing the file is a result too
                print(f"{name:12} {outtype:8} error: {str(e).splitlines()[0][:80]}", flush=True)


if __name__ == "__main__":
    if sys.argv[2:] == ["--new-architectures"]:
        new_architectures(Path(sys.argv[1]).resolve())
    else:
        main()
