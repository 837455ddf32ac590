//! Helpers shared by the model tests.
// Each test file uses its own subset.
#![allow(dead_code)]

use std::path::PathBuf;

use candle_core::{Device, Tensor, D};
use serde_json::Value;

// Each test file uses a different subset.
#[allow(unused_imports)]
pub use ferrotune_testing::{max_abs_diff, rel_l2};

/// The repository's tests/fixtures, or `FERROTUNE_TEST_FIXTURES` (a test binary run on another
/// machine, where the build's path does not exist).
pub fn fixtures() -> PathBuf {
    std::env::var_os("FERROTUNE_TEST_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(ferrotune_testing::fixtures)
}

/// transformers' causal-LM loss: mean cross-entropy of `logits[:, :-1]` against `labels[:, 1:]`,
/// positions labelled -100 ignored. Built from differentiable ops so that it backpropagates.
pub fn causal_lm_loss(logits: &Tensor, labels: &Value) -> Tensor {
    let labels: Vec<Vec<i64>> = serde_json::from_value(labels.clone()).unwrap();
    let (b, t, v) = logits.dims3().unwrap();
    let mut rows = Vec::new();
    let mut targets = Vec::new();
    for (bi, row) in labels.iter().enumerate() {
        for ti in 0..t - 1 {
            let l = row[ti + 1];
            if l != -100 {
                rows.push((bi * t + ti) as u32);
                targets.push(l as u32);
            }
        }
    }
    let n = rows.len();
    let flat = logits.reshape((b * t, v)).unwrap();
    let picked = flat
        .index_select(&Tensor::new(rows, &Device::Cpu).unwrap(), 0)
        .unwrap();
    let lse = picked.log_sum_exp(D::Minus1).unwrap();
    let target_logit = picked
        .gather(&Tensor::from_vec(targets, (n, 1), &Device::Cpu).unwrap(), 1)
        .unwrap()
        .squeeze(1)
        .unwrap();
    (lse - target_logit).unwrap().mean_all().unwrap()
}
