//! The Mailgun HTTP API backend: `POST /v3/{domain}/messages`, and for lookups and delivery
//! either `POST /v1/analytics/logs` (the default, [`logs`]) or `GET /v3/{domain}/events`.
//!
//! Long because it speaks three parts of the API (sending, the crash-recovery lookup, delivery
//! events with paging) with one client and one error mapping; a fifth is tests.

mod logs;

pub use logs::LOGS_BATCH;

use std::{
    fmt,
    hash::{BuildHasher, Hasher},
    pin::Pin,
    task::{Context, Poll},
    time::{Duration, SystemTime},
};

use async_trait::async_trait;
use bytes::Bytes;
use reqwest::{StatusCode, header::HeaderMap, redirect};
use serde::Deserialize;

use crate::{
    Lookup, MailError, Mailer, Message, MessageId, OpenMail, SendReceipt,
    config::{ConfigError, MailgunConfig, MailgunEventsApi},
    gate::{self, Gate},
    secret::{ExposeSecret, Secret},
};

const BACKEND: &str = "mailgun";
/// How much of an error body ends up in an error message.
const MAX_ERROR_TEXT: usize = 300;

/// The most of a send's reply that is read. Mailgun answers `{"id": ..., "message": ...}`, a few
/// hundred bytes; past this the reply is not Mailgun's, and a 2xx is an accepted send anyway.
pub const MAX_SEND_REPLY_BYTES: usize = 64 * 1024;
/// The most of an error reply that is read: its `message` is all we show (300 characters).
pub const MAX_ERROR_REPLY_BYTES: usize = 4 * 1024;
/// The most of one events page that is read: 300 events of a few KiB each fit four times over.
pub const MAX_EVENTS_PAGE_BYTES: usize = 4 * 1024 * 1024;
/// Recipients tracked per delivery question (a message has a handful).
const MAX_TRACKED_RECIPIENTS: usize = 1000;

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
    logs_url: String,
    domain: String,
    events_api: MailgunEventsApi,
    api_key: Secret,
    /// The key reads (lookups, delivery questions) use, when not `api_key`.
    read_key: Option<Secret>,
    /// Set, with the reason shown to humans, once Mailgun refused the reading key (401/403):
    /// from then on nothing is read, lookups answer [`Lookup::Unsupported`] and delivery is
    /// not tracked. Keys are read once, so this lasts as long as the mailer.
    read_denied: std::sync::OnceLock<String>,
    test_mode: bool,
    gate: Gate,
}

impl fmt::Debug for MailgunMailer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MailgunMailer")
            .field("messages_url", &self.messages_url)
            .field("events_api", &self.events_api)
            .field("api_key", &self.api_key)
            .field("read_key", &self.read_key)
            .field("read_denied", &self.read_denied.get().is_some())
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

