//! One decode step (one new token per row) built from [`ferrotune_core::decode`]: eight kernels a
//! layer on a GPU, with the KV cache in fixed-capacity buffers written in place, recorded once as
//! a CUDA graph and replayed for the following steps. The forward pass sends single-token steps
//! here on CUDA; on the CPU the same step is made of the forward's own ops, which is how its
//! bookkeeping (cache slots, padding, windows, every family's options, and — with emulated
//! replays — what a recorded step reads from its buffers) is tested against the forward.

use candle_core::{bail, DType, Result as CResult, Tensor};
use ferrotune_core::decode::{self, FirstKeys, Heads, Projection, QkNorm, StepPosition};
use ferrotune_core::fused;

use super::{AttentionLayout, CausalLm, GateUpProjection, KvCache, Linear, QkvProjection};

impl CausalLm {
    /// Whether a forward call is served by [`CausalLm::decode_step`]: a single-token step of a
    /// model on one CUDA device (f32/bf16) that the step supports, with the decode kernels on
    /// ([`decode::enabled`]).
    pub(super) fn decode_kernels_serve(
        &self,
        input_ids: &Tensor,
        layout: &AttentionLayout,
        cache: &KvCache,
    ) -> bool {
        self.device.is_cuda()
            && matches!(self.dtype, DType::F32 | DType::BF16)
            && decode::enabled()
            && self
                .decode_step_unsupported(input_ids, layout, cache)
                .is_none()
    }

    /// One decode step: the final hidden states `[batch, 1, hidden]` of one new token per row
    /// (`input_ids` `[batch, 1]`, `layout` as for [`CausalLm::forward_hidden`]: left padding,
    /// then the cached tokens, then the new one), the same values the forward computes. The cache
    /// becomes fixed-capacity buffers (grown as needed) and gains this position, written in
    /// place. Inference only: nothing records a backward.
    pub fn decode_step(
        &self,
        input_ids: &Tensor,
        layout: &AttentionLayout,
        cache: &mut KvCache,
    ) -> CResult<Tensor> {
        if let Some(why) = self.decode_step_unsupported(input_ids, layout, cache) {
            bail!("decode_step: {why}");
        }
        self.decode_step_checked(input_ids, layout, cache)
    }

    /// [`CausalLm::decode_step`] once [`CausalLm::decode_step_unsupported`] has passed (the forward
    /// checks through [`CausalLm::decode_kernels_serve`] first, so the check runs once a step).
    ///
    /// On a GPU (and with [`ferrotune_core::graph::enabled`]) a step whose cache buffers, rows and
    /// first keys match the step before is recorded as a CUDA graph, and later steps replay it:
    /// their inputs (token ids, rotary rows, the position counters) are copied into the graph's
    /// buffers and the whole step is one launch. The first step of a buffer set runs eagerly,
    /// which also loads every kernel before anything is recorded. If recording fails, graphs
    /// are turned off with a warning and steps run eagerly.
    pub(super) fn decode_step_checked(
        &self,
        input_ids: &Tensor,
        layout: &AttentionLayout,
        cache: &mut KvCache,
    ) -> CResult<Tensor> {
        let c = &self.config;
        let (batch, _) = input_ids.dims2()?;
        let pos = cache.len();
        cache.reserve(
            pos + 1,
            (batch, c.num_key_value_heads, c.head_dim),
            self.dtype,
            &self.device,
        )?;
        let inputs = self.step_inputs(input_ids, layout, pos)?;
        let first: Vec<u32> = layout
            .key_valid
            .iter()
            .map(|v| v.iter().position(|&ok| ok).unwrap_or(pos) as u32)
            .collect();
        let graphs = match cache.replay {
            Replay::Cuda => self.device.is_cuda() && ferrotune_core::graph::enabled(),
            Replay::Emulated => true,
            Replay::Off => false,
        };
        let hidden = if graphs {
            let emulated = cache.replay == Replay::Emulated;
            self.graphed_step(inputs, first, pos, cache, emulated)?
        } else {
            let first = FirstKeys::new(first, &self.device)?;
            let constants = self.step_constants(batch)?;
            let at = StepPosition {
                len: pos + 1,
                counters: None,
            };
            self.step_body(&inputs, &constants, &first, &cache.layers, at)?
        };
        cache.filled = Some(pos + 1);
        hidden.reshape((batch, 1, c.hidden_size))
    }

