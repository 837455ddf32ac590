//! What the RL recipes (PPO, GRPO) share around a rollout: prompts left-padded into one
//! rectangle, completions sampled from the policy, forward passes over the full sequences (the
//! attention layout of padded rows, log probabilities of the response tokens), back-propagation
//! from the final hidden states, the masks of cut tokens, and the policy's loading.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Tensor, Var, D};
use ferrotune_export::hf::ModelSource;
use ferrotune_infer::generate::{generate, GenerationOptions};
use ferrotune_infer::sampling::SamplingOptions;
use ferrotune_models::{AttentionLayout, CausalLm};

use crate::config::Config;
use crate::loss::log_softmax;
use crate::recipe::kit::checkpoint::base_source;
use crate::recipe::setup;
use crate::rlhf;
use crate::step::{absorb, checkpointed_backward};

/// Left-pads `prompts` with `pad` to the longest (torchtune's `padded_collate` with
/// `pad_direction="left"`).
pub fn left_pad(prompts: &[Vec<u32>], pad: u32) -> Vec<Vec<u32>> {
    let width = prompts.iter().map(Vec::len).max().unwrap_or(0);
    prompts
        .iter()
        .map(|p| {
            let mut row = vec![pad; width - p.len()];
            row.extend_from_slice(p);
            row
        })
        .collect()
}

/// The attention layout of full sequences in which `pad` marks padding (torchtune's causal mask
/// and position ids from the padding mask): pad keys are masked, positions count real tokens.
pub fn padded_layout(rows: &[Vec<u32>], pad: u32) -> AttentionLayout {
    let key_valid: Vec<Vec<bool>> = rows
        .iter()
        .map(|r| r.iter().map(|&t| t != pad).collect())
        .collect();
    let positions = key_valid
        .iter()
        .map(|valid| {
            let mut seen = 0u32;
            valid
                .iter()
                .map(|&v| {
                    seen += v as u32;
                    if v {
                        seen - 1
                    } else {
                        0
                    }
                })
                .collect()
        })
        .collect();
    AttentionLayout {
        positions,
        key_valid,
        segments: None,
    }
}

/// `rows` (all of one length) as a `[rows, len]` tensor of token ids.
pub fn ids_tensor(rows: &[Vec<u32>], device: &Device) -> Result<Tensor> {
    let width = rows.first().map_or(0, Vec::len);
    Ok(Tensor::from_vec(
        rows.concat(),
        (rows.len(), width),
        device,
    )?)
}

/// The positions of full-sequence hidden states `[rows, seq, hidden]` that predict the response
/// tokens: `context_length - 1 ..`, without the last (torchtune's
/// `truncate_sequence_for_logprobs`).
pub fn response_positions(hidden: &Tensor, ctx: usize) -> Result<Tensor> {
    let total = hidden.dim(1)?;
    Ok(hidden.narrow(1, ctx - 1, total - ctx)?)
}

/// `log softmax(logits / temperature)` of each response token (`[rows, response]`, f32) from the
/// model's final hidden states over the full sequences (differentiable when they are).
pub fn logprobs_from_hidden(
    model: &CausalLm,
    hidden: &Tensor,
    rows: &[Vec<u32>],
    ctx: usize,
    temperature: f64,
) -> Result<Tensor> {
    let h = response_positions(hidden, ctx)?;
    let logits = (model.logits(&h)?.to_dtype(DType::F32)? / temperature)?;
    let logp = log_softmax(&logits)?;
    let targets: Vec<u32> = rows.iter().flat_map(|r| r[ctx..].iter().copied()).collect();
    let (b, len) = (rows.len(), rows[0].len() - ctx);
    let index = Tensor::from_vec(targets, (b, len, 1), hidden.device())?;
    Ok(logp.gather(&index, D::Minus1)?.squeeze(D::Minus1)?)
}

