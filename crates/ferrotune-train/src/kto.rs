//! KTO (Kahneman–Tversky Optimization) as TRL's `KTOTrainer` computes it: unpaired rows, each a
//! prompt and one completion labelled desirable or undesirable, against a frozen reference
//! (LoRA: the model with its adapters disabled). With `r = π − ref` a row's summed completion log
//! ratio and `z` the KL estimate:
//!
//! - `loss_type` `kto`: a desirable row's loss is `1 − σ(β (r − z))`, an undesirable row's
//!   `1 − σ(β (z − r))`;
//! - `apo_zero_unpaired`: `1 − σ(β r)` and `σ(β r)` (no KL estimate);
//!
//! each weighed by `desirable_weight` / `undesirable_weight`, and the loss is their mean over the
//! batch's rows. `z` is TRL's: the mean over the batch of `π − ref` on *mismatched* rows (each
//! prompt with the previous row's completion, rotating by one within the batch: row `i` takes
//! row `i − 1`'s, row 0 the last row's), averaged over the ranks, clamped at 0 and detached.

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

/// TRL's `KTOConfig.loss_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KtoLossType {
    /// `kto` (TRL's default): the KTO paper's eqn. 7, with the KL estimate.
    Kto,
    /// `apo_zero_unpaired`: the unpaired APO-zero loss, without a KL estimate.
    ApoZeroUnpaired,
}

/// `KTOLoss` (`torchtune.rlhf.loss.KTOLoss`): TRL's `KTOConfig` parameters and defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KtoLoss {
    /// `beta` (0.1).
    pub beta: f64,
    /// `desirable_weight` (1.0).
    pub desirable_weight: f64,
    /// `undesirable_weight` (1.0).
    pub undesirable_weight: f64,
    /// `loss_type` (`kto`).
    pub loss_type: KtoLossType,
}

impl Default for KtoLoss {
    fn default() -> Self {
        Self {
            beta: 0.1,
            desirable_weight: 1.0,
            undesirable_weight: 1.0,
            loss_type: KtoLossType::Kto,
        }
    }
}

impl KtoLoss {
    /// The `loss.*` keys `KTOLoss` takes (besides `_component_`).
    pub const PARAMS: &'static [&'static str] = &[
        "beta",
        "desirable_weight",
        "undesirable_weight",
        "loss_type",
    ];

    /// The loss from its keys, TRL's defaults where one is not given; an unknown `loss_type` is
    /// an error naming the known ones.
    pub fn from_params(
        beta: Option<f64>,
        desirable_weight: Option<f64>,
        undesirable_weight: Option<f64>,
        loss_type: Option<&str>,
    ) -> Result<Self> {
        let d = Self::default();
        let loss_type = match loss_type.unwrap_or("kto") {
            "kto" => KtoLossType::Kto,
            "apo_zero_unpaired" => KtoLossType::ApoZeroUnpaired,
            other => bail!("KTOLoss: loss_type {other:?}: expected kto or apo_zero_unpaired"),
        };
        Ok(Self {
            beta: beta.unwrap_or(d.beta),
            desirable_weight: desirable_weight.unwrap_or(d.desirable_weight),
            undesirable_weight: undesirable_weight.unwrap_or(d.undesirable_weight),
            loss_type,
        })
    }

    /// Whether the loss reads a KL estimate (TRL's `calculate_KL`: every type but
    /// `apo_zero_unpaired`), so that the mismatched rows are built and scored.
    pub fn calculate_kl(self) -> bool {
        self.loss_type == KtoLossType::Kto
    }
}

/// The `loss` section as `KTOLoss` (`torchtune.rlhf.loss.KTOLoss`, also under
/// `torchtune.modules.rlhf.loss`), or `None` when `loss._component_` names another loss or none.
/// A `loss.*` key `KTOLoss` does not take is an error naming it and the keys it takes; a
/// non-positive `beta` or a negative weight is an error. The DPO recipes read it through
/// `recipe::setup::preference_loss`.
pub fn kto_loss(cfg: &crate::config::Config) -> Result<Option<KtoLoss>> {
    let component = match cfg.str("loss._component_")? {
        Some(c) if c.rsplit('.').next() == Some("KTOLoss") => c,
        _ => return Ok(None),
    };
    if let Some(section) = cfg.get("loss").and_then(|v| v.as_object()) {
        for key in section.keys() {
            if key != "_component_" && !KtoLoss::PARAMS.contains(&key.as_str()) {
                bail!(
                    "{}: loss.{key} is not a parameter of {component} (it takes {})",
                    cfg.origin,
                    KtoLoss::PARAMS.join(", ")
                );
            }
        }
    }
    let loss = KtoLoss::from_params(
        cfg.f64("loss.beta")?,
        cfg.f64("loss.desirable_weight")?,
        cfg.f64("loss.undesirable_weight")?,
        cfg.str("loss.loss_type")?.as_deref(),
    )
    .map_err(|e| anyhow::anyhow!("{}: {e}", cfg.origin))?;
    if loss.beta <= 0.0 {
        bail!("{}: loss.beta must be positive for {component}", cfg.origin);
    }
    for (key, w) in [
        ("desirable_weight", loss.desirable_weight),
        ("undesirable_weight", loss.undesirable_weight),
    ] {
        if w < 0.0 {
            bail!("{}: loss.{key} must not be negative", cfg.origin);
        }
    }
    Ok(Some(loss))
}

