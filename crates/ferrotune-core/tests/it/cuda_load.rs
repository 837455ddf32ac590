//! `cuda_load`: what a CUDA build checks before cudarc loads a CUDA library at run time (it
//! panics on a missing one): a library found under one of the names cudarc tries, a missing one
//! named with what to install, and NCCL installed under a name cudarc does not try.

use std::path::{Path, PathBuf};

use ferrotune_core::cuda_load::{
    first_loadable, missing, require_with, CudaLib, COMPUTE, DRIVER, NCCL,
};
use ferrotune_testing::fresh_dir;

/// A shared library `name` in `dir` exporting `source`'s functions; `None` without a C compiler.
fn shared_library(dir: &Path, name: &str, source: &str) -> Option<PathBuf> {
    let c = dir.join(format!("{name}.c"));
    std::fs::write(&c, source).unwrap();
    let so = dir.join(name);
    let built = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&c)
        .status();
    built.is_ok_and(|s| s.success()).then_some(so)
}

fn names(dir: &Path, files: &[&str]) -> Vec<String> {
    files
        .iter()
        .map(|f| dir.join(f).display().to_string())
        .collect()
}

#[test]
fn a_missing_driver_is_named_with_what_to_install() {
    let dir = fresh_dir(&format!("cuda_load_missing_{}", std::process::id()));
    let candidates = names(&dir, &["libcuda.so", "libcuda.so.13", "libcuda.so.1"]);
    assert_eq!(first_loadable(&candidates), None);
    let why = missing(&DRIVER, &candidates).expect("nothing to load there");
    assert_eq!(
        why,
        "the NVIDIA driver (libcuda.so.1) not found by the dynamic loader: install the NVIDIA \
         driver (580 or later for CUDA 13)"
    );
}

#[test]
fn a_library_under_any_of_the_names_tried_loads() {
    let dir = fresh_dir(&format!("cuda_load_found_{}", std::process::id()));
    let Some(so) = shared_library(
        &dir,
        "libfakeblas.so.13",
        "int fake_blas(void) { return 1; }\n",
    ) else {
        eprintln!("SKIP a_library_under_any_of_the_names_tried_loads: no C compiler (cc)");
        return;
    };
    let candidates = names(
        &dir,
        &["libfakeblas.so", "libfakeblas.so.13", "libfakeblas.so.12"],
    );
    assert_eq!(first_loadable(&candidates), Some(so.display().to_string()));
    let lib = CudaLib {
        what: "fake BLAS",
        stem: "fakeblas",
        file: "libfakeblas.so.13",
        install: "nothing",
    };
    assert_eq!(missing(&lib, &candidates), None);
    // Without the one file that exists, it is missing.
    assert!(missing(&lib, &candidates[..1]).is_some());
}

#[test]
fn nccl_under_a_name_cudarc_does_not_try_is_told_how_to_link_it() {
    let dir = fresh_dir(&format!("cuda_load_nccl_{}", std::process::id()));
    let Some(so) = shared_library(
        &dir,
        "libnccl.so.2",
        "int ncclGetVersion(int *v) { *v = 22809; return 0; }\n",
    ) else {
        eprintln!("SKIP nccl_under_a_name_cudarc_does_not_try: no C compiler (cc)");
        return;
    };
    // As NCCL's packages install it: libnccl.so.2 alone, which cudarc does not try.
    let file: &'static str = Box::leak(so.display().to_string().into_boxed_str());
    let lib = CudaLib { file, ..NCCL };
    let candidates = names(&dir, &["libnccl.so", "libnccl.so.13", "libnccl.so.1"]);
    let why = missing(&lib, &candidates).expect("libnccl.so is not there");
    let want = format!(
        "NCCL ({file}) is installed but this build opens it as {} (or 2 other names), which the \
         loader does not find: link {} to {file} in a folder on LD_LIBRARY_PATH",
        candidates[0], candidates[0]
    );
    assert_eq!(why, want);
    // Linked as told, it loads.
    std::os::unix::fs::symlink(&so, dir.join("libnccl.so")).unwrap();
    assert_eq!(missing(&lib, &candidates), None);
}

#[test]
fn missing_libraries_that_share_what_to_install_are_named_together() {
    let dir = fresh_dir(&format!("cuda_load_group_{}", std::process::id()));
    let Some(_) = shared_library(
        &dir,
        "libcurand.so.10",
        "int curandGetProperty(void) { return 0; }\n",
    ) else {
        eprintln!("SKIP missing_libraries_that_share_what_to_install: no C compiler (cc)");
        return;
    };
    // cuRAND is there, cuBLAS, cuBLASLt and NVRTC are not, nor the driver.
    let tried = |stem: &str| {
        names(
            &dir,
            &[&format!("lib{stem}.so"), &format!("lib{stem}.so.10")],
        )
    };
    let why = require_with(&COMPUTE, tried).unwrap_err();
    assert_eq!(
        why,
        format!(
            "cuBLAS, cuBLASLt, NVRTC (libcublas.so.13, libcublasLt.so.13, libnvrtc.so.13) not \
             found by the dynamic loader: {}",
            COMPUTE[0].install
        )
    );
    let why = require_with(&[DRIVER, COMPUTE[2]], tried).unwrap_err();
    assert_eq!(why, missing(&DRIVER, &tried("cuda")).unwrap());
    assert_eq!(require_with(&[COMPUTE[2]], tried), Ok(()));
}
