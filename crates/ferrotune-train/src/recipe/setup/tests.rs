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
