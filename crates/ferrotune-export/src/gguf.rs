//! A fine-tuned model as one GGUF file, llama.cpp's format (what `convert_hf_to_gguf.py` writes,
//! and unsloth's `save_pretrained_gguf`): the weights in f32, f16, bf16, Q8_0 or one of
//! `llama-quantize`'s k-quant mixes (Q4_K_M, Q5_K_M, Q6_K; see [`crate::gguf_quants`]), the
//! architecture's metadata and the tokenizer, so that llama.cpp, Ollama or `ferrotune generate`
//! run it.
//!
//! Written here: no Rust crate writes GGUF files (candle reads them), and the format is small —
//! a header, typed key/value metadata, tensor descriptions, then the aligned tensor data. The
//! tensors are streamed from the memory-mapped safetensors one at a time, so exporting an 8B
//! model does not hold it in memory; PyTorch `.bin` shards and Meta's `consolidated.00.pth` (as
//! llama.cpp's converter reads them) are read whole in their stored types.
//!
//! Supported: `llama` (Llama 2/3.x with llama3 RoPE, SmolLM2, Mistral without a sliding window;
//! llama.cpp's `llama` layout, q/k rows permuted as its converter does), `qwen2`, `qwen3`,
//! `gemma`, `gemma2`, `gemma3_text`, `phi` (llama.cpp's `phi2`), `smollm3`, `phi3` (fused projections,
//! LongRoPE factors), `mixtral`, `qwen2_moe`,
//! `qwen3_moe` (experts stacked as llama.cpp's `ffn_*_exps`), with a byte-level BPE tokenizer (llama.cpp's `gpt2` vocabulary) or a
//! SentencePiece-style BPE one (its `llama` vocabulary).

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use ferrotune_data::{gguf_vocab, Tokenizer};
use ferrotune_models::checkpoint::read_pickled;
use ferrotune_models::config::RopeScaling;
use ferrotune_models::family::gguf::{GgufNames, GgufNaming, GgufRopeTensors, GgufWindows};
use ferrotune_models::family::{self, GgufArch, GgufVariant};
use ferrotune_models::{CheckpointFormat, ModelConfig};
use half::{bf16, f16};
use safetensors::{Dtype, SafeTensors};

use crate::gguf_quants::{quantize, QuantKind};

/// Alignment of the tensor data (GGUF's default, `general.alignment` unset).
const ALIGNMENT: u64 = 32;
/// Values per Q8_0 block.
const Q8_0_BLOCK: usize = 32;

/// The storage type of the exported matrices (`--outtype`, as llama.cpp's converter names them).
/// Vectors (norms, biases) are always f32, as llama.cpp's converter writes them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutType {
    F32,
    F16,
    Bf16,
    /// 8-bit blocks of 32 values with an f16 scale each.
    Q8_0,
    /// `llama-quantize`'s Q4_K_M mix: Q4_K, with Q6_K for the output head and for the value
    /// projections and `ffn_down` of some layers.
    Q4KM,
    /// The Q5_K_M mix: Q5_K, Q6_K where Q4_K_M has it.
    Q5KM,
    /// Q6_K throughout.
    Q6K,
    /// The Q4_K_S mix: Q4_K, Q5_K for the first layers' `attn_v` and `ffn_down`.
    Q4KS,
    /// The Q5_K_S mix: Q5_K.
    Q5KS,
    /// f16, or bf16 when the checkpoint's weights are bf16 (llama.cpp's converter's `auto`).
    Auto,
    /// llama.cpp's legacy block types (blocks of 32), the output head Q6_K.
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
}

impl OutType {
    /// `f32`, `f16`, `bf16`, `q8_0`, `q4_k_m`, `q5_k_m` or `q6_k`.
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name.to_ascii_lowercase().as_str() {
            "f32" => OutType::F32,
            "f16" => OutType::F16,
            "bf16" => OutType::Bf16,
            "q8_0" => OutType::Q8_0,
            "q4_k_m" => OutType::Q4KM,
            "q5_k_m" => OutType::Q5KM,
            "q6_k" => OutType::Q6K,
            "q4_k_s" => OutType::Q4KS,
            "q5_k_s" => OutType::Q5KS,
            "auto" => OutType::Auto,
            "q4_0" => OutType::Q4_0,
            "q4_1" => OutType::Q4_1,
            "q5_0" => OutType::Q5_0,
            "q5_1" => OutType::Q5_1,
            other => bail!(
                "--outtype '{other}': expected f32, f16, bf16, auto, q8_0, q4_k_m, q4_k_s, \
                 q5_k_m, q5_k_s, q6_k, q4_0, q4_1, q5_0 or q5_1"
            ),
        })
    }

    /// The k-quant a mix is made of, or `None` for a plain type.
    fn mix_base(self) -> Option<QuantKind> {
        match self {
            OutType::Q4KM => Some(QuantKind::Q4K),
            OutType::Q5KM => Some(QuantKind::Q5K),
            OutType::Q6K => Some(QuantKind::Q6K),
            OutType::Q4KS => Some(QuantKind::Q4K),
            OutType::Q5KS => Some(QuantKind::Q5K),
            OutType::Q4_0 => Some(QuantKind::Q4_0),
            OutType::Q4_1 => Some(QuantKind::Q4_1),
            OutType::Q5_0 => Some(QuantKind::Q5_0),
            OutType::Q5_1 => Some(QuantKind::Q5_1),
            _ => None,
        }
    }

    /// `general.file_type` (llama.cpp's `LLAMA_FTYPE_*`).
    fn file_type(self) -> u32 {
        match self {
            OutType::F32 => 0,
            OutType::F16 | OutType::Auto => 1,
            OutType::Q8_0 => 7,
            OutType::Q4KM => 15,
            OutType::Q5KM => 17,
            OutType::Q6K => 18,
            OutType::Q4KS => 14,
            OutType::Q5KS => 16,
            OutType::Q4_0 => 2,
            OutType::Q4_1 => 3,
            OutType::Q5_0 => 8,
            OutType::Q5_1 => 9,
            OutType::Bf16 => 32,
        }
    }
}

/// A tensor's GGML type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GgmlType {
    F32,
    F16,
    Bf16,
    Q8_0,
    Quant(QuantKind),
}

impl GgmlType {
    fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q8_0 => 8,
            GgmlType::Bf16 => 30,
            GgmlType::Quant(k) => k.ggml_id(),
        }
    }

    fn bytes(self, numel: usize) -> u64 {
        (match self {
            GgmlType::F32 => numel * 4,
            GgmlType::F16 | GgmlType::Bf16 => numel * 2,
            GgmlType::Q8_0 => numel / Q8_0_BLOCK * (2 + Q8_0_BLOCK),
            GgmlType::Quant(k) => {
                let (values, bytes) = k.block();
                numel / values * bytes
            }
        }) as u64
    }

    /// Values per block (1 for the float types).
    fn block(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q8_0 => Q8_0_BLOCK,
            GgmlType::Quant(k) => k.block().0,
        }
    }
}

/// What [`export_gguf`] wrote.
#[derive(Debug, Clone)]
pub struct GgufExport {
    /// `general.architecture`.
    pub architecture: String,
    /// Tensors written.
    pub tensors: usize,
    /// Size of the file.
    pub bytes: u64,
    /// `tokenizer.ggml.pre`.
    pub pre_tokenizer: String,
    /// What the file cannot carry, for the user to know.
    pub notes: Vec<String>,
}

