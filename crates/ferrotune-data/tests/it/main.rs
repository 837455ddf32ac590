//! ferrotune-data's integration tests, one binary (the stack is linked once, not once per file): a
//! module per area, and the helpers they share in `common`.

mod chat_template_semantics;
mod common;
mod datasets;
mod errors;
mod eval_tasks;
mod gguf_tokenizers;
mod long_rows;
mod real_tokenizers;
mod reward_pairs;
mod tiny_tokenizer;
mod tool_calls;
mod trl_pairs;
