//! The recipes' layout rules (docs/src/architecture.md): no recipe imports another, and the shared
//! machinery (the kit, `setup`, `state`) imports no recipe. A recipe is a module of
//! `src/recipe/` other than those; the registry (`src/recipe/mod.rs`) names them all.

use std::path::{Path, PathBuf};

/// The modules of `src/recipe/` every recipe may use; the others are recipes.
const SHARED: &[&str] = &["kit", "setup", "state"];

fn recipe_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src/recipe")
}

/// The `.rs` files under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
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

/// The top-level modules of `src/recipe/` (files and folders), `mod.rs` excluded.
fn modules() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(recipe_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter_map(|p| {
            let stem = p.file_stem()?.to_str()?.to_string();
            (p.is_dir() || stem != "mod").then_some(stem)
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The recipe modules `text` names through `recipe::NAME` paths (a `use`, a qualified call, or a
/// `recipe::{NAME, ...}` group), comments left out.
fn named_modules<'a>(text: &str, candidates: &'a [String]) -> Vec<&'a str> {
    let code: String = text
        .lines()
        .map(|l| l.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let ident_end = |c: char| !(c.is_alphanumeric() || c == '_');
    let mut named: Vec<&str> = Vec::new();
    for (i, _) in code.match_indices("recipe::") {
        let rest = &code[i + "recipe::".len()..];
        let heads: Vec<&str> = match rest.strip_prefix('{') {
            // A group: the first segment of each of its paths.
            Some(group) => group
                .split('}')
                .next()
                .unwrap_or("")
                .split(',')
                .map(|p| p.trim().split(ident_end).next().unwrap_or(""))
                .collect(),
            None => vec![rest.split(ident_end).next().unwrap_or("")],
        };
        for head in heads {
            if let Some(m) = candidates.iter().find(|m| m.as_str() == head) {
                if !named.contains(&m.as_str()) {
                    named.push(m);
                }
            }
        }
    }
    named
}

#[test]
fn no_recipe_imports_another_and_the_kit_imports_no_recipe() {
    let all = modules();
    let recipes: Vec<String> = all
        .iter()
        .filter(|m| !SHARED.contains(&m.as_str()))
        .cloned()
        .collect();
    // The rule means something only while there are recipes and shared modules to tell apart.
    for expected in [
        "lora_finetune",
        "dpo",
        "grpo",
        "ppo",
        "generate",
        "kit",
        "setup",
    ] {
        assert!(
            all.iter().any(|m| m == expected),
            "src/recipe/{expected} is gone; update this test"
        );
    }
    let mut problems = Vec::new();
    for module in &all {
        let base = recipe_dir();
        let files = if base.join(module).is_dir() {
            rust_files(&base.join(module))
        } else {
            vec![base.join(format!("{module}.rs"))]
        };
        for file in files {
            let text = std::fs::read_to_string(&file).unwrap();
            for other in named_modules(&text, &recipes) {
                if other != module {
                    problems.push(format!(
                        "{} (module {module}) uses recipe {other}",
                        file.strip_prefix(&base).unwrap().display()
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_rule_sees_an_import() {
    let recipes = vec!["grpo".to_string(), "ppo".to_string()];
    assert_eq!(
        named_modules("use crate::recipe::ppo::passes;\n", &recipes),
        ["ppo"]
    );
    assert_eq!(
        named_modules("let x = crate::recipe::grpo::run(cfg);", &recipes),
        ["grpo"]
    );
    assert!(named_modules(
        "// see crate::recipe::ppo\nuse crate::recipe::ppo_like;",
        &recipes
    )
    .is_empty());
}
