//! The Mailgun HTTP API backend: `POST /v3/{domain}/messages` and `GET /v3/{domain}/events`.
//!
//! Long because it speaks three parts of the API (sending, the crash-recovery lookup, delivery
//! events with paging) with one client and one error mapping; a fifth is tests.

use std::{
    fmt,
    time::{Duration, SystemTime},
};

use async_trait::async_trait;
use reqwest::{StatusCode, header::HeaderMap, multipart::Form, redirect};
use serde::Deserialize;

use crate::{
    Lookup, MailError, Mailer, Message, MessageId, SendReceipt,
    config::{ConfigError, MailgunConfig},
    secret::{ExposeSecret, Secret},
};

const BACKEND: &str = "mailgun";
/// How much of an error body ends up in an error message.
const MAX_ERROR_TEXT: usize = 300;

/// Sends through Mailgun's HTTP API with one pooled, keep-alive HTTP client.
///
/// Build it once (it reads the API key when built) and share it: clones of the inner client
/// share the connection pool.
///
/// # Error classification
/// | reply | [`ErrorKind`](crate::ErrorKind) |
/// |---|---|
/// | connect failure (refused, DNS, TLS handshake, connect timeout) | `Retryable` |
/// | 404, 408 (Mailgun: "may be transient") | `Retryable` |
/// | 429 | `Retryable`, with `Retry-After` (seconds or HTTP date) |
/// | other 4xx (400, 401, 402, 403, 413, ...), 3xx | `Permanent` |
/// | 5xx, timeout after connecting, connection lost | `UnknownOutcome` |
///
/// Lookups change nothing, so every non-permanent lookup failure is `Retryable`.
pub struct MailgunMailer {
    client: reqwest::Client,
    messages_url: String,
    events_url: String,
    api_key: Secret,
    test_mode: bool,
}

impl fmt::Debug for MailgunMailer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MailgunMailer")
            .field("messages_url", &self.messages_url)
            .field("api_key", &self.api_key)
            .field("test_mode", &self.test_mode)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct SendResponse {
    id: Option<String>,
    message: Option<String>,
}

/// At most this many pages are read per delivery query (300 events each): a message has a
/// handful of events per recipient, so more means a server that pages forever.
const MAX_EVENT_PAGES: usize = 20;
/// Events are asked for from this long before the recorded send time (clocks differ).
const EVENTS_CLOCK_SLACK: Duration = Duration::from_secs(600);
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

