//! LayerSkip's training pieces, as torchtune's `dev/early_exit_finetune_distributed` recipe uses
//! them (`torchtune.modules.early_exit_loss`, `torchtune.modules.layer_dropout`):
//!
//! - **early-exit loss**: the hidden state entering chosen layers goes through the final norm and
//!   the output head, and the loss is a weighted sum of those layers' cross-entropies
//!   ([`ScaleFn`] weighs them); a [`Curriculum`] changes which layers count as training goes on.
//!   As in torchtune, layer `i` means the hidden state *entering* layer `i` (0 = the embeddings),
//!   and with any exit chosen the loss is the early-exit loss alone: the final output is not in it.
//! - **layer dropout**: each layer skips a random subset of the batch's rows (their hidden states
//!   pass through unchanged), with a per-layer probability rising across layers
//!   ([`DropoutScale`]). Each layer draws from its own `torch.Generator` seeded with its index
//!   (MT19937, `torch.bernoulli` on f32 probabilities), so the same rows are skipped as in
//!   torchtune.
//!
//! Numbers only; the recipe wires them into the training step (`crate::step::LayerSkip`).

use anyhow::{bail, Result};
use rand_mt::Mt;

/// torchtune's `slice_str_to_array`: which of `length` layers a string selects — a numpy-like
/// slice (`"0::4"`, `"1:3"`, `":"`), one index (`"5"`) or a comma list (`"8,12,16"`).
pub fn slice_str_to_array(slice: &str, length: usize) -> Result<Vec<bool>> {
    let parse = |s: &str| -> Result<i64> {
        s.trim()
            .parse::<i64>()
            .map_err(|_| anyhow::anyhow!("'{slice}': '{s}' is not an integer"))
    };
    if slice.contains(',') {
        if slice.contains(':') {
            bail!("'{slice}': cannot mix commas and colons");
        }
        let mut out = vec![false; length];
        for part in slice.split(',') {
            let i = parse(part)?;
            if i < 0 || i as usize >= length {
                bail!("'{slice}': index {i} is out of range (the model has {length} layers)");
            }
            out[i as usize] = true;
        }
        return Ok(out);
    }
    let parts: Vec<&str> = slice.split(':').collect();
    if parts.len() > 3 {
        bail!("'{slice}': not a slice (at most start:end:step)");
    }
    let opt = |s: &str| -> Result<Option<i64>> {
        if s.trim().is_empty() {
            Ok(None)
        } else {
            parse(s).map(Some)
        }
    };
    let (start, end, step) = match parts.as_slice() {
        [one] => match opt(one)? {
            Some(i) => (Some(i), Some(i + 1), Some(1)),
            None => (None, None, None),
        },
        [a, b] => (opt(a)?, opt(b)?, None),
        [a, b, c] => (opt(a)?, opt(b)?, opt(c)?),
        _ => unreachable!("split yields one to three parts here"),
    };
    let len = length as i64;
    if start.is_some_and(|s| !(0..len).contains(&s)) {
        bail!("'{slice}': start index out of range (the model has {length} layers)");
    }
    // torchtune asserts `end < length` too (so `0:32` of 32 layers is refused; `0:` is the way).
    if end.is_some_and(|e| !(0..len).contains(&e)) && parts.len() > 1 {
        bail!("'{slice}': end index out of range (the model has {length} layers; leave it out to reach the last)");
    }
    if step == Some(0) {
        bail!("'{slice}': step cannot be zero");
    }
    let (start, end, step) = (start.unwrap_or(0), end.unwrap_or(len), step.unwrap_or(1));
    let mut out = vec![false; length];
    let mut i = start;
    // Python's range(start, end, step).
    while (step > 0 && i < end) || (step < 0 && i > end) {
        if (0..len).contains(&i) {
            out[i as usize] = true;
        }
        i += step;
    }
    Ok(out)
}

/// How the early-exit losses of the chosen layers are weighed (`early_exit_loss.scale_fn`,
/// `torchtune.modules.early_exit_loss.*_loss_scale`). Every function multiplies the layers other
/// than the last by `early_exit_loss.scale` and normalises the weights to sum to 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleFn {
    /// `uniform_loss_scale`: every layer alike.
    Uniform,
    /// `linear_l_loss_scale`: `l + 1`.
    LinearL,
    /// `sum_l_loss_scale` (the recipe's default): the running sum of `l + 1` over the chosen
    /// layers.
    SumL,
    /// `sqrt_l_loss_scale`: `√(l + 1)`.
    SqrtL,
    /// `inv_l_loss_scale`: `1 / (l + 1)`.
    InvL,
    /// `inv_sqrt_l_loss_scale`: `1 / √(l + 1)`.
    InvSqrtL,
}

