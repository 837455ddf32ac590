//! The `FERROTUNE_*` knob registry (`src/switch.rs`): the crates' sources read a knob only
//! through it, every knob is documented in `docs/src/environment.md` (which holds the registry's table),
//! and every other `FERROTUNE_*` name the scripts, benchmarks, tests and docs use is either a
//! knob or listed there as the scripts' and tests' own.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use ferrotune_core::switch::{markdown_table, KnobKind, KNOBS};

const PREFIX: &str = "FERROTUNE_";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The files under `dir` (recursively) whose name ends with one of `exts`, sorted.
fn files(dir: &Path, exts: &[&str]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for entry in entries {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(files(&path, exts));
        } else if exts.iter().any(|e| path.to_string_lossy().ends_with(e)) {
            out.push(path);
        }
    }
    out.sort();
    out
}

/// The crates' folders.
fn crates() -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(repo().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("Cargo.toml").exists())
        .collect();
    out.sort();
    out
}

/// The `FERROTUNE_*` names in `line` (a bare `FERROTUNE_*` wildcard is not a name).
fn names(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find(PREFIX) {
        let tail = &rest[at + PREFIX.len()..];
        let len = tail
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(tail.len());
        if len > 0 {
            out.push(format!("{PREFIX}{}", &tail[..len]));
        }
        rest = &tail[len..];
    }
    out
}

/// The numbered lines of a source file outside its `#[cfg(test)] mod … { … }` blocks: unit tests
/// make up variable names of their own, which are not knobs.
fn shipped_lines(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut test_module_end: Option<String> = None;
    let mut after_cfg_test = false;
    for (i, line) in text.lines().enumerate() {
        if let Some(end) = &test_module_end {
            if line == end {
                test_module_end = None;
            }
            continue;
        }
        let trimmed = line.trim_start();
        if after_cfg_test && trimmed.starts_with("mod ") && trimmed.ends_with('{') {
            // The block ends at the first `}` indented as its `mod` line.
            test_module_end = Some(format!("{}}}", &line[..line.len() - trimmed.len()]));
            after_cfg_test = false;
            continue;
        }
        if trimmed == "#[cfg(test)]" {
            after_cfg_test = true;
        } else if !trimmed.starts_with("#[") {
            after_cfg_test = false;
        }
        out.push((i + 1, line));
    }
    out
}

fn registered(name: &str) -> bool {
    KNOBS.iter().any(|k| k.name == name)
}

/// Whether `path` is a test module declared out of line (`#[cfg(test)] mod tests;` in its
/// parent module's file), which is test code as an inline `mod tests { ... }` block is.
fn is_out_of_line_test_module(path: &Path) -> bool {
    let (Some(stem), Some(dir)) = (path.file_stem().and_then(|s| s.to_str()), path.parent()) else {
        return false;
    };
    let parents = [
        dir.join("mod.rs"),
        dir.join("lib.rs"),
        dir.join("main.rs"),
        dir.with_extension("rs"),
    ];
    parents
        .iter()
        .filter(|p| p.as_path() != path)
        .any(|parent| {
            let Ok(text) = std::fs::read_to_string(parent) else {
                return false;
            };
            let lines: Vec<&str> = text.lines().map(str::trim).collect();
            lines
                .windows(2)
                .any(|w| w[0] == "#[cfg(test)]" && w[1] == format!("mod {stem};"))
        })
}

fn relative(path: &Path) -> String {
    path.strip_prefix(repo())
        .unwrap_or(path)
        .display()
        .to_string()
}

#[test]
fn shipped_code_reads_knobs_only_through_the_registry() {
    let registry = repo().join("crates/ferrotune-core/src/switch.rs");
    let mut problems = Vec::new();
    for krate in crates() {
        for path in files(&krate.join("src"), &[".rs"]) {
            if path.canonicalize().unwrap() == registry.canonicalize().unwrap()
                || is_out_of_line_test_module(&path)
            {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            for (n, line) in shipped_lines(&text) {
                let comment = line.trim_start().starts_with("//");
                for name in names(line) {
                    if !comment {
                        problems.push(format!(
                            "{}:{n}: `{name}` in code: take the name and value from \
                             ferrotune_core::switch (add the knob there)",
                            relative(&path)
                        ));
                    } else if !registered(&name) {
                        problems.push(format!(
                            "{}:{n}: a comment names `{name}`, which is no knob of \
                             ferrotune_core::switch",
                            relative(&path)
                        ));
                    }
                }
            }
        }
        // A build script cannot use the registry; what it sets must be a build-time knob.
        let build = krate.join("build.rs");
        if let Ok(text) = std::fs::read_to_string(&build) {
            for (n, line) in text.lines().enumerate() {
                for name in names(line) {
                    if !KNOBS
                        .iter()
                        .any(|k| k.name == name && k.kind == KnobKind::Build)
                    {
                        problems.push(format!(
                            "{}:{}: `{name}` is no build-time knob of ferrotune_core::switch",
                            relative(&build),
                            n + 1
                        ));
                    }
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn every_knob_is_named_once_and_described() {
    let mut seen = BTreeSet::new();
    for k in KNOBS {
        assert!(k.name.starts_with(PREFIX), "{}", k.name);
        assert!(seen.insert(k.name), "{} is registered twice", k.name);
        assert!(!k.meaning.trim().is_empty(), "{} has no meaning", k.name);
        assert!(!k.default.trim().is_empty(), "{} has no default", k.name);
        assert!(
            !k.meaning.contains('|') && !k.default.contains('|'),
            "{}: a `|` would break the table",
            k.name
        );
    }
}

#[test]
fn the_environment_page_holds_the_registry() {
    let doc = std::fs::read_to_string(repo().join("docs/src/environment.md")).unwrap();
    let table = markdown_table();
    assert!(
        doc.contains(&table),
        "docs/src/environment.md does not hold the registry's table (crates/ferrotune-core/src/switch.rs); \
         replace its table with:\n\n{table}"
    );
}

#[test]
fn every_other_ferrotune_name_is_a_knob_or_documented() {
    let doc = std::fs::read_to_string(repo().join("docs/src/environment.md")).unwrap();
    let documented: BTreeSet<String> = doc.lines().flat_map(names).collect();
    let mut paths = files(&repo().join("scripts"), &[".sh", ".py"]);
    paths.extend(files(&repo().join("benchmarks"), &[".sh", ".py", ".md"]));
    paths.extend(files(&repo().join("docs"), &[".md"]));
    paths.push(repo().join("README.md"));
    for krate in crates() {
        paths.extend(files(&krate.join("tests"), &[".rs"]));
    }
    let mut problems = Vec::new();
    for path in paths {
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        for (n, line) in text.lines().enumerate() {
            for name in names(line) {
                if !registered(&name) && !documented.contains(&name) {
                    problems.push(format!(
                        "{}:{}: `{name}` is neither a knob of ferrotune_core::switch nor \
                         listed in docs/src/environment.md",
                        relative(&path),
                        n + 1
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
