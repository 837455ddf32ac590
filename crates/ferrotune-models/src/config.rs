//! Model configuration: one description for every supported family, read from HF `config.json`
//! (transformers 4.x `rope_theta`/`rope_scaling` and 5.x `rope_parameters` alike) or GGUF metadata.
//!
//! Families differ only by the switches in [`ModelConfig`]; the decoder has no per-family code.

use std::path::Path;

use serde_json::{Map, Value};

use crate::error::ModelError;

/// `model_type` values ferrotune can run, as transformers names them.
pub const SUPPORTED_MODEL_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "vaultgemma",
    "gemma3_text",
    "gemma3",
    "mistral3",
    "phi3",
    "phi",
    "mixtral",
    "phimoe",
    "qwen2_moe",
    "qwen3_moe",
    "ministral",
    "ministral3",
    "smollm3",
    "llama4_text",
    "llama4",
    "gemma4_text",
    "gemma4",
];

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
    fn parse(name: &str) -> Option<Self> {
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
    /// transformers' `model_type` (one of [`SUPPORTED_MODEL_TYPES`]).
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
    /// Qwen3: RMSNorm over each query and key head before RoPE.
    pub qk_norm: bool,
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
    /// A `*ForSequenceClassification` checkpoint (a reward or value model): its output head is
    /// `score` (`[num_labels, hidden]`, no bias, never tied), giving this many outputs per
    /// position instead of vocabulary logits.
    pub score_labels: Option<usize>,
    /// The original config.json object, written back unchanged (but for dtype) when we save models;
    /// for a multimodal checkpoint, its text model's config.
    pub raw: Value,
}

