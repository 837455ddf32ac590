//! Preference pairs tokenized as TRL 1.16.0's `ORPOTrainer` and `CPOTrainer` tokenize them
//! (`trl/experimental/{orpo,cpo}`: `maybe_extract_prompt`, `maybe_apply_chat_template`,
//! `tokenize_row`, `build_tokenized_answer`; the two trainers' code is the same), which differs
//! from torchtune's (the DPO recipes' default, [`PairTokenization::Dpo`]) and from `DPOTrainer`'s
//! ([`PairTokenization::DpoTrainer`]):
//!
//! - The prompt is the messages the chosen and rejected conversations share (TRL's
//!   `extract_prompt`; `stack_exchange_paired_dataset`'s question column is the prompt as it
//!   stands), rendered by the chat template with the generation prompt; each answer is the text
//!   the template renders after the prompt (the prompt text being the characters prompt,
//!   prompt + chosen and prompt + rejected have in common). A tokenizer without a chat template
//!   takes the messages' contents as TRL's text rows: the prompt's concatenated, then the
//!   answer's. The template is given no tools (`ORPOTrainer` passes none; `DPOTrainer` does).
//! - `prompt + answer` is tokenized as one text (no special tokens) and split where the prompt's
//!   own tokens end, one token earlier when the last prompt token merged into the answer.
//! - The tokenizer's BOS token is put before the prompt when it does not start with it, and its
//!   EOS token after each answer that does not end with it (after a chat template's end of turn,
//!   too: what `DPOTrainer` does not do).
//! - `max_seq_len` is TRL's `max_length`: an answer is cut to the tokens the prompt leaves of it
//!   (the prompt itself is never cut; TRL's default 1024 applies only in TRL: without
//!   `max_seq_len` nothing is cut). The prompt's tokens are unlabelled (`-100`).

use std::path::Path;

use serde_json::Value;

use crate::chat_template::ChatMessage;
use crate::error::{DataError, Result};
use crate::tokenized::IGNORE_INDEX;
use crate::tokenizer::Tokenizer;

use super::encode::{Conversation, Encoder};
use super::{PreferencePair, Row};

/// How a preference dataset's rows become token ids: the loss picks it, so that switching a DPO
/// config's loss is the only change the user makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PairTokenization {
    /// Each side as an SFT conversation (torchtune's `preference_dataset` and
    /// `stack_exchange_paired_dataset`): DPO and RSO, torchtune's losses.
    #[default]
    Dpo,
    /// TRL's `ORPOTrainer` / `CPOTrainer` (this module): ORPO, CPO, SimPO.
    Orpo,
    /// TRL's `DPOTrainer` ([`super::trl_dpo`]): IPO, the TRL loss `DPOTrainer` runs.
    DpoTrainer,
}

/// [`super::build_preference_dataset_within`] with the rows tokenized as `how` says
/// (`tokenized_dataset` rows are taken as they stand either way).
pub fn build_preference_dataset_as(
    section: &Value,
    tokenizer: &Tokenizer,
    base_dir: &Path,
    positions: Option<usize>,
    how: PairTokenization,
) -> Result<Vec<PreferencePair>> {
    super::concatenated(section, |s| {
        super::build_pairs(s, tokenizer, base_dir, positions, how)
    })
}

/// How a TRL trainer tokenizes one pair: [`orpo_pair`] or [`super::trl_dpo::dpo_trainer_pair`]
/// (encoder, chosen, rejected, explicit prompt length, `max_seq_len`).
pub(crate) type PairTokenizer = fn(
    &Encoder,
    &Conversation,
    &Conversation,
    Option<usize>,
    Option<usize>,
) -> Result<PreferencePair>;

/// `tokenize`'s pair for the row `at` names (its errors say where), each side checked against
/// the model's positions.
pub(crate) fn located(
    tokenize: PairTokenizer,
    encoder: &Encoder,
    (chosen, rejected): (&Conversation, &Conversation),
    explicit_prompt: Option<usize>,
    max_len: Option<usize>,
    at: &dyn Fn() -> String,
) -> Result<PreferencePair> {
    let pair =
        tokenize(encoder, chosen, rejected, explicit_prompt, max_len).map_err(|e| match e {
            DataError::Dataset(m) => DataError::Dataset(format!("{}: {m}", at())),
            other => other,
        })?;
    for row in [&pair.chosen, &pair.rejected] {
        encoder.check_positions(row.input_ids.len(), at)?;
    }
    Ok(pair)
}

