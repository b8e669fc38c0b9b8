//! The one reloader of files that change under a running process: the links' keys and the
//! serving certificates. Every [`RELOAD_INTERVAL`] each file is looked at; a changed, usable one
//! replaces what is in use, a broken one is logged once (until it changes) and the previous
//! content kept. A Kubernetes Secret volume swaps a symlink, cert-manager rewrites files: both
//! are seen within the interval, without a restart.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How often the files are looked at.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);

/// A file, or a pair of files, whose content the process uses while it changes.
pub trait Reload: Send + 'static {
    /// What it is, for the log (`"Fulfilment keys"`, `"a serving certificate"`).
    fn what(&self) -> String;

    /// Reads it again if it changed and puts it in use: `Ok(true)` when it did.
    ///
    /// # Errors
    /// When it changed and cannot be used (the message names no secret).
    fn reload(&mut self) -> anyhow::Result<bool>;
}

/// Reloads `files` every `interval` until `stop`.
pub async fn watch(mut files: Vec<Box<dyn Reload>>, interval: Duration, stop: CancellationToken) {
    let mut failing = vec![false; files.len()];
    loop {
        tokio::select! {
            () = tokio::time::sleep(interval) => {}
            () = stop.cancelled() => return,
        }
        for (file, failing) in files.iter_mut().zip(&mut failing) {
            match file.reload() {
                Ok(true) => {
                    info!("Reloaded {}", file.what());
                    *failing = false;
                }
                Ok(false) => *failing = false,
                Err(e) if !*failing => {
                    warn!(error = %e, "Keeping the previous {}", file.what());
                    *failing = true;
                }
                Err(_) => {}
            }
        }
    }
}
