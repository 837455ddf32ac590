//! Reading model checkpoints: HF folders (single or sharded safetensors, memory-mapped) and GGUF.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::gguf::PackedWeights;
use crate::model::CausalLm;

/// Where a checkpoint's weights came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointFormat {
    /// HF safetensors (one or more files).
    Safetensors(Vec<PathBuf>),
    /// A llama.cpp GGUF file.
    Gguf(PathBuf),
}

/// A checkpoint read into memory: its config and HF-named tensors in the compute dtype.
#[derive(Debug)]
pub struct Checkpoint {
    pub config: ModelConfig,
    pub tensors: HashMap<String, Tensor>,
    /// GGUF matrix weights kept in block format too (inference only; empty otherwise).
    pub packed: PackedWeights,
    pub format: CheckpointFormat,
    /// The folder holding config/tokenizer files (the GGUF's folder for a GGUF).
    pub dir: PathBuf,
}

/// Resolves `path` (an HF folder, a `.safetensors` file, a `.gguf` file, or a folder holding
/// exactly one `.gguf`) to the files that hold the weights.
pub fn locate_weights(path: &Path) -> Result<CheckpointFormat, ModelError> {
    if !path.exists() {
        return Err(ModelError::file(path, "no such file or directory"));
    }
    if path.is_file() {
        return match path.extension().and_then(|e| e.to_str()) {
            Some("gguf") => Ok(CheckpointFormat::Gguf(path.to_path_buf())),
            Some("safetensors") => Ok(CheckpointFormat::Safetensors(vec![path.to_path_buf()])),
            _ => Err(ModelError::file(
                path,
                "not a model: expected an HF checkpoint folder, a .safetensors or a .gguf file",
            )),
        };
    }
    let index = path.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index)
            .map_err(|e| ModelError::file(&index, format!("cannot read: {e}")))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::file(&index, format!("invalid JSON: {e}")))?;
        let map = value
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| ModelError::file(&index, "missing 'weight_map' object"))?;
        let mut files = BTreeSet::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| {
                ModelError::file(&index, format!("weight_map['{name}'] is not a file name"))
            })?;
            files.insert(path.join(file));
        }
        for f in &files {
            if !f.is_file() {
                return Err(ModelError::file(
                    f,
                    "shard listed in model.safetensors.index.json is missing",
                ));
            }
        }
        return Ok(CheckpointFormat::Safetensors(files.into_iter().collect()));
    }
    let single = path.join("model.safetensors");
    if single.is_file() {
        return Ok(CheckpointFormat::Safetensors(vec![single]));
    }
    let mut safetensors = Vec::new();
    let mut ggufs = Vec::new();
    for entry in
        std::fs::read_dir(path).map_err(|e| ModelError::file(path, format!("cannot list: {e}")))?
    {
        let p = entry
            .map_err(|e| ModelError::file(path, format!("cannot list: {e}")))?
            .path();
        match p.extension().and_then(|e| e.to_str()) {
            Some("safetensors") if !p.ends_with("adapter_model.safetensors") => safetensors.push(p),
            Some("gguf") => ggufs.push(p),
            _ => {}
        }
    }
    safetensors.sort();
    if !safetensors.is_empty() {
        return Ok(CheckpointFormat::Safetensors(safetensors));
    }
    match ggufs.len() {
        1 => Ok(CheckpointFormat::Gguf(ggufs.remove(0))),
        0 if path.join("adapter_config.json").is_file() => Err(ModelError::file(
            path,
            adapter_folder_hint(path),
        )),
        0 => Err(ModelError::file(
            path,
            "no model weights found (expected model.safetensors, model.safetensors.index.json or a .gguf file)",
        )),
        _ => Err(ModelError::file(path, "several .gguf files: pass the one to load")),
    }
}

/// What to do with a folder that holds a PEFT adapter (`adapter_config.json`) rather than a model:
/// load its base with it, or the merged model a LoRA run saves beside it.
pub fn adapter_folder_hint(path: &Path) -> String {
    let merged = path.join("merged");
    let merged = if merged.join("config.json").is_file() {
        format!(", or its merged model {}", merged.display())
    } else {
        String::new()
    };
    format!(
        "holds a PEFT adapter (adapter_config.json), not a model: load its base model with it \
         (`--adapter`, `checkpointer.adapter_checkpoint`){merged}"
    )
}

/// Reads every tensor of the given safetensors files, converted to `dtype` on `device`.
pub fn read_safetensors(
    files: &[PathBuf],
    dtype: DType,
    device: &Device,
) -> Result<HashMap<String, Tensor>, ModelError> {
    read_safetensors_renamed(files, dtype, device, &|name| Some(name.to_string()))
}

