//! `dev/grpo_full_finetune_distributed`: reasoning trained by GRPO (group relative policy
//! optimization) with verifiable rewards, as torchtune's dev recipe runs it. Setup (the policy,
//! every weight trained, and a frozen reference policy; GSM8K problems), the loop (for each
//! batch of prompts: `grpo_samples` sampled completions per prompt, their shaped correctness
//! rewards, group-relative advantages, then `ppo_epochs` optimizer steps on the batch), and a
//! checkpoint of the policy every `save_every_n_epochs` epochs. With a `lora_*` model builder only
//! LoRA adapters train and the reference is the base (the policy with its adapters disabled).
//!
//! Sampling draws from the same distribution as torchtune's but from ferrotune's generator, so
//! sampled completions are not torch's; everything after sampling (log probabilities, rewards,
//! advantages, losses, updates) is torchtune's arithmetic (tests/it/grpo.rs checks it against
//! torchtune's code on fixed completions).
//!
//! Launched as several ranks (`--nproc-per-node N`), the ranks run data-parallel as torchtune's
//! do: each takes its share of every epoch's problems (torch's `DistributedSampler`, `batch_size`
//! problems per rank), samples and scores its own completions, and the gradients of the ranks'
//! losses are averaged before every optimizer step, so that every rank holds the same policy.
//! Full fine-tuning shards the policy's gradients and optimizer state and the reference's weights
//! over the ranks (FSDP; memory, not numbers); LoRA keeps whole copies (DDP). A completion's
//! sampling seed follows its prompt's place in the epoch, so N ranks of `batch_size` B sample
//! what one process of batch size N×B samples.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Result};
use candle_core::{Device, Tensor};
use ferrotune_data::dataset::{build_reasoning_dataset, ReasoningProblem};
use ferrotune_data::Tokenizer;
use ferrotune_models::{peft, CausalLm};

use crate::clip::{clip_grad_norm, scale_grads};
use crate::config::Config;
use crate::dist::comm::Collectives;
use crate::dist::fsdp::{CommQueue, ShardedModel, Sharding};
use crate::dist::store::Store;
use crate::grpo::{self, BatchTotals, GrpoLossConfig, GrpoLossKind};
use crate::recipe::kit::checkpoint::Saver;
use crate::recipe::kit::data::epoch_order;
use crate::recipe::kit::model::setup_adapters;
use crate::recipe::kit::report::{kill_if_asked, report_memory};
use crate::recipe::kit::rollout::{
    self, approx_kl_sum, backward_from_hidden, context_length, host, ids_tensor, left_pad, load,
    logprobs_from_hidden, masked_logprobs, num_stop_tokens, padded_layout, response_logprobs,
    Backward, BeforeTokenizer, LoopSettings, Rollout, RolloutBatching, RolloutSettings, StepStats,
};
use crate::recipe::kit::session::Session;
use crate::recipe::kit::{push, ranks};
use crate::recipe::setup;
use crate::recipe::state::{self, TrainState};
use crate::reward::{RewardBatch, RewardSet, RewardSpec};
use crate::rlhf;
use crate::step::empty_grads;

/// The recipe's name, as torchtune's.
pub const RECIPE: &str = "dev/grpo_full_finetune_distributed";

/// What shapes completions and the loss (the recipe's top-level keys and `loss`).
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoSettings {
    /// Completions sampled per prompt (the group).
    pub grpo_samples: usize,
    /// Sampling (each completion ends at its first stop token) and the tokenizer's ids.
    pub rollout: RolloutSettings,
    pub loss: GrpoLossConfig,
}

/// A batch of completions and what GRPO needs from them (torchtune's `GRPOTrajectory`); rows
/// are prompt-major: the `grpo_samples` completions of prompt 0, then those of prompt 1, ...
#[derive(Debug, Clone, PartialEq)]
pub struct GrpoTrajectory {
    /// The completions (each padded after its end to the longest) and their log probabilities.
    pub rollout: Rollout,
    pub rewards: Vec<f32>,
    pub successes: Vec<f32>,
    pub advantages: Vec<f32>,
    /// TRL's `num_items_in_batch` (DAPO's normaliser): the kept completion tokens of every rank's
    /// batch over the number of ranks; this batch's kept tokens on one rank.
    pub num_items: f64,
    /// The loss takes the current log probabilities, detached, as the sampling policy's (TRL
    /// with `num_iterations: 1`) instead of `rollout.logprobs`.
    pub old_is_current: bool,
}

/// The reference policy: a model of its own (whole, or sharded over the ranks and run one
/// gathered layer at a time), or (LoRA) the policy with its adapters disabled.
pub enum Reference<'a> {
    Model(&'a CausalLm),
    Sharded(&'a mut CausalLm, &'a mut ShardedModel),
    AdaptersDisabled,
    /// No reference (TRL's `beta: 0`): no pass is run, and the reference log probabilities are
    /// zeros the loss does not read.
    None,
}

