//! The fine-tuning recipes' settings, read from the config once, before anything is loaded:
//! every key the recipes and their trainer read themselves, typed and checked with the messages
//! a run gives (what `validate` checks too).

use std::path::PathBuf;

use anyhow::{anyhow, bail, Result};

use crate::config::Config;
use crate::loss::PreferenceLoss;
use crate::recipe::kit::model::KdSettings;
use crate::recipe::setup::LayerSkipSettings;
use crate::recipe::Recipe;

/// Which weights a fine-tuning recipe trains, and against what: what its settings and the
/// trainer's shared steps depend on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// LoRA/DoRA adapters on a frozen base.
    Lora,
    /// Every weight.
    Full,
    /// LoRA adapters trained against a frozen teacher's outputs as well as the labels
    /// (torchtune's `knowledge_distillation_*`).
    Distill,
    /// LoRA adapters trained on preference pairs by DPO, the reference being the model with its
    /// adapters disabled (torchtune's `lora_dpo_*`).
    Dpo,
    /// Every weight trained by DPO against a frozen reference model (`full_dpo_distributed`).
    FullDpo,
    /// Every weight trained through fake-quantized linear layers (`qat_distributed`).
    Qat,
    /// LoRA adapters on fake-quantized base layers (`qat_lora_finetune_distributed`).
    QatLora,
    /// Every weight, with LayerSkip's early-exit loss and layer dropout
    /// (`dev/early_exit_finetune_distributed`, see [`crate::early_exit`]).
    EarlyExit,
    /// LoRA adapters and the `score` head of a sequence classifier trained as a reward model on
    /// preference pairs (TRL's `RewardTrainer` with PEFT's `SEQ_CLS` task).
    RewardModel,
    /// Every weight of a sequence classifier trained as a reward model.
    FullRewardModel,
}

impl Mode {
    /// Whether every weight trains (otherwise LoRA adapters on a frozen base).
    pub fn full(self) -> bool {
        matches!(
            self,
            Mode::Full | Mode::FullDpo | Mode::Qat | Mode::EarlyExit | Mode::FullRewardModel
        )
    }

    /// Whether a reward model (a sequence classifier) trains on preference pairs.
    pub fn reward_model(self) -> bool {
        matches!(self, Mode::RewardModel | Mode::FullRewardModel)
    }

    /// Whether linear layers train fake-quantized (torchtune's QAT recipes).
    pub fn qat(self) -> bool {
        matches!(self, Mode::Qat | Mode::QatLora)
    }

    /// Whether the data are preference pairs and the loss a preference loss.
    pub fn preference(self) -> bool {
        matches!(self, Mode::Dpo | Mode::FullDpo)
    }

    /// The mode of fine-tuning recipe `recipe`.
    pub fn of(recipe: &Recipe) -> Result<Mode> {
        recipe
            .mode
            .ok_or_else(|| anyhow!("{} is not a fine-tuning recipe", recipe.name))
    }
}

/// Checks a config for fine-tuning recipe `recipe` without loading anything: its [`Settings`]
/// read as its `run` reads them (`validate`'s check of every fine-tuning recipe).
pub fn check(recipe: &Recipe, cfg: &Config) -> Result<()> {
    Settings::parse(cfg, Mode::of(recipe)?).map(|_| ())
}

/// torchtune speed/memory switches that change no number: accepted, and said to be ignored.
const IGNORED_SWITCHES: [&str; 4] = [
    "compile",
    "optimizer_in_bwd",
    "enable_activation_offloading",
    "low_cpu_ram",
];

