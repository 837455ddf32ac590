//! `MLFlowLogger`: a run on an MLflow tracking server, through MLflow's documented REST API
//! (`/api/2.0/mlflow/...`), from Rust.
//!
//! Why not the `mlflow` Python client: MLflow's wire protocol is a small, stable, documented JSON
//! API (the Python client itself is a wrapper over it), so ferrotune needs no Python, no
//! interpreter in the training process and no package installed beside the binary; the endpoints
//! used are `experiments/get-by-name`, `experiments/create`, `runs/create`, `runs/log-batch`,
//! `runs/update` and, for artifacts, the server's artifact proxy (`mlflow-artifacts`). What this
//! leaves out is the Python client's local file store (`./mlruns` without a server): a tracking
//! URI must be a server (`http://` or `https://`).

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Map, Value};

use super::tracker::Backend;

/// Params per `runs/log-batch` request (MLflow's limit).
const PARAMS_PER_BATCH: usize = 100;

/// `MLFlowLogger`'s options, read from its config section and MLflow's environment variables.
pub(super) struct Mlflow {
    /// The server's base URL, without a trailing `/`.
    uri: Option<String>,
    experiment_name: Option<String>,
    run_id: Option<String>,
    run_name: Option<String>,
    /// The `Authorization` header (`MLFLOW_TRACKING_TOKEN`, or username and password).
    auth: Option<String>,
    http: Option<(tokio::runtime::Runtime, reqwest::Client)>,
    /// The run logged to, once started.
    run: Option<String>,
    /// The run's artifact root (`mlflow-artifacts:/...` when the server proxies artifacts).
    artifact_uri: Option<String>,
}

fn env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn opt_str(map: &Map<String, Value>, key: &str) -> Result<Option<String>> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => bail!("metric_logger.{key}: expected a string, got {other}"),
    }
}

impl Mlflow {
    /// The options of an `MLFlowLogger` section (`tracking_uri`, `experiment_name`, `run_id`,
    /// `run_name`), each falling back to MLflow's variable (`MLFLOW_TRACKING_URI`,
    /// `MLFLOW_EXPERIMENT_NAME`, `MLFLOW_RUN_ID`) as torchtune's logger does.
    pub(super) fn from_options(map: &Map<String, Value>) -> Result<Mlflow> {
        let uri = opt_str(map, "tracking_uri")?.or_else(|| env("MLFLOW_TRACKING_URI"));
        let auth = match (
            env("MLFLOW_TRACKING_TOKEN"),
            env("MLFLOW_TRACKING_USERNAME"),
        ) {
            (Some(token), _) => Some(format!("Bearer {token}")),
            (None, Some(user)) => {
                let pass = env("MLFLOW_TRACKING_PASSWORD").unwrap_or_default();
                Some(format!(
                    "Basic {}",
                    base64(format!("{user}:{pass}").as_bytes())
                ))
            }
            _ => None,
        };
        Ok(Mlflow {
            uri: uri.map(|u| u.trim_end_matches('/').to_string()),
            experiment_name: opt_str(map, "experiment_name")?
                .or_else(|| env("MLFLOW_EXPERIMENT_NAME")),
            run_id: opt_str(map, "run_id")?.or_else(|| env("MLFLOW_RUN_ID")),
            run_name: opt_str(map, "run_name")?,
            auth,
            http: None,
            run: None,
            artifact_uri: None,
        })
    }

    fn base(&self) -> Result<&str> {
        self.uri
            .as_deref()
            .ok_or_else(|| anyhow!("no tracking server"))
    }