/// A text row's `(prompt, completion)` token ids as TRL's `KTOTrainer` tokenizes a
/// non-conversational row: the tokenizer's EOS token appended to the completion unless it ends
/// with it, the prompt and the prompt + completion each encoded with the special tokens, the
/// completion starting where the two diverge (TRL's `common_prefix_length`).
pub fn tokenize_unpaired(
    tokenizer: &ferrotune_data::Tokenizer,
    prompt: &str,
    completion: &str,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let mut completion = completion.to_string();
    if let Some(eos) = tokenizer.eos_token() {
        if !completion.ends_with(eos) {
            completion.push_str(eos);
        }
    }
    let prompt_ids = tokenizer.encode(prompt, true)?;
    let all = tokenizer.encode(&format!("{prompt}{completion}"), true)?;
    let start = prompt_ids
        .iter()
        .zip(&all)
        .take_while(|(a, b)| a == b)
        .count();
    Ok((all[..start].to_vec(), all[start..].to_vec()))
}

/// The rows TRL's `unpair_preference_dataset` makes of `pairs` preference pairs, in its order:
/// `(pair index, desirable)`. Its `datasets.map` runs in batches of 1000 pairs (the default
/// `batch_size`), and each batch gives all its chosen rows (desirable), then all its rejected
/// ones (undesirable), each with its pair's prompt.
pub fn unpaired_order(pairs: usize) -> Vec<(usize, bool)> {
    const MAP_BATCH: usize = 1000;
    let mut out = Vec::with_capacity(2 * pairs);
    for start in (0..pairs).step_by(MAP_BATCH) {
        let end = (start + MAP_BATCH).min(pairs);
        out.extend((start..end).map(|i| (i, true)));
        out.extend((start..end).map(|i| (i, false)));
    }
    out
}

/// TRL's KL rows: for each row `i`, its prompt with row `i − 1`'s completion (row 0 takes the
/// last row's), within one batch. `rows` are `(prompt, completion)` token ids.
pub fn mismatched_rows(rows: &[(Vec<u32>, Vec<u32>)]) -> Vec<(Vec<u32>, Vec<u32>)> {
    let n = rows.len();
    (0..n)
        .map(|i| (rows[i].0.clone(), rows[(i + n - 1) % n].1.clone()))
        .collect()
}

/// TRL's KL estimate from the mismatched rows' summed log probabilities under the policy and the
/// reference: the mean of their differences (the caller averages it over ranks first where
/// there are several, see [`kl_clamped`]).
pub fn kl_mean(policy: &[f32], reference: &[f32]) -> Result<f64> {
    if policy.len() != reference.len() || policy.is_empty() {
        bail!(
            "KTO's KL estimate: {} policy and {} reference log probabilities",
            policy.len(),
            reference.len()
        );
    }
    let sum: f64 = policy
        .iter()
        .zip(reference)
        .map(|(p, r)| (p - r) as f64)
        .sum();
    Ok(sum / policy.len() as f64)
}

/// The KL estimate the loss reads: the ranks' mean, clamped at 0 (TRL's `.clamp(min=0)`).
pub fn kl_clamped(mean_over_ranks: f64) -> f64 {
    mean_over_ranks.max(0.0)
}

/// A batch's KTO loss and what TRL's metrics read.
#[derive(Debug)]
pub struct KtoTerms {
    /// The weighted losses summed over the rows, differentiable: divided by the rows it is TRL's
    /// loss.
    pub total: Tensor,
    /// Desirable rows: their count, and sums of their rewards `β r` and log probabilities `π`.
    pub chosen: SideSums,
    /// Undesirable rows, the same.
    pub rejected: SideSums,
}

