//! Next-token selection with transformers' logits-processor semantics and order: repetition
//! penalty, then temperature, top-k, top-p; `temperature == 0` is greedy.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How the next token is chosen.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingOptions {
    /// 0 = greedy (argmax).
    pub temperature: f64,
    /// Keep only the k most likely tokens (0 or None = off).
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches p (1.0 or None = off).
    pub top_p: Option<f64>,
    /// CTRL-style penalty on tokens already in the sequence (1.0 = off).
    pub repetition_penalty: f64,
    /// Seed of the sampling RNG.
    pub seed: u64,
}

impl Default for SamplingOptions {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            repetition_penalty: 1.0,
            seed: 42,
        }
    }
}

/// Chooses tokens from logits; owns the RNG so a seed reproduces a whole generation.
pub struct Sampler {
    opts: SamplingOptions,
    rng: StdRng,
}

impl Sampler {
    /// A sampler for `opts`.
    pub fn new(opts: SamplingOptions) -> Self {
        let rng = StdRng::seed_from_u64(opts.seed);
        Self { opts, rng }
    }

    /// Picks the next token from `logits` (one row, f32) given the tokens so far (`history`,
    /// prompt included, for the repetition penalty).
    pub fn next(&mut self, logits: &mut [f32], history: &[u32]) -> u32 {
        let penalty = self.opts.repetition_penalty;
        if penalty != 1.0 {
            let mut seen = history.to_vec();
            seen.sort_unstable();
            seen.dedup();
            for &t in &seen {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l < 0.0 {
                        *l * penalty as f32
                    } else {
                        *l / penalty as f32
                    };
                }
            }
        }
        if self.opts.temperature <= 0.0 {
            return argmax(logits);
        }
        let temp = self.opts.temperature as f32;
        logits.iter_mut().for_each(|l| *l /= temp);
        if let Some(k) = self.opts.top_k.filter(|&k| k > 0 && k < logits.len()) {
            // Keep everything at least as large as the k-th largest value (ties survive, as in
            // transformers' TopKLogitsWarper). A selection, not a sort: O(vocab) per token.
            let mut values: Vec<f32> = logits.to_vec();
            let (_, &mut kth, _) = values.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
            logits
                .iter_mut()
                .filter(|l| **l < kth)
                .for_each(|l| *l = f32::NEG_INFINITY);
        }
        let mut probs = softmax(logits);
        if let Some(p) = self.opts.top_p.filter(|&p| p < 1.0) {
            // transformers' TopPLogitsWarper: sort ascending, drop tokens whose cumulative
            // probability stays <= 1 - p, always keep the most likely one. Tokens already at
            // probability 0 (cut by top-k) would come first, add nothing and stay 0, so only the
            // others are sorted: the same result, and after top-k a sort of k tokens, not the vocab.
            let mut order: Vec<usize> = (0..probs.len()).filter(|&i| probs[i] > 0.0).collect();
            order.sort_by(|&a, &b| probs[a].total_cmp(&probs[b]));
            let mut cum = 0f32;
            let last = order.len() - 1;
            for (rank, &i) in order.iter().enumerate() {
                cum += probs[i];
                if cum <= (1.0 - p) as f32 && rank != last {
                    probs[i] = 0.0;
                }
            }
            let sum: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|q| *q /= sum);
        }
        let r: f32 = self.rng.random();
        let mut acc = 0f32;
        for (i, &q) in probs.iter().enumerate() {
            acc += q;
            if r < acc {
                return i as u32;
            }
        }
        // Rounding left `acc` a hair under 1: fall back to the most likely token.
        argmax(&probs)
    }
}

/// The probabilities of `logits`: `exp(l - max)`, normalized to sum 1.
fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut probs: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    probs
}

