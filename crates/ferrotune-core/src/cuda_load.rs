//! The CUDA libraries a `--features cuda` build loads at run time, checked before they are used.
//!
//! The CUDA build does not link the NVIDIA driver, cuBLAS, cuRAND, NVRTC or NCCL: cudarc opens
//! them with `dlopen` when first used (`dynamic-loading`, see third_party/README.md), so the same
//! binary starts and runs on the CPU of a machine without them. cudarc panics when one is missing,
//! so asking for a GPU ([`new_cuda`], which `device: cuda` and `--device-map` go through) first
//! looks each one up under the names cudarc tries, in its order, and turns a missing one into an
//! error naming the library and what to install.

use crate::probe::Library;
use candle_core::Device;

/// A library the CUDA build loads at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaLib {
    /// What it is (`cuBLAS`).
    pub what: &'static str,
    /// The name cudarc derives its file names from (`cublas`: `libcublas.so`, `libcublas.so.13`, ...).
    pub stem: &'static str,
    /// The file its installation provides (`libcublas.so.13`), named in the error.
    pub file: &'static str,
    /// What to install when it is missing.
    pub install: &'static str,
}

const CUDA13_LIBS: &str = "install the CUDA 13 libraries (the CUDA toolkit, or `pip install \
     cuda-toolkit[cublas,curand,nvrtc]==13.*`) and put their folder on LD_LIBRARY_PATH";

/// The NVIDIA driver's library.
pub const DRIVER: CudaLib = CudaLib {
    what: "the NVIDIA driver",
    stem: "cuda",
    file: "libcuda.so.1",
    install: "install the NVIDIA driver (580 or later for CUDA 13)",
};

/// The libraries every GPU device opens (candle creates cuBLAS and cuRAND handles with the
/// device; NVRTC compiles kernels at run time).
pub const COMPUTE: [CudaLib; 4] = [
    CudaLib {
        what: "cuBLAS",
        stem: "cublas",
        file: "libcublas.so.13",
        install: CUDA13_LIBS,
    },
    CudaLib {
        what: "cuBLASLt",
        stem: "cublasLt",
        file: "libcublasLt.so.13",
        install: CUDA13_LIBS,
    },
    CudaLib {
        what: "cuRAND",
        stem: "curand",
        file: "libcurand.so.10",
        install: CUDA13_LIBS,
    },
    CudaLib {
        what: "NVRTC",
        stem: "nvrtc",
        file: "libnvrtc.so.13",
        install: CUDA13_LIBS,
    },
];

/// NCCL, which the distributed recipes of a build with feature `nccl` open on GPUs.
pub const NCCL: CudaLib = CudaLib {
    what: "NCCL",
    stem: "nccl",
    file: "libnccl.so.2",
    install: "install NCCL 2 (`pip install nvidia-nccl-cu13`), put its folder on LD_LIBRARY_PATH \
              and link libnccl.so to its libnccl.so.2 there",
};

/// The first of `candidates` the dynamic loader opens, or `None`.
pub fn first_loadable(candidates: &[String]) -> Option<String> {
    candidates.iter().find(|c| Library::loadable(c)).cloned()
}

/// What the loader finds of a library.
enum Lookup {
    /// One of the names tried opens.
    Loads,
    /// None opens, but the library is there under another name: how to link it.
    Elsewhere(String),
    /// Not there.
    NotFound,
}

fn lookup(lib: &CudaLib, candidates: &[String]) -> Lookup {
    if first_loadable(candidates).is_some() {
        return Lookup::Loads;
    }
    let first = candidates.first().map_or("?", String::as_str);
    if !candidates.iter().any(|c| c == lib.file) && Library::loadable(lib.file) {
        // NCCL's packages install libnccl.so.2 alone, a name cudarc does not try.
        return Lookup::Elsewhere(format!(
            "{} ({}) is installed but this build opens it as {first} (or {} other names), which \
             the loader does not find: link {first} to {} in a folder on LD_LIBRARY_PATH",
            lib.what,
            lib.file,
            candidates.len().saturating_sub(1),
            lib.file
        ));
    }
    Lookup::NotFound
}

