//! `ferrotune generate --device-map`: on fake CPU "devices" (the `FERROTUNE_DEVICE_MAP_FAKE` test
//! hook) the plan is printed one line per device and the tokens equal a plain run's; without a GPU
//! the model stays on the CPU with one note; bad input is one clear error line.

use std::path::Path;
use std::process::{Command, Output};

use serde_json::Value;

const FAKE: &str = "FERROTUNE_DEVICE_MAP_FAKE";

use ferrotune_testing::fixtures;

/// Runs `ferrotune generate` greedily on `model` with `extra` arguments and, when given, the fake
/// devices of the test hook.
fn generate(model: &Path, extra: &[&str], fake: Option<&str>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrotune"));
    cmd.args([
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        "1,2,3",
        "--max-new-tokens",
        "8",
        "--ignore-eos",
        "--json",
    ])
    .args(extra)
    .env_remove(FAKE)
    .env("RUST_BACKTRACE", "1");
    if let Some(f) = fake {
        cmd.env(FAKE, f);
    }
    cmd.output().unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn new_tokens(out: &Output) -> Vec<u64> {
    assert!(out.status.success(), "stderr: {}", stderr(out));
    let stdout = String::from_utf8(out.stdout.clone()).unwrap();
    let j: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    serde_json::from_value(j["new_token_ids"].clone()).unwrap()
}

/// The stderr lines describing fake device `i`.
fn device_line(out: &Output, i: usize) -> String {
    let prefix = format!("cpu:{i}: ");
    let lines: Vec<String> = stderr(out)
        .lines()
        .filter(|l| l.starts_with(&prefix))
        .map(str::to_string)
        .collect();
    assert_eq!(lines.len(), 1, "{}", stderr(out));
    lines[0].clone()
}

#[test]
fn every_mode_on_fake_devices_generates_the_plain_tokens() {
    // Three devices of 400 KB each: 360 KB usable, while the tiny llama needs ~600 KB of weights.
    let fake = "cpu:400000,cpu:400000,cpu:400000";
    for family in ["llama3", "qwen2"] {
        let model = fixtures().join(family).join("model");
        let plain = new_tokens(&generate(&model, &[], None));
        assert_eq!(plain.len(), 8);
        for mode in ["auto", "balanced", "balanced_low_0", "sequential"] {
            let out = generate(&model, &["--device-map", mode], Some(fake));
            assert_eq!(new_tokens(&out), plain, "{family} {mode}: {}", stderr(&out));
            let lines: Vec<String> = (0..3).map(|i| device_line(&out, i)).collect();
            let all = lines.join("\n");
            assert!(
                all.contains("embed") && all.contains("norm + head"),
                "{all}"
            );
            match mode {
                "balanced_low_0" => assert!(lines[0].contains("nothing"), "{all}"),
                "sequential" => assert!(lines[0].starts_with("cpu:0: embed, layer 0"), "{all}"),
                _ => assert!(lines.iter().all(|l| !l.contains("nothing")), "{all}"),
            }
        }
    }
}

#[test]
fn a_real_gguf_model_split_over_fake_devices_generates_the_plain_tokens() {
    // SmolLM2-135M (30 layers, packed Q4_1 weights kept on the CPU devices), balanced over four.
    let model = ferrotune_data::asset_path("SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
    let plain = new_tokens(&generate(&model, &[], None));
    let out = generate(
        &model,
        &["--device-map", "balanced"],
        Some("cpu:250MB,cpu:250MB,cpu:250MB,cpu:250MB"),
    );
    assert_eq!(new_tokens(&out), plain, "{}", stderr(&out));
    assert!(device_line(&out, 0).starts_with("cpu:0: embed, layers 0-"));
    assert!(device_line(&out, 3).contains(", norm + head ("));
}

#[test]
fn without_a_gpu_the_model_stays_on_the_cpu_with_a_note() {
    let model = fixtures().join("llama3").join("model");
    let plain = new_tokens(&generate(&model, &[], None));
    let out = generate(&model, &["--device-map", "auto"], None);
    let err = stderr(&out);
    // A binary built with `cuda` on a GPU machine places the model for real instead.
    if !err.contains("cuda:0:") {
        assert!(
            err.contains(
                "note: --device-map auto: no GPU visible, the whole model stays on the CPU"
            ),
            "{err}"
        );
        assert_eq!(new_tokens(&out), plain);
    }
}

#[test]
fn bad_device_map_input_is_one_error_line() {
    let model = fixtures().join("llama3").join("model");
    let one_line = |out: &Output, needles: &[&str]| {
        let err = stderr(out);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
        for n in needles {
            assert!(err.contains(n), "'{n}' missing from: {err}");
        }
    };
    let out = generate(&model, &["--device-map", "everywhere"], None);
    one_line(
        &out,
        &[
            "--device-map",
            "everywhere",
            "auto, balanced, balanced_low_0, sequential",
        ],
    );
    let out = generate(
        &model,
        &["--device-map", "sequential"],
        Some("cpu:100000,cpu:100000"),
    );
    one_line(
        &out,
        &[
            "--device-map sequential",
            "does not fit on 2 device(s)",
            "short by",
        ],
    );
    let out = generate(&model, &["--device-map", "balanced"], Some("gpu:1GB"));
    one_line(&out, &[FAKE, "cpu:BYTES", "gpu:1GB"]);
    // --device and --device-map name the placement twice.
    let out = generate(&model, &["--device-map", "auto", "--device", "cpu"], None);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("cannot be used with"),
        "{}",
        stderr(&out)
    );
}
