//! A tokenizer from the metadata of a llama.cpp GGUF file, built the way transformers builds it
//! (`integrations/gguf/gguf_tokenizer_mapping.py`).
//!
//! A GGUF has no `tokenizer.json`: it stores the vocabulary (`tokenizer.ggml.tokens`), the merges or
//! the SentencePiece scores, token types and special token ids. transformers hands these to one of
//! its tokenizer classes, which brings its own normalizer, pre-tokenizer and decoder:
//! - `gpt2`: byte-level BPE (`GPT2Tokenizer`); tokens not spelled in the byte alphabet are
//!   re-spelled, and `tokenizer.ggml.pre` picks the split regex where transformers knows it;
//! - `llama`: SentencePiece-style BPE with byte fallback (`LlamaTokenizer`), merges from the file or
//!   derived from the scores; Gemma files (`GemmaTokenizer`) re-spell whitespace tokens and derive
//!   merges from the token order; Phi-3 files get the prefix space from a normalizer;
//! - tokens typed 3 (control) become special added tokens, 4 (user defined) plain added tokens.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use candle_core::quantized::gguf_file::Value;
use tokenizers::models::bpe::{Merges, Vocab, BPE};
use tokenizers::{AddedToken, Tokenizer};

use crate::backend::{self, Shape};
use crate::error::{DataError, Result};

/// What a GGUF's metadata says about its tokenizer, built.
pub(crate) struct GgufTokenizer {
    pub tokenizer: Tokenizer,
    /// `bos_token`, `eos_token`, `unk_token`, `pad_token` (those the file names), and
    /// `mask_token` for Gemma models.
    pub special_tokens: BTreeMap<String, String>,
    pub chat_template: Option<String>,
    pub add_bos_token: Option<bool>,
    pub add_eos_token: Option<bool>,
}

const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

/// How transformers' GGUF converter shapes a SentencePiece vocabulary (`tokenizer.ggml.model`
/// `"llama"`) of a given `general.architecture`. The file does not say; the model family does
/// (`ferrotune_models::family::gguf_vocab_style`), so callers of [`Tokenizer::from_gguf`] pass it.
///
/// [`Tokenizer::from_gguf`]: crate::Tokenizer::from_gguf
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum GgufVocabStyle {
    /// `LlamaTokenizer`: a prefix space, merges derived from the scores.
    #[default]
    Llama,
    /// `GemmaTokenizer`: tokens of two or more spaces re-spelled as `▁▁`, merges derived from the
    /// file order, and a `<mask>` mask token (the class default).
    Gemma,
    /// Phi-3's `LlamaTokenizer` settings.
    Phi3,
}