/// Index of the largest value; the first one on ties (as `torch.argmax`).
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_max() {
        let mut s = Sampler::new(SamplingOptions::default());
        assert_eq!(s.next(&mut [1.0, 3.0, 3.0, 2.0], &[]), 1);
    }

    #[test]
    fn repetition_penalty_follows_ctrl_rule() {
        // token 1 seen: 3.0 / 2 = 1.5 < 2.0, so greedy moves to token 3.
        let mut s = Sampler::new(SamplingOptions {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        assert_eq!(s.next(&mut [1.0, 3.0, -5.0, 2.0], &[1, 1]), 3);
        // negative logits get multiplied (more negative).
        let mut l = [-1.0f32, 0.5];
        let mut s = Sampler::new(SamplingOptions {
            repetition_penalty: 2.0,
            ..Default::default()
        });
        s.next(&mut l, &[0]);
        assert_eq!(l[0], -2.0);
    }

    #[test]
    fn top_k_one_is_greedy_and_top_p_small_keeps_best() {
        for seed in 0..20 {
            for (top_k, top_p) in [(Some(1), None), (None, Some(0.01))] {
                let mut s = Sampler::new(SamplingOptions {
                    temperature: 1.0,
                    top_k,
                    top_p,
                    seed,
                    ..Default::default()
                });
                assert_eq!(s.next(&mut [0.1, 0.2, 5.0, 0.3], &[]), 2);
            }
        }
    }

    /// The filtering as first written: full sorts of the vocabulary.
    fn reference_filter(logits: &[f32], k: usize, p: f32) -> Vec<f32> {
        let mut l = logits.to_vec();
        let mut sorted = l.clone();
        sorted.sort_unstable_by(|a, b| b.total_cmp(a));
        let kth = sorted[k - 1];
        l.iter_mut()
            .filter(|x| **x < kth)
            .for_each(|x| *x = f32::NEG_INFINITY);
        let mut probs = softmax(&l);
        let mut order: Vec<usize> = (0..probs.len()).collect();
        order.sort_by(|&a, &b| probs[a].total_cmp(&probs[b]));
        let (mut cum, last) = (0f32, order.len() - 1);
        for (rank, &i) in order.iter().enumerate() {
            cum += probs[i];
            if cum <= 1.0 - p && rank != last {
                probs[i] = 0.0;
            }
        }
        probs
    }

    #[test]
    fn top_k_and_top_p_draw_what_full_sorts_would() {
        // Logits with ties (rounded to quarters) over a 3000-token vocabulary; the same seed must
        // draw the same token as sampling from the reference's filtered distribution.
        let mut rng = StdRng::seed_from_u64(3);
        for case in 0..40 {
            let logits: Vec<f32> = (0..3000)
                .map(|_| (rng.random::<f32>() * 24.0).round() / 4.0)
                .collect();
            let (k, p) = (1 + case * 37 % 400, 0.5 + (case % 5) as f32 * 0.1);
            let probs = reference_filter(&logits, k, p);
            let sum: f32 = probs.iter().sum();
            let mut s = Sampler::new(SamplingOptions {
                temperature: 1.0,
                top_k: Some(k),
                top_p: Some(p as f64),
                seed: case as u64,
                ..Default::default()
            });
            let got = s.next(&mut logits.clone(), &[]);
            let r: f32 = StdRng::seed_from_u64(case as u64).random();
            let mut acc = 0f32;
            let want = probs
                .iter()
                .position(|&q| {
                    acc += q / sum;
                    r < acc
                })
                .unwrap_or_else(|| argmax(&probs) as usize);
            assert_eq!(got as usize, want, "case {case} (k {k}, p {p})");
        }
    }

    #[test]
    fn sampling_is_seeded_and_follows_the_distribution() {
        let opts = SamplingOptions {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        };
        let logits = [0f32, (3f32).ln()]; // probabilities 0.25 / 0.75
        let draw = |opts: &SamplingOptions| {
            let mut s = Sampler::new(opts.clone());
            (0..4000)
                .map(|_| s.next(&mut logits.clone(), &[]))
                .collect::<Vec<_>>()
        };
        let a = draw(&opts);
        assert_eq!(a, draw(&opts), "same seed, same tokens");
        let ones = a.iter().filter(|&&t| t == 1).count() as f64 / a.len() as f64;
        assert!((ones - 0.75).abs() < 0.03, "frequency {ones}");
        let b = draw(&SamplingOptions { seed: 8, ..opts });
        assert_ne!(a, b);
    }
}
