//! `ferrotune env`: what a user checks before a run — the build, the CPU (threads, SIMD), the
//! NVIDIA driver, GPUs and CUDA libraries (looked up, not linked: `ferrotune_core::probe`), NCCL,
//! and the folders ferrotune caches into.

use anyhow::Result;
use clap::Args;

/// `ferrotune env`'s arguments.
#[derive(Args, Debug)]
pub struct EnvArgs {
    /// Skip measuring how many threads really run in parallel (about 50 ms).
    #[arg(long)]
    pub no_measure: bool,
}

/// Whether this binary was built with the `cuda` feature.
const CUDA_BUILD: bool = cfg!(feature = "cuda");
/// Whether this binary was built with the `nccl` feature.
const NCCL_BUILD: bool = cfg!(feature = "nccl");

fn yes_no(b: bool) -> &'static str {
    if b {
        "yes"
    } else {
        "no"
    }
}

/// Prints the report.
pub fn run(args: EnvArgs) -> Result<()> {
    print!("{}", report(&args));
    Ok(())
}

fn report(args: &EnvArgs) -> String {
    use ferrotune_core::probe;
    let mut out = String::new();
    let mut line = |s: String| {
        out.push_str(&s);
        out.push('\n');
    };
    line(format!(
        "ferrotune {} ({}-{}, {} build)",
        env!("CARGO_PKG_VERSION"),
        std::env::consts::ARCH,
        std::env::consts::OS,
        if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        }
    ));
    line(format!(
        "  features: cuda {}, nccl {}",
        yes_no(CUDA_BUILD),
        yes_no(NCCL_BUILD)
    ));

    line("CPU".into());
    if let Some(model) = probe::cpu_model() {
        line(format!("  model: {model}"));
    }
    let reported = std::thread::available_parallelism().map_or(1, |n| n.get());
    line(format!("  threads: {reported} available to this process"));
    match std::env::var("RAYON_NUM_THREADS") {
        Ok(n) => line(format!("  training threads: {n} (RAYON_NUM_THREADS)")),
        Err(_) if args.no_measure => {}
        Err(_) => line(format!(
            "  training threads: {} (measured: the threads that really run in parallel; \
             RAYON_NUM_THREADS overrides)",
            ferrotune_core::effective_parallelism()
        )),
    }
    let simd = probe::cpu_simd_features();
    line(format!(
        "  SIMD: {}",
        if simd.is_empty() {
            "none detected".to_string()
        } else {
            simd.join(" ")
        }
    ));
    line(format!(
        "  fused CPU kernels: {}",
        if probe::fused_kernels_use_avx2() {
            "AVX2 + FMA build"
        } else {
            "portable build (no AVX2 + FMA)"
        }
    ));

    line("GPU".into());
    if !CUDA_BUILD {
        line(
            "  this binary is built without CUDA: it trains and generates on the CPU only \
             (build with --features cuda for NVIDIA GPUs)"
                .into(),
        );
    }
    match probe::cuda_driver() {
        Err(why) => line(format!("  NVIDIA driver: none found ({why})")),
        Ok(d) => {
            line(format!(
                "  NVIDIA driver: {} supporting CUDA {}.{}{}{}",
                d.library,
                d.cuda_version.0,
                d.cuda_version.1,
                d.kernel_module
                    .as_deref()
                    .map_or(String::new(), |k| format!(" ({k})")),
                at(&d.path)
            ));
            if let Some(e) = &d.error {
                line(format!("  GPUs: none usable ({e})"));
            } else if d.gpus.is_empty() {
                line("  GPUs: none".into());
            }
            for g in &d.gpus {
                line(format!(
                    "  cuda:{}  {}  {:.1} GiB  compute capability {}.{}",
                    g.ordinal,
                    g.name,
                    g.memory_bytes as f64 / (1u64 << 30) as f64,
                    g.compute_capability.0,
                    g.compute_capability.1
                ));
            }
        }
    }
    for lib in probe::cuda_libraries() {
        let found = match (lib.found, &lib.version) {
            (Some(file), Some(v)) => format!("{file} (version {v}){}", at(&lib.path)),
            (Some(file), None) => format!("{file}{}", at(&lib.path)),
            (None, _) => "not found".into(),
        };
        let note = match lib.what {
            "NCCL" if NCCL_BUILD => " (this build's distributed backend on GPUs)",
            "NCCL" => " (unused: this build has no nccl feature)",
            _ if !CUDA_BUILD => " (unused by this build)",
            _ => "",
        };
        line(format!("  {}: {found}{note}", lib.what));
    }
    if CUDA_BUILD {
        for l in cuda_readiness() {
            line(l);
        }
    }

    line("Folders".into());
    let show = |p: &std::path::Path| {
        format!(
            "{}{}",
            p.display(),
            if p.exists() { "" } else { " (not created yet)" }
        )
    };
    line(format!(
        "  assets (scripts/fetch-assets.sh, {}): {}",
        ferrotune_core::switch::ASSETS.name,
        show(&ferrotune_data::assets_dir())
    ));
    match ferrotune_data::hub::cache_dir() {
        Some(dir) => line(format!(
            "  Hugging Face cache (download, hub datasets): {}",
            show(&dir)
        )),
        None => line("  Hugging Face cache: cannot be resolved".into()),
    }
    let python = ferrotune_core::switch::PYTHON
        .value()
        .unwrap_or_else(|| "python3".into());
    line(format!(
        "  Python for WandBLogger / CometLogger ({}): {python}: {}",
        ferrotune_core::switch::PYTHON.name,
        tracker_clients(&python)
    ));
    out
}

/// ` at PATH`, or nothing when the path is unknown.
fn at(path: &Option<String>) -> String {
    path.as_deref()
        .map_or(String::new(), |p| format!(" at {p}"))
}

/// Whether `device: cuda` (and, with `nccl`, the NCCL backend) can load what it needs, as the
/// build's cudarc looks the libraries up (it loads them at run time, under its own file names).
#[cfg(feature = "cuda")]
fn cuda_readiness() -> Vec<String> {
    use ferrotune_core::cuda_load;
    let mut out = vec![match cuda_load::require_gpu_libraries() {
        Ok(()) => {
            "  device cuda: the driver and CUDA libraries load (this build loads them at run time)"
                .into()
        }
        Err(why) => format!("  device cuda: not available: {why}"),
    }];
    if NCCL_BUILD {
        out.push(match cuda_load::require(&[cuda_load::NCCL]) {
            Ok(()) => "  NCCL backend: loads".into(),
            Err(why) => format!("  NCCL backend: not available: {why}"),
        });
    }
    out
}

#[cfg(not(feature = "cuda"))]
fn cuda_readiness() -> Vec<String> {
    Vec::new()
}

/// The versions of `wandb` and `comet_ml` that `python` has (`wandb 0.31.0, comet_ml not
/// installed`), or why it cannot say.
fn tracker_clients(python: &str) -> String {
    const SCRIPT: &str = "import importlib.metadata as m\n\
        for p in ('wandb', 'comet_ml'):\n\
        \x20   try: print(p, m.version(p))\n\
        \x20   except m.PackageNotFoundError: print(p, 'not installed')\n";
    match std::process::Command::new(python)
        .args(["-c", SCRIPT])
        .stderr(std::process::Stdio::null())
        .output()
    {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .collect::<Vec<_>>()
            .join(", "),
        Ok(_) => "cannot list its packages".into(),
        Err(e) => format!("cannot start it ({e})"),
    }
}
