//! PEFT LoRA adapter folders: reading `adapter_config.json` + `adapter_model.safetensors`,
//! attaching the adapters to a [`CausalLm`], saving them back in PEFT's format, merging them into
//! the base weights, and creating fresh adapters for training.
//!
//! Which layers get an adapter, and with which rank and alpha, follows PEFT 0.21's
//! `check_target_module_exists` and `get_pattern_key` against the HF module names of
//! [`CausalLm::linears`] (`model.layers.0.self_attn.q_proj`, ..., `lm_head`).
//!
//! The principal types are [`LoraConfig`] (PEFT's `LoraConfig`, read from and written to
//! `adapter_config.json`) and [`TargetModules`] (its `target_modules` / `exclude_modules`). The
//! code is split by concern:
//!
//! - `mod.rs` (here): the file names and prefixes of PEFT's format ([`ADAPTER_CONFIG_FILE`],
//!   [`ADAPTER_WEIGHTS_FILE`], [`PEFT_PREFIX`], [`EMBED_MODULE`], ...), the adapter-file names of
//!   one module's tensors, and the re-exports that keep every `peft::X` path.
//! - `config.rs`: [`LoraConfig`] and [`TargetModules`], parsing `adapter_config.json`, which
//!   modules a config targets (`targets`, `rank_and_alpha`, the layer index of
//!   `layers_to_transform`) and the modules it adapts in a model.
//! - `pattern.rs`: PEFT's regular expressions (`re.fullmatch`), compiled with the `regex` crate
//!   and cached.
//! - `attach.rs`: attaching adapters to a model ([`attach_adapter`], [`add_adapter`]), their
//!   trainable parameters and [`with_adapters_disabled`].
//! - `files.rs`: adapter folders: [`load_adapter`], [`load_adapter_from`] (with torchtune's
//!   file as a fallback), [`read_adapter_tensors`], [`adapter_tensors`], [`save_adapter`] and
//!   the tensors and files it writes.
//! - `merge.rs`: [`merged_tensors`], [`merge_refusal`] and [`merge_and_unload`].
//! - `saved_modules.rs`: PEFT's `modules_to_save` ([`replace_saved_modules`],
//!   [`make_saved_modules_trainable`]), trainable tokens, and the embedding and head weights
//!   saved beside an adapter (untying a tied head, a resized vocabulary).
//! - [`peft_params`]: PEFT's `target_parameters` (LoRA on transformers 5's fused expert
//!   parameters), expanded to per-expert adapters on attaching and written back in that form
//!   (public also as `ferrotune_models::peft_params`).
//! - `gpt_oss_params.rs`: `target_parameters` on gpt-oss's fused experts, held, trained, saved
//!   and merged in PEFT's fused form (`ParamWrapper`'s `lora_A` `[r · experts, in]`).
//! - [`torchtune_adapter`]: torchtune's `adapter_model.pt`, read as [`load_adapter_from`]'s
//!   fallback and written beside PEFT's files (public also as
//!   `ferrotune_models::torchtune_adapter`).
//!
//! [`CausalLm`]: crate::model::CausalLm
//! [`CausalLm::linears`]: crate::model::CausalLm::linears

mod attach;
mod config;
mod files;
mod gpt_oss_params;
mod merge;
mod pattern;
pub mod peft_params;
mod saved_modules;
pub mod torchtune_adapter;

pub use attach::{add_adapter, attach_adapter, trainable_parameters, with_adapters_disabled};
pub use config::{LoraConfig, TargetModules};
pub use files::{
    adapter_tensors, load_adapter, load_adapter_from, read_adapter_tensors, save_adapter,
};
pub(crate) use files::{saved_tensors, write_adapter_files};
pub use merge::{merge_and_unload, merge_refusal, merged_tensors};
pub use saved_modules::{make_saved_modules_trainable, replace_saved_modules};

/// The adapter config file of a PEFT folder.
pub const ADAPTER_CONFIG_FILE: &str = "adapter_config.json";
/// The adapter weights file of a PEFT folder.
pub const ADAPTER_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// Prefix PEFT puts before module names in adapter files (`PeftModel.base_model.model`).
pub const PEFT_PREFIX: &str = "base_model.model.";

/// The module names PEFT users target on the supported decoders.
pub const LORA_TARGET_NAMES: &[&str] = &[
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "qkv_proj",
    "gate_up_proj",
    "lm_head",
    "embed_tokens",
];

/// The HF module name of the token embedding, as PEFT targets it (`embed_tokens`).
pub const EMBED_MODULE: &str = "model.embed_tokens";

/// The adapter-file names of the embedding adapter's tensors: PEFT's `lora.Embedding` keeps
/// `lora_embedding_A`/`lora_embedding_B` as bare parameters (no `.weight`).
fn embed_file_keys() -> (String, String, String) {
    let p = format!("{PEFT_PREFIX}{EMBED_MODULE}");
    (
        format!("{p}.lora_embedding_A"),
        format!("{p}.lora_embedding_B"),
        format!("{p}.lora_magnitude_vector"),
    )
}

/// The adapter-file names of one module's tensors.
pub(crate) fn file_keys(module: &str) -> (String, String, String) {
    let p = format!("{PEFT_PREFIX}{module}");
    (
        format!("{p}.lora_A.weight"),
        format!("{p}.lora_B.weight"),
        format!("{p}.lora_magnitude_vector"),
    )
}

/// The adapter-file name of one module's LoRA bias (`lora_bias`).
fn bias_file_key(module: &str) -> String {
    format!("{PEFT_PREFIX}{module}.lora_B.bias")
}

/// Why an adapter on Llama 3.2 Vision's token embedding is refused.
const MLLAMA_EMBEDDING: &str = "Llama 3.2 Vision's token embedding holds 8 image-token rows \
     past vocab_size, which ferrotune's text model leaves out: an adapter on embed_tokens (or \
     embed_tokens in modules_to_save) would not have the shape PEFT loads on the checkpoint";

/// Why an adapter whose head shares the embedding's is not trained.
const SHARED_HEAD_TRAINING: &str = "training an adapter with ensure_weight_tying on a tied \
     embedding is not supported (PEFT trains the shared tensors as two parameters): merge it \
     first, or set ensure_weight_tying to false";
