//! The head of a reward-model micro-batch: each row's score at its pooled position, and TRL's
//! reward loss ([`crate::reward_model`]); and the micro-batch of reward pairs.

use candle_core::{DType, Device, Result, Tensor};
use ferrotune_data::dataset::RewardPair;
use ferrotune_models::CausalLm;

use super::head::HeadParts;
use super::MicroBatch;
use crate::reward_model::{reward_loss_sum, RewardRows};

/// [`super::head::head_loss`] of a reward-model batch: the rows' scores (`score` at each row's
/// pooled position of `hidden`, `[2n, t, h]`), the pairs' summed loss and its metrics.
pub(super) fn reward_head_loss(
    hidden: &Tensor,
    model: &CausalLm,
    rows: &RewardRows,
) -> Result<(Tensor, HeadParts)> {
    if model.config.score_labels != Some(1) {
        candle_core::bail!("reward-model training needs a classifier with one output (score)");
    }
    let (b, t, h) = hidden.dims3()?;
    let flat: Vec<u32> = rows
        .pooled
        .iter()
        .enumerate()
        .map(|(r, &i)| (r * t + i) as u32)
        .collect();
    let idx = Tensor::from_vec(flat, b, hidden.device())?;
    let picked = hidden.reshape((b * t, h))?.index_select(&idx, 0)?;
    let rewards = model.logits(&picked.unsqueeze(0)?)?.reshape(b)?;
    let (total, stats) = reward_loss_sum(&rewards, rows)?;
    Ok((total, HeadParts::Rewards(stats)))
}

impl MicroBatch {
    /// A batch of reward pairs as TRL's `DataCollatorForPreference` lays it out: the chosen rows
    /// of every pair, then their rejected rows, right-padded with `pad` to the longest; each row
    /// is scored at its last token that is not `pad`. The step's loss is normalised by its
    /// number of pairs, so `num_targets` counts pairs.
    pub fn from_reward_pairs(pairs: &[&RewardPair], pad: u32, device: &Device) -> Result<Self> {
        let rows: Vec<&Vec<u32>> = pairs
            .iter()
            .map(|p| &p.chosen)
            .chain(pairs.iter().map(|p| &p.rejected))
            .collect();
        let t = rows.iter().map(|r| r.len()).max().unwrap_or(0).max(1);
        let ids: Vec<Vec<u32>> = rows
            .iter()
            .map(|r| {
                let mut row = (*r).clone();
                row.resize(t, pad);
                row
            })
            .collect();
        let valid: Vec<Vec<bool>> = rows
            .iter()
            .map(|r| (0..t).map(|j| j < r.len()).collect())
            .collect();
        let b = ids.len();
        let margins = match pairs.iter().all(|p| p.margin.is_some()) && !pairs.is_empty() {
            true => Some(pairs.iter().map(|p| p.margin.unwrap_or(0.0)).collect()),
            false => None,
        };
        let reward = RewardRows::new(&ids, pad, margins);
        let flat: Vec<u32> = ids.iter().flatten().copied().collect();
        let num_tokens = rows.iter().map(|r| r.len()).sum();
        Ok(Self {
            input_ids: Tensor::from_vec(flat, (b, t), device)?,
            labels: Tensor::full(-100i64, (b, t), device)?.to_dtype(DType::I64)?,
            layout: ferrotune_models::AttentionLayout {
                positions: (0..b).map(|_| (0..t as u32).collect()).collect(),
                key_valid: valid,
                segments: None,
            },
            num_targets: pairs.len(),
            num_tokens,
            distill: None,
            preference: None,
            aux_loss_weight: None,
            layer_skip: None,
            reward: Some(reward),
        })
    }
}
