//! The HTTP servers: the accept loop and the limits every endpoint is served within (`/metrics`,
//! the probes `/healthz` + `/readyz`, the webhooks over TLS, and the fulfilment page,
//! `crate::fulfil`), each an axum [`Router`] served by [`serve`] until its cancellation token
//! fires (open requests then finish). The endpoints' routes are in [`handlers`], the webhooks'
//! metrics in [`webhook_metrics`]; `crate::manager` starts them.
//!
//! Any Pod that can reach a port is a client, so every server reads within [`Limits`], applied
//! while reading: open connections (past the cap a new one is closed at once, so descriptors
//! stay for the API server and the mail relay), requests in flight and body bytes buffered
//! across them (past either, a fast 503), one request's body (413 on its `Content-Length`,
//! before reading, or once it grows past), and time: TLS handshake and request headers within
//! [`HEADER_TIMEOUT`] (hyper's header timer also runs while a kept-alive connection waits for
//! its next request, so idle connections close after it), the body within [`BODY_TIMEOUT`].
//! The request limits are tower and tower-http layers around the router (load shedding over a
//! concurrency limit, the body limit, the body deadline); the connection cap and the header
//! deadline are the accept loop's serve options, since a layer sees requests, not connections.
//! The client's address is in every request's extensions as axum's [`ConnectInfo`].

use std::{convert::Infallible, future::Future, net::SocketAddr, sync::Arc, time::Duration};

use axum::{Router, body::Body, extract::ConnectInfo};
use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::{BodyExt, LengthLimitError};
use hyper::body::Incoming;
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    service::TowerToHyperService,
};
use prometheus::{IntCounterVec, Registry};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpListener,
    sync::{OwnedSemaphorePermit, Semaphore},
    task::JoinHandle,
};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::{
    BoxError, Service, ServiceBuilder, ServiceExt, limit::GlobalConcurrencyLimitLayer, service_fn,
};
use tower_http::{
    body::Limited,
    limit::{RequestBodyLimitLayer, ResponseBody},
    timeout::{DeadlineBody, RequestBodyDeadlineLayer, TimeoutError},
};
use tracing::{debug, info, warn};

pub mod handlers;
pub mod webhook_metrics;
pub mod webhooks;

/// Slow clients get this long to finish a TLS handshake, or to send their request headers (or,
/// on a kept-alive connection, to start the next request).
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(10);
/// A request's body must arrive within this long.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(10);
/// The body budget is counted in units of this many bytes.
const BUDGET_UNIT: usize = 1024;

/// What the servers answer with.
pub type Answer = Response<Body>;

/// What one server's requests may take at once (the connection cap is the manager's, the same
/// for every server). See the module documentation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Requests being handled at once (those past it get 503).
    pub max_in_flight: usize,
    /// One request's body (past it: 413).
    pub max_body_bytes: usize,
    /// Body bytes buffered across all requests in flight (past it: 503).
    pub body_budget_bytes: usize,
}

impl Limits {
    /// Probes and metrics: GETs without bodies.
    pub fn plain() -> Self {
        Self {
            max_in_flight: 64,
            max_body_bytes: 64 * 1024,
            body_budget_bytes: 1024 * 1024,
        }
    }

    /// The fulfilment page: forms of a few fields (16 KiB is generous), from people.
    pub fn page() -> Self {
        Self {
            max_in_flight: 32,
            max_body_bytes: 16 * 1024,
            body_budget_bytes: 256 * 1024,
        }
    }

    /// The webhooks: the largest review either webhook takes, and room for two of them.
    pub fn webhooks() -> Self {
        let max_body_bytes =
            capm_api::webhook::MAX_REVIEW_BYTES.max(capm_api::admission::MAX_REVIEW_BYTES);
        Self {
            max_in_flight: 32,
            max_body_bytes,
            body_budget_bytes: 2 * max_body_bytes,
        }
    }

    /// `router`, to be served within these limits.
    pub fn on(self, router: Router) -> Endpoint {
        Endpoint {
            router,
            limits: self,
        }
    }
}

/// A router and the limits it is served within.
#[derive(Debug, Clone)]
pub struct Endpoint {
    router: Router,
    limits: Limits,
}