impl ModelConfig {
    /// Reads `config.json` from an HF checkpoint folder (or the file itself).
    pub fn from_hf_file(path: &Path) -> Result<Self, ModelError> {
        let file = if path.is_dir() {
            path.join("config.json")
        } else {
            path.to_path_buf()
        };
        let text = std::fs::read_to_string(&file)
            .map_err(|e| ModelError::file(&file, format!("cannot read: {e}")))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::file(&file, format!("invalid JSON: {e}")))?;
        Self::from_hf_json(&value).map_err(|msg| ModelError::file(&file, msg))
    }

    /// Builds the config from a parsed HF `config.json` object.
    pub fn from_hf_json(value: &Value) -> Result<Self, String> {
        let top = value.as_object().ok_or("config must be a JSON object")?;
        let top_type = get_str(top, "model_type")?;
        if let Some((_, text_types)) = MULTIMODAL_TEXT_TYPES
            .iter()
            .find(|(t, _)| Some(*t) == top_type)
        {
            let mut text = multimodal_text_config(top, text_types)?;
            let mllama = match text_types[0] {
                "mllama_text_model" => Some(MllamaLayers {
                    cross_attention_layers: mllama_text_layers(&mut text)?,
                    text_prefix: if top_type == Some("mllama") {
                        "model.language_model."
                    } else {
                        "model."
                    },
                }),
                _ => None,
            };
            let mut config = Self::from_hf_json(&Value::Object(text))?;
            config.text_of_multimodal = true;
            config.mllama = mllama;
            return Ok(config);
        }
        let with_defaults;
        let obj = match family_defaults(get_str(top, "model_type")?.unwrap_or("")) {
            [] => top,
            defaults => {
                // transformers fills keys a config leaves out from the family's config class;
                // Gemma 3's multimodal configs leave out most of their text model's.
                let mut filled = top.clone();
                for (key, default) in defaults {
                    filled.entry(*key).or_insert_with(|| default.clone());
                }
                with_defaults = filled;
                &with_defaults
            }
        };
        let model_type = get_str(obj, "model_type")?
            .ok_or("missing key 'model_type'")?
            .to_string();
        if !SUPPORTED_MODEL_TYPES.contains(&model_type.as_str()) {
            return Err(format!(
                "unsupported model_type '{model_type}': supported model types are {}",
                SUPPORTED_MODEL_TYPES.join(", ")
            ));
        }
        let is = |t: &str| model_type == t;
        let is_gemma = model_type.starts_with("gemma") || model_type == "vaultgemma";
        // Gemma 2 and 3: sandwich norms, query_pre_attn_scalar, per-layer-type attention.
        // VaultGemma is Gemma 2 without the post-norms.
        let gemma2_like = is("gemma2") || is("vaultgemma");
        let is_gemma4 = is("gemma4_text");
        // Gemma 4 shares Gemma 3's layer types, two ropes and sandwich norms.
        let is_gemma_2_3 = gemma2_like || is("gemma3_text") || is_gemma4;
        if is_gemma4 {
            // Gemma 4 names who attends both ways: "vision" concerns image tokens only, which
            // text never holds; "all" makes an encoder.
            match obj.get("use_bidirectional_attention") {
                None | Some(Value::Null) => {}
                Some(Value::String(s)) if s == "vision" => {}
                Some(other) => {
                    return Err(format!(
                        "'use_bidirectional_attention' is {other}: only null or \"vision\" make a causal language model"
                    ))
                }
            }
        } else if get_bool(obj, "use_bidirectional_attention")?.unwrap_or(false) {
            return Err(
                "'use_bidirectional_attention' is true: that is an encoder (EmbeddingGemma), not a causal language model"
                    .into(),
            );
        }
        let hidden_size = req_usize(obj, "hidden_size")?;
        let num_attention_heads = req_usize(obj, "num_attention_heads")?;
        let num_key_value_heads =
            get_usize(obj, "num_key_value_heads")?.unwrap_or(num_attention_heads);
        let head_dim = match get_usize(obj, "head_dim")? {
            Some(d) => d,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(format!(
                        "hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads} and head_dim is not given"
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if num_key_value_heads == 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(format!(
                "num_attention_heads {num_attention_heads} is not a multiple of num_key_value_heads {num_key_value_heads}"
            ));
        }
        let max_position_embeddings = get_usize(obj, "max_position_embeddings")?.unwrap_or(4096);

        // Gemma names it `hidden_activation`; transformers runs Gemma with the tanh GELU whatever
        // the legacy `hidden_act` says.
        if is("phi") && get_bool(obj, "qk_layernorm")?.unwrap_or(false) {
            return Err(
                "'qk_layernorm' true (per-head LayerNorm of queries and keys) is not supported"
                    .into(),
            );
        }
        let act_name = if is_gemma {
            get_str(obj, "hidden_activation")?.unwrap_or("gelu_pytorch_tanh")
        } else {
            get_str(obj, "hidden_act")?.unwrap_or("silu")
        };
        let activation = Activation::parse(act_name)
            .ok_or_else(|| format!("unsupported activation '{act_name}' (hidden_act)"))?;

        let num_hidden_layers = req_usize(obj, "num_hidden_layers")?;
        let (rope, local_rope, layer_sliding_windows, local_rope_layers) = if is_gemma_2_3 {
            let mut sliding = gemma_sliding_layers(obj, &model_type, num_hidden_layers)?;
            if is_gemma4 {
                // transformers forces Gemma 4's last layer to full attention.
                if let Some(last) = sliding.last_mut() {
                    *last = false;
                }
            }
            // Gemma 2/3 default to a 4096-token window when the key is absent; null disables it.
            let window = match obj.get("sliding_window") {
                None => Some(4096),
                Some(_) => get_usize(obj, "sliding_window")?,
            };
            let windows = sliding.iter().map(|&s| window.filter(|_| s)).collect();
            if is("gemma3_text") || is_gemma4 {
                let (global, local) = parse_gemma3_rope(obj, max_position_embeddings)?;
                (global, Some(local), windows, sliding)
            } else {
                let rope = parse_rope(obj, max_position_embeddings, 10000.0)?;
                (rope, None, windows, vec![false; num_hidden_layers])
            }
        } else {
            (
                // PhimoeConfig's `default_theta` is 1e6.
                parse_rope(
                    obj,
                    max_position_embeddings,
                    if is("phimoe") { 1_000_000.0 } else { 10000.0 },
                )?,
                None,
                parse_sliding_windows(obj, &model_type, num_hidden_layers)?,
                vec![false; num_hidden_layers],
            )
        };
        // transformers' Gemma 2 defaults when a key is absent (null turns the feature off).
        let gemma2_default = |key: &str, default: f64| -> Result<Option<f64>, String> {
            match obj.get(key) {
                None if gemma2_like => Ok(Some(default)),
                _ => get_positive(obj, key),
            }
        };
        let attn_logit_softcapping = gemma2_default("attn_logit_softcapping", 50.0)?;
        let final_logit_softcapping = gemma2_default("final_logit_softcapping", 30.0)?;
        let query_pre_attn_scalar = if is_gemma4 {
            // Gemma 4's q/k norms leave the scores unscaled (transformers' `scaling = 1.0`).
            Some(1.0)
        } else if is_gemma_2_3 {
            Some(get_positive(obj, "query_pre_attn_scalar")?.unwrap_or(256.0))
        } else {
            None
        };

        let score_labels = parse_score_labels(obj)?;
        let gemma4 = if is_gemma4 {
            Some(parse_gemma4(
                obj,
                &local_rope_layers,
                (head_dim, num_key_value_heads, num_attention_heads),
                req_usize(obj, "intermediate_size")?,
            )?)
        } else {
            None
        };
        Ok(Self {
            vocab_size: req_usize(obj, "vocab_size")?,
            hidden_size,
            // Llama 4's dense layers take `intermediate_size_mlp`; its experts `intermediate_size`.
            intermediate_size: if is("llama4_text") {
                req_usize(obj, "intermediate_size_mlp")?
            } else {
                req_usize(obj, "intermediate_size")?
            },
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: if is("phi") {
                get_f64(obj, "layer_norm_eps")?.unwrap_or(1e-5)
            } else if is("phimoe") {
                // Phi-3.5-MoE's LayerNorms take `rms_norm_eps` (PhimoeConfig's default 1e-5).
                get_f64(obj, "rms_norm_eps")?.unwrap_or(1e-5)
            } else {
                get_f64(obj, "rms_norm_eps")?.unwrap_or(1e-6)
            },
            max_position_embeddings,
            rope,
            activation,
            // A classifier's `score` head is its own matrix whatever the tying flag says.
            tie_word_embeddings: score_labels.is_none()
                && get_bool(obj, "tie_word_embeddings")?.unwrap_or(is_gemma),
            score_labels,
            qk_norm: is("qwen3") || is("qwen3_moe") || is("gemma3_text") || is_gemma4,
            // Gemma 4's norms scale by the weight itself.
            norm_weight_offset_one: is_gemma && !is_gemma4,
            scale_embeddings: is_gemma,
            fused_projections: is("phi3"),
            layer_sliding_windows,
            sandwich_norms: is_gemma_2_3 && !is("vaultgemma"),
            post_attention_norm_name: if is("vaultgemma") {
                "pre_feedforward_layernorm.weight"
            } else {
                "post_attention_layernorm.weight"
            },
            query_pre_attn_scalar,
            attn_logit_softcapping,
            final_logit_softcapping,
            local_rope,
            local_rope_layers,
            text_of_multimodal: false,
            mllama: None,
            gemma4,
            layer_norm: is("phi") || is("phimoe"),
            parallel_block: is("phi"),
            ungated_mlp: is("phi"),
            moe: parse_moe(obj, &model_type, num_hidden_layers)?,
            rope_layers: parse_rope_layers(obj, &model_type, num_hidden_layers)?,
            llama4_attn_scale: parse_llama4_attn_scale(obj)?,
            nope_attn_temperature: if is("llama4_text")
                && get_bool(obj, "attn_temperature_tuning")?.unwrap_or(true)
            {
                let floor_scale = get_positive(obj, "floor_scale")?.unwrap_or(8192.0);
                Some((get_f64(obj, "attn_scale")?.unwrap_or(0.1), floor_scale))
            } else {
                None
            },
            rope_interleaved: is("llama4_text"),
            rope_layer_qk_l2_norm: is("llama4_text")
                && get_bool(obj, "use_qk_norm")?.unwrap_or(true),
            layer_attention_chunks: parse_attention_chunks(obj, &model_type, num_hidden_layers)?,
            llama4_names: is("llama4_text"),
            bos_token_id: get_ids(obj, "bos_token_id")?.first().copied(),
            eos_token_ids: get_ids(obj, "eos_token_id")?,
            pad_token_id: get_ids(obj, "pad_token_id")?.first().copied(),
            model_type,
            raw: value.clone(),
        })
    }

    /// The decoder's name for a tensor or module of a multimodal checkpoint, or of a PEFT adapter
    /// of the whole model: [`crate::checkpoint::text_model_tensor`]'s, with Llama 3.2 Vision's
    /// layers renumbered past its cross-attention layers; `None` for what text alone does not run
    /// (the vision tower, the projector, the cross-attention layers).
    pub fn text_model_name(&self, name: &str) -> Option<String> {
        let name = crate::checkpoint::text_model_tensor(name)?;
        if self.llama4_names {
            return Some(llama4_decoder_name(&name));
        }
        let Some(mllama) = &self.mllama else {
            return Some(name);
        };
        let Some((layer, rest)) = layer_and_rest(&name) else {
            return Some(name);
        };
        let cross = &mllama.cross_attention_layers;
        let before = cross.partition_point(|&c| c < layer);
        (cross.get(before) != Some(&layer))
            .then(|| format!("model.layers.{}.{rest}", layer - before))
    }

    /// Gemma 4's mixture of experts beside every MLP (`enable_moe_block`):
    /// `(num_experts, top_k_experts, moe_intermediate_size)`.
    pub fn gemma4_moe(&self) -> Option<(usize, usize, usize)> {
        self.gemma4.as_ref().and_then(|g| g.moe)
    }

    /// The checkpoint's name of the decoder's tensor or module `name`, the inverse of
    /// [`ModelConfig::text_model_name`] for Llama 3.2 Vision (its layers numbered as the
    /// checkpoint numbers them, under the checkpoint's prefix as transformers 5 names it); other
    /// models' names are the decoder's.
    pub fn checkpoint_name(&self, name: &str) -> String {
        if self.llama4_names {
            return llama4_checkpoint_name(name);
        }
        let Some(mllama) = &self.mllama else {
            return name.to_string();
        };
        let Some(inner) = name.strip_prefix("model.") else {
            return name.to_string();
        };
        let prefix = mllama.text_prefix;
        match layer_and_rest(name) {
            Some((layer, rest)) => {
                // The layer-th text layer: skip the cross-attention layers at or before it.
                let hf = mllama.cross_attention_layers.iter().fold(layer, |n, &c| {
                    if c <= n {
                        n + 1
                    } else {
                        n
                    }
                });
                format!("{prefix}layers.{hf}.{rest}")
            }
            None => format!("{prefix}{inner}"),
        }
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
        if self.moe.is_none()
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
        if self.model_type == "phimoe" {
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

/// The rotary settings of a config: transformers 5's `rope_parameters`, or 4.x's top-level
/// `rope_theta` (`default_theta` when absent) and `rope_scaling`.
fn parse_rope(
    obj: &Map<String, Value>,
    max_pos: usize,
    default_theta: f64,
) -> Result<RopeConfig, String> {
    // transformers 5 puts everything under `rope_parameters`; 4.x has `rope_theta` at top level and
    // an optional `rope_scaling` dict (with `rope_type`, or the older `type`).
    let empty = Map::new();
    let params = match obj.get("rope_parameters") {
        Some(Value::Object(m)) => m,
        Some(Value::Null) | None => match obj.get("rope_scaling") {
            Some(Value::Object(m)) => m,
            Some(Value::Null) | None => &empty,
            Some(_) => return Err("'rope_scaling' must be an object or null".into()),
        },
        Some(_) => return Err("'rope_parameters' must be an object or null".into()),
    };
    let theta = match get_f64(params, "rope_theta")? {
        Some(t) => t,
        None => get_f64(obj, "rope_theta")?.unwrap_or(default_theta),
    };
    rope_from_params(obj, params, max_pos, theta)
}

/// Gemma 3's two rotary embeddings, `(global, local)`: transformers 5 keeps one
/// `rope_parameters` entry per layer type (`full_attention`, `sliding_attention`); 4.x has
/// `rope_theta` + `rope_scaling` for the full-attention layers and `rope_local_base_freq` for the
/// sliding ones (default rope). Default thetas 1e6 (global) and 1e4 (local), as transformers.
fn parse_gemma3_rope(
    obj: &Map<String, Value>,
    max_pos: usize,
) -> Result<(RopeConfig, RopeConfig), String> {
    const GLOBAL_THETA: f64 = 1_000_000.0;
    const LOCAL_THETA: f64 = 10_000.0;
    let per_type = match obj.get("rope_parameters") {
        Some(Value::Object(m))
            if m.contains_key("full_attention") || m.contains_key("sliding_attention") =>
        {
            Some(m)
        }
        _ => None,
    };
    let Some(per_type) = per_type else {
        let global = parse_rope(obj, max_pos, GLOBAL_THETA)?;
        let local_theta = get_f64(obj, "rope_local_base_freq")?.unwrap_or(LOCAL_THETA);
        let local = RopeConfig {
            theta: local_theta,
            partial_rotary_factor: 1.0,
            scaling: RopeScaling::Default,
        };
        return Ok((global, local));
    };
    let empty = Map::new();
    let entry = |key: &str, default_theta: f64| -> Result<RopeConfig, String> {
        let params = match per_type.get(key) {
            Some(Value::Object(m)) => m,
            Some(Value::Null) | None => &empty,
            Some(_) => return Err(format!("'rope_parameters.{key}' must be an object")),
        };
        let theta = get_f64(params, "rope_theta")?.unwrap_or(default_theta);
        rope_from_params(obj, params, max_pos, theta)
            .map_err(|e| format!("rope_parameters.{key}: {e}"))
    };
    Ok((
        entry("full_attention", GLOBAL_THETA)?,
        entry("sliding_attention", LOCAL_THETA)?,
    ))
}

/// A [`RopeConfig`] from one set of rope parameters (`rope_type`, `factor`, ...) and its theta.
fn rope_from_params(
    obj: &Map<String, Value>,
    params: &Map<String, Value>,
    max_pos: usize,
    theta: f64,
) -> Result<RopeConfig, String> {
    let partial_rotary_factor = match get_f64(params, "partial_rotary_factor")? {
        Some(f) => f,
        None => get_f64(obj, "partial_rotary_factor")?.unwrap_or(1.0),
    };
    let rope_type = get_str(params, "rope_type")?
        .or(get_str(params, "type")?)
        .unwrap_or("default");
    let factor = || -> Result<f64, String> {
        get_f64(params, "factor")?.ok_or_else(|| format!("rope type '{rope_type}' needs 'factor'"))
    };
    let original = |default: usize| -> Result<usize, String> {
        Ok(
            match get_usize(params, "original_max_position_embeddings")? {
                Some(v) => v,
                None => get_usize(obj, "original_max_position_embeddings")?.unwrap_or(default),
            },
        )
    };
    let phimoe = get_str(obj, "model_type")? == Some("phimoe");
    if phimoe && !matches!(rope_type, "default" | "longrope" | "su") {
        // transformers scales Phi-3.5-MoE's cos and sin by `short_mscale` / `long_mscale` in
        // place of every other type's own attention factor.
        return Err(format!(
            "Phi-3.5-MoE with rope_type '{rope_type}' is not supported: default and longrope are"
        ));
    }
    let scaling = match rope_type {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: factor()? },
        // transformers scales dynamic NTK against `max_position_embeddings` and ignores an
        // `original_max_position_embeddings` given with it.
        "dynamic" => RopeScaling::Dynamic {
            factor: factor()?,
            original_max_position_embeddings: max_pos,
        },
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: get_f64(params, "low_freq_factor")?.ok_or("llama3 rope needs 'low_freq_factor'")?,
            high_freq_factor: get_f64(params, "high_freq_factor")?
                .ok_or("llama3 rope needs 'high_freq_factor'")?,
            original_max_position_embeddings: original(8192)?,
        },
        "yarn" => RopeScaling::Yarn {
            factor: factor()?,
            original_max_position_embeddings: original(max_pos)?,
            attention_factor: get_f64(params, "attention_factor")?,
            beta_fast: get_f64(params, "beta_fast")?.unwrap_or(32.0),
            beta_slow: get_f64(params, "beta_slow")?.unwrap_or(1.0),
            mscale: get_f64(params, "mscale")?,
            mscale_all_dim: get_f64(params, "mscale_all_dim")?,
            truncate: get_bool(params, "truncate")?.unwrap_or(true),
        },
        // Gemma 4: the rotated pairs' frequencies over the whole head (`theta^(-2i / head_dim)`
        // for the first `partial_rotary_factor` of them, zero for the rest), divided by `factor`.
        "proportional" => RopeScaling::Proportional {
            factor: get_f64(params, "factor")?.unwrap_or(1.0),
        },
        "longrope" | "su" => {
            let list = |key: &str| -> Result<Vec<f64>, String> {
                params
                    .get(key)
                    .and_then(Value::as_array)
                    .ok_or_else(|| format!("longrope needs a list '{key}'"))?
                    .iter()
                    .map(|v| v.as_f64().ok_or_else(|| format!("'{key}' must hold numbers")))
                    .collect()
            };
            // Phi-3 keeps the pretrained context in `original_max_position_embeddings` and derives
            // the factor from it, as transformers does.
            let orig = original(max_pos)?;
            let mscale = |key: &str| {
                get_f64(params, key)?
                    .ok_or_else(|| format!("Phi-3.5-MoE's longrope needs '{key}'"))
            };
            RopeScaling::LongRope {
                short_factor: list("short_factor")?,
                long_factor: list("long_factor")?,
                factor: if orig > 0 { max_pos as f64 / orig as f64 } else { 1.0 },
                original_max_position_embeddings: orig,
                attention_factor: get_f64(params, "attention_factor")?,
                mscales: if phimoe {
                    Some((mscale("short_mscale")?, mscale("long_mscale")?))
                } else {
                    None
                },
            }
        }
        other => {
            return Err(format!(
                "unsupported rope_type '{other}': supported are default, linear, dynamic, llama3, yarn, longrope, proportional"
            ))
        }
    };
    Ok(RopeConfig {
        theta,
        partial_rotary_factor,
        scaling,
    })
}

fn parse_sliding_windows(
    obj: &Map<String, Value>,
    model_type: &str,
    layers: usize,
) -> Result<Vec<Option<usize>>, String> {
    let window = get_usize(obj, "sliding_window")?;
    let Some(window) = window else {
        return Ok(vec![None; layers]);
    };
    // An explicit per-layer list (transformers 5 `layer_types`) wins where sliding is enabled.
    let layer_types: Option<Vec<String>> = match obj.get("layer_types") {
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|v| v.as_str().unwrap_or("").to_string())
                .collect(),
        ),
        _ => None,
    };
    let windows = match model_type {
        // Qwen2/Qwen3 only slide when `use_sliding_window` is set, and then from `max_window_layers` on.
        "qwen2" | "qwen3" | "qwen2_moe" | "qwen3_moe" | "smollm3" => {
            if !get_bool(obj, "use_sliding_window")?.unwrap_or(false) {
                vec![None; layers]
            } else if let Some(types) = layer_types {
                types
                    .iter()
                    .map(|t| (t == "sliding_attention").then_some(window))
                    .collect()
            } else {
                let from = get_usize(obj, "max_window_layers")?.unwrap_or(layers);
                (0..layers).map(|i| (i >= from).then_some(window)).collect()
            }
        }
        // Ministral (and any config listing them): sliding only where `layer_types` says so.
        _ => match layer_types {
            Some(types) => types
                .iter()
                .map(|t| (t == "sliding_attention").then_some(window))
                .collect(),
            None => vec![Some(window); layers],
        },
    };
    if windows.len() != layers {
        return Err(format!(
            "'layer_types' has {} entries but num_hidden_layers is {layers}",
            windows.len()
        ));
    }
    Ok(windows)
}

