//! Qwen3.5 (`qwen3_5_text` dense, `qwen3_5_moe_text` sparse): layers of Gated DeltaNet linear
//! attention ([`DeltaNetConfig`]) with every `full_attention_interval`-th layer (4) a gated full
//! attention (`q_proj` giving each head's query and an output gate, per-head q/k norms, partial
//! rotary embedding); zero-centred RMSNorms (`x̂ · (1 + w)`). The sparse model's every layer is
//! a mixture of experts ([`MoeConfig`]: softmax top-k, always renormalized; a shared expert
//! scaled by `sigmoid(shared_expert_gate x)`; experts fused in the checkpoint as
//! `experts.gate_up_proj` / `experts.down_proj`). The multimodal checkpoints (`qwen3_5`,
//! `qwen3_5_moe`) run as their text model (`model.language_model.*`, the vision tower left
//! out). Qwen3-Next (`qwen3_next`) has the same layers with the DeltaNet's projections fused
//! per key head (`in_proj_qkvz`, `in_proj_ba`) and Qwen's `decoder_sparse_step` /
//! `mlp_only_layers` / `norm_topk_prob`. Read as transformers 5.24's `Qwen3_5TextConfig`,
//! `Qwen3_5MoeTextConfig` and `Qwen3NextConfig` define them.
//!
//! llama.cpp's `qwen35`, `qwen35moe` and `qwen3next` files ([`GGUF_ARCHS`]) are read (the models
//! crate's `gguf/qwen35.rs`) and written (ferrotune-export's `gguf/qwen35.rs`) through one table
//! of names and of what convert_hf_to_gguf.py does to each tensor ([`GGUF_TOP_TENSORS`],
//! [`GGUF_LAYER_TENSORS`], [`tile_v_heads`]).

use super::prelude::*;
use crate::config::hf::{get_bool, get_usize, layer_list, parse_rope, positive};
use crate::config::{DeltaNetConfig, MoeConfig, RopeConfig};

/// The Qwen3.5 family.
pub static FAMILY: Family = Family {
    multimodal: &[
        Multimodal::new("qwen3_5", &["qwen3_5_text"]),
        Multimodal::new("qwen3_5_moe", &["qwen3_5_moe_text"]),
    ],
    ..Family::new(
        "Qwen3.5",
        &[
            ModelType::new("qwen3_5_text", "Qwen3_5ForCausalLM"),
            ModelType::new("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
            ModelType::new("qwen3_next", "Qwen3NextForCausalLM"),
        ],
        &Qwen35Rules,
    )
};

/// Qwen3.5's reading of its configs.
#[derive(Debug)]
struct Qwen35Rules;

impl HfConfig for Qwen35Rules {
    /// No layer slides (Qwen's gated reading: only with `use_sliding_window`).
    fn window_style(&self) -> WindowStyle {
        WindowStyle::Gated
    }

    /// `partial_rotary_factor` defaults to 0.25 (transformers sets it before reading the rope
    /// parameters); the text model's multimodal rope is plain RoPE on text alone.
    fn rope(&self, hf: HfSource, max_pos: usize) -> HfResult<RopeConfig> {
        let mut rope = parse_rope(hf.obj, max_pos, 10000.0, false)?;
        let given = |o: &Map<String, Value>| o.contains_key("partial_rotary_factor");
        let in_params = ["rope_parameters", "rope_scaling"]
            .iter()
            .any(|k| hf.obj.get(*k).and_then(Value::as_object).is_some_and(given));
        if !given(hf.obj) && !in_params {
            rope.partial_rotary_factor = 0.25;
        }
        Ok(rope)
    }

    fn configure(&self, hf: HfSource, c: &mut ModelConfig) -> HfResult<()> {
        let obj = hf.obj;
        c.qk_norm = true;
        c.norm_weight_offset_one = true;
        c.attn_output_gate = true;
        let layers = c.num_hidden_layers;
        let linear: Vec<bool> = match obj.get("layer_types") {
            Some(Value::Array(types)) => {
                if types.len() != layers {
                    return Err(format!(
                        "layer_types lists {} layers, num_hidden_layers is {layers}",
                        types.len()
                    ));
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        Some("linear_attention") => Ok(true),
                        Some("full_attention") => Ok(false),
                        other => Err(format!(
                            "layer_types: '{}' is neither 'linear_attention' nor \
                             'full_attention'",
                            other.unwrap_or("(not a string)")
                        )),
                    })
                    .collect::<HfResult<_>>()?
            }
            Some(Value::Null) | None => {
                let interval = positive(obj, "full_attention_interval", 4)?;
                (0..layers).map(|i| (i + 1) % interval != 0).collect()
            }
            Some(_) => return Err("'layer_types' must be a list".into()),
        };
        let d = DeltaNetConfig {
            layers: linear,
            key_heads: positive(obj, "linear_num_key_heads", 16)?,
            value_heads: positive(obj, "linear_num_value_heads", 32)?,
            key_head_dim: positive(obj, "linear_key_head_dim", 128)?,
            value_head_dim: positive(obj, "linear_value_head_dim", 128)?,
            conv_kernel: positive(obj, "linear_conv_kernel_dim", 4)?,
            fused_projections: hf.model_type == "qwen3_next",
        };
        if !d.value_heads.is_multiple_of(d.key_heads) {
            return Err(format!(
                "linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
                d.value_heads, d.key_heads
            ));
        }
        if get_usize(obj, "head_dim")?.is_none() {
            // `Qwen3_5TextConfig`'s default head size, not hidden / heads.
            c.head_dim = 256;
        }
        c.delta_net = Some(d);
        c.moe = match hf.model_type {
            "qwen3_5_moe_text" => Some(parse_moe(obj, layers)?),
            "qwen3_next" => parse_next_moe(obj, layers)?,
            _ => None,
        };
        Ok(())
    }
}

