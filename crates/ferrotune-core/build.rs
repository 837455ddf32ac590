//! With the `cuda` feature, compiles `src/cuda/kernels.cu` to PTX with nvcc (the same toolkit
//! candle's own kernels need), for `CUDA_COMPUTE_CAP` (default 80; PTX is JIT-compiled for newer
//! GPUs by the driver). Without the feature this does nothing, so CPU builds need no toolkit.

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
