//! Sharded data-parallel training (FSDP / ZeRO) on top of the [`Collectives`] interface.
//!
//! The model's tensors are grouped in units (one per decoder layer, plus a root unit for the
//! embedding, final norm and head: [`Unit`]). Under `fsdp_sharding`:
//! - `full` (FSDP FULL_SHARD, ZeRO-3): each rank keeps 1/N of every unit's parameters (trainable
//!   and frozen, flattened, zero-padded to a multiple of N), 1/N of the gradients and 1/N of the
//!   optimizer state. A unit is all-gathered just before its forward and released right after;
//!   gathered again for its backward, whose gradients are reduce-scattered. candle's autograd
//!   graph would keep gathered weights alive until the backward, so the backward recomputes the
//!   unit's forward from its saved input (the activation checkpointing torchtune enables with
//!   FSDP anyway).
//! - `grad_op` (SHARD_GRAD_OP, ZeRO-2; torchtune's `fsdp_reshard_after_forward: false`):
//!   parameters are gathered for the forward and kept until the unit's backward has run;
//!   gradients and optimizer state sharded as in `full`.
//! - `none` (DDP): every rank holds the whole model and optimizer; each unit's gradients are
//!   all-reduced as one bucket, queued while the backward of the next unit runs.
//!
//! Every collective goes through one queue served by one thread, so all ranks issue them in the
//! same order and reductions overlap the backward that follows them.
//!
//! The optimizer sees one flat parameter per unit (its shard); AdamW and SGD are elementwise, so
//! each element gets exactly the update it gets on one device. Checkpoints hold full tensors
//! under the single-device names ([`ShardedModel::full_optimizer_state`]), so a run can resume on
//! another world size.
//!
//! A quantized AdamW ([`crate::optim_quant`]) is not elementwise: its moments are quantized in
//! blocks of each parameter. With one ([`ShardedModel::with_quant_state`]) every parameter starts
//! on a block boundary of the flat buffer and the chunks are whole blocks, so each rank quantizes
//! whole blocks of the parameters it holds ([`quant`]): the ranks' codes and scales together are
//! the single-device state, bit for bit.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc;
use std::sync::Arc;

use anyhow::{anyhow, bail, Result};
use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, Var};
use ferrotune_core::nf4::{Nf4Layout, Nf4Matrix};
use ferrotune_models::{BaseWeight, CausalLm, Unit};

use crate::dist::comm::Collectives;
use crate::optim_quant::QuantAdamWConfig;
use crate::step::{empty_grads, layered_forward_backward, LayerPass, MicroBatch};

/// torchtune's `fsdp_sharding` modes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sharding {
    /// Parameters, gradients and optimizer state sharded; parameters re-gathered for backward.
    Full,
    /// Gradients and optimizer state sharded; parameters kept from forward to backward.
    GradOp,
    /// Everything replicated; gradients all-reduced (DDP).
    None,
}

impl Sharding {
    /// Parses `fsdp_sharding` (`full | grad_op | none`, or PyTorch's `FULL_SHARD`,
    /// `SHARD_GRAD_OP`, `NO_SHARD`).
    pub fn parse(value: &str) -> Option<Self> {
        match value.to_ascii_lowercase().as_str() {
            "full" | "full_shard" => Some(Sharding::Full),
            "grad_op" | "shard_grad_op" => Some(Sharding::GradOp),
            "none" | "no_shard" | "ddp" => Some(Sharding::None),
            _ => None,
        }
    }

