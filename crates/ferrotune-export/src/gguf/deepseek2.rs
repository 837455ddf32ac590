//! DeepSeek-V2 and -V3 as llama.cpp's `deepseek2` file, as its `convert_hf_to_gguf.py` writes
//! one: `kv_b_proj` split per head into `attn_k_b` (the key half, transposed) and `attn_v_b`,
//! experts stacked, the router's `e_score_correction_bias` as `exp_probs_b`, the latent attention's
//! sizes as llama.cpp's keys (its absorbed MQA form in `key_length` / `value_length`, the per-head
//! sizes in `*_mla`), `mscale_all_dim` as `yarn_log_multiplier` (× 0.1). The names are the
//! family's ([`ferrotune_models::family::deepseek`]).
//!
//! Unlike the converter, the gating function is always written (it writes none when the config
//! lacks `scoring_func`, as transformers 5's DeepSeek-V3 configs do, and llama.cpp then routes by
//! softmax), and expert groups only where transformers uses them. Refused, as the file would
//! compute something else in llama.cpp: DeepSeek-V2 routing over expert groups (llama.cpp ranks a
//! group by its two best scores, V2 by its best), YaRN whose `mscale` differs from
//! `mscale_all_dim` (llama.cpp takes them equal), rotary halves (`rope_interleave` false).

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Result};
use ferrotune_models::config::{RopeScaling, RouterScoring};
use ferrotune_models::family::deepseek::{GGUF_ARCH, GGUF_LAYER_TENSORS, GGUF_TOP_TENSORS};
use ferrotune_models::ModelConfig;

use super::*;

/// A layer's experts' tensors of one part, by expert: (file index, name).
type ExpertTensors = BTreeMap<usize, (usize, String)>;

/// llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_*` values.
const GATING_SOFTMAX: u32 = 1;
const GATING_SIGMOID: u32 = 2;

