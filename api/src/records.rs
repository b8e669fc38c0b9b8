//! The durable records of the send-once protocol, kept in our annotations
//! ([`crate::names::MAIL_ANNOTATION`], [`crate::names::DELETION_MAIL_ANNOTATION`]): their format
//! and when a value is believed (these annotations are on an object users may write). One
//! annotation per mail goes through the mail's life; release 0.1's two per mail (`mail-intent`,
//! `mail-sent`) are still read and never written. The controllers write them (the protocol:
//! docs/how-it-works.md, step 2 and "Our annotations"); tests and tools read them here.

use k8s_openapi::jiff::Timestamp;
use serde::{Deserialize, Serialize};

/// Longest annotation value this module reads or writes.
pub const MAX_RECORD_BYTES: usize = 1024;

/// Longest Message-Id the mailer sends (`capm_mailer::MAX_MESSAGE_ID_LEN`; the controllers' tests
/// check that the two agree).
pub const MAX_MESSAGE_ID_BYTES: usize = 250;

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
    /// The `MailgunClusterIdentity` the mail goes through; `None` for the provider's own
    /// configuration (and in records of earlier versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
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
    /// The `MailgunClusterIdentity` it went through; `None` for the provider's own
    /// configuration (and in records of earlier versions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<String>,
}

/// What the one record of a mail says (the format written since release 0.2): an
/// [`IntentState`], or that the backend accepted the mail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
enum RecordState {
    Sending,
    Refused,
    Sent,
}

/// The one record of a mail, as written to its annotation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Record {
    message_id: String,
    state: RecordState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    writer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    at: Option<Timestamp>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    backend_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    identity: Option<String>,
}

/// `at` to the whole second, up (`up`) or down.
fn to_second(at: Timestamp, up: bool) -> Timestamp {
    let whole = at.as_second();
    let second = if up && at.subsec_nanosecond() > 0 {
        whole.saturating_add(1)
    } else {
        whole
    };
    Timestamp::from_second(second).unwrap_or(at)
}

/// The record value of an intent not (yet) known to be accepted.
pub fn intent_value(intent: &Intent) -> String {
    to_value(&Record {
        message_id: intent.message_id.clone(),
        state: match intent.state {
            IntentState::Sending => RecordState::Sending,
            IntentState::Refused => RecordState::Refused,
        },
        writer: intent.writer.clone(),
        at: intent.at.map(|at| to_second(at, true)),
        backend_id: None,
        identity: intent.identity.clone(),
    })
}

/// The record value of an accepted mail (`message_id`: ours; the backend's id is kept only when
/// it differs).
pub fn sent_value(message_id: &str, sent: &Sent) -> String {
    to_value(&Record {
        message_id: message_id.to_owned(),
        state: RecordState::Sent,
        writer: None,
        at: sent.at.map(|at| to_second(at, false)),
        backend_id: (sent.backend_id != message_id).then(|| sent.backend_id.clone()),
        identity: sent.identity.clone(),
    })
}

/// Reads a mail's record: the intent it implies, and the sent record when it says `sent`.
///
/// # Errors
/// A [`RecordError`] when the value is not one this provider writes for `kind` and `which`.
pub fn parse_record(
    value: &str,
    kind: &str,
    which: Which,
) -> Result<(Intent, Option<Sent>), RecordError> {
    if value.len() > MAX_RECORD_BYTES {
        return Err(RecordError::TooLong);
    }
    let record: Record = serde_json::from_str(value).map_err(|_| RecordError::Malformed)?;
    if !is_our_message_id(&record.message_id, kind, which) {
        return Err(RecordError::ForeignMessageId);
    }
    check_writer(record.writer.as_deref())?;
    if let Some(id) = record.backend_id.as_deref() {
        check_backend_id(id)?;
    }
    if let Some(identity) = record.identity.as_deref() {
        check_identity(identity)?;
    }
    let (state, sent) = match record.state {
        RecordState::Sending => (IntentState::Sending, None),
        RecordState::Refused => (IntentState::Refused, None),
        RecordState::Sent => (
            IntentState::Sending,
            Some(Sent {
                message_id: Some(record.message_id.clone()),
                backend_id: record
                    .backend_id
                    .unwrap_or_else(|| record.message_id.clone()),
                at: record.at,
                identity: record.identity.clone(),
            }),
        ),
    };
    let intent = Intent {
        message_id: record.message_id,
        writer: record.writer,
        at: if sent.is_some() { None } else { record.at },
        state,
        identity: record.identity,
    };
    Ok((intent, sent))
}

