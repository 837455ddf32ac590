//! `WandBLogger` and `CometLogger`: the official clients (`wandb`, `comet_ml`) in a Python child
//! process, fed JSON lines (`bridge.py`).
//!
//! Why a bridge and not their wire protocols: W&B's and Comet's protocols are their clients'
//! internals, not documented APIs (W&B's client talks to its own `wandb-core` service, writes
//! the `.wandb` files `wandb sync` uploads and reads the login `wandb login` stored); a W&B or
//! Comet user has the client installed and logged in, and through it gets exactly what their
//! other runs get: authentication, offline mode (`WANDB_MODE=offline`, then `wandb sync`),
//! retries and the dashboards' conventions (torchtune's `global_step` axis). The child is
//! started with `FERROTUNE_PYTHON` (default `python3`); without it, or without the package, the
//! run goes on with its JSONL log and one warning.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{Map, Value};

use super::tracker::Backend;

/// The bridge's source, run with `python -c`.
const BRIDGE_PY: &str = include_str!("bridge.py");

/// Which client the bridge drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Client {
    /// `wandb` (`WandBLogger`).
    Wandb,
    /// `comet_ml` (`CometLogger`).
    Comet,
}

impl Client {
    fn module(self) -> &'static str {
        match self {
            Client::Wandb => "wandb",
            Client::Comet => "comet_ml",
        }
    }
}

/// A tracker run through the Python bridge.
pub(super) struct Bridge {
    client: Client,
    /// The logger's options as the bridge takes them (`log_dir` resolved).
    options: Map<String, Value>,
    child: Option<(Child, ChildStdin, BufReader<ChildStdout>)>,
}

impl Bridge {
    /// A bridge for `client` with the section's options (`log_dir` the folder the JSONL log is
    /// in: W&B's `dir` unless the section names one, Comet's offline folder).
    pub(super) fn new(client: Client, options: Map<String, Value>) -> Bridge {
        Bridge {
            client,
            options,
            child: None,
        }
    }

    /// Sends one line and reads the answer: `Ok(answer's "ok")`, or the bridge's error.
    fn ask(&mut self, line: &str) -> Result<Value> {
        let (_, stdin, stdout) = self
            .child
            .as_mut()
            .ok_or_else(|| anyhow!("the bridge is not running"))?;
        // A bridge that died (a crashed client): EPIPE here, not SIGPIPE ending the run.
        let _no_sigpipe = ferrotune_core::sigpipe::SigpipeBlocked::new();
        stdin
            .write_all(line.as_bytes())
            .and_then(|_| stdin.write_all(b"\n"))
            .and_then(|_| stdin.flush())
            .context("the bridge process is gone")?;
        let mut answer = String::new();
        stdout
            .read_line(&mut answer)
            .context("cannot read the bridge's answer")?;
        if answer.is_empty() {
            bail!("the bridge process exited");
        }
        let v: Value = serde_json::from_str(&answer)
            .with_context(|| format!("the bridge answered: {}", answer.trim()))?;
        match v.get("error") {
            Some(e) => Err(anyhow!("{}", e.as_str().unwrap_or_default())),
            None => Ok(v.get("ok").cloned().unwrap_or(Value::Null)),
        }
    }
}

impl Backend for Bridge {
    fn start(&mut self) -> Result<String> {
        let knob = &ferrotune_core::switch::PYTHON;
        let python = knob.value_os().unwrap_or_else(|| "python3".into());
        let mut child = Command::new(&python)
            .arg("-c")
            .arg(BRIDGE_PY)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| {
                format!(
                    "cannot start {} ({} names the Python with {})",
                    python.to_string_lossy(),
                    knob.name,
                    self.client.module()
                )
            })?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        self.child = Some((child, stdin, stdout));
        let first = serde_json::json!({
            "tracker": match self.client { Client::Wandb => "wandb", Client::Comet => "comet" },
            "options": self.options,
        });
        match self.ask(&first.to_string()) {
            Ok(where_) => Ok(where_.as_str().unwrap_or_default().to_string()),
            Err(e) => {
                self.reap();
                let msg = format!("{e:#}");
                if msg.contains("No module named") {
                    bail!(
                        "{msg}: `pip install {}` for {} (or point {} at a Python that has it)",
                        self.client.module(),
                        python.to_string_lossy(),
                        knob.name
                    );
                }
                Err(e)
            }
        }
    }

    fn config(&mut self, config: &Value) -> Result<usize> {
        let n = config.as_object().map_or(0, |m| m.len());
        let line = serde_json::json!({"type": "config", "config": config});
        self.ask(&line.to_string()).map(|_| n)
    }

    fn step(&mut self, step: u64, metrics: &[(String, f64)]) -> Result<()> {
        self.ask(&log_line(step, metrics)).map(|_| ())
    }

    fn finish(&mut self) -> Result<()> {
        let r = self.ask("{\"type\": \"finish\"}").map(|_| ());
        self.reap();
        r
    }
}

impl Bridge {
    /// Closes the child's stdin and waits for it to exit.
    fn reap(&mut self) {
        if let Some((mut child, stdin, _)) = self.child.take() {
            drop(stdin);
            let _ = child.wait();
        }
    }
}

impl Drop for Bridge {
    fn drop(&mut self) {
        self.reap();
    }
}

/// `{"type": "log", "step": 3, "metrics": {"loss": 1.5, "x": NaN}}`: Python's `json` reads the
/// non-standard `NaN`, `Infinity` and `-Infinity`, so a diverging loss reaches the tracker as
/// what it is.
fn log_line(step: u64, metrics: &[(String, f64)]) -> String {
    let mut s = format!("{{\"type\": \"log\", \"step\": {step}, \"metrics\": {{");
    for (i, (k, v)) in metrics.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        s.push_str(&Value::String(k.clone()).to_string());
        s.push_str(": ");
        s.push_str(&if v.is_nan() {
            "NaN".to_string()
        } else if v.is_infinite() {
            if *v > 0.0 { "Infinity" } else { "-Infinity" }.to_string()
        } else {
            Value::from(*v).to_string()
        });
    }
    s.push_str("}}");
    s
}
