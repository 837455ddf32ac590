//! `validate --recipe NAME` refuses what `ferrotune run NAME` refuses in the recipe's own
//! settings, with run's message, for the recipes beside fine-tuning (the fine-tuning recipes'
//! are `recipes.rs`'s `validate_refuses_what_run_refuses`).

use crate::common;

use common::{ferrotune, text, tmpdir};

/// Runs recipe `recipe` on the config `yaml` (written into a fresh folder named after `case`)
/// and checks that it fails with an error that `validate` gives too, with `--recipe` and, when
/// the config's sections name the recipe (`inferred`), without it. Returns run's message.
fn validate_says_what_run_says(case: &str, recipe: &str, yaml: &str, inferred: bool) -> String {
    let dir = tmpdir("recipe-checks", case);
    let path = dir.join("bad.yaml");
    std::fs::write(&path, yaml).unwrap();
    let path = path.to_str().unwrap();
    let run = ferrotune(&["run", recipe, "--config", path], &dir, &[]);
    assert_eq!(run.status.code(), Some(1), "{case}: {}", text(&run));
    let run_text = text(&run);
    let message = run_text
        .lines()
        .find_map(|l| l.strip_prefix("error: "))
        .unwrap_or_else(|| panic!("{case}: no error line in {run_text}"))
        .to_string();
    let mut calls = vec![vec!["validate", path, "--recipe", recipe]];
    if inferred {
        calls.push(vec!["validate", path]);
    }
    for args in calls {
        let out = ferrotune(&args, &dir, &[]);
        assert_eq!(out.status.code(), Some(1), "{case}: {}", text(&out));
        assert!(
            text(&out).contains(&message),
            "{case}: validate should say '{message}': {}",
            text(&out)
        );
    }
    message
}

#[test]
fn validate_refuses_generate_settings() {
    for recipe in ["generate", "dev/generate_v2", "dev/generate_v2_distributed"] {
        let case = recipe.replace('/', "_");
        let message = validate_says_what_run_says(
            &case,
            recipe,
            "device: cpu\ncheckpointer:\n  checkpoint_dir: nowhere\nprompt: [1, 2]\n",
            false,
        );
        assert!(message.contains("'prompt' must be a string"), "{message}");
    }
}

#[test]
fn validate_refuses_eval_settings() {
    let message = validate_says_what_run_says(
        "eval",
        "eval",
        "device: cpu\ncheckpointer:\n  checkpoint_dir: nowhere\nbatch_size: -2\n",
        false,
    );
    assert!(message.contains("batch_size"), "{message}");
}

#[test]
fn validate_refuses_eleuther_eval_settings() {
    let message = validate_says_what_run_says(
        "eleuther_eval",
        "eleuther_eval",
        "device: cpu\ncheckpointer:\n  checkpoint_dir: nowhere\ntasks: [truthfulqa_mc2]\n\
         limit: 0\n",
        false,
    );
    assert!(message.contains("limit must be positive"), "{message}");
}

#[test]
fn validate_refuses_quantize_settings() {
    let message = validate_says_what_run_says(
        "quantize",
        "quantize",
        "output_dir: out\ndevice: cpu\ncheckpointer:\n  checkpoint_dir: nowhere\nquantizer:\n  \
         _component_: torchtune.training.quantization.Int8DynActInt4WeightQuantizer\n  \
         groupsize: 1\n",
        false,
    );
    assert!(
        message.contains("groupsize must be at least 2"),
        "{message}"
    );
}

#[test]
fn validate_refuses_ppo_settings() {
    let message = validate_says_what_run_says(
        "ppo",
        "ppo_full_finetune_single_device",
        "output_dir: out\ndevice: cpu\nreward_and_value_model:\n  \
         _component_: torchtune.models.llama2.llama2_reward_7b\nbatch_size: 2\nnum_steps: 4\n\
         max_generated_tokens: 8\ntemperature: 0\n",
        true,
    );
    assert!(
        message.contains("temperature must be positive"),
        "{message}"
    );
}

#[test]
fn validate_refuses_grpo_settings() {
    let message = validate_says_what_run_says(
        "grpo",
        "dev/grpo_full_finetune_distributed",
        "output_dir: out\ndevice: cpu\nbatch_size: 2\nnum_steps: 4\nepochs: 1\n\
         grpo_samples: 1\nmax_generated_tokens: 8\n",
        true,
    );
    assert!(
        message.contains("grpo_samples must be at least 2"),
        "{message}"
    );
}
