//! GRPO's arithmetic as torchtune's dev GRPO recipe defines it (`torchtune.dev.grpo`): the shaped
//! correctness reward of a completion, group-relative advantages, and the two policy losses
//! (`GRPOSimpleLoss`, TRL's one-step form, and `GRPOLoss`, the clipped token-level form); and
//! TRL's `GRPOTrainer` loss family (`loss_type` grpo, dr_grpo, dapo, bnpo; clip-higher;
//! sequence-level importance sampling, GSPO) with its reward scalings (`scale_rewards`).
//!
//! Per-token quantities are `[rows][response tokens]` host vectors in f32, as in [`crate::rlhf`];
//! only the loss is a tensor. A *keep* mask is true where a response token counts (up to and
//! including the first stop token).

use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Tensor};

use crate::config::Config;
use crate::rlhf::{self, PpoLossConfig, PpoTargets};

/// The text of the first `<think>…</think>` and `<answer>…</answer>` of `text` (each `""` when
/// absent), stripped of surrounding whitespace: torchtune's `extract_tags`, whose non-greedy
/// dot-all search is the first opening tag with the first closing tag after it.
pub fn extract_tags(text: &str) -> (String, String) {
    fn first(text: &str, open: &str, close: &str) -> String {
        text.find(open)
            .and_then(|i| {
                let rest = &text[i + open.len()..];
                rest.find(close).map(|j| &rest[..j])
            })
            .map(python_strip)
            .unwrap_or_default()
    }
    (
        first(text, "<think>", "</think>"),
        first(text, "<answer>", "</answer>"),
    )
}

/// Python's `str.strip()`: Unicode whitespace plus the separators U+001C–U+001F, which Python
/// counts as whitespace and Rust does not.
fn python_strip(s: &str) -> String {
    s.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
        .to_string()
}

/// torchtune's `shaped_correctness_reward(answer, completion)`: `(reward, success)` of a
/// completion that starts right after the prompt's `<think>`. `<<`/`>>` (GSM8K's calculator
/// notes) are removed first. torchtune's tag lists always hold one entry, so every completion
/// gets the 5 + 5 format points; the extracted answer equal to `answer` adds 20, containing it
/// adds 10, and equal to it makes the reward 100 and the success 1.
pub fn shaped_correctness_reward(answer: &str, completion: &str) -> (f32, f32) {
    let text = format!("<think>{}", completion.replace("<<", "").replace(">>", ""));
    let (_think, attempt) = extract_tags(&text);
    let mut reward = 10.0;
    if attempt == answer {
        reward += 20.0;
    }
    if attempt.contains(answer) {
        reward += 10.0;
    }
    if attempt == answer {
        return (100.0, 1.0);
    }
    (reward, 0.0)
}

/// Group-relative advantages: each reward minus its group's mean, over the group's standard
/// deviation (Bessel-corrected, as `torch.std`) plus `1e-4`. `rewards` holds consecutive groups
/// of `group` rows.
pub fn group_advantages(rewards: &[f32], group: usize) -> Result<Vec<f32>> {
    if group < 2 || !rewards.len().is_multiple_of(group) {
        bail!(
            "GRPO: groups of {group} cannot hold {} rewards (a group needs at least 2 samples: \
             its advantages divide by its standard deviation)",
            rewards.len()
        );
    }
    let mut out = Vec::with_capacity(rewards.len());
    for g in rewards.chunks(group) {
        let n = g.len() as f32;
        let mean = g.iter().sum::<f32>() / n;
        let var = g.iter().map(|r| (r - mean).powi(2)).sum::<f32>() / (n - 1.0);
        let std = var.sqrt();
        out.extend(g.iter().map(|r| (r - mean) / (std + 1e-4)));
    }
    Ok(out)
}

/// TRL's `scale_rewards`: what a reward minus its group's mean is divided by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ScaleRewards {
    /// The group's standard deviation plus `1e-4` (torchtune's and TRL's default).
    #[default]
    Group,
    /// The whole batch's standard deviation plus `1e-4`.
    Batch,
    /// Nothing: the advantage is the reward minus its group's mean (Dr. GRPO).
    None,
}

