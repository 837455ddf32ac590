//! Knowledge distillation against torchtune's KD losses computed with PyTorch + PEFT
//! (scripts/make_kd_fixtures.py): the tiny Llama student with its PEFT adapter, a tiny teacher of
//! the same vocabulary, kd_ratio 0.3. For the forward, reverse and symmetric losses: the
//! cross-entropy, distillation and mixed losses of the golden batch, and every adapter gradient
//! of the mixed loss, with and without activation checkpointing.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use ferrotune_models::{load_adapter, load_model, AttentionLayout};
use ferrotune_train::loss::KdLoss;
use ferrotune_train::step::{empty_grads, forward_backward, Distill, MicroBatch};
use serde_json::Value;

mod common;
use common::rel_l2;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn json(path: PathBuf) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn distillation_losses_and_gradients_match_torchtunes_formulas() {
    let g = json(fixtures().join("llama3/golden.json"));
    let want = json(fixtures().join("kd/golden.json"));
    let ids: Vec<Vec<u32>> = serde_json::from_value(g["input_ids"].clone()).unwrap();
    let labels: Vec<Vec<i64>> = serde_json::from_value(g["labels"].clone()).unwrap();
    let (b, t) = (ids.len(), ids[0].len());
    let teacher = load_model(&fixtures().join("kd/teacher"), DType::F32, &Device::Cpu)
        .unwrap()
        .0;
    let input_ids = Tensor::from_vec(ids.concat(), (b, t), &Device::Cpu).unwrap();
    let layout = AttentionLayout::causal(b, t, 0);
    let teacher_logits = teacher.forward(&input_ids, &layout, None).unwrap();
    let num_targets: usize = labels
        .iter()
        .map(|r| r.iter().skip(1).filter(|&&l| l != -100).count())
        .sum();
    let sym = want["sym_kd_ratio"].as_f64().unwrap();
    for (name, kind) in [
        ("forward", KdLoss::Forward),
        ("reverse", KdLoss::Reverse),
        ("symmetric", KdLoss::Symmetric(sym)),
    ] {
        for checkpointing in [false, true] {
            let mut student =
                load_model(&fixtures().join("llama3/model"), DType::F32, &Device::Cpu)
                    .unwrap()
                    .0;
            load_adapter(&mut student, &fixtures().join("llama3/adapter")).unwrap();
            let params = ferrotune_models::peft::trainable_parameters(&mut student).unwrap();
            ferrotune_models::lora::set_training(&mut student, true);
            let batch = MicroBatch {
                input_ids: input_ids.clone(),
                labels: Tensor::from_vec(labels.concat(), (b, t), &Device::Cpu).unwrap(),
                layout: layout.clone(),
                num_targets,
                num_tokens: b * t,
                distill: Some(Distill {
                    teacher_logits: teacher_logits.clone(),
                    ratio: want["kd_ratio"].as_f64().unwrap(),
                    loss: kind,
                }),
                preference: None,
            };
            let mut grads = empty_grads().unwrap();
            let step =
                forward_backward(&student, &batch, &params, &mut grads, checkpointing).unwrap();
            let n = num_targets as f64;
            for (part, got) in [
                ("class_loss", step.class / n),
                ("kd_loss", step.kd / n),
                ("loss", step.sum / n),
            ] {
                let w = want[name][part].as_f64().unwrap();
                assert!(
                    ((got - w) / w).abs() < 1e-5,
                    "{name} (checkpointing {checkpointing}): {part} {got} vs {w}"
                );
            }
            let ref_grads = candle_core::safetensors::load(
                fixtures().join(format!("kd/{name}_grads.safetensors")),
                &Device::Cpu,
            )
            .unwrap();
            assert_eq!(ref_grads.len(), params.len());
            for (pname, var) in &params {
                let got = (grads.get(var.as_tensor()).unwrap() / n).unwrap();
                let err = rel_l2(&got, &ref_grads[pname]);
                assert!(err < 1e-4, "{name}: {pname}: relative L2 {err}");
            }
        }
    }
}

#[test]
fn kd_components_are_read_as_torchtune_names_them() {
    use KdLoss::*;
    let c = |s: &str| KdLoss::from_component(s, None);
    assert_eq!(
        c("torchtune.modules.loss.ForwardKLWithChunkedOutputLoss"),
        Some(Forward)
    );
    assert_eq!(c("torchtune.modules.loss.ForwardKLLoss"), Some(Forward));
    assert_eq!(c("ReverseKLWithChunkedOutputLoss"), Some(Reverse));
    assert_eq!(c("SymmetricKLLoss"), Some(Symmetric(0.5)));
    assert_eq!(
        KdLoss::from_component("SymmetricKLWithChunkedOutputLoss", Some(0.2)),
        Some(Symmetric(0.2))
    );
    assert_eq!(c("torch.nn.KLDivLoss"), None);
}
