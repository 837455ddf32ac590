//! The Gated DeltaNet (Qwen3.5's and Qwen3-Next's linear attention): [`GatedDeltaNet`], its
//! loading and its forward, as transformers 5.24's `Qwen3_5GatedDeltaNet` computes it.
//!
//! `in_proj_qkv` gives queries, keys and values, which pass a causal depthwise convolution
//! (`conv1d`, no bias) and SiLU; queries and keys are L2-normalized per head, the queries scaled
//! by `head_k_dim^-½`, and each key head serves `v_heads / k_heads` consecutive value heads. The
//! gated delta rule then runs over the positions with a state `[b, v_heads, head_k_dim,
//! head_v_dim]`: `S ← S · exp(g)`, `S ← S + k (β (v − kᵀS))ᵀ`, output `qᵀS`, with `β =
//! sigmoid(in_proj_b x)` and `g = −exp(A_log) · softplus(in_proj_a x + dt_bias)`. The output
//! passes the gated RMSNorm `w · x̂ · silu(in_proj_z x)` of each value head and `out_proj`.
//!
//! Over at least a chunk (64) of positions of unpacked rows (training, prefill) the rule runs in
//! its chunked form: in f32 on the CPU as one fused op with its own backward
//! (`ferrotune_core::fused::gated_delta_rule`, each chunk solved by forward substitution),
//! elsewhere (CUDA, other dtypes, `FERROTUNE_DELTA_RULE=0`) as candle ops (`delta_chunked`). Over
//! fewer positions (a decode step) and for packed rows (where a sample's start drops the state)
//! it runs in its recurrent form, as candle ops with their backward. With a cache the layer keeps, instead of keys and values, its convolution's last
//! `kernel - 1` inputs and the rule's state (`LinearState`): a decode step costs the same at any
//! length, and the cache does not grow with it.

use candle_core::{DType, Device, Result as CResult, Tensor, D};

use super::delta_chunked::{chunked_delta_rule, CHUNK};
use super::gpt_oss::sigmoid;
use super::load::TensorTaker;
use super::{AttentionLayout, CausalLm, Linear, LinearState};
use crate::config::DeltaNetConfig;
use crate::error::ModelError;

/// One layer's Gated DeltaNet but `out_proj` (the attention's `o_proj` slot).
#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    /// The input projections.
    pub projections: DeltaNetProjections,
    /// The depthwise convolution's weight, `[conv_dim, 1, kernel]`.
    pub conv1d: Tensor,
    /// `[value_heads]`.
    pub dt_bias: Tensor,
    /// `[value_heads]`.
    pub a_log: Tensor,
    /// The gated RMSNorm's weight, `[value_head_dim]`.
    pub norm: Tensor,
}

/// A Gated DeltaNet's input projections, as the checkpoint holds them.
// One per layer, inside a boxed `GatedDeltaNet`: the variants' sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum DeltaNetProjections {
    /// Qwen3.5's four: `in_proj_qkv` (`[2 · key_dim + value_dim, hidden]`: all queries, all
    /// keys, all values), `in_proj_z` (the output norm's gate, `[value_dim, hidden]`),
    /// `in_proj_b` (β before its sigmoid) and `in_proj_a` (the decay's input), `[value_heads,
    /// hidden]`.
    Split {
        qkv: Linear,
        z: Linear,
        b: Linear,
        a: Linear,
    },
    /// Qwen3-Next's two, grouped by key head: `in_proj_qkvz` (per key head its query, its key,
    /// then its value heads' values and gates) and `in_proj_ba` (per key head its value heads'
    /// β inputs, then their decay inputs).
    Fused { qkvz: Linear, ba: Linear },
}

const NAMES: [&str; 4] = [
    "linear_attn.in_proj_qkv",
    "linear_attn.in_proj_z",
    "linear_attn.in_proj_b",
    "linear_attn.in_proj_a",
];
const FUSED_NAMES: [&str; 2] = ["linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba"];
const CONV: &str = "linear_attn.conv1d.weight";
const DT_BIAS: &str = "linear_attn.dt_bias";
const A_LOG: &str = "linear_attn.A_log";
const NORM: &str = "linear_attn.norm.weight";
/// The output projection's module name inside the decoder layer.
pub(super) const OUT_PROJ: &str = "linear_attn.out_proj";

