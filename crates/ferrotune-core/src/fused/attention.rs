//! Scaled dot-product attention with grouped-query heads, fused flash-attention style: the forward
//! keeps only each query row's softmax statistics, and the backward recomputes the probabilities
//! block by block instead of holding the `[b, heads, t, s]` probability tensor in the graph.

use std::sync::Mutex;

use candle_core::{bail, DType, Device, Result, Shape, Tensor};
use rayon::prelude::*;

use super::kernels::{self, simd_fn};
use super::{contiguous, fused_applies, guard_slice, guard_slices, Forward};
use crate::custom_op::{Fused, FusedOp, Grads};

/// `softmax(q kᵀ · scale + mask) v` per head, with grouped-query attention; differentiable w.r.t.
/// `q`, `k` and `v`.
///
/// `q` is `[b, nh, t, hd]`, `k` and `v` `[b, nkv, s, hd]` with `nh` a multiple of `nkv`: query
/// head `h` attends with key/value head `h / (nh / nkv)`. `mask` is an additive `[b, 1, t, s]`
/// mask (a leading 1 is broadcast over the batch; 0 = attend, a large negative such as `f32::MIN`
/// = masked) and takes no gradient. The softmax runs in f32, as transformers' eager attention.
///
/// For f32 CPU tensors this is a fused op: per query row it stores only the row maximum and the
/// softmax denominator, and the backward recomputes probabilities from them (dV = Pᵀ dO,
/// dP = dO Vᵀ, dS = P ⊙ (dP − rowsum(dO ⊙ O)), dQ = dS K · scale, dK = dSᵀ Q · scale, with dK/dV
/// summed over the query heads of each group). Keys masked with `f32::MIN` (or −∞) at the edges
/// of a block of query rows are skipped, which changes no value: their probability is exactly 0.
/// A row whose keys are all masked with `f32::MIN` gets uniform weights, as with the composite;
/// with a −∞ mask it gets zeros instead of the composite's NaN. Other dtypes and devices use the
/// composite candle formula.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
) -> Result<Tensor> {
    attention_softcapped(q, k, v, mask, scale, None)
}

/// [`attention`] with Gemma 2's softcapping: the scaled scores become `cap · tanh(s / cap)` before
/// the mask is added (`softcap = Some(cap)`). The fused CPU op and the GPU's chunked kernels apply
/// it in the forward and multiply the score gradient by `1 − tanh²` in the backward.
pub fn attention_softcapped(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    softcap: Option<f64>,
) -> Result<Tensor> {
    if let Some(cap) = softcap {
        if !(cap > 0.0 && cap.is_finite()) {
            bail!("attention: the softcap must be a positive number, got {cap}");
        }
    }
    let dims = check_shapes("attention", q, k, v, mask)?;
    // Empty tensors gain nothing from the kernel (and would give it zero-sized blocks).
    let empty = q.elem_count() == 0 || k.elem_count() == 0;
    #[cfg(feature = "cuda")]
    if !empty && crate::cuda::applies(&[q, k, v]) && mask.is_none_or(|m| m.device().is_cuda()) {
        return crate::cuda::attention(q, k, v, mask, scale, softcap.unwrap_or(0.0) as f32);
    }
    if empty
        || !fused_applies(&[q, k, v])
        || mask.is_some_and(|m| !matches!(m.device(), Device::Cpu))
    {
        return composite(q, k, v, mask, scale, softcap);
    }
    let op = Attention::new(dims, mask, scale, softcap)?;
    q.contiguous()?
        .apply_op3(&k.contiguous()?, &v.contiguous()?, Fused(op))
}

