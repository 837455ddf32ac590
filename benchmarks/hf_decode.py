"""Anchor for `ferrotune bench decode`: greedy decoding in HF transformers (PyTorch) on the same
synthetic shape, batch 1, to run beside ferrotune on the same GPU in the same call.

  python hf_decode.py --shape llama3_1_8b --device cuda --dtype bfloat16 --prompt 128 --new-tokens 128
  python hf_decode.py ... --cache static --compile   # transformers' static cache, compiled by generate

Weights are random (decode speed does not depend on their values). Decode tokens/s counts the
tokens after the first (the first comes out of the prefill), over the time after the prefill,
which is measured by a separate 1-token generate; median of --runs. Prints one JSON line.
(hf_generate.py is the CPU anchor on the real SmolLM2 GGUF with its chat template.)"""
import argparse, json, statistics, time
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

SHAPES = {  # name: (hidden, intermediate, layers, heads, kv_heads, vocab), as hf_lora.py
    'llama3_1_8b': (4096, 14336, 32, 32, 8, 128256),
    'llama3_2_1b': (2048, 8192, 16, 32, 8, 128256),
    'smollm2_135m': (576, 1536, 30, 9, 3, 49152),
}
ap = argparse.ArgumentParser()
ap.add_argument('--shape', default='llama3_1_8b'); ap.add_argument('--device', default='cuda')
ap.add_argument('--dtype', default='bfloat16'); ap.add_argument('--prompt', type=int, default=128)
ap.add_argument('--new-tokens', type=int, default=128); ap.add_argument('--runs', type=int, default=3)
ap.add_argument('--cache', default='dynamic', choices=['dynamic', 'static'])
ap.add_argument('--compile', action='store_true')
a = ap.parse_args()
torch.manual_seed(0)
h, i, L, nh, kv, V = SHAPES[a.shape]
cfg = LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=L, num_attention_heads=nh,
                  num_key_value_heads=kv, vocab_size=V, max_position_embeddings=8192,
                  tie_word_embeddings=(a.shape == 'smollm2_135m'), attn_implementation='sdpa')
with torch.device(a.device):
    m = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, a.dtype)).eval()
# With a static cache, generate compiles the decoding forward itself (torch.compile's
# reduce-overhead mode: CUDA graphs, each step marked) unless told not to. Wrapping m.forward in
# torch.compile as well made graph replays overwrite the static cache's outputs still in use.
if a.compile and a.cache != 'static':
    ap.error('--compile needs --cache static (transformers compiles only a static cache decode)')
gen_kwargs = {'disable_compile': not a.compile} if a.cache == 'static' else {}
ids = torch.randint(0, V, (1, a.prompt), device=a.device)


def timed_generate(new_tokens):
    if a.device == 'cuda': torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, cache_implementation=a.cache,
                         pad_token_id=0, **gen_kwargs)
    if a.device == 'cuda': torch.cuda.synchronize()
    assert out.shape[1] == a.prompt + new_tokens
    return time.perf_counter() - t


timed_generate(a.new_tokens)  # warmup (and compilation)
rates, prefills = [], []
for _ in range(a.runs):
    prefill = timed_generate(1)
    total = timed_generate(a.new_tokens)
    prefills.append(prefill)
    rates.append((a.new_tokens - 1) / max(total - prefill, 1e-9))
r = {'anchor': 'hf', 'torch': torch.__version__, 'device': a.device, 'dtype': a.dtype, 'shape': a.shape,
     'cache': a.cache, 'compile': a.compile, 'prompt': a.prompt, 'new_tokens': a.new_tokens,
     'decode_tokens_per_s': statistics.median(rates), 'prefill_s': statistics.median(prefills)}
if a.device == 'cuda':
    r['gpu'] = torch.cuda.get_device_name()
print(json.dumps(r))
