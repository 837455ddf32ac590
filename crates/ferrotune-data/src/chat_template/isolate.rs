//! Chat templates rendered in a separate process, with a memory cap and a time limit.
//!
//! A chat template is untrusted code from a model folder. The step budget
//! ([`super::TEMPLATE_STEP_BUDGET`]) bounds how long it loops and the output cap
//! ([`super::TEMPLATE_OUTPUT_BYTES`]) what it writes, but not the values it builds in between:
//! `{% set ns.a = ns.a ~ ns.a %}` doubles a string per step, so a few dozen steps ask for
//! gigabytes. minijinja has no byte budget for its values, and Rust cannot turn a failed allocation
//! into an error, so the one sound bound is a process: once a binary calls [`use_worker`], every
//! render goes to a long-lived worker process (the same binary, started with the arguments given,
//! which calls [`serve`]) whose address space is capped at [`WORKER_MEMORY_BYTES`] and whose every
//! render must answer within [`RENDER_SECONDS`]. A worker that runs out of memory or time is
//! killed, the render is an error naming the template, and the next render starts a fresh worker.
//!
//! Compiling goes to the worker too: minijinja folds constant expressions while compiling, so
//! `'x' * 100000000` repeated in a template's source asks for gigabytes before any render.
//!
//! The protocol is one JSON line each way over a socket pair: the request
//! `{"source", "origin", "context"}` (`context` null: compile only), the reply `"Compiled"`,
//! `{"Rendered": text}` or `{"Failed": error}`.
//! Without [`use_worker`] (library users, tests) templates render in the calling process.

use std::collections::HashMap;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::ChatTemplate;
use crate::error::{DataError, Result};

/// The worker's address-space cap: far above what a real template needs to render a conversation
/// (its output is capped at 256 MiB), far below what a hostile one would take.
pub const WORKER_MEMORY_BYTES: u64 = 1 << 30;

/// How long one render may take in the worker. Real templates render in milliseconds; the step
/// budget stops a runaway loop in seconds; this catches steps that are each slow (operations on
/// strings of hundreds of megabytes).
pub const RENDER_SECONDS: u64 = 20;

/// The hidden verb by which ferrotune's binaries (the CLI, the fuzzer) start themselves as a
/// worker: they pass it to [`use_worker`] and call [`serve`] when started with it.
pub const WORKER_VERB: &str = "internal-render-templates";

/// How the binary starts a worker: its own executable and the arguments that reach [`serve`].
struct WorkerCommand {
    program: PathBuf,
    args: Vec<OsString>,
}

static COMMAND: OnceLock<WorkerCommand> = OnceLock::new();
static WORKER: Mutex<Option<Worker>> = Mutex::new(None);

/// From now on, render every chat template in a worker process started as `program args...`
/// (a binary passes its own executable and the hidden argument that makes it call [`serve`]).
/// The first call wins.
pub fn use_worker(program: PathBuf, args: Vec<OsString>) {
    let _ = COMMAND.set(WorkerCommand { program, args });
}

/// Whether templates render in a worker process ([`use_worker`] was called).
pub(super) fn enabled() -> bool {
    COMMAND.get().is_some()
}

/// The process id of the running worker, if one runs (for accounting its CPU time and memory).
pub fn worker_pid() -> Option<u32> {
    let slot = WORKER
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    slot.as_ref().map(|worker| worker.child.id())
}

/// A request: compile `source` (no `context`) or render it with `context`.
#[derive(Serialize)]
struct Request<'a, C: Serialize> {
    source: &'a str,
    origin: Option<&'a str>,
    context: Option<C>,
}

#[derive(Deserialize)]
struct OwnedRequest {
    source: String,
    origin: Option<String>,
    context: Option<minijinja::Value>,
}

/// A request's outcome as it crosses the socket.
#[derive(Serialize, Deserialize)]
enum Reply {
    Compiled,
    Rendered(String),
    Failed(WireError),
}

