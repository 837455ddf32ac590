//! AdamW with its two moments held in 8 or 4 bits: torchao's `AdamW8bit` / `AdamW4bit`
//! (`torchao.optim`) and bitsandbytes' `AdamW8bit` / `PagedAdamW8bit` (`bnb.optim`), each with its
//! own quantization scheme and arithmetic, written after their sources (torchao 0.18's
//! `optim/adam.py`, `quant_utils.py`, `subclass_8bit.py`, `subclass_4bit.py`; bitsandbytes
//! 0.50's `optim/optimizer.py` and its CPU kernel `backends/cpu/ops.py`).
//!
//! Block-wise dynamic quantization: the flattened moment is cut into blocks (torchao 8-bit: 256,
//! 4-bit: 128; bitsandbytes: 256); each block keeps its absolute maximum in f32 and each value
//! the index (u8; two 4-bit indices a byte, the first in the high nibble) of the nearest entry
//! of a quantization map of `value / absmax`: the signed dynamic map for `exp_avg`, the unsigned
//! one for `exp_avg_sq` (bitsandbytes' `create_dynamic_map`); torchao's 4-bit uses the signed
//! dynamic map with 3 exponent bits and the linear map `1/16 .. 1` for `exp_avg_sq`. Each step
//! dequantizes both moments, updates them and the parameter in f32 (from the f32 moments, as
//! the references do), and quantizes the moments again.
//!
//! Small tensors keep f32 moments, as the references do: torchao quantizes a tensor of at least
//! 4096 values whose size is a multiple of the block size; bitsandbytes one of at least
//! `min_8bit_size` (4096) values, the last block possibly partial. A parameter in bf16/f16 is
//! updated in f32 and rounded back each step without a master copy, as both references do.
//!
//! The state lives in host memory whatever the parameter's device (a CUDA parameter's gradient
//! and value go through the host each step): the GPU holds no optimizer state at all, which is
//! what bitsandbytes' paged optimizers aim at (its `PagedAdamW8bit` pages the state out to host
//! memory under pressure; the arithmetic is `AdamW8bit`'s, so it runs as `AdamW8bit` here).
//!
//! State dict, per parameter: `"{param}.step"` (f32 scalar), and per moment (`exp_avg`,
//! `exp_avg_sq`) either `"{param}.{moment}"` (f32, unquantized) or `"{param}.{moment}_codes"`
//! (u8, 1-D) and `"{param}.{moment}_absmax"` (f32, one per block): the quantized state itself, so
//! a resumed run continues with the very same numbers.
//!
//! Under sharding ([`QuantAdamW::with_pieces`]) an optimizer variable is a rank's flat shard
//! holding [`Piece`]s of several parameters, each starting on a block boundary of its parameter:
//! each piece keeps the codes and scales of exactly those blocks, and whether it is quantized is
//! decided by its whole parameter's size, so the ranks' states together are the single-device
//! state ([`packed`] has the variables' state dict).

mod packed;

use std::collections::HashMap;

use candle_core::backprop::GradStore;
use candle_core::{bail, DType, Device, Result, Tensor, Var};
use rayon::prelude::*;

use crate::optim::{check_keys, step_from_tensor, step_tensor, AdamWConfig, Optimizer};

/// Which library's quantized AdamW (scheme and arithmetic).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantKind {
    /// `torchao.optim.AdamW8bit`: 8-bit dynamic maps, blocks of 256.
    Torchao8bit,
    /// `torchao.optim.AdamW4bit`: 4-bit maps (signed dynamic, linear unsigned), blocks of 128.
    Torchao4bit,
    /// `bitsandbytes.optim.AdamW8bit` (and `PagedAdamW8bit`): 8-bit dynamic maps, blocks of 256.
    Bnb8bit,
}

impl QuantKind {
    /// The kind a `_component_` names (`torchao.optim.AdamW8bit`, `bitsandbytes.optim.AdamW8bit`
    /// ...), if it names one.
    pub fn from_component(component: &str) -> Option<QuantKind> {
        let class = component.rsplit('.').next().unwrap_or("");
        let torchao = component.starts_with("torchao");
        match class {
            "AdamW8bit" if torchao => Some(QuantKind::Torchao8bit),
            "AdamW4bit" => Some(QuantKind::Torchao4bit),
            "AdamW8bit" | "PagedAdamW8bit" => Some(QuantKind::Bnb8bit),
            _ => None,
        }
    }

