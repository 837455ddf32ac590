//! The gate and up projections of a gated MLP, both LoRA-adapted, and the activation, as one
//! autograd op on the GPU: `act(x W_gᵀ + s_g·(x A_gᵀ) B_gᵀ) ⊙ (x W_uᵀ + s_u·(x A_uᵀ) B_uᵀ)`.
//!
//! As three ops, the graph holds the gate and up results as nodes, and candle's backward gives
//! each `[tokens, intermediate]` gradient a zero-filled buffer and an add — four passes over
//! 117 MB apiece per layer of an 8B model. Here they are plain saved tensors, and the input gets
//! its gradient from four accumulating GEMMs into one buffer.

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::cuda::CudaStorage;
use candle_core::op::BackpropOp;
use candle_core::{bail, Layout, Result, Storage, Tensor};

use super::pointwise::launch_glu;
use super::{alloc_storage, cuda_device, empty, ptr, storage_ptr, with_last_dim, Blas, Forward};
use crate::custom_op::{Cuda, CudaOp, Grads};
use crate::fused::kernels::Operands::{Nn, Nt, Tn};

/// [`crate::fused::gated_lora`] for CUDA tensors of one dtype: `x` `[..., in]`, frozen `w_gate`
/// and `w_up` `[inter, in]`, `a_cat` `[2r, in]` (A_g over A_u), `b_cat` `[2·inter, r]` (B_g over
/// B_u).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gated_lora(
    x: &Tensor,
    w_gate: &Tensor,
    w_up: &Tensor,
    a_cat: &Tensor,
    b_cat: &Tensor,
    scales: (f64, f64),
    act: i32,
) -> Result<Tensor> {
    let op = GatedLora {
        w_gate: w_gate.contiguous()?,
        w_up: w_up.contiguous()?,
        scales: (scales.0 as f32, scales.1 as f32),
        act,
        saved: Mutex::new(None),
    };
    x.contiguous()?
        .apply_op3(&a_cat.contiguous()?, &b_cat.contiguous()?, Cuda(op))
}

/// What the backward needs: the gate and up results and both `x Aᵀ` (`[m, r]` each).
struct Saved {
    gate: Tensor,
    up: Tensor,
    xa_gate: Tensor,
    xa_up: Tensor,
}

struct GatedLora {
    w_gate: Tensor,
    w_up: Tensor,
    scales: (f32, f32),
    act: i32,
    saved: Mutex<Option<Saved>>,
}

fn wrap(s: CudaStorage, shape: (usize, usize)) -> Tensor {
    Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
}

impl CudaOp<3> for GatedLora {
    const NAME: &'static str = "cuda-gated-lora-mlp";
    const WHAT: &'static str = "gated_lora";

    fn forward(&self, [x, a, b]: [&CudaStorage; 3], [xl, al, bl]: [&Layout; 3]) -> Forward {
        let dev = &x.device;
        let dtype = x.dtype();
        let blas = Blas { dev, dtype };
        let es = dtype.size_in_bytes() as u64;
        let inp = *xl.shape().dims().last().unwrap_or(&0);
        let m = xl.shape().elem_count() / inp.max(1);
        let (inter, _) = self.w_gate.dims2()?;
        let r = al.shape().dims2()?.0 / 2;
        let (x_p, a_p, b_p) = (
            storage_ptr(x, xl)?,
            storage_ptr(a, al)?,
            storage_ptr(b, bl)?,
        );
        let mut parts = Vec::with_capacity(4);
        for (w, a_off, b_off, s) in [
            (&self.w_gate, 0u64, 0u64, self.scales.0),
            (
                &self.w_up,
                (r * inp) as u64,
                (inter * r) as u64,
                self.scales.1,
            ),
        ] {
            // y = x Wᵀ;  xa = x Aᵀ;  y += s · xa Bᵀ.
            let y = alloc_storage(dev, dtype, m * inter)?;
            let xa = alloc_storage(dev, dtype, m * r)?;
            let y_p = storage_ptr(&y, &Layout::contiguous((m, inter)))?;
            let xa_p = storage_ptr(&xa, &Layout::contiguous((m, r)))?;
            blas.gemm((m, inter, inp), Nt, x_p, ptr(w)?, y_p, 1.0, 0.0)?;
            blas.gemm((m, r, inp), Nt, x_p, a_p + a_off * es, xa_p, 1.0, 0.0)?;
            blas.gemm((m, inter, r), Nt, xa_p, b_p + b_off * es, y_p, s, 1.0)?;
            parts.push((wrap(y, (m, inter)), wrap(xa, (m, r))));
        }
        let (up, xa_up) = parts.pop().expect("two parts");
        let (gate, xa_gate) = parts.pop().expect("two parts");
        let out = alloc_storage(dev, dtype, m * inter)?;
        let n = m * inter;
        if n > 0 {
            let out_p = storage_ptr(&out, &Layout::contiguous((m, inter)))?;
            let ptrs = [ptr(&gate)?, ptr(&up)?, out_p];
            launch_glu(dev, "glu_fwd", dtype, n, &ptrs, self.act)?;
        }
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some(Saved {
            gate,
            up,
            xa_gate,
            xa_up,
        });
        Ok((out, with_last_dim(xl.shape(), inter)))
    }