    /// One request to `{uri}/api/2.0/{path}`: JSON in and out, non-2xx answers as errors (with
    /// MLflow's `error_code`), a connection error or a 5xx retried twice.
    fn call(&self, method: reqwest::Method, path: &str, body: Option<&Value>) -> Result<Value> {
        let (rt, client) = self.http.as_ref().ok_or_else(|| anyhow!("not started"))?;
        let url = format!("{}/api/2.0/{path}", self.base()?);
        let mut last = None;
        for attempt in 0..3u32 {
            if attempt > 0 {
                std::thread::sleep(Duration::from_millis(500 << attempt));
            }
            let mut req = client.request(method.clone(), &url);
            if let Some(b) = body {
                req = req
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(b.to_string());
            }
            if let Some(a) = &self.auth {
                req = req.header(reqwest::header::AUTHORIZATION, a);
            }
            // The current-thread runtime writes on this thread: a server that cut the
            // connection gives EPIPE, not SIGPIPE ending the run.
            let _no_sigpipe = ferrotune_core::sigpipe::SigpipeBlocked::new();
            let answer = rt.block_on(async {
                let resp = req.send().await?;
                let status = resp.status();
                Ok::<_, reqwest::Error>((status, resp.text().await?))
            });
            match answer {
                Ok((status, text)) if status.is_success() => {
                    return serde_json::from_str(&text)
                        .with_context(|| format!("{url}: not JSON: {text}"));
                }
                Ok((status, text)) => {
                    let e = anyhow!("{url}: {status}: {}", text.trim());
                    if !status.is_server_error() {
                        return Err(e);
                    }
                    last = Some(e);
                }
                Err(e) => last = Some(anyhow!("{url}: {}", with_causes(&e))),
            }
        }
        Err(last.unwrap_or_else(|| anyhow!("{url}: no answer")))
    }

