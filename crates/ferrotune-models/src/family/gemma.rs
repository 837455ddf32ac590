//! Google's Gemma 1, 2 (and VaultGemma, Gemma 2 without post-norms), 3 and 4, with Gemma 3's and
//! Gemma 4's multimodal checkpoints run as their text model.

use super::prelude::*;
use crate::config::hf::{
    get_bool, get_f64, get_positive, get_str, get_usize, layer_types_marking, parse_rope,
    req_usize, rope_from_params,
};
use crate::config::{Gemma4Layers, RopeConfig, RopeScaling};

/// The Gemma family.
pub static FAMILY: Family = Family {
    multimodal: &[
        Multimodal::new("gemma3", &["gemma3_text"]),
        Multimodal::new("gemma4", &["gemma4_text"]),
    ],
    config_defaults,
    // convert_hf_to_gguf.py adds 1 to every Gemma norm weight (q/k norms included).
    // llama.cpp's Gemma and Gemma 2 always use the embeddings as the output head.
    gguf_archs: &[
        gemma_arch(
            "gemma",
            "gemma",
            GgufWriting {
                tied_head_only: true,
                ..GgufWriting::PLAIN
            },
        ),
        gemma_arch(
            "gemma2",
            "gemma2",
            GgufWriting {
                tied_head_only: true,
                windows: GgufWindows::EveryOther,
                score_scale_27b_layers: Some(46),
                softcaps: true,
                ..GgufWriting::PLAIN
            },
        ),
        gemma_arch(
            "gemma3",
            "gemma3_text",
            GgufWriting {
                windows: GgufWindows::FiveOfSix,
                score_scale_27b_layers: Some(62),
                check: gemma3_gguf_check,
                note: gemma3_gguf_note,
                ..GgufWriting::PLAIN
            },
        ),
    ],
    torchtune_builders: &[
        ("gemma", &["gemma"]),
        ("gemma2", &["gemma2"]),
        ("gemma3", &["gemma3_text"]),
    ],
    ..Family::new(
        "Gemma",
        &[
            ModelType::new("gemma", "GemmaForCausalLM")
                .gguf("gemma", GEMMA_GGUF)
                .torchtune(TorchtuneLayout::Permuted),
            // torchtune 0.6.1's checkpointer converts Gemma 2's adapters but not its weights.
            ModelType::new("gemma2", "Gemma2ForCausalLM")
                .gguf(
                    "gemma2",
                    GgufReading {
                        sandwich_norms: true,
                        config_keys: |g, c| layered_gguf_keys(g, c, 46, true),
                        ..GEMMA_GGUF
                    },
                )
                .torchtune_adapters(TorchtuneLayout::Permuted),
            ModelType::new("vaultgemma", "VaultGemmaForCausalLM"),
            ModelType::new("gemma3_text", "Gemma3ForCausalLM").gguf(
                "gemma3",
                GgufReading {
                    sandwich_norms: true,
                    config_keys: |g, c| layered_gguf_keys(g, c, 62, false),
                    ..GEMMA_GGUF
                },
            ),
            ModelType::new("gemma4_text", "Gemma4ForCausalLM"),
        ],
        &GemmaRules,
    )
};

/// Gemma's reading of its configs.
#[derive(Debug)]
struct GemmaRules;

/// Gemma 2 and VaultGemma (Gemma 2 without the post-norms): transformers' Gemma 2 defaults.
fn gemma2_like(model_type: &str) -> bool {
    matches!(model_type, "gemma2" | "vaultgemma")
}

/// Gemma 2, 3 and 4: per-layer-type attention, `query_pre_attn_scalar`, sandwich norms (but
/// VaultGemma). Gemma 4 shares Gemma 3's layer types, two ropes and sandwich norms.
fn layered(model_type: &str) -> bool {
    gemma2_like(model_type) || matches!(model_type, "gemma3_text" | "gemma4_text")
}

impl HfConfig for GemmaRules {
    fn check(&self, hf: HfSource) -> HfResult<()> {
        if hf.model_type != "gemma4_text" {
            return super::refuse_bidirectional(hf.obj);
        }
        // Gemma 4 names who attends both ways: "vision" concerns image tokens only, which text
        // never holds; "all" makes an encoder.
        match hf.obj.get("use_bidirectional_attention") {
            None | Some(Value::Null) => Ok(()),
            Some(Value::String(s)) if s == "vision" => Ok(()),
            Some(other) => Err(format!(
                "'use_bidirectional_attention' is {other}: only null or \"vision\" make a causal language model"
            )),
        }
    }

