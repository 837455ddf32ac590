//! The fine-tuning recipes' parts around `run`: the training examples, the LoRA adapters, QAT's
//! fake quantization, the distillation teacher and DPO reference, the checkpoint saver, memory
//! reports and the progress bar.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::DType;
use ferrotune_data::dataset::{collate, PreferencePair, Row};
use ferrotune_export::hf::{write_model, ModelSource, SaveFormat};
use ferrotune_models::peft::{self, LoraConfig};
use ferrotune_models::CausalLm;
use indicatif::{ProgressBar, ProgressStyle};

use crate::config::Config;
use crate::dist::fsdp::ShardedModel;
use crate::loss::KdLoss;
use crate::optim::Optimizer;
use crate::recipe::setup;
use crate::recipe::state::{self, TrainState};
use crate::step::{dropout_states, MicroBatch};

use super::{Mode, MAX_SHARD_BYTES, MERGED_DIR};

/// A recipe's training examples: rows, or preference pairs for DPO.
pub(super) enum Examples {
    Rows(Vec<Row>),
    Pairs(Vec<PreferencePair>),
}

impl Examples {
    pub(super) fn len(&self) -> usize {
        match self {
            Examples::Rows(r) => r.len(),
            Examples::Pairs(p) => p.len(),
        }
    }

    /// The micro-batch of examples `picked` (indices), padded with `pad`.
    pub(super) fn micro_batch(
        &self,
        picked: impl Iterator<Item = usize>,
        pad: u32,
        device: &candle_core::Device,
    ) -> Result<MicroBatch> {
        Ok(match self {
            Examples::Rows(rows) => {
                let rows: Vec<&Row> = picked.map(|i| &rows[i]).collect();
                MicroBatch::from_batch(&collate(&rows, pad), device)?
            }
            Examples::Pairs(pairs) => {
                let pairs: Vec<&PreferencePair> = picked.map(|i| &pairs[i]).collect();
                MicroBatch::from_pairs(&pairs, pad, device)?
            }
        })
    }
}

/// Prints what this rank holds between steps against what one device would hold: the measure
/// of sharding.
pub(crate) fn report_memory(
    sm: &ShardedModel,
    optimizer: &dyn Optimizer,
    rank: usize,
) -> Result<()> {
    let (params, grads) = sm.resident_bytes();
    let (one_params, one_grads) = sm.single_device_bytes();
    let state = optimizer.state_dict()?;
    let opt: usize = state
        .iter()
        .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
        .sum();
    let held: usize = sm
        .optimizer_params()
        .iter()
        .map(|(_, v)| v.elem_count())
        .sum::<usize>()
        .max(1);
    let one_opt = (opt as f64 * sm.trainable_numel() as f64 / held as f64) as usize;
    let mb = |b: usize| b as f64 / 1e6;
    let line = format!(
        "rank {rank}: parameters {:.1} MB + gradients {:.1} MB + optimizer state {:.1} MB = {:.1} MB \
         (one device: {:.1} + {:.1} + {:.1} = {:.1} MB)",
        mb(params),
        mb(grads),
        mb(opt),
        mb(params + grads + opt),
        mb(one_params),
        mb(one_grads),
        mb(one_opt),
        mb(one_params + one_grads + one_opt)
    );
    // One write of the whole line: the ranks share the terminal, and `eprintln!` may write a
    // formatted line in pieces that interleave with another process's.
    use std::io::Write;
    let _ = std::io::stderr().write_all(format!("{line}\n").as_bytes());
    Ok(())
}

