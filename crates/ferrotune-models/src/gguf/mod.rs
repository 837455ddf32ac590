//! Loading llama.cpp GGUF files (v2/v3) as HF-style checkpoints.
//!
//! The metadata becomes a [`ModelConfig`] (through a config.json-shaped object, so it can be saved
//! as one), and every tensor is dequantized and renamed as in HF checkpoints, undoing what
//! llama.cpp's `convert_hf_to_gguf.py` changed on the way in, as transformers' own GGUF loader
//! (`modeling_gguf_pytorch_utils.py`) does:
//!
//! - GGUF dimensions are stored innermost first; tensors come out in PyTorch order (`[out, in]`).
//! - llama (and Mistral, which llama.cpp writes as `llama`) query/key rows are permuted for
//!   llama.cpp's interleaved RoPE; they are permuted back.
//! - Gemma norm weights were stored as `1 + w`; the 1 is subtracted again.
//! - Mixture-of-experts tensors stacked over experts (`ffn_gate_exps`, ...) are split into
//!   transformers' per-expert tensors; Phi-2's fused `attn_qkv` (older files) into q, k and v.
//!
//! Beyond transformers (whose GGUF loader leaves these out), rotary scaling is recovered too:
//! `rope.scaling.*` keys (linear, YaRN), Phi-3 LongRoPE factors stored as tensors, and Llama 3.x
//! frequency scaling when the `rope_freqs` tensor matches it.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use ferrotune_core::quant::QuantizedMatrix;

use crate::config::ModelConfig;
use crate::error::ModelError;

mod arch;
mod config;
mod deepseek2;
mod file;
mod gpt_oss;
mod mxfp4;
mod qwen35;
mod tensors;

pub use mxfp4::{
    dequantize_mxfp4, mxfp4_block_from_openai, quantize_mxfp4, GGML_TYPE_MXFP4, MXFP4_BLOCK,
    MXFP4_BLOCK_BYTES,
};

use arch::*;
use file::*;
use tensors::*;

/// Loads a llama.cpp GGUF (v2/v3) model: config from metadata, tensors dequantized to `dtype` on `device`, named as in HF checkpoints.
///
/// Supported architectures: `llama` (and Mistral, Mixtral), `qwen2`, `qwen2moe`, `qwen3`,
/// `qwen3moe`, `gemma`, `gemma2`, `gemma3`, `phi2`, `phi3`, `smollm3`, `deepseek2`, `gpt-oss`,
/// `qwen35`, `qwen35moe`, `qwen3next`; tensor
/// types F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and Q2_K to Q6_K, and MXFP4 (type 39) for
/// gpt-oss's experts. Every problem with the
/// file (missing, not a GGUF, truncated, unsupported type, missing metadata, tensor shapes that
/// disagree with the metadata) is a [`ModelError::File`] naming the file and what is wrong.
pub fn load_gguf(
    path: &Path,
    dtype: DType,
    device: &Device,
) -> Result<(ModelConfig, HashMap<String, Tensor>), ModelError> {
    let (config, tensors, _) = read_gguf(path, dtype, device, false)?;
    Ok((config, tensors))
}

/// Matrix weights (HF names) kept in their GGUF block format, for fast inference.
pub type PackedWeights = HashMap<String, QuantizedMatrix>;

/// As [`load_gguf`], and also keeps every quantized matrix weight (projections, output head and —
/// it serves as the head when tied — the embedding) in its block format. The packed copies hold
/// exactly the dequantized values; the decoder uses them when reading 4–8-bit blocks instead of
/// f32 is what bounds speed (decoding).
pub fn load_gguf_with_packed(
    path: &Path,
    dtype: DType,
    device: &Device,
) -> Result<(ModelConfig, HashMap<String, Tensor>, PackedWeights), ModelError> {
    read_gguf(path, dtype, device, true)
}