/// Builds the trajectory of `completions` (one row per completion, prompt-major, each cut or
/// padded as generated) to the left-padded `prompts` (one per group): log probabilities under
/// the policy and the reference, completions cut at their first stop token, their rewards
/// against `answers` (one per group: torchtune's shaped correctness reward) and the
/// group-relative advantages.
pub fn trajectory(
    policy: &mut CausalLm,
    reference: Reference<'_>,
    tokenizer: &Tokenizer,
    prompts: &[Vec<u32>],
    completions: &[Vec<u32>],
    answers: &[String],
    s: &GrpoSettings,
) -> Result<GrpoTrajectory> {
    if answers.len() != prompts.len() {
        bail!(
            "GRPO: {} prompts need as many answers, got {}",
            prompts.len(),
            answers.len()
        );
    }
    let scored = rollout_of(policy, reference, tokenizer, prompts, completions, s)?;
    let g = s.grpo_samples;
    let (rewards, successes): (Vec<f32>, Vec<f32>) = scored
        .texts
        .iter()
        .enumerate()
        .map(|(row, text)| grpo::shaped_correctness_reward(&answers[row / g], text))
        .unzip();
    scored.into_trajectory(rewards, successes, g, grpo::ScaleRewards::Group)
}

/// A rollout and its completions' text: what rewards read.
pub struct ScoredRollout {
    pub rollout: Rollout,
    /// Each row's kept completion tokens (up to and including its first stop token).
    pub kept_ids: Vec<Vec<u32>>,
    /// Each row's kept tokens decoded, skipping special tokens (as torchtune and TRL decode).
    pub texts: Vec<String>,
}

impl ScoredRollout {
    /// The trajectory with `rewards` (one per row) and the advantages `scale` gives them.
    pub fn into_trajectory(
        self,
        rewards: Vec<f32>,
        successes: Vec<f32>,
        group: usize,
        scale: grpo::ScaleRewards,
    ) -> Result<GrpoTrajectory> {
        let advantages = grpo::scaled_advantages(&rewards, group, scale)?;
        let num_items = rlhf::kept(&self.rollout.response_padding)
            .iter()
            .flatten()
            .filter(|&&k| k)
            .count() as f64;
        Ok(GrpoTrajectory {
            rollout: self.rollout,
            rewards,
            successes,
            advantages,
            num_items,
            old_is_current: false,
        })
    }
}

/// The rollout of `completions` (one row per completion, prompt-major, each cut or padded as
/// generated) to the left-padded `prompts` (one per group): log probabilities under the policy
/// and the reference, completions cut at their first stop token, and their text.
pub fn rollout_of(
    policy: &mut CausalLm,
    reference: Reference<'_>,
    tokenizer: &Tokenizer,
    prompts: &[Vec<u32>],
    completions: &[Vec<u32>],
    s: &GrpoSettings,
) -> Result<ScoredRollout> {
    let ctx = context_length(prompts, "GRPO")?;
    let g = s.grpo_samples;
    if completions.len() != prompts.len() * g {
        bail!(
            "GRPO: {} prompts need {} completions, got {}",
            prompts.len(),
            prompts.len() * g,
            completions.len()
        );
    }
    // Every completion padded to the longest, so the batch is one rectangle.
    let width = completions.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let mut responses: Vec<Vec<u32>> = completions
        .iter()
        .map(|c| {
            let mut r = c.clone();
            r.resize(width, s.rollout.pad_id);
            r
        })
        .collect();
    let query_responses: Vec<Vec<u32>> = responses
        .iter()
        .enumerate()
        .map(|(row, r)| [prompts[row / g].as_slice(), r].concat())
        .collect();
    let (pad, t) = (s.rollout.pad_id, s.rollout.temperature);
    let logprobs = host(&response_logprobs(policy, &query_responses, ctx, pad, t)?)?;
    let ref_logprobs = match reference {
        Reference::Model(m) => host(&response_logprobs(m, &query_responses, ctx, pad, t)?)?,
        Reference::Sharded(m, sm) => {
            let ids = ids_tensor(&query_responses, m.device())?;
            let layout = padded_layout(&query_responses, pad);
            host(&sm.inference_pass(m, &ids, &layout, false, |m, hidden| {
                logprobs_from_hidden(m, hidden, &query_responses, ctx, t)
            })?)?
        }
        Reference::AdaptersDisabled => peft::with_adapters_disabled(policy, |m| {
            host(&response_logprobs(m, &query_responses, ctx, pad, t)?)
        })?,
        Reference::None => vec![vec![0f32; width]; query_responses.len()],
    };
    let rollout = Rollout::cut(
        query_responses,
        ctx,
        logprobs,
        ref_logprobs,
        &mut responses,
        &s.rollout,
    );
    let mut kept_ids = Vec::with_capacity(responses.len());
    let mut texts = Vec::with_capacity(responses.len());
    for (r, cut) in responses.iter().zip(&rollout.response_padding) {
        // torchtune decodes skipping special tokens and stopping at EOS: the kept tokens.
        let kept: Vec<u32> = r
            .iter()
            .zip(cut)
            .filter(|(_, &c)| !c)
            .map(|(&id, _)| id)
            .collect();
        texts.push(tokenizer.decode(&kept, true)?);
        kept_ids.push(kept);
    }
    Ok(ScoredRollout {
        rollout,
        kept_ids,
        texts,
    })
}

