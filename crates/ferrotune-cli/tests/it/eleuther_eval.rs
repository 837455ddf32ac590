//! `ferrotune run eleuther_eval` end to end: the built-in tasks fetch their datasets from the Hub
//! (a loopback stand-in serving the repositories' real layouts: config folders, `{split}-NNNNN-of-
//! NNNNN.parquet` shards, a loading-script dataset read through the parquet conversion) and the
//! printed metrics equal lm-evaluation-harness's on the same documents
//! (tests/fixtures/eleuther, scripts/make_eleuther_fixtures.py).

use crate::common::read_json;
use crate::hub_server;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use hub_server::{HubFile, HubRepo, HubRevision, HubServer};
use serde_json::Value;

const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

fn fixtures() -> PathBuf {
    ferrotune_testing::fixtures().join("eleuther")
}

fn parquet(stem: &str) -> Vec<u8> {
    std::fs::read(fixtures().join(format!("data/{stem}.parquet"))).unwrap()
}

fn repo(id: &str, revisions: Vec<(&str, Vec<HubFile>)>) -> HubRepo {
    HubRepo {
        kind: "datasets",
        id: id.into(),
        revisions: revisions
            .into_iter()
            .enumerate()
            .map(|(i, (name, files))| HubRevision {
                name: name.into(),
                sha: if i == 0 {
                    COMMIT.into()
                } else {
                    "fedcba9876543210fedcba9876543210fedcba98".into()
                },
                files,
            })
            .collect(),
    }
}

fn hub_repos(golden: &Value) -> Vec<HubRepo> {
    // MMLU: a folder per subject with its splits (and `all/`), as `cais/mmlu` has them.
    let mut mmlu_files = vec![HubFile::plain(
        "all/test-00000-of-00001.parquet",
        &parquet("arc_easy"),
    )];
    for (subject, category) in golden["mmlu_subjects"].as_object().unwrap() {
        let file = parquet(&format!("mmlu_{}", category.as_str().unwrap()));
        mmlu_files.push(HubFile::plain(
            &format!("{subject}/dev-00000-of-00001.parquet"),
            &parquet("arc_easy"),
        ));
        mmlu_files.push(HubFile::plain(
            &format!("{subject}/test-00000-of-00001.parquet"),
            &file,
        ));
    }
    vec![
        repo("cais/mmlu", vec![("main", mmlu_files)]),
        repo(
            "openai/gsm8k",
            vec![(
                "main",
                vec![
                    HubFile::plain("main/train-00000-of-00001.parquet", &parquet("gsm8k_train")),
                    HubFile::plain("main/test-00000-of-00001.parquet", &parquet("gsm8k_test")),
                    HubFile::plain("socratic/test-00000-of-00001.parquet", &parquet("arc_easy")),
                ],
            )],
        ),
        repo(
            "truthfulqa/truthful_qa",
            vec![(
                "main",
                vec![
                    HubFile::plain("README.md", b"---\n---\n"),
                    HubFile::plain(
                        "generation/validation-00000-of-00001.parquet",
                        &parquet("arc_easy"),
                    ),
                    HubFile::plain(
                        "multiple_choice/validation-00000-of-00001.parquet",
                        &parquet("truthfulqa_mc"),
                    ),
                ],
            )],
        ),
        repo(
            "allenai/ai2_arc",
            vec![(
                "main",
                vec![
                    HubFile::plain(
                        "ARC-Challenge/test-00000-of-00001.parquet",
                        &parquet("arc_challenge"),
                    ),
                    HubFile::plain("ARC-Easy/test-00000-of-00001.parquet", &parquet("arc_easy")),
                    HubFile::plain(
                        "ARC-Easy/validation-00000-of-00001.parquet",
                        &parquet("piqa"),
                    ),
                ],
            )],
        ),
        // A loading-script dataset: only the Hub's parquet conversion holds its rows.
        repo(
            "Rowan/hellaswag",
            vec![
                (
                    "main",
                    vec![HubFile::plain("hellaswag.py", b"import datasets\n")],
                ),
                (
                    "refs/convert/parquet",
                    vec![HubFile::plain(
                        "default/validation/0000.parquet",
                        &parquet("hellaswag"),
                    )],
                ),
            ],
        ),
        repo(
            "allenai/winogrande",
            vec![(
                "main",
                vec![HubFile::plain(
                    "winogrande_xl/validation-00000-of-00001.parquet",
                    &parquet("winogrande"),
                )],
            )],
        ),
    ]
}