fn read_gguf(
    path: &Path,
    dtype: DType,
    device: &Device,
    keep_packed: bool,
) -> Result<(ModelConfig, HashMap<String, Tensor>, PackedWeights), ModelError> {
    let mut gguf = GgufFile::open(path)?;
    // DeepSeek's MLA tensors map many to one and its keys are its own: read apart.
    if gguf.string("general.architecture")? == Some(crate::family::deepseek::GGUF_ARCH) {
        return deepseek2::read(&mut gguf, dtype, device);
    }
    if gguf.string("general.architecture")? == Some(crate::family::gpt_oss::GGUF_ARCH) {
        return gpt_oss::read(&mut gguf, dtype, device);
    }
    // Qwen3.5's and Qwen3-Next's linear attention: tensors and keys of their own.
    let arch_name = gguf.string("general.architecture")?.map(str::to_string);
    if let Some((arch, _, _)) = crate::family::qwen3_5::GGUF_ARCHS
        .iter()
        .find(|(a, _, _)| Some(*a) == arch_name.as_deref())
    {
        return qwen35::read(&mut gguf, arch, dtype, device);
    }
    let arch = Arch::from_metadata(&gguf)?;
    let hp = HParams::read(&gguf, &arch)?;
    let config_json = gguf.config_json(&arch, &hp, dtype)?;
    let config = ModelConfig::from_hf_json(&config_json)
        .map_err(|msg| gguf.err(format!("the metadata gives an invalid model config: {msg}")))?;

    // Decide every tensor's fate (and check its type, shape and place in the file) before
    // dequantizing anything, so that a bad file fails fast.
    let mut plan = Vec::new();
    let mut names: Vec<&String> = gguf.content.tensor_infos.keys().collect();
    names.sort();
    for name in names {
        let Some(role) = Role::parse(name) else {
            if !CONSUMED_TENSORS.contains(&name.as_str()) {
                tracing::warn!(
                    "{}: ignoring GGUF tensor '{name}' (no HF counterpart)",
                    path.display()
                );
            }
            continue;
        };
        let expected = role
            .expected_shape(&hp, &arch)
            .map_err(|msg| gguf.tensor_err(name, msg))?;
        let info = &gguf.content.tensor_infos[name];
        // Qwen2-MoE's shared-expert gate may be stored as `[1, hidden]` as well as `[hidden]`.
        let row_vector = role.kind == Kind::SharedRouter && info.shape.dims() == [1, hp.hidden];
        if info.shape.dims() != expected.as_slice() && !row_vector {
            return Err(gguf.tensor_err(
                name,
                format!(
                    "has shape {:?} but the metadata implies {:?} (PyTorch order)",
                    info.shape.dims(),
                    expected
                ),
            ));
        }
        gguf.check_tensor_data(name)?;
        plan.push((name.clone(), role));
    }

    let mut tensors = HashMap::with_capacity(plan.len());
    let mut packed = PackedWeights::new();
    for (name, role) in plan {
        let q = gguf.read_qtensor(&name)?;
        let parts = role.hf_parts(&arch, &hp);
        if keep_packed && device.is_cpu() && role.is_stacked() {
            // Each expert's rows are contiguous blocks of the stacked tensor.
            if let Ok(data) = q.data() {
                let per_expert = data.len() / hp.experts;
                let row_bytes = per_expert / q.shape().dims()[1];
                for part in &parts {
                    let start = part.index.unwrap_or(0) * per_expert + part.start * row_bytes;
                    let bytes = data[start..start + part.len * row_bytes].to_vec();
                    let cols = q.shape().dims()[2];
                    if let Ok(m) =
                        QuantizedMatrix::from_ggml_bytes(q.dtype(), part.len, cols, bytes)
                    {
                        packed.insert(part.name.clone(), m);
                    }
                }
            }
        }
        // Block types the fused kernel does not cover (and F32/F16) stay dense only.
        let kernel = (keep_packed && device.is_cpu() && role.is_matrix() && parts.len() == 1)
            .then(|| QuantizedMatrix::from_qtensor(&q).ok())
            .flatten();
        if let Some(mut m) = kernel {
            if arch.permuted_qk {
                let heads = match role.kind {
                    Kind::Q => Some(hp.heads),
                    Kind::K => Some(hp.kv_heads),
                    _ => None,
                };
                if let Some(heads) = heads {
                    let order = unpermuted_row_order(m.rows(), heads)
                        .map_err(|msg| gguf.tensor_err(&name, msg))?;
                    m = m
                        .with_row_order(order)
                        .map_err(|e| gguf.tensor_err(&name, e))?;
                }
            }
            packed.insert(parts[0].name.clone(), m);
        }
        let mut t = gguf.dequantize_blocks(&name, &q)?;
        if arch.permuted_qk {
            // convert_hf_to_gguf.py permutes q with n_head and k with n_head_kv.
            match role.kind {
                Kind::Q => {
                    t = unpermute_rows(&t, hp.heads).map_err(|m| gguf.tensor_err(&name, m))?
                }
                Kind::K => {
                    t = unpermute_rows(&t, hp.kv_heads).map_err(|m| gguf.tensor_err(&name, m))?
                }
                _ => {}
            }
        }
        let finish = |t: Tensor| -> candle_core::Result<Tensor> {
            let t = if arch.norm_plus_one && name.ends_with("norm.weight") {
                (t - 1.0)?
            } else {
                t
            };
            t.to_dtype(dtype)?.to_device(device)
        };
        let t = finish(t).map_err(|e| {
            gguf.tensor_err(
                &name,
                format!("cannot be converted to {dtype:?} on {device:?}: {e}"),
            )
        })?;
        // Dequantized blocks are f32.
        crate::weight_checks::finite(gguf.path, &name, &t, Some(DType::F32))?;
        if let [whole] = parts.as_slice() {
            let t = if role.kind == Kind::SharedRouter {
                // transformers' `shared_expert_gate` is a `[1, hidden]` linear layer.
                t.reshape((1, hp.hidden))
                    .map_err(|e| gguf.tensor_err(&name, e))?
            } else {
                t
            };
            tensors.insert(whole.name.clone(), t);
            continue;
        }
        for part in parts {
            let piece = match part.index {
                Some(e) => t.get(e),
                None => Ok(t.clone()),
            }
            .and_then(|p| p.narrow(0, part.start, part.len))
            .map_err(|e| gguf.tensor_err(&name, format!("cannot be split: {e}")))?;
            tensors.insert(part.name, piece);
        }
    }
    Ok((config, tensors, packed))
}

