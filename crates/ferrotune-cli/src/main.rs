//! `ferrotune`: fine-tune and run LLMs — torchtune's verbs and configs in one Rust binary.

mod generate;
mod merge;
mod model_io;
mod tokenize;

use clap::{Parser, Subcommand};

/// Fine-tune and run large language models (Llama, Qwen, Mistral, Gemma, Phi, SmolLM2).
#[derive(Parser)]
#[command(name = "ferrotune", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a model (HF checkpoint folder or .gguf file).
    Generate(Box<generate::GenerateArgs>),
    /// Tokenize text or a chat conversation exactly as a model will see it.
    Tokenize(tokenize::TokenizeArgs),
    /// Merge a PEFT LoRA/DoRA adapter into its base model and write an HF checkpoint.
    Merge(merge::MergeArgs),
}

fn main() {
    ferrotune_core::init_cpu_threads();
    // candle attaches a backtrace to its errors whenever RUST_BACKTRACE is set; our errors are one
    // line for users. Panics still get their backtrace (RUST_LIB_BACKTRACE only covers libraries).
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        std::env::set_var("RUST_LIB_BACKTRACE", "0");
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate::run(*args),
        Command::Tokenize(args) => tokenize::run(args),
        Command::Merge(args) => merge::run(args),
    };
    if let Err(e) = result {
        // One line: the context chain joined, so the file and the problem appear together.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
