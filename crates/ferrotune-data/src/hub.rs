//! Hugging Face Hub access (models and datasets) through the `hf-hub` crate.
//!
//! - [`download_snapshot`]: every file of a repository revision into a folder, as real files,
//!   resumable (an interrupted file continues from the bytes it has, with an HTTP `Range`
//!   request) and skipping files already complete. This is `ferrotune download`.
//! - [`dataset_files`]: the data files (parquet preferred) of one split of a dataset repository,
//!   downloaded into the Hugging Face cache, for recipe datasets with a hub `source`.
//!
//! Environment, as `huggingface_hub` reads it: `HF_ENDPOINT` (the Hub's base URL), `HF_TOKEN`
//! (else the file `HF_TOKEN_PATH`, else `$HF_HOME/token`; `HF_HUB_DISABLE_IMPLICIT_TOKEN` turns the
//! implicit token off), `HF_HOME` / `HF_HUB_CACHE` (where the cache lives).
//!
//! `hf-hub` speaks the protocol: repo info, tree listings, file streams with byte ranges (Xet-backed
//! files included) and the cache layout. What it does not do is written here: its snapshot into a
//! folder neither resumes (it truncates) nor checks files it finds there, so the per-file loop is
//! ours; and the LFS sha256 the Hub reports is lost by `hf-hub` (its tree entries expect
//! `lfs.sha256`, the Hub sends `lfs.oid`; its `get_file_metadata` follows the CDN redirect and
//! reads the CDN's headers), so one redirect-free `HEAD` per file reads `X-Linked-Etag` itself.

use std::collections::BTreeSet;
use std::fs;
use std::io::{Read, Write};
use std::path::{Component, Path, PathBuf};

use futures::StreamExt;
use hf_hub::repository::RepoTreeEntry;
use hf_hub::{HFClient, HFError, HFRepository, RepoType};
use sha2::{Digest, Sha256};

use crate::error::{DataError, Result};

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// What to tell a user whose request needs a token, when downloading a dataset for a recipe.
const DATASET_TOKEN_HINT: &str = "set HF_TOKEN to a Hugging Face access token";

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

/// Python `fnmatch.fnmatch` on POSIX, the matching `huggingface_hub` uses for allow/ignore patterns:
/// `*` matches any run of characters (`/` included), `?` one character, `[seq]` / `[!seq]` a
/// character in / not in `seq` (ranges `a-z` allowed); an unclosed `[` is a literal. Case-sensitive.
pub fn fnmatch(pattern: &str, name: &str) -> bool {
    let tokens = glob_tokens(pattern);
    let s: Vec<char> = name.chars().collect();
    // Classic single-star backtracking: every token other than `*` consumes exactly one char.
    let (mut pi, mut si) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while si < s.len() {
        match tokens.get(pi) {
            Some(GlobToken::Star) => {
                star = Some((pi, si));
                pi += 1;
            }
            Some(t) if t.matches(s[si]) => {
                pi += 1;
                si += 1;
            }
            _ => match star {
                Some((sp, ss)) => {
                    pi = sp + 1;
                    si = ss + 1;
                    star = Some((sp, ss + 1));
                }
                None => return false,
            },
        }
    }
    tokens[pi..].iter().all(|t| matches!(t, GlobToken::Star))
}

/// `huggingface_hub`'s pattern rule: a pattern ending in `/` means everything under that folder.
fn matches_pattern(pattern: &str, path: &str) -> bool {
    if pattern.ends_with('/') {
        fnmatch(&format!("{pattern}*"), path)
    } else {
        fnmatch(pattern, path)
    }
}

enum GlobToken {
    Star,
    Any,
    Char(char),
    Class {
        negated: bool,
        ranges: Vec<(char, char)>,
    },
}

impl GlobToken {
    fn matches(&self, c: char) -> bool {
        match self {
            GlobToken::Star | GlobToken::Any => true,
            GlobToken::Char(x) => *x == c,
            GlobToken::Class { negated, ranges } => {
                ranges.iter().any(|&(lo, hi)| lo <= c && c <= hi) != *negated
            }
        }
    }
}

fn glob_tokens(pattern: &str) -> Vec<GlobToken> {
    let p: Vec<char> = pattern.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < p.len() {
        match p[i] {
            '*' => {
                if !matches!(out.last(), Some(GlobToken::Star)) {
                    out.push(GlobToken::Star);
                }
                i += 1;
            }
            '?' => {
                out.push(GlobToken::Any);
                i += 1;
            }
            '[' => {
                // Find the closing `]`; a `]` right after `[` or `[!` is a member, as in Python.
                let mut j = i + 1;
                if j < p.len() && p[j] == '!' {
                    j += 1;
                }
                if j < p.len() && p[j] == ']' {
                    j += 1;
                }
                while j < p.len() && p[j] != ']' {
                    j += 1;
                }
                if j >= p.len() {
                    out.push(GlobToken::Char('['));
                    i += 1;
                    continue;
                }
                let mut k = i + 1;
                let negated = p[k] == '!';
                if negated {
                    k += 1;
                }
                let mut ranges = Vec::new();
                while k < j {
                    if k + 2 < j && p[k + 1] == '-' {
                        ranges.push((p[k], p[k + 2]));
                        k += 3;
                    } else {
                        ranges.push((p[k], p[k]));
                        k += 1;
                    }
                }
                out.push(GlobToken::Class { negated, ranges });
                i = j + 1;
            }
            c => {
                out.push(GlobToken::Char(c));
                i += 1;
            }
        }
    }
    out
}

/// Where [`download_snapshot`] keeps its bookkeeping inside the output folder (the folder
/// `huggingface_hub` uses for `local_dir` downloads): partial downloads are
/// `{output_dir}/.cache/huggingface/download/{path}.{etag}.incomplete` and completed files get a
/// `{path}.metadata` record (commit, etag, size, modification time) there.
pub fn download_state_dir(output_dir: &Path) -> PathBuf {
    output_dir
        .join(".cache")
        .join("huggingface")
        .join("download")
}

