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
use ferrotune_models::{AttentionLayout, CausalLm, LayerInputs, RouterRecord, Unit};

use std::sync::Arc;

use crate::loss::{causal_lm_head_loss, KdLoss, PreferenceLoss};
use crate::reward_model::{RewardRows, RewardStats};

mod head;
mod reward_head;

use head::{head_loss, head_tensors, step_loss, HeadParts};
pub use head::{reference_log_probs, reference_log_probs_at, sequence_log_probs};

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
    /// Preference optimization: the batch is `n` chosen rows then their `n` rejected rows, and
    /// the loss compares their log probabilities with the reference model's.
    pub preference: Option<Preference>,
    /// Mixture-of-experts models with `output_router_logits`: the weight of the batch's router
    /// load-balancing loss in the summed loss (the recipe's `router_aux_loss_coef × step
    /// targets / micro-batches`, so that after the step's normalisation the loss is the
    /// cross-entropy mean plus the coefficient times the micro-batches' mean auxiliary loss).
    pub aux_loss_weight: Option<f64>,
    /// LayerSkip (torchtune's early-exit recipe): early-exit losses and layer dropout.
    pub layer_skip: Option<LayerSkip>,
    /// Reward-model training: the batch is `n` chosen rows then their `n` rejected rows, each
    /// scored by the classifier's head at one position ([`crate::reward_model`]).
    pub reward: Option<RewardRows>,
}

/// What LayerSkip training changes in a micro-batch's pass (`crate::early_exit`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LayerSkip {
    /// `(layer, weight)`, ascending: the loss is `Σ weight · cross-entropy` of the hidden state
    /// entering each of these layers, through the final norm and the head. The layers from the
    /// highest one up are not run (their output is in no loss, so, as in torchtune, they get no
    /// gradient). Empty: the usual loss of the final output.
    pub exits: Vec<(usize, f64)>,
    /// Per layer, the rows that run it (`None`: all); the other rows' hidden states pass through
    /// unchanged (layer dropout). A layer that runs no row gets no gradient from the batch.
    pub kept_rows: Vec<Option<Vec<usize>>>,
}

/// What a DPO run adds to a micro-batch (torchtune's `lora_dpo_*` / `full_dpo_distributed`).
#[derive(Debug, Clone)]
pub struct Preference {
    /// The reference model's summed log probability of each row's response (`[2n]`, chosen rows
    /// first), from [`reference_log_probs`].
    pub reference_logps: Vec<f32>,
    /// `loss._component_`.
    pub loss: PreferenceLoss,
    /// KTO: the batch is unpaired rows (not pairs), with their labels and KL estimate.
    pub unpaired: Option<Unpaired>,
}

/// What a KTO micro-batch adds ([`crate::kto`]): each row's label, TRL's mismatched KL rows, and
/// the KL estimate read from them before the step.
#[derive(Debug, Clone)]
pub struct Unpaired {
    /// Per row: desirable (TRL's `label`).
    pub desirable: Vec<bool>,
    /// The KL rows (each prompt with the previous row's completion); none for
    /// `apo_zero_unpaired`.
    pub kl_rows: Option<Box<MicroBatch>>,
    /// The clamped KL estimate the loss reads (0 without KL rows).
    pub kl: f64,
}

/// What a distillation run adds to a micro-batch (torchtune's `knowledge_distillation_*`).
///
/// The teacher's final hidden states are kept, not its logits: the head forms both models'
/// logits a chunk of target rows at a time and back-propagates each chunk on its own
/// (torchtune's `num_output_chunks`, with each chunk's graph freed before the next), so neither
/// model's `[rows, vocab]` logits exist whole.
#[derive(Debug, Clone)]
pub struct Distill {
    /// The frozen teacher (its output head forms the teacher's logits).
    pub teacher: Arc<CausalLm>,
    /// The teacher's final hidden states `[b, t, h_teacher]` for this batch (no gradient).
    pub teacher_hidden: Tensor,
    /// `kd_ratio`: the loss is `(1 − r) · cross-entropy + r · distillation loss`.
    pub ratio: f64,
    /// `kd_loss._component_`.
    pub loss: KdLoss,
    /// `kd_loss.num_output_chunks`: the target rows are split into this many chunks (more when
    /// a chunk's logits would exceed [`MAX_CHUNK_LOGITS`] entries).
    pub chunks: usize,
}

