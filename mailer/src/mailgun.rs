//! The Mailgun HTTP API backend: sends with `POST /v3/{domain}/messages`, and answers lookups
//! and delivery questions from the events API chosen once, when the mailer is built: the Logs
//! API (the default, [`logs`]) or the legacy events API ([`events`]). What the two APIs' events
//! say about a mail is folded the same way ([`outcome`]).

mod events;
mod logs;
mod outcome;

pub use logs::LOGS_BATCH;

use std::{
    fmt,
    hash::{BuildHasher, Hasher},
    pin::Pin,
    sync::{Arc, OnceLock},
    task::{Context, Poll},
    time::{Duration, SystemTime},
};

use async_trait::async_trait;
use bytes::Bytes;
use reqwest::{StatusCode, header::HeaderMap, redirect};
use serde::Deserialize;

use crate::{
    Delivery, Lookup, MailError, Mailer, Message, MessageId, OpenMail, SendReceipt,
    config::{ConfigError, MailgunConfig, MailgunEventsApi},
    gate::{self, Gate},
    secret::{ExposeSecret, LiveSecret},
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
/// Events are asked for from this long before the recorded send time (clocks differ).
const EVENTS_CLOCK_SLACK: Duration = Duration::from_secs(600);

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
    api_key: Arc<LiveSecret>,
    /// What reads (lookups, delivery questions) go out with.
    reader: Reader,
    /// The API reads ask (`eventsApi`).
    events: Box<dyn EventSource>,
    test_mode: bool,
    gate: Gate,
}

impl fmt::Debug for MailgunMailer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MailgunMailer")
            .field("messages_url", &self.messages_url)
            .field("events", &self.events)
            .field("api_key", &self.api_key)
            .field("read_key", &self.reader.key)
            .field("read_denied", &self.reader.denied.get().is_some())
            .field("test_mode", &self.test_mode)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct SendResponse {
    id: Option<String>,
    message: Option<String>,
}

/// One of Mailgun's event APIs, answering the lookup and the delivery questions: [`logs::Logs`]
/// or [`events::Events`], chosen by `eventsApi` when the mailer is built.
#[async_trait]
trait EventSource: fmt::Debug + Send + Sync {
    /// How many mails one [`Self::deliveries`] call asks about with one question.
    fn batch_size(&self) -> usize;

    /// Whether Mailgun accepted a message with this Message-Id.
    async fn lookup(&self, reader: &Reader, message_id: &MessageId) -> Result<Lookup, MailError>;

    /// What became of each of `mails` (at most [`Self::batch_size`]), in the same order.
    async fn deliveries(
        &self,
        reader: &Reader,
        mails: &[OpenMail],
    ) -> Result<Vec<Delivery>, MailError>;
}

/// What reads go out with: the shared HTTP client, the key they use, and whether Mailgun refused
/// that key.
struct Reader {
    client: reqwest::Client,
    /// `mailgun.readApiKey`, or the sending key when there is none.
    key: Arc<LiveSecret>,
    /// Which key `key` is, in words, for the refusal's explanation.
    refused_key: &'static str,
    /// Set, with the reason shown to humans, once Mailgun refused the reading key (401/403):
    /// from then on nothing is read, lookups answer [`Lookup::Unsupported`] and delivery is
    /// not tracked. Keys are read once, so this lasts as long as the mailer.
    denied: OnceLock<String>,
}

impl Reader {
    /// True when `error` is Mailgun refusing the reading key, now remembered: the question is
    /// then answered as if the backend could not tell.
    fn refused_for_good(&self, error: &MailError) -> bool {
        self.denied.get().is_some() && error.code().is_some_and(refused)
    }

    /// Remembers that Mailgun refused the reading key, and says so once.
    fn deny(&self, status: StatusCode) {
        let why = format!(
            "Mailgun refused {} on its logs API ({} {}): a domain sending key may only \
             send. Delivery is not tracked and a send whose outcome was unknown is resent with \
             the same Message-Id; give an account key with a read role (Analyst) as \
             mailgun.readApiKey to track deliveries",
            self.refused_key,
            status.as_u16(),
            status.canonical_reason().unwrap_or("")
        );
        if self.denied.set(why.clone()).is_ok() {
            tracing::warn!(backend = BACKEND, reason = %why, "Reading Mailgun's logs is refused; delivery tracking is off");
        }
    }

