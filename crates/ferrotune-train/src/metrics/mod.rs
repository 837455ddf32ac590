//! Metric loggers chosen by a recipe config's `metric_logger` section, as torchtune's
//! `torchtune.training.metric_logging` does: `DiskLogger` (one JSON object per line in
//! `{log_dir}/metrics.jsonl`), `StdoutLogger` (`Step 3 | loss:1.2300 lr:0.0003 ...`),
//! `TensorBoardLogger` (a real `events.out.tfevents.*` file that TensorBoard reads), and the
//! experiment trackers `MLFlowLogger` (an MLflow server, through its REST API: [`mlflow`]),
//! `WandBLogger` and `CometLogger` (the official `wandb` and `comet_ml` clients, through a Python
//! bridge: `bridge.rs` says why). A tracker always has the JSONL log written beside it, in its `log_dir`,
//! and runs on its own thread: one that cannot be reached warns once and the run goes on; what it
//! missed is counted and reported when the log closes ([`TrackerReport`]).
//!
//! Every logged step is written with one `write` call and no user-space buffer, so a run killed
//! with `kill -9` loses at most the line (or event) being written. A run resumed from a checkpoint
//! at step `S` calls [`MetricLogger::truncate_after`]`(S)` so its log matches an uninterrupted
//! run step for step; a fresh run that reuses an output folder calls `truncate_after(0)`. A run's
//! JSONL lines carry its run id ([`MetricLogger::set_run_id`]), and a resume drops other runs'.

mod bridge;
pub mod mlflow;
mod tracker;

pub use tracker::TrackerReport;

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{Map, Value};

use tracker::Tracker;

/// The JSONL file a `DiskLogger` writes in its `log_dir` unless the config names another.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// Module paths under which torchtune has published its metric loggers; a bare class name is
/// accepted too.
const COMPONENT_PREFIXES: &[&str] = &[
    "torchtune.training.metric_logging.",
    "torchtune.utils.metric_logging.",
];

/// A metric logger built from a recipe's `metric_logger` config section.
#[derive(Debug)]
pub struct MetricLogger {
    sink: Sink,
    closed: bool,
    /// The experiment tracker beside the JSONL log (`MLFlowLogger`, `WandBLogger`,
    /// `CometLogger`).
    tracker: Option<Tracker>,
    /// Whether the final checkpoint folder goes to the tracker (`MLFlowLogger`'s
    /// `log_checkpoint`).
    log_checkpoint: bool,
    /// What the tracker took, once the log closed.
    report: Option<TrackerReport>,
}

#[derive(Debug)]
enum Sink {
    Disk(DiskLogger),
    Stdout(StdoutLogger),
    TensorBoard(TensorBoardLogger),
}

/// The `metric_logger` section's mapping and logger class (`DiskLogger`, `StdoutLogger`,
/// `TensorBoardLogger`, `MLFlowLogger`, `WandBLogger`, `CometLogger`), after checking the
/// component and that every key is one of its options.
fn logger_class(section: &Value) -> Result<(&Map<String, Value>, &str)> {
    let map = section
        .as_object()
        .ok_or_else(|| anyhow!("metric_logger: expected a mapping, got {section}"))?;
    let component = match map.get("_component_") {
            Some(Value::String(s)) => s.as_str(),
            Some(other) => bail!("metric_logger._component_: expected a string, got {other}"),
            None => bail!("metric_logger: missing _component_ (e.g. torchtune.training.metric_logging.DiskLogger)"),
        };
    let class = COMPONENT_PREFIXES
        .iter()
        .find_map(|p| component.strip_prefix(p))
        .unwrap_or(component);
    let allowed: &[&str] = match class {
        "DiskLogger" => &["log_dir", "filename"],
        "TensorBoardLogger" => &["log_dir", "organize_logs"],
        // `log_dir` is tolerated so switching a config's component from DiskLogger just works.
        "StdoutLogger" => &["log_dir"],
        // torchtune's options; `log_dir` is where the JSONL log goes beside the tracker.
        "MLFlowLogger" => &[
            "log_dir",
            "experiment_name",
            "tracking_uri",
            "run_id",
            "run_name",
            "log_checkpoint",
        ],
        // torchtune's four, and the `wandb.init` arguments its `**kwargs` pass on.
        "WandBLogger" => &[
            "log_dir",
            "project",
            "entity",
            "group",
            "name",
            "dir",
            "tags",
            "notes",
            "job_type",
            "mode",
            "id",
            "resume",
            "allow_val_change",
            "save_code",
        ],
        "CometLogger" => &[
            "log_dir",
            "api_key",
            "workspace",
            "project",
            "experiment_key",
            "mode",
            "online",
            "experiment_name",
            "tags",
            "log_code",
        ],
        _ => bail!(
            "metric_logger._component_: unknown logger '{component}'; expected DiskLogger, \
                 StdoutLogger, TensorBoardLogger, MLFlowLogger, WandBLogger or CometLogger \
                 (torchtune.training.metric_logging.*)"
        ),
    };
    if let Some(key) = map
        .keys()
        .find(|k| *k != "_component_" && !allowed.contains(&k.as_str()))
    {
        bail!(
            "metric_logger.{key}: not an option of {class} (options: {})",
            allowed.join(", ")
        );
    }
    Ok((map, class))
}

