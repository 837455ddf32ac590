//! Gated MLP activation `act(gate) * up` (SwiGLU / GeGLU) in one pass, with its backward.

use candle_core::{bail, Device, Result, Shape, Tensor};
use rayon::prelude::*;

use super::kernels::{self, simd_fn};
use super::{contiguous, fused_applies, guard_slices, Forward};
use crate::custom_op::{Fused, FusedOp, Grads};

/// The activation applied to the gate projection of a gated MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GatedAct {
    /// `x · sigmoid(x)` (Llama, Qwen, Mistral, Phi-3, SmolLM2): candle's `silu`.
    Silu,
    /// GELU with the tanh approximation (Gemma's `gelu_pytorch_tanh`): candle's `gelu`.
    GeluTanh,
    /// Exact GELU, `x · Φ(x)` with the error function: candle's `gelu_erf`.
    GeluErf,
}

/// `act(gate) * up`, elementwise, for `gate` and `up` of the same shape; differentiable w.r.t. both.
///
/// For f32 CPU tensors this is one fused pass (and one backward pass giving both gradients);
/// otherwise it is candle's `silu`/`gelu`/`gelu_erf` followed by a multiplication.
pub fn swiglu(gate: &Tensor, up: &Tensor, act: GatedAct) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        bail!(
            "swiglu: gate {:?} and up {:?} differ in shape",
            gate.dims(),
            up.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if gate.elem_count() > 0 && crate::cuda::applies(&[gate, up]) {
        return crate::cuda::swiglu(gate, up, act);
    }
    if gate.elem_count() == 0 || !fused_applies(&[gate, up]) {
        let a = match act {
            GatedAct::Silu => gate.silu()?,
            GatedAct::GeluTanh => gate.gelu()?,
            GatedAct::GeluErf => gate.gelu_erf()?,
        };
        return a * up;
    }
    gate.contiguous()?
        .apply_op2(&up.contiguous()?, Fused(SwiGlu { act }))
}

/// One LoRA-adapted projection of a gated MLP: the frozen weight `[inter, in]`, `lora_A`
/// `[r, in]`, `lora_B` `[inter, r]` and the scale.
pub struct LoraProjection<'a> {
    pub weight: &'a Tensor,
    pub a: &'a Tensor,
    pub b: &'a Tensor,
    pub scale: f64,
}

/// `act(gate(x)) ⊙ up(x)` for two LoRA-adapted projections without bias — the gated MLP of
/// Llama-style models up to its down projection; `x` is `[..., in]`, the result `[..., inter]`.
///
/// On the GPU (f32/bf16, frozen weights, equal ranks) this is one op: the gate and up results
/// are saved tensors rather than graph nodes, and `x`'s gradient is accumulated by GEMMs into
/// one buffer. Elsewhere it is [`super::lora_linear`] twice and [`swiglu`], with the same values.
pub fn gated_lora(
    x: &Tensor,
    gate: &LoraProjection<'_>,
    up: &LoraProjection<'_>,
    act: GatedAct,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        let all = [x, gate.weight, gate.a, gate.b, up.weight, up.a, up.b];
        let frozen = !gate.weight.track_op() && !up.weight.track_op();
        let shapes_fit = gate.a.dims() == up.a.dims()
            && gate.b.dims() == up.b.dims()
            && gate.weight.dims() == up.weight.dims()
            && gate.weight.rank() == 2
            && gate.a.rank() == 2
            && x.rank() >= 2
            && gate.weight.dim(1)? == x.dim(candle_core::D::Minus1)?
            && gate.a.dim(1)? == gate.weight.dim(1)?
            && gate.b.dims() == [gate.weight.dim(0)?, gate.a.dim(0)?];
        if frozen && shapes_fit && x.elem_count() > 0 && crate::cuda::applies(&all) {
            let a_cat = Tensor::cat(&[gate.a, up.a], 0)?;
            let b_cat = Tensor::cat(&[gate.b, up.b], 0)?;
            return crate::cuda::gated_lora(
                x,
                gate.weight,
                up.weight,
                &a_cat,
                &b_cat,
                (gate.scale, up.scale),
                crate::cuda::act_code(act),
            );
        }
    }
    let g = super::lora_linear(x, gate.weight, None, gate.a, gate.b, gate.scale)?;
    let u = super::lora_linear(x, up.weight, None, up.a, up.b, up.scale)?;
    swiglu(&g, &u, act)
}

struct SwiGlu {
    act: GatedAct,
}

/// Elements per parallel task.
const CHUNK: usize = 1 << 14;

const SQRT_2_OVER_PI: f32 = 0.797_884_6;
const INV_SQRT_2PI: f32 = 0.398_942_3;

