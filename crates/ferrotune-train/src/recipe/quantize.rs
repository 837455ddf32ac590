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
//! `torch.load(path, weights_only=True)` and by torchao's `Int8DynActInt4WeightLinear`.
//!
//! torchtune's `Int8DynActInt4WeightQuantizer` (without QAT) saves torchao tensor subclasses
//! instead, which only torchao can unpickle; ferrotune writes the same plain buffers for both
//! quantizers. The int4 weight-only quantizers write tinygemm's CUDA-packed layout and are refused.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use ferrotune_models::torch_pickle::{permute_rotary_to_pairs, write_torch_file, TorchTensor};
use ferrotune_models::ModelConfig;
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

/// Runs the recipe; returns the path of the quantized checkpoint.
pub fn run(cfg: &Config) -> Result<PathBuf> {
    // Setup.
    let (mode, groupsize) = quantizer_mode(cfg)?;
    let dtype = setup::dtype(cfg)?;
    let _ = setup::device(cfg)?; // validated; the quantization itself runs on the host
    let out_dir = cfg
        .path("checkpointer.output_dir")?
        .or(cfg.path("output_dir")?)
        .ok_or_else(|| anyhow!("{}: 'checkpointer.output_dir' is required", cfg.origin))?;
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
    let tensors = torchtune_state_dict(&ckpt.config, ckpt.tensors)
        .with_context(|| format!("{}", location.path.display()))?;

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

/// The model's tensors under torchtune's names, as torchtune's checkpointer converts an HF
/// checkpoint for the model type.
pub fn torchtune_state_dict(
    config: &ModelConfig,
    tensors: std::collections::HashMap<String, Tensor>,
) -> Result<BTreeMap<String, Tensor>> {
    #[derive(PartialEq)]
    enum Kind {
        Llama,
        Qwen2,
        Phi3,
    }
    let kind = match config.model_type.as_str() {
        "llama" | "mistral" | "gemma" => Kind::Llama,
        "qwen2" => Kind::Qwen2,
        "phi3" => Kind::Phi3,
        other => bail!(
            "quantize converts llama, mistral, gemma, qwen2 and phi3 checkpoints to torchtune's \
             tensor names (the model types torchtune 0.6.1's checkpointer converts); this one \
             is '{other}'"
        ),
    };
    let (heads, kv, head_dim) = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    );
    let mut out = BTreeMap::new();
    for (name, t) in tensors {
        let unknown = || anyhow!("tensor '{name}' has no torchtune name for this model type");
        let new = match name.as_str() {
            "model.embed_tokens.weight" => "tok_embeddings.weight".to_string(),
            "model.norm.weight" => "norm.scale".to_string(),
            "lm_head.weight" if config.tie_word_embeddings => continue,
            "lm_head.weight" => "output.weight".to_string(),
            _ => {
                let rest = name.strip_prefix("model.layers.").ok_or_else(unknown)?;
                let (layer, tail) = rest.split_once('.').ok_or_else(unknown)?;
                let tune = match (tail, &kind) {
                    ("self_attn.q_proj.weight", Kind::Llama | Kind::Qwen2) => "attn.q_proj.weight",
                    ("self_attn.k_proj.weight", Kind::Llama | Kind::Qwen2) => "attn.k_proj.weight",
                    ("self_attn.v_proj.weight", Kind::Llama | Kind::Qwen2) => "attn.v_proj.weight",
                    ("self_attn.q_proj.bias", Kind::Qwen2) => "attn.q_proj.bias",
                    ("self_attn.k_proj.bias", Kind::Qwen2) => "attn.k_proj.bias",
                    ("self_attn.v_proj.bias", Kind::Qwen2) => "attn.v_proj.bias",
                    ("self_attn.o_proj.weight", _) => "attn.output_proj.weight",
                    ("mlp.gate_proj.weight", Kind::Llama | Kind::Qwen2) => "mlp.w1.weight",
                    ("mlp.up_proj.weight", Kind::Llama | Kind::Qwen2) => "mlp.w3.weight",
                    ("mlp.down_proj.weight", _) => "mlp.w2.weight",
                    ("input_layernorm.weight", _) => "sa_norm.scale",
                    ("post_attention_layernorm.weight", _) => "mlp_norm.scale",
                    ("self_attn.qkv_proj.weight", Kind::Phi3) => {
                        let (q, k) = (heads * head_dim, kv * head_dim);
                        for (part, start, len) in [("q", 0, q), ("k", q, k), ("v", q + k, k)] {
                            out.insert(
                                format!("layers.{layer}.attn.{part}_proj.weight"),
                                t.narrow(0, start, len)?,
                            );
                        }
                        continue;
                    }
                    ("mlp.gate_up_proj.weight", Kind::Phi3) => {
                        let half = t.dim(0)? / 2;
                        out.insert(
                            format!("layers.{layer}.mlp.w1.weight"),
                            t.narrow(0, 0, half)?,
                        );
                        out.insert(
                            format!("layers.{layer}.mlp.w3.weight"),
                            t.narrow(0, half, half)?,
                        );
                        continue;
                    }
                    _ => return Err(unknown()),
                };
                format!("layers.{layer}.{tune}")
            }
        };
        let t = match (&kind, new.rsplit_once('.').map(|(m, _)| m)) {
            (Kind::Llama, Some(m)) if m.ends_with("attn.q_proj") && new.ends_with("weight") => {
                permute_rotary_to_pairs(&t, heads, head_dim)?
            }
            (Kind::Llama, Some(m)) if m.ends_with("attn.k_proj") && new.ends_with("weight") => {
                permute_rotary_to_pairs(&t, kv, head_dim)?
            }
            _ => t,
        };
        out.insert(new, t);
    }
    Ok(out)
}

/// Named tensors as `torch.save` writes them.
pub type StateDict = Vec<(String, TorchTensor)>;

/// Whether torchtune's model holds tensor `name` (`*.weight`) as an `nn.Linear`'s weight.
fn is_linear(name: &str) -> bool {
    name == "output.weight"
        || [
            "_proj.weight",
            ".mlp.w1.weight",
            ".mlp.w2.weight",
            ".mlp.w3.weight",
        ]
        .iter()
        .any(|s| name.ends_with(s))
}

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
        if !is_linear(name) {
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
