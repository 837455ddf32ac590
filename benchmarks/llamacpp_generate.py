#!/usr/bin/env python3
"""llama.cpp decode-speed reference (through the llama-cpp-python package) on the same GGUF.

    pip install llama-cpp-python      # compiles llama.cpp (several minutes on 2 cores)
    python3 benchmarks/llamacpp_generate.py [--gguf PATH] [--prompt TEXT] [--max-new-tokens 128] [--runs 3]

Greedy, same chat-formatted prompt as benchmarks/hf_generate.py, threads = all cores. llama.cpp computes
with its quantized kernels (activations quantized to 8 bits), so its logits are not transformers' f32
ones: it is a speed reference, not a numerical one. Prints one JSON line last:
{"prefill_tokens_per_s": .., "decode_tokens_per_s": .., "new_tokens": ..}
"""

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def main() -> None:
    assets = os.environ.get("FERROTUNE_ASSETS") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "ferrotune", "assets")
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", type=Path, default=Path(assets) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--prompt", default="Write a short story about a robot learning to paint.")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    from llama_cpp import Llama

    llm = Llama(model_path=str(args.gguf), n_ctx=1024, n_threads=os.cpu_count(), verbose=False)
    # The same text the chat template renders for one user message (SmolLM2's ChatML template).
    text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            f"<|im_start|>user\n{args.prompt}<|im_end|>\n<|im_start|>assistant\n")
    prompt = llm.tokenize(text.encode(), add_bos=False, special=True)

    def once():
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t1 = time.perf_counter()
        for _ in range(args.max_new_tokens):
            tok = llm.sample(top_k=1, temp=0.0)
            llm.eval([tok])
        t2 = time.perf_counter()
        return len(prompt) / (t1 - t0), args.max_new_tokens / (t2 - t1)

    once()  # warm-up
    runs = [once() for _ in range(args.runs)]
    print(json.dumps({
        "prefill_tokens_per_s": statistics.median(r[0] for r in runs),
        "decode_tokens_per_s": statistics.median(r[1] for r in runs),
        "new_tokens": args.max_new_tokens,
    }))


if __name__ == "__main__":
    main()
