//! gpt-oss (`gpt_oss`): its layout read from the config (and `GptOssConfig`'s defaults for keys
//! left out), full fine-tuning gradients of every parameter (the attention sinks, the router and
//! the fused experts among them) and a PEFT LoRA adapter's logits, loss and gradients against
//! transformers 5.24 + PEFT 0.21, saving back the checkpoint's tensors, and what is refused
//! (MXFP4 experts, the router's auxiliary loss). golden_models checks the logits, loss, KV cache
//! and bf16 of tests/fixtures/models/gpt_oss; ferrotune-infer its greedy tokens. Fixtures:
//! scripts/make_model_fixtures.py (gpt_oss) and scripts/make_gpt_oss_fixtures.py.

use crate::common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use ferrotune_models::lora::set_training;
use ferrotune_models::model::FeedForward;
use ferrotune_models::peft::merge_and_unload;
use ferrotune_models::peft::{add_adapter, attach_adapter, merged_tensors, trainable_parameters};
use ferrotune_models::{
    load_adapter, load_model, read_checkpoint, save_adapter, save_hf_checkpoint, AttentionLayout,
    CausalLm, LoraConfig, ModelConfig, TargetModules,
};
use serde_json::{json, Value};

use common::{causal_lm_loss, fixtures, max_abs_diff, rel_l2};

fn case_dir() -> PathBuf {
    fixtures().join("models/gpt_oss")
}

