//! Reading PyTorch checkpoints written by `torch.save`: HF's `pytorch_model*.bin` (and torchtune's
//! `hf_model_*.pt`), which carry HF tensor names beside a `config.json`, and Meta's original
//! `consolidated.00.pth` + `params.json` (torchtune's `FullModelMetaCheckpointer`).
//!
//! The zip-and-pickle container is parsed by candle's reader (`candle_core::pickle`); what is ours
//! is the glue: shard lists, the Meta names and config, and the rotary layout of Meta's q/k rows.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::pickle::PthTensors;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::config::ModelConfig;
use crate::error::ModelError;

/// Whether `path` names a PyTorch pickle checkpoint file (`.bin`, `.pt`, `.pth`).
pub fn is_pickle_file(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("bin" | "pt" | "pth")
    )
}

/// The tensors of one `torch.save` file, under their names in the file, in `dtype` on `device`.
pub fn read_pickle_file(
    file: &Path,
    dtype: DType,
    device: &Device,
) -> Result<HashMap<String, Tensor>, ModelError> {
    let pth = open(file)?;
    let mut names: Vec<&String> = pth.tensor_infos().keys().collect();
    names.sort();
    let mut out = HashMap::with_capacity(names.len());
    for name in names {
        let t = pth
            .get(name)
            .map_err(|e| ModelError::file(file, format!("tensor '{name}': {e}")))?
            .ok_or_else(|| ModelError::file(file, format!("tensor '{name}' vanished")))?;
        let t = t
            .to_dtype(dtype)
            .and_then(|t| t.to_device(device))
            .map_err(|e| ModelError::file(file, format!("tensor '{name}': cannot convert: {e}")))?;
        out.insert(name.clone(), t);
    }
    Ok(out)
}

fn open(file: &Path) -> Result<PthTensors, ModelError> {
    let pth = PthTensors::new(file, None).map_err(|e| {
        ModelError::file(
            file,
            format!(
                "not a readable PyTorch checkpoint ({e}); expected a zip file written by \
                 torch.save (PyTorch 1.6 or later) holding a state dict of tensors"
            ),
        )
    })?;
    if pth.tensor_infos().is_empty() {
        return Err(ModelError::file(
            file,
            "holds no tensors ferrotune can read (a state dict of float32/float16/bfloat16 tensors)",
        ));
    }
    Ok(pth)
}

/// Reads HF-named pickle files (shards of one state dict) into one map.
pub fn read_hf_pickles(
    files: &[PathBuf],
    dtype: DType,
    device: &Device,
) -> Result<HashMap<String, Tensor>, ModelError> {
    let mut out = HashMap::new();
    for file in files {
        for (name, t) in read_pickle_file(file, dtype, device)? {
            // HF's own key for a rotary cache some old checkpoints saved; never a weight.
            if name.ends_with("rotary_emb.inv_freq") {
                continue;
            }
            if out.insert(name.clone(), t).is_some() {
                return Err(ModelError::file(
                    file,
                    format!("tensor '{name}' is also in an earlier shard"),
                ));
            }
        }
    }
    Ok(out)
}