/// One HF tensor cut from a GGUF tensor (see [`Role::hf_parts`]).
struct HfPart {
    name: String,
    /// The expert (first dimension) of a stacked tensor.
    index: Option<usize>,
    /// Rows `start .. start + len` of it (`len` 0 with a single part: the whole tensor).
    start: usize,
    len: usize,
}

/// Tensors that feed the config (rotary factors) rather than the model.
const CONSUMED_TENSORS: &[&str] = &[
    "rope_freqs.weight",
    "rope_factors_long.weight",
    "rope_factors_short.weight",
];

/// ggml type ids and names (ggml.h), for messages about types we cannot read.
const GGML_TYPE_NAMES: &[(u32, &str)] = &[
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (6, "Q5_0"),
    (7, "Q5_1"),
    (8, "Q8_0"),
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (12, "Q4_K"),
    (13, "Q5_K"),
    (14, "Q6_K"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (30, "BF16"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
    (39, "MXFP4"),
    (40, "NVFP4"),
];

const SUPPORTED_TYPES: &str =
    "F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4 (gpt-oss's experts)";

fn ggml_type_name(id: u32) -> String {
    GGML_TYPE_NAMES.iter().find(|(i, _)| *i == id).map_or_else(
        || format!("unknown type {id}"),
        |(_, n)| format!("{n} (ggml type {id})"),
    )
}
