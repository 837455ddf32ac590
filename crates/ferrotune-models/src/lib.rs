//! ferrotune-models: model configuration, the one decoder every family shares, and checkpoint
//! loading (HF safetensors, single or sharded; llama.cpp GGUF).

pub mod checkpoint;
pub mod config;
pub mod device_map;
pub mod error;
pub mod family;
pub mod fp8;
pub mod gguf;
pub mod model;
pub mod mxfp4;
pub mod peft;
pub mod rope;
pub mod save;
pub mod slots;
pub mod torch_pickle;
pub mod torchtune_names;
mod weight_checks;

pub use checkpoint::{
    load_model, load_model_files, read_checkpoint, read_checkpoint_files, Checkpoint,
    CheckpointFormat,
};
pub use config::ModelConfig;
pub use device_map::{DeviceMapMode, Placement};
pub use error::ModelError;
pub use lora::LoraAdapter;
/// LoRA and DoRA adapters live with the linear layers they adapt, in [`model::lora`].
pub use model::lora;
pub use model::{
    AttentionLayout, BaseWeight, CausalLm, FakeQuant, KvCache, LayerInputs, Linear, Nf4Summary,
    RouterRecord,
};
/// PEFT's `target_parameters` live with the rest of PEFT's format, in [`peft::peft_params`].
pub use peft::peft_params;
/// torchtune's adapter file, PEFT's fallback, lives in [`peft::torchtune_adapter`].
pub use peft::torchtune_adapter;
pub use peft::{load_adapter, save_adapter, LoraConfig, TargetModules};
pub use save::{parse_shard_size, save_hf_checkpoint};
pub use slots::Unit;
