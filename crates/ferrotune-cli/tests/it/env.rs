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
}
