//! The TCP ring backend: collectives between processes over plain sockets, for CPU training and
//! for the tests. Tensors on other devices go through host memory.
//!
//! Each rank sends to rank `(r+1) % W` on one socket and receives from rank `(r-1) % W` on
//! another. Sums use a ring reduce-scatter (each chunk is summed on exactly one rank) and a ring
//! all-gather of the summed chunks, so every rank ends with the same bits. Floats travel and are
//! summed as f32 (f64 as f64, integers as i64); gathers and broadcasts move the raw elements.
//! Data is sent in native byte order: all ranks run the same build on the same architecture.

use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU8, Ordering::SeqCst};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{CpuStorage, DType, Device, Shape, Storage, Tensor, WithDType};

use super::Collectives;
use crate::dist::env::DistEnv;
use crate::dist::store::{tune_socket, Store};

const RING_MAGIC: u32 = 0x4654_5247; // "FTRG"
/// Received data is processed (added, forwarded) in pieces of this size as it arrives.
const PIECE_BYTES: usize = 1 << 20;

/// How long a rank that lost a ring connection waits for the liveness watchdog before it
/// reports the error itself.
const LOSS_GRACE: Duration = Duration::from_secs(2);

/// A ring neighbour's connection closed or failed (usually: its process ended).
#[derive(Debug)]
struct PeerLost {
    peer: usize,
    cause: io::Error,
}

impl std::fmt::Display for PeerLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "lost connection to rank {} ({})", self.peer, self.cause)
    }
}

impl std::error::Error for PeerLost {}

/// Collectives over a TCP ring (see the module docs). With one rank it opens no sockets and
/// every operation returns its input.
pub struct TcpRing {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    links: Option<Mutex<Links>>,
}

struct Links {
    next: TcpStream,
    prev: TcpStream,
    seq: u64,
    /// Set after a failed operation: the ring's position is unknown, so later ones fail at once.
    broken: Option<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Op {
    AllReduce = 1,
    ReduceScatter = 2,
    AllGather = 3,
    Broadcast = 4,
}

impl Op {
    fn name(code: u8) -> &'static str {
        match code {
            1 => "all_reduce_sum",
            2 => "reduce_scatter_sum",
            3 => "all_gather",
            4 => "broadcast",
            _ => "an unknown operation",
        }
    }
}

/// What every rank announces to the next before an operation, so that ranks calling different
/// operations (a recipe bug) fail with an error instead of exchanging garbage or hanging.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Header {
    op: u8,
    dtype: u8,
    root: u32,
    count: u64,
    seq: u64,
}

impl Header {
    fn encode(&self) -> [u8; 24] {
        let mut b = [0u8; 24];
        b[0] = self.op;
        b[1] = self.dtype;
        b[4..8].copy_from_slice(&self.root.to_le_bytes());
        b[8..16].copy_from_slice(&self.count.to_le_bytes());
        b[16..24].copy_from_slice(&self.seq.to_le_bytes());
        b
    }

    fn decode(b: &[u8; 24]) -> Header {
        Header {
            op: b[0],
            dtype: b[1],
            root: u32::from_le_bytes(b[4..8].try_into().unwrap()),
            count: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            seq: u64::from_le_bytes(b[16..24].try_into().unwrap()),
        }
    }

    fn describe(&self) -> String {
        let dtype = DTYPES
            .iter()
            .find(|d| **d as u8 == self.dtype)
            .map_or_else(|| format!("dtype #{}", self.dtype), |d| format!("{d:?}"));
        let root = if self.op == Op::Broadcast as u8 {
            format!(" from rank {}", self.root)
        } else {
            String::new()
        };
        format!(
            "{} #{} of {} {dtype} elements{root}",
            Op::name(self.op),
            self.seq,
            self.count
        )
    }
}

const DTYPES: [DType; 10] = [
    DType::U8,
    DType::U32,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
    DType::F8E4M3,
];

