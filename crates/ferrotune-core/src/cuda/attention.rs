//! Attention on the GPU in chunks of query rows: `S = Q Kᵀ` and `P V` run on cuBLAS (tensor cores)
//! and a kernel forms the softmax, so only one chunk's `[heads, chunk, keys]` scores exist at a
//! time. The forward keeps each row's softmax statistics; the backward recomputes a chunk's
//! probabilities from it (FlashAttention's recurrence, at chunk rather than tile granularity), so
//! memory is O(t · chunk) instead of O(t²). Keys that no query of a chunk can see (the causal
//! future, other documents of a packed row) are left out of that chunk's GEMMs.
//!
//! In bf16 with head dims 64, 96 and 128, flash kernels (kernels.cu) take their place: the
//! forward in one kernel, the backward in two (dK/dV, then dQ), tensor cores for every product and
//! no score matrix in global memory. They keep the same per-row statistics as the chunked form.
//! `FERROTUNE_ATTN=chunked` keeps the chunked form (for measuring one against the other).

use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda::CudaStorage;
use candle_core::{bail, DType, Device, Layout, Result, Tensor, TensorId};

use super::{clone_storage, cuda_device, empty, launch, ptr, stride_grid, suffix, Arg, Forward};
use crate::custom_op::{Cuda, CudaOp, Grads};

/// Scores per chunk (elements of `[b, heads, chunk, s]`) the chunk size aims for.
const CHUNK_SCORES: usize = 1 << 26;
/// Most query rows per chunk: smaller chunks skip more of the causal future.
const MAX_CHUNK_ROWS: usize = 512;
/// Query rows per block of the flash kernel (`FA_BQ` in kernels.cu).
const FLASH_ROWS: usize = 64;
/// Head dims the flash kernel is built for (`EXPORT_FLASH` in kernels.cu).
const FLASH_HEAD_DIMS: [usize; 3] = [64, 96, 128];

/// One chunk: query positions `r0 .. r0 + rows`, keys `ks .. ks + len`.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    r0: usize,
    rows: usize,
    ks: usize,
    len: usize,
}

/// The mask as the kernels read it and the chunks it allows.
struct Plan {
    /// The mask as given, `[mb, 1, t, s]`.
    mask: Option<Tensor>,
    /// The mask in f32, `[mb, t, s]`, as the chunked kernels (and the flash kernels without
    /// [`Self::row_keys`]) read it: made on first use, so a flash pass never makes it.
    mask_f32: OnceLock<Tensor>,
    /// Elements between two batch rows of the mask (0: one mask for the whole batch).
    mask_bstride: usize,
    chunks: Vec<Chunk>,
    /// For each block of [`FLASH_ROWS`] query rows, the keys `[first, last)` any of its rows may
    /// see (u32 pairs on the device): the flash kernel's key loop.
    block_keys: Tensor,
    /// When the mask is 0 on one interval of keys per (batch, query) row and [`Self::masked`]
    /// elsewhere: those intervals, `[mb, t]` u32 pairs on the device, which the flash kernels
    /// take instead of reading the mask for every score.
    row_keys: Option<Tensor>,
    masked: f32,
}

impl Plan {
    /// The f32 mask's device address, or 0 (null) when there is none.
    fn mask_ptr(&self) -> Result<u64> {
        let Some(mask) = &self.mask else {
            return Ok(0);
        };
        if self.mask_f32.get().is_none() {
            let (mb, _, t, s) = mask.dims4()?;
            let f32_mask = mask
                .to_dtype(DType::F32)?
                .contiguous()?
                .reshape((mb, t, s))?;
            // Another thread may have set it first: the same values either way.
            let _ = self.mask_f32.set(f32_mask);
        }
        ptr(self.mask_f32.get().expect("set above"))
    }

    /// The flash kernels' mask arguments (mask, its batch stride, row intervals, masked value):
    /// the intervals where the layout has them, else the f32 mask (null without one).
    fn flash_mask_args(&self) -> Result<[Arg; 4]> {
        let bstride = Arg::I64(self.mask_bstride as i64);
        Ok(match &self.row_keys {
            Some(keys) => [
                Arg::Ptr(0),
                bstride,
                Arg::Ptr(ptr(keys)?),
                Arg::F32(self.masked),
            ],
            None => [
                Arg::Ptr(self.mask_ptr()?),
                bstride,
                Arg::Ptr(0),
                Arg::F32(0.0),
            ],
        })
    }
}

