//! llama.cpp's `qwen35`, `qwen35moe` and `qwen3next` files read as transformers' `qwen3_5_text`,
//! `qwen3_5_moe_text` and `qwen3_next` checkpoints, undoing what convert_hf_to_gguf.py changed:
//! norms stored as `1 + w`, `ssm_a = -exp(A_log)`, the squeezed conv, Qwen3.5's value heads tiled
//! (put back in transformers' grouped order), Qwen3-Next's `in_proj_qkvz` split into `attn_qkv` /
//! `attn_gate` (fused again per key head), experts stacked. The names and what is done to each
//! are the family's ([`crate::family::qwen3_5`]).
//!
//! The config is what llama.cpp computes: Qwen3-Next's every layer sparse with renormalized top-k
//! weights, plain rope over `rope.dimension_count` dimensions (Qwen3.5's multimodal sections are
//! the same rotation for text). Multi-token-prediction layers (`nextn_predict_layers`) are left
//! out.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use serde_json::{json, Map, Value};

use crate::config::ModelConfig;
use crate::error::ModelError;
use crate::family::qwen3_5::{
    invert, tile_v_heads, GgufVHeads, GgufValues, GGUF_ARCHS, GGUF_ARCH_DENSE, GGUF_ARCH_NEXT,
    GGUF_LAYER_TENSORS, GGUF_TOP_TENSORS,
};

use super::{GgufFile, PackedWeights};

/// The DeltaNet's sizes, as the file's `ssm.*` keys give them.
#[derive(Clone, Copy)]
struct Heads {
    key_heads: usize,
    value_heads: usize,
    key_dim: usize,
    value_dim: usize,
}

/// Reads a `qwen35` / `qwen35moe` / `qwen3next` file: its config, and its tensors in
/// transformers' names, dequantized to `dtype` on `device`.
pub(super) fn read(
    g: &mut GgufFile,
    arch: &str,
    dtype: DType,
    device: &Device,
) -> Result<(ModelConfig, HashMap<String, Tensor>, PackedWeights), ModelError> {
    let (config_json, layers, heads, experts) = config_json(g, arch, dtype)?;
    let config = ModelConfig::from_hf_json(&config_json)
        .map_err(|msg| g.err(format!("the metadata gives an invalid model config: {msg}")))?;
    let next = arch == GGUF_ARCH_NEXT;
    let reorder = !next && heads.key_heads != heads.value_heads;
    let mut names: Vec<String> = g.content.tensor_infos.keys().cloned().collect();
    names.sort();
    for name in &names {
        g.check_tensor_data(name)?;
    }
    let mut tensors = HashMap::with_capacity(names.len());
    // Qwen3-Next: per layer, `attn_qkv` and `attn_gate`, fused once both are read.
    let mut qkvz: HashMap<usize, [Option<Tensor>; 2]> = HashMap::new();
    for name in &names {
        let (layer, part) = match name.strip_prefix("blk.").and_then(|r| r.split_once('.')) {
            Some((l, part)) => match l.parse::<usize>() {
                Ok(l) => (Some(l), part),
                Err(_) => {
                    return Err(g.tensor_err(name, format!("is not a tensor of a {arch} model")))
                }
            },
            None => (None, name.as_str()),
        };
        // Multi-token-prediction layers, past the model's own.
        if layer.is_some_and(|l| l >= layers) {
            continue;
        }
        let t = g.dequantize(name)?;
        crate::weight_checks::finite(g.path, name, &t, Some(DType::F32))?;
        let tensor_err = |e: candle_core::Error| g.tensor_err(name, e);
        let Some(layer) = layer else {
            let Some(entry) = GGUF_TOP_TENSORS.iter().find(|e| e.gguf == part) else {
                return Err(g.tensor_err(name, format!("is not a tensor of a {arch} model")));
            };
            let t = match entry.values {
                GgufValues::PlusOne => t.affine(1.0, -1.0).map_err(tensor_err)?,
                _ => t,
            };
            tensors.insert(entry.hf.to_string(), g.convert(name, t, dtype, device)?);
            continue;
        };
        let p = format!("model.layers.{layer}.");
        if let Some(w) = part
            .strip_suffix("_exps.weight")
            .and_then(|w| w.strip_prefix("ffn_"))
            .filter(|w| matches!(*w, "gate" | "up" | "down"))
        {
            if t.rank() != 3 || t.dims()[0] != experts {
                return Err(g.tensor_err(name, format!("does not hold {experts} experts")));
            }
            for x in 0..experts {
                let e = t.get(x).map_err(tensor_err)?;
                tensors.insert(
                    format!("{p}mlp.experts.{x}.{w}_proj.weight"),
                    g.convert(name, e, dtype, device)?,
                );
            }
            continue;
        }
        if next && matches!(part, "attn_qkv.weight" | "attn_gate.weight") {
            let slot = usize::from(part == "attn_gate.weight");
            qkvz.entry(layer).or_default()[slot] = Some(t);
            continue;
        }
        let Some(entry) = GGUF_LAYER_TENSORS.iter().find(|e| e.gguf == part) else {
            return Err(g.tensor_err(name, format!("is not a tensor of a {arch} model")));
        };
        let t = match entry.values {
            GgufValues::Same => t,
            GgufValues::PlusOne => t.affine(1.0, -1.0).map_err(tensor_err)?,
            GgufValues::NegExp => t.neg().and_then(|t| t.log()).map_err(tensor_err)?,
            GgufValues::Squeeze => {
                let (c, k) = t.dims2().map_err(tensor_err)?;
                t.reshape((c, 1, k)).map_err(tensor_err)?
            }
        };
        let t = if reorder {
            untile(&t, entry.v_heads, heads).map_err(tensor_err)?
        } else {
            t
        };
        tensors.insert(
            format!("{p}{}", entry.hf),
            g.convert(name, t, dtype, device)?,
        );
    }
    for (layer, [qkv, z]) in qkvz {
        let name = format!("blk.{layer}.attn_qkv.weight");
        let (Some(qkv), Some(z)) = (qkv, z) else {
            return Err(g.tensor_err(
                &name,
                "comes without its attn_gate (or the other way round)",
            ));
        };
        let fused = fuse_qkvz(&qkv, &z, heads).map_err(|e| g.tensor_err(&name, e))?;
        tensors.insert(
            format!("model.layers.{layer}.linear_attn.in_proj_qkvz.weight"),
            g.convert(&name, fused, dtype, device)?,
        );
    }
    Ok((config, tensors, PackedWeights::new()))
}

