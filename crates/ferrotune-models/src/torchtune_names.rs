//! torchtune's tensor names, both ways: the conversion torchtune's `FullModelHFCheckpointer`
//! applies to an HF checkpoint for the model type (Llama/Mistral/Gemma: q/k rows permuted to
//! interleaved rotary pairs; Qwen2: biases kept, a tied head dropped; Phi-3: fused `qkv_proj` and
//! `gate_up_proj` split), and back. A state dict in torchtune's names that holds torchao's
//! `Int8DynActInt4WeightLinear` buffers (`weight` int8, `scales`, `zeros`: what the `quantize`
//! recipe saves) reads back with each quantized weight dequantized and its layer named, so that
//! the model runs it as torchao does (int8 per-token inputs).

use std::collections::{BTreeMap, HashMap};

use candle_core::{DType, Device, Tensor};

use crate::config::ModelConfig;
use crate::family::{self, TorchtuneLayout};
use crate::torch_pickle::{permute_rotary_to_pairs, unpermute_rotary, TorchDType, TorchTensor};

/// How torchtune's checkpointer converts the model type's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `convert_weights.hf_to_tune`: q/k rows permuted.
    Llama,
    /// `qwen2_hf_to_tune`: names only, biases kept.
    Qwen2,
    /// `phi3_hf_to_tune`: fused projections split.
    Phi3,
}

fn kind(config: &ModelConfig) -> Result<Kind, String> {
    let layout = family::model_type(&config.model_type).and_then(|(_, t)| t.torchtune_weights);
    match layout {
        Some(TorchtuneLayout::Permuted) => Ok(Kind::Llama),
        Some(TorchtuneLayout::Plain) => Ok(Kind::Qwen2),
        Some(TorchtuneLayout::SplitFused) => Ok(Kind::Phi3),
        None => Err(format!(
            "torchtune's tensor names are known for {} checkpoints (the model types torchtune \
             0.6.1's checkpointer converts); this one is '{}'",
            family::and_list(&family::torchtune_model_types(false)),
            config.model_type
        )),
    }
}

/// Per-layer HF → torchtune names shared by every kind (Phi-3's fused ones are split apart).
const LAYER_NAMES: &[(&str, &str)] = &[
    ("self_attn.q_proj.weight", "attn.q_proj.weight"),
    ("self_attn.k_proj.weight", "attn.k_proj.weight"),
    ("self_attn.v_proj.weight", "attn.v_proj.weight"),
    ("self_attn.o_proj.weight", "attn.output_proj.weight"),
    ("mlp.gate_proj.weight", "mlp.w1.weight"),
    ("mlp.up_proj.weight", "mlp.w3.weight"),
    ("mlp.down_proj.weight", "mlp.w2.weight"),
    ("input_layernorm.weight", "sa_norm.scale"),
    ("post_attention_layernorm.weight", "mlp_norm.scale"),
];

/// Qwen2's attention biases.
const QWEN2_BIASES: &[(&str, &str)] = &[
    ("self_attn.q_proj.bias", "attn.q_proj.bias"),
    ("self_attn.k_proj.bias", "attn.k_proj.bias"),
    ("self_attn.v_proj.bias", "attn.v_proj.bias"),
];

/// The per-layer name `tail` renamed by `kind`'s pairs ([`LAYER_NAMES`], and Qwen2's biases):
/// an HF name to torchtune's (`to_tune`), or torchtune's to HF's.
fn layer_rename(kind: Kind, tail: &str, to_tune: bool) -> Option<&'static str> {
    let biases: &[(&str, &str)] = if kind == Kind::Qwen2 {
        QWEN2_BIASES
    } else {
        &[]
    };
    LAYER_NAMES.iter().chain(biases).find_map(|&(hf, tune)| {
        let (from, to) = if to_tune { (hf, tune) } else { (tune, hf) };
        (from == tail).then_some(to)
    })
}

