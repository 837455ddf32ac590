//! Rotary position embeddings: inverse frequencies for every `rope_type` transformers supports that
//! our families use, and cos/sin tables for arbitrary per-row positions (left padding, packing).
//!
//! Computed on the host in f32, step by step as transformers does in float32, then moved to the
//! device: the tables are tiny next to the attention they feed.

use candle_core::{DType, Device, Result, Tensor};

use crate::config::{ModelConfig, RopeConfig, RopeScaling};

/// Precomputed rotary frequencies for one model.
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    /// Rotated dimensions per head (`head_dim * partial_rotary_factor`).
    rotary_dim: usize,
    inv_freq: Vec<f32>,
    /// LongRoPE: frequencies used once the sequence exceeds the original context.
    long: Option<(usize, Vec<f32>)>,
    /// Dynamic NTK: recomputed for sequences longer than the original context.
    dynamic: Option<(f64, usize, f64)>,
    /// Multiplies cos and sin (YaRN / LongRoPE attention factor).
    attention_scaling: f32,
    /// Phi-3.5-MoE: `(original context, short_mscale, long_mscale)`, the factor on cos and sin
    /// chosen by the call's longest position instead of `attention_scaling`.
    mscales: Option<(usize, f32, f32)>,
}

fn default_inv_freq(base: f64, dim: usize) -> Vec<f32> {
    (0..dim)
        .step_by(2)
        .map(|i| 1.0f32 / (base as f32).powf(i as f32 / dim as f32))
        .collect()
}

impl RotaryEmbedding {
    /// Builds the frequencies for `cfg` (its `rope`).
    pub fn new(cfg: &ModelConfig) -> Self {
        Self::for_head_dim(cfg.head_dim, &cfg.rope)
    }

