//! The NCCL backend (feature "nccl"): collectives between CUDA devices, enqueued on candle's own
//! stream of each device so that they are ordered with the kernels that produce and consume the
//! tensors. Rank 0 creates the NCCL unique id and shares it through the store.

use std::ffi::c_char;
use std::sync::{Mutex, MutexGuard};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DeviceRepr};
use candle_core::cuda_backend::cudarc::nccl::{Comm, Id, NcclType, ReduceOp};
use candle_core::cuda_backend::{CudaDType, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Shape, Storage, Tensor};

use super::Collectives;
use crate::dist::env::DistEnv;
use crate::dist::store::Store;

/// NCCL collectives on this rank's CUDA device.
pub struct NcclComm {
    rank: usize,
    world_size: usize,
    device: CudaDevice,
    comm: Mutex<SendComm>,
}

struct SendComm(Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not overlap;
// the Mutex around it serialises them (and keeps every rank's enqueue order the call order).
unsafe impl Send for SendComm {}

#[derive(Clone, Copy)]
enum Kind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast(usize),
}

impl NcclComm {
    /// Creates the communicator on `device` (which should be `cuda:LOCAL_RANK`).
    pub fn connect(env: &DistEnv, store: &Store, device: &Device) -> Result<NcclComm> {
        let Device::Cuda(dev) = device else {
            bail!("the NCCL backend needs a CUDA device, not {device:?}");
        };
        // cudarc loads libnccl when first used, and panics if it is missing: check first.
        ferrotune_core::cuda_load::require(&[ferrotune_core::cuda_load::NCCL]).map_err(|e| {
            anyhow!(
                "the NCCL backend is not available: {e} (or set {}=tcp)",
                ferrotune_core::switch::DIST_BACKEND.name
            )
        })?;
        let stream = dev.cuda_stream();
        // NCCL picks its GPU from the thread's current context.
        stream.context().bind_to_thread()?;
        let key = format!("__comm/nccl/{}/id", store.sequence("comm/nccl"));
        let id = if env.rank == 0 {
            let id = Id::new().map_err(|e| anyhow!("NCCL: creating the unique id: {:?}", e.0))?;
            let bytes: Vec<u8> = id.internal().iter().map(|&c| c as u8).collect();
            store.set(&key, &bytes)?;
            id
        } else {
            let bytes = store.get(&key)?;
            if bytes.len() != 128 {
                bail!(
                    "NCCL unique id from rank 0 has {} bytes, not 128",
                    bytes.len()
                );
            }
            let mut internal = [0 as c_char; 128];
            for (d, s) in internal.iter_mut().zip(&bytes) {
                *d = *s as c_char;
            }
            Id::uninit(internal)
        };
        let comm = Comm::from_rank(stream, env.rank, env.world_size, id).map_err(|e| {
            anyhow!(
                "NCCL: creating the communicator (rank {} of {}): {:?}",
                env.rank,
                env.world_size,
                e.0
            )
        })?;
        Ok(NcclComm {
            rank: env.rank,
            world_size: env.world_size,
            device: dev.clone(),
            comm: Mutex::new(SendComm(comm)),
        })
    }

    fn comm(&self) -> Result<MutexGuard<'_, SendComm>> {
        let guard = self.comm.lock().unwrap_or_else(|e| e.into_inner());
        guard.0.context().bind_to_thread()?;
        Ok(guard)
    }

    /// Runs `kind` on `t` (made contiguous) into a new tensor of `out_shape`.
    fn run(&self, t: &Tensor, kind: Kind, out_shape: Shape) -> Result<Tensor> {
        if !t.device().same_device(&Device::Cuda(self.device.clone())) {
            bail!(
                "NCCL collective on a tensor on {:?}; this communicator is on {:?}",
                t.device(),
                Device::Cuda(self.device.clone())
            );
        }
        let t = t.contiguous()?;
        let comm = self.comm()?;
        let (storage, layout) = t.storage_and_layout();
        let range = layout
            .contiguous_offsets()
            .context("NCCL collective on a non-contiguous tensor")?;
        let Storage::Cuda(cuda) = &*storage else {
            bail!("NCCL collective on a tensor that is not on a CUDA device");
        };
        let n = out_shape.elem_count();
        let dev = &self.device;
        let out = match &cuda.slice {
            CudaStorageSlice::F32(s) => run_typed(&comm.0, dev, s, range, kind, n)?,
            CudaStorageSlice::BF16(s) => run_typed(&comm.0, dev, s, range, kind, n)?,
            CudaStorageSlice::F16(s) => run_typed(&comm.0, dev, s, range, kind, n)?,
            CudaStorageSlice::F64(s) => run_typed(&comm.0, dev, s, range, kind, n)?,
            CudaStorageSlice::U8(s) => run_typed(&comm.0, dev, s, range, kind, n)?,
            CudaStorageSlice::U32(s) => run_typed(&comm.0, dev, s, range, kind, n)?,
            CudaStorageSlice::I32(s) => run_typed(&comm.0, dev, s, range, kind, n)?,
            CudaStorageSlice::I64(s) => run_typed(&comm.0, dev, s, range, kind, n)?,
            _ => bail!("NCCL collectives do not support {:?} tensors", t.dtype()),
        };
        drop(storage);
        Ok(Tensor::from_storage(
            Storage::Cuda(out),
            out_shape,
            BackpropOp::none(),
            false,
        ))
    }
}

fn run_typed<T: NcclType + CudaDType + DeviceRepr>(
    comm: &Comm,
    dev: &CudaDevice,
    src: &CudaSlice<T>,
    (start, end): (usize, usize),
    kind: Kind,
    out_len: usize,
) -> Result<CudaStorage> {
    let src = src.slice(start..end);
    // SAFETY: the collective writes every element of `dst` before anything on the stream reads it.
    let mut dst = unsafe { dev.alloc::<T>(out_len) }?;
    let status = match kind {
        Kind::AllReduce => comm.all_reduce(&src, &mut dst, &ReduceOp::Sum),
        Kind::ReduceScatter => comm.reduce_scatter(&src, &mut dst, &ReduceOp::Sum),
        Kind::AllGather => comm.all_gather(&src, &mut dst),
        Kind::Broadcast(root) => comm.broadcast(Some(&src), &mut dst, root as i32),
    };
    status.map_err(|e| anyhow!("NCCL collective failed: {:?}", e.0))?;
    Ok(CudaStorage::wrap_cuda_slice(dst, dev.clone()))
}

impl Collectives for NcclComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world_size
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        self.run(t, Kind::AllReduce, t.shape().clone())
    }

    fn reduce_scatter_sum(&self, t: &Tensor) -> Result<Tensor> {
        let k = super::tcp::scatter_len(t, self.world_size)?;
        self.run(t, Kind::ReduceScatter, Shape::from(k))
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        let k = super::tcp::gather_len(t)?;
        self.run(t, Kind::AllGather, Shape::from(k * self.world_size))
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root >= self.world_size {
            bail!(
                "broadcast from rank {root}, but the world size is {}",
                self.world_size
            );
        }
        self.run(t, Kind::Broadcast(root), t.shape().clone())
    }

    fn barrier(&self) -> Result<()> {
        let one = Tensor::zeros(1, DType::F32, &Device::Cuda(self.device.clone()))?;
        self.all_reduce_sum(&one)?;
        // The collective is only enqueued; wait for it so that the host, too, has passed it.
        self.device.cuda_stream().synchronize()?;
        Ok(())
    }

    fn backend(&self) -> &'static str {
        "nccl"
    }
}
