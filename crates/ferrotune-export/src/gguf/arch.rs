//! llama.cpp's side of a checkpoint: its architecture (what llama.cpp fixes, checked against
//! the config), its tensors' names, and the q/k row order and rope factors it expects.

use anyhow::{bail, Result};
use ferrotune_models::family::gguf::{GgufNaming, GgufReading, GgufWindows};
use ferrotune_models::family::{self, GgufArch};
use ferrotune_models::ModelConfig;

/// The llama.cpp architecture of a config (its entry in the families' registry); an error for
/// what the architecture cannot express (llama.cpp fixes some settings per architecture).
pub(super) fn architecture(config: &ModelConfig) -> Result<&'static GgufArch> {
    if config.score_labels.is_some() {
        bail!(
            "the checkpoint is a sequence classifier (a reward or value model, `score` head): \
             GGUF export writes causal language models"
        );
    }
    let Some(entry) = family::gguf_arch_for(&config.model_type) else {
        bail!(
            "GGUF export supports {} checkpoints, not '{}'",
            family::and_list(&family::gguf_exportable_model_types()),
            config.model_type
        );
    };
    let arch = entry.name;
    let w = &entry.writing;
    // llama.cpp's Gemma and Gemma 2 always use the embeddings as the output head (an
    // `output.weight` in the file would make it refuse the file).
    if w.tied_head_only && !config.tie_word_embeddings {
        bail!(
            "llama.cpp's '{}' ties the output head to the embeddings; this checkpoint has its own \
             lm_head (tie_word_embeddings false)",
            arch
        );
    }
    // Which layers attend in a window is fixed by llama.cpp per architecture: none, every other
    // layer from the first (Gemma 2), or for Phi-3 all of them when it has a window.
    let any_window = config.layer_sliding_windows.iter().any(Option::is_some);
    let windowed = |i: usize| match w.windows {
        GgufWindows::None => false,
        GgufWindows::EveryOther => i.is_multiple_of(2),
        // Gemma 3: five sliding layers, then a full one (llama.cpp's fixed pattern of 6).
        GgufWindows::FiveOfSix => i % 6 != 5,
        GgufWindows::AllOrNone => any_window,
    };
    let window = config
        .layer_sliding_windows
        .iter()
        .flatten()
        .next()
        .copied();
    let pattern_ok = config
        .layer_sliding_windows
        .iter()
        .enumerate()
        .all(|(i, w)| w.is_some() == windowed(i) && (w.is_none() || *w == window));
    if !pattern_ok {
        bail!(
            "the checkpoint's sliding-window layers are not the ones llama.cpp's '{}' \
             architecture uses (none, every other layer for Gemma 2, five of every six for Gemma 3, \
             all for Phi-3): the GGUF \
             would compute something else",
            arch
        );
    }
    // The architecture's own refusals (Gemma 3's fixed local rope, ...).
    (w.check)(config).map_err(anyhow::Error::msg)?;
    // llama.cpp's SmolLM3 leaves RoPE out of every fourth layer, whatever the config lists.
    let rope_ok = config
        .rope_layers
        .iter()
        .enumerate()
        .all(|(i, &rope)| rope == (!w.nope_every_fourth || (i + 1) % 4 != 0));
    if !rope_ok {
        bail!(
            "the checkpoint's layers without RoPE (no_rope_layers) are not llama.cpp's '{}' \
             (every fourth layer for smollm3, none elsewhere)",
            arch
        );
    }
    if let Some(moe) = &config.moe {
        // llama.cpp's graphs fix what transformers' configs choose: every layer sparse, and
        // renormalized top-k weights for Mixtral and Qwen3-MoE but not for Qwen2-MoE.
        if moe.sparse_layers.iter().any(|&s| !s) {
            bail!(
                "the checkpoint has dense layers among its mixture-of-experts layers \
                 (decoder_sparse_step / mlp_only_layers): llama.cpp's '{}' makes every layer sparse",
                arch
            );
        }
        let llama_cpp_norm = w.moe_norm_topk;
        if moe.norm_topk_prob != llama_cpp_norm {
            bail!(
                "norm_topk_prob {} is not what llama.cpp's '{}' computes ({llama_cpp_norm})",
                moe.norm_topk_prob,
                arch
            );
        }
    }
    if config.rope.partial_rotary_factor != 1.0 && !w.partial_rotary {
        bail!("GGUF export needs RoPE over whole heads (partial_rotary_factor 1)");
    }
    if let Some(big) = w.score_scale_27b_layers {
        // llama.cpp scales scores by the head size (hidden / heads for the 27B models).
        let scalar = config
            .query_pre_attn_scalar
            .unwrap_or(config.head_dim as f64);
        let llama_cpp = if config.num_hidden_layers == big {
            (config.hidden_size / config.num_attention_heads) as f64
        } else {
            config.head_dim as f64
        };
        if scalar != llama_cpp {
            bail!(
                "query_pre_attn_scalar {scalar} is not what llama.cpp's '{}' uses ({llama_cpp})",
                arch
            );
        }
    }
    Ok(entry)
}

