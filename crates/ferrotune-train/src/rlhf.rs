//! The arithmetic of PPO from a reward model, as torchtune's `rlhf` module defines it: cutting
//! responses at their first stop token, the penalties, per-token rewards (KL to the reference
//! plus the score), generalized advantage estimation with masked whitening, and the clipped
//! policy and value losses.
//!
//! Per-token quantities are `[rows][response tokens]` host vectors in f32, computed in the order
//! torch computes them; only the loss is a tensor, because it is differentiated. Masks follow
//! torchtune's conventions where named so: a *padding* mask is true where a token does not count.

use candle_core::{DType, Result, Tensor};

/// A per-token quantity, `[rows][response tokens]`.
pub type PerToken = Vec<Vec<f32>>;

/// Truncates each response after its first stop token (torchtune's
/// `truncate_sequence_at_first_stop_token`): tokens after it become `fill`. Returns the padding
/// mask, true where a token was cut (the stop token itself is kept).
pub fn truncate_at_first_stop(
    responses: &mut [Vec<u32>],
    stop_tokens: &[u32],
    fill: u32,
) -> Vec<Vec<bool>> {
    responses
        .iter_mut()
        .map(|row| {
            let mut stops_seen = 0usize;
            row.iter_mut()
                .map(|tok| {
                    let is_stop = stop_tokens.contains(tok);
                    stops_seen += is_stop as usize;
                    let cut = stops_seen > 1 || (stops_seen == 1 && !is_stop);
                    if cut {
                        *tok = fill;
                    }
                    cut
                })
                .collect()
        })
        .collect()
}

/// The mask of kept tokens (true = counts) from a padding mask (true = cut).
pub fn kept(padding: &[Vec<bool>]) -> Vec<Vec<bool>> {
    padding
        .iter()
        .map(|row| row.iter().map(|&p| !p).collect())
        .collect()
}

/// The index of the last kept token of a row (torchtune's `get_unmasked_sequence_lengths`: the
/// first position where the count of kept tokens peaks, clipped to the row): one less than the
/// response length, and 0 for a row with nothing kept.
pub fn last_kept_index(padding: &[bool]) -> usize {
    let (mut count, mut best, mut at) = (0usize, 0usize, 0usize);
    for (i, &p) in padding.iter().enumerate() {
        count += (!p) as usize;
        if count > best {
            best = count;
            at = i;
        }
    }
    at.min(padding.len().saturating_sub(1))
}

/// Which rows' scores are replaced by the penalty (torchtune's `get_reward_penalty_mask`): rows
/// that never stopped when `penalise_no_eos`, and rows whose [`last_kept_index`] is below
/// `min_response_length`.
pub fn reward_penalty_mask(
    padding: &[Vec<bool>],
    seq_lens: &[usize],
    penalise_no_eos: bool,
    min_response_length: Option<usize>,
) -> Vec<bool> {
    padding
        .iter()
        .zip(seq_lens)
        .map(|(row, &len)| {
            let no_eos = penalise_no_eos && !row.iter().any(|&p| p);
            let short = min_response_length.is_some_and(|m| len < m);
            no_eos || short
        })
        .collect()
}

/// Where each row's score and last value sit (the recipe's `value_seq_idxs`): one past the last
/// kept token when that is inside the response and not the first token, else the last kept
/// token itself.
pub fn value_indices(seq_lens: &[usize], max_generated_tokens: usize) -> Vec<usize> {
    seq_lens
        .iter()
        .map(|&l| {
            if l > 0 && l + 1 < max_generated_tokens {
                l + 1
            } else {
                l
            }
        })
        .collect()
}

/// Per-token rewards (torchtune's `get_rewards_ppo`): `-kl_coeff · (logprobs − ref_logprobs)` at
/// every token, plus the row's score at its `score_index`. Returns `(total, kl, kl_reward)`.
pub fn rewards_ppo(
    scores: &[f32],
    logprobs: &[Vec<f32>],
    ref_logprobs: &[Vec<f32>],
    kl_coeff: f64,
    score_index: &[usize],
) -> (PerToken, PerToken, PerToken) {
    let neg_coeff = -kl_coeff as f32;
    let kl: Vec<Vec<f32>> = logprobs
        .iter()
        .zip(ref_logprobs)
        .map(|(p, r)| p.iter().zip(r).map(|(a, b)| a - b).collect())
        .collect();
    let kl_reward: Vec<Vec<f32>> = kl
        .iter()
        .map(|row| row.iter().map(|k| neg_coeff * k).collect())
        .collect();
    let mut total = kl_reward.clone();
    for ((row, &s), &at) in total.iter_mut().zip(scores).zip(score_index) {
        row[at] += s;
    }
    (total, kl, kl_reward)
}

