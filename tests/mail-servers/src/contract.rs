//! The Mailgun API contract server: the documented parts of `POST /v3/{domain}/messages`,
//! `GET /v3/{domain}/events` and `POST /v1/analytics/logs` (the Logs API, see its module),
//! messages kept in memory, and control endpoints for tests.
//!
//! # Control endpoints
//! - `GET /_control/messages`: every accepted message, JSON array of [`StoredMessage`].
//! - `DELETE /_control/messages`: forget them.
//! - `PUT /_control/failure` with a JSON [`FailureRule`]: fail the next `count` requests (or every
//!   request when `count` is absent) to the chosen endpoint, or play a hostile peer there (see
//!   below).
//! - `DELETE /_control/failure`: stop failing.
//! - `PUT /_control/delay` with a JSON [`DelayRule`]: answer the next `count` message posts (or
//!   every one when `count` is absent) `delayMs` late, then normally (slow, not failing).
//! - `DELETE /_control/delay`: answer at once again.
//! - `PUT /_control/events` with a JSON [`EventRule`]: record what became of an accepted message
//!   (`delivered`, or `failed` with severity `temporary`/`permanent`, reason and the receiving
//!   server's reply), for each recipient or the one named.
//! - `PUT /_control/paging` with a JSON [`PagingRule`]: serve the events API in pages of at most
//!   `pageSize` items (the default is Mailgun's 300), so clients must follow `paging.next`.
//! - `GET /_control/stats`: request counts, JSON [`Stats`].
//!
//! # Events API
//! `GET /v3/{domain}/events` answers, oldest first with `ascending=yes` (newest first
//! otherwise), one `accepted` event per recipient of every accepted message plus the events set
//! with `/_control/events`, filtered by `message-id` (with or without brackets), `event`,
//! `recipient` and `begin` (seconds since the epoch), `limit` items per page (default 100, at
//! most 300). `paging.next` is an absolute URL `/v3/{domain}/events/{token}` that continues after
//! the page; the page after the last item is empty, and its `next` stays where it is (poll it
//! again later for newer events), as Mailgun documents.
//!
//! # Logs API
//! `POST /v1/analytics/logs` answers from the same events (items with `@timestamp` instead of
//! `timestamp`, and `domain.name`), filtered by the body's window, `events` and `filter.AND`
//! clauses (values of one clause are alternatives), `pagination.limit` items a page (at most
//! 100, and at most the `pageSize` of `/_control/paging`); `pagination.next` is an opaque token
//! present only when more items follow. Failure rules with target `logs` (or `all`) apply to it,
//! hostile modes included; every request, failed or not, counts in `Stats::logs_requests`.
//!
//! # Hostile peers
//! The failure modes from [`FailureMode::HugeOk`] on play a broken or malicious Mailgun (or a
//! proxy in its path) for the client's bounds and text cleaning: replies of `bodyBytes`
//! (default [`HOSTILE_BODY_BYTES`]) or without end, generated while they are sent (the server
//! holds 64 KiB of filler, never the body), [`CONTROL_TEXT`] in what a human would read, a body
//! that is not JSON, a reply dripped one byte at a time, a reply cut by a TCP reset. Each
//! variant's documentation gives its exact wire behaviour. With no rule set (or after
//! `DELETE /_control/failure`) the server behaves normally again.

use std::{
    collections::BTreeMap,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use axum::{
    Json, Router,
    extract::{Multipart, Path, Query, State},
    http::{HeaderMap, StatusCode, header},
    response::{IntoResponse, Response},
    routing::{get, post, put},
};
use base64::Engine as _;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::net::TcpListener;

use self::hostile::{Cutter, MaybeCutter};

mod hostile;
mod logs;

/// What the server expects from its clients.
///
/// Keys have Mailgun's scopes: the account key may do everything; a *domain sending key* only
/// `POST /v3/{domain}/messages` for the server's domain (401 on the events and Logs APIs, as
/// Mailgun answers); a key with a read-only role (Mailgun's `Analyst`) only the events and Logs
/// APIs (401 on sending).
#[derive(Debug, Clone)]
pub struct ContractConfig {
    /// The account API key (basic auth password, user `api`).
    pub api_key: String,
    /// The one sending domain it knows.
    pub domain: String,
    /// A domain sending key for `domain`, if any.
    pub sending_key: Option<String>,
    /// A read-only account key, if any.
    pub read_key: Option<String>,
}

/// What a request does, for the key scopes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    /// Sends a message.
    Send,
    /// Reads events or logs.
    Read,
}

