//! CUDA kernels for the parts of a decoder layer that cuBLAS does not cover, each with its
//! backward: RMSNorm, RoPE, gated activations, attention (chunked, memory O(t · chunk) instead of
//! O(t²)) and the output head with cross-entropy (chunked, no `[tokens, vocab]` logits held).
//!
//! The kernels live in `kernels.cu`, compiled to PTX by build.rs and loaded once per device. They
//! take raw device pointers: every tensor passed is contiguous and on the one stream candle uses,
//! so stream order alone keeps reads and writes in sequence. The public entry points are the
//! functions of [`crate::fused`], which send f32/bf16 CUDA tensors here.

mod attention;
pub(crate) mod decode;
mod gated_mlp;
mod linear_ce;
mod lora;
pub(crate) mod nf4;
mod optim;
mod pointwise;

pub(crate) use attention::attention;
pub(crate) use gated_mlp::gated_lora;
pub(crate) use linear_ce::linear_cross_entropy_sum;
pub(crate) use lora::lora_linear;
pub use optim::{adamw_step, AdamWStep};
pub(crate) use pointwise::{act_code, rms_norm, rope, swiglu};

use candle_core::cuda::cudarc::driver::{CudaFunction, DevicePtr, LaunchConfig, PushKernelArg};
use candle_core::cuda::{CudaDevice, CudaStorage, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Device, Layout, Result, Shape, Storage, Tensor};

use crate::fused::kernels::Operands;

/// The PTX of `kernels.cu`.
const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));
/// Name under which the module is cached on each device.
const MODULE: &str = "ferrotune_kernels";

/// What a [`CudaOp`](crate::custom_op::CudaOp)'s forward returns: the output's storage and shape.
type Forward = crate::custom_op::Forward<CudaStorage>;

/// Whether every tensor is a CUDA tensor of one dtype the kernels handle (f32 or bf16).
pub(crate) fn applies(tensors: &[&Tensor]) -> bool {
    let Some(first) = tensors.first() else {
        return false;
    };
    let dtype = first.dtype();
    matches!(dtype, DType::F32 | DType::BF16)
        && tensors
            .iter()
            .all(|t| t.dtype() == dtype && t.device().is_cuda())
}

/// Kernel-name suffix of a dtype.
fn suffix(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::F32 => Ok("f32"),
        DType::BF16 => Ok("bf16"),
        other => bail!("no CUDA kernel for {other:?}"),
    }
}

fn cuda_device(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        other => bail!("expected a CUDA tensor, got one on {other:?}"),
    }
}

/// Device address of the first element of a contiguous storage view.
fn storage_ptr(storage: &CudaStorage, layout: &Layout) -> Result<u64> {
    let Some((start, _)) = layout.contiguous_offsets() else {
        bail!("CUDA kernel input is not contiguous")
    };
    storage_ptr_at(storage, start)
}

/// Device address of element `start` of a storage (a strided view's first element).
fn storage_ptr_at(storage: &CudaStorage, start: usize) -> Result<u64> {
    let stream = storage.device.cuda_stream();
    let (base, size) = match &storage.slice {
        CudaStorageSlice::F32(s) => (s.device_ptr(&stream).0, 4),
        CudaStorageSlice::BF16(s) => (s.device_ptr(&stream).0, 2),
        CudaStorageSlice::U32(s) => (s.device_ptr(&stream).0, 4),
        _ => bail!("CUDA kernel input of an unsupported dtype"),
    };
    Ok(base + (start * size) as u64)
}

/// Device address of the first element of a contiguous CUDA tensor. The address stays valid
/// while the tensor lives; work queued on the stream before the tensor is dropped completes first.
fn ptr(t: &Tensor) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        bail!("expected a CUDA tensor")
    };
    storage_ptr(s, layout)
}