/// Writes the DeepSeek checkpoint `config` / `weights` of `model_dir` as a `deepseek2` GGUF.
pub(super) fn export(
    model_dir: &Path,
    out: &Path,
    outtype: OutType,
    config: &ModelConfig,
    weights: &Weights,
) -> Result<GgufExport> {
    let Some(mla) = &config.mla else {
        bail!("not a DeepSeek checkpoint (no latent attention)");
    };
    if !mla.rope_interleave {
        bail!(
            "rope_interleave is false: llama.cpp's '{GGUF_ARCH}' rotates adjacent pairs, so the \
             GGUF would compute something else"
        );
    }
    let outtype = resolve_outtype(outtype, weights, false)?;
    let layers = config.num_hidden_layers;
    let heads = config.num_attention_heads;
    let (nope, v, rank) = (mla.qk_nope_head_dim, mla.v_head_dim, mla.kv_lora_rank);
    let mut plan = Vec::new();
    let mut skipped = Vec::new();
    let mut experts: BTreeMap<(usize, &'static str), ExpertTensors> = BTreeMap::new();
    let vector_or = |name: &str, shape: &[usize]| storage_type(name, shape, outtype);
    for (file, name, shape) in weights.list() {
        let dims = |s: &[usize]| s.iter().rev().map(|&d| d as u64).collect::<Vec<_>>();
        if let Some(layer) = layer_of(&name) {
            // Multi-token-prediction layers past the decoder's: the converter leaves them out.
            if layer >= layers {
                continue;
            }
        }
        if let Some((layer, expert, part)) = expert_part(&name) {
            experts
                .entry((layer, part))
                .or_default()
                .insert(expert, (file, name.clone()));
            continue;
        }
        if name == "lm_head.weight" && config.tie_word_embeddings {
            continue;
        }
        let Some((stem, suffix)) = name.rsplit_once('.') else {
            skipped.push(name);
            continue;
        };
        let hf_source = |gguf: String| Planned {
            ty: vector_or(&gguf, &shape),
            name: gguf,
            dims: dims(&shape),
            source: Source::Hf {
                file,
                name: name.clone(),
                rows: None,
                plus_one: false,
            },
        };
        if let Some((top, _)) = GGUF_TOP_TENSORS.iter().find(|(_, hf)| *hf == stem) {
            if suffix != "weight" {
                skipped.push(name.clone());
                continue;
            }
            plan.push(hf_source(format!("{top}.weight")));
            continue;
        }
        let Some((layer, module)) = stem
            .strip_prefix("model.layers.")
            .and_then(|r| r.split_once('.'))
            .and_then(|(l, m)| Some((l.parse::<usize>().ok()?, m)))
        else {
            skipped.push(name.clone());
            continue;
        };
        match (module, suffix) {
            ("self_attn.kv_b_proj", "weight") => {
                if shape != [heads * (nope + v), rank] {
                    bail!(
                        "{name} has shape {shape:?}, not [{heads} · ({nope} + {v}), {rank}] as \
                         the config says"
                    );
                }
                let at = |h: usize, j: usize, c: usize| (h * (nope + v) + j) * rank + c;
                // `attn_k_b` `[heads, rank, nope]`: each head's key rows, transposed.
                let k_index = (0..heads)
                    .flat_map(|h| (0..rank).flat_map(move |c| (0..nope).map(move |j| at(h, j, c))))
                    .collect();
                // `attn_v_b` `[heads, v, rank]`: each head's value rows.
                let v_index = (0..heads)
                    .flat_map(|h| {
                        (0..v).flat_map(move |j| (0..rank).map(move |c| at(h, nope + j, c)))
                    })
                    .collect();
                for (part, shape, index) in [
                    ("attn_k_b", [heads, rank, nope], k_index),
                    ("attn_v_b", [heads, v, rank], v_index),
                ] {
                    let gguf = format!("blk.{layer}.{part}.weight");
                    plan.push(Planned {
                        ty: storage_type(&gguf, &shape, outtype),
                        name: gguf,
                        dims: dims(&shape),
                        source: Source::Gather {
                            file,
                            name: name.clone(),
                            index,
                        },
                    });
                }
            }
            ("mlp.gate", "e_score_correction_bias") => {
                plan.push(hf_source(format!("blk.{layer}.exp_probs_b.bias")));
            }
            (module, "weight") => match GGUF_LAYER_TENSORS.iter().find(|(_, hf)| *hf == module) {
                Some((part, _)) => plan.push(hf_source(format!("blk.{layer}.{part}.weight"))),
                None => skipped.push(name.clone()),
            },
            _ => skipped.push(name.clone()),
        }
    }
    refuse_unplaced(model_dir, GGUF_ARCH, &skipped)?;
    let expert_count = config.moe.as_ref().map_or(0, |m| m.num_experts);
    for ((layer, part), per_expert) in experts {
        if per_expert.len() != expert_count || !per_expert.keys().copied().eq(0..expert_count) {
            bail!(
                "{}: layer {layer}'s experts' {part} projections are not {expert_count} matrices",
                model_dir.display()
            );
        }
        let first = &per_expert[&0];
        let shape = weights
            .list()
            .into_iter()
            .find(|(f, n, _)| *f == first.0 && *n == first.1)
            .map(|(_, _, s)| s)
            .unwrap_or_default();
        if shape.len() != 2 {
            bail!(
                "{}: layer {layer}'s experts' {part} projections are not matrices",
                model_dir.display()
            );
        }
        let name = format!("blk.{layer}.ffn_{part}_exps.weight");
        let stacked = [expert_count, shape[0], shape[1]];
        plan.push(Planned {
            ty: storage_type(&name, &stacked, outtype),
            name,
            dims: stacked.iter().rev().map(|&d| d as u64).collect(),
            source: Source::Stacked(per_expert.into_values().collect()),
        });
    }

    let home = model_dir;
    // llama.cpp runs MLA as one latent key/value head shared by every query head.
    let shape = HeaderShape {
        layers,
        heads,
        kv_heads: 1,
    };
    let file_type = outtype.file_type();
    let mut file = Opened::new(home, GGUF_ARCH, file_type, config, shape, Vec::new())?;
    let meta = &mut file.meta;
    let k = |key: &str| format!("{GGUF_ARCH}.{key}");
    meta.f32(
        &k("attention.layer_norm_rms_epsilon"),
        config.rms_norm_eps as f32,
    );
    meta.u32(&k("vocab_size"), config.vocab_size as u32);
    if let Some(q) = mla.q_lora_rank {
        meta.u32(&k("attention.q_lora_rank"), q as u32);
    }
    let rope = mla.qk_rope_head_dim;
    meta.u32(&k("attention.kv_lora_rank"), rank as u32);
    meta.u32(&k("attention.key_length"), (rank + rope) as u32);
    meta.u32(&k("attention.value_length"), rank as u32);
    meta.u32(&k("attention.key_length_mla"), (nope + rope) as u32);
    meta.u32(&k("attention.value_length_mla"), v as u32);
    meta.u32(&k("rope.dimension_count"), rope as u32);
    moe_meta(config, meta)?;
    match config.rope.scaling {
        RopeScaling::Default => {}
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            attention_factor: None,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim: Some(all_dim),
            truncate: true,
        } if mscale.unwrap_or(1.0) == all_dim => {
            meta.string(&k("rope.scaling.type"), "yarn");
            meta.f32(&k("rope.scaling.factor"), factor as f32);
            meta.u32(
                &k("rope.scaling.original_context_length"),
                original_max_position_embeddings as u32,
            );
            meta.f32(&k("rope.scaling.yarn_beta_fast"), beta_fast as f32);
            meta.f32(&k("rope.scaling.yarn_beta_slow"), beta_slow as f32);
            // convert_hf_to_gguf.py's legacy factor, which llama.cpp divides out again.
            meta.f32(
                &k("rope.scaling.yarn_log_multiplier"),
                (0.1 * all_dim) as f32,
            );
        }
        ref other => bail!(
            "GGUF export of DeepSeek supports plain RoPE and YaRN with `mscale` equal to \
             `mscale_all_dim` (what llama.cpp's '{GGUF_ARCH}' computes), not {other:?}"
        ),
    }
    // llama-quantize's k-quant mixes, as its 0.3.36 types these architectures' tensors.
    let mix = MixModel {
        experts: config.moe.as_ref().map_or(0, |m| m.num_experts),
        seventy_b: false,
        fused_as_value: true,
    };
    file.finish(out, plan, outtype, mix, config, weights)
}

