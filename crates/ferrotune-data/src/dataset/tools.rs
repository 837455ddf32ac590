//! Tool-calling rows: a `tools` column (the JSON schemas of the functions the model may call) and
//! messages with keys beyond `role` and `content` (an assistant turn's `tool_calls`, a tool
//! result's `name` / `tool_call_id`), handed to the chat template as transformers'
//! `apply_chat_template(messages, tools=tools)` gets them from TRL's `SFTTrainer`: a `tools` cell
//! holding JSON text is parsed (`json.loads`), a list is used as it is, null means no tools.
//!
//! The template writes tool schemas and call arguments with `tojson`, whose output follows the
//! order of each object's keys; rows are read into maps that sort their keys, so the cells these
//! come from are read again here from JSON files with their keys in file order (JSON text in a
//! cell keeps its order anyway). Objects inside Parquet cells keep the sorted order: write tools
//! and arguments there as JSON text, as Hub datasets do.

use std::collections::HashMap;
use std::path::Path;

use serde_json::Value;

use super::source::{Record, Table};
use crate::chat_template::ChatMessage;
use crate::error::{DataError, Result};

/// A template value from a cell read in order (or, without one, from the row's own value).
fn template_value(value: &Value) -> minijinja::Value {
    minijinja::Value::from_serialize(value)
}

/// The rows of JSON files parsed again with their objects' keys in file order, per file, by the
/// row's line (JSON Lines) or element number (a JSON list): [`Record::line`].
#[derive(Default)]
pub(crate) struct OrderedCells {
    field: Option<String>,
    files: HashMap<usize, Option<HashMap<usize, minijinja::Value>>>,
}

impl OrderedCells {
    /// For a table read with the dataset's `field` (the key of a JSON document's row list).
    pub fn new(field: Option<&str>) -> Self {
        Self {
            field: field.map(str::to_string),
            files: HashMap::new(),
        }
    }

    /// `column` of `record`, its objects' keys in file order when the row came from a JSON file,
    /// else as the table holds it. `None` when the row has no such cell.
    pub fn cell(
        &mut self,
        table: &Table,
        record: &Record,
        column: &str,
    ) -> Result<Option<minijinja::Value>> {
        let Some(value) = record.values.get(column) else {
            return Ok(None);
        };
        if !(value.is_object() || value.is_array()) {
            return Ok(Some(template_value(value)));
        }
        let field = self.field.clone();
        let rows = match self.files.get(&record.file) {
            Some(rows) => rows,
            None => {
                let rows = read_ordered(&table.files[record.file], field.as_deref())?;
                self.files.entry(record.file).or_insert(rows)
            }
        };
        let ordered = rows
            .as_ref()
            .and_then(|rows| rows.get(&record.line))
            .and_then(|row| row.get_attr(column).ok())
            .filter(|v| !v.is_undefined());
        Ok(Some(ordered.unwrap_or_else(|| template_value(value))))
    }
}

/// A JSON file's rows as template values with their keys in order, by line or element number;
/// `None` for a file that is not JSON.
fn read_ordered(
    path: &Path,
    field: Option<&str>,
) -> Result<Option<HashMap<usize, minijinja::Value>>> {
    let is_json = path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| ["json", "jsonl", "ndjson"].contains(&e.to_ascii_lowercase().as_str()));
    if !is_json {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| DataError::io(path, e, "dataset file"))?;
    let trimmed = text.trim_start_matches('\u{feff}').trim_start();
    let parse = |s: &str| -> Result<minijinja::Value> {
        serde_json::from_str(s).map_err(|source| DataError::Json {
            path: path.to_path_buf(),
            source,
        })
    };
    let list = |doc: minijinja::Value| -> HashMap<usize, minijinja::Value> {
        doc.try_iter()
            .map(|items| items.enumerate().map(|(i, row)| (i + 1, row)).collect())
            .unwrap_or_default()
    };
    let rows = if let Some(field) = field {
        list(parse(trimmed)?.get_attr(field).unwrap_or_default())
    } else if trimmed.starts_with('[') {
        list(parse(trimmed)?)
    } else {
        let mut rows = HashMap::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim_start_matches('\u{feff}');
            if !line.trim().is_empty() {
                rows.insert(i + 1, parse(line)?);
            }
        }
        rows
    };
    Ok(Some(rows))
}

/// The column of a table's tools: `given` (`tools_column`; it must exist), else `tools` when the
/// rows have it.
pub(crate) fn tools_column<'a>(given: Option<&'a str>, table: &Table) -> Result<Option<&'a str>> {
    match given {
        Some(column) => {
            table.require(column)?;
            Ok(Some(column))
        }
        None => Ok(table
            .columns
            .iter()
            .any(|c| c == "tools")
            .then_some("tools")),
    }
}

/// The tools of a row: its `column` cell as TRL's `SFTTrainer` passes it to the template (JSON
/// text parsed, a list as it is, null: none); each tool must be an object, as transformers
/// requires of a JSON schema.
pub(crate) fn row_tools(
    cells: &mut OrderedCells,
    table: &Table,
    record: &Record,
    column: &str,
) -> Result<Option<minijinja::Value>> {
    let bad = |what: String| {
        DataError::Dataset(format!(
            "{}: column '{column}' {what}",
            table.locate(record)
        ))
    };
    let tools = match record.values.get(column) {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(text)) => serde_json::from_str::<minijinja::Value>(text)
            .map_err(|e| bad(format!("holds text that is not JSON ({e})")))?,
        Some(Value::Array(_)) => cells.cell(table, record, column)?.expect("the cell exists"),
        Some(other) => {
            return Err(bad(format!(
                "must hold a list of tool schemas or its JSON text, got {other}"
            )))
        }
    };
    if tools.is_none() {
        return Ok(None);
    }
    let items = tools
        .try_iter()
        .ok()
        .filter(|_| tools.kind() == minijinja::value::ValueKind::Seq)
        .ok_or_else(|| bad(format!("must hold a list of tool schemas, got {tools}")))?;
    for (i, tool) in items.enumerate() {
        if tool.kind() != minijinja::value::ValueKind::Map {
            return Err(bad(format!(
                "tool {} must be a JSON schema (an object), got {tool}",
                i + 1
            )));
        }
    }
    Ok(Some(tools))
}

/// Whether any of a row's messages has a key beyond `role` and `content` (then the messages are
/// read in order and those keys filled in: [`fill_extra_keys`]).
pub(crate) fn any_extra_keys(turns: &[Value]) -> bool {
    turns.iter().any(|turn| {
        turn.as_object()
            .is_some_and(|m| m.keys().any(|k| k != "role" && k != "content"))
    })
}

/// Fills each message's keys beyond `role` and `content` (`tool_calls`, `name`,
/// `tool_call_id`, ...) from `ordered`, the row's list of messages read in order: `kept[i]` is
/// the index in that list of `messages[i]`.
pub(crate) fn fill_extra_keys(
    messages: &mut [ChatMessage],
    ordered: &minijinja::Value,
    kept: &[usize],
) -> Result<()> {
    for (message, &index) in messages.iter_mut().zip(kept) {
        let Ok(source) = ordered.get_item(&minijinja::Value::from(index)) else {
            continue;
        };
        let Ok(keys) = source.try_iter() else {
            continue;
        };
        for key in keys {
            let Some(name) = key.as_str() else { continue };
            if name == "role" || name == "content" {
                continue;
            }
            let value = source.get_item(&key).unwrap_or_default();
            message.extra.insert(name.to_string(), value);
        }
    }
    Ok(())
}
