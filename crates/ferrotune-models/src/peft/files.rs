//! Adapter folders: loading PEFT's (`adapter_model.safetensors` or `.bin`, with torchtune's
//! `adapter_model.pt` as a fallback) and saving them as PEFT does.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use super::attach::{attach_adapter, head_shares_embedding_adapter};
use super::config::{LoraConfig, TargetModules};
use super::saved_modules::{
    load_base_layers, load_trainable_tokens, replace_saved_modules, saved_module_tensors,
    saved_modules, saves_embedding_layers, trainable_tokens_key, vocabulary_resized,
};
use super::torchtune_adapter::same_values;
use super::{
    bias_file_key, embed_file_keys, file_keys, ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE,
    EMBED_MODULE, MLLAMA_EMBEDDING, PEFT_PREFIX,
};
use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::model::lora::LoraAdapter;
use crate::model::CausalLm;
use crate::save::write_atomic;

/// Reads the PEFT adapter in `dir` and attaches it to `model` (replacing any adapters there).
///
/// Tensors are converted to the model's dtype and device. Every targeted module must have its
/// `lora_A`/`lora_B` (and for DoRA `lora_magnitude_vector`) with the shapes the config implies;
/// missing, unexpected or mis-shaped tensors are errors naming the tensor.
pub fn load_adapter(model: &mut CausalLm, dir: &Path) -> Result<LoraConfig, ModelError> {
    let config = LoraConfig::read(dir)?;
    let (file, mut tensors) = read_adapter_tensors(dir)?;
    if model.config.text_of_multimodal || model.config.llama4_names {
        tensors = text_model_adapter_tensors(&model.config, tensors, &file);
    }
    let saved = saved_module_tensors(&mut tensors, &config.modules_to_save);
    let source = file.display().to_string();
    load_base_layers(model, &mut tensors, &source)?;
    load_trainable_tokens(model, &config, &mut tensors, &source)?;
    attach_adapter(model, &config, tensors, &source)?;
    replace_saved_modules(model, saved, &source)?;
    Ok(config)
}

/// The tensors of the PEFT adapter in `dir` under their file names (CPU; a `.bin`'s in f32), and
/// the file they came from: `adapter_model.safetensors`, or `adapter_model.bin` (PEFT's
/// `safe_serialization=False`, a torch.save file).
pub fn read_adapter_tensors(dir: &Path) -> Result<(PathBuf, HashMap<String, Tensor>), ModelError> {
    let file = dir.join(ADAPTER_WEIGHTS_FILE);
    if file.is_file() {
        // The model's reader: its tensors checked as a model's are (float types, finite).
        let tensors = crate::checkpoint::read_safetensors_renamed(
            std::slice::from_ref(&file),
            None,
            &Device::Cpu,
            None,
            &|name| Some(name.to_string()),
        )?;
        return Ok((file, tensors));
    }
    let bin = dir.join("adapter_model.bin");
    if !bin.is_file() {
        return Err(ModelError::file(&file, "no such file"));
    }
    let mut out = HashMap::new();
    for (name, t) in crate::torch_pickle::read_torch_file(&bin)? {
        let t = t.to_weight(&bin, &name, Some(candle_core::DType::F32), &Device::Cpu)?;
        out.insert(name, t);
    }
    Ok((bin, out))
}

/// Loads the adapter at `path` into `model`, whichever way it was saved: a PEFT folder (or its
/// `adapter_model.safetensors` / `.bin`), or torchtune's `adapter_model.pt` (the file, or a
/// folder holding it and no PEFT weights). torchtune's file has no alpha: it is taken from an
/// `adapter_config.json` beside it (torchtune writes one for every model type but Phi-3), else
/// from `lora_alpha`, else the load fails asking for it.
pub fn load_adapter_from(
    model: &mut CausalLm,
    path: &Path,
    lora_alpha: Option<f64>,
) -> Result<LoraConfig, ModelError> {
    use super::torchtune_adapter::{load_torchtune_adapter, TORCHTUNE_ADAPTER_FILE};
    let (dir, torchtune_file) = if path.is_file() {
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let torchtune = path.extension().is_some_and(|e| e == "pt");
        (dir, torchtune.then(|| path.to_path_buf()))
    } else {
        let peft = dir_has_peft_weights(path);
        let tt = path.join(TORCHTUNE_ADAPTER_FILE);
        (path.to_path_buf(), (!peft && tt.is_file()).then_some(tt))
    };
    let Some(file) = torchtune_file else {
        let peft = load_adapter(model, &dir);
        return with_torchtune_file(model, &dir, peft);
    };
    let beside = dir.join(ADAPTER_CONFIG_FILE);
    let alpha = if beside.is_file() {
        LoraConfig::read(&dir)?.lora_alpha
    } else {
        lora_alpha.ok_or_else(|| {
            ModelError::file(
                &file,
                "torchtune's adapter file holds no lora_alpha and there is no \
                 adapter_config.json beside it: give the alpha it was trained with \
                 (`model.lora_alpha` in a config, `--lora-alpha` on the command line)",
            )
        })?
    };
    load_torchtune_adapter(model, &file, alpha)
}

