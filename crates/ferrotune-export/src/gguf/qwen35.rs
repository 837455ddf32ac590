//! Qwen3.5 (dense and MoE) and Qwen3-Next as llama.cpp's `qwen35`, `qwen35moe` and `qwen3next`
//! files, as its `convert_hf_to_gguf.py` writes them (`Qwen3_5TextModel`,
//! `Qwen3_5MoeTextModel`, `Qwen3NextModel`): zero-centred norms stored as `1 + w` (not the
//! DeltaNet's gated norm), `A_log` as `ssm_a = -exp(A_log)`, `dt_bias` as `ssm_dt.bias`, the
//! depthwise conv squeezed, Qwen3.5's DeltaNet value heads moved from transformers' grouped order
//! to llama.cpp's tiled one (when there are more value than key heads), Qwen3-Next's fused
//! `in_proj_qkvz` split into `attn_qkv` and `attn_gate`, experts stacked. The names and what is
//! done to each are the family's ([`ferrotune_models::family::qwen3_5`]).
//!
//! llama.cpp fixes what the file cannot say: Qwen3-Next's every layer sparse with its top-k
//! weights renormalized (other configs are refused), no rope scaling.

use std::path::Path;

use anyhow::{bail, Result};
use ferrotune_models::config::RopeScaling;
use ferrotune_models::family::qwen3_5::{
    gguf_arch_of, tile_v_heads, GgufTensor, GgufVHeads, GgufValues, GGUF_ARCH_DENSE,
    GGUF_ARCH_NEXT, GGUF_LAYER_TENSORS, GGUF_TOP_TENSORS,
};
use ferrotune_models::ModelConfig;
use serde_json::Value;

use super::*;

/// `ssm_a`: what the converter stores of `A_log`.
fn neg_exp(x: f32) -> f32 {
    -x.exp()
}

/// `ssm_a` of an f16 `A_log`, which the converter computes in f16.
fn neg_exp_f16(x: f32) -> f32 {
    f16_round(neg_exp(x))
}

/// A zero-centred norm's `1 + w`.
fn plus_one(x: f32) -> f32 {
    x + 1.0
}

/// `1 + w` of an f16 weight, which the converter computes in f16.
fn plus_one_f16(x: f32) -> f32 {
    f16_round(plus_one(x))
}

/// `x` rounded to the nearest f16 (as torch's f16 arithmetic on the CPU rounds its f32 result).
fn f16_round(x: f32) -> f32 {
    half::f16::from_f32(x).to_f32()
}

