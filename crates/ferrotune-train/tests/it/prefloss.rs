//! TRL's reference-free and IPO preference losses against TRL 1.16.0 with PyTorch + PEFT
//! (scripts/make_prefloss_fixtures.py: ORPO, SimPO and CPO through TRL's own loss and log
//! probability functions, IPO through a real `DPOTrainer`'s `_compute_loss`) on the DPO fixture
//! pairs: ORPO, SimPO, CPO (no reference) and IPO (the adapter-disabled reference). The loss, TRL's metrics and every
//! adapter gradient.

use candle_core::{DType, Device};
use ferrotune_data::dataset::PreferencePair;
use ferrotune_models::{load_adapter, load_model};
use ferrotune_train::loss::PreferenceLoss;
use ferrotune_train::step::{
    empty_grads, forward_backward, reference_log_probs, MicroBatch, Preference,
};

use crate::common;
use common::{json, rel_l2};

use ferrotune_testing::fixtures;

#[test]
fn orpo_simpo_cpo_ipo_losses_metrics_and_gradients_match_trl() {
    let want = json(fixtures().join("prefloss/golden.json"));
    let pairs = crate::dpo::pairs();
    let picked: Vec<&PreferencePair> = pairs.iter().collect();
    let n = pairs.len();
    let f = |k: &str, p: &str| want[k][p].as_f64().unwrap();
    for (name, loss) in [
        (
            "orpo",
            PreferenceLoss::Orpo {
                beta: f("orpo", "beta"),
            },
        ),
        (
            "simpo",
            PreferenceLoss::Simpo {
                beta: f("simpo", "beta"),
                gamma: f("simpo", "simpo_gamma"),
                label_smoothing: f("simpo", "label_smoothing"),
                alpha: f("simpo", "cpo_alpha"),
            },
        ),
        (
            "cpo",
            PreferenceLoss::Cpo {
                beta: f("cpo", "beta"),
                label_smoothing: f("cpo", "label_smoothing"),
                alpha: f("cpo", "cpo_alpha"),
            },
        ),
        (
            "ipo",
            PreferenceLoss::Ipo {
                beta: f("ipo", "beta"),
            },
        ),
    ] {
        for checkpointing in [false, true] {
            let mut model = load_model(&fixtures().join("llama3/model"), DType::F32, &Device::Cpu)
                .unwrap()
                .0;
            load_adapter(&mut model, &fixtures().join("llama3/adapter")).unwrap();
            let params = ferrotune_models::peft::trainable_parameters(&mut model).unwrap();
            ferrotune_models::lora::set_training(&mut model, true);
            let mut batch = MicroBatch::from_pairs(&picked, 3, &Device::Cpu).unwrap();
            let reference = match loss.reference_free() {
                // Whatever stands here is not read.
                true => vec![f32::NAN; 2 * n],
                false => ferrotune_models::peft::with_adapters_disabled(&mut model, |m| {
                    reference_log_probs(m, &batch)
                })
                .unwrap(),
            };
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
            let metrics = step.pairs.metrics(n).into_iter().take(4);
            for (key, got) in metrics.chain(step.pairs.method_metrics(n, loss)) {
                let w = want[name][key].as_f64().unwrap();
                // Rewards and log odds are (scaled) differences of f32 log probabilities (an
                // ulp of the averaged ones near -6 is 4.8e-7): a few of their ulps.
                let tol = match key.split('/').next().unwrap() {
                    "rewards" => 2e-5,
                    "log_odds_chosen" => 2e-6,
                    _ => 1e-5 * w.abs().max(1e-3),
                };
                assert!((got - w).abs() <= tol, "{name}: {key} {got} vs {w}");
            }
            let ref_grads = candle_core::safetensors::load(
                fixtures().join(format!("prefloss/{name}_grads.safetensors")),
                &Device::Cpu,
            )
            .unwrap();
            assert_eq!(ref_grads.len(), params.len());
            let mut worst: f32 = 0.0;
            for (pname, var) in &params {
                let got = (grads.get(var.as_tensor()).unwrap() / n as f64).unwrap();
                let err = rel_l2(&got, &ref_grads[pname]);
                assert!(err < 1e-4, "{name}: {pname}: relative L2 {err}");
                worst = worst.max(err);
            }
            eprintln!(
                "{name} (checkpointing {checkpointing}): loss relative error {:.1e}, worst \
                 gradient relative L2 {worst:.1e}",
                ((got_loss - w) / w).abs()
            );
        }
    }
}

#[test]
fn trl_preference_losses_are_read_with_trl_defaults() {
    let read = |c: &str| {
        PreferenceLoss::from_component(&format!("torchtune.rlhf.loss.{c}"), None, None, None)
            .unwrap()
    };
    assert_eq!(read("ORPOLoss"), PreferenceLoss::Orpo { beta: 0.1 });
    assert_eq!(read("IPOLoss"), PreferenceLoss::Ipo { beta: 0.1 });
    assert_eq!(
        read("CPOLoss"),
        PreferenceLoss::Cpo {
            beta: 0.1,
            label_smoothing: 0.0,
            alpha: 1.0
        }
    );
    assert_eq!(
        read("SimPOLoss").with_trl_params(Some(0.3), None),
        PreferenceLoss::Simpo {
            beta: 0.1,
            gamma: 0.3,
            label_smoothing: 0.0,
            alpha: 0.0
        }
    );
    assert!(read("ORPOLoss").reference_free() && !read("IPOLoss").reference_free());
}
