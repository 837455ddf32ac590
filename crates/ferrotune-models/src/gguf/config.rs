//! The HF config a GGUF file's metadata describes, rotary scaling included.

use candle_core::DType;
use serde_json::{json, Map, Value};

use crate::error::ModelError;
use crate::family::gguf::{GgufRopeTensors, GgufSource};

use super::*;

impl GgufFile<'_> {
    /// Builds an HF `config.json`-shaped object from the metadata.
    pub(super) fn config_json(
        &mut self,
        arch: &Arch,
        hp: &HParams,
        dtype: DType,
    ) -> Result<Value, ModelError> {
        let a = &arch.gguf;
        let mut c = Map::new();
        c.insert("architectures".into(), json!([arch.hf_class]));
        c.insert("model_type".into(), json!(arch.model_type));
        c.insert("vocab_size".into(), json!(hp.vocab));
        c.insert("hidden_size".into(), json!(hp.hidden));
        c.insert("intermediate_size".into(), json!(hp.ffn));
        c.insert("num_hidden_layers".into(), json!(hp.layers));
        c.insert("num_attention_heads".into(), json!(hp.heads));
        c.insert("num_key_value_heads".into(), json!(hp.kv_heads));
        c.insert("head_dim".into(), json!(hp.head_dim));
        c.insert("max_position_embeddings".into(), json!(hp.context));
        c.insert("rms_norm_eps".into(), json!(hp.rms_eps));
        c.insert("rope_theta".into(), json!(hp.rope_theta));
        if hp.rope_dims != hp.head_dim {
            if !arch.reading.partial_rotary {
                return Err(self.err(format!(
                    "{a}.rope.dimension_count is {} but the head dimension is {}: partial rotary embeddings are only supported for phi2 and phi3",
                    hp.rope_dims, hp.head_dim
                )));
            }
            c.insert(
                "partial_rotary_factor".into(),
                json!(hp.rope_dims as f64 / hp.head_dim as f64),
            );
        }
        if let Some(scaling) = self.rope_scaling(arch, hp)? {
            c.insert("rope_scaling".into(), scaling);
        }
        for (key, act) in arch.reading.activation {
            c.insert((*key).into(), json!(act));
        }
        c.insert("tie_word_embeddings".into(), json!(self.head_tied()));
        let source = GgufSource { file: &*self, hp };
        (arch.reading.config_keys)(source, &mut c)?;
        self.insert_ids_dtype_name(&mut c, dtype)?;
        Ok(Value::Object(c))
    }

    /// `layers` (`{arch}.block_count`, less any multi-token-prediction layers) checked as the
    /// model's layer count (against the machine), for the readers of architectures with their
    /// own layout (`deepseek2.rs`, `gpt_oss.rs`, `qwen35.rs`).
    pub(super) fn check_layers(&self, arch: &str, layers: usize) -> Result<(), ModelError> {
        let key = format!("metadata key '{arch}.block_count'");
        crate::config::layers::check_layer_count(layers, &key).map_err(|m| self.err(m))
    }

    /// `{arch}.vocab_size`, else the token embedding's row count (the readers of architectures
    /// with their own layout).
    pub(super) fn vocab_or_embedding_rows(&self, arch: &str) -> Result<usize, ModelError> {
        match self.uint(&format!("{arch}.vocab_size"))? {
            Some(n) => Ok(n as usize),
            None => self
                .content
                .tensor_infos
                .get("token_embd.weight")
                .and_then(|t| t.shape.dims().first().copied())
                .ok_or_else(|| self.err(format!("missing metadata key '{arch}.vocab_size'"))),
        }
    }

    /// `{arch}.attention.layer_norm_rms_epsilon`, which must be there (the readers of
    /// architectures with their own layout).
    pub(super) fn req_rms_eps(&self, arch: &str) -> Result<f64, ModelError> {
        let key = format!("{arch}.attention.layer_norm_rms_epsilon");
        self.float(&key)?
            .ok_or_else(|| self.err(format!("missing metadata key '{key}'")))
    }

    /// Whether the output head is the token embedding: as transformers decides, exactly when
    /// the file has no separate `output.weight`.
    pub(super) fn head_tied(&self) -> bool {
        !self.content.tensor_infos.contains_key("output.weight")
    }

    /// The keys every architecture's config takes the same way: the special token ids, the
    /// `torch_dtype` of the loaded weights and the model's name (shared with the readers of
    /// architectures with their own layout, `deepseek2.rs` and `gpt_oss.rs`).
    pub(super) fn insert_ids_dtype_name(
        &self,
        c: &mut Map<String, Value>,
        dtype: DType,
    ) -> Result<(), ModelError> {
        for (gguf_key, hf_key) in [
            ("tokenizer.ggml.bos_token_id", "bos_token_id"),
            ("tokenizer.ggml.eos_token_id", "eos_token_id"),
            ("tokenizer.ggml.padding_token_id", "pad_token_id"),
        ] {
            if let Some(id) = self.token_id(gguf_key)? {
                c.insert(hf_key.into(), json!(id));
            }
        }
        let dtype_name = match dtype {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F64 => "float64",
            _ => "float32",
        };
        c.insert("torch_dtype".into(), json!(dtype_name));
        if let Some(name) = self.string("general.name")? {
            c.insert("_name_or_path".into(), json!(name));
        }
        Ok(())
    }

    /// The HF `rope_scaling` object, from `{arch}.rope.scaling.*` keys or the rotary-factor tensors.
    pub(super) fn rope_scaling(
        &mut self,
        arch: &Arch,
        hp: &HParams,
    ) -> Result<Option<Value>, ModelError> {
        let a = arch.gguf.clone();
        let key = |k: &str| format!("{a}.rope.scaling.{k}");
        let factor = self.positive_float(&key("factor"))?;
        let original = self.uint(&key("original_context_length"))?;
        let kind = match self.string(&key("type"))? {
            Some(t) => Some(t.to_ascii_lowercase()),
            // Older files: `{arch}.rope.scale_linear`.
            None => self
                .positive_float(&format!("{a}.rope.scale_linear"))?
                .filter(|f| *f != 1.0)
                .map(|_| "linear".into()),
        };
        let need_factor = |this: &Self| {
            factor
                .or(this.float(&format!("{a}.rope.scale_linear")).ok().flatten())
                .ok_or_else(|| this.err(format!("missing metadata key '{}'", key("factor"))))
        };
        match kind.as_deref() {
            Some("linear") => {
                return Ok(Some(
                    json!({"rope_type": "linear", "factor": need_factor(self)?}),
                ))
            }
            Some("yarn") => {
                let mut m = Map::new();
                m.insert("rope_type".into(), json!("yarn"));
                m.insert("factor".into(), json!(need_factor(self)?));
                m.insert(
                    "original_max_position_embeddings".into(),
                    json!(original.unwrap_or(hp.context as u64)),
                );
                for (k, hf) in [
                    ("yarn_beta_fast", "beta_fast"),
                    ("yarn_beta_slow", "beta_slow"),
                ] {
                    if let Some(x) = self.float(&key(k))? {
                        m.insert(hf.into(), json!(x));
                    }
                }
                return Ok(Some(Value::Object(m)));
            }
            Some("none") | None => {}
            Some("longrope") | Some("su") => {}
            Some(other) => {
                return Err(self.err(format!(
                "unsupported rope scaling type '{other}' ({}): supported are none, linear, yarn",
                key("type")
            )))
            }
        }
        // Phi-3 LongRoPE: llama.cpp keeps the per-frequency factors as tensors.
        if arch.reading.rope_tensors == GgufRopeTensors::LongRopeFactors {
            let long = self.small_vector("rope_factors_long.weight")?;
            let short = self.small_vector("rope_factors_short.weight")?;
            if let (Some(long), Some(short)) = (long, short) {
                let half = hp.rope_dims / 2;
                if long.len() != half || short.len() != half {
                    return Err(self.err(format!(
                        "rope_factors_long/short have {} and {} entries but the rotary dimension {} needs {half}",
                        long.len(),
                        short.len(),
                        hp.rope_dims
                    )));
                }
                let orig = original.ok_or_else(|| {
                    self.err(format!(
                        "missing metadata key '{}'",
                        key("original_context_length")
                    ))
                })?;
                return Ok(Some(json!({
                    "rope_type": "longrope",
                    "long_factor": long.iter().map(|&x| x as f64).collect::<Vec<_>>(),
                    "short_factor": short.iter().map(|&x| x as f64).collect::<Vec<_>>(),
                    "original_max_position_embeddings": orig,
                })));
            }
        }
        // Llama 3.x: llama.cpp bakes the frequency scaling into a `rope_freqs` tensor.
        if arch.reading.rope_tensors == GgufRopeTensors::Llama3Freqs {
            if let Some(freqs) = self.small_vector("rope_freqs.weight")? {
                match fit_llama3(&freqs, hp.rope_theta, hp.rope_dims) {
                    Some(s) => return Ok(Some(s)),
                    None => tracing::warn!(
                        "{}: rope_freqs.weight does not match Llama 3 rotary scaling; it is ignored",
                        self.path.display()
                    ),
                }
            }
        }
        Ok(None)
    }
}

