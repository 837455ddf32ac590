//! Reward models below the recipes: TRL's reward loss and pooling (`ferrotune_train::reward_model`)
//! and a reward model as a GRPO reward function (`reward_funcs: [{model: FOLDER}]`), scoring as
//! TRL's `GRPOTrainer` scores with a sequence classifier (scripts/make_reward_model_fixtures.py).

use ferrotune_testing::fixtures;
use ferrotune_train::reward::{RewardBatch, RewardSet, RewardSpec};
use serde_json::{json, Value};

fn golden() -> Value {
    let path = fixtures().join("reward_model/golden.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The tiny Llama classifier as a GRPO reward function gives transformers' rewards of
/// `prompt + completion` (right-padded, the score at the last token that is not the pad id), and
/// weighs into the total like any function.
#[test]
fn a_reward_model_scores_grpo_completions_as_trl() {
    let g = &golden()["grpo"];
    let model = fixtures().join("ppo/reward");
    let mut cfg = ferrotune_train::config::load("dev/3B_full_grpo").unwrap();
    let funcs = json!([{"model": model.display().to_string(), "name": "rm"}]);
    cfg.apply_overrides(&[
        format!("reward_funcs={funcs}"),
        "reward_weights=[2.0]".into(),
    ])
    .unwrap();
    let spec = RewardSpec::parse(&cfg, 8).unwrap();
    let mut set = RewardSet::start(&spec, std::path::Path::new("."), 8, 3).unwrap();
    let prompts: Vec<String> = serde_json::from_value(g["prompts"].clone()).unwrap();
    let completions: Vec<String> = serde_json::from_value(g["completions"].clone()).unwrap();
    let n = prompts.len();
    let batch = RewardBatch {
        prompts: prompts.iter().map(|p| json!(p)).collect(),
        completions,
        completion_ids: vec![vec![]; n],
        answers: vec![String::new(); n],
        columns: vec![serde_json::Map::new(); n],
    };
    let scores = set.score(&batch).unwrap();
    let want: Vec<f32> = serde_json::from_value(g["rewards"].clone()).unwrap();
    for (i, (got, w)) in scores.per_func[0].iter().zip(&want).enumerate() {
        assert!(
            (got - w).abs() <= 1e-5 * w.abs() + 1e-6,
            "row {i}: {got} vs {w}"
        );
        assert!((scores.total[i] - 2.0 * w).abs() <= 1e-5 * w.abs() + 1e-6);
    }
}

/// A folder that is not a classifier is refused when the rewards start, naming it.
#[test]
fn a_causal_lm_is_not_a_reward_model() {
    let model = fixtures().join("llama3/model");
    let mut cfg = ferrotune_train::config::load("dev/3B_full_grpo").unwrap();
    let funcs = json!([{"model": model.display().to_string()}]);
    cfg.apply_overrides(&[format!("reward_funcs={funcs}")])
        .unwrap();
    let spec = RewardSpec::parse(&cfg, 8).unwrap();
    let err = RewardSet::start(&spec, std::path::Path::new("."), 8, 3)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("not a sequence classifier"), "{err}");
}

/// A reward model's `dtype` (and `device`) are checked with the entry, before anything loads.
#[test]
fn a_reward_model_entry_checks_its_dtype() {
    let mut cfg = ferrotune_train::config::load("dev/3B_full_grpo").unwrap();
    let funcs = json!([{"model": "anywhere", "dtype": "fp64x"}]);
    cfg.apply_overrides(&[format!("reward_funcs={funcs}")])
        .unwrap();
    let err = RewardSpec::parse(&cfg, 8).expect_err("refused").to_string();
    assert!(
        err.contains("reward_funcs[0]: dtype: unknown dtype"),
        "{err}"
    );
}
