//! `dev/early_exit_finetune_distributed`: every weight trained with LayerSkip's early-exit loss
//! (the hidden state entering chosen layers also goes through the final norm and the output
//! head, its cross-entropy weighted into the loss, the layers chosen per step by a curriculum)
//! and layer dropout (each layer skipped for some rows, more often deeper). torchtune's recipe,
//! top to bottom; see [`crate::early_exit`].
//!
//! What every fine-tuning recipe does around this (the session, loading, the data, the optimizer
//! and LR schedule, the steps, validation, checkpoints) is the kit's trainer
//! ([`crate::recipe::kit::trainer`]).

use anyhow::{bail, Result};

use crate::config::Config;
use crate::early_exit::{EarlyExitLoss, LayerDropout};
use crate::recipe::kit::trainer::{At, FineTune, Hooks, Trainable};
use crate::recipe::Recipe;
use crate::step::{LayerSkip, MicroBatch};

/// Runs `dev/early_exit_finetune_distributed` (`entry`).
pub fn run(entry: &Recipe, cfg: &Config) -> Result<()> {
    // ---------------------------------------------------------------- setup
    let (run, mut model) = FineTune::start(entry, cfg)?;
    let trainable = Trainable::all(&mut model)?;
    run.trainable(cfg, &trainable);
    let settings = run.settings.clone();
    let lead = run.session.lead();
    let plan = run.plan(cfg, model, trainable)?;
    // Which layers' exits count at each step, and which rows each layer skips.
    let layer_skip = settings.layer_skip.as_ref().expect("parsed for early exit");
    let num_layers = plan.model.layers.len();
    let (early_exit, dropout) = layer_skip.resolve(&cfg.origin, num_layers, plan.total_steps)?;
    if plan.aux_coef.is_some() && (early_exit.is_some() || dropout.is_some()) {
        bail!(
            "{}: early_exit_loss and layer_dropout are not supported with a mixture-of-experts \
             model's router load-balancing loss",
            cfg.origin
        );
    }
    let trainer = plan.start(cfg)?;
    // Every rank draws the same rows (torchtune seeds each layer's generator with its index); a
    // resumed run continues the draws after the rows of the steps already taken.
    let dropout = dropout.map(|d| {
        let steps_taken = trainer.start.global_step * settings.grad_accum;
        let drawn = (steps_taken * settings.batch_size) as u64;
        LayerDropout::new(d.prob, d.scale, &d.applies, drawn)
    });
    if let (true, Some(d)) = (lead, &dropout) {
        eprintln!(
            "Layer dropout: probability per layer {:?}",
            d.probabilities()
        );
    }

    // ---------------------------------------------------------------- training loop
    let mut skip = Skip {
        early_exit,
        dropout,
        num_layers,
        verbose: settings.verbose_exits,
        lead,
        exits: Vec::new(),
        last_exits: None,
    };
    trainer.fit(cfg, &mut skip)
}

/// LayerSkip's state through the run.
struct Skip {
    early_exit: Option<EarlyExitLoss>,
    dropout: Option<LayerDropout>,
    num_layers: usize,
    /// `early_exit_loss.verbose`: say each step's exits when they change, not only the first.
    verbose: bool,
    lead: bool,
    /// This step's exits: a layer and its loss's weight.
    exits: Vec<(usize, f64)>,
    /// The layers of the exits last said.
    last_exits: Option<Vec<usize>>,
}

impl Hooks for Skip {
    fn before_step(&mut self, at: At<'_>) -> Result<()> {
        let Some(early_exit) = &self.early_exit else {
            return Ok(());
        };
        self.exits = early_exit.exits_at(at.global_step, self.num_layers);
        let layers: Vec<usize> = self.exits.iter().map(|&(l, _)| l).collect();
        let changed = self.last_exits.as_ref() != Some(&layers);
        if self.lead && changed && (self.verbose || self.last_exits.is_none()) {
            at.bar
                .suspend(|| eprintln!("Early-exit loss on the inputs of layers {layers:?}"));
        }
        self.last_exits = Some(layers);
        Ok(())
    }

    fn prepare(&mut self, batch: &mut MicroBatch, _: At<'_>) -> Result<()> {
        if self.early_exit.is_some() || self.dropout.is_some() {
            let rows = batch.input_ids.dim(0)?;
            batch.layer_skip = Some(LayerSkip {
                exits: self.exits.clone(),
                kept_rows: match self.dropout.as_mut() {
                    Some(d) => d.draw(rows),
                    None => Vec::new(),
                },
            });
        }
        Ok(())
    }
}
