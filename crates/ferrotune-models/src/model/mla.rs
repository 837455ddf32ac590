//! Multi-head latent attention (DeepSeek-V2/V3): [`LatentProjection`], its loading and its
//! forward, as transformers 5.24's `DeepseekV3Attention` computes it.
//!
//! The queries come from `q_proj`, or from the low-rank `q_a_proj` → `q_a_layernorm` →
//! `q_b_proj`; each head's query is a part without rotary embedding (`qk_nope_head_dim`) and a
//! rotary part (`qk_rope_head_dim`). `kv_a_proj_with_mqa` gives a compressed latent
//! (`kv_lora_rank`, through `kv_a_layernorm`) and one rotary key shared by every head;
//! `kv_b_proj` expands the latent into each head's key part and value (`v_head_dim`).
//!
//! The KV cache holds the latent and the rotated shared key (`[b, 1, positions, kv_lora_rank]`
//! and `[b, 1, positions, qk_rope_head_dim]`), not the expanded keys and values: per token and
//! layer `kv_lora_rank + qk_rope_head_dim` numbers instead of
//! `heads · (qk_nope_head_dim + qk_rope_head_dim + v_head_dim)` (DeepSeek-V3: 576 instead of
//! 40960, 71× less; see [`latent_cache_ratio`]). Decoding attends over the cached latents
//! without expanding them where that costs less (`kv_b_proj` absorbed into the queries and the
//! output, [`absorbed_attention`]); training and long prefills expand them.

use candle_core::{Result as CResult, Tensor, D};
use ferrotune_core::fused;

use super::attention::pairs_to_halves;
use super::load::TensorTaker;
use super::{Attention, CausalLm, Linear};
use crate::config::{MlaConfig, ModelConfig};
use crate::error::ModelError;

/// The queries of a latent attention.
#[derive(Debug, Clone)]
pub enum LatentQuery {
    /// `q_proj` (`q_lora_rank: null`, DeepSeek-V2-Lite), `[heads · qk_head_dim, hidden]`.
    Direct { q_proj: Linear },
    /// `q_a_proj` (`[q_lora_rank, hidden]`) → `q_a_layernorm` (RMSNorm, `[q_lora_rank]`) →
    /// `q_b_proj` (`[heads · qk_head_dim, q_lora_rank]`).
    LowRank {
        q_a_proj: Linear,
        q_a_layernorm: Tensor,
        q_b_proj: Linear,
    },
}

/// Multi-head latent attention's projections but `o_proj` (see the module's documentation).
#[derive(Debug, Clone)]
pub struct LatentProjection {
    /// The queries' projections.
    pub query: LatentQuery,
    /// `[kv_lora_rank + qk_rope_head_dim, hidden]`: the latent, then the shared rotary key.
    pub kv_a_proj_with_mqa: Linear,
    /// `[kv_lora_rank]`.
    pub kv_a_layernorm: Tensor,
    /// `[heads · (qk_nope_head_dim + v_head_dim), kv_lora_rank]`: each head's key part, then its
    /// value.
    pub kv_b_proj: Linear,
}

/// The projections of a [`LatentProjection`], in `names` order: one body for the shared and the
/// mutable borrow.
macro_rules! latent_linears {
    ($projection:expr) => {{
        let LatentProjection {
            query,
            kv_a_proj_with_mqa,
            kv_b_proj,
            ..
        } = $projection;
        match query {
            LatentQuery::Direct { q_proj } => vec![q_proj, kv_a_proj_with_mqa, kv_b_proj],
            LatentQuery::LowRank {
                q_a_proj, q_b_proj, ..
            } => vec![q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj],
        }
    }};
}

/// The eps of `q_a_layernorm` and `kv_a_layernorm` (`DeepseekV3RMSNorm`'s default).
const LATENT_NORM_EPS: f64 = 1e-6;

/// The norm of the low-rank queries, by parameter name inside the decoder layer.
const Q_A_LAYERNORM: &str = "self_attn.q_a_layernorm.weight";
/// The latent's norm, by parameter name inside the decoder layer.
const KV_A_LAYERNORM: &str = "self_attn.kv_a_layernorm.weight";

