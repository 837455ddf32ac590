//! `ferrotune download` and `hub::dataset_files` against a loopback stand-in for the Hub
//! (tests/hub_server): byte-identical files, ignore/allow patterns, the token on the wire, clear
//! errors, resume with HTTP `Range`, checksum verification, and dataset split selection.

use crate::hub_server;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use hub_server::{HubFile, HubRepo, HubRevision, HubServer};

const MODEL_SHA: &str = "e8a405a3d6cdde2e45ca88b5d7ce7a0c861957da78896477a90c4279ce7da89c";
const COMMIT: &str = "0123456789abcdef0123456789abcdef01234567";

/// Deterministic test bytes; the sha256 values in this file were computed for them with Python's
/// hashlib: `bytes(((i*31 + seed*17 + 7) % 251) for i in range(n))`.
fn pattern(n: usize, seed: usize) -> Vec<u8> {
    (0..n)
        .map(|i| ((i * 31 + seed * 17 + 7) % 251) as u8)
        .collect()
}

fn model_files() -> Vec<HubFile> {
    vec![
        HubFile::plain(
            "config.json",
            b"{\"model_type\": \"llama\", \"hidden_size\": 64}\n",
        ),
        HubFile::plain("tokenizer.json", b"{\"version\": \"1.0\", \"model\": {}}\n"),
        HubFile::plain("empty.txt", b""),
        HubFile::plain("original/params.json", b"{\"dim\": 64}\n"),
        HubFile::lfs("model.safetensors", pattern(200_000, 1), MODEL_SHA),
    ]
}

fn model_repo(id: &str) -> HubRepo {
    HubRepo {
        kind: "models",
        id: id.to_string(),
        revisions: vec![HubRevision {
            name: "main".into(),
            sha: COMMIT.into(),
            files: model_files(),
        }],
    }
}

fn temp_dir(name: &str) -> PathBuf {
    ferrotune_testing::fresh_dir(&format!("ferrotune-hub-{name}-{}", std::process::id()))
}

/// Runs the real binary against `endpoint` with a private HF_HOME and no ambient token.
fn ferrotune(endpoint: &str, home: &Path, args: &[&str], envs: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_ferrotune"));
    cmd.arg("download")
        .args(args)
        .env("HF_ENDPOINT", endpoint)
        .env("HF_HOME", home.join("hf-home"))
        .env_remove("HF_TOKEN")
        .env_remove("HF_TOKEN_PATH")
        .env_remove("HF_HUB_CACHE")
        .env_remove("HUGGINGFACE_HUB_CACHE")
        .env_remove("HF_HUB_DISABLE_IMPLICIT_TOKEN");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    cmd.output().expect("run ferrotune")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "ferrotune failed\nstdout: {}\nstderr: {}",
        text(&out.stdout),
        text(&out.stderr)
    );
}

/// GETs the server saw whose path ends with `suffix`.
fn gets(server: &HubServer, suffix: &str) -> Vec<hub_server::Logged> {
    server
        .log()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path.ends_with(suffix))
        .collect()
}