/// Reads the tokenizer keys of `metadata` (from `path`, named in errors) and builds the tokenizer;
/// `vocab_style` says how a SentencePiece vocabulary of the file's architecture is shaped.
pub(crate) fn build(
    metadata: &HashMap<String, Value>,
    path: &Path,
    vocab_style: impl Fn(&str) -> GgufVocabStyle,
) -> Result<GgufTokenizer> {
    let meta = Meta { metadata, path };
    let architecture = meta
        .string("general.architecture")?
        .ok_or_else(|| meta.missing("general.architecture"))?;
    let model = meta
        .string("tokenizer.ggml.model")?
        .ok_or_else(|| meta.missing("tokenizer.ggml.model"))?;
    let tokens = meta
        .strings("tokenizer.ggml.tokens")?
        .ok_or_else(|| meta.missing("tokenizer.ggml.tokens"))?;
    let token_types = meta.ints("tokenizer.ggml.token_type")?;
    let merges = meta.strings("tokenizer.ggml.merges")?;
    let scores = meta.floats("tokenizer.ggml.scores")?;
    let pre = meta.string("tokenizer.ggml.pre")?;
    if let Some(types) = &token_types {
        if types.len() != tokens.len() {
            return Err(DataError::gguf(
                path,
                format!(
                    "tokenizer.ggml.token_type has {} entries but there are {} tokens",
                    types.len(),
                    tokens.len()
                ),
            ));
        }
    }

    let mut add_bos_token = meta.bool("tokenizer.ggml.add_bos_token")?;
    let add_eos_token = meta.bool("tokenizer.ggml.add_eos_token")?;
    match model.as_str() {
        // Older files have no flag, and llama.cpp adds BOS to a SentencePiece vocabulary.
        "llama" => {
            add_bos_token.get_or_insert(true);
        }
        // The reference tokenizer adds no BOS: the chat template writes `<bos>` itself.
        "gemma4" => add_bos_token = Some(false),
        _ => {}
    }

    let mut special_tokens = BTreeMap::new();
    for (name, key) in [
        ("bos_token", "tokenizer.ggml.bos_token_id"),
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("unk_token", "tokenizer.ggml.unknown_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ] {
        if let Some(id) = meta.int(key)? {
            let token = usize::try_from(id)
                .ok()
                .and_then(|i| tokens.get(i))
                .ok_or_else(|| {
                    DataError::gguf(
                        path,
                        format!(
                            "{key} is {id}, outside the vocabulary of {} tokens",
                            tokens.len()
                        ),
                    )
                })?;
            special_tokens.insert(name.to_string(), token.clone());
        }
    }

    // transformers instantiates the model type's tokenizer class around the converted pipeline;
    // for Gemma models that is `GemmaTokenizer`, whose `mask_token` defaults to `<mask>`.
    let style = vocab_style(&architecture);
    if style == GgufVocabStyle::Gemma {
        special_tokens.insert("mask_token".to_string(), "<mask>".to_string());
    }

    let source = Source {
        tokens: &tokens,
        merges: merges.as_deref(),
        scores: scores.as_deref(),
        path,
    };
    let mut tokenizer = match (model.as_str(), style) {
        ("llama", GgufVocabStyle::Gemma) => source.gemma()?,
        ("llama", GgufVocabStyle::Phi3) => source.sentencepiece(Shape::Phi3, None)?,
        ("llama", GgufVocabStyle::Llama) => source.sentencepiece(Shape::Llama { add_prefix_space: true, legacy: false }, None)?,
        ("gemma4", _) => source.sentencepiece(Shape::Gemma, None)?,
        ("gpt2", _) => source.byte_level()?,
        (other, _) => {
            return Err(DataError::gguf(
                path,
                format!("cannot build a tokenizer for tokenizer.ggml.model {other:?}; supported: gemma4, gpt2, llama"),
            ))
        }
    };

    // Control tokens become special added tokens, user-defined ones plain added tokens. In a
    // byte-level vocabulary a control token spelled outside the byte alphabet is a mislabel and
    // is skipped, as transformers does.
    if let Some(types) = &token_types {
        let alphabet: Option<HashSet<char>> =
            (model == "gpt2").then(|| byte_alphabet().into_iter().collect());
        let control: Vec<AddedToken> = tokens
            .iter()
            .zip(types)
            .filter(|(token, &kind)| {
                kind == CONTROL
                    && alphabet
                        .as_ref()
                        .is_none_or(|a| token.chars().all(|c| a.contains(&c)))
            })
            .map(|(token, _)| AddedToken::from(token.clone(), true).normalized(false))
            .collect();
        let add = |tokenizer: &mut Tokenizer, added: Vec<AddedToken>| {
            if !added.is_empty() {
                tokenizer
                    .add_tokens(added)
                    .map_err(|e| DataError::gguf(path, e.to_string()))?;
            }
            Ok::<_, DataError>(())
        };
        add(&mut tokenizer, control)?;
        let user_defined: Vec<AddedToken> = tokens
            .iter()
            .zip(types)
            .filter(|(token, &kind)| kind == USER_DEFINED && tokenizer.token_to_id(token).is_some())
            .map(|(token, _)| AddedToken::from(token.clone(), false).normalized(false))
            .collect();
        add(&mut tokenizer, user_defined)?;
    }

    // Split text the way this vocabulary's merges were learned, where the name is known.
    match pre.as_deref().and_then(pre_shape_for) {
        Some(PreShape::Split(regex)) => {
            let pre_tokenizer = backend::split_then_byte_level(regex, false)
                .map_err(|e| DataError::gguf(path, e))?;
            tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
        }
        Some(PreShape::DigitsThenByteLevel) => {
            tokenizer.with_pre_tokenizer(Some(backend::digits_then_byte_level()));
        }
        // GPT-2's split is what the byte-level tokenizer already has.
        Some(PreShape::ByteLevel) | None => {}
    }

    Ok(GgufTokenizer {
        tokenizer,
        special_tokens,
        chat_template: meta.string("tokenizer.chat_template")?,
        add_bos_token,
        add_eos_token,
    })
}

/// The HF pre-tokenizer a `tokenizer.ggml.pre` name stands for: how llama.cpp splits text before
/// the merges, as a `tokenizer.json` pre-tokenizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PreShape {
    /// `Split(regex, "isolated")` then `ByteLevel` (transformers' GGUF split for the name).
    Split(&'static str),
    /// `Digits(individual_digits)` then `ByteLevel(use_regex)`: every digit alone, then GPT-2's
    /// split (llama.cpp's `\p{N}` then GPT-2's regex).
    DigitsThenByteLevel,
    /// `ByteLevel(use_regex)` alone: GPT-2's split.
    ByteLevel,
}

/// llama.cpp's `tokenizer.ggml.pre` names and the HF pre-tokenizer each stands for: one table for
/// the reader (a name gives its row's pre-tokenizer) and the writer ([`gguf_vocab`]: a tokenizer's
/// pre-tokenizer gives the first name of its row, the one `convert_hf_to_gguf.py` writes for the
/// best known model of that shape).
///
/// The names of one row split text alike in llama.cpp, so a pre-tokenizer cannot tell them apart:
/// a Command-R or StarCoder tokenizer (digits then byte level, as SmolLM's) is written as `smollm`,
/// which llama.cpp splits the same way, where `convert_hf_to_gguf.py`, which tells them apart by
/// hashing the tokenizer's output on a test text, writes `command-r` or `starcoder`.
///
/// The `Split` rows are transformers' (`GGUF_PRE_TOKENIZER_SPLITS`). transformers has no row for
/// the digit-splitting names and reads those files with GPT-2's split alone; we build llama.cpp's
/// split (and the one in SmolLM2's own `tokenizer.json`) instead, which encodes SmolLM2's text as
/// transformers does, as no SmolLM2 merge joins a digit to anything.
const PRE_TOKENIZERS: &[(&[&str], PreShape)] = &[
    (
        &[
            "llama-bpe",
            "llama3",
            "llama-v3",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ],
        PreShape::Split(backend::LLAMA3_SPLIT),
    ),
    (
        &["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"],
        PreShape::Split(backend::QWEN2_SPLIT),
    ),
    (&["tekken"], PreShape::Split(backend::TEKKEN_SPLIT)),
    (
        &["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"],
        PreShape::Split(backend::GPT4O_SPLIT),
    ),
    (&["qwen35"], PreShape::Split(backend::QWEN35_SPLIT)),
    (
        &[
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
        ],
        PreShape::DigitsThenByteLevel,
    ),
    (&["gpt-2", "mpt", "olmo", "jais"], PreShape::ByteLevel),
];

/// The pre-tokenizer a `tokenizer.ggml.pre` name stands for ([`PRE_TOKENIZERS`]).
fn pre_shape_for(pre: &str) -> Option<PreShape> {
    PRE_TOKENIZERS
        .iter()
        .find(|(names, _)| names.contains(&pre))
        .map(|&(_, shape)| shape)
}

/// GPT-2's byte-to-character table: printable Latin-1 bytes stand for themselves, the others are
/// moved to U+0100 onwards, in byte order.
fn byte_alphabet() -> Vec<char> {
    let mut table = vec!['\0'; 256];
    let mut next = 256u32;
    for byte in 0..=255u32 {
        let printable = (0x21..=0x7e).contains(&byte)
            || (0xa1..=0xac).contains(&byte)
            || (0xae..=0xff).contains(&byte);
        table[byte as usize] = if printable {
            char::from_u32(byte).unwrap_or('\0')
        } else {
            let c = char::from_u32(next).unwrap_or('\0');
            next += 1;
            c
        };
    }
    table
}

struct Source<'a> {
    tokens: &'a [String],
    merges: Option<&'a [String]>,
    scores: Option<&'a [f64]>,
    path: &'a Path,
}

