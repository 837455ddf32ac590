//! The fine-tuning recipes' trainer: what every one of them does around what it really does.
//!
//! A recipe reads as torchtune's: [`FineTune::start`] (the session, the settings, the ranks'
//! group, where to resume from, the seed, the tokenizer, the model), its own choice of what
//! trains ([`FineTune::adapters`] or [`Trainable::all`]) and of what else it loads (a teacher, a
//! reference model, fake quantization), [`FineTune::plan`] (sharding, data,
//! validation, the run's length and LR schedule), [`Plan::start`] (optimizer, resumed state, run
//! log), then [`Trainer::fit`]: the epochs' steps — micro-batches prepared by the recipe's
//! [`Hooks`], forward and backward, the step's sums over the ranks, normalise, clip, step, log,
//! validate — and the step and epoch checkpoints.

mod fit;
mod step;

use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::Var;
use ferrotune_data::Tokenizer;
use ferrotune_export::hf::ModelSource;
use ferrotune_models::peft::{self, LoraConfig};
use ferrotune_models::CausalLm;

use crate::config::Config;
use crate::dist::fsdp::{CommQueue, Sharding};
use crate::dist::Store;
use crate::recipe::kit::checkpoint::base_source;
use crate::recipe::kit::model::setup_adapters;
use crate::recipe::kit::report::note_ignored_keys;
use crate::recipe::kit::session::Session;
use crate::recipe::kit::settings::{Mode, Settings};
use crate::recipe::setup::{self, CheckpointLocation};
use crate::recipe::state::{self, SavedCheckpoint};
use crate::recipe::{Ranks, Recipe};

pub use fit::{At, Hooks, Plan, Trainer};
pub use step::{optimizer_step, reduce_step};

/// The ranks' group of a distributed run: the rendezvous store, the collectives' queue, how the
/// model is sharded and whether the optimizer state is offloaded.
struct Group {
    store: Store,
    queue: CommQueue,
    sharding: Sharding,
    offload: bool,
}

/// A fine-tuning run before its model is loaded.
pub struct FineTune {
    /// torchtune's name of the recipe.
    pub recipe: &'static str,
    /// What trains, and against what.
    pub mode: Mode,
    /// Whether it runs as one rank of torchrun's group (the `_distributed` recipes).
    pub distributed: bool,
    /// Rank, world, device, dtype.
    pub session: Session,
    /// The config's settings, read once.
    pub settings: Settings,
    group: Option<Group>,
    /// The checkpoint this run resumes from.
    pub saved: Option<SavedCheckpoint>,
    /// The run's seed (a resumed run's own).
    pub seed: u64,
    /// The configured base checkpoint.
    pub base: CheckpointLocation,
    /// The run's tokenizer.
    pub tokenizer: Tokenizer,
    /// The base's format and folder, which checkpoints copy their config, generation and
    /// tokenizer files from.
    pub source: ModelSource,
}

/// The parameters a recipe trains, and (LoRA) the adapters' settings.
pub struct Trainable {
    /// The trainable parameters by name.
    pub params: Vec<(String, Var)>,
    /// The LoRA settings when adapters train on a frozen base.
    pub adapters: Option<LoraConfig>,
}

impl Trainable {
    /// Every weight of `model`.
    pub fn all(model: &mut CausalLm) -> Result<Trainable> {
        Ok(Trainable {
            params: model.make_all_trainable()?,
            adapters: None,
        })
    }
}

