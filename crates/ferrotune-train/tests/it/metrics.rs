//! Metric loggers: the JSONL contract (order, resume truncation, torn lines), the config section,
//! the stdout format, and TensorBoard event files checked byte for byte against TensorBoard's own
//! Python writer and decoded back frame by frame.

use std::fs;
use std::path::{Path, PathBuf};

use ferrotune_train::metrics::{peak_rss_mb, stdout_line, tfevents, MetricLogger};
use serde_json::{json, Value};

fn temp_dir(name: &str) -> PathBuf {
    ferrotune_testing::fresh_dir(&format!("ferrotune-metrics-{}-{name}", std::process::id()))
}

fn step_metrics(step: u64) -> Vec<(&'static str, f64)> {
    vec![
        ("epoch", (step / 4) as f64),
        ("loss", 2.0 / step as f64),
        ("lr", 3e-4 * step as f64 / 10.0),
        ("tokens_per_second", 1000.0 + step as f64 * 0.5),
    ]
}

#[test]
fn disk_logger_writes_ordered_jsonl_lines() {
    let out = temp_dir("disk");
    let section = json!({"_component_": "torchtune.training.metric_logging.DiskLogger",
                         "log_dir": out.join("logs").to_str().unwrap()});
    let mut log = MetricLogger::from_config(Some(&section), &out).unwrap();
    assert_eq!(log.kind(), "DiskLogger");
    let path = out.join("logs/metrics.jsonl");
    assert_eq!(log.path(), Some(path.as_path()));
    log.log_step(
        3,
        &[
            ("epoch", 0.0),
            ("loss", 1.23),
            ("lr", 0.0003),
            ("tokens_per_second", 1234.5),
            ("peak_memory_rss_mb", 512.0),
        ],
    )
    .unwrap();
    // Written before any flush or close: each line is durable as soon as log_step returns.
    let text = fs::read_to_string(&path).unwrap();
    assert_eq!(
        text,
        "{\"step\": 3, \"epoch\": 0, \"loss\": 1.23, \"lr\": 0.0003, \
         \"tokens_per_second\": 1234.5, \"peak_memory_rss_mb\": 512}\n"
    );
    log.log_step(4, &[("loss", f64::NAN), ("grad_norm", f64::INFINITY)])
        .unwrap();
    log.close().unwrap();
    let lines: Vec<Value> = fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        lines[1],
        json!({"step": 4, "loss": "NaN", "grad_norm": "inf"})
    );
    // Keys keep the order they were given in, `step` first.
    let keys: Vec<&str> = lines[0]
        .as_object()
        .unwrap()
        .keys()
        .map(|k| k.as_str())
        .collect();
    assert!(keys.contains(&"tokens_per_second"));
    assert!(text.starts_with("{\"step\": 3, \"epoch\""));
    // After close, logging is an error, not a silent loss.
    let err = log.log_step(5, &[("loss", 1.0)]).unwrap_err();
    assert!(err.to_string().contains("after close"), "{err}");
    // `step` is the step argument, never a metric.
    let mut log = MetricLogger::disk(&path).unwrap();
    assert!(log.log_step(5, &[("step", 5.0)]).is_err());
}