/// Writes the Qwen3.5 / Qwen3-Next checkpoint `config` / `weights` of `model_dir` as its
/// llama.cpp architecture's GGUF.
pub(super) fn export(
    model_dir: &Path,
    out: &Path,
    outtype: OutType,
    config: &ModelConfig,
    weights: &Weights,
) -> Result<GgufExport> {
    let Some(arch) = gguf_arch_of(&config.model_type) else {
        bail!(
            "{}: not a Qwen3.5 or Qwen3-Next checkpoint",
            config.model_type
        );
    };
    let Some(dn) = &config.delta_net else {
        bail!("not a Qwen3.5 or Qwen3-Next checkpoint (no linear attention)");
    };
    let next = arch == GGUF_ARCH_NEXT;
    if !matches!(config.rope.scaling, RopeScaling::Default) {
        bail!(
            "GGUF export of {} writes plain RoPE, not {:?}",
            config.model_type,
            config.rope.scaling
        );
    }
    if let Some(moe) = &config.moe {
        if next && !(moe.norm_topk_prob && moe.sparse_layers.iter().all(|&s| s)) {
            bail!(
                "llama.cpp's '{arch}' makes every layer sparse and renormalizes the top-k \
                 weights: a checkpoint with dense layers (`mlp_only_layers`, \
                 `decoder_sparse_step`) or `norm_topk_prob` false would compute something else"
            );
        }
    } else if arch != GGUF_ARCH_DENSE {
        bail!("{}: a mixture of experts is expected", config.model_type);
    }
    let outtype = resolve_outtype(outtype, weights, false)?;
    let (kh, vh, dk, dv) = (
        dn.key_heads,
        dn.value_heads,
        dn.key_head_dim,
        dn.value_head_dim,
    );
    // Qwen3.5's converter tiles the value heads; Qwen3-Next's keeps them grouped.
    let reorder = !next && kh != vh;
    let qk = 2 * kh * dk;
    let mut notes = Vec::new();
    if dk != dv {
        // llama.cpp 0.3.36's loader makes the DeltaNet's value heads as wide as its key heads
        // (`ssm.state_size`); released Qwen3.5 / Qwen3-Next checkpoints have them equal.
        notes.push(format!(
            "linear_key_head_dim {dk} is not linear_value_head_dim {dv}: llama.cpp sizes the              DeltaNet's value heads by the key head size and will not load this file"
        ));
    }
    let listed = weights.list();
    let mut plan = Vec::new();
    let mut skipped = Vec::new();
    let dims = |s: &[usize]| s.iter().rev().map(|&d| d as u64).collect::<Vec<_>>();
    let experts = config.moe.as_ref().map_or(0, |m| m.num_experts);
    let mut stacked_layers = Vec::new();
    // A multimodal checkpoint's text model is under `model.language_model.`.
    let text = if listed
        .iter()
        .any(|(_, n, _)| n.starts_with("model.language_model."))
    {
        "model.language_model."
    } else {
        "model."
    };
    let (mut vision, mut mtp) = (false, false);
    for (file, stored, shape) in &listed {
        let file = *file;
        if stored.starts_with("model.visual.") {
            vision = true;
            continue;
        }
        if stored.starts_with("mtp.") || stored.starts_with("model.mtp.") {
            mtp = true;
            continue;
        }
        // The HF name the family's table knows, and the stored one the values come from.
        let hf_name = match stored.strip_prefix(text) {
            Some(rest) => format!("model.{rest}"),
            None => stored.clone(),
        };
        let (name, stored) = (hf_name.as_str(), stored.as_str());
        if name == "lm_head.weight" && config.tie_word_embeddings {
            continue;
        }
        if let Some(t) = GGUF_TOP_TENSORS.iter().find(|t| t.hf == name) {
            plan.push(planned(
                weights,
                t,
                t.gguf.to_string(),
                file,
                stored,
                shape,
                outtype,
                None,
            ));
            continue;
        }
        let Some((layer, module)) = name
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(l, m)| Some((l.parse::<usize>().ok()?, m)))
        else {
            skipped.push(name.to_string());
            continue;
        };
        let blk = |part: &str| format!("blk.{layer}.{part}");
        if let Some(rest) = module.strip_prefix("mlp.experts.") {
            if experts == 0 {
                skipped.push(name.to_string());
                continue;
            }
            if !stacked_layers.contains(&layer) {
                stacked_layers.push(layer);
                stack_experts(&mut plan, &listed, text, layer, experts, outtype)?;
            }
            let known = matches!(rest, "gate_up_proj" | "down_proj")
                || rest.split_once('.').is_some_and(|(x, w)| {
                    x.parse::<usize>().is_ok_and(|x| x < experts)
                        && matches!(
                            w,
                            "gate_proj.weight" | "up_proj.weight" | "down_proj.weight"
                        )
                });
            if !known {
                skipped.push(name.to_string());
            }
            continue;
        }
        if next && module == "linear_attn.in_proj_qkvz.weight" {
            let [rows, h] = shape[..] else {
                bail!("{name} has shape {shape:?}, not [rows, hidden]");
            };
            let per_k = vh / kh * dv;
            let group = 2 * dk + 2 * per_k;
            if rows != kh * group {
                bail!("{name} has shape {shape:?}, not [{}, hidden]", kh * group);
            }
            // Per key head: q, k, v, z; the converter gathers all heads' q, then k, v (and z).
            let rows_of = |from: usize, len: usize| -> Vec<usize> {
                (0..kh)
                    .flat_map(|k| (0..len).map(move |r| k * group + from + r))
                    .collect()
            };
            let mut qkv = rows_of(0, dk);
            qkv.extend(rows_of(dk, dk));
            qkv.extend(rows_of(2 * dk, per_k));
            let z = rows_of(2 * dk + per_k, per_k);
            for (part, rows) in [("attn_qkv.weight", qkv), ("attn_gate.weight", z)] {
                let index = rows
                    .iter()
                    .flat_map(|&r| (r * h..(r + 1) * h).collect::<Vec<_>>())
                    .collect::<Vec<_>>();
                let n = rows.len();
                plan.push(Planned {
                    ty: storage_type(part, &[n, h], outtype),
                    name: blk(part),
                    dims: dims(&[n, h]),
                    source: Source::Gather {
                        file,
                        name: stored.to_string(),
                        index,
                    },
                });
            }
            continue;
        }
        let Some(t) = GGUF_LAYER_TENSORS.iter().find(|t| t.hf == module) else {
            skipped.push(name.to_string());
            continue;
        };
        let perm = if reorder {
            match t.v_heads {
                GgufVHeads::No => None,
                GgufVHeads::OnePerHead => Some(tile_v_heads(kh, vh, 1)),
                GgufVHeads::Rows => Some(tile_v_heads(kh, vh, dv)),
                GgufVHeads::RowsAfterQk => {
                    let mut p: Vec<usize> = (0..qk).collect();
                    p.extend(tile_v_heads(kh, vh, dv).into_iter().map(|i| qk + i));
                    Some(p)
                }
                GgufVHeads::Columns => {
                    // Every row's columns tiled.
                    let [rows, cols] = shape[..] else {
                        bail!("{name} has shape {shape:?}, not a matrix");
                    };
                    let p = tile_v_heads(kh, vh, dv);
                    if p.len() != cols {
                        bail!("{name} has shape {shape:?}, not [hidden, {}]", p.len());
                    }
                    let index = (0..rows)
                        .flat_map(|r| p.iter().map(move |&c| r * cols + c))
                        .collect();
                    plan.push(planned(
                        weights,
                        t,
                        blk(t.gguf),
                        file,
                        stored,
                        shape,
                        outtype,
                        Some(index),
                    ));
                    continue;
                }
            }
        } else {
            None
        };
        // Rows → flat indices.
        let index = perm.map(|rows| {
            let width: usize = shape.iter().skip(1).product();
            rows.iter()
                .flat_map(|&r| r * width..(r + 1) * width)
                .collect::<Vec<_>>()
        });
        if let Some(index) = &index {
            if index.len() != shape.iter().product::<usize>() {
                bail!("{name} has shape {shape:?}, not its DeltaNet heads' size");
            }
        }
        plan.push(planned(
            weights,
            t,
            blk(t.gguf),
            file,
            stored,
            shape,
            outtype,
            index,
        ));
    }
    if vision {
        notes.push(
            "the vision tower is left out (llama.cpp's converter writes it apart, with --mmproj)"
                .into(),
        );
    }
    if mtp {
        notes.push(
            "the multi-token-prediction layers are left out (as llama.cpp's converter with \
             --no-mtp)"
                .into(),
        );
    }
    refuse_unplaced(model_dir, arch, &skipped)?;
    let shape = HeaderShape {
        layers: config.num_hidden_layers,
        heads: config.num_attention_heads,
        kv_heads: config.num_key_value_heads,
    };
    let mut file = Opened::new(model_dir, arch, outtype.file_type(), config, shape, notes)?;
    let meta = &mut file.meta;
    let k = |key: &str| format!("{arch}.{key}");
    meta.f32(
        &k("attention.layer_norm_rms_epsilon"),
        config.rms_norm_eps as f32,
    );
    if let Some(moe) = &config.moe {
        meta.u32(&k("expert_count"), moe.num_experts as u32);
        meta.u32(&k("expert_used_count"), moe.top_k as u32);
    }
    meta.u32(&k("attention.key_length"), config.head_dim as u32);
    meta.u32(&k("attention.value_length"), config.head_dim as u32);
    if let Some(moe) = &config.moe {
        meta.u32(
            &k("expert_feed_forward_length"),
            moe.expert_intermediate_size as u32,
        );
        if let Some(s) = moe.shared_expert_intermediate_size {
            meta.u32(&k("expert_shared_feed_forward_length"), s as u32);
        }
    }
    meta.u32(&k("ssm.conv_kernel"), dn.conv_kernel as u32);
    meta.u32(&k("ssm.state_size"), dk as u32);
    meta.u32(&k("ssm.group_count"), kh as u32);
    meta.u32(&k("ssm.time_step_rank"), vh as u32);
    meta.u32(&k("ssm.inner_size"), (dv * vh) as u32);
    let raw = |key: &str| config.raw.get(key).filter(|v| !v.is_null());
    // The converter writes the layer kinds only when the config lists them.
    if raw("layer_types").is_some() {
        meta.bools(&k("attention.recurrent_layers"), &dn.layers);
    }
    let interval = raw("full_attention_interval")
        .and_then(Value::as_u64)
        .unwrap_or(4);
    meta.u32(&k("full_attention_interval"), interval as u32);
    let rotary = (config.head_dim as f64 * config.rope.partial_rotary_factor) as u32;
    meta.u32(&k("rope.dimension_count"), rotary);
    let mrope = ["rope_parameters", "rope_scaling"]
        .iter()
        .filter_map(|key| raw(key))
        .find_map(|r| r.get("mrope_section"))
        .and_then(Value::as_array)
        .map(|s| {
            s.iter()
                .filter_map(Value::as_i64)
                .map(|x| x as i32)
                .collect::<Vec<_>>()
        });
    match mrope {
        Some(mut s) => {
            s.resize(s.len().max(4), 0);
            s.truncate(4);
            meta.i32s(&k("rope.dimension_sections"), &s);
        }
        // Qwen3.5's interleaved multimodal rope: transformers' default sections.
        None if !next => meta.i32s(&k("rope.dimension_sections"), &[11, 11, 10, 0]),
        None => {}
    }
    // llama-quantize's k-quant mixes, as its 0.3.36 types these architectures' tensors.
    let mix = MixModel {
        experts,
        seventy_b: false,
        fused_as_value: true,
    };
    file.finish(out, plan, outtype, mix, config, weights)
}

