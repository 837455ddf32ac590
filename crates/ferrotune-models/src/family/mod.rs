//! Model families: what is known about each architecture, one file per family, and the registry
//! that lists them.
//!
//! A family file ([`llama`], [`mistral`], [`qwen`], [`gemma`], [`phi`], [`smollm3`], [`llama4`],
//! [`olmo2`], [`deepseek`], [`gpt_oss`], [`qwen3_5`])
//! holds one [`Family`] value: the transformers `model_type`s it reads and their causal-LM
//! classes, the multimodal checkpoints it runs as their text model, the config-class defaults of
//! keys a `config.json` may leave out, its llama.cpp architectures ([`GgufArch`], read by the GGUF
//! reader and written by the GGUF writer from the same entry), torchtune's builders and weight
//! layouts for it. [`FAMILIES`] is the registry: the "unsupported model_type" error, `validate`'s
//! model-component check and `export-gguf` all read it. Adding a family is a new file here plus
//! its line in [`FAMILIES`].
//!
//! Still outside the family files (to move here): the per-family switches `ModelConfig::from_hf_json`
//! sets, the GGUF reader's per-architecture hyperparameters and the GGUF writer's per-architecture
//! checks (see docs/src/architecture.md).

pub mod deepseek;
pub mod gemma;
pub mod gguf;
pub mod gpt_oss;
pub mod llama;
pub mod llama4;
pub mod mistral;
pub mod olmo2;
pub mod phi;
pub mod qwen;
pub mod qwen3_5;
pub mod read;
pub mod smollm3;

/// What every family file imports: the registry's types, the GGUF reading's, and what a family's
/// rules read and write.
mod prelude {
    pub(super) use std::sync::OnceLock;

    pub(super) use serde_json::{Map, Value};

    pub(super) use super::gguf::{
        llama_biases, GgufMoe, GgufNames, GgufReading, GgufRopeTensors, GgufSource, GgufWindows,
        GgufWriting,
    };
    pub(super) use super::{
        AttentionLayers, Family, GgufArch, GgufVariant, GgufVocabStyle, HfConfig, HfResult,
        HfSource, LlamaLike, ModelType, Multimodal, TorchtuneLayout, WindowStyle,
    };
    pub(super) use crate::config::ModelConfig;
    pub(super) use crate::error::ModelError;
}

use serde_json::{Map, Value};

pub use crate::config::hf::WindowStyle;
use crate::config::hf::{get_bool, parse_rope, parse_sliding_windows};
use crate::config::{ModelConfig, RopeConfig};
use gguf::GgufReading;

pub use ferrotune_data::GgufVocabStyle;

/// Every family ferrotune runs, in the order messages list them.
pub static FAMILIES: &[&Family] = &[
    &llama::FAMILY,
    &mistral::FAMILY,
    &qwen::FAMILY,
    &gemma::FAMILY,
    &phi::FAMILY,
    &smollm3::FAMILY,
    &llama4::FAMILY,
    &olmo2::FAMILY,
    &deepseek::FAMILY,
    &gpt_oss::FAMILY,
    &qwen3_5::FAMILY,
];

/// One model family: everything about its architecture that is not the decoder's math.
#[derive(Debug)]
pub struct Family {
    /// The family's name, for documentation.
    pub name: &'static str,
    /// The text decoders' `model_type`s, as transformers names them.
    pub model_types: &'static [ModelType],
    /// Multimodal (or wrapper) checkpoints run as their text model.
    pub multimodal: &'static [Multimodal],
    /// Text `model_type`s of multimodal configs that run as one of [`Family::model_types`]:
    /// `(text model_type, the model_type it runs as)`.
    pub text_aliases: &'static [(&'static str, &'static str)],
    /// Defaults of transformers' config classes for keys a config may leave out, where real
    /// checkpoints rely on them; `&[]` for a `model_type` that needs none.
    pub config_defaults: fn(&str) -> &'static [(&'static str, Value)],
    /// The llama.cpp architectures the family's GGUF files use.
    pub gguf_archs: &'static [GgufArch],
    /// torchtune's model builders (`torchtune.models.<builder>.*`) whose checkpoints are this
    /// family's, with the `model_type`s each may load.
    pub torchtune_builders: &'static [(&'static str, &'static [&'static str])],
    /// How the family's `config.json` is read.
    pub hf_config: &'static dyn HfConfig,
}