/// `Qwen3_5MoeTextConfig`'s experts, its defaults for keys left out: every layer sparse and the
/// top-k weights always renormalized (transformers 5.24 reads no `decoder_sparse_step`,
/// `mlp_only_layers` or `norm_topk_prob` for this model, so a config's are ignored as there), a
/// gated shared expert.
fn parse_moe(obj: &Map<String, Value>, layers: usize) -> HfResult<MoeConfig> {
    Ok(MoeConfig {
        num_experts: positive(obj, "num_experts", 256)?,
        top_k: positive(obj, "num_experts_per_tok", 8)?,
        norm_topk_prob: true,
        expert_intermediate_size: positive(obj, "moe_intermediate_size", 512)?,
        shared_expert_intermediate_size: Some(positive(
            obj,
            "shared_expert_intermediate_size",
            512,
        )?),
        sigmoid_input_routing: false,
        f32_routing_weights: false,
        mixtral_names: false,
        sparse_layers: vec![true; layers],
        sparse_mixer: None,
    })
}

/// `Qwen3NextConfig`'s experts, its defaults for keys left out: a layer is sparse unless listed
/// in `mlp_only_layers` or off the `decoder_sparse_step`, and none is with `num_experts` 0 (the
/// dense ones take an MLP of `intermediate_size`); `norm_topk_prob` (true) renormalizes the
/// top-k weights; every sparse layer has a gated shared expert.
fn parse_next_moe(obj: &Map<String, Value>, layers: usize) -> HfResult<Option<MoeConfig>> {
    let experts = get_usize(obj, "num_experts")?.unwrap_or(512);
    if experts == 0 {
        return Ok(None);
    }
    let step = positive(obj, "decoder_sparse_step", 1)?;
    let dense = layer_list(obj, "mlp_only_layers")?;
    Ok(Some(MoeConfig {
        num_experts: experts,
        top_k: positive(obj, "num_experts_per_tok", 10)?,
        norm_topk_prob: get_bool(obj, "norm_topk_prob")?.unwrap_or(true),
        expert_intermediate_size: positive(obj, "moe_intermediate_size", 512)?,
        shared_expert_intermediate_size: Some(positive(
            obj,
            "shared_expert_intermediate_size",
            512,
        )?),
        sigmoid_input_routing: false,
        f32_routing_weights: false,
        mixtral_names: false,
        sparse_layers: (0..layers)
            .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
            .collect(),
        sparse_mixer: None,
    }))
}