/// The shard files listed by `pytorch_model.bin.index.json`.
pub fn pickle_index_files(index: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let dir = index.parent().unwrap_or(Path::new("."));
    let text = std::fs::read_to_string(index)
        .map_err(|e| ModelError::file(index, format!("cannot read: {e}")))?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::file(index, format!("invalid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| ModelError::file(index, "missing 'weight_map' object"))?;
    let mut files = std::collections::BTreeSet::new();
    for (name, file) in map {
        let file = file.as_str().ok_or_else(|| {
            ModelError::file(index, format!("weight_map['{name}'] is not a file name"))
        })?;
        files.insert(dir.join(file));
    }
    for f in &files {
        if !f.is_file() {
            return Err(ModelError::file(
                f,
                format!("shard listed in {} is missing", index.display()),
            ));
        }
    }
    Ok(files.into_iter().collect())
}

/// A Meta checkpoint (`consolidated.00.pth`, with `params.json` beside it) as an HF Llama model:
/// its config, and its tensors under HF names with the q/k rows in HF's rotary layout.
///
/// Meta's q/k rows hold each head's rotary pairs interleaved (`[x0, x1]` = one complex number);
/// transformers' Llama rotates halves, so its converter permutes the rows of every head from
/// `[pairs, 2]` to `[2, pairs]`, and so do we. Meta's `params.json` has no rope scaling factor:
/// Llama 3.1/3.3 use 8 and Llama 3.2 (the 1B/3B models, the only ones with the output tied to the
/// embeddings) 32, as transformers' configs and torchtune's builders do; `rope_scaling_factor` in
/// `params.json` wins when present.
pub fn read_meta(
    file: &Path,
    dtype: DType,
    device: &Device,
) -> Result<(ModelConfig, HashMap<String, Tensor>), ModelError> {
    let dir = file.parent().unwrap_or(Path::new("."));
    let params_path = dir.join("params.json");
    let text = std::fs::read_to_string(&params_path)
        .map_err(|e| ModelError::file(&params_path, format!("cannot read: {e}")))?;
    let params: Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::file(&params_path, format!("invalid JSON: {e}")))?;
    let perr = |msg: String| ModelError::file(&params_path, msg);
    let int = |key: &str| -> Result<Option<usize>, ModelError> {
        match params.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|n| Some(n as usize))
                .ok_or_else(|| perr(format!("'{key}' must be a positive integer, got {v}"))),
        }
    };
    let float = |key: &str| -> Result<Option<f64>, ModelError> {
        match params.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| perr(format!("'{key}' must be a number, got {v}"))),
        }
    };
    let dim = int("dim")?.ok_or_else(|| perr("missing 'dim'".into()))?;
    let n_layers = int("n_layers")?.ok_or_else(|| perr("missing 'n_layers'".into()))?;
    let n_heads = int("n_heads")?.ok_or_else(|| perr("missing 'n_heads'".into()))?;
    let n_kv_heads = int("n_kv_heads")?.unwrap_or(n_heads);
    if n_heads == 0 || dim % n_heads != 0 || n_kv_heads == 0 || n_heads % n_kv_heads != 0 {
        return Err(perr(format!(
            "dim {dim}, n_heads {n_heads}, n_kv_heads {n_kv_heads} do not split into heads"
        )));
    }
    let head_dim = dim / n_heads;
    let norm_eps = float("norm_eps")?.unwrap_or(1e-5);
    let rope_theta = float("rope_theta")?.unwrap_or(10000.0);
    let scaled_rope = params
        .get("use_scaled_rope")
        .and_then(Value::as_bool)
        .unwrap_or(false);

    let raw = read_pickle_file(file, dtype, device)?;
    let mut tensors = HashMap::with_capacity(raw.len());
    let mut output = None;
    for (name, t) in raw {
        if name == "rope.freqs" {
            // Llama 2's precomputed rotary frequencies: derived from rope_theta, not a weight.
            continue;
        }
        if name == "output.weight" {
            output = Some(t);
            continue;
        }
        let hf = meta_to_hf_name(&name).ok_or_else(|| {
            ModelError::file(
                file,
                format!("unexpected tensor '{name}' for a Meta Llama checkpoint"),
            )
        })?;
        let t = if name.ends_with("attention.wq.weight") {
            unpermute_rotary(&t, n_heads, head_dim, dim)
        } else if name.ends_with("attention.wk.weight") {
            unpermute_rotary(&t, n_kv_heads, head_dim, dim)
        } else {
            Ok(t)
        }
        .map_err(|e| ModelError::file(file, format!("tensor '{name}': {e}")))?;
        tensors.insert(hf, t);
    }
    let embed = tensors
        .get("model.embed_tokens.weight")
        .ok_or_else(|| ModelError::file(file, "missing tensor 'tok_embeddings.weight'"))?;
    let vocab = embed.dim(0)?;
    let tied = match &output {
        None => true,
        Some(out) => same_values(out, embed)?,
    };
    if let (Some(out), false) = (output, tied) {
        tensors.insert("lm_head.weight".into(), out);
    }
    let intermediate = tensors
        .get("model.layers.0.mlp.gate_proj.weight")
        .ok_or_else(|| ModelError::file(file, "missing tensor 'layers.0.feed_forward.w1.weight'"))?
        .dim(0)?;
    let rope_scaling = if scaled_rope {
        let factor = float("rope_scaling_factor")?.unwrap_or(if tied { 32.0 } else { 8.0 });
        json!({
            "rope_type": "llama3",
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        })
    } else {
        Value::Null
    };
    // Meta's files carry no context length: Llama 3.1+ (scaled rope) 131072, Llama 3 8192,
    // Llama 2 4096, as their HF configs say.
    let max_positions = if scaled_rope {
        131072
    } else if rope_theta >= 500000.0 {
        8192
    } else {
        4096
    };
    let stored = match dtype_of_file(file)? {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    };
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": dim,
        "intermediate_size": intermediate,
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": max_positions,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "torch_dtype": stored,
    });
    let config = ModelConfig::from_hf_json(&config).map_err(perr)?;
    let present = (0..n_layers)
        .filter(|i| tensors.contains_key(&format!("model.layers.{i}.input_layernorm.weight")))
        .count();
    if present != n_layers {
        return Err(ModelError::file(
            file,
            format!("params.json says {n_layers} layers, the checkpoint holds {present}"),
        ));
    }
    Ok((config, tensors))
}

