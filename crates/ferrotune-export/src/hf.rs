//! Writing complete HF checkpoint folders: weights, `config.json`, `generation_config.json` and the
//! tokenizer files, so that `AutoModelForCausalLM.from_pretrained(dir)` and
//! `AutoTokenizer.from_pretrained(dir)` load the result unchanged; and Meta-format folders as
//! torchtune's `FullModelMetaCheckpointer` writes them.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result};
use candle_core::{DType, Tensor};
use ferrotune_data::Tokenizer;
use ferrotune_models::save::write_atomic;
use ferrotune_models::{save_hf_checkpoint, CheckpointFormat, ModelConfig};

/// Tokenizer and template files an HF checkpoint folder may carry, copied as they are.
pub const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
];

/// Where a base model came from: decides how its tokenizer and generation config are carried over.
#[derive(Debug, Clone)]
pub struct ModelSource {
    /// The weights' format (HF safetensors files, or a GGUF file).
    pub format: CheckpointFormat,
    /// The folder holding config/tokenizer files (the GGUF's folder for a GGUF).
    pub dir: std::path::PathBuf,
}

/// What a model folder is written from: the weights and everything written beside them.
#[derive(Debug, Clone, Copy)]
pub struct ModelFiles<'a> {
    /// The model's config, written as `config.json`.
    pub config: &'a ModelConfig,
    /// The weights, by HF name.
    pub tensors: &'a HashMap<String, Tensor>,
    /// The dtype the weights are written in.
    pub dtype: DType,
    /// The largest safetensors shard (HF folders only).
    pub max_shard_bytes: u64,
    /// Where the base model came from (its generation config and tokenizer files).
    pub source: &'a ModelSource,
    /// The run's tokenizer, exported where the source has no tokenizer files.
    pub tokenizer: Option<&'a Tokenizer>,
}

/// Writes `m.tensors` as an HF checkpoint into `out` (created if missing), with the config, the
/// generation config of the source (HF sources only) and the tokenizer files.
pub fn write_hf_model(out: &Path, m: &ModelFiles) -> Result<()> {
    let generation = match &m.source.format {
        CheckpointFormat::Safetensors(_) | CheckpointFormat::Pickle(_) => {
            read_json(&m.source.dir.join("generation_config.json"))?
        }
        CheckpointFormat::Gguf(_) | CheckpointFormat::Meta(_) => None,
    };
    save_hf_checkpoint(
        out,
        m.config,
        generation.as_ref(),
        m.tensors,
        m.dtype,
        m.max_shard_bytes,
    )?;
    copy_or_export_tokenizer(m.source, m.tokenizer, out)
}

/// The format a training recipe saves its model in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SaveFormat {
    /// An HF folder (safetensors, `config.json`, tokenizer): what transformers loads.
    Hf,
    /// Meta's format, as torchtune's `FullModelMetaCheckpointer` saves it: see
    /// [`write_meta_model`].
    Meta,
}

/// The name of the one weight file torchtune's `FullModelMetaCheckpointer` saves.
pub const META_MODEL_FILE: &str = "model-00001-of-00001.bin";

/// Writes `m.tensors` (HF names) into `out` in `format`: [`write_hf_model`] or
/// [`write_meta_model`].
pub fn write_model(format: SaveFormat, out: &Path, m: &ModelFiles) -> Result<()> {
    match format {
        SaveFormat::Hf => write_hf_model(out, m),
        SaveFormat::Meta => {
            write_meta_model(out, m.config, m.tensors, m.dtype, m.source, m.tokenizer)
        }
    }
}

/// Writes a Llama model's `tensors` (HF names) into `out` as torchtune's
/// `FullModelMetaCheckpointer` does: `model-00001-of-00001.bin` (`torch.save` of Meta's tensor
/// names, in `dtype`), then the source folder's other files (params.json, tokenizer.model, ...:
/// every file but weights and indexes, up to 100 MiB, not starting with '.'), as torchtune's
/// `copy_files` copies them. The run's HF tokenizer files are added where the source has no file
/// of that name, so that ferrotune's own verbs find a tokenizer in the folder.
pub fn write_meta_model(
    out: &Path,
    config: &ModelConfig,
    tensors: &HashMap<String, Tensor>,
    dtype: DType,
    source: &ModelSource,
    tokenizer: Option<&Tokenizer>,
) -> Result<()> {
    // In `dtype` first, so that a tied head stays the embedding's very tensor (one storage).
    let typed = tensors
        .iter()
        .map(|(name, t)| Ok((name.clone(), t.to_dtype(dtype)?)))
        .collect::<candle_core::Result<HashMap<_, _>>>()?;
    let meta = ferrotune_models::torch_pickle::hf_to_meta(config, &typed)
        .map_err(|e| anyhow::anyhow!("{}: cannot save in Meta's format: {e}", out.display()))?;
    drop(typed);
    ferrotune_models::torch_pickle::write_torch_tensors(&out.join(META_MODEL_FILE), &meta)?;
    copy_checkpoint_files(&source.dir, out)?;
    if let Some(tok) = tokenizer {
        copy_tokenizer_files_where(tok.origin(), out, Existing::Keep)?;
    }
    Ok(())
}

/// File endings torchtune's checkpointers do not copy from the checkpoint folder (weights, their
/// indexes and adapters).
const NOT_COPIED: &[&str] = &[
    ".pt",
    ".pth",
    ".bin",
    ".safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "adapter_config.json",
    "adapter_model",
];

