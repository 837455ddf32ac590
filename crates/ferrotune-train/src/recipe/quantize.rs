//! `quantize`: torchtune's post-training quantization recipe (`tune run quantize --config
//! quantization`), for the int8-dynamic-activation / int4-weight scheme ("8da4w") torchtune's QAT
//! recipes train for.
//!
//! Setup: the checkpoint (`checkpointer`, any format ferrotune reads) in `dtype`, converted to
//! torchtune's tensor names by the conversion torchtune's `FullModelHFCheckpointer` applies for
//! the model type (Llama/Mistral/Gemma: q/k rows permuted to interleaved rotary pairs; Qwen2: as
//! is, a tied head dropped; Phi-3: fused `qkv_proj` and `gate_up_proj` split). Quantize: every
//! linear layer whose input size is a multiple of `quantizer.groupsize` becomes torchao's
//! `Int8DynActInt4WeightLinear` buffers — `weight` int8 codes in [−8, 7], `scales` float32 and
//! `zeros` float32 per group of `groupsize` inputs — computed as torchao's
//! `Int8DynActInt4WeightQATQuantizer.convert` computes them (symmetric: scale = max|w| / 7.5 in
//! the weights' dtype, at least the smallest normal, stored as float32; codes =
//! round-half-even(w × (1 / scale)) clamped);
//! other linears stay as they are (torchao skips them too). Checkpoint: the state dict as
//! `torch.save` writes it, `{output_dir}/{first checkpoint file's stem}-8da4w.pt`, read by
//! `torch.load(path, weights_only=True)` and by torchao's `Int8DynActInt4WeightLinear`, with the
//! source's `config.json` and tokenizer files beside it.
//!
//! torchtune's `Int8DynActInt4WeightQuantizer` (without QAT) saves torchao tensor subclasses
//! instead, which only torchao can unpickle; ferrotune writes the same plain buffers for both
//! quantizers. The int4 weight-only quantizers write tinygemm's CUDA-packed layout and are refused.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use ferrotune_models::torch_pickle::{write_torch_file, TorchTensor};
use ferrotune_models::torchtune_names::{hf_to_torchtune, is_torchtune_linear};
use rayon::prelude::*;

use crate::config::Config;
use crate::recipe::setup;

/// The recipe's name.
pub const RECIPE: &str = "quantize";

/// torchtune's quantizers and the mode each writes into the file name.
fn quantizer_mode(cfg: &Config) -> Result<(&'static str, usize)> {
    let component = cfg.str("quantizer._component_")?.ok_or_else(|| {
        anyhow!(
            "{}: 'quantizer._component_' is required (torchtune.training.quantization.\
             Int8DynActInt4WeightQuantizer or Int8DynActInt4WeightQATQuantizer)",
            cfg.origin
        )
    })?;
    let short = component.rsplit('.').next().unwrap_or(&component);
    let mode = match short {
        "Int8DynActInt4WeightQuantizer" => "8da4w",
        "Int8DynActInt4WeightQATQuantizer" | "Int8DynActInt4WeightQATQuantizerModuleSwap" => {
            "8da4w-qat"
        }
        "Int4WeightOnlyQuantizer"
        | "Int4WeightOnlyQATQuantizer"
        | "Int4WeightOnlyQATQuantizerModuleSwap" => bail!(
            "{}: quantizer._component_ '{component}' writes tinygemm's CUDA-packed int4 layout, \
             which ferrotune does not produce; use Int8DynActInt4WeightQuantizer (or \
             `ferrotune export-gguf --outtype q4_k_m` for a 4-bit model llama.cpp runs)",
            cfg.origin
        ),
        _ => bail!(
            "{}: quantizer._component_ '{component}' is not supported \
             (Int8DynActInt4WeightQuantizer, Int8DynActInt4WeightQATQuantizer)",
            cfg.origin
        ),
    };
    let groupsize = match cfg.usize("quantizer.groupsize")? {
        Some(g) if g < 2 => bail!("{}: quantizer.groupsize must be at least 2", cfg.origin),
        Some(g) => g,
        None => 256,
    };
    Ok((mode, groupsize))
}

