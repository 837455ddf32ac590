//! A panic caught without being printed, on the calling thread only.
//!
//! Swapping the process's panic hook around a call (take it, set a silent one, put it back) also
//! silences every other thread's panic meanwhile, and two threads doing it at once can leave the
//! silent hook in place for good. Instead, the first [`catch_quietly`] chains one hook, for the
//! life of the process, in front of the hook then set: it stays silent for a panic on a thread
//! inside [`catch_quietly`] and hands every other panic to that hook, as before.

use std::cell::Cell;
use std::panic::{self, UnwindSafe};
use std::sync::Once;

thread_local! {
    /// This thread is inside [`catch_quietly`].
    static QUIET: Cell<bool> = const { Cell::new(false) };
}

static CHAINED: Once = Once::new();

/// Runs `f`, turning a panic into `Err(its message)` (empty when the payload is not a string)
/// without the panic hook printing it; a panic on another thread meanwhile is reported as usual.
pub fn catch_quietly<T>(f: impl FnOnce() -> T + UnwindSafe) -> Result<T, String> {
    CHAINED.call_once(|| {
        let previous = panic::take_hook();
        panic::set_hook(Box::new(move |info| {
            if !QUIET.with(Cell::get) {
                previous(info)
            }
        }));
    });
    let was = QUIET.with(|q| q.replace(true));
    let result = panic::catch_unwind(f);
    QUIET.with(|q| q.set(was));
    result.map_err(|payload| {
        payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default()
    })
}

#[cfg(test)]
mod tests {
    use super::catch_quietly;
    use std::sync::{Arc, Barrier, Mutex};

    /// The only test of this binary that sets a hook or calls `catch_quietly`, so that the
    /// recording hook is the one the quiet hook chains to.
    #[test]
    fn only_the_quiet_thread_is_silenced() {
        static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            SEEN.lock().unwrap().push(info.to_string());
            previous(info)
        }));
        // Another thread panics while this one is inside `catch_quietly`.
        let (inside, done) = (Arc::new(Barrier::new(2)), Arc::new(Barrier::new(2)));
        let (i, d) = (inside.clone(), done.clone());
        let loud = std::thread::spawn(move || {
            i.wait();
            let panicked = std::panic::catch_unwind(|| panic!("loud one")).is_err();
            d.wait();
            panicked
        });
        let quiet = catch_quietly(|| {
            inside.wait();
            done.wait();
            panic!("quiet {}", "one")
        });
        assert_eq!(quiet.err().as_deref(), Some("quiet one"));
        assert!(loud.join().unwrap());
        assert_eq!(
            catch_quietly(|| std::panic::panic_any(7u8)),
            Err(String::new())
        );
        assert_eq!(catch_quietly(|| 3), Ok(3));
        let seen = SEEN.lock().unwrap();
        assert!(seen.iter().any(|s| s.contains("loud one")), "{seen:?}");
        assert!(!seen.iter().any(|s| s.contains("quiet one")), "{seen:?}");
    }
}