/// The final hidden states of `rows` (padding marked by `pad`).
pub fn full_hidden(model: &CausalLm, rows: &[Vec<u32>], pad: u32) -> Result<Tensor> {
    let ids = ids_tensor(rows, model.device())?;
    Ok(model.forward_hidden(&ids, &padded_layout(rows, pad), None)?)
}

/// `log softmax(logits / temperature)` of each response token (`[rows, response]`, f32;
/// differentiable when the model trains).
pub fn response_logprobs(
    model: &CausalLm,
    rows: &[Vec<u32>],
    ctx: usize,
    pad: u32,
    temperature: f64,
) -> Result<Tensor> {
    logprobs_from_hidden(
        model,
        &full_hidden(model, rows, pad)?,
        rows,
        ctx,
        temperature,
    )
}

/// Where a step's backward goes: the gradients of `params` added into `grads`, each decoder
/// layer recomputed in the backward when `checkpointing`.
pub struct Backward<'a> {
    /// The parameters that train.
    pub params: &'a [(String, Var)],
    /// Where their gradients add up.
    pub grads: &'a mut GradStore,
    /// `enable_activation_checkpointing`.
    pub checkpointing: bool,
}

/// Back-propagates the loss `head` computes from `model`'s final hidden states over `rows` into
/// `back`'s gradients.
pub fn backward_from_hidden(
    model: &CausalLm,
    rows: &[Vec<u32>],
    pad: u32,
    back: &mut Backward<'_>,
    head: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<()> {
    let (params, acc) = (back.params, &mut *back.grads);
    if back.checkpointing {
        let ids = ids_tensor(rows, model.device())?;
        checkpointed_backward(model, &ids, &padded_layout(rows, pad), params, acc, head)?;
    } else {
        let loss = head(&full_hidden(model, rows, pad)?)?;
        absorb(acc, &loss.backward()?, params)?;
    }
    Ok(())
}

/// A `[rows, len]` tensor as rows of f32 on the host, detached.
pub fn host(t: &Tensor) -> Result<Vec<Vec<f32>>> {
    Ok(t.detach().to_dtype(DType::F32)?.to_vec2()?)
}

/// `m` as a `[rows, len]` f32 tensor: 1 where an entry equals `keep`, 0 elsewhere.
pub fn mask_tensor(m: &[Vec<bool>], keep: bool, device: &Device) -> Result<Tensor> {
    let (rows, len) = (m.len(), m.first().map_or(0, Vec::len));
    let v: Vec<f32> = m
        .iter()
        .flatten()
        .map(|&x| (x == keep) as u8 as f32)
        .collect();
    Ok(Tensor::from_vec(v, (rows, len), device)?)
}

/// Sets the entries of `logprobs` and `ref_logprobs` at cut tokens (`padding`) to 1.0, as
/// torchtune's in-place fills.
pub fn fill_cut(padding: &[Vec<bool>], logprobs: &mut [Vec<f32>], ref_logprobs: &mut [Vec<f32>]) {
    for (r, mask) in padding.iter().enumerate() {
        for (i, &m) in mask.iter().enumerate() {
            if m {
                logprobs[r][i] = 1.0;
                ref_logprobs[r][i] = 1.0;
            }
        }
    }
}

/// `log softmax(logits / temperature)` of the response tokens of `rows` from `hidden`, with 1.0
/// at the cut tokens (`padding`), as torchtune's in-place fill (no gradient there).
pub fn masked_logprobs(
    model: &CausalLm,
    hidden: &Tensor,
    rows: &[Vec<u32>],
    ctx: usize,
    temperature: f64,
    padding: &[Vec<bool>],
) -> Result<Tensor> {
    let raw = logprobs_from_hidden(model, hidden, rows, ctx, temperature)?;
    let device = raw.device().clone();
    Ok(((&raw * mask_tensor(padding, false, &device)?)? + mask_tensor(padding, true, &device)?)?)
}

/// The sum of `(new - old)² / 2` over every token, and the number of tokens: torchtune's
/// `approx_policy_kls` before its mean.
pub fn approx_kl_sum(new: &[Vec<f32>], old: &[Vec<f32>]) -> (f64, usize) {
    let (mut sum, mut count) = (0f64, 0usize);
    for (a, b) in new.iter().zip(old) {
        for (x, y) in a.iter().zip(b) {
            sum += 0.5 * ((x - y) as f64).powi(2);
            count += 1;
        }
    }
    (sum, count)
}

/// The length of the left-padded `prompts`, which must all have it; `who` names the recipe in
/// the error.
pub fn context_length(prompts: &[Vec<u32>], who: &str) -> Result<usize> {
    let ctx = prompts.first().map_or(0, Vec::len);
    if ctx == 0 || prompts.iter().any(|p| p.len() != ctx) {
        bail!("{who}: prompts must be left-padded to one non-zero length");
    }
    Ok(ctx)
}

/// The rows of `v` at `idx`, in that order.
pub fn pick<T: Clone>(v: &[T], idx: &[usize]) -> Vec<T> {
    idx.iter().map(|&i| v[i].clone()).collect()
}

/// What both RL trajectories hold of a batch of responses (torchtune's `Trajectory` and
/// `GRPOTrajectory` share it): per-token quantities are `[rows][response tokens]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Rollout {
    /// Left-padded prompt followed by the response (as generated, not cut), per row.
    pub query_responses: Vec<Vec<u32>>,
    pub context_length: usize,
    /// The sampling policy's log probabilities of the response tokens (1.0 where cut).
    pub logprobs: Vec<Vec<f32>>,
    /// The reference policy's (1.0 where cut).
    pub ref_logprobs: Vec<Vec<f32>>,
    /// True after a row's first stop token.
    pub response_padding: Vec<Vec<bool>>,
    /// The index of each row's last kept response token.
    pub seq_lens: Vec<usize>,
}

