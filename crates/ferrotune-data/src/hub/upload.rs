//! `upload_folder`: a local folder into a Hub repository as one commit, over the Hub's commit
//! API as `huggingface_hub` speaks it (`_commit_api.py`, `lfs.py`):
//!
//! 1. `POST {endpoint}/api/repos/create` (`{"name", "organization", "private", "type"}`); a 409
//!    (the repository exists) is fine, as `create_repo(exist_ok=True)`.
//! 2. `POST /api/{models|datasets}/{repo}/preupload/{revision}` with each file's path, size and
//!    first 512 bytes (base64): the Hub answers `uploadMode` `lfs` or `regular` per file.
//! 3. For the `lfs` files, the Git LFS batch API (`POST {endpoint}/{datasets/}{repo}.git/info/lfs/
//!    objects/batch`, operation `upload`, transfers `basic` and `multipart`, sha256 oids): an
//!    object the Hub already holds comes back without `actions` and is not sent again; the others
//!    are sent as the `upload` action says (one `PUT`, or part by part: see [`super::lfs`]) and
//!    confirmed at its `verify` action.
//! 4. `POST /api/{models|datasets}/{repo}/commit/{revision}` with an NDJSON body: a `header`
//!    line (summary), a `file` line per regular file (base64 content) and an `lfsFile` line per
//!    LFS file (path, `sha256`, oid).
//!
//! Resume-safe: the LFS objects uploaded before a run was cut are skipped by the next run's
//! batch answer, and nothing is committed until every object is there, so running the upload
//! again after a failure completes it. Within a run, the LFS requests are retried on connection
//! errors and 5xx/429 answers as `huggingface_hub`'s `http_backoff` does ([`super::lfs`]). Files
//! are hashed and sent streaming, never read whole (the small `regular` files, which go into the
//! commit's body, excepted).

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use super::client::{runtime, Hub};
use super::lfs::{self, net_error, status_error};
use super::RepoKind;
use crate::error::{DataError, Result};

/// What [`upload_folder`] uploads.
#[derive(Debug, Clone, Default)]
pub struct UploadRequest {
    /// `owner/name` (or `name`, in the token owner's namespace).
    pub repo_id: String,
    /// Model or dataset repository.
    pub kind: RepoKind,
    /// The branch to commit to; `None` is `main`.
    pub revision: Option<String>,
    /// Create the repository private (when it does not exist yet).
    pub private: bool,
    /// Access token; `None` falls back to `HF_TOKEN`, `HF_TOKEN_PATH`, `$HF_HOME/token`.
    pub token: Option<String>,
    /// The commit's summary; `None` is "Upload folder using ferrotune".
    pub commit_message: Option<String>,
}

/// What [`upload_folder`] reports while it works, file by file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UploadEvent<'a> {
    /// The Hub already holds this LFS object (an earlier upload); it is only committed.
    LfsPresent {
        /// Path in the repository.
        path: &'a str,
        /// Size in bytes.
        size: u64,
    },
    /// This LFS object was uploaded.
    LfsUploaded {
        /// Path in the repository.
        path: &'a str,
        /// Size in bytes.
        size: u64,
    },
    /// An LFS request failed transiently and is sent again after `wait` (`http_backoff`'s
    /// warning; see [`super::lfs`]).
    Retrying {
        /// The request, e.g. `upload 'model.safetensors' (part 2 of 3)`.
        what: &'a str,
        /// Why: `HTTP 429`, or that the connection failed.
        failure: &'a str,
        /// The wait before it is sent again.
        wait: std::time::Duration,
        /// `wait` is the answer's own (`Retry-After`, `RateLimit`) + 1 s, not the backoff's.
        told: bool,
        /// This retry's number, from 1.
        retry: u32,
        /// The most retries one request gets.
        max: u32,
    },
}

impl UploadEvent<'_> {
    /// A [`UploadEvent::Retrying`] as one line, e.g. `upload 'model.safetensors': HTTP 429;
    /// retrying in 3 s (the server's wait + 1 s) [retry 1/5]`; `None` for the other events.
    pub fn retry_line(&self) -> Option<String> {
        let UploadEvent::Retrying {
            what,
            failure,
            wait,
            told,
            retry,
            max,
        } = *self
        else {
            return None;
        };
        let why = if told {
            " (the server's wait + 1 s)"
        } else {
            ""
        };
        Some(format!(
            "{what}: {failure}; retrying in {} s{why} [retry {retry}/{max}]",
            wait.as_secs()
        ))
    }
}

