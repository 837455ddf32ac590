//! What the GGUF reader needs to know of a family's llama.cpp files, beyond the architecture's
//! name ([`super::GgufArch`]): how the model type's tensors are named, which hyperparameters its
//! architecture fixes, and the config keys its metadata holds ([`GgufReading`]).

use serde_json::{json, Map, Value};

use crate::error::ModelError;

/// The GGUF file as a family's reading sees it: its metadata and which tensors it holds.
pub trait GgufMetadata {
    /// `general.architecture`, the prefix of the architecture's keys.
    fn arch(&self) -> &str;
    /// An integer metadata value; an error when the key holds something else.
    fn uint(&self, key: &str) -> Result<Option<u64>, ModelError>;
    /// A number metadata value; an error when the key holds something else.
    fn float(&self, key: &str) -> Result<Option<f64>, ModelError>;
    /// A boolean metadata value (`None` when absent or not a boolean).
    fn flag(&self, key: &str) -> Option<bool>;
    /// Whether the file holds the tensor `name`.
    fn has_tensor(&self, name: &str) -> bool;
}

/// The hyperparameters read from a GGUF file's metadata.
#[derive(Debug, Clone)]
pub struct GgufHParams {
    pub vocab: usize,
    pub hidden: usize,
    pub ffn: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub rope_dims: usize,
    pub context: usize,
    pub rms_eps: f64,
    pub rope_theta: f64,
    /// Mixture of experts: experts per sparse layer (0: a dense model).
    pub experts: usize,
    /// Experts each token is routed to.
    pub experts_used: usize,
    /// Each expert's intermediate size.
    pub expert_ffn: usize,
    /// Qwen2-MoE's shared expert's intermediate size.
    pub shared_ffn: Option<usize>,
    /// Which layers are sparse (they have a router, `ffn_gate_inp`); the rest are dense MLPs.
    pub sparse_layers: Vec<bool>,
}

/// What a model type's config keys are read from: the file and its hyperparameters.
#[derive(Clone, Copy)]
pub struct GgufSource<'a> {
    /// The file's metadata and tensors.
    pub file: &'a dyn GgufMetadata,
    /// The hyperparameters read from it.
    pub hp: &'a GgufHParams,
}

/// The config keys a model type's GGUF metadata gives beyond what every architecture shares.
pub type GgufConfigKeys = fn(GgufSource, &mut Map<String, Value>) -> Result<(), ModelError>;

/// How the GGUF reader reads one model type's files.
#[derive(Debug, Clone, Copy)]
pub struct GgufReading {
    /// How its tensors map to transformers' names.
    pub names: GgufNames,
    /// Four norms per layer (Gemma 2/3): `ffn_norm` is the MLP's own pre-norm and
    /// `post_attention_norm` the attention output's norm.
    pub sandwich_norms: bool,
    /// Without `attention.key_length`, the head size is `rope.dimension_count` (llama.cpp's llama
    /// converter writes it there, and transformers reads it so).
    pub head_dim_from_rope: bool,
    /// Rotary embeddings over part of each head are allowed.
    pub partial_rotary: bool,
    /// The activation keys of the config (`hidden_act`, Gemma's `hidden_activation`).
    pub activation: &'static [(&'static str, &'static str)],
    /// Rotary scaling llama.cpp keeps in tensors rather than keys.
    pub rope_tensors: GgufRopeTensors,
    /// The mixture of experts, for the sparse families.
    pub moe: Option<GgufMoe>,
    /// The model type's own config keys.
    pub config_keys: GgufConfigKeys,
}

/// How a model type's GGUF tensors map to transformers' names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufNames {
    /// Llama's names.
    Llama,
    /// Phi-2's: `attn_qkv` split into q/k/v, `dense`, ungated `fc1`/`fc2`, `final_layernorm`,
    /// LayerNorm (`attention.layer_norm_epsilon`).
    Phi2,
    /// Phi-3's: fused `qkv_proj`, and `ffn_up` holding the fused `gate_up_proj`.
    Phi3,
}

/// Rotary scaling kept in tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufRopeTensors {
    None,
    /// Llama 3.x: `rope_freqs` holds the frequency factors (fitted back to `llama3` scaling).
    Llama3Freqs,
    /// Phi-3: `rope_factors_long` / `rope_factors_short`, LongRoPE's per-frequency factors.
    LongRopeFactors,
}

/// A sparse model type's experts in GGUF.
#[derive(Debug, Clone, Copy)]
pub struct GgufMoe {
    /// Mixtral's module names (`block_sparse_moe`, experts' `w1`/`w3`/`w2`).
    pub mixtral_names: bool,
    /// The experts are `feed_forward_length` wide (Mixtral), not
    /// `expert_feed_forward_length`.
    pub expert_ffn_is_ffn: bool,
    /// A shared expert (Qwen2-MoE: `expert_shared_feed_forward_length`, `ffn_*_shexp`).
    pub shared_expert: bool,
    /// Every layer must be sparse (Mixtral).
    pub all_sparse: bool,
}