/// The experts' keys: counts, sizes, routing.
fn moe_meta(config: &ModelConfig, meta: &mut Metadata) -> Result<()> {
    let k = |key: &str| format!("{GGUF_ARCH}.{key}");
    let (Some(moe), Some(routing)) = (&config.moe, &config.grouped_routing) else {
        // Dense layers only: the converter's sizes for llama.cpp, no experts.
        meta.u32(
            &k("leading_dense_block_count"),
            config.num_hidden_layers as u32,
        );
        meta.u32(
            &k("expert_feed_forward_length"),
            config.intermediate_size as u32,
        );
        meta.u32(&k("expert_shared_count"), 0);
        return Ok(());
    };
    let leading = moe.sparse_layers.iter().take_while(|s| !**s).count();
    if moe.sparse_layers[leading..].iter().any(|s| !s) {
        bail!("llama.cpp's '{GGUF_ARCH}' has dense layers only before the sparse ones");
    }
    let inter = moe.expert_intermediate_size;
    let shared = moe.shared_expert_intermediate_size.unwrap_or(0) / inter.max(1);
    meta.u32(&k("leading_dense_block_count"), leading as u32);
    meta.u32(&k("expert_count"), moe.num_experts as u32);
    meta.u32(&k("expert_used_count"), moe.top_k as u32);
    meta.u32(&k("expert_feed_forward_length"), inter as u32);
    meta.u32(&k("expert_shared_count"), shared as u32);
    meta.f32(
        &k("expert_weights_scale"),
        routing.routed_scaling_factor as f32,
    );
    if routing.norm_topk_prob {
        meta.bool(&k("expert_weights_norm"), true);
    }
    match routing.scoring {
        RouterScoring::Sigmoid => meta.u32(&k("expert_gating_func"), GATING_SIGMOID),
        RouterScoring::Softmax if routing.n_group > 1 => bail!(
            "DeepSeek-V2's group_limited_greedy routing ({} groups) ranks a group by its best \
             score; llama.cpp's '{GGUF_ARCH}' by its two best: the GGUF would compute something \
             else",
            routing.n_group
        ),
        RouterScoring::Softmax => meta.u32(&k("expert_gating_func"), GATING_SOFTMAX),
    }
    // DeepSeek-V2's `greedy` routing is one group (what the converter writes for it too).
    meta.u32(&k("expert_group_count"), routing.n_group as u32);
    meta.u32(&k("expert_group_used_count"), routing.topk_group as u32);
    Ok(())
}

/// The decoder layer a tensor belongs to (`model.layers.N.…`).
fn layer_of(name: &str) -> Option<usize> {
    name.strip_prefix("model.layers.")?
        .split_once('.')?
        .0
        .parse()
        .ok()
}