/// Puts Qwen3.5's tiled value heads back in transformers' grouped order, along the dimension
/// the family's table names.
fn untile(t: &Tensor, v_heads: GgufVHeads, h: Heads) -> candle_core::Result<Tensor> {
    let (kh, vh) = (h.key_heads, h.value_heads);
    let Some(qk) = kh.checked_mul(h.key_dim).and_then(|x| x.checked_mul(2)) else {
        candle_core::bail!("the metadata's DeltaNet sizes overflow");
    };
    // The tensor's size along the reordered dimension, checked before any permutation is built
    // from the metadata's sizes.
    let (want, dim) = match v_heads {
        GgufVHeads::No => return Ok(t.clone()),
        GgufVHeads::OnePerHead => (Some(vh), 0),
        GgufVHeads::Rows => (vh.checked_mul(h.value_dim), 0),
        GgufVHeads::Columns => (vh.checked_mul(h.value_dim), 1),
        GgufVHeads::RowsAfterQk => (
            vh.checked_mul(h.value_dim).and_then(|v| v.checked_add(qk)),
            0,
        ),
    };
    if want.is_none() || t.dims().get(dim) != want.as_ref() {
        candle_core::bail!(
            "has shape {:?}, not {want:?} along dimension {dim} ({kh} key and {vh} value heads)",
            t.dims()
        );
    }
    let (perm, dim) = match v_heads {
        GgufVHeads::No => return Ok(t.clone()),
        GgufVHeads::OnePerHead => (invert(&tile_v_heads(kh, vh, 1)), 0),
        GgufVHeads::Rows => (invert(&tile_v_heads(kh, vh, h.value_dim)), 0),
        GgufVHeads::Columns => (invert(&tile_v_heads(kh, vh, h.value_dim)), 1),
        GgufVHeads::RowsAfterQk => {
            let mut p: Vec<usize> = (0..qk).collect();
            p.extend(
                invert(&tile_v_heads(kh, vh, h.value_dim))
                    .into_iter()
                    .map(|i| qk + i),
            );
            (p, 0)
        }
    };
    let index: Vec<u32> = perm.iter().map(|&i| i as u32).collect();
    let index = Tensor::new(index, t.device())?;
    t.index_select(&index, dim)?.contiguous()
}

