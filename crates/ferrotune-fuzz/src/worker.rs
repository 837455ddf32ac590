//! The worker process: runs one target over inputs the driver sends it, under a memory cap, and
//! the driver's handle on it.
//!
//! Inputs run in a child process, not in the driver, so that an abort (a failed allocation, a
//! double panic, a C library's `abort()`), a kill for memory or a hang is caught and blamed on the
//! input that caused it, not only a panic. The driver holds each input until the worker answers
//! for it, so it knows the culprit without the worker saving it first.
//!
//! Protocol: the driver writes a little-endian u32 length and the input's bytes to the worker's
//! stdin; the worker answers one line `ok <peak RSS KiB> <CPU µs>` on stdout after each input.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::targets::{Scratch, Target};

/// How a worker finished with an input.
#[derive(Debug)]
pub enum Outcome {
    /// It answered; the parser returned (with a value or an error).
    Ok {
        /// The worker's peak resident memory so far (VmHWM), KiB.
        peak_rss_kib: u64,
    },
    /// The worker died on it: a panic, an abort, a signal ([`Worker::reap`] says which).
    Died,
    /// It did not answer within the time limit and was killed.
    Hung,
}

/// The driver's handle on a running worker.
pub struct Worker {
    child: Child,
    stdin: ChildStdin,
    replies: Receiver<(u64, u64)>,
    stderr: Arc<Mutex<Vec<u8>>>,
    stderr_reader: std::thread::JoinHandle<()>,
    /// CPU time the worker reported with its last answer, µs.
    cpu_us: u64,
}

impl Worker {
    /// Starts a worker for `target`, capped at `memory_mib` of address space.
    pub fn spawn(target: &str, memory_mib: u64) -> std::io::Result<Self> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["worker", target, "--memory-mib", &memory_mib.to_string()])
            // One compute thread: CPU time is what the budget counts, and threads only add
            // address space (each reserves a stack and a malloc arena) under the cap.
            .env("RAYON_NUM_THREADS", "1")
            // Backtraces name the function that failed: findings are grouped by it.
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let stdin = child.stdin.take().expect("piped stdin");
        let stdout = child.stdout.take().expect("piped stdout");
        let mut stderr_pipe = child.stderr.take().expect("piped stderr");
        let (tx, replies) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let mut fields = line
                    .split_whitespace()
                    .skip(1)
                    .map(|f| f.parse().unwrap_or(0));
                let reply = (fields.next().unwrap_or(0), fields.next().unwrap_or(0));
                if tx.send(reply).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let tail = stderr.clone();
        let stderr_reader = std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = stderr_pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                let mut t = tail.lock().expect("stderr tail");
                t.extend_from_slice(&buf[..n]);
                let excess = t.len().saturating_sub(8192);
                t.drain(..excess);
            }
        });
        Ok(Self {
            child,
            stdin,
            replies,
            stderr,
            stderr_reader,
            cpu_us: 0,
        })
    }

    /// CPU time the worker has used so far (as of its last answer), seconds.
    pub fn cpu_secs(&self) -> f64 {
        self.cpu_us as f64 / 1e6
    }

    /// Runs one input. After anything but [`Outcome::Ok`] the worker is gone: call
    /// [`Worker::reap`] and start another.
    pub fn run(&mut self, input: &[u8], timeout: Duration) -> Outcome {
        let len = (input.len() as u32).to_le_bytes();
        let sent = self
            .stdin
            .write_all(&len)
            .and_then(|_| self.stdin.write_all(input))
            .and_then(|_| self.stdin.flush());
        if sent.is_ok() {
            // The limit is CPU time, checked each `timeout` of wall time: on a busy machine a
            // worker may wait for a core far longer than it runs. Ten limits of wall time end
            // the wait regardless.
            let pid = self.child.id();
            for _ in 0..10 {
                match self.replies.recv_timeout(timeout) {
                    Ok((peak_rss_kib, cpu_us)) => {
                        self.cpu_us = cpu_us;
                        return Outcome::Ok { peak_rss_kib };
                    }
                    Err(RecvTimeoutError::Timeout) => {
                        let spent = process_cpu_us(pid).saturating_sub(self.cpu_us);
                        if spent as f64 / 1e6 >= timeout.as_secs_f64() {
                            break;
                        }
                    }
                    Err(RecvTimeoutError::Disconnected) => return Outcome::Died,
                }
            }
            // SAFETY: kill(2) on our own child's pid, not yet reaped.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            return Outcome::Hung;
        }
        Outcome::Died
    }

    /// Waits for the worker to end (killing it if it still runs), removes its scratch folder,
    /// and says how it ended.
    pub fn reap(self) -> Reaped {
        let pid = self.child.id() as i32;
        drop(self.stdin);
        let mut status = 0;
        // SAFETY: an all-zero rusage is a valid value for wait4 to overwrite.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // wait4 rather than Child::wait: it also gives the CPU time of a worker that died
        // without answering. A worker still running here reads EOF on stdin and exits.
        // SAFETY: waiting for our own child, whose pid std has not reaped.
        let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        let cpu = usage.ru_utime.tv_sec as f64
            + usage.ru_utime.tv_usec as f64 / 1e6
            + usage.ru_stime.tv_sec as f64
            + usage.ru_stime.tv_usec as f64 / 1e6;
        let status = if rc != pid {
            "unknown".to_string()
        } else if libc::WIFSIGNALED(status) {
            let sig = libc::WTERMSIG(status);
            let name = match sig {
                libc::SIGABRT => "SIGABRT",
                libc::SIGKILL => "SIGKILL",
                libc::SIGSEGV => "SIGSEGV",
                libc::SIGBUS => "SIGBUS",
                libc::SIGILL => "SIGILL",
                libc::SIGFPE => "SIGFPE",
                _ => "signal",
            };
            format!("killed by {name} ({sig})")
        } else {
            format!("exit status {}", libc::WEXITSTATUS(status))
        };
        // The stderr thread ends at the pipe's EOF, once the worker has exited.
        let _ = self.stderr_reader.join();
        let stderr =
            String::from_utf8_lossy(&self.stderr.lock().expect("stderr tail")).into_owned();
        let _ = std::fs::remove_dir_all(scratch_dir(pid as u32));
        Reaped {
            status,
            stderr,
            cpu_secs: cpu,
            peak_rss_kib: usage.ru_maxrss as u64,
        }
    }
}

