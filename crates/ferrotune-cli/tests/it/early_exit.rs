//! `ferrotune run dev/early_exit_finetune_distributed --config llama2/7B_full_early_exit` end to end
//! on the tiny 2-layer Llama (paths, device and sizes overridden): with early exits on both
//! layers' inputs the last layer is never run and keeps its weights (torchtune's rule) while the
//! rest trains; with layer dropout alone, a run killed mid-epoch resumes to the same losses and
//! weights as an uninterrupted run (the draws continue where they stopped); bad settings are
//! refused with the key named.

use crate::common;

use std::path::{Path, PathBuf};

use common::{fixtures, load, losses, metrics_lines, run_recipe, text, tmpdir};

fn setup(dir: &Path) -> Vec<String> {
    let rows: Vec<String> = (0..8)
        .map(|i| {
            serde_json::json!({
                "utterance": format!("wake me up at {i} am"),
                "semantic_parse": format!("[IN:CREATE_ALARM [SL:DATE_TIME at {i} am ] ]"),
            })
            .to_string()
        })
        .collect();
    std::fs::write(dir.join("top_v2.jsonl"), rows.join("\n") + "\n").unwrap();
    let model = fixtures().join("models/llama2/model");
    [
        format!("checkpointer.checkpoint_dir={}", model.display()),
        "~checkpointer.checkpoint_files".into(),
        format!("tokenizer.path={}", model.display()),
        "dataset.source=json".into(),
        "dataset.data_files=top_v2.jsonl".into(),
        "device=cpu".into(),
        "dtype=fp32".into(),
        "batch_size=2".into(),
        "epochs=2".into(),
        "seed=5".into(),
        "optimizer.lr=1e-3".into(),
    ]
    .to_vec()
}

fn run(dir: &Path, out: &Path, args: &[String], env: &[(&str, &str)]) -> std::process::Output {
    let mut all = vec!["llama2/7B_full_early_exit".to_string()];
    all.extend(args.iter().cloned());
    let cfg = PathBuf::from(&all[0]);
    let extra: Vec<&str> = all[1..].iter().map(String::as_str).collect();
    run_recipe(
        "dev/early_exit_finetune_distributed",
        &cfg,
        out,
        &extra,
        dir,
        env,
    )
}

#[test]
fn early_exits_train_the_layers_below_the_highest_exit() {
    let dir = tmpdir("early_exit", "exits");
    let mut args = setup(&dir);
    // Both layers' inputs: the embeddings and layer 0's output; layer 1's output is in no loss.
    args.push("early_exit_loss.layers=0:".into());
    let out = dir.join("out");
    let o = run(&dir, &out, &args, &[]);
    let log = text(&o);
    assert!(o.status.success(), "{log}");
    assert!(
        log.contains("Early-exit loss on the inputs of layers [0, 1]"),
        "{log}"
    );
    assert!(
        log.contains("Layer dropout: probability per layer [0.0, 0.2]"),
        "{log}"
    );
    let lines = metrics_lines(&out.join("logs/metrics.jsonl"));
    assert_eq!(lines.len(), 8, "4 steps an epoch, 2 epochs");
    assert!(lines
        .iter()
        .all(|l| l["loss"].as_f64().unwrap().is_finite()));
    let start = load(&fixtures().join("models/llama2/model/model.safetensors"));
    let saved = load(&out.join("epoch_1/model.safetensors"));
    let moved = |name: &str| ferrotune_testing::max_abs_diff(&saved[name], &start[name]) > 0.0;
    for name in [
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.norm.weight",
        "lm_head.weight",
    ] {
        assert!(moved(name), "{name} did not train");
    }
    for (name, _) in start
        .iter()
        .filter(|(n, _)| n.starts_with("model.layers.1."))
    {
        assert!(!moved(name), "{name} changed, but layer 1 never ran");
    }
}

#[test]
fn layer_dropout_resumes_exactly() {
    let dir = tmpdir("early_exit", "resume");
    let mut args = setup(&dir);
    args.extend([
        "early_exit_loss=null".to_string(),
        "layer_dropout.prob=0.5".into(),
        "layer_dropout.layers_scale=uniform".into(),
        "save_every_n_steps=2".into(),
    ]);
    let whole = dir.join("whole");
    let o = run(&dir, &whole, &args, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let want = metrics_lines(&whole.join("logs/metrics.jsonl"));
    assert_eq!(want.len(), 8);

    // Killed after step 7 (the step-6 checkpoint is the latest), then resumed.
    let killed = dir.join("killed");
    let o = run(&dir, &killed, &args, &[("FERROTUNE_KILL_AFTER_STEP", "7")]);
    assert!(!o.status.success(), "the run should have been killed");
    assert!(killed.join("step_6/recipe_state/state.json").is_file());
    let mut resume = args.clone();
    resume.push("resume_from_checkpoint=true".into());
    let o = run(&dir, &killed, &resume, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let got = metrics_lines(&killed.join("logs/metrics.jsonl"));
    assert_eq!(losses(&got), losses(&want), "the resumed run differs");
    let a = load(&whole.join("epoch_1/model.safetensors"));
    let b = load(&killed.join("epoch_1/model.safetensors"));
    for (name, t) in &a {
        assert_eq!(
            ferrotune_testing::max_abs_diff(t, &b[name]),
            0.0,
            "{name} differs after resuming"
        );
    }
}

#[test]
fn early_exit_refuses_bad_settings_naming_them() {
    let dir = tmpdir("early_exit", "bad");
    let args = setup(&dir);
    for (extra, expected) in [
        (
            "early_exit_loss.scale_fn=torchtune.modules.early_exit_loss.cubic",
            "early_exit_loss.scale_fn: 'torchtune.modules.early_exit_loss.cubic' is not one of",
        ),
        (
            "early_exit_loss.curriculum=my.Curriculum",
            "early_exit_loss.curriculum: 'my.Curriculum' is not one of",
        ),
        (
            "early_exit_loss.layers=0:7",
            "early_exit_loss.layers: '0:7': end index out of range",
        ),
        (
            "layer_dropout.layers_scale=step",
            "'step' is not a layer-dropout scale",
        ),
        (
            "layer_dropout.prob=1.5",
            "layer_dropout.prob must be in [0, 1]",
        ),
        // The key torchtune's config comments use, which its recipe never reads.
        ("layer_dropout.scale=exp", "layer_dropout.scale"),
    ] {
        let mut a = args.clone();
        a.push(extra.to_string());
        let o = run(&dir, &dir.join("out"), &a, &[]);
        let log = text(&o);
        assert!(!o.status.success(), "{extra}: accepted");
        assert!(log.contains(expected), "{extra}: {log}");
    }
}
