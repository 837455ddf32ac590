//! `torch.nn.utils.clip_grad_norm_` (L2 norm) over the gradients held in a [`GradStore`].

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor};

/// Rescales the gradients of `params` so that their joint L2 norm is at most `max_norm`, and returns
/// the norm before clipping.
///
/// Follows torch: each gradient's norm is taken in f32, the total norm is the norm of those norms,
/// `clip_coef = max_norm / (total_norm + 1e-6)` and gradients are multiplied by `clip_coef` only
/// when it is below 1 (torch clamps it to 1.0, a no-op multiply). Parameters without a gradient
/// are ignored. A non-finite total norm is returned as is (torch's `error_if_nonfinite=False`) and the
/// gradients are scaled as torch scales them (by 0 for an infinite norm, by NaN for a NaN one): the
/// recipe decides whether to skip the step.
///
/// `params` are the parameters' tensors (`var.as_tensor()`), whose ids key `grads`.
pub fn clip_grad_norm<'a>(
    grads: &mut GradStore,
    params: impl IntoIterator<Item = &'a Tensor>,
    max_norm: f64,
) -> Result<f64> {
    clip_grad_norm_global(grads, params, max_norm, Ok)
}

/// [`clip_grad_norm`] over gradients spread across processes: `sum_over_ranks` turns this
/// process's sum of squared gradient norms into the sum over every process (an all-reduce), so
/// that each one clips its shard by the norm of the whole gradient.
pub fn clip_grad_norm_global<'a>(
    grads: &mut GradStore,
    params: impl IntoIterator<Item = &'a Tensor>,
    max_norm: f64,
    sum_over_ranks: impl FnOnce(f32) -> Result<f32>,
) -> Result<f64> {
    let params: Vec<&Tensor> = params
        .into_iter()
        .filter(|p| grads.get(p).is_some())
        .collect();
    let mut norms = Vec::with_capacity(params.len());
    for p in &params {
        let g = grads.get(p).expect("filtered above").to_dtype(DType::F32)?;
        norms.push(g.sqr()?.sum_all()?.sqrt()?);
    }
    // One host sync for the whole set: the norms stay on the device until the total is formed.
    let local_sq = if norms.is_empty() {
        0.0
    } else {
        Tensor::stack(&norms, 0)?
            .sqr()?
            .sum_all()?
            .to_scalar::<f32>()?
    };
    let total = sum_over_ranks(local_sq)?.sqrt();
    if params.is_empty() {
        return Ok(f64::from(total));
    }
    // torch evaluates `max_norm / (total + 1e-6)` on f32 tensors, the division as reciprocal * max_norm.
    let clip_coef = (1.0f32 / (total + 1e-6f32)) * max_norm as f32;
    // torch's `clamp(max=1.0)` propagates NaN, so a NaN coefficient is applied too.
    if clip_coef < 1.0 || clip_coef.is_nan() {
        for p in params {
            let g = grads.get(p).expect("filtered above");
            // The product is taken in f32 and rounded once into the gradient's dtype, like torch's
            // bf16 * f32-scalar-tensor multiply.
            let scaled = g
                .to_dtype(DType::F32)?
                .affine(f64::from(clip_coef), 0.0)?
                .to_dtype(g.dtype())?;
            grads.insert(p, scaled);
        }
    }
    Ok(f64::from(total))
}

/// Multiplies the gradients of `params` by `factor` (torchtune's `training.scale_grads`).
///
/// The alternative to normalising each micro-batch's loss: backpropagate the summed losses
/// ([`crate::LossSum::sum`]) of all micro-batches, then scale once by `1 / total_tokens` before
/// clipping and stepping. The product is taken in f32 and rounded once into each gradient's dtype.
pub fn scale_grads<'a>(
    grads: &mut GradStore,
    params: impl IntoIterator<Item = &'a Tensor>,
    factor: f64,
) -> Result<()> {
    for p in params {
        let Some(g) = grads.get(p) else { continue };
        let scaled = g
            .to_dtype(DType::F32)?
            .affine(factor, 0.0)?
            .to_dtype(g.dtype())?;
        grads.insert(p, scaled);
    }
    Ok(())
}