    /// The config spelling.
    pub fn name(self) -> &'static str {
        match self {
            Sharding::Full => "full",
            Sharding::GradOp => "grad_op",
            Sharding::None => "none",
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The collective queue

enum Op {
    AllGather,
    ReduceScatter,
    AllReduce,
}

struct Job {
    op: Op,
    input: Tensor,
    reply: mpsc::Sender<Result<Tensor>>,
}

/// A collective issued to the queue; [`Pending::wait`] returns its result.
pub struct Pending(mpsc::Receiver<Result<Tensor>>);

impl Pending {
    /// Blocks until the collective has completed.
    pub fn wait(self) -> Result<Tensor> {
        self.0
            .recv()
            .map_err(|_| anyhow!("the communication thread stopped"))?
    }
}

/// One thread that runs collectives in the order they were issued.
#[derive(Clone)]
pub struct CommQueue {
    jobs: mpsc::Sender<Job>,
    rank: usize,
    world: usize,
}

impl CommQueue {
    /// Starts the thread serving `comm`.
    pub fn start(comm: Arc<dyn Collectives>) -> Self {
        let (tx, rx) = mpsc::channel::<Job>();
        let (rank, world) = (comm.rank(), comm.world_size());
        std::thread::Builder::new()
            .name("ferrotune-comm".into())
            .spawn(move || {
                for job in rx {
                    let out = match job.op {
                        Op::AllGather => comm.all_gather(&job.input),
                        Op::ReduceScatter => comm.reduce_scatter_sum(&job.input),
                        Op::AllReduce => comm.all_reduce_sum(&job.input),
                    };
                    let _ = job.reply.send(out);
                }
            })
            .expect("spawning the communication thread");
        Self {
            jobs: tx,
            rank,
            world,
        }
    }

    fn submit(&self, op: Op, input: Tensor) -> Pending {
        let (reply, rx) = mpsc::channel();
        // A stopped thread shows up as an error in `wait`.
        let _ = self.jobs.send(Job { op, input, reply });
        Pending(rx)
    }

    /// All-gathers a 1-D tensor (every rank's, in rank order).
    pub fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        self.submit(Op::AllGather, t.clone()).wait()
    }

    /// Sums a tensor over ranks.
    pub fn all_reduce(&self, t: &Tensor) -> Result<Tensor> {
        self.submit(Op::AllReduce, t.clone()).wait()
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of processes.
    pub fn world_size(&self) -> usize {
        self.world
    }
}

// ---------------------------------------------------------------------------------------------
// Units and their shards

mod quant;

/// One tensor's place in its unit's flat buffer.
#[derive(Debug, Clone)]
struct Slot {
    name: String,
    shape: Shape,
    offset: usize,
    numel: usize,
}

/// Slots laid out back to back (each starting at a multiple of `align`, zeros between), zero-padded
/// to `chunk * shards` (`chunk` a multiple of `align`).
#[derive(Debug, Clone, Default)]
struct Flat {
    slots: Vec<Slot>,
    len: usize,
    chunk: usize,
}

impl Flat {
    fn push(&mut self, name: String, shape: Shape, align: usize) {
        let numel = shape.elem_count();
        let offset = self.len.next_multiple_of(align);
        self.slots.push(Slot {
            name,
            shape,
            offset,
            numel,
        });
        self.len = offset + numel;
    }

    fn finish(&mut self, shards: usize, align: usize) {
        self.chunk = self.len.div_ceil(shards).next_multiple_of(align);
    }

    /// The values of the slots (the padding aside).
    fn numel(&self) -> usize {
        self.slots.iter().map(|s| s.numel).sum()
    }

    /// Concatenates `parts` (one per slot) into the padded flat buffer of `shards * chunk`.
    fn pack(
        &self,
        parts: &[Tensor],
        shards: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let mut flat: Vec<Tensor> = Vec::with_capacity(parts.len());
        let mut end = 0;
        for (slot, t) in self.slots.iter().zip(parts) {
            if slot.offset > end {
                flat.push(Tensor::zeros(slot.offset - end, dtype, device)?);
            }
            flat.push(t.flatten_all()?.to_dtype(dtype)?);
            end = slot.offset + slot.numel;
        }
        let pad = self.chunk * shards - self.len;
        if pad > 0 || flat.is_empty() {
            flat.push(Tensor::zeros(pad, dtype, device)?);
        }
        Ok(Tensor::cat(&flat, 0)?)
    }

    /// Splits a gathered flat buffer into one tensor per slot, in its shape: views of `flat`
    /// (which they keep alive), or with `own` compact copies.
    fn unpack(&self, flat: &Tensor, own: bool) -> Result<Vec<Tensor>> {
        self.slots
            .iter()
            .map(|s| {
                let view = flat
                    .narrow(0, s.offset, s.numel)?
                    .reshape(s.shape.clone())?;
                // `force_contiguous`, not `copy`: candle's `copy` clones the whole storage
                // behind a view, the entire flat buffer for every slot.
                Ok(if own { view.force_contiguous()? } else { view })
            })
            .collect()
    }
}

struct UnitState {
    unit: Unit,
    trainable: Flat,
    frozen: Flat,
    /// Sharded modes: this rank's chunk of the trainable buffer (the optimizer's parameter).
    shard: Option<Var>,
    /// Sharded modes: this rank's chunk of the frozen buffer.
    frozen_shard: Option<Tensor>,
    /// The trainable tensors now in the model, in slot order (always, under `none`).
    vars: Vec<Var>,
    gathered: bool,
    /// Gradient reductions issued and not yet collected.
    pending: Vec<Pending>,
    /// Reduced gradients of this optimizer step: the chunk (sharded) or the whole flat buffer.
    grad: Option<Tensor>,
    /// Sharded modes: the unit's NF4 (QLoRA) base weights, in [`CausalLm::unit_nf4_mut`] order,
    /// with this rank's chunk of their bytes ([`Nf4Matrix::to_bytes`], concatenated and
    /// zero-padded to a multiple of the ranks). Frozen and never reduced: only gathered.
    nf4: Vec<Nf4Layout>,
    nf4_shard: Option<Tensor>,
    /// Bytes of the unit's NF4 base weights (all of them, whatever the sharding).
    nf4_bytes: usize,
}

/// A model spread over the ranks of a data-parallel group.
pub struct ShardedModel {
    units: Vec<UnitState>,
    sharding: Sharding,
    queue: CommQueue,
    dtype: DType,
    device: Device,
    /// Where trainable shards, their gradients and the optimizer state live.
    opt_device: Device,
    /// Ranks a unit is sharded over (1 under `none`), and this rank's index among them.
    shards: usize,
    shard_index: usize,
    placeholder: Tensor,
    /// The quantized AdamW whose blocks the trainable shards align to (sharded modes only).
    quant: Option<QuantAdamWConfig>,
}

impl ShardedModel {
    /// Takes over `model`'s tensors. `trainable` are the parameters the recipe trains (the same
    /// `Var`s the model holds); every other tensor is frozen. Under sharding, each rank keeps its
    /// chunk and the model's tensors are replaced by empty placeholders until gathered.
    pub fn new(
        model: &mut CausalLm,
        trainable: &[(String, Var)],
        sharding: Sharding,
        queue: CommQueue,
        cpu_offload: bool,
    ) -> Result<Self> {
        Self::with_quant_state(model, trainable, sharding, queue, cpu_offload, None)
    }

    /// [`ShardedModel::new`] for the quantized AdamW `quant` (if any): under sharding, each
    /// trainable parameter starts on a block boundary of its unit's flat buffer and each rank's
    /// chunk is whole blocks, so the optimizer ([`ShardedModel::optimizer_pieces`]) quantizes on
    /// each rank exactly the blocks one device quantizes, and the checkpoint holds the
    /// single-device state.
    pub fn with_quant_state(
        model: &mut CausalLm,
        trainable: &[(String, Var)],
        sharding: Sharding,
        queue: CommQueue,
        cpu_offload: bool,
        quant: Option<QuantAdamWConfig>,
    ) -> Result<Self> {
        let quant = quant.filter(|_| sharding != Sharding::None);
        let align = quant.map_or(1, |q| q.block_size);
        if let Some(why) = model.layers_not_separable() {
            anyhow::bail!("training on several ranks runs the layers one at a time, but {why}");
        }
        let dtype = model.dtype();
        let device = model.device().clone();
        // `fsdp_cpu_offload`: trainable shards, their gradients and the optimizer state live in
        // host memory and the optimizer steps there; only gathered units occupy the device.
        let opt_device = if cpu_offload && sharding != Sharding::None {
            Device::Cpu
        } else {
            device.clone()
        };
        let (shards, shard_index) = match sharding {
            Sharding::None => (1, 0),
            _ => (queue.world_size(), queue.rank()),
        };
        let by_name: HashMap<&str, &Var> = trainable.iter().map(|(n, v)| (n.as_str(), v)).collect();
        let mut seen: HashSet<String> = HashSet::new();
        let placeholder = Tensor::zeros(0, dtype, &device)?;
        let mut units = Vec::new();
        for unit in model.units() {
            let mut st = UnitState {
                unit,
                trainable: Flat::default(),
                frozen: Flat::default(),
                shard: None,
                frozen_shard: None,
                vars: Vec::new(),
                gathered: true,
                pending: Vec::new(),
                grad: None,
                nf4: Vec::new(),
                nf4_shard: None,
                nf4_bytes: 0,
            };
            for (_, weight) in model.unit_nf4_mut(unit) {
                if let BaseWeight::Nf4(q) = weight {
                    st.nf4_bytes += q.layout().byte_len();
                }
            }
            let mut train_parts = Vec::new();
            let mut frozen_parts = Vec::new();
            for (name, tensor) in model.unit_tensors_mut(unit) {
                if let Some(var) = by_name.get(name.as_str()) {
                    st.trainable
                        .push(name.clone(), tensor.shape().clone(), align);
                    st.vars.push((*var).clone());
                    train_parts.push(tensor.clone());
                    seen.insert(name);
                } else {
                    st.frozen.push(name, tensor.shape().clone(), 1);
                    frozen_parts.push(tensor.clone());
                }
            }
            st.trainable.finish(shards, align);
            st.frozen.finish(shards, 1);
            if sharding != Sharding::None {
                let take = |flat: &Flat, parts: &[Tensor]| -> Result<Tensor> {
                    let all = flat.pack(parts, shards, dtype, &device)?;
                    Ok(all
                        .narrow(0, shard_index * flat.chunk, flat.chunk)?
                        .force_contiguous()?)
                };
                let shard = take(&st.trainable, &train_parts)?.to_device(&opt_device)?;
                st.shard = Some(Var::from_tensor(&shard)?);
                st.frozen_shard = Some(take(&st.frozen, &frozen_parts)?);
                drop((train_parts, frozen_parts));
                st.vars.clear();
                for (_, tensor) in model.unit_tensors_mut(unit) {
                    *tensor = placeholder.clone();
                }
                // QLoRA's NF4 base: each rank keeps 1/N of its bytes, like any frozen tensor.
                let mut bytes = Vec::new();
                for (_, weight) in model.unit_nf4_mut(unit) {
                    if let BaseWeight::Nf4(q) = weight {
                        let layout = q.layout();
                        bytes.extend(q.to_bytes());
                        *weight =
                            BaseWeight::Nf4(Arc::new(Nf4Matrix::placeholder(&layout, &device)));
                        st.nf4.push(layout);
                    }
                }
                if !st.nf4.is_empty() {
                    let chunk = bytes.len().div_ceil(shards);
                    bytes.resize(chunk * shards, 0);
                    let mine = bytes[shard_index * chunk..(shard_index + 1) * chunk].to_vec();
                    st.nf4_shard =
                        Some(Tensor::from_vec(mine, chunk, &Device::Cpu)?.to_device(&device)?);
                }
                st.gathered = false;
            }
            units.push(st);
        }
        model.retie_head();
        if let Some((missing, _)) = trainable.iter().find(|(n, _)| !seen.contains(n)) {
            bail!("internal: trainable parameter '{missing}' belongs to no unit of the model");
        }
        Ok(Self {
            units,
            sharding,
            queue,
            dtype,
            device,
            opt_device,
            shards,
            shard_index,
            placeholder,
            quant,
        })
    }

    /// The quantized AdamW the shards are laid out for ([`ShardedModel::with_quant_state`]).
    pub fn quant(&self) -> Option<&QuantAdamWConfig> {
        self.quant.as_ref()
    }

    /// The sharding mode.
    pub fn sharding(&self) -> Sharding {
        self.sharding
    }

    /// The collective queue (for the recipe's own reductions, kept in order with these).
    pub fn queue(&self) -> &CommQueue {
        &self.queue
    }

    fn index(&self, unit: Unit) -> usize {
        match unit {
            Unit::Root => 0,
            Unit::Layer(i) => i + 1,
        }
    }

    /// Puts `unit`'s full tensors into the model (all-gathering them when sharded).
    pub fn gather(&mut self, model: &mut CausalLm, unit: Unit) -> Result<()> {
        let k = self.index(unit);
        if self.units[k].gathered {
            return Ok(());
        }
        let st = &self.units[k];
        let shard = st.shard.as_ref().expect("sharded").as_tensor();
        // Units with nothing trainable (or nothing frozen) skip that gather.
        let gather = |flat: &Flat, shard: &Tensor| -> Result<Tensor> {
            if flat.len == 0 {
                return Ok(shard.clone());
            }
            self.queue.all_gather(&shard.to_device(&self.device)?)
        };
        let train_flat = gather(&st.trainable, shard)?;
        let frozen_flat = gather(&st.frozen, st.frozen_shard.as_ref().expect("sharded"))?;
        // Trainable tensors become fresh Vars (a copy each); frozen ones are compacted.
        let train = st.trainable.unpack(&train_flat, false)?;
        let frozen = st.frozen.unpack(&frozen_flat, true)?;
        drop((train_flat, frozen_flat));
        let vars: Vec<Var> = train
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<_>>()?;
        let mut train_it = vars.iter();
        let mut frozen_it = frozen.into_iter();
        let names: HashSet<&str> = st.trainable.slots.iter().map(|s| s.name.as_str()).collect();
        for (name, tensor) in model.unit_tensors_mut(unit) {
            *tensor = if names.contains(name.as_str()) {
                train_it.next().expect("slot order").as_tensor().clone()
            } else {
                frozen_it.next().expect("slot order")
            };
        }
        if unit == Unit::Root {
            model.retie_head();
        }
        if let Some(shard) = &st.nf4_shard {
            let all = self.queue.all_gather(shard)?.to_device(&Device::Cpu)?;
            let bytes = all.to_vec1::<u8>()?;
            let mut offset = 0;
            let mut matrices = Vec::with_capacity(st.nf4.len());
            for layout in &st.nf4 {
                let n = layout.byte_len();
                matrices.push(Nf4Matrix::from_bytes(
                    layout,
                    &bytes[offset..offset + n],
                    &self.device,
                )?);
                offset += n;
            }
            for ((_, weight), q) in model.unit_nf4_mut(unit).into_iter().zip(matrices) {
                *weight = BaseWeight::Nf4(Arc::new(q));
            }
        }
        let st = &mut self.units[k];
        st.vars = vars;
        st.gathered = true;
        Ok(())
    }

    /// Frees `unit`'s full tensors again (sharded modes; `none` keeps everything).
    pub fn release(&mut self, model: &mut CausalLm, unit: Unit) {
        let k = self.index(unit);
        if self.sharding == Sharding::None || !self.units[k].gathered {
            return;
        }
        for (_, tensor) in model.unit_tensors_mut(unit) {
            *tensor = self.placeholder.clone();
        }
        for ((_, weight), layout) in model.unit_nf4_mut(unit).into_iter().zip(&self.units[k].nf4) {
            *weight = BaseWeight::Nf4(Arc::new(Nf4Matrix::placeholder(layout, &self.device)));
        }
        if unit == Unit::Root {
            model.retie_head();
        }
        let st = &mut self.units[k];
        st.vars.clear();
        st.gathered = false;
    }

    /// An inference pass (no gradient) over `input_ids` with one unit gathered at a time, as the
    /// training pass holds them, instead of the whole model at once: the embedding, each layer
    /// (gathered, run, released), then `head` on the final hidden states with the root unit
    /// gathered. `without_adapters` runs the base model alone (the LoRA DPO reference). Every
    /// unit is released again at the end.
    pub fn inference_pass<R>(
        &mut self,
        model: &mut CausalLm,
        input_ids: &Tensor,
        layout: &ferrotune_models::AttentionLayout,
        without_adapters: bool,
        head: impl FnOnce(&CausalLm, &Tensor) -> Result<R>,
    ) -> Result<R> {
        // Runs `f` on the model, its adapters taken out when asked.
        fn run<T>(
            model: &mut CausalLm,
            without_adapters: bool,
            f: impl FnOnce(&CausalLm) -> T,
        ) -> T {
            if without_adapters {
                ferrotune_models::peft::with_adapters_disabled(model, f)
            } else {
                f(model)
            }
        }
        self.gather(model, Unit::Root)?;
        let inputs = model.layer_inputs(layout)?;
        let mut x = model.embed(input_ids)?.detach();
        for i in 0..model.layers.len() {
            self.gather(model, Unit::Layer(i))?;
            let out = run(model, without_adapters, |m| m.layer(i, &x, &inputs));
            self.release(model, Unit::Layer(i));
            x = out?.detach();
        }
        let result = run(model, without_adapters, |m| -> Result<R> {
            let hidden = m.final_norm(&x)?;
            head(m, &hidden)
        });
        self.release(model, Unit::Root);
        result
    }

    /// Gathers every unit (to save a checkpoint); [`ShardedModel::release_all`] undoes it.
    pub fn gather_all(&mut self, model: &mut CausalLm) -> Result<()> {
        for unit in model.units() {
            self.gather(model, unit)?;
        }
        Ok(())
    }

    /// Releases every unit.
    pub fn release_all(&mut self, model: &mut CausalLm) {
        for unit in model.units() {
            self.release(model, unit);
        }
    }

    /// Issues the reduction of `unit`'s gradients found in `stores` (summed when in several):
    /// reduce-scatter when sharded, all-reduce under `none`. Collected by
    /// [`ShardedModel::finish_reductions`].
    pub fn reduce_grads(&mut self, unit: Unit, stores: &[&GradStore]) -> Result<()> {
        let k = self.index(unit);
        let st = &self.units[k];
        if st.trainable.slots.is_empty() {
            return Ok(());
        }
        let mut parts = Vec::with_capacity(st.vars.len());
        for (slot, var) in st.trainable.slots.iter().zip(&st.vars) {
            let mut g: Option<Tensor> = None;
            for store in stores {
                if let Some(x) = store.get(var.as_tensor()) {
                    g = Some(match g {
                        Some(prev) => (prev + x)?,
                        None => x.clone(),
                    });
                }
            }
            parts.push(match g {
                Some(g) => g,
                None => Tensor::zeros(slot.shape.clone(), self.dtype, &self.device)?,
            });
        }
        let flat = st
            .trainable
            .pack(&parts, self.shards, self.dtype, &self.device)?;
        let op = match self.sharding {
            Sharding::None => Op::AllReduce,
            _ => Op::ReduceScatter,
        };
        let pending = self.queue.submit(op, flat);
        self.units[k].pending.push(pending);
        Ok(())
    }

    /// Waits for every issued reduction and adds it into the step's gradients.
    pub fn finish_reductions(&mut self) -> Result<()> {
        for st in &mut self.units {
            for p in std::mem::take(&mut st.pending) {
                let g = p.wait()?.to_device(&self.opt_device)?;
                st.grad = Some(match st.grad.take() {
                    Some(prev) => (prev + g)?,
                    None => g,
                });
            }
        }
        Ok(())
    }

    /// The parameters the optimizer updates: one flat shard per unit when sharded, the model's
    /// own parameters under `none`.
    pub fn optimizer_params(&self) -> Vec<(String, Var)> {
        let mut out = Vec::new();
        for st in &self.units {
            if st.trainable.slots.is_empty() {
                continue;
            }
            match &st.shard {
                Some(shard) => out.push((st.unit.name(), shard.clone())),
                None => {
                    for (slot, var) in st.trainable.slots.iter().zip(&st.vars) {
                        out.push((slot.name.clone(), var.clone()));
                    }
                }
            }
        }
        out
    }

    /// Clips the gradients in `grads` (this rank's shards, of `params`) to `max_norm` by the norm
    /// of the whole gradient over every rank (the squared norms all-reduced), as torch's
    /// `clip_grad_norm_` does under FSDP; returns that norm.
    pub fn clip_grad_norm<'a>(
        &self,
        grads: &mut GradStore,
        params: impl IntoIterator<Item = &'a Tensor>,
        max_norm: f64,
    ) -> Result<f64> {
        Ok(crate::clip::clip_grad_norm_global(
            grads,
            params,
            max_norm,
            |sq| {
                let t = Tensor::new(&[sq], &self.device)?;
                let total = self
                    .queue
                    .all_reduce(&t)
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                total.to_vec1::<f32>().map(|v| v[0])
            },
        )?)
    }

    /// The trainable tensors in the model while every unit is gathered, by name: the `Var`s a
    /// backward through the whole model fills (what [`ShardedModel::reduce_grads`] reads).
    pub fn gathered_params(&self) -> Vec<(String, Var)> {
        self.units
            .iter()
            .flat_map(|st| {
                st.trainable
                    .slots
                    .iter()
                    .zip(&st.vars)
                    .map(|(slot, var)| (slot.name.clone(), var.clone()))
            })
            .collect()
    }

    /// The reduced gradients of this step, keyed by [`ShardedModel::optimizer_params`]; clears
    /// them from the model.
    pub fn take_grads(&mut self) -> Result<GradStore> {
        let mut store = empty_grads()?;
        for st in &mut self.units {
            let Some(g) = st.grad.take() else { continue };
            match &st.shard {
                Some(shard) => {
                    store.insert(shard.as_tensor(), g);
                }
                None => {
                    let parts = st.trainable.unpack(&g, true)?;
                    for (var, part) in st.vars.iter().zip(parts) {
                        store.insert(var.as_tensor(), part);
                    }
                }
            }
        }
        Ok(store)
    }

    /// The optimizer state under single-device names and shapes (every rank calls it: sharded
    /// state is all-gathered), as a checkpoint holds it.
    pub fn full_optimizer_state(
        &self,
        sharded_state: Vec<(String, Tensor)>,
    ) -> Result<Vec<(String, Tensor)>> {
        if self.sharding == Sharding::None {
            return Ok(sharded_state);
        }
        if let Some(q) = &self.quant {
            return self.full_quant_state(q, sharded_state);
        }
        let by_name: HashMap<String, &UnitState> =
            self.units.iter().map(|u| (u.unit.name(), u)).collect();
        let mut out = Vec::new();
        for (key, t) in sharded_state {
            let (unit, suffix) = key
                .rsplit_once('.')
                .ok_or_else(|| anyhow!("internal: optimizer state key '{key}'"))?;
            let st = by_name
                .get(unit)
                .ok_or_else(|| anyhow!("internal: optimizer state key '{key}' names no unit"))?;
            if t.elem_count() == st.trainable.chunk && t.rank() == 1 {
                let full = self.queue.all_gather(&t)?;
                for (slot, part) in st
                    .trainable
                    .slots
                    .iter()
                    .zip(st.trainable.unpack(&full, true)?)
                {
                    out.push((format!("{}.{suffix}", slot.name), part));
                }
            } else {
                // Per-parameter scalars (the step count) are the same for every slot.
                for slot in &st.trainable.slots {
                    out.push((format!("{}.{suffix}", slot.name), t.force_contiguous()?));
                }
            }
        }
        Ok(out)
    }

    /// Turns a full optimizer state (single-device names, from any world size) into this rank's
    /// state for [`ShardedModel::optimizer_params`].
    pub fn shard_optimizer_state(
        &self,
        full: HashMap<String, Tensor>,
    ) -> Result<HashMap<String, Tensor>> {
        if self.sharding == Sharding::None {
            return Ok(full);
        }
        if let Some(q) = &self.quant {
            return self.shard_quant_state(q, &full);
        }
        let mut out = HashMap::new();
        for st in &self.units {
            let Some(first) = st.trainable.slots.first() else {
                continue;
            };
            let prefix = format!("{}.", first.name);
            let suffixes: Vec<String> = full
                .keys()
                .filter_map(|k| k.strip_prefix(&prefix))
                .filter(|s| !s.contains('.'))
                .map(str::to_string)
                .collect();
            for suffix in suffixes {
                let mut parts = Vec::new();
                for slot in &st.trainable.slots {
                    let key = format!("{}.{suffix}", slot.name);
                    let t = full
                        .get(&key)
                        .ok_or_else(|| anyhow!("the optimizer state has no '{key}'"))?;
                    parts.push(t.clone());
                }
                let first_t = &parts[0];
                // Tensors shaped like their parameter are sharded; scalars (the step) are not.
                let t = if first_t.dims() == first.shape.dims() {
                    let all = st.trainable.pack(
                        &parts,
                        self.shards,
                        first_t.dtype(),
                        first_t.device(),
                    )?;
                    all.narrow(0, self.shard_index * st.trainable.chunk, st.trainable.chunk)?
                        .force_contiguous()?
                } else {
                    first_t.clone()
                };
                out.insert(format!("{}.{suffix}", st.unit.name()), t);
            }
        }
        Ok(out)
    }

    /// Bytes this rank holds at rest: (parameters, gradients at their largest) — the optimizer
    /// state is counted by the caller from its `state_dict`.
    pub fn resident_bytes(&self) -> (usize, usize) {
        let size = self.dtype.size_in_bytes();
        let mut params = 0;
        let mut grads = 0;
        for st in &self.units {
            match self.sharding {
                Sharding::None => {
                    params += (st.trainable.len + st.frozen.len) * size + st.nf4_bytes;
                    grads += st.trainable.len * size;
                }
                _ => {
                    params += (st.trainable.chunk + st.frozen.chunk) * size;
                    params += st.nf4_shard.as_ref().map_or(0, Tensor::elem_count);
                    grads += st.trainable.chunk * size;
                }
            }
        }
        (params, grads)
    }

    /// What one device would hold for the same model: (parameters, gradients).
    pub fn single_device_bytes(&self) -> (usize, usize) {
        let size = self.dtype.size_in_bytes();
        let params = self
            .units
            .iter()
            .map(|u| (u.trainable.numel() + u.frozen.len) * size + u.nf4_bytes)
            .sum();
        let grads = self.units.iter().map(|u| u.trainable.numel() * size).sum();
        (params, grads)
    }

    /// Number of trainable elements in all units (unsharded).
    pub fn trainable_numel(&self) -> usize {
        self.units.iter().map(|u| u.trainable.numel()).sum()
    }

    /// Every rank's `values` (the same count on each), in rank order.
    pub fn all_gather_u64(&self, values: &[u64]) -> Result<Vec<Vec<u64>>> {
        // Sent as 16-bit pieces in f32, which holds them exactly.
        let pieces: Vec<f32> = values
            .iter()
            .flat_map(|&v| (0..4).map(move |k| ((v >> (16 * k)) & 0xFFFF) as f32))
            .collect();
        if pieces.is_empty() {
            return Ok(vec![Vec::new(); self.queue.world_size()]);
        }
        let t = Tensor::new(pieces.as_slice(), &self.device)?;
        let all = self.queue.all_gather(&t)?.to_vec1::<f32>()?;
        Ok(all
            .chunks(pieces.len())
            .map(|rank| {
                rank.chunks(4)
                    .map(|p| {
                        p.iter()
                            .enumerate()
                            .fold(0u64, |acc, (k, &x)| acc | ((x as u64) << (16 * k)))
                    })
                    .collect()
            })
            .collect())
    }

    /// Sums `values` over ranks (the recipe's loss and token counts), in queue order.
    pub fn all_reduce_f64(&self, values: &[f64]) -> Result<Vec<f64>> {
        // On the model's device (NCCL reduces device memory). Sums of losses and token counts
        // need no more than f32's 24 bits of mantissa for the 1e-5 agreement the recipes promise.
        let v: Vec<f32> = values.iter().map(|&x| x as f32).collect();
        let t = Tensor::new(v.as_slice(), &self.device)?;
        let out = self.queue.all_reduce(&t)?;
        Ok(out.to_dtype(DType::F64)?.to_vec1::<f64>()?)
    }
}

/// [`ShardedModel`]'s side of the layer-by-layer pass.
struct ShardedPass<'a> {
    model: &'a mut CausalLm,
    sm: &'a mut ShardedModel,
}