/// The llama.cpp architecture of a config, and whether its converter permutes q/k rows; an error
/// for what the architecture cannot express (llama.cpp fixes some settings per architecture).
fn architecture(config: &ModelConfig) -> Result<&'static GgufArch> {
    if config.score_labels.is_some() {
        bail!(
            "the checkpoint is a sequence classifier (a reward or value model, `score` head): \
             GGUF export writes causal language models"
        );
    }
    let Some(entry) = family::gguf_arch_for(&config.model_type) else {
        bail!(
            "GGUF export supports {} checkpoints, not '{}'",
            family::and_list(&family::gguf_writable_model_types()),
            config.model_type
        );
    };
    let arch = (entry.name, entry.permuted_qk);
    let w = &entry.writing;
    // llama.cpp's Gemma and Gemma 2 always use the embeddings as the output head (an
    // `output.weight` in the file would make it refuse the file).
    if w.tied_head_only && !config.tie_word_embeddings {
        bail!(
            "llama.cpp's '{}' ties the output head to the embeddings; this checkpoint has its own \
             lm_head (tie_word_embeddings false)",
            arch.0
        );
    }
    // Which layers attend in a window is fixed by llama.cpp per architecture: none, every other
    // layer from the first (Gemma 2), or for Phi-3 all of them when it has a window.
    let any_window = config.layer_sliding_windows.iter().any(Option::is_some);
    let windowed = |i: usize| match w.windows {
        GgufWindows::None => false,
        GgufWindows::EveryOther => i.is_multiple_of(2),
        // Gemma 3: five sliding layers, then a full one (llama.cpp's fixed pattern of 6).
        GgufWindows::FiveOfSix => i % 6 != 5,
        GgufWindows::AllOrNone => any_window,
    };
    let window = config
        .layer_sliding_windows
        .iter()
        .flatten()
        .next()
        .copied();
    let pattern_ok = config
        .layer_sliding_windows
        .iter()
        .enumerate()
        .all(|(i, w)| w.is_some() == windowed(i) && (w.is_none() || *w == window));
    if !pattern_ok {
        bail!(
            "the checkpoint's sliding-window layers are not the ones llama.cpp's '{}' \
             architecture uses (none, every other layer for Gemma 2, five of every six for Gemma 3, \
             all for Phi-3): the GGUF \
             would compute something else",
            arch.0
        );
    }
    // The architecture's own refusals (Gemma 3's fixed local rope, ...).
    (w.check)(config).map_err(anyhow::Error::msg)?;
    // llama.cpp's SmolLM3 leaves RoPE out of every fourth layer, whatever the config lists.
    let rope_ok = config
        .rope_layers
        .iter()
        .enumerate()
        .all(|(i, &rope)| rope == (!w.nope_every_fourth || (i + 1) % 4 != 0));
    if !rope_ok {
        bail!(
            "the checkpoint's layers without RoPE (no_rope_layers) are not llama.cpp's '{}' \
             (every fourth layer for smollm3, none elsewhere)",
            arch.0
        );
    }
    if let Some(moe) = &config.moe {
        // llama.cpp's graphs fix what transformers' configs choose: every layer sparse, and
        // renormalized top-k weights for Mixtral and Qwen3-MoE but not for Qwen2-MoE.
        if moe.sparse_layers.iter().any(|&s| !s) {
            bail!(
                "the checkpoint has dense layers among its mixture-of-experts layers \
                 (decoder_sparse_step / mlp_only_layers): llama.cpp's '{}' makes every layer sparse",
                arch.0
            );
        }
        let llama_cpp_norm = w.moe_norm_topk;
        if moe.norm_topk_prob != llama_cpp_norm {
            bail!(
                "norm_topk_prob {} is not what llama.cpp's '{}' computes ({llama_cpp_norm})",
                moe.norm_topk_prob,
                arch.0
            );
        }
    }
    if config.rope.partial_rotary_factor != 1.0 && !w.partial_rotary {
        bail!("GGUF export needs RoPE over whole heads (partial_rotary_factor 1)");
    }
    if let Some(big) = w.score_scale_27b_layers {
        // llama.cpp scales scores by the head size (hidden / heads for the 27B models).
        let scalar = config
            .query_pre_attn_scalar
            .unwrap_or(config.head_dim as f64);
        let llama_cpp = if config.num_hidden_layers == big {
            (config.hidden_size / config.num_attention_heads) as f64
        } else {
            config.head_dim as f64
        };
        if scalar != llama_cpp {
            bail!(
                "query_pre_attn_scalar {scalar} is not what llama.cpp's '{}' uses ({llama_cpp})",
                arch.0
            );
        }
    }
    Ok(entry)
}

/// llama.cpp's name of an HF tensor, from the names table GGUF's reader and writer share
/// ([`family::gguf::TENSOR_NAMES`]); `None` for what llama.cpp has no place for.
fn gguf_name(hf: &str, naming: &GgufNaming) -> Option<String> {
    let (stem, kind) = hf.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    if let Some(top) = naming.gguf_part(stem, false) {
        return Some(format!("{top}.{kind}"));
    }
    let rest = stem.strip_prefix("model.layers.")?;
    let (layer, module) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let part = naming.gguf_part(module, true)?;
    Some(format!("blk.{layer}.{part}.{kind}"))
}

/// What decides the names of `config`'s tensors in GGUF: its model type's reading
/// (Phi-2's and Phi-3's names, Mixtral's expert names) and its norms.
fn naming(config: &ModelConfig) -> GgufNaming {
    let reading = family::model_type(&config.model_type).map(|(_, t)| t.gguf_reading);
    GgufNaming {
        names: reading.map_or(GgufNames::Llama, |r| r.names),
        sandwich_norms: config.sandwich_norms,
        mixtral_names: reading.and_then(|r| r.moe).is_some_and(|m| m.mixtral_names),
    }
}

/// An expert's tensor (transformers 4.x's per-expert names, what checkpoints hold): its layer,
/// expert and the part (`gate`, `up`, `down`) of llama.cpp's stacked `ffn_{part}_exps`.
fn expert_part(hf: &str) -> Option<(usize, usize, &'static str)> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let rest = rest
        .strip_prefix("block_sparse_moe.experts.")
        .or_else(|| rest.strip_prefix("mlp.experts."))?;
    let (expert, proj) = rest.split_once('.')?;
    let part = match proj {
        "w1.weight" | "gate_proj.weight" => "gate",
        "w3.weight" | "up_proj.weight" => "up",
        "w2.weight" | "down_proj.weight" => "down",
        _ => return None,
    };
    Some((layer.parse().ok()?, expert.parse().ok()?, part))
}

/// llama.cpp's q/k row order for its RoPE: within each head, the rows of the first and second
/// halves interleaved (`convert_hf_to_gguf.py`'s `permute`). Row `p` of the result is row
/// `order[p]` of the HF tensor.
fn permuted_rows(rows: usize, heads: usize) -> Vec<usize> {
    let head_dim = rows / heads;
    let half = head_dim / 2;
    (0..rows)
        .map(|p| {
            let (h, r) = (p / head_dim, p % head_dim);
            h * head_dim + (r % 2) * half + r / 2
        })
        .collect()
}

/// llama.cpp's per-frequency factors of Llama 3's RoPE scaling (its `rope_freqs` tensor): 1 for
/// high frequencies, `factor` for low ones, smoothly in between, over `head_dim / 2` frequencies.
fn llama3_rope_factors(
    theta: f64,
    head_dim: usize,
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    original: usize,
) -> Vec<f32> {
    let old = original as f64;
    let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
    (0..head_dim / 2)
        .map(|i| {
            // In f32, as the converter computes the frequencies with torch.
            let freq = 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32);
            let wavelen = 2.0 * std::f64::consts::PI / freq as f64;
            let f = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth =
                    (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            f as f32
        })
        .collect()
}

