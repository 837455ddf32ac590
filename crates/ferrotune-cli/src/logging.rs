//! Diagnostics on stderr through `tracing`: `RUST_LOG` when set, else warnings; a recipe config's
//! `log_level` (torchtune's key) raises or lowers that for its run.

use std::sync::OnceLock;

use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{reload, EnvFilter, Registry};

/// What the filter becomes without `RUST_LOG`: hf-hub logs each exhausted retry, and the error
/// itself is reported once by us.
const QUIET_HUB: &str = "hf_hub::retry=off";

static FILTER: OnceLock<reload::Handle<EnvFilter, Registry>> = OnceLock::new();

/// Installs the stderr logger.
pub fn init() {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new(format!("warn,{QUIET_HUB}")));
    let (filter, handle) = reload::Layer::new(filter);
    tracing_subscriber::registry()
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                // Colour codes only for a terminal: logs piped to a file stay plain text.
                .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())),
        )
        .init();
    let _ = FILTER.set(handle);
}

/// Applies a config's `log_level` (a `tracing` level directive) unless `RUST_LOG` decides.
pub fn set_level(level: &str) {
    if std::env::var_os("RUST_LOG").is_some() {
        return;
    }
    if let Some(handle) = FILTER.get() {
        let _ = handle.reload(EnvFilter::new(format!("{level},{QUIET_HUB}")));
    }
}