impl ScaleRewards {
    /// TRL's spellings: `group`, `batch`, `none`, and the booleans (`true` is `group`, `false`
    /// is `none`).
    pub fn parse(v: &serde_json::Value) -> Result<ScaleRewards> {
        Ok(match v {
            serde_json::Value::Bool(true) => ScaleRewards::Group,
            serde_json::Value::Bool(false) => ScaleRewards::None,
            serde_json::Value::String(s) => match s.as_str() {
                "group" | "true" | "True" => ScaleRewards::Group,
                "batch" => ScaleRewards::Batch,
                "none" | "false" | "False" => ScaleRewards::None,
                _ => bail!("scale_rewards '{s}': expected group, batch or none (or true/false)"),
            },
            _ => bail!("scale_rewards {v}: expected group, batch or none (or true/false)"),
        })
    }
}

/// Bessel-corrected standard deviation (torch's `std`, TRL's `nanstd` without NaNs).
fn std_dev(v: &[f32]) -> f32 {
    let n = v.len() as f32;
    let mean = v.iter().sum::<f32>() / n;
    (v.iter().map(|r| (r - mean).powi(2)).sum::<f32>() / (n - 1.0)).sqrt()
}

/// TRL's advantages (`multi_objective_aggregation: sum_then_normalize`): each reward minus its
/// group's mean, divided as `scale` says. `Group` is [`group_advantages`], torchtune's.
pub fn scaled_advantages(rewards: &[f32], group: usize, scale: ScaleRewards) -> Result<Vec<f32>> {
    if rewards.iter().any(|r| r.is_nan()) {
        return nan_advantages(rewards, group, scale, nan_std(rewards));
    }
    match scale {
        ScaleRewards::Group => group_advantages(rewards, group),
        _ => advantages_over(rewards, group, scale, std_dev(rewards)),
    }
}

/// TRL's `nanstd`: Bessel's standard deviation of the values that are not NaN (NaN with fewer
/// than two).
pub fn nan_std(v: &[f32]) -> f32 {
    let kept: Vec<f32> = v.iter().copied().filter(|x| !x.is_nan()).collect();
    match kept.len() {
        0 | 1 => f32::NAN,
        _ => std_dev(&kept),
    }
}

/// Advantages where some rows are unscorable (NaN: no reward function scored them), as TRL
/// computes them: group means and deviations over the scored rows only, and 0 for the
/// unscorable rows (they carry no signal).
fn nan_advantages(
    rewards: &[f32],
    group: usize,
    scale: ScaleRewards,
    batch_std: f32,
) -> Result<Vec<f32>> {
    // The group checks.
    group_advantages(&vec![0.0; rewards.len()], group)?;
    let mut out = Vec::with_capacity(rewards.len());
    for g in rewards.chunks(group) {
        let kept: Vec<f32> = g.iter().copied().filter(|x| !x.is_nan()).collect();
        let mean = kept.iter().sum::<f32>() / kept.len() as f32;
        let std = match scale {
            ScaleRewards::Group => nan_std(g),
            _ => batch_std,
        };
        out.extend(g.iter().map(|r| {
            let a = match scale {
                ScaleRewards::None => r - mean,
                _ => (r - mean) / (std + 1e-4),
            };
            if a.is_nan() {
                0.0
            } else {
                a
            }
        }));
    }
    Ok(out)
}

/// `Batch` or `None` advantages with `batch_std` the batch's standard deviation (for several
/// ranks: over every rank's rewards, as TRL gathers them).
pub fn advantages_over(
    rewards: &[f32],
    group: usize,
    scale: ScaleRewards,
    batch_std: f32,
) -> Result<Vec<f32>> {
    if rewards.iter().any(|r| r.is_nan()) {
        return nan_advantages(rewards, group, scale, batch_std);
    }
    // The group checks.
    group_advantages(rewards, group)?;
    let mut out = Vec::with_capacity(rewards.len());
    for g in rewards.chunks(group) {
        let mean = g.iter().sum::<f32>() / g.len() as f32;
        out.extend(g.iter().map(|r| match scale {
            ScaleRewards::Batch => (r - mean) / (batch_std + 1e-4),
            _ => r - mean,
        }));
    }
    Ok(out)
}

