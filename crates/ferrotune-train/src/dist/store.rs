//! The rendezvous store: a small key/value server in rank 0 that every rank connects to, plus the
//! liveness watchdog that stops the whole run when one rank disappears.
//!
//! Wire format: every message is a frame, a little-endian `u32` byte count and then the payload.
//! A payload is an opcode byte followed by its fields; strings and byte strings carry a `u32`
//! length. Each connection opens with a hello frame (magic, world size, rank) so that a process of
//! another run (or anything else) that reaches the port is turned away with a clear error.
//!
//! Liveness: besides its request connection, each rank keeps a second "watch" connection on which
//! it registers its rank, and then its watchdog thread sends heartbeats, which the server answers
//! (see [`super::watchdog`]). The kernel closes a process's sockets however it ends, so the server
//! sees a registered watch connection close; a process that is stopped or frozen instead falls
//! silent, and after the watchdog bound without a heartbeat the server counts it lost too. Unless
//! that rank said goodbye (only [`Store::shutdown`] does), the server tells every other watcher
//! which rank was lost and why, and each watcher ends its process. A watch connection that closes
//! on the client side, or that the server leaves silent for the bound, means that the server,
//! that is rank 0, is gone.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::env::{op_timeout, watchdog_timeout, DistEnv};
use super::watchdog::{is_timeout, FrameReader, Heartbeats};

const MAGIC: u32 = 0x4654_5354; // "FTST"
/// Frames larger than this are a protocol error (a stray client), not an allocation to make.
const MAX_FRAME: usize = 1 << 30;

// Requests.
const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OP_GOODBYE: u8 = 4;
const OP_WATCH: u8 = 5;
/// A heartbeat, from a rank's watchdog on its watch connection (and the server's answer).
const BEAT: u8 = 6;
// Replies and notices.
const R_OK: u8 = 0;
const R_VALUE: u8 = 1;
const R_INT: u8 = 2;
const R_TIMEOUT: u8 = 3;
const R_ERR: u8 = 4;
const N_LOST: u8 = 10;

/// A client of the rendezvous store (and, in rank 0, its server). `Send + Sync`: requests from
/// several threads are serialised on one connection.
pub struct Store {
    rank: usize,
    world_size: usize,
    conn: Mutex<TcpStream>,
    op_timeout: Duration,
    sequences: Mutex<HashMap<String, u64>>,
    local_ip: IpAddr,
    /// Set before this process closes its watch connection on purpose, so its own watchdog
    /// does not take that for a lost rank 0.
    closing: Arc<AtomicBool>,
    watch: TcpStream,
    server: Option<Arc<Server>>,
    finished: bool,
}

impl Store {
    /// [`Store::connect_with_watchdog`] with the watchdog bound of `FERROTUNE_DIST_WATCHDOG`
    /// (default 60 s).
    pub fn connect(env: &DistEnv, timeout: Duration) -> Result<Store> {
        Self::connect_with_watchdog(env, timeout, watchdog_timeout(None)?)
    }

    /// Joins the store at `MASTER_ADDR:MASTER_PORT`; rank 0 first starts serving it there.
    /// Connecting is retried for up to `timeout` (rank 0 may start after the others), and every
    /// rank must join within `timeout`. Returns once all have, with this rank's watchdog
    /// registered: a rank lost from then on stops the others, and so does one that sends no
    /// heartbeat for `watchdog` (rank 0's value: the store tells the others, so all agree).
    pub fn connect_with_watchdog(
        env: &DistEnv,
        timeout: Duration,
        watchdog: Duration,
    ) -> Result<Store> {
        let op_timeout = op_timeout()?;
        let (server, addr) = if env.rank == 0 {
            let (server, port) = Server::start(env, watchdog)?;
            (Some(server), host_port(&env.master_addr, port))
        } else {
            (None, host_port(&env.master_addr, env.master_port))
        };
        let deadline = Instant::now() + timeout;
        let conn = connect_retry(&addr, deadline, timeout)?;
        hello(&conn, env)?;
        let local_ip = conn.local_addr()?.ip();

        let watch = connect_retry(&addr, deadline, timeout)?;
        hello(&watch, env)?;
        let mut msg = Msg::new(OP_WATCH);
        msg.u32(env.rank as u32);
        write_frame(&watch, &msg.0)?;
        let reply = read_reply(&watch, Some(Duration::from_secs(30)))?;
        expect_ok(&reply).context("registering with the rendezvous store")?;
        let watchdog = Fields::new(&reply[1..])
            .u64()
            .map_or(watchdog, Duration::from_millis);
        let closing = Arc::new(AtomicBool::new(false));
        let watch_conn = watch.try_clone()?;
        let watch_closing = closing.clone();
        std::thread::Builder::new()
            .name("dist-watchdog".into())
            .spawn(move || watch_loop(watch_conn, watch_closing, watchdog))?;
        Store {
            rank: env.rank,
            world_size: env.world_size,
            conn: Mutex::new(conn),
            op_timeout,
            sequences: Mutex::new(HashMap::new()),
            local_ip,
            closing,
            watch,
            server,
            finished: false,
        }
        .join(timeout)
    }

