//! `ppo_full_finetune_single_device`: RLHF with PPO from a reward model, as torchtune's recipe
//! runs it. Setup (policy, frozen reference policy, trained value model, frozen reward model;
//! one optimizer over policy and value), the loop (generate a batch of trajectories, score them,
//! estimate advantages, then PPO epochs over minibatches), and checkpoints of the policy and
//! the value model at the end of each epoch.
//!
//! The trajectory's old log probabilities come from a forward pass of the policy over the
//! generated sequences (torchtune keeps the logits of its generation loop; the two agree to
//! rounding). Sampling draws from the same distribution as torchtune's but from ferrotune's
//! generator, so sampled responses are not torch's.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use candle_core::Var;
use ferrotune_export::hf::{write_hf_model, ModelFiles};
use ferrotune_models::{peft, CausalLm};

use crate::config::Config;
use crate::recipe::kit::checkpoint::{Saver, MAX_SHARD_BYTES};
use crate::recipe::kit::data::epoch_order;
use crate::recipe::kit::push;
use crate::recipe::kit::report::kill_if_asked;
use crate::recipe::kit::rollout::{
    self, approx_kl_sum, backward_from_hidden, host, left_pad, load, masked_logprobs,
    num_stop_tokens, pick, Backward, BeforeTokenizer, LoopSettings, Rollout, RolloutBatching,
    RolloutSettings, StepStats,
};
use crate::recipe::setup;
use crate::recipe::state::{self, TrainState};
use crate::rlhf::{self, PpoLossConfig, PpoTargets};
use crate::step::empty_grads;

mod passes;

use passes::values_from_hidden;
pub use passes::{response_values, trajectory};

/// The recipe's name, as torchtune's.
pub const RECIPE: &str = "ppo_full_finetune_single_device";

/// What shapes trajectories and their rewards (the recipe's top-level keys).
#[derive(Debug, Clone, PartialEq)]
pub struct PpoSettings {
    /// Sampling (every response is generated to `max_generated_tokens`, then cut at its first
    /// stop token) and the tokenizer's ids.
    pub rollout: RolloutSettings,
    /// Responses whose last kept index is below this get `reward_penalty` as their score.
    pub min_response_length: Option<usize>,
    /// Responses without a stop token get `reward_penalty` as their score.
    pub penalise_no_eos: bool,
    pub reward_penalty: f32,
    pub kl_coeff: f64,
    pub gamma: f64,
    pub lmbda: f64,
    pub loss: PpoLossConfig,
}

/// The four models of a PPO run. The reward and reference models never train.
#[derive(Clone, Copy)]
pub struct PpoModels<'a> {
    pub policy: &'a CausalLm,
    pub reference: &'a CausalLm,
    pub value: &'a CausalLm,
    pub reward: &'a CausalLm,
}

/// A batch of generated responses and everything PPO needs from them (torchtune's
/// `Trajectory`): per-token quantities are `[rows][response tokens]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Trajectory {
    /// The responses (as generated, not cut) and their log probabilities.
    pub rollout: Rollout,
    /// The value model's estimates (0 where `value_padding`).
    pub values: Vec<Vec<f32>>,
    /// `response_padding` with each row's `value_seq_idx` kept.
    pub value_padding: Vec<Vec<bool>>,
    pub value_seq_idxs: Vec<usize>,
    /// The reward model's score of each row (or the penalty).
    pub scores: Vec<f32>,
}

impl Trajectory {
    /// The rows `idx`, in that order.
    pub fn select(&self, idx: &[usize]) -> Trajectory {
        Trajectory {
            rollout: self.rollout.select(idx),
            values: pick(&self.values, idx),
            value_padding: pick(&self.value_padding, idx),
            value_seq_idxs: pick(&self.value_seq_idxs, idx),
            scores: pick(&self.scores, idx),
        }
    }

    /// These rows followed by `other`'s (same context length).
    fn extend(&mut self, other: Trajectory) {
        self.rollout.extend(other.rollout);
        self.values.extend(other.values);
        self.value_padding.extend(other.value_padding);
        self.value_seq_idxs.extend(other.value_seq_idxs);
        self.scores.extend(other.scores);
    }
}

/// One PPO micro-batch's statistics (torchtune's `PPOStats`), already divided by the gradient
/// accumulation steps as torchtune divides them: the recipe's own loss term is the value loss.
pub type PpoStats = StepStats;

