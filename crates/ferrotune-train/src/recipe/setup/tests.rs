//! Unit tests of the recipes' shared setup.

use super::*;

#[test]
fn qlora_builders_quantize_the_base_unless_told_otherwise() {
    let cfg = |yaml: &str| crate::config::Config {
        root: crate::config::parse_yaml(yaml, "test").unwrap(),
        origin: "test".into(),
    };
    let q = |yaml: &str| quantize_base(&cfg(yaml)).unwrap();
    assert!(q(
        "model:\n  _component_: torchtune.models.llama3_1.qlora_llama3_1_8b\n"
    ));
    assert!(!q(
        "model:\n  _component_: torchtune.models.llama3_1.lora_llama3_1_8b\n"
    ));
    assert!(!q(
        "model:\n  _component_: torchtune.models.qwen2_5.qwen2_5_0_5b\n"
    ));
    assert!(!q("output_dir: /tmp\n"));
    assert!(q("model:\n  _component_: torchtune.models.llama3_1.lora_llama3_1_8b\n  quantize_base: True\n"));
    assert!(!q("model:\n  _component_: torchtune.models.llama3_1.qlora_llama3_1_8b\n  quantize_base: false\n"));
}

fn cfg(yaml: &str) -> Config {
    Config {
        root: crate::config::parse_yaml(yaml, "test.yaml").unwrap(),
        origin: "test.yaml".into(),
    }
}

/// torchtune's single-device full fine-tuning configs name bitsandbytes' AdamW classes: they
/// run as AdamW, the low-precision ones with a note saying what differs.
#[test]
fn other_libraries_adamw_classes_run_as_adamw() {
    for (component, noted) in [
        ("torch.optim.AdamW", false),
        ("bitsandbytes.optim.PagedAdamW", false),
        ("bitsandbytes.optim.AdamW32bit", false),
        ("bitsandbytes.optim.PagedAdamW8bit", true),
        ("torchao.optim.AdamW8bit", true),
    ] {
        let c = cfg(&format!(
            "optimizer:\n  _component_: {component}\n  lr: 0.001\n"
        ));
        let opt = optimizer(&c, Vec::new()).unwrap();
        assert_eq!(opt.lr(), 0.001, "{component}");
        assert_eq!(optimizer_note(&c).unwrap().is_some(), noted, "{component}");
    }
    let adam = cfg("optimizer:\n  _component_: torch.optim.Adam\n  lr: 0.1\n");
    assert!(optimizer(&adam, Vec::new()).is_err());
    assert!(check_components(&adam)[0].contains("'torch.optim.Adam' is not supported"));
}

/// The 8- and 4-bit AdamW classes build the quantized optimizer with their own keys, and give
/// the sharded recipes the settings to lay the shards out for (torch's AdamW none).
#[test]
fn quantized_adamw_classes_take_their_keys_and_give_their_blocks() {
    let c = |extra: &str| {
        cfg(&format!(
            "optimizer:\n  _component_: torchao.optim.AdamW4bit\n  lr: 0.001\n{extra}"
        ))
    };
    assert!(optimizer(&c("  block_size: 64\n"), Vec::new()).is_ok());
    assert!(optimizer(&c("  min_8bit_size: 64\n"), Vec::new()).is_err());
    assert!(optimizer(&c("  bf16_stochastic_round: true\n"), Vec::new()).is_err());
    let q = quant_config(&c("  block_size: 64\n")).unwrap().unwrap();
    assert_eq!((q.block_size, q.kind.bits()), (64, 4));
    assert!(quant_config(&c("  block_size: 0\n")).is_err());
    let adamw = cfg("optimizer:\n  _component_: torch.optim.AdamW\n  lr: 0.1\n");
    assert!(quant_config(&adamw).unwrap().is_none());
    let bnb = cfg("optimizer:\n  _component_: bitsandbytes.optim.PagedAdamW8bit\n  lr: 0.1\n  min_8bit_size: 16\n");
    assert!(optimizer(&bnb, Vec::new()).is_ok());
}

/// torchtune's attention keys on DeepSeek's latent attention: `q_proj` reaches the queries'
/// projections (`q_a_proj` and `q_b_proj` when they are low-rank), `k_proj` / `v_proj` the
/// latent's (`kv_a_proj_with_mqa`, `kv_b_proj`), `output_proj` `o_proj`.
#[test]
fn lora_attention_keys_reach_latent_attention() {
    use ferrotune_models::TargetModules;
    let cases: [(&str, &[&str]); 2] = [
        (
            "deepseek_v3",
            &[
                "q_a_proj",
                "q_b_proj",
                "kv_a_proj_with_mqa",
                "kv_b_proj",
                "o_proj",
            ],
        ),
        (
            "deepseek_v2",
            &["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
        ),
    ];
    for (case, want) in cases {
        let dir = ferrotune_testing::fixtures()
            .join("models")
            .join(case)
            .join("model");
        let (model, _) =
            ferrotune_models::load_model(&dir, candle_core::DType::F32, &candle_core::Device::Cpu)
                .unwrap();
        let c = cfg("model:\n  lora_attn_modules: [q_proj, k_proj, v_proj, output_proj]\n");
        let lc = lora_config(&c, &model, &dir).unwrap();
        let want = want.iter().map(|s| s.to_string()).collect();
        assert_eq!(lc.target_modules, TargetModules::Names(want), "{case}");
    }
}

/// `lora_attn_modules` reach Qwen3.5's Gated DeltaNet projections by their names (Qwen3-Next's
/// fused ones too), and only on a model that has them.
#[test]
fn lora_attn_modules_reach_the_delta_net_projections() {
    let modules = "model:\n  lora_attn_modules: [q_proj, output_proj, in_proj_qkv, in_proj_z, \
                   in_proj_b, in_proj_a, in_proj_qkvz, in_proj_ba, out_proj]\n";
    let load = |case: &str| {
        let dir = ferrotune_testing::fixtures()
            .join("models")
            .join(case)
            .join("model");
        let (model, _) =
            ferrotune_models::load_model(&dir, candle_core::DType::F32, &candle_core::Device::Cpu)
                .unwrap();
        (model, dir)
    };
    let (model, dir) = load("qwen3_5");
    let lc = lora_config(&cfg(modules), &model, &dir).unwrap();
    let want = [
        "q_proj",
        "o_proj",
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "in_proj_qkvz",
        "in_proj_ba",
        "out_proj",
    ];
    let want = want.iter().map(|s| s.to_string()).collect();
    assert_eq!(lc.target_modules, TargetModules::Names(want));
    let (model, dir) = load("qwen3");
    let err = lora_config(&cfg(modules), &model, &dir).unwrap_err();
    assert!(
        err.to_string().contains("unknown module 'in_proj_qkv'"),
        "{err}"
    );
}