/// The recipe's own keys, read and checked once before anything is loaded (what `validate`
/// checks too).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// The quantizer's mode, as the file name says it (`8da4w`, `8da4w-qat`).
    pub mode: &'static str,
    /// `quantizer.groupsize` (default 256): inputs per int4 group.
    pub groupsize: usize,
    /// Where the checkpoint goes (`checkpointer.output_dir`, else `output_dir`).
    pub out_dir: PathBuf,
}

impl Settings {
    /// Reads the settings from `cfg`, with run's messages.
    pub fn parse(cfg: &Config) -> Result<Settings> {
        let (mode, groupsize) = quantizer_mode(cfg)?;
        let out_dir = cfg
            .path("checkpointer.output_dir")?
            .or(cfg.path("output_dir")?)
            .ok_or_else(|| anyhow!("{}: 'checkpointer.output_dir' is required", cfg.origin))?;
        Ok(Settings {
            mode,
            groupsize,
            out_dir,
        })
    }
}

/// Checks the recipe's own keys without loading anything (for `validate`).
pub fn check(cfg: &Config) -> Result<()> {
    Settings::parse(cfg).map(|_| ())
}

/// Runs the recipe; returns the path of the quantized checkpoint.
pub fn run(cfg: &Config) -> Result<PathBuf> {
    // Setup.
    let Settings {
        mode,
        groupsize,
        out_dir,
    } = Settings::parse(cfg)?;
    let dtype = setup::dtype(cfg)?;
    // The quantization is host work either way; torchtune's config says `device: cuda`, which a
    // CPU-only build or machine cannot give, and need not.
    if let Err(e) = setup::device(cfg) {
        eprintln!("note: {e}; quantizing on the CPU");
    }
    let location = setup::checkpoint_path(cfg)?;
    let ckpt = ferrotune_models::read_checkpoint_files(
        &location.path,
        &location.files,
        dtype,
        &Device::Cpu,
    )?;
    setup::check_model_component(cfg, &ckpt.config)?;
    ckpt.config
        .require_language_model()
        .map_err(|e| anyhow!("{}: {e}", location.path.display()))?;
    eprintln!("Model is initialized with precision {dtype:?}.");
    if !ckpt.quantized_linears.is_empty() {
        bail!(
            "{}: {} is already quantized (a quantize run's output)",
            cfg.origin,
            location.path.display()
        );
    }
    let config = ckpt.config.clone();
    let source = ferrotune_export::hf::ModelSource {
        format: ckpt.format.clone(),
        dir: ckpt.dir.clone(),
    };
    let tensors = hf_to_torchtune(&ckpt.config, ckpt.tensors)
        .map_err(|e| anyhow!("{}: {e}", location.path.display()))?;

    // Quantize.
    let t0 = Instant::now();
    let (state, skipped) = quantize_8da4w(&tensors, groupsize)?;
    eprintln!(
        "Time for quantization: {:.02} sec",
        t0.elapsed().as_secs_f64()
    );
    if !skipped.is_empty() {
        eprintln!(
            "note: {} linear layers have an input size that is not a multiple of \
             quantizer.groupsize {groupsize} and stay unquantized (as torchao leaves them): {}",
            skipped.len(),
            skipped.join(", ")
        );
    }

    // Checkpoint.
    let stem = checkpoint_stem(&location)?;
    // torchtune: f"{file_name}-{mode}".rstrip("-qat"), then the suffix .pt.
    let name = format!("{stem}-{mode}");
    let name = name.trim_end_matches(['-', 'q', 'a', 't']);
    std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("{}: cannot create", out_dir.display()))?;
    let file = out_dir.join(format!("{name}.pt"));
    write_torch_file(&file, &state)?;
    // torchtune's builders know the architecture; ferrotune reads it from the config beside the
    // file, so that generate and eleuther_eval (and `ferrotune generate --model FILE`) run it.
    let dtype_name = if dtype == DType::BF16 {
        "bfloat16"
    } else {
        "float32"
    };
    ferrotune_models::save::write_atomic(
        &out_dir.join("config.json"),
        ferrotune_models::save::config_json(&config, dtype_name).as_bytes(),
    )?;
    // And its tokenizer, so that the folder runs as it is (`ferrotune generate --model FILE`).
    ferrotune_export::hf::copy_or_export_tokenizer(&source, None, &out_dir)?;
    let size = std::fs::metadata(&file).map(|m| m.len()).unwrap_or(0);
    eprintln!(
        "Model checkpoint of size {:.2} GiB saved to {}",
        size as f64 / (1u64 << 30) as f64,
        file.display()
    );
    Ok(file)
}