impl GatedDeltaNet {
    /// The module names, in the order of [`GatedDeltaNet::linears`].
    pub(super) fn names(&self) -> &'static [&'static str] {
        match self.projections {
            DeltaNetProjections::Split { .. } => &NAMES,
            DeltaNetProjections::Fused { .. } => &FUSED_NAMES,
        }
    }

    pub(super) fn linears(&self) -> Vec<&Linear> {
        match &self.projections {
            DeltaNetProjections::Split { qkv, z, b, a } => vec![qkv, z, b, a],
            DeltaNetProjections::Fused { qkvz, ba } => vec![qkvz, ba],
        }
    }

    pub(super) fn linears_mut(&mut self) -> Vec<&mut Linear> {
        self.parts_mut().0
    }

    /// The other parameters by name inside the decoder layer.
    pub(super) fn norms(&self) -> Vec<(&'static str, &Tensor)> {
        vec![
            (CONV, &self.conv1d),
            (DT_BIAS, &self.dt_bias),
            (A_LOG, &self.a_log),
            (NORM, &self.norm),
        ]
    }

    /// [`GatedDeltaNet::linears_mut`] and [`GatedDeltaNet::norms`], borrowed apart.
    pub(super) fn parts_mut(&mut self) -> (Vec<&mut Linear>, Vec<(&'static str, &mut Tensor)>) {
        let GatedDeltaNet {
            projections,
            conv1d,
            dt_bias,
            a_log,
            norm,
        } = self;
        let linears = match projections {
            DeltaNetProjections::Split { qkv, z, b, a } => vec![qkv, z, b, a],
            DeltaNetProjections::Fused { qkvz, ba } => vec![qkvz, ba],
        };
        (
            linears,
            vec![
                (CONV, conv1d),
                (DT_BIAS, dt_bias),
                (A_LOG, a_log),
                (NORM, norm),
            ],
        )
    }
}

impl TensorTaker<'_> {
    /// The Gated DeltaNet of layer `p` (`model.layers.N`).
    pub(super) fn gated_delta_net(
        &mut self,
        p: &str,
        d: &DeltaNetConfig,
        hidden: usize,
    ) -> Result<GatedDeltaNet, ModelError> {
        let value_dim = d.value_heads * d.value_head_dim;
        let vh = d.value_heads;
        let projections = if d.fused_projections {
            let [qkvz, ba] = FUSED_NAMES;
            DeltaNetProjections::Fused {
                qkvz: self.linear(&format!("{p}.{qkvz}"), d.conv_dim() + value_dim, hidden)?,
                ba: self.linear(&format!("{p}.{ba}"), 2 * vh, hidden)?,
            }
        } else {
            let [qkv, z, b, a] = NAMES;
            DeltaNetProjections::Split {
                qkv: self.linear(&format!("{p}.{qkv}"), d.conv_dim(), hidden)?,
                z: self.linear(&format!("{p}.{z}"), value_dim, hidden)?,
                b: self.linear(&format!("{p}.{b}"), vh, hidden)?,
                a: self.linear(&format!("{p}.{a}"), vh, hidden)?,
            }
        };
        Ok(GatedDeltaNet {
            projections,
            conv1d: self.take(&format!("{p}.{CONV}"), &[d.conv_dim(), 1, d.conv_kernel])?,
            dt_bias: self.take(&format!("{p}.{DT_BIAS}"), &[vh])?,
            a_log: self.take(&format!("{p}.{A_LOG}"), &[vh])?,
            norm: self.take(&format!("{p}.{NORM}"), &[d.value_head_dim])?,
        })
    }
}