/// Recognises llama.cpp's `rope_freqs` factors for Llama 3.x rotary scaling (low 1, high 4,
/// original context 8192: every released Llama 3.1/3.2/3.3) and returns the HF `rope_scaling`.
pub(super) fn fit_llama3(freqs: &[f32], base: f64, dims: usize) -> Option<Value> {
    if freqs.len() * 2 != dims || freqs.is_empty() {
        return None;
    }
    let max = freqs.iter().copied().fold(f32::MIN, f32::max) as f64;
    if max <= 1.0 {
        return None;
    }
    let factor = if (max - max.round()).abs() < 1e-4 {
        max.round()
    } else {
        max
    };
    let (low, high, orig) = (1.0f64, 4.0f64, 8192.0f64);
    let (low_wavelen, high_wavelen) = (orig / low, orig / high);
    let matches = freqs.iter().enumerate().all(|(i, &f)| {
        let inv_freq = 1.0 / base.powf((2 * i) as f64 / dims as f64);
        let wavelen = 2.0 * std::f64::consts::PI / inv_freq;
        let expected = if wavelen < high_wavelen {
            1.0
        } else if wavelen > low_wavelen {
            factor
        } else {
            let smooth = (orig / wavelen - low) / (high - low);
            1.0 / ((1.0 - smooth) / factor + smooth)
        };
        (f as f64 - expected).abs() <= 1e-4 * expected.max(1.0)
    });
    matches.then(|| {
        json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": high, "original_max_position_embeddings": orig as u64})
    })
}