/// What a family's rules read: transformers' text `model_type` (one of the family's) and the
/// config object with the family's defaults filled in.
#[derive(Debug, Clone, Copy)]
pub struct HfSource<'a> {
    /// The text `model_type`.
    pub model_type: &'a str,
    /// The config object.
    pub obj: &'a Map<String, Value>,
}

/// What a family's rules give: the value read, or what is wrong with the config.
pub type HfResult<T> = Result<T, String>;

impl Family {
    /// A family of `model_types` whose configs `hf_config` reads, with nothing else: no
    /// multimodal checkpoint, text alias, config default, GGUF architecture or torchtune builder.
    /// Family files state what they have over it.
    pub const fn new(
        name: &'static str,
        model_types: &'static [ModelType],
        hf_config: &'static dyn HfConfig,
    ) -> Self {
        Self {
            name,
            model_types,
            multimodal: &[],
            text_aliases: &[],
            config_defaults: no_defaults,
            gguf_archs: &[],
            torchtune_builders: &[],
            hf_config,
        }
    }
}

/// How a family reads transformers' `config.json` beyond what every family shares. Each method
/// reads the config as [`HfSource`] holds it; the defaults are Llama's reading.
pub trait HfConfig: Sync + std::fmt::Debug {
    /// Refuses, before anything else is read, what makes the config something ferrotune does not
    /// run. Default: a bidirectional model (an encoder).
    fn check(&self, hf: HfSource) -> HfResult<()> {
        refuse_bidirectional(hf.obj)
    }

    /// The MLP activation's name. Default: `hidden_act`, SiLU when absent.
    fn activation<'a>(&self, hf: HfSource<'a>) -> HfResult<&'a str> {
        Ok(crate::config::hf::get_str(hf.obj, "hidden_act")?.unwrap_or("silu"))
    }

    /// How the config says which layers attend in a window. Default: where `layer_types` lists
    /// them (every layer when it does not).
    fn window_style(&self) -> WindowStyle {
        WindowStyle::Listed
    }

    /// The rotary embedding of a family with one. Default: base 10000 when the config gives
    /// none.
    fn rope(&self, hf: HfSource, max_pos: usize) -> HfResult<RopeConfig> {
        parse_rope(hf.obj, max_pos, 10000.0, false)
    }

    /// The rotary embeddings and each layer's attention window. Default: one rope
    /// ([`HfConfig::rope`]) for every layer, windows as [`HfConfig::window_style`] reads them.
    fn attention(&self, hf: HfSource, layers: usize, max_pos: usize) -> HfResult<AttentionLayers> {
        let rope = self.rope(hf, max_pos)?;
        AttentionLayers::single(rope, hf.obj, layers, self.window_style())
    }

    /// Sets the family's switches on the config read so far. Default: none.
    fn configure(&self, _hf: HfSource, _config: &mut ModelConfig) -> HfResult<()> {
        Ok(())
    }
}

/// Llama's reading of a config: [`HfConfig`]'s defaults.
#[derive(Debug)]
pub struct LlamaLike;

impl HfConfig for LlamaLike {}

/// The rotary embeddings and attention windows of a config's layers.
#[derive(Debug)]
pub struct AttentionLayers {
    /// The rotary embedding (of the full-attention layers, where there are two).
    pub rope: RopeConfig,
    /// The sliding-attention layers' own rotary embedding (Gemma 3 and 4).
    pub local_rope: Option<RopeConfig>,
    /// Per layer: its sliding window, `None` for full attention.
    pub sliding_windows: Vec<Option<usize>>,
    /// Per layer: whether it takes `local_rope`.
    pub local_rope_layers: Vec<bool>,
}

impl AttentionLayers {
    /// One rope for every layer and windows read as `style` says.
    pub(crate) fn single(
        rope: RopeConfig,
        obj: &Map<String, Value>,
        layers: usize,
        style: WindowStyle,
    ) -> Result<Self, String> {
        Ok(Self {
            rope,
            local_rope: None,
            sliding_windows: parse_sliding_windows(obj, layers, style)?,
            local_rope_layers: vec![false; layers],
        })
    }
}

/// A config whose `use_bidirectional_attention` is true is an encoder (EmbeddingGemma).
pub(crate) fn refuse_bidirectional(obj: &Map<String, Value>) -> Result<(), String> {
    if get_bool(obj, "use_bidirectional_attention")?.unwrap_or(false) {
        return Err(
            "'use_bidirectional_attention' is true: that is an encoder (EmbeddingGemma), not a causal language model"
                .into(),
        );
    }
    Ok(())
}

