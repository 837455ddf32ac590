//! `lora_finetune_single_device`, `full_finetune_single_device` and their `_distributed` twins,
//! knowledge distillation, DPO and QAT: setup, the training loop, checkpoints — torchtune's
//! recipes, top to bottom. LoRA and full fine-tuning differ only in which weights train and what a
//! checkpoint holds; one device and several ranks differ in which rows a rank takes, how
//! gradients are reduced (through [`ShardedModel`]) and that rank 0 alone logs and writes;
//! distillation adds a teacher's hidden states to each micro-batch, DPO a reference model's log
//! probabilities of each pair, QAT fake quantization to the linear layers — each marked where it
//! happens.

use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::Var;
use ferrotune_export::hf::ModelSource;
use ferrotune_models::peft;
use indicatif::ProgressBar;

use crate::config::Config;
use crate::dist::fsdp::{forward_backward_sharded, CommQueue, ShardedModel};
use crate::metrics::peak_rss_mb;
use crate::recipe::setup;
use crate::recipe::state::{self, TrainState};
use crate::recipe::{Ranks, Recipe};
use crate::step::{
    dropout_states, empty_grads, forward_backward, set_dropout_states, Preference, StepLoss,
};

use crate::recipe::kit::checkpoint::{base_source, Saver};
use crate::recipe::kit::data::{epoch_order, Examples};
use crate::recipe::kit::model::{
    apply_fake_quant, reference_logps, set_fake_quant_enabled, setup_adapters, setup_reference,
    setup_teacher,
};
use crate::recipe::kit::report::{kill_if_asked, note_ignored_keys, progress_bar, report_memory};
use crate::recipe::kit::session::Session;
use crate::recipe::kit::trainer::{optimizer_step, reduce_step};
use crate::recipe::kit::validation;

mod settings;

pub use settings::{Settings, Validation};

/// Which weights train.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// LoRA/DoRA adapters on a frozen base.
    Lora,
    /// Every weight.
    Full,
    /// LoRA adapters trained against a frozen teacher's outputs as well as the labels
    /// (torchtune's `knowledge_distillation_*`).
    Distill,
    /// LoRA adapters trained on preference pairs by DPO, the reference being the model with its
    /// adapters disabled (torchtune's `lora_dpo_*`).
    Dpo,
    /// Every weight trained by DPO against a frozen reference model (`full_dpo_distributed`).
    FullDpo,
    /// Every weight trained through fake-quantized linear layers (`qat_distributed`).
    Qat,
    /// LoRA adapters on fake-quantized base layers (`qat_lora_finetune_distributed`).
    QatLora,
    /// Every weight, with LayerSkip's early-exit loss and layer dropout
    /// (`dev/early_exit_finetune_distributed`, see [`crate::early_exit`]).
    EarlyExit,
}

impl Mode {
    /// Whether every weight trains (otherwise LoRA adapters on a frozen base).
    fn full(self) -> bool {
        matches!(
            self,
            Mode::Full | Mode::FullDpo | Mode::Qat | Mode::EarlyExit
        )
    }

    /// Whether linear layers train fake-quantized (torchtune's QAT recipes).
    fn qat(self) -> bool {
        matches!(self, Mode::Qat | Mode::QatLora)
    }

    /// Whether the data are preference pairs and the loss a preference loss.
    fn preference(self) -> bool {
        matches!(self, Mode::Dpo | Mode::FullDpo)
    }
}

/// The mode of fine-tuning recipe `recipe`.
fn mode_of(recipe: &Recipe) -> Result<Mode> {
    recipe
        .mode
        .ok_or_else(|| anyhow!("{} is not a fine-tuning recipe", recipe.name))
}

/// Checks a config for fine-tuning recipe `recipe` without loading anything: its [`Settings`]
/// read as `run` reads them.
pub fn check(recipe: &Recipe, cfg: &Config) -> Result<()> {
    Settings::parse(cfg, mode_of(recipe)?).map(|_| ())
}