impl GgufReading {
    /// What decides a model's tensor names in GGUF: this reading's names and experts, with or
    /// without four norms a layer (`sandwich_norms`).
    pub fn naming(&self, sandwich_norms: bool) -> GgufNaming {
        GgufNaming {
            names: self.names,
            sandwich_norms,
            mixtral_names: self.moe.is_some_and(|m| m.mixtral_names),
        }
    }

    /// Llama's reading: its names, SiLU, no key of its own.
    pub const LLAMA: Self = Self {
        names: GgufNames::Llama,
        sandwich_norms: false,
        head_dim_from_rope: false,
        partial_rotary: false,
        activation: &[("hidden_act", "silu")],
        rope_tensors: GgufRopeTensors::None,
        moe: None,
        config_keys: no_keys,
    };
}

/// A model type whose GGUF metadata holds no config key of its own.
pub fn no_keys(_: GgufSource, _: &mut Map<String, Value>) -> Result<(), ModelError> {
    Ok(())
}

/// Llama's attention biases, as the file's tensors show them (`attention_bias`), and no MLP bias.
pub fn llama_biases(g: &dyn GgufMetadata, c: &mut Map<String, Value>) {
    let bias = g.has_tensor("blk.0.attn_q.bias");
    c.insert("attention_bias".into(), json!(bias));
    c.insert("mlp_bias".into(), json!(false));
}

/// What llama.cpp fixes for one architecture, for the GGUF writer: a checkpoint that differs is
/// refused (the file would compute something else), and the architecture's own keys and tensors.
#[derive(Debug, Clone, Copy)]
pub struct GgufWriting {
    /// llama.cpp always uses the embeddings as the output head (Gemma, Gemma 2): an
    /// `output.weight` in the file would make it refuse the file.
    pub tied_head_only: bool,
    /// llama.cpp requires the file's own `output.weight` (Phi-2, Qwen2-MoE): a tied head is
    /// written out as the embedding's copy.
    pub output_required: bool,
    /// Which layers llama.cpp makes sliding-window layers.
    pub windows: GgufWindows,
    /// llama.cpp leaves RoPE out of every fourth layer (SmolLM3), and nowhere else.
    pub nope_every_fourth: bool,
    /// Whether llama.cpp renormalizes a mixture of experts' top-k weights.
    pub moe_norm_topk: bool,
    /// The experts' width is written as `expert_feed_forward_length` (llama's Mixtral writes
    /// `feed_forward_length`).
    pub expert_ffn_key: bool,
    /// Rotary embeddings over part of each head are allowed.
    pub partial_rotary: bool,
    /// Gemma 2/3: llama.cpp scales scores by the head size, but by hidden / heads for the model
    /// with this many layers (the 27B).
    pub score_scale_27b_layers: Option<usize>,
    /// Rotary scaling llama.cpp keeps in tensors (Llama 3's `rope_freqs`, Phi-3's factors).
    pub rope_tensors: GgufRopeTensors,
    /// llama.cpp's keys for the logit softcaps (Gemma 2).
    pub softcaps: bool,
    /// llama.cpp sizes the q bias by the hidden size (its llama).
    pub q_bias_hidden_size: bool,
    /// llama.cpp's `LLM_TYPE_70B`, which the k-quant mixes treat apart.
    pub seventy_b: fn(&crate::ModelConfig) -> bool,
    /// The architecture's own refusals (Gemma 3's fixed local rope, ...).
    pub check: fn(&crate::ModelConfig) -> Result<(), String>,
    /// What the file cannot carry that llama.cpp would need, for the user to know.
    pub note: fn(&crate::ModelConfig) -> Option<String>,
}

/// Which layers llama.cpp's architecture makes sliding-window layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufWindows {
    /// None.
    None,
    /// Every other layer from the first (Gemma 2).
    EveryOther,
    /// Five sliding layers, then a full one (Gemma 3's fixed pattern of 6).
    FiveOfSix,
    /// All of them when the model has a window (Phi-3).
    AllOrNone,
}

impl GgufWriting {
    /// An architecture that fixes nothing beyond llama.cpp's defaults.
    pub const PLAIN: Self = Self {
        tied_head_only: false,
        output_required: false,
        windows: GgufWindows::None,
        nope_every_fourth: false,
        moe_norm_topk: true,
        expert_ffn_key: true,
        partial_rotary: false,
        score_scale_27b_layers: None,
        rope_tensors: GgufRopeTensors::None,
        softcaps: false,
        q_bias_hidden_size: false,
        seventy_b: |_| false,
        check: |_| Ok(()),
        note: |_| None,
    };
}

/// When a pair of [`TENSOR_NAMES`] applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum When {
    Always,
    /// Four norms per layer (Gemma 2/3).
    Sandwich,
    /// These tensor names ([`GgufNames`]).
    Names(GgufNames),
    /// Mixtral's expert block names.
    MixtralNames,
}

/// What decides a model's tensor names in GGUF.
#[derive(Debug, Clone, Copy)]
pub struct GgufNaming {
    pub names: GgufNames,
    pub sandwich_norms: bool,
    pub mixtral_names: bool,
}