/// One optimizer step's statistics (torchtune's `GRPOStats`): the recipe's own loss term is the
/// KL loss.
pub type GrpoStats = StepStats;

/// torchtune's `grpo_step`: the loss of the whole trajectory under the current policy, its
/// gradient back-propagated by `back`. Rows go through the model `rows_per_pass` at a time (each
/// part's loss is its share of the batch's, so the sum is torchtune's one-pass loss).
pub fn grpo_step(
    policy: &CausalLm,
    traj: &GrpoTrajectory,
    s: &GrpoSettings,
    rows_per_pass: usize,
    mut back: Backward<'_>,
) -> Result<GrpoStats> {
    let r = &traj.rollout;
    let keep = rlhf::kept(&r.response_padding);
    let totals = BatchTotals {
        items: traj.num_items,
        ..BatchTotals::of(&keep)
    };
    let ctx = r.context_length;
    let mut stats = GrpoStats::default();
    let (mut kl_sum, mut count) = (0f64, 0usize);
    let rows = r.query_responses.len();
    for start in (0..rows).step_by(rows_per_pass.max(1)) {
        let end = (start + rows_per_pass).min(rows);
        let part_rows = &r.query_responses[start..end];
        let part_keep = &keep[start..end];
        let padding = &r.response_padding[start..end];
        let mut new_lp = None;
        let mut part = None;
        backward_from_hidden(policy, part_rows, s.rollout.pad_id, &mut back, |hidden| {
            let lp = masked_logprobs(
                policy,
                hidden,
                part_rows,
                ctx,
                s.rollout.temperature,
                padding,
            )?;
            let current;
            let old = match traj.old_is_current {
                true => {
                    current = host(&lp)?;
                    &current[..]
                }
                false => &r.logprobs[start..end],
            };
            let out = grpo::grpo_loss(
                &lp,
                old,
                &r.ref_logprobs[start..end],
                &traj.advantages[start..end],
                part_keep,
                s.loss,
                totals,
            )?;
            new_lp = Some(host(&lp)?);
            let loss = out.loss.clone();
            part = Some(out);
            Ok(loss)
        })?;
        let out = part.expect("the head ran");
        stats.loss += out.loss.to_scalar::<f32>()? as f64;
        stats.policy_loss += out.policy_loss;
        stats.value_or_kl_loss += out.kl_loss;
        stats.ratios += out.ratios;
        stats.clipfrac += out.clipfrac;
        let (sum, n) = approx_kl_sum(&new_lp.expect("the head ran"), &r.logprobs[start..end]);
        kl_sum += sum;
        count += n;
    }
    stats.approx_policy_kl = kl_sum / count.max(1) as f64;
    Ok(stats)
}

/// Samples `grpo_samples` completions of each of `prompts` (unpadded) with the policy: each ends
/// at its first stop token or after `max_generated_tokens`.
fn sample_completions(
    policy: &CausalLm,
    prompts: &[Vec<u32>],
    s: &GrpoSettings,
    seed: u64,
) -> Result<Vec<Vec<u32>>> {
    let rows: Vec<Vec<u32>> = prompts
        .iter()
        .flat_map(|p| std::iter::repeat_n(p.clone(), s.grpo_samples))
        .collect();
    let sampling = s.rollout.sampling().stopping_at(&s.rollout.stop_token_ids);
    rollout::sample(policy, &rows, &sampling, seed)
}

/// The recipe's sampling and loss settings from the config, with torchtune's defaults and
/// checks, and `stop_token_ids` as given. The pad id (0 here) and, unless given, the stop tokens
/// are the tokenizer's, filled in once it is loaded.
fn settings(cfg: &Config) -> Result<BeforeTokenizer<GrpoSettings>> {
    let o = &cfg.origin;
    // torchtune's key, or TRL's name for it (the same value if both are given).
    let required = |k: &str, trl: &str| -> Result<usize> {
        match (cfg.usize(k)?, cfg.usize(trl)?) {
            (Some(a), Some(b)) if a != b => bail!(
                "{o}: {k} ({a}) and {trl} ({b}) differ: they are one setting (torchtune's and \
                 TRL's names); keep one"
            ),
            (Some(a), _) | (None, Some(a)) => Ok(a),
            (None, None) => rollout::required_count(cfg, k, RECIPE),
        }
    };
    let grpo_samples = required("grpo_samples", "num_generations")?;
    if grpo_samples < 2 {
        bail!(
            "{o}: grpo_samples must be at least 2: advantages are relative to the group's mean \
             and standard deviation"
        );
    }
    let (rollout, stop_token_ids) = RolloutSettings::parse(cfg, || {
        required("max_generated_tokens", "max_completion_length")
    })?;
    let loss = grpo::loss_config(cfg, rollout.max_generated_tokens, RECIPE)?;
    let settings = GrpoSettings {
        grpo_samples,
        rollout,
        loss,
    };
    Ok(BeforeTokenizer::new(settings, stop_token_ids, |s| {
        &mut s.rollout
    }))
}

/// How a run divides its batches: each batch's prompts, and the run's batches and epochs.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Batching {
    rollout: RolloutBatching,
    num_steps: usize,
    epochs: usize,
    save_every_n_epochs: usize,
}

