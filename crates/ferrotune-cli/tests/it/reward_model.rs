//! `ferrotune run full_reward_model_single_device` / `lora_reward_model_single_device` against
//! TRL 1.16.0's `RewardTrainer` (scripts/make_reward_model_fixtures.py): one SGD step (lr 1) from
//! the tiny Llama classifier logs TRL's loss and metrics and saves TRL's weights; the saved
//! classifier scores the rows as transformers scores them with TRL's weights; PPO takes it as its
//! reward and value model; and a causal LM is given a fresh `score` head.

use crate::common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use common::{ferrotune, fixtures, load, metrics_lines, read_json, rel_l2, text, tmpdir};

fn golden() -> Value {
    let path = fixtures().join("reward_model/golden.json");
    read_json(path)
}

/// A reward-model config over the tiny Llama classifier (tests/fixtures/ppo/reward) with the tiny
/// Llama's tokenizer and chat template, reading `data` (a fixture file), one SGD step of lr 1
/// over its three pairs.
fn write_config(dir: &Path, data: &str) -> PathBuf {
    let f = fixtures();
    let yaml = format!(
        r#"output_dir: {out}
model:
  lora_attn_modules: [q_proj, v_proj]
  lora_rank: 4
  lora_alpha: 8
  lora_dropout: 0.0
tokenizer:
  path: {tok}
checkpointer:
  checkpoint_dir: {model}
  output_dir: ${{output_dir}}
dataset:
  _component_: torchtune.datasets.preference_dataset
  source: json
  data_files: {data}
seed: 7
shuffle: false
batch_size: 3
epochs: 1
max_steps_per_epoch: 1
optimizer:
  _component_: torch.optim.SGD
  lr: 1.0
  weight_decay: 0.0
clip_grad_norm: null
lr_scheduler: null
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${{output_dir}}/logs
log_every_n_steps: 1
device: cpu
dtype: fp32
"#,
        out = dir.join("out").display(),
        tok = f.join("llama3/model").display(),
        model = f.join("ppo/reward").display(),
        data = f.join("reward_model").join(data).display(),
    );
    let path = dir.join("reward.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

fn run(recipe: &str, cfg: &Path, dir: &Path, extra: &[&str]) -> PathBuf {
    let out = dir.join("out");
    let mut args = vec!["run", recipe, "--config", cfg.to_str().unwrap()];
    args.extend(extra);
    let o = ferrotune(&args, dir, &[]);
    assert!(o.status.success(), "{}", text(&o));
    out
}

/// The first logged step's loss and TRL's metrics equal TRL's (1e-5 relative, 1e-6 absolute).
fn assert_log_as_trl(out: &Path, want: &Value) {
    let first = &metrics_lines(&out.join("logs/metrics.jsonl"))[0];
    for key in [
        "loss",
        "accuracy",
        "margin",
        "min_reward",
        "mean_reward",
        "max_reward",
    ] {
        let (got, w) = (first[key].as_f64().unwrap(), want[key].as_f64().unwrap());
        assert!(
            (got - w).abs() <= 1e-5 * w.abs() + 1e-6,
            "{key}: {got} vs TRL's {w}"
        );
    }
}

/// The rewards of `model_dir` (a saved classifier) for the rows TRL collated: each row's score at
/// its last token that is not the pad id, computed by ferrotune's model.
fn rewards(model_dir: &Path, batch: &Value, pad: u32) -> Vec<f32> {
    let (model, _) = ferrotune_models::load_model(model_dir, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(model.config.score_labels, Some(1));
    assert_eq!(model.config.pad_token_id, Some(pad));
    let rows: Vec<Vec<u32>> = serde_json::from_value(batch["input_ids"].clone()).unwrap();
    let (b, t) = (rows.len(), rows[0].len());
    let ids = Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap();
    let layout = ferrotune_models::AttentionLayout::causal(b, t, 0);
    let hidden = model.forward_hidden(&ids, &layout, None).unwrap();
    rows.iter()
        .enumerate()
        .map(|(r, row)| {
            let at = row.iter().rposition(|&x| x != pad).unwrap_or(0);
            let h = hidden.narrow(0, r, 1).unwrap().narrow(1, at, 1).unwrap();
            let s = model.logits(&h).unwrap().flatten_all().unwrap();
            s.to_vec1::<f32>().unwrap()[0]
        })
        .collect()
}

fn assert_close(got: &[f32], want: &Value, what: &str) {
    let want: Vec<f32> = serde_json::from_value(want.clone()).unwrap();
    assert_eq!(got.len(), want.len(), "{what}");
    for (g, w) in got.iter().zip(&want) {
        assert!(
            (g - w).abs() <= 1e-5 * w.abs() + 1e-5,
            "{what}: {got:?} vs {want:?}"
        );
    }
}

/// Full: every weight, text rows with a prompt, a margin column and center_rewards_coefficient.
/// The step's loss and metrics are TRL's, every weight after it is TRL's (1e-5 relative L2; with
/// activation checkpointing too), the
/// saved folder is a LlamaForSequenceClassification that scores TRL's rows as transformers does
/// with TRL's weights, PPO trains with it as its reward and value model, and GRPO with it as a
/// reward function.
#[test]
fn full_reward_model_steps_as_trl() {
    let dir = tmpdir("reward-model", "full");
    let g = golden();
    let want = &g["full"];
    let pad = g["pad_token_id"].as_u64().unwrap() as u32;
    let cfg = write_config(&dir, "text.jsonl");
    let out = run(
        "full_reward_model_single_device",
        &cfg,
        &dir,
        &["center_rewards_coefficient=0.01"],
    );
    assert_log_as_trl(&out, &want["log"]);
    let saved = load(&out.join("epoch_0/model.safetensors"));
    let trl = load(&fixtures().join("reward_model/full_after.safetensors"));
    assert_eq!(saved.len(), trl.len());
    for (key, w) in &trl {
        let e = rel_l2(&saved[key], w);
        assert!(e <= 1e-5, "{key}: relative L2 {e}");
    }
    let config: Value = read_json(out.join("epoch_0/config.json"));
    assert_eq!(
        config["architectures"],
        serde_json::json!(["LlamaForSequenceClassification"])
    );
    assert_eq!(config["id2label"], serde_json::json!({"0": "LABEL_0"}));
    assert_eq!(config["pad_token_id"], serde_json::json!(pad));
    let got = rewards(&out.join("epoch_0"), &want["batch"], pad);
    assert_close(&got, &want["rewards_after"], "rewards after the step");

    // With activation checkpointing (the layer-by-layer pass) the step is the same.
    let layered = tmpdir("reward-model", "full-checkpointing");
    let cfg_layered = write_config(&layered, "text.jsonl");
    let out_layered = run(
        "full_reward_model_single_device",
        &cfg_layered,
        &layered,
        &[
            "center_rewards_coefficient=0.01",
            "enable_activation_checkpointing=true",
        ],
    );
    assert_log_as_trl(&out_layered, &want["log"]);
    let saved = load(&out_layered.join("epoch_0/model.safetensors"));
    for (key, w) in &trl {
        let e = rel_l2(&saved[key], w);
        assert!(
            e <= 1e-5,
            "activation checkpointing: {key}: relative L2 {e}"
        );
    }

    // Without center_rewards_coefficient the loss differs (the option is read).
    let plain = tmpdir("reward-model", "full-plain");
    let cfg = write_config(&plain, "text.jsonl");
    let out_plain = run("full_reward_model_single_device", &cfg, &plain, &[]);
    let loss = |o: &Path| {
        metrics_lines(&o.join("logs/metrics.jsonl"))[0]["loss"]
            .as_f64()
            .unwrap()
    };
    assert!((loss(&out_plain) - loss(&out)).abs() > 1e-4);

    // PPO takes the saved classifier as its reward and value model.
    let ppo_dir = tmpdir("reward-model", "ppo");
    let ppo_cfg = crate::ppo::write_config(&ppo_dir);
    let saved_dir = out.join("epoch_0");
    let reward = format!("reward_checkpointer.checkpoint_dir={}", saved_dir.display());
    let value = format!("value_checkpointer.checkpoint_dir={}", saved_dir.display());
    let o = ferrotune(
        &[
            "run",
            "ppo_full_finetune_single_device",
            "--config",
            ppo_cfg.to_str().unwrap(),
            &reward,
            &value,
            "num_steps=4",
            "ppo_epochs=1",
        ],
        &ppo_dir,
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let lines = metrics_lines(&ppo_dir.join("out/logs/metrics.jsonl"));
    assert!(lines[0]["scores"].as_f64().unwrap().is_finite());

    // GRPO takes it as a reward function.
    let grpo_dir = tmpdir("reward-model", "grpo");
    let grpo_cfg = write_grpo_config(&grpo_dir, &saved_dir);
    let o = ferrotune(
        &[
            "run",
            "dev/grpo_full_finetune_distributed",
            "--config",
            grpo_cfg.to_str().unwrap(),
        ],
        &grpo_dir,
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let lines = metrics_lines(&grpo_dir.join("out/logs/metrics.jsonl"));
    let rewards = lines[0]["rewards"].as_f64().unwrap();
    assert!(rewards.is_finite() && rewards != 0.0, "{}", lines[0]);
}

/// One GRPO step (TRL's DAPO loss, β 0) of the tiny Llama on two prompts, rewarded by the reward
/// model in `reward_model`.
fn write_grpo_config(dir: &Path, reward_model: &Path) -> PathBuf {
    let rows: Vec<String> = ["The sky is", "A cat says"]
        .iter()
        .map(|p| serde_json::json!({ "prompt": p }).to_string())
        .collect();
    std::fs::write(dir.join("prompts.jsonl"), rows.join("\n") + "\n").unwrap();
    let yaml = format!(
        r#"output_dir: {out}
tokenizer:
  path: {policy}
dataset:
  _component_: prompt_dataset
  source: json
  data_files: prompts.jsonl
seed: 5
shuffle: false
checkpointer:
  checkpoint_dir: {policy}
  output_dir: ${{output_dir}}
reward_funcs:
  - model: {reward}
    name: rm
batch_size: 2
grpo_samples: 2
max_generated_tokens: 4
temperature: 1.0
num_steps: 1
epochs: 1
save_every_n_epochs: 1000
optimizer:
  _component_: torch.optim.AdamW
  lr: 1e-5
loss:
  loss_type: dapo
device: cpu
dtype: fp32
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${{output_dir}}/logs
log_every_n_steps: 1
"#,
        out = dir.join("out").display(),
        policy = fixtures().join("llama3/model").display(),
        reward = reward_model.display(),
    );
    let path = dir.join("grpo.yaml");
    std::fs::write(&path, yaml).unwrap();
    path
}

/// A causal LM starts with a fresh `score` head: the saved folder is a one-label classifier of the
/// same decoder, without `lm_head`.
#[test]
fn full_reward_model_from_a_causal_lm_gets_a_score_head() {
    let dir = tmpdir("reward-model", "causal");
    let cfg = write_config(&dir, "text.jsonl");
    let base = fixtures().join("llama3/model");
    let ckpt = format!("checkpointer.checkpoint_dir={}", base.display());
    let out = run("full_reward_model_single_device", &cfg, &dir, &[&ckpt]);
    let saved = load(&out.join("epoch_0/model.safetensors"));
    assert!(!saved.contains_key("lm_head.weight"));
    assert_eq!(saved["score.weight"].dims(), &[1, 64]);
    let config: Value = read_json(out.join("epoch_0/config.json"));
    assert_eq!(
        config["architectures"],
        serde_json::json!(["LlamaForSequenceClassification"])
    );
    let (model, _) =
        ferrotune_models::load_model(&out.join("epoch_0"), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(model.config.score_labels, Some(1));
}

/// LoRA: adapters on q_proj and v_proj from TRL's starting adapter, `score` trained in full
/// (PEFT's SEQ_CLS modules_to_save), conversational rows rendered with the chat template. The
/// step's loss and metrics are TRL's, the adapter and score after it are TRL's (1e-5 relative
/// L2, PEFT's names), the adapter says SEQ_CLS, and the merged classifier scores TRL's rows as
/// transformers does with TRL's weights.
#[test]
fn lora_reward_model_steps_as_trl() {
    let dir = tmpdir("reward-model", "lora");
    let g = golden();
    let want = &g["lora"];
    let pad = g["pad_token_id"].as_u64().unwrap() as u32;
    let cfg = write_config(&dir, "chat.jsonl");
    let start = fixtures().join("reward_model/lora_start");
    let adapter = format!("checkpointer.adapter_checkpoint={}", start.display());
    let out = run("lora_reward_model_single_device", &cfg, &dir, &[&adapter]);
    assert_log_as_trl(&out, &want["log"]);
    let saved = load(&out.join("epoch_0/adapter_model.safetensors"));
    let trl = load(&fixtures().join("reward_model/lora_after.safetensors"));
    let mut names: Vec<&String> = saved.keys().collect();
    names.sort();
    let mut want_names: Vec<&String> = trl.keys().collect();
    want_names.sort();
    assert_eq!(names, want_names);
    for (key, w) in &trl {
        let e = rel_l2(&saved[key], w);
        assert!(e <= 1e-5, "{key}: relative L2 {e}");
    }
    let config: Value = read_json(out.join("epoch_0/adapter_config.json"));
    assert_eq!(config["task_type"], "SEQ_CLS");
    assert!(config["modules_to_save"]
        .as_array()
        .unwrap()
        .contains(&Value::from("score")));
    let got = rewards(&out.join("epoch_0/merged"), &want["batch"], pad);
    assert_close(
        &got,
        &want["rewards_after"],
        "merged rewards after the step",
    );
}

/// `ferrotune merge` of a LoRA reward model's adapter (SEQ_CLS, `score` in modules_to_save) into
/// its causal LM base writes the classifier the recipe merged itself: the same tensors and
/// `architectures`.
#[test]
fn merge_of_a_seq_cls_adapter_into_its_causal_base_is_the_recipes_classifier() {
    let dir = tmpdir("reward-model", "merge");
    let cfg = write_config(&dir, "chat.jsonl");
    let base = fixtures().join("llama3/model");
    let ckpt = format!("checkpointer.checkpoint_dir={}", base.display());
    let out = run("lora_reward_model_single_device", &cfg, &dir, &[&ckpt]);
    let merged = dir.join("merged");
    let o = ferrotune(
        &[
            "merge",
            "--model",
            base.to_str().unwrap(),
            "--adapter",
            out.join("epoch_0").to_str().unwrap(),
            "--output",
            merged.to_str().unwrap(),
        ],
        &dir,
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let ours = load(&merged.join("model.safetensors"));
    let recipe = load(&out.join("epoch_0/merged/model.safetensors"));
    assert!(ours.contains_key("score.weight") && !ours.contains_key("lm_head.weight"));
    assert_eq!(ours.len(), recipe.len());
    for (key, w) in &recipe {
        assert_eq!(ferrotune_testing::max_abs_diff(&ours[key], w), 0.0, "{key}");
    }
    let config = |d: &Path| -> Value { read_json(d.join("config.json")) };
    assert_eq!(
        config(&merged)["architectures"],
        config(&out.join("epoch_0/merged"))["architectures"]
    );
    assert_eq!(config(&merged)["pad_token_id"], serde_json::json!(3));
}

/// A `loss` section is refused (the loss is TRL's reward loss), by `run` and by `validate`, with
/// the recipe named and inferred from `center_rewards_coefficient`.
#[test]
fn validate_refuses_what_a_reward_model_run_refuses() {
    let dir = tmpdir("reward-model", "validate");
    let cfg = write_config(&dir, "text.jsonl");
    let yaml = std::fs::read_to_string(&cfg).unwrap()
        + "center_rewards_coefficient: 0.01\nloss:\n  _component_: torch.nn.CrossEntropyLoss\n";
    std::fs::write(&cfg, yaml).unwrap();
    let path = cfg.to_str().unwrap();
    let needle = "the reward-model recipes train with TRL's RewardTrainer loss";
    for args in [
        vec!["run", "lora_reward_model_single_device", "--config", path],
        vec![
            "validate",
            path,
            "--recipe",
            "full_reward_model_single_device",
        ],
        vec!["validate", path],
    ] {
        let out = ferrotune(&args, &dir, &[]);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {}", text(&out));
        assert!(text(&out).contains(needle), "{args:?}: {}", text(&out));
    }
}

/// A reward model from a causal LM (a fresh `score` head drawn from the seed), killed in the
/// second of three epochs (AdamW; after step 3, its first epoch saved) and resumed, ends with the
/// uninterrupted run's weights, byte for byte: LoRA (adapter and `score`) and full.
#[test]
fn a_killed_reward_model_run_resumes_to_the_uninterrupted_weights() {
    let base = fixtures().join("llama3/model");
    let ckpt = format!("checkpointer.checkpoint_dir={}", base.display());
    for (recipe, file) in [
        (
            "lora_reward_model_single_device",
            "adapter_model.safetensors",
        ),
        ("full_reward_model_single_device", "model.safetensors"),
    ] {
        let dir = tmpdir("reward-model", &format!("resume-{recipe}"));
        let cfg = write_config(&dir, "chat.jsonl");
        let train = |out: &str, env: &[(&str, &str)], extra: &[&str]| {
            let out_dir = format!("output_dir={}", dir.join(out).display());
            let mut args = vec![
                "run",
                recipe,
                "--config",
                cfg.to_str().unwrap(),
                &out_dir,
                &ckpt,
                "epochs=3",
                "batch_size=1",
                "max_steps_per_epoch=2",
                "optimizer._component_=torch.optim.AdamW",
                "optimizer.lr=1e-3",
            ];
            args.extend_from_slice(extra);
            ferrotune(&args, &dir, env)
        };
        let whole = train("whole", &[], &[]);
        assert!(whole.status.success(), "{recipe}: {}", text(&whole));
        let killed = train("resumed", &[("FERROTUNE_KILL_AFTER_STEP", "3")], &[]);
        assert!(
            !killed.status.success(),
            "{recipe}: the run was to be killed"
        );
        assert!(dir.join("resumed/epoch_0").is_dir() && !dir.join("resumed/epoch_1").exists());
        let resumed = train("resumed", &[], &["resume_from_checkpoint=true"]);
        assert!(resumed.status.success(), "{recipe}: {}", text(&resumed));
        let read = |out: &str| std::fs::read(dir.join(out).join("epoch_2").join(file)).unwrap();
        assert!(
            read("whole") == read("resumed"),
            "{recipe}: resumed weights"
        );
        let start = load(&dir.join("whole/epoch_0").join(file));
        let end = load(&dir.join("whole/epoch_2").join(file));
        let score = start
            .keys()
            .find(|k| k.ends_with("score.weight"))
            .expect("score saved");
        assert!(ferrotune_testing::max_abs_diff(&start[score], &end[score]) > 0.0);
    }
}

/// The `_distributed` forms on 2 ranks (2 pairs each) equal one device taking the 4 pairs: the
/// loss and every TRL metric (`min_reward` / `max_reward` over both ranks' rewards, as TRL
/// gathers them) and the weights, LoRA and full, from a causal LM.
#[test]
fn reward_models_on_two_ranks_equal_one_device() {
    let dir = tmpdir("reward-model", "two-ranks");
    let rows = [
        ("The sky is", " blue", " loud", 0.0),
        ("Two plus two is", " four", " five", 0.5),
        ("A cat says", " meow", " woof", 0.0),
        ("Water is", " wet", " dry and dusty", 1.0),
    ];
    let lines: Vec<String> = rows
        .iter()
        .map(|(p, c, r, m)| {
            serde_json::json!({"prompt": p, "chosen": c, "rejected": r, "margin": m}).to_string()
        })
        .collect();
    let data = dir.join("pairs.jsonl");
    std::fs::write(&data, lines.join("\n") + "\n").unwrap();
    let cfg = write_config(&dir, "text.jsonl");
    let base = fixtures().join("llama3/model");
    let ckpt = format!("checkpointer.checkpoint_dir={}", base.display());
    let data = format!("dataset.data_files={}", data.display());
    for (single, several, file) in [
        (
            "lora_reward_model_single_device",
            "lora_reward_model_distributed",
            "adapter_model.safetensors",
        ),
        (
            "full_reward_model_single_device",
            "full_reward_model_distributed",
            "model.safetensors",
        ),
    ] {
        let go = |recipe: &str, out: &str, nproc: &str, batch: &str| {
            let out_dir = format!("output_dir={}", dir.join(out).display());
            let mut args = vec!["run"];
            if nproc != "1" {
                args.extend(["--nproc-per-node", nproc]);
            }
            args.extend([
                recipe,
                "--config",
                cfg.to_str().unwrap(),
                &out_dir,
                &ckpt,
                &data,
                batch,
                "center_rewards_coefficient=0.01",
            ]);
            let o = ferrotune(&args, &dir, &[]);
            assert!(o.status.success(), "{recipe}: {}", text(&o));
            dir.join(out)
        };
        let one = go(single, &format!("one-{single}"), "1", "batch_size=4");
        let two = go(several, &format!("two-{several}"), "2", "batch_size=2");
        let (a, b) = (
            &metrics_lines(&two.join("logs/metrics.jsonl"))[0],
            &metrics_lines(&one.join("logs/metrics.jsonl"))[0],
        );
        for key in [
            "loss",
            "accuracy",
            "margin",
            "min_reward",
            "mean_reward",
            "max_reward",
        ] {
            let (g, w) = (a[key].as_f64().unwrap(), b[key].as_f64().unwrap());
            assert!(
                (g - w).abs() <= 1e-5 * w.abs() + 1e-6,
                "{several}: {key} {g} vs one device's {w}"
            );
        }
        let (got, want) = (
            load(&two.join("epoch_0").join(file)),
            load(&one.join("epoch_0").join(file)),
        );
        assert_eq!(got.len(), want.len());
        for (key, w) in &want {
            let e = rel_l2(&got[key], w);
            assert!(e <= 1e-5, "{several}: {key}: relative L2 {e}");
        }
    }
}
