//! The models crate's structure, checked: its top-level modules import one another without a
//! cycle, no source file is over 1000 lines, and the families' registry is the only place that
//! names a `model_type` (outside tests).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use ferrotune_models::family;

fn src() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `dir`, or `dir` itself when it is a file.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    if dir.is_file() {
        return vec![dir.to_path_buf()];
    }
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    out
}

/// The source without comments and without `#[cfg(test)]` items (`mod tests { .. }` or
/// `mod tests;`).
fn code_of(text: &str) -> String {
    let without_comments: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let mut out = String::new();
    let mut rest = without_comments.as_str();
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at..];
        let stop = after.find(['{', ';']).unwrap_or(after.len());
        if after.as_bytes().get(stop) == Some(&b';') {
            rest = &after[stop + 1..];
            continue;
        }
        let mut depth = 0;
        let mut end = after.len();
        for (i, c) in after.char_indices().skip(stop) {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

/// The top-level modules a piece of code names through `crate::` (single paths and groups).
fn crate_uses(code: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        let tail = &code[at + "crate::".len()..];
        if let Some(group) = tail.strip_prefix('{') {
            let mut depth = 1;
            let mut item = String::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' => depth -= 1,
                    _ => {}
                }
                if depth == 0 || (depth == 1 && c == ',') {
                    if let Some(name) = item
                        .split(|c: char| !c.is_alphanumeric() && c != '_')
                        .find(|s| !s.is_empty())
                    {
                        found.insert(name.to_string());
                    }
                    item.clear();
                    if depth == 0 {
                        break;
                    }
                } else {
                    item.push(c);
                }
            }
        } else {
            let name: String = tail
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            found.insert(name);
        }
    }
    found
}

#[test]
fn top_level_modules_import_each_other_without_a_cycle() {
    let root = src();
    let lib = code_of(&std::fs::read_to_string(root.join("lib.rs")).unwrap());
    // Names the crate root re-exports resolve to their module (`crate::CausalLm` is `model`).
    let mut reexported = BTreeMap::new();
    for line in lib.lines().filter(|l| l.starts_with("pub use ")) {
        let path = line.trim_start_matches("pub use ").trim_end_matches(';');
        if let Some((module, names)) = path.split_once("::") {
            for name in names.split(|c: char| !c.is_alphanumeric() && c != '_') {
                if !name.is_empty() {
                    reexported.insert(name.to_string(), module.to_string());
                }
            }
        }
    }
    let mut modules = BTreeMap::new();
    for entry in std::fs::read_dir(&root).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        if name != "lib" {
            modules.insert(name, path);
        }
    }
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, path) in &modules {
        for file in rust_files(path) {
            let code = code_of(&std::fs::read_to_string(&file).unwrap());
            for used in crate_uses(&code) {
                let used = reexported.get(&used).cloned().unwrap_or(used);
                if &used != module && modules.contains_key(&used) {
                    edges.entry(module.clone()).or_default().insert(used);
                }
            }
        }
    }
    // Depth-first search for a path back to where it started.
    fn cycle_from(
        at: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
    ) -> Option<Vec<String>> {
        if let Some(i) = path.iter().position(|p| p == at) {
            let mut cycle = path[i..].to_vec();
            cycle.push(at.to_string());
            return Some(cycle);
        }
        if done.contains(at) {
            return None;
        }
        path.push(at.to_string());
        for next in edges.get(at).into_iter().flatten() {
            if let Some(c) = cycle_from(next, edges, path, done) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(at.to_string());
        None
    }
    let mut done = BTreeSet::new();
    for module in modules.keys() {
        let cycle = cycle_from(module, &edges, &mut Vec::new(), &mut done);
        assert!(
            cycle.is_none(),
            "import cycle: {}",
            cycle.unwrap().join(" -> ")
        );
    }
    // The check sees real edges: the decoder reads the config, GGUF reading the registry.
    assert!(edges["model"].contains("config"));
    assert!(edges["gguf"].contains("family"));
}

#[test]
fn no_source_file_is_over_1000_lines() {
    for file in rust_files(&src()) {
        let lines = std::fs::read_to_string(&file).unwrap().lines().count();
        assert!(lines <= 1000, "{}: {lines} lines", file.display());
    }
}

#[test]
fn model_types_are_named_only_by_the_families() {
    let family_dir = src().join("family");
    let types = family::supported_model_types();
    assert!(types.contains(&"llama") && types.contains(&"gemma3_text"));
    for file in rust_files(&src()) {
        if file.starts_with(&family_dir) {
            continue;
        }
        let code = code_of(&std::fs::read_to_string(&file).unwrap());
        for t in &types {
            assert!(
                !code.contains(&format!("\"{t}\"")),
                "{}: names the model_type \"{t}\" outside the families",
                file.display()
            );
        }
    }
}