/// The stem torchtune names the output after: the first checkpoint file's name up to its first
/// dot (or the file the folder's weights come from).
fn checkpoint_stem(location: &setup::CheckpointLocation) -> Result<String> {
    let first = match location.files.first() {
        Some(f) => f.clone(),
        None => match ferrotune_models::checkpoint::locate_weights(&location.path)? {
            ferrotune_models::CheckpointFormat::Safetensors(f)
            | ferrotune_models::CheckpointFormat::Pickle(f) => f[0].clone(),
            ferrotune_models::CheckpointFormat::Meta(f)
            | ferrotune_models::CheckpointFormat::Gguf(f) => f,
        },
    };
    let name = first
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("model");
    Ok(name.split('.').next().unwrap_or("model").to_string())
}

/// Named tensors as `torch.save` writes them.
pub type StateDict = Vec<(String, TorchTensor)>;

/// torchtune's state dict after torchao's 8da4w conversion: each linear weight whose input size
/// is a multiple of `groupsize` as `weight` (int8), `scales` and `zeros` (float32); every other
/// tensor as it is. Also returns the linears left unquantized.
pub fn quantize_8da4w(
    tensors: &BTreeMap<String, Tensor>,
    groupsize: usize,
) -> Result<(StateDict, Vec<String>)> {
    let mut out = Vec::new();
    let mut skipped = Vec::new();
    for (name, t) in tensors {
        if !is_torchtune_linear(name) {
            out.push((name.clone(), TorchTensor::from_tensor(t)?));
            continue;
        }
        let (rows, cols) = t.dims2()?;
        if cols % groupsize != 0 {
            skipped.push(name.trim_end_matches(".weight").to_string());
            out.push((name.clone(), TorchTensor::from_tensor(t)?));
            continue;
        }
        let w = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let groups = cols / groupsize;
        let (codes, scales) = quantize_groups_int4(&w, groupsize, t.dtype() == DType::BF16);
        let base = name.trim_end_matches(".weight");
        out.push((
            format!("{base}.weight"),
            TorchTensor::from_i8(vec![rows, cols], &codes),
        ));
        let scales = Tensor::from_vec(scales, (rows, groups), &Device::Cpu)?;
        out.push((format!("{base}.scales"), TorchTensor::from_tensor(&scales)?));
        let zeros = Tensor::zeros((rows, groups), DType::F32, &Device::Cpu)?;
        out.push((format!("{base}.zeros"), TorchTensor::from_tensor(&zeros)?));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((out, skipped))
}

/// Symmetric int4 codes of `w` (row-major, groups of `groupsize` consecutive values) and one
/// scale per group, as torchao's `get_group_qparams_symmetric` + `quantize_per_channel_group` in
/// float32: scale = max(−min(min, 0), max(max, 0)) / 7.5 (rounded to bf16 when the weights are
/// bf16, as torch computes it in the weights' dtype), at least the smallest normal; code =
/// clamp(round-half-even(w × (1 / scale)), −8, 7) in float32.
pub fn quantize_groups_int4(w: &[f32], groupsize: usize, bf16_scale: bool) -> (Vec<i8>, Vec<f32>) {
    let mut codes = vec![0i8; w.len()];
    let mut scales = vec![0f32; w.len() / groupsize];
    codes
        .par_chunks_mut(groupsize)
        .zip(scales.par_iter_mut())
        .zip(w.par_chunks(groupsize))
        .for_each(|((codes, scale), w)| {
            let (mut lo, mut hi) = (0f32, 0f32);
            for &v in w {
                lo = lo.min(v);
                hi = hi.max(v);
            }
            let mut s = (-lo).max(hi) / 7.5;
            if bf16_scale {
                s = half::bf16::from_f32(s).to_f32();
            }
            let s = s.max(f32::MIN_POSITIVE);
            *scale = s;
            // torch's quantize_per_channel_group multiplies by the reciprocal (not a division:
            // the two round differently).
            let inv = 1.0 / s;
            for (c, &v) in codes.iter_mut().zip(w) {
                *c = (v * inv).round_ties_even().clamp(-8.0, 7.0) as i8;
            }
        });
    (codes, scales)
}