/// The most logits (`rows × vocab`) one distillation chunk forms: 32 Mi entries, 128 MB in f32.
pub const MAX_CHUNK_LOGITS: usize = 1 << 25;

/// A micro-batch's summed losses: what was back-propagated (`sum`), and for distillation its two
/// parts (`class`: the cross-entropy, `kd`: the distillation loss; without a teacher `class` is
/// `sum` and `kd` 0). Sums over target tokens, normalised by the recipe.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepLoss {
    pub sum: f64,
    pub class: f64,
    pub kd: f64,
    /// Preference optimization's metrics, summed over the pairs.
    pub pairs: PairStats,
    /// The router load-balancing loss (unweighted), summed over micro-batches.
    pub aux: f64,
    /// Reward-model training's metrics.
    pub rewards: RewardStats,
}

impl std::ops::AddAssign for StepLoss {
    fn add_assign(&mut self, o: Self) {
        self.sum += o.sum;
        self.class += o.class;
        self.kd += o.kd;
        self.pairs += o.pairs;
        self.aux += o.aux;
        self.rewards += o.rewards;
    }
}

/// What torchtune's DPO recipes log, as sums over the pairs of a step (the recipe divides by the
/// number of pairs): rewards `scale · (π − ref)` of the chosen and rejected responses, how many
/// pairs reward the chosen one more, the policy's summed log probabilities, and the mean logit
/// of the chosen and rejected rows (each micro-batch's mean, weighted by its pairs).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PairStats {
    pub chosen_reward: f64,
    pub rejected_reward: f64,
    pub correct: f64,
    pub chosen_logps: f64,
    pub rejected_logps: f64,
    pub chosen_logits: f64,
    pub rejected_logits: f64,
    /// The cross-entropy term of ORPO, CPO and SimPO (each micro-batch's mean, weighted by its
    /// pairs).
    pub nll: f64,
    /// ORPO's `log σ(odds ratio)` and log odds ratio, summed over the pairs.
    pub log_odds_ratio: f64,
    pub log_odds_chosen: f64,
    /// KTO: the desirable and undesirable rows (`chosen_*` / `rejected_*` then sum over them;
    /// `*_logits` over their positions that predict a completion token, which `*_tokens` count),
    /// and the micro-batches' KL estimates, summed.
    pub chosen_rows: f64,
    pub rejected_rows: f64,
    pub kl: f64,
    pub chosen_tokens: f64,
    pub rejected_tokens: f64,
}

impl PairStats {
    /// The sums in a fixed order, to all-reduce across ranks.
    pub fn to_vec(self) -> Vec<f64> {
        vec![
            self.chosen_reward,
            self.rejected_reward,
            self.correct,
            self.chosen_logps,
            self.rejected_logps,
            self.chosen_logits,
            self.rejected_logits,
            self.nll,
            self.log_odds_ratio,
            self.log_odds_chosen,
            self.chosen_rows,
            self.rejected_rows,
            self.kl,
            self.chosen_tokens,
            self.rejected_tokens,
        ]
    }

    /// The inverse of [`PairStats::to_vec`].
    pub fn from_slice(v: &[f64]) -> Self {
        Self {
            chosen_reward: v[0],
            rejected_reward: v[1],
            correct: v[2],
            chosen_logps: v[3],
            rejected_logps: v[4],
            chosen_logits: v[5],
            rejected_logits: v[6],
            nll: v[7],
            log_odds_ratio: v[8],
            log_odds_chosen: v[9],
            chosen_rows: v[10],
            rejected_rows: v[11],
            kl: v[12],
            chosen_tokens: v[13],
            rejected_tokens: v[14],
        }
    }

    /// torchtune's metric names and values for `pairs` pairs.
    pub fn metrics(&self, pairs: usize) -> Vec<(&'static str, f64)> {
        let n = pairs.max(1) as f64;
        vec![
            ("rewards/chosen", self.chosen_reward / n),
            ("rewards/rejected", self.rejected_reward / n),
            ("rewards/accuracies", self.correct / n),
            (
                "rewards/margins",
                (self.chosen_reward - self.rejected_reward) / n,
            ),
            ("log_probs/chosen", self.chosen_logps / n),
            ("log_probs/rejected", self.rejected_logps / n),
            ("logits/chosen", self.chosen_logits / n),
            ("logits/rejected", self.rejected_logits / n),
        ]
    }