/// Runs `$body` with `$v` bound to the elements `$range` of a CPU storage, whatever their type
/// (one match arm per storage variant of [`DTYPES`]).
macro_rules! with_cpu_slice {
    ($storage:expr, $range:expr, $dtype:expr, |$v:ident| $body:expr) => {
        with_cpu_slice!(@arms $storage, $range, $dtype, $v, $body;
            U8 U32 I16 I32 I64 BF16 F16 F32 F64 F8E4M3)
    };
    (@arms $storage:expr, $range:expr, $dtype:expr, $v:ident, $body:expr; $($variant:ident)*) => {
        match $storage {
            $(CpuStorage::$variant(d) => {
                let $v = &d[$range];
                $body
            })*
            _ => bail!("collectives do not support {:?} tensors", $dtype),
        }
    };
}

impl TcpRing {
    /// Builds the ring: every rank listens on an ephemeral port of the interface that reaches
    /// rank 0, publishes it in the store, connects to the next rank and accepts the previous one.
    pub fn connect(env: &DistEnv, store: &Store) -> Result<TcpRing> {
        let (rank, world) = (env.rank, env.world_size);
        let timeout = store.op_timeout();
        if world == 1 {
            return Ok(TcpRing {
                rank,
                world_size: world,
                timeout,
                links: None,
            });
        }
        let id = store.sequence("comm/tcp");
        let key = |r: usize| format!("__comm/tcp/{id}/{r}");
        let listener = TcpListener::bind((store.local_ip(), 0)).with_context(|| {
            format!(
                "rank {rank}: cannot listen on {} for the collectives",
                store.local_ip()
            )
        })?;
        store.set(&key(rank), listener.local_addr()?.to_string().as_bytes())?;
        let (next_rank, prev_rank) = ((rank + 1) % world, (rank + world - 1) % world);
        let next_addr = store.get(&key(next_rank))?;
        let next_addr: SocketAddr = String::from_utf8_lossy(&next_addr)
            .parse()
            .with_context(|| format!("bad address published by rank {next_rank}"))?;
        let deadline = Instant::now() + timeout;
        let (next, prev) = std::thread::scope(|s| {
            let connecting = s.spawn(|| connect_next(next_addr, rank, next_rank, id, deadline));
            let prev = accept_prev(&listener, prev_rank, id, deadline);
            let next = connecting
                .join()
                .unwrap_or_else(|_| Err(anyhow!("the connecting thread panicked")));
            (next, prev)
        });
        let (next, prev) = (next?, prev?);
        next.set_write_timeout(Some(timeout))?;
        prev.set_read_timeout(Some(timeout))?;
        Ok(TcpRing {
            rank,
            world_size: world,
            timeout,
            links: Some(Mutex::new(Links {
                next,
                prev,
                seq: 0,
                broken: None,
            })),
        })
    }

    fn next_rank(&self) -> usize {
        (self.rank + 1) % self.world_size
    }

    fn prev_rank(&self) -> usize {
        (self.rank + self.world_size - 1) % self.world_size
    }

    /// Runs one operation on the ring: checks that the previous rank runs the same one, then
    /// `f`. After a failure the sockets are closed, so that the neighbours fail too instead of
    /// waiting for data that will not come.
    fn run(
        &self,
        op: Op,
        dtype: DType,
        count: usize,
        root: usize,
        f: impl FnOnce(&Links) -> Result<()>,
    ) -> Result<()> {
        let links = self.links.as_ref().expect("ring with more than one rank");
        let mut links = lock(links);
        if let Some(why) = &links.broken {
            bail!("collectives are unusable after an earlier failure: {why}");
        }
        let header = Header {
            op: op as u8,
            dtype: dtype as u8,
            root: root as u32,
            count: count as u64,
            seq: links.seq,
        };
        links.seq += 1;
        let result = self.check_header(&links, header).and_then(|()| f(&links));
        if let Err(e) = &result {
            links.broken = Some(format!("{e:#}"));
            let _ = links.next.shutdown(Shutdown::Both);
            let _ = links.prev.shutdown(Shutdown::Both);
            if e.downcast_ref::<PeerLost>().is_some() {
                // The neighbour may only have closed its sockets because *its* neighbour died.
                // The store's watchdog names the rank that really ended, and ends this process;
                // give it the moment it needs before reporting the neighbour instead.
                drop(links);
                std::thread::sleep(LOSS_GRACE);
            }
        }
        result
    }