/// One `model_type` of a family.
#[derive(Debug)]
pub struct ModelType {
    /// transformers' `model_type`.
    pub name: &'static str,
    /// transformers' causal-LM class, for saved configs.
    pub causal_lm: &'static str,
    /// The llama.cpp architecture the GGUF writer stores it as (one of some family's
    /// [`Family::gguf_archs`]); `None` where llama.cpp has none that computes the same.
    pub gguf_arch: Option<&'static str>,
    /// How torchtune 0.6.1's `FullModelHFCheckpointer` converts its weights; `None` where it
    /// converts none.
    pub torchtune_weights: Option<TorchtuneLayout>,
    /// How torchtune lays out its LoRA adapters (`adapter_model.pt`); `None` where it has none.
    pub torchtune_adapters: Option<TorchtuneLayout>,
    /// How the GGUF reader reads its files (where some llama.cpp architecture reads as it).
    pub gguf_reading: GgufReading,
}

impl ModelType {
    /// A `model_type` with no GGUF architecture and no torchtune conversion.
    pub const fn new(name: &'static str, causal_lm: &'static str) -> Self {
        Self {
            name,
            causal_lm,
            gguf_arch: None,
            torchtune_weights: None,
            torchtune_adapters: None,
            gguf_reading: GgufReading::LLAMA,
        }
    }

    /// Stored as llama.cpp's architecture `arch`, its GGUF files read as `reading` says.
    pub const fn gguf(mut self, arch: &'static str, reading: GgufReading) -> Self {
        self.gguf_arch = Some(arch);
        self.gguf_reading = reading;
        self
    }

    /// torchtune converts its weights and adapters with `layout`.
    pub const fn torchtune(mut self, layout: TorchtuneLayout) -> Self {
        self.torchtune_weights = Some(layout);
        self.torchtune_adapters = Some(layout);
        self
    }

    /// torchtune converts its adapters (not its weights) with `layout`.
    pub const fn torchtune_adapters(mut self, layout: TorchtuneLayout) -> Self {
        self.torchtune_adapters = Some(layout);
        self
    }
}

/// A multimodal checkpoint's `model_type` that runs as its text model.
#[derive(Debug)]
pub struct Multimodal {
    /// The checkpoint's top-level `model_type`.
    pub model_type: &'static str,
    /// The `model_type`s its `text_config` may hold; the first is the default when it names none.
    pub text_types: &'static [&'static str],
    /// Without a `text_config`, the text model's keys are the top level's (the Hub's Qwen2-VL /
    /// Qwen2.5-VL configs).
    pub text_keys_at_top: bool,
}

impl Multimodal {
    /// A checkpoint whose text model's keys are under its `text_config`.
    pub const fn new(model_type: &'static str, text_types: &'static [&'static str]) -> Self {
        Self {
            model_type,
            text_types,
            text_keys_at_top: false,
        }
    }

    /// Without a `text_config`, its text model's keys are the top level's.
    pub const fn keys_at_top(mut self) -> Self {
        self.text_keys_at_top = true;
        self
    }
}

/// How torchtune's checkpointer converts HF tensors (and LoRA adapters) of a model type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TorchtuneLayout {
    /// `convert_weights.hf_to_tune`: q/k rows permuted to interleaved rotary pairs.
    Permuted,
    /// `qwen2_hf_to_tune`: HF's rows, names only, biases kept.
    Plain,
    /// `phi3_hf_to_tune`: HF's rows, fused `qkv_proj` / `gate_up_proj` split.
    SplitFused,
}

/// One llama.cpp architecture (`general.architecture`).
#[derive(Debug)]
pub struct GgufArch {
    /// `general.architecture`, the prefix of its metadata keys.
    pub name: &'static str,
    /// The `model_type` a file of this architecture reads as.
    pub model_type: &'static str,
    /// Files of this architecture that read as another `model_type`, first match wins.
    pub variants: &'static [(GgufVariant, &'static str)],
    /// llama.cpp's converter permuted q/k rows for its RoPE layout.
    pub permuted_qk: bool,
    /// llama.cpp's converter stored norm weights as `1 + w`.
    pub norm_plus_one: bool,
    /// How transformers shapes a SentencePiece vocabulary stored in a file of this architecture.
    pub vocab: GgufVocabStyle,
    /// What llama.cpp fixes for it, for the GGUF writer.
    pub writing: gguf::GgufWriting,
}

