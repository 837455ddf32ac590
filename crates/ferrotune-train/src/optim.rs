//! `torch.optim.AdamW` and `torch.optim.SGD`, following the arithmetic of PyTorch's single-tensor
//! (`foreach=False`) implementations step by step.
//!
//! Parameters are candle [`Var`]s; gradients come from [`GradStore`] (`loss.backward()`), looked up
//! by tensor id. A parameter without a gradient is skipped entirely, as in torch: no weight decay,
//! no state update, and (for AdamW) no step-count increment.
//!
//! All optimizer state is f32. A parameter stored in a reduced dtype (bf16/f16) gets an f32 master
//! copy on its first step; updates are applied to the master and the rounded result is written back
//! into the `Var`. Without it, bf16 rounding would swallow most small updates.
//!
//! State is exported as named tensors (`state_dict`) so a checkpoint can resume the run exactly:
//! `"{param}.step"` (f32 scalar, like torch's per-parameter step tensor), `"{param}.exp_avg"`,
//! `"{param}.exp_avg_sq"`, `"{param}.momentum_buffer"`, and `"{param}.master"` for master copies.
//! Hyperparameters (the learning rate included) are not part of it: the recipe's config and LR
//! schedule own them.

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Result, Tensor, Var};

/// What a recipe needs from an optimizer, whichever it is.
pub trait Optimizer {
    /// Applies one update from `grads`; parameters without a gradient are left alone.
    fn step(&mut self, grads: &GradStore) -> Result<()> {
        self.step_scaled(grads, 1.0)
    }
    /// [`Optimizer::step`] with every gradient multiplied by `grad_scale` first (the recipe's
    /// `1 / target tokens` normalisation folded into the update instead of a separate pass over
    /// all gradients; the same f32 product as [`crate::scale_grads`]).
    fn step_scaled(&mut self, grads: &GradStore, grad_scale: f64) -> Result<()>;
    /// The current learning rate.
    fn lr(&self) -> f64;
    /// Sets the learning rate used by the next [`Optimizer::step`] (LR schedules call this).
    fn set_lr(&mut self, lr: f64);
    /// The optimizer state as named tensors, for checkpoints.
    fn state_dict(&self) -> Result<Vec<(String, Tensor)>>;
    /// Restores state saved by [`Optimizer::state_dict`]. Parameters with no entry keep no state
    /// (as if they had never been stepped); keys naming no parameter are an error.
    fn load_state_dict(&mut self, state: &HashMap<String, Tensor>) -> Result<()>;
    /// Bytes the optimizer state holds now (moments, buffers, master copies; what
    /// [`Optimizer::state_dict`] would export).
    fn state_bytes(&self) -> Result<usize> {
        Ok(self
            .state_dict()?
            .iter()
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum())
    }
}

/// One parameter and its f32 master copy (only for non-f32 parameters, created on first use).
struct Slot {
    name: String,
    var: Var,
    master: Option<Tensor>,
}

impl Slot {
    fn new(name: String, var: Var) -> Self {
        Self {
            name,
            var,
            master: None,
        }
    }

    /// The parameter in f32: the master copy when there is one (creating it if needed).
    fn value_f32(&mut self) -> Result<Tensor> {
        if self.var.dtype() == DType::F32 {
            return Ok(self.var.as_tensor().detach());
        }
        if self.master.is_none() {
            self.master = Some(self.var.as_tensor().to_dtype(DType::F32)?.detach());
        }
        Ok(self.master.clone().expect("just set"))
    }

    /// Stores the updated f32 value: into the master copy and, rounded, into the `Var`.
    fn store(&mut self, value: Tensor) -> Result<()> {
        if self.var.dtype() == DType::F32 {
            self.var.set(&value)
        } else {
            self.var.set(&value.to_dtype(self.var.dtype())?)?;
            self.master = Some(value);
            Ok(())
        }
    }

    fn export_master(&self, out: &mut Vec<(String, Tensor)>) {
        if let Some(m) = &self.master {
            out.push((format!("{}.master", self.name), m.clone()));
        }
    }
}

/// The gradient of `var` in f32, if it has one.
fn grad_f32(grads: &GradStore, var: &Var) -> Result<Option<Tensor>> {
    match grads.get(var.as_tensor()) {
        Some(g) => Ok(Some(g.detach().to_dtype(DType::F32)?)),
        None => Ok(None),
    }
}

