//! `full_finetune_single_device` and `full_finetune_distributed`: every weight trained, on one
//! device, or as one rank of torchrun's group — the model sharded over the ranks as
//! `fsdp_sharding` says, each micro-batch's forward and backward through
//! `forward_backward_sharded` (which gathers each layer's weights and reduces its gradients)
//! rather than one device's `forward_backward`, rank 0 alone logging and writing. torchtune's
//! recipe, top to bottom.
//!
//! What every fine-tuning recipe does around this (the session, loading, the data, the optimizer
//! and LR schedule, the steps, validation, checkpoints) is the kit's trainer
//! ([`crate::recipe::kit::trainer`]).

use anyhow::Result;

use crate::config::Config;
use crate::recipe::kit::trainer::{FineTune, Trainable};
use crate::recipe::Recipe;

/// Runs `entry`, `full_finetune_single_device` or `full_finetune_distributed`.
pub fn run(entry: &Recipe, cfg: &Config) -> Result<()> {
    // ---------------------------------------------------------------- setup
    // A resumed run loads its saved full weights (the base's tokenizer and config files are
    // still copied from the base).
    let (run, mut model) = FineTune::start(entry, cfg)?;
    let every_weight = Trainable::all(&mut model)?;
    run.trainable(cfg, &every_weight);

    // ---------------------------------------------------------------- training loop
    // A checkpoint of the whole model every `save_every_n_steps` and at each epoch's end.
    let trainer = run.plan(cfg, model, every_weight)?.start(cfg)?;
    trainer.fit(cfg, &mut ())
}
