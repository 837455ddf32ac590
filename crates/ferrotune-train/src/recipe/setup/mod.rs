//! The setup steps every recipe shares: device and dtype, model and tokenizer from the
//! checkpointer section, LoRA settings from torchtune's model keys, optimizer, LR schedule, loss.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device};
use ferrotune_data::Tokenizer;
use ferrotune_export::hf::{ModelSource, SaveFormat};
use ferrotune_models::peft::{LoraConfig, TargetModules};
use ferrotune_models::{read_checkpoint_files, CausalLm, CheckpointFormat, ModelConfig};

use crate::config::Config;
use crate::schedule::LrSchedule;

mod early_exit;
mod optimizer;

pub use early_exit::{LayerDropoutSettings, LayerSkipSettings};
pub use optimizer::{optimizer, optimizer_note, quant_config, sharded_optimizer};
// The stop and pad tokens are inference's; the training recipes generate and pad with them too.
pub use ferrotune_infer::{pad_id, stop_ids};

/// `device` (cpu, cuda, cuda:N; default cpu).
pub fn device(cfg: &Config) -> Result<Device> {
    // One device is rank 0 of one: `cuda` means `cuda:0` either way.
    device_for_rank(cfg, 0)
}

/// The device of rank `local_rank` of a distributed run: `device: cuda` (no index) means the
/// GPU of the same number as the local rank, as torchtune does.
pub fn device_for_rank(cfg: &Config, local_rank: usize) -> Result<Device> {
    let name = cfg.str("device")?.unwrap_or_else(|| "cpu".into());
    // `cuda` is already GPU 0; only other ranks need their number spelled out.
    let name = if name.trim().eq_ignore_ascii_case("cuda") && local_rank > 0 {
        format!("cuda:{local_rank}")
    } else {
        name
    };
    ferrotune_core::parse_device(&name).map_err(|e| anyhow!("{}: 'device': {e}", cfg.origin))
}

/// `fsdp_sharding` (`full`, `grad_op`, `none`; default full). Without it, torchtune's
/// `fsdp_reshard_after_forward: false` asks for `grad_op`.
pub fn sharding(cfg: &Config) -> Result<crate::dist::fsdp::Sharding> {
    use crate::dist::fsdp::Sharding;
    match cfg.str("fsdp_sharding")? {
        Some(v) => Sharding::parse(&v).ok_or_else(|| {
            anyhow!(
                "{}: 'fsdp_sharding: {v}': expected full, grad_op or none",
                cfg.origin
            )
        }),
        None if cfg.bool("fsdp_reshard_after_forward")? == Some(false) => Ok(Sharding::GradOp),
        None => Ok(Sharding::Full),
    }
}

/// `dist_watchdog_timeout` (seconds): how long a rank of a distributed run may send no heartbeat
/// before the others stop naming it; unset, `FERROTUNE_DIST_WATCHDOG`, else 60 s.
pub fn dist_watchdog(cfg: &Config) -> Result<std::time::Duration> {
    match cfg.f64("dist_watchdog_timeout")? {
        Some(secs) => crate::dist::env::watchdog_timeout(Some(secs))
            .map_err(|e| anyhow!("{}: {e:#}", cfg.origin)),
        None => crate::dist::env::watchdog_timeout(None),
    }
}

/// `dtype` (fp32, bf16, fp16; torchtune's names and candle's; default fp32).
pub fn dtype(cfg: &Config) -> Result<DType> {
    let name = cfg.str("dtype")?.unwrap_or_else(|| "fp32".into());
    match name.as_str() {
        "fp32" | "f32" | "float32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "fp16" | "f16" | "float16" => bail!(
            "{}: 'dtype: {name}': fp16 training is not supported (torchtune refuses it too); use bf16 or fp32",
            cfg.origin
        ),
        other => bail!(
            "{}: 'dtype' must be fp32 or bf16, got '{other}'",
            cfg.origin
        ),
    }
}

/// A checkpointer section's model: its `checkpoint_dir` (an HF or Meta folder, or a .gguf) and
/// the weight files its `checkpoint_files` names, which are what is loaded, as torchtune's
/// checkpointers do (empty: the folder decides).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointLocation {
    pub path: PathBuf,
    pub files: Vec<PathBuf>,
}

impl CheckpointLocation {
    /// A checkpoint folder whose weights the folder itself names (a run's own checkpoint).
    pub fn folder(path: &Path) -> Self {
        Self {
            path: path.to_path_buf(),
            files: Vec::new(),
        }
    }