/// Checks a `metric_logger` section without creating anything (`ferrotune validate`).
pub fn check_logger_config(section: Option<&Value>) -> Result<()> {
    let Some(section) = section else {
        return Ok(());
    };
    let (map, class) = logger_class(section)?;
    tracker_options(map, class, Path::new("logs")).map(|_| ())
}

/// The tracker a tracker class's options describe (`None` for the local loggers), its
/// options' types checked; `log_dir` is the folder of the JSONL log beside it.
fn tracker_options(
    map: &Map<String, Value>,
    class: &str,
    log_dir: &Path,
) -> Result<Option<(&'static str, Box<dyn tracker::Backend>)>> {
    let mut options = map.clone();
    options.remove("_component_");
    let client = match class {
        "MLFlowLogger" => {
            let run = mlflow::Mlflow::from_options(map)?;
            flag(map, "log_checkpoint")?;
            return Ok(Some(("MLFlowLogger", Box::new(run))));
        }
        "WandBLogger" => bridge::Client::Wandb,
        "CometLogger" => bridge::Client::Comet,
        _ => return Ok(None),
    };
    for (key, value) in &options {
        let fine = match key.as_str() {
            "tags" => matches!(value, Value::Array(_) | Value::String(_) | Value::Null),
            "allow_val_change" | "save_code" | "log_code" | "online" => {
                matches!(value, Value::Bool(_) | Value::Null)
            }
            // wandb's `resume`: true, false or "allow", "must", "never", "auto".
            "resume" => matches!(value, Value::Bool(_) | Value::String(_) | Value::Null),
            _ => matches!(value, Value::String(_) | Value::Null),
        };
        if !fine {
            bail!("metric_logger.{key}: unexpected value {value}");
        }
    }
    // A single tag, as the config's `StrList` type allows, is a list of one for the clients.
    if let Some(Value::String(tag)) = options.get("tags") {
        let one = Value::Array(vec![Value::String(tag.clone())]);
        options.insert("tags".into(), one);
    }
    options.insert(
        "log_dir".into(),
        Value::String(log_dir.display().to_string()),
    );
    let name = match client {
        bridge::Client::Wandb => "WandBLogger",
        bridge::Client::Comet => "CometLogger",
    };
    Ok(Some((name, Box::new(bridge::Bridge::new(client, options)))))
}

/// A boolean option, `false` when absent.
fn flag(map: &Map<String, Value>, key: &str) -> Result<bool> {
    match map.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(other) => bail!("metric_logger.{key}: expected true or false, got {other}"),
    }
}

/// Where a `metric_logger` section sends its lines.
enum LogTarget {
    /// A `DiskLogger`'s JSONL file.
    Disk(PathBuf),
    /// A `TensorBoardLogger`'s folder, and whether each run gets its own subfolder.
    TensorBoard { log_dir: PathBuf, organize: bool },
    /// The terminal.
    Stdout,
    /// An experiment tracker, with the JSONL file written beside it.
    Tracker {
        jsonl: PathBuf,
        class: String,
        map: Map<String, Value>,
    },
}

