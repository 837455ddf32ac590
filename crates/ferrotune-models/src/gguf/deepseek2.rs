//! llama.cpp's `deepseek2` files (DeepSeek-V2 and -V3) read as transformers' `deepseek_v2` /
//! `deepseek_v3` checkpoints, undoing what convert_hf_to_gguf.py changed: `kv_b_proj` split per
//! head into `attn_k_b` (keys transposed) and `attn_v_b`, experts stacked, the router's bias renamed
//! `exp_probs_b`, and the hyperparameters as llama.cpp keeps them (`key_length_mla`,
//! `yarn_log_multiplier` as 0.1 · `mscale_all_dim`, ...). The names are the family's
//! ([`crate::family::deepseek`]).
//!
//! A file is refused where llama.cpp would compute what no transformers DeepSeek does: softmax
//! routing with expert groups (llama.cpp ranks a group by its two best scores, V2 by its best),
//! with renormalized top-k weights or a score-correction bias; a gating function other than
//! softmax or sigmoid; YaRN without `yarn_log_multiplier`.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Map, Value};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::family::deepseek::{GGUF_LAYER_TENSORS, GGUF_TOP_TENSORS};
use crate::family::gguf::GgufMetadata;

use super::{GgufFile, PackedWeights};

/// llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_*` values.
const GATING_SOFTMAX: u64 = 1;
const GATING_SIGMOID: u64 = 2;

/// The MLA sizes of a file: each head's key part without and with RoPE, its value, the latent.
struct Mla {
    nope: usize,
    rope: usize,
    v: usize,
    kv_lora: usize,
}