/// Downloads every file of a Hub repository revision (filtered by the request's allow/ignore
/// patterns) into `output_dir`, as real files at their repository paths, and returns their local
/// paths in the Hub's listing order.
///
/// Files already there are skipped when complete: same size, and same sha256 for LFS files (the
/// hash is skipped when this function's own record says the file is unchanged since it wrote
/// it). An interrupted download resumes from the bytes it has (see [`download_state_dir`]).
/// `on_event` hears about each file.
pub fn download_snapshot(
    request: &SnapshotRequest,
    output_dir: &Path,
    on_event: &mut dyn FnMut(FileEvent<'_>),
) -> Result<Vec<PathBuf>> {
    let hint = if request.token_hint.is_empty() {
        "set HF_TOKEN"
    } else {
        request.token_hint.as_str()
    };
    let hub = Hub::new(request.token.as_deref(), hint)?;
    let ctx = Ctx {
        hub: &hub,
        repo_id: &request.repo_id,
        kind: request.kind,
        revision: request.revision.as_deref().unwrap_or("main"),
    };
    let (owner, name) = hf_hub::split_id(&request.repo_id);
    runtime()?.block_on(async {
        match request.kind {
            RepoKind::Model => {
                let repo = hub.client.model(owner, name);
                snapshot(&ctx, &repo, request, output_dir, on_event).await
            }
            RepoKind::Dataset => {
                let repo = hub.client.dataset(owner, name);
                snapshot(&ctx, &repo, request, output_dir, on_event).await
            }
        }
    })
}

/// Downloads the data files (parquet preferred) of dataset repository `repo_id` needed for
/// `split` and returns their local paths, sorted by path (the shards' order).
///
/// `split` may carry a slice (`train[:10%]`): only the name before `[` selects files; the caller
/// slices. `name` is the dataset config: files under a folder of that name (or the `{name}/...`
/// files of the Hub's parquet conversion); `None` (or `"default"`) is the default config.
///
/// Files are picked as the `datasets` library's default layout does: `{split}-NNNNN-of-NNNNN.*`
/// shards (e.g. `data/train-00000-of-00001.parquet`), else split keywords in folder names
/// (`train/`, `*-validation/`), else in file names (`train.jsonl`, `xsum-test.csv`); with none of
/// these, every data file is `train`. Committed parquet comes first, then the Hub's parquet
/// conversion (revision `refs/convert/parquet`, `{config}/{split}/*.parquet`; first when the
/// repository has a loading script, whose output only the conversion reflects), then committed
/// JSON / JSONL / CSV. Files go to the Hugging Face cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`).
pub fn dataset_files(repo_id: &str, name: Option<&str>, split: &str) -> Result<Vec<PathBuf>> {
    dataset_files_in(repo_id, name, None, split)
}

/// [`dataset_files`] limited to the committed files under folder `data_dir` of the repository
/// (`load_dataset`'s `data_dir`, e.g. `data/rl` of `lvwerra/stack-exchange-paired`, which
/// torchtune's `stack_exchange_paired_dataset` reads). The parquet conversion covers the whole
/// repository, so with a `data_dir` only committed files are used.
pub fn dataset_files_in(
    repo_id: &str,
    name: Option<&str>,
    data_dir: Option<&str>,
    split: &str,
) -> Result<Vec<PathBuf>> {
    let split = split.split('[').next().unwrap_or("").trim();
    if split.is_empty() {
        return Err(DataError::Dataset(format!(
            "hub dataset '{repo_id}': empty split name"
        )));
    }
    let hub = Hub::new(None, DATASET_TOKEN_HINT)?;
    let (owner, repo_name) = hf_hub::split_id(repo_id);
    let repo = hub.client.dataset(owner, repo_name);
    let main_ctx = Ctx {
        hub: &hub,
        repo_id,
        kind: RepoKind::Dataset,
        revision: "main",
    };
    let convert_ctx = Ctx {
        revision: PARQUET_REVISION,
        ..main_ctx
    };
    runtime()?.block_on(async {
        let mut main = list_files(&main_ctx, &repo).await?;
        let data_dir = data_dir.map(|d| format!("{}/", d.trim_matches('/')));
        if let Some(dir) = &data_dir {
            main.retain(|f| f.path.starts_with(dir.as_str()));
        }
        let script = format!("{repo_name}.py");
        let has_script = main.iter().any(|f| f.path == script);
        let config = name.filter(|n| *n != "default");
        let main_pick = pick_committed(&main, config, split);

        let mut converted: Option<Vec<TreeFile>> = None;
        let mut chosen: Option<(&str, Vec<String>)> = None;
        if !has_script && !main_pick.parquet.is_empty() {
            chosen = Some(("main", main_pick.parquet.clone()));
        }
        if chosen.is_none() && data_dir.is_none() {
            let files = list_converted(&convert_ctx, &repo).await?;
            let pick = pick_converted(repo_id, &files, name, split)?;
            converted = Some(files);
            if !pick.is_empty() {
                chosen = Some((PARQUET_REVISION, pick));
            }
        }
        if chosen.is_none() {
            if !main_pick.parquet.is_empty() {
                chosen = Some(("main", main_pick.parquet.clone()));
            } else if !main_pick.other.is_empty() {
                chosen = Some(("main", main_pick.other.clone()));
            }
        }
        let Some((revision, files)) = chosen else {
            if let Some(n) = config {
                let mut configs: BTreeSet<&str> = main
                    .iter()
                    .filter(|f| is_data_file(&f.path))
                    .filter_map(|f| f.path.split_once('/').map(|(c, _)| c))
                    .collect();
                if let Some(conv) = &converted {
                    configs.extend(converted_configs(conv));
                }
                if !configs.contains(n) {
                    let list: Vec<&str> = configs.into_iter().collect();
                    return Err(DataError::Dataset(format!(
                        "hub dataset '{repo_id}': config '{n}' not found; folders with data files: {}",
                        if list.is_empty() { "none".to_string() } else { list.join(", ") }
                    )));
                }
            }
            let mut splits = main_pick.splits_found.clone();
            if let Some(conv) = &converted {
                splits.extend(converted_splits(conv, name));
            }
            let mut config_note = name.map(|n| format!(" (config '{n}')")).unwrap_or_default();
            if let Some(dir) = &data_dir {
                config_note.push_str(&format!(" under data_dir '{dir}'"));
            }
            let found = if splits.is_empty() {
                "none".to_string()
            } else {
                splits.into_iter().collect::<Vec<_>>().join(", ")
            };
            return Err(DataError::Dataset(format!(
                "hub dataset '{repo_id}'{config_note}: no parquet, JSON, JSONL or CSV data files for split '{split}'; splits found: {found}"
            )));
        };
        let ctx = Ctx {
            revision,
            ..main_ctx
        };
        let mut paths = Vec::with_capacity(files.len());
        for file in &files {
            let path = repo
                .download_file()
                .filename(file.clone())
                .revision(revision.to_string())
                .send()
                .await
                .map_err(|e| ctx.error(HubFailure::from(e)))?;
            paths.push(path);
        }
        Ok(paths)
    })
}

/// The revision where the Hub keeps its automatic parquet conversion of a dataset.
const PARQUET_REVISION: &str = "refs/convert/parquet";

/// The client, the token as resolved, and how to ask the user for a token.
struct Hub {
    client: HFClient,
    http: reqwest::Client,
    endpoint: String,
    token: Option<String>,
    token_hint: String,
}

impl Hub {
    fn new(explicit_token: Option<&str>, token_hint: &str) -> Result<Self> {
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|e| !e.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string();
        let token = explicit_token
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .or_else(implicit_token);
        let mut builder = HFClient::builder().endpoint(endpoint.clone());
        if let Some(t) = &token {
            builder = builder.token(t.clone());
        }
        let client = builder.build().map_err(|e| {
            DataError::Hub(format!(
                "cannot use the Hugging Face Hub at '{endpoint}' (HF_ENDPOINT): {e}"
            ))
        })?;
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("ferrotune/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| DataError::Hub(format!("cannot create an HTTP client: {e}")))?;
        Ok(Hub {
            client,
            http,
            endpoint,
            token,
            token_hint: token_hint.to_string(),
        })
    }
}

/// The token `huggingface_hub` would use without an explicit one, in its order.
fn implicit_token() -> Option<String> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if var("HF_HUB_DISABLE_IMPLICIT_TOKEN").is_some() {
        return None;
    }
    if let Some(t) = var("HF_TOKEN") {
        return Some(t);
    }
    let read = |p: PathBuf| {
        fs::read_to_string(p)
            .ok()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
    };
    if let Some(t) = var("HF_TOKEN_PATH").and_then(|p| read(PathBuf::from(p))) {
        return Some(t);
    }
    let home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
        var("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from(".cache"))
            .join("huggingface")
    });
    read(home.join("token"))
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| DataError::Hub(format!("cannot start the HTTP runtime: {e}")))
}

