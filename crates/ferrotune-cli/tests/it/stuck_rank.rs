//! A rank that stops making progress without dying: SIGSTOP of rank 1 of a 2-rank CPU run. Its
//! sockets stay open, so only the heartbeat watchdog can notice; the launcher must then exit
//! non-zero within the documented bound (`dist_watchdog_timeout` + 10 s + about a second),
//! naming rank 1, and leave no rank process behind (the stopped one ignores SIGTERM: SIGKILL).

#![cfg(target_os = "linux")]

use crate::common;

use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const CONFIG: &str = "
output_dir: OUT
tokenizer:
  path: MODEL
checkpointer:
  checkpoint_dir: MODEL
  output_dir: ${output_dir}
dataset:
  _component_: torchtune.datasets.tokenized_dataset
  source: json
  data_files: DATA
seed: 5
batch_size: 1
epochs: 1
optimizer:
  _component_: torch.optim.SGD
  lr: 1e-3
loss:
  _component_: torch.nn.CrossEntropyLoss
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${output_dir}/logs
log_every_n_steps: 1
device: cpu
dtype: fp32
";

/// The watchdog bound the test runs with, in seconds.
const BOUND: u64 = 6;
/// What the launcher adds to the bound: 5 s for the others to stop on their own, 5 s after
/// SIGTERM before SIGKILL (`launch.rs`).
const LAUNCHER: u64 = 10;

/// Kills whatever the test started that is still there, so that a failing test leaves nothing
/// running (SIGKILL ends a stopped process too): the launcher (first) and its ranks.
struct Cleanup(Vec<u32>);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let Some(&launcher) = self.0.first() else {
            return;
        };
        // The ranks are found while the launcher still is their parent.
        for rank in 0..2 {
            if let Some(pid) = rank_pid(launcher, rank) {
                self.0.push(pid);
            }
        }
        for &pid in &self.0 {
            // SAFETY: kill(2) on a process this test started (or one of its ranks).
            unsafe {
                libc::kill(pid as libc::pid_t, libc::SIGKILL);
            }
        }
    }
}

/// The pid of the child of `parent` whose environment has `RANK=rank`.
fn rank_pid(parent: u32, rank: usize) -> Option<u32> {
    let want = format!("RANK={rank}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: u32 = e.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        // `pid (comm) state ppid ...`; the command name may hold spaces and parentheses.
        let ppid: u32 = stat
            .rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        (ppid == parent && environ.split(|&b| b == 0).any(|kv| kv == want.as_bytes()))
            .then_some(pid)
    })
}

fn drain(mut r: impl Read + Send + 'static) -> JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

/// Enough pre-tokenized rows that the run is still training when rank 1 is stopped.
fn write_rows(path: &Path) {
    let lines: Vec<String> = (0..4000u32)
        .map(|i| {
            let ids: Vec<u32> = (0..8).map(|j| (i * 31 + j * 7) % 400 + 3).collect();
            serde_json::json!({ "input_ids": ids, "labels": ids }).to_string()
        })
        .collect();
    std::fs::write(path, lines.join("\n") + "\n").unwrap();
}

#[test]
fn a_stopped_rank_stops_the_run_within_the_watchdog_bound() {
    let dir = common::tmpdir("stuck", "sigstop");
    let data = dir.join("rows.jsonl");
    write_rows(&data);
    let cfg = common::write_config(CONFIG, &dir, "llama3", &data);
    let out = dir.join("out");
    let mut launcher = Command::new(env!("CARGO_BIN_EXE_ferrotune"))
        .args([
            "run",
            "--nproc-per-node",
            "2",
            "full_finetune_distributed",
            "--config",
        ])
        .arg(&cfg)
        .arg(format!("output_dir={}", out.display()))
        // The config key, which wins over the variable (that alone would outlast the test).
        .arg(format!("dist_watchdog_timeout={BOUND}"))
        .env("FERROTUNE_DIST_WATCHDOG", "600")
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("RUST_LOG")
        .current_dir(&dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start ferrotune run");
    let mut cleanup = Cleanup(vec![launcher.id()]);
    let stdout = drain(launcher.stdout.take().unwrap());
    let stderr = drain(launcher.stderr.take().unwrap());
    let log = |stdout: JoinHandle<String>, stderr: JoinHandle<String>| {
        format!("{}{}", stdout.join().unwrap(), stderr.join().unwrap())
    };

    // Wait until the ranks train (rank 0 has logged a step), then stop rank 1.
    let metrics = out.join("logs/metrics.jsonl");
    let start = Instant::now();
    let victim = loop {
        let training = std::fs::read_to_string(&metrics).is_ok_and(|m| m.contains("\"loss\""));
        if training {
            if let Some(pid) = rank_pid(launcher.id(), 1) {
                break pid;
            }
        }
        if let Some(status) = launcher.try_wait().unwrap() {
            panic!(
                "the run ended ({status}) before rank 1 could be stopped:\n{}",
                log(stdout, stderr)
            );
        }
        if start.elapsed() > Duration::from_secs(120) {
            drop(cleanup);
            panic!("no training step within 120 s:\n{}", log(stdout, stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let rank0 = rank_pid(launcher.id(), 0);
    // SAFETY: kill(2) on the rank process found above, a child of the launcher this test started.
    assert_eq!(
        unsafe { libc::kill(victim as libc::pid_t, libc::SIGSTOP) },
        0
    );
    let stopped = Instant::now();

    // The bound plus slack for a machine busy with other tests; past that, it hangs.
    let limit = Duration::from_secs(BOUND + LAUNCHER + 10);
    let status = loop {
        if let Some(status) = launcher.try_wait().unwrap() {
            break status;
        }
        if stopped.elapsed() > limit + Duration::from_secs(30) {
            drop(cleanup);
            panic!(
                "the launcher still runs {} s after rank 1 was stopped:\n{}",
                stopped.elapsed().as_secs(),
                log(stdout, stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = stopped.elapsed();
    let log = log(stdout, stderr);
    eprintln!("the launcher exited {took:?} after SIGSTOP of rank 1:\n{log}");
    assert!(!status.success(), "{log}");
    assert!(took < limit, "took {took:?} (bound {limit:?}):\n{log}");
    assert!(
        log.contains("rank 1 was lost") && log.contains("sent no heartbeat for"),
        "rank 0 names rank 1 and why:\n{log}"
    );
    assert!(
        log.contains(&format!("rank 1 (pid {victim}) is stopped"))
            && log.contains("found stopped: rank 1"),
        "the launcher names the stopped rank:\n{log}"
    );
    // The launcher reaped every rank before it exited: none is left, stopped or not.
    cleanup.0.clear();
    for pid in rank0.into_iter().chain([victim]) {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "rank process {pid} outlived the launcher:\n{log}"
        );
    }
}
