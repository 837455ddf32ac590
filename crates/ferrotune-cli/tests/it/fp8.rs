//! FP8 block-quantized checkpoints through the CLI (tests/fixtures/fp8, made by
//! `scripts/make_fp8_fixtures.py` with transformers 5.24): `generate` gives transformers' 16
//! greedy tokens, and LoRA trains from them, saving an adapter and a plain merged model.

use std::path::Path;

use serde_json::Value;

use crate::common::{self, read_json};
use ferrotune_testing::fixtures;

fn ids(v: &Value) -> Vec<u64> {
    serde_json::from_value(v.clone()).unwrap()
}

/// `generate --json` of 16 greedy tokens after the golden's prompt ids equals transformers'
/// greedy tokens, for DeepSeek-V3 (partial blocks) and Qwen3.
#[test]
fn fp8_checkpoints_generate_transformers_greedy_tokens() {
    for case in ["deepseek_v3", "qwen3"] {
        let dir = fixtures().join("fp8").join(case);
        let g: Value = read_json(dir.join("golden.json"));
        let prompt: Vec<String> = ids(&g["greedy_prompt"])
            .iter()
            .map(u64::to_string)
            .collect();
        let model = dir.join("model");
        let out = common::ferrotune(
            &[
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--prompt-ids",
                &prompt.join(","),
                "--max-new-tokens",
                "16",
                "--ignore-eos",
                "--temperature",
                "0",
                "--json",
            ],
            Path::new("."),
            &[],
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{case}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let j: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        assert_eq!(
            ids(&j["new_token_ids"]),
            ids(&g["greedy_new_tokens"]),
            "{case}"
        );
    }
}

/// One `lora_finetune_single_device` step from the FP8 DeepSeek-V3: the loss is finite, the
/// adapter is saved, and the merged model is a plain checkpoint (no `quantization_config`, no
/// `weight_scale_inv`, the matrices without adapters the dequantized FP8 weights).
#[test]
fn lora_trains_from_an_fp8_checkpoint() {
    let family = "fp8/deepseek_v3";
    let dir = common::tmpdir("fp8", "lora");
    let g: Value = read_json(fixtures().join(family).join("golden.json"));
    let rows: Vec<String> = g["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| serde_json::json!({ "input_ids": i }).to_string())
        .collect();
    let data = dir.join("rows.jsonl");
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    let cfg = common::write_config(common::TINY_LORA, &dir, family, &data);
    let out = common::ferrotune(
        &[
            "run",
            "lora_finetune_single_device",
            "--config",
            cfg.to_str().unwrap(),
            "model.lora_attn_modules=[q_b_proj,kv_b_proj,o_proj]",
            "max_steps_per_epoch=1",
        ],
        &dir,
        &[],
    );
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    let metrics = common::metrics_lines(&dir.join("out/logs/metrics.jsonl"));
    let loss = metrics[0]["loss"].as_f64().unwrap();
    assert!(loss.is_finite() && loss > 0.0, "{loss}");
    let epoch = dir.join("out/epoch_0");
    let adapter = common::load(&epoch.join("adapter_model.safetensors"));
    assert!(
        adapter.keys().any(|k| k.contains("kv_b_proj.lora_A")),
        "{adapter:?}"
    );
    let merged = common::load(&epoch.join("merged/model.safetensors"));
    assert!(!merged.keys().any(|k| k.ends_with("_scale_inv")));
    // A matrix without an adapter is saved as ferrotune read it: the dequantized FP8 weight.
    let base = ferrotune_models::read_checkpoint(
        &fixtures().join(family).join("model"),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap()
    .tensors;
    let name = "model.layers.1.mlp.experts.3.down_proj.weight";
    let diff = (&merged[name] - &base[name])
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(diff, 0.0, "{name}");
    let config: Value = read_json(epoch.join("merged/config.json"));
    assert!(config.get("quantization_config").is_none(), "{config}");
    let _ = std::fs::remove_dir_all(&dir);
}
