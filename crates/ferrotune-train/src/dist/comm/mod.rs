//! Collective operations over tensors, behind one interface: a TCP ring for the CPU (and for the
//! tests), NCCL for CUDA devices.

mod tcp;

#[cfg(feature = "nccl")]
mod nccl;

use anyhow::{bail, Result};
use candle_core::{Device, Tensor};

use super::env::DistEnv;
use super::store::Store;

pub use tcp::TcpRing;

/// The collectives a distributed recipe needs. Every rank must call the same operations in the
/// same order with tensors of the same shape and dtype.
pub trait Collectives: Send + Sync {
    /// This process's rank.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world_size(&self) -> usize;
    /// Elementwise sum over ranks; same shape and dtype out; every rank gets bit-identical results.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// `t` is 1-D of length `world_size * k`; returns this rank's chunk `[k]` of the sum over
    /// ranks (chunk `r` is elements `r*k..(r+1)*k`).
    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// `t` is 1-D `[k]` on every rank; returns `[world_size * k]` with rank `r`'s data at `r*k`.
    fn all_gather(&self, t: &Tensor) -> Result<Tensor>;
    /// Rank `root`'s tensor on every rank (every rank passes a tensor of the same shape/dtype).
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;
    /// Returns once every rank has called it.
    fn barrier(&self) -> Result<()>;
    /// A short name for logs: "tcp" or "nccl".
    fn backend(&self) -> &'static str;
}

/// The backend for `device`: TCP for the CPU, NCCL for CUDA (feature "nccl"; without it CUDA
/// tensors travel over TCP through host memory). A single process gets the TCP backend, which
/// then opens no sockets, unless `FERROTUNE_DIST_BACKEND=nccl` asks for NCCL;
/// `FERROTUNE_DIST_BACKEND=tcp` forces TCP on CUDA too.
pub fn init(env: &DistEnv, store: &Store, device: &Device) -> Result<Box<dyn Collectives>> {
    if env.rank != store.rank() || env.world_size != store.world_size() {
        bail!(
            "collectives for rank {} of {} over a store joined as rank {} of {}",
            env.rank,
            env.world_size,
            store.rank(),
            store.world_size()
        );
    }
    let knob = ferrotune_core::switch::DIST_BACKEND;
    let forced = knob.value().unwrap_or_default();
    match forced.trim() {
        "" => {}
        "tcp" => return Ok(Box::new(TcpRing::connect(env, store)?)),
        "nccl" if cfg!(feature = "nccl") && device.is_cuda() => {}
        other => bail!(
            "{}={other:?}: use \"tcp\"{}",
            knob.name,
            if cfg!(feature = "nccl") {
                " or \"nccl\" (CUDA devices only)"
            } else {
                " (this build has no NCCL support: feature \"nccl\")"
            }
        ),
    }
    // NCCL between several GPUs; a single process uses it only when asked (to check the NCCL
    // path against single-device training on one GPU).
    #[cfg(feature = "nccl")]
    if device.is_cuda() && (env.world_size > 1 || forced.trim() == "nccl") {
        return Ok(Box::new(nccl::NcclComm::connect(env, store, device)?));
    }
    Ok(Box::new(TcpRing::connect(env, store)?))
}
