//! What can go wrong when sending or looking up, classified by what the caller should do next.

use std::{error::Error as StdError, time::Duration};

/// A boxed underlying error (network, TLS, SMTP client).
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// What the caller should do about a [`MailError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// Do not resend this message unchanged: it will be refused again.
    Permanent,
    /// The message was not accepted: send it again later.
    Retryable,
    /// The message may or may not have been accepted: look it up before resending.
    UnknownOutcome,
    /// The caller's [`CommitGate`](crate::CommitGate) stopped the send before its commit point:
    /// nothing was accepted, and this process must not send it again (another may).
    Abandoned,
}

/// A failed send or lookup.
///
/// Messages never contain secrets (API keys, passwords): backends report the server's reply text
/// and the kind of network failure only.
#[derive(Debug, thiserror::Error)]
pub enum MailError {
    /// The backend refused the request for good (bad request, authentication, SMTP 5xx).
    #[error("{backend}: permanently refused{}: {message}", code_suffix(*code))]
    Permanent {
        /// `mailgun` or `smtp`.
        backend: &'static str,
        /// HTTP status or SMTP reply code, when there was a reply.
        code: Option<u16>,
        /// What the server said (or why the request could not be made).
        message: String,
    },
    /// Nothing was accepted; try again later (after `retry_after` when the backend said so).
    #[error("{backend}: temporarily failed{}: {message}", code_suffix(*code))]
    Retryable {
        /// `mailgun` or `smtp`.
        backend: &'static str,
        /// HTTP status or SMTP reply code, when there was a reply.
        code: Option<u16>,
        /// How long the backend asked us to wait (HTTP `Retry-After`).
        retry_after: Option<Duration>,
        /// What the server said, or the connection failure.
        message: String,
        /// The underlying error, if any.
        #[source]
        source: Option<BoxError>,
    },
    /// The request reached the backend but no clear answer came back (timeout, 5xx, connection
    /// lost): the message may have been accepted.
    #[error("{backend}: outcome unknown{}: {message}", code_suffix(*code))]
    UnknownOutcome {
        /// `mailgun` or `smtp`.
        backend: &'static str,
        /// HTTP status or SMTP reply code, when there was a reply.
        code: Option<u16>,
        /// What the server said, or the failure.
        message: String,
        /// The underlying error, if any.
        #[source]
        source: Option<BoxError>,
    },
    /// The caller's [`CommitGate`](crate::CommitGate) refused the commit point: the request was
    /// dropped incomplete, so the backend accepted nothing.
    #[error("{backend}: abandoned before the commit point: {reason}")]
    Abandoned {
        /// `mailgun` or `smtp`.
        backend: &'static str,
        /// What the gate said.
        reason: String,
    },
}

fn code_suffix(code: Option<u16>) -> String {
    code.map(|c| format!(" ({c})")).unwrap_or_default()
}

impl MailError {
    /// What the caller should do next.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Self::Permanent { .. } => ErrorKind::Permanent,
            Self::Retryable { .. } => ErrorKind::Retryable,
            Self::UnknownOutcome { .. } => ErrorKind::UnknownOutcome,
            Self::Abandoned { .. } => ErrorKind::Abandoned,
        }
    }

    /// The wait the backend asked for, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Self::Retryable { retry_after, .. } => *retry_after,
            _ => None,
        }
    }

    /// The HTTP status or SMTP reply code, if the backend replied.
    pub fn code(&self) -> Option<u16> {
        match self {
            Self::Permanent { code, .. }
            | Self::Retryable { code, .. }
            | Self::UnknownOutcome { code, .. } => *code,
            Self::Abandoned { .. } => None,
        }
    }

    /// A low-cardinality label for metrics: `permanent`, `retryable`, `unknown_outcome` or
    /// `abandoned`.
    pub fn metric_label(&self) -> &'static str {
        match self.kind() {
            ErrorKind::Permanent => "permanent",
            ErrorKind::Retryable => "retryable",
            ErrorKind::UnknownOutcome => "unknown_outcome",
            ErrorKind::Abandoned => "abandoned",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_backend_code_and_kind() {
        let e = MailError::Retryable {
            backend: "mailgun",
            code: Some(429),
            retry_after: Some(Duration::from_secs(3)),
            message: "slow down".into(),
            source: None,
        };
        assert_eq!(
            e.to_string(),
            "mailgun: temporarily failed (429): slow down"
        );
        assert_eq!(e.kind(), ErrorKind::Retryable);
        assert_eq!(e.retry_after(), Some(Duration::from_secs(3)));
        assert_eq!(e.metric_label(), "retryable");
        let e = MailError::UnknownOutcome {
            backend: "smtp",
            code: None,
            message: "timed out".into(),
            source: None,
        };
        assert_eq!(e.to_string(), "smtp: outcome unknown: timed out");
        assert_eq!(e.metric_label(), "unknown_outcome");
        assert_eq!(e.retry_after(), None);
    }
}
