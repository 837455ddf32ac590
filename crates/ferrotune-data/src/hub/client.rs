//! The Hub client: endpoint (`HF_ENDPOINT`), the token as `huggingface_hub` resolves it, the
//! HTTP client for our own requests and the runtime that drives them.

use std::fs;
use std::path::PathBuf;

use hf_hub::HFClient;

use crate::error::{DataError, Result};

const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// The client, the token as resolved, and how to ask the user for a token.
pub(super) struct Hub {
    pub(super) client: HFClient,
    pub(super) http: reqwest::Client,
    pub(super) endpoint: String,
    pub(super) token: Option<String>,
    pub(super) token_hint: String,
}

impl Hub {
    pub(super) fn new(explicit_token: Option<&str>, token_hint: &str) -> Result<Self> {
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .filter(|e| !e.trim().is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string())
            .trim_end_matches('/')
            .to_string();
        let token = explicit_token
            .filter(|t| !t.is_empty())
            .map(str::to_string)
            .or_else(implicit_token);
        let mut builder = HFClient::builder().endpoint(endpoint.clone());
        if let Some(t) = &token {
            builder = builder.token(t.clone());
        }
        let client = builder.build().map_err(|e| {
            DataError::Hub(format!(
                "cannot use the Hugging Face Hub at '{endpoint}' (HF_ENDPOINT): {e}"
            ))
        })?;
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .user_agent(concat!("ferrotune/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| DataError::Hub(format!("cannot create an HTTP client: {e}")))?;
        Ok(Hub {
            client,
            http,
            endpoint,
            token,
            token_hint: token_hint.to_string(),
        })
    }
}

/// The token `huggingface_hub` would use without an explicit one, in its order.
pub(super) fn implicit_token() -> Option<String> {
    let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    if var("HF_HUB_DISABLE_IMPLICIT_TOKEN").is_some() {
        return None;
    }
    if let Some(t) = var("HF_TOKEN") {
        return Some(t);
    }
    let read = |p: PathBuf| {
        fs::read_to_string(p)
            .ok()
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
    };
    if let Some(t) = var("HF_TOKEN_PATH").and_then(|p| read(PathBuf::from(p))) {
        return Some(t);
    }
    let home = var("HF_HOME").map(PathBuf::from).unwrap_or_else(|| {
        var("XDG_CACHE_HOME")
            .map(PathBuf::from)
            .or_else(|| var("HOME").map(|h| PathBuf::from(h).join(".cache")))
            .unwrap_or_else(|| PathBuf::from(".cache"))
            .join("huggingface")
    });
    read(home.join("token"))
}

pub(super) fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| DataError::Hub(format!("cannot start the HTTP runtime: {e}")))
}