impl LogTarget {
    /// The target of `section` (`None`: a `DiskLogger` in `{output_dir}/logs`).
    fn of(section: Option<&Value>, output_dir: &Path) -> Result<LogTarget> {
        let default_dir = output_dir.join("logs");
        let Some(section) = section else {
            return Ok(LogTarget::Disk(default_dir.join(METRICS_FILE)));
        };
        let (map, class) = logger_class(section)?;
        let log_dir = match map.get("log_dir") {
            None | Some(Value::Null) => default_dir,
            Some(Value::String(s)) if s.contains("${") => {
                bail!("metric_logger.log_dir: unresolved interpolation in '{s}'")
            }
            Some(Value::String(s)) => PathBuf::from(s),
            Some(other) => bail!("metric_logger.log_dir: expected a path string, got {other}"),
        };
        Ok(match class {
            "DiskLogger" => {
                let filename = match map.get("filename") {
                    None | Some(Value::Null) => METRICS_FILE.to_string(),
                    Some(Value::String(s)) if !s.is_empty() => s.clone(),
                    Some(other) => {
                        bail!("metric_logger.filename: expected a file name, got {other}")
                    }
                };
                LogTarget::Disk(log_dir.join(filename))
            }
            "TensorBoardLogger" => {
                let organize = match map.get("organize_logs") {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(b)) => *b,
                    Some(other) => {
                        bail!("metric_logger.organize_logs: expected true or false, got {other}")
                    }
                };
                LogTarget::TensorBoard { log_dir, organize }
            }
            "StdoutLogger" => LogTarget::Stdout,
            _ => LogTarget::Tracker {
                jsonl: log_dir.join(METRICS_FILE),
                class: class.to_string(),
                map: map.clone(),
            },
        })
    }
}

impl MetricLogger {
    /// Builds the logger named by `section["_component_"]`.
    ///
    /// `section` is the config's `metric_logger` mapping with `${output_dir}` already resolved;
    /// `None` means a `DiskLogger` in `{output_dir}/logs`. Keys: `log_dir` (DiskLogger and
    /// TensorBoardLogger; default `{output_dir}/logs`), `filename` (DiskLogger; default
    /// `metrics.jsonl`), `organize_logs` (TensorBoardLogger; default `true`, as in torchtune: each
    /// run writes into its own `run_0_{unix_time}` subfolder of `log_dir`). The trackers
    /// (`MLFlowLogger`, `WandBLogger`, `CometLogger`) take torchtune's options and write
    /// `{log_dir}/metrics.jsonl` beside the tracker; their thread starts here, connecting
    /// happens on it.
    pub fn from_config(section: Option<&Value>, output_dir: &Path) -> Result<MetricLogger> {
        let mut tracker = None;
        let mut log_checkpoint = false;
        let sink = match LogTarget::of(section, output_dir)? {
            LogTarget::Tracker { jsonl, class, map } => {
                let log_dir = jsonl.parent().unwrap_or(output_dir);
                let (name, backend) = tracker_options(&map, &class, log_dir)?
                    .ok_or_else(|| anyhow!("metric_logger: {class} is not a tracker"))?;
                log_checkpoint = flag(&map, "log_checkpoint")?;
                let disk = DiskLogger::create(&jsonl)?;
                tracker = Some(Tracker::start(name, backend)?);
                Sink::Disk(disk)
            }
            LogTarget::Disk(file) => Sink::Disk(DiskLogger::create(&file)?),
            LogTarget::TensorBoard { log_dir, organize } => {
                let dir = if organize {
                    // torchtune's `run_{rank}_{time.time()}`: one TensorBoard run per training run.
                    log_dir.join(format!("run_0_{:.6}", unix_time()))
                } else {
                    log_dir
                };
                Sink::TensorBoard(TensorBoardLogger::create(&dir)?)
            }
            LogTarget::Stdout => Sink::Stdout(StdoutLogger),
        };
        let mut logger = MetricLogger::new(sink);
        logger.tracker = tracker;
        logger.log_checkpoint = log_checkpoint;
        Ok(logger)
    }

