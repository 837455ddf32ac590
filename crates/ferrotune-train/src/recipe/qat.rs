//! `qat_distributed` and `qat_lora_finetune_distributed`: quantization-aware training. The
//! linear layers' products run fake-quantized — int8 activations per token, int4 weights in
//! groups of `quantizer.groupsize` — so that the weights learn to survive quantization; every
//! weight trains (`qat_distributed`, fake quantization from `fake_quant_after_n_steps` on), or
//! LoRA adapters on the fake-quantized base. torchtune's recipes, top to bottom.
//!
//! What every fine-tuning recipe does around this (the session, loading, the data, the optimizer
//! and LR schedule, the steps, validation, checkpoints) is the kit's trainer
//! ([`crate::recipe::kit::trainer`]).

use anyhow::{bail, Result};

use crate::config::Config;
use crate::recipe::kit::model::{apply_fake_quant, set_fake_quant_enabled};
use crate::recipe::kit::settings::Mode;
use crate::recipe::kit::trainer::{At, FineTune, Hooks, Trainable};
use crate::recipe::Recipe;

/// Runs `entry`, `qat_distributed` or `qat_lora_finetune_distributed`.
pub fn run(entry: &Recipe, cfg: &Config) -> Result<()> {
    // ---------------------------------------------------------------- setup
    let (run, mut model) = FineTune::start(entry, cfg)?;
    let lora = run.mode == Mode::QatLora;
    let trainable = match lora {
        true => run.adapters(cfg, &mut model)?,
        false => Trainable::all(&mut model)?,
    };
    // The linear layers' base products fake-quantized from here on.
    if run.settings.quantize_base {
        bail!(
            "{}: the QAT recipes fake-quantize a dense base; model.quantize_base (QLoRA) \
             is not supported with them",
            cfg.origin
        );
    }
    let group_size = run.settings.qat_group_size.expect("parsed for QAT");
    let n = apply_fake_quant(cfg, &mut model, lora, group_size)?;
    run.say(format!(
        "QAT: {n} linear layers fake-quantized (int8 per-token activations, int4 weights in \
         groups of {group_size})"
    ));
    run.trainable(cfg, &trainable);
    let after = run.settings.fake_quant_after;
    let trainer = run.plan(cfg, model, trainable)?.start(cfg)?;

    // ---------------------------------------------------------------- training loop
    trainer.fit(cfg, &mut FakeQuantAfter(after))
}

/// torchtune's `fake_quant_after_n_steps`: plain steps first, then fake quantization (always on
/// without it).
struct FakeQuantAfter(Option<usize>);

impl Hooks for FakeQuantAfter {
    fn before_step(&mut self, at: At<'_>) -> Result<()> {
        if let Some(n) = self.0 {
            set_fake_quant_enabled(at.model, at.global_step >= n);
        }
        Ok(())
    }
}
