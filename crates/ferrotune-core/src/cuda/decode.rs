//! Launchers of the decode-step kernels (`dec_*` in kernels.cu) behind [`crate::decode`]. The
//! callers there have checked shapes, dtypes and devices; these take contiguous inputs (copying
//! any that are not) and return fresh outputs, except the KV cache, written in place.

use candle_core::{Result, Tensor};

use super::{act_code, cuda_device, empty, launch_dependent, ptr, resident_blocks, suffix, Arg};
use crate::decode::{Heads, Projection, QkNorm};
use crate::fused::GatedAct;

/// Warps (output rows) per block of the GEMV kernels.
const GEMV_WARPS: usize = 8;
/// Threads per block of the attention kernel (at least an eighth of the head dimension).
const ATTENTION_THREADS: usize = 256;
/// Keys per block of the split attention (`dec_attention_part`), used from caches of
/// [`SPLIT_FROM_CAPACITY`] positions on: one block per (head, row) would leave most of the GPU
/// idle while it reads a long cache.
const SPLIT_KEYS: usize = 256;
/// The smallest cache capacity attended in splits. The choice depends on the capacity, fixed
/// while the cache fills, so a recorded CUDA graph keeps its kernels until the cache grows.
const SPLIT_FROM_CAPACITY: usize = 1024;

fn ptr_or_null(t: Option<&Tensor>) -> Result<u64> {
    t.map(ptr).transpose().map(|p| p.unwrap_or(0))
}

/// [`crate::decode::linear_rows`]: one `dec_gemv_{dtype}_{rows}` launch for up to three stacked
/// projections.
pub(crate) fn gemv(
    x: &Tensor,
    projections: &[Projection],
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let dev = cuda_device(x)?;
    let dtype = x.dtype();
    let (rows, width) = x.dims2()?;
    let x = x.contiguous()?;
    // Keep contiguous copies alive until the launch is queued (the stream orders the frees).
    let mut weights = Vec::with_capacity(3);
    let mut biases = Vec::with_capacity(3);
    for p in projections {
        weights.push(p.weight.contiguous()?);
        biases.push(p.bias.map(Tensor::contiguous).transpose()?);
    }
    let residual = residual.map(Tensor::contiguous).transpose()?;
    let total: usize = weights.iter().map(|w| w.dim(0)).sum::<Result<usize>>()?;
    let out = empty(&dev, dtype, (rows, total))?;
    let mut args = vec![Arg::Ptr(ptr(&x)?), Arg::I32(width as i32)];
    for (w, b) in weights.iter().zip(&biases) {
        args.push(Arg::Ptr(ptr(w)?));
        args.push(Arg::Ptr(ptr_or_null(b.as_ref())?));
        args.push(Arg::I32(w.dim(0)? as i32));
    }
    // Unused matrix slots: no rows.
    for _ in weights.len()..3 {
        args.extend([Arg::Ptr(0), Arg::Ptr(0), Arg::I32(0)]);
    }
    args.push(Arg::Ptr(ptr_or_null(residual.as_ref())?));
    args.push(Arg::Ptr(ptr(&out)?));
    launch_dependent(
        &dev,
        &format!("dec_gemv_{}_{rows}", suffix(dtype)?),
        (total.div_ceil(GEMV_WARPS) as u32, 1, 1),
        (GEMV_WARPS * 32) as u32,
        0,
        &args,
    )?;
    Ok(out)
}

/// [`crate::decode::gated_rows`]: one `dec_gated_gemv_{dtype}_{rows}` launch.
pub(crate) fn gated_gemv(
    x: &Tensor,
    gate: Projection,
    up: Projection,
    act: GatedAct,
) -> Result<Tensor> {
    let dev = cuda_device(x)?;
    let dtype = x.dtype();
    let (rows, width) = x.dims2()?;
    let n = gate.weight.dim(0)?;
    let x = x.contiguous()?;
    let (gate_w, up_w) = (gate.weight.contiguous()?, up.weight.contiguous()?);
    let gate_b = gate.bias.map(Tensor::contiguous).transpose()?;
    let up_b = up.bias.map(Tensor::contiguous).transpose()?;
    let out = empty(&dev, dtype, (rows, n))?;
    launch_dependent(
        &dev,
        &format!("dec_gated_gemv_{}_{rows}", suffix(dtype)?),
        (n.div_ceil(GEMV_WARPS) as u32, 1, 1),
        (GEMV_WARPS * 32) as u32,
        0,
        &[
            Arg::Ptr(ptr(&x)?),
            Arg::I32(width as i32),
            Arg::Ptr(ptr(&gate_w)?),
            Arg::Ptr(ptr_or_null(gate_b.as_ref())?),
            Arg::Ptr(ptr(&up_w)?),
            Arg::Ptr(ptr_or_null(up_b.as_ref())?),
            Arg::I32(n as i32),
            Arg::Ptr(ptr(&out)?),
            Arg::I32(act_code(act)),
        ],
    )?;
    Ok(out)
}

