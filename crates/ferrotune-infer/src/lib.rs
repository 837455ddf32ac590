//! ferrotune-infer: text generation with a KV cache — greedy and sampled decoding (temperature,
//! top-k, top-p, repetition penalty, seed), stop on any eos id or stop string, batches of prompts
//! with left padding, tokens handed to a callback as they come.
//!
//! - [`generate`] over [`GenerationOptions`] runs the loop and returns a [`GenerationOutput`];
//!   [`Sampler`] picks each token by [`SamplingOptions`]; [`TextStream`] prints tokens as text.
//! - [`load_for_inference`] over [`LoadOptions`] loads a model (and its adapter) to generate or
//!   score with; [`spread_model`] spreads one over the visible GPUs.
//! - [`stop_ids`] and [`pad_id`]: the token ids that end a row and pad a batch.
//!
//! Nothing here depends on the training crate: the `generate` verb and the inference recipes
//! share it.

pub mod generate;
pub mod load;
pub mod sampling;
pub mod spread;
pub mod stream;
pub mod tokens;

pub use generate::{generate, GenerationOptions, GenerationOutput};
pub use load::{load_for_inference, LoadOptions};
pub use sampling::{Sampler, SamplingOptions};
pub use spread::spread_model;
pub use stream::TextStream;
pub use tokens::{pad_id, stop_ids};