    /// The metrics TRL logs for `loss` beyond [`PairStats::metrics`]: `nll_loss` (ORPO, CPO,
    /// SimPO), ORPO's `log_odds_ratio` and `log_odds_chosen`.
    pub fn method_metrics(&self, pairs: usize, loss: PreferenceLoss) -> Vec<(&'static str, f64)> {
        let n = pairs.max(1) as f64;
        let mut out = Vec::new();
        if matches!(
            loss,
            PreferenceLoss::Orpo { .. } | PreferenceLoss::Cpo { .. } | PreferenceLoss::Simpo { .. }
        ) {
            out.push(("nll_loss", self.nll / n));
        }
        if matches!(loss, PreferenceLoss::Orpo { .. }) {
            out.push(("log_odds_ratio", self.log_odds_ratio / n));
            out.push(("log_odds_chosen", self.log_odds_chosen / n));
        }
        out
    }
}

impl PairStats {
    /// TRL's KTO metrics of a step of `micro_batches` micro-batches (over every rank):
    /// [`crate::kto::kto_metrics`] on the sums over its rows, the KL estimate the micro-batches'
    /// mean, and `logits/chosen` / `logits/rejected`, the mean logit over the completion
    /// positions of each label's rows.
    pub fn kto_metrics(&self, micro_batches: usize) -> Vec<(&'static str, f64)> {
        let mut out = self.kto_means(micro_batches);
        if self.chosen_tokens > 0.0 {
            out.push(("logits/chosen", self.chosen_logits / self.chosen_tokens));
        }
        if self.rejected_tokens > 0.0 {
            out.push((
                "logits/rejected",
                self.rejected_logits / self.rejected_tokens,
            ));
        }
        out
    }

    fn kto_means(&self, micro_batches: usize) -> Vec<(&'static str, f64)> {
        let side = |count, rewards, logps| crate::kto::SideSums {
            count,
            rewards,
            logps,
        };
        crate::kto::kto_metrics(
            side(self.chosen_rows, self.chosen_reward, self.chosen_logps),
            side(
                self.rejected_rows,
                self.rejected_reward,
                self.rejected_logps,
            ),
            self.kl / micro_batches.max(1) as f64,
        )
    }
}

/// `AddAssign` for a struct of metric sums that has `to_vec` and `from_slice` (the one list of
/// its fields, what the all-reduce over ranks adds up): sum by sum, in `to_vec`'s order.
macro_rules! add_assign_by_sums {
    ($sums:ty) => {
        impl std::ops::AddAssign for $sums {
            fn add_assign(&mut self, o: Self) {
                let sums: Vec<f64> = self
                    .to_vec()
                    .iter()
                    .zip(o.to_vec())
                    .map(|(a, b)| a + b)
                    .collect();
                *self = Self::from_slice(&sums);
            }
        }
    };
}
pub(crate) use add_assign_by_sums;

add_assign_by_sums!(PairStats);

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
            preference: None,
            aux_loss_weight: None,
            layer_skip: None,
            reward: None,
        })
    }
}

impl MicroBatch {
    /// A batch of preference pairs with their reference log probabilities: the chosen rows, then
    /// the rejected rows (torchtune's `padded_collate_dpo`). The step's loss is normalised by its
    /// number of pairs, so `num_targets` counts pairs. As torchtune's DPO recipes, the padding
    /// is not masked: it is on the right, where causal attention keeps it from every real token,
    /// and the logged mean logits (over every position) then include padding positions that
    /// attend as torchtune's do.
    pub fn from_pairs(
        pairs: &[&ferrotune_data::dataset::PreferencePair],
        pad_id: u32,
        device: &Device,
    ) -> Result<Self> {
        let mut batch = Self::from_batch(
            &ferrotune_data::dataset::collate_pairs(pairs, pad_id),
            device,
        )?;
        for row in &mut batch.layout.key_valid {
            row.iter_mut().for_each(|v| *v = true);
        }
        batch.num_targets = pairs.len();
        Ok(batch)
    }
}

/// transformers' `load_balancing_loss_func` over a batch's sparse layers (with the attention
/// mask): `E · Σ_e (C_e / R) · (P_e / R)`, `C_e` the tokens routed to expert `e`, `P_e` the sum of
/// its router probabilities, `R` the tokens, all over every layer's real tokens. Only `P` carries
/// a gradient, so the loss is linear in the probabilities: each weighs `E · C_e / R²`.
struct RouterBalance {
    /// The loss.
    value: f64,
    /// Each expert's weight `E · C_e / R²`.
    per_expert: Vec<f32>,
    /// Per token: 1 for a real token, 0 for padding.
    mask: Vec<f32>,
}