/// The HF name inside the text model of a multimodal (Gemma 3, Mistral 3) model's tensor or module,
/// or `None` for the vision tower and projector: transformers 4.5x names them
/// `language_model.model.*` and `language_model.lm_head.*`, transformers 5
/// `model.language_model.*` and `lm_head.*`; names already in the text model's form stay. Serves
/// checkpoints and PEFT adapters of the whole model alike.
pub fn text_model_tensor(name: &str) -> Option<String> {
    if let Some(rest) = name
        .strip_prefix("language_model.model.")
        .or_else(|| name.strip_prefix("model.language_model."))
    {
        return Some(format!("model.{rest}"));
    }
    if let Some(rest) = name.strip_prefix("language_model.lm_head.") {
        return Some(format!("lm_head.{rest}"));
    }
    let vision = ["model.vision_tower.", "model.multi_modal_projector."]
        .iter()
        .any(|p| name.starts_with(p));
    let text = name.starts_with("lm_head.") || name.starts_with("model.");
    (text && !vision).then(|| name.to_string())
}

/// As [`read_safetensors`], keeping only the tensors `rename` maps to a name (under that name);
/// the others are not read at all.
fn read_safetensors_renamed(
    files: &[PathBuf],
    dtype: DType,
    device: &Device,
    rename: &dyn Fn(&str) -> Option<String>,
) -> Result<HashMap<String, Tensor>, ModelError> {
    let mut out = HashMap::new();
    for file in files {
        // SAFETY: the mapping is read-only and lives only while we copy tensors out of it; a
        // checkpoint file being rewritten underneath us is outside what we can guard against.
        let st = unsafe { MmapedSafetensors::new(file) }
            .map_err(|e| ModelError::file(file, format!("not a valid safetensors file: {e}")))?;
        for (name, view) in st.tensors() {
            let Some(new_name) = rename(&name) else {
                continue;
            };
            let t = st.load(&name, device).map_err(|e| {
                ModelError::file(file, format!("tensor '{name}' ({:?}): {e}", view.dtype()))
            })?;
            let t = t.to_dtype(dtype).map_err(|e| {
                ModelError::file(file, format!("tensor '{name}': cannot convert: {e}"))
            })?;
            out.insert(new_name, t);
        }
    }
    Ok(out)
}

/// Reads a checkpoint (HF folder or GGUF) with tensors in `dtype` on `device`.
pub fn read_checkpoint(
    path: &Path,
    dtype: DType,
    device: &Device,
) -> Result<Checkpoint, ModelError> {
    read(path, dtype, device, false)
}

fn read(
    path: &Path,
    dtype: DType,
    device: &Device,
    keep_packed: bool,
) -> Result<Checkpoint, ModelError> {
    let format = locate_weights(path)?;
    match &format {
        CheckpointFormat::Gguf(file) => {
            let (config, tensors, packed) = if keep_packed && dtype == DType::F32 {
                crate::gguf::load_gguf_with_packed(file, dtype, device)?
            } else {
                let (config, tensors) = crate::gguf::load_gguf(file, dtype, device)?;
                (config, tensors, PackedWeights::new())
            };
            let dir = file.parent().unwrap_or(Path::new(".")).to_path_buf();
            Ok(Checkpoint {
                config,
                tensors,
                packed,
                format,
                dir,
            })
        }
        CheckpointFormat::Safetensors(files) => {
            let dir = if path.is_dir() {
                path.to_path_buf()
            } else {
                path.parent().unwrap_or(Path::new(".")).to_path_buf()
            };
            let mut config = ModelConfig::from_hf_file(&dir)?;
            let tensors = if config.text_of_multimodal {
                let tensors = read_safetensors_renamed(files, dtype, device, &text_model_tensor)?;
                // Multimodal configs say little reliable about tying (transformers 5 ties on the
                // top-level flag, which the text config may contradict): the tensors decide.
                let tied = !tensors.contains_key("lm_head.weight");
                config.tie_word_embeddings = tied;
                if let Some(raw) = config.raw.as_object_mut() {
                    raw.insert("tie_word_embeddings".into(), tied.into());
                }
                tensors
            } else {
                read_safetensors(files, dtype, device)?
            };
            Ok(Checkpoint {
                config,
                tensors,
                packed: PackedWeights::new(),
                format,
                dir,
            })
        }
    }
}

/// Loads a model for inference from an HF folder or a GGUF file (for an f32 model from a GGUF,
/// quantized matrix weights are also kept in block format: see [`crate::model::Linear`]).
pub fn load_model(
    path: &Path,
    dtype: DType,
    device: &Device,
) -> Result<(CausalLm, PathBuf), ModelError> {
    let ckpt = read(path, dtype, device, true)?;
    let source = path.display().to_string();
    let model = CausalLm::from_tensors_and_packed(ckpt.config, ckpt.tensors, ckpt.packed, &source)?;
    Ok((model, ckpt.dir))
}