/// A failed Hub request, reduced to what the user message needs.
struct HubFailure {
    status: Option<u16>,
    error_code: Option<String>,
    message: String,
    network: bool,
    /// The file the request was about, when it was about one.
    entry: Option<String>,
}

impl From<HFError> for HubFailure {
    fn from(e: HFError) -> Self {
        // hf-hub does not export its error-context type, so a macro reads the fields.
        macro_rules! http {
            ($ctx:expr, $entry:expr) => {
                HubFailure {
                    status: Some($ctx.status.as_u16()),
                    error_code: $ctx.error_code.clone(),
                    message: $ctx
                        .server_message
                        .clone()
                        .filter(|m| !m.is_empty())
                        .unwrap_or_else(|| $ctx.status.to_string()),
                    network: false,
                    entry: $entry,
                }
            };
        }
        match &e {
            HFError::Http { context }
            | HFError::AuthRequired { context }
            | HFError::Forbidden { context }
            | HFError::Conflict { context }
            | HFError::RateLimited { context, .. } => http!(context, None),
            HFError::RepoNotFound {
                context: Some(context),
                ..
            }
            | HFError::RevisionNotFound {
                context: Some(context),
                ..
            } => http!(context, None),
            HFError::EntryNotFound {
                path,
                context: Some(context),
                ..
            } => http!(context, Some(path.clone())),
            HFError::Request { source, .. } => HubFailure {
                status: None,
                error_code: None,
                message: error_chain(source),
                network: true,
                entry: None,
            },
            _ => HubFailure {
                status: None,
                error_code: None,
                message: error_chain(&e),
                network: false,
                entry: None,
            },
        }
    }
}

fn error_chain(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}

/// The repository a request is about, for error messages.
#[derive(Clone, Copy)]
struct Ctx<'a> {
    hub: &'a Hub,
    repo_id: &'a str,
    kind: RepoKind,
    revision: &'a str,
}

