//! What this machine offers, found without needing it: the CPU's SIMD features, and the NVIDIA
//! driver, GPUs and CUDA libraries, each looked up with `dlopen` so that a binary built with or
//! without CUDA reports the same facts and a missing library is an answer, not a failed start.
//! `ferrotune env` prints them.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

/// The SIMD features of this CPU that the running binary can detect, in a fixed order.
pub fn cpu_simd_features() -> Vec<&'static str> {
    #[allow(unused_mut)]
    let mut found = Vec::new();
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! probe {
            ($($f:tt),*) => {
                $(if std::arch::is_x86_feature_detected!($f) { found.push($f); })*
            };
        }
        probe!(
            "sse2",
            "sse3",
            "ssse3",
            "sse4.1",
            "sse4.2",
            "popcnt",
            "avx",
            "avx2",
            "fma",
            "f16c",
            "bmi2",
            "avx512f",
            "avx512bw",
            "avx512vl",
            "avx512vnni",
            "avx512bf16",
            "avx512fp16"
        );
    }
    #[cfg(target_arch = "aarch64")]
    {
        macro_rules! probe {
            ($($f:tt),*) => {
                $(if std::arch::is_aarch64_feature_detected!($f) { found.push($f); })*
            };
        }
        probe!("neon", "fp16", "dotprod", "i8mm", "bf16", "sve", "sve2");
    }
    found
}

/// Whether ferrotune's fused CPU kernels run their AVX2 + FMA build on this CPU (else their
/// portable build; see `fused::kernels`).
pub fn fused_kernels_use_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// The CPU's model name (`/proc/cpuinfo`), if the system says.
pub fn cpu_model() -> Option<String> {
    let text = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    text.lines()
        .find(|l| l.starts_with("model name") || l.starts_with("Model"))
        .and_then(|l| l.split_once(':'))
        .map(|(_, v)| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// A shared library opened with `dlopen`, never closed (its symbols stay valid).
pub(crate) struct Library {
    handle: *mut c_void,
    /// The name it was found under.
    name: &'static str,
}

impl Library {
    /// The first of `names` the dynamic loader finds.
    fn open(names: &[&'static str]) -> Option<Library> {
        names.iter().find_map(|&name| {
            let c = CString::new(name).ok()?;
            // SAFETY: dlopen with a NUL-terminated name; a null return means not found.
            let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) };
            (!handle.is_null()).then_some(Library { handle, name })
        })
    }

    /// Whether the dynamic loader opens `name` (a file name it searches for, or a path).
    pub(crate) fn loadable(name: &str) -> bool {
        let Ok(c) = CString::new(name) else {
            return false;
        };
        // SAFETY: dlopen with a NUL-terminated name; a null return means not found. The handle
        // is kept (the library stays loaded), as cudarc's own load would keep it.
        !unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) }.is_null()
    }

    /// The path of the file the loader opened, found through one of its symbols.
    fn path(&self, symbol: &str) -> Option<String> {
        let address = self.symbol(symbol)?;
        // SAFETY: dladdr fills `info` for an address inside a loaded object.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        if unsafe { libc::dladdr(address, &mut info) } == 0 || info.dli_fname.is_null() {
            return None;
        }
        // SAFETY: dli_fname is a NUL-terminated string the loader owns.
        let path = unsafe { CStr::from_ptr(info.dli_fname) };
        std::fs::canonicalize(&*path.to_string_lossy())
            .ok()
            .map(|p| p.display().to_string())
    }

    /// The address of `symbol`, if the library has it.
    fn symbol(&self, symbol: &str) -> Option<*mut c_void> {
        let c = CString::new(symbol).ok()?;
        // SAFETY: a handle dlopen returned, a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }
}

/// One GPU as the driver describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gpu {
    /// Its CUDA ordinal (`cuda:N`).
    pub ordinal: usize,
    /// Its name (`NVIDIA H200`).
    pub name: String,
    /// Its memory in bytes.
    pub memory_bytes: u64,
    /// Its compute capability, `(major, minor)`.
    pub compute_capability: (i32, i32),
}