/// `ferrotune run eleuther_eval --config eleuther_evaluation` on SmolLM2 (f32, CPU) against the
/// loopback Hub, with `extra` overrides, from `home`.
fn run_eval(server: &HubServer, home: &Path, gguf: &str, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .args([
            "run",
            "eleuther_eval",
            "--config",
            "eleuther_evaluation",
            "model._component_=torchtune.models.smollm2.smollm2_135m",
            &format!("checkpointer.checkpoint_dir={gguf}"),
            "~checkpointer.checkpoint_files",
            &format!("tokenizer.path={gguf}"),
            "device=cpu",
            "dtype=fp32",
        ])
        .args(extra)
        .current_dir(home)
        .env("HF_ENDPOINT", server.url())
        .env("HF_HOME", home.join("hf-home"))
        .env_remove("HF_TOKEN")
        .env_remove("HF_HUB_CACHE")
        .output()
        .unwrap()
}

/// Each of lm-eval's metrics for `name` (a task or group) within `tol` of the printed JSON's.
fn assert_metrics(json: &Value, name: &str, want: &Value, tol: f64) {
    for (k, v) in want.as_object().unwrap() {
        let (a, b) = (json[name][k].as_f64().unwrap(), v.as_f64().unwrap());
        assert!((a - b).abs() < tol, "{name} {k}: {a} vs lm-eval {b}");
    }
}

#[test]
fn builtin_tasks_read_the_hub_and_report_lm_eval_metrics() {
    let golden: Value = read_json(fixtures().join("golden.json"));
    let gguf = ferrotune_data::asset_path("SmolLM2-135M-Instruct.Q4_1.gguf").unwrap();
    let server = HubServer::start(hub_repos(&golden));
    let home = std::env::temp_dir().join(format!("ferrotune-eleuther-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&home).unwrap();
    let gguf = gguf.display().to_string();
    let out = run_eval(
        &server,
        &home,
        &gguf,
        &[
            "batch_size=4",
            "tasks=[truthfulqa_mc2,arc_easy,hellaswag,winogrande,mmlu,gsm8k]",
        ],
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {stderr}");
    // The harness's table (MMLU's groups first, as a tree, then the other tasks), then the
    // metrics as JSON.
    let lines: Vec<&str> = stdout.lines().collect();
    let at = lines
        .iter()
        .position(|l| l.contains(" Tasks "))
        .expect("a table");
    assert!(lines[at + 2].starts_with("|mmlu "), "{stdout}");
    assert!(lines[at + 3].starts_with("| - humanities "), "{stdout}");
    assert!(lines[at + 4].starts_with("|  - formal_logic "), "{stdout}");
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("|truthfulqa_mc2 ") && l.contains("|0.4933|")),
        "{stdout}"
    );
    let json: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    for task in ["truthfulqa_mc2", "arc_easy", "hellaswag", "winogrande"] {
        assert_eq!(
            json[task]["samples"],
            golden["tasks"][task]["samples"].as_array().unwrap().len()
        );
        assert_metrics(&json, task, &golden["tasks"][task]["metrics"], 1e-5);
    }
    // GSM8K: 5 examples drawn from the train split, generated answers, both filters.
    assert_metrics(&json, "gsm8k", &golden["gsm8k"]["metrics"], 1e-9);
    for (name, want) in golden["mmlu"].as_object().unwrap() {
        assert_metrics(&json, name, want, 1e-5);
    }
    // The conversion was read for the loading-script dataset.
    assert!(server
        .log()
        .iter()
        .any(|r| r.path.contains("Rowan/hellaswag") && r.path.contains("convert")));

    // A task the Hub does not have data for is one clear error naming it.
    let out = run_eval(&server, &home, &gguf, &["tasks=[piqa]"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("task 'piqa'") && stderr.contains("baber/piqa"),
        "{stderr}"
    );
}
