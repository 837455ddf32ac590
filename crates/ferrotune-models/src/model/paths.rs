//! What each path over the decoder's layers cannot take, in one place. Four walkers run the
//! layers:
//!
//! - [`CausalLm::forward_hidden`], the whole forward on one device: every feature of every family;
//! - the same forward on a model spread over devices (`CausalLm::dispatch`), which runs the layers
//!   one at a time, device after device, and [`CausalLm::layer`], one layer at a time
//!   (activation checkpointing, sharded training, early exits, layer dropout): both refuse what
//!   [`CausalLm::layers_not_separable`] names;
//! - [`CausalLm::decode_step`], the GPU decode kernels: the forward serves a step with them only
//!   when [`CausalLm::decode_step_unsupported`] names nothing, and otherwise decodes with its own
//!   ops.
//!
//! A family feature that a path cannot take is refused here, with the reason.

use candle_core::Tensor;
use ferrotune_core::decode;

use super::{AttentionLayout, CausalLm, KvCache, Linear};
use crate::config::QkNormSpan;

impl CausalLm {
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

    /// Why [`CausalLm::decode_step`] cannot serve this call, or `None` when it can.
    pub(super) fn decode_step_unsupported(
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
        if c.gemma4.is_some() {
            return Some(
                "Gemma 4's per-layer head sizes, shared keys and values and per-layer inputs have no decode kernels"
                    .into(),
            );
        }
        if c.head_dim > decode::MAX_HEAD_DIM {
            return Some(format!(
                "head dimension {} is over {}",
                c.head_dim,
                decode::MAX_HEAD_DIM
            ));
        }
        if !c.pre_norms {
            return Some("layers without pre-norms (OLMo 2) have no decode kernels".into());
        }
        if c.qk_norm && c.qk_norm_span != QkNormSpan::Head {
            return Some(
                "a q/k norm over the whole projection (OLMo 2) has no decode kernel".into(),
            );
        }
        if c.layer_norm || c.parallel_block || c.ungated_mlp {
            return Some(
                "Phi-2's LayerNorm, parallel block and ungated MLP have no decode kernels".into(),
            );
        }
        // Named first for Qwen3.5-MoE too: the linear attention is what keeps it off the kernels.
        if c.delta_net.is_some() || c.attn_output_gate {
            return Some(
                "the Gated DeltaNet and gated attention (Qwen3.5, Qwen3-Next) have no decode kernels"
                    .into(),
            );
        }
        // Before the per-layer scan below, which would name every expert. This also keeps Llama 4
        // (always with a MoE config) out: its interleaved RoPE, L2 q/k norm, query temperature
        // and chunked attention have no decode kernels either.
        if c.moe.is_some() || c.gpt_oss_moe.is_some() {
            return Some("a mixture of experts has no decode kernels".into());
        }
        if c.mla.is_some() {
            return Some(
                "multi-head latent attention (DeepSeek) has no decode kernels: its cache holds latents"
                    .into(),
            );
        }
        if c.attention_sinks {
            return Some("attention sinks (gpt-oss) have no decode kernel".into());
        }
        if self.embed_tokens.track_op() {
            return Some("the embedding is being trained".into());
        }
        if self.embed_adapter.is_some() {
            return Some("the embedding has an unmerged adapter".into());
        }
        // Checked every step, so without building the layers' names unless one is refused.
        let plain = |l: &Linear| {
            l.adapter.is_none()
                && l.fake_quant.is_none()
                && l.weight.as_dense().is_some_and(|w| !w.track_op())
        };
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
}
