//! Self-attention: [`Attention`] and its forward (projections, q/k norms, RoPE, the KV cache,
//! fused attention), and the per-position query temperatures (Ministral 3, Llama 4).

use candle_core::{DType, Result as CResult, Tensor, D};
use ferrotune_core::fused;

use super::{weightless_rms_norm, CausalLm, Linear, QkvProjection};
use crate::config::QkNormSpan;

/// Self-attention of one layer.
#[derive(Debug, Clone)]
pub struct Attention {
    pub qkv: QkvProjection,
    pub o_proj: Linear,
    /// The output projection's module name: `self_attn.o_proj` (Phi-2: `self_attn.dense`).
    pub o_proj_name: &'static str,
    /// The q/k RMSNorm weights: Qwen3's and Gemma 3's per head (`[head_dim]`), OLMo 2's over the
    /// whole projection (`[heads · head_dim]`, `[kv_heads · head_dim]`; see
    /// [`crate::config::ModelConfig::qk_norm_span`]).
    pub q_norm: Option<Tensor>,
    pub k_norm: Option<Tensor>,
    /// `(heads, kv_heads, head_dim)` of this layer (Gemma 4's full-attention layers have their
    /// own head size and key/value heads).
    pub dims: (usize, usize, usize),
    /// Gemma 4: the values pass a weightless RMSNorm of each head.
    pub v_norm: bool,
    /// Gemma 4: the earlier layer whose keys and values this one attends with.
    pub kv_source: Option<usize>,
    /// gpt-oss: the learned sink logit of each query head (`self_attn.sinks`, `[heads]`).
    pub sinks: Option<Tensor>,
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
pub(super) enum QueryScale<'a> {
    None,
    /// In the compute dtype (Ministral 3: transformers casts the factors first).
    Compute(&'a Tensor),
    /// f32 factors, the queries multiplied in f32 (Llama 4).
    F32(&'a Tensor),
}

/// Each head's last dim from Meta's adjacent rotary pairs `(x0, x1, x2, x3, ...)` to
/// transformers' halves `(x0, x2, ..., x1, x3, ...)`, for `[b, t, heads, head_dim]`.
pub(super) fn pairs_to_halves(x: &Tensor) -> CResult<Tensor> {
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

impl CausalLm {
    /// Self-attention of one layer; `rope` is `None` for a NoPE layer, `q_scale` the per-position
    /// query temperature (Ministral 3's, Llama 4's NoPE layers'); `shared` the keys and values a
    /// Gemma 4 KV-sharing layer attends with. Returns the output and the keys and values it
    /// attended with (`[b, kv_heads, past + t, head_dim]`, after the cache).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention(
        &self,
        attn: &Attention,
        x: &Tensor,
        rope: Option<(&Tensor, &Tensor)>,
        q_scale: QueryScale,
        mask: Option<&Tensor>,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
        shared: Option<&(Tensor, Tensor)>,
    ) -> CResult<(Tensor, (Tensor, Tensor))> {
        if let QkvProjection::Latent(latent) = &attn.qkv {
            return self.latent_attention(attn, latent, x, rope, mask, cache);
        }
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
            QkvProjection::Latent(_) | QkvProjection::DeltaNet(_) => {
                candle_core::bail!("latent attention and the Gated DeltaNet have their own forward")
            }
        };
        // Qwen3.5: each head's query and output gate side by side in `q_proj`'s output.
        let (q, gate) = if c.attn_output_gate {
            let both = q.reshape((b, t, nh, 2 * hd))?;
            let gate = both.narrow(D::Minus1, hd, hd)?.reshape((b, t, nh * hd))?;
            (both.narrow(D::Minus1, 0, hd)?.contiguous()?, Some(gate))
        } else {
            (q, None)
        };
        // The q/k norm: over the whole projection before it is split into heads (OLMo 2), or
        // over each head after.
        let qk_norm = |t: Tensor, w: &Option<Tensor>, span: QkNormSpan| match w {
            Some(w) if c.qk_norm_span == span => {
                fused::rms_norm(&t, w, c.rms_norm_eps, c.norm_weight_offset_one)
            }
            _ => Ok(t),
        };
        let q = qk_norm(q, &attn.q_norm, QkNormSpan::Projection)?;
        let mut q = qk_norm(q.reshape((b, t, nh, hd))?, &attn.q_norm, QkNormSpan::Head)?;
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
                let k = qk_norm(k, &attn.k_norm, QkNormSpan::Projection)?;
                let mut k = qk_norm(k.reshape((b, t, nkv, hd))?, &attn.k_norm, QkNormSpan::Head)?;
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
        let out = match &attn.sinks {
            // gpt-oss (which applies no softcap, whatever its config says, as transformers).
            Some(sinks) => fused::attention_with_sinks(&q, &k, &v, mask, scale, sinks)?,
            None => fused::attention_softcapped(&q, &k, &v, mask, scale, softcap)?,
        }; // [b, nh, t, hd]
        let out = out.transpose(1, 2)?.reshape((b, t, nh * hd))?;
        let out = match gate {
            Some(gate) => (out * super::gpt_oss::sigmoid(&gate)?)?,
            None => out,
        };
        Ok((attn.o_proj.forward(&out)?, (k, v)))
    }

    /// The factor on attention scores: `head_dim^-0.5`, or `query_pre_attn_scalar^-0.5` (Gemma 2/3).
    pub(super) fn attention_scale(&self) -> f64 {
        self.config
            .query_pre_attn_scalar
            .unwrap_or(self.config.head_dim as f64)
            .powf(-0.5)
    }
}