    /// Loads the model for inference (see [`ferrotune_models::load_model`]); returns it and the
    /// folder holding its config and tokenizer files.
    pub fn load(&self, dtype: DType, device: &Device) -> Result<(CausalLm, PathBuf)> {
        Ok(ferrotune_models::load_model_files(
            &self.path,
            &self.files,
            dtype,
            device,
        )?)
    }
}

/// The inference recipes' `quantizer` (torchtune's generate and eleuther_eval): null, or one of
/// the int8-dynamic-activation / int4-weight quantizers whose `quantize` output the checkpoint
/// is. Returns whether one is set.
pub fn quantizer_mode(cfg: &Config) -> Result<bool> {
    let Some(q) = cfg.get("quantizer").filter(|q| !q.is_null()) else {
        return Ok(false);
    };
    let component = q
        .get("_component_")
        .and_then(|c| c.as_str())
        .unwrap_or_default();
    let short = component.rsplit('.').next().unwrap_or_default();
    match short {
        "Int8DynActInt4WeightQuantizer"
        | "Int8DynActInt4WeightQATQuantizer"
        | "Int8DynActInt4WeightQATQuantizerModuleSwap" => Ok(true),
        _ => bail!(
            "{}: quantizer._component_ '{component}' is not supported here: a checkpoint \
             written by the quantize recipe runs with Int8DynActInt4WeightQuantizer (or its QAT \
             form), or with quantizer: null",
            cfg.origin
        ),
    }
}

/// With a `quantizer` set (`quantizer`, as [`quantizer_mode`] read it), the loaded model must be
/// a `quantize` recipe's output (torchtune loads that file into its quantized model; a float
/// checkpoint would not load there).
pub fn check_quantized(cfg: &Config, quantizer: bool, model: &CausalLm, path: &Path) -> Result<()> {
    let quantized = model
        .linears()
        .iter()
        .any(|(_, l)| l.fake_quant.is_some_and(|f| !f.quantize_weight));
    if quantizer && !quantized {
        bail!(
            "{}: quantizer is set but {} is not a quantized checkpoint: point \
             checkpointer.checkpoint_dir / checkpoint_files at the quantize recipe's \
             *-8da4w.pt (or set quantizer: null)",
            cfg.origin,
            path.display()
        );
    }
    Ok(())
}

/// What a folder named by `checkpoint_dir` does hold, for an error about a listed file that is
/// not there (e.g. torchtune's `model-00001-of-00001.safetensors` where ferrotune saved
/// `model.safetensors`).
fn weight_files_hint(dir: &Path) -> String {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return String::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.path().is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| {
            [".safetensors", ".bin", ".pt", ".pth", ".gguf"]
                .iter()
                .any(|s| n.ends_with(s))
                && !n.starts_with("adapter_model.")
        })
        .collect();
    names.sort();
    match names.len() {
        0 => String::new(),
        _ => format!(
            " ({} holds {}: list those, or leave checkpoint_files out and the folder decides)",
            dir.display(),
            names.join(", ")
        ),
    }
}

/// The format the run saves its model in: Meta's when `checkpointer._component_` is torchtune's
/// `FullModelMetaCheckpointer` and the base is a Meta checkpoint (what that checkpointer reads),
/// HF's otherwise (an HF or GGUF base under a Meta checkpointer is saved as HF, with a note
/// passed to `say`).
pub fn save_format(cfg: &Config, source: &ModelSource, say: impl Fn(String)) -> SaveFormat {
    let component = cfg
        .get("checkpointer._component_")
        .and_then(|c| c.as_str().map(str::to_string))
        .unwrap_or_default();
    let meta_checkpointer = component.rsplit('.').next() == Some("FullModelMetaCheckpointer");
    match (meta_checkpointer, &source.format) {
        (true, CheckpointFormat::Meta(_)) => SaveFormat::Meta,
        (true, _) => {
            say(format!(
                "note: checkpointer is FullModelMetaCheckpointer but {} is not a Meta checkpoint \
                 (consolidated.00.pth + params.json): checkpoints are saved as HF folders",
                source.dir.display()
            ));
            SaveFormat::Hf
        }
        (false, _) => SaveFormat::Hf,
    }
}

/// Whether `checkpointer._component_` is one of torchtune's checkpointers (`FullModelHFCheckpointer`,
/// `FullModelMetaCheckpointer`, `FullModelTorchTuneCheckpointer`): LoRA checkpoints then hold
/// torchtune's `adapter_model.pt` too, as its checkpointers write it.
pub fn torchtune_checkpointer(cfg: &Config) -> bool {
    cfg.get("checkpointer._component_")
        .and_then(|c| c.as_str())
        .and_then(|c| c.rsplit('.').next())
        .is_some_and(|name| name.starts_with("FullModel") && name.ends_with("Checkpointer"))
}