    fn check_header(&self, links: &Links, mine: Header) -> Result<()> {
        (&links.next)
            .write_all(&mine.encode())
            .map_err(|e| self.send_error(e))?;
        let mut theirs = [0u8; 24];
        (&links.prev)
            .read_exact(&mut theirs)
            .map_err(|e| self.recv_error(e))?;
        let theirs = Header::decode(&theirs);
        if theirs != mine {
            bail!(
                "collectives out of step: rank {} called {} while rank {} called {}",
                self.prev_rank(),
                theirs.describe(),
                self.rank,
                mine.describe()
            );
        }
        Ok(())
    }

    fn recv_error(&self, e: io::Error) -> anyhow::Error {
        self.link_error(e, self.prev_rank(), "sent nothing")
    }

    fn send_error(&self, e: io::Error) -> anyhow::Error {
        self.link_error(e, self.next_rank(), "took no data")
    }

    /// The error of the link to `peer` failing with `e`: the timeout ran out (`peer` `stalled`
    /// that long), or the peer is lost.
    fn link_error(&self, e: io::Error, peer: usize, stalled: &str) -> anyhow::Error {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => anyhow!(
                "rank {peer} {stalled} for {} s ({}): is it stuck?",
                self.timeout.as_secs(),
                ferrotune_core::switch::DIST_TIMEOUT.name
            ),
            _ => PeerLost { peer, cause: e }.into(),
        }
    }

    /// One ring step: sends `out` to the next rank (on a scoped thread, so that two ranks
    /// sending large messages to each other cannot deadlock) while receiving `len` elements from
    /// the previous one, handing each piece and its offset to `each` as it arrives.
    fn step<T: WithDType>(
        &self,
        links: &Links,
        out: &[T],
        len: usize,
        mut each: impl FnMut(usize, &[T]),
    ) -> Result<()> {
        let (next, prev) = (&links.next, &links.prev);
        // Whichever side fails first closes the other's socket so that it does not block on.
        let first_failure = AtomicU8::new(0);
        std::thread::scope(|s| {
            let sender = s.spawn(|| {
                let r = { next }.write_all(as_bytes(out));
                if r.is_err() && first_failure.compare_exchange(0, 1, SeqCst, SeqCst).is_ok() {
                    let _ = prev.shutdown(Shutdown::Read);
                }
                r
            });
            let received = recv_pieces(prev, len, &mut each);
            if received.is_err() && first_failure.compare_exchange(0, 2, SeqCst, SeqCst).is_ok() {
                let _ = next.shutdown(Shutdown::Write);
            }
            let sent = sender
                .join()
                .unwrap_or_else(|_| Err(io::Error::other("the sending thread panicked")));
            match (sent, received) {
                (Ok(()), Ok(())) => Ok(()),
                (Err(e), Ok(())) => Err(self.send_error(e)),
                (Ok(()), Err(e)) => Err(self.recv_error(e)),
                (Err(se), Err(re)) => Err(if first_failure.load(SeqCst) == 1 {
                    self.send_error(se)
                } else {
                    self.recv_error(re)
                }),
            }
        })
    }

    /// Ring reduce-scatter over `buf` of `world_size` chunks of `k`: afterwards chunk `r` of
    /// rank `r` holds the sum over ranks. At step `s` rank `r` sends chunk `r-s-1` and adds the
    /// incoming chunk `r-s-2` into its own, so chunk `c` starts at rank `c+1` and ends at `c`.
    fn reduce_scatter_ring<T: WithDType>(
        &self,
        links: &Links,
        buf: &mut [T],
        k: usize,
    ) -> Result<()> {
        let (w, r) = (self.world_size, self.rank);
        for s in 0..w - 1 {
            let send = (r + 2 * w - s - 1) % w;
            let recv = (r + 2 * w - s - 2) % w;
            let (out, acc) = two_chunks(buf, k, send, recv);
            self.step(links, out, k, |off, piece| {
                for (a, b) in acc[off..off + piece.len()].iter_mut().zip(piece) {
                    *a = *b + *a;
                }
            })?;
        }
        Ok(())
    }

    /// Ring all-gather over `buf` of `world_size` chunks of `k`, chunk `r` filled on rank `r`.
    fn all_gather_ring<T: WithDType>(&self, links: &Links, buf: &mut [T], k: usize) -> Result<()> {
        let (w, r) = (self.world_size, self.rank);
        for s in 0..w - 1 {
            let send = (r + w - s) % w;
            let recv = (r + 2 * w - s - 1) % w;
            let (out, into) = two_chunks(buf, k, send, recv);
            self.step(links, out, k, |off, piece| {
                into[off..off + piece.len()].copy_from_slice(piece);
            })?;
        }
        Ok(())
    }

    /// A sum in the accumulation type `T`, on the zero-padded flat tensor.
    fn all_reduce_as<T: WithDType>(&self, t: &Tensor) -> Result<Tensor> {
        let n = t.elem_count();
        let mut buf: Vec<T> = host_vec(t)?;
        let k = n.div_ceil(self.world_size);
        buf.resize(k * self.world_size, T::from_f64(0.0));
        self.run(Op::AllReduce, t.dtype(), n, 0, |links| {
            self.reduce_scatter_ring(links, &mut buf, k)?;
            self.all_gather_ring(links, &mut buf, k)
        })?;
        buf.truncate(n);
        back(Tensor::from_vec(buf, t.shape(), &Device::Cpu)?, t)
    }

    fn reduce_scatter_as<T: WithDType>(&self, t: &Tensor, k: usize) -> Result<Tensor> {
        let mut buf: Vec<T> = host_vec(t)?;
        self.run(Op::ReduceScatter, t.dtype(), buf.len(), 0, |links| {
            self.reduce_scatter_ring(links, &mut buf, k)
        })?;
        let mine = buf[self.rank * k..(self.rank + 1) * k].to_vec();
        back(Tensor::from_vec(mine, k, &Device::Cpu)?, t)
    }

    fn all_gather_raw<T: WithDType>(&self, own: &[T], dtype: DType) -> Result<Tensor> {
        let (w, k) = (self.world_size, own.len());
        let mut buf = vec![T::from_f64(0.0); w * k];
        buf[self.rank * k..(self.rank + 1) * k].copy_from_slice(own);
        self.run(Op::AllGather, dtype, k, 0, |links| {
            self.all_gather_ring(links, &mut buf, k)
        })?;
        Ok(Tensor::from_vec(buf, w * k, &Device::Cpu)?)
    }

    /// A broadcast along the chain root, root+1, ..., root-1: each rank forwards every piece
    /// as soon as it has it. The chain is not a cycle, so blocking sends cannot deadlock.
    fn broadcast_raw<T: WithDType>(
        &self,
        own: &[T],
        dtype: DType,
        root: usize,
        shape: &Shape,
    ) -> Result<Tensor> {
        let mut buf = own.to_vec();
        self.run(Op::Broadcast, dtype, buf.len(), root, |links| {
            if self.rank == root {
                return { &links.next }
                    .write_all(as_bytes(&buf))
                    .map_err(|e| self.send_error(e));
            }
            let forward = self.next_rank() != root;
            let piece = (PIECE_BYTES / std::mem::size_of::<T>().max(1)).max(1);
            for chunk in buf.chunks_mut(piece) {
                { &links.prev }
                    .read_exact(as_bytes_mut(chunk))
                    .map_err(|e| self.recv_error(e))?;
                if forward {
                    { &links.next }
                        .write_all(as_bytes(chunk))
                        .map_err(|e| self.send_error(e))?;
                }
            }
            Ok(())
        })?;
        Ok(Tensor::from_vec(buf, shape, &Device::Cpu)?)
    }

    /// Runs a raw (type-preserving) operation on the tensor's elements on the host.
    fn raw<F>(&self, t: &Tensor, f: F) -> Result<Tensor>
    where
        F: RawOp,
    {
        let host = t.to_device(&Device::Cpu)?.contiguous()?;
        let (storage, layout) = host.storage_and_layout();
        let (start, end) = layout
            .contiguous_offsets()
            .context("collective on a non-contiguous tensor")?;
        let Storage::Cpu(cpu) = &*storage else {
            bail!("collective: the tensor did not move to the CPU");
        };
        let out = with_cpu_slice!(cpu, start..end, t.dtype(), |v| f.run(self, v, t))?;
        drop(storage);
        back(out, t)
    }
}

