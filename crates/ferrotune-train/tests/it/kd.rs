//! Knowledge distillation against torchtune's KD losses computed with PyTorch + PEFT
//! (scripts/make_kd_fixtures.py): the tiny Llama student with its PEFT adapter, a tiny teacher of
//! the same vocabulary, kd_ratio 0.3. For the forward, reverse and symmetric losses: the
//! cross-entropy, distillation and mixed losses of the golden batch, and every adapter gradient
//! of the mixed loss, with and without activation checkpointing.

use candle_core::{DType, Device, Tensor};
use ferrotune_models::{load_adapter, load_model, AttentionLayout};
use ferrotune_train::loss::KdLoss;
use ferrotune_train::step::{empty_grads, forward_backward, Distill, MicroBatch};

use crate::common;
use common::{json, rel_l2};

use ferrotune_testing::fixtures;

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
    let teacher_hidden = teacher.forward_hidden(&input_ids, &layout, None).unwrap();
    let teacher = std::sync::Arc::new(teacher);
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
        // One chunk, and chunks of 6 target rows (the batch has 36), each back-propagated alone.
        for (checkpointing, chunks) in [(false, 1), (true, 1), (false, 8), (true, 8)] {
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
                    teacher: teacher.clone(),
                    teacher_hidden: teacher_hidden.clone(),
                    ratio: want["kd_ratio"].as_f64().unwrap(),
                    loss: kind,
                    chunks,
                }),
                preference: None,
                aux_loss_weight: None,
                layer_skip: None,
                reward: None,
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
                    "{name} (checkpointing {checkpointing}, {chunks} chunks): {part} {got} vs {w}"
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
                assert!(
                    err < 1e-4,
                    "{name} ({chunks} chunks): {pname}: relative L2 {err}"
                );
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

/// The chunked distillation head equals the whole-logits composite (`causal_lm_loss` and
/// `kd_loss_sum` over the full logits, one backward) in value and in every gradient, with an
/// adapter on the output head too (whose gradients the chunks compute themselves).
#[test]
fn chunked_distillation_head_equals_the_whole_logits_composite() {
    use ferrotune_models::peft::{add_adapter, LoraConfig, TargetModules};
    use ferrotune_train::loss::{causal_lm_loss, kd_loss_sum};
    let g = json(fixtures().join("llama3/golden.json"));
    let ids: Vec<Vec<u32>> = serde_json::from_value(g["input_ids"].clone()).unwrap();
    let labels: Vec<Vec<i64>> = serde_json::from_value(g["labels"].clone()).unwrap();
    let (b, t) = (ids.len(), ids[0].len());
    let dev = Device::Cpu;
    let teacher = load_model(&fixtures().join("kd/teacher"), DType::F32, &dev)
        .unwrap()
        .0;
    let input_ids = Tensor::from_vec(ids.concat(), (b, t), &dev).unwrap();
    let labels = Tensor::from_vec(labels.concat(), (b, t), &dev).unwrap();
    let layout = AttentionLayout::causal(b, t, 0);
    let teacher_logits = teacher.forward(&input_ids, &layout, None).unwrap();
    let teacher_hidden = teacher.forward_hidden(&input_ids, &layout, None).unwrap();
    let teacher = std::sync::Arc::new(teacher);
    let targets = ["q_proj", "v_proj", "lm_head"].map(String::from).to_vec();
    let student = || {
        let mut m = load_model(&fixtures().join("llama3/model"), DType::F32, &dev)
            .unwrap()
            .0;
        add_adapter(
            &mut m,
            &LoraConfig::new(4, 8.0, TargetModules::Names(targets.clone())),
            3,
        )
        .unwrap();
        // B starts at zero: give it varied values so that every adapter gradient is non-trivial
        // (not rows all alike: the logits' gradient sums to 0 over the vocabulary, which would
        // make lm_head's A gradient vanish to rounding noise).
        for (_, linear) in m.linears_mut() {
            if let Some(a) = &mut linear.adapter {
                let (out, r) = a.b.dims2().unwrap();
                let values: Vec<f32> = (0..out * r)
                    .map(|i| ((i * 7 + i / r * 3) % 11) as f32 * 0.01 - 0.05)
                    .collect();
                a.b = Tensor::from_vec(values, (out, r), &dev).unwrap();
            }
        }
        let params = ferrotune_models::peft::trainable_parameters(&mut m).unwrap();
        (m, params)
    };
    for kind in [KdLoss::Forward, KdLoss::Reverse] {
        // The composite reference.
        let (reference, ref_params) = student();
        let logits = reference.forward(&input_ids, &layout, None).unwrap();
        let class = causal_lm_loss(&logits, &labels, true).unwrap().sum;
        let kd = kd_loss_sum(&logits, &teacher_logits, &labels, kind)
            .unwrap()
            .sum;
        let total = ((class * 0.6).unwrap() + (kd * 0.4).unwrap()).unwrap();
        let want_grads = total.backward().unwrap();
        let want = total.to_scalar::<f32>().unwrap() as f64;
        assert!(ref_params.iter().any(|(n, _)| n.contains("lm_head")));
        for chunks in [1, 8, 36] {
            let (m, params) = student();
            let batch = MicroBatch {
                input_ids: input_ids.clone(),
                labels: labels.clone(),
                layout: layout.clone(),
                num_targets: 36,
                num_tokens: b * t,
                distill: Some(Distill {
                    teacher: teacher.clone(),
                    teacher_hidden: teacher_hidden.clone(),
                    ratio: 0.4,
                    loss: kind,
                    chunks,
                }),
                preference: None,
                aux_loss_weight: None,
                layer_skip: None,
                reward: None,
            };
            for checkpointing in [false, true] {
                let mut grads = empty_grads().unwrap();
                let step =
                    forward_backward(&m, &batch, &params, &mut grads, checkpointing).unwrap();
                assert!(
                    ((step.sum - want) / want).abs() < 1e-5,
                    "{kind:?} {chunks} chunks: loss {} vs {want}",
                    step.sum
                );
                for ((name, var), (ref_name, ref_var)) in params.iter().zip(&ref_params) {
                    assert_eq!(name, ref_name);
                    let err = rel_l2(
                        grads.get(var.as_tensor()).unwrap(),
                        want_grads.get(ref_var.as_tensor()).unwrap(),
                    );
                    assert!(
                        err < 1e-5,
                        "{kind:?} {chunks} chunks: {name}: relative L2 {err}"
                    );
                }
            }
        }
    }
}