    /// The reference's block size.
    pub fn default_block_size(self) -> usize {
        match self {
            QuantKind::Torchao8bit | QuantKind::Bnb8bit => 256,
            QuantKind::Torchao4bit => 128,
        }
    }

    /// Bits per quantized value.
    pub fn bits(self) -> usize {
        match self {
            QuantKind::Torchao4bit => 4,
            _ => 8,
        }
    }
}

/// Hyperparameters of [`QuantAdamW`]: AdamW's (the references' defaults are torch's: lr 1e-3,
/// betas (0.9, 0.999), eps 1e-8, weight decay 0.01), the scheme, and its block and minimum sizes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuantAdamWConfig {
    /// AdamW's hyperparameters.
    pub adamw: AdamWConfig,
    /// Whose scheme and arithmetic.
    pub kind: QuantKind,
    /// Values per block scale (torchao's `block_size`; bitsandbytes fixes 256).
    pub block_size: usize,
    /// Tensors with fewer values keep f32 moments (bitsandbytes' `min_8bit_size`; torchao fixes
    /// 4096).
    pub min_quant_size: usize,
}

impl QuantAdamWConfig {
    /// The reference's defaults for `kind` with AdamW's hyperparameters `adamw`.
    pub fn new(kind: QuantKind, adamw: AdamWConfig) -> Self {
        Self {
            adamw,
            kind,
            block_size: kind.default_block_size(),
            min_quant_size: 4096,
        }
    }

    /// Whether a tensor of `n` values keeps quantized moments.
    pub fn quantizes(&self, n: usize) -> bool {
        match self.kind {
            QuantKind::Bnb8bit => n >= self.min_quant_size,
            _ => n >= self.min_quant_size && n.is_multiple_of(self.block_size),
        }
    }

    /// The bytes of both moments of a tensor of `n` values (its step count aside).
    pub fn state_bytes(&self, n: usize) -> usize {
        if !self.quantizes(n) {
            return 2 * 4 * n;
        }
        let blocks = n.div_ceil(self.block_size);
        2 * (n * self.kind.bits() / 8 + 4 * blocks)
    }
}

/// The quantization maps.
struct Maps {
    signed: Vec<f32>,
    unsigned: Vec<f32>,
}

/// `torch.linspace(start, end, steps)` in f32, as torch's CPU kernel computes it (fused
/// multiply-adds from both ends).
fn linspace(start: f32, end: f32, steps: usize) -> Vec<f32> {
    let step = (end - start) / (steps - 1) as f32;
    let half = steps / 2;
    (0..steps)
        .map(|i| {
            if i < half {
                step.mul_add(i as f32, start)
            } else {
                (-step).mul_add((steps - i - 1) as f32, end)
            }
        })
        .collect()
}

/// bitsandbytes' `create_dynamic_map` (torchao's copy, without the zero padding), in f32.
pub fn dynamic_map(signed: bool, max_exponent_bits: i32, total_bits: u32) -> Vec<f32> {
    let non_sign_bits = total_bits as i32 - 1;
    let mut data = Vec::new();
    for i in 0..max_exponent_bits {
        let items = if signed {
            (1usize << (i + non_sign_bits - max_exponent_bits)) + 1
        } else {
            (1usize << (i + non_sign_bits - max_exponent_bits + 1)) + 1
        };
        let b = linspace(0.1, 1.0, items);
        let scale = 10f64.powi(-(max_exponent_bits - 1) + i) as f32;
        for w in b.windows(2) {
            let mean = (w[0] + w[1]) / 2.0;
            data.push(scale * mean);
            if signed {
                data.push(-scale * mean);
            }
        }
    }
    // Only maps without "additional items" are built here (all the references use).
    data.push(0.0);
    data.push(1.0);
    assert_eq!(data.len(), 1 << total_bits);
    data.sort_by(|a, b| a.total_cmp(b));
    data
}