/// Descriptors kept out of the servers' connection caps: the API server's connections and
/// watches, the mail relay's pool, files, the runtime's own.
const RESERVED_DESCRIPTORS: u64 = 256;

/// Raises this process's soft limit of open files to its hard limit (as the Go runtime does at
/// start) and returns the soft limit in force, or the error and the unchanged limit.
pub fn raise_open_files_limit() -> (u64, Option<std::io::Error>) {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let soft = limit.current.unwrap_or(u64::MAX);
    if limit.current == limit.maximum {
        return (soft, None);
    }
    match setrlimit(
        Resource::Nofile,
        Rlimit {
            current: limit.maximum,
            maximum: limit.maximum,
        },
    ) {
        Ok(()) => (limit.maximum.unwrap_or(u64::MAX), None),
        Err(e) => (soft, Some(e.into())),
    }
}

/// Each of `servers` servers' connection cap with `open_files` descriptors: an equal share of
/// what [`RESERVED_DESCRIPTORS`] leaves, between 16 and 1024.
pub fn connection_cap(open_files: u64, servers: u64) -> usize {
    let share = open_files.saturating_sub(RESERVED_DESCRIPTORS) / servers.max(1);
    usize::try_from(share.clamp(16, 1024)).unwrap_or(1024)
}

/// `capm_http_rejected_total{server, reason}`: connections and requests refused by [`Limits`]
/// (`connections`, `in_flight`, `budget`, `too_large`, `body_timeout`, `body_error`).
///
/// # Errors
/// When it is already registered.
pub fn rejected_counter(registry: &Registry) -> Result<IntCounterVec, prometheus::Error> {
    let counter = IntCounterVec::new(
        prometheus::Opts::new(
            "capm_http_rejected_total",
            "Connections and requests refused by a server's limits, by reason",
        ),
        &["server", "reason"],
    )?;
    registry.register(Box::new(counter.clone()))?;
    Ok(counter)
}

/// Why a server refused a connection or a request: the `reason` label of
/// `capm_http_rejected_total`, and the answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rejection {
    /// Past the connection cap: closed as soon as accepted.
    Connections,
    /// Past `max_in_flight`: 503.
    InFlight,
    /// Past `body_budget_bytes`: 503.
    Budget,
    /// Past `max_body_bytes`: 413.
    TooLarge,
    /// The body did not arrive within [`BODY_TIMEOUT`]: 408.
    BodyTimeout,
    /// The body could not be read: 400.
    BodyError,
}

impl Rejection {
    fn label(self) -> &'static str {
        match self {
            Self::Connections => "connections",
            Self::InFlight => "in_flight",
            Self::Budget => "budget",
            Self::TooLarge => "too_large",
            Self::BodyTimeout => "body_timeout",
            Self::BodyError => "body_error",
        }
    }

    /// The answer, marked with `self` for the counting layer.
    fn response(self, limits: &Limits) -> Answer {
        let busy = |what: &str| {
            let mut response = text(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("too many {what} at once; try again\n"),
            );
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
            response
        };
        let mut response = match self {
            Self::Connections | Self::InFlight => busy("requests"),
            Self::Budget => busy("request bytes"),
            Self::TooLarge => text(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body exceeds {} bytes\n", limits.max_body_bytes),
            ),
            Self::BodyTimeout => text(
                StatusCode::REQUEST_TIMEOUT,
                format!("the body did not arrive within {BODY_TIMEOUT:?}\n"),
            ),
            Self::BodyError => text(StatusCode::BAD_REQUEST, "the body could not be read\n"),
        };
        response.extensions_mut().insert(self);
        response
    }
}

/// One server's request stack, outermost first: every refusal counted by its [`Rejection`];
/// past `max_in_flight` a 503 at once (tower's load shedding over one concurrency limit shared
/// by all connections); a body declared or growing past `max_body_bytes` refused with 413
/// (tower-http's limit), the whole body due within [`BODY_TIMEOUT`] (tower-http's deadline);
/// then the body read against the budget shared by the requests in flight, and the router.
fn stack(
    name: &'static str,
    endpoint: Endpoint,
    rejected: IntCounterVec,
) -> impl Service<
    Request<Incoming>,
    Response = Answer,
    Error = BoxError,
    Future = impl Future<Output = Result<Answer, BoxError>> + Send,
