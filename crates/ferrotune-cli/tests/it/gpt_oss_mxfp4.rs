//! QLoRA on gpt-oss with its MXFP4 experts held packed (`model.quantize_base`,
//! tests/fixtures/gpt_oss_mxfp4) against the same run with them dequantized on load
//! (`FERROTUNE_MXFP4_PACKED=0`): one SGD step (lr 1) of `lora_finetune_single_device` with
//! adapters on the attention and on both fused experts (`target_parameters`) logs the same loss,
//! and saves the same adapter and the same merged model.

use crate::common;

use std::path::Path;

use serde_json::Value;

use common::{fixtures, load, metrics_lines, text};

const FAMILY: &str = "gpt_oss_mxfp4";

/// One SGD step (lr 1) in `dir`, `env` added; returns the run's output.
fn one_step(dir: &Path, env: &[(&str, &str)]) -> std::process::Output {
    let g: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join(FAMILY).join("golden.json")).unwrap(),
    )
    .unwrap();
    let ids: Vec<Value> = serde_json::from_value(g["input_ids"].clone()).unwrap();
    let rows: Vec<String> = ids
        .iter()
        .map(|i| serde_json::json!({"input_ids": i, "labels": i}).to_string())
        .collect();
    let data = dir.join("batch.jsonl");
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    let cfg = common::write_config(common::TINY_LORA, dir, FAMILY, &data);
    let args = [
        "run",
        "lora_finetune_single_device",
        "--config",
        cfg.to_str().unwrap(),
        "model.quantize_base=true",
        "model.target_parameters=[mlp.experts.gate_up_proj,mlp.experts.down_proj]",
        "optimizer._component_=torch.optim.SGD",
        "optimizer.lr=1.0",
        "optimizer.weight_decay=0.0",
        "clip_grad_norm=null",
        "max_steps_per_epoch=1",
    ];
    common::ferrotune(&args, dir, env)
}

#[test]
fn packed_mxfp4_experts_train_as_the_dequantized_ones() {
    let packed_dir = common::tmpdir("gpt-oss-mxfp4", "packed");
    let dense_dir = common::tmpdir("gpt-oss-mxfp4", "dequantized");
    let packed = one_step(&packed_dir, &[]);
    assert!(packed.status.success(), "{}", text(&packed));
    let dense = one_step(&dense_dir, &[("FERROTUNE_MXFP4_PACKED", "0")]);
    assert!(dense.status.success(), "{}", text(&dense));
    assert!(
        text(&packed).contains("6 gpt-oss expert weights kept as MXFP4"),
        "{}",
        text(&packed)
    );
    assert!(!text(&dense).contains("kept as MXFP4"), "{}", text(&dense));
    let loss = |dir: &Path| {
        metrics_lines(&dir.join("out/logs/metrics.jsonl"))[0]["loss"]
            .as_f64()
            .unwrap()
    };
    let (p, d) = (loss(&packed_dir), loss(&dense_dir));
    assert!(
        ((p - d) / d).abs() <= 1e-6,
        "loss {p} packed vs {d} dequantized"
    );
    for file in ["adapter_model.safetensors", "merged/model.safetensors"] {
        let (a, b) = (
            load(&packed_dir.join("out/epoch_0").join(file)),
            load(&dense_dir.join("out/epoch_0").join(file)),
        );
        assert_eq!(a.len(), b.len(), "{file}");
        for (k, t) in &a {
            let err = common::rel_l2(t, &b[k]);
            assert!(err <= 1e-5, "{file} {k}: relative L2 {err}");
        }
    }
    let merged = load(&packed_dir.join("out/epoch_0/merged/model.safetensors"));
    assert_eq!(
        merged["model.layers.0.mlp.experts.down_proj"].dims(),
        [4, 32, 32]
    );
    assert!(!merged.keys().any(|k| k.ends_with("_blocks")));
    std::fs::remove_dir_all(&packed_dir).ok();
    std::fs::remove_dir_all(&dense_dir).ok();
}
