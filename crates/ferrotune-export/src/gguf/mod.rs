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
//! `qwen3_moe` (experts stacked as llama.cpp's `ffn_*_exps`), `deepseek_v2` / `deepseek_v3`
//! (llama.cpp's `deepseek2`, `kv_b_proj` split as its converter does), `gpt_oss` (its
//! `gpt-oss`, float experts), `qwen3_5_text`, `qwen3_5_moe_text` and `qwen3_next` (its `qwen35`,
//! `qwen35moe` and `qwen3next`: the DeltaNet's tensors as its converter writes them), with a byte-level BPE tokenizer (llama.cpp's `gpt2` vocabulary) or a
//! SentencePiece-style BPE one (its `llama` vocabulary).

use std::collections::BTreeMap;
use std::fs::File;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::Device;
use ferrotune_data::{gguf_vocab, GgufVocab, Tokenizer};
use ferrotune_models::checkpoint::read_pickled;
use ferrotune_models::config::RopeScaling;
use ferrotune_models::family::gguf::GgufRopeTensors;
use ferrotune_models::family::GgufVariant;
use ferrotune_models::{CheckpointFormat, ModelConfig};
use safetensors::{Dtype, SafeTensors};

use crate::gguf_quants::QuantKind;

mod adapter;
mod arch;
mod deepseek2;
mod file;
mod gpt_oss;
mod plan;
mod qwen35;
mod writer;

pub use adapter::export_gguf_adapter;
use arch::*;
pub use file::quantize_q8_0;
use file::*;
use plan::*;
use writer::*;

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
    /// `llama-quantize`'s MXFP4_MOE (gpt-oss only): the experts MXFP4, every other matrix Q8_0
    /// but the router.
    Mxfp4Moe,
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
            "mxfp4_moe" => OutType::Mxfp4Moe,
            other => bail!(
                "--outtype '{other}': expected f32, f16, bf16, auto, q8_0, q4_k_m, q4_k_s, \
                 q5_k_m, q5_k_s, q6_k, q4_0, q4_1, q5_0, q5_1 or mxfp4_moe"
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
            OutType::Mxfp4Moe => 38,
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
    /// MXFP4 (type 39), written from OpenAI's MXFP4 experts as they are ([`Source::Mxfp4`]).
    Mxfp4,
}