impl GgufNaming {
    fn applies(&self, when: When) -> bool {
        match when {
            When::Always => true,
            When::Sandwich => self.sandwich_norms,
            When::Names(n) => self.names == n,
            When::MixtralNames => self.mixtral_names,
        }
    }

    /// transformers' module (under `model.` or `model.layers.N.`, or `lm_head`) of llama.cpp's
    /// tensor `part` (`token_embd`, or under `blk.N.`), without `.weight` / `.bias`.
    pub fn hf_module(&self, part: &str, in_layer: bool) -> Option<&'static str> {
        TENSOR_NAMES
            .iter()
            .find(|t| t.in_layer == in_layer && t.gguf == part && self.applies(t.when))
            .map(|t| t.hf)
    }

    /// llama.cpp's tensor of transformers' module `module`: the inverse of
    /// [`GgufNaming::hf_module`].
    pub fn gguf_part(&self, module: &str, in_layer: bool) -> Option<&'static str> {
        TENSOR_NAMES
            .iter()
            .find(|t| t.in_layer == in_layer && t.hf == module && self.applies(t.when))
            .map(|t| t.gguf)
    }
}

/// One tensor's name in llama.cpp's files and in transformers' checkpoints.
#[derive(Debug)]
pub struct TensorName {
    /// llama.cpp's name: `token_embd`, or `attn_q` under `blk.N.`.
    pub gguf: &'static str,
    /// transformers' module: `model.embed_tokens`, or `self_attn.q_proj` under `model.layers.N.`.
    pub hf: &'static str,
    /// Under a layer (`blk.N.` / `model.layers.N.`).
    pub in_layer: bool,
    pub when: When,
}

impl TensorName {
    /// The pair applies only `when`.
    const fn when(mut self, when: When) -> Self {
        self.when = when;
        self
    }
}

/// A pair outside the layers that always applies.
const fn top(gguf: &'static str, hf: &'static str) -> TensorName {
    TensorName {
        gguf,
        hf,
        in_layer: false,
        when: When::Always,
    }
}

/// A pair under a layer that always applies.
const fn layer(gguf: &'static str, hf: &'static str) -> TensorName {
    TensorName {
        in_layer: true,
        ..top(gguf, hf)
    }
}

/// llama.cpp's tensor names and transformers' module names, for the GGUF reader and writer alike:
/// the first pair that applies wins, either way. The experts themselves (stacked in GGUF, one
/// module each in transformers 4.x's names) are named by the reader and writer.
pub const TENSOR_NAMES: &[TensorName] = &[
    top("token_embd", "model.embed_tokens"),
    top("output_norm", "model.final_layernorm").when(When::Names(GgufNames::Phi2)),
    top("output_norm", "model.norm"),
    top("output", "lm_head"),
    layer("attn_norm", "input_layernorm"),
    // Gemma 2/3: `ffn_norm` is the MLP's own pre-norm, `post_attention_norm` the attention
    // output's norm; elsewhere `ffn_norm` is `post_attention_layernorm`, the MLP's pre-norm.
    layer("ffn_norm", "pre_feedforward_layernorm").when(When::Sandwich),
    layer("post_attention_norm", "post_attention_layernorm").when(When::Sandwich),
    layer("ffn_norm", "post_attention_layernorm"),
    layer("post_attention_norm", "post_attention_layernorm"),
    layer("post_ffw_norm", "post_feedforward_layernorm"),
    layer("attn_q", "self_attn.q_proj"),
    layer("attn_k", "self_attn.k_proj"),
    layer("attn_v", "self_attn.v_proj"),
    // Phi-2: `dense`, and the ungated MLP's `fc1` / `fc2`.
    layer("attn_output", "self_attn.dense").when(When::Names(GgufNames::Phi2)),
    layer("attn_output", "self_attn.o_proj"),
    layer("attn_qkv", "self_attn.qkv_proj"),
    layer("attn_q_norm", "self_attn.q_norm"),
    layer("attn_k_norm", "self_attn.k_norm"),
    layer("ffn_gate", "mlp.gate_proj"),
    // Phi-3's fused gate and up projection is stored as `ffn_up`.
    layer("ffn_up", "mlp.gate_up_proj").when(When::Names(GgufNames::Phi3)),
    layer("ffn_up", "mlp.fc1").when(When::Names(GgufNames::Phi2)),
    layer("ffn_up", "mlp.up_proj"),
    layer("ffn_down", "mlp.fc2").when(When::Names(GgufNames::Phi2)),
    layer("ffn_down", "mlp.down_proj"),
    // A mixture of experts' router, and Qwen2-MoE's shared expert with its gate.
    layer("ffn_gate_inp", "block_sparse_moe.gate").when(When::MixtralNames),
    layer("ffn_gate_inp", "mlp.gate"),
    layer("ffn_gate_shexp", "mlp.shared_expert.gate_proj"),
    layer("ffn_up_shexp", "mlp.shared_expert.up_proj"),
    layer("ffn_down_shexp", "mlp.shared_expert.down_proj"),
    layer("ffn_gate_inp_shexp", "mlp.shared_expert_gate"),
];
