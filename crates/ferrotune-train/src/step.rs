//! One micro-batch through the model and back: the loss *sum* and the trainable parameters'
//! gradients, with or without activation checkpointing.
//!
//! The recipe accumulates the gradients of every micro-batch of an optimizer step in one
//! [`GradStore`] and scales them once by `1 / target tokens of the whole step`, so that N
//! micro-batches give exactly the gradients of one N× larger batch.
//!
//! Activation checkpointing (torchtune's `enable_activation_checkpointing`): candle has no hooks
//! to drop and recompute activations inside one backward pass, so the pass is split at decoder
//! layer boundaries. The forward keeps only each layer's input; the head's backward yields the
//! gradient at the last layer's output, and each layer is then recomputed from its saved input
//! and back-propagated with that incoming gradient (`sum(out * grad_out)` has exactly the
//! gradient `grad_out` at `out`). Only one layer's activations are alive at any time. LoRA
//! dropout masks are replayed by restoring the generators' states before the recompute. The same
//! layer-by-layer pass ([`layered_forward_backward`]) serves sharded training, which gathers and
//! releases each layer's parameters around it.

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var};
use ferrotune_models::{AttentionLayout, CausalLm, Unit};

use crate::loss::{causal_lm_head_loss, causal_lm_loss, kd_loss_sum, KdLoss};

/// One micro-batch as tensors.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    /// `[batch, seq]` u32 token ids.
    pub input_ids: Tensor,
    /// `[batch, seq]` i64 targets aligned with `input_ids` (shifted by the loss); -100 = none.
    pub labels: Tensor,
    /// Positions, padding and packed-sample boundaries.
    pub layout: AttentionLayout,
    /// Number of targets the loss counts (labels other than -100 after the shift).
    pub num_targets: usize,
    /// Number of real (non-padding) tokens, for throughput.
    pub num_tokens: usize,
    /// Knowledge distillation: the teacher's logits for this batch, and how to mix the losses.
    pub distill: Option<Distill>,
}

/// What a distillation run adds to a micro-batch (torchtune's `knowledge_distillation_*`).
#[derive(Debug, Clone)]
pub struct Distill {
    /// The teacher's logits `[b, t, V]` (no gradient).
    pub teacher_logits: Tensor,
    /// `kd_ratio`: the loss is `(1 − r) · cross-entropy + r · distillation loss`.
    pub ratio: f64,
    /// `kd_loss._component_`.
    pub loss: KdLoss,
}

/// A micro-batch's summed losses: what was back-propagated (`sum`), and for distillation its two
/// parts (`class`: the cross-entropy, `kd`: the distillation loss; without a teacher `class` is
/// `sum` and `kd` 0). Sums over target tokens, normalised by the recipe.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepLoss {
    pub sum: f64,
    pub class: f64,
    pub kd: f64,
}

impl std::ops::AddAssign for StepLoss {
    fn add_assign(&mut self, o: Self) {
        self.sum += o.sum;
        self.class += o.class;
        self.kd += o.kd;
    }
}

/// The loss at the head for `hidden` `[b, t, h]`: the cross-entropy sum (chunked, without
/// logits, where it can be), or with a teacher `(1 − r) · CE + r · KD` over the full logits;
/// returns the tensor to back-propagate and, for distillation, its two parts.
fn head_loss(
    hidden: &Tensor,
    model: &CausalLm,
    batch: &MicroBatch,
) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
    let Some(d) = &batch.distill else {
        return Ok((
            causal_lm_head_loss(hidden, model, &batch.labels, true)?.sum,
            None,
        ));
    };
    let logits = model.logits(hidden)?;
    let class = causal_lm_loss(&logits, &batch.labels, true)?.sum;
    let kd = kd_loss_sum(&logits, &d.teacher_logits, &batch.labels, d.loss)?.sum;
    let total = ((&class * (1.0 - d.ratio))? + (&kd * d.ratio)?)?;
    Ok((total, Some((class, kd))))
}

/// The values of [`head_loss`]'s tensors (read after the backward is queued).
fn step_loss(total: &Tensor, parts: Option<&(Tensor, Tensor)>) -> Result<StepLoss> {
    let value = |t: &Tensor| t.to_dtype(DType::F64)?.to_scalar::<f64>();
    let sum = value(total)?;
    Ok(match parts {
        None => StepLoss {
            sum,
            class: sum,
            kd: 0.0,
        },
        Some((class, kd)) => StepLoss {
            sum,
            class: value(class)?,
            kd: value(kd)?,
        },
    })
}