/// Why a value found in one of our annotations is not believed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// Longer than [`MAX_RECORD_BYTES`].
    #[error("longer than {MAX_RECORD_BYTES} bytes")]
    TooLong,
    /// Not JSON of the record's shape (nor, in 0.1's annotations, a bare Message-Id).
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

/// True when `id` is the Message-Id this provider generates for `which` mail of an object of
/// `kind` ([`Which::message_id`]: `<{kind}.{uid}@{domain}>` for the request,
/// `<{kind}-deleted.…>` for the deletion, `<{kind}-reminder-{n}.…>` for reminder `n`) with
/// `kind` lower-cased, a UID-like middle and a host-name-like domain, no longer than a
/// Message-Id the mailer sends.
fn is_our_message_id(id: &str, kind: &str, which: Which) -> bool {
    let Some(inner) = id.strip_prefix('<').and_then(|s| s.strip_suffix('>')) else {
        return false;
    };
    let prefix = match which {
        Which::Request => format!("{}.", kind.to_ascii_lowercase()),
        Which::Deletion => format!("{}-deleted.", kind.to_ascii_lowercase()),
        Which::Reminder(n) => format!("{}-reminder-{}.", kind.to_ascii_lowercase(), clamp(n)),
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
    uid_ok && domain_ok && id.len() <= MAX_MESSAGE_ID_BYTES
}

/// A writer identity, when there is one, must be a plausible Lease holder identity.
fn check_writer(writer: Option<&str>) -> Result<(), RecordError> {
    let plausible = |w: &str| {
        (1..=MAX_WRITER_BYTES).contains(&w.len())
            && w.bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b':'))
    };
    if writer.is_some_and(|w| !plausible(w)) {
        return Err(RecordError::BadWriter);
    }
    Ok(())
}

/// A backend id must be a Message-Id (`<left@right>`, both sides RFC 5322 `dot-atom-text`) of
/// at most [`MAX_MESSAGE_ID_BYTES`], as the mailer sends them.
fn check_backend_id(id: &str) -> Result<(), RecordError> {
    let dot_atom = |s: &str| {
        s.split('.').all(|atom| {
            !atom.is_empty()
                && atom
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "!#$%&'*+-/=?^_`{|}~".contains(c))
        })
    };
    let inner = id.strip_prefix('<').and_then(|s| s.strip_suffix('>'));
    match inner.and_then(|s| s.split_once('@')) {
        Some((l, r)) if id.len() <= MAX_MESSAGE_ID_BYTES && dot_atom(l) && dot_atom(r) => Ok(()),
        _ => Err(RecordError::BadBackendId),
    }
}

/// An identity name as the API server allows it (a DNS subdomain).
fn check_identity(name: &str) -> Result<(), RecordError> {
    let plausible = (1..=253).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.'));
    plausible.then_some(()).ok_or(RecordError::Malformed)
}

/// Reads release 0.1's intent annotation.
fn parse_intent(value: &str, kind: &str, which: Which) -> Result<Intent, RecordError> {
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
            identity: None,
        }
    };
    if !is_our_message_id(&intent.message_id, kind, which) {
        return Err(RecordError::ForeignMessageId);
    }
    check_writer(intent.writer.as_deref())?;
    Ok(intent)
}

