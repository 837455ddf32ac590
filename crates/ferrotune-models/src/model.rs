//! The decoder: one implementation for Llama 2/3, Mistral, Qwen2/2.5/3, Gemma, Phi-3 and SmolLM2,
//! switched by [`ModelConfig`]. Every op on the path has a backward (see `ferrotune_core::ops`), so
//! the same code serves generation and training.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, DeviceLocation, Result as CResult, Tensor, Var, D};
use ferrotune_core::nf4::Nf4Matrix;
use ferrotune_core::quant::QuantizedMatrix;
pub use ferrotune_core::weight::BaseWeight;
use ferrotune_core::{fused, ops};

use crate::config::{Activation, ModelConfig, SparseMixer};
use crate::device_map::Placement;
use crate::error::ModelError;
use crate::lora::LoraAdapter;
use crate::rope::RotaryEmbedding;

mod decode_step;

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
    fn trained_plain_lora(&self, x: &Tensor) -> Option<&LoraAdapter> {
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
                BaseWeight::Nf4(q) => fused::lora_linear_nf4(x, q, bias, a, b, scale)?,
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
    QueryOnly {
        q_proj: Linear,
    },
}

/// The MLP's input projections: gate and up separate, Phi-3's fused `gate_up_proj`, or Phi-2's
/// single `fc1` of an ungated MLP (`fc2(act(fc1(x)))`, `fc2` being the down projection).
#[derive(Debug, Clone)]
pub enum GateUpProjection {
    Separate { gate_proj: Linear, up_proj: Linear },
    Fused { gate_up_proj: Linear },
    Ungated { fc1: Linear },
}

/// Self-attention of one layer.
#[derive(Debug, Clone)]
pub struct Attention {
    pub qkv: QkvProjection,
    pub o_proj: Linear,
    /// The output projection's module name: `self_attn.o_proj` (Phi-2: `self_attn.dense`).
    pub o_proj_name: &'static str,
    /// Qwen3's per-head RMSNorm weights (`[head_dim]`).
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    /// `(heads, kv_heads, head_dim)` of this layer (Gemma 4's full-attention layers have their
    /// own head size and key/value heads).
    pub dims: (usize, usize, usize),
    /// Gemma 4: the values pass a weightless RMSNorm of each head.
    pub v_norm: bool,
    /// Gemma 4: the earlier layer whose keys and values this one attends with.
    pub kv_source: Option<usize>,
}

/// Gemma 4's per-layer input block, after the MLP's residual add: `x + norm(projection(act(gate(x))
/// · per_layer_input))`, the per-layer input being this layer's slice of
/// [`PerLayerEmbedding`]'s output.
#[derive(Debug, Clone)]
pub struct PerLayerInputBlock {
    /// `per_layer_input_gate` (`[per_layer_dim, hidden]`).
    pub gate: Linear,
    /// `per_layer_projection` (`[hidden, per_layer_dim]`).
    pub projection: Linear,
    /// `post_per_layer_input_norm` (`[hidden]`).
    pub norm: Tensor,
}

/// Gemma 4's mixture of experts beside the dense MLP (`enable_moe_block`, the 26B-A4B model):
/// on the MLP's residual input `x` the router scores `proj(rms(x) · scale / √hidden)` (a
/// weightless RMSNorm), softmax in f32, top-k renormalized and multiplied by the chosen experts'
/// `per_expert_scale`; the experts run on `pre_feedforward_layernorm_2(x)`. The layer's
/// feed-forward output is `post_feedforward_layernorm_1(mlp) + post_feedforward_layernorm_2(experts)`,
/// then `post_feedforward_layernorm` as in a dense layer.
///
/// The checkpoint holds the experts fused (`experts.gate_up_proj` `[experts, 2 · inter, hidden]`,
/// gate rows first, `experts.down_proj` `[experts, hidden, inter]`); the decoder keeps each as its
/// own gated MLP (named `experts.N.gate_proj`, ...) so that it trains, quantizes and merges as
/// any linear layer, and [`crate::checkpoint::to_saved_layout`] fuses them again.
#[derive(Debug, Clone)]
pub struct ParallelMoe {
    /// `router.proj` (`[experts, hidden]`) and the experts; `top_k` and f32 routing weights.
    pub moe: Moe,
    /// `router.scale` (`[hidden]`).
    pub router_scale: Tensor,
    /// `router.per_expert_scale` (`[experts]`).
    pub per_expert_scale: Tensor,
    /// `pre_feedforward_layernorm_2` (`[hidden]`): the experts' input norm.
    pub pre_norm: Tensor,
    /// `post_feedforward_layernorm_1` (`[hidden]`): the dense MLP's output norm.
    pub post_norm_mlp: Tensor,
    /// `post_feedforward_layernorm_2` (`[hidden]`): the experts' output norm.
    pub post_norm_experts: Tensor,
}

/// The parameter names, inside the decoder layer, of [`ParallelMoe`]'s tensors other than linear
/// layers, in the order [`ParallelMoe::parts_mut`] and [`ParallelMoe::small_tensors`] list them.
const PARALLEL_MOE_TENSORS: [&str; 5] = [
    "router.scale",
    "router.per_expert_scale",
    "pre_feedforward_layernorm_2.weight",
    "post_feedforward_layernorm_1.weight",
    "post_feedforward_layernorm_2.weight",
];

impl ParallelMoe {
    /// The router and experts, and the block's tensors other than linear layers with their
    /// parameter names inside the decoder layer, borrowed apart.
    fn parts_mut(&mut self) -> (&mut Moe, Vec<(&'static str, &mut Tensor)>) {
        let ParallelMoe {
            moe,
            router_scale,
            per_expert_scale,
            pre_norm,
            post_norm_mlp,
            post_norm_experts,
        } = self;
        let tensors = [
            router_scale,
            per_expert_scale,
            pre_norm,
            post_norm_mlp,
            post_norm_experts,
        ];
        (moe, PARALLEL_MOE_TENSORS.into_iter().zip(tensors).collect())
    }

    /// The block's tensors other than linear layers, with their parameter names inside the
    /// decoder layer.
    fn small_tensors(&self) -> Vec<(&'static str, &Tensor)> {
        let tensors = [
            &self.router_scale,
            &self.per_expert_scale,
            &self.pre_norm,
            &self.post_norm_mlp,
            &self.post_norm_experts,
        ];
        PARALLEL_MOE_TENSORS.into_iter().zip(tensors).collect()
    }

    /// The module names of [`Moe::linears`] inside the decoder layer: `router.proj`, then
    /// `experts.N.gate_proj` / `up_proj` / `down_proj`.
    fn names(&self) -> Vec<String> {
        let mut out = vec!["router.proj".to_string()];
        for e in 0..self.moe.experts.len() {
            out.extend(["gate_proj", "up_proj", "down_proj"].map(|p| format!("experts.{e}.{p}")));
        }
        out
    }
}

/// Gemma 4's per-layer embeddings (PLE): for every layer a `per_layer_dim` input made from a
/// second token embedding and a projection of the input embeddings.
#[derive(Debug, Clone)]
pub struct PerLayerEmbedding {
    /// `model.embed_tokens_per_layer` (`[vocab_per_layer, layers · per_layer_dim]`), scaled by
    /// `√per_layer_dim` on lookup.
    pub table: Tensor,
    /// `model.per_layer_model_projection` (`[layers · per_layer_dim, hidden]`).
    pub projection: Linear,
    /// `model.per_layer_projection_norm` (`[per_layer_dim]`).
    pub norm: Tensor,
}

/// The module names of Gemma 4's per-layer embedding parts.
pub const PER_LAYER_TABLE: &str = "model.embed_tokens_per_layer.weight";
/// See [`PER_LAYER_TABLE`].
pub const PER_LAYER_PROJECTION: &str = "model.per_layer_model_projection";
/// See [`PER_LAYER_TABLE`].
pub const PER_LAYER_NORM: &str = "model.per_layer_projection_norm.weight";

/// The MLP: gated (SwiGLU / GeGLU) or Phi-2's ungated one.
#[derive(Debug, Clone)]
pub struct Mlp {
    pub gate_up: GateUpProjection,
    pub down_proj: Linear,
}

/// A sparse mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE): a router picks `top_k`
/// experts per token, whose outputs are summed with the routing weights.
#[derive(Debug, Clone)]
pub struct Moe {
    /// The router (`gate`, `[experts, hidden]`).
    pub router: Linear,
    /// Gated experts (gate / up / down).
    pub experts: Vec<Mlp>,
    /// The always-on shared expert, with Qwen2-MoE's gate (`[1, hidden]`, through a sigmoid);
    /// Llama 4's has no gate.
    pub shared_expert: Option<(Mlp, Option<Linear>)>,
    /// Llama 4's routing ([`crate::config::MoeConfig::sigmoid_input_routing`]).
    pub sigmoid_input_routing: bool,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    /// Mixtral keeps the routing weights in f32 when scaling expert outputs.
    pub f32_routing_weights: bool,
    /// Mixtral's module names (`block_sparse_moe.experts.N.w1`, ...) instead of Qwen's.
    pub mixtral_names: bool,
    /// Phi-3.5-MoE routes with the sparsemixer (two experts per token) instead of softmax top-k.
    pub sparse_mixer: Option<SparseMixer>,
}

impl Moe {
    /// The block's module name inside the decoder layer: `block_sparse_moe` (Mixtral) or `mlp`.
    pub fn block_name(&self) -> &'static str {
        if self.mixtral_names {
            "block_sparse_moe"
        } else {
            "mlp"
        }
    }

    /// The router's module name in transformers 5's in-memory model: `router` for Phi-3.5-MoE,
    /// `gate` otherwise.
    pub fn transformers5_router_name(&self) -> &'static str {
        if self.sparse_mixer.is_some() {
            "router"
        } else {
            "gate"
        }
    }

    /// Each expert's gate, up and down projection names: `w1`, `w3`, `w2` (Mixtral) or
    /// `gate_proj`, `up_proj`, `down_proj`.
    pub fn projection_names(&self) -> [&'static str; 3] {
        if self.mixtral_names {
            ["w1", "w3", "w2"]
        } else {
            ["gate_proj", "up_proj", "down_proj"]
        }
    }

    /// The block's module names inside the decoder layer, in the order of [`Moe::linears`]:
    /// `block_sparse_moe.gate`, `block_sparse_moe.experts.0.w1` / `w3` / `w2`, ... (Mixtral) or
    /// `mlp.gate`, `mlp.experts.0.gate_proj` / `up_proj` / `down_proj`, ...,
    /// `mlp.shared_expert.*`, `mlp.shared_expert_gate` (Qwen).
    fn names(&self) -> Vec<String> {
        let (block, projections) = (self.block_name(), self.projection_names());
        let mut out = vec![format!("{block}.gate")];
        let mut mlp = |prefix: String| {
            out.extend(projections.iter().map(|p| format!("{prefix}.{p}")));
        };
        for e in 0..self.experts.len() {
            mlp(format!("{block}.experts.{e}"));
        }
        if let Some((_, gate)) = &self.shared_expert {
            mlp(format!("{block}.shared_expert"));
            if gate.is_some() {
                out.push(format!("{block}.shared_expert_gate"));
            }
        }
        out
    }

    /// The router, each expert's gate / up / down projections, then the shared expert's and its
    /// gate. Experts are always separate gated MLPs (the loader builds them so).
    fn linears(&self) -> Vec<&Linear> {
        let mut out = vec![&self.router];
        for e in &self.experts {
            out.extend(mlp_linears(e));
        }
        if let Some((shared, gate)) = &self.shared_expert {
            out.extend(mlp_linears(shared));
            out.extend(gate);
        }
        out
    }

    /// [`Moe::linears`], mutable.
    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut out = vec![&mut self.router];
        for e in self.experts.iter_mut() {
            out.extend(mlp_linears_mut(e));
        }
        if let Some((shared, gate)) = &mut self.shared_expert {
            out.extend(mlp_linears_mut(shared));
            out.extend(gate.as_mut());
        }
        out
    }
}

/// A gated MLP's linear layers in model order (gate, up, down), mutable.
fn mlp_linears_mut(mlp: &mut Mlp) -> Vec<&mut Linear> {
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
}

impl GateUpProjection {
    /// The module name of the down projection that follows: `mlp.down_proj` (Phi-2's ungated
    /// MLP: `mlp.fc2`).
    fn down_proj_name(&self) -> &'static str {
        match self {
            GateUpProjection::Ungated { .. } => "mlp.fc2",
            _ => "mlp.down_proj",
        }
    }
}

impl Mlp {
    /// The down projection's module name: `mlp.down_proj` (Phi-2: `mlp.fc2`).
    pub fn down_proj_name(&self) -> &'static str {
        self.gate_up.down_proj_name()
    }

    /// The module names of a dense layer's MLP, in the order of [`mlp_linears`].
    fn names(&self) -> Vec<&'static str> {
        let mut out = match self.gate_up {
            GateUpProjection::Separate { .. } => vec!["mlp.gate_proj", "mlp.up_proj"],
            GateUpProjection::Fused { .. } => vec!["mlp.gate_up_proj"],
            GateUpProjection::Ungated { .. } => vec!["mlp.fc1"],
        };
        out.push(self.down_proj_name());
        out
    }
}

