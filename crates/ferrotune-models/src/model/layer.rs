//! One decoder layer: [`DecoderLayer`] with its parts by name ([`LayerPartsMut`]), Gemma 4's
//! per-layer embedding blocks ([`PerLayerEmbedding`], [`PerLayerInputBlock`]), and the layer's
//! forward (attention, feed-forward and their norms and residuals).

use std::borrow::Cow;

use candle_core::{Result as CResult, Tensor};

use super::{
    embedding_rows, mlp_linears, mlp_linears_mut, AcrossLayers, Attention, CausalLm, FeedForward,
    LayerCache, LayerInputs, Linear, ParallelMoe, QkvProjection, QueryScale,
};

/// One decoder layer (residual blocks, pre-norm but for OLMo 2's).
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    /// The attention's pre-norm; none in OLMo 2's layers ([`ModelConfig::pre_norms`]).
    ///
    /// [`ModelConfig::pre_norms`]: crate::config::ModelConfig::pre_norms
    pub input_layernorm: Option<Tensor>,
    /// Phi-2's LayerNorm bias.
    pub input_layernorm_bias: Option<Tensor>,
    pub self_attn: Attention,
    /// The MLP's pre-norm; with sandwich norms (Gemma 2/3, OLMo 2) the norm of the attention's
    /// output; none in Phi-2's parallel block.
    pub post_attention_layernorm: Option<Tensor>,
    /// Phi-3.5-MoE's LayerNorm bias of `post_attention_layernorm`.
    pub post_attention_layernorm_bias: Option<Tensor>,
    /// Gemma 2/3: the MLP's pre-norm (OLMo 2's sandwich has none).
    pub pre_feedforward_layernorm: Option<Tensor>,
    /// Gemma 2/3, OLMo 2: the norm of the MLP's output.
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
    ///
    /// [`ModelConfig::post_attention_norm_name`]: crate::config::ModelConfig::post_attention_norm_name
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
            sinks,
            ..
        } = self_attn;
        let mut norms: Vec<(&'static str, &mut Tensor)> = Vec::new();
        let optional = [
            ("input_layernorm.weight", input_layernorm),
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
            ("self_attn.sinks", sinks),
        ];
        norms.extend(
            optional
                .into_iter()
                .filter_map(|(name, t)| t.as_mut().map(|t| (name, t))),
        );
        let (mut linears, projection_norms) = qkv.parts_mut();
        norms.extend(projection_norms);
        linears.push(o_proj);
        let mut adapters = Vec::new();
        match mlp {
            FeedForward::Dense(mlp) => linears.extend(mlp_linears_mut(mlp)),
            FeedForward::Sparse(moe) => linears.extend(moe.linears_mut()),
            FeedForward::GptOss(moe) => {
                let (tensors, lora) = moe.tensors_and_adapters_mut();
                norms.extend(tensors);
                adapters.extend(lora);
            }
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
        LayerPartsMut {
            norms,
            linears,
            adapters,
        }
    }

    /// The layer's norm tensors with their parameter names inside it
    /// (`input_layernorm.weight`, ...), in checkpoint order.
    pub fn norms(&self) -> Vec<(&'static str, &Tensor)> {
        let mut out = Vec::new();
        let optional = [
            ("input_layernorm.weight", &self.input_layernorm),
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
            ("self_attn.sinks", &self.self_attn.sinks),
        ];
        out.extend(
            optional
                .into_iter()
                .filter_map(|(name, t)| t.as_ref().map(|t| (name, t))),
        );
        out.extend(self.self_attn.qkv.norms());
        if let Some(block) = &self.parallel_moe {
            out.extend(block.small_tensors());
        }
        if let FeedForward::GptOss(moe) = &self.mlp {
            out.extend(moe.tensors());
        }
        if let Some(block) = &self.per_layer_input {
            out.push(("post_per_layer_input_norm.weight", &block.norm));
        }
        out
    }

    /// The layer's buffers with their names inside it: checkpoint tensors that are no
    /// parameters (Gemma 4's `layer_scalar`), saved back as they are and never trained.
    pub fn buffers(&self) -> Vec<(&'static str, &Tensor)> {
        let mut out: Vec<(&'static str, &Tensor)> = self
            .layer_scalar
            .iter()
            .map(|t| ("layer_scalar", t))
            .collect();
        // DeepSeek-V3's router bias: it picks experts, it is not trained.
        if let FeedForward::Sparse(moe) = &self.mlp {
            if let Some(bias) = moe
                .grouped
                .as_ref()
                .and_then(|g| g.correction_bias.as_ref())
            {
                out.push(("mlp.gate.e_score_correction_bias", bias));
            }
        }
        out
    }

    /// The layer's linear layers with their module names inside it (`self_attn.q_proj`, ...),
    /// in model order (the names only borrowed, except for a mixture of experts').
    pub fn linears(&self) -> Vec<(Cow<'static, str>, &Linear)> {
        let mut linears = self.self_attn.qkv.linears();
        linears.push(&self.self_attn.o_proj);
        match &self.mlp {
            FeedForward::Dense(mlp) => linears.extend(mlp_linears(mlp)),
            FeedForward::Sparse(moe) => linears.extend(moe.linears()),
            FeedForward::GptOss(_) => {}
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
            FeedForward::GptOss(_) => {}
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

/// Every tensor of one decoder layer, mutable and borrowed apart ([`DecoderLayer::parts_mut`]).
pub struct LayerPartsMut<'a> {
    /// The tensors other than linear layers by parameter name: norms (`input_layernorm.weight`,
    /// `self_attn.q_norm.weight`, ...), gpt-oss's sinks and experts, Gemma 4's router scales.
    pub norms: Vec<(&'static str, &'a mut Tensor)>,
    /// Linear layers by module name (`self_attn.q_proj`, ...), in model order.
    pub linears: Vec<(Cow<'static, str>, &'a mut Linear)>,
    /// Adapters on parameters (gpt-oss's experts, `target_parameters`) by their name inside the
    /// layer as PEFT's file has it after `base_model.model.model.layers.N.`
    /// (`mlp.experts.base_layer.lora_A.weight`, ...).
    pub adapters: Vec<(&'static str, &'a mut Tensor)>,
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

impl CausalLm {
    /// Gemma 4's per-layer inputs `[b, t, layers, per_layer_dim]` from the input ids and their
    /// (scaled) embeddings `embeds`, as transformers makes them: `(norm(projection(embeds) ·
    /// hidden^-½) + table[ids] · √per_layer_dim) · 2^-½`.
    pub(super) fn per_layer_inputs(
        &self,
        input_ids: &Tensor,
        embeds: &Tensor,
    ) -> CResult<Option<Tensor>> {
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

    /// Decoder layer `index` on hidden states `x` (no cache): the unit activation checkpointing
    /// recomputes.
    pub fn layer(&self, index: usize, x: &Tensor, inputs: &LayerInputs) -> CResult<Tensor> {
        if let Some(why) = self.layers_not_separable() {
            candle_core::bail!("{why}");
        }
        let layer = &self.layers[index];
        self.layer_forward(index, layer, x, inputs, None, &mut AcrossLayers::default())
    }

    pub(super) fn layer_forward(
        &self,
        index: usize,
        layer: &DecoderLayer,
        x: &Tensor,
        inputs: &LayerInputs,
        cache: Option<LayerCache<'_>>,
        across: &mut AcrossLayers,
    ) -> CResult<Tensor> {
        let (cos, sin) = inputs.cos_sin(layer);
        let mask = inputs.mask(layer);
        let norm = |t: &Tensor, w: &Tensor| self.norm(t, w, None);
        // OLMo 2's attention reads the residual stream as it is.
        let normed = match &layer.input_layernorm {
            Some(w) => self.norm(x, w, layer.input_layernorm_bias.as_ref())?,
            None => x.clone(),
        };
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
        let (h, kv) = match &layer.self_attn.qkv {
            QkvProjection::DeltaNet(net) => {
                let valid = inputs.token_valid.as_ref();
                let state = cache.map(|c| c.linear);
                let links = inputs.sample_links.as_ref();
                let h = self.gated_delta_net(net, &normed, valid, links, state)?;
                let h = layer.self_attn.o_proj.forward(&h)?;
                // A linear-attention layer has no keys or values to share.
                (h.clone(), (h.clone(), h))
            }
            _ => self.attention(
                &layer.self_attn,
                &normed,
                rope,
                q_scale,
                mask,
                cache.map(|c| c.kv),
                shared,
            )?,
        };
        if self.kv_is_shared(index) {
            across.kv.insert(index, kv);
        }
        let x = match (
            &layer.post_attention_layernorm,
            &layer.pre_feedforward_layernorm,
            &layer.post_feedforward_layernorm,
        ) {
            // Gemma 2/3, OLMo 2: every block's output is normalized before its residual add; OLMo
            // 2's MLP has no pre-norm.
            (Some(post_attn), pre_ff, Some(post_ff)) => {
                let x = (x + norm(&h, post_attn)?)?;
                let h = match pre_ff {
                    Some(pre_ff) => self.feed_forward(&layer.mlp, &norm(&x, pre_ff)?)?,
                    None => self.feed_forward(&layer.mlp, &x)?,
                };
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
}
