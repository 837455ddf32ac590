//! Linear layers with what adapts them: [`Linear`] (dense, NF4 or packed GGUF base, a LoRA/DoRA
//! adapter, QAT fake quantization), the attention's [`QkvProjection`] and the MLP's
//! [`GateUpProjection`], and the NF4 quantization of the base ([`CausalLm::quantize_base_nf4`],
//! [`Nf4Summary`]).

use std::sync::Arc;

use candle_core::{DType, Result as CResult, Tensor, D};
use ferrotune_core::nf4::Nf4Matrix;
use ferrotune_core::quant::QuantizedMatrix;
use ferrotune_core::{fused, ops};

use super::delta_net::GatedDeltaNet;
use super::lora::LoraAdapter;
use super::mla::LatentProjection;
use super::{BaseWeight, CausalLm};

/// Inputs with at most this many rows use a layer's packed weight (decode steps, short prompts);
/// longer ones go through the dense f32 GEMM, which is faster once the weight read is amortized.
const PACKED_MAX_ROWS: usize = 32;

/// What [`CausalLm::quantize_base_nf4`] quantized; displays as "N linear layers quantized to NF4
/// (X MB, was Y MB)".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Nf4Summary {
    /// Linear layers now NF4.
    pub layers: usize,
    /// Their weights' bytes before.
    pub dense_bytes: usize,
    /// Their weights' bytes as NF4 blocks.
    pub nf4_bytes: usize,
}

impl std::fmt::Display for Nf4Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} linear layers quantized to NF4 ({:.1} MB, was {:.1} MB)",
            self.layers,
            self.nf4_bytes as f64 / 1e6,
            self.dense_bytes as f64 / 1e6
        )
    }
}

/// A linear layer in PyTorch's layout: `weight` is `[out, in]`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: BaseWeight,
    pub bias: Option<Tensor>,
    /// The same matrix in its GGUF block format (exactly `weight`'s values). Decoding is bound by
    /// reading weights, and 4–8-bit blocks are several times fewer bytes than f32; used only for
    /// f32 inputs outside autograd, so training always sees `weight`.
    pub packed: Option<Arc<QuantizedMatrix>>,
    /// A LoRA/DoRA adapter applied on top of the (frozen) base layer, as PEFT's `lora.Linear`.
    pub adapter: Option<LoraAdapter>,
    /// Quantization-aware training: the base product's input and weight fake-quantized
    /// (`ferrotune_core::qat`), as torchtune's QAT recipes do; an adapter still sees the input
    /// as it is (torchtune's `QATLoRALinear`).
    pub fake_quant: Option<FakeQuant>,
}

/// torchao's `Int8DynActInt4WeightQATQuantizer` on one linear layer: int8 per-token inputs, int4
/// weights in groups of `group_size` inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FakeQuant {
    pub group_size: usize,
    /// Off for torchtune's `fake_quant_after_n_steps` first steps.
    pub enabled: bool,
    /// Whether the weight is fake-quantized too (QAT); off for a quantized checkpoint's layers,
    /// whose weights already hold the int4 values.
    pub quantize_weight: bool,
}

