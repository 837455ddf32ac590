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
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};

use super::{
    alloc_storage, cpu_unsupported, cuda_device, empty, gemm, launch, ptr, storage_ptr,
    stride_grid, suffix, Arg,
};

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
        .apply_op3(&a.contiguous()?, &b.contiguous()?, op)
}

struct LoraOp {
    weight: crate::weight::BaseWeight,
    bias: Option<Tensor>,
    scale: f32,
    /// `x Aᵀ` `[m, r]`, saved by the forward.
    xa: Mutex<Option<Tensor>>,
}

impl CustomOp3 for LoraOp {
    fn name(&self) -> &'static str {
        "cuda-lora-linear"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        cpu_unsupported("lora_linear")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        a: &CudaStorage,
        al: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = &x.device;
        let dtype = x.dtype();
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
        let x_ptr = storage_ptr(x, xl)?;
        // y = x Wᵀ (+ bias); xa = x Aᵀ; y += scale · xa Bᵀ.
        gemm(
            dev,
            dtype,
            (m, out, inp),
            x_ptr,
            false,
            ptr(&weight)?,
            true,
            y_ptr,
            1.0,
            0.0,
        )?;
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
        gemm(
            dev,
            dtype,
            (m, r, inp),
            x_ptr,
            false,
            storage_ptr(a, al)?,
            true,
            xa_ptr,
            1.0,
            0.0,
        )?;
        gemm(
            dev,
            dtype,
            (m, out, r),
            xa_ptr,
            false,
            storage_ptr(b, bl)?,
            true,
            y_ptr,
            self.scale,
            1.0,
        )?;
        let xa = Tensor::from_storage(Storage::Cuda(xa), (m, r), BackpropOp::none(), false);
        *self.xa.lock().unwrap_or_else(|e| e.into_inner()) = Some(xa);
        let mut dims = xl.shape().dims().to_vec();
        *dims.last_mut().expect("rank ≥ 2") = out;
        Ok((y, Shape::from(dims)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let xa = self.xa.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(xa) = xa else {
            bail!("lora_linear: backward without forward")
        };
        let dev = cuda_device(x)?;
        let dtype = x.dtype();
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
        gemm(
            &dev,
            dtype,
            (m, r, out),
            dy_p,
            false,
            b_p,
            false,
            ptr(&dxa)?,
            s,
            0.0,
        )?;
        gemm(
            &dev,
            dtype,
            (out, r, m),
            dy_p,
            true,
            xa_p,
            false,
            ptr(&db)?,
            s,
            0.0,
        )?;
        gemm(
            &dev,
            dtype,
            (r, inp, m),
            ptr(&dxa)?,
            true,
            x_p,
            false,
            ptr(&da)?,
            1.0,
            0.0,
        )?;
        // The first layers' inputs (the frozen embedding's output) need no gradient.
        let dx = if x.track_op() {
            let weight = self.weight.dense()?;
            let dx = empty(&dev, dtype, x.shape())?;
            gemm(
                &dev,
                dtype,
                (m, inp, out),
                dy_p,
                false,
                ptr(&weight)?,
                false,
                ptr(&dx)?,
                1.0,
                0.0,
            )?;
            gemm(
                &dev,
                dtype,
                (m, inp, r),
                ptr(&dxa)?,
                false,
                a_p,
                false,
                ptr(&dx)?,
                1.0,
                1.0,
            )?;
            Some(dx)
        } else {
            None
        };
        Ok((dx, Some(da), Some(db)))
    }
}
