//! The error type of this crate.
//!
//! Every error that comes from a file names that file, and says what is wrong with it, in one line.

use std::path::{Path, PathBuf};

/// What can go wrong while loading a tokenizer, rendering a chat template or encoding text.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A file or folder that is needed does not exist.
    #[error("{} does not exist ({what})", path.display())]
    NotFound {
        /// The missing path.
        path: PathBuf,
        /// What it was needed for.
        what: &'static str,
    },

    /// A file exists but cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },

    /// A JSON file is not valid JSON, or not the JSON shape expected.
    #[error("{} is not valid JSON: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        #[source]
        source: serde_json::Error,
    },

    /// A JSON file whose top level must be an object (`tokenizer_config.json`, `config.json`,
    /// `generation_config.json`) holds something else.
    #[error("{}: the top level must be a JSON object, found {found}", path.display())]
    NotAnObject {
        /// The file.
        path: PathBuf,
        /// What it holds instead ("an array", "a string", ...).
        found: &'static str,
    },

    /// A file parsed, but what it holds cannot make a tokenizer.
    #[error("{}: invalid tokenizer: {message}", path.display())]
    InvalidTokenizer {
        /// The file (or folder) the tokenizer was loaded from.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },

    /// A dataset row is malformed.
    #[error("{}:{line}: {message}", path.display())]
    InvalidData {
        /// The dataset file.
        path: PathBuf,
        /// 1-based line (row) number.
        line: usize,
        /// What is wrong with the row.
        message: String,
    },

    /// A GGUF file cannot be read, or its metadata does not describe a usable tokenizer.
    #[error("{}: bad GGUF file: {message}", path.display())]
    Gguf {
        /// The GGUF file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },

    /// A chat was requested from a tokenizer that has no chat template.
    #[error("the tokenizer loaded from {} has no chat template ({looked_in}), so it cannot format a chat", origin.display())]
    NoChatTemplate {
        /// The folder or GGUF file the tokenizer came from.
        origin: PathBuf,
        /// Where a template was looked for.
        looked_in: &'static str,
    },

    /// The chat template does not compile, or failed while rendering.
    #[error("chat template error: {message}")]
    Template {
        /// The template engine's message (with the template line where known).
        message: String,
    },

    /// Rendering the chat template took more than [`crate::TEMPLATE_STEP_BUDGET`]
    /// steps: it loops far longer than any real template (a hostile or broken one).
    #[error(
        "the chat template{} ran out of its step budget ({steps} steps) while rendering: it loops \
         far longer than any real template does",
        origin.as_ref().map(|o| format!(" from {o}")).unwrap_or_default()
    )]
    TemplateStepBudget {
        /// Where the template came from (a file, or a key of one), where known.
        origin: Option<String>,
        /// The budget it ran out of.
        steps: u64,
    },

    /// The chat template itself rejected the conversation with `raise_exception(message)`.
    #[error("the chat template rejected the conversation: {message}")]
    TemplateException {
        /// The message the template passed to `raise_exception`.
        message: String,
    },

    /// Encoding text failed.
    #[error("cannot encode text: {message}")]
    Encode {
        /// The tokenizer's message.
        message: String,
    },

    /// A dataset configuration is wrong (unknown builder, bad split, missing column, ...).
    #[error("{0}")]
    Dataset(String),

    /// The Hugging Face Hub could not provide a file (network, authentication, missing repo).
    #[error("{0}")]
    Hub(String),

    /// Something valid that ferrotune does not support.
    #[error("{0}")]
    Unsupported(String),

    /// Decoding ids failed.
    #[error("cannot decode token ids: {message}")]
    Decode {
        /// The tokenizer's message.
        message: String,
    },
}

/// This crate's result type.
pub type Result<T, E = DataError> = std::result::Result<T, E>;

impl DataError {
    /// An I/O error on `path`; a missing file becomes [`DataError::NotFound`].
    pub(crate) fn io(path: &Path, source: std::io::Error, what: &'static str) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            DataError::NotFound {
                path: path.to_path_buf(),
                what,
            }
        } else {
            DataError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    }

    /// The tokenizer could not encode text: its message `e`.
    pub(crate) fn encode(e: impl std::fmt::Display) -> Self {
        DataError::Encode {
            message: e.to_string(),
        }
    }

    /// Invalid data on 1-based `line` of the dataset file `path`.
    pub(crate) fn invalid_data(path: &Path, line: usize, message: String) -> Self {
        DataError::InvalidData {
            path: path.to_path_buf(),
            line,
            message,
        }
    }

    pub(crate) fn invalid(path: &Path, message: impl Into<String>) -> Self {
        DataError::InvalidTokenizer {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }

    pub(crate) fn gguf(path: &Path, message: impl Into<String>) -> Self {
        DataError::Gguf {
            path: path.to_path_buf(),
            message: message.into(),
        }
    }
}

/// The texts of a JSON list, or a [`DataError::Dataset`] with `bad`'s message for the first entry
/// that is not one.
pub(crate) fn texts(
    items: &[serde_json::Value],
    bad: impl Fn(&serde_json::Value) -> String,
) -> Result<Vec<String>> {
    items
        .iter()
        .map(|v| {
            v.as_str()
                .map(str::to_string)
                .ok_or_else(|| DataError::Dataset(bad(v)))
        })
        .collect()
}