/// Which layers apply RoPE: SmolLM3's and Llama 4's `no_rope_layers` (1 = RoPE, 0 = none; by default every
/// `no_rope_layer_interval`-th layer, 4, has none); every layer elsewhere.
fn parse_rope_layers(
    obj: &Map<String, Value>,
    model_type: &str,
    layers: usize,
) -> Result<Vec<bool>, String> {
    if model_type != "smollm3" && model_type != "llama4_text" {
        return Ok(vec![true; layers]);
    }
    match obj.get("no_rope_layers") {
        // Llama4TextConfig takes an empty list as absent, and a longer one as its first entries.
        Some(Value::Array(a)) if a.is_empty() && model_type == "llama4_text" => {
            default_rope_layers(obj, layers)
        }
        Some(Value::Array(a)) if a.len() > layers && model_type == "llama4_text" => {
            let mut first = obj.clone();
            first.insert("no_rope_layers".into(), Value::from(a[..layers].to_vec()));
            parse_rope_layers(&first, model_type, layers)
        }
        Some(Value::Array(a)) => {
            if a.len() != layers {
                return Err(format!(
                    "'no_rope_layers' has {} entries but num_hidden_layers is {layers}",
                    a.len()
                ));
            }
            a.iter()
                .map(|v| match v.as_u64() {
                    Some(0) => Ok(false),
                    Some(1) => Ok(true),
                    _ => Err(format!(
                        "'no_rope_layers' entries must be 0 or 1, found {v}"
                    )),
                })
                .collect()
        }
        None | Some(Value::Null) => default_rope_layers(obj, layers),
        Some(v) => Err(format!("'no_rope_layers' must be a list, found {v}")),
    }
}