/// The last plan, reused while the same mask tensor (or none) comes back: every layer of a
/// forward pass, and the backward, share one mask.
static PLAN_CACHE: Mutex<Option<CachedPlan>> = Mutex::new(None);

/// A plan with what it was made for: the mask's id (none: no mask), `[b, heads, t, s]` and the
/// device holding its tensors.
type CachedPlan = (Option<TensorId>, [usize; 4], Device, Arc<Plan>);

/// Query rows per chunk; `FERROTUNE_ATTN_CHUNK_ROWS` overrides the choice (for measuring it).
fn chunk_rows(b: usize, nh: usize, t: usize, s: usize) -> usize {
    let rows = crate::switch::ATTN_CHUNK_ROWS
        .count()
        .unwrap_or_else(|| (CHUNK_SCORES / (b * nh * s).max(1)).clamp(16, MAX_CHUNK_ROWS));
    rows.clamp(1, t.max(1))
}

fn plan(
    mask: Option<&Tensor>,
    b: usize,
    nh: usize,
    t: usize,
    s: usize,
    device: &Device,
) -> Result<Arc<Plan>> {
    let id = mask.map(|m| m.id());
    let key = [b, nh, t, s];
    if let Some((i, k, d, p)) = PLAN_CACHE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
    {
        if *i == id && *k == key && d.same_device(device) {
            return Ok(p.clone());
        }
    }
    let (mask_bstride, layout) = match mask {
        None => (0, None),
        Some(mask) => {
            let (mb, _, mt, ms) = mask.dims4()?;
            if mt != t || ms != s {
                bail!("attention: mask {:?} does not fit [{t}, {s}]", mask.dims());
            }
            (
                if mb == 1 { 0 } else { t * s },
                Some(mask_layout(mask, t, s)?),
            )
        }
    };
    let rows_seen = layout
        .as_ref()
        .map_or_else(|| vec![(0, s); t], |l| l.rows.clone());
    let row_keys = match layout.as_ref().and_then(|l| l.intervals.as_ref()) {
        Some(iv) => {
            let flat: Vec<u32> = iv.iter().flat_map(|&(f, l)| [f, l]).collect();
            let n = flat.len();
            Some(Tensor::from_vec(flat, n, device)?)
        }
        None => None,
    };
    // The keys a range of query rows may see: the union of its rows' ranges.
    let union = |r0: usize, rows: usize| {
        let seen = &rows_seen[r0..r0 + rows];
        let ks = seen.iter().map(|r| r.0).min().unwrap_or(0);
        let ke = seen.iter().map(|r| r.1).max().unwrap_or(s);
        if ks < ke && ke <= s {
            (ks, ke)
        } else {
            (0, s)
        }
    };
    let rows = chunk_rows(b, nh, t, s);
    let chunks = (0..t)
        .step_by(rows)
        .map(|r0| {
            let rows = rows.min(t - r0);
            let (ks, ke) = union(r0, rows);
            Chunk {
                r0,
                rows,
                ks,
                len: ke - ks,
            }
        })
        .collect();
    let block_keys: Vec<u32> = (0..t)
        .step_by(FLASH_ROWS)
        .flat_map(|r0| {
            let (ks, ke) = union(r0, FLASH_ROWS.min(t - r0));
            [ks as u32, ke as u32]
        })
        .collect();
    let n = block_keys.len();
    let p = Arc::new(Plan {
        mask: mask.cloned(),
        mask_f32: OnceLock::new(),
        mask_bstride,
        chunks,
        block_keys: Tensor::from_vec(block_keys, n, device)?,
        row_keys,
        masked: layout.map_or(0.0, |l| l.masked),
    });
    *PLAN_CACHE.lock().unwrap_or_else(|e| e.into_inner()) =
        Some((id, key, device.clone(), p.clone()));
    Ok(p)
}

/// The layout of `mask` `[mb, 1, t, s]`: registered by its builder, or else read from its values
/// (one copy to the host per distinct mask).
fn mask_layout(mask: &Tensor, t: usize, s: usize) -> Result<crate::fused::MaskLayout> {
    let mb = mask.dim(0)?;
    if let Some(layout) = crate::fused::registered_mask_layout(mask) {
        let intervals_fit = layout
            .intervals
            .as_ref()
            .is_none_or(|iv| iv.len() == mb * t);
        if layout.rows.len() == t && intervals_fit {
            return Ok(layout.as_ref().clone());
        }
    }
    let host: Vec<f32> = mask.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    Ok(crate::fused::MaskLayout::from_values(&host, t, s))
}