impl Ctx<'_> {
    /// One line: what failed, why, and what to do.
    fn error(&self, f: HubFailure) -> DataError {
        let (id, kind, endpoint, hint) = (
            self.repo_id,
            self.kind.singular(),
            self.hub.endpoint.as_str(),
            self.hub.token_hint.as_str(),
        );
        let has_token = self.hub.token.is_some();
        let code = f.error_code.as_deref().unwrap_or("");
        let message = if f.network {
            format!(
                "cannot reach the Hugging Face Hub at {endpoint} (HF_ENDPOINT): {}",
                f.message
            )
        } else if code == "RepoNotFound"
            || (f.status == Some(404) && code.is_empty() && f.entry.is_none())
        {
            let private = if has_token {
                ""
            } else {
                " (if it is private, {hint})"
            };
            format!(
                "{kind} repository '{id}' not found on the Hugging Face Hub at {endpoint}{}",
                private.replace("{hint}", hint)
            )
        } else if code == "RevisionNotFound" {
            format!(
                "revision '{}' not found in {kind} repository '{id}'",
                self.revision
            )
        } else if f.status == Some(404) {
            let entry = f.entry.as_deref().unwrap_or("?");
            format!(
                "file '{entry}' not found in {kind} repository '{id}' at revision '{}'",
                self.revision
            )
        } else if f.status == Some(401) {
            if has_token {
                format!("the Hugging Face Hub rejected the token for {kind} repository '{id}' (HTTP 401: {}); check the token", f.message)
            } else {
                format!("{kind} repository '{id}' needs authentication (HTTP 401: it is gated or private): {hint}")
            }
        } else if f.status == Some(403) {
            if has_token {
                format!("access to {kind} repository '{id}' is denied (HTTP 403: {}); if it is gated, request access on its Hub page with the account of your token", f.message)
            } else {
                format!("{kind} repository '{id}' is gated (HTTP 403): request access on its Hub page, then {hint}")
            }
        } else if let Some(status) = f.status {
            format!(
                "the Hugging Face Hub failed on {kind} repository '{id}' (HTTP {status}): {}",
                f.message
            )
        } else {
            format!("{kind} repository '{id}': {}", f.message)
        };
        DataError::Hub(message)
    }
}

/// A file of a repository tree listing.
struct TreeFile {
    path: String,
    size: u64,
}

async fn list_files<T: RepoType>(ctx: &Ctx<'_>, repo: &HFRepository<T>) -> Result<Vec<TreeFile>> {
    let stream = repo
        .list_tree()
        .revision(ctx.revision.to_string())
        .recursive(true)
        .send()
        .map_err(|e| ctx.error(e.into()))?;
    futures::pin_mut!(stream);
    let mut files = Vec::new();
    while let Some(entry) = stream.next().await {
        if let RepoTreeEntry::File { path, size, .. } = entry.map_err(|e| ctx.error(e.into()))? {
            files.push(TreeFile { path, size });
        }
    }
    Ok(files)
}

/// The parquet conversion's files, or none when the Hub has no conversion of this dataset.
async fn list_converted<T: RepoType>(
    ctx: &Ctx<'_>,
    repo: &HFRepository<T>,
) -> Result<Vec<TreeFile>> {
    let stream = repo
        .list_tree()
        .revision(ctx.revision.to_string())
        .recursive(true)
        .send()
        .map_err(|e| ctx.error(e.into()))?;
    futures::pin_mut!(stream);
    let mut files = Vec::new();
    while let Some(entry) = stream.next().await {
        match entry {
            Ok(RepoTreeEntry::File { path, size, .. }) => files.push(TreeFile { path, size }),
            Ok(_) => {}
            Err(e) => {
                let f = HubFailure::from(e);
                if f.status == Some(404) {
                    return Ok(Vec::new());
                }
                return Err(ctx.error(f));
            }
        }
    }
    Ok(files)
}

async fn resolve_commit(ctx: &Ctx<'_>, revision: Option<&str>) -> Result<String> {
    let (owner, name) = hf_hub::split_id(ctx.repo_id);
    let client = &ctx.hub.client;
    let sha = match ctx.kind {
        RepoKind::Model => client
            .model(owner, name)
            .info()
            .maybe_revision(revision.map(str::to_string))
            .send()
            .await
            .map(|i| i.sha),
        RepoKind::Dataset => client
            .dataset(owner, name)
            .info()
            .maybe_revision(revision.map(str::to_string))
            .send()
            .await
            .map(|i| i.sha),
    }
    .map_err(|e| ctx.error(e.into()))?;
    sha.filter(|s| !s.is_empty()).ok_or_else(|| {
        DataError::Hub(format!(
            "the Hugging Face Hub gave no commit for {} repository '{}' at revision '{}'",
            ctx.kind.singular(),
            ctx.repo_id,
            ctx.revision
        ))
    })
}

async fn snapshot<T: RepoType>(
    ctx: &Ctx<'_>,
    repo: &HFRepository<T>,
    request: &SnapshotRequest,
    output_dir: &Path,
    on_event: &mut dyn FnMut(FileEvent<'_>),
) -> Result<Vec<PathBuf>> {
    let commit = resolve_commit(ctx, request.revision.as_deref()).await?;
    let listing_ctx = Ctx {
        revision: &commit,
        ..*ctx
    };
    let files: Vec<TreeFile> = list_files(&listing_ctx, repo)
        .await?
        .into_iter()
        .filter(|f| {
            (request.allow_patterns.is_empty()
                || request
                    .allow_patterns
                    .iter()
                    .any(|p| matches_pattern(p, &f.path)))
                && !request
                    .ignore_patterns
                    .iter()
                    .any(|p| matches_pattern(p, &f.path))
        })
        .collect();
    let state_dir = download_state_dir(output_dir);
    create_dir(&state_dir)?;
    // As huggingface_hub does: keep the bookkeeping folder out of git.
    let gitignore = output_dir
        .join(".cache")
        .join("huggingface")
        .join(".gitignore");
    if !gitignore.exists() {
        fs::write(&gitignore, "*\n")
            .map_err(|e| DataError::io(&gitignore, e, "download bookkeeping"))?;
    }
    let mut paths = Vec::with_capacity(files.len());
    for file in &files {
        let rel = safe_relative(&file.path).ok_or_else(|| {
            DataError::Hub(format!(
                "{} repository '{}' lists an unsafe file path '{}'; refusing to write it",
                ctx.kind.singular(),
                ctx.repo_id,
                file.path
            ))
        })?;
        let dest = output_dir.join(&rel);
        let head = head_file(ctx, &commit, &file.path).await?;
        let item = Item {
            path: &file.path,
            size: file.size,
            etag: head.etag.unwrap_or_else(|| file.path.replace('/', "_")),
            commit: &commit,
            dest: &dest,
            meta: state_dir.join(format!("{rel}.metadata")),
        };
        fetch_file(ctx, repo, &item, &state_dir, &rel, on_event).await?;
        paths.push(dest);
    }
    Ok(paths)
}

/// One file to bring into the output folder.
struct Item<'a> {
    path: &'a str,
    size: u64,
    etag: String,
    commit: &'a str,
    dest: &'a Path,
    meta: PathBuf,
}

