//! Causal-LM cross-entropy, as `F.cross_entropy(logits.float(), labels, ignore_index=-100)`.
//!
//! The loss is returned as a *sum* over target tokens together with the number of target tokens.
//! A recipe divides the sum by the number of target tokens of the whole optimizer step (all
//! micro-batches), which makes gradient accumulation over N micro-batches identical to one batch
//! N times larger; per-micro-batch means would weight short and long micro-batches equally.
//!
//! The log-softmax is composed from differentiable candle primitives (max, exp, sum, log, gather):
//! candle-nn's fused softmax/log-softmax kernels have no backward pass.
//!
//! Memory: the rows are not processed in chunks, because with candle's autograd that would not
//! lower the footprint: the graph keeps every intermediate alive until `backward`, so about three
//! f32 copies of `[rows, V]` (upcast logits, max-shifted logits, their exp) stay resident whatever
//! the chunking. A leaner loss needs an op with a hand-written backward (recomputing the softmax from
//! the logits and the saved log-sum-exp), which candle only allows with per-device forward kernels.

use candle_core::{bail, DType, Result, Tensor};

/// Label value excluded from the loss (PyTorch's default `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// `-100` as it reads once stored in a `u32` tensor (two's complement), also treated as ignored.
const IGNORE_INDEX_U32: i64 = (IGNORE_INDEX as i32 as u32) as i64;

/// The summed token loss of a batch and how many target tokens it covers.
#[derive(Debug, Clone)]
pub struct LossSum {
    /// Sum of the per-token negative log-likelihoods: an f32 scalar, differentiable w.r.t. the logits.
    pub sum: Tensor,
    /// Number of target tokens (labels other than [`IGNORE_INDEX`]) that entered `sum`.
    pub count: usize,
}

impl LossSum {
    /// `sum / count`: the batch mean (`F.cross_entropy`'s default `reduction="mean"`).
    ///
    /// With no target token this is NaN (0/0), as in PyTorch.
    pub fn mean(&self) -> Result<Tensor> {
        self.normalized(self.count)
    }

    /// `sum / total`: the share of an optimizer step whose micro-batches hold `total` target tokens
    /// in all. Backpropagating each micro-batch's share accumulates exactly the gradient of the
    /// mean over the whole step.
    pub fn normalized(&self, total: usize) -> Result<Tensor> {
        // Division by a scalar tensor rather than `affine(1/total)`: a true division, as torch's.
        let denom = Tensor::new(total as f32, self.sum.device())?;
        self.sum.broadcast_div(&denom)
    }
}

/// Causal-LM cross-entropy of `logits` `[b, t, V]` (any float dtype) against `labels` `[b, t]`
/// (`i64`, or `u32`/`u8` without ignored positions, or `u32` holding `-100` as `u32`).
///
/// With `shift` set (the usual case) position `i` predicts label `i + 1`: `logits[:, :-1]` is scored
/// against `labels[:, 1:]`, as Hugging Face models do internally. Without it the labels are taken as
/// already shifted (torchtune's recipes shift them in the data pipeline) and `logits[:, i]` is scored
/// against `labels[:, i]`.
///
/// The log-softmax runs in f32 whatever the logits dtype (torchtune upcasts before the loss); the
/// gradient flowing back into the logits is cast to their dtype by candle's `to_dtype` backward.
pub fn causal_lm_loss(logits: &Tensor, labels: &Tensor, shift: bool) -> Result<LossSum> {
    let (b, t, vocab) = logits.dims3()?;
    let (lb, lt) = labels.dims2()?;
    if (lb, lt) != (b, t) {
        bail!(
            "causal_lm_loss: logits {:?} vs labels {:?}",
            logits.dims(),
            labels.dims()
        );
    }
    // The shift goes into the targets (the last position of a row scores nothing) rather than a
    // copy of `logits[:, :-1]`; `cross_entropy_sum` runs fused on the CPU in f32 and from candle
    // ops elsewhere.
    let targets = shifted_targets(labels, shift, vocab)?;
    let flat = logits.reshape((b * t, vocab))?.to_dtype(DType::F32)?;
    let (sum, count) = ferrotune_core::fused::cross_entropy_sum(&flat, &targets, IGNORE_INDEX)?;
    Ok(LossSum { sum, count })
}