/// Uninitialized storage of `n` elements.
fn alloc_storage(dev: &CudaDevice, dtype: DType, n: usize) -> Result<CudaStorage> {
    // SAFETY: every caller writes all `n` elements with a kernel before the storage is read.
    let slice = unsafe {
        match dtype {
            DType::F32 => CudaStorageSlice::F32(dev.alloc::<f32>(n)?),
            DType::BF16 => CudaStorageSlice::BF16(dev.alloc::<half::bf16>(n)?),
            DType::U32 => CudaStorageSlice::U32(dev.alloc::<u32>(n)?),
            other => bail!("no CUDA buffer for {other:?}"),
        }
    };
    Ok(CudaStorage {
        slice,
        device: dev.clone(),
    })
}

/// An uninitialized tensor outside any graph (a kernel's output).
fn empty(dev: &CudaDevice, dtype: DType, shape: impl Into<Shape>) -> Result<Tensor> {
    let shape = shape.into();
    let storage = alloc_storage(dev, dtype, shape.elem_count())?;
    Ok(Tensor::from_storage(
        Storage::Cuda(storage),
        shape,
        BackpropOp::none(),
        false,
    ))
}

/// `shape` with its last dimension set to `n`: a projection's output shape from its input's.
fn with_last_dim(shape: &Shape, n: usize) -> Shape {
    let mut dims = shape.dims().to_vec();
    *dims.last_mut().expect("rank ≥ 2") = n;
    Shape::from(dims)
}

/// A copy of `t`'s storage (for custom ops whose result was computed before the op ran).
fn clone_storage(t: &Tensor) -> Result<CudaStorage> {
    use candle_core::backend::BackendStorage;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(s) = &*storage else {
        bail!("expected a CUDA tensor")
    };
    s.try_clone(layout)
}

/// One kernel argument (`long` is 64-bit on the platforms CUDA supports).
#[derive(Clone, Copy)]
enum Arg {
    Ptr(u64),
    I32(i32),
    I64(i64),
    F32(f32),
}

/// Kernel handles by (device, name): looking a function up in the module on every launch is a
/// driver call, and decoding launches thousands of kernels per second.
static FUNCTIONS: std::sync::Mutex<Option<FunctionCache>> = std::sync::Mutex::new(None);

/// Per device, by kernel name (looked up by `&str`: no allocation on a hit).
type FunctionCache = std::collections::HashMap<
    candle_core::cuda::DeviceId,
    std::collections::HashMap<String, CudaFunction>,
>;

fn function(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    let mut cache = FUNCTIONS.lock().unwrap_or_else(|e| e.into_inner());
    let by_name = cache
        .get_or_insert_with(Default::default)
        .entry(dev.id())
        .or_default();
    if let Some(f) = by_name.get(name) {
        return Ok(f.clone());
    }
    let f = dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function();
    by_name.insert(name.to_string(), f.clone());
    Ok(f)
}

/// Launches `name` from the module (loaded on first use) on a 2-D grid.
fn launch(
    dev: &CudaDevice,
    name: &str,
    grid: (u32, u32),
    block: u32,
    shared_bytes: u32,
    args: &[Arg],
) -> Result<()> {
    let grid = (grid.0, grid.1, 1);
    launch_with(dev, name, grid, block, shared_bytes, args, false)
}

/// [`launch`] for a kernel that calls `pdl_wait()` before it reads any other kernel's output or
/// writes anything (the decode step's kernels and RMSNorm): with programmatic dependent launch
/// ([`pdl_enabled`]) it may start while the kernel before it finishes.
fn launch_dependent(
    dev: &CudaDevice,
    name: &str,
    grid: (u32, u32, u32),
    block: u32,
    shared_bytes: u32,
    args: &[Arg],
) -> Result<()> {
    launch_with(dev, name, grid, block, shared_bytes, args, pdl_enabled())
}

/// Whether [`launch_dependent`] uses programmatic dependent launch: the PTX targets compute
/// capability 9.0 or later (below it the kernels' `griddepcontrol` is compiled out, and a kernel
/// that does not wait must not start early), and `FERROTUNE_PDL` is not `0`.
fn pdl_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| crate::switch::cuda_cap() >= 90 && crate::switch::PDL.on())
}

