//! The `ferrotune` binary end to end: JSON contracts of `generate` and `tokenize`, and bad input
//! answered by one clear error line and a non-zero exit.

use std::process::{Command, Output};

use serde_json::Value;

use crate::common::read_json;
use ferrotune_testing::fixtures;

fn ferrotune(args: &[&str]) -> Output {
    // RUST_BACKTRACE set, as on many developer machines: errors must still be one line.
    Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .args(args)
        .env("RUST_BACKTRACE", "1")
        .output()
        .unwrap()
}

/// The last stdout line, parsed as JSON (the `--json` contract: one object, printed last).
fn last_json(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

/// Fails with exit code 1 and exactly one stderr line, which contains every `needles`.
fn assert_error(out: &Output, needles: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert_eq!(
        stderr.trim_end().lines().count(),
        1,
        "one line expected: {stderr}"
    );
    for n in needles {
        assert!(stderr.contains(n), "'{n}' missing from: {stderr}");
    }
}

fn golden_ids(v: &Value) -> Vec<u64> {
    serde_json::from_value(v.clone()).unwrap()
}

/// `generate --json`: 16 greedy tokens (`--temperature 0`, never stopping at EOS) after the
/// golden's `greedy_prompt` ids, with `extra` arguments (the model, an adapter, ...).
fn greedy_generation(golden: &Value, extra: &[&str]) -> Value {
    let prompt: Vec<String> = golden_ids(&golden["greedy_prompt"])
        .iter()
        .map(u64::to_string)
        .collect();
    let prompt = prompt.join(",");
    let mut args = vec![
        "generate",
        "--prompt-ids",
        &prompt,
        "--max-new-tokens",
        "16",
        "--ignore-eos",
        "--temperature",
        "0",
        "--json",
    ];
    args.extend_from_slice(extra);
    last_json(&ferrotune(&args))
}

fn smollm2() -> String {
    ferrotune_data::asset_path("SmolLM2-135M-Instruct.Q4_1.gguf")
        .unwrap()
        .display()
        .to_string()
}

#[test]
fn generate_json_with_prompt_ids_is_greedy_and_exact() {
    let g: Value = read_json(fixtures().join("llama3/golden.json"));
    let model = fixtures().join("llama3/model");
    let j = greedy_generation(&g, &["--model", model.to_str().unwrap()]);
    assert_eq!(
        golden_ids(&j["prompt_ids"]),
        golden_ids(&g["greedy_prompt"])
    );
    assert_eq!(
        golden_ids(&j["new_token_ids"]),
        golden_ids(&g["greedy_new_tokens"])
    );
    assert!(j["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(j["prefill_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(j["text"].is_string());
}

/// An adapter applied on the fly generates what PEFT's merged checkpoint generates.
#[test]
fn generate_with_adapter_equals_the_merged_model() {
    let g: Value = read_json(fixtures().join("llama3/golden.json"));
    let dir = fixtures().join("llama3");
    let run = |extra: &[&str]| golden_ids(&greedy_generation(&g, extra)["new_token_ids"]);
    let model = dir.join("model");
    let with_adapter = run(&[
        "--model",
        model.to_str().unwrap(),
        "--adapter",
        dir.join("adapter").to_str().unwrap(),
    ]);
    let merged = run(&[
        "--model",
        dir.join("merged").to_str().unwrap(),
        "--tokenizer",
        model.to_str().unwrap(),
    ]);
    assert_eq!(with_adapter, merged);
    assert_ne!(
        with_adapter,
        golden_ids(&g["greedy_new_tokens"]),
        "the adapter changes the output"
    );
    // The adapter folder given as the model: one line saying how to load it.
    let out = ferrotune(&[
        "generate",
        "--model",
        dir.join("adapter").to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    assert_error(&out, &["holds a PEFT adapter", "--adapter"]);
}

#[test]
fn generate_chat_with_smollm2_answers_like_transformers() {
    let golden: Value = read_json(fixtures().join("smollm2_golden.json"));
    let golden = &golden[0];
    let out = ferrotune(&[
        "generate",
        "--model",
        &smollm2(),
        "--chat",
        "--prompt",
        "What is the capital of France?",
        "--max-new-tokens",
        "32",
        "--json",
    ]);
    let j = last_json(&out);
    assert_eq!(
        golden_ids(&j["prompt_ids"]),
        golden_ids(&golden["prompt_ids"])
    );
    assert_eq!(
        golden_ids(&j["new_token_ids"]),
        golden_ids(&golden["greedy_new_tokens"])
    );
    assert_eq!(j["text"], golden["greedy_text"]);
    // The answer was streamed before the JSON line.
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.starts_with("The capital of France is Paris."),
        "{stdout}"
    );
}

#[test]
fn tokenize_messages_and_text() {
    let dir = std::env::temp_dir().join(format!("ferrotune-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let msgs = dir.join("messages.json");
    std::fs::write(
        &msgs,
        r#"[{"role": "user", "content": "What is the capital of France?"}]"#,
    )
    .unwrap();
    let golden: Value = read_json(fixtures().join("smollm2_golden.json"));
    let out = ferrotune(&[
        "tokenize",
        "--tokenizer",
        &smollm2(),
        "--messages",
        msgs.to_str().unwrap(),
        "--add-generation-prompt",
        "--json",
    ]);
    let j = last_json(&out);
    assert_eq!(golden_ids(&j["ids"]), golden_ids(&golden[0]["prompt_ids"]));
    assert!(j["text"]
        .as_str()
        .unwrap()
        .ends_with("<|im_start|>assistant\n"));

    let tok = fixtures().join("tiny_tokenizer");
    let out = ferrotune(&[
        "tokenize",
        "--tokenizer",
        tok.to_str().unwrap(),
        "--text",
        "hello world",
        "--json",
    ]);
    let j = last_json(&out);
    assert_eq!(j["text"], "hello world");
    assert!(!j["ids"].as_array().unwrap().is_empty());
}

#[test]
fn bad_input_is_one_clear_error_line() {
    let out = ferrotune(&["generate", "--model", "/no/such/model", "--prompt", "hi"]);
    assert_error(&out, &["/no/such/model"]);

    let dir = std::env::temp_dir().join(format!("ferrotune-cli-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("broken.gguf");
    std::fs::write(&bad, b"GGUF\x03\x00\x00\x00garbage").unwrap();
    let out = ferrotune(&[
        "generate",
        "--model",
        bad.to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    assert_error(&out, &["broken.gguf"]);

    // The real GGUF cut at 1 MB: the reader fails inside candle.
    let truncated = dir.join("truncated.gguf");
    let bytes = std::fs::read(smollm2()).unwrap();
    std::fs::write(&truncated, &bytes[..1 << 20]).unwrap();
    let out = ferrotune(&[
        "generate",
        "--model",
        truncated.to_str().unwrap(),
        "--prompt",
        "hi",
    ]);
    assert_error(&out, &["truncated.gguf"]);

    let model = fixtures().join("llama3/model");
    let m = model.to_str().unwrap();
    let out = ferrotune(&[
        "generate", "--model", m, "--prompt", "hi", "--dtype", "int3",
    ]);
    assert_error(&out, &["int3"]);
    let out = ferrotune(&["generate", "--model", m, "--prompt-ids", "1,2,100000"]);
    assert_error(&out, &["100000", "vocabulary"]);

    let llama2 = ferrotune_data::asset_path("tokenizers/llama2").unwrap();
    let out = ferrotune(&[
        "tokenize",
        "--tokenizer",
        llama2.to_str().unwrap(),
        "--messages",
        "/dev/null",
    ]);
    assert_error(&out, &["/dev/null"]);
    let msgs = dir.join("m.json");
    std::fs::write(&msgs, r#"[{"role": "user", "content": "hi"}]"#).unwrap();
    let out = ferrotune(&[
        "tokenize",
        "--tokenizer",
        llama2.to_str().unwrap(),
        "--messages",
        msgs.to_str().unwrap(),
    ]);
    assert_error(&out, &["chat template"]);
}

#[test]
fn bench_decode_and_train_report_their_numbers() {
    let model = fixtures().join("llama3/model");
    let model = model.to_str().unwrap();
    let d = last_json(&ferrotune(&[
        "bench",
        "decode",
        "--model",
        model,
        "--prompt",
        "5",
        "--new-tokens",
        "4",
        "--runs",
        "1",
        "--json",
    ]));
    for key in [
        "decode_tokens_per_s",
        "prefill_tokens_per_s",
        "bound_tokens_per_s",
        "copy_bandwidth_gb_s",
    ] {
        let v = d[key].as_f64().unwrap_or(f64::NAN);
        assert!(v.is_finite() && v > 0.0, "{key}: {d}");
    }
    let t = last_json(&ferrotune(&[
        "bench", "train", "--model", model, "--seq", "8", "--batch", "2", "--steps", "1", "--json",
    ]));
    let loss = t["loss"].as_f64().unwrap_or(f64::NAN);
    assert!(loss.is_finite() && loss > 0.0, "{t}");
    assert!(t["tokens_per_s"].as_f64().unwrap() > 0.0, "{t}");
    // On the CPU there is no GPU memory to report.
    assert!(t["peak_gpu_mem_gb"].is_null(), "{t}");
    assert_error(
        &ferrotune(&["bench", "train", "--model", model, "--layers", "2"]),
        &["--layers", "--shape"],
    );
}

/// `export-gguf` through the binary: the GGUF it writes generates the checkpoint's greedy tokens
/// (transformers' goldens), and an architecture it cannot write is one error line.
#[test]
fn export_gguf_writes_a_file_that_generates_the_same_tokens() {
    let dir = std::env::temp_dir().join(format!("ferrotune-cli-gguf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let case = fixtures().join("models/qwen2_5");
    let g: Value = read_json(case.join("golden.json"));
    let gguf = dir.join("qwen2_5.gguf");
    let out = ferrotune(&[
        "export-gguf",
        case.join("model").to_str().unwrap(),
        gguf.to_str().unwrap(),
        "--outtype",
        "f32",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("qwen2 architecture"));
    let j = greedy_generation(&g, &["--model", gguf.to_str().unwrap()]);
    assert_eq!(
        golden_ids(&j["new_token_ids"]),
        golden_ids(&g["greedy_new_tokens"])
    );
    let refused = ferrotune(&[
        "export-gguf",
        fixtures().join("models/ministral3/model").to_str().unwrap(),
        dir.join("ministral3.gguf").to_str().unwrap(),
    ]);
    assert_error(&refused, &["not 'ministral3'"]);
    assert!(!dir.join("ministral3.gguf").exists());
    std::fs::remove_dir_all(&dir).ok();
}

/// `export-gguf` of Qwen3.5 (dense: llama.cpp's `qwen35`; MoE: `qwen35moe`) through the binary:
/// `generate` on the GGUF it writes (the Gated DeltaNet's cached decoding) gives the
/// checkpoint's 16 greedy tokens in transformers (the fixtures' goldens).
#[test]
fn export_gguf_of_qwen3_5_generates_the_same_tokens() {
    let dir = std::env::temp_dir().join(format!("ferrotune-cli-gguf-q35-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (case, arch) in [("qwen3_5", "qwen35"), ("qwen3_5_moe", "qwen35moe")] {
        let case_dir = fixtures().join("models").join(case);
        let g: Value = read_json(case_dir.join("golden.json"));
        let gguf = dir.join(format!("{case}.gguf"));
        let out = ferrotune(&[
            "export-gguf",
            case_dir.join("model").to_str().unwrap(),
            gguf.to_str().unwrap(),
            "--outtype",
            "f32",
        ]);
        assert!(
            out.status.success(),
            "{case}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            String::from_utf8_lossy(&out.stdout).contains(&format!("{arch} architecture")),
            "{case}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let j = greedy_generation(&g, &["--model", gguf.to_str().unwrap()]);
        assert_eq!(
            golden_ids(&j["new_token_ids"]),
            golden_ids(&g["greedy_new_tokens"]),
            "{case}"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// `export-gguf` of a LoRA adapter folder: a llama.cpp adapter GGUF, its base taken from the
/// adapter's recorded `base_model_name_or_path` (or `--base`); DoRA, a LoRA bias and adapters on
/// fused experts, which llama.cpp cannot apply, and `--base` with a model folder are one error
/// line each.
#[test]
fn export_gguf_writes_a_lora_adapter_for_llama_cpp() {
    let dir = std::env::temp_dir().join(format!("ferrotune-cli-gguf-lora-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let base = fixtures().join("llama3/model");
    // A copy of the fixture adapter recording this checkout's base path, as ferrotune's runs do.
    let adapter = dir.join("adapter");
    std::fs::create_dir_all(&adapter).unwrap();
    let src = fixtures().join("llama3/adapter");
    std::fs::copy(
        src.join("adapter_model.safetensors"),
        adapter.join("adapter_model.safetensors"),
    )
    .unwrap();
    let mut config: Value = read_json(src.join("adapter_config.json"));
    config["base_model_name_or_path"] = Value::from(base.to_str().unwrap());
    std::fs::write(adapter.join("adapter_config.json"), config.to_string()).unwrap();
    let gguf = dir.join("lora.gguf");
    let out = ferrotune(&[
        "export-gguf",
        adapter.to_str().unwrap(),
        gguf.to_str().unwrap(),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    // 7 modules × 2 layers, an A and a B each.
    assert!(
        stdout.contains("LoRA adapter for llama.cpp's llama architecture, 28 tensors"),
        "{stdout}"
    );
    let bytes = std::fs::read(&gguf).unwrap();
    assert_eq!(&bytes[..4], b"GGUF");

    let dora = fixtures().join("llama3/variants/dora/adapter");
    let out = ferrotune(&[
        "export-gguf",
        dora.to_str().unwrap(),
        dir.join("dora.gguf").to_str().unwrap(),
        "--base",
        base.to_str().unwrap(),
    ]);
    assert_error(&out, &["DoRA", "ferrotune merge"]);
    // A LoRA bias and adapters on fused experts have no place in a llama.cpp adapter either.
    for (case, model, needle) in [
        ("lora_bias/qwen2_qkv", "qwen2/model", "lora_bias"),
        (
            "target_parameters/mixtral",
            "models/mixtral/model",
            "target_parameters",
        ),
    ] {
        let out = ferrotune(&[
            "export-gguf",
            fixtures().join(case).join("adapter").to_str().unwrap(),
            dir.join("refused.gguf").to_str().unwrap(),
            "--base",
            fixtures().join(model).to_str().unwrap(),
        ]);
        assert_error(&out, &[needle, "ferrotune merge"]);
    }
    let out = ferrotune(&[
        "export-gguf",
        base.to_str().unwrap(),
        dir.join("x.gguf").to_str().unwrap(),
        "--base",
        base.to_str().unwrap(),
    ]);
    assert_error(&out, &["--base is for exporting an adapter"]);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn cat_prints_configs_as_tune_cat() {
    // Expected: PyYAML's dump, as torchtune's `tune cat` prints (scripts/make_cat_fixtures.py).
    let dir = fixtures().join("cat");
    let expected: serde_json::Value = read_json(dir.join("expected.json"));
    for (case, outputs) in expected.as_object().unwrap() {
        let target = if case.ends_with(".yaml") {
            dir.join(case).display().to_string()
        } else {
            case.clone()
        };
        for (sort, want) in outputs.as_object().unwrap() {
            let mut args = vec!["cat", target.as_str()];
            if sort == "true" {
                args.push("--sort");
            }
            let out = Command::new(env!("CARGO_BIN_EXE_ferrotune"))
                .args(&args)
                .output()
                .unwrap();
            assert!(out.status.success(), "{case}");
            assert_eq!(
                String::from_utf8(out.stdout).unwrap(),
                want.as_str().unwrap(),
                "{case} (sorted: {sort})"
            );
        }
    }
    // A recipe name is pointed at configs, as torchtune does.
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .args(["cat", "lora_finetune_single_device"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("is a recipe, not a config"));
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .args(["cat", "no/such_config"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}

/// `tokenize --messages --tools`: the prompt rendered with the tools, as TRL 1.16.0's
/// `DPOTrainer` tokenized it with the real qwen3 tokenizer (tests/fixtures/orpo_trainer/
/// tools_golden.json, scripts/make_orpo_trainer_fixtures.py); without `--tools` the ids differ.
#[test]
fn tokenize_messages_with_tools() {
    let dir = std::env::temp_dir().join(format!("ferrotune-cli-tools-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let row: Value = serde_json::from_str(
        std::fs::read_to_string(fixtures().join("orpo_trainer/tools.jsonl"))
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    let (msgs, tools) = (dir.join("prompt.json"), dir.join("tools.json"));
    std::fs::write(&msgs, serde_json::to_string(&[&row["chosen"][0]]).unwrap()).unwrap();
    // The column holds the schemas' JSON text, in the order the template writes them.
    std::fs::write(&tools, row["tools"].as_str().unwrap()).unwrap();
    let golden: Value = read_json(fixtures().join("orpo_trainer/tools_golden.json"));
    let qwen3 = ferrotune_data::asset_path("tokenizers/qwen3").unwrap();
    let mut args = vec![
        "tokenize".to_string(),
        "--tokenizer".into(),
        qwen3.display().to_string(),
        "--messages".into(),
        msgs.display().to_string(),
        "--add-generation-prompt".into(),
        "--json".into(),
    ];
    let run = |args: &[String]| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        last_json(&ferrotune(&args))
    };
    let plain = run(&args);
    args.extend(["--tools".into(), tools.display().to_string()]);
    let with = run(&args);
    let want = golden_ids(&golden["dpo"]["prompt_ids"][0]);
    assert_eq!(golden_ids(&with["ids"]), want);
    assert_ne!(golden_ids(&plain["ids"]), want);
}