impl FineTune {
    /// Starts fine-tuning recipe `entry`: on one device, or (its `_distributed` form) as one rank
    /// of the group that torchrun's environment variables describe (world size 1 without them);
    /// and loads the model to train.
    pub fn start(entry: &Recipe, cfg: &Config) -> Result<(FineTune, CausalLm)> {
        let (recipe, mode) = (entry.name, Mode::of(entry)?);
        let distributed = entry.ranks == Ranks::Several;
        let session = Session::start(cfg, recipe, distributed)?;
        let (world, lead) = (session.world, session.lead());
        let settings = Settings::parse(cfg, mode)?;
        let offload = settings.offload;
        // A backend asked for by name (`FERROTUNE_DIST_BACKEND`) runs its collectives even for
        // one rank: how the NCCL path is checked on a single GPU.
        let backend_asked = ferrotune_core::switch::DIST_BACKEND.value_os().is_some();
        let group = if distributed && world == 1 && !offload && !backend_asked {
            // One rank has nothing to shard or reduce: it takes the single-device path (the same
            // numbers), which keeps no flat copies of the parameters and gradients.
            setup::sharding(cfg)?;
            None
        } else if distributed {
            let sharding = setup::sharding(cfg)?;
            let (store, collectives) =
                crate::dist::join_group(&session.env, &session.device, settings.dist_watchdog)?;
            if lead {
                // Offloading moves the shards and the optimizer state off the device: on a CPU
                // device, or unsharded, there is nothing to move, and the run says so.
                let offloaded = match (offload, sharding, session.device.is_cpu()) {
                    (false, ..) => "",
                    (true, Sharding::None, _) => {
                        ", fsdp_cpu_offload: nothing to offload under fsdp_sharding: none \
                         (the optimizer state stays on the device)"
                    }
                    (true, _, true) => {
                        ", fsdp_cpu_offload: the device is the CPU, where the shards and the \
                         optimizer state are already"
                    }
                    (true, _, false) => ", optimizer state offloaded to the CPU",
                };
                eprintln!(
                    "Distributed: {world} ranks, {} backend, fsdp_sharding: {}{offloaded}",
                    collectives.backend(),
                    sharding.name(),
                );
            }
            let queue = CommQueue::start(collectives);
            Some(Group {
                store,
                queue,
                sharding,
                offload,
            })
        } else {
            if lead {
                let keys = [
                    "fsdp_sharding",
                    "fsdp_cpu_offload",
                    "fsdp",
                    "dist_watchdog_timeout",
                ];
                note_ignored_keys(cfg, &keys, "_distributed", recipe);
            }
            None
        };
        if lead {
            for ignored in &settings.ignored_switches {
                eprintln!("note: '{ignored}: true' is ignored by ferrotune (it changes no result)");
            }
        }
        // torchtune's 70B configs name a tensor-parallel plan with `tensor_parallel_dim: 1`,
        // which is no tensor parallelism; a larger dimension would change how rows are dealt to
        // ranks, so it is refused rather than run as something else.
        match settings.tensor_parallel_dim {
            None | Some(1) => {}
            Some(n) => bail!(
                "{}: tensor_parallel_dim: {n} is not supported (ferrotune has no tensor \
                 parallelism; its distributed recipes shard with fsdp_sharding): set it to 1",
                cfg.origin
            ),
        }
        // Where to start from: a saved checkpoint of this run, or the configured base.
        let saved = match settings.resume {
            true => {
                let asked = settings.recipe_checkpoint.as_deref();
                Some(state::resume_point(
                    &cfg.origin,
                    asked,
                    &settings.checkpoint_dir,
                )?)
            }
            false => {
                let s = &settings;
                let dirs = [s.checkpoint_dir.as_path(), s.output_dir.as_path()];
                let log = s.metrics_file.as_deref();
                state::claim_output(&cfg.origin, &dirs, log, s.overwrite, session.lead())?;
                None
            }
        };
        let seed = state::run_seed(cfg, saved.as_ref())?;
        let base = setup::checkpoint_path(cfg)?;
        let mut tokenizer = setup::tokenizer(cfg, &base.path)?;
        let (mut model, source) =
            load_model(cfg, mode, &session, &settings, &base, saved.as_ref())?;
        if mode.reward_model() {
            crate::recipe::kit::reward::classifier(&mut model, &tokenizer, seed, session.lead())?;
        }
        // Token ids past the model's embedding are errors while the data is read.
        tokenizer.feed_model(model.config.vocab_size);
        let run = FineTune {
            recipe,
            mode,
            distributed,
            session,
            settings,
            group,
            saved,
            seed,
            base,
            tokenizer,
            source,
        };
        Ok((run, model))
    }

    /// Prints `msg` on rank 0.
    pub fn say(&self, msg: String) {
        self.session.say(msg)
    }