/// A message the server accepted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredMessage {
    /// The id returned to the client, bracketed.
    pub id: String,
    /// `from`.
    pub from: String,
    /// Every `to`.
    pub to: Vec<String>,
    /// `subject`.
    pub subject: String,
    /// `text`, if sent.
    pub text: Option<String>,
    /// `html`, if sent.
    pub html: Option<String>,
    /// Every `o:tag`.
    pub tags: Vec<String>,
    /// `v:<name>` fields, by name.
    pub variables: BTreeMap<String, String>,
    /// `h:<Header>` fields, by header name.
    pub headers: BTreeMap<String, String>,
    /// Every other `o:<option>`, by option name (e.g. `testmode`).
    pub options: BTreeMap<String, String>,
    /// Seconds since the epoch when it was accepted.
    pub timestamp: f64,
    /// Which key sent it: `account` or `sending` (a domain sending key).
    #[serde(default)]
    pub key: String,
}

/// How to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FailureMode {
    /// 401 `Forbidden`.
    Unauthorized,
    /// 429 with `Retry-After: <retryAfter>` (seconds, default 1).
    RateLimited,
    /// 500 without storing anything.
    ServerError,
    /// Store the message, then answer 500 (the "5xx may still mean accepted" case).
    AcceptThenServerError,
    /// Never answer (read the request, then wait until the client gives up).
    Hang,
    /// Store the message, then never answer.
    AcceptThenHang,
    /// A hostile peer with a huge success. Messages: store the message, then 200,
    /// `Content-Type: application/json`, chunked (no `Content-Length`), a body that starts
    /// `{"id":"<id>","message":"Queued. Thank you."` and goes on with spaces (JSON whitespace,
    /// never the closing `}`) to `bodyBytes` bytes in all. Events: 200, chunked, a page that
    /// starts `{"items":[` and goes on with `accepted` items of the asked message-id, each
    /// followed by a comma, never closed, `bodyBytes` bytes in all (the last item cut).
    HugeOk,
    /// A hostile peer with a huge error (either target): 500 without storing anything,
    /// `Content-Type: application/json`, chunked, a body that starts `{"message":"` and goes on
    /// with `x` to `bodyBytes` bytes in all (never closed).
    HugeError,
    /// A hostile peer whose success never ends: as [`Self::HugeOk`] (messages: stored first),
    /// but the body goes on until the client hangs up.
    Endless,
    /// A hostile peer with control characters in its texts. Messages: 400 (nothing stored),
    /// `{"message": CONTROL_TEXT}` (see [`CONTROL_TEXT`]), with `Content-Length`. Events: 200,
    /// a page with one `failed` event, severity `permanent`, for the asked message-id (and the
    /// first recipient of the stored message with it, if any) whose `reason` and
    /// `delivery-status.message` and `.description` carry [`CONTROL_TEXT`].
    ControlText,
    /// A hostile peer whose body is not JSON: 200, `Content-Type: application/json`, body
    /// `<html>oops\u{1b}[2J</html>`. Messages: stored first (an accepted send whose reply cannot
    /// be read).
    BadJson,
    /// A hostile peer that drips: 200 with `Content-Length` and a valid body (messages: stored
    /// first, `{"id":…,"message":"Queued. Thank you."}`; events: an empty page), the headers at
    /// once, then the body one byte every `dripMs` milliseconds (default [`DEFAULT_DRIP_MS`]).
    Drip,
    /// A hostile peer that cuts its reply: 200 with `Content-Length` of the valid body of
    /// [`Self::Drip`] (messages: stored first), the status line, headers and the first half of
    /// the body, then, 200 ms later, a TCP reset (`SO_LINGER` 0, then close: an RST, not a
    /// FIN). Served through [`router`] without [`serve`], the connection is closed instead.
    ResetMidReply,
}

/// The default `bodyBytes` of a [`FailureRule`]: 1 GiB, generated as it is sent.
pub const HOSTILE_BODY_BYTES: u64 = 1 << 30;

/// The default `dripMs` of a [`FailureRule`] ([`FailureMode::Drip`]): a byte a second.
pub const DEFAULT_DRIP_MS: u64 = 1000;