> + Clone
+ Send
+ 'static {
    let Endpoint { router, limits } = endpoint;
    let budget = Arc::new(Semaphore::new(
        limits.body_budget_bytes.div_ceil(BUDGET_UNIT),
    ));
    // The body read whole, its share of the budget held until the router has answered.
    let collect = service_fn(move |req: Request<DeadlineBody<Limited<Incoming>>>| {
        let (router, budget) = (router.clone(), Arc::clone(&budget));
        async move {
            let (parts, body) = req.into_parts();
            Ok::<_, Infallible>(match read(body, &budget).await {
                Ok((bytes, held)) => {
                    let request = Request::from_parts(parts, Body::from(bytes));
                    let Ok(response) = router.oneshot(request).await;
                    drop(held);
                    response
                }
                Err(rejection) => rejection.response(&limits),
            })
        }
    });
    ServiceBuilder::new()
        .map_response(move |response: Answer| {
            if let Some(rejection) = response.extensions().get::<Rejection>() {
                rejected.with_label_values(&[name, rejection.label()]).inc();
            }
            response
        })
        .map_result(move |result: Result<Answer, BoxError>| {
            // Never an error: a refusal is an answer (hyper would close the connection).
            Ok::<_, BoxError>(match result {
                Ok(response) => response,
                // `Overloaded`: the only error below (every other answer is a response).
                Err(_) => Rejection::InFlight.response(&limits),
            })
        })
        .load_shed()
        .layer(GlobalConcurrencyLimitLayer::new(limits.max_in_flight))
        .map_response(move |response: Response<ResponseBody<Body>>| {
            // tower-http answers a declared Content-Length past the limit itself, unmarked.
            if response.status() == StatusCode::PAYLOAD_TOO_LARGE
                && response.extensions().get::<Rejection>().is_none()
            {
                Rejection::TooLarge.response(&limits)
            } else {
                response.map(Body::new)
            }
        })
        .layer(RequestBodyLimitLayer::new(limits.max_body_bytes))
        .layer(RequestBodyDeadlineLayer::new(BODY_TIMEOUT))
        .service(collect)
}

/// Reads `body` whole, taking its bytes from `budget` as they arrive.
async fn read<B>(
    body: B,
    budget: &Arc<Semaphore>,
) -> Result<(Bytes, Vec<OwnedSemaphorePermit>), Rejection>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    let mut body = std::pin::pin!(body);
    let mut bytes =
        Vec::with_capacity(usize::try_from(body.size_hint().exact().unwrap_or(0)).unwrap_or(0));
    let mut held = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            let e: BoxError = e.into();
            if e.is::<LengthLimitError>() {
                Rejection::TooLarge
            } else if e.is::<TimeoutError>() {
                Rejection::BodyTimeout
            } else {
                Rejection::BodyError
            }
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        let units =
            u32::try_from(data.len().div_ceil(BUDGET_UNIT)).map_err(|_| Rejection::TooLarge)?;
        if units > 0 {
            held.push(
                Arc::clone(budget)
                    .try_acquire_many_owned(units)
                    .map_err(|_| Rejection::Budget)?,
            );
        }
        bytes.extend_from_slice(&data);
    }
    Ok((Bytes::from(bytes), held))
}

