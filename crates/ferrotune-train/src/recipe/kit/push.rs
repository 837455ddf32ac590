//! `push_to_hub`: the run's final checkpoint folder (the last epoch's `epoch_{N}`, as the
//! checkpointer wrote it: adapter, merged model) uploaded to a Hugging Face Hub repository when
//! the run ends, as `ferrotune upload` does (`ferrotune_data::hub::upload_folder`):
//!
//! ```yaml
//! push_to_hub:
//!   repo_id: me/smollm2-135m-lora   # created if it does not exist
//!   repo_type: model                # or dataset
//!   private: true
//!   revision: main
//!   commit_message: "LoRA fine-tune"
//! ```
//!
//! The token (HF_TOKEN, else the Hugging Face token file) is checked before training, so a run
//! without one stops at once rather than after its last epoch. Rank 0 pushes.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use ferrotune_data::hub::{has_token, upload_folder, RepoKind, UploadEvent, UploadRequest};

use crate::config::Config;

/// What `push_to_hub` asks for, or `None` when the config has no `push_to_hub`.
pub fn push_request(cfg: &Config) -> Result<Option<UploadRequest>> {
    if cfg.get("push_to_hub").is_none() {
        return Ok(None);
    }
    let Some(repo_id) = cfg.str("push_to_hub.repo_id")? else {
        bail!("{}: push_to_hub.repo_id is required", cfg.origin);
    };
    let kind: RepoKind = cfg
        .str("push_to_hub.repo_type")?
        .unwrap_or_else(|| "model".into())
        .parse()
        .map_err(|e| anyhow!("{}: push_to_hub.repo_type: {e}", cfg.origin))?;
    if !has_token() {
        bail!(
            "{}: push_to_hub needs a Hugging Face token with write access: set HF_TOKEN \
             (checked before training so the run does not end without its upload)",
            cfg.origin
        );
    }
    Ok(Some(UploadRequest {
        repo_id,
        kind,
        revision: cfg.str("push_to_hub.revision")?,
        private: cfg.bool("push_to_hub.private")?.unwrap_or(false),
        token: None,
        commit_message: cfg.str("push_to_hub.commit_message")?,
    }))
}

/// `push_to_hub` in a recipe with its own loop (GRPO, PPO): [`push_request`] on rank 0, checked
/// before training as the fine-tuning recipes check it; `None` on the other ranks.
pub fn request_on_lead(cfg: &Config, lead: bool) -> Result<Option<UploadRequest>> {
    match lead {
        true => push_request(cfg),
        false => Ok(None),
    }
}

/// After the run: pushes its final checkpoint `dir` (when this run wrote one) if `req` asks.
pub fn push_final(req: &Option<UploadRequest>, dir: Option<&Path>) -> Result<()> {
    match (req, dir) {
        (Some(req), Some(dir)) => push(req, dir),
        _ => Ok(()),
    }
}

/// Uploads `dir` as `req` asks, printing what went up; an error names the command that retries.
pub fn push(req: &UploadRequest, dir: &Path) -> Result<()> {
    eprintln!("Pushing {} to the Hub ({})...", dir.display(), req.repo_id);
    let mut on_event = |e: UploadEvent<'_>| match e {
        UploadEvent::LfsPresent { path, .. } => eprintln!("  {path}: already on the Hub"),
        UploadEvent::LfsUploaded { path, size } => {
            eprintln!("  {path}: uploaded ({:.1} MB)", size as f64 / 1e6)
        }
        UploadEvent::Retrying { .. } => eprintln!("  {}", e.retry_line().unwrap_or_default()),
    };
    let out = upload_folder(req, dir, &mut on_event).with_context(|| {
        format!(
            "push_to_hub: the checkpoint is saved in {}, but uploading it to {} failed \
             (retry with `ferrotune upload {} {}`)",
            dir.display(),
            req.repo_id,
            req.repo_id,
            dir.display()
        )
    })?;
    eprintln!(
        "Pushed {} files ({} through LFS) to {}: {}",
        out.files, out.lfs_files, req.repo_id, out.commit_url
    );
    Ok(())
}
