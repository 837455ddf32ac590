//! The loss at the output head of a micro-batch: cross-entropy, distillation a chunk of rows at
//! a time, the preference loss, and the sequence log probabilities they build on.

use candle_core::backprop::GradStore;
use candle_core::{DType, Result, Tensor, Var};
use ferrotune_models::CausalLm;

use crate::loss::{
    causal_lm_head_loss, kd_rows_sum, preference_terms, shifted_targets, NllOver, PreferenceLoss,
    IGNORE_INDEX,
};

use super::{
    add_grads, empty_grads, Distill, MicroBatch, PairStats, Preference, StepLoss, MAX_CHUNK_LOGITS,
};

/// What the head of a micro-batch computed besides the tensor to back-propagate.
pub(super) enum HeadParts {
    /// Plain cross-entropy.
    None,
    /// Distillation, already back-propagated chunk by chunk: the losses' values (the tensor
    /// returned beside is a surrogate with the right gradient at the hidden states, not the
    /// loss), and the gradients of the output head's own tensors.
    Distill {
        step: StepLoss,
        head_grads: GradStore,
    },
    /// Preference optimization: the metrics, already read.
    Pairs(PairStats),
    /// Reward-model training: the metrics, already read.
    Rewards(crate::reward_model::RewardStats),
}

impl HeadParts {
    /// Gradients the head computed itself, for the caller to add to the step's.
    pub(super) fn head_grads(&self) -> Option<&GradStore> {
        match self {
            HeadParts::Distill { head_grads, .. } => Some(head_grads),
            _ => None,
        }
    }
}

/// The summed log probability of each row's labelled tokens (`[rows]`, labels shifted as the
/// loss shifts them): minus each row's cross-entropy sum, through the chunked head where it
/// applies. Differentiable when `hidden` is.
pub fn sequence_log_probs(hidden: &Tensor, model: &CausalLm, labels: &Tensor) -> Result<Tensor> {
    let rows = hidden.dim(0)?;
    let mut out = Vec::with_capacity(rows);
    for r in 0..rows {
        let ce = causal_lm_head_loss(
            &hidden.narrow(0, r, 1)?,
            model,
            &labels.narrow(0, r, 1)?,
            true,
        )?;
        out.push(ce.sum.neg()?.reshape(1)?);
    }
    Tensor::cat(&out, 0)
}

/// The reference model's [`sequence_log_probs`] of `batch` (no gradient is recorded: call it on a
/// model without trainable tensors, e.g. inside `peft::with_adapters_disabled`).
pub fn reference_log_probs(model: &CausalLm, batch: &MicroBatch) -> Result<Vec<f32>> {
    let hidden = model.forward_hidden(&batch.input_ids, &batch.layout, None)?;
    reference_log_probs_at(&hidden, model, &batch.labels)
}

/// [`reference_log_probs`] from the final hidden states (a sharded model's unit-by-unit pass
/// ends there).
pub fn reference_log_probs_at(
    hidden: &Tensor,
    model: &CausalLm,
    labels: &Tensor,
) -> Result<Vec<f32>> {
    sequence_log_probs(hidden, model, labels)?
        .detach()
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()
}

/// The mean logit over rows `start..start + len` of `hidden` and every position and vocabulary
/// entry (a logged metric; no gradient). Where the head is affine (no softcap) the logits are
/// never formed: the mean of an affine map is the map of the mean, so it is the mean hidden state
/// against the head's mean row (`1ᵀW / V`, one GEMV in the weight's dtype with f32
/// accumulation; no f32 copy of `[V, h]`). With Gemma 2's softcap the logits are formed in
/// chunks of positions.
fn mean_logit(model: &CausalLm, hidden: &Tensor, start: usize, len: usize) -> Result<f64> {
    mean_logit_of(model, &hidden.narrow(0, start, len)?)
}

