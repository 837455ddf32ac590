//! The quantized AdamW optimizers in a training run (full fine-tuning of the tiny Llama, whose
//! q/o projections, MLP and embedding are large enough to be quantized; k/v keep f32 moments):
//! each reaches f32 AdamW's loss, the state line is printed, and a run killed after a checkpoint
//! resumes to the uninterrupted run's losses and weights.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{load, losses, metrics_lines, text};

fn tmpdir(name: &str) -> PathBuf {
    common::tmpdir("optim-quant", name)
}

/// 6 rows repeated (two epochs of 6 steps), so the loss falls.
fn write_rows(dir: &Path) -> PathBuf {
    let data = dir.join("rows.jsonl");
    let mut lines = Vec::new();
    for i in 0..12u32 {
        let ids: Vec<u32> = (0..12).map(|j| ((i % 6) * 31 + j * 7) % 500 + 3).collect();
        lines.push(serde_json::json!({"input_ids": ids}).to_string());
    }
    std::fs::write(&data, lines.join("\n")).unwrap();
    data
}

fn run(dir: &Path, cfg: &Path, out: &Path, extra: &[&str], env: &[(&str, &str)]) -> Output {
    let mut args = vec![
        "run".to_string(),
        "full_finetune_single_device".into(),
        "--config".into(),
        cfg.display().to_string(),
        format!("output_dir={}", out.display()),
        "epochs=3".into(),
        "optimizer.lr=3e-3".into(),
        "log_peak_memory_stats=true".into(),
    ];
    args.extend(extra.iter().map(|s| s.to_string()));
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    common::ferrotune(&refs, dir, env)
}

/// The mean loss of the last epoch's 6 steps.
fn last_epoch_loss(out: &Path) -> f64 {
    let l = losses(&metrics_lines(&out.join("logs/metrics.jsonl")));
    assert_eq!(l.len(), 18);
    l[12..].iter().map(|x| x.1).sum::<f64>() / 6.0
}

/// The `optimizer_state_mb` the last step logged.
fn state_mb(out: &Path) -> f64 {
    let lines = metrics_lines(&out.join("logs/metrics.jsonl"));
    lines.last().unwrap()["optimizer_state_mb"]
        .as_f64()
        .unwrap()
}

/// torchao's AdamW8bit / AdamW4bit and bitsandbytes' PagedAdamW8bit end within 5% of f32
/// AdamW's last-epoch loss (which is well below the first step's), print their state size and
/// log a smaller `optimizer_state_mb` (the tiny model's k/v projections and norms keep f32
/// moments, so not a quarter).
#[test]
fn quantized_adamw_reaches_the_f32_loss() {
    let dir = tmpdir("loss");
    let data = write_rows(&dir);
    let cfg = common::write_config(common::TINY_LORA, &dir, "llama3", &data);
    let base = dir.join("f32");
    let o = run(&dir, &cfg, &base, &[], &[]);
    assert!(o.status.success(), "{}", text(&o));
    let first = losses(&metrics_lines(&base.join("logs/metrics.jsonl")))[0].1;
    let want = last_epoch_loss(&base);
    eprintln!("f32 AdamW: first {first:.4}, last epoch {want:.4}");
    assert!(want < 0.8 * first, "the loss falls: {first} -> {want}");
    let f32_state = state_mb(&base);
    for (name, component) in [
        ("torchao8", "torchao.optim.AdamW8bit"),
        ("torchao4", "torchao.optim.AdamW4bit"),
        ("bnb8", "bitsandbytes.optim.PagedAdamW8bit"),
    ] {
        let out = dir.join(name);
        let set = format!("optimizer._component_={component}");
        let o = run(&dir, &cfg, &out, &[&set], &[]);
        let log = text(&o);
        assert!(o.status.success(), "{log}");
        assert!(log.contains("Optimizer state: "), "{log}");
        let got = last_epoch_loss(&out);
        let state = state_mb(&out);
        eprintln!("{component}: optimizer_state_mb {state} (f32 AdamW {f32_state})");
        assert!(
            state > 0.0 && state < 0.6 * f32_state,
            "{component}: {state} MB"
        );
        eprintln!("{component}: last epoch {got:.4} (f32 AdamW {want:.4})");
        assert!(
            (got - want).abs() <= 0.05 * want,
            "{component}: {got} vs f32 AdamW's {want}"
        );
    }
}

/// Killed after step 7 (a checkpoint at step 4 holds the quantized state), resumed: the same
/// losses and final weights as the uninterrupted run.
#[test]
fn quantized_state_resumes_step_exact() {
    let dir = tmpdir("resume");
    let data = write_rows(&dir);
    let cfg = common::write_config(common::TINY_LORA, &dir, "llama3", &data);
    for component in ["torchao.optim.AdamW4bit", "bitsandbytes.optim.AdamW8bit"] {
        let set = format!("optimizer._component_={component}");
        let extra = [set.as_str(), "save_every_n_steps=4", "shuffle=true"];
        let tag = component.replace('.', "_");
        let straight = dir.join(format!("{tag}-straight"));
        let o = run(&dir, &cfg, &straight, &extra, &[]);
        assert!(o.status.success(), "{}", text(&o));
        let killed = dir.join(format!("{tag}-killed"));
        let o = run(
            &dir,
            &cfg,
            &killed,
            &extra,
            &[("FERROTUNE_KILL_AFTER_STEP", "7")],
        );
        assert!(
            !o.status.success(),
            "{component}: the run should have been killed"
        );
        let state = load(&killed.join("step_4/recipe_state/optimizer.safetensors"));
        assert!(
            state.keys().any(|k| k.ends_with("exp_avg_codes")),
            "{component}: the checkpoint holds the codes"
        );
        let mut resume = extra.to_vec();
        resume.push("resume_from_checkpoint=true");
        let o = run(&dir, &cfg, &killed, &resume, &[]);
        assert!(o.status.success(), "{}", text(&o));
        let want = losses(&metrics_lines(&straight.join("logs/metrics.jsonl")));
        let got = losses(&metrics_lines(&killed.join("logs/metrics.jsonl")));
        assert_eq!(got, want, "{component}: resumed run differs");
        let a = load(&straight.join("epoch_2/model.safetensors"));
        let b = load(&killed.join("epoch_2/model.safetensors"));
        for (k, t) in &a {
            let d = (t - &b[k]).unwrap().abs().unwrap().max_all().unwrap();
            assert_eq!(d.to_scalar::<f32>().unwrap(), 0.0, "{component}: {k}");
        }
    }
}
