#!/usr/bin/env python3
"""Generate tiny random-weight model fixtures for every architecture ferrotune supports.

Usage (from the repository root):

    python3 scripts/make_model_fixtures.py [--out tests/fixtures/models] [--only CASE ...]

Reference stack: HF transformers 5.x, PyTorch 2.x, CPU, float32. Output, one folder per case:

    tests/fixtures/models/<case>/
        model/               transformers checkpoint (config.json, *.safetensors, generation_config.json,
                             tokenizer.json, tokenizer_config.json, chat_template.jinja)
        golden.json          input_ids [2,16], labels (first 4 positions -100), loss, greedy_prompt (8 ids),
                             greedy_new_tokens (16 ids, greedy, no early stop), config_style ("v5" | "v4"), ...
        golden.safetensors   logits [2,16,512] float32
        grads.safetensors    (cases with grads=True) d loss / d parameter for every parameter, float32

Goldens are always computed from the checkpoint *as written to disk* (reloaded with
AutoModelForCausalLM.from_pretrained(..., dtype=float32)), so a post-edited config.json (4.x style) or
bf16 weights are exactly what the golden describes. Everything is deterministic (fixed seeds).

The models are deliberately not "nice": every norm weight is perturbed, biases are non-zero, weights are
large enough that attention is far from uniform and logits differ clearly across tokens, and several
dimensions differ (hidden 32, intermediate 96, head_dim 8/16/32, vocab 512) so that a transposed or
mis-split tensor shows up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import zlib
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import transformers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    Gemma4TextConfig,
    GemmaConfig,
    GptOssConfig,
    GenerationConfig,
    LlamaConfig,
    Ministral3Config,
    MinistralConfig,
    MistralConfig,
    MixtralConfig,
    Olmo2Config,
    Phi3Config,
    Qwen3_5MoeTextConfig,
    Qwen3NextConfig,
    Qwen3_5TextConfig,
    PhiConfig,
    PhimoeConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
    Llama4TextConfig,
    Qwen2Config,
    Qwen3Config,
    SmolLM3Config,
    VaultGemmaConfig,
)

transformers.logging.set_verbosity_error()

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = Path(os.environ.get("FERROTUNE_TINY_TOKENIZER", "/work/shared/fixtures/tiny_tokenizer"))
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]

# Tiny tokenizer: vocab 512; special tokens <|endoftext|>=0, <|im_start|>=1, <|im_end|>=2, <pad>=3.
VOCAB = 512
BOS, IM_START, EOS, PAD = 0, 1, 2, 3

# Model size knobs. hidden 32 keeps every checkpoint ~100-250 KB (the whole folder ~3 MB); head_dim is
# set explicitly where the real family decouples it from hidden/heads.
HIDDEN = 32
INTERMEDIATE = 96
LAYERS = 2
HEADS = 4

SEQ = 16
BATCH = 2
IGNORED_LABEL_POSITIONS = 4
PROMPT_LEN = 8
NEW_TOKENS = 16

# Weight scales (std = gain / sqrt(fan_in) for projections).
NORM_PERTURB = 0.15
EMBED_STD = 1.0
EMBED_STD_TIED = 0.3
# Gemma 2/3 normalize each block's output before the residual add (sandwich norms), so the tied embedding must
# be smaller still for the layers to outweigh it.
EMBED_STD_SANDWICH = 0.08
LM_HEAD_GAIN = 2.0
IN_GAIN = 1.5
OUT_GAIN = 2.0
# The prompt for the greedy golden is searched (deterministically) until greedy decoding is decisive and varied.
MIN_GREEDY_MARGIN = 0.02
MIN_GREEDY_DISTINCT = 8
MAX_INPUT_ATTEMPTS = 64


def common(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        max_position_embeddings=512,
        initializer_range=0.02,
        use_cache=True,
        attention_dropout=0.0,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
    )
    base.update(kw)
    return base


# --------------------------------------------------------------------------------------------------------
# Config builders (each sets the fields that matter explicitly)
# --------------------------------------------------------------------------------------------------------


def cfg_llama2():
    return LlamaConfig(**common(
        num_key_value_heads=HEADS,  # MHA
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        pretraining_tp=1,
        pad_token_id=None,  # like the real Llama 2 config
    ))


def cfg_llama3_2():
    # head_dim 16 (explicit, != hidden/heads = 8) so that with theta 500000 and original_max_position_embeddings 64
    # the rotary frequencies cover all three llama3 branches: kept (wavelen < 16), smoothly interpolated
    # (16 < wavelen < 64: i=1, wavelen ~32.4) and divided by factor (wavelen > 64).
    return LlamaConfig(**common(
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        eos_token_id=[EOS, BOS],  # a list, like Llama 3.x instruct configs
    ))


def cfg_mistral():
    return MistralConfig(**common(
        num_key_value_heads=2,
        head_dim=16,  # explicit, != hidden/heads (= 8), like Mistral-Nemo
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        sliding_window=None,
        tie_word_embeddings=False,
    ))


def cfg_qwen2_5():
    return Qwen2Config(**common(
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=LAYERS,
        tie_word_embeddings=False,
    ))


def cfg_qwen3():
    return Qwen3Config(**common(
        num_key_value_heads=2,
        head_dim=32,  # != hidden/heads (= 8)
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        attention_bias=False,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=LAYERS,
        tie_word_embeddings=True,
    ))


def cfg_gemma():
    return GemmaConfig(**common(
        num_key_value_heads=1,
        head_dim=32,  # != hidden/heads (= 8)
        hidden_act="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        attention_bias=False,
        tie_word_embeddings=True,
    ))


def gemma2_args():
    # Gemma 2: sandwich norms (post-attention / pre- and post-feedforward), scores scaled by
    # query_pre_attn_scalar^-0.5 (24, != head_dim 16), tanh softcapping of attention scores and final
    # logits with caps small enough to bite (3 and 2.5), and layer_types alternating sliding (window 5 <
    # the 16-token sequence) and full attention.
    return common(
        num_key_value_heads=2,
        head_dim=16,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        query_pre_attn_scalar=24,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=2.5,
        sliding_window=5,
        attention_bias=False,
        tie_word_embeddings=True,
    )


def cfg_gemma2():
    return Gemma2Config(**gemma2_args())


def cfg_vaultgemma():
    # VaultGemma: Gemma 2 without the post-attention and post-feedforward norms (input_layernorm, and
    # pre_feedforward_layernorm before the MLP); Gemma 2's scalar, softcaps and alternating windows.
    return VaultGemmaConfig(**gemma2_args())


def cfg_gemma3():
    # Gemma 3 text: Gemma 2's sandwich norms plus per-head q/k RMSNorm (1 + w), no softcapping, and two
    # rotary tables: sliding layers (window 5) use a local default rope (theta 1e4), full layers the global
    # one (theta 1e6, linear scaling factor 8, as Gemma 3 4B+).
    return Gemma3TextConfig(**common(
        num_key_value_heads=2,
        head_dim=16,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        query_pre_attn_scalar=12,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        attention_bias=False,
        tie_word_embeddings=True,
    ))


def cfg_gemma4():
    # Gemma 4 text, as the dense 31B: sliding and full layers alternating (window 5); the full layers have their
    # own head size (global_head_dim 32 against 16) and one key/value head whose values are the key projection's
    # output (attention_k_eq_v), rotated by the proportional rope on a quarter of the head (4 of 16 pairs, theta
    # 1e6, factor 2); the sliding layers take the default rope (theta 1e4). Norms multiply by the weight itself,
    # q/k norms, weightless v norm, scores unscaled (scaling 1.0), logits softcapped at 30; no per-layer
    # embeddings, no KV sharing; tied.
    return Gemma4TextConfig(**common(
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0,
                               "factor": 2.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=30.0,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        tie_word_embeddings=True,
    ))


def cfg_gemma4_e2b_like():
    # Gemma 4 "E" models (E2B / E4B): per-layer embeddings (a second token table [vocab, layers x 8] mixed with a
    # projection of the input embeddings, gated into every layer), the last two layers reusing the keys and values
    # of the last unshared layer of their type (num_kv_shared_layers 2: layer 3 takes layer 2's, layer 4 layer
    # 1's) with double-wide MLPs there (use_double_wide_mlp), no attention_k_eq_v; global_head_dim 24, untied.
    return Gemma4TextConfig(**common(
        num_hidden_layers=5,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=24,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
                     "full_attention"],
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        tie_word_embeddings=False,
    ))


def cfg_gemma4_moe():
    # Gemma 4 MoE (as the 26B-A4B): every layer runs its dense MLP and, beside it, a mixture of 4 experts
    # (top-2, moe_intermediate_size 24) routed from the MLP's residual input through a weightless RMSNorm, a
    # learned scale and 1/sqrt(hidden); the top-2 softmax weights renormalized and multiplied by per-expert
    # scales; experts fused as experts.gate_up_proj [4, 48, 32] / experts.down_proj [4, 32, 24]; the two
    # outputs normed apart (post_feedforward_layernorm_1 / _2) and summed. Full layers with global_head_dim 32
    # and attention_k_eq_v (2 key/value heads), proportional rope; untied.
    return Gemma4TextConfig(**common(
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=16,
        global_head_dim=32,
        num_global_key_value_heads=2,
        attention_k_eq_v=True,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        rope_parameters={
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
        sliding_window=5,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=30.0,
        hidden_size_per_layer_input=0,
        num_kv_shared_layers=0,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=24,
        tie_word_embeddings=False,
    ))


def cfg_phi2():
    # Phi-2 (model_type phi): LayerNorm with bias, attention and MLP in parallel on one normed input,
    # output projection `dense`, ungated MLP fc1 -> gelu_new -> fc2, partial rotary 0.5 of head_dim 8,
    # biases on every projection and on lm_head, final_layernorm; GQA 4/2 (Phi-2 itself is MHA).
    return PhiConfig(**common(
        num_key_value_heads=2,
        hidden_act="gelu_new",
        layer_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        qk_layernorm=False,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        tie_word_embeddings=False,
    ))


def cfg_phi2_tied():
    # Phi-2 with tied embeddings: the head's weight is the embedding's, its bias its own (saved as
    # lm_head.bias with no lm_head.weight); MHA.
    c = cfg_phi2()
    c.tie_word_embeddings = True
    c.num_key_value_heads = c.num_attention_heads
    return c


def cfg_mixtral():
    # Mixtral: 4 experts (w1 gate / w3 up / w2 down) under block_sparse_moe, top-2 routing with the two
    # weights renormalized (f32), router block_sparse_moe.gate; GQA 4/2.
    return MixtralConfig(**common(
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        sliding_window=None,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=48,
        router_jitter_noise=0.0,
        tie_word_embeddings=False,
    ))


def cfg_phimoe():
    # Phi-3.5-MoE: LayerNorms with bias (input, post-attention, final model.norm, eps from rms_norm_eps),
    # q/k/v/o and lm_head biases, 4 experts (block_sparse_moe.experts.N.w1/w3/w2) routed by the
    # sparsemixer: router_jitter_noise 0.3 masks logits whose relative gap to the top exceeds 0.6, so
    # some weights are a softmax over several logits and some are 1; longrope with short_mscale 1.1 and
    # long_mscale 1.3 (original context 6 < the prompt, so every call scales by 1.3 while rotating with
    # the short factors, as transformers 5 does), GQA 4/2.
    rot_half = 4
    return PhimoeConfig(**common(
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.2 * i for i in range(rot_half)],
            "long_factor": [2.0 + 0.9 * i for i in range(rot_half)],
            "short_mscale": 1.1,
            "long_mscale": 1.3,
            "original_max_position_embeddings": 6,
        },
        sliding_window=None,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=48,
        router_jitter_noise=0.3,
        input_jitter_noise=0.0,
        attention_bias=True,
        lm_head_bias=True,
        tie_word_embeddings=False,
    ))


def cfg_qwen3_moe():
    # Qwen3-MoE: layer 0 dense (mlp_only_layers), layer 1 with 4 experts (moe_intermediate_size 24), top-2
    # with norm_topk_prob, q/k norms, head_dim 16.
    return Qwen3MoeConfig(**common(
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
        use_sliding_window=False,
        tie_word_embeddings=False,
    ))


def cfg_qwen2_moe():
    # Qwen2-MoE: 4 experts top-2 without renormalization, plus the shared expert (intermediate 40) scaled
    # by sigmoid(shared_expert_gate(x)); q/k/v bias.
    return Qwen2MoeConfig(**common(
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        norm_topk_prob=False,
        qkv_bias=True,
        use_sliding_window=False,
        tie_word_embeddings=False,
    ))


def cfg_ministral():
    # Ministral: Mistral with layer_types; layer 0 sliding (window 5), layer 1 full.
    return MinistralConfig(**common(
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    ))


def cfg_ministral3():
    # Ministral 3: YaRN (factor 4 over 4 original positions) and the llama-4 query temperature
    # 1 + 0.3 ln(1 + floor(p / 4)), which is > 1 from position 4 on.
    return Ministral3Config(**common(
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 4.0,
                         "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.3},
        sliding_window=None,
        tie_word_embeddings=False,
    ))


def cfg_smollm3():
    # SmolLM3: layer 1 is a NoPE layer (no_rope_layers [1, 0]); GQA 4/2, tied.
    return SmolLM3Config(**common(
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0},
        no_rope_layers=[1, 0],
        use_sliding_window=False,
        tie_word_embeddings=True,
    ))


def cfg_olmo2():
    # OLMo 2: no pre-norms (post_attention_layernorm / post_feedforward_layernorm on each block's output),
    # q_norm / k_norm over the whole q / k projection (widths 4*8 and 2*8), rope theta 5e5, GQA 4/2, untied.
    return Olmo2Config(**common(
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        attention_bias=False,
        tie_word_embeddings=False,
    ))


def cfg_llama4():
    # Llama 4 text (Llama4ForCausalLM, llama4_text): 4 layers, no_rope_layers [1, 0, 1, 0] (RoPE layers take
    # chunked attention, chunk 6, and the weightless L2 q/k norm; NoPE layers full attention with the query
    # temperature 1 + 0.5 ln(1 + floor((p + 1) / 4))), MoE on layers 1 and 2 (4 experts, top-1 sigmoid
    # routing that scales the expert's input, fused experts.gate_up_proj / down_proj, a shared expert of
    # intermediate 24), dense layers 0 and 3 with intermediate_size_mlp 96; rope llama3 as Scout's (factor 16,
    # low = high frequency factor 1, original 64); head_dim 16, GQA 4/2, untied.
    return Llama4TextConfig(**common(
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        intermediate_size=24,
        intermediate_size_mlp=INTERMEDIATE,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 1.0, "original_max_position_embeddings": 64},
        no_rope_layers=[1, 0, 1, 0],
        moe_layers=[1, 2],
        num_local_experts=4,
        num_experts_per_tok=1,
        use_qk_norm=True,
        attention_chunk_size=6,
        attn_temperature_tuning=True,
        floor_scale=4,
        attn_scale=0.5,
        tie_word_embeddings=False,
        num_hidden_layers=4,
    ))


def cfg_gpt_oss():
    # gpt-oss: 3 layers (layer_types default: sliding, full, sliding), sliding_window 4 (it matters on 16 tokens),
    # a learned attention sink per head, q/k/v/o biases, head_dim 16 (!= hidden/heads), GQA 4/2; 4 experts top-2:
    # router mlp.router (Linear with bias), top-2 logits softmaxed, fused experts.gate_up_proj [E, hidden, 2 I]
    # with gate/up interleaved, biases, the clamped SwiGLU (limit 2.0 so that the clamps bite) and (up + 1);
    # rope left to GptOssConfig's default: YaRN factor 32 over 4096 original positions, truncate false, theta 1.5e5.
    return GptOssConfig(**common(
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        intermediate_size=24,
        num_hidden_layers=3,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=4,
        swiglu_limit=2.0,
        attention_bias=True,
        tie_word_embeddings=False,
    ))


def cfg_phi3():
    return Phi3Config(**common(
        num_key_value_heads=2,  # GQA inside the fused qkv_proj (like Phi-4-mini), so an even 3-way split is wrong
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        original_max_position_embeddings=512,
        sliding_window=None,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        tie_word_embeddings=False,
    ))


def cfg_smollm2_like():
    return LlamaConfig(**common(
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=True,
        attention_bias=False,
        mlp_bias=False,
        pad_token_id=EOS,  # SmolLM2-Instruct uses eos as pad
    ))


def cfg_mistral_window():
    # A sliding window (5) shorter than the golden sequence (16) and the greedy run (8 + 16).
    return MistralConfig(**common(
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        sliding_window=5,
        tie_word_embeddings=False,
    ))


def cfg_qwen2_window_yarn():
    # Qwen2 with use_sliding_window on from layer max_window_layers (1): layer 0 full, layer 1 windowed;
    # YaRN rope (factor 4 over 8 original positions: every frequency band is exercised at 16 positions).
    return Qwen2Config(**common(
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 8},
        use_sliding_window=True,
        sliding_window=5,
        max_window_layers=1,
        tie_word_embeddings=False,
    ))


def cfg_phi3_longrope():
    # Phi-3.5 / Phi-4-mini style: longrope (short/long factor lists, attention factor from
    # max_position_embeddings / original) over a partial rotary dimension (0.75 of head_dim 16 = 12).
    # original_max_position_embeddings 6 < the prompt (8): every call uses the long factors, so
    # generate() with its cache and a cache-free argmax loop agree (mixing short and long factors in
    # one cache is where they would not).
    rot_half = 6
    return Phi3Config(**common(
        num_attention_heads=2,
        num_key_value_heads=1,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0 + 0.1 * i for i in range(rot_half)],
            "long_factor": [1.5 + 0.7 * i for i in range(rot_half)],
        },
        original_max_position_embeddings=6,
        sliding_window=None,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        tie_word_embeddings=False,
    ))


def cfg_llama_linear_bias():
    # Linear rope scaling (factor 2) and biases on every projection (attention_bias, mlp_bias).
    return LlamaConfig(**common(
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        tie_word_embeddings=False,
        attention_bias=True,
        mlp_bias=True,
    ))


def cfg_llama3_meta(tied: bool, factor: float):
    # A config Meta's params.json can express: head_dim = hidden / heads = 8, intermediate from
    # ffn_dim_multiplier 1.5 and multiple_of 16 (4 * 32 -> 85 -> 127 -> 128), Meta's fixed llama3 rope
    # constants (low 1, high 4, original 8192). With theta 5e5 the four frequencies have wavelengths ~6, ~167,
    # ~4443 and ~118k: two kept, one smoothed, one divided by the factor.
    return LlamaConfig(**common(
        intermediate_size=128,
        num_key_value_heads=2,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=tied,
        attention_bias=False,
        mlp_bias=False,
    ))


def cfg_llama3_1_meta():
    return cfg_llama3_meta(tied=False, factor=8.0)


def cfg_llama3_2_meta():
    return cfg_llama3_meta(tied=True, factor=32.0)


def load_convert_weights():
    """torchtune's own converter (torchtune/models/convert_weights.py, self-contained), loaded from its
    source so that the Meta files written here are checked against the conversion torchtune applies."""
    import importlib.util
    src = Path(os.environ.get("TORCHTUNE_SRC", "/tmp/tt/src")) / "torchtune" / "models" / "convert_weights.py"
    spec = importlib.util.spec_from_file_location("tt_convert_weights", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_pickles(case: str, model_dir: Path, config):
    """Replaces the safetensors just written by PyTorch pickles: HF's `pytorch_model-*.bin` shards with
    `pytorch_model.bin.index.json` (kind "hf"), or Meta's `consolidated.00.pth` + `params.json` (kind "meta")."""
    spec = CASES[case]
    hf = load_file(str(model_dir / "model.safetensors"))
    (model_dir / "model.safetensors").unlink()
    if spec["pickle"] == "hf":
        names = sorted(hf)
        parts = [names[: len(names) // 2], names[len(names) // 2:]]
        weight_map = {}
        for i, part in enumerate(parts):
            fname = f"pytorch_model-{i + 1:05d}-of-{len(parts):05d}.bin"
            torch.save({k: hf[k] for k in part}, model_dir / fname)
            weight_map.update({k: fname for k in part})
        total = sum(v.numel() * v.element_size() for v in hf.values())
        (model_dir / "pytorch_model.bin.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")
        return
    heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.hidden_size
    head_dim = dim // heads
    assert getattr(config, "head_dim", head_dim) == head_dim, "Meta's format has head_dim = dim / n_heads"

    def to_meta_rows(t, n):  # HF's rotate-half rows back to Meta's interleaved pairs
        return t.view(n, 2, head_dim // 2, dim).transpose(1, 2).reshape(n * head_dim, dim).contiguous()

    names = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
                 "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
                 "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
                 "mlp.up_proj": "feed_forward.w3", "input_layernorm": "attention_norm",
                 "post_attention_layernorm": "ffn_norm"}
    meta = {}
    for k, v in hf.items():
        if k in names:
            meta[names[k]] = v
            continue
        layer, rest = k.removeprefix("model.layers.").split(".", 1)
        mod = rest.removesuffix(".weight")
        new = f"layers.{layer}.{per_layer[mod]}.weight"
        if mod == "self_attn.q_proj":
            v = to_meta_rows(v, heads)
        elif mod == "self_attn.k_proj":
            v = to_meta_rows(v, kv)
        meta[new] = v
    if config.tie_word_embeddings:
        meta["output.weight"] = meta["tok_embeddings.weight"].clone()  # as torchtune's Meta checkpointer saves 3.2
    # torchtune's converter must read these files back into the same HF tensors.
    cw = load_convert_weights()
    tune = cw.meta_to_tune({k: v for k, v in meta.items()})
    back = cw.tune_to_hf(tune, num_heads=heads, num_kv_heads=kv, dim=dim)
    for k, v in hf.items():
        assert torch.equal(back[k], v), f"{case}: torchtune reads {k} differently"
    params = dict(spec["params"])
    params.update(dim=dim, n_layers=config.num_hidden_layers, n_heads=heads, n_kv_heads=kv,
                  norm_eps=config.rms_norm_eps)
    if spec.get("rope_freqs"):
        # Llama 2's consolidated files carry the rotary frequencies as a buffer, which loaders skip.
        meta["rope.freqs"] = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    torch.save(meta, model_dir / "consolidated.00.pth")
    (model_dir / "params.json").write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
    for f in ["config.json", "generation_config.json"]:
        (model_dir / f).unlink()


# --------------------------------------------------------------------------------------------------------
# Cases
# --------------------------------------------------------------------------------------------------------
# weights_from: build the weights with that case's config and seed (so derived cases share weights exactly).
# v4_edit: a function rewriting config.json (dict) into transformers 4.x style.


def to_v4_common(cfg: dict) -> dict:
    """transformers 4.x style: top-level rope_theta (+ rope_scaling dict or null), torch_dtype."""
    out = dict(cfg)
    rp = out.pop("rope_parameters")
    rp = dict(rp)
    out["rope_theta"] = rp.pop("rope_theta")
    rp.pop("partial_rotary_factor", None)
    if rp.get("rope_type", "default") == "default":
        out["rope_scaling"] = None
    else:
        out["rope_scaling"] = rp  # keeps "rope_type" (4.x also accepted the legacy key "type")
    if "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    out["transformers_version"] = "4.46.3"
    return dict(sorted(out.items()))


def to_v4_qwen2(cfg: dict) -> dict:
    out = to_v4_common(cfg)
    # Real Qwen2.5 4.x configs carry a sliding_window value while use_sliding_window is false, and no
    # layer_types. transformers ignores sliding_window unless use_sliding_window is true; 8 (< sequence length)
    # makes a loader that applies it anyway produce different logits.
    out.pop("layer_types", None)
    out["use_sliding_window"] = False
    out["sliding_window"] = 8
    return dict(sorted(out.items()))


def to_v4_gemma3(cfg: dict) -> dict:
    """Gemma 3 as transformers 4.5x wrote it: rope_theta (global), rope_local_base_freq, rope_scaling for the
    global layers, sliding_window_pattern instead of layer_types."""
    out = dict(cfg)
    rp = out.pop("rope_parameters")
    full, local = dict(rp["full_attention"]), dict(rp["sliding_attention"])
    out["rope_theta"] = full.pop("rope_theta")
    out["rope_local_base_freq"] = local.pop("rope_theta")
    out["rope_scaling"] = None if full.get("rope_type", "default") == "default" else full
    types = out.pop("layer_types")
    out.pop("_sliding_window_pattern", None)  # transformers 5 also saves its private copy
    out["sliding_window_pattern"] = types.index("full_attention") + 1
    if "dtype" in out:
        out["torch_dtype"] = out.pop("dtype")
    out["transformers_version"] = "4.53.0"
    return dict(sorted(out.items()))


def cfg_deepseek_v3():
    # DeepSeek-V3: multi-head latent attention with low-rank queries (q_lora_rank 16), latent 12, per head
    # 8 + 4 (rotary, interleaved pairs) query/key dims and values of 10; YaRN (factor 4, original 8) with
    # mscale_all_dim 0.8 in the softmax scale; layer 0 dense, layers 1-2 MoE: 8 experts in 4 groups, top-2
    # groups by the sum of their two best sigmoid scores + e_score_correction_bias, top-3 experts,
    # norm_topk_prob, routed_scaling_factor 2.5, 2 shared experts.
    return DeepseekV3Config(**common(
        num_hidden_layers=3,
        num_key_value_heads=4,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 8, "mscale": 1.0, "mscale_all_dim": 0.8,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        rope_interleave=True,
        q_lora_rank=16,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=10,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        moe_intermediate_size=16,
        n_shared_experts=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        tie_word_embeddings=False,
    ))


def cfg_deepseek_v2():
    # DeepSeek-V2(-Lite): q_proj (q_lora_rank null), latent 16, per head 8 + 8 (rotary, always interleaved
    # pairs) query/key dims and values of 20 (wider than the keys); default rope; layer 0 dense, layer 1 MoE:
    # softmax scores, group_limited_greedy (4 experts in 2 groups, 1 group kept by its best score), top-2,
    # routed_scaling_factor 1.5, no renormalization, 1 shared expert.
    return DeepseekV2Config(**common(
        num_key_value_heads=4,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        q_lora_rank=None,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=20,
        n_routed_experts=4,
        num_experts_per_tok=2,
        topk_method="group_limited_greedy",
        n_group=2,
        topk_group=1,
        moe_intermediate_size=16,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        tie_word_embeddings=False,
    ))


def cfg_qwen3_5():
    # Qwen3.5 (dense text model): 4 layers, every 4th full attention (default interval): layers 0-2 Gated
    # DeltaNet (2 key heads of 8, 4 value heads of 16: each key head serves 2 value heads; conv kernel 4), layer 3
    # gated full attention (q_proj gives query + output gate per head, q/k norms, GQA 4/2, head_dim 16, partial
    # rotary 0.25 by default); zero-centred norms; untied.
    return Qwen3_5TextConfig(**common(
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        tie_word_embeddings=False,
    ))


def cfg_qwen3_5_moe():
    # Qwen3.5-MoE (text model): qwen3_5's layers (0-2 Gated DeltaNet, 3 gated full attention) with every MLP a
    # mixture of 4 experts (moe_intermediate_size 16), top-2 always renormalized, plus a shared expert
    # (intermediate 24) scaled by sigmoid(shared_expert_gate(x)); untied.
    return Qwen3_5MoeTextConfig(**common(
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        tie_word_embeddings=False,
    ))


def cfg_qwen3_next():
    # Qwen3-Next: qwen3_5_moe's layer pattern (0-2 Gated DeltaNet, 3 gated full attention) with the DeltaNet's
    # projections fused per key head (in_proj_qkvz, in_proj_ba; 2 key heads each serving 2 value heads), layer 1
    # dense (mlp_only_layers, intermediate 96), the others 4 experts (intermediate 16) top-2 without
    # renormalization (norm_topk_prob false) plus a gated shared expert (intermediate 24); untied.
    return Qwen3NextConfig(**common(
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        linear_conv_kernel_dim=4,
        linear_key_head_dim=8,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        tie_word_embeddings=False,
    ))


CASES = {
    "llama2": dict(cfg=cfg_llama2, seed=101, style="v5",
                   notes="MHA, rope default theta 1e4, untied lm_head, pad_token_id null"),
    "llama3_2": dict(cfg=cfg_llama3_2, seed=102, style="v5",
                     notes="rope_type llama3 (factor 32, low 1, high 4, orig 64, theta 5e5), explicit head_dim 16 "
                           "(!= hidden/heads), GQA 4/2, tied embeddings (no lm_head.weight in the file), "
                           "eos_token_id is a list [2, 0]"),
    "mistral": dict(cfg=cfg_mistral, seed=103, style="v5",
                    notes="GQA 4/2, explicit head_dim 16 (!= hidden/heads), sliding_window null, theta 1e6"),
    "qwen2_5": dict(cfg=cfg_qwen2_5, seed=104, style="v4", v4_edit=to_v4_qwen2,
                    notes="4.x config (top-level rope_theta, rope_scaling null, torch_dtype, no layer_types, no "
                          "head_dim); q/k/v bias (o_proj none); sliding_window 8 but use_sliding_window false: "
                          "transformers ignores the window, so must you; untied"),
    "qwen3": dict(cfg=cfg_qwen3, seed=105, style="v5",
                  notes="per-head q_norm/k_norm (RMSNorm over head_dim, before rope), head_dim 32 (!= hidden/heads), "
                        "GQA 4/2, no attention bias, tied embeddings"),
    "gemma": dict(cfg=cfg_gemma, seed=106, style="v5",
                  notes="Gemma 1: RMSNorm scales by (1 + w), embeddings times sqrt(hidden) (cast to the weight "
                        "dtype), gelu_pytorch_tanh, head_dim 32, GQA 4/1 (MQA), tied embeddings"),
    "phi3": dict(cfg=cfg_phi3, seed=107, style="v5",
                 notes="fused qkv_proj rows [q (heads*hd) | k (kv*hd) | v (kv*hd)] with GQA 4/2; fused gate_up_proj "
                       "rows [gate | up] (chunk(2)); rope_parameters has partial_rotary_factor 1.0; untied"),
    "smollm2_like": dict(cfg=cfg_smollm2_like, seed=108, style="v5",
                         notes="llama, tied embeddings, rope theta 1e5, GQA 4/2, pad = eos"),
    "llama3_v4config": dict(weights_from="llama3_2", style="v4", v4_edit=to_v4_common, same_golden_as="llama3_2",
                            notes="llama3_2 with a 4.x config.json (rope_theta top-level, rope_scaling dict with "
                                  "rope_type llama3, torch_dtype); weights and golden identical to llama3_2"),
    "bf16_llama": dict(weights_from="llama2", style="v5", dtype=torch.bfloat16,
                       notes="llama2 weights stored in bfloat16; golden computed in float32 from the bf16-rounded "
                             "weights (loaded with dtype=float32)"),
    "sharded_llama": dict(weights_from="llama2", style="v5", shards=3, same_golden_as="llama2",
                          notes="llama2 saved in 4 shards + model.safetensors.index.json; golden identical to llama2"),
    "mistral_window": dict(cfg=cfg_mistral_window, seed=109, style="v5",
                           notes="sliding_window 5 (< the 16-token sequence): keys older than 5 positions are "
                                 "masked in every layer, also while decoding"),
    "qwen2_window_yarn": dict(cfg=cfg_qwen2_window_yarn, seed=110, style="v5",
                              notes="use_sliding_window true, sliding_window 5, max_window_layers 1 (layer 0 full, "
                                    "layer 1 windowed); rope_type yarn (factor 4, original 8, attention factor "
                                    "0.1 ln 4 + 1); q/k/v bias"),
    "phi3_longrope": dict(cfg=cfg_phi3_longrope, seed=111, style="v5",
                          notes="rope_type longrope (short/long factor lists over the rotary half-dimension, "
                                "original_max_position_embeddings 6, attention factor from 512 / 6), "
                                "partial_rotary_factor 0.75 of head_dim 16, GQA 2/1 in the fused qkv_proj"),
    "llama_linear_bias": dict(cfg=cfg_llama_linear_bias, seed=112, style="v5",
                              notes="rope_type linear (factor 2); attention_bias and mlp_bias: biases on q, k, v, o, "
                                    "gate, up and down"),
    "gemma2": dict(cfg=cfg_gemma2, seed=113, style="v5", embed_std=EMBED_STD_SANDWICH, grads=True,
                   notes="Gemma 2: post-attention, pre- and post-feedforward RMSNorms (1 + w), scale "
                         "query_pre_attn_scalar^-0.5 = 24^-0.5, attention scores softcapped at 3 and final logits at "
                         "2.5 (tanh), layer 0 sliding (window 5), layer 1 full, GQA 4/2, tied embeddings"),
    "vaultgemma": dict(cfg=cfg_vaultgemma, seed=132, style="v5", grads=True,
                       notes="VaultGemma: Gemma 2 without the post-norms (input_layernorm, pre_feedforward_layernorm "
                             "before the MLP), scale 24^-0.5, softcaps 3 and 2.5, layer 0 sliding (window 5), layer 1 "
                             "full, GQA 4/2, tied embeddings"),
    "gemma3": dict(cfg=cfg_gemma3, seed=114, style="v5", embed_std=EMBED_STD_SANDWICH, grads=True,
                   notes="Gemma 3 text (gemma3_text): Gemma 2's norms, per-head q_norm/k_norm (1 + w), scale 12^-0.5, "
                         "no softcapping; layer 0 sliding (window 5) with a local rope (theta 1e4), layer 1 full with "
                         "the global rope (theta 1e6, linear factor 8); rope_parameters per layer type"),
    "gemma3_v4config": dict(weights_from="gemma3", style="v4", v4_edit=to_v4_gemma3, same_golden_as="gemma3",
                            notes="gemma3 with a 4.x config.json: rope_theta, rope_local_base_freq, rope_scaling "
                                  "(linear 8) for the global layers, sliding_window_pattern 2 instead of layer_types; "
                                  "weights and golden identical to gemma3"),
    "gemma4": dict(cfg=cfg_gemma4, seed=135, style="v5", embed_std=EMBED_STD_SANDWICH, grads=True,
                   notes="Gemma 4 text (Gemma4ForCausalLM), dense: per-layer head sizes, attention_k_eq_v, "
                         "proportional rope, v norm, final softcap; layer_scalar buffers set"),
    "gemma4_e2b_like": dict(cfg=cfg_gemma4_e2b_like, seed=136, style="v5", embed_std=EMBED_STD_SANDWICH,
                            grads=True,
                            notes="Gemma 4 E-model shape: per-layer embeddings, KV sharing (2 layers), "
                                  "double-wide MLPs on the sharing layers, untied; layer_scalar buffers set"),
    "gemma4_moe": dict(cfg=cfg_gemma4_moe, seed=137, style="v5", embed_std=EMBED_STD_SANDWICH, grads=True,
                       notes="Gemma 4 MoE (26B-A4B shape): a dense MLP and 4 experts (top-2) side by side in every "
                             "layer, router with scale and per-expert scales, fused experts; attention_k_eq_v; "
                             "untied; router scales and layer_scalar buffers set"),
    "phi2": dict(cfg=cfg_phi2, seed=115, style="v5", grads=True,
                 notes="Phi-2 (phi): LayerNorm with bias (input_layernorm, final_layernorm), parallel attention + MLP "
                       "on one normed input, self_attn.dense, ungated mlp.fc1 -> gelu_new -> mlp.fc2, partial rotary "
                       "0.5 of head_dim 8, biases on every projection and on lm_head, GQA 4/2, untied"),
    "phi2_tied": dict(cfg=cfg_phi2_tied, seed=131, style="v5", grads=True,
                      notes="phi2 with tie_word_embeddings: lm_head.weight is the embedding, lm_head.bias "
                            "stays the head's own (the checkpoint holds lm_head.bias only); MHA"),
    "mixtral": dict(cfg=cfg_mixtral, seed=116, style="v5", grads=True,
                    notes="Mixtral: 4 experts (block_sparse_moe.experts.N.w1/w3/w2), router block_sparse_moe.gate, "
                          "top-2 routing renormalized in f32, GQA 4/2, untied"),
    "phimoe": dict(cfg=cfg_phimoe, seed=133, style="v5", grads=True,
                   notes="Phi-3.5-MoE (phimoe): LayerNorms with bias, q/k/v/o and lm_head bias, 4 experts "
                         "(block_sparse_moe.experts.N.w1/w3/w2) with sparsemixer routing (router_jitter_noise "
                         "0.3), longrope with short factors and long_mscale 1.3, GQA 4/2, untied"),
    "qwen3_moe": dict(cfg=cfg_qwen3_moe, seed=117, style="v5", grads=True,
                      notes="Qwen3-MoE: layer 0 dense (mlp_only_layers [0], intermediate 96), layer 1 sparse: 4 experts "
                            "(mlp.experts.N.gate_proj/up_proj/down_proj, moe_intermediate_size 24), router mlp.gate, "
                            "top-2 with norm_topk_prob; q/k norms, head_dim 16"),
    "qwen2_moe": dict(cfg=cfg_qwen2_moe, seed=118, style="v5", grads=True,
                      notes="Qwen2-MoE: 4 experts top-2 without renormalization, shared expert (intermediate 40) "
                            "times sigmoid(mlp.shared_expert_gate(x)); q/k/v bias"),
    "ministral": dict(cfg=cfg_ministral, seed=119, style="v5",
                      notes="Ministral: layer_types [sliding (window 5), full], head_dim 16, GQA 4/2"),
    "ministral3": dict(cfg=cfg_ministral3, seed=120, style="v5",
                       notes="Ministral 3: YaRN (factor 4, original 4) and llama_4_scaling_beta 0.3: queries at "
                             "position p scaled by 1 + 0.3 ln(1 + floor(p / 4)) after rope"),
    "smollm3": dict(cfg=cfg_smollm3, seed=121, style="v5",
                    notes="SmolLM3: no_rope_layers [1, 0] (layer 1 has no rotary embedding), tied, GQA 4/2"),
    "olmo2": dict(cfg=cfg_olmo2, seed=138, style="v5", grads=True,
                  notes="OLMo 2: no pre-norms, each block's output normalized before its residual add "
                        "(post_attention_layernorm, post_feedforward_layernorm); q_norm [32] / k_norm [16] are "
                        "RMSNorms over the whole q / k projection before the split into heads and rope; theta 5e5, "
                        "GQA 4/2, untied"),
    "llama4": dict(cfg=cfg_llama4, seed=134, style="v5", grads=True,
                   notes="Llama 4 text (llama4_text): no_rope_layers [1, 0, 1, 0]; RoPE layers with chunked attention "
                         "(chunk 6) and the L2 q/k norm after Meta's interleaved rotary pairs, NoPE layers with the "
                         "query temperature (floor_scale 4, attn_scale 0.5); MoE layers 1, 2: 4 experts top-1, "
                         "sigmoid score scaling the expert's input, fused feed_forward.experts.gate_up_proj "
                         "[E, hidden, 2 I] / down_proj [E, I, hidden], shared expert; dense layers 0, 3 "
                         "(intermediate_size_mlp 96); rope llama3 with low = high frequency factor; untied"),
    "deepseek_v3": dict(cfg=cfg_deepseek_v3, seed=139, style="v5", grads=True,
                        notes="DeepSeek-V3: MLA with q_a_proj/q_a_layernorm/q_b_proj, kv_a_proj_with_mqa (latent 12 + "
                              "rotary key 4), kv_a_layernorm, kv_b_proj (8 + 10 per head), interleaved rope, YaRN "
                              "(factor 4, original 8) with mscale_all_dim 0.8 in the softmax scale; layer 0 dense, "
                              "layers 1-2: 8 experts in 4 groups (top-2 groups), top-3, sigmoid scores with "
                              "e_score_correction_bias (set), norm_topk_prob, routed_scaling_factor 2.5, "
                              "2 shared experts; untied"),
    "deepseek_v2": dict(cfg=cfg_deepseek_v2, seed=140, style="v5", grads=True,
                        notes="DeepSeek-V2: MLA with a plain q_proj (q_lora_rank null), latent 16 + rotary key 8, "
                              "values (20) wider than keys (16), rope in adjacent pairs; layer 1: 4 experts, "
                              "softmax, group_limited_greedy (2 groups, 1 kept), top-2, scaling 1.5, 1 shared "
                              "expert; untied"),
    "gpt_oss": dict(cfg=cfg_gpt_oss, seed=141, style="v5", grads=True,
                    notes="gpt-oss: layers sliding (window 4) / full / sliding, attention sinks (self_attn.sinks), "
                          "q/k/v/o biases, 4 experts top-2 (router mlp.router with bias, softmax over the top-2 "
                          "logits), fused interleaved experts.gate_up_proj [E, hidden, 2 I] + biases, clamped SwiGLU "
                          "(limit 2.0, alpha 1.702, (up + 1) * glu), default YaRN rope (factor 32, original 4096, "
                          "truncate false, theta 1.5e5), head_dim 16, GQA 4/2, untied"),
    "qwen3_5": dict(cfg=cfg_qwen3_5, seed=142, style="v5", grads=True,
                    notes="Qwen3.5 text (qwen3_5_text, dense): layers 0-2 Gated DeltaNet (conv1d kernel 4, "
                          "2 key heads x 8 / 4 value heads x 16, A_log, dt_bias, gated RMSNorm), layer 3 gated "
                          "full attention (q_proj 2 x heads x head_dim, q/k norms, partial rotary 0.25, GQA 4/2, "
                          "head_dim 16); zero-centred RMSNorms; untied"),
    "qwen3_5_moe": dict(cfg=cfg_qwen3_5_moe, seed=143, style="v5", grads=True,
                        notes="Qwen3.5-MoE text (qwen3_5_moe_text): qwen3_5's layer pattern (0-2 Gated DeltaNet, 3 gated "
                              "full attention) with every MLP 4 experts (intermediate 16), softmax top-2 renormalized, "
                              "a shared expert (intermediate 24) gated by sigmoid(shared_expert_gate); untied"),
    "qwen3_next": dict(cfg=cfg_qwen3_next, seed=144, style="v5", grads=True,
                       notes="Qwen3-Next: layers 0-2 Gated DeltaNet with fused in_proj_qkvz / in_proj_ba (grouped per "
                             "key head; 2 key heads x 8, 4 value heads x 16), layer 3 gated full attention; layer 1 "
                             "dense (mlp_only_layers), the others 4 experts top-2 without renormalization plus a "
                             "gated shared expert; zero-centred RMSNorms; untied"),
    "qwen3_5_multimodal": dict(weights_from="qwen3_5", multimodal="qwen3_5", same_golden_as="qwen3_5", style="v5",
                               notes="Qwen3_5ForConditionalGeneration holding qwen3_5's text weights "
                                     "(model.language_model.*) and a tiny vision tower (model.visual.*); text-only "
                                     "logits equal qwen3_5's"),
    "qwen3_5_moe_multimodal": dict(weights_from="qwen3_5_moe", multimodal="qwen3_5_moe", same_golden_as="qwen3_5_moe",
                                   style="v5",
                                   notes="Qwen3_5MoeForConditionalGeneration holding qwen3_5_moe's text weights "
                                         "(model.language_model.*) and a tiny vision tower (model.visual.*); "
                                         "text-only logits equal qwen3_5_moe's"),
    "llama2_bin": dict(weights_from="llama2", style="v5", pickle="hf", same_golden_as="llama2",
                       notes="llama2 saved as PyTorch pickles: pytorch_model-0000{1,2}-of-00002.bin + "
                             "pytorch_model.bin.index.json (no safetensors); golden identical to llama2"),
    "llama2_meta": dict(weights_from="llama2", style="v5", pickle="meta", same_golden_as="llama2", rope_freqs=True,
                        params={"multiple_of": 32, "vocab_size": -1},
                        notes="llama2 in Meta's original format: consolidated.00.pth (Meta names, q/k rows in "
                              "interleaved rotary pairs, a rope.freqs buffer) + params.json (vocab_size -1, no "
                              "config.json); golden identical to llama2"),
    "llama3_1_meta": dict(cfg=cfg_llama3_1_meta, seed=122, style="v5", pickle="meta",
                          params={"ffn_dim_multiplier": 1.5, "multiple_of": 16, "rope_theta": 500000.0,
                                  "use_scaled_rope": True, "vocab_size": VOCAB},
                          notes="Meta format of a Llama 3.1-like model: GQA 4/2, use_scaled_rope (factor 8, "
                                "Meta's constants low 1 / high 4 / original 8192, theta 5e5), ffn_dim_multiplier, "
                                "untied output; golden from transformers on the equivalent HF model"),
    "llama3_2_meta": dict(cfg=cfg_llama3_2_meta, seed=123, style="v5", pickle="meta",
                          params={"ffn_dim_multiplier": 1.5, "multiple_of": 16, "rope_theta": 500000.0,
                                  "use_scaled_rope": True, "vocab_size": VOCAB},
                          notes="Meta format of a Llama 3.2-like model: output.weight stored equal to "
                                "tok_embeddings (tied), which makes the rope factor 32 as Llama 3.2's; golden "
                                "from transformers on the equivalent HF model"),
    "mistral3_multimodal": dict(weights_from="mistral", multimodal="mistral3", same_golden_as="mistral", style="v4",
                                notes="Mistral3ForConditionalGeneration (model_type mistral3) holding mistral's text "
                                      "weights (language_model.model.*, language_model.lm_head.*) and a tiny Pixtral "
                                      "vision tower, untied; text-only logits equal mistral's"),
    "qwen2_5_vl_multimodal": dict(weights_from="qwen2_5", multimodal="qwen2_5_vl", same_golden_as="qwen2_5",
                                  style="v4",
                                  notes="Qwen2_5_VLForConditionalGeneration holding qwen2_5's text weights (model.layers.*, "
                                        "lm_head.weight) and a tiny vision tower (visual.*); config as the Hub's: text keys "
                                        "at the top level, rope_scaling {type: mrope, mrope_section}; text-only logits "
                                        "equal qwen2_5's"),
    "qwen3_vl_multimodal": dict(weights_from="qwen3", multimodal="qwen3_vl", same_golden_as="qwen3", style="v5",
                                notes="Qwen3VLForConditionalGeneration holding qwen3's text weights "
                                      "(model.language_model.*), tied, and a tiny vision tower (model.visual.*); "
                                      "text_config with interleaved mrope; text-only logits equal qwen3's"),
    "mllama_multimodal": dict(weights_from="llama3_1_meta", multimodal="mllama", same_golden_as="llama3_1_meta",
                              style="v4",
                              notes="MllamaForConditionalGeneration (Llama 3.2 Vision, model_type mllama): 4 text layers "
                                    "of which 0 and 2 are cross-attention layers (random weights, skipped on text "
                                    "alone) and 1, 3 hold llama3_1_meta's layers 0, 1; the embedding has 8 random rows "
                                    "past vocab_size (image tokens); 4.x names (language_model.model.*, "
                                    "language_model.lm_head.*, vision_model.*), a tiny vision tower; text-only logits "
                                    "equal llama3_1_meta's"),
    "mllama_text_model": dict(weights_from="llama3_1_meta", multimodal="mllama_text", same_golden_as="llama3_1_meta",
                              style="v5",
                              notes="MllamaForCausalLM (model_type mllama_text_model, Llama 3.2 Vision's text model "
                                    "alone): mllama_multimodal's text weights, model.layers.* with cross-attention "
                                    "layers 0 and 2; logits equal llama3_1_meta's"),
    "llama4_multimodal": dict(weights_from="llama4", multimodal="llama4", same_golden_as="llama4", style="v4",
                              notes="Llama4ForConditionalGeneration (model_type llama4, as Llama 4 Scout / Maverick "
                                    "ship) holding llama4's text weights (language_model.model.*, "
                                    "language_model.lm_head.*) and a tiny vision tower (vision_model.*, "
                                    "multi_modal_projector.*); text-only logits equal llama4's"),
    "gemma4_multimodal": dict(weights_from="gemma4_e2b_like", multimodal="gemma4", same_golden_as="gemma4_e2b_like",
                              style="v5",
                              notes="Gemma4ForConditionalGeneration (model_type gemma4) holding gemma4_e2b_like's text "
                                    "weights (model.language_model.*, per-layer embeddings and layer_scalar buffers "
                                    "included), its own lm_head, a tiny vision tower (model.vision_tower.*, "
                                    "model.embed_vision.*); text-only logits equal gemma4_e2b_like's"),
    "gemma4_moe_multimodal": dict(weights_from="gemma4_moe", multimodal="gemma4", same_golden_as="gemma4_moe",
                                  style="v5",
                                  notes="Gemma4ForConditionalGeneration holding gemma4_moe's text weights, as the "
                                        "26B-A4B ships (model.language_model.layers.N.experts.*, router.*), its own "
                                        "lm_head, a tiny vision tower; text-only logits equal gemma4_moe's"),
    "gemma3_multimodal": dict(weights_from="gemma3", multimodal="gemma3", same_golden_as="gemma3", style="v4",
                              notes="Gemma3ForConditionalGeneration (model_type gemma3) with gemma3's text weights under "
                                    "language_model.model.* and a tiny SigLIP vision tower; text_config written as a "
                                    "diff against Gemma3TextConfig's defaults (as the Hub's gemma-3-*-it configs); "
                                    "text-only logits equal gemma3's"),
}


# --------------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------------


@torch.no_grad()
def init_weights(model, seed: int, gemma_norm: bool, embed_std: float | None = None):
    """Deterministic, deliberately non-trivial weights (independent of transformers' own init)."""
    g = torch.Generator().manual_seed(seed)
    tied = model.config.tie_word_embeddings
    for name, p in model.named_parameters():  # tied lm_head is listed once (as embed_tokens)
        shape = tuple(p.shape)
        r = torch.randn(shape, generator=g, dtype=torch.float32)
        if name.endswith("linear_attn.norm.weight"):
            p.copy_(1.0 + NORM_PERTURB * r)  # Qwen3.5's gated norm multiplies by w (init 1)
        elif name.endswith("linear_attn.conv1d.weight"):
            p.copy_(0.5 * r)  # depthwise kernel [channels, 1, kernel]
        elif name.endswith(("linear_attn.A_log", "linear_attn.dt_bias")):
            p.copy_(0.5 * r)
        elif "norm" in name and name.endswith(".bias"):
            p.copy_(0.1 * r)  # LayerNorm bias (Phi-2)
        elif "norm" in name:
            # Gemma's RMSNorm multiplies by (1 + w) with w initialised to 0; the others by w (init 1).
            p.copy_(NORM_PERTURB * r if gemma_norm else 1.0 + NORM_PERTURB * r)
        elif name.endswith(".bias"):
            p.copy_(0.1 * r)
        elif name.endswith(("router.scale", "router.per_expert_scale")):
            # Gemma 4's router scales (init 1): perturbed so that one left out shows.
            p.copy_(1.0 + 0.3 * r)
        elif "embed_tokens" in name:
            # Small next to what the layers add: with tied embeddings a dominant residual e_t makes the model
            # predict its own input token forever (a useless greedy golden).
            p.copy_((embed_std or (EMBED_STD_TIED if tied else EMBED_STD)) * r)
        elif name.startswith("lm_head"):
            p.copy_(LM_HEAD_GAIN * r / shape[1] ** 0.5)
        elif name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
            p.copy_(0.1 * r)  # gpt-oss's expert biases
        elif name.endswith("self_attn.sinks"):
            # gpt-oss's attention sinks (one logit per head), of the scores' size so that they take a real share
            p.copy_(r)
        elif model.config.model_type in ("llama4_text", "gpt_oss") and name.endswith(("experts.gate_up_proj",
                                                                                      "experts.down_proj")):
            # Llama 4 and gpt-oss hold their experts as [experts, in, out]: fan-in is the middle dim
            gain = OUT_GAIN if name.endswith("down_proj") else IN_GAIN
            p.copy_(gain * r / shape[1] ** 0.5)
        elif name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj", "out_proj.weight")):
            # transformers 5 holds MoE experts as 3D [experts, out, in] parameters: fan-in is the last dim
            p.copy_(OUT_GAIN * r / shape[-1] ** 0.5)
        else:
            assert p.dim() == 2 or name.endswith("experts.gate_up_proj"), name
            p.copy_(IN_GAIN * r / shape[-1] ** 0.5)


@torch.no_grad()
def init_buffers(model, seed: int):
    """Gemma 4's `layer_scalar` buffers (1 at init) and DeepSeek-V3's `e_score_correction_bias` (0) get values of
    their own, so that a decoder that ignores them shows."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, b in model.named_buffers():
        if name.endswith("layer_scalar"):
            b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=g))
        elif name.endswith("e_score_correction_bias"):
            # DeepSeek-V3's routing bias (0 at init) picks experts: set, so that one left out shows.
            b.copy_(0.2 * torch.randn(b.shape, generator=g))


def build_model(case: str):
    spec = CASES[case]
    src = spec.get("weights_from", case)
    src_spec = CASES[src]
    config = src_spec["cfg"]()
    config.architectures = None
    torch.manual_seed(src_spec["seed"])
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Gemma 4's norms multiply by the weight itself (init 1), the earlier Gemmas' by 1 + weight.
    gemma_norm = (config.model_type.startswith("gemma") and config.model_type != "gemma4_text") \
        or config.model_type in ("vaultgemma", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
    init_weights(model, src_spec["seed"], gemma_norm=gemma_norm, embed_std=src_spec.get("embed_std"))
    init_buffers(model, src_spec["seed"])
    model.eval()
    return model


# --------------------------------------------------------------------------------------------------------
# Goldens
# --------------------------------------------------------------------------------------------------------


def case_inputs(case: str, attempt: int):
    spec = CASES[case]
    key = spec.get("same_golden_as", spec.get("weights_from", case))
    seed = (zlib.crc32(key.encode()) + 7919 * attempt) & 0x7FFFFFFF
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, VOCAB, (BATCH, SEQ), generator=g)  # no special tokens
    labels = input_ids.clone()
    labels[:, :IGNORED_LABEL_POSITIONS] = -100
    return input_ids, labels


@torch.no_grad()
def greedy(model, prompt: list[int]):
    """Greedy continuation via generate() (KV cache), cross-checked against a cache-free argmax loop."""
    # NB: eos_token_id=None must be passed as a kwarg. Inside a GenerationConfig(eos_token_id=None) the None
    # counts as "unset" and the model's generation_config eos is used (generation stops, then pads).
    # min_new_tokens is not used either: it works by masking eos logits, which changes the argmax.
    gen = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        num_beams=1,
        max_new_tokens=NEW_TOKENS,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    new = gen[0, len(prompt):].tolist()
    assert len(new) == NEW_TOKENS, (len(new), new)
    seq = list(prompt)
    margins = []
    for _ in range(NEW_TOKENS):
        last = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
        top2 = torch.topk(last, 2)
        margins.append(float(top2.values[0] - top2.values[1]))
        seq.append(int(top2.indices[0]))
    assert seq[len(prompt):] == new, f"generate() {new} != argmax loop {seq[len(prompt):]}"
    return new, min(margins)


@torch.no_grad()
def compute_golden(model, case: str):
    best = None
    for attempt in range(MAX_INPUT_ATTEMPTS):
        input_ids, labels = case_inputs(case, attempt)
        prompt = input_ids[0, :PROMPT_LEN].tolist()
        new, margin = greedy(model, prompt)
        if margin >= MIN_GREEDY_MARGIN and len(set(new)) >= MIN_GREEDY_DISTINCT:
            break
        score = (len(set(new)) >= MIN_GREEDY_DISTINCT, margin)
        if best is None or score > best[0]:
            best = (score, attempt, input_ids, labels, prompt, new, margin)
    else:
        print(f"warning: {case}: no prompt met the greedy criteria, using the best one", file=sys.stderr)
        _, attempt, input_ids, labels, prompt, new, margin = best
    out = model(input_ids=input_ids, labels=labels)
    return dict(
        attempt=attempt,
        input_ids=input_ids,
        labels=labels,
        logits=out.logits.float().contiguous(),
        loss=float(out.loss),
        prompt=prompt,
        new=new,
        margin=margin,
    )


# --------------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------------


def dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def weights_size(model_dir: Path) -> int:
    return sum(f.stat().st_size for f in model_dir.iterdir() if f.suffix in (".safetensors", ".bin", ".pth"))


def gemma3_hub_text_config(text: dict) -> dict:
    """Gemma 3's text_config as the Hub's gemma-3-*-it configs hold it: only the keys that differ from
    Gemma3TextConfig's defaults, rope in 4.x style."""
    text = dict(text)
    rp = text.pop("rope_parameters")
    full, local = dict(rp["full_attention"]), dict(rp["sliding_attention"])
    text["rope_theta"] = full.pop("rope_theta")
    text["rope_local_base_freq"] = local.pop("rope_theta")
    text["rope_scaling"] = None if full.get("rope_type", "default") == "default" else full
    text["sliding_window_pattern"] = text.pop("layer_types").index("full_attention") + 1
    text.pop("_sliding_window_pattern", None)
    defaults = Gemma3TextConfig().to_dict()
    defaults_v4 = {"rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "rope_scaling": None,
                   "sliding_window_pattern": 6}
    diff = {k: v for k, v in text.items()
            if k == "model_type" or v != defaults_v4.get(k, defaults.get(k, object()))}
    return dict(sorted(diff.items()))


def write_multimodal(case: str, out_root: Path, golden_cache: dict):
    """A multimodal model (Gemma3ForConditionalGeneration with a tiny SigLIP tower, or
    Mistral3ForConditionalGeneration with a tiny Pixtral tower) whose text model holds the `weights_from`
    case's weights. Gemma 3's config is written the way the Hub's gemma-3-*-it configs are: text_config keeps
    only the keys that differ from Gemma3TextConfig's defaults (rope in 4.x style), so a loader must fill the
    rest from those defaults. The golden is the text case's: on text-only input the multimodal model's logits
    must equal it (checked here)."""
    from transformers import (Gemma3Config, Gemma3ForConditionalGeneration, Mistral3Config,
                              Mistral3ForConditionalGeneration, PixtralVisionConfig, SiglipVisionConfig)

    spec = CASES[case]
    kind = spec["multimodal"]
    src = spec["weights_from"]
    text_model = build_model(src)
    case_dir = out_root / case
    if case_dir.exists():
        shutil.rmtree(case_dir)
    model_dir = case_dir / "model"
    model_dir.mkdir(parents=True)

    text_cfg = text_model.config
    if kind == "gemma3":
        vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                    image_size=28, patch_size=14)
        cfg = Gemma3Config(text_config=text_cfg.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                           image_token_index=VOCAB - 3, boi_token_index=VOCAB - 2, eoi_token_index=VOCAB - 1,
                           bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
        mm_class = Gemma3ForConditionalGeneration
    elif kind in ("qwen2_5_vl", "qwen3_vl"):
        from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen3VLConfig,
                                  Qwen3VLForConditionalGeneration)
        text = text_cfg.to_dict()
        for k in ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype"):
            text.pop(k, None)
        half = text_cfg.head_dim // 2 if getattr(text_cfg, "head_dim", None) else \
            text_cfg.hidden_size // text_cfg.num_attention_heads // 2
        rope = dict(text_cfg.rope_parameters)
        if kind == "qwen2_5_vl":
            rope["mrope_section"] = [1, 1, half - 2]
            text["rope_parameters"] = rope
            cfg = Qwen2_5_VLConfig(text_config=text, vision_config=dict(
                depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text_cfg.hidden_size,
                fullatt_block_indexes=[0]), tie_word_embeddings=text_cfg.tie_word_embeddings)
            mm_class = Qwen2_5_VLForConditionalGeneration
        else:
            rope["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
            rope["mrope_interleaved"] = True
            text["rope_parameters"] = rope
            cfg = Qwen3VLConfig(text_config=text, vision_config=dict(
                depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text_cfg.hidden_size,
                deepstack_visual_indexes=[0]), tie_word_embeddings=text_cfg.tie_word_embeddings)
            mm_class = Qwen3VLForConditionalGeneration
    elif kind in ("qwen3_5", "qwen3_5_moe"):
        from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                                  Qwen3_5MoeForConditionalGeneration)
        text = text_cfg.to_dict()
        for k in ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype"):
            text.pop(k, None)
        # As the Hub's Qwen3.5 configs: interleaved mrope sections (text-only positions make it plain RoPE).
        text["rope_parameters"] = dict(text_cfg.rope_parameters, mrope_section=[11, 11, 10], mrope_interleaved=True)
        cfg_class, mm_class = (Qwen3_5Config, Qwen3_5ForConditionalGeneration) if kind == "qwen3_5" else \
            (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration)
        cfg = cfg_class(text_config=text, vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text_cfg.hidden_size,
            num_position_embeddings=16), tie_word_embeddings=text_cfg.tie_word_embeddings)
    elif kind in ("mllama", "mllama_text"):
        from transformers import MllamaConfig, MllamaForCausalLM, MllamaForConditionalGeneration, MllamaTextConfig
        text = text_cfg.to_dict()
        for k in ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype", "head_dim",
                  "attention_bias", "mlp_bias", "attention_dropout", "pretraining_tp"):
            text.pop(k, None)
        text.update(num_hidden_layers=2 * text_cfg.num_hidden_layers, cross_attention_layers=[0, 2])
        if kind == "mllama":
            cfg = MllamaConfig(text_config=text, vision_config=dict(
                hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                image_size=28, patch_size=14, max_num_tiles=1, vision_output_dim=32,
                intermediate_layers_indices=[0], supported_aspect_ratios=[[1, 1]]), image_token_index=VOCAB + 1)
            mm_class = MllamaForConditionalGeneration
        else:
            cfg = MllamaTextConfig(**text)
            mm_class = MllamaForCausalLM
    elif kind == "llama4":
        from transformers import Llama4Config, Llama4ForConditionalGeneration
        text = text_cfg.to_dict()
        for k in ("architectures", "transformers_version", "dtype", "torch_dtype"):
            text.pop(k, None)
        cfg = Llama4Config(text_config=text, vision_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
            patch_size=14, vision_output_dim=32, projector_input_dim=16, projector_output_dim=16,
            pixel_shuffle_ratio=0.5), image_token_index=VOCAB - 3, boi_token_index=VOCAB - 2,
            eoi_token_index=VOCAB - 1, tie_word_embeddings=False)
        mm_class = Llama4ForConditionalGeneration
    elif kind == "gemma4":
        from transformers import Gemma4Config, Gemma4ForConditionalGeneration
        text = text_cfg.to_dict()
        for k in ("architectures", "transformers_version", "dtype", "torch_dtype"):
            text.pop(k, None)
        cfg = Gemma4Config(text_config=text, vision_config=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            head_dim=8), audio_config=None, tie_word_embeddings=text_cfg.tie_word_embeddings)
        mm_class = Gemma4ForConditionalGeneration
    else:
        vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     image_size=28, patch_size=14, head_dim=8)
        # Untied like Mistral Small 3.x: the top-level flag is the one transformers 5 ties on.
        cfg = Mistral3Config(text_config=text_cfg.to_dict(), vision_config=vision.to_dict(),
                             image_token_index=VOCAB - 3, tie_word_embeddings=False)
        mm_class = Mistral3ForConditionalGeneration
    torch.manual_seed(0)
    mm = mm_class(cfg).eval()
    with torch.no_grad():
        if kind in ("mllama", "mllama_text"):
            # The text layers sit after each cross-attention layer (1, 3); the embedding keeps its 8 rows
            # past the vocabulary (image tokens) random.
            language = mm.model if kind == "mllama_text" else mm.model.language_model
            g = torch.Generator().manual_seed(7)
            for p in language.parameters():
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            for name, t in text_model.model.state_dict().items():
                if name.startswith("layers."):
                    i, rest = name[len("layers."):].split(".", 1)
                    name = f"layers.{2 * int(i) + 1}.{rest}"
                target = language.get_parameter(name)
                target[: t.shape[0]].copy_(t)
            mm.lm_head.weight.copy_(text_model.lm_head.weight)
        else:
            language = mm.language_model.model if kind == "llama4" else mm.model.language_model
            missing, unexpected = language.load_state_dict(text_model.model.state_dict(), strict=True)
            assert not missing and not unexpected
            if not text_cfg.tie_word_embeddings:
                head = mm.language_model.lm_head if kind == "llama4" else mm.lm_head
                head.weight.copy_(text_model.lm_head.weight)
    mm.save_pretrained(model_dir)
    for f in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / f, model_dir / f)

    cfg_path = model_dir / "config.json"
    saved = json.loads(cfg_path.read_text())
    if kind == "gemma3":
        saved["text_config"] = gemma3_hub_text_config(saved["text_config"])
    if kind == "qwen2_5_vl":
        # As the Hub's Qwen2.5-VL configs: the text model's keys at the top level, rope in 4.x style
        # with the `mrope` type.
        text = saved.pop("text_config")
        rope = text.pop("rope_parameters")
        for k in ("model_type", "architectures", "dtype", "torch_dtype"):
            text.pop(k, None)
        saved.update(text)
        saved["rope_theta"] = rope.pop("rope_theta")
        saved["rope_scaling"] = {"type": "mrope", "mrope_section": rope["mrope_section"]}
    if kind in ("mllama", "llama4"):
        # As the Hub's Llama 3.2 Vision and Llama 4 configs: the text model's rope in 4.x style.
        text = saved["text_config"]
        rope = text.pop("rope_parameters")
        text["rope_theta"] = rope.pop("rope_theta")
        text["rope_scaling"] = rope
    if "dtype" in saved:
        saved["torch_dtype"] = saved.pop("dtype")
    saved["transformers_version"] = "4.50.0"
    cfg_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")

    loaded = mm_class.from_pretrained(model_dir, dtype=torch.float32).eval()
    other = golden_cache.get(spec["same_golden_as"]) or \
        load_file(str(out_root / spec["same_golden_as"] / "golden.safetensors"))
    ref = json.loads((out_root / spec["same_golden_as"] / "golden.json").read_text())
    with torch.no_grad():
        logits = loaded(input_ids=torch.tensor(ref["input_ids"])).logits.float()
    err = (logits - other["logits"]).abs().max().item()
    assert err <= 1e-5, f"{case}: multimodal logits differ from {spec['same_golden_as']} by {err}"
    golden = dict(ref)
    golden.update(model_type=loaded.config.model_type, architecture=loaded.__class__.__name__, config_style="v4",
                  weights_from=src, notes=spec.get("notes", ""))
    (case_dir / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    save_file({"logits": other["logits"]}, str(case_dir / "golden.safetensors"))
    for f in case_dir.rglob("*"):
        f.chmod(0o644 if f.is_file() else 0o755)
    return {"case": case, "model_type": kind, "style": "v4", "dtype": "float32",
            "n_weight_files": 1, "weights_kb": weights_size(model_dir) / 1024, "total_kb": dir_size(case_dir) / 1024,
            "loss": ref["loss"], "logit_std": float(logits.std()), "margin": ref["greedy_min_top2_margin"],
            "greedy": ref["greedy_new_tokens"]}


def write_case(case: str, out_root: Path, golden_cache: dict):
    spec = CASES[case]
    if spec.get("multimodal"):
        return write_multimodal(case, out_root, golden_cache)
    case_dir = out_root / case
    if case_dir.exists():
        shutil.rmtree(case_dir)
    model_dir = case_dir / "model"
    model_dir.mkdir(parents=True)

    model = build_model(case)
    ref_state = {k: v.clone() for k, v in model.state_dict().items()}

    dtype = spec.get("dtype", torch.float32)
    save_kw = {}
    if spec.get("shards"):
        total = sum(v.numel() * v.element_size() for v in model.state_dict().values())
        save_kw["max_shard_size"] = total // (spec["shards"] + 1)
    model.to(dtype).save_pretrained(model_dir, **save_kw)

    for f in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / f, model_dir / f)

    cfg_path = model_dir / "config.json"
    saved_cfg = json.loads(cfg_path.read_text())
    if spec.get("v4_edit"):
        assert "rope_parameters" in saved_cfg and "rope_theta" not in saved_cfg, "expected a 5.x-style config"
        cfg_path.write_text(json.dumps(spec["v4_edit"](saved_cfg), indent=2, sort_keys=True) + "\n")

    if spec.get("shards"):
        shards = sorted(model_dir.glob("model-*-of-*.safetensors"))
        assert len(shards) >= spec["shards"], f"only {len(shards)} shards"
        assert (model_dir / "model.safetensors.index.json").exists()
        assert not (model_dir / "model.safetensors").exists()

    # Reload exactly what was written and compute goldens from it (bf16 weights are upcast to f32 here).
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loaded.eval()
    lc = loaded.config
    if spec.get("v4_edit"):
        assert "rope_theta" in json.loads(cfg_path.read_text())
        ref_rp = saved_cfg["rope_parameters"]
        assert lc.rope_parameters == ref_rp, (lc.rope_parameters, ref_rp)
    for k, v in loaded.state_dict().items():
        expect = ref_state[k].to(dtype).float() if k in ref_state else None
        if expect is not None:
            assert torch.equal(v, expect), f"{case}: reloaded {k} differs"

    gd = compute_golden(loaded, case)
    if spec.get("pickle"):
        write_pickles(case, model_dir, loaded.config)
    input_ids, labels, logits, loss = gd["input_ids"], gd["labels"], gd["logits"], gd["loss"]
    prompt, new, margin = gd["prompt"], gd["new"], gd["margin"]

    if spec.get("same_golden_as"):
        other = golden_cache.get(spec["same_golden_as"])
        if other is not None:
            assert torch.equal(other["logits"], logits), f"{case}: logits differ from {spec['same_golden_as']}"
            assert other["greedy_new_tokens"] == new and other["loss"] == loss

    golden = {
        "model_type": lc.model_type,
        "architecture": loaded.__class__.__name__,
        "config_style": spec["style"],
        "weights_dtype": str(dtype).replace("torch.", ""),
        "input_ids": input_ids.tolist(),
        "labels": labels.tolist(),
        "loss": loss,
        "greedy_prompt": prompt,
        "greedy_new_tokens": new,
        "greedy_min_top2_margin": margin,
        "input_seed_attempt": gd["attempt"],
        "reference": {
            "transformers": transformers.__version__,
            "torch": torch.__version__.split("+")[0],
            "device": "cpu",
            "compute_dtype": "float32",
            "attn_implementation": loaded.config._attn_implementation,
        },
    }
    if spec.get("weights_from"):
        golden["weights_from"] = spec["weights_from"]
    golden["notes"] = spec.get("notes", "")
    (case_dir / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")
    save_file({"logits": logits}, str(case_dir / "golden.safetensors"))
    if spec.get("grads"):
        # Full fine-tuning gradients of the golden loss for every parameter (a tied head is the embedding).
        loaded.zero_grad()
        loaded(input_ids=input_ids, labels=labels).loss.backward()
        # Written through save_pretrained, so that the gradients carry the checkpoint's tensor names (MoE
        # experts are 3D parameters in memory but per-expert matrices on disk).
        with torch.no_grad():
            for _, p in loaded.named_parameters():
                p.copy_(p.grad)
        grad_dir = case_dir / "grads_tmp"
        loaded.save_pretrained(grad_dir)
        # Buffers (Gemma 4's layer_scalar) are saved with the parameters but are not trained.
        buffers = {k for k, _ in loaded.named_buffers()}
        grads = {k: v.float().contiguous() for k, v in load_file(str(grad_dir / "model.safetensors")).items()
                 if k not in buffers}
        shutil.rmtree(grad_dir)
        save_file(grads, str(case_dir / "grads.safetensors"))

    for f in case_dir.rglob("*"):
        f.chmod(0o644 if f.is_file() else 0o755)  # safetensors writes 0600 files

    golden_cache[case] = {"logits": logits, "loss": loss, "greedy_new_tokens": new}
    return {
        "case": case,
        "model_type": lc.model_type,
        "style": spec["style"],
        "dtype": golden["weights_dtype"],
        "n_weight_files": len([f for f in model_dir.iterdir() if f.suffix in (".safetensors", ".bin", ".pth")]),
        "weights_kb": weights_size(model_dir) / 1024,
        "total_kb": dir_size(case_dir) / 1024,
        "loss": loss,
        "logit_std": float(logits.std()),
        "margin": margin,
        "greedy": new,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "models"))
    ap.add_argument("--only", nargs="*", help="cases to (re)generate (default: all)")
    args = ap.parse_args()

    torch.set_num_threads(min(2, torch.get_num_threads()))
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    out_root = Path(args.out)
    out_root.mkdir(parents=True, exist_ok=True)

    wanted = args.only or list(CASES)
    unknown = [c for c in wanted if c not in CASES]
    if unknown:
        sys.exit(f"unknown case(s): {unknown}; known: {list(CASES)}")
    # generate the cases that others compare against first (those not on disk yet)
    order = [c for c in CASES if c in wanted or any(CASES[w].get("same_golden_as") == c for w in wanted)
             and not (out_root / c / "golden.safetensors").is_file()]

    golden_cache: dict = {}
    rows = []
    for case in order:
        row = write_case(case, out_root, golden_cache)
        if case in wanted:
            rows.append(row)

    hdr = f"{'case':<16} {'model_type':<10} {'cfg':<3} {'dtype':<8} {'files':>5} {'weights':>9} {'total':>9} {'loss':>7} {'lstd':>5} {'margin':>6}  greedy_new_tokens"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(
            f"{r['case']:<16} {r['model_type']:<10} {r['style']:<3} {r['dtype']:<8} {r['n_weight_files']:>5} "
            f"{r['weights_kb']:>7.1f}KB {r['total_kb']:>7.1f}KB {r['loss']:>7.4f} {r['logit_std']:>5.2f} {r['margin']:>6.3f}  "
            f"{' '.join(map(str, r['greedy']))}"
        )
    print(f"\ntotal {dir_size(out_root) / 1024:.1f} KB in {out_root}")


if __name__ == "__main__":
    main()
