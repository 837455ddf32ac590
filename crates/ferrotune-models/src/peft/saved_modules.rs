//! PEFT's `modules_to_save` (the embedding and head trained in full), trainable tokens, and the
//! embedding and head weights PEFT saves beside an adapter: loading them into a model (untying
//! a tied head, resizing the vocabulary) and deciding what a saved adapter holds.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Tensor, Var};
use serde_json::Value;

use super::config::{LoraConfig, TargetModules};
use super::pattern::full_match;
use super::{EMBED_MODULE, MLLAMA_EMBEDDING, PEFT_PREFIX};
use crate::error::ModelError;
use crate::model::CausalLm;

/// Unties an output head tied to the embedding: the head keeps the embedding's current tensor
/// (shared storage, no copy) while the embedding may change on its own, and the config says so.
/// PEFT runs a tied head this way when the embedding alone is adapted or saved; untying makes a
/// merge and a saved checkpoint give the same outputs.
pub(super) fn untie_head(model: &mut CausalLm) {
    if !model.config.tie_word_embeddings {
        return;
    }
    model.lm_head.weight = crate::model::BaseWeight::Dense(model.embed_tokens.clone());
    model.config.tie_word_embeddings = false;
    set_raw_config(model, "tie_word_embeddings", false.into());
}

/// The vocabulary size of `model` after its embedding was replaced by one of `rows` rows.
fn set_vocab_size(model: &mut CausalLm, rows: usize) {
    if rows != model.config.vocab_size {
        model.config.vocab_size = rows;
        set_raw_config(model, "vocab_size", rows.into());
    }
}

/// Sets `key` in the model's `config.json` as read, which a saved checkpoint writes back.
fn set_raw_config(model: &mut CausalLm, key: &str, value: Value) {
    if let Some(raw) = model.config.raw.as_object_mut() {
        raw.insert(key.into(), value);
    }
}

/// The file name of PEFT's trainable-token rows (`TrainableTokensLayer.trainable_tokens_delta`).
pub(super) fn trainable_tokens_key() -> String {
    format!("{PEFT_PREFIX}{EMBED_MODULE}.token_adapter.trainable_tokens_delta")
}

/// Puts PEFT's trainable tokens in place (taking their tensor out of `tensors`): the rows
/// `trainable_token_indices` of the embedding become the saved values, which is what PEFT's
/// `TrainableTokensLayer` runs (the values replace the rows; they are not added) and what its
/// merge writes. A head tied to the embedding follows, as PEFT ties its layer to the embedding's.
pub(super) fn load_trainable_tokens(
    model: &mut CausalLm,
    config: &LoraConfig,
    tensors: &mut HashMap<String, Tensor>,
    source: &str,
) -> Result<(), ModelError> {
    let key = trainable_tokens_key();
    let err = |msg: String| ModelError::Msg(format!("{source}: {msg}"));
    let indices = &config.trainable_token_indices;
    let Some(values) = tensors.remove(&key) else {
        if indices.is_empty() {
            return Ok(());
        }
        return Err(err(format!(
            "trainable_token_indices is set but '{key}' is missing"
        )));
    };
    if indices.is_empty() {
        return Err(err(format!(
            "'{key}' is present but trainable_token_indices is not set"
        )));
    }
    if config.resolve_module(&model.config, EMBED_MODULE).is_some() {
        return Err(err(
            "trainable_token_indices and an adapter on embed_tokens together are not supported"
                .into(),
        ));
    }
    let (vocab, hidden) = model.embed_tokens.dims2()?;
    if values.dims() != [indices.len(), hidden] {
        return Err(err(format!(
            "'{key}' has shape {:?}, expected [{}, {hidden}] (one row per trainable token)",
            values.dims(),
            indices.len()
        )));
    }
    // Each row's source in `values`, and whether it is replaced.
    let mut source_row = vec![0u32; vocab];
    let mut replaced = vec![0u8; vocab];
    for (k, &id) in indices.iter().enumerate() {
        let row = id as usize;
        if row >= vocab {
            return Err(err(format!(
                "trainable token {id} is outside the vocabulary of {vocab}"
            )));
        }
        if replaced[row] != 0 {
            return Err(err(format!("trainable_token_indices lists {id} twice")));
        }
        source_row[row] = k as u32;
        replaced[row] = 1;
    }
    let device = model.embed_tokens.device().clone();
    let values = values
        .to_dtype(model.embed_tokens.dtype())?
        .to_device(&device)?;
    let spread = values.index_select(&Tensor::new(source_row, &device)?, 0)?;
    let mask = Tensor::from_vec(replaced, (vocab, 1), &device)?.broadcast_as((vocab, hidden))?;
    model.embed_tokens = mask.where_cond(&spread, &model.embed_tokens)?;
    model.retie_head();
    Ok(())
}

