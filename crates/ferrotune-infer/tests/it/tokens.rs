//! The stop and pad tokens generation takes from a tokenizer and its model's config (what the
//! `generate` verb and the recipes share): the tokenizer's EOS first, then the config's others;
//! the pad from the tokenizer, else the config, else the tokenizer's EOS, else 0.

use candle_core::{DType, Device};
use ferrotune_data::Tokenizer;
use ferrotune_infer::{pad_id, stop_ids};
use ferrotune_models::{load_model, ModelConfig};

use ferrotune_testing::fixtures;

/// The tiny llama fixture's config (eos 2, pad 3).
fn config() -> ModelConfig {
    let dir = fixtures().join("llama3").join("model");
    load_model(&dir, DType::F32, &Device::Cpu).unwrap().0.config
}

/// The tiny tokenizer (`<|im_end|>` = 2 its EOS, `<pad>` = 3) with `tokenizer_config.json`'s
/// special tokens replaced by `special`, in a folder of its own.
fn tokenizer(name: &str, special: serde_json::Value) -> Tokenizer {
    let dir = std::env::temp_dir().join(format!("ferrotune-infer-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixtures().join("tiny_tokenizer").join("tokenizer.json");
    std::fs::copy(src, dir.join("tokenizer.json")).unwrap();
    std::fs::write(dir.join("tokenizer_config.json"), special.to_string()).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    tok
}

#[test]
fn stop_ids_are_the_tokenizers_eos_then_the_configs_others() {
    let tok = tokenizer("stop", serde_json::json!({"eos_token": "<|im_end|>"}));
    let mut config = config();
    config.eos_token_ids = vec![5, 2, 0];
    assert_eq!(stop_ids(&tok, &config), vec![2, 5, 0]);
    let none = tokenizer("stop-none", serde_json::json!({}));
    assert_eq!(stop_ids(&none, &config), vec![5, 2, 0]);
}

#[test]
fn pad_id_falls_back_from_the_tokenizer_to_the_config_to_eos_to_zero() {
    let mut config = config();
    config.pad_token_id = Some(7);
    let with_pad = tokenizer(
        "pad",
        serde_json::json!({"eos_token": "<|im_end|>", "pad_token": "<pad>"}),
    );
    assert_eq!(pad_id(&with_pad, &config), 3);
    let eos_only = tokenizer("pad-eos", serde_json::json!({"eos_token": "<|im_end|>"}));
    assert_eq!(pad_id(&eos_only, &config), 7);
    config.pad_token_id = None;
    assert_eq!(pad_id(&eos_only, &config), 2);
    let bare = tokenizer("pad-bare", serde_json::json!({}));
    config.eos_token_ids = vec![5];
    assert_eq!(pad_id(&bare, &config), 0);
}