/// The loss of `model`'s output head applied to `hidden` (`[b, t, h]`): the same value as
/// `causal_lm_loss(model.logits(hidden), labels, shift)`, but for a head without adapter, bias or
/// logit softcap (frozen, or trained by full fine-tuning) in f32 on the CPU or f32/bf16 on a GPU
/// the logits are formed and consumed in row chunks
/// ([`ferrotune_core::fused::linear_cross_entropy_sum`]), never whole, and rows without a target
/// are skipped.
pub fn causal_lm_head_loss(
    hidden: &Tensor,
    model: &ferrotune_models::CausalLm,
    labels: &Tensor,
    shift: bool,
) -> Result<LossSum> {
    let lm_head = &model.lm_head;
    let weight = match lm_head.weight.as_dense() {
        Some(w)
            if lm_head.adapter.is_none()
                && lm_head.bias.is_none()
                && lm_head.fake_quant.is_none_or(|f| !f.enabled)
                && model.config.final_logit_softcapping.is_none()
                && ferrotune_core::fused::chunked_head_applies(hidden, w) =>
        {
            w
        }
        _ => return causal_lm_loss(&model.logits(hidden)?, labels, shift),
    };
    let (b, t, h) = hidden.dims3()?;
    let vocab = weight.dim(0)?;
    let targets = shifted_targets(labels, shift, vocab)?;
    let flat = hidden.reshape((b * t, h))?;
    let (sum, count) =
        ferrotune_core::fused::linear_cross_entropy_sum(&flat, weight, &targets, IGNORE_INDEX)?;
    Ok(LossSum { sum, count })
}

/// Per-position targets for `[b, t]` labels: `labels[i + 1]` with `shift` (the last position of a
/// row scores nothing), checked against the vocabulary; -100 (also as u32) = none.
pub(crate) fn shifted_targets(labels: &Tensor, shift: bool, vocab: usize) -> Result<Vec<i64>> {
    let t = labels.dim(1)?;
    if shift && t < 2 {
        bail!("causal_lm_loss: shifting needs at least 2 positions, got {t}");
    }
    let raw = labels.to_dtype(DType::I64)?.to_vec2::<i64>()?;
    let u32_labels = labels.dtype() == DType::U32;
    let mut targets = Vec::with_capacity(raw.len() * t);
    for row in &raw {
        for p in 0..t {
            let l = if shift {
                row.get(p + 1).copied().unwrap_or(IGNORE_INDEX)
            } else {
                row[p]
            };
            let l = if u32_labels && l == IGNORE_INDEX_U32 {
                IGNORE_INDEX
            } else {
                l
            };
            if l != IGNORE_INDEX && (l < 0 || l as usize >= vocab) {
                bail!("causal_lm_loss: label {l} outside the vocabulary (size {vocab})");
            }
            targets.push(l);
        }
    }
    Ok(targets)
}

/// [`causal_lm_loss`] reduced to its mean over target tokens (`F.cross_entropy` default reduction).
pub fn causal_lm_loss_mean(logits: &Tensor, labels: &Tensor, shift: bool) -> Result<Tensor> {
    causal_lm_loss(logits, labels, shift)?.mean()
}

/// torchtune's distillation losses (`kd_loss._component_`), each summed over the positions with a
/// target. torchtune's "forward KL" is the cross-entropy of the student against the teacher's
/// distribution, `−Σ p_t · log p_s` (without the teacher's entropy, which has no gradient).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KdLoss {
    /// `ForwardKLLoss` / `ForwardKLWithChunkedOutputLoss`: `−Σ p_t log p_s`.
    Forward,
    /// `ReverseKLLoss` / `ReverseKLWithChunkedOutputLoss`: `−Σ (p_s log p_t − p_s log p_s)`.
    Reverse,
    /// `SymmetricKLLoss` / `SymmetricKLWithChunkedOutputLoss`: `r · forward + (1 − r) · reverse`.
    Symmetric(f64),
}

