//! ferrotune-core: the tensor layer every other crate stands on.
//!
//! Tensors are candle-core's. What this crate adds is a set of model-path ops written only from
//! candle primitives that have a backward pass (candle-nn's fused `rms_norm`, `softmax_last_dim` and
//! `rope*` have none: gradients would silently stop there), plus dtype/device parsing shared by the
//! CLI and the recipes.

pub mod device;
pub mod frozen;
pub mod ops;
pub mod quant;

pub use candle_core::{DType, Device, Tensor};
pub use device::{parse_device, parse_dtype};

/// Pins the CPU thread count once, for the whole process.
///
/// candle asks for the thread count on every matmul and, unless `RAYON_NUM_THREADS` is set, works
/// it out again from /proc each time: a measurable share of a decode step. Setting the variable
/// at start-up (when the user has not) makes that lookup free. Call it first thing in `main`,
/// before any thread exists.
pub fn init_cpu_threads() {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        let n = std::thread::available_parallelism().map_or(1, |n| n.get());
        std::env::set_var("RAYON_NUM_THREADS", n.to_string());
    }
}
