//! PPO against torchtune's `rlhf` functions and `PPOLoss` on transformers models
//! (scripts/make_ppo_fixtures.py): the tiny Llama as policy and reference, a tiny Llama sequence
//! classifier as reward model and starting value model, four left-padded prompts with fixed
//! responses. Checked: every field of the trajectory, rewards, KL, advantages and returns, then
//! two PPO epochs with one AdamW over both models (the whole batch, then two accumulated
//! micro-batches): their statistics and the parameters after each.

use candle_core::{DType, Device, Var};
use ferrotune_models::load_model;
use ferrotune_train::optim::{AdamW, AdamWConfig, Optimizer};
use ferrotune_train::recipe::kit::rollout::{Backward, Rollout, RolloutSettings};
use ferrotune_train::recipe::ppo::{self, PpoModels, PpoSettings, PpoStats, Trajectory};
use ferrotune_train::rlhf::{self, PpoLossConfig};
use ferrotune_train::step::empty_grads;
use serde_json::Value;

use crate::common;
use common::{load, rel_l2, workspace_fixture};

fn golden() -> Value {
    let path = workspace_fixture("ppo/golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn get<T: serde::de::DeserializeOwned>(g: &Value, key: &str) -> T {
    serde_json::from_value(g[key].clone()).unwrap_or_else(|e| panic!("golden {key}: {e}"))
}

fn settings(g: &Value) -> PpoSettings {
    PpoSettings {
        rollout: RolloutSettings {
            temperature: get(g, "temperature"),
            top_k: None,
            max_generated_tokens: get(g, "max_generated_tokens"),
            stop_token_ids: get(g, "stop_token_ids"),
            pad_id: get(g, "pad_id"),
        },
        min_response_length: Some(get(g, "min_response_length")),
        penalise_no_eos: true,
        reward_penalty: get(g, "reward_penalty"),
        kl_coeff: get(g, "kl_coeff"),
        gamma: get(g, "gamma"),
        lmbda: get(g, "lmbda"),
        loss: PpoLossConfig {
            epsilon: get(g, "epsilon"),
            value_clip_range: get(g, "value_clip_range"),
            value_coeff: get(g, "value_coeff"),
        },
    }
}

/// Largest absolute difference between two `[rows][tokens]` tables.
fn max_diff(what: &str, got: &[Vec<f32>], want: &[Vec<f32>]) -> f32 {
    assert_eq!(got.len(), want.len(), "{what}: rows");
    let mut worst = 0f32;
    for (a, b) in got.iter().zip(want) {
        assert_eq!(a.len(), b.len(), "{what}: row length");
        for (x, y) in a.iter().zip(b) {
            worst = worst.max((x - y).abs());
        }
    }
    worst
}

fn assert_table(what: &str, got: &[Vec<f32>], want: &[Vec<f32>], tol: f32) {
    let d = max_diff(what, got, want);
    assert!(
        d <= tol,
        "{what}: max |diff| {d} > {tol}\n got {got:?}\nwant {want:?}"
    );
}

fn close(what: &str, got: f64, want: f64, tol: f64) {
    assert!(
        (got - want).abs() <= tol * want.abs().max(1.0),
        "{what}: {got} vs torch {want}"
    );
}

#[test]
fn trajectory_rewards_and_advantages_match_torchtune() {
    let g = golden();
    let s = settings(&g);
    let dev = Device::Cpu;
    let (policy, _) = load_model(&workspace_fixture("llama3/model"), DType::F32, &dev).unwrap();
    let (reward, _) = load_model(&workspace_fixture("ppo/reward"), DType::F32, &dev).unwrap();
    assert_eq!(reward.config.score_labels, Some(1));
    assert_eq!(reward.head_name(), "score");
    let prompts: Vec<Vec<u32>> = get(&g, "prompts");
    let responses: Vec<Vec<u32>> = get(&g, "responses");
    let padded = ferrotune_train::recipe::kit::rollout::left_pad(&prompts, s.rollout.pad_id);
    let models = PpoModels {
        policy: &policy,
        reference: &policy,
        value: &reward,
        reward: &reward,
    };
    let t = ppo::trajectory(models, &padded, &responses, &s).unwrap();

    let qr: Vec<Vec<u32>> = get(&g, "query_responses");
    assert_eq!(t.rollout.query_responses, qr);
    assert_eq!(
        t.rollout.response_padding,
        get::<Vec<Vec<bool>>>(&g, "response_padding")
    );
    assert_eq!(t.value_padding, get::<Vec<Vec<bool>>>(&g, "value_padding"));
    assert_eq!(t.rollout.seq_lens, get::<Vec<usize>>(&g, "seq_lens"));
    assert_eq!(t.value_seq_idxs, get::<Vec<usize>>(&g, "value_seq_idxs"));
    assert_table(
        "logprobs",
        &t.rollout.logprobs,
        &get::<Vec<Vec<f32>>>(&g, "logprobs"),
        2e-5,
    );
    assert_table(
        "ref_logprobs",
        &t.rollout.ref_logprobs,
        &get::<Vec<Vec<f32>>>(&g, "ref_logprobs"),
        2e-5,
    );
    assert_table(
        "values",
        &t.values,
        &get::<Vec<Vec<f32>>>(&g, "values"),
        2e-5,
    );
    let scores: Vec<f32> = get(&g, "scores");
    assert_table("scores", std::slice::from_ref(&t.scores), &[scores], 2e-5);

    let (rewards, kl, kl_rewards) = rlhf::rewards_ppo(
        &t.scores,
        &t.rollout.logprobs,
        &t.rollout.ref_logprobs,
        s.kl_coeff,
        &t.value_seq_idxs,
    );
    assert_table(
        "rewards",
        &rewards,
        &get::<Vec<Vec<f32>>>(&g, "rewards"),
        2e-5,
    );
    assert_table("kl", &kl, &get::<Vec<Vec<f32>>>(&g, "kl"), 2e-5);
    assert_table(
        "kl_rewards",
        &kl_rewards,
        &get::<Vec<Vec<f32>>>(&g, "kl_rewards"),
        2e-6,
    );
    let keep = rlhf::kept(&t.rollout.response_padding);
    let (adv, ret) = rlhf::estimate_advantages(&t.values, &rewards, s.gamma, s.lmbda, &keep);
    assert_table(
        "advantages",
        &adv,
        &get::<Vec<Vec<f32>>>(&g, "advantages"),
        5e-5,
    );
    assert_table("returns", &ret, &get::<Vec<Vec<f32>>>(&g, "returns"), 5e-5);
}

/// The trajectory exactly as torch recorded it: the PPO epochs start from the same numbers.
fn golden_trajectory(g: &Value) -> Trajectory {
    let prompts: Vec<Vec<u32>> = get(g, "prompts");
    Trajectory {
        rollout: Rollout {
            query_responses: get(g, "query_responses"),
            context_length: prompts.iter().map(Vec::len).max().unwrap(),
            logprobs: get(g, "logprobs"),
            ref_logprobs: get(g, "ref_logprobs"),
            response_padding: get(g, "response_padding"),
            seq_lens: get(g, "seq_lens"),
        },
        values: get(g, "values"),
        value_padding: get(g, "value_padding"),
        value_seq_idxs: get(g, "value_seq_idxs"),
        scores: get(g, "scores"),
    }
}

#[test]
fn ppo_epochs_match_torchtune_losses_and_updates() {
    check_ppo_epochs(false);
}

/// The same with each decoder layer recomputed in the backward (`enable_activation_checkpointing`).
#[test]
fn ppo_epochs_with_activation_checkpointing_match_too() {
    check_ppo_epochs(true);
}

fn check_ppo_epochs(checkpointing: bool) {
    let g = golden();
    let s = settings(&g);
    let dev = Device::Cpu;
    let (mut policy, _) = load_model(&workspace_fixture("llama3/model"), DType::F32, &dev).unwrap();
    let (mut value, _) = load_model(&workspace_fixture("ppo/reward"), DType::F32, &dev).unwrap();
    let mut params = policy.make_all_trainable().unwrap();
    params.extend(
        value
            .make_all_trainable()
            .unwrap()
            .into_iter()
            .map(|(n, v)| (format!("value.{n}"), v)),
    );
    assert!(params.iter().any(|(n, _)| n == "value.score.weight"));
    let lr: f64 = get(&g, "lr");
    let mut opt = AdamW::new(
        params.clone(),
        AdamWConfig {
            lr,
            ..AdamWConfig::default()
        },
    )
    .unwrap();
    let traj = golden_trajectory(&g);
    let advantages: Vec<Vec<f32>> = get(&g, "advantages");
    let returns: Vec<Vec<f32>> = get(&g, "returns");
    let epochs = g["epochs"].as_array().unwrap();
    for (e, want) in epochs.iter().enumerate() {
        let groups: Vec<Vec<usize>> = get(want, "groups");
        let mut grads = empty_grads().unwrap();
        let mut stats = PpoStats::default();
        for rows in &groups {
            let part = traj.select(rows);
            let pick = |m: &[Vec<f32>]| rows.iter().map(|&i| m[i].clone()).collect::<Vec<_>>();
            stats += ppo::ppo_step(
                &policy,
                &value,
                &part,
                &pick(&advantages),
                &pick(&returns),
                &s,
                groups.len(),
                Backward {
                    params: &params,
                    grads: &mut grads,
                    checkpointing,
                },
            )
            .unwrap();
        }
        let epoch = e + 1;
        // Adam's first step moves by the gradient's sign: the gradients themselves are compared.
        let want_grads = load(workspace_fixture(&format!(
            "ppo/grads_epoch{epoch}.safetensors"
        )));
        for (name, want_g) in &want_grads {
            let var: &Var = &params.iter().find(|(n, _)| n == name).unwrap().1;
            let got = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for {name}"));
            let err = rel_l2(got, want_g);
            assert!(err < 1e-4, "epoch {epoch} d loss / d {name}: rel L2 {err}");
        }
        opt.step(&grads).unwrap();
        close(
            &format!("epoch {epoch} loss"),
            stats.loss,
            get(want, "loss"),
            1e-5,
        );
        close(
            &format!("epoch {epoch} policy_loss"),
            stats.policy_loss,
            get(want, "policy_loss"),
            1e-5,
        );
        close(
            &format!("epoch {epoch} value_loss"),
            stats.value_or_kl_loss,
            get(want, "value_loss"),
            1e-5,
        );
        close(
            &format!("epoch {epoch} ratios"),
            stats.ratios,
            get(want, "ratios"),
            1e-5,
        );
        close(
            &format!("epoch {epoch} clipfrac"),
            stats.clipfrac,
            get(want, "clipfrac"),
            1e-6,
        );
        close(
            &format!("epoch {epoch} approx_policy_kl"),
            stats.approx_policy_kl,
            get(want, "approx_policy_kl"),
            1e-3,
        );
        let expected = load(workspace_fixture(&format!(
            "ppo/params_epoch{epoch}.safetensors"
        )));
        for (name, want_t) in &expected {
            let var: &Var = &params.iter().find(|(n, _)| n == name).unwrap().1;
            // The update is lr-sized: compare the change from the start, not just the weights.
            let d = ferrotune_testing::max_abs_diff(var.as_tensor(), want_t);
            assert!(
                d < 2e-6,
                "epoch {epoch} {name}: max |diff| {d} from torch's AdamW step"
            );
        }
    }
    // The second epoch is the interesting one: some ratios clipped, not all.
    let clipfrac: f64 = get(&epochs[1], "clipfrac");
    assert!(clipfrac > 0.1 && clipfrac < 0.9, "fixture clips {clipfrac}");
}

#[test]
fn detached_copy_follows_trained_weights_without_recording_gradients() {
    use ferrotune_models::AttentionLayout;
    let dev = Device::Cpu;
    let (mut model, _) = load_model(&workspace_fixture("llama3/model"), DType::F32, &dev).unwrap();
    let params = model.make_all_trainable().unwrap();
    let copy = model.detached();
    let ids = candle_core::Tensor::new(&[[40u32, 41, 42]], &dev).unwrap();
    let layout = AttentionLayout::causal(1, 3, 0);
    let tracked = model.forward(&ids, &layout, None).unwrap();
    let plain = copy.forward(&ids, &layout, None).unwrap();
    assert!(tracked.track_op() && !plain.track_op());
    assert_eq!(ferrotune_testing::max_abs_diff(&tracked, &plain), 0.0);
    // The optimizer writes parameters in place: the copy sees the new values.
    let (name, var) = &params[0];
    assert_eq!(name, "model.embed_tokens.weight");
    var.set(&(var.as_tensor().detach() * 2.0).unwrap()).unwrap();
    let d = ferrotune_testing::max_abs_diff(&copy.embed_tokens, var.as_tensor());
    assert_eq!(d, 0.0);
    let moved = copy.forward(&ids, &layout, None).unwrap();
    assert!(ferrotune_testing::max_abs_diff(&moved, &plain) > 0.0);
}