    /// The id of the experiment named `name`, created if it does not exist.
    fn experiment_id(&self, name: &str) -> Result<String> {
        let by_name = |me: &Self| {
            me.call(
                reqwest::Method::GET,
                &format!(
                    "mlflow/experiments/get-by-name?experiment_name={}",
                    percent_encode(name)
                ),
                None,
            )
        };
        match by_name(self) {
            Ok(v) => id_of(&v["experiment"]["experiment_id"]),
            Err(e) if format!("{e}").contains("RESOURCE_DOES_NOT_EXIST") => {
                match self.call(
                    reqwest::Method::POST,
                    "mlflow/experiments/create",
                    Some(&json!({ "name": name })),
                ) {
                    Ok(v) => id_of(&v["experiment_id"]),
                    // Another process created it in between.
                    Err(e) if format!("{e}").contains("RESOURCE_ALREADY_EXISTS") => {
                        id_of(&by_name(self)?["experiment"]["experiment_id"])
                    }
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        }
    }

    fn log_batch(&self, body: Value) -> Result<()> {
        self.call(reqwest::Method::POST, "mlflow/runs/log-batch", Some(&body))
            .map(|_| ())
    }

    fn run_id(&self) -> Result<&str> {
        self.run.as_deref().ok_or_else(|| anyhow!("no run"))
    }
}

/// An error with its causes (`error sending request: ...: Connection refused`): reqwest's own
/// message leaves out why.
fn with_causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

fn id_of(v: &Value) -> Result<String> {
    v.as_str()
        .map(str::to_string)
        .ok_or_else(|| anyhow!("unexpected answer: no id in {v}"))
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Backend for Mlflow {
    fn start(&mut self) -> Result<String> {
        let base = match self.uri.as_deref() {
            Some(u) if u.starts_with("http://") || u.starts_with("https://") => u.to_string(),
            Some(u) => bail!(
                "tracking URI '{u}' is not a server: ferrotune talks to MLflow through its REST \
                 API, so the tracking URI must be http:// or https:// (start one with \
                 `mlflow server`)"
            ),
            None => bail!(
                "no tracking URI (metric_logger.tracking_uri or MLFLOW_TRACKING_URI); ferrotune \
                 talks to an MLflow server (`mlflow server`), not to a local ./mlruns store"
            ),
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("cannot start the HTTP client's runtime")?;
        let client = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .timeout(Duration::from_secs(60))
            .build()
            .context("cannot build the HTTP client")?;
        self.http = Some((rt, client));
        let experiment = match &self.experiment_name {
            Some(name) => self.experiment_id(name)?,
            None => "0".to_string(), // MLflow's "Default" experiment
        };
        match self.run_id.clone() {
            Some(id) => {
                let got = self.call(
                    reqwest::Method::GET,
                    &format!("mlflow/runs/get?run_id={}", percent_encode(&id)),
                    None,
                )?;
                self.artifact_uri = got["run"]["info"]["artifact_uri"]
                    .as_str()
                    .map(str::to_string);
                self.run = Some(id);
            }
            None => {
                let mut tags = vec![
                    json!({"key": "mlflow.source.name", "value": "ferrotune"}),
                    json!({"key": "mlflow.source.type", "value": "LOCAL"}),
                ];
                if let Some(user) = env("USER") {
                    tags.push(json!({"key": "mlflow.user", "value": user}));
                }
                let mut body = json!({
                    "experiment_id": experiment,
                    "start_time": now_ms(),
                    "tags": tags,
                });
                if let Some(name) = &self.run_name {
                    body["run_name"] = json!(name);
                }
                let made = self.call(reqwest::Method::POST, "mlflow/runs/create", Some(&body))?;
                let info = &made["run"]["info"];
                self.run = Some(id_of(&info["run_id"])?);
                self.artifact_uri = info["artifact_uri"].as_str().map(str::to_string);
            }
        }
        let experiment = self
            .experiment_name
            .as_deref()
            .map_or(String::new(), |n| format!(" of experiment '{n}'"));
        Ok(format!(
            "MLflow run {}{experiment} at {base}",
            self.run_id()?
        ))
    }

    fn config(&mut self, config: &Value) -> Result<usize> {
        let mut flat = Vec::new();
        flatten(config, "", &mut flat);
        let run = self.run_id()?.to_string();
        for chunk in flat.chunks(PARAMS_PER_BATCH) {
            let params: Vec<Value> = chunk
                .iter()
                .map(|(k, v)| json!({"key": k, "value": v}))
                .collect();
            self.log_batch(json!({"run_id": run, "params": params}))?;
        }
        Ok(flat.len())
    }

    fn step(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        let ts = now_ms();
        let metrics: Vec<Value> = metrics
            .iter()
            .map(|(k, v)| json!({"key": k, "value": proto_double(*v), "timestamp": ts, "step": step}))
            .collect();
        self.log_batch(json!({"run_id": self.run_id()?, "metrics": metrics}))
    }

    fn artifacts(&mut self, dir: &Path) -> Result<usize> {
        let root = self.artifact_uri.clone().unwrap_or_default();
        let Some(rest) = root.strip_prefix("mlflow-artifacts:") else {
            bail!(
                "the run's artifact root '{root}' is not served by the tracking server \
                 (mlflow-artifacts:): ferrotune uploads artifacts only through the server \
                 (`mlflow server` serves them by default)"
            );
        };
        // `mlflow-artifacts:/0/RUN/artifacts` or `mlflow-artifacts://host:port/0/RUN/artifacts`.
        let rest = match rest.strip_prefix("//") {
            Some(hosted) => hosted.split_once('/').map_or("", |(_, p)| p),
            None => rest.trim_start_matches('/'),
        };
        let folder = dir
            .file_name()
            .map_or("checkpoint".into(), |n| n.to_string_lossy().into_owned());
        let mut files = Vec::new();
        walk_files(dir, dir, &mut files)?;
        let (rt, client) = self.http.as_ref().ok_or_else(|| anyhow!("not started"))?;
        for rel in &files {
            let rel_url: Vec<String> = rel.split('/').map(percent_encode).collect();
            let url = format!(
                "{}/api/2.0/mlflow-artifacts/artifacts/{rest}/{}/{}",
                self.base()?,
                percent_encode(&folder),
                rel_url.join("/")
            );
            let bytes = std::fs::read(dir.join(rel))
                .with_context(|| format!("{}: cannot read", dir.join(rel).display()))?;
            let mut req = client.put(&url).body(bytes);
            if let Some(a) = &self.auth {
                req = req.header(reqwest::header::AUTHORIZATION, a);
            }
            let _no_sigpipe = ferrotune_core::sigpipe::SigpipeBlocked::new();
            let (status, text) = rt
                .block_on(async {
                    let resp = req.send().await?;
                    let status = resp.status();
                    Ok::<_, reqwest::Error>((status, resp.text().await?))
                })
                .map_err(|e| anyhow!("{url}: {}", with_causes(&e)))?;
            if !status.is_success() {
                bail!("{url}: {status}: {}", text.trim());
            }
        }
        Ok(files.len())
    }

    fn finish(&mut self) -> Result<()> {
        let body = json!({"run_id": self.run_id()?, "status": "FINISHED", "end_time": now_ms()});
        self.call(reqwest::Method::POST, "mlflow/runs/update", Some(&body))
            .map(|_| ())
    }
}

/// The files under `dir`, as `/`-separated paths relative to `root`, in name order.
fn walk_files(root: &Path, dir: &Path, out: &mut Vec<String>) -> Result<()> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("{}: cannot list", dir.display()))?
        .collect::<std::io::Result<_>>()?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = e.path();
        if e.file_type()?.is_dir() {
            walk_files(root, &path, out)?;
        } else {
            let rel = path.strip_prefix(root).unwrap_or(&path);
            let parts: Vec<String> = rel
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            out.push(parts.join("/"));
        }
    }
    Ok(())
}

/// A metric value as protobuf's JSON mapping writes a double: a number, or `"NaN"`,
/// `"Infinity"`, `"-Infinity"` (JSON has no literal for them).
fn proto_double(v: f64) -> Value {
    if v.is_nan() {
        json!("NaN")
    } else if v.is_infinite() {
        json!(if v > 0.0 { "Infinity" } else { "-Infinity" })
    } else {
        json!(v)
    }
}

/// torchtune's `flatten_dict(OmegaConf.to_container(config))` as MLflow's `log_params` stores
/// it: nested keys joined with `.`, each value as Python's `str()` writes it.
pub fn flatten(v: &Value, prefix: &str, out: &mut Vec<(String, String)>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                match v {
                    Value::Object(_) => flatten(v, &key, out),
                    _ => out.push((key, py_str(v))),
                }
            }
        }
        other => out.push((prefix.to_string(), py_str(other))),
    }
}