    /// Gemma names it `hidden_activation`; transformers runs Gemma with the tanh GELU whatever the
    /// legacy `hidden_act` says.
    fn activation<'a>(&self, hf: HfSource<'a>) -> HfResult<&'a str> {
        Ok(get_str(hf.obj, "hidden_activation")?.unwrap_or("gelu_pytorch_tanh"))
    }

    fn attention(&self, hf: HfSource, layers: usize, max_pos: usize) -> HfResult<AttentionLayers> {
        let (model_type, obj) = (hf.model_type, hf.obj);
        if !layered(model_type) {
            let rope = self.rope(hf, max_pos)?;
            return AttentionLayers::single(rope, obj, layers, self.window_style());
        }
        let mut sliding = gemma_sliding_layers(obj, model_type, layers)?;
        if model_type == "gemma4_text" {
            // transformers forces Gemma 4's last layer to full attention.
            if let Some(last) = sliding.last_mut() {
                *last = false;
            }
        }
        // Gemma 2/3 default to a 4096-token window when the key is absent; null disables it.
        let window = match obj.get("sliding_window") {
            None => Some(4096),
            Some(_) => get_usize(obj, "sliding_window")?,
        };
        let sliding_windows = sliding.iter().map(|&s| window.filter(|_| s)).collect();
        if gemma2_like(model_type) {
            return Ok(AttentionLayers {
                rope: parse_rope(obj, max_pos, 10000.0, false)?,
                local_rope: None,
                sliding_windows,
                local_rope_layers: vec![false; layers],
            });
        }
        let (global, local) = parse_gemma3_rope(obj, max_pos)?;
        Ok(AttentionLayers {
            rope: global,
            local_rope: Some(local),
            sliding_windows,
            local_rope_layers: sliding,
        })
    }

    fn configure(&self, hf: HfSource, c: &mut ModelConfig) -> HfResult<()> {
        let (model_type, obj) = (hf.model_type, hf.obj);
        let gemma4 = model_type == "gemma4_text";
        if gemma2_like(model_type) {
            // transformers' Gemma 2 defaults when a key is absent (null turns the feature off).
            for (key, cap, default) in [
                (
                    "attn_logit_softcapping",
                    &mut c.attn_logit_softcapping,
                    50.0,
                ),
                (
                    "final_logit_softcapping",
                    &mut c.final_logit_softcapping,
                    30.0,
                ),
            ] {
                if obj.get(key).is_none() {
                    *cap = Some(default);
                }
            }
        }
        c.query_pre_attn_scalar = if gemma4 {
            // Gemma 4's q/k norms leave the scores unscaled (transformers' `scaling = 1.0`).
            Some(1.0)
        } else if layered(model_type) {
            Some(get_positive(obj, "query_pre_attn_scalar")?.unwrap_or(256.0))
        } else {
            None
        };
        if gemma4 {
            c.gemma4 = Some(parse_gemma4(
                obj,
                &c.local_rope_layers,
                (c.head_dim, c.num_key_value_heads, c.num_attention_heads),
                c.intermediate_size,
            )?);
        }
        // Gemma ties the output head to the embeddings unless the config says otherwise.
        c.tie_word_embeddings =
            c.score_labels.is_none() && get_bool(obj, "tie_word_embeddings")?.unwrap_or(true);
        c.qk_norm = matches!(model_type, "gemma3_text" | "gemma4_text");
        // Gemma's norms scale by `1 + weight`, Gemma 4's by the weight itself.
        c.norm_weight_offset_one = !gemma4;
        c.scale_embeddings = true;
        c.sandwich_norms = layered(model_type) && model_type != "vaultgemma";
        if model_type == "vaultgemma" {
            // VaultGemma's MLP pre-norm is Gemma 2's, without its two post-norms.
            c.post_attention_norm_name = "pre_feedforward_layernorm.weight";
        }
        Ok(())
    }
}

/// Gemma in GGUF: the tanh GELU, under both of its config names.
const GEMMA_GGUF: GgufReading = GgufReading {
    activation: &[
        ("hidden_act", "gelu_pytorch_tanh"),
        ("hidden_activation", "gelu_pytorch_tanh"),
    ],
    ..GgufReading::LLAMA
};

