//! Loading a model for inference: the checkpoint (HF folder, GGUF, `torch.save`, a `quantize`
//! recipe's file), optionally its base quantized to NF4 for a QLoRA adapter, the adapter applied
//! without merging, and the decoder layers spread over the visible GPUs.

use std::path::{Path, PathBuf};

use anyhow::Result;
use candle_core::{DType, Device};
use ferrotune_models::{CausalLm, DeviceMapMode};

use crate::spread::spread_model;

/// What [`load_for_inference`] loads and where.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// The weight files of the checkpoint folder to read (empty: the folder decides).
    pub files: Vec<PathBuf>,
    /// Compute dtype.
    pub dtype: DType,
    /// Where the model runs (ignored with `device_map`: the model is read into host memory, then
    /// spread).
    pub device: Device,
    /// Quantize the base to NF4 before the adapter goes on: a QLoRA adapter runs on the NF4 base
    /// it was trained on.
    pub quantize_base: bool,
    /// A LoRA/DoRA adapter (PEFT folder or torchtune's `adapter_model.pt`), applied unmerged.
    pub adapter: Option<PathBuf>,
    /// The alpha of a torchtune adapter with no `adapter_config.json` beside it.
    pub lora_alpha: Option<f64>,
    /// Spread the decoder layers over the visible GPUs, as Accelerate's `device_map`, and the
    /// setting that asked for it (`--device-map`, `device: cuda`), named in its messages.
    pub device_map: Option<(DeviceMapMode, String)>,
}

/// Loads the causal language model at `path` for inference. `check` sees the base as read, before
/// it is quantized or adapted (the recipes check it against their config there).
pub fn load_for_inference(
    path: &Path,
    opts: &LoadOptions,
    check: impl FnOnce(&CausalLm) -> Result<()>,
) -> Result<CausalLm> {
    // Spread over the GPUs: read into host memory, then move layer by layer.
    let load_device = match opts.device_map {
        Some(_) => Device::Cpu,
        None => opts.device.clone(),
    };
    let (mut model, _) =
        ferrotune_models::load_model_files(path, &opts.files, opts.dtype, &load_device)?;
    model
        .config
        .require_language_model()
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    check(&model)?;
    if opts.quantize_base {
        // Before the adapter: DoRA's magnitude is of the quantized weight, as in training.
        eprintln!("QLoRA: {}", model.quantize_base_nf4()?);
    }
    if let Some(dir) = &opts.adapter {
        ferrotune_models::peft::load_adapter_from(&mut model, dir, opts.lora_alpha)?;
    }
    if let Some((mode, setting)) = &opts.device_map {
        // After the adapter: dispatch moves adapter tensors along with their layers.
        spread_model(&mut model, *mode, setting)?;
    }
    Ok(model)
}
