//! GRPO's arithmetic as torchtune's dev GRPO recipe defines it (`torchtune.dev.grpo`): the shaped
//! correctness reward of a completion, group-relative advantages, and the two policy losses
//! (`GRPOSimpleLoss`, TRL's one-step form, and `GRPOLoss`, the clipped token-level form).
//!
//! Per-token quantities are `[rows][response tokens]` host vectors in f32, as in [`crate::rlhf`];
//! only the loss is a tensor. A *keep* mask is true where a response token counts (up to and
//! including the first stop token).

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};

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

/// Which of torchtune's GRPO losses, with its settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GrpoLossKind {
    /// `GRPOSimpleLoss`: `exp(π − sg(π))·A − β·KL` per token, averaged per response, then over
    /// responses. Its gradient is the policy gradient of one step from the sampling policy.
    Simple,
    /// `GRPOLoss`: PPO's clipped ratio against the sampling policy's log probabilities, with
    /// `epsilon`, and `β·KL`, each averaged over every kept token of the batch.
    Clipped { epsilon: f64 },
}

/// The loss settings (torchtune's `loss:` section).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GrpoLossConfig {
    pub kind: GrpoLossKind,
    /// β, the weight of the KL estimate to the reference policy.
    pub kl_coeff: f64,
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
}

impl BatchTotals {
    /// The totals of a batch with keep mask `keep`.
    pub fn of(keep: &[Vec<bool>]) -> Self {
        BatchTotals {
            rows: keep.len(),
            kept: keep.iter().flatten().filter(|&&k| k).count(),
            positions: keep.iter().map(Vec::len).sum(),
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
}