    /// Sends `request` with the reading key and reads its JSON reply of at most
    /// [`MAX_EVENTS_PAGE_BYTES`], with the lookup's error classes (`what` names the API in
    /// errors).
    async fn page<T: serde::de::DeserializeOwned>(
        &self,
        request: reqwest::RequestBuilder,
        what: &str,
    ) -> Result<T, MailError> {
        let mut response = request
            .basic_auth("api", Some(self.key.get().expose_secret()))
            .send()
            .await
            .map_err(|e| transport_error(e, true))?;
        let status = response.status();
        if !status.is_success() {
            if refused(status.as_u16()) {
                self.deny(status);
            }
            return Err(reply_error(response, true).await);
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

/// Mailgun's answers to a key that may not do what it asked.
fn refused(code: u16) -> bool {
    matches!(code, 401 | 403)
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
        let api_key = LiveSecret::new(config.api_key.clone())
            .map(Arc::new)
            .map_err(|source| ConfigError::Secret {
                field: "mailgun.apiKey".into(),
                source,
            })?;
        let read_key = config
            .read_api_key
            .as_ref()
            .map(|source| {
                LiveSecret::new(source.clone())
                    .map(Arc::new)
                    .map_err(|source| ConfigError::Secret {
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
        let base = config.effective_base_url();
        // The one place the events API is decided: every read goes to `events` from now on.
        let events: Box<dyn EventSource> = match config.events_api {
            MailgunEventsApi::Logs => Box::new(logs::Logs::new(base, &config.domain)),
            MailgunEventsApi::Events => Box::new(events::Events::new(base, &config.domain)),
        };
        let reader = Reader {
            client: client.clone(),
            refused_key: if read_key.is_some() {
                "the read key (mailgun.readApiKey, --mailgun-read-key-file)"
            } else {
                "the sending key, which is also the read key"
            },
            key: read_key.unwrap_or_else(|| api_key.clone()),
            denied: OnceLock::new(),
        };
        Ok(Self {
            client,
            messages_url: format!("{base}/v3/{}/messages", config.domain),
            api_key,
            reader,
            events,
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
        if let Some(first) = message.in_reply_to() {
            fields.push(("h:In-Reply-To".into(), first.to_string()));
            fields.push(("h:References".into(), first.to_string()));
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

/// The error a non-2xx `response` stands for: its status, its `Retry-After` and its body's
/// `message` (an unreadable or cut body still has its status).
async fn reply_error(mut response: reqwest::Response, lookup: bool) -> MailError {
    let status = response.status();
    let headers = response.headers().clone();
    let body = read_at_most(&mut response, MAX_ERROR_REPLY_BYTES)
        .await
        .map(|(body, _)| body)
        .unwrap_or_default();
    status_error(status, &headers, &body, lookup)
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

#[async_trait]
impl Mailer for MailgunMailer {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    fn tracking(&self) -> crate::Tracking {
        match self.reader.denied.get() {
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
            .basic_auth("api", Some(self.api_key.get().expose_secret()))
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
        if !response.status().is_success() {
            return Err(reply_error(response, false).await);
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
        if self.reader.denied.get().is_some() {
            return Ok(Lookup::Unsupported);
        }
        match self.events.lookup(&self.reader, message_id).await {
            Err(e) if self.reader.refused_for_good(&e) => Ok(Lookup::Unsupported),
            other => other,
        }
    }

    fn delivery_batch_size(&self) -> usize {
        self.events.batch_size()
    }

    async fn delivery_statuses(&self, mails: &[OpenMail]) -> Result<Vec<Delivery>, MailError> {
        let untracked = || Ok(vec![Delivery::NotTrackable; mails.len()]);
        if self.reader.denied.get().is_some() {
            return untracked();
        }
        let mut answers = Vec::with_capacity(mails.len());
        for batch in mails.chunks(self.events.batch_size().max(1)) {
            match self.events.deliveries(&self.reader, batch).await {
                Ok(batch) => answers.extend(batch),
                Err(e) if self.reader.refused_for_good(&e) => return untracked(),
                Err(e) => return Err(e),
            }
        }
        Ok(answers)
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
}
