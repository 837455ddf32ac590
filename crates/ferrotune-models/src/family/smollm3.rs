//! SmolLM3: Llama's layout with every fourth layer without RoPE (`no_rope_layers`).

use super::prelude::*;
use crate::config::hf::parse_rope_layers;

/// The SmolLM3 family.
pub static FAMILY: Family = Family {
    // llama.cpp runs SmolLM3 as llama with every fourth layer without RoPE (fixed there, and
    // SmolLM3Config's default); convert_hf_to_gguf.py's SmolLM3 is its llama converter, so the
    // q/k rows are permuted as Llama's.
    gguf_archs: &[GgufArch {
        permuted_qk: true,
        // llama.cpp's SmolLM3 leaves RoPE out of every fourth layer, whatever the config lists.
        ..GgufArch::plain(
            "smollm3",
            "smollm3",
            GgufWriting {
                nope_every_fourth: true,
                ..GgufWriting::PLAIN
            },
        )
    }],
    torchtune_builders: &[("smollm3", &["smollm3"])],
    ..Family::new(
        "SmolLM3",
        &[ModelType::new("smollm3", "SmolLM3ForCausalLM").gguf(
            "smollm3",
            GgufReading {
                head_dim_from_rope: true,
                ..GgufReading::LLAMA
            },
        )],
        &SmolLm3Rules,
    )
};

/// SmolLM3's reading of its config.
#[derive(Debug)]
struct SmolLm3Rules;

impl HfConfig for SmolLm3Rules {
    fn configure(&self, hf: HfSource, c: &mut ModelConfig) -> HfResult<()> {
        c.rope_layers = parse_rope_layers(hf.obj, c.num_hidden_layers, false)?;
        Ok(())
    }

    /// Like Qwen's: windows only with `use_sliding_window`.
    fn window_style(&self) -> WindowStyle {
        WindowStyle::Gated
    }
}
