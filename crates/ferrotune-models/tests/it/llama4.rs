//! Llama 4's text model (`llama4_text`, and `Llama4ForConditionalGeneration` as Scout and Maverick
//! ship): its layout read from the config, transformers' logits (golden_models also checks the
//! KV cache and bf16), packed samples attending within their own chunks, adapters under the
//! checkpoint's names, and saving back in the checkpoint's layout (fused experts).

use crate::common;

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use ferrotune_models::peft::{add_adapter, merged_tensors, save_adapter, ADAPTER_WEIGHTS_FILE};
use ferrotune_models::{
    load_adapter, load_model, read_checkpoint, AttentionLayout, CausalLm, LoraConfig, ModelConfig,
    TargetModules,
};
use serde_json::json;

use common::{fixtures, max_abs_diff};

fn model_dir(case: &str) -> PathBuf {
    fixtures().join("models").join(case).join("model")
}

fn load(case: &str) -> CausalLm {
    load_model(&model_dir(case), DType::F32, &Device::Cpu)
        .unwrap()
        .0
}

fn golden_logits(case: &str) -> Tensor {
    let dir = fixtures().join("models").join(case);
    candle_core::safetensors::load(dir.join("golden.safetensors"), &Device::Cpu).unwrap()["logits"]
        .clone()
}

fn golden_ids(case: &str) -> Tensor {
    let dir = fixtures().join("models").join(case);
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden.json")).unwrap()).unwrap();
    let rows: Vec<Vec<u32>> = serde_json::from_value(g["input_ids"].clone()).unwrap();
    Tensor::new(rows, &Device::Cpu).unwrap()
}

fn forward(model: &CausalLm, ids: &Tensor) -> Tensor {
    let (b, t) = ids.dims2().unwrap();
    model
        .forward(ids, &AttentionLayout::causal(b, t, 0), None)
        .unwrap()
}

#[test]
fn the_config_gives_llama_4s_layout() {
    for case in ["llama4", "llama4_multimodal"] {
        let c = load(case).config;
        assert_eq!(c.model_type, "llama4_text", "{case}");
        assert_eq!(c.text_of_multimodal, case == "llama4_multimodal");
        assert_eq!(c.rope_layers, [true, false, true, false], "{case}");
        assert_eq!(c.layer_attention_chunks, [Some(6), None, Some(6), None]);
        assert_eq!(c.nope_attn_temperature, Some((0.5, 4.0)));
        assert!(c.rope_interleaved && c.rope_layer_qk_l2_norm && c.llama4_names);
        // Dense layers take intermediate_size_mlp, the experts and shared expert intermediate_size.
        assert_eq!(c.intermediate_size, 96);
        let moe = c.moe.clone().unwrap();
        assert_eq!(moe.sparse_layers, [false, true, true, false]);
        assert_eq!(
            (moe.num_experts, moe.top_k, moe.expert_intermediate_size),
            (4, 1, 24)
        );
        assert_eq!(moe.shared_expert_intermediate_size, Some(24));
        assert!(moe.sigmoid_input_routing && !moe.norm_topk_prob);
        assert_eq!(c.router_aux_loss_coef(), None);
    }
}

