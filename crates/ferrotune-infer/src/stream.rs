//! Streaming generated text: the printable part of each new token, given as soon as it is whole.

use std::io::Write;

use ferrotune_data::Tokenizer;

/// Prints one generation's text to stdout as tokens arrive. Tokens are decoded together (a
/// token may only be a piece of a character or need its neighbours' spacing), and an incomplete
/// UTF-8 sequence is held back until the token completing it arrives; stop tokens are not printed.
pub struct TextStream<'a> {
    tokenizer: &'a Tokenizer,
    stop_ids: &'a [u32],
    ids: Vec<u32>,
    printed: String,
}

impl<'a> TextStream<'a> {
    /// A stream decoding with `tokenizer` that skips `stop_ids` (the eos tokens).
    pub fn new(tokenizer: &'a Tokenizer, stop_ids: &'a [u32]) -> Self {
        Self {
            tokenizer,
            stop_ids,
            ids: Vec::new(),
            printed: String::new(),
        }
    }

    /// Adds a token and prints whatever text it completes.
    pub fn push(&mut self, id: u32) {
        if self.stop_ids.contains(&id) {
            return;
        }
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, true).unwrap_or_default();
        if text.ends_with('\u{FFFD}') || !text.starts_with(self.printed.as_str()) {
            return;
        }
        let mut stdout = std::io::stdout();
        let _ = write!(stdout, "{}", &text[self.printed.len()..]);
        let _ = stdout.flush();
        self.printed = text;
    }
}