/// `sum(x · mask) / (count + 1e-8)` over every entry, in f32 (trl's and torchtune's
/// `masked_mean`).
pub fn masked_mean(x: &[Vec<f32>], keep: &[Vec<bool>]) -> f32 {
    let mut sum = 0f32;
    let mut count = 0usize;
    for (row, mask) in x.iter().zip(keep) {
        for (&v, &k) in row.iter().zip(mask) {
            if k {
                sum += v;
                count += 1;
            }
        }
    }
    sum / (count as f32 + 1e-8)
}

/// The masked variance of already-centred values, Bessel-corrected (torchtune's `masked_var`).
fn masked_var(centred: &[Vec<f32>], keep: &[Vec<bool>]) -> f32 {
    let squares: Vec<Vec<f32>> = centred
        .iter()
        .map(|row| row.iter().map(|v| v * v).collect())
        .collect();
    let var = masked_mean(&squares, keep);
    let count = keep.iter().flatten().filter(|&&k| k).count() as f32 + 1e-8;
    var * (count / (count - 1.0))
}

/// Normalizes `x` to unit variance over the kept entries, keeping their mean (torchtune's
/// `whiten` with `shift_mean=True`).
pub fn whiten(x: &[Vec<f32>], keep: &[Vec<bool>]) -> Vec<Vec<f32>> {
    let mean = masked_mean(x, keep);
    let centred: Vec<Vec<f32>> = x
        .iter()
        .map(|row| row.iter().map(|v| v - mean).collect())
        .collect();
    let var = masked_var(&centred, keep);
    let inv_std = 1.0 / (var + 1e-8).sqrt();
    centred
        .iter()
        .map(|row| row.iter().map(|c| c * inv_std + mean).collect())
        .collect()
}

/// Generalized advantage estimation (torchtune's `estimate_advantages`): advantages whitened
/// over the kept tokens and zero elsewhere, and returns (`advantages + values`, before
/// whitening).
pub fn estimate_advantages(
    values: &[Vec<f32>],
    rewards: &[Vec<f32>],
    gamma: f64,
    lmbda: f64,
    keep: &[Vec<bool>],
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let (g, gl) = (gamma as f32, (gamma * lmbda) as f32);
    let mut advantages = Vec::with_capacity(values.len());
    let mut returns = Vec::with_capacity(values.len());
    for (v, r) in values.iter().zip(rewards) {
        let n = v.len();
        let mut adv = vec![0f32; n];
        let mut last = 0f32;
        for t in (0..n).rev() {
            let next = if t + 1 < n { v[t + 1] } else { 0.0 };
            let delta = r[t] + g * next - v[t];
            last = delta + gl * last;
            adv[t] = last;
        }
        returns.push(adv.iter().zip(v).map(|(a, b)| a + b).collect());
        advantages.push(adv);
    }
    let mut whitened = whiten(&advantages, keep);
    for (row, mask) in whitened.iter_mut().zip(keep) {
        for (a, &k) in row.iter_mut().zip(mask) {
            if !k {
                *a = 0.0;
            }
        }
    }
    (whitened, returns)
}

/// PPO's clipping settings (torchtune's `PPOLoss`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PpoLossConfig {
    /// Policy ratio clip: ratios outside `[1 − epsilon, 1 + epsilon]` stop pulling.
    pub epsilon: f64,
    /// Value clip: new values further than this from the old ones stop pulling.
    pub value_clip_range: f64,
    /// The value loss's weight in the total.
    pub value_coeff: f64,
}

impl Default for PpoLossConfig {
    fn default() -> Self {
        // torchtune's PPOLoss defaults.
        Self {
            epsilon: 0.1,
            value_clip_range: 0.2,
            value_coeff: 0.1,
        }
    }
}

/// One PPO loss evaluation: the differentiable total and the statistics torchtune logs.
#[derive(Debug)]
pub struct PpoLoss {
    /// `policy_loss + value_coeff · value_loss` (scalar, f32, differentiable).
    pub loss: Tensor,
    pub policy_loss: f32,
    pub value_loss: f32,
    /// The mean probability ratio over every token (padding included, as torchtune).
    pub ratios: f32,
    /// The fraction of kept tokens whose policy term was clipped.
    pub clipfrac: f32,
}

