//! `ferrotune run dev/grpo_full_finetune_distributed` end to end on the tiny Llama with GSM8K-style
//! rows: the run logs torchtune's GRPO metrics at each step, saves the policy as an HF folder that
//! loads back, trained (the reference is another checkpoint of the same shape, so the KL term
//! moves the policy even where every completion gets the same reward), a run killed after its
//! first epoch's checkpoint resumes to the same weights as an uninterrupted run, and bad settings
//! are refused with the key named.

use crate::common;

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use common::{fixtures, load, metrics_lines, read_json, run_recipe, text, tmpdir};

pub(crate) fn write_config(dir: &Path) -> PathBuf {
    let rows: Vec<String> = (0..4)
        .map(|i| {
            serde_json::json!({
                "question": format!("What is {i} plus {i}?"),
                "answer": format!("{i} + {i} = <<{i}+{i}={}>>{}\n#### {}", 2 * i, 2 * i, 2 * i),
            })
            .to_string()
        })
        .collect();
    std::fs::write(dir.join("gsm.jsonl"), rows.join("\n") + "\n").unwrap();
    let f = fixtures();
    let yaml = format!(
        r#"output_dir: {out}
base_model_path: {policy}
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: {policy}
  max_seq_len: null
dataset:
  _component_: torchtune.dev.grpo.gsm8k.gsm8k_dataset
  source: json
  data_files: gsm.jsonl
seed: 3
shuffle: true
reward_fn:
  _component_: torchtune.dev.grpo.rewards.batch_shaped_correctness_reward
model:
  _component_: torchtune.models.llama3_2.llama3_2_1b
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: ${{base_model_path}}
  output_dir: ${{output_dir}}
ref_checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {reference}
resume_from_checkpoint: false
save_every_n_epochs: 1
batch_size: 2
grpo_samples: 3
forward_batch_size: 1
max_generated_tokens: 6
top_k: null
temperature: 1.0
ppo_epochs: 2
num_steps: 100
clip_grad_norm: 1.0
epochs: 2
optimizer:
  _component_: torch.optim.AdamW
  lr: 1e-3
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 1
loss:
  _component_: torchtune.dev.grpo.loss.GRPOSimpleLoss
  kl_coeff: 0.5
  epsilon: 0.2
device: cpu
dtype: fp32
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${{output_dir}}/logs
log_every_n_steps: 1
"#,
        out = dir.join("out").display(),
        policy = f.join("llama3/model").display(),
        reference = f.join("llama3/merged").display(),
    );
    let path = dir.join("grpo.yaml");
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
    run_recipe(
        "dev/grpo_full_finetune_distributed",
        cfg,
        out,
        extra,
        dir,
        env,
    )
}