/// The projections of `x` (`[b, t, hidden]`) in Qwen3.5's order: `(qkv [b, t, conv_dim] — all
/// queries, all keys, all values —, z [b, t, value_dim], b [b, t, value_heads], a [b, t,
/// value_heads])`; Qwen3-Next's fused ones regrouped from per key head.
fn project(
    projections: &DeltaNetProjections,
    d: &DeltaNetConfig,
    x: &Tensor,
) -> CResult<(Tensor, Tensor, Tensor, Tensor)> {
    match projections {
        DeltaNetProjections::Split { qkv, z, b, a } => {
            Ok((qkv.forward(x)?, z.forward(x)?, b.forward(x)?, a.forward(x)?))
        }
        DeltaNetProjections::Fused { qkvz, ba } => {
            let (bs, t, _) = x.dims3()?;
            let (kh, dk, dv) = (d.key_heads, d.key_head_dim, d.value_head_dim);
            let rep = d.value_heads / kh;
            let group = 2 * dk + 2 * rep * dv;
            let qkvz = qkvz.forward(x)?.reshape((bs, t, kh, group))?;
            // Each piece of every key head's group, heads kept in order: `[b, t, heads · n]`.
            let piece = |g: &Tensor, at: usize, n: usize| -> CResult<Tensor> {
                g.narrow(3, at, n)?.reshape((bs, t, kh * n))
            };
            let q = piece(&qkvz, 0, dk)?;
            let k = piece(&qkvz, dk, dk)?;
            let v = piece(&qkvz, 2 * dk, rep * dv)?;
            let z = piece(&qkvz, 2 * dk + rep * dv, rep * dv)?;
            let ba = ba.forward(x)?.reshape((bs, t, kh, 2 * rep))?;
            Ok((
                Tensor::cat(&[q, k, v], 2)?,
                z,
                piece(&ba, 0, rep)?,
                piece(&ba, rep, rep)?,
            ))
        }
    }
}

/// Whether each slot of `layout` (cached + new) is a real token, `[b, past + t, 1]`.
pub(super) fn token_valid(
    layout: &AttentionLayout,
    dtype: DType,
    device: &Device,
) -> CResult<Tensor> {
    let b = layout.key_valid.len();
    let n = layout.key_valid.first().map_or(0, Vec::len);
    let values: Vec<f32> = layout
        .key_valid
        .iter()
        .flatten()
        .map(|&v| if v { 1.0 } else { 0.0 })
        .collect();
    Tensor::from_vec(values, (b, n, 1), device)?.to_dtype(dtype)
}

/// For packed rows (`segments`: the sample id of each key slot, cached + new, `[b][past + t]`),
/// whether each of the `t` new positions `i` shares its sample with position `i - s`, for `s` in
/// `0..width`: `[b, t, width]`, f32, 0 where `i - s` is before the new positions.
pub(super) fn sample_links(
    segments: &[Vec<u32>],
    t: usize,
    width: usize,
    device: &Device,
) -> CResult<Tensor> {
    let mut values = Vec::with_capacity(segments.len() * t * width);
    for row in segments {
        let new = &row[row.len() - t..];
        for i in 0..t {
            for s in 0..width {
                let same = i >= s && new[i - s..=i].iter().all(|&id| id == new[i]);
                values.push(if same { 1f32 } else { 0.0 });
            }
        }
    }
    Tensor::from_vec(values, (segments.len(), t, width), device)
}

/// `x · rsqrt(Σ x² + 1e-6)` over the last dimension (FLA's l2norm, as transformers').
fn l2_norm(x: &Tensor) -> CResult<Tensor> {
    let sum = x.sqr()?.sum_keepdim(D::Minus1)?;
    x.broadcast_div(&(sum + 1e-6)?.sqrt()?)
}

/// `log(1 + exp(x))`, computed as `relu(x) + log(1 + exp(−|x|))` so that it never overflows.
fn softplus(x: &Tensor) -> CResult<Tensor> {
    let tail = ((x.abs()?.neg()?.exp()? + 1.0)?).log()?;
    x.relu()? + tail
}

/// `[b, t, heads, d]` with each head repeated `n` times in place (`repeat_interleave`).
fn repeat_heads(x: &Tensor, n: usize) -> CResult<Tensor> {
    if n == 1 {
        return Ok(x.clone());
    }
    let (b, t, h, d) = x.dims4()?;
    x.unsqueeze(3)?
        .broadcast_as((b, t, h, n, d))?
        .contiguous()?
        .reshape((b, t, h * n, d))
}

