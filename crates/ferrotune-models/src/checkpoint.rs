//! Reading model checkpoints: HF folders (single or sharded safetensors, memory-mapped, or
//! PyTorch `.bin` pickles), Meta's `consolidated.00.pth`, and GGUF.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::error::ModelError;
pub use crate::family::read::text_model_tensor;
use crate::gguf::PackedWeights;
use crate::model::CausalLm;
use crate::torch_pickle::{read_torch_file, TorchTensor};
use crate::{torch_pickle, torchtune_names, weight_checks};

/// Where a checkpoint's weights came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckpointFormat {
    /// HF safetensors (one or more files).
    Safetensors(Vec<PathBuf>),
    /// A llama.cpp GGUF file.
    Gguf(PathBuf),
    /// `torch.save` files with HF tensor names beside a `config.json` (`pytorch_model*.bin`,
    /// torchtune's `hf_model_*.pt`).
    Pickle(Vec<PathBuf>),
    /// Meta's original format: one `consolidated.00.pth` with `params.json` beside it.
    Meta(PathBuf),
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
    /// The linear layers (HF module names) a `quantize` recipe's file holds as torchao's int8
    /// dynamic-activation / int4-weight layers, with their group size: `tensors` holds their
    /// dequantized weights, and their inputs are to be quantized per token as torchao does.
    pub quantized_linears: Vec<(String, usize)>,
}

/// Resolves `path` (an HF folder, a `.safetensors`/`.bin`/`.pt`/`.pth` file, a `.gguf` file, a
/// folder holding exactly one `.gguf`, or a Meta folder with `params.json`: Meta's
/// `consolidated.00.pth` or the one `.bin` torchtune's Meta checkpointer saves) to the files that
/// hold the weights. Safetensors win over pickles of the same model in one folder.
pub fn locate_weights(path: &Path) -> Result<CheckpointFormat, ModelError> {
    if !path.exists() {
        return Err(ModelError::file(path, "no such file or directory"));
    }
    if path.is_file() {
        return match path.extension().and_then(|e| e.to_str()) {
            Some("gguf") => Ok(CheckpointFormat::Gguf(path.to_path_buf())),
            Some("safetensors") => Ok(CheckpointFormat::Safetensors(vec![path.to_path_buf()])),
            _ if torch_pickle::is_pickle_file(path) => locate_listed(
                path.parent().unwrap_or(Path::new(".")),
                &[path.to_path_buf()],
            ),
            _ => Err(ModelError::file(
                path,
                "not a model: expected an HF checkpoint folder, a .safetensors, .bin, .pth or \
                 .gguf file",
            )),
        };
    }
    if let Some(files) =
        indexed_or_single(path, "model.safetensors.index.json", "model.safetensors")?
    {
        return Ok(CheckpointFormat::Safetensors(files));
    }
    let mut safetensors = Vec::new();
    let mut ggufs = Vec::new();
    let mut consolidated = Vec::new();
    let mut pickles = Vec::new();
    for entry in
        std::fs::read_dir(path).map_err(|e| ModelError::file(path, format!("cannot list: {e}")))?
    {
        let p = entry
            .map_err(|e| ModelError::file(path, format!("cannot list: {e}")))?
            .path();
        if p.is_file() && torch_pickle::is_pickle_file(&p) {
            pickles.push(p.clone());
        }
        match p.extension().and_then(|e| e.to_str()) {
            Some("safetensors") if !p.ends_with("adapter_model.safetensors") => safetensors.push(p),
            Some("gguf") => ggufs.push(p),
            Some("pth")
                if p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("consolidated.")) =>
            {
                consolidated.push(p)
            }
            _ => {}
        }
    }
    safetensors.sort();
    pickles.sort();
    if !safetensors.is_empty() {
        return Ok(CheckpointFormat::Safetensors(safetensors));
    }
    if let Some(files) =
        indexed_or_single(path, "pytorch_model.bin.index.json", "pytorch_model.bin")?
    {
        return Ok(CheckpointFormat::Pickle(files));
    }
    if !consolidated.is_empty() && path.join("params.json").is_file() {
        consolidated.sort();
        return locate_listed(path, &consolidated);
    }
    if path.join("params.json").is_file() && !path.join("config.json").is_file() {
        // torchtune's FullModelMetaCheckpointer saves Meta's tensors as
        // `model-00001-of-00001.bin` beside a copy of params.json (and a LoRA run's
        // `adapter_model.pt`, which is not the model).
        let model: Vec<PathBuf> = pickles
            .iter()
            .filter(|p| {
                !p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("adapter_model."))
            })
            .cloned()
            .collect();
        if !model.is_empty() {
            return locate_listed(path, &model);
        }
    }
    if path.join("config.json").is_file() {
        // One torch.save file beside the config (torchtune's `hf_model_0001_0.pt` of a one-shard
        // model, the quantize recipe's `*-8da4w.pt`); several without an index are ambiguous.
        match pickles.len() {
            0 => {}
            1 => return Ok(CheckpointFormat::Pickle(pickles)),
            n => {
                return Err(ModelError::file(
                    path,
                    format!(
                        "{n} PyTorch checkpoint files and no pytorch_model.bin.index.json: name \
                         the ones to load (checkpointer.checkpoint_files, or the file itself)"
                    ),
                ))
            }
        }
    }
    match ggufs.len() {
        1 => Ok(CheckpointFormat::Gguf(ggufs.remove(0))),
        0 if path.join("adapter_config.json").is_file() => {
            Err(ModelError::file(path, adapter_folder_hint(path)))
        }
        0 => Err(ModelError::file(
            path,
            "no model weights found (expected model.safetensors, model.safetensors.index.json, \
             pytorch_model.bin, pytorch_model.bin.index.json, consolidated.00.pth with \
             params.json, or a .gguf file)",
        )),
        _ => Err(ModelError::file(
            path,
            "several .gguf files: pass the one to load",
        )),
    }
}