/// `torch.lerp(start, end, weight)` with a scalar weight: torch switches formulas at 0.5 so that
/// the result is exact at both ends.
fn lerp(start: &Tensor, end: &Tensor, weight: f64) -> Result<Tensor> {
    let diff = (end - start)?;
    if weight.abs() < 0.5 {
        start + diff.affine(weight, 0.0)?
    } else {
        end - diff.affine(1.0 - weight, 0.0)?
    }
}

/// Fetches `"{name}.{suffix}"` from a state dict as an f32 tensor shaped like `like`, on its device.
fn load_entry(
    state: &HashMap<String, Tensor>,
    name: &str,
    suffix: &str,
    like: &Tensor,
) -> Result<Option<Tensor>> {
    let key = format!("{name}.{suffix}");
    let Some(t) = state.get(&key) else {
        return Ok(None);
    };
    if t.dims() != like.dims() {
        bail!(
            "optimizer state {key}: shape {:?}, parameter {:?}",
            t.dims(),
            like.dims()
        );
    }
    Ok(Some(
        t.to_dtype(DType::F32)?
            .to_device(like.device())?
            .contiguous()?,
    ))
}

/// Checks that every key of `state` belongs to one of `names` with one of `suffixes`.
pub(crate) fn check_keys<'a>(
    state: &HashMap<String, Tensor>,
    names: impl Iterator<Item = &'a str>,
    suffixes: &[&str],
) -> Result<()> {
    let known: std::collections::HashSet<String> = names
        .flat_map(|n| suffixes.iter().map(move |s| format!("{n}.{s}")))
        .collect();
    let mut unknown: Vec<&String> = state.keys().filter(|k| !known.contains(*k)).collect();
    if !unknown.is_empty() {
        unknown.sort();
        bail!("optimizer state has entries for no parameter: {unknown:?}");
    }
    Ok(())
}

/// Scalar-tensor step count, torch's representation (`state["step"]` is an f32 0-d tensor).
pub(crate) fn step_tensor(step: u64, like: &Tensor) -> Result<Tensor> {
    Tensor::new(step as f32, like.device())
}

pub(crate) fn step_from_tensor(t: &Tensor) -> Result<u64> {
    let v = t.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>()?;
    match v.as_slice() {
        [s] if *s >= 0.0 && s.fract() == 0.0 => Ok(*s as u64),
        _ => bail!("optimizer state: step must be one non-negative integer, got {v:?}"),
    }
}

/// Hyperparameters of [`AdamW`]; the defaults are `torch.optim.AdamW`'s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// Learning rate.
    pub lr: f64,
    /// Decay of the first-moment running average (torch's `betas[0]`).
    pub beta1: f64,
    /// Decay of the second-moment running average (torch's `betas[1]`).
    pub beta2: f64,
    /// Added to the denominator for numerical stability.
    pub eps: f64,
    /// Decoupled weight decay: each step multiplies the parameter by `1 - lr * weight_decay`.
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
        }
    }
}

/// Per-parameter AdamW state, created on the parameter's first step (as torch does lazily).
pub struct AdamState {
    step: u64,
    moments: Moments,
}

impl AdamState {
    /// The state of a parameter stepped with tensor moments shaped like `like` (f32, on its
    /// device): zeros on the first step, and host moments moved over when the state was restored
    /// for the fused CPU path but is used on the tensor (or GPU) path.
    fn with_tensor_moments<'a>(
        state: &'a mut Option<AdamState>,
        like: &Tensor,
    ) -> Result<&'a mut AdamState> {
        let st = match state {
            Some(st) => st,
            None => state.insert(AdamState {
                step: 0,
                moments: Moments::Tensors {
                    exp_avg: like.zeros_like()?,
                    exp_avg_sq: like.zeros_like()?,
                },
            }),
        };
        if let Moments::Host {
            exp_avg,
            exp_avg_sq,
        } = &st.moments
        {
            st.moments = Moments::Tensors {
                exp_avg: Tensor::from_slice(exp_avg, like.shape(), like.device())?,
                exp_avg_sq: Tensor::from_slice(exp_avg_sq, like.shape(), like.device())?,
            };
        }
        Ok(st)
    }

    /// Both moments, after [`AdamState::with_tensor_moments`] made them tensors.
    fn moment_tensors(&mut self) -> (&mut Tensor, &mut Tensor) {
        match &mut self.moments {
            Moments::Tensors {
                exp_avg,
                exp_avg_sq,
            } => (exp_avg, exp_avg_sq),
            Moments::Host { .. } => unreachable!("made tensors by with_tensor_moments"),
        }
    }
}

