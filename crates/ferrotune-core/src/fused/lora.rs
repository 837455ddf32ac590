//! A LoRA layer as one op: `x Wᵀ (+ bias) + scale · (x Aᵀ) Bᵀ` with a frozen `W`, and its
//! backward, straight on GEMMs that accumulate into their outputs.
//!
//! Composed from candle ops, each of the ~200 adapted layers of a model allocates and adds several
//! `[tokens, features]` temporaries per step (the adapter branch, its scaling, the sum, and the
//! gradient accumulation of `x` from both branches). Here the adapter branch is added by the GEMM
//! that computes it, `dx` gathers both branches in one buffer, and only `x Aᵀ` (`[tokens, r]`) is
//! kept for the backward.

use std::sync::Mutex;

use candle_core::{bail, Device, Result, Shape, Tensor};

use crate::weight::BaseWeight;

use super::kernels::{
    self,
    Operands::{Nn, Nt, Tn},
};
use super::{contiguous, fused_applies, guard_slice, guard_slices, Forward};
use crate::custom_op::{Fused, FusedOp, Grads};

/// `x @ weightᵀ + bias + scale · (x @ aᵀ) @ bᵀ` for `x` `[..., in]`, `weight` `[out, in]`
/// (frozen), `a` `[r, in]`, `b` `[out, r]`: PEFT's `lora.Linear` forward without dropout; the
/// result is `[..., out]`. Gradients flow to `x`, `a` and `b`. One op for f32 CPU tensors and for
/// f32/bf16 CUDA tensors with a frozen weight and bias; composed from candle ops otherwise.
///
/// `weight` is a dense `&Tensor`, or an NF4 base `&Arc<Nf4Matrix>` (QLoRA): the same op, the
/// weight dequantized for the forward's and the backward's product and never kept.
pub fn lora_linear(
    x: &Tensor,
    weight: impl Into<BaseWeight>,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    lora_linear_on(x, weight.into(), bias, a, b, scale)
}

fn lora_linear_on(
    x: &Tensor,
    weight: BaseWeight,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    if x.rank() < 2 {
        bail!("lora_linear: x {:?} needs rows and features", x.dims());
    }
    let inp = x.dim(candle_core::D::Minus1)?;
    let (out, win) = weight.dims2()?;
    let (r, ain) = a.dims2()?;
    let (bout, br) = b.dims2()?;
    if win != inp || ain != inp || bout != out || br != r {
        bail!(
            "lora_linear: x {:?}, weight {:?}, a {:?}, b {:?} do not fit together",
            x.dims(),
            (out, win),
            a.dims(),
            b.dims()
        );
    }
    // A trained weight or bias (full fine-tuning) is not this op's case: the composed form gives
    // them their gradients. The weight (an NF4 one: what it dequantizes to) must match the input.
    let frozen = !weight.track_op() && bias.is_none_or(|t| !t.track_op());
    let weight_fits = weight.dtype() == x.dtype() && weight.device().same_device(x.device());
    let mut all = vec![x, a, b];
    all.extend(bias);
    #[cfg(feature = "cuda")]
    if frozen && weight_fits && x.elem_count() > 0 && crate::cuda::applies(&all) {
        // Any rank: the op treats the leading dimensions as rows, so the graph gets no reshape
        // nodes (each would cost a zero-fill and an add of its gradient in the backward).
        return crate::cuda::lora_linear(x, weight, bias, a, b, scale);
    }
    if x.rank() > 2 {
        let mut dims = x.dims().to_vec();
        let rows = x.elem_count() / inp.max(1);
        let y = lora_linear_on(&x.reshape((rows, inp))?, weight, bias, a, b, scale)?;
        *dims.last_mut().expect("rank ≥ 2") = out;
        return y.reshape(dims);
    }
    if !frozen || !weight_fits || !fused_applies(&all) {
        let base = match &weight {
            BaseWeight::Dense(w) => crate::ops::linear(x, w, bias)?,
            BaseWeight::Nf4(q) => {
                crate::ops::linear_with(x, out, bias, |rows| crate::frozen::nf4_matmul(rows, q))?
            }
        };
        let lora = crate::ops::linear(&crate::ops::linear(x, a, None)?, b, None)?;
        return base + (lora * scale)?;
    }
    let op = LoraLinear {
        weight: weight.contiguous()?,
        bias: bias.map(|t| t.contiguous()).transpose()?,
        scale: scale as f32,
        xa: Mutex::new(None),
    };
    x.contiguous()?
        .apply_op3(&a.contiguous()?, &b.contiguous()?, Fused(op))
}