/// torchtune's `ppo_step`: the loss of `batch` (whose `advantages` and `returns` are given) under
/// the current policy and value model, its gradients (of `loss / grad_accum`) back-propagated by
/// `back`: the policy and the value model one after the other (the loss is a sum of a part of
/// each).
#[allow(clippy::too_many_arguments)]
pub fn ppo_step(
    policy: &CausalLm,
    value: &CausalLm,
    batch: &Trajectory,
    advantages: &[Vec<f32>],
    returns: &[Vec<f32>],
    s: &PpoSettings,
    grad_accum: usize,
    mut back: Backward<'_>,
) -> Result<PpoStats> {
    let r = &batch.rollout;
    let (ctx, pad) = (r.context_length, s.rollout.pad_id);
    let rows = &r.query_responses;
    let keep = rlhf::kept(&r.response_padding);
    let value_keep = rlhf::kept(&batch.value_padding);
    let targets = PpoTargets {
        old_logprobs: &r.logprobs,
        advantages,
        old_values: &batch.values,
        returns,
        keep: &keep,
        value_keep: &value_keep,
    };
    let n = grad_accum as f64;
    // Cut tokens get log probability 1 and value 0, as torchtune's in-place fills (no gradient).
    let mut policy_part = None;
    backward_from_hidden(policy, rows, pad, &mut back, |hidden| {
        let lp = masked_logprobs(
            policy,
            hidden,
            rows,
            ctx,
            s.rollout.temperature,
            &r.response_padding,
        )?;
        let out = rlhf::ppo_policy_loss(&lp, targets, s.loss)?;
        let loss = (&out.loss / n)?;
        policy_part = Some((out, host(&lp)?));
        Ok(loss)
    })?;
    let mut value_part = None;
    backward_from_hidden(value, rows, pad, &mut back, |hidden| {
        let raw = values_from_hidden(value, hidden, ctx)?;
        let v = (&raw * rollout::mask_tensor(&batch.value_padding, false, raw.device())?)?;
        let out = rlhf::ppo_value_loss(&v, targets, s.loss)?;
        let loss = (&out.loss / n)?;
        value_part = Some(out);
        Ok(loss)
    })?;
    let (policy_out, new_lp) = policy_part.expect("the head ran");
    let value_out = value_part.expect("the head ran");
    let (kl_sum, count) = approx_kl_sum(&new_lp, &r.logprobs);
    let total = policy_out.policy_loss as f64 + s.loss.value_coeff * value_out.value_loss as f64;
    Ok(PpoStats {
        loss: total / n,
        policy_loss: policy_out.policy_loss as f64 / n,
        value_or_kl_loss: value_out.value_loss as f64 / n,
        ratios: policy_out.ratios as f64 / n,
        clipfrac: policy_out.clipfrac as f64 / n,
        approx_policy_kl: kl_sum / count.max(1) as f64 / n,
    })
}

/// Checks that `model` (from `section`) is a single-output sequence classifier.
fn require_scalar_head(cfg: &Config, section: &str, model: &CausalLm, path: &Path) -> Result<()> {
    match model.config.score_labels {
        Some(1) => Ok(()),
        Some(n) => bail!(
            "{}: {section}: {} is a classifier with {n} labels; PPO's reward and value models \
             give one score (num_labels: 1)",
            cfg.origin,
            path.display()
        ),
        None => bail!(
            "{}: {section}: {} is not a reward model: its config.json must name a \
             *ForSequenceClassification architecture with a `score` head (num_labels: 1)",
            cfg.origin,
            path.display()
        ),
    }
}