/// Qwen3-Next's `in_proj_qkvz` (per key head: its q, k, v and z rows) from llama.cpp's
/// `attn_qkv` (every head's q, then k, then v) and `attn_gate` (every head's z).
fn fuse_qkvz(qkv: &Tensor, z: &Tensor, h: Heads) -> candle_core::Result<Tensor> {
    let (kh, dk) = (h.key_heads, h.key_dim);
    // The metadata's sizes, checked against the tensors' before they size anything.
    let per_k = (h.value_heads / kh).checked_mul(h.value_dim);
    let v_rows = per_k.and_then(|p| p.checked_mul(kh));
    let qk = kh.checked_mul(dk).and_then(|x| x.checked_mul(2));
    let (rows, _) = qkv.dims2()?;
    let (Some(per_k), Some(v_rows), Some(qk)) = (per_k, v_rows, qk) else {
        candle_core::bail!("the metadata's DeltaNet sizes overflow");
    };
    if qk.checked_add(v_rows) != Some(rows) || z.dims2()?.0 != v_rows {
        candle_core::bail!(
            "has shape {:?} and attn_gate {:?}: not the DeltaNet's heads",
            qkv.dims(),
            z.dims()
        );
    }
    let all = Tensor::cat(&[qkv, z], 0)?;
    let z0 = rows;
    let index: Vec<u32> = (0..kh)
        .flat_map(|k| {
            let q = (0..dk).map(move |r| k * dk + r);
            let key = (0..dk).map(move |r| kh * dk + k * dk + r);
            let v = (0..per_k).map(move |r| qk + k * per_k + r);
            let zz = (0..per_k).map(move |r| z0 + k * per_k + r);
            q.chain(key).chain(v).chain(zz)
        })
        .map(|i| i as u32)
        .collect();
    let index = Tensor::new(index, all.device())?;
    all.index_select(&index, 0)?.contiguous()
}