/// torchtune's `copy_files`: every file under `from` (recursively, keeping sub-folders) that
/// is not a weight file, not hidden and not over 100 MiB, and not already in `to`.
pub fn copy_checkpoint_files(from: &Path, to: &Path) -> Result<()> {
    const MAX_BYTES: u64 = 100 * 1024 * 1024;
    std::fs::create_dir_all(to).with_context(|| format!("{}: cannot create", to.display()))?;
    let entries =
        std::fs::read_dir(from).with_context(|| format!("{}: cannot list", from.display()))?;
    for entry in entries {
        let entry = entry.with_context(|| format!("{}: cannot list", from.display()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with('.') {
            continue;
        }
        let path = entry.path();
        if path.is_dir() {
            // Not into itself: an output_dir inside the checkpoint folder is not copied.
            let holds_output = match (path.canonicalize(), to.canonicalize()) {
                (Ok(dir), Ok(out)) => out.starts_with(dir),
                _ => false,
            };
            if !holds_output {
                copy_checkpoint_files(&path, &to.join(&name))?;
            }
            continue;
        }
        let dst = to.join(&name);
        let size = entry.metadata().map(|m| m.len()).unwrap_or(u64::MAX);
        if NOT_COPIED.iter().any(|s| name.ends_with(s)) || size > MAX_BYTES || dst.exists() {
            continue;
        }
        let bytes =
            std::fs::read(&path).with_context(|| format!("{}: cannot read", path.display()))?;
        write_atomic(&dst, &bytes)?;
    }
    Ok(())
}

/// Puts the tokenizer files of the model's source into `out`: copied from an HF folder (or from
/// `tokenizer`'s folder when the checkpoint has none), or exported from a GGUF.
pub fn copy_or_export_tokenizer(
    source: &ModelSource,
    tokenizer: Option<&Tokenizer>,
    out: &Path,
) -> Result<()> {
    match &source.format {
        CheckpointFormat::Meta(_) => {
            // Meta's folder holds its own tokenizer.model (tiktoken for Llama 3, not a file HF
            // reads as one): the run's HF tokenizer is what the saved folder gets.
            if let Some(tok) = tokenizer {
                copy_tokenizer_files(tok.origin(), out)?;
            }
        }
        CheckpointFormat::Safetensors(_) | CheckpointFormat::Pickle(_) => {
            let copied = copy_tokenizer_files(&source.dir, out)?;
            // A tokenizer from elsewhere (`tokenizer.path`) when the checkpoint folder has none.
            if !copied {
                if let Some(tok) = tokenizer {
                    copy_tokenizer_files(tok.origin(), out)?;
                }
            }
        }
        CheckpointFormat::Gguf(file) => {
            let tok = match tokenizer {
                Some(t) => t.clone(),
                None => Tokenizer::from_gguf(file, ferrotune_models::family::gguf_vocab_style)?,
            };
            export_tokenizer(&tok, out)
                .with_context(|| format!("exporting the tokenizer of {}", file.display()))?;
        }
    }
    Ok(())
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    let value =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    Ok(Some(value))
}

/// Copies the tokenizer files present in `from` (a folder, or a file whose folder is used) to
/// `to`, each atomically; returns whether `tokenizer.json` was among them.
pub fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<bool> {
    copy_tokenizer_files_where(from, to, Existing::Replace)
}

/// What [`copy_tokenizer_files_where`] does with a file of the same name already in `to`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Existing {
    Replace,
    Keep,
}

/// [`copy_tokenizer_files`], keeping or replacing files already in `to`; returns whether
/// `tokenizer.json` was copied.
fn copy_tokenizer_files_where(from: &Path, to: &Path, existing: Existing) -> Result<bool> {
    let from = if from.is_file() {
        from.parent().unwrap_or(Path::new("."))
    } else {
        from
    };
    let mut found = false;
    for name in TOKENIZER_FILES {
        let src = from.join(name);
        if src.is_file() && (existing == Existing::Replace || !to.join(name).exists()) {
            let bytes =
                std::fs::read(&src).with_context(|| format!("{}: cannot read", src.display()))?;
            write_atomic(&to.join(name), &bytes)?;
            found |= *name == "tokenizer.json";
        }
    }
    Ok(found)
}

/// Writes a tokenizer (e.g. one embedded in a GGUF) as `tokenizer.json` plus a
/// `tokenizer_config.json` with its special tokens and chat template.
pub fn export_tokenizer(tok: &Tokenizer, to: &Path) -> Result<()> {
    let json = tok
        .inner()
        .to_string(true)
        .map_err(|e| anyhow::anyhow!("cannot serialize the tokenizer: {e}"))?;
    write_atomic(&to.join("tokenizer.json"), json.as_bytes())?;
    let mut config = serde_json::Map::new();
    for (key, value) in tok.special_tokens() {
        config.insert(key.clone(), serde_json::json!(value));
    }
    config.insert(
        "tokenizer_class".into(),
        serde_json::json!("PreTrainedTokenizerFast"),
    );
    config.insert(
        "add_bos_token".into(),
        serde_json::json!(tok.add_bos_token()),
    );
    if let Some(template) = tok.chat_template() {
        config.insert("chat_template".into(), serde_json::json!(template));
    }
    let text = serde_json::to_string_pretty(&serde_json::Value::Object(config))?;
    write_atomic(&to.join("tokenizer_config.json"), text.as_bytes())?;
    Ok(())
}