    /// The JSONL file [`MetricLogger::from_config`] would write for `section` (a `DiskLogger`'s
    /// or a tracker's), without creating anything; `None` for the other loggers.
    pub fn file_for(section: Option<&Value>, output_dir: &Path) -> Result<Option<PathBuf>> {
        Ok(match LogTarget::of(section, output_dir)? {
            LogTarget::Disk(file) | LogTarget::Tracker { jsonl: file, .. } => Some(file),
            _ => None,
        })
    }

    /// Tags every line logged from now on with `run_id` (the JSONL logger's `"run_id"` key), and
    /// makes [`MetricLogger::truncate_after`] drop the lines of other runs.
    pub fn set_run_id(&mut self, run_id: &str) {
        if let Sink::Disk(d) = &mut self.sink {
            d.run_id = Some(run_id.to_string()).filter(|id| !id.is_empty());
        }
    }

    fn new(sink: Sink) -> MetricLogger {
        MetricLogger {
            sink,
            closed: false,
            tracker: None,
            log_checkpoint: false,
            report: None,
        }
    }

    /// A logger that writes JSONL to `path` (see [`DiskLogger`]).
    pub fn disk(path: &Path) -> Result<MetricLogger> {
        Ok(MetricLogger::new(Sink::Disk(DiskLogger::create(path)?)))
    }

    /// A logger that prints to stdout (see [`StdoutLogger`]).
    pub fn stdout() -> MetricLogger {
        MetricLogger::new(Sink::Stdout(StdoutLogger))
    }

    /// A logger that writes a TensorBoard event file into `dir` (see [`TensorBoardLogger`]).
    pub fn tensorboard(dir: &Path) -> Result<MetricLogger> {
        Ok(MetricLogger::new(Sink::TensorBoard(
            TensorBoardLogger::create(dir)?,
        )))
    }

    /// The file this logger writes (`None` for stdout).
    pub fn path(&self) -> Option<&Path> {
        match &self.sink {
            Sink::Disk(d) => Some(d.path()),
            Sink::TensorBoard(t) => Some(t.path()),
            Sink::Stdout(_) => None,
        }
    }

    /// The logger's torchtune class name: `DiskLogger`, `StdoutLogger`, `TensorBoardLogger`, or
    /// the tracker's (`MLFlowLogger`, `WandBLogger`, `CometLogger`).
    pub fn kind(&self) -> &'static str {
        if let Some(t) = &self.tracker {
            return t.name();
        }
        match &self.sink {
            Sink::Disk(_) => "DiskLogger",
            Sink::Stdout(_) => "StdoutLogger",
            Sink::TensorBoard(_) => "TensorBoardLogger",
        }
    }

    /// Logs one step's metrics, in the given order (e.g. `epoch`, `loss`, `lr`,
    /// `tokens_per_second`, `peak_memory_*`), and makes it durable against a crash of this
    /// process before returning.
    pub fn log_step(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<()> {
        if self.closed {
            bail!("metric logger: log_step({step}) after close");
        }
        if let Some((k, _)) = metrics.iter().find(|(k, _)| *k == "step") {
            bail!("metric logger: '{k}' is passed as the step argument, not as a metric");
        }
        match &mut self.sink {
            Sink::Disk(d) => d.log_step(step, metrics),
            Sink::Stdout(s) => s.log_step(step, metrics),
            Sink::TensorBoard(t) => t.log_step(step, metrics),
        }?;
        // The JSONL line is written first: the tracker gets what the log already holds.
        if let Some(t) = &self.tracker {
            t.step(step, metrics);
        }
        Ok(())
    }

    /// Hands the resolved config to the tracker (its params, run config or parameters, as
    /// torchtune's `log_config`); the local loggers ignore it (the run folder's `config.yaml`
    /// holds it).
    pub fn log_config(&mut self, config: &Value) {
        if let Some(t) = &self.tracker {
            t.config(config);
        }
    }

    /// Hands the final checkpoint folder to the tracker as the run's artifacts, when the config
    /// asks for it (`MLFlowLogger`'s `log_checkpoint: true`); otherwise does nothing.
    pub fn log_checkpoint(&mut self, dir: &Path) {
        if let (Some(t), true) = (&self.tracker, self.log_checkpoint) {
            t.artifacts(dir.to_path_buf());
        }
    }

    /// What the tracker took of the run, once the log is closed (`None` without a tracker).
    pub fn tracker_report(&self) -> Option<&TrackerReport> {
        self.report.as_ref()
    }

    /// Ends the tracker's run, waits for it and prints what it took (or missed).
    fn finish_tracker(&mut self) {
        if let Some(report) = self.tracker.as_mut().and_then(Tracker::finish) {
            eprintln!("{}", report.summary(self.path()));
            self.report = Some(report);
        }
    }

    /// Drops what a previous, interrupted run logged after `step`, so that a run resumed from
    /// the checkpoint at `step` leaves the same log as an uninterrupted one; once a run id is set,
    /// lines of other runs go too. `truncate_after(0)`
    /// starts the log afresh.
    pub fn truncate_after(&mut self, step: u64) -> Result<()> {
        match &mut self.sink {
            Sink::Disk(d) => d.truncate_after(step),
            Sink::Stdout(_) => Ok(()),
            Sink::TensorBoard(t) => t.truncate_after(step),
        }
    }

    /// Pushes anything written to the operating system (and stdout's buffer to the terminal).
    pub fn flush(&mut self) -> Result<()> {
        match &mut self.sink {
            Sink::Disk(d) => d.flush(),
            Sink::Stdout(_) => std::io::stdout().flush().context("metric logger: stdout"),
            Sink::TensorBoard(t) => t.flush(),
        }
    }

    /// Flushes and syncs the log to disk; later `log_step` calls are errors.
    pub fn close(&mut self) -> Result<()> {
        if self.closed {
            return Ok(());
        }
        self.flush()?;
        self.closed = true;
        self.finish_tracker();
        match &mut self.sink {
            Sink::Disk(d) => d
                .file
                .sync_all()
                .with_context(|| d.path.display().to_string()),
            Sink::TensorBoard(t) => t
                .file
                .sync_all()
                .with_context(|| t.path.display().to_string()),
            Sink::Stdout(_) => Ok(()),
        }
    }
}