#[test]
fn downloads_every_file_byte_identical_then_skips_complete_files() {
    let server = HubServer::start(vec![model_repo("acme/tiny-model")]);
    let tmp = temp_dir("full");
    let out_dir = tmp.join("out");
    let out = ferrotune(
        server.url(),
        &tmp,
        &["acme/tiny-model", "--output-dir", out_dir.to_str().unwrap()],
        &[],
    );
    assert_ok(&out);
    for f in model_files() {
        let local = out_dir.join(&f.path);
        let meta = std::fs::symlink_metadata(&local).unwrap_or_else(|e| panic!("{}: {e}", f.path));
        assert!(meta.file_type().is_file(), "{} must be a real file", f.path);
        assert_eq!(std::fs::read(&local).unwrap(), f.bytes, "{}", f.path);
    }
    let stdout = text(&out.stdout);
    let tail = stdout
        .split("Successfully downloaded model repo and wrote to the following locations:\n")
        .nth(1)
        .unwrap_or_else(|| panic!("no final line in:\n{stdout}"));
    let listed: Vec<&str> = tail.lines().collect();
    assert_eq!(listed.len(), model_files().len(), "{stdout}");
    for f in model_files() {
        let want = out_dir.join(&f.path);
        assert!(
            listed.contains(&want.to_str().unwrap()),
            "{} not listed:\n{stdout}",
            f.path
        );
    }
    // No token anywhere: none must be sent.
    assert!(server
        .log()
        .iter()
        .all(|r| !r.headers.contains_key("authorization")));
    // The LFS file came through the CDN redirect; no partial file is left behind.
    assert_eq!(gets(&server, &format!("/cdn/{MODEL_SHA}")).len(), 1);
    let state = out_dir.join(".cache/huggingface/download");
    let leftovers: Vec<_> = walk(&state)
        .into_iter()
        .filter(|p| p.to_string_lossy().ends_with(".incomplete"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // Second run: everything is complete, so nothing is downloaded again.
    server.clear_log();
    let again = ferrotune(
        server.url(),
        &tmp,
        &["acme/tiny-model", "--output-dir", out_dir.to_str().unwrap()],
        &[],
    );
    assert_ok(&again);
    let file_gets: Vec<_> = server
        .log()
        .into_iter()
        .filter(|r| {
            r.method == "GET" && (r.path.contains("/resolve/") || r.path.starts_with("/cdn/"))
        })
        .collect();
    assert!(file_gets.is_empty(), "re-downloaded: {file_gets:?}");
    assert_eq!(
        text(&again.stdout).matches("already complete").count(),
        model_files().len()
    );

    // A damaged complete-size file (the record no longer matches its mtime) is detected by its
    // sha256 and downloaded again.
    let weights = out_dir.join("model.safetensors");
    let mut bad = std::fs::read(&weights).unwrap();
    bad[100] ^= 0xff;
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::write(&weights, &bad).unwrap();
    server.clear_log();
    assert_ok(&ferrotune(
        server.url(),
        &tmp,
        &["acme/tiny-model", "--output-dir", out_dir.to_str().unwrap()],
        &[],
    ));
    assert_eq!(std::fs::read(&weights).unwrap(), pattern(200_000, 1));
    assert_eq!(gets(&server, &format!("/cdn/{MODEL_SHA}")).len(), 1);
}

fn walk(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            let p = e.path();
            if p.is_dir() {
                out.extend(walk(&p));
            } else {
                out.push(p);
            }
        }
    }
    out
}

#[test]
fn ignore_and_allow_patterns_select_files() {
    let server = HubServer::start(vec![model_repo("acme/tiny-model")]);
    let tmp = temp_dir("patterns");
    let out_dir = tmp.join("out");
    let out = ferrotune(
        server.url(),
        &tmp,
        &[
            "acme/tiny-model",
            "--output-dir",
            out_dir.to_str().unwrap(),
            "--ignore-patterns",
            "*.safetensors",
            "--ignore-patterns",
            "original/",
        ],
        &[],
    );
    assert_ok(&out);
    assert!(out_dir.join("config.json").is_file());
    assert!(out_dir.join("tokenizer.json").is_file());
    assert!(!out_dir.join("model.safetensors").exists());
    assert!(!out_dir.join("original").exists());
    assert!(gets(&server, "model.safetensors").is_empty());
    assert!(gets(&server, &format!("/cdn/{MODEL_SHA}")).is_empty());
    assert!(text(&out.stdout)
        .contains("Ignoring files matching the following patterns: *.safetensors, original/"));

    let only = tmp.join("only");
    let out = ferrotune(
        server.url(),
        &tmp,
        &[
            "acme/tiny-model",
            "--output-dir",
            only.to_str().unwrap(),
            "--allow-patterns",
            "*.json",
        ],
        &[],
    );
    assert_ok(&out);
    let mut got: Vec<String> = walk(&only)
        .into_iter()
        .filter(|p| !p.starts_with(only.join(".cache")))
        .map(|p| {
            p.strip_prefix(&only)
                .unwrap()
                .to_string_lossy()
                .into_owned()
        })
        .collect();
    got.sort();
    assert_eq!(
        got,
        ["config.json", "original/params.json", "tokenizer.json"]
    );
}