#[derive(Deserialize)]
struct EventItem {
    event: String,
    #[serde(default)]
    recipient: Option<String>,
    #[serde(default)]
    severity: Option<String>,
    #[serde(default)]
    reason: Option<String>,
    #[serde(default, rename = "delivery-status")]
    delivery_status: Option<DeliveryStatusField>,
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

/// Folds events (oldest first) into one answer: delivered as soon as one recipient has the
/// message (a human can act on it); failed when every recipient seen failed for good; pending
/// otherwise, with the latest temporary failure.
fn fold_events(items: &[EventItem]) -> crate::Delivery {
    let mut recipients: Vec<(String, RecipientState)> = Vec::new();
    let mut latest_temporary = None;
    for item in items {
        let who = item.recipient.clone().unwrap_or_default();
        let next = match (item.event.as_str(), item.severity.as_deref()) {
            ("delivered", _) => RecipientState::Delivered,
            ("failed", Some("temporary")) => {
                let text = item.failure_text();
                latest_temporary = Some(text.clone());
                RecipientState::Pending(Some(text))
            }
            ("failed" | "rejected", _) => RecipientState::Failed(item.failure_text()),
            _ => RecipientState::Pending(None),
        };
        match recipients.iter_mut().find(|(r, _)| *r == who) {
            // A final state stays: later `accepted`/`opened`... events change nothing.
            Some((_, state)) => {
                if matches!(state, RecipientState::Pending(_)) {
                    *state = next;
                }
            }
            None => recipients.push((who, next)),
        }
    }
    if recipients
        .iter()
        .any(|(_, s)| *s == RecipientState::Delivered)
    {
        return crate::Delivery::Delivered;
    }
    let failures: Vec<&str> = recipients
        .iter()
        .filter_map(|(_, s)| match s {
            RecipientState::Failed(reason) => Some(reason.as_str()),
            _ => None,
        })
        .collect();
    if !failures.is_empty() && failures.len() == recipients.len() {
        return crate::Delivery::Failed {
            reason: error_text(failures.join("; ").as_bytes()),
        };
    }
    crate::Delivery::Pending {
        temporary_failure: latest_temporary,
    }
}

fn client_error(source: impl Into<crate::BoxError>) -> ConfigError {
    ConfigError::Client {
        backend: BACKEND,
        source: source.into(),
    }
}

impl MailgunMailer {
    /// Validates `config`, reads the API key and builds the HTTP client.
    ///
    /// # Errors
    /// [`ConfigError`] naming the bad field, an unreadable key, or a client set-up failure.
    pub fn new(config: &MailgunConfig) -> Result<Self, ConfigError> {
        config.validate()?;
        let api_key = config
            .api_key
            .read()
            .map_err(|source| ConfigError::Secret {
                field: "mailgun.apiKey".into(),
                source,
            })?;
        let tls = crate::tls::platform_client_config().map_err(client_error)?;
        let client = reqwest::Client::builder()
            .tls_backend_preconfigured(tls)
            .connect_timeout(config.connect_timeout()?)
            .timeout(config.request_timeout()?)
            .tcp_nodelay(true)
            .pool_idle_timeout(Duration::from_secs(60))
            // A redirected POST would silently become a GET: a redirect is a configuration error.
            .redirect(redirect::Policy::none())
            .user_agent(concat!("capm-mailer/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(client_error)?;
        let base = format!("{}/v3/{}", config.effective_base_url(), config.domain);
        Ok(Self {
            client,
            messages_url: format!("{base}/messages"),
            events_url: format!("{base}/events"),
            api_key,
            test_mode: config.test_mode,
        })
    }

    fn form(&self, message: &Message) -> Form {
        let mut form = Form::new().text("from", message.from().to_string());
        for to in message.to() {
            form = form.text("to", to.to_string());
        }
        form = form
            .text("subject", message.subject().to_owned())
            .text("text", message.text().to_owned())
            .text("h:Message-Id", message.message_id().to_string());
        for tag in message.tags() {
            form = form.text("o:tag", tag.clone());
        }
        for (name, value) in message.variables() {
            form = form.text(format!("v:{name}"), value.clone());
        }
        if self.test_mode {
            form = form.text("o:testmode", "yes");
        }
        form
    }
}

/// Parses `Retry-After`: delay-seconds or an HTTP date.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = headers
        .get(reqwest::header::RETRY_AFTER)?
        .to_str()
        .ok()?
        .trim();
    if let Ok(secs) = value.parse::<u64>() {
        return Some(Duration::from_secs(secs));
    }
    let when = httpdate::parse_http_date(value).ok()?;
    Some(
        when.duration_since(SystemTime::now())
            .unwrap_or(Duration::ZERO),
    )
}

/// The `message` of a Mailgun JSON error, or the start of the body.
fn error_text(body: &[u8]) -> String {
    #[derive(Deserialize)]
    struct ErrorBody {
        message: String,
    }
    let text = match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) => e.message,
        Err(_) => String::from_utf8_lossy(body).trim().to_owned(),
    };
    let mut text: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .take(MAX_ERROR_TEXT)
        .collect();
    if text.is_empty() {
        text = "(empty reply)".into();
    }
    text
}

fn status_error(status: StatusCode, headers: &HeaderMap, body: &[u8], lookup: bool) -> MailError {
    let code = Some(status.as_u16());
    let message = format!(
        "{} {}",
        status.canonical_reason().unwrap_or("HTTP"),
        error_text(body)
    );
    let retryable = |retry_after| MailError::Retryable {
        backend: BACKEND,
        code,
        retry_after,
        message: message.clone(),
        source: None,
    };
    match status.as_u16() {
        429 => retryable(retry_after(headers)),
        404 | 408 => retryable(None),
        500..=599 if lookup => retryable(retry_after(headers)),
        500..=599 => MailError::UnknownOutcome {
            backend: BACKEND,
            code,
            message,
            source: None,
        },
        _ => MailError::Permanent {
            backend: BACKEND,
            code,
            message,
        },
    }
}