/// The dtype the file stores its (first) tensor in.
fn dtype_of_file(file: &Path) -> Result<DType, ModelError> {
    let pth = open(file)?;
    let mut infos: Vec<_> = pth.tensor_infos().values().collect();
    infos.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(infos.first().map(|i| i.dtype).unwrap_or(DType::F32))
}

fn same_values(a: &Tensor, b: &Tensor) -> Result<bool, ModelError> {
    if a.shape() != b.shape() {
        return Ok(false);
    }
    let ne = a
        .ne(b)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()?;
    Ok(ne == 0.0)
}

/// Meta's Llama tensor names in HF's form.
fn meta_to_hf_name(name: &str) -> Option<String> {
    match name {
        "tok_embeddings.weight" => return Some("model.embed_tokens.weight".into()),
        "norm.weight" => return Some("model.norm.weight".into()),
        _ => {}
    }
    let rest = name.strip_prefix("layers.")?;
    let (layer, tail) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let hf = match tail {
        "attention.wq.weight" => "self_attn.q_proj.weight",
        "attention.wk.weight" => "self_attn.k_proj.weight",
        "attention.wv.weight" => "self_attn.v_proj.weight",
        "attention.wo.weight" => "self_attn.o_proj.weight",
        "feed_forward.w1.weight" => "mlp.gate_proj.weight",
        "feed_forward.w2.weight" => "mlp.down_proj.weight",
        "feed_forward.w3.weight" => "mlp.up_proj.weight",
        "attention_norm.weight" => "input_layernorm.weight",
        "ffn_norm.weight" => "post_attention_layernorm.weight",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}"))
}

/// Rows `[heads, pairs, 2, dim]` (Meta's interleaved rotary pairs) to `[heads, 2, pairs, dim]`
/// (HF's halves).
fn unpermute_rotary(
    t: &Tensor,
    heads: usize,
    head_dim: usize,
    dim: usize,
) -> candle_core::Result<Tensor> {
    if t.dims() != [heads * head_dim, dim] {
        candle_core::bail!(
            "shape {:?}, expected [{}, {dim}] from params.json",
            t.dims(),
            heads * head_dim
        );
    }
    t.reshape((heads, head_dim / 2, 2, dim))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape((heads * head_dim, dim))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn meta_names_map_to_hf() {
        assert_eq!(
            meta_to_hf_name("layers.3.feed_forward.w2.weight").as_deref(),
            Some("model.layers.3.mlp.down_proj.weight")
        );
        assert_eq!(
            meta_to_hf_name("layers.0.attention_norm.weight").as_deref(),
            Some("model.layers.0.input_layernorm.weight")
        );
        assert_eq!(meta_to_hf_name("layers.x.attention.wq.weight"), None);
        assert_eq!(meta_to_hf_name("layers.0.attention.inner_attention"), None);
    }

    #[test]
    fn rotary_rows_go_from_pairs_to_halves() {
        // One head of dim 4 (two pairs) over 1 input: Meta rows [a0, b0, a1, b1] (pairs (a, b)),
        // HF rows [a0, a1, b0, b1].
        let t = Tensor::new(&[[0f32], [1.], [2.], [3.]], &Device::Cpu).unwrap();
        let hf = unpermute_rotary(&t, 1, 4, 1).unwrap();
        assert_eq!(
            hf.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [0., 2., 1., 3.]
        );
    }
}