impl Source<'_> {
    /// `{token: index}`: a token listed twice keeps its last index, as a Python dict does.
    fn vocab_of(tokens: &[String]) -> HashMap<&str, u32> {
        tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_str(), i as u32))
            .collect()
    }

    /// The file's merges, split on spaces.
    fn file_merges(&self, merges: &[String]) -> Result<Merges> {
        merges
            .iter()
            .map(|m| {
                let mut parts = m.split(' ');
                match (parts.next(), parts.next(), parts.next()) {
                    (Some(a), Some(b), None) => Ok((a.to_string(), b.to_string())),
                    _ => Err(DataError::gguf(
                        self.path,
                        format!("tokenizer.ggml.merges has a malformed entry {m:?}"),
                    )),
                }
            })
            .collect()
    }

    /// Merges from the file, or derived from the vocabulary and the given (or the file's) scores.
    fn merges(&self, tokens: &[String], scores: Option<Vec<f64>>) -> Result<Merges> {
        if let Some(merges) = self.merges {
            return self.file_merges(merges);
        }
        let scores = match scores {
            Some(scores) => scores,
            None => self
                .scores
                .ok_or_else(|| {
                    DataError::gguf(
                        self.path,
                        "the file has neither tokenizer.ggml.merges nor tokenizer.ggml.scores",
                    )
                })?
                .to_vec(),
        };
        if scores.len() != tokens.len() {
            return Err(DataError::gguf(
                self.path,
                format!(
                    "tokenizer.ggml.scores has {} entries but there are {} tokens",
                    scores.len(),
                    tokens.len()
                ),
            ));
        }
        Ok(generate_merges(tokens, &scores))
    }

    fn bpe(&self, vocab: HashMap<&str, u32>, merges: Merges, shape: &Shape) -> Result<Tokenizer> {
        let vocab: Vocab = vocab.into_iter().map(|(t, i)| (t.to_string(), i)).collect();
        let builder = BPE::builder().vocab_and_merges(vocab, merges);
        let builder = match shape {
            Shape::Gpt2 { .. } => builder
                .continuing_subword_prefix(String::new())
                .end_of_word_suffix(String::new())
                .fuse_unk(false),
            Shape::Gemma => builder
                .fuse_unk(true)
                .byte_fallback(true)
                .unk_token("<unk>".into()),
            _ => builder.fuse_unk(true).byte_fallback(true),
        };
        let bpe = builder
            .build()
            .map_err(|e| DataError::gguf(self.path, format!("cannot build the BPE model: {e}")))?;
        let mut tokenizer = Tokenizer::new(bpe);
        shape
            .apply(&mut tokenizer, Some("<unk>"))
            .map_err(|e| DataError::gguf(self.path, e))?;
        // `apply` resets the BPE options to the class's; Gemma's unknown token is its default here.
        // The class then adds its default special tokens that are not added tokens yet (which
        // gives a token missing from the vocabulary a new id, as transformers does), and the
        // post-processor adds nothing until the file's flags say otherwise.
        add_missing_special_tokens(
            &mut tokenizer,
            shape.default_special_tokens().iter().map(|(_, t)| *t),
        )
        .map_err(|e| DataError::gguf(self.path, e))?;
        let processor = backend::bos_eos_post_processor(None, None)
            .map_err(|e| DataError::gguf(self.path, e))?;
        tokenizer.with_post_processor(Some(processor));
        Ok(tokenizer)
    }

    /// `LlamaTokenizer`-style (or Phi-3 / Gemma 4) SentencePiece BPE.
    fn sentencepiece(&self, shape: Shape, scores: Option<Vec<f64>>) -> Result<Tokenizer> {
        let merges = self.merges(self.tokens, scores)?;
        self.bpe(Self::vocab_of(self.tokens), merges, &shape)
    }

    /// Gemma files spell a token of two or more spaces with real spaces; `GemmaTokenizer` looks it
    /// up as `▁▁`. Merges (the file has none) are derived with the file order as the score.
    fn gemma(&self) -> Result<Tokenizer> {
        let respelled: Vec<String> = self
            .tokens
            .iter()
            .map(|t| {
                if t.contains(' ') && t.chars().all(crate::chat_template::is_py_space) {
                    "▁".repeat(t.chars().count())
                } else {
                    t.clone()
                }
            })
            .collect();
        let positions: Vec<f64> = (0..respelled.len()).map(|i| -(i as f64)).collect();
        let merges = self.merges(&respelled, Some(positions))?;
        self.bpe(Self::vocab_of(&respelled), merges, &Shape::Gemma)
    }

    /// Byte-level BPE (`GPT2Tokenizer`): a token with characters outside the byte alphabet is
    /// re-spelled through it from its UTF-8 bytes.
    fn byte_level(&self) -> Result<Tokenizer> {
        let table = byte_alphabet();
        let alphabet: HashSet<char> = table.iter().copied().collect();
        let respelled: Vec<String> = self
            .tokens
            .iter()
            .map(|t| {
                if t.chars().all(|c| alphabet.contains(&c)) {
                    t.clone()
                } else {
                    t.bytes().map(|b| table[b as usize]).collect()
                }
            })
            .collect();
        let merges = self.merges(self.tokens, None)?;
        self.bpe(
            Self::vocab_of(&respelled),
            merges,
            &Shape::Gpt2 {
                add_prefix_space: false,
            },
        )
    }
}