/// The base checkpoint (`checkpointer.checkpoint_dir` and `checkpoint_files`).
pub fn checkpoint_path(cfg: &Config) -> Result<CheckpointLocation> {
    checkpoint_path_at(cfg, "checkpointer")
}

/// [`checkpoint_path`] for the checkpointer section `section` (`teacher_checkpointer` too).
pub fn checkpoint_path_at(cfg: &Config, section: &str) -> Result<CheckpointLocation> {
    let dir = cfg
        .path(&format!("{section}.checkpoint_dir"))?
        .ok_or_else(|| anyhow!("{}: '{section}.checkpoint_dir' is required", cfg.origin))?;
    if !dir.exists() {
        bail!(
            "{}: {section}.checkpoint_dir: {} does not exist",
            cfg.origin,
            dir.display()
        );
    }
    let gguf = dir.extension().is_some_and(|e| e == "gguf");
    if gguf && cfg.get(&format!("{section}.checkpoint_files")).is_some() {
        // A torchtune config retargeted at a GGUF keeps its shard list: the file is the checkpoint.
        eprintln!(
            "note: {section}.checkpoint_files is ignored: {} is a single GGUF checkpoint",
            dir.display()
        );
    }
    let mut listed = Vec::new();
    if let Some(files) = cfg
        .get(&format!("{section}.checkpoint_files"))
        .filter(|_| !gguf)
    {
        let names: Vec<String> = match files {
            serde_json::Value::Array(a) => a
                .iter()
                .filter_map(|v| v.as_str().map(str::to_string))
                .collect(),
            serde_json::Value::String(s) => vec![s.clone()],
            // torchtune's `{filename_format: ..., max_filename: ...}` form: let the folder speak.
            _ => Vec::new(),
        };
        let base = if dir.is_dir() {
            dir.clone()
        } else {
            dir.parent().unwrap_or(Path::new(".")).to_path_buf()
        };
        for name in &names {
            let f = base.join(name);
            if !f.is_file() {
                bail!(
                    "{}: {section}.checkpoint_files: {} does not exist{}",
                    cfg.origin,
                    f.display(),
                    weight_files_hint(&base)
                );
            }
            listed.push(f);
        }
        if dir.is_dir() && !listed.is_empty() {
            ferrotune_models::checkpoint::locate_listed(&dir, &listed)
                .map_err(|e| anyhow!("{}: {section}.checkpoint_files: {e}", cfg.origin))?;
        } else {
            // checkpoint_dir names a file: that file is the checkpoint.
            listed.clear();
        }
    }
    Ok(CheckpointLocation {
        path: dir,
        files: listed,
    })
}

/// Loads the base model (training copy: no packed weights) in `dtype` on `device`.
pub fn load_model(
    cfg: &Config,
    location: &CheckpointLocation,
    dtype: DType,
    device: &Device,
) -> Result<(CausalLm, ModelSource)> {
    load_model_as(cfg, location, dtype, device, false)
}

/// [`load_model`]; with `keep_mxfp4`, a gpt-oss checkpoint's MXFP4 experts are held packed
/// (QLoRA's frozen base) rather than dequantized.
pub fn load_model_as(
    cfg: &Config,
    location: &CheckpointLocation,
    dtype: DType,
    device: &Device,
    keep_mxfp4: bool,
) -> Result<(CausalLm, ModelSource)> {
    let path = &location.path;
    let ckpt = if keep_mxfp4 {
        ferrotune_models::checkpoint::read_checkpoint_files_keeping_mxfp4(
            path,
            &location.files,
            dtype,
            device,
        )?
    } else {
        read_checkpoint_files(path, &location.files, dtype, device)?
    };
    if !ckpt.quantized_linears.is_empty() {
        bail!(
            "{}: {} is a quantized checkpoint (the quantize recipe's output): it is for \
             generate and eleuther_eval, not for training; train from the model before \
             quantization",
            cfg.origin,
            path.display()
        );
    }
    check_model_component(cfg, &ckpt.config)?;
    for caveat in ckpt.config.training_caveats() {
        tracing::warn!("{}: {caveat}", path.display());
    }
    let source = ModelSource {
        format: ckpt.format.clone(),
        dir: ckpt.dir.clone(),
    };
    let model = CausalLm::from_tensors(ckpt.config, ckpt.tensors, &path.display().to_string())?;
    Ok((model, source))
}

