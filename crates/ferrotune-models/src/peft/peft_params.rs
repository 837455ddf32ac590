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
//!
//! The other way, [`transformers5_adapter`] writes adapters trained on ferrotune's per-expert
//! layers in that form, for PEFT on transformers 5.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use candle_core::{DType, Tensor};

use crate::model::lora::{lora_scaling, LoraAdapter};
use crate::model::{FeedForward, GateUpProjection, Moe};
use crate::peft::{file_keys, LoraConfig, TargetModules, PEFT_PREFIX};
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
        /// Llama 4's layout, `[experts, in, out]` (the experts multiply `x @ W_e`), where Qwen's
        /// and Mixtral's is `[experts, out, in]`.
        transposed: bool,
    },
}

/// transformers 5's name of ferrotune's module `name` in `model`: Mixtral's and Phi-3.5-MoE's
/// `block_sparse_moe` is `mlp` there (the checkpoint keeps the old name, the in-memory model,
/// which PEFT names, does not), and Phi-3.5-MoE's router `gate` is `router`.
fn transformers5_name(model: &CausalLm, name: &str) -> String {
    let name = name.replacen(".block_sparse_moe.", ".mlp.", 1);
    let router = sparse_layers(model)
        .first()
        .map_or("gate", |(_, moe)| moe.transformers5_router_name());
    match name.strip_suffix(".mlp.gate") {
        Some(layer) if router != "gate" => format!("{layer}.mlp.{router}"),
        _ => name,
    }
}

