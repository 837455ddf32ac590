//! Cross-entropy against a second model's distribution (distillation's "forward KL"), summed over
//! rows in one pass per row, keeping only per-row statistics for the backward: no `[n, vocab]`
//! softmax, log-softmax or product is held between the two passes.

use std::sync::Mutex;

use candle_core::{bail, DType, Device, Result, Shape, Tensor};
use rayon::prelude::*;

use super::{contiguous, fused_applies, guard_slices, Forward};
use crate::custom_op::{Fused, FusedOp, Grads};

/// Whether [`soft_cross_entropy_sum`] runs fused: f32 CPU rows with every student logit finite
/// (torchtune zeroes the terms at infinite student logits, which the composite form does).
pub fn soft_cross_entropy_applies(student: &Tensor, teacher: &Tensor) -> Result<bool> {
    if !fused_applies(&[student, teacher]) {
        return Ok(false);
    }
    let finite = student.abs()?.max_all()?.to_scalar::<f32>()?.is_finite();
    Ok(finite)
}

/// `−Σ_rows Σ_v softmax(teacher)_v · log_softmax(student)_v` for `[n, vocab]` f32 CPU rows (check
/// [`soft_cross_entropy_applies`] first). Differentiable in `student` (`grad · (softmax(student) −
/// softmax(teacher))` per row, recomputed from stored row statistics); the teacher takes none.
pub fn soft_cross_entropy_sum(student: &Tensor, teacher: &Tensor) -> Result<Tensor> {
    if student.dims() != teacher.dims() || student.rank() != 2 {
        bail!(
            "soft_cross_entropy_sum: student {:?} and teacher {:?} must be the same [n, vocab]",
            student.dims(),
            teacher.dims()
        );
    }
    let op = SoftCrossEntropy {
        stats: Mutex::new(Vec::new()),
    };
    student
        .contiguous()?
        .apply_op2(&teacher.detach().contiguous()?, Fused(op))
}

/// Per row: the student's `(max, ln Σ exp(s − max))` and the teacher's `(max, Σ exp(t − max))`.
type RowStats = (f32, f32, f32, f32);

struct SoftCrossEntropy {
    stats: Mutex<Vec<RowStats>>,
}

fn row_max(row: &[f32]) -> f32 {
    row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v))
}

impl FusedOp<2> for SoftCrossEntropy {
    const NAME: &'static str = "fused-soft-cross-entropy";
    const WHAT: &'static str = "soft_cross_entropy_sum";

    fn forward(&self, [s, t]: [&[f32]; 2], [s_shape, _]: [&Shape; 2]) -> Forward {
        let (_, vocab) = s_shape.dims2()?;
        let rows: Vec<(RowStats, f64)> = s
            .par_chunks(vocab)
            .zip(t.par_chunks(vocab))
            .map(|(srow, trow)| {
                let ms = row_max(srow);
                let ls = srow.iter().map(|&v| (v - ms).exp()).sum::<f32>().ln();
                let mt = row_max(trow);
                let zt: f32 = trow.iter().map(|&v| (v - mt).exp()).sum();
                // −Σ p_t (s − ms − ls), in f64 over the row.
                let dot: f64 = srow
                    .iter()
                    .zip(trow)
                    .map(|(&sv, &tv)| ((tv - mt).exp() / zt) as f64 * (sv - ms - ls) as f64)
                    .sum();
                ((ms, ls, mt, zt), -dot)
            })
            .collect();
        let total: f64 = rows.iter().map(|(_, l)| l).sum();
        *self.stats.lock().expect("stats lock") = rows.into_iter().map(|(st, _)| st).collect();
        Ok((vec![total as f32], Shape::from(())))
    }

    fn backward(&self, [student, teacher]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> Grads<2> {
        let g = grad.to_dtype(DType::F32)?.to_scalar::<f32>()?;
        let (n, vocab) = student.dims2()?;
        let tensors = contiguous([student, teacher])?;
        let guards = tensors.each_ref().map(Tensor::storage_and_layout);
        let [s, t] = guard_slices(&guards, "soft_cross_entropy_sum")?;
        let stats = self.stats.lock().expect("stats lock");
        if stats.len() != n {
            bail!("soft_cross_entropy_sum: backward before forward");
        }
        let mut ds = vec![0f32; s.len()];
        ds.par_chunks_mut(vocab)
            .zip(s.par_chunks(vocab).zip(t.par_chunks(vocab)))
            .zip(stats.par_iter())
            .for_each(|((out, (srow, trow)), &(ms, ls, mt, zt))| {
                for ((o, &sv), &tv) in out.iter_mut().zip(srow).zip(trow) {
                    *o = g * ((sv - ms - ls).exp() - (tv - mt).exp() / zt);
                }
            });
        Ok([
            Some(Tensor::from_vec(ds, student.shape(), &Device::Cpu)?),
            None,
        ])
    }
}