/// An operation generic over the element type, for [`TcpRing::raw`] (closures cannot be generic).
trait RawOp {
    fn run<T: WithDType>(&self, ring: &TcpRing, v: &[T], t: &Tensor) -> Result<Tensor>;
}

struct GatherOp;

impl RawOp for GatherOp {
    fn run<T: WithDType>(&self, ring: &TcpRing, v: &[T], t: &Tensor) -> Result<Tensor> {
        ring.all_gather_raw(v, t.dtype())
    }
}

struct BroadcastOp(usize);

impl RawOp for BroadcastOp {
    fn run<T: WithDType>(&self, ring: &TcpRing, v: &[T], t: &Tensor) -> Result<Tensor> {
        ring.broadcast_raw(v, t.dtype(), self.0, t.shape())
    }
}

impl Collectives for TcpRing {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        if self.links.is_none() || t.elem_count() == 0 {
            return Ok(t.clone());
        }
        match sum_dtype(t.dtype()) {
            DType::F32 => self.all_reduce_as::<f32>(t),
            DType::F64 => self.all_reduce_as::<f64>(t),
            _ => self.all_reduce_as::<i64>(t),
        }
    }

    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        let k = scatter_len(t, self.world_size)?;
        if self.links.is_none() || k == 0 {
            return Ok(t.clone());
        }
        match sum_dtype(t.dtype()) {
            DType::F32 => self.reduce_scatter_as::<f32>(t, k),
            DType::F64 => self.reduce_scatter_as::<f64>(t, k),
            _ => self.reduce_scatter_as::<i64>(t, k),
        }
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let k = gather_len(t)?;
        if self.links.is_none() {
            return Ok(t.clone());
        }
        if k == 0 {
            return Ok(t.clone());
        }
        self.raw(t, GatherOp)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root >= self.world_size {
            bail!(
                "broadcast from rank {root}, but the world size is {}",
                self.world_size
            );
        }
        if self.links.is_none() || t.elem_count() == 0 {
            return Ok(t.clone());
        }
        self.raw(t, BroadcastOp(root))
    }

    fn barrier(&self) -> Result<()> {
        // Every rank's result depends on every rank's input, so none leaves before all arrive.
        self.all_reduce_sum(&Tensor::zeros(1, DType::F32, &Device::Cpu)?)
            .map(|_| ())
    }

    fn backend(&self) -> &'static str {
        "tcp"
    }
}

