//! What each GGUF tensor is, and its HF names and shapes.

use candle_core::Tensor;

use crate::family::gguf::GgufNames;

use super::*;

/// What a GGUF tensor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Kind {
    Embed,
    Output,
    FinalNorm,
    AttnNorm,
    FfnNorm,
    /// Gemma 2/3: the norm of the attention's output (`post_attention_norm`).
    PostAttnNorm,
    /// Gemma 2/3: the norm of the MLP's output (`post_ffw_norm`).
    PostFfwNorm,
    Q,
    K,
    V,
    O,
    Qkv,
    QNorm,
    KNorm,
    Gate,
    Up,
    Down,
    /// A mixture of experts' router (`ffn_gate_inp`, `[experts, hidden]`).
    Router,
    /// Qwen2-MoE's shared expert's gate (`ffn_gate_inp_shexp`, `[hidden]` or `[1, hidden]`).
    SharedRouter,
    /// Every expert's gate / up / down projection stacked: `[experts, out, in]`.
    GateExps,
    UpExps,
    DownExps,
    /// Gate and up stacked per expert: `[experts, 2 · expert_ffn, hidden]`, gate rows first.
    GateUpExps,
    /// Qwen2-MoE's shared expert.
    SharedGate,
    SharedUp,
    SharedDown,
}

/// llama.cpp's top-level tensors, by kind.
pub(super) const TOP_KINDS: &[(&str, Kind)] = &[
    ("token_embd", Kind::Embed),
    ("output", Kind::Output),
    ("output_norm", Kind::FinalNorm),
];

/// llama.cpp's tensors under `blk.N.`, by kind.
pub(super) const LAYER_KINDS: &[(&str, Kind)] = &[
    ("attn_norm", Kind::AttnNorm),
    ("ffn_norm", Kind::FfnNorm),
    ("post_attention_norm", Kind::PostAttnNorm),
    ("post_ffw_norm", Kind::PostFfwNorm),
    ("attn_q", Kind::Q),
    ("attn_k", Kind::K),
    ("attn_v", Kind::V),
    ("attn_output", Kind::O),
    ("attn_qkv", Kind::Qkv),
    ("attn_q_norm", Kind::QNorm),
    ("attn_k_norm", Kind::KNorm),
    ("ffn_gate", Kind::Gate),
    ("ffn_up", Kind::Up),
    ("ffn_down", Kind::Down),
    ("ffn_gate_inp", Kind::Router),
    ("ffn_gate_inp_shexp", Kind::SharedRouter),
    ("ffn_gate_exps", Kind::GateExps),
    ("ffn_up_exps", Kind::UpExps),
    ("ffn_down_exps", Kind::DownExps),
    ("ffn_gate_up_exps", Kind::GateUpExps),
    ("ffn_gate_shexp", Kind::SharedGate),
    ("ffn_up_shexp", Kind::SharedUp),
    ("ffn_down_shexp", Kind::SharedDown),
];

impl Kind {
    /// llama.cpp's name of the kind (under `blk.N.` when `in_layer`).
    pub(super) fn part(self, in_layer: bool) -> &'static str {
        let table = if in_layer { LAYER_KINDS } else { TOP_KINDS };
        table
            .iter()
            .find(|(_, k)| *k == self)
            .map_or("", |(part, _)| part)
    }
}

/// A GGUF tensor's kind, layer, expert (llama.cpp's older per-expert tensors `ffn_gate.E`) and
/// whether it is a bias.
#[derive(Debug, Clone, Copy)]
pub(super) struct Role {
    pub(super) kind: Kind,
    pub(super) layer: Option<usize>,
    pub(super) expert: Option<usize>,
    pub(super) bias: bool,
}

impl Role {
    pub(super) fn parse(name: &str) -> Option<Self> {
        let (stem, bias) = if let Some(s) = name.strip_suffix(".weight") {
            (s, false)
        } else {
            (name.strip_suffix(".bias")?, true)
        };
        let top = |kind| {
            Some(Self {
                kind,
                layer: None,
                expert: None,
                bias,
            })
        };
        if let Some(&(_, kind)) = TOP_KINDS.iter().find(|(part, _)| *part == stem) {
            return top(kind);
        }
        let rest = stem.strip_prefix("blk.")?;
        let (layer, part) = rest.split_once('.')?;
        if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let layer = layer.parse().ok()?;
        // Older Mixtral files: one tensor per expert, `ffn_gate.E` / `ffn_up.E` / `ffn_down.E`.
        let (part, expert) = match part.split_once('.') {
            Some((p, e)) if !e.is_empty() && e.bytes().all(|b| b.is_ascii_digit()) => {
                if !matches!(p, "ffn_gate" | "ffn_up" | "ffn_down") {
                    return None;
                }
                (p, Some(e.parse().ok()?))
            }
            Some(_) => return None,
            None => (part, None),
        };
        let &(_, kind) = LAYER_KINDS.iter().find(|(p, _)| *p == part)?;
        Some(Self {
            kind,
            layer: Some(layer),
            expert,
            bias,
        })
    }

