//! Multi-process (distributed) training: torchrun's environment contract ([`env`]), the
//! rendezvous store with its liveness watchdog ([`store`], heartbeats in [`watchdog`]), and tensor
//! collectives ([`comm`]).

pub mod comm;
pub mod env;
pub mod fsdp;
pub mod store;
mod watchdog;

pub use comm::{init as init_collectives, Collectives};
pub use env::DistEnv;
pub use store::Store;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use candle_core::Device;

/// How long a rank waits for the others to join.
const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);

/// Joins the group torchrun's environment `env` describes: the rendezvous store (to be kept for
/// the whole run: it is also the watchdog that stops every rank when one dies, or sends no
/// heartbeat for `watchdog`, see [`env::watchdog_timeout`]) and the collectives for `device`.
pub fn join_group(
    env: &DistEnv,
    device: &Device,
    watchdog: Duration,
) -> Result<(Store, Arc<dyn Collectives>)> {
    let store =
        Store::connect_with_watchdog(env, RENDEZVOUS_TIMEOUT, watchdog).with_context(|| {
            format!(
                "rank {}: rendezvous at {}:{}",
                env.rank, env.master_addr, env.master_port
            )
        })?;
    let collectives: Arc<dyn Collectives> = Arc::from(comm::init(env, &store, device)?);
    Ok((store, collectives))
}