/// `model._component_` is optional (the checkpoint decides the architecture), but a torchtune
/// builder naming another family than the checkpoint's is a mistake worth stopping for.
pub fn check_model_component(cfg: &Config, model: &ModelConfig) -> Result<()> {
    check_component_at(cfg, "model._component_", model)
}

/// [`check_model_component`] for the builder at `key` (`teacher_model._component_` too).
pub fn check_component_at(cfg: &Config, key: &str, model: &ModelConfig) -> Result<()> {
    let Some(component) = cfg.str(key)? else {
        return Ok(());
    };
    let rest = component
        .strip_prefix("torchtune.models.")
        .or_else(|| component.strip_prefix("ferrotune.models."));
    let Some(rest) = rest else {
        bail!(
            "{}: {key} '{component}' is not a torchtune model builder \
             (torchtune.models.<family>.<builder>); leave it out to take the architecture from the checkpoint",
            cfg.origin
        );
    };
    let family = rest.split('.').next().unwrap_or("");
    // torchtune's builder families and the `model_type`s they build: the families' registry.
    let Some(types) = ferrotune_models::family::torchtune_builder(family) else {
        let known = ferrotune_models::family::torchtune_builder_names();
        bail!(
            "{}: {key} '{component}': unknown model family '{family}' (known: {})",
            cfg.origin,
            known.join(", ")
        );
    };
    if !types.contains(&model.model_type.as_str()) {
        bail!(
            "{}: {key} '{component}' builds a {family} model, but the checkpoint is a \
             '{}' model; fix {key} or remove it (the checkpoint's architecture is used)",
            cfg.origin,
            model.model_type
        );
    }
    Ok(())
}

/// Whether the frozen base is quantized to NF4 (QLoRA): `model.quantize_base` when given (as the
/// torchtune builders' keyword, which overrides what a builder sets), else whether
/// `model._component_` is one of torchtune's `qlora_*` builders.
pub fn quantize_base(cfg: &Config) -> Result<bool> {
    if let Some(q) = cfg.bool("model.quantize_base")? {
        return Ok(q);
    }
    let component = cfg.str("model._component_")?.unwrap_or_default();
    let builder = component.rsplit('.').next().unwrap_or(&component);
    Ok(builder.starts_with("qlora_"))
}

/// The tokenizer: `tokenizer.path` (an HF folder, a tokenizer.json / tokenizer.model file — looking
/// for tokenizer.json beside it or one folder up, as in torchtune's `original/tokenizer.model` —
/// or a .gguf), else the checkpoint's own.
pub fn tokenizer(cfg: &Config, checkpoint: &Path) -> Result<Tokenizer> {
    let (tokenizer, dir) = find_tokenizer(cfg, checkpoint)?;
    // torchtune's configs run at `log_level: INFO`, which shows this as torchtune shows its line.
    tracing::info!("Tokenizer is initialized from {}", dir.display());
    Ok(tokenizer)
}

/// The tokenizer [`tokenizer`] reads, and the file or folder it came from.
fn find_tokenizer(cfg: &Config, checkpoint: &Path) -> Result<(Tokenizer, PathBuf)> {
    let path = match cfg.path("tokenizer.path")? {
        Some(p) => p,
        // torchtune's Phi-4 tokenizer takes `vocab_path` (tokenizer.json sits beside it).
        None => cfg
            .path("tokenizer.vocab_path")?
            .unwrap_or_else(|| checkpoint.to_path_buf()),
    };
    if !path.exists() {
        bail!(
            "{}: tokenizer.path: {} does not exist",
            cfg.origin,
            path.display()
        );
    }
    if path.extension().is_some_and(|e| e == "gguf") {
        return Ok((
            Tokenizer::from_gguf(&path, ferrotune_models::family::gguf_vocab_style)?,
            path,
        ));
    }
    if path.is_dir() {
        // Meta's `original/` folder holds its own tokenizer.model; the HF tokenizer is one up.
        let dir = ferrotune_data::tokenizer::tokenizer_folder(&path).unwrap_or(path);
        return Ok((Tokenizer::from_dir(&dir)?, dir));
    }
    if let Some(dir) = ferrotune_data::tokenizer::tokenizer_folder(&path) {
        return Ok((Tokenizer::from_dir(&dir)?, dir));
    }
    bail!(
        "{}: tokenizer.path: no tokenizer.json next to {} or in its parent folder",
        cfg.origin,
        path.display()
    )
}