/// Keys a config leaves out take Llama4TextConfig's defaults: every fourth layer without RoPE,
/// chunks of 8192 on the RoPE layers, every layer sparse, 16 experts top-1, the query temperature
/// (0.1, 8192), the L2 q/k norm; `attention_chunk_size` null and `use_qk_norm` /
/// `attn_temperature_tuning` false turn those off; `moe_layers` and `interleave_moe_layer_step`
/// pick the sparse layers.
#[test]
fn left_out_keys_take_llama4_text_configs_defaults() {
    let base = json!({
        "model_type": "llama4_text", "vocab_size": 64, "hidden_size": 16,
        "intermediate_size": 8, "intermediate_size_mlp": 24, "num_hidden_layers": 8,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
    });
    let c = ModelConfig::from_hf_json(&base).unwrap();
    let every_fourth: Vec<bool> = (0..8).map(|i| (i + 1) % 4 != 0).collect();
    assert_eq!(c.rope_layers, every_fourth);
    let chunks: Vec<Option<usize>> = every_fourth.iter().map(|&r| r.then_some(8192)).collect();
    assert_eq!(c.layer_attention_chunks, chunks);
    assert_eq!(c.nope_attn_temperature, Some((0.1, 8192.0)));
    assert!(c.rope_layer_qk_l2_norm && c.rope_interleaved);
    assert_eq!(c.rope.theta, 500_000.0);
    let moe = c.moe.unwrap();
    assert_eq!((moe.num_experts, moe.top_k), (16, 1));
    assert_eq!(moe.sparse_layers, vec![true; 8]);

    let mut off = base.clone();
    off["attention_chunk_size"] = json!(null);
    off["use_qk_norm"] = json!(false);
    off["attn_temperature_tuning"] = json!(false);
    off["interleave_moe_layer_step"] = json!(2);
    off["no_rope_layers"] = json!([]);
    let c = ModelConfig::from_hf_json(&off).unwrap();
    assert_eq!(c.layer_attention_chunks, vec![None; 8]);
    assert!(!c.rope_layer_qk_l2_norm && c.nope_attn_temperature.is_none());
    assert_eq!(c.rope_layers, every_fourth);
    let step_two: Vec<bool> = (0..8).map(|i| i % 2 == 1).collect();
    assert_eq!(c.moe.unwrap().sparse_layers, step_two);

    let mut listed = base.clone();
    listed["moe_layers"] = json!([0, 5]);
    listed["layer_types"] = json!(vec!["full_attention"; 8]);
    let c = ModelConfig::from_hf_json(&listed).unwrap();
    let sparse: Vec<bool> = (0..8).map(|i| i == 0 || i == 5).collect();
    assert_eq!(c.moe.unwrap().sparse_layers, sparse);
    assert_eq!(c.layer_attention_chunks, vec![None; 8]);

    let mut bad = base.clone();
    bad["layer_types"] = json!(vec!["sliding_attention"; 8]);
    let err = ModelConfig::from_hf_json(&bad).unwrap_err();
    assert!(
        err.contains("'layer_types'") && err.contains("sliding_attention"),
        "{err}"
    );
}

/// Both checkpoints give transformers' logits (f32, 4 layers: chunked RoPE layers with the L2
/// q/k norm, NoPE layers past the point where their query temperature exceeds 1, a dense and a
/// sparse layer of each kind).
#[test]
fn both_checkpoints_give_transformers_logits() {
    let want = golden_logits("llama4");
    let ids = golden_ids("llama4");
    for case in ["llama4", "llama4_multimodal"] {
        let err = max_abs_diff(&forward(&load(case), &ids), &want);
        assert!(err <= 3e-5, "{case}: max abs error {err}");
    }
}

/// Samples packed into one row attend only within themselves, with their chunks and query
/// temperatures counted from their own start: the same logits as each alone.
#[test]
fn packed_samples_equal_separate_ones() {
    let model = load("llama4");
    let a: Vec<u32> = (0..11).map(|i| 7 + 13 * i).collect();
    let b: Vec<u32> = (0..9).map(|i| 300 - 17 * i).collect();
    let alone = |s: &[u32]| {
        forward(
            &model,
            &Tensor::new(s, &Device::Cpu).unwrap().unsqueeze(0).unwrap(),
        )
    };
    let packed: Vec<u32> = a.iter().chain(&b).copied().collect();
    let n = packed.len();
    let layout = AttentionLayout {
        positions: vec![(0..a.len() as u32).chain(0..b.len() as u32).collect()],
        key_valid: vec![vec![true; n]],
        segments: Some(vec![std::iter::repeat_n(0, a.len())
            .chain(std::iter::repeat_n(1, b.len()))
            .collect()]),
    };
    let ids = Tensor::new(packed.as_slice(), &Device::Cpu)
        .unwrap()
        .unsqueeze(0)
        .unwrap();
    let got = model.forward(&ids, &layout, None).unwrap();
    let want = Tensor::cat(&[alone(&a), alone(&b)], 1).unwrap();
    let err = max_abs_diff(&got, &want);
    assert!(err <= 1e-5, "packed differs by {err}");
}

