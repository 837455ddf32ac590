//! The tokenizer pipelines transformers' tokenizer classes build for themselves.
//!
//! In transformers 5 a tokenizer class such as `LlamaTokenizer` does not take `tokenizer.json` as it
//! is: it keeps the vocabulary, merges and post-processor, and sets its own normalizer,
//! pre-tokenizer, decoder and BPE options. The GGUF converters build tokenizers through these same
//! classes. This module reproduces those pipelines on a `tokenizers::Tokenizer`.

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::models::ModelWrapper;
use tokenizers::normalizers::prepend::Prepend;
use tokenizers::normalizers::replace::Replace;
use tokenizers::normalizers::unicode::NFC;
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::sequence::Sequence as PreTokenizerSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{SplitDelimiterBehavior, Tokenizer};

/// Qwen2's pre-tokenizer regex (`tokenization_qwen2.PRETOKENIZE_REGEX`).
pub(crate) const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen3.5's pre-tokenizer regex.
pub(crate) const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's pre-tokenizer regex.
pub(crate) const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Mistral's tekken pre-tokenizer regex.
pub(crate) const TEKKEN_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// GPT-4o's pre-tokenizer regex.
pub(crate) const GPT4O_SPLIT: &str = r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A transformers tokenizer class whose pipeline we reproduce.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Shape {
    /// `tokenizer.json` as it is (`TokenizersBackend`, `PreTrainedTokenizerFast`, and classes
    /// without a pipeline of their own).
    AsIs,
    /// `LlamaTokenizer`: Metaspace with the given prepend scheme, byte fallback.
    Llama {
        add_prefix_space: bool,
        legacy: bool,
    },
    /// `GemmaTokenizer`: spaces replaced by `▁` in the normalizer, byte fallback.
    Gemma,
    /// `Qwen2Tokenizer`: NFC, Qwen2's split regex, byte level.
    Qwen2 { add_prefix_space: bool },
    /// `GPT2Tokenizer`: byte level with GPT-2's regex.
    Gpt2 { add_prefix_space: bool },
    /// The GGUF converter's Phi-3 pipeline: `LlamaTokenizer`, but the prefix space comes from a
    /// normalizer and there is no pre-tokenizer.
    Phi3,
}

impl Shape {
    /// The special tokens the class defaults to when the configuration does not name them.
    pub(crate) fn default_special_tokens(&self) -> &'static [(&'static str, &'static str)] {
        match self {
            Shape::AsIs => &[],
            Shape::Llama { .. } | Shape::Phi3 => &[
                ("unk_token", "<unk>"),
                ("bos_token", "<s>"),
                ("eos_token", "</s>"),
            ],
            Shape::Gemma => &[
                ("unk_token", "<unk>"),
                ("bos_token", "<bos>"),
                ("eos_token", "<eos>"),
                ("pad_token", "<pad>"),
                ("mask_token", "<mask>"),
            ],
            Shape::Qwen2 { .. } => &[
                ("unk_token", "<|endoftext|>"),
                ("eos_token", "<|endoftext|>"),
                ("pad_token", "<|endoftext|>"),
            ],
            Shape::Gpt2 { .. } => &[
                ("unk_token", "<|endoftext|>"),
                ("bos_token", "<|endoftext|>"),
                ("eos_token", "<|endoftext|>"),
            ],
        }
    }

    /// Sets the class's normalizer, pre-tokenizer and decoder on `tokenizer`, and its options on
    /// the BPE model. `unk_token` is the class's resolved unknown token (Gemma puts it in the model).
    pub(crate) fn apply(
        &self,
        tokenizer: &mut Tokenizer,
        unk_token: Option<&str>,
    ) -> Result<(), String> {
        let (normalizer, pre_tokenizer, decoder): (
            Option<NormalizerWrapper>,
            Option<PreTokenizerWrapper>,
            Option<DecoderWrapper>,
        ) = match self {
            Shape::AsIs => return Ok(()),
            Shape::Llama {
                add_prefix_space,
                legacy,
            } => {
                let scheme = match (add_prefix_space, legacy) {
                    (true, true) => PrependScheme::Always,
                    (true, false) => PrependScheme::First,
                    (false, _) => PrependScheme::Never,
                };
                let pre = Metaspace::new('▁', scheme, false);
                (
                    None,
                    Some(pre.into()),
                    Some(sentencepiece_decoder(*add_prefix_space)?),
                )
            }
            Shape::Phi3 => {
                let normalizer = tokenizers::normalizers::Sequence::new(vec![
                    Prepend::new("▁".into()).into(),
                    Replace::new(" ", "▁").map_err(|e| e.to_string())?.into(),
                ]);
                (
                    Some(normalizer.into()),
                    None,
                    Some(sentencepiece_decoder(true)?),
                )
            }
            Shape::Gemma => {
                let normalizer = Replace::new(" ", "▁").map_err(|e| e.to_string())?;
                let pre = Split::new(
                    SplitPattern::String(" ".into()),
                    SplitDelimiterBehavior::MergedWithPrevious,
                    false,
                )
                .map_err(|e| e.to_string())?;
                (
                    Some(normalizer.into()),
                    Some(pre.into()),
                    Some(sentencepiece_decoder(false)?),
                )
            }
            Shape::Qwen2 { add_prefix_space } => {
                let pre = split_then_byte_level(QWEN2_SPLIT, *add_prefix_space)?;
                (
                    Some(NFC.into()),
                    Some(pre),
                    Some(ByteLevel::default().into()),
                )
            }
            Shape::Gpt2 { add_prefix_space } => {
                let pre = ByteLevel::new(*add_prefix_space, true, true);
                (None, Some(pre.into()), Some(ByteLevel::default().into()))
            }
        };
        tokenizer
            .with_normalizer(normalizer)
            .map_err(|e| e.to_string())?;
        tokenizer.with_pre_tokenizer(pre_tokenizer);
        tokenizer.with_decoder(decoder);

        if let ModelWrapper::BPE(bpe) = tokenizer.get_model() {
            let sentencepiece = matches!(self, Shape::Llama { .. } | Shape::Phi3 | Shape::Gemma);
            let unk = match self {
                Shape::Gemma => Some(unk_token.unwrap_or("None").to_string()),
                _ => None,
            };
            let affix = (!sentencepiece).then(String::new);
            let same = bpe.dropout.is_none()
                && !bpe.ignore_merges
                && bpe.unk_token == unk
                && bpe.fuse_unk == sentencepiece
                && bpe.byte_fallback == sentencepiece
                && bpe.continuing_subword_prefix == affix
                && bpe.end_of_word_suffix == affix;
            // Cloning a large BPE model costs time; only do it when an option changes.
            if !same {
                let mut bpe: BPE = bpe.clone();
                bpe.dropout = None;
                bpe.ignore_merges = false;
                bpe.unk_token = unk;
                bpe.fuse_unk = sentencepiece;
                bpe.byte_fallback = sentencepiece;
                bpe.continuing_subword_prefix = affix.clone();
                bpe.end_of_word_suffix = affix;
                tokenizer.with_model(bpe);
            }
        }
        Ok(())
    }
}