impl KdLoss {
    /// The loss a torchtune component names (`torchtune.modules.loss.ForwardKLWithChunkedOutputLoss`,
    /// ...); `sym_kd_ratio` is the symmetric loss's weight of the forward term.
    pub fn from_component(component: &str, sym_kd_ratio: Option<f64>) -> Option<Self> {
        let name = component.rsplit('.').next().unwrap_or(component);
        let name = name.replace("WithChunkedOutput", "");
        match name.as_str() {
            "ForwardKLLoss" => Some(Self::Forward),
            "ReverseKLLoss" => Some(Self::Reverse),
            "SymmetricKLLoss" => Some(Self::Symmetric(sym_kd_ratio.unwrap_or(0.5))),
            _ => None,
        }
    }
}

/// `x − logsumexp(x)` along the last dimension, from differentiable ops (the max is a constant
/// shift, as in torch's implementation).
pub(crate) fn log_softmax(x: &Tensor) -> Result<Tensor> {
    let shifted = x.broadcast_sub(&x.max_keepdim(candle_core::D::Minus1)?.detach())?;
    let lse = shifted.exp()?.sum_keepdim(candle_core::D::Minus1)?.log()?;
    shifted.broadcast_sub(&lse)
}

/// The distillation loss *sum* of `student` logits against `teacher` logits (both `[b, t, V]`)
/// over the positions that have a target in `labels` (shifted as [`causal_lm_loss`] shifts
/// them), with the number of those positions. Computed in f32 (torchtune upcasts both); the
/// teacher's logits take no gradient. Terms at infinite logits count 0, as torchtune masks them.
pub fn kd_loss_sum(
    student: &Tensor,
    teacher: &Tensor,
    labels: &Tensor,
    kind: KdLoss,
) -> Result<LossSum> {
    let (b, t, vocab) = student.dims3()?;
    if teacher.dims() != student.dims() {
        bail!(
            "distillation: teacher logits {:?} vs student logits {:?} (the models' vocabularies must match)",
            teacher.dims(),
            student.dims()
        );
    }
    let targets = shifted_targets(labels, true, vocab)?;
    let rows: Vec<u32> = targets
        .iter()
        .enumerate()
        .filter(|(_, &l)| l != IGNORE_INDEX)
        .map(|(i, _)| i as u32)
        .collect();
    let count = rows.len();
    if count == 0 {
        return Ok(LossSum {
            sum: Tensor::zeros((), DType::F32, student.device())?,
            count,
        });
    }
    let idx = Tensor::from_vec(rows, count, student.device())?;
    let pick = |x: &Tensor| -> Result<Tensor> { x.reshape((b * t, vocab))?.index_select(&idx, 0) };
    let sum = kd_rows_sum(&pick(student)?, &pick(teacher)?, kind)?;
    Ok(LossSum { sum, count })
}

/// The distillation loss *sum* over rows of `student` and `teacher` logits (both `[n, V]`, every
/// row counted), in f32; the teacher takes no gradient. The core of [`kd_loss_sum`], and what the
/// chunked distillation head applies to each chunk of target rows.
pub fn kd_rows_sum(student: &Tensor, teacher: &Tensor, kind: KdLoss) -> Result<Tensor> {
    let s = student.to_dtype(DType::F32)?;
    let tl = teacher.detach().to_dtype(DType::F32)?;
    // One pass per row without `[n, V]` intermediates where it can (f32 CPU, finite logits).
    if kind == KdLoss::Forward && ferrotune_core::fused::soft_cross_entropy_applies(&s, &tl)? {
        return ferrotune_core::fused::soft_cross_entropy_sum(&s, &tl);
    }
    let inf = |x: &Tensor| x.abs()?.ge(f32::INFINITY);
    let zeros = s.zeros_like()?;
    let (log_s, log_t) = (log_softmax(&s)?, log_softmax(&tl)?);
    let forward = || -> Result<Tensor> {
        let prod = (log_t.exp()? * &log_s)?;
        inf(&s)?.where_cond(&zeros, &prod)?.sum_all()?.neg()
    };
    let reverse = || -> Result<Tensor> {
        let p_s = log_s.exp()?;
        let mask = inf(&s)?.maximum(&inf(&tl)?)?;
        let cross = mask.where_cond(&zeros, &(&p_s * &log_t)?)?;
        let own = mask.where_cond(&zeros, &(&p_s * &log_s)?)?;
        (cross - own)?.sum_all()?.neg()
    };
    match kind {
        KdLoss::Forward => forward(),
        KdLoss::Reverse => reverse(),
        KdLoss::Symmetric(r) => (forward()? * r)? + (reverse()? * (1.0 - r))?,
    }
}

