//! Attaching adapters to a model: from PEFT-named tensors ([`attach_adapter`]) or fresh for
//! training ([`add_adapter`]), their trainable parameters, and running without them.

use std::collections::HashMap;

use candle_core::{Tensor, Var};

use super::config::{targeted_modules, LoraConfig};
use super::saved_modules::untie_head;
use super::torchtune_adapter::same_values;
use super::{
    bias_file_key, embed_file_keys, file_keys, EMBED_MODULE, MLLAMA_EMBEDDING, PEFT_PREFIX,
    SHARED_HEAD_TRAINING,
};
use crate::error::ModelError;
use crate::model::lora::{LoraAdapter, SplitMix64};
use crate::model::CausalLm;

/// The adapter of a head that shares the embedding's (`ensure_weight_tying`): PEFT's
/// `tied_adapter`, `lora_A = lora_embedding_B.T`, `lora_B = lora_embedding_A.T`, so that the
/// head's delta is the embedding's transposed and the two stay tied when merged.
fn shared_head_adapter(embed: &LoraAdapter) -> candle_core::Result<LoraAdapter> {
    Ok(LoraAdapter::new(embed.b.t()?, embed.a.t()?, embed.scale))
}

/// Whether `model`'s head is tied to the embedding and its adapter is the embedding's
/// (`ensure_weight_tying`), so that merging the embedding merges the head.
pub(super) fn head_shares_embedding_adapter(model: &CausalLm) -> bool {
    let (Some(embed), Some(head)) = (&model.embed_adapter, &model.lm_head.adapter) else {
        return false;
    };
    let same = |x: &Tensor, y: candle_core::Result<Tensor>| y.is_ok_and(|y| same_values(x, &y));
    model.config.tie_word_embeddings
        && head.dora_magnitude.is_none()
        && same(&head.a, embed.b.t())
        && same(&head.b, embed.a.t())
}

/// Attaches adapters from PEFT-named tensors (`base_model.model.{module}.lora_A.weight`, ...) to
/// `model` under `config`. `source` names the tensors' origin in errors.
pub fn attach_adapter(
    model: &mut CausalLm,
    config: &LoraConfig,
    mut tensors: HashMap<String, Tensor>,
    source: &str,
) -> Result<(), ModelError> {
    // An adapter made on transformers 5 (PEFT creates one there from module names alone, as the
    // experts are no modules) holds no tensor of a single expert or of a router; one made on
    // transformers 4 has them wherever its names reach.
    let sparse = super::peft_params::sparse_layers(model);
    let per_expert = tensors.keys().any(|k| {
        let module = k.strip_prefix(PEFT_PREFIX).unwrap_or(k);
        let module = module.split(".lora_").next().unwrap_or(module);
        super::peft_params::fused_in_transformers5(module, &sparse)
    });
    // Llama 4's routers are modules in both versions, its experts in neither.
    let transformers5 =
        !model.config.llama4_names && (!config.target_parameters.is_empty() || !per_expert);
    let mut targets = targeted_modules(model, config, transformers5)
        .map_err(|m| ModelError::Msg(format!("{source}: {m}")))?;
    let experts = super::gpt_oss_params::read(model, config, &mut tensors, source)?;
    for (name, r, scale) in super::peft_params::expand(model, config, &mut tensors, source)? {
        if targets.linears.iter().any(|(n, _, _)| *n == name) {
            return Err(ModelError::Msg(format!(
                "{source}: '{name}' is targeted by both target_modules and target_parameters"
            )));
        }
        targets.linears.push((name, r, scale));
    }
    let dtype = model.dtype();
    let device = model.device().clone();
    let names: std::collections::HashSet<String> = tensors.keys().cloned().collect();
    let has = |name: &str| names.contains(name);
    let mut take = |name: &str, shape: &[usize]| -> Result<Tensor, ModelError> {
        let t = tensors
            .remove(name)
            .ok_or_else(|| ModelError::Msg(format!("{source}: missing adapter tensor '{name}'")))?;
        if t.dims() != shape {
            return Err(ModelError::Msg(format!(
                "{source}: adapter tensor '{name}' has shape {:?}, expected {shape:?}",
                t.dims()
            )));
        }
        Ok(t.to_dtype(dtype)?.to_device(&device)?)
    };
    let mut shapes: HashMap<String, (usize, usize)> = model
        .linears()
        .into_iter()
        .map(|(n, l)| {
            let (out, inp) = l.weight.dims2().unwrap_or((0, 0));
            (n, (out, inp))
        })
        .collect();
    // The embedding as PEFT's adapter sees it: a linear map from the vocabulary, `[hidden, vocab]`.
    let (vocab, hidden) = model.embed_tokens.dims2()?;
    shapes.insert(EMBED_MODULE.to_string(), (hidden, vocab));
    let embed_target = targets
        .embed
        .map(|(r, scale)| (EMBED_MODULE.to_string(), r, scale));
    let mut adapters = HashMap::new();
    for (i, (module, r, scale)) in targets.linears.iter().chain(&embed_target).enumerate() {
        let (out, inp) = shapes[module];
        let (ka, kb, km) = if module == EMBED_MODULE {
            embed_file_keys()
        } else {
            file_keys(module)
        };
        let a = take(&ka, &[*r, inp])?;
        let b = take(&kb, &[out, *r])?;
        let mut adapter =
            LoraAdapter::new(a, b, *scale).with_dropout(config.lora_dropout, i as u64);
        if config.use_dora {
            // Files written under the parameter name (`....lora_magnitude_vector.weight`) exist
            // too; PEFT's own saving strips the `.weight`.
            let alt = format!("{km}.weight");
            let key = if !has(&km) && has(&alt) { alt } else { km };
            adapter = adapter.with_dora_magnitude(take(&key, &[out])?);
        }
        if config.lora_bias {
            adapter = adapter.with_bias(take(&bias_file_key(module), &[out])?);
        }
        adapters.insert(module.clone(), adapter);
    }
    if targets.head_shares_embed {
        let embed = &adapters[EMBED_MODULE];
        let head = shared_head_adapter(embed)?;
        // PEFT's file holds the head's tensors too: the embedding's, transposed.
        let (ka, kb, _) = file_keys("lm_head");
        for (key, want) in [(ka, &head.a), (kb, &head.b)] {
            let Some(t) = tensors.remove(&key) else {
                continue;
            };
            if !same_values(want, &t) {
                return Err(ModelError::Msg(format!(
                    "{source}: '{key}' is not the embedding's adapter transposed, which \
                     ensure_weight_tying ties the head to"
                )));
            }
        }
        adapters.insert("lm_head".to_string(), head);
    }
    if !tensors.is_empty() {
        let mut extra: Vec<&String> = tensors.keys().collect();
        extra.sort();
        let shown: Vec<&str> = extra.iter().take(5).map(|s| s.as_str()).collect();
        return Err(ModelError::Msg(format!(
            "{source}: {} unexpected adapter tensor(s) not targeted by the config: {}{}",
            extra.len(),
            shown.join(", "),
            if extra.len() > 5 { ", ..." } else { "" }
        )));
    }
    for (name, linear) in model.linears_mut() {
        linear.adapter = adapters.remove(&name);
    }
    super::gpt_oss_params::replace(model, experts);
    model.embed_adapter = adapters.remove(EMBED_MODULE);
    if !targets.head_shares_embed {
        untie_adapted_head(model);
    }
    Ok(())
}

