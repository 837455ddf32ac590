//! [`Tokenizer`]: a Hugging Face tokenizer with its chat template and special tokens, loaded from a
//! transformers folder or from the metadata of a GGUF file, behaving as transformers 5's
//! `AutoTokenizer.from_pretrained(folder)` / `AutoTokenizer.from_pretrained(folder, gguf_file=...)`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde_json::{Map, Value as Json};
use tokenizers::models::ModelWrapper;
use tokenizers::AddedToken;

use crate::backend::{self, Shape};
use crate::chat_template::{ChatMessage, ChatTemplate};
use crate::error::{DataError, Result};
use crate::gguf;

/// The named special tokens transformers knows (`SPECIAL_TOKENS_ATTRIBUTES`).
const NAMED_SPECIAL_TOKENS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

const DIR_TEMPLATE_LOCATIONS: &str =
    "no chat_template.jinja, and no \"chat_template\" in tokenizer_config.json";
const GGUF_TEMPLATE_LOCATIONS: &str = "no tokenizer.chat_template in the GGUF metadata";

/// A tokenizer: the `tokenizers` pipeline, plus what transformers keeps beside it — the chat
/// template, the special tokens, and the BOS/EOS/PAD ids.
#[derive(Clone)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    /// Where `chat_template` was read from, for the errors rendering it gives.
    template_origin: Option<String>,
    /// The template named `tool_use` of a config's list of named templates, and where it was
    /// read from: what transformers renders with when it is given tools.
    tool_template: Option<(String, String)>,
    special_tokens: BTreeMap<String, String>,
    extra_special_tokens: Vec<String>,
    bos_id: Option<u32>,
    eos_ids: Vec<u32>,
    pad_id: Option<u32>,
    unk_id: Option<u32>,
    add_bos_token: bool,
    add_eos_token: bool,
    clean_up_tokenization_spaces: bool,
    vocab_size: usize,
    origin: PathBuf,
    template_locations: &'static str,
    /// The pre-tokenizer `tokenizer.json` holds, where the tokenizer class put its own in its
    /// place (`GPT2Tokenizer` over SmolLM's digit split): what llama.cpp's converter sees.
    written_pre_tokenizer: Option<Json>,
    /// The rows of the embedding of the model this tokenizer feeds, once a recipe says
    /// ([`Tokenizer::feed_model`]): ids past it are errors, not an index out of bounds later.
    model_vocab: Option<usize>,
    /// [`Tokenizer::max_token_bytes`], worked out on first use.
    pub(crate) max_token_bytes: std::sync::OnceLock<usize>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("origin", &self.origin)
            .field("vocab_size", &self.vocab_size)
            .field("special_tokens", &self.special_tokens)
            .field("bos_id", &self.bos_id)
            .field("eos_ids", &self.eos_ids)
            .field("pad_id", &self.pad_id)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish_non_exhaustive()
    }
}

/// A special token as `tokenizer_config.json` gives it: a string, or an `AddedToken` object.
#[derive(Debug, Clone)]
struct TokenSpec {
    content: String,
    flags: Option<AddedToken>,
}

impl TokenSpec {
    fn plain(content: &str) -> Self {
        Self {
            content: content.to_string(),
            flags: None,
        }
    }

    /// `None` for JSON `null` and for values that are not tokens. An object without `"special"`
    /// gets `special_default`; without `"normalized"`, the opposite of `special`.
    fn from_json(value: &Json, special_default: bool) -> Option<Self> {
        match value {
            Json::String(s) => Some(Self::plain(s)),
            Json::Object(obj) => {
                let content = obj.get("content")?.as_str()?.to_string();
                let flag = |name: &str, default: bool| {
                    obj.get(name).and_then(Json::as_bool).unwrap_or(default)
                };
                let special = flag("special", special_default);
                let token = AddedToken::from(content.clone(), special)
                    .single_word(flag("single_word", false))
                    .lstrip(flag("lstrip", false))
                    .rstrip(flag("rstrip", false))
                    .normalized(flag("normalized", !special));
                Some(Self {
                    content,
                    flags: Some(token),
                })
            }
            _ => None,
        }
    }