/// `no_rope_layers` left out: every `no_rope_layer_interval`-th layer (4) has no RoPE.
fn default_rope_layers(obj: &Map<String, Value>, layers: usize) -> Result<Vec<bool>, String> {
    let interval = get_usize(obj, "no_rope_layer_interval")?.unwrap_or(4);
    if interval == 0 {
        return Err("'no_rope_layer_interval' must be at least 1".into());
    }
    Ok((0..layers).map(|i| (i + 1) % interval != 0).collect())
}

/// Per layer, whether transformers' `layer_types` names it `marked` (`sliding_attention`,
/// `chunked_attention`) rather than `full_attention`; `None` when the config has no list.
fn layer_types_marking(
    obj: &Map<String, Value>,
    marked: &str,
    layers: usize,
) -> Result<Option<Vec<bool>>, String> {
    let Some(types) = obj.get("layer_types").filter(|v| !v.is_null()) else {
        return Ok(None);
    };
    let types = types
        .as_array()
        .ok_or("'layer_types' must be a list of strings")?;
    if types.len() != layers {
        return Err(format!(
            "'layer_types' has {} entries but num_hidden_layers is {layers}",
            types.len()
        ));
    }
    types
        .iter()
        .map(|t| match t.as_str() {
            Some(m) if m == marked => Ok(true),
            Some("full_attention") => Ok(false),
            _ => Err(format!(
                "'layer_types' entry {t} is neither \"{marked}\" nor \"full_attention\""
            )),
        })
        .collect::<Result<_, _>>()
        .map(Some)
}

/// Llama 4's chunked attention: the layers `layer_types` marks `chunked_attention` (by default
/// the RoPE layers) see only their own chunk of `attention_chunk_size` positions; a null chunk
/// size turns it off, as in transformers. Every other family attends fully (or in windows).
fn parse_attention_chunks(
    obj: &Map<String, Value>,
    model_type: &str,
    layers: usize,
) -> Result<Vec<Option<usize>>, String> {
    if model_type != "llama4_text" {
        return Ok(vec![None; layers]);
    }
    let chunk = match obj.get("attention_chunk_size") {
        None => Some(8192),
        Some(_) => get_usize(obj, "attention_chunk_size")?,
    };
    if chunk == Some(0) {
        return Err("'attention_chunk_size' must be at least 1".into());
    }
    let chunked = match layer_types_marking(obj, "chunked_attention", layers)? {
        Some(chunked) => chunked,
        None => parse_rope_layers(obj, model_type, layers)?,
    };
    Ok(chunked.into_iter().map(|c| chunk.filter(|_| c)).collect())
}

/// Ministral 3's `llama_4_scaling_beta` (in `rope_parameters`, with its
/// `original_max_position_embeddings`).
fn parse_llama4_attn_scale(obj: &Map<String, Value>) -> Result<Option<(f64, usize)>, String> {
    let Some(Value::Object(params)) = obj.get("rope_parameters").or(obj.get("rope_scaling")) else {
        return Ok(None);
    };
    let Some(beta) = get_f64(params, "llama_4_scaling_beta")? else {
        return Ok(None);
    };
    let original = get_usize(params, "original_max_position_embeddings")?
        .or(get_usize(obj, "original_max_position_embeddings")?)
        .ok_or(
            "'llama_4_scaling_beta' needs 'original_max_position_embeddings' in rope_parameters",
        )?;
    if original == 0 {
        return Err("'original_max_position_embeddings' must be at least 1".into());
    }
    Ok(Some((beta, original)))
}

/// The mixture-of-experts settings of Mixtral and Qwen-MoE configs (transformers' defaults for
/// keys left out), `None` for dense families.
fn parse_moe(
    obj: &Map<String, Value>,
    model_type: &str,
    layers: usize,
) -> Result<Option<MoeConfig>, String> {
    let positive = |key: &str, default: usize| -> Result<usize, String> {
        match get_usize(obj, key)?.unwrap_or(default) {
            0 => Err(format!("'{key}' must be at least 1")),
            n => Ok(n),
        }
    };
    let config = match model_type {
        "mixtral" => MoeConfig {
            num_experts: match get_usize(obj, "num_local_experts")? {
                Some(_) => positive("num_local_experts", 0)?,
                None => positive("num_experts", 8)?,
            },
            top_k: positive("num_experts_per_tok", 2)?,
            norm_topk_prob: true,
            expert_intermediate_size: req_usize(obj, "intermediate_size")?,
            shared_expert_intermediate_size: None,
            f32_routing_weights: true,
            sigmoid_input_routing: false,
            mixtral_names: true,
            sparse_layers: vec![true; layers],
            sparse_mixer: None,
        },
        "phimoe" => {
            let num_experts = positive("num_local_experts", 16)?;
            if num_experts < 2 {
                return Err(
                    "'num_local_experts' must be at least 2: Phi-3.5-MoE's router always picks two experts"
                        .into(),
                );
            }
            MoeConfig {
                num_experts,
                // The sparsemixer always picks two; `num_experts_per_tok` only sets how many the
                // router's auxiliary loss counts, as in transformers.
                top_k: positive("num_experts_per_tok", 2)?,
                norm_topk_prob: false,
                expert_intermediate_size: req_usize(obj, "intermediate_size")?,
                shared_expert_intermediate_size: None,
                f32_routing_weights: false,
                sigmoid_input_routing: false,
                mixtral_names: true,
                sparse_layers: vec![true; layers],
                sparse_mixer: Some(SparseMixer {
                    jitter_eps: get_f64(obj, "router_jitter_noise")?.unwrap_or(0.01),
                }),
            }
        }
        "qwen2_moe" | "qwen3_moe" => {
            let qwen2 = model_type == "qwen2_moe";
            let step = positive("decoder_sparse_step", 1)?;
            let dense: Vec<usize> = match obj.get("mlp_only_layers") {
                None | Some(Value::Null) => vec![],
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|v| {
                        v.as_u64().map(|n| n as usize).ok_or_else(|| {
                            format!("'mlp_only_layers' must hold layer indices, found {v}")
                        })
                    })
                    .collect::<Result<_, _>>()?,
                Some(v) => return Err(format!("'mlp_only_layers' must be a list, found {v}")),
            };
            MoeConfig {
                // Hub configs name it `num_experts`; transformers 5 writes `num_local_experts`.
                num_experts: match get_usize(obj, "num_experts")? {
                    Some(_) => positive("num_experts", 0)?,
                    None => positive("num_local_experts", if qwen2 { 60 } else { 128 })?,
                },
                top_k: positive("num_experts_per_tok", if qwen2 { 4 } else { 8 })?,
                norm_topk_prob: get_bool(obj, "norm_topk_prob")?.unwrap_or(false),
                expert_intermediate_size: positive(
                    "moe_intermediate_size",
                    if qwen2 { 1408 } else { 768 },
                )?,
                shared_expert_intermediate_size: if qwen2 {
                    Some(positive("shared_expert_intermediate_size", 5632)?)
                } else {
                    None
                },
                f32_routing_weights: false,
                sigmoid_input_routing: false,
                mixtral_names: false,
                sparse_layers: (0..layers)
                    .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
                    .collect(),
                sparse_mixer: None,
            }
        }
        "llama4_text" => {
            let sparse_layers = match obj.get("moe_layers") {
                None | Some(Value::Null) => {
                    let step = positive("interleave_moe_layer_step", 1)?;
                    (0..layers).map(|i| (i + 1) % step == 0).collect()
                }
                Some(Value::Array(a)) => {
                    let listed = a
                        .iter()
                        .map(|v| {
                            v.as_u64().map(|n| n as usize).ok_or_else(|| {
                                format!("'moe_layers' must hold layer indices, found {v}")
                            })
                        })
                        .collect::<Result<Vec<_>, _>>()?;
                    (0..layers).map(|i| listed.contains(&i)).collect()
                }
                Some(v) => return Err(format!("'moe_layers' must be a list, found {v}")),
            };
            let inter = positive("intermediate_size", 8192)?;
            MoeConfig {
                num_experts: positive("num_local_experts", 16)?,
                top_k: positive("num_experts_per_tok", 1)?,
                norm_topk_prob: false,
                expert_intermediate_size: inter,
                shared_expert_intermediate_size: Some(inter),
                sigmoid_input_routing: true,
                f32_routing_weights: false,
                mixtral_names: false,
                sparse_layers,
                sparse_mixer: None,
            }
        }
        _ => return Ok(None),
    };
    if config.top_k > config.num_experts {
        return Err(format!(
            "num_experts_per_tok {} is more than the {} experts",
            config.top_k, config.num_experts
        ));
    }
    Ok(Some(config))
}

