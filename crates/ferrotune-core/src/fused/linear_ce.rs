//! The output head and the cross-entropy in one op, over row chunks: `Σ CE(hidden @ weightᵀ)`
//! without ever holding the `[n, vocab]` logits (or their gradient) whole.
//!
//! The loss is the last node of the graph, so its gradients are computed in the forward pass,
//! chunk by chunk — `(softmax − onehot) @ weight` for `hidden`, and for a trained head (full
//! fine-tuning) also `(softmax − onehot)ᵀ @ hidden` for the weight — and kept; backward only
//! scales them. Rows without a target are skipped entirely: with prompt tokens masked, most of
//! the head's work disappears.

use std::sync::Mutex;

use candle_core::{bail, DType, Device, Result, Shape, Tensor};
use rayon::prelude::*;

use super::kernels::{
    self, simd_fn,
    Operands::{Nn, Nt, Tn},
};
use super::{fused_applies, guard_slice, Forward};
use crate::custom_op::{Fused, FusedOp, Grads};

/// Rows of logits materialized at once (`CHUNK × vocab` floats).
const CHUNK: usize = 512;

/// Whether [`linear_cross_entropy_sum`] runs chunked (never holding the `[n, vocab]` logits) for
/// these tensors: f32 on the CPU, f32 or bf16 on a GPU, one dtype for both.
pub fn chunked_head_applies(hidden: &Tensor, weight: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    if crate::cuda::applies(&[hidden, weight]) {
        return true;
    }
    fused_applies(&[hidden, weight])
}

/// `Σ -log_softmax(hidden @ weightᵀ)[targets[i]]` over the rows whose target is not
/// `ignore_index`, and the number of such rows.
///
/// `hidden` is `[n, h]`, `weight` `[vocab, h]` (frozen, or trained: then it gets its gradient
/// too). Where [`chunked_head_applies`] this is the chunked op (CPU or CUDA kernels); otherwise the
/// logits are formed with candle and [`super::cross_entropy_sum`] is used.
pub fn linear_cross_entropy_sum(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &[i64],
    ignore_index: i64,
) -> Result<(Tensor, usize)> {
    let (n, h) = hidden.dims2()?;
    let (vocab, wh) = weight.dims2()?;
    if wh != h {
        bail!("linear_cross_entropy_sum: hidden has {h} features, weight {wh}");
    }
    if targets.len() != n {
        bail!(
            "linear_cross_entropy_sum: {} targets for {n} rows",
            targets.len()
        );
    }
    if !chunked_head_applies(hidden, weight) {
        let logits = hidden.matmul(&weight.t()?)?;
        return super::cross_entropy_sum(&logits, targets, ignore_index);
    }
    let mut rows = Vec::new();
    for (i, &t) in targets.iter().enumerate() {
        if t == ignore_index {
            continue;
        }
        if t < 0 || t as usize >= vocab {
            bail!("linear_cross_entropy_sum: target {t} outside the vocabulary (size {vocab})");
        }
        rows.push((i, t as usize));
    }
    let count = rows.len();
    #[cfg(feature = "cuda")]
    if hidden.device().is_cuda() {
        return Ok((
            crate::cuda::linear_cross_entropy_sum(hidden, weight, &rows)?,
            count,
        ));
    }
    if weight.track_op() {
        // A trained head (full fine-tuning): the weight's gradient is formed in the same pass.
        let op = TrainedLinearCrossEntropy {
            rows,
            grads: Mutex::new(None),
        };
        let sum = hidden
            .contiguous()?
            .apply_op2(&weight.contiguous()?, Fused(op))?;
        return Ok((sum, count));
    }
    let op = LinearCrossEntropy {
        weight: weight.contiguous()?,
        rows,
        grad: Mutex::new(None),
    };
    let sum = hidden.contiguous()?.apply_op1(Fused(op))?;
    Ok((sum, count))
}

struct LinearCrossEntropy {
    weight: Tensor,
    /// (row of `hidden`, target) for every counted row.
    rows: Vec<(usize, usize)>,
    /// d(sum)/d(hidden), `[n, h]`, filled by the forward pass.
    grad: Mutex<Option<Vec<f32>>>,
}

simd_fn! {
    /// Turns a row of logits into `softmax − onehot(target)` in place; returns `lse − x[target]`.
    fn softmax_minus_onehot(row: &mut [f32], target: usize) -> f32 {
        let m = kernels::max(row);
        let x_t = row[target];
        let sum = kernels::exp_shift_inplace(row, m);
        let inv = 1.0 / sum;
        for v in row.iter_mut() {
            *v *= inv;
        }
        row[target] -= 1.0;
        // lse − x_t = ln Σ exp(x − m) − (x_t − m): finite however small p_t is.
        sum.ln() - (x_t - m)
    }
}