/// What [`FailureMode::ControlText`] says: normal text (`Invalid recipient`, `mailbox
/// unavailable`) around a terminal colour escape (ESC `[31m`), BEL, NUL, DEL, the C1 control
/// CSI (U+009B), the Unicode line and paragraph separators (U+2028, U+2029), a right-to-left
/// override (U+202E) and the isolates U+2066 to U+2069.
pub const CONTROL_TEXT: &str = "Invalid recipient \u{1b}[31mred\u{1b}[0m bell\u{7} nul\u{0} \
     del\u{7f} csi\u{9b}2J line\u{2028}para\u{2029} \u{202e}exe.txt \u{2066}lri\u{2069} \
     \u{2067}rli\u{2069} \u{2068}fsi\u{2069} mailbox unavailable";

/// Which requests a [`FailureRule`] applies to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FailureTarget {
    /// `POST /v3/{domain}/messages` (the default).
    #[default]
    Messages,
    /// `GET /v3/{domain}/events`.
    Events,
    /// `POST /v1/analytics/logs`.
    Logs,
    /// Every endpoint.
    All,
}

/// A failure to inject, set with `PUT /_control/failure`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FailureRule {
    /// How to fail.
    pub mode: FailureMode,
    /// How many requests to fail; absent = all until cleared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    /// `Retry-After` seconds for [`FailureMode::RateLimited`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after: Option<u64>,
    /// Which endpoint fails.
    #[serde(default)]
    pub target: FailureTarget,
    /// How long the body of [`FailureMode::HugeOk`] and [`FailureMode::HugeError`] is, in
    /// bytes; absent = [`HOSTILE_BODY_BYTES`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_bytes: Option<u64>,
    /// Milliseconds between two bytes of [`FailureMode::Drip`]; absent = [`DEFAULT_DRIP_MS`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drip_ms: Option<u64>,
}

impl FailureRule {
    /// `mode` for every message post until cleared, every other field absent: write
    /// `FailureRule { count: Some(1), ..FailureRule::new(mode) }` for the rest.
    pub fn new(mode: FailureMode) -> Self {
        Self {
            mode,
            count: None,
            retry_after: None,
            target: FailureTarget::Messages,
            body_bytes: None,
            drip_ms: None,
        }
    }
}

/// A delay to add before answering message posts, set with `PUT /_control/delay`: a slow
/// server that still answers (and stores) normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DelayRule {
    /// How long to wait before handling each affected request, in milliseconds.
    pub delay_ms: u64,
    /// How many requests to delay; absent = all until cleared.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
}

/// What became of a message, set with `PUT /_control/events`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum DeliveryEvent {
    /// `delivered`: the receiving server accepted it.
    Delivered,
    /// `failed`, severity `temporary`: Mailgun will retry.
    TemporaryFailure,
    /// `failed`, severity `permanent`: Mailgun gave up.
    PermanentFailure,
}

/// An event to record for an accepted message, set with `PUT /_control/events`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EventRule {
    /// The message's id, with or without brackets.
    pub message_id: String,
    /// What happened.
    pub event: DeliveryEvent,
    /// Only this recipient; absent: every recipient of the message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recipient: Option<String>,
    /// `reason` of a failure (Mailgun: `bounce`, `suppress-bounce`, `generic`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// `delivery-status.code` (the receiving server's SMTP code).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<u16>,
    /// `delivery-status.message` (the receiving server's reply).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
}

/// How the events and Logs APIs page, set with `PUT /_control/paging`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PagingRule {
    /// At most this many items per page, whatever `limit` asks (at least 1).
    pub page_size: usize,
}

/// Request counts, from `GET /_control/stats`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Stats {
    /// Answered events requests (first pages and `paging.next` pages).
    #[serde(default)]
    pub events_requests: u64,
    /// Logs API requests (first pages and pages asked by token), failed ones included: what a
    /// client spent of its rate limit.
    #[serde(default)]
    pub logs_requests: u64,
}

/// An event recorded with `PUT /_control/events`, for one recipient.
#[derive(Debug, Clone)]
struct RecordedEvent {
    id: String,
    recipient: String,
    rule: EventRule,
    timestamp: f64,
    seq: u64,
}

#[derive(Default)]
struct Store {
    messages: Vec<StoredMessage>,
    failure: Option<FailureRule>,
    delay: Option<DelayRule>,
    events: Vec<RecordedEvent>,
    page_size: Option<usize>,
    stats: Stats,
}