/// The inputs of [`ppo_loss`] that are fixed by the trajectory: old log probabilities and values,
/// advantages, returns and the two masks (true = the token counts).
#[derive(Debug, Clone, Copy)]
pub struct PpoTargets<'a> {
    pub old_logprobs: &'a [Vec<f32>],
    pub advantages: &'a [Vec<f32>],
    pub old_values: &'a [Vec<f32>],
    pub returns: &'a [Vec<f32>],
    pub keep: &'a [Vec<bool>],
    pub value_keep: &'a [Vec<bool>],
}

/// The clipped PPO loss (torchtune's `PPOLoss.forward`) of the current log probabilities
/// `logprobs` and values `values` (`[rows, tokens]`, f32, differentiable): the policy part
/// ([`ppo_policy_loss`]) plus `value_coeff` times the value part ([`ppo_value_loss`]). The two
/// parts depend on different models, so each can be back-propagated on its own.
pub fn ppo_loss(
    logprobs: &Tensor,
    values: &Tensor,
    t: PpoTargets<'_>,
    cfg: PpoLossConfig,
) -> Result<PpoLoss> {
    let policy = ppo_policy_loss(logprobs, t, cfg)?;
    let value = ppo_value_loss(values, t, cfg)?;
    Ok(PpoLoss {
        loss: (&policy.loss + &value.loss)?,
        policy_loss: policy.policy_loss,
        value_loss: value.value_loss,
        ratios: policy.ratios,
        clipfrac: policy.clipfrac,
    })
}

/// The clipped policy part of [`ppo_loss`]; its `value_loss` is 0.
///
/// Each clipped maximum is formed as its active branch: where the clipped term wins strictly it
/// enters as a constant (a clipped ratio passes no gradient), elsewhere the unclipped term
/// carries the gradient. This is exactly torch's gradient, which splits it between equal
/// branches of `maximum` while `clamp` passes it inside its range: the two branches are equal only
/// when the clamp is inactive, and then the halves add up to the unclipped gradient.
pub fn ppo_policy_loss(
    logprobs: &Tensor,
    t: PpoTargets<'_>,
    cfg: PpoLossConfig,
) -> Result<PpoLoss> {
    let device = logprobs.device();
    let (rows, len) = logprobs.dims2()?;
    let host_lp: Vec<Vec<f32>> = logprobs.detach().to_dtype(DType::F32)?.to_vec2()?;
    let (lo, hi) = ((1.0 - cfg.epsilon) as f32, (1.0 + cfg.epsilon) as f32);
    let n = rows * len;
    let mut neg_adv = vec![0f32; n];
    let mut max = ActiveMax::new(rows, len);
    let mut clipped_rows = vec![vec![0f32; len]; rows];
    let mut ratio_sum = 0f32;
    for r in 0..rows {
        for i in 0..len {
            let k = r * len + i;
            let a = t.advantages[r][i];
            let ratio = (host_lp[r][i] - t.old_logprobs[r][i]).exp();
            ratio_sum += ratio;
            let clipped = -a * ratio.clamp(lo, hi);
            let unclipped = -a * ratio;
            neg_adv[k] = -a;
            if max.set(k, clipped, unclipped, t.keep[r][i]) {
                clipped_rows[r][i] = 1.0;
            }
        }
    }
    let tensor = |v: Vec<f32>| Tensor::from_vec(v, (rows, len), device);
    let lp = logprobs.to_dtype(DType::F32)?;
    let old_lp = tensor(t.old_logprobs.concat())?;
    let ratio = (lp - old_lp)?.exp()?;
    let loss = max.mean((ratio * tensor(neg_adv)?)?, t.keep)?;
    Ok(PpoLoss {
        policy_loss: loss.to_scalar::<f32>()?,
        value_loss: 0.0,
        ratios: ratio_sum / n.max(1) as f32,
        clipfrac: masked_mean(&clipped_rows, t.keep),
        loss,
    })
}

