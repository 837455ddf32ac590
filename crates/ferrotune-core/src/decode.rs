//! The building blocks of one decode step (one new token for each of a few rows), shaped for a
//! KV cache written in place.
//!
//! Decoding reads every weight once per token, so its speed is set by memory bandwidth and, on a
//! GPU, by how many kernels a token launches. On CUDA (f32/bf16, built with `cuda`) each function
//! here is one kernel: the projections are GEMVs that stream the weights with wide loads (several
//! stacked matrices, a bias and the residual add in the same pass; gate, up and the activation in
//! one), and RoPE, the per-head norms, the cache write and the attention over the cache are one
//! kernel each (attention over a long cache two: keys split over blocks, then the combine).
//! Elsewhere they are the same candle ops the model's forward uses, so a decode step built from
//! them gives the forward's results on the CPU (the reference the GPU kernels are tested
//! against). Nothing here records a backward: this is inference only.

use candle_core::{bail, Device, Result, Tensor};

use crate::fused::{self, GatedAct};
use crate::ops;

/// Most rows (prompts decoded together) the decode kernels take in one call.
pub const MAX_ROWS: usize = 8;

static ENABLED: crate::switch::EnvSwitch =
    crate::switch::EnvSwitch::new(&crate::switch::DECODE_KERNELS);

/// Whether the decode kernels are on: [`set_enabled`]'s last value, else on unless
/// `FERROTUNE_DECODE_KERNELS=0`.
pub fn enabled() -> bool {
    ENABLED.get()
}

/// Turns the decode kernels on or off for the whole process (`bench decode` times both).
pub fn set_enabled(on: bool) {
    ENABLED.set(on);
}

/// Whether the GPU decode kernels serve `x`: a CUDA f32/bf16 tensor of at most [`MAX_ROWS`] rows
/// (the product of all but its last dimension) whose width is a multiple of 8 (the kernels load
/// 8 elements at a time), outside autograd, in a `cuda` build, with the kernels [`enabled`].
pub fn kernels_apply(x: &Tensor) -> bool {
    #[cfg(feature = "cuda")]
    {
        let width = x.dims().last().copied().unwrap_or(0);
        width % 8 == 0 && width > 0 && gpu_rows(x, x.elem_count() / width)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = x;
        false
    }
}

/// One matrix of a stacked projection: `weight` `[out, in]` (PyTorch's layout) and its bias.
#[derive(Debug, Clone, Copy)]
pub struct Projection<'a> {
    pub weight: &'a Tensor,
    pub bias: Option<&'a Tensor>,
}

/// `x` `[rows, in]` through up to three projections side by side: `[rows, Σ out]` with
/// `x · Wᵢᵀ (+ bᵢ)` in column blocks (q, k and v from one pass), plus `residual` `[rows, Σ out]`
/// when given (the residual add after `o_proj` / `down_proj`).
pub fn linear_rows(
    x: &Tensor,
    projections: &[Projection],
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let (_, width) = x.dims2()?;
    if projections.is_empty() || projections.len() > 3 {
        bail!("linear_rows: 1 to 3 projections, got {}", projections.len());
    }
    for p in projections {
        let (_, w_in) = p.weight.dims2()?;
        if w_in != width {
            bail!(
                "linear_rows: weight {:?} does not take inputs of width {width}",
                p.weight.dims()
            );
        }
    }
    #[cfg(feature = "cuda")]
    if kernels_apply(x)
        && projections
            .iter()
            .all(|p| same_kind(x, p.weight) && p.bias.is_none_or(|b| same_kind(x, b)))
        && residual.is_none_or(|r| same_kind(x, r))
    {
        return crate::cuda::decode::gemv(x, projections, residual);
    }
    let outs = projections
        .iter()
        .map(|p| ops::linear(x, p.weight, p.bias))
        .collect::<Result<Vec<_>>>()?;
    let out = if outs.len() == 1 {
        outs.into_iter().next().expect("one projection")
    } else {
        Tensor::cat(&outs, 1)?
    };
    match residual {
        Some(r) => r + out,
        None => Ok(out),
    }
}