impl RouterBalance {
    fn new(records: &[&RouterRecord], batch: &MicroBatch, experts: usize) -> Self {
        let mask: Vec<f32> = batch
            .layout
            .key_valid
            .iter()
            .flatten()
            .map(|&v| f32::from(u8::from(v)))
            .collect();
        let (mut counts, mut probs, mut rows) = (vec![0f64; experts], vec![0f64; experts], 0f64);
        for r in records {
            let n = mask.len();
            let k = r.selected.len() / n.max(1);
            for (tok, &m) in mask.iter().enumerate() {
                if m == 0.0 {
                    continue;
                }
                rows += 1.0;
                for &e in &r.selected[tok * k..(tok + 1) * k] {
                    counts[e as usize] += 1.0;
                }
                for (e, p) in probs.iter_mut().enumerate() {
                    *p += r.host_probs[tok * experts + e] as f64;
                }
            }
        }
        let weight = |e: usize| {
            if rows > 0.0 {
                experts as f64 * counts[e] / (rows * rows)
            } else {
                0.0
            }
        };
        Self {
            value: (0..experts).map(|e| weight(e) * probs[e]).sum(),
            per_expert: (0..experts).map(|e| weight(e) as f32).collect(),
            mask,
        }
    }

    /// `scale · Σ mask · weight · probs` of one layer's record: the part of the loss (times
    /// `scale`) that depends on that layer's router, differentiable.
    fn term(&self, probs: &Tensor, scale: f64) -> Result<Tensor> {
        let (n, e) = probs.dims2()?;
        let w: Vec<f32> = (0..n)
            .flat_map(|t| self.per_expert.iter().map(move |&w| w * self.mask[t]))
            .collect();
        let w = Tensor::from_vec(w, (n, e), probs.device())?;
        (probs.to_dtype(DType::F32)? * w)?.sum_all()? * scale
    }
}

