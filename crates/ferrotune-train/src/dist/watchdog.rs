//! Heartbeat bookkeeping for the liveness watchdog ([`super::store`]): when this side must send
//! its next heartbeat, and whether the other side has been silent for longer than the bound.
//!
//! A closed connection says that a process ended; it says nothing about one that is stopped
//! (SIGSTOP, a debugger), frozen (swapping, a hung driver) or cut off without a close. So every
//! rank's watchdog thread sends a heartbeat on its watch connection every [`interval`], the store
//! (in rank 0) answers each with one of its own, and each side declares the other lost after
//! `bound` without hearing from it. The thread is the rank's own, so a rank busy for minutes in
//! its main thread (saving a checkpoint, a long step) still beats.

use std::io::{self, Read};
use std::net::TcpStream;
use std::time::{Duration, Instant};

/// How often heartbeats go out for a given silence bound: eight per bound, so that a beat or two
/// delayed by a busy machine does not look like silence; at most every 10 ms, at least every 5 s.
pub(crate) fn interval(bound: Duration) -> Duration {
    (bound / 8).clamp(Duration::from_millis(10), Duration::from_secs(5))
}

/// One side's view of a heartbeat exchange.
#[derive(Debug, Clone)]
pub(crate) struct Heartbeats {
    bound: Duration,
    interval: Duration,
    last_sent: Option<Instant>,
    last_heard: Instant,
}

impl Heartbeats {
    /// Starts counting at `now`, as if the other side had just been heard from.
    pub(crate) fn new(bound: Duration, now: Instant) -> Self {
        Self {
            bound,
            interval: interval(bound),
            last_sent: None,
            last_heard: now,
        }
    }

    /// Something arrived from the other side at `now`.
    pub(crate) fn heard(&mut self, now: Instant) {
        self.last_heard = self.last_heard.max(now);
    }

    /// A heartbeat went out at `now`.
    pub(crate) fn sent(&mut self, now: Instant) {
        self.last_sent = Some(now);
    }

    /// Whether a heartbeat is due at `now`.
    pub(crate) fn send_due(&self, now: Instant) -> bool {
        self.last_sent
            .is_none_or(|t| now.saturating_duration_since(t) >= self.interval)
    }

    /// How long the other side has been silent at `now`, once that is the bound or more.
    pub(crate) fn silent(&self, now: Instant) -> Option<Duration> {
        let quiet = now.saturating_duration_since(self.last_heard);
        (quiet >= self.bound).then_some(quiet)
    }

    /// How long to wait for the other side at `now` before there is something to do (send a
    /// beat, or give up on it); at least 1 ms, since a zero socket timeout means "forever".
    pub(crate) fn wait(&self, now: Instant) -> Duration {
        let next_send = match self.last_sent {
            None => Duration::ZERO,
            Some(t) => (t + self.interval).saturating_duration_since(now),
        };
        let deadline = (self.last_heard + self.bound).saturating_duration_since(now);
        next_send.min(deadline).max(Duration::from_millis(1))
    }
}

/// Reads length-prefixed frames (the store's framing) from a socket with a read timeout without
/// losing a frame that a timeout cut in two: bytes are kept until their frame is whole.
#[derive(Default)]
pub(crate) struct FrameReader {
    buf: Vec<u8>,
}

impl FrameReader {
    /// The next whole frame: `Ok(None)` when the socket's read timeout passed first, an error
    /// when the connection closed or failed.
    pub(crate) fn next(&mut self, mut conn: &TcpStream) -> io::Result<Option<Vec<u8>>> {
        loop {
            if let Some(frame) = self.pop()? {
                return Ok(Some(frame));
            }
            let mut chunk = [0u8; 256];
            match conn.read(&mut chunk) {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                Err(e) if is_timeout(&e) => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
    }

    fn pop(&mut self) -> io::Result<Option<Vec<u8>>> {
        let Some(len) = self.buf.get(..4) else {
            return Ok(None);
        };
        let len = u32::from_le_bytes(len.try_into().expect("4 bytes")) as usize;
        // Watch connections carry only tiny notices; anything big is not one of ours.
        if len > 1 << 20 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("frame of {len} bytes on a watch connection"),
            ));
        }
        if self.buf.len() < 4 + len {
            return Ok(None);
        }
        let frame = self.buf[4..4 + len].to_vec();
        self.buf.drain(..4 + len);
        Ok(Some(frame))
    }
}

/// Whether a socket error is its read timeout passing.
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeats_are_due_every_interval_and_silence_counts_from_the_last_heard() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut h = Heartbeats::new(s(8), t0);
        assert_eq!(interval(s(8)), s(1));
        assert_eq!(interval(s(600)), s(5));
        assert_eq!(
            interval(Duration::from_millis(1)),
            Duration::from_millis(10)
        );
        // The first beat goes out at once.
        assert!(h.send_due(t0));
        assert_eq!(h.wait(t0), Duration::from_millis(1));
        h.sent(t0);
        assert!(!h.send_due(t0 + Duration::from_millis(999)));
        assert!(h.send_due(t0 + s(1)));
        assert_eq!(h.wait(t0), s(1));
        // Silent only from the bound on, counted from the last time the other side was heard.
        assert_eq!(h.silent(t0 + s(7)), None);
        assert_eq!(h.silent(t0 + s(8)), Some(s(8)));
        h.heard(t0 + s(7));
        h.sent(t0 + s(7));
        assert_eq!(h.silent(t0 + s(14)), None);
        assert_eq!(h.silent(t0 + s(16)), Some(s(9)));
        // An earlier arrival processed late does not move the clock back.
        h.heard(t0 + s(3));
        assert_eq!(h.silent(t0 + s(14)), None);
        // The wait ends at the next beat, or at the deadline when that comes first.
        assert_eq!(h.wait(t0 + s(7)), s(1));
        h.sent(t0 + s(20));
        assert_eq!(h.wait(t0 + s(14)), s(1));
        assert_eq!(h.wait(t0 + s(15)), Duration::from_millis(1));
    }

    #[test]
    fn frames_cut_by_a_timeout_are_kept_whole() {
        use std::io::Write;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut tx = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (rx, _) = listener.accept().unwrap();
        rx.set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let mut reader = FrameReader::default();
        assert!(reader.next(&rx).unwrap().is_none());
        // Half a frame, a timeout, then the rest and a second frame.
        tx.write_all(&[3, 0, 0, 0, 7]).unwrap();
        assert!(reader.next(&rx).unwrap().is_none());
        tx.write_all(&[8, 9, 1, 0, 0, 0, 4]).unwrap();
        assert_eq!(reader.next(&rx).unwrap(), Some(vec![7, 8, 9]));
        assert_eq!(reader.next(&rx).unwrap(), Some(vec![4]));
        drop(tx);
        assert!(reader.next(&rx).is_err());
    }
}
