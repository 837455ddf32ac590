//! The planned tensors of a GGUF file and the storage type of each (the k-quant mixes).

use crate::gguf_quants::QuantKind;

use super::*;

/// One tensor to write: its GGUF name, GGML dims (innermost first), type, and where its values
/// come from.
pub(super) struct Planned {
    pub(super) name: String,
    pub(super) dims: Vec<u64>,
    pub(super) ty: GgmlType,
    pub(super) source: Source,
}

pub(super) enum Source {
    /// An HF tensor (file index, name), rows reordered when `rows` is given.
    Hf {
        file: usize,
        name: String,
        rows: Option<Vec<usize>>,
        /// Gemma's norms: llama.cpp stores `1 + w`.
        plus_one: bool,
    },
    /// Values computed here (`rope_freqs`).
    Values(Vec<f32>),
    /// Experts' tensors (file index, name) stacked in expert order.
    Stacked(Vec<(usize, String)>),
    /// Values picked from an HF tensor (file index, name): value `i` is its flat value
    /// `index[i]` (DeepSeek's `kv_b_proj` split per head, the key half transposed).
    Gather {
        file: usize,
        name: String,
        index: Vec<usize>,
    },
    /// As [`Source::Gather`], each value then mapped (Qwen3.5's `ssm_a`, `-exp(A_log)`).
    Mapped {
        file: usize,
        name: String,
        index: Vec<usize>,
        map: fn(f32) -> f32,
    },
    /// OpenAI's MXFP4 weight `{name}_blocks` / `{name}_scales` (file indices and names), rows
    /// `start, start + step, ...` of each expert, repacked as llama.cpp's converter repacks them
    /// into MXFP4 blocks (the values unchanged).
    Mxfp4 {
        blocks: (usize, String),
        scales: (usize, String),
        start: usize,
        step: usize,
    },
}

/// The type a tensor of `shape` is stored in.
pub(super) fn storage_type(name: &str, shape: &[usize], outtype: OutType) -> GgmlType {
    if shape.len() < 2 {
        return GgmlType::F32;
    }
    if name.contains("ffn_gate_inp") {
        // Routers stay f32, as llama.cpp's converter and quantizer keep them.
        return GgmlType::F32;
    }
    match outtype {
        OutType::F32 => GgmlType::F32,
        OutType::F16 | OutType::Auto => GgmlType::F16,
        OutType::Bf16 => GgmlType::Bf16,
        // As gguf-py: rows that are not whole blocks fall back to f16.
        OutType::Q8_0 if shape[shape.len() - 1].is_multiple_of(Q8_0_BLOCK) => GgmlType::Q8_0,
        OutType::Q8_0 => GgmlType::F16,
        // Chosen per tensor by `assign_mix_types` once the whole file is planned.
        _ => GgmlType::F32,
    }
}

/// llama.cpp's `use_more_bits`: which of `n` layers the Q4_K_M / Q5_K_M mixes give Q6_K.
pub(super) fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i as isize - (n / 8) as isize).rem_euclid(3) == 2
}

/// What of the model, beyond its tensors' names and shapes, `llama-quantize`'s mixes look at.
#[derive(Debug, Clone, Copy)]
pub(super) struct MixModel {
    /// The routed experts (llama.cpp's `n_expert`; 0 for a dense model): 8 widens the
    /// attention.
    pub(super) experts: usize,
    /// llama.cpp's `LLM_TYPE_70B` (an 80-layer Llama or Qwen2): its Q4_K value projections are
    /// widened.
    pub(super) seventy_b: bool,
    /// A fused `attn_qkv` and DeepSeek's `attn_kv_b` are typed as value projections (llama.cpp
    /// since its tensor categories, 0.3.36, what the architectures of 2026 were checked against);
    /// otherwise `attn_qkv` has mid-2025 llama.cpp's own rule (what Phi-3 was checked against).
    pub(super) fused_as_value: bool,
}

