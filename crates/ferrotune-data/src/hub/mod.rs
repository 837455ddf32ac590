//! Hugging Face Hub access (models and datasets) through the `hf-hub` crate.
//!
//! - [`download_snapshot`]: every file of a repository revision into a folder, as real files,
//!   resumable (an interrupted file continues from the bytes it has, with an HTTP `Range`
//!   request) and skipping files already complete. This is `ferrotune download`.
//! - [`dataset_files`]: the data files (parquet preferred) of one split of a dataset repository,
//!   downloaded into the Hugging Face cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`), in its layout
//!   (`datasets--{owner}--{name}/snapshots/{commit}/{path}`, real files) by the same per-file
//!   loop, for recipe datasets with a hub `source`.
//! - [`upload_folder`]: a folder into a repository as one commit (preupload, Git LFS batch for
//!   large files, the NDJSON commit), creating the repository if needed and resume-safe. This is
//!   `ferrotune upload`.
//!
//! Environment, as `huggingface_hub` reads it: `HF_ENDPOINT` (the Hub's base URL), `HF_TOKEN`
//! (else the file `HF_TOKEN_PATH`, else `$HF_HOME/token`; `HF_HUB_DISABLE_IMPLICIT_TOKEN` turns the
//! implicit token off), `HF_HOME` / `HF_HUB_CACHE` (where the cache lives).
//!
//! `hf-hub` speaks the protocol: repo info, tree listings, file streams with byte ranges (Xet-backed
//! files included). What it does not do is written here: its snapshot into a folder neither
//! resumes (it truncates) nor checks files it finds there, and its cache download names blobs and
//! snapshot folders after the server's ETag and `X-Repo-Commit` headers unchecked, so the
//! per-file loop (and the cache layout) is ours; and the LFS sha256 the Hub reports is lost by `hf-hub` (its tree entries expect
//! `lfs.sha256`, the Hub sends `lfs.oid`; its `get_file_metadata` follows the CDN redirect and
//! reads the CDN's headers), so one redirect-free `HEAD` per file reads `X-Linked-Etag` itself.
//!
//! Principal types: [`RepoKind`], [`SnapshotRequest`], [`FileEvent`] (here). By file:
//! - `download.rs`: [`download_snapshot`], [`download_state_dir`], the per-file resume/verify loop.
//! - `dataset_files.rs`: [`dataset_files`], [`dataset_files_in`].
//! - `cache.rs`: files into the Hugging Face cache layout through the per-file loop.
//! - `splits.rs`: which files of a dataset repository make up a split.
//! - `pattern.rs`: [`fnmatch`] and the allow/ignore pattern rule.
//! - `client.rs`: the client (`Hub`), endpoint, token resolution, runtime.
//! - `requests.rs`: tree listings, commit resolution, the etag `HEAD` request.
//! - `safe_path.rs`: `RemotePath`, `etag_component`, `CommitId` and `repo_folder_name`, the one
//!   checked way a listed file path, an ETag, a commit header or a repository id becomes part of
//!   a local path (listings refuse unsafe entries).
//! - `upload.rs`: [`upload_folder`] (`ferrotune upload`), the commit API with LFS.
//! - `errors.rs`: failed requests (`HubFailure`) and their user messages (`Ctx`).
//! - `tests.rs`: unit tests.

mod cache;
mod client;
mod dataset_files;
mod download;
mod errors;
mod lfs;
mod pattern;
mod requests;
mod safe_path;
mod splits;
#[cfg(test)]
mod tests;
mod upload;

pub use dataset_files::{dataset_files, dataset_files_in};
pub use download::{download_snapshot, download_state_dir};
pub use pattern::fnmatch;

/// Whether a Hub token is at hand without an explicit one (`HF_TOKEN`, `HF_TOKEN_PATH`,
/// `$HF_HOME/token`, as `huggingface_hub` looks), e.g. before a run that will upload.
pub fn has_token() -> bool {
    client::implicit_token().is_some()
}
pub use upload::{upload_folder, UploadEvent, UploadOutcome, UploadRequest};

/// The Hugging Face cache folder downloads go to, as the hub client resolves it (`HF_HUB_CACHE`,
/// else `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub`); `None` if the client cannot be built.
pub fn cache_dir() -> Option<std::path::PathBuf> {
    hf_hub::HFClient::builder()
        .build()
        .ok()
        .map(|c| c.cache_dir().to_path_buf())
}

/// The kind of Hub repository.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RepoKind {
    /// A model repository (`{endpoint}/{repo_id}`).
    #[default]
    Model,
    /// A dataset repository (`{endpoint}/datasets/{repo_id}`).
    Dataset,
}

impl RepoKind {
    fn singular(self) -> &'static str {
        match self {
            RepoKind::Model => "model",
            RepoKind::Dataset => "dataset",
        }
    }

    /// The plural that starts the repository's cache folder name (`datasets--owner--name`).
    fn plural(self) -> &'static str {
        match self {
            RepoKind::Model => "models",
            RepoKind::Dataset => "datasets",
        }
    }

    fn url_prefix(self) -> &'static str {
        match self {
            RepoKind::Model => "",
            RepoKind::Dataset => "datasets/",
        }
    }
}

impl std::str::FromStr for RepoKind {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "model" => Ok(RepoKind::Model),
            "dataset" => Ok(RepoKind::Dataset),
            other => Err(format!(
                "unknown repository type '{other}' (expected model or dataset)"
            )),
        }
    }
}

/// What [`download_snapshot`] downloads.
#[derive(Debug, Clone, Default)]
pub struct SnapshotRequest {
    /// `owner/name`.
    pub repo_id: String,
    /// Model or dataset repository.
    pub kind: RepoKind,
    /// Branch, tag or commit; `None` is `main`.
    pub revision: Option<String>,
    /// Access token; `None` falls back to `HF_TOKEN`, `HF_TOKEN_PATH`, `$HF_HOME/token`.
    pub token: Option<String>,
    /// When not empty, only files matching one of these globs are downloaded.
    pub allow_patterns: Vec<String>,
    /// Files matching one of these globs are skipped.
    pub ignore_patterns: Vec<String>,
    /// How an error that needs a token tells the user to give one (e.g. "pass --hf-token or set
    /// HF_TOKEN"); empty means "set HF_TOKEN".
    pub token_hint: String,
}

/// What [`download_snapshot`] reports while it works, file by file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileEvent<'a> {
    /// The file is already complete in the output folder and was not downloaded again.
    Skipped {
        /// Path in the repository.
        path: &'a str,
        /// Size in bytes.
        size: u64,
    },
    /// Downloading starts; `resume_from > 0` when a partial download is continued.
    Started {
        /// Path in the repository.
        path: &'a str,
        /// Size in bytes.
        size: u64,
        /// Bytes already on disk from an earlier, interrupted download.
        resume_from: u64,
    },
    /// Bytes on disk so far (partial bytes included).
    Progress {
        /// Path in the repository.
        path: &'a str,
        /// Bytes on disk.
        done: u64,
        /// Size in bytes.
        size: u64,
    },
    /// The file is complete and verified.
    Finished {
        /// Path in the repository.
        path: &'a str,
        /// Size in bytes.
        size: u64,
    },
}