/// A run killed after step 5 (mid-way through writing step 6) and resumed from its step-3
/// checkpoint leaves the same file as a run that was never interrupted.
#[test]
fn resumed_run_matches_uninterrupted_run() {
    let dir = temp_dir("resume");
    let straight = dir.join("straight/metrics.jsonl");
    let mut log = MetricLogger::disk(&straight).unwrap();
    for s in 1..=8 {
        log.log_step(s, &step_metrics(s)).unwrap();
    }
    log.close().unwrap();

    let resumed = dir.join("resumed/metrics.jsonl");
    let mut log = MetricLogger::disk(&resumed).unwrap();
    for s in 1..=5 {
        log.log_step(s, &step_metrics(s)).unwrap();
    }
    drop(log);
    // What a `kill -9` in the middle of a write leaves: a line without its newline.
    let mut torn = fs::read(&resumed).unwrap();
    torn.extend_from_slice(b"{\"step\": 6, \"epoch\": 1, \"lo");
    fs::write(&resumed, &torn).unwrap();

    let section = json!({"_component_": "DiskLogger",
                         "log_dir": resumed.parent().unwrap().to_str().unwrap()});
    let mut log = MetricLogger::from_config(Some(&section), &dir).unwrap();
    log.truncate_after(3).unwrap();
    let after_truncate = fs::read_to_string(&resumed).unwrap();
    assert_eq!(after_truncate.lines().count(), 3, "{after_truncate}");
    for s in 4..=8 {
        log.log_step(s, &step_metrics(s)).unwrap();
    }
    log.close().unwrap();
    assert_eq!(
        fs::read_to_string(&resumed).unwrap(),
        fs::read_to_string(&straight).unwrap()
    );

    // truncate_after(0) starts afresh (a new run reusing an output folder).
    let mut log = MetricLogger::disk(&resumed).unwrap();
    log.truncate_after(0).unwrap();
    log.log_step(1, &step_metrics(1)).unwrap();
    assert_eq!(fs::read_to_string(&resumed).unwrap().lines().count(), 1);
}

