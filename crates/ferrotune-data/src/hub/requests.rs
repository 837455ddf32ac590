//! Requests to the Hub: tree listings, a revision's commit, and the redirect-free `HEAD` that
//! reads a file's etag (the LFS sha256).

use futures::StreamExt;
use hf_hub::repository::RepoTreeEntry;
use hf_hub::{HFRepository, RepoType};

use super::errors::{error_chain, Ctx, HubFailure};
use super::safe_path::RemotePath;
use super::RepoKind;
use crate::error::{DataError, Result};

/// A file of a repository tree listing.
pub(super) struct TreeFile {
    /// Checked when listed: every path ferrotune writes a Hub file to comes from here.
    pub(super) path: RemotePath,
    pub(super) size: u64,
}

pub(super) async fn list_files<T: RepoType>(
    ctx: &Ctx<'_>,
    repo: &HFRepository<T>,
) -> Result<Vec<TreeFile>> {
    tree_files(ctx, repo, false).await
}

/// The parquet conversion's files, or none when the Hub has no conversion of this dataset.
pub(super) async fn list_converted<T: RepoType>(
    ctx: &Ctx<'_>,
    repo: &HFRepository<T>,
) -> Result<Vec<TreeFile>> {
    tree_files(ctx, repo, true).await
}

/// The files of `repo`'s recursive tree at the context's revision; with `missing_is_empty`, a 404
/// while listing means there is no such tree and gives no files. An entry whose path could leave
/// the folder it is written to (see [`RemotePath`]) fails the whole listing, naming it: skipping
/// it would quietly give a different dataset or model than the repository holds.
async fn tree_files<T: RepoType>(
    ctx: &Ctx<'_>,
    repo: &HFRepository<T>,
    missing_is_empty: bool,
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
            Ok(RepoTreeEntry::File { path, size, .. }) => {
                let path = RemotePath::new(&path).map_err(|why| {
                    DataError::Hub(format!(
                        "{} repository '{}' at revision '{}' lists an unsafe file path '{}' ({why}); refusing to write it",
                        ctx.kind.singular(),
                        ctx.repo_id,
                        ctx.revision,
                        path.escape_debug()
                    ))
                })?;
                files.push(TreeFile { path, size })
            }
            Ok(_) => {}
            Err(e) => {
                let f = HubFailure::from(e);
                if missing_is_empty && f.status == Some(404) {
                    return Ok(Vec::new());
                }
                return Err(ctx.error(f));
            }
        }
    }
    Ok(files)
}

pub(super) async fn resolve_commit(ctx: &Ctx<'_>, revision: Option<&str>) -> Result<String> {
    let (owner, name) = hf_hub::split_id(ctx.repo_id);
    let client = &ctx.hub.client;
    // One request on either client: their info types differ, hence the macro.
    macro_rules! sha_of {
        ($repo:expr) => {
            $repo
                .info()
                .maybe_revision(revision.map(str::to_string))
                .send()
                .await
                .map(|i| i.sha)
        };
    }
    let sha = match ctx.kind {
        RepoKind::Model => sha_of!(client.model(owner, name)),
        RepoKind::Dataset => sha_of!(client.dataset(owner, name)),
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

/// What a `HEAD` on a file's resolve URL says, as sent (unchecked).
pub(super) struct Head {
    pub(super) etag: Option<String>,
    /// `X-Repo-Commit`: the commit the revision resolved to.
    pub(super) commit: Option<String>,
}

/// `HEAD {endpoint}/{prefix}{repo}/resolve/{revision}/{path}` (a commit, branch or ref), following
/// only relative redirects (a renamed repository), as `huggingface_hub` does: for LFS files the
/// Hub answers with a redirect to its CDN that carries `X-Linked-Etag` (the sha256), which the
/// CDN's own answer lacks.
pub(super) async fn head_file(ctx: &Ctx<'_>, revision: &str, path: &str) -> Result<Head> {
    let hub = ctx.hub;
    let encoded: Vec<String> = path.split('/').map(percent_encode).collect();
    let mut url = format!(
        "{}/{}{}/resolve/{}/{}",
        hub.endpoint,
        ctx.kind.url_prefix(),
        ctx.repo_id,
        percent_encode(revision),
        encoded.join("/")
    );
    let file_ctx = Ctx { revision, ..*ctx };
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
            return Ok(Head {
                etag,
                commit: header("x-repo-commit"),
            });
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