/// llama.cpp's architectures for the family (`general.architecture`) and the `model_type` and
/// transformers class each reads as and is written from: dense Qwen3.5, Qwen3.5-MoE,
/// Qwen3-Next.
pub const GGUF_ARCHS: &[(&str, &str, &str)] = &[
    (GGUF_ARCH_DENSE, "qwen3_5_text", "Qwen3_5ForCausalLM"),
    (GGUF_ARCH_MOE, "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    (GGUF_ARCH_NEXT, "qwen3_next", "Qwen3NextForCausalLM"),
];

/// llama.cpp's architecture for dense Qwen3.5.
pub const GGUF_ARCH_DENSE: &str = "qwen35";
/// llama.cpp's architecture for Qwen3.5-MoE.
pub const GGUF_ARCH_MOE: &str = "qwen35moe";
/// llama.cpp's architecture for Qwen3-Next.
pub const GGUF_ARCH_NEXT: &str = "qwen3next";

/// The llama.cpp architecture of `model_type`, if it has one of [`GGUF_ARCHS`].
pub fn gguf_arch_of(model_type: &str) -> Option<&'static str> {
    GGUF_ARCHS
        .iter()
        .find(|(_, t, _)| *t == model_type)
        .map(|(a, _, _)| *a)
}

/// What convert_hf_to_gguf.py does to a tensor's values on the way in (the reader undoes it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufValues {
    /// Kept as they are.
    Same,
    /// A zero-centred RMSNorm's weight `w`, stored as `1 + w` (llama.cpp's norm is plain).
    PlusOne,
    /// `A_log`, stored as `ssm_a = -exp(A_log)`.
    NegExp,
    /// The DeltaNet's depthwise `conv1d.weight` `[channels, 1, kernel]`, stored squeezed to
    /// `[channels, kernel]`.
    Squeeze,
}

/// Where the Qwen3.5 converter moves the DeltaNet's value heads from transformers' grouped
/// order (the value heads of key head 0, then of key head 1, ...) to llama.cpp's tiled order
/// (value head 0 of every key head, then value head 1, ...), when there are more value heads
/// than key heads. Qwen3-Next's converter keeps the grouped order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GgufVHeads {
    /// Not reordered.
    No,
    /// Rows (or vector entries), each value head `linear_value_head_dim` of them, after the
    /// `2 · key_heads · key_head_dim` query and key rows (`in_proj_qkv`, `conv1d`).
    RowsAfterQk,
    /// Rows, each value head `linear_value_head_dim` of them (`in_proj_z`).
    Rows,
    /// Rows or entries, one per value head (`in_proj_a`, `in_proj_b`, `A_log`, `dt_bias`).
    OnePerHead,
    /// Columns, each value head `linear_value_head_dim` of them (`out_proj`).
    Columns,
}

/// One tensor's name in llama.cpp's files of the family and in transformers' checkpoints, and
/// what the converter does to it.
#[derive(Debug)]
pub struct GgufTensor {
    /// llama.cpp's name: `token_embd.weight`, or `attn_qkv.weight` under `blk.N.`.
    pub gguf: &'static str,
    /// transformers' name: `model.embed_tokens.weight`, or `linear_attn.in_proj_qkv.weight`
    /// under `model.layers.N.`.
    pub hf: &'static str,
    pub values: GgufValues,
    pub v_heads: GgufVHeads,
}

const fn t(gguf: &'static str, hf: &'static str) -> GgufTensor {
    GgufTensor {
        gguf,
        hf,
        values: GgufValues::Same,
        v_heads: GgufVHeads::No,
    }
}

const fn norm(gguf: &'static str, hf: &'static str) -> GgufTensor {
    GgufTensor {
        values: GgufValues::PlusOne,
        ..t(gguf, hf)
    }
}

const fn dn(
    gguf: &'static str,
    hf: &'static str,
    values: GgufValues,
    v_heads: GgufVHeads,
) -> GgufTensor {
    GgufTensor {
        gguf,
        hf,
        values,
        v_heads,
    }
}

/// The family's top-level tensors, as convert_hf_to_gguf.py maps them.
pub const GGUF_TOP_TENSORS: &[GgufTensor] = &[
    t("token_embd.weight", "model.embed_tokens.weight"),
    norm("output_norm.weight", "model.norm.weight"),
    t("output.weight", "lm_head.weight"),
];