    fn backward(&self, [x, a, b]: [&Tensor; 3], _res: &Tensor, dy: &Tensor) -> Grads<3> {
        let saved = self.saved.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(saved) = saved else {
            bail!("gated_lora: backward without forward")
        };
        let dev = cuda_device(x)?;
        let dtype = x.dtype();
        let blas = Blas { dev: &dev, dtype };
        let es = dtype.size_in_bytes() as u64;
        let inp = x.dim(candle_core::D::Minus1)?;
        let m = x.elem_count() / inp.max(1);
        let (inter, _) = self.w_gate.dims2()?;
        let r = a.dim(0)? / 2;
        let dy = dy.to_dtype(dtype)?.contiguous()?;
        let n = m * inter;
        let dg = empty(&dev, dtype, (m, inter))?;
        let du = empty(&dev, dtype, (m, inter))?;
        if n > 0 {
            let (gate, up) = (ptr(&saved.gate)?, ptr(&saved.up)?);
            let ptrs = [gate, up, ptr(&dy)?, ptr(&dg)?, ptr(&du)?];
            launch_glu(&dev, "glu_bwd", dtype, n, &ptrs, self.act)?;
        }
        drop(saved.gate);
        drop(saved.up);
        let da = empty(&dev, dtype, (2 * r, inp))?;
        let db = empty(&dev, dtype, (2 * inter, r))?;
        let (x_p, a_p, b_p) = (ptr(x)?, ptr(a)?, ptr(b)?);
        let (da_p, db_p) = (ptr(&da)?, ptr(&db)?);
        let mut dxas = Vec::with_capacity(2);
        for (d, xa, a_off, b_off, s) in [
            (&dg, &saved.xa_gate, 0u64, 0u64, self.scales.0),
            (
                &du,
                &saved.xa_up,
                (r * inp) as u64,
                (inter * r) as u64,
                self.scales.1,
            ),
        ] {
            // d(xa) = s · d B;  dB = s · dᵀ xa;  dA = d(xa)ᵀ x.
            let dxa = empty(&dev, dtype, (m, r))?;
            let (d_p, xa_p, dxa_p) = (ptr(d)?, ptr(xa)?, ptr(&dxa)?);
            // This projection's blocks of B, dB and dA.
            let (b_s, db_s, da_s) = (b_p + b_off * es, db_p + b_off * es, da_p + a_off * es);
            blas.gemm((m, r, inter), Nn, d_p, b_s, dxa_p, s, 0.0)?;
            blas.gemm((inter, r, m), Tn, d_p, xa_p, db_s, s, 0.0)?;
            blas.gemm((r, inp, m), Tn, dxa_p, x_p, da_s, 1.0, 0.0)?;
            dxas.push(dxa);
        }
        // dx = dg W_g + du W_u + d(xa_g) A_g + d(xa_u) A_u, accumulated in one buffer.
        let dx = if x.track_op() {
            let dx = empty(&dev, dtype, x.shape())?;
            let dx_p = ptr(&dx)?;
            let (dg_p, wg_p) = (ptr(&dg)?, ptr(&self.w_gate)?);
            let (du_p, wu_p) = (ptr(&du)?, ptr(&self.w_up)?);
            let (dxa_g, dxa_u) = (ptr(&dxas[0])?, ptr(&dxas[1])?);
            let a_up = a_p + (r * inp) as u64 * es;
            blas.gemm((m, inp, inter), Nn, dg_p, wg_p, dx_p, 1.0, 0.0)?;
            blas.gemm((m, inp, inter), Nn, du_p, wu_p, dx_p, 1.0, 1.0)?;
            blas.gemm((m, inp, r), Nn, dxa_g, a_p, dx_p, 1.0, 1.0)?;
            blas.gemm((m, inp, r), Nn, dxa_u, a_up, dx_p, 1.0, 1.0)?;
            Some(dx)
        } else {
            None
        };
        Ok([dx, Some(da), Some(db)])
    }
}
