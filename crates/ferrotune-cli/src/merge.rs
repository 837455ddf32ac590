//! `ferrotune merge`: fold a PEFT adapter into its base model and write an HF checkpoint.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrotune_core::parse_dtype;
use ferrotune_models::{
    parse_shard_size, peft, read_checkpoint, save_hf_checkpoint, CausalLm, CheckpointFormat,
};

use crate::model_io::tokenizer_for;

#[derive(Args)]
pub struct MergeArgs {
    /// The base model: an HF checkpoint folder or a .gguf file.
    #[arg(long)]
    model: PathBuf,
    /// The PEFT adapter folder (adapter_config.json + adapter_model.safetensors).
    #[arg(long)]
    adapter: PathBuf,
    /// Where to write the merged HF checkpoint.
    #[arg(long)]
    output: PathBuf,
    /// dtype of the saved weights: f32 or bf16 (the merge itself is computed in f32).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Largest safetensors file; bigger models are sharded with an index (e.g. 5GB, 500MB, 2GiB).
    #[arg(long, default_value = "5GB")]
    max_shard_size: String,
}

/// Tokenizer and template files an HF checkpoint folder may carry, copied as they are.
const TOKENIZER_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
];

pub fn run(args: MergeArgs) -> Result<()> {
    let dtype = parse_dtype(&args.dtype)
        .map_err(anyhow::Error::msg)
        .context("--dtype")?;
    let max_shard = parse_shard_size(&args.max_shard_size)
        .map_err(anyhow::Error::msg)
        .context("--max-shard-size")?;
    if args.output.exists() && args.output.canonicalize()? == args.model.canonicalize()? {
        bail!(
            "{}: --output must differ from --model",
            args.output.display()
        );
    }
    let ckpt = read_checkpoint(
        &args.model,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )?;
    let format = ckpt.format.clone();
    let source_dir = ckpt.dir.clone();
    let source = args.model.display().to_string();
    let mut model = CausalLm::from_tensors(ckpt.config, ckpt.tensors, &source)?;
    peft::load_adapter(&mut model, &args.adapter)?;
    let merged = peft::merged_tensors(&model)?;

    let generation = read_json(&source_dir.join("generation_config.json"))?;
    let generation = match (&format, generation) {
        (CheckpointFormat::Safetensors(_), g) => g,
        (CheckpointFormat::Gguf(_), _) => None,
    };
    save_hf_checkpoint(
        &args.output,
        &model.config,
        generation.as_ref(),
        &merged,
        dtype,
        max_shard,
    )?;
    match &format {
        CheckpointFormat::Safetensors(_) => copy_tokenizer_files(&source_dir, &args.output)?,
        CheckpointFormat::Gguf(file) => export_gguf_tokenizer(file, &args.output)?,
    }
    eprintln!(
        "merged {} into {} → {}",
        args.adapter.display(),
        args.model.display(),
        args.output.display()
    );
    Ok(())
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read", path.display()))?;
    let value =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    Ok(Some(value))
}

fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<()> {
    for name in TOKENIZER_FILES {
        let src = from.join(name);
        if src.is_file() {
            std::fs::copy(&src, to.join(name))
                .with_context(|| format!("{}: cannot copy to {}", src.display(), to.display()))?;
        }
    }
    Ok(())
}

/// A GGUF carries its tokenizer in metadata: write it out as `tokenizer.json` plus a
/// `tokenizer_config.json` with the special tokens and chat template, so the merged folder is a
/// complete HF checkpoint.
fn export_gguf_tokenizer(gguf: &Path, to: &Path) -> Result<()> {
    let tok = tokenizer_for(gguf)?;
    let json = tok
        .inner()
        .to_string(true)
        .map_err(|e| anyhow::anyhow!("{}: cannot serialize the tokenizer: {e}", gguf.display()))?;
    std::fs::write(to.join("tokenizer.json"), json)
        .with_context(|| format!("{}: cannot write tokenizer.json", to.display()))?;
    let mut config = serde_json::Map::new();
    for (key, value) in tok.special_tokens() {
        config.insert(key.clone(), serde_json::json!(value));
    }
    config.insert(
        "tokenizer_class".into(),
        serde_json::json!("PreTrainedTokenizerFast"),
    );
    config.insert(
        "add_bos_token".into(),
        serde_json::json!(tok.add_bos_token()),
    );
    if let Some(template) = tok.chat_template() {
        config.insert("chat_template".into(), serde_json::json!(template));
    }
    let text = serde_json::to_string_pretty(&serde_json::Value::Object(config))?;
    std::fs::write(to.join("tokenizer_config.json"), text)
        .with_context(|| format!("{}: cannot write tokenizer_config.json", to.display()))?;
    Ok(())
}
