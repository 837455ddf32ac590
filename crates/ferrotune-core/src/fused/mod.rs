//! Fused CPU training kernels with hand-written backward passes.
//!
//! Composed candle ops (see [`crate::ops`]) run every small elementwise step as its own pass over
//! memory, mostly on one thread, and their autograd adds several more passes per step; attention
//! and the loss also keep large intermediates (`[b, h, t, s]` probabilities, `[n, vocab]` softmax)
//! alive until `backward`. Each function here is one candle custom op instead: one multi-threaded
//! pass forward, one backward, and only small per-row statistics kept in between.
//!
//! The fused path is taken for f32 tensors on the CPU. Any other dtype or device goes through the
//! composite implementation, so bf16 and CUDA keep working with the same numerics as before. The
//! fused kernels follow the same arithmetic as the composites (statistics and softmax in f32); they
//! agree with them to float rounding, not bit for bit (sums are accumulated in a different order and
//! `exp` is a vectorized polynomial accurate to a couple of ulps).
//!
//! The backward passes are computed directly, not as candle graphs: gradients of gradients are not
//! available through these ops.

mod attention;
mod attention_sinks;
mod clamped_glu;
mod cross_entropy;
mod delta_rule;
mod fake_quant;
pub(crate) mod kernels;
mod linear;
mod linear_ce;
mod lora;
mod rms_norm;
mod rope;
mod soft_cross_entropy;
mod swiglu;

pub use attention::{
    attention, attention_softcapped, register_mask_layout, registered_mask_layout, MaskLayout,
};
pub use attention_sinks::attention_with_sinks;
pub use clamped_glu::clamped_swiglu_interleaved;
pub use cross_entropy::cross_entropy_sum;
pub use delta_rule::{
    delta_rule_applies, gated_delta_rule, set_delta_rule_enabled, CHUNK as DELTA_RULE_CHUNK,
};
pub use fake_quant::{fake_quantize_rows, FakeQuantKind};
pub use linear::trainable_linear;
pub use linear_ce::{chunked_head_applies, linear_cross_entropy_sum};
pub use lora::lora_linear;
pub use rms_norm::rms_norm;
pub use rope::rope;
pub use soft_cross_entropy::{soft_cross_entropy_applies, soft_cross_entropy_sum};
pub use swiglu::{gated_lora, swiglu, GatedAct, LoraProjection};

use candle_core::{bail, DType, Device, Result, Storage, Tensor};

/// Whether every tensor is f32 on the CPU, i.e. whether the fused kernels apply.
pub(crate) fn fused_applies(tensors: &[&Tensor]) -> bool {
    tensors
        .iter()
        .all(|t| t.dtype() == DType::F32 && matches!(t.device(), Device::Cpu))
}

/// What a [`FusedOp`](crate::custom_op::FusedOp)'s forward returns: the output's data and shape.
type Forward = crate::custom_op::Forward<Vec<f32>>;

/// The f32 data of a contiguous CPU tensor, from the (locked storage, layout) pair that
/// `Tensor::storage_and_layout` returns.
fn guard_slice<'a, G: std::ops::Deref<Target = Storage>>(
    guard: &'a (G, &candle_core::Layout),
    what: &str,
) -> Result<&'a [f32]> {
    let Storage::Cpu(cpu) = &*guard.0 else {
        bail!("fused {what}: expected a CPU tensor")
    };
    slice_of(cpu, guard.1, what)
}

/// `tensors` made contiguous (a cheap clone of those that already are), to lock for
/// [`guard_slices`].
fn contiguous<const N: usize>(tensors: [&Tensor; N]) -> Result<[Tensor; N]> {
    let mut out = Vec::with_capacity(N);
    for t in tensors {
        out.push(t.contiguous()?);
    }
    Ok(out.try_into().expect("one tensor per input"))
}

/// [`guard_slice`] of each (locked storage, layout) pair in `guards`.
fn guard_slices<'a, G: std::ops::Deref<Target = Storage>, const N: usize>(
    guards: &'a [(G, &candle_core::Layout); N],
    what: &str,
) -> Result<[&'a [f32]; N]> {
    let mut out: [&[f32]; N] = [&[]; N];
    for (slice, guard) in out.iter_mut().zip(guards) {
        *slice = guard_slice(guard, what)?;
    }
    Ok(out)
}

/// The contiguous f32 slice behind a CPU storage and its layout (as custom ops receive them).
pub(crate) fn slice_of<'a>(
    storage: &'a candle_core::CpuStorage,
    layout: &candle_core::Layout,
    what: &str,
) -> Result<&'a [f32]> {
    let data = storage.as_slice::<f32>()?;
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("fused {what}: input is not contiguous")
    };
    Ok(&data[start..end])
}

/// Number of rows each parallel task handles so that a task covers about `target` elements.
fn rows_per_task(row_len: usize, target: usize) -> usize {
    (target / row_len.max(1)).max(1)
}