impl ScaleFn {
    /// From a `scale_fn` path such as `torchtune.modules.early_exit_loss.sum_l_loss_scale`.
    pub fn from_component(path: &str) -> Result<Self> {
        Ok(match path.rsplit('.').next().unwrap_or("") {
            "uniform_loss_scale" => ScaleFn::Uniform,
            "linear_l_loss_scale" => ScaleFn::LinearL,
            "sum_l_loss_scale" => ScaleFn::SumL,
            "sqrt_l_loss_scale" => ScaleFn::SqrtL,
            "inv_l_loss_scale" => ScaleFn::InvL,
            "inv_sqrt_l_loss_scale" => ScaleFn::InvSqrtL,
            _ => bail!(
                "'{path}' is not one of torchtune.modules.early_exit_loss's scale functions \
                 (uniform_loss_scale, linear_l_loss_scale, sum_l_loss_scale, sqrt_l_loss_scale, \
                 inv_l_loss_scale, inv_sqrt_l_loss_scale)"
            ),
        })
    }

    /// The weight of each chosen layer (`layers`, ascending) of a model with `num_layers`
    /// layers, computed in f32 as torch does.
    pub fn weights(self, layers: &[usize], num_layers: usize, scale: f64) -> Vec<f64> {
        let ids: Vec<f32> = layers.iter().map(|&l| l as f32).collect();
        let mut running = 0f32;
        let raw: Vec<f32> = ids
            .iter()
            .map(|&l| match self {
                ScaleFn::Uniform => 1.0,
                ScaleFn::LinearL => l + 1.0,
                ScaleFn::SumL => {
                    running += l + 1.0;
                    running
                }
                ScaleFn::SqrtL => (l + 1.0).sqrt(),
                ScaleFn::InvL => 1.0 / (l + 1.0),
                ScaleFn::InvSqrtL => 1.0 / (l + 1.0).sqrt(),
            })
            .collect();
        let scaled: Vec<f32> = raw
            .iter()
            .zip(layers)
            .map(|(&w, &l)| {
                if l + 1 < num_layers {
                    w * scale as f32
                } else {
                    w
                }
            })
            .collect();
        let total: f32 = scaled.iter().sum();
        scaled.iter().map(|&w| f64::from(w / total)).collect()
    }
}

/// Which layers' early-exit losses count at each step (`early_exit_loss.curriculum`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Curriculum {
    /// No curriculum (or torchtune's base `EarlyExitCurriculum`): the chosen layers throughout.
    Fixed,
    /// `RotationalEarlyExitCurriculum`: the selection rotates one layer up after every step.
    Rotational,
    /// `GradualEarlyExitCurriculum`: layers join from the top down, all of the chosen ones by
    /// half of the training steps.
    Gradual,
}

impl Curriculum {
    /// From a `curriculum` path (`None`/null: [`Curriculum::Fixed`]).
    pub fn from_component(path: Option<&str>) -> Result<Self> {
        let Some(path) = path else {
            return Ok(Curriculum::Fixed);
        };
        Ok(match path.rsplit('.').next().unwrap_or("") {
            "EarlyExitCurriculum" => Curriculum::Fixed,
            "RotationalEarlyExitCurriculum" => Curriculum::Rotational,
            "GradualEarlyExitCurriculum" => Curriculum::Gradual,
            _ => bail!(
                "'{path}' is not one of torchtune.modules.early_exit_loss's curricula \
                 (RotationalEarlyExitCurriculum, GradualEarlyExitCurriculum)"
            ),
        })
    }
}

/// The gradual curriculum's `fraction_scale`: every chosen layer is on by this fraction of the
/// training steps (torchtune's recipe leaves the default).
const GRADUAL_FRACTION: f64 = 0.5;

/// The early-exit loss of a run (`early_exit_loss`).
#[derive(Debug, Clone, PartialEq)]
pub struct EarlyExitLoss {
    /// `layers`, as a mask over the model's layers.
    pub chosen: Vec<bool>,
    pub curriculum: Curriculum,
    pub scale_fn: ScaleFn,
    /// `scale`: the weight of the layers below the last before normalisation.
    pub scale: f64,
    /// `include_last_layer`: the last layer's input always counts.
    pub include_last_layer: bool,
    /// The run's optimizer steps (`epochs × steps per epoch`), the gradual curriculum's span.
    pub max_steps: usize,
}

