//! One decode step (one new token per row) built from [`ferrotune_core::decode`]: eight kernels a
//! layer on a GPU, with the KV cache in fixed-capacity buffers written in place. The forward pass
//! sends single-token steps here on CUDA; on the CPU the same step is made of the forward's own
//! ops, which is how its bookkeeping (cache slots, padding, windows, every family's options) is
//! tested against the forward.

use candle_core::{bail, DType, Result as CResult, Tensor};
use ferrotune_core::decode::{self, FirstKeys, Heads, Projection, QkNorm};
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

    /// Why [`CausalLm::decode_step`] cannot serve this call, or `None` when it can.
    fn decode_step_unsupported(
        &self,
        input_ids: &Tensor,
        layout: &AttentionLayout,
        cache: &KvCache,
    ) -> Option<String> {
        let Ok((batch, seq)) = input_ids.dims2() else {
            return Some(format!(
                "input ids {:?} are not [batch, 1]",
                input_ids.dims()
            ));
        };
        if seq != 1 || batch == 0 || batch > decode::MAX_ROWS {
            return Some(format!(
                "a decode step takes 1 to {} rows of one token, got {batch} × {seq}",
                decode::MAX_ROWS
            ));
        }
        if self.spread.is_some() {
            return Some("the model is spread over several devices".into());
        }
        if layout.segments.is_some() || layout.positions.len() != batch {
            return Some("packed or mismatched attention layout".into());
        }
        if cache.layers.len() != self.layers.len() {
            return Some(format!(
                "the KV cache has {} layers, the model {}",
                cache.layers.len(),
                self.layers.len()
            ));
        }
        let past = cache.len();
        for (row, valid) in layout.key_valid.iter().enumerate() {
            // Keys must be left padding followed by real tokens, the new one last.
            let first = valid.iter().position(|&v| v).unwrap_or(valid.len());
            if valid.len() != past + 1
                || layout.positions[row].len() != 1
                || first > past
                || !valid[first..].iter().all(|&v| v)
            {
                return Some(format!(
                    "row {row}'s keys are not left padding followed by {} cached + 1 new tokens",
                    past
                ));
            }
        }
        let c = &self.config;
        if c.head_dim > decode::MAX_HEAD_DIM {
            return Some(format!(
                "head dimension {} is over {}",
                c.head_dim,
                decode::MAX_HEAD_DIM
            ));
        }
        if c.layer_norm || c.parallel_block || c.ungated_mlp {
            return Some(
                "Phi-2's LayerNorm, parallel block and ungated MLP have no decode kernels".into(),
            );
        }
        // Before the per-layer scan below, which would name every expert.
        if c.moe.is_some() {
            return Some("a mixture of experts has no decode kernels".into());
        }
        if self.embed_tokens.track_op() {
            return Some("the embedding is being trained".into());
        }
        // Checked every step, so without building the layers' names unless one is refused.
        let plain = |l: &Linear| l.adapter.is_none() && !l.weight.track_op();
        let all_plain = self
            .layers
            .iter()
            .all(|layer| layer.linears().into_iter().all(|(_, l)| plain(l)));
        if !all_plain || !plain(&self.lm_head) {
            let (name, _) = self
                .linears()
                .into_iter()
                .find(|(_, l)| !plain(l))
                .expect("one layer is not plain");
            return Some(format!(
                "{name} has an unmerged adapter or is being trained"
            ));
        }
        for layer in &self.layers {
            if layer.self_attn.q_norm.is_some() != layer.self_attn.k_norm.is_some() {
                return Some("only one of q_norm / k_norm is set".into());
            }
            if layer.pre_feedforward_layernorm.is_some()
                != layer.post_feedforward_layernorm.is_some()
            {
                return Some("only one of the feed-forward sandwich norms is set".into());
            }
        }
        None
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
    pub(super) fn decode_step_checked(
        &self,
        input_ids: &Tensor,
        layout: &AttentionLayout,
        cache: &mut KvCache,
    ) -> CResult<Tensor> {
        let c = &self.config;
        let (batch, _) = input_ids.dims2()?;
        let heads = Heads {
            query: c.num_attention_heads,
            kv: c.num_key_value_heads,
            dim: c.head_dim,
        };
        let pos = cache.len();
        cache.reserve(
            pos + 1,
            (batch, heads.kv, heads.dim),
            self.dtype,
            &self.device,
        )?;
        let (eps, offset) = (c.rms_norm_eps, c.norm_weight_offset_one);
        let act = self.gated_act();
        let scale = self.attention_scale();

        let mut x = self.embed(input_ids)?.reshape((batch, c.hidden_size))?;
        // Rotary tables as `[batch, rotary_dim]` rows: the model's, and Gemma 3's local ones.
        let tables = |rope: &crate::rope::RotaryEmbedding| -> CResult<(Tensor, Tensor)> {
            let (cos, sin) = rope.cos_sin(&layout.positions, self.dtype, &self.device)?;
            let rot = cos.dim(3)?;
            Ok((cos.reshape((batch, rot))?, sin.reshape((batch, rot))?))
        };
        let global = tables(&self.rope)?;
        // Ministral 3's query temperature per row (`[rows, 1, 1]`), when one differs from 1.
        let q_scale = match c.llama4_attn_scale {
            Some((beta, original)) => super::llama4_query_scale(&layout.positions, beta, original)
                .map(|values| {
                    Tensor::from_vec(values, (batch, 1, 1), &self.device)?.to_dtype(self.dtype)
                })
                .transpose()?,
            None => None,
        };
        // NoPE layers (SmolLM3) go through the same kernel with identity tables: cos 1, sin 0.
        let identity = if self.layers.iter().any(|l| !l.use_rope) {
            let rot = global.0.dim(1)?;
            Some((
                Tensor::ones((batch, rot), self.dtype, &self.device)?,
                Tensor::zeros((batch, rot), self.dtype, &self.device)?,
            ))
        } else {
            None
        };
        let local = self.local_rope.as_ref().map(tables).transpose()?;
        let first: Vec<u32> = layout
            .key_valid
            .iter()
            .map(|v| v.iter().position(|&ok| ok).unwrap_or(pos) as u32)
            .collect();
        let first = FirstKeys::new(first, &self.device)?;

        for (layer, entry) in self.layers.iter().zip(&cache.layers) {
            let (k_cache, v_cache) = entry.as_ref().expect("reserved above");
            let attn = &layer.self_attn;
            let h = fused::rms_norm(&x, &layer.input_layernorm, eps, offset)?;
            let qkv = match &attn.qkv {
                QkvProjection::Separate {
                    q_proj,
                    k_proj,
                    v_proj,
                } => decode::linear_rows(
                    &h,
                    &[projection(q_proj), projection(k_proj), projection(v_proj)],
                    None,
                )?,
                QkvProjection::Fused { qkv_proj } => {
                    decode::linear_rows(&h, &[projection(qkv_proj)], None)?
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
            let (cos, sin) = match (&local, layer.local_rope, &identity) {
                (_, _, Some(id)) if !layer.use_rope => (&id.0, &id.1),
                (Some(local), true, _) => (&local.0, &local.1),
                _ => (&global.0, &global.1),
            };
            let q = decode::rope_into_cache(&qkv, cos, sin, norm, heads, k_cache, v_cache, pos)?;
            let q = match &q_scale {
                Some(s) => q.broadcast_mul(s)?,
                None => q,
            };
            let a = decode::cached_attention(
                &q,
                k_cache,
                v_cache,
                pos + 1,
                &first,
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
                    let o = decode::linear_rows(&a, &[projection(&attn.o_proj)], None)?;
                    x = (&x + fused::rms_norm(&o, post_attn, eps, offset)?)?;
                    fused::rms_norm(&x, pre_ff, eps, offset)?
                }
                None => {
                    x = decode::linear_rows(&a, &[projection(&attn.o_proj)], Some(&x))?;
                    fused::rms_norm(&x, post_attn, eps, offset)?
                }
            };
            let g = match &mlp.gate_up {
                GateUpProjection::Separate { gate_proj, up_proj } => {
                    decode::gated_rows(&h, projection(gate_proj), projection(up_proj), act)?
                }
                GateUpProjection::Ungated { .. } => {
                    bail!("decode_step: an ungated MLP has no decode kernel")
                }
                GateUpProjection::Fused { gate_up_proj } => {
                    // Rows [gate | up] of one matrix (and of its bias).
                    let inter = c.intermediate_size;
                    let half = |start: usize| -> CResult<(Tensor, Option<Tensor>)> {
                        Ok((
                            gate_up_proj.weight.narrow(0, start, inter)?,
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
                    let d = decode::linear_rows(&g, &[projection(&mlp.down_proj)], None)?;
                    (&x + fused::rms_norm(&d, post_ff, eps, offset)?)?
                }
                None => decode::linear_rows(&g, &[projection(&mlp.down_proj)], Some(&x))?,
            };
        }
        cache.filled = Some(pos + 1);
        self.final_norm(&x)?.reshape((batch, 1, c.hidden_size))
    }
}

fn projection(l: &Linear) -> Projection<'_> {
    Projection {
        weight: &l.weight,
        bias: l.bias.as_ref(),
    }
}