/// Reads release 0.1's sent annotation and checks it against the intent it must follow.
fn parse_sent(value: &str, intent: Option<&Intent>) -> Result<Sent, RecordError> {
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
            identity: None,
        }
    };
    check_backend_id(&sent.backend_id)?;
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

fn to_value<T: Serialize>(record: &T) -> String {
    // Serialising these plain structs cannot fail; an empty string would be read as malformed.
    serde_json::to_string(record).unwrap_or_default()
}

/// One mail's durable records as found, each either believed or ignored with the reason.
pub struct Records {
    /// The intent believed, if any.
    pub intent: Option<Intent>,
    /// The sent record believed, if any.
    pub sent: Option<Sent>,
    /// Annotations present but not believed: key and reason.
    pub ignored: Vec<(&'static str, RecordError)>,
}

/// `parsed`, or `None` with `key` and the reason noted in `ignored`.
fn believe<T>(
    ignored: &mut Vec<(&'static str, RecordError)>,
    key: &'static str,
    parsed: Result<T, RecordError>,
) -> Option<T> {
    parsed.map_err(|e| ignored.push((key, e))).ok()
}

/// Reads one mail's records from `annotations`: its one record, or release 0.1's intent and
/// sent annotations when there is no record we believe.
pub fn read_records(
    annotations: &std::collections::BTreeMap<String, String>,
    kind: &str,
    which: Which,
) -> Records {
    let mut ignored = Vec::new();
    let record_key = which.record_key();
    let record = (annotations.get(record_key))
        .and_then(|v| believe(&mut ignored, record_key, parse_record(v, kind, which)));
    if let Some((intent, sent)) = record {
        return Records {
            intent: Some(intent),
            sent,
            ignored,
        };
    }
    let intent = which.intent_key().and_then(|key| {
        let value = annotations.get(key)?;
        believe(&mut ignored, key, parse_intent(value, kind, which))
    });
    let sent = which.sent_key().and_then(|key| {
        let value = annotations.get(key)?;
        believe(&mut ignored, key, parse_sent(value, intent.as_ref()))
    });
    Records {
        intent,
        sent,
        ignored,
    }
}

/// Which of an object's mails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// "One cluster please"; a `MailgunRemediation`'s repair mail.
    Request,
    /// "No longer needed", sent during deletion if a request went out.
    Deletion,
    /// Reminder `n` (1 to [`crate::limits::MAX_REMINDERS`]; others read as the nearest) of a
    /// `MailgunRemediation`'s repair mail, threaded to it.
    Reminder(u8),
}

/// A reminder's number within 1 to [`crate::limits::MAX_REMINDERS`].
fn clamp(n: u8) -> u8 {
    n.clamp(1, crate::limits::MAX_REMINDERS)
}

impl Which {
    /// The annotation holding this mail's one record.
    pub fn record_key(self) -> &'static str {
        match self {
            Self::Request => crate::names::MAIL_ANNOTATION,
            Self::Deletion => crate::names::DELETION_MAIL_ANNOTATION,
            Self::Reminder(n) => crate::names::REMINDER_MAIL_ANNOTATIONS[usize::from(clamp(n)) - 1],
        }
    }
    /// Release 0.1's intent annotation (read, removed on our next write); none for mails
    /// release 0.1 did not send.
    pub fn intent_key(self) -> Option<&'static str> {
        match self {
            Self::Request => Some(crate::names::MAIL_INTENT_ANNOTATION),
            Self::Deletion => Some(crate::names::DELETION_MAIL_INTENT_ANNOTATION),
            Self::Reminder(_) => None,
        }
    }
    /// Release 0.1's sent annotation (read, removed on our next write); none for mails
    /// release 0.1 did not send.
    pub fn sent_key(self) -> Option<&'static str> {
        match self {
            Self::Request => Some(crate::names::MAIL_SENT_ANNOTATION),
            Self::Deletion => Some(crate::names::DELETION_MAIL_SENT_ANNOTATION),
            Self::Reminder(_) => None,
        }
    }
    /// The deterministic Message-Id of this mail of the object `uid` of `kind`.
    pub fn message_id(self, kind: &str, uid: &str, domain: &str) -> String {
        match self {
            Self::Request => crate::names::message_id(kind, uid, domain),
            Self::Deletion => crate::names::deletion_message_id(kind, uid, domain),
            Self::Reminder(n) => crate::names::reminder_message_id(kind, clamp(n), uid, domain),
        }
    }
    /// The mail this one follows: the request, for the deletion and the reminders. Its
    /// identity carries this one, and a reminder is threaded to it.
    pub fn follows(self) -> Option<Self> {
        match self {
            Self::Request => None,
            Self::Deletion | Self::Reminder(_) => Some(Self::Request),
        }
    }
    /// `request` / `deletion` / `reminder-n`: the mail in logs, metric labels and tags.
    pub fn label(self) -> &'static str {
        match self {
            Self::Request => "request",
            Self::Deletion => "deletion",
            Self::Reminder(n) => {
                ["reminder-1", "reminder-2", "reminder-3"][usize::from(clamp(n)) - 1]
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0b6e2c1a-9f3d-4c55-8a11-2f1e9d7c6b5a";

    fn id(which: Which) -> String {
        match which {
            Which::Request => format!("<mailguncluster.{UID}@mg.example.com>"),
            Which::Deletion => format!("<mailguncluster-deleted.{UID}@mg.example.com>"),
            Which::Reminder(n) => format!("<mailguncluster-reminder-{n}.{UID}@mg.example.com>"),
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

    /// Each reminder is a mail of its own: its own annotation, its own Message-Id, and no record
    /// of another mail (the repair mail's, another reminder's) is believed for it.
    #[test]
    fn each_reminder_has_its_own_record_and_message_id() {
        let kind = "MailgunRemediation";
        let ids: Vec<String> = (1..=3)
            .map(|n| Which::Reminder(n).message_id(kind, UID, "mg.example.com"))
            .collect();
        assert_eq!(
            ids[1],
            format!("<mailgunremediation-reminder-2.{UID}@mg.example.com>")
        );
        let keys: std::collections::BTreeSet<_> = [Which::Request, Which::Deletion]
            .into_iter()
            .chain((1..=3).map(Which::Reminder))
            .map(Which::record_key)
            .collect();
        assert_eq!(keys.len(), 5, "one annotation per mail");
        for (n, id) in (1..=3).zip(&ids) {
            let which = Which::Reminder(n);
            assert!(is_our_message_id(id, kind, which));
            assert_eq!(which.follows(), Some(Which::Request));
            assert_eq!((which.intent_key(), which.sent_key()), (None, None));
            let sent = Sent {
                message_id: Some(id.clone()),
                backend_id: id.clone(),
                at: None,
                identity: None,
            };
            let annotations = [(which.record_key().to_owned(), sent_value(id, &sent))].into();
            assert!(read_records(&annotations, kind, which).sent.is_some());
            for other in [Which::Request, Which::Reminder(n % 3 + 1)] {
                let theirs = read_records(
                    &[(other.record_key().to_owned(), sent_value(id, &sent))].into(),
                    kind,
                    other,
                );
                assert!(
                    theirs.sent.is_none(),
                    "{which:?}'s record read as {other:?}'s"
                );
            }
        }
        assert!(!is_our_message_id(
            &Which::Request.message_id(kind, UID, "mg.example.com"),
            kind,
            Which::Reminder(1)
        ));
    }

    #[test]
    fn intents_round_trip_and_legacy_values_are_read() {
        let intent = Intent {
            message_id: id(Which::Request),
            writer: Some("capm-7d9f-abc_k2j4h5g6f7".into()),
            at: Some("2026-11-23T10:00:00Z".parse().unwrap()),
            identity: None,
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
    fn one_record_goes_through_the_mail_s_life() {
        let (k, r) = ("MailgunCluster", Which::Request);
        let intent = Intent {
            message_id: id(r),
            writer: Some("capm-7d9f-abc_k2j4h5g6f7".into()),
            at: Some("2026-11-23T10:00:00.25Z".parse().unwrap()),
            identity: Some("tenant-a".into()),
            state: IntentState::Sending,
        };
        let value = intent_value(&intent);
        let (read, sent) = parse_record(&value, k, r).unwrap();
        assert_eq!(sent, None);
        assert_eq!(
            read.at,
            Some("2026-11-23T10:00:01Z".parse().unwrap()),
            "an intent's time is rounded up: it looks younger, never older"
        );
        assert_eq!(
            (read.writer, read.state),
            (intent.writer, IntentState::Sending)
        );

        let accepted = Sent {
            message_id: Some(id(r)),
            backend_id: id(r),
            at: Some("2026-11-23T10:00:02.9Z".parse().unwrap()),
            identity: None,
        };
        let value = sent_value(&id(r), &accepted);
        assert_eq!(
            value,
            format!(
                r#"{{"messageId":"{}","state":"sent","at":"2026-11-23T10:00:02Z"}}"#,
                id(r)
            ),
            "no writer, no backend id equal to ours, a time to the second"
        );
        let (_, sent) = parse_record(&value, k, r).unwrap();
        let sent = sent.unwrap();
        assert_eq!(
            (sent.backend_id.as_str(), sent.message_id.as_deref()),
            (id(r).as_str(), Some(id(r).as_str()))
        );
        let other = Sent {
            backend_id: "<20261123.1@mg.example.com>".into(),
            ..accepted
        };
        let (_, sent) = parse_record(&sent_value(&id(r), &other), k, r).unwrap();
        assert_eq!(sent.unwrap().backend_id, "<20261123.1@mg.example.com>");
    }

    #[test]
    fn records_we_did_not_write_are_refused() {
        let (k, r) = ("MailgunCluster", Which::Request);
        for (value, error) in [
            ("x".repeat(1500), RecordError::TooLong),
            (id(r), RecordError::Malformed),
            (
                format!(r#"{{"messageId":"{}","state":"delivered"}}"#, id(r)),
                RecordError::Malformed,
            ),
            (
                format!(r#"{{"messageId":"{}","state":"sent","extra":1}}"#, id(r)),
                RecordError::Malformed,
            ),
            (
                r#"{"messageId":"<forged@evil.example>","state":"sent"}"#.to_owned(),
                RecordError::ForeignMessageId,
            ),
            (
                format!(
                    r#"{{"messageId":"{}","state":"sent"}}"#,
                    id(Which::Deletion)
                ),
                RecordError::ForeignMessageId,
            ),
            (
                format!(
                    r#"{{"messageId":"{}","state":"sending","writer":"a\r\nb"}}"#,
                    id(r)
                ),
                RecordError::BadWriter,
            ),
            (
                format!(
                    r#"{{"messageId":"{}","state":"sent","backendId":"not an id"}}"#,
                    id(r)
                ),
                RecordError::BadBackendId,
            ),
        ] {
            assert_eq!(parse_record(&value, k, r), Err(error), "{value}");
        }
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
            identity: None,
        };
        let value = to_value(&sent);
        assert_eq!(parse_sent(&value, Some(&intent)), Ok(sent));
        assert_eq!(parse_sent(&value, None), Err(RecordError::Unmatched));
        assert!(parse_sent("<20261123.1@mg.example.com>", Some(&intent)).is_ok());
        let other = to_value(&Sent {
            message_id: Some("<mailguncluster.other@mg.example.com>".into()),
            backend_id: "<a@b.example>".into(),
            at: None,
            identity: None,
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
