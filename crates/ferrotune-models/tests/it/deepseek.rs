//! DeepSeek-V3 and V2 (`deepseek_v3`, `deepseek_v2`): multi-head latent attention and
//! group-limited routing read from the config and matching transformers (golden_models checks
//! every fixture's logits, KV cache and bf16 too), the cache holding latents, training gradients
//! through MLA and the router, and the multi-token-prediction layers skipped on load.

use crate::common;

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use ferrotune_models::model::{latent_cache_ratio, FeedForward};
use ferrotune_models::{load_model, AttentionLayout, CausalLm, KvCache};

use common::{fixtures, max_abs_diff, rel_l2};

fn case_dir(case: &str) -> PathBuf {
    fixtures().join("models").join(case)
}

fn load(case: &str) -> CausalLm {
    load_model(&case_dir(case).join("model"), DType::F32, &Device::Cpu)
        .unwrap()
        .0
}

fn golden(case: &str) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(case_dir(case).join("golden.json")).unwrap())
        .unwrap()
}

fn golden_ids(case: &str) -> Tensor {
    let rows: Vec<Vec<u32>> = serde_json::from_value(golden(case)["input_ids"].clone()).unwrap();
    let (b, t) = (rows.len(), rows[0].len());
    Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap()
}

fn tensors(path: PathBuf) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

/// The configs read as transformers defines them: MLA's shapes, YaRN's mscale² in the softmax
/// scale, the routing rules and the dense first layers.
#[test]
fn configs_read_mla_and_routing() {
    let v3 = load("deepseek_v3");
    let c = &v3.config;
    let m = c.mla.as_ref().unwrap();
    assert_eq!(
        (
            m.q_lora_rank,
            m.kv_lora_rank,
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim
        ),
        (Some(16), 12, 8, 4, 10)
    );
    assert!(m.rope_interleave);
    assert_eq!(c.head_dim, 4);
    // transformers: 12^-0.5 · (0.1 · 0.8 · ln 4 + 1)².
    let mscale = 0.1 * 0.8 * 4f64.ln() + 1.0;
    assert!((m.softmax_scale - 12f64.powf(-0.5) * mscale * mscale).abs() < 1e-12);
    let r = c.grouped_routing.as_ref().unwrap();
    assert_eq!((r.n_group, r.topk_group, r.group_sum_top2), (4, 2, true));
    assert!(r.correction_bias && r.norm_topk_prob && r.routed_scaling_factor == 2.5);
    assert!(matches!(v3.layers[0].mlp, FeedForward::Dense(_)));
    assert!(matches!(v3.layers[1].mlp, FeedForward::Sparse(_)));
    // 4 heads · (12 + 10) per token and layer against a latent of 12 + 4.
    assert_eq!(latent_cache_ratio(c), Some(88.0 / 16.0));
    let names: Vec<String> = v3.linears().into_iter().map(|(n, _)| n).collect();
    for n in [
        "model.layers.1.self_attn.q_a_proj",
        "model.layers.1.self_attn.q_b_proj",
        "model.layers.1.self_attn.kv_a_proj_with_mqa",
        "model.layers.1.self_attn.kv_b_proj",
        "model.layers.1.self_attn.o_proj",
        "model.layers.1.mlp.shared_experts.up_proj",
        "model.layers.2.mlp.experts.7.down_proj",
    ] {
        assert!(names.iter().any(|x| x == n), "{n} not in {names:?}");
    }

    let v2 = load("deepseek_v2");
    let m = v2.config.mla.as_ref().unwrap();
    assert_eq!((m.q_lora_rank, m.v_head_dim), (None, 20));
    assert!(m.rope_interleave);
    let r = v2.config.grouped_routing.as_ref().unwrap();
    assert_eq!((r.n_group, r.topk_group, r.group_sum_top2), (2, 1, false));
    assert!(!r.correction_bias && !r.norm_topk_prob && r.routed_scaling_factor == 1.5);
    assert_eq!(v2.config.mtp_layers, 0);
}