/// Runs fine-tuning recipe `entry`: on one device, or (`distributed`) as one rank of the group that
/// torchrun's environment variables describe (world size 1 without them).
pub fn run(entry: &Recipe, cfg: &Config) -> Result<()> {
    // ---------------------------------------------------------------- setup
    let (recipe, mode) = (entry.name, mode_of(entry)?);
    let distributed = entry.ranks == Ranks::Several;
    let session = Session::start(cfg, recipe, distributed)?;
    let (rank, world, lead) = (session.rank, session.world, session.lead());
    let (env, device, dtype) = (&session.env, session.device.clone(), session.dtype);
    let settings = Settings::parse(cfg, mode)?;
    let Settings {
        batch_size,
        epochs,
        grad_accum,
        clip,
        checkpointing,
        offload,
        preference_loss,
        max_steps_per_epoch: max_steps,
        log_every,
        log_memory,
        save_every,
        adapter_only,
        verbose_exits,
        ..
    } = settings;
    // A backend asked for by name (`FERROTUNE_DIST_BACKEND`) runs its collectives even for one
    // rank: how the NCCL path is checked on a single GPU.
    let backend_asked = ferrotune_core::switch::DIST_BACKEND.value_os().is_some();
    let group = if distributed && world == 1 && !offload && !backend_asked {
        // One rank has nothing to shard or reduce: it takes the single-device path (the same
        // numbers), which keeps no flat copies of the parameters and gradients.
        setup::sharding(cfg)?;
        None
    } else if distributed {
        let sharding = setup::sharding(cfg)?;
        let (store, collectives) = crate::dist::join_group(env, &device)?;
        if lead {
            eprintln!(
                "Distributed: {world} ranks, {} backend, fsdp_sharding: {}{}",
                collectives.backend(),
                sharding.name(),
                if offload {
                    ", optimizer state offloaded to the CPU"
                } else {
                    ""
                }
            );
        }
        Some((store, CommQueue::start(collectives), sharding, offload))
    } else {
        if lead {
            let keys = ["fsdp_sharding", "fsdp_cpu_offload", "fsdp"];
            note_ignored_keys(cfg, &keys, "_distributed", recipe);
        }
        None
    };
    if lead {
        for ignored in &settings.ignored_switches {
            eprintln!("note: '{ignored}: true' is ignored by ferrotune (it changes no result)");
        }
    }
    // torchtune's 70B configs name a tensor-parallel plan with `tensor_parallel_dim: 1`, which
    // is no tensor parallelism; a larger dimension would change how rows are dealt to ranks,
    // so it is refused rather than run as something else.
    match settings.tensor_parallel_dim {
        None | Some(1) => {}
        Some(n) => bail!(
            "{}: tensor_parallel_dim: {n} is not supported (ferrotune has no tensor \
             parallelism; its distributed recipes shard with fsdp_sharding): set it to 1",
            cfg.origin
        ),
    }
    let output_dir = settings.output_dir.clone();
    let ckpt_out = settings.checkpoint_dir.clone();

    // Where to start from: a saved checkpoint of this run, or the configured base.
    let saved = match settings.resume {
        true => {
            let asked = settings.recipe_checkpoint.as_deref();
            Some(state::resume_point(&cfg.origin, asked, &ckpt_out)?)
        }
        false => None,
    };
    let seed = state::run_seed(cfg, saved.as_ref())?;

    let base = setup::checkpoint_path(cfg)?;
    let base_path = base.path.clone();
    let tokenizer = setup::tokenizer(cfg, &base_path)?;
    // Full fine-tuning resumes from the saved full weights; LoRA from the base plus the saved adapter.
    let weights = match (&saved, mode) {
        (Some(s), m) if m.full() => setup::CheckpointLocation::folder(&s.dir),
        _ => base.clone(),
    };
    let t0 = Instant::now();
    let (mut model, source) = setup::load_model(cfg, &weights, dtype, &device)?;
    model
        .config
        .require_language_model()
        .map_err(|e| anyhow!("{}: {e}", weights.path.display()))?;
    let say = |msg: String| {
        if lead {
            eprintln!("{msg}");
        }
    };
    let source = match (&saved, mode) {
        // Tokenizer/generation files still come from the original base.
        (Some(_), m) if m.full() => {
            let (fmt, dir) = base_source(&base)?;
            ModelSource { format: fmt, dir }
        }
        _ => source,
    };
    say(format!(
        "Model {} ({}, {} layers) loaded in {:.1}s on {device:?} as {dtype:?}",
        base_path.display(),
        model.config.model_type,
        model.config.num_hidden_layers,
        t0.elapsed().as_secs_f64()
    ));

    let qlora = setup::quantize_base(cfg)?;
    if qlora && mode.full() {
        bail!(
            "{}: model.quantize_base (a qlora_* builder) freezes the base in NF4; full fine-tuning \
             trains every weight: use a LoRA recipe, or a lora_*/full model builder",
            cfg.origin
        );
    }
    if let Some(line) = setup::quantize_base_if_asked(cfg, &mut model)? {
        say(line);
    }
    let (params, lora_config) = match mode {
        Mode::Lora | Mode::Distill | Mode::Dpo | Mode::QatLora => {
            let lc = setup_adapters(cfg, &mut model, &base_path, saved.as_ref(), seed, lead)?;
            ferrotune_models::lora::set_training(&mut model, true);
            let mut params = peft::trainable_parameters(&mut model)?;
            if !lc.modules_to_save.is_empty() {
                if mode == Mode::Dpo {
                    // The reference is the model with its adapters disabled, which would need the
                    // saved modules' original weights kept beside them.
                    bail!(
                        "{}: modules_to_save {:?} is not supported by the LoRA DPO recipe",
                        cfg.origin,
                        lc.modules_to_save
                    );
                }
                let saved = peft::make_saved_modules_trainable(&mut model, &lc.modules_to_save)
                    .with_context(|| cfg.origin.clone())?;
                say(format!(
                    "Trained in full beside the adapters (modules_to_save): {}",
                    saved
                        .iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
                params.extend(saved);
            }
            (params, Some(lc))
        }
        Mode::Full | Mode::FullDpo | Mode::Qat | Mode::EarlyExit => {
            (model.make_all_trainable()?, None)
        }
    };
    // QAT: the linear layers' base products fake-quantized from here on.
    let fake_quant_after = if mode.qat() {
        if qlora {
            bail!(
                "{}: the QAT recipes fake-quantize a dense base; model.quantize_base (QLoRA) \
                 is not supported with them",
                cfg.origin
            );
        }
        let group_size = settings.qat_group_size.expect("parsed for the QAT recipes");
        let n = apply_fake_quant(cfg, &mut model, mode == Mode::QatLora, group_size)?;
        say(format!(
            "QAT: {n} linear layers fake-quantized (int8 per-token activations, int4 weights in \
             groups of {group_size})"
        ));
        settings.fake_quant_after
    } else {
        if lead && cfg.get("quantizer").is_some_and(|v| !v.is_null()) {
            // torchtune's QAT recipes fake-quantize with it; this one does not.
            eprintln!(
                "warning: 'quantizer' applies to the QAT recipes (qat_distributed, \
                 qat_lora_finetune_distributed): {recipe} trains without fake quantization"
            );
        }
        None
    };
    let trainable: usize = params.iter().map(|(_, v)| v.elem_count()).sum();
    say(format!(
        "{} trainable parameters in {} tensors",
        trainable,
        params.len()
    ));
    let teacher = match mode {
        Mode::Distill => {
            let kd = settings.kd.expect("parsed for the distillation recipes");
            Some(setup_teacher(cfg, kd, &model, dtype, &device, lead)?)
        }
        _ => {
            if lead {
                let keys = [
                    "teacher_model",
                    "teacher_checkpointer",
                    "kd_loss",
                    "kd_ratio",
                ];
                note_ignored_keys(cfg, &keys, "knowledge_distillation", recipe);
            }
            None
        }
    };
    // DPO's reference: the base model with the adapters disabled (LoRA), or a frozen copy.
    let reference = match mode {
        Mode::FullDpo => Some(setup_reference(cfg, &model, &base, dtype, &device, lead)?),
        _ => {
            if lead && mode != Mode::Dpo {
                note_ignored_keys(cfg, &["ref_checkpointer"], "full_dpo", recipe);
            }
            None
        }
    };
    // transformers' MoE models add the router's load-balancing loss when the checkpoint's
    // config asks for it (`output_router_logits`).
    let aux_coef = model.config.router_aux_loss_coef();
    if lead {
        if let Some(loss) = preference_loss {
            eprintln!("Preference loss: {loss:?}");
        }
        if let Some(coef) = aux_coef {
            eprintln!("Router load-balancing loss added with weight {coef} (output_router_logits)");
        }
        if let (true, Some(why)) = (checkpointing, model.layers_not_separable()) {
            tracing::warn!(
                "enable_activation_checkpointing is not applied ({why}): every layer's activations \
                 are kept to the backward"
            );
        }
    }
    // Distributed: the model is spread over the ranks, and the optimizer updates this rank's part.
    let mut sharded = match &group {
        Some((_, queue, sharding, offload)) => Some(ShardedModel::new(
            &mut model,
            &params,
            *sharding,
            queue.clone(),
            *offload,
        )?),
        None => None,
    };
    let params = match &sharded {
        Some(sm) => sm.optimizer_params(),
        None => params,
    };

    let examples = if mode.preference() {
        Examples::Pairs(setup::preference_dataset(cfg, &tokenizer)?)
    } else {
        Examples::Rows(setup::dataset(cfg, &tokenizer)?.rows)
    };
    let pad = setup::pad_id(&tokenizer, &model.config);
    // Validation every `run_val_every_n_steps` optimizer steps on `dataset_val` (torchtune's keys).
    let validation = match settings.validation {
        None => None,
        Some(v) => {
            let val_rows = setup::dataset_at(cfg, &tokenizer, "dataset_val")?.rows;
            // One device scores every row; ranks take theirs as torchtune's sampler deals them
            // (and, like its loader, leave out each rank's last incomplete batch).
            let (val_rows, val_batches) = if distributed {
                let (mine, batches) =
                    validation::rank_validation_rows(&val_rows, v.batch_size, rank, world);
                (mine, Some(batches))
            } else {
                (val_rows, None)
            };
            Some((v.every, val_rows, v.batch_size, val_batches))
        }
    };
    // Each optimizer step takes batch_size × ranks × gradient_accumulation_steps rows.
    let batches_per_epoch = examples.len() / (batch_size * world);
    let mut steps_per_epoch = batches_per_epoch / grad_accum;
    if let Some(m) = max_steps {
        steps_per_epoch = steps_per_epoch.min(m);
    }
    if steps_per_epoch == 0 {
        bail!(
            "{}: the dataset has {} {}, fewer than one optimizer step needs \
             (batch_size {batch_size} × {world} ranks × gradient_accumulation_steps {grad_accum})",
            cfg.origin,
            examples.len(),
            if mode.preference() { "pairs" } else { "rows" }
        );
    }
    let total_steps = steps_per_epoch * epochs;
    let schedule = setup::schedule(cfg, total_steps)?;
    // LayerSkip (the early-exit recipe): which layers' exits count at each step, and which rows
    // each layer skips.
    let num_layers = model.layers.len();
    let (early_exit, layer_dropout) = if mode == Mode::EarlyExit {
        setup::layer_skip(cfg, num_layers, total_steps)?
    } else {
        if lead {
            let keys = ["early_exit_loss", "layer_dropout"];
            note_ignored_keys(cfg, &keys, "dev/early_exit_finetune_distributed", recipe);
        }
        (None, None)
    };
    if aux_coef.is_some() && (early_exit.is_some() || layer_dropout.is_some()) {
        bail!(
            "{}: early_exit_loss and layer_dropout are not supported with a mixture-of-experts \
             model's router load-balancing loss",
            cfg.origin
        );
    }
    let param_refs: Vec<(String, Var)> = params.clone();
    if let (true, Some(note)) = (lead, setup::optimizer_note(cfg)?) {
        eprintln!("warning: {note}");
    }
    let mut optimizer = setup::optimizer(cfg, params)?;
    let base_lr = optimizer.lr();

    let mut start = TrainState {
        dropout_states: dropout_states(&model),
        ..TrainState::fresh(recipe, seed, examples.len(), steps_per_epoch)
    };
    if rank > 0 {
        // Ranks draw different LoRA dropout masks (their data differs too).
        let mixed: Vec<u64> = start
            .dropout_states
            .iter()
            .map(|&s| ferrotune_models::lora::SplitMix64::new(s ^ rank as u64).next_u64())
            .collect();
        set_dropout_states(&model, &mixed);
    }
    if let Some(s) = &saved {
        state::check_resumable(s, recipe, examples.len(), steps_per_epoch)?;
        let full = state::read_optimizer_state(&s.dir, &device)?;
        let mine = match &sharded {
            Some(sm) => sm.shard_optimizer_state(full)?,
            None => full,
        };
        state::load_optimizer_state(&s.dir, optimizer.as_mut(), &mine)?;
        start = s.state.clone();
        match s.state.rank_dropout_states.get(rank) {
            Some(states) if s.state.rank_dropout_states.len() == world => {
                set_dropout_states(&model, states)
            }
            _ if rank == 0 => set_dropout_states(&model, &s.state.dropout_states),
            // Another world size: rank 0 continues its masks, the others start afresh.
            _ => {}
        }
        say(format!(
            "Resuming from {} at epoch {} step {} (global step {})",
            s.dir.display(),
            start.epoch,
            start.step_in_epoch,
            start.global_step
        ));
    }
    let mut logger = match lead {
        true => Some(state::open_run_log(cfg, &output_dir, start.global_step)?),
        false => None,
    };
    // Every rank draws the same rows (torchtune seeds each layer's generator with its index); a
    // resumed run continues the draws after the rows of the steps already taken.
    let mut layer_dropout = layer_dropout.map(|d| {
        let drawn = (start.global_step * grad_accum * batch_size) as u64;
        crate::early_exit::LayerDropout::new(d.prob, d.scale, &d.applies, drawn)
    });
    if let Some(d) = &layer_dropout {
        say(format!(
            "Layer dropout: probability per layer {:?}",
            d.probabilities()
        ));
    }
    let mut last_exits: Option<Vec<usize>> = None;

    // ---------------------------------------------------------------- training loop
    let torchtune_adapter = setup::torchtune_checkpointer(cfg)
        && ferrotune_models::torchtune_adapter::supports(&model.config);
    let saver = Saver {
        adapter_only,
        keep_last: settings.keep_last,
        ..Saver::hf(&ckpt_out, &source, &tokenizer, dtype)
    };
    let lora_adapters = lora_config.as_ref().filter(|_| !mode.full());
    let saver = saver.with_adapters(&model, lora_adapters, torchtune_adapter, &say);
    let saver = Saver {
        format: setup::save_format(cfg, &source, say),
        ..saver
    };
    let mut global_step = start.global_step;
    for epoch in start.epoch..epochs {
        let order = epoch_order(examples.len(), settings.shuffle, seed, epoch);
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
            if let Some(n) = fake_quant_after {
                // torchtune's `fake_quant_after_n_steps`: plain steps first, then fake quantization.
                set_fake_quant_enabled(&mut model, global_step >= n);
            }
            let lr = base_lr * schedule.multiplier(global_step);
            optimizer.set_lr(lr);
            let mut grads = empty_grads()?;
            let (mut losses, mut targets, mut tokens) = (StepLoss::default(), 0usize, 0usize);
            // The step's micro-batches. Rank r takes every world-th row of the step's block
            // (torch's DistributedSampler), so the ranks together take the rows one device would.
            let mut batches = (0..grad_accum)
                .map(|micro| {
                    let b = step_in_epoch * grad_accum + micro;
                    let picked =
                        (b * batch_size..(b + 1) * batch_size).map(|j| order[j * world + rank]);
                    examples.micro_batch(picked, pad, &device)
                })
                .collect::<Result<Vec<_>>>()?;
            if let Some(coef) = aux_coef {
                // The router loss is weighed against the whole step's targets (every rank's), so
                // that after normalisation it is the coefficient times the micro-batches' mean.
                let mut step_targets = batches.iter().map(|b| b.num_targets).sum::<usize>() as f64;
                if let Some(sm) = &sharded {
                    step_targets = sm.all_reduce_f64(&[step_targets])?[0];
                }
                let weight = coef * step_targets / (grad_accum * world) as f64;
                for b in &mut batches {
                    b.aux_loss_weight = Some(weight);
                }
            }
            let exits = early_exit
                .as_ref()
                .map(|e| e.exits_at(global_step, num_layers))
                .unwrap_or_default();
            if early_exit.is_some() {
                let layers: Vec<usize> = exits.iter().map(|&(l, _)| l).collect();
                if lead
                    && last_exits.as_ref() != Some(&layers)
                    && (verbose_exits || last_exits.is_none())
                {
                    bar.suspend(|| eprintln!("Early-exit loss on the inputs of layers {layers:?}"));
                }
                last_exits = Some(layers);
            }
            for mut batch in batches {
                if early_exit.is_some() || layer_dropout.is_some() {
                    let rows = batch.input_ids.dim(0)?;
                    batch.layer_skip = Some(crate::step::LayerSkip {
                        exits: exits.clone(),
                        kept_rows: match layer_dropout.as_mut() {
                            Some(d) => d.draw(rows),
                            None => Vec::new(),
                        },
                    });
                }
                if let Some(t) = &teacher {
                    batch.distill = Some(t.distill(&batch)?);
                }
                if let Some(loss) = preference_loss {
                    let r = reference.as_ref();
                    let reference_logps = reference_logps(r, &mut model, sharded.as_mut(), &batch)?;
                    batch.preference = Some(Preference {
                        reference_logps,
                        loss,
                    });
                }
                let step = match &mut sharded {
                    Some(sm) => forward_backward_sharded(&mut model, sm, &batch, checkpointing)?,
                    None => {
                        forward_backward(&model, &batch, &param_refs, &mut grads, checkpointing)?
                    }
                };
                losses += step;
                targets += batch.num_targets;
                tokens += batch.num_tokens;
            }
            // This rank's own tokens: torchtune's `tokens_per_second_per_gpu`.
            let local_tokens = tokens;
            if let Some(sm) = &mut sharded {
                grads = reduce_step(sm, &mut losses, &mut targets, &mut tokens)?;
            }
            let grad_norm = optimizer_step(
                optimizer.as_mut(),
                grads,
                &param_refs,
                targets,
                clip,
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
            if let (Some(logger), true) = (logger.as_mut(), global_step.is_multiple_of(log_every)) {
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
                if teacher.is_some() {
                    // torchtune's KD recipes log both parts of the loss.
                    let per_target = |s: f64| if targets > 0 { s / targets as f64 } else { 0.0 };
                    metrics.push(("class_loss", per_target(losses.class)));
                    metrics.push(("kd_loss", per_target(losses.kd)));
                }
                if mode.preference() {
                    // torchtune's DPO metrics, as means over the step's pairs (every rank's).
                    metrics.extend(losses.pairs.metrics(targets));
                }
                if aux_coef.is_some() {
                    // transformers' `aux_loss`: the micro-batches' mean (every rank's).
                    metrics.push(("aux_loss", losses.aux / (grad_accum * world) as f64));
                }
                if let Some(n) = grad_norm {
                    metrics.push(("grad_norm", n));
                }
                if log_memory {
                    metrics.push(("peak_memory_rss_mb", peak_rss_mb()));
                }
                logger.log_step(global_step as u64, &metrics)?;
            }
            if let Some((every, val_rows, val_batch, val_batches)) = &validation {
                if global_step.is_multiple_of(*every) {
                    // Dropout off while validating, as torchtune's `model.eval()`.
                    ferrotune_models::lora::set_training(&mut model, false);
                    let val_loss = validation::validation_loss(
                        &mut model,
                        sharded.as_mut(),
                        val_rows,
                        (*val_batch, *val_batches),
                        pad,
                        &device,
                    )?;
                    ferrotune_models::lora::set_training(&mut model, !mode.full());
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
            if let Some(n) = save_every {
                if global_step.is_multiple_of(n) && !end_of_epoch {
                    let st = TrainState {
                        epoch,
                        step_in_epoch: step_in_epoch + 1,
                        global_step,
                        ..start.clone()
                    };
                    bar.suspend(|| {
                        saver.save(
                            &mut model,
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
        // ------------------------------------------------------------ checkpoint
        let st = start.after_epoch(epoch, global_step);
        saver.save(
            &mut model,
            sharded.as_mut(),
            &format!("epoch_{epoch}"),
            st,
            optimizer.as_ref(),
        )?;
    }
    if let Some(mut logger) = logger {
        logger.close()?;
    }
    if let Some((store, ..)) = group {
        drop(sharded);
        store.barrier("end of training")?;
        store.shutdown()?;
    }
    Ok(())
}