/// The dimensions of `q` `[b, nh, t, hd]`, `k` and `v` `[b, nkv, s, hd]` and an additive mask
/// `[b or 1, 1, t, s]`, or an error (naming `what`) where they do not fit together.
pub(super) fn check_shapes(
    what: &str,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
) -> Result<Dims> {
    let (b, nh, t, hd) = q.dims4()?;
    let (kb, nkv, s, khd) = k.dims4()?;
    if v.dims() != k.dims() || kb != b || khd != hd {
        bail!(
            "{what}: q {:?}, k {:?} and v {:?} do not fit together (expected k = v = [{b}, kv heads, s, {hd}])",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if nkv == 0 || nh % nkv != 0 {
        bail!("{what}: {nh} query heads are not a multiple of {nkv} key/value heads");
    }
    if let Some(m) = mask {
        let (mb, one, mt, ms) = m.dims4()?;
        if !(mb == b || mb == 1) || one != 1 || mt != t || ms != s {
            bail!(
                "{what}: mask {:?} does not fit scores [{b}, {nh}, {t}, {s}] (expected [{b} or 1, 1, {t}, {s}])",
                m.dims()
            );
        }
    }
    Ok(Dims {
        b,
        nh,
        nkv,
        t,
        s,
        hd,
    })
}

/// The unfused formula (as the decoder computes it), for dtypes and devices without the kernel.
fn composite(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    softcap: Option<f64>,
) -> Result<Tensor> {
    let (b, nh, t, hd) = q.dims4()?;
    let (_, nkv, s, _) = k.dims4()?;
    let groups = nh / nkv;
    // Query heads sharing a key/value head are stacked along the rows: one matmul per kv head.
    let q = q.reshape((b, nkv, groups * t, hd))?;
    // Keys may arrive as a strided view (a fused qkv projection narrowed, RoPE's output): the CPU
    // matmul takes only contiguous operands.
    let scores = (q.matmul(&k.contiguous()?.t()?)? * scale)?;
    let scores = match softcap {
        Some(cap) => crate::ops::softcap(&scores, cap)?,
        None => scores,
    };
    let scores = match mask {
        Some(m) => scores
            .reshape((b, nkv, groups, t, s))?
            .broadcast_add(&m.to_dtype(scores.dtype())?.unsqueeze(1)?)?
            .reshape((b, nkv, groups * t, s))?,
        None => scores,
    };
    crate::ops::softmax_last_dim(&scores)?
        .matmul(&v.contiguous()?)?
        .reshape((b, nh, t, hd))
}

/// What is known of an additive mask `[mb, 1, t, s]` without reading it: which keys each query
/// row may see. Built by the mask's builder ([`register_mask_layout`]) or from its values
/// ([`MaskLayout::from_values`]); the GPU kernels skip the keys no row of a block sees, and where
/// every row's visible keys form one interval they take the intervals instead of the mask.
#[derive(Debug, Clone, PartialEq)]
pub struct MaskLayout {
    /// Per query row, the keys `[first, last)` some batch row lets it see; `(0, s)` when the row
    /// sees no key in some batch row (it attends uniformly to all of them, as the composite
    /// softmax of a row of minima does).
    pub rows: Vec<(usize, usize)>,
    /// Per (mask batch row, query row), the keys `[first, last)` on which the mask is exactly 0,
    /// when it is [`Self::masked`] on every other key of every row (an empty interval for a row
    /// that sees nothing); `None` when some row's visible keys have a gap.
    pub intervals: Option<Vec<(u32, u32)>>,
    /// The value of the masked entries, as f32 (the mask dtype's minimum, or −∞).
    pub masked: f32,
}

impl MaskLayout {
    /// From which entries of a `[mb, t, s]` mask are visible (`allowed[(b · t + i) · s + j]`),
    /// masked entries holding `masked` and visible ones 0.
    pub fn from_allowed(allowed: &[bool], t: usize, s: usize, masked: f32) -> Self {
        Self::build(
            t,
            s,
            masked,
            allowed.chunks_exact(s.max(1)).map(|row| {
                let first = row.iter().position(|&a| a);
                let last = row.iter().rposition(|&a| a).map_or(0, |l| l + 1);
                let exact = first.is_none_or(|f| row[f..last].iter().all(|&a| a));
                (first.map(|f| (f, last)), exact)
            }),
        )
    }

    /// From the values of a `[mb, t, s]` additive mask: entries at or below −1e30 count as
    /// masked. The intervals are kept only when every visible entry is exactly 0 and every masked
    /// one the same value.
    pub fn from_values(values: &[f32], t: usize, s: usize) -> Self {
        let masked = values
            .iter()
            .copied()
            .find(|&v| v <= MASKED)
            .unwrap_or(f32::MIN);
        Self::build(
            t,
            s,
            masked,
            values.chunks_exact(s.max(1)).map(|row| {
                let first = row.iter().position(|&v| v > MASKED);
                let last = row.iter().rposition(|&v| v > MASKED).map_or(0, |l| l + 1);
                // Compared by bits, so that −∞ matches −∞ and NaN matches nothing.
                let is_masked = |v: f32| v.to_bits() == masked.to_bits();
                let exact = match first {
                    None => row.iter().all(|&v| is_masked(v)),
                    Some(f) => {
                        row[f..last].iter().all(|&v| v == 0.0)
                            && row[..f].iter().chain(&row[last..]).all(|&v| is_masked(v))
                    }
                };
                (first.map(|f| (f, last)), exact)
            }),
        )
    }

    /// Gathers per-row `(visible keys, exactly one interval)` over the mask's rows, batch-major.
    fn build(
        t: usize,
        s: usize,
        masked: f32,
        rows: impl Iterator<Item = (Option<(usize, usize)>, bool)>,
    ) -> Self {
        let mut union = vec![(usize::MAX, 0usize); t];
        let mut intervals = Some(Vec::new());
        for (i, (seen, exact)) in rows.enumerate() {
            let u = &mut union[i % t.max(1)];
            *u = match seen {
                Some((f, l)) => (u.0.min(f), u.1.max(l)),
                None => (0, s),
            };
            intervals = intervals.filter(|_| exact).map(|mut v| {
                let (f, l) = seen.unwrap_or((0, 0));
                v.push((f as u32, l as u32));
                v
            });
        }
        for u in union.iter_mut().filter(|u| u.0 == usize::MAX) {
            *u = (0, s);
        }
        Self {
            rows: union,
            intervals,
            masked,
        }
    }
}

/// Layouts of masks whose builder registered them (see [`register_mask_layout`]), newest last.
static MASK_LAYOUTS: std::sync::Mutex<Vec<(candle_core::TensorId, std::sync::Arc<MaskLayout>)>> =
    std::sync::Mutex::new(Vec::new());

/// Registers the layout of an additive mask its builder made, so kernels that skip masked keys
/// need not read the mask back from the device. The last few registrations are kept.
pub fn register_mask_layout(mask: &Tensor, layout: MaskLayout) {
    let mut reg = MASK_LAYOUTS.lock().unwrap_or_else(|e| e.into_inner());
    if reg.len() >= 8 {
        reg.remove(0);
    }
    reg.push((mask.id(), std::sync::Arc::new(layout)));
}

/// The layout registered for `mask` by [`register_mask_layout`], if any.
pub fn registered_mask_layout(mask: &Tensor) -> Option<std::sync::Arc<MaskLayout>> {
    let reg = MASK_LAYOUTS.lock().unwrap_or_else(|e| e.into_inner());
    reg.iter()
        .rev()
        .find(|(id, _)| *id == mask.id())
        .map(|(_, r)| r.clone())
}

/// Query rows per block: one block's scores (`BLOCK × s` floats) stay in cache.
const BLOCK: usize = 64;

/// A mask value at or below this counts as masked when trimming key ranges (`f32::MIN`, −∞).
const MASKED: f32 = -1e30;

/// The attention's sizes: `q` `[b, nh, t, hd]`, `k` and `v` `[b, nkv, s, hd]`.
#[derive(Clone, Copy)]
pub(super) struct Dims {
    pub(super) b: usize,
    pub(super) nh: usize,
    pub(super) nkv: usize,
    pub(super) t: usize,
    pub(super) s: usize,
    pub(super) hd: usize,
}

impl Dims {
    fn groups(&self) -> usize {
        self.nh / self.nkv
    }
    fn blocks(&self) -> usize {
        self.t.div_ceil(BLOCK)
    }
}

/// For each (mask batch, block of query rows), the key range `[lo, hi)` outside which every row of
/// the block is masked. A block holding a fully masked row keeps all keys, so that row's uniform
/// weights come out as in the composite.
fn key_ranges(mask: &[f32], mb: usize, t: usize, s: usize) -> Vec<(usize, usize)> {
    let blocks = t.div_ceil(BLOCK);
    (0..mb * blocks)
        .into_par_iter()
        .map(|idx| {
            let (bi, blk) = (idx / blocks, idx % blocks);
            let (mut lo, mut hi) = (s, 0);
            for i in blk * BLOCK..((blk + 1) * BLOCK).min(t) {
                let row = &mask[(bi * t + i) * s..][..s];
                match row.iter().position(|&m| m > MASKED) {
                    None => return (0, s),
                    Some(first) => {
                        let last = row.iter().rposition(|&m| m > MASKED).unwrap_or(first);
                        lo = lo.min(first);
                        hi = hi.max(last + 1);
                    }
                }
            }
            (lo, hi.max(lo))
        })
        .collect()
}

/// The fused kernel's state: sizes, settings, the mask's key ranges and the forward's row
/// statistics. [`FusedOp`] over `(q, k, v)` here; `attention_sinks.rs` runs the same kernel with
/// a sink logit per head.
pub(super) struct Attention {
    dims: Dims,
    scale: f32,
    /// Gemma 2's cap on the scaled scores (`cap · tanh(s / cap)`), applied before the mask.
    softcap: Option<f32>,
    /// The additive mask as contiguous f32 `[b or 1, 1, t, s]`.
    mask: Option<Tensor>,
    /// Key range of each (mask batch, row block), from [`key_ranges`].
    ranges: Vec<(usize, usize)>,
    /// Per query row `(max, Σ exp(score − max))` of the softmax (the sink's logit included in
    /// both), from the forward; `(+∞, 1)` for a row with no finite score, which makes its
    /// recomputed probabilities 0.
    stats: Mutex<Vec<(f32, f32)>>,
    /// A sink logit per query head that takes no gradient (see [`Attention::with_sinks`]).
    sinks: Option<Vec<f32>>,
}

/// The backward's gradients: `dq`, `dk`, `dv` (as the inputs' data) and, with sinks, `d(sinks)`
/// per query head.
pub(super) type AttentionGrads = (Vec<f32>, Vec<f32>, Vec<f32>, Option<Vec<f32>>);

/// One row block's view of the mask: the slice starting at its first row and key `lo`, read with
/// row stride `s`.
struct MaskRows<'a> {
    data: &'a [f32],
    stride: usize,
}

/// `s ← cap · tanh(s / cap)` over a block of scores; with `derivative`, also writes
/// `1 − tanh²(s / cap)` (the factor the score gradient takes) there.
fn softcap_rows(scores: &mut [f32], cap: f32, derivative: Option<&mut [f32]>) {
    match derivative {
        Some(d) => {
            for (x, d) in scores.iter_mut().zip(d.iter_mut()) {
                let t = (*x / cap).tanh();
                *x = cap * t;
                *d = 1.0 - t * t;
            }
        }
        None => {
            for x in scores.iter_mut() {
                *x = cap * (*x / cap).tanh();
            }
        }
    }
}

simd_fn! {
    /// Adds the mask to a block of scores (`rows × w`) and turns each row into probabilities,
    /// writing the row's `(max, sum)`; a `sink` logit joins each row's max and sum (and takes no
    /// column).
    fn softmax_rows(
        scores: &mut [f32],
        w: usize,
        mask: Option<MaskRows<'_>>,
        sink: Option<f32>,
        stats: &mut [(f32, f32)],
    ) {
        for (r, (row, st)) in scores.chunks_exact_mut(w).zip(stats.iter_mut()).enumerate() {
            if let Some(m) = &mask {
                for (x, &mv) in row.iter_mut().zip(&m.data[r * m.stride..][..w]) {
                    *x += mv;
                }
            }
            let mut mx = kernels::max(row);
            // Compared so, a NaN maximum stays NaN.
            if sink.is_some_and(|sk| sk > mx) {
                mx = sink.unwrap_or(mx);
            }
            if mx == f32::NEG_INFINITY || mx.is_nan() {
                row.fill(0.0);
                *st = (f32::INFINITY, 1.0);
                continue;
            }
            let mut sum = kernels::exp_shift_inplace(row, mx);
            if let Some(sk) = sink {
                sum += kernels::exp(sk - mx);
            }
            for x in row.iter_mut() {
                *x /= sum;
            }
            *st = (mx, sum);
        }
    }
}

simd_fn! {
    /// Recomputes a block's probabilities from its scores and the forward's statistics.
    fn probs_rows(scores: &mut [f32], w: usize, mask: Option<MaskRows<'_>>, stats: &[(f32, f32)]) {
        for (r, (row, &(mx, sum))) in scores.chunks_exact_mut(w).zip(stats).enumerate() {
            if let Some(m) = &mask {
                for (x, &mv) in row.iter_mut().zip(&m.data[r * m.stride..][..w]) {
                    *x += mv;
                }
            }
            for x in row.iter_mut() {
                *x = kernels::exp(*x - mx) / sum;
            }
        }
    }
}

simd_fn! {
    /// `dP ← P ⊙ (dP − rowsum(dO ⊙ O))` for a block (`dO`, `O` rows of `hd`).
    fn softmax_grad_rows(p: &[f32], dp: &mut [f32], w: usize, d_o: &[f32], o: &[f32], hd: usize) {
        for (r, (pr, dpr)) in p.chunks_exact(w).zip(dp.chunks_exact_mut(w)).enumerate() {
            let di = kernels::dot(&d_o[r * hd..][..hd], &o[r * hd..][..hd]);
            for (g, &pv) in dpr.iter_mut().zip(pr) {
                *g = pv * (*g - di);
            }
        }
    }
}

impl Attention {
    /// The kernel for checked `dims` ([`check_shapes`]): the mask as contiguous f32 and the key
    /// range of each block of query rows.
    pub(super) fn new(
        dims: Dims,
        mask: Option<&Tensor>,
        scale: f64,
        softcap: Option<f64>,
    ) -> Result<Self> {
        let Dims { t, s, .. } = dims;
        let (mask, ranges) = match mask {
            Some(m) => {
                let m = m.to_dtype(DType::F32)?.contiguous()?;
                let ranges = {
                    let (mb, _, _, _) = m.dims4()?;
                    let guard = m.storage_and_layout();
                    key_ranges(guard_slice(&guard, "attention")?, mb, t, s)
                };
                (Some(m), ranges)
            }
            None => (None, vec![(0, s); t.div_ceil(BLOCK)]),
        };
        Ok(Self {
            dims,
            scale: scale as f32,
            softcap: softcap.map(|c| c as f32),
            mask,
            ranges,
            stats: Mutex::new(Vec::new()),
            sinks: None,
        })
    }

    /// The kernel with a fixed sink logit per query head, as an op over `(q, k, v)` that gives
    /// no gradient to the sinks (they are frozen, as under LoRA, or nothing trains).
    pub(super) fn with_sinks(self, sinks: Vec<f32>) -> Self {
        Self {
            sinks: Some(sinks),
            ..self
        }
    }

    /// The mask rows of block `blk` of batch element `bi`, from key `lo` on.
    fn mask_rows<'a>(
        &self,
        mask: Option<&'a [f32]>,
        bi: usize,
        blk: usize,
        lo: usize,
    ) -> Option<MaskRows<'a>> {
        let Dims { t, s, .. } = self.dims;
        mask.map(|m| {
            let mb = m.len() / (t * s);
            let bi = if mb == 1 { 0 } else { bi };
            MaskRows {
                data: &m[(bi * t + blk * BLOCK) * s + lo..],
                stride: s,
            }
        })
    }

    fn range(&self, bi: usize, blk: usize) -> (usize, usize) {
        let blocks = self.dims.blocks();
        let mb = self.ranges.len() / blocks;
        self.ranges[if mb == 1 { 0 } else { bi } * blocks + blk]
    }
}