/// The recipe's sampling and reward settings from the config, with torchtune's defaults and
/// checks, and `stop_token_ids` as given. The pad id (0 here) and, unless given, the stop tokens
/// are the tokenizer's, filled in once it is loaded.
fn settings(cfg: &Config) -> Result<BeforeTokenizer<PpoSettings>> {
    let o = &cfg.origin;
    let (rollout, stop_token_ids) = RolloutSettings::parse(cfg, || {
        cfg.usize("max_generated_tokens")?
            .ok_or_else(|| anyhow!("{o}: 'max_generated_tokens' is required"))
    })?;
    let loss = match cfg.get("loss") {
        Some(section) if !section.is_null() => {
            let component = cfg.str("loss._component_")?.unwrap_or_default();
            if !component.ends_with("PPOLoss") {
                bail!("{o}: loss '{component}': the PPO recipe takes torchtune.rlhf.loss.PPOLoss");
            }
            let d = PpoLossConfig::default();
            PpoLossConfig {
                epsilon: cfg.f64("loss.epsilon")?.unwrap_or(d.epsilon),
                value_clip_range: cfg
                    .f64("loss.value_clip_range")?
                    .unwrap_or(d.value_clip_range),
                value_coeff: cfg.f64("loss.value_coeff")?.unwrap_or(d.value_coeff),
            }
        }
        _ => PpoLossConfig::default(),
    };
    let required = |k: &str| -> Result<f64> {
        cfg.f64(k)?
            .ok_or_else(|| anyhow!("{o}: '{k}' is required by {RECIPE}"))
    };
    let settings = PpoSettings {
        rollout,
        min_response_length: cfg.usize("min_response_length")?,
        penalise_no_eos: cfg.bool("penalise_no_eos")?.unwrap_or(false),
        reward_penalty: cfg.f64("reward_penalty")?.unwrap_or(0.0) as f32,
        kl_coeff: required("kl_coeff")?,
        gamma: required("gamma")?,
        lmbda: required("lmbda")?,
        loss,
    };
    Ok(BeforeTokenizer::new(settings, stop_token_ids, |s| {
        &mut s.rollout
    }))
}

/// How a run divides its batches (torchtune's `_setup_training_parameters`).
#[derive(Debug, Clone, Copy, PartialEq)]
struct Batching {
    rollout: RolloutBatching,
    ppo_batch_size: usize,
    grad_accum: usize,
    total_steps: usize,
}

fn batching(cfg: &Config) -> Result<Batching> {
    let o = &cfg.origin;
    let per_batch = RolloutBatching::parse(cfg, RECIPE)?;
    let (batch_size, forward_batch_size) = (per_batch.batch_size, per_batch.forward_batch_size);
    let ppo_batch_size = cfg.usize("ppo_batch_size")?.unwrap_or(batch_size);
    let grad_accum = cfg.usize("gradient_accumulation_steps")?.unwrap_or(1);
    let num_steps = rollout::required_count(cfg, "num_steps", RECIPE)?;
    if batch_size == 0 || forward_batch_size == 0 || ppo_batch_size == 0 || grad_accum == 0 {
        bail!("{o}: batch_size, forward_batch_size, ppo_batch_size and gradient_accumulation_steps must be at least 1");
    }
    let batch = ("batch_size", batch_size);
    rollout::check_divides(cfg, batch, ("forward_batch_size", forward_batch_size))?;
    rollout::check_divides(cfg, batch, ("ppo_batch_size", ppo_batch_size))?;
    rollout::check_divides(
        cfg,
        ("ppo_batch_size", ppo_batch_size),
        ("gradient_accumulation_steps", grad_accum),
    )?;
    let total_steps = num_steps / batch_size;
    if total_steps == 0 {
        bail!("{o}: num_steps {num_steps} must be at least the batch size {batch_size} (num_steps counts prompts)");
    }
    Ok(Batching {
        rollout: per_batch,
        ppo_batch_size,
        grad_accum,
        total_steps,
    })
}

/// Checks the recipe's own keys without loading anything (for `validate`).
pub fn check_config(cfg: &Config) -> Result<()> {
    Parsed::parse(cfg).map(|_| ())
}

/// The recipe's own keys, read and checked once before anything is loaded.
struct Parsed {
    batching: Batching,
    keys: LoopSettings,
    /// Sampling and rewards, but for the tokenizer's pad id and stop tokens.
    settings: BeforeTokenizer<PpoSettings>,
    /// Where the value model's checkpoints go (`value_checkpointer.output_dir`, else
    /// `{output_dir}/value`).
    value_out: PathBuf,
}

impl Parsed {
    fn parse(cfg: &Config) -> Result<Parsed> {
        let batching = batching(cfg)?;
        let settings = settings(cfg)?;
        let sections = [
            "checkpointer",
            "ref_policy_checkpointer",
            "value_checkpointer",
            "reward_checkpointer",
        ];
        rollout::require_checkpoint_dirs(cfg, &sections, RECIPE)?;
        let keys = LoopSettings::parse(cfg, &["compile", "optimizer_in_bwd"])?;
        let value_out = cfg
            .path("value_checkpointer.output_dir")?
            .unwrap_or(keys.output_dir.join("value"));
        Ok(Parsed {
            batching,
            keys,
            settings,
            value_out,
        })
    }
}