/// llama.cpp's name of an HF tensor, from the names table GGUF's reader and writer share
/// ([`family::gguf::TENSOR_NAMES`]); `None` for what llama.cpp has no place for.
pub(super) fn gguf_name(hf: &str, naming: &GgufNaming) -> Option<String> {
    let (stem, kind) = hf.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    if let Some(top) = naming.gguf_part(stem, false) {
        return Some(format!("{top}.{kind}"));
    }
    let rest = stem.strip_prefix("model.layers.")?;
    let (layer, module) = rest.split_once('.')?;
    layer.parse::<usize>().ok()?;
    let part = naming.gguf_part(module, true)?;
    Some(format!("blk.{layer}.{part}.{kind}"))
}

/// What decides the names of `config`'s tensors in GGUF: its model type's reading
/// (Phi-2's and Phi-3's names, Mixtral's expert names) and its norms.
pub(super) fn naming(config: &ModelConfig) -> GgufNaming {
    let reading =
        family::model_type(&config.model_type).map_or(GgufReading::LLAMA, |(_, t)| t.gguf_reading);
    reading.naming(config.sandwich_norms)
}

/// An expert's tensor (transformers 4.x's per-expert names, what checkpoints hold): its layer,
/// expert and the part (`gate`, `up`, `down`) of llama.cpp's stacked `ffn_{part}_exps`.
pub(super) fn expert_part(hf: &str) -> Option<(usize, usize, &'static str)> {
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, rest) = rest.split_once('.')?;
    let rest = rest
        .strip_prefix("block_sparse_moe.experts.")
        .or_else(|| rest.strip_prefix("mlp.experts."))?;
    let (expert, proj) = rest.split_once('.')?;
    let part = match proj {
        "w1.weight" | "gate_proj.weight" => "gate",
        "w3.weight" | "up_proj.weight" => "up",
        "w2.weight" | "down_proj.weight" => "down",
        _ => return None,
    };
    Some((layer.parse().ok()?, expert.parse().ok()?, part))
}

/// llama.cpp's q/k row order for its RoPE: within each head, the rows of the first and second
/// halves interleaved (`convert_hf_to_gguf.py`'s `permute`). Row `p` of the result is row
/// `order[p]` of the HF tensor.
pub(super) fn permuted_rows(rows: usize, heads: usize) -> Vec<usize> {
    let head_dim = rows / heads;
    let half = head_dim / 2;
    (0..rows)
        .map(|p| {
            let (h, r) = (p / head_dim, p % head_dim);
            h * head_dim + (r % 2) * half + r / 2
        })
        .collect()
}

/// llama.cpp's per-frequency factors of Llama 3's RoPE scaling (its `rope_freqs` tensor): 1 for
/// high frequencies, `factor` for low ones, smoothly in between, over `head_dim / 2` frequencies.
pub(super) fn llama3_rope_factors(
    theta: f64,
    head_dim: usize,
    factor: f64,
    low_freq_factor: f64,
    high_freq_factor: f64,
    original: usize,
) -> Vec<f32> {
    let old = original as f64;
    let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
    (0..head_dim / 2)
        .map(|i| {
            // In f32, as the converter computes the frequencies with torch.
            let freq = 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32);
            let wavelen = 2.0 * std::f64::consts::PI / freq as f64;
            let f = if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth =
                    (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                1.0 / ((1.0 - smooth) / factor + smooth)
            };
            f as f32
        })
        .collect()
}