/// The LoRA adapter settings from torchtune's model keys (`lora_attn_modules`,
/// `apply_lora_to_mlp`, `apply_lora_to_output`, `lora_rank`, `lora_alpha`, `lora_dropout`,
/// `use_dora`) and ferrotune's `apply_lora_to_embeddings`, `use_rslora` and `lora_bias`, in HF
/// module names for `model`'s layout.
pub fn lora_config(cfg: &Config, model: &CausalLm, base_path: &Path) -> Result<LoraConfig> {
    let fused = model.config.fused_projections;
    let attn = cfg
        .str_list("model.lora_attn_modules")?
        .unwrap_or_else(|| vec!["q_proj".into(), "v_proj".into()]);
    let mut targets: Vec<String> = Vec::new();
    let mut push = |name: &str| {
        if !targets.iter().any(|t| t == name) {
            targets.push(name.to_string());
        }
    };
    // DeepSeek's latent attention: the queries' projections (`q_proj`, or `q_a_proj` and
    // `q_b_proj`) for q, the latent's (`kv_a_proj_with_mqa`, `kv_b_proj`) for k and v.
    let mla = model.config.mla.as_ref();
    for m in &attn {
        match m.as_str() {
            "q_proj" if mla.is_some_and(|m| m.q_lora_rank.is_some()) => {
                push("q_a_proj");
                push("q_b_proj");
            }
            "k_proj" | "v_proj" if mla.is_some() => {
                push("kv_a_proj_with_mqa");
                push("kv_b_proj");
            }
            "q_a_proj" | "q_b_proj" | "kv_a_proj_with_mqa" | "kv_b_proj" if mla.is_some() => push(m),
            "q_proj" | "k_proj" | "v_proj" if fused => push("qkv_proj"),
            "q_proj" | "k_proj" | "v_proj" | "qkv_proj" => push(m),
            // Phi-2 names its output projection `dense`.
            "output_proj" | "o_proj" | "dense" if model.config.parallel_block => push("dense"),
            "output_proj" | "o_proj" => push("o_proj"),
            // Qwen3.5's Gated DeltaNet projections (Qwen3-Next's fused `in_proj_qkvz`, `in_proj_ba`).
            "in_proj_qkv" | "in_proj_z" | "in_proj_b" | "in_proj_a" | "in_proj_qkvz"
            | "in_proj_ba" | "out_proj"
                if model.config.delta_net.is_some() =>
            {
                push(m)
            }
            other => bail!(
                "{}: model.lora_attn_modules: unknown module '{other}' (use q_proj, k_proj, v_proj, output_proj)",
                cfg.origin
            ),
        }
    }
    if cfg.bool("model.apply_lora_to_mlp")?.unwrap_or(false) {
        if model.config.moe.as_ref().is_some_and(|m| m.mixtral_names) {
            // Mixtral's experts: w1 (gate), w3 (up), w2 (down).
            push("w1");
            push("w3");
            push("w2");
        } else if model.config.ungated_mlp {
            // Phi-2's MLP is fc1 → act → fc2.
            push("fc1");
            push("fc2");
        } else if fused {
            push("gate_up_proj");
            push("down_proj");
        } else {
            push("gate_proj");
            push("up_proj");
            push("down_proj");
        }
    }
    if cfg.bool("model.apply_lora_to_output")?.unwrap_or(false) {
        // torchtune refuses this for a head tied to the embeddings; as PEFT does, the head is
        // adapted on its own (untied; the embedding keeps the base weights).
        push("lm_head");
    }
    let on_embeddings = cfg.bool("model.apply_lora_to_embeddings")?.unwrap_or(false);
    if on_embeddings {
        // ferrotune's key (torchtune adapts linear layers only): PEFT's `lora.Embedding`.
        push("embed_tokens");
    }
    // PEFT's `target_parameters` (ferrotune's key): LoRA on gpt-oss's fused experts.
    let target_parameters = cfg.str_list("model.target_parameters")?.unwrap_or_default();
    if targets.is_empty() && target_parameters.is_empty() {
        bail!(
            "{}: no LoRA targets: set model.lora_attn_modules and/or model.apply_lora_to_mlp",
            cfg.origin
        );
    }
    let r = cfg.usize("model.lora_rank")?.unwrap_or(8);
    if r == 0 {
        bail!("{}: model.lora_rank must be at least 1", cfg.origin);
    }
    let alpha = cfg.f64("model.lora_alpha")?.unwrap_or(16.0);
    let mut lc = LoraConfig::new(r, alpha, TargetModules::Names(targets));
    lc.lora_dropout = cfg.f64("model.lora_dropout")?.unwrap_or(0.0);
    if !(0.0..1.0).contains(&lc.lora_dropout) {
        bail!(
            "{}: model.lora_dropout must be in [0, 1), got {}",
            cfg.origin,
            lc.lora_dropout
        );
    }
    lc.use_dora = cfg.bool("model.use_dora")?.unwrap_or(false);
    lc.use_rslora = cfg.bool("model.use_rslora")?.unwrap_or(false);
    // ferrotune's key for PEFT's `lora_bias` (torchtune's LoRA layers have none).
    lc.lora_bias = cfg.bool("model.lora_bias")?.unwrap_or(false);
    if lc.lora_bias && lc.use_dora {
        bail!(
            "{}: model.lora_bias is not supported with model.use_dora (PEFT refuses the pair too)",
            cfg.origin
        );
    }
    if lc.lora_bias && on_embeddings {
        bail!(
            "{}: model.lora_bias is not supported with model.apply_lora_to_embeddings (PEFT's \
             embedding adapter has no bias)",
            cfg.origin
        );
    }
    // PEFT's `modules_to_save`: the token embedding and/or output head trained in full beside the
    // adapters (say, for tokens the base never learned).
    lc.modules_to_save = cfg.str_list("model.modules_to_save")?.unwrap_or_default();
    if !target_parameters.is_empty() {
        if model.config.gpt_oss_moe.is_none() {
            bail!(
                "{}: model.target_parameters trains adapters on gpt-oss's fused experts only \
                 (other mixtures of experts: model.apply_lora_to_mlp reaches every expert)",
                cfg.origin
            );
        }
        // PEFT's `ParamWrapper` refuses all three.
        if lc.lora_dropout != 0.0 || lc.use_dora || lc.lora_bias {
            bail!(
                "{}: model.target_parameters cannot be used with model.lora_dropout other than \
                 0, model.use_dora or model.lora_bias (PEFT refuses them on parameters too)",
                cfg.origin
            );
        }
        lc.target_parameters = target_parameters;
    }
    lc.base_model_name_or_path = Some(base_path.display().to_string());
    Ok(lc)
}

