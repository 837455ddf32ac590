//! `ferrotune export-gguf`: a checkpoint folder (a fine-tuned or merged model; HF safetensors or
//! `.bin`, or Meta's files) as one GGUF file for llama.cpp, Ollama or `ferrotune generate`.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use ferrotune_train::gguf_export::{export_gguf, OutType};

#[derive(Args)]
pub struct ExportGgufArgs {
    /// The checkpoint folder (config.json, safetensors or `.bin`, tokenizer), e.g. a LoRA run's
    /// `epoch_N/merged` or a full fine-tune's `epoch_N`; or Meta's `original/` folder.
    model: PathBuf,
    /// The GGUF file to write.
    output: PathBuf,
    /// Storage of the weight matrices: f32, f16, bf16, auto (bf16 for a bf16 checkpoint, else
    /// f16), q8_0, or llama-quantize's mixes q4_k_m, q4_k_s, q5_k_m, q5_k_s, q6_k, q4_0, q4_1,
    /// q5_0, q5_1 (vectors stay f32).
    #[arg(long, default_value = "f16")]
    outtype: String,
}

pub fn run(args: ExportGgufArgs) -> Result<()> {
    let outtype = OutType::parse(&args.outtype)?;
    let done = export_gguf(&args.model, &args.output, outtype)?;
    for note in &done.notes {
        eprintln!("note: {note}");
    }
    println!(
        "Wrote {} ({} architecture, {} tensors, {:.1} MB, pre-tokenizer '{}')",
        args.output.display(),
        done.architecture,
        done.tensors,
        done.bytes as f64 / 1e6,
        done.pre_tokenizer
    );
    Ok(())
}