impl LayerPass for ShardedPass<'_> {
    fn model(&self) -> &CausalLm {
        self.model
    }

    fn gather(&mut self, unit: Unit) -> Result<()> {
        self.sm.gather(self.model, unit)
    }

    fn forward_done(&mut self, unit: Unit) {
        // `full` frees a layer after its forward; `grad_op` keeps it for the backward.
        if self.sm.sharding == Sharding::Full {
            self.sm.release(self.model, unit);
        }
    }

    fn grads(&mut self, unit: Unit, stores: &[&GradStore]) -> Result<()> {
        self.sm.reduce_grads(unit, stores)
    }

    fn backward_done(&mut self, unit: Unit) {
        self.sm.release(self.model, unit);
    }
}

/// One micro-batch forward and backward on a [`ShardedModel`]: returns the summed loss and issues
/// every unit's gradient reduction (collected by [`ShardedModel::finish_reductions`]).
///
/// Under `full` sharding, or with activation checkpointing, a layer's graph is dropped after its
/// forward and rebuilt for its backward (parameters gathered again under `full`: candle's graph
/// would otherwise keep them alive); otherwise the graph is kept to the backward.
pub fn forward_backward_sharded(
    model: &mut CausalLm,
    sm: &mut ShardedModel,
    batch: &MicroBatch,
    activation_checkpointing: bool,
) -> Result<crate::step::StepLoss> {
    let recompute = activation_checkpointing || sm.sharding == Sharding::Full;
    layered_forward_backward(&mut ShardedPass { model, sm }, batch, recompute)
}
