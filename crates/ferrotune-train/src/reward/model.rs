//! A reward model as a GRPO reward function (`reward_funcs: [{model: FOLDER}]`), as TRL's
//! `GRPOTrainer` scores with a `*ForSequenceClassification` reward function: each row's prompt and
//! completion joined — text prompts as `prompt + completion`; a conversational prompt (or
//! `conversational: true`) as its messages and the completion as an assistant message, rendered
//! with the reward model's chat template — encoded without special tokens, right-padded with its
//! tokenizer's pad id (else its EOS id), and scored by the `score` head at each row's last token
//! that is not the pad id (output 0). The model runs without gradients on the entry's `device`
//! (default `cpu`) in its `dtype` (default `fp32`); the scores are read in f32.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use ferrotune_data::chat_template::ChatMessage;
use ferrotune_data::dataset::default_pad_id;
use ferrotune_data::Tokenizer;
use ferrotune_models::{AttentionLayout, CausalLm};
use serde_json::Value;

use super::{RewardBatch, RewardFn};

/// A loaded reward model and its tokenizer.
pub struct ModelReward {
    name: String,
    model: CausalLm,
    tokenizer: Tokenizer,
    pad: u32,
    conversational: bool,
    device: Device,
}

impl ModelReward {
    /// Loads the classifier in `dir` (with the tokenizer saved beside it) on `device` in
    /// `dtype`, named `name`.
    pub fn load(
        dir: &Path,
        name: String,
        conversational: bool,
        device: Device,
        dtype: DType,
    ) -> Result<Self> {
        let (model, _) = ferrotune_models::load_model(dir, dtype, &device)
            .with_context(|| format!("reward model {}", dir.display()))?;
        match model.config.score_labels {
            Some(_) => {}
            None => bail!(
                "reward model {}: not a sequence classifier (its config.json must name a \
                 *ForSequenceClassification architecture with a `score` head)",
                dir.display()
            ),
        }
        let tokenizer = Tokenizer::from_dir(dir)
            .with_context(|| format!("reward model {}: its tokenizer", dir.display()))?;
        let pad = default_pad_id(&tokenizer);
        Ok(Self {
            name,
            model,
            tokenizer,
            pad,
            conversational,
            device,
        })
    }

    /// The text TRL scores for one row.
    fn text(&self, prompt: &Value, completion: &str) -> Result<String> {
        let messages = |list: &[Value]| -> Result<Vec<ChatMessage>> {
            list.iter()
                .map(|m| {
                    let field = |k: &str| m.get(k).and_then(Value::as_str);
                    match (field("role"), field("content")) {
                        (Some(r), Some(c)) => Ok(ChatMessage::new(r, c)),
                        _ => Err(anyhow!("a prompt message without string role and content")),
                    }
                })
                .collect()
        };
        let chat = |mut msgs: Vec<ChatMessage>| -> Result<String> {
            msgs.push(ChatMessage::assistant(completion));
            Ok(self.tokenizer.apply_chat_template(&msgs, false)?)
        };
        match prompt {
            Value::Array(list) => chat(messages(list)?),
            Value::String(p) if self.conversational => chat(vec![ChatMessage::user(p.as_str())]),
            Value::String(p) => Ok(format!("{p}{completion}")),
            other => bail!("a prompt that is neither text nor messages: {other}"),
        }
    }

    /// The rewards of `texts`.
    pub fn score_texts(&self, texts: &[String]) -> Result<Vec<f32>> {
        let rows: Vec<Vec<u32>> = texts
            .iter()
            .map(|t| self.tokenizer.encode(t, false))
            .collect::<std::result::Result<_, _>>()?;
        let t = rows.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let b = rows.len();
        let mut ids = Vec::with_capacity(b * t);
        let mut valid = Vec::with_capacity(b);
        let mut pooled = Vec::with_capacity(b);
        for row in &rows {
            let mut padded = row.clone();
            padded.resize(t, self.pad);
            pooled.push(padded.iter().rposition(|&x| x != self.pad).unwrap_or(0));
            valid.push((0..t).map(|j| j < row.len()).collect());
            ids.extend(padded);
        }
        let layout = AttentionLayout {
            positions: vec![(0..t as u32).collect(); b],
            key_valid: valid,
            segments: None,
        };
        let ids = Tensor::from_vec(ids, (b, t), &self.device)?;
        let hidden = self.model.forward_hidden(&ids, &layout, None)?;
        let mut out = Vec::with_capacity(b);
        for (r, &at) in pooled.iter().enumerate() {
            let h = hidden.narrow(0, r, 1)?.narrow(1, at, 1)?;
            let scores = self
                .model
                .logits(&h)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            out.push(scores[0]);
        }
        Ok(out)
    }
}

impl RewardFn for ModelReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score(&mut self, batch: &RewardBatch) -> Result<Vec<f32>> {
        let texts = batch
            .prompts
            .iter()
            .zip(&batch.completions)
            .map(|(p, c)| self.text(p, c))
            .collect::<Result<Vec<_>>>()
            .map_err(|e| anyhow!("reward model '{}': {e}", self.name))?;
        self.score_texts(&texts)
            .map_err(|e| anyhow!("reward model '{}': {e}", self.name))
    }
}