/// The types of a k-quant mix, as `llama-quantize` chooses them for an f32 file with these
/// tensors in this order (`llama_tensor_get_type` without an importance matrix): only matrices
/// (not `[1, n]`) named `*weight` (not norms, routers or the DeltaNet's `ssm_conv1d`) are
/// quantized; the output
/// head (or the token embedding when it is tied) gets Q6_K, or Q8_0 when its rows are not whole
/// superblocks; Q4_K_M and Q5_K_M give Q6_K to the value projections (`attn_v`, and with
/// [`MixModel::fused_as_value`] `attn_qkv` and `attn_kv_b`; llama.cpp counts them in its order:
/// by layer, then by name) and `ffn_down` (experts' and shared experts' too) of the layers
/// [`use_more_bits`] picks; under the older rule a fused `attn_qkv` gets Q5_K (Q4_K_M) or Q6_K
/// (Q5_K_M); Q4_K_S gives Q5_K to the first 4 value projections and the first eighth's
/// `ffn_down`; a 70B model's Q4_K `attn_v` becomes Q5_K; with 8 experts (Mixtral, DeepSeek-V3)
/// the value projections and `attn_k` get Q8_0 and Q4_K_M's / Q4_K_S's `attn_output` Q5_K; the
/// legacy types (Q4_0, ...) are uniform but for the output; a row length that is not a multiple
/// of 256 falls back to Q5_0 / Q5_1 / Q8_0, and to f16 when not even of 32. Everything else
/// (the DeltaNet's `ssm_*` and `attn_gate`, MLA's `attn_k_b` / `attn_v_b` / `attn_q_a` /
/// `attn_kv_a_mqa`, the experts' other parts) takes the mix's base type.
pub(super) fn assign_mix_types(plan: &mut [Planned], outtype: OutType, model: MixModel) {
    let Some(base) = outtype.mix_base() else {
        return;
    };
    let MixModel {
        experts,
        seventy_b,
        fused_as_value,
    } = model;
    let more_bits_mix = matches!(outtype, OutType::Q4KM | OutType::Q5KM);
    let is_value = |name: &str| {
        name.contains("attn_v.weight")
            || name.contains("attn_qkv.weight")
            || (fused_as_value && name.contains("attn_kv_b.weight"))
    };
    let has_output = plan.iter().any(|t| t.name == "output.weight");
    // The layer number of `blk.N.*`.
    let layer = |name: &str| -> Option<usize> {
        name.strip_prefix("blk.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|n| n.parse().ok())
    };
    // The value projections in llama.cpp's order (layer, then name; tensors of no layer first):
    // its counter of them is the position in this list.
    let mut values: Vec<(Option<usize>, &str)> = plan
        .iter()
        .filter(|t| is_value(&t.name))
        .map(|t| (layer(&t.name), t.name.as_str()))
        .collect();
    values.sort();
    let value_index: std::collections::HashMap<String, usize> = values
        .iter()
        .enumerate()
        .map(|(i, (_, name))| (name.to_string(), i))
        .collect();
    let n_value = values.len();
    // llama.cpp sets its `ffn_down` count to the number of layers (a layer's experts and shared
    // expert both take that layer's choice).
    let n_down = plan
        .iter()
        .filter(|t| t.name.contains("ffn_down"))
        .map(|t| layer(&t.name).unwrap_or(0) + 1)
        .max()
        .unwrap_or(0);
    let q = GgmlType::Quant;
    for t in plan.iter_mut() {
        let name = t.name.as_str();
        // ggml's `ggml_n_dims`: trailing dimensions of 1 do not count (a `[1, n]` matrix is a
        // vector to llama.cpp, and stays f32).
        let n_dims = t.dims.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
        if n_dims < 2
            || !name.ends_with("weight")
            || name.contains("_norm.weight")
            || name.contains("ffn_gate_inp")
            || name.contains("ssm_conv1d")
        {
            continue;
        }
        let cols = t.dims[0] as usize;
        let mut ty = q(base);
        if name == "output.weight" || (!has_output && name == "token_embd.weight") {
            ty = if cols.is_multiple_of(base.block().0) {
                q(QuantKind::Q6K)
            } else {
                GgmlType::Q8_0
            };
        } else if name.contains("attn_qkv.weight") && !fused_as_value {
            // A fused projection's own rule in llama.cpp of mid-2025 (what the Phi-3 test checks
            // against); later llama.cpp treats it as `attn_v`.
            match outtype {
                OutType::Q4KM => ty = q(QuantKind::Q5K),
                OutType::Q5KM => ty = q(QuantKind::Q6K),
                _ => {}
            }
        } else if is_value(name) {
            let i = value_index[name];
            if more_bits_mix && use_more_bits(i, n_value) {
                ty = q(QuantKind::Q6K);
            } else if outtype == OutType::Q4KS && i < 4 {
                ty = q(QuantKind::Q5K);
            }
            if seventy_b && ty == q(QuantKind::Q4K) {
                // 70B models share each value projection among 8 heads: cheap to widen.
                ty = q(QuantKind::Q5K);
            }
            if experts == 8 {
                // Mixtral's value (and key) projections are small beside 8 experts: 8 bits.
                ty = GgmlType::Q8_0;
            }
        } else if name.contains("attn_k.weight") && experts == 8 {
            ty = GgmlType::Q8_0;
        } else if name.contains("attn_output.weight") && experts == 8 {
            if matches!(outtype, OutType::Q4KM | OutType::Q4KS) {
                ty = q(QuantKind::Q5K);
            }
        } else if name.contains("ffn_down") {
            let i = layer(name).unwrap_or(0);
            if more_bits_mix && use_more_bits(i, n_down) {
                ty = q(QuantKind::Q6K);
            } else if outtype == OutType::Q4KS && i < n_down / 8 {
                ty = q(QuantKind::Q5K);
            }
        }
        if !cols.is_multiple_of(ty.block()) {
            ty = match ty {
                GgmlType::Quant(QuantKind::Q4K) => q(QuantKind::Q5_0),
                GgmlType::Quant(QuantKind::Q5K) => q(QuantKind::Q5_1),
                GgmlType::Quant(QuantKind::Q6K) => GgmlType::Q8_0,
                other => other,
            };
            if !cols.is_multiple_of(ty.block()) {
                ty = GgmlType::F16;
            }
        }
        t.ty = ty;
    }
}