/// One tensor to write: its GGUF name, GGML dims (innermost first), type, and where its values
/// come from.
struct Planned {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    source: Source,
}

enum Source {
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
}

/// The type a tensor of `shape` is stored in.
fn storage_type(name: &str, shape: &[usize], outtype: OutType) -> GgmlType {
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
fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i as isize - (n / 8) as isize).rem_euclid(3) == 2
}

/// The types of a k-quant mix, as `llama-quantize` chooses them for an f32 file with these
/// tensors in this order (`llama_tensor_get_type` without an importance matrix): only matrices
/// named `*weight` (not norms) are quantized; the output head (or the token embedding when it
/// is tied) gets Q6_K, or Q8_0 when its rows are not whole superblocks; Q4_K_M and Q5_K_M give
/// Q6_K to the value projections (`attn_v`) and `ffn_down` of the layers [`use_more_bits`]
/// picks (llama.cpp visits tensors by layer number, so its counters are layer indices), and a
/// fused `attn_qkv` Q5_K (Q4_K_M) or Q6_K (Q5_K_M); Q4_K_S gives Q5_K to the first 4 layers'
/// `attn_v` and the first eighth's `ffn_down`; a 70B model's Q4_K `attn_v` becomes Q5_K; with 8
/// experts (Mixtral) `attn_v` and `attn_k` get Q8_0 and Q4_K_M's / Q4_K_S's `attn_output` Q5_K;
/// the legacy types (Q4_0, ...) are uniform but for the output; a row length that is
/// not a multiple of 256 falls back to Q5_0 / Q5_1 / Q8_0, and to f16 when not even of 32.
fn assign_mix_types(plan: &mut [Planned], outtype: OutType, experts: usize, seventy_b: bool) {
    let Some(base) = outtype.mix_base() else {
        return;
    };
    let more_bits_mix = matches!(outtype, OutType::Q4KM | OutType::Q5KM);
    let is_value = |name: &str| name.contains("attn_v.weight") || name.contains("attn_qkv.weight");
    let n_value = plan.iter().filter(|t| is_value(&t.name)).count();
    let has_output = plan.iter().any(|t| t.name == "output.weight");
    // The layer number of `blk.N.*`.
    let layer = |name: &str| -> usize {
        name.strip_prefix("blk.")
            .and_then(|rest| rest.split('.').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0)
    };
    // llama.cpp sets its `ffn_down` count to the number of layers (a layer's experts and shared
    // expert both take that layer's choice).
    let n_down = plan
        .iter()
        .filter(|t| t.name.contains("ffn_down"))
        .map(|t| layer(&t.name) + 1)
        .max()
        .unwrap_or(0);
    let q = GgmlType::Quant;
    for t in plan.iter_mut() {
        let name = t.name.as_str();
        if t.dims.len() < 2
            || !name.ends_with("weight")
            || name.contains("_norm.weight")
            || name.contains("ffn_gate_inp")
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
        } else if name.contains("attn_qkv.weight") {
            // A fused projection's own rule in llama.cpp of mid-2025 (what the tests check
            // against); later llama.cpp treats it as `attn_v`.
            match outtype {
                OutType::Q4KM => ty = q(QuantKind::Q5K),
                OutType::Q5KM => ty = q(QuantKind::Q6K),
                _ => {}
            }
        } else if is_value(name) {
            let i = layer(name);
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
            let i = layer(name);
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

/// Writes the checkpoint folder `model_dir` — HF (config, safetensors or PyTorch `.bin`,
/// tokenizer) or Meta's (`consolidated.00.pth`, `params.json`; the tokenizer beside it or in the
/// parent folder) — as the GGUF file `out` with its matrices in `outtype`. The file is written under a temporary name and renamed
/// into place when complete.
pub fn export_gguf(model_dir: &Path, out: &Path, outtype: OutType) -> Result<GgufExport> {
    if model_dir.join("adapter_config.json").is_file() && !model_dir.join("config.json").is_file() {
        // A LoRA run's checkpoint folder: the adapter alone is not a model llama.cpp can run.
        bail!(
            "{}: {} (`ferrotune merge` writes one)",
            model_dir.display(),
            ferrotune_models::checkpoint::adapter_folder_hint(model_dir)
        );
    }
    let format = ferrotune_models::checkpoint::locate_weights(model_dir)?;
    // Memory-mapped safetensors (their headers plan the file, their data fills it), or
    // PyTorch pickles read whole.
    let maps = match &format {
        CheckpointFormat::Safetensors(files) => files
            .iter()
            .map(|f| {
                let file = File::open(f).with_context(|| format!("opening {}", f.display()))?;
                // SAFETY: the checkpoint is only read, and not expected to change while
                // exporting.
                unsafe { memmap2::Mmap::map(&file) }
                    .with_context(|| format!("mapping {}", f.display()))
            })
            .collect::<Result<Vec<_>>>()?,
        _ => Vec::new(),
    };
    let (config, weights) = match &format {
        CheckpointFormat::Safetensors(files) => {
            let config = ModelConfig::from_hf_file(&model_dir.join("config.json"))?;
            let views = maps
                .iter()
                .zip(files)
                .map(|(m, f)| {
                    SafeTensors::deserialize(m).with_context(|| format!("reading {}", f.display()))
                })
                .collect::<Result<_>>()?;
            (config, Weights::Mapped(views))
        }
        CheckpointFormat::Gguf(path) => bail!(
            "{} is already a GGUF file; export-gguf converts an HF checkpoint folder",
            path.display()
        ),
        CheckpointFormat::Pickle(_) | CheckpointFormat::Meta(_) => {
            let (config, tensors, quantized) =
                read_pickled(&format, model_dir, None, &Device::Cpu)?;
            if !quantized.is_empty() {
                bail!(
                    "{}: the checkpoint holds torchao-quantized layers ({}); export-gguf \
                     converts float weights",
                    model_dir.display(),
                    quantized[0].0
                );
            }
            (config, Weights::Loaded(tensors.into_iter().collect()))
        }
    };
    let entry = architecture(&config)?;
    let (arch, permute, w) = (entry.name, entry.permuted_qk, &entry.writing);
    // Meta's files sit in the `original/` folder of an HF download, whose tokenizer.json (and
    // name) is the parent's.
    let home = match (&format, model_dir.parent()) {
        (CheckpointFormat::Meta(_), Some(parent))
            if !model_dir.join("tokenizer.json").is_file()
                && parent.join("tokenizer.json").is_file() =>
        {
            parent
        }
        _ => model_dir,
    };
    let tok = Tokenizer::from_dir(home)
        .with_context(|| format!("reading the tokenizer of {}", home.display()))?;
    let vocab =
        gguf_vocab(&tok, config.vocab_size).map_err(|e| anyhow!("{}: {e}", home.display()))?;
    let mut notes = Vec::new();
    let pre = match vocab.pre {
        Some(p) => p.to_string(),
        // llama.cpp's SentencePiece tokenizer has no pre-tokenizer.
        None if vocab.model == "llama" => "default".into(),
        None => {
            notes.push(
                "the tokenizer's pre-tokenizer is not one llama.cpp names: written as 'default' \
                 (llama.cpp then splits text with GPT-2's rules)"
                    .into(),
            );
            "default".into()
        }
    };
    if let Some(note) = (w.note)(&config) {
        notes.push(note);
    }
    if config.eos_token_ids.len() > 1 {
        notes.push(format!(
            "GGUF holds one end-of-sequence id: {} of {:?} is written",
            config.eos_token_ids[0], config.eos_token_ids
        ));
    }

    let listed = weights.list();
    let q_rows = config.num_attention_heads * config.head_dim;
    let q_bias = listed
        .iter()
        .any(|(_, name, _)| name.ends_with("self_attn.q_proj.bias"));
    if w.q_bias_hidden_size && q_bias && q_rows != config.hidden_size {
        // llama.cpp 0.3.16 sizes the llama architecture's q bias by the hidden size and refuses
        // the file otherwise.
        bail!(
            "llama.cpp's 'llama' expects attention biases of the hidden size ({}), and this \
             checkpoint's q projection has {q_rows} outputs (heads × head_dim): llama.cpp \
             cannot load it",
            config.hidden_size
        );
    }
    let outtype = match outtype {
        // The first matrix's dtype decides, as llama.cpp's converter's `auto` does.
        OutType::Auto => {
            let first_matrix = weights.first_matrix_dtype();
            match first_matrix {
                Some(Dtype::BF16) => OutType::Bf16,
                _ => OutType::F16,
            }
        }
        other => other,
    };
    let mut plan = Vec::new();
    let mut skipped = Vec::new();
    // Experts by (layer, part), then by expert: (file, name, shape).
    type ExpertTensors = BTreeMap<usize, (usize, String, Vec<usize>)>;
    let mut experts: BTreeMap<(usize, &'static str), ExpertTensors> = BTreeMap::new();
    for (file, stored, stored_shape) in &listed {
        let (file, stored) = (*file, stored.as_str());
        {
            // A multimodal checkpoint (Gemma 3, Mistral 3): its text model, under the text
            // model's names; the vision tower and projector are left out (llama.cpp keeps them in
            // a separate projector file).
            let text_name = if config.text_of_multimodal {
                match config.text_model_name(stored) {
                    Some(n) => n,
                    None => continue,
                }
            } else {
                stored.to_string()
            };
            let name = text_name.as_str();
            if let Some((layer, expert, part)) = expert_part(name) {
                experts
                    .entry((layer, part))
                    .or_default()
                    .insert(expert, (file, stored.to_string(), stored_shape.clone()));
                continue;
            }
            let Some(gguf) = gguf_name(name, &naming(&config)) else {
                skipped.push(name.to_string());
                continue;
            };
            let mut shape = stored_shape.clone();
            if gguf.ends_with("ffn_gate_inp_shexp.weight") {
                // transformers' `[1, hidden]` linear layer; llama.cpp's converter writes a vector.
                shape = vec![shape.iter().product()];
            }
            let rows = match (permute, gguf.rsplit('.').nth(1)) {
                (true, Some(part)) if part == "attn_q" || part == "attn_k" => {
                    let heads = if part == "attn_q" {
                        config.num_attention_heads
                    } else {
                        config.num_key_value_heads
                    };
                    Some(permuted_rows(shape[0], heads))
                }
                _ if config.text_of_multimodal
                    && name == "model.embed_tokens.weight"
                    && shape[0] > config.vocab_size =>
                {
                    // Llama 3.2 Vision's embedding: its rows past the text vocabulary (image
                    // tokens) are left out, as the decoder leaves them.
                    shape[0] = config.vocab_size;
                    Some((0..config.vocab_size).collect())
                }
                _ => None,
            };
            let plus_one = config.norm_weight_offset_one && gguf.ends_with("norm.weight");
            plan.push(Planned {
                ty: storage_type(&gguf, &shape, outtype),
                name: gguf,
                dims: shape.iter().rev().map(|&d| d as u64).collect(),
                source: Source::Hf {
                    file,
                    name: stored.to_string(),
                    rows,
                    plus_one,
                },
            });
        }
    }
    // llama.cpp's `phi2` and `qwen2moe` require their own `output.weight` (other architectures
    // fall back to the embeddings): a tied head is written out as the embedding's copy.
    if w.output_required && config.tie_word_embeddings {
        if let Some((file, stored, shape)) = listed
            .iter()
            .find(|(_, n, _)| n == "model.embed_tokens.weight")
        {
            let name = "output.weight".to_string();
            plan.push(Planned {
                ty: storage_type(&name, shape, outtype),
                dims: shape.iter().rev().map(|&d| d as u64).collect(),
                name,
                source: Source::Hf {
                    file: *file,
                    name: stored.clone(),
                    rows: None,
                    plus_one: false,
                },
            });
        }
    }
    let expert_count = config.moe.as_ref().map_or(0, |m| m.num_experts);
    for ((layer, part), per_expert) in experts {
        let first_shape = per_expert.values().next().map(|(_, _, s)| s.clone());
        let complete = per_expert.len() == expert_count
            && per_expert.keys().copied().eq(0..expert_count)
            && per_expert
                .values()
                .all(|(_, _, s)| Some(s) == first_shape.as_ref());
        let shape = match (complete, first_shape) {
            (true, Some(s)) if s.len() == 2 => s,
            _ => bail!(
                "{}: layer {layer}'s experts' {part} projections are not {expert_count} matrices \
                 of one shape",
                model_dir.display()
            ),
        };
        let name = format!("blk.{layer}.ffn_{part}_exps.weight");
        let stacked = [expert_count, shape[0], shape[1]];
        plan.push(Planned {
            ty: storage_type(&name, &stacked, outtype),
            name,
            dims: stacked.iter().rev().map(|&d| d as u64).collect(),
            source: Source::Stacked(per_expert.into_values().map(|(f, n, _)| (f, n)).collect()),
        });
    }
    if !skipped.is_empty() {
        bail!(
            "{}: tensors llama.cpp's '{arch}' has no place for: {}",
            model_dir.display(),
            skipped.join(", ")
        );
    }
    match config.rope.scaling {
        RopeScaling::Default => {}
        // Written as llama.cpp's `rope.scaling.*` keys below (Gemma 3 4B+'s global rope too).
        RopeScaling::Linear { .. } => {}
        // YaRN as llama.cpp computes it: its default attention factor and rounded correction
        // range (transformers' `truncate`), with the betas in the file.
        RopeScaling::Yarn {
            attention_factor: None,
            mscale: None,
            mscale_all_dim: None,
            truncate: true,
            ..
        } => {}
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } if w.rope_tensors == GgufRopeTensors::Llama3Freqs => {
            let factors = llama3_rope_factors(
                config.rope.theta,
                config.head_dim,
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            );
            plan.push(Planned {
                name: "rope_freqs.weight".into(),
                dims: vec![factors.len() as u64],
                ty: GgmlType::F32,
                source: Source::Values(factors),
            });
        }
        // Phi-3's LongRoPE: llama.cpp keeps the per-frequency factors as tensors.
        RopeScaling::LongRope {
            ref short_factor,
            ref long_factor,
            ..
        } if w.rope_tensors == GgufRopeTensors::LongRopeFactors => {
            for (name, factors) in [
                ("rope_factors_long.weight", long_factor),
                ("rope_factors_short.weight", short_factor),
            ] {
                plan.push(Planned {
                    name: name.into(),
                    dims: vec![factors.len() as u64],
                    ty: GgmlType::F32,
                    source: Source::Values(factors.iter().map(|&f| f as f32).collect()),
                });
            }
        }
        ref other => bail!(
            "GGUF export supports plain RoPE, linear and YaRN scaling (with its default \
             attention factor), Llama 3's and Phi-3's, not {other:?}"
        ),
    }

    // llama.cpp's `LLM_TYPE_70B`: 80 layers of a Llama (grouped-query) or Qwen2.
    let seventy_b = (w.seventy_b)(&config);
    assign_mix_types(&mut plan, outtype, expert_count, seventy_b);
    let mut meta = Metadata::default();
    let name = folder_name(home, "model");
    // ferrotune (as transformers) tells Mistral from Llama by the name in a `llama` GGUF: a model
    // type its architecture reads back by name gets that name in front where it lacks it.
    let by_name = entry.variants.iter().find_map(|(v, t)| match v {
        GgufVariant::NameContains(s) if *t == config.model_type => Some(*s),
        _ => None,
    });
    let name = match by_name {
        Some(s) if !name.to_lowercase().contains(s) => {
            let mut chars = s.chars();
            let first = chars.next().map(|c| c.to_uppercase().collect::<String>());
            format!("{}{} {name}", first.unwrap_or_default(), chars.as_str())
        }
        _ => name,
    };
    meta.string("general.architecture", arch);
    meta.string("general.name", &name);
    meta.u32("general.file_type", outtype.file_type());
    meta.u32("general.quantization_version", 2);
    let k = |key: &str| format!("{arch}.{key}");
    meta.u32(&k("context_length"), config.max_position_embeddings as u32);
    meta.u32(&k("embedding_length"), config.hidden_size as u32);
    meta.u32(&k("block_count"), config.num_hidden_layers as u32);
    meta.u32(&k("feed_forward_length"), config.intermediate_size as u32);
    meta.u32(
        &k("attention.head_count"),
        config.num_attention_heads as u32,
    );
    meta.u32(
        &k("attention.head_count_kv"),
        config.num_key_value_heads as u32,
    );
    meta.f32(&k("rope.freq_base"), config.rope.theta as f32);
    // Phi-2's norms are LayerNorms, with their own key.
    let eps_key = if config.layer_norm {
        "attention.layer_norm_epsilon"
    } else {
        "attention.layer_norm_rms_epsilon"
    };
    meta.f32(&k(eps_key), config.rms_norm_eps as f32);
    let rope_dims = (config.head_dim as f64 * config.rope.partial_rotary_factor).round() as u32;
    meta.u32(&k("rope.dimension_count"), rope_dims);
    meta.u32(&k("attention.key_length"), config.head_dim as u32);
    meta.u32(&k("attention.value_length"), config.head_dim as u32);
    meta.u32(&k("vocab_size"), config.vocab_size as u32);
    if let Some(moe) = &config.moe {
        meta.u32(&k("expert_count"), moe.num_experts as u32);
        meta.u32(&k("expert_used_count"), moe.top_k as u32);
        if w.expert_ffn_key {
            meta.u32(
                &k("expert_feed_forward_length"),
                moe.expert_intermediate_size as u32,
            );
        }
        if let Some(shared) = moe.shared_expert_intermediate_size {
            meta.u32(&k("expert_shared_feed_forward_length"), shared as u32);
        }
    }
    if let Some(window) = config.layer_sliding_windows.iter().flatten().next() {
        meta.u32(&k("attention.sliding_window"), *window as u32);
    }
    if let RopeScaling::LongRope {
        original_max_position_embeddings: original,
        attention_factor,
        ..
    } = config.rope.scaling
    {
        // llama.cpp's converter: sqrt(1 + ln(scale) / ln(original)) unless the config says.
        let scale = config.max_position_embeddings as f64 / original as f64;
        let attn = attention_factor.unwrap_or(if scale <= 1.0 {
            1.0
        } else {
            (1.0 + scale.ln() / (original as f64).ln()).sqrt()
        });
        meta.u32(&k("rope.scaling.original_context_length"), original as u32);
        meta.f32(&k("rope.scaling.attn_factor"), attn as f32);
    }
    match config.rope.scaling {
        RopeScaling::Linear { factor } => {
            meta.string(&k("rope.scaling.type"), "linear");
            meta.f32(&k("rope.scaling.factor"), factor as f32);
        }
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            ..
        } => {
            meta.string(&k("rope.scaling.type"), "yarn");
            meta.f32(&k("rope.scaling.factor"), factor as f32);
            meta.u32(
                &k("rope.scaling.original_context_length"),
                original_max_position_embeddings as u32,
            );
            meta.f32(&k("rope.scaling.yarn_beta_fast"), beta_fast as f32);
            meta.f32(&k("rope.scaling.yarn_beta_slow"), beta_slow as f32);
        }
        _ => {}
    }
    if w.softcaps {
        // llama.cpp's keys; transformers' defaults when the config has none.
        let attn = config.attn_logit_softcapping.unwrap_or(50.0);
        let fin = config.final_logit_softcapping.unwrap_or(30.0);
        meta.f32(&k("attn_logit_softcapping"), attn as f32);
        meta.f32(&k("final_logit_softcapping"), fin as f32);
    }
    meta.string("tokenizer.ggml.model", vocab.model);
    meta.string("tokenizer.ggml.pre", &pre);
    meta.strings("tokenizer.ggml.tokens", &vocab.tokens);
    if let Some(scores) = &vocab.scores {
        meta.f32s("tokenizer.ggml.scores", scores);
    }
    meta.i32s("tokenizer.ggml.token_type", &vocab.token_types);
    // A SentencePiece vocabulary keeps its merges too: transformers' and ferrotune's GGUF
    // readers take them as they are (llama.cpp merges by the scores).
    meta.strings("tokenizer.ggml.merges", &vocab.merges);
    if let Some(prefix) = vocab.add_space_prefix {
        meta.bool("tokenizer.ggml.add_space_prefix", prefix);
    }
    let bos = tok.bos_id().or(config.bos_token_id);
    if let Some(id) = bos {
        meta.u32("tokenizer.ggml.bos_token_id", id);
    }
    if let Some(&id) = tok.eos_ids().first().or(config.eos_token_ids.first()) {
        meta.u32("tokenizer.ggml.eos_token_id", id);
    }
    if let Some(id) = tok.unk_id() {
        meta.u32("tokenizer.ggml.unknown_token_id", id);
    }
    if let Some(id) = tok.pad_id().or(config.pad_token_id) {
        meta.u32("tokenizer.ggml.padding_token_id", id);
    }
    meta.bool("tokenizer.ggml.add_bos_token", tok.add_bos_token());
    meta.bool("tokenizer.ggml.add_eos_token", tok.add_eos_token());
    if let Some(template) = tok.chat_template() {
        meta.string("tokenizer.chat_template", template);
    }

    let written = write_gguf(out, &plan, &meta, &weights)?;
    Ok(GgufExport {
        architecture: arch.into(),
        tensors: plan.len(),
        bytes: written,
        pre_tokenizer: pre,
        notes,
    })
}

/// A PEFT LoRA adapter (`adapter_dir`) of the HF model `base_dir` as llama.cpp's LoRA adapter
/// GGUF (what its `convert_lora_to_gguf.py` writes, for `llama-cli --lora`, Ollama's `ADAPTER`):
/// `general.type` `adapter`, `adapter.type` `lora`, `adapter.lora.alpha`, and per adapted
/// matrix `{gguf name}.lora_a` (`[r, in]`) and `.lora_b` (`[out, r]`, q/k rows in llama.cpp's
/// order where the architecture permutes them), in `outtype` (f32, f16 or bf16).
///
/// llama.cpp scales every matrix by `alpha / r` with one alpha per file: per-module ranks keep
/// their own `r`, but a scale it cannot express (rsLoRA's `alpha / sqrt(r)` beside other ranks,
/// `alpha_pattern`) is folded into `lora_b`. DoRA, adapters on experts or tied embeddings, and
/// `modules_to_save` have no llama.cpp form and are refused (merge instead).
pub fn export_gguf_adapter(
    adapter_dir: &Path,
    base_dir: &Path,
    out: &Path,
    outtype: OutType,
) -> Result<GgufExport> {
    use ferrotune_models::peft::{read_adapter_tensors, LoraConfig, PEFT_PREFIX};
    let lc = LoraConfig::read(adapter_dir)?;
    let merge_instead = "`ferrotune merge` it and export the merged model";
    if lc.use_dora {
        bail!(
            "{}: a DoRA adapter (use_dora); llama.cpp applies LoRA adapters only: {merge_instead}",
            adapter_dir.display()
        );
    }
    if !lc.target_parameters.is_empty() {
        bail!(
            "{}: the adapter targets parameters (target_parameters {:?}), which a llama.cpp \
             adapter cannot hold: {merge_instead}",
            adapter_dir.display(),
            lc.target_parameters
        );
    }
    if lc.lora_bias {
        bail!(
            "{}: the adapter has biases on lora_B (lora_bias), which a llama.cpp adapter cannot \
             hold (its LoRA tensors are A and B only): {merge_instead}",
            adapter_dir.display()
        );
    }
    if !lc.trainable_token_indices.is_empty() {
        bail!(
            "{}: the adapter replaces embedding rows (trainable_token_indices), which a llama.cpp \
             adapter cannot hold: {merge_instead}",
            adapter_dir.display()
        );
    }
    if !lc.modules_to_save.is_empty() {
        bail!(
            "{}: the adapter trains whole modules too (modules_to_save {:?}), which a llama.cpp \
             adapter cannot hold: {merge_instead}",
            adapter_dir.display(),
            lc.modules_to_save
        );
    }
    let ty = match outtype {
        OutType::F32 => GgmlType::F32,
        OutType::F16 => GgmlType::F16,
        OutType::Bf16 => GgmlType::Bf16,
        other => bail!("an adapter is exported as f32, f16 or bf16, not {other:?}"),
    };
    let config_file = base_dir.join("config.json");
    if !config_file.is_file() {
        bail!(
            "{}: the base model's HF folder (with config.json) is needed to name the adapter's \
             tensors as llama.cpp's architecture does",
            base_dir.display()
        );
    }
    let config = ModelConfig::from_hf_file(&config_file)?;
    let entry = architecture(&config)?;
    let (arch, permute) = (entry.name, entry.permuted_qk);
    let (file, tensors) = read_adapter_tensors(adapter_dir)?;

    // module -> (A, B)
    let mut modules: BTreeMap<String, (Option<Tensor>, Option<Tensor>)> = BTreeMap::new();
    let mut notes = Vec::new();
    let mut left_out = 0;
    let mut base_layers = 0;
    for (key, t) in tensors {
        let stem = key.strip_prefix(PEFT_PREFIX).unwrap_or(&key);
        if stem.contains(".base_layer.") {
            // PEFT's default save keeps the base weights of an adapted head beside the adapter;
            // llama.cpp applies the adapter to the base GGUF's own.
            base_layers += 1;
            continue;
        }
        let (module, is_a) = if let Some(m) = stem.strip_suffix(".lora_A.weight") {
            (m, true)
        } else if let Some(m) = stem.strip_suffix(".lora_B.weight") {
            (m, false)
        } else if let Some(m) = stem.strip_suffix(".lora_embedding_A") {
            (m, true)
        } else if let Some(m) = stem.strip_suffix(".lora_embedding_B") {
            (m, false)
        } else {
            bail!(
                "{}: tensor '{key}' is not a LoRA A or B matrix; llama.cpp adapters hold only \
                 those: {merge_instead}",
                file.display()
            );
        };
        let module = if config.text_of_multimodal {
            match config.text_model_name(module) {
                Some(m) => m,
                None => {
                    left_out += 1;
                    continue;
                }
            }
        } else {
            module.to_string()
        };
        let slot = modules.entry(module).or_default();
        if is_a {
            slot.0 = Some(t);
        } else {
            slot.1 = Some(t);
        }
    }
    if base_layers > 0 {
        notes.push(format!(
            "{base_layers} base weight tensor(s) PEFT saved beside the adapter left out (llama.cpp \
             applies the adapter to the base GGUF's weights)"
        ));
    }
    if left_out > 0 {
        notes.push(format!(
            "{left_out} adapter tensors of the vision tower / projector left out (the GGUF is the \
             text model's)"
        ));
    }
    if modules.is_empty() {
        bail!("{}: holds no LoRA matrices", file.display());
    }
    // One alpha for the file: the first module's `scale · r`; other modules' scales relative
    // to it go into their B.
    let mut alpha: Option<f64> = None;
    let mut folded = false;
    let mut plan = Vec::new();
    for (module, (a, b)) in modules {
        let (Some(a), Some(b)) = (a, b) else {
            bail!(
                "{}: module '{module}' lacks its lora_A or lora_B",
                file.display()
            );
        };
        let hf = format!("{module}.weight");
        if expert_part(&hf).is_some() {
            bail!(
                "{}: '{module}' is an expert; llama.cpp's adapters on stacked experts are not \
                 written here: {merge_instead}",
                file.display()
            );
        }
        if module == "lm_head" && config.tie_word_embeddings {
            bail!(
                "{}: the adapter changes lm_head, which the base ties to the embeddings (llama.cpp \
                 has no separate output matrix to adapt): {merge_instead}",
                file.display()
            );
        }
        // PEFT's embedding adapter: A `[r, vocab]`, B `[hidden, r]`, the embedding seen as a
        // linear map from the vocabulary.
        let embedding = module == ferrotune_models::peft::EMBED_MODULE;
        if embedding && config.tie_word_embeddings {
            bail!(
                "{}: the adapter changes the token embedding, which the base ties to the output \
                 head (llama.cpp would adapt the head with it; PEFT does not): {merge_instead}",
                file.display()
            );
        }
        let Some(gguf) = gguf_name(&hf, &naming(&config)) else {
            bail!(
                "{}: llama.cpp's '{arch}' has no matrix for adapted module '{module}'",
                file.display()
            );
        };
        let (r, inp) = a.dims2()?;
        let (rows, rb) = b.dims2()?;
        let Some((want_r, scale)) = lc.resolve_module(&config, &module) else {
            bail!(
                "{}: module '{module}' has tensors but adapter_config.json does not target it",
                file.display()
            );
        };
        if r != want_r || rb != r {
            bail!(
                "{}: module '{module}' has lora_A {:?} and lora_B {:?}, adapter_config.json says \
                 rank {want_r}",
                file.display(),
                a.dims(),
                b.dims()
            );
        }
        let alpha_gguf = *alpha.get_or_insert(scale * r as f64);
        let factor = scale * r as f64 / alpha_gguf;
        let mut b_values = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        if factor != 1.0 {
            folded = true;
            b_values
                .iter_mut()
                .for_each(|v| *v = (*v as f64 * factor) as f32);
        }
        let part = gguf.rsplit('.').nth(1).unwrap_or_default();
        if permute && (part == "attn_q" || part == "attn_k") {
            let heads = if part == "attn_q" {
                config.num_attention_heads
            } else {
                config.num_key_value_heads
            };
            let order = permuted_rows(rows, heads);
            b_values = order
                .iter()
                .flat_map(|&i| b_values[i * r..(i + 1) * r].iter().copied())
                .collect();
        }
        // llama.cpp looks the embedding's lora_a up by token (rows of `[vocab, r]`: A
        // transposed); a linear layer's lora_a is A as it is.
        let (a, a_dims) = if embedding {
            (a.t()?.contiguous()?, vec![r as u64, inp as u64])
        } else {
            (a, vec![inp as u64, r as u64])
        };
        let a_values = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        plan.push(Planned {
            name: format!("{gguf}.lora_a"),
            dims: a_dims,
            ty,
            source: Source::Values(a_values),
        });
        plan.push(Planned {
            name: format!("{gguf}.lora_b"),
            dims: vec![r as u64, rows as u64],
            ty,
            source: Source::Values(b_values),
        });
    }
    if folded {
        notes.push(
            "llama.cpp scales every matrix by one alpha / r: the modules whose scale differs \
             (rsLoRA, alpha_pattern) have it folded into their lora_b"
                .into(),
        );
    }
    let mut meta = Metadata::default();
    let name = folder_name(adapter_dir, "adapter");
    meta.string("general.architecture", arch);
    meta.string("general.type", "adapter");
    meta.string("general.name", &name);
    meta.u32("general.file_type", outtype.file_type());
    meta.string("adapter.type", "lora");
    meta.f32("adapter.lora.alpha", alpha.unwrap_or(0.0) as f32);
    let written = write_gguf(out, &plan, &meta, &Weights::Loaded(BTreeMap::new()))?;
    Ok(GgufExport {
        architecture: arch.into(),
        tensors: plan.len(),
        bytes: written,
        pre_tokenizer: String::new(),
        notes,
    })
}

/// `general.name`: the folder's own name (of its canonical path, so `.` names itself), else
/// `fallback`.
fn folder_name(dir: &Path, fallback: &str) -> String {
    dir.canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().to_string()))
        .unwrap_or_else(|| fallback.into())
}

