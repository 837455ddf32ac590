//! [`download_snapshot`]: a repository revision into a folder, file by file, resuming partial
//! downloads (HTTP `Range`), skipping complete files and checking LFS files' sha256.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use futures::StreamExt;
use hf_hub::{HFRepository, RepoType};
use sha2::{Digest, Sha256};

use super::client::{runtime, Hub};
use super::errors::{Ctx, HubFailure};
use super::pattern::matches_pattern;
use super::requests::{head_file, list_files, resolve_commit, TreeFile};
use super::safe_path::etag_component;
use super::{FileEvent, RepoKind, SnapshotRequest};
use crate::error::{DataError, Result};

/// Where [`download_snapshot`] keeps its bookkeeping inside the output folder (the folder
/// `huggingface_hub` uses for `local_dir` downloads): partial downloads are
/// `{output_dir}/.cache/huggingface/download/{path}.{etag}.incomplete` (an ETag that is not plain
/// letters and digits is replaced by its sha256) and completed files get a `{path}.metadata`
/// record (commit, etag, size, modification time) there.
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
        // `file.path` was checked when listed (`RemotePath`); the ETag is a header, made safe here.
        let dest = file.path.under(output_dir);
        let head = head_file(ctx, &commit, &file.path).await?;
        let etag = head.etag.unwrap_or_else(|| file.path.replace('/', "_"));
        let item = Item {
            path: &file.path,
            size: file.size,
            partial_name: format!("{}.{}.incomplete", file.path, etag_component(&etag)),
            etag,
            commit: &commit,
            dest: &dest,
            meta: state_dir.join(format!("{}.metadata", file.path)),
        };
        fetch_file(ctx, repo, &item, &state_dir, on_event).await?;
        paths.push(dest);
    }
    Ok(paths)
}

/// One file to bring into the output folder (or the cache: `cache.rs`).
pub(super) struct Item<'a> {
    /// Path in the repository (checked when listed).
    pub(super) path: &'a str,
    /// Size in bytes, from the listing.
    pub(super) size: u64,
    /// The server's ETag as sent (compared with the record, and the LFS sha256 when 64 hex).
    pub(super) etag: String,
    /// `{path}.{etag_component(etag)}.incomplete`, under the bookkeeping folder.
    pub(super) partial_name: String,
    /// The commit the bytes are fetched at.
    pub(super) commit: &'a str,
    /// Where the complete file goes.
    pub(super) dest: &'a Path,
    /// The record that lets a later run skip the file without hashing it.
    pub(super) meta: PathBuf,
}

impl Item<'_> {
    /// The LFS sha256: LFS files' etag is the sha256 of their content (the git blob id of other
    /// files is 40 hex digits).
    fn sha256(&self) -> Option<&str> {
        (self.etag.len() == 64 && self.etag.bytes().all(|b| b.is_ascii_hexdigit()))
            .then_some(self.etag.as_str())
    }
}

/// Brings `item` to `item.dest` unless it is complete there: resumes the partial file kept under
/// `state_dir`, checks size and LFS sha256, then renames it into place and records it.
pub(super) async fn fetch_file<T: RepoType>(
    ctx: &Ctx<'_>,
    repo: &HFRepository<T>,
    item: &Item<'_>,
    state_dir: &Path,
    on_event: &mut dyn FnMut(FileEvent<'_>),
) -> Result<()> {
    if is_complete(item)? {
        on_event(FileEvent::Skipped {
            path: item.path,
            size: item.size,
        });
        return Ok(());
    }
    let partial = state_dir.join(&item.partial_name);
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

pub(super) fn create_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| DataError::io(dir, e, "output folder"))
}

fn remove(path: &Path) -> Result<()> {
    match fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(DataError::io(path, e, "partial download")),
    }
}
