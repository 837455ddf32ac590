//! Writing to a pipe or socket whose reader may have gone, without dying of SIGPIPE.
//!
//! The `ferrotune` binary restores SIGPIPE's default action (so `ferrotune ls | head` ends
//! quietly), which also means a write to a child process that died — a reward worker, a tracker's
//! Python bridge — would end the whole run without a message. [`SigpipeBlocked`] blocks SIGPIPE
//! for the calling thread only while it lives (the signal a write raises is delivered to the
//! writing thread), so such a write returns `EPIPE` as an ordinary error; on drop it consumes a
//! SIGPIPE the write left pending and restores the thread's mask. Other threads, and the
//! process-wide disposition, are untouched.

/// SIGPIPE blocked on this thread until dropped; see the module doc.
pub struct SigpipeBlocked {
    old: libc::sigset_t,
}

fn sigpipe_set() -> libc::sigset_t {
    // SAFETY: sigemptyset/sigaddset only write the set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGPIPE);
        set
    }
}

impl SigpipeBlocked {
    /// Blocks SIGPIPE on the calling thread.
    pub fn new() -> SigpipeBlocked {
        let set = sigpipe_set();
        // SAFETY: pthread_sigmask reads `set` and writes the previous mask into `old`.
        unsafe {
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
            SigpipeBlocked { old }
        }
    }
}

impl Default for SigpipeBlocked {
    fn default() -> Self {
        SigpipeBlocked::new()
    }
}

impl Drop for SigpipeBlocked {
    fn drop(&mut self) {
        let set = sigpipe_set();
        // SAFETY: plain signal-mask syscalls on sets we own; a zero timeout never waits.
        unsafe {
            let mut pending: libc::sigset_t = std::mem::zeroed();
            libc::sigpending(&mut pending);
            if libc::sigismember(&pending, libc::SIGPIPE) == 1 {
                let zero = libc::timespec {
                    tv_sec: 0,
                    tv_nsec: 0,
                };
                libc::sigtimedwait(&set, std::ptr::null_mut(), &zero);
            }
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::SigpipeBlocked;
    use std::io::Write;
    use std::os::fd::FromRawFd;

    /// In a forked child with SIGPIPE's default action (as the binary has it): a write to a pipe
    /// whose reader is closed returns EPIPE under the guard and the child exits normally; without
    /// the guard the same write kills it with SIGPIPE (checked too, so the test can fail).
    #[test]
    fn a_write_to_a_closed_pipe_is_an_error_not_a_signal() {
        fn child(guarded: bool) -> i32 {
            // SAFETY: the child only makes syscalls and leaves with _exit.
            unsafe {
                let pid = libc::fork();
                assert!(pid >= 0);
                if pid == 0 {
                    libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                    let mut fds = [0; 2];
                    libc::pipe(fds.as_mut_ptr());
                    libc::close(fds[0]);
                    let mut w = std::fs::File::from_raw_fd(fds[1]);
                    let code = {
                        let _g = guarded.then(SigpipeBlocked::new);
                        match w.write_all(b"x") {
                            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => 7,
                            _ => 1,
                        }
                    };
                    libc::_exit(code);
                }
                let mut status = 0;
                libc::waitpid(pid, &mut status, 0);
                status
            }
        }
        let guarded = child(true);
        assert!(
            libc::WIFEXITED(guarded) && libc::WEXITSTATUS(guarded) == 7,
            "status {guarded}"
        );
        let bare = child(false);
        assert!(
            libc::WIFSIGNALED(bare) && libc::WTERMSIG(bare) == libc::SIGPIPE,
            "status {bare}"
        );
    }
}
