//! A causal language model turned into a sequence classifier (a reward model): transformers'
//! `*ForSequenceClassification` over the same decoder, its output head `score`
//! (`[num_labels, hidden]`, no bias) instead of `lm_head`.

use candle_core::Tensor;
use serde_json::{json, Value};

use super::lora::SplitMix64;
use super::{CausalLm, Linear};
use crate::error::ModelError;

impl CausalLm {
    /// Replaces the output head by a fresh `score` head with `labels` outputs, drawn as
    /// transformers' `_init_weights` draws a linear layer (normal, mean 0, standard deviation
    /// `initializer_range`, default 0.02) from `seed`, and rewrites the config a checkpoint is
    /// saved with as transformers' `AutoModelForSequenceClassification.from_pretrained(...,
    /// num_labels=labels)` does: `architectures` names the `*ForSequenceClassification` class,
    /// `id2label` / `label2id` hold the labels, `pad_token_id` is `pad` (where the score of a
    /// row is read). A model that already is a classifier is refused.
    pub fn into_sequence_classifier(
        &mut self,
        labels: usize,
        pad: Option<u32>,
        seed: u64,
    ) -> Result<(), ModelError> {
        if let Some(n) = self.config.score_labels {
            return Err(ModelError::Msg(format!(
                "the model already is a sequence classifier ({n} label(s))"
            )));
        }
        let raw =
            self.config.raw.as_object_mut().ok_or_else(|| {
                ModelError::Msg("the model's config.json is not an object".into())
            })?;
        let class = raw
            .get("architectures")
            .and_then(Value::as_array)
            .and_then(|a| a.first())
            .and_then(Value::as_str)
            .and_then(|c| c.strip_suffix("ForCausalLM"))
            .map(|stem| format!("{stem}ForSequenceClassification"))
            .ok_or_else(|| {
                ModelError::Msg(
                    "config.json's architectures names no *ForCausalLM class to make a \
                     *ForSequenceClassification of"
                        .into(),
                )
            })?;
        let std = raw
            .get("initializer_range")
            .and_then(Value::as_f64)
            .unwrap_or(0.02);
        raw.insert("architectures".into(), json!([class]));
        let id2label: serde_json::Map<String, Value> = (0..labels)
            .map(|i| (i.to_string(), json!(format!("LABEL_{i}"))))
            .collect();
        let label2id: serde_json::Map<String, Value> = (0..labels)
            .map(|i| (format!("LABEL_{i}"), json!(i)))
            .collect();
        raw.insert("id2label".into(), Value::Object(id2label));
        raw.insert("label2id".into(), Value::Object(label2id));
        if let Some(p) = pad {
            raw.insert("pad_token_id".into(), json!(p));
            self.config.pad_token_id = Some(p);
        }
        let hidden = self.config.hidden_size;
        let mut rng = SplitMix64::new(seed ^ 0x5C0E_4EAD);
        // Box-Muller: torch.normal_'s distribution, reproducibly from the seed.
        let values: Vec<f32> = (0..labels * hidden)
            .map(|_| {
                let u1 = rng.next_f64().max(f64::MIN_POSITIVE);
                let u2 = rng.next_f64();
                (std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
            })
            .collect();
        let dtype = self.embed_tokens.dtype();
        let weight = Tensor::from_vec(values, (labels, hidden), self.embed_tokens.device())?
            .to_dtype(dtype)?;
        self.lm_head = Linear::new(weight, None);
        self.config.score_labels = Some(labels);
        self.config.tie_word_embeddings = false;
        Ok(())
    }
}
