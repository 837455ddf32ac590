//! `ferrotune export-gguf`: a checkpoint folder (a fine-tuned or merged model; HF safetensors or
//! `.bin`, or Meta's files) as one GGUF file for llama.cpp, Ollama or `ferrotune generate`; or a
//! PEFT LoRA adapter as llama.cpp's LoRA adapter GGUF.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::Args;
use ferrotune_export::gguf::{export_gguf, export_gguf_adapter, OutType};
use ferrotune_models::peft::LoraConfig;

#[derive(Args)]
pub struct ExportGgufArgs {
    /// The checkpoint folder (config.json, safetensors or `.bin`, tokenizer), e.g. a LoRA run's
    /// `epoch_N/merged` or a full fine-tune's `epoch_N`; or Meta's `original/` folder; or a PEFT
    /// LoRA adapter folder (a LoRA run's `epoch_N`), written as a llama.cpp adapter.
    model: PathBuf,
    /// The GGUF file to write.
    output: PathBuf,
    /// Storage of the weight matrices: f32, f16, bf16, auto (bf16 for a bf16 checkpoint, else
    /// f16), q8_0, or llama-quantize's mixes q4_k_m, q4_k_s, q5_k_m, q5_k_s, q6_k, q4_0, q4_1,
    /// q5_0, q5_1, mxfp4_moe (gpt-oss: experts MXFP4, other matrices Q8_0) (vectors stay f32).
    /// Default f16 for a model, f32 for an adapter (as llama.cpp's converters).
    #[arg(long)]
    outtype: Option<String>,
    /// For an adapter: the base model's HF folder (its config names the tensors). Default: the
    /// adapter's `base_model_name_or_path` when that is a local folder (ferrotune records it).
    #[arg(long)]
    base: Option<PathBuf>,
}

pub fn run(args: ExportGgufArgs) -> Result<()> {
    let adapter = args.model.join("adapter_config.json").is_file()
        && !args.model.join("config.json").is_file();
    if !adapter && args.base.is_some() {
        bail!(
            "--base is for exporting an adapter; {} is not an adapter folder (adapter_config.json)",
            args.model.display()
        );
    }
    let outtype =
        OutType::parse(
            args.outtype
                .as_deref()
                .unwrap_or(if adapter { "f32" } else { "f16" }),
        )?;
    let done = if adapter {
        let base = match &args.base {
            Some(b) => b.clone(),
            None => {
                let recorded = LoraConfig::read(&args.model)?
                    .base_model_name_or_path
                    .map(PathBuf::from)
                    .filter(|p| p.join("config.json").is_file());
                match recorded {
                    Some(p) => p,
                    None => bail!(
                        "{}: a LoRA adapter; give its base model's HF folder with --base (the \
                         adapter's base_model_name_or_path is not a local folder)",
                        args.model.display()
                    ),
                }
            }
        };
        export_gguf_adapter(&args.model, &base, &args.output, outtype)?
    } else {
        export_gguf(&args.model, &args.output, outtype)?
    };
    for note in &done.notes {
        eprintln!("note: {note}");
    }
    if adapter {
        println!(
            "Wrote {} (LoRA adapter for llama.cpp's {} architecture, {} tensors, {:.1} MB)",
            args.output.display(),
            done.architecture,
            done.tensors,
            done.bytes as f64 / 1e6
        );
    } else {
        println!(
            "Wrote {} ({} architecture, {} tensors, {:.1} MB, pre-tokenizer '{}')",
            args.output.display(),
            done.architecture,
            done.tensors,
            done.bytes as f64 / 1e6,
            done.pre_tokenizer
        );
    }
    Ok(())
}
