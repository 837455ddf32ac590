//! `lora_finetune_single_device` and `lora_finetune_distributed`: LoRA (or DoRA) adapters
//! trained on a frozen base — a QLoRA config's base quantized to NF4 first — on one device, or as
//! one rank of torchrun's group, which takes every world-th row of a step and whose gradients
//! are reduced over the ranks (rank 0 alone logs and writes). torchtune's recipe, top to bottom.
//!
//! What every fine-tuning recipe does around this (the session, loading, the data, the optimizer
//! and LR schedule, the steps, validation, checkpoints) is the kit's trainer
//! ([`crate::recipe::kit::trainer`]).

use anyhow::Result;

use crate::config::Config;
use crate::recipe::kit::trainer::FineTune;
use crate::recipe::Recipe;

/// Runs `entry`, `lora_finetune_single_device` or `lora_finetune_distributed`.
pub fn run(entry: &Recipe, cfg: &Config) -> Result<()> {
    // ---------------------------------------------------------------- setup
    // The session, settings, resume point, tokenizer and model; then the adapters, fresh, from
    // `checkpointer.adapter_checkpoint` or resumed, which alone train (with `modules_to_save`).
    let (run, mut model) = FineTune::start(entry, cfg)?;
    let adapters = run.adapters(cfg, &mut model)?;
    run.trainable(cfg, &adapters);
    let trainer = run.plan(cfg, model, adapters)?.start(cfg)?;

    // ---------------------------------------------------------------- training loop
    // Each step's micro-batches as they are; a checkpoint (the adapter, and unless
    // `save_adapter_weights_only` the merged model) every `save_every_n_steps` and at each
    // epoch's end.
    trainer.fit(cfg, &mut ())
}