/// The gated MLP's first half for `x` `[rows, in]`: `act(x · gateᵀ + b) · (x · upᵀ + b)`,
/// `[rows, out]`.
pub fn gated_rows(x: &Tensor, gate: Projection, up: Projection, act: GatedAct) -> Result<Tensor> {
    if gate.weight.dims() != up.weight.dims() || gate.weight.dim(1)? != x.dim(1)? {
        bail!(
            "gated_rows: gate {:?} and up {:?} do not fit x {:?}",
            gate.weight.dims(),
            up.weight.dims(),
            x.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if kernels_apply(x)
        && [gate, up]
            .iter()
            .all(|p| same_kind(x, p.weight) && p.bias.is_none_or(|b| same_kind(x, b)))
    {
        return crate::cuda::decode::gated_gemv(x, gate, up, act);
    }
    fused::swiglu(
        &ops::linear(x, gate.weight, gate.bias)?,
        &ops::linear(x, up.weight, up.bias)?,
        act,
    )
}

/// Attention heads of a layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub query: usize,
    pub kv: usize,
    pub dim: usize,
}

/// Per-head RMSNorm weights for queries and keys (Qwen3's `q_norm` / `k_norm`).
#[derive(Debug, Clone, Copy)]
pub struct QkNorm<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub eps: f64,
    pub offset_one: bool,
}

/// Largest head dimension the decode kernels take.
pub const MAX_HEAD_DIM: usize = 256;

/// Where a decode step is in the KV cache: it writes slot `len − 1` and attends to keys up to
/// `len`. The kernels take `len` as an argument, except inside a captured CUDA graph
/// ([`crate::graph`]), whose arguments stay as they were at capture: there they read
/// `[len − 1, len]` from `counters` (u32, on the device), which is rewritten before every replay.
/// The CPU path reads `counters` too when given, so a replay can be checked on the CPU.
#[derive(Debug, Clone, Copy)]
pub struct StepPosition<'a> {
    /// Cached positions after this step (its slot + 1).
    pub len: usize,
    /// `[len − 1, len]` as the kernels read them in a replayed graph.
    pub counters: Option<&'a Tensor>,
}

impl StepPosition<'_> {
    /// The step's `len` as the ops will see it: from `counters` when they are on the CPU (on a GPU
    /// the kernels read them; `len`, the value at capture, only sizes the launch).
    fn effective_len(&self) -> Result<usize> {
        match self.counters {
            Some(c) if c.device().is_cpu() => {
                let v = c.to_vec1::<u32>()?;
                match v.as_slice() {
                    [slot, len] if *len == slot + 1 => Ok(*len as usize),
                    other => bail!("step counters must be [slot, slot + 1], got {other:?}"),
                }
            }
            _ => Ok(self.len),
        }
    }
}

