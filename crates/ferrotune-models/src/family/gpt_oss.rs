//! gpt-oss (`gpt_oss`, transformers' `GptOssForCausalLM`): alternating sliding and full attention
//! layers with a learned attention sink per head, q/k/v/o biases, YaRN rope, and a mixture of
//! experts in every layer (top-k logits softmaxed, fused interleaved gate/up experts with biases,
//! a clamped SwiGLU).
//!
//! llama.cpp's `gpt-oss` files are read ([`GGUF_ARCH`], [`GGUF_TOP_TENSORS`],
//! [`GGUF_LAYER_TENSORS`]; the reader is `gguf/gpt_oss.rs`) and written (ferrotune-export's
//! `gguf/gpt_oss.rs`), with float experts.
//!
//! OpenAI's MXFP4 experts (`*_blocks` / `*_scales`) are dequantized when read
//! ([`crate::mxfp4`]); the model then is a bf16 one, and its config loses the
//! `quantization_config` that said otherwise.

use super::prelude::*;
use crate::config::hf::{
    get_f64, get_usize, parse_rope, parse_sliding_windows, positive, rope_from_params,
};
use crate::config::{GptOssMoeConfig, RopeConfig};

/// The gpt-oss family.
pub static FAMILY: Family = Family {
    config_defaults,
    ..Family::new(
        "gpt-oss",
        &[ModelType::new("gpt_oss", "GptOssForCausalLM")],
        &GptOssRules,
    )
};

/// llama.cpp's architecture for gpt-oss (`general.architecture`).
pub const GGUF_ARCH: &str = "gpt-oss";

/// The `model_type` and transformers class a `gpt-oss` file reads as.
pub fn gguf_model_type() -> (&'static str, &'static str) {
    let t = &FAMILY.model_types[0];
    (t.name, t.causal_lm)
}

/// llama.cpp's top-level `gpt-oss` tensors and transformers' names, as convert_hf_to_gguf.py
/// maps them.
pub const GGUF_TOP_TENSORS: &[(&str, &str)] = &[
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
];

/// llama.cpp's `gpt-oss` tensors under `blk.N.` and transformers' under `model.layers.N.` (the
/// `.weight` / `.bias` suffix kept), as convert_hf_to_gguf.py maps them. Not here, as they are not one to one: `ffn_{gate,up}_exps` (weights
/// `[experts, inter, hidden]` and biases), interleaved into transformers'
/// `mlp.experts.gate_up_proj` `[experts, hidden, 2 · inter]` (gate in even columns) and its bias,
/// and `ffn_down_exps` (`mlp.experts.down_proj`, transposed; its bias as it is).
pub const GGUF_LAYER_TENSORS: &[(&str, &str)] = &[
    ("attn_norm.weight", "input_layernorm.weight"),
    // llama.cpp names the MLP's pre-norm after the attention it follows.
    (
        "post_attention_norm.weight",
        "post_attention_layernorm.weight",
    ),
    ("attn_q.weight", "self_attn.q_proj.weight"),
    ("attn_q.bias", "self_attn.q_proj.bias"),
    ("attn_k.weight", "self_attn.k_proj.weight"),
    ("attn_k.bias", "self_attn.k_proj.bias"),
    ("attn_v.weight", "self_attn.v_proj.weight"),
    ("attn_v.bias", "self_attn.v_proj.bias"),
    ("attn_output.weight", "self_attn.o_proj.weight"),
    ("attn_output.bias", "self_attn.o_proj.bias"),
    ("attn_sinks.weight", "self_attn.sinks"),
    ("ffn_gate_inp.weight", "mlp.router.weight"),
    ("ffn_gate_inp.bias", "mlp.router.bias"),
];

/// `GptOssConfig`'s default theta, used when the config gives none.
const DEFAULT_THETA: f64 = 150_000.0;

/// gpt-oss's reading of its config.
#[derive(Debug)]
struct GptOssRules;