impl MicroBatch {
    /// Builds the tensors of a collated batch on `device`.
    pub fn from_batch(batch: &ferrotune_data::dataset::Batch, device: &Device) -> Result<Self> {
        let b = batch.input_ids.len();
        let t = batch.input_ids.first().map_or(0, Vec::len);
        let ids: Vec<u32> = batch.input_ids.iter().flatten().copied().collect();
        let labels: Vec<i64> = batch.labels.iter().flatten().copied().collect();
        let num_targets = batch
            .labels
            .iter()
            .map(|row| row.iter().skip(1).filter(|&&l| l != -100).count())
            .sum();
        let num_tokens = batch.valid.iter().flatten().filter(|&&v| v).count();
        Ok(Self {
            input_ids: Tensor::from_vec(ids, (b, t), device)?,
            labels: Tensor::from_vec(labels, (b, t), device)?,
            layout: AttentionLayout {
                positions: batch.positions.clone(),
                key_valid: batch.valid.clone(),
                segments: batch.segments.clone(),
            },
            num_targets,
            num_tokens,
            distill: None,
        })
    }
}

/// An empty gradient store (candle only hands them out from `backward`).
pub fn empty_grads() -> Result<GradStore> {
    let t = Tensor::zeros((), DType::F32, &Device::Cpu)?;
    let mut g = t.backward()?;
    g.remove(&t);
    Ok(g)
}

/// Adds the gradients of `params` found in `from` into `acc`; everything else in `from` (grads
/// of intermediate or frozen tensors) is dropped with it.
fn absorb(acc: &mut GradStore, from: &GradStore, params: &[(String, Var)]) -> Result<()> {
    for (_, var) in params {
        let p = var.as_tensor();
        if let Some(g) = from.get(p) {
            let sum = match acc.get(p) {
                Some(prev) => (prev + g)?.detach(),
                None => g.detach(),
            };
            acc.insert(p, sum);
        }
    }
    Ok(())
}

/// Runs `batch` forward and backward, adds the gradients of `params` (the loss *sum*, not yet
/// normalised) into `acc`, and returns the summed losses.
pub fn forward_backward(
    model: &CausalLm,
    batch: &MicroBatch,
    params: &[(String, Var)],
    acc: &mut GradStore,
    activation_checkpointing: bool,
) -> anyhow::Result<StepLoss> {
    if !activation_checkpointing {
        let hidden = model.forward_hidden(&batch.input_ids, &batch.layout, None)?;
        let (total, parts) = head_loss(&hidden, model, batch)?;
        let grads = total.backward()?;
        absorb(acc, &grads, params)?;
        // Read after the backward is queued: reading first would make the host wait for the
        // forward to finish on a GPU before issuing any of the backward.
        return Ok(step_loss(&total, parts.as_ref())?);
    }
    let mut pass = Accumulate { model, params, acc };
    layered_forward_backward(&mut pass, batch, true)
}

/// What [`layered_forward_backward`] does around each unit of the model. One device only
/// collects gradients ([`forward_backward`]); sharded training also gathers a unit's
/// parameters before it runs, releases them after, and reduces its gradients across ranks
/// (`crate::dist::fsdp`).
pub trait LayerPass {
    /// The model, with the units in use in place.
    fn model(&self) -> &CausalLm;
    /// Before `unit` runs (its forward, or the recompute of its backward).
    fn gather(&mut self, _unit: Unit) -> anyhow::Result<()> {
        Ok(())
    }
    /// After `unit`'s forward, when its graph is dropped and rebuilt for the backward.
    fn forward_done(&mut self, _unit: Unit) {}
    /// The gradients of `unit`'s parameters, summed over `stores`.
    fn grads(&mut self, unit: Unit, stores: &[&GradStore]) -> anyhow::Result<()>;
    /// After `unit`'s backward.
    fn backward_done(&mut self, _unit: Unit) {}
}

/// Single-device activation checkpointing: gradients go straight into the step's store.
struct Accumulate<'a> {
    model: &'a CausalLm,
    params: &'a [(String, Var)],
    acc: &'a mut GradStore,
}