    /// Stacked experts: one GGUF tensor for every expert of a layer.
    pub(super) fn is_stacked(&self) -> bool {
        matches!(
            self.kind,
            Kind::GateExps | Kind::UpExps | Kind::DownExps | Kind::GateUpExps
        )
    }

    /// The HF tensors this GGUF tensor becomes, `(name, rows of this tensor)`: itself renamed, or
    /// its parts — each expert of a stacked tensor (`[experts, rows, in]`; gate and up halves of
    /// `ffn_gate_up_exps`) or Phi-2's fused `attn_qkv` split into q, k and v. Each part is
    /// `index` along the first dimension (stacked) and then rows `start .. start + len`.
    pub(super) fn hf_parts(&self, arch: &Arch, hp: &HParams) -> Vec<HfPart> {
        let layer = self.layer.unwrap_or(0);
        let suffix = if self.bias { "bias" } else { "weight" };
        let named = |module: String| format!("model.layers.{layer}.{module}.{suffix}");
        if self.is_stacked() {
            let rows = match self.kind {
                Kind::DownExps => hp.hidden,
                _ => hp.expert_ffn,
            };
            let halves: &[(Kind, usize)] = match self.kind {
                Kind::GateExps => &[(Kind::Gate, 0)],
                Kind::UpExps => &[(Kind::Up, 0)],
                Kind::DownExps => &[(Kind::Down, 0)],
                _ => &[(Kind::Gate, 0), (Kind::Up, 1)],
            };
            return (0..hp.experts)
                .flat_map(|e| {
                    halves.iter().map(move |&(part, half)| HfPart {
                        name: named(arch.expert_module(Some(e), part)),
                        index: Some(e),
                        start: half * rows,
                        len: rows,
                    })
                })
                .collect();
        }
        if self.kind == Kind::Qkv && arch.phi2() {
            let (q, kv) = (hp.heads * hp.head_dim, hp.kv_heads * hp.head_dim);
            return [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)]
                .into_iter()
                .map(|(proj, start, len)| HfPart {
                    name: named(format!("self_attn.{proj}")),
                    index: None,
                    start,
                    len,
                })
                .collect();
        }
        vec![HfPart {
            name: self.hf_name(arch),
            index: None,
            start: 0,
            len: 0,
        }]
    }

    /// A weight matrix used as `x @ W.T` (projections, the head, and the embedding, which is the
    /// head when tied), kept whole under one HF name; stacked experts are matrices too, split
    /// per expert.
    pub(super) fn is_matrix(&self) -> bool {
        !self.bias
            && matches!(
                self.kind,
                Kind::Embed
                    | Kind::Output
                    | Kind::Q
                    | Kind::K
                    | Kind::V
                    | Kind::O
                    | Kind::Qkv
                    | Kind::Gate
                    | Kind::Up
                    | Kind::Down
                    | Kind::SharedGate
                    | Kind::SharedUp
                    | Kind::SharedDown
            )
    }

    /// The HF name of a tensor that maps to one HF tensor (see [`Role::hf_parts`]), from the
    /// names table GGUF's reader and writer share ([`family::gguf::TENSOR_NAMES`]).
    pub(super) fn hf_name(&self, arch: &Arch) -> String {
        let suffix = if self.bias { "bias" } else { "weight" };
        let layer = self.layer.unwrap_or(0);
        if matches!(self.kind, Kind::Gate | Kind::Up | Kind::Down) && self.expert.is_some() {
            let module = arch.expert_module(self.expert, self.kind);
            return format!("model.layers.{layer}.{module}.{suffix}");
        }
        let in_layer = self.layer.is_some();
        let part = self.kind.part(in_layer);
        let module = arch
            .naming()
            .hf_module(part, in_layer)
            .unwrap_or_else(|| unreachable!("'{part}' has an HF name (stacked experts are split)"));
        if in_layer {
            format!("model.layers.{layer}.{module}.{suffix}")
        } else {
            format!("{module}.{suffix}")
        }
    }

    /// The PyTorch shape the metadata implies.
    pub(super) fn expected_shape(&self, hp: &HParams, arch: &Arch) -> Result<Vec<usize>, String> {
        if let Some(l) = self.layer {
            if l >= hp.layers {
                return Err(format!(
                    "belongs to layer {l} but {}.block_count is {}",
                    arch.gguf, hp.layers
                ));
            }
        }
        let h = hp.hidden;
        let q = hp.heads * hp.head_dim;
        let kv = hp.kv_heads * hp.head_dim;
        let up = if arch.reading.names == GgufNames::Phi3 {
            2 * hp.ffn
        } else {
            hp.ffn
        };
        let moe_part = matches!(
            self.kind,
            Kind::Router
                | Kind::SharedRouter
                | Kind::GateExps
                | Kind::UpExps
                | Kind::DownExps
                | Kind::GateUpExps
                | Kind::SharedGate
                | Kind::SharedUp
                | Kind::SharedDown
        ) || self.expert.is_some();
        if moe_part && hp.experts == 0 {
            return Err(format!(
                "is part of a mixture of experts but {}.expert_count is not set",
                arch.gguf
            ));
        }
        if let Some(e) = self.expert {
            if e >= hp.experts {
                return Err(format!(
                    "belongs to expert {e} but {}.expert_count is {}",
                    arch.gguf, hp.experts
                ));
            }
        }
        let (e, ffe) = (hp.experts, hp.expert_ffn);
        let shared = || {
            hp.shared_ffn.ok_or_else(|| {
                format!("is a shared expert, which {} models do not have", arch.gguf)
            })
        };
        if self.bias && moe_part {
            return Err("is a bias, which mixture-of-experts layers do not have".into());
        }
        let (out, inp) = match self.kind {
            Kind::Router => (e, h),
            Kind::SharedRouter => return Ok(vec![h]),
            Kind::GateExps | Kind::UpExps => return Ok(vec![e, ffe, h]),
            Kind::DownExps => return Ok(vec![e, h, ffe]),
            Kind::GateUpExps => return Ok(vec![e, 2 * ffe, h]),
            Kind::SharedGate | Kind::SharedUp => (shared()?, h),
            Kind::SharedDown => (h, shared()?),
            Kind::Gate | Kind::Up if self.expert.is_some() => (ffe, h),
            Kind::Down if self.expert.is_some() => (h, ffe),
            Kind::Embed | Kind::Output => (hp.vocab, h),
            Kind::FinalNorm
            | Kind::AttnNorm
            | Kind::FfnNorm
            | Kind::PostAttnNorm
            | Kind::PostFfwNorm => return Ok(vec![h]),
            Kind::QNorm | Kind::KNorm => return Ok(vec![hp.head_dim]),
            Kind::Q => (q, h),
            Kind::K | Kind::V => (kv, h),
            Kind::O => (h, q),
            Kind::Qkv => (q + 2 * kv, h),
            Kind::Gate => (hp.ffn, h),
            Kind::Up => (up, h),
            Kind::Down => (h, hp.ffn),
        };
        Ok(if self.bias { vec![out] } else { vec![out, inp] })
    }
}