    /// The step through a recorded graph (see [`CausalLm::decode_step_checked`]): replayed when
    /// the cache holds one for these buffers, recorded when the previous step ran eagerly on
    /// them, else run eagerly. `emulated`: recordings are replayed by running the ops again
    /// ([`Replay::Emulated`]) instead of as CUDA graphs.
    fn graphed_step(
        &self,
        inputs: StepInputs,
        first: Vec<u32>,
        pos: usize,
        cache: &mut KvCache,
        emulated: bool,
    ) -> CResult<Tensor> {
        let key = GraphKey {
            rows: first.len(),
            buffers: cache
                .layers
                .iter()
                .flatten()
                .flat_map(|(k, v)| [k.id(), v.id()])
                .collect(),
            first: first.clone(),
        };
        if let Some(graph) = cache.graph.0.take() {
            if graph.key == key {
                graph.refill(&inputs)?;
                self.replay(&graph, &cache.layers)?;
                // A copy: the next replay overwrites the graph's output.
                let out = graph.out.copy()?;
                cache.graph.0 = Some(graph);
                return Ok(out);
            }
        }
        let first = FirstKeys::new(first, &self.device)?;
        let constants = self.step_constants(key.rows)?;
        // candle's shape uploads are cached on the device from the eager step on, for the capture.
        let _uploads = ferrotune_core::graph::upload_cache(&self.device);
        if cache.warm.as_ref() != Some(&key) {
            // First step on these buffers: eager, and it loads every kernel.
            let at = StepPosition {
                len: pos + 1,
                counters: None,
            };
            let out = self.step_body(&inputs, &constants, &first, &cache.layers, at)?;
            cache.warm = Some(key);
            return Ok(out);
        }
        let out = Tensor::zeros(
            (key.rows, self.config.hidden_size),
            self.dtype,
            &self.device,
        )?;
        let recording = if emulated {
            Recording::Emulated { pos }
        } else {
            let work = || {
                let at = StepPosition {
                    len: pos + 1,
                    counters: Some(&inputs.counters),
                };
                let h = self.step_body(&inputs, &constants, &first, &cache.layers, at)?;
                out.slice_set(&h, 0, 0)
            };
            match ferrotune_core::graph::CapturedGraph::capture(&self.device, work) {
                Ok(g) => Recording::Cuda(g),
                Err(e) => {
                    tracing::warn!(
                        "recording the decode step as a CUDA graph failed ({e}); decoding goes on without CUDA graphs"
                    );
                    ferrotune_core::graph::set_enabled(false);
                    let at = StepPosition {
                        len: pos + 1,
                        counters: None,
                    };
                    return self.step_body(&inputs, &constants, &first, &cache.layers, at);
                }
            }
        };
        let graph = DecodeGraph {
            recording,
            key,
            inputs,
            constants,
            first,
            out,
        };
        // Recording ran nothing: this step's work is the first replay.
        self.replay(&graph, &cache.layers)?;
        let out = graph.out.copy()?;
        cache.graph.0 = Some(Box::new(graph));
        Ok(out)
    }

    /// Runs a recorded step once: a CUDA graph launch, or (emulated) the step's ops run again with
    /// the graph's buffers and the position it was recorded at, as a replayed graph would.
    fn replay(&self, graph: &DecodeGraph, layers: &[Option<(Tensor, Tensor)>]) -> CResult<()> {
        match &graph.recording {
            Recording::Cuda(g) => g.launch(),
            Recording::Emulated { pos } => {
                let at = StepPosition {
                    len: pos + 1,
                    counters: Some(&graph.inputs.counters),
                };
                let h =
                    self.step_body(&graph.inputs, &graph.constants, &graph.first, layers, at)?;
                graph.out.slice_set(&h, 0, 0)
            }
        }
    }

