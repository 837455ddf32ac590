//! Mistral AI's models: Mistral, Mixtral (sparse experts), Ministral, Ministral 3, and Mistral 3's
//! multimodal checkpoints run as their text model.

use super::prelude::*;
use crate::config::hf::{get_usize, positive, req_usize};
use crate::config::MoeConfig;

/// The Mistral family.
pub static FAMILY: Family = Family {
    multimodal: &[Multimodal::new(
        "mistral3",
        &["mistral", "ministral3", "ministral"],
    )],
    // Read only: the writer stores Mistral as llama.cpp's `llama`.
    gguf_archs: &[GgufArch::plain("mistral", "mistral", GgufWriting::PLAIN)],
    torchtune_builders: &[(
        "mistral",
        &["mistral", "llama", "mixtral", "ministral", "ministral3"],
    )],
    ..Family::new(
        "Mistral",
        &[
            // llama.cpp runs Mistral and Mixtral as `llama` (Mixtral with experts).
            ModelType::new("mistral", "MistralForCausalLM")
                .gguf("llama", MISTRAL_GGUF)
                .torchtune(TorchtuneLayout::Permuted),
            ModelType::new("mixtral", "MixtralForCausalLM").gguf("llama", MIXTRAL_GGUF),
            ModelType::new("ministral", "MinistralForCausalLM"),
            ModelType::new("ministral3", "Ministral3ForCausalLM"),
        ],
        &MistralRules,
    )
};

/// Mistral in GGUF: the head size from the rope dimension, its own keys.
const MISTRAL_GGUF: GgufReading = GgufReading {
    head_dim_from_rope: true,
    config_keys: mistral_gguf_keys,
    ..GgufReading::LLAMA
};

/// Mixtral in GGUF: llama's files with Mixtral's experts.
const MIXTRAL_GGUF: GgufReading = GgufReading {
    moe: Some(GgufMoe {
        mixtral_names: true,
        expert_ffn_is_ffn: true,
        shared_expert: false,
        all_sparse: true,
    }),
    config_keys: mixtral_gguf_keys,
    ..GgufReading::LLAMA
};

/// A Mistral GGUF file's own config keys: Llama's biases, and full attention (llama.cpp runs
/// these with full attention whatever the original config said).
fn mistral_gguf_keys(g: GgufSource, c: &mut Map<String, Value>) -> Result<(), ModelError> {
    llama_biases(g.file, c);
    c.insert("sliding_window".into(), Value::Null);
    Ok(())
}

/// A Mixtral GGUF file's experts, and full attention.
fn mixtral_gguf_keys(g: GgufSource, c: &mut Map<String, Value>) -> Result<(), ModelError> {
    c.insert("num_local_experts".into(), g.hp.experts.into());
    c.insert("num_experts_per_tok".into(), g.hp.experts_used.into());
    c.insert("sliding_window".into(), Value::Null);
    Ok(())
}

/// Mistral's reading of its configs: Llama's, and Mixtral's experts.
#[derive(Debug)]
struct MistralRules;

impl HfConfig for MistralRules {
    fn configure(&self, hf: HfSource, c: &mut ModelConfig) -> HfResult<()> {
        let obj = hf.obj;
        if hf.model_type == "mixtral" {
            c.moe = Some(MoeConfig {
                num_experts: match get_usize(obj, "num_local_experts")? {
                    Some(_) => positive(obj, "num_local_experts", 0)?,
                    None => positive(obj, "num_experts", 8)?,
                },
                top_k: positive(obj, "num_experts_per_tok", 2)?,
                norm_topk_prob: true,
                expert_intermediate_size: req_usize(obj, "intermediate_size")?,
                shared_expert_intermediate_size: None,
                f32_routing_weights: true,
                sigmoid_input_routing: false,
                mixtral_names: true,
                sparse_layers: vec![true; c.num_hidden_layers],
                sparse_mixer: None,
            });
        }
        Ok(())
    }
}
