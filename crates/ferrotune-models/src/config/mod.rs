//! Model configuration: one description for every supported family, read from HF `config.json`
//! (transformers 4.x `rope_theta`/`rope_scaling` and 5.x `rope_parameters` alike) or GGUF metadata.
//!
//! Families differ only by the switches in [`ModelConfig`]; the decoder has no per-family code.
//! This module holds the description and the key readers every family shares (`hf`); reading a
//! `config.json` ([`ModelConfig::from_hf_json`]) lives with the families' registry, in
//! [`crate::family::read`], since each family reads its own keys.

use serde_json::Value;

pub(crate) mod hf;
pub mod layers;
mod ranges;

/// A sparse mixture-of-experts MLP's settings (Mixtral, Qwen2-MoE, Qwen3-MoE).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    /// Experts per sparse layer (`num_local_experts` / `num_experts`).
    pub num_experts: usize,
    /// Experts each token is routed to (`num_experts_per_tok`).
    pub top_k: usize,
    /// The top-k routing weights are renormalized to sum to 1 (Mixtral always; Qwen's
    /// `norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Each expert's intermediate size (Mixtral: `intermediate_size`; Qwen:
    /// `moe_intermediate_size`).
    pub expert_intermediate_size: usize,
    /// The always-on shared expert's intermediate size: Qwen2-MoE's
    /// (`shared_expert_intermediate_size`, scaled by `sigmoid(shared_expert_gate(x))`) or Llama
    /// 4's (`intermediate_size`, added as it is).
    pub shared_expert_intermediate_size: Option<usize>,
    /// Llama 4's routing: the top-k router *logits* go through a sigmoid (in f32) and scale each
    /// chosen expert's input, not its output; no softmax, no renormalization, no shared-expert
    /// gate.
    pub sigmoid_input_routing: bool,
    /// Mixtral scales expert outputs by f32 routing weights; Qwen casts them to the compute
    /// dtype first.
    pub f32_routing_weights: bool,
    /// Mixtral's module names (`block_sparse_moe`, experts' `w1` / `w3` / `w2`) instead of Qwen's
    /// (`mlp`, `gate_proj` / `up_proj` / `down_proj`).
    pub mixtral_names: bool,
    /// Per layer: whether it is sparse (Qwen's `decoder_sparse_step` and `mlp_only_layers` leave
    /// some layers dense).
    pub sparse_layers: Vec<bool>,
    /// Phi-3.5-MoE routes with the sparsemixer instead of a softmax top-k (see [`SparseMixer`]).
    pub sparse_mixer: Option<SparseMixer>,
}

/// The Gated DeltaNet's shapes and which layers have one (Qwen3.5, Qwen3-Next).
#[derive(Debug, Clone, PartialEq)]
pub struct DeltaNetConfig {
    /// Per layer: linear attention (a Gated DeltaNet) instead of self-attention.
    pub layers: Vec<bool>,
    /// `linear_num_key_heads`.
    pub key_heads: usize,
    /// `linear_num_value_heads`.
    pub value_heads: usize,
    /// `linear_key_head_dim`.
    pub key_head_dim: usize,
    /// `linear_value_head_dim`.
    pub value_head_dim: usize,
    /// `linear_conv_kernel_dim`.
    pub conv_kernel: usize,
    /// Qwen3-Next's fused projections (`in_proj_qkvz`, `in_proj_ba`, grouped by key head)
    /// instead of Qwen3.5's four.
    pub fused_projections: bool,
}

impl DeltaNetConfig {
    /// The width of the convolved projection: queries, keys, values.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim
    }
}

/// Multi-head latent attention's shapes (DeepSeek-V2/V3, transformers' `DeepseekV3Attention`):
/// queries from `q_proj` or the low-rank `q_a_proj` → `q_a_layernorm` → `q_b_proj`; keys and
/// values from one compressed latent (`kv_a_proj_with_mqa` → `kv_a_layernorm` → `kv_b_proj`) plus a
/// rotary key shared by every head. [`crate::config::ModelConfig::head_dim`] is the rotary part's
/// size (`qk_rope_head_dim`), as transformers sets it.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    /// `q_lora_rank`: the queries' low-rank width; `None` for a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// `kv_lora_rank`: the compressed key/value latent's width (what generation caches).
    pub kv_lora_rank: usize,
    /// `qk_nope_head_dim`: each head's query/key part without rotary embedding.
    pub qk_nope_head_dim: usize,
    /// `qk_rope_head_dim`: each head's rotary query part and the shared rotary key.
    pub qk_rope_head_dim: usize,
    /// `v_head_dim`: each head's value size (may differ from the query/key size).
    pub v_head_dim: usize,
    /// The factor on attention scores: `(qk_nope + qk_rope)^-0.5`, times YaRN's `mscale²` where
    /// the rope parameters give `mscale_all_dim`.
    pub softmax_scale: f64,
    /// The rotary dimensions come in adjacent pairs (`rope_interleave`; always in DeepSeek-V2).
    pub rope_interleave: bool,
}