/// A Gemma 2/3 GGUF file's window, score scale (`big_layers`: the layer count of the 27B model)
/// and, for Gemma 2 (`softcaps`), its caps.
fn layered_gguf_keys(
    g: GgufSource,
    c: &mut Map<String, Value>,
    big_layers: usize,
    softcaps: bool,
) -> Result<(), ModelError> {
    let (g, hp) = (g.file, g.hp);
    let a = g.arch();
    let window = g.uint(&format!("{a}.attention.sliding_window"))?;
    c.insert("sliding_window".into(), window.into());
    // GGUF has no query_pre_attn_scalar: llama.cpp scales by the head size, but by hidden / heads
    // for the 27B models (46 and 62 layers), which is what their HF configs say too.
    let scalar = if hp.layers == big_layers {
        hp.hidden / hp.heads
    } else {
        hp.head_dim
    };
    c.insert("query_pre_attn_scalar".into(), scalar.into());
    if softcaps {
        // llama.cpp writes the caps; transformers' defaults (50, 30) otherwise.
        for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
            if let Some(cap) = g.float(&format!("{a}.{key}"))? {
                c.insert(key.into(), cap.into());
            }
        }
    }
    // Gemma 3: llama.cpp's local rope base is fixed at 10000 and its pattern at 6
    // (Gemma3TextConfig's defaults) unless the file says otherwise; `rope_scaling` (linear, 4B+)
    // applies to the global layers.
    if let Some(p) = g.uint(&format!("{a}.attention.sliding_window_pattern"))? {
        c.insert("sliding_window_pattern".into(), p.into());
    }
    Ok(())
}

const fn gemma_arch(
    name: &'static str,
    model_type: &'static str,
    writing: GgufWriting,
) -> GgufArch {
    GgufArch {
        norm_plus_one: true,
        vocab: GgufVocabStyle::Gemma,
        ..GgufArch::plain(name, model_type, writing)
    }
}

/// What llama.cpp's `gemma3` fixes: a window, the local layers' rope (base 10000, unscaled), no
/// softcaps, and a global rope scaled linearly or not at all.
fn gemma3_gguf_check(config: &ModelConfig) -> Result<(), String> {
    if config
        .layer_sliding_windows
        .iter()
        .flatten()
        .next()
        .is_none()
    {
        return Err("llama.cpp's 'gemma3' needs a sliding window (sliding_window is null)".into());
    }
    let local_ok = config
        .local_rope
        .as_ref()
        .is_some_and(|r| r.theta == 10_000.0 && matches!(r.scaling, RopeScaling::Default));
    if !local_ok {
        return Err(
            "the sliding layers' rope is not llama.cpp's for 'gemma3' (base 10000, no scaling)"
                .into(),
        );
    }
    if config.attn_logit_softcapping.is_some() || config.final_logit_softcapping.is_some() {
        return Err(
            "llama.cpp's 'gemma3' applies no logit softcapping; the checkpoint sets one".into(),
        );
    }
    if !matches!(
        config.rope.scaling,
        RopeScaling::Default | RopeScaling::Linear { .. }
    ) {
        return Err(format!(
            "llama.cpp's 'gemma3' scales the global rope linearly or not at all, not {:?}",
            config.rope.scaling
        ));
    }
    Ok(())
}

/// llama.cpp's `gemma3` makes every sixth layer a full-attention one: with fewer layers its KV
/// cache for them is empty, and llama.cpp 0.3.16 crashes on such a file (ferrotune and
/// transformers read it).
fn gemma3_gguf_note(config: &ModelConfig) -> Option<String> {
    (config.num_hidden_layers < 6).then(|| {
        format!(
            "llama.cpp's 'gemma3' makes every sixth layer a full-attention layer; this model has \
             {} layers, none of them full, and llama.cpp cannot run it",
            config.num_hidden_layers
        )
    })
}

