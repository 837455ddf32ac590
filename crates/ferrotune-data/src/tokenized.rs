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
        let bad = |message: String| DataError::InvalidData {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let row: Value =
            serde_json::from_str(line).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let obj = row
            .as_object()
            .ok_or_else(|| bad("a row must be a JSON object".into()))?;
        let input_ids: Vec<u32> = match obj.get("input_ids") {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
                .collect::<Option<_>>()
                .ok_or_else(
                    || bad("'input_ids' must hold non-negative integer token ids".into()),
                )?,
            Some(_) => return Err(bad("'input_ids' must be a list of token ids".into())),
            None => return Err(bad("missing 'input_ids'".into())),
        };
        if input_ids.is_empty() {
            return Err(bad("'input_ids' is empty".into()));
        }
        let labels: Vec<i64> = match obj.get("labels") {
            None | Some(Value::Null) => input_ids.iter().map(|&t| t as i64).collect(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| v.as_i64().filter(|&n| n >= 0 || n == IGNORE_INDEX))
                .collect::<Option<_>>()
                .ok_or_else(|| bad("'labels' must hold token ids or -100".into()))?,
            Some(_) => return Err(bad("'labels' must be a list".into())),
        };
        if labels.len() != input_ids.len() {
            return Err(bad(format!(
                "'labels' has {} entries but 'input_ids' has {}",
                labels.len(),
                input_ids.len()
            )));
        }
        rows.push(TokenizedExample { input_ids, labels });
    }
    Ok(rows)
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
        let msg = read_tokenized_jsonl(Path::new("/no/data.jsonl"))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("/no/data.jsonl"), "{msg}");
    }
}
