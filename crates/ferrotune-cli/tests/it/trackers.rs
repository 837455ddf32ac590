//! The experiment trackers torchtune's configs name (issue 43 item 3), against the real thing:
//! a run with `MLFlowLogger` leaves every metric of its `metrics.jsonl`, at the same steps, and
//! the config as params in a real `mlflow server` on loopback (queried through MLflow's REST
//! API); a run with `WandBLogger` and `WANDB_MODE=offline` leaves a run folder whose history and
//! config, read back with wandb's own reader (`wandb leet inspect`), are the same; a
//! `CometLogger` run with `online: false` leaves Comet's offline archive; an MLflow server that
//! cannot be reached costs one warning and nothing of the run.
//!
//! The clients come from the virtual environment `scripts/fetch-trackers.sh` creates (and
//! `scripts/test.sh` runs); without it these tests say SKIP and pass. The unreachable-server
//! test needs nothing.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::{metrics_lines, run_recipe, text, tmpdir, write_config, TINY_LORA};

const RECIPE: &str = "lora_finetune_single_device";

/// 8 rows, batch 2: 4 steps.
fn rows(dir: &Path) -> PathBuf {
    let data = dir.join("rows.jsonl");
    let rows: Vec<String> = (0..8u32)
        .map(|i| {
            let ids: Vec<u32> = (0..10).map(|j| (i * 31 + j * 7) % 500 + 3).collect();
            serde_json::json!({"input_ids": ids}).to_string()
        })
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    data
}

/// The trackers' venv (`scripts/fetch-trackers.sh`), or `None` with a SKIP message.
fn venv(test: &str) -> Option<PathBuf> {
    let dir = std::env::var_os("FERROTUNE_TRACKERS_VENV")
        .map(PathBuf::from)
        .or_else(|| {
            let cache = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
            Some(cache.join("ferrotune/trackers-venv"))
        })?;
    if dir.join(".ferrotune-pins").exists() && dir.join("bin/python").exists() {
        Some(dir)
    } else {
        eprintln!(
            "SKIP {test}: no trackers' venv at {} (scripts/fetch-trackers.sh creates it; \
             scripts/test.sh runs it)",
            dir.display()
        );
        None
    }
}

/// A free loopback port.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `mlflow server` in its own process group, stopped (the group) when dropped.
struct MlflowServer {
    child: Child,
    url: String,
}