/// The transformers config a file's metadata describes, with its layer count (without
/// multi-token-prediction layers), DeltaNet heads and expert count (0: dense).
fn config_json(
    g: &GgufFile,
    arch: &str,
    dtype: DType,
) -> Result<(Value, usize, Heads, usize), ModelError> {
    let k = |s: &str| format!("{arch}.{s}");
    let blocks = g.req_count(&k("block_count"))?;
    let mtp = g.uint(&k("nextn_predict_layers"))?.unwrap_or(0) as usize;
    let Some(layers) = blocks.checked_sub(mtp).filter(|&l| l > 0) else {
        return Err(g.err(format!(
            "'{}' {mtp} leaves no layer of the {blocks} blocks",
            k("nextn_predict_layers")
        )));
    };
    g.check_layers(arch, layers)?;
    let head_dim = g.req_count(&k("attention.key_length"))?;
    let rotary = g.req_count(&k("rope.dimension_count"))?;
    let value_heads = g.req_count(&k("ssm.time_step_rank"))?;
    let inner = g.req_count(&k("ssm.inner_size"))?;
    if !inner.is_multiple_of(value_heads) {
        return Err(g.err(format!(
            "'{}' {inner} is not a multiple of '{}' {value_heads}",
            k("ssm.inner_size"),
            k("ssm.time_step_rank")
        )));
    }
    let heads = Heads {
        key_heads: g.req_count(&k("ssm.group_count"))?,
        value_heads,
        key_dim: g.req_count(&k("ssm.state_size"))?,
        value_dim: inner / value_heads,
    };
    let layer_types: Vec<&str> = match g.meta(&k("attention.recurrent_layers")) {
        Some(candle_core::quantized::gguf_file::Value::Array(a)) => {
            if a.len() < layers {
                return Err(g.err(format!(
                    "'{}' lists {} layers, the model has {layers}",
                    k("attention.recurrent_layers"),
                    a.len()
                )));
            }
            a.iter()
                .take(layers)
                .map(|v| match v.to_bool() {
                    Ok(true) => Ok("linear_attention"),
                    Ok(false) => Ok("full_attention"),
                    Err(_) => Err(g.err(format!(
                        "'{}' must list booleans",
                        k("attention.recurrent_layers")
                    ))),
                })
                .collect::<Result<_, _>>()?
        }
        Some(_) => {
            return Err(g.err(format!(
                "'{}' must be an array",
                k("attention.recurrent_layers")
            )))
        }
        None => {
            let interval = g.uint(&k("full_attention_interval"))?.unwrap_or(4).max(1) as usize;
            (0..layers)
                .map(|i| {
                    if (i + 1) % interval != 0 {
                        "linear_attention"
                    } else {
                        "full_attention"
                    }
                })
                .collect()
        }
    };
    let vocab = g.vocab_or_embedding_rows(arch)?;
    if g.meta(&k("rope.scaling.type")).is_some() {
        return Err(g.err(format!(
            "'{}' is set: {arch} files are read with plain rope",
            k("rope.scaling.type")
        )));
    }
    let eps = g.req_rms_eps(arch)?;
    let theta = g.positive_float(&k("rope.freq_base"))?.unwrap_or(10000.0);
    let Some((_, model_type, class)) = GGUF_ARCHS.iter().find(|(a, _, _)| *a == arch) else {
        return Err(g.err(format!("'{arch}' is not a Qwen3.5 architecture")));
    };
    let mut c = Map::new();
    c.insert("architectures".into(), json!([class]));
    c.insert("model_type".into(), json!(model_type));
    c.insert("vocab_size".into(), json!(vocab));
    c.insert(
        "hidden_size".into(),
        json!(g.req_count(&k("embedding_length"))?),
    );
    if let Some(ff) = g.uint(&k("feed_forward_length"))? {
        c.insert("intermediate_size".into(), json!(ff));
    }
    c.insert("num_hidden_layers".into(), json!(layers));
    c.insert(
        "num_attention_heads".into(),
        json!(g.req_count(&k("attention.head_count"))?),
    );
    c.insert(
        "num_key_value_heads".into(),
        json!(g.req_count(&k("attention.head_count_kv"))?),
    );
    c.insert("head_dim".into(), json!(head_dim));
    c.insert(
        "max_position_embeddings".into(),
        json!(g.req_count(&k("context_length"))?),
    );
    c.insert("rms_norm_eps".into(), json!(eps));
    c.insert(
        "rope_parameters".into(),
        json!({
            "rope_type": "default",
            "rope_theta": theta,
            "partial_rotary_factor": rotary as f64 / head_dim as f64,
        }),
    );
    c.insert("layer_types".into(), json!(layer_types));
    c.insert(
        "linear_conv_kernel_dim".into(),
        json!(g.req_count(&k("ssm.conv_kernel"))?),
    );
    c.insert("linear_key_head_dim".into(), json!(heads.key_dim));
    c.insert("linear_num_key_heads".into(), json!(heads.key_heads));
    c.insert("linear_num_value_heads".into(), json!(heads.value_heads));
    c.insert("linear_value_head_dim".into(), json!(heads.value_dim));
    c.insert("attention_bias".into(), json!(false));
    let experts = if arch == GGUF_ARCH_DENSE {
        0
    } else {
        let experts = g.req_count(&k("expert_count"))?;
        c.insert("num_experts".into(), json!(experts));
        c.insert(
            "num_experts_per_tok".into(),
            json!(g.req_count(&k("expert_used_count"))?),
        );
        c.insert(
            "moe_intermediate_size".into(),
            json!(g.req_count(&k("expert_feed_forward_length"))?),
        );
        c.insert(
            "shared_expert_intermediate_size".into(),
            json!(g.req_count(&k("expert_shared_feed_forward_length"))?),
        );
        if arch == GGUF_ARCH_NEXT {
            // llama.cpp: every layer sparse, the top-k weights renormalized.
            c.insert("decoder_sparse_step".into(), json!(1));
            c.insert("mlp_only_layers".into(), json!([]));
            c.insert("norm_topk_prob".into(), json!(true));
        }
        experts
    };
    c.insert("tie_word_embeddings".into(), json!(g.head_tied()));
    g.insert_ids_dtype_name(&mut c, dtype)?;
    Ok((Value::Object(c), layers, heads, experts))
}