/// The length `k` of each rank's chunk of a reduce-scatter input (checked to be 1-D, `W * k`).
pub(super) fn scatter_len(t: &Tensor, world_size: usize) -> Result<usize> {
    match t.dims() {
        [n] if n % world_size == 0 => Ok(n / world_size),
        dims => bail!(
            "reduce_scatter_sum needs a 1-D tensor whose length is a multiple of the world size \
             {world_size}, got shape {dims:?}"
        ),
    }
}

/// The length of an all-gather input (checked to be 1-D).
pub(super) fn gather_len(t: &Tensor) -> Result<usize> {
    match t.dims() {
        [k] => Ok(*k),
        dims => bail!("all_gather needs a 1-D tensor, got shape {dims:?}"),
    }
}

/// The type sums travel and accumulate in.
fn sum_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F64 => DType::F64,
        DType::U8 | DType::U32 | DType::I16 | DType::I32 | DType::I64 => DType::I64,
        _ => DType::F32,
    }
}

/// The tensor's elements on the host, converted to `T`.
fn host_vec<T: WithDType>(t: &Tensor) -> Result<Vec<T>> {
    Ok(t.flatten_all()?
        .to_device(&Device::Cpu)?
        .to_dtype(T::DTYPE)?
        .to_vec1::<T>()?)
}