#[test]
fn token_reaches_the_server_and_flag_wins_over_env() {
    let server = HubServer::start(vec![model_repo("acme/gated")]);
    server.require_token("hf_right");
    let tmp = temp_dir("token");

    let out_dir = tmp.join("flag");
    let out = ferrotune(
        server.url(),
        &tmp,
        &[
            "acme/gated",
            "--output-dir",
            out_dir.to_str().unwrap(),
            "--hf-token",
            "hf_right",
        ],
        &[("HF_TOKEN", "hf_wrong")],
    );
    assert_ok(&out);
    assert_eq!(
        std::fs::read(out_dir.join("model.safetensors")).unwrap(),
        pattern(200_000, 1)
    );
    let log = server.log();
    let authed: Vec<_> = log
        .iter()
        .filter(|r| !r.path.starts_with("/cdn/"))
        .collect();
    assert!(!authed.is_empty());
    for r in authed {
        assert_eq!(
            r.headers.get("authorization").map(String::as_str),
            Some("Bearer hf_right"),
            "{} {}",
            r.method,
            r.path
        );
    }

    // HF_TOKEN alone is used too.
    let env_dir = tmp.join("env");
    let out = ferrotune(
        server.url(),
        &tmp,
        &["acme/gated", "--output-dir", env_dir.to_str().unwrap()],
        &[("HF_TOKEN", "hf_right")],
    );
    assert_ok(&out);
    assert!(env_dir.join("config.json").is_file());
}