/// The modules whose base weights PEFT saves beside their adapters: the token embedding and the
/// language-model head (`get_input_embeddings`/`get_output_embeddings`; a classifier's `score`
/// is neither).
fn embedding_modules(model: &CausalLm) -> Vec<&'static str> {
    let mut out = vec![EMBED_MODULE];
    if model.head_name() == "lm_head" {
        out.push("lm_head");
    }
    out
}

/// PEFT's `save_embedding_layers="auto"` (its default) decision: the base weights of adapted
/// embedding layers are saved when `target_modules` names `embed_tokens` or `lm_head` (a list
/// entry equal to one of them, or a regex that matches either module's name).
pub(super) fn saves_embedding_layers(model: &CausalLm, config: &LoraConfig) -> bool {
    match &config.target_modules {
        TargetModules::Names(names) => names.iter().any(|n| n == "embed_tokens" || n == "lm_head"),
        TargetModules::Regex(r) if r == "all-linear" => false,
        TargetModules::Regex(r) => embedding_modules(model).iter().any(|m| full_match(r, m)),
    }
}

/// PEFT's test for saving the embedding layers of an adapter whose embeddings are not targeted:
/// the model's vocabulary differs from that of the base's `config.json`
/// (`base_model_name_or_path`, when it is a local folder).
pub(super) fn vocabulary_resized(model: &CausalLm, config: &LoraConfig) -> bool {
    let Some(base) = &config.base_model_name_or_path else {
        return false;
    };
    let Ok(text) = std::fs::read_to_string(Path::new(base).join("config.json")) else {
        return false;
    };
    let Ok(json) = serde_json::from_str::<Value>(&text) else {
        return false;
    };
    let vocab = json["vocab_size"]
        .as_u64()
        .or_else(|| json["text_config"]["vocab_size"].as_u64());
    vocab.is_some_and(|v| v as usize != model.config.vocab_size)
}

/// Loads the embedding and head weights PEFT saves beside an adapter, taking them out of
/// `tensors`: the base weights of an adapted embedding or head
/// (`base_model.model.{module}.base_layer.weight`, and Phi-2's head `.bias`), and the whole
/// embedding and head when the vocabulary was resized for the adapter
/// (`base_model.model.model.embed_tokens.weight`, `base_model.model.lm_head.weight`). PEFT loads
/// them into the base parameters in place, so a head tied to the embedding follows it. A
/// different number of rows (a resized vocabulary) is taken when the embedding and the head end
/// up with the same number.
pub(super) fn load_base_layers(
    model: &mut CausalLm,
    tensors: &mut HashMap<String, Tensor>,
    source: &str,
) -> Result<(), ModelError> {
    let err = |msg: String| ModelError::Msg(format!("{source}: {msg}"));
    let (dtype, device) = (model.dtype(), model.device().clone());
    let hidden = model.config.hidden_size;
    let mut changed = false;
    let keys: Vec<(&str, &str, String)> = embedding_modules(model)
        .into_iter()
        .flat_map(|module| {
            ["weight", "bias"].into_iter().flat_map(move |param| {
                [
                    (
                        module,
                        param,
                        format!("{PEFT_PREFIX}{module}.base_layer.{param}"),
                    ),
                    (module, param, format!("{PEFT_PREFIX}{module}.{param}")),
                ]
            })
        })
        .collect();
    for (module, param, key) in keys {
        let Some(t) = tensors.remove(&key) else {
            continue;
        };
        let t = t.to_dtype(dtype)?.to_device(&device)?;
        let tied = model.config.tie_word_embeddings;
        match (module, param) {
            (_, "weight") => {
                if t.rank() != 2 || t.dim(1)? != hidden {
                    return Err(err(format!(
                        "'{key}' has shape {:?}, expected [rows, {hidden}]",
                        t.dims()
                    )));
                }
                if module == EMBED_MODULE || tied {
                    model.embed_tokens = t;
                    model.retie_head();
                } else {
                    model.lm_head.weight = crate::model::BaseWeight::Dense(t);
                    model.lm_head.packed = None;
                }
                changed = true;
            }
            ("lm_head", "bias") => {
                if model.lm_head.bias.is_none() {
                    return Err(err(format!("'{key}': the model's head has no bias")));
                }
                model.lm_head.bias = Some(t);
            }
            _ => return Err(err(format!("'{key}': the embedding has no bias"))),
        }
    }
    if changed {
        let rows = model.embed_tokens.dim(0)?;
        let head_rows = model.lm_head.weight.dims2()?.0;
        if rows != head_rows {
            return Err(err(format!(
                "the saved base weights leave the embedding with {rows} rows and the head with \
                 {head_rows}"
            )));
        }
        if let Some(b) = model.lm_head.bias.as_ref().filter(|b| b.dims() != [rows]) {
            return Err(err(format!(
                "the head's bias has shape {:?} for a vocabulary of {rows}",
                b.dims()
            )));
        }
        set_vocab_size(model, rows);
    }
    Ok(())
}

