//! AdamW on the GPU: one kernel per parameter updates the f32 master (or the f32 parameter
//! itself), both moments, and the model's bf16 copy, where candle ops take about fifteen launches
//! and as many passes over memory.

use candle_core::{bail, DType, Result, Tensor};

use super::{cuda_device, launch, ptr, stride_grid, suffix, Arg};

/// The scalars of one AdamW step, as `torch.optim.AdamW` derives them for the step.
#[derive(Debug, Clone, Copy)]
pub struct AdamWStep {
    /// Multiplies the gradient first (e.g. 1 / number of target tokens).
    pub grad_scale: f32,
    /// `1 − lr · weight_decay`.
    pub decay: f32,
    /// `1 − beta1` (must be below 0.5: lerp's small-weight branch).
    pub one_minus_beta1: f32,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    /// `sqrt(1 − beta2^step)`.
    pub bias_correction2_sqrt: f32,
    pub eps: f32,
    /// `−lr / (1 − beta1^step)`.
    pub neg_step_size: f32,
}

/// Updates, in place, the f32 parameter `p32` and the moments `exp_avg`/`exp_avg_sq` (f32,
/// contiguous, all on one GPU) from `grad`, and writes the result rounded to `model_copy`'s dtype
/// into `model_copy` when there is one (a bf16 parameter whose master is `p32`). `grad` and
/// `model_copy` share one dtype (f32 or bf16).
pub fn adamw_step(
    p32: &Tensor,
    model_copy: Option<&Tensor>,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    s: &AdamWStep,
) -> Result<()> {
    let n = p32.elem_count();
    for t in [exp_avg, exp_avg_sq] {
        if t.dtype() != DType::F32 || t.elem_count() != n || !t.is_contiguous() {
            bail!("adamw_step: moments must be contiguous f32 tensors of {n} elements");
        }
    }
    if p32.dtype() != DType::F32 || !p32.is_contiguous() || grad.elem_count() != n {
        bail!("adamw_step: the parameter must be contiguous f32 and match its gradient");
    }
    if let Some(m) = model_copy {
        if m.dtype() != grad.dtype() || m.elem_count() != n || !m.is_contiguous() {
            bail!("adamw_step: the model copy must be contiguous, of the gradient's dtype");
        }
    }
    if s.one_minus_beta1 >= 0.5 {
        bail!("adamw_step: 1 - beta1 must be below 0.5");
    }
    let grad = grad.contiguous()?;
    let dev = cuda_device(p32)?;
    if n == 0 {
        return Ok(());
    }
    launch(
        &dev,
        &format!("adamw_{}", suffix(grad.dtype())?),
        (stride_grid(n), 1),
        256,
        0,
        &[
            Arg::Ptr(ptr(p32)?),
            Arg::Ptr(match model_copy {
                Some(m) => ptr(m)?,
                None => 0,
            }),
            Arg::Ptr(ptr(&grad)?),
            Arg::Ptr(ptr(exp_avg)?),
            Arg::Ptr(ptr(exp_avg_sq)?),
            Arg::I64(n as i64),
            Arg::F32(s.grad_scale),
            Arg::F32(s.decay),
            Arg::F32(s.one_minus_beta1),
            Arg::F32(s.beta2),
            Arg::F32(s.one_minus_beta2),
            Arg::F32(s.bias_correction2_sqrt),
            Arg::F32(s.eps),
            Arg::F32(s.neg_step_size),
        ],
    )
}
