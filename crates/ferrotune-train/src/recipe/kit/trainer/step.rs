//! The optimizer side of a fine-tuning step: the step's sums over the ranks, then its gradients
//! normalised by the step's targets, clipped and applied.

use anyhow::Result;
use candle_core::backprop::GradStore;
use candle_core::Var;

use crate::clip::{clip_grad_norm, scale_grads};
use crate::dist::fsdp::{ShardedModel, Sharding};
use crate::optim::Optimizer;
use crate::step::{PairStats, StepLoss};

/// Adds up a step's loss sums and its target and token counts over the ranks of `sm` (once the
/// gradients' reductions are finished), and returns this rank's part of the gradients: the loss
/// is normalised over the target tokens of every rank.
pub fn reduce_step(
    sm: &mut ShardedModel,
    losses: &mut StepLoss,
    targets: &mut usize,
    tokens: &mut usize,
) -> Result<GradStore> {
    sm.finish_reductions()?;
    let mut local = vec![
        losses.sum,
        *targets as f64,
        *tokens as f64,
        losses.class,
        losses.kd,
        losses.aux,
    ];
    local.extend(losses.pairs.to_vec());
    let pairs_end = local.len();
    local.extend(losses.rewards.to_vec());
    let sums = sm.all_reduce_f64(&local)?;
    losses.sum = sums[0];
    *targets = sums[1].round() as usize;
    *tokens = sums[2].round() as usize;
    (losses.class, losses.kd, losses.aux) = (sums[3], sums[4], sums[5]);
    losses.pairs = PairStats::from_slice(&sums[6..pairs_end]);
    losses.rewards = crate::reward_model::RewardStats::from_slice(&sums[pairs_end..]);
    sm.take_grads()
}

/// Steps `optimizer` with the step's gradients `grads` of `params` normalised by its `targets`
/// (the target tokens of the whole step, not per micro-batch; for DPO its pairs, which with equal
/// micro-batches is torchtune's mean per micro-batch over gradient_accumulation_steps) and
/// clipped to `clip` (when `sharded` and each rank holds a part of the gradient, the norm is over
/// all parts). Without clipping the factor is folded into the optimizer's pass over the
/// gradients. Returns the gradient norm when clipped.
pub fn optimizer_step(
    optimizer: &mut dyn Optimizer,
    mut grads: GradStore,
    params: &[(String, Var)],
    targets: usize,
    clip: Option<f64>,
    sharded: Option<&ShardedModel>,
) -> Result<Option<f64>> {
    let factor = if targets > 0 {
        1.0 / targets as f64
    } else {
        1.0
    };
    let params_iter = || params.iter().map(|(_, v)| v.as_tensor());
    Ok(match clip {
        Some(max) => {
            scale_grads(&mut grads, params_iter(), factor)?;
            let norm = match sharded {
                Some(sm) if sm.sharding() != Sharding::None => {
                    sm.clip_grad_norm(&mut grads, params_iter(), max)?
                }
                _ => clip_grad_norm(&mut grads, params_iter(), max)?,
            };
            optimizer.step(&grads)?;
            Some(norm)
        }
        None => {
            optimizer.step_scaled(&grads, factor)?;
            None
        }
    })
}