fn batching(cfg: &Config) -> Result<Batching> {
    let get = |k: &str| rollout::required_count(cfg, k, RECIPE);
    let mut per_batch = RolloutBatching::parse(cfg, RECIPE)?;
    // TRL's name for torchtune's ppo_epochs: optimizer steps on each generated batch.
    if let Some(n) = cfg.usize("num_iterations")? {
        if cfg.usize("ppo_epochs")?.is_some_and(|p| p != n) {
            bail!(
                "{}: num_iterations ({n}) and ppo_epochs differ: they are one setting (TRL's \
                 and torchtune's names); keep one",
                cfg.origin
            );
        }
        per_batch.ppo_epochs = n;
    }
    let b = Batching {
        rollout: per_batch,
        num_steps: get("num_steps")?,
        epochs: get("epochs")?,
        save_every_n_epochs: cfg.usize("save_every_n_epochs")?.unwrap_or(1),
    };
    let at_least_one = [
        per_batch.batch_size,
        per_batch.forward_batch_size,
        b.rollout.ppo_epochs,
        b.num_steps,
        b.epochs,
        b.save_every_n_epochs,
    ];
    if at_least_one.contains(&0) {
        bail!(
            "{}: batch_size, forward_batch_size, ppo_epochs (num_iterations), num_steps, epochs \
             and save_every_n_epochs must be at least 1",
            cfg.origin
        );
    }
    rollout::check_divides(
        cfg,
        ("batch_size", per_batch.batch_size),
        ("forward_batch_size", per_batch.forward_batch_size),
    )?;
    Ok(b)
}

/// The recipe's own keys, read and checked once before anything is loaded.
struct Parsed {
    batching: Batching,
    keys: LoopSettings,
    /// Sampling and the loss, but for the tokenizer's pad id and stop tokens.
    settings: BeforeTokenizer<GrpoSettings>,
    /// LoRA: a `lora_*` model builder's keys (`model.lora_attn_modules`) are set.
    lora: bool,
    /// The loss reads a reference policy (not TRL's `beta: 0`).
    reference: bool,
    /// TRL's `scale_rewards` (default group, torchtune's).
    scale_rewards: grpo::ScaleRewards,
    /// `reward_funcs` and `reward_weights` (default torchtune's GSM8K reward).
    rewards: RewardSpec,
    /// The `dataset` section (GSM8K problems).
    dataset: serde_json::Value,
    /// `dist_watchdog_timeout`: how long a rank may send no heartbeat before the others stop.
    watchdog: std::time::Duration,
}

impl Parsed {
    fn parse(cfg: &Config) -> Result<Parsed> {
        let batching = batching(cfg)?;
        let settings = settings(cfg)?;
        let lora = cfg.get("model.lora_attn_modules").is_some();
        let reference = settings.with(0, Vec::new()).loss.needs_reference();
        let sections: &[&str] = match lora || !reference {
            // LoRA's reference is the policy with its adapters disabled; β 0 needs none.
            true => &["checkpointer"],
            false => &["checkpointer", "ref_checkpointer"],
        };
        let scale_rewards = match cfg.get("scale_rewards") {
            None => grpo::ScaleRewards::Group,
            Some(v) => grpo::ScaleRewards::parse(v).map_err(|e| anyhow!("{}: {e}", cfg.origin))?,
        };
        rollout::require_checkpoint_dirs(cfg, sections, RECIPE)?;
        if let Some(c) = cfg.str("reward_fn._component_")? {
            if !c.ends_with("batch_shaped_correctness_reward") {
                bail!(
                    "{}: reward_fn._component_ '{c}' is not supported \
                     (torchtune.dev.grpo.rewards.batch_shaped_correctness_reward)",
                    cfg.origin
                );
            }
        }
        let max_generated = settings.with(0, Vec::new()).rollout.max_generated_tokens;
        let rewards = RewardSpec::parse(cfg, max_generated)?;
        let keys = LoopSettings::parse(cfg, &["compile", "fsdp_cpu_offload"])?;
        let dataset = cfg
            .get("dataset")
            .filter(|v| !v.is_null())
            .ok_or_else(|| anyhow!("{}: 'dataset' is required", cfg.origin))?
            .clone();
        Ok(Parsed {
            batching,
            keys,
            settings,
            lora,
            reference,
            scale_rewards,
            rewards,
            dataset,
            watchdog: crate::recipe::setup::dist_watchdog(cfg)?,
        })
    }
}

/// Checks the recipe's own keys without loading anything (for `validate`).
pub fn check_config(cfg: &Config) -> Result<()> {
    Parsed::parse(cfg).map(|_| ())
}

