//! PEFT's `target_parameters` (`lora.ParamWrapper`): LoRA on parameters rather than modules.
//!
//! transformers 5 keeps a mixture of experts' weights as fused 3-D parameters
//! (`mlp.experts.gate_up_proj` `[experts, 2 * inter, hidden]`, gate rows first, and
//! `mlp.experts.down_proj` `[experts, hidden, inter]`) and its router as a bare `mlp.gate.weight`,
//! none of them an `nn.Linear`, so PEFT adapts them through `target_parameters`. Its adapter on a
//! 3-D parameter of `E` experts holds `lora_A` `[r * E, in]` (expert `e`'s rows `e * r ..`) and
//! `lora_B` `[out, r * E]` (expert `e`'s columns `e, e + E, e + 2E, ...`), and expert `e`'s
//! weight becomes `W_e + B_e A_e * scaling`. ferrotune holds every expert as its own gated MLP,
//! so such an adapter is exactly one LoRA per expert projection (the gate and up projections
//! sharing expert `e`'s `A`); a 2-D parameter's adapter is a plain LoRA on its layer.

use std::collections::HashMap;

use candle_core::Tensor;

use crate::lora::lora_scaling;
use crate::model::FeedForward;
use crate::peft::{file_keys, LoraConfig, PEFT_PREFIX};
use crate::{CausalLm, ModelError};

