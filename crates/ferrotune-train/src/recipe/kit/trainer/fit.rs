//! The training loop the fine-tuning recipes share: its plan (sharding, data, validation, the
//! run's length), its start (optimizer, resumed state, run log), and the epochs' steps with their
//! checkpoints; what a recipe adds to a step comes through its [`Hooks`].

use std::time::Instant;

use anyhow::{bail, Result};
use candle_core::Var;
use ferrotune_data::dataset::Row;
use ferrotune_models::peft::LoraConfig;
use ferrotune_models::CausalLm;
use indicatif::ProgressBar;

use crate::config::Config;
use crate::dist::fsdp::{forward_backward_sharded, ShardedModel};
use crate::loss::PreferenceLoss;
use crate::metrics::{peak_rss_mb, MetricLogger};
use crate::optim::Optimizer;
use crate::recipe::kit::checkpoint::Saver;
use crate::recipe::kit::data::{epoch_order, Examples};
use crate::recipe::kit::push;
use crate::recipe::kit::report::{kill_if_asked, note_ignored_keys, progress_bar, report_memory};
use crate::recipe::kit::reward;
use crate::recipe::kit::settings::Mode;
use crate::recipe::kit::unpaired::UnpairedData;
use crate::recipe::kit::validation;
use crate::recipe::setup;
use crate::recipe::state::{self, TrainState};
use crate::schedule::LrSchedule;
use crate::step::{
    dropout_states, empty_grads, forward_backward, set_dropout_states, MicroBatch, StepLoss,
};

use super::{optimizer_step, reduce_step, FineTune, Trainable};

/// Where a step stands when a recipe's [`Hooks`] are called.
pub struct At<'a> {
    /// The model being trained.
    pub model: &'a mut CausalLm,
    /// Distributed: this rank's part of the model.
    pub sharded: Option<&'a mut ShardedModel>,
    /// The optimizer steps taken so far.
    pub global_step: usize,
    /// The epoch's progress bar (to print a line through).
    pub bar: &'a ProgressBar,
}

/// What a recipe adds to the shared steps (each does nothing unless the recipe says otherwise).
pub trait Hooks {
    /// Before an optimizer step takes its micro-batches: switches on the model's layers, or a
    /// line printed through the bar.
    fn before_step(&mut self, _at: At<'_>) -> Result<()> {
        Ok(())
    }

    /// Readies one micro-batch before its forward and backward (a teacher's outputs, a
    /// reference's log probabilities, which layers it skips).
    fn prepare(&mut self, _batch: &mut MicroBatch, _at: At<'_>) -> Result<()> {
        Ok(())
    }
}

/// No additions: supervised fine-tuning as it is.
impl Hooks for () {}

/// Validation on `dataset_val`: every how many steps, this rank's rows, its batch size and (over
/// several ranks) how many batches each rank scores.
struct ValidationRun {
    every: usize,
    rows: Vec<Row>,
    batch_size: usize,
    batches: Option<usize>,
}

/// A run with its model, data and length decided, before its optimizer is made.
pub struct Plan {
    /// The run's start.
    pub run: FineTune,
    /// The model being trained.
    pub model: CausalLm,
    adapters: Option<LoraConfig>,
    params: Vec<(String, Var)>,
    /// Distributed: this rank's part of the model, and how gradients are reduced.
    pub sharded: Option<ShardedModel>,
    examples: Examples,
    pad: u32,
    validation: Option<ValidationRun>,
    steps_per_epoch: usize,
    /// Optimizer steps over the whole run.
    pub total_steps: usize,
    schedule: LrSchedule,
    /// The router's load-balancing loss coefficient of a mixture-of-experts model that asks for it.
    pub aux_coef: Option<f64>,
}

