//! Failed Hub requests ([`HubFailure`]) and the one-line user messages they become, worded
//! for the repository a request is about ([`Ctx`]).

use hf_hub::HFError;

use super::client::Hub;
use super::RepoKind;
use crate::error::DataError;

/// A failed Hub request, reduced to what the user message needs.
pub(super) struct HubFailure {
    pub(super) status: Option<u16>,
    pub(super) error_code: Option<String>,
    pub(super) message: String,
    pub(super) network: bool,
    /// The file the request was about, when it was about one.
    pub(super) entry: Option<String>,
}

impl From<HFError> for HubFailure {
    fn from(e: HFError) -> Self {
        // hf-hub does not export its error-context type, so a macro reads the fields.
        macro_rules! http {
            ($ctx:expr, $entry:expr) => {
                HubFailure {
                    status: Some($ctx.status.as_u16()),
                    error_code: $ctx.error_code.clone(),
                    message: $ctx
                        .server_message
                        .clone()
                        .filter(|m| !m.is_empty())
                        .unwrap_or_else(|| $ctx.status.to_string()),
                    network: false,
                    entry: $entry,
                }
            };
        }
        match &e {
            HFError::Http { context }
            | HFError::AuthRequired { context }
            | HFError::Forbidden { context }
            | HFError::Conflict { context }
            | HFError::RateLimited { context, .. } => http!(context, None),
            HFError::RepoNotFound {
                context: Some(context),
                ..
            }
            | HFError::RevisionNotFound {
                context: Some(context),
                ..
            } => http!(context, None),
            HFError::EntryNotFound {
                path,
                context: Some(context),
                ..
            } => http!(context, Some(path.clone())),
            HFError::Request { source, .. } => HubFailure {
                status: None,
                error_code: None,
                message: error_chain(source),
                network: true,
                entry: None,
            },
            _ => HubFailure {
                status: None,
                error_code: None,
                message: error_chain(&e),
                network: false,
                entry: None,
            },
        }
    }
}

pub(super) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}

/// The repository a request is about, for error messages.
#[derive(Clone, Copy)]
pub(super) struct Ctx<'a> {
    pub(super) hub: &'a Hub,
    pub(super) repo_id: &'a str,
    pub(super) kind: RepoKind,
    pub(super) revision: &'a str,
}

impl Ctx<'_> {
    /// One line: what failed, why, and what to do.
    pub(super) fn error(&self, f: HubFailure) -> DataError {
        let (id, kind, endpoint, hint) = (
            self.repo_id,
            self.kind.singular(),
            self.hub.endpoint.as_str(),
            self.hub.token_hint.as_str(),
        );
        let has_token = self.hub.token.is_some();
        let code = f.error_code.as_deref().unwrap_or("");
        let message = if f.network {
            format!(
                "cannot reach the Hugging Face Hub at {endpoint} (HF_ENDPOINT): {}",
                f.message
            )
        } else if code == "RepoNotFound"
            || (f.status == Some(404) && code.is_empty() && f.entry.is_none())
        {
            let private = if has_token {
                ""
            } else {
                " (if it is private, {hint})"
            };
            format!(
                "{kind} repository '{id}' not found on the Hugging Face Hub at {endpoint}{}",
                private.replace("{hint}", hint)
            )
        } else if code == "RevisionNotFound" {
            format!(
                "revision '{}' not found in {kind} repository '{id}'",
                self.revision
            )
        } else if f.status == Some(404) {
            let entry = f.entry.as_deref().unwrap_or("?");
            format!(
                "file '{entry}' not found in {kind} repository '{id}' at revision '{}'",
                self.revision
            )
        } else if f.status == Some(401) {
            if has_token {
                format!("the Hugging Face Hub rejected the token for {kind} repository '{id}' (HTTP 401: {}); check the token", f.message)
            } else {
                format!("{kind} repository '{id}' needs authentication (HTTP 401: it is gated or private): {hint}")
            }
        } else if f.status == Some(403) {
            if has_token {
                format!("access to {kind} repository '{id}' is denied (HTTP 403: {}); if it is gated, request access on its Hub page with the account of your token", f.message)
            } else {
                format!("{kind} repository '{id}' is gated (HTTP 403): request access on its Hub page, then {hint}")
            }
        } else if let Some(status) = f.status {
            format!(
                "the Hugging Face Hub failed on {kind} repository '{id}' (HTTP {status}): {}",
                f.message
            )
        } else {
            format!("{kind} repository '{id}': {}", f.message)
        };
        DataError::Hub(message)
    }
}
