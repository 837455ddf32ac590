//! Experiment trackers (`MLFlowLogger`, `WandBLogger`, `CometLogger`) behind the JSONL log.
//!
//! A tracker runs on its own thread, fed through a channel: training never waits on a network
//! call or on a tracker's client, and a tracker that cannot be reached costs one warning, not the
//! run. The JSONL file is written beside it in every case, on the training thread, before the
//! step is handed to the tracker. What the tracker failed to take is counted, and
//! [`TrackerReport`] says so when the log closes: nothing is lost silently.

use std::path::PathBuf;
use std::sync::mpsc::{channel, Sender};
use std::thread::JoinHandle;

use anyhow::Result;
use serde_json::Value;

/// One tracker's client: the calls a run makes, each answering whether the tracker took it.
pub(super) trait Backend: Send + 'static {
    /// Connects and opens the run; returns where it lives (a URL, a run folder), for messages.
    fn start(&mut self) -> Result<String>;
    /// Records the resolved config; returns how many values it recorded.
    fn config(&mut self, config: &Value) -> Result<usize>;
    /// Records one step's metrics.
    fn step(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()>;
    /// Uploads a folder's files as the run's artifacts; returns how many.
    fn artifacts(&mut self, dir: &std::path::Path) -> Result<usize> {
        let _ = dir;
        Ok(0)
    }
    /// Ends the run (and waits for the client to hand over what it holds).
    fn finish(&mut self) -> Result<()>;
}

enum Msg {
    Config(Value),
    Step(u64, Vec<(String, f64)>),
    Artifacts(PathBuf),
}

/// What a tracker took of a run, reported when the log closes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrackerReport {
    /// The logger's torchtune class name (`MLFlowLogger`, ...).
    pub tracker: &'static str,
    /// Where the run lives (a URL, a run folder), once the tracker started.
    pub location: Option<String>,
    /// Steps handed to the tracker.
    pub steps: u64,
    /// Of those, steps the tracker did not take.
    pub steps_failed: u64,
    /// Config values recorded (`None`: no config was logged, or it failed).
    pub config_values: Option<usize>,
    /// Whether logging the config was tried and failed.
    pub config_failed: bool,
    /// Artifact files uploaded.
    pub artifacts: usize,
    /// Whether an artifact upload was tried and failed.
    pub artifacts_failed: bool,
    /// Whether ending the run failed.
    pub finish_failed: bool,
    /// The first error, when there was one.
    pub first_error: Option<String>,
}

impl TrackerReport {
    /// Whether the tracker took everything it was handed.
    pub fn complete(&self) -> bool {
        self.first_error.is_none()
    }

    /// The one line printed when the log closes.
    pub fn summary(&self, jsonl: Option<&std::path::Path>) -> String {
        let jsonl = jsonl.map_or(String::new(), |p| {
            format!("; {} holds every step", p.display())
        });
        if self.complete() {
            let config = self
                .config_values
                .map_or(String::new(), |n| format!(", the config ({n} values)"));
            let artifacts = match self.artifacts {
                0 => String::new(),
                n => format!(", {n} artifact files"),
            };
            format!(
                "{}: {} steps{config}{artifacts} logged to {}",
                self.tracker,
                self.steps,
                self.location.as_deref().unwrap_or("the tracker")
            )
        } else {
            let mut lost = vec![format!("{} of {} steps", self.steps_failed, self.steps)];
            if self.config_failed {
                lost.push("the config".into());
            }
            if self.artifacts_failed {
                lost.push("the artifacts".into());
            }
            if self.finish_failed {
                lost.push("the run's end".into());
            }
            format!(
                "warning: {}: {} not logged (first error: {}){jsonl}",
                self.tracker,
                lost.join(", "),
                self.first_error.as_deref().unwrap_or("?")
            )
        }
    }
}

/// A tracker's thread and the channel that feeds it.
#[derive(Debug)]
pub(super) struct Tracker {
    name: &'static str,
    tx: Option<Sender<Msg>>,
    worker: Option<JoinHandle<TrackerReport>>,
}