/// The NVIDIA driver as `libcuda` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaDriver {
    /// The library found (`libcuda.so.1`).
    pub library: &'static str,
    /// The file the loader opened for it, links resolved (`/usr/lib/.../libcuda.so.580.95.05`).
    pub path: Option<String>,
    /// The CUDA version the driver supports, `(major, minor)`.
    pub cuda_version: (i32, i32),
    /// The kernel module's version line (`/proc/driver/nvidia/version`), where there is one.
    pub kernel_module: Option<String>,
    /// The GPUs it sees (none when it cannot initialise: the error says why).
    pub gpus: Vec<Gpu>,
    /// Why the driver could not list GPUs, when it could not.
    pub error: Option<String>,
}

type CuResult = c_int;

/// The NVIDIA driver, or why it was not found.
pub fn cuda_driver() -> Result<CudaDriver, String> {
    let lib = Library::open(&["libcuda.so.1", "libcuda.so", "nvcuda.dll"])
        .ok_or_else(|| "libcuda.so.1 not found".to_string())?;
    let sym = |name: &str| {
        lib.symbol(name)
            .ok_or_else(|| format!("{} has no {name}", lib.name))
    };
    // SAFETY (all transmutes below): the CUDA driver API's documented signatures.
    let init: extern "C" fn(u32) -> CuResult = unsafe { std::mem::transmute(sym("cuInit")?) };
    let version: extern "C" fn(*mut c_int) -> CuResult =
        unsafe { std::mem::transmute(sym("cuDriverGetVersion")?) };
    let mut v: c_int = 0;
    let cuda_version = if version(&mut v) == 0 {
        (v / 1000, (v % 1000) / 10)
    } else {
        (0, 0)
    };
    let kernel_module = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|t| t.lines().next().map(|l| l.trim().to_string()));
    let mut driver = CudaDriver {
        library: lib.name,
        path: lib.path("cuInit"),
        cuda_version,
        kernel_module,
        gpus: Vec::new(),
        error: None,
    };
    let rc = init(0);
    if rc != 0 {
        driver.error = Some(format!("cuInit failed with CUDA error {rc}"));
        return Ok(driver);
    }
    let count: extern "C" fn(*mut c_int) -> CuResult =
        unsafe { std::mem::transmute(sym("cuDeviceGetCount")?) };
    let get: extern "C" fn(*mut c_int, c_int) -> CuResult =
        unsafe { std::mem::transmute(sym("cuDeviceGet")?) };
    let name: extern "C" fn(*mut c_char, c_int, c_int) -> CuResult =
        unsafe { std::mem::transmute(sym("cuDeviceGetName")?) };
    let total: extern "C" fn(*mut usize, c_int) -> CuResult =
        unsafe { std::mem::transmute(sym("cuDeviceTotalMem_v2")?) };
    let attribute: extern "C" fn(*mut c_int, c_int, c_int) -> CuResult =
        unsafe { std::mem::transmute(sym("cuDeviceGetAttribute")?) };
    // CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR / _MINOR.
    const CC_MAJOR: c_int = 75;
    const CC_MINOR: c_int = 76;
    let mut n: c_int = 0;
    if count(&mut n) != 0 {
        driver.error = Some("cuDeviceGetCount failed".into());
        return Ok(driver);
    }
    for ordinal in 0..n {
        let mut dev: c_int = 0;
        if get(&mut dev, ordinal) != 0 {
            continue;
        }
        let mut buf = [0 as c_char; 256];
        let gpu_name = if name(buf.as_mut_ptr(), buf.len() as c_int, dev) == 0 {
            // SAFETY: the driver NUL-terminates the name within the buffer.
            unsafe { CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .into_owned()
        } else {
            "?".into()
        };
        let mut bytes: usize = 0;
        total(&mut bytes, dev);
        let (mut major, mut minor) = (0, 0);
        attribute(&mut major, CC_MAJOR, dev);
        attribute(&mut minor, CC_MINOR, dev);
        driver.gpus.push(Gpu {
            ordinal: ordinal as usize,
            name: gpu_name,
            memory_bytes: bytes as u64,
            compute_capability: (major, minor),
        });
    }
    Ok(driver)
}

