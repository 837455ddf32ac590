//! The dense feed-forward block: [`Mlp`] (gated or Phi-2's ungated), [`FeedForward`] (an MLP or
//! a mixture of experts) and their forward.

use candle_core::{Result as CResult, Tensor, D};
use ferrotune_core::fused;

use super::{CausalLm, GateUpProjection, GptOssMoe, Linear, Moe};
use crate::config::Activation;

/// The MLP: gated (SwiGLU / GeGLU) or Phi-2's ungated one.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate_up: GateUpProjection,
    pub down_proj: Linear,
}

impl Mlp {
    /// The down projection's module name: `mlp.down_proj` (Phi-2: `mlp.fc2`).
    pub fn down_proj_name(&self) -> &'static str {
        self.gate_up.down_proj_name()
    }

    /// The module names of a dense layer's MLP, in the order of [`mlp_linears`].
    pub(super) fn names(&self) -> Vec<&'static str> {
        let mut out = match self.gate_up {
            GateUpProjection::Separate { .. } => vec!["mlp.gate_proj", "mlp.up_proj"],
            GateUpProjection::Fused { .. } => vec!["mlp.gate_up_proj"],
            GateUpProjection::Ungated { .. } => vec!["mlp.fc1"],
        };
        out.push(self.down_proj_name());
        out
    }
}

/// A gated MLP's linear layers in model order (gate, up, down).
pub(super) fn mlp_linears(mlp: &Mlp) -> Vec<&Linear> {
    let mut out = Vec::with_capacity(3);
    match &mlp.gate_up {
        GateUpProjection::Separate { gate_proj, up_proj } => out.extend([gate_proj, up_proj]),
        GateUpProjection::Fused { gate_up_proj } => out.push(gate_up_proj),
        GateUpProjection::Ungated { fc1 } => out.push(fc1),
    }
    out.push(&mlp.down_proj);
    out
}

/// A gated MLP's linear layers in model order (gate, up, down), mutable.
pub(super) fn mlp_linears_mut(mlp: &mut Mlp) -> Vec<&mut Linear> {
    let Mlp { gate_up, down_proj } = mlp;
    let mut out = Vec::with_capacity(3);
    match gate_up {
        GateUpProjection::Separate { gate_proj, up_proj } => out.extend([gate_proj, up_proj]),
        GateUpProjection::Fused { gate_up_proj } => out.push(gate_up_proj),
        GateUpProjection::Ungated { fc1 } => out.push(fc1),
    }
    out.push(down_proj);
    out
}

/// A decoder layer's feed-forward block: one MLP, or a mixture of experts.
// The dense MLP stays inline: it is every layer of most models, and one enum per layer is small.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum FeedForward {
    Dense(Mlp),
    Sparse(Box<Moe>),
    /// gpt-oss's experts (no linear layers: fused tensors and a bare router).
    GptOss(Box<GptOssMoe>),
}

impl CausalLm {
    /// The MLP's activation function alone (Phi-2's ungated MLP, Gemma 4's per-layer input gate).
    pub(super) fn activation(&self, x: &Tensor) -> CResult<Tensor> {
        match self.config.activation {
            Activation::Silu => x.silu(),
            Activation::GeluTanh => x.gelu(),
            Activation::GeluErf => x.gelu_erf(),
        }
    }

    /// The MLP's gated activation as the fused kernels name it.
    pub(super) fn gated_act(&self) -> fused::GatedAct {
        match self.config.activation {
            Activation::Silu => fused::GatedAct::Silu,
            Activation::GeluTanh => fused::GatedAct::GeluTanh,
            Activation::GeluErf => fused::GatedAct::GeluErf,
        }
    }

    pub(super) fn feed_forward(&self, ffn: &FeedForward, x: &Tensor) -> CResult<Tensor> {
        match ffn {
            FeedForward::Dense(mlp) => self.mlp(mlp, x),
            FeedForward::Sparse(moe) => self.moe(moe, x),
            FeedForward::GptOss(moe) => self.gpt_oss_moe(moe, x),
        }
    }

    pub(super) fn mlp(&self, mlp: &Mlp, x: &Tensor) -> CResult<Tensor> {
        let act = self.gated_act();
        if let GateUpProjection::Separate { gate_proj, up_proj } = &mlp.gate_up {
            // Training LoRA on both projections on a GPU: gate, up and the activation as one op
            // (`fused::gated_lora`), which keeps their results out of the autograd graph.
            if let (Some(ga), Some(ua), Some(gw), Some(uw)) = (
                gate_proj.trained_plain_lora(x),
                up_proj.trained_plain_lora(x),
                gate_proj.weight.as_dense(),
                up_proj.weight.as_dense(),
            ) {
                let biases = [&gate_proj.bias, &up_proj.bias, &ga.bias, &ua.bias];
                if x.device().is_cuda() && biases.iter().all(|b| b.is_none()) {
                    let gate = fused::LoraProjection {
                        weight: gw,
                        a: &ga.a,
                        b: &ga.b,
                        scale: ga.scale,
                    };
                    let up = fused::LoraProjection {
                        weight: uw,
                        a: &ua.a,
                        b: &ua.b,
                        scale: ua.scale,
                    };
                    let h = fused::gated_lora(x, &gate, &up, act)?;
                    return mlp.down_proj.forward(&h);
                }
            }
        }
        let (gate, up) = match &mlp.gate_up {
            GateUpProjection::Separate { gate_proj, up_proj } => {
                (gate_proj.forward(x)?, up_proj.forward(x)?)
            }
            GateUpProjection::Fused { gate_up_proj } => {
                let gu = gate_up_proj.forward(x)?;
                let inter = self.config.intermediate_size;
                (
                    gu.narrow(D::Minus1, 0, inter)?,
                    gu.narrow(D::Minus1, inter, inter)?,
                )
            }
            GateUpProjection::Ungated { fc1 } => {
                return mlp.down_proj.forward(&self.activation(&fc1.forward(x)?)?);
            }
        };
        mlp.down_proj.forward(&fused::swiglu(&gate, &up, act)?)
    }
}
