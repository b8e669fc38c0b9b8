//! What Mailgun's events say about one mail: an event as both APIs give it, and how a mail's
//! events fold into one [`Delivery`](crate::Delivery) answer.

use serde::Deserialize;

use super::error_text;

/// Recipients tracked per delivery question (a message has a handful).
const MAX_TRACKED_RECIPIENTS: usize = 1000;

/// One event, as both APIs give it (the Logs API's items carry the same fields by the same
/// names, plus `@timestamp`).
#[derive(Deserialize)]
pub(super) struct EventItem {
    pub(super) event: String,
    #[serde(default)]
    recipient: Option<String>,
    #[serde(default)]
    severity: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default, rename = "delivery-status")]
    delivery_status: Option<DeliveryStatusField>,
    #[serde(default)]
    message: Option<EventMessage>,
}

#[derive(Deserialize)]
struct EventMessage {
    #[serde(default)]
    headers: EventHeaders,
}

#[derive(Deserialize, Default)]
struct EventHeaders {
    #[serde(default, rename = "message-id")]
    message_id: Option<String>,
}

impl EventItem {
    /// The event's Message-Id without brackets, if it names one.
    pub(super) fn message_id(&self) -> Option<&str> {
        let id = self.message.as_ref()?.headers.message_id.as_deref()?;
        Some(id.trim().trim_start_matches('<').trim_end_matches('>'))
    }
}

#[derive(Deserialize)]
struct DeliveryStatusField {
    #[serde(default)]
    code: Option<serde_json::Value>,
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    description: Option<String>,
}

impl EventItem {
    /// `reason (code message)`, single line and bounded: what the receiving side said.
    fn failure_text(&self) -> String {
        let mut text = self.reason.clone().unwrap_or_else(|| "failed".into());
        if let Some(status) = &self.delivery_status {
            let code = status.code.as_ref().map(|c| match c {
                serde_json::Value::String(s) => s.clone(),
                other => other.to_string(),
            });
            let detail = status
                .message
                .as_deref()
                .filter(|m| !m.trim().is_empty())
                .or(status.description.as_deref())
                .unwrap_or_default()
                .trim();
            let detail = [code.unwrap_or_default(), detail.to_owned()]
                .into_iter()
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join(" ");
            if !detail.is_empty() {
                text = format!("{text}: {detail}");
            }
        }
        if let Some(recipient) = &self.recipient {
            text = format!("{recipient}: {text}");
        }
        error_text(text.as_bytes())
    }
}

/// Where one recipient's copy stands, from its events in time order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum RecipientState {
    Pending(Option<String>),
    Delivered,
    Failed(String),
}

/// Folds events (oldest first) into one answer, page by page, keeping only what the answer needs
/// (bounded texts, at most [`MAX_TRACKED_RECIPIENTS`] recipients): final only once every
/// recipient seen is (delivered, or failed for good); then delivered when all have it, failed
/// when none has, partly delivered otherwise: a failure to one recipient is reported even when
/// another has the mail. Pending while any is open, with the latest temporary failure.
#[derive(Default)]
pub(super) struct Fold {
    recipients: Vec<(String, RecipientState)>,
    latest_temporary: Option<String>,
}

impl Fold {
    pub(super) fn add(&mut self, item: &EventItem) {
        let who = crate::text::clean(item.recipient.as_deref().unwrap_or_default(), 320);
        let next = match (item.event.as_str(), item.severity.as_deref()) {
            ("delivered", _) => RecipientState::Delivered,
            ("failed", Some("temporary")) => {
                let text = item.failure_text();
                self.latest_temporary = Some(text.clone());
                RecipientState::Pending(Some(text))
            }
            ("failed" | "rejected", _) => RecipientState::Failed(item.failure_text()),
            _ => RecipientState::Pending(None),
        };
        let tracked = self.recipients.len();
        match self.recipients.iter_mut().find(|(r, _)| *r == who) {
            // A final state stays: later `accepted`/`opened`... events change nothing.
            Some((_, state)) => {
                if matches!(state, RecipientState::Pending(_)) {
                    *state = next;
                }
            }
            None if tracked < MAX_TRACKED_RECIPIENTS => self.recipients.push((who, next)),
            None => {}
        }
    }

    pub(super) fn finish(self) -> crate::Delivery {
        let open = self
            .recipients
            .iter()
            .any(|(_, s)| matches!(s, RecipientState::Pending(_)));
        if self.recipients.is_empty() || open {
            return crate::Delivery::Pending {
                temporary_failure: self.latest_temporary,
            };
        }
        let failures: Vec<&str> = self
            .recipients
            .iter()
            .filter_map(|(_, s)| match s {
                RecipientState::Failed(reason) => Some(reason.as_str()),
                _ => None,
            })
            .collect();
        let text = || error_text(failures.join("; ").as_bytes());
        if failures.is_empty() {
            crate::Delivery::Delivered
        } else if failures.len() == self.recipients.len() {
            crate::Delivery::Failed { reason: text() }
        } else {
            crate::Delivery::PartlyDelivered { failed: text() }
        }
    }
}

#[cfg(test)]
pub(super) fn fold_events(items: &[EventItem]) -> crate::Delivery {
    let mut fold = Fold::default();
    for item in items {
        fold.add(item);
    }
    fold.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(event: &str, recipient: &str, severity: Option<&str>) -> EventItem {
        EventItem {
            event: event.into(),
            recipient: Some(recipient.into()),
            severity: severity.map(Into::into),
            reason: Some("bounce".into()),
            delivery_status: None,
            message: None,
        }
    }

    #[test]
    fn events_fold_per_recipient() {
        use crate::Delivery;
        let accepted = |r| item("accepted", r, None);
        assert_eq!(
            fold_events(&[]),
            Delivery::Pending {
                temporary_failure: None
            }
        );
        // A final state is not undone by later events of the same recipient.
        assert_eq!(
            fold_events(&[
                accepted("a@x"),
                item("delivered", "a@x", None),
                item("opened", "a@x", None)
            ]),
            Delivery::Delivered
        );
        let failed = fold_events(&[
            accepted("a@x"),
            accepted("b@x"),
            item("failed", "a@x", Some("permanent")),
            item("failed", "b@x", Some("permanent")),
        ]);
        assert_eq!(
            failed,
            Delivery::Failed {
                reason: "a@x: bounce; b@x: bounce".into()
            }
        );
        assert!(matches!(
            fold_events(&[
                accepted("a@x"),
                accepted("b@x"),
                item("failed", "a@x", Some("permanent")),
                item("failed", "b@x", Some("temporary")),
            ]),
            Delivery::Pending {
                temporary_failure: Some(_)
            }
        ));
        // One recipient has it, the other is still on its way: not final yet.
        assert_eq!(
            fold_events(&[
                accepted("a@x"),
                accepted("b@x"),
                item("delivered", "a@x", None)
            ]),
            Delivery::Pending {
                temporary_failure: None
            }
        );
        // A failure to one recipient is reported although the other has the mail.
        assert_eq!(
            fold_events(&[
                accepted("a@x"),
                accepted("b@x"),
                item("delivered", "a@x", None),
                item("failed", "b@x", Some("permanent")),
            ]),
            Delivery::PartlyDelivered {
                failed: "b@x: bounce".into()
            }
        );
    }
}