/// Takes out of `tensors` the whole tensors of `modules_to_save` modules, under the model's
/// names (`lm_head.weight`, `model.embed_tokens.weight`). PEFT saves them as
/// `base_model.model.{module}.{param}`, or — for an embedding saved with a resized vocabulary —
/// as the wrapper's `{module}.modules_to_save.{param}` (the trained copy, which is what runs) beside
/// `{module}.original_module.{param}` (the base's, unused while the adapter is on: left out); a
/// module matches when its name ends with an entry, as PEFT matches.
pub(super) fn saved_module_tensors(
    tensors: &mut HashMap<String, Tensor>,
    modules_to_save: &[String],
) -> HashMap<String, Tensor> {
    if modules_to_save.is_empty() {
        return HashMap::new();
    }
    let mut out = HashMap::new();
    let names: Vec<String> = tensors.keys().cloned().collect();
    for key in names {
        let Some(rest) = key.strip_prefix(PEFT_PREFIX) else {
            continue;
        };
        let Some((module, param)) = rest.rsplit_once('.') else {
            continue;
        };
        if param.starts_with("lora_") || module.contains(".lora_") {
            continue;
        }
        let (module, keep) = if let Some(m) = module.strip_suffix(".modules_to_save") {
            (m, true)
        } else if let Some(m) = module.strip_suffix(".original_module") {
            (m, false)
        } else {
            (module, true)
        };
        if !modules_to_save.iter().any(|m| module.ends_with(m.as_str())) {
            continue;
        }
        let t = tensors.remove(&key).expect("listed");
        if keep {
            out.insert(format!("{module}.{param}"), t);
        }
    }
    out
}

/// Puts PEFT's saved whole modules in place of the base's tensors, as `PeftModel` runs them:
/// each replaces the tensor of the same name; an embedding or head with more rows (tokens added
/// with `resize_token_embeddings`) resizes the vocabulary; a head tied to the embedding is untied
/// when either is replaced (PEFT trains a copy of the one module; the other keeps the original).
pub fn replace_saved_modules(
    model: &mut CausalLm,
    saved: HashMap<String, Tensor>,
    source: &str,
) -> Result<(), ModelError> {
    if saved.is_empty() {
        return Ok(());
    }
    let err = |msg: String| ModelError::Msg(format!("{source}: {msg}"));
    let (dtype, device) = (model.dtype(), model.device().clone());
    // A classifier's head is `score` in files and in the model's units alike.
    let mut saved: HashMap<String, Tensor> = saved
        .into_iter()
        .map(|(name, t)| Ok((name, t.to_dtype(dtype)?.to_device(&device)?)))
        .collect::<Result<_, ModelError>>()?;
    let embed_rows = |m: &CausalLm| m.embed_tokens.dim(0).unwrap_or(0);
    if model.config.tie_word_embeddings
        && (saved.contains_key("lm_head.weight") || saved.contains_key("model.embed_tokens.weight"))
    {
        untie_head(model);
        if let Some(head_weight) = saved.remove("lm_head.weight") {
            model.lm_head.weight = crate::model::BaseWeight::Dense(head_weight);
        }
    }
    for unit in model.units() {
        for (name, slot) in model.unit_tensors_mut(unit) {
            let Some(t) = saved.remove(&name) else {
                continue;
            };
            let vocab_rows = name == "model.embed_tokens.weight" || name == "lm_head.weight";
            let fits = t.dims() == slot.dims()
                || (vocab_rows && t.rank() == 2 && t.dim(1)? == slot.dim(1)?);
            if !fits {
                return Err(err(format!(
                    "saved module tensor '{name}' has shape {:?}, the model's {:?}",
                    t.dims(),
                    slot.dims()
                )));
            }
            *slot = t;
        }
    }
    if !saved.is_empty() {
        let mut left: Vec<String> = saved.into_keys().collect();
        left.sort();
        return Err(err(format!(
            "modules_to_save tensor(s) {} match no tensor of the model",
            left.join(", ")
        )));
    }
    model.retie_head();
    let rows = embed_rows(model);
    let head_rows = model.lm_head.weight.dims2().map(|(r, _)| r).unwrap_or(rows);
    if model.config.score_labels.is_none() && head_rows != rows {
        return Err(err(format!(
            "the embedding has {rows} tokens and the output head {head_rows}: save both in \
             modules_to_save when the vocabulary is resized"
        )));
    }
    set_vocab_size(model, rows);
    Ok(())
}