/// The mean logit over the hidden states `rows` (`[..., h]`, every one counted) and every
/// vocabulary entry, as [`mean_logit`].
fn mean_logit_of(model: &CausalLm, rows: &Tensor) -> Result<f64> {
    let head = &model.lm_head;
    let weight = head.weight.dense()?;
    let weight = match &head.adapter {
        // DoRA rescales rows by their norms: only the merged weight says what the rows are.
        Some(adapter) if adapter.dora_magnitude.is_some() => std::borrow::Cow::Owned(
            adapter
                .merged_weight(&weight.to_dtype(adapter.a.dtype())?)?
                .detach(),
        ),
        _ => weight,
    };
    let (vocab, h) = weight.dims2()?;
    // The head's bias, with an adapter's `lora_bias` (scaled) added: both are added to every
    // position's logits.
    let base_bias = head.bias.as_ref().map(Tensor::detach);
    let bias = match &head.adapter {
        Some(adapter) => adapter.output_bias(base_bias.as_ref())?,
        None => base_bias,
    }
    .map(|b| b.detach().to_dtype(DType::F32))
    .transpose()?;
    let flat = rows.detach().reshape(((), h))?;
    let Some(cap) = model.config.final_logit_softcapping else {
        let ones = Tensor::ones((1, vocab), weight.dtype(), weight.device())?;
        let mut mean_row = (ones.matmul(&weight)?.to_dtype(DType::F32)? / vocab as f64)?;
        if let Some(adapter) = head.adapter.as_ref().filter(|a| a.dora_magnitude.is_none()) {
            // W + s·BA: the mean row gains s · (mean row of B) · A.
            let ones = ones.to_dtype(adapter.b.dtype())?;
            let b_mean = (ones.matmul(&adapter.b.detach())? / vocab as f64)?;
            let delta = (b_mean.matmul(&adapter.a.detach())? * adapter.scale)?;
            mean_row = (mean_row + delta.to_dtype(DType::F32)?)?;
        }
        let mean_h = flat.to_dtype(DType::F32)?.mean_keepdim(0)?;
        let dot = (mean_h * mean_row)?.sum_all()?.to_dtype(DType::F64)?;
        let bias_mean = match &bias {
            Some(b) => b.to_dtype(DType::F64)?.mean_all()?.to_scalar::<f64>()?,
            None => 0.0,
        };
        return Ok(dot.to_scalar::<f64>()? + bias_mean);
    };
    // Chunks of positions small enough that their f32 logits stay near 64 MB.
    let n = flat.dim(0)?;
    let chunk = (16_000_000 / vocab).clamp(1, n.max(1));
    let mut total = 0.0;
    for first in (0..n).step_by(chunk) {
        let part = flat.narrow(0, first, chunk.min(n - first))?;
        let mut logits = part
            .to_dtype(weight.dtype())?
            .matmul(&weight.t()?)?
            .to_dtype(DType::F32)?;
        if let Some(b) = &bias {
            logits = logits.broadcast_add(b)?;
        }
        let capped = ((logits / cap)?.tanh()? * cap)?;
        total += capped.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    }
    Ok(total / (n.max(1) * vocab) as f64)
}

/// The loss at the head for `hidden` `[b, t, h]`: the cross-entropy sum (chunked, without
/// logits, where it can be), or with a teacher `(1 − r) · CE + r · KD` over the full logits;
/// returns the tensor to back-propagate and, for distillation, its two parts.
pub(super) fn head_loss(
    hidden: &Tensor,
    model: &CausalLm,
    batch: &MicroBatch,
) -> Result<(Tensor, HeadParts)> {
    if let Some(p) = &batch.preference {
        return preference_head_loss(hidden, model, batch, p);
    }
    if let Some(rows) = &batch.reward {
        return super::reward_head::reward_head_loss(hidden, model, rows);
    }
    match &batch.distill {
        Some(d) => distill_head(hidden, model, &batch.labels, d),
        None => Ok((
            causal_lm_head_loss(hidden, model, &batch.labels, true)?.sum,
            HeadParts::None,
        )),
    }
}

/// The output head's own tensors (what a chunk's backward may give gradients to).
pub(super) fn head_tensors(model: &CausalLm) -> Vec<Tensor> {
    let head = &model.lm_head;
    let mut out: Vec<Tensor> = head.weight.as_dense().into_iter().cloned().collect();
    out.extend(head.bias.iter().cloned());
    if let Some(a) = &head.adapter {
        out.extend([a.a.clone(), a.b.clone()]);
        out.extend(a.dora_magnitude.iter().cloned());
        out.extend(a.bias.iter().cloned());
    }
    out
}