    /// The token to add when it is not an added token yet; named special tokens are special.
    fn added_token(&self) -> AddedToken {
        match &self.flags {
            Some(token) => token.clone().special(true),
            None => AddedToken::from(self.content.clone(), true),
        }
    }
}

impl Tokenizer {
    /// Loads a transformers tokenizer folder: `tokenizer.json` (required), `tokenizer_config.json`
    /// (special tokens, `add_bos_token`/`add_eos_token`, the tokenizer class, and maybe the chat
    /// template), `chat_template.jinja` (preferred over the config's template), and
    /// `generation_config.json` / `config.json` for extra EOS ids.
    ///
    /// As in transformers 5, `LlamaTokenizer`, `GemmaTokenizer`, `Qwen2Tokenizer` and
    /// `GPT2Tokenizer` keep the vocabulary, merges and post-processor of `tokenizer.json` but use
    /// their own normalizer, pre-tokenizer and decoder; other classes use `tokenizer.json` as it is.
    pub fn from_dir(path: impl AsRef<Path>) -> Result<Self> {
        let dir = path.as_ref();
        if !dir.exists() {
            return Err(DataError::NotFound {
                path: dir.to_path_buf(),
                what: "tokenizer folder",
            });
        }
        if !dir.is_dir() {
            return Err(DataError::invalid(
                dir,
                "not a folder (expected a folder with tokenizer.json, or use Tokenizer::from_gguf for a .gguf file)",
            ));
        }
        let tokenizer_path = dir.join("tokenizer.json");
        let raw = read_text(&tokenizer_path, "tokenizer.json is required")?;
        let config_path = dir.join("tokenizer_config.json");
        let config = read_json_object(&config_path, "optional")?.unwrap_or_default();

        // The class transformers would instantiate, and so the pipeline it would build.
        let class = config
            .get("tokenizer_class")
            .and_then(Json::as_str)
            .map(|c| c.strip_suffix("Fast").unwrap_or(c));
        let flag =
            |key: &str, default: bool| config.get(key).and_then(Json::as_bool).unwrap_or(default);
        let shape = match class {
            Some("LlamaTokenizer") if !raw.contains("\"ByteLevel\"") => Shape::Llama {
                add_prefix_space: flag("add_prefix_space", true),
                legacy: flag("legacy", false),
            },
            Some("GemmaTokenizer") => Shape::Gemma,
            Some("Qwen2Tokenizer") => Shape::Qwen2 {
                add_prefix_space: flag("add_prefix_space", false),
            },
            Some("GPT2Tokenizer") => Shape::Gpt2 {
                add_prefix_space: flag("add_prefix_space", false),
            },
            _ => Shape::AsIs,
        };

        let mut inner = tokenizers::Tokenizer::from_str(&raw).map_err(|e| {
            if serde_json::from_str::<serde::de::IgnoredAny>(&raw).is_err() {
                DataError::invalid(&tokenizer_path, format!("not valid JSON: {e}"))
            } else {
                DataError::invalid(&tokenizer_path, format!("not a tokenizers definition: {e}"))
            }
        })?;
        drop(raw);

        let written_pre_tokenizer = (shape != Shape::AsIs)
            .then(|| serde_json::to_value(inner.get_pre_tokenizer()).ok())
            .flatten()
            .filter(|pre| !pre.is_null());
        let (named, extras) = special_tokens_of(&config, &shape);
        let unk = named
            .iter()
            .find(|(k, _)| k == "unk_token")
            .map(|(_, t)| t.content.as_str());
        shape
            .apply(&mut inner, unk)
            .map_err(|e| DataError::invalid(&tokenizer_path, e))?;

        // `added_tokens_decoder` of the config: tokens the pipeline does not have as they are
        // declared are added (in id order), as transformers does.
        if let Some(Json::Object(decoder)) = config.get("added_tokens_decoder") {
            let mut declared: Vec<(u64, AddedToken)> = decoder
                .iter()
                .filter_map(|(id, v)| {
                    Some((
                        id.parse::<u64>().ok()?,
                        TokenSpec::from_json(v, false)?.flags?,
                    ))
                })
                .collect();
            declared.sort_by_key(|(id, _)| *id);
            let present = inner.get_added_tokens_decoder();
            let present: std::collections::HashSet<&AddedToken> = present.values().collect();
            let new: Vec<AddedToken> = declared
                .into_iter()
                .map(|(_, t)| t)
                .filter(|t| !present.contains(t))
                .collect();
            if !new.is_empty() {
                inner
                    .add_tokens(new)
                    .map_err(|e| DataError::invalid(&config_path, e.to_string()))?;
            }
        }

        // Special tokens that are not added tokens yet become special added tokens.
        let mut missing: Vec<AddedToken> = Vec::new();
        for spec in named.iter().map(|(_, t)| t).chain(&extras) {
            let known = inner
                .get_added_vocabulary()
                .get_vocab()
                .contains_key(&spec.content)
                || missing.iter().any(|t| t.content == spec.content);
            if !known && !spec.content.is_empty() {
                missing.push(spec.added_token());
            }
        }
        if !missing.is_empty() {
            inner
                .add_tokens(missing)
                .map_err(|e| DataError::invalid(&tokenizer_path, e.to_string()))?;
        }
        // `Qwen2Tokenizer` then (re-)adds every special token as a plain special `AddedToken`.
        if matches!(shape, Shape::Qwen2 { .. }) {
            let all: Vec<AddedToken> = named
                .iter()
                .map(|(_, t)| &t.content)
                .chain(extras.iter().map(|t| &t.content))
                .map(|t| AddedToken::from(t.clone(), true))
                .collect();
            inner
                .add_tokens(all)
                .map_err(|e| DataError::invalid(&tokenizer_path, e.to_string()))?;
        }

        let explicit = config.contains_key("add_bos_token") || config.contains_key("add_eos_token");
        let add_bos_token = config.get("add_bos_token").is_some_and(truthy);
        let add_eos_token = config.get("add_eos_token").is_some_and(truthy);
        let special_tokens: BTreeMap<String, String> = named
            .iter()
            .map(|(k, t)| (k.clone(), t.content.clone()))
            .collect();
        let needs_processor = explicit || inner.get_post_processor().is_none();

        let (chat_template, template_origin) =
            chat_template_of(dir, &config, &config_path)?.unzip();
        let mut tokenizer = Self::assemble(
            inner,
            special_tokens,
            extras.into_iter().map(|t| t.content).collect(),
            chat_template,
            needs_processor.then_some((add_bos_token, add_eos_token)),
            &tokenizer_path,
        )?;
        tokenizer.tool_template = tool_use_template_of(&config, &config_path);
        tokenizer.clean_up_tokenization_spaces = config
            .get("clean_up_tokenization_spaces")
            .is_some_and(truthy);
        tokenizer
            .inner
            .set_encode_special_tokens(flag("split_special_tokens", false));
        tokenizer.origin = dir.to_path_buf();
        tokenizer.template_origin = template_origin;
        tokenizer.template_locations = DIR_TEMPLATE_LOCATIONS;
        tokenizer.written_pre_tokenizer = written_pre_tokenizer;

        // EOS may be a list; generation_config.json and config.json add theirs after the tokenizer's.
        for file in ["generation_config.json", "config.json"] {
            let path = dir.join(file);
            let Some(obj) = read_json_object(&path, "optional")? else {
                continue;
            };
            let section = |key: &str| {
                obj.get(key).filter(|v| !v.is_null()).or_else(|| {
                    obj.get("text_config")
                        .and_then(|c| c.get(key))
                        .filter(|v| !v.is_null())
                })
            };
            for id in section("eos_token_id").map(ids_of).unwrap_or_default() {
                if !tokenizer.eos_ids.contains(&id) {
                    tokenizer.eos_ids.push(id);
                }
            }
            if tokenizer.pad_id.is_none() {
                tokenizer.pad_id = section("pad_token_id").and_then(|v| ids_of(v).first().copied());
            }
            if tokenizer.bos_id.is_none() {
                tokenizer.bos_id = section("bos_token_id").and_then(|v| ids_of(v).first().copied());
            }
        }
        Ok(tokenizer)
    }

