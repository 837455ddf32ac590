//! Fixture loading and tensor comparison shared by the integration tests.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};

/// `crates/ferrotune-train/tests/fixtures/train/<name>`.
pub fn train_fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/train")
        .join(name)
}

/// The workspace-level `tests/fixtures/<rel>`.
pub fn workspace_fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(rel)
}

pub fn load(path: PathBuf) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
}

pub fn f32s(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Elementwise `|a - e| <= atol + rtol * |e|`, reporting the worst offender.
pub fn assert_close(what: &str, actual: &Tensor, expected: &Tensor, rtol: f32, atol: f32) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    let (a, e) = (f32s(actual), f32s(expected));
    let mut worst = (0usize, 0f32);
    for (i, (x, y)) in a.iter().zip(&e).enumerate() {
        let excess = (x - y).abs() - (atol + rtol * y.abs());
        // NaN counts as the worst possible mismatch.
        if excess.is_nan() || excess > worst.1 {
            worst = (
                i,
                if excess.is_nan() {
                    f32::INFINITY
                } else {
                    excess
                },
            );
        }
    }
    assert!(
        worst.1 <= 0.0,
        "{what}: element {} is {} vs expected {} (rtol {rtol}, atol {atol})",
        worst.0,
        a[worst.0],
        e[worst.0]
    );
}

/// `‖got − want‖ / ‖want‖` over all elements (f32 tensors of one shape).
pub fn rel_l2(got: &Tensor, want: &Tensor) -> f32 {
    let norm = |t: &Tensor| {
        t.sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            .sqrt()
    };
    norm(&(got - want).unwrap()) / norm(want).max(1e-30)
}