/// Reads a `deepseek2` file: its config, and its tensors in transformers' names, dequantized to
/// `dtype` on `device`.
pub(super) fn read(
    g: &mut GgufFile,
    dtype: DType,
    device: &Device,
) -> Result<(ModelConfig, HashMap<String, Tensor>, PackedWeights), ModelError> {
    let (config_json, mla, heads, layers, experts) = config_json(g, dtype)?;
    let config = ModelConfig::from_hf_json(&config_json)
        .map_err(|msg| g.err(format!("the metadata gives an invalid model config: {msg}")))?;
    let mut names: Vec<String> = g.content.tensor_infos.keys().cloned().collect();
    names.sort();
    for name in &names {
        g.check_tensor_data(name)?;
    }
    let mut tensors = HashMap::with_capacity(names.len());
    // Per layer: `attn_k_b` and `attn_v_b`, joined into `kv_b_proj` once both are read.
    let mut kb: HashMap<usize, Tensor> = HashMap::new();
    let mut vb: HashMap<usize, Tensor> = HashMap::new();
    for name in &names {
        let (stem, bias) = match name.strip_suffix(".weight") {
            Some(s) => (s, false),
            None => match name.strip_suffix(".bias") {
                Some(s) => (s, true),
                None => return Err(g.tensor_err(name, "is neither a weight nor a bias")),
            },
        };
        let t = g.dequantize(name)?;
        crate::weight_checks::finite(g.path, name, &t, Some(DType::F32))?;
        let convert = |t: Tensor| t.to_dtype(dtype).and_then(|t| t.to_device(device));
        let convert = |t: Tensor| {
            convert(t).map_err(|e| {
                g.tensor_err(
                    name,
                    format!("cannot be converted to {dtype:?} on {device:?}: {e}"),
                )
            })
        };
        let Some(rest) = stem.strip_prefix("blk.") else {
            let Some((_, hf)) = GGUF_TOP_TENSORS.iter().find(|(p, _)| *p == stem) else {
                return Err(g.tensor_err(name, "is not a tensor of a deepseek2 model"));
            };
            if bias {
                return Err(g.tensor_err(name, "is a bias, which deepseek2 models do not have"));
            }
            tensors.insert(format!("{hf}.weight"), convert(t)?);
            continue;
        };
        let (layer, part) = rest
            .split_once('.')
            .and_then(|(l, p)| Some((l.parse::<usize>().ok()?, p)))
            .ok_or_else(|| g.tensor_err(name, "is not a tensor of a deepseek2 model"))?;
        if layer >= layers {
            // Multi-token-prediction layers past the decoder's, which transformers skips too.
            tracing::warn!(
                "{}: ignoring GGUF tensor '{name}' (past the {layers} decoder layers)",
                g.path.display()
            );
            continue;
        }
        let p = format!("model.layers.{layer}");
        match (part, bias) {
            ("attn_k_b", false) => {
                kb.insert(layer, t);
            }
            ("attn_v_b", false) => {
                vb.insert(layer, t);
            }
            ("exp_probs_b", true) => {
                tensors.insert(format!("{p}.mlp.gate.e_score_correction_bias"), convert(t)?);
            }
            ("ffn_gate_exps" | "ffn_up_exps" | "ffn_down_exps", false) => {
                let proj = &part[4..part.len() - 5];
                if t.dims().first() != Some(&experts) {
                    return Err(g.tensor_err(
                        name,
                        format!("has shape {:?}, not {experts} experts", t.dims()),
                    ));
                }
                for e in 0..experts {
                    let one = t.get(e).map_err(|e| g.tensor_err(name, e))?;
                    tensors.insert(
                        format!("{p}.mlp.experts.{e}.{proj}_proj.weight"),
                        convert(one)?,
                    );
                }
            }
            (part, false) => {
                let Some((_, hf)) = GGUF_LAYER_TENSORS.iter().find(|(g, _)| *g == part) else {
                    return Err(g.tensor_err(name, "is not a tensor of a deepseek2 model"));
                };
                tensors.insert(format!("{p}.{hf}.weight"), convert(t)?);
            }
            (_, true) => {
                return Err(g.tensor_err(name, "is a bias, which deepseek2 models do not have"))
            }
        }
    }
    for layer in 0..layers {
        let name = format!("blk.{layer}.attn_k_b.weight");
        let kv_b = match (kb.remove(&layer), vb.remove(&layer)) {
            (Some(k), Some(v)) => join_kv_b(&k, &v, heads, &mla)
                .map_err(|msg| g.tensor_err(&name, format!("and attn_v_b {msg}")))?,
            (None, None) => continue,
            _ => {
                return Err(
                    g.tensor_err(&name, "comes without its attn_v_b (or the other way round)")
                )
            }
        };
        let kv_b = kv_b
            .to_dtype(dtype)
            .and_then(|t| t.to_device(device))
            .map_err(|e| g.tensor_err(&name, e))?;
        tensors.insert(
            format!("model.layers.{layer}.self_attn.kv_b_proj.weight"),
            kv_b,
        );
    }
    // A sigmoid router without `exp_probs_b` adds nothing to its scores.
    if config
        .grouped_routing
        .as_ref()
        .is_some_and(|r| r.correction_bias)
    {
        for (layer, sparse) in config
            .moe
            .as_ref()
            .map_or(&[][..], |m| &m.sparse_layers[..])
            .iter()
            .enumerate()
        {
            let key = format!("model.layers.{layer}.mlp.gate.e_score_correction_bias");
            // Bounded by the stacked experts' count, checked above when they are present.
            if *sparse && !tensors.contains_key(&key) && experts <= 1 << 20 {
                let zeros =
                    Tensor::zeros(experts, dtype, device).map_err(|e| g.err(e.to_string()))?;
                tensors.insert(key, zeros);
            }
        }
    }
    Ok((config, tensors, PackedWeights::new()))
}

/// `kv_b_proj` (`[heads · (nope + v), kv_lora]`) from llama.cpp's `attn_k_b`
/// (`[heads, kv_lora, nope]`: each head's key rows transposed) and `attn_v_b`
/// (`[heads, v, kv_lora]`).
fn join_kv_b(k: &Tensor, v: &Tensor, heads: usize, m: &Mla) -> Result<Tensor, String> {
    if k.dims() != [heads, m.kv_lora, m.nope] || v.dims() != [heads, m.v, m.kv_lora] {
        return Err(format!(
            "have shapes {:?} and {:?}, not [{heads}, {}, {}] and [{heads}, {}, {}]",
            k.dims(),
            v.dims(),
            m.kv_lora,
            m.nope,
            m.v,
            m.kv_lora
        ));
    }
    let join = || -> candle_core::Result<Tensor> {
        let k = k.transpose(1, 2)?.contiguous()?;
        Tensor::cat(&[&k, v], 1)?.reshape((heads * (m.nope + m.v), m.kv_lora))
    };
    join().map_err(|e| format!("cannot be joined: {e}"))
}