/// Prefill then decoding one token at a time through the latent cache gives the full forward's
/// logits, and the cache holds `[b, 1, positions, kv_lora_rank]` latents and
/// `[b, 1, positions, qk_rope_head_dim]` rotary keys.
#[test]
fn the_latent_cache_decodes_as_the_full_forward() {
    for (case, rank, rot) in [("deepseek_v3", 12, 4), ("deepseek_v2", 16, 8)] {
        let model = load(case);
        let ids = golden_ids(case);
        let (b, t) = ids.dims2().unwrap();
        let full = model
            .forward(&ids, &AttentionLayout::causal(b, t, 0), None)
            .unwrap();
        let want = &tensors(case_dir(case).join("golden.safetensors"))["logits"];
        let err = max_abs_diff(&full, want);
        assert!(err <= 1e-4, "{case}: logits max abs error {err}");
        let mut cache = KvCache::new(model.layers.len());
        let split = 5;
        let mut parts = vec![model
            .forward(
                &ids.narrow(1, 0, split).unwrap(),
                &AttentionLayout::causal(b, split, 0),
                Some(&mut cache),
            )
            .unwrap()];
        for i in split..t {
            let step = ids.narrow(1, i, 1).unwrap();
            let layout = AttentionLayout::causal(b, 1, i);
            parts.push(model.forward(&step, &layout, Some(&mut cache)).unwrap());
        }
        let err = max_abs_diff(&Tensor::cat(&parts, 1).unwrap(), &full);
        assert!(err <= 1e-4, "{case}: decoding max abs error {err}");
        assert_eq!(cache.len(), t);
        let layers = cache.layer_shapes();
        assert!(
            layers
                .iter()
                .all(|s| *s == Some(([b, 1, t, rank], [b, 1, t, rot]))),
            "{case}: {layers:?}"
        );
    }
}

/// Full fine-tuning gradients of the golden loss equal transformers' (`grads.safetensors`) for
/// every parameter: MLA's projections and norms, the router (through the sigmoid or softmax
/// scores), the experts and the shared experts.
#[test]
fn full_training_gradients_match_transformers() {
    for case in ["deepseek_v3", "deepseek_v2"] {
        let mut model = load(case);
        let params = model.make_all_trainable().unwrap();
        let ids = golden_ids(case);
        let (b, t) = ids.dims2().unwrap();
        let logits = model
            .forward(&ids, &AttentionLayout::causal(b, t, 0), None)
            .unwrap();
        let l = common::causal_lm_loss(&logits, &golden(case)["labels"]);
        let want_loss = golden(case)["loss"].as_f64().unwrap();
        let got = l.to_scalar::<f32>().unwrap() as f64;
        assert!(
            (got - want_loss).abs() <= 1e-4,
            "{case}: loss {got} vs {want_loss}"
        );
        let grads = l.backward().unwrap();
        let want = tensors(case_dir(case).join("grads.safetensors"));
        let mut names: Vec<&String> = params.iter().map(|(n, _)| n).collect();
        names.sort();
        let mut want_names: Vec<&String> = want.keys().collect();
        want_names.sort();
        assert_eq!(names, want_names, "{case}: parameter names");
        for (name, var) in &params {
            let g = grads
                .get(var)
                .unwrap_or_else(|| panic!("{name}: no gradient"));
            let err = rel_l2(g, &want[name]);
            assert!(
                err <= 1e-4,
                "{case}: {name}: gradient relative L2 error {err}"
            );
        }
    }
}

