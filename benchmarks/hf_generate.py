#!/usr/bin/env python3
"""HF transformers decode-speed anchor for ferrotune.

Loads SmolLM2-135M-Instruct from the Q4_1 GGUF that scripts/fetch-assets.sh caches (transformers dequantizes
it to float32), applies the chat template to a prompt, and greedy-generates a fixed number of tokens on the CPU.

    python3 benchmarks/hf_generate.py [--gguf PATH] [--prompt TEXT] [--max-new-tokens 128] [--runs 3] [--json]

Measured per run (after one untimed warm-up run), reported as the median over --runs:
  prefill tokens/s = prompt tokens / time of one forward pass over the whole prompt (no cache reuse)
  decode tokens/s  = new tokens / (time of generate() - prefill time)
generate() uses do_sample=False, max_new_tokens = min_new_tokens = N (so it never stops early) and the KV cache.
Threads: torch's default (torch.get_num_threads()) unless --threads is given. Attention: transformers' default
(sdpa) unless --attn is given.
Timings are very sensitive to other load on the machine: with more runnable threads than cores, torch's
OpenMP regions stall (measured: 2 threads on a busy 2-core box decode ~4x slower than 1 thread), so run it
on an otherwise idle machine; the 1-minute load average before/after is printed.
With --json, the last line printed is one JSON object:
  {"prefill_tokens_per_s":..,"decode_tokens_per_s":..,"new_tokens":..,"torch_threads":..,...}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path


def default_gguf() -> Path:
    assets = os.environ.get("FERROTUNE_ASSETS")
    if not assets:
        cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        assets = os.path.join(cache, "ferrotune", "assets")
    return Path(assets) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=default_gguf(), help="GGUF file (default: %(default)s)")
    ap.add_argument("--prompt", default="Write a short story about a robot learning to paint.")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default)")
    ap.add_argument("--attn", default=None, help="attn_implementation (sdpa, eager; default: transformers' default)")
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    args = ap.parse_args()

    gguf = args.gguf.expanduser()
    if not gguf.is_file():
        print(f"error: {gguf} not found (run scripts/fetch-assets.sh, or pass --gguf)", file=sys.stderr)
        return 2

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    transformers.logging.set_verbosity_error()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()

    # transformers 5 renamed torch_dtype -> dtype (torch_dtype still works there, with a deprecation warning)
    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    t = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    extra = {"attn_implementation": args.attn} if args.attn else {}
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, **{dtype_kw: torch.float32}, **extra
    )
    model.eval()
    load_s = time.perf_counter() - t

    enc = tokenizer.apply_chat_template(
        [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt"
    )
    input_ids = enc["input_ids"] if not torch.is_tensor(enc) else enc  # 5.x returns a BatchEncoding
    attention_mask = torch.ones_like(input_ids)
    n_prompt = input_ids.shape[1]
    n_new = args.max_new_tokens

    gen_kwargs = dict(
        attention_mask=attention_mask,
        do_sample=False,
        num_beams=1,
        max_new_tokens=n_new,
        min_new_tokens=n_new,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )

    def one_run():
        t0 = time.perf_counter()
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True)
        t1 = time.perf_counter()
        out = model.generate(input_ids, **gen_kwargs)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out[0, n_prompt:].tolist()

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with torch.inference_mode():
        one_run()  # warm-up
        prefill_s, gen_s, tokens = [], [], None
        for _ in range(args.runs):
            p, g, toks = one_run()
            assert len(toks) == n_new, f"generated {len(toks)} tokens, expected {n_new}"
            if tokens is not None and toks != tokens:
                print("warning: runs generated different tokens", file=sys.stderr)
            tokens = toks
            prefill_s.append(p)
            gen_s.append(g)

    load_after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    decode_s = [g - p for g, p in zip(gen_s, prefill_s)]
    prefill_tps = statistics.median(n_prompt / p for p in prefill_s)
    decode_tps = statistics.median(n_new / d for d in decode_s)
    gen_tps = statistics.median(n_new / g for g in gen_s)

    text = tokenizer.decode(tokens, skip_special_tokens=False)
    print(f"model: {gguf.name} (dequantized to float32)   load {load_s:.1f}s")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {threads}, "
          f"attn {model.config._attn_implementation}, "
          f"{platform.processor() or platform.machine()}")
    print(f"prompt tokens {n_prompt}, new tokens {n_new}, runs {args.runs} (+1 warm-up), "
          f"cpus {os.cpu_count()}, 1-min load average {load_before} -> {load_after} (other work skews timings)")
    print("--- generated text ---")
    print(text)
    print("----------------------")
    print(f"{'metric':<28}{'median':>10}{'min':>10}{'max':>10}")
    rows = [
        ("prefill tokens/s", [n_prompt / p for p in prefill_s]),
        ("decode tokens/s", [n_new / d for d in decode_s]),
        ("generate() tokens/s (all)", [n_new / g for g in gen_s]),
        ("prefill ms", [1e3 * p for p in prefill_s]),
        ("generate() s", gen_s),
    ]
    for name, vals in rows:
        print(f"{name:<28}{statistics.median(vals):>10.2f}{min(vals):>10.2f}{max(vals):>10.2f}")

    if args.json:
        print(json.dumps({
            "prefill_tokens_per_s": round(prefill_tps, 2),
            "decode_tokens_per_s": round(decode_tps, 2),
            "new_tokens": n_new,
            "torch_threads": threads,
            "attn_implementation": model.config._attn_implementation,
            "prompt_tokens": n_prompt,
            "generate_tokens_per_s": round(gen_tps, 2),
            "runs": args.runs,
            "loadavg_1m": [load_before, load_after],
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