/// A folder torchtune wrote holds its adapter twice: `adapter_model.pt` (what torchtune's model
/// ran and resumes from) and the PEFT files converted from it. torchtune 0.6.1 converts some
/// wrongly: it permutes Qwen2's q/k `lora_B` rows (whose weights it never permuted), leaves
/// DoRA's q/k magnitudes in its own row order, and writes no `use_dora` into the config. So when
/// the folder also holds `adapter_model.pt` for this model and the PEFT load (`peft`) failed, or
/// loaded tensors that differ from the `.pt` read exactly, the `.pt` is what was trained: it is
/// attached instead, with a warning. A folder ferrotune wrote holds the same tensors twice and
/// stays loaded as PEFT, options and all.
fn with_torchtune_file(
    model: &mut CausalLm,
    dir: &Path,
    peft: Result<LoraConfig, ModelError>,
) -> Result<LoraConfig, ModelError> {
    use super::torchtune_adapter::{read_torchtune_adapter, supports, TORCHTUNE_ADAPTER_FILE};
    let file = dir.join(TORCHTUNE_ADAPTER_FILE);
    if !file.is_file() || !supports(&model.config) {
        return peft;
    }
    // The config the PEFT load read, or (when it failed) read here.
    let alpha = match &peft {
        Ok(c) => c.lora_alpha,
        Err(_) => match LoraConfig::read(dir) {
            Ok(c) => c.lora_alpha,
            Err(_) => return peft,
        },
    };
    let Ok((tt_config, tt)) = read_torchtune_adapter(model, &file, alpha) else {
        // Not an adapter of this model in torchtune's names: the PEFT folder decides.
        return peft;
    };
    let why = match &peft {
        Ok(_) => {
            let loaded = adapter_tensors(model);
            let same = loaded.len() == tt.len()
                && loaded.iter().all(|(name, t)| {
                    // Compared in the model's dtype, as both were loaded.
                    tt.get(name).is_some_and(|u| same_values(t, u))
                });
            if same {
                return peft;
            }
            "the PEFT adapter differs from it".to_string()
        }
        Err(e) => format!("the PEFT adapter does not load ({e})"),
    };
    tracing::warn!(
        "{}: using torchtune's {TORCHTUNE_ADAPTER_FILE}: {why} (torchtune 0.6.1 writes Qwen2's \
         q/k lora_B and DoRA's q/k magnitudes in the wrong row order to the PEFT file, and no \
         use_dora)",
        dir.display()
    );
    attach_adapter(model, &tt_config, tt, &file.display().to_string())?;
    Ok(tt_config)
}

/// Whether `dir` holds PEFT adapter weights.
fn dir_has_peft_weights(dir: &Path) -> bool {
    dir.join(ADAPTER_WEIGHTS_FILE).is_file() || dir.join("adapter_model.bin").is_file()
}

/// An adapter trained by PEFT on a whole multimodal model (Gemma 3, Mistral 3, Llama 3.2
/// Vision, ...), as adapter tensors of its text model (see [`ModelConfig::text_model_name`]):
/// `language_model.model.*` (transformers 4.5x) and `model.language_model.*` (5.x) become
/// `model.*`; the vision tower's, projector's and cross-attention layers' adapters are left out,
/// with a warning.
fn text_model_adapter_tensors(
    config: &ModelConfig,
    tensors: HashMap<String, Tensor>,
    file: &Path,
) -> HashMap<String, Tensor> {
    let mut out = HashMap::with_capacity(tensors.len());
    let mut dropped = 0;
    for (name, t) in tensors {
        let Some(rest) = name.strip_prefix(PEFT_PREFIX) else {
            out.insert(name, t);
            continue;
        };
        match config.text_model_name(rest) {
            Some(text) => {
                out.insert(format!("{PEFT_PREFIX}{text}"), t);
            }
            None => dropped += 1,
        }
    }
    if dropped > 0 {
        tracing::warn!(
            "{}: {dropped} adapter tensors of the vision tower / projector / cross-attention layers left out (ferrotune runs the text model)",
            file.display()
        );
    }
    out
}