/// [`crate::fused::attention_softcapped`] for CUDA tensors (validated by the caller): `q`
/// `[b, nh, t, hd]`, `k`/`v` `[b, nkv, s, hd]`, additive `mask` `[b or 1, 1, t, s]`, Gemma 2's
/// `softcap` on the scaled scores (0 = none).
pub(crate) fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    softcap: f32,
) -> Result<Tensor> {
    let (b, nh, t, _) = q.dims4()?;
    let (_, _, s, _) = k.dims4()?;
    let plan = plan(mask, b, nh, t, s, q.device())?;
    // The computation takes contiguous copies outside the graph; the graph keeps q, k and v as
    // given (views of the projections for k and v), so no second copy lives until backward.
    let (out, stats) = forward(
        &q.detach().contiguous()?,
        &k.detach().contiguous()?,
        &v.detach().contiguous()?,
        &plan,
        scale as f32,
        softcap,
    )?;
    if !(q.track_op() || k.track_op() || v.track_op()) {
        return Ok(out);
    }
    let op = Attention {
        out: Mutex::new(Some(out)),
        stats,
        plan,
        scale: scale as f32,
        softcap,
    };
    q.apply_op3_arc(k, v, Arc::new(Box::new(Cuda(op))))
}

/// Launches the softmax kernel over one chunk's scores `[b, nkv, rows, len]` (in place).
#[allow(clippy::too_many_arguments)]
fn softmax(
    scores: &Tensor,
    stats: &Tensor,
    plan: &Plan,
    c: &Chunk,
    s: usize,
    scale: f32,
    softcap: f32,
    recompute: bool,
) -> Result<()> {
    let lead = [Arg::Ptr(ptr(scores)?), Arg::Ptr(ptr(stats)?)];
    let tail = [
        Arg::F32(scale),
        Arg::I32(recompute as i32),
        Arg::F32(softcap),
    ];
    launch_chunk_rows("attn_softmax", scores, &lead, plan, c, s, &tail)
}

/// Launches the row-wise chunk kernel `kernel` (`attn_softmax`, `attn_softcap_bwd`; the dtype's
/// suffix added) over `scores` `[b, nkv, rows, len]`, a block of 256 threads per row, with the
/// arguments `lead`, then [`chunk_args`] of chunk `c` out of `s` keys, then `tail`.
fn launch_chunk_rows(
    kernel: &str,
    scores: &Tensor,
    lead: &[Arg],
    plan: &Plan,
    c: &Chunk,
    s: usize,
    tail: &[Arg],
) -> Result<()> {
    let (b, nkv, rows, _) = scores.dims4()?;
    let mut args = lead.to_vec();
    args.extend(chunk_args(scores, plan, c, s)?);
    args.extend_from_slice(tail);
    launch(
        &cuda_device(scores)?,
        &format!("{kernel}_{}", suffix(scores.dtype())?),
        (rows as u32, (b * nkv) as u32),
        256,
        0,
        &args,
    )
}

/// The arguments the row-wise chunk kernels (`attn_softmax`, `attn_softcap_bwd`) share, for
/// `scores` `[b, nkv, rows, len]` of chunk `c` out of `s` keys: the mask, the chunk's shape and
/// place.
fn chunk_args(scores: &Tensor, plan: &Plan, c: &Chunk, s: usize) -> Result<[Arg; 9]> {
    let (_, nkv, rows, len) = scores.dims4()?;
    Ok([
        Arg::Ptr(plan.mask_ptr()?),
        Arg::I32(rows as i32),
        Arg::I32(len as i32),
        Arg::I32(c.rows as i32),
        Arg::I32(c.r0 as i32),
        Arg::I32(c.ks as i32),
        Arg::I32(nkv as i32),
        Arg::I32(s as i32),
        Arg::I64(plan.mask_bstride as i64),
    ])
}

/// Rows `r0 .. r0 + rows` of `x` `[b, nkv, g, t, d]` as `[b, nkv, g · rows, d]` (contiguous).
fn rows_of(x5: &Tensor, c: &Chunk) -> Result<Tensor> {
    let (b, nkv, g, _, d) = x5.dims5()?;
    x5.narrow(3, c.r0, c.rows)?
        .contiguous()?
        .reshape((b, nkv, g * c.rows, d))
}

