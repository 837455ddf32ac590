//! Who attends to whom: [`AttentionLayout`] (positions, valid keys, packed samples) and the
//! additive masks built from it, and [`LayerInputs`], the rotary tables and masks every layer of
//! one forward call shares.

use std::collections::HashMap;

use candle_core::{DType, Device, Result as CResult, Tensor};
use ferrotune_core::{fused, ops};

use super::{llama4_query_scale, nope_query_temperature, CausalLm, DecoderLayer};

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
pub(super) struct AcrossLayers {
    /// The per-layer inputs `[b, t, layers, per_layer_dim]`.
    pub(super) per_layer_inputs: Option<Tensor>,
    /// Keys and values by the layer that computed them, for the layers that attend with them.
    pub(super) kv: HashMap<usize, (Tensor, Tensor)>,
}

/// Per-call tensors every decoder layer uses: rotary tables and attention masks.
#[derive(Debug, Clone)]
pub struct LayerInputs {
    cos: Tensor,
    sin: Tensor,
    /// Gemma 3: the local rotary tables of the sliding-attention layers.
    local_cos_sin: Option<(Tensor, Tensor)>,
    /// Ministral 3: the query temperature per position (`[b, 1, t, 1]`), when one differs from 1.
    pub(super) q_scale: Option<Tensor>,
    /// Llama 4: the NoPE layers' query temperature per position (`[b, 1, t, 1]`, f32), when one
    /// differs from 1.
    pub(super) nope_q_scale: Option<Tensor>,
    full_mask: Option<Tensor>,
    /// The masks of layers with a sliding window or an attention chunk, by `(window, chunk)`.
    limited_masks: Vec<(MaskLimits, Option<Tensor>)>,
    /// Gated DeltaNet models: whether each slot (cached + new) is a real token (`[b, past + t,
    /// 1]`, compute dtype), what zeroes padding before the linear attention.
    pub(super) token_valid: Option<Tensor>,
    /// Gated DeltaNet models with packed batches (several samples per row): `[b, t, width]`
    /// (f32), 1 where new position `i - s` is in the same sample as `i` (column `s`), what
    /// restarts the convolution and the delta rule at each sample's start.
    pub(super) sample_links: Option<Tensor>,
}

/// What confines a layer's attention besides causality: `(sliding window, attention chunk)`.
type MaskLimits = (Option<usize>, Option<usize>);

impl LayerInputs {
    /// The same inputs on `device` (copies, so the host-side mask building runs once per call).
    pub(super) fn to_device(&self, device: &Device) -> CResult<Self> {
        let opt = |m: &Option<Tensor>| super::to_device_opt(m, device);
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
            token_valid: opt(&self.token_valid)?,
            sample_links: opt(&self.sample_links)?,
        })
    }

    /// The rotary tables `(cos, sin)` of `layer`.
    pub(super) fn cos_sin(&self, layer: &DecoderLayer) -> (&Tensor, &Tensor) {
        match (&self.local_cos_sin, layer.local_rope) {
            (Some((cos, sin)), true) => (cos, sin),
            _ => (&self.cos, &self.sin),
        }
    }

    /// The additive mask of `layer` (full causal, or confined to its sliding window or chunk).
    pub(super) fn mask(&self, layer: &DecoderLayer) -> Option<&Tensor> {
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

impl CausalLm {
    /// What every layer of one forward call shares: rotary tables and attention masks.
    pub fn layer_inputs(&self, layout: &AttentionLayout) -> CResult<LayerInputs> {
        self.layer_inputs_on(layout, &self.device)
    }

    /// [`CausalLm::layer_inputs`] built on `device`.
    pub(super) fn layer_inputs_on(
        &self,
        layout: &AttentionLayout,
        device: &Device,
    ) -> CResult<LayerInputs> {
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
            token_valid: match self.config.delta_net {
                Some(_) => Some(super::delta_net::token_valid(layout, self.dtype, device)?),
                None => None,
            },
            sample_links: match (&self.config.delta_net, &layout.segments) {
                (Some(d), Some(segments)) => Some(super::delta_net::sample_links(
                    segments,
                    t,
                    d.conv_kernel.max(2),
                    device,
                )?),
                _ => None,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