    /// Waits until every rank has joined. Rank 0 alone decides whether all joined in time and
    /// publishes the verdict, so all ranks agree; on failure every rank says goodbye before it
    /// returns the error, so that no one reports the others as lost.
    fn join(mut self, timeout: Duration) -> Result<Store> {
        if self.add("__join", 1)? as usize == self.world_size {
            self.set("__join/all", b"")?;
        }
        let verdict = if self.rank == 0 {
            let verdict = match self.get_timeout("__join/all", timeout)? {
                Some(_) => String::new(),
                None => format!(
                    "only {} of {} ranks joined the rendezvous store within {} s",
                    self.add("__join", 0)?,
                    self.world_size,
                    timeout.as_secs()
                ),
            };
            self.set("__join/verdict", verdict.as_bytes())?;
            verdict
        } else {
            // Rank 0 started no later than this rank reached it: its verdict is due within
            // `timeout`.
            match self.get_timeout("__join/verdict", timeout + Duration::from_secs(10))? {
                Some(v) => String::from_utf8_lossy(&v).into_owned(),
                None => format!(
                    "rank 0 gave no verdict on the rendezvous within {} s",
                    timeout.as_secs() + 10
                ),
            }
        };
        if verdict.is_empty() {
            return Ok(self);
        }
        self.closing.store(true, Ordering::SeqCst);
        let mut msg = Msg::new(OP_GOODBYE);
        msg.u32(self.rank as u32);
        let _ = self.request(&msg.0, None);
        self.finished = true;
        let _ = self.watch.shutdown(Shutdown::Both);
        if let Some(server) = &self.server {
            // The others are saying goodbye too; the store must serve them until they have.
            let _ = server.wait_registered_finished(Duration::from_secs(10));
        }
        bail!("{verdict}")
    }