impl QkvProjection {
    /// The module names, in the order of [`QkvProjection::linears`].
    fn names(&self) -> &'static [&'static str] {
        match self {
            QkvProjection::Separate { .. } => {
                &["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
            }
            QkvProjection::Fused { .. } => &["self_attn.qkv_proj"],
            QkvProjection::KeyIsValue { .. } => &["self_attn.q_proj", "self_attn.k_proj"],
            QkvProjection::QueryOnly { .. } => &["self_attn.q_proj"],
        }
    }

    fn linears(&self) -> Vec<&Linear> {
        match self {
            QkvProjection::Separate {
                q_proj,
                k_proj,
                v_proj,
            } => vec![q_proj, k_proj, v_proj],
            QkvProjection::Fused { qkv_proj } => vec![qkv_proj],
            QkvProjection::KeyIsValue { q_proj, k_proj } => vec![q_proj, k_proj],
            QkvProjection::QueryOnly { q_proj } => vec![q_proj],
        }
    }

    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        match self {
            QkvProjection::Separate {
                q_proj,
                k_proj,
                v_proj,
            } => vec![q_proj, k_proj, v_proj],
            QkvProjection::Fused { qkv_proj } => vec![qkv_proj],
            QkvProjection::KeyIsValue { q_proj, k_proj } => vec![q_proj, k_proj],
            QkvProjection::QueryOnly { q_proj } => vec![q_proj],
        }
    }
}

/// One decoder layer (pre-norm residual blocks).
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    pub input_layernorm: Tensor,
    /// Phi-2's LayerNorm bias.
    pub input_layernorm_bias: Option<Tensor>,
    pub self_attn: Attention,
    /// The MLP's pre-norm; with sandwich norms (Gemma 2/3) the norm of the attention's output;
    /// none in Phi-2's parallel block.
    pub post_attention_layernorm: Option<Tensor>,
    /// Phi-3.5-MoE's LayerNorm bias of `post_attention_layernorm`.
    pub post_attention_layernorm_bias: Option<Tensor>,
    /// Gemma 2/3: the MLP's pre-norm.
    pub pre_feedforward_layernorm: Option<Tensor>,
    /// Gemma 2/3: the norm of the MLP's output.
    pub post_feedforward_layernorm: Option<Tensor>,
    pub mlp: FeedForward,
    /// Gemma 4's mixture of experts beside the MLP.
    pub parallel_moe: Option<Box<ParallelMoe>>,
    /// Sliding-window span, if this layer uses one.
    pub sliding_window: Option<usize>,
    /// Llama 4's chunked attention: the chunk length, if this layer's attention is confined to
    /// its own chunk of positions.
    pub attention_chunk: Option<usize>,
    /// Gemma 3: the layer uses the local rotary embedding.
    pub local_rope: bool,
    /// The layer applies RoPE (SmolLM3's NoPE layers do not).
    pub use_rope: bool,
    /// The parameter name of `post_attention_layernorm`'s tensor
    /// ([`ModelConfig::post_attention_norm_name`]).
    pub post_attention_norm_name: &'static str,
    /// Gemma 4's per-layer input block.
    pub per_layer_input: Option<PerLayerInputBlock>,
    /// Gemma 4's `layer_scalar` (`[1]`), multiplying the layer's output: a buffer of the
    /// checkpoint, never trained.
    pub layer_scalar: Option<Tensor>,
}

impl DecoderLayer {
    /// The layer's norm tensors with their parameter names inside it (`input_layernorm.weight`,
    /// ..., `self_attn.k_norm.weight`), and its linear layers as [`DecoderLayer::linears`] names
    /// them: every tensor of the layer, borrowed apart.
    pub fn parts_mut(&mut self) -> LayerPartsMut<'_> {
        let names = self.linear_names();
        let post_attention_norm_name = self.post_attention_norm_name;
        let DecoderLayer {
            input_layernorm,
            input_layernorm_bias,
            self_attn,
            post_attention_layernorm,
            post_attention_layernorm_bias,
            pre_feedforward_layernorm,
            post_feedforward_layernorm,
            mlp,
            parallel_moe,
            per_layer_input,
            ..
        } = self;
        let Attention {
            qkv,
            o_proj,
            q_norm,
            k_norm,
            ..
        } = self_attn;
        let mut norms: Vec<(&'static str, &mut Tensor)> =
            vec![("input_layernorm.weight", input_layernorm)];
        let optional = [
            ("input_layernorm.bias", input_layernorm_bias),
            (post_attention_norm_name, post_attention_layernorm),
            (
                "post_attention_layernorm.bias",
                post_attention_layernorm_bias,
            ),
            (
                "pre_feedforward_layernorm.weight",
                pre_feedforward_layernorm,
            ),
            (
                "post_feedforward_layernorm.weight",
                post_feedforward_layernorm,
            ),
            ("self_attn.q_norm.weight", q_norm),
            ("self_attn.k_norm.weight", k_norm),
        ];
        norms.extend(
            optional
                .into_iter()
                .filter_map(|(name, t)| t.as_mut().map(|t| (name, t))),
        );
        let mut linears = qkv.linears_mut();
        linears.push(o_proj);
        match mlp {
            FeedForward::Dense(mlp) => linears.extend(mlp_linears_mut(mlp)),
            FeedForward::Sparse(moe) => linears.extend(moe.linears_mut()),
        }
        if let Some(block) = parallel_moe {
            let (moe, small) = block.parts_mut();
            linears.extend(moe.linears_mut());
            norms.extend(small);
        }
        if let Some(block) = per_layer_input {
            norms.push(("post_per_layer_input_norm.weight", &mut block.norm));
            linears.extend([&mut block.gate, &mut block.projection]);
        }
        debug_assert_eq!(names.len(), linears.len());
        let linears = names.into_iter().zip(linears).collect();
        LayerPartsMut { norms, linears }
    }

    /// The layer's norm tensors with their parameter names inside it
    /// (`input_layernorm.weight`, ...), in checkpoint order.
    pub fn norms(&self) -> Vec<(&'static str, &Tensor)> {
        let mut out = vec![("input_layernorm.weight", &self.input_layernorm)];
        let optional = [
            ("input_layernorm.bias", &self.input_layernorm_bias),
            (
                self.post_attention_norm_name,
                &self.post_attention_layernorm,
            ),
            (
                "post_attention_layernorm.bias",
                &self.post_attention_layernorm_bias,
            ),
            (
                "pre_feedforward_layernorm.weight",
                &self.pre_feedforward_layernorm,
            ),
            (
                "post_feedforward_layernorm.weight",
                &self.post_feedforward_layernorm,
            ),
            ("self_attn.q_norm.weight", &self.self_attn.q_norm),
            ("self_attn.k_norm.weight", &self.self_attn.k_norm),
        ];
        out.extend(
            optional
                .into_iter()
                .filter_map(|(name, t)| t.as_ref().map(|t| (name, t))),
        );
        if let Some(block) = &self.parallel_moe {
            out.extend(block.small_tensors());
        }
        if let Some(block) = &self.per_layer_input {
            out.push(("post_per_layer_input_norm.weight", &block.norm));
        }
        out
    }

    /// The layer's buffers with their names inside it: checkpoint tensors that are no
    /// parameters (Gemma 4's `layer_scalar`), saved back as they are and never trained.
    pub fn buffers(&self) -> Vec<(&'static str, &Tensor)> {
        self.layer_scalar
            .iter()
            .map(|t| ("layer_scalar", t))
            .collect()
    }

    /// The layer's linear layers with their module names inside it (`self_attn.q_proj`, ...),
    /// in model order (the names only borrowed, except for a mixture of experts').
    pub fn linears(&self) -> Vec<(Cow<'static, str>, &Linear)> {
        let mut linears = self.self_attn.qkv.linears();
        linears.push(&self.self_attn.o_proj);
        match &self.mlp {
            FeedForward::Dense(mlp) => linears.extend(mlp_linears(mlp)),
            FeedForward::Sparse(moe) => linears.extend(moe.linears()),
        }
        if let Some(block) = &self.parallel_moe {
            linears.extend(block.moe.linears());
        }
        if let Some(block) = &self.per_layer_input {
            linears.extend([&block.gate, &block.projection]);
        }
        let names = self.linear_names();
        debug_assert_eq!(names.len(), linears.len());
        names.into_iter().zip(linears).collect()
    }

    /// The module names of [`DecoderLayer::linears`], in its order (borrowed, except a mixture
    /// of experts' per-expert names).
    fn linear_names(&self) -> Vec<Cow<'static, str>> {
        let attn = &self.self_attn;
        let mut names: Vec<Cow<'static, str>> =
            attn.qkv.names().iter().map(|&n| Cow::Borrowed(n)).collect();
        names.push(Cow::Borrowed(attn.o_proj_name));
        match &self.mlp {
            FeedForward::Dense(mlp) => names.extend(mlp.names().into_iter().map(Cow::Borrowed)),
            FeedForward::Sparse(moe) => names.extend(moe.names().into_iter().map(Cow::Owned)),
        }
        if let Some(block) = &self.parallel_moe {
            names.extend(block.names().into_iter().map(Cow::Owned));
        }
        if self.per_layer_input.is_some() {
            names.extend(["per_layer_input_gate", "per_layer_projection"].map(Cow::Borrowed));
        }
        names
    }
}

/// A gated MLP's linear layers in model order (gate, up, down).
fn mlp_linears(mlp: &Mlp) -> Vec<&Linear> {
    let mut out = Vec::with_capacity(3);
    match &mlp.gate_up {
        GateUpProjection::Separate { gate_proj, up_proj } => out.extend([gate_proj, up_proj]),
        GateUpProjection::Fused { gate_up_proj } => out.push(gate_up_proj),
        GateUpProjection::Ungated { fc1 } => out.push(fc1),
    }
    out.push(&mlp.down_proj);
    out
}

/// Every tensor of one decoder layer, mutable and borrowed apart ([`DecoderLayer::parts_mut`]).
pub struct LayerPartsMut<'a> {
    /// Norm tensors by parameter name (`input_layernorm.weight`, `self_attn.q_norm.weight`, ...).
    pub norms: Vec<(&'static str, &'a mut Tensor)>,
    /// Linear layers by module name (`self_attn.q_proj`, ...), in model order.
    pub linears: Vec<(Cow<'static, str>, &'a mut Linear)>,
}

/// Keys and values of earlier positions, per layer: `[batch, kv_heads, positions, head_dim]`.
///
/// The forward pass appends to it by concatenation, so each entry holds exactly the cached
/// positions. The decode step ([`CausalLm::decode_step`]) instead keeps fixed-capacity buffers and
/// writes each new position in place (no copy of the whole cache per token); the forward turns
/// those back into exact entries when it runs next.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
    /// While the entries are fixed-capacity buffers: how many positions are filled.
    filled: Option<usize>,
    /// The decode step recorded as a graph for these buffers (see `CausalLm::decode_step`).
    graph: decode_step::Recorded,
    /// The buffers, rows and first keys the last eager decode step ran on: the next step on the
    /// same ones is recorded.
    warm: Option<decode_step::GraphKey>,
    /// How recorded steps replay.
    replay: decode_step::Replay,
}

/// Fixed-capacity buffers grow in steps of this many positions (and at least double).
const KV_CAPACITY_STEP: usize = 256;

impl KvCache {
    /// An empty cache for `num_layers` layers.
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: vec![None; num_layers],
            ..Self::default()
        }
    }

    /// Tests: decode steps go through the graph bookkeeping on any device, each replay emulated
    /// by running the step's ops again on the recorded buffers with the position they were
    /// recorded at, so that everything a replayed CUDA graph depends on (inputs copied into its
    /// buffers, the position read from device counters) is checked without a GPU.
    #[doc(hidden)]
    pub fn emulate_graph_replay(&mut self) {
        self.replay = decode_step::Replay::Emulated;
    }

    /// Tests: decode steps on this cache are never recorded as CUDA graphs.
    #[doc(hidden)]
    pub fn never_record_steps(&mut self) {
        self.replay = decode_step::Replay::Off;
    }

    /// Whether a decode step is recorded for the current buffers (tests).
    #[doc(hidden)]
    pub fn has_recorded_step(&self) -> bool {
        self.graph.0.is_some()
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.filled.unwrap_or_else(|| self.capacity())
    }

    /// True when nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A cache of `rows` rows, each a copy of this cache's first row (entries exact): one shared
    /// prefix continued `rows` ways in one batch (the evaluation harness's answer choices).
    pub fn repeat_first_row(&self, rows: usize) -> CResult<KvCache> {
        let filled = self.len();
        let take = |t: &Tensor| -> CResult<Tensor> {
            t.narrow(0, 0, 1)?
                .narrow(2, 0, filled)?
                .repeat((rows, 1, 1, 1))?
                .contiguous()
        };
        let mut layers = Vec::with_capacity(self.layers.len());
        for entry in &self.layers {
            layers.push(match entry {
                Some((k, v)) => Some((take(k)?, take(v)?)),
                None => None,
            });
        }
        Ok(KvCache {
            layers,
            ..KvCache::default()
        })
    }

    /// Positions the entries can hold without growing (their length when they are exact).
    fn capacity(&self) -> usize {
        self.layers
            .first()
            .and_then(|l| l.as_ref())
            .map_or(0, |(k, _)| k.dim(2).unwrap_or(0))
    }

    /// Makes every entry hold exactly the filled positions again (what concatenation expects).
    fn make_exact(&mut self) -> CResult<()> {
        // A recorded step wrote into the buffers being replaced.
        self.graph = Default::default();
        self.warm = None;
        if let Some(filled) = self.filled.take() {
            for (k, v) in self.layers.iter_mut().flatten() {
                *k = k.narrow(2, 0, filled)?.contiguous()?;
                *v = v.narrow(2, 0, filled)?.contiguous()?;
            }
        }
        Ok(())
    }

    /// Turns the entries into fixed-capacity buffers with room for at least `needed` positions
    /// (contents kept); `shape` is `(batch, kv_heads, head_dim)` for entries not created yet.
    fn reserve(
        &mut self,
        needed: usize,
        shape: (usize, usize, usize),
        dtype: DType,
        device: &Device,
    ) -> CResult<()> {
        let filled = self.len();
        let capacity = self.capacity();
        if self.filled.is_some() && capacity >= needed {
            return Ok(());
        }
        let grown = if self.filled.is_some() {
            2 * capacity
        } else {
            0
        };
        let new_capacity = needed.max(grown).next_multiple_of(KV_CAPACITY_STEP);
        // New buffers: a recorded step wrote into the old ones.
        self.graph = Default::default();
        self.warm = None;
        let (batch, kv_heads, head_dim) = shape;
        let widen = |t: Option<&Tensor>| -> CResult<Tensor> {
            let buffer = Tensor::zeros((batch, kv_heads, new_capacity, head_dim), dtype, device)?;
            if let Some(t) = t {
                buffer.slice_set(&t.narrow(2, 0, filled)?.contiguous()?, 2, 0)?;
            }
            Ok(buffer)
        };
        for entry in self.layers.iter_mut() {
            let (k, v) = match entry.as_ref() {
                Some((k, v)) => (widen(Some(k))?, widen(Some(v))?),
                None => (widen(None)?, widen(None)?),
            };
            *entry = Some((k, v));
        }
        self.filled = Some(filled);
        Ok(())
    }
}