/// [`crate::decode::rope_into_cache`]: one `dec_qkv_rope` launch, one block per (head, row);
/// `counters` (`[slot, len]`, u32), when given, overrides `pos` on the device.
#[allow(clippy::too_many_arguments)]
pub(crate) fn qkv_rope(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    norm: Option<QkNorm>,
    heads: Heads,
    k_cache: &Tensor,
    v_cache: &Tensor,
    pos: usize,
    counters: Option<&Tensor>,
) -> Result<Tensor> {
    let dev = cuda_device(qkv)?;
    let dtype = qkv.dtype();
    let rows = qkv.dim(0)?;
    let rot = cos.dim(1)?;
    let cap = k_cache.dim(2)?;
    let Heads { query, kv, dim } = heads;
    let (qkv, cos, sin) = (qkv.contiguous()?, cos.contiguous()?, sin.contiguous()?);
    let (qn, kn) = match norm {
        Some(n) => (Some(n.q.contiguous()?), Some(n.k.contiguous()?)),
        None => (None, None),
    };
    let (eps, offset_one) = norm.map_or((0.0, false), |n| (n.eps as f32, n.offset_one));
    let q = empty(&dev, dtype, (rows, query, dim))?;
    launch_dependent(
        &dev,
        &format!("dec_qkv_rope_{}", suffix(dtype)?),
        ((query + 2 * kv) as u32, rows as u32, 1),
        dim.div_ceil(32) as u32 * 32,
        (dim * 4) as u32,
        &[
            Arg::Ptr(ptr(&qkv)?),
            Arg::Ptr(ptr(&cos)?),
            Arg::Ptr(ptr(&sin)?),
            Arg::Ptr(ptr_or_null(qn.as_ref())?),
            Arg::Ptr(ptr_or_null(kn.as_ref())?),
            Arg::F32(eps),
            Arg::I32(offset_one as i32),
            Arg::Ptr(ptr(&q)?),
            Arg::Ptr(ptr(k_cache)?),
            Arg::Ptr(ptr(v_cache)?),
            Arg::I32(query as i32),
            Arg::I32(kv as i32),
            Arg::I32(dim as i32),
            Arg::I32(rot as i32),
            Arg::I32(cap as i32),
            Arg::I32(pos as i32),
            Arg::Ptr(ptr_or_null(counters)?),
        ],
    )?;
    Ok(q)
}

/// [`crate::decode::cached_attention`]: one `dec_attention` launch, one block per (query head,
/// row), with an f32 scratch row of scores per block. `window` 0 means none; `softcap` 0 too;
/// `counters` (`[slot, len]`, u32), when given, overrides `len` on the device.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    len: usize,
    first: &Tensor,
    window: usize,
    scale: f32,
    softcap: f32,
    counters: Option<&Tensor>,
) -> Result<Tensor> {
    let dev = cuda_device(q)?;
    let dtype = q.dtype();
    let (rows, query, dim) = q.dims3()?;
    let (_, kv, cap, _) = k_cache.dims4()?;
    let q = q.contiguous()?;
    let scores = empty(&dev, candle_core::DType::F32, (rows, query, cap))?;
    let out = empty(&dev, dtype, (rows, query * dim))?;
    let split = cap >= SPLIT_FROM_CAPACITY;
    let splits = cap.div_ceil(SPLIT_KEYS);
    // The split kernel leaves per-split partial sums for the combine; the other writes `out`.
    let part = if split {
        Some(empty(
            &dev,
            candle_core::DType::F32,
            (rows, query, splits, dim + 2),
        )?)
    } else {
        None
    };
    // Both kernels take the same arguments, the split one with its key count after `cap`.
    let mut args = vec![
        Arg::Ptr(ptr(&q)?),
        Arg::Ptr(ptr(k_cache)?),
        Arg::Ptr(ptr(v_cache)?),
        Arg::Ptr(ptr(part.as_ref().unwrap_or(&out))?),
        Arg::Ptr(ptr(&scores)?),
        Arg::Ptr(ptr(first)?),
        Arg::I32(len as i32),
        Arg::I32(window as i32),
        Arg::I32(query as i32),
        Arg::I32(kv as i32),
        Arg::I32(dim as i32),
        Arg::I32(cap as i32),
    ];
    if split {
        args.push(Arg::I32(SPLIT_KEYS as i32));
    }
    args.extend([
        Arg::F32(scale),
        Arg::F32(softcap),
        Arg::Ptr(ptr_or_null(counters)?),
    ]);
    let (name, z) = if split {
        ("dec_attention_part", splits)
    } else {
        ("dec_attention", 1)
    };
    let grid = (query as u32, rows as u32, z as u32);
    let shared_bytes = ((dim + 8 * ATTENTION_THREADS) * 4) as u32;
    // The score pass (kernels.cu, dec_scores): one key per thread where the whole grid runs at
    // once (fewest round trips in a row), else lanes sharing a key (half the registers, twice
    // the blocks an SM), as the per-thread form would leave blocks waiting for a second wave.
    let per_thread = format!("{name}_{}", suffix(dtype)?);
    let blocks = query * rows * z;
    let kernel =
        if blocks <= resident_blocks(&dev, &per_thread, ATTENTION_THREADS as u32, shared_bytes)? {
            per_thread
        } else {
            format!("{name}_lanes_{}", suffix(dtype)?)
        };
    launch_dependent(
        &dev,
        &kernel,
        grid,
        ATTENTION_THREADS as u32,
        shared_bytes,
        &args,
    )?;
    if let Some(part) = &part {
        launch_dependent(
            &dev,
            &format!("dec_attention_combine_{}", suffix(dtype)?),
            (query as u32, rows as u32, 1),
            dim.next_multiple_of(32).min(256) as u32,
            (splits * 4) as u32,
            &[
                Arg::Ptr(ptr(part)?),
                Arg::Ptr(ptr(&out)?),
                Arg::I32(query as i32),
                Arg::I32(dim as i32),
                Arg::I32(splits as i32),
            ],
        )?;
    }
    Ok(out)
}