/// The commit an upload made.
#[derive(Debug, Clone)]
pub struct UploadOutcome {
    /// The commit's URL, as the Hub answers it.
    pub commit_url: String,
    /// The commit's id.
    pub commit_oid: String,
    /// Files committed (regular + LFS).
    pub files: usize,
    /// Of them, LFS files.
    pub lfs_files: usize,
}

struct LocalFile {
    path_in_repo: String,
    local: PathBuf,
    size: u64,
    sha256: String,
    sample: Vec<u8>,
}

/// Uploads every file under `folder` (hidden `.git`/`.cache` folders skipped) to the repository
/// as one commit, creating the repository when needed. See the module documentation for the
/// protocol; `on_event` hears about each LFS file and each retry.
pub fn upload_folder(
    req: &UploadRequest,
    folder: &Path,
    on_event: &mut dyn FnMut(UploadEvent<'_>),
) -> Result<UploadOutcome> {
    let hub = Hub::new(req.token.as_deref(), "set HF_TOKEN")?;
    if hub.token.is_none() {
        return Err(DataError::Hub(
            "uploading to the Hugging Face Hub needs a token with write access: set HF_TOKEN"
                .into(),
        ));
    }
    let files = local_files(folder)?;
    if files.is_empty() {
        return Err(DataError::Hub(format!(
            "'{}' holds no files to upload",
            folder.display()
        )));
    }
    let _pipe = IgnoreSigpipe::new();
    runtime()?.block_on(upload(&hub, req, files, on_event))
}

/// While alive, SIGPIPE is ignored: a connection the server cuts while a body is being written
/// is then an error the upload reports (and a rerun completes), not a signal that kills the
/// process silently (the binary restores SIGPIPE's default for `ferrotune ls | head`).
struct IgnoreSigpipe(libc::sighandler_t);

impl IgnoreSigpipe {
    fn new() -> Self {
        // SAFETY: changing a signal's disposition has no memory effects.
        IgnoreSigpipe(unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) })
    }
}

impl Drop for IgnoreSigpipe {
    fn drop(&mut self) {
        // SAFETY: restores the disposition `new` replaced.
        unsafe { libc::signal(libc::SIGPIPE, self.0) };
    }
}

/// The files under `folder`, sorted, with their sha256 and first 512 bytes.
fn local_files(folder: &Path) -> Result<Vec<LocalFile>> {
    let io = |p: &Path, e: std::io::Error| DataError::Hub(format!("{}: {e}", p.display()));
    let mut out = Vec::new();
    if folder.is_file() {
        let name = folder
            .file_name()
            .map(|n| n.to_string_lossy().to_string())
            .unwrap_or_default();
        out.push(local_file(folder, name)?);
        return Ok(out);
    }
    let mut stack = vec![folder.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).map_err(|e| io(&dir, e))? {
            let entry = entry.map_err(|e| io(&dir, e))?;
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().to_string();
            if path.is_dir() {
                if name != ".git" && name != ".cache" {
                    stack.push(path);
                }
                continue;
            }
            let rel = path
                .strip_prefix(folder)
                .unwrap_or(&path)
                .components()
                .map(|c| c.as_os_str().to_string_lossy().to_string())
                .collect::<Vec<_>>()
                .join("/");
            out.push(local_file(&path, rel)?);
        }
    }
    out.sort_by(|a, b| a.path_in_repo.cmp(&b.path_in_repo));
    Ok(out)
}

