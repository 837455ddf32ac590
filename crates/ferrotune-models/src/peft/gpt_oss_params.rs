//! PEFT's `target_parameters` on gpt-oss's fused experts (`mlp.experts.gate_up_proj`
//! `[experts, hidden, 2 · inter]` and `mlp.experts.down_proj` `[experts, inter, hidden]`): one
//! [`ExpertsLora`] per parameter, held on the layer's [`GptOssMoe`] as PEFT's `ParamWrapper`
//! holds it (`lora_A` `[r · experts, in]`, `lora_B` `[out, r · experts]`), read, trained, saved
//! and merged in that form. gpt-oss's router (a bare parameter with a bias) and its sinks are not
//! adapted.
//!
//! PEFT nests the wrappers of several parameters of one module in its declaration order
//! (`gate_up_proj`, then `down_proj`): with both targeted, `gate_up_proj`'s tensors sit one
//! `.base_layer` inside (`...mlp.experts.base_layer.lora_A.weight`), `down_proj`'s at
//! `...mlp.experts.lora_A.weight`.

use std::collections::HashMap;

use candle_core::{Tensor, Var};

use super::{LoraConfig, PEFT_PREFIX};
use crate::model::lora::{lora_scaling, SplitMix64};
use crate::model::{ExpertWeight, ExpertsLora, FeedForward, GptOssMoe};
use crate::{CausalLm, ModelError};

/// The fused parameters PEFT can adapt, in the module's declaration order; `true` for
/// `gate_up_proj`.
const PARAMETERS: [(&str, bool); 2] = [("gate_up_proj", true), ("down_proj", false)];

/// Whether `model` is gpt-oss (its experts are [`GptOssMoe`]s).
pub(crate) fn is_gpt_oss(model: &CausalLm) -> bool {
    model.config.gpt_oss_moe.is_some()
}

/// The layers' gpt-oss blocks with their indices.
fn blocks(model: &CausalLm) -> Vec<(usize, &GptOssMoe)> {
    let layers = model.layers.iter().enumerate();
    layers
        .filter_map(|(i, l)| match &l.mlp {
            FeedForward::GptOss(moe) => Some((i, moe.as_ref())),
            _ => None,
        })
        .collect()
}

/// [`blocks`], mutable.
fn blocks_mut(model: &mut CausalLm) -> Vec<(usize, &mut GptOssMoe)> {
    let layers = model.layers.iter_mut().enumerate();
    layers
        .filter_map(|(i, l)| match &mut l.mlp {
            FeedForward::GptOss(moe) => Some((i, moe.as_mut())),
            _ => None,
        })
        .collect()
}

/// PEFT's module name of layer `i`'s experts.
fn module(i: usize) -> String {
    format!("model.layers.{i}.mlp.experts")
}

/// The adapter-file stem of a parameter's tensors (`base_model.model.model.layers.0.mlp.experts`,
/// with `.base_layer` for `gate_up_proj` nested inside `down_proj`'s wrapper).
fn stem(i: usize, gate_up: bool, both: bool) -> String {
    let nested = if gate_up && both { ".base_layer" } else { "" };
    format!("{PEFT_PREFIX}{}{nested}", module(i))
}

/// The parameter's adapter slot in `moe`.
fn slot(moe: &mut GptOssMoe, gate_up: bool) -> &mut Option<ExpertsLora> {
    if gate_up {
        &mut moe.gate_up_lora
    } else {
        &mut moe.down_lora
    }
}

/// The adapters of `moe` in declaration order, with whether each is `gate_up_proj`'s.
fn adapters(moe: &GptOssMoe) -> impl Iterator<Item = (bool, &ExpertsLora)> {
    [(true, &moe.gate_up_lora), (false, &moe.down_lora)]
        .into_iter()
        .filter_map(|(g, a)| a.as_ref().map(|a| (g, a)))
}