impl Maps {
    fn new(kind: QuantKind) -> Self {
        match kind {
            QuantKind::Torchao4bit => Maps {
                signed: dynamic_map(true, 3, 4),
                unsigned: (1..=16).map(|i| i as f32 / 16.0).collect(),
            },
            QuantKind::Torchao8bit | QuantKind::Bnb8bit => Maps {
                signed: dynamic_map(true, 7, 8),
                unsigned: dynamic_map(false, 7, 8),
            },
        }
    }
}

/// A moment: f32 values, or codes and block scales.
enum Moment {
    F32(Vec<f32>),
    Quant { codes: Vec<u8>, absmax: Vec<f32> },
}

/// torchao's `quantize_8bit_with_qmap` / `quantize_4bit_with_qmap`: a branchless binary search
/// for the last map entry at or below `x`, then up one when `x` is at least halfway to the next.
fn code_torchao(x: f32, map: &[f32]) -> u8 {
    let len = map.len();
    let mut c = 0usize;
    let mut step = len / 2;
    while step > 0 {
        if x >= map[c + step] {
            c += step;
        }
        step /= 2;
    }
    let up = (c + 1).min(len - 1);
    let (down_v, up_v) = (map[c], map[up]);
    if x - down_v >= (up_v - down_v) * 0.5 {
        c = up;
    }
    c as u8
}

/// bitsandbytes' quantizer (its pure-PyTorch one, `backends/default/ops.py`): the nearest map
/// entry, the lower one on a tie. Its native CPU library searches with an approximate fast binary
/// search that can land some codes away from the nearest for small values; this is the exact
/// nearest that its CUDA kernels and other backends aim at.
fn code_bnb(x: f32, map: &[f32]) -> u8 {
    let idx = map.partition_point(|&m| m <= x).saturating_sub(1);
    if idx + 1 < map.len() {
        let left = (x - map[idx]).abs();
        let right = (x - map[idx + 1]).abs();
        if right < left {
            return (idx + 1) as u8;
        }
    }
    idx as u8
}

impl Moment {
    /// `n` zeros, in codes and scales when `quantized`.
    fn zeros(n: usize, quantized: bool, cfg: &QuantAdamWConfig) -> Moment {
        if !quantized {
            return Moment::F32(vec![0.0; n]);
        }
        let bytes = n * cfg.kind.bits() / 8;
        Moment::Quant {
            codes: vec![0; bytes],
            absmax: vec![0.0; n.div_ceil(cfg.block_size)],
        }
    }

    /// The moment in f32 (a copy).
    fn dequantize(&self, n: usize, map: &[f32], cfg: &QuantAdamWConfig) -> Vec<f32> {
        match self {
            Moment::F32(v) => v.clone(),
            Moment::Quant { codes, absmax } => {
                let mut out = vec![0f32; n];
                let bs = cfg.block_size;
                out.par_chunks_mut(bs).enumerate().for_each(|(b, o)| {
                    let s = absmax[b];
                    for (j, x) in o.iter_mut().enumerate() {
                        let i = b * bs + j;
                        let c = if cfg.kind.bits() == 4 {
                            let byte = codes[i / 2];
                            if i.is_multiple_of(2) {
                                byte >> 4
                            } else {
                                byte & 15
                            }
                        } else {
                            codes[i]
                        };
                        *x = map[c as usize] * s;
                    }
                });
                out
            }
        }
    }

