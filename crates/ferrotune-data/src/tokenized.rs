//! Pre-tokenized datasets: JSON Lines rows `{"input_ids": [...], "labels": [...]}`, for exact
//! checks and for users who tokenize themselves (the `tokenized_dataset` builder of the recipes).

use std::path::Path;

use serde_json::Value;

use crate::error::{DataError, Result};

/// Label value that contributes no loss (PyTorch's `ignore_index`).
pub const IGNORE_INDEX: i64 = -100;

/// One training example.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizedExample {
    /// Token ids fed to the model.
    pub input_ids: Vec<u32>,
    /// Per-token targets before the causal shift; [`IGNORE_INDEX`] for no loss. When a row has no
    /// `labels`, they are the input ids (loss on every token, as transformers does for
    /// `labels=input_ids`).
    pub labels: Vec<i64>,
}

/// Reads a JSONL file of pre-tokenized rows. Blank lines are skipped; every malformed row is an
/// error naming the file, the line and the problem (nothing is silently dropped).
pub fn read_tokenized_jsonl(path: &Path) -> Result<Vec<TokenizedExample>> {
    read_tokenized_jsonl_for(path, None)
}

/// [`read_tokenized_jsonl`] for a model whose vocabulary has `vocab_size` tokens (when known):
/// an input id or label at or past it is an error naming the file, the line, the id and the
/// vocabulary size, before training starts rather than as an index error in the embedding.
pub fn read_tokenized_jsonl_for(
    path: &Path,
    vocab_size: Option<usize>,
) -> Result<Vec<TokenizedExample>> {
    read_rows(path, |obj, bad| example(obj, "", vocab_size, bad))
}

/// One preference pair of a pre-tokenized preference dataset: what torchtune's
/// `PreferenceDataset` yields for a row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenizedPair {
    /// `chosen_input_ids` / `chosen_labels`.
    pub chosen: TokenizedExample,
    /// `rejected_input_ids` / `rejected_labels`.
    pub rejected: TokenizedExample,
}

/// Reads a JSONL file of pre-tokenized preference pairs, rows `{"chosen_input_ids": [...],
/// "chosen_labels": [...], "rejected_input_ids": [...], "rejected_labels": [...]}` (labels
/// optional, as in [`read_tokenized_jsonl`]), with the same error reporting.
pub fn read_tokenized_pairs_jsonl(path: &Path) -> Result<Vec<TokenizedPair>> {
    read_tokenized_pairs_jsonl_for(path, None)
}

/// [`read_tokenized_pairs_jsonl`] with the ids checked against the model's vocabulary, as
/// [`read_tokenized_jsonl_for`] does.
pub fn read_tokenized_pairs_jsonl_for(
    path: &Path,
    vocab_size: Option<usize>,
) -> Result<Vec<TokenizedPair>> {
    read_rows(path, |obj, bad| {
        Ok(TokenizedPair {
            chosen: example(obj, "chosen_", vocab_size, bad)?,
            rejected: example(obj, "rejected_", vocab_size, bad)?,
        })
    })
}

/// Whether the first row of a pre-tokenized JSONL file is a preference pair (has
/// `chosen_input_ids`); false for an unreadable or empty file (reading it reports why).
pub fn holds_pairs(path: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(path) else {
        return false;
    };
    text.lines()
        .find(|l| !l.trim().is_empty())
        .and_then(|l| serde_json::from_str::<Value>(l).ok())
        .is_some_and(|v| v.get("chosen_input_ids").is_some())
}

type Bad<'a> = &'a dyn Fn(String) -> DataError;

/// Every non-blank line of `path` as a JSON object, through `parse`.
fn read_rows<T>(
    path: &Path,
    parse: impl Fn(&serde_json::Map<String, Value>, Bad) -> Result<T>,
) -> Result<Vec<T>> {
    let text = std::fs::read_to_string(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            DataError::NotFound {
                path: path.to_path_buf(),
                what: "pre-tokenized dataset",
            }
        } else {
            DataError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    })?;
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| DataError::invalid_data(path, i + 1, message);
        let row: Value =
            serde_json::from_str(line).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let obj = row
            .as_object()
            .ok_or_else(|| bad("a row must be a JSON object".into()))?;
        rows.push(parse(obj, &bad)?);
    }
    Ok(rows)
}