/// Output `[b, nh, t, hd]` and per-row softmax statistics (max, 1 / Σexp) `[b, nkv, g, t, 2]`
/// (f32).
fn forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    plan: &Plan,
    scale: f32,
    softcap: f32,
) -> Result<(Tensor, Tensor)> {
    if flash_applies(q, k, v)? {
        return flash_forward(q, k, v, plan, scale, softcap);
    }
    let (b, nh, t, hd) = q.dims4()?;
    let (_, nkv, s, _) = k.dims4()?;
    let g = nh / nkv;
    let dev = cuda_device(q)?;
    let q5 = q.reshape((b, nkv, g, t, hd))?;
    let mut outs = Vec::with_capacity(plan.chunks.len());
    let mut stats = Vec::with_capacity(plan.chunks.len());
    for c in &plan.chunks {
        let qc = rows_of(&q5, c)?;
        let kc = k.narrow(2, c.ks, c.len)?.contiguous()?;
        let vc = v.narrow(2, c.ks, c.len)?.contiguous()?;
        let scores = qc.matmul(&kc.t()?)?;
        let st = empty(&dev, DType::F32, (b, nkv, g * c.rows, 2))?;
        softmax(&scores, &st, plan, c, s, scale, softcap, false)?;
        let oc = scores.matmul(&vc)?;
        outs.push(oc.reshape((b, nkv, g, c.rows, hd))?);
        stats.push(st.reshape((b, nkv, g, c.rows, 2))?);
    }
    Ok((cat3(outs)?.reshape((b, nh, t, hd))?, cat3(stats)?))
}

/// Whether the flash kernel takes this forward: bf16, a head dim it is built for, 16-byte aligned
/// rows, tensor cores with bf16 MMA (the PTX targets compute capability 8.0 or later), and not
/// `FERROTUNE_ATTN=chunked`.
fn flash_applies(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<bool> {
    static CHUNKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let chunked = *CHUNKED.get_or_init(|| crate::switch::ATTN.is("chunked"));
    let cap = crate::switch::cuda_cap();
    Ok(!chunked
        && cap >= 80
        && q.dtype() == DType::BF16
        && FLASH_HEAD_DIMS.contains(&q.dim(3)?)
        && [q, k, v].iter().all(|x| ptr(x).is_ok_and(|p| p % 16 == 0)))
}

/// The forward as one kernel (`flash_fwd_bf16_d{hd}`): output `[b, nh, t, hd]` and the
/// statistics `[b, nkv, g, t, 2]` the backward reads, as [`forward`] returns them.
fn flash_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    plan: &Plan,
    scale: f32,
    softcap: f32,
) -> Result<(Tensor, Tensor)> {
    let (b, nh, t, hd) = q.dims4()?;
    let (_, nkv, s, _) = k.dims4()?;
    let dev = cuda_device(q)?;
    let out = empty(&dev, DType::BF16, (b, nh, t, hd))?;
    let stats = empty(&dev, DType::F32, (b, nkv, nh / nkv, t, 2))?;
    let mut args = vec![Arg::Ptr(ptr(q)?), Arg::Ptr(ptr(k)?), Arg::Ptr(ptr(v)?)];
    args.extend(plan.flash_mask_args()?);
    args.extend([
        Arg::Ptr(ptr(&plan.block_keys)?),
        Arg::I32(t as i32),
        Arg::I32(s as i32),
        Arg::I32(nh as i32),
        Arg::I32(nkv as i32),
        Arg::F32(scale),
        Arg::F32(softcap),
        Arg::Ptr(ptr(&out)?),
        Arg::Ptr(ptr(&stats)?),
    ]);
    launch(
        &dev,
        &format!("flash_fwd_bf16_d{hd}"),
        (t.div_ceil(FLASH_ROWS) as u32, (b * nh) as u32),
        128,
        0,
        &args,
    )?;
    Ok((out, stats))
}

/// Chunks joined along the query-position dimension (no copy for a single chunk).
fn cat3(mut parts: Vec<Tensor>) -> Result<Tensor> {
    if parts.len() == 1 {
        return Ok(parts.remove(0));
    }
    Tensor::cat(&parts, 3)
}

/// Adds `src` `[b, nkv, len, hd]` into rows `ks .. ks + len` of the f32 accumulator
/// `[b, nkv, s, hd]`.
fn add_key_rows(acc: &Tensor, src: &Tensor, ks: usize) -> Result<()> {
    let (b, nkv, s, hd) = acc.dims4()?;
    let (_, _, len, _) = src.dims4()?;
    let src = src.contiguous()?;
    let inner = len * hd;
    launch(
        &cuda_device(acc)?,
        &format!("add_rows_{}", suffix(src.dtype())?),
        (stride_grid(b * nkv * inner), 1),
        256,
        0,
        &[
            Arg::Ptr(ptr(acc)?),
            Arg::Ptr(ptr(&src)?),
            Arg::I32((b * nkv) as i32),
            Arg::I64(inner as i64),
            Arg::I64((s * hd) as i64),
            Arg::I64((ks * hd) as i64),
        ],
    )
}

