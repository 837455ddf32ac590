//! Building a [`CausalLm`] from HF-named tensors ([`CausalLm::from_tensors`]): shapes checked
//! against the config, fused experts split, unused tensors reported.

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Device, Result as CResult, Tensor};
use ferrotune_core::quant::QuantizedMatrix;

use super::{
    final_norm_name, Attention, BaseWeight, CausalLm, DecoderLayer, ExpertWeight, FeedForward,
    GateUpProjection, GptOssMoe, GroupedRouter, Linear, Mlp, Moe, ParallelMoe, PerLayerEmbedding,
    PerLayerInputBlock, QkvProjection, PARALLEL_MOE_TENSORS, PER_LAYER_NORM, PER_LAYER_PROJECTION,
    PER_LAYER_TABLE,
};
use crate::config::{GptOssMoeConfig, ModelConfig, QkNormSpan};
use crate::error::ModelError;
use crate::mxfp4::Mxfp4Experts;
use crate::rope::RotaryEmbedding;

/// The layer count's key, named in errors: a config.json's, or a GGUF file's metadata key.
const LAYERS_KEY: &str = "num_hidden_layers (a GGUF file's {arch}.block_count)";

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

/// Leaves out the multi-token-prediction layers a DeepSeek-V3 checkpoint holds after the
/// decoder's (`model.layers.{num_hidden_layers + i}.*`, [`ModelConfig::mtp_layers`]), with a
/// note: transformers ignores them too, and generation does not use them.
fn skip_mtp_layers(
    tensors: &mut HashMap<String, Tensor>,
    packed: &mut HashMap<String, QuantizedMatrix>,
    c: &ModelConfig,
    source: &str,
) {
    if c.mtp_layers == 0 {
        return;
    }
    let is_mtp = |name: &str| {
        name.strip_prefix("model.layers.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|i| i.parse::<usize>().ok())
            .is_some_and(|i| i >= c.num_hidden_layers && i < c.num_hidden_layers + c.mtp_layers)
    };
    let before = tensors.len() + packed.len();
    tensors.retain(|name, _| !is_mtp(name));
    packed.retain(|name, _| !is_mtp(name));
    let skipped = before - tensors.len() - packed.len();
    if skipped > 0 {
        tracing::info!(
            "{source}: skipped {skipped} tensor(s) of the {} multi-token-prediction layer(s)              (model.layers.{}.*): generation and training use the decoder's layers only",
            c.mtp_layers,
            c.num_hidden_layers
        );
    }
}

/// Takes named tensors out of a checkpoint's map, checking shapes.
pub(super) struct TensorTaker<'a> {
    tensors: &'a mut HashMap<String, Tensor>,
    packed: &'a mut HashMap<String, QuantizedMatrix>,
    source: &'a str,
}

