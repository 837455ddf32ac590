//! Helpers shared by the model tests.
// Each test file uses its own subset.
#![allow(dead_code)]

use std::path::PathBuf;

// Each test file uses a different subset.
#[allow(unused_imports)]
pub use ferrotune_testing::{max_abs_diff, rel_l2};

/// The repository's tests/fixtures, or `FERROTUNE_TEST_FIXTURES` (a test binary run on another
/// machine, where the build's path does not exist).
pub fn fixtures() -> PathBuf {
    std::env::var_os("FERROTUNE_TEST_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(ferrotune_testing::fixtures)
}
