//! Llama 4 (Scout, Maverick): its text model, which ships only inside
//! `Llama4ForConditionalGeneration`.

use super::prelude::*;
use super::read::layer_and_rest;
use crate::config::hf::{
    get_bool, get_f64, get_positive, get_usize, layer_list, layer_types_marking, parse_rope_layers,
    positive, req_usize,
};
use crate::config::MoeConfig;

/// The Llama 4 family.
pub static FAMILY: Family = Family {
    multimodal: &[Multimodal::new("llama4", &["llama4_text"])],
    config_defaults,
    ..Family::new(
        "Llama 4",
        &[ModelType::new("llama4_text", "Llama4ForCausalLM")],
        &Llama4Rules,
    )
};

/// Llama 4's reading of its config.
#[derive(Debug)]
struct Llama4Rules;

impl HfConfig for Llama4Rules {
    fn configure(&self, hf: HfSource, c: &mut ModelConfig) -> HfResult<()> {
        let obj = hf.obj;
        let layers = c.num_hidden_layers;
        // Llama 4's dense layers take `intermediate_size_mlp`; its experts `intermediate_size`.
        c.intermediate_size = req_usize(obj, "intermediate_size_mlp")?;
        c.moe = Some(parse_moe(obj, layers)?);
        c.rope_layers = parse_rope_layers(obj, layers, true)?;
        c.nope_attn_temperature = if get_bool(obj, "attn_temperature_tuning")?.unwrap_or(true) {
            let floor_scale = get_positive(obj, "floor_scale")?.unwrap_or(8192.0);
            Some((get_f64(obj, "attn_scale")?.unwrap_or(0.1), floor_scale))
        } else {
            None
        };
        c.rope_interleaved = true;
        c.rope_layer_qk_l2_norm = get_bool(obj, "use_qk_norm")?.unwrap_or(true);
        c.layer_attention_chunks = parse_attention_chunks(obj, layers)?;
        c.llama4_names = true;
        Ok(())
    }
}

/// Llama 4's mixture of experts: the layers `moe_layers` lists (or every
/// `interleave_moe_layer_step`-th), sigmoid routing of the expert's input, and a shared expert.
fn parse_moe(obj: &Map<String, Value>, layers: usize) -> Result<MoeConfig, String> {
    let sparse_layers = match obj.get("moe_layers") {
        None | Some(Value::Null) => {
            let step = positive(obj, "interleave_moe_layer_step", 1)?;
            (0..layers).map(|i| (i + 1) % step == 0).collect()
        }
        Some(_) => {
            let listed = layer_list(obj, "moe_layers")?;
            (0..layers).map(|i| listed.contains(&i)).collect()
        }
    };
    let inter = positive(obj, "intermediate_size", 8192)?;
    Ok(MoeConfig {
        num_experts: positive(obj, "num_local_experts", 16)?,
        top_k: positive(obj, "num_experts_per_tok", 1)?,
        norm_topk_prob: false,
        expert_intermediate_size: inter,
        shared_expert_intermediate_size: Some(inter),
        sigmoid_input_routing: true,
        f32_routing_weights: false,
        mixtral_names: false,
        sparse_layers,
        sparse_mixer: None,
    })
}

/// `Llama4TextConfig`'s defaults (Llama 4 Scout's shape); the Llama 4 keys themselves
/// (`no_rope_layers`, `moe_layers`, `attention_chunk_size`, ...) default where they are read.
fn config_defaults(model_type: &str) -> &'static [(&'static str, Value)] {
    static LLAMA4: OnceLock<Vec<(&str, Value)>> = OnceLock::new();
    match model_type {
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
        _ => &[],
    }
}

/// Llama 4's chunked attention: the layers `layer_types` marks `chunked_attention` (by default
/// the RoPE layers) see only their own chunk of `attention_chunk_size` positions; a null chunk
/// size turns it off, as in transformers.
fn parse_attention_chunks(
    obj: &Map<String, Value>,
    layers: usize,
) -> Result<Vec<Option<usize>>, String> {
    let chunk = match obj.get("attention_chunk_size") {
        None => Some(8192),
        Some(_) => get_usize(obj, "attention_chunk_size")?,
    };
    if chunk == Some(0) {
        return Err("'attention_chunk_size' must be at least 1".into());
    }
    let chunked = match layer_types_marking(obj, "chunked_attention", layers)? {
        Some(chunked) => chunked,
        None => parse_rope_layers(obj, layers, true)?,
    };
    Ok(chunked.into_iter().map(|c| chunk.filter(|_| c)).collect())
}

/// The decoder's name of a Llama 4 checkpoint tensor or module: `feed_forward.router` is the
/// decoder's `mlp.gate`, the rest of `feed_forward.*` its `mlp.*` (the fused experts,
/// `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`, are split when the model is built).
pub(crate) fn decoder_name(name: &str) -> String {
    rename_layer_block(name, ("feed_forward", "router"), ("mlp", "gate"))
}

/// The inverse of [`decoder_name`]. A separate expert's projection
/// (`mlp.experts.N.gate_proj`) keeps its number: it is no module of the checkpoint, whose experts
/// are fused, so PEFT patterns never name it.
pub(crate) fn checkpoint_name(name: &str) -> String {
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