impl LatentProjection {
    /// The module names, in the order of [`LatentProjection::linears`].
    pub(super) fn names(&self) -> &'static [&'static str] {
        match self.query {
            LatentQuery::Direct { .. } => &[
                "self_attn.q_proj",
                "self_attn.kv_a_proj_with_mqa",
                "self_attn.kv_b_proj",
            ],
            LatentQuery::LowRank { .. } => &[
                "self_attn.q_a_proj",
                "self_attn.q_b_proj",
                "self_attn.kv_a_proj_with_mqa",
                "self_attn.kv_b_proj",
            ],
        }
    }

    pub(super) fn linears(&self) -> Vec<&Linear> {
        latent_linears!(self)
    }

    pub(super) fn linears_mut(&mut self) -> Vec<&mut Linear> {
        latent_linears!(self)
    }

    /// The norms with their parameter names inside the decoder layer.
    pub(super) fn norms(&self) -> Vec<(&'static str, &Tensor)> {
        let mut out = Vec::with_capacity(2);
        if let LatentQuery::LowRank { q_a_layernorm, .. } = &self.query {
            out.push((Q_A_LAYERNORM, q_a_layernorm));
        }
        out.push((KV_A_LAYERNORM, &self.kv_a_layernorm));
        out
    }

    /// [`LatentProjection::linears_mut`] and the norms of [`LatentProjection::norms`], borrowed
    /// apart.
    pub(super) fn parts_mut(&mut self) -> (Vec<&mut Linear>, Vec<(&'static str, &mut Tensor)>) {
        let LatentProjection {
            query,
            kv_a_proj_with_mqa,
            kv_a_layernorm,
            kv_b_proj,
        } = self;
        let mut norms = Vec::with_capacity(2);
        let mut linears = match query {
            LatentQuery::Direct { q_proj } => vec![q_proj],
            LatentQuery::LowRank {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
            } => {
                norms.push((Q_A_LAYERNORM, q_a_layernorm));
                vec![q_a_proj, q_b_proj]
            }
        };
        linears.extend([kv_a_proj_with_mqa, kv_b_proj]);
        norms.push((KV_A_LAYERNORM, kv_a_layernorm));
        (linears, norms)
    }
}

/// How many times smaller the latent cache is than a cache of the expanded keys and values,
/// per token and layer: `heads · (qk_head_dim + v_head_dim) / (kv_lora_rank + qk_rope_head_dim)`.
pub fn latent_cache_ratio(config: &ModelConfig) -> Option<f64> {
    let m = config.mla.as_ref()?;
    let expanded = config.num_attention_heads * (m.qk_head_dim() + m.v_head_dim);
    Some(expanded as f64 / (m.kv_lora_rank + m.qk_rope_head_dim) as f64)
}

impl TensorTaker<'_> {
    /// The latent attention projections of layer `p` (`model.layers.N`); biases where the
    /// checkpoint has them (`attention_bias`).
    pub(super) fn latent_projection(
        &mut self,
        p: &str,
        m: &MlaConfig,
        heads: usize,
        hidden: usize,
    ) -> Result<LatentProjection, ModelError> {
        let q_width = heads * m.qk_head_dim();
        let query = match m.q_lora_rank {
            None => LatentQuery::Direct {
                q_proj: self.linear(&format!("{p}.self_attn.q_proj"), q_width, hidden)?,
            },
            Some(rank) => LatentQuery::LowRank {
                q_a_proj: self.linear(&format!("{p}.self_attn.q_a_proj"), rank, hidden)?,
                q_a_layernorm: self.take(&format!("{p}.{Q_A_LAYERNORM}"), &[rank])?,
                q_b_proj: self.linear(&format!("{p}.self_attn.q_b_proj"), q_width, rank)?,
            },
        };
        let rank = m.kv_lora_rank;
        Ok(LatentProjection {
            query,
            kv_a_proj_with_mqa: self.linear(
                &format!("{p}.self_attn.kv_a_proj_with_mqa"),
                rank + m.qk_rope_head_dim,
                hidden,
            )?,
            kv_a_layernorm: self.take(&format!("{p}.{KV_A_LAYERNORM}"), &[rank])?,
            kv_b_proj: self.linear(
                &format!("{p}.self_attn.kv_b_proj"),
                heads * (m.qk_nope_head_dim + m.v_head_dim),
                rank,
            )?,
        })
    }
}

