//! Where the tests' inputs are and where they write: the repository's fixtures and fresh folders
//! under the temp dir.

use std::path::{Path, PathBuf};

/// The repository's `tests/fixtures` (every crate's tests read the same checkpoints and goldens).
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// A fresh, empty folder `name` under the temp dir (what an earlier run left there removed).
/// Tests of one crate share a process, so `name` carries its module's group and the process id.
pub fn fresh_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