/// The number of experts of `model`'s sparse layers (0 without any).
fn num_experts(model: &CausalLm) -> usize {
    let c = &model.config;
    c.moe
        .as_ref()
        .map(|m| m.num_experts)
        .or(c.gpt_oss_moe.as_ref().map(|m| m.num_experts))
        .unwrap_or(0)
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
pub(crate) fn absorb(
    acc: &mut GradStore,
    from: &GradStore,
    params: &[(String, Var)],
) -> Result<()> {
    add_grads(acc, from, params.iter().map(|(_, var)| var.as_tensor()))
}

/// Adds the gradients of `tensors` found in `from` into `acc` (detached).
fn add_grads<'a>(
    acc: &mut GradStore,
    from: &GradStore,
    tensors: impl Iterator<Item = &'a Tensor>,
) -> Result<()> {
    for t in tensors {
        if let Some(g) = from.get(t) {
            let sum = match acc.get(t) {
                Some(prev) => (prev + g)?.detach(),
                None => g.detach(),
            };
            acc.insert(t, sum);
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
    let separable = model.layers_not_separable();
    if let (Some(why), Some(_)) = (&separable, &batch.layer_skip) {
        anyhow::bail!("early exits and layer dropout run the layers one at a time, but {why}");
    }
    // Checkpointing recomputes layer by layer; a model whose layers depend on one another
    // (Gemma 4's) keeps the whole graph instead (the recipes warn).
    let checkpointing = activation_checkpointing && separable.is_none();
    if !checkpointing && batch.layer_skip.is_none() {
        if batch.aux_loss_weight.is_some() {
            model.record_routers();
        }
        let hidden = model.forward_hidden(&batch.input_ids, &batch.layout, None)?;
        let (head_total, parts) = head_loss(&hidden, model, batch)?;
        let mut total = head_total.clone();
        let mut aux = 0.0;
        if let Some(weight) = batch.aux_loss_weight {
            let records = model.take_router_records();
            let balance = RouterBalance::new(
                &records.iter().collect::<Vec<_>>(),
                batch,
                num_experts(model),
            );
            for r in &records {
                total = (total + balance.term(&r.probs, weight)?)?;
            }
            aux = balance.value;
        }
        let grads = total.backward()?;
        absorb(acc, &grads, params)?;
        if let Some(head) = parts.head_grads() {
            absorb(acc, head, params)?;
        }
        // Read after the backward is queued: reading first would make the host wait for the
        // forward to finish on a GPU before issuing any of the backward.
        let mut step = step_loss(&head_total, &parts)?;
        step.sum += batch.aux_loss_weight.unwrap_or(0.0) * aux;
        step.aux = aux;
        return Ok(step);
    }
    let mut pass = Accumulate { model, params, acc };
    layered_forward_backward(&mut pass, batch, activation_checkpointing)
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
    let skip = batch.layer_skip.as_ref();
    let exits: &[(usize, f64)] = skip.map_or(&[], |s| s.exits.as_slice());
    if let Some(&(l, _)) = exits.iter().find(|&&(l, _)| l >= n) {
        anyhow::bail!("an early exit at layer {l}, but the model has {n} layers");
    }
    // With early exits the loss ends at the highest one: the layers from there up do not run.
    let run_to = exits.iter().map(|&(l, _)| l).max().unwrap_or(n);
    let kept = |i: usize| -> Option<&[usize]> {
        skip.and_then(|s| s.kept_rows.get(i))
            .and_then(|k| k.as_deref())
    };
    // A layer that layer dropout skips for every row is not run at all.
    let runs = |i: usize| kept(i).is_none_or(|rows| !rows.is_empty());
    let aux_weight = batch.aux_loss_weight;
    if aux_weight.is_some() && skip.is_some() {
        anyhow::bail!(
            "the router load-balancing loss (output_router_logits) cannot be combined with early \
             exits or layer dropout"
        );
    }
    pass.gather(Unit::Root)?;
    let inputs = pass.model().layer_inputs(&batch.layout)?;
    // Layer `i` on `x`, with this batch's layer inputs and kept rows.
    let run_layer = |model: &CausalLm, i: usize, x: &Tensor| {
        layer_on_rows(model, i, x, &inputs, &batch.layout, kept(i))
    };
    let embedded = pass.model().embed(&batch.input_ids)?;
    let mut x = embedded.detach();
    let mut saved: Vec<Tensor> = Vec::with_capacity(run_to);
    let mut kept_graphs: Vec<Option<(Var, Tensor)>> = Vec::with_capacity(run_to);
    let mut dropout_before = Vec::with_capacity(run_to);
    // Early exits: each exit's loss is back-propagated to its hidden state during the forward;
    // the gradient there waits for the backward, the head's own gradients for the root unit.
    let mut value = StepLoss::default();
    // (layer, gradient at its entering hidden state), ascending: the backward takes them from the end.
    let mut exit_grads: Vec<(usize, Tensor)> = Vec::with_capacity(exits.len());
    let mut exit_root_grads = empty_grads()?;
    // The router's auxiliary loss: each layer's routing from the forward (its gradient part is
    // added to that layer's backward once every layer's counts are known).
    let mut routing: Vec<Vec<RouterRecord>> = Vec::new();
    for i in 0..=run_to {
        if let Some(&(_, weight)) = exits.iter().find(|&&(l, _)| l == i) {
            let (sum, grad) = exit_loss(pass.model(), &x, batch, weight, &mut exit_root_grads)?;
            value.sum += sum;
            value.class += sum;
            exit_grads.push((i, grad));
        }
        if i == n || (i == run_to && !exits.is_empty()) {
            break;
        }
        dropout_before.push(dropout_states(pass.model()));
        if !runs(i) {
            saved.push(x.clone());
            kept_graphs.push(None);
            routing.push(Vec::new());
            continue;
        }
        pass.gather(Unit::Layer(i))?;
        if aux_weight.is_some() {
            pass.model().record_routers();
        }
        if recompute {
            saved.push(x.clone());
            // `detach` drops the layer's graph: its activations are freed here, recomputed later.
            x = run_layer(pass.model(), i, &x)?.detach();
            pass.forward_done(Unit::Layer(i));
        } else {
            let input = Var::from_tensor(&x)?;
            let out = run_layer(pass.model(), i, input.as_tensor())?;
            x = out.detach();
            kept_graphs.push(Some((input, out)));
        }
        if aux_weight.is_some() {
            let mut records = pass.model().take_router_records();
            if recompute {
                // Only the host copies are needed now; the recompute records the tensors again.
                for r in &mut records {
                    r.probs = r.probs.detach();
                }
            }
            routing.push(records);
        }
    }
    let balance = aux_weight.map(|_| {
        let all: Vec<&RouterRecord> = routing.iter().flatten().collect();
        RouterBalance::new(&all, batch, num_experts(pass.model()))
    });
    let dropout_after = dropout_states(pass.model());

    let (mut grad_out, head_grads, parts) = if exits.is_empty() {
        let top = Var::from_tensor(&x)?;
        let model = pass.model();
        let hidden = model.final_norm(top.as_tensor())?;
        let (total, parts) = head_loss(&hidden, model, batch)?;
        let mut head_grads = total.backward()?;
        value = step_loss(&total, &parts)?;
        if let (Some(weight), Some(b)) = (aux_weight, &balance) {
            value.sum += weight * b.value;
            value.aux = b.value;
        }
        drop((hidden, total));
        let grad_out = head_grads
            .remove(top.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("no gradient reached the last layer"))?;
        (grad_out, Some(head_grads), Some(parts))
    } else {
        let (_, top) = exit_grads.pop().expect("the highest exit's gradient");
        (top, None, None)
    };

    for i in (0..run_to).rev() {
        if !runs(i) {
            // Skipped for every row: the gradient passes through unchanged.
            saved.truncate(i);
            kept_graphs.pop();
            routing.pop();
        } else {
            let (input, out, records) = if recompute {
                pass.gather(Unit::Layer(i))?;
                set_dropout_states(pass.model(), &dropout_before[i]);
                if aux_weight.is_some() {
                    pass.model().record_routers();
                }
                let input = Var::from_tensor(&saved[i])?;
                let out = run_layer(pass.model(), i, input.as_tensor())?;
                saved.truncate(i);
                let records = if aux_weight.is_some() {
                    pass.model().take_router_records()
                } else {
                    Vec::new()
                };
                (input, out, records)
            } else {
                let (input, out) = kept_graphs
                    .pop()
                    .flatten()
                    .expect("one kept graph per layer run");
                (input, out, routing.pop().unwrap_or_default())
            };
            let mut scalar = (out * &grad_out)?.sum_all()?;
            if let (Some(weight), Some(b)) = (aux_weight, &balance) {
                for r in &records {
                    scalar = (scalar + b.term(&r.probs, weight)?)?;
                }
            }
            let grads = scalar.backward()?;
            pass.grads(Unit::Layer(i), &[&grads])?;
            grad_out = grads
                .get(input.as_tensor())
                .ok_or_else(|| anyhow::anyhow!("no gradient reached layer {i}"))?
                .detach();
            drop(grads);
            pass.backward_done(Unit::Layer(i));
        }
        if exit_grads.last().is_some_and(|(l, _)| *l == i) {
            let (_, g) = exit_grads.pop().expect("checked");
            grad_out = (grad_out + g)?;
        }
    }
    set_dropout_states(pass.model(), &dropout_after);
    let mut stores: Vec<&GradStore> = vec![&exit_root_grads];
    stores.extend(head_grads.as_ref());
    stores.extend(parts.as_ref().and_then(HeadParts::head_grads));
    let embed_grads;
    if embedded.track_op() {
        // Full fine-tuning: the embedding table itself is trained.
        embed_grads = (embedded * grad_out)?.sum_all()?.backward()?;
        stores.push(&embed_grads);
    }
    pass.grads(Unit::Root, &stores)?;
    pass.backward_done(Unit::Root);
    Ok(value)
}

/// An early exit's loss at hidden state `x` (detached, `[b, t, h]`): `weight` times the
/// cross-entropy sum of `x` through the final norm and the head, back-propagated at once. Adds the
/// gradients of the head's and final norm's tensors into `root_grads`; returns the weighted sum
/// and the gradient at `x`.
fn exit_loss(
    model: &CausalLm,
    x: &Tensor,
    batch: &MicroBatch,
    weight: f64,
    root_grads: &mut GradStore,
) -> anyhow::Result<(f64, Tensor)> {
    let at = Var::from_tensor(x)?;
    let hidden = model.final_norm(at.as_tensor())?;
    let ce = causal_lm_head_loss(&hidden, model, &batch.labels, true)?;
    let loss = (ce.sum * weight)?;
    let grads = loss.backward()?;
    let mut root: Vec<Tensor> = head_tensors(model);
    root.extend(
        model
            .final_norm_tensors()
            .into_iter()
            .map(|(_, t)| t.clone()),
    );
    add_grads(root_grads, &grads, root.iter())?;
    let grad = grads
        .get(at.as_tensor())
        .ok_or_else(|| anyhow::anyhow!("no gradient reached an early exit's hidden state"))?
        .detach();
    Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, grad))
}