/// A model is saved in the checkpoint's own layout: `feed_forward.*` names, the router
/// `feed_forward.router`, the experts fused back into `gate_up_proj` / `down_proj`: exactly the
/// tensors of the checkpoint, equal to them.
#[test]
fn saving_gives_back_the_checkpoints_tensors() {
    for case in ["llama4", "llama4_multimodal"] {
        let model = load(case);
        let saved = merged_tensors(&model).unwrap();
        let ckpt =
            candle_core::safetensors::load(model_dir(case).join("model.safetensors"), &Device::Cpu)
                .unwrap();
        let want: HashMap<String, Tensor> = ckpt
            .into_iter()
            .filter_map(|(k, v)| Some((ferrotune_models::checkpoint::text_model_tensor(&k)?, v)))
            .collect();
        let mut names: Vec<&String> = saved.keys().collect();
        let mut want_names: Vec<&String> = want.keys().collect();
        names.sort();
        want_names.sort();
        assert_eq!(names, want_names, "{case}");
        for (name, t) in &saved {
            assert_eq!(max_abs_diff(t, &want[name]), 0.0, "{case}: {name}");
        }
    }
    let dir = std::env::temp_dir().join(format!("ferrotune-llama4-save-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mm = load("llama4_multimodal");
    let tensors = merged_tensors(&mm).unwrap();
    ferrotune_models::save_hf_checkpoint(&dir, &mm.config, None, &tensors, DType::F32, u64::MAX)
        .unwrap();
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["model_type"], "llama4_text");
    assert_eq!(config["architectures"][0], "Llama4ForCausalLM");
    let back = read_checkpoint(&dir, DType::F32, &Device::Cpu).unwrap();
    assert!(!back.config.text_of_multimodal);
    let back = CausalLm::from_tensors(back.config, back.tensors, "saved").unwrap();
    let ids = golden_ids("llama4");
    assert_eq!(
        max_abs_diff(&forward(&mm, &ids), &forward(&back, &ids)),
        0.0
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// LoRA on every projection name reaches what PEFT reaches on Llama 4 — the attention, the dense
/// layers' MLPs and the shared experts — never the fused experts; the adapter is saved under the
/// checkpoint's names (`feed_forward.*`) and loads back to the same logits.
#[test]
fn adapters_skip_the_fused_experts_and_keep_the_checkpoints_names() {
    let mut model = load("llama4");
    let names = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ];
    let config = LoraConfig::new(
        2,
        4.0,
        TargetModules::Names(names.iter().map(|n| n.to_string()).collect()),
    );
    add_adapter(&mut model, &config, 3).unwrap();
    let adapted: Vec<String> = model
        .linears()
        .into_iter()
        .filter(|(_, l)| l.adapter.is_some())
        .map(|(n, _)| n)
        .collect();
    // 4 attention projections × 4 layers, 3 MLP projections in each of the 4 layers.
    assert_eq!(adapted.len(), 28, "{adapted:?}");
    assert!(
        !adapted.iter().any(|n| n.contains(".experts.")),
        "{adapted:?}"
    );
    for (_, linear) in model.linears_mut() {
        if let Some(a) = &mut linear.adapter {
            a.b = Tensor::randn(0f32, 0.5, a.b.dims(), &Device::Cpu).unwrap();
        }
    }
    let dir = std::env::temp_dir().join(format!("ferrotune-llama4-lora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    save_adapter(&model, &config, &dir).unwrap();
    let saved =
        candle_core::safetensors::load(dir.join(ADAPTER_WEIGHTS_FILE), &Device::Cpu).unwrap();
    for layer in [1, 2] {
        for p in ["gate_proj", "up_proj", "down_proj"] {
            let key = format!(
                "base_model.model.model.layers.{layer}.feed_forward.shared_expert.{p}.lora_A.weight"
            );
            assert!(saved.contains_key(&key), "{key}: {:?}", saved.keys());
        }
    }
    assert!(
        saved.contains_key("base_model.model.model.layers.0.feed_forward.gate_proj.lora_B.weight")
    );
    assert!(!saved
        .keys()
        .any(|k| k.contains(".mlp.") || k.contains("experts.")));
    let ids = golden_ids("llama4");
    let want = forward(&model, &ids);
    assert!(max_abs_diff(&want, &golden_logits("llama4")) > 1e-3);
    for case in ["llama4", "llama4_multimodal"] {
        let mut back = load(case);
        load_adapter(&mut back, &dir).unwrap();
        assert_eq!(max_abs_diff(&forward(&back, &ids), &want), 0.0, "{case}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Llama 4 checkpoint in PyTorch pickles is refused by name (its fused experts and
/// `feed_forward.*` names are read from safetensors only).
#[test]
fn a_pickled_llama4_checkpoint_is_refused_with_the_reason() {
    let dir = std::env::temp_dir().join(format!("ferrotune-llama4-bin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::copy(
        model_dir("llama4").join("config.json"),
        dir.join("config.json"),
    )
    .unwrap();
    std::fs::write(dir.join("pytorch_model.bin"), b"").unwrap();
    let Err(err) = read_checkpoint(&dir, DType::F32, &Device::Cpu) else {
        panic!("a .bin Llama 4 checkpoint was read");
    };
    let err = err.to_string();
    assert!(
        err.contains("Llama 4") && err.contains("safetensors"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