impl FineTune {
    /// Plans the run of `model` (as [`Self::start`] loaded it) training `trainable`: the ranks'
    /// shards, the training and validation data, the steps per epoch and the LR schedule.
    pub fn plan(self, cfg: &Config, mut model: CausalLm, trainable: Trainable) -> Result<Plan> {
        let (recipe, mode, lead) = (self.recipe, self.mode, self.session.lead());
        let (rank, world) = (self.session.rank, self.session.world);
        let settings = &self.settings;
        if lead && !mode.preference() {
            note_ignored_keys(cfg, &["ref_checkpointer"], "full_dpo", recipe);
        }
        // transformers' MoE models add the router's load-balancing loss when the checkpoint's
        // config asks for it (`output_router_logits`).
        let aux_coef = model.config.router_aux_loss_coef();
        if lead {
            if let Some(loss) = settings.preference_loss {
                eprintln!("Preference loss: {loss:?}");
            }
            if let Some(coef) = aux_coef {
                eprintln!(
                    "Router load-balancing loss added with weight {coef} (output_router_logits)"
                );
            }
            if let (true, Some(why)) = (settings.checkpointing, model.layers_not_separable()) {
                tracing::warn!(
                    "enable_activation_checkpointing is not applied ({why}): every layer's \
                     activations are kept to the backward"
                );
            }
        }
        // Distributed: the model is spread over the ranks, and the optimizer updates this rank's
        // part.
        let sharded = match &self.group {
            // A quantized AdamW's blocks decide where the shards split.
            Some(g) => Some(ShardedModel::with_quant_state(
                &mut model,
                &trainable.params,
                g.sharding,
                g.queue.clone(),
                g.offload,
                setup::quant_config(cfg)?,
            )?),
            None => None,
        };
        let params = match &sharded {
            Some(sm) => sm.optimizer_params(),
            None => trainable.params,
        };
        let tokenizer = &self.tokenizer;
        let positions = model.config.position_limit();
        let examples = if let Some(PreferenceLoss::Kto(loss)) = settings.preference_loss {
            Examples::Unpaired(UnpairedData::build(cfg, tokenizer, positions, loss)?)
        } else if mode.preference() {
            crate::recipe::kit::unpaired::refuse_for_pairs(cfg)?;
            let how = settings.preference_loss.map(|l| l.tokenization());
            let how = how.unwrap_or_default();
            Examples::Pairs(setup::preference_dataset(cfg, tokenizer, positions, how)?)
        } else if mode.reward_model() {
            Examples::Rewards(reward::pairs(cfg, tokenizer, positions, lead)?)
        } else {
            Examples::Rows(setup::dataset(cfg, tokenizer, positions)?.rows)
        };
        let pad = setup::pad_id(tokenizer, &model.config);
        // Validation every `run_val_every_n_steps` optimizer steps on `dataset_val` (torchtune's
        // keys).
        let validation = match settings.validation {
            None => None,
            Some(v) => {
                let rows = setup::dataset_at(cfg, tokenizer, "dataset_val", positions)?.rows;
                // One device scores every row; ranks take theirs as torchtune's sampler deals
                // them (and, like its loader, leave out each rank's last incomplete batch).
                let (rows, batches) = if self.distributed {
                    let (mine, batches) =
                        validation::rank_validation_rows(&rows, v.batch_size, rank, world);
                    (mine, Some(batches))
                } else {
                    (rows, None)
                };
                Some(ValidationRun {
                    every: v.every,
                    rows,
                    batch_size: v.batch_size,
                    batches,
                })
            }
        };
        // Each optimizer step takes batch_size × ranks × gradient_accumulation_steps rows.
        let (batch_size, grad_accum) = (settings.batch_size, settings.grad_accum);
        let batches_per_epoch = examples.len() / (batch_size * world);
        let mut steps_per_epoch = batches_per_epoch / grad_accum;
        if let Some(m) = settings.max_steps_per_epoch {
            steps_per_epoch = steps_per_epoch.min(m);
        }
        if steps_per_epoch == 0 {
            bail!(
                "{}: the dataset has {} {}, fewer than one optimizer step needs \
                 (batch_size {batch_size} × {world} ranks × gradient_accumulation_steps {grad_accum})",
                cfg.origin,
                examples.len(),
                if matches!(examples, Examples::Pairs(_) | Examples::Rewards(_)) { "pairs" } else { "rows" }
            );
        }
        let total_steps = steps_per_epoch * settings.epochs;
        let schedule = setup::schedule(cfg, total_steps)?;
        if lead && mode != Mode::EarlyExit {
            let keys = ["early_exit_loss", "layer_dropout"];
            note_ignored_keys(cfg, &keys, "dev/early_exit_finetune_distributed", recipe);
        }
        Ok(Plan {
            run: self,
            model,
            adapters: trainable.adapters,
            params,
            sharded,
            examples,
            pad,
            validation,
            steps_per_epoch,
            total_steps,
            schedule,
            aux_coef,
        })
    }
}

/// A run ready to train: [`Plan::start`]'s optimizer and the state it starts (or resumes) from.
pub struct Trainer {
    plan: Plan,
    param_refs: Vec<(String, Var)>,
    optimizer: Box<dyn Optimizer>,
    base_lr: f64,
    /// Where the run starts: fresh, or the resumed checkpoint's epoch and step.
    pub start: TrainState,
    logger: Option<MetricLogger>,
}