impl Attention {
    /// The forward on the inputs' data (`sinks`: one logit per query head), keeping the row
    /// statistics for the backward.
    pub(super) fn forward_with(
        &self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        sinks: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        let dims = self.dims;
        let Dims { nh, t, s, hd, .. } = dims;
        let mask_guard = self.mask.as_ref().map(|m| m.storage_and_layout());
        let mask = match &mask_guard {
            Some(g) => Some(guard_slice(g, "attention")?),
            None => None,
        };
        let groups = dims.groups();
        let mut out = vec![0f32; q.len()];
        let mut stats = vec![(0f32, 0f32); dims.b * nh * t];
        out.par_chunks_mut(t * hd)
            .zip(stats.par_chunks_mut(t))
            .enumerate()
            .for_each(|(bh, (out_h, stats_h))| {
                let (bi, h) = (bh / nh, bh % nh);
                let kv = bi * dims.nkv + h / groups;
                let qh = &q[bh * t * hd..][..t * hd];
                let kh = &k[kv * s * hd..][..s * hd];
                let vh = &v[kv * s * hd..][..s * hd];
                out_h
                    .par_chunks_mut(BLOCK * hd)
                    .zip(stats_h.par_chunks_mut(BLOCK))
                    .enumerate()
                    .for_each(|(blk, (out_b, stats_b))| {
                        let rows = stats_b.len();
                        let (lo, hi) = self.range(bi, blk);
                        let w = hi - lo;
                        let mut scores = vec![0f32; rows * w];
                        // SAFETY: the operands are the block's `rows × hd` queries and the
                        // `w × hd` keys/values `lo..hi` of this head, all inside their slices.
                        unsafe {
                            kernels::gemm(
                                (rows, w, hd),
                                scores.as_mut_ptr(),
                                w,
                                false,
                                (qh[blk * BLOCK * hd..].as_ptr(), hd, 1),
                                (kh[lo * hd..].as_ptr(), 1, hd),
                                self.scale,
                            );
                        }
                        if let Some(cap) = self.softcap {
                            softcap_rows(&mut scores, cap, None);
                        }
                        let sink = sinks.map(|sk| sk[h]);
                        let mask = self.mask_rows(mask, bi, blk, lo);
                        softmax_rows(&mut scores, w, mask, sink, stats_b);
                        unsafe {
                            kernels::gemm(
                                (rows, hd, w),
                                out_b.as_mut_ptr(),
                                hd,
                                false,
                                (scores.as_ptr(), w, 1),
                                (vh[lo * hd..].as_ptr(), hd, 1),
                                1.0,
                            );
                        }
                    });
            });
        *self.stats.lock().expect("stats lock") = stats;
        Ok(out)
    }