#[test]
fn grpo_runs_saves_the_policy_and_resumes_exactly() {
    let dir = tmpdir("grpo", "run");
    let cfg = write_config(&dir);
    let out = dir.join("full");
    let o = run(&dir, &cfg, &out, &[], &[]);
    let log = text(&o);
    assert!(o.status.success(), "{log}");

    // 4 problems in batches of 2: 2 batches an epoch, 2 epochs; each batch takes 2 optimizer
    // steps (ppo_epochs), the logged step.
    let lines = metrics_lines(&out.join("logs/metrics.jsonl"));
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, vec![2, 4, 6, 8], "{log}");
    for l in &lines {
        for key in [
            "rewards",
            "successes",
            "num_stop_tokens",
            "loss",
            "policy_loss",
            "kl_loss",
            "clipfrac",
            "ratios",
            "approx_policy_kl",
            "response_lengths",
            "lr",
            "grad_norm",
        ] {
            let v = l[key]
                .as_f64()
                .unwrap_or_else(|| panic!("{key} missing in {l}"));
            assert!(v.is_finite(), "{key} = {v}");
        }
        // At most 6 new tokens: the last kept index is at most 5.
        assert!(l["response_lengths"].as_f64().unwrap() <= 5.0);
        // The reference is another model: the KL estimate is positive.
        assert!(l["kl_loss"].as_f64().unwrap() > 0.0, "{l}");
    }

    // Saved per epoch as an HF folder that loads, trained away from the start.
    for epoch in ["epoch_0", "epoch_1"] {
        assert!(
            out.join(epoch).join("model.safetensors").is_file(),
            "{epoch}"
        );
    }
    let (policy, _) =
        ferrotune_models::load_model(&out.join("epoch_1"), DType::F32, &Device::Cpu).unwrap();
    assert_eq!(policy.config.num_hidden_layers, 2);
    let saved = load(&out.join("epoch_1/model.safetensors"));
    let start = load(&fixtures().join("llama3/model/model.safetensors"));
    let diff = ferrotune_testing::max_abs_diff;
    let q = "model.layers.0.self_attn.q_proj.weight";
    assert!(diff(&saved[q], &start[q]) > 0.0);

    // Killed right after the first epoch's checkpoint (optimizer step 4), then resumed.
    let resumed = dir.join("resumed");
    let killed = run(
        &dir,
        &cfg,
        &resumed,
        &[],
        &[("FERROTUNE_KILL_AFTER_STEP", "4")],
    );
    assert!(!killed.status.success(), "the run was not killed");
    assert!(resumed.join("epoch_0").is_dir() && !resumed.join("epoch_1").exists());
    let o = run(&dir, &cfg, &resumed, &["resume_from_checkpoint=true"], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let b = load(&resumed.join("epoch_1/model.safetensors"));
    for (name, t) in &saved {
        assert_eq!(diff(t, &b[name]), 0.0, "{name} differs after resuming");
    }
    let resumed_lines = metrics_lines(&resumed.join("logs/metrics.jsonl"));
    assert_eq!(resumed_lines.len(), 4);
    assert_eq!(resumed_lines[3]["loss"].as_f64(), lines[3]["loss"].as_f64());
}

#[test]
fn grpo_refuses_bad_settings_naming_them() {
    let dir = tmpdir("grpo", "bad");
    let cfg = write_config(&dir);
    for (extra, expected) in [
        ("grpo_samples=1", "grpo_samples must be at least 2"),
        (
            "loss._component_=torchtune.dev.grpo.loss.GRPOCompletionLoss",
            "GRPOCompletionLoss' is not supported",
        ),
        (
            "forward_batch_size=3",
            "exactly divisible by forward_batch_size",
        ),
        (
            "reward_fn._component_=my.reward",
            "reward_fn._component_ 'my.reward' is not supported",
        ),
        (
            "dataset._component_=torchtune.datasets.alpaca_dataset",
            "does not give problems with reference answers",
        ),
    ] {
        let o = run(&dir, &cfg, &dir.join("out"), &[extra], &[]);
        let log = text(&o);
        assert_eq!(o.status.code(), Some(1), "{extra}: {log}");
        assert!(log.contains(expected), "{extra}: {log}");
    }
}