/// The preference losses of the DPO recipes (`loss._component_`): torchtune's `DPOLoss` and
/// `RSOLoss`, and TRL's reference-free and IPO losses under torchtune's namespace. With per-row
/// log probabilities `π` (policy) and `ref` (reference), summed over each response's tokens, and
/// `π̄`, `ref̄` the same averaged over the response's tokens; `z = (π_chosen − π_rejected) −
/// (ref_chosen − ref_rejected)`:
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PreferenceLoss {
    /// `DPOLoss`: `−(1 − ε) log σ(β z) − ε log σ(−β z)` (β = `beta`, ε = `label_smoothing`).
    Dpo { beta: f64, label_smoothing: f64 },
    /// `RSOLoss` (hinge): `max(0, 1 − γ z)` (γ = `gamma`).
    Rso { gamma: f64 },
    /// `ORPOLoss` (TRL's `ORPOTrainer`, reference-free): the chosen rows' cross-entropy over
    /// their whole sequence (prompt and response) minus `λ log σ(o)`, `o = (π̄_c − π̄_r) −
    /// (log(1 − e^π̄_c) − log(1 − e^π̄_r))` (λ = `beta`, default 0.1).
    Orpo { beta: f64 },
    /// `SimPOLoss` (TRL's `CPOTrainer` with `loss_type="simpo"`, reference-free): with `d =
    /// π̄_c − π̄_r − γ/β`, `−(1 − ε) log σ(β d) − ε log σ(−β d)` plus `α ·` the chosen
    /// responses' cross-entropy (β = `beta` 0.1, γ = `simpo_gamma` 0.5, ε = `label_smoothing`
    /// 0, α = `cpo_alpha` 0: SimPO proper; TRL's `CPOConfig` default 1 is CPO-SimPO).
    Simpo {
        beta: f64,
        gamma: f64,
        label_smoothing: f64,
        alpha: f64,
    },
    /// `CPOLoss` (TRL's `CPOTrainer`, `loss_type="sigmoid"`, reference-free): with `d = π_c −
    /// π_r`, `−(1 − ε) log σ(β d) − ε log σ(−β d)` plus `α ·` the chosen responses'
    /// cross-entropy (β = `beta` 0.1, ε = `label_smoothing` 0, α = `cpo_alpha` 1).
    Cpo {
        beta: f64,
        label_smoothing: f64,
        alpha: f64,
    },
    /// `IPOLoss` (TRL's `DPOTrainer`, `loss_type="ipo"`): `(z̄ − 1/(2β))²` with `z̄ = (π_c −
    /// ref_c)/n_c − (π_r − ref_r)/n_r` (`n` the response's tokens; β = `beta`, default 0.1).
    Ipo { beta: f64 },
    /// `KTOLoss` (TRL's `KTOTrainer`): unpaired rows, each desirable or undesirable, against
    /// the reference with TRL's KL estimate; its arithmetic is [`crate::kto`].
    Kto(crate::kto::KtoLoss),
}

/// Which tokens of the chosen rows a preference loss's cross-entropy term covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NllOver {
    /// The labelled (response) tokens: CPO and SimPO.
    Response,
    /// Every real token after the first, prompt included: ORPO.
    Sequence,
}