    /// Stores `values`: as they are, or quantized block by block.
    fn store(&mut self, values: Vec<f32>, map: &[f32], cfg: &QuantAdamWConfig) {
        match self {
            Moment::F32(v) => *v = values,
            Moment::Quant { codes, absmax } => {
                let bs = cfg.block_size;
                let four = cfg.kind.bits() == 4;
                let per_block = if four { bs / 2 } else { bs };
                let bnb = cfg.kind == QuantKind::Bnb8bit;
                codes
                    .par_chunks_mut(per_block)
                    .zip(absmax.par_iter_mut())
                    .zip(values.par_chunks(bs))
                    .for_each(|((c, a), x)| {
                        let m = x.iter().fold(0f32, |m, v| m.max(v.abs()));
                        // torchao clips the scale at 1e-12 and divides; bitsandbytes keeps the
                        // scale, clamps it at 1e-38 for its reciprocal and multiplies.
                        let scale = if bnb { m } else { m.max(1e-12) };
                        *a = scale;
                        // (A last, partial block it divides by.)
                        let inv = 1.0 / m.max(1e-38);
                        let partial = x.len() < bs;
                        let code = |v: f32| {
                            if bnb {
                                let y = if partial { v / m.max(1e-38) } else { v * inv };
                                code_bnb(y.clamp(-1.0, 1.0), map)
                            } else {
                                code_torchao(v / scale, map)
                            }
                        };
                        if four {
                            for (j, byte) in c.iter_mut().enumerate() {
                                *byte = (code(x[2 * j]) << 4) | code(x[2 * j + 1]);
                            }
                        } else {
                            for (byte, &v) in c.iter_mut().zip(x) {
                                *byte = code(v);
                            }
                        }
                    });
            }
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Moment::F32(v) => 4 * v.len(),
            Moment::Quant { codes, absmax } => codes.len() + 4 * absmax.len(),
        }
    }

    fn export(&self, key: &str, dev: &Device, out: &mut Vec<(String, Tensor)>) -> Result<()> {
        match self {
            Moment::F32(v) => out.push((key.to_string(), Tensor::new(v.as_slice(), dev)?)),
            Moment::Quant { codes, absmax } => {
                out.push((format!("{key}_codes"), Tensor::new(codes.as_slice(), dev)?));
                out.push((
                    format!("{key}_absmax"),
                    Tensor::new(absmax.as_slice(), dev)?,
                ));
            }
        }
        Ok(())
    }

    /// Reads `key` (f32) or `key_codes` + `key_absmax` from `state`; `None` when absent.
    fn import(
        state: &HashMap<String, Tensor>,
        key: &str,
        n: usize,
        cfg: &QuantAdamWConfig,
    ) -> Result<Option<Moment>> {
        let vec_of = |t: &Tensor| t.flatten_all()?.to_device(&Device::Cpu);
        if let Some(t) = state.get(key) {
            let v = vec_of(t)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            if v.len() != n {
                bail!("optimizer state {key}: {} values, parameter {n}", v.len());
            }
            return Ok(Some(Moment::F32(v)));
        }
        let (codes, absmax) = (format!("{key}_codes"), format!("{key}_absmax"));
        match (state.get(&codes), state.get(&absmax)) {
            (None, None) => Ok(None),
            (Some(c), Some(a)) => {
                if !cfg.quantizes(n) {
                    bail!(
                        "optimizer state {codes}: this optimizer keeps f32 moments for {n} values"
                    );
                }
                let c = vec_of(c)?.to_dtype(DType::U8)?.to_vec1::<u8>()?;
                let a = vec_of(a)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                if c.len() != n * cfg.kind.bits() / 8 || a.len() != n.div_ceil(cfg.block_size) {
                    bail!(
                        "optimizer state {key}: {} codes and {} scales do not fit {n} values in \
                         {}-bit blocks of {}",
                        c.len(),
                        a.len(),
                        cfg.kind.bits(),
                        cfg.block_size
                    );
                }
                Ok(Some(Moment::Quant {
                    codes: c,
                    absmax: a,
                }))
            }
            _ => bail!("optimizer state {key}: codes and absmax go together"),
        }
    }
}

/// A run of one parameter's values inside an optimizer variable (a rank's flat shard holds
/// pieces of several parameters; on one device a variable is its parameter, one piece).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// Values of the whole parameter: what decides whether its moments are quantized.
    pub numel: usize,
    /// Index of the piece's first value in its parameter (a multiple of the block size).
    pub start: usize,
    /// Index of the piece's first value in the variable (a multiple of the block size).
    pub at: usize,
    /// Values in the piece (a multiple of the block size unless it ends its parameter).
    pub len: usize,
}

impl Piece {
    /// The whole of a parameter of `n` values.
    fn whole(n: usize) -> Piece {
        Piece {
            numel: n,
            start: 0,
            at: 0,
            len: n,
        }
    }
}

/// The moments of one piece.
struct PieceState {
    exp_avg: Moment,
    exp_avg_sq: Moment,
}