/// With a `lora_*` model builder only the adapters train, against the base itself as reference
/// (no `ref_checkpointer` needed): the checkpoint is a PEFT adapter folder with the merged model
/// one folder down. The run continues a trained adapter (`checkpointer.adapter_checkpoint`), so
/// that the policy differs from the base and the KL term moves the adapter (a fresh adapter, B =
/// 0, is the base itself, and the tiny model's completions all get the same reward).
#[test]
fn grpo_with_lora_saves_a_peft_adapter_and_the_merged_model() {
    let (o, out) = grpo_lora_from("lora", &fixtures().join("llama3/adapter"));
    let log = text(&o);
    assert!(o.status.success(), "{log}");
    let epoch = out.join("epoch_0");
    assert!(epoch.join("adapter_config.json").is_file(), "{log}");
    assert!(epoch.join("merged/model.safetensors").is_file());
    let adapter = load(&epoch.join("adapter_model.safetensors"));
    let b = adapter
        .iter()
        .find(|(k, _)| k.ends_with("layers.0.self_attn.q_proj.lora_B.weight"))
        .map(|(_, t)| t.clone())
        .expect("a q_proj lora_B");
    let start = load(&fixtures().join("llama3/adapter/adapter_model.safetensors"));
    let (_, b0) = start
        .iter()
        .find(|(k, _)| k.ends_with("layers.0.self_attn.q_proj.lora_B.weight"))
        .expect("the fixture adapts q_proj");
    assert!(
        ferrotune_testing::max_abs_diff(&b, b0) > 0.0,
        "lora_B did not train"
    );
    // The merged model loads as a plain causal LM.
    ferrotune_models::load_model(&epoch.join("merged"), DType::F32, &Device::Cpu).unwrap();
    for l in metrics_lines(&out.join("logs/metrics.jsonl")) {
        assert!(l["kl_loss"].as_f64().unwrap() >= 0.0);
    }
}

/// One epoch of GRPO with LoRA (no reference checkpoint: the reference is the base under the
/// adapter) continuing the PEFT adapter at `adapter` (whose config decides its targets); returns
/// the run's output and its output folder.
fn grpo_lora_from(name: &str, adapter: &Path) -> (std::process::Output, PathBuf) {
    let dir = tmpdir("grpo", name);
    let cfg = write_config(&dir);
    let out = dir.join("out");
    let o = run(
        &dir,
        &cfg,
        &out,
        &[
            "~ref_checkpointer",
            "model._component_=torchtune.models.llama3_2.lora_llama3_2_1b",
            "model.lora_attn_modules=[q_proj,v_proj]",
            "model.lora_rank=4",
            "model.lora_alpha=8",
            &format!("checkpointer.adapter_checkpoint={}", adapter.display()),
            "epochs=1",
            "optimizer.lr=1e-2",
        ],
        &[],
    );
    (o, out)
}

/// GRPO continuing an adapter with LoRA biases on Llama's bias-free layers (which cannot be
/// merged): the biases train, the adapter is saved with them, and no merged model is written,
/// with a note.
#[test]
fn grpo_with_an_unmergeable_lora_bias_adapter_saves_the_adapter_alone() {
    let adapter = fixtures().join("lora_bias/llama3_unmergeable/adapter");
    let (o, out) = grpo_lora_from("lora-bias", &adapter);
    let log = text(&o);
    assert!(o.status.success(), "{log}");
    assert!(log.contains("no merged/ model"), "{log}");
    let epoch = out.join("epoch_0");
    assert!(!epoch.join("merged").exists());
    let saved = load(&epoch.join("adapter_model.safetensors"));
    let start = load(&adapter.join("adapter_model.safetensors"));
    let key = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias";
    assert!(
        ferrotune_testing::max_abs_diff(&saved[key], &start[key]) > 0.0,
        "{key} did not train"
    );
}