/// The settings of a fine-tuning run (torchtune's top-level keys, and `checkpointer`'s).
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// `output_dir`: logs, the config copy, and checkpoints unless `checkpointer.output_dir`.
    pub output_dir: PathBuf,
    /// Where checkpoints go (`checkpointer.output_dir`, else `output_dir`).
    pub checkpoint_dir: PathBuf,
    /// `resume_from_checkpoint`.
    pub resume: bool,
    /// `overwrite_output_dir`: a fresh run deletes an earlier run's checkpoints instead of
    /// refusing to mix with them.
    pub overwrite: bool,
    /// The metrics log (`metric_logger`'s JSONL file), which a fresh run must find empty.
    pub metrics_file: Option<PathBuf>,
    /// `checkpointer.recipe_checkpoint`: the checkpoint to resume (else the latest).
    pub recipe_checkpoint: Option<PathBuf>,
    /// Rows per micro-batch on each rank.
    pub batch_size: usize,
    pub epochs: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    pub max_steps_per_epoch: Option<usize>,
    /// `clip_grad_norm`: the largest gradient norm, if clipped.
    pub clip: Option<f64>,
    /// `enable_activation_checkpointing`.
    pub checkpointing: bool,
    /// `log_every_n_steps` (at least 1).
    pub log_every: usize,
    /// `log_peak_memory_stats`.
    pub log_memory: bool,
    /// `save_every_n_steps` (none for 0).
    pub save_every: Option<usize>,
    /// `save_adapter_weights_only`.
    pub adapter_only: bool,
    /// `checkpointer.keep_last_n_checkpoints`.
    pub keep_last: Option<usize>,
    /// `shuffle` (default true).
    pub shuffle: bool,
    /// `fsdp_cpu_offload` (or `fsdp.cpu_offload`, the spelling of torchtune's distributed QLoRA
    /// configs): the optimizer state kept on the CPU.
    pub offload: bool,
    /// `dist_watchdog_timeout` (or `FERROTUNE_DIST_WATCHDOG`, default 60 s): how long a rank may
    /// send no heartbeat before the others stop.
    pub dist_watchdog: std::time::Duration,
    /// `tensor_parallel_dim` as given (only 1 runs).
    pub tensor_parallel_dim: Option<usize>,
    /// The switches of [`IGNORED_SWITCHES`] the config turns on.
    pub ignored_switches: Vec<&'static str>,
    /// The DPO recipes' loss.
    pub preference_loss: Option<PreferenceLoss>,
    /// Validation every `run_val_every_n_steps` optimizer steps with `batch_size_val` rows.
    pub validation: Option<Validation>,
    /// `fake_quant_after_n_steps` (`qat_distributed`).
    pub fake_quant_after: Option<usize>,
    /// `early_exit_loss.verbose`.
    pub verbose_exits: bool,
    /// The distillation recipes' `kd_ratio` and `kd_loss`.
    pub kd: Option<KdSettings>,
    /// The QAT recipes' `quantizer.groupsize`.
    pub qat_group_size: Option<usize>,
    /// A `quantizer` section given to a recipe other than the QAT ones (which says it is unused).
    pub quantizer_unused: bool,
    /// `model.quantize_base` (or a `qlora_*` builder): the frozen base quantized to NF4.
    pub quantize_base: bool,
    /// The early-exit recipe's `early_exit_loss` and `layer_dropout`.
    pub layer_skip: Option<LayerSkipSettings>,
    /// The reward-model recipes' `center_rewards_coefficient` (TRL's).
    pub center_rewards: Option<f64>,
}

/// When and how `dataset_val` is scored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validation {
    /// `run_val_every_n_steps`.
    pub every: usize,
    /// `batch_size_val` (default `batch_size`, at least 1).
    pub batch_size: usize,
}