impl Rollout {
    /// The rollout of `query_responses` (prompts of `context_length` tokens) whose log
    /// probabilities under the policy and the reference are `logprobs` and `ref_logprobs`:
    /// `responses` (their response tokens) are cut at their first stop token in place, and the
    /// log probabilities of the cut tokens set to 1.0.
    pub fn cut(
        query_responses: Vec<Vec<u32>>,
        context_length: usize,
        mut logprobs: Vec<Vec<f32>>,
        mut ref_logprobs: Vec<Vec<f32>>,
        responses: &mut [Vec<u32>],
        s: &RolloutSettings,
    ) -> Rollout {
        let response_padding = rlhf::truncate_at_first_stop(responses, &s.stop_token_ids, s.pad_id);
        let seq_lens = response_padding
            .iter()
            .map(|p| rlhf::last_kept_index(p))
            .collect();
        fill_cut(&response_padding, &mut logprobs, &mut ref_logprobs);
        Rollout {
            query_responses,
            context_length,
            logprobs,
            ref_logprobs,
            response_padding,
            seq_lens,
        }
    }

    /// The rows `idx`, in that order.
    pub fn select(&self, idx: &[usize]) -> Rollout {
        Rollout {
            query_responses: pick(&self.query_responses, idx),
            context_length: self.context_length,
            logprobs: pick(&self.logprobs, idx),
            ref_logprobs: pick(&self.ref_logprobs, idx),
            response_padding: pick(&self.response_padding, idx),
            seq_lens: pick(&self.seq_lens, idx),
        }
    }

    /// These rows followed by `other`'s (same context length).
    pub fn extend(&mut self, other: Rollout) {
        self.query_responses.extend(other.query_responses);
        self.logprobs.extend(other.logprobs);
        self.ref_logprobs.extend(other.ref_logprobs);
        self.response_padding.extend(other.response_padding);
        self.seq_lens.extend(other.seq_lens);
    }
}

