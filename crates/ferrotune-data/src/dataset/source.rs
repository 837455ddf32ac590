//! Where a dataset's rows come from: local JSON / CSV / Parquet / text files or a hub repository,
//! and which of them a `split` string (`train[:10%]`, `train+validation`) selects.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use super::builders::get_str;
use crate::error::{texts, DataError, Result};

/// File formats a dataset can be read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Format {
    Json,
    Csv,
    Parquet,
    Text,
}

impl Format {
    fn from_name(name: &str) -> Option<Format> {
        match name {
            "json" => Some(Format::Json),
            "csv" => Some(Format::Csv),
            "parquet" => Some(Format::Parquet),
            "text" => Some(Format::Text),
            _ => None,
        }
    }

    /// The format a file name's extension means, as HF `datasets` infers it.
    fn from_path(path: &Path) -> Option<Format> {
        let ext = path.extension()?.to_str()?.to_ascii_lowercase();
        match ext.as_str() {
            "json" | "jsonl" | "ndjson" => Some(Format::Json),
            "csv" => Some(Format::Csv),
            "parquet" => Some(Format::Parquet),
            "txt" | "text" => Some(Format::Text),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Format::Json => "json",
            Format::Csv => "csv",
            Format::Parquet => "parquet",
            Format::Text => "text",
        }
    }
}

/// One source row and where it came from (for error messages).
#[derive(Debug, Clone)]
pub(crate) struct Record {
    pub values: Map<String, Value>,
    /// Index into [`Table::files`].
    pub file: usize,
    /// 1-based line (JSON Lines, CSV, text) or element/row number (JSON array, Parquet).
    pub line: usize,
}

/// The rows of one split, in file order.
#[derive(Debug, Clone, Default)]
pub(crate) struct Table {
    pub files: Vec<PathBuf>,
    /// Column names, in order of first appearance.
    pub columns: Vec<String>,
    pub rows: Vec<Record>,
}

impl Table {
    /// Fails, naming the column, the files and the columns there are, unless `column` exists.
    pub fn require(&self, column: &str) -> Result<()> {
        if self.columns.iter().any(|c| c == column) {
            return Ok(());
        }
        Err(DataError::Dataset(format!(
            "column '{column}' not found in {} (its columns: {})",
            self.describe_files(),
            if self.columns.is_empty() {
                "none".to_string()
            } else {
                self.columns.join(", ")
            }
        )))
    }

    pub fn describe_files(&self) -> String {
        let names: Vec<String> = self.files.iter().map(|p| p.display().to_string()).collect();
        match names.len() {
            0 => "the dataset (no files)".into(),
            1 => names[0].clone(),
            _ => names.join(", "),
        }
    }

    /// "file:line" of a row, for error messages.
    pub fn locate(&self, record: &Record) -> String {
        format!("{}:{}", self.files[record.file].display(), record.line)
    }

    fn push_columns(&mut self, keys: impl IntoIterator<Item = String>) {
        for key in keys {
            if !self.columns.contains(&key) {
                self.columns.push(key);
            }
        }
    }
}

/// How rounding turns percent boundaries into row indices (HF `ReadInstruction`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rounding {
    /// `round(boundary * n / 100)`, ties to even (Python's `round`); HF's default.
    Closest,
    /// `boundary * trunc(n / 100)`; forbidden below 100 rows.
    Pct1DropRemainder,
}

/// One `+`-separated part of a split string, e.g. `train[10%:20%]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SplitPart {
    pub name: String,
    from: Option<i64>,
    to: Option<i64>,
    percent: bool,
    rounding: Rounding,
}

