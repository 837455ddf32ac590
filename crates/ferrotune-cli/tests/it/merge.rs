//! `ferrotune merge` against PEFT's `merge_and_unload()` + `save_pretrained` (fixture `merged/`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{DType, Device, Tensor};

use crate::common::read_json;
use ferrotune_testing::fixtures;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferrotune-merge-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn merge(case: &str, out: &Path, extra: &[&str]) {
    let dir = fixtures().join(case);
    let status = Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .args(["merge", "--model"])
        .arg(dir.join("model"))
        .arg("--adapter")
        .arg(dir.join("adapter"))
        .arg("--output")
        .arg(out)
        .args(extra)
        .status()
        .unwrap();
    assert!(status.success());
}

/// All tensors of an HF folder (single file or shards), as f32.
fn read_all(dir: &Path) -> HashMap<String, Tensor> {
    let format = ferrotune_models::checkpoint::locate_weights(dir).unwrap();
    let ferrotune_models::CheckpointFormat::Safetensors(files) = format else {
        panic!("not safetensors")
    };
    ferrotune_models::checkpoint::read_safetensors(&files, DType::F32, &Device::Cpu).unwrap()
}

fn assert_same_tensors(got: &HashMap<String, Tensor>, want: &HashMap<String, Tensor>, tol: f32) {
    let mut got_names: Vec<_> = got.keys().collect();
    let mut want_names: Vec<_> = want.keys().collect();
    got_names.sort();
    want_names.sort();
    assert_eq!(got_names, want_names);
    for (name, w) in want {
        let d = (&got[name] - w)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d <= tol, "{name}: max abs difference {d}");
    }
}

#[test]
fn merged_weights_equal_peft_merge() {
    for case in ["llama3", "qwen2"] {
        let out = tmp(case);
        merge(case, &out, &[]);
        assert!(out.join("model.safetensors").is_file());
        assert!(out.join("tokenizer.json").is_file() && out.join("chat_template.jinja").is_file());
        let want = read_all(&fixtures().join(case).join("merged"));
        assert_same_tensors(&read_all(&out), &want, 1e-5);
        let config: serde_json::Value = read_json(out.join("config.json"));
        assert_eq!(config["torch_dtype"], "float32");
        // The merged folder is a complete checkpoint: it loads and runs.
        ferrotune_models::load_model(&out, DType::F32, &Device::Cpu).unwrap();
    }
}

#[test]
fn sharded_output_has_an_index_and_the_same_weights() {
    let out = tmp("sharded");
    merge("llama3", &out, &["--max-shard-size", "100KB"]);
    let index: serde_json::Value = read_json(out.join("model.safetensors.index.json"));
    let shards: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(shards.len() >= 3, "{shards:?}");
    for s in &shards {
        assert!(s.starts_with("model-0000") && out.join(s).is_file(), "{s}");
        let size = std::fs::metadata(out.join(s)).unwrap().len();
        // A shard only exceeds the limit when one tensor alone does (the 512x64 embedding: 131 KB).
        assert!(size <= 140_000, "{s}: {size} bytes");
    }
    assert!(!out.join("model.safetensors").exists());
    let want = read_all(&fixtures().join("llama3").join("merged"));
    assert_same_tensors(&read_all(&out), &want, 1e-5);
}

#[test]
fn bf16_output() {
    let out = tmp("bf16");
    merge("llama3", &out, &["--dtype", "bf16"]);
    let raw = candle_core::safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
    assert!(raw.values().all(|t| t.dtype() == DType::BF16));
    let want = read_all(&fixtures().join("llama3").join("merged"));
    // bf16 keeps 8 significant bits: within 1% of each value (weights here are O(0.1)).
    assert_same_tensors(&read_all(&out), &want, 5e-3);
}