impl EarlyExitLoss {
    /// The layers (ascending) whose entering hidden states have an exit loss in the step taken
    /// after `global_step` earlier ones, with their weights. Empty: the plain loss of the final
    /// output (torchtune's recipe falls back to it when no layer is selected).
    pub fn exits_at(&self, global_step: usize, num_layers: usize) -> Vec<(usize, f64)> {
        let n = self.chosen.len();
        let mut mask: Vec<bool> = match self.curriculum {
            Curriculum::Fixed => self.chosen.clone(),
            // np.roll by one per step already taken.
            Curriculum::Rotational => (0..n)
                .map(|i| self.chosen[(i + n - global_step % n.max(1)) % n.max(1)])
                .collect(),
            // Its n-th step enables layer l when (n − 1) / max_steps ≥ 0.5 · (L − l) / L.
            Curriculum::Gradual if global_step == 0 => vec![false; n],
            Curriculum::Gradual => {
                let fraction = (global_step - 1) as f64 / self.max_steps.max(1) as f64;
                (0..n)
                    .map(|l| {
                        self.chosen[l] && fraction >= GRADUAL_FRACTION * (n - l) as f64 / n as f64
                    })
                    .collect()
            }
        };
        if self.include_last_layer && n > 0 {
            mask[n - 1] = true;
        }
        let layers: Vec<usize> = (0..n).filter(|&i| mask[i]).collect();
        let weights = self.scale_fn.weights(&layers, num_layers, self.scale);
        layers.into_iter().zip(weights).collect()
    }
}

/// How layer dropout's probability grows across layers (`layer_dropout.layers_scale`,
/// torchtune's `ScaleType`): from 0 at the first layer to `prob` at the last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DropoutScale {
    Uniform,
    Exp,
    Linear,
    Log,
    Sin,
    Sigmoid,
}

impl DropoutScale {
    /// From `uniform`, `exp`, `linear`, `log`, `sin` or `sigmoid`.
    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s {
            "uniform" => DropoutScale::Uniform,
            "exp" => DropoutScale::Exp,
            "linear" => DropoutScale::Linear,
            "log" => DropoutScale::Log,
            "sin" => DropoutScale::Sin,
            "sigmoid" => DropoutScale::Sigmoid,
            _ => bail!(
                "'{s}' is not a layer-dropout scale (uniform, exp, linear, log, sin, sigmoid)"
            ),
        })
    }

    /// torchtune's `get_scale`: 0 at `val` 0, 1 at `val ≥ period`, clamped to [0, 1].
    pub fn at(self, period: usize, val: usize) -> f64 {
        if period == 0 || val >= period {
            return 1.0;
        }
        let (v, p) = (val as f64, period as f64);
        let s = match self {
            DropoutScale::Uniform => 1.0,
            DropoutScale::Exp => 2f64.powf(v / p) - 1.0,
            DropoutScale::Linear => v / p,
            DropoutScale::Log => (v + 1.0).ln() / (p + 1.0).ln(),
            DropoutScale::Sin => (0.5 * std::f64::consts::PI * v / p).sin(),
            DropoutScale::Sigmoid => 1.0 / (1.0 + (-10.0 * (v / p - 0.5)).exp()),
        };
        s.clamp(0.0, 1.0)
    }
}

/// Layer dropout over a model's layers (`layer_dropout`): each layer's probability of skipping a
/// row, and its generator.
pub struct LayerDropout {
    /// Per layer, the probability as torch holds it (f32).
    probs: Vec<f32>,
    generators: Vec<Mt>,
}

impl LayerDropout {
    /// `prob` at most, scaled across layers by `scale`, on the layers `applies` selects (the
    /// others 0); each layer's generator seeded with its index, then advanced past the draws of
    /// `rows_drawn` earlier rows (a resumed run continues the sequence).
    pub fn new(prob: f64, scale: DropoutScale, applies: &[bool], rows_drawn: u64) -> Self {
        let n = applies.len();
        let probs: Vec<f32> = (0..n)
            .map(|l| {
                if applies[l] {
                    (prob * scale.at(n.saturating_sub(1), l)) as f32
                } else {
                    0.0
                }
            })
            .collect();
        let generators = (0..n)
            .map(|l| {
                let mut mt = Mt::new(l as u32);
                if probs[l] != 0.0 {
                    for _ in 0..rows_drawn {
                        mt.next_u32();
                    }
                }
                mt
            })
            .collect();
        Self { probs, generators }
    }

    /// Each layer's probability of skipping a row.
    pub fn probabilities(&self) -> &[f32] {
        &self.probs
    }