    /// Builds the frequencies of `rope` for heads of `head_dim` (Gemma 3's local rope is a second
    /// one; Gemma 4's full-attention layers have heads of their own size).
    pub fn for_head_dim(head_dim: usize, rope: &RopeConfig) -> Self {
        let dim = match rope.scaling {
            // Every pair rotates (some at frequency zero).
            RopeScaling::Proportional { .. } => head_dim,
            _ => ((head_dim as f64) * rope.partial_rotary_factor) as usize,
        };
        let base = rope.theta;
        let mut long = None;
        let mut dynamic = None;
        let mut mscales = None;
        let mut attention_scaling = 1.0f32;
        let inv_freq = match &rope.scaling {
            RopeScaling::Default => default_inv_freq(base, dim),
            RopeScaling::Linear { factor } => default_inv_freq(base, dim)
                .into_iter()
                .map(|f| f / *factor as f32)
                .collect(),
            RopeScaling::Dynamic {
                factor,
                original_max_position_embeddings,
            } => {
                dynamic = Some((*factor, *original_max_position_embeddings, base));
                default_inv_freq(base, dim)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old_ctx = *original_max_position_embeddings as f32;
                let (factor, low, high) = (
                    *factor as f32,
                    *low_freq_factor as f32,
                    *high_freq_factor as f32,
                );
                let low_freq_wavelen = old_ctx / low;
                let high_freq_wavelen = old_ctx / high;
                default_inv_freq(base, dim)
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wavelen > low_freq_wavelen {
                            f / factor
                        } else {
                            f
                        };
                        // wavelengths are finite, so "not below / not above" is the closed interval.
                        let medium = (high_freq_wavelen..=low_freq_wavelen).contains(&wavelen);
                        if medium {
                            let smooth = (old_ctx / wavelen - low) / (high - low);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
            RopeScaling::Proportional { factor } => {
                // transformers: int(partial_rotary_factor * head_dim // 2) rotated pairs.
                let rotated = (rope.partial_rotary_factor * head_dim as f64 / 2.0).floor() as usize;
                (0..head_dim / 2)
                    .map(|i| {
                        let f = if i < rotated {
                            1.0f32 / (base as f32).powf((2 * i) as f32 / head_dim as f32)
                        } else {
                            0.0
                        };
                        f / *factor as f32
                    })
                    .collect()
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                attention_factor,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                truncate,
            } => {
                let get_mscale = |scale: f64, m: f64| {
                    if scale <= 1.0 {
                        1.0
                    } else {
                        0.1 * m * scale.ln() + 1.0
                    }
                };
                attention_scaling =
                    attention_factor.unwrap_or_else(|| match (mscale, mscale_all_dim) {
                        (Some(m), Some(a)) if *m != 0.0 && *a != 0.0 => {
                            get_mscale(*factor, *m) / get_mscale(*factor, *a)
                        }
                        _ => get_mscale(*factor, 1.0),
                    }) as f32;
                let orig = *original_max_position_embeddings as f64;
                let correction_dim = |rot: f64| {
                    (dim as f64 * (orig / (rot * 2.0 * std::f64::consts::PI)).ln())
                        / (2.0 * base.ln())
                };
                let (mut lo, mut hi) = (correction_dim(*beta_fast), correction_dim(*beta_slow));
                if *truncate {
                    lo = lo.floor();
                    hi = hi.ceil();
                }
                let lo = lo.max(0.0) as f32;
                let mut hi = hi.min(dim as f64 - 1.0) as f32;
                if lo == hi {
                    hi += 0.001;
                }
                (0..dim / 2)
                    .map(|i| {
                        let pos_freq = (base as f32).powf((2 * i) as f32 / dim as f32);
                        let extrapolation = 1.0 / pos_freq;
                        let interpolation = 1.0 / (*factor as f32 * pos_freq);
                        let ramp = ((i as f32 - lo) / (hi - lo)).clamp(0.0, 1.0);
                        let extrapolation_weight = 1.0 - ramp;
                        interpolation * (1.0 - extrapolation_weight)
                            + extrapolation * extrapolation_weight
                    })
                    .collect()
            }
            RopeScaling::LongRope {
                short_factor,
                long_factor,
                factor,
                original_max_position_embeddings,
                attention_factor,
                mscales: phimoe_mscales,
            } => {
                let orig = *original_max_position_embeddings;
                attention_scaling = attention_factor.unwrap_or_else(|| {
                    if *factor <= 1.0 {
                        1.0
                    } else {
                        (1.0 + factor.ln() / (orig as f64).ln()).sqrt()
                    }
                }) as f32;
                let with = |ext: &[f64]| -> Vec<f32> {
                    (0..dim / 2)
                        .map(|i| {
                            let shape = (2 * i) as f32 / dim as f32;
                            1.0 / (ext.get(i).copied().unwrap_or(1.0) as f32
                                * (base as f32).powf(shape))
                        })
                        .collect()
                };
                match phimoe_mscales {
                    // transformers 5's Phi-3.5-MoE recomputes its frequencies every call without
                    // the sequence length, so the short factors serve every length.
                    Some((short, long)) => mscales = Some((orig, *short as f32, *long as f32)),
                    None => long = Some((orig, with(long_factor))),
                }
                with(short_factor)
            }
        };
        Self {
            rotary_dim: dim,
            inv_freq,
            long,
            dynamic,
            attention_scaling,
            mscales,
        }
    }

    /// The context length past which this embedding changes for every position (LongRoPE's long
    /// factors, Phi-3.5-MoE's long mscale): keys cached before a sequence outgrows it were rotated
    /// for the short one.
    pub fn switch_length(&self) -> Option<usize> {
        self.long
            .as_ref()
            .map(|(orig, _)| *orig)
            .or(self.mscales.map(|(orig, _, _)| orig))
    }

    /// Rotated dimensions per head.
    pub fn rotary_dim(&self) -> usize {
        self.rotary_dim
    }

    /// cos and sin tables `[batch, 1, seq, rotary_dim]` for `positions` (`batch` rows of `seq`).
    pub fn cos_sin(
        &self,
        positions: &[Vec<u32>],
        dtype: DType,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let batch = positions.len();
        let seq = positions.first().map_or(0, Vec::len);
        let max_pos = positions.iter().flatten().copied().max().unwrap_or(0) as usize;
        let dynamic_freq;
        // Frequencies for this call, chosen by the longest position as transformers'
        // `dynamic_rope_update` does.
        let inv_freq: &[f32] = match (&self.long, &self.dynamic) {
            (Some((orig, long)), _) if max_pos + 1 > *orig => long,
            (_, Some((factor, orig, base))) if max_pos + 1 > *orig => {
                let dim = self.rotary_dim as f64;
                let seq_len = (max_pos + 1) as f64;
                let b = base
                    * ((factor * seq_len / *orig as f64) - (factor - 1.0)).powf(dim / (dim - 2.0));
                dynamic_freq = default_inv_freq(b, self.rotary_dim);
                &dynamic_freq
            }
            _ => &self.inv_freq,
        };
        let scaling = match self.mscales {
            Some((orig, short, long)) => {
                if max_pos + 1 > orig {
                    long
                } else {
                    short
                }
            }
            None => self.attention_scaling,
        };
        let half = inv_freq.len();
        let mut cos = Vec::with_capacity(batch * seq * 2 * half);
        let mut sin = Vec::with_capacity(batch * seq * 2 * half);
        for row in positions {
            for &p in row {
                let p = p as f32;
                // emb = cat(freqs, freqs)
                for _ in 0..2 {
                    for &f in inv_freq {
                        let angle = p * f;
                        cos.push(angle.cos() * scaling);
                        sin.push(angle.sin() * scaling);
                    }
                }
            }
        }
        let shape = (batch, 1, seq, 2 * half);
        let cos = Tensor::from_vec(cos, shape, device)?.to_dtype(dtype)?;
        let sin = Tensor::from_vec(sin, shape, device)?.to_dtype(dtype)?;
        Ok((cos, sin))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cos and sin at one position, as f32 rows.
    fn at(rope: &RotaryEmbedding, pos: u32) -> (Vec<f32>, Vec<f32>) {
        let (cos, sin) = rope
            .cos_sin(&[vec![pos]], DType::F32, &Device::Cpu)
            .unwrap();
        let row = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (row(cos), row(sin))
    }

    /// The rotary embedding of a small one-layer model: `fields` (model type, rope parameters,
    /// ...) over shared small sizes, which `fields` may override.
    fn rope_of(fields: serde_json::Value) -> RotaryEmbedding {
        let mut hf = serde_json::json!({
            "vocab_size": 16, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2
        });
        for (key, value) in fields.as_object().unwrap() {
            hf[key] = value.clone();
        }
        RotaryEmbedding::new(&ModelConfig::from_hf_json(&hf).unwrap())
    }

    #[test]
    fn dynamic_ntk_matches_transformers() {
        // transformers 5.23's LlamaRotaryEmbedding (a fresh one per position) for this config:
        // default frequencies up to max_position_embeddings (12) positions, NTK-scaled beyond;
        // the `original_max_position_embeddings` given with it is ignored, as transformers does.
        let rope = rope_of(serde_json::json!({
            "model_type": "llama", "max_position_embeddings": 12,
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0,
                                "original_max_position_embeddings": 6}
        }));
        check(
            &rope,
            &[
                (
                    5,
                    vec![0.2836622, 0.8775826, 0.9987503, 0.9999875],
                    vec![-0.9589243, 0.4794255, 0.0499792, 0.005],
                ),
                (
                    11,
                    vec![0.0044257, 0.4535961, 0.9939561, 0.9999395],
                    vec![-0.9999902, 0.8912074, 0.1097783, 0.0109998],
                ),
                (
                    15,
                    vec![-0.7596879, 0.3009106, 0.9943122, 0.9999595],
                    vec![0.6502879, 0.9536524, 0.1065044, 0.0089999],
                ),
            ],
        );
    }

    /// Checks cos/sin rows (each half repeated) at several positions.
    fn check(rope: &RotaryEmbedding, want: &[(u32, Vec<f32>, Vec<f32>)]) {
        for (pos, cos_half, sin_half) in want {
            let (cos, sin) = at(rope, *pos);
            assert_row(&cos, &sin, cos_half, sin_half, &format!("at {pos}"));
        }
    }

    /// One position's cos and sin rows are `cos_half` and `sin_half`, each repeated.
    fn assert_row(cos: &[f32], sin: &[f32], cos_half: &[f32], sin_half: &[f32], what: &str) {
        let half = cos_half.len();
        assert_eq!(cos.len(), 2 * half);
        for i in 0..2 * half {
            assert!(
                (cos[i] - cos_half[i % half]).abs() < 3e-6,
                "cos {what}: {cos:?}"
            );
            assert!(
                (sin[i] - sin_half[i % half]).abs() < 3e-6,
                "sin {what}: {sin:?}"
            );
        }
    }

    #[test]
    fn phimoe_longrope_keeps_short_factors_and_switches_mscale() {
        // transformers 5.23's PhimoeRotaryEmbedding: the short factors at every length, cos and
        // sin times short_mscale (1.1) while the call's longest position is within the original
        // context (6), long_mscale (1.3) beyond.
        let rope = rope_of(serde_json::json!({
            "model_type": "phimoe", "max_position_embeddings": 512, "num_local_experts": 2,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                "short_factor": [1.0, 1.2, 1.4, 1.6], "long_factor": [2.0, 2.9, 3.8, 4.7],
                "short_mscale": 1.1, "long_mscale": 1.3, "original_max_position_embeddings": 6}
        }));
        check(
            &rope,
            &[
                (
                    3,
                    vec![-1.0889918, 1.0658036, 1.0997474, 1.0999981],
                    vec![0.155232, 0.2721444, 0.0235696, 0.0020625],
                ),
                (
                    5,
                    vec![0.3120284, 1.0058874, 1.0992986, 1.0999947],
                    vec![-1.0548167, 0.445186, 0.0392774, 0.0034375],
                ),
            ],
        );
        // Position 3 in a call reaching position 7.
        let (cos, sin) = rope
            .cos_sin(&[(0..8).collect()], DType::F32, &Device::Cpu)
            .unwrap();
        let row = |t: &Tensor| t.get(0).unwrap().get(0).unwrap().get(3).unwrap();
        let (cos, sin) = (
            row(&cos).to_vec1::<f32>().unwrap(),
            row(&sin).to_vec1::<f32>().unwrap(),
        );
        assert_row(
            &cos,
            &sin,
            &[-1.2869902, 1.2595861, 1.2997015, 1.2999977],
            &[0.183456, 0.3216251, 0.027855, 0.0024375],
            "at 3 of 0..8",
        );
    }

    #[test]
    fn longrope_short_and_long_factors_match_transformers() {
        // Phi-3.5-style: short factors up to original_max_position_embeddings (6) positions, long
        // beyond; attention factor sqrt(1 + ln(512 / 6) / ln 6); rotary over 0.75 of head_dim 16.
        let rope = rope_of(serde_json::json!({
            "model_type": "phi3", "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 512, "original_max_position_embeddings": 6,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.1, 1.2, 1.3, 1.4, 1.5],
                "long_factor": [1.5, 2.2, 2.9, 3.6, 4.3, 5.0]}
        }));
        check(
            &rope,
            &[
                (
                    3,
                    vec![
                        -1.8472514, 1.5529877, 1.8533763, 1.8654279, 1.8659048, 1.8659239,
                    ],
                    vec![
                        0.2633193, 1.0343618, 0.2160358, 0.043056, 0.0086143, 0.0017322,
                    ],
                ),
                (
                    10,
                    vec![
                        1.730398, 1.0404645, 1.8420755, 1.8652049, 1.8659012, 1.8659239,
                    ],
                    vec![
                        0.6981386, 1.5489056, 0.2973767, 0.0518246, 0.0093488, 0.0017322,
                    ],
                ),
            ],
        );
    }