/// Adds each token that is not an added token yet as a special one (normalized = false).
pub(crate) fn add_missing_special_tokens<'a>(
    tokenizer: &mut Tokenizer,
    tokens: impl IntoIterator<Item = &'a str>,
) -> Result<(), String> {
    let mut missing: Vec<AddedToken> = Vec::new();
    for token in tokens {
        let known = tokenizer
            .get_added_vocabulary()
            .get_vocab()
            .contains_key(token)
            || missing.iter().any(|t| t.content == token);
        if !known && !token.is_empty() {
            missing.push(AddedToken::from(token, true));
        }
    }
    if !missing.is_empty() {
        tokenizer.add_tokens(missing).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// transformers' `generate_merges(vocab, vocab_scores)`: every split of every token into two
/// tokens of the vocabulary is a merge; merges sort best score first, then longer left part, then
/// longer right part, ties keeping vocabulary order.
fn generate_merges(tokens: &[String], scores: &[f64]) -> Merges {
    let vocab = Source::vocab_of(tokens);
    // `dict(zip(tokens, scores))`: first-seen order, last score.
    let mut order: Vec<&str> = Vec::new();
    let mut score_of: HashMap<&str, f64> = HashMap::new();
    for (token, &score) in tokens.iter().zip(scores) {
        if score_of.insert(token.as_str(), score).is_none() {
            order.push(token.as_str());
        }
    }
    let mut merges: Vec<(&str, &str, f64)> = Vec::new();
    for token in order {
        let score = score_of[token];
        let mut local: Vec<(&str, &str, f64)> = token
            .char_indices()
            .skip(1)
            .map(|(i, _)| (&token[..i], &token[i..]))
            .filter(|(l, r)| vocab.contains_key(l) && vocab.contains_key(r))
            .map(|(l, r)| (l, r, score))
            .collect();
        local.sort_by_key(|(l, r, _)| (vocab[l], vocab[r]));
        merges.extend(local);
    }
    let key = |m: &(&str, &str, f64)| (m.2, m.0.chars().count(), m.1.chars().count());
    merges.sort_by(|a, b| {
        let (ka, kb) = (key(a), key(b));
        kb.0.partial_cmp(&ka.0)
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(kb.1.cmp(&ka.1))
            .then(kb.2.cmp(&ka.2))
    });
    merges
        .into_iter()
        .map(|(l, r, _)| (l.to_string(), r.to_string()))
        .collect()
}

/// Typed access to GGUF metadata, with errors naming the file and key.
struct Meta<'a> {
    metadata: &'a HashMap<String, Value>,
    path: &'a Path,
}

impl Meta<'_> {
    fn missing(&self, key: &str) -> DataError {
        DataError::gguf(
            self.path,
            format!("the metadata has no {key}, so it describes no tokenizer"),
        )
    }

    fn wrong(&self, key: &str, expected: &str, value: &Value) -> DataError {
        DataError::gguf(
            self.path,
            format!("{key} should be {expected}, found {:?}", value.value_type()),
        )
    }

    fn string(&self, key: &str) -> Result<Option<String>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(self.wrong(key, "a string", v)),
        }
    }

    fn bool(&self, key: &str) -> Result<Option<bool>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => int_of(v)
                .map(|i| Some(i != 0))
                .ok_or_else(|| self.wrong(key, "a bool", v)),
        }
    }

    fn int(&self, key: &str) -> Result<Option<i64>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(v) => int_of(v)
                .map(Some)
                .ok_or_else(|| self.wrong(key, "an integer", v)),
        }
    }

    fn array(&self, key: &str) -> Result<Option<&Vec<Value>>> {
        match self.metadata.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => Ok(Some(items)),
            Some(v) => Err(self.wrong(key, "an array", v)),
        }
    }

    /// The array at `key`, each element read by `item`; an error naming `what` (the array's
    /// kind) for an element it cannot read.
    fn array_of<T>(
        &self,
        key: &str,
        what: &str,
        item: impl Fn(&Value) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .map(|v| item(v).ok_or_else(|| self.wrong(key, what, v)))
            .collect::<Result<Vec<_>>>()
            .map(Some)
    }

    fn strings(&self, key: &str) -> Result<Option<Vec<String>>> {
        self.array_of(key, "an array of strings", |v| match v {
            Value::String(s) => Some(s.clone()),
            _ => None,
        })
    }

    fn ints(&self, key: &str) -> Result<Option<Vec<i64>>> {
        self.array_of(key, "an array of integers", int_of)
    }

    fn floats(&self, key: &str) -> Result<Option<Vec<f64>>> {
        self.array_of(key, "an array of numbers", |v| match v {
            Value::F32(f) => Some(*f as f64),
            Value::F64(f) => Some(*f),
            v => int_of(v).map(|i| i as f64),
        })
    }
}