/// The gated delta rule in its recurrent form, f32: `q`, `k` `[b, h, t, dk]`, `v` `[b, h, t,
/// dv]`, `decay` (`exp(g)`; 0 where a packed sample starts), `beta` `[b, h, t]`, from `state`
/// `[b, h, dk, dv]` (zeros when `None`); returns the output `[b, h, t, dv]` and the state after
/// the last position.
pub(super) fn recurrent_delta_rule(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    decay: &Tensor,
    beta: &Tensor,
    state: Option<Tensor>,
) -> CResult<(Tensor, Tensor)> {
    let (b, h, t, dk) = q.dims4()?;
    let dv = v.dim(3)?;
    let mut state = match state {
        Some(s) => s,
        None => Tensor::zeros((b, h, dk, dv), DType::F32, q.device())?,
    };
    let mut outs = Vec::with_capacity(t);
    for i in 0..t {
        let q_i = q.narrow(2, i, 1)?; // [b, h, 1, dk]
        let k_i = k.narrow(2, i, 1)?;
        let v_i = v.narrow(2, i, 1)?; // [b, h, 1, dv]
        let decay_i = decay.narrow(2, i, 1)?.unsqueeze(3)?; // [b, h, 1, 1]
        let beta_i = beta.narrow(2, i, 1)?.unsqueeze(3)?;
        state = state.broadcast_mul(&decay_i)?;
        let remembered = k_i.matmul(&state)?; // [b, h, 1, dv]
        let delta = (v_i - remembered)?.broadcast_mul(&beta_i)?;
        state = (state + k_i.transpose(2, 3)?.matmul(&delta)?)?;
        outs.push(q_i.matmul(&state)?);
    }
    Ok((Tensor::cat(&outs, 2)?, state))
}