impl Plan {
    /// Makes the optimizer (resuming its state with the rest of a saved checkpoint's) and opens
    /// the run's log.
    pub fn start(mut self, cfg: &Config) -> Result<Trainer> {
        let run = &self.run;
        let (rank, world, lead) = (run.session.rank, run.session.world, run.session.lead());
        let (recipe, seed) = (run.recipe, run.seed);
        let model = &self.model;
        let param_refs: Vec<(String, Var)> = self.params.clone();
        if let (true, Some(note)) = (lead, setup::optimizer_note(cfg)?) {
            eprintln!("{note}");
        }
        let params = std::mem::take(&mut self.params);
        let mut optimizer = setup::sharded_optimizer(cfg, params, self.sharded.as_ref())?;
        let base_lr = optimizer.lr();
        let rows = self.examples.len();
        let mut start = TrainState {
            dropout_states: dropout_states(model),
            ..TrainState::fresh(recipe, seed, rows, self.steps_per_epoch)
        };
        if rank > 0 {
            // Ranks draw different LoRA dropout masks (their data differs too).
            let mixed: Vec<u64> = start
                .dropout_states
                .iter()
                .map(|&s| ferrotune_models::lora::SplitMix64::new(s ^ rank as u64).next_u64())
                .collect();
            set_dropout_states(model, &mixed);
        }
        if let Some(s) = &run.saved {
            state::check_resumable(s, recipe, rows, self.steps_per_epoch)?;
            let full = state::read_optimizer_state(&s.dir, &run.session.device)?;
            let mine = match &self.sharded {
                Some(sm) => sm.shard_optimizer_state(full)?,
                None => full,
            };
            state::load_optimizer_state(&s.dir, optimizer.as_mut(), &mine)?;
            start = s.state.clone();
            match s.state.rank_dropout_states.get(rank) {
                Some(states) if s.state.rank_dropout_states.len() == world => {
                    set_dropout_states(model, states)
                }
                _ if rank == 0 => set_dropout_states(model, &s.state.dropout_states),
                // Another world size: rank 0 continues its masks, the others start afresh.
                _ => {}
            }
            run.say(format!(
                "Resuming from {} at epoch {} step {} (global step {})",
                s.dir.display(),
                start.epoch,
                start.step_in_epoch,
                start.global_step
            ));
        }
        let logger = match lead {
            true => Some(state::open_run_log(cfg, &run.settings.output_dir, &start)?),
            false => None,
        };
        Ok(Trainer {
            plan: self,
            param_refs,
            optimizer,
            base_lr,
            start,
            logger,
        })
    }
}

/// One optimizer step's sums (this rank's until reduced over the ranks).
struct StepSums {
    losses: StepLoss,
    targets: usize,
    tokens: usize,
}