/// The planned tensor `gguf` of the HF tensor `name` (`shape`) as the family's table says: its
/// values changed as the converter changes them, picked by `index` when given (the value heads
/// reordered).
#[allow(clippy::too_many_arguments)]
fn planned(
    weights: &Weights,
    t: &GgufTensor,
    gguf: String,
    file: usize,
    name: &str,
    shape: &[usize],
    outtype: OutType,
    index: Option<Vec<usize>>,
) -> Planned {
    // `conv1d.weight` `[channels, 1, kernel]` is stored `[channels, kernel]`.
    let stored: Vec<usize> = if t.values == GgufValues::Squeeze {
        shape.iter().copied().filter(|&d| d != 1).collect()
    } else {
        shape.to_vec()
    };
    // The converter keeps the conv, `ssm_a` and `ssm_dt.bias` f32.
    let ty = if t.values == GgufValues::Squeeze || !gguf.ends_with(".weight") {
        GgmlType::F32
    } else {
        storage_type(&gguf, &stored, outtype)
    };
    let numel: usize = shape.iter().product();
    let f16 = weights.is_f16(file, name);
    let name = name.to_string();
    let source = match (t.values, index) {
        (GgufValues::NegExp, index) => Source::Mapped {
            file,
            name,
            index: index.unwrap_or_else(|| (0..numel).collect()),
            map: if f16 { neg_exp_f16 } else { neg_exp },
        },
        (GgufValues::PlusOne, index) => Source::Mapped {
            file,
            name,
            index: index.unwrap_or_else(|| (0..numel).collect()),
            map: if f16 { plus_one_f16 } else { plus_one },
        },
        (_, Some(index)) => Source::Gather { file, name, index },
        (_, None) => Source::Hf {
            file,
            name,
            rows: None,
            plus_one: false,
        },
    };
    Planned {
        name: gguf,
        dims: stored.iter().rev().map(|&d| d as u64).collect(),
        ty,
        source,
    }
}

