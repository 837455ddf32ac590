//! Fixture paths and tensor comparison shared by the integration tests.

#![allow(dead_code)]

use std::path::PathBuf;

// Each test file uses a different subset.
#[allow(unused_imports)]
pub use ferrotune_testing::{assert_close, f32s, rel_l2};

/// The workspace-level `tests/fixtures/<rel>`.
pub fn workspace_fixture(rel: &str) -> PathBuf {
    ferrotune_testing::fixtures().join(rel)
}