/// Sums over one label's rows, for TRL's per-label means (`rewards/chosen_sum` over
/// `count/chosen` etc.).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SideSums {
    /// Rows with this label.
    pub count: f64,
    /// `Σ β (π − ref)`.
    pub rewards: f64,
    /// `Σ π`.
    pub logps: f64,
}

/// The KTO loss of a batch: `policy` `[n]` each row's summed completion log probability
/// (differentiable), `reference` the reference's, `desirable` each row's label, `kl` the clamped
/// KL estimate (ignored by `apo_zero_unpaired`).
pub fn kto_terms(
    policy: &Tensor,
    reference: &[f32],
    desirable: &[bool],
    kl: f64,
    loss: KtoLoss,
) -> Result<KtoTerms> {
    let n = policy.dim(0)?;
    if reference.len() != n || desirable.len() != n {
        bail!(
            "KTO loss: {n} policy and {} reference log probabilities, {} labels",
            reference.len(),
            desirable.len()
        );
    }
    let dev = policy.device().clone();
    let policy = policy.to_dtype(DType::F32)?;
    let ratio = policy.broadcast_sub(&Tensor::from_vec(reference.to_vec(), n, &dev)?)?;
    let beta = loss.beta;
    // Per row: the sign s and offset o of the sigmoid's argument β (s r + o), whether the loss is
    // 1 − σ(·) or σ(·), and the row's weight.
    let kl = match loss.calculate_kl() {
        true => kl,
        false => 0.0,
    };
    let (mut sign, mut offset, mut one_minus, mut weight) = (vec![], vec![], vec![], vec![]);
    for &d in desirable {
        let (s, o, m, w) = match (loss.loss_type, d) {
            (KtoLossType::Kto, true) => (1.0, -kl, 1.0, loss.desirable_weight),
            (KtoLossType::Kto, false) => (-1.0, kl, 1.0, loss.undesirable_weight),
            (KtoLossType::ApoZeroUnpaired, true) => (1.0, 0.0, 1.0, loss.desirable_weight),
            (KtoLossType::ApoZeroUnpaired, false) => (1.0, 0.0, 0.0, loss.undesirable_weight),
        };
        sign.push(s as f32);
        offset.push(o as f32);
        one_minus.push(m as f32);
        weight.push(w as f32);
    }
    let t = |v: Vec<f32>| Tensor::from_vec(v, n, &dev);
    let arg = ((ratio.mul(&t(sign)?)? + t(offset)?)? * beta)?;
    // σ(x) = (1 + tanh(x/2)) / 2: no overflow at either end, nor in its gradient.
    let sig = ((arg * 0.5)?.tanh()? + 1.0)? * 0.5;
    let sig = sig?;
    // m (1 − σ) + (1 − m) σ = m + (1 − 2m) σ.
    let m = t(one_minus)?;
    let per_row = (m.affine(1.0, 0.0)? + sig.mul(&m.affine(-2.0, 1.0)?)?)?;
    let total = per_row.mul(&t(weight)?)?.sum_all()?;
    let ratio = ratio.detach().to_vec1::<f32>()?;
    let logps = policy.detach().to_vec1::<f32>()?;
    let (mut chosen, mut rejected) = (SideSums::default(), SideSums::default());
    for i in 0..n {
        let side = match desirable[i] {
            true => &mut chosen,
            false => &mut rejected,
        };
        side.count += 1.0;
        side.rewards += beta * ratio[i] as f64;
        side.logps += logps[i] as f64;
    }
    Ok(KtoTerms {
        total,
        chosen,
        rejected,
    })
}

/// TRL's logged KTO metrics from sums over a step's rows (over every rank): `rewards/chosen`,
/// `logps/chosen` (when a row is desirable), the same for rejected, `rewards/margins` (when both
/// are present) and `kl`.
pub fn kto_metrics(chosen: SideSums, rejected: SideSums, kl: f64) -> Vec<(&'static str, f64)> {
    let mut out = vec![];
    if chosen.count > 0.0 {
        out.push(("rewards/chosen", chosen.rewards / chosen.count));
        out.push(("logps/chosen", chosen.logps / chosen.count));
    }
    if rejected.count > 0.0 {
        out.push(("rewards/rejected", rejected.rewards / rejected.count));
        out.push(("logps/rejected", rejected.logps / rejected.count));
    }
    if chosen.count > 0.0 && rejected.count > 0.0 {
        let margin = chosen.rewards / chosen.count - rejected.rewards / rejected.count;
        out.push(("rewards/margins", margin));
    }
    out.push(("kl", kl));
    out
}
