//! The durable records of the send-once protocol, kept in our annotations.
//!
//! Metadata survives `clusterctl move` and backups (status does not), so everything the protocol
//! must remember lives here:
//! - the **intent** (`mail-intent`, `deletion-mail-intent`), written before any send:
//!   `{"messageId":"<…>","writer":"<Lease identity>","at":"<RFC 3339>","state":"sending"|"refused"}`;
//! - the **sent record** (`mail-sent`, `deletion-mail-sent`), written after the backend accepted:
//!   `{"messageId":"<…>","backendId":"<…>","at":"<RFC 3339>"}`.
//!
//! Values written by earlier versions (the bare Message-Id / backend id) are still read.
//!
//! # Trust
//! These annotations are on an object users may write. The chart's admission policy keeps users
//! from changing them; independently of it, a value is believed only when it has our exact shape
//! (Message-Id `<kind[-deleted].uid@domain>`, at most [`MAX_RECORD_BYTES`]), and a sent record
//! only together with an intent naming the same Message-Id. Anything else is treated as absent
//! and overwritten by our next write; it never reaches status. A moved object legitimately
//! carries our records with the UID of its source object: the UID in a Message-Id is therefore
//! not compared with the object's.

use capm_mailer::MessageId;
use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

use crate::sendonce::Which;

/// Longest annotation value this module reads or writes.
pub const MAX_RECORD_BYTES: usize = 1024;

/// Longest Lease holder identity kept in an intent.
const MAX_WRITER_BYTES: usize = 253;

/// What the last attempt under an intent is known to have done.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum IntentState {
    /// An attempt may be in flight, or its outcome is unknown: the mail may have been accepted.
    #[default]
    Sending,
    /// Every attempt so far was refused by the backend before it accepted anything: the mail
    /// certainly never went out.
    Refused,
}

/// The intent record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Intent {
    /// The Message-Id every attempt carries.
    pub message_id: String,
    /// The Lease holder identity of the process that wrote it; `None` in records of earlier
    /// versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<String>,
    /// When it was written (the writer's clock); `None` in records of earlier versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<Timestamp>,
    /// What the last attempt is known to have done.
    #[serde(default)]
    pub state: IntentState,
}

/// The sent record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sent {
    /// Our Message-Id; `None` in records of earlier versions (then the intent's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message_id: Option<String>,
    /// The id the backend reported.
    pub backend_id: String,
    /// When the backend accepted it (our clock); `None` in records of earlier versions.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<Timestamp>,
}

/// Why a value found in one of our annotations is not believed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Longer than [`MAX_RECORD_BYTES`].
    #[error("longer than {MAX_RECORD_BYTES} bytes")]
    TooLong,
    /// Not JSON of the record's shape nor a bare Message-Id.
    #[error("not a record this provider writes")]
    Malformed,
    /// The Message-Id is not of the shape this provider generates for this kind and mail.
    #[error("the Message-Id is not one this provider generates for this object")]
    ForeignMessageId,
    /// The writer identity is not a plausible Lease holder identity.
    #[error("the writer identity is not valid")]
    BadWriter,
    /// The backend id is not a valid Message-Id.
    #[error("the backend id is not a valid Message-Id")]
    BadBackendId,
    /// A sent record without an intent, or naming another Message-Id than the intent.
    #[error("no matching intent")]
    Unmatched,
}

/// True when `id` is `<{kind}.{uid}@{domain}>` (request) or `<{kind}-deleted.{uid}@{domain}>`
/// (deletion) with `kind` lower-cased, a UID-like middle and a host-name-like domain, and a
/// valid Message-Id besides.
pub fn is_our_message_id(id: &str, kind: &str, which: Which) -> bool {
    let Some(inner) = id.strip_prefix('<').and_then(|s| s.strip_suffix('>')) else {
        return false;
    };
    let prefix = match which {
        Which::Request => format!("{}.", kind.to_ascii_lowercase()),
        Which::Deletion => format!("{}-deleted.", kind.to_ascii_lowercase()),
    };
    let Some(rest) = inner.strip_prefix(&prefix) else {
        return false;
    };
    let Some((uid, domain)) = rest.split_once('@') else {
        return false;
    };
    let uid_ok = (1..=64).contains(&uid.len())
        && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    let domain_ok = (1..=253).contains(&domain.len())
        && domain
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.')
        && !domain.starts_with(['.', '-'])
        && !domain.ends_with(['.', '-'])
        && !domain.contains("..");
    uid_ok && domain_ok && MessageId::parse(id).is_ok()
}

fn plausible_writer(writer: &str) -> bool {
    (1..=MAX_WRITER_BYTES).contains(&writer.len())
        && writer
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b':'))
}

/// Reads an intent value.
///
/// # Errors
/// A [`RecordError`] when the value is not one this provider writes for `kind` and `which`.
pub fn parse_intent(value: &str, kind: &str, which: Which) -> Result<Intent, RecordError> {
    if value.len() > MAX_RECORD_BYTES {
        return Err(RecordError::TooLong);
    }
    let intent = if value.starts_with('{') {
        serde_json::from_str::<Intent>(value).map_err(|_| RecordError::Malformed)?
    } else {
        Intent {
            message_id: value.to_owned(),
            writer: None,
            at: None,
            state: IntentState::Sending,
        }
    };
    if !is_our_message_id(&intent.message_id, kind, which) {
        return Err(RecordError::ForeignMessageId);
    }
    if intent
        .writer
        .as_deref()
        .is_some_and(|w| !plausible_writer(w))
    {
        return Err(RecordError::BadWriter);
    }
    Ok(intent)
}