impl PreferenceLoss {
    /// The loss a torchtune component names (`torchtune.rlhf.loss.DPOLoss`, `RSOLoss`,
    /// `ORPOLoss`, `SimPOLoss`, `CPOLoss`, `IPOLoss`; also under `torchtune.modules.rlhf.loss`),
    /// with `beta`, `label_smoothing` and `gamma` (torchtune's defaults: β 0.1, ε 0, γ 0.1; the
    /// TRL losses take their other parameters at TRL's defaults, see
    /// [`PreferenceLoss::with_trl_params`]).
    pub fn from_component(
        component: &str,
        beta: Option<f64>,
        label_smoothing: Option<f64>,
        gamma: Option<f64>,
    ) -> Option<Self> {
        let beta = beta.unwrap_or(0.1);
        let label_smoothing = label_smoothing.unwrap_or(0.0);
        match component.rsplit('.').next().unwrap_or(component) {
            "DPOLoss" => Some(Self::Dpo {
                beta,
                label_smoothing,
            }),
            "RSOLoss" => Some(Self::Rso {
                gamma: gamma.unwrap_or(0.1),
            }),
            "ORPOLoss" => Some(Self::Orpo { beta }),
            "SimPOLoss" => Some(Self::Simpo {
                beta,
                gamma: 0.5,
                label_smoothing,
                alpha: 0.0,
            }),
            "CPOLoss" => Some(Self::Cpo {
                beta,
                label_smoothing,
                alpha: 1.0,
            }),
            "IPOLoss" => Some(Self::Ipo { beta }),
            "KTOLoss" => Some(Self::Kto(crate::kto::KtoLoss {
                beta,
                ..Default::default()
            })),
            _ => None,
        }
    }

    /// Sets `simpo_gamma` (SimPO) and `cpo_alpha` (SimPO, CPO) where given.
    pub fn with_trl_params(mut self, simpo_gamma: Option<f64>, cpo_alpha: Option<f64>) -> Self {
        match &mut self {
            Self::Simpo { gamma, alpha, .. } => {
                *gamma = simpo_gamma.unwrap_or(*gamma);
                *alpha = cpo_alpha.unwrap_or(*alpha);
            }
            Self::Cpo { alpha, .. } => *alpha = cpo_alpha.unwrap_or(*alpha),
            _ => {}
        }
        self
    }

    /// The `loss.*` keys this loss takes (besides `_component_`).
    pub fn params(self) -> &'static [&'static str] {
        match self {
            Self::Dpo { .. } => &["beta", "label_smoothing"],
            Self::Rso { .. } => &["gamma"],
            Self::Orpo { .. } | Self::Ipo { .. } => &["beta"],
            Self::Simpo { .. } => &["beta", "simpo_gamma", "label_smoothing", "cpo_alpha"],
            Self::Cpo { .. } => &["beta", "label_smoothing", "cpo_alpha"],
            Self::Kto(_) => crate::kto::KtoLoss::PARAMS,
        }
    }

    /// Whether the loss needs no reference model (ORPO, SimPO, CPO).
    pub fn reference_free(self) -> bool {
        matches!(
            self,
            Self::Orpo { .. } | Self::Simpo { .. } | Self::Cpo { .. }
        )
    }

    /// How the loss's preference rows are tokenized: each as the trainer TRL runs it with for
    /// TRL's losses — `ORPOTrainer` / `CPOTrainer` for ORPO, CPO and SimPO (EOS after each
    /// answer, BOS before the prompt), `DPOTrainer` for IPO — and as torchtune for its own, DPO
    /// and RSO.
    pub fn tokenization(self) -> ferrotune_data::dataset::PairTokenization {
        use ferrotune_data::dataset::PairTokenization;
        match self {
            Self::Ipo { .. } => PairTokenization::DpoTrainer,
            _ if self.reference_free() => PairTokenization::Orpo,
            _ => PairTokenization::Dpo,
        }
    }

    /// Whether the loss reads each response's log probability averaged over its tokens (ORPO,
    /// SimPO, IPO) rather than summed.
    pub fn averaged(self) -> bool {
        matches!(
            self,
            Self::Orpo { .. } | Self::Simpo { .. } | Self::Ipo { .. }
        )
    }

    /// The cross-entropy term on the chosen rows, if the loss has one (with a nonzero weight).
    pub fn nll_over(self) -> Option<NllOver> {
        match self {
            Self::Orpo { .. } => Some(NllOver::Sequence),
            Self::Simpo { alpha, .. } | Self::Cpo { alpha, .. } if alpha != 0.0 => {
                Some(NllOver::Response)
            }
            _ => None,
        }
    }

    /// The factor of the logged rewards (`β · (π − ref)`, summed log probabilities also for IPO;
    /// γ for RSO; `β · π` for the reference-free losses, averaged for ORPO and SimPO, summed for
    /// CPO, as TRL logs them).
    pub fn reward_scale(self) -> f64 {
        match self {
            Self::Dpo { beta, .. }
            | Self::Orpo { beta }
            | Self::Simpo { beta, .. }
            | Self::Cpo { beta, .. }
            | Self::Ipo { beta } => beta,
            Self::Rso { gamma } => gamma,
            Self::Kto(k) => k.beta,
        }
    }
}

