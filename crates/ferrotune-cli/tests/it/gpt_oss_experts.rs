//! LoRA on gpt-oss's fused experts (PEFT's `target_parameters`) through
//! `ferrotune run lora_finetune_single_device`: one SGD step (lr 1) from PEFT's adapter
//! (tests/fixtures/target_parameters/gpt_oss) logs PEFT's loss and saves `start − gradient` under
//! PEFT's names with a merged model; fresh adapters from `model.target_parameters` train and save
//! as PEFT holds them; the key is refused for other families.

use crate::common;

use std::path::Path;

use serde_json::Value;

use common::{fixtures, load, metrics_lines, read_json, rel_l2, text};

const FAMILY: &str = "models/gpt_oss";
const CASE: &str = "target_parameters/gpt_oss";

/// The golden batch of `case` as a tokenized dataset's rows.
fn write_rows(case: &Path, path: &Path) {
    let g: Value = read_json(case.join("golden.json"));
    let ids: Vec<Value> = serde_json::from_value(g["input_ids"].clone()).unwrap();
    let labels: Vec<Value> = serde_json::from_value(g["labels"].clone()).unwrap();
    let lines: Vec<String> = ids
        .iter()
        .zip(labels)
        .map(|(i, l)| serde_json::json!({"input_ids": i, "labels": l}).to_string())
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

/// Runs one SGD step (lr 1) of `lora_finetune_single_device` on `family` in `dir` with `extra`
/// overrides; returns the run's output.
fn one_step(dir: &Path, family: &str, extra: &[&str]) -> std::process::Output {
    let case = fixtures().join(CASE);
    let data = dir.join("batch.jsonl");
    write_rows(&case, &data);
    let cfg = common::write_config(common::TINY_LORA, dir, family, &data);
    let mut args = vec![
        "run",
        "lora_finetune_single_device",
        "--config",
        cfg.to_str().unwrap(),
        "optimizer._component_=torch.optim.SGD",
        "optimizer.lr=1.0",
        "optimizer.weight_decay=0.0",
        "lr_scheduler=null",
        "clip_grad_norm=null",
        "max_steps_per_epoch=1",
        "shuffle=false",
    ];
    args.extend(extra);
    common::ferrotune(&args, dir, &[])
}

/// From PEFT's adapter on both fused experts (nested, rank 3 on down_proj) and q/o_proj: the
/// first loss is PEFT's, the saved adapter is `start − gradient` with PEFT's gradients (1e-4
/// relative L2) under PEFT's names and config, and the folder holds the merged model.
#[test]
fn one_sgd_step_from_pefts_expert_adapter_saves_start_minus_gradient() {
    let case = fixtures().join(CASE);
    let dir = common::tmpdir("gpt-oss-experts", "from-peft");
    let adapter = case.join("adapter");
    let out = one_step(
        &dir,
        FAMILY,
        &[&format!(
            "checkpointer.adapter_checkpoint={}",
            adapter.display()
        )],
    );
    assert!(out.status.success(), "{}", text(&out));
    let first = &metrics_lines(&dir.join("out/logs/metrics.jsonl"))[0];
    let golden: Value = read_json(case.join("golden.json"));
    let (got, want) = (
        first["loss"].as_f64().unwrap(),
        golden["lora_loss"].as_f64().unwrap(),
    );
    assert!(
        ((got - want) / want).abs() < 1e-5,
        "loss {got} vs PEFT {want}"
    );
    let saved_dir = dir.join("out/epoch_0");
    let saved = load(&saved_dir.join("adapter_model.safetensors"));
    let start = load(&adapter.join("adapter_model.safetensors"));
    let grads = load(&case.join("lora_grads.safetensors"));
    assert_eq!(saved.len(), start.len());
    assert!(start
        .keys()
        .any(|k| k.contains(".mlp.experts.base_layer.lora_A")));
    for (key, s) in &start {
        let e = rel_l2(&saved[key], &(s - &grads[key]).unwrap());
        assert!(e <= 1e-4, "{key}: relative L2 {e}");
    }
    let config: Value = read_json(saved_dir.join("adapter_config.json"));
    assert_eq!(
        config["target_parameters"],
        serde_json::json!(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    );
    let merged = load(&saved_dir.join("merged/model.safetensors"));
    assert_eq!(
        merged["model.layers.0.mlp.experts.gate_up_proj"].dims(),
        [4, 32, 48]
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// `model.target_parameters` trains fresh adapters on gpt-oss's experts (beside the attention's):
/// saved under PEFT's names and config, B moved from zero; the key on another family is refused
/// naming it.
#[test]
fn fresh_expert_adapters_train_from_model_target_parameters() {
    let dir = common::tmpdir("gpt-oss-experts", "fresh");
    let out = one_step(
        &dir,
        FAMILY,
        &["model.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]"],
    );
    assert!(out.status.success(), "{}", text(&out));
    let saved_dir = dir.join("out/epoch_0");
    let saved = load(&saved_dir.join("adapter_model.safetensors"));
    for layer in 0..3 {
        let stem = format!("base_model.model.model.layers.{layer}.mlp.experts");
        assert_eq!(
            saved[&format!("{stem}.base_layer.lora_A.weight")].dims(),
            [16, 32]
        );
        assert_eq!(saved[&format!("{stem}.lora_A.weight")].dims(), [16, 24]);
        let b = &saved[&format!("{stem}.lora_B.weight")];
        assert_eq!(b.dims(), [32, 16]);
        let moved = b
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(moved > 0.0, "{stem}: lora_B did not train");
    }
    let config: Value = read_json(saved_dir.join("adapter_config.json"));
    assert_eq!(
        config["target_parameters"],
        serde_json::json!(["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    );
    assert!(saved_dir.join("merged/model.safetensors").is_file());

    let other = common::tmpdir("gpt-oss-experts", "other-family");
    let out = one_step(
        &other,
        "models/mixtral",
        &["model.target_parameters=[mlp.experts.gate_up_proj]"],
    );
    assert!(!out.status.success());
    let log = text(&out);
    assert!(log.contains("model.target_parameters"), "{log}");
    std::fs::remove_dir_all(&dir).ok();
    std::fs::remove_dir_all(&other).ok();
}
