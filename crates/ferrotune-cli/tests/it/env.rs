//! `ferrotune env` (issue 43 item 2): the build, the CPU's threads and SIMD features, the GPUs
//! (or that there are none), the CUDA libraries and NCCL, and the folders, on this machine.

use crate::common::{ferrotune, text, tmpdir};

#[test]
fn env_names_the_build_the_cpu_features_the_gpus_and_the_folders() {
    let dir = tmpdir("env", "report");
    let assets = dir.join("assets");
    let out = ferrotune(
        &["env"],
        &dir,
        &[
            ("FERROTUNE_ASSETS", assets.to_str().unwrap()),
            ("RAYON_NUM_THREADS", "3"),
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let report = String::from_utf8(out.stdout).unwrap();
    assert!(
        report.starts_with(&format!("ferrotune {} (", env!("CARGO_PKG_VERSION"))),
        "{report}"
    );
    let cuda = if cfg!(feature = "cuda") { "yes" } else { "no" };
    assert!(
        report.contains(&format!("features: cuda {cuda}")),
        "{report}"
    );
    if !cfg!(feature = "cuda") {
        assert!(report.contains("built without CUDA"), "{report}");
    }
    let threads = std::thread::available_parallelism().unwrap().get();
    assert!(
        report.contains(&format!("threads: {threads} available")),
        "{report}"
    );
    assert!(
        report.contains("training threads: 3 (RAYON_NUM_THREADS)"),
        "{report}"
    );
    // Every SIMD feature the test itself detects is named.
    #[cfg(target_arch = "x86_64")]
    for (feature, present) in [
        ("sse2", std::arch::is_x86_feature_detected!("sse2")),
        ("avx", std::arch::is_x86_feature_detected!("avx")),
        ("avx2", std::arch::is_x86_feature_detected!("avx2")),
        ("fma", std::arch::is_x86_feature_detected!("fma")),
        ("avx512f", std::arch::is_x86_feature_detected!("avx512f")),
    ] {
        let simd = report
            .lines()
            .find(|l| l.trim_start().starts_with("SIMD:"))
            .unwrap_or_else(|| panic!("{report}"));
        assert_eq!(
            simd.split_whitespace().any(|w| w == feature),
            present,
            "{feature}: {simd}"
        );
    }
    // The driver is found or said to be missing; each library and NCCL has its line.
    assert!(report.contains("NVIDIA driver: "), "{report}");
    if !std::path::Path::new("/proc/driver/nvidia").exists() {
        assert!(report.contains("NVIDIA driver: none found"), "{report}");
    }
    for lib in ["cuBLAS:", "NVRTC:", "NCCL:"] {
        assert!(report.contains(lib), "{lib}: {report}");
    }
    assert!(
        report.contains(&format!("{} (not created yet)", assets.display())),
        "{report}"
    );
    assert!(report.contains("Hugging Face cache"), "{report}");
    // The trackers' clients of the Python FERROTUNE_PYTHON names: one that does not exist.
    let out = ferrotune(
        &["env", "--no-measure"],
        &dir,
        &[("FERROTUNE_PYTHON", "/nonexistent/python")],
    );
    let report = String::from_utf8(out.stdout).unwrap();
    assert!(
        report.contains("(FERROTUNE_PYTHON): /nonexistent/python: cannot start it"),
        "{report}"
    );
}

/// A stand-in for the NVIDIA driver and NCCL: `libcuda.so.1` with one 80 GiB GPU of compute
/// capability 9.0 supporting CUDA 13.0, `libnccl.so.2` at 2.27.3, and cuBLAS 13.1.0, built with
/// the C compiler into `dir`; `false` when there is no C compiler.
fn fake_cuda(dir: &std::path::Path) -> bool {
    const CUDA: &str = r#"
#include <string.h>
#include <stddef.h>
int cuInit(unsigned f) { return 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuDeviceGetCount(int *n) { *n = 1; return 0; }
int cuDeviceGet(int *d, int i) { *d = i; return 0; }
int cuDeviceGetName(char *s, int len, int d) { strncpy(s, "Fake GPU", len); return 0; }
int cuDeviceTotalMem_v2(size_t *b, int d) { *b = (size_t)80 << 30; return 0; }
int cuDeviceGetAttribute(int *v, int a, int d) { *v = a == 75 ? 9 : a == 76 ? 0 : -1; return 0; }
"#;
    const NCCL: &str = "int ncclGetVersion(int *v) { *v = 22703; return 0; }\n";
    const CUBLAS: &str =
        "int cublasGetProperty(int t, int *v) { *v = t == 0 ? 13 : t == 1 ? 1 : 0; return 0; }\n";
    for (name, source) in [
        ("libcuda.so.1", CUDA),
        ("libnccl.so.2", NCCL),
        ("libcublas.so.13", CUBLAS),
    ] {
        let c = dir.join(format!("{name}.c"));
        std::fs::write(&c, source).unwrap();
        let built = std::process::Command::new("cc")
            .args(["-shared", "-fPIC", "-o"])
            .arg(dir.join(name))
            .arg(&c)
            .status();
        if !built.is_ok_and(|s| s.success()) {
            return false;
        }
    }
    true
}

#[test]
fn env_reports_the_driver_gpus_and_libraries_it_finds() {
    let dir = tmpdir("env", "driver");
    if !fake_cuda(&dir) {
        eprintln!("SKIP env_reports_the_driver_gpus_and_libraries_it_finds: no C compiler (cc)");
        return;
    }
    let out = ferrotune(
        &["env", "--no-measure"],
        &dir,
        &[("LD_LIBRARY_PATH", dir.to_str().unwrap())],
    );
    assert!(out.status.success(), "{}", text(&out));
    let report = String::from_utf8(out.stdout).unwrap();
    for want in [
        "NVIDIA driver: libcuda.so.1 supporting CUDA 13.0",
        "cuda:0  Fake GPU  80.0 GiB  compute capability 9.0",
        "cuBLAS: libcublas.so.13 (version 13.1.0)",
        "NCCL: libnccl.so.2 (version 2.27.3)",
    ] {
        assert!(report.contains(want), "{want}:\n{report}");
    }
}

#[test]
fn env_gives_the_file_each_library_was_loaded_from() {
    let dir = tmpdir("env", "paths");
    if !fake_cuda(&dir) {
        eprintln!("SKIP env_gives_the_file_each_library_was_loaded_from: no C compiler (cc)");
        return;
    }
    let out = ferrotune(
        &["env", "--no-measure"],
        &dir,
        &[("LD_LIBRARY_PATH", dir.to_str().unwrap())],
    );
    assert!(out.status.success(), "{}", text(&out));
    let report = String::from_utf8(out.stdout).unwrap();
    let at = |f: &str| {
        std::fs::canonicalize(dir.join(f))
            .unwrap()
            .display()
            .to_string()
    };
    for want in [
        format!(
            "NVIDIA driver: libcuda.so.1 supporting CUDA 13.0 at {}",
            at("libcuda.so.1")
        ),
        format!(
            "cuBLAS: libcublas.so.13 (version 13.1.0) at {}",
            at("libcublas.so.13")
        ),
        format!(
            "NCCL: libnccl.so.2 (version 2.27.3) at {}",
            at("libnccl.so.2")
        ),
    ] {
        assert!(report.contains(&want), "{want}:\n{report}");
    }
}