    /// The step's inputs besides the weights and the cache, made on the host.
    fn step_inputs(
        &self,
        input_ids: &Tensor,
        layout: &AttentionLayout,
        pos: usize,
    ) -> CResult<StepInputs> {
        let c = &self.config;
        let batch = input_ids.dim(0)?;
        // Rotary tables as `[batch, rotary_dim]` rows: the model's, and Gemma 3's local ones.
        let tables = |rope: &crate::rope::RotaryEmbedding| -> CResult<(Tensor, Tensor)> {
            let (cos, sin) = rope.cos_sin(&layout.positions, self.dtype, &self.device)?;
            let rot = cos.dim(3)?;
            Ok((cos.reshape((batch, rot))?, sin.reshape((batch, rot))?))
        };
        // Ministral 3's query temperature per row (`[rows, 1, 1]`); 1 before it starts (× 1 is
        // exact), so a recorded step keeps working once it does.
        let q_scale = match c.llama4_attn_scale {
            Some((beta, original)) => {
                let values = super::llama4_query_scale(&layout.positions, beta, original)
                    .unwrap_or_else(|| vec![1.0; batch]);
                Some(Tensor::from_vec(values, (batch, 1, 1), &self.device)?.to_dtype(self.dtype)?)
            }
            None => None,
        };
        Ok(StepInputs {
            ids: input_ids.to_device(&self.device)?.to_dtype(DType::U32)?,
            global: tables(&self.rope)?,
            local: self.local_rope.as_ref().map(tables).transpose()?,
            q_scale,
            counters: Tensor::new(&[pos as u32, pos as u32 + 1], &self.device)?,
        })
    }

    /// What every step of a generation shares: NoPE layers' identity tables, the embedding scale.
    fn step_constants(&self, batch: usize) -> CResult<StepConstants> {
        let c = &self.config;
        // NoPE layers (SmolLM3) go through the same kernel with identity tables: cos 1, sin 0.
        let identity = if self.layers.iter().any(|l| !l.use_rope) {
            let rot = self.rope.rotary_dim();
            Some((
                Tensor::ones((batch, rot), self.dtype, &self.device)?,
                Tensor::zeros((batch, rot), self.dtype, &self.device)?,
            ))
        } else {
            None
        };
        // transformers builds Gemma's normalizer as a tensor of the hidden dtype: rounded alike.
        let embed_scale = if c.scale_embeddings {
            Some(Tensor::new((c.hidden_size as f32).sqrt(), &self.device)?.to_dtype(self.dtype)?)
        } else {
            None
        };
        Ok(StepConstants {
            identity,
            embed_scale,
        })
    }

