//! Fake quantization for quantization-aware training, as torchao's
//! `Int8DynActInt4WeightQATQuantizer` applies it to a linear layer (torchtune's QAT recipes):
//! the input is rounded to int8 per token (asymmetric, a scale and zero point from each token's
//! min and max), the weight to int4 per group of `group_size` inputs (symmetric, the scale from the
//! group's absolute maximum / 7.5), each then mapped back to floats.
//!
//! As torchao: the scales and zero points are computed without gradient (`choose_qparams_affine`
//! is `no_grad`), rounding is half to even with a straight-through gradient, and the clamp to the
//! integer range passes the gradient only where the rounded value lies strictly inside it (torch
//! 2.15's clamp gives its bounds none).
//! The gradient is therefore the incoming one masked, for activations and weights alike.
//!
//! f32 on the CPU runs as one fused pass per row ([`crate::fused::fake_quantize_rows`]); other
//! dtypes and devices compose candle ops that exist everywhere (no kernel of their own).

use candle_core::{DType, Result, Tensor, D};

use crate::fused;

/// `round` with ties to even (torch.round), without gradient.
fn round_half_even(x: &Tensor) -> Result<Tensor> {
    let x = x.detach();
    let away = x.round()?; // ties away from zero
    let tie = (&x - x.floor()?)?.eq(0.5)?;
    // An odd result of a tie moves one step towards zero.
    let half = (&away * 0.5)?;
    let odd = (&half - half.floor()?)?.ne(0.0)?;
    let sign = x
        .ge(0.0)?
        .where_cond(&x.ones_like()?, &x.ones_like()?.neg()?)?;
    let fix = tie
        .to_dtype(DType::U8)?
        .mul(&odd.to_dtype(DType::U8)?)?
        .ne(0u8)?;
    fix.where_cond(&(&away - &sign)?, &away)
}

/// `(clamp(round(x · (1/scale)) + zp, qmin, qmax) − zp) · scale` with `scale` and `zp`
/// broadcast over `x`'s last dimension (`[rows, 1]` against `[rows, n]`), and torchao's gradient:
/// the incoming gradient where `round(x/scale) + zp` lies strictly inside `(qmin, qmax)` (torch's
/// clamp passes no gradient at its bounds), zero elsewhere.
fn fake_quantize(x: &Tensor, scale: &Tensor, zp: &Tensor, qmin: f64, qmax: f64) -> Result<Tensor> {
    let inv = scale.recip()?;
    let q = round_half_even(&x.detach().broadcast_mul(&inv)?)?.broadcast_add(zp)?;
    let inside = q
        .gt(qmin)?
        .to_dtype(DType::U8)?
        .mul(&q.lt(qmax)?.to_dtype(DType::U8)?)?;
    let dq = q
        .clamp(qmin, qmax)?
        .broadcast_sub(zp)?
        .broadcast_mul(scale)?;
    let mask = inside.to_dtype(x.dtype())?;
    // Value `dq`, gradient `mask`: x·mask + (dq − x·mask) with the second term detached.
    let passed = (x * &mask)?;
    &passed + (dq.to_dtype(x.dtype())? - passed.detach())?.detach()
}

/// `x / d` as a true division in `x`'s dtype (candle's `x / f64` multiplies by the reciprocal,
/// which rounds differently).
fn divide(x: &Tensor, d: f32) -> Result<Tensor> {
    x.broadcast_div(&Tensor::new(d, x.device())?.to_dtype(x.dtype())?)
}

/// torchao's int8 per-token asymmetric fake quantization of activations `x` (`[..., n]`): per
/// row, scale `(max(max, 0) − min(min, 0)) / 255` (at least f32's epsilon), zero point
/// `−128 − round(min(min, 0) / scale)` clamped to `[−128, 127]`, both computed in `x`'s dtype
/// and then held in f32, as `choose_qparams_affine` does; the rounding in f32.
pub fn fake_quantize_per_token_int8(x: &Tensor) -> Result<Tensor> {
    let dims = x.dims().to_vec();
    let n = *dims.last().unwrap_or(&1);
    let rows = x.reshape(((), n))?;
    if crate::fused::fused_applies(&[&rows]) {
        return fused::fake_quantize_rows(&rows, fused::FakeQuantKind::PerTokenInt8)?.reshape(dims);
    }
    let stats = rows.detach();
    let min_neg = stats.min_keepdim(D::Minus1)?.minimum(0.0)?;
    let max_pos = stats.max_keepdim(D::Minus1)?.maximum(0.0)?;
    let scale = divide(&(max_pos - &min_neg)?, 255.0)?.maximum(f32::EPSILON as f64)?;
    let zp =
        (round_half_even(&min_neg.broadcast_div(&scale)?)?.neg()? - 128.0)?.clamp(-128.0, 127.0)?;
    let (scale, zp) = (scale.to_dtype(DType::F32)?, zp.to_dtype(DType::F32)?);
    fake_quantize(&rows.to_dtype(DType::F32)?, &scale, &zp, -128.0, 127.0)?
        .to_dtype(x.dtype())?
        .reshape(dims)
}

/// torchao's int4 per-group symmetric fake quantization of a weight `[out, in]` in groups of
/// `group_size` inputs: scale `max(|min|, |max|) / 7.5` per group (at least the dtype's smallest
/// normal), zero point 0, values in `[−8, 7]`.
pub fn fake_quantize_per_group_int4(w: &Tensor, group_size: usize) -> Result<Tensor> {
    let (out, inp) = w.dims2()?;
    if group_size < 2 || inp % group_size != 0 {
        candle_core::bail!(
            "int4 fake quantization: {inp} inputs are not a multiple of the group size {group_size}"
        );
    }
    let eps = match w.dtype() {
        DType::BF16 => 1.1754944e-38, // bf16's smallest normal equals f32's
        DType::F16 => 6.1035156e-5,
        _ => f32::MIN_POSITIVE as f64,
    };
    let groups = w.reshape((out * inp / group_size, group_size))?;
    if crate::fused::fused_applies(&[&groups]) {
        return fused::fake_quantize_rows(&groups, fused::FakeQuantKind::SymmetricInt4)?
            .reshape((out, inp));
    }
    // The scale in the weight's dtype, then held in f32 (torchao's `scale_precision`).
    let stats = groups.detach();
    let min_neg = stats.min_keepdim(D::Minus1)?.minimum(0.0)?;
    let max_pos = stats.max_keepdim(D::Minus1)?.maximum(0.0)?;
    let scale = divide(&min_neg.neg()?.maximum(&max_pos)?, 7.5)?
        .maximum(eps)?
        .to_dtype(DType::F32)?;
    let zp = scale.zeros_like()?;
    let fq = fake_quantize(&groups.to_dtype(DType::F32)?, &scale, &zp, -8.0, 7.0)?;
    fq.to_dtype(w.dtype())?.reshape((out, inp))
}