impl Attention {
    /// The backward as two flash kernels: dK and dV added into the zeroed f32 `dk`, `dv`
    /// `[b, nkv, s, hd]`, and dQ returned (`[b, nh, t, hd]`, bf16). `d_rows` = rowsum(dO ⊙ O).
    #[allow(clippy::too_many_arguments)]
    fn flash_backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        dout: &Tensor,
        d_rows: &Tensor,
        dk: &Tensor,
        dv: &Tensor,
    ) -> Result<Tensor> {
        let (b, nh, t, hd) = q.dims4()?;
        let (_, nkv, s, _) = k.dims4()?;
        let dev = cuda_device(q)?;
        let dq = empty(&dev, DType::BF16, (b, nh, t, hd))?;
        let args = |grads: &[&Tensor]| -> Result<Vec<Arg>> {
            let mut a = vec![
                Arg::Ptr(ptr(q)?),
                Arg::Ptr(ptr(k)?),
                Arg::Ptr(ptr(v)?),
                Arg::Ptr(ptr(dout)?),
                Arg::Ptr(ptr(&self.stats)?),
                Arg::Ptr(ptr(d_rows)?),
            ];
            a.extend(self.plan.flash_mask_args()?);
            a.extend([
                Arg::Ptr(ptr(&self.plan.block_keys)?),
                Arg::I32(t as i32),
                Arg::I32(s as i32),
                Arg::I32(nh as i32),
                Arg::I32(nkv as i32),
                Arg::F32(self.scale),
                Arg::F32(self.softcap),
            ]);
            for g in grads {
                a.push(Arg::Ptr(ptr(g)?));
            }
            Ok(a)
        };
        // K, V, Q and dO tiles of 64 rows (row stride hd/2 + 4 words), and per query row three
        // statistics and a key interval.
        let shared = (4 * FLASH_ROWS * (hd / 2 + 4) + 5 * FLASH_ROWS) * 4;
        launch(
            &dev,
            &format!("flash_bwd_dkdv_bf16_d{hd}"),
            (s.div_ceil(FLASH_ROWS) as u32, (b * nh) as u32),
            128,
            shared as u32,
            &args(&[dk, dv])?,
        )?;
        launch(
            &dev,
            &format!("flash_bwd_dq_bf16_d{hd}"),
            (t.div_ceil(FLASH_ROWS) as u32, (b * nh) as u32),
            128,
            0,
            &args(&[&dq])?,
        )?;
        Ok(dq)
    }

    /// `attn_softcap_bwd` over one chunk: raw scores `p` become probabilities and `dp`
    /// (`dO · Vᵀ`) the scores' gradient, both `[b, nkv, rows, len]`, in place.
    fn softcap_backward(
        &self,
        p: &Tensor,
        dp: &Tensor,
        stats: &Tensor,
        d_rows: &Tensor,
        c: &Chunk,
        s: usize,
    ) -> Result<()> {
        let lead = [
            Arg::Ptr(ptr(p)?),
            Arg::Ptr(ptr(dp)?),
            Arg::Ptr(ptr(stats)?),
            Arg::Ptr(ptr(d_rows)?),
        ];
        let tail = [Arg::F32(self.scale), Arg::F32(self.softcap)];
        launch_chunk_rows("attn_softcap_bwd", p, &lead, &self.plan, c, s, &tail)
    }
}

struct Attention {
    /// The output, computed before the op was attached to the graph; handed over by `cuda_fwd`.
    out: Mutex<Option<Tensor>>,
    stats: Tensor,
    plan: Arc<Plan>,
    scale: f32,
    /// Gemma 2's softcap of the scaled scores (0 = none).
    softcap: f32,
}

impl CudaOp<3> for Attention {
    const NAME: &'static str = "cuda-attention";
    const WHAT: &'static str = "attention";

    fn forward(&self, _: [&CudaStorage; 3], _: [&Layout; 3]) -> Forward {
        let out = self.out.lock().unwrap_or_else(|e| e.into_inner()).take();
        let Some(out) = out else {
            bail!("attention: forward ran twice")
        };
        Ok((clone_storage(&out)?, out.shape().clone()))
    }

