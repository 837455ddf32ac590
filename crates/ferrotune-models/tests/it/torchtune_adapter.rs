//! torchtune's `adapter_model.pt` against torchtune 0.6.1 itself: adapters saved by torchtune's
//! LoRA/DoRA models (fixtures by scripts/make_torchtune_adapter_fixtures.py) give torchtune's
//! logits once read, and are written back tensor for tensor.

use crate::common;

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use ferrotune_models::peft::{adapter_tensors, load_adapter_from};
use ferrotune_models::torch_pickle::read_torch_file;
use ferrotune_models::torchtune_adapter::{save_torchtune_adapter, torchtune_adapter_tensors};
use ferrotune_models::{load_model, save_adapter, AttentionLayout, CausalLm};
use serde_json::Value;

use common::{fixtures, max_abs_diff, rel_l2};

const CASES: &[&str] = &["llama2_dora", "gemma", "qwen2_5", "phi3", "phi3_dora"];

fn case_dir(case: &str) -> std::path::PathBuf {
    fixtures().join("torchtune_adapter").join(case)
}

fn golden(case: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(case_dir(case).join("golden.json")).unwrap())
        .unwrap()
}

fn base(case: &str) -> CausalLm {
    let g = golden(case);
    load_model(
        &fixtures().join(g["base"].as_str().unwrap()),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
    .0
}

fn logits(model: &CausalLm, case: &str) -> Tensor {
    let rows: Vec<Vec<u32>> = serde_json::from_value(golden(case)["input_ids"].clone()).unwrap();
    let (b, t) = (rows.len(), rows[0].len());
    let ids = Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap();
    model
        .forward(&ids, &AttentionLayout::causal(b, t, 0), None)
        .unwrap()
}

fn file_tensors(path: &Path) -> BTreeMap<String, Tensor> {
    read_torch_file(path)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, t.to_tensor(DType::F32, &Device::Cpu).unwrap()))
        .collect()
}

fn loaded(case: &str) -> CausalLm {
    let mut model = base(case);
    let alpha = golden(case)["lora_alpha"].as_f64().unwrap();
    load_adapter_from(
        &mut model,
        &case_dir(case).join("adapter_model.pt"),
        Some(alpha),
    )
    .unwrap_or_else(|e| panic!("{case}: {e}"));
    model
}

#[test]
fn torchtune_adapters_give_torchtunes_logits() {
    for case in CASES {
        let model = loaded(case);
        let want =
            candle_core::safetensors::load(case_dir(case).join("golden.safetensors"), &Device::Cpu)
                .unwrap()
                .remove("logits")
                .unwrap();
        // f32 on both sides, summed in different orders: ~1e-5 of the logits' scale (~10).
        let got = logits(&model, case);
        let (err, rel) = (max_abs_diff(&got, &want), rel_l2(&got, &want));
        eprintln!("{case}: logits max abs error {err:.2e}, relative L2 {rel:.2e}");
        assert!(
            err <= 3e-4 && rel <= 1e-5,
            "{case}: logits max abs error {err}, relative L2 {rel}"
        );
        // The adapter changes the logits clearly (a no-op reading would not pass by luck).
        let plain = logits(&base(case), case);
        assert!(
            max_abs_diff(&plain, &want) > 1e-2,
            "{case}: adapter has no effect"
        );
    }
}

#[test]
fn torchtune_adapters_are_written_back_as_they_were_read() {
    for case in CASES {
        let model = loaded(case);
        let want = file_tensors(&case_dir(case).join("adapter_model.pt"));
        let got: BTreeMap<String, Tensor> = torchtune_adapter_tensors(&model)
            .unwrap()
            .into_iter()
            .collect();
        assert_eq!(
            got.keys().collect::<Vec<_>>(),
            want.keys().collect::<Vec<_>>(),
            "{case}: tensor names"
        );
        for (name, t) in &want {
            assert_eq!(got[name].dims(), t.dims(), "{case}: {name}");
            let err = max_abs_diff(&got[name], t);
            assert!(err == 0.0, "{case}: {name} differs by {err}");
        }
    }
}

