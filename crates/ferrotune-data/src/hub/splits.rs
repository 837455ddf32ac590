//! Choosing a dataset split's files, as the `datasets` library's default layout does: committed
//! files by shard names or split keywords, or the Hub's parquet conversion.

use std::collections::BTreeSet;

use super::requests::TreeFile;
use crate::error::{DataError, Result};

/// `datasets`' split keywords, by canonical split name.
const SPLIT_KEYWORDS: &[(&str, &[&str])] = &[
    ("train", &["train", "training"]),
    ("validation", &["validation", "valid", "dev", "val"]),
    ("test", &["test", "testing", "eval", "evaluation"]),
];

/// Characters `datasets` accepts around a split keyword (`[-._ 0-9]`).
fn is_sep(c: char) -> bool {
    matches!(c, '-' | '.' | '_' | ' ') || c.is_ascii_digit()
}

/// The canonical split a user-facing name means (`dev` is `validation`).
fn canonical_split(name: &str) -> String {
    let lower = name.to_ascii_lowercase();
    SPLIT_KEYWORDS
        .iter()
        .find(|(_, kws)| kws.contains(&lower.as_str()))
        .map(|(canon, _)| canon.to_string())
        .unwrap_or(lower)
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum DataFormat {
    Parquet,
    Other,
}

fn data_format(path: &str) -> Option<DataFormat> {
    let lower = path.to_ascii_lowercase();
    if lower.ends_with(".parquet") {
        Some(DataFormat::Parquet)
    } else if lower.ends_with(".jsonl") || lower.ends_with(".json") || lower.ends_with(".csv") {
        Some(DataFormat::Other)
    } else {
        None
    }
}

/// `{split}-NNNNN-of-NNNNN...` (the Hub's shard names): the split.
fn shard_split(file_name: &str) -> Option<&str> {
    let bytes = file_name.as_bytes();
    let mut i = 0;
    while let Some(pos) = file_name[i..].find('-') {
        let at = i + pos;
        let rest = &bytes[at + 1..];
        let digits = |s: &[u8]| s.len() >= 5 && s[..5].iter().all(u8::is_ascii_digit);
        if at > 0 && digits(rest) && rest.get(5..9) == Some(b"-of-") && digits(&rest[9..]) {
            return Some(&file_name[..at]);
        }
        i = at + 1;
    }
    None
}

/// The split keyword a name carries as `datasets` looks for it: the whole name, or the keyword
/// after the start / before the end / in the middle, set off by `[-._ 0-9]`.
pub(super) fn keyword_split(name: &str, whole_or_edges: bool) -> Option<&'static str> {
    let lower = name.to_ascii_lowercase();
    for (canon, kws) in SPLIT_KEYWORDS {
        for kw in *kws {
            let mut found = false;
            let mut from = 0;
            while let Some(pos) = lower[from..].find(kw) {
                let at = from + pos;
                let end = at + kw.len();
                let before = lower[..at].chars().next_back();
                let after = lower[end..].chars().next();
                let ok_before = before.is_none_or(is_sep);
                let ok_after = after.is_none_or(is_sep);
                // File names need a separator after the keyword (the extension's dot counts);
                // folder names may end with it.
                let ok = if whole_or_edges {
                    ok_before && ok_after
                } else {
                    ok_before && after.is_some_and(is_sep)
                };
                if ok {
                    found = true;
                    break;
                }
                from = at + 1;
            }
            if found {
                return Some(canon);
            }
        }
    }
    None
}

/// Which rule assigns splits to a repository's data files: the first that applies to any file.
#[derive(Clone, Copy)]
enum SplitRule {
    Shards,
    FolderKeyword,
    FileKeyword,
    AllTrain,
}

fn split_by(rule: SplitRule, path: &str) -> Option<String> {
    let (dirs, file) = match path.rsplit_once('/') {
        Some((d, f)) => (d, f),
        None => ("", path),
    };
    match rule {
        SplitRule::Shards => shard_split(file).map(canonical_split),
        SplitRule::FolderKeyword => dirs
            .split('/')
            .filter(|d| !d.is_empty())
            .find_map(|d| keyword_split(d, true))
            .map(str::to_string),
        SplitRule::FileKeyword => keyword_split(file, false).map(str::to_string),
        SplitRule::AllTrain => Some("train".to_string()),
    }
}

/// Files `datasets` never takes as data (metadata it writes itself).
const NOT_DATA: &[&str] = &[
    "config.json",
    "dataset_info.json",
    "dataset_infos.json",
    "dataset_dict.json",
];