struct AppState {
    /// `Authorization` values and what each may do.
    keys: Vec<(String, &'static [Scope])>,
    domain: String,
    store: Mutex<Store>,
    next_id: AtomicU64,
}

type Shared = Arc<AppState>;

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

fn error(status: StatusCode, message: &str) -> Response {
    (status, Json(json!({ "message": message }))).into_response()
}

impl AppState {
    fn store(&self) -> std::sync::MutexGuard<'_, Store> {
        // A panic while holding the lock leaves plain data behind: keep serving.
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes one use of the failure rule if it applies to `target`.
    fn take_failure(&self, target: FailureTarget) -> Option<FailureRule> {
        let mut store = self.store();
        let rule = store.failure?;
        if rule.target != FailureTarget::All && rule.target != target {
            return None;
        }
        match rule.count {
            Some(0) => {
                store.failure = None;
                None
            }
            Some(n) => {
                store.failure = (n > 1).then_some(FailureRule {
                    count: Some(n - 1),
                    ..rule
                });
                Some(rule)
            }
            None => Some(rule),
        }
    }

    /// Takes one use of the delay rule, if any.
    fn take_delay(&self) -> Option<Duration> {
        let mut store = self.store();
        let rule = store.delay?;
        match rule.count {
            Some(0) => {
                store.delay = None;
                None
            }
            Some(n) => {
                store.delay = (n > 1).then_some(DelayRule {
                    count: Some(n - 1),
                    ..rule
                });
                Some(Duration::from_millis(rule.delay_ms))
            }
            None => Some(Duration::from_millis(rule.delay_ms)),
        }
    }

    /// The error answer for a request with wrong credentials, if any.
    /// 401 for a request without a known key, or with a key whose scope does not cover `scope`.
    fn unauthorized(&self, headers: &HeaderMap, scope: Scope) -> Option<Response> {
        let auth = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        match self.keys.iter().find(|(k, _)| Some(k.as_str()) == auth) {
            None => Some(error(StatusCode::UNAUTHORIZED, "Invalid private key")),
            Some((_, scopes)) if !scopes.contains(&scope) => {
                Some(error(StatusCode::UNAUTHORIZED, "Forbidden"))
            }
            Some(_) => None,
        }
    }

    /// `account`, `sending` or `read`: which of the keys a request carries (`unknown` for none).
    fn key_name(&self, headers: &HeaderMap) -> &'static str {
        let auth = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        match self.keys.iter().position(|(k, _)| Some(k.as_str()) == auth) {
            Some(0) => "account",
            Some(_) => match self.keys.iter().find(|(k, _)| Some(k.as_str()) == auth) {
                Some((_, scopes)) if scopes == &[Scope::Send] => "sending",
                _ => "read",
            },
            None => "unknown",
        }
    }

    /// The error answer for a request with wrong credentials, a key that may not do `scope`,
    /// or an unknown domain, if any.
    fn rejection(&self, headers: &HeaderMap, domain: &str, scope: Scope) -> Option<Response> {
        if let Some(r) = self.unauthorized(headers, scope) {
            return Some(r);
        }
        if domain != self.domain {
            // A sending key belongs to its domain: elsewhere it is refused, not told "not found".
            let account = headers
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                == self.keys.first().map(|(k, _)| k.as_str());
            if !account {
                return Some(error(StatusCode::UNAUTHORIZED, "Forbidden"));
            }
            return Some(error(
                StatusCode::NOT_FOUND,
                &format!("Domain not found: {domain}"),
            ));
        }
        None
    }
}

/// What a failing request asked for.
enum Asked {
    /// A message post, with the message as it would be stored.
    Message(Box<StoredMessage>),
    /// An events or Logs page: the (first) asked message-id, if any, and the `paging.next`
    /// URL (events) or `pagination.next` token (Logs) of a page after every event.
    Events {
        message_id: Option<String>,
        next: String,
        logs: bool,
    },
}

