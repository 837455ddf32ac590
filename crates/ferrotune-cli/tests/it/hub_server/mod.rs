//! A loopback stand-in for the Hugging Face Hub, serving the endpoints `hf-hub` and ferrotune call:
//! repo info (`/api/{models,datasets}/{id}[/revision/{rev}]`), tree listings
//! (`/api/.../tree/{rev}`), `resolve` URLs (`HEAD`/`GET`, with `Range`) and, for LFS files, the
//! Hub's redirect to a CDN (`/cdn/{sha256}`) that carries `X-Linked-Etag`/`X-Linked-Size` as the
//! real Hub does; and the upload endpoints (`upload.rs`: repo creation, preupload, the Git LFS
//! batch API and the commit). Every request is logged for the tests to inspect.

// Each test binary uses part of the server.
#![allow(dead_code)]

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};

mod upload;
pub use upload::{Commit, CreatedRepo};

/// A file in a fake repository.
#[derive(Clone)]
pub struct HubFile {
    pub path: String,
    pub bytes: Vec<u8>,
    /// `Some(sha256 hex)`: an LFS file (listed with `lfs.oid`, resolved through the CDN redirect).
    pub lfs_sha256: Option<String>,
}

impl HubFile {
    pub fn plain(path: &str, bytes: &[u8]) -> Self {
        HubFile {
            path: path.to_string(),
            bytes: bytes.to_vec(),
            lfs_sha256: None,
        }
    }

    pub fn lfs(path: &str, bytes: Vec<u8>, sha256: &str) -> Self {
        HubFile {
            path: path.to_string(),
            bytes,
            lfs_sha256: Some(sha256.to_string()),
        }
    }
}

/// One revision (branch or ref) of a fake repository.
#[derive(Clone)]
pub struct HubRevision {
    pub name: String,
    pub sha: String,
    pub files: Vec<HubFile>,
}

/// A fake repository: `kind` is `models` or `datasets`.
#[derive(Clone)]
pub struct HubRepo {
    pub kind: &'static str,
    pub id: String,
    pub revisions: Vec<HubRevision>,
}

/// A request as the server saw it; header names are lower-case.
#[derive(Clone, Debug)]
pub struct Logged {
    pub method: String,
    pub path: String,
    pub headers: HashMap<String, String>,
    /// When it arrived.
    pub at: std::time::Instant,
}

#[derive(Default)]
struct Behaviour {
    required_token: Option<String>,
    /// One-shot: the next full `GET` of this CDN sha256 sends only this many body bytes, then
    /// closes the connection (an interrupted download).
    cut_once: Option<(String, usize)>,
    /// CDN content served in place of the real bytes (a corrupted transfer).
    corrupt: HashMap<String, Vec<u8>>,
    /// Sent as every answer's `X-Repo-Commit` in place of the revision's sha (a hostile server).
    repo_commit_header: Option<String>,
    /// The next LFS `PUT`s (whole objects or multipart parts) longer than `.0` bytes are read
    /// for `.0` body bytes, then the connection is closed without an answer (an upload cut
    /// short); `.1` such cuts are left.
    cut_upload: Option<(usize, u32)>,
    /// The next LFS `PUT`s are answered thus (their body read).
    answer_upload: Option<CannedAnswer>,
}

/// An answer the next LFS `PUT`s get in place of being stored.
struct CannedAnswer {
    status: u16,
    headers: Vec<(String, String)>,
    /// How many such answers are left.
    left: u32,
}

struct State {
    repos: Vec<HubRepo>,
    log: Mutex<Vec<Logged>>,
    behaviour: Mutex<Behaviour>,
    uploads: Mutex<upload::Uploads>,
    base: String,
}

/// The running server; it lives as long as the test process.
pub struct HubServer {
    state: Arc<State>,
}