/// Writes the GGUF file `out` under a temporary name, renamed into place when complete and
/// removed if anything fails; returns the file's size.
fn write_gguf(out: &Path, plan: &[Planned], meta: &Metadata, weights: &Weights) -> Result<u64> {
    let partial = PathBuf::from(format!("{}.partial", out.display()));
    let written = write_gguf_data(&partial, plan, meta, weights).inspect_err(|_| {
        let _ = std::fs::remove_file(&partial);
    })?;
    std::fs::rename(&partial, out)
        .with_context(|| format!("moving {} into place", partial.display()))?;
    Ok(written)
}

/// Writes the header, the metadata, the tensor descriptions, then each tensor's data at its
/// aligned offset; returns the file's size.
fn write_gguf_data(
    partial: &Path,
    plan: &[Planned],
    meta: &Metadata,
    weights: &Weights,
) -> Result<u64> {
    let mut w = BufWriter::new(
        File::create(partial).with_context(|| format!("creating {}", partial.display()))?,
    );
    w.write_all(b"GGUF")?;
    w.write_all(&3u32.to_le_bytes())?;
    w.write_all(&(plan.len() as u64).to_le_bytes())?;
    w.write_all(&(meta.count as u64).to_le_bytes())?;
    w.write_all(&meta.bytes)?;
    let mut offset = 0u64;
    let mut offsets = Vec::with_capacity(plan.len());
    let mut head_len = 4 + 4 + 8 + 8 + meta.bytes.len() as u64;
    for t in plan {
        let mut info = Vec::new();
        put_string(&mut info, &t.name);
        info.extend((t.dims.len() as u32).to_le_bytes());
        for d in &t.dims {
            info.extend(d.to_le_bytes());
        }
        info.extend(t.ty.id().to_le_bytes());
        info.extend(offset.to_le_bytes());
        w.write_all(&info)?;
        head_len += info.len() as u64;
        offsets.push(offset);
        let numel: u64 = t.dims.iter().product();
        offset = (offset + t.ty.bytes(numel as usize)).next_multiple_of(ALIGNMENT);
    }
    pad_to(&mut w, head_len)?;
    let mut written = head_len.next_multiple_of(ALIGNMENT);
    let data_start = written;
    for (t, &off) in plan.iter().zip(&offsets) {
        pad_to(&mut w, written - data_start)?;
        written = data_start + off;
        let values = match &t.source {
            Source::Values(v) => v.clone(),
            Source::Stacked(parts) => {
                let mut values = Vec::new();
                for (file, name) in parts {
                    values.extend(weights.values(*file, name)?);
                }
                values
            }
            Source::Hf {
                file,
                name,
                rows,
                plus_one,
            } => {
                let mut values = weights.values(*file, name)?;
                if *plus_one {
                    values.iter_mut().for_each(|v| *v += 1.0);
                }
                match rows {
                    Some(order) => {
                        // A row holds the planned tensor's innermost dimension (1 for a vector).
                        let width = if t.dims.len() >= 2 {
                            t.dims[0] as usize
                        } else {
                            1
                        };
                        order
                            .iter()
                            .flat_map(|&r| values[r * width..(r + 1) * width].iter().copied())
                            .collect()
                    }
                    None => values,
                }
            }
        };
        let bytes = encode(&values, t.ty);
        w.write_all(&bytes)?;
        written += bytes.len() as u64;
    }
    w.flush()?;
    drop(w);
    Ok(written)
}