fn load() -> CausalLm {
    load_model(&case_dir().join("model"), DType::F32, &Device::Cpu)
        .unwrap()
        .0
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn tensors(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn ids(rows: &Value) -> Tensor {
    let rows: Vec<Vec<u32>> = serde_json::from_value(rows.clone()).unwrap();
    Tensor::new(rows, &Device::Cpu).unwrap()
}

fn forward(model: &CausalLm, ids: &Tensor) -> Tensor {
    let (b, t) = ids.dims2().unwrap();
    model
        .forward(ids, &AttentionLayout::causal(b, t, 0), None)
        .unwrap()
}

/// The fixture's config: sliding (window 4) / full / sliding layers, sinks, 4 experts top-2
/// with the SwiGLU clamp at 2.0, and `GptOssConfig`'s default YaRN as written out.
#[test]
fn the_config_gives_gpt_oss_layout() {
    let c = load().config;
    assert_eq!(c.model_type, "gpt_oss");
    assert_eq!(c.layer_sliding_windows, [Some(4), None, Some(4)]);
    assert!(c.attention_sinks);
    let m = c.gpt_oss_moe.as_ref().unwrap();
    assert_eq!(
        (m.num_experts, m.top_k, m.alpha, m.limit),
        (4, 2, 1.702, 2.0)
    );
    assert_eq!(c.rope.theta, 150_000.0);
    assert_eq!(
        c.rope.scaling,
        ferrotune_models::config::RopeScaling::Yarn {
            factor: 32.0,
            original_max_position_embeddings: 4096,
            attention_factor: None,
            beta_fast: 32.0,
            beta_slow: 1.0,
            mscale: None,
            mscale_all_dim: None,
            truncate: false,
        }
    );
    assert!(c.moe.is_none() && c.router_aux_loss_coef().is_none());
    // With `output_router_logits`, training adds the router's auxiliary loss (checked against
    // transformers in ferrotune-train's step tests).
    let c = ModelConfig::from_hf_json(&json!({
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "output_router_logits": true,
    }))
    .unwrap();
    assert_eq!(c.router_aux_loss_coef(), Some(0.001));
}

/// Keys left out take `GptOssConfig`'s defaults: alternating sliding (128) / full layers, its
/// YaRN rope with theta 150000, head_dim 64 and 8 key/value heads whatever the hidden size,
/// eps 1e-5, 128 experts top-4, the clamp at 7; a 4.x config's `rope_theta` beside no scaling
/// keeps the default YaRN.
#[test]
fn left_out_keys_take_gpt_oss_config_defaults() {
    let c = ModelConfig::from_hf_json(&json!({
        "model_type": "gpt_oss",
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "hidden_size": 256,
    }))
    .unwrap();
    let w = Some(128);
    assert_eq!(c.layer_sliding_windows, [w, None, w, None]);
    assert_eq!((c.head_dim, c.num_key_value_heads), (64, 8));
    assert_eq!(c.rms_norm_eps, 1e-5);
    assert_eq!(c.rope.theta, 150_000.0);
    assert!(matches!(
        c.rope.scaling,
        ferrotune_models::config::RopeScaling::Yarn {
            factor: 32.0,
            original_max_position_embeddings: 4096,
            truncate: false,
            ..
        }
    ));
    let m = c.gpt_oss_moe.unwrap();
    assert_eq!(
        (m.num_experts, m.top_k, m.alpha, m.limit),
        (128, 4, 1.702, 7.0)
    );
    assert!(!c.tie_word_embeddings);
    let c = ModelConfig::from_hf_json(&json!({
        "model_type": "gpt_oss",
        "num_hidden_layers": 2,
        "rope_theta": 5000.0,
        "num_experts": 8,
        "sliding_window": null,
    }))
    .unwrap();
    assert_eq!(c.rope.theta, 5000.0);
    assert!(matches!(
        c.rope.scaling,
        ferrotune_models::config::RopeScaling::Yarn { .. }
    ));
    assert_eq!(c.layer_sliding_windows, [None, None]);
    assert_eq!(c.gpt_oss_moe.unwrap().num_experts, 8);
}

/// What gpt-oss cannot be is refused naming it: an unknown layer type, more experts per token
/// than experts.
#[test]
fn unsupported_configs_are_refused_by_name() {
    for (extra, named) in [
        (
            json!({"layer_types": ["sliding_attention", "chunked_attention"]}),
            "chunked_attention",
        ),
        (
            json!({"num_local_experts": 2, "num_experts_per_tok": 3}),
            "num_experts_per_tok",
        ),
    ] {
        let mut cfg = json!({"model_type": "gpt_oss", "num_hidden_layers": 2});
        for (k, v) in extra.as_object().unwrap() {
            cfg[k] = v.clone();
        }
        let err = ModelConfig::from_hf_json(&cfg).unwrap_err();
        assert!(err.contains(named), "{err}");
    }
}

/// MXFP4 parts that reach the model without being dequantized (not read as U8 from
/// safetensors) are refused with the tensor's name, not read as missing experts.
#[test]
fn undequantized_mxfp4_experts_are_refused_naming_the_tensor() {
    let ckpt = read_checkpoint(&case_dir().join("model"), DType::F32, &Device::Cpu).unwrap();
    let mut tensors = ckpt.tensors;
    let name = "model.layers.1.mlp.experts.down_proj";
    let t = tensors.remove(name).unwrap();
    tensors.insert(format!("{name}_blocks"), t.clone());
    tensors.insert(format!("{name}_scales"), t);
    let err = CausalLm::from_tensors(ckpt.config, tensors, "ckpt")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.layers.1.mlp.experts.down_proj_blocks") && err.contains("MXFP4"),
        "{err}"
    );
}

/// Full fine-tuning: every parameter (the sinks, the router's weight and bias, the fused experts
/// and their biases, q/k/v/o with biases, norms, embedding, head) gets transformers' gradient
/// of the golden loss, each to 1e-4 relative L2.
#[test]
fn full_fine_tuning_gradients_match_transformers() {
    let g = read_json(&case_dir().join("golden.json"));
    let mut model = load();
    let params = model.make_all_trainable().unwrap();
    let logits = forward(&model, &ids(&g["input_ids"]));
    let loss = causal_lm_loss(&logits, &g["labels"]);
    let want_loss = g["loss"].as_f64().unwrap();
    let got = loss.to_scalar::<f32>().unwrap() as f64;
    assert!((got - want_loss).abs() <= 1e-4, "loss {got} vs {want_loss}");
    let grads = loss.backward().unwrap();
    let want = tensors(&case_dir().join("grads.safetensors"));
    let mut names: Vec<&String> = params.iter().map(|(n, _)| n).collect();
    let mut want_names: Vec<&String> = want.keys().collect();
    names.sort();
    want_names.sort();
    assert_eq!(names, want_names);
    assert!(names.iter().any(|n| n.ends_with("self_attn.sinks")));
    for (name, var) in &params {
        let got = grads
            .get(var)
            .unwrap_or_else(|| panic!("{name}: no gradient"));
        let err = rel_l2(got, &want[name]);
        assert!(err <= 1e-4, "{name}: gradient relative L2 error {err}");
    }
}

/// PEFT's `all-linear` adapter on gpt-oss (q/k/v/o_proj: the router and the experts are no
/// `nn.Linear`): PEFT's logits and loss in training mode, and every LoRA gradient to 1e-4
/// relative L2.
#[test]
fn lora_logits_loss_and_gradients_match_peft() {
    let dir = fixtures().join("gpt_oss_lora/all_linear");
    let g = read_json(&dir.join("golden.json"));
    let mut model = load();
    load_adapter(&mut model, &dir.join("adapter")).unwrap();
    let adapted: Vec<String> = model
        .linears()
        .into_iter()
        .filter(|(_, l)| l.adapter.is_some())
        .map(|(n, _)| n)
        .collect();
    let mut want_targets: Vec<String> =
        serde_json::from_value(g["target_modules"].clone()).unwrap();
    want_targets.sort();
    let mut adapted_sorted = adapted.clone();
    adapted_sorted.sort();
    assert_eq!(adapted_sorted, want_targets);
    let params = trainable_parameters(&mut model).unwrap();
    set_training(&mut model, true);
    let logits = forward(&model, &ids(&g["input_ids"]));
    let err = max_abs_diff(
        &logits,
        &tensors(&dir.join("golden.safetensors"))["lora_logits"],
    );
    assert!(err <= 1e-4, "logits max abs error {err}");
    let loss = causal_lm_loss(&logits, &g["labels"]);
    let want_loss = g["lora_loss"].as_f64().unwrap();
    let got = loss.to_scalar::<f32>().unwrap() as f64;
    assert!(
        ((got - want_loss) / want_loss).abs() <= 1e-5,
        "loss {got} vs {want_loss}"
    );
    let grads = loss.backward().unwrap();
    let want = tensors(&dir.join("lora_grads.safetensors"));
    assert_eq!(params.len(), want.len());
    for (name, var) in &params {
        let got = grads
            .get(var)
            .unwrap_or_else(|| panic!("{name}: no gradient"));
        let err = rel_l2(got, &want[name]);
        assert!(err <= 1e-4, "{name}: gradient relative L2 error {err}");
    }
}

/// The model's tensors are the checkpoint's, under the same names (the sinks, the bare router and
/// the fused experts as they were read): a saved model is the checkpoint.
#[test]
fn saving_gives_back_the_checkpoints_tensors() {
    let saved = merged_tensors(&load()).unwrap();
    let want = tensors(&case_dir().join("model/model.safetensors"));
    let mut names: Vec<&String> = saved.keys().collect();
    let mut want_names: Vec<&String> = want.keys().collect();
    names.sort();
    want_names.sort();
    assert_eq!(names, want_names);
    for (name, t) in &saved {
        assert_eq!(max_abs_diff(t, &want[name]), 0.0, "{name}");
    }
}

/// transformers' MXFP4 dequantization (`convert_moe_packed_tensors`, float32) of random blocks
/// and scales (powers of two 2^-22 to 2^29), value for value.
#[test]
fn mxfp4_dequantizes_as_transformers() {
    let t = tensors(&fixtures().join("gpt_oss_mxfp4/synthetic.safetensors"));
    let got = ferrotune_models::mxfp4::dequantize(&t["blocks"], &t["scales"], "w").unwrap();
    assert_eq!(got.dims(), [2, 64, 3]);
    assert_eq!(max_abs_diff(&got, &t["want"]), 0.0);
}

/// A checkpoint as OpenAI ships gpt-oss (experts as MXFP4 `*_blocks` / `*_scales`,
/// `quantization_config` mxfp4) reads with its experts dequantized: transformers' logits (it
/// dequantizes them on the CPU too); saved, it is a plain checkpoint (fused experts, no
/// `quantization_config`) that loads back to the same logits.
#[test]
fn an_mxfp4_checkpoint_reads_dequantized_and_saves_plain() {
    let dir = fixtures().join("gpt_oss_mxfp4");
    let g = read_json(&dir.join("golden.json"));
    let model = load_model(&dir.join("model"), DType::F32, &Device::Cpu)
        .unwrap()
        .0;
    let logits = forward(&model, &ids(&g["input_ids"]));
    let err = max_abs_diff(&logits, &tensors(&dir.join("golden.safetensors"))["logits"]);
    assert!(err <= 1e-4, "logits max abs error {err}");
    assert!(model.config.raw.get("quantization_config").is_none());
    let saved = merged_tensors(&model).unwrap();
    assert!(saved.contains_key("model.layers.0.mlp.experts.gate_up_proj"));
    assert!(!saved
        .keys()
        .any(|k| k.ends_with("_blocks") || k.ends_with("_scales")));
    let out = std::env::temp_dir().join(format!("ferrotune-gpt-oss-mxfp4-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    save_hf_checkpoint(&out, &model.config, None, &saved, DType::F32, u64::MAX).unwrap();
    let config = read_json(&out.join("config.json"));
    assert!(config.get("quantization_config").is_none(), "{config}");
    let back = load_model(&out, DType::F32, &Device::Cpu).unwrap().0;
    assert_eq!(
        max_abs_diff(&forward(&back, &ids(&g["input_ids"])), &logits),
        0.0
    );
    let _ = std::fs::remove_dir_all(&out);
}

/// LoRA on module names reaches q/k/v/o_proj only: the router and the experts are no linear
/// modules (as in PEFT); a PEFT adapter on gpt-oss's parameters (`target_parameters`) without
/// its tensors is refused naming what is missing.
#[test]
fn adapters_reach_the_attention_only() {
    let mut model = load();
    let names = [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "router",
        "gate_up_proj",
        "down_proj",
    ];
    let config = LoraConfig::new(
        2,
        4.0,
        TargetModules::Names(names.iter().map(|s| s.to_string()).collect()),
    );
    add_adapter(&mut model, &config, 1).unwrap();
    let adapted: Vec<String> = model
        .linears()
        .into_iter()
        .filter(|(_, l)| l.adapter.is_some())
        .map(|(n, _)| n)
        .collect();
    assert_eq!(adapted.len(), 12, "{adapted:?}");
    assert!(
        adapted.iter().all(|n| n.contains(".self_attn.")),
        "{adapted:?}"
    );
    let mut config = LoraConfig::new(2, 4.0, TargetModules::Names(vec!["q_proj".into()]));
    config.target_parameters = vec!["mlp.experts.gate_up_proj".into()];
    let err = attach_adapter(&mut load(), &config, HashMap::new(), "adapter")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("target_parameters") && err.contains("gpt-oss"),
        "{err}"
    );
}

/// gpt-oss-20b's config.json as OpenAI ships it (4.x keys: `rope_scaling` with `truncate`,
/// top-level `rope_theta`; `quantization_config` mxfp4; keys transformers ignores such as
/// `experts_per_token`): 24 alternating layers, window 128, head_dim 64 (not hidden / heads),
/// its YaRN, 32 experts top-4 with the clamp at 7, router_aux_loss_coef 0.9; the MXFP4 note
/// dropped (its experts are dequantized on reading).
#[test]
fn gpt_oss_20bs_config_reads_as_transformers_reads_it() {
    let types: Vec<&str> = (0..24)
        .map(|i| {
            if i % 2 == 0 {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    let c = ModelConfig::from_hf_json(&json!({
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": true,
        "attention_dropout": 0.0,
        "eos_token_id": 200002,
        "experts_per_token": 4,
        "head_dim": 64,
        "hidden_act": "silu",
        "hidden_size": 2880,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 2880,
        "layer_types": types,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": 64,
        "num_experts_per_tok": 4,
        "num_hidden_layers": 24,
        "num_key_value_heads": 8,
        "num_local_experts": 32,
        "output_router_logits": false,
        "pad_token_id": 199999,
        "quantization_config": {
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head"
            ],
            "quant_method": "mxfp4"
        },
        "rms_norm_eps": 1e-05,
        "rope_scaling": {
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "rope_type": "yarn",
            "truncate": false
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": 128,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": false,
        "transformers_version": "4.55.0.dev0",
        "use_cache": true,
        "vocab_size": 201088
    }))
    .unwrap();
    assert_eq!(
        (c.head_dim, c.num_key_value_heads, c.hidden_size),
        (64, 8, 2880)
    );
    let windows: Vec<Option<usize>> = (0..24).map(|i| (i % 2 == 0).then_some(128)).collect();
    assert_eq!(c.layer_sliding_windows, windows);
    assert_eq!(c.rope.theta, 150_000.0);
    assert!(matches!(
        c.rope.scaling,
        ferrotune_models::config::RopeScaling::Yarn {
            factor: 32.0,
            original_max_position_embeddings: 4096,
            truncate: false,
            attention_factor: None,
            ..
        }
    ));
    assert_eq!(c.position_limit(), Some(131_072));
    let m = c.gpt_oss_moe.as_ref().unwrap();
    assert_eq!(
        (m.num_experts, m.top_k, m.alpha, m.limit),
        (32, 4, 1.702, 7.0)
    );
    assert_eq!(
        (c.eos_token_ids.clone(), c.pad_token_id),
        (vec![200002], Some(199999))
    );
    assert!(c.raw.get("quantization_config").is_none());
    assert_eq!(c.router_aux_loss_coef(), None);
    assert_eq!(c.raw["router_aux_loss_coef"], 0.9);
}

/// PEFT's `target_parameters` on gpt-oss's fused experts (tests/fixtures/target_parameters/gpt_oss:
/// `mlp.experts.gate_up_proj` and `down_proj`, nested, rank 3 on down_proj by `rank_pattern`,
/// beside q/o_proj; scripts/make_target_parameters_fixtures.py): held in PEFT's fused form
/// (`lora_A` `[r · experts, in]`, `lora_B` `[out, r · experts]`, gpt-oss's experts being inputs
/// first), PEFT's logits (inference and training) and loss, every adapter gradient to 1e-4
/// relative L2, merged weights equal to PEFT's merge (biases untouched) and the merged model's
/// logits; saved, the folder holds PEFT's tensor names and loads back to the same logits.
#[test]
fn expert_target_parameters_match_peft() {
    let dir = fixtures().join("target_parameters/gpt_oss");
    let g = read_json(&dir.join("golden.json"));
    let golden = tensors(&dir.join("golden.safetensors"));
    let mut model = load();
    let config = load_adapter(&mut model, &dir.join("adapter")).unwrap();
    assert_eq!(config.target_parameters.len(), 2);
    for layer in &model.layers {
        let FeedForward::GptOss(moe) = &layer.mlp else {
            panic!("a gpt-oss block");
        };
        let (gate_up, down) = (
            moe.gate_up_lora.as_ref().unwrap(),
            moe.down_lora.as_ref().unwrap(),
        );
        assert_eq!((gate_up.rank, down.rank), (2, 3));
        assert_eq!(gate_up.a.dims(), [8, 32]);
        assert_eq!(gate_up.b.dims(), [48, 8]);
        assert_eq!(down.a.dims(), [12, 24]);
        assert_eq!(down.b.dims(), [32, 12]);
        assert_eq!((gate_up.scale, down.scale), (3.0, 2.0));
    }
    let ids = ids(&g["input_ids"]);
    let assert_logits = |model: &CausalLm, what: &str| {
        let err = max_abs_diff(&forward(model, &ids), &golden["lora_logits"]);
        assert!(err <= 1e-4, "{what}: logits max abs error {err}");
    };
    assert_logits(&model, "inference");

    let params = trainable_parameters(&mut model).unwrap();
    set_training(&mut model, true);
    let logits = forward(&model, &ids);
    let loss = causal_lm_loss(&logits, &g["labels"]);
    let want_loss = g["lora_loss"].as_f64().unwrap();
    let got = loss.to_scalar::<f32>().unwrap() as f64;
    assert!(
        ((got - want_loss) / want_loss).abs() <= 1e-5,
        "loss {got} vs {want_loss}"
    );
    let grads = loss.backward().unwrap();
    let want = tensors(&dir.join("lora_grads.safetensors"));
    let mut names: Vec<&String> = params.iter().map(|(n, _)| n).collect();
    let mut want_names: Vec<&String> = want.keys().collect();
    names.sort();
    want_names.sort();
    assert_eq!(names, want_names);
    for (name, var) in &params {
        let got = grads
            .get(var)
            .unwrap_or_else(|| panic!("{name}: no gradient"));
        let err = rel_l2(got, &want[name]);
        assert!(err <= 1e-4, "{name}: gradient relative L2 error {err}");
    }
    set_training(&mut model, false);

    // Saved: PEFT's names and config; read back, the same logits.
    let out = std::env::temp_dir().join(format!(
        "ferrotune-gpt-oss-target-parameters-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&out);
    save_adapter(&model, &config, &out).unwrap();
    let saved = tensors(&out.join("adapter_model.safetensors"));
    let peft_file = tensors(&dir.join("adapter/adapter_model.safetensors"));
    let mut saved_names: Vec<&String> = saved.keys().collect();
    let mut peft_names: Vec<&String> = peft_file.keys().collect();
    saved_names.sort();
    peft_names.sort();
    assert_eq!(saved_names, peft_names);
    for (k, t) in &saved {
        assert_eq!(max_abs_diff(t, &peft_file[k]), 0.0, "{k}");
    }
    let saved_config = read_json(&out.join("adapter_config.json"));
    assert_eq!(
        saved_config["target_parameters"],
        json!(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    );
    let mut back = load();
    load_adapter(&mut back, &out).unwrap();
    assert_logits(&back, "saved and read back");
    let _ = std::fs::remove_dir_all(&out);

    // Merged: PEFT's merged state dict (the experts' biases as they were).
    let merged = merged_tensors(&model).unwrap();
    let want = tensors(&dir.join("merged.safetensors"));
    let mut merged_names: Vec<&String> = merged.keys().collect();
    let mut want_names: Vec<&String> = want.keys().collect();
    merged_names.sort();
    want_names.sort();
    assert_eq!(merged_names, want_names);
    let base = tensors(&case_dir().join("model/model.safetensors"));
    for (name, t) in &merged {
        let err = max_abs_diff(t, &want[name]);
        assert!(err <= 1e-5, "merged {name}: max abs error {err}");
        if name.ends_with("_bias") {
            assert_eq!(max_abs_diff(t, &base[name]), 0.0, "{name}");
        }
    }
    assert!(
        max_abs_diff(
            &merged["model.layers.0.mlp.experts.gate_up_proj"],
            &base["model.layers.0.mlp.experts.gate_up_proj"]
        ) > 1e-3
    );
    merge_and_unload(&mut model).unwrap();
    assert_logits(&model, "merged");
}

/// Fresh adapters for training on gpt-oss's experts (`target_parameters`): PEFT's shapes, B
/// zeros (the model starts as the base), trainable under PEFT's parameter names, and refused
/// for a name that is no expert parameter.
#[test]
fn fresh_expert_adapters_start_as_the_base() {
    let g = read_json(&case_dir().join("golden.json"));
    let ids = ids(&g["input_ids"]);
    let base = forward(&load(), &ids);
    let mut model = load();
    let mut config = LoraConfig::new(2, 4.0, TargetModules::Names(vec![]));
    config.target_parameters = vec!["experts.gate_up_proj".into()];
    assert_eq!(add_adapter(&mut model, &config, 3).unwrap(), 3);
    assert_eq!(max_abs_diff(&forward(&model, &ids), &base), 0.0);
    let params = trainable_parameters(&mut model).unwrap();
    let names: Vec<&str> = params.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), 6, "{names:?}");
    assert!(names.contains(&"base_model.model.model.layers.2.mlp.experts.lora_A.weight"));
    assert_eq!(params[0].1.as_tensor().dims(), [8, 32]);
    assert_eq!(params[1].1.as_tensor().dims(), [48, 8]);
    config.target_parameters = vec!["mlp.router.weight".into()];
    let err = add_adapter(&mut load(), &config, 3)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("mlp.router.weight") && err.contains("no expert parameter"),
        "{err}"
    );
}

/// ggml's MXFP4 blocks (GGML type 39: an E8M0 scale byte, then 16 bytes of nibbles, values
/// `kvalues_mxfp4[q] · 2^(scale − 128)`; the subnormal halves of scale bytes 0 and 1 among them)
/// dequantize to gguf-py's `gguf.quants.dequantize` of them, value for value
/// (tests/fixtures/gguf/mxfp4_reference.safetensors, scripts/make_gguf_fixtures.py).
#[test]
fn mxfp4_blocks_dequantize_as_gguf_py() {
    let t = tensors(&fixtures().join("gguf/mxfp4_reference.safetensors"));
    let raw: Vec<u8> = t["raw"].to_vec1().unwrap();
    let want: Vec<f32> = t["expected"].to_vec1().unwrap();
    let got = ferrotune_models::gguf::dequantize_mxfp4(&raw);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.to_bits(), w.to_bits(), "value {i}: {g} vs {w}");
    }
    assert!(want
        .iter()
        .any(|&w| w != 0.0 && w.abs() < f32::MIN_POSITIVE));
}

/// gpt-oss with OpenAI's MXFP4 experts (tests/fixtures/gpt_oss_mxfp4, llama.cpp's SwiGLU limit and
/// rounded YaRN) through llama.cpp's own convert_hf_to_gguf.py, which writes the experts as MXFP4
/// (tests/fixtures/gguf/gpt_oss_mxfp4_tiny.gguf): loaded, it gives transformers' logits of that
/// checkpoint (which dequantizes the experts too).
#[test]
fn gpt_oss_mxfp4_gguf_gives_transformers_logits() {
    let path = fixtures().join("gguf/gpt_oss_mxfp4_tiny.gguf");
    let model = load_model(&path, DType::F32, &Device::Cpu).unwrap().0;
    assert_eq!(model.config.model_type, "gpt_oss");
    let reference = tensors(&fixtures().join("gguf/gpt_oss_mxfp4_tiny_reference.safetensors"));
    let ids = reference["input_ids"].to_dtype(DType::U32).unwrap();
    let err = max_abs_diff(&forward(&model, &ids), &reference["logits"]);
    assert!(err <= 1e-4, "logits max abs error {err}");
    // The experts are no plain copy of a float file: MXFP4's values (a power of two times
    // 0, ±0.5, ..., ±6) in every expert.
    let FeedForward::GptOss(moe) = &model.layers[0].mlp else {
        panic!("a gpt-oss block");
    };
    let values: Vec<f32> = moe
        .down_proj
        .dense()
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert!(values.iter().all(|v| {
        let m = v.abs() / 2f32.powi(v.abs().log2().floor() as i32);
        *v == 0.0 || [1.0, 1.5].contains(&m)
    }));
}