/// The LR schedule of `lr_scheduler` over `total_steps` optimizer steps (null = constant).
pub fn schedule(cfg: &Config, total_steps: usize) -> Result<LrSchedule> {
    let Some(component) = cfg.str("lr_scheduler._component_")? else {
        if cfg.get("lr_scheduler").is_some() {
            bail!("{}: lr_scheduler._component_ is required", cfg.origin);
        }
        return Ok(LrSchedule::Constant);
    };
    let warmup = cfg.usize("lr_scheduler.num_warmup_steps")?.unwrap_or(0);
    let total = cfg
        .usize("lr_scheduler.num_training_steps")?
        .unwrap_or(total_steps);
    Ok(match component.rsplit('.').next().unwrap_or("") {
        "get_cosine_schedule_with_warmup" => LrSchedule::Cosine {
            warmup,
            total,
            num_cycles: cfg.f64("lr_scheduler.num_cycles")?.unwrap_or(0.5),
        },
        "get_linear_schedule_with_warmup" => LrSchedule::Linear { warmup, total },
        "get_constant_schedule_with_warmup" => LrSchedule::ConstantWithWarmup { warmup },
        "get_constant_schedule" => LrSchedule::Constant,
        _ => bail!(
            "{}: lr_scheduler._component_ '{component}' is not supported \
             (torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup, \
             get_linear_schedule_with_warmup, get_constant_schedule_with_warmup, or null)",
            cfg.origin
        ),
    })
}

/// `loss._component_`: the cross-entropy variants torchtune ships all compute the same mean
/// over target tokens; anything else is refused rather than silently replaced.
pub fn check_loss(cfg: &Config) -> Result<()> {
    let Some(c) = cfg.str("loss._component_")? else {
        return Ok(());
    };
    let name = c.rsplit('.').next().unwrap_or("");
    match name {
        "CrossEntropyLoss" | "CEWithChunkedOutputLoss" | "LinearCrossEntropyLoss" => Ok(()),
        "DPOLoss" | "RSOLoss" | "ORPOLoss" | "SimPOLoss" | "CPOLoss" | "IPOLoss" | "KTOLoss" => {
            bail!(
                "{}: loss._component_ '{c}' is a preference loss: it trains with the DPO recipes \
             (lora_dpo_single_device, lora_dpo_distributed, full_dpo_distributed)",
                cfg.origin
            )
        }
        _ => bail!(
            "{}: loss._component_ '{c}' is not supported (torch.nn.CrossEntropyLoss, \
             torchtune.modules.loss.CEWithChunkedOutputLoss or LinearCrossEntropyLoss)",
            cfg.origin
        ),
    }
}

