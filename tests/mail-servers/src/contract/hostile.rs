//! The contract server's hostile answers ([`FailureMode::HugeOk`] and the modes after it):
//! bodies generated while they are sent, and connections that a handler can reset.
//!
//! What it is for: playing a broken or malicious Mailgun (or a proxy in its path) with a small,
//! constant memory of its own: a body is 64 KiB of filler sent again and again (or, for an
//! events page, one 64 KiB block of items), never the body itself, and hyper polls it only as
//! fast as the client reads.
//!
//! What it is not for: anything a well-behaved Mailgun does (that is the parent module).

use std::{
    convert::Infallible,
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
    time::Duration,
};

use axum::{
    body::Body,
    extract::{ConnectInfo, FromRequestParts, connect_info::Connected},
    http::{StatusCode, header, request::Parts},
    response::{IntoResponse, Response},
    serve::{IncomingStream, Listener},
};
use bytes::Bytes;
use futures::StreamExt as _;
use serde_json::json;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
};

use super::{
    AppState, Asked, CONTROL_TEXT, DEFAULT_DRIP_MS, FailureMode, FailureRule, HOSTILE_BODY_BYTES,
    bare, error, now,
};

/// The size of one generated chunk.
const CHUNK: usize = 64 * 1024;
/// Filler that keeps a JSON document open and valid so far: whitespace.
static SPACES: [u8; CHUNK] = [b' '; CHUNK];
/// Filler inside a JSON string.
static XS: [u8; CHUNK] = [b'x'; CHUNK];
/// How long [`FailureMode::ResetMidReply`] waits between the half body and the reset, so the
/// half is flushed to the client first.
const CUT_AFTER: Duration = Duration::from_millis(200);
/// The body of [`FailureMode::BadJson`].
const NOT_JSON: &str = "<html>oops\u{1b}[2J</html>";