#[test]
fn opening_drops_a_torn_last_line_before_appending() {
    let dir = temp_dir("torn");
    let path = dir.join("metrics.jsonl");
    fs::write(&path, "{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"lo").unwrap();
    let mut log = MetricLogger::disk(&path).unwrap();
    log.log_step(2, &[("loss", 1.5)]).unwrap();
    assert_eq!(
        fs::read_to_string(&path).unwrap(),
        "{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\": 1.5}\n"
    );
}

#[test]
fn lines_carry_the_run_id_and_a_resume_keeps_only_its_runs_lines() {
    let dir = temp_dir("run-id");
    let path = dir.join("metrics.jsonl");
    // Steps 1-2 of run "a", then (mixed in by a user moving files) steps 1-3 of run "b".
    let mut log = MetricLogger::disk(&path).unwrap();
    log.set_run_id("a");
    for s in 1..=2 {
        log.log_step(s, &[("loss", 2.0)]).unwrap();
    }
    log.set_run_id("b");
    for s in 1..=3 {
        log.log_step(s, &[("loss", 1.0)]).unwrap();
    }
    log.close().unwrap();
    let first = fs::read_to_string(&path).unwrap();
    assert_eq!(
        first.lines().next(),
        Some("{\"step\": 1, \"run_id\": \"a\", \"loss\": 2}")
    );
    // Run "b" resumed from its step 2: its steps 1-2 stay, run "a"'s lines go.
    let mut log = MetricLogger::disk(&path).unwrap();
    log.set_run_id("b");
    log.truncate_after(2).unwrap();
    log.close().unwrap();
    assert_eq!(
        fs::read_to_string(&path).unwrap(),
        "{\"step\": 1, \"run_id\": \"b\", \"loss\": 1}\n{\"step\": 2, \"run_id\": \"b\", \"loss\": 1}\n"
    );
}

#[test]
fn truncate_names_a_corrupt_line() {
    let dir = temp_dir("corrupt");
    let path = dir.join("metrics.jsonl");
    fs::write(&path, "{\"step\": 1}\nnot json\n{\"step\": 3}\n").unwrap();
    let mut log = MetricLogger::disk(&path).unwrap();
    let err = format!("{:#}", log.truncate_after(2).unwrap_err());
    assert!(err.contains("metrics.jsonl:2"), "{err}");
    // Nothing was lost on the error.
    assert_eq!(fs::read_to_string(&path).unwrap().lines().count(), 3);
}

#[test]
fn config_section_picks_the_logger_and_rejects_bad_keys() {
    let out = temp_dir("config");
    // No section: a DiskLogger in {output_dir}/logs.
    let log = MetricLogger::from_config(None, &out).unwrap();
    assert_eq!(log.path(), Some(out.join("logs/metrics.jsonl").as_path()));
    // The older torchtune.utils path and a custom file name.
    let s = json!({"_component_": "torchtune.utils.metric_logging.DiskLogger",
                   "filename": "run.jsonl"});
    let log = MetricLogger::from_config(Some(&s), &out).unwrap();
    assert_eq!(log.path(), Some(out.join("logs/run.jsonl").as_path()));
    let s = json!({"_component_": "torchtune.training.metric_logging.StdoutLogger"});
    let log = MetricLogger::from_config(Some(&s), &out).unwrap();
    assert_eq!((log.kind(), log.path()), ("StdoutLogger", None));

    let err = |v: Value| {
        format!(
            "{:#}",
            MetricLogger::from_config(Some(&v), &out).unwrap_err()
        )
    };
    // The trackers take torchtune's options, and only those (issue 43: they were refused).
    let e = err(
        json!({"_component_": "torchtune.training.metric_logging.WandBLogger",
                       "projcet": "x"}),
    );
    assert!(
        e.contains("WandBLogger") && e.contains("metric_logger.projcet"),
        "{e}"
    );
    let e = err(json!({"_component_": "DiskLogger", "log_dri": "x"}));
    assert!(e.contains("metric_logger.log_dri"), "{e}");
    let e = err(json!({"_component_": "my.FancyLogger"}));
    assert!(e.contains("my.FancyLogger"), "{e}");
    let e = err(json!({"log_dir": "x"}));
    assert!(e.contains("_component_"), "{e}");
    let e = err(json!({"_component_": "DiskLogger", "log_dir": "${output_dir}/logs"}));
    assert!(e.contains("unresolved"), "{e}");
    let e = err(json!({"_component_": "TensorBoardLogger", "organize_logs": "yes"}));
    assert!(e.contains("organize_logs"), "{e}");
}

#[test]
fn stdout_lines_look_like_torchtune() {
    assert_eq!(
        stdout_line(
            3,
            &[
                ("epoch", 0.0),
                ("loss", 1.23),
                ("lr", 0.0003),
                ("tokens_per_second", 1234.5)
            ]
        ),
        "Step 3 | epoch:0 loss:1.2300 lr:0.0003 tokens_per_second:1234.5\n"
    );
    assert_eq!(
        stdout_line(
            7,
            &[("lr", 2.0e-5 / 3.0), ("tokens_per_second", 987.654321)]
        ),
        "Step 7 | lr:0.00000666667 tokens_per_second:987.654\n"
    );
}

#[test]
fn crc32c_matches_the_standard_check_value() {
    assert_eq!(tfevents::crc32c(b"123456789"), 0xE306_9283);
    assert_eq!(tfevents::crc32c(b""), 0);
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Two frames as TensorBoard's Python `RecordWriter` writes them for
/// `Event(wall_time=1700000000.5, file_version="brain.Event:2")` and
/// `Event(wall_time=1700000001.25, step=3, summary=Summary(value=[Value(tag="loss",
/// simple_value=1.23), Value(tag="lr", simple_value=0.0003)]))` (tensorboard 2.21,
/// `tensorboard.summary.writer.record_writer.RecordWriter` on `event_pb2.Event.SerializeToString`).
const PYTHON_FRAMES: &str = "1800000000000000a37f4b220900002040fc54d9411a0d627261696e2e4576656e74\
3a322b3531102500000000000000eabc36f30900005040fc54d94110032a180a0b0a046c6f737315a4709d3f0a090a02\
6c721552499d394ee836b3";

#[test]
fn event_frames_match_tensorboards_python_writer() {
    let mut ours = tfevents::frame(&tfevents::file_version_event(1_700_000_000.5));
    ours.extend(tfevents::frame(&tfevents::scalars_event(
        1_700_000_001.25,
        3,
        &[("loss", 1.23), ("lr", 0.0003)],
    )));
    assert_eq!(ours, hex(PYTHON_FRAMES));
}

/// `Event(wall_time=1700000002.75, step=4, session_log=SessionLog(status=START))` framed by
/// TensorBoard's `RecordWriter`: the resume marker `truncate_after(3)` writes.
#[test]
fn session_start_frame_matches_tensorboards_python_writer() {
    let ours = tfevents::frame(&tfevents::session_start_event(1_700_000_002.75, 4));
    assert_eq!(
        ours,
        hex("0f000000000000006d532b09090000b040fc54d94110043a020801421bfef6")
    );
}

/// A decoded protobuf field: number and either a varint, 64/32-bit raw value or bytes.
#[derive(Debug, Clone)]
enum Field {
    Varint(u64),
    Fixed64([u8; 8]),
    Fixed32([u8; 4]),
    Bytes(Vec<u8>),
}

fn read_varint(b: &[u8], i: &mut usize) -> u64 {
    let (mut v, mut shift) = (0u64, 0);
    loop {
        let byte = b[*i];
        *i += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return v;
        }
        shift += 7;
    }
}

/// A minimal protobuf wire-format decoder, independent of the encoder under test.
fn decode(b: &[u8]) -> Vec<(u64, Field)> {
    let mut i = 0;
    let mut out = Vec::new();
    while i < b.len() {
        let key = read_varint(b, &mut i);
        let field = match key & 7 {
            0 => Field::Varint(read_varint(b, &mut i)),
            1 => {
                i += 8;
                Field::Fixed64(b[i - 8..i].try_into().unwrap())
            }
            2 => {
                let n = read_varint(b, &mut i) as usize;
                i += n;
                Field::Bytes(b[i - n..i].to_vec())
            }
            5 => {
                i += 4;
                Field::Fixed32(b[i - 4..i].try_into().unwrap())
            }
            w => panic!("unexpected wire type {w}"),
        };
        out.push((key >> 3, field));
    }
    out
}

/// Splits a TFRecord file into its records, checking both masked CRCs of each frame.
fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut i = 0;
    let mut out = Vec::new();
    while i < bytes.len() {
        let len_bytes = &bytes[i..i + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let len_crc = u32::from_le_bytes(bytes[i + 8..i + 12].try_into().unwrap());
        assert_eq!(len_crc, tfevents::masked_crc(len_bytes), "length CRC");
        let data = &bytes[i + 12..i + 12 + len];
        let data_crc = u32::from_le_bytes(bytes[i + 12 + len..i + 16 + len].try_into().unwrap());
        assert_eq!(data_crc, tfevents::masked_crc(data), "data CRC");
        out.push(data.to_vec());
        i += 16 + len;
    }
    out
}

#[derive(Debug, Default)]
struct Event {
    wall_time: f64,
    step: u64,
    file_version: Option<String>,
    scalars: Vec<(String, f32)>,
    session_start: bool,
}

fn parse_event(data: &[u8]) -> Event {
    let mut e = Event::default();
    for (num, f) in decode(data) {
        match (num, f) {
            (1, Field::Fixed64(b)) => e.wall_time = f64::from_le_bytes(b),
            (2, Field::Varint(v)) => e.step = v,
            (3, Field::Bytes(b)) => e.file_version = Some(String::from_utf8(b).unwrap()),
            (5, Field::Bytes(summary)) => {
                for (vn, value) in decode(&summary) {
                    let Field::Bytes(value) = value else { panic!() };
                    assert_eq!(vn, 1);
                    let (mut tag, mut v) = (String::new(), f32::NAN);
                    for (n, f) in decode(&value) {
                        match (n, f) {
                            (1, Field::Bytes(t)) => tag = String::from_utf8(t).unwrap(),
                            (2, Field::Fixed32(x)) => v = f32::from_le_bytes(x),
                            other => panic!("unexpected Summary.Value field {other:?}"),
                        }
                    }
                    e.scalars.push((tag, v));
                }
            }
            (7, Field::Bytes(log)) => {
                let fields = decode(&log);
                assert!(matches!(fields[..], [(1, Field::Varint(1))]), "{fields:?}");
                e.session_start = true;
            }
            other => panic!("unexpected Event field {other:?}"),
        }
    }
    e
}

fn event_file(dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files.into_iter().next().unwrap()
}

#[test]
fn tensorboard_logger_writes_a_readable_event_file() {
    let out = temp_dir("tb");
    let log_dir = out.join("tb");
    let s = json!({"_component_": "torchtune.training.metric_logging.TensorBoardLogger",
                   "log_dir": log_dir.to_str().unwrap(), "organize_logs": false});
    let mut log = MetricLogger::from_config(Some(&s), &out).unwrap();
    let before = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    for step in 1..=3 {
        log.log_step(step, &step_metrics(step)).unwrap();
    }
    log.truncate_after(2).unwrap();
    log.log_step(3, &[("loss", 0.5)]).unwrap();
    log.close().unwrap();

    let path = event_file(&log_dir);
    assert_eq!(log.path(), Some(path.as_path()));
    let name = path.file_name().unwrap().to_str().unwrap();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let events: Vec<Event> = records(&fs::read(&path).unwrap())
        .iter()
        .map(|r| parse_event(r))
        .collect();
    assert_eq!(events.len(), 6);
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    for (i, e) in events[1..4].iter().enumerate() {
        let step = i as u64 + 1;
        assert_eq!(e.step, step);
        assert!((e.wall_time - before).abs() < 60.0, "{}", e.wall_time);
        let want: Vec<(String, f32)> = step_metrics(step)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v as f32))
            .collect();
        assert_eq!(e.scalars, want);
    }
    // The resume marker: SessionLog START at step 3 purges steps >= 3 in TensorBoard.
    assert!(events[4].session_start && events[4].step == 3);
    assert_eq!(events[5].scalars, vec![("loss".to_string(), 0.5)]);

    // organize_logs (torchtune's default): the event file goes in a run_0_* subfolder.
    let s =
        json!({"_component_": "TensorBoardLogger", "log_dir": out.join("org").to_str().unwrap()});
    let log = MetricLogger::from_config(Some(&s), &out).unwrap();
    let run_dir = log.path().unwrap().parent().unwrap();
    assert_eq!(run_dir.parent().unwrap(), out.join("org"));
    assert!(run_dir
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .starts_with("run_0_"));
}