/// Defaults of transformers' config classes for keys a config may leave out, where real
/// checkpoints rely on them (Gemma 2's `Gemma2Config`, Gemma 3's `Gemma3TextConfig`, Llama 3.2
/// Vision's `MllamaTextConfig`).
fn family_defaults(model_type: &str) -> &'static [(&'static str, Value)] {
    static MLLAMA: std::sync::OnceLock<Vec<(&str, Value)>> = std::sync::OnceLock::new();
    static GEMMA2: std::sync::OnceLock<Vec<(&str, Value)>> = std::sync::OnceLock::new();
    static GEMMA3: std::sync::OnceLock<Vec<(&str, Value)>> = std::sync::OnceLock::new();
    let common = |vocab: u64, max_pos: u64| {
        vec![
            ("vocab_size", Value::from(vocab)),
            ("hidden_size", Value::from(2304u64)),
            ("intermediate_size", Value::from(9216u64)),
            ("num_hidden_layers", Value::from(26u64)),
            ("num_attention_heads", Value::from(8u64)),
            ("num_key_value_heads", Value::from(4u64)),
            ("head_dim", Value::from(256u64)),
            ("max_position_embeddings", Value::from(max_pos)),
            ("rms_norm_eps", Value::from(1e-6)),
            ("bos_token_id", Value::from(2u64)),
            ("eos_token_id", Value::from(1u64)),
            ("pad_token_id", Value::from(0u64)),
        ]
    };
    static GEMMA4: std::sync::OnceLock<Vec<(&str, Value)>> = std::sync::OnceLock::new();
    static PHI: std::sync::OnceLock<Vec<(&str, Value)>> = std::sync::OnceLock::new();
    static LLAMA4: std::sync::OnceLock<Vec<(&str, Value)>> = std::sync::OnceLock::new();
    match model_type {
        // Llama4TextConfig's (Llama 4 Scout's shape); the Llama 4 keys themselves
        // (`no_rope_layers`, `moe_layers`, `attention_chunk_size`, ...) default where they are read.
        "llama4_text" => LLAMA4.get_or_init(|| {
            vec![
                ("vocab_size", Value::from(202_048u64)),
                ("hidden_size", Value::from(5120u64)),
                ("intermediate_size", Value::from(8192u64)),
                ("intermediate_size_mlp", Value::from(16_384u64)),
                ("num_hidden_layers", Value::from(48u64)),
                ("num_attention_heads", Value::from(40u64)),
                ("num_key_value_heads", Value::from(8u64)),
                ("head_dim", Value::from(128u64)),
                ("hidden_act", Value::from("silu")),
                ("max_position_embeddings", Value::from(131_072u64)),
                ("rms_norm_eps", Value::from(1e-5)),
                ("rope_theta", Value::from(500_000.0)),
                ("bos_token_id", Value::from(1u64)),
                ("eos_token_id", Value::from(2u64)),
            ]
        }),
        // PhiConfig gives partial_rotary_factor 0.5 when a config has none.
        "phi" => PHI.get_or_init(|| {
            vec![
                ("partial_rotary_factor", Value::from(0.5)),
                ("hidden_act", Value::from("gelu_new")),
            ]
        }),
        "gemma2" | "vaultgemma" => GEMMA2.get_or_init(|| common(256_000, 8192)),
        "gemma3_text" => GEMMA3.get_or_init(|| common(262_208, 131_072)),
        // Gemma4TextConfig's: its own sizes, window and per-layer embeddings, and a proportional
        // rope on a quarter of the full-attention layers' heads.
        "gemma4_text" => GEMMA4.get_or_init(|| {
            let mut d = common(262_144, 131_072);
            d.retain(|(k, _)| *k != "num_hidden_layers");
            d.extend([
                ("num_hidden_layers", Value::from(30u64)),
                ("sliding_window", Value::from(512u64)),
                ("hidden_size_per_layer_input", Value::from(256u64)),
                ("vocab_size_per_layer_input", Value::from(262_144u64)),
                (
                    "rope_parameters",
                    serde_json::json!({
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "proportional",
                                           "partial_rotary_factor": 0.25,
                                           "rope_theta": 1_000_000.0},
                    }),
                ),
            ]);
            d
        }),
        // A top-level `rope_theta` serves only where the rope parameters hold none.
        "mllama_text_model" => MLLAMA.get_or_init(|| {
            vec![
                ("vocab_size", Value::from(128_256u64)),
                ("hidden_size", Value::from(4096u64)),
                ("hidden_act", Value::from("silu")),
                ("num_hidden_layers", Value::from(40u64)),
                ("num_attention_heads", Value::from(32u64)),
                ("num_key_value_heads", Value::from(8u64)),
                ("intermediate_size", Value::from(14_336u64)),
                ("rope_theta", Value::from(500_000.0)),
                ("rms_norm_eps", Value::from(1e-5)),
                ("max_position_embeddings", Value::from(131_072u64)),
                (
                    "cross_attention_layers",
                    Value::from(vec![3u64, 8, 13, 18, 23, 28, 33, 38]),
                ),
                ("bos_token_id", Value::from(128_000u64)),
                ("eos_token_id", Value::from(128_001u64)),
                ("pad_token_id", Value::from(128_004u64)),
            ]
        }),
        _ => &[],
    }
}

/// Multimodal `model_type`s ferrotune runs as their text model: the text `model_type`s each
/// may hold in `text_config` (the first is the default when it names none).
const MULTIMODAL_TEXT_TYPES: &[(&str, &[&str])] = &[
    ("gemma3", &["gemma3_text"]),
    ("mllama", &["mllama_text_model"]),
    // MllamaForCausalLM: Llama 3.2 Vision's text model alone, its config at the top level.
    ("mllama_text_model", &["mllama_text_model"]),
    ("mistral3", &["mistral", "ministral3", "ministral"]),
    // Llama 4 Scout / Maverick ship only as `Llama4ForConditionalGeneration`.
    ("llama4", &["llama4_text"]),
    ("qwen2_vl", &["qwen2_vl_text"]),
    ("qwen2_5_vl", &["qwen2_5_vl_text"]),
    ("qwen3_vl", &["qwen3_vl_text"]),
    ("gemma4", &["gemma4_text"]),
];

/// The family a multimodal checkpoint's text model runs as: Qwen2-VL's and Qwen2.5-VL's text
/// models are Qwen2's and Qwen3-VL's is Qwen3's once their multimodal rope (`mrope`) sees text
/// alone (every section at the same position, which is plain RoPE).
fn text_family(text_type: &str) -> &str {
    match text_type {
        "qwen2_vl_text" | "qwen2_5_vl_text" => "qwen2",
        "qwen3_vl_text" => "qwen3",
        "mllama_text_model" => "llama",
        other => other,
    }
}

/// transformers' causal-LM class of a text `model_type`, for the saved text model's config.
fn causal_lm_class(model_type: &str) -> &'static str {
    match model_type {
        "gemma3_text" => "Gemma3ForCausalLM",
        "ministral3" => "Ministral3ForCausalLM",
        "ministral" => "MinistralForCausalLM",
        "qwen2" => "Qwen2ForCausalLM",
        "qwen3" => "Qwen3ForCausalLM",
        "llama" => "LlamaForCausalLM",
        "llama4_text" => "Llama4ForCausalLM",
        "gemma4_text" => "Gemma4ForCausalLM",
        _ => "MistralForCausalLM",
    }
}

/// The text model's config of a multimodal config (Gemma 3's or Mistral 3's
/// `...ForConditionalGeneration`): its `text_config` with the token ids and dtype kept at the top
/// level, as the standalone causal LM config ferrotune runs and saves. Whether the output head is
/// tied is decided by the checkpoint's tensors when it is read (see `text_of_multimodal`).
fn multimodal_text_config(
    top: &Map<String, Value>,
    text_types: &[&str],
) -> Result<Map<String, Value>, String> {
    let mut text = match top.get("text_config") {
        Some(Value::Object(t)) => t.clone(),
        None if get_str(top, "model_type")? == Some("mllama_text_model") => top.clone(),
        // The Hub's Qwen2-VL / Qwen2.5-VL configs keep the text model's keys at the top level.
        None | Some(Value::Null) if text_types[0].starts_with("qwen") => {
            let mut t = top.clone();
            for key in ["vision_config", "model_type", "architectures"] {
                t.remove(key);
            }
            t
        }
        None | Some(Value::Null) => Map::new(),
        Some(_) => return Err("'text_config' must be an object".into()),
    };
    // Text alone puts every mrope section at the same position: plain RoPE, so the sections
    // (and 4.x's `mrope` type) are dropped.
    for key in ["rope_parameters", "rope_scaling"] {
        if let Some(Value::Object(rope)) = text.get_mut(key) {
            rope.remove("mrope_section");
            rope.remove("mrope_interleaved");
            for type_key in ["type", "rope_type"] {
                if rope.get(type_key).and_then(Value::as_str) == Some("mrope") {
                    rope.insert(type_key.into(), Value::from("default"));
                }
            }
        }
    }
    let text_type = match get_str(&text, "model_type")? {
        None => text_types[0],
        Some(t) if text_types.contains(&t) => t,
        Some(other) => {
            return Err(format!(
                "text_config.model_type is '{other}', expected one of {}",
                text_types.join(", ")
            ))
        }
    }
    .to_string();
    let family = text_family(&text_type).to_string();
    text.insert(
        "architectures".into(),
        serde_json::json!([causal_lm_class(&family)]),
    );
    for key in [
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "torch_dtype",
        "dtype",
    ] {
        match (text.get(key), top.get(key)) {
            (None | Some(Value::Null), Some(v)) if !v.is_null() => {
                text.insert(key.into(), v.clone());
            }
            _ => {}
        }
    }
    // Written out whole (defaults filled), so that the saved text model needs no class defaults.
    for (key, default) in family_defaults(&text_type) {
        text.entry(*key).or_insert_with(|| default.clone());
    }
    text.insert("model_type".into(), Value::from(family));
    Ok(text)
}