/// Runs the recipe.
pub fn run(cfg: &Config) -> Result<()> {
    // ---------------------------------------------------------------- setup
    let o = cfg.origin.clone();
    let parsed = Parsed::parse(cfg)?;
    let (b, keys) = (parsed.batching, &parsed.keys);
    // Rank 0 prints, logs and writes checkpoints; every rank samples and trains.
    let session = Session::start(cfg, RECIPE, true)?;
    let (rank, world, lead) = (session.rank, session.world, session.lead());
    let (env, device, dtype) = (&session.env, session.device.clone(), session.dtype);
    let say = |line: String| session.say(line);
    // The store stays open for the whole run: it is also the watchdog that stops every rank
    // when one of them dies.
    let group: Option<(Store, Arc<dyn Collectives>)> = if world > 1 {
        let (store, collectives) = crate::dist::join_group(env, &device, parsed.watchdog)?;
        Some((store, collectives))
    } else {
        None
    };
    let comm = group.as_ref().map(|(_, c)| c.as_ref());
    if lead {
        keys.note_ignored();
    }
    let (push, mut last_dir) = (push::request_on_lead(cfg, lead)?, None);
    let (output_dir, policy_out) = (&keys.output_dir, &keys.checkpoint_dir);
    let checkpointing = keys.checkpointing;
    let saved = match keys.resume {
        true => Some(state::latest_to_resume(&o, policy_out)?),
        false => {
            let dirs = [policy_out.as_path(), output_dir.as_path()];
            let log = keys.metrics_file.as_deref();
            state::claim_output(&o, &dirs, log, keys.overwrite, lead)?;
            None
        }
    };
    let seed = state::run_seed(cfg, saved.as_ref())?;
    let t0 = Instant::now();
    // LoRA (a `lora_*` model builder's keys): the adapters train, the base stays frozen, and the
    // reference is the base itself (the policy with its adapters disabled), as torchtune's LoRA
    // RL recipes do; no second model is loaded. Resuming LoRA reloads the base (the adapter comes
    // from the checkpoint below); resuming full training, the checkpoint's weights.
    let lora = parsed.lora;
    let resumed = saved.as_ref().filter(|_| !lora).map(|s| s.dir.as_path());
    let (mut policy, policy_source, policy_path) =
        load(cfg, "checkpointer", "model", resumed, dtype, &device)?;
    let mut reference = match lora || !parsed.reference {
        true => None,
        false => Some(load(cfg, "ref_checkpointer", "model", None, dtype, &device)?.0),
    };
    for (section, m) in std::iter::once(("checkpointer", &policy))
        .chain(reference.as_ref().map(|m| ("ref_checkpointer", m)))
    {
        m.config
            .require_language_model()
            .map_err(|e| anyhow!("{o}: {section}: {e}"))?;
    }
    if let Some(r) = &reference {
        if r.config.vocab_size != policy.config.vocab_size {
            bail!(
                "{o}: the reference policy's vocabulary ({} tokens) differs from the policy's ({})",
                r.config.vocab_size,
                policy.config.vocab_size
            );
        }
    }
    let mut tokenizer = setup::tokenizer(cfg, &policy_path)?;
    tokenizer.feed_model(policy.config.vocab_size);
    say(format!(
        "Policy and reference policy loaded in {:.1}s on {device:?} as {dtype:?}",
        t0.elapsed().as_secs_f64()
    ));
    let pad = setup::pad_id(&tokenizer, &policy.config);
    let s = parsed
        .settings
        .with(pad, setup::stop_ids(&tokenizer, &policy.config));
    if lead {
        if s.rollout.stop_token_ids.is_empty() {
            eprintln!("warning: no stop tokens (tokenizer or stop_token_ids): every completion runs to max_generated_tokens");
        }
        setup::warn_if_eos_does_not_stop(&tokenizer, &s.rollout.stop_token_ids);
    }
    let lora_config = if lora {
        let lc = setup_adapters(cfg, &mut policy, &policy_path, saved.as_ref(), seed, true)?;
        if !lc.modules_to_save.is_empty() {
            // The reference is the policy with its adapters disabled, which would need the saved
            // modules' original weights kept beside them.
            bail!(
                "{o}: modules_to_save {:?} is not supported by GRPO",
                lc.modules_to_save
            );
        }
        ferrotune_models::lora::set_training(&mut policy, true);
        Some(lc)
    } else {
        None
    };
    // The policy's checkpoints: HF folders; with LoRA the PEFT adapter, and the merged model one
    // folder down (as the LoRA fine-tuning recipes save them) unless it cannot be merged (a LoRA
    // bias on layers without one).
    let saver = Saver::hf(policy_out, &policy_source, &tokenizer, dtype).with_adapters(
        &policy,
        lora_config.as_ref(),
        false,
        &say,
    );
    let params = match lora {
        true => peft::trainable_parameters(&mut policy)?,
        false => policy.make_all_trainable()?,
    };
    let trainable: usize = params.iter().map(|(_, v)| v.elem_count()).sum();
    say(format!("{trainable} trainable parameters"));
    if let (true, Some(note)) = (lead, setup::optimizer_note(cfg)?) {
        eprintln!("{note}");
    }
    // Full fine-tuning on several ranks: the gradients and the optimizer state (with its f32
    // master copies, most of the memory) are sharded over the ranks, as torchtune's FSDP shards
    // them; the policy is gathered whole for each batch's sampling, scoring and optimizer steps
    // (FSDP's SHARD_GRAD_OP). LoRA, and `fsdp_sharding: none`, keep DDP: a LoRA optimizer state
    // is small, and its frozen base would be gathered again for every batch.
    let mut sharded = match &group {
        Some((_, c)) if !lora && setup::sharding(cfg)? != Sharding::None => {
            Some(ShardedModel::with_quant_state(
                &mut policy,
                &params,
                Sharding::GradOp,
                CommQueue::start(c.clone()),
                false,
                setup::quant_config(cfg)?,
            )?)
        }
        _ => None,
    };
    // The frozen reference is sharded with the policy: each rank keeps 1/N of its weights and
    // gathers one layer at a time to score a batch.
    let mut reference_shards = match (&sharded, reference.as_mut()) {
        (Some(sm), Some(r)) => Some(ShardedModel::new(
            r,
            &[],
            Sharding::Full,
            sm.queue().clone(),
            false,
        )?),
        _ => None,
    };
    if let Some((_, c)) = &group {
        say(format!(
            "Distributed: {world} ranks, {} backend, {}",
            c.backend(),
            match sharded {
                Some(_) =>
                    "fsdp_sharding: grad_op (the policy's gradients and optimizer state \
                     sharded, the policy gathered for each batch; the reference sharded)",
                None => "data parallel (gradients averaged over the ranks)",
            }
        ));
    }
    let params = match &sharded {
        Some(sm) => sm.optimizer_params(),
        None => params,
    };
    let mut optimizer = setup::sharded_optimizer(cfg, params.clone(), sharded.as_ref())?;
    let base_lr = optimizer.lr();
    let clip = keys.clip;

    let problems: Vec<ReasoningProblem> =
        build_reasoning_dataset(&parsed.dataset, &tokenizer, std::path::Path::new("."))
            .map_err(|e| anyhow!("{o}: dataset: {e}"))?;
    let mut rewards = RewardSet::start(
        &parsed.rewards,
        std::path::Path::new("."),
        s.rollout.max_generated_tokens,
        s.grpo_samples,
    )
    .map_err(|e| anyhow!("{o}: reward_funcs: {e}"))?;
    // torch's DistributedSampler deals each rank every world-th problem of the epoch's order
    // (padded with its first problems to a multiple of the ranks), and torchtune's loader drops
    // each rank's last incomplete batch.
    let per_rank = problems.len().div_ceil(world);
    let batches_per_epoch = per_rank / b.rollout.batch_size;
    let on_ranks = match world {
        1 => String::new(),
        n => format!(" on each of {n} ranks"),
    };
    if batches_per_epoch == 0 {
        bail!(
            "{o}: the dataset has {} problems, fewer than one batch (batch_size {}{on_ranks})",
            problems.len(),
            b.rollout.batch_size,
        );
    }
    // torchtune's schedule spans every epoch's optimizer steps, whatever num_steps says.
    let schedule = setup::schedule(cfg, b.epochs * batches_per_epoch)?;
    let start = state::start_or_resume(
        TrainState::fresh(RECIPE, seed, problems.len(), batches_per_epoch),
        saved.as_ref(),
        optimizer.as_mut(),
        sharded.as_ref(),
        &device,
    )?;
    let mut logger = match lead {
        true => Some(state::open_run_log(cfg, output_dir, &start)?),
        false => None,
    };
    let log_every = keys.log_every;
    let total_batches = b.num_steps.min(b.epochs * batches_per_epoch);
    say(format!(
        "GRPO: {total_batches} batch(es) of {} prompts × {} completions{on_ranks}, {} optimizer step(s) each",
        b.rollout.batch_size, s.grpo_samples, b.rollout.ppo_epochs
    ));

    // ---------------------------------------------------------------- training loop
    let mut global_step = start.global_step;
    let mut steps_run = start.epoch * batches_per_epoch;
    let shuffle = keys.shuffle;
    let rows_per_pass = b.rollout.forward_batch_size * s.grpo_samples;
    // TRL with one iteration a batch takes the current log probabilities, detached, as the
    // sampling policy's: ratios exactly 1 (whatever rounding the two passes differ by).
    let on_policy = matches!(s.loss.kind, GrpoLossKind::Trl(_)) && b.rollout.ppo_epochs == 1;
    for epoch in start.epoch..b.epochs {
        let order = epoch_order(problems.len(), shuffle, seed, epoch);
        let mut done = false;
        for batch_idx in 0..batches_per_epoch {
            let picked: Vec<usize> = (0..b.rollout.batch_size)
                .map(|i| {
                    order[((batch_idx * b.rollout.batch_size + i) * world + rank) % order.len()]
                })
                .collect();
            let prompts: Vec<Vec<u32>> = picked
                .iter()
                .map(|&i| problems[i].prompt_ids.clone())
                .collect();
            let answers: Vec<String> = picked.iter().map(|&i| problems[i].answer.clone()).collect();
            let padded = left_pad(&prompts, pad);
            // Completions, forward_batch_size prompts at a time, by a copy that records no
            // gradient; one trajectory over the batch.
            let t_traj = Instant::now();
            if let Some(sm) = sharded.as_mut() {
                sm.gather_all(&mut policy)?;
            }
            let mut policy_ng = policy.detached();
            let mut completions = Vec::new();
            for (chunk_idx, first) in (0..b.rollout.batch_size)
                .step_by(b.rollout.forward_batch_size)
                .enumerate()
            {
                // The chunk's place among every rank's chunks of the epoch: with one prompt a
                // chunk, a prompt is sampled alike whatever the number of ranks.
                let place = (steps_run * b.rollout.batch_size + chunk_idx) * world + rank;
                let sample_seed = rollout::sample_seed(seed, place);
                completions.extend(sample_completions(
                    &policy_ng,
                    &prompts[first..first + b.rollout.forward_batch_size],
                    &s,
                    sample_seed,
                )?);
            }
            let reference = match (reference.as_mut(), reference_shards.as_mut()) {
                _ if !parsed.reference => Reference::None,
                (Some(m), Some(sm)) => Reference::Sharded(m, sm),
                (Some(m), None) => Reference::Model(m),
                (None, _) => Reference::AdaptersDisabled,
            };
            let scored = rollout_of(
                &mut policy_ng,
                reference,
                &tokenizer,
                &padded,
                &completions,
                &s,
            )?;
            let per_row = |i: usize| &problems[picked[i / s.grpo_samples]];
            let batch = RewardBatch {
                prompts: (0..scored.texts.len())
                    .map(|i| {
                        let p = per_row(i);
                        p.messages
                            .clone()
                            .unwrap_or_else(|| p.prompt.clone().into())
                    })
                    .collect(),
                completions: scored.texts.clone(),
                completion_ids: scored.kept_ids.clone(),
                answers: (0..scored.texts.len())
                    .map(|i| answers[i / s.grpo_samples].clone())
                    .collect(),
                columns: (0..scored.texts.len())
                    .map(|i| per_row(i).columns.clone())
                    .collect(),
            };
            let scores = rewards
                .score(&batch)
                .map_err(|e| anyhow!("{o}: batch {} of epoch {epoch}: {e}", batch_idx + 1))?;
            let reward_metrics = rewards.metrics(&scores);
            let mut traj = scored.into_trajectory(
                scores.total,
                scores.successes,
                s.grpo_samples,
                parsed.scale_rewards,
            )?;
            traj.old_is_current = on_policy;
            if let (Some(c), grpo::ScaleRewards::Batch) = (comm, parsed.scale_rewards) {
                // TRL gathers every rank's rewards before taking the batch's deviation.
                let std = ranks::std_over_ranks(c, &traj.rewards, &device)?;
                traj.advantages = grpo::advantages_over(
                    &traj.rewards,
                    s.grpo_samples,
                    grpo::ScaleRewards::Batch,
                    std,
                )?;
            }
            if let Some(c) = comm {
                // DAPO's normaliser: every rank's kept tokens over the ranks (TRL's
                // num_items_in_batch / num_processes).
                let n = Tensor::new(&[traj.num_items as f32], &device)?;
                let sum = c.all_reduce_sum(&n)?.to_vec1::<f32>()?[0] as f64;
                traj.num_items = sum / world as f64;
            }
            drop(policy_ng);
            let traj_s = t_traj.elapsed().as_secs_f64();

            let t_step = Instant::now();
            let mut stats = Vec::new();
            let mut grad_norm = None;
            for _ in 0..b.rollout.ppo_epochs {
                optimizer.set_lr(base_lr * schedule.multiplier(global_step));
                let mut grads = empty_grads()?;
                let in_model = match sharded.as_mut() {
                    Some(sm) => {
                        sm.gather_all(&mut policy)?;
                        sm.gathered_params()
                    }
                    None => params.clone(),
                };
                let back = Backward {
                    params: &in_model,
                    grads: &mut grads,
                    checkpointing,
                };
                let st = grpo_step(&policy, &traj, &s, rows_per_pass, back)?;
                if !st.loss.is_finite() {
                    bail!("the GRPO loss became {} at step {global_step}: lower optimizer.lr or set clip_grad_norm", st.loss);
                }
                let refs = || params.iter().map(|(_, v)| v.as_tensor());
                match sharded.as_mut() {
                    Some(sm) => {
                        // Reduce-scattered sums: this rank's part of the mean over the ranks.
                        for unit in policy.units() {
                            sm.reduce_grads(unit, &[&grads])?;
                        }
                        drop(grads);
                        sm.finish_reductions()?;
                        grads = sm.take_grads()?;
                        scale_grads(&mut grads, refs(), 1.0 / world as f64)?;
                        if let Some(max) = clip {
                            grad_norm = Some(sm.clip_grad_norm(&mut grads, refs(), max)?);
                        }
                    }
                    None => {
                        if let Some(c) = comm {
                            ranks::average_grads(c, &params, &mut grads)?;
                        }
                        if let Some(max) = clip {
                            grad_norm = Some(clip_grad_norm(&mut grads, refs(), max)?);
                        }
                    }
                }
                optimizer.step(&grads)?;
                drop(grads);
                if let Some(sm) = sharded.as_mut() {
                    // The next gather takes up the updated shards.
                    sm.release_all(&mut policy);
                    if global_step == start.global_step {
                        report_memory(sm, optimizer.as_ref(), rank)?;
                    }
                }
                stats.push(st);
                global_step += 1;
            }
            let step_s = t_step.elapsed().as_secs_f64();
            steps_run += 1;
            let log_now = steps_run.is_multiple_of(log_every);
            // As torchtune: rewards and successes are the means over the ranks, the other
            // statistics rank 0's (every rank takes part in the reduction).
            let over_ranks = match (comm, log_now) {
                (Some(c), true) => Some(ranks_mean(c, &traj, &device)?),
                _ => None,
            };
            if let (Some(logger), true) = (logger.as_mut(), log_now) {
                let mut metrics = step_metrics(&traj, &stats);
                if let Some((rewards, successes)) = over_ranks {
                    for (name, value) in [("rewards", rewards), ("successes", successes)] {
                        if let Some(m) = metrics.iter_mut().find(|(n, _)| *n == name) {
                            m.1 = value;
                        }
                    }
                }
                metrics.extend(reward_metrics);
                metrics.push(("lr", optimizer.lr()));
                if let Some(n) = grad_norm {
                    metrics.push(("grad_norm", n));
                }
                let qr = &traj.rollout.query_responses;
                let tokens = (qr.len() * qr[0].len()) as f64;
                metrics.push(("tokens_per_second_trajectory", tokens / traj_s.max(1e-9)));
                metrics.push((
                    "tokens_per_second_grpo",
                    tokens * b.rollout.ppo_epochs as f64 / step_s.max(1e-9),
                ));
                logger.log_step(global_step as u64, &metrics)?;
                let shown = "loss:4 rewards:2 successes:3 kl_loss:4 response_lengths:1";
                let line = rollout::step_line(steps_run, total_batches, &metrics, shown);
                eprintln!("{line} ({traj_s:.1} s sampling and scoring, {step_s:.1} s optimizing)");
            }
            if steps_run == b.num_steps {
                done = true;
                break;
            }
        }
        // ------------------------------------------------------------ checkpoint
        let save =
            (epoch + 1).is_multiple_of(b.save_every_n_epochs) || done || epoch + 1 == b.epochs;
        // Sharded: every rank gathers the policy and its part of the optimizer state; rank 0
        // writes them whole.
        let opt_state = match (save, sharded.as_mut()) {
            (true, Some(sm)) => {
                sm.gather_all(&mut policy)?;
                Some(sm.full_optimizer_state(optimizer.state_dict()?)?)
            }
            (true, None) if lead => Some(optimizer.state_dict()?),
            _ => None,
        };
        if let (true, Some(opt_state)) = (lead, opt_state) {
            let st = start.after_epoch(epoch, global_step);
            let dir = saver.write(&policy, &format!("epoch_{epoch}"), &st, opt_state)?;
            eprintln!("Checkpoint saved: {}", dir.display());
            last_dir = Some(dir);
        }
        if let Some(sm) = sharded.as_mut() {
            sm.release_all(&mut policy);
        }
        if let (true, Some(c)) = (save, comm) {
            // The other ranks wait for rank 0's checkpoint, as torchtune's do.
            c.barrier()?;
        }
        kill_if_asked(global_step, rank);
        if done {
            break;
        }
    }
    if let Some(logger) = logger.as_mut() {
        logger.flush()?;
    }
    if let Some((store, _)) = group {
        // Leaving together: a rank that exits early looks lost to the others' watchdog.
        store.barrier("end of training")?;
        store.shutdown()?;
    }
    push::push_final(&push, last_dir.as_deref())
}