    /// Builds the tokenizer a llama.cpp GGUF file describes in its metadata (`tokenizer.ggml.*`,
    /// `tokenizer.chat_template`), as transformers does for `AutoTokenizer.from_pretrained(folder,
    /// gguf_file=...)`. `vocab_style` maps the file's `general.architecture` to how its
    /// SentencePiece vocabulary is shaped: the model family knows
    /// (`ferrotune_models::family::gguf_vocab_style`).
    pub fn from_gguf(
        path: impl AsRef<Path>,
        vocab_style: impl Fn(&str) -> crate::GgufVocabStyle,
    ) -> Result<Self> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| DataError::io(path, e, "GGUF file"))?;
        let file_len = file
            .metadata()
            .map_err(|e| DataError::io(path, e, "GGUF file"))?
            .len();
        let mut reader = BufReader::new(file);
        let mut magic = [0u8; 4];
        let has_magic = reader.read_exact(&mut magic).is_ok() && &magic == b"GGUF";
        if !has_magic {
            return Err(DataError::gguf(
                path,
                "not a GGUF file (it does not start with the bytes \"GGUF\")",
            ));
        }
        reader
            .rewind()
            .map_err(|e| DataError::io(path, e, "GGUF file"))?;
        let content =
            candle_core::quantized::gguf_file::Content::read(&mut reader).map_err(|e| {
                let message = e.to_string();
                if message.contains("failed to fill whole buffer") {
                    DataError::gguf(
                        path,
                        "truncated: the file ends inside its header or metadata",
                    )
                } else {
                    DataError::gguf(path, message)
                }
            })?;
        // A file cut short after its metadata still parses; its tensors would not fit.
        for (name, info) in &content.tensor_infos {
            let dtype = info.ggml_dtype;
            let bytes =
                (info.shape.elem_count() / dtype.block_size()) as u64 * dtype.type_size() as u64;
            let end = content
                .tensor_data_offset
                .saturating_add(info.offset)
                .saturating_add(bytes);
            if end > file_len {
                return Err(DataError::gguf(
                    path,
                    format!("truncated: tensor {name} ends at byte {end} but the file has {file_len} bytes"),
                ));
            }
        }
        Self::from_gguf_metadata(&content.metadata, path, vocab_style)
    }

    /// [`Tokenizer::from_gguf`] for metadata already read (with
    /// `candle_core::quantized::gguf_file::Content::read`); `path` names the file in errors.
    pub fn from_gguf_metadata(
        metadata: &std::collections::HashMap<String, candle_core::quantized::gguf_file::Value>,
        path: impl AsRef<Path>,
        vocab_style: impl Fn(&str) -> crate::GgufVocabStyle,
    ) -> Result<Self> {
        let path = path.as_ref();
        let built = gguf::build(metadata, path, vocab_style)?;
        let mut inner = built.tokenizer;
        let named = [
            "bos_token",
            "eos_token",
            "unk_token",
            "pad_token",
            "mask_token",
        ];
        let named = named
            .iter()
            .filter_map(|name| built.special_tokens.get(*name).map(String::as_str));
        gguf::add_missing_special_tokens(&mut inner, named)
            .map_err(|e| DataError::gguf(path, e))?;
        let flags = (built.add_bos_token.is_some() || built.add_eos_token.is_some()).then(|| {
            (
                built.add_bos_token.unwrap_or(false),
                built.add_eos_token.unwrap_or(false),
            )
        });
        let mut tokenizer = Self::assemble(
            inner,
            built.special_tokens,
            Vec::new(),
            built.chat_template,
            flags,
            path,
        )?;
        tokenizer.origin = path.to_path_buf();
        tokenizer.template_origin = (tokenizer.chat_template.is_some())
            .then(|| format!("tokenizer.chat_template in {}", path.display()));
        tokenizer.template_locations = GGUF_TEMPLATE_LOCATIONS;
        Ok(tokenizer)
    }

    /// The parts every loader shares: the BOS/EOS post-processor (when `flags` says to rebuild it),
    /// the ids of the special tokens, no truncation or padding.
    fn assemble(
        mut inner: tokenizers::Tokenizer,
        special_tokens: BTreeMap<String, String>,
        extra_special_tokens: Vec<String>,
        chat_template: Option<String>,
        flags: Option<(bool, bool)>,
        path: &Path,
    ) -> Result<Self> {
        let id_of = |inner: &tokenizers::Tokenizer, name: &str| {
            special_tokens
                .get(name)
                .and_then(|token| inner.token_to_id(token).map(|id| (token.as_str(), id)))
        };
        let (mut add_bos_token, mut add_eos_token) = (false, false);
        if let Some((add_bos, add_eos)) = flags {
            let bos = id_of(&inner, "bos_token").filter(|_| add_bos);
            let eos = id_of(&inner, "eos_token").filter(|_| add_eos);
            let processor = backend::bos_eos_post_processor(bos, eos)
                .map_err(|e| DataError::invalid(path, e))?;
            inner.with_post_processor(Some(processor));
            (add_bos_token, add_eos_token) = (bos.is_some(), eos.is_some());
        }
        inner
            .with_truncation(None)
            .map_err(|e| DataError::invalid(path, e.to_string()))?;
        inner.with_padding(None);
        let bos_id = id_of(&inner, "bos_token").map(|(_, id)| id);
        let eos_ids = id_of(&inner, "eos_token")
            .map(|(_, id)| id)
            .into_iter()
            .collect();
        let pad_id = id_of(&inner, "pad_token").map(|(_, id)| id);
        let unk_id = id_of(&inner, "unk_token").map(|(_, id)| id);
        let vocab_size = inner.get_vocab_size(true);
        Ok(Self {
            inner,
            chat_template,
            template_origin: None,
            tool_template: None,
            special_tokens,
            extra_special_tokens,
            bos_id,
            eos_ids,
            pad_id,
            unk_id,
            add_bos_token,
            add_eos_token,
            clean_up_tokenization_spaces: false,
            vocab_size,
            origin: path.to_path_buf(),
            template_locations: DIR_TEMPLATE_LOCATIONS,
            written_pre_tokenizer: None,
            model_vocab: None,
            max_token_bytes: std::sync::OnceLock::new(),
        })
    }

    /// Token ids of `text`. With `add_special_tokens` the post-processor adds what the tokenizer
    /// adds around a sequence (e.g. BOS). Special tokens written in the text are always matched.
    /// Once fed to a model ([`Tokenizer::feed_model`]), an id past its vocabulary is an error.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(DataError::encode)?;
        let ids = encoding.get_ids();
        if let Some(rows) = self.model_vocab {
            if let Some(&id) = ids.iter().find(|&&id| id as usize >= rows) {
                let token = self.inner.id_to_token(id).unwrap_or_default();
                return Err(DataError::invalid(
                    &self.origin,
                    format!(
                        "token {token:?} (id {id}) is past the model's vocabulary (vocab_size \
                         {rows}): the tokenizer has {} tokens, more than the model embeds \
                         (added tokens the model was not resized for?)",
                        self.vocab_size
                    ),
                ));
            }
        }
        Ok(ids.to_vec())
    }

    /// Says which model the token ids are for: one whose embedding has `vocab_size` rows. From
    /// then on [`Tokenizer::encode`] refuses an id past them (a tokenizer with added tokens the
    /// model was not resized for), and pre-tokenized datasets read for it are checked against
    /// it ([`Tokenizer::model_vocab`]).
    pub fn feed_model(&mut self, vocab_size: usize) {
        self.model_vocab = Some(vocab_size);
    }

    /// The model vocabulary set by [`Tokenizer::feed_model`], if any.
    pub fn model_vocab(&self) -> Option<usize> {
        self.model_vocab
    }

    /// The text of `ids`; with `skip_special_tokens`, special tokens are left out. Ids outside the
    /// vocabulary are skipped.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        let text = self
            .inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| DataError::Decode {
                message: e.to_string(),
            })?;
        // transformers applies `clean_up_tokenization_spaces` to WordPiece/Unigram/WordLevel only.
        if self.clean_up_tokenization_spaces
            && !matches!(self.inner.get_model(), ModelWrapper::BPE(_))
        {
            return Ok(clean_up_tokenization(&text));
        }
        Ok(text)
    }

    /// The token string of `id` (as the vocabulary spells it, e.g. `Ġthe` or `▁the`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token string (as the vocabulary spells it).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The number of tokens, added tokens included (transformers' `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Renders `messages` with the chat template, as transformers' `apply_chat_template(messages,
    /// add_generation_prompt=..., tokenize=False)`. Fails if the tokenizer has no chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.compiled_chat_template()?
            .ok_or_else(|| DataError::NoChatTemplate {
                origin: self.origin.clone(),
                looked_in: self.template_locations,
            })?
            .render(messages, add_generation_prompt, &self.special_tokens)
    }

    /// [`Tokenizer::apply_chat_template`] with `tools` (their JSON schemas), as transformers'
    /// `apply_chat_template(messages, tools=tools, ...)`: rendered with the template named
    /// `tool_use` when the tokenizer has one and `tools` is given, else with its chat template.
    pub fn apply_chat_template_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&minijinja::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.compiled_chat_template_for(tools.is_some())?
            .ok_or_else(|| DataError::NoChatTemplate {
                origin: self.origin.clone(),
                looked_in: self.template_locations,
            })?
            .render_with_tools(messages, tools, add_generation_prompt, &self.special_tokens)
    }

    /// The template transformers renders with (`get_chat_template(tools=...)`): the one named
    /// `tool_use` when there are tools and the tokenizer has it, else the chat template.
    pub fn compiled_chat_template_for(&self, with_tools: bool) -> Result<Option<ChatTemplate>> {
        match &self.tool_template {
            Some((source, origin)) if with_tools => {
                ChatTemplate::from_origin(source, origin.clone()).map(Some)
            }
            _ => self.compiled_chat_template(),
        }
    }

    /// The chat template compiled, knowing where it was read from (which its errors name);
    /// `None` if the tokenizer has none.
    pub fn compiled_chat_template(&self) -> Result<Option<ChatTemplate>> {
        let Some(source) = self.chat_template.as_deref() else {
            return Ok(None);
        };
        match &self.template_origin {
            Some(origin) => ChatTemplate::from_origin(source, origin.clone()).map(Some),
            None => ChatTemplate::new(source).map(Some),
        }
    }

    /// Token ids of the rendered chat, encoded without adding special tokens (the template writes
    /// them), as transformers' `apply_chat_template(..., tokenize=True)`.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let text = self.apply_chat_template(messages, add_generation_prompt)?;
        self.encode(&text, false)
    }

    /// The chat template, if the tokenizer has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Replaces (or removes) the chat template.
    pub fn set_chat_template(&mut self, template: Option<String>) {
        self.chat_template = template;
        self.template_origin = None;
        self.tool_template = None;
    }

    /// The named special tokens (`bos_token`, `eos_token`, `unk_token`, `pad_token`, ..., and
    /// model-specific ones such as `image_token`): the variables a chat template sees.
    pub fn special_tokens(&self) -> &BTreeMap<String, String> {
        &self.special_tokens
    }

    /// One named special token, e.g. `special_token("bos_token")`.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens.get(name).map(String::as_str)
    }

    /// The BOS token string.
    pub fn bos_token(&self) -> Option<&str> {
        self.special_token("bos_token")
    }

    /// The EOS token string (the tokenizer's own; [`Tokenizer::eos_ids`] may hold more ids).
    pub fn eos_token(&self) -> Option<&str> {
        self.special_token("eos_token")
    }

    /// The unknown token string.
    pub fn unk_token(&self) -> Option<&str> {
        self.special_token("unk_token")
    }

    /// The padding token string.
    pub fn pad_token(&self) -> Option<&str> {
        self.special_token("pad_token")
    }

    /// Unnamed extra special tokens (`extra_special_tokens` / `additional_special_tokens` lists).
    pub fn extra_special_tokens(&self) -> &[String] {
        &self.extra_special_tokens
    }

    /// The BOS id: the BOS token's, else `bos_token_id` of generation_config.json / config.json.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos_id
    }

    /// Ids that end a generation: the EOS token's first, then those of generation_config.json and
    /// config.json (`eos_token_id`, an int or a list) in that order, without repeats.
    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    /// The padding id: the PAD token's, else `pad_token_id` of generation_config.json / config.json.
    pub fn pad_id(&self) -> Option<u32> {
        self.pad_id
    }

    /// The unknown token's id.
    pub fn unk_id(&self) -> Option<u32> {
        self.unk_id
    }

    /// Whether `encode(text, true)` puts the BOS token first (when the post-processor was built
    /// from `add_bos_token`; a `tokenizer.json` post-processor kept as it is reports `false`).
    pub fn add_bos_token(&self) -> bool {
        self.add_bos_token
    }

    /// Whether `encode(text, true)` puts the EOS token last (see [`Tokenizer::add_bos_token`]).
    pub fn add_eos_token(&self) -> bool {
        self.add_eos_token
    }

    /// The folder or GGUF file this tokenizer was loaded from.
    pub fn origin(&self) -> &Path {
        &self.origin
    }

    /// The pre-tokenizer of the folder's `tokenizer.json` as written, when the tokenizer class
    /// replaced it with its own (`None`: the pipeline's is the file's).
    pub(crate) fn written_pre_tokenizer(&self) -> Option<&Json> {
        self.written_pre_tokenizer.as_ref()
    }

    /// The underlying `tokenizers` pipeline.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// transformers' `clean_up_tokenization`.
