//! Reward-model training as TRL's `RewardTrainer` (trl 1.16.0) computes it: each row's reward is
//! the classifier's `score` at its last token that is not the pad id (transformers'
//! `GenericForSequenceClassification` pooling), and the loss of a pair is Bradley–Terry's
//! `−log σ(r_chosen − r_rejected − margin)` (the margin when the data has one), plus
//! `center_rewards_coefficient · (r_chosen + r_rejected)²` when that is set; the step's loss is
//! the mean over its pairs. The metrics are TRL's: `accuracy`, `margin`, `min_reward`,
//! `mean_reward`, `max_reward`.

use candle_core::{DType, Result, Tensor};

use crate::loss::softplus;

/// What a reward-model micro-batch adds: its rows are the `n` chosen sequences, then their `n`
/// rejected sequences.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardRows {
    /// Per row (`2n`), the position whose score is its reward: the last one whose token is not
    /// the pad id (0 if every token is), as transformers pools.
    pub pooled: Vec<usize>,
    /// Per pair (`n`), the margin the loss subtracts (the data's `margin` column).
    pub margins: Option<Vec<f32>>,
    /// `center_rewards_coefficient`.
    pub center: Option<f64>,
}

impl RewardRows {
    /// The rows of right-padded `ids` (chosen rows, then rejected rows), pooled where
    /// transformers pools with pad id `pad`.
    pub fn new(ids: &[Vec<u32>], pad: u32, margins: Option<Vec<f32>>) -> Self {
        let pooled = ids
            .iter()
            .map(|row| row.iter().rposition(|&t| t != pad).unwrap_or(0))
            .collect();
        Self {
            pooled,
            margins,
            center: None,
        }
    }
}

/// TRL's reward metrics as sums over a step's pairs (`chosen`, `rejected`, `correct`) and its
/// micro-batches (`min`, `max`: each micro-batch's extreme reward, `batches`: how many), which
/// the all-reduce over ranks adds up.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RewardStats {
    /// The chosen rows' rewards, summed.
    pub chosen: f64,
    /// The rejected rows' rewards, summed.
    pub rejected: f64,
    /// How many pairs reward the chosen row more.
    pub correct: f64,
    /// Each micro-batch's smallest reward, summed.
    pub min: f64,
    /// Each micro-batch's largest reward, summed.
    pub max: f64,
    /// How many micro-batches.
    pub batches: f64,
}

impl RewardStats {
    /// The sums in a fixed order, to all-reduce across ranks.
    pub fn to_vec(self) -> Vec<f64> {
        vec![
            self.chosen,
            self.rejected,
            self.correct,
            self.min,
            self.max,
            self.batches,
        ]
    }

    /// The inverse of [`RewardStats::to_vec`].
    pub fn from_slice(v: &[f64]) -> Self {
        Self {
            chosen: v[0],
            rejected: v[1],
            correct: v[2],
            min: v[3],
            max: v[4],
            batches: v[5],
        }
    }

    /// TRL's metric names and values for a step of `pairs` pairs: the accuracy and margin over
    /// the pairs, the mean reward over every row, and the micro-batches' mean of their smallest
    /// and largest reward (TRL averages each logged value over the micro-batches it saw).
    pub fn metrics(&self, pairs: usize) -> Vec<(&'static str, f64)> {
        let n = pairs.max(1) as f64;
        let b = self.batches.max(1.0);
        vec![
            ("accuracy", self.correct / n),
            ("margin", (self.chosen - self.rejected) / n),
            ("mean_reward", (self.chosen + self.rejected) / (2.0 * n)),
            ("min_reward", self.min / b),
            ("max_reward", self.max / b),
        ]
    }
}

crate::step::add_assign_by_sums!(RewardStats);

/// The loss *summed* over the pairs of a micro-batch from its rows' `rewards` (`[2n]`, chosen
/// rows first, differentiable), and its metrics. Summed so that the recipe's normalisation by the
/// step's pairs gives TRL's mean.
pub fn reward_loss_sum(rewards: &Tensor, rows: &RewardRows) -> Result<(Tensor, RewardStats)> {
    let rewards = rewards.to_dtype(DType::F32)?;
    let n = rewards.dim(0)? / 2;
    let chosen = rewards.narrow(0, 0, n)?;
    let rejected = rewards.narrow(0, n, n)?;
    let mut diff = (&chosen - &rejected)?;
    if let Some(m) = &rows.margins {
        diff = (diff - Tensor::from_slice(m, n, rewards.device())?)?;
    }
    // −log σ(x) = softplus(−x).
    let mut total = softplus(&diff.neg()?)?.sum_all()?;
    if let Some(coef) = rows.center {
        let centered = (&chosen + &rejected)?.sqr()?.sum_all()?;
        total = (total + (centered * coef)?)?;
    }
    let values: Vec<f32> = rewards.detach().to_vec1()?;
    let (c, r) = values.split_at(n);
    let stats = RewardStats {
        chosen: c.iter().map(|&x| x as f64).sum(),
        rejected: r.iter().map(|&x| x as f64).sum(),
        // In f32, as TRL compares its tensors.
        correct: c.iter().zip(r).filter(|(a, b)| a > b).count() as f64,
        min: values.iter().copied().fold(f32::INFINITY, f32::min) as f64,
        max: values.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64,
        batches: 1.0,
    };
    Ok((total, stats))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn pooling_takes_the_last_token_that_is_not_the_pad_id() {
        let rows = RewardRows::new(
            &[vec![5, 6, 2, 3, 3], vec![3, 3, 3], vec![4, 3, 7]],
            3,
            None,
        );
        assert_eq!(rows.pooled, vec![2, 0, 2]);
    }

    #[test]
    fn loss_is_bradley_terry_with_margin_and_centering() {
        let r = Tensor::new(&[1.0f32, -0.5, 0.25, 2.0], &Device::Cpu).unwrap();
        let rows = RewardRows {
            pooled: vec![0; 4],
            margins: Some(vec![0.5, -1.0]),
            center: Some(0.01),
        };
        let (loss, stats) = reward_loss_sum(&r, &rows).unwrap();
        let sp = |x: f64| (1.0 + x.exp()).ln();
        let want = sp(-(1.0 - 0.25 - 0.5))
            + sp(-(-0.5 - 2.0 + 1.0))
            + 0.01 * ((1.25f64).powi(2) + (1.5f64).powi(2));
        let got = loss.to_scalar::<f32>().unwrap() as f64;
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
        assert_eq!(stats.correct, 1.0);
        assert_eq!((stats.min, stats.max), (-0.5, 2.0));
        let m = stats.metrics(2);
        assert_eq!(m[0], ("accuracy", 0.5));
        assert_eq!(m[2], ("mean_reward", 2.75 / 4.0));
    }
}
