//! Writing HF checkpoints: `config.json`, `generation_config.json` and the weights as
//! `model.safetensors`, or shards `model-0000i-of-0000n.safetensors` with
//! `model.safetensors.index.json` — the layout `save_pretrained` writes and transformers loads.
//! Every file is written atomically (a temporary file in the same folder, then a rename).

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};

use crate::config::ModelConfig;
use crate::error::ModelError;

/// Writes through a temporary file in `path`'s folder and renames it into place, so a crash never
/// leaves a truncated file under the final name.
pub fn write_atomic_with(
    path: &Path,
    write: impl FnOnce(&Path) -> Result<(), String>,
) -> Result<(), ModelError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp{}", std::process::id()));
    if let Err(msg) = write(&tmp) {
        let _ = std::fs::remove_file(&tmp);
        return Err(ModelError::file(path, format!("cannot write: {msg}")));
    }
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        ModelError::file(
            path,
            format!("cannot move the written file into place: {e}"),
        )
    })
}

/// [`write_atomic_with`] for bytes already in memory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), ModelError> {
    write_atomic_with(path, |tmp| {
        std::fs::write(tmp, bytes).map_err(|e| e.to_string())
    })
}

/// The model's `config.json` text with its weights' dtype (`float32`, `bfloat16`, ...) under both
/// spellings transformers reads (`torch_dtype` for 4.x, `dtype` for 5.x).
pub fn config_json(config: &ModelConfig, dtype_name: &str) -> String {
    let mut raw = config.raw.clone();
    if let Some(obj) = raw.as_object_mut() {
        obj.insert("torch_dtype".into(), json!(dtype_name));
        obj.insert("dtype".into(), json!(dtype_name));
    }
    serde_json::to_string_pretty(&raw).expect("JSON values serialize")
}

/// Parses a shard size as transformers does: `5GB` = 5·10⁹ bytes, `5GiB` = 5·2³⁰, also `MB`,
/// `MiB`, `KB`, `KiB`, `B`, or a plain number of bytes.
pub fn parse_shard_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let units: [(&str, f64); 7] = [
        ("GiB", (1u64 << 30) as f64),
        ("MiB", (1u64 << 20) as f64),
        ("KiB", 1024.0),
        ("GB", 1e9),
        ("MB", 1e6),
        ("KB", 1e3),
        ("B", 1.0),
    ];
    let (number, scale) = units
        .iter()
        .find_map(|(u, s)| t.strip_suffix(u).map(|n| (n.trim(), *s)))
        .unwrap_or((t, 1.0));
    let value: f64 = number.parse().map_err(|_| {
        format!("invalid size '{text}': expected e.g. 5GB, 500MB, 2GiB or a byte count")
    })?;
    // Written to reject NaN as well as zero and negatives.
    if value.is_nan() || value <= 0.0 {
        return Err(format!("invalid size '{text}': must be positive"));
    }
    Ok((value * scale) as u64)
}

/// Orders tensor names the way a reader expects: layers by number, not as strings.
fn natural_key(name: &str) -> Vec<(String, u64)> {
    name.split('.')
        .map(|part| match part.parse::<u64>() {
            Ok(n) => (String::new(), n),
            Err(_) => (part.to_string(), 0),
        })
        .collect()
}

/// Writes an HF checkpoint to `dir`: `config.json` (the model's config with its dtype set),
/// `generation_config.json` (given, or derived from the config's token ids) and the weights in
/// `dtype`, split into shards of at most `max_shard_bytes` (a larger tensor gets a shard of its
/// own, as in transformers).
pub fn save_hf_checkpoint(
    dir: &Path,
    config: &ModelConfig,
    generation_config: Option<&Value>,
    tensors: &HashMap<String, Tensor>,
    dtype: DType,
    max_shard_bytes: u64,
) -> Result<(), ModelError> {
    let dtype_name = match dtype {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        other => return Err(ModelError::Msg(format!("cannot save weights as {other:?}"))),
    };
    std::fs::create_dir_all(dir)
        .map_err(|e| ModelError::file(dir, format!("cannot create folder: {e}")))?;

    let mut names: Vec<&String> = tensors.keys().collect();
    names.sort_by_key(|n| natural_key(n));
    let mut shards: Vec<Vec<(&str, Tensor)>> = vec![Vec::new()];
    let mut shard_bytes = 0u64;
    let mut total_size = 0u64;
    for name in names {
        let t = tensors[name]
            .to_dtype(dtype)?
            .to_device(&Device::Cpu)?
            .contiguous()?;
        let bytes = (t.elem_count() * dtype.size_in_bytes()) as u64;
        let current = shards.last_mut().expect("at least one shard");
        if !current.is_empty() && shard_bytes + bytes > max_shard_bytes {
            shards.push(Vec::new());
            shard_bytes = 0;
        }
        shards
            .last_mut()
            .expect("at least one shard")
            .push((name.as_str(), t));
        shard_bytes += bytes;
        total_size += bytes;
    }

    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    for (i, shard) in shards.iter().enumerate() {
        let file_name = if n == 1 {
            "model.safetensors".to_string()
        } else {
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        };
        for (name, _) in shard {
            weight_map.insert(name.to_string(), file_name.clone());
        }
        write_atomic_with(&dir.join(&file_name), |tmp| {
            safetensors::serialize_to_file(
                shard.iter().map(|(k, t)| (*k, t)),
                Some(metadata.clone()),
                tmp,
            )
            .map_err(|e| e.to_string())
        })?;
    }
    if n > 1 {
        let index = json!({"metadata": {"total_size": total_size}, "weight_map": weight_map});
        let text = serde_json::to_string_pretty(&index).expect("JSON values serialize");
        write_atomic(&dir.join("model.safetensors.index.json"), text.as_bytes())?;
    } else {
        // A stale index from an earlier, sharded save would shadow the single file.
        let _ = std::fs::remove_file(dir.join("model.safetensors.index.json"));
    }

    write_atomic(
        &dir.join("config.json"),
        config_json(config, dtype_name).as_bytes(),
    )?;

    let generation = match generation_config {
        Some(g) => g.clone(),
        None => {
            let eos = match config.eos_token_ids.as_slice() {
                [one] => json!(one),
                many => json!(many),
            };
            json!({"bos_token_id": config.bos_token_id, "eos_token_id": eos,
                   "pad_token_id": config.pad_token_id})
        }
    };
    let text = serde_json::to_string_pretty(&generation).expect("JSON values serialize");
    write_atomic(&dir.join("generation_config.json"), text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shard_sizes_parse_like_transformers() {
        assert_eq!(parse_shard_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_shard_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_shard_size("100KB").unwrap(), 100_000);
        assert_eq!(parse_shard_size("1234").unwrap(), 1234);
        assert!(parse_shard_size("lots").unwrap_err().contains("lots"));
        assert!(parse_shard_size("0MB").is_err());
    }

    #[test]
    fn names_sort_by_layer_number() {
        let mut v = ["model.layers.10.x", "model.layers.2.x", "lm_head.weight"];
        v.sort_by_key(|n| natural_key(n));
        assert_eq!(
            v,
            ["lm_head.weight", "model.layers.2.x", "model.layers.10.x"]
        );
    }
}