/// Layer `layer`'s experts as llama.cpp's stacked `ffn_{down,gate,up}_exps` (the converter's
/// order), from transformers 4.x's per-expert tensors or 5.x's fused `gate_up_proj` (gate rows
/// first) and `down_proj`.
fn stack_experts(
    plan: &mut Vec<Planned>,
    listed: &[(usize, String, Vec<usize>)],
    text: &str,
    layer: usize,
    experts: usize,
    outtype: OutType,
) -> Result<()> {
    let p = format!("{text}layers.{layer}.mlp.experts.");
    let find = |n: &str| {
        listed
            .iter()
            .find(|(_, name, _)| *name == format!("{p}{n}"))
    };
    let blk = |part: &str| format!("blk.{layer}.{part}");
    if let Some((file, name, shape)) = find("gate_up_proj") {
        let [e, two_i, h] = shape[..] else {
            bail!("{name} has shape {shape:?}, not [experts, 2 · inter, hidden]");
        };
        if e != experts || two_i % 2 != 0 {
            bail!("{name} has shape {shape:?}, not [{experts}, 2 · inter, hidden]");
        }
        let Some((dfile, dname, dshape)) = find("down_proj") else {
            bail!("{name} comes without its down_proj");
        };
        let i = two_i / 2;
        plan.push(Planned {
            name: blk("ffn_down_exps.weight"),
            dims: dshape.iter().rev().map(|&d| d as u64).collect(),
            ty: storage_type("ffn_down_exps.weight", dshape, outtype),
            source: Source::Hf {
                file: *dfile,
                name: dname.clone(),
                rows: None,
                plus_one: false,
            },
        });
        for (part, half) in [("ffn_gate_exps.weight", 0), ("ffn_up_exps.weight", 1)] {
            let index = (0..e)
                .flat_map(|x| {
                    let start = (x * two_i + half * i) * h;
                    start..start + i * h
                })
                .collect();
            plan.push(Planned {
                name: blk(part),
                dims: vec![h as u64, i as u64, e as u64],
                ty: storage_type(part, &[e, i, h], outtype),
                source: Source::Gather {
                    file: *file,
                    name: name.clone(),
                    index,
                },
            });
        }
        return Ok(());
    }
    for (w, part) in [
        ("down_proj", "ffn_down_exps.weight"),
        ("gate_proj", "ffn_gate_exps.weight"),
        ("up_proj", "ffn_up_exps.weight"),
    ] {
        let mut parts = Vec::new();
        let mut shape0: Option<Vec<usize>> = None;
        for x in 0..experts {
            let n = format!("{x}.{w}.weight");
            let Some((file, name, shape)) = find(&n) else {
                bail!("{p}{n} is missing: llama.cpp stacks all {experts} experts");
            };
            if shape0.as_ref().is_some_and(|s| s != shape) {
                bail!("{name} has shape {shape:?}, unlike expert 0's");
            }
            shape0 = Some(shape.clone());
            parts.push((*file, name.clone()));
        }
        let shape = shape0.unwrap_or_default();
        let full: Vec<usize> = std::iter::once(experts).chain(shape).collect();
        plan.push(Planned {
            name: blk(part),
            dims: full.iter().rev().map(|&d| d as u64).collect(),
            ty: storage_type(part, &full, outtype),
            source: Source::Stacked(parts),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On an f16 checkpoint the converter's `1 + w` and `-exp(A_log)` are f16 values (torch
    /// computes in the tensor's type); on others, f32's.
    #[test]
    fn f16_weights_are_changed_in_f16() {
        let w = 0.123_456_79_f32;
        assert_eq!(plus_one(w), 1.123_456_8);
        assert_eq!(plus_one_f16(w), 1.123_046_9);
        assert_eq!(neg_exp_f16(0.5), -1.648_437_5);
        assert_ne!(neg_exp(0.5), neg_exp_f16(0.5));
    }
}