    /// LoRA adapters on `model`'s frozen base (fresh, from `checkpointer.adapter_checkpoint`, or
    /// resumed), and the modules `modules_to_save` trains in full beside them.
    pub fn adapters(&self, cfg: &Config, model: &mut CausalLm) -> Result<Trainable> {
        let lead = self.session.lead();
        let base_path = &self.base.path;
        let mut lc = setup_adapters(cfg, model, base_path, self.saved.as_ref(), self.seed, lead)?;
        if self.mode == Mode::RewardModel {
            // PEFT's SEQ_CLS task: the classifier's head trains in full beside the adapters.
            lc.task_type = "SEQ_CLS".into();
            if !lc.modules_to_save.iter().any(|m| m == "score") {
                lc.modules_to_save.push("score".into());
            }
        }
        ferrotune_models::lora::set_training(model, true);
        let mut params = peft::trainable_parameters(model)?;
        if !lc.modules_to_save.is_empty() {
            if self.mode == Mode::Dpo {
                // The reference is the model with its adapters disabled, which would need the
                // saved modules' original weights kept beside them.
                bail!(
                    "{}: modules_to_save {:?} is not supported by the LoRA DPO recipe",
                    cfg.origin,
                    lc.modules_to_save
                );
            }
            let saved = peft::make_saved_modules_trainable(model, &lc.modules_to_save)
                .with_context(|| cfg.origin.clone())?;
            self.say(format!(
                "Trained in full beside the adapters (modules_to_save): {}",
                saved
                    .iter()
                    .map(|(n, _)| n.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            params.extend(saved);
        }
        Ok(Trainable {
            params,
            adapters: Some(lc),
        })
    }

    /// Says what trains (after what a recipe does to the model's layers, such as QAT's fake
    /// quantization), and which keys of other recipes this one ignores: `quantizer` (but for
    /// the QAT recipes) and a teacher's (but for distillation, which loads its teacher next).
    pub fn trainable(&self, cfg: &Config, trainable: &Trainable) {
        let (recipe, lead) = (self.recipe, self.session.lead());
        if lead && self.settings.quantizer_unused {
            // torchtune's QAT recipes fake-quantize with it; this one does not.
            eprintln!(
                "warning: 'quantizer' applies to the QAT recipes (qat_distributed, \
                 qat_lora_finetune_distributed): {recipe} trains without fake quantization"
            );
        }
        let params = &trainable.params;
        let count: usize = params.iter().map(|(_, v)| v.elem_count()).sum();
        self.say(format!(
            "{} trainable parameters in {} tensors",
            count,
            params.len()
        ));
        if lead && self.mode != Mode::Distill {
            let keys = [
                "teacher_model",
                "teacher_checkpointer",
                "kd_loss",
                "kd_ratio",
            ];
            note_ignored_keys(cfg, &keys, "knowledge_distillation", recipe);
        }
    }
}

/// Loads the model to train, and the base's format and folder its checkpoints copy files
/// from: full fine-tuning resumes from the saved full weights, LoRA from the base (its saved
/// adapter comes with [`FineTune::adapters`]). A QLoRA config's base is quantized to NF4 here,
/// before any adapter is attached: DoRA's magnitude is taken from the quantized weight, as
/// in torchtune; gpt-oss's MXFP4 experts are held packed instead on one rank (unless
/// `FERROTUNE_MXFP4_PACKED=0`).
fn load_model(
    cfg: &Config,
    mode: Mode,
    session: &Session,
    settings: &Settings,
    base: &CheckpointLocation,
    saved: Option<&SavedCheckpoint>,
) -> Result<(CausalLm, ModelSource)> {
    let (dtype, device) = (session.dtype, &session.device);
    let weights = match (saved, mode) {
        (Some(s), m) if m.full() => setup::CheckpointLocation::folder(&s.dir),
        _ => base.clone(),
    };
    let t0 = Instant::now();
    // One rank: the distributed paths shard and gather the layers' tensors, which packed
    // experts are not.
    let keep_mxfp4 = settings.quantize_base
        && !mode.full()
        && session.world == 1
        && ferrotune_core::switch::MXFP4_PACKED.on();
    let (mut model, source) = setup::load_model_as(cfg, &weights, dtype, device, keep_mxfp4)?;
    if !mode.reward_model() {
        model
            .config
            .require_language_model()
            .map_err(|e| anyhow!("{}: {e}", weights.path.display()))?;
    }
    let source = match (saved, mode) {
        // Tokenizer/generation files still come from the original base.
        (Some(_), m) if m.full() => {
            let (fmt, dir) = base_source(base)?;
            ModelSource { format: fmt, dir }
        }
        _ => source,
    };
    session.say(format!(
        "Model {} ({}, {} layers) loaded in {:.1}s on {device:?} as {dtype:?}",
        base.path.display(),
        model.config.model_type,
        model.config.num_hidden_layers,
        t0.elapsed().as_secs_f64()
    ));
    if settings.quantize_base && mode.full() {
        bail!(
            "{}: model.quantize_base (a qlora_* builder) freezes the base in NF4; full \
             fine-tuning trains every weight: use a LoRA recipe, or a lora_*/full model builder",
            cfg.origin
        );
    }
    if settings.quantize_base {
        session.say(format!("QLoRA: {}", model.quantize_base_nf4()?));
        let mxfp4 = model.mxfp4_experts();
        if mxfp4.weights > 0 {
            session.say(format!("QLoRA: {mxfp4}"));
        }
    }
    Ok((model, source))
}