/// The files of an HF checkpoint in `dir` in one format: the shards its `index` file lists, or
/// its `single` file, or none of either.
fn indexed_or_single(
    dir: &Path,
    index: &str,
    single: &str,
) -> Result<Option<Vec<PathBuf>>, ModelError> {
    let index = dir.join(index);
    if index.is_file() {
        return Ok(Some(index_shard_files(&index)?));
    }
    let single = dir.join(single);
    Ok(single.is_file().then(|| vec![single]))
}

/// The shard files an HF index (`model.safetensors.index.json`, `pytorch_model.bin.index.json`)
/// lists in its `weight_map`, each checked to exist beside it.
pub fn index_shard_files(index: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let dir = index.parent().unwrap_or(Path::new("."));
    let text = std::fs::read_to_string(index)
        .map_err(|e| ModelError::file(index, format!("cannot read: {e}")))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::file(index, format!("invalid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::file(index, "missing 'weight_map' object"))?;
    let mut files = BTreeSet::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            ModelError::file(index, format!("weight_map['{name}'] is not a file name"))
        })?;
        // A model folder comes from anywhere: its index may only name files inside it (no
        // absolute path, no `..`), so loading it never reads a file elsewhere on the machine.
        let inside = !file.is_empty()
            && !file.contains(['\\', '\0'])
            && Path::new(file)
                .components()
                .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !inside {
            return Err(ModelError::file(
                index,
                format!(
                    "weight_map['{name}'] = {file:?} is not a file inside the model folder \
                     (absolute paths and '..' are refused)"
                ),
            ));
        }
        files.insert(dir.join(file));
    }
    let index_name = index
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    for f in &files {
        if !f.is_file() {
            return Err(ModelError::file(
                f,
                format!("shard listed in {index_name} is missing"),
            ));
        }
    }
    Ok(files.into_iter().collect())
}