/// The DPO recipes' `loss` section: `torchtune.rlhf.loss.DPOLoss` (the default; `beta`,
/// `label_smoothing`), `RSOLoss` (`gamma`), or TRL's `ORPOLoss` (`beta`), `SimPOLoss` (`beta`,
/// `simpo_gamma`, `label_smoothing`, `cpo_alpha`), `CPOLoss` (`beta`, `label_smoothing`,
/// `cpo_alpha`), `IPOLoss` (`beta`), `KTOLoss` ([`crate::kto::kto_loss`]). A key the chosen loss
/// does not take is an error.
pub fn preference_loss(cfg: &Config) -> Result<crate::loss::PreferenceLoss> {
    if let Some(kto) = crate::kto::kto_loss(cfg)? {
        return Ok(crate::loss::PreferenceLoss::Kto(kto));
    }
    let component = cfg
        .str("loss._component_")?
        .unwrap_or_else(|| "torchtune.rlhf.loss.DPOLoss".into());
    let smoothing = cfg.fraction("loss.label_smoothing")?;
    let loss = crate::loss::PreferenceLoss::from_component(
        &component,
        cfg.f64("loss.beta")?,
        smoothing,
        cfg.f64("loss.gamma")?,
    )
    .ok_or_else(|| {
        anyhow!(
            "{}: loss._component_ '{component}' is not a preference loss the DPO recipes \
             support (torchtune.rlhf.loss.DPOLoss, RSOLoss, ORPOLoss, SimPOLoss, CPOLoss, \
             IPOLoss or KTOLoss)",
            cfg.origin
        )
    })?;
    for key in [
        "beta",
        "label_smoothing",
        "gamma",
        "simpo_gamma",
        "cpo_alpha",
    ] {
        if cfg.get(&format!("loss.{key}")).is_some() && !loss.params().contains(&key) {
            bail!(
                "{}: loss.{key} is not a parameter of {component} (it takes {})",
                cfg.origin,
                loss.params().join(", ")
            );
        }
    }
    // SimPO and IPO divide by β.
    let divides = matches!(
        loss,
        crate::loss::PreferenceLoss::Simpo { .. } | crate::loss::PreferenceLoss::Ipo { .. }
    );
    if divides
        && cfg
            .f64("loss.beta")?
            .is_some_and(|b| b <= 0.0 || b.is_nan())
    {
        bail!("{}: loss.beta must be positive for {component}", cfg.origin);
    }
    Ok(loss.with_trl_params(cfg.f64("loss.simpo_gamma")?, cfg.f64("loss.cpo_alpha")?))
}

/// The QAT recipes' `quantizer` section: torchtune's `Int8DynActInt4WeightQATQuantizer` (or its
/// `ModuleSwap` form), whose `groupsize` (default 256) is returned.
pub fn qat_group_size(cfg: &Config) -> Result<usize> {
    let component = cfg.str("quantizer._component_")?.ok_or_else(|| {
        anyhow!(
            "{}: the QAT recipes need 'quantizer' (torchtune.training.quantization.\
             Int8DynActInt4WeightQATQuantizer)",
            cfg.origin
        )
    })?;
    match component.rsplit('.').next().unwrap_or("") {
        "Int8DynActInt4WeightQATQuantizer" | "Int8DynActInt4WeightQATQuantizerModuleSwap" => {}
        _ => bail!(
            "{}: quantizer._component_ '{component}' is not supported (Int8DynActInt4WeightQATQuantizer)",
            cfg.origin
        ),
    }
    match cfg.usize("quantizer.groupsize")? {
        Some(g) if g < 2 => bail!("{}: quantizer.groupsize must be at least 2", cfg.origin),
        Some(g) => Ok(g),
        None => Ok(256),
    }
}

/// The `dataset` section with `tokenizer.max_seq_len` applied where a dataset sets none, for a
/// model of `positions` positions (`ModelConfig::position_limit`: longer rows that no
/// `max_seq_len` cuts are refused, naming the file and row).
pub fn dataset(
    cfg: &Config,
    tok: &Tokenizer,
    positions: Option<usize>,
) -> Result<ferrotune_data::dataset::Dataset> {
    dataset_at(cfg, tok, "dataset", positions)
}