impl Linear {
    /// A dense layer.
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self {
            weight: BaseWeight::Dense(weight),
            bias,
            packed: None,
            adapter: None,
            fake_quant: None,
        }
    }

    /// The adapter when it is a plain LoRA adapter being trained on inputs like `x` (no DoRA, no
    /// active dropout, the input's dtype): the case the fused LoRA ops serve.
    pub(super) fn trained_plain_lora(&self, x: &Tensor) -> Option<&LoraAdapter> {
        if self.fake_quant.is_some_and(|f| f.enabled) {
            return None;
        }
        self.adapter.as_ref().filter(|adapter| {
            adapter.dora_magnitude.is_none()
                && !(adapter.training && adapter.dropout > 0.0)
                && adapter.a.track_op()
                && x.dtype() == adapter.a.dtype()
        })
    }

    /// `x @ weight.T + bias`, plus the adapter's contribution when one is attached.
    pub fn forward(&self, x: &Tensor) -> CResult<Tensor> {
        let bias = self.bias.as_ref();
        if let Some(fq) = self.fake_quant.filter(|f| f.enabled) {
            let weight = self.weight.dense()?;
            let xq = ferrotune_core::qat::fake_quantize_per_token_int8(x)?;
            let wq = if fq.quantize_weight {
                ferrotune_core::qat::fake_quantize_per_group_int4(&weight, fq.group_size)?
            } else {
                weight.into_owned()
            };
            let base = ops::linear(&xq, &wq, bias)?;
            return match &self.adapter {
                Some(adapter) => adapter.forward(x, &base, &self.weight, bias),
                None => Ok(base),
            };
        }
        if let Some(adapter) = self.trained_plain_lora(x) {
            // Training a plain LoRA adapter: base and adapter branch in one fused op.
            let (a, b, scale) = (&adapter.a, &adapter.b, adapter.scale);
            let out = match &self.weight {
                BaseWeight::Nf4(q) => fused::lora_linear(x, q, bias, a, b, scale)?,
                // The op takes `[b, t, in]` as it is: no reshape nodes in the graph.
                BaseWeight::Dense(w) if x.device().is_cuda() => {
                    fused::lora_linear(x, w, bias, a, b, scale)?
                }
                BaseWeight::Dense(w) => ops::linear_with(x, w.dim(0)?, None, |rows| {
                    fused::lora_linear(rows, w, bias, a, b, scale)
                })?,
            };
            return match &adapter.bias {
                // PEFT's `lora_bias`: lora_B's bias, scaled with the product.
                Some(lora_bias) => out.broadcast_add(&(lora_bias * scale)?),
                None => Ok(out),
            };
        }
        let base = match &self.weight {
            BaseWeight::Dense(w) => self.forward_base(x, w)?,
            // QLoRA: the NF4 base through its own op, which keeps only the 4-bit blocks for the
            // backward.
            BaseWeight::Nf4(q) => ops::linear_with(x, q.dims().0, bias, |rows| {
                ferrotune_core::frozen::nf4_matmul(rows, q)
            })?,
        };
        match &self.adapter {
            // PEFT computes the base layer first and adds the adapter on top; the packed copy holds
            // exactly `weight`'s values, so it may serve as that base result.
            Some(adapter) => adapter.forward(x, &base, &self.weight, bias),
            None => Ok(base),
        }
    }

    /// The base layer alone: `x @ weight.T + bias`, `weight` being the dense base weight.
    fn forward_base(&self, x: &Tensor, weight: &Tensor) -> CResult<Tensor> {
        if ferrotune_core::decode::kernels_apply(x)
            && !weight.track_op()
            && self.bias.as_ref().is_none_or(|b| !b.track_op())
        {
            // A few rows on the GPU (decode steps, the output head): one GEMV kernel, which
            // adds the bias itself.
            let projection = ferrotune_core::decode::Projection {
                weight,
                bias: self.bias.as_ref(),
            };
            return ops::linear_with(x, weight.dim(0)?, None, |rows| {
                ferrotune_core::decode::linear_rows(rows, &[projection], None)
            });
        }
        if let Some(packed) = &self.packed {
            let rows = x.elem_count() / x.dim(D::Minus1)?;
            if rows <= PACKED_MAX_ROWS && x.dtype() == DType::F32 && !x.track_op() {
                return self.forward_packed(packed, x);
            }
        }
        ops::linear(x, weight, self.bias.as_ref())
    }

    fn forward_packed(&self, packed: &QuantizedMatrix, x: &Tensor) -> CResult<Tensor> {
        ops::linear_with(x, packed.rows(), self.bias.as_ref(), |rows| {
            packed.matmul(&rows.contiguous()?)
        })
    }
}

/// Query/key/value projections: separate, or Phi-3's fused `qkv_proj`.
#[derive(Debug, Clone)]
// One per decoder layer: boxing the three projections would add an indirection to every
// forward to save memory nobody would notice.
#[allow(clippy::large_enum_variant)]
pub enum QkvProjection {
    Separate {
        q_proj: Linear,
        k_proj: Linear,
        v_proj: Linear,
    },
    Fused {
        qkv_proj: Linear,
    },
    /// Gemma 4's `attention_k_eq_v` layers: the values are the key projection's output.
    KeyIsValue {
        q_proj: Linear,
        k_proj: Linear,
    },
    /// Gemma 4's KV-sharing layers: queries only; keys and values come from an earlier layer
    /// ([`Attention::kv_source`]).
    ///
    /// [`Attention::kv_source`]: super::Attention::kv_source
    QueryOnly {
        q_proj: Linear,
    },
    /// DeepSeek's multi-head latent attention ([`ModelConfig::mla`]).
    ///
    /// [`ModelConfig::mla`]: crate::config::ModelConfig::mla
    Latent(Box<LatentProjection>),
    /// Qwen3.5's and Qwen3-Next's linear attention ([`ModelConfig::delta_net`]); its output
    /// projection is the attention's `o_proj` slot (`linear_attn.out_proj`).
    ///
    /// [`ModelConfig::delta_net`]: crate::config::ModelConfig::delta_net
    DeltaNet(Box<GatedDeltaNet>),
}

/// The MLP's input projections: gate and up separate, Phi-3's fused `gate_up_proj`, or Phi-2's
/// single `fc1` of an ungated MLP (`fc2(act(fc1(x)))`, `fc2` being the down projection).
#[derive(Debug, Clone)]
pub enum GateUpProjection {
    Separate { gate_proj: Linear, up_proj: Linear },
    Fused { gate_up_proj: Linear },
    Ungated { fc1: Linear },
}