/// TRL's weighted sum of several reward functions' rewards (`reward_weights`): `per_func[f][row]`
/// times `weights[f]`, summed over the functions per row, NaN (a function's `None`: the row is
/// not its to score) left out as by `nansum`; a row no function scored is NaN (unscorable: left
/// out of its group's statistics, advantage 0).
pub fn weighted_rewards(per_func: &[Vec<f32>], weights: &[f32]) -> Vec<f32> {
    let rows = per_func.first().map_or(0, Vec::len);
    (0..rows)
        .map(|r| {
            if per_func.iter().all(|f| f[r].is_nan()) {
                return f32::NAN;
            }
            per_func
                .iter()
                .zip(weights)
                .map(|(f, w)| f[r] * w)
                .filter(|x| !x.is_nan())
                .sum()
        })
        .collect()
}

/// TRL's `loss_type`: how the per-token losses are summed into the loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrlLossType {
    /// Each completion's mean over its tokens, then the mean over completions.
    Grpo,
    /// The sum over every token, over rows × `max_completion_length` (a constant).
    DrGrpo,
    /// The sum over every token, over the kept tokens of the whole generation batch (over every
    /// rank); TRL's default.
    Dapo,
    /// The sum over every token, over the kept tokens of the (local) batch.
    Bnpo,
}

impl TrlLossType {
    /// TRL's name.
    pub fn parse(s: &str) -> Result<TrlLossType> {
        Ok(match s {
            "grpo" => TrlLossType::Grpo,
            "dr_grpo" => TrlLossType::DrGrpo,
            "dapo" => TrlLossType::Dapo,
            "bnpo" => TrlLossType::Bnpo,
            _ => bail!("loss.loss_type '{s}': expected grpo, dr_grpo, dapo or bnpo"),
        })
    }
}

/// TRL's GRPO loss settings (`GRPOConfig`'s names).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrlLoss {
    /// How per-token losses are reduced.
    pub loss_type: TrlLossType,
    /// The ratio is clipped to `[1 - epsilon_low, 1 + epsilon_high]`.
    pub epsilon_low: f64,
    pub epsilon_high: f64,
    /// `importance_sampling_level: sequence` (GSPO): one ratio per completion, the exponential of
    /// the mean of its tokens' log ratios.
    pub sequence_level: bool,
    /// Dr. GRPO's constant: TRL's `max_completion_length` (the recipe's `max_generated_tokens`).
    pub max_completion_length: usize,
    /// TRL's `use_bias_correction_kl` (its default true): the KL term times the (differentiable)
    /// importance ratio, DeepSeek-V3.2's unbiased reverse-KL gradient.
    pub bias_correction_kl: bool,
}

/// Which of torchtune's GRPO losses, with its settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GrpoLossKind {
    /// `GRPOSimpleLoss`: `exp(π − sg(π))·A − β·KL` per token, averaged per response, then over
    /// responses. Its gradient is the policy gradient of one step from the sampling policy.
    Simple,
    /// `GRPOLoss`: PPO's clipped ratio against the sampling policy's log probabilities, with
    /// `epsilon`, and `β·KL`, each averaged over every kept token of the batch.
    Clipped { epsilon: f64 },
    /// TRL's `GRPOTrainer` loss: the clipped ratio per token (or per sequence) times the
    /// advantage, plus `β·KL` per token, reduced as `loss_type` says. β 0 skips the KL term.
    Trl(TrlLoss),
}

/// The loss settings (torchtune's `loss:` section).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrpoLossConfig {
    pub kind: GrpoLossKind,
    /// β, the weight of the KL estimate to the reference policy.
    pub kl_coeff: f64,
}

impl GrpoLossConfig {
    /// Whether the loss reads a reference policy: torchtune's always do (their KL is logged
    /// even at `kl_coeff: 0`); TRL's only when `beta` is not 0.
    pub fn needs_reference(&self) -> bool {
        !matches!(self.kind, GrpoLossKind::Trl(_)) || self.kl_coeff > 0.0
    }
}

