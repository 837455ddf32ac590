//! Shared by the verbs: finding the tokenizer that belongs to a model path.

use std::path::Path;

use anyhow::Result;
use ferrotune_data::Tokenizer;

/// The tokenizer of a model: the GGUF's embedded one, or the HF folder's tokenizer files.
pub fn tokenizer_for(path: &Path) -> Result<Tokenizer> {
    let is_gguf = path.extension().is_some_and(|e| e == "gguf");
    Ok(if is_gguf {
        Tokenizer::from_gguf(path)?
    } else {
        Tokenizer::from_dir(path)?
    })
}
