//! `loss._component_: torchtune.rlhf.loss.KTOLoss` in the DPO recipes against TRL 1.16.0's own
//! `KTOTrainer` (scripts/make_kto_fixtures.py): the tiny Llama with its PEFT adapter, four
//! unpaired rows read by `ferrotune.datasets.unpaired_dataset`, one SGD step (lr 1, no clipping,
//! no schedule).

use std::path::Path;

use serde_json::Value;

use crate::common::{
    self, ferrotune, fixtures, load, metrics_lines, read_json, rel_l2, text, tmpdir,
};

/// A DPO config turned KTO: the loss, the dataset builder, one SGD step (lr 1) from the PEFT
/// adapter on the four rows in one batch.
fn kto_args(cfg: &Path, out: &Path, data: &Path, extra: &[String]) -> Vec<String> {
    let adapter = fixtures().join("llama3/adapter");
    let mut args: Vec<String> = vec![
        "run".into(),
        "lora_dpo_single_device".into(),
        "--config".into(),
        cfg.display().to_string(),
        format!("output_dir={}", out.display()),
        format!("checkpointer.adapter_checkpoint={}", adapter.display()),
        "loss._component_=torchtune.rlhf.loss.KTOLoss".into(),
        "dataset._component_=ferrotune.datasets.unpaired_dataset".into(),
        format!("dataset.data_files={}", data.display()),
        "batch_size=4".into(),
        "optimizer._component_=torch.optim.SGD".into(),
        "optimizer.lr=1.0".into(),
        "optimizer.weight_decay=0.0".into(),
        "clip_grad_norm=null".into(),
        "max_steps_per_epoch=1".into(),
    ];
    args.extend(extra.iter().cloned());
    args
}