/// The decoder's name of a Llama 4 checkpoint tensor or module: `feed_forward.router` is the
/// decoder's `mlp.gate`, the rest of `feed_forward.*` its `mlp.*` (the fused experts,
/// `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, are split when the model is built).
fn llama4_decoder_name(name: &str) -> String {
    rename_layer_block(name, ("feed_forward", "router"), ("mlp", "gate"))
}

/// The inverse of [`llama4_decoder_name`]. A separate expert's projection
/// (`mlp.experts.N.gate_proj`) keeps its number: it is no module of the checkpoint, whose experts
/// are fused, so PEFT patterns never name it.
fn llama4_checkpoint_name(name: &str) -> String {
    rename_layer_block(name, ("mlp", "gate"), ("feed_forward", "router"))
}

/// `model.layers.N.{block}.*` renamed `model.layers.N.{to_block}.*`, and its router
/// `{block}.{router}` (the module itself, or its tensors) `{to_block}.{to_router}`; other names
/// as they are.
fn rename_layer_block(
    name: &str,
    (block, router): (&str, &str),
    (to_block, to_router): (&str, &str),
) -> String {
    let Some((layer, rest)) = layer_and_rest(name) else {
        return name.to_string();
    };
    let Some(inner) = rest.strip_prefix(block).and_then(|r| r.strip_prefix('.')) else {
        return name.to_string();
    };
    let inner = match inner.strip_prefix(router) {
        Some(tail) if tail.is_empty() || tail.starts_with('.') => format!("{to_router}{tail}"),
        _ => inner.to_string(),
    };
    format!("model.layers.{layer}.{to_block}.{inner}")
}

/// `(i, rest)` of a `model.layers.{i}.{rest}` name.
fn layer_and_rest(name: &str) -> Option<(usize, &str)> {
    let (n, rest) = name.strip_prefix("model.layers.")?.split_once('.')?;
    Some((n.parse().ok()?, rest))
}

/// Llama 3.2 Vision's text config (`mllama_text_model`, already turned into a `llama` config by
/// [`multimodal_text_config`], which filled in `MllamaTextConfig`'s defaults) as the Llama of
/// its self-attention layers: takes out `cross_attention_layers` (returned, sorted) and counts
/// only the other layers in `num_hidden_layers`.
fn mllama_text_layers(text: &mut Map<String, Value>) -> Result<Vec<usize>, String> {
    let listed = match text.remove("cross_attention_layers") {
        // MllamaTextConfig's default, as transformers fills it for null.
        None | Some(Value::Null) => family_defaults("mllama_text_model")
            .iter()
            .find(|(k, _)| *k == "cross_attention_layers")
            .map(|(_, v)| v.clone())
            .expect("Mllama's defaults list its cross-attention layers"),
        Some(v) => v,
    };
    let layers = req_usize(text, "num_hidden_layers")?;
    let entries = listed.as_array().ok_or_else(|| {
        format!("'cross_attention_layers' must be a list of layer numbers, found {listed}")
    })?;
    // transformers asks of each layer whether it is listed: numbers past the last layer name none.
    let mut cross = Vec::new();
    for v in entries {
        let i = v
            .as_u64()
            .ok_or_else(|| format!("'cross_attention_layers' must hold layer numbers, found {v}"))?
            as usize;
        if i < layers {
            cross.push(i);
        }
    }
    cross.sort_unstable();
    cross.dedup();
    if cross.len() == layers {
        return Err("every layer is in 'cross_attention_layers': no text layer is left".into());
    }
    text.insert(
        "num_hidden_layers".into(),
        Value::from((layers - cross.len()) as u64),
    );
    Ok(cross)
}

/// Gemma 4's per-layer structure ([`Gemma4Layers`]) from its config; `sliding` marks the
/// sliding-attention layers, `dims` is `(head_dim, num_key_value_heads, num_attention_heads)`.
fn parse_gemma4(
    obj: &Map<String, Value>,
    sliding: &[bool],
    dims: (usize, usize, usize),
    intermediate_size: usize,
) -> Result<Gemma4Layers, String> {
    let (head_dim, kv_heads, heads) = dims;
    let layers = sliding.len();
    let key_is_value_flag = get_bool(obj, "attention_k_eq_v")?.unwrap_or(false);
    let mut attention_dims = vec![(head_dim, kv_heads); layers];
    match obj.get("per_layer_config").filter(|v| !v.is_null()) {
        // What transformers writes: the overrides by layer index, authoritative.
        Some(per_layer) => {
            let per_layer = per_layer
                .as_object()
                .ok_or("'per_layer_config' must be an object of layer overrides")?;
            for (key, overrides) in per_layer {
                let at = |what: &str| format!("'per_layer_config.{key}'{what}");
                let layer: usize = key
                    .parse()
                    .ok()
                    .filter(|&l| l < layers)
                    .ok_or_else(|| at(" does not name a layer"))?;
                let overrides = overrides
                    .as_object()
                    .ok_or_else(|| at(" must be an object"))?;
                for (name, _) in overrides {
                    if !matches!(name.as_str(), "head_dim" | "num_key_value_heads") {
                        return Err(at(&format!(
                            " overrides '{name}': only head_dim and num_key_value_heads are supported"
                        )));
                    }
                }
                let (d, kv) = &mut attention_dims[layer];
                *d = get_usize(overrides, "head_dim")?.unwrap_or(*d);
                *kv = get_usize(overrides, "num_key_value_heads")?.unwrap_or(*kv);
            }
        }
        // The Hub's configs: the full-attention layers' own head size and, with
        // `attention_k_eq_v`, their own number of key/value heads.
        None => {
            let global_dim = get_usize(obj, "global_head_dim")?.unwrap_or(512);
            let global_kv = get_usize(obj, "num_global_key_value_heads")?
                .filter(|_| key_is_value_flag)
                .unwrap_or(kv_heads);
            for (dims, &s) in attention_dims.iter_mut().zip(sliding) {
                if !s {
                    *dims = (global_dim, global_kv);
                }
            }
        }
    }
    for (i, &(d, kv)) in attention_dims.iter().enumerate() {
        if d == 0 || kv == 0 || heads % kv != 0 {
            return Err(format!(
                "layer {i}: num_attention_heads {heads} is not a multiple of its {kv} key/value heads (head_dim {d})"
            ));
        }
        // One rotary table per layer type: a type's layers must share their head size.
        if let Some(j) = (0..i).find(|&j| sliding[j] == sliding[i] && attention_dims[j].0 != d) {
            return Err(format!(
                "layers {j} and {i} are of one attention type but have head_dim {} and {d}",
                attention_dims[j].0
            ));
        }
    }
    let shared = get_usize(obj, "num_kv_shared_layers")?.unwrap_or(0);
    if shared >= layers && shared > 0 {
        return Err(format!(
            "'num_kv_shared_layers' {shared} leaves no layer of the {layers} to compute keys and values"
        ));
    }
    let first_shared = layers - shared;
    let mut kv_source = vec![None; layers];
    for i in first_shared..layers {
        let source = (0..first_shared)
            .rev()
            .find(|&j| sliding[j] == sliding[i])
            .ok_or_else(|| {
                format!(
                    "layer {i} shares the keys and values of an earlier layer of its type \
                     (num_kv_shared_layers {shared}), but no unshared layer has its type"
                )
            })?;
        kv_source[i] = Some(source);
    }
    let double_wide = get_bool(obj, "use_double_wide_mlp")?.unwrap_or(false);
    let intermediate_sizes = kv_source
        .iter()
        .map(|s| intermediate_size * if double_wide && s.is_some() { 2 } else { 1 })
        .collect();
    let per_layer_input = match get_usize(obj, "hidden_size_per_layer_input")? {
        Some(0) | None => None,
        Some(dim) => Some((req_usize(obj, "vocab_size_per_layer_input")?, dim)),
    };
    let moe = if get_bool(obj, "enable_moe_block")?.unwrap_or(false) {
        let experts = req_usize(obj, "num_experts")?;
        let top_k = req_usize(obj, "top_k_experts")?;
        if top_k == 0 || top_k > experts {
            return Err(format!(
                "'top_k_experts' {top_k} must be between 1 and num_experts {experts}"
            ));
        }
        Some((experts, top_k, req_usize(obj, "moe_intermediate_size")?))
    } else {
        None
    };
    Ok(Gemma4Layers {
        attention_dims,
        key_is_value: sliding.iter().map(|&s| key_is_value_flag && !s).collect(),
        kv_source,
        intermediate_sizes,
        per_layer_input,
        moe,
    })
}