#[test]
fn a_phi3_adapter_of_separate_parts_saves_as_peft_and_reloads() {
    // torchtune cannot save Phi-3 adapters for PEFT; read here, they become one fused adapter
    // per module (block-diagonal where the parts have their own A) that PEFT's format holds.
    for case in ["phi3", "phi3_dora"] {
        let model = loaded(case);
        let dir = std::env::temp_dir().join(format!(
            "ferrotune-tt-adapter-{}-{case}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = load_adapter_from(
            &mut base(case),
            &case_dir(case).join("adapter_model.pt"),
            Some(golden(case)["lora_alpha"].as_f64().unwrap()),
        )
        .unwrap();
        let r = golden(case)["lora_rank"].as_u64().unwrap() as usize;
        assert_eq!(config.r, r, "{case}");
        assert!(
            config
                .rank_pattern
                .iter()
                .any(|(m, rank)| m.ends_with("qkv_proj") && *rank > r),
            "{case}: the q/k/v parts have their own A's, so qkv_proj has a larger rank: {:?}",
            config.rank_pattern
        );
        save_adapter(&model, &config, &dir).unwrap();
        let mut reloaded = base(case);
        load_adapter_from(&mut reloaded, &dir, None).unwrap();
        let err = max_abs_diff(&logits(&reloaded, case), &logits(&model, case));
        assert!(
            err <= 1e-5,
            "{case}: PEFT round trip changed logits by {err}"
        );
        // And the PEFT folder's adapter writes out as torchtune's parts again.
        save_torchtune_adapter(&reloaded, &dir).unwrap();
        let again = file_tensors(&dir.join("adapter_model.pt"));
        let want = file_tensors(&case_dir(case).join("adapter_model.pt"));
        assert_eq!(again.len(), want.len(), "{case}");
        assert_eq!(
            adapter_tensors(&reloaded).len(),
            adapter_tensors(&model).len()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn torchtune_adapter_errors_name_what_is_missing() {
    let case = "phi3";
    let file = case_dir(case).join("adapter_model.pt");
    let err = load_adapter_from(&mut base(case), &file, None)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("lora_alpha") && err.contains("adapter_model.pt"),
        "{err}"
    );
    // An adapter for another architecture names the module it cannot place.
    let err = load_adapter_from(
        &mut base("gemma"),
        &case_dir("phi3").join("adapter_model.pt"),
        Some(8.0),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("adapter_model.pt"), "{err}");
}

#[test]
fn a_fused_phi3_adapter_goes_to_torchtune_and_back_at_its_rank() {
    // ferrotune's (and PEFT's) Phi-3 adapter is one per fused module; torchtune's parts then
    // share its A, and reading them back fuses them into the same adapter, same rank.
    let case = "phi3";
    let mut model = base(case);
    let config = ferrotune_models::LoraConfig::new(
        4,
        8.0,
        ferrotune_models::TargetModules::Names(vec!["qkv_proj".into(), "gate_up_proj".into()]),
    );
    ferrotune_models::peft::add_adapter(&mut model, &config, 7).unwrap();
    for (_, linear) in model.linears_mut() {
        if let Some(adapter) = &mut linear.adapter {
            adapter.b = adapter.b.randn_like(0.0, 0.3).unwrap();
        }
    }
    let dir = std::env::temp_dir().join(format!("ferrotune-tt-fused-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    save_torchtune_adapter(&model, &dir).unwrap();
    let written = file_tensors(&dir.join("adapter_model.pt"));
    assert!(written.contains_key("layers.1.attn.k_proj.lora_a.weight"));
    assert!(written.contains_key("layers.1.mlp.w3.lora_b.weight"));
    let mut reloaded = base(case);
    let back = load_adapter_from(&mut reloaded, &dir.join("adapter_model.pt"), Some(8.0)).unwrap();
    assert_eq!(back.r, 4);
    assert!(back.rank_pattern.is_empty(), "{:?}", back.rank_pattern);
    let before = adapter_tensors(&model);
    let after = adapter_tensors(&reloaded);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>()
    );
    for (name, t) in &before {
        assert_eq!(max_abs_diff(t, &after[name]), 0.0, "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn torchtunes_output_folders_load_as_torchtune_trained_them() {
    // torchtune's epoch folder holds adapter_model.pt and the PEFT files it converts from it;
    // torchtune 0.6.1 gets Qwen2's q/k lora_B and DoRA's q/k magnitudes (and use_dora) wrong
    // there, so the folder loads by its .pt, which is what torchtune trained.
    for (case, peft_alone_is_right) in [("gemma", true), ("qwen2_5", false), ("llama2_dora", false)]
    {
        let want =
            candle_core::safetensors::load(case_dir(case).join("golden.safetensors"), &Device::Cpu)
                .unwrap()
                .remove("logits")
                .unwrap();
        let mut model = base(case);
        let config = load_adapter_from(&mut model, &case_dir(case), None)
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        assert_eq!(config.use_dora, case.ends_with("dora"), "{case}");
        let got = logits(&model, case);
        assert!(
            rel_l2(&got, &want) <= 1e-5,
            "{case}: {}",
            rel_l2(&got, &want)
        );

        // The PEFT files alone, as transformers + PEFT would read them.
        let dir =
            std::env::temp_dir().join(format!("ferrotune-tt-peft-{}-{case}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in ["adapter_config.json", "adapter_model.safetensors"] {
            std::fs::copy(case_dir(case).join(f), dir.join(f)).unwrap();
        }
        let mut alone = base(case);
        let right = load_adapter_from(&mut alone, &dir, None)
            .is_ok_and(|_| rel_l2(&logits(&alone, case), &want) <= 1e-5);
        assert_eq!(
            right, peft_alone_is_right,
            "{case}: torchtune's PEFT files alone"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