/// The format of the weight files `files` (in the checkpoint folder `dir`), as a config's
/// `checkpoint_files` lists them: all safetensors, or all PyTorch pickles (Meta's when `dir` has
/// `params.json` and no `config.json`).
pub fn locate_listed(dir: &Path, files: &[PathBuf]) -> Result<CheckpointFormat, ModelError> {
    let Some(first) = files.first() else {
        return locate_weights(dir);
    };
    let safetensors = |f: &PathBuf| f.extension().is_some_and(|e| e == "safetensors");
    if files.iter().all(safetensors) {
        return Ok(CheckpointFormat::Safetensors(files.to_vec()));
    }
    if !files.iter().all(|f| torch_pickle::is_pickle_file(f)) {
        return Err(ModelError::file(
            first,
            "checkpoint files must be all .safetensors or all PyTorch pickles (.bin, .pt, .pth)",
        ));
    }
    let meta = dir.join("params.json").is_file() && !dir.join("config.json").is_file();
    if !meta {
        if !dir.join("config.json").is_file() {
            return Err(ModelError::file(
                dir,
                "PyTorch checkpoint files need the model's config.json (an HF checkpoint) or \
                 params.json (Meta's format) beside them",
            ));
        }
        return Ok(CheckpointFormat::Pickle(files.to_vec()));
    }
    match files {
        [one] => Ok(CheckpointFormat::Meta(one.clone())),
        _ => Err(ModelError::file(
            dir,
            format!(
                "{} Meta checkpoint files: model-parallel shards are not supported (torchtune \
                 reads one consolidated.00.pth too); use the model's HF checkpoint",
                files.len()
            ),
        )),
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
    read_safetensors_renamed(files, Some(dtype), device, None, &|name| {
        Some(name.to_string())
    })
}

/// A multimodal text model's embedding rows past `vocab_size` (Llama 3.2 Vision's 8 image-token
/// rows, which text alone never looks up; its output head has `vocab_size` rows) are left out:
/// the decoder keeps the text vocabulary, so that what it saves is a plain text model.
fn narrow_multimodal_embedding(
    config: &ModelConfig,
    tensors: &mut HashMap<String, Tensor>,
) -> Result<(), String> {
    let key = "model.embed_tokens.weight";
    if let Some(embed) = tensors.get_mut(key) {
        let rows = embed.dim(0).map_err(|e| format!("{key}: {e}"))?;
        if rows > config.vocab_size {
            tracing::warn!(
                "{key}: its {} rows past vocab_size {} (image tokens) are left out: text alone \
                 never reads them",
                rows - config.vocab_size,
                config.vocab_size
            );
            *embed = embed
                .narrow(0, 0, config.vocab_size)
                .map_err(|e| format!("{key}: {e}"))?;
        }
    }
    Ok(())
}

/// As [`read_safetensors`], keeping only the tensors `rename` maps to a name (under that name);
/// the others are not read at all. `dtype` `None`: as stored. Every tensor read is checked
/// (`weight_checks`): a float type, finite values. MXFP4 weights (gpt-oss's `*_blocks` /
/// `*_scales` bytes) are dequantized into the weight they stand for ([`crate::mxfp4`]), and so
/// are FP8 weights with their `weight_scale_inv` when the config declares `fp8` blocks
/// ([`crate::fp8`]; FP8 weights are refused without).
pub(crate) fn read_safetensors_renamed(
    files: &[PathBuf],
    dtype: Option<DType>,
    device: &Device,
    fp8: Option<crate::fp8::Fp8Blocks>,
    rename: &dyn Fn(&str) -> Option<String>,
) -> Result<HashMap<String, Tensor>, ModelError> {
    read_safetensors_parts(files, dtype, device, fp8, rename, false)
}

/// [`read_safetensors_renamed`]; with `keep_mxfp4`, MXFP4 weights stay as their `*_blocks` /
/// `*_scales` (u8, on the CPU) for the model to hold packed.
fn read_safetensors_parts(
    files: &[PathBuf],
    dtype: Option<DType>,
    device: &Device,
    fp8: Option<crate::fp8::Fp8Blocks>,
    rename: &dyn Fn(&str) -> Option<String>,
    keep_mxfp4: bool,
) -> Result<HashMap<String, Tensor>, ModelError> {
    let mut out = HashMap::new();
    let mut mxfp4_parts = HashMap::new();
    let mut fp8_pending = fp8.map(|blocks| crate::fp8::Pending::new(blocks, dtype, device));
    for file in files {
        // SAFETY: the mapping is read-only and lives only while we copy tensors out of it; a
        // checkpoint file being rewritten underneath us is outside what we can guard against.
        let st = unsafe { MmapedSafetensors::new(file) }
            .map_err(|e| ModelError::file(file, format!("not a valid safetensors file: {e}")))?;
        for (name, view) in st.tensors() {
            let Some(new_name) = rename(&name) else {
                continue;
            };
            let stored = view.dtype();
            if stored == safetensors::Dtype::U8 && crate::mxfp4::is_part(&name) {
                let t = st.load(&name, &Device::Cpu).map_err(|e| {
                    ModelError::file(file, format!("tensor '{name}' ({stored:?}): {e}"))
                })?;
                mxfp4_parts.insert(new_name, (file.clone(), t));
                continue;
            }
            if let Some(part) = fp8_part(file, &name, &new_name, &view, fp8, &st)? {
                let pending = fp8_pending
                    .as_mut()
                    .expect("FP8 parts are read only under fp8 blocks");
                match part {
                    Fp8Part::Weight(raw) => pending.add_weight(new_name, raw, &mut out)?,
                    Fp8Part::Scale(weight, t) => pending.add_scale(weight, t, &mut out)?,
                }
                continue;
            }
            weight_checks::stored_as_float(
                file,
                &name,
                stored,
                weight_checks::safetensors_float(stored),
            )?;
            let t = st.load(&name, device).map_err(|e| {
                ModelError::file(file, format!("tensor '{name}' ({stored:?}): {e}"))
            })?;
            let loaded = t.dtype();
            let t = match dtype {
                Some(dtype) => t.to_dtype(dtype).map_err(|e| {
                    ModelError::file(file, format!("tensor '{name}': cannot convert: {e}"))
                })?,
                None => t,
            };
            weight_checks::finite(file, &name, &t, Some(loaded))?;
            out.insert(new_name, t);
        }
    }
    crate::mxfp4::dequantize_parts(mxfp4_parts, dtype, device, &mut out, keep_mxfp4)?;
    if let Some(pending) = fp8_pending {
        pending.finish()?;
    }
    Ok(out)
}

/// A part of an FP8 weight met while reading a checkpoint.
enum Fp8Part {
    /// The FP8 weight itself, as bytes.
    Weight(crate::fp8::RawFp8),
    /// The scales of the weight named first (with the file they came from).
    Scale(String, (PathBuf, Tensor)),
}

/// The tensor `name` (read as `new_name`) of `file` as a part of an FP8 weight, if it is one:
/// a weight stored `F8_E4M3` (refused unless the config declares `fp8` blocks, and `F8_E5M2`
/// always), or, under `fp8` blocks, a `*_scale_inv` (refused unless stored as a float).
fn fp8_part(
    file: &Path,
    name: &str,
    new_name: &str,
    view: &safetensors::tensor::TensorView,
    fp8: Option<crate::fp8::Fp8Blocks>,
    st: &MmapedSafetensors,
) -> Result<Option<Fp8Part>, ModelError> {
    use safetensors::Dtype as D;
    let stored = view.dtype();
    match (stored, fp8) {
        (D::F8_E4M3, Some(_)) => {
            return Ok(Some(Fp8Part::Weight((
                file.to_path_buf(),
                view.shape().to_vec(),
                view.data().to_vec(),
            ))))
        }
        (D::F8_E4M3 | D::F8_E5M2, _) => {
            let why = if stored == D::F8_E5M2 {
                "e5m2 weights are not read (transformers' FP8 checkpoints are e4m3)"
            } else {
                "config.json declares no FP8 quantization_config (quant_method 'fp8', \
                 weight_block_size) saying how its scales apply"
            };
            return Err(ModelError::file(
                file,
                format!("tensor '{name}' is stored as {stored:?}: {why}"),
            ));
        }
        _ => {}
    }
    let Some(weight) = fp8.and(new_name.strip_suffix(crate::fp8::SCALE_SUFFIX)) else {
        return Ok(None);
    };
    if !matches!(stored, D::F32 | D::BF16 | D::F16 | D::F64) {
        return Err(ModelError::file(
            file,
            format!(
                "tensor '{name}' (FP8 block scales) is stored as {stored:?}: scales are read as \
                 F32, BF16, F16 or F64"
            ),
        ));
    }
    let t = st
        .load(name, &Device::Cpu)
        .map_err(|e| ModelError::file(file, format!("tensor '{name}' ({stored:?}): {e}")))?;
    Ok(Some(Fp8Part::Scale(
        weight.to_string(),
        (file.to_path_buf(), t),
    )))
}

/// A checkpoint of PyTorch pickles (`format` `Pickle`, beside `dir`'s `config.json`) or Meta's
/// file: its config, its tensors under HF names in `dtype` (`None`: as stored; a torchtune-named
/// state dict in its first tensor's type) on `device`, and the layers a `quantize` recipe's file
/// holds quantized.
pub fn read_pickled(
    format: &CheckpointFormat,
    dir: &Path,
    dtype: Option<DType>,
    device: &Device,
) -> Result<
    (
        ModelConfig,
        HashMap<String, Tensor>,
        torchtune_names::QuantizedLinears,
    ),
    ModelError,
> {
    match format {
        CheckpointFormat::Pickle(files) => {
            let config = ModelConfig::from_hf_file(dir)?;
            if config.fp8.is_some() {
                return Err(ModelError::file(
                    dir,
                    "FP8 checkpoints are read from safetensors, not PyTorch .bin files",
                ));
            }
            if config.text_of_multimodal || config.llama4_names {
                return Err(ModelError::file(
                    dir,
                    "a multimodal or Llama 4 model's PyTorch .bin checkpoint is not supported; \
                     use its safetensors",
                ));
            }
            let (tensors, quantized_linears) = read_pickle_shards(
                files,
                |raw| {
                    let dtype = dtype.unwrap_or_else(|| {
                        raw.first().map_or(DType::F32, |(_, t)| t.dtype.candle())
                    });
                    torchtune_names::torchtune_to_hf(&config, raw, dtype, device)
                },
                dtype,
                device,
            )?;
            Ok((config, tensors, quantized_linears))
        }
        CheckpointFormat::Meta(file) => {
            let (config, tensors) = torch_pickle::read_meta(file, dtype, device)?;
            Ok((config, tensors, Vec::new()))
        }
        CheckpointFormat::Safetensors(_) | CheckpointFormat::Gguf(_) => Err(ModelError::file(
            dir,
            "not a PyTorch or Meta pickle checkpoint",
        )),
    }
}

/// Reads pickle files that are shards of one state dict. HF-named tensors are converted to
/// `dtype` (`None`: kept as stored) on `device` as each file is read (its raw bytes dropped tensor by tensor, so that a
/// 7B checkpoint does not sit in memory twice); a torchtune-named state dict (the `quantize`
/// recipe's) is handed whole to `torchtune`, which returns HF tensors and the quantized layers.
pub fn read_pickle_shards(
    files: &[PathBuf],
    torchtune: impl FnOnce(
        Vec<(String, TorchTensor)>,
    ) -> Result<
        (
            HashMap<String, Tensor>,
            crate::torchtune_names::QuantizedLinears,
        ),
        String,
    >,
    dtype: Option<DType>,
    device: &Device,
) -> Result<
    (
        HashMap<String, Tensor>,
        crate::torchtune_names::QuantizedLinears,
    ),
    ModelError,
> {
    let mut hf = HashMap::new();
    let mut tune: Vec<(String, TorchTensor)> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for file in files {
        let tensors = read_torch_file(file)?;
        if tensors.is_empty() {
            return Err(ModelError::file(file, "holds no tensors"));
        }
        let torchtune_names =
            crate::torchtune_names::is_torchtune_state_dict(tensors.iter().map(|(n, _)| n));
        for (name, t) in tensors {
            // HF's own key for a rotary cache some old checkpoints saved; never a weight.
            if name.ends_with("rotary_emb.inv_freq") {
                continue;
            }
            if !seen.insert(name.clone()) {
                return Err(ModelError::file(
                    file,
                    format!("tensor '{name}' is also in an earlier shard"),
                ));
            }
            if torchtune_names || !tune.is_empty() {
                tune.push((name, t));
            } else {
                let t = t.to_weight(file, &name, dtype, device)?;
                hf.insert(name, t);
            }
        }
    }
    if tune.is_empty() {
        return Ok((hf, Vec::new()));
    }
    if !hf.is_empty() {
        return Err(ModelError::file(
            &files[0],
            "the files mix HF and torchtune tensor names",
        ));
    }
    let (tensors, quantized) = torchtune(tune).map_err(|msg| ModelError::file(&files[0], msg))?;
    // torchtune's names are converted whole (its int8 layers included), so its weights are
    // checked once converted.
    for (name, t) in &tensors {
        weight_checks::finite(&files[0], name, t, None)?;
    }
    Ok((tensors, quantized))
}

/// Reads a checkpoint (HF folder, PyTorch or Meta pickle, or GGUF) with tensors in `dtype` on
/// `device`.
pub fn read_checkpoint(
    path: &Path,
    dtype: DType,
    device: &Device,
) -> Result<Checkpoint, ModelError> {
    read(path, &[], dtype, device, false, false)
}

/// [`read_checkpoint`] of exactly the weight files `files` of the folder `path` (a config's
/// `checkpoint_files`; empty: the folder decides).
pub fn read_checkpoint_files(
    path: &Path,
    files: &[PathBuf],
    dtype: DType,
    device: &Device,
) -> Result<Checkpoint, ModelError> {
    read(path, files, dtype, device, false, false)
}

/// [`read_checkpoint_files`] keeping MXFP4 weights (gpt-oss's experts as OpenAI ships them) as
/// their `*_blocks` / `*_scales` bytes rather than dequantized: [`CausalLm::from_tensors`] then
/// holds them packed ([`crate::model::ExpertWeight::Mxfp4`]), a frozen base for LoRA (QLoRA).
/// Other checkpoints read as with [`read_checkpoint_files`].
pub fn read_checkpoint_files_keeping_mxfp4(
    path: &Path,
    files: &[PathBuf],
    dtype: DType,
    device: &Device,
) -> Result<Checkpoint, ModelError> {
    read(path, files, dtype, device, false, true)
}

fn read(
    path: &Path,
    files: &[PathBuf],
    dtype: DType,
    device: &Device,
    keep_packed: bool,
    keep_mxfp4: bool,
) -> Result<Checkpoint, ModelError> {
    let format = if files.is_empty() {
        locate_weights(path)?
    } else {
        locate_listed(path, files)?
    };
    let folder = || {
        if path.is_dir() {
            path.to_path_buf()
        } else {
            path.parent().unwrap_or(Path::new(".")).to_path_buf()
        }
    };
    let (config, tensors, packed, dir, quantized_linears) = match &format {
        CheckpointFormat::Pickle(_) | CheckpointFormat::Meta(_) => {
            let dir = folder();
            let (config, tensors, quantized_linears) =
                read_pickled(&format, &dir, Some(dtype), device)?;
            (
                config,
                tensors,
                PackedWeights::new(),
                dir,
                quantized_linears,
            )
        }
        CheckpointFormat::Gguf(file) => {
            let (config, tensors, packed) = if keep_packed && dtype == DType::F32 {
                crate::gguf::load_gguf_with_packed(file, dtype, device)?
            } else {
                let (config, tensors) = crate::gguf::load_gguf(file, dtype, device)?;
                (config, tensors, PackedWeights::new())
            };
            let dir = file.parent().unwrap_or(Path::new(".")).to_path_buf();
            (config, tensors, packed, dir, Vec::new())
        }
        CheckpointFormat::Safetensors(files) => {
            let dir = folder();
            let mut config = ModelConfig::from_hf_file(&dir)?;
            // Multimodal checkpoints hold their text model under a prefix; Llama 4 names its
            // MLP `feed_forward`: both read under the decoder's names.
            let tensors = if config.text_of_multimodal || config.llama4_names {
                let mut tensors = read_safetensors_parts(
                    files,
                    Some(dtype),
                    device,
                    config.fp8,
                    &|name| config.text_model_name(name),
                    keep_mxfp4,
                )?;
                if config.text_of_multimodal {
                    narrow_multimodal_embedding(&config, &mut tensors)
                        .map_err(|msg| ModelError::file(&dir, msg))?;
                    // Multimodal configs say little reliable about tying (transformers 5 ties on
                    // the top-level flag, which the text config may contradict): the tensors
                    // decide.
                    let tied = !tensors.contains_key("lm_head.weight");
                    config.tie_word_embeddings = tied;
                    if let Some(raw) = config.raw.as_object_mut() {
                        raw.insert("tie_word_embeddings".into(), tied.into());
                    }
                }
                tensors
            } else {
                read_safetensors_parts(
                    files,
                    Some(dtype),
                    device,
                    config.fp8,
                    &|n| Some(n.into()),
                    keep_mxfp4,
                )?
            };
            (config, tensors, PackedWeights::new(), dir, Vec::new())
        }
    };
    Ok(Checkpoint {
        config,
        tensors,
        packed,
        format,
        dir,
        quantized_linears,
    })
}

/// Loads a model for inference from an HF folder or a GGUF file (for an f32 model from a GGUF,
/// quantized matrix weights are also kept in block format: see [`crate::model::Linear`]).
pub fn load_model(
    path: &Path,
    dtype: DType,
    device: &Device,
) -> Result<(CausalLm, PathBuf), ModelError> {
    load_model_files(path, &[], dtype, device)
}

/// [`load_model`] of exactly the weight files `files` of the folder `path` (empty: the folder
/// decides).
pub fn load_model_files(
    path: &Path,
    files: &[PathBuf],
    dtype: DType,
    device: &Device,
) -> Result<(CausalLm, PathBuf), ModelError> {
    let ckpt = read(path, files, dtype, device, true, false)?;
    let source = path.display().to_string();
    let mut model =
        CausalLm::from_tensors_and_packed(ckpt.config, ckpt.tensors, ckpt.packed, &source)?;
    apply_activation_quant(&mut model, &ckpt.quantized_linears)
        .map_err(|msg| ModelError::file(path, msg))?;
    Ok((model, ckpt.dir))
}

/// Marks the quantized linears of a `quantize` recipe's file: their weights already hold the
/// dequantized int4 values; their inputs are quantized to int8 per token, as torchao's
/// `Int8DynActInt4WeightLinear` runs.
pub fn apply_activation_quant(
    model: &mut CausalLm,
    quantized: &[(String, usize)],
) -> Result<(), String> {
    if quantized.is_empty() {
        return Ok(());
    }
    let mut linears: HashMap<String, &mut crate::model::Linear> =
        model.linears_mut().into_iter().collect();
    for (name, group_size) in quantized {
        let linear = linears.get_mut(name).ok_or_else(|| {
            format!("quantized layer '{name}' is not a linear layer of the model")
        })?;
        linear.fake_quant = Some(crate::model::FakeQuant {
            group_size: *group_size,
            enabled: true,
            quantize_weight: false,
        });
    }
    Ok(())
}

/// The decoder's tensors (as [`crate::peft::merged_tensors`] names them, or gradients of them)
/// in the checkpoint layout a saved model has: unchanged, but for Llama 4, whose names go back to
/// `feed_forward.*` ([`ModelConfig::checkpoint_name`]) and whose experts are fused again
/// (`feed_forward.experts.gate_up_proj` `[experts, hidden, 2 × inter]`, gate then up, and
/// `feed_forward.experts.down_proj` `[experts, inter, hidden]`), and for Gemma 4's mixture of
/// experts, fused as its checkpoint holds them (`experts.gate_up_proj` `[experts, 2 × inter,
/// hidden]`, gate rows first, and `experts.down_proj` `[experts, hidden, inter]`), as
/// transformers loads them.
pub fn to_saved_layout(
    config: &ModelConfig,
    tensors: HashMap<String, Tensor>,
) -> Result<HashMap<String, Tensor>, ModelError> {
    let gemma4_moe = config.gemma4_moe().is_some();
    if !config.llama4_names && !gemma4_moe {
        return Ok(tensors);
    }
    // Where a layer's experts sit inside it, and where the fused tensors go.
    let (within, fused_at) = if gemma4_moe {
        (".experts.", "experts")
    } else {
        (".mlp.experts.", "feed_forward.experts")
    };
    // Per MoE layer prefix (`model.layers.N.mlp.experts`), its experts' (gate, up, down).
    type Experts = Vec<[Option<Tensor>; 3]>;
    let mut fused: HashMap<String, Experts> = HashMap::new();
    let mut out = HashMap::with_capacity(tensors.len());
    for (name, t) in tensors {
        let expert = name.split_once(within).and_then(|(layer, rest)| {
            let (e, proj) = rest.split_once('.')?;
            let slot = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
                .iter()
                .position(|p| *p == proj)?;
            Some((
                format!("{layer}.{fused_at}"),
                e.parse::<usize>().ok()?,
                slot,
            ))
        });
        match expert {
            Some((prefix, e, slot)) => {
                let experts = fused.entry(prefix).or_default();
                if experts.len() <= e {
                    experts.resize(e + 1, [None, None, None]);
                }
                experts[e][slot] = Some(t);
            }
            None => {
                out.insert(config.checkpoint_name(&name), t);
            }
        }
    }
    for (prefix, experts) in fused {
        let mut gate_up = Vec::with_capacity(experts.len());
        let mut down = Vec::with_capacity(experts.len());
        for (e, [g, u, d]) in experts.into_iter().enumerate() {
            let (Some(g), Some(u), Some(d)) = (g, u, d) else {
                return Err(ModelError::Msg(format!(
                    "{prefix}: expert {e} lacks one of its gate / up / down projections"
                )));
            };
            if gemma4_moe {
                gate_up.push(Tensor::cat(&[g, u], 0)?);
                down.push(d);
            } else {
                gate_up.push(Tensor::cat(&[g.t()?, u.t()?], 1)?);
                down.push(d.t()?);
            }
        }
        out.insert(
            format!("{prefix}.gate_up_proj"),
            Tensor::stack(&gate_up, 0)?,
        );
        out.insert(format!("{prefix}.down_proj"), Tensor::stack(&down, 0)?);
    }
    Ok(out)
}