/// Parses an HF split string: `name`, `name[from:to]` with row counts or percents (negative =
/// from the end), an optional `(closest)` / `(pct1_dropremainder)` rounding, parts joined by `+`.
pub(crate) fn parse_split(spec: &str) -> Result<Vec<SplitPart>> {
    let bad = |why: &str| DataError::Dataset(format!("bad split '{spec}': {why}"));
    let mut parts = Vec::new();
    for raw in spec.split('+') {
        let raw = raw.trim();
        let (name_end, rest) = match raw.find(['[', '(']) {
            Some(i) => (i, &raw[i..]),
            None => (raw.len(), ""),
        };
        let name = &raw[..name_end];
        let name_ok = !name.is_empty()
            && name
                .split('.')
                .all(|w| !w.is_empty() && w.chars().all(|c| c.is_alphanumeric() || c == '_'));
        if !name_ok {
            return Err(bad(
                "expected a split name such as 'train', 'train[:100]' or 'train[10%:20%]'",
            ));
        }
        let (slice, rounding_text) = if let Some(body) = rest.strip_prefix('[') {
            let close = body
                .find(']')
                .ok_or_else(|| bad("missing ']' after the slice"))?;
            (Some(&body[..close]), &body[close + 1..])
        } else {
            (None, rest)
        };
        let rounding_name = if rounding_text.is_empty() {
            None
        } else {
            let inner = rounding_text
                .strip_prefix('(')
                .and_then(|r| r.strip_suffix(')'))
                .ok_or_else(|| bad("unexpected text after the slice"))?;
            Some(inner)
        };
        let (mut from, mut to, mut percent) = (None, None, false);
        if let Some(slice) = slice {
            let (a, b) = slice
                .split_once(':')
                .ok_or_else(|| bad("a slice needs ':' (e.g. 'train[:100]')"))?;
            let mut bound = |text: &str| -> Result<Option<i64>> {
                let text = text.trim();
                if text.is_empty() {
                    return Ok(None);
                }
                let (digits, pct) = match text.strip_suffix('%') {
                    Some(d) => (d, true),
                    None => (text, false),
                };
                percent |= pct;
                let body = digits.strip_prefix('-').unwrap_or(digits);
                if body.is_empty()
                    || !body.chars().all(|c| c.is_ascii_digit() || c == '_')
                    || body.starts_with('_')
                {
                    return Err(bad(&format!("'{text}' is not a row count or percent")));
                }
                digits
                    .replace('_', "")
                    .parse::<i64>()
                    .map(Some)
                    .map_err(|_| bad(&format!("'{text}' is out of range")))
            };
            from = bound(a)?;
            to = bound(b)?;
        }
        if percent {
            for v in [from, to].into_iter().flatten() {
                if v.abs() > 100 {
                    return Err(bad("percent boundaries must be between -100% and 100%"));
                }
            }
        }
        let rounding = match rounding_name {
            None => Rounding::Closest,
            Some(_) if !percent => {
                return Err(bad("a rounding can only be given with percent slicing"))
            }
            Some("closest") => Rounding::Closest,
            Some("pct1_dropremainder") => Rounding::Pct1DropRemainder,
            Some(other) => {
                return Err(bad(&format!(
                    "rounding '{other}' must be 'closest' or 'pct1_dropremainder'"
                )))
            }
        };
        parts.push(SplitPart {
            name: name.to_string(),
            from,
            to,
            percent,
            rounding,
        });
    }
    Ok(parts)
}

impl SplitPart {
    /// The rows of a split of `n` rows this part selects (HF `_rel_to_abs_instr`: boundaries
    /// clamped to `[0, n]`, an empty range when `from >= to`).
    pub fn range(&self, n: usize) -> Result<Range<usize>> {
        let n_i = n as i64;
        let abs = |b: i64| -> Result<i64> {
            if !self.percent {
                return Ok(b);
            }
            Ok(match self.rounding {
                // Python: int(round(boundary * n / 100.0)), round half to even.
                Rounding::Closest => ((b * n_i) as f64 / 100.0).round_ties_even() as i64,
                Rounding::Pct1DropRemainder => {
                    if n < 100 {
                        return Err(DataError::Dataset(format!(
                            "split '{}': pct1_dropremainder rounding on a split of {n} rows \
                             (< 100) always selects nothing",
                            self.name
                        )));
                    }
                    b * (n_i / 100)
                }
            })
        };
        let mut from = match self.from {
            Some(b) => abs(b)?,
            None => 0,
        };
        let mut to = match self.to {
            Some(b) => abs(b)?,
            None => n_i,
        };
        if from < 0 {
            from = (n_i + from).max(0);
        }
        if to < 0 {
            to = (n_i + to).max(0);
        }
        let from = from.min(n_i) as usize;
        let to = to.min(n_i) as usize;
        Ok(from..to.max(from))
    }
}

/// Resolves an HF split string against split sizes: for each `+` part, the split name and the
/// row range it selects. Unknown split names and malformed strings are errors.
pub fn resolve_split(
    spec: &str,
    sizes: &BTreeMap<String, usize>,
) -> Result<Vec<(String, Range<usize>)>> {
    parse_split(spec)?
        .into_iter()
        .map(|part| {
            let n = *sizes.get(&part.name).ok_or_else(|| {
                DataError::Dataset(format!(
                    "unknown split '{}' (available: {})",
                    part.name,
                    sizes.keys().cloned().collect::<Vec<_>>().join(", ")
                ))
            })?;
            Ok((part.name.clone(), part.range(n)?))
        })
        .collect()
}