/// The keys an RL recipe's loop reads beside its batching and its loss (torchtune's top-level
/// keys), read once before anything is loaded.
#[derive(Debug, Clone, PartialEq)]
pub struct LoopSettings {
    /// `output_dir`: logs and the config copy.
    pub output_dir: PathBuf,
    /// Where the policy's checkpoints go (`checkpointer.output_dir`, else `output_dir`).
    pub checkpoint_dir: PathBuf,
    /// `resume_from_checkpoint`.
    pub resume: bool,
    /// `overwrite_output_dir`: a fresh run deletes an earlier run's checkpoints instead of
    /// refusing to mix with them.
    pub overwrite: bool,
    /// The metrics log (`metric_logger`'s JSONL file), which a fresh run must find empty.
    pub metrics_file: Option<PathBuf>,
    /// `enable_activation_checkpointing`: each decoder layer recomputed in the backward.
    pub checkpointing: bool,
    /// `log_every_n_steps` (at least 1).
    pub log_every: usize,
    /// `shuffle` (default true).
    pub shuffle: bool,
    /// `clip_grad_norm`.
    pub clip: Option<f64>,
    /// The switches of those the recipe accepts without effect that the config turns on.
    pub ignored_switches: Vec<&'static str>,
}

impl LoopSettings {
    /// Reads the settings from `cfg`; `ignorable` are the switches the recipe accepts and ignores
    /// (they change no result).
    pub fn parse(cfg: &Config, ignorable: &[&'static str]) -> Result<LoopSettings> {
        let checkpointing = cfg
            .bool("enable_activation_checkpointing")?
            .unwrap_or(false);
        let mut ignored_switches = Vec::new();
        for &switch in ignorable {
            if cfg.bool(switch)?.unwrap_or(false) {
                ignored_switches.push(switch);
            }
        }
        let (output_dir, checkpoint_dir) = crate::recipe::state::output_dirs(cfg)?;
        let metrics_file = crate::recipe::state::metrics_file(cfg, &output_dir)?;
        Ok(LoopSettings {
            output_dir,
            checkpoint_dir,
            resume: cfg.bool("resume_from_checkpoint")?.unwrap_or(false),
            overwrite: cfg.bool("overwrite_output_dir")?.unwrap_or(false),
            metrics_file,
            checkpointing,
            log_every: cfg.usize("log_every_n_steps")?.unwrap_or(1).max(1),
            shuffle: cfg.bool("shuffle")?.unwrap_or(true),
            clip: cfg.f64("clip_grad_norm")?,
            ignored_switches,
        })
    }

    /// Says which switches the run ignores.
    pub fn note_ignored(&self) {
        for switch in &self.ignored_switches {
            eprintln!("note: '{switch}: true' is ignored by ferrotune (it changes no result)");
        }
    }
}

/// The error unless each of the checkpointer `sections` names its `checkpoint_dir`, which
/// recipe `recipe` requires.
pub fn require_checkpoint_dirs(cfg: &Config, sections: &[&str], recipe: &str) -> Result<()> {
    for section in sections {
        if cfg.get(&format!("{section}.checkpoint_dir")).is_none() {
            bail!(
                "{}: '{section}.checkpoint_dir' is required by {recipe}",
                cfg.origin
            );
        }
    }
    Ok(())
}

/// The count at `key`, which recipe `recipe` requires.
pub fn required_count(cfg: &Config, key: &str, recipe: &str) -> Result<usize> {
    cfg.usize(key)?
        .ok_or_else(|| anyhow!("{}: '{key}' is required by {recipe}", cfg.origin))
}

/// How the RL recipes divide a batch of prompts, whatever else each reads about its batches.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RolloutBatching {
    /// `batch_size`: prompts per batch (required).
    pub batch_size: usize,
    /// `forward_batch_size`: prompts per rollout pass (default all of them).
    pub forward_batch_size: usize,
    /// `ppo_epochs`: optimizer passes over each batch (default 1).
    pub ppo_epochs: usize,
}

