//! One process-wide "stop now" signal: SIGTERM or SIGINT, or a fatal error elsewhere.

use tokio::sync::watch;
use tracing::{info, warn};

/// A cloneable handle that resolves [`Shutdown::wait`] once shutdown was requested.
#[derive(Debug, Clone)]
pub struct Shutdown {
    rx: watch::Receiver<bool>,
    tx: std::sync::Arc<watch::Sender<bool>>,
}

impl Shutdown {
    /// A handle nobody has triggered yet.
    pub fn new() -> Self {
        let (tx, rx) = watch::channel(false);
        Self {
            rx,
            tx: std::sync::Arc::new(tx),
        }
    }

    /// Requests shutdown (idempotent).
    pub fn trigger(&self) {
        self.tx.send_replace(true);
    }

    /// Whether shutdown was requested.
    pub fn is_triggered(&self) -> bool {
        *self.rx.borrow()
    }

    /// Resolves once shutdown is requested.
    pub async fn wait(&mut self) {
        // The sender lives in `self`, so the channel cannot close while we wait.
        let _ = self.rx.wait_for(|stop| *stop).await;
    }

    /// Triggers on the first SIGTERM or SIGINT; a second one ends the process at once with
    /// status 1, as controller-runtime does.
    ///
    /// # Errors
    /// When the signal handlers cannot be installed.
    pub fn on_signals(&self) -> std::io::Result<()> {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = signal(SignalKind::terminate())?;
        let mut int = signal(SignalKind::interrupt())?;
        let this = self.clone();
        tokio::spawn(async move {
            let name = tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            };
            info!(signal = name, "Shutting down");
            this.trigger();
            tokio::select! {
                _ = term.recv() => {},
                _ = int.recv() => {},
            }
            warn!("Second signal: exiting immediately");
            std::process::exit(1);
        });
        Ok(())
    }
}
