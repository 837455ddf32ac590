//! `lora_reward_model_single_device`, `full_reward_model_single_device` and their `_distributed`
//! forms (one rank of torchrun's group each, data-parallel): a reward model — a
//! sequence classifier, the base's decoder under a `score` head with one output — trained on
//! preference pairs as TRL's `RewardTrainer` (trl 1.16.0) trains it: each sequence's reward is
//! the score at its last token that is not the pad id, the loss of a pair
//! `−log σ(r_chosen − r_rejected − margin)` (plus `center_rewards_coefficient ·
//! (r_chosen + r_rejected)²`), averaged over the step's pairs. LoRA trains the adapters and the
//! `score` head in full (PEFT's `SEQ_CLS` task, saved as `modules_to_save`); full trains every
//! weight. The checkpoints are `*ForSequenceClassification` folders (or the PEFT adapter) that
//! transformers loads, and that PPO's `reward_and_value_model` and GRPO's reward take.
//!
//! What every fine-tuning recipe does around this (the session, loading, the data, the optimizer
//! and LR schedule, the steps, checkpoints) is the kit's trainer
//! ([`crate::recipe::kit::trainer`]); the classifier and the pairs are the kit's
//! [`reward`](crate::recipe::kit::reward); the loss is [`crate::reward_model`].

use anyhow::Result;

use crate::config::Config;
use crate::recipe::kit::trainer::{At, FineTune, Hooks, Trainable};
use crate::recipe::Recipe;
use crate::step::MicroBatch;

/// Runs `entry`: `lora_reward_model_single_device`, `full_reward_model_single_device`, or their
/// `_distributed` forms.
pub fn run(entry: &Recipe, cfg: &Config) -> Result<()> {
    // ---------------------------------------------------------------- setup
    // The model is loaded as a classifier with one output (a causal LM gets a fresh `score`
    // head); the pairs are tokenized as TRL's RewardTrainer tokenizes them.
    let (run, mut model) = FineTune::start(entry, cfg)?;
    let trainable = match run.mode.full() {
        true => Trainable::all(&mut model)?,
        // The adapters, and `score` in full beside them (modules_to_save).
        false => run.adapters(cfg, &mut model)?,
    };
    run.trainable(cfg, &trainable);
    let center = run.settings.center_rewards;
    let trainer = run.plan(cfg, model, trainable)?.start(cfg)?;

    // ---------------------------------------------------------------- training loop
    // Each micro-batch of pairs is its chosen rows then its rejected rows; the loss and TRL's
    // metrics (accuracy, margin, min/mean/max reward) are the head's.
    trainer.fit(cfg, &mut RewardModel { center })
}

/// `center_rewards_coefficient`.
struct RewardModel {
    center: Option<f64>,
}

impl Hooks for RewardModel {
    fn prepare(&mut self, batch: &mut MicroBatch, _at: At<'_>) -> Result<()> {
        if let Some(rows) = batch.reward.as_mut() {
            rows.center = self.center;
        }
        Ok(())
    }
}