impl RolloutBatching {
    /// Reads the keys; `batch_size` is required by `recipe`. Each recipe checks them with its own
    /// keys (what must be at least 1 differs).
    pub fn parse(cfg: &Config, recipe: &str) -> Result<RolloutBatching> {
        let batch_size = required_count(cfg, "batch_size", recipe)?;
        Ok(RolloutBatching {
            batch_size,
            forward_batch_size: cfg.usize("forward_batch_size")?.unwrap_or(batch_size),
            ppo_epochs: cfg.usize("ppo_epochs")?.unwrap_or(1),
        })
    }
}

/// The error unless `whole` (the value of key `whole_key`) is a multiple of `part` (of
/// `part_key`).
pub fn check_divides(
    cfg: &Config,
    (whole_key, whole): (&str, usize),
    (part_key, part): (&str, usize),
) -> Result<()> {
    if whole % part != 0 {
        bail!(
            "{}: {whole_key} ({whole}) must be exactly divisible by {part_key} ({part})",
            cfg.origin
        );
    }
    Ok(())
}

/// One optimizer step's statistics as torchtune's RL recipes log them (its `PPOStats` and
/// `GRPOStats`, which differ in one loss term).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// The loss backpropagated: the policy loss plus the recipe's weighted second term.
    pub loss: f64,
    /// The clipped policy-gradient loss.
    pub policy_loss: f64,
    /// The recipe's second loss term: PPO's value loss, GRPO's KL loss against the reference.
    pub value_or_kl_loss: f64,
    /// The mean ratio of the new to the old policy's probabilities.
    pub ratios: f64,
    /// The fraction of ratios clipped.
    pub clipfrac: f64,
    /// The approximate KL divergence between the old and new policies.
    pub approx_policy_kl: f64,
}

impl std::ops::AddAssign for StepStats {
    fn add_assign(&mut self, o: Self) {
        *self = StepStats {
            loss: self.loss + o.loss,
            policy_loss: self.policy_loss + o.policy_loss,
            value_or_kl_loss: self.value_or_kl_loss + o.value_or_kl_loss,
            ratios: self.ratios + o.ratios,
            clipfrac: self.clipfrac + o.clipfrac,
            approx_policy_kl: self.approx_policy_kl + o.approx_policy_kl,
        };
    }
}

/// The metrics torchtune's RL recipes log after the rollout's own: the means over the steps of
/// each step's `stats` (`loss`, `policy_loss`, the recipe's second loss term named `second`, `clipfrac`,
/// `ratios`, `approx_policy_kl`), then the mean `response_lengths` of the rows (`seq_lens`).
pub fn step_metrics(
    stats: &[StepStats],
    second: &'static str,
    seq_lens: &[usize],
) -> Vec<(&'static str, f64)> {
    let mean = |column: fn(&StepStats) -> f64| {
        stats.iter().map(column).sum::<f64>() / stats.len().max(1) as f64
    };
    let rows = seq_lens.len().max(1) as f64;
    let lengths = seq_lens.iter().map(|&l| l as f64).sum::<f64>();
    vec![
        ("loss", mean(|s| s.loss)),
        ("policy_loss", mean(|s| s.policy_loss)),
        (second, mean(|s| s.value_or_kl_loss)),
        ("clipfrac", mean(|s| s.clipfrac)),
        ("ratios", mean(|s| s.ratios)),
        ("approx_policy_kl", mean(|s| s.approx_policy_kl)),
        ("response_lengths", lengths / rows),
    ]
}

/// The progress line an RL recipe prints after step `step` of `total`: each metric `shown` names
/// (`name:places`, space-separated) as its name and its value (0 when not logged) to that many
/// decimal places.
pub fn step_line(step: usize, total: usize, metrics: &[(&str, f64)], shown: &str) -> String {
    let values: Vec<String> = shown
        .split_whitespace()
        .map(|item| {
            let (name, places) = item.rsplit_once(':').expect("shown is name:places");
            let places: usize = places.parse().expect("shown is name:places");
            let value = metrics
                .iter()
                .find(|(n, _)| *n == name)
                .map_or(0.0, |m| m.1);
            format!("{name} {value:.places$}")
        })
        .collect();
    format!("step {step}/{total}: {}", values.join(" "))
}