/// Set in the copy of this crate's test binary that a test needing a process of its own runs in.
const ALONE: &str = "FERROTUNE_TEST_ALONE";

#[test]
fn peak_rss_follows_allocations() {
    // The peak is the whole process's: the other tests of this binary, running beside it, raise
    // it past what this test allocates. So it runs in a copy of the binary, alone.
    if !ferrotune_testing::in_own_process(ALONE, module_path!(), "peak_rss_follows_allocations") {
        return;
    }
    let before = peak_rss_mb();
    assert!(before > 1.0, "{before}");
    // Touch 256 MiB so it is resident, not just reserved.
    let mut big = vec![0u8; 256 << 20];
    for i in (0..big.len()).step_by(4096) {
        big[i] = 1;
    }
    std::hint::black_box(&big);
    let after = peak_rss_mb();
    assert!(
        after >= before + 200.0,
        "before {before} MiB, after {after} MiB"
    );
    drop(big);
    // A high-water mark stays up after the memory is freed (the kernel's RSS counters are
    // approximate per CPU, hence the slack).
    let later = peak_rss_mb();
    assert!(
        later >= after - 16.0,
        "after {after} MiB, later {later} MiB"
    );
}

/// Not a test by itself: the writer process that `kill_9_loses_at_most_the_last_line` starts
/// (this test binary again, filtered to this name) and kills.
#[test]
fn metrics_child_writer_process() {
    let Some(path) = std::env::var_os("FERROTUNE_METRICS_CHILD") else {
        return;
    };
    let mut log = MetricLogger::disk(Path::new(&path)).unwrap();
    let start = std::time::Instant::now();
    // Bounded, in case the parent dies before killing it.
    for step in 1..=5_000_000 {
        log.log_step(step, &step_metrics(step)).unwrap();
        if start.elapsed().as_secs() > 60 {
            break;
        }
    }
}

