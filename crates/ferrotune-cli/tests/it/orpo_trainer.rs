//! ORPO, CPO, SimPO and IPO in the DPO recipes against TRL 1.16.0's whole trainers
//! (scripts/make_orpo_trainer_fixtures.py: `ORPOTrainer`, `CPOTrainer` with loss_type sigmoid and
//! simpo, `DPOTrainer` with loss_type ipo, each `train()` for one step), tokenization included:
//! the tiny Llama from its PEFT adapter, three pairs in one batch, one SGD step (lr 1, no
//! clipping, no schedule), as text rows (`stack_exchange_paired_dataset`, a tokenizer without a
//! chat template) and conversational rows (`preference_dataset` through the chat template). The
//! first logged loss and TRL's metrics equal the trainer's log, and every adapter tensor after the
//! step the trainer's; ORPO's full fine-tune (`full_dpo_distributed` on one rank) every weight.
//! IPO takes `DPOTrainer`'s tokenization (the prompt and prompt + answer + EOS tokenized apart and
//! split where they diverge, where the prompt's last token merges into the answer too), checked
//! on the text rows, the conversational rows and multi-turn conversational rows (no token of the
//! shared prompt labelled, its earlier assistant turn included).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common::{
    self, ferrotune, fixtures, load, metrics_lines, read_json, rel_l2, text, tmpdir,
};

/// The loss's component and the parameters it takes, by case kind.
fn loss(kind: &str) -> (&'static str, &'static [&'static str]) {
    match kind {
        "orpo" => ("ORPOLoss", &["beta"]),
        "cpo" => ("CPOLoss", &["beta", "label_smoothing", "cpo_alpha"]),
        "simpo" => (
            "SimPOLoss",
            &["beta", "simpo_gamma", "label_smoothing", "cpo_alpha"],
        ),
        _ => ("IPOLoss", &["beta"]),
    }
}

/// The tiny Llama's tokenizer without its chat template (TRL's text rows).
fn plain_tokenizer(dir: &Path) -> PathBuf {
    let tok = dir.join("plain-tokenizer");
    std::fs::create_dir_all(&tok).unwrap();
    let model = fixtures().join("llama3/model");
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "config.json",
        "generation_config.json",
    ] {
        std::fs::copy(model.join(f), tok.join(f)).unwrap();
    }
    tok
}

/// `lora_dpo_single_device` (or `recipe`) with the case's loss, dataset form and one SGD step on
/// the three pairs.
fn args(
    recipe: &str,
    cfg: &Path,
    out: &Path,
    kind: &str,
    form: &str,
    golden: &Value,
) -> Vec<String> {
    let (component, params) = loss(kind);
    let (builder, file) = match form {
        "text" => ("stack_exchange_paired_dataset", "text.jsonl"),
        "multi" => ("preference_dataset", "chat_multi.jsonl"),
        _ => ("preference_dataset", "chat.jsonl"),
    };
    let mut args: Vec<String> = vec![
        "run".into(),
        recipe.into(),
        "--config".into(),
        cfg.display().to_string(),
        format!("output_dir={}", out.display()),
        format!("loss._component_=torchtune.rlhf.loss.{component}"),
        format!("dataset._component_=torchtune.datasets.{builder}"),
        format!(
            "dataset.data_files={}",
            fixtures().join("orpo_trainer").join(file).display()
        ),
        "batch_size=3".into(),
        "optimizer._component_=torch.optim.SGD".into(),
        "optimizer.lr=1.0".into(),
        "optimizer.weight_decay=0.0".into(),
        "clip_grad_norm=null".into(),
        "max_steps_per_epoch=1".into(),
    ];
    let case = if recipe == "full_dpo_distributed" {
        "full_orpo".to_string()
    } else {
        format!("{kind}_{form}")
    };
    args.extend(
        params
            .iter()
            .map(|p| format!("loss.{p}={}", golden[&case]["params"][p])),
    );
    if form == "text" {
        let dir = out.parent().unwrap();
        args.push(format!("tokenizer.path={}", plain_tokenizer(dir).display()));
    }
    args
}

