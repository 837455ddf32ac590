//! torchrun's part of `ferrotune run`: with `--nproc-per-node N` (and `--nnodes M`) greater than
//! one process in all, start N copies of this executable running the same recipe, each with the
//! environment torchrun gives its workers (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`, ...), wait for
//! them, and stop them all when one fails.

use std::ffi::OsString;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering::SeqCst};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;

/// How long the other ranks get to stop on their own after one fails (their liveness watchdog
/// normally stops them within a second) before they are sent SIGTERM. Together with
/// [`TERM_GRACE`] it is what the launcher adds to the ranks' watchdog bound (`docs/src/reliability.md`
/// promises the sum plus a second or so).
const GRACE: Duration = Duration::from_secs(5);
/// How long SIGTERMed ranks get before SIGKILL (a stopped process does not act on SIGTERM
/// until it is continued; SIGKILL ends it anyway).
const TERM_GRACE: Duration = Duration::from_secs(5);

/// The launcher flags of `ferrotune run` (torchrun's; its underscore spellings work too).
#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Processes (ranks) per node; more than one process in all makes a distributed run.
    #[arg(long = "nproc-per-node", alias = "nproc_per_node", default_value_t = 1)]
    pub nproc_per_node: usize,
    /// Number of nodes (machines); run the same command on each with its own --node-rank.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// This node's index, 0..nnodes.
    #[arg(long = "node-rank", alias = "node_rank", default_value_t = 0)]
    pub node_rank: usize,
    /// Host of node 0, where rank 0 serves the rendezvous store [default: 127.0.0.1].
    #[arg(long = "master-addr", alias = "master_addr")]
    pub master_addr: Option<String>,
    /// Port of the rendezvous store [default: a free port with one node, else 29500].
    #[arg(long = "master-port", alias = "master_port")]
    pub master_port: Option<u16>,
    /// Accepted for torchrun compatibility; a run on one node needs nothing more.
    #[arg(long, hide = true)]
    pub standalone: bool,
}

impl LaunchArgs {
    /// The total number of processes, after checking the flags.
    pub fn world_size(&self) -> Result<usize> {
        if self.nproc_per_node == 0 {
            bail!("--nproc-per-node must be at least 1");
        }
        if self.nnodes == 0 {
            bail!("--nnodes must be at least 1");
        }
        if self.node_rank >= self.nnodes {
            bail!(
                "--node-rank {} is out of range for --nnodes {} (node ranks count from 0)",
                self.node_rank,
                self.nnodes
            );
        }
        Ok(self.nproc_per_node * self.nnodes)
    }
}

/// The flags the launcher consumes, and whether each takes a value.
const LAUNCH_FLAGS: &[(&str, bool)] = &[
    ("--nproc-per-node", true),
    ("--nproc_per_node", true),
    ("--nnodes", true),
    ("--node-rank", true),
    ("--node_rank", true),
    ("--master-addr", true),
    ("--master_addr", true),
    ("--master-port", true),
    ("--master_port", true),
    ("--standalone", false),
];

/// The arguments for a rank: this process's own, from `run` on, without the launcher flags.
/// Working from the command line itself (not from the parsed arguments) passes on every other
/// flag of `run` exactly as given.
fn child_args(argv: &[OsString]) -> Result<Vec<OsString>> {
    let run = argv
        .iter()
        .skip(1)
        .position(|a| a == "run")
        .context("the launcher found no `run` in its command line")?
        + 1;
    let mut out = vec![argv[run].clone()];
    let mut rest = argv[run + 1..].iter();
    while let Some(arg) = rest.next() {
        let text = arg.to_string_lossy();
        if text == "--" {
            out.push(arg.clone());
            out.extend(rest.cloned());
            break;
        }
        let name = text.split('=').next().unwrap_or_default();
        match LAUNCH_FLAGS.iter().find(|(flag, _)| *flag == name) {
            Some((_, takes_value)) => {
                if *takes_value && !text.contains('=') {
                    rest.next();
                }
            }
            None => out.push(arg.clone()),
        }
    }
    Ok(out)
}

static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    // Only an atomic store: anything more is not async-signal-safe.
    SIGNAL.store(sig, SeqCst);
}

struct Rank {
    rank: usize,
    pid: u32,
    status: Option<ExitStatus>,
}

impl Rank {
    fn signal(&self, sig: libc::c_int) {
        if self.status.is_none() {
            // SAFETY: kill(2) on our own child. Its waiter thread may have reaped it a moment
            // ago, but pids are not reused that fast.
            unsafe {
                libc::kill(self.pid as libc::pid_t, sig);
            }
        }
    }
}

/// A rank's end: its index in the list and its exit status.
type Ended = (usize, std::io::Result<ExitStatus>);

