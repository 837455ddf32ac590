//! Multimodal Gemma 3 and Mistral 3 checkpoints (`...ForConditionalGeneration`) run as their text model: the
//! same logits as the text-only checkpoint of the same weights (golden_models checks them against
//! transformers), and PEFT adapters trained on the whole multimodal model attach to it.

mod common;

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use ferrotune_models::peft::{
    add_adapter, save_adapter, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE,
};
use ferrotune_models::{
    load_adapter, load_model, AttentionLayout, CausalLm, LoraConfig, TargetModules,
};

use common::{fixtures, max_abs_diff};

fn models() -> PathBuf {
    fixtures().join("models")
}

fn load(case: &str) -> CausalLm {
    load_model(&models().join(case).join("model"), DType::F32, &Device::Cpu)
        .unwrap()
        .0
}

fn logits(model: &CausalLm) -> Tensor {
    let ids = Tensor::new(&[[5u32, 9, 44, 7, 100, 3, 250, 17]], &Device::Cpu).unwrap();
    model
        .forward(&ids, &AttentionLayout::causal(1, 8, 0), None)
        .unwrap()
}

#[test]
fn the_text_model_of_a_multimodal_checkpoint_is_the_text_checkpoint() {
    let text = load("gemma3");
    let mm = load("gemma3_multimodal");
    assert!(mm.config.text_of_multimodal && !text.config.text_of_multimodal);
    assert_eq!(mm.config.model_type, "gemma3_text");
    // The text_config leaves out what equals Gemma3TextConfig's defaults.
    assert_eq!(mm.config.rms_norm_eps, 1e-6);
    assert_eq!(mm.config.local_rope, text.config.local_rope);
    assert_eq!(max_abs_diff(&logits(&text), &logits(&mm)), 0.0);
}

#[test]
fn a_peft_adapter_of_the_whole_multimodal_model_attaches_to_its_text_model() {
    let dir = std::env::temp_dir().join(format!("ferrotune-gemma3-mm-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (text_dir, mm_dir) = (dir.join("text"), dir.join("mm"));
    std::fs::create_dir_all(&mm_dir).unwrap();

    // An adapter on the text model with non-zero B (PEFT starts B at zero).
    let mut text = load("gemma3");
    let config = LoraConfig::new(
        4,
        8.0,
        TargetModules::Names(vec!["q_proj".into(), "down_proj".into()]),
    );
    add_adapter(&mut text, &config, 3).unwrap();
    for (i, (_, linear)) in text.linears_mut().into_iter().enumerate() {
        if let Some(a) = &mut linear.adapter {
            a.b = Tensor::randn(0f32, 0.5, a.b.dims(), &Device::Cpu)
                .unwrap()
                .affine(1.0, i as f64 * 0.01)
                .unwrap();
        }
    }
    save_adapter(&text, &config, &text_dir).unwrap();

    // The same adapter as PEFT names it on Gemma3ForConditionalGeneration (transformers 4.5x
    // module paths), plus a vision-tower adapter ferrotune must leave out.
    let saved =
        candle_core::safetensors::load(text_dir.join(ADAPTER_WEIGHTS_FILE), &Device::Cpu).unwrap();
    let mut renamed: std::collections::HashMap<String, Tensor> = saved
        .into_iter()
        .map(|(k, v)| {
            let k = k.replacen(
                "base_model.model.model.",
                "base_model.model.language_model.model.",
                1,
            );
            (k, v)
        })
        .collect();
    renamed.insert(
        "base_model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"
            .into(),
        Tensor::zeros((4, 16), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&renamed, mm_dir.join(ADAPTER_WEIGHTS_FILE)).unwrap();
    std::fs::copy(
        text_dir.join(ADAPTER_CONFIG_FILE),
        mm_dir.join(ADAPTER_CONFIG_FILE),
    )
    .unwrap();

    let mut mm = load("gemma3_multimodal");
    load_adapter(&mut mm, &mm_dir).unwrap();
    let base = logits(&load("gemma3"));
    let (want, got) = (logits(&text), logits(&mm));
    assert!(
        max_abs_diff(&want, &base) > 1e-3,
        "the adapter changes nothing"
    );
    assert!(max_abs_diff(&got, &want) <= 1e-6);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_multimodal_mistral_3_runs_as_its_untied_text_model() {
    let text = load("mistral");
    let mm = load("mistral3_multimodal");
    assert!(mm.config.text_of_multimodal);
    assert_eq!(mm.config.model_type, "mistral");
    // The checkpoint holds language_model.lm_head: untied, whatever the top-level flag says.
    assert!(!mm.config.tie_word_embeddings);
    assert_eq!(mm.config.raw["architectures"][0], "MistralForCausalLM");
    assert_eq!(mm.config.raw["tie_word_embeddings"], false);
    assert_eq!(max_abs_diff(&logits(&text), &logits(&mm)), 0.0);
}

/// Qwen2.5-VL (its Hub config: text keys at the top level, `rope_scaling` of type `mrope`; text
/// tensors `model.layers.*`, the tower `visual.*`) and Qwen3-VL (transformers 5's `text_config`
/// with interleaved mrope; `model.language_model.*`, `model.visual.*`, a tied head) run as Qwen2
/// and Qwen3: on text alone every mrope section sits at the same position, which is plain RoPE.
#[test]
fn qwen_vision_language_models_run_as_their_text_model() {
    for (mm_case, text_case, family, class, tied) in [
        (
            "qwen2_5_vl_multimodal",
            "qwen2_5",
            "qwen2",
            "Qwen2ForCausalLM",
            false,
        ),
        (
            "qwen3_vl_multimodal",
            "qwen3",
            "qwen3",
            "Qwen3ForCausalLM",
            true,
        ),
    ] {
        let text = load(text_case);
        let mm = load(mm_case);
        assert!(mm.config.text_of_multimodal, "{mm_case}");
        assert_eq!(mm.config.model_type, family);
        assert_eq!(mm.config.raw["architectures"][0], class);
        assert_eq!(mm.config.tie_word_embeddings, tied, "{mm_case}");
        assert_eq!(
            mm.config.rope.scaling,
            ferrotune_models::config::RopeScaling::Default
        );
        let raw = mm.config.raw.to_string();
        assert!(
            !raw.contains("mrope") && !raw.contains("vision_config"),
            "{raw}"
        );
        assert_eq!(max_abs_diff(&logits(&text), &logits(&mm)), 0.0, "{mm_case}");
    }
}