impl Drop for MetricLogger {
    /// A logger dropped without [`MetricLogger::close`] (a recipe that only flushes, or a run
    /// ended by an error) still ends its tracker's run and reports what it took.
    fn drop(&mut self) {
        self.finish_tracker();
    }
}

/// Seconds since the Unix epoch, as a float (protobuf `Event.wall_time`).
fn unix_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Writes `{"step": 3, "epoch": 0, "loss": 1.23, ...}` lines, one per logged step.
///
/// Integral values are written as JSON integers (`epoch`, token counts); non-finite values as
/// the strings `"NaN"`, `"inf"`, `"-inf"` (JSON has no literal for them, and a diverging loss
/// must stay visible). The file is opened for appending; a torn last line left by a killed
/// process is dropped first so new lines never glue onto it.
#[derive(Debug)]
pub struct DiskLogger {
    path: PathBuf,
    file: File,
    /// The run whose lines this logger writes (`"run_id"` on each line), once set.
    run_id: Option<String>,
}

impl DiskLogger {
    /// Opens (creating folders as needed) `path` for appending.
    pub fn create(path: &Path) -> Result<DiskLogger> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            fs::create_dir_all(dir)
                .with_context(|| format!("{}: cannot create log folder", dir.display()))?;
        }
        drop_torn_tail(path)?;
        let file = open_append(path)?;
        Ok(DiskLogger {
            path: path.to_path_buf(),
            file,
            run_id: None,
        })
    }

    /// The JSONL file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn log_step(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<()> {
        let line = jsonl_line(step, self.run_id.as_deref(), metrics);
        // One write of the whole line: a crash leaves whole lines plus at most one torn tail.
        self.file
            .write_all(line.as_bytes())
            .with_context(|| format!("{}: cannot write metrics", self.path.display()))
    }

    fn flush(&mut self) -> Result<()> {
        self.file
            .flush()
            .with_context(|| format!("{}: cannot flush metrics", self.path.display()))
    }

    fn truncate_after(&mut self, step: u64) -> Result<()> {
        let text = fs::read_to_string(&self.path)
            .with_context(|| format!("{}: cannot read metrics", self.path.display()))?;
        let mut kept = String::with_capacity(text.len());
        for (i, line) in text.split_inclusive('\n').enumerate() {
            if !line.ends_with('\n') {
                break; // the torn tail of a killed run
            }
            if line.trim().is_empty() {
                continue;
            }
            let s = line_step(line).ok_or_else(|| {
                anyhow!(
                    "{}:{}: not a metrics line with an integer \"step\": {}",
                    self.path.display(),
                    i + 1,
                    line.trim_end()
                )
            })?;
            // Lines of another run (a fresh run's log restarts at 0, so this only matters on
            // resume) go: a resumed run's log holds its own steps only.
            let other_run = match (&self.run_id, line_run_id(line)) {
                (Some(mine), Some(theirs)) => *mine != theirs,
                _ => false,
            };
            if s <= step && !other_run {
                kept.push_str(line);
            }
        }
        // Atomic replace, then reopen: the old descriptor still points at the replaced file.
        let tmp = self.path.with_extension("jsonl.tmp");
        fs::write(&tmp, kept.as_bytes())
            .with_context(|| format!("{}: cannot write", tmp.display()))?;
        fs::rename(&tmp, &self.path)
            .with_context(|| format!("{}: cannot replace", self.path.display()))?;
        self.file = open_append(&self.path)?;
        Ok(())
    }
}

