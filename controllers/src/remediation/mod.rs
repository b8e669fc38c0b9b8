//! Remediation by mail: the `MailgunRemediation` controller (Cluster API external remediation
//! answered by a human; docs/proposals/remediation-by-mail.md).
//!
//! [`decide`] is the whole decision as a pure function; [`mail`] the texts. The mails go through
//! the send-once layer ([`crate::sendonce`]) as the request and release mails do, each with its
//! own record ([`crate::sendonce::Which`]: the repair mail is the object's request, the "no
//! longer needed" mail its deletion mail, and each reminder has its own).

pub(crate) mod decide;
mod handback;
mod kind;
pub(crate) mod mail;
mod reconcile;
mod shown;
mod view;

pub(crate) use self::reconcile::reconcile;

use std::collections::BTreeMap;

use k8s_openapi::jiff::Timestamp;

use self::decide::Mail;
use crate::sendonce::{
    Which,
    records::{IntentState, read_records},
};

/// The kind whose records these are.
const KIND: &str = "MailgunRemediation";

/// What the records in `annotations` say of `which` mail. A sent record without a time (one
/// found at the backend after a crash) is taken as sent at `sent_at` (what the status shows,
/// else now: the wait is then counted from when it was first seen, never shortened).
pub fn mail_of(
    annotations: &BTreeMap<String, String>,
    which: Which,
    sent_at: Option<Timestamp>,
    now: Timestamp,
) -> Mail {
    let records = read_records(annotations, KIND, which);
    match (records.sent, records.intent) {
        (Some(sent), _) => Mail::Sent(sent.at.or(sent_at).unwrap_or(now)),
        (None, Some(intent)) if intent.state == IntentState::Refused => Mail::Refused,
        (None, Some(_)) => Mail::Pending,
        (None, None) => Mail::None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sendonce::records::{Intent, Sent, intent_value, sent_value};

    #[test]
    fn each_mail_is_read_from_its_own_record() {
        let (uid, domain) = ("0b6e2c1a-9f3d", "mg.example.com");
        let now: Timestamp = "2026-11-29T06:00:00Z".parse().unwrap();
        let at: Timestamp = "2026-11-29T05:00:00Z".parse().unwrap();
        let id = |w: Which| w.message_id(KIND, uid, domain);
        let sent = |w: Which, at| {
            sent_value(
                &id(w),
                &Sent {
                    message_id: Some(id(w)),
                    backend_id: id(w),
                    at,
                    identity: None,
                },
            )
        };
        let intent = |w: Which, state| {
            intent_value(&Intent {
                message_id: id(w),
                writer: None,
                at: Some(at),
                state,
                identity: None,
            })
        };
        let annotations: BTreeMap<String, String> = [
            (
                Which::Request.record_key().into(),
                sent(Which::Request, Some(at)),
            ),
            (
                Which::Reminder(1).record_key().into(),
                sent(Which::Reminder(1), None),
            ),
            (
                Which::Reminder(2).record_key().into(),
                intent(Which::Reminder(2), IntentState::Sending),
            ),
            (
                Which::Deletion.record_key().into(),
                intent(Which::Deletion, IntentState::Refused),
            ),
        ]
        .into();
        let read = |w| mail_of(&annotations, w, None, now);
        assert_eq!(read(Which::Request), Mail::Sent(at));
        assert_eq!(
            read(Which::Reminder(1)),
            Mail::Sent(now),
            "no time: from now"
        );
        assert_eq!(
            mail_of(&annotations, Which::Reminder(1), Some(at), now),
            Mail::Sent(at),
            "no time: the status's"
        );
        assert_eq!(read(Which::Reminder(2)), Mail::Pending);
        assert_eq!(read(Which::Reminder(3)), Mail::None);
        assert_eq!(read(Which::Deletion), Mail::Refused);
        // A record copied from another mail is not believed for this one.
        let copied: BTreeMap<String, String> = [(
            Which::Reminder(3).record_key().into(),
            sent(Which::Request, Some(at)),
        )]
        .into();
        assert_eq!(mail_of(&copied, Which::Reminder(3), None, now), Mail::None);
    }
}
