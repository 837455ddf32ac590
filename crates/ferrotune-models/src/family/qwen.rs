//! Qwen 2, 2.5 and 3, dense and sparse (Qwen2-MoE, Qwen3-MoE), and the Qwen VL checkpoints run as
//! their text model (their multimodal rope is plain RoPE on text alone).

use super::prelude::*;
use crate::config::hf::{get_bool, get_usize, layer_list, positive};
use crate::config::MoeConfig;

/// The Qwen family.
pub static FAMILY: Family = Family {
    multimodal: &[
        Multimodal::new("qwen2_vl", &["qwen2_vl_text"]).keys_at_top(),
        Multimodal::new("qwen2_5_vl", &["qwen2_5_vl_text"]).keys_at_top(),
        Multimodal::new("qwen3_vl", &["qwen3_vl_text"]).keys_at_top(),
    ],
    // Qwen2-VL's and Qwen2.5-VL's text models are Qwen2's, Qwen3-VL's is Qwen3's.
    text_aliases: &[
        ("qwen2_vl_text", "qwen2"),
        ("qwen2_5_vl_text", "qwen2"),
        ("qwen3_vl_text", "qwen3"),
    ],
    gguf_archs: &[
        GgufArch::plain(
            "qwen2",
            "qwen2",
            GgufWriting {
                // `LLM_TYPE_70B`: 80 layers of a Qwen2.
                seventy_b: |c| c.num_hidden_layers == 80,
                ..GgufWriting::PLAIN
            },
        ),
        GgufArch::plain("qwen3", "qwen3", GgufWriting::PLAIN),
        GgufArch::plain(
            "qwen2moe",
            "qwen2_moe",
            GgufWriting {
                // Qwen2-MoE's top-k weights are not renormalized there, and it needs its own
                // `output.weight`.
                moe_norm_topk: false,
                output_required: true,
                ..GgufWriting::PLAIN
            },
        ),
        GgufArch::plain("qwen3moe", "qwen3_moe", GgufWriting::PLAIN),
    ],
    torchtune_builders: &[
        ("qwen2", &["qwen2", "qwen2_moe"]),
        ("qwen2_5", &["qwen2"]),
        ("qwen3", &["qwen3", "qwen3_moe"]),
    ],
    ..Family::new(
        "Qwen",
        &[
            ModelType::new("qwen2", "Qwen2ForCausalLM")
                .gguf("qwen2", DENSE_GGUF)
                .torchtune(TorchtuneLayout::Plain),
            ModelType::new("qwen3", "Qwen3ForCausalLM").gguf("qwen3", DENSE_GGUF),
            ModelType::new("qwen2_moe", "Qwen2MoeForCausalLM").gguf("qwen2moe", moe_gguf(true)),
            ModelType::new("qwen3_moe", "Qwen3MoeForCausalLM").gguf("qwen3moe", moe_gguf(false)),
        ],
        &QwenRules,
    )
};

/// Dense Qwen in GGUF: llama.cpp runs it without sliding windows.
const DENSE_GGUF: GgufReading = GgufReading {
    config_keys: |_, c| {
        c.insert("use_sliding_window".into(), Value::Bool(false));
        Ok(())
    },
    ..GgufReading::LLAMA
};

/// Qwen-MoE in GGUF (`qwen2`: Qwen2-MoE, with its shared expert).
const fn moe_gguf(qwen2: bool) -> GgufReading {
    GgufReading {
        moe: Some(GgufMoe {
            mixtral_names: false,
            expert_ffn_is_ffn: false,
            shared_expert: qwen2,
            all_sparse: false,
        }),
        // llama.cpp renormalizes the top-k weights for Qwen3-MoE and not for Qwen2-MoE.
        config_keys: if qwen2 {
            |g, c| moe_keys(g, c, false)
        } else {
            |g, c| moe_keys(g, c, true)
        },
        ..GgufReading::LLAMA
    }
}

/// A Qwen-MoE GGUF file's experts. llama.cpp renormalizes the top-k weights for Qwen3-MoE and not
/// for Qwen2-MoE (what the released configs say), unless the file says otherwise.
fn moe_keys(
    g: GgufSource,
    c: &mut Map<String, Value>,
    norm_default: bool,
) -> Result<(), ModelError> {
    let hp = g.hp;
    c.insert("num_experts".into(), hp.experts.into());
    c.insert("num_experts_per_tok".into(), hp.experts_used.into());
    c.insert("moe_intermediate_size".into(), hp.expert_ffn.into());
    if let Some(shared) = hp.shared_ffn {
        c.insert("shared_expert_intermediate_size".into(), shared.into());
    }
    let norm = g
        .file
        .flag(&format!("{}.expert_weights_norm", g.file.arch()))
        .unwrap_or(norm_default);
    c.insert("norm_topk_prob".into(), Value::Bool(norm));
    c.insert("decoder_sparse_step".into(), 1.into());
    let dense: Vec<usize> = (0..hp.layers).filter(|&i| !hp.sparse_layers[i]).collect();
    c.insert("mlp_only_layers".into(), dense.into());
    c.insert("use_sliding_window".into(), Value::Bool(false));
    Ok(())
}

/// Qwen's reading of its configs.
#[derive(Debug)]
struct QwenRules;

impl HfConfig for QwenRules {
    /// Qwen slides only when `use_sliding_window` is set, and then from `max_window_layers` on.
    fn window_style(&self) -> WindowStyle {
        WindowStyle::Gated
    }

    fn configure(&self, hf: HfSource, c: &mut ModelConfig) -> HfResult<()> {
        let (model_type, obj) = (hf.model_type, hf.obj);
        // Qwen3: RMSNorm over each query and key head before RoPE.
        c.qk_norm = matches!(model_type, "qwen3" | "qwen3_moe");
        if matches!(model_type, "qwen2_moe" | "qwen3_moe") {
            c.moe = Some(parse_moe(
                obj,
                model_type == "qwen2_moe",
                c.num_hidden_layers,
            )?);
        }
        Ok(())
    }
}

/// Qwen2-MoE's and Qwen3-MoE's experts (`qwen2`: Qwen2-MoE's defaults and shared expert), with
/// transformers' defaults for keys left out.
fn parse_moe(obj: &Map<String, Value>, qwen2: bool, layers: usize) -> Result<MoeConfig, String> {
    let step = positive(obj, "decoder_sparse_step", 1)?;
    let dense = layer_list(obj, "mlp_only_layers")?;
    Ok(MoeConfig {
        // Hub configs name it `num_experts`; transformers 5 writes `num_local_experts`.
        num_experts: match get_usize(obj, "num_experts")? {
            Some(_) => positive(obj, "num_experts", 0)?,
            None => positive(obj, "num_local_experts", if qwen2 { 60 } else { 128 })?,
        },
        top_k: positive(obj, "num_experts_per_tok", if qwen2 { 4 } else { 8 })?,
        norm_topk_prob: get_bool(obj, "norm_topk_prob")?.unwrap_or(false),
        expert_intermediate_size: positive(
            obj,
            "moe_intermediate_size",
            if qwen2 { 1408 } else { 768 },
        )?,
        shared_expert_intermediate_size: if qwen2 {
            Some(positive(obj, "shared_expert_intermediate_size", 5632)?)
        } else {
            None
        },
        f32_routing_weights: false,
        sigmoid_input_routing: false,
        mixtral_names: false,
        sparse_layers: (0..layers)
            .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
            .collect(),
        sparse_mixer: None,
    })
}