/// One variable's state: its step count and its pieces' moments.
struct QState {
    step: u64,
    pieces: Vec<PieceState>,
}

/// AdamW with quantized moments (see the module's documentation).
pub struct QuantAdamW {
    cfg: QuantAdamWConfig,
    maps: Maps,
    params: Vec<(String, Var)>,
    /// Each variable's pieces, in order.
    pieces: Vec<Vec<Piece>>,
    /// Whether the variables are shards ([`QuantAdamW::with_pieces`]): the state dict is then
    /// [`packed`]'s, per variable.
    packed: bool,
    state: Vec<Option<QState>>,
}

impl QuantAdamW {
    /// The optimizer over named parameters (unique names, float dtypes).
    pub fn new(params: Vec<(String, Var)>, cfg: QuantAdamWConfig) -> Result<Self> {
        let pieces = params
            .iter()
            .map(|(_, v)| vec![Piece::whole(v.elem_count())])
            .collect();
        Self::build(params, pieces, false, cfg)
    }

    /// The optimizer over flat shards of parameters: `pieces[i]` are the parameters' pieces
    /// variable `params[i]` holds (in order, not overlapping, each starting on a block boundary
    /// of its parameter and of the variable); the values between them are left alone. Its state
    /// dict holds each variable's state in one piece ([`packed`]).
    pub fn with_pieces(
        params: Vec<(String, Var)>,
        pieces: Vec<Vec<Piece>>,
        cfg: QuantAdamWConfig,
    ) -> Result<Self> {
        if pieces.len() != params.len() {
            bail!(
                "quantized AdamW: {} variables, pieces for {}",
                params.len(),
                pieces.len()
            );
        }
        let bs = cfg.block_size;
        for ((name, var), pcs) in params.iter().zip(&pieces) {
            let mut end = 0;
            for p in pcs {
                let aligned = p.start.is_multiple_of(bs) && p.at.is_multiple_of(bs);
                let whole_blocks = p.len.is_multiple_of(bs) || p.start + p.len == p.numel;
                if !aligned || !whole_blocks || p.at < end || p.start + p.len > p.numel {
                    bail!("quantized AdamW: piece {p:?} of {name} is not on block boundaries");
                }
                end = p.at + p.len;
            }
            if end > var.elem_count() {
                bail!("quantized AdamW: the pieces of {name} run past its values");
            }
        }
        Self::build(params, pieces, true, cfg)
    }

    fn build(
        params: Vec<(String, Var)>,
        pieces: Vec<Vec<Piece>>,
        packed: bool,
        cfg: QuantAdamWConfig,
    ) -> Result<Self> {
        let a = cfg.adamw;
        if !(a.lr >= 0.0 && a.eps >= 0.0 && a.weight_decay >= 0.0) {
            bail!("AdamW: invalid lr/eps/weight_decay in {a:?}");
        }
        if !((0.0..1.0).contains(&a.beta1) && (0.0..1.0).contains(&a.beta2)) {
            bail!("AdamW: betas must lie in [0, 1), got {a:?}");
        }
        if cfg.block_size == 0 || (cfg.kind.bits() == 4 && cfg.block_size % 2 == 1) {
            bail!(
                "quantized AdamW: block size {} is not usable",
                cfg.block_size
            );
        }
        let mut seen = std::collections::HashSet::new();
        for (name, var) in &params {
            if !var.dtype().is_float() {
                bail!(
                    "optimizer: parameter {name} has non-float dtype {:?}",
                    var.dtype()
                );
            }
            if !seen.insert(name.clone()) {
                bail!("optimizer: duplicate parameter name {name}");
            }
        }
        let state = params.iter().map(|_| None).collect();
        Ok(Self {
            maps: Maps::new(cfg.kind),
            cfg,
            params,
            pieces,
            packed,
            state,
        })
    }

    /// The hyperparameters in use.
    pub fn config(&self) -> &QuantAdamWConfig {
        &self.cfg
    }

    /// Bytes the moments of all parameters take once every one has been stepped.
    pub fn planned_state_bytes(&self) -> usize {
        let cfg = &self.cfg;
        self.pieces
            .iter()
            .flatten()
            .map(|p| match cfg.quantizes(p.numel) {
                true => 2 * (p.len * cfg.kind.bits() / 8 + 4 * p.len.div_ceil(cfg.block_size)),
                false => 2 * 4 * p.len,
            })
            .sum()
    }

