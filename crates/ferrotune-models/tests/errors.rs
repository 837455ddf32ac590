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

fn pickle_fixture(case: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/models")
        .join(case)
        .join("model")
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
    }
}

#[test]
fn bad_pytorch_checkpoints() {
    // Not a torch.save zip (a pre-1.6 pickle or anything else): named, with what is expected.
    let d = tmp("legacy-bin");
    copy_dir(&pickle_fixture("llama2_bin"), &d);
    std::fs::remove_file(d.join("pytorch_model.bin.index.json")).unwrap();
    for f in std::fs::read_dir(&d).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "bin") {
            std::fs::remove_file(p).unwrap();
        }
    }
    std::fs::write(d.join("pytorch_model.bin"), b"\x80\x02legacy pickle").unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("pytorch_model.bin") && err.contains("torch.save"),
        "{err}"
    );

    // A shard the index lists is missing.
    let d = tmp("missing-shard");
    copy_dir(&pickle_fixture("llama2_bin"), &d);
    std::fs::remove_file(d.join("pytorch_model-00002-of-00002.bin")).unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("pytorch_model-00002-of-00002.bin") && err.contains("missing"),
        "{err}"
    );

    // Pickles with neither config.json nor params.json: no way to know the model.
    let d = tmp("no-config");
    copy_dir(&pickle_fixture("llama2_bin"), &d);
    std::fs::remove_file(d.join("config.json")).unwrap();
    let err = load_err(&d.join("pytorch_model-00001-of-00002.bin"));
    assert!(
        err.contains("config.json") && err.contains("params.json"),
        "{err}"
    );

    // Meta's model-parallel shards (70B ships eight): refused, not half-loaded.
    let d = tmp("meta-shards");
    copy_dir(&pickle_fixture("llama2_meta"), &d);
    std::fs::copy(d.join("consolidated.00.pth"), d.join("consolidated.01.pth")).unwrap();
    let err = load_err(&d);
    assert!(err.contains("2 Meta checkpoint files"), "{err}");

    // params.json disagreeing with the weights.
    let d = tmp("meta-params");
    copy_dir(&pickle_fixture("llama2_meta"), &d);
    let path = d.join("params.json");
    let mut params: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    params["n_layers"] = 3.into();
    std::fs::write(&path, params.to_string()).unwrap();
    let err = load_err(&d);
    assert!(
        err.contains("consolidated.00.pth") && err.contains("3 layers"),
        "{err}"
    );
}