/// Runs the recipe.
pub fn run(cfg: &Config) -> Result<()> {
    // ---------------------------------------------------------------- setup
    let o = cfg.origin.clone();
    let device = setup::device(cfg)?;
    let dtype = setup::dtype(cfg)?;
    let parsed = Parsed::parse(cfg)?;
    let (b, keys) = (parsed.batching, &parsed.keys);
    keys.note_ignored();
    // Each decoder layer recomputed in the backward of the policy and the value model.
    let checkpointing = keys.checkpointing;
    let (output_dir, policy_out) = (&keys.output_dir, &keys.checkpoint_dir);
    let value_out = &parsed.value_out;
    let saved = if keys.resume {
        Some(state::latest_to_resume(&o, policy_out)?)
    } else {
        let (p, r) = (
            setup::checkpoint_path_at(cfg, "checkpointer")?,
            setup::checkpoint_path_at(cfg, "ref_policy_checkpointer")?,
        );
        if p != r {
            bail!(
                "{o}: the policy and the reference policy must start from the same checkpoint \
                 (checkpointer.checkpoint_dir {} vs ref_policy_checkpointer.checkpoint_dir {})",
                p.path.display(),
                r.path.display()
            );
        }
        let dirs = [
            policy_out.as_path(),
            value_out.as_path(),
            output_dir.as_path(),
        ];
        let log = keys.metrics_file.as_deref();
        state::claim_output(&o, &dirs, log, keys.overwrite, true)?;
        None
    };
    let seed = state::run_seed(cfg, saved.as_ref())?;

    // Resuming: the trained weights of both models come from the checkpoint being resumed.
    let resumed_policy = saved.as_ref().map(|s| s.dir.clone());
    let resumed_value = saved
        .as_ref()
        .map(|s| value_out.join(s.dir.file_name().unwrap_or_default()));
    let t0 = Instant::now();
    let (mut policy, policy_source, policy_path) = load(
        cfg,
        "checkpointer",
        "policy_model",
        resumed_policy.as_deref(),
        dtype,
        &device,
    )?;
    let mut tokenizer = setup::tokenizer(cfg, &policy_path)?;
    tokenizer.feed_model(policy.config.vocab_size);
    let (reference, _, _) = load(
        cfg,
        "ref_policy_checkpointer",
        "policy_model",
        None,
        dtype,
        &device,
    )?;
    let (mut value, value_source, value_path) = load(
        cfg,
        "value_checkpointer",
        "reward_and_value_model",
        resumed_value.as_deref(),
        dtype,
        &device,
    )?;
    let (reward, _, reward_path) = load(
        cfg,
        "reward_checkpointer",
        "reward_and_value_model",
        None,
        dtype,
        &device,
    )?;
    for (section, m) in [
        ("checkpointer", &policy),
        ("ref_policy_checkpointer", &reference),
    ] {
        m.config
            .require_language_model()
            .map_err(|e| anyhow!("{o}: {section}: {e}"))?;
    }
    require_scalar_head(cfg, "value_checkpointer", &value, &value_path)?;
    require_scalar_head(cfg, "reward_checkpointer", &reward, &reward_path)?;
    for (name, m) in [("value", &value), ("reward", &reward)] {
        if m.config.vocab_size < policy.config.vocab_size {
            bail!(
                "{o}: the {name} model's vocabulary ({} tokens) is smaller than the policy's ({}): \
                 it must read every token the policy generates",
                m.config.vocab_size,
                policy.config.vocab_size
            );
        }
    }
    eprintln!(
        "Policy, reference, value and reward models loaded in {:.1}s on {device:?} as {dtype:?}",
        t0.elapsed().as_secs_f64()
    );
    let pad = setup::pad_id(&tokenizer, &policy.config);
    let stops = setup::stop_ids(&tokenizer, &policy.config);
    let s = parsed.settings.with(pad, stops);
    setup::warn_if_eos_does_not_stop(&tokenizer, &s.rollout.stop_token_ids);
    // Every response runs to max_generated_tokens; it is cut at its first stop token after.
    let sampling = s.rollout.sampling();

    let mut params = policy.make_all_trainable()?;
    let value_params: Vec<(String, Var)> = value
        .make_all_trainable()?
        .into_iter()
        .map(|(n, v)| (format!("value.{n}"), v))
        .collect();
    params.extend(value_params);
    let trainable: usize = params.iter().map(|(_, v)| v.elem_count()).sum();
    eprintln!("{trainable} trainable parameters (policy and value model)");
    if let Some(note) = setup::optimizer_note(cfg)? {
        eprintln!("{note}");
    }
    let mut optimizer = setup::optimizer(cfg, params.clone())?;

    let rows = setup::dataset(cfg, &tokenizer, policy.config.position_limit())?.rows;
    // torchtune's loader drops the last incomplete batch.
    let batches_per_epoch = rows.len() / b.rollout.batch_size;
    if batches_per_epoch == 0 {
        bail!(
            "{o}: the dataset has {} prompts, fewer than one batch (batch_size {})",
            rows.len(),
            b.rollout.batch_size
        );
    }
    let epochs = b.total_steps.div_ceil(batches_per_epoch);
    if b.total_steps < batches_per_epoch {
        eprintln!(
            "warning: there are fewer total steps ({}, num_steps // batch_size) than batches ({batches_per_epoch}) in the dataset: training stops after {} steps without intermediate checkpoints",
            b.total_steps, b.total_steps
        );
    }
    let minibatches = b.rollout.batch_size / b.ppo_batch_size;
    let start = state::start_or_resume(
        TrainState::fresh(RECIPE, seed, rows.len(), batches_per_epoch),
        saved.as_ref(),
        optimizer.as_mut(),
        None,
        &device,
    )?;
    let mut logger = state::open_run_log(cfg, output_dir, &start)?;
    // The policy's checkpoints: HF folders of the whole model, with the tokenizer files.
    let saver = Saver::hf(policy_out, &policy_source, &tokenizer, dtype);
    let log_every = keys.log_every;
    eprintln!(
        "PPO: {} steps of {} prompts, {epochs} epoch(s); {} PPO epoch(s) of {minibatches} minibatch(es)",
        b.total_steps, b.rollout.batch_size, b.rollout.ppo_epochs
    );

    // ---------------------------------------------------------------- training loop
    let mut global_step = start.global_step;
    let mut steps_run = start.epoch * batches_per_epoch;
    let shuffle = keys.shuffle;
    // `push_to_hub`: checked before training; the last policy checkpoint goes up at the end.
    let (push, mut last_dir) = (push::push_request(cfg)?, None);
    for epoch in start.epoch..epochs {
        let order = epoch_order(rows.len(), shuffle, seed, epoch);
        let mut done = false;
        for batch_idx in 0..batches_per_epoch {
            let prompts: Vec<Vec<u32>> = order[batch_idx * b.rollout.batch_size..]
                [..b.rollout.batch_size]
                .iter()
                .map(|&i| rows[i].input_ids.clone())
                .collect();
            if let Some(i) = prompts.iter().position(Vec::is_empty) {
                bail!(
                    "{o}: dataset row {} has no tokens: PPO needs a prompt",
                    order[batch_idx * b.rollout.batch_size + i]
                );
            }
            let padded = left_pad(&prompts, pad);
            let num_tokens = padded.len() * padded[0].len();
            // Trajectories, forward_batch_size prompts at a time.
            let t_traj = Instant::now();
            // Trajectories take no gradient: generated and scored by copies that record none.
            let (policy_ng, value_ng) = (policy.detached(), value.detached());
            let mut traj: Option<Trajectory> = None;
            for (chunk_idx, start_row) in (0..b.rollout.batch_size)
                .step_by(b.rollout.forward_batch_size)
                .enumerate()
            {
                let end = start_row + b.rollout.forward_batch_size;
                let sample_seed =
                    rollout::sample_seed(seed, steps_run * b.rollout.batch_size + chunk_idx);
                let responses =
                    rollout::sample(&policy_ng, &prompts[start_row..end], &sampling, sample_seed)?;
                let models = PpoModels {
                    policy: &policy_ng,
                    reference: &reference,
                    value: &value_ng,
                    reward: &reward,
                };
                let part = trajectory(models, &padded[start_row..end], &responses, &s)?;
                match &mut traj {
                    Some(t) => t.extend(part),
                    None => traj = Some(part),
                }
            }
            let traj = traj.expect("batch_size >= 1");
            let traj_s = t_traj.elapsed().as_secs_f64();
            let (rewards, kl, kl_rewards) = rlhf::rewards_ppo(
                &traj.scores,
                &traj.rollout.logprobs,
                &traj.rollout.ref_logprobs,
                s.kl_coeff,
                &traj.value_seq_idxs,
            );
            let keep = rlhf::kept(&traj.rollout.response_padding);
            let (advantages, returns) =
                rlhf::estimate_advantages(&traj.values, &rewards, s.gamma, s.lmbda, &keep);

            let t_ppo = Instant::now();
            let mut stats: Vec<PpoStats> = Vec::new();
            let backward_rows = b.ppo_batch_size / b.grad_accum;
            for ppo_epoch in 0..b.rollout.ppo_epochs {
                let perm = ferrotune_data::dataset::shuffled_order(
                    b.rollout.batch_size,
                    seed ^ 0x5050_5050,
                    (steps_run * b.rollout.ppo_epochs + ppo_epoch) as u64,
                );
                for mini in perm.chunks(b.ppo_batch_size) {
                    let mut grads = empty_grads()?;
                    let mut mini_stats = PpoStats::default();
                    for micro in mini.chunks(backward_rows) {
                        let part = traj.select(micro);
                        let back = Backward {
                            params: &params,
                            grads: &mut grads,
                            checkpointing,
                        };
                        mini_stats += ppo_step(
                            &policy,
                            &value,
                            &part,
                            &pick(&advantages, micro),
                            &pick(&returns, micro),
                            &s,
                            b.grad_accum,
                            back,
                        )?;
                    }
                    optimizer.step(&grads)?;
                    stats.push(mini_stats);
                    global_step += 1;
                }
            }
            let ppo_s = t_ppo.elapsed().as_secs_f64();
            steps_run += 1;
            if steps_run.is_multiple_of(log_every) {
                let metrics =
                    step_metrics(&traj, &stats, &kl, &kl_rewards, num_tokens, traj_s, ppo_s);
                logger.log_step(global_step as u64, &metrics)?;
                let shown = "loss:4 policy_loss:4 value_loss:4 scores:4 kl:4 response_lengths:1";
                let line = rollout::step_line(steps_run, b.total_steps, &metrics, shown);
                eprintln!("{line}");
            }
            if steps_run == b.total_steps {
                done = true;
                break;
            }
        }
        // ------------------------------------------------------------ checkpoint
        let name = format!("epoch_{epoch}");
        let st = start.after_epoch(epoch, global_step);
        let value_dir = state::write_folder(value_out, &name, |dir| {
            let files = ModelFiles {
                config: &value.config,
                tensors: &peft::merged_tensors(&value)?,
                dtype,
                max_shard_bytes: MAX_SHARD_BYTES,
                source: &value_source,
                tokenizer: None,
            };
            write_hf_model(dir, &files)
        })?;
        let policy_dir = saver.write(&policy, &name, &st, optimizer.state_dict()?)?;
        eprintln!(
            "Checkpoint saved: policy {}, value model {}",
            policy_dir.display(),
            value_dir.display()
        );
        last_dir = Some(policy_dir);
        kill_if_asked(global_step, 0);
        if done {
            break;
        }
    }
    logger.flush()?;
    push::push_final(&push, last_dir.as_deref())
}

