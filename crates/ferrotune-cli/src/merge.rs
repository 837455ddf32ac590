//! `ferrotune merge`: fold a PEFT adapter into its base model and write an HF checkpoint.

use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use clap::Args;
use ferrotune_core::parse_dtype;
use ferrotune_export::hf::{write_hf_model, ModelFiles, ModelSource};
use ferrotune_models::{parse_shard_size, peft, read_checkpoint, CausalLm};

use crate::model_io::flag;

#[derive(Args)]
pub struct MergeArgs {
    /// The base model: an HF checkpoint folder or a .gguf file.
    #[arg(long)]
    model: PathBuf,
    /// The adapter: a PEFT folder (adapter_config.json + adapter_model.safetensors), or
    /// torchtune's adapter_model.pt (the file or its folder).
    #[arg(long)]
    adapter: PathBuf,
    /// The alpha of a torchtune adapter_model.pt with no adapter_config.json beside it (Phi-3:
    /// torchtune writes none); the `model.lora_alpha` it was trained with.
    #[arg(long)]
    lora_alpha: Option<f64>,
    /// Where to write the merged HF checkpoint.
    #[arg(long)]
    output: PathBuf,
    /// dtype of the saved weights: f32 or bf16 (the merge itself is computed in f32).
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// Largest safetensors file; bigger models are sharded with an index (e.g. 5GB, 500MB, 2GiB).
    #[arg(long, default_value = "5GB")]
    max_shard_size: String,
    /// The adapter was trained with QLoRA: merge it into the NF4 round trip of the base, quantized
    /// and merged in `--dtype` (what a QLoRA recipe saves as its merged model).
    #[arg(long)]
    quantize_base: bool,
}

pub fn run(args: MergeArgs) -> Result<()> {
    let dtype = flag("--dtype", parse_dtype(&args.dtype))?;
    let max_shard = flag("--max-shard-size", parse_shard_size(&args.max_shard_size))?;
    if args.output.exists() && args.output.canonicalize()? == args.model.canonicalize()? {
        bail!(
            "{}: --output must differ from --model",
            args.output.display()
        );
    }
    // QLoRA's base is quantized in the dtype it trained in; a plain merge is computed in f32.
    let load_dtype = if args.quantize_base {
        dtype
    } else {
        candle_core::DType::F32
    };
    let ckpt = read_checkpoint(&args.model, load_dtype, &candle_core::Device::Cpu)?;
    let source = ModelSource {
        format: ckpt.format.clone(),
        dir: ckpt.dir.clone(),
    };
    let name = args.model.display().to_string();
    let mut model = CausalLm::from_tensors(ckpt.config, ckpt.tensors, &name)?;
    if args.quantize_base {
        let layers = model.quantize_base_nf4()?.layers;
        eprintln!("QLoRA: {layers} linear layers quantized to NF4 ({dtype:?})");
    }
    classifier_for_seq_cls_adapter(&mut model, &args.adapter, &ckpt.dir)?;
    peft::load_adapter_from(&mut model, &args.adapter, args.lora_alpha)?;
    let merged = peft::merged_tensors(&model)?;
    // Weights, config, the source's generation config and its tokenizer files (exported from a
    // GGUF): the same folder a recipe writes for a merged model.
    let files = ModelFiles {
        config: &model.config,
        tensors: &merged,
        dtype,
        max_shard_bytes: max_shard,
        source: &source,
        tokenizer: None,
    };
    write_hf_model(&args.output, &files)?;
    if args.adapter.join("tokenizer.json").is_file() {
        // The adapter's own tokenizer (tokens added for it) is the merged model's.
        ferrotune_export::hf::copy_tokenizer_files(&args.adapter, &args.output)?;
    }
    eprintln!(
        "merged {} into {} → {}",
        args.adapter.display(),
        args.model.display(),
        args.output.display()
    );
    Ok(())
}

/// A PEFT `SEQ_CLS` adapter (a reward model's, with its `score` head in `modules_to_save`) on a
/// causal LM base: the base becomes the one-output classifier PEFT's
/// `AutoPeftModelForSequenceClassification` loads it as (its head replaced by the adapter's
/// `score`), with the base's tokenizer's pad id (else its EOS id; without a tokenizer the
/// config's) as `pad_token_id`, as TRL's `RewardTrainer` sets it.
fn classifier_for_seq_cls_adapter(model: &mut CausalLm, adapter: &Path, base: &Path) -> Result<()> {
    let config = adapter.join(peft::ADAPTER_CONFIG_FILE);
    if !config.is_file() || model.config.score_labels.is_some() {
        return Ok(());
    }
    if peft::LoraConfig::read(adapter)?.task_type != "SEQ_CLS" {
        return Ok(());
    }
    let pad = ferrotune_data::Tokenizer::from_dir(base)
        .ok()
        .map(|t| ferrotune_data::dataset::default_pad_id(&t))
        .or(model.config.pad_token_id);
    model.into_sequence_classifier(1, pad, 0)?;
    eprintln!("SEQ_CLS adapter: the base is merged as a one-output sequence classifier");
    Ok(())
}