fn clean_up_tokenization(text: &str) -> String {
    text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
}

/// Python truthiness of a JSON value.
fn truthy(value: &Json) -> bool {
    match value {
        Json::Null => false,
        Json::Bool(b) => *b,
        Json::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Json::String(s) => !s.is_empty(),
        Json::Array(a) => !a.is_empty(),
        Json::Object(o) => !o.is_empty(),
    }
}

/// Token ids from an `eos_token_id`-style value: an int or a list of ints.
fn ids_of(value: &Json) -> Vec<u32> {
    match value {
        Json::Number(n) => n
            .as_u64()
            .and_then(|v| u32::try_from(v).ok())
            .into_iter()
            .collect(),
        Json::Array(items) => items.iter().flat_map(ids_of).collect(),
        _ => Vec::new(),
    }
}

/// The named special tokens (class defaults, then the config) and the extra special tokens, as
/// `PreTrainedTokenizerBase.__init__` sorts them.
fn special_tokens_of(
    config: &Map<String, Json>,
    shape: &Shape,
) -> (Vec<(String, TokenSpec)>, Vec<TokenSpec>) {
    let mut named: Vec<(String, TokenSpec)> = shape
        .default_special_tokens()
        .iter()
        .map(|(k, t)| (k.to_string(), TokenSpec::plain(t)))
        .collect();
    let set = |named: &mut Vec<(String, TokenSpec)>, key: &str, spec: Option<TokenSpec>| {
        named.retain(|(k, _)| k != key);
        if let Some(spec) = spec {
            named.push((key.to_string(), spec));
        }
    };
    let mut extras: Vec<TokenSpec> = Vec::new();
    for key in NAMED_SPECIAL_TOKENS {
        if let Some(value) = config.get(key) {
            set(&mut named, key, TokenSpec::from_json(value, true));
        }
    }
    let extra = config
        .get("extra_special_tokens")
        .or_else(|| config.get("additional_special_tokens"));
    match extra {
        Some(Json::Object(map)) => {
            for (key, value) in map {
                if let Some(spec) = TokenSpec::from_json(value, true) {
                    set(&mut named, key, Some(spec));
                }
            }
        }
        Some(Json::Array(items)) => {
            extras.extend(items.iter().filter_map(|v| TokenSpec::from_json(v, true)))
        }
        _ => {}
    }
    for (key, value) in config {
        let model_specific = key.ends_with("_token")
            && !NAMED_SPECIAL_TOKENS.contains(&key.as_str())
            && matches!(value, Json::String(_) | Json::Object(_));
        if model_specific {
            if let Some(spec) = TokenSpec::from_json(value, true) {
                set(&mut named, key, Some(spec));
            }
        }
    }
    // transformers walks them in `SPECIAL_TOKENS_ATTRIBUTES` order, model-specific ones last.
    named.sort_by_key(|(k, _)| {
        NAMED_SPECIAL_TOKENS
            .iter()
            .position(|n| n == k)
            .unwrap_or(NAMED_SPECIAL_TOKENS.len())
    });
    (named, extras)
}

