//! Direct Preference Optimization against torchtune's recipe computed with PyTorch + PEFT
//! (scripts/make_dpo_fixtures.py): the tiny Llama with its PEFT adapter as the policy, the same
//! model with the adapter disabled as the reference, two pairs of unequal lengths. For DPOLoss
//! (β 0.3, label smoothing 0.2) and RSOLoss (γ 0.4): the loss, the logged metrics and every
//! adapter gradient, with and without activation checkpointing.

use candle_core::{DType, Device};
use ferrotune_data::dataset::{PreferencePair, Row};
use ferrotune_models::{load_adapter, load_model};
use ferrotune_train::loss::PreferenceLoss;
use ferrotune_train::step::{
    empty_grads, forward_backward, reference_log_probs, MicroBatch, Preference,
};
use serde_json::Value;

use crate::common;
use common::{json, rel_l2};

use ferrotune_testing::fixtures;

pub(crate) fn pairs() -> Vec<PreferencePair> {
    let text = std::fs::read_to_string(fixtures().join("dpo/pairs.jsonl")).unwrap();
    text.lines()
        .map(|line| {
            let v: Value = serde_json::from_str(line).unwrap();
            let side = |k: &str| {
                Row::new(
                    serde_json::from_value(v[format!("{k}_input_ids")].clone()).unwrap(),
                    serde_json::from_value(v[format!("{k}_labels")].clone()).unwrap(),
                )
            };
            PreferencePair {
                chosen: side("chosen"),
                rejected: side("rejected"),
            }
        })
        .collect()
}

#[test]
fn dpo_and_rso_losses_metrics_and_gradients_match_torchtune() {
    let want = json(fixtures().join("dpo/golden.json"));
    let pairs = pairs();
    let picked: Vec<&PreferencePair> = pairs.iter().collect();
    let n = pairs.len();
    let f = |k: &str| want[k].as_f64().unwrap();
    for (name, loss) in [
        (
            "dpo",
            PreferenceLoss::Dpo {
                beta: f("beta"),
                label_smoothing: f("label_smoothing"),
            },
        ),
        ("rso", PreferenceLoss::Rso { gamma: f("gamma") }),
    ] {
        for checkpointing in [false, true] {
            let mut model = load_model(&fixtures().join("llama3/model"), DType::F32, &Device::Cpu)
                .unwrap()
                .0;
            load_adapter(&mut model, &fixtures().join("llama3/adapter")).unwrap();
            let params = ferrotune_models::peft::trainable_parameters(&mut model).unwrap();
            ferrotune_models::lora::set_training(&mut model, true);
            let mut batch = MicroBatch::from_pairs(&picked, 3, &Device::Cpu).unwrap();
            let reference = ferrotune_models::peft::with_adapters_disabled(&mut model, |m| {
                reference_log_probs(m, &batch)
            })
            .unwrap();
            batch.preference = Some(Preference {
                reference_logps: reference,
                loss,
                unpaired: None,
            });
            let mut grads = empty_grads().unwrap();
            let step =
                forward_backward(&model, &batch, &params, &mut grads, checkpointing).unwrap();
            let got_loss = step.sum / n as f64;
            let w = want[name]["loss"].as_f64().unwrap();
            assert!(
                ((got_loss - w) / w).abs() < 1e-5,
                "{name} (checkpointing {checkpointing}): loss {got_loss} vs {w}"
            );
            for (key, got) in step.pairs.metrics(n) {
                let w = want[name][key].as_f64().unwrap();
                // Rewards are scaled differences of f32 sums near -85 (an ulp is 7.6e-6), so
                // they agree to a few ulps of those sums, not relatively.
                let tol = match key.split('/').next().unwrap() {
                    "rewards" => 2e-5,
                    "logits" => 1e-3 * w.abs(),
                    _ => 1e-5 * w.abs(),
                };
                assert!((got - w).abs() <= tol, "{name}: {key} {got} vs {w}");
            }
            let ref_grads = candle_core::safetensors::load(
                fixtures().join(format!("dpo/{name}_grads.safetensors")),
                &Device::Cpu,
            )
            .unwrap();
            assert_eq!(ref_grads.len(), params.len());
            for (pname, var) in &params {
                let got = (grads.get(var.as_tensor()).unwrap() / n as f64).unwrap();
                let err = rel_l2(&got, &ref_grads[pname]);
                assert!(err < 1e-4, "{name}: {pname}: relative L2 {err}");
            }
        }
    }
}

