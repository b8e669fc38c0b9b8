//! Mailgun's Logs API, `POST /v1/analytics/logs`: the crash-recovery lookup and delivery status,
//! many Message-Ids per question.
//!
//! The request and reply follow Mailgun's published OpenAPI description of the endpoint
//! (`start`/`end` in RFC 2822, `events`, `filter.AND[] = {attribute, comparator, values[] =
//! {label, value}}`, `pagination = {sort, token, limit ≤ 100}`; the reply's `items` and
//! `pagination.next`, a token). The endpoint is the account's, not the domain's: every query
//! also filters on our `domain`.
//!
//! # Caveats
//! The description names no attribute for the Message-Id; [`MESSAGE_ID_ATTRIBUTE`] is the name
//! the items carry it under (`message.headers.message-id`) and the events API filters by. The
//! reply is checked anyway: items of other Message-Ids are ignored, so a server that ignored
//! the clause would cost pages, not wrong answers.

use std::{
    collections::HashMap,
    time::{Duration, SystemTime},
};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::{
    BACKEND, EVENTS_CLOCK_SLACK, EventSource, Reader,
    outcome::{EventItem, Fold},
};
use crate::{Delivery, Lookup, MailError, MessageId, OpenMail};

/// The most Message-Ids one Logs question names: a page's worth (the API serves at most 100
/// items a page, and a mail has an `accepted` event per recipient at least).
pub const LOGS_BATCH: usize = 100;
/// The page size asked for: the most the OpenAPI description allows.
const PAGE_LIMIT: u32 = 100;
/// At most this many pages are read per question: 100 mails with a handful of events per
/// recipient fit several times over; more means a server that pages forever.
const MAX_PAGES: usize = 50;
/// The filter attribute that selects by Message-Id (see the module's caveats).
pub(super) const MESSAGE_ID_ATTRIBUTE: &str = "message-id";
/// The events that answer both questions: any of them but `rejected` means Mailgun accepted the
/// message; `delivered` and `failed` say what became of it.
const EVENTS: &[&str] = &["accepted", "rejected", "delivered", "failed"];
/// How far back a lookup searches: the crash-recovery lookup asks about a send attempted moments
/// ago, and Mailgun promises its events for at least 3 days.
const LOOKUP_WINDOW: Duration = Duration::from_secs(3 * 24 * 3600);

/// The request body.
#[derive(Debug, Serialize)]
struct LogsRequest<'a> {
    start: String,
    end: String,
    events: &'a [&'a str],
    filter: Filter,
    include_totals: bool,
    pagination: Pagination,
}

#[derive(Debug, Serialize)]
struct Filter {
    #[serde(rename = "AND")]
    and: Vec<Clause>,
}

#[derive(Debug, Serialize)]
struct Clause {
    attribute: &'static str,
    comparator: &'static str,
    values: Vec<Value>,
}

#[derive(Debug, Serialize)]
struct Value {
    label: String,
    value: String,
}

#[derive(Debug, Serialize)]
struct Pagination {
    sort: &'static str,
    limit: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    token: Option<String>,
}

#[derive(Deserialize)]
struct LogsResponse {
    #[serde(default)]
    items: Vec<EventItem>,
    #[serde(default)]
    pagination: NextPage,
}

#[derive(Deserialize, Default)]
struct NextPage {
    #[serde(default)]
    next: Option<String>,
}

/// `at` as RFC 2822 in the documented form (`Mon, 08 Jul 2024 00:00:00 -0000`), to the second:
/// HTTP's date with the zone RFC 2822 writes for UTC.
fn rfc2822(at: SystemTime) -> String {
    let http = httpdate::fmt_http_date(at);
    match http.strip_suffix("GMT") {
        Some(head) => format!("{head}-0000"),
        None => http,
    }
}

fn equals(attribute: &'static str, values: impl IntoIterator<Item = String>) -> Clause {
    Clause {
        attribute,
        comparator: "=",
        values: values
            .into_iter()
            .map(|v| Value {
                label: v.clone(),
                value: v,
            })
            .collect(),
    }
}

fn retryable(message: impl Into<String>) -> MailError {
    MailError::Retryable {
        backend: BACKEND,
        code: None,
        retry_after: None,
        message: message.into(),
        source: None,
    }
}

/// The Logs API of the account, asked about one sending domain.
#[derive(Debug)]
pub(super) struct Logs {
    /// `<base>/v1/analytics/logs`: the only address the key is sent to.
    url: String,
    /// The sending domain every query filters on.
    domain: String,
}

impl Logs {
    pub(super) fn new(base_url: &str, domain: &str) -> Self {
        Self {
            url: format!("{base_url}/v1/analytics/logs"),
            domain: domain.to_owned(),
        }
    }

    /// Every event of the Message-Ids `ids` (bare) since `since`, oldest first, page by page
    /// into `each`. The next page is asked at the same URL with the reply's token (the key never
    /// goes anywhere else).
    async fn events(
        &self,
        reader: &Reader,
        ids: &[&str],
        since: SystemTime,
        mut each: impl FnMut(&EventItem),
    ) -> Result<(), MailError> {
        // Mailgun's clock may be ahead of ours or behind; a window that starts after it ends
        // (a send time in the future) is empty, not an error.
        let end = SystemTime::now() + EVENTS_CLOCK_SLACK;
        let start = since
            .checked_sub(EVENTS_CLOCK_SLACK)
            .unwrap_or(since)
            .min(end);
        let mut body = LogsRequest {
            start: rfc2822(start),
            end: rfc2822(end),
            events: EVENTS,
            filter: Filter {
                and: vec![
                    equals("domain", [self.domain.clone()]),
                    equals(MESSAGE_ID_ATTRIBUTE, ids.iter().map(|id| (*id).to_owned())),
                ],
            },
            include_totals: false,
            pagination: Pagination {
                sort: "timestamp:asc",
                limit: PAGE_LIMIT,
                token: None,
            },
        };
        for _ in 0..MAX_PAGES {
            let page: LogsResponse = reader
                .page(reader.client.post(&self.url).json(&body), "logs")
                .await?;
            for item in &page.items {
                each(item);
            }
            match page.pagination.next.filter(|t| !t.is_empty()) {
                // A page without items or a token that does not move ends the question.
                Some(next)
                    if !page.items.is_empty() && body.pagination.token.as_ref() != Some(&next) =>
                {
                    body.pagination.token = Some(next);
                }
                _ => return Ok(()),
            }
        }
        Err(retryable(format!(
            "more than {MAX_PAGES} pages of logs for one question"
        )))
    }
}