/// The GRPO recipe's loss section: torchtune's `GRPOSimpleLoss` (the default) or `GRPOLoss`, with `kl_coeff`
/// and `epsilon` (defaults 0.1 and 0.1, as torchtune's); or, with `loss_type`, TRL's
/// `GRPOTrainer` loss under TRL's names and defaults (`beta` 0, `epsilon` 0.2, `epsilon_high` =
/// `epsilon`, `importance_sampling_level` token, `use_bias_correction_kl` true). Dr. GRPO's constant is `max_generated_tokens`.
pub fn loss_config(
    cfg: &Config,
    max_generated_tokens: usize,
    recipe: &str,
) -> Result<GrpoLossConfig> {
    let o = &cfg.origin;
    if let Some(loss_type) = cfg.str("loss.loss_type")? {
        return trl_loss_config(cfg, &loss_type, max_generated_tokens);
    }
    for key in [
        "beta",
        "epsilon_high",
        "importance_sampling_level",
        "use_bias_correction_kl",
    ] {
        if cfg.get(&format!("loss.{key}")).is_some() {
            bail!(
                "{o}: loss.{key} is a key of TRL's GRPO losses: set loss.loss_type (grpo, \
                 dr_grpo, dapo or bnpo) to use them, or use torchtune's loss.kl_coeff"
            );
        }
    }
    let component = cfg
        .str("loss._component_")?
        .unwrap_or_else(|| "torchtune.dev.grpo.loss.GRPOSimpleLoss".into());
    let kl_coeff = cfg.f64("loss.kl_coeff")?.unwrap_or(0.1);
    let epsilon = cfg.f64("loss.epsilon")?.unwrap_or(0.1);
    if kl_coeff < 0.0 || epsilon < 0.0 {
        bail!("{o}: loss.kl_coeff and loss.epsilon must not be negative");
    }
    let kind = match component.rsplit('.').next().unwrap_or("") {
        "GRPOSimpleLoss" => GrpoLossKind::Simple,
        "GRPOLoss" => GrpoLossKind::Clipped { epsilon },
        "GRPOCompletionLoss" => bail!(
            "{o}: loss._component_ '{component}' is not supported: torchtune's version cannot \
             run (its KL term masks a per-completion value with per-token masks); use \
             GRPOSimpleLoss or GRPOLoss"
        ),
        _ => bail!(
            "{o}: loss._component_ '{component}': {recipe} takes \
             torchtune.dev.grpo.loss.GRPOSimpleLoss or GRPOLoss, or TRL's losses by \
             loss.loss_type"
        ),
    };
    Ok(GrpoLossConfig { kind, kl_coeff })
}

/// TRL's loss (`loss.loss_type` given): its keys, checked.
fn trl_loss_config(
    cfg: &Config,
    loss_type: &str,
    max_generated_tokens: usize,
) -> Result<GrpoLossConfig> {
    let o = &cfg.origin;
    if let Some(c) = cfg.str("loss._component_")? {
        bail!(
            "{o}: loss._component_ '{c}' and loss.loss_type '{loss_type}' both given: \
             loss_type selects TRL's GRPO loss, _component_ torchtune's; keep one"
        );
    }
    if cfg.get("loss.kl_coeff").is_some() {
        bail!("{o}: loss.kl_coeff is torchtune's name: TRL's losses (loss.loss_type) take beta");
    }
    let loss_type = TrlLossType::parse(loss_type).map_err(|e| anyhow!("{o}: {e}"))?;
    let beta = cfg.f64("loss.beta")?.unwrap_or(0.0);
    let epsilon = cfg.f64("loss.epsilon")?.unwrap_or(0.2);
    let epsilon_high = cfg.f64("loss.epsilon_high")?.unwrap_or(epsilon);
    if beta < 0.0 || epsilon < 0.0 || epsilon_high < 0.0 {
        bail!("{o}: loss.beta, loss.epsilon and loss.epsilon_high must not be negative");
    }
    let sequence_level = match cfg.str("loss.importance_sampling_level")?.as_deref() {
        None | Some("token") => false,
        Some("sequence") => true,
        Some(other) => bail!(
            "{o}: loss.importance_sampling_level '{other}': expected token or sequence (GSPO)"
        ),
    };
    Ok(GrpoLossConfig {
        kind: GrpoLossKind::Trl(TrlLoss {
            loss_type,
            epsilon_low: epsilon,
            epsilon_high,
            sequence_level,
            max_completion_length: max_generated_tokens,
            bias_correction_kl: cfg.bool("loss.use_bias_correction_kl")?.unwrap_or(true),
        }),
        kl_coeff: beta,
    })
}

/// Whole-batch counts a part of the batch is normalised by, so that the parts' losses (and
/// statistics) add up to the batch's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchTotals {
    pub rows: usize,
    /// Kept response tokens.
    pub kept: usize,
    /// Every response position, kept or not.
    pub positions: usize,
    /// TRL's `num_items_in_batch` over the ranks: the kept tokens of every rank's batch over the
    /// number of ranks (DAPO's normaliser); [`BatchTotals::of`] sets it to `kept`.
    pub items: f64,
}