/// Who attends to whom in one forward call, and at which positions.
///
/// Covers plain causal batches, left-padded generation batches (padding keys masked, positions
/// counted from each row's first real token) and packed training batches (attention only within a
/// sample, positions restarting per sample).
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionLayout {
    /// Position id of each new token, `[batch][seq]`.
    pub positions: Vec<Vec<u32>>,
    /// Whether each key slot (cached + new, `[batch][past + seq]`) is a real token.
    pub key_valid: Vec<Vec<bool>>,
    /// Sample id of each key slot for packed batches (`[batch][past + seq]`).
    pub segments: Option<Vec<Vec<u32>>>,
}

impl AttentionLayout {
    /// A plain causal layout: `batch` rows of `seq` new tokens after `past` cached ones.
    pub fn causal(batch: usize, seq: usize, past: usize) -> Self {
        let row: Vec<u32> = (past as u32..(past + seq) as u32).collect();
        Self {
            positions: vec![row; batch],
            key_valid: vec![vec![true; past + seq]; batch],
            segments: None,
        }
    }

    /// The layout of the batch rows `rows` (in that order): what a layer sees when it runs only
    /// some rows (layer dropout).
    pub fn select_rows(&self, rows: &[usize]) -> Self {
        Self {
            positions: rows.iter().map(|&r| self.positions[r].clone()).collect(),
            key_valid: rows.iter().map(|&r| self.key_valid[r].clone()).collect(),
            segments: self
                .segments
                .as_ref()
                .map(|s| rows.iter().map(|&r| s[r].clone()).collect()),
        }
    }

    /// Additive mask `[batch, 1, seq, past + seq]` (0 = attend, the dtype's minimum = masked, as
    /// transformers' `finfo(dtype).min`), or `None` when every query may see every key (a single
    /// decode step without padding). The keys each query row can see are registered with the mask
    /// ([`fused::register_mask_layout`]) so the GPU kernels need not read it back.
    fn additive_mask(
        &self,
        window: Option<usize>,
        chunk: Option<usize>,
        dtype: DType,
        device: &Device,
    ) -> CResult<Option<Tensor>> {
        let batch = self.positions.len();
        let seq = self.positions.first().map_or(0, Vec::len);
        let total = self.key_valid.first().map_or(0, Vec::len);
        let past = total - seq;
        let mut allowed = vec![false; batch * seq * total];
        let mut any_masked = false;
        for b in 0..batch {
            let valid = &self.key_valid[b];
            let seg = self.segments.as_ref().map(|s| &s[b]);
            for i in 0..seq {
                let q = past + i;
                // Only keys in [lo, q] can be visible: causal, within the sliding window, and in
                // the query's chunk of positions (the keys before a query hold the positions
                // before its own, one each, back to its sample's start).
                let window_lo = window.map_or(0, |w| (q + 1).saturating_sub(w));
                let chunk_lo =
                    chunk.map_or(0, |c| q.saturating_sub(self.positions[b][i] as usize % c));
                let lo = window_lo.max(chunk_lo);
                let row = &mut allowed[(b * seq + i) * total..][..total];
                for j in lo..=q.min(total - 1) {
                    row[j] = valid[j] && seg.is_none_or(|s| s[j] == s[q]);
                }
                any_masked |= !row.iter().all(|&a| a);
            }
        }
        if !any_masked {
            return Ok(None);
        }
        // Built in the compute dtype: half the bytes to copy for bf16, and its own minimum.
        let mask = ops::additive_mask(&allowed, (batch, 1, seq, total), dtype, device)?;
        let layout =
            fused::MaskLayout::from_allowed(&allowed, seq, total, ops::additive_mask_min(dtype));
        fused::register_mask_layout(&mask, layout);
        Ok(Some(mask))
    }
}

/// What one forward call carries from layer to layer besides the hidden states (Gemma 4).
#[derive(Debug, Default)]
struct AcrossLayers {
    /// The per-layer inputs `[b, t, layers, per_layer_dim]`.
    per_layer_inputs: Option<Tensor>,
    /// Keys and values by the layer that computed them, for the layers that attend with them.
    kv: HashMap<usize, (Tensor, Tensor)>,
}

/// Per-call tensors every decoder layer uses: rotary tables and attention masks.
#[derive(Debug, Clone)]
pub struct LayerInputs {
    cos: Tensor,
    sin: Tensor,
    /// Gemma 3: the local rotary tables of the sliding-attention layers.
    local_cos_sin: Option<(Tensor, Tensor)>,
    /// Ministral 3: the query temperature per position (`[b, 1, t, 1]`), when one differs from 1.
    q_scale: Option<Tensor>,
    /// Llama 4: the NoPE layers' query temperature per position (`[b, 1, t, 1]`, f32), when one
    /// differs from 1.
    nope_q_scale: Option<Tensor>,
    full_mask: Option<Tensor>,
    /// The masks of layers with a sliding window or an attention chunk, by `(window, chunk)`.
    limited_masks: Vec<(MaskLimits, Option<Tensor>)>,
}

/// What confines a layer's attention besides causality: `(sliding window, attention chunk)`.
type MaskLimits = (Option<usize>, Option<usize>);

impl LayerInputs {
    /// The same inputs on `device` (copies, so the host-side mask building runs once per call).
    fn to_device(&self, device: &Device) -> CResult<Self> {
        let opt = |m: &Option<Tensor>| m.as_ref().map(|t| t.to_device(device)).transpose();
        Ok(Self {
            cos: self.cos.to_device(device)?,
            sin: self.sin.to_device(device)?,
            local_cos_sin: self
                .local_cos_sin
                .as_ref()
                .map(|(c, s)| {
                    Ok::<_, candle_core::Error>((c.to_device(device)?, s.to_device(device)?))
                })
                .transpose()?,
            q_scale: opt(&self.q_scale)?,
            nope_q_scale: opt(&self.nope_q_scale)?,
            full_mask: opt(&self.full_mask)?,
            limited_masks: self
                .limited_masks
                .iter()
                .map(|(w, m)| Ok((*w, opt(m)?)))
                .collect::<CResult<_>>()?,
        })
    }

    /// The rotary tables `(cos, sin)` of `layer`.
    fn cos_sin(&self, layer: &DecoderLayer) -> (&Tensor, &Tensor) {
        match (&self.local_cos_sin, layer.local_rope) {
            (Some((cos, sin)), true) => (cos, sin),
            _ => (&self.cos, &self.sin),
        }
    }

    /// The additive mask of `layer` (full causal, or confined to its sliding window or chunk).
    fn mask(&self, layer: &DecoderLayer) -> Option<&Tensor> {
        match (layer.sliding_window, layer.attention_chunk) {
            (None, None) => self.full_mask.as_ref(),
            limits => self
                .limited_masks
                .iter()
                .find(|(l, _)| *l == limits)
                .and_then(|(_, m)| m.as_ref()),
        }
    }
}

/// A causal language model: embeddings, decoder layers, final norm and output head.
#[derive(Debug, Clone)]
pub struct CausalLm {
    pub config: ModelConfig,
    pub embed_tokens: Tensor,
    /// A LoRA/DoRA adapter on the token embedding (PEFT's `lora.Embedding`: `target_modules`
    /// naming `embed_tokens`); `a` is `lora_embedding_A` `[r, vocab]`, `b` `lora_embedding_B`
    /// `[hidden, r]`.
    pub embed_adapter: Option<LoraAdapter>,
    /// Gemma 4's per-layer embeddings.
    pub per_layer_embedding: Option<PerLayerEmbedding>,
    pub layers: Vec<DecoderLayer>,
    pub norm: Tensor,
    /// Phi-2's final LayerNorm bias.
    pub norm_bias: Option<Tensor>,
    /// The output head; with tied embeddings its weight is `embed_tokens`.
    pub lm_head: Linear,
    rope: RotaryEmbedding,
    /// Gemma 3: the rotary embedding of the sliding-attention layers.
    local_rope: Option<RotaryEmbedding>,
    dtype: DType,
    /// The embedding's device (where input ids go); every weight's when not dispatched.
    device: Device,
    /// Where the parts live after [`CausalLm::dispatch`]; `None` keeps the single-device path.
    spread: Option<Arc<DeviceSpread>>,
    /// The last layer inputs built, by layout and device: training batches of one shape share
    /// them, so the masks are built on the host and copied to the device once, not every step.
    inputs_cache: Arc<std::sync::Mutex<Option<(AttentionLayout, DeviceLocation, LayerInputs)>>>,
    /// While recording ([`CausalLm::record_routers`]), each sparse layer's router output, in
    /// the order the layers run: what the router's auxiliary load-balancing loss is computed
    /// from. Shared by clones of the model.
    router_tape: Arc<std::sync::Mutex<Option<Vec<RouterRecord>>>>,
}

/// One sparse layer's routing of a batch, as the router's auxiliary loss needs it.
#[derive(Debug, Clone)]
pub struct RouterRecord {
    /// The router's softmax probabilities `[tokens, experts]` in f32 (differentiable).
    pub probs: Tensor,
    /// The experts each token was sent to, `top_k` per token in order (`[tokens * top_k]`).
    pub selected: Vec<u32>,
    /// `probs` as read on the host (row-major `[tokens, experts]`).
    pub host_probs: Vec<f32>,
}

/// A model's placement over several devices, as [`CausalLm::dispatch`] left it.
#[derive(Debug)]
struct DeviceSpread {
    placement: Placement,
    devices: Vec<Device>,
}

/// Ministral 3's query temperature `1 + beta · ln(1 + ⌊p / original⌋)` for every position, as
/// transformers computes it in f32, row by row; `None` when every factor is 1 (all positions
/// below `original`).
pub(crate) fn llama4_query_scale(
    positions: &[Vec<u32>],
    beta: f64,
    original: usize,
) -> Option<Vec<f32>> {
    if positions.iter().flatten().all(|&p| (p as usize) < original) {
        return None;
    }
    let values = positions
        .iter()
        .flatten()
        .map(|&p| 1.0 + beta as f32 * (1.0 + (p as f32 / original as f32).floor()).ln())
        .collect();
    Some(values)
}

/// A per-position query temperature (`[b, 1, t, 1]`) and the dtype it multiplies in.
#[derive(Clone, Copy)]
enum QueryScale<'a> {
    None,
    /// In the compute dtype (Ministral 3: transformers casts the factors first).
    Compute(&'a Tensor),
    /// f32 factors, the queries multiplied in f32 (Llama 4).
    F32(&'a Tensor),
}

/// Each head's last dim from Meta's adjacent rotary pairs `(x0, x1, x2, x3, ...)` to
/// transformers' halves `(x0, x2, ..., x1, x3, ...)`, for `[b, t, heads, head_dim]`.
fn pairs_to_halves(x: &Tensor) -> CResult<Tensor> {
    let (b, t, n, d) = x.dims4()?;
    x.reshape((b, t, n, d / 2, 2))?
        .transpose(3, 4)?
        .contiguous()?
        .reshape((b, t, n, d))
}

/// Llama 4's query temperature of its NoPE layers, `1 + attn_scale · ln(1 + ⌊(p + 1) /
/// floor_scale⌋)` for every position, in f32 as transformers computes it; `None` when every
/// factor is 1 (all positions before `floor_scale − 1`).
pub(crate) fn nope_query_temperature(
    positions: &[Vec<u32>],
    attn_scale: f64,
    floor_scale: f64,
) -> Option<Vec<f32>> {
    let values: Vec<f32> = positions
        .iter()
        .flatten()
        .map(|&p| {
            let floor = ((p as f32 + 1.0) / floor_scale as f32).floor();
            floor.ln_1p() * attn_scale as f32 + 1.0
        })
        .collect();
    values.iter().any(|&v| v != 1.0).then_some(values)
}

/// The final norm's module name: `model.norm` (Phi-2: `model.final_layernorm`).
pub(crate) fn final_norm_name(config: &ModelConfig) -> &'static str {
    if config.parallel_block {
        "model.final_layernorm"
    } else {
        "model.norm"
    }
}

/// The final norm's weight (and Phi-2's bias) under their HF names, mutable: what
/// [`CausalLm::final_norm_tensors_mut`] lists, from the fields alone so that callers can borrow
/// the model's other fields beside them.
pub(crate) fn final_norm_entries_mut<'a>(
    config: &ModelConfig,
    norm: &'a mut Tensor,
    bias: Option<&'a mut Tensor>,
) -> Vec<(String, &'a mut Tensor)> {
    let name = final_norm_name(config);
    let mut out = vec![(format!("{name}.weight"), norm)];
    if let Some(b) = bias {
        out.push((format!("{name}.bias"), b));
    }
    out
}