#[test]
fn preference_losses_are_read_as_torchtune_names_them() {
    let dpo = PreferenceLoss::from_component("torchtune.rlhf.loss.DPOLoss", None, None, None);
    assert_eq!(
        dpo,
        Some(PreferenceLoss::Dpo {
            beta: 0.1,
            label_smoothing: 0.0
        })
    );
    let rso = PreferenceLoss::from_component("torchtune.rlhf.loss.RSOLoss", None, None, Some(0.5));
    assert_eq!(rso, Some(PreferenceLoss::Rso { gamma: 0.5 }));
    assert_eq!(
        PreferenceLoss::from_component("torchtune.rlhf.loss.PPOLoss", None, None, None),
        None
    );
}

/// The logged mean logits equal the mean of the model's logits over the chosen (rejected) rows,
/// for heads with a bias (Phi-2), with Gemma 2's final softcap (formed in chunks), and plain; and
/// with a head adapter carrying a `lora_bias`, beside the head's own bias (Phi-2) and without one
/// (Llama).
#[test]
fn logged_mean_logits_are_the_mean_of_the_logits() {
    let cases = [
        ("models/gemma2", None),
        ("models/phi2", None),
        ("models/qwen3", None),
        ("models/phi2", Some("lora_bias/phi2_all")),
        ("llama3", Some("lora_bias/llama3_unmergeable")),
    ];
    for (family, adapter) in cases {
        let dir = fixtures().join(family).join("model");
        let mut model = load_model(&dir, DType::F32, &Device::Cpu).unwrap().0;
        if let Some(adapter) = adapter {
            load_adapter(&mut model, &fixtures().join(adapter).join("adapter")).unwrap();
            assert!(model
                .lm_head
                .adapter
                .as_ref()
                .is_some_and(|a| a.bias.is_some()));
        }
        let vocab = model.config.vocab_size as u32;
        let side = |seed: u32, len: u32| {
            let ids: Vec<u32> = (0..len)
                .map(|j| (seed * 31 + j * 7) % (vocab - 4) + 4)
                .collect();
            let labels = ids
                .iter()
                .enumerate()
                .map(|(j, &t)| if j < 2 { -100 } else { t as i64 });
            Row::new(ids.clone(), labels.collect())
        };
        let pairs = [
            PreferencePair {
                chosen: side(1, 7),
                rejected: side(2, 5),
            },
            PreferencePair {
                chosen: side(3, 4),
                rejected: side(4, 9),
            },
        ];
        let picked: Vec<&PreferencePair> = pairs.iter().collect();
        let mut batch = MicroBatch::from_pairs(&picked, 0, &Device::Cpu).unwrap();
        batch.preference = Some(Preference {
            reference_logps: vec![-3.0; 4],
            loss: PreferenceLoss::Dpo {
                beta: 0.1,
                label_smoothing: 0.0,
            },
            unpaired: None,
        });
        let logits = model
            .forward(&batch.input_ids, &batch.layout, None)
            .unwrap();
        let mean = |first: usize| {
            logits
                .narrow(0, first, 2)
                .unwrap()
                .mean_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64
        };
        let mut grads = empty_grads().unwrap();
        let step = forward_backward(&model, &batch, &[], &mut grads, false).unwrap();
        let metrics: std::collections::HashMap<_, _> = step.pairs.metrics(2).into_iter().collect();
        for (key, want) in [("logits/chosen", mean(0)), ("logits/rejected", mean(2))] {
            let got = metrics[key];
            assert!(
                (got - want).abs() <= 1e-5 * want.abs().max(1e-3),
                "{family}: {key} {got} vs {want}"
            );
        }
    }
}
