//! The short fuzz run of the test suite: every target over its corpus and regression inputs (the
//! inputs of past crashes, in `regressions/<target>/`), then a few hundred seeded mutations, each
//! in a worker under the 2 GiB memory cap, with none allowed to panic, abort or hang.

use std::process::Command;

/// Runs the fuzzer on `target` for `execs` inputs with a fixed seed; fails naming the findings.
fn short_run(target: &str, execs: u64) {
    let crashes = std::env::temp_dir().join(format!(
        "ferrotune-fuzz-test-{target}-{}",
        std::process::id()
    ));
    let out = Command::new(env!("CARGO_BIN_EXE_ferrotune-fuzz"))
        .args(["run", "--quiet", "--seed", "1", "--timeout-secs", "60"])
        .args([
            "--targets",
            target,
            "--execs",
            &execs.to_string(),
            "--cpu-secs",
            "120",
        ])
        .arg("--crashes")
        .arg(&crashes)
        .output()
        .expect("the fuzzer runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let _ = std::fs::remove_dir_all(&crashes);
    assert!(
        out.status.success(),
        "{target}: inputs broke the parser:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with(target) && l[target.len()..].starts_with(' '))
        .unwrap_or_else(|| panic!("no report line for {target}:\n{stdout}"));
    let ran: u64 = line
        .split_whitespace()
        .nth(2)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert_eq!(ran, execs, "{target}: {line}");
}

#[test]
fn safetensors() {
    short_run("safetensors", 400);
}

#[test]
fn safetensors_index() {
    short_run("safetensors_index", 400);
}

#[test]
fn gguf() {
    short_run("gguf", 300);
}

#[test]
fn torch_pickle() {
    short_run("torch_pickle", 400);
}

#[test]
fn config() {
    short_run("config", 400);
}

#[test]
fn tokenized_jsonl() {
    short_run("tokenized_jsonl", 400);
}

#[test]
fn chat_template() {
    short_run("chat_template", 400);
}
