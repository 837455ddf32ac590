//! `ferrotune`: fine-tune and run LLMs — torchtune's verbs and configs in one Rust binary.

mod bench;
mod cat;
mod download;
mod env;
mod export_gguf;
mod generate;
mod launch;
mod logging;
mod merge;
mod model_io;
mod plot;
mod recipes;
mod tokenize;
mod upload;

use clap::{Parser, Subcommand};

/// Fine-tune and run large language models (Llama, Qwen, Mistral, Gemma, Phi, SmolLM2).
#[derive(Parser)]
#[command(name = "ferrotune", version, about, long_about = None)]
// `--help` ends with the environment variables users may set (the registry's, test hooks left out).
#[command(after_long_help = ferrotune_core::switch::help_text())]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the recipes and their built-in configs.
    Ls(recipes::LsArgs),
    /// Copy a built-in config (or a recipe's source) to a file to edit.
    Cp(recipes::CpArgs),
    /// Run a recipe with a config and key=value overrides.
    Run(recipes::RunArgs),
    /// Check a config without running it.
    Validate(recipes::ValidateArgs),
    /// Print a config as torchtune's `tune cat` does (the keys you can override with `run`).
    Cat(cat::CatArgs),
    /// Measure training speed and memory.
    Bench(bench::BenchArgs),
    /// Generate text from a model (HF checkpoint folder or .gguf file).
    Generate(Box<generate::GenerateArgs>),
    /// Tokenize text or a chat conversation exactly as a model will see it.
    Tokenize(tokenize::TokenizeArgs),
    /// Merge a PEFT LoRA/DoRA adapter into its base model and write an HF checkpoint.
    Merge(merge::MergeArgs),
    /// Write an HF checkpoint folder as one GGUF file (llama.cpp, Ollama).
    ExportGguf(export_gguf::ExportGgufArgs),
    /// Download a model or dataset repository from the Hugging Face Hub (resumable).
    Download(download::DownloadArgs),
    /// Upload a folder to a Hugging Face Hub repository as one commit (LFS, resumable).
    Upload(upload::UploadArgs),
    /// Plot a training run's loss and learning rate against step into a PNG.
    Plot(plot::PlotArgs),
    /// Print the build, CPU threads and SIMD, GPUs, driver, CUDA libraries, NCCL and folders.
    Env(env::EnvArgs),
    /// Internal: the process chat templates render in (see `ferrotune_data::chat_template::isolate`).
    #[command(name = ferrotune_data::chat_template::isolate::WORKER_VERB, hide = true)]
    RenderTemplates,
}

/// glibc returns large freed blocks to the kernel and maps fresh zeroed pages for the next
/// allocation; a training step allocates and frees the same large activations every time, so that
/// turned into page faults and page clearing on every step. Keep freed memory for reuse instead.
fn keep_freed_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only changes allocator tunables; called before other threads allocate.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
    }
}

fn main() {
    // Like any Unix tool, stop quietly when the reader of our output goes away
    // (`ferrotune ls | head`); Rust's default turns that into a panic.
    // SAFETY: setting a signal's disposition to the default has no memory effects.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    // candle attaches a backtrace to its errors whenever RUST_BACKTRACE is set; our errors are one
    // line for users. Panics still get their backtrace (RUST_LIB_BACKTRACE only covers libraries).
    if std::env::var_os("RUST_LIB_BACKTRACE").is_none() {
        std::env::set_var("RUST_LIB_BACKTRACE", "0");
    }
    logging::init();
    let cli = Cli::parse();
    if matches!(cli.command, Command::RenderTemplates) {
        if let Err(e) = ferrotune_data::chat_template::isolate::serve() {
            eprintln!("error: chat template worker: {e}");
            std::process::exit(1);
        }
        return;
    }
    // Chat templates are untrusted code from model folders: they render in a worker process with
    // a memory cap (this binary again, with the hidden verb).
    match std::env::current_exe() {
        Ok(exe) => ferrotune_data::chat_template::isolate::use_worker(
            exe,
            vec![ferrotune_data::chat_template::isolate::WORKER_VERB.into()],
        ),
        Err(e) => tracing::warn!("chat templates render in this process: {e}"),
    }
    if matches!(
        cli.command,
        Command::Generate(_) | Command::Run(_) | Command::Bench(_) | Command::Merge(_)
    ) {
        // Only the verbs that compute pay for measuring the machine's parallelism.
        ferrotune_core::init_cpu_threads();
        keep_freed_memory();
    }
    let result = match cli.command {
        Command::Ls(args) => recipes::ls(args),
        Command::Cp(args) => recipes::cp(args),
        Command::Run(args) => recipes::run(args),
        Command::Validate(args) => recipes::validate(args),
        Command::Cat(args) => cat::cat(args),
        Command::Bench(args) => bench::run(args),
        Command::Generate(args) => generate::run(*args),
        Command::Tokenize(args) => tokenize::run(args),
        Command::Merge(args) => merge::run(args),
        Command::ExportGguf(args) => export_gguf::run(args),
        Command::Download(args) => download::run(args),
        Command::Upload(args) => upload::run(args),
        Command::Plot(args) => plot::run(args),
        Command::Env(args) => env::run(args),
        Command::RenderTemplates => unreachable!("served above"),
    };
    if let Err(e) = result {
        // One line: the context chain joined, so the file and the problem appear together.
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