/// The running averages: device tensors, or host vectors updated in place by the fused CPU step.
enum Moments {
    Tensors {
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
    },
    Host {
        exp_avg: Vec<f32>,
        exp_avg_sq: Vec<f32>,
    },
}

impl Moments {
    fn exp_avg(&self, like: &Tensor) -> Result<Tensor> {
        match self {
            Moments::Tensors { exp_avg, .. } => Ok(exp_avg.clone()),
            Moments::Host { exp_avg, .. } => {
                Tensor::from_slice(exp_avg, like.shape(), like.device())
            }
        }
    }

    fn exp_avg_sq(&self, like: &Tensor) -> Result<Tensor> {
        match self {
            Moments::Tensors { exp_avg_sq, .. } => Ok(exp_avg_sq.clone()),
            Moments::Host { exp_avg_sq, .. } => {
                Tensor::from_slice(exp_avg_sq, like.shape(), like.device())
            }
        }
    }
}

/// Whether a parameter takes the fused host path: f32, on the CPU.
fn fused_host(var: &Var) -> bool {
    var.dtype() == DType::F32 && var.device().is_cpu()
}

/// AdamW's arithmetic for one parameter, element by element, in place: the same f32 operations
/// in the same order as the tensor path (and torch's single-tensor loop), in one pass over memory
/// instead of a dozen, on all cores.
struct FusedAdamW<'a> {
    grad: &'a [f32],
    /// Multiplies each gradient element first (1.0 = none).
    grad_scale: f32,
    exp_avg: std::sync::Mutex<&'a mut [f32]>,
    exp_avg_sq: std::sync::Mutex<&'a mut [f32]>,
    decay: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    bias_correction2_sqrt: f32,
    eps: f32,
    neg_step_size: f32,
}

impl candle_core::InplaceOp1 for FusedAdamW<'_> {
    fn name(&self) -> &'static str {
        "fused-adamw"
    }

    fn cpu_fwd(
        &self,
        storage: &mut candle_core::CpuStorage,
        layout: &candle_core::Layout,
    ) -> Result<()> {
        use rayon::prelude::*;
        let candle_core::CpuStorage::F32(data) = storage else {
            bail!("fused AdamW: parameter is not f32");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("fused AdamW: parameter is not contiguous");
        };
        let param = &mut data[start..end];
        let mut m = self.exp_avg.lock().unwrap_or_else(|e| e.into_inner());
        let mut v = self.exp_avg_sq.lock().unwrap_or_else(|e| e.into_inner());
        if param.len() != self.grad.len() || m.len() != param.len() || v.len() != param.len() {
            bail!("fused AdamW: state and gradient sizes differ from the parameter's");
        }
        const CHUNK: usize = 1 << 14;
        param
            .par_chunks_mut(CHUNK)
            .zip(m.par_chunks_mut(CHUNK))
            .zip(v.par_chunks_mut(CHUNK))
            .zip(self.grad.par_chunks(CHUNK))
            .for_each(|(((p, m), v), g)| {
                for i in 0..p.len() {
                    let mut x = p[i];
                    if self.decay != 1.0 {
                        x *= self.decay;
                    }
                    let gi = if self.grad_scale != 1.0 {
                        g[i] * self.grad_scale
                    } else {
                        g[i]
                    };
                    // lerp with weight < 0.5: start + weight * (end - start)
                    let mi = m[i] + (gi - m[i]) * self.one_minus_beta1;
                    let vi = v[i] * self.beta2 + (gi * self.one_minus_beta2) * gi;
                    let denom = vi.sqrt() / self.bias_correction2_sqrt + self.eps;
                    p[i] = x + (mi * self.neg_step_size) / denom;
                    m[i] = mi;
                    v[i] = vi;
                }
            });
        Ok(())
    }
}

