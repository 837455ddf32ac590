//! The training examples of the supervised and preference recipes, their micro-batches, and the
//! order each epoch takes a dataset in.

use anyhow::Result;
use ferrotune_data::dataset::{collate, PreferencePair, RewardPair, Row};

use crate::step::MicroBatch;

/// A recipe's training examples: rows, or preference pairs for DPO.
pub enum Examples {
    /// Tokenized rows (supervised fine-tuning, distillation).
    Rows(Vec<Row>),
    /// Chosen and rejected responses to one prompt (DPO).
    Pairs(Vec<PreferencePair>),
    /// Chosen and rejected sequences scored by a reward model.
    Rewards(Vec<RewardPair>),
    /// Unpaired rows, each desirable or not (KTO).
    Unpaired(super::unpaired::UnpairedData),
}

impl Examples {
    /// How many examples.
    pub fn len(&self) -> usize {
        match self {
            Examples::Rows(r) => r.len(),
            Examples::Pairs(p) => p.len(),
            Examples::Rewards(p) => p.len(),
            Examples::Unpaired(u) => u.rows.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The micro-batch of examples `picked` (indices), padded with `pad`.
    pub fn micro_batch(
        &self,
        picked: impl Iterator<Item = usize>,
        pad: u32,
        device: &candle_core::Device,
    ) -> Result<MicroBatch> {
        Ok(match self {
            Examples::Rows(rows) => {
                let rows: Vec<&Row> = picked.map(|i| &rows[i]).collect();
                MicroBatch::from_batch(&collate(&rows, pad), device)?
            }
            Examples::Pairs(pairs) => {
                let pairs: Vec<&PreferencePair> = picked.map(|i| &pairs[i]).collect();
                MicroBatch::from_pairs(&pairs, pad, device)?
            }
            Examples::Rewards(pairs) => {
                let pairs: Vec<&RewardPair> = picked.map(|i| &pairs[i]).collect();
                MicroBatch::from_reward_pairs(&pairs, pad, device)?
            }
            Examples::Unpaired(u) => u.micro_batch(picked, pad, device)?,
        })
    }
}

/// The order epoch `epoch` takes `n` examples in: shuffled from `seed` (torch's
/// `RandomSampler` as torchtune seeds it), or as they stand.
pub fn epoch_order(n: usize, shuffle: bool, seed: u64, epoch: usize) -> Vec<usize> {
    match shuffle {
        true => ferrotune_data::dataset::shuffled_order(n, seed, epoch as u64),
        false => (0..n).collect(),
    }
}