impl HfConfig for GptOssRules {
    /// The experts' activation is the fixed clamped SwiGLU: transformers ignores `hidden_act`.
    fn activation<'a>(&self, _hf: HfSource<'a>) -> HfResult<&'a str> {
        Ok("silu")
    }

    /// `rope_parameters` (or 4.x's `rope_scaling`); without either, `GptOssConfig`'s default:
    /// YaRN, factor 32 over 4096 original positions, beta_fast 32, beta_slow 1, not truncated,
    /// theta `rope_theta` or 150000.
    fn rope(&self, hf: HfSource, max_pos: usize) -> HfResult<RopeConfig> {
        let absent = |key: &str| matches!(hf.obj.get(key), None | Some(Value::Null));
        if !(absent("rope_parameters") && absent("rope_scaling")) {
            return parse_rope(hf.obj, max_pos, DEFAULT_THETA, false);
        }
        let mut params = Map::new();
        params.insert("rope_type".into(), "yarn".into());
        params.insert("factor".into(), 32.0.into());
        params.insert("beta_fast".into(), 32.0.into());
        params.insert("beta_slow".into(), 1.0.into());
        params.insert("truncate".into(), false.into());
        params.insert("original_max_position_embeddings".into(), 4096.into());
        let theta = get_f64(hf.obj, "rope_theta")?.unwrap_or(DEFAULT_THETA);
        rope_from_params(hf.obj, &params, max_pos, theta, false)
    }

    /// `layer_types` as listed; without a list, `GptOssConfig`'s default: even layers slide
    /// (`sliding_window`), odd ones attend fully.
    fn attention(&self, hf: HfSource, layers: usize, max_pos: usize) -> HfResult<AttentionLayers> {
        let rope = self.rope(hf, max_pos)?;
        let sliding_windows = match hf.obj.get("layer_types") {
            Some(Value::Array(types)) => {
                // transformers has masks for these two kinds only.
                if let Some(t) = types
                    .iter()
                    .find(|t| !matches!(t.as_str(), Some("sliding_attention" | "full_attention")))
                {
                    return Err(format!(
                        "'layer_types' entry {t} is not supported by gpt_oss: each layer is \
                         \"sliding_attention\" or \"full_attention\""
                    ));
                }
                parse_sliding_windows(hf.obj, layers, WindowStyle::Listed)?
            }
            _ => {
                let window = get_usize(hf.obj, "sliding_window")?;
                (0..layers).map(|i| window.filter(|_| i % 2 == 0)).collect()
            }
        };
        Ok(AttentionLayers {
            rope,
            local_rope: None,
            sliding_windows,
            local_rope_layers: vec![false; layers],
        })
    }

    fn configure(&self, hf: HfSource, c: &mut ModelConfig) -> HfResult<()> {
        let obj = hf.obj;
        // The experts are dequantized on reading: what the model holds and saves is no longer
        // MXFP4, and transformers would look for `*_blocks` in a checkpoint whose config says so.
        if let Value::Object(raw) = &mut c.raw {
            let mxfp4 = raw
                .get("quantization_config")
                .and_then(|q| q.get("quant_method"))
                .and_then(Value::as_str)
                == Some("mxfp4");
            if mxfp4 {
                raw.remove("quantization_config");
            }
            // The auxiliary loss's weight is read from the config as written
            // (`ModelConfig::router_aux_loss_coef`): `GptOssConfig`'s default when left out.
            raw.entry("router_aux_loss_coef")
                .or_insert(Value::from(0.001));
        }
        c.attention_sinks = true;
        let num_experts = match get_usize(obj, "num_local_experts")? {
            Some(_) => positive(obj, "num_local_experts", 0)?,
            // `num_experts` is GptOssConfig's alias of `num_local_experts`.
            None => positive(obj, "num_experts", 128)?,
        };
        let top_k = positive(obj, "num_experts_per_tok", 4)?;
        if top_k > num_experts {
            return Err(format!(
                "num_experts_per_tok {top_k} is more than the {num_experts} experts"
            ));
        }
        let limit = get_f64(obj, "swiglu_limit")?.unwrap_or(7.0);
        if limit.is_nan() {
            return Err("'swiglu_limit' must be a number".into());
        }
        c.gpt_oss_moe = Some(GptOssMoeConfig {
            num_experts,
            top_k,
            alpha: get_f64(obj, "swiglu_alpha")?.unwrap_or(1.702),
            limit,
        });
        Ok(())
    }
}

/// `GptOssConfig`'s defaults (gpt-oss-120b's shape) for the keys the shared reading takes;
/// the gpt-oss keys themselves (`swiglu_limit`, `num_local_experts`, ...) default where they
/// are read.
fn config_defaults(model_type: &str) -> &'static [(&'static str, Value)] {
    static GPT_OSS: OnceLock<Vec<(&str, Value)>> = OnceLock::new();
    match model_type {
        "gpt_oss" => GPT_OSS.get_or_init(|| {
            vec![
                ("vocab_size", Value::from(201_088u64)),
                ("hidden_size", Value::from(2880u64)),
                ("intermediate_size", Value::from(2880u64)),
                ("num_hidden_layers", Value::from(36u64)),
                ("num_attention_heads", Value::from(64u64)),
                ("num_key_value_heads", Value::from(8u64)),
                ("head_dim", Value::from(64u64)),
                ("sliding_window", Value::from(128u64)),
                ("max_position_embeddings", Value::from(131_072u64)),
                ("rms_norm_eps", Value::from(1e-5)),
                ("tie_word_embeddings", Value::from(false)),
            ]
        }),
        _ => &[],
    }
}
