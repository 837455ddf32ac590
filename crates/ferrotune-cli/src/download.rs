//! `ferrotune download`: a Hugging Face Hub repository snapshot into a folder (torchtune's
//! `tune download`), resumable.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use ferrotune_data::hub::{download_snapshot, FileEvent, RepoKind, SnapshotRequest};

#[derive(Args)]
#[command(
    after_help = "Environment: HF_TOKEN (access token; --hf-token wins), HF_ENDPOINT (Hub \
                        base URL, default https://huggingface.co), HF_HOME.\n\
                        An interrupted download resumes where it stopped when run again; files \
                        already complete are skipped."
)]
pub struct DownloadArgs {
    /// The repository on the Hugging Face Hub, e.g. HuggingFaceTB/SmolLM2-135M-Instruct.
    repo_id: String,
    /// Folder to write the files to [default: /tmp/<repo name>].
    #[arg(long)]
    output_dir: Option<PathBuf>,
    /// Hugging Face access token, for gated or private repositories [default: $HF_TOKEN].
    #[arg(long)]
    hf_token: Option<String>,
    /// Skip files matching this glob (fnmatch: `*` also crosses `/`; `dir/` is all under dir).
    /// Repeatable.
    #[arg(long = "ignore-patterns", value_name = "GLOB")]
    ignore_patterns: Vec<String>,
    /// Download only files matching this glob (same syntax). Repeatable.
    #[arg(long = "allow-patterns", value_name = "GLOB")]
    allow_patterns: Vec<String>,
    /// Repository type: model or dataset.
    #[arg(long, default_value = "model")]
    repo_type: RepoKind,
    /// Branch, tag or commit to download [default: main].
    #[arg(long)]
    revision: Option<String>,
}

pub fn run(args: DownloadArgs) -> Result<()> {
    let output_dir = args.output_dir.clone().unwrap_or_else(|| {
        let name = args.repo_id.rsplit('/').next().unwrap_or(&args.repo_id);
        PathBuf::from("/tmp").join(name)
    });
    if !args.ignore_patterns.is_empty() {
        println!(
            "Ignoring files matching the following patterns: {}",
            args.ignore_patterns.join(", ")
        );
    }
    let request = SnapshotRequest {
        repo_id: args.repo_id.clone(),
        kind: args.repo_type,
        revision: args.revision.clone(),
        token: args.hf_token.clone(),
        allow_patterns: args.allow_patterns.clone(),
        ignore_patterns: args.ignore_patterns.clone(),
        token_hint: "pass --hf-token or set HF_TOKEN".to_string(),
    };
    let live = std::io::stderr().is_terminal();
    let mut last_percent = u64::MAX;
    let mut on_event = |event: FileEvent<'_>| match event {
        FileEvent::Skipped { path, size } => {
            println!("{path}: already complete ({}), skipped", human_bytes(size));
        }
        FileEvent::Started {
            path,
            size,
            resume_from,
        } => {
            last_percent = u64::MAX;
            if resume_from > 0 {
                println!(
                    "{path}: resuming at {} of {}",
                    human_bytes(resume_from),
                    human_bytes(size)
                );
            } else {
                println!("{path}: downloading {}", human_bytes(size));
            }
        }
        FileEvent::Progress { path, done, size } => {
            // A live percentage only on a terminal; logs get one line per file.
            if live && size > 0 {
                let percent = done * 100 / size;
                if percent != last_percent {
                    last_percent = percent;
                    eprint!("\r{path}: {percent}%");
                    let _ = std::io::stderr().flush();
                }
            }
        }
        FileEvent::Finished { path, size } => {
            if live && last_percent != u64::MAX {
                eprintln!();
            }
            println!("{path}: done ({})", human_bytes(size));
        }
    };
    let paths = download_snapshot(&request, &output_dir, &mut on_event)
        .with_context(|| format!("download of '{}' failed", args.repo_id))?;
    let kind = match args.repo_type {
        RepoKind::Model => "model",
        RepoKind::Dataset => "dataset",
    };
    println!("Successfully downloaded {kind} repo and wrote to the following locations:");
    for path in paths {
        println!("{}", path.display());
    }
    Ok(())
}

pub(crate) fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}