/// The chat template of a folder: `chat_template.jinja`, else `chat_template` in the config (a
/// string, or a list of `{name, template}` of which the one named `default` is used).
fn chat_template_of(
    dir: &Path,
    config: &Map<String, Json>,
    config_path: &Path,
) -> Result<Option<(String, String)>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        let origin = jinja.display().to_string();
        return read_text(&jinja, "chat template").map(|t| Some((t, origin)));
    }
    let origin = |what: &str| format!("{what} in {}", config_path.display());
    match config.get("chat_template") {
        None | Some(Json::Null) => Ok(None),
        Some(Json::String(s)) => Ok(Some((s.clone(), origin("\"chat_template\"")))),
        Some(Json::Array(items)) => {
            for item in items {
                let name = item.get("name").and_then(Json::as_str);
                let template = item.get("template").and_then(Json::as_str);
                match (name, template) {
                    (Some("default"), Some(template)) => {
                        let origin = origin("the \"default\" entry of \"chat_template\"");
                        return Ok(Some((template.to_string(), origin)));
                    }
                    (Some(_), Some(_)) => {}
                    _ => return Err(DataError::invalid(
                        config_path,
                        "\"chat_template\" list entries must be {\"name\": ..., \"template\": ...}",
                    )),
                }
            }
            Ok(None)
        }
        Some(_) => Err(DataError::invalid(
            config_path,
            "\"chat_template\" must be a string or a list of templates",
        )),
    }
}