/// Starts this node's ranks of the recipe and waits for them. Returns an error when a rank
/// fails; ends this process (status 128 + signal) after forwarding SIGINT/SIGTERM/SIGHUP.
pub fn launch(args: &LaunchArgs) -> Result<()> {
    let world_size = args.world_size()?;
    let n = args.nproc_per_node;
    let argv: Vec<OsString> = std::env::args_os().collect();
    let child_args = child_args(&argv)?;
    let exe = std::env::current_exe().context("cannot find this executable to start the ranks")?;
    let master_addr = args
        .master_addr
        .clone()
        .unwrap_or_else(|| "127.0.0.1".to_string());
    let master_port = match args.master_port {
        Some(p) => p,
        None if args.nnodes == 1 => free_port(&master_addr)?,
        None => 29500,
    };
    let threads = rayon_threads_per_rank(n);
    eprintln!(
        "ferrotune run: starting {n} rank(s) of {world_size} on this node \
         (rendezvous at {master_addr}:{master_port})"
    );

    // Before any child exists, so that a signal in between is not lost; children get the default
    // dispositions back when they exec.
    for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
        // SAFETY: the handler only stores to an atomic.
        unsafe {
            libc::signal(
                sig,
                on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t,
            );
        }
    }

    // One thread per rank blocks in wait(), so that ends arrive in the order they happen: the
    // first failure is the cause, the ones after it are usually its consequence.
    let (ended_tx, ended) = std::sync::mpsc::channel::<Ended>();
    let mut ranks: Vec<Rank> = Vec::with_capacity(n);
    for local in 0..n {
        let rank = args.node_rank * n + local;
        let mut cmd = Command::new(&exe);
        cmd.args(&child_args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_WORLD_SIZE", n.to_string())
            .env("GROUP_RANK", args.node_rank.to_string())
            .env("MASTER_ADDR", &master_addr)
            .env("MASTER_PORT", master_port.to_string());
        if let Some(t) = threads {
            cmd.env("RAYON_NUM_THREADS", t.to_string());
        }
        if local > 0 {
            // One reader of the terminal is enough.
            cmd.stdin(Stdio::null());
        }
        #[cfg(target_os = "linux")]
        {
            use std::os::unix::process::CommandExt;
            // SAFETY: prctl is async-signal-safe, as code between fork and exec must be.
            // A rank outlives a launcher killed with SIGKILL otherwise, training on alone.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                    Ok(())
                });
            }
        }
        let mut child: Child = match cmd.spawn() {
            Ok(child) => child,
            Err(e) => {
                for r in &ranks {
                    r.signal(libc::SIGKILL);
                }
                for _ in &ranks {
                    let _ = ended.recv();
                }
                return Err(anyhow!(e))
                    .with_context(|| format!("cannot start rank {rank} ({})", exe.display()));
            }
        };
        ranks.push(Rank {
            rank,
            pid: child.id(),
            status: None,
        });
        let tx = ended_tx.clone();
        let index = ranks.len() - 1;
        std::thread::spawn(move || {
            let _ = tx.send((index, child.wait()));
        });
    }
    drop(ended_tx);
    supervise(&mut ranks, &ended)
}

