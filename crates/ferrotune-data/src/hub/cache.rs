//! [`cache_files`]: files of a repository revision into the Hugging Face cache, through the same
//! per-file loop as `ferrotune download` (resumable, LFS sha256 checked, complete files skipped).
//!
//! Layout, as `huggingface_hub` lays out its cache so that it (and `datasets`) can read what
//! ferrotune fetched: `{cache}/datasets--{owner}--{name}/snapshots/{commit}/{path}` and
//! `refs/{revision}` (the commit). The files are real files, not symlinks into `blobs/`:
//! `huggingface_hub` accepts either, and a real file needs no blob named after a header.
//! Partial downloads and the records that let a later run skip a complete file without hashing
//! it live in ferrotune's own folder of the repository, `.ferrotune/download/`
//! (`{path}.{etag}.incomplete`, `{commit}/{path}.metadata`), which `huggingface_hub` ignores.
//!
//! Every part of those paths the server decides is checked: the file path ([`RemotePath`], when
//! listed), the commit from the `X-Repo-Commit` header ([`CommitId`]: 40 hex digits, else the
//! download fails naming the header), the ETag ([`etag_component`]); the repository id, from a
//! config, too ([`repo_folder_name`]).

use std::fs;
use std::path::{Path, PathBuf};

use hf_hub::{HFRepository, RepoType};

use super::download::{create_dir, fetch_file, Item};
use super::errors::Ctx;
use super::requests::{head_file, TreeFile};
use super::safe_path::{etag_component, repo_folder_name, CommitId, RemotePath};
use crate::error::{DataError, Result};

/// The cache folder of the context's repository, `{cache}/{kind}s--{owner}--{name}`; the cache is
/// `HF_HUB_CACHE`, else `HUGGINGFACE_HUB_CACHE`, else `$HF_HOME/hub` (as `hf-hub` resolves it).
pub(super) fn repo_cache_dir(ctx: &Ctx<'_>) -> Result<PathBuf> {
    let folder = repo_folder_name(ctx.kind, ctx.repo_id).map_err(|why| {
        DataError::Hub(format!(
            "'{}' is not a valid Hugging Face {} repository id ({why})",
            ctx.repo_id.escape_debug(),
            ctx.kind.singular()
        ))
    })?;
    Ok(ctx.hub.client.cache_dir().join(folder))
}

/// Brings `files` (listed at the context's revision) into the cache and returns their paths, in
/// the same order. A `HEAD` per file at the revision gives its commit and ETag, as
/// `huggingface_hub`'s `hf_hub_download` does; the bytes are then fetched at that commit.
pub(super) async fn cache_files<T: RepoType>(
    ctx: &Ctx<'_>,
    repo: &HFRepository<T>,
    files: &[&TreeFile],
) -> Result<Vec<PathBuf>> {
    let folder = repo_cache_dir(ctx)?;
    let state_dir = folder.join(".ferrotune").join("download");
    let mut paths = Vec::with_capacity(files.len());
    for file in files {
        let head = head_file(ctx, ctx.revision, &file.path).await?;
        let commit = checked_commit(ctx, &file.path, head.commit.as_deref())?;
        let dest = file
            .path
            .under(&folder.join("snapshots").join(commit.as_str()));
        // As `download_snapshot`: a file without ETag is named by its path (made safe below).
        let etag = head.etag.unwrap_or_else(|| file.path.replace('/', "_"));
        let item = Item {
            path: &file.path,
            size: file.size,
            partial_name: format!("{}.{}.incomplete", file.path, etag_component(&etag)),
            etag,
            commit: commit.as_str(),
            dest: &dest,
            meta: state_dir
                .join(commit.as_str())
                .join(format!("{}.metadata", file.path)),
        };
        fetch_file(ctx, repo, &item, &state_dir, &mut |_| {}).await?;
        write_ref(&folder, ctx.revision, &commit)?;
        paths.push(dest);
    }
    Ok(paths)
}

/// The `X-Repo-Commit` header checked to be a commit id before it names a snapshot folder.
fn checked_commit(ctx: &Ctx<'_>, path: &RemotePath, header: Option<&str>) -> Result<CommitId> {
    let problem = match header {
        None => "no X-Repo-Commit header".to_string(),
        Some(raw) => match CommitId::new(raw) {
            Ok(commit) => return Ok(commit),
            Err(why) => format!(
                "an X-Repo-Commit header '{}' that is {why}",
                raw.escape_debug()
            ),
        },
    };
    Err(DataError::Hub(format!(
        "the Hub at {} (HF_ENDPOINT) answered for '{path}' of {} repository '{}' at revision '{}' \
         with {problem}; refusing to use it as a cache folder name",
        ctx.hub.endpoint,
        ctx.kind.singular(),
        ctx.repo_id,
        ctx.revision
    )))
}

/// `refs/{revision}` holds the commit the revision resolved to, as `huggingface_hub` keeps it (its
/// offline mode reads it). The revision is ferrotune's own (`main`, `refs/convert/parquet`);
/// it is checked anyway, and a revision that is itself a commit needs no ref.
fn write_ref(folder: &Path, revision: &str, commit: &CommitId) -> Result<()> {
    if revision == commit.as_str() {
        return Ok(());
    }
    let Ok(name) = RemotePath::new(revision) else {
        return Ok(());
    };
    let ref_path = name.under(&folder.join("refs"));
    if fs::read_to_string(&ref_path).is_ok_and(|c| c == commit.as_str()) {
        return Ok(());
    }
    if let Some(parent) = ref_path.parent() {
        create_dir(parent)?;
    }
    fs::write(&ref_path, commit.as_str())
        .map_err(|e| DataError::io(&ref_path, e, "Hugging Face cache ref"))
}
