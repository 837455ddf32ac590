//! gpt-oss's MXFP4 experts held packed (QLoRA's frozen base,
//! `read_checkpoint_files_keeping_mxfp4`) against the same checkpoint read dequantized, on
//! tests/fixtures/gpt_oss_mxfp4 (scripts/make_gpt_oss_fixtures.py): the dequantization is exact,
//! so every expert, the logits, the LoRA loss and every adapter gradient agree to f32 rounding,
//! and the saved adapter and merged weights are the dequantized run's.

use crate::common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use ferrotune_models::checkpoint::read_checkpoint_files_keeping_mxfp4;
use ferrotune_models::lora::set_training;
use ferrotune_models::model::{ExpertWeight, FeedForward};
use ferrotune_models::peft::{add_adapter, merged_tensors, trainable_parameters};
use ferrotune_models::{
    load_model, save_adapter, AttentionLayout, CausalLm, LoraConfig, TargetModules,
};
use serde_json::Value;

use common::{causal_lm_loss, fixtures, max_abs_diff, rel_l2};

fn dir() -> std::path::PathBuf {
    fixtures().join("gpt_oss_mxfp4")
}

fn dequantized() -> CausalLm {
    load_model(&dir().join("model"), DType::F32, &Device::Cpu)
        .unwrap()
        .0
}

fn packed() -> CausalLm {
    let ckpt =
        read_checkpoint_files_keeping_mxfp4(&dir().join("model"), &[], DType::F32, &Device::Cpu)
            .unwrap();
    CausalLm::from_tensors(ckpt.config, ckpt.tensors, "packed").unwrap()
}

fn ids() -> Tensor {
    let g: Value =
        serde_json::from_str(&std::fs::read_to_string(dir().join("golden.json")).unwrap()).unwrap();
    let rows: Vec<Vec<u32>> = serde_json::from_value(g["input_ids"].clone()).unwrap();
    Tensor::new(rows, &Device::Cpu).unwrap()
}

fn forward(model: &CausalLm, ids: &Tensor) -> Tensor {
    let (b, t) = ids.dims2().unwrap();
    model
        .forward(ids, &AttentionLayout::causal(b, t, 0), None)
        .unwrap()
}

/// LoRA on q/o_proj and on both fused experts (`target_parameters`), every `lora_B` set to the
/// same random values on both models so that every factor gets a gradient.
fn adapt(model: &mut CausalLm) -> (LoraConfig, Vec<(String, candle_core::Var)>) {
    let mut config = LoraConfig::new(
        2,
        4.0,
        TargetModules::Names(vec!["q_proj".into(), "o_proj".into()]),
    );
    config.target_parameters = vec![
        "mlp.experts.gate_up_proj".into(),
        "mlp.experts.down_proj".into(),
    ];
    add_adapter(model, &config, 7).unwrap();
    let params = trainable_parameters(model).unwrap();
    for (i, (name, var)) in params.iter().enumerate() {
        if name.contains("lora_B") {
            let t = var.as_tensor();
            let n = t.elem_count();
            let values: Vec<f32> = (0..n)
                .map(|j| (((j * 7919 + i * 104_729) % 1000) as f32 / 1000.0 - 0.5) * 0.2)
                .collect();
            var.set(&Tensor::from_vec(values, t.dims(), t.device()).unwrap())
                .unwrap();
        }
    }
    (config, params)
}

