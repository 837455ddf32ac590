//! ferrotune-core's integration tests, one binary (the stack is linked once, not once per file): a
//! module per area, and the helpers they share in `common`.

mod common;
mod cuda_kernels;
mod cuda_load;
mod frozen;
mod fused;
mod fused_gpt_oss;
mod knobs;
mod nf4;
mod qat;
mod quant;