/// The clipped value part of [`ppo_loss`], already weighted by `value_coeff` in `loss` (its
/// `value_loss` is the unweighted `0.5 · masked mean`). Same construction of the maximum as
/// [`ppo_policy_loss`].
pub fn ppo_value_loss(values: &Tensor, t: PpoTargets<'_>, cfg: PpoLossConfig) -> Result<PpoLoss> {
    let device = values.device();
    let (rows, len) = values.dims2()?;
    let host_v: Vec<Vec<f32>> = values.detach().to_dtype(DType::F32)?.to_vec2()?;
    let clip = cfg.value_clip_range as f32;
    let mut max = ActiveMax::new(rows, len);
    for (r, row) in host_v.iter().enumerate() {
        for (i, &v) in row.iter().enumerate() {
            let k = r * len + i;
            let old = t.old_values[r][i];
            let v_clipped = v.clamp(old - clip, old + clip);
            let ret = t.returns[r][i];
            let (plain, clipped_sq) = ((v - ret).powi(2), (v_clipped - ret).powi(2));
            max.set(k, clipped_sq, plain, t.value_keep[r][i]);
        }
    }
    let vals = values.to_dtype(DType::F32)?;
    let returns = Tensor::from_vec(t.returns.concat(), (rows, len), device)?;
    let value_loss = (max.mean((vals - returns)?.sqr()?, t.value_keep)? * 0.5)?;
    Ok(PpoLoss {
        policy_loss: 0.0,
        value_loss: value_loss.to_scalar::<f32>()?,
        ratios: 0.0,
        clipfrac: 0.0,
        loss: (value_loss * cfg.value_coeff)?,
    })
}

/// The maximum of a differentiable term and a constant at each token of a `[rows, len]` batch,
/// formed as its active branch (see [`ppo_policy_loss`]), and its mean over the kept tokens.
struct ActiveMax {
    shape: (usize, usize),
    /// The constant where it wins strictly, else 0.
    constant: Vec<f32>,
    /// 1 where the differentiable term carries the maximum.
    live: Vec<f32>,
    /// 1 at the kept tokens.
    keep: Vec<f32>,
}

impl ActiveMax {
    fn new(rows: usize, len: usize) -> Self {
        let n = rows * len;
        ActiveMax {
            shape: (rows, len),
            constant: vec![0f32; n],
            live: vec![0f32; n],
            keep: vec![0f32; n],
        }
    }

    /// Token `k` (kept or not) takes `constant` if it exceeds `term` (the differentiable term's
    /// value), else the term; true when the constant wins.
    fn set(&mut self, k: usize, constant: f32, term: f32, kept: bool) -> bool {
        let wins = constant > term;
        if wins {
            self.constant[k] = constant;
        } else {
            self.live[k] = 1.0;
        }
        self.keep[k] = kept as u8 as f32;
        wins
    }

    /// The masked mean of the maxima, `term` being the differentiable term's tensor; divided as
    /// torch's masked mean of the kept tokens `keep` divides.
    fn mean(self, term: Tensor, keep: &[Vec<bool>]) -> Result<Tensor> {
        let device = term.device().clone();
        let tensor = |v: Vec<f32>| Tensor::from_vec(v, self.shape, &device);
        let terms = (term * tensor(self.live)?)?.add(&tensor(self.constant)?)?;
        (terms * tensor(self.keep)?)?.sum_all()? / count(keep) as f64
    }
}

/// Kept entries of a mask plus torch's `1e-8`, as [`masked_mean`] divides.
fn count(m: &[Vec<bool>]) -> f32 {
    m.iter().flatten().filter(|&&k| k).count() as f32 + 1e-8
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn truncation_follows_torchtunes_docstring() {
        // The example of torchtune's `truncate_sequence_at_first_stop_token`.
        let mut seqs = vec![
            vec![869, 30, 869],
            vec![2, 30, 869],
            vec![869, 30, 2],
            vec![50, 30, 869],
            vec![13, 30, 2],
            vec![13, 30, 5],
            vec![13, 2, 20],
            vec![13, 2, 2],
            vec![2, 2, 2],
        ];
        let mask = truncate_at_first_stop(&mut seqs, &[2, 869], 0);
        let (f, t) = (false, true);
        assert_eq!(
            mask,
            vec![
                vec![f, t, t],
                vec![f, t, t],
                vec![f, t, t],
                vec![f, f, f],
                vec![f, f, f],
                vec![f, f, f],
                vec![f, f, t],
                vec![f, f, t],
                vec![f, t, t],
            ]
        );
        assert_eq!(seqs[0], vec![869, 0, 0]);
        assert_eq!(seqs[3], vec![50, 30, 869]);
        assert_eq!(seqs[6], vec![13, 2, 0]);
    }

    #[test]
    fn last_kept_index_is_torchtunes_sequence_length() {
        // torchtune's `get_unmasked_sequence_lengths` docstring: [1, 2, 3].
        let (f, t) = (false, true);
        assert_eq!(last_kept_index(&[f, f, t, t]), 1);
        assert_eq!(last_kept_index(&[f, f, f, t]), 2);
        assert_eq!(last_kept_index(&[f, f, f, f]), 3);
        assert_eq!(last_kept_index(&[t, t, t]), 0);
    }
}
