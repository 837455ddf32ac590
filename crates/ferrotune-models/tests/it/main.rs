//! ferrotune-models's integration tests, one binary (the stack is linked once, not once per file): a
//! module per area, and the helpers they share in `common`.

mod common;
mod decode_step;
mod deepseek;
mod device_map;
mod errors;
mod fp8;
mod gguf;
mod gguf_qwen35;
mod golden_models;
mod gpt_oss;
mod gpt_oss_mxfp4;
mod llama4;
mod lora;
mod modules_to_save;
mod multimodal_text;
mod qlora;
mod quantized;
mod qwen3_5;
mod structure;
mod torch_save;
mod torchtune_adapter;
mod weight_checks;
