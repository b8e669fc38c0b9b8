//! The Mailgun API contract server: the documented parts of `POST /v3/{domain}/messages` and
//! `GET /v3/{domain}/events`, messages kept in memory, and control endpoints for tests.
//!
//! # Control endpoints
//! - `GET /_control/messages`: every accepted message, JSON array of [`StoredMessage`].
//! - `DELETE /_control/messages`: forget them.
//! - `PUT /_control/failure` with a JSON [`FailureRule`]: fail the next `count` requests (or every
//!   request when `count` is absent) to the chosen endpoint.
//! - `DELETE /_control/failure`: stop failing.
//! - `PUT /_control/delay` with a JSON [`DelayRule`]: answer the next `count` message posts (or
//!   every one when `count` is absent) `delayMs` late, then normally (slow, not failing).
//! - `DELETE /_control/delay`: answer at once again.

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

/// What the server expects from its clients.
#[derive(Debug, Clone)]
pub struct ContractConfig {
    /// The API key (basic auth password, user `api`).
    pub api_key: String,
    /// The one sending domain it knows.
    pub domain: String,
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
}

/// Which requests a [`FailureRule`] applies to.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum FailureTarget {
    /// `POST /v3/{domain}/messages` (the default).
    #[default]
    Messages,
    /// `GET /v3/{domain}/events`.
    Events,
    /// Both.
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

#[derive(Default)]
struct Store {
    messages: Vec<StoredMessage>,
    failure: Option<FailureRule>,
    delay: Option<DelayRule>,
}

struct AppState {
    expected_auth: String,
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

    /// The error answer for a request with wrong credentials or an unknown domain, if any.
    fn rejection(&self, headers: &HeaderMap, domain: &str) -> Option<Response> {
        let auth = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if auth != Some(self.expected_auth.as_str()) {
            return Some(error(StatusCode::UNAUTHORIZED, "Invalid private key"));
        }
        if domain != self.domain {
            return Some(error(
                StatusCode::NOT_FOUND,
                &format!("Domain not found: {domain}"),
            ));
        }
        None
    }
}

/// Answers a request the failure rule says to fail; `store` stores the message first.
async fn fail(rule: FailureRule, state: &AppState, message: Option<StoredMessage>) -> Response {
    let store = |m: Option<StoredMessage>| {
        if let Some(m) = m {
            state.store().messages.push(m);
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
            store(message);
            error(StatusCode::INTERNAL_SERVER_ERROR, "Internal error")
        }
        FailureMode::Hang | FailureMode::AcceptThenHang => {
            if rule.mode == FailureMode::AcceptThenHang {
                store(message);
            }
            tokio::time::sleep(Duration::from_secs(3600)).await;
            error(StatusCode::GATEWAY_TIMEOUT, "Gave up hanging")
        }
    }
}

async fn send_message(
    State(state): State<Shared>,
    Path(domain): Path<String>,
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
    if let Some(r) = state.rejection(&headers, &domain) {
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
        return fail(rule, &state, Some(message)).await;
    }
    let id = message.id.clone();
    state.store().messages.push(message);
    Json(json!({ "id": id, "message": "Queued. Thank you." })).into_response()
}

#[derive(Deserialize)]
struct EventsQuery {
    #[serde(rename = "message-id")]
    message_id: Option<String>,
}

async fn events(
    State(state): State<Shared>,
    Path(domain): Path<String>,
    headers: HeaderMap,
    Query(query): Query<EventsQuery>,
) -> Response {
    if let Some(r) = state.rejection(&headers, &domain) {
        return r;
    }
    if let Some(rule) = state.take_failure(FailureTarget::Events) {
        return fail(rule, &state, None).await;
    }
    let wanted = query
        .message_id
        .map(|id| id.trim_start_matches('<').trim_end_matches('>').to_owned());
    let items: Vec<_> = state
        .store()
        .messages
        .iter()
        .filter(|m| {
            wanted
                .as_deref()
                .is_none_or(|w| m.id.trim_start_matches('<').trim_end_matches('>') == w)
        })
        .map(|m| {
            json!({
                "event": "accepted",
                "timestamp": m.timestamp,
                "recipient": m.to.first(),
                "tags": m.tags,
                "user-variables": m.variables,
                "message": {"headers": {
                    "message-id": m.id.trim_start_matches('<').trim_end_matches('>'),
                    "from": m.from,
                    "to": m.to.join(", "),
                    "subject": m.subject,
                }},
            })
        })
        .collect();
    Json(json!({ "items": items, "paging": {} })).into_response()
}

async fn list_messages(State(state): State<Shared>) -> Json<Vec<StoredMessage>> {
    Json(state.store().messages.clone())
}

async fn clear_messages(State(state): State<Shared>) -> StatusCode {
    state.store().messages.clear();
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
    let credentials =
        base64::engine::general_purpose::STANDARD.encode(format!("api:{}", config.api_key));
    let state = Arc::new(AppState {
        expected_auth: format!("Basic {credentials}"),
        domain: config.domain.clone(),
        store: Mutex::new(Store::default()),
        next_id: AtomicU64::new(1),
    });
    Router::new()
        .route("/v3/{domain}/messages", post(send_message))
        .route("/v3/{domain}/events", get(events))
        .route(
            "/_control/messages",
            get(list_messages).delete(clear_messages),
        )
        .route("/_control/failure", put(set_failure).delete(clear_failure))
        .route("/_control/delay", put(set_delay).delete(clear_delay))
        .with_state(state)
}

/// Serves the contract on `listener` until the future is dropped, with `TCP_NODELAY` on every
/// accepted socket (otherwise Nagle plus delayed ACKs add ~40 ms to each keep-alive request).
///
/// # Errors
/// When accepting connections fails for good.
pub async fn serve(listener: TcpListener, config: &ContractConfig) -> std::io::Result<()> {
    use axum::serve::ListenerExt as _;
    let listener = listener.tap_io(|tcp| {
        // Best effort: a socket without NODELAY is only slower.
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, router(config)).await
}