/// One event, as both APIs give it (the Logs API's items carry the same fields by the same
/// names, plus `@timestamp`).
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
    fn message_id(&self) -> Option<&str> {
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
struct Fold {
    recipients: Vec<(String, RecipientState)>,
    latest_temporary: Option<String>,
}

impl Fold {
    fn add(&mut self, item: &EventItem) {
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

    fn finish(self) -> crate::Delivery {
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
fn fold_events(items: &[EventItem]) -> crate::Delivery {
    let mut fold = Fold::default();
    for item in items {
        fold.add(item);
    }
    fold.finish()
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
        let read_key = config
            .read_api_key
            .as_ref()
            .map(|source| {
                source.read().map_err(|source| ConfigError::Secret {
                    field: "mailgun.readApiKey".into(),
                    source,
                })
            })
            .transpose()?;
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
            logs_url: format!("{}/v1/analytics/logs", config.effective_base_url()),
            domain: config.domain.clone(),
            events_api: config.events_api,
            api_key,
            read_key,
            read_denied: std::sync::OnceLock::new(),
            test_mode: config.test_mode,
            gate: gate::open(),
        })
    }

    /// The same mailer, asking `gate` right before each send's commit point (the request
    /// body's final chunk).
    #[must_use]
    pub fn with_commit_gate(mut self, gate: std::sync::Arc<dyn crate::CommitGate>) -> Self {
        self.gate = gate;
        self
    }

    /// The message's form fields, in Mailgun's names.
    fn fields(&self, message: &Message) -> Vec<(String, String)> {
        let mut fields = vec![("from".to_owned(), message.from().to_string())];
        for to in message.to() {
            fields.push(("to".into(), to.to_string()));
        }
        fields.push(("subject".into(), message.subject().to_owned()));
        fields.push(("text".into(), message.text().to_owned()));
        fields.push(("h:Message-Id".into(), message.message_id().to_string()));
        if let Some(reply_to) = message.reply_to() {
            fields.push(("h:Reply-To".into(), reply_to.to_string()));
        }
        for tag in message.tags() {
            fields.push(("o:tag".into(), tag.clone()));
        }
        for (name, value) in message.variables() {
            fields.push((format!("v:{name}"), value.clone()));
        }
        if self.test_mode {
            fields.push(("o:testmode".into(), "yes".into()));
        }
        fields
    }
}

/// A `multipart/form-data` body (RFC 7578) of text fields: its boundary, everything before the
/// closing delimiter, and the closing delimiter (the request's commit point).
struct Multipart {
    boundary: String,
    head: Bytes,
    tail: Bytes,
}

impl Multipart {
    fn new(fields: &[(String, String)]) -> Self {
        let random = std::hash::RandomState::new();
        let mut salt = 0u64;
        let boundary = loop {
            let mut h = random.build_hasher();
            h.write_u64(salt);
            let candidate = format!("capm-{:016x}{:08x}", h.finish(), salt);
            // A boundary must not occur in any value (names are ours and ASCII).
            if !fields.iter().any(|(_, v)| v.contains(&candidate)) {
                break candidate;
            }
            salt += 1;
        };
        let mut head = Vec::new();
        for (name, value) in fields {
            // Field names are Mailgun's and validated variable names: no quote, CR or LF.
            head.extend_from_slice(
                format!("--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n")
                    .as_bytes(),
            );
            head.extend_from_slice(value.as_bytes());
            head.extend_from_slice(b"\r\n");
        }
        let tail = format!("--{boundary}--\r\n");
        Self {
            boundary,
            head: head.into(),
            tail: tail.into_bytes().into(),
        }
    }

    fn len(&self) -> u64 {
        (self.head.len() + self.tail.len()) as u64
    }
}

/// A request body that releases its final chunk only if the [`CommitGate`](crate::CommitGate)
/// says so; otherwise it fails, and the HTTP client drops the connection with the request
/// incomplete (its `Content-Length` is never reached).
struct GatedBody {
    head: Option<Bytes>,
    tail: Option<Bytes>,
    /// Whether the head has had its chance to be written out.
    flushed: bool,
    gate: Gate,
    abandoned: std::sync::Arc<std::sync::OnceLock<String>>,
    len: u64,
}

impl http_body::Body for GatedBody {
    type Data = Bytes;
    type Error = std::io::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>> {
        if let Some(head) = self.head.take() {
            return Poll::Ready(Some(Ok(http_body::Frame::data(head))));
        }
        if !self.flushed {
            // Pending once, so the HTTP client writes out everything before the final chunk
            // (hyper flushes while its body is pending): the gate is then asked with only the
            // final chunk left to write.
            self.flushed = true;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let Some(tail) = self.tail.take() else {
            return Poll::Ready(None);
        };
        match self.gate.may_commit() {
            Ok(()) => Poll::Ready(Some(Ok(http_body::Frame::data(tail)))),
            Err(reason) => {
                let _ = self.abandoned.set(reason);
                Poll::Ready(Some(Err(std::io::Error::other(
                    "the commit gate refused the final chunk",
                ))))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.tail.is_none()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.len)
    }
}

/// Reads at most `limit` bytes of `response`'s body, chunk by chunk (never more than one chunk
/// past what is kept). `true` when the whole body fit.
async fn read_at_most(
    response: &mut reqwest::Response,
    limit: usize,
) -> Result<(Vec<u8>, bool), reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        let room = limit - body.len();
        if chunk.len() > room {
            body.extend_from_slice(&chunk[..room]);
            return Ok((body, false));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((body, true))
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
    let mut text = crate::text::clean(&text, MAX_ERROR_TEXT);
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

    fn tracking(&self) -> crate::Tracking {
        match self.read_denied.get() {
            None => crate::Tracking::Tracked,
            Some(why) => crate::Tracking::Untracked(Some(why.clone())),
        }
    }

    async fn send(&self, message: &Message) -> Result<SendReceipt, MailError> {
        let form = Multipart::new(&self.fields(message));
        let abandoned = std::sync::Arc::new(std::sync::OnceLock::new());
        let body = GatedBody {
            len: form.len(),
            head: Some(form.head),
            tail: Some(form.tail),
            flushed: false,
            gate: self.gate.clone(),
            abandoned: abandoned.clone(),
        };
        let sent = self
            .client
            .post(&self.messages_url)
            .basic_auth("api", Some(self.api_key.expose_secret()))
            .header(
                reqwest::header::CONTENT_TYPE,
                format!("multipart/form-data; boundary={}", form.boundary),
            )
            .header(reqwest::header::CONTENT_LENGTH, body.len)
            .body(reqwest::Body::wrap(body))
            .send()
            .await;
        if let Some(reason) = abandoned.get() {
            return Err(MailError::Abandoned {
                backend: BACKEND,
                reason: reason.clone(),
            });
        }
        let mut response = sent.map_err(|e| transport_error(e, false))?;
        let status = response.status();
        if !status.is_success() {
            let headers = response.headers().clone();
            // The message is all that is shown: an unreadable or cut body still has its status.
            let body = read_at_most(&mut response, MAX_ERROR_REPLY_BYTES)
                .await
                .map(|(body, _)| body)
                .unwrap_or_default();
            return Err(status_error(status, &headers, &body, false));
        }
        // A 2xx means Mailgun queued the message, whatever the body looks like (oversized, cut,
        // unreadable): the receipt then names our own Message-Id.
        let (id, text) = match read_at_most(&mut response, MAX_SEND_REPLY_BYTES).await {
            Ok((body, true)) => match serde_json::from_slice::<SendResponse>(&body) {
                Ok(reply) => (reply.id, reply.message.map(|m| error_text(m.as_bytes()))),
                Err(_) => (None, Some(error_text(&body))),
            },
            Ok((_, false)) => (
                None,
                Some(format!(
                    "accepted; the reply exceeded {MAX_SEND_REPLY_BYTES} bytes and was not read"
                )),
            ),
            Err(_) => (None, Some("accepted; the reply was cut off".to_owned())),
        };
        Ok(SendReceipt {
            // Mailgun echoes our `h:Message-Id`; what it says is kept cleaned and bounded.
            message_id: id
                .map(|id| crate::text::clean(&id, crate::MAX_MESSAGE_ID_LEN))
                .filter(|id| !id.is_empty())
                .unwrap_or_else(|| message.message_id().to_string()),
            response: text.unwrap_or_else(|| "(empty reply)".into()),
        })
    }

    async fn lookup(&self, message_id: &MessageId) -> Result<Lookup, MailError> {
        if self.read_denied.get().is_some() {
            return Ok(Lookup::Unsupported);
        }
        let found = self.lookup_by_reading(message_id).await;
        match found {
            Err(e) if self.read_denied.get().is_some() && e.code().is_some_and(refused) => {
                Ok(Lookup::Unsupported)
            }
            other => other,
        }
    }

    async fn delivery_status(
        &self,
        message_id: &MessageId,
        sent_at: SystemTime,
    ) -> Result<crate::Delivery, MailError> {
        let mail = OpenMail {
            message_id: message_id.clone(),
            sent_at,
        };
        let mut answers = self.delivery_statuses(std::slice::from_ref(&mail)).await?;
        Ok(answers.pop().unwrap_or(crate::Delivery::Pending {
            temporary_failure: None,
        }))
    }

    fn delivery_batch_size(&self) -> usize {
        match self.events_api {
            MailgunEventsApi::Logs => LOGS_BATCH,
            MailgunEventsApi::Events => 1,
        }
    }

    async fn delivery_statuses(
        &self,
        mails: &[OpenMail],
    ) -> Result<Vec<crate::Delivery>, MailError> {
        let untracked = || Ok(vec![crate::Delivery::NotTrackable; mails.len()]);
        if self.read_denied.get().is_some() {
            return untracked();
        }
        let mut answers = Vec::with_capacity(mails.len());
        let asked = match self.events_api {
            MailgunEventsApi::Events => {
                let mut asked = Ok(());
                for mail in mails {
                    match self.events_delivery(&mail.message_id, mail.sent_at).await {
                        Ok(answer) => answers.push(answer),
                        Err(e) => {
                            asked = Err(e);
                            break;
                        }
                    }
                }
                asked
            }
            MailgunEventsApi::Logs => {
                let mut asked = Ok(());
                for batch in mails.chunks(LOGS_BATCH) {
                    match self.logs_deliveries(batch).await {
                        Ok(batch) => answers.extend(batch),
                        Err(e) => {
                            asked = Err(e);
                            break;
                        }
                    }
                }
                asked
            }
        };
        match asked {
            Ok(()) => Ok(answers),
            Err(e) if self.read_denied.get().is_some() && e.code().is_some_and(refused) => {
                untracked()
            }
            Err(e) => Err(e),
        }
    }
}

/// Mailgun's answers to a key that may not do what it asked.
fn refused(code: u16) -> bool {
    matches!(code, 401 | 403)
}

impl MailgunMailer {
    /// The lookup itself, by the configured API.
    async fn lookup_by_reading(&self, message_id: &MessageId) -> Result<Lookup, MailError> {
        if self.events_api == MailgunEventsApi::Logs {
            return self.logs_lookup(message_id).await;
        }
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
                event: crate::text::clean(&item.event, 64),
            }))
    }

    /// What the events API says became of one mail.
    async fn events_delivery(
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
        let mut fold = Fold::default();
        for _ in 0..MAX_EVENT_PAGES {
            let page = self.events_page(&url).await?;
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
        url.strip_prefix(&self.events_url)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with(['/', '?']))
    }

    /// Remembers that Mailgun refused the reading key, and says so once.
    fn deny_reads(&self, status: StatusCode) {
        let which = if self.read_key.is_some() {
            "the read key (mailgun.readApiKey, --mailgun-read-key-file)"
        } else {
            "the sending key, which is also the read key"
        };
        let why = format!(
            "Mailgun refused {which} on its logs API ({} {}): a domain sending key may only \
             send. Delivery is not tracked and a send whose outcome was unknown is resent with \
             the same Message-Id; give an account key with a read role (Analyst) as \
             mailgun.readApiKey to track deliveries",
            status.as_u16(),
            status.canonical_reason().unwrap_or("")
        );
        if self.read_denied.set(why.clone()).is_ok() {
            tracing::warn!(backend = BACKEND, reason = %why, "Reading Mailgun's logs is refused; delivery tracking is off");
        }
    }

    /// One page of `GET /v3/{domain}/events`.
    async fn events_page(&self, url: &str) -> Result<EventsResponse, MailError> {
        self.page(self.client.get(url), "events").await
    }

    /// Sends `request` with the API key and reads its JSON reply of at most
    /// [`MAX_EVENTS_PAGE_BYTES`], with the lookup's error classes (`what` names the API in
    /// errors).
    async fn page<T: serde::de::DeserializeOwned>(
        &self,
        request: reqwest::RequestBuilder,
        what: &str,
    ) -> Result<T, MailError> {
        let key = self.read_key.as_ref().unwrap_or(&self.api_key);
        let mut response = request
            .basic_auth("api", Some(key.expose_secret()))
            .send()
            .await
            .map_err(|e| transport_error(e, true))?;
        let status = response.status();
        if !status.is_success() {
            let headers = response.headers().clone();
            let body = read_at_most(&mut response, MAX_ERROR_REPLY_BYTES)
                .await
                .map(|(body, _)| body)
                .unwrap_or_default();
            if refused(status.as_u16()) {
                self.deny_reads(status);
            }
            return Err(status_error(status, &headers, &body, true));
        }
        let (body, complete) = read_at_most(&mut response, MAX_EVENTS_PAGE_BYTES)
            .await
            .map_err(|e| transport_error(e, true))?;
        let unreadable = |message: String, source: Option<crate::BoxError>| MailError::Retryable {
            backend: BACKEND,
            code: Some(status.as_u16()),
            retry_after: None,
            message,
            source,
        };
        if !complete {
            return Err(unreadable(
                format!("a page of {what} larger than {MAX_EVENTS_PAGE_BYTES} bytes; not read"),
                None,
            ));
        }
        serde_json::from_slice(&body)
            .map_err(|e| unreadable(format!("unreadable {what} reply"), Some(Box::new(e))))
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

    #[test]
    fn query_values_are_encoded() {
        assert_eq!(encode_query_value("a+b=c&d@x.y z"), "a%2Bb%3Dc%26d%40x.y+z");
    }
}
