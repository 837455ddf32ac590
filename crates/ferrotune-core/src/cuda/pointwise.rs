//! RMSNorm, gated activations and RoPE on the GPU: one kernel forward, one backward.

use candle_core::backend::BackendStorage;
use candle_core::cuda::{CudaDevice, CudaStorage};
use candle_core::{bail, DType, Layout, Result, Shape, Tensor};

use super::{
    alloc_storage, cuda_device, empty, launch, launch_dependent, launch_elementwise, ptr,
    storage_ptr, storage_ptr_at, stride_grid, suffix, Arg, Forward,
};
use crate::custom_op::{Cuda, CudaOp, Grads};
use crate::fused::GatedAct;

/// Largest hidden size whose weight-gradient row fits the kernel's shared memory (48 KiB).
const MAX_NORM_WIDTH: usize = 12 * 1024;

// ---------------------------------------------------------------------------------------------

/// [`crate::fused::rms_norm`] for CUDA tensors (`x` `[..., h]`, `weight` `[h]`, same dtype).
pub(crate) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64, offset_one: bool) -> Result<Tensor> {
    let h = weight.dim(0)?;
    if h > MAX_NORM_WIDTH {
        return crate::ops::rms_norm(x, weight, eps, offset_one);
    }
    x.contiguous()?.apply_op2(
        &weight.contiguous()?,
        Cuda(RmsNorm {
            eps: eps as f32,
            offset_one,
        }),
    )
}

/// Threads per row of `rmsnorm_fwd`: 256, or enough for its vector path (16 elements a thread,
/// `RMSNORM_CHUNKS` in kernels.cu) to hold a wider row.
fn rmsnorm_threads(h: usize) -> u32 {
    h.div_ceil(16).next_multiple_of(32).clamp(256, 1024) as u32
}

struct RmsNorm {
    eps: f32,
    offset_one: bool,
}

impl CudaOp<2> for RmsNorm {
    const NAME: &'static str = "cuda-rms-norm";
    const WHAT: &'static str = "rms_norm";

    fn forward(&self, [x, w]: [&CudaStorage; 2], [xl, wl]: [&Layout; 2]) -> Forward {
        let dtype = x.dtype();
        let h = wl.shape().elem_count();
        let rows = xl.shape().elem_count() / h.max(1);
        let out = alloc_storage(&x.device, dtype, rows * h)?;
        let out_ptr = storage_ptr(&out, &Layout::contiguous(xl.shape()))?;
        if rows > 0 {
            // The decode step's norms sit between its kernels: a dependent launch overlaps them.
            launch_dependent(
                &x.device,
                &format!("rmsnorm_fwd_{}", suffix(dtype)?),
                (rows as u32, 1, 1),
                rmsnorm_threads(h),
                0,
                &[
                    Arg::Ptr(storage_ptr(x, xl)?),
                    Arg::Ptr(storage_ptr(w, wl)?),
                    Arg::Ptr(out_ptr),
                    Arg::I32(h as i32),
                    Arg::F32(self.eps),
                    Arg::I32(self.offset_one as i32),
                ],
            )?;
        }
        Ok((out, xl.shape().clone()))
    }

    fn backward(&self, [x, w]: [&Tensor; 2], _res: &Tensor, dy: &Tensor) -> Grads<2> {
        let dev = cuda_device(x)?;
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        let h = w.dim(0)?;
        let rows = x.elem_count() / h.max(1);
        let dx = empty(&dev, x.dtype(), x.shape())?;
        // The weight's gradient only when it trains (full fine-tuning); LoRA leaves it frozen.
        let dw_acc = if w.track_op() {
            Some(Tensor::zeros(h, DType::F32, x.device())?)
        } else {
            None
        };
        // About four blocks per SM on an H100; each block adds its rows' dw once.
        let rows_per_block = rows.div_ceil(528).max(1);
        if rows > 0 {
            launch(
                &dev,
                &format!("rmsnorm_bwd_{}", suffix(x.dtype())?),
                (rows.div_ceil(rows_per_block) as u32, 1),
                256,
                if dw_acc.is_some() { (h * 4) as u32 } else { 0 },
                &[
                    Arg::Ptr(ptr(x)?),
                    Arg::Ptr(ptr(w)?),
                    Arg::Ptr(ptr(&dy)?),
                    Arg::Ptr(ptr(&dx)?),
                    Arg::Ptr(match &dw_acc {
                        Some(t) => ptr(t)?,
                        None => 0,
                    }),
                    Arg::I32(rows as i32),
                    Arg::I32(h as i32),
                    Arg::F32(self.eps),
                    Arg::I32(self.offset_one as i32),
                    Arg::I32(rows_per_block as i32),
                ],
            )?;
        }
        let dw = dw_acc.map(|t| t.to_dtype(w.dtype())).transpose()?;
        Ok([Some(dx), dw])
    }
}