/// Decoder layer `i` on the rows `kept` of `x` (every row with `None`); the other rows' hidden
/// states pass through unchanged, as torchtune's `LayerDropout` leaves them.
fn layer_on_rows(
    model: &CausalLm,
    i: usize,
    x: &Tensor,
    inputs: &LayerInputs,
    layout: &AttentionLayout,
    kept: Option<&[usize]>,
) -> anyhow::Result<Tensor> {
    let Some(rows) = kept else {
        return Ok(model.layer(i, x, inputs)?);
    };
    let b = x.dim(0)?;
    let ids: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    let picked = x.index_select(&Tensor::from_vec(ids, rows.len(), x.device())?, 0)?;
    let sub_inputs = model.layer_inputs(&layout.select_rows(rows))?;
    let out = model.layer(i, &picked, &sub_inputs)?;
    // Row r of the result: the layer's output where it ran, else row r of the input, picked from
    // [x; out] (index_select's backward routes each gradient row to its source).
    let mut order = Vec::with_capacity(b);
    let mut next = 0;
    for r in 0..b {
        if rows.get(next) == Some(&r) {
            order.push((b + next) as u32);
            next += 1;
        } else {
            order.push(r as u32);
        }
    }
    let both = Tensor::cat(&[x, &out], 0)?;
    Ok(both.index_select(&Tensor::from_vec(order, b, x.device())?, 0)?)
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

/// Forward and backward of `model` over `input_ids` with activation checkpointing, for a loss
/// that `head` computes from the final normed hidden states (`[batch, seq, hidden]`): each
/// decoder layer's graph is dropped after its forward and rebuilt from its saved input for its
/// backward, so only one layer's activations are alive at a time. The gradients of `params` are
/// added into `acc`; returns the loss (detached). What [`layered_forward_backward`] does for the
/// fine-tuning losses, for any loss (the RLHF recipes').
pub fn checkpointed_backward(
    model: &CausalLm,
    input_ids: &Tensor,
    layout: &AttentionLayout,
    params: &[(String, Var)],
    acc: &mut GradStore,
    head: impl FnOnce(&Tensor) -> anyhow::Result<Tensor>,
) -> anyhow::Result<Tensor> {
    if model.layers_not_separable().is_some() {
        // Layers that depend on one another (Gemma 4's) are not recomputed one at a time: the
        // whole graph is kept to the backward.
        let loss = head(&model.forward_hidden(input_ids, layout, None)?)?;
        absorb(acc, &loss.backward()?, params)?;
        return Ok(loss.detach());
    }
    let n = model.layers.len();
    let inputs = model.layer_inputs(layout)?;
    let embedded = model.embed(input_ids)?;
    let mut x = embedded.detach();
    let mut saved: Vec<Tensor> = Vec::with_capacity(n);
    let mut dropout_before = Vec::with_capacity(n);
    for i in 0..n {
        dropout_before.push(dropout_states(model));
        saved.push(x.clone());
        x = model.layer(i, &x, &inputs)?.detach();
    }
    let dropout_after = dropout_states(model);
    let top = Var::from_tensor(&x)?;
    let loss = head(&model.final_norm(top.as_tensor())?)?;
    let mut head_grads = loss.backward()?;
    absorb(acc, &head_grads, params)?;
    let mut grad_out = head_grads
        .remove(top.as_tensor())
        .ok_or_else(|| anyhow::anyhow!("no gradient reached the last layer"))?;
    drop(head_grads);
    for i in (0..n).rev() {
        set_dropout_states(model, &dropout_before[i]);
        let input = Var::from_tensor(&saved[i])?;
        let out = model.layer(i, input.as_tensor(), &inputs)?;
        saved.truncate(i);
        let grads = (out * &grad_out)?.sum_all()?.backward()?;
        absorb(acc, &grads, params)?;
        grad_out = grads
            .get(input.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("no gradient reached layer {i}"))?
            .detach();
    }
    set_dropout_states(model, &dropout_after);
    if embedded.track_op() {
        // Full fine-tuning: the embedding table itself is trained.
        let grads = (embedded * grad_out)?.sum_all()?.backward()?;
        absorb(acc, &grads, params)?;
    }
    Ok(loss.detach())
}