/// The metrics torchtune's PPO recipe logs for one step.
fn step_metrics(
    traj: &Trajectory,
    stats: &[PpoStats],
    kl: &[Vec<f32>],
    kl_rewards: &[Vec<f32>],
    num_tokens: usize,
    traj_s: f64,
    ppo_s: f64,
) -> Vec<(&'static str, f64)> {
    let rows = traj.scores.len().max(1) as f64;
    let row_sums = |m: &[Vec<f32>]| -> f64 {
        m.iter()
            .map(|r| r.iter().map(|&x| x as f64).sum::<f64>())
            .sum::<f64>()
            / rows
    };
    let scores = traj.scores.iter().map(|&x| x as f64).sum::<f64>() / rows;
    let kl_reward = row_sums(kl_rewards);
    let mut metrics = vec![
        ("scores", scores),
        (
            "num_stop_tokens",
            num_stop_tokens(&traj.rollout.response_padding),
        ),
        ("rlhf_reward", scores + kl_reward),
        ("kl", row_sums(kl)),
        ("kl_reward", kl_reward),
    ];
    metrics.extend(rollout::step_metrics(
        stats,
        "value_loss",
        &traj.rollout.seq_lens,
    ));
    metrics.extend([
        (
            "tokens_per_second_per_gpu_trajectory",
            num_tokens as f64 / traj_s.max(1e-9),
        ),
        (
            "tokens_per_second_per_gpu_ppo",
            num_tokens as f64 / ppo_s.max(1e-9),
        ),
    ]);
    metrics
}
