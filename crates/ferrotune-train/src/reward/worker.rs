//! Reward functions from a Python file, run in a long-lived worker process: ferrotune starts
//! `python3 DRIVER FILE` once per file (the driver, `worker_driver.py`, ships inside the binary
//! and is written to a temp file), then sends each batch as one JSON line on its stdin and reads
//! one JSON line back (`{"rewards": [...]}` or `{"error": ..., "row": ...}`). A batch that gets no
//! answer within the function's timeout stops the worker and the run.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

use super::{read_answer, RewardBatch, RewardFn};

/// The worker's driver, shipped in the binary.
pub const DRIVER: &str = include_str!("worker_driver.py");

/// The interpreter a worker runs under unless an entry names one (`interpreter:`).
pub const DEFAULT_INTERPRETER: &str = "python3";

/// One worker process.
pub struct Worker {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<std::io::Result<String>>,
    file: PathBuf,
    /// Why the worker cannot answer any more (it was stopped after a timeout, or exited).
    broken: Option<String>,
}

/// A worker shared by the functions of its file.
#[derive(Clone)]
pub struct Shared(Arc<Mutex<Worker>>);

static DRIVERS: AtomicUsize = AtomicUsize::new(0);

impl Shared {
    /// Starts the worker for `file` under `interpreter` and waits (up to `timeout`) for it to
    /// import the file.
    pub fn start(file: &Path, interpreter: &str, timeout: Duration) -> Result<Shared> {
        if !file.is_file() {
            bail!("reward file {}: no such file", file.display());
        }
        let driver = std::env::temp_dir().join(format!(
            "ferrotune-reward-worker-{}-{}.py",
            std::process::id(),
            DRIVERS.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::write(&driver, DRIVER)
            .with_context(|| format!("writing the reward worker's driver {}", driver.display()))?;
        let spawned = Command::new(interpreter)
            .arg("-u")
            .arg(&driver)
            .arg(file)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                std::fs::remove_file(&driver).ok();
                bail!(
                    "reward file {}: cannot start '{interpreter}': {e}",
                    file.display()
                );
            }
        };
        let stdout = child.stdout.take().expect("piped");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let mut worker = Worker {
            stdin: child.stdin.take(),
            child,
            lines: rx,
            file: file.to_path_buf(),
            broken: None,
        };
        let first = worker.read(timeout);
        // Python has read the driver by now (or never will).
        std::fs::remove_file(&driver).ok();
        let first = first.map_err(|e| anyhow!("reward file {}: {e}", file.display()))?;
        if let Some(e) = first.get("error") {
            bail!(
                "reward file {}: {}",
                file.display(),
                e.as_str().unwrap_or_default()
            );
        }
        Ok(Shared(Arc::new(Mutex::new(worker))))
    }
}

impl Worker {
    /// The next line, as JSON, within `timeout`; on a timeout the worker is stopped.
    fn read(&mut self, timeout: Duration) -> Result<Value> {
        match self.lines.recv_timeout(timeout) {
            Ok(Ok(line)) => serde_json::from_str(&line)
                .map_err(|e| anyhow!("the worker wrote a line that is not JSON ({e}): {line}")),
            Ok(Err(e)) => Err(self.fail(format!("reading from the worker: {e}"))),
            Err(RecvTimeoutError::Timeout) => Err(self.fail(format!(
                "no answer within {:.3} s (the timeout); the worker was stopped",
                timeout.as_secs_f64()
            ))),
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.wait().map(|s| s.to_string()).unwrap_or_default();
                Err(self.fail(format!("the worker exited ({status})")))
            }
        }
    }

    /// Stops the worker, remembering `why`.
    fn fail(&mut self, why: String) -> anyhow::Error {
        self.child.kill().ok();
        self.child.wait().ok();
        self.stdin = None;
        self.broken = Some(why.clone());
        anyhow!(why)
    }

    /// Sends `request`, reads its answer.
    fn call(&mut self, request: &Value, timeout: Duration) -> Result<Value> {
        if let Some(why) = &self.broken {
            bail!("its worker is stopped: {why}");
        }
        let line = serde_json::to_string(request)? + "\n";
        // A worker that died between batches: EPIPE here, not SIGPIPE ending the run.
        let _no_sigpipe = ferrotune_core::sigpipe::SigpipeBlocked::new();
        let written = match self.stdin.as_mut() {
            Some(s) => s.write_all(line.as_bytes()).and_then(|_| s.flush()),
            None => Err(std::io::Error::other("no stdin")),
        };
        if let Err(e) = written {
            return Err(self.fail(format!("writing to the worker: {e}")));
        }
        self.read(timeout)
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Closing stdin ends the driver's loop; kill in case a function still runs.
        self.stdin = None;
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// One function of a worker's file.
pub struct PythonReward {
    worker: Shared,
    function: String,
    name: String,
    timeout: Duration,
    conversational: bool,
    group: usize,
}

impl PythonReward {
    /// `function` of the worker's file, logged as `name`.
    pub fn new(
        worker: Shared,
        function: String,
        name: String,
        timeout: Duration,
        conversational: bool,
        group: usize,
    ) -> Self {
        PythonReward {
            worker,
            function,
            name,
            timeout,
            conversational,
            group,
        }
    }
}

impl RewardFn for PythonReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&mut self, batch: &RewardBatch) -> Result<Vec<f32>> {
        let request = batch.request(&self.function, self.conversational);
        let mut w = self
            .worker
            .0
            .lock()
            .map_err(|_| anyhow!("reward worker lock poisoned"))?;
        let file = w.file.display().to_string();
        let answer = w.call(&request, self.timeout).map_err(|e| {
            anyhow!(
                "reward function '{}' ({file}) on a batch of {} completions: {e}",
                self.name,
                batch.len()
            )
        })?;
        drop(w);
        read_answer(&answer, &self.name, batch, self.group).map_err(|e| anyhow!("{e} ({file})"))
    }
}