/// A parameter `target_parameters` may name.
enum Slot {
    /// A linear layer's 2-D `weight`: a LoRA on that layer (ferrotune's module name).
    Weight(String),
    /// A sparse block's fused expert parameter: `gate_up_proj` (`gate_up`) or `down_proj`.
    Experts {
        /// ferrotune's name of the block: `model.layers.N.block_sparse_moe` or `...mlp`.
        block: String,
        /// The experts' gate, up and down projection names.
        projections: [&'static str; 3],
        experts: usize,
        gate_up: bool,
    },
}

/// transformers 5's name of ferrotune's module `name`: Mixtral's `block_sparse_moe` is `mlp`
/// there (the checkpoint keeps the old name, the in-memory model, which PEFT names, does not).
fn transformers5_name(name: &str) -> String {
    name.replacen(".block_sparse_moe.", ".mlp.", 1)
}

/// Every parameter of `model` that `target_parameters` can adapt, under transformers 5's name
/// (`model.layers.0.mlp.experts.gate_up_proj`, `model.layers.0.self_attn.q_proj.weight`).
fn slots(model: &CausalLm) -> Vec<(String, Slot)> {
    let mut out = Vec::new();
    for (name, _) in model.linears() {
        // Single experts are slices of the fused parameters, not parameters of their own.
        if name.contains(".experts.") {
            continue;
        }
        let key = format!("{}.weight", transformers5_name(&name));
        out.push((key, Slot::Weight(name)));
    }
    for (i, layer) in model.layers.iter().enumerate() {
        let FeedForward::Sparse(moe) = &layer.mlp else {
            continue;
        };
        for (param, gate_up) in [("gate_up_proj", true), ("down_proj", false)] {
            out.push((
                format!("model.layers.{i}.mlp.experts.{param}"),
                Slot::Experts {
                    block: format!("model.layers.{i}.{}", moe.block_name()),
                    projections: moe.projection_names(),
                    experts: moe.experts.len(),
                    gate_up,
                },
            ));
        }
    }
    out
}

/// PEFT's match of a parameter `key` against `target_parameters`: equal, or ending in
/// `.{target}`.
fn targeted(config: &LoraConfig, key: &str) -> bool {
    config
        .target_parameters
        .iter()
        .any(|t| key == t || key.ends_with(&format!(".{t}")))
}

/// Turns the `target_parameters` adapters among `tensors` (PEFT's file names) into per-layer LoRA
/// tensors under ferrotune's module names, in place, and returns those layers with their rank
/// and scaling, for [`crate::peft::attach_adapter`] to attach as it attaches `target_modules`'.
///
/// PEFT nests the wrappers of several parameters of one module in the module's declaration
/// order (`gate_up_proj`, then `down_proj`): all but the last carry one `.base_layer` per wrapper
/// around them in their names. Rank and alpha follow `rank_pattern` / `alpha_pattern` matched
/// against the parameter's name, as PEFT matches them.
pub(crate) fn expand(
    model: &CausalLm,
    config: &LoraConfig,
    tensors: &mut HashMap<String, Tensor>,
    source: &str,
) -> Result<Vec<(String, usize, f64)>, ModelError> {
    if config.target_parameters.is_empty() {
        return Ok(Vec::new());
    }
    let err = |msg: String| ModelError::Msg(format!("{source}: {msg}"));
    let slots: Vec<(String, Slot)> = slots(model)
        .into_iter()
        .filter(|(key, _)| targeted(config, key))
        .collect();
    if slots.is_empty() {
        return Err(err(format!(
            "target_parameters {:?} matches no parameter of the model (names look like \
             'model.layers.0.mlp.experts.gate_up_proj' and 'model.layers.0.mlp.gate.weight')",
            config.target_parameters
        )));
    }
    // How many targeted parameters each module has, and how many of them came before: the
    // wrappers around a parameter's own.
    let module_of = |key: &str| {
        key.rsplit_once('.')
            .map_or(String::new(), |(m, _)| m.into())
    };
    let mut per_module: HashMap<String, usize> = HashMap::new();
    for (key, _) in &slots {
        *per_module.entry(module_of(key)).or_default() += 1;
    }
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::new();
    for (key, slot) in slots {
        let module = module_of(&key);
        let index = seen.entry(module.clone()).or_default();
        let outer = per_module[&module] - 1 - *index;
        *index += 1;
        let stem = format!("{PEFT_PREFIX}{module}{}", ".base_layer".repeat(outer));
        let (r, alpha) = config.rank_and_alpha(&key);
        let scale = lora_scaling(r, alpha, config.use_rslora);
        let mut take = |suffix: &str, shape: [usize; 2]| -> Result<Tensor, ModelError> {
            let name = format!("{stem}.{suffix}");
            let t = tensors
                .remove(&name)
                .ok_or_else(|| err(format!("missing adapter tensor '{name}' for '{key}'")))?;
            if t.dims() != shape {
                return Err(err(format!(
                    "adapter tensor '{name}' has shape {:?}, expected {shape:?} for '{key}'",
                    t.dims()
                )));
            }
            Ok(t)
        };
        // Each layer's (name, A, B).
        let mut pieces: Vec<(String, Tensor, Tensor)> = Vec::new();
        match slot {
            Slot::Weight(layer) => {
                let (rows, cols) = model
                    .linears()
                    .into_iter()
                    .find(|(n, _)| *n == layer)
                    .map(|(_, l)| l.weight.dims2())
                    .transpose()?
                    .unwrap_or_default();
                let a = take("lora_A.weight", [r, cols])?;
                let b = take("lora_B.weight", [rows, r])?;
                pieces.push((layer, a, b));
            }
            Slot::Experts {
                block,
                projections,
                experts,
                gate_up,
            } => {
                let hidden = model.config.hidden_size;
                let inter = model
                    .config
                    .moe
                    .as_ref()
                    .map_or(0, |m| m.expert_intermediate_size);
                let (rows, cols) = if gate_up {
                    (2 * inter, hidden)
                } else {
                    (hidden, inter)
                };
                let a = take("lora_A.weight", [r * experts, cols])?;
                let b = take("lora_B.weight", [rows, r * experts])?;
                for e in 0..experts {
                    let a_e = a.narrow(0, e * r, r)?.contiguous()?;
                    let columns: Vec<u32> = (0..r).map(|k| (k * experts + e) as u32).collect();
                    let columns = Tensor::new(columns, b.device())?;
                    let b_e = b.index_select(&columns, 1)?;
                    let expert = format!("{block}.experts.{e}");
                    if gate_up {
                        let gate = b_e.narrow(0, 0, inter)?.contiguous()?;
                        let up = b_e.narrow(0, inter, inter)?.contiguous()?;
                        pieces.push((format!("{expert}.{}", projections[0]), a_e.clone(), gate));
                        pieces.push((format!("{expert}.{}", projections[1]), a_e, up));
                    } else {
                        pieces.push((format!("{expert}.{}", projections[2]), a_e, b_e));
                    }
                }
            }
        }
        for (layer, a, b) in pieces {
            let (ka, kb, _) = file_keys(&layer);
            tensors.insert(ka, a);
            tensors.insert(kb, b);
            out.push((layer, r, scale));
        }
    }
    Ok(out)
}
