//! Writing a PEFT LoRA adapter as a llama.cpp adapter GGUF.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use ferrotune_models::ModelConfig;

use super::*;

/// A PEFT LoRA adapter (`adapter_dir`) of the HF model `base_dir` as llama.cpp's LoRA adapter
/// GGUF (what its `convert_lora_to_gguf.py` writes, for `llama-cli --lora`, Ollama's `ADAPTER`):
/// `general.type` `adapter`, `adapter.type` `lora`, `adapter.lora.alpha`, and per adapted
/// matrix `{gguf name}.lora_a` (`[r, in]`) and `.lora_b` (`[out, r]`, q/k rows in llama.cpp's
/// order where the architecture permutes them), in `outtype` (f32, f16 or bf16).
///
/// llama.cpp scales every matrix by `alpha / r` with one alpha per file: per-module ranks keep
/// their own `r`, but a scale it cannot express (rsLoRA's `alpha / sqrt(r)` beside other ranks,
/// `alpha_pattern`) is folded into `lora_b`. DoRA, adapters on experts or tied embeddings, and
/// `modules_to_save` have no llama.cpp form and are refused (merge instead).
pub fn export_gguf_adapter(
    adapter_dir: &Path,
    base_dir: &Path,
    out: &Path,
    outtype: OutType,
) -> Result<GgufExport> {
    use ferrotune_models::peft::{read_adapter_tensors, LoraConfig, PEFT_PREFIX};
    let lc = LoraConfig::read(adapter_dir)?;
    let merge_instead = "`ferrotune merge` it and export the merged model";
    if lc.use_dora {
        bail!(
            "{}: a DoRA adapter (use_dora); llama.cpp applies LoRA adapters only: {merge_instead}",
            adapter_dir.display()
        );
    }
    if !lc.target_parameters.is_empty() {
        bail!(
            "{}: the adapter targets parameters (target_parameters {:?}), which a llama.cpp \
             adapter cannot hold: {merge_instead}",
            adapter_dir.display(),
            lc.target_parameters
        );
    }
    if lc.lora_bias {
        bail!(
            "{}: the adapter has biases on lora_B (lora_bias), which a llama.cpp adapter cannot \
             hold (its LoRA tensors are A and B only): {merge_instead}",
            adapter_dir.display()
        );
    }
    if !lc.trainable_token_indices.is_empty() {
        bail!(
            "{}: the adapter replaces embedding rows (trainable_token_indices), which a llama.cpp \
             adapter cannot hold: {merge_instead}",
            adapter_dir.display()
        );
    }
    if !lc.modules_to_save.is_empty() {
        bail!(
            "{}: the adapter trains whole modules too (modules_to_save {:?}), which a llama.cpp \
             adapter cannot hold: {merge_instead}",
            adapter_dir.display(),
            lc.modules_to_save
        );
    }
    let ty = match outtype {
        OutType::F32 => GgmlType::F32,
        OutType::F16 => GgmlType::F16,
        OutType::Bf16 => GgmlType::Bf16,
        other => bail!("an adapter is exported as f32, f16 or bf16, not {other:?}"),
    };
    let config_file = base_dir.join("config.json");
    if !config_file.is_file() {
        bail!(
            "{}: the base model's HF folder (with config.json) is needed to name the adapter's \
             tensors as llama.cpp's architecture does",
            base_dir.display()
        );
    }
    let config = ModelConfig::from_hf_file(&config_file)?;
    let entry = architecture(&config)?;
    let (arch, permute) = (entry.name, entry.permuted_qk);
    let naming = naming(&config);
    let (file, tensors) = read_adapter_tensors(adapter_dir)?;

    // module -> (A, B)
    let mut modules: BTreeMap<String, (Option<Tensor>, Option<Tensor>)> = BTreeMap::new();
    let mut notes = Vec::new();
    let mut left_out = 0;
    let mut base_layers = 0;
    for (key, t) in tensors {
        let stem = key.strip_prefix(PEFT_PREFIX).unwrap_or(&key);
        if stem.contains(".base_layer.") {
            // PEFT's default save keeps the base weights of an adapted head beside the adapter;
            // llama.cpp applies the adapter to the base GGUF's own.
            base_layers += 1;
            continue;
        }
        let (module, is_a) = if let Some(m) = stem.strip_suffix(".lora_A.weight") {
            (m, true)
        } else if let Some(m) = stem.strip_suffix(".lora_B.weight") {
            (m, false)
        } else if let Some(m) = stem.strip_suffix(".lora_embedding_A") {
            (m, true)
        } else if let Some(m) = stem.strip_suffix(".lora_embedding_B") {
            (m, false)
        } else {
            bail!(
                "{}: tensor '{key}' is not a LoRA A or B matrix; llama.cpp adapters hold only \
                 those: {merge_instead}",
                file.display()
            );
        };
        let module = if config.text_of_multimodal {
            match config.text_model_name(module) {
                Some(m) => m,
                None => {
                    left_out += 1;
                    continue;
                }
            }
        } else {
            module.to_string()
        };
        let slot = modules.entry(module).or_default();
        if is_a {
            slot.0 = Some(t);
        } else {
            slot.1 = Some(t);
        }
    }
    if base_layers > 0 {
        notes.push(format!(
            "{base_layers} base weight tensor(s) PEFT saved beside the adapter left out (llama.cpp \
             applies the adapter to the base GGUF's weights)"
        ));
    }
    if left_out > 0 {
        notes.push(format!(
            "{left_out} adapter tensors of the vision tower / projector left out (the GGUF is the \
             text model's)"
        ));
    }
    if modules.is_empty() {
        bail!("{}: holds no LoRA matrices", file.display());
    }
    // One alpha for the file: the first module's `scale · r`; other modules' scales relative
    // to it go into their B.
    let mut alpha: Option<f64> = None;
    let mut folded = false;
    let mut plan = Vec::new();
    for (module, (a, b)) in modules {
        let (Some(a), Some(b)) = (a, b) else {
            bail!(
                "{}: module '{module}' lacks its lora_A or lora_B",
                file.display()
            );
        };
        let hf = format!("{module}.weight");
        if expert_part(&hf).is_some() {
            bail!(
                "{}: '{module}' is an expert; llama.cpp's adapters on stacked experts are not \
                 written here: {merge_instead}",
                file.display()
            );
        }
        if module == "lm_head" && config.tie_word_embeddings {
            bail!(
                "{}: the adapter changes lm_head, which the base ties to the embeddings (llama.cpp \
                 has no separate output matrix to adapt): {merge_instead}",
                file.display()
            );
        }
        // PEFT's embedding adapter: A `[r, vocab]`, B `[hidden, r]`, the embedding seen as a
        // linear map from the vocabulary.
        let embedding = module == ferrotune_models::peft::EMBED_MODULE;
        if embedding && config.tie_word_embeddings {
            bail!(
                "{}: the adapter changes the token embedding, which the base ties to the output \
                 head (llama.cpp would adapt the head with it; PEFT does not): {merge_instead}",
                file.display()
            );
        }
        let Some(gguf) = gguf_name(&hf, &naming) else {
            bail!(
                "{}: llama.cpp's '{arch}' has no matrix for adapted module '{module}'",
                file.display()
            );
        };
        let (r, inp) = a.dims2()?;
        let (rows, rb) = b.dims2()?;
        let Some((want_r, scale)) = lc.resolve_module(&config, &module) else {
            bail!(
                "{}: module '{module}' has tensors but adapter_config.json does not target it",
                file.display()
            );
        };
        if r != want_r || rb != r {
            bail!(
                "{}: module '{module}' has lora_A {:?} and lora_B {:?}, adapter_config.json says \
                 rank {want_r}",
                file.display(),
                a.dims(),
                b.dims()
            );
        }
        let alpha_gguf = *alpha.get_or_insert(scale * r as f64);
        let factor = scale * r as f64 / alpha_gguf;
        let mut b_values = b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        if factor != 1.0 {
            folded = true;
            b_values
                .iter_mut()
                .for_each(|v| *v = (*v as f64 * factor) as f32);
        }
        let part = gguf.rsplit('.').nth(1).unwrap_or_default();
        if permute && (part == "attn_q" || part == "attn_k") {
            let heads = if part == "attn_q" {
                config.num_attention_heads
            } else {
                config.num_key_value_heads
            };
            let order = permuted_rows(rows, heads);
            b_values = order
                .iter()
                .flat_map(|&i| b_values[i * r..(i + 1) * r].iter().copied())
                .collect();
        }
        // llama.cpp looks the embedding's lora_a up by token (rows of `[vocab, r]`: A
        // transposed); a linear layer's lora_a is A as it is.
        let (a, a_dims) = if embedding {
            (a.t()?.contiguous()?, vec![r as u64, inp as u64])
        } else {
            (a, vec![inp as u64, r as u64])
        };
        let a_values = a.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        plan.push(Planned {
            name: format!("{gguf}.lora_a"),
            dims: a_dims,
            ty,
            source: Source::Values(a_values),
        });
        plan.push(Planned {
            name: format!("{gguf}.lora_b"),
            dims: vec![r as u64, rows as u64],
            ty,
            source: Source::Values(b_values),
        });
    }
    if folded {
        notes.push(
            "llama.cpp scales every matrix by one alpha / r: the modules whose scale differs \
             (rsLoRA, alpha_pattern) have it folded into their lora_b"
                .into(),
        );
    }
    let mut meta = Metadata::default();
    let name = folder_name(adapter_dir, "adapter");
    meta.string("general.architecture", arch);
    meta.string("general.type", "adapter");
    meta.string("general.name", &name);
    meta.u32("general.file_type", outtype.file_type());
    meta.string("adapter.type", "lora");
    meta.f32("adapter.lora.alpha", alpha.unwrap_or(0.0) as f32);
    let written = write_gguf(out, &plan, &meta, &Weights::Loaded(BTreeMap::new()))?;
    Ok(GgufExport {
        architecture: arch.into(),
        tensors: plan.len(),
        bytes: written,
        pre_tokenizer: String::new(),
        notes,
    })
}
