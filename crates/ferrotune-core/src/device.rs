//! Parsing of the user-facing names for devices and compute dtypes.

use candle_core::{DType, Device};

/// Parses a compute dtype as users write it on the CLI or in a config (`f32`, `fp32`, `float32`,
/// `bf16`, `bfloat16`, `f16`, `fp16`, `float16`).
pub fn parse_dtype(name: &str) -> Result<DType, String> {
    match name.trim().to_ascii_lowercase().as_str() {
        "f32" | "fp32" | "float32" | "float" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "fp16" | "float16" | "half" => Ok(DType::F16),
        other => Err(format!(
            "unknown dtype '{other}': expected one of f32 (fp32), bf16, f16"
        )),
    }
}

/// Parses a device name: `cpu`, `cuda` (GPU 0) or `cuda:N`.
pub fn parse_device(name: &str) -> Result<Device, String> {
    let Some(ordinal) = parse_device_name(name)? else {
        return Ok(Device::Cpu);
    };
    let name = name.trim().to_ascii_lowercase();
    // A CUDA build loads the CUDA libraries now: a missing one is named, with what to install.
    #[cfg(feature = "cuda")]
    crate::cuda_load::require_gpu_libraries()
        .map_err(|e| format!("device '{name}' is not available: {e} (or use device: cpu)"))?;
    let device = crate::cuda_load::new_cuda(ordinal).map_err(|e| {
        format!("device '{name}' is not available: {e} (this binary needs the `cuda` feature and a GPU)")
    })?;
    #[cfg(feature = "cuda")]
    gpu::configure(&device);
    Ok(device)
}

/// The GPU index a device name (`cpu`, `cuda`, `cuda:N`, any case) names, `None` for the CPU,
/// without opening the device: what a config is checked with on a machine that may have no GPU.
pub fn parse_device_name(name: &str) -> Result<Option<usize>, String> {
    let name = name.trim().to_ascii_lowercase();
    if name == "cpu" {
        return Ok(None);
    }
    if name == "cuda" {
        return Ok(Some(0));
    }
    match name.strip_prefix("cuda:") {
        Some(n) => n
            .parse::<usize>()
            .map(Some)
            .map_err(|_| format!("invalid device '{name}': expected cuda:N with N a GPU index")),
        None => Err(format!(
            "unknown device '{name}': expected cpu, cuda or cuda:N"
        )),
    }
}

/// Peak GPU memory in bytes held by tensors since the last [`reset_peak_memory`] (the CUDA
/// memory pool's high-water mark: what PyTorch's `max_memory_allocated` reports), or `None` on
/// the CPU.
pub fn peak_memory_bytes(device: &Device) -> Option<u64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return gpu::pool_attribute(d, gpu::PoolAttr::UsedHigh);
    }
    let _ = device;
    None
}

/// The GPU's name (`NVIDIA H100 80GB HBM3`), or `None` on the CPU.
pub fn gpu_name(device: &Device) -> Option<String> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        return d.cuda_stream().context().name().ok();
    }
    let _ = device;
    None
}

/// Restarts [`peak_memory_bytes`] from the memory in use now.
pub fn reset_peak_memory(device: &Device) {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = device {
        gpu::reset_used_high(d);
    }
    let _ = device;
}

#[cfg(feature = "cuda")]
mod gpu {
    use candle_core::cuda::cudarc::driver::sys;
    use candle_core::cuda::CudaDevice;
    use candle_core::Device;

    pub(super) enum PoolAttr {
        UsedHigh,
    }

    fn default_pool(d: &CudaDevice) -> Option<sys::CUmemoryPool> {
        let stream = d.cuda_stream();
        let ctx = stream.context();
        ctx.bind_to_thread().ok()?;
        let mut pool = std::ptr::null_mut();
        // SAFETY: plain driver query on a bound context.
        let rc = unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) };
        (rc == sys::CUresult::CUDA_SUCCESS).then_some(pool)
    }

    pub(super) fn pool_attribute(d: &CudaDevice, attr: PoolAttr) -> Option<u64> {
        let pool = default_pool(d)?;
        let attr = match attr {
            PoolAttr::UsedHigh => sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
        };
        let mut v: u64 = 0;
        // SAFETY: the attribute is a cuuint64_t.
        let rc = unsafe { sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()) };
        (rc == sys::CUresult::CUDA_SUCCESS).then_some(v)
    }

    fn set(d: &CudaDevice, attr: sys::CUmemPool_attribute, mut v: u64) {
        if let Some(pool) = default_pool(d) {
            // SAFETY: both attributes set here are cuuint64_t.
            unsafe { sys::cuMemPoolSetAttribute(pool, attr, (&mut v as *mut u64).cast()) };
        }
    }

    pub(super) fn reset_used_high(d: &CudaDevice) {
        set(
            d,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            0,
        );
    }

    /// Keeps freed memory in the pool instead of handing it back to the driver at every
    /// synchronization (the pool's default), which otherwise remaps memory every step; and, for a
    /// process that drives the GPU from one thread, turns off cudarc's per-buffer events.
    pub(super) fn configure(device: &Device) {
        let Device::Cuda(d) = device else { return };
        set(
            d,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            u64::MAX,
        );
        // Distributed ranks run collectives from a communication thread, whose per-thread stream
        // needs the events to order against the compute thread's; a single process does not.
        let distributed = std::env::var("WORLD_SIZE")
            .ok()
            .and_then(|w| w.parse::<usize>().ok())
            .is_some_and(|w| w > 1);
        if !distributed {
            // SAFETY: without a second thread issuing work, candle's single stream orders every
            // read and write of a buffer.
            unsafe { d.disable_event_tracking() };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dtypes_parse_and_unknown_is_an_error() {
        assert_eq!(parse_dtype("bf16").unwrap(), DType::BF16);
        assert_eq!(parse_dtype("FP32").unwrap(), DType::F32);
        let err = parse_dtype("int3").unwrap_err();
        assert!(err.contains("int3") && err.contains("bf16"), "{err}");
    }

    #[test]
    fn devices_parse() {
        assert!(parse_device("cpu").unwrap().is_cpu());
        assert!(parse_device("tpu").unwrap_err().contains("tpu"));
        assert!(parse_device("cuda:x").unwrap_err().contains("cuda:N"));
    }
}