    #[test]
    fn yarn_without_truncation_and_with_mscale_matches_transformers() {
        // head_dim 32: 16 frequencies, so the ramp between beta_fast and beta_slow (which depends
        // on original_max_position_embeddings) separates extrapolated, blended and interpolated
        // ones.
        let rope = rope_of(serde_json::json!({
            "model_type": "qwen2", "hidden_size": 128, "max_position_embeddings": 64,
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                "original_max_position_embeddings": 16, "beta_fast": 16.0, "beta_slow": 2.0,
                "truncate": false, "mscale": 0.8, "mscale_all_dim": 0.5}
        }));
        check(
            &rope,
            &[
                (
                    7,
                    vec![
                        0.783224, 0.575147, 0.883831, 0.988992, 1.023026, 1.033866, 1.037303,
                        1.03839, 1.038734, 1.038843, 1.038877, 1.038888, 1.038891, 1.038893,
                        1.038893, 1.038893,
                    ],
                    vec![
                        0.682539, 0.865162, 0.546023, 0.318109, 0.18088, 0.102072, 0.057463,
                        0.032325, 0.01818, 0.010224, 0.005749, 0.003233, 0.001818, 0.001022,
                        0.000575, 0.000323,
                    ],
                ),
                (
                    40,
                    vec![
                        -0.692877, 0.820862, -1.038671, -0.214009, 0.561316, 0.878913, 0.98738,
                        1.02251, 1.033703, 1.037251, 1.038374, 1.038729, 1.038841, 1.038877,
                        1.038888, 1.038891,
                    ],
                    vec![
                        0.774093, -0.636776, -0.021488, 1.016611, 0.874198, 0.553905, 0.323079,
                        0.183772, 0.103716, 0.05839, 0.032847, 0.018473, 0.010389, 0.005842,
                        0.003285, 0.001847,
                    ],
                ),
            ],
        );
    }
}