fn open_append(path: &Path) -> Result<File> {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("{}: cannot open metrics file for writing", path.display()))
}

/// Cuts a file back to its last `\n`, if it has content after it.
fn drop_torn_tail(path: &Path) -> Result<()> {
    let mut f = match OpenOptions::new().read(true).write(true).open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("{}: cannot open", path.display())),
    };
    let mut bytes = Vec::new();
    f.read_to_end(&mut bytes)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    if bytes.last().is_some_and(|&b| b != b'\n') {
        let keep = bytes.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1);
        f.set_len(keep as u64)
            .with_context(|| format!("{}: cannot truncate torn last line", path.display()))?;
        f.seek(SeekFrom::End(0))?;
    }
    Ok(())
}

/// The `step` of one JSONL line, if it is an object with a non-negative integer `step`.
fn line_step(line: &str) -> Option<u64> {
    serde_json::from_str::<Value>(line)
        .ok()?
        .get("step")?
        .as_u64()
}

/// The `run_id` of one JSONL line, if it has one.
fn line_run_id(line: &str) -> Option<String> {
    match serde_json::from_str::<Value>(line).ok()?.get("run_id")? {
        Value::String(id) => Some(id.clone()),
        _ => None,
    }
}

/// `{"step": 3, "run_id": "…", "loss": 1.23}\n` (`run_id` when the run has one), metrics in the
/// given order, Python `json.dumps` spacing.
fn jsonl_line(step: u64, run_id: Option<&str>, metrics: &[(&str, f64)]) -> String {
    let mut s = format!("{{\"step\": {step}");
    if let Some(id) = run_id {
        s.push_str(", \"run_id\": ");
        s.push_str(&Value::String(id.to_string()).to_string());
    }
    for (k, v) in metrics {
        s.push_str(", ");
        s.push_str(&Value::String((*k).to_string()).to_string());
        s.push_str(": ");
        s.push_str(&json_number(*v));
    }
    s.push_str("}\n");
    s
}

fn json_number(v: f64) -> String {
    if v.is_nan() {
        "\"NaN\"".into()
    } else if v.is_infinite() {
        if v > 0.0 { "\"inf\"" } else { "\"-inf\"" }.into()
    } else if v.fract() == 0.0 && v.abs() < 9.007_199_254_740_992e15 {
        format!("{}", v as i64)
    } else {
        // serde_json prints the shortest representation that reads back as the same f64.
        Value::from(v).to_string()
    }
}

/// Prints `Step 3 | loss:1.2300 lr:0.0003 tokens_per_second:1234.5` lines to stdout.
///
/// Losses get four decimals; integral values print as integers; others with six significant
/// digits.
#[derive(Debug)]
pub struct StdoutLogger;

