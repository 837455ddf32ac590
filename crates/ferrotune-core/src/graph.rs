//! CUDA graphs: the kernels a piece of work queues on a device's stream, recorded once and then
//! replayed with one launch. A decode step queues a few hundred small kernels; replayed as a
//! graph they start back to back on the GPU instead of each waiting for the host to issue it.
//!
//! Capture records, it does not run: the recorded kernels keep the arguments (pointers, sizes)
//! they had at capture, so whatever changes between replays must live in device buffers that are
//! rewritten before each launch, and the work must not read results back to the host or copy from
//! it while it is captured. Memory the work allocates and frees during capture becomes part of
//! the graph (stream-ordered allocation); the work must free everything it allocated before the
//! capture ends, so results go into buffers made beforehand.

use candle_core::{bail, Device, Result};

/// Whether decode steps may run as CUDA graphs: on unless `FERROTUNE_CUDA_GRAPHS=0`, or as
/// [`set_enabled`] last said.
pub fn enabled() -> bool {
    ENABLED.get()
}

/// Turns CUDA graphs on or off for the whole process (`bench decode` times both).
pub fn set_enabled(on: bool) {
    ENABLED.set(on);
}

static ENABLED: crate::switch::EnvSwitch =
    crate::switch::EnvSwitch::new(&crate::switch::CUDA_GRAPHS);

/// Some candle ops upload their operands' shapes from the host on every call (index_select,
/// broadcasting binary ops), which a capture cannot record. While the returned guard lives (on
/// this thread), candle keeps those uploads on the device and reuses them: hold it while the work
/// runs once before it is captured (filling the cache) and during the capture. `None` (and no
/// effect) off CUDA.
pub fn upload_cache(device: &Device) -> Option<impl Sized> {
    #[cfg(feature = "cuda")]
    {
        match device {
            Device::Cuda(d) => Some(d.enable_cuda_graph_htod_cache()),
            _ => None,
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = device;
        None::<()>
    }
}

/// A recorded piece of GPU work, replayed by [`CapturedGraph::launch`].
pub struct CapturedGraph {
    #[cfg(feature = "cuda")]
    graph: SendGraph,
}

impl std::fmt::Debug for CapturedGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CapturedGraph")
    }
}

/// cudarc's graph holds raw driver handles, so it is not `Send`.
// SAFETY: CUDA graph objects may be used from any thread as long as calls on one graph are not
// concurrent; a `CapturedGraph` is only launched through `&self` by the one owner that holds it
// (the KV cache of one generation, borrowed mutably for each step), and it is not `Sync`.
#[cfg(feature = "cuda")]
struct SendGraph(candle_core::cuda::cudarc::driver::CudaGraph);
#[cfg(feature = "cuda")]
unsafe impl Send for SendGraph {}

impl CapturedGraph {
    /// Records what `work` queues on `device`'s stream (a CUDA device; the work does not run).
    /// If the work or the capture fails, the stream leaves capture mode and the error is
    /// returned; nothing of the work has run.
    pub fn capture(device: &Device, work: impl FnOnce() -> Result<()>) -> Result<Self> {
        #[cfg(feature = "cuda")]
        {
            use candle_core::cuda::cudarc::driver::sys;
            let Device::Cuda(dev) = device else {
                bail!("CUDA graphs need a CUDA device, got {device:?}");
            };
            let stream = dev.cuda_stream();
            stream
                .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(|e| candle_core::Error::Msg(format!("cannot begin a CUDA graph: {e}")))?;
            let worked = work();
            // Always end the capture, so the stream works normally again whatever happened.
            let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
            worked?;
            match ended {
                Ok(Some(graph)) => Ok(Self {
                    graph: SendGraph(graph),
                }),
                Ok(None) => bail!("the CUDA graph capture recorded nothing"),
                Err(e) => bail!("the CUDA graph capture failed: {e}"),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = work;
            bail!("CUDA graphs need a build with the cuda feature (device {device:?})")
        }
    }

    /// Queues one replay of the recorded work on the stream it was captured on.
    pub fn launch(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            self.graph
                .0
                .launch()
                .map_err(|e| candle_core::Error::Msg(format!("CUDA graph launch failed: {e}")))
        }
        #[cfg(not(feature = "cuda"))]
        {
            bail!("CUDA graphs need a build with the cuda feature")
        }
    }
}