/// One AdamW step of a GPU parameter in a single kernel ([`ferrotune_core::adamw_step`]); `false`
/// when it does not apply (CPU, another dtype, no gradient, `beta1` below 0.5), leaving the step
/// to the tensor path.
#[cfg(feature = "cuda")]
fn gpu_step(
    slot: &mut Slot,
    state: &mut Option<AdamState>,
    grads: &GradStore,
    cfg: &AdamWConfig,
    grad_scale: f64,
) -> Result<bool> {
    let Some(grad) = grads.get(slot.var.as_tensor()) else {
        return Ok(false);
    };
    let dtype = slot.var.dtype();
    let applies = grad.device().is_cuda()
        && matches!(dtype, DType::F32 | DType::BF16)
        && grad.dtype() == dtype
        && slot.var.is_contiguous()
        && (1.0 - cfg.beta1) < 0.5;
    if !applies {
        return Ok(false);
    }
    // The f32 parameter: the Var itself (same storage) or its master copy.
    let p32 = slot.value_f32()?;
    let st = AdamState::with_tensor_moments(state, &p32)?;
    st.step += 1;
    // Bias corrections in f64, as torch computes them on Python floats.
    let step = st.step as f64;
    let (exp_avg, exp_avg_sq) = st.moment_tensors();
    if !exp_avg.is_contiguous() || !exp_avg_sq.is_contiguous() {
        *exp_avg = exp_avg.contiguous()?;
        *exp_avg_sq = exp_avg_sq.contiguous()?;
    }
    let s = ferrotune_core::AdamWStep {
        grad_scale: grad_scale as f32,
        decay: (1.0 - cfg.lr * cfg.weight_decay) as f32,
        one_minus_beta1: (1.0 - cfg.beta1) as f32,
        beta2: cfg.beta2 as f32,
        one_minus_beta2: (1.0 - cfg.beta2) as f32,
        bias_correction2_sqrt: (1.0 - cfg.beta2.powf(step)).sqrt() as f32,
        eps: cfg.eps as f32,
        neg_step_size: (-(cfg.lr / (1.0 - cfg.beta1.powf(step)))) as f32,
    };
    let model_copy = (dtype != DType::F32).then(|| slot.var.as_tensor());
    ferrotune_core::adamw_step(&p32, model_copy, grad, exp_avg, exp_avg_sq, &s)?;
    Ok(true)
}

/// An optimizer whose state is per parameter ([`AdamW`], [`Sgd`]): its hyperparameters `C`, and
/// the parameters it updates, each with its state `S`.
pub struct PerParam<C, S> {
    cfg: C,
    params: Params<S>,
}

impl<C, S> PerParam<C, S> {
    /// The optimizer over `params` (checked: unique names, float dtypes) with `cfg`.
    fn with(cfg: C, params: Vec<(String, Var)>) -> Result<Self> {
        let params = Params::new(params)?;
        Ok(PerParam { cfg, params })
    }

    /// The hyperparameters in use.
    pub fn config(&self) -> &C {
        &self.cfg
    }

    /// The parameters, in the order given to `new`.
    pub fn params(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.params.named()
    }
}

/// `torch.optim.AdamW` (no amsgrad, no maximize), single-tensor arithmetic.
pub type AdamW = PerParam<AdamWConfig, AdamState>;

impl AdamW {
    /// An optimizer over named parameters. Names key the exported state and must be unique.
    pub fn new(params: Vec<(String, Var)>, cfg: AdamWConfig) -> Result<Self> {
        // Negated so that NaN hyperparameters are rejected too.
        if !(cfg.lr >= 0.0 && cfg.eps >= 0.0 && cfg.weight_decay >= 0.0) {
            bail!("AdamW: invalid lr/eps/weight_decay in {cfg:?}");
        }
        if !((0.0..1.0).contains(&cfg.beta1) && (0.0..1.0).contains(&cfg.beta2)) {
            bail!("AdamW: betas must lie in [0, 1), got {cfg:?}");
        }
        Self::with(cfg, params)
    }
}