/// `Replace("▁", " ")`, `ByteFallback`, `Fuse`, and `Strip(" ", 1, 0)` when a prefix space is added.
fn sentencepiece_decoder(strip_prefix_space: bool) -> Result<DecoderWrapper, String> {
    let mut steps: Vec<DecoderWrapper> = vec![
        Replace::new("▁", " ").map_err(|e| e.to_string())?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if strip_prefix_space {
        steps.push(Strip::new(' ', 1, 0).into());
    }
    Ok(DecoderSequence::new(steps).into())
}

/// `Split(regex, "isolated")` then `ByteLevel(add_prefix_space, use_regex=False)`.
pub(crate) fn split_then_byte_level(
    regex: &str,
    add_prefix_space: bool,
) -> Result<PreTokenizerWrapper, String> {
    let split = Split::new(
        SplitPattern::Regex(regex.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| format!("bad pre-tokenizer regex: {e}"))?;
    Ok(PreTokenizerSequence::new(vec![
        split.into(),
        ByteLevel::new(add_prefix_space, true, false).into(),
    ])
    .into())
}

/// `Digits(individual_digits = true)` then `ByteLevel(add_prefix_space = false, use_regex = true)`:
/// every digit on its own, then GPT-2's split (SmolLM's, StarCoder's `tokenizer.json`).
pub(crate) fn digits_then_byte_level() -> PreTokenizerWrapper {
    PreTokenizerSequence::new(vec![
        Digits::new(true).into(),
        ByteLevel::new(false, true, true).into(),
    ])
    .into()
}

/// transformers' `update_post_processor`: `bos $A eos` with each part present when its flag is on
/// and the token exists.
pub(crate) fn bos_eos_post_processor(
    bos: Option<(&str, u32)>,
    eos: Option<(&str, u32)>,
) -> Result<TemplateProcessing, String> {
    let mut single = String::new();
    let mut pair = String::new();
    let mut special: Vec<(String, u32)> = Vec::new();
    if let Some((token, id)) = bos {
        single.push_str(&format!("{token}:0 "));
        special.push((token.to_string(), id));
    }
    single.push_str("$A:0");
    if let Some((token, id)) = eos {
        single.push_str(&format!(" {token}:0"));
        if !special.iter().any(|(t, _)| t == token) {
            special.push((token.to_string(), id));
        }
    }
    pair.push_str(&single);
    if let Some((token, _)) = bos {
        pair.push_str(&format!(" {token}:1"));
    }
    pair.push_str(" $B:1");
    if let Some((token, _)) = eos {
        pair.push_str(&format!(" {token}:1"));
    }
    TemplateProcessing::builder()
        .try_single(single.as_str())
        .map_err(|e| e.to_string())?
        .try_pair(pair.as_str())
        .map_err(|e| e.to_string())?
        .special_tokens(special)
        .build()
        .map_err(|e| e.to_string())
}
