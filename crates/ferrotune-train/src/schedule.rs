//! Learning-rate schedules as `LambdaLR` multipliers: `lr(step) = base_lr * multiplier(step)`.
//!
//! `step` counts optimizer steps already taken, starting at 0 (LambdaLR's `last_epoch` after
//! `scheduler.step()` calls): the first update uses `multiplier(0)`, which is 0 during warmup.
//! All arithmetic is f64, as the Python lambdas compute on floats.

/// A learning-rate schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LrSchedule {
    /// Always the base learning rate.
    Constant,
    /// Linear warmup from 0 over `warmup` steps, then constant (Hugging Face's
    /// `get_constant_schedule_with_warmup`).
    ConstantWithWarmup {
        /// Number of warmup steps.
        warmup: usize,
    },
    /// Linear warmup from 0 over `warmup` steps, then linear decay to 0 at step `total`
    /// (Hugging Face's `get_linear_schedule_with_warmup`).
    Linear {
        /// Number of warmup steps.
        warmup: usize,
        /// Total number of training steps.
        total: usize,
    },
    /// torchtune's `get_cosine_schedule_with_warmup`: linear warmup from 0 over `warmup` steps,
    /// then `0.5 * (1 + cos(pi * num_cycles * 2 * progress))`, floored at 0. `num_cycles = 0.5`
    /// (torchtune's default) is a half cosine down to 0 at step `total`.
    Cosine {
        /// Number of warmup steps.
        warmup: usize,
        /// Total number of training steps.
        total: usize,
        /// Number of cosine waves over the decay phase.
        num_cycles: f64,
    },
}

/// `current_step / max(1, warmup)`, the warmup ramp shared by all schedules.
fn ramp(step: usize, warmup: usize) -> f64 {
    step as f64 / warmup.max(1) as f64
}

impl LrSchedule {
    /// torchtune's cosine schedule with its default `num_cycles = 0.5`.
    pub fn cosine(warmup: usize, total: usize) -> Self {
        Self::Cosine {
            warmup,
            total,
            num_cycles: 0.5,
        }
    }

    /// The multiplier of the base learning rate after `step` optimizer steps.
    pub fn multiplier(&self, step: usize) -> f64 {
        match *self {
            Self::Constant => 1.0,
            Self::ConstantWithWarmup { warmup } => {
                if step < warmup {
                    ramp(step, warmup)
                } else {
                    1.0
                }
            }
            Self::Linear { warmup, total } => {
                if step < warmup {
                    return ramp(step, warmup);
                }
                // Signed: past `total` the ratio goes negative and is floored at 0.
                let remaining = total as f64 - step as f64;
                (remaining / total.saturating_sub(warmup).max(1) as f64).max(0.0)
            }
            Self::Cosine {
                warmup,
                total,
                num_cycles,
            } => {
                if step < warmup {
                    return ramp(step, warmup);
                }
                let progress = (step - warmup) as f64 / total.saturating_sub(warmup).max(1) as f64;
                let m = 0.5 * (1.0 + (std::f64::consts::PI * num_cycles * 2.0 * progress).cos());
                m.max(0.0)
            }
        }
    }

    /// The learning rate after `step` optimizer steps: `base_lr * multiplier(step)`.
    pub fn lr(&self, base_lr: f64, step: usize) -> f64 {
        base_lr * self.multiplier(step)
    }
}
