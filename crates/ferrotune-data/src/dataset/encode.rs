//! Turning conversations and texts into token ids and labels, for any tokenizer.

use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::error::{DataError, Result};
use crate::tokenized::IGNORE_INDEX;
use crate::tokenizer::Tokenizer;

/// A conversation to train on.
#[derive(Debug, Clone)]
pub(crate) struct Conversation {
    pub messages: Vec<ChatMessage>,
    /// Label the non-assistant tokens too (system messages stay unlabelled).
    pub train_on_input: bool,
    /// The tools (JSON schemas) the template renders the conversation with, if the row has any.
    pub tools: Option<minijinja::Value>,
}

/// What every sample of a dataset needs from the tokenizer, computed once.
pub(crate) struct Encoder<'a> {
    pub tok: &'a Tokenizer,
    /// The ids `encode(text, add_special_tokens=true)` puts before the text (usually `[bos]`).
    pub prefix: Vec<u32>,
    /// The EOS id (the EOS token's own first), if any.
    pub eos: Option<u32>,
    /// The chat template, compiled once (each sample renders it several times).
    template: Option<ChatTemplate>,
    /// The template conversations with tools render with (the tokenizer's `tool_use` template,
    /// else its chat template).
    tool_template: Option<ChatTemplate>,
    /// The dataset's `max_seq_len`: texts are cut before tokenizing to what keeps its tokens.
    limit: Option<usize>,
    /// The model's position limit, which a row must not pass when no `max_seq_len` cuts it.
    positions: Option<usize>,
}

impl<'a> Encoder<'a> {
    pub fn new(tok: &'a Tokenizer) -> Result<Self> {
        // The post-processor's own prefix: compare a probe encoded with and without it.
        let probe = "a";
        let with = tok.encode(probe, true)?;
        let without = tok.encode(probe, false)?;
        let prefix = if without.is_empty() {
            Vec::new()
        } else {
            (0..=with.len().saturating_sub(without.len()))
                .find(|&i| with[i..].starts_with(&without))
                .map(|i| with[..i].to_vec())
                .unwrap_or_default()
        };
        let template = tok.compiled_chat_template()?;
        let tool_template = tok.compiled_chat_template_for(true)?;
        Ok(Self {
            tok,
            prefix,
            eos: tok.eos_ids().first().copied(),
            template,
            tool_template,
            limit: None,
            positions: None,
        })
    }

    /// Refuses rows longer than `positions` (the model's position limit) when no `max_seq_len`
    /// truncates them: such a row would take the model past what it was made for, and its
    /// attention scores alone grow with the square of its length.
    pub fn within(mut self, positions: Option<usize>) -> Self {
        self.positions = positions;
        self
    }

    /// [`Encoder::within`]'s check of a row of `len` tokens; `row` locates it (file and row).
    pub fn check_positions(&self, len: usize, row: impl FnOnce() -> String) -> Result<()> {
        match self.positions {
            Some(max) if self.limit.is_none() && len > max => Err(DataError::Dataset(format!(
                "{}: the row is {len} tokens long, more than the model's {max} positions \
                 (max_position_embeddings, or what its rope scaling allows): set \
                 tokenizer.max_seq_len (or the dataset's max_seq_len) to truncate rows",
                row()
            ))),
            _ => Ok(()),
        }
    }

    /// Tokenizes no more of each text than keeps its first `max_seq_len` tokens (and one more,
    /// so that a cut text is still seen as cut): rows come out as tokenizing them whole and
    /// truncating would give, without the memory and time of the whole.
    pub fn bounded(mut self, max_seq_len: Option<usize>) -> Self {
        self.limit = max_seq_len;
        self
    }