fn int_of(value: &Value) -> Option<i64> {
    Some(match value {
        Value::U8(v) => *v as i64,
        Value::I8(v) => *v as i64,
        Value::U16(v) => *v as i64,
        Value::I16(v) => *v as i64,
        Value::U32(v) => *v as i64,
        Value::I32(v) => *v as i64,
        Value::U64(v) => i64::try_from(*v).ok()?,
        Value::I64(v) => *v,
        _ => return None,
    })
}

/// The tokenizer's own JSON (not GGUF metadata).
type Json = serde_json::Value;

/// A vocabulary as llama.cpp's GGUF tokenizer keys hold it (`tokenizer.ggml.*`), for writing a
/// GGUF file: byte-level BPE (`model = "gpt2"`) or SentencePiece-style BPE (`"llama"`).
#[derive(Debug, Clone, PartialEq)]
pub struct GgufVocab {
    /// `tokenizer.ggml.model`: `gpt2` or `llama`.
    pub model: &'static str,
    /// Every token by id, `vocab_size` of them (ids the tokenizer lacks are `[PAD{id}]`).
    pub tokens: Vec<String>,
    /// llama.cpp's token types: 1 normal, 2 unknown, 3 control (special added tokens), 4
    /// user-defined (other added tokens), 5 unused (the padding ids), 6 byte (`<0xNN>`).
    pub token_types: Vec<i32>,
    /// The merges as `"left right"`, in rank order.
    pub merges: Vec<String>,
    /// `llama` vocabularies: each token's score, which llama.cpp's SentencePiece tokenizer merges
    /// by: minus the rank of the first merge that forms the token, so that it applies the
    /// merges in the tokenizer's order (tokens no merge forms: 0 for single characters, bytes
    /// and special tokens, -1e9 for the rest).
    pub scores: Option<Vec<f32>>,
    /// `tokenizer.ggml.pre`: llama.cpp's name for the pre-tokenizer of `tokenizer.json`, from the
    /// table the reader splits text by (`None`: the table has none for it).
    pub pre: Option<&'static str>,
    /// `llama` vocabularies: whether a space (`▁`) is put before the text.
    pub add_space_prefix: Option<bool>,
}