/// A CUDA library the GPU build uses, and what was found of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaLibrary {
    /// What it is for (`cuBLAS`).
    pub what: &'static str,
    /// The file found, or `None`.
    pub found: Option<&'static str>,
    /// The file the loader opened for it, links resolved.
    pub path: Option<String>,
    /// Its version, where the library says (`13.0.2`).
    pub version: Option<String>,
}

/// The CUDA libraries the GPU build loads (cuBLAS, cuBLASLt, cuRAND, NVRTC) and NCCL, each
/// looked up by the names CUDA 13 and 12 install them under.
pub fn cuda_libraries() -> Vec<CudaLibrary> {
    let mut out = Vec::new();
    // `symbol`: one the library exports, which finds its file.
    let mut add =
        |what, names: &[&'static str], symbol: &str, version: fn(&Library) -> Option<String>| {
            let lib = Library::open(names);
            out.push(CudaLibrary {
                what,
                found: lib.as_ref().map(|l| l.name),
                path: lib.as_ref().and_then(|l| l.path(symbol)),
                version: lib.as_ref().and_then(version),
            });
        };
    add(
        "cuBLAS",
        &["libcublas.so.13", "libcublas.so.12", "libcublas.so"],
        "cublasGetProperty",
        |l| library_property(l, "cublasGetProperty"),
    );
    add(
        "cuBLASLt",
        &["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"],
        "cublasLtGetProperty",
        |l| library_property(l, "cublasLtGetProperty"),
    );
    add(
        "cuRAND",
        &["libcurand.so.10", "libcurand.so"],
        "curandGetProperty",
        |l| library_property(l, "curandGetProperty"),
    );
    add(
        "NVRTC",
        &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
        "nvrtcVersion",
        |l| {
            let f: extern "C" fn(*mut c_int, *mut c_int) -> c_int =
                // SAFETY: `nvrtcResult nvrtcVersion(int *major, int *minor)`.
                unsafe { std::mem::transmute(l.symbol("nvrtcVersion")?) };
            let (mut major, mut minor) = (0, 0);
            (f(&mut major, &mut minor) == 0).then(|| format!("{major}.{minor}"))
        },
    );
    add(
        "NCCL",
        &["libnccl.so.2", "libnccl.so"],
        "ncclGetVersion",
        |l| {
            let f: extern "C" fn(*mut c_int) -> c_int =
            // SAFETY: `ncclResult_t ncclGetVersion(int *version)`.
            unsafe { std::mem::transmute(l.symbol("ncclGetVersion")?) };
            let mut v = 0;
            (f(&mut v) == 0).then(|| {
                // NCCL ≥ 2.9 codes its version as major·10000 + minor·100 + patch.
                let (major, minor, patch) = if v >= 10000 {
                    (v / 10000, (v % 10000) / 100, v % 100)
                } else {
                    (v / 1000, (v % 1000) / 100, v % 100)
                };
                format!("{major}.{minor}.{patch}")
            })
        },
    );
    out
}

/// `major.minor.patch` through a CUDA library's `*GetProperty(libraryPropertyType, int*)`.
fn library_property(lib: &Library, symbol: &str) -> Option<String> {
    let f: extern "C" fn(c_int, *mut c_int) -> c_int =
        // SAFETY: cuBLAS's, cuBLASLt's and cuRAND's `*GetProperty` share this signature.
        unsafe { std::mem::transmute(lib.symbol(symbol)?) };
    let mut parts = [0; 3];
    for (i, p) in parts.iter_mut().enumerate() {
        if f(i as c_int, p) != 0 {
            return None;
        }
    }
    Some(format!("{}.{}.{}", parts[0], parts[1], parts[2]))
}