/// The model's HF-named tensors under torchtune's names.
pub fn hf_to_torchtune(
    config: &ModelConfig,
    tensors: HashMap<String, Tensor>,
) -> Result<BTreeMap<String, Tensor>, String> {
    let kind = kind(config)?;
    let (heads, kv, head_dim) = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    );
    let e = |name: &str, err: candle_core::Error| format!("tensor '{name}': {err}");
    let mut out = BTreeMap::new();
    for (name, t) in tensors {
        let unknown = || format!("tensor '{name}' has no torchtune name for this model type");
        let new = match name.as_str() {
            "model.embed_tokens.weight" => "tok_embeddings.weight".to_string(),
            "model.norm.weight" => "norm.scale".to_string(),
            "lm_head.weight" if config.tie_word_embeddings => continue,
            "lm_head.weight" => "output.weight".to_string(),
            _ => {
                let rest = name.strip_prefix("model.layers.").ok_or_else(unknown)?;
                let (layer, tail) = rest.split_once('.').ok_or_else(unknown)?;
                match (tail, kind) {
                    ("self_attn.qkv_proj.weight", Kind::Phi3) => {
                        let (q, k) = (heads * head_dim, kv * head_dim);
                        for (part, start, len) in [("q", 0, q), ("k", q, k), ("v", q + k, k)] {
                            let piece = t.narrow(0, start, len).map_err(|err| e(&name, err))?;
                            out.insert(format!("layers.{layer}.attn.{part}_proj.weight"), piece);
                        }
                        continue;
                    }
                    ("mlp.gate_up_proj.weight", Kind::Phi3) => {
                        let half = t.dim(0).map_err(|err| e(&name, err))? / 2;
                        for (part, start) in [("w1", 0), ("w3", half)] {
                            let piece = t.narrow(0, start, half).map_err(|err| e(&name, err))?;
                            out.insert(format!("layers.{layer}.mlp.{part}.weight"), piece);
                        }
                        continue;
                    }
                    _ => {}
                }
                let tune = layer_rename(kind, tail, true).ok_or_else(unknown)?;
                format!("layers.{layer}.{tune}")
            }
        };
        let t = match kind {
            Kind::Llama if new.ends_with("attn.q_proj.weight") => {
                permute_rotary_to_pairs(&t, heads, head_dim).map_err(|err| e(&name, err))?
            }
            Kind::Llama if new.ends_with("attn.k_proj.weight") => {
                permute_rotary_to_pairs(&t, kv, head_dim).map_err(|err| e(&name, err))?
            }
            _ => t,
        };
        out.insert(new, t);
    }
    Ok(out)
}

/// Whether torchtune's model holds tensor `name` (`*.weight`) as an `nn.Linear`'s weight.
pub fn is_torchtune_linear(name: &str) -> bool {
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

/// Whether a state dict is in torchtune's names (rather than HF's).
pub fn is_torchtune_state_dict<'a>(mut names: impl Iterator<Item = &'a String>) -> bool {
    names.any(|n| n == "tok_embeddings.weight")
}

/// HF module names of quantized linear layers with their group size.
pub type QuantizedLinears = Vec<(String, usize)>;

