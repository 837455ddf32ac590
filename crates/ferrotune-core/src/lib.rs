//! ferrotune-core: the tensor layer every other crate stands on.
//!
//! Tensors are candle-core's. What this crate adds is a set of model-path ops written only from
//! candle primitives that have a backward pass (candle-nn's fused `rms_norm`, `softmax_last_dim` and
//! `rope*` have none: gradients would silently stop there), plus dtype/device parsing shared by the
//! CLI and the recipes.

#[cfg(feature = "cuda")]
mod cuda;
pub mod cuda_load;
mod custom_op;
#[cfg(feature = "cuda")]
pub use cuda::{adamw_step, AdamWStep};
pub mod decode;
pub mod device;
pub mod frozen;
pub mod fused;
pub mod graph;
pub mod memory;
pub mod nf4;
pub mod ops;
pub mod probe;
pub mod qat;
pub mod quant;
pub mod quiet_panic;
pub mod sigpipe;
pub mod switch;
pub mod weight;

pub use candle_core::{DType, Device, Tensor};
pub use device::{
    parse_device, parse_device_name, parse_dtype, peak_memory_bytes, reset_peak_memory,
};

/// Pins the CPU thread count once, for the whole process.
///
/// candle asks for the thread count on every matmul and, unless `RAYON_NUM_THREADS` is set, works
/// it out again from /proc each time: a measurable share of a decode step. Setting the variable
/// at start-up (when the user has not) makes that lookup free. Call it first thing in `main`,
/// before any thread exists.
///
/// The count is the parallelism the machine really delivers, measured (see
/// [`effective_parallelism`]), not the number of CPUs it reports: candle's thread pool waits for
/// its workers by spinning, so a thread more than there are cores to run it steals the time of
/// the thread doing the work. On a VM whose two vCPUs share one core's worth of time, two threads
/// made a training step 2× slower than one.
pub fn init_cpu_threads() {
    // After each parallel op candle's idle workers spin 25 000 times before sleeping; meanwhile
    // the GEMMs (rayon threads) that usually come next want those cores. Sleep almost at once.
    if std::env::var_os("CANDLE_BARRIER_POOL_SPIN_LIMIT").is_none() {
        std::env::set_var("CANDLE_BARRIER_POOL_SPIN_LIMIT", "200");
    }
    // The work that matters runs on rayon (GEMMs, ferrotune's fused kernels); candle's own pool
    // only serves its elementwise ops, few on the training path. One pool, not two competing for
    // the same cores: candle's element-wise ops stay on the calling thread.
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = effective_parallelism();
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}

/// How many threads run truly in parallel here: the reported CPU count, reduced when running
/// that many busy threads at once takes longer per thread than running one (a CPU quota,
/// an oversubscribed host, or other busy processes). Takes about 50 ms.
pub fn effective_parallelism() -> usize {
    let reported = std::thread::available_parallelism().map_or(1, |n| n.get());
    if reported <= 1 {
        return 1;
    }
    fn spin(iterations: u64) -> u64 {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..iterations {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
        }
        std::hint::black_box(x)
    }
    // About 15 ms of work per thread: long enough that a host granting short bursts of parallelism
    // but not sustained parallelism is seen for what it is (at 2 ms it is not), short enough not
    // to matter next to loading a model.
    let mut iterations = 1u64 << 16;
    let single = loop {
        let t = std::time::Instant::now();
        spin(iterations);
        let e = t.elapsed();
        if e.as_micros() >= 15_000 || iterations >= 1 << 34 {
            break e;
        }
        iterations *= 2;
    };
    let mut best = f64::MAX;
    for _ in 0..2 {
        let t = std::time::Instant::now();
        std::thread::scope(|s| {
            for _ in 0..reported {
                s.spawn(|| spin(iterations));
            }
        });
        best = best.min(t.elapsed().as_secs_f64());
    }
    // `reported` threads each did one unit; n units in the time of one means n-way parallelism.
    // A thread is only worth adding when it nearly pays for itself: a spare one costs more (its
    // spinning) than a missing one.
    let speedup = reported as f64 * single.as_secs_f64() / best.max(1e-9);
    ((speedup + 0.2).floor() as usize).clamp(1, reported)
}
