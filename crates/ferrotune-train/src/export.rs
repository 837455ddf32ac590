//! Writing complete HF checkpoint folders: weights, `config.json`, `generation_config.json` and the
//! tokenizer files, so that `AutoModelForCausalLM.from_pretrained(dir)` and
//! `AutoTokenizer.from_pretrained(dir)` load the result unchanged.

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

/// Writes `tensors` as an HF checkpoint into `out` (created if missing), with the config, the
/// generation config of the source (HF sources only) and the tokenizer files.
pub fn write_hf_model(
    out: &Path,
    config: &ModelConfig,
    tensors: &HashMap<String, Tensor>,
    dtype: DType,
    max_shard_bytes: u64,
    source: &ModelSource,
    tokenizer: Option<&Tokenizer>,
) -> Result<()> {
    let generation = match &source.format {
        CheckpointFormat::Safetensors(_) | CheckpointFormat::Pickle(_) => {
            read_json(&source.dir.join("generation_config.json"))?
        }
        CheckpointFormat::Gguf(_) | CheckpointFormat::Meta(_) => None,
    };
    save_hf_checkpoint(
        out,
        config,
        generation.as_ref(),
        tensors,
        dtype,
        max_shard_bytes,
    )?;
    copy_or_export_tokenizer(source, tokenizer, out)
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
                None => Tokenizer::from_gguf(file)?,
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
    let from = if from.is_file() {
        from.parent().unwrap_or(Path::new("."))
    } else {
        from
    };
    let mut found = false;
    for name in TOKENIZER_FILES {
        let src = from.join(name);
        if src.is_file() {
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
