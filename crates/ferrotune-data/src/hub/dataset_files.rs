//! [`dataset_files`] / [`dataset_files_in`]: the data files of one split of a dataset repository,
//! downloaded into the Hugging Face cache (by `cache.rs`).

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

use super::cache::cache_files;
use super::client::{runtime, Hub};
use super::errors::Ctx;
use super::requests::{list_converted, list_files, TreeFile};
use super::safe_path::repo_folder_name;
use super::splits::{
    converted_configs, converted_splits, is_data_file, pick_committed, pick_converted,
};
use super::RepoKind;
use crate::error::{DataError, Result};

/// What to tell a user whose request needs a token, when downloading a dataset for a recipe.
const DATASET_TOKEN_HINT: &str = "set HF_TOKEN to a Hugging Face access token";

/// The revision where the Hub keeps its automatic parquet conversion of a dataset.
const PARQUET_REVISION: &str = "refs/convert/parquet";

/// Downloads the data files (parquet preferred) of dataset repository `repo_id` needed for
/// `split` and returns their local paths, sorted by path (the shards' order).
///
/// `split` may carry a slice (`train[:10%]`): only the name before `[` selects files; the caller
/// slices. `name` is the dataset config: files under a folder of that name (or the `{name}/...`
/// files of the Hub's parquet conversion); `None` (or `"default"`) is the default config.
///
/// Files are picked as the `datasets` library's default layout does: `{split}-NNNNN-of-NNNNN.*`
/// shards (e.g. `data/train-00000-of-00001.parquet`), else split keywords in folder names
/// (`train/`, `*-validation/`), else in file names (`train.jsonl`, `xsum-test.csv`); with none of
/// these, every data file is `train`. Committed parquet comes first, then the Hub's parquet
/// conversion (revision `refs/convert/parquet`, `{config}/{split}/*.parquet`; first when the
/// repository has a loading script, whose output only the conversion reflects), then committed
/// JSON / JSONL / CSV. Files go to the Hugging Face cache (`HF_HUB_CACHE`, else `$HF_HOME/hub`),
/// at `datasets--{owner}--{name}/snapshots/{commit}/{path}` as real files; a file already complete
/// there is not downloaded again, an interrupted one resumes. The repository id must be one the
/// Hub accepts (`owner/name`, no `..`), and the commit the Hub names (`X-Repo-Commit`) a commit id.
pub fn dataset_files(repo_id: &str, name: Option<&str>, split: &str) -> Result<Vec<PathBuf>> {
    dataset_files_in(repo_id, name, None, split)
}

/// [`dataset_files`] limited to the committed files under folder `data_dir` of the repository
/// (`load_dataset`'s `data_dir`, e.g. `data/rl` of `lvwerra/stack-exchange-paired`, which
/// torchtune's `stack_exchange_paired_dataset` reads). The parquet conversion covers the whole
/// repository, so with a `data_dir` only committed files are used.
pub fn dataset_files_in(
    repo_id: &str,
    name: Option<&str>,
    data_dir: Option<&str>,
    split: &str,
) -> Result<Vec<PathBuf>> {
    let split = split.split('[').next().unwrap_or("").trim();
    if split.is_empty() {
        return Err(DataError::Dataset(format!(
            "hub dataset '{repo_id}': empty split name"
        )));
    }
    let hub = Hub::new(None, DATASET_TOKEN_HINT)?;
    let (owner, repo_name) = hf_hub::split_id(repo_id);
    let repo = hub.client.dataset(owner, repo_name);
    let main_ctx = Ctx {
        hub: &hub,
        repo_id,
        kind: RepoKind::Dataset,
        revision: "main",
    };
    let convert_ctx = Ctx {
        revision: PARQUET_REVISION,
        ..main_ctx
    };
    // The id names the cache folder: checked before any request.
    repo_folder_name(RepoKind::Dataset, repo_id).map_err(|why| {
        DataError::Dataset(format!(
            "hub dataset '{}' (the dataset's `source`) is not a valid Hugging Face repository id: {why}",
            repo_id.escape_debug()
        ))
    })?;
    runtime()?.block_on(async {
        let mut main = list_files(&main_ctx, &repo).await?;
        let data_dir = data_dir.map(|d| format!("{}/", d.trim_matches('/')));
        if let Some(dir) = &data_dir {
            main.retain(|f| f.path.starts_with(dir.as_str()));
        }
        let script = format!("{repo_name}.py");
        let has_script = main.iter().any(|f| f.path.as_str() == script);
        let config = name.filter(|n| *n != "default");
        let main_pick = pick_committed(&main, config, split);

        let mut converted: Option<Vec<TreeFile>> = None;
        let mut chosen: Option<(&str, Vec<String>)> = None;
        if !has_script && !main_pick.parquet.is_empty() {
            chosen = Some(("main", main_pick.parquet.clone()));
        }
        if chosen.is_none() && data_dir.is_none() {
            let files = list_converted(&convert_ctx, &repo).await?;
            let pick = pick_converted(repo_id, &files, name, split)?;
            converted = Some(files);
            if !pick.is_empty() {
                chosen = Some((PARQUET_REVISION, pick));
            }
        }
        if chosen.is_none() {
            if !main_pick.parquet.is_empty() {
                chosen = Some(("main", main_pick.parquet.clone()));
            } else if !main_pick.other.is_empty() {
                chosen = Some(("main", main_pick.other.clone()));
            }
        }
        let Some((revision, files)) = chosen else {
            if let Some(n) = config {
                let mut configs: BTreeSet<&str> = main
                    .iter()
                    .filter(|f| is_data_file(&f.path))
                    .filter_map(|f| f.path.split_once('/').map(|(c, _)| c))
                    .collect();
                if let Some(conv) = &converted {
                    configs.extend(converted_configs(conv));
                }
                if !configs.contains(n) {
                    let list: Vec<&str> = configs.into_iter().collect();
                    return Err(DataError::Dataset(format!(
                        "hub dataset '{repo_id}': config '{n}' not found; folders with data files: {}",
                        if list.is_empty() { "none".to_string() } else { list.join(", ") }
                    )));
                }
            }
            let mut splits = main_pick.splits_found.clone();
            if let Some(conv) = &converted {
                splits.extend(converted_splits(conv, name));
            }
            let mut config_note = name.map(|n| format!(" (config '{n}')")).unwrap_or_default();
            if let Some(dir) = &data_dir {
                config_note.push_str(&format!(" under data_dir '{dir}'"));
            }
            let found = if splits.is_empty() {
                "none".to_string()
            } else {
                splits.into_iter().collect::<Vec<_>>().join(", ")
            };
            return Err(DataError::Dataset(format!(
                "hub dataset '{repo_id}'{config_note}: no parquet, JSON, JSONL or CSV data files for split '{split}'; splits found: {found}"
            )));
        };
        let ctx = Ctx {
            revision,
            ..main_ctx
        };
        let listing = if revision == PARQUET_REVISION {
            converted.as_deref().unwrap_or_default()
        } else {
            &main
        };
        let by_path: HashMap<&str, &TreeFile> =
            listing.iter().map(|f| (f.path.as_str(), f)).collect();
        // The picks come from these listings, so every one is found.
        let picked: Vec<&TreeFile> = files
            .iter()
            .filter_map(|p| by_path.get(p.as_str()).copied())
            .collect();
        cache_files(&ctx, &repo, &picked).await
    })
}
