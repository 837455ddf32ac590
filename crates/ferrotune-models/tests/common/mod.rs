//! Helpers shared by the model tests.
// Each test file uses its own subset.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use candle_core::{DType, Tensor};

/// The repository's tests/fixtures, or `FERROTUNE_TEST_FIXTURES` (a test binary run on another
/// machine, where the build's path does not exist).
pub fn fixtures() -> PathBuf {
    std::env::var_os("FERROTUNE_TEST_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures"))
}

/// The largest absolute difference of two tensors of one shape (compared in f32); NaN if any
/// difference is NaN, so that a `<= tolerance` assertion fails on it.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    let values = |t: &Tensor| {
        t.to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    values(a)
        .iter()
        .zip(&values(b))
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, |m: f32, d| {
            if m.is_nan() || d.is_nan() {
                f32::NAN
            } else {
                m.max(d)
            }
        })
}