/// One pair as `ORPOTrainer.tokenize_row` builds it. `explicit_prompt`: the number of leading
/// messages that are the row's prompt column (`stack_exchange_paired_dataset`), else `None`
/// (TRL's `extract_prompt` over the two conversations).
pub(crate) fn orpo_pair(
    encoder: &Encoder,
    chosen: &Conversation,
    rejected: &Conversation,
    explicit_prompt: Option<usize>,
    max_len: Option<usize>,
) -> Result<PreferencePair> {
    if chosen.train_on_input || rejected.train_on_input {
        return Err(DataError::Dataset(
            "train_on_input: true is not what TRL's ORPOTrainer / CPOTrainer do (the prompt is \
             never a target); ORPO, CPO and SimPO take train_on_input: false"
                .into(),
        ));
    }
    let (c, r) = (&chosen.messages, &rejected.messages);
    let at = match explicit_prompt {
        Some(n) => n,
        None => extract_prompt_at(c, r)?,
    };
    let (prompt, c_answer, r_answer) = texts(encoder, &c[..at], &c[at..], &r[at..])?;
    let tok = encoder.tok;
    let chosen = split(tok, &prompt, &c_answer)?;
    let rejected = split(tok, &prompt, &r_answer)?;
    // TRL's check: the two splits' prompts differ at most in their last token.
    let differing = chosen
        .0
        .iter()
        .zip(&rejected.0)
        .filter(|(a, b)| a != b)
        .count();
    if differing > 1 || chosen.0.len().abs_diff(rejected.0.len()) > 1 {
        return Err(DataError::Dataset(
            "the chosen and rejected prompt tokens differ beyond their last token (TRL's \
             ORPOTrainer refuses such a row)"
                .into(),
        ));
    }
    let bos = tok.bos_token().and_then(|t| tok.token_to_id(t));
    let eos = tok.eos_token().and_then(|t| tok.token_to_id(t));
    let side = |(mut p, mut a): (Vec<u32>, Vec<u32>)| -> Result<Row> {
        if let Some(bos) = bos {
            if p.first() != Some(&bos) {
                p.insert(0, bos);
            }
        }
        if let Some(eos) = eos {
            if a.last() != Some(&eos) {
                a.push(eos);
            }
        }
        if let Some(max) = max_len {
            if p.len() + a.len() > max {
                a.truncate(max.saturating_sub(p.len()));
            }
        }
        if a.is_empty() {
            return Err(DataError::Dataset(format!(
                "the prompt alone fills max_seq_len ({} tokens): no answer token is left to \
                 train on",
                p.len()
            )));
        }
        let labels = std::iter::repeat_n(IGNORE_INDEX, p.len())
            .chain(a.iter().map(|&t| t as i64))
            .collect();
        Ok(Row::new([p, a].concat(), labels))
    };
    Ok(PreferencePair {
        chosen: side(chosen)?,
        rejected: side(rejected)?,
    })
}

/// TRL's `extract_prompt` on message lists: the index of the first message where chosen and
/// rejected differ, else (one is a prefix of the other) one before the shorter's end.
pub(super) fn extract_prompt_at(c: &[ChatMessage], r: &[ChatMessage]) -> Result<usize> {
    let n = c.len().min(r.len());
    if n == 0 {
        return Err(DataError::Dataset(
            "chosen or rejected has no messages: there is no prompt to extract".into(),
        ));
    }
    Ok((0..n).find(|&i| c[i] != r[i]).unwrap_or(n - 1))
}

/// The prompt's and the two answers' texts: TRL's `maybe_apply_chat_template` with a chat
/// template (given no tools, as `ORPOTrainer` gives it none), the messages' contents without one.
fn texts(
    encoder: &Encoder,
    prompt: &[ChatMessage],
    chosen: &[ChatMessage],
    rejected: &[ChatMessage],
) -> Result<(String, String, String)> {
    if !encoder.has_template() {
        let join = |m: &[ChatMessage]| m.iter().map(|m| m.content.as_str()).collect::<String>();
        return Ok((join(prompt), join(chosen), join(rejected)));
    }
    let last = prompt.last().map(|m| m.role.as_str());
    if !matches!(last, Some("user" | "tool")) {
        return Err(DataError::Dataset(format!(
            "the prompt (the messages chosen and rejected share) must end with a user or tool \
             message for TRL's ORPOTrainer's chat template path, not {}",
            last.map_or("nothing".to_string(), |r| format!("a {r} message"))
        )));
    }
    // ORPOTrainer renders the template without the row's tools (DPOTrainer passes them).
    let tools = None;
    let alone = encoder.render(prompt, tools, true)?;
    let with = |answer: &[ChatMessage]| encoder.render(&[prompt, answer].concat(), tools, false);
    let (pc, pr) = (with(chosen)?, with(rejected)?);
    // The characters all three share (DeepSeek-R1's templates render the prompt alone otherwise).
    let shared = common_chars(common_chars(&alone, &pc), &pr).to_string();
    let c = pc[shared.len()..].to_string();
    let r = pr[shared.len()..].to_string();
    Ok((shared, c, r))
}

/// The longest common prefix of two strings, on a character boundary.
fn common_chars<'a>(a: &'a str, b: &str) -> &'a str {
    let end = a
        .char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((i, _), _)| i);
    &a[..end]
}

/// `build_tokenized_answer`: `(prompt tokens, answer tokens)` of `prompt + answer` tokenized as
/// one text, split where the prompt's own tokens end (one earlier when its last token merged).
fn split(tok: &Tokenizer, prompt: &str, answer: &str) -> Result<(Vec<u32>, Vec<u32>)> {
    let full = tok.encode(&format!("{prompt}{answer}"), false)?;
    let alone = tok.encode(prompt, false)?;
    if alone.len() > full.len() {
        return Err(DataError::Dataset(
            "the prompt tokenizes longer than prompt + answer (TRL's ORPOTrainer refuses such a \
             row)"
                .into(),
        ));
    }
    let mut start = alone.len();
    if alone[..] != full[..start] {
        start = start.saturating_sub(1);
    }
    Ok((full[..start].to_vec(), full[start..].to_vec()))
}