    /// The step's device work, from the token ids to the final norm's output `[batch, hidden]`:
    /// nothing here reads back to the host or copies from it, so it can be recorded as a graph.
    fn step_body(
        &self,
        inputs: &StepInputs,
        constants: &StepConstants,
        first: &FirstKeys,
        layers: &[Option<(Tensor, Tensor)>],
        at: StepPosition,
    ) -> CResult<Tensor> {
        let c = &self.config;
        let heads = Heads {
            query: c.num_attention_heads,
            kv: c.num_key_value_heads,
            dim: c.head_dim,
        };
        let (eps, offset) = (c.rms_norm_eps, c.norm_weight_offset_one);
        let act = self.gated_act();
        let scale = self.attention_scale();

        let mut x = self
            .embed_tokens
            .index_select(&inputs.ids.flatten_all()?, 0)?;
        if let Some(s) = &constants.embed_scale {
            x = x.broadcast_mul(s)?;
        }
        let (global, local) = (&inputs.global, &inputs.local);
        for (layer, entry) in self.layers.iter().zip(layers) {
            let (k_cache, v_cache) = entry.as_ref().expect("reserved by the step");
            let attn = &layer.self_attn;
            let Some(input_norm) = &layer.input_layernorm else {
                bail!("decode_step: a layer without input_layernorm");
            };
            let h = fused::rms_norm(&x, input_norm, eps, offset)?;
            let qkv = match &attn.qkv {
                QkvProjection::Separate {
                    q_proj,
                    k_proj,
                    v_proj,
                } => decode::linear_rows(
                    &h,
                    &[
                        projection(q_proj)?,
                        projection(k_proj)?,
                        projection(v_proj)?,
                    ],
                    None,
                )?,
                QkvProjection::Fused { qkv_proj } => {
                    decode::linear_rows(&h, &[projection(qkv_proj)?], None)?
                }
                // Refused by `decode_step_unsupported`.
                QkvProjection::KeyIsValue { .. } | QkvProjection::QueryOnly { .. } => {
                    candle_core::bail!("Gemma 4's attention has no decode kernels")
                }
                QkvProjection::Latent(_) => {
                    candle_core::bail!("multi-head latent attention has no decode kernels")
                }
                QkvProjection::DeltaNet(_) => {
                    candle_core::bail!("the Gated DeltaNet has no decode kernels")
                }
            };
            let norm = match (&attn.q_norm, &attn.k_norm) {
                (Some(q), Some(k)) => Some(QkNorm {
                    q,
                    k,
                    eps,
                    offset_one: offset,
                }),
                _ => None,
            };
            let (cos, sin) = match (local, layer.local_rope, &constants.identity) {
                (_, _, Some(id)) if !layer.use_rope => (&id.0, &id.1),
                (Some(local), true, _) => (&local.0, &local.1),
                _ => (&global.0, &global.1),
            };
            let q = decode::rope_into_cache(&qkv, cos, sin, norm, heads, k_cache, v_cache, at)?;
            let q = match &inputs.q_scale {
                Some(s) => q.broadcast_mul(s)?,
                None => q,
            };
            let a = decode::cached_attention(
                &q,
                k_cache,
                v_cache,
                at,
                first,
                layer.sliding_window,
                scale,
                c.attn_logit_softcapping,
            )?;
            let super::FeedForward::Dense(mlp) = &layer.mlp else {
                bail!("decode_step: a mixture of experts has no decode kernel");
            };
            let Some(post_attn) = &layer.post_attention_layernorm else {
                bail!("decode_step: a layer without post_attention_layernorm");
            };
            let sandwich = layer
                .pre_feedforward_layernorm
                .as_ref()
                .zip(layer.post_feedforward_layernorm.as_ref());
            let h = match sandwich {
                // Gemma 2/3: the block's output is normalized before the residual add, so the
                // GEMV cannot add the residual itself.
                Some((pre_ff, _)) => {
                    let o = decode::linear_rows(&a, &[projection(&attn.o_proj)?], None)?;
                    x = (&x + fused::rms_norm(&o, post_attn, eps, offset)?)?;
                    fused::rms_norm(&x, pre_ff, eps, offset)?
                }
                None => {
                    x = decode::linear_rows(&a, &[projection(&attn.o_proj)?], Some(&x))?;
                    fused::rms_norm(&x, post_attn, eps, offset)?
                }
            };
            let g = match &mlp.gate_up {
                GateUpProjection::Separate { gate_proj, up_proj } => {
                    decode::gated_rows(&h, projection(gate_proj)?, projection(up_proj)?, act)?
                }
                GateUpProjection::Ungated { .. } => {
                    bail!("decode_step: an ungated MLP has no decode kernel")
                }
                GateUpProjection::Fused { gate_up_proj } => {
                    // Rows [gate | up] of one matrix (and of its bias).
                    let inter = c.intermediate_size;
                    let half = |start: usize| -> CResult<(Tensor, Option<Tensor>)> {
                        Ok((
                            projection(gate_up_proj)?.weight.narrow(0, start, inter)?,
                            gate_up_proj
                                .bias
                                .as_ref()
                                .map(|b| b.narrow(0, start, inter))
                                .transpose()?,
                        ))
                    };
                    let (gw, gb) = half(0)?;
                    let (uw, ub) = half(inter)?;
                    let gate = Projection {
                        weight: &gw,
                        bias: gb.as_ref(),
                    };
                    let up = Projection {
                        weight: &uw,
                        bias: ub.as_ref(),
                    };
                    decode::gated_rows(&h, gate, up, act)?
                }
            };
            x = match sandwich {
                Some((_, post_ff)) => {
                    let d = decode::linear_rows(&g, &[projection(&mlp.down_proj)?], None)?;
                    (&x + fused::rms_norm(&d, post_ff, eps, offset)?)?
                }
                None => decode::linear_rows(&g, &[projection(&mlp.down_proj)?], Some(&x))?,
            };
        }
        self.final_norm(&x)
    }
}