/// `tanh` through `exp`, so that it vectorizes; saturates correctly at ±∞.
#[inline(always)]
fn tanh(z: f32) -> f32 {
    1.0 - 2.0 / (kernels::exp(2.0 * z) + 1.0)
}

#[inline(always)]
fn gelu_tanh_inner(g: f32) -> f32 {
    SQRT_2_OVER_PI * g * (1.0 + 0.044_715 * g * g)
}

simd_fn! {
    /// `out = act(gate) * up`.
    fn forward_kernel(act: GatedAct, gate: &[f32], up: &[f32], out: &mut [f32]) {
        let it = out.iter_mut().zip(gate.iter().zip(up));
        match act {
            GatedAct::Silu => {
                for (o, (&g, &u)) in it {
                    *o = g / (1.0 + kernels::exp(-g)) * u;
                }
            }
            GatedAct::GeluTanh => {
                for (o, (&g, &u)) in it {
                    *o = 0.5 * g * (1.0 + tanh(gelu_tanh_inner(g))) * u;
                }
            }
            GatedAct::GeluErf => {
                for (o, (&g, &u)) in it {
                    let e = candle_core::cpu::erf::erf_f32(g * std::f32::consts::FRAC_1_SQRT_2);
                    *o = (e + 1.0) * 0.5 * g * u;
                }
            }
        }
    }
}

simd_fn! {
    /// `d_gate = dy · up · act'(gate)`, `d_up = dy · act(gate)`.
    fn backward_kernel(
        act: GatedAct,
        gate: &[f32],
        up: &[f32],
        dy: &[f32],
        d_gate: &mut [f32],
        d_up: &mut [f32],
    ) {
        let n = gate.len();
        let (up, dy, d_gate, d_up) = (&up[..n], &dy[..n], &mut d_gate[..n], &mut d_up[..n]);
        match act {
            GatedAct::Silu => {
                for i in 0..n {
                    let g = gate[i];
                    let s = 1.0 / (1.0 + kernels::exp(-g));
                    let a = g * s;
                    d_up[i] = dy[i] * a;
                    d_gate[i] = dy[i] * up[i] * (s + a * (1.0 - s));
                }
            }
            GatedAct::GeluTanh => {
                for i in 0..n {
                    let g = gate[i];
                    let th = tanh(gelu_tanh_inner(g));
                    d_up[i] = dy[i] * 0.5 * g * (1.0 + th);
                    // d/dg of the tanh argument is √(2/π)(1 + 3·0.044715 g²).
                    let inner_d = SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044_715 * g * g);
                    let d = 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * inner_d;
                    d_gate[i] = dy[i] * up[i] * d;
                }
            }
            GatedAct::GeluErf => {
                for i in 0..n {
                    let g = gate[i];
                    let e = candle_core::cpu::erf::erf_f32(g * std::f32::consts::FRAC_1_SQRT_2);
                    d_up[i] = dy[i] * (e + 1.0) * 0.5 * g;
                    let d = 0.5 * (1.0 + e) + INV_SQRT_2PI * g * kernels::exp(-0.5 * g * g);
                    d_gate[i] = dy[i] * up[i] * d;
                }
            }
        }
    }
}

impl FusedOp<2> for SwiGlu {
    const NAME: &'static str = "fused-swiglu";
    const WHAT: &'static str = "swiglu";

    fn forward(&self, [gate, up]: [&[f32]; 2], [shape, _]: [&Shape; 2]) -> Forward {
        let mut out = vec![0f32; gate.len()];
        out.par_chunks_mut(CHUNK)
            .zip(gate.par_chunks(CHUNK).zip(up.par_chunks(CHUNK)))
            .for_each(|(o, (g, u))| forward_kernel(self.act, g, u, o));
        Ok((out, shape.clone()))
    }

    fn backward(&self, [gate, up]: [&Tensor; 2], _res: &Tensor, grad: &Tensor) -> Grads<2> {
        let tensors = contiguous([gate, up, grad])?;
        let guards = tensors.each_ref().map(Tensor::storage_and_layout);
        let [g, u, dy] = guard_slices(&guards, "swiglu")?;
        let mut d_gate = vec![0f32; g.len()];
        let mut d_up = vec![0f32; g.len()];
        d_gate
            .par_chunks_mut(CHUNK)
            .zip(d_up.par_chunks_mut(CHUNK))
            .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
            .zip(dy.par_chunks(CHUNK))
            .for_each(|(((dg, du), (g, u)), dy)| backward_kernel(self.act, g, u, dy, dg, du));
        let shape = gate.shape();
        Ok([
            Some(Tensor::from_vec(d_gate, shape, &Device::Cpu)?),
            Some(Tensor::from_vec(d_up, shape, &Device::Cpu)?),
        ])
    }
}