/// `t` with `extra` zeros appended along its last dimension (nothing when `extra` is 0).
fn pad_last(t: &Tensor, extra: usize) -> CResult<Tensor> {
    if extra == 0 {
        return Ok(t.clone());
    }
    let mut dims = t.dims().to_vec();
    *dims.last_mut().expect("a 4-D tensor") = extra;
    let zeros = Tensor::zeros(dims, t.dtype(), t.device())?;
    Tensor::cat(&[t, &zeros], D::Minus1)
}

/// `kv_b_proj`'s weight where the absorbed form may stand in for it: a plain frozen matrix
/// (no adapter, fake quantization or bias), outside autograd.
fn absorbable<'a>(kv_b_proj: &'a Linear, x: &Tensor) -> Option<&'a Tensor> {
    let plain = kv_b_proj.adapter.is_none()
        && kv_b_proj.fake_quant.is_none()
        && kv_b_proj.bias.is_none()
        && !x.track_op();
    kv_b_proj
        .weight
        .as_dense()
        .filter(|w| plain && !w.track_op())
}

/// Whether the absorbed form costs less for `t` new tokens: expanding `s` cached latents costs
/// `s · rank · heads · (nope + v)`, attending in the latent space `heads · t · s` times
/// `2 · rank − nope − v` more than with expanded heads.
fn absorbs(m: &MlaConfig, t: usize) -> bool {
    let (rank, kv) = (m.kv_lora_rank, m.qk_nope_head_dim + m.v_head_dim);
    t * (2 * rank).saturating_sub(kv) <= rank * kv
}

/// Attention over the cached latents without expanding them (inference): `kv_b_proj`'s key half
/// is folded into the queries (`q_nope · W_UK`, per head, into the latent space) and its value
/// half applied after the attention (`(softmax · latent) · W_UVᵀ`), so every head attends one
/// shared key `[latent, k_rot]` whose latent part is also the value. The same products as the
/// expanded form, in another order. `w` is `kv_b_proj`'s weight as `[heads, nope + v, rank]`,
/// `q_pass` `[b, heads, t, nope]`, `q_rot` `[b, heads, t, rot]`, `latent` `[b, 1, s, rank]`,
/// `k_rot` `[b, 1, s, rot]`; returns `[b, heads, t, v]`.
fn absorbed_attention(
    w: &Tensor,
    q_pass: &Tensor,
    q_rot: &Tensor,
    latent: &Tensor,
    k_rot: &Tensor,
    mask: Option<&Tensor>,
    m: &MlaConfig,
) -> CResult<Tensor> {
    let (nope, rank) = (m.qk_nope_head_dim, m.kv_lora_rank);
    let w_uk = w.narrow(1, 0, nope)?.contiguous()?; // [heads, nope, rank]
    let w_uv_t = w
        .narrow(1, nope, m.v_head_dim)?
        .transpose(1, 2)?
        .contiguous()?; // [heads, rank, v]
    let q_latent = q_pass.broadcast_matmul(&w_uk)?; // [b, heads, t, rank]
    let q = Tensor::cat(&[&q_latent, q_rot], D::Minus1)?;
    let k = Tensor::cat(&[latent, k_rot], D::Minus1)?.contiguous()?; // [b, 1, s, rank + rot]
    let out = fused::attention_softcapped(&q, &k, &k, mask, m.softmax_scale, None)?;
    out.narrow(D::Minus1, 0, rank)?
        .contiguous()?
        .broadcast_matmul(&w_uv_t)
}

