//! Rotary position embedding (transformers' `rotate_half` layout, partial rotary included) in one
//! pass, with the backward for the input.

use candle_core::{bail, Device, Result, Shape, Tensor};
use rayon::prelude::*;

use super::kernels::simd_fn;
use super::{contiguous, fused_applies, guard_slices, rows_per_task, Forward};
use crate::custom_op::{Fused, FusedOp, Grads};

/// Applies RoPE to `x` `[b, heads, t, d]` with `cos`/`sin` `[b, 1, t, rot]` (a leading 1 instead
/// of `b` is broadcast), as [`crate::ops::apply_rope`]: the first `rot` features are rotated in the
/// half-split layout, the remaining `d - rot` pass through. Differentiable w.r.t. `x` only.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (b, _, t, d) = x.dims4()?;
    let (cb, one, ct, rot) = cos.dims4()?;
    if sin.dims() != cos.dims() || one != 1 || ct != t || !(cb == b || cb == 1) {
        bail!(
            "rope: cos {:?} / sin {:?} do not fit x {:?} (expected [{b} or 1, 1, {t}, rot])",
            cos.dims(),
            sin.dims(),
            x.dims()
        );
    }
    if rot > d || rot % 2 != 0 {
        bail!("rope: rotary dimension {rot} must be even and at most the head dimension {d}");
    }
    #[cfg(feature = "cuda")]
    if x.elem_count() > 0
        && crate::cuda::applies(&[x])
        && cos.device().is_cuda()
        && sin.device().is_cuda()
    {
        return crate::cuda::rope(x, cos, sin);
    }
    if x.elem_count() == 0 || !fused_applies(&[x, cos, sin]) {
        return crate::ops::apply_rope(x, cos, sin);
    }
    x.contiguous()?
        .apply_op3(&cos.contiguous()?, &sin.contiguous()?, Fused(Rope))
}

struct Rope;

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

/// Geometry shared by forward and backward.
struct Dims {
    /// Rows per batch element (`heads · t`), sequence length and head/rotary dimensions.
    rows_per_batch: usize,
    t: usize,
    d: usize,
    rot: usize,
    /// Whether cos/sin have a batch dimension of their own (rather than 1, broadcast).
    per_batch: bool,
}

impl Dims {
    fn new(x: &Shape, cos: &Shape) -> Result<Self> {
        let (_, h, t, d) = x.dims4()?;
        let (cb, _, _, rot) = cos.dims4()?;
        Ok(Self {
            rows_per_batch: h * t,
            t,
            d,
            rot,
            per_batch: cb != 1,
        })
    }

    /// Offset of the cos/sin row for row `r` of `x`.
    fn table_row(&self, r: usize) -> usize {
        let b = if self.per_batch {
            r / self.rows_per_batch
        } else {
            0
        };
        (b * self.t + r % self.t) * self.rot
    }
}

simd_fn! {
    /// Rotates one row: `src` and `dst` have `d` features, `c`/`s` have `rot`. With `inverse`,
    /// applies the transposed rotation (the backward: `sin` enters with the opposite sign and the
    /// halves of `c`/`s` swap roles).
    fn rotate_row(src: &[f32], dst: &mut [f32], c: &[f32], s: &[f32], inverse: bool) {
        let rot = c.len();
        let half = rot / 2;
        let (c1, c2) = c.split_at(half);
        let (s1, s2) = s.split_at(half);
        let (x1, rest) = src.split_at(half);
        let (x2, tail) = rest.split_at(half);
        let (y1, rest) = dst.split_at_mut(half);
        let (y2, ytail) = rest.split_at_mut(half);
        if inverse {
            // dx1 = dy1·c1 + dy2·s2 ; dx2 = dy2·c2 − dy1·s1
            for i in 0..half {
                y1[i] = x1[i] * c1[i] + x2[i] * s2[i];
                y2[i] = x2[i] * c2[i] + (-x1[i]) * s1[i];
            }
        } else {
            // y1 = x1·c1 + (−x2)·s1 ; y2 = x2·c2 + x1·s2 (rotate_half = cat(−x2, x1))
            for i in 0..half {
                y1[i] = x1[i] * c1[i] + (-x2[i]) * s1[i];
                y2[i] = x2[i] * c2[i] + x1[i] * s2[i];
            }
        }
        ytail.copy_from_slice(tail);
    }
}

fn apply(x: &[f32], cos: &[f32], sin: &[f32], dims: &Dims, inverse: bool) -> Vec<f32> {
    let d = dims.d;
    let rows = rows_per_task(d, CHUNK);
    let mut out = vec![0f32; x.len()];
    out.par_chunks_mut(rows * d)
        .zip(x.par_chunks(rows * d))
        .enumerate()
        .for_each(|(task, (o, x))| {
            for (i, (yr, xr)) in o.chunks_exact_mut(d).zip(x.chunks_exact(d)).enumerate() {
                let off = dims.table_row(task * rows + i);
                let (c, s) = (&cos[off..off + dims.rot], &sin[off..off + dims.rot]);
                rotate_row(xr, yr, c, s, inverse);
            }
        });
    out
}

impl FusedOp<3> for Rope {
    const NAME: &'static str = "fused-rope";
    const WHAT: &'static str = "rope";

    fn forward(&self, [x, cos, sin]: [&[f32]; 3], [x_shape, cos_shape, _]: [&Shape; 3]) -> Forward {
        let dims = Dims::new(x_shape, cos_shape)?;
        let out = apply(x, cos, sin, &dims, false);
        Ok((out, x_shape.clone()))
    }

    fn backward(&self, [x, cos, sin]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> Grads<3> {
        let dims = Dims::new(x.shape(), cos.shape())?;
        let tensors = contiguous([grad, cos, sin])?;
        let guards = tensors.each_ref().map(Tensor::storage_and_layout);
        let [dy, c, s] = guard_slices(&guards, "rope")?;
        let dx = apply(dy, c, s, &dims, true);
        Ok([
            Some(Tensor::from_vec(dx, x.shape(), &Device::Cpu)?),
            None,
            None,
        ])
    }
}