#[test]
fn packed_mxfp4_experts_give_the_dequantized_models_numbers() {
    let (mut dense, mut packed) = (dequantized(), packed());
    // Every expert weight is held packed, a quarter of its f32 bytes and then some (the scales);
    // each expert dequantizes to exactly the dense model's slice.
    let summary = packed.mxfp4_experts();
    assert_eq!(summary.weights, 6);
    assert!(summary.packed_bytes * 7 < summary.dense_bytes, "{summary}");
    for (d, p) in dense.layers.iter().zip(&packed.layers) {
        let (FeedForward::GptOss(d), FeedForward::GptOss(p)) = (&d.mlp, &p.mlp) else {
            panic!("gpt-oss blocks");
        };
        for (dw, pw) in [
            (&d.gate_up_proj, &p.gate_up_proj),
            (&d.down_proj, &p.down_proj),
        ] {
            assert!(matches!(dw, ExpertWeight::Dense(_)));
            assert!(matches!(pw, ExpertWeight::Mxfp4(_)));
            assert_eq!(
                max_abs_diff(&dw.dense().unwrap(), &pw.dense().unwrap()),
                0.0
            );
            for e in 0..4 {
                let (a, b) = (dw.expert(e).unwrap(), pw.expert(e).unwrap());
                assert_eq!(max_abs_diff(&a, &b), 0.0, "expert {e}");
            }
        }
        // The model's tensors leave the packed experts out (they are no parameters).
        assert_eq!(d.tensors().len(), 6);
        assert_eq!(p.tensors().len(), 4);
    }
    let ids = ids();
    let err = max_abs_diff(&forward(&dense, &ids), &forward(&packed, &ids));
    assert!(err <= 1e-5, "inference logits max abs error {err}");

    // LoRA training: the loss and every adapter's gradient (through the packed experts'
    // dequantize-in-the-backward product) as the dequantized model's.
    let (config, dense_params) = adapt(&mut dense);
    let (_, packed_params) = adapt(&mut packed);
    let mut losses = Vec::new();
    let mut grads = Vec::new();
    for model in [&mut dense, &mut packed] {
        set_training(model, true);
        let logits = forward(model, &ids);
        let labels: Value = serde_json::to_value(ids.to_vec2::<u32>().unwrap()).unwrap();
        let loss = causal_lm_loss(&logits, &labels);
        losses.push(loss.to_scalar::<f32>().unwrap());
        grads.push(loss.backward().unwrap());
        set_training(model, false);
    }
    assert!(
        (losses[0] - losses[1]).abs() <= 1e-6 * losses[0].abs(),
        "loss {losses:?}"
    );
    assert_eq!(dense_params.len(), packed_params.len());
    assert_eq!(dense_params.len(), 3 * (4 + 4));
    for ((name, dv), (pname, pv)) in dense_params.iter().zip(&packed_params) {
        assert_eq!(name, pname);
        let (dg, pg) = (grads[0].get(dv).unwrap(), grads[1].get(pv).unwrap());
        assert!(
            dg.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                > 0.0,
            "{name}"
        );
        let err = rel_l2(pg, dg);
        assert!(err <= 1e-5, "{name}: gradient relative L2 error {err}");
    }

    // Saved adapters and merged weights: the dequantized run's (packed experts dequantized).
    let out = std::env::temp_dir().join(format!("ferrotune-mxfp4-packed-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let read = |p: &std::path::Path| -> HashMap<String, Tensor> {
        candle_core::safetensors::load(p.join("adapter_model.safetensors"), &Device::Cpu).unwrap()
    };
    save_adapter(&dense, &config, &out.join("dense")).unwrap();
    save_adapter(&packed, &config, &out.join("packed")).unwrap();
    let (a, b) = (read(&out.join("dense")), read(&out.join("packed")));
    assert_eq!(a.len(), b.len());
    for (k, t) in &a {
        assert_eq!(max_abs_diff(t, &b[k]), 0.0, "{k}");
    }
    let _ = std::fs::remove_dir_all(&out);
    let (a, b) = (
        merged_tensors(&dense).unwrap(),
        merged_tensors(&packed).unwrap(),
    );
    let mut names: Vec<&String> = a.keys().collect();
    let mut packed_names: Vec<&String> = b.keys().collect();
    names.sort();
    packed_names.sort();
    assert_eq!(names, packed_names);
    for (k, t) in &a {
        assert_eq!(max_abs_diff(t, &b[k]), 0.0, "merged {k}");
    }
}

/// Without adapters on the experts, the merged (saved) model still holds every packed expert,
/// dequantized: the checkpoint a run saves is complete.
#[test]
fn a_packed_base_merges_to_the_whole_dequantized_checkpoint() {
    let (dense, packed) = (dequantized(), packed());
    let (a, b) = (
        merged_tensors(&dense).unwrap(),
        merged_tensors(&packed).unwrap(),
    );
    assert_eq!(a.len(), b.len());
    for (k, t) in &a {
        assert_eq!(max_abs_diff(t, &b[k]), 0.0, "{k}");
    }
}
