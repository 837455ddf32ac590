//! Tokenizers, chat templates and datasets.
//!
//! - [`Tokenizer`]: a Hugging Face tokenizer loaded from a transformers folder
//!   ([`Tokenizer::from_dir`]) or from a GGUF file's metadata ([`Tokenizer::from_gguf`]), encoding,
//!   decoding and applying chat templates exactly as transformers does.
//! - [`ChatTemplate`]: chat templates rendered with transformers' Jinja semantics.
//! - [`read_tokenized_jsonl`]: pre-tokenized JSONL datasets.
//! - [`assets_dir`]: where `scripts/fetch-assets.sh` puts the real tokenizers and models tests use.

#![warn(missing_docs)]

mod backend;
mod bounded;
pub mod chat_template;
pub mod dataset;
pub mod error;
pub mod eval_tasks;
mod gguf;
pub mod hub;
pub mod tokenized;
pub mod tokenizer;

use std::path::PathBuf;

pub use chat_template::{ChatMessage, ChatTemplate, TEMPLATE_STEP_BUDGET};
pub use error::{DataError, Result};
pub use gguf::{gguf_vocab, GgufVocab, GgufVocabStyle};
pub use tokenized::{read_tokenized_jsonl, TokenizedExample};
pub use tokenizer::Tokenizer;

/// The folder `scripts/fetch-assets.sh` fills: `$FERROTUNE_ASSETS` if set, else
/// `$XDG_CACHE_HOME/ferrotune/assets`, else `$HOME/.cache/ferrotune/assets`.
pub fn assets_dir() -> PathBuf {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = ferrotune_core::switch::ASSETS.path() {
        return dir;
    }
    let cache = var("XDG_CACHE_HOME")
        .or_else(|| var("HOME").map(|home| home.join(".cache")))
        .unwrap_or_else(|| PathBuf::from(".cache"));
    cache.join("ferrotune").join("assets")
}

/// `assets_dir()/relative`, or an error saying to run `scripts/fetch-assets.sh` if it is missing.
pub fn asset_path(relative: &str) -> Result<PathBuf> {
    let path = assets_dir().join(relative);
    if path.exists() {
        Ok(path)
    } else {
        Err(DataError::NotFound {
            path,
            what: "a test asset: run scripts/fetch-assets.sh",
        })
    }
}
