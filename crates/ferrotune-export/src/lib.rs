//! ferrotune-export: the file formats a fine-tuned model or adapter is written in.
//!
//! - [`gguf`] — llama.cpp's GGUF: [`gguf::export_gguf`] writes a model (f32, f16, bf16, Q8_0 or a
//!   k-quant mix, chosen by [`gguf::OutType`]) with its metadata and tokenizer, and
//!   [`gguf::export_gguf_adapter`] a PEFT LoRA adapter; [`gguf::GgufExport`] reports what was
//!   written.
//! - [`gguf_quants`] — ggml's block quantizers ([`gguf_quants::quantize`],
//!   [`gguf_quants::QuantKind`]) behind `llama-quantize`'s k-quant mixes.
//! - [`hf`] — complete HF checkpoint folders ([`hf::write_hf_model`] from a [`hf::ModelSource`],
//!   or Meta's format through [`hf::write_model`] and [`hf::SaveFormat`]) and their tokenizer files
//!   ([`hf::copy_tokenizer_files`], [`hf::copy_or_export_tokenizer`]).

pub mod gguf;
pub mod gguf_quants;
pub mod hf;
