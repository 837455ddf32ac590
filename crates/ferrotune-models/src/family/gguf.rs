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

/// The config keys a model type's GGUF metadata gives beyond what every architecture shares.
pub type GgufConfigKeys =
    fn(&dyn GgufMetadata, &GgufHParams, &mut Map<String, Value>) -> Result<(), ModelError>;

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
pub fn no_keys(
    _: &dyn GgufMetadata,
    _: &GgufHParams,
    _: &mut Map<String, Value>,
) -> Result<(), ModelError> {
    Ok(())
}

/// Llama's attention biases, as the file's tensors show them (`attention_bias`), and no MLP bias.
pub fn llama_biases(g: &dyn GgufMetadata, c: &mut Map<String, Value>) {
    let bias = g.has_tensor("blk.0.attn_q.bias");
    c.insert("attention_bias".into(), json!(bias));
    c.insert("mlp_bias".into(), json!(false));
}