impl CausalLm {
    /// A Gated DeltaNet layer on normed hidden states `x` (`[b, t, hidden]`), its output before
    /// `out_proj`. `valid` (`[b, past + t, 1]`) zeroes padding; `links` (packed rows, see
    /// [`sample_links`]) restart the convolution and the state at each sample. With a cache, `cache` holds the
    /// convolution's last inputs and the delta rule's state after the cached positions: the layer
    /// goes on from them and leaves them after its last position.
    pub(super) fn gated_delta_net(
        &self,
        net: &GatedDeltaNet,
        x: &Tensor,
        valid: Option<&Tensor>,
        links: Option<&Tensor>,
        cache: Option<&mut Option<LinearState>>,
    ) -> CResult<Tensor> {
        let Some(d) = &self.config.delta_net else {
            candle_core::bail!("a Gated DeltaNet layer in a model without a delta_net config");
        };
        if links.is_some() && cache.is_some() {
            candle_core::bail!(
                "packed batches with a cache are not supported by the Gated DeltaNet"
            );
        }
        let (b, t, _) = x.dims3()?;
        // transformers zeroes the padding positions' inputs (`apply_mask_to_padding_states`): a
        // left-padded row's state and convolution then start clean at its first real token.
        let x = match valid {
            Some(m) if m.dim(1)? >= t => x.broadcast_mul(&m.narrow(1, m.dim(1)? - t, t)?)?,
            Some(_) => candle_core::bail!("the padding mask is shorter than the new positions"),
            None => x.clone(),
        };
        let mut cache = cache;
        let (past_conv, past_state, past) = match cache.as_deref_mut().and_then(Option::take) {
            Some(s) => (Some(s.conv), Some(s.recurrent), s.positions),
            None => (None, None, 0),
        };
        let dtype = x.dtype();
        let (kh, vh, dk, dv) = (d.key_heads, d.value_heads, d.key_head_dim, d.value_head_dim);
        // The causal depthwise convolution (the cached inputs, or kernel - 1 zeros, before the
        // first position), summed in f32 and rounded once, as PyTorch's conv1d accumulates.
        let (qkv, z, b_in, a_in) = project(&net.projections, d, &x)?;
        let qkv = qkv.to_dtype(DType::F32)?; // [b, t, conv_dim]
        let kernel = d.conv_kernel;
        let w = net.conv1d.squeeze(1)?.to_dtype(DType::F32)?; // [conv_dim, kernel]
        let before = match past_conv {
            Some(c) => c,
            None => Tensor::zeros((b, kernel - 1, qkv.dim(2)?), DType::F32, x.device())?,
        };
        let padded = Tensor::cat(&[&before, &qkv], 1)?;
        let mut conv = padded
            .narrow(1, 0, t)?
            .broadcast_mul(&w.narrow(1, 0, 1)?.squeeze(1)?)?;
        // Packed rows: a tap reaching `s` positions back into another sample reads nothing (the
        // convolution restarts with zeros at each sample's start, as FLA's kernels with
        // `cu_seqlens` compute it).
        let link =
            |s: usize| -> CResult<Option<Tensor>> { links.map(|l| l.narrow(2, s, 1)).transpose() };
        if let Some(l) = link(kernel - 1)? {
            conv = conv.broadcast_mul(&l)?;
        }
        for j in 1..kernel {
            let tap = w.narrow(1, j, 1)?.squeeze(1)?;
            let term = padded.narrow(1, j, t)?.broadcast_mul(&tap)?;
            let term = match link(kernel - 1 - j)? {
                Some(l) if j + 1 < kernel => term.broadcast_mul(&l)?,
                _ => term,
            };
            conv = (conv + term)?;
        }
        let conv = conv.to_dtype(dtype)?;
        let conv = conv.silu()?;
        let key_dim = kh * dk;
        let q = conv.narrow(2, 0, key_dim)?.reshape((b, t, kh, dk))?;
        let k = conv.narrow(2, key_dim, key_dim)?.reshape((b, t, kh, dk))?;
        let v = conv
            .narrow(2, 2 * key_dim, vh * dv)?
            .reshape((b, t, vh, dv))?;
        let f32 = |t: &Tensor| t.to_dtype(DType::F32);
        let beta = sigmoid(&b_in)?; // [b, t, vh]
        let a = f32(&a_in)?;
        let g = softplus(&a.broadcast_add(&f32(&net.dt_bias)?)?)?
            .broadcast_mul(&f32(&net.a_log)?.exp()?.neg()?)?;
        let rep = vh / kh;
        let q = (l2_norm(&f32(&repeat_heads(&q, rep)?)?)? * (dk as f64).powf(-0.5))?;
        let k = l2_norm(&f32(&repeat_heads(&k, rep)?)?)?;
        let heads_first = |t: Tensor| t.transpose(1, 2)?.contiguous();
        let (q, k, v, beta) = (
            heads_first(q)?,
            heads_first(k)?,
            heads_first(f32(&v)?)?,
            heads_first(f32(&beta)?)?,
        );
        let fused = t >= CHUNK
            && links.is_none()
            && ferrotune_core::fused::delta_rule_applies(&[&q, &k, &v, &beta]);
        let (out, state) = match links {
            // At least a chunk of positions of unpacked rows in f32 on the CPU (training,
            // prefill): the fused kernel. (Under a chunk the recurrent form stays: in f32 it
            // lands nearer float64 than a chunked form, 1.7e-4 against 4.2e-4 on the in_proj_b
            // DoRA golden.)
            _ if fused => ferrotune_core::fused::gated_delta_rule(
                &q,
                &k,
                &v,
                &heads_first(g)?,
                &beta,
                past_state.as_ref(),
                None,
            )?,
            // At least a chunk of positions of unpacked rows (training, prefill): the chunked
            // form, as transformers runs them.
            None if t >= CHUNK => {
                chunked_delta_rule(&q, &k, &v, &heads_first(g)?, &beta, past_state)?
            }
            // Fewer positions (decoding; short sequences, where the chunk's 64 × 64 products
            // cost more than the steps), or packed rows: the recurrent form, where a packed
            // sample's start drops the state (its decay times 0).
            _ => {
                let decay = match links {
                    Some(l) => g.exp()?.broadcast_mul(&l.narrow(2, 1, 1)?)?,
                    None => g.exp()?,
                };
                recurrent_delta_rule(&q, &k, &v, &heads_first(decay)?, &beta, past_state)?
            }
        }; // [b, vh, t, dv]
        if let Some(slot) = cache {
            // What the next positions' convolution reads: the last kernel - 1 inputs.
            let conv = padded.narrow(1, t, kernel - 1)?.contiguous()?;
            *slot = Some(LinearState {
                conv,
                recurrent: state,
                positions: past + t,
            });
        }
        let out = out.transpose(1, 2)?.to_dtype(dtype)?;
        // The gated RMSNorm of each value head (`[b, t, vh, dv]`): normalized in f32, cast back,
        // times the weight, times silu(z) in f32.
        let z = z.reshape((b, t, vh, dv))?;
        let o = f32(&out)?;
        let var = o.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = o
            .broadcast_div(&(var + self.config.rms_norm_eps)?.sqrt()?)?
            .to_dtype(dtype)?
            .broadcast_mul(&net.norm)?;
        let gated = f32(&normed)?.mul(&f32(&z)?.silu()?)?;
        gated.to_dtype(dtype)?.reshape((b, t, vh * dv))
    }
}