/// How many rows hold a stop token (`padding` true after a row's first).
pub fn num_stop_tokens(padding: &[Vec<bool>]) -> f64 {
    padding.iter().filter(|r| r.iter().any(|&p| p)).count() as f64
}

/// The sampling keys the RL recipes share (torchtune's top-level keys) and the tokenizer's ids.
#[derive(Debug, Clone, PartialEq)]
pub struct RolloutSettings {
    /// Sampling temperature; log probabilities are of `logits / temperature`.
    pub temperature: f64,
    /// Sample from the `top_k` most likely tokens only.
    pub top_k: Option<usize>,
    /// The longest response.
    pub max_generated_tokens: usize,
    /// The tokens that end a response: `stop_token_ids`, else the tokenizer's.
    pub stop_token_ids: Vec<u32>,
    /// The tokenizer's pad token.
    pub pad_id: u32,
}

impl RolloutSettings {
    /// Reads `temperature` (default 1; positive, as log probabilities are of `logits /
    /// temperature`), `max_generated_tokens` (with `max_generated_tokens`, which says when it is
    /// missing; at least 1), `stop_token_ids` and `top_k`. The tokenizer's part is left to
    /// [`BeforeTokenizer::with`]: the pad id, and the stop tokens unless the config names them.
    pub fn parse(
        cfg: &Config,
        max_generated_tokens: impl FnOnce() -> Result<usize>,
    ) -> Result<(RolloutSettings, Option<Vec<u32>>)> {
        let o = &cfg.origin;
        let temperature = cfg.f64("temperature")?.unwrap_or(1.0);
        if temperature <= 0.0 {
            bail!(
                "{o}: temperature must be positive (log probabilities are of logits / temperature)"
            );
        }
        let max_generated_tokens = max_generated_tokens()?;
        if max_generated_tokens == 0 {
            bail!("{o}: max_generated_tokens must be at least 1");
        }
        let stop_token_ids = match cfg.get("stop_token_ids").filter(|v| !v.is_null()) {
            Some(v) => Some(
                v.as_array()
                    .and_then(|a| {
                        a.iter()
                            .map(|x| x.as_u64().map(|n| n as u32))
                            .collect::<Option<Vec<_>>>()
                    })
                    .ok_or_else(|| anyhow!("{o}: stop_token_ids must be a list of token ids"))?,
            ),
            None => None,
        };
        let settings = RolloutSettings {
            temperature,
            top_k: cfg.usize("top_k")?.filter(|&k| k > 0),
            max_generated_tokens,
            stop_token_ids: Vec::new(),
            pad_id: 0,
        };
        Ok((settings, stop_token_ids))
    }

    /// Sampling by these settings, every completion `max_generated_tokens` long.
    pub fn sampling(&self) -> Sampling {
        Sampling::new(
            self.temperature,
            self.top_k,
            self.max_generated_tokens,
            self.pad_id,
        )
    }
}

/// An RL recipe's settings `S` as its config gives them, parsed before the tokenizer is loaded:
/// the tokenizer's pad id, and its stop tokens unless `stop_token_ids` names them, are filled
/// into their [`RolloutSettings`] once it is ([`BeforeTokenizer::with`]), without reading the
/// config again.
#[derive(Debug, Clone)]
pub struct BeforeTokenizer<S> {
    settings: S,
    stop_token_ids: Option<Vec<u32>>,
    /// Where the settings keep their [`RolloutSettings`].
    rollout: fn(&mut S) -> &mut RolloutSettings,
}

impl<S: Clone> BeforeTokenizer<S> {
    /// `settings` (their token ids still unset, in the part `rollout` points to) and
    /// `stop_token_ids` as the config gives them.
    pub fn new(
        settings: S,
        stop_token_ids: Option<Vec<u32>>,
        rollout: fn(&mut S) -> &mut RolloutSettings,
    ) -> Self {
        BeforeTokenizer {
            settings,
            stop_token_ids,
            rollout,
        }
    }

