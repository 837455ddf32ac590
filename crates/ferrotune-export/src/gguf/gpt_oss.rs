//! gpt-oss as llama.cpp's `gpt-oss` file, as its `convert_hf_to_gguf.py` writes one from float
//! experts: the fused, interleaved `gate_up_proj` split into `ffn_gate_exps` / `ffn_up_exps` and
//! transposed (their biases split too), `down_proj` transposed, the sinks as `attn_sinks`, the
//! router as `ffn_gate_inp`. The names are the family's ([`ferrotune_models::family::gpt_oss`]).
//!
//! OpenAI's MXFP4 experts (`mlp.experts.*_blocks` / `*_scales`, `quantization_config` mxfp4) are
//! written as the converter writes them: GGML type 39 MXFP4, repacked byte for byte (the same
//! scale bytes, the nibbles in ggml's order), whatever the float or Q8_0 outtype of the other
//! tensors; a k-quant mix dequantizes and requantizes them, as `llama-quantize
//! --allow-requantize` does from the f32 file.
//!
//! llama.cpp fixes what the file cannot say: the clamped SwiGLU's limit 7 and alpha 1.702 (other
//! values are refused) and even layers sliding (another pattern is refused). It rounds YaRN's
//! correction range, which gpt-oss's configs do not (`truncate` false): written with a note.

use std::path::Path;

use anyhow::{bail, Result};
use ferrotune_models::config::RopeScaling;
use ferrotune_models::family::gpt_oss::{GGUF_ARCH, GGUF_LAYER_TENSORS, GGUF_TOP_TENSORS};
use ferrotune_models::ModelConfig;

use super::*;

/// The type `llama-quantize --type MXFP4_MOE` gives a tensor of `shape` (PyTorch order) named
/// `gguf` (`llama_tensor_get_type`): the experts (3-D, more than one) MXFP4; every other matrix
/// Q8_0 (the output head too) but the router (`ffn_gate_inp`, never quantized), or F16 where its
/// rows are not whole blocks of 32; vectors F32.
fn mxfp4_moe_type(gguf: &str, shape: &[usize]) -> GgmlType {
    let cols = shape.last().copied().unwrap_or(0);
    if shape.len() < 2 || gguf.contains("ffn_gate_inp") || !gguf.ends_with("weight") {
        GgmlType::F32
    } else if shape.len() == 3 && shape[0] > 1 && cols.is_multiple_of(32) {
        GgmlType::Mxfp4
    } else if cols.is_multiple_of(32) {
        GgmlType::Q8_0
    } else {
        GgmlType::F16
    }
}