/// A DeepSeek-V3 checkpoint's multi-token-prediction layer (`model.layers.{num_hidden_layers}.*`)
/// is left out on load: the model is the decoder's layers, its logits unchanged.
#[test]
fn multi_token_prediction_layers_are_skipped() {
    let src = case_dir("deepseek_v3").join("model");
    let dir = std::env::temp_dir().join(format!("ferrotune-deepseek-mtp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, dir.join(f.file_name().unwrap())).unwrap();
    }
    let mut stored = tensors(src.join("model.safetensors"));
    let layer2: Vec<(String, Tensor)> = stored
        .iter()
        .filter_map(|(k, v)| {
            let rest = k.strip_prefix("model.layers.2.")?;
            Some((format!("model.layers.3.{rest}"), v.clone()))
        })
        .collect();
    stored.extend(layer2);
    let h = 32;
    stored.insert(
        "model.layers.3.eh_proj.weight".into(),
        Tensor::zeros((h, 2 * h), DType::F32, &Device::Cpu).unwrap(),
    );
    candle_core::safetensors::save(&stored, dir.join("model.safetensors")).unwrap();
    let model = load_model(&dir, DType::F32, &Device::Cpu).unwrap().0;
    assert_eq!(model.layers.len(), 3);
    let ids = golden_ids("deepseek_v3");
    let (b, t) = ids.dims2().unwrap();
    let logits = model
        .forward(&ids, &AttentionLayout::causal(b, t, 0), None)
        .unwrap();
    let want = &tensors(case_dir("deepseek_v3").join("golden.safetensors"))["logits"];
    assert!(max_abs_diff(&logits, want) <= 1e-4);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A DeepSeek model saved as ferrotune saves merged or fully fine-tuned models (its tensors,
/// `e_score_correction_bias` buffers included) loads back to the same logits.
#[test]
fn saved_models_load_back_the_same() {
    for case in ["deepseek_v3", "deepseek_v2"] {
        let model = load(case);
        let tensors = ferrotune_models::peft::merged_tensors(&model).unwrap();
        if case == "deepseek_v3" {
            assert!(tensors.contains_key("model.layers.1.mlp.gate.e_score_correction_bias"));
        }
        let stored = tensors_of(case);
        let mut names: Vec<&String> = tensors.keys().collect();
        names.sort();
        let mut want: Vec<&String> = stored.keys().collect();
        want.sort();
        assert_eq!(names, want, "{case}: saved tensor names");
        let dir =
            std::env::temp_dir().join(format!("ferrotune-{case}-save-{}", std::process::id()));
        ferrotune_models::save_hf_checkpoint(
            &dir,
            &model.config,
            None,
            &tensors,
            DType::F32,
            u64::MAX,
        )
        .unwrap();
        let again = load_model(&dir, DType::F32, &Device::Cpu).unwrap().0;
        let ids = golden_ids(case);
        let (b, t) = ids.dims2().unwrap();
        let layout = AttentionLayout::causal(b, t, 0);
        let want = model.forward(&ids, &layout, None).unwrap();
        let got = again.forward(&ids, &layout, None).unwrap();
        assert_eq!(max_abs_diff(&got, &want), 0.0, "{case}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

fn tensors_of(case: &str) -> HashMap<String, Tensor> {
    tensors(case_dir(case).join("model").join("model.safetensors"))
}

/// The released configs read as transformers 5.24 reads them: DeepSeek-V3's (its FP8
/// `quantization_config` read, another quantization refused naming the key) and DeepSeek-V2-Lite's, 4.x `rope_scaling`
/// with YaRN's `mscale_all_dim` (softmax scales from transformers' `yarn_apply_mscale`).
#[test]
fn released_configs_read_as_transformers() {
    use ferrotune_models::ModelConfig;
    let yarn = |m: f64| {
        serde_json::json!({"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": m,
                           "mscale_all_dim": m, "original_max_position_embeddings": 4096,
                           "type": "yarn"})
    };
    let mut v3 = serde_json::json!({
        "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": false,
        "bos_token_id": 0, "eos_token_id": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
        "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
        "max_position_embeddings": 163840, "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8,
        "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": true,
        "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
        "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": yarn(1.0), "rope_theta": 10000, "routed_scaling_factor": 2.5,
        "scoring_func": "sigmoid", "tie_word_embeddings": false, "topk_group": 4,
        "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "v_head_dim": 128,
        "vocab_size": 129280
    });
    let c = ModelConfig::from_hf_json(&v3).unwrap();
    let m = c.mla.as_ref().unwrap();
    assert!(
        (m.softmax_scale - 0.1352337788608801).abs() < 1e-12,
        "{}",
        m.softmax_scale
    );
    assert!(m.rope_interleave && m.q_lora_rank == Some(1536));
    assert_eq!((c.head_dim, c.mtp_layers), (64, 1));
    let moe = c.moe.as_ref().unwrap();
    assert_eq!(moe.sparse_layers.iter().position(|&s| s), Some(3));
    assert_eq!(moe.shared_expert_intermediate_size, Some(2048));
    assert_eq!(
        ferrotune_models::model::latent_cache_ratio(&c).map(f64::round),
        Some(71.0)
    );
    // The released FP8 blocks read (dequantized on loading); another quantization is refused.
    v3["quantization_config"] = serde_json::json!({"activation_scheme": "dynamic",
        "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]});
    let fp8 = ModelConfig::from_hf_json(&v3).unwrap();
    assert_eq!(fp8.fp8.and_then(|f| f.block), Some([128, 128]));
    assert!(fp8.raw.get("quantization_config").is_none());
    v3["quantization_config"] = serde_json::json!({"quant_method": "bitsandbytes"});
    let err = ModelConfig::from_hf_json(&v3).unwrap_err();
    assert!(err.contains("quantization_config"), "{err}");

    let v2_lite = serde_json::json!({
        "model_type": "deepseek_v2", "hidden_size": 2048, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
        "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": null,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
        "topk_method": "greedy", "n_group": 1, "topk_group": 1, "num_experts_per_tok": 6,
        "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": false,
        "scoring_func": "softmax", "hidden_act": "silu", "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-06, "pad_token_id": null, "bos_token_id": 100000,
        "eos_token_id": 100001, "tie_word_embeddings": false, "rope_theta": 10000,
        "rope_scaling": yarn(0.707), "attention_bias": false, "vocab_size": 102400
    });
    let c = ModelConfig::from_hf_json(&v2_lite).unwrap();
    let m = c.mla.as_ref().unwrap();
    assert!(
        (m.softmax_scale - 0.1147213867929261).abs() < 1e-12,
        "{}",
        m.softmax_scale
    );
    assert_eq!(m.q_lora_rank, None);
    let r = c.grouped_routing.as_ref().unwrap();
    assert_eq!((r.n_group, r.topk_group), (1, 1));
    assert!(!r.norm_topk_prob);
    assert_eq!(c.mtp_layers, 0);
    assert_eq!(
        ferrotune_models::model::latent_cache_ratio(&c).map(|r| (r * 10.0).round()),
        Some(89.0)
    );
}

/// Samples packed into one row attend only within themselves, their rotary positions counted from
/// their own start: the same logits as each alone (and so the same loss).
#[test]
fn packed_samples_equal_separate_ones() {
    for case in ["deepseek_v3", "deepseek_v2"] {
        let model = load(case);
        let a: Vec<u32> = (0..11).map(|i| 7 + 13 * i).collect();
        let b: Vec<u32> = (0..9).map(|i| 300 - 17 * i).collect();
        let run = |s: &[u32], layout: &AttentionLayout| {
            let ids = Tensor::new(s, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
            model.forward(&ids, layout, None).unwrap()
        };
        let alone = |s: &[u32]| run(s, &AttentionLayout::causal(1, s.len(), 0));
        let packed: Vec<u32> = a.iter().chain(&b).copied().collect();
        let n = packed.len();
        let layout = AttentionLayout {
            positions: vec![(0..a.len() as u32).chain(0..b.len() as u32).collect()],
            key_valid: vec![vec![true; n]],
            segments: Some(vec![std::iter::repeat_n(0, a.len())
                .chain(std::iter::repeat_n(1, b.len()))
                .collect()]),
        };
        let got = run(&packed, &layout);
        let want = Tensor::cat(&[alone(&a), alone(&b)], 1).unwrap();
        // Rounding only (GEMMs over other row counts): a leak across samples moves logits by
        // orders of magnitude more.
        let err = max_abs_diff(&got, &want);
        assert!(err <= 1e-4, "{case}: packed differs by {err}");
    }
}