/// Unties a head tied to the embedding when either has an adapter: PEFT adapts the one module,
/// the other keeps the base weights, and a merge must keep them apart (PEFT's own merge adds the
/// delta to the shared weight, which changes the other module too).
fn untie_adapted_head(model: &mut CausalLm) {
    if model.embed_adapter.is_some() || model.lm_head.adapter.is_some() {
        untie_head(model);
    }
}

/// Attaches fresh adapters for training to every module `config` targets, initialised as PEFT
/// does by default (A kaiming-uniform, B zeros, DoRA magnitude = weight row norms), drawing from
/// `seed`. Returns the number of adapted modules.
pub fn add_adapter(
    model: &mut CausalLm,
    config: &LoraConfig,
    seed: u64,
) -> Result<usize, ModelError> {
    let targets = targeted_modules(model, config, false).map_err(ModelError::Msg)?;
    if targets.head_shares_embed {
        return Err(ModelError::Msg(SHARED_HEAD_TRAINING.into()));
    }
    if model.config.mllama.is_some() && targets.embed.is_some() {
        return Err(ModelError::Msg(MLLAMA_EMBEDDING.into()));
    }
    check_adapter_sizes(model, &targets.linears, targets.embed.map(|(r, _)| r))?;
    let mut rng = SplitMix64::new(seed);
    let mut count = 0;
    let embed_adapter = targets
        .embed
        .map(|(r, scale)| {
            LoraAdapter::init_embedding(&model.embed_tokens, r, scale, config.use_dora, &mut rng)
        })
        .transpose()?;
    count += usize::from(embed_adapter.is_some());
    model.embed_adapter = embed_adapter;
    let targets = targets.linears;
    for (name, linear) in model.linears_mut() {
        let Some((i, (_, r, scale))) = targets.iter().enumerate().find(|(_, t)| t.0 == name) else {
            linear.adapter = None;
            continue;
        };
        let mut adapter = LoraAdapter::init(&linear.weight, *r, *scale, config.use_dora, &mut rng)?
            .with_dropout(
                config.lora_dropout,
                seed ^ (i as u64 + 1).wrapping_mul(0x9E37_79B9),
            );
        if config.lora_bias {
            // PEFT starts the bias at zero, like B.
            let zeros = Tensor::zeros(adapter.b.dim(0)?, adapter.b.dtype(), adapter.b.device())?;
            adapter = adapter.with_bias(zeros);
        }
        linear.adapter = Some(adapter);
        count += 1;
    }
    count += super::gpt_oss_params::add(model, config, &mut rng)?;
    untie_adapted_head(model);
    Ok(count)
}