/// The adapter tensors of `model` under PEFT's file names (as in `adapter_model.safetensors`).
pub fn adapter_tensors(model: &CausalLm) -> BTreeMap<String, Tensor> {
    let mut out = BTreeMap::new();
    let embed = model
        .embed_adapter
        .as_ref()
        .map(|a| (embed_file_keys(), EMBED_MODULE.to_string(), a));
    let linears = model.linears();
    let linears = linears.iter().filter_map(|(name, l)| {
        l.adapter
            .as_ref()
            .map(|a| (file_keys(name), name.clone(), a))
    });
    for ((ka, kb, km), module, adapter) in embed.into_iter().chain(linears) {
        out.insert(ka, adapter.a.clone());
        out.insert(kb, adapter.b.clone());
        if let Some(m) = &adapter.dora_magnitude {
            out.insert(km, m.clone());
        }
        if let Some(b) = &adapter.bias {
            out.insert(bias_file_key(&module), b.clone());
        }
    }
    out.extend(super::gpt_oss_params::tensors(model));
    out
}

/// What PEFT must leave alone when it loads an adapter of Llama 3.2 Vision's text layers on the
/// checkpoint (as a regular expression of module names for `exclude_modules`): the
/// cross-attention layers and the vision tower hold modules of the names `target_modules` lists
/// (`q_proj`, `up_proj`, ...), which text alone never runs. `None` when nothing needs leaving out.
fn mllama_untouched(config: &ModelConfig) -> Option<String> {
    let mllama = config.mllama.as_ref()?;
    let mut parts = Vec::new();
    if !mllama.cross_attention_layers.is_empty() {
        let layers: Vec<String> = mllama
            .cross_attention_layers
            .iter()
            .map(usize::to_string)
            .collect();
        parts.push(format!(
            r"{}layers\.(?:{})\..*",
            mllama.text_prefix.replace('.', r"\."),
            layers.join("|")
        ));
    }
    if mllama.text_prefix != "model." {
        parts.push(r"model\.vision_model\..*".to_string());
    }
    (!parts.is_empty()).then(|| parts.join("|"))
}

/// Saves `model`'s adapters to `dir` in PEFT's format: `adapter_config.json` (from `config`) and
/// `adapter_model.safetensors` (metadata `format: pt`), each written atomically.
///
/// The adapters must be the ones `config` describes (same modules and ranks): a mismatch is an
/// error rather than a folder PEFT would load differently.
pub fn save_adapter(model: &CausalLm, config: &LoraConfig, dir: &Path) -> Result<(), ModelError> {
    if super::gpt_oss_params::is_gpt_oss(model) {
        // gpt-oss's expert adapters are held in PEFT's fused form: saved as they are.
        super::gpt_oss_params::check_saved(model, config)?;
    } else if !config.target_parameters.is_empty() {
        return Err(ModelError::Msg(
            "cannot save an adapter with target_parameters (PEFT's adapters on parameters, such \
             as fused experts): merge it instead"
                .into(),
        ));
    }
    let linears = model.linears();
    let embed = (EMBED_MODULE.to_string(), model.embed_adapter.as_ref());
    let modules = linears
        .iter()
        .map(|(name, l)| (name.clone(), l.adapter.as_ref()))
        .chain([embed]);
    let shared_head = head_shares_embedding_adapter(model);
    for (name, adapter) in modules {
        if shared_head && name == "lm_head" {
            // The embedding's adapter, saved under the head's names too, as PEFT does.
            continue;
        }
        let want = config.resolve_module(&model.config, &name).map(|(r, _)| r);
        let have = adapter.map(LoraAdapter::rank);
        let dora = adapter.map(|a| a.dora_magnitude.is_some());
        let bias = adapter.map(|a| a.bias.is_some());
        if want != have
            || dora.is_some_and(|d| d != config.use_dora)
            || bias.is_some_and(|b| b != config.lora_bias)
        {
            return Err(ModelError::Msg(format!(
                "cannot save: module '{name}' has adapter rank {have:?} (DoRA {dora:?}, bias \
                 {bias:?}) but the config implies rank {want:?} (DoRA {}, lora_bias {})",
                config.use_dora, config.lora_bias
            )));
        }
    }
    let tensors = saved_tensors(model, config)?;
    if model.config.mllama.is_none() && !model.config.llama4_names {
        return write_adapter_files(dir, config, tensors);
    }
    // Llama 3.2 Vision and Llama 4: saved under the checkpoint's own names, so that PEFT loads
    // the adapter on the checkpoint (and ferrotune maps it back).
    if model.config.mllama.is_some() && tensors.keys().any(|k| k.contains(EMBED_MODULE)) {
        return Err(ModelError::Msg(MLLAMA_EMBEDDING.into()));
    }
    let tensors = tensors
        .into_iter()
        .map(|(k, t)| {
            let name = k.strip_prefix(PEFT_PREFIX).unwrap_or(&k);
            (
                format!("{PEFT_PREFIX}{}", model.config.checkpoint_name(name)),
                t,
            )
        })
        .collect();
    if model.config.mllama.is_none() {
        return write_adapter_files(dir, config, tensors);
    }
    let mut config = config.clone();
    if config.exclude_modules.is_none() {
        config.exclude_modules = mllama_untouched(&model.config).map(TargetModules::Regex);
    }
    write_adapter_files(dir, &config, tensors)
}

