//! The three HTTP endpoints: `/metrics`, the probes `/healthz` + `/readyz`, and the webhooks
//! (conversion and admission) over TLS. Each stops accepting when shutdown is requested and lets open requests
//! finish.

use std::{
    convert::Infallible,
    future::Future,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::{body::Incoming, service::service_fn};
use hyper_util::rt::{TokioIo, TokioTimer};
use prometheus::{Encoder, Registry, TextEncoder};
use tokio::{
    io::{AsyncRead, AsyncWrite},
    net::TcpListener,
    task::JoinHandle,
};
use tokio_rustls::TlsAcceptor;
use tracing::{debug, info, warn};

use crate::shutdown::Shutdown;

/// Slow clients get this long to send their request headers or finish a TLS handshake.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// A plain-text response.
pub fn text(status: StatusCode, body: impl Into<Bytes>) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// Binds `address`.
///
/// # Errors
/// When the address cannot be bound (in use, not local, no permission).
pub async fn bind(what: &str, address: SocketAddr) -> anyhow::Result<TcpListener> {
    let listener = TcpListener::bind(address)
        .await
        .map_err(|e| anyhow::anyhow!("binding the {what} address {address}: {e}"))?;
    info!(%address, "serving {what}");
    Ok(listener)
}

/// Serves one connection until it ends or shutdown asks it to close.
async fn connection<S, F, Fut>(io: S, handler: F, mut shutdown: Shutdown)
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    let service = service_fn(move |req| {
        let handler = handler.clone();
        async move { Ok::<_, Infallible>(handler(req).await) }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_TIMEOUT)
        .serve_connection(TokioIo::new(io), service);
    tokio::pin!(conn);
    tokio::select! {
        result = conn.as_mut() => {
            if let Err(e) = result {
                debug!(error = %e, "connection ended with an error");
            }
        }
        () = shutdown.wait() => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

/// Accepts connections on `listener` until shutdown, with TLS when `tls` is given.
pub fn serve<F, Fut>(
    listener: TcpListener,
    tls: Option<TlsAcceptor>,
    handler: F,
    shutdown: Shutdown,
) -> JoinHandle<()>
where
    F: Fn(Request<Incoming>) -> Fut + Send + Sync + Clone + 'static,
    Fut: Future<Output = Response<Full<Bytes>>> + Send + 'static,
{
    tokio::spawn(async move {
        let mut stop = shutdown.clone();
        loop {
            let (tcp, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(pair) => pair,
                    Err(e) => {
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
                () = stop.wait() => break,
            };
            let _ = tcp.set_nodelay(true);
            let handler = handler.clone();
            let shutdown = shutdown.clone();
            let tls = tls.clone();
            tokio::spawn(async move {
                match tls {
                    None => connection(tcp, handler, shutdown).await,
                    Some(acceptor) => {
                        match tokio::time::timeout(HEADER_TIMEOUT, acceptor.accept(tcp)).await {
                            Ok(Ok(stream)) => connection(stream, handler, shutdown).await,
                            Ok(Err(e)) => debug!(%peer, error = %e, "TLS handshake failed"),
                            Err(_) => debug!(%peer, "TLS handshake timed out"),
                        }
                    }
                }
            });
        }
    })
}

/// `GET /metrics`: the registry in Prometheus text format.
pub fn metrics_handler(
    registry: Registry,
) -> impl Fn(Request<Incoming>) -> std::future::Ready<Response<Full<Bytes>>>
+ Send
+ Sync
+ Clone
+ 'static {
    move |req| {
        std::future::ready(if req.uri().path() != "/metrics" {
            text(StatusCode::NOT_FOUND, "not found\n")
        } else if req.method() != Method::GET && req.method() != Method::HEAD {
            text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n")
        } else {
            let encoder = TextEncoder::new();
            let mut body = Vec::new();
            match encoder.encode(&registry.gather(), &mut body) {
                Ok(()) => {
                    let mut response = Response::new(Full::new(Bytes::from(body)));
                    if let Ok(value) = header::HeaderValue::from_str(encoder.format_type()) {
                        response.headers_mut().insert(header::CONTENT_TYPE, value);
                    }
                    response
                }
                Err(e) => text(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("encoding metrics: {e}\n"),
                ),
            }
        })
    }
}

/// `/healthz`: the process serves requests. `/readyz`: and it can reach the API server.
pub fn probe_handler(
    api_reachable: Arc<AtomicBool>,
) -> impl Fn(Request<Incoming>) -> std::future::Ready<Response<Full<Bytes>>>
+ Send
+ Sync
+ Clone
+ 'static {
    move |req| {
        std::future::ready(match req.uri().path() {
            "/healthz" | "/livez" => text(StatusCode::OK, "ok\n"),
            "/readyz" if api_reachable.load(Ordering::Relaxed) => text(StatusCode::OK, "ok\n"),
            "/readyz" => text(
                StatusCode::SERVICE_UNAVAILABLE,
                "the Kubernetes API server is not reachable\n",
            ),
            _ => text(StatusCode::NOT_FOUND, "not found\n"),
        })
    }
}

/// The conversion webhook at `/convert`, the admission webhook for writes through `v1alpha1`
/// at `/validate`.
pub async fn webhook_handler(req: Request<Incoming>) -> Response<Full<Bytes>> {
    match req.uri().path() {
        capm_api::webhook::CONVERT_PATH => capm_api::webhook::handle(req).await,
        capm_api::admission::VALIDATE_PATH => capm_api::admission::handle(req).await,
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}