/// Answers a request the failure rule says to fail (storing the message first where the mode
/// says so); `cutter` resets the connection for [`FailureMode::ResetMidReply`].
async fn fail(
    rule: FailureRule,
    state: &AppState,
    asked: Asked,
    cutter: Option<Cutter>,
) -> Response {
    let store = |asked: &Asked| {
        if let Asked::Message(m) = asked {
            state.store().messages.push((**m).clone());
        }
    };
    match rule.mode {
        FailureMode::Unauthorized => error(StatusCode::UNAUTHORIZED, "Forbidden"),
        FailureMode::RateLimited => {
            let mut r = error(StatusCode::TOO_MANY_REQUESTS, "Too many requests");
            r.headers_mut().insert(
                header::RETRY_AFTER,
                rule.retry_after
                    .unwrap_or(1)
                    .to_string()
                    .parse()
                    .unwrap_or_else(|_| header::HeaderValue::from_static("1")),
            );
            r
        }
        FailureMode::ServerError => error(StatusCode::INTERNAL_SERVER_ERROR, "Internal error"),
        FailureMode::AcceptThenServerError => {
            store(&asked);
            error(StatusCode::INTERNAL_SERVER_ERROR, "Internal error")
        }
        FailureMode::Hang | FailureMode::AcceptThenHang => {
            if rule.mode == FailureMode::AcceptThenHang {
                store(&asked);
            }
            tokio::time::sleep(Duration::from_secs(3600)).await;
            error(StatusCode::GATEWAY_TIMEOUT, "Gave up hanging")
        }
        FailureMode::HugeError | FailureMode::ControlText => {
            hostile::reply(rule, state, &asked, cutter)
        }
        FailureMode::HugeOk
        | FailureMode::Endless
        | FailureMode::BadJson
        | FailureMode::Drip
        | FailureMode::ResetMidReply => {
            store(&asked);
            hostile::reply(rule, state, &asked, cutter)
        }
    }
}

/// `POST /v3/{domain}/messages`. A request that arrived whole is handled whole even when its
/// client hangs up right after the last byte, as a real server does (hyper drops the handler of
/// a connection whose client went away, so the handling runs in a task of its own); a request
/// whose body never completes is never handled.
/// The lower-cased domain of a `From` value (`Name <a@b>` or `a@b`).
fn address_domain(from: &str) -> String {
    let address = match from.trim().strip_suffix('>') {
        Some(rest) => rest.rsplit_once('<').map_or(rest, |(_, a)| a),
        None => from.trim(),
    };
    address
        .rsplit_once('@')
        .map(|(_, d)| d.to_ascii_lowercase())
        .unwrap_or_default()
}

async fn send_message(
    State(state): State<Shared>,
    Path(domain): Path<String>,
    MaybeCutter(cutter): MaybeCutter,
    headers: HeaderMap,
    form: Multipart,
) -> Response {
    tokio::spawn(receive_message(state, domain, cutter, headers, form))
        .await
        .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "the handler failed"))
}

async fn receive_message(
    state: Shared,
    domain: String,
    cutter: Option<Cutter>,
    headers: HeaderMap,
    mut form: Multipart,
) -> Response {
    // Read the whole request before judging it, as a real server does: an early answer would
    // reach a client that is still uploading as a broken connection.
    let mut fields: Vec<(String, String)> = Vec::new();
    loop {
        match form.next_field().await {
            Ok(Some(field)) => {
                let name = field.name().unwrap_or_default().to_owned();
                match field.text().await {
                    Ok(value) => fields.push((name, value)),
                    Err(e) => return error(StatusCode::BAD_REQUEST, &format!("bad field: {e}")),
                }
            }
            Ok(None) => break,
            Err(e) => return error(StatusCode::BAD_REQUEST, &format!("bad form: {e}")),
        }
    }
    if let Some(r) = state.rejection(&headers, &domain, Scope::Send) {
        return r;
    }
    let one = |name: &str| {
        fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.clone())
    };
    let Some(from) = one("from") else {
        return error(StatusCode::BAD_REQUEST, "from parameter is missing");
    };
    // Mailgun accepts any From, and receivers then judge it: a From outside the domain the mail
    // is sent (and DKIM-signed) for fails DMARC alignment, and a domain with `p=reject` has it
    // refused. The contract server refuses it outright, so a test sees it.
    let from_domain = address_domain(&from);
    if from_domain != domain.to_ascii_lowercase()
        && !from_domain.ends_with(&format!(".{}", domain.to_ascii_lowercase()))
    {
        return error(
            StatusCode::BAD_REQUEST,
            &format!(
                "from: {from_domain:?} is not the sending domain {domain:?} (a From on another \
                 domain fails DMARC at the receivers)"
            ),
        );
    }
    let to: Vec<String> = fields
        .iter()
        .filter(|(n, _)| n == "to")
        .map(|(_, v)| v.clone())
        .collect();
    if to.is_empty() {
        return error(StatusCode::BAD_REQUEST, "to parameter is missing");
    }
    let Some(subject) = one("subject") else {
        return error(StatusCode::BAD_REQUEST, "subject parameter is missing");
    };
    let (text, html) = (one("text"), one("html"));
    if text.is_none() && html.is_none() {
        return error(
            StatusCode::BAD_REQUEST,
            "Need at least one of 'text' or 'html' parameters specified",
        );
    }
    let mut message = StoredMessage {
        id: String::new(),
        from,
        to,
        subject,
        text,
        html,
        tags: Vec::new(),
        variables: BTreeMap::new(),
        headers: BTreeMap::new(),
        options: BTreeMap::new(),
        timestamp: now(),
        key: state.key_name(&headers).to_owned(),
    };
    for (name, value) in &fields {
        if let Some(h) = name.strip_prefix("h:") {
            message.headers.insert(h.to_owned(), value.clone());
        } else if let Some(v) = name.strip_prefix("v:") {
            message.variables.insert(v.to_owned(), value.clone());
        } else if name == "o:tag" {
            message.tags.push(value.clone());
        } else if let Some(o) = name.strip_prefix("o:") {
            message.options.insert(o.to_owned(), value.clone());
        }
    }
    let given = message
        .headers
        .iter()
        .find(|(k, _)| k.eq_ignore_ascii_case("Message-Id"))
        .map(|(_, v)| v.trim().to_owned());
    message.id = match given {
        Some(id) if id.starts_with('<') && id.ends_with('>') => id,
        Some(id) => format!("<{id}>"),
        None => format!(
            "<{}.{}@{}>",
            now() as u64,
            state.next_id.fetch_add(1, Ordering::Relaxed),
            state.domain
        ),
    };
    if let Some(delay) = state.take_delay() {
        tokio::time::sleep(delay).await;
    }
    if let Some(rule) = state.take_failure(FailureTarget::Messages) {
        return fail(rule, &state, Asked::Message(Box::new(message)), cutter).await;
    }
    let id = message.id.clone();
    state.store().messages.push(message);
    Json(json!({ "id": id, "message": "Queued. Thank you." })).into_response()
}

