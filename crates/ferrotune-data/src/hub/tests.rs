//! Unit tests of the hub module: pattern matching, safe paths, split file choice.

use super::pattern::matches_pattern;
use super::requests::TreeFile;
use super::safe_path::{etag_component, repo_folder_name, CommitId, RemotePath};
use super::splits::{keyword_split, pick_committed, pick_converted};
use super::*;

#[test]
fn fnmatch_follows_python() {
    // Expected values from Python's fnmatch.fnmatch.
    let cases = [
        ("*.safetensors", "model.safetensors", true),
        ("*.safetensors", "sub/model.safetensors", true),
        ("*.safetensors", "model.safetensors.index.json", false),
        ("original/*", "original/consolidated.00.pth", true),
        ("original/*", "orig/x", false),
        ("model-0000?-of-*", "model-00001-of-00002.safetensors", true),
        ("[!a]*", "abc", false),
        ("[!a]*", "bc", true),
        ("[a-c]x", "bx", true),
        ("[]]x", "]x", true),
        ("[x", "[x", true),
        ("*", "", true),
        ("a*b*c", "aXbYbZc", true),
        ("a*b*c", "aXbYbZ", false),
        ("*.JSON", "a.json", false),
    ];
    for (pat, name, want) in cases {
        assert_eq!(fnmatch(pat, name), want, "fnmatch({pat:?}, {name:?})");
    }
    assert!(matches_pattern("original/", "original/params.json"));
}

fn tree(paths: &[&str]) -> Vec<TreeFile> {
    paths
        .iter()
        .map(|p| TreeFile {
            path: RemotePath::new(p).unwrap(),
            size: 1,
        })
        .collect()
}

#[test]
fn committed_split_layouts() {
    let shards = tree(&[
        "README.md",
        "data/train-00000-of-00002.parquet",
        "data/train-00001-of-00002.parquet",
        "data/validation-00000-of-00001.parquet",
    ]);
    let p = pick_committed(&shards, None, "train[:10%]".split('[').next().unwrap());
    assert_eq!(
        p.parquet,
        [
            "data/train-00000-of-00002.parquet",
            "data/train-00001-of-00002.parquet"
        ]
    );
    let p = pick_committed(&shards, None, "dev");
    assert_eq!(p.parquet, ["data/validation-00000-of-00001.parquet"]);
    assert_eq!(
        p.splits_found.iter().collect::<Vec<_>>(),
        ["train", "validation"]
    );

    let configs = tree(&[
        "en/train-00000-of-00001.parquet",
        "fr/train-00000-of-00001.parquet",
    ]);
    assert_eq!(
        pick_committed(&configs, Some("fr"), "train").parquet,
        ["fr/train-00000-of-00001.parquet"]
    );

    let folders = tree(&[
        "cfg/train/a.parquet",
        "cfg/test/a.parquet",
        "cfg/test/b.parquet",
    ]);
    assert_eq!(
        pick_committed(&folders, Some("cfg"), "test").parquet,
        ["cfg/test/a.parquet", "cfg/test/b.parquet"]
    );

    let named = tree(&["xsum-train.jsonl", "xsum-test.jsonl", "training_notes.txt"]);
    let p = pick_committed(&named, None, "test");
    assert_eq!(p.other, ["xsum-test.jsonl"]);
    assert!(p.parquet.is_empty());

    // Metadata JSON is not data.
    let meta = tree(&["dataset_infos.json", "train.jsonl"]);
    assert_eq!(pick_committed(&meta, None, "train").other, ["train.jsonl"]);
    // No split anywhere: everything is train.
    let plain = tree(&["data.csv"]);
    assert_eq!(pick_committed(&plain, None, "train").other, ["data.csv"]);
    assert!(pick_committed(&plain, None, "test").other.is_empty());
    // "contest.json" has no keyword set off by separators.
    assert!(keyword_split("contest.json", false).is_none());
}

#[test]
fn converted_layouts() {
    let files = tree(&[
        "default/train/0000.parquet",
        "default/train/0001.parquet",
        "default/partial-test/0000.parquet",
    ]);
    assert_eq!(
        pick_converted("x", &files, None, "train").unwrap(),
        ["default/train/0000.parquet", "default/train/0001.parquet"]
    );
    assert_eq!(
        pick_converted("x", &files, None, "test").unwrap(),
        ["default/partial-test/0000.parquet"]
    );
    let old = tree(&[
        "plain_text/squad-train.parquet",
        "plain_text/squad-validation.parquet",
    ]);
    assert_eq!(
        pick_converted("x", &old, None, "validation").unwrap(),
        ["plain_text/squad-validation.parquet"]
    );
    let two = tree(&["a/train/0000.parquet", "b/train/0000.parquet"]);
    let err = pick_converted("x", &two, None, "train")
        .unwrap_err()
        .to_string();
    assert!(err.contains("several configs (a, b)"), "{err}");
}

fn safe_relative(path: &str) -> Option<RemotePath> {
    RemotePath::new(path).ok()
}

#[test]
fn unsafe_paths_are_refused() {
    assert!(safe_relative("a/b.json").is_some());
    assert!(safe_relative("../x").is_none());
    assert!(safe_relative("/etc/passwd").is_none());
    assert!(safe_relative("a/../../x").is_none());
}

#[test]
fn remote_paths_refuse_every_escape() {
    for bad in [
        "",
        "/abs/x-train.jsonl",
        "..",
        "../x-train.jsonl",
        "data/../../x",
        "./x",
        "a//b",
        "a/",
        "a\\..\\x",
        "a\0b",
    ] {
        assert!(RemotePath::new(bad).is_err(), "{bad:?} accepted");
    }
    let ok = RemotePath::new("data/train-00000-of-00001.parquet").unwrap();
    let root = std::path::Path::new("/cache/root");
    assert_eq!(
        ok.under(root),
        root.join("data/train-00000-of-00001.parquet")
    );
    // Names with dots inside a segment are ordinary files.
    assert!(RemotePath::new("a..b/.hidden").is_ok());
}