/// The entry named `tool_use` of a config's list of named chat templates (checked, with the
/// list, by [`chat_template_of`]).
fn tool_use_template_of(
    config: &Map<String, Json>,
    config_path: &Path,
) -> Option<(String, String)> {
    let Some(Json::Array(items)) = config.get("chat_template") else {
        return None;
    };
    items.iter().find_map(|item| {
        let template = item.get("template").and_then(Json::as_str)?;
        (item.get("name").and_then(Json::as_str) == Some("tool_use")).then(|| {
            let origin = format!(
                "the \"tool_use\" entry of \"chat_template\" in {}",
                config_path.display()
            );
            (template.to_string(), origin)
        })
    })
}

fn read_text(path: &Path, what: &'static str) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| DataError::io(path, e, what))
}

/// A JSON object file; `None` if the file does not exist.
fn read_json_object(path: &Path, what: &'static str) -> Result<Option<Map<String, Json>>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = read_text(path, what)?;
    match serde_json::from_str::<Json>(&text) {
        Ok(Json::Object(map)) => Ok(Some(map)),
        // Not the tokenizer's fault: `config.json` is read here too.
        Ok(other) => Err(DataError::NotAnObject {
            path: path.to_path_buf(),
            found: match other {
                Json::Array(_) => "an array",
                Json::String(_) => "a string",
                Json::Number(_) => "a number",
                Json::Bool(_) => "a boolean",
                Json::Null => "null",
                Json::Object(_) => "an object",
            },
        }),
        Err(source) => Err(DataError::Json {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// The folder whose tokenizer files serve `path`: for a file (a `tokenizer.model`, a weights file)
/// its folder, for a folder itself — or, when that holds no `tokenizer.json` /
/// `tokenizer_config.json`, the folder above it if that does (torchtune's
/// `original/tokenizer.model`, Meta's `original/` checkpoint folder). `None` when neither does.
pub fn tokenizer_folder(path: &Path) -> Option<PathBuf> {
    let start = if path.is_file() {
        path.parent().unwrap_or(Path::new("."))
    } else {
        path
    };
    let has =
        |d: &Path| d.join("tokenizer.json").is_file() || d.join("tokenizer_config.json").is_file();
    [Some(start), start.parent()]
        .into_iter()
        .flatten()
        .find(|d| has(d))
        .map(Path::to_path_buf)
}
