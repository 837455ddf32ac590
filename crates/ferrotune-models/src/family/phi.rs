//! Microsoft's Phi models: Phi-1.5 / Phi-2 (`phi`: LayerNorm with biases, attention and MLP in
//! parallel), Phi-3 / Phi-4 (`phi3`: fused projections) and Phi-3.5-MoE (`phimoe`).

use super::prelude::*;
use crate::config::hf::{get_bool, get_f64, parse_rope, positive, req_usize};
use crate::config::{MoeConfig, RopeConfig, SparseMixer};

/// The Phi family.
pub static FAMILY: Family = Family {
    config_defaults,
    gguf_archs: &[
        GgufArch {
            vocab: GgufVocabStyle::Phi3,
            ..GgufArch::plain(
                "phi3",
                "phi3",
                GgufWriting {
                    windows: GgufWindows::AllOrNone,
                    partial_rotary: true,
                    rope_tensors: GgufRopeTensors::LongRopeFactors,
                    ..GgufWriting::PLAIN
                },
            )
        },
        // Phi-1.5 / Phi-2: LayerNorm with biases, attention and MLP in parallel.
        GgufArch::plain(
            "phi2",
            "phi",
            GgufWriting {
                output_required: true,
                partial_rotary: true,
                ..GgufWriting::PLAIN
            },
        ),
    ],
    torchtune_builders: &[
        ("phi3", &["phi3", "phimoe"]),
        ("phi2", &["phi"]),
        ("phi4", &["phi3"]),
    ],
    ..Family::new(
        "Phi",
        &[
            ModelType::new("phi3", "Phi3ForCausalLM")
                .gguf("phi3", PHI3_GGUF)
                .torchtune(TorchtuneLayout::SplitFused),
            ModelType::new("phi", "PhiForCausalLM").gguf("phi2", PHI2_GGUF),
            ModelType::new("phimoe", "PhimoeForCausalLM"),
        ],
        &PhiRules,
    )
};

/// Phi-3 in GGUF: fused projections, partial rotary, LongRoPE's factors in tensors.
const PHI3_GGUF: GgufReading = GgufReading {
    names: GgufNames::Phi3,
    partial_rotary: true,
    rope_tensors: GgufRopeTensors::LongRopeFactors,
    config_keys: phi3_gguf_keys,
    ..GgufReading::LLAMA
};

/// Phi-2 in GGUF: its names, partial rotary, the GELU.
const PHI2_GGUF: GgufReading = GgufReading {
    names: GgufNames::Phi2,
    partial_rotary: true,
    activation: &[("hidden_act", "gelu_new")],
    config_keys: phi2_gguf_keys,
    ..GgufReading::LLAMA
};

/// A Phi-3 GGUF file's sliding window, where it has one.
fn phi3_gguf_keys(g: GgufSource, c: &mut Map<String, Value>) -> Result<(), ModelError> {
    let key = format!("{}.attention.sliding_window", g.file.arch());
    if let Some(w) = g.file.uint(&key)? {
        c.insert("sliding_window".into(), w.into());
    }
    Ok(())
}

/// A Phi-2 GGUF file's LayerNorm epsilon; it has no q/k LayerNorm.
fn phi2_gguf_keys(g: GgufSource, c: &mut Map<String, Value>) -> Result<(), ModelError> {
    c.insert("layer_norm_eps".into(), g.hp.rms_eps.into());
    c.insert("qk_layernorm".into(), Value::Bool(false));
    Ok(())
}

/// Phi's reading of its configs.
#[derive(Debug)]
struct PhiRules;

impl HfConfig for PhiRules {
    fn check(&self, hf: HfSource) -> HfResult<()> {
        super::refuse_bidirectional(hf.obj)?;
        if hf.model_type == "phi" && get_bool(hf.obj, "qk_layernorm")?.unwrap_or(false) {
            return Err(
                "'qk_layernorm' true (per-head LayerNorm of queries and keys) is not supported"
                    .into(),
            );
        }
        Ok(())
    }

    /// Phi-3.5-MoE: `PhimoeConfig`'s `default_theta` is 1e6, and its longrope has mscales.
    fn rope(&self, hf: HfSource, max_pos: usize) -> HfResult<RopeConfig> {
        let phimoe = hf.model_type == "phimoe";
        let default_theta = if phimoe { 1_000_000.0 } else { 10000.0 };
        parse_rope(hf.obj, max_pos, default_theta, phimoe)
    }

    fn configure(&self, hf: HfSource, c: &mut ModelConfig) -> HfResult<()> {
        let obj = hf.obj;
        match hf.model_type {
            // Phi-1.5 / Phi-2: LayerNorm with biases (`layer_norm_eps`), attention and MLP in
            // parallel, an ungated MLP.
            "phi" => {
                c.rms_norm_eps = get_f64(obj, "layer_norm_eps")?.unwrap_or(1e-5);
                c.layer_norm = true;
                c.parallel_block = true;
                c.ungated_mlp = true;
            }
            "phi3" => c.fused_projections = true,
            "phimoe" => {
                // Phi-3.5-MoE's LayerNorms take `rms_norm_eps` (PhimoeConfig's default 1e-5).
                c.rms_norm_eps = get_f64(obj, "rms_norm_eps")?.unwrap_or(1e-5);
                c.layer_norm = true;
                c.moe = Some(parse_moe(obj, c.num_hidden_layers)?);
            }
            _ => {}
        }
        Ok(())
    }
}

/// Phi-3.5-MoE's experts, routed by the sparsemixer.
fn parse_moe(obj: &Map<String, Value>, layers: usize) -> Result<MoeConfig, String> {
    let num_experts = positive(obj, "num_local_experts", 16)?;
    if num_experts < 2 {
        return Err(
            "'num_local_experts' must be at least 2: Phi-3.5-MoE's router always picks two experts"
                .into(),
        );
    }
    Ok(MoeConfig {
        num_experts,
        // The sparsemixer always picks two; `num_experts_per_tok` only sets how many the
        // router's auxiliary loss counts, as in transformers.
        top_k: positive(obj, "num_experts_per_tok", 2)?,
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
    })
}

/// `PhiConfig` gives partial_rotary_factor 0.5 when a config has none.
fn config_defaults(model_type: &str) -> &'static [(&'static str, Value)] {
    static PHI: OnceLock<Vec<(&str, Value)>> = OnceLock::new();
    match model_type {
        "phi" => PHI.get_or_init(|| {
            vec![
                ("partial_rotary_factor", Value::from(0.5)),
                ("hidden_act", Value::from("gelu_new")),
            ]
        }),
        _ => &[],
    }
}