/// The DPO recipes' `dataset` section as preference pairs tokenized as `how` (the loss picks it),
/// `tokenizer.max_seq_len` applied as
/// for [`dataset`].
pub fn preference_dataset(
    cfg: &Config,
    tok: &Tokenizer,
    positions: Option<usize>,
    how: ferrotune_data::dataset::PairTokenization,
) -> Result<Vec<ferrotune_data::dataset::PreferencePair>> {
    let section = dataset_section(cfg, "dataset")?;
    ferrotune_data::dataset::build_preference_dataset_as(
        &section,
        tok,
        Path::new("."),
        positions,
        how,
    )
    .with_context(|| format!("{}: dataset", cfg.origin))
}

/// The dataset described by section `key` (`dataset`, or `dataset_val` for validation).
pub fn dataset_at(
    cfg: &Config,
    tok: &Tokenizer,
    key: &str,
    positions: Option<usize>,
) -> Result<ferrotune_data::dataset::Dataset> {
    let section = dataset_section(cfg, key)?;
    ferrotune_data::dataset::build_dataset_within(&section, tok, Path::new("."), positions)
        .with_context(|| format!("{}: {key}", cfg.origin))
}

/// Dataset section `key` with `tokenizer.max_seq_len` filled in where a dataset sets none.
pub(crate) fn dataset_section(cfg: &Config, key: &str) -> Result<serde_json::Value> {
    let mut section = cfg
        .get(key)
        .cloned()
        .ok_or_else(|| anyhow!("{}: '{key}' is required", cfg.origin))?;
    if let Some(max) = cfg.usize("tokenizer.max_seq_len")? {
        let fill = |v: &mut serde_json::Value| {
            if let Some(m) = v.as_object_mut() {
                if m.get("max_seq_len").is_none_or(|x| x.is_null()) {
                    m.insert("max_seq_len".into(), serde_json::json!(max));
                }
            }
        };
        match &mut section {
            serde_json::Value::Array(items) => items.iter_mut().for_each(fill),
            other => fill(other),
        }
    }
    Ok(section)
}

/// torchtune's warning when the tokenizer's EOS does not end a generated response.
pub fn warn_if_eos_does_not_stop(tok: &Tokenizer, stop_token_ids: &[u32]) {
    if let Some(eos) = tok.eos_ids().first() {
        if !stop_token_ids.contains(eos) {
            eprintln!(
                "warning: tokenizer eos_id ({eos}) is not in stop_token_ids ({stop_token_ids:?})"
            );
        }
    }
}

/// The seed: `seed`, or a fresh one (torchtune picks a random seed for `seed: null`).
pub fn seed(cfg: &Config) -> Result<u64> {
    Ok(match cfg.usize("seed")? {
        Some(s) => s as u64,
        None => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64 & 0xFFFF_FFFF)
            .unwrap_or(0),
    })
}

/// What `ferrotune validate` checks beyond keys and types for every recipe, as torchtune's
/// `tune validate` resolves each `_component_`: the device's and dtype's names, `fsdp_sharding`,
/// the optimizer, LR schedule, metric logger and dataset components with their settings (a
/// recipe's own settings, its loss among them, are its registry entry's `check`). Nothing is
/// read or created; each problem is one message, as a run would give it.
pub fn check_components(cfg: &Config) -> Vec<String> {
    let mut problems = Vec::new();
    let mut note = |r: Result<()>| {
        if let Err(e) = r {
            problems.push(e.to_string());
        }
    };
    note(check_device_name(cfg));
    note(dtype(cfg).map(|_| ()));
    note(sharding(cfg).map(|_| ()));
    if cfg.get("optimizer").is_some_and(|v| !v.is_null()) {
        note(optimizer(cfg, Vec::new()).map(|_| ()));
    }
    note(schedule(cfg, 1).map(|_| ()));
    note(
        crate::metrics::check_logger_config(cfg.get("metric_logger"))
            .map_err(|e| anyhow!("{}: {e}", cfg.origin)),
    );
    for key in ["dataset", "dataset_val"] {
        let section = cfg.get(key).filter(|v| !v.is_null());
        // KTO's unpaired rows are the kit's builder, not the data crate's.
        if let Some(section) = section.filter(|s| !crate::recipe::kit::unpaired::named(s)) {
            note(
                ferrotune_data::dataset::check_section(section)
                    .map_err(|e| anyhow!("{}: {key}: {e}", cfg.origin)),
            );
        }
    }
    problems
}

/// `device` is `cpu`, `cuda` or `cuda:N` (whether this machine has that GPU is for a run to find).
fn check_device_name(cfg: &Config) -> Result<()> {
    if let Some(name) = cfg.str("device")? {
        ferrotune_core::parse_device_name(&name)
            .map_err(|e| anyhow!("{}: 'device': {e}", cfg.origin))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests;