/// The golden rows as TRL's unpaired JSON lines.
fn write_rows(golden: &Value, path: &Path) {
    let rows = &golden["rows"];
    let lines: Vec<String> = (0..4)
        .map(|i| {
            serde_json::json!({
                "prompt": rows["prompt"][i],
                "completion": rows["completion"][i],
                "label": rows["label"][i],
            })
            .to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

/// Each case of the fixture (`kto` twice weighted, `apo_zero_unpaired`): the first logged loss
/// equals TRL's to 1e-5 relative, its metrics to a few f32 ulps of the log probabilities, and the
/// saved adapter TRL's after its step.
#[test]
fn lora_kto_steps_as_trl_kto_trainer() {
    let dir = tmpdir("kto", "lora");
    let golden: Value = read_json(fixtures().join("kto/golden.json"));
    assert_eq!(golden["trl"], "1.16.0");
    let data = dir.join("rows.jsonl");
    write_rows(&golden, &data);
    let cfg = common::write_config(common::TINY_LORA, &dir, "llama3", &data);
    for case in ["kto", "kto_weighted", "apo_zero_unpaired"] {
        let w = &golden[case];
        let out_dir = dir.join(case);
        let params: Vec<String> = [
            "beta",
            "desirable_weight",
            "undesirable_weight",
            "loss_type",
        ]
        .iter()
        .map(|k| match &w[k] {
            Value::String(s) => format!("loss.{k}={s}"),
            v => format!("loss.{k}={v}"),
        })
        .collect();
        let args = kto_args(&cfg, &out_dir, &data, &params);
        let out = ferrotune(&args, &dir, &[]);
        assert!(out.status.success(), "{case}: {}", text(&out));
        let first = &metrics_lines(&out_dir.join("logs/metrics.jsonl"))[0];
        let log = &w["log"];
        let (got, want) = (
            first["loss"].as_f64().unwrap(),
            log["loss"].as_f64().unwrap(),
        );
        assert!(
            ((got - want) / want).abs() < 1e-5,
            "{case}: loss {got} vs TRL {want}"
        );
        eprintln!("{case}: loss {got} vs TRL {want}");
        let mut keys = vec![
            "rewards/chosen",
            "rewards/rejected",
            "rewards/margins",
            "logps/chosen",
            "logps/rejected",
        ];
        if case != "apo_zero_unpaired" {
            keys.push("kl");
        }
        for key in ["logits/chosen", "logits/rejected"] {
            // Means over the vocabulary near 1e-4, formed another way than TRL's (the mean
            // hidden state against the head's mean row).
            let (got, want) = (first[key].as_f64().unwrap(), log[key].as_f64().unwrap());
            eprintln!("{case}: {key} {got} vs TRL {want}");
            assert!(
                (got - want).abs() <= 1e-4 * want.abs() + 1e-9,
                "{case}: {key} {got} vs TRL {want}"
            );
        }
        for key in keys {
            let (got, want) = (first[key].as_f64().unwrap(), log[key].as_f64().unwrap());
            // Differences of f32 log probabilities near -50 (an ulp is 3.8e-6).
            let tol = 2e-5 * want.abs().max(1.0);
            assert!(
                (got - want).abs() <= tol,
                "{case}: {key} {got} vs TRL {want}"
            );
        }
        let saved = load(&out_dir.join("epoch_0/adapter_model.safetensors"));
        let trl = load(&fixtures().join(format!("kto/{case}_adapter.safetensors")));
        assert_eq!(saved.len(), trl.len(), "{case}: {:?}", saved.keys());
        let mut worst: f32 = 0.0;
        for (name, t) in &trl {
            let e = rel_l2(&saved[name], t);
            assert!(e < 1e-5, "{case}: {name}: relative L2 {e}");
            worst = worst.max(e);
        }
        eprintln!("{case}: worst adapter relative L2 vs TRL {worst:.1e}");
    }
}

/// A paired preference dataset (`prompt`, `chosen`, `rejected`) given to KTO is split as TRL's
/// `unpair_preference_dataset` splits it (every chosen row, then every rejected one): the run
/// equals the one on those unpaired rows written out in that order, and differs from one on
/// another order (the KL rows pair each prompt with the previous row's completion). A key the
/// loss or the builder does not take is refused naming it, and so are unpaired rows under another
/// preference loss.
#[test]
fn kto_splits_pairs_as_trl_and_names_wrong_keys() {
    let dir = tmpdir("kto", "pairs");
    let (a, b) = ("The sky is", "A cat says");
    let pairs = [
        serde_json::json!({"prompt": a, "chosen": " blue", "rejected": " five, surely not four"}),
        serde_json::json!({"prompt": b, "chosen": " meow", "rejected": " a low heat of ten"}),
    ];
    let row = |p: &str, c: &str, l: bool| {
        serde_json::json!({"prompt": p, "completion": c, "label": l}).to_string()
    };
    let trl_order = [
        row(a, " blue", true),
        row(b, " meow", true),
        row(a, " five, surely not four", false),
        row(b, " a low heat of ten", false),
    ];
    let other_order = [
        trl_order[0].clone(),
        trl_order[2].clone(),
        trl_order[1].clone(),
        trl_order[3].clone(),
    ];
    let write = |name: &str, lines: &[String]| {
        let path = dir.join(name);
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        path
    };
    let paired = write(
        "pairs.jsonl",
        &pairs.iter().map(|p| p.to_string()).collect::<Vec<_>>(),
    );
    let unpaired = write("unpaired.jsonl", &trl_order);
    let shuffled = write("other.jsonl", &other_order);
    let cfg = common::write_config(common::TINY_LORA, &dir, "llama3", &paired);
    let run = |name: &str, data: &Path| -> Value {
        let out_dir = dir.join(name);
        let args = kto_args(&cfg, &out_dir, data, &["loss.beta=0.3".into()]);
        let out = ferrotune(&args, &dir, &[]);
        assert!(out.status.success(), "{name}: {}", text(&out));
        metrics_lines(&out_dir.join("logs/metrics.jsonl"))[0].clone()
    };
    let (from_pairs, from_rows, other) = (
        run("pairs", &paired),
        run("rows", &unpaired),
        run("other", &shuffled),
    );
    for key in ["loss", "kl", "rewards/chosen", "logps/rejected"] {
        assert_eq!(from_pairs[key], from_rows[key], "{key}");
    }
    // The SmolLM2 DPO demo's layout: the prompt in `input`, renamed by `column_map` (the DPO
    // config's own dataset section, its builder switched).
    let renamed: Vec<String> = pairs
        .iter()
        .map(|p| {
            serde_json::json!({"input": p["prompt"], "chosen": p["chosen"], "rejected": p["rejected"]})
                .to_string()
        })
        .collect();
    let renamed = write("input.jsonl", &renamed);
    let out_dir = dir.join("mapped");
    let extra = [
        "loss.beta=0.3".to_string(),
        "dataset.column_map={prompt: input, chosen: chosen, rejected: rejected}".into(),
        "dataset.train_on_input=false".into(),
    ];
    let out = ferrotune(&kto_args(&cfg, &out_dir, &renamed, &extra), &dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let mapped = metrics_lines(&out_dir.join("logs/metrics.jsonl"))[0].clone();
    for key in ["loss", "kl", "rewards/chosen", "logps/rejected"] {
        assert_eq!(mapped[key], from_rows[key], "column_map: {key}");
    }
    assert_ne!(from_pairs["kl"], other["kl"]);

    let refused = |extra: &[&str], needle: &str| {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let args = kto_args(&cfg, &dir.join("refused"), &unpaired, &extra);
        let out = ferrotune(&args, &dir, &[]);
        assert!(!out.status.success(), "{extra:?}");
        assert!(text(&out).contains(needle), "{}", text(&out));
    };
    refused(
        &["loss.label_smoothing=0.1"],
        "loss.label_smoothing is not a parameter of torchtune.rlhf.loss.KTOLoss",
    );
    refused(&["loss.loss_type=bco"], "loss_type \"bco\"");
    refused(&["batch_size=8"], "the dataset has 4 rows");
    refused(
        &["dataset.conversation_column=q"],
        "dataset.conversation_column is not a key of ferrotune.datasets.unpaired_dataset",
    );
    refused(
        &["dataset.column_map={answer: q}"],
        "dataset.column_map.answer: the columns are prompt, completion, label, chosen, rejected",
    );
    refused(
        &["loss._component_=torchtune.rlhf.loss.DPOLoss"],
        "holds unpaired rows: they train with loss._component_ torchtune.rlhf.loss.KTOLoss",
    );
}

/// Full fine-tuning (`full_dpo_distributed` on one rank, the reference a frozen copy of the
/// base): one SGD step (lr 1) on the four rows gives TRL's `KTOTrainer` with its `ref_model` —
/// the loss (0.5: policy and reference start equal, so every log ratio and the KL estimate are 0)
/// and every weight after the step.
#[test]
fn full_kto_steps_as_trl_kto_trainer() {
    let dir = tmpdir("kto", "full");
    let golden: Value = read_json(fixtures().join("kto/golden.json"));
    let data = dir.join("rows.jsonl");
    write_rows(&golden, &data);
    let cfg = common::write_config(common::TINY_LORA, &dir, "llama3", &data);
    let out_dir = dir.join("out");
    let mut args = kto_args(&cfg, &out_dir, &data, &["loss.beta=0.3".into()]);
    args[1] = "full_dpo_distributed".into();
    // No adapter: every weight trains.
    args.retain(|a| !a.starts_with("checkpointer.adapter_checkpoint"));
    let out = ferrotune(&args, &dir, &[]);
    assert!(out.status.success(), "{}", text(&out));
    let log = &golden["full_kto"]["log"];
    let first = &metrics_lines(&out_dir.join("logs/metrics.jsonl"))[0];
    for key in [
        "loss",
        "kl",
        "rewards/chosen",
        "logps/chosen",
        "logps/rejected",
    ] {
        let (got, want) = (first[key].as_f64().unwrap(), log[key].as_f64().unwrap());
        let tol = 1e-5 * want.abs().max(1.0);
        assert!((got - want).abs() <= tol, "{key} {got} vs TRL {want}");
    }
    let saved = load(&out_dir.join("epoch_0/model.safetensors"));
    let trl = load(&fixtures().join("kto/full_kto_model.safetensors"));
    let start = load(&fixtures().join("llama3/model/model.safetensors"));
    assert_eq!(saved.len(), trl.len());
    let mut worst: f32 = 0.0;
    for (name, t) in &trl {
        let e = rel_l2(&saved[name], t);
        // The step itself (TRL's after − start), compared as a move: a loss that did not
        // train would leave the weights at the start and fail here.
        let moved = rel_l2(
            &(&saved[name] - &start[name]).unwrap(),
            &(t - &start[name]).unwrap(),
        );
        assert!(e < 1e-5, "{name}: relative L2 {e}");
        assert!(moved < 1e-3, "{name}: step relative L2 {moved}");
        worst = worst.max(e);
    }
    eprintln!("full: worst weight relative L2 vs TRL {worst:.1e}");
}

/// Two ranks of two rows each (rank r takes rows r and r + 2): TRL's loss averages its
/// micro-batches' KL estimates over the ranks before the loss. Without a KL estimate
/// (`apo_zero_unpaired`) the step is the one-device step over the four rows, so LoRA equals TRL's
/// golden; with `kto` the logged `kl` is the mean of each rank's (each from its own two rows'
/// rotation, as one device gives on those rows alone), and the rewards are the rows' own.
/// Full fine-tuning against a frozen copy on two ranks (the policy sharded) equals TRL's full
/// step (its KL estimate is 0 on every rank).
#[test]
fn kto_on_two_ranks_averages_the_kl_estimate_as_trl() {
    let dir = tmpdir("kto", "ranks");
    let golden: Value = read_json(fixtures().join("kto/golden.json"));
    let data = dir.join("rows.jsonl");
    write_rows(&golden, &data);
    let cfg = common::write_config(common::TINY_LORA, &dir, "llama3", &data);
    let run = |name: &str, nproc: usize, recipe: &str, data: &Path, extra: &[&str]| -> Value {
        let out_dir = dir.join(name);
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        let mut args = kto_args(&cfg, &out_dir, data, &extra);
        args[1] = recipe.into();
        if nproc > 1 {
            args.splice(1..1, ["--nproc-per-node".to_string(), nproc.to_string()]);
        }
        let out = ferrotune(&args, &dir, &[]);
        assert!(out.status.success(), "{name}: {}", text(&out));
        metrics_lines(&out_dir.join("logs/metrics.jsonl"))[0].clone()
    };
    let close = |got: &Value, want: &Value, key: &str, what: &str| {
        let (g, w) = (got[key].as_f64().unwrap(), want[key].as_f64().unwrap());
        assert!(
            (g - w).abs() <= 2e-5 * w.abs().max(1.0),
            "{what}: {key} {g} vs {w}"
        );
    };
    let two = ["batch_size=2"];

    // apo_zero_unpaired: TRL's one-device step.
    let apo = &golden["apo_zero_unpaired"];
    let params = [
        "loss.loss_type=apo_zero_unpaired".to_string(),
        format!("loss.beta={}", apo["beta"]),
        format!("loss.undesirable_weight={}", apo["undesirable_weight"]),
    ];
    let mut extra: Vec<&str> = params.iter().map(String::as_str).collect();
    extra.extend(two);
    let got = run("apo", 2, "lora_dpo_distributed", &data, &extra);
    for key in ["loss", "rewards/chosen", "rewards/rejected", "logps/chosen"] {
        close(&got, &apo["log"], key, "apo on two ranks vs TRL");
    }
    let saved = load(&dir.join("apo/epoch_0/adapter_model.safetensors"));
    let trl = load(&fixtures().join("kto/apo_zero_unpaired_adapter.safetensors"));
    for (name, t) in &trl {
        let e = rel_l2(&saved[name], t);
        assert!(e < 1e-5, "apo on two ranks: {name}: relative L2 {e}");
    }

    // kto: the ranks' mean KL estimate. Rank 0 takes golden rows 1 and 3, rank 1 rows 2 and 3
    // (rows whose two-row estimates are positive, so that the clamp of each is the estimate
    // the mean reads).
    let rows: Vec<String> = std::fs::read_to_string(&data)
        .unwrap()
        .lines()
        .map(str::to_string)
        .collect();
    let file = |name: &str, picked: &[usize]| {
        let path = dir.join(name);
        let lines: Vec<&str> = picked.iter().map(|&i| rows[i].as_str()).collect();
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        path
    };
    let rank0 = run(
        "rank0",
        1,
        "lora_dpo_single_device",
        &file("r0.jsonl", &[1, 3]),
        &two,
    );
    let rank1 = run(
        "rank1",
        1,
        "lora_dpo_single_device",
        &file("r1.jsonl", &[2, 3]),
        &two,
    );
    let kl_of = |v: &Value| v["kl"].as_f64().unwrap();
    assert!(
        kl_of(&rank0) > 0.0 && kl_of(&rank1) > 0.0,
        "{rank0} {rank1}"
    );
    let both = file("both.jsonl", &[1, 2, 3, 3]);
    let got = run("kto", 2, "lora_dpo_distributed", &both, &two);
    let want = (kl_of(&rank0) + kl_of(&rank1)) / 2.0;
    assert!(
        (kl_of(&got) - want).abs() <= 2e-5,
        "kl {} vs the ranks' mean {want}",
        kl_of(&got)
    );
    // The rewards, before any step, are each row's: rank 0's two undesirable rows, rank 1's
    // desirable and undesirable one.
    let reward = |v: &Value, k: &str| v[k].as_f64().unwrap();
    let rejected =
        (2.0 * reward(&rank0, "rewards/rejected") + reward(&rank1, "rewards/rejected")) / 3.0;
    for (key, want) in [
        ("rewards/chosen", reward(&rank1, "rewards/chosen")),
        ("rewards/rejected", rejected),
    ] {
        let g = reward(&got, key);
        assert!(
            (g - want).abs() <= 2e-5,
            "kto on two ranks: {key} {g} vs {want}"
        );
    }
    // The loss reads the ranks' mean estimate (not each rank its own): from each row's reward
    // (row 3's is rank 1's rejected one, row 1's the rest of rank 0's), TRL's loss with it.
    let beta = 0.1;
    let (r2, r3) = (
        reward(&rank1, "rewards/chosen"),
        reward(&rank1, "rewards/rejected"),
    );
    let r1 = 2.0 * reward(&rank0, "rewards/rejected") - r3;
    let sigmoid = |x: f64| 1.0 / (1.0 + (-x).exp());
    let z = beta * want;
    let loss =
        ((1.0 - sigmoid(r2 - z)) + (1.0 - sigmoid(z - r1)) + 2.0 * (1.0 - sigmoid(z - r3))) / 4.0;
    let g = got["loss"].as_f64().unwrap();
    assert!(
        ((g - loss) / loss).abs() < 1e-5,
        "kto on two ranks: loss {g} vs {loss}"
    );
    // Each rank's own estimate would give another loss.
    let own = ((1.0 - sigmoid(r2 - beta * kl_of(&rank1)))
        + (1.0 - sigmoid(beta * kl_of(&rank0) - r1))
        + (1.0 - sigmoid(beta * kl_of(&rank0) - r3))
        + (1.0 - sigmoid(beta * kl_of(&rank1) - r3)))
        / 4.0;
    assert!(((own - loss) / loss).abs() > 1e-5, "{own} vs {loss}");

    // Full fine-tuning, the policy sharded over the two ranks.
    let full = &golden["full_kto"]["log"];
    let mut args = vec!["loss.beta=0.3", "checkpointer.adapter_checkpoint=null"];
    args.extend(two);
    let got = run("full", 2, "full_dpo_distributed", &data, &args);
    for key in ["loss", "logps/chosen", "logps/rejected"] {
        close(&got, full, key, "full on two ranks vs TRL");
    }
    let saved = load(&dir.join("full/epoch_0/model.safetensors"));
    let trl = load(&fixtures().join("kto/full_kto_model.safetensors"));
    for (name, t) in &trl {
        let e = rel_l2(&saved[name], t);
        assert!(e < 1e-5, "full on two ranks: {name}: relative L2 {e}");
    }
}