/// The GGUF vocabulary of `tok` padded to `vocab_size` ids, or an error saying why it cannot be
/// written as one: byte-level BPE vocabularies (Llama 3, Qwen, SmolLM, Mistral's tekken) and
/// SentencePiece-style BPE ones with byte fallback (Llama 2, Mistral 7B) are.
pub fn gguf_vocab(
    tok: &crate::Tokenizer,
    vocab_size: usize,
) -> std::result::Result<GgufVocab, String> {
    let json: Json = serde_json::from_str(
        &tok.inner()
            .to_string(false)
            .map_err(|e| format!("cannot serialise the tokenizer: {e}"))?,
    )
    .map_err(|e| format!("cannot read the tokenizer's JSON: {e}"))?;
    let model = &json["model"];
    let pipeline = format!("{}{}", json["normalizer"], json["pre_tokenizer"]);
    let byte_fallback = model["byte_fallback"] == Json::Bool(true);
    let sentencepiece = byte_fallback && pipeline.contains('\u{2581}');
    let byte_level = !byte_fallback
        && (json["decoder"]["type"] == "ByteLevel" || pipeline.contains("\"ByteLevel\""));
    if model["type"] != "BPE" || !(byte_level || sentencepiece) {
        return Err(
            "only BPE tokenizers, byte-level (Llama 3, Qwen, SmolLM, Mistral tekken) or \
             SentencePiece-style with byte fallback (Llama 2, Mistral 7B), can be written as a \
             GGUF vocabulary; this one is another kind (a Unigram model, or Gemma's)"
                .into(),
        );
    }
    let mut tokens: Vec<Option<String>> = vec![None; vocab_size];
    let mut types = vec![1i32; vocab_size];
    let mut put = |id: u64, token: &str, kind: i32| -> std::result::Result<(), String> {
        let slot = tokens.get_mut(id as usize).ok_or_else(|| {
            format!("token {token:?} has id {id}, beyond the model's {vocab_size} embeddings")
        })?;
        *slot = Some(token.to_string());
        types[id as usize] = kind;
        Ok(())
    };
    for (token, id) in model["vocab"].as_object().into_iter().flatten() {
        let is_byte = sentencepiece
            && token.len() == 6
            && token.starts_with("<0x")
            && token.ends_with('>')
            && u8::from_str_radix(&token[3..5], 16).is_ok();
        put(
            id.as_u64().unwrap_or(u64::MAX),
            token,
            if is_byte { 6 } else { 1 },
        )?;
    }
    let unk = model["unk_token"].as_str();
    for added in json["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (added["id"].as_u64(), added["content"].as_str()) else {
            continue;
        };
        let kind = match (
            Some(content) == unk && sentencepiece,
            added["special"] == true,
        ) {
            (true, _) => 2,
            (false, true) => 3,
            (false, false) => 4,
        };
        put(id, content, kind)?;
    }
    let mut token_types = types;
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(id, t)| {
            t.unwrap_or_else(|| {
                token_types[id] = 5;
                format!("[PAD{id}]")
            })
        })
        .collect();
    let merges = model["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| match m {
            Json::String(s) => Ok(s.clone()),
            Json::Array(pair) => match (pair.first(), pair.get(1)) {
                (Some(Json::String(a)), Some(Json::String(b))) => Ok(format!("{a} {b}")),
                _ => Err(format!("a merge is {m}, not two tokens")),
            },
            other => Err(format!("a merge is {other}, not two tokens")),
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    if byte_level {
        return Ok(GgufVocab {
            model: "gpt2",
            tokens,
            token_types,
            merges,
            scores: None,
            // llama.cpp's converter names the split `tokenizer.json` holds, which the tokenizer
            // class may have replaced with its own (SmolLM2's `GPT2Tokenizer`).
            pre: tok
                .written_pre_tokenizer()
                .and_then(pre_name)
                .or_else(|| pre_name(&json["pre_tokenizer"])),
            add_space_prefix: None,
        });
    }
    let mut rank_of: HashMap<String, usize> = HashMap::new();
    for (rank, m) in merges.iter().enumerate() {
        rank_of.entry(m.replacen(' ', "", 1)).or_insert(rank);
    }
    let scores = tokens
        .iter()
        .zip(&token_types)
        .map(|(t, &kind)| match rank_of.get(t) {
            Some(&rank) => -(rank as f32),
            None if kind != 1 || t.chars().count() == 1 => 0.0,
            None => -1e9,
        })
        .collect();
    Ok(GgufVocab {
        model: "llama",
        tokens,
        token_types,
        merges,
        scores: Some(scores),
        pre: None,
        // `▁` put first by the normalizer (`Prepend`) or the pre-tokenizer (Metaspace).
        add_space_prefix: Some(
            pipeline.contains("\"Prepend\"")
                || json["pre_tokenizer"]["prepend_scheme"]
                    .as_str()
                    .is_some_and(|s| s != "never"),
        ),
    })
}