    /// The backward on the inputs' data, the output `o` and its gradient `d_o`: dQ, dK, dV and,
    /// with `sinks`, each sink's gradient `−Σ_rows p_sink · rowsum(dO ⊙ O)` (the sink takes no
    /// value, so its score gradient is `p_sink · (0 − rowsum(dO ⊙ O))`), summed over the batch.
    pub(super) fn backward_with(
        &self,
        [q, k, v, o, d_o]: [&[f32]; 5],
        sinks: Option<&[f32]>,
    ) -> Result<AttentionGrads> {
        let dims = self.dims;
        let Dims {
            b,
            nh,
            nkv,
            t,
            s,
            hd,
        } = dims;
        let mask_guard = self.mask.as_ref().map(|m| m.storage_and_layout());
        let mask = match &mask_guard {
            Some(g) => Some(guard_slice(g, "attention")?),
            None => None,
        };
        let stats = self.stats.lock().expect("stats lock");
        if stats.len() != b * nh * t {
            bail!("attention: backward before forward");
        }
        let groups = dims.groups();
        let mut dq = vec![0f32; q.len()];
        // Key/value gradients per *query* head, summed over each group afterwards.
        let mut dk_q = vec![0f32; b * nh * s * hd];
        let mut dv_q = vec![0f32; b * nh * s * hd];
        // Each (batch, head)'s part of its sink's gradient.
        let mut dsink_q = vec![0f32; if sinks.is_some() { b * nh } else { 0 }];
        let dsink_parts: Vec<Option<&mut f32>> = if sinks.is_some() {
            dsink_q.iter_mut().map(Some).collect()
        } else {
            (0..b * nh).map(|_| None).collect()
        };
        dq.par_chunks_mut(t * hd)
            .zip(dk_q.par_chunks_mut(s * hd).zip(dv_q.par_chunks_mut(s * hd)))
            .zip(dsink_parts)
            .enumerate()
            .for_each(|(bh, ((dq_h, (dk_h, dv_h)), dsink))| {
                let (bi, h) = (bh / nh, bh % nh);
                let kv = bi * nkv + h / groups;
                let qh = &q[bh * t * hd..][..t * hd];
                let oh = &o[bh * t * hd..][..t * hd];
                let doh = &d_o[bh * t * hd..][..t * hd];
                let kh = &k[kv * s * hd..][..s * hd];
                let vh = &v[kv * s * hd..][..s * hd];
                let stats_h = &stats[bh * t..][..t];
                let mut p = vec![0f32; BLOCK * s];
                let mut dp = vec![0f32; BLOCK * s];
                // The softcap's derivative per score of the block (empty without a softcap).
                let mut cap_grad = vec![0f32; if self.softcap.is_some() { BLOCK * s } else { 0 }];
                for blk in 0..dims.blocks() {
                    let i0 = blk * BLOCK;
                    let rows = BLOCK.min(t - i0);
                    let (lo, hi) = self.range(bi, blk);
                    let w = hi - lo;
                    let (p, dp) = (&mut p[..rows * w], &mut dp[..rows * w]);
                    let q_blk = qh[i0 * hd..].as_ptr();
                    let do_blk = doh[i0 * hd..].as_ptr();
                    let k_lo = kh[lo * hd..].as_ptr();
                    let v_lo = vh[lo * hd..].as_ptr();
                    // SAFETY (all GEMMs below): operands are this block's `rows × hd` rows of
                    // q/dO/dQ, the `w × hd` rows `lo..hi` of k/v/dK/dV of this head, and the
                    // `rows × w` block buffers; every access stays inside those slices.
                    unsafe {
                        kernels::gemm(
                            (rows, w, hd),
                            p.as_mut_ptr(),
                            w,
                            false,
                            (q_blk, hd, 1),
                            (k_lo, 1, hd),
                            self.scale,
                        );
                    }
                    if let Some(cap) = self.softcap {
                        softcap_rows(p, cap, Some(&mut cap_grad[..rows * w]));
                    }
                    probs_rows(
                        p,
                        w,
                        self.mask_rows(mask, bi, blk, lo),
                        &stats_h[i0..i0 + rows],
                    );
                    unsafe {
                        kernels::gemm(
                            (rows, w, hd),
                            dp.as_mut_ptr(),
                            w,
                            false,
                            (do_blk, hd, 1),
                            (v_lo, 1, hd),
                            1.0,
                        );
                    }
                    softmax_grad_rows(
                        p,
                        dp,
                        w,
                        &doh[i0 * hd..][..rows * hd],
                        &oh[i0 * hd..][..rows * hd],
                        hd,
                    );
                    if self.softcap.is_some() {
                        // dS_raw = dS_capped ⊙ (1 − tanh²).
                        for (g, &d) in dp.iter_mut().zip(&cap_grad[..rows * w]) {
                            *g *= d;
                        }
                    }
                    unsafe {
                        kernels::gemm(
                            (w, hd, rows),
                            dv_h[lo * hd..].as_mut_ptr(),
                            hd,
                            true,
                            (p.as_ptr(), 1, w),
                            (do_blk, hd, 1),
                            1.0,
                        );
                        kernels::gemm(
                            (rows, hd, w),
                            dq_h[i0 * hd..].as_mut_ptr(),
                            hd,
                            false,
                            (dp.as_ptr(), w, 1),
                            (k_lo, hd, 1),
                            self.scale,
                        );
                        kernels::gemm(
                            (w, hd, rows),
                            dk_h[lo * hd..].as_mut_ptr(),
                            hd,
                            true,
                            (dp.as_ptr(), 1, w),
                            (q_blk, hd, 1),
                            self.scale,
                        );
                    }
                }
                if let (Some(dsink), Some(sinks)) = (dsink, sinks) {
                    let sk = sinks[h];
                    *dsink = -(0..t)
                        .map(|i| {
                            let (mx, sum) = stats_h[i];
                            let di = kernels::dot(&doh[i * hd..][..hd], &oh[i * hd..][..hd]);
                            kernels::exp(sk - mx) / sum * di
                        })
                        .sum::<f32>();
                }
            });
        let dsinks = sinks.map(|_| {
            (0..nh)
                .map(|h| (0..b).map(|bi| dsink_q[bi * nh + h]).sum())
                .collect()
        });
        let (dk, dv) = if groups == 1 {
            (dk_q, dv_q)
        } else {
            let sum_groups = |parts: &[f32]| {
                let mut out = vec![0f32; b * nkv * s * hd];
                out.par_chunks_mut(s * hd)
                    .enumerate()
                    .for_each(|(bk, dst)| {
                        let (bi, kv) = (bk / nkv, bk % nkv);
                        for g in 0..groups {
                            let h = bi * nh + kv * groups + g;
                            for (d, x) in dst.iter_mut().zip(&parts[h * s * hd..][..s * hd]) {
                                *d += x;
                            }
                        }
                    });
                out
            };
            (sum_groups(&dk_q), sum_groups(&dv_q))
        };
        Ok((dq, dk, dv, dsinks))
    }
}

impl FusedOp<3> for Attention {
    const NAME: &'static str = "fused-attention";
    const WHAT: &'static str = "attention";

    fn forward(&self, [q, k, v]: [&[f32]; 3], [q_shape, ..]: [&Shape; 3]) -> Forward {
        let out = self.forward_with(q, k, v, self.sinks.as_deref())?;
        Ok((out, q_shape.clone()))
    }

    fn backward(&self, [q, k, v]: [&Tensor; 3], res: &Tensor, grad: &Tensor) -> Grads<3> {
        let tensors = contiguous([q, k, v, res, grad])?;
        let guards = tensors.each_ref().map(Tensor::storage_and_layout);
        let [q_c, k_c, v_c, ..] = &tensors;
        let slices = guard_slices(&guards, "attention")?;
        let (dq, dk, dv, _) = self.backward_with(slices, self.sinks.as_deref())?;
        let dev = Device::Cpu;
        Ok([
            Some(Tensor::from_vec(dq, q_c.shape(), &dev)?),
            Some(Tensor::from_vec(dk, k_c.shape(), &dev)?),
            Some(Tensor::from_vec(dv, v_c.shape(), &dev)?),
        ])
    }
}