impl GateUpProjection {
    /// The module name of the down projection that follows: `mlp.down_proj` (Phi-2's ungated
    /// MLP: `mlp.fc2`).
    pub(super) fn down_proj_name(&self) -> &'static str {
        match self {
            GateUpProjection::Ungated { .. } => "mlp.fc2",
            _ => "mlp.down_proj",
        }
    }
}

/// The projections of a [`QkvProjection`], in `names` order: one body for the shared and the
/// mutable borrow.
macro_rules! qkv_linears {
    ($projection:expr, $linears:ident) => {
        match $projection {
            QkvProjection::Separate {
                q_proj,
                k_proj,
                v_proj,
            } => vec![q_proj, k_proj, v_proj],
            QkvProjection::Fused { qkv_proj } => vec![qkv_proj],
            QkvProjection::KeyIsValue { q_proj, k_proj } => vec![q_proj, k_proj],
            QkvProjection::QueryOnly { q_proj } => vec![q_proj],
            QkvProjection::Latent(latent) => latent.$linears(),
            QkvProjection::DeltaNet(net) => net.$linears(),
        }
    };
}

impl QkvProjection {
    /// The module names, in the order of [`QkvProjection::linears`].
    pub(super) fn names(&self) -> &'static [&'static str] {
        match self {
            QkvProjection::Separate { .. } => {
                &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
            }
            QkvProjection::Fused { .. } => &["self_attn.qkv_proj"],
            QkvProjection::KeyIsValue { .. } => &["self_attn.q_proj", "self_attn.k_proj"],
            QkvProjection::QueryOnly { .. } => &["self_attn.q_proj"],
            QkvProjection::Latent(latent) => latent.names(),
            QkvProjection::DeltaNet(net) => net.names(),
        }
    }

    pub(super) fn linears(&self) -> Vec<&Linear> {
        qkv_linears!(self, linears)
    }

    pub(super) fn linears_mut(&mut self) -> Vec<&mut Linear> {
        qkv_linears!(self, linears_mut)
    }

    /// The norms inside the projections (latent attention's), by parameter name inside the
    /// decoder layer.
    pub(super) fn norms(&self) -> Vec<(&'static str, &Tensor)> {
        match self {
            QkvProjection::Latent(latent) => latent.norms(),
            QkvProjection::DeltaNet(net) => net.norms(),
            _ => Vec::new(),
        }
    }

    /// [`QkvProjection::linears_mut`] and the norms of [`QkvProjection::norms`], borrowed apart.
    pub(super) fn parts_mut(&mut self) -> (Vec<&mut Linear>, Vec<(&'static str, &mut Tensor)>) {
        match self {
            QkvProjection::Latent(latent) => latent.parts_mut(),
            QkvProjection::DeltaNet(net) => net.parts_mut(),
            other => (other.linears_mut(), Vec::new()),
        }
    }
}

impl CausalLm {
    /// QLoRA's frozen base, as torchtune's `qlora_*` builders make it: every linear layer inside
    /// the decoder layers (attention and MLP projections, experts included; a mixture of experts'
    /// router and shared-expert gate stay dense, as they decide the routing) is replaced by its
    /// NF4 quantization (torchao's `to_nf4`, in the weight's dtype; Phi-3's fused `qkv_proj` and
    /// `gate_up_proj` part by part, as torchtune splits them). Embeddings, norms and the
    /// output head are untouched. Returns how many layers were quantized and their bytes before
    /// and after. Attach adapters afterwards: DoRA's magnitude is taken from the
    /// quantized weight, as torchtune's `DoRALinear(quantize_base=True)` does.
    pub fn quantize_base_nf4(&mut self) -> CResult<Nf4Summary> {
        let (mut count, mut before, mut after) = (0, 0, 0);
        let c = &self.config;
        let (q_rows, kv_rows) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        for (name, linear) in self.linears_mut() {
            let router = name.ends_with(".gate") || name.ends_with(".shared_expert_gate");
            if !name.starts_with("model.layers.") || router {
                continue;
            }
            before += linear.weight.size_in_bytes();
            if let BaseWeight::Dense(w) = &linear.weight {
                if w.track_op() {
                    candle_core::bail!("{name}: a trained weight cannot be quantized to NF4");
                }
                // Fused projections are quantized part by part, as torchtune (which splits them
                // on load) quantizes q, k, v and gate, up.
                let rows = w.dim(0)?;
                let split = if name.ends_with(".qkv_proj") {
                    vec![q_rows, kv_rows, kv_rows]
                } else if name.ends_with(".gate_up_proj") {
                    vec![rows / 2, rows / 2]
                } else {
                    vec![rows]
                };
                let q = Nf4Matrix::quantize_rows(w, &split)?;
                linear.weight = BaseWeight::Nf4(Arc::new(q));
                // A GGUF block copy would be a second, different base.
                linear.packed = None;
            }
            count += 1;
            after += linear.weight.size_in_bytes();
        }
        Ok(Nf4Summary {
            layers: count,
            dense_bytes: before,
            nf4_bytes: after,
        })
    }
}
