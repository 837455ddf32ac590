//! Fixture loading and tensor comparison shared by the integration tests.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};
// Each test file uses a different subset.
#[allow(unused_imports)]
pub use ferrotune_testing::{assert_close, f32s, rel_l2};

/// `crates/ferrotune-train/tests/fixtures/train/<name>`.
pub fn train_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/train")
        .join(name)
}

/// The workspace-level `tests/fixtures/<rel>`.
pub fn workspace_fixture(rel: &str) -> PathBuf {
    ferrotune_testing::fixtures().join(rel)
}

/// A JSON golden file.
pub fn json(path: PathBuf) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

pub fn load(path: PathBuf) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}