/// The first metrics line against TRL's first log: the loss to 1e-5 relative, the rewards and
/// each method's own metrics to a few f32 ulps of the log probabilities.
fn assert_log(first: &Value, log: &Value, kind: &str, case: &str) {
    let (got, want) = (
        first["loss"].as_f64().unwrap(),
        log["loss"].as_f64().unwrap(),
    );
    eprintln!("{case}: loss {got} vs TRL {want}");
    assert!(
        ((got - want) / want).abs() < 1e-5,
        "{case}: loss {got} vs TRL {want}"
    );
    let own: &[&str] = match kind {
        "orpo" => &["nll_loss", "log_odds_ratio", "log_odds_chosen"],
        "ipo" => &[],
        _ => &["nll_loss"],
    };
    for key in [
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "rewards/accuracies",
    ]
    .iter()
    .chain(own)
    {
        let (got, want) = (first[key].as_f64().unwrap(), log[key].as_f64().unwrap());
        assert!(
            (got - want).abs() <= 2e-5 * want.abs().max(1.0),
            "{case}: {key} {got} vs TRL {want}"
        );
    }
}

/// Every tensor of `trl` equals `saved` to 1e-5 relative L2, and the step itself (after − start)
/// too, so a run that did not train fails.
fn assert_weights(saved: &Path, trl: &Path, start: &Path, case: &str) {
    let (saved, trl, start) = (load(saved), load(trl), load(start));
    assert_eq!(saved.len(), trl.len(), "{case}: {:?}", saved.keys());
    let mut worst: f32 = 0.0;
    for (name, t) in &trl {
        let e = rel_l2(&saved[name], t);
        let moved = rel_l2(
            &(&saved[name] - &start[name]).unwrap(),
            &(t - &start[name]).unwrap(),
        );
        assert!(e < 1e-5, "{case}: {name}: relative L2 {e}");
        assert!(moved < 1e-3, "{case}: {name}: step relative L2 {moved}");
        worst = worst.max(e);
    }
    eprintln!("{case}: worst tensor relative L2 vs TRL {worst:.1e}");
}

fn golden() -> Value {
    let g: Value = read_json(fixtures().join("orpo_trainer/golden.json"));
    assert_eq!(g["trl"], "1.16.0");
    g
}

/// Each loss on each form of the rows: TRL's trainer's step.
#[test]
fn lora_preference_losses_step_as_trl_trainers() {
    let g = golden();
    let dir = tmpdir("orpo-trainer", "lora");
    let data = fixtures().join("orpo_trainer/chat.jsonl");
    let cfg = common::write_config(common::TINY_LORA, &dir, "llama3", &data);
    let adapter = fixtures().join("llama3/adapter");
    for kind in ["orpo", "cpo", "simpo", "ipo"] {
        // IPO is DPOTrainer's, also on multi-turn rows, where its labels differ from torchtune's.
        let forms: &[&str] = if kind == "ipo" {
            &["text", "chat", "multi"]
        } else {
            &["text", "chat"]
        };
        for &form in forms {
            let case = format!("{kind}_{form}");
            let out = dir.join(&case);
            let mut a = args("lora_dpo_single_device", &cfg, &out, kind, form, &g);
            a.push(format!(
                "checkpointer.adapter_checkpoint={}",
                adapter.display()
            ));
            let o = ferrotune(&a, &dir, &[]);
            assert!(o.status.success(), "{case}: {}", text(&o));
            let first = &metrics_lines(&out.join("logs/metrics.jsonl"))[0];
            assert_log(first, &g[&case]["log"], kind, &case);
            assert_weights(
                &out.join("epoch_0/adapter_model.safetensors"),
                &fixtures().join(format!("orpo_trainer/{case}_adapter.safetensors")),
                &adapter.join("adapter_model.safetensors"),
                &case,
            );
        }
    }
}

/// ORPO's full fine-tune on one rank: TRL's `ORPOTrainer` training every weight.
#[test]
fn full_orpo_steps_as_trl_orpo_trainer() {
    let g = golden();
    let dir = tmpdir("orpo-trainer", "full");
    let data = fixtures().join("orpo_trainer/chat.jsonl");
    let cfg = common::write_config(common::TINY_LORA, &dir, "llama3", &data);
    let out = dir.join("full");
    let a = args("full_dpo_distributed", &cfg, &out, "orpo", "chat", &g);
    let o = ferrotune(&a, &dir, &[]);
    assert!(o.status.success(), "{}", text(&o));
    let first = &metrics_lines(&out.join("logs/metrics.jsonl"))[0];
    assert_log(first, &g["full_orpo"]["log"], "orpo", "full_orpo");
    assert_weights(
        &out.join("epoch_0/model.safetensors"),
        &fixtures().join("orpo_trainer/full_orpo_model.safetensors"),
        &fixtures().join("llama3/model/model.safetensors"),
        "full_orpo",
    );
}
