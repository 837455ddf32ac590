//! The keys ferrotune knows: the type each must have ([`Ty`]) and the keys of every section,
//! which [`validate`](super::validate) checks a config against.

/// The type a key must have. Every key may also be `null` (torchtune's "unset").
#[derive(Debug, Clone, Copy)]
pub enum Ty {
    /// Any string.
    Str,
    /// An integer (a whole-number string such as "8" is accepted too).
    Int,
    /// A number (an integer, a float or a numeric string such as "3e-4").
    Float,
    /// A boolean (or the strings true/false/True/False).
    Bool,
    /// A list of strings (a single string is accepted too).
    StrList,
    /// A list of numbers.
    FloatList,
    /// A mapping from strings to strings (e.g. `column_map`).
    StrMap,
    /// A mapping with known keys.
    Map(&'static [(&'static str, Ty)]),
    /// A mapping with known keys, or a list of such mappings (datasets).
    MapOrList(&'static [(&'static str, Ty)]),
    /// Anything (sections ferrotune accepts but does not interpret, such as `profiler`).
    Any,
    /// A string or a mapping with `system`/`user` strings (generation prompts).
    Prompt,
}

impl Ty {
    pub(super) fn name(&self) -> &'static str {
        match self {
            Ty::Str => "a string",
            Ty::Int => "an integer",
            Ty::Float => "a number",
            Ty::Bool => "a boolean",
            Ty::StrList => "a list of strings",
            Ty::FloatList => "a list of numbers",
            Ty::StrMap => "a mapping of strings",
            Ty::Map(_) => "a mapping",
            Ty::MapOrList(_) => "a mapping or a list of mappings",
            Ty::Any => "anything",
            Ty::Prompt => "a string or a mapping with system/user (user a string or {text})",
        }
    }
}

/// `push_to_hub`: where the final checkpoint goes (`ferrotune upload`'s arguments).
const PUSH_TO_HUB_KEYS: &[(&str, Ty)] = &[
    ("repo_id", Ty::Str),
    ("repo_type", Ty::Str),
    ("private", Ty::Bool),
    ("revision", Ty::Str),
    ("commit_message", Ty::Str),
];