impl HubServer {
    pub fn start(repos: Vec<HubRepo>) -> HubServer {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind loopback");
        let base = format!("http://{}", listener.local_addr().unwrap());
        let state = Arc::new(State {
            repos,
            log: Mutex::new(Vec::new()),
            behaviour: Mutex::new(Behaviour::default()),
            uploads: Mutex::new(upload::Uploads::default()),
            base,
        });
        let st = state.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let st = st.clone();
                std::thread::spawn(move || handle(&st, stream));
            }
        });
        HubServer { state }
    }

    /// The endpoint, e.g. `http://127.0.0.1:PORT`, for `HF_ENDPOINT`.
    pub fn url(&self) -> &str {
        &self.state.base
    }

    /// Every request must carry `Authorization: Bearer {token}` (else 401).
    pub fn require_token(&self, token: &str) {
        self.state.behaviour.lock().unwrap().required_token = Some(token.to_string());
    }

    /// The next full download of the CDN object `sha256` stops after `bytes` body bytes.
    pub fn cut_next_download(&self, sha256: &str, bytes: usize) {
        self.state.behaviour.lock().unwrap().cut_once = Some((sha256.to_string(), bytes));
    }

    /// The CDN serves `bytes` for `sha256` (the listing still reports the true hash).
    pub fn corrupt(&self, sha256: &str, bytes: Vec<u8>) {
        self.state
            .behaviour
            .lock()
            .unwrap()
            .corrupt
            .insert(sha256.to_string(), bytes);
    }

    /// Every answer that carries `X-Repo-Commit` carries `value` instead (a hostile server).
    pub fn send_repo_commit(&self, value: &str) {
        self.state.behaviour.lock().unwrap().repo_commit_header = Some(value.to_string());
    }

    /// The next LFS upload (`PUT`) longer than `bytes` is cut after `bytes` body bytes,
    /// unanswered, on each of the 6 tries one run makes (the first and the client's 5 in-run
    /// retries): the run fails.
    pub fn cut_next_upload(&self, bytes: usize) {
        self.cut_next_uploads(bytes, 6);
    }

    /// The next `tries` LFS `PUT`s (objects or parts) longer than `bytes` are cut after `bytes`
    /// body bytes, unanswered.
    pub fn cut_next_uploads(&self, bytes: usize, tries: u32) {
        self.state.behaviour.lock().unwrap().cut_upload = Some((bytes, tries));
    }

    /// The next `tries` LFS `PUT`s (objects or parts) are answered `status` with `headers` (a
    /// 429 with `Retry-After`, say), their bodies read first.
    pub fn answer_next_uploads(&self, status: u16, headers: &[(&str, &str)], tries: u32) {
        let headers = headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        self.state.behaviour.lock().unwrap().answer_upload = Some(CannedAnswer {
            status,
            headers,
            left: tries,
        });
    }

    /// From now on the LFS batch answers objects over `chunk_size` bytes with a `multipart`
    /// upload action, as the Hub does for large files: `chunk_size` and one numbered part URL
    /// per `chunk_size` bytes in its header, the completion at its `href`.
    pub fn multipart(&self, chunk_size: usize) {
        self.state.uploads.lock().unwrap().multipart_chunk = Some(chunk_size);
    }

    /// The multipart parts received so far, as (oid, part number, length), in arrival order.
    pub fn parts_received(&self) -> Vec<(String, usize, usize)> {
        self.state.uploads.lock().unwrap().parts_log.clone()
    }

    /// The commits accepted so far.
    pub fn commits(&self) -> Vec<Commit> {
        self.state.uploads.lock().unwrap().commits.clone()
    }

    /// The repositories created so far.
    pub fn created_repos(&self) -> Vec<CreatedRepo> {
        self.state.uploads.lock().unwrap().repos.clone()
    }

    /// The LFS objects stored so far (sha256 hex).
    pub fn lfs_objects(&self) -> Vec<String> {
        self.state
            .uploads
            .lock()
            .unwrap()
            .objects
            .keys()
            .cloned()
            .collect()
    }

    /// The requests seen so far.
    pub fn log(&self) -> Vec<Logged> {
        self.state.log.lock().unwrap().clone()
    }

    pub fn clear_log(&self) {
        self.state.log.lock().unwrap().clear();
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(v) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(v);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8(out).unwrap()
}

/// A made-up 40-hex git blob id for a non-LFS file (stable per content).
fn git_oid(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf29ce484222325;
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x100000001b3);
    }
    format!("{h:016x}{:016x}{:08x}", h.rotate_left(17), (h >> 7) as u32)
}

