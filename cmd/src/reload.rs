//! The one reloader of files that change under a running process: the links' keys and the
//! serving certificates. Each file is looked at every [`Reload::interval`] (the keys every
//! [`RELOAD_INTERVAL`], a certificate's metadata every second); a changed, usable one replaces
//! what is in use, a broken one is logged once (until it changes) and the previous content kept.
//! A Kubernetes Secret volume swaps a symlink, cert-manager rewrites files: both are seen within
//! the interval, without a restart.

use std::time::Duration;

use tokio::time::Instant;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// How often the files are looked at.
pub const RELOAD_INTERVAL: Duration = Duration::from_secs(10);

/// A file, or a pair of files, whose content the process uses while it changes.
pub trait Reload: Send + 'static {
    /// What it is, for the log (`"the fulfilment keys"`, `"a serving certificate"`).
    fn what(&self) -> String;

    /// How often it is looked at.
    fn interval(&self) -> Duration {
        RELOAD_INTERVAL
    }

    /// Reads it again if it changed and puts it in use: `Ok(true)` when it did.
    ///
    /// # Errors
    /// When it changed and cannot be used (the message names no secret).
    fn reload(&mut self) -> anyhow::Result<bool>;
}

/// Reloads each of `files` every [`Reload::interval`] (at most `cap`) until `stop`.
pub async fn watch(mut files: Vec<Box<dyn Reload>>, cap: Duration, stop: CancellationToken) {
    let mut failing = vec![false; files.len()];
    let start = Instant::now();
    let mut due: Vec<Instant> = files
        .iter()
        .map(|f| start + f.interval().min(cap))
        .collect();
    loop {
        let Some(next) = due.iter().min().copied() else {
            return;
        };
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            () = stop.cancelled() => return,
        }
        let now = Instant::now();
        for ((file, failing), due) in files.iter_mut().zip(&mut failing).zip(&mut due) {
            if *due > now {
                continue;
            }
            *due = now + file.interval().min(cap);
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