/// The family's tensors under `blk.N.` / `model.layers.N.`, as convert_hf_to_gguf.py maps them
/// (`Qwen3NextModel`, `_LinearAttentionVReorderBase`). Not here, as they are not one to one:
/// Qwen3-Next's fused `in_proj_qkvz`, split into `attn_qkv` and `attn_gate`, and the experts,
/// stacked into `ffn_{gate,up,down}_exps`.
pub const GGUF_LAYER_TENSORS: &[GgufTensor] = &[
    norm("attn_norm.weight", "input_layernorm.weight"),
    norm(
        "post_attention_norm.weight",
        "post_attention_layernorm.weight",
    ),
    // Gated DeltaNet.
    dn(
        "ssm_a",
        "linear_attn.A_log",
        GgufValues::NegExp,
        GgufVHeads::OnePerHead,
    ),
    dn(
        "ssm_conv1d.weight",
        "linear_attn.conv1d.weight",
        GgufValues::Squeeze,
        GgufVHeads::RowsAfterQk,
    ),
    dn(
        "ssm_dt.bias",
        "linear_attn.dt_bias",
        GgufValues::Same,
        GgufVHeads::OnePerHead,
    ),
    dn(
        "ssm_alpha.weight",
        "linear_attn.in_proj_a.weight",
        GgufValues::Same,
        GgufVHeads::OnePerHead,
    ),
    dn(
        "ssm_beta.weight",
        "linear_attn.in_proj_b.weight",
        GgufValues::Same,
        GgufVHeads::OnePerHead,
    ),
    dn(
        "attn_qkv.weight",
        "linear_attn.in_proj_qkv.weight",
        GgufValues::Same,
        GgufVHeads::RowsAfterQk,
    ),
    dn(
        "attn_gate.weight",
        "linear_attn.in_proj_z.weight",
        GgufValues::Same,
        GgufVHeads::Rows,
    ),
    t("ssm_ba.weight", "linear_attn.in_proj_ba.weight"),
    // The gated RMSNorm's weight is plain, not zero-centred.
    t("ssm_norm.weight", "linear_attn.norm.weight"),
    dn(
        "ssm_out.weight",
        "linear_attn.out_proj.weight",
        GgufValues::Same,
        GgufVHeads::Columns,
    ),
    // Gated full attention (`q_proj` holds each head's query and gate, as in transformers).
    t("attn_q.weight", "self_attn.q_proj.weight"),
    t("attn_k.weight", "self_attn.k_proj.weight"),
    t("attn_v.weight", "self_attn.v_proj.weight"),
    t("attn_output.weight", "self_attn.o_proj.weight"),
    norm("attn_q_norm.weight", "self_attn.q_norm.weight"),
    norm("attn_k_norm.weight", "self_attn.k_norm.weight"),
    // Dense MLP.
    t("ffn_gate.weight", "mlp.gate_proj.weight"),
    t("ffn_up.weight", "mlp.up_proj.weight"),
    t("ffn_down.weight", "mlp.down_proj.weight"),
    // Experts: the router, the shared expert and its gate.
    t("ffn_gate_inp.weight", "mlp.gate.weight"),
    t(
        "ffn_gate_shexp.weight",
        "mlp.shared_expert.gate_proj.weight",
    ),
    t("ffn_up_shexp.weight", "mlp.shared_expert.up_proj.weight"),
    t(
        "ffn_down_shexp.weight",
        "mlp.shared_expert.down_proj.weight",
    ),
    t("ffn_gate_inp_shexp.weight", "mlp.shared_expert_gate.weight"),
];

/// The permutation the Qwen3.5 converter applies to `value_heads` value heads of `head` entries
/// each (grouped by `key_heads` key heads) to tile them: entry `i` of the tiled order is entry
/// `perm[i]` of transformers' grouped one. [`invert`] gives the reader's.
pub fn tile_v_heads(key_heads: usize, value_heads: usize, head: usize) -> Vec<usize> {
    let per_k = value_heads / key_heads;
    (0..per_k)
        .flat_map(|j| {
            (0..key_heads).flat_map(move |k| (0..head).map(move |d| (k * per_k + j) * head + d))
        })
        .collect()
}

/// The inverse of the permutation `perm`.
pub fn invert(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    inv
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two key heads with two value heads each: grouped `[k0v0, k0v1, k1v0, k1v1]` tiles to
    /// `[k0v0, k1v0, k0v1, k1v1]`, rows of a head moving together; the inverse undoes it.
    #[test]
    fn value_heads_tile_as_the_converter_reorders_them() {
        assert_eq!(tile_v_heads(2, 4, 1), vec![0, 2, 1, 3]);
        assert_eq!(tile_v_heads(2, 4, 2), vec![0, 1, 4, 5, 2, 3, 6, 7]);
        assert_eq!(tile_v_heads(2, 2, 3), (0..6).collect::<Vec<_>>());
        let p = tile_v_heads(3, 12, 5);
        let back: Vec<usize> = invert(&p).iter().map(|&i| p[i]).collect();
        assert_eq!(back, (0..60).collect::<Vec<_>>());
    }
}