impl TensorTaker<'_> {
    pub(super) fn take(&mut self, name: &str, shape: &[usize]) -> Result<Tensor, ModelError> {
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
    pub(super) fn linear(
        &mut self,
        prefix: &str,
        out: usize,
        inp: usize,
    ) -> Result<Linear, ModelError> {
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
    fn moe(
        &mut self,
        p: &str,
        m: &crate::config::MoeConfig,
        grouped: Option<&crate::config::GroupedRouting>,
        h: usize,
    ) -> Result<Moe, ModelError> {
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
        if !m.sigmoid_input_routing {
            // transformers 5's in-memory layout, should a checkpoint hold it (Qwen3.5-MoE's
            // does; a no-op where the experts are separate).
            let experts = m.num_experts;
            self.split_fused_experts(&pre, experts, m.expert_intermediate_size, h, false)?;
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
        // DeepSeek's are `shared_experts`.
        let shared_name = if grouped.is_some() {
            "shared_experts"
        } else {
            "shared_expert"
        };
        let shared = match m.shared_expert_intermediate_size {
            Some(inter) => Some(gated(&format!("{pre}.{shared_name}"), inter)?),
            None => None,
        };
        let shared_expert = match shared {
            // Llama 4's and DeepSeek's shared experts are added as they are.
            Some(mlp) if m.sigmoid_input_routing || grouped.is_some() => Some((mlp, None)),
            Some(mlp) => Some((
                mlp,
                Some(self.linear(&format!("{pre}.shared_expert_gate"), 1, h)?),
            )),
            None => None,
        };
        let grouped = match grouped {
            Some(routing) => Some(GroupedRouter {
                routing: routing.clone(),
                correction_bias: match routing.correction_bias {
                    true => Some(self.take(
                        &format!("{pre}.gate.e_score_correction_bias"),
                        &[m.num_experts],
                    )?),
                    false => None,
                },
            }),
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
            grouped,
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
                grouped: None,
            },
            router_scale: router_scale?,
            per_expert_scale: per_expert_scale?,
            pre_norm: pre_norm?,
            post_norm_mlp: post_norm_mlp?,
            post_norm_experts: post_norm_experts?,
        })
    }

    /// gpt-oss's mixture of experts of layer `p` (`model.layers.N`), each expert `inter` wide,
    /// in `dtype` on `device`. MXFP4 experts (`*_blocks` / `*_scales`, as OpenAI ships them) are
    /// dequantized when a safetensors checkpoint is read ([`crate::mxfp4`]), or kept as read
    /// (u8) for QLoRA: those are held packed ([`ExpertWeight::Mxfp4`]). Parts of another type
    /// did not come that way and are refused, naming the tensor.
    fn gpt_oss_moe(
        &mut self,
        p: &str,
        m: &GptOssMoeConfig,
        (h, inter): (usize, usize),
        (dtype, device): (DType, &Device),
    ) -> Result<GptOssMoe, ModelError> {
        let e = m.num_experts;
        let experts = format!("{p}.mlp.experts");
        let mut fused = |name: &str, shape: [usize; 3]| -> Result<ExpertWeight, ModelError> {
            let (blocks, scales) = (format!("{name}_blocks"), format!("{name}_scales"));
            let Some(b) = self.tensors.get(&blocks) else {
                return Ok(ExpertWeight::Dense(self.take(name, &shape)?));
            };
            let (Some(s), DType::U8) = (self.tensors.get(&scales), b.dtype()) else {
                return Err(ModelError::Msg(format!(
                    "{}: tensor '{blocks}' holds MXFP4-quantized experts that were not \
                     dequantized: ferrotune dequantizes them when it reads them from safetensors \
                     (U8 blocks beside their U8 scales)",
                    self.source
                )));
            };
            let packed = Mxfp4Experts::new(b, s, name, dtype, device)?;
            if packed.dims3() != (shape[0], shape[1], shape[2]) {
                return Err(ModelError::Msg(format!(
                    "{}: MXFP4 tensor '{blocks}' {:?} stands for a weight of shape {:?}, \
                     expected {shape:?} from the model config",
                    self.source,
                    b.dims(),
                    packed.dims3()
                )));
            }
            self.tensors.remove(&blocks);
            self.tensors.remove(&scales);
            Ok(ExpertWeight::Mxfp4(Arc::new(packed)))
        };
        let gate_up_proj = fused(&format!("{experts}.gate_up_proj"), [e, h, 2 * inter])?;
        let down_proj = fused(&format!("{experts}.down_proj"), [e, inter, h])?;
        Ok(GptOssMoe {
            router_weight: self.take(&format!("{p}.mlp.router.weight"), &[e, h])?,
            router_bias: self.take(&format!("{p}.mlp.router.bias"), &[e])?,
            gate_up_proj,
            gate_up_proj_bias: self
                .take(&format!("{experts}.gate_up_proj_bias"), &[e, 2 * inter])?,
            down_proj,
            down_proj_bias: self.take(&format!("{experts}.down_proj_bias"), &[e, h])?,
            config: m.clone(),
            gate_up_lora: None,
            down_lora: None,
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
        skip_mtp_layers(&mut tensors, &mut packed, c, source);
        // Every format's tensors carry HF names by now: a config promising more layers than the
        // checkpoint holds is refused before anything is built for them.
        let held = crate::config::layers::layers_held(
            tensors.keys().chain(packed.keys()).map(String::as_str),
            "model.layers.",
        );
        crate::config::layers::check_layers_held(c.num_hidden_layers, held, LAYERS_KEY)
            .map_err(|m| ModelError::Msg(format!("{source}: {m}")))?;
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
            let linear_attn = c
                .delta_net
                .as_ref()
                .filter(|d| d.layers.get(i).copied().unwrap_or(false));
            // Qwen3.5: `q_proj` gives each head's query and output gate.
            let q_width = if c.attn_output_gate {
                2 * nh * hd
            } else {
                nh * hd
            };
            let qkv = if let Some(d) = linear_attn {
                QkvProjection::DeltaNet(Box::new(take.gated_delta_net(&p, d, h)?))
            } else if let Some(m) = &c.mla {
                QkvProjection::Latent(Box::new(take.latent_projection(&p, m, nh, h)?))
            } else if kv_source.is_some() {
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
                    q_proj: take.linear(&format!("{p}.self_attn.q_proj"), q_width, h)?,
                    k_proj: take.linear(&format!("{p}.self_attn.k_proj"), nkv * hd, h)?,
                    v_proj: take.linear(&format!("{p}.self_attn.v_proj"), nkv * hd, h)?,
                }
            };
            let (q_norm, k_norm) = if c.qk_norm && linear_attn.is_none() {
                // Per head, or over the whole projection (OLMo 2).
                let (q_width, k_width) = match c.qk_norm_span {
                    QkNormSpan::Head => (hd, hd),
                    QkNormSpan::Projection => (nh * hd, nkv * hd),
                };
                (
                    Some(take.take(&format!("{p}.self_attn.q_norm.weight"), &[q_width])?),
                    // A KV-sharing layer has no keys of its own.
                    match kv_source {
                        Some(_) => None,
                        None => {
                            Some(take.take(&format!("{p}.self_attn.k_norm.weight"), &[k_width])?)
                        }
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
            let mut sandwich = |name: &str, present: bool| -> Result<Option<Tensor>, ModelError> {
                if c.sandwich_norms && present {
                    take.take(&format!("{p}.{name}.weight"), &[h]).map(Some)
                } else {
                    Ok(None)
                }
            };
            // OLMo 2's sandwich has no pre-norm.
            let pre_feedforward_layernorm = sandwich("pre_feedforward_layernorm", c.pre_norms)?;
            let post_feedforward_layernorm = sandwich("post_feedforward_layernorm", true)?;
            let sparse = c
                .moe
                .as_ref()
                .filter(|m| m.sparse_layers.get(i).copied().unwrap_or(false));
            let mlp = match (sparse, &c.gpt_oss_moe) {
                (Some(m), _) => {
                    let grouped = c.grouped_routing.as_ref();
                    FeedForward::Sparse(Box::new(take.moe(&p, m, grouped, h)?))
                }
                (None, Some(m)) => FeedForward::GptOss(Box::new(take.gpt_oss_moe(
                    &p,
                    m,
                    (h, inter),
                    (dtype, &device),
                )?)),
                (None, None) => {
                    let gate_up = dense_gate_up(&mut take)?;
                    let down = format!("{p}.{}", gate_up.down_proj_name());
                    FeedForward::Dense(Mlp {
                        down_proj: take.linear(&down, h, inter)?,
                        gate_up,
                    })
                }
            };
            let o_proj_name = if linear_attn.is_some() {
                super::delta_net::OUT_PROJ
            } else if c.parallel_block {
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
                input_layernorm: if c.pre_norms {
                    Some(take.take(&format!("{p}.input_layernorm.weight"), &[h])?)
                } else {
                    None
                },
                input_layernorm_bias: if c.layer_norm && c.pre_norms {
                    Some(take.take(&format!("{p}.input_layernorm.bias"), &[h])?)
                } else {
                    None
                },
                self_attn: Attention {
                    qkv,
                    // Latent attention's values are `v_head_dim` wide.
                    o_proj: take.linear(
                        &format!("{p}.{o_proj_name}"),
                        h,
                        match linear_attn {
                            Some(d) => d.value_heads * d.value_head_dim,
                            None => nh * c.mla.as_ref().map_or(hd, |m| m.v_head_dim),
                        },
                    )?,
                    o_proj_name,
                    q_norm,
                    k_norm,
                    dims: (nh, nkv, hd),
                    v_norm: gemma4.is_some(),
                    kv_source,
                    sinks: if c.attention_sinks {
                        Some(take.take(&format!("{p}.self_attn.sinks"), &[nh])?)
                    } else {
                        None
                    },
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
        if let (Some(m), Some(ratio)) = (&c.mla, super::latent_cache_ratio(c)) {
            tracing::info!(
                "{source}: multi-head latent attention caches {} numbers per token and layer \
                 (the latent and the rotary key) instead of {} expanded keys and values: {ratio:.1}x less",
                m.kv_lora_rank + m.qk_rope_head_dim,
                c.num_attention_heads * (m.qk_head_dim() + m.v_head_dim)
            );
        }
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
}