    /// The settings with the loaded tokenizer's `pad_id`, and its stop tokens (`default_stops`)
    /// unless the config names them.
    pub fn with(&self, pad_id: u32, default_stops: Vec<u32>) -> S {
        let mut settings = self.settings.clone();
        let rollout = (self.rollout)(&mut settings);
        rollout.pad_id = pad_id;
        rollout.stop_token_ids = self.stop_token_ids.clone().unwrap_or(default_stops);
        settings
    }
}

/// How the policy samples a rollout's completions.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    /// Sampling temperature.
    pub temperature: f64,
    /// Sample from the `top_k` most likely tokens only.
    pub top_k: Option<usize>,
    /// The longest completion.
    pub max_generated_tokens: usize,
    /// The token that pads completions that end early.
    pub pad_id: u32,
    /// The tokens that end a completion; none: every completion runs to `max_generated_tokens`
    /// (PPO cuts at its stop tokens afterwards).
    pub stop_token_ids: Option<Vec<u32>>,
}

impl Sampling {
    /// Sampling at `temperature` from the `top_k` most likely tokens, every completion
    /// `max_generated_tokens` long (`pad_id` pads).
    pub fn new(
        temperature: f64,
        top_k: Option<usize>,
        max_generated_tokens: usize,
        pad_id: u32,
    ) -> Self {
        Sampling {
            temperature,
            top_k,
            max_generated_tokens,
            pad_id,
            stop_token_ids: None,
        }
    }

    /// This sampling with each completion ending at its first token of `stop_token_ids`.
    pub fn stopping_at(self, stop_token_ids: &[u32]) -> Self {
        Sampling {
            stop_token_ids: Some(stop_token_ids.to_vec()),
            ..self
        }
    }
}

/// Samples one completion of each of `rows` (unpadded prompts) with `policy`, drawing from
/// `seed`.
pub fn sample(
    policy: &CausalLm,
    rows: &[Vec<u32>],
    s: &Sampling,
    seed: u64,
) -> Result<Vec<Vec<u32>>> {
    let opts = GenerationOptions {
        max_new_tokens: s.max_generated_tokens,
        sampling: SamplingOptions {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: None,
            repetition_penalty: 1.0,
            seed,
        },
        eos_token_ids: s.stop_token_ids.clone().unwrap_or_default(),
        stop_strings: Vec::new(),
        ignore_eos: s.stop_token_ids.is_none(),
        pad_token_id: s.pad_id,
    };
    let out = generate(policy, rows, &opts, &|_| String::new(), &mut |_, _| {})?;
    Ok(out.new_token_ids)
}

/// The seed of the `place`-th chunk of prompts a run samples.
pub fn sample_seed(seed: u64, place: usize) -> u64 {
    seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(place as u64)
}

/// Loads the model of checkpointer section `section`, or the checkpoint `resumed` when resuming
/// (the section's checkpoint still supplies the tokenizer and generation files), and checks
/// `component` against it. Returns the model, its source files and the section's path.
pub fn load(
    cfg: &Config,
    section: &str,
    component: &str,
    resumed: Option<&Path>,
    dtype: DType,
    device: &Device,
) -> Result<(CausalLm, ModelSource, PathBuf)> {
    let location = setup::checkpoint_path_at(cfg, section)?;
    let (model, source) = match resumed {
        Some(dir) => {
            let (model, _) =
                setup::load_model(cfg, &setup::CheckpointLocation::folder(dir), dtype, device)
                    .with_context(|| {
                        format!("{}: resuming {section} from {}", cfg.origin, dir.display())
                    })?;
            let (format, base) = base_source(&location)?;
            (model, ModelSource { format, dir: base })
        }
        None => setup::load_model(cfg, &location, dtype, device)
            .with_context(|| format!("{}: {section}", cfg.origin))?,
    };
    let path = location.path;
    setup::check_component_at(cfg, &format!("{component}._component_"), &model.config)?;
    Ok((model, source, path))
}