/// Defaults of `Gemma2Config`, `Gemma3TextConfig` and `Gemma4TextConfig` for keys a config may
/// leave out (Gemma 3's multimodal configs leave out most of their text model's).
fn config_defaults(model_type: &str) -> &'static [(&'static str, Value)] {
    static GEMMA2: OnceLock<Vec<(&str, Value)>> = OnceLock::new();
    static GEMMA3: OnceLock<Vec<(&str, Value)>> = OnceLock::new();
    static GEMMA4: OnceLock<Vec<(&str, Value)>> = OnceLock::new();
    let common = |vocab: u64, max_pos: u64| {
        vec![
            ("vocab_size", Value::from(vocab)),
            ("hidden_size", Value::from(2304u64)),
            ("intermediate_size", Value::from(9216u64)),
            ("num_hidden_layers", Value::from(26u64)),
            ("num_attention_heads", Value::from(8u64)),
            ("num_key_value_heads", Value::from(4u64)),
            ("head_dim", Value::from(256u64)),
            ("max_position_embeddings", Value::from(max_pos)),
            ("rms_norm_eps", Value::from(1e-6)),
            ("bos_token_id", Value::from(2u64)),
            ("eos_token_id", Value::from(1u64)),
            ("pad_token_id", Value::from(0u64)),
        ]
    };
    match model_type {
        "gemma2" | "vaultgemma" => GEMMA2.get_or_init(|| common(256_000, 8192)),
        "gemma3_text" => GEMMA3.get_or_init(|| common(262_208, 131_072)),
        // Gemma4TextConfig's: its own sizes, window and per-layer embeddings, and a proportional
        // rope on a quarter of the full-attention layers' heads.
        "gemma4_text" => GEMMA4.get_or_init(|| {
            let mut d = common(262_144, 131_072);
            d.retain(|(k, _)| *k != "num_hidden_layers");
            d.extend([
                ("num_hidden_layers", Value::from(30u64)),
                ("sliding_window", Value::from(512u64)),
                ("hidden_size_per_layer_input", Value::from(256u64)),
                ("vocab_size_per_layer_input", Value::from(262_144u64)),
                (
                    "rope_parameters",
                    serde_json::json!({
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                        "full_attention": {"rope_type": "proportional",
                                           "partial_rotary_factor": 0.25,
                                           "rope_theta": 1_000_000.0},
                    }),
                ),
            ]);
            d
        }),
        _ => &[],
    }
}

/// Gemma 3's two rotary embeddings, `(global, local)`: transformers 5 keeps one
/// `rope_parameters` entry per layer type (`full_attention`, `sliding_attention`); 4.x has
/// `rope_theta` + `rope_scaling` for the full-attention layers and `rope_local_base_freq` for the
/// sliding ones (default rope). Default thetas 1e6 (global) and 1e4 (local), as transformers.
fn parse_gemma3_rope(
    obj: &Map<String, Value>,
    max_pos: usize,
) -> Result<(RopeConfig, RopeConfig), String> {
    const GLOBAL_THETA: f64 = 1_000_000.0;
    const LOCAL_THETA: f64 = 10_000.0;
    let per_type = match obj.get("rope_parameters") {
        Some(Value::Object(m))
            if m.contains_key("full_attention") || m.contains_key("sliding_attention") =>
        {
            Some(m)
        }
        _ => None,
    };
    let Some(per_type) = per_type else {
        let global = parse_rope(obj, max_pos, GLOBAL_THETA, false)?;
        let local_theta = get_f64(obj, "rope_local_base_freq")?.unwrap_or(LOCAL_THETA);
        let local = RopeConfig {
            theta: local_theta,
            partial_rotary_factor: 1.0,
            scaling: RopeScaling::Default,
        };
        return Ok((global, local));
    };
    let empty = Map::new();
    let entry = |key: &str, default_theta: f64| -> Result<RopeConfig, String> {
        let params = match per_type.get(key) {
            Some(Value::Object(m)) => m,
            Some(Value::Null) | None => &empty,
            Some(_) => return Err(format!("'rope_parameters.{key}' must be an object")),
        };
        let theta = get_f64(params, "rope_theta")?.unwrap_or(default_theta);
        rope_from_params(obj, params, max_pos, theta, false)
            .map_err(|e| format!("rope_parameters.{key}: {e}"))
    };
    Ok((
        entry("full_attention", GLOBAL_THETA)?,
        entry("sliding_attention", LOCAL_THETA)?,
    ))
}

