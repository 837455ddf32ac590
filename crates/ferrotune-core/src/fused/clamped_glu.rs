//! gpt-oss's clamped SwiGLU on its interleaved gate/up projection in one pass, with its backward.

use candle_core::{bail, Device, Result, Shape, Tensor, D};
use rayon::prelude::*;

use super::kernels::{self, simd_fn};
use super::{contiguous, fused_applies, guard_slices, Forward};
use crate::custom_op::{Fused, FusedOp, Grads};

/// gpt-oss's expert activation on `gate_up` `[..., 2 · inter]` (gate at even columns, up at odd
/// ones, as `mlp.experts.gate_up_proj` gives them): `(clamp(up, ±limit) + 1) · g · σ(alpha · g)`
/// with `g = min(gate, limit)`, `[..., inter]`; differentiable w.r.t. `gate_up` (as torch's
/// `clamp`, a value at a bound passes its gradient, one beyond it passes none).
///
/// For f32 CPU tensors this is one fused op that keeps only its input for the backward; other
/// dtypes and devices use the composite candle formula, which holds every intermediate.
pub fn clamped_swiglu_interleaved(gate_up: &Tensor, alpha: f64, limit: f64) -> Result<Tensor> {
    let last = gate_up.dim(D::Minus1)?;
    if last % 2 != 0 {
        bail!(
            "clamped swiglu: gate_up {:?} has an odd last dimension (gate and up interleaved)",
            gate_up.dims()
        );
    }
    if gate_up.elem_count() == 0 || !fused_applies(&[gate_up]) {
        return composite(gate_up, alpha, limit);
    }
    let op = ClampedGlu {
        alpha: alpha as f32,
        limit: limit as f32,
    };
    gate_up.contiguous()?.apply_op1(Fused(op))
}

/// The composite formula from candle ops.
fn composite(gate_up: &Tensor, alpha: f64, limit: f64) -> Result<Tensor> {
    let mut pairs = gate_up.dims().to_vec();
    let inter = pairs.pop().unwrap_or(0) / 2;
    pairs.extend([inter, 2]);
    let gate_up = gate_up.reshape(pairs.as_slice())?;
    let gate = gate_up.narrow(D::Minus1, 0, 1)?.squeeze(D::Minus1)?;
    let up = gate_up.narrow(D::Minus1, 1, 1)?.squeeze(D::Minus1)?;
    let gate = gate.minimum(limit)?;
    let up = up.clamp(-limit, limit)?;
    // σ(x) = 1 / (1 + e^−x), from differentiable ops.
    let sig = ((&gate * alpha)?.neg()?.exp()? + 1.0)?.recip()?;
    (up + 1.0)? * (gate * sig)?
}

struct ClampedGlu {
    alpha: f32,
    limit: f32,
}

/// Output elements per parallel task.
const CHUNK: usize = 1 << 13;

simd_fn! {
    /// `out[i] = (clamp(u, ±limit) + 1) · g · σ(alpha g)`, `g = min(gate, limit)`, from the pairs
    /// `(gate, up)` of `gate_up`.
    fn forward_kernel(alpha: f32, limit: f32, gate_up: &[f32], out: &mut [f32]) {
        for (o, gu) in out.iter_mut().zip(gate_up.chunks_exact(2)) {
            let g = gu[0].min(limit);
            let u = gu[1].max(-limit).min(limit);
            *o = (u + 1.0) * (g / (1.0 + kernels::exp(-alpha * g)));
        }
    }
}

simd_fn! {
    /// The gradient of the pairs `(gate, up)` from the output's gradient `dy`.
    fn backward_kernel(alpha: f32, limit: f32, gate_up: &[f32], dy: &[f32], d: &mut [f32]) {
        for ((dgu, gu), &dy) in d.chunks_exact_mut(2).zip(gate_up.chunks_exact(2)).zip(dy) {
            let (gr, ur) = (gu[0], gu[1]);
            let g = gr.min(limit);
            let u = ur.max(-limit).min(limit);
            let s = 1.0 / (1.0 + kernels::exp(-alpha * g));
            let glu = g * s;
            let pass_g = if gr <= limit { 1.0 } else { 0.0 };
            let pass_u = if ur >= -limit && ur <= limit { 1.0 } else { 0.0 };
            dgu[0] = dy * (u + 1.0) * (s + alpha * glu * (1.0 - s)) * pass_g;
            dgu[1] = dy * glu * pass_u;
        }
    }
}

impl FusedOp<1> for ClampedGlu {
    const NAME: &'static str = "fused-clamped-swiglu";
    const WHAT: &'static str = "clamped swiglu";

    fn forward(&self, [gate_up]: [&[f32]; 1], [shape]: [&Shape; 1]) -> Forward {
        let mut dims = shape.dims().to_vec();
        if let Some(last) = dims.last_mut() {
            *last /= 2;
        }
        let mut out = vec![0f32; gate_up.len() / 2];
        out.par_chunks_mut(CHUNK)
            .zip(gate_up.par_chunks(2 * CHUNK))
            .for_each(|(o, gu)| forward_kernel(self.alpha, self.limit, gu, o));
        Ok((out, Shape::from(dims)))
    }

    fn backward(&self, [gate_up]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> Grads<1> {
        let tensors = contiguous([gate_up, grad])?;
        let guards = tensors.each_ref().map(Tensor::storage_and_layout);
        let [gu, dy] = guard_slices(&guards, Self::WHAT)?;
        let mut d = vec![0f32; gu.len()];
        d.par_chunks_mut(2 * CHUNK)
            .zip(gu.par_chunks(2 * CHUNK).zip(dy.par_chunks(CHUNK)))
            .for_each(|(d, (gu, dy))| backward_kernel(self.alpha, self.limit, gu, dy, d));
        Ok([Some(Tensor::from_vec(d, gate_up.shape(), &Device::Cpu)?)])
    }
}