impl GgmlType {
    fn id(self) -> u32 {
        match self {
            GgmlType::F32 => 0,
            GgmlType::F16 => 1,
            GgmlType::Q8_0 => 8,
            GgmlType::Bf16 => 30,
            GgmlType::Quant(k) => k.ggml_id(),
            GgmlType::Mxfp4 => ferrotune_models::gguf::GGML_TYPE_MXFP4,
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
            GgmlType::Mxfp4 => {
                use ferrotune_models::gguf::{MXFP4_BLOCK, MXFP4_BLOCK_BYTES};
                numel / MXFP4_BLOCK * MXFP4_BLOCK_BYTES
            }
        }) as u64
    }

    /// Values per block (1 for the float types).
    fn block(self) -> usize {
        match self {
            GgmlType::F32 | GgmlType::F16 | GgmlType::Bf16 => 1,
            GgmlType::Q8_0 => Q8_0_BLOCK,
            GgmlType::Quant(k) => k.block().0,
            GgmlType::Mxfp4 => ferrotune_models::gguf::MXFP4_BLOCK,
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
    // DeepSeek's latent attention has tensors and keys of its own (llama.cpp's `deepseek2`).
    if config.mla.is_some() {
        return deepseek2::export(model_dir, out, outtype, &config, &weights);
    }
    // gpt-oss's fused experts and sinks (llama.cpp's `gpt-oss`).
    if config.gpt_oss_moe.is_some() {
        return gpt_oss::export(model_dir, out, outtype, &config, &weights);
    }
    // Qwen3.5's and Qwen3-Next's linear attention (llama.cpp's `qwen35`, `qwen35moe`,
    // `qwen3next`).
    if config.delta_net.is_some() {
        return qwen35::export(model_dir, out, outtype, &config, &weights);
    }
    let entry = architecture(&config)?;
    let (arch, permute, w) = (entry.name, entry.permuted_qk, &entry.writing);
    let naming = naming(&config);
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
    let mut notes = Vec::new();
    let (tok, vocab, pre) = read_tokenizer(home, &config, &mut notes)?;
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
    let outtype = resolve_outtype(outtype, &weights, false)?;
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
            let Some(gguf) = gguf_name(name, &naming) else {
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
            // A tied checkpoint may still hold `lm_head.weight`: one `output.weight` only (a
            // GGUF naming a tensor twice is refused by llama.cpp and by our reader).
            plan.retain(|t| t.name != name);
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
    refuse_unplaced(model_dir, arch, &skipped)?;
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
    let mix = MixModel {
        experts: expert_count,
        seventy_b: (w.seventy_b)(&config),
        fused_as_value: false,
    };
    assign_mix_types(&mut plan, outtype, mix);
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
    let shape = HeaderShape {
        layers: config.num_hidden_layers,
        heads: config.num_attention_heads,
        kv_heads: config.num_key_value_heads,
    };
    write_header(&mut meta, arch, &name, outtype, &config, shape);
    let k = |key: &str| format!("{arch}.{key}");
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
    write_tokenizer(&mut meta, &tok, &vocab, &pre, &config);

    let written = write_gguf(out, &plan, &meta, &weights)?;
    Ok(GgufExport {
        architecture: arch.into(),
        tensors: plan.len(),
        bytes: written,
        pre_tokenizer: pre,
        notes,
    })
}

/// The tokenizer of the checkpoint folder `home` as GGUF holds it (llama.cpp's vocabulary and its
/// `tokenizer.ggml.pre`), with a note in `notes` when llama.cpp does not name the pre-tokenizer.
fn read_tokenizer(
    home: &Path,
    config: &ModelConfig,
    notes: &mut Vec<String>,
) -> Result<(Tokenizer, GgufVocab, String)> {
    let tok = Tokenizer::from_dir(home)
        .with_context(|| format!("reading the tokenizer of {}", home.display()))?;
    let vocab =
        gguf_vocab(&tok, config.vocab_size).map_err(|e| anyhow!("{}: {e}", home.display()))?;
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
    Ok((tok, vocab, pre))
}

/// llama.cpp's `tokenizer.*` keys: the vocabulary, special ids and chat template.
fn write_tokenizer(
    meta: &mut Metadata,
    tok: &Tokenizer,
    vocab: &GgufVocab,
    pre: &str,
    config: &ModelConfig,
) {
    meta.string("tokenizer.ggml.model", vocab.model);
    meta.string("tokenizer.ggml.pre", pre);
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
}

/// Refuses a checkpoint with tensors (`skipped`, their HF names) that llama.cpp's `arch` has no
/// tensor for: writing the file without them would lose weights silently.
fn refuse_unplaced(model_dir: &Path, arch: &str, skipped: &[String]) -> Result<()> {
    if !skipped.is_empty() {
        bail!(
            "{}: tensors llama.cpp's '{arch}' has no place for: {}",
            model_dir.display(),
            skipped.join(", ")
        );
    }
    Ok(())
}

/// The attention and depth numbers of a GGUF header, where an architecture's writer counts them
/// its own way (DeepSeek's latent attention is one key/value head to llama.cpp).
struct HeaderShape {
    layers: usize,
    heads: usize,
    kv_heads: usize,
}

/// The keys every writer opens its metadata with, in llama.cpp's converter's order: the four
/// `general.*` ones, then `{arch}.`'s context and embedding lengths, block count, feed-forward
/// length, head counts and rope base.
fn write_header(
    meta: &mut Metadata,
    arch: &str,
    name: &str,
    outtype: OutType,
    config: &ModelConfig,
    shape: HeaderShape,
) {
    write_header_typed(meta, arch, name, outtype.file_type(), config, shape);
}

/// [`write_header`] with `general.file_type` given (`LLAMA_FTYPE_*`): gpt-oss's MXFP4 experts
/// make the file `MOSTLY_MXFP4_MOE`, as the converter says.
fn write_header_typed(
    meta: &mut Metadata,
    arch: &str,
    name: &str,
    file_type: u32,
    config: &ModelConfig,
    shape: HeaderShape,
) {
    meta.string("general.architecture", arch);
    meta.string("general.name", name);
    meta.u32("general.file_type", file_type);
    meta.u32("general.quantization_version", 2);
    let k = |key: &str| format!("{arch}.{key}");
    meta.u32(&k("context_length"), config.max_position_embeddings as u32);
    meta.u32(&k("embedding_length"), config.hidden_size as u32);
    meta.u32(&k("block_count"), shape.layers as u32);
    meta.u32(&k("feed_forward_length"), config.intermediate_size as u32);
    meta.u32(&k("attention.head_count"), shape.heads as u32);
    meta.u32(&k("attention.head_count_kv"), shape.kv_heads as u32);
    meta.f32(&k("rope.freq_base"), config.rope.theta as f32);
}

/// `general.name`: the folder's own name (of its canonical path, so `.` names itself), else
/// `fallback`.
pub(super) fn folder_name(dir: &Path, fallback: &str) -> String {
    dir.canonicalize()
        .ok()
        .and_then(|p| p.file_name().map(|n| n.to_string_lossy().to_string()))
        .unwrap_or_else(|| fallback.into())
}

#[cfg(test)]
mod tests {
    use half::f16;

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
            let model = MixModel {
                experts: 0,
                seventy_b,
                fused_as_value: false,
            };
            assign_mix_types(&mut plan, OutType::parse(mix).unwrap(), model);
            let got: std::collections::HashMap<&str, u32> =
                plan.iter().map(|t| (t.name.as_str(), t.ty.id())).collect();
            for (name, _, want) in &rows {
                assert_eq!(got[name.as_str()], *want, "{table} {mix} {name}");
            }
        }
    }
}
