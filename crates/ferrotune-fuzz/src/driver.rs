//! The fuzzing loop: for each target, the corpus and the regression inputs as they are, then
//! mutations of them, each run in a worker under a time limit and a memory cap, until the
//! target's CPU budget or exec count is spent. Findings are saved under `crashes/<target>/`.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::mutate::{mutate, Rng};
use crate::targets::Target;
use crate::worker::{Outcome, Worker};

/// What a run does.
#[derive(Debug, Clone)]
pub struct Options {
    /// CPU seconds per target (worker and driver time together), after which it stops.
    pub cpu_secs: f64,
    /// Inputs per target, after which it stops (whichever of the two comes first).
    pub max_execs: u64,
    /// The seed of the mutations: a run is reproducible from it.
    pub seed: u64,
    /// CPU time an input may take before it counts as a hang (checked each this often of wall
    /// time, for at most ten times this).
    pub timeout: Duration,
    /// The workers' address-space cap, MiB (an allocation past it aborts: a finding).
    pub memory_mib: u64,
    /// The largest input made, bytes.
    pub max_len: usize,
    /// The folder of the seeds, one subfolder per target.
    pub corpus: PathBuf,
    /// The folder of inputs that once failed, one subfolder per target; run as seeds too.
    pub regressions: PathBuf,
    /// Where findings are saved (`<target>/<kind>-<hash>` and a `.txt` saying what happened).
    pub crashes: PathBuf,
    /// Print progress every this often (None: quiet).
    pub progress: Option<Duration>,
}

/// One input that broke a target.
#[derive(Debug, Clone)]
pub struct Finding {
    /// `panic`, `abort`, `signal`, `hang`, ...
    pub kind: String,
    /// What the worker said (its stderr's end) or why it was stopped.
    pub message: String,
    /// Where the input was saved, if it was (the first few of each signature are).
    pub saved: Option<PathBuf>,
    /// The kind and the innermost ferrotune function of the backtrace: findings with the same
    /// signature are most likely one bug.
    pub signature: String,
}

/// A target's numbers after a run.
#[derive(Debug, Clone, Default)]
pub struct Stats {
    /// The target's name.
    pub target: String,
    /// Inputs run.
    pub execs: u64,
    /// CPU seconds used (workers and driver).
    pub cpu_secs: f64,
    /// Wall-clock seconds.
    pub wall_secs: f64,
    /// The inputs that broke it.
    pub findings: Vec<Finding>,
    /// The highest peak RSS of any worker, KiB.
    pub peak_rss_kib: u64,
    /// The wall-clock time of the slowest input that finished.
    pub slowest: Duration,
}

/// The inputs in `dir`, sorted by file name (none if it does not exist).
fn read_inputs(dir: &Path) -> Vec<Vec<u8>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut paths: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_none_or(|e| e != "txt"))
        .collect();
    paths.sort();
    paths.iter().filter_map(|p| std::fs::read(p).ok()).collect()
}

/// This process's own CPU time, seconds (the mutations and bookkeeping).
fn own_cpu_secs() -> f64 {
    // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage of this process into a valid rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let s = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    s(usage.ru_utime) + s(usage.ru_stime)
}

/// A short stable name for an input (FNV-1a).
fn hash(data: &[u8]) -> String {
    let h = data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    });
    format!("{h:016x}")
}

/// What kind of failure a dead worker's status and stderr show.
fn classify(status: &str, stderr: &str) -> &'static str {
    if stderr.contains("memory allocation of") || stderr.contains("capacity overflow") {
        "oom"
    } else if stderr.contains("panicked at") {
        "panic"
    } else if status.contains("SIGABRT") {
        "abort"
    } else if status.contains("killed by") {
        "signal"
    } else {
        "exit"
    }
}

/// The innermost frame of a panic's or abort's backtrace in ferrotune's own code (the std and
/// candle frames above it say less about where the bug is).
fn culprit(stderr: &str) -> String {
    stderr
        .lines()
        .filter_map(|l| l.trim().split_once(": ").map(|(_, f)| f))
        .find(|f| f.starts_with("ferrotune_") && !f.starts_with("ferrotune_fuzz"))
        .unwrap_or("?")
        .to_string()
}

