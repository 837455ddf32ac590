//! DeepSeek-V3 (`deepseek_v3`, also Kimi-K2's and DeepSeek-R1's) and DeepSeek-V2
//! (`deepseek_v2`, V2-Lite): multi-head latent attention ([`MlaConfig`]) and, from layer
//! `first_k_dense_replace` on, a mixture of experts with group-limited routing
//! ([`GroupedRouting`]: V3's sigmoid scores with `e_score_correction_bias`, V2's softmax) and
//! always-on `shared_experts`. Read as transformers 5.24's `DeepseekV3Config` /
//! `DeepseekV2Config` define them, defaults included. V3's multi-token-prediction layers
//! (`num_nextn_predict_layers`) are skipped on load, as transformers does. llama.cpp's `deepseek2`
//! files are read ([`GGUF_ARCH`], [`GGUF_TOP_TENSORS`], [`GGUF_LAYER_TENSORS`]; the reader is
//! `gguf/deepseek2.rs`) and written (ferrotune-export's `gguf/deepseek2.rs`); torchtune has no
//! DeepSeek builder.

use super::prelude::*;
use crate::config::hf::{get_bool, get_f64, get_str, get_usize, positive};
use crate::config::{GroupedRouting, MlaConfig, MoeConfig, RopeScaling, RouterScoring};

/// The DeepSeek family.
pub static FAMILY: Family = Family::new(
    "DeepSeek",
    &[
        ModelType::new("deepseek_v3", "DeepseekV3ForCausalLM"),
        ModelType::new("deepseek_v2", "DeepseekV2ForCausalLM"),
    ],
    &DeepseekRules,
);

/// llama.cpp's architecture for DeepSeek-V2 and -V3 (`general.architecture`).
pub const GGUF_ARCH: &str = "deepseek2";

/// The `model_type` and transformers class a `deepseek2` file reads as: DeepSeek-V3's when it
/// routes by sigmoid, V2's (softmax) otherwise.
pub fn gguf_model_type(sigmoid: bool) -> (&'static str, &'static str) {
    let t = &FAMILY.model_types[usize::from(!sigmoid)];
    (t.name, t.causal_lm)
}

/// llama.cpp's top-level `deepseek2` tensors and transformers' modules (as convert_hf_to_gguf.py
/// maps them), for the GGUF reader and writer.
pub const GGUF_TOP_TENSORS: &[(&str, &str)] = &[
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("output", "lm_head"),
];