/// Waits for every rank; after the first failure (or a signal to this process) the others get
/// [`GRACE`] to stop on their own, then SIGTERM, then SIGKILL.
fn supervise(ranks: &mut [Rank], ended: &std::sync::mpsc::Receiver<Ended>) -> Result<()> {
    let mut first_failure: Option<String> = None;
    let mut failures = 0;
    let mut interrupted: Option<libc::c_int> = None;
    let mut term_at: Option<Instant> = None;
    let mut kill_at: Option<Instant> = None;
    let mut stopped_by_us = false;
    // Ranks found stopped (SIGSTOP), the likely cause of a failure the others report.
    let mut found_stopped: Vec<String> = Vec::new();
    while ranks.iter().any(|r| r.status.is_none()) {
        let sig = SIGNAL.swap(0, SeqCst);
        if sig != 0 {
            interrupted = Some(sig);
            for r in ranks.iter() {
                r.signal(sig);
            }
            term_at.get_or_insert(Instant::now() + GRACE);
        }
        match ended.recv_timeout(Duration::from_millis(50)) {
            Ok((index, status)) => {
                let r = &mut ranks[index];
                let status = status.with_context(|| format!("waiting for rank {}", r.rank))?;
                r.status = Some(status);
                if !status.success() {
                    failures += 1;
                    if interrupted.is_none() {
                        let what = format!(
                            "rank {} (pid {}) {}{}",
                            r.rank,
                            r.pid,
                            describe(status),
                            if stopped_by_us {
                                " after the launcher stopped it"
                            } else {
                                ""
                            }
                        );
                        say(&format!("ferrotune run: {what}"));
                        if first_failure.is_none() {
                            first_failure = Some(what);
                            term_at = Some(Instant::now() + GRACE);
                        }
                    }
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        }
        let now = Instant::now();
        let live = ranks.iter().any(|r| r.status.is_none());
        if live && kill_at.is_none() && term_at.is_some_and(|t| now >= t) {
            say("ferrotune run: stopping the remaining ranks (SIGTERM)");
            stopped_by_us = true;
            for r in ranks.iter() {
                if r.status.is_none() && is_stopped(r.pid) {
                    // The usual cause of a silent rank, worth naming: SIGTERM will not reach it.
                    say(&format!(
                        "ferrotune run: rank {} (pid {}) is stopped (SIGSTOP, Ctrl-Z or a debugger)",
                        r.rank, r.pid
                    ));
                    found_stopped.push(format!("rank {}", r.rank));
                }
                r.signal(libc::SIGTERM);
            }
            kill_at = Some(now + TERM_GRACE);
        }
        if kill_at.is_some_and(|t| now >= t) {
            for r in ranks.iter().filter(|r| r.status.is_none()) {
                say(&format!(
                    "ferrotune run: rank {} (pid {}) did not stop within {} s of SIGTERM: SIGKILL",
                    r.rank,
                    r.pid,
                    TERM_GRACE.as_secs()
                ));
                r.signal(libc::SIGKILL);
            }
            kill_at = Some(now + Duration::from_secs(3600));
        }
    }
    if let Some(sig) = interrupted {
        std::process::exit(128 + sig);
    }
    match first_failure {
        None => Ok(()),
        Some(first) => bail!(
            "distributed run failed: {failures} of {} rank(s) on this node failed; the first: \
             {first}{}",
            ranks.len(),
            match found_stopped.is_empty() {
                true => String::new(),
                false => format!("; found stopped: {}", found_stopped.join(", ")),
            }
        ),
    }
}

/// Whether process `pid` is stopped (state `T` in `/proc/PID/stat`); false where that cannot be
/// read.
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        // The state follows the command name, which is in parentheses and may hold anything.
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, rest)| rest.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

/// One line on stderr in one write, so that it does not interleave with the ranks' output.
fn say(line: &str) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        return format!("exited with status {code}");
    }
    match status.signal() {
        Some(sig) => format!("was killed by signal {sig} ({})", signal_name(sig)),
        None => format!("ended: {status}"),
    }
}

fn signal_name(sig: libc::c_int) -> &'static str {
    match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        _ => "unknown signal",
    }
}

/// A port nothing listens on now, for rank 0's store (as torchrun picks one for a single node).
fn free_port(host: &str) -> Result<u16> {
    let listener = std::net::TcpListener::bind((host, 0))
        .or_else(|_| std::net::TcpListener::bind(("0.0.0.0", 0)))
        .context("cannot find a free port for the rendezvous store (pass --master-port)")?;
    Ok(listener.local_addr()?.port())
}

/// `RAYON_NUM_THREADS` for each rank: the cores shared out, so that N ranks on one machine do
/// not each start a thread per core. `None` when the user chose a value (the ranks inherit it).
fn rayon_threads_per_rank(n: usize) -> Option<usize> {
    const KEY: &str = "RAYON_NUM_THREADS";
    // main() sets RAYON_NUM_THREADS to the measured parallelism before `run` starts, so the
    // current environment cannot tell whether the user set it; /proc/self/environ still holds
    // the environment this process started with.
    let user_set = match std::fs::read("/proc/self/environ") {
        Ok(env) => env
            .split(|&b| b == 0)
            .any(|kv| kv.starts_with(format!("{KEY}=").as_bytes())),
        Err(_) => std::env::var_os(KEY).is_some(),
    };
    if user_set {
        return None;
    }
    let cores = std::env::var(KEY)
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&c| c > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |c| c.get()));
    Some((cores / n).max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<OsString> {
        a.iter().map(OsString::from).collect()
    }

    #[test]
    fn child_args_drop_the_launcher_flags() {
        let argv = args(&[
            "ferrotune",
            "run",
            "--nproc-per-node",
            "2",
            "--nnodes=1",
            "--standalone",
            "--master_port",
            "1234",
            "full_finetune_distributed",
            "--config",
            "my.yaml",
            "optimizer.lr=1e-4",
            "~seed",
        ]);
        assert_eq!(
            child_args(&argv).unwrap(),
            args(&[
                "run",
                "full_finetune_distributed",
                "--config",
                "my.yaml",
                "optimizer.lr=1e-4",
                "~seed"
            ])
        );
    }
}