impl Optimizer for AdamW {
    fn step_scaled(&mut self, grads: &GradStore, grad_scale: f64) -> Result<()> {
        let AdamWConfig {
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
        } = self.cfg;
        for (slot, state) in self.params.iter_mut() {
            #[cfg(feature = "cuda")]
            if gpu_step(slot, state, grads, &self.cfg, grad_scale)? {
                continue;
            }
            let Some(grad) = grad_f32(grads, &slot.var)? else {
                continue;
            };
            let grad_on_host = grad.device().is_cpu() && grad.is_contiguous();
            if fused_host(&slot.var) && grad_on_host && (1.0 - beta1) < 0.5 {
                let n = slot.var.elem_count();
                let st = state.get_or_insert_with(|| AdamState {
                    step: 0,
                    moments: Moments::Host {
                        exp_avg: vec![0.0; n],
                        exp_avg_sq: vec![0.0; n],
                    },
                });
                if let Moments::Host {
                    exp_avg,
                    exp_avg_sq,
                } = &mut st.moments
                {
                    st.step += 1;
                    let step = st.step as f64;
                    // Read the gradient where it lies (no copy of a possibly large tensor).
                    let (g_storage, g_layout) = grad.storage_and_layout();
                    let g = match (&*g_storage, g_layout.contiguous_offsets()) {
                        (
                            candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)),
                            Some((a, b)),
                        ) => &v[a..b],
                        _ => bail!(
                            "fused AdamW: gradient of {} is not a contiguous f32 CPU tensor",
                            slot.name
                        ),
                    };
                    let op = FusedAdamW {
                        grad: g,
                        grad_scale: grad_scale as f32,
                        exp_avg: std::sync::Mutex::new(exp_avg.as_mut_slice()),
                        exp_avg_sq: std::sync::Mutex::new(exp_avg_sq.as_mut_slice()),
                        decay: (1.0 - lr * weight_decay) as f32,
                        one_minus_beta1: (1.0 - beta1) as f32,
                        beta2: beta2 as f32,
                        one_minus_beta2: (1.0 - beta2) as f32,
                        bias_correction2_sqrt: (1.0 - beta2.powf(step)).sqrt() as f32,
                        eps: eps as f32,
                        neg_step_size: (-(lr / (1.0 - beta1.powf(step)))) as f32,
                    };
                    let param = slot.var.as_tensor();
                    if param.is_contiguous() {
                        param.inplace_op1(&op)?;
                        continue;
                    }
                    st.step -= 1;
                }
            }
            let grad = if grad_scale != 1.0 {
                grad.affine(grad_scale, 0.0)?
            } else {
                grad
            };
            let mut param = slot.value_f32()?;
            let st = AdamState::with_tensor_moments(state, &param)?;
            st.step += 1;
            let step = st.step as f64;
            let (exp_avg, exp_avg_sq) = st.moment_tensors();
            if weight_decay != 0.0 {
                // param.mul_(1 - lr * weight_decay)
                param = param.affine(1.0 - lr * weight_decay, 0.0)?;
            }
            // exp_avg.lerp_(grad, 1 - beta1)
            *exp_avg = lerp(exp_avg, &grad, 1.0 - beta1)?;
            // exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            *exp_avg_sq =
                (exp_avg_sq.affine(beta2, 0.0)? + (grad.affine(1.0 - beta2, 0.0)? * &grad)?)?;
            // Bias corrections in f64, as torch computes them on Python floats.
            let bias_correction1 = 1.0 - beta1.powf(step);
            let bias_correction2 = 1.0 - beta2.powf(step);
            let step_size = lr / bias_correction1;
            let bias_correction2_sqrt = bias_correction2.sqrt();
            // denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            let bc2 = Tensor::new(bias_correction2_sqrt as f32, param.device())?;
            let denom = (exp_avg_sq.sqrt()?.broadcast_div(&bc2)? + eps)?;
            // param.addcdiv_(exp_avg, denom, value=-step_size)
            let update = (exp_avg.affine(-step_size, 0.0)? / denom)?;
            slot.store((param + update)?)?;
        }
        Ok(())
    }

    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (slot, state) in self.params.iter() {
            let Some(st) = state else { continue };
            let n = &slot.name;
            let like = slot.var.as_tensor();
            out.push((format!("{n}.step"), step_tensor(st.step, like)?));
            out.push((format!("{n}.exp_avg"), st.moments.exp_avg(like)?));
            out.push((format!("{n}.exp_avg_sq"), st.moments.exp_avg_sq(like)?));
            slot.export_master(&mut out);
        }
        Ok(out)
    }

    fn load_state_dict(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        let suffixes = ["step", "exp_avg", "exp_avg_sq", "master"];
        self.params.load(state, &suffixes, |slot| {
            let like = slot.var.as_tensor();
            let n = slot.name.as_str();
            let step = match state.get(&format!("{n}.step")) {
                Some(t) => Some(step_from_tensor(t)?),
                None => None,
            };
            let exp_avg = load_entry(state, n, "exp_avg", like)?;
            let exp_avg_sq = load_entry(state, n, "exp_avg_sq", like)?;
            Ok(match (step, exp_avg, exp_avg_sq) {
                (Some(step), Some(exp_avg), Some(exp_avg_sq)) => Some(AdamState {
                    step,
                    moments: if fused_host(&slot.var) {
                        Moments::Host {
                            exp_avg: exp_avg.flatten_all()?.to_vec1::<f32>()?,
                            exp_avg_sq: exp_avg_sq.flatten_all()?.to_vec1::<f32>()?,
                        }
                    } else {
                        Moments::Tensors {
                            exp_avg,
                            exp_avg_sq,
                        }
                    },
                }),
                (None, None, None) => None,
                _ => bail!("AdamW state for {n}: step, exp_avg and exp_avg_sq go together"),
            })
        })
    }

    fn lr(&self) -> f64 {
        self.cfg.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }

    fn state_bytes(&self) -> Result<usize> {
        // Counted without copying the host moments into tensors.
        Ok(self
            .params
            .iter()
            .map(|(slot, st)| {
                let n = slot.var.elem_count();
                let master = slot.master.as_ref().map_or(0, |_| 4 * n);
                master + st.as_ref().map_or(0, |_| 4 + 2 * 4 * n)
            })
            .sum())
    }
}