const MODEL_KEYS: &[(&str, Ty)] = &[
    ("_component_", Ty::Str),
    ("lora_attn_modules", Ty::StrList),
    ("apply_lora_to_mlp", Ty::Bool),
    ("apply_lora_to_output", Ty::Bool),
    ("apply_lora_to_embeddings", Ty::Bool),
    ("lora_rank", Ty::Int),
    ("lora_alpha", Ty::Float),
    ("lora_dropout", Ty::Float),
    ("use_dora", Ty::Bool),
    ("use_rslora", Ty::Bool),
    ("lora_bias", Ty::Bool),
    ("modules_to_save", Ty::StrList),
    ("target_parameters", Ty::StrList),
    ("quantize_base", Ty::Bool),
];
const TOKENIZER_KEYS: &[(&str, Ty)] = &[
    ("_component_", Ty::Str),
    ("path", Ty::Str),
    ("max_seq_len", Ty::Int),
    ("merges_file", Ty::Str),
    // torchtune's Phi-4 tokenizer names its files this way.
    ("vocab_path", Ty::Str),
    ("merges_path", Ty::Str),
    ("prompt_template", Ty::Any),
];
const CHECKPOINTER_KEYS: &[(&str, Ty)] = &[
    ("_component_", Ty::Str),
    ("checkpoint_dir", Ty::Str),
    ("checkpoint_files", Ty::Any),
    ("recipe_checkpoint", Ty::Str),
    ("adapter_checkpoint", Ty::Str),
    ("output_dir", Ty::Str),
    ("model_type", Ty::Str),
    ("safe_serialization", Ty::Bool),
    ("keep_last_n_checkpoints", Ty::Int),
];
/// Keys of one dataset section.
pub const DATASET_KEYS: &[(&str, Ty)] = &[
    ("_component_", Ty::Str),
    ("source", Ty::Str),
    ("data_files", Ty::Any),
    ("data_dir", Ty::Str),
    ("name", Ty::Str),
    ("field", Ty::Str),
    ("split", Ty::Str),
    ("column_map", Ty::StrMap),
    ("template", Ty::Str),
    ("train_on_input", Ty::Bool),
    ("new_system_prompt", Ty::Str),
    ("max_seq_len", Ty::Int),
    ("packed", Ty::Bool),
    ("conversation_column", Ty::Str),
    ("conversation_style", Ty::Str),
    ("column", Ty::Str),
    ("add_eos", Ty::Bool),
    ("trust_remote_code", Ty::Bool),
    ("split_across_pack", Ty::Bool),
    // wikitext_dataset's hub configuration.
    ("subset", Ty::Str),
    // torchtune.dev.grpo.gsm8k's builders: `start-end/total` of the row indices.
    ("partition", Ty::Str),
    // prompt_dataset (GRPO): the column of the built-in rewards' reference.
    ("answer_column", Ty::Str),
    // chat_dataset, prompt_dataset: the column of the rows' tools (JSON schemas).
    ("tools_column", Ty::Str),
    // The reward-model recipes: pairs with a longer side are left out (TRL's max_length).
    ("max_length", Ty::Int),
];
const OPTIMIZER_KEYS: &[(&str, Ty)] = &[
    ("_component_", Ty::Str),
    ("lr", Ty::Float),
    ("weight_decay", Ty::Float),
    ("betas", Ty::FloatList),
    ("eps", Ty::Float),
    ("momentum", Ty::Float),
    ("dampening", Ty::Float),
    ("nesterov", Ty::Bool),
    ("amsgrad", Ty::Bool),
    ("maximize", Ty::Bool),
    ("fused", Ty::Bool),
    ("foreach", Ty::Bool),
    // The quantized AdamW classes' own (torchao's, bitsandbytes'): `recipe/setup/optimizer.rs`.
    ("block_size", Ty::Int),
    ("bf16_stochastic_round", Ty::Bool),
    ("min_8bit_size", Ty::Int),
    ("percentile_clipping", Ty::Float),
    ("optim_bits", Ty::Int),
];
const SCHEDULER_KEYS: &[(&str, Ty)] = &[
    ("_component_", Ty::Str),
    ("num_warmup_steps", Ty::Int),
    ("num_training_steps", Ty::Int),
    ("num_cycles", Ty::Float),
];
const LOSS_KEYS: &[(&str, Ty)] = &[
    ("_component_", Ty::Str),
    ("num_output_chunks", Ty::Int),
    // DPOLoss / RSOLoss / ORPOLoss / SimPOLoss / CPOLoss / IPOLoss (the DPO recipes).
    ("beta", Ty::Float),
    ("label_smoothing", Ty::Float),
    ("gamma", Ty::Float),
    ("simpo_gamma", Ty::Float),
    ("cpo_alpha", Ty::Float),
    // KTOLoss (the DPO recipes; also `beta`, `loss_type`).
    ("desirable_weight", Ty::Float),
    ("undesirable_weight", Ty::Float),
    // PPOLoss (ppo_full_finetune_single_device).
    ("epsilon", Ty::Float),
    ("value_clip_range", Ty::Float),
    ("value_coeff", Ty::Float),
    // GRPOSimpleLoss / GRPOLoss (dev/grpo_full_finetune_distributed).
    ("kl_coeff", Ty::Float),
    // TRL's GRPO losses (dev/grpo_full_finetune_distributed with `loss_type`; also `beta`,
    // `epsilon`).
    ("loss_type", Ty::Str),
    ("epsilon_high", Ty::Float),
    ("importance_sampling_level", Ty::Str),
    ("use_bias_correction_kl", Ty::Bool),
];
/// torchtune's classifier builders (`mistral_classifier`, ...): the architecture is read from the
/// checkpoint, so the builder's dimensions are accepted and not used.
const CLASSIFIER_KEYS: &[(&str, Ty)] = &[
    ("_component_", Ty::Str),
    ("attn_dropout", Ty::Float),
    ("embed_dim", Ty::Int),
    ("intermediate_dim", Ty::Int),
    ("max_seq_len", Ty::Int),
    ("norm_eps", Ty::Float),
    ("num_classes", Ty::Int),
    ("num_heads", Ty::Int),
    ("num_kv_heads", Ty::Int),
    ("num_layers", Ty::Int),
    ("vocab_size", Ty::Int),
    ("rope_base", Ty::Float),
    ("head_dim", Ty::Int),
];
const LOGGER_KEYS: &[(&str, Ty)] = &[
    ("_component_", Ty::Str),
    ("log_dir", Ty::Str),
    ("filename", Ty::Str),
    ("project", Ty::Str),
    ("organize_logs", Ty::Bool),
    // MLFlowLogger's
    ("experiment_name", Ty::Str),
    ("tracking_uri", Ty::Str),
    ("run_id", Ty::Str),
    ("run_name", Ty::Str),
    ("log_checkpoint", Ty::Bool),
    // WandBLogger's (torchtune's and the `wandb.init` arguments it passes on)
    ("entity", Ty::Str),
    ("group", Ty::Str),
    ("name", Ty::Str),
    ("dir", Ty::Str),
    ("tags", Ty::StrList),
    ("notes", Ty::Str),
    ("job_type", Ty::Str),
    ("mode", Ty::Str),
    ("id", Ty::Str),
    ("resume", Ty::Any),
    ("allow_val_change", Ty::Bool),
    ("save_code", Ty::Bool),
    // CometLogger's
    ("api_key", Ty::Str),
    ("workspace", Ty::Str),
    ("experiment_key", Ty::Str),
    ("online", Ty::Bool),
    ("log_code", Ty::Bool),
];

