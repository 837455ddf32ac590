//! ferrotune-infer's integration tests, one binary (the stack is linked once, not once per file): a
//! module per area.

mod generation;
mod tokens;