#[test]
fn bad_arguments_are_clear_errors() {
    let dir = fixtures().join("llama3");
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .args(["merge", "--model"])
        .arg(dir.join("model"))
        .arg("--adapter")
        .arg(dir.join("adapter"))
        .args(["--output", "/tmp/x", "--max-shard-size", "huge"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("huge"));
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .args(["merge", "--model"])
        .arg(dir.join("model"))
        .args(["--adapter", "/no/adapter", "--output", "/tmp/x"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/no/adapter"));
}

/// From a GGUF base: an adapter applied on the fly (quantized-block path + adapter) and the merged
/// HF checkpoint (with the GGUF's tokenizer exported) generate the same greedy answer.
#[test]
fn gguf_base_merge_equals_adapter_on_the_fly() {
    use ferrotune_models::peft::{add_adapter, save_adapter};
    use ferrotune_models::{LoraConfig, TargetModules};

    let gguf = ferrotune_data::asset_path("SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
    let work = tmp("gguf");
    let adapter = work.join("adapter");
    let (mut model, _) = ferrotune_models::load_model(&gguf, DType::F32, &Device::Cpu).unwrap();
    let config = LoraConfig::new(
        4,
        8.0,
        TargetModules::Names(vec!["q_proj".into(), "v_proj".into(), "down_proj".into()]),
    );
    add_adapter(&mut model, &config, 1).unwrap();
    // PEFT initializes B to zero (a no-op adapter); make it count. Deterministic values (candle's
    // CPU generator cannot be seeded), so the answer changes the same way on every run.
    for (_, linear) in model.linears_mut() {
        if let Some(a) = linear.adapter.as_mut() {
            let n = a.b.elem_count();
            let values: Vec<f32> = (0..n).map(|i| (i as f32 * 0.7548).sin()).collect();
            a.b = Tensor::from_vec(values, a.b.dims(), &Device::Cpu).unwrap();
        }
    }
    save_adapter(&model, &config, &adapter).unwrap();
    let merged = work.join("merged");
    let status = Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .arg("merge")
        .arg("--model")
        .arg(&gguf)
        .arg("--adapter")
        .arg(&adapter)
        .arg("--output")
        .arg(&merged)
        .status()
        .unwrap();
    assert!(status.success());
    assert!(
        merged.join("tokenizer.json").is_file() && merged.join("tokenizer_config.json").is_file()
    );
    let answer = |extra: &[&std::ffi::OsStr]| -> serde_json::Value {
        let out = Command::new(env!("CARGO_BIN_EXE_ferrotune"))
            .args([
                "generate",
                "--chat",
                "--prompt",
                "What is the capital of France?",
            ])
            .args(["--max-new-tokens", "12", "--json"])
            .args(extra)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
    };
    let on_the_fly = answer(&[
        "--model".as_ref(),
        gguf.as_os_str(),
        "--adapter".as_ref(),
        adapter.as_os_str(),
    ]);
    let from_merged = answer(&["--model".as_ref(), merged.as_os_str()]);
    // Same prompt ids: the exported tokenizer and chat template behave like the GGUF's.
    assert_eq!(on_the_fly["prompt_ids"], from_merged["prompt_ids"]);
    assert_eq!(on_the_fly["new_token_ids"], from_merged["new_token_ids"]);
    let base = answer(&["--model".as_ref(), gguf.as_os_str()]);
    assert_ne!(
        base["new_token_ids"], on_the_fly["new_token_ids"],
        "the adapter changes the answer"
    );
}

/// `--quantize-base` merges a QLoRA adapter into the NF4 round trip of the base: a layer without
/// an adapter is exactly its dequantized NF4 weight, an adapted one that plus the adapter's delta;
/// the head is the base's.
#[test]
fn quantize_base_merges_into_the_nf4_round_trip() {
    use ferrotune_core::nf4::Nf4Matrix;
    let out = tmp("qlora");
    merge("nf4/qlora", &out, &["--quantize-base"]);
    let merged = read_all(&out);
    let base = read_all(&fixtures().join("nf4/qlora/model"));
    let adapter = ferrotune_models::checkpoint::read_safetensors(
        &[fixtures().join("nf4/qlora/adapter/adapter_model.safetensors")],
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let nf4 = |name: &str| {
        Nf4Matrix::quantize(&base[name])
            .unwrap()
            .dequantize()
            .unwrap()
    };
    let k = "model.layers.0.self_attn.k_proj.weight";
    let mut want = HashMap::new();
    want.insert(k.to_string(), nf4(k));
    let q = "model.layers.1.self_attn.q_proj";
    let a = &adapter[&format!("base_model.model.{q}.lora_A.weight")];
    let b = &adapter[&format!("base_model.model.{q}.lora_B.weight")];
    // r = 4, alpha = 8: scale 2.
    let delta = (b.matmul(a).unwrap() * 2.0).unwrap();
    let qw = format!("{q}.weight");
    want.insert(qw.clone(), (nf4(&qw) + delta).unwrap());
    want.insert("lm_head.weight".into(), base["lm_head.weight"].clone());
    let got: HashMap<String, Tensor> = want
        .keys()
        .map(|k| (k.clone(), merged[k].clone()))
        .collect();
    assert_same_tensors(&got, &want, 1e-6);
    // Without the flag the base is merged as stored: k_proj is the base's own weight.
    let plain = tmp("qlora-plain");
    merge("nf4/qlora", &plain, &[]);
    let plain = read_all(&plain);
    let diff = (&plain[k] - &merged[k])
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap();
    assert!(diff.to_scalar::<f32>().unwrap() > 1e-4);
}

#[test]
fn merge_keeps_peft_modules_to_save_with_a_resized_vocabulary() {
    // PEFT adapter with modules_to_save [embed_tokens, lm_head] over a vocabulary resized from 512
    // to 520 tokens; its folder also holds the tokenizer with the added tokens.
    let case = fixtures().join("peft_modules_to_save/resized");
    let adapter = tmp("mts-adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    for entry in std::fs::read_dir(case.join("adapter")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), adapter.join(entry.file_name())).unwrap();
    }
    let marker = "{\"version\": \"1.0\", \"marker\": \"the adapter's tokenizer\"}";
    std::fs::write(adapter.join("tokenizer.json"), marker).unwrap();
    let out = tmp("mts-out");
    let status = Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .args(["merge", "--model"])
        .arg(fixtures().join("models/llama2/model"))
        .arg("--adapter")
        .arg(&adapter)
        .arg("--output")
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let config: serde_json::Value = read_json(out.join("config.json"));
    assert_eq!(config["vocab_size"], 520);
    assert_eq!(
        std::fs::read_to_string(out.join("tokenizer.json")).unwrap(),
        marker
    );
    // The merged model computes PEFT's logits.
    let g: serde_json::Value = read_json(case.join("golden.json"));
    let rows: Vec<Vec<u32>> = serde_json::from_value(g["input_ids"].clone()).unwrap();
    let (b, t) = (rows.len(), rows[0].len());
    let ids = Tensor::from_vec(rows.concat(), (b, t), &Device::Cpu).unwrap();
    let (model, _) = ferrotune_models::load_model(&out, DType::F32, &Device::Cpu).unwrap();
    let got = model
        .forward(
            &ids,
            &ferrotune_models::AttentionLayout::causal(b, t, 0),
            None,
        )
        .unwrap();
    let want = candle_core::safetensors::load(case.join("golden.safetensors"), &Device::Cpu)
        .unwrap()
        .remove("logits")
        .unwrap();
    let d = ferrotune_testing::max_abs_diff(&got, &want);
    assert!(d < 1e-4, "max abs difference {d}");
}

/// A PEFT adapter on Llama 4's fused experts and router (`target_parameters`) merges into PEFT's
/// merged weights, written as `Llama4ForCausalLM` with the checkpoint's fused experts.
#[test]
fn llama4_expert_parameter_adapter_merges_as_peft() {
    let out = tmp("llama4-experts");
    let status = Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .args(["merge", "--model"])
        .arg(fixtures().join("models/llama4/model"))
        .arg("--adapter")
        .arg(fixtures().join("target_parameters/llama4/adapter"))
        .arg("--output")
        .arg(&out)
        .status()
        .unwrap();
    assert!(status.success());
    let want = ferrotune_models::checkpoint::read_safetensors(
        &[fixtures().join("target_parameters/llama4/merged.safetensors")],
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    assert_same_tensors(&read_all(&out), &want, 1e-5);
    std::fs::remove_dir_all(&out).ok();
}