fn launch_with(
    dev: &CudaDevice,
    name: &str,
    grid: (u32, u32, u32),
    block: u32,
    shared_bytes: u32,
    args: &[Arg],
    programmatic: bool,
) -> Result<()> {
    let func = function(dev, name)?;
    if shared_bytes > 48 * 1024 {
        // Past 48 KiB a kernel's dynamic shared memory must be asked for (once is enough, but
        // the call costs less than a launch).
        func.set_attribute(
            candle_core::cuda::cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared_bytes as i32,
        )
        .map_err(candle_core::Error::wrap)?;
    }
    let stream = dev.cuda_stream();
    let cfg = LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: shared_bytes,
    };
    if programmatic {
        // SAFETY: as below; the kernel waits for the one before it where that matters.
        return unsafe { launch_programmatic(&func, &stream, cfg, args) };
    }
    let mut builder = stream.launch_builder(&func);
    for a in args {
        match a {
            Arg::Ptr(p) => builder.arg(p),
            Arg::I32(v) => builder.arg(v),
            Arg::I64(v) => builder.arg(v),
            Arg::F32(v) => builder.arg(v),
        };
    }
    // SAFETY: the argument list matches the kernel's signature in kernels.cu (checked by the
    // GPU tests in tests/it/cuda_kernels.rs), and every pointer refers to a live, large enough buffer.
    unsafe { builder.launch(cfg) }.map_err(candle_core::Error::wrap)?;
    Ok(())
}

/// `cuLaunchKernelEx` with the programmatic-stream-serialization attribute (cudarc's launch
/// builder has no launch attributes).
///
/// # Safety
/// `args` must match the kernel's signature, every pointer a live buffer large enough for it.
unsafe fn launch_programmatic(
    func: &CudaFunction,
    stream: &candle_core::cuda::cudarc::driver::CudaStream,
    cfg: LaunchConfig,
    args: &[Arg],
) -> Result<()> {
    use candle_core::cuda::cudarc::driver::sys;
    // One 8-byte slot per argument; the driver reads each parameter's size from the start of
    // its slot (4-byte values in the low half: little-endian).
    let mut values: Vec<u64> = args
        .iter()
        .map(|a| match *a {
            Arg::Ptr(p) => p,
            Arg::I32(v) => v as u32 as u64,
            Arg::I64(v) => v as u64,
            Arg::F32(v) => v.to_bits() as u64,
        })
        .collect();
    let mut params: Vec<*mut std::ffi::c_void> =
        values.iter_mut().map(|v| (v as *mut u64).cast()).collect();
    // SAFETY: a plain C struct, all zeros is a valid value before the fields are set.
    let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: 1,
    };
    stream
        .context()
        .bind_to_thread()
        .map_err(candle_core::Error::wrap)?;
    sys::cuLaunchKernelEx(
        &config,
        func.cu_function(),
        params.as_mut_ptr(),
        std::ptr::null_mut(),
    )
    .result()
    .map_err(candle_core::Error::wrap)
}

/// How many blocks of `name` (`block` threads, `shared_bytes` of dynamic shared memory) the
/// device runs at once: the occupancy calculator's blocks per SM times the SMs. Cached per
/// device and kernel (the decode step asks at every launch it records or makes).
fn resident_blocks(dev: &CudaDevice, name: &str, block: u32, shared_bytes: u32) -> Result<usize> {
    // Per device, by kernel name (looked up by `&str`, as FUNCTIONS is: no allocation on a hit):
    // the block size and shared memory asked about, and the answer.
    type Resident = std::collections::HashMap<
        candle_core::cuda::DeviceId,
        std::collections::HashMap<String, (u32, u32, usize)>,
    >;
    static RESIDENT: std::sync::Mutex<Option<Resident>> = std::sync::Mutex::new(None);
    let mut cache = RESIDENT.lock().unwrap_or_else(|e| e.into_inner());
    let by_name = cache
        .get_or_insert_with(Default::default)
        .entry(dev.id())
        .or_default();
    if let Some(&(b, s, n)) = by_name.get(name) {
        if (b, s) == (block, shared_bytes) {
            return Ok(n);
        }
    }
    let func = function(dev, name)?;
    let per_sm = func
        .occupancy_max_active_blocks_per_multiprocessor(block, shared_bytes as usize, None)
        .map_err(candle_core::Error::wrap)?;
    let sms = dev
        .cuda_stream()
        .context()
        .attribute(
            candle_core::cuda::cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
        )
        .map_err(candle_core::Error::wrap)?;
    let n = per_sm as usize * sms.max(1) as usize;
    by_name.insert(name.to_string(), (block, shared_bytes, n));
    Ok(n)
}