impl StdoutLogger {
    fn log_step(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<()> {
        let line = stdout_line(step, metrics);
        let mut out = std::io::stdout().lock();
        out.write_all(line.as_bytes())
            .and_then(|_| out.flush())
            .context("metric logger: cannot write to stdout")
    }
}

/// The line a [`StdoutLogger`] prints for one step, with its trailing newline.
pub fn stdout_line(step: u64, metrics: &[(&str, f64)]) -> String {
    let fields: Vec<String> = metrics
        .iter()
        .map(|(k, v)| format!("{k}:{}", format_stdout_value(k, *v)))
        .collect();
    format!("Step {step} | {}\n", fields.join(" "))
}

fn format_stdout_value(key: &str, v: f64) -> String {
    if !v.is_finite() {
        format!("{v}")
    } else if key.contains("loss") {
        format!("{v:.4}")
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{}", v as i64)
    } else {
        // Round to 6 significant digits, then print the shortest decimal of that (no exponent).
        let rounded: f64 = format!("{v:.5e}").parse().unwrap_or(v);
        format!("{rounded}")
    }
}

/// Writes TensorBoard's event-file format: TFRecord frames holding protobuf `Event`s.
///
/// The file is `events.out.tfevents.{unix_secs}.{hostname}.{pid}.0` (torch's `SummaryWriter`
/// naming; TensorBoard reads any file with `tfevents` in its name). It starts with a
/// `file_version: "brain.Event:2"` event; each logged step is one event with one `simple_value`
/// per metric. [`MetricLogger::truncate_after`] appends a `SessionLog START` event at `step + 1`,
/// which makes TensorBoard drop the events of later steps, as it does for a restarted TF job.
#[derive(Debug)]
pub struct TensorBoardLogger {
    path: PathBuf,
    file: File,
}

impl TensorBoardLogger {
    /// Creates `dir` if needed and a new event file in it.
    pub fn create(dir: &Path) -> Result<TensorBoardLogger> {
        fs::create_dir_all(dir)
            .with_context(|| format!("{}: cannot create log folder", dir.display()))?;
        let now = unix_time();
        let name = format!(
            "events.out.tfevents.{:010}.{}.{}.0",
            now as u64,
            hostname(),
            std::process::id()
        );
        let path = dir.join(name);
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("{}: cannot create event file", path.display()))?;
        file.write_all(&tfevents::frame(&tfevents::file_version_event(now)))
            .with_context(|| format!("{}: cannot write", path.display()))?;
        Ok(TensorBoardLogger { path, file })
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    fn log_step(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<()> {
        let event = tfevents::scalars_event(unix_time(), step, metrics);
        self.write_event(&event)
    }

    fn truncate_after(&mut self, step: u64) -> Result<()> {
        let event = tfevents::session_start_event(unix_time(), step.saturating_add(1));
        self.write_event(&event)
    }

    fn write_event(&mut self, event: &[u8]) -> Result<()> {
        self.file
            .write_all(&tfevents::frame(event))
            .with_context(|| format!("{}: cannot write event", self.path.display()))
    }

    fn flush(&mut self) -> Result<()> {
        self.file
            .flush()
            .with_context(|| format!("{}: cannot flush", self.path.display()))
    }
}

fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is valid for `len` bytes; gethostname NUL-terminates within it or fails.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let name = if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        String::new()
    };
    // The name becomes part of a file name: keep it to safe characters.
    let clean: String = name
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    if clean.is_empty() {
        "localhost".into()
    } else {
        clean
    }
}

/// TensorBoard's event-file encoding: TFRecord framing and the few protobuf fields of `Event`,
/// `Summary` and `SessionLog` that scalar logging needs.
///
/// The protobuf is encoded by hand: five fields with fixed tags do not justify a protobuf crate
/// and its build-time code generation.
pub mod tfevents {
    /// CRC-32C (Castagnoli), the checksum TFRecord uses.
    pub fn crc32c(data: &[u8]) -> u32 {
        const TABLE: [u32; 256] = {
            let mut t = [0u32; 256];
            let mut i = 0;
            while i < 256 {
                let mut c = i as u32;
                let mut k = 0;
                while k < 8 {
                    // Reflected polynomial 0x1EDC6F41.
                    c = if c & 1 != 0 {
                        (c >> 1) ^ 0x82F6_3B78
                    } else {
                        c >> 1
                    };
                    k += 1;
                }
                t[i] = c;
                i += 1;
            }
            t
        };
        let mut crc = !0u32;
        for &b in data {
            crc = TABLE[((crc ^ b as u32) & 0xff) as usize] ^ (crc >> 8);
        }
        !crc
    }

