//! `ferrotune upload` against the loopback Hub (tests/hub_server, its `upload.rs`): the
//! repository is created, a folder with files over 10 MB commits through preupload, the Git LFS
//! batch API and the NDJSON commit, byte-identical; an upload whose connection is cut fails
//! without committing, and running it again completes it without re-sending what the Hub holds.

use crate::hub_server;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use hub_server::HubServer;

const TOKEN: &str = "hf_test_write_token";

/// Deterministic bytes (as the download tests').
fn pattern(n: usize, seed: usize) -> Vec<u8> {
    (0..n)
        .map(|i| ((i * 31 + seed * 17 + 7) % 251) as u8)
        .collect()
}

/// A checkpoint-like folder: two files over 10 MB (LFS), a small safetensors (LFS by name) and
/// small text files, one in a subfolder. Returns the folder and its files by repository path.
fn checkpoint(name: &str) -> (PathBuf, HashMap<String, Vec<u8>>) {
    let dir =
        ferrotune_testing::fresh_dir(&format!("ferrotune-upload-{name}-{}", std::process::id()));
    let files: HashMap<String, Vec<u8>> = [
        (
            "model-00001-of-00002.safetensors",
            pattern(12 * 1024 * 1024 + 5, 1),
        ),
        (
            "model-00002-of-00002.safetensors",
            pattern(11 * 1024 * 1024, 2),
        ),
        ("adapter_model.safetensors", pattern(3000, 3)),
        ("config.json", b"{\"model_type\": \"llama\"}\n".to_vec()),
        ("original/params.json", b"{\"dim\": 64}\n".to_vec()),
        ("empty.txt", Vec::new()),
    ]
    .into_iter()
    .map(|(p, b)| (p.to_string(), b))
    .collect();
    for (p, b) in &files {
        let path = dir.join(p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b).unwrap();
    }
    (dir, files)
}