/// Where the rows come from.
#[derive(Debug, Clone)]
pub(crate) enum Source {
    /// Local files per split name, each with its format.
    Local(BTreeMap<String, Vec<(PathBuf, Format)>>),
    /// A hub dataset repository (files fetched per split).
    Hub {
        repo: String,
        name: Option<String>,
        /// `data_dir`: only the repository's files under this folder.
        data_dir: Option<String>,
    },
}

fn as_str_list(value: &Value, key: &str) -> Result<Vec<String>> {
    match value {
        Value::String(s) => Ok(vec![s.clone()]),
        Value::Array(items) => texts(items, |v| {
            format!("dataset '{key}': entries must be paths, got {v}")
        }),
        other => Err(DataError::Dataset(format!(
            "dataset '{key}' must be a path or a list of paths, got {other}"
        ))),
    }
}

/// Matches `name` against a pattern with `*` (any run) and `?` (one character).
fn wildcard(pattern: &[char], name: &[char]) -> bool {
    match (pattern.first(), name.first()) {
        (None, None) => true,
        (Some('*'), _) => {
            wildcard(&pattern[1..], name) || (!name.is_empty() && wildcard(pattern, &name[1..]))
        }
        (Some('?'), Some(_)) => wildcard(&pattern[1..], &name[1..]),
        (Some(p), Some(n)) if p == n => wildcard(&pattern[1..], &name[1..]),
        _ => false,
    }
}

fn list_dir(dir: &Path) -> Result<Vec<PathBuf>> {
    let entries = std::fs::read_dir(dir).map_err(|e| DataError::io(dir, e, "dataset folder"))?;
    let mut files = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| DataError::io(dir, e, "dataset folder"))?;
        let path = entry.path();
        let hidden = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with('.') || n.starts_with('_'));
        if path.is_file() && !hidden {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// A local path of the config: `~/` is the home folder, a relative path is under `base_dir`.
fn local_path(entry: &str, base_dir: &Path) -> PathBuf {
    if let (Some(rest), Some(home)) = (entry.strip_prefix("~/"), std::env::var_os("HOME")) {
        return PathBuf::from(home).join(rest);
    }
    base_dir.join(entry)
}

/// Expands one `data_files` entry (a file, a folder, or a file-name wildcard) into files.
fn expand(entry: &str, base_dir: &Path, format: Option<Format>) -> Result<Vec<PathBuf>> {
    let path = local_path(entry, base_dir);
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
    if name.contains(['*', '?']) {
        let dir = path.parent().unwrap_or(base_dir);
        let pattern: Vec<char> = name.chars().collect();
        let files: Vec<PathBuf> = list_dir(dir)?
            .into_iter()
            .filter(|p| {
                let n: Vec<char> = p
                    .file_name()
                    .and_then(|n| n.to_str())
                    .unwrap_or("")
                    .chars()
                    .collect();
                wildcard(&pattern, &n)
            })
            .collect();
        if files.is_empty() {
            return Err(DataError::Dataset(format!(
                "dataset data_files '{entry}': no file matches {}",
                path.display()
            )));
        }
        return Ok(files);
    }
    if path.is_dir() {
        let files: Vec<PathBuf> = list_dir(&path)?
            .into_iter()
            .filter(|p| match format {
                Some(f) => Format::from_path(p) == Some(f),
                None => Format::from_path(p).is_some(),
            })
            .collect();
        if files.is_empty() {
            return Err(DataError::Dataset(format!(
                "dataset folder {} holds no {} files",
                path.display(),
                format.map_or("data (.json/.jsonl/.csv/.parquet/.txt)", Format::name)
            )));
        }
        return Ok(files);
    }
    if !path.exists() {
        return Err(DataError::NotFound {
            path,
            what: "a dataset file",
        });
    }
    Ok(vec![path])
}

fn with_format(files: Vec<PathBuf>, format: Option<Format>) -> Result<Vec<(PathBuf, Format)>> {
    files
        .into_iter()
        .map(|p| {
            let f = match format {
                Some(f) => f,
                None => Format::from_path(&p).ok_or_else(|| {
                    DataError::Dataset(format!(
                        "{}: cannot tell the dataset format from the extension (use .json, \
                         .jsonl, .csv, .parquet or .txt, or set source to the format name)",
                        p.display()
                    ))
                })?,
            };
            Ok((p, f))
        })
        .collect()
}

/// The split a file of a dataset folder belongs to, from its name (HF's split-in-file-name
/// convention: `train*.jsonl`, `test-00000.parquet`, `validation.csv`, `dev.json`, ...).
fn split_of_file_name(path: &Path) -> Option<&'static str> {
    let stem = path.file_name()?.to_str()?.to_ascii_lowercase();
    let words: Vec<&str> = stem
        .split(|c: char| "-._ ".contains(c) || c.is_ascii_digit())
        .collect();
    let first = *words.first()?;
    match first {
        "train" | "training" => Some("train"),
        "validation" | "valid" | "val" | "dev" | "eval" => Some("validation"),
        "test" | "testing" => Some("test"),
        _ => None,
    }
}