/// What tells a GGUF variant apart from its architecture's main `model_type`.
#[derive(Debug)]
pub enum GgufVariant {
    /// The file has experts (`{arch}.expert_count` > 0).
    Experts,
    /// `general.name`, lowercased, contains this.
    NameContains(&'static str),
}

impl GgufArch {
    /// An architecture stored as transformers holds it (no variants, no permutation, no norm
    /// offset, Llama's vocabulary style): what the others are written relative to.
    pub const fn plain(
        name: &'static str,
        model_type: &'static str,
        writing: gguf::GgufWriting,
    ) -> Self {
        Self {
            name,
            model_type,
            variants: &[],
            permuted_qk: false,
            norm_plus_one: false,
            vocab: GgufVocabStyle::Llama,
            writing,
        }
    }

    /// The `model_type` of a file of this architecture with `general.name` `name` (lowercased)
    /// and `experts` experts.
    pub fn model_type_of(&self, name: &str, experts: u64) -> &'static str {
        self.variants
            .iter()
            .find(|(v, _)| match v {
                GgufVariant::Experts => experts > 0,
                GgufVariant::NameContains(s) => name.contains(s),
            })
            .map_or(self.model_type, |(_, t)| t)
    }
}

/// A plain family's `config_defaults`: none.
pub fn no_defaults(_: &str) -> &'static [(&'static str, Value)] {
    &[]
}

/// The family and entry of a text decoder's `model_type`.
pub fn model_type(name: &str) -> Option<(&'static Family, &'static ModelType)> {
    FAMILIES.iter().find_map(|f| {
        f.model_types
            .iter()
            .find(|t| t.name == name)
            .map(|t| (*f, t))
    })
}

/// Every `model_type` ferrotune reads: the text decoders', then the multimodal checkpoints'.
pub fn supported_model_types() -> Vec<&'static str> {
    let text = FAMILIES
        .iter()
        .flat_map(|f| f.model_types.iter().map(|t| t.name));
    let multimodal = FAMILIES
        .iter()
        .flat_map(|f| f.multimodal.iter().map(|m| m.model_type));
    text.chain(multimodal).collect()
}

/// The multimodal checkpoint of `model_type`, if it is one.
pub fn multimodal(model_type: &str) -> Option<&'static Multimodal> {
    FAMILIES
        .iter()
        .flat_map(|f| f.multimodal.iter())
        .find(|m| m.model_type == model_type)
}

/// The `model_type` a multimodal checkpoint's text model runs as.
pub fn text_model_type(text_type: &str) -> &str {
    FAMILIES
        .iter()
        .flat_map(|f| f.text_aliases.iter())
        .find(|(alias, _)| *alias == text_type)
        .map_or(text_type, |(_, t)| t)
}

/// transformers' causal-LM class of a text `model_type`.
pub fn causal_lm_class(model_type: &str) -> Option<&'static str> {
    self::model_type(model_type).map(|(_, t)| t.causal_lm)
}

/// The config-class defaults for `model_type` (a text `model_type`, or a multimodal text model's).
pub fn config_defaults(model_type: &str) -> &'static [(&'static str, Value)] {
    FAMILIES
        .iter()
        .map(|f| (f.config_defaults)(model_type))
        .find(|d| !d.is_empty())
        .unwrap_or(&[])
}

/// The llama.cpp architecture named `name`.
pub fn gguf_arch(name: &str) -> Option<&'static GgufArch> {
    FAMILIES
        .iter()
        .flat_map(|f| f.gguf_archs.iter())
        .find(|a| a.name == name)
}

/// How a SentencePiece vocabulary in a GGUF file of architecture `arch` is shaped (the argument
/// [`ferrotune_data::Tokenizer::from_gguf`] takes): the architecture's, or `LlamaTokenizer`'s for
/// one no family reads.
pub fn gguf_vocab_style(arch: &str) -> GgufVocabStyle {
    gguf_arch(arch).map(|a| a.vocab).unwrap_or_default()
}

/// The llama.cpp architecture the GGUF writer stores `model_type` as.
pub fn gguf_arch_for(model_type: &str) -> Option<&'static GgufArch> {
    self::model_type(model_type)
        .and_then(|(_, t)| t.gguf_arch)
        .and_then(gguf_arch)
}

