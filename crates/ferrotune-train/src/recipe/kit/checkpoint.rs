//! The checkpointer every training recipe saves with: a checkpoint folder in torchtune's layout
//! holding the model (or the LoRA adapter files and the merged model one folder down), the
//! tokenizer files and the recipe state, written on one process or gathered from the ranks.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use candle_core::DType;
use ferrotune_export::hf::{write_model, ModelFiles, ModelSource, SaveFormat};
use ferrotune_models::peft::{self, LoraConfig};
use ferrotune_models::CausalLm;

use crate::dist::fsdp::ShardedModel;
use crate::optim::Optimizer;
use crate::recipe::setup;
use crate::recipe::state::{self, TrainState};
use crate::step::dropout_states;

/// The subfolder of a LoRA checkpoint that holds the merged HF model.
pub const MERGED_DIR: &str = "merged";

/// Largest safetensors file of saved merged/full checkpoints (transformers' default).
pub const MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// The format and folder of the checkpoint at `location`: where a run's saved checkpoint
/// still takes its tokenizer and generation files from.
pub fn base_source(
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
pub fn writes_transformers5(
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
pub struct Saver<'a> {
    /// Where the checkpoint folders go.
    pub output_dir: &'a Path,
    /// HF folders, or Meta's format under torchtune's `FullModelMetaCheckpointer`.
    pub format: SaveFormat,
    /// The base checkpoint's format and folder (its config, generation and tokenizer files).
    pub source: &'a ModelSource,
    /// The run's tokenizer, exported when the base has no tokenizer files to copy.
    pub tokenizer: &'a ferrotune_data::Tokenizer,
    /// The adapters' settings when only adapters train: the checkpoint holds the adapter files
    /// (and the merged model one folder down); without, the whole model.
    pub lora_config: Option<&'a LoraConfig>,
    /// The dtype the weights are saved in.
    pub dtype: DType,
    /// LoRA: the adapter files alone, no merged model.
    pub adapter_only: bool,
    /// Also write torchtune's `adapter_model.pt` (a torchtune checkpointer, a model type it
    /// converts).
    pub torchtune_adapter: bool,
    /// Also write the adapter as PEFT holds it on transformers 5 (`transformers5/`), for
    /// adapters on experts or routers.
    pub transformers5: bool,
    /// `checkpointer.keep_last_n_checkpoints`: older `epoch_N` (or `step_N`) folders are removed
    /// after each save, as torchtune's checkpointer does.
    pub keep_last: Option<usize>,
}

impl<'a> Saver<'a> {
    /// A saver of whole models as HF folders (with the tokenizer files) into `output_dir`.
    pub fn hf(
        output_dir: &'a Path,
        source: &'a ModelSource,
        tokenizer: &'a ferrotune_data::Tokenizer,
        dtype: DType,
    ) -> Self {
        Saver {
            output_dir,
            format: SaveFormat::Hf,
            source,
            tokenizer,
            lora_config: None,
            dtype,
            adapter_only: false,
            torchtune_adapter: false,
            transformers5: false,
            keep_last: None,
        }
    }

    /// This saver with the adapters of `lora_config` (none: whole models) saved as `model` holds
    /// them: torchtune's `adapter_model.pt` too when `torchtune_adapter` and the adapters fit it,
    /// the merged model unless `adapter_only` or they cannot be merged, transformers 5's form when
    /// they reach experts; `say` tells what is not written and why.
    pub fn with_adapters(
        self,
        model: &CausalLm,
        lora_config: Option<&'a LoraConfig>,
        torchtune_adapter: bool,
        say: &dyn Fn(String),
    ) -> Self {
        let Some(lc) = lora_config else {
            return self;
        };
        let saves_modules = !lc.modules_to_save.is_empty();
        let unfit = ferrotune_models::torchtune_adapter::unfit_adapter(model)
            .or(saves_modules.then_some(
                "modules_to_save trains whole modules, which torchtune's adapter file lacks",
            ));
        if let Some(why) = unfit.filter(|_| torchtune_adapter) {
            say(format!(
                "note: no adapter_model.pt is written: {why} (the PEFT adapter files are written \
                 as always)"
            ));
        }
        let unmergeable = peft::merge_refusal(model).filter(|_| !self.adapter_only);
        if let Some(why) = &unmergeable {
            say(format!(
                "note: no merged/ model is written: {why}; the adapter files are complete"
            ));
        }
        Saver {
            lora_config: Some(lc),
            adapter_only: self.adapter_only || unmergeable.is_some(),
            torchtune_adapter: torchtune_adapter && unfit.is_none(),
            transformers5: writes_transformers5(model, Some(lc), say),
            ..self
        }
    }

    /// Saves checkpoint `name` with state `st` (its dropout states filled in here). Distributed,
    /// every rank calls it: the model and optimizer state are gathered, rank 0 writes one copy,
    /// and the others wait until it is in place.
    pub fn save(
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

    /// Writes checkpoint `name` of `model` with state `st` on this process alone (then prunes
    /// older ones as `keep_last` asks); returns its folder.
    pub fn write(
        &self,
        model: &CausalLm,
        name: &str,
        st: &TrainState,
        optimizer_state: Vec<(String, candle_core::Tensor)>,
    ) -> Result<PathBuf> {
        let dir = state::save_checkpoint(self.output_dir, name, st, optimizer_state, |dir| {
            match self.lora_config {
                Some(lc) => {
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
                        let out = dir.join(MERGED_DIR);
                        std::fs::create_dir_all(&out)
                            .with_context(|| format!("{}: cannot create", out.display()))?;
                        self.write_whole(model, &out)?;
                    }
                    ferrotune_export::hf::copy_or_export_tokenizer(
                        self.source,
                        Some(self.tokenizer),
                        dir,
                    )?;
                }
                None => self.write_whole(model, dir)?,
            }
            Ok(())
        })?;
        if let Some(keep) = self.keep_last {
            state::prune_checkpoints(self.output_dir, name, keep)?;
        }
        Ok(dir)
    }

    /// Writes `model` whole (adapters merged) into `dir` in the run's format, with the tokenizer
    /// files.
    fn write_whole(&self, model: &CausalLm, dir: &Path) -> Result<()> {
        let files = ModelFiles {
            config: &model.config,
            tensors: &peft::merged_tensors(model)?,
            dtype: self.dtype,
            max_shard_bytes: MAX_SHARD_BYTES,
            source: self.source,
            tokenizer: Some(self.tokenizer),
        };
        write_model(self.format, dir, &files)
    }
}
