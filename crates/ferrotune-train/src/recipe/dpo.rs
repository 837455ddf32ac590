//! `lora_dpo_single_device`, `lora_dpo_distributed` and `full_dpo_distributed`: Direct
//! Preference Optimization on pairs of a chosen and a rejected response to one prompt. The
//! policy is LoRA adapters whose reference is the model with its adapters disabled, or every
//! weight against a frozen reference model (`ref_checkpointer`, else the base). torchtune's
//! recipes, top to bottom.
//!
//! What every fine-tuning recipe does around this (the session, loading, the data, the optimizer
//! and LR schedule, the steps, checkpoints) is the kit's trainer
//! ([`crate::recipe::kit::trainer`]); the DPO recipes have no validation loop.

use anyhow::Result;
use ferrotune_models::CausalLm;

use crate::config::Config;
use crate::loss::PreferenceLoss;
use crate::recipe::kit::model::{kto_kl, reference_logps, setup_reference};
use crate::recipe::kit::settings::Mode;
use crate::recipe::kit::trainer::{At, FineTune, Hooks, Trainable};
use crate::recipe::Recipe;
use crate::step::{MicroBatch, Preference};

/// Runs `entry`: `lora_dpo_single_device`, `lora_dpo_distributed` or `full_dpo_distributed`.
pub fn run(entry: &Recipe, cfg: &Config) -> Result<()> {
    // ---------------------------------------------------------------- setup
    let (run, mut policy) = FineTune::start(entry, cfg)?;
    let full = run.mode == Mode::FullDpo;
    let trainable = match full {
        true => Trainable::all(&mut policy)?,
        // `modules_to_save` is refused: the reference would need their original weights.
        false => run.adapters(cfg, &mut policy)?,
    };
    run.trainable(cfg, &trainable);
    let loss = run.settings.preference_loss.expect("parsed for DPO");
    // ORPO, SimPO and CPO have no reference: none is loaded, and LoRA runs no adapters-disabled
    // pass.
    if loss.reference_free() && run.session.lead() {
        eprintln!("reference-free preference loss {loss:?}: no reference model");
    }
    let reference = match full && !loss.reference_free() {
        true => {
            let (session, base) = (&run.session, &run.base);
            let (dtype, device, lead) = (session.dtype, &session.device, session.lead());
            Some(setup_reference(cfg, &policy, base, dtype, device, lead)?)
        }
        false => None,
    };
    let trainer = run.plan(cfg, policy, trainable)?.start(cfg)?;

    // ---------------------------------------------------------------- training loop
    // Each micro-batch of pairs carries the reference's log probabilities of both responses
    // (torchtune's DPO metrics are logged as means over a step's pairs).
    trainer.fit(cfg, &mut Dpo { reference, loss })
}

/// The frozen reference (none for LoRA: the policy with its adapters disabled; none at all for a
/// reference-free loss) and the loss.
struct Dpo {
    reference: Option<CausalLm>,
    loss: PreferenceLoss,
}

impl Hooks for Dpo {
    fn prepare(&mut self, batch: &mut MicroBatch, mut at: At<'_>) -> Result<()> {
        let reference = self.reference.as_ref();
        if let Some(mut p) = batch.preference.take() {
            // KTO's rows come with their labels and KL rows: the reference's log probabilities
            // of the rows, and the KL estimate.
            if let Some(u) = p.unpaired.as_mut() {
                if let Some(kl_rows) = &u.kl_rows {
                    u.kl = kto_kl(reference, at.model, at.sharded.as_deref_mut(), kl_rows)?;
                }
            }
            p.reference_logps = reference_logps(reference, at.model, at.sharded, batch)?;
            batch.preference = Some(p);
            return Ok(());
        }
        let reference_logps = match self.loss.reference_free() {
            true => vec![0.0; batch.input_ids.dim(0)?],
            false => reference_logps(reference, at.model, at.sharded, batch)?,
        };
        batch.preference = Some(Preference {
            reference_logps,
            loss: self.loss,
            unpaired: None,
        });
        Ok(())
    }
}