/// The families whose GGUF files have a layout of their own, with llama.cpp's architecture for
/// them and the one `model_type` it is (`None`: every model type of the family): read by the
/// models crate's `gguf/deepseek2.rs`, `gguf/gpt_oss.rs` and `gguf/qwen35.rs` and written by
/// ferrotune-export's writers of the same names, not through [`Family::gguf_archs`].
pub static OWN_LAYOUT_GGUF: &[(&str, &Family, Option<&str>)] = &[
    (deepseek::GGUF_ARCH, &deepseek::FAMILY, None),
    (gpt_oss::GGUF_ARCH, &gpt_oss::FAMILY, None),
    // Qwen3.5's three, each with its model type ([`qwen3_5::GGUF_ARCHS`]).
    (
        qwen3_5::GGUF_ARCHS[0].0,
        &qwen3_5::FAMILY,
        Some(qwen3_5::GGUF_ARCHS[0].1),
    ),
    (
        qwen3_5::GGUF_ARCHS[1].0,
        &qwen3_5::FAMILY,
        Some(qwen3_5::GGUF_ARCHS[1].1),
    ),
    (
        qwen3_5::GGUF_ARCHS[2].0,
        &qwen3_5::FAMILY,
        Some(qwen3_5::GGUF_ARCHS[2].1),
    ),
];

/// Every llama.cpp architecture the GGUF reader loads, for messages: each with the other
/// `model_type`s it reads as in parentheses.
pub fn gguf_arch_names() -> String {
    let names: Vec<String> = FAMILIES
        .iter()
        .flat_map(|f| f.gguf_archs.iter())
        .map(|a| {
            if a.variants.is_empty() {
                a.name.to_string()
            } else {
                let others: Vec<&str> = a.variants.iter().map(|(_, t)| *t).collect();
                format!("{} (and {})", a.name, others.join(", "))
            }
        })
        .chain(OWN_LAYOUT_GGUF.iter().map(|(arch, _, _)| arch.to_string()))
        .collect();
    names.join(", ")
}

/// Every `model_type` `export-gguf` writes, for messages: those of [`gguf_writable_model_types`]
/// and those of the families with a layout of their own ([`OWN_LAYOUT_GGUF`]).
pub fn gguf_exportable_model_types() -> Vec<&'static str> {
    let own = OWN_LAYOUT_GGUF.iter().flat_map(|(_, f, only)| {
        f.model_types
            .iter()
            .map(|t| t.name)
            .filter(move |t| only.is_none_or(|o| o == *t))
    });
    gguf_writable_model_types().into_iter().chain(own).collect()
}

/// The `model_type`s the GGUF writer can store, for messages.
pub fn gguf_writable_model_types() -> Vec<&'static str> {
    FAMILIES
        .iter()
        .flat_map(|f| f.model_types.iter())
        .filter(|t| t.gguf_arch.is_some())
        .map(|t| t.name)
        .collect()
}

/// The `model_type`s torchtune's builder family `builder` (`torchtune.models.<builder>`) loads.
pub fn torchtune_builder(builder: &str) -> Option<&'static [&'static str]> {
    FAMILIES
        .iter()
        .flat_map(|f| f.torchtune_builders.iter())
        .find(|(b, _)| *b == builder)
        .map(|(_, types)| *types)
}

/// Every torchtune builder family, for messages.
pub fn torchtune_builder_names() -> Vec<&'static str> {
    FAMILIES
        .iter()
        .flat_map(|f| f.torchtune_builders.iter().map(|(b, _)| *b))
        .collect()
}

/// The `model_type`s whose weights (`adapters` false) or LoRA adapters (true) torchtune
/// converts, for messages.
pub fn torchtune_model_types(adapters: bool) -> Vec<&'static str> {
    FAMILIES
        .iter()
        .flat_map(|f| f.model_types.iter())
        .filter(|t| {
            if adapters {
                t.torchtune_adapters.is_some()
            } else {
                t.torchtune_weights.is_some()
            }
        })
        .map(|t| t.name)
        .collect()
}