/// Restores (or clears) a slot's master copy from a state dict.
fn load_master(slot: &mut Slot, state: &HashMap<String, Tensor>) -> Result<()> {
    let master = load_entry(state, &slot.name, "master", slot.var.as_tensor())?;
    if master.is_some() && slot.var.dtype() == DType::F32 {
        bail!(
            "optimizer state {}.master: parameter is already f32",
            slot.name
        );
    }
    slot.master = master;
    Ok(())
}

/// The parameters an optimizer updates (unique names, float dtypes), each with the optimizer's
/// state for it: none before its first step, or after a load that had none for it.
struct Params<S> {
    slots: Vec<Slot>,
    state: Vec<Option<S>>,
}

impl<S> Params<S> {
    fn new(params: Vec<(String, Var)>) -> Result<Self> {
        let slots = unique_slots(params)?;
        let state = slots.iter().map(|_| None).collect();
        Ok(Params { slots, state })
    }

    /// The parameters by name, in the order given.
    fn named(&self) -> impl Iterator<Item = (&str, &Var)> {
        self.slots.iter().map(|s| (s.name.as_str(), &s.var))
    }

    fn iter(&self) -> impl Iterator<Item = (&Slot, &Option<S>)> {
        self.slots.iter().zip(&self.state)
    }

    fn iter_mut(&mut self) -> impl Iterator<Item = (&mut Slot, &mut Option<S>)> {
        self.slots.iter_mut().zip(self.state.iter_mut())
    }

    /// Restores each parameter's state (what `load` reads for it) and master copy from `state`,
    /// once every entry of `state` is known to be one of a parameter's `suffixes`.
    fn load(
        &mut self,
        state: &HashMap<String, Tensor>,
        suffixes: &[&str],
        mut load: impl FnMut(&Slot) -> Result<Option<S>>,
    ) -> Result<()> {
        check_keys(state, self.slots.iter().map(|s| s.name.as_str()), suffixes)?;
        for (slot, st) in self.iter_mut() {
            *st = load(slot)?;
            load_master(slot, state)?;
        }
        Ok(())
    }
}