impl MlflowServer {
    fn start(venv: &Path, dir: &Path) -> MlflowServer {
        let port = free_port();
        let db = format!("sqlite:///{}", dir.join("mlflow.db").display());
        let child = Command::new(venv.join("bin/mlflow"))
            .args(["server", "--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--workers", "1", "--backend-store-uri", &db])
            .arg("--artifacts-destination")
            .arg(dir.join("artifacts"))
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("server.log")).unwrap())
            .process_group(0)
            .spawn()
            .expect("start mlflow server");
        let server = MlflowServer {
            child,
            url: format!("http://127.0.0.1:{port}"),
        };
        let start = Instant::now();
        while rest(venv, &format!("{}/health", server.url)).is_none() {
            assert!(
                start.elapsed() < Duration::from_secs(180),
                "mlflow server did not answer: {}",
                std::fs::read_to_string(dir.join("server.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        server
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        // SAFETY: signals this test's own process group (the server and its workers).
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

/// GET (or POST `body`) `url` with the venv's Python (urllib: MLflow's REST API as any HTTP
/// client sees it); the answer's text, `None` when it fails.
fn http(venv: &Path, url: &str, body: Option<&Value>) -> Option<String> {
    const SCRIPT: &str = "import sys, urllib.request\n\
        data = sys.argv[2].encode() if len(sys.argv) > 2 else None\n\
        req = urllib.request.Request(sys.argv[1], data=data, headers={'Content-Type': 'application/json'})\n\
        print(urllib.request.urlopen(req, timeout=10).read().decode())\n";
    let mut cmd = Command::new(venv.join("bin/python"));
    cmd.args(["-c", SCRIPT, url]);
    if let Some(b) = body {
        cmd.arg(b.to_string());
    }
    let out = cmd.stderr(Stdio::null()).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn rest(venv: &Path, url: &str) -> Option<String> {
    http(venv, url, None)
}

fn rest_json(venv: &Path, url: &str, body: Option<&Value>) -> Value {
    let text = http(venv, url, body).unwrap_or_else(|| panic!("{url}: no answer"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{url}: {e}: {text}"))
}

/// `{key: [(step, value)]}` of every metric of a `metrics.jsonl` (`step`, `run_id` left out).
fn jsonl_history(path: &Path) -> BTreeMap<String, Vec<(u64, f64)>> {
    let mut out: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
    for line in metrics_lines(path) {
        let step = line["step"].as_u64().unwrap();
        for (k, v) in line.as_object().unwrap() {
            if k != "step" && k != "run_id" {
                out.entry(k.clone())
                    .or_default()
                    .push((step, v.as_f64().unwrap()));
            }
        }
    }
    out
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * a.abs().max(1.0)
}

#[test]
fn mlflow_logger_leaves_every_metric_and_the_config_in_a_real_server() {
    let Some(venv) = venv("mlflow") else {
        return;
    };
    let dir = tmpdir("trackers", "mlflow");
    let server = MlflowServer::start(&venv, &dir);
    let data = rows(&dir);
    let cfg = write_config(TINY_LORA, &dir, "llama3", &data);
    let out = dir.join("out");
    let o = run_recipe(
        RECIPE,
        &cfg,
        &out,
        &[
            "metric_logger._component_=torchtune.training.metric_logging.MLFlowLogger",
            "metric_logger.experiment_name=ferrotune-test",
            "metric_logger.run_name=tiny-lora",
            "metric_logger.log_checkpoint=true",
            "log_peak_memory_stats=true",
        ],
        &dir,
        &[("MLFLOW_TRACKING_URI", server.url.as_str())],
    );
    let msg = text(&o);
    assert!(o.status.success(), "{msg}");
    assert!(!msg.contains("warning: MLFlowLogger"), "{msg}");
    assert!(msg.contains("MLFlowLogger: 4 steps"), "{msg}");

    // The run, through the REST API.
    let api = format!("{}/api/2.0/mlflow", server.url);
    let exp = rest_json(
        &venv,
        &format!("{api}/experiments/get-by-name?experiment_name=ferrotune-test"),
        None,
    );
    let exp_id = exp["experiment"]["experiment_id"]
        .as_str()
        .unwrap()
        .to_string();
    let found = rest_json(
        &venv,
        &format!("{api}/runs/search"),
        Some(&serde_json::json!({"experiment_ids": [exp_id]})),
    );
    let runs = found["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1, "{found}");
    let info = &runs[0]["info"];
    assert_eq!(info["run_name"], "tiny-lora", "{info}");
    assert_eq!(info["status"], "FINISHED", "{info}");
    let run_id = info["run_id"].as_str().unwrap();

    // Every metric of metrics.jsonl, at the same steps, with the same values.
    let jsonl = jsonl_history(&out.join("logs/metrics.jsonl"));
    assert!(
        jsonl.contains_key("loss") && jsonl.contains_key("lr"),
        "{jsonl:?}"
    );
    assert_eq!(jsonl["loss"].len(), 4);
    for (key, want) in &jsonl {
        let h = rest_json(
            &venv,
            &format!("{api}/metrics/get-history?run_id={run_id}&metric_key={key}"),
            None,
        );
        let mut got: Vec<(u64, f64)> = h["metrics"]
            .as_array()
            .unwrap_or_else(|| panic!("{key}: {h}"))
            .iter()
            .map(|m| {
                (
                    m["step"].as_u64().unwrap_or(0),
                    m["value"].as_f64().unwrap(),
                )
            })
            .collect();
        got.sort_by_key(|(s, _)| *s);
        assert_eq!(got.len(), want.len(), "{key}: {got:?} vs {want:?}");
        for ((gs, gv), (ws, wv)) in got.iter().zip(want) {
            assert!(gs == ws && close(*gv, *wv), "{key}: {got:?} vs {want:?}");
        }
    }

    // The resolved config as params: torchtune's flattened keys, Python's str() of the values.
    let run = rest_json(&venv, &format!("{api}/runs/get?run_id={run_id}"), None);
    let params: BTreeMap<String, String> = run["run"]["data"]["params"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            (
                p["key"].as_str().unwrap().to_string(),
                p["value"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    let saved: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(out.join("config.yaml")).unwrap())
            .unwrap();
    let mut flat = Vec::new();
    ferrotune_train::metrics::mlflow::flatten(&saved, "", &mut flat);
    let flat: BTreeMap<String, String> = flat.into_iter().collect();
    assert_eq!(params, flat);
    assert_eq!(params["batch_size"], "2");
    assert_eq!(params["optimizer.lr"], "0.001");
    assert_eq!(params["model.lora_attn_modules"], "['q_proj', 'v_proj']");
    assert_eq!(
        params["metric_logger._component_"],
        "torchtune.training.metric_logging.MLFlowLogger"
    );

    // The final checkpoint folder as the run's artifacts (`log_checkpoint: true`).
    let listed = rest_json(
        &venv,
        &format!("{api}/artifacts/list?run_id={run_id}&path=epoch_0"),
        None,
    );
    let files: Vec<&str> = listed["files"]
        .as_array()
        .unwrap_or_else(|| panic!("{listed}"))
        .iter()
        .map(|f| f["path"].as_str().unwrap())
        .collect();
    assert!(
        files.contains(&"epoch_0/adapter_model.safetensors"),
        "{files:?}"
    );
    drop(server);
}

#[test]
fn wandb_logger_offline_run_holds_the_history_and_config() {
    let Some(venv) = venv("wandb") else {
        return;
    };
    let dir = tmpdir("trackers", "wandb");
    let data = rows(&dir);
    let cfg = write_config(TINY_LORA, &dir, "llama3", &data);
    let out = dir.join("out");
    let python = venv.join("bin/python");
    let o = run_recipe(
        RECIPE,
        &cfg,
        &out,
        &[
            "metric_logger._component_=torchtune.training.metric_logging.WandBLogger",
            "metric_logger.project=ferrotune-test",
            "metric_logger.name=tiny-lora",
            // One tag as a string: a list of one for wandb.
            "metric_logger.tags=lora",
        ],
        &dir,
        &[
            ("WANDB_MODE", "offline"),
            ("WANDB_SILENT", "true"),
            ("FERROTUNE_PYTHON", python.to_str().unwrap()),
        ],
    );
    let msg = text(&o);
    assert!(o.status.success(), "{msg}");
    assert!(!msg.contains("warning: WandBLogger"), "{msg}");
    assert!(msg.contains("WandBLogger: 4 steps"), "{msg}");

    // The run folder, read back with wandb's own reader of `.wandb` files.
    let runs: Vec<PathBuf> = std::fs::read_dir(out.join("logs/wandb"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("offline-run-")
        })
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    let file = std::fs::read_dir(&runs[0])
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "wandb"))
        .expect("a .wandb file");
    let read = Command::new(venv.join("bin/wandb"))
        .args(["leet", "inspect", "--json"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(read.status.success(), "{}", text(&read));
    let records: Vec<Value> = String::from_utf8_lossy(&read.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    let mut history: BTreeMap<String, Vec<(u64, f64)>> = BTreeMap::new();
    let mut config = serde_json::Map::new();
    let run = records
        .iter()
        .find(|r| r["type"] == "run")
        .expect("a run record");
    assert_eq!(run["run"]["tags"], serde_json::json!(["lora"]), "{run}");
    assert_eq!(run["run"]["display_name"], "tiny-lora", "{run}");
    assert_eq!(run["run"]["project"], "ferrotune-test", "{run}");
    for r in &records {
        match r["type"].as_str() {
            Some("history") => {
                let item = r["history"]["item"].as_object().unwrap();
                let step = item["global_step"].as_u64().unwrap();
                for (k, v) in item {
                    if !k.starts_with('_') && k != "global_step" {
                        history
                            .entry(k.clone())
                            .or_default()
                            .push((step, v.as_f64().unwrap()));
                    }
                }
            }
            Some("config") => {
                for (k, v) in r["config"]["update"].as_object().unwrap() {
                    config.insert(k.clone(), v.clone());
                }
            }
            _ => {}
        }
    }
    let jsonl = jsonl_history(&out.join("logs/metrics.jsonl"));
    assert_eq!(
        history.keys().collect::<Vec<_>>(),
        jsonl.keys().collect::<Vec<_>>()
    );
    for (key, want) in &jsonl {
        let got = &history[key];
        assert_eq!(got.len(), want.len(), "{key}");
        for ((gs, gv), (ws, wv)) in got.iter().zip(want) {
            assert!(gs == ws && close(*gv, *wv), "{key}: {got:?} vs {want:?}");
        }
    }
    let saved: Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(out.join("config.yaml")).unwrap())
            .unwrap();
    for (k, v) in saved.as_object().unwrap() {
        assert_eq!(config.get(k), Some(v), "config key {k}");
    }
}

#[test]
fn comet_logger_offline_leaves_its_archive() {
    let Some(venv) = venv("comet") else {
        return;
    };
    let dir = tmpdir("trackers", "comet");
    let data = rows(&dir);
    let cfg = write_config(TINY_LORA, &dir, "llama3", &data);
    let out = dir.join("out");
    let python = venv.join("bin/python");
    let o = run_recipe(
        RECIPE,
        &cfg,
        &out,
        &[
            "metric_logger._component_=torchtune.training.metric_logging.CometLogger",
            "metric_logger.project=ferrotune-test",
            "metric_logger.online=false",
            "metric_logger.log_code=false",
        ],
        &dir,
        &[("FERROTUNE_PYTHON", python.to_str().unwrap())],
    );
    let msg = text(&o);
    assert!(o.status.success(), "{msg}");
    assert!(!msg.contains("warning: CometLogger"), "{msg}");
    assert!(msg.contains("CometLogger: 4 steps"), "{msg}");
    let archives: Vec<PathBuf> = std::fs::read_dir(out.join("logs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "zip"))
        .collect();
    assert_eq!(archives.len(), 1, "{archives:?}");
    // Comet's own reader of the archive: every loss of metrics.jsonl, at its step.
    const READ: &str = "import json, sys, zipfile\n\
        z = zipfile.ZipFile(sys.argv[1])\n\
        out = []\n\
        for line in z.read('messages.json').decode().splitlines():\n\
        \x20   m = json.loads(line)\n\
        \x20   p = m.get('payload', {})\n\
        \x20   metric = p.get('metric') if isinstance(p, dict) else None\n\
        \x20   if metric and metric.get('metricName') == 'loss':\n\
        \x20       out.append([metric.get('step'), float(metric['metricValue'])])\n\
        print(json.dumps(out))\n";
    let read = Command::new(&python)
        .args(["-c", READ])
        .arg(&archives[0])
        .output()
        .unwrap();
    assert!(read.status.success(), "{}", text(&read));
    let got: Vec<(u64, f64)> = serde_json::from_slice(&read.stdout).unwrap();
    let jsonl = jsonl_history(&out.join("logs/metrics.jsonl"));
    assert_eq!(got.len(), jsonl["loss"].len(), "{got:?}");
    for ((gs, gv), (ws, wv)) in got.iter().zip(&jsonl["loss"]) {
        assert!(
            gs == ws && (gv - wv).abs() < 1e-6 * wv.abs().max(1.0),
            "{got:?}"
        );
    }
}

#[test]
fn an_unreachable_mlflow_server_warns_once_and_the_run_completes() {
    let dir = tmpdir("trackers", "unreachable");
    let data = rows(&dir);
    let cfg = write_config(TINY_LORA, &dir, "llama3", &data);
    let out = dir.join("out");
    // A port nothing listens on.
    let url = format!("http://127.0.0.1:{}", free_port());
    let o = run_recipe(
        RECIPE,
        &cfg,
        &out,
        &[
            "metric_logger._component_=torchtune.training.metric_logging.MLFlowLogger",
            &format!("metric_logger.tracking_uri={url}"),
        ],
        &dir,
        &[],
    );
    let msg = text(&o);
    assert!(o.status.success(), "{msg}");
    assert_eq!(
        msg.matches("warning: MLFlowLogger: cannot start").count(),
        1,
        "{msg}"
    );
    assert!(
        msg.contains("MLFlowLogger: 4 of 4 steps, the config not logged"),
        "{msg}"
    );
    let lines = metrics_lines(&out.join("logs/metrics.jsonl"));
    let steps: Vec<u64> = lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [1, 2, 3, 4]);
    assert!(out.join("epoch_0/adapter_model.safetensors").exists());
}