// ---------------------------------------------------------------------------------------------

/// [`crate::fused::swiglu`] for CUDA tensors of one shape and dtype.
pub(crate) fn swiglu(gate: &Tensor, up: &Tensor, act: GatedAct) -> Result<Tensor> {
    gate.contiguous()?
        .apply_op2(&up.contiguous()?, Cuda(Glu { act: act_code(act) }))
}

pub(crate) fn act_code(act: GatedAct) -> i32 {
    match act {
        GatedAct::Silu => 0,
        GatedAct::GeluTanh => 1,
        GatedAct::GeluErf => 2,
    }
}

struct Glu {
    act: i32,
}

/// Launches the gated activation's kernel `kernel` over `n` elements (`n > 0`) of contiguous
/// `dtype` data: `glu_fwd` with the pointers (gate, up, out), `glu_bwd` with (gate, up, dy,
/// d_gate, d_up). The gated LoRA MLP runs the same kernels.
pub(super) fn launch_glu(
    dev: &CudaDevice,
    kernel: &str,
    dtype: DType,
    n: usize,
    ptrs: &[u64],
    act: i32,
) -> Result<()> {
    let mut args: Vec<Arg> = ptrs.iter().map(|&p| Arg::Ptr(p)).collect();
    args.extend([Arg::I64(n as i64), Arg::I32(act)]);
    launch_elementwise(dev, &format!("{kernel}_{}", suffix(dtype)?), n, &args)
}

impl CudaOp<2> for Glu {
    const NAME: &'static str = "cuda-gated-activation";
    const WHAT: &'static str = "swiglu";

    fn forward(&self, [g, u]: [&CudaStorage; 2], [gl, ul]: [&Layout; 2]) -> Forward {
        let dtype = g.dtype();
        let n = gl.shape().elem_count();
        let out = alloc_storage(&g.device, dtype, n)?;
        if n > 0 {
            let out_p = storage_ptr(&out, &Layout::contiguous(gl.shape()))?;
            let ptrs = [storage_ptr(g, gl)?, storage_ptr(u, ul)?, out_p];
            launch_glu(&g.device, "glu_fwd", dtype, n, &ptrs, self.act)?;
        }
        Ok((out, gl.shape().clone()))
    }

    fn backward(&self, [g, u]: [&Tensor; 2], _res: &Tensor, dy: &Tensor) -> Grads<2> {
        let dev = cuda_device(g)?;
        let dy = dy.to_dtype(g.dtype())?.contiguous()?;
        let n = g.elem_count();
        let dg = empty(&dev, g.dtype(), g.shape())?;
        let du = empty(&dev, g.dtype(), g.shape())?;
        if n > 0 {
            let ptrs = [ptr(g)?, ptr(u)?, ptr(&dy)?, ptr(&dg)?, ptr(&du)?];
            launch_glu(&dev, "glu_bwd", g.dtype(), n, &ptrs, self.act)?;
        }
        Ok([Some(dg), Some(du)])
    }
}

// ---------------------------------------------------------------------------------------------