/// `(layer, gate_up, key, in, out, rank, scale)` of every gpt-oss expert parameter `config`'s
/// `target_parameters` names (PEFT's match: equal, or ending in `.{target}`). A target matching
/// none of them is an error naming what can be adapted.
#[allow(clippy::type_complexity)]
fn targets(
    model: &CausalLm,
    config: &LoraConfig,
) -> Result<Vec<(usize, bool, String, usize, usize, usize, f64)>, String> {
    let mut out = Vec::new();
    let mut matched = vec![false; config.target_parameters.len()];
    for (i, moe) in blocks(model) {
        for (param, gate_up) in PARAMETERS {
            let key = format!("{}.{param}", module(i));
            let hits: Vec<usize> = (0..matched.len())
                .filter(|&j| {
                    let t = &config.target_parameters[j];
                    key == *t || key.ends_with(&format!(".{t}"))
                })
                .collect();
            if hits.is_empty() {
                continue;
            }
            for j in hits {
                matched[j] = true;
            }
            let w = if gate_up {
                &moe.gate_up_proj
            } else {
                &moe.down_proj
            };
            let (_, inp, outp) = w.dims3().map_err(|e| e.to_string())?;
            let (r, alpha) = config.rank_and_alpha(&key);
            let scale = lora_scaling(r, alpha, config.use_rslora);
            out.push((i, gate_up, key, inp, outp, r, scale));
        }
    }
    if let Some(j) = matched.iter().position(|m| !m) {
        return Err(format!(
            "gpt-oss's target_parameters: '{}' matches no expert parameter (gpt-oss adapts \
             'mlp.experts.gate_up_proj' and 'mlp.experts.down_proj'; its router and sinks are \
             not supported)",
            config.target_parameters[j]
        ));
    }
    Ok(out)
}

/// An expert adapter read or made for `model`: its layer, whether it is `gate_up_proj`'s, and
/// the adapter.
pub(crate) type Placed = (usize, bool, ExpertsLora);

/// Reads `config`'s `target_parameters` adapters on gpt-oss's experts from PEFT-named `tensors`
/// (taking them out), for [`replace`] to put on the model once everything else is checked.
/// Nothing for other models.
pub(crate) fn read(
    model: &CausalLm,
    config: &LoraConfig,
    tensors: &mut HashMap<String, Tensor>,
    source: &str,
) -> Result<Vec<Placed>, ModelError> {
    if !is_gpt_oss(model) || config.target_parameters.is_empty() {
        return Ok(Vec::new());
    }
    let err = |m: String| ModelError::Msg(format!("{source}: {m}"));
    let targets = targets(model, config).map_err(err)?;
    let experts = model
        .config
        .gpt_oss_moe
        .as_ref()
        .map_or(0, |m| m.num_experts);
    let (dtype, device) = (model.dtype(), model.device().clone());
    let mut found = Vec::new();
    for (i, gate_up, key, inp, outp, r, scale) in &targets {
        let both = targets.iter().filter(|t| t.0 == *i).count() == 2;
        let stem = stem(*i, *gate_up, both);
        let mut take = |suffix: &str, shape: [usize; 2]| -> Result<Tensor, ModelError> {
            let name = format!("{stem}.{suffix}");
            let t = tensors.remove(&name).ok_or_else(|| {
                err(format!(
                    "gpt-oss's target_parameters: missing adapter tensor '{name}' for '{key}'"
                ))
            })?;
            if t.dims() != shape {
                return Err(err(format!(
                    "gpt-oss's target_parameters: adapter tensor '{name}' has shape {:?}, \
                     expected {shape:?} for '{key}'",
                    t.dims()
                )));
            }
            Ok(t.to_dtype(dtype)?.to_device(&device)?)
        };
        let a = take("lora_A.weight", [r * experts, *inp])?;
        let b = take("lora_B.weight", [*outp, r * experts])?;
        let lora = ExpertsLora {
            a,
            b,
            rank: *r,
            scale: *scale,
        };
        found.push((*i, *gate_up, lora));
    }
    Ok(found)
}