/// `what, what (file, file) not found by the dynamic loader: install` for libraries that share
/// what to install.
fn not_found(libs: &[&CudaLib]) -> String {
    let list = |f: fn(&CudaLib) -> &'static str| libs.iter().map(|l| f(l)).collect::<Vec<_>>();
    format!(
        "{} ({}) not found by the dynamic loader: {}",
        list(|l| l.what).join(", "),
        list(|l| l.file).join(", "),
        libs.first().map_or("", |l| l.install)
    )
}

/// Why cudarc cannot load `lib` when it tries `candidates` (its file names for the library, in its
/// order), or `None` when one of them opens.
pub fn missing(lib: &CudaLib, candidates: &[String]) -> Option<String> {
    match lookup(lib, candidates) {
        Lookup::Loads => None,
        Lookup::Elsewhere(how) => Some(how),
        Lookup::NotFound => Some(not_found(&[lib])),
    }
}

/// `Ok` when every library in `libs` loads under the names `candidates` gives for its stem, else
/// one line saying which do not: the missing ones that share what to install named together.
pub fn require_with(
    libs: &[CudaLib],
    candidates: impl Fn(&str) -> Vec<String>,
) -> Result<(), String> {
    let mut why = Vec::new();
    // Missing libraries grouped by what to install, in the order first met.
    let mut absent: Vec<Vec<&CudaLib>> = Vec::new();
    for lib in libs {
        match lookup(lib, &candidates(lib.stem)) {
            Lookup::Loads => {}
            Lookup::Elsewhere(how) => why.push(how),
            Lookup::NotFound => match absent.iter_mut().find(|g| g[0].install == lib.install) {
                Some(group) => group.push(lib),
                None => absent.push(vec![lib]),
            },
        }
    }
    why.extend(absent.iter().map(|g| not_found(g)));
    if why.is_empty() {
        Ok(())
    } else {
        Err(why.join("; "))
    }
}

/// The file names cudarc tries for `stem`, in its order (CUDA builds only).
#[cfg(feature = "cuda")]
pub fn candidates(stem: &str) -> Vec<String> {
    candle_core::cuda::cudarc::get_lib_name_candidates(stem)
}

/// `Ok` when every library in `libs` loads as cudarc will load it, else which do not
/// ([`require_with`] with cudarc's names; CUDA builds only).
#[cfg(feature = "cuda")]
pub fn require(libs: &[CudaLib]) -> Result<(), String> {
    require_with(libs, candidates)
}

/// `Ok` when a GPU device can be opened as far as the libraries go: the driver, cuBLAS, cuBLASLt,
/// cuRAND and NVRTC all load; else the driver alone when it is missing, or the libraries that
/// are (CUDA builds only).
#[cfg(feature = "cuda")]
pub fn require_gpu_libraries() -> Result<(), String> {
    // Without the driver nothing else matters: it alone is named.
    require(&[DRIVER])?;
    require(&COMPUTE)
}

/// Opens GPU `ordinal` after checking its libraries (`require_gpu_libraries`, CUDA builds
/// only), with a panic of cudarc's (a symbol an older driver or library lacks) turned into an
/// error. The panic is caught quietly ([`crate::quiet_panic`]: on this thread only, the process's
/// panic hook left as it is for the others), so that the error, not a backtrace, is what the
/// user reads. Without CUDA: candle's error saying the build has none.
pub fn new_cuda(ordinal: usize) -> Result<Device, String> {
    #[cfg(feature = "cuda")]
    require_gpu_libraries()?;
    match crate::quiet_panic::catch_quietly(|| Device::new_cuda(ordinal)) {
        Ok(device) => device.map_err(|e| e.to_string()),
        Err(what) => Err(format!(
            "the CUDA libraries found cannot be used ({what}): a driver or library older than \
             CUDA 13?"
        )),
    }
}