/// The transformers config a `deepseek2` file's metadata describes, with its MLA sizes, head and
/// layer counts and experts.
fn config_json(
    g: &GgufFile,
    dtype: DType,
) -> Result<(Value, Mla, usize, usize, usize), ModelError> {
    let a = crate::family::deepseek::GGUF_ARCH;
    let k = |s: &str| format!("{a}.{s}");
    let hidden = g.req_count(&k("embedding_length"))?;
    let layers = g.req_count(&k("block_count"))?;
    g.check_layers(a, layers)?;
    let heads = g.req_count(&k("attention.head_count"))?;
    let rope = g.req_count(&k("rope.dimension_count"))?;
    let kv_lora = g.req_count(&k("attention.kv_lora_rank"))?;
    // Newer converters write the absorbed (MQA) sizes as `key_length` / `value_length` and the
    // per-head ones as `*_mla`; older files have the per-head ones only.
    let (qk, v) = match (
        g.uint(&k("attention.key_length_mla"))?,
        g.uint(&k("attention.value_length_mla"))?,
    ) {
        (Some(qk), Some(v)) => (qk as usize, v as usize),
        _ => (
            g.req_count(&k("attention.key_length"))?,
            g.req_count(&k("attention.value_length"))?,
        ),
    };
    if qk <= rope {
        return Err(g.err(format!(
            "the key head size {qk} leaves no room beside the rotary part {rope}"
        )));
    }
    let mla = Mla {
        nope: qk - rope,
        rope,
        v,
        kv_lora,
    };
    let vocab = g.vocab_or_embedding_rows(a)?;
    let eps = g.req_rms_eps(a)?;
    let mut c = Map::new();
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("hidden_size".into(), json!(hidden));
    c.insert(
        "intermediate_size".into(),
        json!(g.req_count(&k("feed_forward_length"))?),
    );
    c.insert("num_hidden_layers".into(), json!(layers));
    c.insert("num_attention_heads".into(), json!(heads));
    // llama.cpp stores MLA as one shared latent head; transformers counts the expanded heads.
    c.insert("num_key_value_heads".into(), json!(heads));
    c.insert(
        "max_position_embeddings".into(),
        json!(g.req_count(&k("context_length"))?),
    );
    c.insert("rms_norm_eps".into(), json!(eps));
    c.insert("hidden_act".into(), json!("silu"));
    c.insert("attention_bias".into(), json!(false));
    let q_lora = g.uint(&k("attention.q_lora_rank"))?.filter(|&r| r > 0);
    c.insert("q_lora_rank".into(), json!(q_lora));
    c.insert("kv_lora_rank".into(), json!(kv_lora));
    c.insert("qk_nope_head_dim".into(), json!(mla.nope));
    c.insert("qk_rope_head_dim".into(), json!(mla.rope));
    c.insert("v_head_dim".into(), json!(mla.v));
    c.insert("head_dim".into(), json!(mla.rope));
    c.insert("rope_interleave".into(), json!(true));
    c.insert("rope_parameters".into(), rope_parameters(g)?);
    c.insert("tie_word_embeddings".into(), json!(g.head_tied()));
    c.insert("num_nextn_predict_layers".into(), json!(0));
    let experts = g.uint(&k("expert_count"))?.unwrap_or(0) as usize;
    let leading = g.uint(&k("leading_dense_block_count"))?.unwrap_or(0) as usize;
    let v3 = if experts == 0 {
        c.insert("first_k_dense_replace".into(), json!(layers));
        false
    } else {
        c.insert("first_k_dense_replace".into(), json!(leading));
        moe_keys(g, &mut c, experts)?
    };
    let (model_type, class) = crate::family::deepseek::gguf_model_type(v3);
    c.insert("model_type".into(), json!(model_type));
    c.insert("architectures".into(), json!([class]));
    g.insert_ids_dtype_name(&mut c, dtype)?;
    Ok((Value::Object(c), mla, heads, layers, experts))
}