/// Gemma 2/3: which layers use sliding-window attention, from `layer_types` or, in older configs,
/// the pattern transformers derives (every `sliding_window_pattern`-th layer is full attention:
/// 2 for Gemma 2, `sliding_window_pattern` (default 6) for Gemma 3).
fn gemma_sliding_layers(
    obj: &Map<String, Value>,
    model_type: &str,
    layers: usize,
) -> Result<Vec<bool>, String> {
    if let Some(sliding) = layer_types_marking(obj, "sliding_attention", layers)? {
        return Ok(sliding);
    }
    let pattern = if model_type == "gemma2" || model_type == "vaultgemma" {
        2
    } else {
        get_usize(obj, "sliding_window_pattern")?.unwrap_or(6)
    };
    if pattern == 0 {
        return Err("'sliding_window_pattern' must be at least 1".into());
    }
    Ok((0..layers).map(|i| (i + 1) % pattern != 0).collect())
}

/// A number that must be positive when given (caps, scalars).
fn get_positive(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, String> {
    match get_f64(obj, key)? {
        Some(v) if v <= 0.0 || !v.is_finite() => {
            Err(format!("'{key}' must be a positive number, found {v}"))
        }
        other => Ok(other),
    }
}

/// The number of outputs of a `*ForSequenceClassification` checkpoint's `score` head, as
/// transformers' `PretrainedConfig` sets it: `num_labels`, else the size of `id2label`, else 2;
/// `None` for any other architecture.
fn parse_score_labels(obj: &Map<String, Value>) -> Result<Option<usize>, String> {
    let classifier = obj
        .get("architectures")
        .and_then(Value::as_array)
        .is_some_and(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .any(|name| name.ends_with("ForSequenceClassification"))
        });
    if !classifier {
        return Ok(None);
    }
    let labels = match get_usize(obj, "num_labels")? {
        Some(n) => n,
        None => match obj.get("id2label").and_then(Value::as_object) {
            Some(map) => map.len(),
            None => 2,
        },
    };
    if labels == 0 {
        return Err(
            "a sequence classifier needs at least one label (num_labels / id2label)".into(),
        );
    }
    Ok(Some(labels))
}

fn get_str<'a>(obj: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(format!("'{key}' must be a string, found {v}")),
    }
}

fn get_f64(obj: &Map<String, Value>, key: &str) -> Result<Option<f64>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("'{key}' must be a number, found {v}")),
    }
}

fn get_usize(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| format!("'{key}' must be a non-negative integer, found {v}")),
    }
}

fn req_usize(obj: &Map<String, Value>, key: &str) -> Result<usize, String> {
    get_usize(obj, key)?.ok_or_else(|| format!("missing key '{key}'"))
}

fn get_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, String> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(format!("'{key}' must be true or false, found {v}")),
    }
}