/// Splits `qkv` `[rows, (query + 2·kv) · dim]` (one token per row) into heads, normalizes query
/// and key heads when `norm` is given, applies RoPE (`cos`, `sin`: `[rows, rot]`) to both, and
/// writes keys and values into slot `at.len − 1` of `k_cache` / `v_cache` (`[rows, kv, cap,
/// dim]`, contiguous, modified in place). Returns the queries, `[rows, query, dim]`.
#[allow(clippy::too_many_arguments)]
pub fn rope_into_cache(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    norm: Option<QkNorm>,
    heads: Heads,
    k_cache: &Tensor,
    v_cache: &Tensor,
    at: StepPosition,
) -> Result<Tensor> {
    let pos = at.effective_len()?.wrapping_sub(1);
    let (rows, width) = qkv.dims2()?;
    let Heads { query, kv, dim } = heads;
    let (cr, rot) = cos.dims2()?;
    let (kr, kh, cap, kd) = k_cache.dims4()?;
    if width != (query + 2 * kv) * dim
        || cr != rows
        || sin.dims() != cos.dims()
        || rot > dim
        || rot % 2 != 0
        || (kr, kh, kd) != (rows, kv, dim)
        || v_cache.dims() != k_cache.dims()
        || pos >= cap
        || at
            .counters
            .is_some_and(|c| c.dims() != [2] || c.dtype() != candle_core::DType::U32)
        || kv == 0
        || query % kv != 0
    {
        bail!(
            "rope_into_cache: qkv {:?}, cos {:?}, caches {:?} / {:?} at slot {pos} do not fit {heads:?}",
            qkv.dims(),
            cos.dims(),
            k_cache.dims(),
            v_cache.dims()
        );
    }
    if !k_cache.is_contiguous() || !v_cache.is_contiguous() {
        bail!("rope_into_cache: the caches must be contiguous");
    }
    #[cfg(feature = "cuda")]
    if on_gpu(qkv)
        && dim <= MAX_HEAD_DIM
        && [cos, sin, k_cache, v_cache]
            .iter()
            .all(|t| same_kind(qkv, t))
        && norm.is_none_or(|n| same_kind(qkv, n.q) && same_kind(qkv, n.k))
        && at
            .counters
            .is_none_or(|c| c.device().same_device(qkv.device()))
    {
        return crate::cuda::decode::qkv_rope(
            qkv,
            cos,
            sin,
            norm,
            heads,
            k_cache,
            v_cache,
            pos,
            at.counters,
        );
    }
    if at.counters.is_some() && !qkv.device().is_cpu() {
        // The ops below take the slot from the host: recorded in a graph, every replay would
        // write the recording's slot.
        bail!("rope_into_cache: no decode kernel for these inputs, so it cannot be recorded");
    }
    // The model's forward, one position: [rows, 1, heads, dim], norms, RoPE on the transposed view.
    let mut q = qkv
        .narrow(1, 0, query * dim)?
        .reshape((rows, 1, query, dim))?;
    let mut k = qkv
        .narrow(1, query * dim, kv * dim)?
        .reshape((rows, 1, kv, dim))?;
    let v = qkv
        .narrow(1, (query + kv) * dim, kv * dim)?
        .reshape((rows, kv, 1, dim))?;
    if let Some(n) = norm {
        q = fused::rms_norm(&q, n.q, n.eps, n.offset_one)?;
        k = fused::rms_norm(&k, n.k, n.eps, n.offset_one)?;
    }
    let cos = cos.reshape((rows, 1, 1, rot))?;
    let sin = sin.reshape((rows, 1, 1, rot))?;
    let q = fused::rope(&q.transpose(1, 2)?, &cos, &sin)?;
    let k = fused::rope(&k.transpose(1, 2)?, &cos, &sin)?;
    k_cache.slice_set(&k.contiguous()?, 2, pos)?;
    v_cache.slice_set(&v.contiguous()?, 2, pos)?;
    q.reshape((rows, query, dim))
}

/// The first key each row may attend to (its first real token after left padding), on the host
/// and on the device, made once per decode step and shared by every layer.
#[derive(Debug, Clone)]
pub struct FirstKeys {
    host: Vec<u32>,
    /// Read by the CUDA kernel only.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    device: Tensor,
}

impl FirstKeys {
    /// First keys `first` (one per row) for attention on `device`.
    pub fn new(first: Vec<u32>, device: &Device) -> Result<Self> {
        let device = Tensor::new(first.as_slice(), device)?;
        Ok(Self {
            host: first,
            device,
        })
    }

    /// The first keys per row.
    pub fn rows(&self) -> &[u32] {
        &self.host
    }
}

