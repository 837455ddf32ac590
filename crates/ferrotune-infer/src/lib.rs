//! ferrotune-infer: text generation with a KV cache — greedy and sampled decoding (temperature,
//! top-k, top-p, repetition penalty, seed), stop on any eos id or stop string, batches of prompts
//! with left padding, tokens handed to a callback as they come.

pub mod generate;
pub mod sampling;
pub mod stream;

pub use generate::{generate, GenerationOptions, GenerationOutput};
pub use sampling::{Sampler, SamplingOptions};
pub use stream::TextStream;