/// How a worker ended.
pub struct Reaped {
    /// Its exit status, in words.
    pub status: String,
    /// The end of what it printed to stderr.
    pub stderr: String,
    /// The CPU time it used in all, seconds.
    pub cpu_secs: f64,
    /// Its peak resident memory, KiB.
    pub peak_rss_kib: u64,
}

/// The scratch folder of the worker with process id `pid`.
fn scratch_dir(pid: u32) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("ferrotune-fuzz-{pid}"))
}

/// The worker's main loop (`ferrotune-fuzz worker TARGET --memory-mib N`): caps its address
/// space at `memory_mib` MiB, then runs every input it is sent until stdin closes.
pub fn worker_main(target: &Target, memory_mib: Option<u64>) -> std::io::Result<()> {
    if let Some(mib) = memory_mib {
        let bytes = mib << 20;
        let limit = libc::rlimit {
            rlim_cur: bytes,
            rlim_max: bytes,
        };
        // SAFETY: setrlimit with a valid rlimit on this process.
        if unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    let scratch = Scratch::new(scratch_dir(std::process::id()))?;
    let _cleanup = RemoveOnDrop(scratch.dir().to_path_buf());
    let mut stdin = std::io::stdin().lock();
    let mut stdout = std::io::stdout().lock();
    loop {
        let mut len = [0u8; 4];
        if stdin.read_exact(&mut len).is_err() {
            return Ok(());
        }
        let mut input = vec![0u8; u32::from_le_bytes(len) as usize];
        stdin.read_exact(&mut input)?;
        target.run(&scratch, &input);
        // A target's own child processes (the chat template worker) count as its work: their CPU
        // time against the budget, their memory against the cap's report.
        let (child_rss, child_cpu) = children_usage();
        writeln!(
            stdout,
            "ok {} {}",
            peak_rss_kib().max(child_rss),
            cpu_us() + child_cpu
        )?;
        stdout.flush()?;
    }
}

/// Removes a worker's scratch folder when it ends normally (the driver removes those of workers
/// that died).
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// This process's peak resident memory (VmHWM), KiB.
pub fn peak_rss_kib() -> u64 {
    status_kib("/proc/self/status", "VmHWM:")
}

/// The CPU time of the process `pid` (user and system, all threads), µs; 0 if unknown.
fn process_cpu_us(pid: u32) -> u64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0;
    };
    // Fields after the command name (which may hold spaces, in parentheses): utime and stime
    // are the 12th and 13th, in clock ticks.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().collect())
        .unwrap_or_default();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    (ticks(11) + ticks(12)) * 1_000_000 / hz
}

/// The peak resident memory (KiB) and CPU time (µs) of this process's children: those that
/// ended (`RUSAGE_CHILDREN`) and the chat template worker still running.
fn children_usage() -> (u64, u64) {
    // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage of this process's waited-for children into a valid rusage.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    let mut rss = usage.ru_maxrss as u64;
    let mut cpu = us(usage.ru_utime) + us(usage.ru_stime);
    if let Some(pid) = ferrotune_data::chat_template::isolate::worker_pid() {
        cpu += process_cpu_us(pid);
        rss = rss.max(status_kib(&format!("/proc/{pid}/status"), "VmHWM:"));
    }
    (rss, cpu)
}

/// A `kB` field of a `/proc/.../status` file; 0 if unknown.
fn status_kib(path: &str, field: &str) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

/// This process's CPU time (user and system, all threads), µs.
fn cpu_us() -> u64 {
    // SAFETY: an all-zero rusage is a valid value for getrusage to overwrite.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: getrusage of this process into a valid rusage.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let us = |t: libc::timeval| t.tv_sec as u64 * 1_000_000 + t.tv_usec as u64;
    us(usage.ru_utime) + us(usage.ru_stime)
}