const FSDP_KEYS: &[(&str, Ty)] = &[("cpu_offload", Ty::Bool)];
const KD_LOSS_KEYS: &[(&str, Ty)] = &[
    ("_component_", Ty::Str),
    ("num_output_chunks", Ty::Int),
    ("ignore_index", Ty::Int),
    ("sym_kd_ratio", Ty::Float),
];

/// The early-exit recipe's `early_exit_loss` (torchtune.modules.early_exit_loss).
const EARLY_EXIT_KEYS: &[(&str, Ty)] = &[
    ("layers", Ty::Any),
    ("curriculum", Ty::Str),
    ("scale_fn", Ty::Str),
    ("scale", Ty::Float),
    ("include_last_layer", Ty::Bool),
    ("verbose", Ty::Bool),
];
/// The early-exit recipe's `layer_dropout` (torchtune.modules.layer_dropout).
const LAYER_DROPOUT_KEYS: &[(&str, Ty)] = &[
    ("prob", Ty::Float),
    ("layers", Ty::Any),
    ("layers_scale", Ty::Str),
    ("disable_on_eval", Ty::Bool),
];

/// The keys of one GRPO `reward_funcs` entry (`crate::reward` checks which each kind takes).
pub const REWARD_KEYS: &[(&str, Ty)] = &[
    ("builtin", Ty::Str),
    ("python", Ty::Str),
    ("http", Ty::Str),
    // An https endpoint's extra trusted authority (PEM), beside the system's (reward/https.rs).
    ("ca_cert", Ty::Str),
    // A reward model's folder (a *ForSequenceClassification checkpoint), and where it runs.
    ("model", Ty::Str),
    ("device", Ty::Str),
    ("dtype", Ty::Str),
    ("function", Ty::Str),
    ("name", Ty::Str),
    ("timeout", Ty::Float),
    ("conversational", Ty::Bool),
    ("column", Ty::Str),
    ("pattern", Ty::Str),
    ("max_completion_len", Ty::Int),
    ("soft_punish_cache", Ty::Int),
    ("interpreter", Ty::Str),
];

