//! Model setup the training recipes share beyond loading: LoRA adapters (fresh, from a PEFT
//! folder, or resumed), QAT's fake quantization, a distillation teacher and a DPO reference; and
//! what the inference recipes load.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device};
use ferrotune_infer::LoadOptions;
use ferrotune_models::peft::{self, LoraConfig};
use ferrotune_models::CausalLm;

use crate::config::Config;
use crate::dist::fsdp::ShardedModel;
use crate::loss::KdLoss;
use crate::recipe::setup;
use crate::recipe::state::SavedCheckpoint;
use crate::step::{reference_log_probs, reference_log_probs_at, Distill, MicroBatch};

/// The LoRA adapters to train: from `checkpointer.adapter_checkpoint` (a PEFT folder, whose config
/// wins), from a checkpoint being resumed, or fresh from the model keys.
pub fn setup_adapters(
    cfg: &Config,
    model: &mut CausalLm,
    base_path: &Path,
    resumed: Option<&SavedCheckpoint>,
    seed: u64,
    lead: bool,
) -> Result<LoraConfig> {
    if let Some(saved) = resumed {
        let lc = peft::load_adapter(model, &saved.dir)?;
        return Ok(lc);
    }
    if let Some(path) = cfg.path("checkpointer.adapter_checkpoint")? {
        let dir = if path.is_file() {
            path.parent().map(Path::to_path_buf).unwrap_or_default()
        } else {
            path.clone()
        };
        // torchtune's own adapter_model.pt may have no adapter_config.json beside it (Phi-3).
        if dir.join(peft::ADAPTER_CONFIG_FILE).is_file() {
            let saved = peft::LoraConfig::read(&dir)
                .with_context(|| format!("{}: checkpointer.adapter_checkpoint", cfg.origin))?;
            // Trainable token rows would need their own trainable parameters beside the
            // adapters, and adapters on fused parameters their own layout.
            let what = if !saved.trainable_token_indices.is_empty() {
                Some(format!(
                    "trainable_token_indices {:?}",
                    saved.trainable_token_indices
                ))
            } else if !saved.target_parameters.is_empty() && model.config.gpt_oss_moe.is_none() {
                // gpt-oss's expert adapters are held as PEFT holds them, and train so.
                // PEFT's expert adapters share A between the gate and up projections.
                Some(format!("target_parameters {:?}", saved.target_parameters))
            } else {
                None
            };
            if let Some(what) = what {
                bail!(
                    "{}: checkpointer.adapter_checkpoint {} has {what}: training them further \
                     is not supported; `ferrotune merge` it into the base and train the merged \
                     model",
                    cfg.origin,
                    dir.display()
                );
            }
        }
        let mut lc = peft::load_adapter_from(model, &path, cfg.f64("model.lora_alpha")?)
            .with_context(|| format!("{}: checkpointer.adapter_checkpoint", cfg.origin))?;
        if lc.base_model_name_or_path.is_none() {
            lc.base_model_name_or_path = Some(base_path.display().to_string());
        }
        if lead {
            eprintln!("Adapter loaded from {}", dir.display());
        }
        return Ok(lc);
    }
    let lc = setup::lora_config(cfg, model, base_path)?;
    let n = peft::add_adapter(model, &lc, seed)?;
    if lead {
        eprintln!("LoRA r={} alpha={} on {n} modules", lc.r, lc.lora_alpha);
    }
    Ok(lc)
}

/// Puts torchao's `Int8DynActInt4WeightQATQuantizer` on `model`'s linear layers, as torchtune's
/// QAT recipes prepare the model: `qat_distributed` every linear layer whose input count is a
/// multiple of the group size (the output head too, unless tied to the embedding; others are
/// left as they are, as torchao skips them); `qat_lora_finetune_distributed` the layers with an
/// adapter (`adapters_only`; each must divide, as torchtune's `QATLoRALinear` requires; DoRA is
/// refused). Returns how many layers.
pub fn apply_fake_quant(
    cfg: &Config,
    model: &mut CausalLm,
    adapters_only: bool,
    group_size: usize,
) -> Result<usize> {
    let tied = model.config.tie_word_embeddings;
    let mut n = 0;
    for (name, linear) in model.linears_mut() {
        let inputs = linear.weight.dims2()?.1;
        if adapters_only {
            let Some(adapter) = &linear.adapter else {
                continue;
            };
            if adapter.dora_magnitude.is_some() {
                bail!(
                    "{}: QAT is not compatible with DoRA (torchtune's neither)",
                    cfg.origin
                );
            }
            if inputs % group_size != 0 {
                bail!(
                    "{}: {name} has {inputs} inputs, not a multiple of quantizer.groupsize \
                     {group_size}",
                    cfg.origin
                );
            }
        } else if inputs % group_size != 0 || (name == "lm_head" && tied) {
            continue;
        }
        linear.fake_quant = Some(ferrotune_models::FakeQuant {
            group_size,
            enabled: true,
            quantize_weight: true,
        });
        n += 1;
    }
    Ok(n)
}