    /// TFRecord's masked CRC: rotate right by 15 bits and add a constant, so that a CRC of data
    /// that itself contains CRCs stays well distributed.
    pub fn masked_crc(data: &[u8]) -> u32 {
        let c = crc32c(data);
        c.rotate_right(15).wrapping_add(0xa282_ead8)
    }

    /// One TFRecord: `u64` length, masked CRC of the length bytes, the data, masked CRC of the
    /// data (all little-endian).
    pub fn frame(data: &[u8]) -> Vec<u8> {
        let len = (data.len() as u64).to_le_bytes();
        let mut out = Vec::with_capacity(data.len() + 16);
        out.extend_from_slice(&len);
        out.extend_from_slice(&masked_crc(&len).to_le_bytes());
        out.extend_from_slice(data);
        out.extend_from_slice(&masked_crc(data).to_le_bytes());
        out
    }

    fn varint(out: &mut Vec<u8>, mut v: u64) {
        while v >= 0x80 {
            out.push((v as u8 & 0x7f) | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    fn len_delimited(out: &mut Vec<u8>, tag: u8, bytes: &[u8]) {
        out.push(tag);
        varint(out, bytes.len() as u64);
        out.extend_from_slice(bytes);
    }

    /// `Event.wall_time` (field 1, double) and `Event.step` (field 2, int64), each left out at
    /// its default of 0 as proto3 serializers do.
    fn event_header(wall_time: f64, step: u64) -> Vec<u8> {
        let mut out = Vec::new();
        if wall_time != 0.0 {
            out.push(0x09);
            out.extend_from_slice(&wall_time.to_le_bytes());
        }
        if step != 0 {
            out.push(0x10);
            varint(&mut out, step);
        }
        out
    }

    /// `Event { wall_time, file_version: "brain.Event:2" }`, the first event of every file.
    pub fn file_version_event(wall_time: f64) -> Vec<u8> {
        let mut out = event_header(wall_time, 0);
        len_delimited(&mut out, 0x1a, b"brain.Event:2");
        out
    }

    /// `Event { wall_time, step, summary { value { tag, simple_value } ... } }`; values are
    /// stored as f32, the type of `simple_value`.
    pub fn scalars_event(wall_time: f64, step: u64, values: &[(&str, f64)]) -> Vec<u8> {
        let mut summary = Vec::new();
        for (tag, v) in values {
            let mut value = Vec::new();
            len_delimited(&mut value, 0x0a, tag.as_bytes()); // Summary.Value.tag = 1
            value.push(0x15); // Summary.Value.simple_value = 2, fixed32
            value.extend_from_slice(&(*v as f32).to_le_bytes());
            len_delimited(&mut summary, 0x0a, &value); // Summary.value = 1
        }
        let mut out = event_header(wall_time, step);
        len_delimited(&mut out, 0x2a, &summary); // Event.summary = 5
        out
    }

    /// `Event { wall_time, step, session_log { status: START } }`: TensorBoard drops every
    /// event of this run with a step `>= step` read before it.
    pub fn session_start_event(wall_time: f64, step: u64) -> Vec<u8> {
        let mut out = event_header(wall_time, step);
        len_delimited(&mut out, 0x3a, &[0x08, 0x01]); // Event.session_log = 7, status = START
        out
    }
}

/// The process's peak resident memory in MiB: `VmHWM` from `/proc/self/status` on Linux,
/// otherwise `getrusage`'s `ru_maxrss`.
pub fn peak_rss_mb() -> f64 {
    if let Ok(status) = fs::read_to_string("/proc/self/status") {
        let kb = status.lines().find_map(|l| {
            l.strip_prefix("VmHWM:")?
                .trim()
                .strip_suffix("kB")?
                .trim()
                .parse::<f64>()
                .ok()
        });
        if let Some(kb) = kb {
            return kb / 1024.0;
        }
    }
    // SAFETY: getrusage only writes the struct we hand it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0.0;
    }
    let maxrss = usage.ru_maxrss as f64;
    // macOS reports bytes, Linux and the BSDs kilobytes.
    if cfg!(target_os = "macos") {
        maxrss / (1024.0 * 1024.0)
    } else {
        maxrss / 1024.0
    }
}
