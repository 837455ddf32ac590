//! Shared by the verbs: finding the tokenizer that belongs to a model path, and reading a flag's
//! value.

use std::path::Path;

use anyhow::{Context, Result};
use ferrotune_data::Tokenizer;

/// The value of flag `name` as its parser read it (whose error is a sentence), an error naming
/// the flag.
pub fn flag<T>(name: &'static str, parsed: std::result::Result<T, String>) -> Result<T> {
    parsed.map_err(anyhow::Error::msg).context(name)
}

/// The tokenizer of a model: the GGUF's embedded one, or the HF folder's tokenizer files.
pub fn tokenizer_for(path: &Path) -> Result<Tokenizer> {
    let is_gguf = path.extension().is_some_and(|e| e == "gguf");
    if is_gguf {
        return Ok(Tokenizer::from_gguf(
            path,
            ferrotune_models::family::gguf_vocab_style,
        )?);
    }
    // A weights file (`model-8da4w.pt`, `pytorch_model.bin`) speaks for its folder; Meta's
    // `original/` folder for the HF folder above it, where tokenizer.json is.
    let dir = ferrotune_data::tokenizer::tokenizer_folder(path).unwrap_or_else(|| {
        if path.is_file() {
            path.parent().unwrap_or(Path::new(".")).to_path_buf()
        } else {
            path.to_path_buf()
        }
    });
    Ok(Tokenizer::from_dir(dir)?)
}