/// [`crate::fused::rope`] for CUDA tensors: `x` `[b, heads, t, d]`, `cos`/`sin` `[b or 1, 1, t,
/// rot]` (cast to `x`'s dtype).
pub(crate) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let cos = cos.to_dtype(x.dtype())?.contiguous()?;
    let sin = sin.to_dtype(x.dtype())?.contiguous()?;
    // A transposed projection is read in place (the kernel takes strides): no contiguous copy
    // of q and k is made, nor kept by the graph.
    let x = if x.stride()[3] == 1 {
        x.clone()
    } else {
        x.contiguous()?
    };
    x.apply_op3(&cos, &sin, Cuda(Rope))
}

struct Rope;

/// Launches the RoPE kernel on contiguous pointers (`backward` maps dy to dx).
#[allow(clippy::too_many_arguments)]
fn launch_rope(
    dev: &candle_core::cuda::CudaDevice,
    dtype: DType,
    x: u64,
    x_strides: [usize; 3],
    cos: u64,
    sin: u64,
    y: u64,
    x_shape: &Shape,
    cos_shape: &Shape,
    backward: bool,
) -> Result<()> {
    let (_, heads, t, d) = x_shape.dims4()?;
    let (cb, _, _, rot) = cos_shape.dims4()?;
    let n = x_shape.elem_count();
    if n == 0 {
        return Ok(());
    }
    // The kernel's vector path (8 features a thread) when shapes and addresses allow it.
    let vector = d % 8 == 0
        && rot % 16 == 0
        && x_strides.iter().all(|s| s % 8 == 0)
        && [x, cos, sin, y].iter().all(|p| p % 16 == 0);
    launch(
        dev,
        &format!("rope_{}", suffix(dtype)?),
        (stride_grid(if vector { n / 8 } else { n }), 1),
        256,
        0,
        &[
            Arg::Ptr(x),
            Arg::Ptr(cos),
            Arg::Ptr(sin),
            Arg::Ptr(y),
            Arg::I64(n as i64),
            Arg::I32(heads as i32),
            Arg::I32(t as i32),
            Arg::I32(d as i32),
            Arg::I32(rot as i32),
            Arg::I32((cb != 1) as i32),
            Arg::I32(backward as i32),
            Arg::I64(x_strides[0] as i64),
            Arg::I64(x_strides[1] as i64),
            Arg::I64(x_strides[2] as i64),
        ],
    )
}

/// Element strides of the batch, head and position dimensions of a contiguous `[b, h, t, d]`.
fn contiguous_strides(shape: &Shape) -> Result<[usize; 3]> {
    let (_, h, t, d) = shape.dims4()?;
    Ok([h * t * d, t * d, d])
}

impl CudaOp<3> for Rope {
    const NAME: &'static str = "cuda-rope";
    const WHAT: &'static str = "rope";

    fn forward(&self, [x, c, s]: [&CudaStorage; 3], [xl, cl, sl]: [&Layout; 3]) -> Forward {
        let dtype = x.dtype();
        let out = alloc_storage(&x.device, dtype, xl.shape().elem_count())?;
        let st = xl.stride();
        if st[3] != 1 {
            bail!("rope: the feature dimension must be contiguous");
        }
        launch_rope(
            &x.device,
            dtype,
            storage_ptr_at(x, xl.start_offset())?,
            [st[0], st[1], st[2]],
            storage_ptr(c, cl)?,
            storage_ptr(s, sl)?,
            storage_ptr(&out, &Layout::contiguous(xl.shape()))?,
            xl.shape(),
            cl.shape(),
            false,
        )?;
        Ok((out, xl.shape().clone()))
    }

    fn backward(&self, [x, cos, sin]: [&Tensor; 3], _res: &Tensor, dy: &Tensor) -> Grads<3> {
        let dev = cuda_device(x)?;
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        let dx = empty(&dev, x.dtype(), x.shape())?;
        launch_rope(
            &dev,
            x.dtype(),
            ptr(&dy)?,
            contiguous_strides(dy.shape())?,
            ptr(cos)?,
            ptr(sin)?,
            ptr(&dx)?,
            x.shape(),
            cos.shape(),
            true,
        )?;
        Ok([Some(dx), None, None])
    }
}