/// Decides where a dataset section's rows come from.
pub(crate) fn resolve_source(section: &Map<String, Value>, base_dir: &Path) -> Result<Source> {
    let source = match section.get("source") {
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            return Err(DataError::Dataset(format!(
                "dataset 'source' must be a string, got {other}"
            )))
        }
        None => return Err(DataError::Dataset("dataset 'source' is missing".into())),
    };
    if source == "arrow" {
        return Err(DataError::Unsupported(
            "dataset source 'arrow' is not supported: convert the data to parquet or JSON Lines"
                .into(),
        ));
    }
    if let Some(format) = Format::from_name(&source) {
        let data_files = section.get("data_files").ok_or_else(|| {
            DataError::Dataset(format!(
                "dataset source '{source}' needs 'data_files' (a file, a folder, a list, or a \
                 mapping of split names to files)"
            ))
        })?;
        let mut splits = BTreeMap::new();
        match data_files {
            Value::Object(map) => {
                for (split, entries) in map {
                    let mut files = Vec::new();
                    for entry in as_str_list(entries, "data_files")? {
                        files.extend(expand(&entry, base_dir, Some(format))?);
                    }
                    splits.insert(split.clone(), with_format(files, Some(format))?);
                }
            }
            other => {
                let mut files = Vec::new();
                for entry in as_str_list(other, "data_files")? {
                    files.extend(expand(&entry, base_dir, Some(format))?);
                }
                splits.insert("train".to_string(), with_format(files, Some(format))?);
            }
        }
        return Ok(Source::Local(splits));
    }
    let local = local_path(&source, base_dir);
    let looks_local = local.exists()
        || source.starts_with(['.', '/', '~'])
        || Format::from_path(Path::new(&source)).is_some();
    if looks_local {
        if local.is_dir() {
            let files = with_format(expand(&source, base_dir, None)?, None)?;
            let formats: Vec<Format> = files.iter().map(|(_, f)| *f).collect();
            if formats.windows(2).any(|w| w[0] != w[1]) {
                return Err(DataError::Dataset(format!(
                    "dataset folder {} mixes file formats; set source to the format name and \
                     list data_files",
                    local.display()
                )));
            }
            let mut splits: BTreeMap<String, Vec<(PathBuf, Format)>> = BTreeMap::new();
            if files.iter().any(|(p, _)| split_of_file_name(p).is_some()) {
                for (p, f) in files {
                    // Files whose names name no split are ignored, as HF does once any does.
                    if let Some(split) = split_of_file_name(&p) {
                        splits.entry(split.to_string()).or_default().push((p, f));
                    }
                }
            } else {
                splits.insert("train".into(), files);
            }
            return Ok(Source::Local(splits));
        }
        let files = with_format(expand(&source, base_dir, None)?, None)?;
        return Ok(Source::Local(BTreeMap::from([(
            "train".to_string(),
            files,
        )])));
    }
    let name = get_str(section, "name")?.map(str::to_string);
    let data_dir = get_str(section, "data_dir")?.map(str::to_string);
    Ok(Source::Hub {
        repo: source,
        name,
        data_dir,
    })
}