fn local_file(path: &Path, path_in_repo: String) -> Result<LocalFile> {
    use std::io::Read;
    let io = |e: std::io::Error| DataError::Hub(format!("{}: {e}", path.display()));
    let mut f = std::fs::File::open(path).map_err(io)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let (mut size, mut sample) = (0u64, Vec::new());
    loop {
        let n = f.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        if sample.len() < 512 {
            let take = (512 - sample.len()).min(n);
            sample.extend_from_slice(&buf[..take]);
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    Ok(LocalFile {
        path_in_repo,
        local: path.to_path_buf(),
        size,
        sha256: hex(&hasher.finalize()),
        sample,
    })
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Standard base64 with padding (what `base64.b64encode` gives).
pub(super) fn base64(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (b[0] as u32) << 16 | (b[1] as u32) << 8 | b[2] as u32;
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// `urllib.parse.quote(s, safe="")`, for a revision in a URL path.
fn quote(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

async fn upload(
    hub: &Hub,
    req: &UploadRequest,
    files: Vec<LocalFile>,
    on_event: &mut dyn FnMut(UploadEvent<'_>),
) -> Result<UploadOutcome> {
    let revision = req.revision.clone().unwrap_or_else(|| "main".to_string());
    let api = format!(
        "{}/api/{}s/{}",
        hub.endpoint,
        req.kind.singular(),
        req.repo_id
    );
    create_repo(hub, req).await?;

    // Preupload: which files go through LFS.
    let body = json!({ "files": files.iter().map(|f| json!({
        "path": f.path_in_repo, "sample": base64(&f.sample), "size": f.size,
    })).collect::<Vec<_>>() });
    let url = format!("{api}/preupload/{}", quote(&revision));
    let answer = send_json(hub, hub.http.post(&url), &body, "preupload").await?;
    let answered = || answer["files"].as_array().into_iter().flatten();
    let paths = |mode: &dyn Fn(&Value) -> bool| -> std::collections::HashSet<String> {
        answered()
            .filter(|f| mode(f))
            .filter_map(|f| f["path"].as_str().map(str::to_string))
            .collect()
    };
    let lfs = paths(&|f| f["uploadMode"] == "lfs");
    // Files the repository's `.gitignore` excludes are left out, as `huggingface_hub` does.
    let ignored = paths(&|f| f["shouldIgnore"] == true);
    let files: Vec<LocalFile> = files
        .into_iter()
        .filter(|f| !ignored.contains(&f.path_in_repo))
        .collect();
    let lfs_files: Vec<&LocalFile> = files
        .iter()
        .filter(|f| lfs.contains(&f.path_in_repo))
        .collect();

    if !lfs_files.is_empty() {
        upload_lfs(hub, req, &revision, &lfs_files, on_event).await?;
    }

    // The commit, NDJSON.
    let summary = req
        .commit_message
        .clone()
        .unwrap_or_else(|| "Upload folder using ferrotune".to_string());
    let mut ndjson =
        json!({ "key": "header", "value": { "summary": summary, "description": "" } }).to_string();
    for f in &files {
        ndjson.push('\n');
        let line = if lfs.contains(&f.path_in_repo) {
            json!({ "key": "lfsFile", "value": {
                "path": f.path_in_repo, "algo": "sha256", "oid": f.sha256,
            } })
        } else {
            let bytes = std::fs::read(&f.local)
                .map_err(|e| DataError::Hub(format!("{}: {e}", f.local.display())))?;
            json!({ "key": "file", "value": {
                "content": base64(&bytes), "path": f.path_in_repo, "encoding": "base64",
            } })
        };
        ndjson.push_str(&line.to_string());
    }
    let url = format!("{api}/commit/{}", quote(&revision));
    let rb = authed(hub, hub.http.post(&url))
        .header("content-type", "application/x-ndjson")
        .body(ndjson);
    let answer = read_json(
        rb.send().await.map_err(|e| net_error("commit", e)),
        "commit",
    )
    .await?;
    Ok(UploadOutcome {
        commit_url: answer["commitUrl"].as_str().unwrap_or_default().to_string(),
        commit_oid: answer["commitOid"].as_str().unwrap_or_default().to_string(),
        files: files.len(),
        lfs_files: lfs_files.len(),
    })
}

async fn create_repo(hub: &Hub, req: &UploadRequest) -> Result<()> {
    let (organization, name) = match req.repo_id.split_once('/') {
        Some((o, n)) => (Some(o), n),
        None => (None, req.repo_id.as_str()),
    };
    let mut body = json!({ "name": name, "private": req.private });
    if let Some(o) = organization {
        body["organization"] = json!(o);
    }
    if req.kind == RepoKind::Dataset {
        body["type"] = json!("dataset");
    }
    let url = format!("{}/api/repos/create", hub.endpoint);
    let rb = authed(hub, hub.http.post(&url))
        .header("content-type", "application/json")
        .body(body.to_string());
    let resp = rb
        .send()
        .await
        .map_err(|e| net_error("create the repository", e))?;
    // 409: it exists. 403: this token may not create it (an organization's repository it can
    // still write to, as `create_repo(exist_ok=True)` allows); the preupload says if it is missing.
    if matches!(resp.status().as_u16(), 409 | 403) || resp.status().is_success() {
        return Ok(());
    }
    Err(status_error(resp, "create the repository").await)
}

async fn upload_lfs(
    hub: &Hub,
    req: &UploadRequest,
    revision: &str,
    files: &[&LocalFile],
    on_event: &mut dyn FnMut(UploadEvent<'_>),
) -> Result<()> {
    let url = format!(
        "{}/{}{}.git/info/lfs/objects/batch",
        hub.endpoint,
        req.kind.url_prefix(),
        req.repo_id
    );
    let body = json!({
        "operation": "upload",
        "transfers": ["basic", "multipart"],
        "objects": files.iter().map(|f| json!({ "oid": f.sha256, "size": f.size })).collect::<Vec<_>>(),
        "hash_algo": "sha256",
        "ref": { "name": revision },
    });
    let body = body.to_string();
    let resp = lfs::send_retrying("LFS batch", on_event, || {
        Ok(authed(hub, hub.http.post(&url))
            .header("accept", "application/vnd.git-lfs+json")
            .header("content-type", "application/vnd.git-lfs+json")
            .body(body.clone()))
    })
    .await;
    let answer = read_json(resp, "LFS batch").await?;
    for obj in answer["objects"].as_array().into_iter().flatten() {
        let oid = obj["oid"].as_str().unwrap_or_default();
        let Some(f) = files.iter().find(|f| f.sha256 == oid) else {
            continue;
        };
        if let Some(err) = obj.get("error") {
            return Err(DataError::Hub(format!(
                "LFS upload of '{}' refused: {}",
                f.path_in_repo,
                err["message"].as_str().unwrap_or(&err.to_string())
            )));
        }
        let Some(actions) = obj.get("actions").filter(|a| !a.is_null()) else {
            on_event(UploadEvent::LfsPresent {
                path: &f.path_in_repo,
                size: f.size,
            });
            continue;
        };
        let object = lfs::Object {
            local: &f.local,
            size: f.size,
            oid: &f.sha256,
            path_in_repo: &f.path_in_repo,
        };
        lfs::transfer(hub, &object, &actions["upload"], on_event).await?;
        if let Some(verify) = actions.get("verify").filter(|v| !v.is_null()) {
            let href = verify["href"].as_str().unwrap_or_default();
            let body = json!({ "oid": f.sha256, "size": f.size }).to_string();
            let what = format!("verify '{}'", f.path_in_repo);
            let resp = lfs::send_retrying(&what, on_event, || {
                let mut rb = hub
                    .http
                    .post(href)
                    .header("content-type", "application/vnd.git-lfs+json")
                    .body(body.clone());
                for (k, v) in verify["header"].as_object().into_iter().flatten() {
                    if let Some(v) = v.as_str() {
                        rb = rb.header(k.as_str(), v);
                    }
                }
                Ok(rb)
            })
            .await;
            read_json(resp, &what).await?;
        }
        on_event(UploadEvent::LfsUploaded {
            path: &f.path_in_repo,
            size: f.size,
        });
    }
    Ok(())
}

fn authed(hub: &Hub, rb: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    match &hub.token {
        Some(t) => rb.header("authorization", format!("Bearer {t}")),
        None => rb,
    }
}

async fn send_json(
    hub: &Hub,
    rb: reqwest::RequestBuilder,
    body: &Value,
    what: &str,
) -> Result<Value> {
    let rb = authed(hub, rb)
        .header("content-type", "application/json")
        .body(body.to_string());
    read_json(rb.send().await.map_err(|e| net_error(what, e)), what).await
}

async fn read_json(resp: Result<reqwest::Response>, what: &str) -> Result<Value> {
    let resp = resp?;
    if !resp.status().is_success() {
        return Err(status_error(resp, what).await);
    }
    let text = resp.text().await.map_err(|e| net_error(what, e))?;
    if text.trim().is_empty() {
        return Ok(Value::Null);
    }
    serde_json::from_str(&text)
        .map_err(|e| DataError::Hub(format!("{what}: the Hub's answer is not JSON: {e}")))
}
