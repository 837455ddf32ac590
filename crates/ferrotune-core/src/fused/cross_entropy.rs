//! Summed token cross-entropy in one pass per row, keeping only each row's log-sum-exp for the
//! backward (no `[n, vocab]` softmax or gradient is held between the two).

use std::sync::Mutex;

use candle_core::{bail, DType, Device, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::kernels::{self, simd_fn};
use super::{fused_applies, guard_slice, Forward};
use crate::custom_op::{Fused, FusedOp, Grads};

/// `Σ -log_softmax(logits[i])[targets[i]]` over the rows whose target is not `ignore_index`, and
/// the number of such rows.
///
/// `logits` is `[n, vocab]` (differentiable); `targets` holds `n` class ids. The log-softmax runs in
/// f32 (PyTorch's `F.cross_entropy(logits.float(), ..., reduction="sum")`). A target outside
/// `[0, vocab)` other than `ignore_index` is an error. For f32 CPU logits this is a fused op whose
/// backward, `grad · (softmax − onehot)` for counted rows and 0 for ignored ones, is recomputed
/// from the stored per-row log-sum-exp; otherwise it is composed from candle ops.
pub fn cross_entropy_sum(
    logits: &Tensor,
    targets: &[i64],
    ignore_index: i64,
) -> Result<(Tensor, usize)> {
    let (n, vocab) = logits.dims2()?;
    if targets.len() != n {
        bail!(
            "cross_entropy_sum: {} targets for {n} rows of logits",
            targets.len()
        );
    }
    if vocab == 0 {
        bail!(
            "cross_entropy_sum: logits {:?} have an empty vocabulary",
            logits.dims()
        );
    }
    let mut count = 0usize;
    for &t in targets {
        if t == ignore_index {
            continue;
        }
        if t < 0 || t as usize >= vocab {
            bail!("cross_entropy_sum: target {t} outside the vocabulary (size {vocab})");
        }
        count += 1;
    }
    if !fused_applies(&[logits]) {
        return Ok((composite(logits, targets, ignore_index)?, count));
    }
    let op = CrossEntropy {
        targets: targets
            .iter()
            .map(|&t| {
                if t == ignore_index {
                    None
                } else {
                    Some(t as usize)
                }
            })
            .collect(),
        stats: Mutex::new(Vec::new()),
    };
    Ok((logits.contiguous()?.apply_op1(Fused(op))?, count))
}

/// The same loss from differentiable candle ops, for dtypes and devices without the fused kernel.
fn composite(logits: &Tensor, targets: &[i64], ignore_index: i64) -> Result<Tensor> {
    let (n, _) = logits.dims2()?;
    let device = logits.device();
    let (index, keep): (Vec<u32>, Vec<f32>) = targets
        .iter()
        .map(|&t| {
            if t == ignore_index {
                // Any in-range index serves an ignored row: its term is multiplied by 0.
                (0, 0.0)
            } else {
                (t as u32, 1.0)
            }
        })
        .unzip();
    let index = Tensor::from_vec(index, (n, 1), device)?;
    let keep = Tensor::from_vec(keep, n, device)?;
    let x = logits.to_dtype(DType::F32)?;
    // The max only shifts each row: detached, it changes no gradient.
    let max = x.max_keepdim(D::Minus1)?.detach();
    let z = x.broadcast_sub(&max)?;
    let lse = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let nll = (lse - z.gather(&index, D::Minus1)?)?.squeeze(D::Minus1)?;
    (nll * keep)?.sum_all()
}

struct CrossEntropy {
    /// Class id of each row, `None` for ignored rows.
    targets: Vec<Option<usize>>,
    /// Per row `(max, ln Σ exp(x − max))`, filled by the forward for the backward.
    stats: Mutex<Vec<(f32, f32)>>,
}

/// Rows per parallel task.
const ROWS: usize = 4;

simd_fn! {
    /// `(max, ln Σ exp(x − max))` of one row.
    fn row_stats(row: &[f32]) -> (f32, f32) {
        let m = kernels::max(row);
        (m, kernels::sum_exp_shift(row, m).ln())
    }
}

simd_fn! {
    /// `out = scale · exp(x − max)`: `g` times the softmax when `scale` is `g / Σ exp(x − max)`.
    fn scaled_exp(row: &[f32], max: f32, scale: f32, out: &mut [f32]) {
        for (o, &v) in out.iter_mut().zip(row) {
            *o = scale * kernels::exp(v - max);
        }
    }
}

impl FusedOp<1> for CrossEntropy {
    const NAME: &'static str = "fused-cross-entropy";
    const WHAT: &'static str = "cross_entropy_sum";

    fn forward(&self, [x]: [&[f32]; 1], [shape]: [&Shape; 1]) -> Forward {
        let (_, vocab) = shape.dims2()?;
        let stats: Vec<(f32, f32)> = x
            .par_chunks(vocab)
            .with_min_len(ROWS)
            .map(row_stats)
            .collect();
        // Summed in f64: the order differs from a sequential f32 sum anyway, so make it accurate.
        let total: f64 = stats
            .iter()
            .zip(x.chunks(vocab))
            .zip(&self.targets)
            .filter_map(|((&(m, l), row), t)| t.map(|t| (l - (row[t] - m)) as f64))
            .sum();
        *self.stats.lock().expect("stats lock") = stats;
        Ok((vec![total as f32], Shape::from(())))
    }

    fn backward(&self, [logits]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> Grads<1> {
        let g = grad.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let (_, vocab) = logits.dims2()?;
        let x_c = logits.contiguous()?;
        let xg = x_c.storage_and_layout();
        let x = guard_slice(&xg, "cross_entropy_sum")?;
        let stats = self.stats.lock().expect("stats lock");
        if stats.len() != self.targets.len() {
            bail!("cross_entropy_sum: backward before forward");
        }
        let mut dx = vec![0f32; x.len()];
        dx.par_chunks_mut(vocab)
            .with_min_len(ROWS)
            .zip(x.par_chunks(vocab))
            .zip(stats.par_iter().zip(self.targets.par_iter()))
            .for_each(|((out, row), (&(m, l), t))| {
                // Ignored rows keep their zeros.
                if let Some(t) = *t {
                    scaled_exp(row, m, g / l.exp(), out);
                    out[t] -= g;
                }
            });
        Ok([Some(Tensor::from_vec(dx, logits.shape(), &Device::Cpu)?)])
    }
}