impl MlaConfig {
    /// Each head's query/key size.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }
}

/// How a router scores its experts under group-limited routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RouterScoring {
    /// DeepSeek-V3: a sigmoid of each logit; the choice adds `e_score_correction_bias`.
    Sigmoid,
    /// DeepSeek-V2: a softmax over the experts.
    Softmax,
}

/// Group-limited routing (DeepSeek-V2/V3): the experts fall into `n_group` groups; each token
/// keeps its `topk_group` best groups and picks its `top_k` experts among theirs.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupedRouting {
    /// How logits become scores.
    pub scoring: RouterScoring,
    /// `n_group` (1: no group limit).
    pub n_group: usize,
    /// `topk_group`: groups kept per token.
    pub topk_group: usize,
    /// A group's score is the sum of its two best scores (DeepSeek-V3), else its best score
    /// (DeepSeek-V2's `group_limited_greedy`).
    pub group_sum_top2: bool,
    /// The choice uses the scores plus the router's `e_score_correction_bias` buffer (V3); the
    /// weights are the scores without it.
    pub correction_bias: bool,
    /// The chosen scores are divided by their sum (plus 1e-20) before the scaling (V3's
    /// `norm_topk_prob`; V2 never does).
    pub norm_topk_prob: bool,
    /// `routed_scaling_factor`, on every routing weight.
    pub routed_scaling_factor: f64,
}

/// gpt-oss's mixture of experts (`GptOssMLP`): a router with a bias whose top-k *logits* are
/// softmaxed (in the compute dtype), and fused experts with biases whose gate and up columns are
/// interleaved, through the clamped SwiGLU `(clamp(up, ±limit) + 1) · g · σ(α · g)`,
/// `g = min(gate, limit)`. Each expert's intermediate size is the config's `intermediate_size`.
#[derive(Debug, Clone, PartialEq)]
pub struct GptOssMoeConfig {
    /// `num_local_experts`.
    pub num_experts: usize,
    /// `num_experts_per_tok`.
    pub top_k: usize,
    /// `swiglu_alpha`: the sigmoid's gain.
    pub alpha: f64,
    /// `swiglu_limit`: the clamp on the gate (above) and the up projection (both sides).
    pub limit: f64,
}

/// Llama 3.2 Vision's layers (`MllamaForConditionalGeneration`, or `MllamaForCausalLM` alone).
/// On text alone transformers skips the cross-attention layers (they run only with image
/// states), so the decoder holds the other layers, numbered in order; checkpoint and PEFT names
/// map onto them through [`ModelConfig::text_model_name`] and back through
/// [`ModelConfig::checkpoint_name`].
#[derive(Debug, Clone, PartialEq)]
pub struct MllamaLayers {
    /// The checkpoint's layer numbers of its cross-attention layers, sorted.
    pub cross_attention_layers: Vec<usize>,
    /// Where the checkpoint's text modules sit as transformers 5 names them:
    /// `model.language_model.` in the whole model, `model.` in `MllamaForCausalLM`.
    pub text_prefix: &'static str,
}

