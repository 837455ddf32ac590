//! Bad checkpoints give one clear error naming the file and the problem, never a panic.

use std::path::Path;

use candle_core::{DType, Device};
use ferrotune_models::load_model;

fn fixture_model() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/llama3/model")
}

fn copy_model(to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_model().join(f), to.join(f)).unwrap();
    }
}

fn load_err(path: &Path) -> String {
    match load_model(path, DType::F32, &Device::Cpu) {
        Ok(_) => panic!("{} loaded but should not", path.display()),
        Err(e) => e.to_string(),
    }
}

fn tmp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ferrotune-errors-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn missing_path() {
    let err = load_err(Path::new("/nonexistent/model"));
    assert!(
        err.contains("/nonexistent/model") && err.contains("no such file"),
        "{err}"
    );
}

#[test]
fn truncated_safetensors() {
    let d = tmp("trunc");
    copy_model(&d);
    let f = d.join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    let err = load_err(&d);
    assert!(err.contains("model.safetensors"), "{err}");
}

#[test]
fn corrupt_safetensors_header() {
    let d = tmp("corrupt");
    copy_model(&d);
    std::fs::write(
        d.join("model.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all",
    )
    .unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("model.safetensors") && err.contains("safetensors"),
        "{err}"
    );
}

#[test]
fn corrupt_config() {
    let d = tmp("config");
    copy_model(&d);
    std::fs::write(d.join("config.json"), "{\"model_type\": \"llama\",").unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("config.json") && err.contains("invalid JSON"),
        "{err}"
    );
}

#[test]
fn unsupported_model_type() {
    let d = tmp("arch");
    copy_model(&d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"llama\"", "\"bloom\"");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("bloom") && err.contains("supported model types"),
        "{err}"
    );
}

#[test]
fn wrong_shape_names_the_tensor() {
    let d = tmp("shape");
    copy_model(&d);
    let cfg = std::fs::read_to_string(d.join("config.json"))
        .unwrap()
        .replace("\"intermediate_size\": 160", "\"intermediate_size\": 161");
    std::fs::write(d.join("config.json"), cfg).unwrap();
    let err = load_err(&d);
    assert!(err.contains("gate_proj") && err.contains("shape"), "{err}");
}

#[test]
fn missing_shard() {
    let d = tmp("shard");
    copy_model(&d);
    std::fs::write(
        d.join("model.safetensors.index.json"),
        r#"{"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("model-00002-of-00002.safetensors") && err.contains("missing"),
        "{err}"
    );
}