/// `log(1 + exp(x))` without overflow: `max(x, 0) + log(1 + exp(−|x|))`.
pub(crate) fn softplus(x: &Tensor) -> Result<Tensor> {
    let tail = (x.abs()?.neg()?.exp()? + 1.0)?.log()?;
    x.relu()? + tail
}

/// The preference loss *summed* over the pairs of a micro-batch, for the losses that read summed
/// log probabilities and no cross-entropy (DPO, RSO, CPO without `cpo_alpha`). `policy` is `[2n]`
/// (the chosen responses' summed log probabilities, then the rejected ones', as torchtune's
/// concatenated batch), differentiable; `reference` the same from the frozen reference
/// (constants). The general form is [`preference_terms`].
pub fn preference_loss_sum(
    policy: &Tensor,
    reference: &[f32],
    loss: PreferenceLoss,
) -> Result<Tensor> {
    let ones = vec![1.0; reference.len()];
    Ok(preference_terms(policy, reference, &ones, None, loss)?.total)
}

/// A micro-batch's preference loss and what its metrics read.
#[derive(Debug)]
pub struct PreferenceTerms {
    /// The loss summed over the pairs (the cross-entropy term, a mean over tokens, counted once
    /// per pair), differentiable: divided by the pairs it is TRL's / torchtune's loss.
    pub total: Tensor,
    /// Per row (`[2n]`, chosen first), the log probability the rewards read (averaged over the
    /// response's tokens for ORPO and SimPO, else summed).
    pub logps: Vec<f32>,
    /// Per row, the reference's log probability read the same way (zeros when reference-free).
    pub reference: Vec<f32>,
    /// The cross-entropy term's value (0 without one).
    pub nll: f64,
    /// ORPO: `Σ log σ(o)` over the pairs (TRL's `log_odds_ratio`, as a sum).
    pub log_odds_ratio: f64,
    /// ORPO: `Σ o` over the pairs (TRL's `log_odds_chosen`, as a sum).
    pub log_odds_chosen: f64,
}

/// `log(1 − eˣ)` for `x < 0`, without cancellation (`log(−expm1(x))` near 0, `log1p(−eˣ)` below
/// `−ln 2`).
fn log1mexp(x: &Tensor) -> Result<Tensor> {
    let near = x.ge(-std::f64::consts::LN_2)?;
    let small = x.clamp(f32::MIN, -std::f64::consts::LN_2 as f32)?;
    let far = (small.exp()?.neg()? + 1.0)?.log()?;
    // −expm1(x) = 1 − eˣ; for x in [−ln 2, 0) it is accurate enough through its series start.
    let big = x.clamp(-std::f64::consts::LN_2 as f32, -f32::MIN_POSITIVE)?;
    let em1 = expm1(&big)?;
    near.where_cond(&em1.neg()?.log()?, &far)
}

/// `eˣ − 1` for `|x| ≤ ln 2`: `2 tanh(x/2) / (1 − tanh(x/2))`, exact to rounding.
fn expm1(x: &Tensor) -> Result<Tensor> {
    let t = (x * 0.5)?.tanh()?;
    (&t * 2.0)? / (t.neg()? + 1.0)?
}