/// Warns about checkpoint tensors the model did not take (as transformers reports unused
/// weights): a tensor the model should use but ignores would otherwise change its outputs
/// silently. Rotary caches (`rotary_emb.inv_freq`) and a tied head's stored copy are expected.
fn warn_unused(left: &HashMap<String, Tensor>, c: &ModelConfig, source: &str) {
    let mut unused: Vec<&String> = left
        .keys()
        .filter(|n| !n.ends_with("rotary_emb.inv_freq"))
        .filter(|n| !(c.tie_word_embeddings && n.as_str() == "lm_head.weight"))
        .collect();
    if unused.is_empty() {
        return;
    }
    unused.sort();
    let shown: Vec<&str> = unused.iter().take(5).map(|s| s.as_str()).collect();
    tracing::warn!(
        "{source}: {} tensor(s) of the checkpoint are not used by the '{}' model: {}{}",
        unused.len(),
        c.model_type,
        shown.join(", "),
        if unused.len() > 5 { ", ..." } else { "" }
    );
}

/// Takes named tensors out of a checkpoint's map, checking shapes.
struct TensorTaker<'a> {
    tensors: &'a mut HashMap<String, Tensor>,
    packed: &'a mut HashMap<String, QuantizedMatrix>,
    source: &'a str,
}