/// The tensors PEFT's `save_pretrained` writes for `model`'s adapters under `config`: the
/// adapters', the trainable tokens' rows, and the embedding and head weights PEFT saves beside
/// them by default.
pub(crate) fn saved_tensors(
    model: &CausalLm,
    config: &LoraConfig,
) -> Result<BTreeMap<String, Tensor>, ModelError> {
    let mut tensors = adapter_tensors(model);
    if !config.trainable_token_indices.is_empty() {
        // The trainable tokens were put into the embedding when loaded: their rows are there.
        let ids = Tensor::new(config.trainable_token_indices.as_slice(), model.device())?;
        let rows = model.embed_tokens.index_select(&ids, 0)?;
        tensors.insert(trainable_tokens_key(), rows);
    }
    // `modules_to_save`: the modules trained in full, as PEFT saves them.
    let (embed, head) = saved_modules(model, &config.modules_to_save)?;
    insert_embedding_and_head(&mut tensors, model, embed, head, "")?;
    let tokens = !config.trainable_token_indices.is_empty();
    let lm_head = model.head_name() == "lm_head";
    if !tokens && !saves_embedding_layers(model, config) && vocabulary_resized(model, config) {
        // As PEFT saves by default when the vocabulary is not the base's: the whole embedding
        // and head, which a reader must put in the base's place.
        insert_embedding_and_head(&mut tensors, model, true, lm_head, "")?;
    }
    if !tokens && saves_embedding_layers(model, config) {
        // As PEFT saves by default: the base weights of the adapted embedding and head.
        let embed = model.embed_adapter.is_some();
        let head = lm_head && model.lm_head.adapter.is_some();
        insert_embedding_and_head(&mut tensors, model, embed, head, ".base_layer")?;
    }
    Ok(tensors)
}

/// Puts `model`'s embedding weight (`embed`) and/or its head's weight and bias (`head`) into
/// `tensors` under PEFT's names, `infix` between module and parameter (`""`, or `.base_layer`
/// for the base weights of an adapted module).
fn insert_embedding_and_head(
    tensors: &mut BTreeMap<String, Tensor>,
    model: &CausalLm,
    embed: bool,
    head: bool,
    infix: &str,
) -> Result<(), ModelError> {
    if embed {
        let key = format!("{PEFT_PREFIX}{EMBED_MODULE}{infix}.weight");
        tensors.insert(key, model.embed_tokens.clone());
    }
    if head {
        let name = model.head_name();
        let weight = model.lm_head.weight.dense()?.into_owned();
        tensors.insert(format!("{PEFT_PREFIX}{name}{infix}.weight"), weight);
        if let Some(b) = &model.lm_head.bias {
            tensors.insert(format!("{PEFT_PREFIX}{name}{infix}.bias"), b.clone());
        }
    }
    Ok(())
}

/// Writes a PEFT adapter folder: `adapter_config.json` (from `config`) and
/// `adapter_model.safetensors` holding `tensors` (metadata `format: pt`), each atomically.
pub(crate) fn write_adapter_files(
    dir: &Path,
    config: &LoraConfig,
    tensors: BTreeMap<String, Tensor>,
) -> Result<(), ModelError> {
    std::fs::create_dir_all(dir)
        .map_err(|e| ModelError::file(dir, format!("cannot create folder: {e}")))?;
    let tensors: Vec<(String, Tensor)> = tensors
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_device(&Device::Cpu)?.contiguous()?)))
        .collect::<Result<_, candle_core::Error>>()?;
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let file = dir.join(ADAPTER_WEIGHTS_FILE);
    let bytes =
        safetensors::serialize(tensors.iter().map(|(k, t)| (k.as_str(), t)), Some(metadata))
            .map_err(|e| ModelError::file(&file, format!("cannot serialize: {e}")))?;
    write_atomic(&file, &bytes)?;
    let text = serde_json::to_string_pretty(&config.to_json()).expect("JSON values serialize");
    write_atomic(&dir.join(ADAPTER_CONFIG_FILE), text.as_bytes())
}