impl Item<'_> {
    /// The LFS sha256: LFS files' etag is the sha256 of their content (the git blob id of other
    /// files is 40 hex digits).
    fn sha256(&self) -> Option<&str> {
        (self.etag.len() == 64 && self.etag.bytes().all(|b| b.is_ascii_hexdigit()))
            .then_some(self.etag.as_str())
    }
}

async fn fetch_file<T: RepoType>(
    ctx: &Ctx<'_>,
    repo: &HFRepository<T>,
    item: &Item<'_>,
    state_dir: &Path,
    rel: &str,
    on_event: &mut dyn FnMut(FileEvent<'_>),
) -> Result<()> {
    if is_complete(item)? {
        on_event(FileEvent::Skipped {
            path: item.path,
            size: item.size,
        });
        return Ok(());
    }
    let partial = state_dir.join(format!("{rel}.{}.incomplete", item.etag));
    if let Some(parent) = partial.parent() {
        create_dir(parent)?;
    }
    // A second attempt from scratch when a resumed download does not check out: the bytes kept
    // from before may be what is wrong.
    for attempt in 0..2 {
        let mut start = fs::metadata(&partial).map(|m| m.len()).unwrap_or(0);
        if start > item.size || attempt > 0 {
            remove(&partial)?;
            start = 0;
        }
        on_event(FileEvent::Started {
            path: item.path,
            size: item.size,
            resume_from: start,
        });
        if start < item.size {
            fetch_bytes(ctx, repo, item, &partial, start, on_event).await?;
        } else if !partial.exists() {
            // An empty file: nothing to fetch.
            fs::File::create(&partial)
                .map_err(|e| DataError::io(&partial, e, "partial download"))?;
        }
        let got = fs::metadata(&partial).map(|m| m.len()).unwrap_or(0);
        let mut problem = (got != item.size).then(|| {
            format!(
                "received {got} bytes of {} for '{}' (the download was cut short; run again to resume)",
                item.size, item.path
            )
        });
        if problem.is_none() {
            if let Some(expected) = item.sha256() {
                let actual = sha256_file(&partial)?;
                if actual != expected {
                    problem = Some(format!(
                        "sha256 mismatch for '{}': the Hub reports {expected}, the downloaded bytes hash to {actual}",
                        item.path
                    ));
                }
            }
        }
        match problem {
            None => {
                if let Some(parent) = item.dest.parent() {
                    create_dir(parent)?;
                }
                fs::rename(&partial, item.dest)
                    .map_err(|e| DataError::io(item.dest, e, "downloaded file"))?;
                write_record(item)?;
                on_event(FileEvent::Finished {
                    path: item.path,
                    size: item.size,
                });
                return Ok(());
            }
            // The next `Started` event (from 0) tells the caller about the fresh start.
            Some(_) if start > 0 && attempt == 0 => {}
            Some(p) => {
                if got == item.size {
                    // Complete but wrong: resuming from these bytes cannot help.
                    remove(&partial)?;
                }
                return Err(DataError::Hub(format!(
                    "{} repository '{}': {p}",
                    ctx.kind.singular(),
                    ctx.repo_id
                )));
            }
        }
    }
    unreachable!("the second attempt returns")
}

/// Appends bytes `start..size` of the file to `partial`.
async fn fetch_bytes<T: RepoType>(
    ctx: &Ctx<'_>,
    repo: &HFRepository<T>,
    item: &Item<'_>,
    partial: &Path,
    start: u64,
    on_event: &mut dyn FnMut(FileEvent<'_>),
) -> Result<()> {
    let file_ctx = Ctx {
        revision: item.commit,
        ..*ctx
    };
    let (length, mut stream) = repo
        .download_file_stream()
        .filename(item.path.to_string())
        .revision(item.commit.to_string())
        .maybe_range((start > 0).then_some(start..item.size))
        .send()
        .await
        .map_err(|e| file_ctx.error(e.into()))?;
    let mut start = start;
    // A server that ignores `Range` sends the whole file: start over rather than append it.
    if start > 0 && length == Some(item.size) {
        start = 0;
    }
    let mut out = fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(start > 0)
        .truncate(start == 0)
        .open(partial)
        .map_err(|e| DataError::io(partial, e, "partial download"))?;
    let mut done = start;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            let mut f = HubFailure::from(e);
            f.message = format!(
                "download of '{}' interrupted at {done} of {} bytes ({}); run again to resume",
                item.path, item.size, f.message
            );
            f.network = false;
            file_ctx.error(f)
        })?;
        out.write_all(&chunk)
            .map_err(|e| DataError::io(partial, e, "partial download"))?;
        done += chunk.len() as u64;
        on_event(FileEvent::Progress {
            path: item.path,
            done,
            size: item.size,
        });
    }
    out.flush()
        .map_err(|e| DataError::io(partial, e, "partial download"))
}

/// Whether `item.dest` already holds the file (see [`download_snapshot`]).
fn is_complete(item: &Item<'_>) -> Result<bool> {
    let Ok(md) = fs::metadata(item.dest) else {
        return Ok(false);
    };
    if !md.is_file() || md.len() != item.size {
        return Ok(false);
    }
    if let Ok(record) = fs::read_to_string(&item.meta) {
        let lines: Vec<&str> = record.lines().collect();
        if lines.len() >= 4 {
            if lines[1] != item.etag {
                // Written from another version of the file.
                return Ok(false);
            }
            if lines[2] == item.size.to_string() && lines[3] == mtime_ns(&md) {
                return Ok(true);
            }
        }
    }
    let ok = match item.sha256() {
        Some(expected) => sha256_file(item.dest)? == expected,
        None => true,
    };
    if ok {
        write_record(item)?;
    }
    Ok(ok)
}

