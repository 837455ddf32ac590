//! GRPO against torchtune's own GRPO code (`torchtune.dev.grpo` loss and rewards) and `rlhf`
//! functions on transformers models (scripts/make_grpo_fixtures.py): the tiny Llama as policy and
//! reference, two left-padded prompts with three fixed completions each. Checked: the trajectory
//! (log probabilities of both models, rewards decoded from the completions, successes,
//! advantages, masks), then two optimizer steps (AdamW, gradient clipping) for each of
//! `GRPOSimpleLoss` and the clipped `GRPOLoss`: statistics, gradients and parameters after each,
//! with the batch in one pass or in parts, with and without activation checkpointing.

use candle_core::{DType, Device, Var};
use ferrotune_data::Tokenizer;
use ferrotune_models::{load_model, CausalLm};
use ferrotune_train::clip::clip_grad_norm;
use ferrotune_train::grpo::{GrpoLossConfig, GrpoLossKind};
use ferrotune_train::optim::{AdamW, AdamWConfig, Optimizer};
use ferrotune_train::recipe::grpo::{self, GrpoSettings, GrpoTrajectory, Reference};
use ferrotune_train::recipe::kit::rollout::left_pad;
use ferrotune_train::recipe::kit::rollout::{Backward, RolloutSettings};
use ferrotune_train::step::empty_grads;
use serde_json::Value;

use crate::common;
use common::{load, rel_l2, workspace_fixture};

fn golden() -> Value {
    let path = workspace_fixture("grpo/golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn get<T: serde::de::DeserializeOwned>(g: &Value, key: &str) -> T {
    serde_json::from_value(g[key].clone()).unwrap_or_else(|e| panic!("golden {key}: {e}"))
}

fn settings(g: &Value, clipped: bool) -> GrpoSettings {
    GrpoSettings {
        grpo_samples: get(g, "grpo_samples"),
        rollout: RolloutSettings {
            temperature: get(g, "temperature"),
            top_k: None,
            max_generated_tokens: 64,
            stop_token_ids: get(g, "stop_token_ids"),
            pad_id: get(g, "pad_id"),
        },
        loss: GrpoLossConfig {
            kind: if clipped {
                GrpoLossKind::Clipped {
                    epsilon: get(g, "epsilon"),
                }
            } else {
                GrpoLossKind::Simple
            },
            kl_coeff: get(g, "kl_coeff"),
        },
    }
}

fn assert_table(what: &str, got: &[Vec<f32>], want: &[Vec<f32>], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: rows");
    for (r, (a, b)) in got.iter().zip(want).enumerate() {
        assert_eq!(a.len(), b.len(), "{what}: row {r} length");
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= tol,
                "{what} row {r}: {a:?}\n vs torch {b:?}"
            );
        }
    }
}

fn close(what: &str, got: f64, want: f64, tol: f64) {
    assert!(
        (got - want).abs() <= tol * want.abs().max(1.0),
        "{what}: {got} vs torch {want}"
    );
}

/// The trajectory of the fixture's completions under `policy` and `reference`.
fn trajectory_of(
    g: &Value,
    s: &GrpoSettings,
    policy: &mut CausalLm,
    reference: Reference<'_>,
) -> GrpoTrajectory {
    let tok = Tokenizer::from_dir(workspace_fixture("llama3/model")).unwrap();
    let prompts: Vec<Vec<u32>> = get(g, "prompts");
    grpo::trajectory(
        policy,
        reference,
        &tok,
        &left_pad(&prompts, s.rollout.pad_id),
        &get::<Vec<Vec<u32>>>(g, "completions"),
        &get::<Vec<String>>(g, "answers"),
        s,
    )
    .unwrap()
}

/// The tiny Llama, f32.
fn tiny_llama() -> CausalLm {
    load_model(&workspace_fixture("llama3/model"), DType::F32, &Device::Cpu)
        .unwrap()
        .0
}

/// The trajectory with the tiny Llama as policy and as reference (two copies).
fn build_trajectory(g: &Value, s: &GrpoSettings) -> GrpoTrajectory {
    let reference = tiny_llama();
    trajectory_of(g, s, &mut tiny_llama(), Reference::Model(&reference))
}