struct LoraLinear {
    weight: BaseWeight,
    bias: Option<Tensor>,
    scale: f32,
    /// `x Aᵀ` from the forward pass, `[m, r]`.
    xa: Mutex<Option<Vec<f32>>>,
}

impl FusedOp<3> for LoraLinear {
    const NAME: &'static str = "fused-lora-linear";
    const WHAT: &'static str = "lora_linear";

    fn forward(&self, [x, a, b]: [&[f32]; 3], [x_shape, a_shape, b_shape]: [&Shape; 3]) -> Forward {
        let (m, inp) = x_shape.dims2()?;
        let (r, _) = a_shape.dims2()?;
        let (out, _) = b_shape.dims2()?;
        let weight = self.weight.dense()?;
        let wg = weight.storage_and_layout();
        let w = guard_slice(&wg, "lora_linear")?;
        let mut y = vec![0f32; m * out];
        let mut accumulate = false;
        if let Some(bias) = &self.bias {
            let bg = bias.storage_and_layout();
            let bias = guard_slice(&bg, "lora_linear")?;
            for row in y.chunks_mut(out) {
                row.copy_from_slice(bias);
            }
            accumulate = true;
        }
        let mut xa = vec![0f32; m * r];
        // y (+)= x · Wᵀ
        kernels::matmul(&mut y, (m, out, inp), accumulate, Nt, x, w, 1.0);
        // xa = x · Aᵀ
        kernels::matmul(&mut xa, (m, r, inp), false, Nt, x, a, 1.0);
        // y += scale · xa · Bᵀ
        kernels::matmul(&mut y, (m, out, r), true, Nt, &xa, b, self.scale);
        *self.xa.lock().unwrap_or_else(|e| e.into_inner()) = Some(xa);
        Ok((y, Shape::from((m, out))))
    }

    fn backward(&self, [x, a, b]: [&Tensor; 3], _res: &Tensor, grad: &Tensor) -> Grads<3> {
        let (m, inp) = x.dims2()?;
        let (r, _) = a.dims2()?;
        let (out, _) = b.dims2()?;
        let weight = self.weight.dense()?;
        let tensors = contiguous([grad, x, a, b, &weight])?;
        let guards = tensors.each_ref().map(Tensor::storage_and_layout);
        let [dy, xs, av, bv, w] = guard_slices(&guards, "lora_linear")?;
        let stored = self.xa.lock().unwrap_or_else(|e| e.into_inner());
        let Some(xa) = stored.as_ref() else {
            bail!("lora_linear: backward before forward");
        };
        let mut t = vec![0f32; m * r];
        let mut dx = vec![0f32; m * inp];
        let mut da = vec![0f32; r * inp];
        let mut db = vec![0f32; out * r];
        // t = dy · B                      [m, r]
        kernels::matmul(&mut t, (m, r, out), false, Nn, dy, bv, 1.0);
        // dx = dy · W + scale · t · A     [m, in]
        kernels::matmul(&mut dx, (m, inp, out), false, Nn, dy, w, 1.0);
        kernels::matmul(&mut dx, (m, inp, r), true, Nn, &t, av, self.scale);
        // dA = scale · tᵀ · x             [r, in]
        kernels::matmul(&mut da, (r, inp, m), false, Tn, &t, xs, self.scale);
        // dB = scale · dyᵀ · xa           [out, r]
        kernels::matmul(&mut db, (out, r, m), false, Tn, dy, xa, self.scale);
        let dev = Device::Cpu;
        Ok([
            Some(Tensor::from_vec(dx, (m, inp), &dev)?),
            Some(Tensor::from_vec(da, (r, inp), &dev)?),
            Some(Tensor::from_vec(db, (out, r), &dev)?),
        ])
    }
}