/// The filters and position of an events query; a `paging.next` token is this, as JSON in
/// base64url.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
struct EventsQuery {
    #[serde(
        rename = "message-id",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    message_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    event: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    recipient: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    begin: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    ascending: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    limit: Option<String>,
    /// Items already served (tokens only).
    #[serde(default)]
    offset: usize,
}

fn bare(id: &str) -> &str {
    id.trim().trim_start_matches('<').trim_end_matches('>')
}

/// Every event of the domain as (timestamp, sequence, JSON), oldest first; only those of the
/// message ids `wanted` accepts (filtered before any JSON is built: a query about one message
/// must not cost what the whole log costs, or a long benchmark measures this server).
fn all_events(store: &Store, wanted: &dyn Fn(&str) -> bool) -> Vec<(f64, u64, serde_json::Value)> {
    let mut out = Vec::new();
    for (n, m) in store.messages.iter().enumerate() {
        if !wanted(&m.id) {
            continue;
        }
        let headers = json!({
            "message-id": bare(&m.id),
            "from": m.from,
            "to": m.to.join(", "),
            "subject": m.subject,
        });
        for (r, to) in m.to.iter().enumerate() {
            out.push((
                m.timestamp,
                (n * 1000 + r) as u64,
                json!({
                    "id": format!("acc-{n}-{r}"),
                    "event": "accepted",
                    "timestamp": m.timestamp,
                    "recipient": to,
                    "tags": m.tags,
                    "user-variables": m.variables,
                    "message": {"headers": headers},
                }),
            ));
        }
    }
    for e in store.events.iter().filter(|e| wanted(&e.id)) {
        let mut item = json!({
            "id": format!("ev-{}", e.seq),
            "timestamp": e.timestamp,
            "recipient": e.recipient,
            "message": {"headers": {"message-id": e.id}},
        });
        match e.rule.event {
            DeliveryEvent::Delivered => {
                item["event"] = json!("delivered");
                item["delivery-status"] = json!({
                    "code": e.rule.code.unwrap_or(250),
                    "message": e.rule.message.clone().unwrap_or_else(|| "OK".into()),
                });
            }
            DeliveryEvent::TemporaryFailure | DeliveryEvent::PermanentFailure => {
                let permanent = e.rule.event == DeliveryEvent::PermanentFailure;
                item["event"] = json!("failed");
                item["severity"] = json!(if permanent { "permanent" } else { "temporary" });
                item["reason"] = json!(e.rule.reason.clone().unwrap_or_else(|| "generic".into()));
                item["delivery-status"] = json!({
                    "code": e.rule.code.unwrap_or(if permanent { 550 } else { 421 }),
                    "message": e.rule.message.clone().unwrap_or_default(),
                    "description": "",
                });
            }
        }
        out.push((e.timestamp, 1_000_000_000 + e.seq, item));
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    out
}

fn matches(query: &EventsQuery, begin: Option<f64>, item: &serde_json::Value) -> bool {
    let text = |v: &serde_json::Value| v.as_str().unwrap_or_default().to_owned();
    query
        .message_id
        .as_deref()
        .is_none_or(|w| text(&item["message"]["headers"]["message-id"]) == bare(w))
        && query
            .event
            .as_deref()
            .is_none_or(|w| text(&item["event"]) == w)
        && query
            .recipient
            .as_deref()
            .is_none_or(|w| text(&item["recipient"]) == w)
        && begin.is_none_or(|b| item["timestamp"].as_f64().unwrap_or_default() >= b)
}

async fn events(
    State(state): State<Shared>,
    Path(domain): Path<String>,
    MaybeCutter(cutter): MaybeCutter,
    headers: HeaderMap,
    Query(query): Query<EventsQuery>,
) -> Response {
    events_page(&state, &domain, &headers, query, cutter).await
}

async fn events_next(
    State(state): State<Shared>,
    Path((domain, token)): Path<(String, String)>,
    MaybeCutter(cutter): MaybeCutter,
    headers: HeaderMap,
) -> Response {
    let query = base64::engine::general_purpose::URL_SAFE_NO_PAD
        .decode(token.as_bytes())
        .ok()
        .and_then(|raw| serde_json::from_slice::<EventsQuery>(&raw).ok());
    match query {
        Some(query) => events_page(&state, &domain, &headers, query, cutter).await,
        None => {
            if let Some(r) = state.rejection(&headers, &domain, Scope::Read) {
                return r;
            }
            error(StatusCode::BAD_REQUEST, "invalid page token")
        }
    }
}

async fn events_page(
    state: &AppState,
    domain: &str,
    headers: &HeaderMap,
    query: EventsQuery,
    cutter: Option<Cutter>,
) -> Response {
    if let Some(r) = state.rejection(headers, domain, Scope::Read) {
        return r;
    }
    let host = headers
        .get(header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("localhost");
    let url = |offset: usize| {
        let token = EventsQuery {
            offset,
            ..query.clone()
        };
        let raw = serde_json::to_vec(&token).unwrap_or_default();
        format!(
            "http://{host}/v3/{domain}/events/{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(raw)
        )
    };
    if let Some(rule) = state.take_failure(FailureTarget::Events) {
        // A hostile page's `next` asks again from where this one started: once the server
        // behaves again, the real events are there.
        let asked = Asked::Events {
            message_id: query.message_id.clone(),
            next: url(query.offset),
            logs: false,
        };
        return fail(rule, state, asked, cutter).await;
    }
    let begin = match query.begin.as_deref().map(str::parse::<f64>) {
        None => None,
        Some(Ok(b)) => Some(b),
        Some(Err(_)) => return error(StatusCode::BAD_REQUEST, "invalid begin"),
    };
    let ascending = match query.ascending.as_deref() {
        None | Some("no") => false,
        Some("yes") => true,
        Some(_) => return error(StatusCode::BAD_REQUEST, "ascending: yes or no"),
    };
    let limit = match query.limit.as_deref().map(str::parse::<usize>) {
        None => 100,
        Some(Ok(n @ 1..=300)) => n,
        Some(_) => return error(StatusCode::BAD_REQUEST, "limit: 1 to 300"),
    };
    let (items, size) = {
        let mut store = state.store();
        store.stats.events_requests += 1;
        let asked = query.message_id.as_deref();
        let wanted = |id: &str| asked.is_none_or(|w| bare(id) == bare(w));
        let mut all: Vec<_> = all_events(&store, &wanted)
            .into_iter()
            .map(|(_, _, item)| item)
            .filter(|item| matches(&query, begin, item))
            .collect();
        if !ascending {
            all.reverse();
        }
        let size = limit.min(store.page_size.unwrap_or(300)).max(1);
        let items: Vec<_> = all.into_iter().skip(query.offset).take(size).collect();
        (items, size)
    };
    let next = url(query.offset + items.len());
    let paging = json!({
        "next": next,
        "previous": url(query.offset.saturating_sub(size)),
        "first": url(0),
        "last": next,
    });
    Json(json!({ "items": items, "paging": paging })).into_response()
}

async fn add_event(State(state): State<Shared>, Json(rule): Json<EventRule>) -> Response {
    let mut store = state.store();
    let id = bare(&rule.message_id).to_owned();
    let Some(message) = store.messages.iter().find(|m| bare(&m.id) == id) else {
        return error(StatusCode::NOT_FOUND, "no accepted message with this id");
    };
    let recipients: Vec<String> = match &rule.recipient {
        Some(r) if message.to.contains(r) => vec![r.clone()],
        Some(_) => return error(StatusCode::BAD_REQUEST, "not a recipient of this message"),
        None => message.to.clone(),
    };
    // Strictly after every event so far, so the order of control calls is the events' order.
    let latest = store
        .events
        .iter()
        .map(|e| e.timestamp)
        .chain(store.messages.iter().map(|m| m.timestamp))
        .fold(0.0_f64, f64::max);
    let timestamp = now().max(latest + 0.001);
    for recipient in recipients {
        let seq = store.events.len() as u64;
        store.events.push(RecordedEvent {
            id: id.clone(),
            recipient,
            rule: rule.clone(),
            timestamp,
            seq,
        });
    }
    StatusCode::NO_CONTENT.into_response()
}

async fn set_paging(State(state): State<Shared>, Json(rule): Json<PagingRule>) -> StatusCode {
    state.store().page_size = Some(rule.page_size.max(1));
    StatusCode::NO_CONTENT
}

async fn stats(State(state): State<Shared>) -> Json<Stats> {
    Json(state.store().stats)
}

async fn list_messages(State(state): State<Shared>) -> Json<Vec<StoredMessage>> {
    Json(state.store().messages.clone())
}

async fn clear_messages(State(state): State<Shared>) -> StatusCode {
    let mut store = state.store();
    store.messages.clear();
    store.events.clear();
    StatusCode::NO_CONTENT
}

async fn set_failure(State(state): State<Shared>, Json(rule): Json<FailureRule>) -> StatusCode {
    state.store().failure = Some(rule);
    StatusCode::NO_CONTENT
}

async fn clear_failure(State(state): State<Shared>) -> StatusCode {
    state.store().failure = None;
    StatusCode::NO_CONTENT
}

async fn set_delay(State(state): State<Shared>, Json(rule): Json<DelayRule>) -> StatusCode {
    state.store().delay = Some(rule);
    StatusCode::NO_CONTENT
}

async fn clear_delay(State(state): State<Shared>) -> StatusCode {
    state.store().delay = None;
    StatusCode::NO_CONTENT
}

/// The server's routes.
pub fn router(config: &ContractConfig) -> Router {
    let auth = |key: &str| {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("api:{key}"))
        )
    };
    let mut keys: Vec<(String, &'static [Scope])> =
        vec![(auth(&config.api_key), &[Scope::Send, Scope::Read])];
    if let Some(key) = &config.sending_key {
        keys.push((auth(key), &[Scope::Send]));
    }
    if let Some(key) = &config.read_key {
        keys.push((auth(key), &[Scope::Read]));
    }
    let state = Arc::new(AppState {
        keys,
        domain: config.domain.clone(),
        store: Mutex::new(Store::default()),
        next_id: AtomicU64::new(1),
    });
    Router::new()
        .route("/v3/{domain}/messages", post(send_message))
        .route("/v3/{domain}/events", get(events))
        .route("/v3/{domain}/events/{token}", get(events_next))
        .route("/v1/analytics/logs", post(logs::logs))
        .route(
            "/_control/messages",
            get(list_messages).delete(clear_messages),
        )
        .route("/_control/failure", put(set_failure).delete(clear_failure))
        .route("/_control/delay", put(set_delay).delete(clear_delay))
        .route("/_control/events", put(add_event))
        .route("/_control/paging", put(set_paging))
        .route("/_control/stats", get(stats))
        .with_state(state)
}

/// Serves the contract on `listener` until the future is dropped, with `TCP_NODELAY` on every
/// accepted socket (otherwise Nagle plus delayed ACKs add ~40 ms to each keep-alive request),
/// and connections that [`FailureMode::ResetMidReply`] can reset.
///
/// # Errors
/// When accepting connections fails for good.
pub async fn serve(listener: TcpListener, config: &ContractConfig) -> std::io::Result<()> {
    axum::serve(
        hostile::CuttingListener::new(listener),
        router(config).into_make_service_with_connect_info::<Cutter>(),
    )
    .await
}
