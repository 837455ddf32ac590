//! [`RemotePath`], [`etag_component`], [`CommitId`] and [`repo_folder_name`]: the one checked way
//! a name the Hub sends (a listing's file path, an ETag or `X-Repo-Commit` header) or a repository
//! id from a config becomes part of a local path. A hostile or broken server must not
//! make ferrotune create, replace or delete anything outside the folder it writes to (the output
//! folder of `ferrotune download`, the Hugging Face cache for recipe datasets).

use std::fmt;
use std::ops::Deref;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::RepoKind;

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

/// A git commit id from the Hub (the `X-Repo-Commit` header, a repository info's `sha`), checked
/// before it names a cache folder (`snapshots/{commit}`): exactly 40 lower-case hex digits, as
/// `huggingface_hub` requires of commit hashes. Built only by [`CommitId::new`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct CommitId(String);

impl CommitId {
    /// Checks `commit`; the error says what is wrong with it.
    pub(super) fn new(commit: &str) -> Result<CommitId, &'static str> {
        if commit.len() == 40
            && commit
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        {
            Ok(CommitId(commit.to_string()))
        } else {
            Err("not a commit id (40 lower-case hex digits)")
        }
    }

    /// The commit id.
    pub(super) fn as_str(&self) -> &str {
        &self.0
    }
}

/// The longest repository id the Hub accepts (`huggingface_hub`'s `validate_repo_id`).
const REPO_ID_MAX_LEN: usize = 96;

/// The cache folder of repository `repo_id` (from a config, so checked too): `models--{owner}--
/// {name}` or `datasets--{owner}--{name}` (`datasets--{name}` for an id without owner), as
/// `huggingface_hub` names it. The id must be what the Hub accepts (`validate_repo_id`): one or
/// two `/`-separated parts of ASCII letters, digits, `-`, `_` and `.`, each starting and ending
/// with a letter, digit or `_`, no `--` or `..` (which would make the folder name ambiguous or
/// climb), at most 96 characters.
pub(super) fn repo_folder_name(kind: RepoKind, repo_id: &str) -> Result<String, &'static str> {
    if repo_id.is_empty() {
        return Err("it is empty");
    }
    if repo_id.len() > REPO_ID_MAX_LEN {
        return Err("it is longer than 96 characters");
    }
    if repo_id.contains("--") || repo_id.contains("..") {
        return Err("it holds '--' or '..'");
    }
    let parts: Vec<&str> = repo_id.split('/').collect();
    if parts.len() > 2 {
        return Err("it has more than one '/' (expected 'owner/name' or 'name')");
    }
    let edge_ok = |b: Option<u8>| b.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_');
    for part in &parts {
        if !part
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
        {
            return Err(
                "it holds a character other than ASCII letters, digits, '-', '_', '.' and one '/'",
            );
        }
        if !edge_ok(part.bytes().next()) || !edge_ok(part.bytes().last()) {
            return Err("a part is empty, or starts or ends with '-' or '.'");
        }
    }
    Ok(std::iter::once(kind.plural())
        .chain(parts)
        .collect::<Vec<_>>()
        .join("--"))
}
