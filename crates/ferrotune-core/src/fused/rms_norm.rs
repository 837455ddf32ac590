//! RMSNorm (transformers' `LlamaRMSNorm`, and Gemma's `1 + weight` variant) in one pass per row,
//! with the backward for both the input and the weight.

use candle_core::{bail, Device, Result, Shape, Tensor};
use rayon::prelude::*;

use super::kernels::{self, simd_fn};
use super::{contiguous, fused_applies, guard_slices, rows_per_task, Forward};
use crate::custom_op::{Fused, FusedOp, Grads};

/// RMSNorm over the last dimension: `weight * (x / sqrt(mean(x²) + eps))`, or with `offset_one`
/// (Gemma) `(1 + weight) * (x / sqrt(mean(x²) + eps))`; differentiable w.r.t. `x` and `weight`.
///
/// `x` is `[..., h]`, `weight` `[h]`. For f32 CPU tensors this is one fused pass per row (backward:
/// `dx` per row and `dweight` summed over rows); otherwise it is [`crate::ops::rms_norm`], which
/// computes the statistics in f32 whatever the input dtype.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64, offset_one: bool) -> Result<Tensor> {
    let h = x.dim(candle_core::D::Minus1)?;
    if weight.dims() != [h] {
        bail!(
            "rms_norm: weight {:?} does not match the last dimension of x {:?}",
            weight.dims(),
            x.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if x.elem_count() > 0 && crate::cuda::applies(&[x, weight]) {
        return crate::cuda::rms_norm(x, weight, eps, offset_one);
    }
    if x.elem_count() == 0 || !fused_applies(&[x, weight]) {
        return crate::ops::rms_norm(x, weight, eps, offset_one);
    }
    x.contiguous()?.apply_op2(
        &weight.contiguous()?,
        Fused(RmsNorm {
            eps: eps as f32,
            offset_one,
        }),
    )
}

struct RmsNorm {
    eps: f32,
    offset_one: bool,
}

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// `1 / sqrt(mean(x²) + eps)` of one row, as the composite computes it (mean = sum · (1/h)).
#[inline(always)]
fn inv_rms(row: &[f32], eps: f32) -> f32 {
    let inv_h = (1.0 / row.len() as f64) as f32;
    1.0 / (kernels::dot(row, row) * inv_h + eps).sqrt()
}

simd_fn! {
    /// Normalizes consecutive rows of length `w.len()`.
    fn forward_rows(x: &[f32], w: &[f32], eps: f32, offset_one: bool, out: &mut [f32]) {
        let h = w.len();
        for (xr, yr) in x.chunks_exact(h).zip(out.chunks_exact_mut(h)) {
            let r = inv_rms(xr, eps);
            if offset_one {
                for ((y, &xv), &wv) in yr.iter_mut().zip(xr).zip(w) {
                    *y = xv * r * (wv + 1.0);
                }
            } else {
                for ((y, &xv), &wv) in yr.iter_mut().zip(xr).zip(w) {
                    *y = xv * r * wv;
                }
            }
        }
    }
}

simd_fn! {
    /// `dx` of consecutive rows, and their contribution to `dw` added to `dw` (unless it is empty).
    fn backward_rows(
        x: &[f32],
        dy: &[f32],
        w: &[f32],
        eps: f32,
        offset_one: bool,
        dx: &mut [f32],
        dw: &mut [f32],
    ) {
        let h = w.len();
        let inv_h = (1.0 / h as f64) as f32;
        let shift = if offset_one { 1.0 } else { 0.0 };
        let rows = x.chunks_exact(h).zip(dy.chunks_exact(h)).zip(dx.chunks_exact_mut(h));
        for ((xr, dyr), dxr) in rows {
            let r = inv_rms(xr, eps);
            // Σ_j dy_j w_j x_j: the only cross-element term of the derivative.
            let mut acc = [0f32; 8];
            let mut k = 0;
            while k + 8 <= h {
                for j in 0..8 {
                    acc[j] += dyr[k + j] * (w[k + j] + shift) * xr[k + j];
                }
                k += 8;
            }
            let mut gx = acc.iter().sum::<f32>();
            while k < h {
                gx += dyr[k] * (w[k] + shift) * xr[k];
                k += 1;
            }
            let c = gx * r * r * r * inv_h;
            for j in 0..h {
                dxr[j] = r * dyr[j] * (w[j] + shift) - xr[j] * c;
            }
            if dw.len() == h {
                for j in 0..h {
                    dw[j] += dyr[j] * xr[j] * r;
                }
            }
        }
    }
}

impl FusedOp<2> for RmsNorm {
    const NAME: &'static str = "fused-rms-norm";
    const WHAT: &'static str = "rms_norm";

    fn forward(&self, [x, w]: [&[f32]; 2], [x_shape, _]: [&Shape; 2]) -> Forward {
        let h = w.len();
        let chunk = rows_per_task(h, CHUNK) * h;
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(chunk)
            .zip(x.par_chunks(chunk))
            .for_each(|(o, x)| forward_rows(x, w, self.eps, self.offset_one, o));
        Ok((out, x_shape.clone()))
    }

    fn backward(&self, [x, weight]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> Grads<2> {
        let tensors = contiguous([x, weight, grad])?;
        let guards = tensors.each_ref().map(Tensor::storage_and_layout);
        let [xs, w, dy] = guard_slices(&guards, "rms_norm")?;
        let h = w.len();
        let chunk = rows_per_task(h, CHUNK) * h;
        // A frozen weight (the usual case under LoRA) needs no gradient: skip that reduction.
        let dw_len = if weight.track_op() { h } else { 0 };
        let mut dx = vec![0f32; xs.len()];
        let dw = dx
            .par_chunks_mut(chunk)
            .zip(xs.par_chunks(chunk).zip(dy.par_chunks(chunk)))
            .map(|(dx, (x, dy))| {
                let mut dw = vec![0f32; dw_len];
                backward_rows(x, dy, w, self.eps, self.offset_one, dx, &mut dw);
                dw
            })
            .reduce(
                || vec![0f32; dw_len],
                |mut a, b| {
                    a.iter_mut().zip(&b).for_each(|(a, b)| *a += b);
                    a
                },
            );
        Ok([
            Some(Tensor::from_vec(dx, x.shape(), &Device::Cpu)?),
            if dw_len == h {
                Some(Tensor::from_vec(dw, h, &Device::Cpu)?)
            } else {
                None
            },
        ])
    }
}