    /// The rows each layer runs for a micro-batch of `rows` rows: `None` where it runs them all
    /// (a layer with probability 0 draws nothing, as torchtune's), otherwise the kept rows in
    /// order (possibly none: the layer is skipped for the whole batch).
    pub fn draw(&mut self, rows: usize) -> Vec<Option<Vec<usize>>> {
        self.probs
            .iter()
            .zip(&mut self.generators)
            .map(|(&p, mt)| {
                if p == 0.0 {
                    return None;
                }
                // torch.bernoulli(p) on CPU: uniform = (random() & (2²⁴ − 1)) · 2⁻²⁴ < p, in f32.
                let kept: Vec<usize> = (0..rows)
                    .filter(|_| {
                        let u = (mt.next_u32() & 0x00FF_FFFF) as f32 * (1.0 / 16_777_216.0);
                        u >= p
                    })
                    .collect();
                (kept.len() < rows).then_some(kept)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_select_as_torchtune() {
        let on = |s: &str, n: usize| -> Vec<usize> {
            let m = slice_str_to_array(s, n).unwrap();
            (0..n).filter(|&i| m[i]).collect()
        };
        // torchtune's docstring examples.
        assert_eq!(on("1:3", 5), vec![1, 2]);
        assert_eq!(on(":", 5), vec![0, 1, 2, 3, 4]);
        assert_eq!(on("::2", 5), vec![0, 2, 4]);
        assert_eq!(on("1::2", 5), vec![1, 3]);
        assert_eq!(on("2:5:2", 6), vec![2, 4]);
        assert_eq!(on("0,4,5", 7), vec![0, 4, 5]);
        assert_eq!(on("0::4", 10), vec![0, 4, 8]);
        assert_eq!(on("3", 5), vec![3]);
        for bad in ["0:5", "1,2:3", "9", "::0", "a:b", "1:2:3:4"] {
            assert!(slice_str_to_array(bad, 5).is_err(), "{bad}");
        }
    }

    #[test]
    fn scale_functions_weigh_as_torchtune() {
        // By hand: layers 0, 2, 3 of 4 with scale 0.5 (layer 3 is the last: unscaled).
        let w = ScaleFn::SumL.weights(&[0, 2, 3], 4, 0.5);
        // cumsum(1, 3, 4) = 1, 4, 8 -> 0.5, 2, 8 over 10.5.
        let want = [0.5 / 10.5, 2.0 / 10.5, 8.0 / 10.5];
        for (a, b) in w.iter().zip(want) {
            assert!((a - b).abs() < 1e-7, "{w:?}");
        }
        let w = ScaleFn::InvL.weights(&[1, 3], 4, 1.0);
        assert!((w[0] - 2.0 / 3.0).abs() < 1e-7 && (w[1] - 1.0 / 3.0).abs() < 1e-7);
        assert!(ScaleFn::from_component("x.nope").is_err());
    }

    #[test]
    fn curricula_follow_torchtune() {
        let ee = |curriculum| EarlyExitLoss {
            chosen: vec![true, false, false, true, false, false],
            curriculum,
            scale_fn: ScaleFn::Uniform,
            scale: 1.0,
            include_last_layer: true,
            max_steps: 8,
        };
        let layers = |e: &EarlyExitLoss, s| -> Vec<usize> {
            e.exits_at(s, 6).into_iter().map(|(l, _)| l).collect()
        };
        let fixed = ee(Curriculum::Fixed);
        assert_eq!(layers(&fixed, 5), vec![0, 3, 5]);
        let rot = ee(Curriculum::Rotational);
        assert_eq!(layers(&rot, 0), vec![0, 3, 5]);
        assert_eq!(layers(&rot, 1), vec![1, 4, 5]);
        assert_eq!(layers(&rot, 3), vec![0, 3, 5]);
        let gradual = ee(Curriculum::Gradual);
        assert_eq!(layers(&gradual, 0), vec![5]);
        // Step s uses fraction (s − 1)/8: layer 3 needs 0.5·3/6 = 0.25 (s = 3), layer 0 needs 0.5.
        assert_eq!(layers(&gradual, 2), vec![5]);
        assert_eq!(layers(&gradual, 3), vec![3, 5]);
        assert_eq!(layers(&gradual, 5), vec![0, 3, 5]);
    }

    #[test]
    fn dropout_scales_and_draws() {
        assert_eq!(DropoutScale::Exp.at(4, 0), 0.0);
        assert!((DropoutScale::Exp.at(4, 2) - (2f64.sqrt() - 1.0)).abs() < 1e-12);
        assert_eq!(DropoutScale::Linear.at(4, 4), 1.0);
        assert!(DropoutScale::parse("step").is_err());
        // Layer 0's probability is 0 under exp: it never draws; resuming skips earlier draws.
        let mut a = LayerDropout::new(0.5, DropoutScale::Exp, &[true; 3], 0);
        assert_eq!(a.probabilities()[0], 0.0);
        let first = a.draw(4);
        let second = a.draw(4);
        assert!(first[0].is_none());
        let mut resumed = LayerDropout::new(0.5, DropoutScale::Exp, &[true; 3], 4);
        assert_eq!(resumed.draw(4), second);
    }
}