fn write_record(item: &Item<'_>) -> Result<()> {
    let md = fs::metadata(item.dest).map_err(|e| DataError::io(item.dest, e, "downloaded file"))?;
    if let Some(parent) = item.meta.parent() {
        create_dir(parent)?;
    }
    let record = format!(
        "{}\n{}\n{}\n{}\n",
        item.commit,
        item.etag,
        item.size,
        mtime_ns(&md)
    );
    fs::write(&item.meta, record).map_err(|e| DataError::io(&item.meta, e, "download record"))
}

fn mtime_ns(md: &fs::Metadata) -> String {
    md.modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos().to_string())
        .unwrap_or_default()
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut file = fs::File::open(path).map_err(|e| DataError::io(path, e, "downloaded file"))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file
            .read(&mut buf)
            .map_err(|e| DataError::io(path, e, "downloaded file"))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn create_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e, "output folder"))
}

fn remove(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(DataError::io(path, e, "partial download")),
    }
}

/// A repository path as a relative local path, or `None` if it could escape the output folder.
fn safe_relative(path: &str) -> Option<String> {
    let p = Path::new(path);
    let ok = !path.is_empty()
        && p.components().all(|c| matches!(c, Component::Normal(_)))
        && !path.contains('\\');
    ok.then(|| path.to_string())
}

/// What a `HEAD` on a file's resolve URL says.
struct Head {
    etag: Option<String>,
}

