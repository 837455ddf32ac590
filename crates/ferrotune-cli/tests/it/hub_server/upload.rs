//! The Hub's upload endpoints, as `huggingface_hub` calls them (`_commit_api.py`, `lfs.py`):
//! `POST /api/repos/create`, `POST /api/{models,datasets}/{repo}/preupload/{rev}` (LFS for files
//! over 10 MB and `*.safetensors` / `*.bin`, the Hub's default `.gitattributes` rule in short),
//! the Git LFS batch API (`POST /{datasets/}{repo}.git/info/lfs/objects/batch`, `basic`
//! transfer: objects already stored come back without `actions`), the LFS `PUT` and `verify`
//! (here `/lfs-upload/{oid}`, `/lfs-verify/{oid}`; the stored bytes must hash to the oid) and
//! `POST /api/{models,datasets}/{repo}/commit/{rev}` (NDJSON; every `lfsFile` must be stored).
//! With `HubServer::multipart(chunk)`, objects over `chunk` bytes get the Hub's `multipart`
//! action (header `chunk_size` and numbered part URLs `/lfs-part/{oid}/{n}`, each answered with
//! an `ETag`; completion `POST /lfs-complete/{oid}` with `{"oid", "parts": [{"partNumber",
//! "etag"}]}`, whose parts, joined, must hash to the oid).

use std::collections::HashMap;

use sha2::{Digest, Sha256};

use super::{Response, State};

/// A repository created through `/api/repos/create`.
#[derive(Clone, Debug)]
pub struct CreatedRepo {
    /// `models` or `datasets`.
    pub kind: String,
    pub id: String,
    pub private: bool,
}

/// A commit the server accepted.
#[derive(Clone, Debug)]
pub struct Commit {
    pub kind: String,
    pub repo: String,
    pub revision: String,
    pub summary: String,
    /// Path → content (regular files decoded; LFS files from the object store).
    pub files: HashMap<String, Vec<u8>>,
    /// The paths committed as `lfsFile`.
    pub lfs_paths: Vec<String>,
}

#[derive(Default)]
pub(super) struct Uploads {
    pub(super) repos: Vec<CreatedRepo>,
    pub(super) objects: HashMap<String, Vec<u8>>,
    pub(super) commits: Vec<Commit>,
    /// Objects over this size are uploaded in parts of this size.
    pub(super) multipart_chunk: Option<usize>,
    /// Parts received, by (oid, part number).
    pub(super) parts: HashMap<(String, usize), Vec<u8>>,
    /// (oid, part number, length) per part `PUT` received whole.
    pub(super) parts_log: Vec<(String, usize, usize)>,
}

pub(super) fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn b64_decode(s: &str) -> Vec<u8> {
    let val = |c: u8| match c {
        b'A'..=b'Z' => c - b'A',
        b'a'..=b'z' => c - b'a' + 26,
        b'0'..=b'9' => c - b'0' + 52,
        b'+' => 62,
        _ => 63,
    };
    let clean: Vec<u8> = s.bytes().filter(|&c| c != b'=').collect();
    let mut out = Vec::new();
    for chunk in clean.chunks(4) {
        let mut n = 0u32;
        for (i, &c) in chunk.iter().enumerate() {
            n |= (val(c) as u32) << (18 - 6 * i);
        }
        for i in 0..chunk.len().saturating_sub(1) {
            out.push((n >> (16 - 8 * i)) as u8);
        }
    }
    out
}

/// Whether `segs` is one of the upload endpoints the token guards.
pub(super) fn is_upload(method: &str, segs: &[String]) -> bool {
    let s: Vec<&str> = segs.iter().map(String::as_str).collect();
    matches!(
        (method, s.as_slice()),
        ("POST", ["api", "repos", "create"])
            | ("POST", ["api", _, _, _, "preupload" | "commit", _])
            | ("POST", [.., "info", "lfs", "objects", "batch"])
    )
}

