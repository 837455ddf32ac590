//! Preference pairs tokenized as TRL 1.16.0's `DPOTrainer` tokenizes them
//! (`trl/trainer/dpo_trainer.py`: `_prepare_dataset`, its `tokenize_fn`, `_tokenize`,
//! `common_prefix_length`, and `DataCollatorForPreference`), the tokenization IPO (a TRL loss) takes,
//! as ORPO, CPO and SimPO take their trainers' ([`super::trl_pairs`]):
//!
//! - The prompt is the messages the chosen and rejected conversations share (TRL's
//!   `extract_prompt`; `stack_exchange_paired_dataset`'s question column is the prompt as it
//!   stands).
//! - With a chat template: the prompt (with the generation prompt), prompt + chosen and prompt +
//!   rejected are each rendered with the row's tools and tokenized without special tokens
//!   (`apply_chat_template(tokenize=True)`); nothing is appended.
//! - Without one (TRL's text rows: the messages' contents concatenated): the tokenizer's EOS
//!   token text is appended to each answer that does not end with it, and the prompt, prompt +
//!   chosen and prompt + rejected are each tokenized with the tokenizer's special tokens (its
//!   BOS).
//! - The answers start where the prompt's tokens and both prompt + answer's diverge (one token
//!   earlier when the prompt's last token merges into an answer); every token after that point
//!   is labelled, every token before it not — earlier assistant turns inside a multi-turn prompt
//!   included (torchtune's masking, [`super::PairTokenization::Dpo`], labels those).
//! - `max_seq_len` is TRL's `max_length` with `truncation_mode: keep_start`: each side is cut to
//!   its first `max_seq_len` tokens, and a row whose prompt alone fills it is refused (TRL drops
//!   it; TRL's default 1024 applies only in TRL: without `max_seq_len` nothing is cut).

use crate::error::{DataError, Result};
use crate::tokenized::IGNORE_INDEX;

use super::encode::{Conversation, Encoder};
use super::{PreferencePair, Row};

/// One pair as `DPOTrainer`'s `tokenize_fn` and its collator build it. `explicit_prompt`: the
/// number of leading messages that are the row's prompt column (`stack_exchange_paired_dataset`),
/// else `None` (TRL's `extract_prompt` over the two conversations).
pub(crate) fn dpo_trainer_pair(
    encoder: &Encoder,
    chosen: &Conversation,
    rejected: &Conversation,
    explicit_prompt: Option<usize>,
    max_len: Option<usize>,
) -> Result<PreferencePair> {
    if chosen.train_on_input || rejected.train_on_input {
        return Err(DataError::Dataset(
            "train_on_input: true is not what TRL's DPOTrainer does (the prompt is never a \
             target); IPO takes train_on_input: false"
                .into(),
        ));
    }
    let (c, r) = (&chosen.messages, &rejected.messages);
    let at = match explicit_prompt {
        Some(n) => n,
        None => super::trl_pairs::extract_prompt_at(c, r)?,
    };
    let tok = encoder.tok;
    let (prompt, pc, pr) = if encoder.has_template() {
        // DPOTrainer passes the row's tools to the template (ORPOTrainer does not).
        let tools = chosen.tools.as_ref().or(rejected.tools.as_ref());
        let ids = |text: String| tok.encode(&text, false);
        let p = &c[..at];
        (
            ids(encoder.render(p, tools, true)?)?,
            ids(encoder.render(&[p, &c[at..]].concat(), tools, false)?)?,
            ids(encoder.render(&[p, &r[at..]].concat(), tools, false)?)?,
        )
    } else {
        let join = |m: &[_]| {
            m.iter()
                .map(|m: &crate::chat_template::ChatMessage| m.content.as_str())
                .collect::<String>()
        };
        let eos = tok.eos_token().unwrap_or("");
        let answer = |m: &[_]| {
            let mut a = join(m);
            if !a.ends_with(eos) {
                a.push_str(eos);
            }
            a
        };
        let prompt = join(&c[..at]);
        (
            tok.encode(&prompt, true)?,
            tok.encode(&format!("{prompt}{}", answer(&c[at..])), true)?,
            tok.encode(&format!("{prompt}{}", answer(&r[at..])), true)?,
        )
    };
    let shared = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let start = shared(&prompt, &pc).min(shared(&prompt, &pr));
    if let Some(max) = max_len {
        if start >= max {
            return Err(DataError::Dataset(format!(
                "the prompt alone fills max_seq_len ({start} tokens of {max}): no answer token \
                 is left to train on (TRL's DPOTrainer drops such a row)"
            )));
        }
    }
    let side = |mut ids: Vec<u32>| -> Result<Row> {
        if let Some(max) = max_len {
            ids.truncate(max);
        }
        if ids.len() <= start {
            return Err(DataError::Dataset(
                "an answer has no tokens of its own after the prompt's".into(),
            ));
        }
        let labels = ids
            .iter()
            .enumerate()
            .map(|(i, &t)| if i < start { IGNORE_INDEX } else { t as i64 })
            .collect();
        Ok(Row::new(ids, labels))
    };
    Ok(PreferencePair {
        chosen: side(pc)?,
        rejected: side(pr)?,
    })
}