/// llama.cpp's `tokenizer.ggml.pre` for a pre-tokenizer (a `tokenizer.json` `pre_tokenizer`): the
/// first name of the [`PRE_TOKENIZERS`] row whose pre-tokenizer it is (`None`: none is).
fn pre_name(pre: &Json) -> Option<&'static str> {
    let steps: Vec<&Json> = match pre["type"].as_str() {
        Some("Sequence") => pre["pretokenizers"].as_array()?.iter().collect(),
        Some(_) => vec![pre],
        None => return None,
    };
    let kinds: Vec<&str> = steps.iter().filter_map(|s| s["type"].as_str()).collect();
    // `use_regex` (GPT-2's split) is on unless the file turns it off.
    let gpt2_split = |step: &Json| step["use_regex"] != false;
    let shape = match kinds.as_slice() {
        ["Split", "ByteLevel"] => {
            let regex = steps[0]["pattern"]["Regex"].as_str()?;
            PRE_TOKENIZERS.iter().find_map(|&(_, shape)| match shape {
                PreShape::Split(r) if r == regex => Some(shape),
                _ => None,
            })?
        }
        ["Digits", "ByteLevel"]
            if steps[0]["individual_digits"] == true && gpt2_split(steps[1]) =>
        {
            PreShape::DigitsThenByteLevel
        }
        ["ByteLevel"] if gpt2_split(steps[0]) => PreShape::ByteLevel,
        _ => return None,
    };
    PRE_TOKENIZERS
        .iter()
        .find(|&&(_, s)| s == shape)
        .map(|(names, _)| names[0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_is_gpt2s() {
        let table = byte_alphabet();
        assert_eq!(table[b' ' as usize], 'Ġ');
        assert_eq!(table[b'\n' as usize], 'Ċ');
        assert_eq!(table[b'a' as usize], 'a');
        assert_eq!(table.iter().collect::<HashSet<_>>().len(), 256);
    }

    #[test]
    fn merges_sort_like_python() {
        let tokens: Vec<String> = ["a", "b", "ab", "ba", "aba"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        // scores: "ab" best, then "aba", then "ba"
        let merges = generate_merges(&tokens, &[0.0, 0.0, -1.0, -3.0, -2.0]);
        let merges: Vec<(&str, &str)> = merges
            .iter()
            .map(|(a, b)| (a.as_str(), b.as_str()))
            .collect();
        assert_eq!(
            merges,
            vec![("a", "b"), ("ab", "a"), ("a", "ba"), ("b", "a")]
        );
    }

    /// One table both ways: every name reads as its row's pre-tokenizer, and that pre-tokenizer
    /// (as the reader builds it) is written back as the row's first name.
    #[test]
    fn pre_tokenizer_names_read_and_write_back_through_one_table() {
        use tokenizers::pre_tokenizers::byte_level::ByteLevel;
        use tokenizers::pre_tokenizers::PreTokenizerWrapper;
        for &(names, shape) in PRE_TOKENIZERS {
            for name in names {
                assert_eq!(pre_shape_for(name), Some(shape), "{name}");
            }
            let built: PreTokenizerWrapper = match shape {
                PreShape::Split(regex) => backend::split_then_byte_level(regex, false).unwrap(),
                PreShape::DigitsThenByteLevel => backend::digits_then_byte_level(),
                // What the byte-level tokenizer has already (`Shape::Gpt2`).
                PreShape::ByteLevel => ByteLevel::new(false, true, true).into(),
            };
            let json = serde_json::to_value(&built).unwrap();
            assert_eq!(pre_name(&json), Some(names[0]), "{json}");
        }
        // Digits grouped, or GPT-2's split turned off: not a pre-tokenizer llama.cpp names.
        let digits = |individual: bool, use_regex: bool| {
            serde_json::json!({"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": individual},
                {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                 "use_regex": use_regex}]})
        };
        assert_eq!(pre_name(&digits(true, true)), Some("smollm"));
        assert_eq!(pre_name(&digits(false, true)), None);
        assert_eq!(pre_name(&digits(true, false)), None);
    }
}