/// Zero bytes up to the next multiple of the alignment after `len` bytes.
fn pad_to(w: &mut impl Write, len: u64) -> Result<()> {
    let pad = len.next_multiple_of(ALIGNMENT) - len;
    w.write_all(&vec![0u8; pad as usize])?;
    Ok(())
}

/// The checkpoint's tensors as the export reads them.
enum Weights<'a> {
    /// Memory-mapped safetensors files: a tensor's bytes are read when it is written, so the
    /// checkpoint is never held in memory.
    Mapped(Vec<SafeTensors<'a>>),
    /// PyTorch pickles or Meta's file under HF names, in their stored types: read whole, as a
    /// pickle's tensors are not laid out to be mapped one by one.
    Loaded(BTreeMap<String, Tensor>),
}

impl Weights<'_> {
    /// Every tensor as (file index, stored name, shape), each file's in name order.
    fn list(&self) -> Vec<(usize, String, Vec<usize>)> {
        match self {
            Weights::Mapped(files) => files
                .iter()
                .enumerate()
                .flat_map(|(file, st)| {
                    let mut named: Vec<_> = st
                        .tensors()
                        .into_iter()
                        .map(|(name, view)| (file, name, view.shape().to_vec()))
                        .collect();
                    named.sort();
                    named
                })
                .collect(),
            Weights::Loaded(tensors) => tensors
                .iter()
                .map(|(name, t)| (0, name.clone(), t.dims().to_vec()))
                .collect(),
        }
    }

    /// The type of the first matrix stored.
    fn first_matrix_dtype(&self) -> Option<Dtype> {
        match self {
            Weights::Mapped(files) => files
                .iter()
                .flat_map(|st| st.tensors())
                .find(|(_, v)| v.shape().len() >= 2)
                .map(|(_, v)| v.dtype()),
            Weights::Loaded(tensors) => {
                tensors
                    .values()
                    .find(|t| t.rank() >= 2)
                    .map(|t| match t.dtype() {
                        DType::BF16 => Dtype::BF16,
                        DType::F16 => Dtype::F16,
                        _ => Dtype::F32,
                    })
            }
        }
    }

    /// One tensor's values as f32.
    fn values(&self, file: usize, name: &str) -> Result<Vec<f32>> {
        match self {
            Weights::Mapped(files) => {
                let view = files[file].tensor(name)?;
                to_f32(view.dtype(), view.data())
                    .with_context(|| format!("{name}: {:?} weights", view.dtype()))
            }
            Weights::Loaded(tensors) => {
                let t = &tensors[name];
                if !t.dtype().is_float() {
                    bail!("{name}: {:?} weights cannot be exported", t.dtype());
                }
                Ok(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?)
            }
        }
    }
}

