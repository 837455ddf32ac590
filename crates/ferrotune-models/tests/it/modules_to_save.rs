//! PEFT adapters with `modules_to_save`: the saved whole modules replace the base's, as
//! `PeftModel.from_pretrained` runs them — an untied head and embedding, a vocabulary resized with
//! `resize_token_embeddings`, a tied head kept as it was while the embedding is replaced, and an
//! `adapter_model.bin` (scripts/make_modules_to_save_fixtures.py; logits from PEFT 0.21).

use crate::common;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use ferrotune_models::peft::{load_adapter, merge_and_unload};
use ferrotune_models::{load_model, AttentionLayout, CausalLm};
use serde_json::Value;

use common::{fixtures, max_abs_diff};

fn forward(model: &CausalLm, ids: &Value) -> Tensor {
    let rows: Vec<Vec<u32>> = serde_json::from_value(ids.clone()).unwrap();
    let (b, t) = (rows.len(), rows[0].len());
    let ids = Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap();
    model
        .forward(&ids, &AttentionLayout::causal(b, t, 0), None)
        .unwrap()
}

fn case(name: &str) -> (CausalLm, Value, Tensor, std::path::PathBuf) {
    let dir = fixtures().join("peft_modules_to_save").join(name);
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let base = fixtures()
        .join("models")
        .join(g["base"].as_str().unwrap())
        .join("model");
    let (model, _) = load_model(&base, DType::F32, &Device::Cpu).unwrap();
    let want = candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu)
        .unwrap()
        .remove("logits")
        .unwrap();
    (model, g, want, dir.join("adapter"))
}

#[test]
fn saved_modules_replace_the_base_as_peft_loads_them() {
    for name in ["untied", "resized", "tied", "bin"] {
        let (mut model, g, want, adapter) = case(name);
        let config = load_adapter(&mut model, &adapter).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(!config.modules_to_save.is_empty());
        let got = forward(&model, &g["input_ids"]);
        assert_eq!(got.dims(), want.dims(), "{name}");
        let err = max_abs_diff(&got, &want);
        assert!(err < 1e-4, "{name}: max abs error {err}");
        // Merged, the replaced modules stay; the vocabulary and tying are the new ones.
        merge_and_unload(&mut model).unwrap();
        let err = max_abs_diff(&forward(&model, &g["input_ids"]), &want);
        assert!(err < 1e-4, "{name}: merged: max abs error {err}");
        let vocab = want.dim(2).unwrap();
        assert_eq!(model.config.vocab_size, vocab, "{name}");
        assert_eq!(model.config.raw["vocab_size"], vocab, "{name}");
        if name == "tied" {
            assert!(!model.config.tie_word_embeddings);
            assert_eq!(model.config.raw["tie_word_embeddings"], false);
        }
    }
}

#[test]
fn a_saved_module_the_model_lacks_is_named() {
    let (mut model, _, _, adapter) = case("untied");
    let dir = std::env::temp_dir().join(format!("ferrotune-mts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let mut config: Value = serde_json::from_str(
        &std::fs::read_to_string(adapter.join("adapter_config.json")).unwrap(),
    )
    .unwrap();
    config["modules_to_save"] = serde_json::json!(["lm_head", "embed_tokens", "extra_head"]);
    std::fs::write(dir.join("adapter_config.json"), config.to_string()).unwrap();
    let mut tensors =
        candle_core::safetensors::load(adapter.join("adapter_model.safetensors"), &Device::Cpu)
            .unwrap();
    tensors.insert(
        "base_model.model.extra_head.weight".into(),
        Tensor::zeros((2, 32), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&tensors, dir.join("adapter_model.safetensors")).unwrap();
    let err = load_adapter(&mut model, Path::new(&dir))
        .unwrap_err()
        .to_string();
    assert!(err.contains("extra_head.weight"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
