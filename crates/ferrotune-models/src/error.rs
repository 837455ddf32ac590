//! Errors for loading models: each names the file (or tensor) and what is wrong with it.

use std::path::{Path, PathBuf};

/// A model could not be loaded or run.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A problem with a specific file.
    #[error("{path}: {msg}")]
    File { path: PathBuf, msg: String },
    /// A problem that is not tied to one file.
    #[error("{0}")]
    Msg(String),
    /// A tensor operation failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

impl ModelError {
    /// An error about `path`.
    pub fn file(path: &Path, msg: impl Into<String>) -> Self {
        Self::File {
            path: path.to_path_buf(),
            msg: msg.into(),
        }
    }
}