#[test]
fn kill_9_loses_at_most_the_last_line() {
    let dir = temp_dir("kill");
    let path = dir.join("metrics.jsonl");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            ferrotune_testing::test_path(module_path!(), "metrics_child_writer_process").as_str(),
            "--test-threads=1",
            "--nocapture",
        ])
        .env("FERROTUNE_METRICS_CHILD", &path)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    while fs::metadata(&path).map_or(0, |m| m.len()) < 200_000 {
        assert!(
            t0.elapsed().as_secs() < 60,
            "the writer process wrote nothing"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap(); // SIGKILL: no destructors, no flush
    child.wait().unwrap();
    let text = fs::read_to_string(&path).unwrap();
    let complete: Vec<&str> = text
        .split_inclusive('\n')
        .filter(|l| l.ends_with('\n'))
        .collect();
    for (i, line) in complete.iter().enumerate() {
        let v: Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["step"], json!(i + 1), "line {}", i + 1);
    }
    // A resume picks up cleanly after the last whole line.
    let last = complete.len() as u64;
    let mut log = MetricLogger::disk(&path).unwrap();
    log.truncate_after(last).unwrap();
    log.log_step(last + 1, &step_metrics(last + 1)).unwrap();
    let lines: Vec<Value> = fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len() as u64, last + 1);
    assert_eq!(lines.last().unwrap()["step"], json!(last + 1));
}

