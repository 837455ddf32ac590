//! The decoder: one implementation for Llama 2/3, Mistral, Qwen2/2.5/3, Gemma, Phi-3 and SmolLM2,
//! switched by [`ModelConfig`]. Every op on the path has a backward (see `ferrotune_core::ops`), so
//! the same code serves generation and training.
//!
//! [`CausalLm`] is the model: embeddings, [`DecoderLayer`]s, final norm and output head. Its
//! struct, accessors, forward and placement over devices ([`CausalLm::dispatch`]) live here, with
//! the helpers several files share; the rest by concern:
//! - `linear`: [`Linear`], [`FakeQuant`], [`QkvProjection`], [`GateUpProjection`], NF4
//!   quantization of the base ([`Nf4Summary`]);
//! - `cache`: [`KvCache`];
//! - `layout`: [`AttentionLayout`], attention masks, [`LayerInputs`];
//! - `load`: [`CausalLm::from_tensors`] and its tensor taker;
//! - `attention`: [`Attention`] and its forward, query temperatures;
//! - `mlp`: [`Mlp`], [`FeedForward`] and their forward;
//! - `moe`: [`Moe`], [`ParallelMoe`], routing, [`RouterRecord`]; `moe_grouped`: DeepSeek's
//!   group-limited routing ([`GroupedRouter`]);
//! - `mla`: DeepSeek's multi-head latent attention ([`LatentProjection`]) and its latent cache;
//! - `delta_net`: Qwen3.5's and Qwen3-Next's Gated DeltaNet ([`GatedDeltaNet`]) and the
//!   recurrent form of its delta rule; `delta_chunked`: the chunked form;
//! - `gpt_oss`: gpt-oss's attention sinks and [`GptOssMoe`]; `gpt_oss_experts`: how its fused
//!   experts are held and fetched ([`ExpertWeight`]: dense, or MXFP4 for QLoRA);
//! - `layer`: [`DecoderLayer`], [`LayerPartsMut`], Gemma 4's per-layer embeddings, the layer
//!   forward;
//! - `decode_step`: the single-token decode step on the GPU decode kernels;
//! - [`lora`]: [`LoraAdapter`] on a [`Linear`], with PEFT's arithmetic
//!   (public also as `ferrotune_models::lora`).

use std::sync::Arc;

use candle_core::{DType, Device, DeviceLocation, Result as CResult, Tensor, Var, D};
pub use ferrotune_core::weight::BaseWeight;
use ferrotune_core::{fused, ops};

use crate::config::ModelConfig;
use crate::device_map::Placement;
use crate::error::ModelError;
use crate::rope::RotaryEmbedding;

mod attention;
mod cache;
mod classifier;
mod decode_step;
mod delta_chunked;
mod delta_net;
mod gpt_oss;
mod gpt_oss_experts;
mod layer;
mod layout;
mod linear;
mod load;
pub mod lora;
mod mla;
mod mlp;
mod moe;
mod moe_grouped;
mod paths;

pub use attention::Attention;
use attention::QueryScale;
pub(crate) use attention::{llama4_query_scale, nope_query_temperature};
pub use cache::KvCache;
use cache::{LayerCache, LinearState};
pub use delta_net::{DeltaNetProjections, GatedDeltaNet};
pub use gpt_oss::{ExpertsLora, GptOssMoe, GPT_OSS_MOE_TENSORS};
pub use gpt_oss_experts::{ExpertWeight, Mxfp4Summary};
pub use layer::{
    DecoderLayer, LayerPartsMut, PerLayerEmbedding, PerLayerInputBlock, PER_LAYER_NORM,
    PER_LAYER_PROJECTION, PER_LAYER_TABLE,
};
use layout::AcrossLayers;
pub use layout::{AttentionLayout, LayerInputs};
pub use linear::{FakeQuant, GateUpProjection, Linear, Nf4Summary, QkvProjection};
use lora::LoraAdapter;
pub use mla::{latent_cache_ratio, LatentProjection, LatentQuery};
use mlp::{mlp_linears, mlp_linears_mut};
pub use mlp::{FeedForward, Mlp};
use moe::PARALLEL_MOE_TENSORS;
pub use moe::{Moe, ParallelMoe, RouterRecord};
pub use moe_grouped::GroupedRouter;

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

/// A model's placement over several devices, as [`CausalLm::dispatch`] left it.
#[derive(Debug)]
struct DeviceSpread {
    placement: Placement,
    devices: Vec<Device>,
}

/// `t`, where there is one, on `device`.
fn to_device_opt(t: &Option<Tensor>, device: &Device) -> CResult<Option<Tensor>> {
    t.as_ref().map(|t| t.to_device(device)).transpose()
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

impl CausalLm {
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
            out.bias = to_device_opt(&l.bias, device)?;
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
        let norm_bias = to_device_opt(&self.norm_bias, head_device)?;
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
            let layer_cache = cache.as_deref_mut().map(|c| c.layer(i));
            x = self.layer_forward(i, layer, &x, &inputs, layer_cache, &mut across)?;
        }
        self.final_norm(&x)
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
            let layer_cache = cache.as_deref_mut().map(|c| c.layer(i));
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

impl CausalLm {
    /// Weight bytes of each part as [`plan`](crate::device_map::plan) takes them: every decoder layer, then (embedding,
    /// final norm + head). LoRA adapter tensors count with their layer (the embedding's with the embedding). A tied head is counted at
    /// full size, as it needs its own copy whenever it lands on another device than the embedding.
    /// Packed (GGUF block) copies are not counted: they only exist on the CPU.
    pub fn part_bytes(&self) -> (Vec<u64>, (u64, u64)) {
        fn bytes(t: &candle_core::Tensor) -> u64 {
            (t.elem_count() * t.dtype().size_in_bytes()) as u64
        }
        fn adapter_bytes(a: Option<&crate::model::lora::LoraAdapter>) -> u64 {
            a.map_or(0, |a| {
                bytes(&a.a)
                    + bytes(&a.b)
                    + a.dora_magnitude.as_ref().map_or(0, bytes)
                    + a.bias.as_ref().map_or(0, bytes)
            })
        }
        fn linear_bytes(l: &crate::Linear) -> u64 {
            l.weight.size_in_bytes() as u64
                + l.bias.as_ref().map_or(0, bytes)
                + adapter_bytes(l.adapter.as_ref())
        }
        let mut layers = vec![0u64; self.layers.len()];
        for (i, layer) in self.layers.iter().enumerate() {
            layers[i] = layer.norms().into_iter().map(|(_, t)| bytes(t)).sum();
        }
        let mut head: u64 = self
            .final_norm_tensors()
            .into_iter()
            .map(|(_, t)| bytes(t))
            .sum();
        for (name, linear) in self.linears() {
            if name == "lm_head" {
                head += linear_bytes(linear);
            } else if let Some(i) = layer_index(&name) {
                layers[i] += linear_bytes(linear);
            }
        }
        let embed = bytes(&self.embed_tokens) + adapter_bytes(self.embed_adapter.as_ref());
        (layers, (embed, head))
    }
}

/// `i` of a `model.layers.{i}.` module name.
fn layer_index(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split('.')
        .next()?
        .parse()
        .ok()
}