/// Two ranks of batch size 1 train what one process of batch size 2 trains, every weight or LoRA
/// adapters: torch's sampler deals the problems, each prompt is sampled alike, and the ranks'
/// gradients are averaged before each step; the logged rewards and successes are the means over
/// the ranks.
#[test]
fn grpo_on_two_ranks_trains_what_one_process_trains() {
    let dir = tmpdir("grpo", "ranks");
    let cfg = write_config(&dir);
    let adapter = format!(
        "checkpointer.adapter_checkpoint={}",
        fixtures().join("llama3/adapter").display()
    );
    let lora = [
        "~ref_checkpointer",
        "model._component_=torchtune.models.llama3_2.lora_llama3_2_1b",
        "model.lora_attn_modules=[q_proj,v_proj]",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        adapter.as_str(),
        "optimizer.lr=1e-2",
    ];
    // Full fine-tuning shards gradients and optimizer state over the ranks (or, with
    // `fsdp_sharding: none`, replicates them as DDP); LoRA is DDP. Each trains what one process
    // trains.
    let cases: [(&str, &[&str], &str, &str); 4] = [
        // (The config's clip_grad_norm does not bind here: with an active clip the norm, summed
        // shard by shard, differs from one process's in its last bits, and AdamW's second step
        // carries that past this tolerance. The sharded clip is ShardedModel::clip_grad_norm,
        // checked by tests/distributed.rs.)
        ("full", &[], "model.safetensors", "fsdp_sharding: grad_op"),
        (
            "full-ddp",
            &["fsdp_sharding=none"],
            "model.safetensors",
            "data parallel",
        ),
        ("lora", &lora, "adapter_model.safetensors", "data parallel"),
        // torchao's 8-bit AdamW over the sharded policy: each rank quantizes whole blocks of
        // the parameters it holds, one process's blocks.
        (
            "full-8bit",
            &["optimizer._component_=torchao.optim.AdamW8bit"],
            "model.safetensors",
            "fsdp_sharding: grad_op",
        ),
    ];
    for (name, extra, weights, mode) in cases {
        let single = dir.join(format!("{name}-single"));
        let mut args = vec!["epochs=1"];
        args.extend(extra);
        let o = run(&dir, &cfg, &single, &args, &[]);
        assert!(o.status.success(), "{}", text(&o));
        let ranks = dir.join(format!("{name}-ranks"));
        let mut cmd = vec![
            "run".to_string(),
            "--nproc-per-node".into(),
            "2".into(),
            "dev/grpo_full_finetune_distributed".into(),
            "--config".into(),
            cfg.display().to_string(),
            format!("output_dir={}", ranks.display()),
            "batch_size=1".into(),
        ];
        cmd.extend(args.iter().map(|s| s.to_string()));
        let o = common::ferrotune(&cmd, &dir, &[]);
        let log = text(&o);
        assert!(o.status.success(), "{name}: {log}");
        assert!(
            log.contains("Distributed: 2 ranks") && log.contains(mode),
            "{log}"
        );
        if name == "full" {
            // Each rank holds half of the optimizer state (AdamW's two moments, in f32).
            let line = log
                .lines()
                .find(|l| l.starts_with("rank 1: parameters"))
                .unwrap_or_else(|| panic!("no memory line: {log}"));
            let mb = |after: &str| -> f64 {
                let rest = &line[line.find(after).unwrap() + after.len()..];
                rest.split_whitespace().next().unwrap().parse().unwrap()
            };
            let held = mb("optimizer state ");
            let one: Vec<f64> = line[line.find("(one device: ").unwrap() + 13..]
                .split(" + ")
                .map(|p| p.split_whitespace().next().unwrap().parse().unwrap())
                .collect();
            let ratio = held / one[2];
            assert!((0.45..=0.55).contains(&ratio), "{line}");
        }
        if name == "full" {
            // Two epochs on two ranks, killed (rank 1) after the first epoch's checkpoint at
            // optimizer step 4, resumed: the weights of the uninterrupted two-epoch run.
            let mut two_epochs = cmd.clone();
            let through = dir.join("through");
            two_epochs[6] = format!("output_dir={}", through.display());
            two_epochs.push("epochs=2".into());
            let o = common::ferrotune(&two_epochs, &dir, &[]);
            assert!(o.status.success(), "{}", text(&o));
            let resumed = dir.join("resumed");
            two_epochs[6] = format!("output_dir={}", resumed.display());
            let kill = [
                ("FERROTUNE_KILL_AFTER_STEP", "4"),
                ("FERROTUNE_KILL_RANK", "1"),
            ];
            let o = common::ferrotune(&two_epochs, &dir, &kill);
            assert!(!o.status.success(), "the run was not killed");
            assert!(resumed.join("epoch_0").is_dir() && !resumed.join("epoch_1").exists());
            two_epochs.push("resume_from_checkpoint=true".into());
            let o = common::ferrotune(&two_epochs, &dir, &[]);
            assert!(o.status.success(), "{}", text(&o));
            let a = load(&resumed.join("epoch_1/model.safetensors"));
            for (key, t) in load(&through.join("epoch_1/model.safetensors")) {
                assert_eq!(ferrotune_testing::max_abs_diff(&t, &a[&key]), 0.0, "{key}");
            }
        }

        let want = metrics_lines(&single.join("logs/metrics.jsonl"));
        let got = metrics_lines(&ranks.join("logs/metrics.jsonl"));
        assert_eq!(got.len(), want.len(), "{name}: {log}");
        for (g, w) in got.iter().zip(&want) {
            assert_eq!(g["step"], w["step"]);
            for key in ["rewards", "successes"] {
                let (g, w) = (g[key].as_f64().unwrap(), w[key].as_f64().unwrap());
                assert!((g - w).abs() <= 1e-6, "{name} {key}: {g} vs {w}");
            }
        }
        let a = load(&ranks.join("epoch_0").join(weights));
        let b = load(&single.join("epoch_0").join(weights));
        let start = match name {
            "full" | "full-ddp" | "full-8bit" => {
                load(&fixtures().join("llama3/model/model.safetensors"))
            }
            _ => load(&fixtures().join("llama3/adapter/adapter_model.safetensors")),
        };
        for (key, t) in &b {
            let moved = ferrotune_testing::max_abs_diff(t, &start[key]);
            let apart = ferrotune_testing::max_abs_diff(t, &a[key]);
            assert!(
                apart <= 1e-4 * moved.max(1e-3),
                "{name} {key}: {apart} apart, moved {moved}"
            );
        }
    }
}