#[test]
fn errors_are_one_clear_line_with_exit_code_1() {
    let server = HubServer::start(vec![model_repo("acme/gated")]);
    server.require_token("hf_right");
    let tmp = temp_dir("errors");
    let out_dir = tmp.join("out");

    let out = ferrotune(
        server.url(),
        &tmp,
        &["acme/gated", "--output-dir", out_dir.to_str().unwrap()],
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("acme/gated") && err.contains("401"), "{err}");
    assert!(
        err.contains("--hf-token") && err.contains("HF_TOKEN"),
        "{err}"
    );

    let out = ferrotune(
        server.url(),
        &tmp,
        &[
            "acme/gated",
            "--output-dir",
            out_dir.to_str().unwrap(),
            "--hf-token",
            "hf_bad",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(err.contains("rejected the token"), "{err}");

    let open = HubServer::start(vec![model_repo("acme/tiny-model")]);
    let out = ferrotune(
        open.url(),
        &tmp,
        &["acme/nope", "--output-dir", out_dir.to_str().unwrap()],
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("'acme/nope' not found"), "{err}");

    let out = ferrotune(
        open.url(),
        &tmp,
        &[
            "acme/tiny-model",
            "--output-dir",
            out_dir.to_str().unwrap(),
            "--revision",
            "v9",
        ],
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("revision 'v9' not found"),
        "{}",
        text(&out.stderr)
    );

    // Nothing listens on this port.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dead = format!("http://127.0.0.1:{port}");
    let out = ferrotune(
        &dead,
        &tmp,
        &["acme/tiny-model", "--output-dir", out_dir.to_str().unwrap()],
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("cannot reach the Hugging Face Hub") && err.contains(&dead),
        "{err}"
    );
}

#[test]
fn partial_downloads_resume_with_a_range_request() {
    let server = HubServer::start(vec![model_repo("acme/tiny-model")]);
    let tmp = temp_dir("resume");
    let out_dir = tmp.join("out");
    let full = pattern(200_000, 1);

    // A partial download left by an earlier run, where ferrotune keeps it.
    let partial = out_dir.join(format!(
        ".cache/huggingface/download/model.safetensors.{MODEL_SHA}.incomplete"
    ));
    std::fs::create_dir_all(partial.parent().unwrap()).unwrap();
    std::fs::write(&partial, &full[..70_000]).unwrap();
    let out = ferrotune(
        server.url(),
        &tmp,
        &["acme/tiny-model", "--output-dir", out_dir.to_str().unwrap()],
        &[],
    );
    assert_ok(&out);
    let cdn = gets(&server, &format!("/cdn/{MODEL_SHA}"));
    assert_eq!(cdn.len(), 1, "{cdn:?}");
    assert_eq!(
        cdn[0].headers.get("range").map(String::as_str),
        Some("bytes=70000-199999")
    );
    assert_eq!(
        std::fs::read(out_dir.join("model.safetensors")).unwrap(),
        full
    );
    assert!(!partial.exists());
    assert!(text(&out.stdout).contains("model.safetensors: resuming at 70.0 kB of 200.0 kB"));

    // An interrupted transfer: the connection drops after 50,000 bytes. The run fails, keeps the
    // bytes it got, and the next run asks only for the rest.
    let out_dir = tmp.join("cut");
    server.cut_next_download(MODEL_SHA, 50_000);
    server.clear_log();
    let out = ferrotune(
        server.url(),
        &tmp,
        &["acme/tiny-model", "--output-dir", out_dir.to_str().unwrap()],
        &[],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(err.contains("run again to resume"), "{err}");
    let partial = out_dir.join(format!(
        ".cache/huggingface/download/model.safetensors.{MODEL_SHA}.incomplete"
    ));
    let kept = std::fs::metadata(&partial).unwrap().len();
    assert!(kept > 0 && kept <= 50_000, "kept {kept} bytes");
    assert!(!out_dir.join("model.safetensors").exists());

    server.clear_log();
    assert_ok(&ferrotune(
        server.url(),
        &tmp,
        &["acme/tiny-model", "--output-dir", out_dir.to_str().unwrap()],
        &[],
    ));
    let cdn = gets(&server, &format!("/cdn/{MODEL_SHA}"));
    assert_eq!(cdn.len(), 1, "{cdn:?}");
    assert_eq!(
        cdn[0].headers.get("range").map(String::as_str),
        Some(format!("bytes={kept}-199999").as_str())
    );
    assert_eq!(
        std::fs::read(out_dir.join("model.safetensors")).unwrap(),
        full
    );
}

#[test]
fn corrupted_download_fails_its_sha256_check() {
    let server = HubServer::start(vec![model_repo("acme/tiny-model")]);
    let mut bad = pattern(200_000, 1);
    bad[123_456] ^= 1;
    server.corrupt(MODEL_SHA, bad);
    let tmp = temp_dir("corrupt");
    let out_dir = tmp.join("out");
    let out = ferrotune(
        server.url(),
        &tmp,
        &["acme/tiny-model", "--output-dir", out_dir.to_str().unwrap()],
        &[],
    );
    assert_eq!(out.status.code(), Some(1));
    let err = text(&out.stderr);
    assert!(
        err.contains("sha256 mismatch for 'model.safetensors'") && err.contains(MODEL_SHA),
        "{err}"
    );
    assert!(!out_dir.join("model.safetensors").exists());
}

fn dataset_repos() -> Vec<HubRepo> {
    vec![
        HubRepo {
            kind: "datasets",
            id: "acme/tiny-ds".into(),
            revisions: vec![HubRevision {
                name: "main".into(),
                sha: COMMIT.into(),
                files: vec![
                    HubFile::plain("README.md", b"# tiny\n"),
                    HubFile::lfs(
                        "data/train-00000-of-00001.parquet",
                        pattern(3000, 2),
                        "a9acd61bd03577d7b1936baa83715f9991417b41bd3497e8af434564aec5053a",
                    ),
                    HubFile::lfs(
                        "data/test-00000-of-00001.parquet",
                        pattern(2000, 3),
                        "e637b1970025269d36999afbb659e8db37943195ebf13f5a28a9f941b7620b4f",
                    ),
                    HubFile::lfs(
                        "data/validation-00000-of-00001.parquet",
                        pattern(1000, 4),
                        "ce0278ca7511b50b36907af3c466521ad40946880ab5ee4f3d94f69b541809cc",
                    ),
                ],
            }],
        },
        // Subsets in folders, as lvwerra/stack-exchange-paired (`data_dir: data/rl`).
        HubRepo {
            kind: "datasets",
            id: "acme/paired".into(),
            revisions: vec![HubRevision {
                name: "main".into(),
                sha: COMMIT.into(),
                files: vec![
                    HubFile::plain(
                        "data/finetune/train-00000-of-00001.parquet",
                        &pattern(700, 7),
                    ),
                    HubFile::plain("data/rl/train-00000-of-00001.parquet", &pattern(600, 8)),
                ],
            }],
        },
        // A loading-script dataset: only the Hub's parquet conversion has its rows.
        HubRepo {
            kind: "datasets",
            id: "acme/scripted".into(),
            revisions: vec![
                HubRevision {
                    name: "main".into(),
                    sha: COMMIT.into(),
                    files: vec![
                        HubFile::plain("scripted.py", b"import datasets\n"),
                        HubFile::plain("data/train.jsonl", b"{\"raw\": 1}\n"),
                    ],
                },
                HubRevision {
                    name: "refs/convert/parquet".into(),
                    sha: "fedcba9876543210fedcba9876543210fedcba98".into(),
                    files: vec![
                        HubFile::lfs(
                            "default/train/0000.parquet",
                            pattern(1500, 5),
                            "8111db927a7c62360c9909c5640e7d334884ed95d5b58248a27118c7b4160cde",
                        ),
                        HubFile::plain("default/validation/0000.parquet", &pattern(800, 6)),
                    ],
                },
            ],
        },
    ]
}

/// Set in the copy of this crate's test binary that a test needing a process of its own runs in.
const ALONE: &str = "FERROTUNE_TEST_ALONE";

/// Points this process's Hub access at `server` with `HF_HOME` under `tmp` and no token or other
/// cache set, and returns the Hugging Face cache folder. Only for a test that runs alone in a copy
/// of the binary (`in_own_process`): the CLI tests give their children these variables instead.
fn use_hub_in_this_process(server: &HubServer, tmp: &Path) -> PathBuf {
    std::env::set_var("HF_ENDPOINT", server.url());
    std::env::set_var("HF_HOME", tmp.join("hf-home"));
    for k in [
        "HF_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
    ] {
        std::env::remove_var(k);
    }
    tmp.join("hf-home").join("hub")
}

#[test]
fn dataset_files_returns_the_split_parquet_from_the_cache() {
    // It sets HF_ENDPOINT and HF_HOME in its own process, which the other tests of this binary
    // (running in parallel threads, starting `ferrotune`s that inherit the environment) must not
    // see: so it runs in a copy of the binary, alone.
    let name = "dataset_files_returns_the_split_parquet_from_the_cache";
    if !ferrotune_testing::in_own_process(ALONE, module_path!(), name) {
        return;
    }
    let server = HubServer::start(dataset_repos());
    let tmp = temp_dir("datasets");
    let cache = use_hub_in_this_process(&server, &tmp);

    let paths = ferrotune_data::hub::dataset_files("acme/tiny-ds", None, "test[:50%]").unwrap();
    assert_eq!(paths.len(), 1, "{paths:?}");
    assert!(
        paths[0].ends_with("data/test-00000-of-00001.parquet"),
        "{paths:?}"
    );
    assert!(
        paths[0].starts_with(cache.join("datasets--acme--tiny-ds")),
        "{paths:?}"
    );
    assert_eq!(std::fs::read(&paths[0]).unwrap(), pattern(2000, 3));

    let paths = ferrotune_data::hub::dataset_files("acme/tiny-ds", None, "validation").unwrap();
    assert_eq!(std::fs::read(&paths[0]).unwrap(), pattern(1000, 4));

    let err = ferrotune_data::hub::dataset_files("acme/tiny-ds", None, "extra")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("split 'extra'") && err.contains("splits found: test, train, validation"),
        "{err}"
    );

    // The loading-script dataset comes from refs/convert/parquet.
    let paths = ferrotune_data::hub::dataset_files("acme/scripted", None, "train").unwrap();
    assert_eq!(paths.len(), 1, "{paths:?}");
    assert_eq!(std::fs::read(&paths[0]).unwrap(), pattern(1500, 5));
    let paths =
        ferrotune_data::hub::dataset_files("acme/scripted", Some("default"), "validation").unwrap();
    assert_eq!(std::fs::read(&paths[0]).unwrap(), pattern(800, 6));
    assert!(server
        .log()
        .iter()
        .any(|r| r.path.contains("/resolve/refs%2Fconvert%2Fparquet/")
            || r.path.contains("/resolve/refs/convert/parquet/")));

    let err = ferrotune_data::hub::dataset_files("acme/tiny-ds", Some("fr"), "train")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("config 'fr' not found; folders with data files: data"),
        "{err}"
    );

    // `data_dir` picks one folder's files.
    let paths =
        ferrotune_data::hub::dataset_files_in("acme/paired", None, Some("data/rl"), "train")
            .unwrap();
    assert_eq!(paths.len(), 1, "{paths:?}");
    assert_eq!(std::fs::read(&paths[0]).unwrap(), pattern(600, 8));
    let err = ferrotune_data::hub::dataset_files_in("acme/paired", None, Some("data/x"), "train")
        .unwrap_err()
        .to_string();
    assert!(err.contains("under data_dir 'data/x/'"), "{err}");

    let err = ferrotune_data::hub::dataset_files("acme/missing", None, "train")
        .unwrap_err()
        .to_string();
    assert!(err.contains("'acme/missing' not found"), "{err}");
}

#[test]
fn dataset_repos_download_with_repo_type() {
    let server = HubServer::start(dataset_repos());
    let tmp = temp_dir("ds-download");
    let out_dir = tmp.join("out");
    let out = ferrotune(
        server.url(),
        &tmp,
        &[
            "acme/tiny-ds",
            "--repo-type",
            "dataset",
            "--output-dir",
            out_dir.to_str().unwrap(),
        ],
        &[],
    );
    assert_ok(&out);
    assert_eq!(
        std::fs::read(out_dir.join("data/train-00000-of-00001.parquet")).unwrap(),
        pattern(3000, 2)
    );
    assert!(server
        .log()
        .iter()
        .any(|r| r.path.starts_with("/api/datasets/acme/tiny-ds")));
    assert!(text(&out.stdout).contains("Successfully downloaded dataset repo"));
}

/// Every file under `root` that is neither under `out_dir` nor under the private `HF_HOME`.
fn files_outside(root: &Path, out_dir: &Path) -> Vec<PathBuf> {
    walk(root)
        .into_iter()
        .filter(|p| !p.starts_with(out_dir) && !p.starts_with(root.join("hf-home")))
        .collect()
}

#[test]
fn download_etag_holding_dotdot_stays_in_the_output_folder() {
    // The partial file's name carries the ETag; this one (the LFS `X-Linked-Etag` of the Hub's
    // redirect) holds `../`, enough to climb out of the output folder. The stand-in's CDN looks
    // the object up by the part before `?`, so the bytes still come (from the decoy repository).
    const DECOY: &str = "decoyobject";
    let evil = format!("{DECOY}?/../../../../../escape");
    let bytes = pattern(50_000, 9);
    let repo = |id: &str, etag: &str| HubRepo {
        kind: "models",
        id: id.to_string(),
        revisions: vec![HubRevision {
            name: "main".into(),
            sha: COMMIT.into(),
            files: vec![HubFile::lfs("weights.bin", bytes.clone(), etag)],
        }],
    };
    let server = HubServer::start(vec![
        repo("acme/evil-etag", &evil),
        repo("acme/decoy", DECOY),
    ]);
    server.cut_next_download(DECOY, 20_000);
    let tmp = temp_dir("etag-escape");
    let out_dir = tmp.join("out");
    let args = ["acme/evil-etag", "--output-dir", out_dir.to_str().unwrap()];
    let out = ferrotune(server.url(), &tmp, &args, &[]);
    assert!(!out.status.success(), "the cut download must fail");
    let outside = files_outside(&tmp, &out_dir);
    assert!(
        outside.is_empty(),
        "written outside the output folder: {outside:?}"
    );
    let partials: Vec<_> = walk(&out_dir.join(".cache/huggingface/download"))
        .into_iter()
        .filter(|p| p.to_string_lossy().ends_with(".incomplete"))
        .collect();
    assert_eq!(partials.len(), 1, "{partials:?}");

    // The second run resumes from that partial file and completes.
    let out = ferrotune(server.url(), &tmp, &args, &[]);
    assert_ok(&out);
    assert_eq!(std::fs::read(out_dir.join("weights.bin")).unwrap(), bytes);
    let outside = files_outside(&tmp, &out_dir);
    assert!(
        outside.is_empty(),
        "written outside the output folder: {outside:?}"
    );
}

#[test]
fn dataset_listing_with_escaping_entries_is_refused() {
    // Sets HF_ENDPOINT and HF_HOME in its own process: see
    // `dataset_files_returns_the_split_parquet_from_the_cache`.
    let name = "dataset_listing_with_escaping_entries_is_refused";
    if !ferrotune_testing::in_own_process(ALONE, module_path!(), name) {
        return;
    }
    let tmp = temp_dir("ds-escape");
    let outside = tmp.join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    // An existing file an absolute entry names, and where a `../` entry climbing out of the
    // cache's `snapshots/{commit}/` folder lands.
    let victim = outside.join("victim-train.jsonl");
    std::fs::write(&victim, b"precious\n").unwrap();
    let abs_entry = victim.to_str().unwrap().to_string();
    let dotdot_entry = "../../../../../outside/dotdot-train.jsonl";
    let repo = |id: &str, entry: &str| HubRepo {
        kind: "datasets",
        id: id.to_string(),
        revisions: vec![HubRevision {
            name: "main".into(),
            sha: COMMIT.into(),
            files: vec![
                HubFile::plain("README.md", b"# ds\n"),
                HubFile::plain(entry, b"{\"text\": \"x\"}\n"),
            ],
        }],
    };
    let server = HubServer::start(vec![
        repo("acme/abs-ds", &abs_entry),
        repo("acme/dotdot-ds", dotdot_entry),
    ]);
    use_hub_in_this_process(&server, &tmp);
    for (id, entry) in [
        ("acme/abs-ds", abs_entry.as_str()),
        ("acme/dotdot-ds", dotdot_entry),
    ] {
        let err = ferrotune_data::hub::dataset_files(id, None, "train")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("dataset repository '{id}'"))
                && err.contains(&format!("unsafe file path '{entry}'")),
            "{err}"
        );
    }
    let meta = std::fs::symlink_metadata(&victim).unwrap();
    assert!(meta.file_type().is_file(), "the victim was replaced");
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious\n");
    let names: Vec<_> = std::fs::read_dir(&outside).unwrap().collect();
    assert_eq!(names.len(), 1, "{names:?}");
}