/// The LoRA adapters to train: from `checkpointer.adapter_checkpoint` (a PEFT folder, whose config
/// wins), from a checkpoint being resumed, or fresh from the model keys.
pub(crate) fn setup_adapters(
    cfg: &Config,
    model: &mut CausalLm,
    base_path: &Path,
    resume_dir: Option<&Path>,
    seed: u64,
    lead: bool,
) -> Result<LoraConfig> {
    if let Some(dir) = resume_dir {
        let lc = peft::load_adapter(model, dir)?;
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
            } else if !saved.target_parameters.is_empty() {
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
/// adapter (each must divide, as torchtune's `QATLoRALinear` requires; DoRA is refused). Returns
/// how many layers.
pub(super) fn apply_fake_quant(
    cfg: &Config,
    model: &mut CausalLm,
    mode: Mode,
    group_size: usize,
) -> Result<usize> {
    let tied = model.config.tie_word_embeddings;
    let mut n = 0;
    for (name, linear) in model.linears_mut() {
        let inputs = linear.weight.dims2()?.1;
        if mode == Mode::QatLora {
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
pub(super) fn set_fake_quant_enabled(model: &mut CausalLm, enabled: bool) {
    for (_, linear) in model.linears_mut() {
        if let Some(fq) = &mut linear.fake_quant {
            fq.enabled = enabled;
        }
    }
}

/// Says which of `keys` the config sets although only the `family` recipes read them.
pub(super) fn note_ignored_keys(cfg: &Config, keys: &[&str], family: &str, recipe: &str) {
    for key in keys {
        if cfg.get(key).is_some_and(|v| !v.is_null()) {
            eprintln!("note: '{key}' applies to the {family} recipes; {recipe} ignores it");
        }
    }
}

/// The frozen teacher of a distillation run and how its loss mixes in.
pub(super) struct Teacher {
    pub(super) model: Arc<CausalLm>,
    pub(super) ratio: f64,
    pub(super) loss: KdLoss,
    /// `kd_loss.num_output_chunks`.
    pub(super) chunks: usize,
}

/// Loads `teacher_checkpointer`'s model (frozen, in the run's dtype, on the student's device) and
/// reads `kd_ratio` and `kd_loss`. The two models must share the vocabulary.
pub(super) fn setup_teacher(
    cfg: &Config,
    student: &CausalLm,
    dtype: DType,
    device: &candle_core::Device,
    lead: bool,
) -> Result<Teacher> {
    let location = setup::checkpoint_path_at(cfg, "teacher_checkpointer")?;
    let path = location.path.clone();
    let t0 = Instant::now();
    let (model, _) = location
        .load(dtype, device)
        .with_context(|| format!("{}: teacher_checkpointer", cfg.origin))?;
    model
        .config
        .require_language_model()
        .map_err(|e| anyhow!("{}: teacher_checkpointer: {e}", cfg.origin))?;
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
pub(super) fn setup_reference(
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
    let (model, _) = location
        .load(dtype, device)
        .with_context(|| format!("{}: ref_checkpointer", cfg.origin))?;
    model
        .config
        .require_language_model()
        .map_err(|e| anyhow!("{}: ref_checkpointer: {e}", cfg.origin))?;
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

pub(crate) fn base_source(
    location: &setup::CheckpointLocation,
) -> Result<(ferrotune_models::CheckpointFormat, PathBuf)> {
    let path = &location.path;
    let format = ferrotune_models::checkpoint::locate_listed(path, &location.files)?;
    let dir = match &format {
        ferrotune_models::CheckpointFormat::Gguf(f) => {
            f.parent().unwrap_or(Path::new(".")).to_path_buf()
        }
        _ if path.is_dir() => path.to_path_buf(),
        _ => path.parent().unwrap_or(Path::new(".")).to_path_buf(),
    };
    Ok((format, dir))
}

/// Whether a LoRA run also writes its adapter as PEFT holds it on transformers 5
/// (`transformers5/`: fused experts): when `lora_config`'s adapters reach experts or routers and
/// that form can hold them; `say` tells why not otherwise.
pub(crate) fn writes_transformers5(
    model: &CausalLm,
    lora_config: Option<&LoraConfig>,
    say: &dyn Fn(String),
) -> bool {
    let Some(lc) = lora_config else {
        return false;
    };
    match ferrotune_models::peft_params::has_transformers5_adapter(model, lc) {
        Ok(found) => found,
        Err(why) => {
            say(format!(
                "note: no transformers5/ adapter is written for the experts: {why} (the \
                 adapter files load with transformers 4's per-expert modules)"
            ));
            false
        }
    }
}

/// Writes checkpoint folders for this run.
pub(super) struct Saver<'a> {
    pub(super) mode: Mode,
    pub(super) output_dir: &'a Path,
    /// HF folders, or Meta's format under torchtune's `FullModelMetaCheckpointer`.
    pub(super) format: SaveFormat,
    pub(super) source: &'a ModelSource,
    pub(super) tokenizer: &'a ferrotune_data::Tokenizer,
    pub(super) lora_config: Option<&'a LoraConfig>,
    pub(super) dtype: DType,
    pub(super) adapter_only: bool,
    /// Also write torchtune's `adapter_model.pt` (a torchtune checkpointer, a model type it
    /// converts).
    pub(super) torchtune_adapter: bool,
    /// Also write the adapter as PEFT holds it on transformers 5 (`transformers5/`), for
    /// adapters on experts or routers.
    pub(super) transformers5: bool,
    /// `checkpointer.keep_last_n_checkpoints`: older `epoch_N` (or `step_N`) folders are removed
    /// after each save, as torchtune's checkpointer does.
    pub(super) keep_last: Option<usize>,
}

impl Saver<'_> {
    /// Saves checkpoint `name` with state `st` (its dropout states filled in here). Distributed,
    /// every rank calls it: the model and optimizer state are gathered, rank 0 writes one copy,
    /// and the others wait until it is in place.
    pub(super) fn save(
        &self,
        model: &mut CausalLm,
        sharded: Option<&mut ShardedModel>,
        name: &str,
        mut st: TrainState,
        optimizer: &dyn Optimizer,
    ) -> Result<()> {
        st.dropout_states = dropout_states(model);
        let Some(sm) = sharded else {
            let dir = self.write(model, name, &st, optimizer.state_dict()?)?;
            eprintln!("Checkpoint saved to {}", dir.display());
            return Ok(());
        };
        st.rank_dropout_states = sm.all_gather_u64(&st.dropout_states)?;
        if let Some(first) = st.rank_dropout_states.first() {
            st.dropout_states = first.clone();
        }
        sm.gather_all(model)?;
        let opt_state = sm.full_optimizer_state(optimizer.state_dict()?)?;
        let written = if sm.queue().rank() == 0 {
            Some(self.write(model, name, &st, opt_state))
        } else {
            None
        };
        sm.release_all(model);
        let ok = match &written {
            Some(Err(_)) => 0.0,
            _ => 1.0,
        };
        // Nobody runs ahead of a checkpoint that is not on disk yet.
        let all_ok = sm.all_reduce_f64(&[ok])?[0];
        match written {
            Some(r) => {
                let dir = r?;
                eprintln!("Checkpoint saved to {}", dir.display());
            }
            None if all_ok < sm.queue().world_size() as f64 => {
                bail!("rank 0 could not write checkpoint {name}")
            }
            None => {}
        }
        Ok(())
    }

    fn write(
        &self,
        model: &CausalLm,
        name: &str,
        st: &TrainState,
        optimizer_state: Vec<(String, candle_core::Tensor)>,
    ) -> Result<PathBuf> {
        let dir = self.write_folder(model, name, st, optimizer_state)?;
        if let Some(keep) = self.keep_last {
            state::prune_checkpoints(self.output_dir, name, keep)?;
        }
        Ok(dir)
    }

    fn write_folder(
        &self,
        model: &CausalLm,
        name: &str,
        st: &TrainState,
        optimizer_state: Vec<(String, candle_core::Tensor)>,
    ) -> Result<PathBuf> {
        state::save_checkpoint(self.output_dir, name, st, optimizer_state, |dir| {
            match (self.mode, self.lora_config) {
                (m, Some(lc)) if !m.full() => {
                    peft::save_adapter(model, lc, dir)?;
                    if self.torchtune_adapter {
                        ferrotune_models::torchtune_adapter::save_torchtune_adapter(model, dir)?;
                    }
                    if self.transformers5 {
                        ferrotune_models::peft_params::save_transformers5_adapter(model, lc, dir)?;
                    }
                    // The merged model goes one folder down: transformers treats a folder holding
                    // adapter_config.json as "base + adapter", so merged weights beside it would
                    // get the adapter applied a second time by `from_pretrained`.
                    if !self.adapter_only {
                        let merged = peft::merged_tensors(model)?;
                        let out = dir.join(MERGED_DIR);
                        std::fs::create_dir_all(&out)
                            .with_context(|| format!("{}: cannot create", out.display()))?;
                        write_model(
                            self.format,
                            &out,
                            &model.config,
                            &merged,
                            self.dtype,
                            MAX_SHARD_BYTES,
                            self.source,
                            Some(self.tokenizer),
                        )?;
                    }
                    ferrotune_export::hf::copy_or_export_tokenizer(
                        self.source,
                        Some(self.tokenizer),
                        dir,
                    )?;
                }
                _ => {
                    let weights = peft::merged_tensors(model)?;
                    write_model(
                        self.format,
                        dir,
                        &model.config,
                        &weights,
                        self.dtype,
                        MAX_SHARD_BYTES,
                        self.source,
                        Some(self.tokenizer),
                    )?;
                }
            }
            Ok(())
        })
    }
}

/// `FERROTUNE_KILL_AFTER_STEP=N` sends this process SIGKILL right after step N is logged: how the
/// tests interrupt a run at a known point to check that resuming is step-exact.
/// With `FERROTUNE_KILL_RANK=R` only rank R is killed (the others must notice).
/// A test hook: does nothing unless built with the `test-hooks` feature (the test suite's).
pub(crate) fn kill_if_asked(global_step: usize, rank: usize) {
    #[cfg(feature = "test-hooks")]
    {
        use ferrotune_core::switch::{KILL_AFTER_STEP, KILL_RANK};
        let rank_ok = KILL_RANK.count().is_none_or(|r| r == rank);
        if KILL_AFTER_STEP.count() == Some(global_step) && rank_ok {
            // SAFETY: kill(2) on our own pid with a valid signal number has no memory effects.
            unsafe {
                libc::kill(libc::getpid(), libc::SIGKILL);
            }
        }
    }
    #[cfg(not(feature = "test-hooks"))]
    let _ = (global_step, rank);
}

pub(super) fn progress_bar(len: usize, pos: usize, epoch: usize) -> ProgressBar {
    let bar = ProgressBar::new(len as u64);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg}: {percent:>3}%|{bar:24}| {pos}/{len} [{elapsed_precise}<{eta_precise}]",
        )
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_position(pos as u64);
    bar.set_message(format!("{}|{}", epoch + 1, pos));
    bar
}
