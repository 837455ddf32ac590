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