/// Fuzzes `target` as `opts` says.
pub fn fuzz(target: &Target, opts: &Options) -> std::io::Result<Stats> {
    let mut seeds = read_inputs(&opts.corpus.join(target.name));
    seeds.extend(read_inputs(&opts.regressions.join(target.name)));
    if seeds.is_empty() {
        seeds.push(Vec::new());
    }
    // Each target its own stream, so that running one alone mutates as running all does.
    let mut rng = Rng::new(opts.seed ^ fnv(target.name));
    let mut stats = Stats {
        target: target.name.to_string(),
        ..Stats::default()
    };
    let started = Instant::now();
    let own_start = own_cpu_secs();
    let mut done_cpu = 0.0; // CPU of workers already reaped
    let mut worker = Worker::spawn(target.name, opts.memory_mib)?;
    let mut last_progress = Instant::now();
    let mut saved_per_signature: std::collections::HashMap<String, usize> = Default::default();
    loop {
        let cpu = done_cpu + worker.cpu_secs() + (own_cpu_secs() - own_start);
        if stats.execs >= opts.max_execs || cpu >= opts.cpu_secs {
            break;
        }
        let i = stats.execs as usize;
        let input = if i < seeds.len() {
            seeds[i].clone()
        } else {
            let a = &seeds[rng.below(seeds.len())];
            let b = &seeds[rng.below(seeds.len())];
            mutate(&mut rng, a, b, target.dictionary, target.text, opts.max_len)
        };
        let t0 = Instant::now();
        let outcome = worker.run(&input, opts.timeout);
        stats.execs += 1;
        match outcome {
            Outcome::Ok { peak_rss_kib } => {
                stats.peak_rss_kib = stats.peak_rss_kib.max(peak_rss_kib);
                stats.slowest = stats.slowest.max(t0.elapsed());
            }
            Outcome::Died | Outcome::Hung => {
                let hung = matches!(outcome, Outcome::Hung);
                let reaped =
                    std::mem::replace(&mut worker, Worker::spawn(target.name, opts.memory_mib)?)
                        .reap();
                done_cpu += reaped.cpu_secs;
                stats.peak_rss_kib = stats.peak_rss_kib.max(reaped.peak_rss_kib);
                let (kind, message) = if hung {
                    (
                        "hang",
                        format!("no answer within {:?} of CPU time", opts.timeout),
                    )
                } else {
                    (
                        classify(&reaped.status, &reaped.stderr),
                        format!("{}\n{}", reaped.status, reaped.stderr.trim_end()),
                    )
                };
                let signature = format!("{kind} in {}", culprit(&reaped.stderr));
                let n = saved_per_signature.entry(signature.clone()).or_default();
                *n += 1;
                let saved = (*n <= 3)
                    .then(|| save(opts, target, kind, &input, &message).ok())
                    .flatten();
                if opts.progress.is_some() && saved.is_some() {
                    eprintln!(
                        "[{}] {kind} on a {}-byte input{}: {}",
                        target.name,
                        input.len(),
                        saved
                            .as_ref()
                            .map(|p| format!(" (saved as {})", p.display()))
                            .unwrap_or_default(),
                        message.lines().take(4).collect::<Vec<_>>().join(" | ")
                    );
                }
                stats.findings.push(Finding {
                    kind: kind.to_string(),
                    message,
                    saved,
                    signature,
                });
            }
        }
        if let Some(every) = opts.progress {
            if last_progress.elapsed() >= every {
                last_progress = Instant::now();
                eprintln!(
                    "[{}] {} execs, {:.0} CPU s, {} findings, peak RSS {} MiB",
                    target.name,
                    stats.execs,
                    cpu,
                    stats.findings.len(),
                    stats.peak_rss_kib / 1024
                );
            }
        }
    }
    let last = worker.reap();
    stats.cpu_secs = done_cpu + last.cpu_secs + (own_cpu_secs() - own_start);
    stats.peak_rss_kib = stats.peak_rss_kib.max(last.peak_rss_kib);
    stats.wall_secs = started.elapsed().as_secs_f64();
    Ok(stats)
}

fn fnv(s: &str) -> u64 {
    u64::from_str_radix(&hash(s.as_bytes()), 16).unwrap_or(0)
}

/// Saves a finding's input and what happened, returning the input's path.
fn save(
    opts: &Options,
    target: &Target,
    kind: &str,
    input: &[u8],
    message: &str,
) -> std::io::Result<PathBuf> {
    let dir = opts.crashes.join(target.name);
    std::fs::create_dir_all(&dir)?;
    let path = dir.join(format!("{kind}-{}", hash(input)));
    std::fs::write(&path, input)?;
    std::fs::write(path.with_extension("txt"), message)?;
    Ok(path)
}

/// The report's table: one line per target.
pub fn report(all: &[Stats]) -> String {
    let mut out = format!(
        "{:<18} {:>8} {:>9} {:>8} {:>9} {:>13} {:>11}\n",
        "target", "CPU s", "execs", "execs/s", "findings", "peak RSS MiB", "slowest ms"
    );
    for s in all {
        out += &format!(
            "{:<18} {:>8.1} {:>9} {:>8.0} {:>9} {:>13.0} {:>11.0}\n",
            s.target,
            s.cpu_secs,
            s.execs,
            s.execs as f64 / s.cpu_secs.max(1e-9),
            s.findings.len(),
            s.peak_rss_kib as f64 / 1024.0,
            s.slowest.as_secs_f64() * 1e3,
        );
    }
    out
}