/// Loads the rows a split string selects from `source`. `field` is the JSON key holding the rows
/// of a top-level JSON object (HF's `field`).
pub(crate) fn load_split(source: &Source, split: &str, field: Option<&str>) -> Result<Table> {
    let parts = parse_split(split)?;
    let mut out = Table::default();
    for part in parts {
        let files: Vec<(PathBuf, Format)> = match source {
            Source::Local(splits) => splits
                .get(&part.name)
                .ok_or_else(|| {
                    DataError::Dataset(format!(
                        "unknown split '{}' (available: {})",
                        part.name,
                        splits.keys().cloned().collect::<Vec<_>>().join(", ")
                    ))
                })?
                .clone(),
            Source::Hub {
                repo,
                name,
                data_dir,
            } => {
                let files = crate::hub::dataset_files_in(
                    repo,
                    name.as_deref(),
                    data_dir.as_deref(),
                    &part.name,
                )?;
                with_format(files, None)?
            }
        };
        let table = load_files(&files, field)?;
        let range = part.range(table.rows.len())?;
        let offset = out.files.len();
        out.files.extend(table.files);
        out.push_columns(table.columns);
        out.rows
            .extend(table.rows[range].iter().cloned().map(|mut r| {
                r.file += offset;
                r
            }));
    }
    Ok(out)
}

/// Reads and concatenates files.
pub(crate) fn load_files(files: &[(PathBuf, Format)], field: Option<&str>) -> Result<Table> {
    let mut table = Table::default();
    for (i, (path, format)) in files.iter().enumerate() {
        table.files.push(path.clone());
        let (columns, rows) = match format {
            Format::Json => read_json(path, field)?,
            Format::Csv => read_csv(path)?,
            Format::Parquet => read_parquet(path)?,
            Format::Text => read_text(path)?,
        };
        table.push_columns(columns);
        table
            .rows
            .extend(rows.into_iter().map(|(line, values)| Record {
                values,
                file: i,
                line,
            }));
    }
    Ok(table)
}

type Rows = (Vec<String>, Vec<(usize, Map<String, Value>)>);

fn read_to_string(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| DataError::io(path, e, "a dataset file"))
}

fn keys_in_order(rows: &[(usize, Map<String, Value>)]) -> Vec<String> {
    let mut columns: Vec<String> = Vec::new();
    for (_, row) in rows {
        for key in row.keys() {
            if !columns.contains(key) {
                columns.push(key.clone());
            }
        }
    }
    columns
}

fn object_rows(path: &Path, items: Vec<Value>) -> Result<Vec<(usize, Map<String, Value>)>> {
    items
        .into_iter()
        .enumerate()
        .map(|(i, v)| match v {
            Value::Object(map) => Ok((i + 1, map)),
            other => Err(DataError::invalid_data(
                path,
                i + 1,
                format!("row {} is not a JSON object: {other}", i + 1),
            )),
        })
        .collect()
}

/// JSON as HF `load_dataset("json")` reads it: a top-level array of objects, a top-level object
/// whose `field` holds that array, or JSON Lines (one object per line, blank lines skipped).
fn read_json(path: &Path, field: Option<&str>) -> Result<Rows> {
    let text = read_to_string(path)?;
    let trimmed = text.trim_start_matches('\u{feff}').trim_start();
    let rows = if let Some(field) = field {
        let doc: Value = serde_json::from_str(trimmed).map_err(|source| DataError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        match doc.get(field) {
            Some(Value::Array(items)) => object_rows(path, items.clone())?,
            Some(_) => {
                return Err(DataError::Dataset(format!(
                    "{}: JSON key '{field}' (dataset 'field') does not hold a list of rows",
                    path.display()
                )))
            }
            None => {
                return Err(DataError::Dataset(format!(
                    "{}: the JSON document has no key '{field}' (dataset 'field')",
                    path.display()
                )))
            }
        }
    } else if trimmed.starts_with('[') {
        let doc: Vec<Value> = serde_json::from_str(trimmed).map_err(|source| DataError::Json {
            path: path.to_path_buf(),
            source,
        })?;
        object_rows(path, doc)?
    } else {
        let mut rows = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.trim_start_matches('\u{feff}');
            if line.trim().is_empty() {
                continue;
            }
            let bad = |message: String| DataError::invalid_data(path, i + 1, message);
            match serde_json::from_str::<Value>(line) {
                Ok(Value::Object(map)) => rows.push((i + 1, map)),
                Ok(_) => return Err(bad("a JSON Lines row must be a JSON object".into())),
                Err(e) => {
                    return Err(bad(format!(
                        "not valid JSON Lines ({e}); a JSON file must be JSON Lines, a list of \
                         objects, or an object with the list under dataset 'field'"
                    )))
                }
            }
        }
        rows
    };
    Ok((keys_in_order(&rows), rows))
}