/// Reads a sent record and checks it against the intent it must follow.
///
/// # Errors
/// A [`RecordError`] when the value is not one this provider writes, or does not match
/// `intent`.
pub fn parse_sent(value: &str, intent: Option<&Intent>) -> Result<Sent, RecordError> {
    if value.len() > MAX_RECORD_BYTES {
        return Err(RecordError::TooLong);
    }
    let sent = if value.starts_with('{') {
        serde_json::from_str::<Sent>(value).map_err(|_| RecordError::Malformed)?
    } else {
        Sent {
            message_id: None,
            backend_id: value.to_owned(),
            at: None,
        }
    };
    if MessageId::parse(&sent.backend_id).is_err() || sent.backend_id.len() > 256 {
        return Err(RecordError::BadBackendId);
    }
    let Some(intent) = intent else {
        return Err(RecordError::Unmatched);
    };
    if sent
        .message_id
        .as_deref()
        .is_some_and(|id| id != intent.message_id)
    {
        return Err(RecordError::Unmatched);
    }
    Ok(sent)
}

/// The JSON value of a record.
pub fn to_value<T: Serialize>(record: &T) -> String {
    // Serialising these plain structs cannot fail; an empty string would be read as malformed.
    serde_json::to_string(record).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0b6e2c1a-9f3d-4c55-8a11-2f1e9d7c6b5a";

    fn id(which: Which) -> String {
        match which {
            Which::Request => format!("<mailguncluster.{UID}@mg.example.com>"),
            Which::Deletion => format!("<mailguncluster-deleted.{UID}@mg.example.com>"),
        }
    }

    #[test]
    fn our_message_ids_and_only_those() {
        assert!(is_our_message_id(
            &id(Which::Request),
            "MailgunCluster",
            Which::Request
        ));
        assert!(is_our_message_id(
            &id(Which::Deletion),
            "MailgunCluster",
            Which::Deletion
        ));
        for bad in [
            id(Which::Deletion),
            "<forged@evil.example>".into(),
            format!("<mailgunmachine.{UID}@mg.example.com>"),
            format!("<mailguncluster.{UID}@mg.example.com>\r\nBcc: x@evil.example"),
            format!("<mailguncluster.{UID}@mg..example.com>"),
            format!("<mailguncluster.{}@mg.example.com>", "a".repeat(65)),
            format!("mailguncluster.{UID}@mg.example.com"),
            format!("<mailguncluster.{UID} @mg.example.com>"),
            format!("<mailguncluster.{UID}@mg.example.com\u{2028}>"),
        ] {
            assert!(
                !is_our_message_id(&bad, "MailgunCluster", Which::Request),
                "{bad:?}"
            );
        }
        assert!(!is_our_message_id(
            &id(Which::Request),
            "MailgunCluster",
            Which::Deletion
        ));
    }

    #[test]
    fn intents_round_trip_and_legacy_values_are_read() {
        let intent = Intent {
            message_id: id(Which::Request),
            writer: Some("capm-7d9f-abc_k2j4h5g6f7".into()),
            at: Some("2026-11-23T10:00:00Z".parse().unwrap()),
            state: IntentState::Refused,
        };
        let value = to_value(&intent);
        assert!(value.len() < MAX_RECORD_BYTES);
        assert_eq!(
            parse_intent(&value, "MailgunCluster", Which::Request),
            Ok(intent)
        );
        let legacy = parse_intent(&id(Which::Request), "MailgunCluster", Which::Request).unwrap();
        assert_eq!(
            (legacy.writer, legacy.at, legacy.state),
            (None, None, IntentState::Sending)
        );
    }

    #[test]
    fn values_we_did_not_write_are_refused() {
        let k = "MailgunCluster";
        let r = Which::Request;
        assert_eq!(
            parse_intent(&"x".repeat(1500), k, r),
            Err(RecordError::TooLong)
        );
        assert_eq!(
            parse_intent("{\"nope\":1}", k, r),
            Err(RecordError::Malformed)
        );
        assert_eq!(
            parse_intent("<forged@evil.example>", k, r),
            Err(RecordError::ForeignMessageId)
        );
        let bad_writer = format!(
            r#"{{"messageId":"{}","writer":"a\r\nb","state":"sending"}}"#,
            id(r)
        );
        assert_eq!(parse_intent(&bad_writer, k, r), Err(RecordError::BadWriter));
        let bad_state = format!(r#"{{"messageId":"{}","state":"delivered"}}"#, id(r));
        assert_eq!(parse_intent(&bad_state, k, r), Err(RecordError::Malformed));
    }

    #[test]
    fn a_sent_record_needs_a_matching_intent() {
        let intent = parse_intent(&id(Which::Request), "MailgunCluster", Which::Request).unwrap();
        let sent = Sent {
            message_id: Some(id(Which::Request)),
            backend_id: "<20261123.1@mg.example.com>".into(),
            at: None,
        };
        let value = to_value(&sent);
        assert_eq!(parse_sent(&value, Some(&intent)), Ok(sent));
        assert_eq!(parse_sent(&value, None), Err(RecordError::Unmatched));
        assert!(parse_sent("<20261123.1@mg.example.com>", Some(&intent)).is_ok());
        let other = to_value(&Sent {
            message_id: Some("<mailguncluster.other@mg.example.com>".into()),
            backend_id: "<a@b.example>".into(),
            at: None,
        });
        assert_eq!(
            parse_sent(&other, Some(&intent)),
            Err(RecordError::Unmatched)
        );
        assert_eq!(
            parse_sent("not an id", Some(&intent)),
            Err(RecordError::BadBackendId)
        );
        assert_eq!(
            parse_sent(&"<a@b>".repeat(300), Some(&intent)),
            Err(RecordError::TooLong)
        );
    }
}