/// The row order that [`unpermute_rows`] produces: HF row `r` is GGUF row `order[r]`.
pub(super) fn unpermuted_row_order(rows: usize, n_head: usize) -> Result<Vec<u32>, String> {
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        return Err(format!(
            "has {rows} rows, which cannot be split into {n_head} heads of (re, im) pairs"
        ));
    }
    let half = rows / n_head / 2;
    let mut order = Vec::with_capacity(rows);
    for h in 0..n_head {
        for j in 0..2 {
            for i in 0..half {
                order.push((h * 2 * half + i * 2 + j) as u32);
            }
        }
    }
    Ok(order)
}

/// Undoes convert_hf_to_gguf.py's `permute`: rows grouped per head as `(n_head, 2, half)` were
/// reordered to `(n_head, half, 2)` (interleaved RoPE pairs); this restores HF's half-split order.
pub(super) fn unpermute_rows(t: &Tensor, n_head: usize) -> Result<Tensor, String> {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        return Err(format!(
            "has {rows} rows, which cannot be split into {n_head} heads of (re, im) pairs"
        ));
    }
    let half = rows / n_head / 2;
    let rest: usize = dims[1..].iter().product();
    let un = || -> candle_core::Result<Tensor> {
        t.reshape((n_head, half, 2, rest))?
            .transpose(1, 2)?
            .contiguous()?
            .reshape(dims.as_slice())
    };
    un().map_err(|e| format!("cannot be un-permuted: {e}"))
}