    /// Bytes the moments take now (the step counts aside).
    pub fn moment_bytes(&self) -> usize {
        self.state
            .iter()
            .flatten()
            .flat_map(|s| &s.pieces)
            .map(|s| s.exp_avg.bytes() + s.exp_avg_sq.bytes())
            .sum()
    }
}

/// A tensor's values in f32 on the host, flattened.
fn host_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.detach()
        .flatten_all()?
        .to_device(&Device::Cpu)?
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()
}

/// `torch.lerp` with a scalar weight (exact at both ends).
fn lerp(start: f32, end: f32, w: f32) -> f32 {
    if w.abs() < 0.5 {
        start + w * (end - start)
    } else {
        end - (end - start) * (1.0 - w)
    }
}

/// torchao's `single_param_adam` (AdamW form) on host values: bias corrections from an f32 step
/// count, moments as lerps, the update from the new f32 moments.
fn torchao_update(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    a: &AdamWConfig,
    step: u64,
) {
    let lr = a.lr as f32;
    let lr_wd = lr * a.weight_decay as f32;
    let step = step as f32;
    let bc1 = 1.0 - (a.beta1 as f32).powf(step);
    let bc2_sqrt = (1.0 - (a.beta2 as f32).powf(step)).sqrt();
    let (w1, w2, eps) = ((1.0 - a.beta1) as f32, (1.0 - a.beta2) as f32, a.eps as f32);
    (p, g, m, v).into_par_iter().for_each(|(p, &g, m, v)| {
        let x = *p - lr_wd * *p;
        *m = lerp(*m, g, w1);
        *v = lerp(*v, g * g, w2);
        let denom = v.sqrt() / bc2_sqrt + eps;
        *p = x - lr * (*m / bc1) / denom;
    });
}

/// bitsandbytes' AdamW on host values: its 8-bit blockwise CPU kernel when `quantized`, else its
/// 32-bit one (`eps` scaled by the second bias correction's root), bias corrections in f64.
fn bnb_update(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    a: &AdamWConfig,
    step: u64,
    quantized: bool,
) {
    let (b1, b2) = (a.beta1 as f32, a.beta2 as f32);
    let (w1, w2) = ((1.0 - a.beta1) as f32, (1.0 - a.beta2) as f32);
    let c1 = 1.0 - a.beta1.powf(step as f64);
    let c2 = (1.0 - a.beta2.powf(step as f64)).sqrt();
    let decay = (a.weight_decay > 0.0).then_some((1.0 - a.lr * a.weight_decay) as f32);
    let eps = a.eps as f32;
    let (c2_f, neg_lr_c1) = (c2 as f32, (-a.lr / c1) as f32);
    let (eps_c2, step_size) = ((a.eps * c2) as f32, (-a.lr * c2 / c1) as f32);
    (p, g, m, v).into_par_iter().for_each(|(p, &g, m, v)| {
        *m = *m * b1 + w1 * g;
        *v = *v * b2 + w2 * g * g;
        let mut x = *p;
        if let Some(d) = decay {
            x *= d;
        }
        *p = if quantized {
            let denom = v.sqrt() / c2_f + eps;
            x + neg_lr_c1 * *m / denom
        } else {
            x + step_size * (*m / (v.sqrt() + eps_c2))
        };
    });
}