struct Response {
    status: u16,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
    /// Send only this many body bytes, then close (Content-Length still says all).
    cut_at: Option<usize>,
}

impl Response {
    fn new(status: u16) -> Self {
        Response {
            status,
            headers: Vec::new(),
            body: Vec::new(),
            cut_at: None,
        }
    }

    fn header(mut self, k: &str, v: impl Into<String>) -> Self {
        self.headers.push((k.to_string(), v.into()));
        self
    }

    fn json(self, value: serde_json::Value) -> Self {
        let mut r = self.header("content-type", "application/json");
        r.body = value.to_string().into_bytes();
        r
    }

    fn error(status: u16, code: Option<&str>, message: &str) -> Self {
        let mut r = Response::new(status).header("x-error-message", message);
        if let Some(c) = code {
            r = r.header("x-error-code", c);
        }
        r.json(serde_json::json!({ "error": message }))
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        206 => "Partial Content",
        302 => "Found",
        400 => "Bad Request",
        409 => "Conflict",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        416 => "Range Not Satisfiable",
        _ => "Other",
    }
}

fn handle(state: &State, stream: TcpStream) {
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut line = String::new();
    if reader.read_line(&mut line).unwrap_or(0) == 0 {
        return;
    }
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let target = parts.next().unwrap_or("").to_string();
    let mut headers = HashMap::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h).unwrap_or(0) == 0 {
            break;
        }
        let h = h.trim_end();
        if h.is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.insert(k.trim().to_ascii_lowercase(), v.trim().to_string());
        }
    }
    let path = target.split('?').next().unwrap_or("").to_string();
    state.log.lock().unwrap().push(Logged {
        method: method.clone(),
        path: path.clone(),
        headers: headers.clone(),
        at: std::time::Instant::now(),
    });
    let length: usize = headers
        .get("content-length")
        .and_then(|l| l.parse().ok())
        .unwrap_or(0);
    let lfs_put =
        method == "PUT" && (path.starts_with("/lfs-upload/") || path.starts_with("/lfs-part/"));
    let cut = match lfs_put {
        true => {
            let mut b = state.behaviour.lock().unwrap();
            match b.cut_upload {
                Some((n, left)) if length > n => {
                    b.cut_upload = (left > 1).then_some((n, left - 1));
                    Some(n)
                }
                _ => None,
            }
        }
        false => None,
    };
    let mut body = vec![0u8; cut.unwrap_or(length).min(length)];
    if std::io::Read::read_exact(&mut reader, &mut body).is_err() {
        return;
    }
    if cut.is_some() {
        let _ = stream.shutdown(Shutdown::Both);
        return;
    }
    if lfs_put {
        let mut b = state.behaviour.lock().unwrap();
        if let Some(canned) = b.answer_upload.take() {
            let mut response = Response::error(canned.status, None, "try again later");
            response.headers.extend(canned.headers.iter().cloned());
            b.answer_upload = (canned.left > 1).then(|| CannedAnswer {
                left: canned.left - 1,
                ..canned
            });
            drop(b);
            write_response(stream, &method, response);
            return;
        }
    }
    let mut response = match upload_route(state, &method, &path, &headers, &body) {
        Some(r) => r,
        None => route(state, &method, &path, &headers),
    };
    if let Some(commit) = &state.behaviour.lock().unwrap().repo_commit_header {
        for (k, v) in response.headers.iter_mut() {
            if k == "x-repo-commit" {
                *v = commit.clone();
            }
        }
    }
    write_response(stream, &method, response);
}

fn write_response(mut stream: TcpStream, method: &str, r: Response) {
    let mut head = format!("HTTP/1.1 {} {}\r\n", r.status, reason(r.status));
    let has_length = r.headers.iter().any(|(k, _)| k == "content-length");
    for (k, v) in &r.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if !has_length {
        head.push_str(&format!("content-length: {}\r\n", r.body.len()));
    }
    head.push_str("connection: close\r\n\r\n");
    let _ = stream.write_all(head.as_bytes());
    if method != "HEAD" {
        let n = r.cut_at.unwrap_or(r.body.len()).min(r.body.len());
        let _ = stream.write_all(&r.body[..n]);
    }
    let _ = stream.flush();
    let _ = stream.shutdown(Shutdown::Both);
}

