//! TRL's GRPO loss family against TRL's own `GRPOTrainer` (scripts/make_grpo_trl_fixtures.py,
//! trl 1.16.0): the tiny Llama, two prompts with three fixed completions each (injected, so
//! sampling does not enter), two reward functions weighted by `reward_weights`. For each case
//! (`loss_type` grpo, dr_grpo, dapo with β 0, bnpo, clip-higher, GSPO) ferrotune's log
//! probabilities, its advantages under the case's `scale_rewards`, then — with the same injected
//! sampling and reference log probabilities — the loss (≤ 1e-5 relative) and gradients (≤ 1e-4
//! relative L2) equal TRL's `_compute_loss`.

use candle_core::{DType, Device, Var};
use ferrotune_data::Tokenizer;
use ferrotune_models::load_model;
use ferrotune_train::grpo::{
    scaled_advantages, weighted_rewards, GrpoLossConfig, GrpoLossKind, ScaleRewards, TrlLoss,
    TrlLossType,
};
use ferrotune_train::recipe::grpo::{self, GrpoSettings, Reference};
use ferrotune_train::recipe::kit::rollout::{Backward, RolloutSettings};
use ferrotune_train::step::empty_grads;
use serde_json::Value;

use crate::common::{load, rel_l2, workspace_fixture};

