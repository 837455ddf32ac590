//! The Git LFS transfer of one object, as `huggingface_hub`'s `lfs.py` does it: `basic` (one
//! `PUT` of the whole file) or `multipart` (the batch answer's upload action carries `chunk_size`
//! and one numbered URL per part in its `header`: each part is `PUT` from the file at its offset,
//! the `ETag`s collected, and `{"oid", "parts": [{"partNumber", "etag"}]}` posted to the action's
//! `href`). Bodies are streamed from the file in [`READ_CHUNK`]-byte reads, so a file is never
//! held in memory whole (a 16 GB GGUF costs a few MB).
//!
//! Every request here goes through [`send_retrying`], `huggingface_hub`'s `http_backoff`: a
//! connection error or an HTTP 408/429/500/502/503/504 is retried up to [`MAX_RETRIES`] times,
//! waiting 1, 2, 4, 8, 8 s (at most 23 s in all), the same request rebuilt (the body re-read from
//! the file). An answer that says how long to wait is obeyed instead, as `http_backoff` does
//! ([`server_wait`]): a 429 whose `RateLimit` header leaves no request (`"api";r=0;t=55`) waits
//! its reset, `t` + 1 s; otherwise a `Retry-After` in seconds waits that + 1 s (an HTTP-date
//! `Retry-After` is ignored, as there). Neither is capped (`http_backoff` caps only its own
//! doubling), and the doubling goes on underneath. Each wait is reported (`UploadEvent::Retrying`), as
//! `http_backoff` logs it. Transient S3 and proxy failures are this short-lived; past it, the
//! upload fails and running it again skips what is on the Hub. A retried multipart upload sends
//! only the part that failed: the parts before it have their `ETag`s.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};

use super::client::Hub;
use super::upload::UploadEvent;
use crate::error::{DataError, Result};

/// Retries after the first try (`http_backoff`'s `max_retries`).
pub(super) const MAX_RETRIES: u32 = 5;
/// The first wait; it doubles up to [`MAX_WAIT`] (`base_wait_time`, `max_wait_time`).
const BASE_WAIT: Duration = Duration::from_secs(1);
const MAX_WAIT: Duration = Duration::from_secs(8);
/// The size of one read from the file while a body is sent.
pub(super) const READ_CHUNK: usize = 1 << 20;

/// `len` bytes of a file from `offset`, read [`READ_CHUNK`] bytes at a time: the body of a
/// `PUT`. Never holds more than one chunk.
pub(super) struct FileSlice {
    file: std::fs::File,
    path: PathBuf,
    left: u64,
}

impl FileSlice {
    pub(super) fn open(path: &Path, offset: u64, len: u64) -> Result<FileSlice> {
        let io = |e: std::io::Error| DataError::Hub(format!("{}: {e}", path.display()));
        let mut file = std::fs::File::open(path).map_err(io)?;
        file.seek(SeekFrom::Start(offset)).map_err(io)?;
        Ok(FileSlice {
            file,
            path: path.to_path_buf(),
            left: len,
        })
    }

    /// A request body that streams the slice.
    fn body(self) -> reqwest::Body {
        reqwest::Body::wrap_stream(futures::stream::iter(self))
    }
}

impl Iterator for FileSlice {
    type Item = std::io::Result<Vec<u8>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        let n = self.left.min(READ_CHUNK as u64) as usize;
        let mut buf = vec![0u8; n];
        match self.file.read_exact(&mut buf) {
            Ok(()) => {
                self.left -= n as u64;
                Some(Ok(buf))
            }
            Err(e) => {
                self.left = 0;
                let path = self.path.display();
                Some(Err(std::io::Error::new(e.kind(), format!("{path}: {e}"))))
            }
        }
    }
}

/// Sends the request `build` makes, retrying as `http_backoff` does (see the module
/// documentation); each retry is told to `on_event` before its wait. Returns the last answer (success or not) or the last connection error.
pub(super) async fn send_retrying(
    what: &str,
    on_event: &mut dyn FnMut(UploadEvent<'_>),
    mut build: impl FnMut() -> Result<reqwest::RequestBuilder>,
) -> Result<reqwest::Response> {
    let mut backoff = BASE_WAIT;
    let mut tries = 0;
    loop {
        tries += 1;
        let result = build()?.send().await;
        let transient = match &result {
            Ok(r) => matches!(r.status().as_u16(), 408 | 429 | 500 | 502 | 503 | 504),
            Err(e) => !e.is_builder(),
        };
        if !transient || tries > MAX_RETRIES {
            return result.map_err(|e| net_error(what, e));
        }
        let (failure, told) = match &result {
            Ok(r) => (
                format!("HTTP {}", r.status().as_u16()),
                server_wait(r.status().as_u16(), r.headers()),
            ),
            Err(_) => ("the connection failed".to_string(), None),
        };
        let wait = match told {
            Some(secs) => Duration::from_secs(secs.saturating_add(1)),
            None => backoff,
        };
        on_event(UploadEvent::Retrying {
            what,
            failure: &failure,
            wait,
            told: told.is_some(),
            retry: tries,
            max: MAX_RETRIES,
        });
        tokio::time::sleep(wait).await;
        backoff = (backoff * 2).min(MAX_WAIT);
    }
}

/// The seconds an answer asks the client to wait, as `http_backoff` reads them: on a 429, the
/// reset of a `RateLimit` header (`"api";r=0;t=55`: resource, requests left, seconds to the
/// reset) that leaves no request; else `Retry-After` in seconds. An HTTP-date `Retry-After`, or
/// none, is `None`: the client's own backoff.
pub(super) fn server_wait(status: u16, headers: &reqwest::header::HeaderMap) -> Option<u64> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if status == 429 {
        if let Some((0, reset)) = header("ratelimit").and_then(ratelimit) {
            return Some(reset);
        }
    }
    let retry_after = header("retry-after")?.trim();
    match !retry_after.is_empty() && retry_after.bytes().all(|b| b.is_ascii_digit()) {
        true => retry_after.parse().ok(),
        false => None,
    }
}