/// The upload endpoints (`upload.rs`), behind the same token check as the rest.
fn upload_route(
    state: &State,
    method: &str,
    path: &str,
    headers: &HashMap<String, String>,
    body: &[u8],
) -> Option<Response> {
    let segs: Vec<String> = path
        .trim_start_matches('/')
        .split('/')
        .map(percent_decode)
        .collect();
    let lfs_action = matches!(
        segs.first().map(String::as_str),
        Some("lfs-upload" | "lfs-verify" | "lfs-part" | "lfs-complete")
    );
    let required = state.behaviour.lock().unwrap().required_token.clone();
    if let (Some(t), false) = (required, lfs_action) {
        if headers.get("authorization") != Some(&format!("Bearer {t}")) {
            return upload::is_upload(method, &segs).then(|| {
                Response::error(401, None, "Invalid credentials in Authorization header")
            });
        }
    }
    upload::route(state, method, &segs, body)
}

fn route(state: &State, method: &str, path: &str, headers: &HashMap<String, String>) -> Response {
    let segs: Vec<String> = path
        .trim_start_matches('/')
        .split('/')
        .map(percent_decode)
        .collect();
    if segs.first().map(String::as_str) == Some("cdn") && segs.len() == 2 {
        return cdn(state, method, &segs[1], headers);
    }
    let required = state.behaviour.lock().unwrap().required_token.clone();
    if let Some(t) = required {
        if headers.get("authorization") != Some(&format!("Bearer {t}")) {
            return Response::error(
                401,
                None,
                "Access to this repository is restricted. You must be authenticated to access it.",
            );
        }
    }
    let find_repo = |kind: &str, owner: &str, name: &str| {
        state
            .repos
            .iter()
            .find(|r| r.kind == kind && r.id == format!("{owner}/{name}"))
    };
    let find_rev = |repo: &HubRepo, rev: &str| {
        repo.revisions
            .iter()
            .find(|r| r.name == rev || r.sha == rev)
            .cloned()
    };
    let not_found = || Response::error(404, Some("RepoNotFound"), "Repository not found");
    let no_rev = || Response::error(404, Some("RevisionNotFound"), "Invalid rev id");

    if segs.first().map(String::as_str) == Some("api") && segs.len() >= 4 {
        let (kind, owner, name) = (&segs[1], &segs[2], &segs[3]);
        let Some(repo) = find_repo(kind, owner, name) else {
            return not_found();
        };
        let rest = &segs[4..];
        return match rest.first().map(String::as_str) {
            None | Some("revision") => {
                let rev = rest.get(1).map(String::as_str).unwrap_or("main");
                let Some(r) = find_rev(repo, rev) else {
                    return no_rev();
                };
                let siblings: Vec<_> = r
                    .files
                    .iter()
                    .map(|f| serde_json::json!({ "rfilename": f.path }))
                    .collect();
                Response::new(200).json(serde_json::json!({
                    "_id": "0123", "id": repo.id, "sha": r.sha, "private": false,
                    "siblings": siblings,
                }))
            }
            Some("tree") => {
                let rev = rest.get(1).map(String::as_str).unwrap_or("main");
                let Some(r) = find_rev(repo, rev) else {
                    return no_rev();
                };
                let mut entries = Vec::new();
                let mut dirs: Vec<String> = Vec::new();
                for f in &r.files {
                    let mut prefix = String::new();
                    for part in f
                        .path
                        .split('/')
                        .collect::<Vec<_>>()
                        .split_last()
                        .unwrap()
                        .1
                    {
                        prefix = if prefix.is_empty() {
                            part.to_string()
                        } else {
                            format!("{prefix}/{part}")
                        };
                        if !dirs.contains(&prefix) {
                            dirs.push(prefix.clone());
                            entries.push(serde_json::json!({
                                "type": "directory", "oid": git_oid(prefix.as_bytes()), "path": prefix,
                            }));
                        }
                    }
                    let mut e = serde_json::json!({
                        "type": "file", "oid": git_oid(&f.bytes), "size": f.bytes.len(), "path": f.path,
                    });
                    if let Some(sha) = &f.lfs_sha256 {
                        e["lfs"] = serde_json::json!({
                            "oid": sha, "size": f.bytes.len(), "pointerSize": 134,
                        });
                    }
                    entries.push(e);
                }
                Response::new(200).json(serde_json::Value::Array(entries))
            }
            _ => Response::error(404, None, "unknown API path"),
        };
    }

    // {datasets/}owner/name/resolve/rev/path...
    let (kind, segs) = if segs.first().map(String::as_str) == Some("datasets") {
        ("datasets", &segs[1..])
    } else {
        ("models", &segs[..])
    };
    if segs.len() >= 5 && segs[2] == "resolve" {
        let Some(repo) = find_repo(kind, &segs[0], &segs[1]) else {
            return not_found();
        };
        let Some(rev) = find_rev(repo, &segs[3]) else {
            return no_rev();
        };
        let file_path = segs[4..].join("/");
        let Some(file) = rev.files.iter().find(|f| f.path == file_path) else {
            return Response::error(404, Some("EntryNotFound"), "Entry not found")
                .header("x-repo-commit", rev.sha.clone());
        };
        if let Some(sha) = &file.lfs_sha256 {
            return Response::new(302)
                .header("location", format!("{}/cdn/{sha}", state.base))
                .header("x-repo-commit", rev.sha.clone())
                .header("x-linked-etag", format!("\"{sha}\""))
                .header("x-linked-size", file.bytes.len().to_string())
                .header("etag", format!("\"{}\"", git_oid(sha.as_bytes())))
                .header("content-length", "0");
        }
        let etag = git_oid(&file.bytes);
        return serve_bytes(&file.bytes, headers, None)
            .header("x-repo-commit", rev.sha.clone())
            .header("etag", format!("\"{etag}\""));
    }
    Response::error(404, None, "no such route")
}