/// [`head_loss`] of a distillation batch: `(1 − r) · CE + r · KD` over the positions with a
/// target, formed and back-propagated a chunk of rows at a time. Returns a surrogate whose
/// gradient at `hidden` is the loss's (`Σ hidden · g`, `g` the chunks' gradients, detached) and
/// the losses' values and head gradients in [`HeadParts::Distill`].
fn distill_head(
    hidden: &Tensor,
    model: &CausalLm,
    labels: &Tensor,
    d: &Distill,
) -> Result<(Tensor, HeadParts)> {
    hidden.dims3()?;
    let vocab = model.config.vocab_size;
    let targets = shifted_targets(labels, true, vocab)?;
    let (rows, row_targets): (Vec<u32>, Vec<i64>) = targets
        .iter()
        .enumerate()
        .filter(|(_, &l)| l != IGNORE_INDEX)
        .map(|(i, &l)| (i as u32, l))
        .unzip();
    let mut head_grads = empty_grads()?;
    let n = rows.len();
    if n == 0 {
        let zero = (hidden.sum_all()? * 0.0)?;
        let step = StepLoss::default();
        return Ok((zero, HeadParts::Distill { step, head_grads }));
    }
    let pick = |x: &Tensor| -> Result<Tensor> {
        let (xb, xt, xh) = x.dims3()?;
        let idx = Tensor::from_vec(rows.clone(), n, x.device())?;
        x.reshape((xb * xt, xh))?.index_select(&idx, 0)
    };
    let student = pick(hidden)?;
    let teacher = pick(&d.teacher_hidden)?;
    let per_chunk = n
        .div_ceil(d.chunks.max(1))
        .min((MAX_CHUNK_LOGITS / vocab.max(1)).max(1));
    let head = head_tensors(model);
    let (mut class, mut kd) = (0.0f64, 0.0f64);
    let mut grad_rows = Vec::with_capacity(n.div_ceil(per_chunk));
    for start in (0..n).step_by(per_chunk) {
        let len = per_chunk.min(n - start);
        let rows_in = Var::from_tensor(&student.narrow(0, start, len)?.detach())?;
        let logits = model
            .logits(&rows_in.as_tensor().unsqueeze(0)?)?
            .reshape((len, vocab))?
            .to_dtype(DType::F32)?;
        let teacher_logits = d
            .teacher
            .logits(&teacher.narrow(0, start, len)?.unsqueeze(0)?)?
            .reshape((len, vocab))?;
        let (ce, _) = ferrotune_core::fused::cross_entropy_sum(
            &logits,
            &row_targets[start..start + len],
            IGNORE_INDEX,
        )?;
        let kl = kd_rows_sum(&logits, &teacher_logits, d.loss)?;
        let total = ((&ce * (1.0 - d.ratio))? + (&kl * d.ratio)?)?;
        let grads = total.backward()?;
        let value = |x: &Tensor| x.to_dtype(DType::F64)?.to_scalar::<f64>();
        class += value(&ce)?;
        kd += value(&kl)?;
        let g = grads.get(rows_in.as_tensor()).ok_or_else(|| {
            candle_core::Error::Msg("no gradient reached the head's input".into())
        })?;
        grad_rows.push(g.detach());
        add_grads(&mut head_grads, &grads, head.iter())?;
    }
    let g = Tensor::cat(&grad_rows, 0)?.to_dtype(student.dtype())?;
    let surrogate = (student * g)?.sum_all()?;
    let step = StepLoss {
        sum: (1.0 - d.ratio) * class + d.ratio * kd,
        class,
        kd,
        ..StepLoss::default()
    };
    Ok((surrogate, HeadParts::Distill { step, head_grads }))
}

