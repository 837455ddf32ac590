//! `ferrotune upload`: a local folder (or file) into a Hugging Face Hub repository as one commit,
//! through the Hub's commit API with Git LFS for large files (`huggingface-cli upload`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use ferrotune_data::hub::{upload_folder, RepoKind, UploadEvent, UploadRequest};

use crate::download::human_bytes;

#[derive(Args)]
#[command(
    after_help = "Environment: HF_TOKEN (a token with write access; --hf-token wins), \
                  HF_ENDPOINT (Hub base URL, default https://huggingface.co).\n\
                  The repository is created if it does not exist. An upload cut short is \
                  completed by running it again: large files the Hub already holds are not \
                  sent again, and nothing is committed until every file is there."
)]
pub struct UploadArgs {
    /// The repository on the Hugging Face Hub, e.g. me/smollm2-135m-lora.
    repo_id: String,
    /// The folder (or one file) to upload; its files keep their paths relative to it.
    path: PathBuf,
    /// Repository type: model or dataset.
    #[arg(long, default_value = "model")]
    repo_type: RepoKind,
    /// Create the repository private (when it does not exist yet).
    #[arg(long)]
    private: bool,
    /// The branch to commit to [default: main].
    #[arg(long)]
    revision: Option<String>,
    /// The commit's summary [default: "Upload folder using ferrotune"].
    #[arg(long)]
    commit_message: Option<String>,
    /// Hugging Face access token with write access [default: $HF_TOKEN].
    #[arg(long)]
    hf_token: Option<String>,
}

pub fn run(args: UploadArgs) -> Result<()> {
    let req = UploadRequest {
        repo_id: args.repo_id.clone(),
        kind: args.repo_type,
        revision: args.revision.clone(),
        private: args.private,
        token: args.hf_token.clone(),
        commit_message: args.commit_message.clone(),
    };
    let mut on_event = |event: UploadEvent<'_>| match event {
        UploadEvent::LfsPresent { path, size } => {
            println!(
                "{path}: already on the Hub ({}), not sent again",
                human_bytes(size)
            )
        }
        UploadEvent::LfsUploaded { path, size } => {
            println!("{path}: uploaded ({}, LFS)", human_bytes(size))
        }
        UploadEvent::Retrying { .. } => println!("{}", event.retry_line().unwrap_or_default()),
    };
    let out = upload_folder(&req, &args.path, &mut on_event)
        .with_context(|| format!("uploading '{}' to {}", args.path.display(), args.repo_id))?;
    println!(
        "Committed {} files ({} through LFS) to {}: {}",
        out.files, out.lfs_files, args.repo_id, out.commit_url
    );
    Ok(())
}
