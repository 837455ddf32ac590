//! Merging adapters into the base weights (PEFT's `merge_and_unload`).

use std::collections::HashMap;

use candle_core::Tensor;

use super::attach::head_shares_embedding_adapter;
use crate::error::ModelError;
use crate::model::lora::LoraAdapter;
use crate::model::CausalLm;

/// All weights of `model` by HF name with the adapters merged in (PEFT's `merge_and_unload`
/// followed by `save_pretrained`). With tied embeddings `lm_head.weight` is omitted, as in HF
/// checkpoints. A head tied to the embedding is untied when either gets an adapter, so each
/// merges on its own; an adapter on a head still tied (set up by other means) is refused, since
/// merging it would change the input embeddings too.
pub fn merged_tensors(model: &CausalLm) -> Result<HashMap<String, Tensor>, ModelError> {
    if let Some(why) = merge_refusal(model) {
        return Err(ModelError::Msg(why));
    }
    let mut out = HashMap::new();
    let embed = match &model.embed_adapter {
        Some(adapter) => adapter.merged_embedding(&model.embed_tokens)?.detach(),
        None => model.embed_tokens.clone(),
    };
    out.insert("model.embed_tokens.weight".to_string(), embed);
    for (name, t) in model.final_norm_tensors() {
        out.insert(name, t.clone());
    }
    if let Some(ple) = &model.per_layer_embedding {
        out.insert(crate::model::PER_LAYER_TABLE.to_string(), ple.table.clone());
        out.insert(crate::model::PER_LAYER_NORM.to_string(), ple.norm.clone());
    }
    for (i, layer) in model.layers.iter().enumerate() {
        for (name, t) in layer.norms().into_iter().chain(layer.buffers()) {
            out.insert(format!("model.layers.{i}.{name}"), t.clone());
        }
    }
    let tied = model.config.tie_word_embeddings;
    let shared_head = head_shares_embedding_adapter(model);
    for (name, linear) in model.linears() {
        if name == "lm_head" && tied {
            // A head sharing the embedding's adapter is merged with the embedding.
            if linear.adapter.is_some() && !shared_head {
                return Err(ModelError::Msg(
                    "cannot merge an lm_head adapter into tied embeddings: the merged weight \
                     would also replace the input embeddings"
                        .into(),
                ));
            }
            // The weight is the embedding's; a bias is the head's own.
            if let Some(b) = &linear.bias {
                out.insert("lm_head.bias".to_string(), b.clone());
            }
            continue;
        }
        let (weight, bias) = match &linear.adapter {
            Some(adapter) => (
                adapter.merged_weight(&*linear.weight.dense()?)?.detach(),
                merged_bias(&name, adapter, linear.bias.as_ref())?,
            ),
            None => (linear.weight.dense()?.into_owned(), linear.bias.clone()),
        };
        out.insert(format!("{name}.weight"), weight);
        if let Some(b) = bias {
            out.insert(format!("{name}.bias"), b);
        }
    }
    // gpt-oss's fused experts with their adapters (`target_parameters`) merged in.
    out.extend(super::gpt_oss_params::merged(model)?);
    crate::checkpoint::to_saved_layout(&model.config, out)
}

/// Why `model`'s adapters cannot be merged into its weights, when they cannot: a LoRA bias
/// (`lora_bias`) on a layer without a bias of its own, which the merged checkpoint's config could
/// not give it (PEFT refuses such a merge too).
pub fn merge_refusal(model: &CausalLm) -> Option<String> {
    let linears = model.linears();
    let (name, _) = linears
        .iter()
        .find(|(_, l)| l.bias.is_none() && l.adapter.as_ref().is_some_and(|a| a.bias.is_some()))?;
    Some(format!(
        "cannot merge the adapters: '{name}' has a LoRA bias (lora_bias) but no bias of its own \
         to merge it into (PEFT cannot merge it either)"
    ))
}

/// The bias of module `name` with its adapter merged in ([`LoraAdapter::merged_bias`]); the
/// error names the module.
fn merged_bias(
    name: &str,
    adapter: &LoraAdapter,
    base_bias: Option<&Tensor>,
) -> Result<Option<Tensor>, ModelError> {
    let bias = adapter
        .merged_bias(base_bias)
        .map_err(|e| ModelError::Msg(format!("cannot merge '{name}': {e}")))?;
    Ok(bias.map(|b| b.detach()))
}

/// Merges every adapter into its base weight and removes the adapters (PEFT's
/// `merge_and_unload`). Packed (GGUF) copies of merged weights are dropped: they no longer hold
/// the layer's values.
pub fn merge_and_unload(model: &mut CausalLm) -> Result<(), ModelError> {
    // Refused before anything is merged, so that an error leaves the model as it was.
    if let Some(why) = merge_refusal(model) {
        return Err(ModelError::Msg(why));
    }
    if head_shares_embedding_adapter(model) {
        // The head follows the merged embedding it is tied to.
        model.lm_head.adapter = None;
    }
    if let Some(adapter) = model.embed_adapter.take() {
        // A head with its own weights keeps the base weights (it was untied when the adapter
        // was attached); a tied one follows the merged embedding.
        model.embed_tokens = adapter.merged_embedding(&model.embed_tokens)?.detach();
        model.retie_head();
    }
    let tied = model.config.tie_word_embeddings;
    for (name, linear) in model.linears_mut() {
        if let Some(adapter) = linear.adapter.take() {
            if name == "lm_head" && tied {
                linear.adapter = Some(adapter);
                return Err(ModelError::Msg(
                    "cannot merge an lm_head adapter into tied embeddings".into(),
                ));
            }
            let bias = merged_bias(&name, &adapter, linear.bias.as_ref())?;
            let merged = adapter.merged_weight(&*linear.weight.dense()?)?.detach();
            linear.weight = crate::model::BaseWeight::Dense(merged);
            linear.bias = bias;
            linear.packed = None;
        }
    }
    super::gpt_oss_params::merge_and_unload(model)
}