/// A decode step's inputs that change every step: in a recorded graph, buffers rewritten before
/// each replay.
#[derive(Debug)]
struct StepInputs {
    /// `[rows, 1]` u32.
    ids: Tensor,
    /// cos, sin `[rows, rotary dim]` of the model's rope.
    global: (Tensor, Tensor),
    /// Gemma 3's local rope's.
    local: Option<(Tensor, Tensor)>,
    /// Ministral 3's query temperature `[rows, 1, 1]`.
    q_scale: Option<Tensor>,
    /// `[slot, len]` u32 (see [`StepPosition`]).
    counters: Tensor,
}

/// What stays the same over a generation's steps.
#[derive(Debug)]
struct StepConstants {
    /// NoPE layers' cos 1 / sin 0 tables.
    identity: Option<(Tensor, Tensor)>,
    /// Gemma's √hidden embedding scale in the compute dtype.
    embed_scale: Option<Tensor>,
}

/// Whether decode steps go through a recorded graph: a CUDA graph on a GPU, or (tests) the same
/// bookkeeping with each replay emulated by running the step's ops again on the recorded buffers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) enum Replay {
    #[default]
    Cuda,
    Emulated,
    /// Never recorded (tests: the kernels launched one by one, beside a cache that replays).
    Off,
}

/// A recorded decode step.
#[derive(Debug)]
enum Recording {
    Cuda(ferrotune_core::graph::CapturedGraph),
    /// Replays run the ops again with the recorded position (`pos`), as a graph replays its
    /// recorded arguments: the position must come from the counters.
    Emulated {
        pos: usize,
    },
}

/// What a recording was made for: replaying it on other cache buffers, rows or first keys
/// would read or write the wrong memory.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct GraphKey {
    rows: usize,
    buffers: Vec<candle_core::TensorId>,
    first: Vec<u32>,
}

/// The [`KvCache`]'s recorded decode step, if any. A clone of the cache starts without one: a
/// recording belongs to the one generation stepping it.
#[derive(Debug, Default)]
pub(super) struct Recorded(pub(super) Option<Box<DecodeGraph>>);

impl Clone for Recorded {
    fn clone(&self) -> Self {
        Self(None)
    }
}

/// A recorded decode step with its buffers (held by the [`KvCache`] it writes).
#[derive(Debug)]
pub(super) struct DecodeGraph {
    recording: Recording,
    key: GraphKey,
    inputs: StepInputs,
    constants: StepConstants,
    first: FirstKeys,
    /// The final norm's output `[rows, hidden]`, written by each replay.
    out: Tensor,
}

impl DecodeGraph {
    /// Copies a step's inputs into the recording's buffers.
    fn refill(&self, step: &StepInputs) -> CResult<()> {
        let own = &self.inputs;
        own.ids.slice_set(&step.ids, 0, 0)?;
        own.counters.slice_set(&step.counters, 0, 0)?;
        own.global.0.slice_set(&step.global.0, 0, 0)?;
        own.global.1.slice_set(&step.global.1, 0, 0)?;
        if let (Some(a), Some(b)) = (&own.local, &step.local) {
            a.0.slice_set(&b.0, 0, 0)?;
            a.1.slice_set(&b.1, 0, 0)?;
        }
        if let (Some(a), Some(b)) = (&own.q_scale, &step.q_scale) {
            a.slice_set(b, 0, 0)?;
        }
        Ok(())
    }
}

fn projection(l: &Linear) -> CResult<Projection<'_>> {
    let Some(weight) = l.weight.as_dense() else {
        bail!("decode_step: an NF4 (QLoRA) base has no decode kernel")
    };
    Ok(Projection {
        weight,
        bias: l.bias.as_ref(),
    })
}