impl LayerPass for Accumulate<'_> {
    fn model(&self) -> &CausalLm {
        self.model
    }

    fn grads(&mut self, _unit: Unit, stores: &[&GradStore]) -> anyhow::Result<()> {
        for store in stores {
            absorb(self.acc, store, self.params)?;
        }
        Ok(())
    }
}

/// `batch` forward and backward one decoder layer at a time, with `pass` called around each
/// unit; returns the summed losses.
///
/// With `recompute` a layer's graph is dropped after its forward (only its input is kept) and
/// rebuilt from that input for its backward — activation checkpointing; otherwise every layer's
/// graph is kept until its backward. Either way each layer is back-propagated on its own with the
/// gradient arriving at its output (`sum(out * grad_out)` has exactly that gradient at `out`).
pub fn layered_forward_backward(
    pass: &mut impl LayerPass,
    batch: &MicroBatch,
    recompute: bool,
) -> anyhow::Result<StepLoss> {
    let n = pass.model().layers.len();
    pass.gather(Unit::Root)?;
    let inputs = pass.model().layer_inputs(&batch.layout)?;
    let embedded = pass.model().embed(&batch.input_ids)?;
    let mut x = embedded.detach();
    let mut saved: Vec<Tensor> = Vec::with_capacity(n);
    let mut kept: Vec<(Var, Tensor)> = Vec::with_capacity(n);
    let mut dropout_before = Vec::with_capacity(n);
    for i in 0..n {
        pass.gather(Unit::Layer(i))?;
        dropout_before.push(dropout_states(pass.model()));
        if recompute {
            saved.push(x.clone());
            // `detach` drops the layer's graph: its activations are freed here, recomputed later.
            x = pass.model().layer(i, &x, &inputs)?.detach();
            pass.forward_done(Unit::Layer(i));
        } else {
            let input = Var::from_tensor(&x)?;
            let out = pass.model().layer(i, input.as_tensor(), &inputs)?;
            x = out.detach();
            kept.push((input, out));
        }
    }
    let dropout_after = dropout_states(pass.model());

    let top = Var::from_tensor(&x)?;
    let model = pass.model();
    let hidden = model.final_norm(top.as_tensor())?;
    let (total, parts) = head_loss(&hidden, model, batch)?;
    let mut head_grads = total.backward()?;
    let value = step_loss(&total, parts.as_ref())?;
    drop((hidden, total, parts));
    let mut grad_out = head_grads
        .remove(top.as_tensor())
        .ok_or_else(|| anyhow::anyhow!("no gradient reached the last layer"))?;

    for i in (0..n).rev() {
        let (input, out) = if recompute {
            pass.gather(Unit::Layer(i))?;
            set_dropout_states(pass.model(), &dropout_before[i]);
            let input = Var::from_tensor(&saved[i])?;
            let out = pass.model().layer(i, input.as_tensor(), &inputs)?;
            saved.truncate(i);
            (input, out)
        } else {
            kept.pop().expect("one kept graph per layer")
        };
        let grads = (out * &grad_out)?.sum_all()?.backward()?;
        pass.grads(Unit::Layer(i), &[&grads])?;
        grad_out = grads
            .get(input.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("no gradient reached layer {i}"))?
            .detach();
        drop(grads);
        pass.backward_done(Unit::Layer(i));
    }
    set_dropout_states(pass.model(), &dropout_after);
    if embedded.track_op() {
        // Full fine-tuning: the embedding table itself is trained.
        let embed_grads = (embedded * grad_out)?.sum_all()?.backward()?;
        pass.grads(Unit::Root, &[&head_grads, &embed_grads])?;
    } else {
        pass.grads(Unit::Root, &[&head_grads])?;
    }
    pass.backward_done(Unit::Root);
    Ok(value)
}

/// Dropout generator states of every adapter, in module order.
pub fn dropout_states(model: &CausalLm) -> Vec<u64> {
    model
        .linears()
        .into_iter()
        .filter_map(|(_, l)| l.adapter.as_ref().map(|a| a.dropout_state()))
        .collect()
}

/// Restores states from [`dropout_states`].
pub fn set_dropout_states(model: &CausalLm, states: &[u64]) {
    let adapters = model
        .linears()
        .into_iter()
        .filter_map(|(_, l)| l.adapter.as_ref());
    for (adapter, &s) in adapters.zip(states) {
        adapter.set_dropout_state(s);
    }
}
