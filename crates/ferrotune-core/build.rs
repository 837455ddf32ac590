//! With the `cuda` feature, compiles `src/cuda/kernels.cu` to PTX with nvcc (the same toolkit
//! candle's own kernels need), for `CUDA_COMPUTE_CAP` (default 80; PTX is JIT-compiled for newer
//! GPUs by the driver). Without the feature this does nothing, so CPU builds need no toolkit.
//!
//! It also makes the binary's one link-time CUDA dependency static: candle-kernels links its
//! nvcc-compiled kernels against the CUDA runtime with `-lcudart`, which would make `libcudart.so`
//! a library the binary needs to start. A `libcudart.so` in `OUT_DIR` that is a linker script
//! naming the toolkit's `libcudart_static.a` (as glibc's `libc.so` is a script) answers that
//! `-lcudart` instead; the static runtime loads the driver only when first used. Everything else
//! CUDA (driver, cuBLAS, cuRAND, NVRTC, NCCL) cudarc loads at run time (`dynamic-loading`, see
//! third_party/README.md), so the binary starts, on CPU, on a machine without any of it.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/cuda/kernels.cu");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let cap: String = cap.chars().filter(char::is_ascii_digit).collect();
    // The Rust side picks kernels by it (the flash attention needs bf16 MMA, 8.0 and later).
    println!("cargo:rustc-env=FERROTUNE_CUDA_CAP={cap}");
    let nvcc = std::env::var_os("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin").join("nvcc"))
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let ptx = out.join("kernels.ptx");
    static_cudart(&out);
    let status = Command::new(&nvcc)
        .args(["-ptx", "-O3", "-std=c++17"])
        .arg(format!("-arch=compute_{cap}"))
        .arg("-o")
        .arg(&ptx)
        .arg("src/cuda/kernels.cu")
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e} (set CUDA_HOME)", nvcc.display()));
    assert!(status.success(), "nvcc failed on src/cuda/kernels.cu");
}

/// Points `-lcudart` at the static CUDA runtime (see the file's comment), or warns and leaves the
/// shared one (then the binary needs `libcudart.so` to start) when the toolkit has none.
fn static_cudart(out: &std::path::Path) {
    println!("cargo:rerun-if-env-changed=CUDA_PATH");
    let Some(archive) = find_cudart_static() else {
        println!(
            "cargo:warning=libcudart_static.a not found under CUDA_HOME/CUDA_PATH or /usr/local/cuda: \
             the binary will need libcudart.so to start, also on CPU"
        );
        return;
    };
    let dir = out.join("cudart-static");
    std::fs::create_dir_all(&dir).expect("create OUT_DIR/cudart-static");
    let script = format!(
        "/* ferrotune-core build.rs */\nINPUT({})\n",
        archive.display()
    );
    std::fs::write(dir.join("libcudart.so"), script).expect("write the libcudart.so linker script");
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rerun-if-changed={}", archive.display());
}

/// `libcudart_static.a` in the toolkit's library folders, or next to the file its `libcudart.so`
/// links to (a toolkit assembled from PyPI wheels links its `lib/` into the wheels' folders).
fn find_cudart_static() -> Option<PathBuf> {
    let roots = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(PathBuf::from))
        .chain([PathBuf::from("/usr/local/cuda")]);
    for root in roots {
        for sub in [
            "lib64",
            "lib",
            "targets/x86_64-linux/lib",
            "targets/sbsa-linux/lib",
        ] {
            let lib = root.join(sub);
            let direct = lib.join("libcudart_static.a");
            if direct.is_file() {
                return Some(direct);
            }
            let beside = std::fs::canonicalize(lib.join("libcudart.so"))
                .ok()
                .and_then(|so| so.parent().map(|d| d.join("libcudart_static.a")));
            if let Some(a) = beside.filter(|a| a.is_file()) {
                return Some(a);
            }
        }
    }
    None
}