/// Every top-level key of every recipe.
pub const TOP_LEVEL_KEYS: &[(&str, Ty)] = &[
    ("output_dir", Ty::Str),
    ("model", Ty::Map(MODEL_KEYS)),
    ("teacher_model", Ty::Map(MODEL_KEYS)),
    ("teacher_checkpointer", Ty::Map(CHECKPOINTER_KEYS)),
    ("kd_loss", Ty::Map(KD_LOSS_KEYS)),
    ("kd_ratio", Ty::Float),
    // The reward-model recipes: TRL's RewardConfig.center_rewards_coefficient.
    ("center_rewards_coefficient", Ty::Float),
    ("ref_checkpointer", Ty::Map(CHECKPOINTER_KEYS)),
    ("tokenizer", Ty::Map(TOKENIZER_KEYS)),
    ("checkpointer", Ty::Map(CHECKPOINTER_KEYS)),
    ("resume_from_checkpoint", Ty::Bool),
    ("overwrite_output_dir", Ty::Bool),
    ("save_adapter_weights_only", Ty::Bool),
    ("dataset", Ty::MapOrList(DATASET_KEYS)),
    ("dataset_val", Ty::MapOrList(DATASET_KEYS)),
    ("batch_size_val", Ty::Int),
    ("run_val_every_n_steps", Ty::Int),
    ("seed", Ty::Int),
    ("shuffle", Ty::Bool),
    ("batch_size", Ty::Int),
    ("epochs", Ty::Int),
    ("max_steps_per_epoch", Ty::Int),
    ("gradient_accumulation_steps", Ty::Int),
    ("clip_grad_norm", Ty::Float),
    ("optimizer", Ty::Map(OPTIMIZER_KEYS)),
    ("lr_scheduler", Ty::Map(SCHEDULER_KEYS)),
    ("loss", Ty::Map(LOSS_KEYS)),
    ("device", Ty::Str),
    ("dtype", Ty::Str),
    ("enable_activation_checkpointing", Ty::Bool),
    ("enable_activation_offloading", Ty::Bool),
    ("compile", Ty::Bool),
    ("low_cpu_ram", Ty::Bool),
    ("optimizer_in_bwd", Ty::Bool),
    ("metric_logger", Ty::Map(LOGGER_KEYS)),
    ("log_every_n_steps", Ty::Int),
    ("log_peak_memory_stats", Ty::Bool),
    // ferrotune's: upload the final checkpoint to the Hugging Face Hub (recipe/kit/push.rs).
    ("push_to_hub", Ty::Map(PUSH_TO_HUB_KEYS)),
    ("log_level", Ty::Str),
    ("save_every_n_steps", Ty::Int),
    ("profiler", Ty::Any),
    ("fsdp_sharding", Ty::Str),
    ("fsdp_cpu_offload", Ty::Bool),
    // The older spelling in torchtune's distributed QLoRA configs (`fsdp: {cpu_offload: ...}`).
    ("fsdp", Ty::Map(FSDP_KEYS)),
    ("fsdp_reshard_after_forward", Ty::Bool),
    // ferrotune's: seconds a rank may send no heartbeat before the others stop the run.
    ("dist_watchdog_timeout", Ty::Float),
    // torchtune's tensor parallelism: only dimension 1 (none) runs; the plan then does nothing.
    ("tensor_parallel_dim", Ty::Int),
    ("tensor_parallel_plan", Ty::Any),
    ("custom_sharded_layers", Ty::StrList),
    ("cpu_offload", Ty::Bool),
    ("prompt", Ty::Prompt),
    ("max_new_tokens", Ty::Int),
    ("temperature", Ty::Float),
    ("top_k", Ty::Int),
    ("top_p", Ty::Float),
    ("enable_kv_cache", Ty::Bool),
    ("instruct_template", Ty::Str),
    ("chat_format", Ty::Str),
    ("quantizer", Ty::Any),
    // eleuther_eval
    ("tasks", Ty::StrList),
    ("limit", Ty::Float),
    ("max_seq_length", Ty::Int),
    ("include_path", Ty::Str),
    ("fake_quant_after_n_steps", Ty::Int),
    ("max_seq_len", Ty::Int),
    // ppo_full_finetune_single_device
    ("policy_model", Ty::Map(MODEL_KEYS)),
    ("reward_and_value_model", Ty::Map(CLASSIFIER_KEYS)),
    ("ref_policy_checkpointer", Ty::Map(CHECKPOINTER_KEYS)),
    ("value_checkpointer", Ty::Map(CHECKPOINTER_KEYS)),
    ("reward_checkpointer", Ty::Map(CHECKPOINTER_KEYS)),
    ("num_steps", Ty::Int),
    ("ppo_epochs", Ty::Int),
    ("ppo_batch_size", Ty::Int),
    ("forward_batch_size", Ty::Int),
    ("max_generated_tokens", Ty::Int),
    ("min_response_length", Ty::Int),
    ("penalise_no_eos", Ty::Bool),
    ("reward_penalty", Ty::Float),
    ("stop_token_ids", Ty::Any),
    ("whiten_rewards", Ty::Bool),
    ("gamma", Ty::Float),
    ("lmbda", Ty::Float),
    ("kl_coeff", Ty::Float),
    // dev/grpo_full_finetune_distributed
    ("grpo_samples", Ty::Int),
    ("save_every_n_epochs", Ty::Int),
    ("reward_fn", Ty::Map(&[("_component_", Ty::Str)])),
    // TRL's GRPO keys: `scale_rewards` group/batch/none or a boolean, `num_iterations` (=
    // ppo_epochs).
    ("scale_rewards", Ty::Any),
    ("num_iterations", Ty::Int),
    // TRL's names for grpo_samples and max_generated_tokens.
    ("num_generations", Ty::Int),
    ("max_completion_length", Ty::Int),
    // TRL's reward functions and their weights.
    ("reward_funcs", Ty::MapOrList(REWARD_KEYS)),
    ("reward_weights", Ty::FloatList),
    // dev/early_exit_finetune_distributed
    ("early_exit_loss", Ty::Map(EARLY_EXIT_KEYS)),
    ("layer_dropout", Ty::Map(LAYER_DROPOUT_KEYS)),
];