impl CausalLm {
    /// Multi-head latent attention of one layer on `x` (`[b, t, hidden]`): `rope` the rotary
    /// tables of these positions, `cache` the layer's latent cache (appended to). Returns the
    /// output and the cached latent and rotary key after this call.
    pub(super) fn latent_attention(
        &self,
        attn: &Attention,
        mla: &LatentProjection,
        x: &Tensor,
        rope: Option<(&Tensor, &Tensor)>,
        mask: Option<&Tensor>,
        cache: Option<&mut Option<(Tensor, Tensor)>>,
    ) -> CResult<(Tensor, (Tensor, Tensor))> {
        let c = &self.config;
        let m = c
            .mla
            .as_ref()
            .ok_or_else(|| candle_core::Error::Msg("latent attention without its config".into()))?;
        let (b, t, _) = x.dims3()?;
        let nh = attn.dims.0;
        let (nope, rot, vd, rank) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.v_head_dim,
            m.kv_lora_rank,
        );
        // transformers builds both latent norms with RMSNorm's default eps, not the config's.
        let eps = LATENT_NORM_EPS;
        let q = match &mla.query {
            LatentQuery::Direct { q_proj } => q_proj.forward(x)?,
            LatentQuery::LowRank {
                q_a_proj,
                q_a_layernorm,
                q_b_proj,
            } => {
                let low = fused::rms_norm(&q_a_proj.forward(x)?, q_a_layernorm, eps, false)?;
                q_b_proj.forward(&low)?
            }
        };
        let q = q.reshape((b, t, nh, nope + rot))?;
        let compressed = mla.kv_a_proj_with_mqa.forward(x)?;
        let latent = compressed.narrow(D::Minus1, 0, rank)?;
        let latent = fused::rms_norm(&latent, &mla.kv_a_layernorm, eps, false)?.unsqueeze(1)?;
        let k_rot = compressed
            .narrow(D::Minus1, rank, rot)?
            .reshape((b, t, 1, rot))?;
        // Adjacent rotary pairs are gathered into transformers' halves first: the same
        // reordering of queries and keys leaves their dot products as they are.
        let rotate = |r: Tensor| -> CResult<Tensor> {
            let r = if m.rope_interleave {
                pairs_to_halves(&r.contiguous()?)?
            } else {
                r
            };
            match rope {
                Some((cos, sin)) => fused::rope(&r.transpose(1, 2)?, cos, sin),
                None => r.transpose(1, 2)?.contiguous(),
            }
        };
        let q_rot = rotate(q.narrow(D::Minus1, nope, rot)?)?; // [b, nh, t, rot]
        let mut k_rot = rotate(k_rot)?; // [b, 1, t, rot]
        let mut latent = latent; // [b, 1, t, rank]
        let latent_cached = cache.is_some();
        if let Some(slot) = cache {
            if let Some((past_latent, past_rot)) = slot.as_ref() {
                latent = Tensor::cat(&[past_latent, &latent], 2)?;
                k_rot = Tensor::cat(&[past_rot, &k_rot], 2)?;
            }
            *slot = Some((latent.clone(), k_rot.clone()));
        }
        let cached = latent_cached;
        if let Some(w) = absorbable(&mla.kv_b_proj, x).filter(|_| cached && absorbs(m, t)) {
            let w = w.reshape((nh, nope + vd, rank))?;
            let q_pass = q
                .narrow(D::Minus1, 0, nope)?
                .transpose(1, 2)?
                .contiguous()?;
            let out = absorbed_attention(&w, &q_pass, &q_rot, &latent, &k_rot, mask, m)?;
            let out = out.transpose(1, 2)?.reshape((b, t, nh * vd))?;
            return Ok((attn.o_proj.forward(&out)?, (latent, k_rot)));
        }
        let s = latent.dim(2)?;
        let kv = mla
            .kv_b_proj
            .forward(&latent.squeeze(1)?)?
            .reshape((b, s, nh, nope + vd))?
            .transpose(1, 2)?; // [b, nh, s, nope + vd]
        let k_nope = kv.narrow(D::Minus1, 0, nope)?.contiguous()?;
        let v = kv.narrow(D::Minus1, nope, vd)?.contiguous()?;
        let k_shared = k_rot.broadcast_as((b, nh, s, rot))?.contiguous()?;
        let k = Tensor::cat(&[&k_nope, &k_shared], D::Minus1)?;
        let q_pass = q
            .narrow(D::Minus1, 0, nope)?
            .transpose(1, 2)?
            .contiguous()?;
        let q = Tensor::cat(&[&q_pass, &q_rot], D::Minus1)?;
        // The attention kernels take one head size for queries, keys and values: the narrower
        // side gets zero columns (nothing added to the scores, zero outputs dropped below).
        let width = (nope + rot).max(vd);
        let (q, k) = (
            pad_last(&q, width - nope - rot)?,
            pad_last(&k, width - nope - rot)?,
        );
        let v = pad_last(&v, width - vd)?;
        let out = fused::attention_softcapped(&q, &k, &v, mask, m.softmax_scale, None)?;
        let out = out
            .narrow(D::Minus1, 0, vd)?
            .transpose(1, 2)?
            .reshape((b, t, nh * vd))?;
        Ok((attn.o_proj.forward(&out)?, (latent, k_rot)))
    }
}