/// The trajectory's log probabilities (policy and reference) against `want`'s.
fn assert_logprobs(traj: &GrpoTrajectory, want: &Value) {
    assert_table(
        "logprobs",
        &traj.rollout.logprobs,
        &get::<Vec<Vec<f32>>>(want, "logprobs"),
        2e-5,
    );
    assert_table(
        "ref_logprobs",
        &traj.rollout.ref_logprobs,
        &get::<Vec<Vec<f32>>>(want, "ref_logprobs"),
        2e-5,
    );
}

#[test]
fn trajectory_rewards_and_advantages_match_torchtune() {
    let g = golden();
    let s = settings(&g, false);
    let traj = build_trajectory(&g, &s);
    let want = &g["trajectory"];
    assert_logprobs(&traj, want);
    assert_eq!(
        traj.rollout.response_padding,
        get::<Vec<Vec<bool>>>(want, "response_padding")
    );
    assert_eq!(traj.rewards, get::<Vec<f32>>(want, "rewards"));
    assert_eq!(traj.successes, get::<Vec<f32>>(want, "successes"));
    let adv: Vec<f32> = get(want, "advantages");
    for (a, b) in traj.advantages.iter().zip(&adv) {
        assert!(
            (a - b).abs() < 1e-5,
            "advantages {:?} vs {adv:?}",
            traj.advantages
        );
    }
    // The fixture reaches every reward level.
    for level in [100.0, 20.0, 10.0] {
        assert!(traj.rewards.contains(&level), "{:?}", traj.rewards);
    }
}

#[test]
fn simple_loss_steps_match_torchtune() {
    check_steps(false, 6, false);
}

#[test]
fn clipped_loss_steps_match_torchtune() {
    check_steps(true, 6, false);
}

/// The batch through the model in parts (two rows, then one prompt's three) adds up to the
/// one-pass loss and gradient, with and without activation checkpointing.
#[test]
fn steps_in_parts_and_with_checkpointing_match_too() {
    check_steps(false, 2, true);
    check_steps(true, 3, false);
}

fn check_steps(clipped: bool, rows_per_pass: usize, checkpointing: bool) {
    let g = golden();
    let s = settings(&g, clipped);
    let name = if clipped { "clipped" } else { "simple" };
    let traj = build_trajectory(&g, &s);
    let mut policy = tiny_llama();
    let params = policy.make_all_trainable().unwrap();
    let steps = g[format!("steps_{name}")].as_array().unwrap().clone();
    let case = Case {
        name,
        rows_per_pass,
        checkpointing,
    };
    check_optimizer_steps(&g, &s, &case, &steps, &policy, &params, &traj);
    // The second step is the interesting one: the policy has moved from the reference.
    let kl: f64 = get(&steps[1], "kl_loss");
    assert!(kl > 1e-3, "fixture KL {kl}");
    if clipped {
        let clipfrac: f64 = get(&steps[1], "clipfrac");
        assert!(clipfrac > 0.1 && clipfrac < 0.9, "fixture clips {clipfrac}");
    }
}

/// Which fixture steps (`grads_{name}_epoch*`, `params_{name}_epoch*`) and how the batch goes
/// through the model.
struct Case {
    name: &'static str,
    rows_per_pass: usize,
    checkpointing: bool,
}

