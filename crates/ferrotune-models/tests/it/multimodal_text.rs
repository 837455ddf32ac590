//! Multimodal Gemma 3, Mistral 3, Qwen-VL and Llama 3.2 Vision checkpoints (`...ForConditionalGeneration`) run as their text model: the
//! same logits as the text-only checkpoint of the same weights (golden_models checks them against
//! transformers), and PEFT adapters trained on the whole multimodal model attach to it.

use crate::common;

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

/// Saves an adapter (q_proj and down_proj, non-zero B) trained on `text_case`, renames its
/// tensors as PEFT names them on the whole multimodal model (`rename` of each text-model name),
/// adds `extra` adapter tensors of parts text alone does not run, and checks that `mm_case` with
/// that adapter gives the text model's adapted logits.
fn assert_whole_model_adapter_attaches(
    text_case: &str,
    mm_case: &str,
    rename: impl Fn(&str) -> String,
    extra: &[&str],
) {
    let dir = std::env::temp_dir().join(format!("ferrotune-{mm_case}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (text_dir, mm_dir) = (dir.join("text"), dir.join("mm"));
    std::fs::create_dir_all(&mm_dir).unwrap();

    // An adapter on the text model with non-zero B (PEFT starts B at zero).
    let mut text = load(text_case);
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

    let saved =
        candle_core::safetensors::load(text_dir.join(ADAPTER_WEIGHTS_FILE), &Device::Cpu).unwrap();
    let mut renamed: std::collections::HashMap<String, Tensor> =
        saved.into_iter().map(|(k, v)| (rename(&k), v)).collect();
    for name in extra {
        let shape = if name.contains("lora_A") {
            (4, 32)
        } else {
            (32, 4)
        };
        renamed.insert(
            name.to_string(),
            Tensor::ones(shape, DType::F32, &Device::Cpu).unwrap(),
        );
    }
    candle_core::safetensors::save(&renamed, mm_dir.join(ADAPTER_WEIGHTS_FILE)).unwrap();
    std::fs::copy(
        text_dir.join(ADAPTER_CONFIG_FILE),
        mm_dir.join(ADAPTER_CONFIG_FILE),
    )
    .unwrap();

    let mut mm = load(mm_case);
    load_adapter(&mut mm, &mm_dir).unwrap();
    let base = logits(&load(text_case));
    let (want, got) = (logits(&text), logits(&mm));
    assert!(
        max_abs_diff(&want, &base) > 1e-3,
        "the adapter changes nothing"
    );
    assert!(max_abs_diff(&got, &want) <= 1e-6, "{mm_case}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_peft_adapter_of_the_whole_multimodal_model_attaches_to_its_text_model() {
    // As PEFT names it on Gemma3ForConditionalGeneration (transformers 4.5x module paths), plus a
    // vision-tower adapter ferrotune must leave out.
    assert_whole_model_adapter_attaches(
        "gemma3",
        "gemma3_multimodal",
        |k| k.replacen("base_model.model.model.", "base_model.model.language_model.model.", 1),
        &["base_model.model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.lora_A.weight"],
    );
}

/// Llama 3.2 Vision (`mllama`): text alone skips the cross-attention layers (0 and 2 here), so
/// the text model is the Llama of the other layers, renumbered; the embedding's 8 image-token
/// rows past `vocab_size` are left out. Both the whole model (the Hub's 4.x names and rope keys)
/// and `MllamaForCausalLM` run as the Llama checkpoint of the same weights.
#[test]
fn llama_3_2_vision_runs_as_the_llama_of_its_self_attention_layers() {
    let text = load("llama3_1_meta");
    for case in ["mllama_multimodal", "mllama_text_model"] {
        let mm = load(case);
        assert!(mm.config.text_of_multimodal, "{case}");
        assert_eq!(mm.config.model_type, "llama");
        assert_eq!(
            mm.config.mllama.as_ref().unwrap().cross_attention_layers,
            [0, 2]
        );
        assert_eq!(mm.config.num_hidden_layers, 2);
        assert_eq!(mm.config.rope, text.config.rope, "{case}");
        assert!(!mm.config.tie_word_embeddings);
        assert_eq!(mm.config.raw["architectures"][0], "LlamaForCausalLM");
        assert_eq!(mm.config.raw["num_hidden_layers"], 2);
        assert!(mm.config.raw.get("cross_attention_layers").is_none());
        assert_eq!(max_abs_diff(&logits(&text), &logits(&mm)), 0.0, "{case}");
    }
    // Layer names map past the cross-attention layers, which (with the tower) map to nothing.
    let mm = load("mllama_multimodal");
    let name = |n: &str| mm.config.text_model_name(n);
    assert_eq!(
        name("language_model.model.layers.3.mlp.up_proj.weight").as_deref(),
        Some("model.layers.1.mlp.up_proj.weight")
    );
    assert_eq!(
        name("model.language_model.layers.1.self_attn.q_proj").as_deref(),
        Some("model.layers.0.self_attn.q_proj")
    );
    assert_eq!(
        name("language_model.model.layers.2.cross_attn.q_proj"),
        None
    );
    assert_eq!(
        name("model.vision_model.transformer.layers.0.mlp.fc1"),
        None
    );
    assert_eq!(name("vision_model.patch_embedding.weight"), None);
    // And back, as transformers 5 names the whole model's modules.
    for (text, checkpoint) in [
        (
            "model.layers.0.self_attn.q_proj",
            "model.language_model.layers.1.self_attn.q_proj",
        ),
        (
            "model.layers.1.mlp.up_proj.weight",
            "model.language_model.layers.3.mlp.up_proj.weight",
        ),
        ("model.norm.weight", "model.language_model.norm.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ] {
        assert_eq!(mm.config.checkpoint_name(text), checkpoint);
        assert_eq!(name(checkpoint).as_deref(), Some(text));
    }
    let text_model = load("mllama_text_model");
    assert_eq!(
        text_model
            .config
            .checkpoint_name("model.layers.1.mlp.up_proj"),
        "model.layers.3.mlp.up_proj"
    );
}

/// An adapter trained on Llama 3.2 Vision is saved under the checkpoint's names (its layers
/// numbered as the checkpoint numbers them, cross-attention layers and the tower excluded for
/// PEFT), and loads back onto the whole model and onto its text model alone.
#[test]
fn llama_3_2_vision_adapters_are_saved_under_the_checkpoints_names() {
    let dir = std::env::temp_dir().join(format!("ferrotune-mllama-adapter-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut mm = load("mllama_multimodal");
    let config = LoraConfig::new(
        4,
        8.0,
        TargetModules::Names(vec!["q_proj".into(), "up_proj".into(), "lm_head".into()]),
    );
    add_adapter(&mut mm, &config, 5).unwrap();
    for (_, linear) in mm.linears_mut() {
        if let Some(a) = &mut linear.adapter {
            a.b = Tensor::randn(0f32, 0.5, a.b.dims(), &Device::Cpu).unwrap();
        }
    }
    save_adapter(&mm, &config, &dir).unwrap();
    let saved =
        candle_core::safetensors::load(dir.join(ADAPTER_WEIGHTS_FILE), &Device::Cpu).unwrap();
    let mut names: Vec<&str> = saved.keys().map(String::as_str).collect();
    names.sort();
    assert_eq!(
        names,
        [
            // PEFT's default save keeps an adapted head's base weight beside it.
            "base_model.model.lm_head.base_layer.weight",
            "base_model.model.lm_head.lora_A.weight",
            "base_model.model.lm_head.lora_B.weight",
            "base_model.model.model.language_model.layers.1.mlp.up_proj.lora_A.weight",
            "base_model.model.model.language_model.layers.1.mlp.up_proj.lora_B.weight",
            "base_model.model.model.language_model.layers.1.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.language_model.layers.1.self_attn.q_proj.lora_B.weight",
            "base_model.model.model.language_model.layers.3.mlp.up_proj.lora_A.weight",
            "base_model.model.model.language_model.layers.3.mlp.up_proj.lora_B.weight",
            "base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.language_model.layers.3.self_attn.q_proj.lora_B.weight",
        ]
    );
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(ADAPTER_CONFIG_FILE)).unwrap())
            .unwrap();
    assert_eq!(
        written["exclude_modules"],
        r"model\.language_model\.layers\.(?:0|2)\..*|model\.vision_model\..*"
    );
    let want = logits(&mm);
    assert!(max_abs_diff(&want, &logits(&load("mllama_multimodal"))) > 1e-3);
    for case in ["mllama_multimodal", "mllama_text_model"] {
        let mut back = load(case);
        load_adapter(&mut back, &dir).unwrap();
        assert_eq!(max_abs_diff(&logits(&back), &want), 0.0, "{case}");
    }
    // The embedding's image-token rows are not the text model's: no adapter on it.
    let mut mm = load("mllama_multimodal");
    let embed = LoraConfig::new(4, 8.0, TargetModules::Names(vec!["embed_tokens".into()]));
    let err = add_adapter(&mut mm, &embed, 5).unwrap_err().to_string();
    assert!(err.contains("image-token rows"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A PEFT adapter of the whole Llama 3.2 Vision model: its self-attention layers' adapters land
/// on the renumbered layers; the cross-attention layers' and the tower's are left out.
#[test]
fn a_peft_adapter_of_llama_3_2_vision_attaches_to_its_text_layers() {
    let to_mllama = |k: &str| -> String {
        let rest = k
            .strip_prefix("base_model.model.model.layers.")
            .unwrap_or_else(|| panic!("{k}"));
        let (i, rest) = rest.split_once('.').unwrap();
        let i: usize = i.parse().unwrap();
        format!(
            "base_model.model.language_model.model.layers.{}.{rest}",
            2 * i + 1
        )
    };
    assert_whole_model_adapter_attaches(
        "llama3_1_meta",
        "mllama_multimodal",
        to_mllama,
        &[
            "base_model.model.language_model.model.layers.2.cross_attn.q_proj.lora_A.weight",
            "base_model.model.language_model.model.layers.2.cross_attn.q_proj.lora_B.weight",
            "base_model.model.vision_model.transformer.layers.0.self_attn.q_proj.lora_A.weight",
        ],
    );
}

/// What a run saves of Llama 3.2 Vision is the Llama text model: two layers, `vocab_size` rows of
/// embedding, LlamaForCausalLM's config; it loads back to the same logits.
#[test]
fn llama_3_2_vision_saves_its_text_model_as_llama() {
    let mm = load("mllama_multimodal");
    let tensors = ferrotune_models::peft::merged_tensors(&mm).unwrap();
    assert_eq!(tensors["model.embed_tokens.weight"].dims(), [512, 32]);
    assert!(tensors.contains_key("model.layers.1.self_attn.q_proj.weight"));
    assert!(!tensors
        .keys()
        .any(|k| k.starts_with("model.layers.2.") || k.contains("cross_attn")));
    let dir = std::env::temp_dir().join(format!("ferrotune-mllama-save-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    ferrotune_models::save_hf_checkpoint(&dir, &mm.config, None, &tensors, DType::F32, u64::MAX)
        .unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "llama");
    assert_eq!(config["architectures"][0], "LlamaForCausalLM");
    let saved = load_model(&dir, DType::F32, &Device::Cpu).unwrap().0;
    assert!(!saved.config.text_of_multimodal);
    assert_eq!(max_abs_diff(&logits(&mm), &logits(&saved)), 0.0);
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

/// Gemma 4 as it ships (`Gemma4ForConditionalGeneration`, tensors `model.language_model.*`, a
/// vision tower left unread) runs as its text model: the E-model shape (per-layer embeddings,
/// shared keys and values) and the mixture-of-experts shape (fused experts, router scales).
#[test]
fn multimodal_gemma_4_runs_as_its_text_model() {
    for (mm_case, text_case) in [
        ("gemma4_multimodal", "gemma4_e2b_like"),
        ("gemma4_moe_multimodal", "gemma4_moe"),
    ] {
        let (text, mm) = (load(text_case), load(mm_case));
        assert!(mm.config.text_of_multimodal, "{mm_case}");
        assert_eq!(mm.config.model_type, "gemma4_text");
        assert_eq!(mm.config.raw["architectures"][0], "Gemma4ForCausalLM");
        assert_eq!(
            mm.config.gemma4.as_ref().map(|g| g.moe.is_some()),
            Some(text_case == "gemma4_moe")
        );
        assert_eq!(max_abs_diff(&logits(&text), &logits(&mm)), 0.0, "{mm_case}");
    }
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