#[test]
fn etags_become_safe_file_name_parts() {
    let sha = "e8a405a3d6cdde2e45ca88b5d7ce7a0c861957da78896477a90c4279ce7da89c";
    assert_eq!(etag_component(sha), sha);
    for bad in ["../../../x", "a/b", "", "x\0y", ".."] {
        let part = etag_component(bad);
        assert_eq!(part.len(), 64, "{bad:?}");
        assert!(part.bytes().all(|b| b.is_ascii_hexdigit()), "{bad:?}");
    }
}

#[test]
fn commit_ids_and_repo_ids_are_checked_before_naming_folders() {
    let sha = "0123456789abcdef0123456789abcdef01234567";
    assert_eq!(CommitId::new(sha).unwrap().as_str(), sha);
    for bad in [
        "",
        "main",
        "../../escape",
        "0123456789abcdef0123456789abcdef0123456",
        "0123456789abcdef0123456789abcdef012345678",
        "0123456789ABCDEF0123456789ABCDEF01234567",
        "0123456789abcdef0123456789abcdef0123456/",
    ] {
        assert!(CommitId::new(bad).is_err(), "{bad:?} accepted");
    }
    assert_eq!(
        repo_folder_name(RepoKind::Dataset, "lvwerra/stack-exchange-paired").unwrap(),
        "datasets--lvwerra--stack-exchange-paired"
    );
    assert_eq!(
        repo_folder_name(RepoKind::Model, "gpt2").unwrap(),
        "models--gpt2"
    );
    assert!(repo_folder_name(RepoKind::Dataset, "Org_1/data.v2_x").is_ok());
    for bad in [
        "",
        "..",
        "a/../b",
        "../x",
        "a/..",
        "/abs",
        "a/",
        "a/b/c",
        "a--b/c",
        "a/.hidden",
        "a/b-",
        "a\0b",
        "a\\b",
        "a b/c",
        &"x".repeat(97),
    ] {
        assert!(
            repo_folder_name(RepoKind::Dataset, bad).is_err(),
            "{bad:?} accepted"
        );
    }
}

/// An LFS body is read in chunks of at most `READ_CHUNK` bytes, never the file whole, and
/// yields exactly the slice asked for (a multipart part at its offset).
#[test]
fn lfs_bodies_stream_the_file_in_bounded_chunks() {
    use super::lfs::{FileSlice, READ_CHUNK};
    let dir = std::env::temp_dir().join(format!("ferrotune-lfs-slice-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("big.bin");
    let bytes: Vec<u8> = (0..3 * READ_CHUNK + 777).map(|i| (i % 251) as u8).collect();
    std::fs::write(&path, &bytes).unwrap();
    let (offset, len) = (1000u64, (2 * READ_CHUNK + 500) as u64);
    let chunks: Vec<Vec<u8>> = FileSlice::open(&path, offset, len)
        .unwrap()
        .map(|c| c.unwrap())
        .collect();
    assert!(chunks.len() >= 3, "{} chunks", chunks.len());
    assert!(chunks.iter().all(|c| c.len() <= READ_CHUNK));
    assert_eq!(
        chunks.concat(),
        &bytes[offset as usize..(offset + len) as usize]
    );
    let whole: Vec<Vec<u8>> = FileSlice::open(&path, 0, bytes.len() as u64)
        .unwrap()
        .map(|c| c.unwrap())
        .collect();
    assert_eq!(whole.iter().map(Vec::len).max(), Some(READ_CHUNK));
    assert_eq!(whole.concat(), bytes);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The wait an answer asks for, read as `huggingface_hub` 2.4.0's `http_backoff` reads it
/// (`_parse_retry_after`, `parse_ratelimit_headers`; the expected values are its own, printed
/// for these headers): `RateLimit` only on a 429 with no request left, `Retry-After` only in
/// whole seconds.
#[test]
fn retry_waits_follow_http_backoff() {
    use super::lfs::server_wait;
    // (status, headers, the wait http_backoff reads)
    type Case<'a> = (u16, &'a [(&'a str, &'a str)], Option<u64>);
    let cases: &[Case] = &[
        (429, &[("retry-after", "3")], Some(3)),
        (503, &[("retry-after", " 7 ")], Some(7)),
        (500, &[("retry-after", "0")], Some(0)),
        (
            429,
            &[("retry-after", "Wed, 21 Oct 2015 07:28:00 GMT")],
            None,
        ),
        (429, &[("retry-after", "1.5")], None),
        (429, &[("retry-after", "")], None),
        (429, &[("retry-after", "-1")], None),
        (429, &[], None),
        (
            429,
            &[("ratelimit", "\"api\";r=0;t=55"), ("retry-after", "3")],
            Some(55),
        ),
        (
            429,
            &[("ratelimit", "\"api\";r=2;t=55"), ("retry-after", "3")],
            Some(3),
        ),
        (503, &[("ratelimit", "\"api\";r=0;t=55")], None),
        (
            429,
            &[("ratelimit", "x \"resolvers\" ; r = 0 ; t = 12, more")],
            Some(12),
        ),
        (429, &[("ratelimit", "api;r=0;t=55")], None),
    ];
    for (status, headers, want) in cases {
        let mut map = reqwest::header::HeaderMap::new();
        for (k, v) in *headers {
            map.insert(*k, reqwest::header::HeaderValue::from_str(v).unwrap());
        }
        assert_eq!(server_wait(*status, &map), *want, "{status} {headers:?}");
    }
}