/// Takes the fixture's optimizer steps (`want`) on `traj` with AdamW and gradient clipping,
/// checking each step's statistics, gradients and updated parameters against torch's.
fn check_optimizer_steps(
    g: &Value,
    s: &GrpoSettings,
    case: &Case,
    want_steps: &[Value],
    policy: &CausalLm,
    params: &[(String, Var)],
    traj: &GrpoTrajectory,
) {
    let name = case.name;
    let rows_per_pass = case.rows_per_pass;
    let lr: f64 = get(g, "lr");
    let mut opt = AdamW::new(
        params.to_vec(),
        AdamWConfig {
            lr,
            ..AdamWConfig::default()
        },
    )
    .unwrap();
    let max_norm: f64 = get(g, "clip_grad_norm");
    for (e, want) in want_steps.iter().enumerate() {
        let epoch = e + 1;
        let what = format!("{name} epoch {epoch} (rows_per_pass {rows_per_pass})");
        let mut grads = empty_grads().unwrap();
        let stats = grpo::grpo_step(
            policy,
            traj,
            s,
            rows_per_pass,
            Backward {
                params,
                grads: &mut grads,
                checkpointing: case.checkpointing,
            },
        )
        .unwrap();
        close(&format!("{what} loss"), stats.loss, get(want, "loss"), 1e-5);
        close(
            &format!("{what} policy_loss"),
            stats.policy_loss,
            get(want, "policy_loss"),
            1e-5,
        );
        close(
            &format!("{what} kl_loss"),
            stats.value_or_kl_loss,
            get(want, "kl_loss"),
            1e-4,
        );
        close(
            &format!("{what} ratios"),
            stats.ratios,
            get(want, "ratios"),
            1e-5,
        );
        close(
            &format!("{what} clipfrac"),
            stats.clipfrac,
            get(want, "clipfrac"),
            1e-6,
        );
        close(
            &format!("{what} approx_policy_kl"),
            stats.approx_policy_kl,
            get(want, "approx_policy_kl"),
            1e-3,
        );
        let want_grads = load(workspace_fixture(&format!(
            "grpo/grads_{name}_epoch{epoch}.safetensors"
        )));
        assert!(
            !want_grads.is_empty(),
            "{what}: no gradients in the fixture"
        );
        for (pname, want_g) in &want_grads {
            let var: &Var = &params
                .iter()
                .find(|(n, _)| n == pname)
                .unwrap_or_else(|| panic!("no parameter {pname}"))
                .1;
            let got = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for {pname}"));
            let err = rel_l2(got, want_g);
            assert!(err < 1e-4, "{what} d loss / d {pname}: rel L2 {err}");
        }
        let norm = clip_grad_norm(
            &mut grads,
            params.iter().map(|(_, v)| v.as_tensor()),
            max_norm,
        )
        .unwrap();
        close(
            &format!("{what} grad_norm"),
            norm,
            get(want, "grad_norm"),
            1e-4,
        );
        opt.step(&grads).unwrap();
        let expected = load(workspace_fixture(&format!(
            "grpo/params_{name}_epoch{epoch}.safetensors"
        )));
        for (pname, want_t) in &expected {
            let var: &Var = &params.iter().find(|(n, _)| n == pname).unwrap().1;
            // Adam moves each entry by about lr: entries whose gradient is near Adam's eps are
            // sensitive to rounding, so the bound is a small fraction of lr.
            let d = ferrotune_testing::max_abs_diff(var.as_tensor(), want_t);
            assert!(
                (d as f64) < 5e-3 * lr,
                "{what} {pname}: max |diff| {d} from torch's AdamW step"
            );
        }
    }
}

/// LoRA: the PEFT adapter trained, the reference being the same model with its adapter disabled
/// (no second model), against PEFT + torchtune's GRPOSimpleLoss: the trajectory's log
/// probabilities of both, then two steps' losses, adapter gradients and AdamW updates.
#[test]
fn lora_steps_match_peft_with_the_adapter_disabled_as_reference() {
    let g = golden();
    let s = settings(&g, false);
    let want = &g["steps_lora"];
    let mut policy = tiny_llama();
    ferrotune_models::peft::load_adapter(&mut policy, &workspace_fixture("llama3/adapter"))
        .unwrap();
    ferrotune_models::lora::set_training(&mut policy, true);
    let params = ferrotune_models::peft::trainable_parameters(&mut policy).unwrap();
    let traj = trajectory_of(&g, &s, &mut policy.detached(), Reference::AdaptersDisabled);
    assert_logprobs(&traj, want);
    let steps = want["steps"].as_array().unwrap();
    let case = Case {
        name: "lora",
        rows_per_pass: 6,
        checkpointing: false,
    };
    check_optimizer_steps(&g, &s, &case, steps, &policy, &params, &traj);
    // The adapter makes the policy differ from its reference from the first step.
    let kl: f64 = get(&steps[0], "kl_loss");
    assert!(kl > 1e-4, "fixture KL {kl}");
}
