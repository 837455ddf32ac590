//! ferrotune-core: the tensor layer every other crate stands on.
//!
//! Tensors are candle-core's. What this crate adds is a set of model-path ops written only from
//! candle primitives that have a backward pass (candle-nn's fused `rms_norm`, `softmax_last_dim` and
//! `rope*` have none: gradients would silently stop there), plus dtype/device parsing shared by the
//! CLI and the recipes.

pub mod device;
pub mod ops;

pub use candle_core::{DType, Device, Tensor};
pub use device::{parse_device, parse_dtype};