/// CSV with a header row; every value is text, an empty field is null.
fn read_csv(path: &Path) -> Result<Rows> {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(true)
        .from_path(path)
        .map_err(|e| csv_error(path, e))?;
    let headers: Vec<String> = reader
        .headers()
        .map_err(|e| csv_error(path, e))?
        .iter()
        .map(str::to_string)
        .collect();
    let mut rows = Vec::new();
    for record in reader.records() {
        let record = record.map_err(|e| csv_error(path, e))?;
        // The csv crate counts the line breaks before a record: its first line is one more.
        let line = record.position().map_or(0, |p| p.line() as usize + 1);
        let map: Map<String, Value> = headers
            .iter()
            .cloned()
            .zip(record.iter().map(|v| {
                // An empty field is a missing value, as HF's CSV reader (pandas) reads it.
                if v.is_empty() {
                    Value::Null
                } else {
                    Value::String(v.to_string())
                }
            }))
            .collect();
        rows.push((line, map));
    }
    Ok((headers, rows))
}

fn csv_error(path: &Path, e: csv::Error) -> DataError {
    if let csv::ErrorKind::Io(io) = e.kind() {
        let io = std::io::Error::new(io.kind(), io.to_string());
        return DataError::io(path, io, "a dataset file");
    }
    let line = e.position().map_or(0, |p| p.line() as usize);
    DataError::invalid_data(path, line, format!("bad CSV: {e}"))
}

/// Every line is a row `{"text": line}` (HF's `text` builder, line breaks removed).
fn read_text(path: &Path) -> Result<Rows> {
    let text = read_to_string(path)?;
    let rows = text
        .lines()
        .enumerate()
        .map(|(i, line)| {
            let mut map = Map::new();
            map.insert("text".into(), Value::String(line.to_string()));
            (i + 1, map)
        })
        .collect();
    Ok((vec!["text".into()], rows))
}

fn parquet_error(path: &Path, e: impl std::fmt::Display) -> DataError {
    DataError::Dataset(format!("{}: cannot read parquet: {e}", path.display()))
}

fn parquet_value(field: &parquet::record::Field) -> Value {
    use parquet::record::Field;
    let num = |f: f64| {
        serde_json::Number::from_f64(f)
            .map(Value::Number)
            .unwrap_or(Value::Null)
    };
    match field {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Byte(n) => (*n).into(),
        Field::Short(n) => (*n).into(),
        Field::Int(n) => (*n).into(),
        Field::Long(n) => (*n).into(),
        Field::UByte(n) => (*n).into(),
        Field::UShort(n) => (*n).into(),
        Field::UInt(n) => (*n).into(),
        Field::ULong(n) => (*n).into(),
        Field::Float16(n) => num(f64::from(*n)),
        Field::Float(n) => num(f64::from(*n)),
        Field::Double(n) => num(*n),
        Field::Str(s) => Value::String(s.clone()),
        Field::Bytes(b) => match std::str::from_utf8(b.data()) {
            Ok(s) => Value::String(s.to_string()),
            Err(_) => Value::Array(b.data().iter().map(|&x| x.into()).collect()),
        },
        Field::Group(row) => Value::Object(
            row.get_column_iter()
                .map(|(k, v)| (k.clone(), parquet_value(v)))
                .collect(),
        ),
        Field::ListInternal(list) => {
            Value::Array(list.elements().iter().map(parquet_value).collect())
        }
        Field::MapInternal(map) => Value::Array(
            map.entries()
                .iter()
                .map(|(k, v)| Value::Array(vec![parquet_value(k), parquet_value(v)]))
                .collect(),
        ),
        // Dates, times and decimals: their display text (not used as prompt columns in practice).
        other => Value::String(other.to_string()),
    }
}

/// Parquet through the record API: strings, integers, floats, booleans, lists, structs, nulls.
fn read_parquet(path: &Path) -> Result<Rows> {
    use parquet::file::reader::{FileReader, SerializedFileReader};
    let file = std::fs::File::open(path).map_err(|e| DataError::io(path, e, "a dataset file"))?;
    let reader = SerializedFileReader::new(file).map_err(|e| parquet_error(path, e))?;
    let columns: Vec<String> = reader
        .metadata()
        .file_metadata()
        .schema_descr()
        .root_schema()
        .get_fields()
        .iter()
        .map(|f| f.name().to_string())
        .collect();
    let mut rows = Vec::new();
    for (i, row) in reader
        .get_row_iter(None)
        .map_err(|e| parquet_error(path, e))?
        .enumerate()
    {
        let row = row.map_err(|e| parquet_error(path, e))?;
        let map: Map<String, Value> = row
            .get_column_iter()
            .map(|(k, v)| (k.clone(), parquet_value(v)))
            .collect();
        rows.push((i + 1, map));
    }
    Ok((columns, rows))
}
