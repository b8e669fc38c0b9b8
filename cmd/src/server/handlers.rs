//! The routes of the process's own endpoints: `/metrics`, the probes, and the webhooks
//! (`/convert`, `/validate`).

use std::sync::{
    Arc,
    atomic::{AtomicBool, Ordering},
};

use axum::{
    Router,
    extract::State,
    response::{IntoResponse, Response},
    routing::get,
};
use http::{StatusCode, header};
use prometheus::{Encoder, Registry, TextEncoder};

use super::text;

/// `GET /metrics`: the registry in Prometheus text format.
pub fn metrics_routes(registry: Registry) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .fallback(super::not_found)
        .with_state(registry)
}

async fn metrics(State(registry): State<Registry>) -> Response {
    let encoder = TextEncoder::new();
    let mut body = Vec::new();
    match encoder.encode(&registry.gather(), &mut body) {
        Ok(()) => (
            [(header::CONTENT_TYPE, encoder.format_type().to_owned())],
            body,
        )
            .into_response(),
        Err(e) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding metrics: {e}\n"),
        ),
    }
}

/// `/healthz` (and `/livez`): the process serves requests. `/readyz`: and it can reach the API
/// server.
pub fn probe_routes(api_reachable: Arc<AtomicBool>) -> Router {
    let ok = || async { text(StatusCode::OK, "ok\n") };
    Router::new()
        .route("/healthz", get(ok))
        .route("/livez", get(ok))
        .route(
            "/readyz",
            get(|State(reachable): State<Arc<AtomicBool>>| async move {
                if reachable.load(Ordering::Relaxed) {
                    text(StatusCode::OK, "ok\n")
                } else {
                    text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "the Kubernetes API server is not reachable\n",
                    )
                }
            }),
        )
        .fallback(super::not_found)
        .with_state(api_reachable)
}