/// A committed file in a data format, not hidden (`.x`, `__x`) and not metadata.
pub(super) fn is_data_file(path: &str) -> bool {
    let name = path.rsplit('/').next().unwrap_or(path);
    data_format(path).is_some()
        && !NOT_DATA.contains(&name)
        && !path
            .split('/')
            .any(|c| c.starts_with('.') || c.starts_with("__"))
}

/// The committed data files of a split, by format, and the splits seen.
pub(super) struct CommittedPick {
    pub(super) parquet: Vec<String>,
    pub(super) other: Vec<String>,
    pub(super) splits_found: BTreeSet<String>,
}

pub(super) fn pick_committed(
    files: &[TreeFile],
    config: Option<&str>,
    split: &str,
) -> CommittedPick {
    let data: Vec<&TreeFile> = files
        .iter()
        .filter(|f| is_data_file(&f.path))
        .filter(|f| match config {
            Some(c) => f.path.split('/').next() == Some(c) && f.path.contains('/'),
            None => true,
        })
        .collect();
    let rule = [
        SplitRule::Shards,
        SplitRule::FolderKeyword,
        SplitRule::FileKeyword,
    ]
    .into_iter()
    .find(|&r| data.iter().any(|f| split_by(r, &f.path).is_some()))
    .unwrap_or(SplitRule::AllTrain);
    let wanted = canonical_split(split);
    let mut pick = CommittedPick {
        parquet: Vec::new(),
        other: Vec::new(),
        splits_found: BTreeSet::new(),
    };
    for f in data {
        let Some(s) = split_by(rule, &f.path) else {
            continue;
        };
        if s == wanted {
            match data_format(&f.path) {
                Some(DataFormat::Parquet) => pick.parquet.push(f.path.to_string()),
                _ => pick.other.push(f.path.to_string()),
            }
        }
        pick.splits_found.insert(s);
    }
    pick.parquet.sort();
    pick.other.sort();
    pick
}

/// The configs of the parquet conversion (its top-level folders).
pub(super) fn converted_configs(files: &[TreeFile]) -> BTreeSet<&str> {
    files
        .iter()
        .filter(|f| f.path.ends_with(".parquet"))
        .filter_map(|f| f.path.split_once('/').map(|(c, _)| c))
        .collect()
}

/// The conversion's config for `name`: `name`, else `default`, else the only one.
fn converted_config<'a>(files: &'a [TreeFile], name: Option<&'a str>) -> Option<&'a str> {
    let configs = converted_configs(files);
    match name {
        Some(n) => Some(n),
        None if configs.contains("default") || configs.is_empty() => Some("default"),
        None if configs.len() == 1 => configs.into_iter().next(),
        None => None,
    }
}

/// The split of a conversion file of `config`: `{config}/{split}/NNNN.parquet` (or
/// `{config}/partial-{split}/...` for a partial conversion), or the older
/// `{config}/{name}-{split}[-NNNNN-of-NNNNN].parquet`.
fn converted_split(path: &str, config: &str) -> Option<String> {
    let rest = path.strip_prefix(config)?.strip_prefix('/')?;
    if !rest.ends_with(".parquet") {
        return None;
    }
    match rest.split_once('/') {
        Some((dir, _)) => Some(dir.strip_prefix("partial-").unwrap_or(dir).to_string()),
        None => {
            let stem = rest.trim_end_matches(".parquet");
            let stem = shard_split(stem).unwrap_or(stem);
            stem.rsplit_once('-').map(|(_, s)| s.to_string())
        }
    }
}

pub(super) fn converted_splits(files: &[TreeFile], name: Option<&str>) -> BTreeSet<String> {
    let Some(config) = converted_config(files, name) else {
        return BTreeSet::new();
    };
    files
        .iter()
        .filter_map(|f| converted_split(&f.path, config))
        .collect()
}

pub(super) fn pick_converted(
    repo_id: &str,
    files: &[TreeFile],
    name: Option<&str>,
    split: &str,
) -> Result<Vec<String>> {
    let Some(config) = converted_config(files, name) else {
        let configs: Vec<&str> = converted_configs(files).into_iter().collect();
        return Err(DataError::Dataset(format!(
            "hub dataset '{repo_id}' has several configs ({}): set the dataset's `name` to one of them",
            configs.join(", ")
        )));
    };
    let wanted = canonical_split(split);
    let mut picked: Vec<String> = files
        .iter()
        .filter(|f| {
            converted_split(&f.path, config)
                .is_some_and(|s| s == split || canonical_split(&s) == wanted)
        })
        .map(|f| f.path.to_string())
        .collect();
    picked.sort();
    Ok(picked)
}
