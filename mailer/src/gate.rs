//! The commit gate: the caller's last word right before a send becomes irrevocable.
//!
//! A send has a *commit point*: the last bytes after which the backend may act on the message.
//! For Mailgun it is the final chunk of the request body (an HTTP server does not handle a request
//! whose body never completed); for SMTP it is the end-of-data line `CRLF.CRLF` (RFC 5321 §4.1.1.4:
//! no message is delivered without it). Everything before it is written freely; right before it,
//! the backend asks the [`CommitGate`]. A refusal abandons the send: the connection is dropped
//! with the request incomplete, and the send fails with [`MailError::Abandoned`](crate::MailError::Abandoned).
//!
//! What the gate checks is the caller's business (the provider: that its leader Lease was renewed
//! within the renew deadline, by the monotonic clock, so a process frozen mid-send and resumed
//! after another replica took over never completes the send).

use std::sync::Arc;

/// Asked once per send, right before its commit point.
pub trait CommitGate: Send + Sync {
    /// `Ok` to complete the send; `Err(reason)` to abandon it (nothing reaches the backend whole).
    /// Called on the task that drives the send: it must not block for long.
    ///
    /// # Errors
    /// The reason the send must not complete, for logs.
    fn may_commit(&self) -> Result<(), String>;
}

/// The gate of a process that is the only sender: always open.
#[derive(Debug, Clone, Copy, Default)]
pub struct AlwaysOpen;

impl CommitGate for AlwaysOpen {
    fn may_commit(&self) -> Result<(), String> {
        Ok(())
    }
}

/// The gate every backend holds.
pub(crate) type Gate = Arc<dyn CommitGate>;

/// An always-open gate.
pub(crate) fn open() -> Gate {
    Arc::new(AlwaysOpen)
}