fn cdn(state: &State, method: &str, sha: &str, headers: &HashMap<String, String>) -> Response {
    let file = state
        .repos
        .iter()
        .flat_map(|r| r.revisions.iter())
        .flat_map(|r| r.files.iter())
        .find(|f| f.lfs_sha256.as_deref() == Some(sha))
        .cloned();
    let Some(file) = file else {
        return Response::error(404, None, "no such object");
    };
    let mut b = state.behaviour.lock().unwrap();
    let bytes = b.corrupt.get(sha).cloned().unwrap_or(file.bytes);
    let cut = if method == "GET" && !headers.contains_key("range") {
        match &b.cut_once {
            Some((s, n)) if s == sha => {
                let n = *n;
                b.cut_once = None;
                Some(n)
            }
            _ => None,
        }
    } else {
        None
    };
    drop(b);
    serve_bytes(&bytes, headers, cut).header("etag", format!("\"{sha}\""))
}

/// 200 with the bytes, or 206 with the requested `bytes=a-b` / `bytes=a-` range.
fn serve_bytes(bytes: &[u8], headers: &HashMap<String, String>, cut_at: Option<usize>) -> Response {
    let total = bytes.len();
    let mut r = if let Some(range) = headers.get("range") {
        let spec = range.trim_start_matches("bytes=");
        let (a, b) = spec.split_once('-').unwrap_or((spec, ""));
        let start: usize = a.parse().unwrap_or(0);
        let end: usize = if b.is_empty() {
            total.saturating_sub(1)
        } else {
            b.parse::<usize>().unwrap_or(total - 1).min(total - 1)
        };
        if start >= total || start > end {
            return Response::new(416).header("content-range", format!("bytes */{total}"));
        }
        let mut r = Response::new(206)
            .header("content-range", format!("bytes {start}-{end}/{total}"))
            .header("content-length", (end + 1 - start).to_string());
        r.body = bytes[start..=end].to_vec();
        r
    } else {
        let mut r = Response::new(200).header("content-length", total.to_string());
        r.body = bytes.to_vec();
        r
    };
    r.cut_at = cut_at;
    r.header("accept-ranges", "bytes")
        .header("content-type", "application/octet-stream")
}