/// Replaces `model`'s expert adapters by `adapters`.
pub(crate) fn replace(model: &mut CausalLm, adapters: Vec<Placed>) {
    clear(model);
    set(model, adapters);
}

/// Puts `adapters` on `model`'s blocks.
fn set(model: &mut CausalLm, adapters: Vec<Placed>) {
    let mut blocks = blocks_mut(model);
    for (i, gate_up, lora) in adapters {
        if let Some((_, moe)) = blocks.iter_mut().find(|(j, _)| *j == i) {
            *slot(moe, gate_up) = Some(lora);
        }
    }
}

/// Removes every expert adapter of `model`.
fn clear(model: &mut CausalLm) {
    for (_, moe) in blocks_mut(model) {
        moe.gate_up_lora = None;
        moe.down_lora = None;
    }
}

/// Fresh adapters for training on every expert parameter `config`'s `target_parameters` names,
/// initialised as PEFT initialises `ParamWrapper`'s `nn.Linear` factors by default (`lora_A`
/// kaiming-uniform, bound `1/√in`; `lora_B` zeros), drawn from `rng`. Returns how many.
pub(crate) fn add(
    model: &mut CausalLm,
    config: &LoraConfig,
    rng: &mut SplitMix64,
) -> Result<usize, ModelError> {
    if !is_gpt_oss(model) {
        return Ok(0);
    }
    clear(model);
    if config.target_parameters.is_empty() {
        return Ok(0);
    }
    let targets = targets(model, config).map_err(ModelError::Msg)?;
    let experts = model
        .config
        .gpt_oss_moe
        .as_ref()
        .map_or(0, |m| m.num_experts);
    let elems: Option<u64> = targets.iter().try_fold(0u64, |acc, t| {
        let per = (t.3 as u64 + t.4 as u64).checked_mul((t.5 * experts) as u64)?;
        acc.checked_add(per)
    });
    ferrotune_core::memory::check_fits(
        elems.and_then(|e| ferrotune_core::memory::bytes_of(e, 4)),
        "the LoRA adapters on gpt-oss's experts (target_parameters)",
        model.device(),
    )
    .map_err(ModelError::Msg)?;
    let (dtype, device) = (model.dtype(), model.device().clone());
    let mut found = Vec::new();
    for (i, gate_up, _, inp, outp, r, scale) in targets {
        let rows = r * experts;
        let bound = 1.0 / (inp as f64).sqrt();
        let a: Vec<f32> = (0..rows * inp)
            .map(|_| ((rng.next_f64() * 2.0 - 1.0) * bound) as f32)
            .collect();
        let a = Tensor::from_vec(a, (rows, inp), &device)?.to_dtype(dtype)?;
        let b = Tensor::zeros((outp, rows), dtype, &device)?;
        found.push((
            i,
            gate_up,
            ExpertsLora {
                a,
                b,
                rank: r,
                scale,
            },
        ));
    }
    let n = found.len();
    set(model, found);
    Ok(n)
}

/// Makes the expert adapters trainable: their [`Var`]s under PEFT's parameter names
/// (`base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight`, ...).
pub(crate) fn trainable(model: &mut CausalLm) -> Result<Vec<(String, Var)>, ModelError> {
    let mut out = Vec::new();
    for (i, moe) in blocks_mut(model) {
        let both = moe.gate_up_lora.is_some() && moe.down_lora.is_some();
        for gate_up in [true, false] {
            if let Some(lora) = slot(moe, gate_up) {
                for (suffix, var) in lora.make_trainable()? {
                    out.push((format!("{}.{suffix}", stem(i, gate_up, both)), var));
                }
            }
        }
    }
    Ok(out)
}

/// The expert adapters' tensors under PEFT's file names.
pub(crate) fn tensors(model: &CausalLm) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    for (i, moe) in blocks(model) {
        let both = moe.gate_up_lora.is_some() && moe.down_lora.is_some();
        for (gate_up, lora) in adapters(moe) {
            let stem = stem(i, gate_up, both);
            out.push((format!("{stem}.lora_A.weight"), lora.a.clone()));
            out.push((format!("{stem}.lora_B.weight"), lora.b.clone()));
        }
    }
    out
}