fn golden() -> Value {
    let path = workspace_fixture("grpo_trl/golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn get<T: serde::de::DeserializeOwned>(g: &Value, key: &str) -> T {
    serde_json::from_value(g[key].clone()).unwrap_or_else(|e| panic!("golden {key}: {e}"))
}

/// The case's settings as the recipe parses TRL's keys.
fn settings(g: &Value, case: &Value) -> (GrpoSettings, ScaleRewards) {
    let st = &case["settings"];
    let epsilon = st["epsilon"].as_f64().unwrap();
    let trl = TrlLoss {
        loss_type: TrlLossType::parse(st["loss_type"].as_str().unwrap()).unwrap(),
        epsilon_low: epsilon,
        epsilon_high: st["epsilon_high"].as_f64().unwrap_or(epsilon),
        sequence_level: st["importance_sampling_level"] == "sequence",
        max_completion_length: get(g, "max_completion_length"),
        bias_correction_kl: true,
    };
    let scale = ScaleRewards::parse(&st["scale_rewards"]).unwrap();
    let s = GrpoSettings {
        grpo_samples: get(g, "grpo_samples"),
        rollout: RolloutSettings {
            temperature: get(g, "temperature"),
            top_k: None,
            max_generated_tokens: get(g, "max_completion_length"),
            stop_token_ids: vec![2],
            pad_id: 3,
        },
        loss: GrpoLossConfig {
            kind: GrpoLossKind::Trl(trl),
            kl_coeff: st["beta"].as_f64().unwrap(),
        },
    };
    (s, scale)
}

fn check_case(name: &str, rows_per_pass: usize) {
    let g = golden();
    let case = &g["cases"][name];
    let (s, scale) = settings(&g, case);
    let tok = Tokenizer::from_dir(workspace_fixture("llama3/model")).unwrap();
    let mut policy = load_model(&workspace_fixture("llama3/model"), DType::F32, &Device::Cpu)
        .unwrap()
        .0;
    let prompts: Vec<Vec<u32>> = get(&g, "prompts");
    let completions: Vec<Vec<u32>> = get(&g, "completions");
    let mut scored = grpo::rollout_of(
        &mut policy.detached(),
        Reference::None,
        &tok,
        &prompts,
        &completions,
        &s,
    )
    .unwrap();
    assert_eq!(scored.texts, get::<Vec<String>>(&g, "completion_texts"));
    // The current policy's log probabilities, then the injected old and reference tables.
    let keep: Vec<Vec<bool>> = scored
        .rollout
        .response_padding
        .iter()
        .map(|r| r.iter().map(|&p| !p).collect())
        .collect();
    let current: Vec<Vec<f32>> = get(case, "current_logprobs");
    for (r, row) in current.iter().enumerate() {
        for (i, &want) in row.iter().enumerate() {
            if keep[r][i] {
                let got = scored.rollout.logprobs[r][i];
                assert!(
                    (got - want).abs() < 2e-5,
                    "{name} logprob [{r}][{i}] {got} vs TRL {want}"
                );
            }
        }
    }
    let inject = |table: &mut Vec<Vec<f32>>, want: Vec<Vec<f32>>| {
        for (r, row) in want.iter().enumerate() {
            for (i, &w) in row.iter().enumerate() {
                if keep[r][i] {
                    table[r][i] = w;
                }
            }
        }
    };
    inject(&mut scored.rollout.logprobs, get(case, "old_logprobs"));
    inject(&mut scored.rollout.ref_logprobs, get(case, "ref_logprobs"));
    // TRL's weighted sum of the two functions' rewards, and its advantages.
    let per_func: Vec<Vec<f32>> = get(&g, "rewards_per_func");
    let weights: Vec<f32> = get(&g, "reward_weights");
    let rewards = weighted_rewards(&per_func, &weights);
    let want_adv: Vec<f32> = get(case, "advantages");
    let adv = scaled_advantages(&rewards, s.grpo_samples, scale).unwrap();
    for (a, b) in adv.iter().zip(&want_adv) {
        assert!(
            (a - b).abs() < 1e-5,
            "{name} advantages {adv:?} vs TRL {want_adv:?}"
        );
    }
    let traj = scored
        .into_trajectory(rewards, vec![0.0; adv.len()], s.grpo_samples, scale)
        .unwrap();
    assert_eq!(traj.num_items, get::<f64>(case, "num_items_in_batch"));

    let params = policy.make_all_trainable().unwrap();
    let mut grads = empty_grads().unwrap();
    let stats = grpo::grpo_step(
        &policy,
        &traj,
        &s,
        rows_per_pass,
        Backward {
            params: &params,
            grads: &mut grads,
            checkpointing: false,
        },
    )
    .unwrap();
    let want_loss: f64 = get(case, "loss");
    assert!(
        (stats.loss - want_loss).abs() <= 1e-5 * want_loss.abs(),
        "{name} loss {} vs TRL {want_loss}",
        stats.loss
    );
    let want_grads = load(workspace_fixture(&format!(
        "grpo_trl/grads_{name}.safetensors"
    )));
    assert!(!want_grads.is_empty());
    for (pname, want_g) in &want_grads {
        let var: &Var = &params.iter().find(|(n, _)| n == pname).unwrap().1;
        let got = grads.get(var.as_tensor()).unwrap();
        let err = rel_l2(got, want_g);
        assert!(err < 1e-4, "{name} d loss / d {pname}: rel L2 {err}");
    }
    // The injected tables make the ratios move: some tokens are clipped.
    if !s.loss.kind.eq(&GrpoLossKind::Simple) {
        assert!(stats.clipfrac > 0.0, "{name}: nothing clipped");
    }
}

#[test]
fn trl_grpo_loss_matches_trl() {
    check_case("grpo", 6);
}

#[test]
fn trl_dr_grpo_loss_matches_trl() {
    check_case("dr_grpo", 6);
}

/// TRL's default: DAPO, with β 0 (no reference pass, no KL term).
#[test]
fn trl_dapo_loss_without_reference_matches_trl() {
    check_case("dapo", 6);
}

#[test]
fn trl_bnpo_loss_with_batch_scaled_rewards_matches_trl() {
    check_case("bnpo", 6);
}

/// `epsilon_high` (DAPO's clip-higher), the batch in parts of two rows.
#[test]
fn trl_clip_higher_matches_trl_in_parts() {
    check_case("clip_higher", 2);
}

/// `importance_sampling_level: sequence` (GSPO), in parts of three rows.
#[test]
fn trl_gspo_sequence_level_matches_trl() {
    check_case("gspo", 3);
}

/// The built-in `dev/3B_full_grpo` with `overrides`, checked as `validate` checks it.
fn check(overrides: &[&str]) -> Result<(), String> {
    let mut cfg = ferrotune_train::config::load("dev/3B_full_grpo").unwrap();
    let o: Vec<String> = overrides.iter().map(|s| s.to_string()).collect();
    cfg.apply_overrides(&o).unwrap();
    cfg.resolve().unwrap();
    grpo::check_config(&cfg).map_err(|e| e.to_string())
}

/// TRL's keys are read under TRL's names and checked; torchtune's config is unchanged.
#[test]
fn trl_keys_parse_and_are_checked() {
    check(&[]).unwrap();
    let trl = [
        "~loss._component_",
        "~loss.kl_coeff",
        "loss.loss_type=dapo",
        "loss.epsilon_high=0.28",
        "loss.importance_sampling_level=sequence",
        "scale_rewards=batch",
        "num_iterations=2",
        "~ppo_epochs",
    ];
    check(&trl).unwrap();
    // β 0 (TRL's default) needs no reference; β > 0 does.
    check(&[&trl[..], &["~ref_checkpointer"]].concat()).unwrap();
    let e = check(&[&trl[..], &["~ref_checkpointer", "loss.beta=0.04"]].concat()).unwrap_err();
    assert!(e.contains("ref_checkpointer"), "{e}");
    for (bad, says) in [
        (
            "loss.loss_type=grpo2",
            "expected grpo, dr_grpo, dapo or bnpo",
        ),
        (
            "loss.importance_sampling_level=row",
            "expected token or sequence",
        ),
        ("scale_rewards=sometimes", "expected group, batch or none"),
        ("loss.kl_coeff=0.1", "take beta"),
        ("ppo_epochs=3", "num_iterations (2) and ppo_epochs differ"),
    ] {
        let e = check(&[&trl[..], &[bad]].concat()).unwrap_err();
        assert!(e.contains(says), "{bad}: {e}");
    }
    // TRL's keys without loss_type, and both selectors at once.
    let e = check(&["loss.beta=0.1"]).unwrap_err();
    assert!(e.contains("set loss.loss_type"), "{e}");
    let e = check(&["loss.loss_type=dapo", "~loss.kl_coeff"]).unwrap_err();
    assert!(e.contains("keep one"), "{e}");
    // TRL's boolean forms of scale_rewards.
    check(&["scale_rewards=false"]).unwrap();
    // TRL's names for the group size and the completion length.
    check(&[
        "~grpo_samples",
        "num_generations=8",
        "~max_generated_tokens",
        "max_completion_length=64",
    ])
    .unwrap();
    let e = check(&["num_generations=8"]).unwrap_err();
    assert!(
        e.contains("grpo_samples (16) and num_generations (8) differ"),
        "{e}"
    );
}

/// With one iteration a batch (TRL's `num_iterations: 1`) the loss takes the current log
/// probabilities, detached, as the sampling policy's, as TRL does: every ratio is exactly 1, so
/// nothing clips, even where the sampling pass's log probabilities differ in their last bits.
#[test]
fn one_iteration_takes_the_current_policy_as_the_sampling_one() {
    let g = golden();
    let (s, scale) = settings(&g, &g["cases"]["clip_higher"]);
    let tok = Tokenizer::from_dir(workspace_fixture("llama3/model")).unwrap();
    let mut policy = load_model(&workspace_fixture("llama3/model"), DType::F32, &Device::Cpu)
        .unwrap()
        .0;
    let mut scored = grpo::rollout_of(
        &mut policy.detached(),
        Reference::None,
        &tok,
        &get::<Vec<Vec<u32>>>(&g, "prompts"),
        &get::<Vec<Vec<u32>>>(&g, "completions"),
        &s,
    )
    .unwrap();
    // Sampling log probabilities far from the current ones: ignored.
    for row in &mut scored.rollout.logprobs {
        for x in row.iter_mut() {
            *x -= 1.0;
        }
    }
    let rewards = weighted_rewards(
        &get::<Vec<Vec<f32>>>(&g, "rewards_per_func"),
        &get::<Vec<f32>>(&g, "reward_weights"),
    );
    let mut traj = scored
        .into_trajectory(rewards, vec![0.0; 6], s.grpo_samples, scale)
        .unwrap();
    traj.old_is_current = true;
    let params = policy.make_all_trainable().unwrap();
    let mut grads = empty_grads().unwrap();
    let back = Backward {
        params: &params,
        grads: &mut grads,
        checkpointing: false,
    };
    let stats = grpo::grpo_step(&policy, &traj, &s, 6, back).unwrap();
    assert_eq!((stats.ratios, stats.clipfrac), (1.0, 0.0));
}
