//! Tokenizing no more of a text than a length limit keeps: a 50 MB row with `max_seq_len: 64`
//! must not be tokenized whole (tens of GiB for the tokenizer's work on it) only for all but 64
//! tokens to be cut.

use crate::error::Result;
use crate::tokenizer::Tokenizer;

/// Tokens a text cut short may tokenize differently at its end (a word cut in two); the cut
/// keeps this many beyond the ones wanted.
const SLACK_TOKENS: usize = 16;

impl Tokenizer {
    /// The bytes of the vocabulary's longest token as it spells it (at least 1): a token covers
    /// at most that many bytes of text (byte-level BPE spells each byte as one character of one
    /// or two bytes, SentencePiece a space as the three-byte `▁`), save for normalizers that
    /// shorten text, which [`Tokenizer::prefix_for_tokens`]'s check covers.
    pub fn max_token_bytes(&self) -> usize {
        *self.max_token_bytes.get_or_init(|| {
            let vocab = self.inner().get_vocab(true);
            vocab.keys().map(String::len).max().unwrap_or(1).max(1)
        })
    }

    /// A prefix of `text` whose tokens (without special tokens added) begin with the first
    /// `n` tokens of the whole text's and number at least `n`; `text` itself when it is short
    /// or when no shorter prefix is found to agree.
    ///
    /// The prefix is cut on a character boundary where `n` tokens plus a slack fit at the
    /// longest token's length, and kept only when its first `n` tokens equal those of a prefix
    /// twice as long (a cut changes the tokens near it, not those far before); otherwise the
    /// cut doubles, up to the whole text. What is tokenized stays proportional to `n`, not to
    /// the text.
    pub fn prefix_for_tokens<'t>(&self, text: &'t str, n: usize) -> Result<&'t str> {
        let per_token = self.max_token_bytes();
        let mut cut = n.saturating_add(SLACK_TOKENS).saturating_mul(per_token);
        while cut < text.len() {
            let short = &text[..char_floor(text, cut)];
            let ids = self.encode(short, false)?;
            if ids.len() >= n {
                let long = &text[..char_floor(text, cut.saturating_mul(2))];
                let check = self.encode(long, false)?;
                if check.len() >= n && ids[..n] == check[..n] {
                    return Ok(short);
                }
            }
            cut = cut.saturating_mul(2);
        }
        Ok(text)
    }
}

/// The largest character boundary of `text` at or below `at` (the text's length past its end).
fn char_floor(text: &str, at: usize) -> usize {
    if at >= text.len() {
        return text.len();
    }
    let mut i = at;
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn char_floor_stays_on_characters() {
        let s = "aé€";
        assert_eq!(char_floor(s, 0), 0);
        assert_eq!(char_floor(s, 2), 1);
        assert_eq!(char_floor(s, 4), 3);
        assert_eq!(char_floor(s, 99), s.len());
    }
}
