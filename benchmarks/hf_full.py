"""(benchmarks/hf_lora.py with the PEFT lines removed.)

Anchor (full fine-tuning variant of hf_lora.py: every weight trains, no PEFT): the same training step in HF transformers, to run beside `ferrotune bench train --full`.

CPU (real model):  python hf_lora.py --gguf PATH/SmolLM2-135M-Instruct.Q4_1.gguf --seq 256 --batch 4
GPU (synthetic):   python hf_lora.py --shape llama3_1_8b --device cuda --dtype bfloat16 --seq 2048 --batch 2
Weights are random for --shape (speed does not depend on their values). Prints one JSON line:
tokens_per_s (training tokens through forward+backward+optimizer), step_s, peak memory."""
import argparse, json, os, resource, time
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

SHAPES = {  # name: (hidden, intermediate, layers, heads, kv_heads, vocab)
    'llama3_1_8b': (4096, 14336, 32, 32, 8, 128256),
    'llama3_2_1b': (2048, 8192, 16, 32, 8, 128256),
    'smollm2_135m': (576, 1536, 30, 9, 3, 49152),
}
ap = argparse.ArgumentParser()
ap.add_argument('--gguf'); ap.add_argument('--shape'); ap.add_argument('--device', default='cpu')
ap.add_argument('--dtype', default='float32'); ap.add_argument('--seq', type=int, default=256)
ap.add_argument('--batch', type=int, default=4); ap.add_argument('--steps', type=int, default=5)
ap.add_argument('--rank', type=int, default=8); ap.add_argument('--alpha', type=int, default=16)
ap.add_argument('--attn', default='sdpa'); ap.add_argument('--compile', action='store_true')
ap.add_argument('--grad-ckpt', action='store_true'); ap.add_argument('--threads', type=int, default=0)
ap.add_argument('--prompt-fraction', type=float, default=0.0)  # leading labels set to -100, as masked prompts
a = ap.parse_args()
if a.threads: torch.set_num_threads(a.threads)
torch.manual_seed(0)
dt = getattr(torch, a.dtype)
if a.gguf:
    m = AutoModelForCausalLM.from_pretrained(os.path.dirname(a.gguf), gguf_file=os.path.basename(a.gguf), dtype=dt,
                                             attn_implementation=a.attn).to(a.device)
else:
    h, i, L, nh, kv, V = SHAPES[a.shape]
    cfg = LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=L, num_attention_heads=nh, num_key_value_heads=kv,
                      vocab_size=V, max_position_embeddings=max(8192, a.seq), tie_word_embeddings=(a.shape == 'smollm2_135m'),
                      attn_implementation=a.attn)
    with torch.device(a.device):
        m = AutoModelForCausalLM.from_config(cfg, dtype=dt)
if a.grad_ckpt:
    m.gradient_checkpointing_enable(); m.enable_input_require_grads()
# Full fine-tuning: every weight trains.
m.train()
fwd = torch.compile(m) if a.compile else m
opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, fused=(a.device == 'cuda'))
V = m.config.vocab_size
ids = torch.randint(0, V, (a.batch, a.seq), device=a.device)
labels = ids.clone(); labels[:, :int(a.seq * a.prompt_fraction)] = -100
def sync():
    if a.device == 'cuda': torch.cuda.synchronize()
def step():
    loss = fwd(input_ids=ids, labels=labels).loss; loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
for _ in range(2): step()
sync()
if a.device == 'cuda': torch.cuda.reset_peak_memory_stats()
t = time.time()
for _ in range(a.steps): step()
sync(); el = time.time() - t
r = {'anchor': 'hf-full', 'torch': torch.__version__, 'device': a.device, 'dtype': a.dtype, 'seq': a.seq, 'batch': a.batch,
     'tokens_per_s': a.batch * a.seq * a.steps / el, 'step_s': el / a.steps,
     'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
if a.device == 'cuda':
    r['peak_gpu_mem_gb'] = torch.cuda.max_memory_allocated() / 2**30; r['gpu'] = torch.cuda.get_device_name()
print(json.dumps(r))
