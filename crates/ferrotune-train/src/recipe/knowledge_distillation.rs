//! `knowledge_distillation_single_device` and `knowledge_distillation_distributed`: LoRA
//! adapters on a frozen student trained against a frozen teacher's output distribution as well
//! as the labels — the loss `(1 - kd_ratio) × cross-entropy + kd_ratio × KL(teacher ‖ student)`
//! as `kd_loss` says. torchtune's recipe, top to bottom.
//!
//! What every fine-tuning recipe does around this (the session, loading, the data, the optimizer
//! and LR schedule, the steps, validation, checkpoints) is the kit's trainer
//! ([`crate::recipe::kit::trainer`]).

use anyhow::Result;

use crate::config::Config;
use crate::recipe::kit::model::{setup_teacher, Teacher};
use crate::recipe::kit::trainer::{At, FineTune, Hooks};
use crate::recipe::Recipe;
use crate::step::MicroBatch;

/// Runs `entry`, `knowledge_distillation_single_device` or `knowledge_distillation_distributed`.
pub fn run(entry: &Recipe, cfg: &Config) -> Result<()> {
    // ---------------------------------------------------------------- setup
    // The student: the model of `checkpointer` with its LoRA adapters.
    let (run, mut student) = FineTune::start(entry, cfg)?;
    let adapters = run.adapters(cfg, &mut student)?;
    run.trainable(cfg, &adapters);
    // The teacher: `teacher_checkpointer`'s model, frozen, over the student's vocabulary.
    let kd = run
        .settings
        .kd
        .expect("parsed for the distillation recipes");
    let (session, lead) = (&run.session, run.session.lead());
    let teacher = setup_teacher(cfg, kd, &student, session.dtype, &session.device, lead)?;
    let trainer = run.plan(cfg, student, adapters)?.start(cfg)?;

    // ---------------------------------------------------------------- training loop
    // Each micro-batch carries the teacher's hidden states for the loss's KL part (its
    // `class_loss` and `kd_loss` parts are logged).
    trainer.fit(cfg, &mut Distill(teacher))
}

/// The teacher whose outputs each micro-batch is distilled from.
struct Distill(Teacher);

impl Hooks for Distill {
    fn prepare(&mut self, batch: &mut MicroBatch, _: At<'_>) -> Result<()> {
        batch.distill = Some(self.0.distill(batch)?);
        Ok(())
    }
}