/// Failures in a row after which a tracker is given up on (its later calls counted as failed
/// without being tried, so that an unreachable server does not cost a timeout per step).
const GIVE_UP_AFTER: u32 = 3;

impl Tracker {
    /// Starts `backend` on its own thread; connecting happens there, not here.
    pub(super) fn start(name: &'static str, backend: Box<dyn Backend>) -> Result<Tracker> {
        let (tx, rx) = channel::<Msg>();
        let worker = std::thread::Builder::new()
            .name(format!("ferrotune-{}", name.to_ascii_lowercase()))
            .spawn(move || work(name, backend, rx))?;
        Ok(Tracker {
            name,
            tx: Some(tx),
            worker: Some(worker),
        })
    }

    /// The logger's class name.
    pub(super) fn name(&self) -> &'static str {
        self.name
    }

    fn send(&self, msg: Msg) {
        if let Some(tx) = &self.tx {
            // A worker that panicked has dropped its receiver; `finish` reports that.
            let _ = tx.send(msg);
        }
    }

    pub(super) fn config(&self, config: &Value) {
        self.send(Msg::Config(config.clone()));
    }

    pub(super) fn step(&self, step: u64, metrics: &[(&str, f64)]) {
        let owned = metrics.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        self.send(Msg::Step(step, owned));
    }

    pub(super) fn artifacts(&self, dir: PathBuf) {
        self.send(Msg::Artifacts(dir));
    }

    /// Ends the run and waits for the tracker to finish; `None` if already finished.
    pub(super) fn finish(&mut self) -> Option<TrackerReport> {
        drop(self.tx.take());
        let worker = self.worker.take()?;
        Some(worker.join().unwrap_or_else(|_| TrackerReport {
            tracker: self.name,
            first_error: Some("the tracker's thread panicked".into()),
            finish_failed: true,
            ..TrackerReport::default()
        }))
    }
}

/// The tracker's thread: starts the backend, then takes messages until the channel closes.
fn work(
    name: &'static str,
    mut backend: Box<dyn Backend>,
    rx: std::sync::mpsc::Receiver<Msg>,
) -> TrackerReport {
    let mut report = TrackerReport {
        tracker: name,
        ..TrackerReport::default()
    };
    let mut failures_in_a_row = 0u32;
    let mut live = match backend.start() {
        Ok(location) => {
            report.location = Some(location);
            true
        }
        Err(e) => {
            fail(&mut report, &format!("cannot start: {e:#}"));
            false
        }
    };
    for msg in rx {
        if let Msg::Step(..) = msg {
            report.steps += 1;
        }
        let outcome = if live {
            match &msg {
                Msg::Config(c) => backend.config(c).map(|n| report.config_values = Some(n)),
                Msg::Step(s, m) => backend.step(*s, m),
                Msg::Artifacts(d) => backend.artifacts(d).map(|n| report.artifacts += n),
            }
        } else {
            Err(anyhow::anyhow!("not started"))
        };
        if let Err(e) = outcome {
            match msg {
                Msg::Config(_) => report.config_failed = true,
                Msg::Step(..) => report.steps_failed += 1,
                Msg::Artifacts(_) => report.artifacts_failed = true,
            }
            if live {
                fail(&mut report, &format!("{e:#}"));
                failures_in_a_row += 1;
                live = failures_in_a_row < GIVE_UP_AFTER;
            }
        } else {
            failures_in_a_row = 0;
        }
    }
    if live {
        if let Err(e) = backend.finish() {
            report.finish_failed = true;
            fail(&mut report, &format!("cannot end the run: {e:#}"));
        }
    }
    report
}

/// Records a failure; the first one is the tracker's one warning during the run.
fn fail(report: &mut TrackerReport, error: &str) {
    if report.first_error.is_none() {
        eprintln!(
            "warning: {}: {error}; the run goes on, the metrics log holds every step (what the \
             tracker misses is counted and reported at the end)",
            report.tracker
        );
        report.first_error = Some(error.to_string());
    }
}