/// The example under `{prefix}input_ids` and `{prefix}labels`, its ids (and labels other than
/// [`IGNORE_INDEX`]) below `vocab_size` when given.
fn example(
    obj: &serde_json::Map<String, Value>,
    prefix: &str,
    vocab_size: Option<usize>,
    bad: Bad,
) -> Result<TokenizedExample> {
    let (ids_key, labels_key) = (format!("{prefix}input_ids"), format!("{prefix}labels"));
    let input_ids: Vec<u32> = match obj.get(&ids_key) {
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect::<Option<_>>()
            .ok_or_else(|| {
                bad(format!(
                    "'{ids_key}' must hold non-negative integer token ids"
                ))
            })?,
        Some(_) => return Err(bad(format!("'{ids_key}' must be a list of token ids"))),
        None => return Err(bad(format!("missing '{ids_key}'"))),
    };
    if input_ids.is_empty() {
        return Err(bad(format!("'{ids_key}' is empty")));
    }
    let labels: Vec<i64> = match obj.get(&labels_key) {
        None | Some(Value::Null) => input_ids.iter().map(|&t| t as i64).collect(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| v.as_i64().filter(|&n| n >= 0 || n == IGNORE_INDEX))
            .collect::<Option<_>>()
            .ok_or_else(|| bad(format!("'{labels_key}' must hold token ids or -100")))?,
        Some(_) => return Err(bad(format!("'{labels_key}' must be a list"))),
    };
    if labels.len() != input_ids.len() {
        return Err(bad(format!(
            "'{labels_key}' has {} entries but '{ids_key}' has {}",
            labels.len(),
            input_ids.len()
        )));
    }
    if let Some(vocab) = vocab_size {
        let past = |key: &str, at: Option<(usize, i64)>| match at {
            Some((i, id)) => Err(bad(format!(
                "'{key}' holds the id {id} (position {}), past the model's vocabulary of \
                 {vocab} tokens (ids 0 to {})",
                i + 1,
                vocab.saturating_sub(1)
            ))),
            None => Ok(()),
        };
        let first_past = |ids: &mut dyn Iterator<Item = i64>| {
            ids.enumerate().find(|&(_, id)| id >= vocab as i64)
        };
        past(
            &ids_key,
            first_past(&mut input_ids.iter().map(|&id| id as i64)),
        )?;
        past(&labels_key, first_past(&mut labels.iter().copied()))?;
    }
    Ok(TokenizedExample { input_ids, labels })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(name: &str, text: &str) -> std::path::PathBuf {
        let p =
            std::env::temp_dir().join(format!("ferrotune-tok-{}-{name}.jsonl", std::process::id()));
        std::fs::write(&p, text).unwrap();
        p
    }

    #[test]
    fn rows_with_and_without_labels() {
        let p = write(
            "ok",
            "{\"input_ids\": [1, 2, 3], \"labels\": [-100, 2, 3]}\n\n{\"input_ids\": [4, 5]}\n",
        );
        let rows = read_tokenized_jsonl(&p).unwrap();
        assert_eq!(
            rows,
            vec![
                TokenizedExample {
                    input_ids: vec![1, 2, 3],
                    labels: vec![-100, 2, 3]
                },
                TokenizedExample {
                    input_ids: vec![4, 5],
                    labels: vec![4, 5]
                },
            ]
        );
    }

    #[test]
    fn preference_pairs_and_their_errors() {
        let p = write(
            "pairs",
            "{\"chosen_input_ids\": [1, 2], \"chosen_labels\": [-100, 2], \"rejected_input_ids\": [1, 3, 4]}\n",
        );
        assert!(holds_pairs(&p));
        let pairs = read_tokenized_pairs_jsonl(&p).unwrap();
        assert_eq!(pairs[0].chosen.labels, vec![-100, 2]);
        assert_eq!(pairs[0].rejected.labels, vec![1, 3, 4]);
        let p = write("pairs-bad", "{\"chosen_input_ids\": [1, 2]}\n");
        let msg = read_tokenized_pairs_jsonl(&p).unwrap_err().to_string();
        assert!(msg.contains("1: missing 'rejected_input_ids'"), "{msg}");
        assert!(!holds_pairs(&write("plain", "{\"input_ids\": [1]}\n")));
    }

    #[test]
    fn malformed_rows_name_file_and_line() {
        let cases = [
            (
                "{\"input_ids\": [1, 2]}\n{\"labels\": [1]}\n",
                "2: missing 'input_ids'",
            ),
            ("{\"input_ids\": [1, -2]}\n", "1: 'input_ids' must hold"),
            (
                "{\"input_ids\": [1, 2], \"labels\": [1]}\n",
                "'labels' has 1 entries",
            ),
            ("{\"input_ids\": [1], \"labels\": [-5]}\n", "-100"),
            ("{\"input_ids\": []}\n", "empty"),
            ("[1, 2]\n", "JSON object"),
            ("{oops\n", "not valid JSON"),
        ];
        for (i, (text, needle)) in cases.iter().enumerate() {
            let p = write(&format!("bad{i}"), text);
            let msg = read_tokenized_jsonl(&p).unwrap_err().to_string();
            assert!(
                msg.contains(p.to_str().unwrap()) && msg.contains(needle),
                "{msg}"
            );
        }
        // Ids past the model's vocabulary, in the inputs or the labels (here on line 3).
        for (text, needle) in [
            (
                "{\"input_ids\": [1, 2]}\n\n{\"input_ids\": [1, 2, 16]}\n",
                "3: 'input_ids' holds the id 16 (position 3), past the model's vocabulary of 16",
            ),
            (
                "{\"input_ids\": [1]}\n\n{\"input_ids\": [1, 2], \"labels\": [-100, 99]}\n",
                "3: 'labels' holds the id 99 (position 2)",
            ),
        ] {
            let p = write("vocab", text);
            read_tokenized_jsonl(&p).unwrap();
            let msg = read_tokenized_jsonl_for(&p, Some(16))
                .unwrap_err()
                .to_string();
            assert!(
                msg.contains(p.to_str().unwrap()) && msg.contains(needle),
                "{msg}"
            );
        }
        let p = write(
            "vocab-pairs",
            "{\"chosen_input_ids\": [1, 2], \"rejected_input_ids\": [1, 40]}\n",
        );
        let msg = read_tokenized_pairs_jsonl_for(&p, Some(16))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("1: 'rejected_input_ids' holds the id 40"),
            "{msg}"
        );
        let msg = read_tokenized_jsonl(Path::new("/no/data.jsonl"))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("/no/data.jsonl"), "{msg}");
    }
}