/// The loss sum over `rows` and its gradient with respect to `x` (`[n, h]`, zero on rows without
/// a target), chunk by chunk; with `dw` (`[vocab, h]`, zeroed) also the weight's gradient
/// `Σ (softmax − onehot)ᵀ · x`, accumulated per chunk.
fn chunked_forward(
    x: &[f32],
    n: usize,
    h: usize,
    w: &[f32],
    rows: &[(usize, usize)],
    mut dw: Option<&mut [f32]>,
) -> (f64, Vec<f32>) {
    let vocab = w.len() / h.max(1);
    let mut dx = vec![0f32; n * h];
    let mut logits = vec![0f32; CHUNK.min(rows.len()) * vocab];
    let mut xc = vec![0f32; CHUNK.min(rows.len()) * h];
    let mut dxc = vec![0f32; CHUNK.min(rows.len()) * h];
    let mut total = 0f64;
    for chunk in rows.chunks(CHUNK) {
        let c = chunk.len();
        for (j, &(i, _)) in chunk.iter().enumerate() {
            xc[j * h..(j + 1) * h].copy_from_slice(&x[i * h..(i + 1) * h]);
        }
        // logits[c, vocab] = xc[c, h] · wᵀ  (w is [vocab, h] row-major).
        kernels::matmul(&mut logits, (c, vocab, h), false, Nt, &xc, w, 1.0);
        let losses: Vec<f32> = logits[..c * vocab]
            .par_chunks_mut(vocab)
            .zip(chunk.par_iter())
            .map(|(row, &(_, t))| softmax_minus_onehot(row, t))
            .collect();
        total += losses.iter().map(|&l| l as f64).sum::<f64>();
        // dxc[c, h] = (softmax − onehot)[c, vocab] · w[vocab, h]
        kernels::matmul(&mut dxc, (c, h, vocab), false, Nn, &logits, w, 1.0);
        if let Some(dw) = dw.as_deref_mut() {
            // dw[vocab, h] += (softmax − onehot)ᵀ[vocab, c] · xc[c, h]
            kernels::matmul(dw, (vocab, h, c), true, Tn, &logits, &xc, 1.0);
        }
        for (j, &(i, _)) in chunk.iter().enumerate() {
            dx[i * h..(i + 1) * h].copy_from_slice(&dxc[j * h..(j + 1) * h]);
        }
    }
    (total, dx)
}

impl FusedOp<1> for LinearCrossEntropy {
    const NAME: &'static str = "fused-linear-cross-entropy";
    const WHAT: &'static str = "linear_cross_entropy_sum";

    fn forward(&self, [x]: [&[f32]; 1], [shape]: [&Shape; 1]) -> Forward {
        let (n, h) = shape.dims2()?;
        let wg = self.weight.storage_and_layout();
        let w = guard_slice(&wg, "linear_cross_entropy_sum")?;
        let (total, dx) = chunked_forward(x, n, h, w, &self.rows, None);
        *self.grad.lock().unwrap_or_else(|e| e.into_inner()) = Some(dx);
        Ok((vec![total as f32], Shape::from(())))
    }

    fn backward(&self, [hidden]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> Grads<1> {
        let g = grad.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let stored = self.grad.lock().unwrap_or_else(|e| e.into_inner());
        let Some(dx) = stored.as_ref() else {
            bail!("linear_cross_entropy_sum: backward before forward");
        };
        let scaled: Vec<f32> = dx.par_iter().map(|&v| v * g).collect();
        Ok([Some(Tensor::from_vec(
            scaled,
            hidden.shape(),
            &Device::Cpu,
        )?)])
    }
}

/// The same with a trained weight: both gradients are formed in the forward pass (rows without a
/// target cost nothing, and no `[n, vocab]` logits or logit gradient is ever held whole).
struct TrainedLinearCrossEntropy {
    rows: Vec<(usize, usize)>,
    /// (d(sum)/d(hidden) `[n, h]`, d(sum)/d(weight) `[vocab, h]`), filled by the forward pass.
    grads: Mutex<Option<(Vec<f32>, Vec<f32>)>>,
}

impl FusedOp<2> for TrainedLinearCrossEntropy {
    const NAME: &'static str = "fused-trained-linear-cross-entropy";
    const WHAT: &'static str = "linear_cross_entropy_sum";

    fn forward(&self, [x, w]: [&[f32]; 2], [x_shape, _]: [&Shape; 2]) -> Forward {
        let (n, h) = x_shape.dims2()?;
        let mut dw = vec![0f32; w.len()];
        let (total, dx) = chunked_forward(x, n, h, w, &self.rows, Some(&mut dw));
        *self.grads.lock().unwrap_or_else(|e| e.into_inner()) = Some((dx, dw));
        Ok((vec![total as f32], Shape::from(())))
    }

    fn backward(&self, [hidden, weight]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> Grads<2> {
        let g = grad.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let Some((dx, dw)) = self.grads.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            bail!("linear_cross_entropy_sum: backward before forward (or twice)");
        };
        let scale = |mut v: Vec<f32>| {
            if g != 1.0 {
                v.par_iter_mut().for_each(|x| *x *= g);
            }
            v
        };
        Ok([
            Some(Tensor::from_vec(scale(dx), hidden.shape(), &Device::Cpu)?),
            Some(Tensor::from_vec(scale(dw), weight.shape(), &Device::Cpu)?),
        ])
    }
}