impl Trainer {
    /// Trains every epoch left, each step's micro-batches readied by `hooks`, saving a checkpoint
    /// every `save_every_n_steps` and at each epoch's end; then closes the log and (several
    /// ranks) leaves the group.
    pub fn fit(self, cfg: &Config, hooks: &mut dyn Hooks) -> Result<()> {
        let Trainer {
            mut plan,
            param_refs,
            mut optimizer,
            base_lr,
            start,
            mut logger,
        } = self;
        let run = &plan.run;
        let settings = &run.settings;
        let (rank, world, lead) = (run.session.rank, run.session.world, run.session.lead());
        let (mode, device, dtype) = (run.mode, &run.session.device, run.session.dtype);
        let (batch_size, grad_accum) = (settings.batch_size, settings.grad_accum);
        let say = |msg: String| run.say(msg);
        let torchtune_adapter = setup::torchtune_checkpointer(cfg)
            && ferrotune_models::torchtune_adapter::supports(&plan.model.config);
        let saver = Saver {
            adapter_only: settings.adapter_only,
            keep_last: settings.keep_last,
            ..Saver::hf(&settings.checkpoint_dir, &run.source, &run.tokenizer, dtype)
        };
        let lora_adapters = plan.adapters.as_ref().filter(|_| !mode.full());
        let saver = saver.with_adapters(&plan.model, lora_adapters, torchtune_adapter, &say);
        let saver = Saver {
            format: setup::save_format(cfg, &run.source, say),
            ..saver
        };
        // `push_to_hub`: checked (repo id, token) before the first step; rank 0 pushes at the end.
        let push = match lead {
            true => push::push_request(cfg)?,
            false => None,
        };
        let model = &mut plan.model;
        let mut sharded = plan.sharded.take();
        let steps_per_epoch = plan.steps_per_epoch;
        let mut global_step = start.global_step;
        for epoch in start.epoch..settings.epochs {
            let order = epoch_order(plan.examples.len(), settings.shuffle, run.seed, epoch);
            let first = if epoch == start.epoch {
                start.step_in_epoch
            } else {
                0
            };
            let bar = if lead {
                progress_bar(steps_per_epoch, first, epoch)
            } else {
                ProgressBar::hidden()
            };
            for step_in_epoch in first..steps_per_epoch {
                let t_step = Instant::now();
                let at = At {
                    model: &mut *model,
                    sharded: sharded.as_mut(),
                    global_step,
                    bar: &bar,
                };
                hooks.before_step(at)?;
                let lr = base_lr * plan.schedule.multiplier(global_step);
                optimizer.set_lr(lr);
                let mut grads = empty_grads()?;
                // Each micro-batch's smallest and largest reward (reward models).
                let mut extremes = Vec::with_capacity(grad_accum);
                let mut sums = StepSums {
                    losses: StepLoss::default(),
                    targets: 0,
                    tokens: 0,
                };
                // The step's micro-batches. Rank r takes every world-th row of the step's block
                // (torch's DistributedSampler), so the ranks together take the rows one device
                // would.
                let mut batches = (0..grad_accum)
                    .map(|micro| {
                        let b = step_in_epoch * grad_accum + micro;
                        let picked =
                            (b * batch_size..(b + 1) * batch_size).map(|j| order[j * world + rank]);
                        plan.examples.micro_batch(picked, plan.pad, device)
                    })
                    .collect::<Result<Vec<_>>>()?;
                if let Some(coef) = plan.aux_coef {
                    // The router loss is weighed against the whole step's targets (every
                    // rank's), so that after normalisation it is the coefficient times the
                    // micro-batches' mean.
                    let mut step_targets =
                        batches.iter().map(|b| b.num_targets).sum::<usize>() as f64;
                    if let Some(sm) = &sharded {
                        step_targets = sm.all_reduce_f64(&[step_targets])?[0];
                    }
                    let weight = coef * step_targets / (grad_accum * world) as f64;
                    for b in &mut batches {
                        b.aux_loss_weight = Some(weight);
                    }
                }
                for mut batch in batches {
                    let at = At {
                        model: &mut *model,
                        sharded: sharded.as_mut(),
                        global_step,
                        bar: &bar,
                    };
                    hooks.prepare(&mut batch, at)?;
                    let checkpointing = settings.checkpointing;
                    let step = match &mut sharded {
                        Some(sm) => forward_backward_sharded(model, sm, &batch, checkpointing)?,
                        None => {
                            forward_backward(model, &batch, &param_refs, &mut grads, checkpointing)?
                        }
                    };
                    sums.losses += step;
                    extremes.push((step.rewards.min, step.rewards.max));
                    sums.targets += batch.num_targets;
                    sums.tokens += batch.num_tokens;
                }
                // This rank's own tokens: torchtune's `tokens_per_second_per_gpu`.
                let local_tokens = sums.tokens;
                if let Some(sm) = &mut sharded {
                    let StepSums {
                        losses,
                        targets,
                        tokens,
                    } = &mut sums;
                    grads = reduce_step(sm, losses, targets, tokens)?;
                    if mode.reward_model() {
                        // TRL takes each micro-batch's extremes over every rank's rewards.
                        losses.rewards =
                            reward::extremes_over_ranks(sm, losses.rewards, &extremes)?;
                    }
                }
                let StepSums {
                    losses,
                    targets,
                    tokens,
                } = sums;
                let grad_norm = optimizer_step(
                    optimizer.as_mut(),
                    grads,
                    &param_refs,
                    targets,
                    settings.clip,
                    sharded.as_ref(),
                )?;
                global_step += 1;
                let loss = if targets > 0 {
                    losses.sum / targets as f64
                } else {
                    0.0
                };
                if !loss.is_finite() {
                    bail!("the loss became {loss} at step {global_step}: lower optimizer.lr or set clip_grad_norm");
                }
                let secs = t_step.elapsed().as_secs_f64();
                let tps = tokens as f64 / secs.max(1e-9);
                bar.set_message(format!(
                    "{}|{}|Loss: {loss:.4}|lr: {lr:.2e}|{tps:.0} tok/s",
                    epoch + 1,
                    global_step
                ));
                bar.inc(1);
                if global_step == start.global_step + 1 {
                    if let Some(sm) = &sharded {
                        report_memory(sm, optimizer.as_ref(), rank)?;
                    }
                }
                let log_now = global_step.is_multiple_of(settings.log_every);
                if let (Some(logger), true) = (logger.as_mut(), log_now) {
                    let mut metrics: Vec<(&str, f64)> = vec![
                        ("epoch", epoch as f64),
                        ("loss", loss),
                        ("lr", lr),
                        ("tokens_per_second", tps),
                        (
                            "tokens_per_second_per_gpu",
                            local_tokens as f64 / secs.max(1e-9),
                        ),
                    ];
                    if settings.kd.is_some() {
                        // torchtune's KD recipes log both parts of the loss.
                        let per_target =
                            |s: f64| if targets > 0 { s / targets as f64 } else { 0.0 };
                        metrics.push(("class_loss", per_target(losses.class)));
                        metrics.push(("kd_loss", per_target(losses.kd)));
                    }
                    if mode.reward_model() {
                        // TRL's RewardTrainer metrics, over the step's pairs (every rank's).
                        metrics.extend(losses.rewards.metrics(targets));
                    }
                    if let Some(PreferenceLoss::Kto(_)) = settings.preference_loss {
                        // TRL's KTO metrics (every rank's).
                        metrics.extend(losses.pairs.kto_metrics(grad_accum * world));
                    } else if mode.preference() {
                        // torchtune's DPO metrics, as means over the step's pairs (every rank's).
                        metrics.extend(losses.pairs.metrics(targets));
                        if let Some(loss) = settings.preference_loss {
                            // TRL's own metrics of ORPO, CPO and SimPO.
                            metrics.extend(losses.pairs.method_metrics(targets, loss));
                        }
                    }
                    if plan.aux_coef.is_some() {
                        // transformers' `aux_loss`: the micro-batches' mean (every rank's).
                        metrics.push(("aux_loss", losses.aux / (grad_accum * world) as f64));
                    }
                    if let Some(n) = grad_norm {
                        metrics.push(("grad_norm", n));
                    }
                    if settings.log_memory {
                        metrics.push(("peak_memory_rss_mb", peak_rss_mb()));
                        let state = optimizer.state_bytes()?;
                        metrics.push(("optimizer_state_mb", state as f64 / 1e6));
                    }
                    logger.log_step(global_step as u64, &metrics)?;
                }
                if let Some(v) = &plan.validation {
                    if global_step.is_multiple_of(v.every) {
                        // Dropout off while validating, as torchtune's `model.eval()`.
                        ferrotune_models::lora::set_training(model, false);
                        let val_loss = validation::validation_loss(
                            model,
                            sharded.as_mut(),
                            &v.rows,
                            (v.batch_size, v.batches),
                            plan.pad,
                            device,
                        )?;
                        ferrotune_models::lora::set_training(model, !mode.full());
                        if lead {
                            bar.suspend(|| eprintln!("Validation loss: {val_loss:.4}"));
                        }
                        if let Some(logger) = logger.as_mut() {
                            logger.log_step(global_step as u64, &[("val_loss", val_loss)])?;
                        }
                    }
                }
                kill_if_asked(global_step, rank);
                let end_of_epoch = step_in_epoch + 1 == steps_per_epoch;
                if let Some(n) = settings.save_every {
                    if global_step.is_multiple_of(n) && !end_of_epoch {
                        let st = TrainState {
                            epoch,
                            step_in_epoch: step_in_epoch + 1,
                            global_step,
                            ..start.clone()
                        };
                        bar.suspend(|| {
                            saver.save(
                                model,
                                sharded.as_mut(),
                                &format!("step_{global_step}"),
                                st,
                                optimizer.as_ref(),
                            )
                        })?;
                    }
                }
            }
            bar.finish();
            // -------------------------------------------------------- checkpoint
            let st = start.after_epoch(epoch, global_step);
            saver.save(
                model,
                sharded.as_mut(),
                &format!("epoch_{epoch}"),
                st,
                optimizer.as_ref(),
            )?;
        }
        // The last epoch's checkpoint, when this run wrote it.
        let last_dir = settings
            .epochs
            .checked_sub(1)
            .filter(|&e| e >= start.epoch)
            .map(|last| saver.output_dir.join(format!("epoch_{last}")));
        if let Some(mut logger) = logger {
            // For a tracker asked to keep it (`log_checkpoint`).
            if let Some(dir) = &last_dir {
                logger.log_checkpoint(dir);
            }
            logger.close()?;
        }
        drop(sharded);
        if let Some(group) = plan.run.group.take() {
            group.store.barrier("end of training")?;
            group.store.shutdown()?;
        }
        if let (Some(req), Some(dir)) = (&push, &last_dir) {
            push::push(req, dir)?;
        }
        Ok(())
    }
}