/// Writes the gpt-oss checkpoint `config` / `weights` of `model_dir` as a `gpt-oss` GGUF.
pub(super) fn export(
    model_dir: &Path,
    out: &Path,
    outtype: OutType,
    config: &ModelConfig,
    weights: &Weights,
) -> Result<GgufExport> {
    let Some(moe) = &config.gpt_oss_moe else {
        bail!("not a gpt-oss checkpoint");
    };
    if moe.limit != 7.0 || moe.alpha != 1.702 {
        bail!(
            "swiglu_limit {} / swiglu_alpha {}: llama.cpp's '{GGUF_ARCH}' fixes them at 7 and \
             1.702, so the GGUF would compute something else",
            moe.limit,
            moe.alpha
        );
    }
    let window = config
        .layer_sliding_windows
        .iter()
        .flatten()
        .next()
        .copied();
    let even_sliding = config
        .layer_sliding_windows
        .iter()
        .enumerate()
        .all(|(i, w)| (i % 2 == 0) == w.is_some() && (w.is_none() || *w == window));
    if !even_sliding {
        bail!(
            "the checkpoint's sliding-window layers are not llama.cpp's '{GGUF_ARCH}' pattern \
             (even layers sliding, one window)"
        );
    }
    let outtype = resolve_outtype(outtype, weights, true)?;
    let e = moe.num_experts;
    let listed = weights.list();
    let mut plan = Vec::new();
    let mut skipped = Vec::new();
    let dims = |s: &[usize]| s.iter().rev().map(|&d| d as u64).collect::<Vec<_>>();
    // Biases stay f32 whatever their rank (the experts' are `[experts, n]`), as the converter
    // writes them.
    let vector_or = |gguf: &str, shape: &[usize]| {
        if gguf.ends_with(".bias") {
            GgmlType::F32
        } else if outtype == OutType::Mxfp4Moe {
            mxfp4_moe_type(gguf, shape)
        } else {
            storage_type(gguf, shape, outtype)
        }
    };
    for (file, name, shape) in &listed {
        let (file, name) = (*file, name.as_str());
        if name == "lm_head.weight" && config.tie_word_embeddings {
            continue;
        }
        let hf = |gguf: String, shape: &[usize]| Planned {
            ty: vector_or(&gguf, shape),
            name: gguf,
            dims: dims(shape),
            source: Source::Hf {
                file,
                name: name.to_string(),
                rows: None,
                plus_one: false,
            },
        };
        let gather = |gguf: String, shape: &[usize], index: Vec<usize>| Planned {
            ty: vector_or(&gguf, shape),
            name: gguf,
            dims: dims(shape),
            source: Source::Gather {
                file,
                name: name.to_string(),
                index,
            },
        };
        if let Some((g, _)) = GGUF_TOP_TENSORS.iter().find(|(_, h)| *h == name) {
            plan.push(hf(g.to_string(), shape));
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
        match module {
            "mlp.experts.gate_up_proj" => {
                let [ee, h, two_i] = shape[..] else {
                    bail!("{name} has shape {shape:?}, not [experts, hidden, 2 · inter]");
                };
                if ee != e || two_i % 2 != 0 {
                    bail!("{name} has shape {shape:?}, not [{e}, hidden, 2 · inter]");
                }
                let i = two_i / 2;
                // `[experts, inter, hidden]`: column 2j (gate) or 2j + 1 (up) of each expert.
                for (part, half) in [("ffn_gate_exps.weight", 0), ("ffn_up_exps.weight", 1)] {
                    let index = (0..e)
                        .flat_map(|x| {
                            (0..i).flat_map(move |j| {
                                (0..h).map(move |c| (x * h + c) * two_i + 2 * j + half)
                            })
                        })
                        .collect();
                    plan.push(gather(blk(part), &[e, i, h], index));
                }
            }
            "mlp.experts.gate_up_proj_bias" => {
                let [ee, two_i] = shape[..] else {
                    bail!("{name} has shape {shape:?}, not [experts, 2 · inter]");
                };
                if ee != e || two_i % 2 != 0 {
                    bail!("{name} has shape {shape:?}, not [{e}, 2 · inter]");
                }
                let i = two_i / 2;
                for (part, half) in [("ffn_gate_exps.bias", 0), ("ffn_up_exps.bias", 1)] {
                    let index = (0..e)
                        .flat_map(|x| (0..i).map(move |j| x * two_i + 2 * j + half))
                        .collect();
                    plan.push(gather(blk(part), &[e, i], index));
                }
            }
            "mlp.experts.down_proj" => {
                let [ee, i, h] = shape[..] else {
                    bail!("{name} has shape {shape:?}, not [experts, inter, hidden]");
                };
                if ee != e {
                    bail!("{name} has shape {shape:?}, not [{e}, inter, hidden]");
                }
                // `[experts, hidden, inter]`: each expert transposed.
                let index = (0..e)
                    .flat_map(|x| {
                        (0..h).flat_map(move |c| (0..i).map(move |j| (x * i + j) * h + c))
                    })
                    .collect();
                plan.push(gather(blk("ffn_down_exps.weight"), &[e, h, i], index));
            }
            "mlp.experts.down_proj_bias" => plan.push(hf(blk("ffn_down_exps.bias"), shape)),
            // OpenAI's MXFP4 experts: written as MXFP4, repacked as the converter repacks them
            // (gate rows even, up rows odd); the scales go with their blocks.
            "mlp.experts.gate_up_proj_scales" | "mlp.experts.down_proj_scales" => {}
            "mlp.experts.gate_up_proj_blocks" | "mlp.experts.down_proj_blocks" => {
                let [ee, rows, groups, 16] = shape[..] else {
                    bail!("{name} has shape {shape:?}, not [experts, rows, groups, 16]");
                };
                let scales = name.replace("_blocks", "_scales");
                let Some((scales_file, _, _)) = listed.iter().find(|(_, n, _)| *n == scales) else {
                    bail!("{name} has no {scales} beside it");
                };
                let gate_up = module.starts_with("mlp.experts.gate_up");
                if ee != e || (gate_up && rows % 2 != 0) {
                    bail!("{name} has shape {shape:?}, not [{e}, rows, groups, 16]");
                }
                let parts: &[(&str, usize, usize)] = if gate_up {
                    &[("ffn_gate_exps.weight", 0, 2), ("ffn_up_exps.weight", 1, 2)]
                } else {
                    &[("ffn_down_exps.weight", 0, 1)]
                };
                for &(part, start, step) in parts {
                    plan.push(Planned {
                        name: blk(part),
                        dims: dims(&[e, rows / step, groups * 32]),
                        ty: GgmlType::Mxfp4,
                        source: Source::Mxfp4 {
                            blocks: (file, name.to_string()),
                            scales: (*scales_file, scales.clone()),
                            start,
                            step,
                        },
                    });
                }
            }
            module => match GGUF_LAYER_TENSORS.iter().find(|(_, h)| *h == module) {
                Some((g, _)) => plan.push(hf(blk(g), shape)),
                None => skipped.push(name.to_string()),
            },
        }
    }
    refuse_unplaced(model_dir, GGUF_ARCH, &skipped)?;
    let shape = HeaderShape {
        layers: config.num_hidden_layers,
        heads: config.num_attention_heads,
        kv_heads: config.num_key_value_heads,
    };
    // As the converter: float files with MXFP4 experts are `MOSTLY_MXFP4_MOE` (38).
    let mxfp4 = plan.iter().any(|t| t.ty == GgmlType::Mxfp4);
    let file_type = match outtype {
        OutType::F32 | OutType::F16 | OutType::Bf16 if mxfp4 => 38,
        other => other.file_type(),
    };
    let mut file = Opened::new(model_dir, GGUF_ARCH, file_type, config, shape, Vec::new())?;
    let (meta, notes) = (&mut file.meta, &mut file.notes);
    if outtype == OutType::Mxfp4Moe {
        notes.push(
            "mxfp4_moe: the experts quantized to MXFP4 as llama-quantize's MXFP4_MOE does, the \
             other matrices Q8_0 (the router and vectors kept)"
                .into(),
        );
    }
    let k = |key: &str| format!("{GGUF_ARCH}.{key}");
    meta.f32(
        &k("attention.layer_norm_rms_epsilon"),
        config.rms_norm_eps as f32,
    );
    meta.u32(&k("expert_count"), e as u32);
    meta.u32(&k("expert_used_count"), moe.top_k as u32);
    meta.u32(&k("attention.key_length"), config.head_dim as u32);
    meta.u32(&k("attention.value_length"), config.head_dim as u32);
    if let Some(w) = window {
        meta.u32(&k("attention.sliding_window"), w as u32);
    }
    meta.u32(
        &k("expert_feed_forward_length"),
        config.intermediate_size as u32,
    );
    match config.rope.scaling {
        RopeScaling::Default => {}
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            attention_factor: None,
            beta_fast,
            beta_slow,
            mscale: None,
            mscale_all_dim: None,
            truncate,
        } => {
            if !truncate {
                notes.push(
                    "llama.cpp rounds YaRN's correction range (transformers' `truncate`), which \
                     this config turns off: the GGUF's logits differ slightly from transformers'"
                        .into(),
                );
            }
            meta.string(&k("rope.scaling.type"), "yarn");
            meta.f32(&k("rope.scaling.factor"), factor as f32);
            meta.u32(
                &k("rope.scaling.original_context_length"),
                original_max_position_embeddings as u32,
            );
            meta.f32(&k("rope.scaling.yarn_beta_fast"), beta_fast as f32);
            meta.f32(&k("rope.scaling.yarn_beta_slow"), beta_slow as f32);
        }
        ref other => bail!(
            "GGUF export of gpt-oss supports plain RoPE and YaRN with its default attention \
             factor, not {other:?}"
        ),
    }
    // llama-quantize's k-quant mixes, as its 0.3.36 types these architectures' tensors.
    let mix = MixModel {
        experts: e,
        seventy_b: false,
        fused_as_value: true,
    };
    file.finish(out, plan, outtype, mix, config, weights)
}