/// The answer to an upload request, or `None` when `path` is not one of these endpoints.
pub(super) fn route(state: &State, method: &str, segs: &[String], body: &[u8]) -> Option<Response> {
    let s: Vec<&str> = segs.iter().map(String::as_str).collect();
    let json = || serde_json::from_slice::<serde_json::Value>(body).unwrap_or_default();
    let mut up = state.uploads.lock().unwrap();
    let exists =
        |up: &Uploads, kind: &str, id: &str| up.repos.iter().any(|r| r.kind == kind && r.id == id);
    match (method, s.as_slice()) {
        ("POST", ["api", "repos", "create"]) => {
            let v = json();
            let name = v["name"].as_str().unwrap_or_default();
            let id = match v["organization"].as_str() {
                Some(o) => format!("{o}/{name}"),
                None => format!("user/{name}"),
            };
            let kind = match v["type"].as_str() {
                Some("dataset") => "datasets",
                _ => "models",
            };
            if exists(&up, kind, &id) {
                return Some(Response::error(409, None, "You already created this repo"));
            }
            up.repos.push(CreatedRepo {
                kind: kind.to_string(),
                id: id.clone(),
                private: v["private"].as_bool().unwrap_or(false),
            });
            Some(
                Response::new(200)
                    .json(serde_json::json!({ "url": format!("{}/{id}", state.base) })),
            )
        }
        ("POST", ["api", kind, owner, name, "preupload", _rev]) => {
            if !exists(&up, kind, &format!("{owner}/{name}")) {
                return Some(Response::error(
                    404,
                    Some("RepoNotFound"),
                    "Repository not found",
                ));
            }
            let files: Vec<_> = json()["files"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|f| {
                    let path = f["path"].as_str().unwrap_or_default();
                    let lfs = f["size"].as_u64().unwrap_or(0) > 10 * 1024 * 1024
                        || path.ends_with(".safetensors")
                        || path.ends_with(".bin");
                    serde_json::json!({
                        "path": path, "uploadMode": if lfs { "lfs" } else { "regular" },
                        "shouldIgnore": false,
                    })
                })
                .collect();
            Some(Response::new(200).json(serde_json::json!({ "files": files })))
        }
        ("POST", [.., repo_git, "info", "lfs", "objects", "batch"]) => {
            let v = json();
            assert_eq!(v["operation"], "upload");
            let _ = repo_git;
            let objects: Vec<_> = v["objects"]
                .as_array()
                .cloned()
                .unwrap_or_default()
                .iter()
                .map(|o| {
                    let oid = o["oid"].as_str().unwrap_or_default().to_string();
                    let mut e = serde_json::json!({ "oid": oid, "size": o["size"] });
                    let size = o["size"].as_u64().unwrap_or(0) as usize;
                    let multipart = up.multipart_chunk.filter(|&c| size > c);
                    if let (Some(chunk), false) = (multipart, up.objects.contains_key(&oid)) {
                        assert!(v["transfers"]
                            .as_array()
                            .unwrap()
                            .contains(&serde_json::json!("multipart")));
                        let mut header = serde_json::json!({ "chunk_size": chunk.to_string() });
                        for n in 1..=size.div_ceil(chunk) {
                            header[n.to_string()] =
                                serde_json::json!(format!("{}/lfs-part/{oid}/{n}", state.base));
                        }
                        e["actions"] = serde_json::json!({
                            "upload": { "href": format!("{}/lfs-complete/{oid}", state.base),
                                        "header": header },
                            "verify": { "href": format!("{}/lfs-verify/{oid}", state.base) },
                        });
                    } else if !up.objects.contains_key(&oid) {
                        e["actions"] = serde_json::json!({
                            "upload": { "href": format!("{}/lfs-upload/{oid}", state.base),
                                        "header": { "x-test-upload": "yes" } },
                            "verify": { "href": format!("{}/lfs-verify/{oid}", state.base) },
                        });
                    }
                    e
                })
                .collect();
            Some(
                Response::new(200)
                    .json(serde_json::json!({ "transfer": "basic", "objects": objects })),
            )
        }
        ("PUT", ["lfs-upload", oid]) => {
            if sha256_hex(body) != *oid {
                return Some(Response::error(400, None, "sha256 mismatch"));
            }
            up.objects.insert(oid.to_string(), body.to_vec());
            Some(Response::new(200))
        }
        ("PUT", ["lfs-part", oid, n]) => {
            let n: usize = n.parse().unwrap();
            let etag = format!("\"{}\"", &sha256_hex(body)[..32]);
            up.parts_log.push((oid.to_string(), n, body.len()));
            up.parts.insert((oid.to_string(), n), body.to_vec());
            Some(Response::new(200).header("etag", etag))
        }
        ("POST", ["lfs-complete", oid]) => {
            let v = json();
            assert_eq!(v["oid"], *oid);
            let mut whole = Vec::new();
            for (i, p) in v["parts"].as_array().unwrap().iter().enumerate() {
                assert_eq!(p["partNumber"], i + 1, "parts in order");
                let Some(bytes) = up.parts.get(&(oid.to_string(), i + 1)) else {
                    return Some(Response::error(400, None, "part not uploaded"));
                };
                let etag = format!("\"{}\"", &sha256_hex(bytes)[..32]);
                if p["etag"] != etag.as_str() {
                    return Some(Response::error(400, None, "etag mismatch"));
                }
                whole.extend_from_slice(bytes);
            }
            if sha256_hex(&whole) != *oid {
                return Some(Response::error(400, None, "sha256 mismatch"));
            }
            up.objects.insert(oid.to_string(), whole);
            Some(Response::new(200).json(serde_json::json!({})))
        }
        ("POST", ["lfs-verify", oid]) => {
            let ok = up.objects.contains_key(*oid) && json()["oid"] == *oid;
            Some(match ok {
                true => Response::new(200).json(serde_json::json!({})),
                false => Response::error(404, None, "object not found"),
            })
        }
        ("POST", ["api", kind, owner, name, "commit", rev]) => {
            let id = format!("{owner}/{name}");
            if !exists(&up, kind, &id) {
                return Some(Response::error(
                    404,
                    Some("RepoNotFound"),
                    "Repository not found",
                ));
            }
            let mut commit = Commit {
                kind: kind.to_string(),
                repo: id.clone(),
                revision: rev.to_string(),
                summary: String::new(),
                files: HashMap::new(),
                lfs_paths: Vec::new(),
            };
            for line in String::from_utf8_lossy(body).lines() {
                let v: serde_json::Value = serde_json::from_str(line).unwrap();
                let val = &v["value"];
                let path = val["path"].as_str().unwrap_or_default().to_string();
                match v["key"].as_str() {
                    Some("header") => {
                        commit.summary = val["summary"].as_str().unwrap_or_default().into()
                    }
                    Some("file") => {
                        assert_eq!(val["encoding"], "base64");
                        commit
                            .files
                            .insert(path, b64_decode(val["content"].as_str().unwrap()));
                    }
                    Some("lfsFile") => {
                        assert_eq!(val["algo"], "sha256");
                        let oid = val["oid"].as_str().unwrap_or_default();
                        let Some(bytes) = up.objects.get(oid) else {
                            return Some(Response::error(400, None, "LFS object not uploaded"));
                        };
                        commit.files.insert(path.clone(), bytes.clone());
                        commit.lfs_paths.push(path);
                    }
                    other => panic!("unknown commit key {other:?}"),
                }
            }
            let oid = sha256_hex(body)[..40].to_string();
            up.commits.push(commit);
            Some(Response::new(200).json(serde_json::json!({
                "commitUrl": format!("{}/{id}/commit/{oid}", state.base),
                "commitOid": oid,
            })))
        }
        _ => None,
    }
}