    /// Stores `value` under `key` (replacing any previous value) and wakes its waiters.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut msg = Msg::new(OP_SET);
        msg.bytes(key.as_bytes());
        msg.bytes(value);
        expect_ok(&self.request(&msg.0, None)?).with_context(|| format!("store set '{key}'"))
    }

    /// The value under `key`, waiting until some rank sets it (at most `FERROTUNE_DIST_TIMEOUT`).
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        match self.get_timeout(key, self.op_timeout)? {
            Some(value) => Ok(value),
            None => bail!(
                "store key '{key}' was not set by any rank within {} s",
                self.op_timeout.as_secs()
            ),
        }
    }

    /// The value under `key`, waiting at most `timeout` (`None` then).
    fn get_timeout(&self, key: &str, timeout: Duration) -> Result<Option<Vec<u8>>> {
        let mut msg = Msg::new(OP_GET);
        msg.bytes(key.as_bytes());
        msg.u64(timeout.as_millis() as u64);
        let reply = self.request(&msg.0, Some(timeout))?;
        match reply.first() {
            Some(&R_VALUE) => Ok(Some(Fields::new(&reply[1..]).bytes()?.to_vec())),
            Some(&R_TIMEOUT) => Ok(None),
            _ => Err(reply_error(&reply)).with_context(|| format!("store get '{key}'")),
        }
    }

    /// Atomically adds `n` to the counter under `key` (missing counts as 0); returns the new value.
    pub fn add(&self, key: &str, n: i64) -> Result<i64> {
        let mut msg = Msg::new(OP_ADD);
        msg.bytes(key.as_bytes());
        msg.u64(n as u64);
        let reply = self.request(&msg.0, None)?;
        match reply.first() {
            Some(&R_INT) => Ok(Fields::new(&reply[1..]).u64()? as i64),
            _ => Err(reply_error(&reply)).with_context(|| format!("store add '{key}'")),
        }
    }

    /// Waits until all `world_size` ranks have reached the barrier `name`. Every rank must pass
    /// the same barriers in the same order; a name may be reused (each use is counted apart).
    pub fn barrier(&self, name: &str) -> Result<()> {
        let generation = self.sequence(&format!("barrier/{name}"));
        let key = format!("__barrier/{name}/{generation}");
        let arrived = self.add(&key, 1)?;
        let done = format!("{key}/done");
        if arrived as usize == self.world_size {
            self.set(&done, b"1")?;
        }
        self.get(&done).map(|_| ()).map_err(|e| {
            let arrived = self.add(&key, 0).unwrap_or(arrived);
            anyhow!(
                "barrier '{name}': {arrived} of {} ranks arrived ({e:#})",
                self.world_size
            )
        })
    }

    /// 0, 1, 2, ... for successive calls with the same `name` in this process. Ranks that make the
    /// same calls in the same order get the same numbers: unique store keys without a round trip.
    pub fn sequence(&self, name: &str) -> u64 {
        let mut seqs = lock(&self.sequences);
        let n = seqs.entry(name.to_string()).or_insert(0);
        *n += 1;
        *n - 1
    }

    /// Ends this rank's part cleanly: says goodbye so that its exit is not reported as a lost
    /// rank. Rank 0 then keeps serving until every rank has said goodbye (at most
    /// `FERROTUNE_DIST_TIMEOUT`), because the others still need the store to say theirs.
    pub fn shutdown(mut self) -> Result<()> {
        self.closing.store(true, Ordering::SeqCst);
        let mut msg = Msg::new(OP_GOODBYE);
        msg.u32(self.rank as u32);
        expect_ok(&self.request(&msg.0, None)?)
            .context("saying goodbye to the rendezvous store")?;
        self.finished = true;
        let _ = self.watch.shutdown(Shutdown::Both);
        if let Some(server) = &self.server {
            server.wait_all_finished(self.op_timeout)?;
        }
        Ok(())
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// The address of this host on the interface that reaches rank 0, for peers to connect to.
    pub fn local_ip(&self) -> IpAddr {
        self.local_ip
    }

    /// How long waits may block without progress (`FERROTUNE_DIST_TIMEOUT`).
    pub fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    /// Sends one request and reads its reply. `wait` is how long the server may take to answer
    /// (a get's wait); the socket waits 30 s longer before it gives up on the server itself.
    fn request(&self, payload: &[u8], wait: Option<Duration>) -> Result<Vec<u8>> {
        let patience = wait.unwrap_or(Duration::ZERO) + Duration::from_secs(30);
        let conn = lock(&self.conn);
        let result = conn
            .set_read_timeout(Some(patience))
            .and_then(|()| write_frame(&conn, payload))
            .and_then(|()| read_frame(&mut &*conn));
        drop(conn);
        result.map_err(|e| {
            let timed_out = matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            );
            if timed_out {
                return anyhow!(
                    "the rendezvous store (rank 0) did not answer within {} s",
                    patience.as_secs()
                );
            }
            if !self.closing.load(Ordering::SeqCst) {
                // Rank 0 is gone; its watchdog report (the same news) is due any moment and
                // ends the process. Give it that moment, so the report is the same everywhere.
                std::thread::sleep(Duration::from_secs(2));
            }
            anyhow!("lost connection to rank 0, which serves the rendezvous store ({e})")
        })
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        if !self.finished {
            // Dropped without `shutdown` (an error unwound past it): close the watch connection
            // now, so the other ranks hear of it at once rather than when this process exits.
            self.closing.store(true, Ordering::SeqCst);
            let _ = self.watch.shutdown(Shutdown::Both);
        }
        if let Some(server) = &self.server {
            server.stop();
        }
    }
}