/// `HEAD {endpoint}/{prefix}{repo}/resolve/{commit}/{path}`, following only relative redirects (a
/// renamed repository), as `huggingface_hub` does: for LFS files the Hub answers with a redirect
/// to its CDN that carries `X-Linked-Etag` (the sha256), which the CDN's own answer lacks.
async fn head_file(ctx: &Ctx<'_>, commit: &str, path: &str) -> Result<Head> {
    let hub = ctx.hub;
    let encoded: Vec<String> = path.split('/').map(percent_encode).collect();
    let mut url = format!(
        "{}/{}{}/resolve/{}/{}",
        hub.endpoint,
        ctx.kind.url_prefix(),
        ctx.repo_id,
        percent_encode(commit),
        encoded.join("/")
    );
    let file_ctx = Ctx {
        revision: commit,
        ..*ctx
    };
    for _ in 0..10 {
        let mut req = hub.http.head(&url);
        if let Some(t) = &hub.token {
            req = req.bearer_auth(t);
        }
        let resp = send_with_retry(req).await.map_err(|e| {
            file_ctx.error(HubFailure {
                status: None,
                error_code: None,
                message: error_chain(&e),
                network: true,
                entry: None,
            })
        })?;
        let status = resp.status();
        let header = |name: &str| {
            resp.headers()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        if status.is_redirection() {
            if let Some(loc) = header("location") {
                if loc.starts_with('/') && !loc.starts_with("//") {
                    url = format!("{}{}", origin(&url), loc);
                    continue;
                }
            }
        }
        if status.is_success() || status.is_redirection() {
            let etag = header("x-linked-etag")
                .or_else(|| header("etag"))
                .map(|raw| {
                    raw.strip_prefix("W/")
                        .unwrap_or(&raw)
                        .trim_matches('"')
                        .to_string()
                });
            return Ok(Head { etag });
        }
        return Err(file_ctx.error(HubFailure {
            status: Some(status.as_u16()),
            error_code: header("x-error-code"),
            message: header("x-error-message").unwrap_or_else(|| status.to_string()),
            network: false,
            entry: Some(path.to_string()),
        }));
    }
    Err(DataError::Hub(format!(
        "too many redirects for '{path}' in {} repository '{}'",
        ctx.kind.singular(),
        ctx.repo_id
    )))
}

/// Sends `req`, retrying connection failures a few times (hf-hub retries its own requests too).
async fn send_with_retry(req: reqwest::RequestBuilder) -> reqwest::Result<reqwest::Response> {
    let mut delay = std::time::Duration::from_millis(200);
    for _ in 0..3 {
        let Some(attempt) = req.try_clone() else {
            break;
        };
        match attempt.send().await {
            Err(e) if e.is_connect() || e.is_timeout() => {
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            other => return other,
        }
    }
    req.send().await
}

/// `scheme://host[:port]` of an absolute URL.
fn origin(url: &str) -> &str {
    let after_scheme = url.find("://").map(|i| i + 3).unwrap_or(0);
    match url[after_scheme..].find('/') {
        Some(i) => &url[..after_scheme + i],
        None => url,
    }
}

/// Percent-encodes everything but RFC 3986 unreserved characters, as `huggingface_hub` quotes
/// path segments and revisions.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

// ---- Choosing a dataset split's files -------------------------------------------------------

/// `datasets`' split keywords, by canonical split name.
const SPLIT_KEYWORDS: &[(&str, &[&str])] = &[
    ("train", &["train", "training"]),
    ("validation", &["validation", "valid", "dev", "val"]),
    ("test", &["test", "testing", "eval", "evaluation"]),
];

/// Characters `datasets` accepts around a split keyword (`[-._ 0-9]`).
fn is_sep(c: char) -> bool {
    matches!(c, '-' | '.' | '_' | ' ') || c.is_ascii_digit()
}

/// The canonical split a user-facing name means (`dev` is `validation`).
fn canonical_split(name: &str) -> String {
    let lower = name.to_ascii_lowercase();
    SPLIT_KEYWORDS
        .iter()
        .find(|(_, kws)| kws.contains(&lower.as_str()))
        .map(|(canon, _)| canon.to_string())
        .unwrap_or(lower)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum DataFormat {
    Parquet,
    Other,
}

fn data_format(path: &str) -> Option<DataFormat> {
    let lower = path.to_ascii_lowercase();
    if lower.ends_with(".parquet") {
        Some(DataFormat::Parquet)
    } else if lower.ends_with(".jsonl") || lower.ends_with(".json") || lower.ends_with(".csv") {
        Some(DataFormat::Other)
    } else {
        None
    }
}

/// `{split}-NNNNN-of-NNNNN...` (the Hub's shard names): the split.
fn shard_split(file_name: &str) -> Option<&str> {
    let bytes = file_name.as_bytes();
    let mut i = 0;
    while let Some(pos) = file_name[i..].find('-') {
        let at = i + pos;
        let rest = &bytes[at + 1..];
        let digits = |s: &[u8]| s.len() >= 5 && s[..5].iter().all(u8::is_ascii_digit);
        if at > 0 && digits(rest) && rest.get(5..9) == Some(b"-of-") && digits(&rest[9..]) {
            return Some(&file_name[..at]);
        }
        i = at + 1;
    }
    None
}

/// The split keyword a name carries as `datasets` looks for it: the whole name, or the keyword
/// after the start / before the end / in the middle, set off by `[-._ 0-9]`.
fn keyword_split(name: &str, whole_or_edges: bool) -> Option<&'static str> {
    let lower = name.to_ascii_lowercase();
    for (canon, kws) in SPLIT_KEYWORDS {
        for kw in *kws {
            let mut found = false;
            let mut from = 0;
            while let Some(pos) = lower[from..].find(kw) {
                let at = from + pos;
                let end = at + kw.len();
                let before = lower[..at].chars().next_back();
                let after = lower[end..].chars().next();
                let ok_before = before.is_none_or(is_sep);
                let ok_after = after.is_none_or(is_sep);
                // File names need a separator after the keyword (the extension's dot counts);
                // folder names may end with it.
                let ok = if whole_or_edges {
                    ok_before && ok_after
                } else {
                    ok_before && after.is_some_and(is_sep)
                };
                if ok {
                    found = true;
                    break;
                }
                from = at + 1;
            }
            if found {
                return Some(canon);
            }
        }
    }
    None
}

/// Which rule assigns splits to a repository's data files: the first that applies to any file.
#[derive(Clone, Copy)]
enum SplitRule {
    Shards,
    FolderKeyword,
    FileKeyword,
    AllTrain,
}

fn split_by(rule: SplitRule, path: &str) -> Option<String> {
    let (dirs, file) = match path.rsplit_once('/') {
        Some((d, f)) => (d, f),
        None => ("", path),
    };
    match rule {
        SplitRule::Shards => shard_split(file).map(canonical_split),
        SplitRule::FolderKeyword => dirs
            .split('/')
            .filter(|d| !d.is_empty())
            .find_map(|d| keyword_split(d, true))
            .map(str::to_string),
        SplitRule::FileKeyword => keyword_split(file, false).map(str::to_string),
        SplitRule::AllTrain => Some("train".to_string()),
    }
}

/// Files `datasets` never takes as data (metadata it writes itself).
const NOT_DATA: &[&str] = &[
    "config.json",
    "dataset_info.json",
    "dataset_infos.json",
    "dataset_dict.json",
];

/// A committed file in a data format, not hidden (`.x`, `__x`) and not metadata.
fn is_data_file(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    data_format(path).is_some()
        && !NOT_DATA.contains(&name)
        && !path
            .split('/')
            .any(|c| c.starts_with('.') || c.starts_with("__"))
}

/// The committed data files of a split, by format, and the splits seen.
struct CommittedPick {
    parquet: Vec<String>,
    other: Vec<String>,
    splits_found: BTreeSet<String>,
}

fn pick_committed(files: &[TreeFile], config: Option<&str>, split: &str) -> CommittedPick {
    let data: Vec<&TreeFile> = files
        .iter()
        .filter(|f| is_data_file(&f.path))
        .filter(|f| match config {
            Some(c) => f.path.split('/').next() == Some(c) && f.path.contains('/'),
            None => true,
        })
        .collect();
    let rule = [
        SplitRule::Shards,
        SplitRule::FolderKeyword,
        SplitRule::FileKeyword,
    ]
    .into_iter()
    .find(|&r| data.iter().any(|f| split_by(r, &f.path).is_some()))
    .unwrap_or(SplitRule::AllTrain);
    let wanted = canonical_split(split);
    let mut pick = CommittedPick {
        parquet: Vec::new(),
        other: Vec::new(),
        splits_found: BTreeSet::new(),
    };
    for f in data {
        let Some(s) = split_by(rule, &f.path) else {
            continue;
        };
        if s == wanted {
            match data_format(&f.path) {
                Some(DataFormat::Parquet) => pick.parquet.push(f.path.clone()),
                _ => pick.other.push(f.path.clone()),
            }
        }
        pick.splits_found.insert(s);
    }
    pick.parquet.sort();
    pick.other.sort();
    pick
}

/// The configs of the parquet conversion (its top-level folders).
fn converted_configs(files: &[TreeFile]) -> BTreeSet<&str> {
    files
        .iter()
        .filter(|f| f.path.ends_with(".parquet"))
        .filter_map(|f| f.path.split_once('/').map(|(c, _)| c))
        .collect()
}

/// The conversion's config for `name`: `name`, else `default`, else the only one.
fn converted_config<'a>(files: &'a [TreeFile], name: Option<&'a str>) -> Option<&'a str> {
    let configs = converted_configs(files);
    match name {
        Some(n) => Some(n),
        None if configs.contains("default") || configs.is_empty() => Some("default"),
        None if configs.len() == 1 => configs.into_iter().next(),
        None => None,
    }
}

/// The split of a conversion file of `config`: `{config}/{split}/NNNN.parquet` (or
/// `{config}/partial-{split}/...` for a partial conversion), or the older
/// `{config}/{name}-{split}[-NNNNN-of-NNNNN].parquet`.
fn converted_split(path: &str, config: &str) -> Option<String> {
    let rest = path.strip_prefix(config)?.strip_prefix('/')?;
    if !rest.ends_with(".parquet") {
        return None;
    }
    match rest.split_once('/') {
        Some((dir, _)) => Some(dir.strip_prefix("partial-").unwrap_or(dir).to_string()),
        None => {
            let stem = rest.trim_end_matches(".parquet");
            let stem = shard_split(stem).unwrap_or(stem);
            stem.rsplit_once('-').map(|(_, s)| s.to_string())
        }
    }
}

fn converted_splits(files: &[TreeFile], name: Option<&str>) -> BTreeSet<String> {
    let Some(config) = converted_config(files, name) else {
        return BTreeSet::new();
    };
    files
        .iter()
        .filter_map(|f| converted_split(&f.path, config))
        .collect()
}

fn pick_converted(
    repo_id: &str,
    files: &[TreeFile],
    name: Option<&str>,
    split: &str,
) -> Result<Vec<String>> {
    let Some(config) = converted_config(files, name) else {
        let configs: Vec<&str> = converted_configs(files).into_iter().collect();
        return Err(DataError::Dataset(format!(
            "hub dataset '{repo_id}' has several configs ({}): set the dataset's `name` to one of them",
            configs.join(", ")
        )));
    };
    let wanted = canonical_split(split);
    let mut picked: Vec<String> = files
        .iter()
        .filter(|f| {
            converted_split(&f.path, config)
                .is_some_and(|s| s == split || canonical_split(&s) == wanted)
        })
        .map(|f| f.path.clone())
        .collect();
    picked.sort();
    Ok(picked)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnmatch_follows_python() {
        // Expected values from Python's fnmatch.fnmatch.
        let cases = [
            ("*.safetensors", "model.safetensors", true),
            ("*.safetensors", "sub/model.safetensors", true),
            ("*.safetensors", "model.safetensors.index.json", false),
            ("original/*", "original/consolidated.00.pth", true),
            ("original/*", "orig/x", false),
            ("model-0000?-of-*", "model-00001-of-00002.safetensors", true),
            ("[!a]*", "abc", false),
            ("[!a]*", "bc", true),
            ("[a-c]x", "bx", true),
            ("[]]x", "]x", true),
            ("[x", "[x", true),
            ("*", "", true),
            ("a*b*c", "aXbYbZc", true),
            ("a*b*c", "aXbYbZ", false),
            ("*.JSON", "a.json", false),
        ];
        for (pat, name, want) in cases {
            assert_eq!(fnmatch(pat, name), want, "fnmatch({pat:?}, {name:?})");
        }
        assert!(matches_pattern("original/", "original/params.json"));
    }

    fn tree(paths: &[&str]) -> Vec<TreeFile> {
        paths
            .iter()
            .map(|p| TreeFile {
                path: p.to_string(),
                size: 1,
            })
            .collect()
    }

    #[test]
    fn committed_split_layouts() {
        let shards = tree(&[
            "README.md",
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet",
            "data/validation-00000-of-00001.parquet",
        ]);
        let p = pick_committed(&shards, None, "train[:10%]".split('[').next().unwrap());
        assert_eq!(
            p.parquet,
            [
                "data/train-00000-of-00002.parquet",
                "data/train-00001-of-00002.parquet"
            ]
        );
        let p = pick_committed(&shards, None, "dev");
        assert_eq!(p.parquet, ["data/validation-00000-of-00001.parquet"]);
        assert_eq!(
            p.splits_found.iter().collect::<Vec<_>>(),
            ["train", "validation"]
        );

        let configs = tree(&[
            "en/train-00000-of-00001.parquet",
            "fr/train-00000-of-00001.parquet",
        ]);
        assert_eq!(
            pick_committed(&configs, Some("fr"), "train").parquet,
            ["fr/train-00000-of-00001.parquet"]
        );

        let folders = tree(&[
            "cfg/train/a.parquet",
            "cfg/test/a.parquet",
            "cfg/test/b.parquet",
        ]);
        assert_eq!(
            pick_committed(&folders, Some("cfg"), "test").parquet,
            ["cfg/test/a.parquet", "cfg/test/b.parquet"]
        );

        let named = tree(&["xsum-train.jsonl", "xsum-test.jsonl", "training_notes.txt"]);
        let p = pick_committed(&named, None, "test");
        assert_eq!(p.other, ["xsum-test.jsonl"]);
        assert!(p.parquet.is_empty());

        // Metadata JSON is not data.
        let meta = tree(&["dataset_infos.json", "train.jsonl"]);
        assert_eq!(pick_committed(&meta, None, "train").other, ["train.jsonl"]);
        // No split anywhere: everything is train.
        let plain = tree(&["data.csv"]);
        assert_eq!(pick_committed(&plain, None, "train").other, ["data.csv"]);
        assert!(pick_committed(&plain, None, "test").other.is_empty());
        // "contest.json" has no keyword set off by separators.
        assert!(keyword_split("contest.json", false).is_none());
    }

    #[test]
    fn converted_layouts() {
        let files = tree(&[
            "default/train/0000.parquet",
            "default/train/0001.parquet",
            "default/partial-test/0000.parquet",
        ]);
        assert_eq!(
            pick_converted("x", &files, None, "train").unwrap(),
            ["default/train/0000.parquet", "default/train/0001.parquet"]
        );
        assert_eq!(
            pick_converted("x", &files, None, "test").unwrap(),
            ["default/partial-test/0000.parquet"]
        );
        let old = tree(&[
            "plain_text/squad-train.parquet",
            "plain_text/squad-validation.parquet",
        ]);
        assert_eq!(
            pick_converted("x", &old, None, "validation").unwrap(),
            ["plain_text/squad-validation.parquet"]
        );
        let two = tree(&["a/train/0000.parquet", "b/train/0000.parquet"]);
        let err = pick_converted("x", &two, None, "train")
            .unwrap_err()
            .to_string();
        assert!(err.contains("several configs (a, b)"), "{err}");
    }

    #[test]
    fn unsafe_paths_are_refused() {
        assert!(safe_relative("a/b.json").is_some());
        assert!(safe_relative("../x").is_none());
        assert!(safe_relative("/etc/passwd").is_none());
        assert!(safe_relative("a/../../x").is_none());
    }
}