/// A safetensors tensor's values as f32.
fn to_f32(dtype: Dtype, data: &[u8]) -> Result<Vec<f32>> {
    Ok(match dtype {
        Dtype::F32 => data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::BF16 => data
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => data
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        other => bail!("weights of type {other:?} cannot be exported"),
    })
}

/// Values in a GGML type's bytes.
fn encode(values: &[f32], ty: GgmlType) -> Vec<u8> {
    match ty {
        GgmlType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => values
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::Bf16 => values
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect(),
        GgmlType::Q8_0 => quantize_q8_0(values),
        GgmlType::Quant(k) => quantize(values, k),
    }
}

/// Q8_0 as gguf-py's `quants.quantize` writes it: per block of 32 values the scale
/// `d = max|x| / 127` (stored as f16) and `round(x / d)` rounded half away from zero, computed
/// with the f32 scale.
pub fn quantize_q8_0(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / Q8_0_BLOCK * (2 + Q8_0_BLOCK));
    for block in values.chunks_exact(Q8_0_BLOCK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend(f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|&x| {
            let q = x * id;
            (q.signum() * (q.abs() + 0.5).floor()) as i8 as u8
        }));
    }
    out
}

/// GGUF key/value metadata, serialised as it is added.
#[derive(Default)]
struct Metadata {
    bytes: Vec<u8>,
    count: usize,
}