impl TensorTaker<'_> {
    fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
        let t = self
            .tensors
            .remove(name)
            .ok_or_else(|| ModelError::Msg(format!("{}: missing tensor '{name}'", self.source)))?;
        if t.dims() != shape {
            return Err(ModelError::Msg(format!(
                "{}: tensor '{name}' has shape {:?}, expected {:?} from the model config",
                self.source,
                t.dims(),
                shape
            )));
        }
        Ok(t)
    }

    fn take_opt(&mut self, name: &str, shape: &[usize]) -> Result<Option<Tensor>, ModelError> {
        if self.tensors.contains_key(name) {
            self.take(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }

    /// A linear layer; its bias is used when the checkpoint has one.
    fn linear(&mut self, prefix: &str, out: usize, inp: usize) -> Result<Linear, ModelError> {
        let name = format!("{prefix}.weight");
        Ok(Linear {
            weight: BaseWeight::Dense(self.take(&name, &[out, inp])?),
            bias: self.take_opt(&format!("{prefix}.bias"), &[out])?,
            packed: self.take_packed(&name, out, inp),
            adapter: None,
            fake_quant: None,
        })
    }

    /// The mixture-of-experts block of layer `p` (`model.layers.N`).
    fn moe(&mut self, p: &str, m: &crate::config::MoeConfig, h: usize) -> Result<Moe, ModelError> {
        let (block, [gate, up, down]) = if m.mixtral_names {
            ("block_sparse_moe", ["w1", "w3", "w2"])
        } else {
            ("mlp", ["gate_proj", "up_proj", "down_proj"])
        };
        let pre = format!("{p}.{block}");
        if m.sigmoid_input_routing {
            let experts = m.num_experts;
            self.split_fused_experts(&pre, experts, m.expert_intermediate_size, h, true)?;
        }
        let mut gated = |prefix: &str, inter: usize| -> Result<Mlp, ModelError> {
            Ok(Mlp {
                gate_up: GateUpProjection::Separate {
                    gate_proj: self.linear(&format!("{prefix}.{gate}"), inter, h)?,
                    up_proj: self.linear(&format!("{prefix}.{up}"), inter, h)?,
                },
                down_proj: self.linear(&format!("{prefix}.{down}"), h, inter)?,
            })
        };
        let experts = (0..m.num_experts)
            .map(|e| gated(&format!("{pre}.experts.{e}"), m.expert_intermediate_size))
            .collect::<Result<Vec<_>, _>>()?;
        let shared = match m.shared_expert_intermediate_size {
            Some(inter) => Some(gated(&format!("{pre}.shared_expert"), inter)?),
            None => None,
        };
        let shared_expert = match shared {
            // Llama 4's shared expert is added as it is.
            Some(mlp) if m.sigmoid_input_routing => Some((mlp, None)),
            Some(mlp) => Some((
                mlp,
                Some(self.linear(&format!("{pre}.shared_expert_gate"), 1, h)?),
            )),
            None => None,
        };
        Ok(Moe {
            router: self.linear(&format!("{pre}.gate"), m.num_experts, h)?,
            experts,
            shared_expert,
            top_k: m.top_k,
            norm_topk_prob: m.norm_topk_prob,
            f32_routing_weights: m.f32_routing_weights,
            sigmoid_input_routing: m.sigmoid_input_routing,
            mixtral_names: m.mixtral_names,
            sparse_mixer: m.sparse_mixer,
        })
    }

    /// Fused experts as each expert's linear weights (`{pre}.experts.N.gate_proj.weight`
    /// `[inter, hidden]`, ...), which the decoder keeps separate so that each trains, quantizes
    /// and merges as any linear layer. Llama 4's are `transposed`, inputs first as `torch.bmm`
    /// takes them (`{pre}.experts.gate_up_proj` `[experts, hidden, 2 × inter]`, gate then up
    /// along the last dim, and `{pre}.experts.down_proj` `[experts, inter, hidden]`); Gemma 4's
    /// are `[experts, 2 × inter, hidden]` (gate rows first) and `[experts, hidden, inter]`. Left
    /// as they are when the experts are separate already.
    fn split_fused_experts(
        &mut self,
        pre: &str,
        experts: usize,
        inter: usize,
        h: usize,
        transposed: bool,
    ) -> Result<(), ModelError> {
        let gate_up_name = format!("{pre}.experts.gate_up_proj");
        if !self.tensors.contains_key(&gate_up_name) {
            return Ok(());
        }
        let down_name = format!("{pre}.experts.down_proj");
        let (gate_up, down) = if transposed {
            (
                self.take(&gate_up_name, &[experts, h, 2 * inter])?,
                self.take(&down_name, &[experts, inter, h])?,
            )
        } else {
            (
                self.take(&gate_up_name, &[experts, 2 * inter, h])?,
                self.take(&down_name, &[experts, h, inter])?,
            )
        };
        let split = |e: usize| -> CResult<[Tensor; 3]> {
            let (gu, d) = (gate_up.get(e)?, down.get(e)?);
            if !transposed {
                return Ok([
                    gu.narrow(0, 0, inter)?.contiguous()?,
                    gu.narrow(0, inter, inter)?.contiguous()?,
                    d.contiguous()?,
                ]);
            }
            Ok([
                gu.narrow(1, 0, inter)?.t()?.contiguous()?,
                gu.narrow(1, inter, inter)?.t()?.contiguous()?,
                d.t()?.contiguous()?,
            ])
        };
        for e in 0..experts {
            let [gate, up, down] = split(e)?;
            for (name, t) in [("gate_proj", gate), ("up_proj", up), ("down_proj", down)] {
                self.tensors
                    .insert(format!("{pre}.experts.{e}.{name}.weight"), t);
            }
        }
        Ok(())
    }

    /// Gemma 4's mixture of experts of layer `p` (`model.layers.N`), `(experts, top_k, inter)`.
    fn parallel_moe(
        &mut self,
        p: &str,
        (experts, top_k, inter): (usize, usize, usize),
        h: usize,
    ) -> Result<ParallelMoe, ModelError> {
        self.split_fused_experts(p, experts, inter, h, false)?;
        let experts = (0..experts)
            .map(|e| {
                let prefix = format!("{p}.experts.{e}");
                Ok(Mlp {
                    gate_up: GateUpProjection::Separate {
                        gate_proj: self.linear(&format!("{prefix}.gate_proj"), inter, h)?,
                        up_proj: self.linear(&format!("{prefix}.up_proj"), inter, h)?,
                    },
                    down_proj: self.linear(&format!("{prefix}.down_proj"), h, inter)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let count = experts.len();
        let router = self.linear(&format!("{p}.router.proj"), count, h)?;
        // The router's scales and the three norms, in the order of PARALLEL_MOE_TENSORS.
        let [router_scale, per_expert_scale, pre_norm, post_norm_mlp, post_norm_experts] =
            PARALLEL_MOE_TENSORS.map(|name| {
                let len = if name == "router.per_expert_scale" {
                    count
                } else {
                    h
                };
                self.take(&format!("{p}.{name}"), &[len])
            });
        Ok(ParallelMoe {
            moe: Moe {
                router,
                experts,
                shared_expert: None,
                sigmoid_input_routing: false,
                top_k,
                norm_topk_prob: true,
                // transformers multiplies the bf16 outputs by the f32 weights.
                f32_routing_weights: true,
                mixtral_names: false,
                sparse_mixer: None,
            },
            router_scale: router_scale?,
            per_expert_scale: per_expert_scale?,
            pre_norm: pre_norm?,
            post_norm_mlp: post_norm_mlp?,
            post_norm_experts: post_norm_experts?,
        })
    }

    fn take_packed(&mut self, name: &str, out: usize, inp: usize) -> Option<Arc<QuantizedMatrix>> {
        self.packed
            .remove(name)
            .filter(|m| m.rows() == out && m.cols() == inp)
            .map(Arc::new)
    }
}

impl CausalLm {
    /// Builds the model from HF-named tensors (already in the compute dtype, on `device`).
    ///
    /// `source` names the checkpoint in error messages. Tensors the model does not use are left
    /// out, with a warning naming them.
    pub fn from_tensors(
        config: ModelConfig,
        tensors: HashMap<String, Tensor>,
        source: &str,
    ) -> Result<Self, ModelError> {
        Self::from_tensors_and_packed(config, tensors, HashMap::new(), source)
    }

    /// As [`CausalLm::from_tensors`], attaching packed (GGUF block) copies of matrix weights to
    /// their layers for fast inference.
    pub fn from_tensors_and_packed(
        config: ModelConfig,
        mut tensors: HashMap<String, Tensor>,
        mut packed: HashMap<String, QuantizedMatrix>,
        source: &str,
    ) -> Result<Self, ModelError> {
        let c = &config;
        let (h, hd, inter) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let mut take = TensorTaker {
            tensors: &mut tensors,
            packed: &mut packed,
            source,
        };
        let embed_tokens = take.take("model.embed_tokens.weight", &[c.vocab_size, h])?;
        // The embedding's packed copy only serves as the tied output head.
        let embed_packed = take.take_packed("model.embed_tokens.weight", c.vocab_size, h);
        let dtype = embed_tokens.dtype();
        let device = embed_tokens.device().clone();
        let gemma4 = c.gemma4.as_ref();
        let per_layer_embedding = match gemma4.and_then(|g| g.per_layer_input) {
            Some((vocab, dim)) => {
                let width = c.num_hidden_layers * dim;
                Some(PerLayerEmbedding {
                    table: take.take(PER_LAYER_TABLE, &[vocab, width])?,
                    projection: take.linear(PER_LAYER_PROJECTION, width, h)?,
                    norm: take.take(PER_LAYER_NORM, &[dim])?,
                })
            }
            None => None,
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            // Gemma 4's layers differ in head size, key/value heads and MLP width.
            let (hd, nkv) = gemma4.map_or((hd, nkv), |g| g.attention_dims[i]);
            let inter = gemma4.map_or(inter, |g| g.intermediate_sizes[i]);
            let kv_source = gemma4.and_then(|g| g.kv_source[i]);
            let key_is_value = gemma4.is_some_and(|g| g.key_is_value[i]);
            let qkv = if kv_source.is_some() {
                QkvProjection::QueryOnly {
                    q_proj: take.linear(&format!("{p}.self_attn.q_proj"), nh * hd, h)?,
                }
            } else if key_is_value {
                QkvProjection::KeyIsValue {
                    q_proj: take.linear(&format!("{p}.self_attn.q_proj"), nh * hd, h)?,
                    k_proj: take.linear(&format!("{p}.self_attn.k_proj"), nkv * hd, h)?,
                }
            } else if c.fused_projections {
                QkvProjection::Fused {
                    qkv_proj: take.linear(
                        &format!("{p}.self_attn.qkv_proj"),
                        (nh + 2 * nkv) * hd,
                        h,
                    )?,
                }
            } else {
                QkvProjection::Separate {
                    q_proj: take.linear(&format!("{p}.self_attn.q_proj"), nh * hd, h)?,
                    k_proj: take.linear(&format!("{p}.self_attn.k_proj"), nkv * hd, h)?,
                    v_proj: take.linear(&format!("{p}.self_attn.v_proj"), nkv * hd, h)?,
                }
            };
            let (q_norm, k_norm) = if c.qk_norm {
                (
                    Some(take.take(&format!("{p}.self_attn.q_norm.weight"), &[hd])?),
                    // A KV-sharing layer has no keys of its own.
                    match kv_source {
                        Some(_) => None,
                        None => Some(take.take(&format!("{p}.self_attn.k_norm.weight"), &[hd])?),
                    },
                )
            } else {
                (None, None)
            };
            let dense_gate_up = |take: &mut TensorTaker| -> Result<GateUpProjection, ModelError> {
                Ok(if c.ungated_mlp {
                    GateUpProjection::Ungated {
                        fc1: take.linear(&format!("{p}.mlp.fc1"), inter, h)?,
                    }
                } else if c.fused_projections {
                    GateUpProjection::Fused {
                        gate_up_proj: take.linear(
                            &format!("{p}.mlp.gate_up_proj"),
                            2 * inter,
                            h,
                        )?,
                    }
                } else {
                    GateUpProjection::Separate {
                        gate_proj: take.linear(&format!("{p}.mlp.gate_proj"), inter, h)?,
                        up_proj: take.linear(&format!("{p}.mlp.up_proj"), inter, h)?,
                    }
                })
            };
            let mut sandwich = |name: &str| -> Result<Option<Tensor>, ModelError> {
                if c.sandwich_norms {
                    take.take(&format!("{p}.{name}.weight"), &[h]).map(Some)
                } else {
                    Ok(None)
                }
            };
            let pre_feedforward_layernorm = sandwich("pre_feedforward_layernorm")?;
            let post_feedforward_layernorm = sandwich("post_feedforward_layernorm")?;
            let sparse = c
                .moe
                .as_ref()
                .filter(|m| m.sparse_layers.get(i).copied().unwrap_or(false));
            let mlp = match sparse {
                Some(m) => FeedForward::Sparse(Box::new(take.moe(&p, m, h)?)),
                None => {
                    let gate_up = dense_gate_up(&mut take)?;
                    let down = format!("{p}.{}", gate_up.down_proj_name());
                    FeedForward::Dense(Mlp {
                        down_proj: take.linear(&down, h, inter)?,
                        gate_up,
                    })
                }
            };
            let o_proj_name = if c.parallel_block {
                "self_attn.dense"
            } else {
                "self_attn.o_proj"
            };
            let per_layer_input = match gemma4.and_then(|g| g.per_layer_input) {
                Some((_, dim)) => Some(PerLayerInputBlock {
                    gate: take.linear(&format!("{p}.per_layer_input_gate"), dim, h)?,
                    projection: take.linear(&format!("{p}.per_layer_projection"), h, dim)?,
                    norm: take.take(&format!("{p}.post_per_layer_input_norm.weight"), &[h])?,
                }),
                None => None,
            };
            let parallel_moe = match c.gemma4_moe() {
                Some(m) => Some(Box::new(take.parallel_moe(&p, m, h)?)),
                None => None,
            };
            let layer_scalar = match gemma4 {
                Some(_) => take.take_opt(&format!("{p}.layer_scalar"), &[1])?,
                None => None,
            };
            layers.push(DecoderLayer {
                input_layernorm: take.take(&format!("{p}.input_layernorm.weight"), &[h])?,
                input_layernorm_bias: if c.layer_norm {
                    Some(take.take(&format!("{p}.input_layernorm.bias"), &[h])?)
                } else {
                    None
                },
                self_attn: Attention {
                    qkv,
                    o_proj: take.linear(&format!("{p}.{o_proj_name}"), h, nh * hd)?,
                    o_proj_name,
                    q_norm,
                    k_norm,
                    dims: (nh, nkv, hd),
                    v_norm: gemma4.is_some(),
                    kv_source,
                },
                post_attention_layernorm: if c.parallel_block {
                    None
                } else {
                    let name = c.post_attention_norm_name;
                    Some(take.take(&format!("{p}.{name}"), &[h])?)
                },
                post_attention_layernorm_bias: if c.layer_norm && !c.parallel_block {
                    let name = format!("{p}.post_attention_layernorm.bias");
                    Some(take.take(&name, &[h])?)
                } else {
                    None
                },
                pre_feedforward_layernorm,
                post_feedforward_layernorm,
                mlp,
                parallel_moe,
                sliding_window: c.layer_sliding_windows.get(i).copied().flatten(),
                attention_chunk: c.layer_attention_chunks.get(i).copied().flatten(),
                local_rope: c.local_rope.is_some()
                    && c.local_rope_layers.get(i).copied().unwrap_or(false),
                use_rope: c.rope_layers.get(i).copied().unwrap_or(true),
                post_attention_norm_name: c.post_attention_norm_name,
                per_layer_input,
                layer_scalar,
            });
        }
        let final_norm = final_norm_name(c);
        let norm = take.take(&format!("{final_norm}.weight"), &[h])?;
        let norm_bias = if c.layer_norm {
            Some(take.take(&format!("{final_norm}.bias"), &[h])?)
        } else {
            None
        };
        let lm_head = if c.tie_word_embeddings {
            Linear {
                weight: BaseWeight::Dense(embed_tokens.clone()),
                // Tying shares the weight only: a head with a bias (Phi-2's) keeps its own.
                bias: take.take_opt("lm_head.bias", &[c.vocab_size])?,
                packed: embed_packed,
                adapter: None,
                fake_quant: None,
            }
        } else {
            match c.score_labels {
                Some(labels) => take.linear("score", labels, h)?,
                None => take.linear("lm_head", c.vocab_size, h)?,
            }
        };
        warn_unused(&tensors, c, source);
        // Each rope serves heads of its layers' size (Gemma 4's full and sliding layers differ).
        let head_dim_where = |local: bool| {
            layers
                .iter()
                .find(|l| l.local_rope == local)
                .map_or(c.head_dim, |l| l.self_attn.dims.2)
        };
        let rope = RotaryEmbedding::for_head_dim(head_dim_where(false), &c.rope);
        let local_rope = c
            .local_rope
            .as_ref()
            .map(|r| RotaryEmbedding::for_head_dim(head_dim_where(true), r));
        Ok(Self {
            config,
            embed_tokens,
            embed_adapter: None,
            per_layer_embedding,
            layers,
            norm,
            norm_bias,
            lm_head,
            rope,
            local_rope,
            dtype,
            device,
            spread: None,
            inputs_cache: Arc::default(),
            router_tape: Arc::default(),
        })
    }

    /// Every linear layer with its HF module name (`model.layers.0.self_attn.q_proj`, ...,
    /// `lm_head`), in model order: the names PEFT uses to target and store adapters.
    pub fn linears(&self) -> Vec<(String, &Linear)> {
        let mut out = Vec::new();
        if let Some(ple) = &self.per_layer_embedding {
            out.push((PER_LAYER_PROJECTION.to_string(), &ple.projection));
        }
        for (i, layer) in self.layers.iter().enumerate() {
            for (module, linear) in layer.linears() {
                out.push((format!("model.layers.{i}.{module}"), linear));
            }
        }
        out.push((self.head_name().to_string(), &self.lm_head));
        out
    }

    /// As [`CausalLm::linears`], mutable: where adapters are attached.
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear)> {
        let head = self.head_name();
        let mut out = Vec::new();
        if let Some(ple) = &mut self.per_layer_embedding {
            out.push((PER_LAYER_PROJECTION.to_string(), &mut ple.projection));
        }
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for (module, linear) in layer.parts_mut().linears {
                out.push((format!("model.layers.{i}.{module}"), linear));
            }
        }
        out.push((head.to_string(), &mut self.lm_head));
        out
    }

    /// The context length at which the rotary embedding switches from its short to its long form
    /// (LongRoPE, Phi-3.5-MoE's mscales), if it does: generation recomputes its KV cache when a
    /// sequence first outgrows it, as transformers' Phi-3 and Phi-3.5-MoE do.
    pub fn rope_switch_length(&self) -> Option<usize> {
        self.rope.switch_length()
    }

    /// The HF module name of the output head: `lm_head`, or `score` for a sequence classifier
    /// (a reward or value model, [`ModelConfig::score_labels`]).
    pub fn head_name(&self) -> &'static str {
        if self.config.score_labels.is_some() {
            "score"
        } else {
            "lm_head"
        }
    }

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

    /// Makes every weight trainable (full fine-tuning) and returns the [`Var`]s under their HF
    /// names, in checkpoint order. With tied embeddings the output head shares the embedding's
    /// `Var`, so its gradient collects both uses, as in PyTorch.
    pub fn make_all_trainable(&mut self) -> CResult<Vec<(String, Var)>> {
        let var = make_var;
        let mut out = Vec::new();
        var(
            &mut self.embed_tokens,
            "model.embed_tokens.weight".into(),
            &mut out,
        )?;
        if let Some(ple) = &mut self.per_layer_embedding {
            var(&mut ple.table, PER_LAYER_TABLE.into(), &mut out)?;
            var(&mut ple.norm, PER_LAYER_NORM.into(), &mut out)?;
        }
        for (i, layer) in self.layers.iter_mut().enumerate() {
            for (name, norm) in layer.parts_mut().norms {
                var(norm, format!("model.layers.{i}.{name}"), &mut out)?;
            }
        }
        for (name, t) in self.final_norm_tensors_mut() {
            var(t, name, &mut out)?;
        }
        let tied = self.config.tie_word_embeddings;
        let embed = self.embed_tokens.clone();
        for (name, linear) in self.linears_mut() {
            // Dense weights change every step: a packed (GGUF block) copy would go stale.
            linear.packed = None;
            if name == "lm_head" && tied {
                // The weight is the embedding's Var; a bias is the head's own parameter.
                linear.weight = BaseWeight::Dense(embed.clone());
            } else {
                var(
                    linear.weight.as_dense_mut()?,
                    format!("{name}.weight"),
                    &mut out,
                )?;
            }
            if let Some(b) = &mut linear.bias {
                var(b, format!("{name}.bias"), &mut out)?;
            }
        }
        Ok(out)
    }

    /// A copy that shares every weight's storage but records no gradient: what the no-grad
    /// passes of a model in training run on (torch's `no_grad`). Without it every op on a
    /// trained weight keeps its inputs alive until its output is dropped, so a forward holds a
    /// training forward's activations and a KV cache a whole generation's. The optimizer updates
    /// weights in place, so the copy follows them.
    pub fn detached(&self) -> CausalLm {
        fn linear(l: &mut Linear) {
            if let BaseWeight::Dense(w) = &l.weight {
                l.weight = BaseWeight::Dense(w.detach());
            }
            l.bias = l.bias.as_ref().map(Tensor::detach);
            l.adapter = l.adapter.as_ref().map(LoraAdapter::detached);
        }
        let mut m = self.clone();
        m.embed_tokens = m.embed_tokens.detach();
        m.embed_adapter = m.embed_adapter.as_ref().map(LoraAdapter::detached);
        if let Some(ple) = &mut m.per_layer_embedding {
            ple.table = ple.table.detach();
            ple.norm = ple.norm.detach();
            linear(&mut ple.projection);
        }
        for layer in &mut m.layers {
            let parts = layer.parts_mut();
            for (_, norm) in parts.norms {
                *norm = norm.detach();
            }
            for (_, l) in parts.linears {
                linear(l);
            }
        }
        for (_, t) in m.final_norm_tensors_mut() {
            *t = t.detach();
        }
        linear(&mut m.lm_head);
        m
    }

    /// The final norm's tensors under their HF names (`model.norm.weight`; Phi-2's
    /// `model.final_layernorm.weight` and `.bias`).
    pub fn final_norm_tensors(&self) -> Vec<(String, &Tensor)> {
        let name = final_norm_name(&self.config);
        let mut out = vec![(format!("{name}.weight"), &self.norm)];
        if let Some(b) = &self.norm_bias {
            out.push((format!("{name}.bias"), b));
        }
        out
    }

    /// As [`CausalLm::final_norm_tensors`], mutable.
    pub fn final_norm_tensors_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        final_norm_entries_mut(&self.config, &mut self.norm, self.norm_bias.as_mut())
    }

    /// The compute dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The device the weights live on; for a dispatched model, the embedding's (where input ids
    /// belong).
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The placement and device list of a dispatched model ([`CausalLm::dispatch`]).
    pub fn placement(&self) -> Option<(&Placement, &[Device])> {
        self.spread
            .as_deref()
            .map(|s| (&s.placement, s.devices.as_slice()))
    }

    /// The device the logits come out on: the output head's.
    pub fn head_device(&self) -> &Device {
        match &self.spread {
            Some(s) => &s.devices[s.placement.head],
            None => &self.device,
        }
    }

    /// Spreads the model over `devices` (pipeline placement): the embedding, each decoder layer
    /// and the final norm + head move to the device `placement` names for them, and the forward
    /// pass carries the hidden states from device to device. LoRA adapters move with their layer;
    /// packed (GGUF block) copies are CPU-only kernels, so they are kept on CPU devices and dropped
    /// elsewhere (the dense weight serves there). A tied head gets its own copy when its device is
    /// not the embedding's. Meant for inference: training paths (`make_all_trainable`, adapters
    /// attached afterwards, [`CausalLm::layer`]) assume a single device. The model is unchanged
    /// when an error is returned.
    pub fn dispatch(
        &mut self,
        placement: &Placement,
        devices: &[Device],
    ) -> Result<(), ModelError> {
        if let Some(why) = self.layers_not_separable() {
            return Err(ModelError::Msg(format!(
                "cannot spread the model over devices: {why}"
            )));
        }
        if placement.layers.len() != self.layers.len() {
            return Err(ModelError::Msg(format!(
                "device placement covers {} layers, the model has {}",
                placement.layers.len(),
                self.layers.len()
            )));
        }
        if placement.devices_needed() > devices.len() {
            return Err(ModelError::Msg(format!(
                "device placement uses {} devices, {} given",
                placement.devices_needed(),
                devices.len()
            )));
        }
        fn move_linear(l: &Linear, device: &Device) -> CResult<Linear> {
            let mut out = l.clone();
            out.weight = l.weight.to_device(device)?;
            out.bias = l.bias.as_ref().map(|b| b.to_device(device)).transpose()?;
            if !device.is_cpu() {
                out.packed = None;
            }
            out.adapter = l
                .adapter
                .as_ref()
                .map(|a| a.to_device(device))
                .transpose()?;
            Ok(out)
        }
        let embed_device = &devices[placement.embed];
        let head_device = &devices[placement.head];
        let embed_tokens = self.embed_tokens.to_device(embed_device)?;
        let embed_adapter = self
            .embed_adapter
            .as_ref()
            .map(|a| a.to_device(embed_device))
            .transpose()?;
        let mut layers = Vec::with_capacity(self.layers.len());
        for (layer, &d) in self.layers.iter().zip(&placement.layers) {
            let dev = &devices[d];
            let mut moved = layer.clone();
            let parts = moved.parts_mut();
            for (_, norm) in parts.norms {
                *norm = norm.to_device(dev)?;
            }
            for (_, linear) in parts.linears {
                *linear = move_linear(linear, dev)?;
            }
            layers.push(moved);
        }
        let norm = self.norm.to_device(head_device)?;
        let norm_bias = self
            .norm_bias
            .as_ref()
            .map(|b| b.to_device(head_device))
            .transpose()?;
        let mut lm_head = move_linear(&self.lm_head, head_device)?;
        if self.config.tie_word_embeddings && placement.head == placement.embed {
            // Same device: share the embedding's storage instead of holding it twice.
            lm_head.weight = BaseWeight::Dense(embed_tokens.clone());
        }
        self.embed_tokens = embed_tokens;
        self.embed_adapter = embed_adapter;
        self.layers = layers;
        self.norm = norm;
        self.norm_bias = norm_bias;
        self.lm_head = lm_head;
        self.device = embed_device.clone();
        self.spread = Some(Arc::new(DeviceSpread {
            placement: placement.clone(),
            devices: devices.to_vec(),
        }));
        Ok(())
    }

    /// Runs the decoder over `input_ids` (`[batch, seq]`, u32) and returns the final hidden states
    /// `[batch, seq, hidden]`. With a cache, keys/values of these tokens are appended to it.
    pub fn forward_hidden(
        &self,
        input_ids: &Tensor,
        layout: &AttentionLayout,
        mut cache: Option<&mut KvCache>,
    ) -> CResult<Tensor> {
        if let Some(c) = cache.as_deref_mut() {
            if self.decode_kernels_serve(input_ids, layout, c) {
                match self.decode_step_checked(input_ids, layout, c) {
                    Ok(hidden) => return Ok(hidden),
                    Err(e) => {
                        // The step commits its position only at the end, so the cache still
                        // holds exactly the earlier positions: the forward can take this step.
                        tracing::warn!(
                            "the decode kernels failed ({e}); decoding goes on with the forward's ops"
                        );
                        ferrotune_core::decode::set_enabled(false);
                    }
                }
            }
            c.make_exact()?;
        }
        if let Some(spread) = &self.spread {
            return self.forward_hidden_spread(spread, input_ids, layout, cache);
        }
        let mut x = self.embed(input_ids)?;
        let mut across = AcrossLayers {
            per_layer_inputs: self.per_layer_inputs(input_ids, &x)?,
            ..AcrossLayers::default()
        };
        let inputs = self.layer_inputs(layout)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let layer_cache = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            x = self.layer_forward(i, layer, &x, &inputs, layer_cache, &mut across)?;
        }
        self.final_norm(&x)
    }

    /// Why this model's layers cannot run one at a time ([`CausalLm::layer`]: activation
    /// checkpointing, sharded training, early exits, layer dropout, a model spread over devices),
    /// when they cannot: Gemma 4's layers read the per-layer embeddings or an earlier layer's
    /// keys and values.
    pub fn layers_not_separable(&self) -> Option<String> {
        let g = self.config.gemma4.as_ref()?;
        let what = match (
            g.per_layer_input.is_some(),
            g.kv_source.iter().any(Option::is_some),
        ) {
            (false, false) => return None,
            (true, false) => "per-layer embeddings (hidden_size_per_layer_input)",
            (false, true) => "keys and values shared across layers (num_kv_shared_layers)",
            (true, true) => "per-layer embeddings and keys and values shared across layers",
        };
        Some(format!(
            "this Gemma 4 model's layers do not run one at a time: they read {what}"
        ))
    }

    /// Gemma 4's per-layer inputs `[b, t, layers, per_layer_dim]` from the input ids and their
    /// (scaled) embeddings `embeds`, as transformers makes them: `(norm(projection(embeds) ·
    /// hidden^-½) + table[ids] · √per_layer_dim) · 2^-½`.
    fn per_layer_inputs(&self, input_ids: &Tensor, embeds: &Tensor) -> CResult<Option<Tensor>> {
        let Some(ple) = &self.per_layer_embedding else {
            return Ok(None);
        };
        let c = &self.config;
        let (b, t) = input_ids.dims2()?;
        let dim = ple.norm.dim(0)?;
        let shape = (b, t, c.num_hidden_layers, dim);
        let projected = (ple.projection.forward(embeds)? * (c.hidden_size as f64).powf(-0.5))?
            .reshape(shape)?;
        let projected = self.norm(&projected, &ple.norm, None)?;
        let looked_up = embedding_rows(&ple.table, &input_ids.flatten_all()?, c.pad_token_id)?
            .reshape(shape)?
            .broadcast_mul(&self.embedding_scale(dim)?)?;
        ((projected + looked_up)? * 0.5f64.sqrt()).map(Some)
    }

    /// [`CausalLm::forward_hidden`] of a dispatched model: the hidden states follow the layers
    /// from device to device, and each device gets its own rotary tables and masks, made when the
    /// first layer there runs. Cache entries stay with their layer's device.
    fn forward_hidden_spread(
        &self,
        spread: &DeviceSpread,
        input_ids: &Tensor,
        layout: &AttentionLayout,
        mut cache: Option<&mut KvCache>,
    ) -> CResult<Tensor> {
        let (placement, devices) = (&spread.placement, &spread.devices);
        let mut at = placement.embed;
        let mut x = self.embed(&input_ids.to_device(&devices[at])?)?;
        // `dispatch` refuses models whose layers depend on one another (Gemma 4's).
        let mut across = AcrossLayers::default();
        let mut per_device: Vec<Option<LayerInputs>> = vec![None; devices.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            let d = placement.layers[i];
            if d != at {
                x = x.to_device(&devices[d])?;
                at = d;
            }
            if per_device[d].is_none() {
                let built = match per_device.iter().flatten().next() {
                    Some(first) => first.to_device(&devices[d])?,
                    None => self.layer_inputs_on(layout, &devices[d])?,
                };
                per_device[d] = Some(built);
            }
            let inputs = per_device[d].as_ref().expect("built above");
            let layer_cache = cache.as_deref_mut().map(|c| &mut c.layers[i]);
            x = self.layer_forward(i, layer, &x, inputs, layer_cache, &mut across)?;
        }
        if placement.head != at {
            x = x.to_device(&devices[placement.head])?;
        }
        self.final_norm(&x)
    }

    /// Token embeddings `[batch, seq, hidden]` of `input_ids` (`[batch, seq]`, u32), scaled where
    /// the family does so (Gemma).
    ///
    /// When the embedding trains, the rows of `pad_token_id` pass no gradient to it: transformers
    /// builds every family's embedding with `padding_idx = pad_token_id`, so where the pad token
    /// is also a real input (SmolLM2's and Qwen's pad is their end-of-turn or end-of-text token)
    /// its row stays as loaded, as under HF's Trainer. A tied output head still trains that row.
    pub fn embed(&self, input_ids: &Tensor) -> CResult<Tensor> {
        let (batch, seq) = input_ids.dims2()?;
        let flat = input_ids.flatten_all()?;
        let mut x = embedding_rows(&self.embed_tokens, &flat, self.config.pad_token_id)?;
        if let Some(adapter) = &self.embed_adapter {
            let pad = self
                .config
                .pad_token_id
                .filter(|&p| (p as usize) < self.config.vocab_size);
            x = adapter.embedding_forward(&flat, &x, &self.embed_tokens, pad)?;
        }
        let x = x.reshape((batch, seq, self.config.hidden_size))?;
        if self.config.scale_embeddings {
            return x.broadcast_mul(&self.embedding_scale(self.config.hidden_size)?);
        }
        Ok(x)
    }

    /// Gemma's embedding scale `√width` as a tensor of the compute dtype: transformers builds it
    /// as a tensor of the hidden dtype, so it is rounded the same way.
    fn embedding_scale(&self, width: usize) -> CResult<Tensor> {
        Tensor::new((width as f32).sqrt(), &self.device)?.to_dtype(self.dtype)
    }

    /// What every layer of one forward call shares: rotary tables and attention masks.
    pub fn layer_inputs(&self, layout: &AttentionLayout) -> CResult<LayerInputs> {
        self.layer_inputs_on(layout, &self.device)
    }

    /// [`CausalLm::layer_inputs`] built on `device`.
    fn layer_inputs_on(&self, layout: &AttentionLayout, device: &Device) -> CResult<LayerInputs> {
        let location = device.location();
        let mut cache = self.inputs_cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((l, d, inputs)) = cache.as_ref() {
            if *d == location && l == layout && inputs.cos.dtype() == self.dtype {
                return Ok(inputs.clone());
            }
        }
        let inputs = self.build_layer_inputs(layout, device)?;
        *cache = Some((layout.clone(), location, inputs.clone()));
        Ok(inputs)
    }

    fn build_layer_inputs(
        &self,
        layout: &AttentionLayout,
        device: &Device,
    ) -> CResult<LayerInputs> {
        let (cos, sin) = self.rope.cos_sin(&layout.positions, self.dtype, device)?;
        let local_cos_sin = self
            .local_rope
            .as_ref()
            .map(|r| r.cos_sin(&layout.positions, self.dtype, device))
            .transpose()?;
        let full_mask = layout.additive_mask(None, None, self.dtype, device)?;
        let mut limited_masks: Vec<(MaskLimits, Option<Tensor>)> = Vec::new();
        for layer in &self.layers {
            let limits = (layer.sliding_window, layer.attention_chunk);
            if limits != (None, None) && !limited_masks.iter().any(|(l, _)| *l == limits) {
                let mask = layout.additive_mask(limits.0, limits.1, self.dtype, device)?;
                limited_masks.push((limits, mask));
            }
        }
        // The query temperatures' shape, `[b, 1, t, 1]`.
        let (b, t) = (
            layout.positions.len(),
            layout.positions.first().map_or(0, Vec::len),
        );
        let nope_q_scale = match self.config.nope_attn_temperature {
            Some((attn_scale, floor_scale)) => {
                nope_query_temperature(&layout.positions, attn_scale, floor_scale)
                    .map(|values| Tensor::from_vec(values, (b, 1, t, 1), device))
                    .transpose()?
            }
            None => None,
        };
        let q_scale = match self.config.llama4_attn_scale {
            Some((beta, original)) => llama4_query_scale(&layout.positions, beta, original)
                .map(|values| Tensor::from_vec(values, (b, 1, t, 1), device)?.to_dtype(self.dtype))
                .transpose()?,
            None => None,
        };
        Ok(LayerInputs {
            cos,
            sin,
            local_cos_sin,
            q_scale,
            nope_q_scale,
            full_mask,
            limited_masks,
        })
    }

    /// Starts recording every sparse layer's routing (see [`RouterRecord`]) until
    /// [`CausalLm::take_router_records`].
    pub fn record_routers(&self) {
        *self.router_tape.lock().unwrap_or_else(|e| e.into_inner()) = Some(Vec::new());
    }

    /// The routing recorded since [`CausalLm::record_routers`], which stops recording.
    pub fn take_router_records(&self) -> Vec<RouterRecord> {
        self.router_tape
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default()
    }

    /// Decoder layer `index` on hidden states `x` (no cache): the unit activation checkpointing
    /// recomputes.
    pub fn layer(&self, index: usize, x: &Tensor, inputs: &LayerInputs) -> CResult<Tensor> {
        if let Some(why) = self.layers_not_separable() {
            candle_core::bail!("{why}");
        }
        let layer = &self.layers[index];
        self.layer_forward(index, layer, x, inputs, None, &mut AcrossLayers::default())
    }

    /// The final norm.
    pub fn final_norm(&self, x: &Tensor) -> CResult<Tensor> {
        self.norm(x, &self.norm, self.norm_bias.as_ref())
    }

    /// The family's norm of `x` with weight `w`: RMSNorm (Gemma's with `1 + w`), or Phi-2's
    /// LayerNorm with bias `b`.
    fn norm(&self, x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> CResult<Tensor> {
        let c = &self.config;
        if c.layer_norm {
            return ops::layer_norm(x, w, b, c.rms_norm_eps);
        }
        fused::rms_norm(x, w, c.rms_norm_eps, c.norm_weight_offset_one)
    }

    /// Logits `[batch, seq, vocab]` (compute dtype) from hidden states, on
    /// [`CausalLm::head_device`]; softcapped where the family does so (Gemma 2).
    pub fn logits(&self, hidden: &Tensor) -> CResult<Tensor> {
        let logits = match &self.spread {
            // Hidden states from `forward_hidden` are there already; this only moves others.
            Some(s) => self
                .lm_head
                .forward(&hidden.to_device(&s.devices[s.placement.head])?),
            None => self.lm_head.forward(hidden),
        }?;
        match self.config.final_logit_softcapping {
            // transformers' sequence classifiers score the hidden states without the softcap.
            Some(cap) if self.config.score_labels.is_none() => ops::softcap(&logits, cap),
            _ => Ok(logits),
        }
    }

    /// Full forward: logits for every position.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        layout: &AttentionLayout,
        cache: Option<&mut KvCache>,
    ) -> CResult<Tensor> {
        let hidden = self.forward_hidden(input_ids, layout, cache)?;
        self.logits(&hidden)
    }

    fn layer_forward(
        &self,
        index: usize,
        layer: &DecoderLayer,
        x: &Tensor,
        inputs: &LayerInputs,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
        across: &mut AcrossLayers,
    ) -> CResult<Tensor> {
        let (cos, sin) = inputs.cos_sin(layer);
        let mask = inputs.mask(layer);
        let norm = |t: &Tensor, w: &Tensor| self.norm(t, w, None);
        let normed = self.norm(
            x,
            &layer.input_layernorm,
            layer.input_layernorm_bias.as_ref(),
        )?;
        let rope = layer.use_rope.then_some((cos, sin));
        let q_scale = match &inputs.nope_q_scale {
            Some(s) if !layer.use_rope => QueryScale::F32(s),
            _ => match &inputs.q_scale {
                Some(s) => QueryScale::Compute(s),
                None => QueryScale::None,
            },
        };
        let shared = match layer.self_attn.kv_source {
            Some(source) => Some(across.kv.get(&source).ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "layer {index} reuses the keys and values of layer {source}, which has not run"
                ))
            })?),
            None => None,
        };
        let (h, kv) = self.attention(
            &layer.self_attn,
            &normed,
            rope,
            q_scale,
            mask,
            cache,
            shared,
        )?;
        if self.kv_is_shared(index) {
            across.kv.insert(index, kv);
        }
        let x = match (
            &layer.post_attention_layernorm,
            &layer.pre_feedforward_layernorm,
            &layer.post_feedforward_layernorm,
        ) {
            // Gemma 2/3: every block's output is normalized before its residual add.
            (Some(post_attn), Some(pre_ff), Some(post_ff)) => {
                let x = (x + norm(&h, post_attn)?)?;
                let h = self.feed_forward(&layer.mlp, &norm(&x, pre_ff)?)?;
                let h = match &layer.parallel_moe {
                    Some(block) => {
                        (norm(&h, &block.post_norm_mlp)? + self.parallel_moe(block, &x)?)?
                    }
                    None => h,
                };
                x + norm(&h, post_ff)?
            }
            (Some(post_attn), _, _) => {
                let x = (x + h)?;
                let bias = layer.post_attention_layernorm_bias.as_ref();
                let h = self.feed_forward(&layer.mlp, &self.norm(&x, post_attn, bias)?)?;
                x + h
            }
            // Phi-2: attention and MLP side by side on the same normed input.
            (None, _, _) => {
                let m = self.feed_forward(&layer.mlp, &normed)?;
                (h + m)? + x
            }
        }?;
        let x = match (&layer.per_layer_input, &across.per_layer_inputs) {
            (Some(block), Some(inputs)) => {
                let own = inputs.narrow(2, index, 1)?.squeeze(2)?;
                let gated = self.activation(&block.gate.forward(&x)?)?;
                let h = block.projection.forward(&gated.broadcast_mul(&own)?)?;
                (&x + self.norm(&h, &block.norm, None)?)?
            }
            _ => x,
        };
        match &layer.layer_scalar {
            Some(s) => x.broadcast_mul(s),
            None => Ok(x),
        }
    }

    /// Whether a later layer attends with layer `index`'s keys and values (Gemma 4).
    fn kv_is_shared(&self, index: usize) -> bool {
        self.config
            .gemma4
            .as_ref()
            .is_some_and(|g| g.kv_source.contains(&Some(index)))
    }

    /// The MLP's activation function alone (Phi-2's ungated MLP, Gemma 4's per-layer input gate).
    fn activation(&self, x: &Tensor) -> CResult<Tensor> {
        match self.config.activation {
            Activation::Silu => x.silu(),
            Activation::GeluTanh => x.gelu(),
            Activation::GeluErf => x.gelu_erf(),
        }
    }

    /// Self-attention of one layer; `rope` is `None` for a NoPE layer, `q_scale` the per-position
    /// query temperature (Ministral 3's, Llama 4's NoPE layers'); `shared` the keys and values a
    /// Gemma 4 KV-sharing layer attends with. Returns the output and the keys and values it
    /// attended with (`[b, kv_heads, past + t, head_dim]`, after the cache).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        attn: &Attention,
        x: &Tensor,
        rope: Option<(&Tensor, &Tensor)>,
        q_scale: QueryScale,
        mask: Option<&Tensor>,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
        shared: Option<&(Tensor, Tensor)>,
    ) -> CResult<(Tensor, (Tensor, Tensor))> {
        let c = &self.config;
        let (b, t, _) = x.dims3()?;
        let (nh, nkv, hd) = attn.dims;
        let (q, kv) = match &attn.qkv {
            QkvProjection::Separate {
                q_proj,
                k_proj,
                v_proj,
            } => (
                q_proj.forward(x)?,
                Some((k_proj.forward(x)?, v_proj.forward(x)?)),
            ),
            QkvProjection::Fused { qkv_proj } => {
                let qkv = qkv_proj.forward(x)?;
                (
                    qkv.narrow(D::Minus1, 0, nh * hd)?,
                    Some((
                        qkv.narrow(D::Minus1, nh * hd, nkv * hd)?,
                        qkv.narrow(D::Minus1, (nh + nkv) * hd, nkv * hd)?,
                    )),
                )
            }
            // The values are the keys' projection before the key norm and RoPE.
            QkvProjection::KeyIsValue { q_proj, k_proj } => {
                let k = k_proj.forward(x)?;
                (q_proj.forward(x)?, Some((k.clone(), k)))
            }
            QkvProjection::QueryOnly { q_proj } => (q_proj.forward(x)?, None),
        };
        let mut q = q.reshape((b, t, nh, hd))?;
        if let Some(qn) = &attn.q_norm {
            q = fused::rms_norm(&q, qn, c.rms_norm_eps, c.norm_weight_offset_one)?;
        }
        if rope.is_some() && c.rope_interleaved {
            // Meta's rotary pairs are adjacent elements; gathered into transformers' halves (the
            // same reordering of every query and key head leaves their dot products as they
            // are), the half-split kernels rotate them.
            q = pairs_to_halves(&q)?;
        }
        // The kernels take the transposed views as they are (RoPE on the GPU reads them in place;
        // the CPU kernels copy them), so no contiguous copy is kept in the graph here.
        let rotate = |t: &Tensor| match rope {
            Some((cos, sin)) => fused::rope(&t.transpose(1, 2)?, cos, sin),
            None => t.transpose(1, 2)?.contiguous(),
        };
        let mut q = rotate(&q)?;
        // A weightless RMSNorm of each head: Llama 4's of queries and keys after RoPE, Gemma 4's
        // of values.
        let weightless_norm = |t: &Tensor| weightless_rms_norm(t, c.rms_norm_eps);
        let l2_norm = rope.is_some() && c.rope_layer_qk_l2_norm;
        if l2_norm {
            q = weightless_norm(&q)?;
        }
        let new_kv = match kv {
            Some((k, v)) => {
                let mut k = k.reshape((b, t, nkv, hd))?;
                if let Some(kn) = &attn.k_norm {
                    k = fused::rms_norm(&k, kn, c.rms_norm_eps, c.norm_weight_offset_one)?;
                }
                if rope.is_some() && c.rope_interleaved {
                    k = pairs_to_halves(&k)?;
                }
                let mut k = rotate(&k)?;
                if l2_norm {
                    k = weightless_norm(&k)?;
                }
                let mut v = v.reshape((b, t, nkv, hd))?;
                if attn.v_norm {
                    v = weightless_norm(&v)?;
                }
                Some((k, v.transpose(1, 2)?))
            }
            None => None,
        };
        let q = match q_scale {
            QueryScale::Compute(s) => q.broadcast_mul(s)?,
            // transformers multiplies the f32 factors into the queries in f32.
            QueryScale::F32(s) => q
                .to_dtype(DType::F32)?
                .broadcast_mul(s)?
                .to_dtype(q.dtype())?,
            QueryScale::None => q,
        };
        let (k, v) = match (new_kv, shared) {
            (Some((mut k, mut v)), _) => {
                if let Some(slot) = cache {
                    if let Some((pk, pv)) = slot.as_ref() {
                        k = Tensor::cat(&[pk, &k], 2)?;
                        v = Tensor::cat(&[pv, &v], 2)?;
                    }
                    *slot = Some((k.clone(), v.clone()));
                }
                (k, v)
            }
            // A KV-sharing layer caches nothing: its source's entry holds every position.
            (None, Some((k, v))) => (k.clone(), v.clone()),
            (None, None) => {
                candle_core::bail!("a layer without key/value projections has no keys to attend to")
            }
        };
        let scale = self.attention_scale();
        // softmax(softcap(q kᵀ · scale) + mask) v with grouped-query heads, one fused op with its
        // own backward on the CPU (f32); the composite candle ops elsewhere.
        let softcap = c.attn_logit_softcapping;
        let out = fused::attention_softcapped(&q, &k, &v, mask, scale, softcap)?; // [b, nh, t, hd]
        let out = out.transpose(1, 2)?.reshape((b, t, nh * hd))?;
        Ok((attn.o_proj.forward(&out)?, (k, v)))
    }

    /// The factor on attention scores: `head_dim^-0.5`, or `query_pre_attn_scalar^-0.5` (Gemma 2/3).
    fn attention_scale(&self) -> f64 {
        self.config
            .query_pre_attn_scalar
            .unwrap_or(self.config.head_dim as f64)
            .powf(-0.5)
    }

    /// The MLP's gated activation as the fused kernels name it.
    fn gated_act(&self) -> fused::GatedAct {
        match self.config.activation {
            Activation::Silu => fused::GatedAct::Silu,
            Activation::GeluTanh => fused::GatedAct::GeluTanh,
            Activation::GeluErf => fused::GatedAct::GeluErf,
        }
    }

    fn feed_forward(&self, ffn: &FeedForward, x: &Tensor) -> CResult<Tensor> {
        match ffn {
            FeedForward::Dense(mlp) => self.mlp(mlp, x),
            FeedForward::Sparse(moe) => self.moe(moe, x),
        }
    }

    /// A mixture-of-experts block on `x` (`[b, t, hidden]`), as transformers computes it: router
    /// logits, softmax in f32, the top-k experts per token (renormalized with
    /// `norm_topk_prob`), each expert on its tokens, outputs scaled by their weights and summed in
    /// expert order; plus Qwen2-MoE's gated shared expert. The routing weights stay
    /// differentiable (the router trains); the choice of experts is made on the host.
    fn moe(&self, moe: &Moe, x: &Tensor) -> CResult<Tensor> {
        let (b, t, h) = x.dims3()?;
        let n = b * t;
        let flat = x.reshape((n, h))?;
        let logits = moe.router.forward(&flat)?;
        if moe.sigmoid_input_routing {
            return self.sigmoid_routed_moe(moe, x, &flat, &logits);
        }
        let k = moe.top_k;
        let recording = self
            .router_tape
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some();
        // The softmax's top-k experts of each token: its route with softmax routing, and what
        // the router's auxiliary loss counts whatever the routing (the sparsemixer needs them for
        // that loss only).
        let softmax_top_k = if moe.sparse_mixer.is_none() || recording {
            let probs = ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
            let host: Vec<Vec<f32>> = probs.detach().to_vec2()?;
            let selected = top_k_experts(&host, k);
            if let Some(tape) = self
                .router_tape
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_mut()
            {
                tape.push(RouterRecord {
                    probs: probs.clone(),
                    selected: selected.clone(),
                    host_probs: host.concat(),
                });
            }
            Some((probs, selected))
        } else {
            None
        };
        // Each token's experts (`slots` per token) and their weights `[n, slots]`.
        let (route, top) = match (&moe.sparse_mixer, softmax_top_k) {
            (Some(mixer), _) => sparse_mixer_route(&logits, mixer)?,
            (None, top_k) => {
                let (probs, selected) = top_k.expect("computed for softmax routing");
                let top = gather_routes(&probs, &selected)?;
                let top = if moe.norm_topk_prob {
                    top.broadcast_div(&top.sum_keepdim(1)?)?
                } else {
                    top
                };
                (selected, top)
            }
        };
        let mut out = self.run_experts(moe, &flat, &route, &top)?;
        if let Some((shared, gate)) = &moe.shared_expert {
            let s = self.mlp(shared, x)?.reshape((n, h))?;
            out = match gate {
                // sigmoid(g) = 1 / (1 + e^−g), from differentiable ops.
                Some(gate) => {
                    let g = (gate.forward(&flat)?.neg()?.exp()? + 1.0)?.recip()?;
                    (out + s.broadcast_mul(&g)?)?
                }
                None => (out + s)?,
            };
        }
        out.reshape((b, t, h))
    }

    /// The experts of `moe` on the rows `flat` (`[n, hidden]`) they are routed to (`route`, the
    /// same number of experts per token, in order), each output scaled by its weight in `top`
    /// (`[n, slots]`) and summed in expert order, as transformers does.
    fn run_experts(
        &self,
        moe: &Moe,
        flat: &Tensor,
        route: &[u32],
        top: &Tensor,
    ) -> CResult<Tensor> {
        let device = flat.device();
        let slots = route.len() / flat.dim(0)?.max(1);
        // Per expert, the tokens routed to it and where their weight sits in the `[n, slots]`
        // table, tokens in order.
        let mut routed: Vec<(Vec<u32>, Vec<u32>)> =
            vec![(Vec::new(), Vec::new()); moe.experts.len()];
        for (i, &e) in route.iter().enumerate() {
            routed[e as usize].0.push((i / slots) as u32);
            routed[e as usize].1.push(i as u32);
        }
        let weight_dtype = if moe.f32_routing_weights {
            DType::F32
        } else {
            self.dtype
        };
        let weights = top.to_dtype(weight_dtype)?.flatten_all()?;
        let mut out = flat.zeros_like()?;
        for (expert, (tokens, slots)) in moe.experts.iter().zip(routed) {
            if tokens.is_empty() {
                continue;
            }
            let m = tokens.len();
            let tokens = Tensor::new(tokens, device)?;
            let rows = flat.index_select(&tokens, 0)?.unsqueeze(0)?;
            let y = self.mlp(expert, &rows)?.squeeze(0)?;
            let w = weights
                .index_select(&Tensor::new(slots, device)?, 0)?
                .reshape((m, 1))?;
            let y = y
                .to_dtype(weight_dtype)?
                .broadcast_mul(&w)?
                .to_dtype(self.dtype)?;
            out = out.index_add(&tokens, &y, 0)?;
        }
        Ok(out)
    }

    /// Gemma 4's mixture of experts ([`ParallelMoe`]) on the MLP's residual input `x`
    /// (`[b, t, hidden]`): `post_feedforward_layernorm_2` of the experts' output. No load-balancing
    /// loss (the router is not recorded): `Gemma4ForCausalLM` adds none.
    fn parallel_moe(&self, block: &ParallelMoe, x: &Tensor) -> CResult<Tensor> {
        let (b, t, h) = x.dims3()?;
        let flat = x.reshape((b * t, h))?;
        // transformers multiplies by the scale in the compute dtype, then by 1/√hidden as a
        // Python float (in f32, rounded once).
        let scaled = weightless_rms_norm(&flat, self.config.rms_norm_eps)?
            .broadcast_mul(&block.router_scale)?;
        let scaled =
            (scaled.to_dtype(DType::F32)? * (h as f64).powf(-0.5))?.to_dtype(flat.dtype())?;
        let logits = block.moe.router.forward(&scaled)?;
        let probs = ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
        let route = top_k_experts(&probs.detach().to_vec2()?, block.moe.top_k);
        let top = gather_routes(&probs, &route)?;
        let top = top.broadcast_div(&top.sum_keepdim(1)?)?;
        let scale = block
            .per_expert_scale
            .to_dtype(DType::F32)?
            .index_select(&Tensor::new(route.as_slice(), x.device())?, 0)?
            .reshape(top.shape())?;
        let experts_in = self.norm(&flat, &block.pre_norm, None)?;
        let out = self.run_experts(&block.moe, &experts_in, &route, &(top * scale)?)?;
        self.norm(&out, &block.post_norm_experts, None)?
            .reshape((b, t, h))
    }

    /// Llama 4's mixture of experts on `x` (`[b, t, hidden]`, `flat` its `[n, hidden]` rows) from
    /// the router's `logits`: each token's top-k logits (ties to the lower expert, as
    /// `torch.topk`), each through a sigmoid in f32, cast back and multiplied into the *input* of
    /// its expert; the experts' outputs summed, plus the shared expert's. transformers runs every
    /// expert on every token, with zero inputs where an expert is not chosen, which give exactly
    /// zero (no biases): only the chosen ones are computed here. No load-balancing loss (the
    /// router is not recorded): `Llama4ForCausalLM` adds none.
    fn sigmoid_routed_moe(
        &self,
        moe: &Moe,
        x: &Tensor,
        flat: &Tensor,
        logits: &Tensor,
    ) -> CResult<Tensor> {
        let (b, t, h) = x.dims3()?;
        let n = b * t;
        let (experts, k) = (moe.experts.len(), moe.top_k);
        let device = x.device();
        let host: Vec<Vec<f32>> = logits.detach().to_dtype(DType::F32)?.to_vec2()?;
        let mut order: Vec<usize> = (0..experts).collect();
        // Per expert, its tokens and their places in the flattened `[n, experts]` logits.
        let mut routed: Vec<(Vec<u32>, Vec<u32>)> = vec![(Vec::new(), Vec::new()); experts];
        for (i, row) in host.iter().enumerate() {
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for &e in &order[..k] {
                routed[e].0.push(i as u32);
                routed[e].1.push((i * experts + e) as u32);
            }
        }
        let flat_logits = logits.flatten_all()?;
        let mut out = flat.zeros_like()?;
        for (expert, (tokens, places)) in moe.experts.iter().zip(routed) {
            if tokens.is_empty() {
                continue;
            }
            let m = tokens.len();
            let tokens = Tensor::new(tokens, device)?;
            let score = flat_logits
                .index_select(&Tensor::new(places, device)?, 0)?
                .to_dtype(DType::F32)?;
            // sigmoid(s) = 1 / (1 + e^−s), from differentiable ops.
            let score = (score.neg()?.exp()? + 1.0)?
                .recip()?
                .to_dtype(self.dtype)?
                .reshape((m, 1))?;
            let rows = flat.index_select(&tokens, 0)?.broadcast_mul(&score)?;
            let y = self.mlp(expert, &rows.unsqueeze(0)?)?.squeeze(0)?;
            out = out.index_add(&tokens, &y, 0)?;
        }
        if let Some((shared, _)) = &moe.shared_expert {
            let s = self.mlp(shared, x)?.reshape((n, h))?;
            out = (s + out)?;
        }
        out.reshape((b, t, h))
    }

    fn mlp(&self, mlp: &Mlp, x: &Tensor) -> CResult<Tensor> {
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

/// The rows of embedding `table` for the token ids `flat`; when the table is trained, the rows of
/// the padding token get no gradient (PyTorch's `padding_idx`).
fn embedding_rows(table: &Tensor, flat: &Tensor, pad: Option<u32>) -> CResult<Tensor> {
    let rows = table.index_select(flat, 0)?;
    match pad.filter(|&p| (p as usize) < table.dim(0).unwrap_or(0) && table.track_op()) {
        Some(pad) => {
            let is_pad = flat.eq(pad)?.unsqueeze(1)?.broadcast_as(rows.shape())?;
            is_pad.where_cond(&rows.detach(), &rows)
        }
        None => Ok(rows),
    }
}

/// Makes `t` a trainable parameter in place (a `Var` holding its values, which the model then
/// uses) and lists it in `out` as `name`.
pub(crate) fn make_var(t: &mut Tensor, name: String, out: &mut Vec<(String, Var)>) -> CResult<()> {
    let v = Var::from_tensor(&t.detach())?;
    *t = v.as_tensor().clone();
    out.push((name, v));
    Ok(())
}

/// RMSNorm without a weight over the last dimension (Gemma 4's v norm and router norm, Llama 4's
/// L2 q/k norm).
fn weightless_rms_norm(t: &Tensor, eps: f64) -> CResult<Tensor> {
    let ones = Tensor::ones(t.dim(D::Minus1)?, t.dtype(), t.device())?;
    fused::rms_norm(t, &ones, eps, false)
}

/// Each token's `k` experts from its routing probabilities (`probs[token][expert]`), largest
/// first; equal probabilities keep the lower expert first, as `torch.topk`.
fn top_k_experts(probs: &[Vec<f32>], k: usize) -> Vec<u32> {
    let mut selected = Vec::with_capacity(probs.len() * k);
    let mut order: Vec<usize> = (0..probs.first().map_or(0, Vec::len)).collect();
    for p in probs {
        order.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
        selected.extend(order[..k].iter().map(|&e| e as u32));
    }
    selected
}

/// The probabilities (`[n, experts]`) of each token's `selected` experts (the same number per
/// token, in order) as `[n, k]`, differentiable.
fn gather_routes(probs: &Tensor, selected: &[u32]) -> CResult<Tensor> {
    let (n, experts) = probs.dims2()?;
    let k = selected.len() / n.max(1);
    let picked: Vec<u32> = selected
        .iter()
        .enumerate()
        .map(|(i, &e)| ((i / k) * experts) as u32 + e)
        .collect();
    probs
        .flatten_all()?
        .index_select(&Tensor::new(picked, probs.device())?, 0)?
        .reshape((n, k))
}

/// Phi-3.5-MoE's sparsemixer as transformers runs it in evaluation ([`SparseMixer`]): each
/// token's two experts (`[n * 2]`, first then second) and their weights `[n, 2]`, differentiable
/// through the router's `logits` (`[n, experts]`). The choices and masks are made on the host; a
/// weight is the softmax of the logits left unmasked, taken at its expert.
fn sparse_mixer_route(logits: &Tensor, mixer: &SparseMixer) -> CResult<(Vec<u32>, Tensor)> {
    let (n, experts) = logits.dims2()?;
    let host: Vec<Vec<f32>> = logits.detach().to_dtype(DType::F32)?.to_vec2()?;
    let threshold = (2.0 * mixer.jitter_eps) as f32;
    // The first largest logit (torch.max), skipping `skip`.
    let argmax = |s: &[f32], skip: Option<usize>| {
        let mut best: Option<usize> = None;
        for (e, &v) in s.iter().enumerate() {
            if Some(e) != skip && best.is_none_or(|b| v > s[b]) {
                best = Some(e);
            }
        }
        best.unwrap_or(0)
    };
    let mut masks = vec![0f32; n * 2 * experts];
    let mut route = Vec::with_capacity(n * 2);
    let mut picked = Vec::with_capacity(n * 2);
    for (row, s) in host.iter().enumerate() {
        let first = argmax(s, None);
        let second = argmax(s, Some(first));
        for (slot, (chosen, excluded)) in [(first, None), (second, Some(first))]
            .into_iter()
            .enumerate()
        {
            let top = s[chosen];
            let at = (row * 2 + slot) * experts;
            for (e, &v) in s.iter().enumerate() {
                // transformers: (top − v) / max(|v|, top) > 2·eps masks the logit.
                if Some(e) == excluded || (top - v) / v.abs().max(top) > threshold {
                    masks[at + e] = f32::NEG_INFINITY;
                }
            }
            route.push(chosen as u32);
            picked.push((at + chosen) as u32);
        }
    }
    let device = logits.device();
    let masks = Tensor::from_vec(masks, (n, 2, experts), device)?;
    let logits = logits.to_dtype(DType::F32)?.unsqueeze(1)?;
    let gates = ops::softmax_last_dim(&logits.broadcast_add(&masks)?)?;
    let top = gates
        .flatten_all()?
        .index_select(&Tensor::new(picked, device)?, 0)?
        .reshape((n, 2))?;
    Ok((route, top))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sparsemixer against transformers 5.23's `sparsemixer(scores, 0.1, training=False)` on
    /// logits with negative maxima, near ties, exact ties (the lower expert first) and zeros.
    #[test]
    fn sparse_mixer_routes_as_transformers() {
        let rows = [
            [1.0f32, 0.5, 0.9, -2.0],
            [-1.0, -1.2, -3.0, -1.05],
            [0.3, 0.3, 0.1, 0.29],
            [0.0, 0.0, -0.5, 0.2],
            [2.0, -2.0, 1.0, 1.5],
        ];
        let logits = Tensor::from_vec(rows.concat(), (5, 4), &Device::Cpu).unwrap();
        let (route, weights) =
            sparse_mixer_route(&logits, &SparseMixer { jitter_eps: 0.1 }).unwrap();
        assert_eq!(route, [0, 2, 0, 3, 0, 1, 3, 0, 0, 3]);
        let want = [
            0.5249792f32,
            1.0,
            0.36101604,
            0.53742987,
            0.3344426,
            0.5025,
            1.0,
            0.5,
            1.0,
            1.0,
        ];
        let got = weights.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-6, "{got:?}");
        }
    }

    /// Two rows of four new tokens: row 0 packs two samples (2 + 2 tokens), row 1 has one
    /// padding key in front (left padding).
    fn packed_and_padded() -> AttentionLayout {
        AttentionLayout {
            positions: vec![vec![0, 1, 0, 1], vec![1, 0, 1, 2]],
            key_valid: vec![vec![true; 4], vec![false, true, true, true]],
            segments: Some(vec![vec![0, 0, 1, 1], vec![0, 0, 0, 0]]),
        }
    }

    #[test]
    fn mask_allows_exactly_causal_same_sample_real_keys_and_registers_their_ranges() {
        let layout = packed_and_padded();
        let mask = layout
            .additive_mask(None, None, DType::F32, &Device::Cpu)
            .unwrap()
            .expect("masked");
        let m: Vec<Vec<f32>> = mask.squeeze(1).unwrap().to_vec3().unwrap().concat();
        for b in 0..2 {
            for q in 0..4 {
                for k in 0..4 {
                    let seg = layout.segments.as_ref().unwrap();
                    let ok = k <= q && layout.key_valid[b][k] && seg[b][k] == seg[b][q];
                    let want = if ok { 0.0 } else { f32::MIN };
                    assert_eq!(m[b * 4 + q][k], want, "batch {b} query {q} key {k}");
                }
            }
        }
        // Keys seen per query row over both batch rows: row 0 (query 0) sees key 0 in batch 0 but
        // nothing in batch 1 (its only key is padding), so it keeps all keys.
        let layout = ferrotune_core::fused::registered_mask_layout(&mask).expect("registered");
        assert_eq!(layout.rows, [(0, 4), (0, 2), (1, 3), (1, 4)]);
        // Every (batch, query) row sees one interval of keys (none: empty), so the kernels may
        // take the intervals instead of the mask.
        let want: Vec<(u32, u32)> = (0..8)
            .map(|r| {
                let row = &m[r];
                let seen: Vec<u32> = (0..4).filter(|&k| row[k as usize] == 0.0).collect();
                seen.first()
                    .map_or((0, 0), |&f| (f, seen[seen.len() - 1] + 1))
            })
            .collect();
        assert_eq!(layout.intervals.as_deref(), Some(&want[..]));
        assert_eq!(layout.masked, f32::MIN);
    }

    #[test]
    fn bf16_mask_uses_the_finite_bf16_minimum() {
        // transformers fills with finfo(bfloat16).min; f32::MIN would round to -inf in bf16 and
        // turn rows without a visible key into NaN instead of uniform weights.
        let mask = packed_and_padded()
            .additive_mask(None, None, DType::BF16, &Device::Cpu)
            .unwrap()
            .expect("masked");
        let v: Vec<f32> = mask
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1()
            .unwrap();
        let min = half::bf16::MIN.to_f32();
        assert!(v.iter().all(|&x| x == 0.0 || x == min), "{v:?}");
        assert!(v.contains(&min) && v.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn no_mask_when_every_query_sees_every_key() {
        // One decode step after two cached tokens, no padding.
        let layout = AttentionLayout {
            positions: vec![vec![2]],
            key_valid: vec![vec![true; 3]],
            segments: None,
        };
        assert!(layout
            .additive_mask(None, None, DType::F32, &Device::Cpu)
            .unwrap()
            .is_none());
    }
}