/// The mean reward and success of the batch over every rank.
fn ranks_mean(c: &dyn Collectives, traj: &GrpoTrajectory, device: &Device) -> Result<(f64, f64)> {
    let rows = traj.rewards.len().max(1) as f32;
    // Unscorable rows (NaN: no reward function scored them) are left out, as TRL does.
    let scored = traj.rewards.iter().filter(|r| !r.is_nan());
    let mine = [
        scored.clone().sum::<f32>() / scored.count().max(1) as f32,
        traj.successes.iter().sum::<f32>() / rows,
    ];
    let sum = c
        .all_reduce_sum(&Tensor::new(&mine[..], device)?)?
        .to_vec1::<f32>()?;
    let n = c.world_size() as f64;
    Ok((sum[0] as f64 / n, sum[1] as f64 / n))
}

/// The metrics torchtune's GRPO recipe logs for one batch (the optimizer steps' means).
fn step_metrics(traj: &GrpoTrajectory, stats: &[GrpoStats]) -> Vec<(&'static str, f64)> {
    let rows = traj.rewards.len().max(1) as f64;
    let mean = |v: &[f32]| v.iter().map(|&x| x as f64).sum::<f64>() / rows;
    let scored: Vec<f64> = traj
        .rewards
        .iter()
        .filter(|r| !r.is_nan())
        .map(|&r| r as f64)
        .collect();
    let mut metrics = vec![
        (
            "rewards",
            scored.iter().sum::<f64>() / scored.len().max(1) as f64,
        ),
        ("successes", mean(&traj.successes)),
        (
            "num_stop_tokens",
            num_stop_tokens(&traj.rollout.response_padding),
        ),
    ];
    metrics.extend(rollout::step_metrics(
        stats,
        "kl_loss",
        &traj.rollout.seq_lens,
    ));
    metrics
}