#[async_trait]
impl EventSource for Logs {
    fn batch_size(&self) -> usize {
        LOGS_BATCH
    }

    async fn lookup(&self, reader: &Reader, message_id: &MessageId) -> Result<Lookup, MailError> {
        let since = SystemTime::now()
            .checked_sub(LOOKUP_WINDOW)
            .unwrap_or(SystemTime::UNIX_EPOCH);
        let wanted = message_id.without_brackets();
        let mut found = None;
        self.events(reader, &[wanted], since, |item| {
            if found.is_none() && item.event != "rejected" && item.message_id() == Some(wanted) {
                found = Some(crate::text::clean(&item.event, 64));
            }
        })
        .await?;
        Ok(found.map_or(Lookup::NotFound, |event| Lookup::Accepted { event }))
    }

    /// What became of each of `mails` (at most [`LOGS_BATCH`]), with one question.
    async fn deliveries(
        &self,
        reader: &Reader,
        mails: &[OpenMail],
    ) -> Result<Vec<Delivery>, MailError> {
        let Some(since) = mails.iter().map(|m| m.sent_at).min() else {
            return Ok(Vec::new());
        };
        let ids: Vec<&str> = mails
            .iter()
            .map(|m| m.message_id.without_brackets())
            .collect();
        let mut folds: HashMap<&str, Fold> = ids.iter().map(|id| (*id, Fold::default())).collect();
        self.events(reader, &ids, since, |item| {
            // Another mail's events (or a server that ignored the filter) answer nothing here.
            if let Some(fold) = item.message_id().and_then(|id| folds.get_mut(id)) {
                fold.add(item);
            }
        })
        .await?;
        Ok(ids
            .iter()
            .map(|id| folds.remove(id).unwrap_or_default().finish())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_rfc_2822() {
        let at = SystemTime::UNIX_EPOCH + Duration::from_secs(1_720_396_800);
        assert_eq!(rfc2822(at), "Mon, 08 Jul 2024 00:00:00 -0000");
    }

    #[test]
    fn the_request_has_the_documented_shape() {
        let body = LogsRequest {
            start: "Mon, 08 Jul 2024 00:00:00 -0000".into(),
            end: "Fri, 12 Jul 2024 00:00:00 -0000".into(),
            events: EVENTS,
            filter: Filter {
                and: vec![
                    equals("domain", ["mg.example.com".to_owned()]),
                    equals(MESSAGE_ID_ATTRIBUTE, ["a@x".to_owned(), "b@x".to_owned()]),
                ],
            },
            include_totals: false,
            pagination: Pagination {
                sort: "timestamp:asc",
                limit: PAGE_LIMIT,
                token: Some("t1".into()),
            },
        };
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            serde_json::json!({
                "start": "Mon, 08 Jul 2024 00:00:00 -0000",
                "end": "Fri, 12 Jul 2024 00:00:00 -0000",
                "events": ["accepted", "rejected", "delivered", "failed"],
                "filter": {"AND": [
                    {"attribute": "domain", "comparator": "=",
                     "values": [{"label": "mg.example.com", "value": "mg.example.com"}]},
                    {"attribute": "message-id", "comparator": "=",
                     "values": [{"label": "a@x", "value": "a@x"}, {"label": "b@x", "value": "b@x"}]},
                ]},
                "include_totals": false,
                "pagination": {"sort": "timestamp:asc", "limit": 100, "token": "t1"},
            })
        );
    }

    #[test]
    fn the_documented_reply_is_read() {
        // The OpenAPI description's example item, with a Message-Id.
        let reply: LogsResponse = serde_json::from_value(serde_json::json!({
            "start": "Mon, 08 Jul 2024 00:00:00 -0000",
            "end": "Fri, 12 Jul 2024 00:00:00 -0000",
            "items": [{
                "id": "JDhSWf9mT5OFxCkZfpDU5d",
                "event": "failed",
                "@timestamp": "2024-07-08T16:30:18.530Z",
                "severity": "permanent",
                "reason": "bounce",
                "delivery-status": {"message": "no such user", "attempt-no": 5, "code": 550},
                "domain": {"name": "example.com"},
                "recipient": "example@gmail.com",
                "message": {"headers": {"message-id": "a@x", "to": "example@gmail.com"}}
            }],
            "pagination": {"previous": "p", "next": "n", "first": "f", "last": "l", "total": 1000},
            "aggregates": {}
        }))
        .unwrap();
        assert_eq!(reply.pagination.next.as_deref(), Some("n"));
        let item = &reply.items[0];
        assert_eq!(item.message_id(), Some("a@x"));
        let mut fold = Fold::default();
        fold.add(item);
        assert_eq!(
            fold.finish(),
            Delivery::Failed {
                reason: "example@gmail.com: bounce: 550 no such user".into()
            }
        );
    }
}