/// Gemma 4's per-layer structure ([`Gemma4Layers`]) from its config; `sliding` marks the
/// sliding-attention layers, `dims` is `(head_dim, num_key_value_heads, num_attention_heads)`.
fn parse_gemma4(
    obj: &Map<String, Value>,
    sliding: &[bool],
    dims: (usize, usize, usize),
    intermediate_size: usize,
) -> Result<Gemma4Layers, String> {
    let (head_dim, kv_heads, heads) = dims;
    let layers = sliding.len();
    let key_is_value_flag = get_bool(obj, "attention_k_eq_v")?.unwrap_or(false);
    let mut attention_dims = vec![(head_dim, kv_heads); layers];
    match obj.get("per_layer_config").filter(|v| !v.is_null()) {
        // What transformers writes: the overrides by layer index, authoritative.
        Some(per_layer) => {
            let per_layer = per_layer
                .as_object()
                .ok_or("'per_layer_config' must be an object of layer overrides")?;
            for (key, overrides) in per_layer {
                let at = |what: &str| format!("'per_layer_config.{key}'{what}");
                let layer: usize = key
                    .parse()
                    .ok()
                    .filter(|&l| l < layers)
                    .ok_or_else(|| at(" does not name a layer"))?;
                let overrides = overrides
                    .as_object()
                    .ok_or_else(|| at(" must be an object"))?;
                for (name, _) in overrides {
                    if !matches!(name.as_str(), "head_dim" | "num_key_value_heads") {
                        return Err(at(&format!(
                            " overrides '{name}': only head_dim and num_key_value_heads are supported"
                        )));
                    }
                }
                let (d, kv) = &mut attention_dims[layer];
                *d = get_usize(overrides, "head_dim")?.unwrap_or(*d);
                *kv = get_usize(overrides, "num_key_value_heads")?.unwrap_or(*kv);
            }
        }
        // The Hub's configs: the full-attention layers' own head size and, with
        // `attention_k_eq_v`, their own number of key/value heads.
        None => {
            let global_dim = get_usize(obj, "global_head_dim")?.unwrap_or(512);
            let global_kv = get_usize(obj, "num_global_key_value_heads")?
                .filter(|_| key_is_value_flag)
                .unwrap_or(kv_heads);
            for (dims, &s) in attention_dims.iter_mut().zip(sliding) {
                if !s {
                    *dims = (global_dim, global_kv);
                }
            }
        }
    }
    for (i, &(d, kv)) in attention_dims.iter().enumerate() {
        if d == 0 || kv == 0 || heads % kv != 0 {
            return Err(format!(
                "layer {i}: num_attention_heads {heads} is not a multiple of its {kv} key/value heads (head_dim {d})"
            ));
        }
        // One rotary table per layer type: a type's layers must share their head size.
        if let Some(j) = (0..i).find(|&j| sliding[j] == sliding[i] && attention_dims[j].0 != d) {
            return Err(format!(
                "layers {j} and {i} are of one attention type but have head_dim {} and {d}",
                attention_dims[j].0
            ));
        }
    }
    let shared = get_usize(obj, "num_kv_shared_layers")?.unwrap_or(0);
    if shared >= layers && shared > 0 {
        return Err(format!(
            "'num_kv_shared_layers' {shared} leaves no layer of the {layers} to compute keys and values"
        ));
    }
    let first_shared = layers - shared;
    let mut kv_source = vec![None; layers];
    for i in first_shared..layers {
        let source = (0..first_shared)
            .rev()
            .find(|&j| sliding[j] == sliding[i])
            .ok_or_else(|| {
                format!(
                    "layer {i} shares the keys and values of an earlier layer of its type \
                     (num_kv_shared_layers {shared}), but no unshared layer has its type"
                )
            })?;
        kv_source[i] = Some(source);
    }
    let double_wide = get_bool(obj, "use_double_wide_mlp")?.unwrap_or(false);
    let intermediate_sizes = kv_source
        .iter()
        .map(|s| intermediate_size * if double_wide && s.is_some() { 2 } else { 1 })
        .collect();
    let per_layer_input = match get_usize(obj, "hidden_size_per_layer_input")? {
        Some(0) | None => None,
        Some(dim) => Some((req_usize(obj, "vocab_size_per_layer_input")?, dim)),
    };
    let moe = if get_bool(obj, "enable_moe_block")?.unwrap_or(false) {
        let experts = req_usize(obj, "num_experts")?;
        let top_k = req_usize(obj, "top_k_experts")?;
        if top_k == 0 || top_k > experts {
            return Err(format!(
                "'top_k_experts' {top_k} must be between 1 and num_experts {experts}"
            ));
        }
        Some((experts, top_k, req_usize(obj, "moe_intermediate_size")?))
    } else {
        None
    };
    Ok(Gemma4Layers {
        attention_dims,
        key_is_value: sliding.iter().map(|&s| key_is_value_flag && !s).collect(),
        kv_source,
        intermediate_sizes,
        per_layer_input,
        moe,
    })
}

/// Gemma 2/3: which layers use sliding-window attention, from `layer_types` or, in older configs,
/// the pattern transformers derives (every `sliding_window_pattern`-th layer is full attention:
/// 2 for Gemma 2, `sliding_window_pattern` (default 6) for Gemma 3).
fn gemma_sliding_layers(
    obj: &Map<String, Value>,
    model_type: &str,
    layers: usize,
) -> Result<Vec<bool>, String> {
    if let Some(sliding) = layer_types_marking(obj, "sliding_attention", layers)? {
        return Ok(sliding);
    }
    let pattern = if model_type == "gemma2" || model_type == "vaultgemma" {
        2
    } else {
        get_usize(obj, "sliding_window_pattern")?.unwrap_or(6)
    };
    if pattern == 0 {
        return Err("'sliding_window_pattern' must be at least 1".into());
    }
    Ok((0..layers).map(|i| (i + 1) % pattern != 0).collect())
}