/// GGUF's value types.
const T_UINT32: u32 = 4;
const T_INT32: u32 = 5;
const T_FLOAT32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;

fn put_string(buf: &mut Vec<u8>, s: &str) {
    buf.extend((s.len() as u64).to_le_bytes());
    buf.extend(s.as_bytes());
}

impl Metadata {
    fn key(&mut self, key: &str, ty: u32) {
        put_string(&mut self.bytes, key);
        self.bytes.extend(ty.to_le_bytes());
        self.count += 1;
    }

    fn u32(&mut self, key: &str, v: u32) {
        self.key(key, T_UINT32);
        self.bytes.extend(v.to_le_bytes());
    }

    fn f32(&mut self, key: &str, v: f32) {
        self.key(key, T_FLOAT32);
        self.bytes.extend(v.to_le_bytes());
    }

    fn bool(&mut self, key: &str, v: bool) {
        self.key(key, T_BOOL);
        self.bytes.push(u8::from(v));
    }

    fn string(&mut self, key: &str, v: &str) {
        self.key(key, T_STRING);
        put_string(&mut self.bytes, v);
    }

    /// An array: its element type, its length, then each element as `put` writes it.
    fn array<T>(&mut self, key: &str, elem: u32, v: &[T], put: impl Fn(&mut Vec<u8>, &T)) {
        self.key(key, T_ARRAY);
        self.bytes.extend(elem.to_le_bytes());
        self.bytes.extend((v.len() as u64).to_le_bytes());
        for x in v {
            put(&mut self.bytes, x);
        }
    }