/// Gemma 4's layer-by-layer structure (`gemma4_text`): what differs from one layer to the next,
/// beyond Gemma 3's sliding and full layers.
#[derive(Debug, Clone, PartialEq)]
pub struct Gemma4Layers {
    /// Per layer `(head_dim, num_key_value_heads)`: the full-attention layers take
    /// `global_head_dim` (and `num_global_key_value_heads` with `attention_k_eq_v`), or what a
    /// saved config's `per_layer_config` lists.
    pub attention_dims: Vec<(usize, usize)>,
    /// Per layer: the values are the key projection's output (`attention_k_eq_v`, on the
    /// full-attention layers); the layer has no `v_proj`.
    pub key_is_value: Vec<bool>,
    /// Per layer: the earlier layer whose keys and values it attends with
    /// (`num_kv_shared_layers`: the last layers reuse those of the last unshared layer of their
    /// type); such a layer has no key/value projections or norms.
    pub kv_source: Vec<Option<usize>>,
    /// Per layer: the MLP's intermediate size (twice `intermediate_size` on the KV-sharing
    /// layers with `use_double_wide_mlp`).
    pub intermediate_sizes: Vec<usize>,
    /// Per-layer embeddings (PLE) `(vocab_size_per_layer_input, hidden_size_per_layer_input)`:
    /// every layer adds a gated projection of its own slice of a second token embedding mixed
    /// with a projection of the input embeddings.
    pub per_layer_input: Option<(usize, usize)>,
    /// The mixture-of-experts block beside every layer's MLP (`enable_moe_block`):
    /// `(num_experts, top_k_experts, moe_intermediate_size)`.
    pub moe: Option<(usize, usize, usize)>,
}

/// Phi-3.5-MoE's router (transformers' `sparsemixer`, as it runs in evaluation): the first expert
/// is the router logits' largest; logits whose gap to it, relative to `max(|logit|, largest)`,
/// exceeds `2 · jitter_eps` are masked, and the expert's weight is its softmax over the rest. The
/// second expert is the largest of the others, weighted the same way against the logits left
/// (the first one masked). Weights are not renormalized; always two experts per token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SparseMixer {
    /// `router_jitter_noise`: half the relative gap beyond which a logit is masked.
    pub jitter_eps: f64,
}

/// What a q/k norm ([`ModelConfig::qk_norm`]) normalizes over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNormSpan {
    /// Each head's `head_dim` values, after the projection is split into heads (Qwen3, Gemma 3).
    Head,
    /// The whole projection output (`heads · head_dim` of the queries, `kv_heads · head_dim` of
    /// the keys), before it is split into heads (OLMo 2).
    Projection,
}

/// The MLP's activation function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// `silu` / `swish` (SwiGLU MLP).
    Silu,
    /// GELU with the tanh approximation (`gelu_pytorch_tanh`, `gelu_new`): Gemma's GeGLU.
    GeluTanh,
    /// Exact (erf) GELU, `gelu`.
    GeluErf,
}

impl Activation {
    pub(crate) fn parse(name: &str) -> Option<Self> {
        match name {
            "silu" | "swish" => Some(Self::Silu),
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" | "gelu_python_tanh" => {
                Some(Self::GeluTanh)
            }
            "gelu" | "gelu_python" => Some(Self::GeluErf),
            _ => None,
        }
    }
}

/// How rotary frequencies are scaled (transformers' `rope_type`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE.
    Default,
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// Dynamic NTK: the base grows once the sequence exceeds `original_max_position_embeddings`
    /// (the config's `max_position_embeddings`, as transformers takes it).
    Dynamic {
        factor: f64,
        original_max_position_embeddings: usize,
    },
    /// Llama 3.x frequency-dependent scaling.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// YaRN (Qwen2.5 long context).
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        attention_factor: Option<f64>,
        beta_fast: f64,
        beta_slow: f64,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        truncate: bool,
    },
    /// Gemma 4's proportional RoPE: every pair of the head rotates, the first
    /// `partial_rotary_factor` of them at `theta^(-2i / head_dim) / factor` and the others not
    /// at all (frequency zero).
    Proportional { factor: f64 },
    /// Phi-3's LongRoPE: per-frequency factors, short below the original context, long above.
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        factor: f64,
        original_max_position_embeddings: usize,
        attention_factor: Option<f64>,
        /// Phi-3.5-MoE (`short_mscale`, `long_mscale`): transformers 5 rotates with the short
        /// factors at every length and multiplies cos and sin by `short_mscale` up to the original
        /// context, by `long_mscale` beyond it (instead of the attention factor).
        mscales: Option<(f64, f64)>,
    },
}

/// Rotary embedding settings.
#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    /// Base frequency (`rope_theta`).
    pub theta: f64,
    /// Fraction of each head's dimensions that is rotated.
    pub partial_rotary_factor: f64,
    /// Frequency scaling.
    pub scaling: RopeScaling,
}