/// Checks that `model`'s expert adapters are those `config` describes (the same parameters,
/// ranks and scalings), so that the saved folder loads in PEFT as it runs here.
pub(crate) fn check_saved(model: &CausalLm, config: &LoraConfig) -> Result<(), ModelError> {
    let want = if config.target_parameters.is_empty() {
        Vec::new()
    } else {
        targets(model, config).map_err(ModelError::Msg)?
    };
    let mut have = Vec::new();
    for (i, moe) in blocks(model) {
        for (gate_up, lora) in adapters(moe) {
            have.push((i, gate_up, lora.rank, lora.scale));
        }
    }
    let want: Vec<(usize, bool, usize, f64)> =
        want.into_iter().map(|t| (t.0, t.1, t.5, t.6)).collect();
    let same = want.len() == have.len()
        && want
            .iter()
            .zip(&have)
            .all(|(w, h)| w.0 == h.0 && w.1 == h.1 && w.2 == h.2 && (w.3 - h.3).abs() <= 1e-9);
    if !same {
        return Err(ModelError::Msg(format!(
            "cannot save: gpt-oss's expert adapters (layer, gate_up_proj, rank, scaling) \
             {have:?} are not those target_parameters {:?} describes {want:?}",
            config.target_parameters
        )));
    }
    Ok(())
}

/// The merged fused experts: `(name, W + delta)` for every adapted parameter (PEFT's
/// `ParamWrapper.merge`; the biases are left as they are), and every MXFP4 one (QLoRA's packed
/// base) dequantized, adapted or not: the model's tensors leave packed weights out.
pub(crate) fn merged(model: &CausalLm) -> Result<Vec<(String, Tensor)>, ModelError> {
    let mut out = Vec::new();
    for (i, moe) in blocks(model) {
        for (param, gate_up) in PARAMETERS {
            let (w, lora) = if gate_up {
                (&moe.gate_up_proj, &moe.gate_up_lora)
            } else {
                (&moe.down_proj, &moe.down_lora)
            };
            let merged = match (lora, w) {
                (Some(lora), w) => merged_weight(w, lora)?,
                (None, ExpertWeight::Mxfp4(q)) => q.dense()?,
                (None, ExpertWeight::Dense(_)) => continue,
            };
            out.push((format!("{}.{param}", module(i)), merged));
        }
    }
    Ok(out)
}

/// `W + delta` (dense, detached) of an expert parameter and its adapter.
fn merged_weight(w: &ExpertWeight, lora: &ExpertsLora) -> Result<Tensor, ModelError> {
    let w = w.dense()?;
    Ok((&*w + lora.delta()?.to_dtype(w.dtype())?)?.detach())
}

/// Merges every expert adapter into its parameter (an MXFP4 one becomes dense) and removes it.
pub(crate) fn merge_and_unload(model: &mut CausalLm) -> Result<(), ModelError> {
    for (_, moe) in blocks_mut(model) {
        if let Some(lora) = moe.gate_up_lora.take() {
            moe.gate_up_proj = ExpertWeight::Dense(merged_weight(&moe.gate_up_proj, &lora)?);
        }
        if let Some(lora) = moe.down_lora.take() {
            moe.down_proj = ExpertWeight::Dense(merged_weight(&moe.down_proj, &lora)?);
        }
    }
    Ok(())
}

/// Takes every expert adapter out of `model` (see [`put_back`]).
pub(crate) fn take_all(model: &mut CausalLm) -> Vec<Placed> {
    let mut out = Vec::new();
    for (i, moe) in blocks_mut(model) {
        for gate_up in [true, false] {
            if let Some(lora) = slot(moe, gate_up).take() {
                out.push((i, gate_up, lora));
            }
        }
    }
    out
}

/// Puts back what [`take_all`] took.
pub(crate) fn put_back(model: &mut CausalLm, taken: Vec<Placed>) {
    set(model, taken);
}
