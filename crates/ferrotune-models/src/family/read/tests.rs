//! Reading `config.json` on each family's configs.
use super::*;
use crate::config::RopeScaling;
use serde_json::json;

fn base() -> Value {
    json!({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 2, "num_attention_heads": 2})
}

/// [`base`] as a config of `model_type`.
fn base_of(model_type: &str) -> Value {
    let mut c = base();
    c["model_type"] = json!(model_type);
    c
}

/// Llama 3.2 Vision's text config takes `MllamaTextConfig`'s defaults for what it leaves out
/// (the Hub's configs spell most of them out), cross-attention layers included: null or absent
/// means 3, 8, ..., 38, and numbers past the last layer name none.
#[test]
fn llama_3_2_vision_takes_mllama_text_defaults() {
    let config =
        ModelConfig::from_hf_json(&json!({"model_type": "mllama", "text_config": {}})).unwrap();
    assert_eq!(config.model_type, "llama");
    let mllama = config.mllama.as_ref().unwrap();
    assert_eq!(
        mllama.cross_attention_layers,
        [3, 8, 13, 18, 23, 28, 33, 38]
    );
    assert_eq!(mllama.text_prefix, "model.language_model.");
    assert_eq!(config.num_hidden_layers, 32);
    assert_eq!((config.hidden_size, config.vocab_size), (4096, 128_256));
    assert_eq!(
        (config.num_attention_heads, config.num_key_value_heads),
        (32, 8)
    );
    assert_eq!(config.rms_norm_eps, 1e-5);
    assert_eq!(config.rope.theta, 500_000.0);
    assert_eq!(config.bos_token_id, Some(128_000));
    assert_eq!(config.pad_token_id, Some(128_004));

    let small = json!({"model_type": "mllama_text_model", "num_hidden_layers": 10,
                       "cross_attention_layers": null, "hidden_size": 64,
                       "num_attention_heads": 4, "num_key_value_heads": 2,
                       "intermediate_size": 128, "vocab_size": 100,
                       "rope_theta": 10000.0});
    let config = ModelConfig::from_hf_json(&small).unwrap();
    let mllama = config.mllama.as_ref().unwrap();
    assert_eq!(mllama.cross_attention_layers, [3, 8]);
    assert_eq!(mllama.text_prefix, "model.");
    assert_eq!(config.num_hidden_layers, 8);
    assert_eq!(config.rope.theta, 10_000.0);
    assert_eq!(config.raw["architectures"][0], "LlamaForCausalLM");

    let all = json!({"model_type": "mllama_text_model", "num_hidden_layers": 2,
                     "cross_attention_layers": [0, 1]});
    let err = ModelConfig::from_hf_json(&all).unwrap_err();
    assert!(err.contains("no text layer"), "{err}");
}

