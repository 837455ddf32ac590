//! OLMo 2 (`olmo2`, `Olmo2ForCausalLM`): Llama's layout with the norms moved. A layer has no
//! pre-norms: each block's output is normalized before its residual add
//! (`h = x + post_attention_layernorm(attn(x))`, `out = h + post_feedforward_layernorm(mlp(h))`),
//! and the queries and keys pass an RMSNorm over the whole projection output (`q_norm`
//! `[heads · head_dim]`, `k_norm` `[kv_heads · head_dim]`) before they are split into heads and
//! rotated. llama.cpp's `olmo2` architecture is not written (no GGUF export), and torchtune has no
//! OLMo 2 builder.

use super::prelude::*;
use crate::config::QkNormSpan;

/// The OLMo 2 family.
pub static FAMILY: Family = Family {
    config_defaults,
    ..Family::new(
        "OLMo 2",
        &[ModelType::new("olmo2", "Olmo2ForCausalLM")],
        &Olmo2Rules,
    )
};

/// `Olmo2Config`'s defaults (transformers 5.24) where they differ from the reading every family
/// starts from (`rms_norm_eps` 1e-6, 4096 positions, no pad or end-of-sequence token).
fn config_defaults(model_type: &str) -> &'static [(&'static str, Value)] {
    static OLMO2: OnceLock<Vec<(&str, Value)>> = OnceLock::new();
    match model_type {
        "olmo2" => OLMO2.get_or_init(|| {
            vec![
                ("rms_norm_eps", Value::from(1e-5)),
                ("max_position_embeddings", Value::from(2048u64)),
                ("pad_token_id", Value::from(1u64)),
                ("eos_token_id", Value::from(50_279u64)),
            ]
        }),
        _ => &[],
    }
}

/// OLMo 2's reading of its config: Llama's, with its norms.
#[derive(Debug)]
struct Olmo2Rules;

impl HfConfig for Olmo2Rules {
    fn configure(&self, _hf: HfSource, c: &mut ModelConfig) -> HfResult<()> {
        c.qk_norm = true;
        c.qk_norm_span = QkNormSpan::Projection;
        // The sandwich's two output norms, without its MLP pre-norm (nor the attention's).
        c.sandwich_norms = true;
        c.pre_norms = false;
        Ok(())
    }
}