/// llama.cpp's `deepseek2` weights under `blk.N.` and transformers' modules under
/// `model.layers.N.`, one to one. Not here, as they are not one to one: `attn_k_b` + `attn_v_b`
/// (newer converters split `kv_b_proj` per head, keys transposed; older files hold `attn_kv_b`,
/// listed), the stacked experts `ffn_{gate,up,down}_exps` (transformers' per-expert
/// `mlp.experts.E.*_proj`) and `exp_probs_b.bias` (`mlp.gate.e_score_correction_bias`).
pub const GGUF_LAYER_TENSORS: &[(&str, &str)] = &[
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_q_a", "self_attn.q_a_proj"),
    ("attn_q_a_norm", "self_attn.q_a_layernorm"),
    ("attn_q_b", "self_attn.q_b_proj"),
    ("attn_kv_a_mqa", "self_attn.kv_a_proj_with_mqa"),
    ("attn_kv_a_norm", "self_attn.kv_a_layernorm"),
    ("attn_kv_b", "self_attn.kv_b_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
    ("ffn_gate_inp", "mlp.gate"),
    ("ffn_gate_shexp", "mlp.shared_experts.gate_proj"),
    ("ffn_up_shexp", "mlp.shared_experts.up_proj"),
    ("ffn_down_shexp", "mlp.shared_experts.down_proj"),
];

/// DeepSeek's reading of its configs.
#[derive(Debug)]
struct DeepseekRules;

impl HfConfig for DeepseekRules {
    fn check(&self, hf: HfSource) -> HfResult<()> {
        super::refuse_bidirectional(hf.obj)?;
        // The released V3/R1 weights are FP8 blocks with `weight_scale_inv` tensors, read
        // dequantized ([`crate::fp8`]); other quantized checkpoints are not read.
        let Some(q) = hf.obj.get("quantization_config") else {
            return Ok(());
        };
        match q.get("quant_method").and_then(Value::as_str) {
            Some("fp8") => Ok(()),
            method => Err(format!(
                "'quantization_config' is set (quant_method '{}'): {} checkpoints stored \
                 quantized are read only as FP8 blocks (quant_method 'fp8', DeepSeek-V3's); use \
                 a BF16 copy of the weights",
                method.unwrap_or("none"),
                hf.model_type
            )),
        }
    }

    fn configure(&self, hf: HfSource, c: &mut ModelConfig) -> HfResult<()> {
        let (obj, v3) = (hf.obj, hf.model_type == "deepseek_v3");
        let mla = parse_mla(obj, c, v3)?;
        // transformers sets `head_dim` to the rotary part (the rotary embedding's size) whatever
        // the config says; a `head_dim` of 0 is left for the range checks to refuse.
        if get_usize(obj, "head_dim")? != Some(0) {
            c.head_dim = mla.qk_rope_head_dim;
        }
        c.mla = Some(mla);
        let (moe, routing) = parse_moe(obj, c.num_hidden_layers, v3)?;
        c.moe = moe;
        c.grouped_routing = routing;
        c.mtp_layers = if v3 {
            get_usize(obj, "num_nextn_predict_layers")?
                .or(get_usize(obj, "num_mtp_layers")?)
                .unwrap_or(1)
        } else {
            0
        };
        Ok(())
    }
}

/// The rope parameters object (`rope_parameters`, or a 4.x config's `rope_scaling`), if any.
fn rope_params(obj: &Map<String, Value>) -> Option<&Map<String, Value>> {
    ["rope_parameters", "rope_scaling"]
        .iter()
        .find_map(|k| obj.get(*k).and_then(Value::as_object))
}

/// The attention's softmax scale, as transformers' `yarn_apply_mscale`: `qk_head_dim^-0.5`, times
/// `mscale²` with `mscale = 0.1 · mscale_all_dim · ln(factor) + 1` (1 for a factor ≤ 1) when the
/// rope type is not `default` and `mscale_all_dim` is given and non-zero.
fn softmax_scale(obj: &Map<String, Value>, c: &ModelConfig, qk_head_dim: usize) -> HfResult<f64> {
    let scale = (qk_head_dim as f64).powf(-0.5);
    let Some(rope) = rope_params(obj) else {
        return Ok(scale);
    };
    let rope_type = get_str(rope, "rope_type")?
        .or(get_str(rope, "type")?)
        .unwrap_or("default");
    let all_dim = get_f64(rope, "mscale_all_dim")?.unwrap_or(0.0);
    if rope_type == "default" || all_dim == 0.0 {
        return Ok(scale);
    }
    let factor = match &c.rope.scaling {
        RopeScaling::Yarn { factor, .. } => *factor,
        _ => get_f64(rope, "factor")?
            .ok_or("the rope parameters give 'mscale_all_dim' without 'factor'")?,
    };
    let mscale = if factor <= 1.0 {
        1.0
    } else {
        0.1 * all_dim * factor.ln() + 1.0
    };
    Ok(scale * mscale * mscale)
}

/// Multi-head latent attention's shapes, with `DeepseekV3Config`'s / `DeepseekV2Config`'s
/// defaults.
fn parse_mla(obj: &Map<String, Value>, c: &ModelConfig, v3: bool) -> HfResult<MlaConfig> {
    // `q_lora_rank: null` is a plain q_proj (V2-Lite); absent, the class default (1536).
    let q_lora_rank = match obj.get("q_lora_rank") {
        Some(Value::Null) => None,
        Some(_) => Some(positive(obj, "q_lora_rank", 1536)?),
        None => Some(1536),
    };
    let qk_nope_head_dim = positive(obj, "qk_nope_head_dim", 128)?;
    let qk_rope_head_dim = positive(obj, "qk_rope_head_dim", 64)?;
    if qk_rope_head_dim % 2 != 0 {
        return Err(format!(
            "qk_rope_head_dim {qk_rope_head_dim} is odd: rotary pairs need an even size"
        ));
    }
    if c.rope.partial_rotary_factor != 1.0 {
        return Err(
            "'partial_rotary_factor' is not 1: DeepSeek rotates the whole rotary part".into(),
        );
    }
    let v_head_dim = positive(obj, "v_head_dim", 128)?;
    let qk_head_dim = qk_nope_head_dim + qk_rope_head_dim;
    Ok(MlaConfig {
        q_lora_rank,
        kv_lora_rank: positive(obj, "kv_lora_rank", 512)?,
        qk_nope_head_dim,
        qk_rope_head_dim,
        v_head_dim,
        softmax_scale: softmax_scale(obj, c, qk_head_dim)?,
        // V2 always rotates adjacent pairs (its complex-number rotary embedding).
        rope_interleave: !v3 || get_bool(obj, "rope_interleave")?.unwrap_or(true),
    })
}

/// The experts and their routing, or `(None, None)` for a model of dense layers only.
fn parse_moe(
    obj: &Map<String, Value>,
    layers: usize,
    v3: bool,
) -> HfResult<(Option<MoeConfig>, Option<GroupedRouting>)> {
    let first_dense = get_usize(obj, "first_k_dense_replace")?.unwrap_or(if v3 { 3 } else { 0 });
    if first_dense >= layers {
        return Ok((None, None));
    }
    // transformers 5 names the count `n_routed_experts` (`num_local_experts` / `num_experts` are
    // its aliases).
    let num_experts = ["n_routed_experts", "num_local_experts", "num_experts"]
        .iter()
        .find(|k| obj.get(**k).is_some_and(|v| !v.is_null()))
        .map_or(Ok(if v3 { 256 } else { 64 }), |k| positive(obj, k, 0))?;
    let top_k = match get_usize(obj, "num_experts_per_tok")? {
        Some(_) => positive(obj, "num_experts_per_tok", 0)?,
        None if v3 => 8,
        None => return Err("missing key 'num_experts_per_tok' (a mixture of experts)".into()),
    };
    let inter = positive(obj, "moe_intermediate_size", if v3 { 2048 } else { 1407 })?;
    let shared = positive(obj, "n_shared_experts", if v3 { 1 } else { 2 })?;
    let norm_topk_prob = v3 && get_bool(obj, "norm_topk_prob")?.unwrap_or(true);
    let (n_group, topk_group) = if v3 {
        (
            positive(obj, "n_group", 8)?,
            positive(obj, "topk_group", 4)?,
        )
    } else {
        match get_str(obj, "topk_method")?.unwrap_or("greedy") {
            "greedy" => (1, 1),
            "group_limited_greedy" => (
                positive(obj, "n_group", 0)?,
                positive(obj, "topk_group", 0)?,
            ),
            other => {
                return Err(format!(
                    "topk_method '{other}': DeepSeek-V2 routes with 'greedy' or \
                     'group_limited_greedy' (transformers 5.24)"
                ))
            }
        }
    };
    if num_experts % n_group != 0 || topk_group > n_group {
        return Err(format!(
            "n_group {n_group} does not divide the {num_experts} experts or is fewer than \
             topk_group {topk_group}"
        ));
    }
    // V3 scores a group by its two best experts.
    if v3 && num_experts / n_group < 2 {
        return Err(format!(
            "n_group {n_group} leaves fewer than 2 experts per group (DeepSeek-V3 scores a group \
             by its best two)"
        ));
    }
    if top_k > (num_experts / n_group) * topk_group {
        return Err(format!(
            "num_experts_per_tok {top_k} is more than the experts of the {topk_group} groups kept"
        ));
    }
    let moe = MoeConfig {
        num_experts,
        top_k,
        norm_topk_prob,
        expert_intermediate_size: inter,
        shared_expert_intermediate_size: Some(inter * shared),
        sigmoid_input_routing: false,
        // transformers multiplies the experts' outputs by the f32 routing weights.
        f32_routing_weights: true,
        mixtral_names: false,
        sparse_layers: (0..layers).map(|i| i >= first_dense).collect(),
        sparse_mixer: None,
    };
    let routing = GroupedRouting {
        scoring: if v3 {
            RouterScoring::Sigmoid
        } else {
            RouterScoring::Softmax
        },
        n_group,
        topk_group,
        group_sum_top2: v3,
        correction_bias: v3,
        norm_topk_prob,
        routed_scaling_factor: get_f64(obj, "routed_scaling_factor")?.unwrap_or(if v3 {
            2.5
        } else {
            1.0
        }),
    };
    Ok((Some(moe), Some(routing)))
}