/// The general preference loss of a micro-batch (see [`PreferenceLoss`]): `policy` `[2n]` summed
/// log probabilities (differentiable), `reference` the reference's (ignored when
/// reference-free), `lengths` each row's response tokens, `nll` the chosen rows' cross-entropy
/// mean (differentiable) when [`PreferenceLoss::nll_over`] asks for one.
pub fn preference_terms(
    policy: &Tensor,
    reference: &[f32],
    lengths: &[f32],
    nll: Option<Tensor>,
    loss: PreferenceLoss,
) -> Result<PreferenceTerms> {
    let rows = policy.dim(0)?;
    if rows % 2 != 0 || reference.len() != rows || lengths.len() != rows {
        bail!(
            "preference loss: {rows} policy and {} reference log probabilities, {} lengths; \
             expected the same even number (chosen rows, then rejected rows)",
            reference.len(),
            lengths.len()
        );
    }
    let n = rows / 2;
    let dev = policy.device().clone();
    let mut policy = policy.to_dtype(DType::F32)?;
    let mut reference: Vec<f32> = match loss.reference_free() {
        true => vec![0.0; rows],
        false => reference.to_vec(),
    };
    // IPO averages in its loss only: TRL logs its rewards on the summed log ratios.
    let summed = match loss {
        PreferenceLoss::Ipo { .. } => Some((policy.detach().to_vec1::<f32>()?, reference.clone())),
        _ => None,
    };
    if loss.averaged() {
        let lens: Vec<f32> = lengths.iter().map(|l| l.max(1.0)).collect();
        policy = policy.div(&Tensor::from_vec(lens.clone(), rows, &dev)?)?;
        reference.iter_mut().zip(&lens).for_each(|(r, l)| *r /= l);
    }
    let (chosen, rejected) = (policy.narrow(0, 0, n)?, policy.narrow(0, n, n)?);
    let ref_margin: Vec<f32> = (0..n).map(|i| reference[i] - reference[n + i]).collect();
    let z = (&chosen - &rejected)?.broadcast_sub(&Tensor::from_vec(ref_margin, n, &dev)?)?;
    // −(1 − ε) log σ(x) − ε log σ(−x), with −log σ(x) = softplus(−x).
    let sigmoid = |x: &Tensor, eps: f64| -> Result<Tensor> {
        let pos = (softplus(&x.neg()?)? * (1.0 - eps))?;
        match eps == 0.0 {
            true => Ok(pos),
            false => pos + (softplus(x)? * eps)?,
        }
    };
    let (mut log_odds_ratio, mut log_odds_chosen) = (0.0, 0.0);
    let losses = match loss {
        PreferenceLoss::Dpo {
            beta,
            label_smoothing,
        } => sigmoid(&(z * beta)?, label_smoothing)?,
        PreferenceLoss::Rso { gamma } => ((z * -gamma)? + 1.0)?.relu()?,
        PreferenceLoss::Orpo { beta } => {
            let odds = (z - (log1mexp(&chosen)? - log1mexp(&rejected)?)?)?;
            let ratio = softplus(&odds.neg()?)?.neg()?;
            log_odds_ratio = ratio.sum_all()?.to_scalar::<f32>()? as f64;
            log_odds_chosen = odds.sum_all()?.to_scalar::<f32>()? as f64;
            (ratio * -beta)?
        }
        PreferenceLoss::Simpo {
            beta,
            gamma,
            label_smoothing,
            ..
        } => sigmoid(&((z - gamma / beta)? * beta)?, label_smoothing)?,
        PreferenceLoss::Cpo {
            beta,
            label_smoothing,
            ..
        } => sigmoid(&(z * beta)?, label_smoothing)?,
        PreferenceLoss::Ipo { beta } => (z - 1.0 / (2.0 * beta))?.sqr()?,
        PreferenceLoss::Kto(_) => {
            bail!(
                "preference loss: KTOLoss scores unpaired rows (crate::kto::kto_terms), not pairs"
            )
        }
    };
    let mut total = losses.sum_all()?;
    let mut nll_value = 0.0;
    if let Some(nll) = nll {
        let weight = match loss {
            PreferenceLoss::Simpo { alpha, .. } | PreferenceLoss::Cpo { alpha, .. } => alpha,
            _ => 1.0,
        };
        let nll = nll.to_dtype(DType::F32)?;
        nll_value = nll.to_scalar::<f32>()? as f64;
        total = (total + (nll * (weight * n as f64))?)?;
    }
    let (logps, reference) = match summed {
        Some(summed) => summed,
        None => (policy.detach().to_vec1::<f32>()?, reference),
    };
    Ok(PreferenceTerms {
        total,
        logps,
        reference,
        nll: nll_value,
        log_odds_ratio,
        log_odds_chosen,
    })
}
