//! "Send exactly one mail", crash-safely and across leader changes.
//!
//! The protocol, per mail (the request, and the release sent during deletion):
//! 1. **Intent.** One metadata write guarded by `resourceVersion` records the Message-Id, who
//!    writes it (the Lease identity) and when, in state `sending`, and adds our finalizer. It is
//!    the fence between two processes that both believe they lead: the loser gets 409. The
//!    mail's one record annotation ([`records`]) holds it.
//! 2. **Send**, only if this process renewed its Lease less than the renew deadline ago
//!    ([`crate::Leadership::may_act`]), with that Message-Id.
//! 3. **Sent record**: the same annotation rewritten to state `sent` (with the time); then status
//!    and an event. A refusal before acceptance marks the intent `refused` instead: the mail
//!    certainly never went out, so deletion owes no release.
//!
//! An intent in state `sending` without a sent record means an attempt may be in flight
//! elsewhere or its outcome is unknown. If another holder wrote it less than lease duration +
//! renew deadline ago, it may still be sending: wait. Otherwise ask the backend (Mailgun's
//! events; "not found" is trusted only after a grace period) and resend with the **same**
//! Message-Id only when the backend cannot answer (SMTP) or never saw it; every resend is
//! counted in `capm_mail_resends_total`.
//!
//! # Caveats
//! - SMTP cannot be asked. A process that sent but died before recording "sent" leads to a
//!   second delivery with the same Message-Id (receivers can fold it); counted as a resend.
//! - A process frozen between the lease check and the backend's acceptance (one network write)
//!   still delivers when it resumes; see [`crate::Leadership`].
//! - An object the API server deletes although our finalizer was being added (its delete
//!   decision predates the finalizer) is released right away if its request went out, without a
//!   durable record (counted in `capm_mail_orphan_releases_total`).
//!
//! `decide::decide` is the whole decision as a pure function; `execute` performs it.

pub(crate) mod decide;
pub(crate) mod execute;
pub mod records;

use capm_api::names;

/// Which of an object's two mails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// "One cluster please".
    Request,
    /// "No longer needed", sent during deletion if a request went out.
    Deletion,
}

impl Which {
    /// The annotation holding this mail's one record.
    pub fn record_key(self) -> &'static str {
        match self {
            Self::Request => names::MAIL_ANNOTATION,
            Self::Deletion => names::DELETION_MAIL_ANNOTATION,
        }
    }
    /// Release 0.1's intent annotation (read, removed on our next write).
    pub(crate) fn intent_key(self) -> &'static str {
        match self {
            Self::Request => names::MAIL_INTENT_ANNOTATION,
            Self::Deletion => names::DELETION_MAIL_INTENT_ANNOTATION,
        }
    }
    /// Release 0.1's sent annotation (read, removed on our next write).
    pub(crate) fn sent_key(self) -> &'static str {
        match self {
            Self::Request => names::MAIL_SENT_ANNOTATION,
            Self::Deletion => names::DELETION_MAIL_SENT_ANNOTATION,
        }
    }
    pub(crate) fn message_id(self, kind: &str, uid: &str, domain: &str) -> String {
        match self {
            Self::Request => names::message_id(kind, uid, domain),
            Self::Deletion => names::deletion_message_id(kind, uid, domain),
        }
    }
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Request => "request",
            Self::Deletion => "deletion",
        }
    }
}
