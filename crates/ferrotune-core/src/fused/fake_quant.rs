//! Fake quantization of f32 rows in one pass (QAT on the CPU): the same arithmetic as the
//! composite in [`crate::qat`], per row of the `[rows, n]` input, with the pass-through mask kept
//! for the backward.

use std::sync::Mutex;

use candle_core::{bail, Device, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{guard_slice, Forward};
use crate::custom_op::{Fused, FusedOp, Grads};

/// Which of torchao's fake quantizers a row gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FakeQuantKind {
    /// int8, asymmetric: scale `(max(max,0) − min(min,0)) / 255` ≥ f32's epsilon, zero point
    /// `−128 − round(min(min,0) / scale)` clamped to `[−128, 127]`.
    PerTokenInt8,
    /// int4, symmetric: scale `max(|min|, |max|) / 7.5` ≥ f32's smallest normal, zero point 0.
    SymmetricInt4,
}

struct FakeQuantRows {
    kind: FakeQuantKind,
    /// 1 where the gradient passes (the rounded value strictly inside the integer range); not
    /// kept for an input without gradient (QAT-LoRA's frozen base weights).
    mask: Option<Mutex<Vec<u8>>>,
}

/// `f32::round_ties_even` inline: std's calls libm's `rintf` for every value on targets without
/// SSE4.1 (13% of a QAT-LoRA step). Adding and subtracting 1.5·2²³ leaves the nearest integer,
/// ties to even, for |x| < 2²²; larger values are integers already, and NaN stays NaN.
#[inline(always)]
fn round_ties_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    if x.abs() < 4_194_304.0 {
        (x + MAGIC) - MAGIC
    } else {
        x
    }
}

/// One row: writes the fake-quantized values, and the mask when asked for.
fn row(kind: FakeQuantKind, x: &[f32], out: &mut [f32], mask: Option<&mut [u8]>) {
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for &v in x {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    let (min_neg, max_pos) = (lo.min(0.0), hi.max(0.0));
    let (scale, zp, qmin, qmax) = match kind {
        FakeQuantKind::PerTokenInt8 => {
            let scale = ((max_pos - min_neg) / 255.0).max(f32::EPSILON);
            let zp = (-128.0 - round_ties_even(min_neg / scale)).clamp(-128.0, 127.0);
            (scale, zp, -128.0f32, 127.0f32)
        }
        FakeQuantKind::SymmetricInt4 => {
            let scale = ((-min_neg).max(max_pos) / 7.5).max(f32::MIN_POSITIVE);
            (scale, 0.0, -8.0, 7.0)
        }
    };
    let inv = 1.0 / scale;
    // The rounded value (for the mask) and the value mapped back.
    let quantize = |v: f32| {
        let q = round_ties_even(v * inv) + zp;
        (q, (q.clamp(qmin, qmax) - zp) * scale)
    };
    match mask {
        Some(mask) => {
            for ((o, m), &v) in out.iter_mut().zip(mask.iter_mut()).zip(x) {
                let (q, value) = quantize(v);
                *m = u8::from(q > qmin && q < qmax);
                *o = value;
            }
        }
        None => {
            for (o, &v) in out.iter_mut().zip(x) {
                *o = quantize(v).1;
            }
        }
    }
}

impl FusedOp<1> for FakeQuantRows {
    const NAME: &'static str = "fused-fake-quantize";
    const WHAT: &'static str = "fake_quantize";

    fn forward(&self, [x]: [&[f32]; 1], [shape]: [&Shape; 1]) -> Forward {
        let (_, n) = shape.dims2()?;
        let mut out = vec![0f32; x.len()];
        match &self.mask {
            Some(kept) => {
                let mut mask = vec![0u8; x.len()];
                out.par_chunks_mut(n)
                    .zip(mask.par_chunks_mut(n))
                    .zip(x.par_chunks(n))
                    .for_each(|((o, m), r)| row(self.kind, r, o, Some(m)));
                *kept.lock().unwrap_or_else(|e| e.into_inner()) = mask;
            }
            None => out
                .par_chunks_mut(n)
                .zip(x.par_chunks(n))
                .for_each(|(o, r)| row(self.kind, r, o, None)),
        }
        Ok((out, shape.clone()))
    }

    fn backward(&self, [arg]: [&Tensor; 1], _res: &Tensor, grad: &Tensor) -> Grads<1> {
        let Some(kept) = &self.mask else {
            bail!("fake_quantize: backward of an input that had no gradient");
        };
        let mask = kept.lock().unwrap_or_else(|e| e.into_inner());
        if mask.len() != arg.elem_count() {
            bail!("fake_quantize: backward before forward");
        }
        let g = grad.contiguous()?;
        let gg = g.storage_and_layout();
        let gs = guard_slice(&gg, "fake_quantize")?;
        let dx: Vec<f32> = gs
            .par_iter()
            .zip(mask.par_iter())
            .map(|(&d, &m)| if m == 1 { d } else { 0.0 })
            .collect();
        Ok([Some(Tensor::from_vec(dx, arg.shape(), &Device::Cpu)?)])
    }
}

/// Fake-quantizes each row of the f32 CPU tensor `x` (`[rows, n]`) as `kind` says; the gradient is
/// the incoming one where the rounded value stayed strictly inside the integer range.
pub fn fake_quantize_rows(x: &Tensor, kind: FakeQuantKind) -> Result<Tensor> {
    x.contiguous()?.apply_op1(Fused(FakeQuantRows {
        kind,
        mask: x.track_op().then(|| Mutex::new(Vec::new())),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The inline rounding is std's `round_ties_even` on ties, near and beyond 2²², on negative
    /// values and on a sweep of fractions.
    #[test]
    fn inline_rounding_is_ties_to_even() {
        let mut values = vec![
            0.5f32,
            1.5,
            2.5,
            -0.5,
            -1.5,
            -2.5,
            0.49999997,
            -0.49999997,
            4_194_303.5,
            -4_194_303.5,
            4_194_304.0,
            8_388_607.0,
            1e30,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MIN_POSITIVE,
            -0.0,
        ];
        values.extend((-3000..3000).map(|i| i as f32 * 0.0625 + 0.001));
        values.extend((-3000..3000).map(|i| i as f32 * 0.25));
        for v in values {
            let (got, want) = (round_ties_even(v), v.round_ties_even());
            assert!(got == want, "{v}: {got} vs {want}");
        }
        assert!(round_ties_even(f32::NAN).is_nan());
    }
}