/// Checks fresh adapters' sizes before any is allocated: their bytes (rank × (in + out) per
/// module, overflow-checked) against the machine's memory, so that a rank of 1e11 is an error
/// naming the rank rather than an aborted allocation; and warns about a rank above a module's
/// smaller side, which adds parameters but no expressiveness (PEFT allows it, so it stays
/// allowed).
fn check_adapter_sizes(
    model: &CausalLm,
    linears: &[(String, usize, f64)],
    embed_rank: Option<usize>,
) -> Result<(), ModelError> {
    let shapes: HashMap<String, (usize, usize)> = model
        .linears()
        .into_iter()
        .map(|(n, l)| (n, l.weight.dims2().unwrap_or((0, 0))))
        .collect();
    let embed = embed_rank.map(|r| (EMBED_MODULE.to_string(), model.embed_tokens.dims2(), r));
    let mut elems: Option<u64> = Some(0);
    let mut max_rank = 0;
    let mut over: Option<(String, usize, usize)> = None;
    let sized = linears
        .iter()
        .map(|(name, r, _)| (name.clone(), shapes.get(name).copied(), *r))
        .chain(embed.map(|(n, dims, r)| (n, dims.ok(), r)));
    for (name, dims, r) in sized {
        let Some((out, inp)) = dims else { continue };
        max_rank = max_rank.max(r);
        let per = (out as u64)
            .checked_add(inp as u64)
            .and_then(|w| w.checked_mul(r as u64));
        elems = elems.zip(per).and_then(|(a, b)| a.checked_add(b));
        if r > out.min(inp) && over.is_none() {
            over = Some((name, r, out.min(inp)));
        }
    }
    if let Some((name, r, side)) = over {
        tracing::warn!(
            "LoRA rank {r} on '{name}' is above its smaller side ({side}): ranks past {side} add              parameters but cannot make the update more expressive"
        );
    }
    // A is drawn in f32 before taking the model's dtype: 4 bytes an element at most.
    let bytes = elems.and_then(|e| ferrotune_core::memory::bytes_of(e, 4));
    ferrotune_core::memory::check_fits(
        bytes,
        &format!(
            "the LoRA adapters of rank {max_rank} (the config's lora_rank, r or rank_pattern)"
        ),
        model.device(),
    )
    .map_err(ModelError::Msg)
}

/// Makes every adapter's tensors trainable and returns the [`Var`]s under PEFT's parameter
/// names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`, DoRA's
/// `...lora_magnitude_vector.weight`), the names of PEFT's `named_parameters()` and gradients.
pub fn trainable_parameters(model: &mut CausalLm) -> Result<Vec<(String, Var)>, ModelError> {
    if head_shares_embedding_adapter(model) {
        return Err(ModelError::Msg(SHARED_HEAD_TRAINING.into()));
    }
    let mut out = Vec::new();
    if let Some(adapter) = &mut model.embed_adapter {
        for (suffix, var) in adapter.make_trainable()? {
            // PEFT's `lora.Embedding` holds A and B as bare parameters.
            let suffix = match suffix {
                "lora_A.weight" => "lora_embedding_A",
                "lora_B.weight" => "lora_embedding_B",
                other => other,
            };
            out.push((format!("{PEFT_PREFIX}{EMBED_MODULE}.{suffix}"), var));
        }
    }
    for (name, linear) in model.linears_mut() {
        if let Some(adapter) = &mut linear.adapter {
            for (suffix, var) in adapter.make_trainable()? {
                out.push((format!("{PEFT_PREFIX}{name}.{suffix}"), var));
            }
        }
    }
    out.extend(super::gpt_oss_params::trainable(model)?);
    Ok(out)
}

/// Runs `f` on `model` with every adapter taken out (the base model alone, as inside PEFT's
/// `disable_adapter()` context, which torchtune's LoRA DPO recipes use for the reference
/// model), then puts the adapters back in place.
pub fn with_adapters_disabled<R>(model: &mut CausalLm, f: impl FnOnce(&CausalLm) -> R) -> R {
    let taken: Vec<Option<LoraAdapter>> = model
        .linears_mut()
        .into_iter()
        .map(|(_, linear)| linear.adapter.take())
        .collect();
    let embed = model.embed_adapter.take();
    let experts = super::gpt_oss_params::take_all(model);
    let result = f(model);
    for ((_, linear), adapter) in model.linears_mut().into_iter().zip(taken) {
        linear.adapter = adapter;
    }
    model.embed_adapter = embed;
    super::gpt_oss_params::put_back(model, experts);
    result
}