#[test]
fn an_unreachable_tracker_costs_nothing_of_the_log_and_is_reported() {
    let out = temp_dir("unreachable");
    // A loopback port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let s = json!({"_component_": "torchtune.training.metric_logging.MLFlowLogger",
                   "tracking_uri": format!("http://127.0.0.1:{port}"),
                   "experiment_name": "x"});
    let mut log = MetricLogger::from_config(Some(&s), &out).unwrap();
    assert_eq!(log.kind(), "MLFlowLogger");
    assert_eq!(log.path(), Some(out.join("logs/metrics.jsonl").as_path()));
    log.log_config(&json!({"lr": 0.1}));
    for step in 1..=5 {
        log.log_step(step, &[("loss", 1.0 / step as f64)]).unwrap();
    }
    log.close().unwrap();
    let r = log.tracker_report().unwrap().clone();
    assert!(!r.complete());
    assert_eq!((r.steps, r.steps_failed, r.config_failed), (5, 5, true));
    assert!(
        r.first_error.as_deref().unwrap().contains("cannot start"),
        "{r:?}"
    );
    let summary = r.summary(log.path());
    assert!(
        summary.contains("5 of 5 steps, the config not logged"),
        "{summary}"
    );
    // The JSONL log beside it holds every step.
    let text = std::fs::read_to_string(out.join("logs/metrics.jsonl")).unwrap();
    assert_eq!(text.lines().count(), 5);

    // No tracking URI: the same (MLflow's local ./mlruns store is the Python client's own).
    let s = json!({"_component_": "MLFlowLogger", "log_dir": out.join("b").display().to_string()});
    let mut log = MetricLogger::from_config(Some(&s), &out).unwrap();
    log.log_step(1, &[("loss", 1.0)]).unwrap();
    log.close().unwrap();
    let r = log.tracker_report().unwrap();
    assert!(
        r.first_error
            .as_deref()
            .unwrap()
            .contains("no tracking URI"),
        "{r:?}"
    );
    assert_eq!(r.steps_failed, 1);
}

#[test]
fn tracker_options_are_checked() {
    use ferrotune_train::metrics::check_logger_config;
    let ok = json!({"_component_": "torchtune.training.metric_logging.WandBLogger",
                    "project": "p", "entity": "e", "group": "g", "tags": ["a"], "log_dir": "/x"});
    check_logger_config(Some(&ok)).unwrap();
    let ok = json!({"_component_": "CometLogger", "online": false, "experiment_name": "n"});
    check_logger_config(Some(&ok)).unwrap();
    let bad = json!({"_component_": "CometLogger", "online": "no"});
    let e = format!("{:#}", check_logger_config(Some(&bad)).unwrap_err());
    assert!(e.contains("metric_logger.online"), "{e}");
    let bad = json!({"_component_": "MLFlowLogger", "log_checkpoint": "yes"});
    let e = format!("{:#}", check_logger_config(Some(&bad)).unwrap_err());
    assert!(e.contains("metric_logger.log_checkpoint"), "{e}");
}