fn transport_error(err: reqwest::Error, lookup: bool) -> MailError {
    // `err` holds the URL (no credentials: the key travels in a header), never the key.
    let message = if err.is_connect() {
        "could not connect".to_owned()
    } else if err.is_timeout() {
        "timed out waiting for the reply".to_owned()
    } else {
        "request failed".to_owned()
    };
    if err.is_builder() {
        MailError::Permanent {
            backend: BACKEND,
            code: None,
            message: format!("building the request: {err}"),
        }
    } else if err.is_connect() || lookup {
        MailError::Retryable {
            backend: BACKEND,
            code: None,
            retry_after: None,
            message,
            source: Some(Box::new(err)),
        }
    } else {
        MailError::UnknownOutcome {
            backend: BACKEND,
            code: None,
            message,
            source: Some(Box::new(err)),
        }
    }
}

/// Encodes a query value (`application/x-www-form-urlencoded`, as servers decode query strings).
fn encode_query_value(value: &str) -> String {
    form_urlencoded::byte_serialize(value.as_bytes()).collect()
}

#[async_trait]
impl Mailer for MailgunMailer {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn tracks_delivery(&self) -> bool {
        true
    }

    async fn send(&self, message: &Message) -> Result<SendReceipt, MailError> {
        let response = self
            .client
            .post(&self.messages_url)
            .basic_auth("api", Some(self.api_key.expose_secret()))
            .multipart(self.form(message))
            .send()
            .await
            .map_err(|e| transport_error(e, false))?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response
            .bytes()
            .await
            .map_err(|e| transport_error(e, false))?;
        if !status.is_success() {
            return Err(status_error(status, &headers, &body, false));
        }
        // A 2xx means Mailgun queued the message, whatever the body looks like.
        let parsed = serde_json::from_slice::<SendResponse>(&body).ok();
        let (id, text) = parsed.map(|r| (r.id, r.message)).unwrap_or_default();
        Ok(SendReceipt {
            message_id: id.unwrap_or_else(|| message.message_id().to_string()),
            response: text.unwrap_or_else(|| error_text(&body)),
        })
    }

    async fn lookup(&self, message_id: &MessageId) -> Result<Lookup, MailError> {
        let url = format!(
            "{}?message-id={}",
            self.events_url,
            encode_query_value(message_id.without_brackets())
        );
        let events = self.events_page(&url).await?;
        // Any event but `rejected` means Mailgun accepted the message at some point.
        Ok(events
            .items
            .into_iter()
            .find(|item| item.event != "rejected")
            .map_or(Lookup::NotFound, |item| Lookup::Accepted {
                event: item.event,
            }))
    }