/// A host result back in the input's dtype and on its device.
fn back(out: Tensor, like: &Tensor) -> Result<Tensor> {
    Ok(out.to_dtype(like.dtype())?.to_device(like.device())?)
}

/// Chunk `a` to read and chunk `b` to write, of a buffer cut into chunks of `k` (`a != b`).
fn two_chunks<T>(buf: &mut [T], k: usize, a: usize, b: usize) -> (&[T], &mut [T]) {
    debug_assert_ne!(a, b);
    if a < b {
        let (lo, hi) = buf.split_at_mut(b * k);
        (&lo[a * k..(a + 1) * k], &mut hi[..k])
    } else {
        let (lo, hi) = buf.split_at_mut(a * k);
        (&hi[..k], &mut lo[b * k..(b + 1) * k])
    }
}

fn recv_pieces<T: WithDType>(
    mut prev: &TcpStream,
    len: usize,
    each: &mut impl FnMut(usize, &[T]),
) -> io::Result<()> {
    let piece = (PIECE_BYTES / std::mem::size_of::<T>().max(1)).max(1);
    let mut buf = vec![T::from_f64(0.0); piece.min(len)];
    let mut off = 0;
    while off < len {
        let n = piece.min(len - off);
        prev.read_exact(as_bytes_mut(&mut buf[..n]))?;
        each(off, &buf[..n]);
        off += n;
    }
    Ok(())
}

fn as_bytes<T: WithDType>(s: &[T]) -> &[u8] {
    // SAFETY: only called on candle's element types (integers, IEEE floats, the one-byte f8
    // newtype): plain data without padding, so all of their bytes are initialised.
    unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

fn as_bytes_mut<T: WithDType>(s: &mut [T]) -> &mut [u8] {
    // SAFETY: as in `as_bytes`; moreover every bit pattern is a valid value of these types, so
    // writing arbitrary bytes leaves valid elements.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(s)) }
}

fn connect_next(
    addr: SocketAddr,
    rank: usize,
    peer: usize,
    id: u64,
    deadline: Instant,
) -> Result<TcpStream> {
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(5)) {
            Ok(s) => {
                tune_socket(&s);
                let mut hello = [0u8; 16];
                hello[0..4].copy_from_slice(&RING_MAGIC.to_le_bytes());
                hello[4..8].copy_from_slice(&(rank as u32).to_le_bytes());
                hello[8..16].copy_from_slice(&id.to_le_bytes());
                { &s }
                    .write_all(&hello)
                    .with_context(|| format!("lost connection to rank {peer} while connecting"))?;
                return Ok(s);
            }
            Err(e) if Instant::now() >= deadline => {
                bail!("could not connect to rank {peer} at {addr}: {e}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn accept_prev(
    listener: &TcpListener,
    peer: usize,
    id: u64,
    deadline: Instant,
) -> Result<TcpStream> {
    listener.set_nonblocking(true)?;
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(Duration::from_secs(10)))?;
                let mut hello = [0u8; 16];
                let ok = { &s }.read_exact(&mut hello).is_ok()
                    && hello[0..4] == RING_MAGIC.to_le_bytes()
                    && hello[4..8] == (peer as u32).to_le_bytes()
                    && hello[8..16] == id.to_le_bytes();
                if ok {
                    tune_socket(&s);
                    return Ok(s);
                }
                // Not our predecessor (a stray connection): keep waiting for it.
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    bail!("rank {peer} did not connect to this rank's collectives port in time");
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e).context("accepting the previous rank's connection"),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