/// GRPO with LoRA on a mixture of experts (Mixtral's experts and router) also writes the adapter
/// as PEFT holds it on transformers 5 (`transformers5/`, fused experts), as the LoRA fine-tuning
/// recipes do: that folder gives the same model as the per-expert adapter beside it.
#[test]
fn grpo_lora_on_experts_writes_the_transformers5_adapter() {
    use candle_core::Tensor;
    use ferrotune_models::{load_adapter, load_model, AttentionLayout};

    let dir = tmpdir("grpo", "moe");
    let cfg = write_config(&dir);
    let out = dir.join("out");
    let base = fixtures().join("models/mixtral/model");
    let o = run(
        &dir,
        &cfg,
        &out,
        &[
            &format!("base_model_path={}", base.display()),
            &format!("tokenizer.path={}", base.display()),
            "~ref_checkpointer",
            "model._component_=torchtune.models.mistral.lora_mistral_7b",
            "model.lora_attn_modules=[q_proj]",
            "model.apply_lora_to_mlp=true",
            "model.lora_rank=2",
            "model.lora_alpha=4",
            "epochs=1",
            "optimizer.lr=1e-2",
        ],
        &[],
    );
    assert!(o.status.success(), "{}", text(&o));
    let epoch = out.join("epoch_0");
    let t5 = epoch.join("transformers5");
    let config: serde_json::Value = read_json(t5.join("adapter_config.json"));
    assert!(
        config["target_parameters"]
            .as_array()
            .is_some_and(|a| !a.is_empty()),
        "{config}"
    );
    let ids = Tensor::new(&[[5u32, 9, 44, 7, 100, 3, 250, 17]], &Device::Cpu).unwrap();
    let logits = |adapter: &Path| {
        let mut m = load_model(&base, DType::F32, &Device::Cpu).unwrap().0;
        load_adapter(&mut m, adapter).unwrap();
        m.forward(&ids, &AttentionLayout::causal(1, 8, 0), None)
            .unwrap()
    };
    let err = ferrotune_testing::max_abs_diff(&logits(&epoch), &logits(&t5));
    assert!(err <= 1e-5, "transformers5/ logits differ by {err}");
}