#[test]
fn v4_and_v5_rope_styles_agree() {
    let mut v4 = base();
    v4["rope_theta"] = json!(500000.0);
    v4["rope_scaling"] = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    let mut v5 = base();
    v5["rope_parameters"] = json!({"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
        "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    let a = ModelConfig::from_hf_json(&v4).unwrap();
    let b = ModelConfig::from_hf_json(&v5).unwrap();
    assert_eq!(a.rope, b.rope);
    assert_eq!(a.rope.theta, 500000.0);
    assert!(matches!(
        a.rope.scaling,
        RopeScaling::Llama3 {
            original_max_position_embeddings: 64,
            ..
        }
    ));
}

#[test]
fn training_caveats_name_what_training_leaves_out() {
    let mut c = base();
    assert!(ModelConfig::from_hf_json(&c)
        .unwrap()
        .training_caveats()
        .is_empty());
    c["model_type"] = json!("mixtral");
    c["num_local_experts"] = json!(4);
    c["num_experts_per_tok"] = json!(2);
    c["output_router_logits"] = json!(true);
    c["router_aux_loss_coef"] = json!(0.02);
    c["router_jitter_noise"] = json!(0.0);
    // The auxiliary loss is applied (not a caveat); its weight is read.
    let config = ModelConfig::from_hf_json(&c).unwrap();
    assert!(config.training_caveats().is_empty());
    assert_eq!(config.router_aux_loss_coef(), Some(0.02));
    c["output_router_logits"] = json!(false);
    assert_eq!(
        ModelConfig::from_hf_json(&c)
            .unwrap()
            .router_aux_loss_coef(),
        None
    );
    c["router_jitter_noise"] = json!(0.1);
    let caveats = ModelConfig::from_hf_json(&c).unwrap().training_caveats();
    assert_eq!(caveats.len(), 1, "{caveats:?}");
    assert!(
        caveats[0].contains("router_jitter_noise 0.1"),
        "{caveats:?}"
    );
    let mut phi = base_of("phi");
    phi["resid_pdrop"] = json!(0.1);
    phi["embd_pdrop"] = json!(0.0);
    phi["attention_dropout"] = json!(0.0);
    let caveats = ModelConfig::from_hf_json(&phi).unwrap().training_caveats();
    assert_eq!(
        caveats,
        vec!["resid_pdrop 0.1 (dropout) is not applied".to_string()]
    );
    c["attention_dropout"] = json!(0.1);
    let caveats = ModelConfig::from_hf_json(&c).unwrap().training_caveats();
    assert!(
        caveats.iter().any(|w| w.contains("attention_dropout 0.1")),
        "{caveats:?}"
    );
}

#[test]
fn unsupported_model_type_lists_supported_ones() {
    let c = base_of("gpt_neox");
    let err = ModelConfig::from_hf_json(&c).unwrap_err();
    assert!(
        err.contains("gpt_neox") && err.contains("qwen3") && err.contains("phi3"),
        "{err}"
    );
}

#[test]
fn family_switches_and_eos_lists() {
    let mut c = base_of("gemma");
    c["eos_token_id"] = json!([1, 107]);
    let g = ModelConfig::from_hf_json(&c).unwrap();
    assert!(g.norm_weight_offset_one && g.scale_embeddings && g.tie_word_embeddings);
    assert_eq!(g.activation, Activation::GeluTanh);
    assert_eq!(g.eos_token_ids, vec![1, 107]);
    c["model_type"] = json!("qwen2");
    c["sliding_window"] = json!(4);
    c["use_sliding_window"] = json!(false);
    assert_eq!(
        ModelConfig::from_hf_json(&c).unwrap().layer_sliding_windows,
        vec![None, None]
    );
    c["model_type"] = json!("mistral");
    assert_eq!(
        ModelConfig::from_hf_json(&c).unwrap().layer_sliding_windows,
        vec![Some(4), Some(4)]
    );
}

#[test]
fn gemma2_defaults_follow_transformers_and_null_disables() {
    let mut c = base_of("gemma2");
    c["num_key_value_heads"] = json!(1);
    c["num_hidden_layers"] = json!(4);
    let g = ModelConfig::from_hf_json(&c).unwrap();
    // Absent keys: transformers' Gemma2Config defaults.
    assert_eq!(g.attn_logit_softcapping, Some(50.0));
    assert_eq!(g.final_logit_softcapping, Some(30.0));
    assert_eq!(g.query_pre_attn_scalar, Some(256.0));
    assert!(g.sandwich_norms && g.norm_weight_offset_one && g.tie_word_embeddings);
    assert!(!g.qk_norm && g.local_rope.is_none());
    // Even layers slide (window 4096), odd ones attend fully.
    assert_eq!(
        g.layer_sliding_windows,
        vec![Some(4096), None, Some(4096), None]
    );
    c["attn_logit_softcapping"] = Value::Null;
    c["final_logit_softcapping"] = Value::Null;
    c["sliding_window"] = Value::Null;
    let g = ModelConfig::from_hf_json(&c).unwrap();
    assert_eq!(g.attn_logit_softcapping, None);
    assert_eq!(g.final_logit_softcapping, None);
    assert_eq!(g.layer_sliding_windows, vec![None; 4]);
    c["attn_logit_softcapping"] = json!(-1.0);
    let err = ModelConfig::from_hf_json(&c).unwrap_err();
    assert!(err.contains("attn_logit_softcapping"), "{err}");
}

#[test]
fn gemma3_rope_per_layer_type_in_both_config_styles() {
    let mut c = base_of("gemma3_text");
    c["num_key_value_heads"] = json!(1);
    c["num_hidden_layers"] = json!(7);
    c["sliding_window"] = json!(512);
    // 4.x: rope_theta / rope_scaling for the global layers, rope_local_base_freq, pattern 6.
    c["rope_theta"] = json!(1000000.0);
    c["rope_local_base_freq"] = json!(10000.0);
    c["rope_scaling"] = json!({"rope_type": "linear", "factor": 8.0});
    let v4 = ModelConfig::from_hf_json(&c).unwrap();
    assert!(v4.qk_norm && v4.sandwich_norms);
    assert_eq!(v4.attn_logit_softcapping, None);
    assert_eq!(
        v4.local_rope_layers,
        vec![true, true, true, true, true, false, true]
    );
    assert_eq!(v4.layer_sliding_windows[5], None);
    assert_eq!(v4.layer_sliding_windows[6], Some(512));
    assert_eq!(v4.rope.theta, 1000000.0);
    assert_eq!(v4.rope.scaling, RopeScaling::Linear { factor: 8.0 });
    let local = v4.local_rope.clone().unwrap();
    assert_eq!(
        (local.theta, local.scaling),
        (10000.0, RopeScaling::Default)
    );
    // 5.x: rope_parameters per layer type, layer_types listed.
    let mut v5 = base_of("gemma3_text");
    v5["num_key_value_heads"] = json!(1);
    v5["num_hidden_layers"] = json!(7);
    v5["sliding_window"] = json!(512);
    v5["layer_types"] = json!(v4
        .local_rope_layers
        .iter()
        .map(|&s| if s {
            "sliding_attention"
        } else {
            "full_attention"
        })
        .collect::<Vec<_>>());
    v5["rope_parameters"] = json!({
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}});
    let v5 = ModelConfig::from_hf_json(&v5).unwrap();
    assert_eq!(v5.rope, v4.rope);
    assert_eq!(v5.local_rope, v4.local_rope);
    assert_eq!(v5.layer_sliding_windows, v4.layer_sliding_windows);
    // Nothing given: theta 1e6 globally, 1e4 locally.
    let mut bare = base_of("gemma3_text");
    bare["num_key_value_heads"] = json!(1);
    let bare = ModelConfig::from_hf_json(&bare).unwrap();
    assert_eq!(bare.rope.theta, 1_000_000.0);
    assert_eq!(bare.local_rope.unwrap().theta, 10_000.0);
}

#[test]
fn gemma_configs_that_cannot_run_say_why() {
    let mut c = base_of("gemma3_text");
    c["num_key_value_heads"] = json!(1);
    c["layer_types"] = json!(["sliding_attention", "chunked_attention"]);
    let err = ModelConfig::from_hf_json(&c).unwrap_err();
    assert!(err.contains("chunked_attention"), "{err}");
    c["layer_types"] = json!(["sliding_attention"]);
    let err = ModelConfig::from_hf_json(&c).unwrap_err();
    assert!(err.contains("layer_types") && err.contains("2"), "{err}");
    let mut c = base_of("gemma3_text");
    c["num_key_value_heads"] = json!(1);
    c["use_bidirectional_attention"] = json!(true);
    let err = ModelConfig::from_hf_json(&c).unwrap_err();
    assert!(err.contains("use_bidirectional_attention"), "{err}");
}

#[test]
fn phi2_switches_and_partial_rotary_defaults() {
    let mut c = base_of("phi");
    c["layer_norm_eps"] = json!(1e-5);
    // Phi-2's own 4.x config: partial_rotary_factor 0.4 at the top level.
    c["partial_rotary_factor"] = json!(0.4);
    c["rope_theta"] = json!(10000.0);
    let p = ModelConfig::from_hf_json(&c).unwrap();
    assert!(p.layer_norm && p.parallel_block && p.ungated_mlp);
    assert!(!p.sandwich_norms && !p.norm_weight_offset_one && !p.tie_word_embeddings);
    assert_eq!(p.rope.partial_rotary_factor, 0.4);
    assert_eq!(p.rms_norm_eps, 1e-5);
    assert_eq!(p.activation, Activation::GeluTanh);
    // Absent: PhiConfig's default 0.5.
    c.as_object_mut().unwrap().remove("partial_rotary_factor");
    assert_eq!(
        ModelConfig::from_hf_json(&c)
            .unwrap()
            .rope
            .partial_rotary_factor,
        0.5
    );
    c["qk_layernorm"] = json!(true);
    let err = ModelConfig::from_hf_json(&c).unwrap_err();
    assert!(err.contains("qk_layernorm"), "{err}");
}

#[test]
fn wrong_types_name_the_key() {
    let mut c = base();
    c["hidden_size"] = json!("big");
    assert!(ModelConfig::from_hf_json(&c)
        .unwrap_err()
        .contains("hidden_size"));
    let mut c = base();
    c["rope_parameters"] = json!({"rope_type": "fancy"});
    assert!(ModelConfig::from_hf_json(&c).unwrap_err().contains("fancy"));
}

/// OLMo 2: no pre-norms, the sandwich's output norms, q/k norms over the whole projection, and
/// `Olmo2Config`'s defaults for keys a config leaves out; every other family keeps its pre-norms
/// and per-head q/k norms.
#[test]
fn olmo2_switches_and_defaults() {
    let mut c = base_of("olmo2");
    let o = ModelConfig::from_hf_json(&c).unwrap();
    assert!(!o.pre_norms && o.sandwich_norms && o.qk_norm);
    assert_eq!(o.qk_norm_span, QkNormSpan::Projection);
    assert!(!o.tie_word_embeddings && o.activation == Activation::Silu);
    assert_eq!(o.rms_norm_eps, 1e-5);
    assert_eq!(o.max_position_embeddings, 2048);
    assert_eq!(
        (o.pad_token_id, o.eos_token_ids.clone()),
        (Some(1), vec![50_279])
    );
    c["rms_norm_eps"] = json!(1e-6);
    assert_eq!(ModelConfig::from_hf_json(&c).unwrap().rms_norm_eps, 1e-6);
    for t in ["llama", "qwen3"] {
        c["model_type"] = json!(t);
        let other = ModelConfig::from_hf_json(&c).unwrap();
        assert!(
            other.pre_norms && other.qk_norm_span == QkNormSpan::Head,
            "{t}"
        );
    }
}

/// Values out of range are refused naming the key, for every family (issue 44: a rope factor of
/// 0 loaded silently, and `num_attention_heads: 0` divided by zero).
#[test]
fn out_of_range_values_name_the_key() {
    let cases: [(&str, Value, &str); 13] = [
        (
            "rope_scaling",
            json!({"rope_type": "linear", "factor": 0.0}),
            "rope_scaling.factor",
        ),
        (
            "rope_scaling",
            json!({"rope_type": "linear", "factor": -2.0}),
            "rope_scaling.factor",
        ),
        (
            "rope_parameters",
            json!({"rope_type": "dynamic", "factor": 0}),
            "rope_scaling.factor",
        ),
        (
            "rope_scaling",
            json!({"rope_type": "llama3", "factor": 8, "low_freq_factor": 0,
                   "high_freq_factor": 4, "original_max_position_embeddings": 8192}),
            "rope_scaling.low_freq_factor",
        ),
        (
            "rope_scaling",
            json!({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 0}),
            "original_max_position_embeddings",
        ),
        (
            "rope_theta",
            json!(0),
            "'rope_theta' must be a positive number",
        ),
        ("rope_theta", json!(-10000.0), "'rope_theta'"),
        ("rms_norm_eps", json!(-1e-6), "'rms_norm_eps'"),
        ("hidden_size", json!(0), "'hidden_size'"),
        ("vocab_size", json!(0), "'vocab_size'"),
        ("num_attention_heads", json!(0), "'num_attention_heads'"),
        ("head_dim", json!(0), "'head_dim'"),
        ("num_hidden_layers", json!(0), "'num_hidden_layers'"),
    ];
    let mut families = 0;
    for family in crate::family::FAMILIES {
        let model_type = family.model_types[0].name;
        let Ok(sound) = ModelConfig::from_hf_json(&base_of(model_type)) else {
            continue; // a family needing more keys than `base` has
        };
        assert!(sound.rope.theta > 0.0);
        families += 1;
        for (key, value, needle) in &cases {
            let mut c = base_of(model_type);
            c[*key] = value.clone();
            match ModelConfig::from_hf_json(&c) {
                Ok(_) => panic!("{model_type}: {key} = {value} was accepted"),
                Err(e) => assert!(e.contains(needle), "{model_type}: {key} = {value}: {e}"),
            }
        }
    }
    assert!(
        families >= 5,
        "only {families} families parse the base config"
    );
}