/// Launches an elementwise kernel over `n` elements (256-thread blocks, a grid-stride loop): with
/// `n / 8` threads where every pointer argument is 16-byte aligned, the condition under which the
/// kernel takes 8 elements a thread.
fn launch_elementwise(dev: &CudaDevice, name: &str, n: usize, args: &[Arg]) -> Result<()> {
    let vector = args
        .iter()
        .all(|a| !matches!(a, Arg::Ptr(p) if p % 16 != 0));
    let threads = if vector { n.div_ceil(8) } else { n };
    launch(dev, name, (stride_grid(threads), 1), 256, 0, args)
}

/// Grid size for a grid-stride loop over `n` elements with 256-thread blocks.
fn stride_grid(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 65_535 * 16) as u32
}

/// cuBLAS GEMMs on one device in one dtype: what every GEMM of an op's pass shares.
struct Blas<'a> {
    dev: &'a CudaDevice,
    dtype: DType,
}

impl Blas<'_> {
    /// A row-major GEMM on cuBLAS with accumulation: `C = alpha · op(A) · op(B) + beta · C`,
    /// where C is `[m, n]` (contiguous), op(A) is `[m, k]` stored as `[m, k]` (or as `[k, m]`:
    /// [`Operands::Tn`]) and op(B) is `[k, n]` stored as `[n, k]` ([`Operands::Nt`], i.e. `A Bᵀ`
    /// with B in PyTorch's `Linear` layout) or as `[k, n]`. Pointers are to contiguous f32 or
    /// bf16 data of the dtype; accumulation is in f32.
    ///
    /// candle's matmul has no `beta`: adding a product into an existing buffer would cost a
    /// temporary and an extra pass over the output, which for LoRA's rank-r updates of
    /// `[tokens, features]` outputs is most of their cost.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        (m, n, k): (usize, usize, usize),
        operands: Operands,
        a: u64,
        b: u64,
        c: u64,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        use candle_core::cuda::cudarc::cublas::{result, sys};
        let (dev, dtype) = (self.dev, self.dtype);
        let (a_transposed, b_transposed) = match operands {
            Operands::Nt => (false, true),
            Operands::Nn => (false, false),
            Operands::Tn => (true, false),
        };
        if m == 0 || n == 0 {
            return Ok(());
        }
        let data_type = match dtype {
            DType::F32 => sys::cudaDataType::CUDA_R_32F,
            DType::BF16 => sys::cudaDataType::CUDA_R_16BF,
            other => bail!("no cuBLAS GEMM for {other:?}"),
        };
        // Column-major view: Cᵀ [n, m] = op(B)ᵀ [n, k] · op(A)ᵀ [k, m].
        let (op_b, ldb) = if b_transposed {
            (sys::cublasOperation_t::CUBLAS_OP_T, k)
        } else {
            (sys::cublasOperation_t::CUBLAS_OP_N, n)
        };
        let (op_a, lda) = if a_transposed {
            (sys::cublasOperation_t::CUBLAS_OP_T, m)
        } else {
            (sys::cublasOperation_t::CUBLAS_OP_N, k)
        };
        let blas = dev.cublas_handle();
        // SAFETY: the pointers address live buffers of the stated shapes on the stream cuBLAS
        // runs on (candle's), and alpha/beta are f32 as the compute type requires.
        unsafe {
            result::gemm_ex(
                *blas.handle(),
                op_b,
                op_a,
                n as i32,
                m as i32,
                k as i32,
                (&alpha as *const f32).cast(),
                b as *const std::ffi::c_void,
                data_type,
                ldb as i32,
                a as *const std::ffi::c_void,
                data_type,
                lda as i32,
                (&beta as *const f32).cast(),
                c as *mut std::ffi::c_void,
                data_type,
                n as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(candle_core::Error::wrap)
    }
}
