//! Attention with a learned sink logit per head (gpt-oss): the fused attention kernel of
//! `attention.rs` with the sink joining every row's softmax denominator, and the composite candle
//! formula for other dtypes and devices.

use candle_core::{bail, DType, Device, Result, Shape, Tensor, D};

use super::attention::{check_shapes, Attention};
use super::{contiguous, fused_applies, guard_slices, Forward};
use crate::custom_op::{Fused, FusedOp, Grads};

/// `softmax([q kᵀ · scale + mask, sink]) v` per head, the sink's column dropped after the
/// softmax: each head's learned `sinks[h]` joins every row's denominator and takes no value (as
/// transformers' `GptOssAttention`). Shapes as [`attention`](super::attention) (`q`
/// `[b, nh, t, hd]`, `k`/`v` `[b, nkv, s, hd]`, additive `mask` `[b or 1, 1, t, s]`), `sinks`
/// `[nh]`; differentiable w.r.t. `q`, `k`, `v` and `sinks`. The softmax runs in f32.
///
/// For f32 CPU tensors this is the fused attention kernel: it keeps only each row's maximum and
/// denominator (the sink included in both) instead of the `[b, nh, t, s]` probabilities, skips
/// the keys a block of query rows cannot see (a sliding window's), and recomputes the
/// probabilities in the backward; the sink's gradient is `−Σ_rows p_sink · rowsum(dO ⊙ O)` over
/// the rows of its head. Sinks that take no gradient (LoRA, inference) are constants of the op;
/// trained ones are its third input, beside `q` and the keys and values as one tensor. A row
/// whose keys are all masked gives zeros (its weight is all on the sink), as with the composite.
/// Other dtypes and devices use the composite candle formula, which holds the probabilities.
pub fn attention_with_sinks(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    sinks: &Tensor,
) -> Result<Tensor> {
    let dims = check_shapes("attention with sinks", q, k, v, mask)?;
    if sinks.dims() != [dims.nh] {
        bail!(
            "attention with sinks: sinks {:?} do not fit {} query heads",
            sinks.dims(),
            dims.nh
        );
    }
    let empty = q.elem_count() == 0 || k.elem_count() == 0;
    if empty
        || !fused_applies(&[q, k, v, sinks])
        || mask.is_some_and(|m| !matches!(m.device(), Device::Cpu))
    {
        return composite(q, k, v, mask, scale, sinks);
    }
    let kernel = Attention::new(dims, mask, scale, None)?;
    if !sinks.track_op() {
        // Frozen sinks (LoRA, inference): an op over `(q, k, v)` with the sinks as constants.
        let op = kernel.with_sinks(sinks.flatten_all()?.to_vec1()?);
        return q
            .contiguous()?
            .apply_op3(&k.contiguous()?, &v.contiguous()?, Fused(op));
    }
    let op = SinkAttention(kernel);
    // candle's custom ops take at most three inputs: keys and values travel as one tensor
    // `[2b, nkv, s, hd]` (keys first), a copy of the smaller operands under grouped-query heads.
    let kv = Tensor::cat(&[k, v], 0)?;
    q.contiguous()?
        .apply_op3(&kv, &sinks.contiguous()?, Fused(op))
}

/// The composite formula from candle ops (each with its backward, so the sinks train); it holds
/// the `[b, nh, t, s]` probabilities, as transformers' eager attention does.
fn composite(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    scale: f64,
    sinks: &Tensor,
) -> Result<Tensor> {
    let (b, nh, t, hd) = q.dims4()?;
    let (_, nkv, s, _) = k.dims4()?;
    let groups = nh / nkv;
    // Query heads sharing a key/value head are stacked along the rows (head h = kv · groups + g):
    // one matmul per key/value head.
    let q = q.contiguous()?.reshape((b, nkv, groups * t, hd))?;
    // The softmax in f32 whatever the compute dtype, as the fused attention's; a sink's gradient
    // (the sum over every row of its head) then adds up in f32 too.
    let scores = (q.matmul(&k.contiguous()?.t()?)? * scale)?.to_dtype(DType::F32)?;
    let scores = match mask {
        Some(m) => scores
            .reshape((b, nkv, groups, t, s))?
            .broadcast_add(&m.to_dtype(DType::F32)?.unsqueeze(1)?)?
            .reshape((b, nkv, groups * t, s))?,
        None => scores,
    };
    let sink = sinks
        .to_dtype(DType::F32)?
        .reshape((1, nkv, groups, 1, 1))?
        .broadcast_as((b, nkv, groups, t, 1))?
        .reshape((b, nkv, groups * t, 1))?;
    let probs = crate::ops::softmax_last_dim(&Tensor::cat(&[&scores, &sink], D::Minus1)?)?;
    probs
        .narrow(D::Minus1, 0, s)?
        .to_dtype(v.dtype())?
        .matmul(&v.contiguous()?)?
        .reshape((b, nh, t, hd))
}

/// The fused attention kernel over `(q, [k; v], sinks)`.
struct SinkAttention(Attention);

impl FusedOp<3> for SinkAttention {
    const NAME: &'static str = "fused-attention-sinks";
    const WHAT: &'static str = "attention with sinks";

    fn forward(&self, [q, kv, sinks]: [&[f32]; 3], [q_shape, ..]: [&Shape; 3]) -> Forward {
        let (k, v) = kv.split_at(kv.len() / 2);
        Ok((self.0.forward_with(q, k, v, Some(sinks))?, q_shape.clone()))
    }

    fn backward(&self, [q, kv, sinks]: [&Tensor; 3], res: &Tensor, grad: &Tensor) -> Grads<3> {
        let tensors = contiguous([q, kv, sinks, res, grad])?;
        let guards = tensors.each_ref().map(Tensor::storage_and_layout);
        let [q_c, kv_c, sinks_c, ..] = &tensors;
        let [q, kv, sinks, o, d_o] = guard_slices(&guards, Self::WHAT)?;
        let (k, v) = kv.split_at(kv.len() / 2);
        let (dq, mut dkv, dv, dsinks) = self.0.backward_with([q, k, v, o, d_o], Some(sinks))?;
        dkv.extend_from_slice(&dv);
        let Some(dsinks) = dsinks else {
            bail!("attention with sinks: the kernel gave no sink gradient")
        };
        let dev = Device::Cpu;
        Ok([
            Some(Tensor::from_vec(dq, q_c.shape(), &dev)?),
            Some(Tensor::from_vec(dkv, kv_c.shape(), &dev)?),
            Some(Tensor::from_vec(dsinks, sinks_c.shape(), &dev)?),
        ])
    }
}