/// `a, b and c`.
pub fn and_list(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => one.to_string(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_is_registered_once() {
        let mut types = supported_model_types();
        let n = types.len();
        types.sort_unstable();
        types.dedup();
        assert_eq!(types.len(), n, "a model_type is listed twice");
        let mut builders = torchtune_builder_names();
        let n = builders.len();
        builders.sort_unstable();
        builders.dedup();
        assert_eq!(builders.len(), n, "a torchtune builder is listed twice");
    }

    /// Every `model_type` of `types` is a registered text decoder's; `what` names each one's
    /// origin in a failure.
    fn assert_registered<'a>(types: impl Iterator<Item = (&'a str, String)>) {
        for (t, what) in types {
            assert!(causal_lm_class(t).is_some(), "{what}");
        }
    }

    #[test]
    fn every_multimodal_text_model_runs_as_a_registered_model_type() {
        assert_registered(
            FAMILIES
                .iter()
                .flat_map(|f| f.multimodal.iter())
                .flat_map(|m| {
                    m.text_types.iter().map(move |t| {
                        let runs_as = text_model_type(t);
                        let what = format!(
                            "{}: text model {t} runs as unregistered {runs_as}",
                            m.model_type
                        );
                        (runs_as, what)
                    })
                }),
        );
    }

    /// The messages naming what GGUF reads and writes name the families with a layout of their
    /// own too (DeepSeek's `deepseek2`, `gpt-oss`).
    #[test]
    fn gguf_messages_name_the_own_layout_families() {
        let read = gguf_arch_names();
        for arch in ["llama", "qwen3moe", "deepseek2", "gpt-oss"] {
            assert!(
                read.split(", ").any(|a| a.starts_with(arch)),
                "{arch}: {read}"
            );
        }
        let written = gguf_exportable_model_types();
        for t in [
            "llama",
            "qwen3_moe",
            "deepseek_v3",
            "deepseek_v2",
            "gpt_oss",
        ] {
            assert!(written.contains(&t), "{t}: {written:?}");
        }
    }

    /// Qwen3.5's three llama.cpp architectures are named where GGUF reading and writing are,
    /// each with its one model type, and the family's table names each for one model type.
    #[test]
    fn gguf_messages_name_qwen35s_architectures() {
        let read = gguf_arch_names();
        let written = gguf_exportable_model_types();
        for (arch, t, _) in qwen3_5::GGUF_ARCHS {
            assert!(read.split(", ").any(|a| a == *arch), "{arch}: {read}");
            assert_eq!(
                written.iter().filter(|w| *w == t).count(),
                1,
                "{t}: {written:?}"
            );
            assert_eq!(qwen3_5::gguf_arch_of(t), Some(*arch));
        }
    }

    #[test]
    fn gguf_archs_written_are_registered_and_read_back_as_written() {
        for t in gguf_writable_model_types() {
            let arch = gguf_arch_for(t).unwrap_or_else(|| panic!("{t}: its arch is not listed"));
            let read = arch.model_type_of(if t == "mistral" { "mistral" } else { "" }, 0);
            // Mixtral reads back through the experts it has, Mistral through its name.
            if t != "mixtral" {
                assert_eq!(read, t, "{t} is written as '{}'", arch.name);
            }
        }
        assert_eq!(gguf_arch("llama").unwrap().model_type_of("x", 8), "mixtral");
        // The GGUF reader names each file's causal-LM class from the registry.
        assert_registered(
            FAMILIES
                .iter()
                .flat_map(|f| f.gguf_archs.iter())
                .flat_map(|arch| {
                    let types = arch.variants.iter().map(|(_, t)| *t);
                    std::iter::once(arch.model_type)
                        .chain(types)
                        .map(move |t| (t, format!("{}: {t} is not registered", arch.name)))
                }),
        );
    }
    /// The SentencePiece shapes transformers' GGUF converter picks by architecture: Gemma's for
    /// Gemma 1–3 (`GemmaTokenizer`), Phi-3's settings for `phi3`, `LlamaTokenizer` otherwise,
    /// unknown architectures included.
    #[test]
    fn gguf_vocab_styles_follow_transformers_tokenizer_classes() {
        for (arch, want) in [
            ("gemma", GgufVocabStyle::Gemma),
            ("gemma2", GgufVocabStyle::Gemma),
            ("gemma3", GgufVocabStyle::Gemma),
            ("phi3", GgufVocabStyle::Phi3),
            ("phi2", GgufVocabStyle::Llama),
            ("llama", GgufVocabStyle::Llama),
            ("qwen2", GgufVocabStyle::Llama),
            ("not-an-arch", GgufVocabStyle::Llama),
        ] {
            assert_eq!(gguf_vocab_style(arch), want, "{arch}");
        }
    }
}
