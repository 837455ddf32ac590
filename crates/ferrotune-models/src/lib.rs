//! ferrotune-models: model configuration, the one decoder every family shares, and checkpoint
//! loading (HF safetensors, single or sharded; llama.cpp GGUF).

pub mod checkpoint;
pub mod config;
pub mod error;
pub mod gguf;
pub mod model;
pub mod rope;

pub use checkpoint::{load_model, read_checkpoint, Checkpoint, CheckpointFormat};
pub use config::{ModelConfig, SUPPORTED_MODEL_TYPES};
pub use error::ModelError;
pub use model::{AttentionLayout, CausalLm, KvCache, Linear};