/// Token ids that may be a single integer or a list (`eos_token_id: [128001, 128009]`).
fn get_ids(obj: &Map<String, Value>, key: &str) -> Result<Vec<u32>, String> {
    let as_id = |v: &Value| {
        v.as_u64()
            .map(|n| n as u32)
            .ok_or_else(|| format!("'{key}' must hold token ids, found {v}"))
    };
    match obj.get(key) {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Array(a)) => a.iter().map(as_id).collect(),
        Some(v) => Ok(vec![as_id(v)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
               "num_hidden_layers": 2, "num_attention_heads": 2})
    }

    /// Llama 3.2 Vision's text config takes `MllamaTextConfig`'s defaults for what it leaves out
    /// (the Hub's configs spell most of them out), cross-attention layers included: null or absent
    /// means 3, 8, ..., 38, and numbers past the last layer name none.
    #[test]
    fn llama_3_2_vision_takes_mllama_text_defaults() {
        let config =
            ModelConfig::from_hf_json(&json!({"model_type": "mllama", "text_config": {}})).unwrap();
        assert_eq!(config.model_type, "llama");
        let mllama = config.mllama.as_ref().unwrap();
        assert_eq!(
            mllama.cross_attention_layers,
            [3, 8, 13, 18, 23, 28, 33, 38]
        );
        assert_eq!(mllama.text_prefix, "model.language_model.");
        assert_eq!(config.num_hidden_layers, 32);
        assert_eq!((config.hidden_size, config.vocab_size), (4096, 128_256));
        assert_eq!(
            (config.num_attention_heads, config.num_key_value_heads),
            (32, 8)
        );
        assert_eq!(config.rms_norm_eps, 1e-5);
        assert_eq!(config.rope.theta, 500_000.0);
        assert_eq!(config.bos_token_id, Some(128_000));
        assert_eq!(config.pad_token_id, Some(128_004));

        let small = json!({"model_type": "mllama_text_model", "num_hidden_layers": 10,
                           "cross_attention_layers": null, "hidden_size": 64,
                           "num_attention_heads": 4, "num_key_value_heads": 2,
                           "intermediate_size": 128, "vocab_size": 100,
                           "rope_theta": 10000.0});
        let config = ModelConfig::from_hf_json(&small).unwrap();
        let mllama = config.mllama.as_ref().unwrap();
        assert_eq!(mllama.cross_attention_layers, [3, 8]);
        assert_eq!(mllama.text_prefix, "model.");
        assert_eq!(config.num_hidden_layers, 8);
        assert_eq!(config.rope.theta, 10_000.0);
        assert_eq!(config.raw["architectures"][0], "LlamaForCausalLM");

        let all = json!({"model_type": "mllama_text_model", "num_hidden_layers": 2,
                         "cross_attention_layers": [0, 1]});
        let err = ModelConfig::from_hf_json(&all).unwrap_err();
        assert!(err.contains("no text layer"), "{err}");
    }

    #[test]
    fn v4_and_v5_rope_styles_agree() {
        let mut v4 = base();
        v4["rope_theta"] = json!(500000.0);
        v4["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
        let mut v5 = base();
        v5["rope_parameters"] = json!({"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
        let a = ModelConfig::from_hf_json(&v4).unwrap();
        let b = ModelConfig::from_hf_json(&v5).unwrap();
        assert_eq!(a.rope, b.rope);
        assert_eq!(a.rope.theta, 500000.0);
        assert!(matches!(
            a.rope.scaling,
            RopeScaling::Llama3 {
                original_max_position_embeddings: 64,
                ..
            }
        ));
    }

    #[test]
    fn training_caveats_name_what_training_leaves_out() {
        let mut c = base();
        assert!(ModelConfig::from_hf_json(&c)
            .unwrap()
            .training_caveats()
            .is_empty());
        c["model_type"] = json!("mixtral");
        c["num_local_experts"] = json!(4);
        c["num_experts_per_tok"] = json!(2);
        c["output_router_logits"] = json!(true);
        c["router_aux_loss_coef"] = json!(0.02);
        c["router_jitter_noise"] = json!(0.0);
        // The auxiliary loss is applied (not a caveat); its weight is read.
        let config = ModelConfig::from_hf_json(&c).unwrap();
        assert!(config.training_caveats().is_empty());
        assert_eq!(config.router_aux_loss_coef(), Some(0.02));
        c["output_router_logits"] = json!(false);
        assert_eq!(
            ModelConfig::from_hf_json(&c)
                .unwrap()
                .router_aux_loss_coef(),
            None
        );
        c["router_jitter_noise"] = json!(0.1);
        let caveats = ModelConfig::from_hf_json(&c).unwrap().training_caveats();
        assert_eq!(caveats.len(), 1, "{caveats:?}");
        assert!(
            caveats[0].contains("router_jitter_noise 0.1"),
            "{caveats:?}"
        );
        let mut phi = base();
        phi["model_type"] = json!("phi");
        phi["resid_pdrop"] = json!(0.1);
        phi["embd_pdrop"] = json!(0.0);
        phi["attention_dropout"] = json!(0.0);
        let caveats = ModelConfig::from_hf_json(&phi).unwrap().training_caveats();
        assert_eq!(
            caveats,
            vec!["resid_pdrop 0.1 (dropout) is not applied".to_string()]
        );
        c["attention_dropout"] = json!(0.1);
        let caveats = ModelConfig::from_hf_json(&c).unwrap().training_caveats();
        assert!(
            caveats.iter().any(|w| w.contains("attention_dropout 0.1")),
            "{caveats:?}"
        );
    }

    #[test]
    fn unsupported_model_type_lists_supported_ones() {
        let mut c = base();
        c["model_type"] = json!("gpt_neox");
        let err = ModelConfig::from_hf_json(&c).unwrap_err();
        assert!(
            err.contains("gpt_neox") && err.contains("qwen3") && err.contains("phi3"),
            "{err}"
        );
    }

    #[test]
    fn family_switches_and_eos_lists() {
        let mut c = base();
        c["model_type"] = json!("gemma");
        c["eos_token_id"] = json!([1, 107]);
        let g = ModelConfig::from_hf_json(&c).unwrap();
        assert!(g.norm_weight_offset_one && g.scale_embeddings && g.tie_word_embeddings);
        assert_eq!(g.activation, Activation::GeluTanh);
        assert_eq!(g.eos_token_ids, vec![1, 107]);
        c["model_type"] = json!("qwen2");
        c["sliding_window"] = json!(4);
        c["use_sliding_window"] = json!(false);
        assert_eq!(
            ModelConfig::from_hf_json(&c).unwrap().layer_sliding_windows,
            vec![None, None]
        );
        c["model_type"] = json!("mistral");
        assert_eq!(
            ModelConfig::from_hf_json(&c).unwrap().layer_sliding_windows,
            vec![Some(4), Some(4)]
        );
    }

    #[test]
    fn gemma2_defaults_follow_transformers_and_null_disables() {
        let mut c = base();
        c["model_type"] = json!("gemma2");
        c["num_key_value_heads"] = json!(1);
        c["num_hidden_layers"] = json!(4);
        let g = ModelConfig::from_hf_json(&c).unwrap();
        // Absent keys: transformers' Gemma2Config defaults.
        assert_eq!(g.attn_logit_softcapping, Some(50.0));
        assert_eq!(g.final_logit_softcapping, Some(30.0));
        assert_eq!(g.query_pre_attn_scalar, Some(256.0));
        assert!(g.sandwich_norms && g.norm_weight_offset_one && g.tie_word_embeddings);
        assert!(!g.qk_norm && g.local_rope.is_none());
        // Even layers slide (window 4096), odd ones attend fully.
        assert_eq!(
            g.layer_sliding_windows,
            vec![Some(4096), None, Some(4096), None]
        );
        c["attn_logit_softcapping"] = Value::Null;
        c["final_logit_softcapping"] = Value::Null;
        c["sliding_window"] = Value::Null;
        let g = ModelConfig::from_hf_json(&c).unwrap();
        assert_eq!(g.attn_logit_softcapping, None);
        assert_eq!(g.final_logit_softcapping, None);
        assert_eq!(g.layer_sliding_windows, vec![None; 4]);
        c["attn_logit_softcapping"] = json!(-1.0);
        let err = ModelConfig::from_hf_json(&c).unwrap_err();
        assert!(err.contains("attn_logit_softcapping"), "{err}");
    }

    #[test]
    fn gemma3_rope_per_layer_type_in_both_config_styles() {
        let mut c = base();
        c["model_type"] = json!("gemma3_text");
        c["num_key_value_heads"] = json!(1);
        c["num_hidden_layers"] = json!(7);
        c["sliding_window"] = json!(512);
        // 4.x: rope_theta / rope_scaling for the global layers, rope_local_base_freq, pattern 6.
        c["rope_theta"] = json!(1000000.0);
        c["rope_local_base_freq"] = json!(10000.0);
        c["rope_scaling"] = json!({"rope_type": "linear", "factor": 8.0});
        let v4 = ModelConfig::from_hf_json(&c).unwrap();
        assert!(v4.qk_norm && v4.sandwich_norms);
        assert_eq!(v4.attn_logit_softcapping, None);
        assert_eq!(
            v4.local_rope_layers,
            vec![true, true, true, true, true, false, true]
        );
        assert_eq!(v4.layer_sliding_windows[5], None);
        assert_eq!(v4.layer_sliding_windows[6], Some(512));
        assert_eq!(v4.rope.theta, 1000000.0);
        assert_eq!(v4.rope.scaling, RopeScaling::Linear { factor: 8.0 });
        let local = v4.local_rope.clone().unwrap();
        assert_eq!(
            (local.theta, local.scaling),
            (10000.0, RopeScaling::Default)
        );
        // 5.x: rope_parameters per layer type, layer_types listed.
        let mut v5 = base();
        v5["model_type"] = json!("gemma3_text");
        v5["num_key_value_heads"] = json!(1);
        v5["num_hidden_layers"] = json!(7);
        v5["sliding_window"] = json!(512);
        v5["layer_types"] = json!(v4
            .local_rope_layers
            .iter()
            .map(|&s| if s {
                "sliding_attention"
            } else {
                "full_attention"
            })
            .collect::<Vec<_>>());
        v5["rope_parameters"] = json!({
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}});
        let v5 = ModelConfig::from_hf_json(&v5).unwrap();
        assert_eq!(v5.rope, v4.rope);
        assert_eq!(v5.local_rope, v4.local_rope);
        assert_eq!(v5.layer_sliding_windows, v4.layer_sliding_windows);
        // Nothing given: theta 1e6 globally, 1e4 locally.
        let mut bare = base();
        bare["model_type"] = json!("gemma3_text");
        bare["num_key_value_heads"] = json!(1);
        let bare = ModelConfig::from_hf_json(&bare).unwrap();
        assert_eq!(bare.rope.theta, 1_000_000.0);
        assert_eq!(bare.local_rope.unwrap().theta, 10_000.0);
    }

    #[test]
    fn gemma_configs_that_cannot_run_say_why() {
        let mut c = base();
        c["model_type"] = json!("gemma3_text");
        c["num_key_value_heads"] = json!(1);
        c["layer_types"] = json!(["sliding_attention", "chunked_attention"]);
        let err = ModelConfig::from_hf_json(&c).unwrap_err();
        assert!(err.contains("chunked_attention"), "{err}");
        c["layer_types"] = json!(["sliding_attention"]);
        let err = ModelConfig::from_hf_json(&c).unwrap_err();
        assert!(err.contains("layer_types") && err.contains("2"), "{err}");
        let mut c = base();
        c["model_type"] = json!("gemma3_text");
        c["num_key_value_heads"] = json!(1);
        c["use_bidirectional_attention"] = json!(true);
        let err = ModelConfig::from_hf_json(&c).unwrap_err();
        assert!(err.contains("use_bidirectional_attention"), "{err}");
    }

    #[test]
    fn phi2_switches_and_partial_rotary_defaults() {
        let mut c = base();
        c["model_type"] = json!("phi");
        c["layer_norm_eps"] = json!(1e-5);
        // Phi-2's own 4.x config: partial_rotary_factor 0.4 at the top level.
        c["partial_rotary_factor"] = json!(0.4);
        c["rope_theta"] = json!(10000.0);
        let p = ModelConfig::from_hf_json(&c).unwrap();
        assert!(p.layer_norm && p.parallel_block && p.ungated_mlp);
        assert!(!p.sandwich_norms && !p.norm_weight_offset_one && !p.tie_word_embeddings);
        assert_eq!(p.rope.partial_rotary_factor, 0.4);
        assert_eq!(p.rms_norm_eps, 1e-5);
        assert_eq!(p.activation, Activation::GeluTanh);
        // Absent: PhiConfig's default 0.5.
        c.as_object_mut().unwrap().remove("partial_rotary_factor");
        assert_eq!(
            ModelConfig::from_hf_json(&c)
                .unwrap()
                .rope
                .partial_rotary_factor,
            0.5
        );
        c["qk_layernorm"] = json!(true);
        let err = ModelConfig::from_hf_json(&c).unwrap_err();
        assert!(err.contains("qk_layernorm"), "{err}");
    }

    #[test]
    fn wrong_types_name_the_key() {
        let mut c = base();
        c["hidden_size"] = json!("big");
        assert!(ModelConfig::from_hf_json(&c)
            .unwrap_err()
            .contains("hidden_size"));
        let mut c = base();
        c["rope_parameters"] = json!({"rope_type": "fancy"});
        assert!(ModelConfig::from_hf_json(&c).unwrap_err().contains("fancy"));
    }
}
