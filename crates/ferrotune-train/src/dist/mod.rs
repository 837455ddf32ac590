//! Multi-process (distributed) training: torchrun's environment contract ([`env`]), the
//! rendezvous store with its liveness watchdog ([`store`]), and tensor collectives ([`comm`]).

pub mod comm;
pub mod env;
pub mod fsdp;
pub mod store;

pub use comm::{init as init_collectives, Collectives};
pub use env::DistEnv;
pub use store::Store;
