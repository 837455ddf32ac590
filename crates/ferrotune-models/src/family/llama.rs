//! Llama (1, 2, 3.x, SmolLM2 and other `llama` checkpoints) and Llama 3.2 Vision's text model
//! (`mllama`), which runs as a Llama over its self-attention layers.

use super::prelude::*;
use crate::config::hf::req_usize;

/// The Llama family.
pub static FAMILY: Family = Family {
    multimodal: &[
        Multimodal::new("mllama", &[MLLAMA_TEXT]),
        // MllamaForCausalLM: Llama 3.2 Vision's text model alone, its config at the top level.
        Multimodal::new(MLLAMA_TEXT, &[MLLAMA_TEXT]),
    ],
    text_aliases: &[(MLLAMA_TEXT, "llama")],
    config_defaults,
    gguf_archs: &[GgufArch {
        name: "llama",
        model_type: "llama",
        // llama.cpp writes Mixtral as `llama` with experts, and Mistral models as `llama`
        // (transformers tells them apart by name).
        variants: &[
            (GgufVariant::Experts, "mixtral"),
            (GgufVariant::NameContains("mistral"), "mistral"),
        ],
        permuted_qk: true,
        norm_plus_one: false,
        vocab: GgufVocabStyle::Llama,
        writing: GgufWriting {
            rope_tensors: GgufRopeTensors::Llama3Freqs,
            // llama.cpp 0.3.16 sizes the llama architecture's q bias by the hidden size.
            q_bias_hidden_size: true,
            // Mixtral's experts are `feed_forward_length` wide there.
            expert_ffn_key: false,
            // `LLM_TYPE_70B`: 80 layers of a grouped-query Llama.
            seventy_b: |c| {
                c.num_hidden_layers == 80 && c.num_attention_heads != c.num_key_value_heads
            },
            ..GgufWriting::PLAIN
        },
    }],
    torchtune_builders: &[
        ("llama2", &["llama"]),
        ("code_llama2", &["llama"]),
        ("llama3", &["llama"]),
        ("llama3_1", &["llama"]),
        ("llama3_2", &["llama"]),
        ("llama3_3", &["llama"]),
        ("smollm2", &["llama"]),
    ],
    ..Family::new(
        "Llama",
        &[ModelType::new(LLAMA, "LlamaForCausalLM")
            .gguf(
                "llama",
                GgufReading {
                    head_dim_from_rope: true,
                    // Llama 3.x: llama.cpp bakes the frequency scaling into a `rope_freqs` tensor.
                    rope_tensors: GgufRopeTensors::Llama3Freqs,
                    config_keys: gguf_keys,
                    ..GgufReading::LLAMA
                },
            )
            .torchtune(TorchtuneLayout::Permuted)],
        &LlamaLike,
    )
};

/// A Llama GGUF file's own config keys: its biases.
fn gguf_keys(g: GgufSource, c: &mut Map<String, Value>) -> Result<(), ModelError> {
    llama_biases(g.file, c);
    Ok(())
}

/// Llama's `model_type`.
pub const LLAMA: &str = "llama";

/// The `model_type` Meta's own checkpoint format (`params.json`, `consolidated.NN.pth`) holds.
pub const META_FORMAT: &str = LLAMA;

/// Llama 3.2 Vision's text model's `model_type` (`MllamaTextConfig`).
pub const MLLAMA_TEXT: &str = "mllama_text_model";

/// `MllamaTextConfig`'s defaults. A top-level `rope_theta` serves only where the rope parameters
/// hold none.
fn config_defaults(model_type: &str) -> &'static [(&'static str, Value)] {
    static MLLAMA: OnceLock<Vec<(&str, Value)>> = OnceLock::new();
    match model_type {
        MLLAMA_TEXT => MLLAMA.get_or_init(|| {
            vec![
                ("vocab_size", Value::from(128_256u64)),
                ("hidden_size", Value::from(4096u64)),
                ("hidden_act", Value::from("silu")),
                ("num_hidden_layers", Value::from(40u64)),
                ("num_attention_heads", Value::from(32u64)),
                ("num_key_value_heads", Value::from(8u64)),
                ("intermediate_size", Value::from(14_336u64)),
                ("rope_theta", Value::from(500_000.0)),
                ("rms_norm_eps", Value::from(1e-5)),
                ("max_position_embeddings", Value::from(131_072u64)),
                (
                    "cross_attention_layers",
                    Value::from(vec![3u64, 8, 13, 18, 23, 28, 33, 38]),
                ),
                ("bos_token_id", Value::from(128_000u64)),
                ("eos_token_id", Value::from(128_001u64)),
                ("pad_token_id", Value::from(128_004u64)),
            ]
        }),
        _ => &[],
    }
}

/// Llama 3.2 Vision's text config (`mllama_text_model`, already turned into a `llama` config by
/// `multimodal_text_config`, which filled in `MllamaTextConfig`'s defaults) as the Llama of
/// its self-attention layers: takes out `cross_attention_layers` (returned, sorted) and counts
/// only the other layers in `num_hidden_layers`.
pub(crate) fn mllama_text_layers(text: &mut Map<String, Value>) -> Result<Vec<usize>, String> {
    let listed = match text.remove("cross_attention_layers") {
        // MllamaTextConfig's default, as transformers fills it for null.
        None | Some(Value::Null) => config_defaults(MLLAMA_TEXT)
            .iter()
            .find(|(k, _)| *k == "cross_attention_layers")
            .map(|(_, v)| v.clone())
            .expect("Mllama's defaults list its cross-attention layers"),
        Some(v) => v,
    };
    let layers = req_usize(text, "num_hidden_layers")?;
    let entries = listed.as_array().ok_or_else(|| {
        format!("'cross_attention_layers' must be a list of layer numbers, found {listed}")
    })?;
    // transformers asks of each layer whether it is listed: numbers past the last layer name none.
    let mut cross = Vec::new();
    for v in entries {
        let i = v
            .as_u64()
            .ok_or_else(|| format!("'cross_attention_layers' must hold layer numbers, found {v}"))?
            as usize;
        if i < layers {
            cross.push(i);
        }
    }
    cross.sort_unstable();
    cross.dedup();
    if cross.len() == layers {
        return Err("every layer is in 'cross_attention_layers': no text layer is left".into());
    }
    text.insert(
        "num_hidden_layers".into(),
        Value::from((layers - cross.len()) as u64),
    );
    Ok(cross)
}
