//! What the reward-model recipes add to the fine-tuning kit: the model made a sequence
//! classifier with one output (as TRL's `RewardTrainer` loads it with
//! `AutoModelForSequenceClassification.from_pretrained(..., num_labels=1)`), and the preference
//! pairs tokenized as `RewardTrainer` tokenizes them.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use ferrotune_data::dataset::{build_reward_pairs_within, default_pad_id, RewardPair};
use ferrotune_data::Tokenizer;
use ferrotune_models::CausalLm;
use serde_json::json;

use crate::config::Config;
use crate::dist::fsdp::ShardedModel;
use crate::reward_model::RewardStats;

/// Makes `model` the reward model TRL trains: a causal LM gets a fresh `score` head (one output,
/// drawn from `seed`), a classifier must have one output; either way its `pad_token_id` becomes
/// the tokenizer's pad id (else its EOS id), where each row's reward is read, as TRL sets it.
pub fn classifier(
    model: &mut CausalLm,
    tokenizer: &Tokenizer,
    seed: u64,
    lead: bool,
) -> Result<()> {
    let pad = default_pad_id(tokenizer);
    match model.config.score_labels {
        Some(1) => {}
        Some(n) => bail!(
            "the checkpoint is a classifier with {n} labels; a reward model gives one score \
             (num_labels: 1)"
        ),
        None => {
            model
                .into_sequence_classifier(1, Some(pad), seed)
                .map_err(|e| anyhow!("making the reward model's score head: {e}"))?;
            if lead {
                eprintln!(
                    "Reward model: a fresh `score` head (1 output) replaces the output head \
                     (saved as a *ForSequenceClassification checkpoint)"
                );
            }
        }
    }
    model.config.pad_token_id = Some(pad);
    if let Some(raw) = model.config.raw.as_object_mut() {
        raw.insert("pad_token_id".into(), json!(pad));
    }
    Ok(())
}

/// The `dataset` section's preference pairs, tokenized as TRL's `RewardTrainer` does (pairs with
/// a side longer than `dataset.max_length`, default 1024, or than the model's positions are left
/// out, and said so).
pub fn pairs(
    cfg: &Config,
    tokenizer: &Tokenizer,
    positions: Option<usize>,
    lead: bool,
) -> Result<Vec<RewardPair>> {
    let section = cfg
        .get("dataset")
        .cloned()
        .ok_or_else(|| anyhow!("{}: 'dataset' is required", cfg.origin))?;
    let (pairs, dropped) =
        build_reward_pairs_within(&section, tokenizer, Path::new("."), positions)
            .with_context(|| format!("{}: dataset", cfg.origin))?;
    if lead && dropped > 0 {
        eprintln!(
            "{dropped} pair(s) left out: a side is longer than dataset.max_length (TRL's \
             RewardTrainer filters them the same way)"
        );
    }
    Ok(pairs)
}

/// TRL's `min_reward` and `max_reward` of a step on several ranks: each micro-batch's extreme
/// over every rank's rewards (TRL gathers them before taking it), averaged over the step's
/// micro-batches. `extremes` are this rank's micro-batches' `(min, max)`; every rank calls this
/// (a collective: each rank's values in its own slots, summed). Returns `stats` with `min` and
/// `max` those means (`batches` 1).
pub fn extremes_over_ranks(
    sm: &ShardedModel,
    stats: RewardStats,
    extremes: &[(f64, f64)],
) -> Result<RewardStats> {
    let (rank, world, n) = (sm.queue().rank(), sm.queue().world_size(), extremes.len());
    let mut local = vec![0.0; 2 * world * n];
    for (i, &(lo, hi)) in extremes.iter().enumerate() {
        local[rank * n + i] = lo;
        local[(world + rank) * n + i] = hi;
    }
    let all = sm.all_reduce_f64(&local)?;
    let mean_of = |base: usize, pick: fn(f64, f64) -> f64| {
        (0..n)
            .map(|i| {
                (1..world)
                    .map(|r| all[base + r * n + i])
                    .fold(all[base + i], pick)
            })
            .sum::<f64>()
            / n.max(1) as f64
    };
    Ok(RewardStats {
        min: mean_of(0, f64::min),
        max: mean_of(world * n, f64::max),
        batches: 1.0,
        ..stats
    })
}