/// A plain-text response.
pub fn text(status: StatusCode, body: impl Into<String>) -> Answer {
    let mut response = Response::new(Body::from(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Every router's answer to a path it does not serve.
pub async fn not_found() -> Answer {
    text(StatusCode::NOT_FOUND, "not found\n")
}

/// Binds `address`.
///
/// # Errors
/// When the address cannot be bound (in use, not local, no permission).
pub async fn bind(what: &str, address: SocketAddr) -> anyhow::Result<TcpListener> {
    let listener = TcpListener::bind(address)
        .await
        .map_err(|e| anyhow::anyhow!("binding the {what} address {address}: {e}"))?;
    info!(%address, "Serving {what}");
    Ok(listener)
}

/// Serves one connection until it ends or `stop` asks it to close.
async fn connection<IO, S>(io: IO, service: S, stop: CancellationToken)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: Service<Request<Incoming>, Response = Answer, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(TokioIo::new(io), TowerToHyperService::new(service));
    tokio::pin!(conn);
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(e) = result {
                debug!(error = %e, "Connection ended with an error");
            }
        }
        () = stop.cancelled() => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

/// One server: its name (a metric label), listener, TLS, and connection cap.
pub struct Server {
    /// `webhook`, `diagnostics`, `probes` or `fulfilment`.
    pub name: &'static str,
    /// The bound listener.
    pub listener: TcpListener,
    /// TLS, when served over it.
    pub tls: Option<TlsAcceptor>,
    /// Open connections (those past it are closed as soon as accepted).
    pub max_connections: usize,
    /// `capm_http_rejected_total`.
    pub rejected: IntCounterVec,
}

/// Accepts connections until `stop`, each within the server's cap and the endpoint's
/// [`Limits`].
pub fn serve(server: Server, endpoint: Endpoint, stop: CancellationToken) -> JoinHandle<()> {
    let Server {
        name,
        listener,
        tls,
        max_connections,
        rejected,
    } = server;
    let connections = Arc::new(Semaphore::new(max_connections));
    let service = stack(name, endpoint, rejected.clone());
    tokio::spawn(async move {
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(pair) => pair,
                    Err(e) => {
                        warn!(error = %e, "Accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                () = stop.cancelled() => break,
            };
            // Past the cap the connection is closed at once: waiting clients would hold their
            // descriptors in the backlog, and closing is the fastest answer.
            let Ok(permit) = Arc::clone(&connections).try_acquire_owned() else {
                rejected
                    .with_label_values(&[name, Rejection::Connections.label()])
                    .inc();
                drop(tcp);
                continue;
            };
            let _ = tcp.set_nodelay(true);
            let service = service
                .clone()
                .map_request(move |mut req: Request<Incoming>| {
                    req.extensions_mut().insert(ConnectInfo(peer));
                    req
                });
            let stop = stop.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                let _permit = permit;
                match tls {
                    None => connection(tcp, service, stop).await,
                    Some(acceptor) => {
                        match tokio::time::timeout(HEADER_TIMEOUT, acceptor.accept(tcp)).await {
                            Ok(Ok(stream)) => connection(stream, service, stop).await,
                            Ok(Err(e)) => debug!(%peer, error = %e, "TLS handshake failed"),
                            Err(_) => debug!(%peer, "TLS handshake timed out"),
                        }
                    }
                }
            });
        }
    })
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    #[test]
    fn connection_caps_share_what_the_reserve_leaves() {
        assert_eq!(connection_cap(1024, 3), 256);
        assert_eq!(connection_cap(1_048_576, 3), 1024);
        assert_eq!(connection_cap(100, 3), 16);
    }

    /// A server with small limits whose handler waits `hold` before answering.
    async fn small_server(hold: Duration) -> (SocketAddr, IntCounterVec, CancellationToken) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let registry = Registry::new();
        let rejected = rejected_counter(&registry).unwrap();
        let stop = CancellationToken::new();
        let limits = Limits {
            max_in_flight: 1,
            max_body_bytes: 4096,
            body_budget_bytes: 4096,
        };
        let router = Router::new().fallback(move |body: Bytes| async move {
            tokio::time::sleep(hold).await;
            text(StatusCode::OK, format!("{} bytes\n", body.len()))
        });
        serve(
            Server {
                name: "test",
                listener,
                tls: None,
                max_connections: 3,
                rejected: rejected.clone(),
            },
            limits.on(router),
            stop.clone(),
        );
        (addr, rejected, stop)
    }

    /// Sends `head` and `body`, returns the status line (or the error) and how long it took.
    async fn exchange(addr: SocketAddr, head: &str, body: &[u8]) -> String {
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = tcp.write_all(head.as_bytes()).await;
        let _ = tcp.write_all(body).await;
        let mut answer = vec![0; 256];
        match tokio::time::timeout(Duration::from_secs(15), tcp.read(&mut answer)).await {
            Ok(Ok(n)) => String::from_utf8_lossy(&answer[..n])
                .lines()
                .next()
                .unwrap_or("(closed)")
                .to_owned(),
            Ok(Err(e)) => format!("error: {e}"),
            Err(_) => "no answer".into(),
        }
    }

    fn post(len: usize) -> String {
        format!("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {len}\r\nConnection: close\r\n\r\n")
    }

    #[tokio::test]
    async fn bodies_are_bounded_before_and_while_reading() {
        let (addr, rejected, _stop) = small_server(Duration::ZERO).await;
        assert_eq!(
            exchange(addr, &post(10), b"0123456789").await,
            "HTTP/1.1 200 OK"
        );
        // Declared too large: answered before a byte of the body is read.
        let started = Instant::now();
        assert_eq!(
            exchange(addr, &post(1 << 30), b"").await,
            "HTTP/1.1 413 Payload Too Large"
        );
        assert!(started.elapsed() < Duration::from_secs(5));
        // Chunked, growing past the limit while read.
        let chunk = format!("{:x}\r\n{}\r\n", 3000, "x".repeat(3000));
        let chunked = "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert_eq!(
            exchange(addr, chunked, format!("{chunk}{chunk}").as_bytes()).await,
            "HTTP/1.1 413 Payload Too Large"
        );
        assert_eq!(rejected.with_label_values(&["test", "too_large"]).get(), 2);
    }

    #[tokio::test]
    async fn past_the_caps_answers_are_fast() {
        let (addr, rejected, _stop) = small_server(Duration::from_secs(2)).await;
        // One request in flight holds the only slot; the next gets 503 at once.
        let first = tokio::spawn(async move { exchange(addr, &post(1), b"x").await });
        tokio::time::sleep(Duration::from_millis(300)).await;
        let started = Instant::now();
        assert_eq!(
            exchange(addr, &post(1), b"x").await,
            "HTTP/1.1 503 Service Unavailable"
        );
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(first.await.unwrap(), "HTTP/1.1 200 OK");
        assert_eq!(rejected.with_label_values(&["test", "in_flight"]).get(), 1);

        // Three idle connections fill the cap; a fourth is closed as soon as it is accepted.
        let mut idle = Vec::new();
        for _ in 0..3 {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        let mut fourth = tokio::net::TcpStream::connect(addr).await.unwrap();
        let mut byte = [0u8; 1];
        let closed = tokio::time::timeout(Duration::from_secs(2), fourth.read(&mut byte)).await;
        assert!(matches!(closed, Ok(Ok(0) | Err(_))), "{closed:?}");
        assert!(rejected.with_label_values(&["test", "connections"]).get() >= 1);
    }

    #[tokio::test]
    async fn an_idle_kept_alive_connection_is_closed_after_the_header_timeout() {
        let (addr, _rejected, _stop) = small_server(Duration::ZERO).await;
        let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
        tcp.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut answer = vec![0; 256];
        let n = tcp.read(&mut answer).await.unwrap();
        assert!(answer[..n].starts_with(b"HTTP/1.1 200 OK"));
        // Kept alive, then idle: closed once the next request's headers are overdue.
        let started = Instant::now();
        let closed = tokio::time::timeout(HEADER_TIMEOUT * 2, tcp.read(&mut answer)).await;
        assert!(matches!(closed, Ok(Ok(0) | Err(_))), "{closed:?}");
        assert!(started.elapsed() >= HEADER_TIMEOUT - Duration::from_secs(1));
    }

    #[tokio::test]
    async fn a_body_that_does_not_arrive_times_out() {
        let (addr, rejected, _stop) = small_server(Duration::ZERO).await;
        let started = Instant::now();
        assert_eq!(
            exchange(addr, &post(100), b"x").await,
            "HTTP/1.1 408 Request Timeout"
        );
        assert!(started.elapsed() >= BODY_TIMEOUT);
        assert_eq!(
            rejected.with_label_values(&["test", "body_timeout"]).get(),
            1
        );
    }
}