#[test]
fn dataset_cache_paths_trust_no_header() {
    // Sets HF_ENDPOINT and HF_HOME in its own process: see
    // `dataset_files_returns_the_split_parquet_from_the_cache`.
    let name = "dataset_cache_paths_trust_no_header";
    if !ferrotune_testing::in_own_process(ALONE, module_path!(), name) {
        return;
    }
    // Headers that name cache paths, each climbing from its folder in the cache to `tmp`: the
    // `X-Repo-Commit` (from `snapshots/`) and an LFS ETag (from `blobs/`; the stand-in's CDN looks
    // the object up by the part before `?`, so the bytes still come, from the decoy repository).
    const DECOY: &str = "decoyobject";
    let evil_commit = "../../../../escape-commit";
    let evil_etag = format!("{DECOY}?/../../../../../escape-etag");
    let shard = "data/train-00000-of-00001.parquet";
    let bytes = pattern(30_000, 11);
    let repo = |id: &str, files: Vec<HubFile>| HubRepo {
        kind: "datasets",
        id: id.to_string(),
        revisions: vec![HubRevision {
            name: "main".into(),
            sha: COMMIT.into(),
            files,
        }],
    };
    let server = HubServer::start(vec![
        repo(
            "acme/evil-etag-ds",
            vec![
                HubFile::plain("README.md", b"# ds\n"),
                HubFile::lfs(shard, bytes.clone(), &evil_etag),
            ],
        ),
        repo(
            "acme/decoy-ds",
            vec![HubFile::lfs(shard, bytes.clone(), DECOY)],
        ),
        repo(
            "acme/evil-commit-ds",
            vec![HubFile::plain(shard, &pattern(500, 12))],
        ),
    ]);
    let tmp = temp_dir("ds-headers");
    let cache = use_hub_in_this_process(&server, &tmp);
    let assert_nothing_outside = || {
        let outside = files_outside(&tmp, &cache);
        assert!(outside.is_empty(), "written outside the cache: {outside:?}");
        for name in ["escape-commit", "escape-etag", "escape-etag.incomplete"] {
            assert!(
                std::fs::symlink_metadata(tmp.join(name)).is_err(),
                "{name} created"
            );
        }
    };

    // The ETag only names the partial file, after hashing: the download succeeds in the cache.
    let paths = ferrotune_data::hub::dataset_files("acme/evil-etag-ds", None, "train").unwrap();
    assert_nothing_outside();
    let snapshot = cache.join(format!("datasets--acme--evil-etag-ds/snapshots/{COMMIT}"));
    assert_eq!(paths, [snapshot.join(shard)]);
    assert_eq!(std::fs::read(&paths[0]).unwrap(), bytes);

    // A second call finds the file complete: no download.
    server.clear_log();
    let again = ferrotune_data::hub::dataset_files("acme/evil-etag-ds", None, "train").unwrap();
    assert_eq!(again, paths);
    let fetched: Vec<_> = server
        .log()
        .into_iter()
        .filter(|r| r.method == "GET" && !r.path.starts_with("/api/"))
        .collect();
    assert!(fetched.is_empty(), "downloaded again: {fetched:?}");

    // A commit header that is not a commit id fails the load, naming the header.
    server.send_repo_commit(evil_commit);
    let err = ferrotune_data::hub::dataset_files("acme/evil-commit-ds", None, "train")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(&format!("X-Repo-Commit header '{evil_commit}'"))
            && err.contains("dataset repository 'acme/evil-commit-ds'")
            && err.contains(shard),
        "{err}"
    );
    assert_nothing_outside();

    // The repository id, from the config, names the cache folder too.
    let err = ferrotune_data::hub::dataset_files("acme/../x", None, "train")
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("hub dataset 'acme/../x' (the dataset's `source`) is not a valid"),
        "{err}"
    );
}