fn unique_slots(params: Vec<(String, Var)>) -> Result<Vec<Slot>> {
    let mut seen = std::collections::HashSet::new();
    let mut slots = Vec::with_capacity(params.len());
    for (name, var) in params {
        if !var.dtype().is_float() {
            bail!(
                "optimizer: parameter {name} has non-float dtype {:?}",
                var.dtype()
            );
        }
        if !seen.insert(name.clone()) {
            bail!("optimizer: duplicate parameter name {name}");
        }
        slots.push(Slot::new(name, var));
    }
    Ok(slots)
}

/// Hyperparameters of [`Sgd`]; the defaults are `torch.optim.SGD`'s (with lr 1e-3).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SgdConfig {
    /// Learning rate.
    pub lr: f64,
    /// Momentum factor (0 disables the momentum buffer).
    pub momentum: f64,
    /// Dampening of the gradient's contribution to the momentum buffer.
    pub dampening: f64,
    /// L2 penalty added to the gradient (coupled, unlike AdamW's).
    pub weight_decay: f64,
    /// Nesterov momentum (needs `momentum > 0` and `dampening == 0`, as torch enforces).
    pub nesterov: bool,
}

impl Default for SgdConfig {
    fn default() -> Self {
        Self {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
        }
    }
}

/// `torch.optim.SGD` (no maximize), single-tensor arithmetic; a parameter's state is its momentum
/// buffer.
pub type Sgd = PerParam<SgdConfig, Tensor>;

impl Sgd {
    /// An optimizer over named parameters. Names key the exported state and must be unique.
    pub fn new(params: Vec<(String, Var)>, cfg: SgdConfig) -> Result<Self> {
        // Negated so that NaN hyperparameters are rejected too.
        if !(cfg.lr >= 0.0 && cfg.momentum >= 0.0 && cfg.weight_decay >= 0.0) {
            bail!("SGD: invalid lr/momentum/weight_decay in {cfg:?}");
        }
        if cfg.nesterov && (cfg.momentum <= 0.0 || cfg.dampening != 0.0) {
            bail!("SGD: Nesterov momentum requires a momentum and zero dampening");
        }
        Self::with(cfg, params)
    }
}

impl SgdConfig {
    /// SGD's update of one parameter from its (scaled) gradient, with its momentum buffer.
    fn update(&self, slot: &mut Slot, buf: &mut Option<Tensor>, mut grad: Tensor) -> Result<()> {
        let param = slot.value_f32()?;
        if self.weight_decay != 0.0 {
            // grad = grad.add(param, alpha=weight_decay)
            grad = (grad + param.affine(self.weight_decay, 0.0)?)?;
        }
        let momentum = self.momentum;
        if momentum != 0.0 {
            // First step: buf = grad.clone(); then buf.mul_(momentum).add_(grad, alpha=1 - dampening).
            let b = match buf.take() {
                None => grad.clone(),
                Some(b) => (b.affine(momentum, 0.0)? + grad.affine(1.0 - self.dampening, 0.0)?)?,
            };
            grad = if self.nesterov {
                (grad + b.affine(momentum, 0.0)?)?
            } else {
                b.clone()
            };
            *buf = Some(b);
        }
        // param.add_(grad, alpha=-lr)
        slot.store((param + grad.affine(-self.lr, 0.0)?)?)
    }
}

impl Optimizer for Sgd {
    fn step_scaled(&mut self, grads: &GradStore, grad_scale: f64) -> Result<()> {
        for (slot, buf) in self.params.iter_mut() {
            let Some(mut grad) = grad_f32(grads, &slot.var)? else {
                continue;
            };
            if grad_scale != 1.0 {
                grad = grad.affine(grad_scale, 0.0)?;
            }
            self.cfg.update(slot, buf, grad)?;
        }
        Ok(())
    }

    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        let mut out = Vec::new();
        for (slot, buf) in self.params.iter() {
            if let Some(b) = buf {
                out.push((format!("{}.momentum_buffer", slot.name), b.clone()));
            }
            slot.export_master(&mut out);
        }
        Ok(out)
    }

    fn load_state_dict(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        self.params
            .load(state, &["momentum_buffer", "master"], |slot| {
                load_entry(state, &slot.name, "momentum_buffer", slot.var.as_tensor())
            })
    }

    fn lr(&self) -> f64 {
        self.cfg.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.cfg.lr = lr;
    }
}
