//! A LoRA layer on the GPU as one autograd op: `x Wᵀ (+ bias) + scale · (x Aᵀ) Bᵀ` with a frozen
//! `W`, straight on cuBLAS: the adapter branch is accumulated into the base result by the GEMM
//! that computes it (`beta = 1`), `dx` gathers both branches in one buffer the same way, and only
//! `x Aᵀ` (`[tokens, r]`) is kept for the backward. Composed from candle ops, the graph would
//! instead hold the base result, the adapter branch, its scaled copy and the sum — four
//! `[tokens, out]` tensors per adapted layer.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda::CudaStorage;
use candle_core::op::BackpropOp;
use candle_core::{bail, Layout, Result, Storage, Tensor};

use super::{
    alloc_storage, cuda_device, empty, launch, ptr, storage_ptr, stride_grid, suffix,
    with_last_dim, Arg, Blas, Forward,
};
use crate::custom_op::{Cuda, CudaOp, Grads};
use crate::fused::kernels::Operands::{Nn, Nt, Tn};

/// [`crate::fused::lora_linear`] for CUDA tensors of one dtype, frozen `weight` and `bias`:
/// `x` `[..., in]` (leading dimensions are rows), `weight` `[out, in]`, `a` `[r, in]`,
/// `b` `[out, r]`.
pub(crate) fn lora_linear(
    x: &Tensor,
    weight: crate::weight::BaseWeight,
    bias: Option<&Tensor>,
    a: &Tensor,
    b: &Tensor,
    scale: f64,
) -> Result<Tensor> {
    let op = LoraOp {
        weight: weight.contiguous()?,
        bias: bias.map(|t| t.contiguous()).transpose()?,
        scale: scale as f32,
        xa: Mutex::new(None),
    };
    x.contiguous()?
        .apply_op3(&a.contiguous()?, &b.contiguous()?, Cuda(op))
}

struct LoraOp {
    weight: crate::weight::BaseWeight,
    bias: Option<Tensor>,
    scale: f32,
    /// `x Aᵀ` `[m, r]`, saved by the forward.
    xa: Mutex<Option<Tensor>>,
}

impl CudaOp<3> for LoraOp {
    const NAME: &'static str = "cuda-lora-linear";
    const WHAT: &'static str = "lora_linear";

    fn forward(&self, [x, a, b]: [&CudaStorage; 3], [xl, al, bl]: [&Layout; 3]) -> Forward {
        let dev = &x.device;
        let dtype = x.dtype();
        let blas = Blas { dev, dtype };
        let inp = *xl.shape().dims().last().unwrap_or(&0);
        let m = xl.shape().elem_count() / inp.max(1);
        let (r, _) = al.shape().dims2()?;
        let (out, _) = self.weight.dims2()?;
        // An NF4 base is expanded here and dropped when the op returns.
        let weight = self.weight.dense()?;
        let y = alloc_storage(dev, dtype, m * out)?;
        let y_ptr = storage_ptr(&y, &Layout::contiguous((m, out)))?;
        let xa = alloc_storage(dev, dtype, m * r)?;
        let xa_ptr = storage_ptr(&xa, &Layout::contiguous((m, r)))?;
        let (x_ptr, a_ptr, b_ptr) = (
            storage_ptr(x, xl)?,
            storage_ptr(a, al)?,
            storage_ptr(b, bl)?,
        );
        // y = x Wᵀ (+ bias); xa = x Aᵀ; y += scale · xa Bᵀ.
        blas.gemm((m, out, inp), Nt, x_ptr, ptr(&weight)?, y_ptr, 1.0, 0.0)?;
        if let Some(bias) = &self.bias {
            launch(
                dev,
                &format!("bias_add_{}", suffix(dtype)?),
                (stride_grid(m * out), 1),
                256,
                0,
                &[
                    Arg::Ptr(y_ptr),
                    Arg::Ptr(ptr(bias)?),
                    Arg::I64(m as i64),
                    Arg::I32(out as i32),
                ],
            )?;
        }
        blas.gemm((m, r, inp), Nt, x_ptr, a_ptr, xa_ptr, 1.0, 0.0)?;
        blas.gemm((m, out, r), Nt, xa_ptr, b_ptr, y_ptr, self.scale, 1.0)?;
        let xa = Tensor::from_storage(Storage::Cuda(xa), (m, r), BackpropOp::none(), false);
        *self.xa.lock().unwrap_or_else(|e| e.into_inner()) = Some(xa);
        Ok((y, with_last_dim(xl.shape(), out)))
    }

    fn backward(&self, [x, a, b]: [&Tensor; 3], _res: &Tensor, dy: &Tensor) -> Grads<3> {
        let xa = self.xa.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(xa) = xa else {
            bail!("lora_linear: backward without forward")
        };
        let dev = cuda_device(x)?;
        let dtype = x.dtype();
        let blas = Blas { dev: &dev, dtype };
        let inp = x.dim(candle_core::D::Minus1)?;
        let m = x.elem_count() / inp.max(1);
        let (r, _) = a.dims2()?;
        let (out, _) = b.dims2()?;
        let dy = dy.to_dtype(dtype)?.contiguous()?;
        let (x_p, a_p, b_p, dy_p, xa_p) = (ptr(x)?, ptr(a)?, ptr(b)?, ptr(&dy)?, ptr(&xa)?);
        let dxa = empty(&dev, dtype, (m, r))?;
        let da = empty(&dev, dtype, (r, inp))?;
        let db = empty(&dev, dtype, (out, r))?;
        let s = self.scale;
        // d(xa) = scale · dy B;  dB = scale · dyᵀ xa;  dA = d(xa)ᵀ x;  dx = dy W + d(xa) A.
        blas.gemm((m, r, out), Nn, dy_p, b_p, ptr(&dxa)?, s, 0.0)?;
        blas.gemm((out, r, m), Tn, dy_p, xa_p, ptr(&db)?, s, 0.0)?;
        blas.gemm((r, inp, m), Tn, ptr(&dxa)?, x_p, ptr(&da)?, 1.0, 0.0)?;
        // The first layers' inputs (the frozen embedding's output) need no gradient.
        let dx = if x.track_op() {
            let weight = self.weight.dense()?;
            let dx = empty(&dev, dtype, x.shape())?;
            blas.gemm((m, inp, out), Nn, dy_p, ptr(&weight)?, ptr(&dx)?, 1.0, 0.0)?;
            blas.gemm((m, inp, r), Nn, ptr(&dxa)?, a_p, ptr(&dx)?, 1.0, 1.0)?;
            Some(dx)
        } else {
            None
        };
        Ok([dx, Some(da), Some(db)])
    }
}