/// Switches the fake quantization of every prepared layer on or off.
pub fn set_fake_quant_enabled(model: &mut CausalLm, enabled: bool) {
    for (_, linear) in model.linears_mut() {
        if let Some(fq) = &mut linear.fake_quant {
            fq.enabled = enabled;
        }
    }
}

/// The frozen teacher of a distillation run and how its loss mixes in.
pub struct Teacher {
    /// The teacher, frozen.
    pub model: Arc<CausalLm>,
    /// `kd_ratio`: the distillation loss's share of the total.
    pub ratio: f64,
    /// `kd_loss`: which KL divergence.
    pub loss: KdLoss,
    /// `kd_loss.num_output_chunks`.
    pub chunks: usize,
}

impl Teacher {
    /// What a micro-batch needs to distill from this teacher: its hidden states for the batch's
    /// tokens (outside autograd: it has no Vars; the head forms its logits chunk by chunk).
    pub fn distill(&self, batch: &MicroBatch) -> Result<Distill> {
        let teacher_hidden = self
            .model
            .forward_hidden(&batch.input_ids, &batch.layout, None)?;
        Ok(Distill {
            teacher: self.model.clone(),
            teacher_hidden,
            ratio: self.ratio,
            loss: self.loss,
            chunks: self.chunks,
        })
    }
}

/// DPO's reference log probabilities of `batch`'s pairs (no gradient): the frozen `reference`
/// model's, or (LoRA) `model`'s with its adapters disabled — when `sharded`, gathered one unit
/// at a time.
pub fn reference_logps(
    reference: Option<&CausalLm>,
    model: &mut CausalLm,
    sharded: Option<&mut ShardedModel>,
    batch: &MicroBatch,
) -> Result<Vec<f32>> {
    Ok(match (reference, sharded) {
        (Some(r), _) => reference_log_probs(r, batch)?,
        (None, Some(sm)) => {
            let labels = batch.labels.clone();
            sm.inference_pass(model, &batch.input_ids, &batch.layout, true, |m, hidden| {
                Ok(reference_log_probs_at(hidden, m, &labels)?)
            })?
        }
        (None, None) => peft::with_adapters_disabled(model, |m| reference_log_probs(m, batch))?,
    })
}

/// KTO's KL estimate on a micro-batch's KL rows (TRL's): the mean of the policy's summed
/// completion log probabilities (no gradient) minus the reference's ([`reference_logps`]);
/// when `sharded`, both passes gather one unit at a time and the mean is averaged over the ranks
/// (TRL's `gather_for_metrics(kl).mean()`). Clamped at 0.
pub fn kto_kl(
    reference: Option<&CausalLm>,
    model: &mut CausalLm,
    mut sharded: Option<&mut ShardedModel>,
    kl_rows: &MicroBatch,
) -> Result<f64> {
    let policy = match sharded.as_deref_mut() {
        Some(sm) => {
            let labels = kl_rows.labels.clone();
            sm.inference_pass(model, &kl_rows.input_ids, &kl_rows.layout, false, |m, h| {
                Ok(reference_log_probs_at(h, m, &labels)?)
            })?
        }
        None => reference_log_probs(model, kl_rows)?,
    };
    let reference = reference_logps(reference, model, sharded.as_deref_mut(), kl_rows)?;
    let mut mean = crate::kto::kl_mean(&policy, &reference)?;
    if let Some(sm) = sharded {
        mean = sm.all_reduce_f64(&[mean])?[0] / sm.queue().world_size() as f64;
    }
    Ok(crate::kto::kl_clamped(mean))
}

/// How a distillation run's loss mixes in the teacher: `kd_ratio` and the `kd_loss` section.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KdSettings {
    /// `kd_ratio`: the distillation loss's share of the total.
    pub ratio: f64,
    /// `kd_loss`: which KL divergence.
    pub loss: KdLoss,
    /// `kd_loss.num_output_chunks`.
    pub chunks: usize,
}

impl KdSettings {
    /// Reads and checks `kd_ratio` and `kd_loss` (torchtune's defaults: 0.5, the forward KL in
    /// 8 chunks).
    pub fn parse(cfg: &Config) -> Result<KdSettings> {
        let ratio = cfg.f64("kd_ratio")?.unwrap_or(0.5);
        if !(0.0..=1.0).contains(&ratio) {
            bail!("{}: kd_ratio must be in [0, 1], got {ratio}", cfg.origin);
        }
        let component = cfg
            .str("kd_loss._component_")?
            .unwrap_or_else(|| "torchtune.modules.loss.ForwardKLWithChunkedOutputLoss".into());
        let sym = cfg.f64("kd_loss.sym_kd_ratio")?;
        if sym.is_some_and(|r| !(0.0..=1.0).contains(&r)) {
            bail!("{}: kd_loss.sym_kd_ratio must be in [0, 1]", cfg.origin);
        }
        // torchtune's chunked losses default to 8 chunks; the plain ones form every row at once
        // (here still at most MAX_CHUNK_LOGITS logits per chunk).
        let chunks = match cfg.usize("kd_loss.num_output_chunks")? {
            Some(0) => bail!(
                "{}: kd_loss.num_output_chunks must be at least 1",
                cfg.origin
            ),
            Some(n) => n,
            None if component.contains("WithChunkedOutput") => 8,
            None => 1,
        };
        let Some(loss) = KdLoss::from_component(&component, sym) else {
            bail!(
                "{}: kd_loss._component_ '{component}' is not supported (torchtune.modules.loss.\
                 ForwardKLLoss, ReverseKLLoss, SymmetricKLLoss, or their WithChunkedOutput forms)",
                cfg.origin
            );
        };
        Ok(KdSettings {
            ratio,
            loss,
            chunks,
        })
    }
}