impl Optimizer for QuantAdamW {
    fn step_scaled(&mut self, grads: &GradStore, grad_scale: f64) -> Result<()> {
        let cfg = self.cfg;
        let vars = self.params.iter().zip(&self.pieces);
        for (((name, var), pieces), state) in vars.zip(self.state.iter_mut()) {
            let Some(grad) = grads.get(var.as_tensor()) else {
                continue;
            };
            let n = var.elem_count();
            let mut g = host_f32(grad)?;
            if g.len() != n {
                bail!(
                    "optimizer: gradient of {name} has {} values, parameter {n}",
                    g.len()
                );
            }
            if grad_scale != 1.0 {
                let s = grad_scale as f32;
                g.par_iter_mut().for_each(|x| *x *= s);
            }
            let st = state.get_or_insert_with(|| QState {
                step: 0,
                pieces: pieces
                    .iter()
                    .map(|pc| {
                        let q = cfg.quantizes(pc.numel);
                        PieceState {
                            exp_avg: Moment::zeros(pc.len, q, &cfg),
                            exp_avg_sq: Moment::zeros(pc.len, q, &cfg),
                        }
                    })
                    .collect(),
            });
            st.step += 1;
            let mut p = host_f32(var.as_tensor())?;
            for (pc, ps) in pieces.iter().zip(st.pieces.iter_mut()) {
                let (p, g) = (&mut p[pc.at..pc.at + pc.len], &g[pc.at..pc.at + pc.len]);
                let mut m = ps.exp_avg.dequantize(pc.len, &self.maps.signed, &cfg);
                let mut v = ps.exp_avg_sq.dequantize(pc.len, &self.maps.unsigned, &cfg);
                match cfg.kind {
                    QuantKind::Bnb8bit => {
                        let q = matches!(ps.exp_avg, Moment::Quant { .. });
                        bnb_update(p, g, &mut m, &mut v, &cfg.adamw, st.step, q)
                    }
                    _ => torchao_update(p, g, &mut m, &mut v, &cfg.adamw, st.step),
                }
                ps.exp_avg.store(m, &self.maps.signed, &cfg);
                ps.exp_avg_sq.store(v, &self.maps.unsigned, &cfg);
            }
            let value = Tensor::from_vec(p, var.shape(), var.device())?.to_dtype(var.dtype())?;
            var.set(&value)?;
        }
        Ok(())
    }

    fn state_bytes(&self) -> Result<usize> {
        Ok(self.moment_bytes() + 4 * self.state.iter().flatten().count())
    }

    fn lr(&self) -> f64 {
        self.cfg.adamw.lr
    }

    fn set_lr(&mut self, lr: f64) {
        self.cfg.adamw.lr = lr;
    }

    fn state_dict(&self) -> Result<Vec<(String, Tensor)>> {
        if self.packed {
            return self.packed_state_dict();
        }
        let mut out = Vec::new();
        for ((name, var), st) in self.params.iter().zip(&self.state) {
            let Some(st) = st else { continue };
            let dev = var.device();
            out.push((
                format!("{name}.step"),
                step_tensor(st.step, var.as_tensor())?,
            ));
            let ps = &st.pieces[0];
            ps.exp_avg
                .export(&format!("{name}.exp_avg"), dev, &mut out)?;
            ps.exp_avg_sq
                .export(&format!("{name}.exp_avg_sq"), dev, &mut out)?;
        }
        Ok(out)
    }

    fn load_state_dict(&mut self, state: &HashMap<String, Tensor>) -> Result<()> {
        let suffixes = [
            "step",
            "exp_avg",
            "exp_avg_sq",
            "exp_avg_codes",
            "exp_avg_absmax",
            "exp_avg_sq_codes",
            "exp_avg_sq_absmax",
        ];
        check_keys(
            state,
            self.params.iter().map(|(n, _)| n.as_str()),
            &suffixes,
        )?;
        if self.packed {
            return self.load_packed(state);
        }
        let cfg = self.cfg;
        for ((name, var), st) in self.params.iter().zip(self.state.iter_mut()) {
            let n = var.elem_count();
            let step = match state.get(&format!("{name}.step")) {
                Some(t) => Some(step_from_tensor(t)?),
                None => None,
            };
            let m = Moment::import(state, &format!("{name}.exp_avg"), n, &cfg)?;
            let v = Moment::import(state, &format!("{name}.exp_avg_sq"), n, &cfg)?;
            *st = match (step, m, v) {
                (Some(step), Some(exp_avg), Some(exp_avg_sq)) => Some(QState {
                    step,
                    pieces: vec![PieceState {
                        exp_avg,
                        exp_avg_sq,
                    }],
                }),
                (None, None, None) => None,
                _ => bail!("AdamW state for {name}: step, exp_avg and exp_avg_sq go together"),
            };
        }
        Ok(())
    }
}