/// The template errors a render can end in ([`DataError`]'s template variants).
#[derive(Serialize, Deserialize)]
enum WireError {
    Template { message: String },
    StepBudget { steps: u64 },
    Exception { message: String },
}

impl WireError {
    fn from_error(err: DataError) -> Self {
        match err {
            DataError::TemplateStepBudget { steps, .. } => Self::StepBudget { steps },
            DataError::TemplateException { message } => Self::Exception { message },
            other => Self::Template {
                message: match other {
                    DataError::Template { message } => message,
                    other => other.to_string(),
                },
            },
        }
    }

    fn into_error(self, origin: Option<&str>) -> DataError {
        match self {
            Self::Template { message } => DataError::Template { message },
            Self::StepBudget { steps } => DataError::TemplateStepBudget {
                origin: origin.map(str::to_owned),
                steps,
            },
            Self::Exception { message } => DataError::TemplateException { message },
        }
    }
}

struct Worker {
    child: Child,
    socket: UnixStream,
    replies: BufReader<UnixStream>,
}

impl Worker {
    fn start(command: &WorkerCommand) -> std::io::Result<Self> {
        let (ours, theirs) = UnixStream::pair()?;
        let theirs_out = theirs.try_clone()?;
        let child = Command::new(&command.program)
            .args(&command.args)
            .stdin(Stdio::from(OwnedFd::from(theirs)))
            .stdout(Stdio::from(OwnedFd::from(theirs_out)))
            .stderr(Stdio::null())
            .spawn()?;
        ours.set_read_timeout(Some(Duration::from_secs(RENDER_SECONDS)))?;
        let replies = BufReader::new(ours.try_clone()?);
        Ok(Self {
            child,
            socket: ours,
            replies,
        })
    }

    /// Writes all of `bytes` without SIGPIPE: a worker that died must become an error here, and
    /// the binary keeps SIGPIPE's default (it ends the process) for its own output.
    fn send(&self, mut bytes: &[u8]) -> std::io::Result<()> {
        while !bytes.is_empty() {
            // SAFETY: `send` reads at most `bytes.len()` bytes from a live slice, on a socket this
            // struct owns.
            let n = unsafe {
                libc::send(
                    self.socket.as_raw_fd(),
                    bytes.as_ptr().cast(),
                    bytes.len(),
                    libc::MSG_NOSIGNAL,
                )
            };
            if n < 0 {
                let err = std::io::Error::last_os_error();
                if err.kind() == std::io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(err);
            }
            bytes = &bytes[n as usize..];
        }
        Ok(())
    }

    /// Kills the worker and says how it ended, for the error.
    fn stop(mut self) -> String {
        let _ = self.child.kill();
        match self.child.wait() {
            Ok(status) => status.to_string(),
            Err(e) => format!("cannot be waited for: {e}"),
        }
    }
}

/// Compiles `source` (from `origin`) in the worker process, for its syntax errors.
pub(super) fn compile(source: &str, origin: Option<&str>) -> Result<()> {
    match exchange(source, origin, None::<()>, "compile")? {
        Reply::Compiled => Ok(()),
        _ => Err(nonsense(origin)),
    }
}

/// Renders `source` (from `origin`) with `context` in the worker process.
pub(super) fn render<C: Serialize>(
    source: &str,
    origin: Option<&str>,
    context: C,
) -> Result<String> {
    match exchange(source, origin, Some(context), "render")? {
        Reply::Rendered(text) => Ok(text),
        _ => Err(nonsense(origin)),
    }
}

fn nonsense(origin: Option<&str>) -> DataError {
    DataError::Template {
        message: format!(
            "the chat template renderer answered out of turn for the template{}",
            origin.map(|o| format!(" from {o}")).unwrap_or_default()
        ),
    }
}