/// A torchtune-named state dict read back in HF's names and `dtype`, with each quantized linear
/// (torchao's `weight` int8 codes + `scales` + `zeros`) dequantized to `(code − zero) × scale`
/// (float32, then `dtype`); also returns the HF module names of the quantized linears with their
/// group size.
pub fn torchtune_to_hf(
    config: &ModelConfig,
    tensors: Vec<(String, TorchTensor)>,
    dtype: DType,
    device: &Device,
) -> Result<(HashMap<String, Tensor>, QuantizedLinears), String> {
    let kind = kind(config)?;
    let (heads, kv, head_dim) = (
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    );
    let mut by_name: BTreeMap<String, TorchTensor> = tensors.into_iter().collect();
    // Dequantize first: a quantized linear's three buffers become its float weight.
    let mut groups: BTreeMap<String, usize> = BTreeMap::new();
    let quantized: Vec<String> = by_name
        .keys()
        .filter_map(|n| n.strip_suffix(".scales").map(str::to_string))
        .collect();
    let mut floats: BTreeMap<String, Tensor> = BTreeMap::new();
    for base in quantized {
        let take = |by_name: &mut BTreeMap<String, TorchTensor>, suffix: &str| {
            by_name
                .remove(&format!("{base}.{suffix}"))
                .ok_or_else(|| format!("'{base}.scales' without '{base}.{suffix}'"))
        };
        let codes = take(&mut by_name, "weight")?;
        let scales = take(&mut by_name, "scales")?;
        let zeros = take(&mut by_name, "zeros")?;
        if codes.dtype != TorchDType::I8 || codes.shape.len() != 2 {
            return Err(format!(
                "'{base}.weight' is {:?} {:?}, not the int8 matrix of a quantized linear",
                codes.dtype, codes.shape
            ));
        }
        let (rows, cols) = (codes.shape[0], codes.shape[1]);
        let n_groups = scales.shape.get(1).copied().unwrap_or(0);
        if scales.shape != [rows, n_groups] || zeros.shape != scales.shape || n_groups == 0 {
            return Err(format!(
                "'{base}': scales {:?} / zeros {:?} do not match the weight {:?}",
                scales.shape, zeros.shape, codes.shape
            ));
        }
        if cols % n_groups != 0 {
            return Err(format!(
                "'{base}': {cols} inputs do not split into {n_groups} groups"
            ));
        }
        let gs = cols / n_groups;
        let f = |t: &TorchTensor| -> Result<Vec<f32>, String> {
            t.to_tensor(DType::F32, &Device::Cpu)
                .and_then(|t| t.flatten_all()?.to_vec1::<f32>())
                .map_err(|e| format!("'{base}': {e}"))
        };
        let (c, s, z) = (f(&codes)?, f(&scales)?, f(&zeros)?);
        // torchao's dequantize_affine: (code − zero) × scale, in float32.
        let w: Vec<f32> = c
            .iter()
            .enumerate()
            .map(|(i, &code)| {
                let g = (i / cols) * n_groups + (i % cols) / gs;
                (code - z[g]) * s[g]
            })
            .collect();
        let t = Tensor::from_vec(w, (rows, cols), &Device::Cpu).map_err(|e| e.to_string())?;
        floats.insert(format!("{base}.weight"), t);
        groups.insert(base, gs);
    }
    for (name, t) in by_name {
        let t = t
            .to_tensor(DType::F32, &Device::Cpu)
            .map_err(|e| format!("'{name}': {e}"))?;
        floats.insert(name, t);
    }

    let mut out = HashMap::new();
    let mut fused: BTreeMap<String, Vec<(usize, Tensor)>> = BTreeMap::new();
    let e = |name: &str, err: candle_core::Error| format!("tensor '{name}': {err}");
    for (name, t) in floats {
        let unknown = || format!("tensor '{name}' is not a torchtune name for this model type");
        let hf = match name.as_str() {
            "tok_embeddings.weight" => "model.embed_tokens.weight".to_string(),
            "norm.scale" => "model.norm.weight".to_string(),
            "output.weight" => "lm_head.weight".to_string(),
            _ => {
                let rest = name.strip_prefix("layers.").ok_or_else(unknown)?;
                let (layer, tail) = rest.split_once('.').ok_or_else(unknown)?;
                if kind == Kind::Phi3 {
                    // Fused again in HF's order: [q; k; v] and [gate; up].
                    let part = match tail {
                        "attn.q_proj.weight" => Some(("self_attn.qkv_proj.weight", 0)),
                        "attn.k_proj.weight" => Some(("self_attn.qkv_proj.weight", 1)),
                        "attn.v_proj.weight" => Some(("self_attn.qkv_proj.weight", 2)),
                        "mlp.w1.weight" => Some(("mlp.gate_up_proj.weight", 0)),
                        "mlp.w3.weight" => Some(("mlp.gate_up_proj.weight", 1)),
                        _ => None,
                    };
                    if let Some((fused_name, order)) = part {
                        fused
                            .entry(format!("model.layers.{layer}.{fused_name}"))
                            .or_default()
                            .push((order, t));
                        continue;
                    }
                }
                let hf = layer_rename(kind, tail, false).ok_or_else(unknown)?;
                format!("model.layers.{layer}.{hf}")
            }
        };
        let t = match kind {
            Kind::Llama if hf.ends_with("self_attn.q_proj.weight") => {
                let d = t.dim(1).map_err(|err| e(&name, err))?;
                unpermute_rotary(&t, heads, head_dim, d).map_err(|err| e(&name, err))?
            }
            Kind::Llama if hf.ends_with("self_attn.k_proj.weight") => {
                let d = t.dim(1).map_err(|err| e(&name, err))?;
                unpermute_rotary(&t, kv, head_dim, d).map_err(|err| e(&name, err))?
            }
            _ => t,
        };
        out.insert(hf, t);
    }
    for (name, mut parts) in fused {
        parts.sort_by_key(|(order, _)| *order);
        let expected = if name.ends_with("qkv_proj.weight") {
            3
        } else {
            2
        };
        if parts.len() != expected {
            return Err(format!("'{name}': {} of its {expected} parts", parts.len()));
        }
        let pieces: Vec<Tensor> = parts.into_iter().map(|(_, t)| t).collect();
        out.insert(
            name.clone(),
            Tensor::cat(&pieces, 0).map_err(|err| e(&name, err))?,
        );
    }

    // The quantized layers under HF's module names (Phi-3's fused layer once; its parts share
    // the input, so quantizing the input once is the same).
    let mut layers: BTreeMap<String, usize> = BTreeMap::new();
    for (base, gs) in groups {
        let hf = match base.as_str() {
            "output" => "lm_head".to_string(),
            _ => {
                let rest = base.strip_prefix("layers.").unwrap_or(&base);
                let (layer, tail) = rest.split_once('.').unwrap_or((rest, ""));
                let module = match (tail, kind) {
                    ("attn.q_proj" | "attn.k_proj" | "attn.v_proj", Kind::Phi3) => {
                        "self_attn.qkv_proj"
                    }
                    ("mlp.w1" | "mlp.w3", Kind::Phi3) => "mlp.gate_up_proj",
                    _ => LAYER_NAMES
                        .iter()
                        .find(|(_, tune)| tune.strip_suffix(".weight") == Some(tail))
                        .and_then(|(hf, _)| hf.strip_suffix(".weight"))
                        .ok_or_else(|| format!("'{base}' is not a linear layer"))?,
                };
                format!("model.layers.{layer}.{module}")
            }
        };
        if let Some(prev) = layers.insert(hf.clone(), gs) {
            if prev != gs {
                return Err(format!(
                    "'{hf}': parts quantized with group sizes {prev} and {gs}"
                ));
            }
        }
    }
    let out = out
        .into_iter()
        .map(|(n, t)| {
            t.to_dtype(dtype)
                .and_then(|t| t.to_device(device))
                .map(|t| (n.clone(), t))
                .map_err(|err| e(&n, err))
        })
        .collect::<Result<HashMap<_, _>, _>>()?;
    Ok((out, layers.into_iter().collect()))
}