/// A `RateLimit` header's requests left and seconds to the reset (`parse_ratelimit_headers`:
/// its pattern, searched anywhere in the value).
fn ratelimit(value: &str) -> Option<(u64, u64)> {
    static PATTERN: std::sync::OnceLock<fancy_regex::Regex> = std::sync::OnceLock::new();
    let re = PATTERN.get_or_init(|| {
        fancy_regex::Regex::new(r#""(\w+)"\s*;\s*r\s*=\s*(\d+)\s*;\s*t\s*=\s*(\d+)"#)
            .expect("a valid pattern")
    });
    let caps = re.captures(value).ok()??;
    Some((caps[2].parse().ok()?, caps[3].parse().ok()?))
}

/// A connection error, worded for a rerun.
pub(super) fn net_error(what: &str, e: reqwest::Error) -> DataError {
    use std::error::Error;
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg = format!("{msg}: {s}");
        src = s.source();
    }
    DataError::Hub(format!(
        "{what}: {msg} (the connection failed; run the upload again: what was uploaded is kept)"
    ))
}

/// An unsuccessful answer as one line (the Hub's `X-Error-Message` when it sends one).
pub(super) async fn status_error(resp: reqwest::Response, what: &str) -> DataError {
    let status = resp.status();
    let msg = resp
        .headers()
        .get("x-error-message")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let body = resp.text().await.unwrap_or_default();
    let hint = match status.as_u16() {
        401 | 403 => " (check HF_TOKEN: uploading needs a token with write access)",
        _ => "",
    };
    DataError::Hub(format!(
        "{what}: HTTP {status}: {}{hint}",
        msg.unwrap_or(body)
    ))
}

/// One LFS object to send: its file, size and sha256 (hex), and its name in messages.
pub(super) struct Object<'a> {
    pub(super) local: &'a Path,
    pub(super) size: u64,
    pub(super) oid: &'a str,
    pub(super) path_in_repo: &'a str,
}

/// Sends `obj` as the batch answer's `upload` action says: multipart when its header carries
/// `chunk_size`, else one `PUT` with the action's headers.
pub(super) async fn transfer(
    hub: &Hub,
    obj: &Object<'_>,
    upload: &Value,
    on_event: &mut dyn FnMut(UploadEvent<'_>),
) -> Result<()> {
    let href = upload["href"].as_str().ok_or_else(|| {
        DataError::Hub(format!(
            "LFS batch: no upload href for '{}'",
            obj.path_in_repo
        ))
    })?;
    let header = upload["header"].as_object().cloned().unwrap_or_default();
    let what = format!("upload '{}'", obj.path_in_repo);
    let Some(chunk) = header.get("chunk_size") else {
        let resp = send_retrying(&what, on_event, || {
            let mut rb = hub
                .http
                .put(href)
                .header("content-length", obj.size)
                .body(FileSlice::open(obj.local, 0, obj.size)?.body());
            for (k, v) in &header {
                if let Some(v) = v.as_str() {
                    rb = rb.header(k.as_str(), v);
                }
            }
            Ok(rb)
        })
        .await?;
        if !resp.status().is_success() {
            return Err(status_error(resp, &what).await);
        }
        return Ok(());
    };
    let chunk = match chunk {
        Value::String(s) => s.parse::<u64>().ok(),
        v => v.as_u64(),
    }
    .filter(|&c| c > 0)
    .ok_or_else(|| {
        DataError::Hub(format!(
            "{what}: malformed LFS batch answer: chunk_size {chunk}"
        ))
    })?;
    // The part URLs, by their number (`_get_sorted_parts_urls`).
    let mut parts: Vec<(u64, &str)> = header
        .iter()
        .filter(|(k, _)| !k.is_empty() && k.bytes().all(|b| b.is_ascii_digit()))
        .filter_map(|(k, v)| Some((k.parse().ok()?, v.as_str()?)))
        .collect();
    parts.sort();
    if parts.len() as u64 != obj.size.div_ceil(chunk) {
        return Err(DataError::Hub(format!(
            "{what}: invalid LFS batch answer: {} part URLs for {} bytes in parts of {chunk}",
            parts.len(),
            obj.size
        )));
    }
    let mut done = Vec::with_capacity(parts.len());
    for (i, (_, url)) in parts.iter().enumerate() {
        let offset = chunk * i as u64;
        let len = chunk.min(obj.size - offset);
        let what = format!("{what} (part {} of {})", i + 1, parts.len());
        let resp = send_retrying(&what, on_event, || {
            Ok(hub
                .http
                .put(*url)
                .header("content-length", len)
                .body(FileSlice::open(obj.local, offset, len)?.body()))
        })
        .await?;
        if !resp.status().is_success() {
            return Err(status_error(resp, &what).await);
        }
        let etag = resp
            .headers()
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| DataError::Hub(format!("{what}: the answer carries no ETag")))?;
        done.push(json!({ "partNumber": i + 1, "etag": etag }));
    }
    let body = json!({ "oid": obj.oid, "parts": done }).to_string();
    let what = format!("{what} (completing the multipart upload)");
    let resp = send_retrying(&what, on_event, || {
        Ok(hub
            .http
            .post(href)
            .header("accept", "application/vnd.git-lfs+json")
            .header("content-type", "application/vnd.git-lfs+json")
            .body(body.clone()))
    })
    .await?;
    if !resp.status().is_success() {
        return Err(status_error(resp, &what).await);
    }
    Ok(())
}