/// The watchdog thread: sends this rank's heartbeats on the watch connection and waits there for
/// a lost-rank notice, the connection's close, or the store's silence.
fn watch_loop(conn: TcpStream, closing: Arc<AtomicBool>, bound: Duration) {
    let mut beats = Heartbeats::new(bound, Instant::now());
    let mut frames = FrameReader::default();
    let closed = "the rendezvous store it serves closed the connection";
    let (rank, why) = loop {
        if closing.load(Ordering::SeqCst) {
            return;
        }
        let now = Instant::now();
        if beats.send_due(now) {
            if write_frame(&conn, &[BEAT]).is_err() {
                break (0, closed.to_string());
            }
            beats.sent(now);
        }
        if let Some(quiet) = beats.silent(now) {
            break (0, silence(quiet, "the rendezvous store it serves"));
        }
        let read = conn
            .set_read_timeout(Some(beats.wait(now)))
            .and_then(|()| frames.next(&conn));
        match read {
            Ok(None) => {}
            Ok(Some(frame)) if frame.first() == Some(&N_LOST) => {
                let mut f = Fields::new(&frame[1..]);
                break match (f.u32(), f.string()) {
                    (Ok(r), Ok(why)) => (r as usize, why),
                    _ => (0, "unreadable notice from the store".to_string()),
                };
            }
            Ok(Some(_)) => beats.heard(Instant::now()),
            Err(_) => break (0, closed.to_string()),
        }
    };
    if closing.load(Ordering::SeqCst) {
        return;
    }
    // One write, so that the lines of ranks sharing a terminal do not interleave.
    let line = format!("error: distributed training stopped: rank {rank} was lost ({why})\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
    // The main thread may be blocked in a socket read for up to the op timeout; ending the
    // process is the point.
    std::process::exit(1);
}

/// Why a silent peer counts as lost, for the notice.
fn silence(quiet: Duration, who: &str) -> String {
    format!(
        "{who} sent no heartbeat for {:.0} s: stopped, frozen or unreachable; the bound is \
         dist_watchdog_timeout or {}",
        quiet.as_secs_f64(),
        ferrotune_core::switch::DIST_WATCHDOG.name
    )
}

/// `host:port`, with an IPv6 address in brackets.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn connect_retry(addr: &str, deadline: Instant, timeout: Duration) -> Result<TcpStream> {
    let mut last_err = String::new();
    loop {
        match addr.to_socket_addrs() {
            Ok(addrs) => {
                for a in addrs {
                    match TcpStream::connect_timeout(&a, Duration::from_secs(5)) {
                        Ok(s) => {
                            tune_socket(&s);
                            return Ok(s);
                        }
                        Err(e) => last_err = e.to_string(),
                    }
                }
            }
            Err(e) => last_err = e.to_string(),
        }
        if Instant::now() >= deadline {
            bail!(
                "could not reach the rendezvous store at {addr} (rank 0, MASTER_ADDR:MASTER_PORT) \
                 within {} s: {last_err}",
                timeout.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn hello(conn: &TcpStream, env: &DistEnv) -> Result<()> {
    let mut msg = Msg(Vec::new());
    msg.u32(MAGIC);
    msg.u32(env.world_size as u32);
    msg.u32(env.rank as u32);
    write_frame(conn, &msg.0)?;
    let reply = read_reply(conn, Some(Duration::from_secs(30)))
        .context("no answer from the rendezvous store (is MASTER_PORT used by something else?)")?;
    expect_ok(&reply).context("joining the rendezvous store")
}

fn read_reply(conn: &TcpStream, timeout: Option<Duration>) -> Result<Vec<u8>> {
    conn.set_read_timeout(timeout)?;
    let frame = read_frame(&mut &*conn)?;
    conn.set_read_timeout(None)?;
    Ok(frame)
}

fn expect_ok(reply: &[u8]) -> Result<()> {
    if reply.first() == Some(&R_OK) {
        Ok(())
    } else {
        Err(reply_error(reply))
    }
}

fn reply_error(reply: &[u8]) -> anyhow::Error {
    if reply.first() == Some(&R_ERR) {
        if let Ok(msg) = Fields::new(&reply[1..]).bytes() {
            return anyhow!("{}", String::from_utf8_lossy(msg));
        }
    }
    anyhow!("unexpected reply from the rendezvous store")
}

/// Low latency for small messages, and keepalive probes so that a peer host that vanishes
/// without closing its connections (power loss, network cut) is noticed within about a minute.
pub(crate) fn tune_socket(s: &TcpStream) {
    let _ = s.set_nodelay(true);
    #[cfg(unix)]
    {
        use std::os::fd::AsRawFd;
        let fd = s.as_raw_fd();
        let set = |level: libc::c_int, name: libc::c_int, value: libc::c_int| {
            // SAFETY: setsockopt reads `size_of::<c_int>()` bytes from a live local.
            unsafe {
                libc::setsockopt(
                    fd,
                    level,
                    name,
                    &value as *const libc::c_int as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                );
            }
        };
        set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1);
        #[cfg(target_os = "linux")]
        {
            set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 20);
            set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 5);
            set(libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 6);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere while holding the lock leaves plain data that is still consistent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

// ---- framing ----

fn write_frame(mut w: &TcpStream, payload: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)
}

fn read_frame(r: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// A payload under construction.
struct Msg(Vec<u8>);

impl Msg {
    fn new(op: u8) -> Msg {
        Msg(vec![op])
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.0.extend_from_slice(b);
    }
}

/// Reads the fields of a payload in order.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn new(b: &'a [u8]) -> Self {
        Fields(b)
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.0.len() < n {
            bail!("truncated store message");
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into()?))
    }
    fn bytes(&mut self) -> Result<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    fn string(&mut self) -> Result<String> {
        Ok(String::from_utf8_lossy(self.bytes()?).into_owned())
    }
}

// ---- server (rank 0) ----

struct Server {
    world_size: usize,
    /// How long a registered rank may send no heartbeat before it counts as lost.
    watchdog: Duration,
    addr: SocketAddr,
    state: Mutex<State>,
    changed: Condvar,
    stopped: AtomicBool,
}

#[derive(Default)]
struct State {
    kv: HashMap<String, Vec<u8>>,
    /// Ranks that said goodbye.
    finished: Vec<bool>,
    /// Ranks whose goodbye has been answered.
    answered: Vec<bool>,
    /// Write ends of the registered watch connections, by rank.
    watchers: HashMap<usize, TcpStream>,
    /// The first rank lost, once one is, and why (the notice's words, so that a store call
    /// interrupted by the loss says the same as the watchdog).
    lost: Option<(usize, String)>,
}

impl Server {
    /// Binds the store's port and serves it from a background thread; returns the bound port.
    fn start(env: &DistEnv, watchdog: Duration) -> Result<(Arc<Server>, u16)> {
        // Loopback stays loopback (nothing outside reaches a single-machine run's store); any
        // other MASTER_ADDR binds every interface, as torch's store does, since the name the
        // others use may not be an address of a local interface.
        let loopback = (env.master_addr.as_str(), 0)
            .to_socket_addrs()
            .map(|mut a| a.all(|a| a.ip().is_loopback()))
            .unwrap_or(false);
        let host = if loopback {
            env.master_addr.clone()
        } else {
            "0.0.0.0".to_string()
        };
        let listener = TcpListener::bind((host.as_str(), env.master_port)).with_context(|| {
            format!(
                "rank 0 cannot listen on {host}:{} for the rendezvous store \
                 (is MASTER_PORT in use by another run?)",
                env.master_port
            )
        })?;
        let addr = listener.local_addr()?;
        let server = Arc::new(Server {
            world_size: env.world_size,
            watchdog,
            addr,
            state: Mutex::new(State {
                finished: vec![false; env.world_size],
                answered: vec![false; env.world_size],
                ..State::default()
            }),
            changed: Condvar::new(),
            stopped: AtomicBool::new(false),
        });
        let s = server.clone();
        std::thread::Builder::new()
            .name("dist-store".into())
            .spawn(move || s.accept_loop(listener))?;
        Ok((server, addr.port()))
    }

    fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        for conn in listener.incoming() {
            if self.stopped.load(Ordering::SeqCst) {
                break;
            }
            let Ok(conn) = conn else { continue };
            tune_socket(&conn);
            let s = self.clone();
            let _ = std::thread::Builder::new()
                .name("dist-store-conn".into())
                .spawn(move || s.serve(conn));
        }
    }

    /// Stops accepting connections (the accept call is woken by connecting to it).
    fn stop(&self) {
        if !self.stopped.swap(true, Ordering::SeqCst) {
            let mut wake = self.addr;
            if wake.ip().is_unspecified() {
                wake.set_ip(IpAddr::from([127, 0, 0, 1]));
            }
            let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        }
    }

    fn serve(&self, mut conn: TcpStream) {
        // The hello: turn away anything that is not a rank of this run.
        let _ = conn.set_read_timeout(Some(Duration::from_secs(30)));
        let Ok(frame) = read_frame(&mut conn) else {
            return;
        };
        let _ = conn.set_read_timeout(None);
        let mut f = Fields::new(&frame);
        let (magic, world, rank) = match (f.u32(), f.u32(), f.u32()) {
            (Ok(m), Ok(w), Ok(r)) => (m, w as usize, r as usize),
            _ => return,
        };
        if magic != MAGIC {
            return;
        }
        if world != self.world_size || rank >= world {
            let _ = reply_err(
                &conn,
                &format!(
                    "this store serves WORLD_SIZE={}, but a process with RANK={rank} \
                     WORLD_SIZE={world} connected (two runs on one MASTER_PORT?)",
                    self.world_size
                ),
            );
            return;
        }
        if write_frame(&conn, &[R_OK]).is_err() {
            return;
        }
        while let Ok(frame) = read_frame(&mut conn) {
            let result = match frame.first() {
                Some(&OP_WATCH) => return self.watch(conn, &frame[1..]),
                Some(&OP_GOODBYE) => {
                    let Ok(rank) = Fields::new(&frame[1..]).u32().map(|r| r as usize) else {
                        return;
                    };
                    if rank >= self.world_size {
                        return;
                    }
                    // Finished before the answer, so that the watch connection closing right
                    // after it is not taken for a loss; answered only once the answer is out,
                    // because rank 0 may end its process (and this server) from then on.
                    lock(&self.state).finished[rank] = true;
                    let sent = write_frame(&conn, &[R_OK]);
                    lock(&self.state).answered[rank] = true;
                    self.changed.notify_all();
                    if sent.is_err() {
                        return;
                    }
                    continue;
                }
                Some(&op) => self.handle(op, &frame[1..]),
                None => Err(anyhow!("empty request")),
            };
            let sent = match result {
                Ok(reply) => write_frame(&conn, &reply),
                Err(e) => reply_err(&conn, &format!("{e:#}")),
            };
            if sent.is_err() {
                return;
            }
        }
    }

    fn handle(&self, op: u8, body: &[u8]) -> Result<Vec<u8>> {
        let mut f = Fields::new(body);
        match op {
            OP_SET => {
                let key = f.string()?;
                let value = f.bytes()?.to_vec();
                lock(&self.state).kv.insert(key, value);
                self.changed.notify_all();
                Ok(vec![R_OK])
            }
            OP_GET => {
                let key = f.string()?;
                let deadline = Instant::now() + Duration::from_millis(f.u64()?);
                let mut state = lock(&self.state);
                loop {
                    if let Some(v) = state.kv.get(&key) {
                        let mut msg = Msg::new(R_VALUE);
                        msg.bytes(v);
                        return Ok(msg.0);
                    }
                    if let Some((rank, why)) = &state.lost {
                        bail!("rank {rank} was lost while waiting for store key '{key}' ({why})");
                    }
                    let now = Instant::now();
                    if now >= deadline {
                        return Ok(vec![R_TIMEOUT]);
                    }
                    state = self
                        .changed
                        .wait_timeout(state, deadline - now)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
            }
            OP_ADD => {
                let key = f.string()?;
                let n = f.u64()? as i64;
                let mut state = lock(&self.state);
                let old = match state.kv.get(&key) {
                    None => 0,
                    Some(v) => std::str::from_utf8(v)
                        .ok()
                        .and_then(|s| s.parse::<i64>().ok())
                        .with_context(|| format!("store key '{key}' does not hold a counter"))?,
                };
                let new = old.wrapping_add(n);
                // Decimal text, as torch's store keeps counters: readable with `get` too.
                state.kv.insert(key, new.to_string().into_bytes());
                drop(state);
                self.changed.notify_all();
                let mut msg = Msg::new(R_INT);
                msg.u64(new as u64);
                Ok(msg.0)
            }
            _ => bail!("unknown store request {op}"),
        }
    }

    /// A watch connection: registers the rank, then answers its heartbeats until the connection
    /// closes or the rank falls silent for the watchdog bound.
    fn watch(&self, mut conn: TcpStream, body: &[u8]) {
        let Ok(rank) = Fields::new(body).u32().map(|r| r as usize) else {
            return;
        };
        {
            let mut state = lock(&self.state);
            if rank >= self.world_size || state.watchers.contains_key(&rank) {
                drop(state);
                let _ = reply_err(
                    &conn,
                    &format!("rank {rank} is already registered (two processes with RANK={rank}?)"),
                );
                return;
            }
            let Ok(writer) = conn.try_clone() else { return };
            let _ = writer.set_write_timeout(Some(Duration::from_secs(5)));
            state.watchers.insert(rank, writer);
        }
        // The bound goes back with the answer: every rank then watches the store with rank 0's.
        let mut ok = Msg::new(R_OK);
        ok.u64(self.watchdog.as_millis() as u64);
        if write_frame(&conn, &ok.0).is_err() {
            self.lost(rank, None);
            return;
        }
        // Only heartbeats come in from now on: whatever arrives counts as one, and is answered.
        let mut sink = [0u8; 64];
        let _ = conn.set_read_timeout(Some(self.watchdog));
        let silent = loop {
            match conn.read(&mut sink) {
                Ok(0) => break None,
                Ok(_) => {
                    // Under the lock, as notices are written: frames must not interleave.
                    let state = lock(&self.state);
                    if let Some(w) = state.watchers.get(&rank) {
                        let _ = write_frame(w, &[BEAT]);
                    }
                }
                Err(e) if is_timeout(&e) => break Some(self.watchdog),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break None,
            }
        };
        self.lost(rank, silent.map(|quiet| silence(quiet, "it")));
    }

    /// `rank`'s watch connection closed (`why` is `None`), or it fell silent (`why` says so):
    /// unless it said goodbye first, tell the others.
    fn lost(&self, rank: usize, why: Option<String>) {
        let mut state = lock(&self.state);
        state.watchers.remove(&rank);
        if state.finished.get(rank).copied().unwrap_or(true) {
            return;
        }
        let why = why.unwrap_or_else(|| "its process ended or its connection closed".to_string());
        state.lost.get_or_insert_with(|| (rank, why.clone()));
        let mut msg = Msg::new(N_LOST);
        msg.u32(rank as u32);
        msg.bytes(why.as_bytes());
        // Remote ranks first, rank 0 (this process) last: its watchdog ends this process, and
        // with it the store, so the others must have their notice by then.
        let mut ranks: Vec<usize> = state.watchers.keys().copied().collect();
        ranks.sort_unstable_by(|a, b| b.cmp(a));
        for r in ranks {
            if !state.finished[r] {
                let _ = write_frame(&state.watchers[&r], &msg.0);
            }
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Waits until every rank still connected has said goodbye (a failed rendezvous).
    fn wait_registered_finished(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut state = lock(&self.state);
        loop {
            if state.watchers.keys().all(|&r| state.answered[r]) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            state = self
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Rank 0's clean shutdown: waits until every rank has said goodbye.
    fn wait_all_finished(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut state = lock(&self.state);
        loop {
            if state.answered.iter().all(|&f| f) {
                return Ok(());
            }
            if let Some((rank, why)) = &state.lost {
                bail!("rank {rank} was lost before it finished ({why})");
            }
            let now = Instant::now();
            if now >= deadline {
                let missing: Vec<String> = (0..self.world_size)
                    .filter(|&r| !state.answered[r])
                    .map(|r| r.to_string())
                    .collect();
                bail!(
                    "rank(s) {} did not finish within {} s of rank 0",
                    missing.join(", "),
                    timeout.as_secs()
                );
            }
            state = self
                .changed
                .wait_timeout(state, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

fn reply_err(conn: &TcpStream, text: &str) -> io::Result<()> {
    let mut msg = Msg::new(R_ERR);
    msg.bytes(text.as_bytes());
    write_frame(conn, &msg.0)
}