    /// `text`, or the prefix of it that the limit keeps the tokens of.
    fn cut<'t>(&self, text: &'t str) -> Result<&'t str> {
        match self.limit {
            Some(max) => self.tok.prefix_for_tokens(text, max.saturating_add(1)),
            None => Ok(text),
        }
    }

    /// Whether the tokenizer has a chat template.
    pub fn has_template(&self) -> bool {
        self.template.is_some()
    }

    /// The chat rendered as `Tokenizer::apply_chat_template_with_tools` renders it.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        tools: Option<&minijinja::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = match tools {
            Some(_) => self.tool_template.as_ref(),
            None => self.template.as_ref(),
        };
        let template = template.expect("only called with a chat template");
        template.render_with_tools(
            messages,
            tools,
            add_generation_prompt,
            self.tok.special_tokens(),
        )
    }

    /// `prefix + tokens(text) + [eos if add_eos]`, every token labelled (text completion).
    pub fn text(&self, text: &str, add_eos: bool) -> Result<(Vec<u32>, Vec<i64>)> {
        let mut ids = self.prefix.clone();
        ids.extend(self.tok.encode(self.cut(text)?, false)?);
        if add_eos {
            if let Some(eos) = self.eos {
                ids.push(eos);
            }
        }
        let labels = ids.iter().map(|&t| t as i64).collect();
        Ok((ids, labels))
    }

    /// Ids and labels of a conversation: with the chat template if the tokenizer has one, else
    /// turn by turn as `prefix + tokens(message)... + eos` after each assistant message.
    pub fn conversation(&self, conv: &Conversation) -> Result<(Vec<u32>, Vec<i64>)> {
        if self.template.is_some() {
            self.with_template(conv)
        } else {
            self.without_template(conv)
        }
    }

    fn without_template(&self, conv: &Conversation) -> Result<(Vec<u32>, Vec<i64>)> {
        let mut ids = Vec::new();
        let mut labels = Vec::new();
        let mut turn_start = true;
        for message in &conv.messages {
            if turn_start {
                // BOS is never a target.
                ids.extend(&self.prefix);
                labels.extend(self.prefix.iter().map(|_| IGNORE_INDEX));
            }
            let tokens = self.tok.encode(self.cut(&message.content)?, false)?;
            let is_assistant = message.role == "assistant";
            let learn = is_assistant || (conv.train_on_input && message.role != "system");
            labels.extend(
                tokens
                    .iter()
                    .map(|&t| if learn { t as i64 } else { IGNORE_INDEX }),
            );
            ids.extend(tokens);
            turn_start = is_assistant;
            if is_assistant {
                if let Some(eos) = self.eos {
                    ids.push(eos);
                    labels.push(eos as i64);
                }
            }
        }
        Ok((ids, labels))
    }

    fn with_template(&self, conv: &Conversation) -> Result<(Vec<u32>, Vec<i64>)> {
        let msgs = &conv.messages;
        let tools = conv.tools.as_ref();
        let full = self.render(msgs, tools, false)?;
        // Spans are found in the whole text; tokens only in the part the limit keeps (a span
        // reaching past it ends with the tokens).
        let kept = self.cut(&full)?;
        let ids = self.tok.encode(kept, false)?;
        // Character spans of the text the labels cover.
        let mut spans: Vec<(usize, usize)> = Vec::new();
        if conv.train_on_input {
            spans.push((self.system_end(msgs, tools, &full)?, full.len()));
        } else {
            for k in (0..msgs.len()).filter(|&k| msgs[k].role == "assistant") {
                spans.push(self.assistant_span(msgs, tools, k, &full)?);
            }
        }
        let mut labels = vec![IGNORE_INDEX; ids.len()];
        for (start, end) in spans {
            let a = self.token_boundary(kept, &ids, start)?;
            let b = self.token_boundary(kept, &ids, end)?;
            for i in a..b {
                labels[i] = ids[i] as i64;
            }
        }
        Ok((ids, labels))
    }

    /// Where the leading system message ends in the rendered text (0 without one, or when the
    /// template folds it into the first user turn).
    fn system_end(
        &self,
        msgs: &[ChatMessage],
        tools: Option<&minijinja::Value>,
        full: &str,
    ) -> Result<usize> {
        let n = msgs.iter().take_while(|m| m.role == "system").count();
        if n == 0 {
            return Ok(0);
        }
        match self.render(&msgs[..n], tools, false) {
            Ok(text) if full.starts_with(&text) => Ok(text.len()),
            _ => Ok(0),
        }
    }

    /// The text span of assistant message `k` in `full`: from the end of the conversation before
    /// it rendered with the generation prompt, to the end of the conversation through it.
    fn assistant_span(
        &self,
        msgs: &[ChatMessage],
        tools: Option<&minijinja::Value>,
        k: usize,
        full: &str,
    ) -> Result<(usize, usize)> {
        let unlocatable = || {
            DataError::Dataset(format!(
                "the chat template of {} renders assistant message {} differently when the \
                 conversation stops there, so its tokens cannot be located",
                self.tok.origin().display(),
                k + 1
            ))
        };
        let start = if k == 0 {
            0
        } else {
            let prompt = self.render(&msgs[..k], tools, true)?;
            if !full.starts_with(&prompt) {
                return Err(unlocatable());
            }
            prompt.len()
        };
        let through = self.render(&msgs[..=k], tools, false)?;
        if full.starts_with(&through) {
            return Ok((start, through.len()));
        }
        // Templates such as Qwen3's render the final assistant turn differently (a think block),
        // so an earlier turn is found by where its content ends (a marker appended to it changes
        // the text from there on) plus the end-of-turn text the template writes after content.
        const MARK: &str = "\u{f8ff}\u{f8fe}";
        let marked = |upto: usize| -> Result<String> {
            let mut m = msgs[..upto].to_vec();
            m[k].content.push_str(MARK);
            self.render(&m, tools, false)
        };
        let content_end_full = common_prefix(full, &marked(msgs.len())?);
        let content_end_through = common_prefix(&through, &marked(k + 1)?);
        let suffix = &through[content_end_through..];
        if content_end_full < start || !full[content_end_full..].starts_with(suffix) {
            return Err(unlocatable());
        }
        Ok((start, content_end_full + suffix.len()))
    }

    /// The index of the first token at or after text position `pos`: the token count of the
    /// text before it when that tokenizes to a prefix of `ids` (the usual case), else by offsets.
    fn token_boundary(&self, full: &str, ids: &[u32], pos: usize) -> Result<usize> {
        if pos == 0 {
            return Ok(0);
        }
        if pos >= full.len() {
            return Ok(ids.len());
        }
        let head = self.tok.encode(&full[..pos], false)?;
        if ids.starts_with(&head) {
            return Ok(head.len());
        }
        let encoding = self
            .tok
            .inner()
            .encode(full, false)
            .map_err(DataError::encode)?;
        Ok(encoding
            .get_offsets()
            .iter()
            .position(|&(s, _)| s >= pos)
            .unwrap_or(ids.len()))
    }
}

/// The length in bytes of the common prefix of two strings, on a character boundary.
fn common_prefix(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((i, _), _)| i)
}

/// torchtune's truncation of a conversation: keep the first `max_len` tokens and, when anything
/// was cut and there is an EOS id, make the last kept token EOS (labelled as the token it
/// replaced was: learned if that position was learned).
pub(crate) fn truncate_sft(
    ids: &mut Vec<u32>,
    labels: &mut Vec<i64>,
    max_len: usize,
    eos: Option<u32>,
) {
    if ids.len() <= max_len {
        return;
    }
    ids.truncate(max_len);
    labels.truncate(max_len);
    if let (Some(eos), Some(last)) = (eos, ids.last_mut()) {
        *last = eos;
        let label = labels.last_mut().expect("labels as long as ids");
        if *label != IGNORE_INDEX {
            *label = eos as i64;
        }
    }
}