/// Python's `str(value)` of a YAML value: `True`, `None`, `0.0001`, `1e-05`, `['a', 'b']`.
pub fn py_str(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => py_repr(other),
    }
}

/// Python's `repr(value)`.
fn py_repr(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => i.to_string(),
            (_, Some(u), _) => u.to_string(),
            (_, _, Some(f)) => py_float(f),
            _ => n.to_string(),
        },
        Value::String(s) => {
            let quote = if s.contains('\'') && !s.contains('"') {
                '"'
            } else {
                '\''
            };
            let mut out = String::from(quote);
            for c in s.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '\n' => out.push_str("\\n"),
                    '\t' => out.push_str("\\t"),
                    '\r' => out.push_str("\\r"),
                    c if c == quote => {
                        out.push('\\');
                        out.push(c);
                    }
                    c => out.push(c),
                }
            }
            out.push(quote);
            out
        }
        Value::Array(items) => {
            let parts: Vec<String> = items.iter().map(py_repr).collect();
            format!("[{}]", parts.join(", "))
        }
        Value::Object(m) => {
            let parts: Vec<String> = m
                .iter()
                .map(|(k, v)| format!("{}: {}", py_repr(&Value::String(k.clone())), py_repr(v)))
                .collect();
            format!("{{{}}}", parts.join(", "))
        }
    }
}

/// Python's `repr(float)`: the shortest digits that read back, positional for exponents from -4
/// to 15, else `d.ddde-05`.
pub fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.into();
    }
    let sci = format!("{f:e}"); // shortest round-trip digits: "-1.5e-5", "1e0"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let s = format!("{f}");
        if s.contains('.') {
            s
        } else {
            format!("{s}.0")
        }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Standard base64 with padding (HTTP basic authentication).
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |acc, (i, &b)| acc | (b as u32) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_str_of_config_values() {
        assert_eq!(py_float(0.0001), "0.0001");
        assert_eq!(py_float(2e-5), "2e-05");
        assert_eq!(py_float(1.0), "1.0");
        assert_eq!(py_float(1e16), "1e+16");
        assert_eq!(py_float(-1.5e-7), "-1.5e-07");
        assert_eq!(py_str(&json!(["q_proj", "v_proj"])), "['q_proj', 'v_proj']");
        assert_eq!(py_str(&json!(null)), "None");
        assert_eq!(py_str(&json!(true)), "True");
        let mut flat = Vec::new();
        flatten(
            &json!({"a": {"b": 1, "c": {"d": "x"}}, "e": [1.5]}),
            "",
            &mut flat,
        );
        assert_eq!(
            flat,
            [
                ("a.b".into(), "1".into()),
                ("a.c.d".into(), "x".into()),
                ("e".into(), "[1.5]".into())
            ]
        );
    }

    #[test]
    fn encodings() {
        assert_eq!(base64(b"user:pass"), "dXNlcjpwYXNz");
        assert_eq!(base64(b"ab"), "YWI=");
        assert_eq!(percent_encode("my exp/1"), "my%20exp%2F1");
    }
}