impl BatchTotals {
    /// The totals of a batch with keep mask `keep`.
    pub fn of(keep: &[Vec<bool>]) -> Self {
        let kept = keep.iter().flatten().filter(|&&k| k).count();
        BatchTotals {
            rows: keep.len(),
            kept,
            positions: keep.iter().map(Vec::len).sum(),
            items: kept as f64,
        }
    }
}

/// One evaluation of the loss on a part of a batch: the differentiable loss and the statistics
/// torchtune logs, each already this part's share of the batch's value.
#[derive(Debug)]
pub struct GrpoLoss {
    pub loss: Tensor,
    pub policy_loss: f64,
    pub kl_loss: f64,
    pub ratios: f64,
    pub clipfrac: f64,
}

/// The GRPO loss of current log probabilities `logprobs` (`[rows, tokens]`, differentiable;
/// torchtune sets the cut positions to 1.0, which the masks leave out) given the sampling
/// policy's `old_logprobs`, the reference's `ref_logprobs`, one advantage per row and the keep
/// mask. `totals` are the whole batch's, of which these rows are a part.
pub fn grpo_loss(
    logprobs: &Tensor,
    old_logprobs: &[Vec<f32>],
    ref_logprobs: &[Vec<f32>],
    advantages: &[f32],
    keep: &[Vec<bool>],
    cfg: GrpoLossConfig,
    totals: BatchTotals,
) -> Result<GrpoLoss> {
    let device = logprobs.device();
    let (rows, len) = logprobs.dims2()?;
    let lp = logprobs.to_dtype(DType::F32)?;
    let table = |v: &[Vec<f32>]| Tensor::from_vec(v.concat(), (rows, len), device);
    let keep_f: Vec<Vec<f32>> = keep
        .iter()
        .map(|r| r.iter().map(|&k| k as u8 as f32).collect())
        .collect();
    let keep_t = table(&keep_f)?;
    // k3, the KL estimate torchtune uses: exp(ref − π) − (ref − π) − 1 ≥ 0.
    let d = (table(ref_logprobs)? - &lp)?;
    let kl = ((d.exp()? - &d)? - 1.0)?;
    match cfg.kind {
        GrpoLossKind::Simple => {
            let adv = Tensor::from_vec(advantages.to_vec(), (rows, 1), device)?;
            // exp(π − sg(π)) is 1 with π's gradient: the policy term's value is A.
            let policy = (&lp - lp.detach())?.exp()?.broadcast_mul(&adv)?;
            let per_token = (&policy - (&kl * cfg.kl_coeff)?)?.neg()?;
            // torchtune's masked_mean(dim=1): per row, sum / (count + 1e-8).
            let counts = (keep_t.sum(1)? + 1e-8)?;
            let row_mean =
                |x: &Tensor| -> Result<Tensor> { Ok((x * &keep_t)?.sum(1)?.div(&counts)?) };
            let share = |x: &Tensor| -> Result<f64> {
                Ok(row_mean(&x.detach())?.sum_all()?.to_scalar::<f32>()? as f64
                    / totals.rows as f64)
            };
            let loss = (row_mean(&per_token)?.sum_all()? / totals.rows as f64)?;
            Ok(GrpoLoss {
                policy_loss: share(&policy)?,
                kl_loss: share(&kl)?,
                // GRPOSimpleLoss reports 1 and 0.
                ratios: rows as f64 / totals.rows as f64,
                clipfrac: 0.0,
                loss,
            })
        }
        GrpoLossKind::Trl(trl) => trl_loss(
            &lp,
            old_logprobs,
            &kl,
            advantages,
            &keep_t,
            trl,
            cfg.kl_coeff,
            totals,
        ),
        GrpoLossKind::Clipped { epsilon } => {
            // min(A·clip(r), A·r) = −max(−A·clip(r), −A·r): PPO's policy term with the row's
            // advantage at every token, masked-meaned over the part; rescaled to the batch.
            let per_token_adv: Vec<Vec<f32>> = advantages.iter().map(|&a| vec![a; len]).collect();
            let targets = PpoTargets {
                old_logprobs,
                advantages: &per_token_adv,
                old_values: &[],
                returns: &[],
                keep,
                value_keep: &[],
            };
            let ppo = rlhf::ppo_policy_loss(
                &lp,
                targets,
                PpoLossConfig {
                    epsilon,
                    ..PpoLossConfig::default()
                },
            )?;
            let part = BatchTotals::of(keep);
            let kept_share = part.kept as f64 / totals.kept.max(1) as f64;
            let kl_sum = (&kl * &keep_t)?.sum_all()?;
            let kl_mean = (kl_sum / (totals.kept as f64 + 1e-8))?;
            let loss = ((&ppo.loss * kept_share)? + (&kl_mean * cfg.kl_coeff)?)?;
            Ok(GrpoLoss {
                policy_loss: -(ppo.policy_loss as f64) * kept_share,
                kl_loss: kl_mean.to_scalar::<f32>()? as f64,
                ratios: ppo.ratios as f64 * part.positions as f64 / totals.positions as f64,
                clipfrac: ppo.clipfrac as f64 * kept_share,
                loss,
            })
        }
    }
}