/// [`head_loss`] of a preference batch: the pairs' summed loss, and their metrics.
fn preference_head_loss(
    hidden: &Tensor,
    model: &CausalLm,
    batch: &MicroBatch,
    p: &Preference,
) -> Result<(Tensor, HeadParts)> {
    let logps = sequence_log_probs(hidden, model, &batch.labels)?;
    if let (PreferenceLoss::Kto(loss), Some(u)) = (p.loss, &p.unpaired) {
        // KTO: the rows' summed loss, and TRL's sums over each label's rows.
        let terms = crate::kto::kto_terms(&logps, &p.reference_logps, &u.desirable, u.kl, loss)
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        let stats = PairStats {
            chosen_reward: terms.chosen.rewards,
            rejected_reward: terms.rejected.rewards,
            chosen_logps: terms.chosen.logps,
            rejected_logps: terms.rejected.logps,
            chosen_rows: terms.chosen.count,
            rejected_rows: terms.rejected.count,
            kl: u.kl,
            ..PairStats::default()
        };
        let stats = kto_logits(model, hidden, batch, &u.desirable, stats)?;
        return Ok((terms.total, HeadParts::Pairs(stats)));
    }
    let n = logps.dim(0)? / 2;
    let labels: Vec<Vec<i64>> = batch.labels.to_vec2()?;
    // Each row's response tokens (its labels after the first, as the loss shifts them).
    let lengths: Vec<f32> = labels
        .iter()
        .map(|row| row.iter().skip(1).filter(|&&l| l != IGNORE_INDEX).count() as f32)
        .collect();
    let nll = match p.loss.nll_over() {
        None => None,
        // The mean over the chosen responses' tokens: their summed log probabilities, negated.
        Some(NllOver::Response) => {
            let tokens: f32 = lengths[..n].iter().sum();
            Some((logps.narrow(0, 0, n)?.sum_all()?.neg()? / tokens.max(1.0) as f64)?)
        }
        // Every real token of the chosen rows (prompt included): rows are right-padded and end
        // with their response, so a row's real tokens run to its last labelled one.
        Some(NllOver::Sequence) => {
            let ids: Vec<Vec<u32>> = batch.input_ids.narrow(0, 0, n)?.to_vec2()?;
            let t = ids.first().map_or(0, Vec::len);
            let mut full = Vec::with_capacity(n * t);
            for (row, lab) in ids.iter().zip(&labels) {
                let end = lab
                    .iter()
                    .rposition(|&l| l != IGNORE_INDEX)
                    .map_or(0, |e| e + 1);
                full.extend(row.iter().enumerate().map(|(j, &id)| {
                    if j < end {
                        id as i64
                    } else {
                        IGNORE_INDEX
                    }
                }));
            }
            let full = Tensor::from_vec(full, (n, t), hidden.device())?;
            Some(causal_lm_head_loss(&hidden.narrow(0, 0, n)?, model, &full, true)?.mean()?)
        }
    };
    let terms = preference_terms(&logps, &p.reference_logps, &lengths, nll, p.loss)?;
    let (values, reference) = (&terms.logps, &terms.reference);
    let scale = p.loss.reward_scale();
    let mut stats = PairStats::default();
    for i in 0..n {
        // In f32, as torchtune's tensors: `chosen > rejected` is decided on the rounded rewards.
        let chosen = (scale as f32) * (values[i] - reference[i]);
        let rejected = (scale as f32) * (values[n + i] - reference[n + i]);
        stats.chosen_reward += chosen as f64;
        stats.rejected_reward += rejected as f64;
        stats.correct += f64::from(u8::from(chosen > rejected));
        stats.chosen_logps += values[i] as f64;
        stats.rejected_logps += values[n + i] as f64;
    }
    stats.nll = terms.nll * n as f64;
    stats.log_odds_ratio = terms.log_odds_ratio;
    stats.log_odds_chosen = terms.log_odds_chosen;
    stats.chosen_logits = mean_logit(model, hidden, 0, n)? * n as f64;
    stats.rejected_logits = mean_logit(model, hidden, n, n)? * n as f64;
    Ok((terms.total, HeadParts::Pairs(stats)))
}

/// TRL's KTO `logits/*` sums: over the desirable (and the undesirable) rows' positions that
/// predict a completion token, the mean logit over the vocabulary, summed, and those positions
/// counted.
fn kto_logits(
    model: &CausalLm,
    hidden: &Tensor,
    batch: &MicroBatch,
    desirable: &[bool],
    mut stats: PairStats,
) -> Result<PairStats> {
    let (b, t, h) = hidden.dims3()?;
    let targets = shifted_targets(&batch.labels, true, model.config.vocab_size)?;
    let flat = hidden.reshape((b * t, h))?;
    for side in [true, false] {
        let picked: Vec<u32> = (0..b * t)
            .filter(|&i| desirable[i / t] == side && targets[i] != IGNORE_INDEX)
            .map(|i| i as u32)
            .collect();
        if picked.is_empty() {
            continue;
        }
        let n = picked.len();
        let rows = flat.index_select(&Tensor::from_vec(picked, n, hidden.device())?, 0)?;
        let sum = mean_logit_of(model, &rows)? * n as f64;
        match side {
            true => (stats.chosen_logits, stats.chosen_tokens) = (sum, n as f64),
            false => (stats.rejected_logits, stats.rejected_tokens) = (sum, n as f64),
        }
    }
    Ok(stats)
}

/// The values of [`head_loss`]'s tensors (read after the backward is queued).
pub(super) fn step_loss(total: &Tensor, parts: &HeadParts) -> Result<StepLoss> {
    let value = |t: &Tensor| t.to_dtype(DType::F64)?.to_scalar::<f64>();
    let sum = value(total)?;
    Ok(match parts {
        HeadParts::None => StepLoss {
            sum,
            class: sum,
            ..StepLoss::default()
        },
        HeadParts::Distill { step, .. } => *step,
        HeadParts::Pairs(pairs) => StepLoss {
            sum,
            pairs: *pairs,
            ..StepLoss::default()
        },
        HeadParts::Rewards(rewards) => StepLoss {
            sum,
            rewards: *rewards,
            ..StepLoss::default()
        },
    })
}