/// The answer of a hostile `rule` to `asked` (the message is already stored where the mode
/// says so).
pub(super) fn reply(
    rule: FailureRule,
    state: &AppState,
    asked: &Asked,
    cutter: Option<Cutter>,
) -> Response {
    let limit = match rule.mode {
        FailureMode::Endless => None,
        _ => Some(rule.body_bytes.unwrap_or(HOSTILE_BODY_BYTES)),
    };
    match (rule.mode, asked) {
        (FailureMode::HugeOk | FailureMode::Endless, Asked::Message(message)) => {
            let head = format!(
                r#"{{"id":{},"message":"Queued. Thank you.""#,
                json!(message.id)
            );
            let body = generated(head.into(), Bytes::from_static(&SPACES), limit);
            with_body(StatusCode::OK, body, None)
        }
        (FailureMode::HugeOk | FailureMode::Endless, Asked::Events { message_id, .. }) => {
            let items = item_block(&message_id_or_made_up(state, message_id.as_deref()));
            let body = generated(Bytes::from_static(br#"{"items":["#), items, limit);
            with_body(StatusCode::OK, body, None)
        }
        (FailureMode::HugeError, _) => {
            let head = Bytes::from_static(br#"{"message":""#);
            let body = generated(head, Bytes::from_static(&XS), limit);
            with_body(StatusCode::INTERNAL_SERVER_ERROR, body, None)
        }
        (FailureMode::ControlText, Asked::Message(_)) => {
            error(StatusCode::BAD_REQUEST, CONTROL_TEXT)
        }
        (
            FailureMode::ControlText,
            Asked::Events {
                message_id,
                next,
                logs,
            },
        ) => {
            let id = message_id_or_made_up(state, message_id.as_deref());
            let recipient = state
                .store()
                .messages
                .iter()
                .find(|m| bare(&m.id) == id)
                .and_then(|m| m.to.first().cloned())
                .unwrap_or_else(|| "recipient@example.com".into());
            let items = json!([{
                "id": "hostile-control-text",
                "event": "failed",
                "severity": "permanent",
                "timestamp": now(),
                "@timestamp": super::logs::rfc3339(now()),
                "recipient": recipient,
                "reason": CONTROL_TEXT,
                "delivery-status": {
                    "code": 550,
                    "message": CONTROL_TEXT,
                    "description": CONTROL_TEXT,
                },
                "message": {"headers": {"message-id": id}},
            }]);
            axum::Json(page(items, next, *logs)).into_response()
        }
        (FailureMode::BadJson, _) => with_body(StatusCode::OK, Body::from(NOT_JSON), None),
        (FailureMode::Drip, _) => {
            let valid = valid_body(asked);
            let every = Duration::from_millis(rule.drip_ms.unwrap_or(DEFAULT_DRIP_MS));
            let length = valid.len();
            with_body(StatusCode::OK, dripped(valid, every), Some(length))
        }
        (FailureMode::ResetMidReply, _) => {
            let valid = valid_body(asked);
            let length = valid.len();
            let half = valid.slice(..length / 2);
            let cut = futures::stream::once(async move { Ok::<_, io::Error>(half) }).chain(
                futures::stream::once(async move {
                    tokio::time::sleep(CUT_AFTER).await;
                    if let Some(cutter) = cutter {
                        cutter.cut();
                    }
                    Err(io::Error::new(
                        io::ErrorKind::ConnectionReset,
                        "cut on purpose mid-reply",
                    ))
                }),
            );
            with_body(StatusCode::OK, Body::from_stream(cut), Some(length))
        }
        (other, _) => error(
            StatusCode::INTERNAL_SERVER_ERROR,
            &format!("{other:?} is not a hostile mode"),
        ),
    }
}

/// A response with `Content-Type: application/json` and, when given, `Content-Length` (else
/// hyper sends a body of unknown length chunked).
fn with_body(status: StatusCode, body: Body, length: Option<usize>) -> Response {
    let mut builder = Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json");
    if let Some(length) = length {
        builder = builder.header(header::CONTENT_LENGTH, length);
    }
    builder
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// `head`, then `filler` again and again, `limit` bytes in all (the last filler cut), or
/// without end; made as it is sent.
fn generated(head: Bytes, filler: Bytes, limit: Option<u64>) -> Body {
    let mut head = Some(head);
    let mut left = limit;
    Body::from_stream(futures::stream::poll_fn(move |_| {
        let mut chunk = head.take().unwrap_or_else(|| filler.clone());
        if let Some(left) = left.as_mut() {
            if *left == 0 {
                return Poll::Ready(None);
            }
            let n = usize::try_from(*left).map_or(chunk.len(), |l| l.min(chunk.len()));
            chunk.truncate(n);
            *left -= n as u64;
        }
        Poll::Ready(Some(Ok::<_, Infallible>(chunk)))
    }))
}

/// `body`, one byte every `every` (the first one too).
fn dripped(body: Bytes, every: Duration) -> Body {
    Body::from_stream(futures::stream::unfold(0, move |at| {
        let byte = (at < body.len()).then(|| body.slice(at..=at));
        async move {
            let byte = byte?;
            tokio::time::sleep(every).await;
            Some((Ok::<_, Infallible>(byte), at + 1))
        }
    }))
}

/// The asked message-id without brackets, or one made up for this domain.
fn message_id_or_made_up(state: &AppState, message_id: Option<&str>) -> String {
    message_id.map_or_else(
        || format!("hostile@{}", state.domain),
        |m| bare(m).to_owned(),
    )
}

/// At least 64 KiB of the same `accepted` item of `message_id`, each followed by a comma.
fn item_block(message_id: &str) -> Bytes {
    let item = json!({
        "id": "hostile-accepted",
        "event": "accepted",
        "timestamp": now(),
        "@timestamp": super::logs::rfc3339(now()),
        "recipient": "flood@example.com",
        "message": {"headers": {"message-id": message_id}},
    });
    let item = format!("{item},");
    Bytes::from(item.repeat(CHUNK / item.len() + 1))
}

/// A page of `items` whose every link is `next`: events' `paging` (URLs) or Logs'
/// `pagination` (tokens).
fn page(items: serde_json::Value, next: &str, logs: bool) -> serde_json::Value {
    let links = json!({ "next": next, "previous": next, "first": next, "last": next });
    if logs {
        json!({ "items": items, "pagination": links })
    } else {
        json!({ "items": items, "paging": links })
    }
}

/// What a well-behaved server would answer (for the modes that spoil only the delivery):
/// `{"id":…,"message":"Queued. Thank you."}`, or an empty events or Logs page.
fn valid_body(asked: &Asked) -> Bytes {
    let value = match asked {
        Asked::Message(message) => json!({ "id": message.id, "message": "Queued. Thank you." }),
        Asked::Events { next, logs, .. } => page(json!([]), next, *logs),
    };
    Bytes::from(value.to_string())
}

/// Resets its connection (instead of closing it) once [`Self::cut`] was called: the handler's
/// side of a [`CuttableStream`], found in the request's [`ConnectInfo`].
#[derive(Debug, Clone)]
pub(crate) struct Cutter(Arc<AtomicBool>);

impl Cutter {
    /// From now on the connection fails every read and write, and is reset when dropped.
    fn cut(&self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

impl Connected<IncomingStream<'_, CuttingListener>> for Cutter {
    fn connect_info(stream: IncomingStream<'_, CuttingListener>) -> Self {
        Self(stream.io().cut.clone())
    }
}

/// The [`Cutter`] of the request's connection, when served by [`super::serve`] (none through
/// [`super::router`] alone).
pub(crate) struct MaybeCutter(pub(crate) Option<Cutter>);

impl<S: Send + Sync> FromRequestParts<S> for MaybeCutter {
    type Rejection = Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        let cutter = parts.extensions.get::<ConnectInfo<Cutter>>();
        Ok(Self(cutter.map(|ConnectInfo(c)| c.clone())))
    }
}

/// A TCP listener whose connections can be reset by their handler.
pub(crate) struct CuttingListener(TcpListener);

impl CuttingListener {
    pub(crate) fn new(listener: TcpListener) -> Self {
        Self(listener)
    }
}

impl Listener for CuttingListener {
    type Io = CuttableStream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            match self.0.accept().await {
                Ok((inner, addr)) => {
                    // Best effort: a socket without NODELAY is only slower (Nagle plus delayed
                    // ACKs add ~40 ms to each keep-alive request).
                    let _ = inner.set_nodelay(true);
                    let cut = Arc::default();
                    return (CuttableStream { inner, cut }, addr);
                }
                // Out of descriptors or a connection gone before it was accepted: wait a
                // little rather than spin.
                Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        self.0.local_addr()
    }
}

/// An accepted connection that, once its [`Cutter`] was used, fails every read and write and
/// is reset when dropped (`SO_LINGER` 0: the close sends an RST and discards what is unsent).
pub(crate) struct CuttableStream {
    inner: TcpStream,
    cut: Arc<AtomicBool>,
}

impl CuttableStream {
    fn is_cut(&self) -> bool {
        self.cut.load(Ordering::SeqCst)
    }
}

fn reset() -> io::Error {
    io::Error::new(io::ErrorKind::ConnectionReset, "cut on purpose")
}

impl AsyncRead for CuttableStream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.is_cut() {
            return Poll::Ready(Err(reset()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl AsyncWrite for CuttableStream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.is_cut() {
            return Poll::Ready(Err(reset()));
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.is_cut() {
            return Poll::Ready(Err(reset()));
        }
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.is_cut() {
            return Poll::Ready(Err(reset()));
        }
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // No FIN before the reset.
        if self.is_cut() {
            return Poll::Ready(Err(reset()));
        }
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl Drop for CuttableStream {
    fn drop(&mut self) {
        if self.is_cut() {
            // Best effort: without it the close is a FIN, still short of the promised length.
            let _ = self.inner.set_zero_linger();
        }
    }
}
