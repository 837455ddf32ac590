//! `x · Wᵀ` for a trainable weight (full fine-tuning), as one op with both gradients.
//!
//! candle builds `x.matmul(&w.t())` as a transpose node and a matmul node. Its backward then
//! produces the weight gradient as `xᵀ · dy` in `[in, out]`, adds it into a zero-filled buffer of
//! the transposed node, transposes that and adds it (a strided pass) into a second zero-filled
//! buffer for `w`. This op returns `dW = dyᵀ · x` directly in `[out, in]`: the same two GEMMs,
//! without the extra zero-fill and strided add per weight and step.

use std::sync::Arc;

use candle_core::{Device, Result, Shape, Tensor};

use super::kernels::Operands::{Nn, Nt, Tn};
use super::{contiguous, fused_applies, guard_slices, kernels, Forward};
use crate::custom_op::{Fused, FusedOp, Grads};

struct TrainableLinear;

impl FusedOp<2> for TrainableLinear {
    const NAME: &'static str = "fused-trainable-linear";
    const WHAT: &'static str = "trainable_linear";

    fn forward(&self, [x, w]: [&[f32]; 2], [x_shape, w_shape]: [&Shape; 2]) -> Forward {
        let (m, inp) = x_shape.dims2()?;
        let (out, _) = w_shape.dims2()?;
        let mut y = vec![0f32; m * out];
        kernels::matmul(&mut y, (m, out, inp), false, Nt, x, w, 1.0);
        Ok((y, Shape::from((m, out))))
    }

    fn backward(&self, [x, w]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> Grads<2> {
        let (m, inp) = x.dims2()?;
        let (out, _) = w.dims2()?;
        let tensors = contiguous([grad, x, w])?;
        let guards = tensors.each_ref().map(Tensor::storage_and_layout);
        let [dy, xs, ws] = guard_slices(&guards, "trainable_linear")?;
        let mut dx = vec![0f32; m * inp];
        let mut dw = vec![0f32; out * inp];
        // dx = dy · W          [m, in]
        kernels::matmul(&mut dx, (m, inp, out), false, Nn, dy, ws, 1.0);
        // dW = dyᵀ · x         [out, in]
        kernels::matmul(&mut dw, (out, inp, m), false, Tn, dy, xs, 1.0);
        let dev = Device::Cpu;
        Ok([
            Some(Tensor::from_vec(dx, (m, inp), &dev)?),
            Some(Tensor::from_vec(dw, (out, inp), &dev)?),
        ])
    }
}

/// `rows · weightᵀ` (`[m, in]` × `[out, in]` → `[m, out]`) with the gradients of both, for f32
/// CPU tensors; anything else takes candle's matmul (same values).
pub fn trainable_linear(rows: &Tensor, weight: &Tensor) -> Result<Tensor> {
    if !fused_applies(&[rows, weight]) {
        return rows.matmul(&weight.t()?);
    }
    let (_, inp) = rows.dims2()?;
    let (_, w_inp) = weight.dims2()?;
    if inp != w_inp {
        candle_core::bail!("trainable_linear: input has {inp} features, weight expects {w_inp}");
    }
    rows.contiguous()?.apply_op2_arc(
        &weight.contiguous()?,
        Arc::new(Box::new(Fused(TrainableLinear))),
    )
}