/// TRL's `_compute_loss` on a part of the batch (its share of the batch's loss): `lp` the current
/// log probabilities, `kl` the per-token k3 estimate, `keep_t` the keep mask as 0/1.
#[allow(clippy::too_many_arguments)]
fn trl_loss(
    lp: &Tensor,
    old_logprobs: &[Vec<f32>],
    kl: &Tensor,
    advantages: &[f32],
    keep_t: &Tensor,
    trl: TrlLoss,
    beta: f64,
    totals: BatchTotals,
) -> Result<GrpoLoss> {
    let device = lp.device();
    let (rows, len) = lp.dims2()?;
    let old = Tensor::from_vec(old_logprobs.concat(), (rows, len), device)?;
    let adv = Tensor::from_vec(advantages.to_vec(), (rows, 1), device)?;
    let log_ratio = (lp - &old)?;
    // Per token, or (GSPO) the row's mean log ratio over its kept tokens, as [rows, 1].
    let row_counts = keep_t.sum_keepdim(1)?.clamp(1f32, f32::MAX)?;
    let log_w = match trl.sequence_level {
        false => log_ratio,
        true => (&log_ratio * keep_t)?.sum_keepdim(1)?.div(&row_counts)?,
    };
    let coef1 = log_w.exp()?;
    let kl = match trl.bias_correction_kl {
        true => kl.broadcast_mul(&coef1)?,
        false => kl.clone(),
    };
    let kl = &kl;
    let (lo, hi) = (1.0 - trl.epsilon_low, 1.0 + trl.epsilon_high);
    // -min(c1·A, clamp(c1)·A): the clipped branch carries no gradient where it is the smaller
    // (the clamp is active there); ties (clamp inactive) take the unclipped branch, whose
    // gradient torch's split between equal branches adds up to.
    let unclipped = coef1.broadcast_mul(&adv)?;
    let host_c1: Vec<f32> = coef1.detach().flatten_all()?.to_vec1()?;
    let w = coef1.dim(1)?;
    let mut use_unclipped = Vec::with_capacity(host_c1.len());
    let mut clipped_value = Vec::with_capacity(host_c1.len());
    let mut clipped_flag = Vec::with_capacity(host_c1.len());
    for (k, &c) in host_c1.iter().enumerate() {
        let a = advantages[k / w] as f64;
        let c = c as f64;
        let cc = c.clamp(lo, hi);
        let take = c * a <= cc * a;
        use_unclipped.push(take as u8 as f32);
        clipped_value.push((cc * a) as f32);
        clipped_flag.push((!take) as u8 as f32);
    }
    let shape = coef1.shape().clone();
    let use_t = Tensor::from_vec(use_unclipped, shape.clone(), device)?;
    let other = Tensor::from_vec(clipped_value, shape.clone(), device)?;
    let policy = ((&unclipped * &use_t)? + (other * use_t.affine(-1.0, 1.0)?)?)?.neg()?;
    let policy = policy.broadcast_as((rows, len))?.contiguous()?;
    let per_token = match beta > 0.0 {
        false => policy.clone(),
        true => (&policy + (kl * beta)?)?,
    };
    let masked_sum = |x: &Tensor| -> Result<Tensor> { Ok((x * keep_t)?.sum_all()?) };
    let reduce = |x: &Tensor| -> Result<Tensor> {
        Ok(match trl.loss_type {
            TrlLossType::Grpo => {
                ((x * keep_t)?
                    .sum(1)?
                    .div(&row_counts.squeeze(1)?)?
                    .sum_all()?
                    / totals.rows as f64)?
            }
            TrlLossType::Bnpo => (masked_sum(x)? / totals.kept.max(1) as f64)?,
            TrlLossType::DrGrpo => {
                (masked_sum(x)? / (totals.rows * trl.max_completion_length).max(1) as f64)?
            }
            TrlLossType::Dapo => (masked_sum(x)? / totals.items.max(1.0))?,
        })
    };
    let loss = reduce(&per_token)?;
    let scalar = |t: Tensor| -> Result<f64> { Ok(t.to_scalar::<f32>()? as f64) };
    let kept_total = totals.kept.max(1) as f64;
    let flags = Tensor::from_vec(clipped_flag, shape, device)?
        .broadcast_as((rows, len))?
        .contiguous()?;
    let ratios = coef1.detach().broadcast_as((rows, len))?.contiguous()?;
    Ok(GrpoLoss {
        policy_loss: scalar(reduce(&policy.detach())?)?,
        // β 0: no reference, no KL.
        kl_loss: match beta > 0.0 {
            true => scalar(masked_sum(&kl.detach())?)? / kept_total,
            false => 0.0,
        },
        ratios: scalar(masked_sum(&ratios)?)? / kept_total,
        clipfrac: scalar(masked_sum(&flags)?)? / kept_total,
        loss,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_are_the_first_pair_and_stripped() {
        assert_eq!(
            extract_tags("<think> a </think> <answer>\n7 </answer><answer>8</answer>"),
            ("a".into(), "7".into())
        );
        // An opening tag without a closing one after it gives nothing.
        assert_eq!(
            extract_tags("</answer> <answer>5"),
            (String::new(), String::new())
        );
        assert_eq!(extract_tags("<answer>\u{1f}9\u{a0}</answer>").1, "9");
    }

    #[test]
    fn shaped_reward_has_torchtunes_levels() {
        assert_eq!(
            shaped_correctness_reward("72", "x</think> <answer>72</answer>"),
            (100.0, 1.0)
        );
        assert_eq!(
            shaped_correctness_reward("72", "x <answer>$72</answer>"),
            (20.0, 0.0)
        );
        assert_eq!(
            shaped_correctness_reward("72", "no tags at all"),
            (10.0, 0.0)
        );
        // The calculator brackets go before the tags are read.
        assert_eq!(
            shaped_correctness_reward("5", "<answer><<5>></answer>"),
            (100.0, 1.0)
        );
    }

    #[test]
    fn advantages_are_group_relative_with_bessels_std() {
        let a = group_advantages(&[1.0, 3.0, 10.0, 10.0], 2).unwrap();
        let s = 2f32.sqrt(); // std of [1, 3]
        assert!((a[0] + 1.0 / (s + 1e-4)).abs() < 1e-6 && (a[1] - 1.0 / (s + 1e-4)).abs() < 1e-6);
        assert_eq!(&a[2..], &[0.0, 0.0]);
        assert!(group_advantages(&[1.0, 2.0], 1).is_err());
    }

    /// TRL's unscorable rows: left out of the group's mean and deviation, advantage 0.
    #[test]
    fn unscorable_rows_get_no_advantage() {
        let nan = f32::NAN;
        let r = weighted_rewards(
            &[vec![1.0, nan, 3.0, nan], vec![nan, nan, 1.0, 2.0]],
            &[1.0, 2.0],
        );
        assert_eq!(r[0], 1.0);
        assert!(r[1].is_nan());
        assert_eq!(&r[2..], &[5.0, 4.0]);
        // Group [1, NaN, 5]: mean 3, std of [1, 5] = 2√2.
        let a = scaled_advantages(&[1.0, nan, 5.0], 3, ScaleRewards::Group).unwrap();
        let s = 8f32.sqrt() + 1e-4;
        assert_eq!(a, vec![-2.0 / s, 0.0, 2.0 / s]);
        let a = scaled_advantages(&[1.0, nan, 5.0, 2.0], 2, ScaleRewards::None).unwrap();
        assert_eq!(a, vec![0.0, 0.0, 1.5, -1.5]);
    }
}
