//! Process-wide on/off switches for optional fast paths, each with an environment variable that
//! turns it off, so a slower reference path can be timed or used instead.

use std::sync::atomic::{AtomicU8, Ordering};

/// On unless its environment variable is `0`, until [`EnvSwitch::set`] says otherwise.
pub struct EnvSwitch {
    var: &'static str,
    /// 0 = not yet read from the environment, 1 = on, 2 = off.
    state: AtomicU8,
}

impl EnvSwitch {
    /// A switch read from `var` on first use.
    pub const fn new(var: &'static str) -> Self {
        Self {
            var,
            state: AtomicU8::new(0),
        }
    }

    /// Whether the switch is on.
    pub fn get(&self) -> bool {
        match self.state.load(Ordering::Relaxed) {
            1 => true,
            2 => false,
            _ => {
                let on = std::env::var(self.var).map_or(true, |v| v.trim() != "0");
                self.set(on);
                on
            }
        }
    }

    /// Turns the switch on or off for the whole process.
    pub fn set(&self, on: bool) {
        self.state.store(if on { 1 } else { 2 }, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::EnvSwitch;

    #[test]
    fn on_unless_the_variable_is_zero_until_set() {
        static UNSET: EnvSwitch = EnvSwitch::new("FERROTUNE_TEST_SWITCH_NEVER_SET");
        assert!(UNSET.get());
        UNSET.set(false);
        assert!(!UNSET.get());
        // Read once, on first use.
        std::env::set_var("FERROTUNE_TEST_SWITCH_ZERO", "0");
        static ZERO: EnvSwitch = EnvSwitch::new("FERROTUNE_TEST_SWITCH_ZERO");
        assert!(!ZERO.get());
        std::env::set_var("FERROTUNE_TEST_SWITCH_ZERO", "1");
        assert!(!ZERO.get());
        ZERO.set(true);
        assert!(ZERO.get());
    }
}