/// Sends one request to the worker (starting one if none runs) and reads its reply; a failed
/// compile or render is the error it names, a worker that dies or overruns is killed.
fn exchange<C: Serialize>(
    source: &str,
    origin: Option<&str>,
    context: Option<C>,
    what: &str,
) -> Result<Reply> {
    let from = || origin.map(|o| format!(" from {o}")).unwrap_or_default();
    let command = COMMAND.get().expect("only called once use_worker was");
    let mut line = serde_json::to_vec(&Request {
        source,
        origin,
        context,
    })
    .map_err(|e| DataError::Template {
        message: format!(
            "cannot pass the conversation to the template{}: {e}",
            from()
        ),
    })?;
    line.push(b'\n');

    let mut slot = WORKER
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if slot.is_none() {
        let worker = Worker::start(command).map_err(|e| DataError::Template {
            message: format!(
                "cannot start the chat template renderer ({}): {e}",
                command.program.display()
            ),
        })?;
        *slot = Some(worker);
    }
    let worker = slot.as_mut().expect("started above");
    let mut reply = String::new();
    let outcome = worker
        .send(&line)
        .and_then(|()| worker.replies.read_line(&mut reply));
    match outcome {
        Ok(n) if n > 0 => match serde_json::from_str::<Reply>(&reply) {
            Ok(Reply::Failed(err)) => Err(err.into_error(origin)),
            Ok(reply) => Ok(reply),
            Err(e) => {
                let status = slot.take().expect("present").stop();
                Err(DataError::Template {
                    message: format!(
                        "the chat template renderer answered nonsense for the template{} ({e}; \
                         it {status})",
                        from()
                    ),
                })
            }
        },
        Ok(_) | Err(_) => {
            let timed_out = matches!(
                &outcome,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)
            );
            let status = slot.take().expect("present").stop();
            let message = if timed_out {
                format!(
                    "the template{} took more than {RENDER_SECONDS} s to {what}: far longer than \
                     any real template",
                    from()
                )
            } else {
                format!(
                    "the template{} needed more than {} MiB of memory to {what}, far more than \
                     any real template (its renderer: {status})",
                    from(),
                    WORKER_MEMORY_BYTES >> 20
                )
            };
            Err(DataError::Template { message })
        }
    }
}

/// The worker's side: caps this process's address space at [`WORKER_MEMORY_BYTES`], then renders
/// requests from stdin, one reply line each on stdout, until stdin closes. A binary calls this when
/// started with the arguments it gave [`use_worker`].
pub fn serve() -> std::io::Result<()> {
    let limit = libc::rlimit {
        rlim_cur: WORKER_MEMORY_BYTES,
        rlim_max: WORKER_MEMORY_BYTES,
    };
    // SAFETY: setrlimit with a valid rlimit, on this process.
    if unsafe { libc::setrlimit(libc::RLIMIT_AS, &limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // Compiled templates by (source, origin): a run renders one or two templates many times.
    let mut compiled: HashMap<(String, Option<String>), ChatTemplate> = HashMap::new();
    let mut stdout = std::io::stdout().lock();
    for line in std::io::stdin().lock().lines() {
        let request: OwnedRequest = serde_json::from_str(&line?)?;
        let key = (request.source, request.origin);
        if !compiled.contains_key(&key) {
            if compiled.len() >= 8 {
                compiled.clear();
            }
            match ChatTemplate::build_here(&key.0, key.1.clone()) {
                Ok(template) => {
                    compiled.insert(key.clone(), template);
                }
                Err(e) => {
                    write_reply(&mut stdout, &Reply::Failed(WireError::from_error(e)))?;
                    continue;
                }
            }
        }
        let reply = match request.context {
            None => Reply::Compiled,
            Some(context) => match compiled[&key].render_here(context) {
                Ok(text) => Reply::Rendered(text),
                Err(e) => Reply::Failed(WireError::from_error(e)),
            },
        };
        write_reply(&mut stdout, &reply)?;
    }
    Ok(())
}

fn write_reply(out: &mut impl Write, reply: &Reply) -> std::io::Result<()> {
    serde_json::to_writer(&mut *out, reply)?;
    out.write_all(b"\n")?;
    out.flush()
}
