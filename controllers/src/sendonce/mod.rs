//! "Send exactly one mail", crash-safely and across leader changes, per mail (the request, and
//! the release sent during deletion): an intent written before the send in one write guarded by
//! `resourceVersion` (the fence between two processes that both believe they lead), the send only
//! while [`crate::Leadership::may_act`], then the sent record in the same annotation
//! ([`records`]). An intent without a sent record is waited on (another holder may still be
//! sending), looked up, or sent again under the **same** Message-Id. The protocol step by step,
//! and what it cannot close: docs/how-it-works.md.
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