/// The modules of `modules` (PEFT's `modules_to_save`) that `model` trains in full beside its
/// adapters: `(embedding, head)`. Only the token embedding (`embed_tokens`) and the output head
/// (`lm_head`, a classifier's `score`) can be; anything else is an error naming it.
pub(super) fn saved_modules(
    model: &CausalLm,
    modules: &[String],
) -> Result<(bool, bool), ModelError> {
    let head = model.head_name();
    let names = |m: &str, module: &str| module == m || module.ends_with(&format!(".{m}"));
    let (mut embed, mut out_head) = (false, false);
    for m in modules {
        if names(m, EMBED_MODULE) {
            embed = true;
        } else if names(m, head) {
            out_head = true;
        } else if model.config.score_labels.is_some() && names(m, "classifier") {
            // PEFT's SEQ_CLS adapters list every family's head name (`classifier`, `score`);
            // the one the model lacks matches nothing, as in PEFT.
        } else {
            return Err(ModelError::Msg(format!(
                "modules_to_save: '{m}' cannot be trained in full here: only the token \
                 embedding (embed_tokens) and the output head ({head}) can"
            )));
        }
    }
    Ok((embed, out_head))
}

/// Makes PEFT's `modules_to_save` (the token embedding and/or the output head, trained in full
/// beside the adapters) trainable, named as full fine-tuning names them (`model.embed_tokens.weight`,
/// `lm_head.weight`, `lm_head.bias`, a classifier's `score.weight`: the names sharded training
/// finds them by). As PEFT
/// trains a copy of each listed module, a head tied to the embedding is untied first: the module
/// not listed keeps the base weights, frozen. A listed module may not also have an adapter.
pub fn make_saved_modules_trainable(
    model: &mut CausalLm,
    modules: &[String],
) -> Result<Vec<(String, Var)>, ModelError> {
    let (embed, head) = saved_modules(model, modules)?;
    let mut out = Vec::new();
    if !embed && !head {
        return Ok(out);
    }
    if embed && model.config.mllama.is_some() {
        return Err(ModelError::Msg(MLLAMA_EMBEDDING.into()));
    }
    if (embed && model.embed_adapter.is_some()) || (head && model.lm_head.adapter.is_some()) {
        return Err(ModelError::Msg(
            "modules_to_save: a module listed there cannot also have a LoRA adapter (PEFT \
             refuses the pair too)"
                .into(),
        ));
    }
    untie_head(model);
    let var = crate::model::make_var;
    if embed {
        var(
            &mut model.embed_tokens,
            format!("{EMBED_MODULE}.weight"),
            &mut out,
        )?;
    }
    if head {
        // `lm_head`, or a classifier's `score`, as full fine-tuning names it.
        let name = model.head_name();
        let linear = &mut model.lm_head;
        // The weight changes every step: a packed (GGUF block) copy would go stale.
        linear.packed = None;
        var(
            linear.weight.as_dense_mut()?,
            format!("{name}.weight"),
            &mut out,
        )?;
        if let Some(b) = &mut linear.bias {
            var(b, format!("{name}.bias"), &mut out)?;
        }
    }
    Ok(out)
}
