//! A fuzzing harness for ferrotune's parsers of untrusted files, on stable Rust.
//!
//! Not `cargo fuzz`: libFuzzer needs a nightly compiler (`-Zsanitizer`), and this project builds
//! and tests on stable only. Instead a small mutation fuzzer without coverage feedback: seeds from
//! `corpus/<target>/` mutated byte- and token-wise ([`mutate`]), each input run in a worker process
//! ([`worker`]) so that aborts, kills for memory and hangs are caught along with panics. It finds
//! the shallow crashes a parser of hostile files must not have (lengths and offsets trusted,
//! unchecked arithmetic, unbounded allocation or recursion); a coverage-guided fuzzer would go
//! deeper, given a nightly toolchain.
//!
//! `cargo run --release -p ferrotune-fuzz -- run --cpu-secs 600` fuzzes every target for ten CPU
//! minutes; see docs/src/reliability.md ("Fuzzing").

pub mod driver;
pub mod mutate;
pub mod targets;
pub mod worker;

/// This crate's folder (the corpus, fixtures and regression inputs are read from it).
pub fn crate_dir() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}