/// Everything the decoder needs to know about an architecture.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    /// transformers' `model_type` (one of [`crate::family::supported_model_types`]).
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// The norms' epsilon: `rms_norm_eps`, or Phi-2's `layer_norm_eps`.
    pub rms_norm_eps: f64,
    pub max_position_embeddings: usize,
    pub rope: RopeConfig,
    pub activation: Activation,
    /// The output head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Qwen3, Gemma 3, OLMo 2: RMSNorm of the queries and keys before RoPE, over what
    /// [`ModelConfig::qk_norm_span`] says.
    pub qk_norm: bool,
    /// What the q/k norm ([`ModelConfig::qk_norm`]) normalizes over: each head (Qwen3, Gemma 3;
    /// weights `[head_dim]`) or the whole projection output (OLMo 2; weights
    /// `[heads · head_dim]` and `[kv_heads · head_dim]`).
    pub qk_norm_span: QkNormSpan,
    /// Gemma: norms scale by `1 + weight`.
    pub norm_weight_offset_one: bool,
    /// Gemma: embeddings multiplied by `sqrt(hidden_size)` (in the compute dtype).
    pub scale_embeddings: bool,
    /// Phi-3: fused `qkv_proj` and `gate_up_proj` weights.
    pub fused_projections: bool,
    /// Sliding-window attention span for each layer (None = full attention).
    pub layer_sliding_windows: Vec<Option<usize>>,
    /// Phi-2, Phi-3.5-MoE: LayerNorm with a bias (`(x − mean) / √(var + eps) · w + b`) instead
    /// of RMSNorm.
    pub layer_norm: bool,
    /// Phi-2: attention and MLP read the same normed input and both add to the residual
    /// (`x + attn(h) + mlp(h)`); there is no second norm in a layer.
    pub parallel_block: bool,
    /// Phi-2: the MLP is ungated, `fc2(act(fc1(x)))`.
    pub ungated_mlp: bool,
    /// Mixtral / Qwen-MoE: sparse mixture-of-experts MLPs.
    pub moe: Option<MoeConfig>,
    /// Per layer: whether it applies RoPE (SmolLM3's `no_rope_layers` leave every fourth layer
    /// without position embedding).
    pub rope_layers: Vec<bool>,
    /// Ministral 3's query temperature `(beta, original context)`: queries at position `p` are
    /// scaled by `1 + beta · ln(1 + ⌊p / original⌋)` after RoPE (`llama_4_scaling_beta`).
    pub llama4_attn_scale: Option<(f64, usize)>,
    /// Llama 4 (`attn_temperature_tuning`): the NoPE layers' query temperature
    /// `(attn_scale, floor_scale)`: queries at position `p` are scaled by
    /// `1 + attn_scale · ln(1 + ⌊(p + 1) / floor_scale⌋)`, computed in f32.
    pub nope_attn_temperature: Option<(f64, f64)>,
    /// Llama 4: each head's rotary pairs are adjacent elements (`[x0, x1]` = one complex number,
    /// as Meta's checkpoints hold q/k rows and `torch.view_as_complex` reads them) instead of
    /// transformers' two halves.
    pub rope_interleaved: bool,
    /// Llama 4 (`use_qk_norm`): the RoPE layers' queries and keys are L2-normalized per head
    /// (an RMSNorm without weight, `rms_norm_eps`) after RoPE.
    pub rope_layer_qk_l2_norm: bool,
    /// Llama 4 (`attention_chunk_size`): per layer, the chunk length its attention is confined to
    /// (a query sees the earlier keys of its own chunk of positions); `None` = full attention.
    pub layer_attention_chunks: Vec<Option<usize>>,
    /// Llama 4's checkpoint names: the MLP is `feed_forward` (`feed_forward.router`, the experts
    /// fused as `feed_forward.experts.gate_up_proj` `[experts, hidden, 2 × inter]` and
    /// `feed_forward.experts.down_proj` `[experts, inter, hidden]`); the decoder holds them as
    /// `mlp.gate` and separate experts, see [`ModelConfig::text_model_name`].
    pub llama4_names: bool,
    /// Gemma 2/3 ("sandwich" norms): each block's output is normalized before the residual add
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`) and the MLP has its own pre-norm
    /// (`pre_feedforward_layernorm`); otherwise `post_attention_layernorm` is the MLP's pre-norm.
    pub sandwich_norms: bool,
    /// Each block has a norm of its input: `input_layernorm` before the attention and, before the
    /// MLP, `post_attention_layernorm` (with sandwich norms, `pre_feedforward_layernorm`). True
    /// for every family but OLMo 2, whose blocks read the residual stream as it is and have only
    /// the sandwich norms' output norms (`post_attention_layernorm`,
    /// `post_feedforward_layernorm`); false needs [`ModelConfig::sandwich_norms`].
    pub pre_norms: bool,
    /// The parameter name of the layer's `post_attention_layernorm` tensor:
    /// `post_attention_layernorm.weight`, but VaultGemma's MLP pre-norm (Gemma 2's layer without
    /// its two post-norms) is `pre_feedforward_layernorm.weight`.
    pub post_attention_norm_name: &'static str,
    /// Gemma 2/3: attention scores are scaled by `query_pre_attn_scalar^-0.5` instead of
    /// `head_dim^-0.5`.
    pub query_pre_attn_scalar: Option<f64>,
    /// Gemma 2: attention scores become `cap · tanh(score / cap)` before the mask.
    pub attn_logit_softcapping: Option<f64>,
    /// Gemma 2: the output logits become `cap · tanh(logit / cap)`.
    pub final_logit_softcapping: Option<f64>,
    /// Gemma 3: the rotary embedding of the sliding-attention layers (`rope_local_base_freq`);
    /// the layers marked in [`ModelConfig::local_rope_layers`] use it instead of `rope`.
    pub local_rope: Option<RopeConfig>,
    /// Per layer: whether it uses [`ModelConfig::local_rope`] (Gemma 3's sliding-attention layers).
    pub local_rope_layers: Vec<bool>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    /// The checkpoint is a multimodal Gemma 3 or Mistral 3 (`model_type: gemma3` / `mistral3`) and
    /// this is its text model: its tensors are read from `language_model.*` /
    /// `model.language_model.*`, the vision tower is left out, the output head is tied exactly
    /// when the checkpoint has no `lm_head`, and what is saved is the text model
    /// (`Gemma3ForCausalLM`, `MistralForCausalLM`, ...).
    pub text_of_multimodal: bool,
    /// Llama 3.2 Vision's layers (`mllama`, `mllama_text_model`); `None` for other models.
    pub mllama: Option<MllamaLayers>,
    /// Gemma 4's per-layer structure; `None` for other models.
    pub gemma4: Option<Gemma4Layers>,
    /// gpt-oss: every layer's attention has a learned sink logit per head (`self_attn.sinks`)
    /// that joins the softmax's denominator and takes no value.
    pub attention_sinks: bool,
    /// gpt-oss's mixture of experts, in every layer; `None` for other models.
    pub gpt_oss_moe: Option<GptOssMoeConfig>,
    /// A `*ForSequenceClassification` checkpoint (a reward or value model): its output head is
    /// `score` (`[num_labels, hidden]`, no bias, never tied), giving this many outputs per
    /// position instead of vocabulary logits.
    pub score_labels: Option<usize>,
    /// Multi-head latent attention (DeepSeek-V2/V3) instead of q/k/v projections; `None` for
    /// other models.
    pub mla: Option<MlaConfig>,
    /// Group-limited routing of a mixture of experts (DeepSeek-V2/V3): how the router scores and
    /// picks the experts, with always-on shared experts; `None` for the other routers.
    pub grouped_routing: Option<GroupedRouting>,
    /// Multi-token-prediction layers the checkpoint holds after the decoder's
    /// (`num_nextn_predict_layers`, DeepSeek-V3's `model.layers.{num_hidden_layers}.*`): skipped
    /// on load, as transformers does.
    pub mtp_layers: usize,
    /// Qwen3.5 / Qwen3-Next: the Gated DeltaNet (linear attention) of the layers that have one
    /// instead of self-attention; `None` for other models.
    pub delta_net: Option<DeltaNetConfig>,
    /// Qwen3.5 / Qwen3-Next: `q_proj` gives each head's query and an output gate side by side
    /// (`[.., heads, 2 · head_dim]`), the attention's output multiplied by `sigmoid(gate)`
    /// before `o_proj`.
    pub attn_output_gate: bool,
    /// The FP8 blocks the checkpoint's weights are stored in (`quantization_config` fp8,
    /// [`crate::fp8`]): they are dequantized on reading, and `raw` loses the
    /// `quantization_config`; `None` for other checkpoints.
    pub fp8: Option<crate::fp8::Fp8Blocks>,
    /// The original config.json object, written back unchanged (but for dtype) when we save models;
    /// for a multimodal checkpoint, its text model's config.
    pub raw: Value,
}

impl ModelConfig {
    /// The most positions a sequence may take: `max_position_embeddings`, or what the rope
    /// scaling extends it to (YaRN's, LongRoPE's and Llama 3's `factor` × the original context,
    /// linear scaling's `factor` × it); `None` for dynamic NTK scaling, which has no end.
    pub fn position_limit(&self) -> Option<usize> {
        let mpe = self.max_position_embeddings;
        let scaled = |factor: f64, base: usize| (base as f64 * factor.max(1.0)) as usize;
        Some(match &self.rope.scaling {
            RopeScaling::Dynamic { .. } => return None,
            RopeScaling::Linear { factor } => mpe.max(scaled(*factor, mpe)),
            RopeScaling::Llama3 {
                factor,
                original_max_position_embeddings: orig,
                ..
            }
            | RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: orig,
                ..
            }
            | RopeScaling::LongRope {
                factor,
                original_max_position_embeddings: orig,
                ..
            } => mpe.max(scaled(*factor, *orig)),
            RopeScaling::Default | RopeScaling::Proportional { .. } => mpe,
        })
    }

    /// Gemma 4's mixture of experts beside every MLP (`enable_moe_block`):
    /// `(num_experts, top_k_experts, moe_intermediate_size)`.
    pub fn gemma4_moe(&self) -> Option<(usize, usize, usize)> {
        self.gemma4.as_ref().and_then(|g| g.moe)
    }

    /// An error for a sequence classifier ([`ModelConfig::score_labels`]) where a causal language
    /// model is needed (generation, fine-tuning, evaluation): its head scores, it does not predict
    /// tokens.
    pub fn require_language_model(&self) -> Result<(), String> {
        match self.score_labels {
            Some(n) => Err(format!(
                "this checkpoint is a sequence classifier (a `score` head with {n} label(s), e.g. \
                 a reward model), not a causal language model"
            )),
            None => Ok(()),
        }
    }

    /// Number of query heads per key/value head (grouped-query attention).
    pub fn kv_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// The weight of the router's auxiliary load-balancing loss in the training loss, as
    /// transformers' MoE models add it: `router_aux_loss_coef` when `output_router_logits` is true,
    /// the coefficient is positive and the model has sparse layers; otherwise `None`.
    pub fn router_aux_loss_coef(&self) -> Option<f64> {
        let Value::Object(obj) = &self.raw else {
            return None;
        };
        // Llama4ForCausalLM computes no load-balancing loss, whatever its config says.
        if (self.moe.is_none() && self.gpt_oss_moe.is_none())
            || self.llama4_names
            || obj.get("output_router_logits").and_then(Value::as_bool) != Some(true)
        {
            return None;
        }
        obj.get("router_aux_loss_coef")
            .and_then(Value::as_f64)
            .filter(|c| *c > 0.0)
    }

    /// Training settings of the config that ferrotune's training does not apply, one sentence
    /// each (the recipes warn with them): router jitter, Phi-2's residual / embedding dropout, and
    /// dropout on the attention probabilities.
    pub fn training_caveats(&self) -> Vec<String> {
        // `raw` is already the text model's config for a multimodal checkpoint.
        let Value::Object(obj) = &self.raw else {
            return Vec::new();
        };
        let positive = |key: &str| obj.get(key).and_then(Value::as_f64).filter(|v| *v > 0.0);
        let mut out = Vec::new();
        // Phi-3.5-MoE's sparsemixer.
        if self.moe.as_ref().is_some_and(|m| m.sparse_mixer.is_some()) {
            // There `router_jitter_noise` is the sparsemixer's masking threshold, which applies.
            out.push(
                "Phi-3.5-MoE's sparsemixer samples experts in transformers' training mode; \
                 ferrotune routes training steps as in evaluation (the two top experts)"
                    .into(),
            );
            if let Some(j) = positive("input_jitter_noise") {
                out.push(format!(
                    "input_jitter_noise {j} is not applied: the experts see their inputs unchanged"
                ));
            }
        } else if let Some(j) = positive("router_jitter_noise") {
            out.push(format!(
                "router_jitter_noise {j} is not applied: the router sees its inputs unchanged"
            ));
        }
        for key in ["resid_pdrop", "embd_pdrop", "attention_dropout"] {
            if let Some(p) = positive(key) {
                out.push(format!("{key} {p} (dropout) is not applied"));
            }
        }
        out
    }
}