fn upload(server: &HubServer, dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .arg("upload")
        .args(args)
        .arg(dir)
        .env("HF_ENDPOINT", server.url())
        .env("HF_TOKEN", TOKEN)
        .env("HF_HOME", dir.join("..").join("hf-home-upload"))
        .env_remove("HF_TOKEN_PATH")
        .env_remove("HF_HUB_DISABLE_IMPLICIT_TOKEN")
        .output()
        .expect("run ferrotune")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn count(server: &HubServer, method: &str, prefix: &str) -> usize {
    server
        .log()
        .iter()
        .filter(|r| r.method == method && r.path.starts_with(prefix))
        .count()
}

#[test]
fn a_folder_with_large_files_commits_through_lfs() {
    let server = HubServer::start(Vec::new());
    server.require_token(TOKEN);
    let (dir, files) = checkpoint("commit");
    let out = upload(
        &server,
        &dir,
        &["me/tiny-lora", "--private", "--revision", "main"],
    );
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "stdout: {stdout}\nstderr: {stderr}");
    assert!(
        stdout.contains("Committed 6 files (3 through LFS) to me/tiny-lora"),
        "{stdout}"
    );

    let repos = server.created_repos();
    assert_eq!(repos.len(), 1);
    assert_eq!(
        (
            repos[0].kind.as_str(),
            repos[0].id.as_str(),
            repos[0].private
        ),
        ("models", "me/tiny-lora", true)
    );
    let commits = server.commits();
    assert_eq!(commits.len(), 1);
    let c = &commits[0];
    assert_eq!(
        (c.repo.as_str(), c.revision.as_str()),
        ("me/tiny-lora", "main")
    );
    assert_eq!(
        c.files, files,
        "the commit holds every file, byte-identical"
    );
    let mut lfs = c.lfs_paths.clone();
    lfs.sort();
    assert_eq!(
        lfs,
        [
            "adapter_model.safetensors",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors"
        ]
    );
    // Each LFS object went up once, with the batch action's header; the token went to the API.
    let puts: Vec<_> = server
        .log()
        .into_iter()
        .filter(|r| r.method == "PUT")
        .collect();
    assert_eq!(puts.len(), 3);
    assert!(puts
        .iter()
        .all(|r| r.headers.get("x-test-upload").map(String::as_str) == Some("yes")));
    let commit_req = server
        .log()
        .into_iter()
        .find(|r| r.path.contains("/commit/"))
        .unwrap();
    assert_eq!(
        commit_req.headers["authorization"],
        format!("Bearer {TOKEN}")
    );
    assert_eq!(commit_req.headers["content-type"], "application/x-ndjson");

    // Again, into an existing repository (409 on create is fine), as a dataset on a branch: the
    // objects the Hub holds are not sent again.
    server.clear_log();
    let out = upload(&server, &dir, &["me/tiny-lora", "--revision", "refs/pr/1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stdout).contains("already on the Hub"),
        "{}",
        text(&out.stdout)
    );
    assert_eq!(count(&server, "PUT", "/lfs-upload/"), 0);
    assert_eq!(server.commits()[1].revision, "refs/pr/1");
    assert!(server
        .log()
        .iter()
        .any(|r| r.path == "/api/models/me/tiny-lora/commit/refs%2Fpr%2F1"));
    let out = upload(&server, &dir, &["me/tiny-data", "--repo-type", "dataset"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(server
        .log()
        .iter()
        .any(|r| r.path == "/datasets/me/tiny-data.git/info/lfs/objects/batch"));
    assert_eq!(server.commits()[2].kind, "datasets");
}

#[test]
fn an_upload_cut_short_completes_when_run_again() {
    let server = HubServer::start(Vec::new());
    server.require_token(TOKEN);
    let (dir2, files2) = checkpoint("cut");
    // The small LFS object arrives whole; the first one over 4 MB is cut 4 MB in, unanswered.
    server.cut_next_upload(4 * 1024 * 1024);
    let out = upload(&server, &dir2, &["me/cut2"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with("error: uploading")
            && stderr.contains("model-00001-of-00002.safetensors")
            && stderr.contains("run the upload again"),
        "{stderr}"
    );
    assert!(server.commits().is_empty(), "nothing committed");
    assert_eq!(
        server.lfs_objects().len(),
        1,
        "only the small object is stored"
    );

    server.clear_log();
    let out = upload(&server, &dir2, &["me/cut2"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        stdout.contains("adapter_model.safetensors: already on the Hub"),
        "{stdout}"
    );
    assert_eq!(
        count(&server, "PUT", "/lfs-upload/"),
        2,
        "only the missing objects are sent"
    );
    let commits: Vec<_> = server
        .commits()
        .into_iter()
        .filter(|c| c.repo == "me/cut2")
        .collect();
    assert_eq!(commits.len(), 1);
    assert_eq!(commits[0].files, files2);
}

fn oid(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The Hub's `multipart` transfer: objects over the chunk size go up part by part (each part
/// once, in order, of the chunk size but the last), the completion joins them, and the commit
/// holds the files byte-identical; the small LFS object still takes `basic`.
#[test]
fn a_large_file_goes_up_in_parts() {
    let server = HubServer::start(Vec::new());
    server.require_token(TOKEN);
    server.multipart(5 * 1024 * 1024);
    let (dir, files) = checkpoint("parts");
    let out = upload(&server, &dir, &["me/parts"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let commits = server.commits();
    assert_eq!(commits.len(), 1);
    assert_eq!(commits[0].files, files, "byte-identical");
    let mb = 1024 * 1024;
    let first = oid(&files["model-00001-of-00002.safetensors"]);
    let second = oid(&files["model-00002-of-00002.safetensors"]);
    let parts = server.parts_received();
    let of = |o: &str| -> Vec<(usize, usize)> {
        parts
            .iter()
            .filter(|p| p.0 == o)
            .map(|p| (p.1, p.2))
            .collect()
    };
    assert_eq!(of(&first), [(1, 5 * mb), (2, 5 * mb), (3, 2 * mb + 5)]);
    assert_eq!(of(&second), [(1, 5 * mb), (2, 5 * mb), (3, mb)]);
    assert_eq!(
        count(&server, "PUT", "/lfs-upload/"),
        1,
        "the small one: basic"
    );
    assert_eq!(count(&server, "POST", "/lfs-complete/"), 2);
    assert_eq!(count(&server, "PUT", "/lfs-part/"), 6);
}

/// A connection cut in the middle of a part is retried in the same run (after `http_backoff`'s
/// first 1 s wait): the run commits, the cut part is sent again and no other part twice.
#[test]
fn a_part_cut_in_the_middle_is_retried_in_the_same_run() {
    let server = HubServer::start(Vec::new());
    server.require_token(TOKEN);
    server.multipart(5 * 1024 * 1024);
    // The first PUT over 2 MB (part 1 of the first large file) is cut 2 MB in, once.
    server.cut_next_uploads(2 * 1024 * 1024, 1);
    let (dir, files) = checkpoint("part-cut");
    let out = upload(&server, &dir, &["me/part-cut"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let commits = server.commits();
    assert_eq!(commits.len(), 1);
    assert_eq!(commits[0].files, files, "byte-identical");
    let first = oid(&files["model-00001-of-00002.safetensors"]);
    let tries = |n: usize| count(&server, "PUT", &format!("/lfs-part/{first}/{n}"));
    assert_eq!((tries(1), tries(2), tries(3)), (2, 1, 1));
    let received: Vec<usize> = server
        .parts_received()
        .iter()
        .filter(|p| p.0 == first)
        .map(|p| p.1)
        .collect();
    assert_eq!(received, [1, 2, 3], "each part stored once, whole");
    assert_eq!(count(&server, "PUT", "/lfs-part/"), 7);
}

/// An LFS `PUT` answered 429 with `Retry-After: 2` is sent again after the server's 2 s + 1 s,
/// as `huggingface_hub`'s `http_backoff` waits (its own first wait would be 1 s): the retry is
/// reported with its wait, arrives no sooner, and the upload commits.
#[test]
fn a_429_with_retry_after_waits_as_told() {
    let server = HubServer::start(Vec::new());
    server.require_token(TOKEN);
    server.answer_next_uploads(429, &[("retry-after", "2")], 1);
    let (dir, files) = checkpoint("retry-after");
    let out = upload(&server, &dir, &["me/retry-after"]);
    let stdout = text(&out.stdout);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let retries: Vec<&str> = stdout.lines().filter(|l| l.contains("retrying")).collect();
    assert_eq!(retries.len(), 1, "{stdout}");
    assert!(
        retries[0].ends_with(": HTTP 429; retrying in 3 s (the server's wait + 1 s) [retry 1/5]"),
        "{stdout}"
    );
    let puts: Vec<_> = server
        .log()
        .into_iter()
        .filter(|r| r.method == "PUT" && r.path.starts_with("/lfs-upload/"))
        .collect();
    assert_eq!(puts.len(), 4, "three objects, the first sent twice");
    assert_eq!(
        puts[0].path, puts[1].path,
        "the refused object is sent again"
    );
    let waited = puts[1].at - puts[0].at;
    assert!(waited.as_secs_f64() >= 3.0, "retried after {waited:?}");
    let commits = server.commits();
    assert_eq!(commits.len(), 1);
    assert_eq!(commits[0].files, files, "byte-identical");
}

/// 8 rows, batch 2: 4 steps (as the trackers' tests).
fn rows(dir: &Path) -> PathBuf {
    let data = dir.join("rows.jsonl");
    let rows: Vec<String> = (0..8u32)
        .map(|i| {
            let ids: Vec<u32> = (0..10).map(|j| (i * 31 + j * 7) % 500 + 3).collect();
            serde_json::json!({"input_ids": ids}).to_string()
        })
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    data
}

/// `push_to_hub`: the run's final checkpoint folder is committed, byte-identical; without a
/// token the run stops before training.
#[test]
fn push_to_hub_uploads_the_final_checkpoint() {
    use crate::common::{run_recipe, text as out_text, tmpdir, write_config, TINY_LORA};
    let server = HubServer::start(Vec::new());
    server.require_token(TOKEN);
    let dir = tmpdir("upload", "push");
    let data = rows(&dir);
    let cfg = write_config(TINY_LORA, &dir, "llama3", &data);
    let out = dir.join("out");
    let home = dir.join("hf-home");
    let keys = ["push_to_hub.repo_id=me/pushed", "push_to_hub.private=true"];
    let env = [
        ("HF_ENDPOINT", server.url()),
        ("HF_HOME", home.to_str().unwrap()),
        ("HF_TOKEN", ""),
    ];
    let o = run_recipe("lora_finetune_single_device", &cfg, &out, &keys, &dir, &env);
    let msg = out_text(&o);
    assert_eq!(o.status.code(), Some(1), "{msg}");
    assert!(
        msg.contains("push_to_hub needs a Hugging Face token"),
        "{msg}"
    );
    assert!(
        !out.join("epoch_0").exists(),
        "stopped before training: {msg}"
    );

    let env = [
        ("HF_ENDPOINT", server.url()),
        ("HF_HOME", home.to_str().unwrap()),
        ("HF_TOKEN", TOKEN),
    ];
    let o = run_recipe("lora_finetune_single_device", &cfg, &out, &keys, &dir, &env);
    let msg = out_text(&o);
    assert!(o.status.success(), "{msg}");
    assert!(
        msg.contains("Pushed ") && msg.contains("to me/pushed"),
        "{msg}"
    );
    let commits = server.commits();
    assert_eq!(commits.len(), 1, "{msg}");
    assert!(server.created_repos()[0].private);
    let epoch = out.join("epoch_0");
    let mut on_disk = HashMap::new();
    let mut stack = vec![epoch.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p
                    .strip_prefix(&epoch)
                    .unwrap()
                    .to_string_lossy()
                    .replace('\\', "/");
                on_disk.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    assert!(on_disk.contains_key("adapter_model.safetensors"));
    assert_eq!(commits[0].files, on_disk);
    assert!(commits[0]
        .lfs_paths
        .contains(&"adapter_model.safetensors".to_string()));
}

/// Every file under `dir`, by its path relative to `dir`.
fn folder_files(dir: &Path) -> HashMap<String, Vec<u8>> {
    let mut files = HashMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            let rel = p
                .strip_prefix(dir)
                .unwrap()
                .to_string_lossy()
                .replace('\\', "/");
            files.insert(rel, std::fs::read(&p).unwrap());
        }
    }
    files
}

/// A recipe, its config writer, its last epoch's folder and extra keys.
type RlCase = (
    &'static str,
    fn(&Path) -> PathBuf,
    &'static str,
    &'static [&'static str],
);

/// `push_to_hub` from the recipes with their own loop, GRPO and PPO: without a token the run
/// stops before training; with one, rank 0 pushes the last epoch's policy checkpoint after the
/// final save, byte-identical.
#[test]
fn push_to_hub_from_grpo_and_ppo() {
    use crate::common::{run_recipe, text as out_text, tmpdir};
    let server = HubServer::start(Vec::new());
    server.require_token(TOKEN);
    let cases: [RlCase; 2] = [
        (
            "dev/grpo_full_finetune_distributed",
            crate::grpo::write_config,
            "epoch_0",
            &["epochs=1"],
        ),
        (
            "ppo_full_finetune_single_device",
            crate::ppo::write_config,
            "epoch_1",
            &[],
        ),
    ];
    for (i, (recipe, write_config, last, extra)) in cases.into_iter().enumerate() {
        let dir = tmpdir("upload", &format!("push-rl-{i}"));
        let cfg = write_config(&dir);
        let out = dir.join("out");
        let home = dir.join("hf-home");
        let repo = format!("me/pushed-{i}");
        let repo_key = format!("push_to_hub.repo_id={repo}");
        let mut keys = vec![repo_key.as_str()];
        keys.extend_from_slice(extra);
        let env = |token| {
            [
                ("HF_ENDPOINT", server.url()),
                ("HF_HOME", home.to_str().unwrap()),
                ("HF_TOKEN", token),
            ]
        };
        let o = run_recipe(recipe, &cfg, &out, &keys, &dir, &env(""));
        let msg = out_text(&o);
        assert_eq!(o.status.code(), Some(1), "{recipe}: {msg}");
        assert!(
            msg.contains("push_to_hub needs a Hugging Face token"),
            "{recipe}: {msg}"
        );
        assert!(!out.join("epoch_0").exists(), "{recipe}: {msg}");

        let o = run_recipe(recipe, &cfg, &out, &keys, &dir, &env(TOKEN));
        let msg = out_text(&o);
        assert!(o.status.success(), "{recipe}: {msg}");
        assert!(msg.contains(&format!("to {repo}")), "{recipe}: {msg}");
        let commits: Vec<_> = server
            .commits()
            .into_iter()
            .filter(|c| c.repo == repo)
            .collect();
        assert_eq!(commits.len(), 1, "{recipe}: {msg}");
        let on_disk = folder_files(&out.join(last));
        assert!(on_disk.contains_key("model.safetensors"), "{recipe}");
        assert_eq!(commits[0].files, on_disk, "{recipe}");
    }
}