    async fn delivery_status(
        &self,
        message_id: &MessageId,
        sent_at: SystemTime,
    ) -> Result<crate::Delivery, MailError> {
        let begin = sent_at
            .checked_sub(EVENTS_CLOCK_SLACK)
            .unwrap_or(sent_at)
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let mut url = format!(
            "{}?message-id={}&begin={begin}&ascending=yes&limit={EVENTS_PAGE_LIMIT}",
            self.events_url,
            encode_query_value(message_id.without_brackets())
        );
        let mut items = Vec::new();
        for _ in 0..MAX_EVENT_PAGES {
            let page = self.events_page(&url).await?;
            // The last page is the first empty one.
            if page.items.is_empty() {
                return Ok(fold_events(&items));
            }
            items.extend(page.items);
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
                None => return Ok(fold_events(&items)),
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
}

impl MailgunMailer {
    /// True for the events URL itself and its paging URLs (`<events>/<token>`, `<events>?...`).
    fn is_events_url(&self, url: &str) -> bool {
        url.strip_prefix(&self.events_url)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(['/', '?']))
    }

    /// One page of `GET /v3/{domain}/events`.
    async fn events_page(&self, url: &str) -> Result<EventsResponse, MailError> {
        let response = self
            .client
            .get(url)
            .basic_auth("api", Some(self.api_key.expose_secret()))
            .send()
            .await
            .map_err(|e| transport_error(e, true))?;
        let status = response.status();
        let headers = response.headers().clone();
        let body = response
            .bytes()
            .await
            .map_err(|e| transport_error(e, true))?;
        if !status.is_success() {
            return Err(status_error(status, &headers, &body, true));
        }
        serde_json::from_slice(&body).map_err(|e| MailError::Retryable {
            backend: BACKEND,
            code: Some(status.as_u16()),
            retry_after: None,
            message: "unreadable events reply".into(),
            source: Some(Box::new(e)),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::{HeaderValue, RETRY_AFTER};

    fn headers(retry: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(r) = retry {
            h.insert(RETRY_AFTER, HeaderValue::from_str(r).unwrap());
        }
        h
    }

    #[test]
    fn statuses_are_classified() {
        use crate::ErrorKind::*;
        let body = br#"{"message": "Invalid private key"}"#;
        let cases = [
            (400, Permanent),
            (401, Permanent),
            (402, Permanent),
            (403, Permanent),
            (413, Permanent),
            (302, Permanent),
            (404, Retryable),
            (429, Retryable),
            (500, UnknownOutcome),
            (502, UnknownOutcome),
            (503, UnknownOutcome),
        ];
        for (code, kind) in cases {
            let status = StatusCode::from_u16(code).unwrap();
            let err = status_error(status, &headers(None), body, false);
            assert_eq!(err.kind(), kind, "{code}");
            assert_eq!(err.code(), Some(code));
            let lookup_err = status_error(status, &headers(None), body, true);
            if code >= 500 {
                assert_eq!(lookup_err.kind(), Retryable, "lookup {code}");
            }
        }
        let err = status_error(StatusCode::UNAUTHORIZED, &headers(None), body, false);
        assert!(err.to_string().contains("Invalid private key"), "{err}");
    }

    #[test]
    fn retry_after_seconds_and_dates() {
        let h = headers(Some("7"));
        assert_eq!(retry_after(&h), Some(Duration::from_secs(7)));
        let later = SystemTime::now() + Duration::from_secs(120);
        let h = headers(Some(&httpdate::fmt_http_date(later)));
        let d = retry_after(&h).unwrap();
        assert!(
            d > Duration::from_secs(100) && d <= Duration::from_secs(120),
            "{d:?}"
        );
        assert_eq!(retry_after(&headers(Some("soon"))), None);
        assert_eq!(retry_after(&headers(None)), None);
    }

    #[test]
    fn error_text_is_bounded_and_single_line() {
        assert_eq!(error_text(b"line1\nline2"), "line1 line2");
        assert_eq!(error_text(b""), "(empty reply)");
        assert_eq!(error_text(&[b'x'; 1000]).len(), MAX_ERROR_TEXT);
    }

    #[test]
    fn paging_is_followed_only_within_the_events_url() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, "key-x").unwrap();
        let mut config = MailgunConfig::new("mg.example.com", crate::SecretSource::File(key));
        config.base_url = Some("https://api.mailgun.net".into());
        let mailer = MailgunMailer::new(&config).unwrap();
        let events = "https://api.mailgun.net/v3/mg.example.com/events";
        assert!(mailer.is_events_url(&format!("{events}/W3siYSI6ZmFsc2V9XQ")));
        assert!(mailer.is_events_url(&format!("{events}?page=next")));
        for other in [
            "https://api.mailgun.net.evil.example/v3/mg.example.com/events/x",
            "https://api.mailgun.net/v3/mg.example.com/eventsX",
            "https://evil.example/v3/mg.example.com/events/x",
            "http://api.mailgun.net/v3/mg.example.com/events/x",
        ] {
            assert!(!mailer.is_events_url(other), "{other}");
        }
    }

    fn item(event: &str, recipient: &str, severity: Option<&str>) -> EventItem {
        EventItem {
            event: event.into(),
            recipient: Some(recipient.into()),
            severity: severity.map(Into::into),
            reason: Some("bounce".into()),
            delivery_status: None,
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
    }

    #[test]
    fn query_values_are_encoded() {
        assert_eq!(encode_query_value("a+b=c&d@x.y z"), "a%2Bb%3Dc%26d%40x.y+z");
    }
}