    fn backward(&self, [q, k, v]: [&Tensor; 3], out: &Tensor, dout: &Tensor) -> Grads<3> {
        let (q, k, v, out) = (
            q.detach().contiguous()?,
            k.detach().contiguous()?,
            v.detach().contiguous()?,
            out.detach(),
        );
        let (b, nh, t, hd) = q.dims4()?;
        let (_, nkv, s, _) = k.dims4()?;
        let g = nh / nkv;
        let dtype = q.dtype();
        let dev = cuda_device(&q)?;
        let dout = dout.detach().to_dtype(dtype)?.contiguous()?;
        // D = rowsum(dO ⊙ O), the softmax backward's per-row term.
        let out = out.contiguous()?;
        let d_rows = empty(&dev, DType::F32, (b, nkv, g, t))?;
        launch(
            &dev,
            &format!("row_dot_{}", suffix(dtype)?),
            ((b * nh * t).div_ceil(8) as u32, 1),
            256,
            0,
            &[
                Arg::Ptr(ptr(&dout)?),
                Arg::Ptr(ptr(&out)?),
                Arg::Ptr(ptr(&d_rows)?),
                Arg::I64((b * nh * t) as i64),
                Arg::I32(hd as i32),
            ],
        )?;
        let dk = Tensor::zeros((b, nkv, s, hd), DType::F32, q.device())?;
        let dv = Tensor::zeros((b, nkv, s, hd), DType::F32, q.device())?;
        if flash_applies(&q, &k, &v)? && ptr(&dout)? % 16 == 0 {
            let dq = self.flash_backward(&q, &k, &v, &dout, &d_rows, &dk, &dv)?;
            return Ok([
                Some(dq),
                Some(dk.to_dtype(dtype)?),
                Some(dv.to_dtype(dtype)?),
            ]);
        }
        let q5 = q.reshape((b, nkv, g, t, hd))?;
        let do5 = dout.reshape((b, nkv, g, t, hd))?;
        let mut dqs = Vec::with_capacity(self.plan.chunks.len());
        for c in &self.plan.chunks {
            let qc = rows_of(&q5, c)?;
            let doc = rows_of(&do5, c)?;
            let kc = k.narrow(2, c.ks, c.len)?.contiguous()?;
            let vc = v.narrow(2, c.ks, c.len)?.contiguous()?;
            let stats = self.stats.narrow(3, c.r0, c.rows)?.contiguous()?.reshape((
                b,
                nkv,
                g * c.rows,
                2,
            ))?;
            let dc = d_rows
                .narrow(3, c.r0, c.rows)?
                .contiguous()?
                .reshape((b, nkv, g * c.rows))?;
            let p = qc.matmul(&kc.t()?)?;
            let ds = if self.softcap > 0.0 {
                // The softcap's derivative needs the raw scores, which the probabilities would
                // overwrite: one kernel turns (scores, dP) into (P, dS) in place.
                let ds = doc.matmul(&vc.t()?)?;
                self.softcap_backward(&p, &ds, &stats, &dc, c, s)?;
                add_key_rows(&dv, &p.t()?.matmul(&doc)?, c.ks)?;
                ds
            } else {
                softmax(&p, &stats, &self.plan, c, s, self.scale, 0.0, true)?;
                add_key_rows(&dv, &p.t()?.matmul(&doc)?, c.ks)?;
                let ds = doc.matmul(&vc.t()?)?;
                let n = b * nkv * g * c.rows * c.len;
                launch(
                    &dev,
                    &format!("attn_dsoftmax_{}", suffix(dtype)?),
                    (stride_grid(n), 1),
                    256,
                    0,
                    &[
                        Arg::Ptr(ptr(&p)?),
                        Arg::Ptr(ptr(&ds)?),
                        Arg::Ptr(ptr(&dc)?),
                        Arg::I64(n as i64),
                        Arg::I32(c.len as i32),
                        Arg::F32(self.scale),
                    ],
                )?;
                ds
            };
            dqs.push(ds.matmul(&kc)?.reshape((b, nkv, g, c.rows, hd))?);
            add_key_rows(&dk, &ds.t()?.matmul(&qc)?, c.ks)?;
        }
        let dq = cat3(dqs)?.reshape((b, nh, t, hd))?;
        Ok([
            Some(dq),
            Some(dk.to_dtype(dtype)?),
            Some(dv.to_dtype(dtype)?),
        ])
    }
}
