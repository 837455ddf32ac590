//! Scoring a held-out dataset: the summed cross-entropy over its target tokens, batch by batch,
//! and the rows each rank of a distributed run takes (the `eval` recipe's loss and the training
//! recipes' validation loss).

use anyhow::Result;
use candle_core::DType;
use ferrotune_data::dataset::{collate, Row};

use ferrotune_models::CausalLm;

use crate::dist::fsdp::ShardedModel;
use crate::loss::causal_lm_loss;
use crate::step::MicroBatch;

/// The summed cross-entropy over the target tokens of `rows` (in batches of `batch_size`, at
/// most `cap` batches) and the number of target tokens: what ranks add up before dividing.
pub fn target_loss_sum(
    model: &ferrotune_models::CausalLm,
    rows: &[Row],
    batch_size: usize,
    cap: Option<usize>,
    pad: u32,
    device: &candle_core::Device,
) -> Result<(f64, usize)> {
    target_loss_sum_by(rows, batch_size, cap, pad, device, |batch| {
        let logits = model.forward(&batch.input_ids, &batch.layout, None)?;
        let loss = causal_lm_loss(&logits, &batch.labels, true)?;
        Ok((
            loss.sum.to_dtype(DType::F64)?.to_scalar::<f64>()?,
            loss.count,
        ))
    })
}

/// [`target_loss_sum`] with each batch's (loss sum, target count) from `score`: how a sharded
/// model scores batches one unit at a time.
pub fn target_loss_sum_by(
    rows: &[Row],
    batch_size: usize,
    cap: Option<usize>,
    pad: u32,
    device: &candle_core::Device,
    mut score: impl FnMut(&MicroBatch) -> Result<(f64, usize)>,
) -> Result<(f64, usize)> {
    let (mut sum, mut targets) = (0f64, 0usize);
    for (i, chunk) in rows.chunks(batch_size.max(1)).enumerate() {
        if cap.is_some_and(|c| i >= c) {
            break;
        }
        let picked: Vec<&Row> = chunk.iter().collect();
        let batch = MicroBatch::from_batch(&collate(&picked, pad), device)?;
        let (s, n) = score(&batch)?;
        sum += s;
        targets += n;
    }
    Ok((sum, targets))
}

/// The validation rows of `rank` out of `world`, as torchtune's distributed recipes take them: a
/// `DistributedSampler` without shuffling (the row list padded with its first rows up to a
/// multiple of `world`, then every `world`-th row from `rank`), in batches of `batch_size` with
/// the last incomplete batch dropped (`drop_last=True`). Returns the rows and how many batches.
pub fn rank_validation_rows(
    rows: &[Row],
    batch_size: usize,
    rank: usize,
    world: usize,
) -> (Vec<Row>, usize) {
    let n = rows.len();
    if n == 0 || world == 0 {
        return (Vec::new(), 0);
    }
    let per_rank = n.div_ceil(world);
    let mine: Vec<Row> = (0..per_rank)
        .map(|i| rows[(rank + i * world) % n].clone())
        .collect();
    let batches = mine.len() / batch_size.max(1);
    (mine, batches)
}

/// The validation loss of a training run: the mean cross-entropy over the target tokens of
/// `rows` in batches of `batch_size` (at most `cap` batches), every rank's sums all-reduced when
/// the model is `sharded` (and scored one unit gathered at a time, as in training). NaN without
/// targets.
pub fn validation_loss(
    model: &mut CausalLm,
    sharded: Option<&mut ShardedModel>,
    rows: &[Row],
    (batch_size, cap): (usize, Option<usize>),
    pad: u32,
    device: &candle_core::Device,
) -> Result<f64> {
    let (sum, targets) = match sharded {
        Some(sm) => {
            let (sum, targets) = target_loss_sum_by(rows, batch_size, cap, pad, device, |batch| {
                sm.inference_pass(
                    model,
                    &batch.input_ids,
                    &batch.layout,
                    false,
                    |m, hidden| {
                        let loss =
                            crate::loss::causal_lm_head_loss(hidden, m, &batch.labels, true)?;
                        let sum = loss.sum.to_dtype(DType::F64)?.to_scalar()?;
                        Ok((sum, loss.count))
                    },
                )
            })?;
            // Every rank's sums, as torchtune all-reduces them.
            let all = sm.all_reduce_f64(&[sum, targets as f64])?;
            (all[0], all[1])
        }
        None => {
            let (sum, targets) = target_loss_sum(model, rows, batch_size, cap, pad, device)?;
            (sum, targets as f64)
        }
    };
    Ok(if targets > 0.0 {
        sum / targets
    } else {
        f64::NAN
    })
}
