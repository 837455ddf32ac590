//! ferrotune-export's integration tests, one binary (the stack is linked once, not once per file): a
//! module per area, and the helpers they share in `common`.

mod common;
mod gguf_converter;
mod gguf_export;
mod gguf_kquants;