/// Loads the language model at `location` (of checkpointer section `section`) to run frozen, in
/// `dtype` on `device`.
fn load_frozen(
    cfg: &Config,
    location: &setup::CheckpointLocation,
    section: &str,
    dtype: DType,
    device: &candle_core::Device,
) -> Result<CausalLm> {
    let (model, _) = location
        .load(dtype, device)
        .with_context(|| format!("{}: {section}", cfg.origin))?;
    model
        .config
        .require_language_model()
        .map_err(|e| anyhow!("{}: {section}: {e}", cfg.origin))?;
    Ok(model)
}

/// Loads `teacher_checkpointer`'s model (frozen, in the run's dtype, on the student's device),
/// to mix in as `kd` says. The two models must share the vocabulary.
pub fn setup_teacher(
    cfg: &Config,
    kd: KdSettings,
    student: &CausalLm,
    dtype: DType,
    device: &candle_core::Device,
    lead: bool,
) -> Result<Teacher> {
    let location = setup::checkpoint_path_at(cfg, "teacher_checkpointer")?;
    let path = location.path.clone();
    let t0 = Instant::now();
    let model = load_frozen(cfg, &location, "teacher_checkpointer", dtype, device)?;
    setup::check_component_at(cfg, "teacher_model._component_", &model.config)?;
    if model.config.vocab_size != student.config.vocab_size {
        bail!(
            "{}: the teacher ({}) has a vocabulary of {} tokens, the student {}: distillation \
             compares their distributions over one vocabulary",
            cfg.origin,
            path.display(),
            model.config.vocab_size,
            student.config.vocab_size
        );
    }
    let KdSettings {
        ratio,
        loss,
        chunks,
    } = kd;
    if lead {
        eprintln!(
            "Teacher {} ({}, {} layers) loaded in {:.1}s; kd_ratio {ratio}, {loss:?} KL",
            path.display(),
            model.config.model_type,
            model.config.num_hidden_layers,
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(Teacher {
        model: Arc::new(model),
        ratio,
        loss,
        chunks,
    })
}

/// `full_dpo_distributed`'s frozen reference model: `ref_checkpointer`'s (torchtune's key), else
/// the base checkpoint the policy starts from, in the run's dtype on its device.
pub fn setup_reference(
    cfg: &Config,
    policy: &CausalLm,
    base: &setup::CheckpointLocation,
    dtype: DType,
    device: &candle_core::Device,
    lead: bool,
) -> Result<CausalLm> {
    let location = if cfg.get("ref_checkpointer").is_some_and(|v| !v.is_null()) {
        setup::checkpoint_path_at(cfg, "ref_checkpointer")?
    } else {
        base.clone()
    };
    let path = location.path.clone();
    let t0 = Instant::now();
    let model = load_frozen(cfg, &location, "ref_checkpointer", dtype, device)?;
    if model.config.vocab_size != policy.config.vocab_size {
        bail!(
            "{}: the reference model ({}) has a vocabulary of {} tokens, the policy {}: DPO \
             compares their log probabilities of the same tokens",
            cfg.origin,
            path.display(),
            model.config.vocab_size,
            policy.config.vocab_size
        );
    }
    if lead {
        eprintln!(
            "Reference model {} loaded in {:.1}s",
            path.display(),
            t0.elapsed().as_secs_f64()
        );
    }
    Ok(model)
}

/// What the inference recipes (`generate`, `eval`, `eleuther_eval`) load: the checkpointer's
/// model in `dtype` on `device`, on the NF4 base for a QLoRA adapter (the config's builder says),
/// with `checkpointer.adapter_checkpoint` (and `model.lora_alpha`).
pub fn load_options(
    cfg: &Config,
    location: &setup::CheckpointLocation,
    dtype: DType,
    device: Device,
) -> Result<LoadOptions> {
    Ok(LoadOptions {
        files: location.files.clone(),
        dtype,
        device,
        quantize_base: setup::quantize_base(cfg)?,
        adapter: cfg.path("checkpointer.adapter_checkpoint")?,
        lora_alpha: cfg.f64("model.lora_alpha")?,
        device_map: None,
    })
}