/// Attention of one query per row, `q` `[rows, query heads, dim]`, over keys `first[r] .. len`
/// (`len` = `at`'s) of `k_cache` / `v_cache` (`[rows, kv heads, cap, dim]`; a sliding `window`
/// raises the first key to `len − window`), scaled by `scale` and softcapped
/// (`cap · tanh(s / cap)`, Gemma 2) when `softcap` is given. Returns `[rows, query heads · dim]`
/// (the layout `o_proj` takes).
#[allow(clippy::too_many_arguments)]
pub fn cached_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    at: StepPosition,
    first: &FirstKeys,
    window: Option<usize>,
    scale: f64,
    softcap: Option<f64>,
) -> Result<Tensor> {
    let len = at.effective_len()?;
    let (rows, query, dim) = q.dims3()?;
    let (kr, kv, cap, kd) = k_cache.dims4()?;
    if (kr, kd) != (rows, dim)
        || v_cache.dims() != k_cache.dims()
        || len == 0
        || len > cap
        || first.host.len() != rows
        || first.host.iter().any(|&f| f as usize >= len)
        || kv == 0
        || query % kv != 0
    {
        bail!(
            "cached_attention: q {:?}, caches {:?} / {:?}, {len} keys, first keys {:?} do not fit",
            q.dims(),
            k_cache.dims(),
            v_cache.dims(),
            first.host
        );
    }
    #[cfg(feature = "cuda")]
    if on_gpu(q)
        && dim <= MAX_HEAD_DIM
        && dim % 8 == 0
        && same_kind(q, k_cache)
        && same_kind(q, v_cache)
        && first.device.device().same_device(q.device())
        && at
            .counters
            .is_none_or(|c| c.device().same_device(q.device()))
    {
        let window = window.unwrap_or(0);
        return crate::cuda::decode::attention(
            q,
            k_cache,
            v_cache,
            len,
            &first.device,
            window,
            scale as f32,
            softcap.unwrap_or(0.0) as f32,
            at.counters,
        );
    }
    if at.counters.is_some() && !q.device().is_cpu() {
        // The ops below take the length from the host: recorded in a graph, every replay would
        // attend to the recording's keys.
        bail!("cached_attention: no decode kernel for these inputs, so it cannot be recorded");
    }
    let k = k_cache.narrow(2, 0, len)?.contiguous()?;
    let v = v_cache.narrow(2, 0, len)?.contiguous()?;
    let starts: Vec<usize> = first
        .host
        .iter()
        .map(|&f| match window {
            Some(w) => (f as usize).max(len.saturating_sub(w)),
            None => f as usize,
        })
        .collect();
    // The same additive mask the forward builds (0 = attend, the dtype's finite minimum =
    // masked), or none when every row sees every key.
    let mask = if starts.iter().all(|&s| s == 0) {
        None
    } else {
        let allowed: Vec<bool> = starts
            .iter()
            .flat_map(|&s| (0..len).map(move |j| j >= s))
            .collect();
        Some(ops::additive_mask(
            &allowed,
            (rows, 1, 1, len),
            q.dtype(),
            q.device(),
        )?)
    };
    let out = fused::attention_softcapped(
        &q.reshape((rows, query, 1, dim))?,
        &k,
        &v,
        mask.as_ref(),
        scale,
        softcap,
    )?;
    out.reshape((rows, query * dim))
}

/// A CUDA f32/bf16 tensor of at most [`MAX_ROWS`] rows (its first dimension), outside autograd.
#[cfg(feature = "cuda")]
fn on_gpu(x: &Tensor) -> bool {
    x.dims().first().is_some_and(|&rows| gpu_rows(x, rows))
}

/// `x`, taken as `rows` rows, is for the decode kernels: 1 to [`MAX_ROWS`] rows, outside
/// autograd, CUDA f32/bf16, with the kernels [`enabled`].
#[cfg(feature = "cuda")]
fn gpu_rows(x: &Tensor, rows: usize) -> bool {
    (1..=MAX_ROWS).contains(&rows) && !x.track_op() && crate::cuda::applies(&[x]) && enabled()
}

/// Same device and dtype (the kernels take one of each per call).
#[cfg(feature = "cuda")]
fn same_kind(a: &Tensor, b: &Tensor) -> bool {
    a.dtype() == b.dtype() && a.device().same_device(b.device())
}
