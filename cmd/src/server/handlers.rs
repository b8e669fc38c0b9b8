//! The handlers of the process's own endpoints: `/metrics`, the probes, and the webhooks'
//! routing (`/convert`, `/validate`).

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use bytes::Bytes;
use http::{Method, Response, StatusCode, header};
use http_body_util::Full;
use prometheus::{Encoder, Registry, TextEncoder};

use super::{Req, text};

/// `GET /metrics`: the registry in Prometheus text format.
pub fn metrics_handler(
    registry: Registry,
) -> impl Fn(Req) -> std::future::Ready<Response<Full<Bytes>>> + Send + Sync + Clone + 'static {
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
) -> impl Fn(Req) -> std::future::Ready<Response<Full<Bytes>>> + Send + Sync + Clone + 'static {
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
pub async fn webhook_handler(req: Req) -> Response<Full<Bytes>> {
    match req.uri().path() {
        capm_api::webhook::CONVERT_PATH => capm_api::webhook::handle(req).await,
        capm_api::admission::VALIDATE_PATH => capm_api::admission::handle(req).await,
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}
