//! `x · Wᵀ` for a trainable weight (full fine-tuning), as one op with both gradients.
//!
//! candle builds `x.matmul(&w.t())` as a transpose node and a matmul node. Its backward then
//! produces the weight gradient as `xᵀ · dy` in `[in, out]`, adds it into a zero-filled buffer of
//! the transposed node, transposes that and adds it (a strided pass) into a second zero-filled
//! buffer for `w`. This op returns `dW = dyᵀ · x` directly in `[out, in]`: the same two GEMMs,
//! without the extra zero-fill and strided add per weight and step.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, Device, Layout, Result, Shape, Tensor};

use super::{fused_applies, guard_slice, kernels, slice_of};

struct TrainableLinear;

impl CustomOp2 for TrainableLinear {
    fn name(&self) -> &'static str {
        "fused-trainable-linear"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, inp) = xl.shape().dims2()?;
        let (out, _) = wl.shape().dims2()?;
        let x = slice_of(xs, xl, "trainable_linear")?;
        let w = slice_of(ws, wl, "trainable_linear")?;
        let mut y = vec![0f32; m * out];
        // SAFETY: shapes checked by the caller; buffers sized to them; the output is fresh.
        unsafe {
            kernels::gemm_parallel(
                (m, out, inp),
                y.as_mut_ptr(),
                out,
                false,
                (x.as_ptr(), inp, 1),
                (w.as_ptr(), 1, inp),
                1.0,
            );
        }
        Ok((CpuStorage::F32(y), Shape::from((m, out))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (m, inp) = x.dims2()?;
        let (out, _) = w.dims2()?;
        let dy_t = grad.contiguous()?;
        let dyg = dy_t.storage_and_layout();
        let dy = guard_slice(&dyg, "trainable_linear")?;
        let xg = x.storage_and_layout();
        let xs = guard_slice(&xg, "trainable_linear")?;
        let wg = w.storage_and_layout();
        let ws = guard_slice(&wg, "trainable_linear")?;
        let mut dx = vec![0f32; m * inp];
        let mut dw = vec![0f32; out * inp];
        // SAFETY: as in the forward pass.
        unsafe {
            // dx = dy · W          [m, in]
            kernels::gemm_parallel(
                (m, inp, out),
                dx.as_mut_ptr(),
                inp,
                false,
                (dy.as_ptr(), out, 1),
                (ws.as_ptr(), inp, 1),
                1.0,
            );
            // dW = dyᵀ · x         [out, in]
            kernels::gemm_parallel(
                (out, inp, m),
                dw.as_mut_ptr(),
                inp,
                false,
                (dy.as_ptr(), 1, out),
                (xs.as_ptr(), inp, 1),
                1.0,
            );
        }
        let dev = Device::Cpu;
        Ok((
            Some(Tensor::from_vec(dx, (m, inp), &dev)?),
            Some(Tensor::from_vec(dw, (out, inp), &dev)?),
        ))
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
    rows.contiguous()?
        .apply_op2_arc(&weight.contiguous()?, Arc::new(Box::new(TrainableLinear)))
}