/// The experts' keys; whether they route as DeepSeek-V3 (sigmoid) rather than V2 (softmax).
fn moe_keys(g: &GgufFile, c: &mut Map<String, Value>, experts: usize) -> Result<bool, ModelError> {
    let a = crate::family::deepseek::GGUF_ARCH;
    let k = |s: &str| format!("{a}.{s}");
    // As llama.cpp: files without a gating function (DeepSeek-V2, V2.5) route by softmax.
    let gating = g.uint(&k("expert_gating_func"))?.unwrap_or(GATING_SOFTMAX);
    let groups = g.uint(&k("expert_group_count"))?.unwrap_or(1).max(1);
    let groups_used = g.uint(&k("expert_group_used_count"))?.unwrap_or(groups);
    let norm = g.flag(&k("expert_weights_norm")).unwrap_or(false);
    let biased = g
        .content
        .tensor_infos
        .keys()
        .any(|n| n.ends_with(".exp_probs_b.bias"));
    let v3 = match gating {
        GATING_SIGMOID => true,
        GATING_SOFTMAX => {
            let refuse = |what: &str| {
                g.err(format!(
                    "{a}: softmax routing ({}) with {what}, which no transformers DeepSeek computes",
                    k("expert_gating_func")
                ))
            };
            if groups > 1 {
                return Err(refuse(&format!(
                    "{groups} expert groups ({}; llama.cpp ranks a group by its two best scores, DeepSeek-V2 by its best)",
                    k("expert_group_count")
                )));
            }
            if norm {
                return Err(refuse(&format!(
                    "renormalized top-k weights ({})",
                    k("expert_weights_norm")
                )));
            }
            if biased {
                return Err(refuse("a score-correction bias (exp_probs_b)"));
            }
            false
        }
        other => {
            return Err(g.err(format!(
                "{}: gating function {other} is not supported (softmax 1 and sigmoid 2 are)",
                k("expert_gating_func")
            )))
        }
    };
    let shared = g.req_count(&k("expert_shared_count"))?;
    c.insert("n_routed_experts".into(), json!(experts));
    c.insert(
        "num_experts_per_tok".into(),
        json!(g.req_count(&k("expert_used_count"))?),
    );
    c.insert(
        "moe_intermediate_size".into(),
        json!(g.req_count(&k("expert_feed_forward_length"))?),
    );
    c.insert("n_shared_experts".into(), json!(shared));
    // llama.cpp scales by `expert_weights_scale` only when the file has it.
    let scale = g.float(&k("expert_weights_scale"))?.unwrap_or(1.0);
    c.insert("routed_scaling_factor".into(), json!(scale));
    c.insert("norm_topk_prob".into(), json!(norm));
    if v3 {
        c.insert("topk_method".into(), json!("noaux_tc"));
        c.insert("n_group".into(), json!(groups));
        c.insert("topk_group".into(), json!(groups_used));
    } else {
        c.insert("topk_method".into(), json!("greedy"));
    }
    Ok(v3)
}

/// transformers' `rope_parameters` of the file: plain, or YaRN with DeepSeek's `mscale` keys.
fn rope_parameters(g: &GgufFile) -> Result<Value, ModelError> {
    let a = crate::family::deepseek::GGUF_ARCH;
    let k = |s: &str| format!("{a}.{s}");
    let theta = g.positive_float(&k("rope.freq_base"))?.unwrap_or(10000.0);
    let kind = g
        .string(&k("rope.scaling.type"))?
        .map(str::to_ascii_lowercase);
    match kind.as_deref() {
        None | Some("none") => Ok(json!({"rope_type": "default", "rope_theta": theta})),
        Some("yarn") => {
            let req = |key: &str| -> Result<f64, ModelError> {
                g.positive_float(&k(key))?
                    .ok_or_else(|| g.err(format!("missing metadata key '{}'", k(key))))
            };
            let factor = req("rope.scaling.factor")?;
            let original = g.req_count(&k("rope.scaling.original_context_length"))?;
            // convert_hf_to_gguf.py stores 0.1 · mscale_all_dim, and llama.cpp takes `mscale`
            // to equal it; without it llama.cpp scales the scores in a way transformers does not.
            let log_mul = g.float(&k("rope.scaling.yarn_log_multiplier"))?.ok_or_else(|| {
                g.err(format!(
                    "YaRN without '{}': llama.cpp then scales the attention scores by its own mscale, which transformers' DeepSeek does not",
                    k("rope.scaling.yarn_log_multiplier")
                ))
            })?;
            let all_dim = log_mul / 0.1;
            let beta = |key: &str, default: f64| -> Result<f64, ModelError> {
                Ok(g.float(&k(key))?.unwrap_or(default))
            };
            Ok(json!({
                "rope_type": "yarn",
                "rope_theta": theta,
                "factor": factor,
                "original_max_position_embeddings": original,
                "beta_fast": beta("rope.scaling.yarn_beta_fast", 32.0)?,
                "beta_slow": beta("rope.scaling.yarn_beta_slow", 1.0)?,
                "mscale": all_dim,
                "mscale_all_dim": all_dim,
            }))
        }
        Some(other) => Err(g.err(format!(
            "unsupported rope scaling type '{other}' ({}): deepseek2 files are read with none or yarn",
            k("rope.scaling.type")
        ))),
    }
}
