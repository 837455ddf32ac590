//! [`RemotePath`] and [`etag_component`]: the one checked way a name the Hub sends (a listing's
//! file path, an ETag header) becomes part of a local path. A hostile or broken server must not
//! make ferrotune create, replace or delete anything outside the folder it writes to (the output
//! folder of `ferrotune download`, the Hugging Face cache for recipe datasets).

use std::fmt;
use std::ops::Deref;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// A repository file path from a Hub listing, checked to stay under any folder it is joined to:
/// relative, `/`-separated segments that are neither empty, `.` nor `..`, and no NUL or
/// backslash (a Windows separator) anywhere. Built only by [`RemotePath::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct RemotePath(String);

impl RemotePath {
    /// Checks `path`; the error says what is wrong with it.
    pub(super) fn new(path: &str) -> Result<RemotePath, &'static str> {
        if path.is_empty() {
            return Err("it is empty");
        }
        if path.starts_with('/') {
            return Err("it is absolute");
        }
        if path.contains('\0') {
            return Err("it holds a NUL byte");
        }
        if path.contains('\\') {
            return Err("it holds a backslash");
        }
        for seg in path.split('/') {
            match seg {
                "" => return Err("it has an empty segment"),
                "." | ".." => return Err("it has a '.' or '..' segment"),
                _ => {}
            }
        }
        Ok(RemotePath(path.to_string()))
    }

    /// The path as the listing spelled it.
    pub(super) fn as_str(&self) -> &str {
        &self.0
    }

    /// `root` joined with this path; lexically under `root` by construction.
    pub(super) fn under(&self, root: &Path) -> PathBuf {
        let joined = root.join(&self.0);
        debug_assert!(joined.starts_with(root) && joined != root);
        joined
    }
}

impl Deref for RemotePath {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RemotePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// An ETag (or any other header value) made safe to put in a file name: kept as it is when it is
/// 1 to 128 ASCII letters and digits (the Hub's sha256s and git blob ids), else replaced by its
/// sha256 in hex, so `../` or a `/` in a header can never reach the file system.
pub(super) fn etag_component(etag: &str) -> String {
    if !etag.is_empty() && etag.len() <= 128 && etag.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return etag.to_string();
    }
    Sha256::digest(etag.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