impl Settings {
    /// Reads and checks the settings of recipe mode `mode` from `cfg`.
    pub fn parse(cfg: &Config, mode: Mode) -> Result<Settings> {
        let o = &cfg.origin;
        let offload = match cfg.bool("fsdp_cpu_offload")? {
            Some(o) => o,
            None => cfg.bool("fsdp.cpu_offload")?.unwrap_or(false),
        };
        let preference_loss = if mode.preference() {
            Some(crate::recipe::setup::preference_loss(cfg)?)
        } else if mode.reward_model() {
            if let Some(c) = cfg.str("loss._component_")? {
                bail!(
                    "{o}: loss._component_ '{c}': the reward-model recipes train with TRL's \
                     RewardTrainer loss (-log σ(r_chosen − r_rejected − margin)); leave `loss` \
                     out (center_rewards_coefficient adds TRL's centering term)"
                );
            }
            None
        } else {
            crate::recipe::setup::check_loss(cfg)?;
            None
        };
        let mut ignored_switches = Vec::new();
        for ignored in IGNORED_SWITCHES {
            if cfg.bool(ignored)?.unwrap_or(false) {
                ignored_switches.push(ignored);
            }
        }
        let tensor_parallel_dim = cfg.usize("tensor_parallel_dim")?;
        let dist_watchdog = crate::recipe::setup::dist_watchdog(cfg)?;
        let (output_dir, checkpoint_dir) = crate::recipe::state::output_dirs(cfg)?;
        let resume = cfg.bool("resume_from_checkpoint")?.unwrap_or(false);
        let overwrite = cfg.bool("overwrite_output_dir")?.unwrap_or(false);
        let metrics_file = crate::recipe::state::metrics_file(cfg, &output_dir)?;
        let batch_size = cfg.usize("batch_size")?.unwrap_or(1);
        let epochs = cfg.usize("epochs")?.unwrap_or(1);
        let grad_accum = cfg.usize("gradient_accumulation_steps")?.unwrap_or(1);
        if batch_size == 0 || grad_accum == 0 {
            bail!("{o}: batch_size and gradient_accumulation_steps must be at least 1");
        }
        let max_steps_per_epoch = cfg.usize("max_steps_per_epoch")?;
        let clip = cfg.f64("clip_grad_norm")?;
        let checkpointing = cfg
            .bool("enable_activation_checkpointing")?
            .unwrap_or(false);
        let log_every = cfg.usize("log_every_n_steps")?.unwrap_or(1).max(1);
        let log_memory = cfg.bool("log_peak_memory_stats")?.unwrap_or(false);
        let save_every = cfg.usize("save_every_n_steps")?.filter(|&n| n > 0);
        let adapter_only = cfg.bool("save_adapter_weights_only")?.unwrap_or(false);
        let recipe_checkpoint = match resume {
            true => cfg.path("checkpointer.recipe_checkpoint")?,
            false => None,
        };
        let fake_quant_after = match mode {
            Mode::Qat => cfg.usize("fake_quant_after_n_steps")?,
            _ => None,
        };
        // Validation every `run_val_every_n_steps` optimizer steps on `dataset_val` (torchtune's
        // keys).
        let validation = match cfg.usize("run_val_every_n_steps")?.filter(|&n| n > 0) {
            None => None,
            Some(_) if mode.reward_model() => bail!(
                "{o}: run_val_every_n_steps: the reward-model recipes have no validation loop"
            ),
            Some(_) if mode.preference() => bail!(
                "{o}: run_val_every_n_steps: the DPO recipes have no validation loop (torchtune's \
                 neither)"
            ),
            Some(every) => {
                if cfg.get("dataset_val").is_none_or(|v| v.is_null()) {
                    bail!("{o}: run_val_every_n_steps is set but dataset_val is not configured");
                }
                let batch_size = cfg.usize("batch_size_val")?.unwrap_or(batch_size).max(1);
                Some(Validation { every, batch_size })
            }
        };
        let verbose_exits = cfg.bool("early_exit_loss.verbose")?.unwrap_or(false);
        let keep_last = match cfg.usize("checkpointer.keep_last_n_checkpoints")? {
            Some(0) => bail!("{o}: checkpointer.keep_last_n_checkpoints must be at least 1"),
            n => n,
        };
        let shuffle = cfg.bool("shuffle")?.unwrap_or(true);
        let kd = match mode {
            Mode::Distill => Some(KdSettings::parse(cfg)?),
            _ => None,
        };
        let qat_group_size = match mode.qat() {
            true => Some(crate::recipe::setup::qat_group_size(cfg)?),
            false => None,
        };
        let quantizer_unused = !mode.qat() && cfg.get("quantizer").is_some_and(|v| !v.is_null());
        let quantize_base = crate::recipe::setup::quantize_base(cfg)?;
        let layer_skip = match mode {
            Mode::EarlyExit => Some(LayerSkipSettings::parse(cfg)?),
            _ => None,
        };
        let center_rewards = match mode.reward_model() {
            true => cfg.f64("center_rewards_coefficient")?,
            false => None,
        };
        Ok(Settings {
            center_rewards,
            output_dir,
            checkpoint_dir,
            resume,
            overwrite,
            metrics_file,
            recipe_checkpoint,
            batch_size,
            epochs,
            grad_accum,
            max_steps_per_epoch,
            clip,
            checkpointing,
            log_every,
            log_memory,
            save_every,
            adapter_only,
            keep_last,
            shuffle,
            offload,
            dist_watchdog,
            tensor_parallel_dim,
            ignored_switches,
            preference_loss,
            validation,
            fake_quant_after,
            verbose_exits,
            kd,
            qat_group_size,
            quantizer_unused,
            quantize_base,
            layer_skip,
        })
    }
}
