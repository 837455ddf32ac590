//! torchrun's environment contract: which rank this process is, how many there are, and where
//! rank 0's rendezvous store listens.

use std::time::Duration;

use anyhow::{bail, Context, Result};

/// One process's place in a distributed run, as torchrun (or `ferrotune run --nproc-per-node`)
/// describes it through environment variables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size` (`RANK`).
    pub rank: usize,
    /// Rank on this node, `0..local_world_size` (`LOCAL_RANK`); picks the GPU.
    pub local_rank: usize,
    /// Number of processes in the run (`WORLD_SIZE`).
    pub world_size: usize,
    /// Number of processes on this node (`LOCAL_WORLD_SIZE`).
    pub local_world_size: usize,
    /// Host of rank 0's store (`MASTER_ADDR`).
    pub master_addr: String,
    /// Port of rank 0's store (`MASTER_PORT`); 0 lets a single process pick a free one.
    pub master_port: u16,
}

impl DistEnv {
    /// Reads the process environment. `None` when `WORLD_SIZE` is not set (a plain
    /// single-process run); errors name the variable and its bad value.
    pub fn from_env() -> Result<Option<DistEnv>> {
        Self::from_lookup(|key| std::env::var(key).ok())
    }

    /// [`DistEnv::from_env`] over any variable lookup, so the parsing can be tested without
    /// touching the process-global environment. Empty values count as unset.
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Option<DistEnv>> {
        let get = |key: &str| lookup(key).filter(|v| !v.trim().is_empty());
        let Some(world_size) = get("WORLD_SIZE") else {
            return Ok(None);
        };
        let world_size: usize = parse("WORLD_SIZE", &world_size)?;
        if world_size == 0 {
            bail!("WORLD_SIZE=0: the world size must be at least 1");
        }
        let rank = match get("RANK") {
            Some(v) => parse("RANK", &v)?,
            None if world_size == 1 => 0,
            None => bail!("RANK is not set (WORLD_SIZE={world_size} needs each process's rank)"),
        };
        if rank >= world_size {
            bail!("RANK={rank} is out of range for WORLD_SIZE={world_size}");
        }
        let local_world_size = match get("LOCAL_WORLD_SIZE") {
            Some(v) => parse("LOCAL_WORLD_SIZE", &v)?,
            None => world_size,
        };
        if local_world_size == 0 || local_world_size > world_size {
            bail!(
                "LOCAL_WORLD_SIZE={local_world_size} is out of range for WORLD_SIZE={world_size}"
            );
        }
        let local_rank = match get("LOCAL_RANK") {
            Some(v) => parse("LOCAL_RANK", &v)?,
            None => rank,
        };
        if local_rank >= local_world_size {
            bail!(
                "LOCAL_RANK={local_rank} is out of range for LOCAL_WORLD_SIZE={local_world_size}"
            );
        }
        let master_addr = match get("MASTER_ADDR") {
            Some(v) => v.trim().to_string(),
            None if world_size == 1 => "127.0.0.1".to_string(),
            None => bail!("MASTER_ADDR is not set (WORLD_SIZE={world_size} needs rank 0's host)"),
        };
        let master_port = match get("MASTER_PORT") {
            Some(v) => parse::<u16>("MASTER_PORT", &v)?,
            None if world_size == 1 => 0,
            None => bail!("MASTER_PORT is not set (WORLD_SIZE={world_size} needs rank 0's port)"),
        };
        // Port 0 means "any free port", which only rank 0 itself could know.
        if master_port == 0 && world_size > 1 {
            bail!("MASTER_PORT=0: with WORLD_SIZE={world_size} the port must be given");
        }
        Ok(Some(DistEnv {
            rank,
            local_rank,
            world_size,
            local_world_size,
            master_addr,
            master_port,
        }))
    }

    /// World size 1, rank 0; the store listens on 127.0.0.1 on a free port.
    pub fn single() -> DistEnv {
        DistEnv {
            rank: 0,
            local_rank: 0,
            world_size: 1,
            local_world_size: 1,
            master_addr: "127.0.0.1".to_string(),
            master_port: 0,
        }
    }

    /// True when more than one process takes part.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }
}

fn parse<T: std::str::FromStr>(key: &str, value: &str) -> Result<T> {
    value
        .trim()
        .parse()
        .ok()
        .with_context(|| format!("{key}={value:?} is not a valid non-negative integer"))
}

/// How long a collective or a store wait may block without progress: `FERROTUNE_DIST_TIMEOUT`
/// seconds, default 1800 (as torch.distributed). Long, because one rank may legitimately spend
/// minutes alone (saving a checkpoint) while the others wait for it; a rank that is stopped or
/// gone is caught sooner, by the heartbeat watchdog ([`watchdog_timeout`]).
pub fn op_timeout() -> Result<Duration> {
    Ok(seconds_knob(ferrotune_core::switch::DIST_TIMEOUT)?.unwrap_or(Duration::from_secs(1800)))
}

/// The watchdog's bound when neither the config nor `FERROTUNE_DIST_WATCHDOG` sets one.
pub const DEFAULT_WATCHDOG: Duration = Duration::from_secs(60);

/// How long a rank may send no heartbeat before the others stop the run naming it: `configured`
/// (the config's `dist_watchdog_timeout`, seconds) if given, else `FERROTUNE_DIST_WATCHDOG`, else
/// [`DEFAULT_WATCHDOG`]. Heartbeats come from a thread of their own, so a rank busy alone (saving
/// a checkpoint) still sends them; a stopped, frozen or vanished process does not.
pub fn watchdog_timeout(configured: Option<f64>) -> Result<Duration> {
    if let Some(secs) = configured {
        return positive_seconds(secs).with_context(|| {
            format!("dist_watchdog_timeout: {secs} is not a positive number of seconds")
        });
    }
    Ok(seconds_knob(ferrotune_core::switch::DIST_WATCHDOG)?.unwrap_or(DEFAULT_WATCHDOG))
}

/// A duration from a number of seconds: finite, positive and at most a year (so that adding it
/// to an `Instant` cannot overflow).
fn positive_seconds(secs: f64) -> Option<Duration> {
    (secs.is_finite() && secs > 0.0 && secs <= 365.0 * 86400.0)
        .then(|| Duration::from_secs_f64(secs))
}

/// A [`KnobKind::Seconds`](ferrotune_core::switch::KnobKind::Seconds) knob's value; `None` when
/// unset or empty, an error naming the variable when it is not a positive number of seconds.
fn seconds_knob(knob: ferrotune_core::switch::Knob) -> Result<Option<Duration>> {
    match knob.value() {
        Some(v) if !v.trim().is_empty() => v
            .trim()
            .parse()
            .ok()
            .and_then(positive_seconds)
            .map(Some)
            .with_context(|| format!("{}={v:?} is not a positive number of seconds", knob.name)),
        _ => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_configured_watchdog_bound_must_be_positive_seconds() {
        assert_eq!(watchdog_timeout(Some(6.0)).unwrap(), Duration::from_secs(6));
        assert_eq!(
            watchdog_timeout(Some(0.5)).unwrap(),
            Duration::from_millis(500)
        );
        for bad in [0.0, -1.0, f64::INFINITY, 1e300] {
            let e = format!("{:#}", watchdog_timeout(Some(bad)).unwrap_err());
            assert!(
                e.contains("dist_watchdog_timeout") && e.contains("positive number of seconds"),
                "{e}"
            );
        }
    }
}
