//! Mailgun's events API, `GET /v3/{domain}/events`: the crash-recovery lookup and delivery
//! status, one Message-Id per question (`eventsApi: events`, for accounts or proxies without
//! the Logs API).

use std::time::SystemTime;

use async_trait::async_trait;
use serde::Deserialize;

use super::{BACKEND, EVENTS_CLOCK_SLACK, EventSource, Reader, outcome::EventItem, outcome::Fold};
use crate::{Delivery, Lookup, MailError, MessageId, OpenMail};

/// At most this many pages are read per delivery query (300 events each): a message has a
/// handful of events per recipient, so more means a server that pages forever.
const MAX_EVENT_PAGES: usize = 20;
/// The largest page Mailgun serves.
const EVENTS_PAGE_LIMIT: u32 = 300;

#[derive(Deserialize)]
struct EventsResponse {
    #[serde(default)]
    items: Vec<EventItem>,
    #[serde(default)]
    paging: Paging,
}

#[derive(Deserialize, Default)]
struct Paging {
    next: Option<String>,
}

/// The events API of one sending domain.
#[derive(Debug)]
pub(super) struct Events {
    /// `<base>/v3/<domain>/events`: the only address the key is sent to.
    url: String,
}

impl Events {
    pub(super) fn new(base_url: &str, domain: &str) -> Self {
        Self {
            url: format!("{base_url}/v3/{domain}/events"),
        }
    }

    /// What the events API says became of one mail.
    async fn delivery(
        &self,
        reader: &Reader,
        message_id: &MessageId,
        sent_at: SystemTime,
    ) -> Result<Delivery, MailError> {
        let begin = sent_at
            .checked_sub(EVENTS_CLOCK_SLACK)
            .unwrap_or(sent_at)
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let mut url = format!(
            "{}?message-id={}&begin={begin}&ascending=yes&limit={EVENTS_PAGE_LIMIT}",
            self.url,
            encode_query_value(message_id.without_brackets())
        );
        let mut fold = Fold::default();
        for _ in 0..MAX_EVENT_PAGES {
            let page = self.page(reader, &url).await?;
            // The last page is the first empty one.
            if page.items.is_empty() {
                return Ok(fold.finish());
            }
            for item in &page.items {
                fold.add(item);
            }
            match page.paging.next {
                Some(next) if self.is_events_url(&next) => url = next,
                Some(_) => {
                    // The API key goes with every request: never to another address.
                    return Err(MailError::Retryable {
                        backend: BACKEND,
                        code: None,
                        retry_after: None,
                        message: "the events reply pages to another address; not followed".into(),
                        source: None,
                    });
                }
                None => return Ok(fold.finish()),
            }
        }
        Err(MailError::Retryable {
            backend: BACKEND,
            code: None,
            retry_after: None,
            message: format!("more than {MAX_EVENT_PAGES} pages of events for one message"),
            source: None,
        })
    }

    /// True for the events URL itself and its paging URLs (`<events>/<token>`, `<events>?...`).
    fn is_events_url(&self, url: &str) -> bool {
        url.strip_prefix(&self.url)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(['/', '?']))
    }

    /// One page of `GET /v3/{domain}/events`.
    async fn page(&self, reader: &Reader, url: &str) -> Result<EventsResponse, MailError> {
        reader.page(reader.client.get(url), "events").await
    }
}

#[async_trait]
impl EventSource for Events {
    fn batch_size(&self) -> usize {
        1
    }

    async fn lookup(&self, reader: &Reader, message_id: &MessageId) -> Result<Lookup, MailError> {
        let url = format!(
            "{}?message-id={}",
            self.url,
            encode_query_value(message_id.without_brackets())
        );
        let events = self.page(reader, &url).await?;
        // Any event but `rejected` means Mailgun accepted the message at some point.
        Ok(events
            .items
            .into_iter()
            .find(|item| item.event != "rejected")
            .map_or(Lookup::NotFound, |item| Lookup::Accepted {
                event: crate::text::clean(&item.event, 64),
            }))
    }

    async fn deliveries(
        &self,
        reader: &Reader,
        mails: &[OpenMail],
    ) -> Result<Vec<Delivery>, MailError> {
        let mut answers = Vec::with_capacity(mails.len());
        for mail in mails {
            answers.push(
                self.delivery(reader, &mail.message_id, mail.sent_at)
                    .await?,
            );
        }
        Ok(answers)
    }
}

/// Encodes a query value (`application/x-www-form-urlencoded`, as servers decode query strings).
fn encode_query_value(value: &str) -> String {
    url::form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paging_is_followed_only_within_the_events_url() {
        let api = Events::new("https://api.mailgun.net", "mg.example.com");
        let events = "https://api.mailgun.net/v3/mg.example.com/events";
        assert!(api.is_events_url(&format!("{events}/W3siYSI6ZmFsc2V9XQ")));
        assert!(api.is_events_url(&format!("{events}?page=next")));
        for other in [
            "https://api.mailgun.net.evil.example/v3/mg.example.com/events/x",
            "https://api.mailgun.net/v3/mg.example.com/eventsX",
            "https://evil.example/v3/mg.example.com/events/x",
            "http://api.mailgun.net/v3/mg.example.com/events/x",
        ] {
            assert!(!api.is_events_url(other), "{other}");
        }
    }

    #[test]
    fn query_values_are_encoded() {
        assert_eq!(encode_query_value("a+b=c&d@x.y z"), "a%2Bb%3Dc%26d%40x.y+z");
    }
}