/// Every parameter of `model` that `target_parameters` can adapt: its name as PEFT matches it
/// (transformers 5's, such as `model.layers.0.mlp.experts.gate_up_proj` or
/// `model.layers.0.self_attn.q_proj.weight`; Llama 4's checkpoint names,
/// `model.layers.1.feed_forward.experts.gate_up_proj`), the module its adapter tensors are read
/// under (ferrotune's name after [`ModelConfig::text_model_name`] for Llama 4), and what it is.
///
/// [`ModelConfig::text_model_name`]: crate::ModelConfig::text_model_name
fn slots(model: &CausalLm) -> Vec<(String, String, Slot)> {
    let llama4 = model.config.llama4_names;
    // PEFT's name of ferrotune's module `name`, and the module its tensors arrive under.
    let names = |name: &str| {
        if llama4 {
            (model.config.checkpoint_name(name), name.to_string())
        } else {
            let t5 = transformers5_name(model, name);
            (t5.clone(), t5)
        }
    };
    let mut out = Vec::new();
    for (name, _) in model.linears() {
        // Single experts are slices of the fused parameters, not parameters of their own.
        if name.contains(".experts.") {
            continue;
        }
        let (key, module) = names(&name);
        out.push((format!("{key}.weight"), module, Slot::Weight(name)));
    }
    for (i, layer) in model.layers.iter().enumerate() {
        // Where the layer's experts sit (ferrotune's name of the block holding them), their
        // projections' names and count, and whether the fused layout is Llama 4's.
        let (block, projections, experts, transposed) = match (&layer.parallel_moe, &layer.mlp) {
            // Gemma 4's experts beside the MLP: `model.layers.N.experts.gate_up_proj`, Qwen's
            // layout.
            (Some(parallel), _) => (
                format!("model.layers.{i}"),
                ["gate_proj", "up_proj", "down_proj"],
                parallel.moe.experts.len(),
                false,
            ),
            (None, FeedForward::Sparse(moe)) => (
                format!("model.layers.{i}.{}", moe.block_name()),
                moe.projection_names(),
                moe.experts.len(),
                llama4,
            ),
            // gpt-oss's experts keep PEFT's fused adapters (`gpt_oss_params`).
            (None, FeedForward::Dense(_) | FeedForward::GptOss(_)) => continue,
        };
        let (key, module) = names(&format!("{block}.experts"));
        for (param, gate_up) in [("gate_up_proj", true), ("down_proj", false)] {
            out.push((
                format!("{key}.{param}"),
                module.clone(),
                Slot::Experts {
                    block: block.clone(),
                    projections,
                    experts,
                    gate_up,
                    transposed,
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
    if model.config.gpt_oss_moe.is_some() {
        // gpt-oss's fused experts keep PEFT's fused adapters (`gpt_oss_params`).
        return Ok(Vec::new());
    }
    let (slots, others): (Vec<_>, Vec<_>) = slots(model)
        .into_iter()
        .partition(|(key, _, _)| targeted(config, key));
    if slots.is_empty() {
        // Two of the model's own names: an expert parameter's and a weight's.
        let examples: Vec<&str> = [
            others
                .iter()
                .find(|(_, _, s)| matches!(s, Slot::Experts { .. })),
            others.iter().find(|(_, _, s)| matches!(s, Slot::Weight(_))),
        ]
        .into_iter()
        .flatten()
        .map(|(key, _, _)| key.as_str())
        .collect();
        return Err(err(format!(
            "target_parameters {:?} matches no parameter of the model (names look like '{}')",
            config.target_parameters,
            examples.join("' and '")
        )));
    }
    // How many targeted parameters each module has, and how many of them came before: the
    // wrappers around a parameter's own.
    let mut per_module: HashMap<String, usize> = HashMap::new();
    for (_, module, _) in &slots {
        *per_module.entry(module.clone()).or_default() += 1;
    }
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = Vec::new();
    for (key, module, slot) in slots {
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
                transposed,
            } => {
                let (hidden, inter) = (model.config.hidden_size, expert_intermediate_size(model));
                // The parameter's expert matrix as a linear layer's weight, `[out, in]`.
                let (out, inp) = if gate_up {
                    (2 * inter, hidden)
                } else {
                    (hidden, inter)
                };
                // PEFT takes a 3-D parameter's last dimension as the input of its factors
                // (lora_A `[r * E, last]`, lora_B `[middle, r * E]`), whichever way the experts
                // multiply: on Llama 4's `[experts, in, out]` the update `B_e A_e` is the
                // transposed weight's, so the factors trade roles.
                let (rows, cols) = if transposed { (inp, out) } else { (out, inp) };
                let a = take("lora_A.weight", [r * experts, cols])?;
                let b = take("lora_B.weight", [rows, r * experts])?;
                for e in 0..experts {
                    let a_e = a.narrow(0, e * r, r)?.contiguous()?;
                    let columns: Vec<u32> = (0..r).map(|k| (k * experts + e) as u32).collect();
                    let columns = Tensor::new(columns, b.device())?;
                    let b_e = b.index_select(&columns, 1)?;
                    // (B_e A_e)ᵀ = A_eᵀ B_eᵀ: the linear layer's A is B_eᵀ, its B A_eᵀ.
                    let (a_e, b_e) = if transposed {
                        (b_e.t()?.contiguous()?, a_e.t()?.contiguous()?)
                    } else {
                        (a_e, b_e)
                    };
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

/// An adapter folder's contents: its config and its tensors under PEFT's file names.
pub type AdapterFolder = (LoraConfig, BTreeMap<String, Tensor>);

/// The folder, inside a saved adapter's, that holds it as PEFT on transformers 5 loads it (see
/// [`transformers5_adapter`]).
pub const TRANSFORMERS5_DIR: &str = "transformers5";

/// Where one parameter target's adapter comes from.
enum Source<'a> {
    /// Per-expert adapters to fuse: expert `e`'s `parts[e]`, one adapter per row block of the
    /// parameter (each of `rows` output rows over `inputs` inputs; `None` where a block has none).
    Experts {
        parts: Vec<Vec<Option<&'a LoraAdapter>>>,
        rows: usize,
        inputs: usize,
    },
    /// A 2-D weight's own LoRA, as it is.
    Weight(&'a LoraAdapter),
}

/// One parameter target of the adapter as PEFT holds it on transformers 5: its name, rank `R`
/// (per expert), scaling, whether PEFT nests its wrapper inside another of the same module, and
/// where its tensors come from.
struct ParamTarget<'a> {
    key: String,
    rank: usize,
    scale: f64,
    nested: bool,
    source: Source<'a>,
}

impl<'a> ParamTarget<'a> {
    /// The target of a 2-D parameter `key`: the layer's own LoRA.
    fn weight(key: String, adapter: &'a LoraAdapter) -> Self {
        Self {
            key,
            rank: adapter.rank(),
            scale: adapter.scale,
            nested: false,
            source: Source::Weight(adapter),
        }
    }

    /// The target of a fused expert parameter `key` (see [`Source::Experts`]): rank the largest
    /// sum of an expert's blocks' ranks, scaling the first adapter's. `None` when no expert has
    /// an adapter.
    fn experts(
        key: String,
        parts: Vec<Vec<Option<&'a LoraAdapter>>>,
        rows: usize,
        inputs: usize,
    ) -> Option<Self> {
        let scale = parts.iter().flatten().flatten().next()?.scale;
        let rank = parts
            .iter()
            .map(|p| p.iter().flatten().map(|a| a.rank()).sum::<usize>())
            .max()
            .unwrap_or(0);
        Some(Self {
            key,
            rank,
            scale,
            nested: false,
            source: Source::Experts {
                parts,
                rows,
                inputs,
            },
        })
    }

    /// `lora_A` `[R * E, in]` and `lora_B` `[out, R * E]` as PEFT's `ParamWrapper` reads them.
    /// Fused experts: `A_e` the blocks' A's stacked, `B_e` their B's on the block diagonal, each
    /// scaled by its scaling over the target's.
    fn tensors(&self) -> candle_core::Result<(Tensor, Tensor)> {
        let (parts, rows, inputs) = match &self.source {
            Source::Weight(a) => return Ok((a.a.clone(), a.b.clone())),
            Source::Experts {
                parts,
                rows,
                inputs,
            } => (parts, *rows, *inputs),
        };
        let (experts, rank) = (parts.len(), self.rank);
        let blocks = parts.first().map_or(0, Vec::len);
        let out = rows * blocks;
        // Dense host buffers: the adapters are small, and the interleaved layout is plain
        // indexing.
        let mut a = vec![0f32; rank * experts * inputs];
        let mut b = vec![0f32; out * rank * experts];
        let mut first = None;
        for (e, expert) in parts.iter().enumerate() {
            let mut col = 0;
            for (block, adapter) in expert.iter().enumerate() {
                let Some(adapter) = adapter else {
                    continue;
                };
                first.get_or_insert(*adapter);
                let r = adapter.rank();
                let a_rows: Vec<Vec<f32>> = adapter.a.to_dtype(DType::F32)?.to_vec2()?;
                let factor = (adapter.scale / self.scale) as f32;
                let b_rows: Vec<Vec<f32>> = adapter.b.to_dtype(DType::F32)?.to_vec2()?;
                for k in 0..r {
                    // A_e's row col + k is fused row e * R + col + k.
                    let at = (e * rank + col + k) * inputs;
                    a[at..at + inputs].copy_from_slice(&a_rows[k]);
                    // B_e's column col + k is fused column (col + k) * E + e.
                    let fused_col = (col + k) * experts + e;
                    for (i, row) in b_rows.iter().enumerate() {
                        b[(block * rows + i) * rank * experts + fused_col] = row[k] * factor;
                    }
                }
                col += r;
            }
        }
        let first = first.expect("a fused target has an adapter");
        let (device, dtype) = (first.a.device(), first.a.dtype());
        Ok((
            Tensor::from_vec(a, (rank * experts, inputs), device)?.to_dtype(dtype)?,
            Tensor::from_vec(b, (out, rank * experts), device)?.to_dtype(dtype)?,
        ))
    }
}

/// The three projections of a gated expert: gate, up, down.
fn expert_projections(moe: &Moe) -> Vec<[&crate::Linear; 3]> {
    moe.experts
        .iter()
        .filter_map(|e| match &e.gate_up {
            GateUpProjection::Separate { gate_proj, up_proj } => {
                Some([gate_proj, up_proj, &e.down_proj])
            }
            _ => None,
        })
        .collect()
}

/// The intermediate size of `model`'s experts (0 without experts).
fn expert_intermediate_size(model: &CausalLm) -> usize {
    match (&model.config.moe, model.config.gemma4_moe()) {
        (Some(m), _) => m.expert_intermediate_size,
        (None, Some((_, _, inter))) => inter,
        (None, None) => 0,
    }
}

/// The adapter of `model` as PEFT holds it on transformers 5 (see [`transformers5_adapter`]),
/// without its tensors: the config, the parameter targets, and the prefixes of the per-expert and
/// router tensors they replace. Cheap: no tensor is read.
struct Transformers5Plan<'a> {
    config: LoraConfig,
    targets: Vec<ParamTarget<'a>>,
    replaced: Vec<String>,
}

/// The [`Transformers5Plan`] of `model` under `config`: `Ok(None)` when no expert or router has
/// an adapter, `Err` when the adapter cannot be written so.
fn transformers5_plan<'a>(
    model: &'a CausalLm,
    config: &LoraConfig,
) -> Result<Option<Transformers5Plan<'a>>, String> {
    let sparse = sparse_layers(model);
    let adapted = |l: &crate::Linear| l.adapter.is_some();
    let any = sparse.iter().any(|(_, moe)| {
        adapted(&moe.router) || expert_projections(moe).iter().flatten().any(|l| adapted(l))
    });
    if !any {
        return Ok(None);
    }
    let TargetModules::Names(names) = &config.target_modules else {
        return Err("target_modules is a regex".into());
    };
    let (inter, hidden) = (expert_intermediate_size(model), model.config.hidden_size);
    let mut targets: Vec<ParamTarget> = Vec::new();
    let mut replaced = Vec::new();
    for (i, moe) in &sparse {
        let ours = format!("{PEFT_PREFIX}model.layers.{i}.{}", moe.block_name());
        let experts = format!("model.layers.{i}.mlp.experts");
        let projections = expert_projections(moe);
        let blocks = |which: &[usize]| -> Vec<Vec<Option<&LoraAdapter>>> {
            projections
                .iter()
                .map(|p| which.iter().map(|&w| p[w].adapter.as_ref()).collect())
                .collect()
        };
        let gate_up = ParamTarget::experts(
            format!("{experts}.gate_up_proj"),
            blocks(&[0, 1]),
            inter,
            hidden,
        );
        let down =
            ParamTarget::experts(format!("{experts}.down_proj"), blocks(&[2]), hidden, inter);
        // PEFT wraps gate_up_proj first: with both, its tensors sit one `.base_layer` inside.
        let both = gate_up.is_some() && down.is_some();
        targets.extend(gate_up.map(|t| ParamTarget { nested: both, ..t }));
        targets.extend(down);
        replaced.push(format!("{ours}.experts."));
        if let Some(a) = &moe.router.adapter {
            let router = moe.transformers5_router_name();
            targets.push(ParamTarget::weight(
                format!("model.layers.{i}.mlp.{router}.weight"),
                a,
            ));
            replaced.push(format!("{ours}.gate."));
        }
    }
    // PEFT on transformers 5 turns every module target named like an expert projection or the
    // router (`gate_proj`, `w1`, `gate`, ...) into a parameter target of the fused experts, which
    // would drop a shared expert's or a dense layer's adapter of that name: those layers are
    // parameter targets too (their 2-D `weight`).
    let renamed: Vec<&str> = sparse.first().map_or(Vec::new(), |(_, moe)| {
        let mut names = moe.projection_names().to_vec();
        names.push("gate");
        names
    });
    let mut others: Vec<(String, (usize, f64))> = Vec::new();
    for (name, linear) in model.linears() {
        let Some(a) = &linear.adapter else {
            continue;
        };
        if fused_in_transformers5(&name, &sparse) {
            continue;
        }
        let leaf = name.rsplit('.').next().unwrap_or("");
        if renamed.contains(&leaf) {
            targets.push(ParamTarget::weight(format!("{name}.weight"), a));
        } else {
            others.push((name, (a.rank(), a.scale)));
        }
    }
    let param_adapters = targets.iter().flat_map(|t| match &t.source {
        Source::Weight(a) => vec![*a],
        Source::Experts { parts, .. } => parts.iter().flatten().flatten().copied().collect(),
    });
    for a in param_adapters {
        if a.dora_magnitude.is_some() || a.bias.is_some() {
            return Err(
                "an adapter on an expert, a router or a layer named like them is DoRA \
                        or has a LoRA bias, which PEFT's adapters on parameters cannot hold"
                    .into(),
            );
        }
    }
    let mut out = config.clone();
    out.lora_dropout = 0.0;
    // Module targets left: those still naming an adapted `nn.Linear` of transformers 5.
    let kept: Vec<String> = names
        .iter()
        .filter(|t| {
            others
                .iter()
                .any(|(n, _)| n == *t || n.ends_with(&format!(".{t}")))
                || (*t == "embed_tokens" && model.embed_adapter.is_some())
        })
        .cloned()
        .collect();
    out.target_modules = TargetModules::Names(kept);
    out.target_parameters = targets.iter().map(|t| t.key.clone()).collect();
    let alpha = |t: &ParamTarget| {
        let r = t.rank as f64;
        t.scale * if config.use_rslora { r.sqrt() } else { r }
    };
    // Each parameter's own pattern, its name with the dots escaped, in parentheses: the file
    // orders patterns by name and PEFT takes the first that matches, and `(` sorts before any
    // module name a pattern would start with.
    let exact = |t: &ParamTarget| format!("({})", t.key.replace('.', "\\."));
    let mut ranks: Vec<(String, usize)> = targets.iter().map(|t| (exact(t), t.rank)).collect();
    ranks.extend(out.rank_pattern.iter().cloned());
    out.rank_pattern = ranks;
    let mut alphas: Vec<(String, f64)> = targets.iter().map(|t| (exact(t), alpha(t))).collect();
    alphas.extend(out.alpha_pattern.iter().cloned());
    out.alpha_pattern = alphas;
    // Check that every target gets its rank and scaling once read back.
    let text = out.to_json().to_string();
    let read = LoraConfig::parse(&text)?;
    let close = |x: f64, y: f64| (x - y).abs() <= 1e-9 * x.abs().max(1.0);
    for t in &targets {
        let (r, a) = read.rank_and_alpha(&t.key);
        if r != t.rank || !close(lora_scaling(r, a, config.use_rslora), t.scale) {
            return Err(format!(
                "the adapter's rank_pattern / alpha_pattern also match '{}'",
                t.key
            ));
        }
    }
    for (name, (r, scale)) in &others {
        match read.resolve(name) {
            Some((rr, s)) if rr == *r && close(s, *scale) => {}
            _ => return Err(format!("'{name}' would not keep its rank and scaling")),
        }
    }
    Ok(Some(Transformers5Plan {
        config: read,
        targets,
        replaced,
    }))
}

/// Whether `model`'s adapters go out as PEFT holds them on transformers 5 too
/// ([`save_transformers5_adapter`] writes them): `Ok(true)` when an expert or router has an
/// adapter, `Err` saying why they cannot be. Reads no tensor.
pub fn has_transformers5_adapter(model: &CausalLm, config: &LoraConfig) -> Result<bool, String> {
    Ok(transformers5_plan(model, config)?.is_some())
}

/// `model`'s adapters (trained with ferrotune's per-expert modules, transformers 4.x's names) as
/// PEFT holds them on transformers 5, where experts are fused parameters and the router a bare
/// weight: the config and the tensors of that adapter folder. `Ok(None)` when no expert or router
/// has an adapter (the adapter loads on transformers 5 as it is); `Err` says why it cannot be
/// written so (DoRA or LoRA biases on experts, which PEFT's `ParamWrapper` refuses; a regex
/// `target_modules`).
///
/// The conversion is exact: expert `e`'s gate and up adapters (ranks `r_g`, `r_u`) become one of
/// rank `r_g + r_u` on the fused `gate_up_proj` (A's stacked, B's on the block diagonal), and
/// `rank_pattern` / `alpha_pattern` give each fused parameter its rank and scaling (B's rescaled
/// where experts' scalings differ). Other layers named like an expert projection or the router
/// (a shared expert's, a dense layer's `gate_proj`) are targeted by their 2-D `weight`, since PEFT
/// on transformers 5 turns such module names into expert targets. Dropout is written as 0, which
/// PEFT's `ParamWrapper` requires (it only acts in training).
pub fn transformers5_adapter(
    model: &CausalLm,
    config: &LoraConfig,
) -> Result<Option<AdapterFolder>, String> {
    let Some(plan) = transformers5_plan(model, config)? else {
        return Ok(None);
    };
    let mut tensors = crate::peft::saved_tensors(model, config).map_err(|e| e.to_string())?;
    // The per-expert and router tensors give way to the parameter targets'.
    tensors.retain(|k, _| !plan.replaced.iter().any(|p| k.starts_with(p.as_str())));
    for t in &plan.targets {
        let (a, b) = t.tensors().map_err(|e| e.to_string())?;
        let stem = format!(
            "{PEFT_PREFIX}{}{}",
            t.key.rsplit_once('.').map_or("", |(m, _)| m),
            if t.nested { ".base_layer" } else { "" }
        );
        tensors.insert(format!("{stem}.lora_A.weight"), a);
        tensors.insert(format!("{stem}.lora_B.weight"), b);
    }
    Ok(Some((plan.config, tensors)))
}

/// The sparse (mixture-of-experts) layers of `model` with their indices.
pub(crate) fn sparse_layers(model: &CausalLm) -> Vec<(usize, &Moe)> {
    model
        .layers
        .iter()
        .enumerate()
        .filter_map(|(i, l)| match &l.mlp {
            FeedForward::Sparse(moe) => Some((i, moe.as_ref())),
            FeedForward::Dense(_) | FeedForward::GptOss(_) => None,
        })
        .collect()
}

/// Whether ferrotune's linear layer `name` is no `nn.Linear` in transformers 5: a single expert
/// (a slice of the fused parameters) or the router (a bare weight) of one of the `sparse` layers.
pub(crate) fn fused_in_transformers5(name: &str, sparse: &[(usize, &Moe)]) -> bool {
    sparse.iter().any(|(i, moe)| {
        let block = format!("model.layers.{i}.{}", moe.block_name());
        name == format!("{block}.gate") || name.starts_with(&format!("{block}.experts."))
    })
}

/// Writes [`transformers5_adapter`]'s folder into `dir/transformers5` when `model` has
/// adapters on experts or routers; returns whether it did.
pub fn save_transformers5_adapter(
    model: &CausalLm,
    config: &LoraConfig,
    dir: &Path,
) -> Result<bool, ModelError> {
    match transformers5_adapter(model, config).map_err(ModelError::Msg)? {
        None => Ok(false),
        Some((config, tensors)) => {
            crate::peft::write_adapter_files(&dir.join(TRANSFORMERS5_DIR), &config, tensors)?;
            Ok(true)
        }
    }
}
