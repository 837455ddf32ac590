//! `ferrotune run ppo_full_finetune_single_device` end to end on the tiny Llama (policy) and the
//! tiny Llama classifier (reward and value model): the run logs torchtune's PPO metrics at each
//! step, saves the policy and the value model as HF folders that load back (the value model still
//! a classifier, trained), and a run killed after its first epoch's checkpoint resumes to the same
//! weights as an uninterrupted run.

use crate::common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use common::{ferrotune, fixtures, load, metrics_lines, run_recipe, text, tmpdir};

pub(crate) fn write_config(dir: &Path) -> PathBuf {
    let prompts: Vec<String> = [
        "the cat sat",
        "a dog ran home",
        "we like tea",
        "it was late at night",
        "one two three",
        "red and blue",
        "she said hello",
        "time to go",
    ]
    .iter()
    .map(|p| serde_json::json!({ "prompt": p }).to_string())
    .collect();
    std::fs::write(dir.join("prompts.jsonl"), prompts.join("\n") + "\n").unwrap();
    let f = fixtures();
    let policy = f.join("llama3/model");
    let reward = f.join("ppo/reward");
    let yaml = format!(
        r#"output_dir: {out}
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: {policy}/tokenizer.json
  max_seq_len: 16
dataset:
  _component_: torchtune.datasets.text_completion_dataset
  source: json
  data_files: prompts.jsonl
  split: train
  column: prompt
  add_eos: false
policy_model:
  _component_: torchtune.models.llama3_2.llama3_2_1b
reward_and_value_model:
  _component_: torchtune.models.mistral._component_builders.mistral_classifier
  num_classes: 1
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {policy}
  output_dir: ${{output_dir}}
ref_policy_checkpointer:
  checkpoint_dir: {policy}
value_checkpointer:
  checkpoint_dir: {reward}
  output_dir: ${{output_dir}}/value
reward_checkpointer:
  checkpoint_dir: {reward}
resume_from_checkpoint: false
seed: 5
shuffle: true
device: cpu
dtype: fp32
batch_size: 4
num_steps: 12
ppo_epochs: 2
ppo_batch_size: 2
forward_batch_size: 2
gradient_accumulation_steps: 2
optimizer:
  _component_: torch.optim.AdamW
  lr: 1e-4
max_generated_tokens: 5
temperature: 0.7
top_k: null
min_response_length: 1
penalise_no_eos: false
reward_penalty: -3
stop_token_ids: [2]
whiten_rewards: false
gamma: 1
lmbda: 0.95
loss:
  _component_: torchtune.rlhf.loss.PPOLoss
  epsilon: 0.2
  value_coeff: 0.1
  value_clip_range: 0.2
kl_coeff: 0.01
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${{output_dir}}/logs
log_every_n_steps: 1
"#,
        out = dir.join("out").display(),
        policy = policy.display(),
        reward = reward.display(),
    );
    let path = dir.join("ppo.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

fn run(
    dir: &Path,
    cfg: &Path,
    out: &Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> std::process::Output {
    run_recipe("ppo_full_finetune_single_device", cfg, out, extra, dir, env)
}

#[test]
fn ppo_runs_saves_both_models_and_resumes_exactly() {
    let dir = tmpdir("ppo", "run");
    let cfg = write_config(&dir);
    let out = dir.join("full");
    let o = run(&dir, &cfg, &out, &[], &[]);
    let log = text(&o);
    assert!(o.status.success(), "{log}");

    // 8 prompts in batches of 4: 2 steps an epoch, 12 // 4 = 3 steps, so 2 epochs. Each step
    // takes 2 PPO epochs × 2 minibatches = 4 optimizer steps (the logged step).
    let lines = metrics_lines(&out.join("logs/metrics.jsonl"));
    assert_eq!(lines.len(), 3, "{log}");
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, vec![4, 8, 12]);
    for l in &lines {
        for key in [
            "scores",
            "num_stop_tokens",
            "rlhf_reward",
            "kl",
            "kl_reward",
            "loss",
            "policy_loss",
            "value_loss",
            "clipfrac",
            "ratios",
            "approx_policy_kl",
            "response_lengths",
            "tokens_per_second_per_gpu_trajectory",
            "tokens_per_second_per_gpu_ppo",
        ] {
            let v = l[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{key} missing in {l}"));
            assert!(v.is_finite(), "{key} = {v}");
        }
        // Responses are 5 tokens: the last kept index is at most 4.
        assert!(l["response_lengths"].as_f64().unwrap() <= 4.0);
        // rlhf_reward = scores + kl_reward, as torchtune logs it.
        let sum = l["scores"].as_f64().unwrap() + l["kl_reward"].as_f64().unwrap();
        assert!((l["rlhf_reward"].as_f64().unwrap() - sum).abs() < 1e-4);
    }
    // The first PPO epoch of the first step starts at the trajectory's own policy: ratio 1, no
    // KL between old and new, but the average over the step includes the second epoch.
    assert!(lines[0]["ratios"].as_f64().unwrap() > 0.5);

    // Both models saved per epoch, as HF folders that load: the policy a causal LM, the value
    // model still a one-label classifier, and both trained.
    for epoch in ["epoch_0", "epoch_1"] {
        assert!(
            out.join(epoch).join("model.safetensors").is_file(),
            "{epoch}"
        );
        assert!(out
            .join("value")
            .join(epoch)
            .join("model.safetensors")
            .is_file());
    }
    let dev = Device::Cpu;
    let (value, _) =
        ferrotune_models::load_model(&out.join("value/epoch_1"), DType::F32, &dev).unwrap();
    assert_eq!(value.config.score_labels, Some(1));
    let saved_value = load(&out.join("value/epoch_1/model.safetensors"));
    let start_value = load(&fixtures().join("ppo/reward/model.safetensors"));
    assert!(!saved_value.contains_key("lm_head.weight"));
    let diff = ferrotune_testing::max_abs_diff;
    assert!(diff(&saved_value["score.weight"], &start_value["score.weight"]) > 0.0);
    let saved_policy = load(&out.join("epoch_1/model.safetensors"));
    let start_policy = load(&fixtures().join("llama3/model/model.safetensors"));
    let q = "model.layers.0.self_attn.q_proj.weight";
    assert!(diff(&saved_policy[q], &start_policy[q]) > 0.0);
    assert!(out.join("epoch_1/tokenizer.json").is_file());

    // Killed right after the first epoch's checkpoint (PPO step 8), then resumed.
    let resumed = dir.join("resumed");
    let killed = run(
        &dir,
        &cfg,
        &resumed,
        &[],
        &[("FERROTUNE_KILL_AFTER_STEP", "8")],
    );
    assert!(!killed.status.success(), "the run was not killed");
    assert!(resumed.join("epoch_0").is_dir() && !resumed.join("epoch_1").exists());
    let o = run(&dir, &cfg, &resumed, &["resume_from_checkpoint=true"], &[]);
    assert!(o.status.success(), "{}", text(&o));
    for file in [
        "epoch_1/model.safetensors",
        "value/epoch_1/model.safetensors",
    ] {
        let (a, b) = (load(&out.join(file)), load(&resumed.join(file)));
        for (name, t) in &a {
            assert_eq!(
                diff(t, &b[name]),
                0.0,
                "{file} {name} differs after resuming"
            );
        }
    }
    let resumed_lines = metrics_lines(&resumed.join("logs/metrics.jsonl"));
    assert_eq!(resumed_lines.len(), 3);
    assert_eq!(
        resumed_lines[2]["loss"].as_f64(),
        lines[2]["loss"].as_f64(),
        "the resumed step logs the same loss"
    );
}

#[test]
fn ppo_refuses_a_causal_lm_as_reward_model() {
    let dir = tmpdir("ppo", "bad-reward");
    let cfg = write_config(&dir);
    let policy = fixtures().join("llama3/model");
    let o = run(
        &dir,
        &cfg,
        &dir.join("out"),
        &[&format!(
            "reward_checkpointer.checkpoint_dir={}",
            policy.display()
        )],
        &[],
    );
    let log = text(&o);
    assert!(!o.status.success());
    assert!(
        log.contains("reward_checkpointer") && log.contains("is not a reward model"),
        "{log}"
    );
    // And the other way round: a reward model is no policy, and no model to generate with.
    let reward = fixtures().join("ppo/reward");
    let o = run(
        &dir,
        &cfg,
        &dir.join("out1"),
        &[
            &format!("checkpointer.checkpoint_dir={}", reward.display()),
            &format!(
                "ref_policy_checkpointer.checkpoint_dir={}",
                reward.display()
            ),
        ],
        &[],
    );
    assert!(
        !o.status.success() && text(&o).contains("sequence classifier"),
        "{}",
        text(&o)
    );
    let o = ferrotune(
        &[
            "generate",
            "--model",
            reward.to_str().unwrap(),
            "--prompt",
            "hi",
        ],
        &dir,
        &[],
    );
    assert!(
        !o.status.success() && text(&o).contains("not a causal language model"),
        "{}",
        text(&o)
    );
    let o = run(&dir, &cfg, &dir.join("out2"), &["num_steps=3"], &[]);
    assert!(
        text(&o).contains("num_steps 3 must be at least the batch size 4"),
        "{}",
        text(&o)
    );
}