    fn strings(&mut self, key: &str, v: &[String]) {
        self.array(key, T_STRING, v, |b, s| put_string(b, s));
    }

    fn f32s(&mut self, key: &str, v: &[f32]) {
        self.array(key, T_FLOAT32, v, |b, x| b.extend(x.to_le_bytes()));
    }

    fn i32s(&mut self, key: &str, v: &[i32]) {
        self.array(key, T_INT32, v, |b, x| b.extend(x.to_le_bytes()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The permutation is convert_hf_to_gguf.py's `reshape(n_head, 2, hd/2, ...)
    /// .swapaxes(1, 2)`: within a head, rows 0, hd/2, 1, hd/2+1, ...
    #[test]
    fn qk_rows_interleave_the_two_halves_of_each_head() {
        assert_eq!(permuted_rows(8, 2), vec![0, 2, 1, 3, 4, 6, 5, 7]);
        assert_eq!(permuted_rows(6, 1), vec![0, 3, 1, 4, 2, 5]);
    }

    #[test]
    fn q8_0_rounds_half_away_from_zero_with_the_f32_scale() {
        let mut block = vec![0f32; 32];
        block[0] = 127.0;
        block[1] = -0.5;
        block[2] = 0.5;
        block[3] = 1.5;
        block[4] = -63.5;
        let bytes = quantize_q8_0(&block);
        assert_eq!(bytes.len(), 34);
        assert_eq!(f16::from_le_bytes([bytes[0], bytes[1]]).to_f32(), 1.0);
        let q: Vec<i8> = bytes[2..].iter().map(|&b| b as i8).collect();
        assert_eq!(&q[..5], &[127, -1, 1, 2, -64]);
        // An all-zero block has scale 0 and zeros.
        assert!(quantize_q8_0(&[0.0; 32]).iter().all(|&b| b == 0));
    }

    #[test]
    fn use_more_bits_picks_llama_cpps_layers() {
        let picked = |n| (0..n).filter(|&i| use_more_bits(i, n)).collect::<Vec<_>>();
        assert_eq!(picked(4), vec![2, 3]);
        assert_eq!(picked(8), vec![0, 3, 6, 7]);
        assert_eq!(
            picked(30),
            vec![0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]
        );
    }

    /// llama.cpp's mixes of SmolLM2-135M (30 layers, tied embeddings) and of an 80-layer Llama
    /// (its 70B rule), recorded by scripts/make_kquant_fixtures.py: every tensor's type from its
    /// name and shape alone.
    #[test]
    fn k_quant_mixes_type_deep_models_as_llama_cpp() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/gguf_export/kquants.json");
        let fixture: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cases = [
            ("smollm2_types", "q4_k_m", false),
            ("smollm2_types", "q5_k_m", false),
            ("smollm2_types", "q4_k_s", false),
            ("smollm2_types", "q4_0", false),
            ("llama80_types", "q4_k_m", true),
            ("llama80_types", "q4_k_s", true),
        ];
        for (table, mix, seventy_b) in cases {
            let rows: Vec<(String, Vec<u64>, u32)> =
                serde_json::from_value(fixture[table][mix].clone()).unwrap();
            assert!(!rows.is_empty(), "{table} {mix}");
            // Planned in the exporter's (lexicographic) order, not llama.cpp's.
            let mut plan: Vec<Planned> = rows
                .iter()
                .map(|(name, dims, _)| Planned {
                    name: name.clone(),
                    dims: dims.clone(),
                    ty: GgmlType::F32,
                    source: Source::Values(Vec::new()),
                })
                .collect();
            plan.sort_by(|a, b| a.name.cmp(&b.name));
            assign_mix_types(&mut plan, OutType::parse(mix).unwrap(), 0, seventy_b);
            let got: std::collections::HashMap<&str, u32> =
                plan.iter().map(|t| (t.name.as_str(), t.ty.id())).collect();
            for (name, _, want) in &rows {
                assert_eq!(got[name.as_str()], *want, "{table} {mix} {name}");
            }
        }
    }
}
