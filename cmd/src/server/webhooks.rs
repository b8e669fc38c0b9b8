//! The webhooks' routes: `/convert` (CRD conversion) and `/validate` (admission of writes made
//! through `v1alpha1`), their logic in `capm_api` on kube's `ConversionReview` and
//! `AdmissionReview`; each counted and timed by [`super::webhook_metrics`].

use axum::{
    Router,
    body::Bytes,
    response::{IntoResponse, Response},
    routing::post,
};
use capm_api::{admission, webhook};
use http::{StatusCode, header};

use super::{
    text,
    webhook_metrics::{WebhookMetrics, instrumented},
};

/// The two webhooks, POST only, their answers counted in `metrics`.
pub fn webhook_routes(metrics: WebhookMetrics) -> Router {
    let only_post = |name: &'static str| {
        move || async move {
            text(
                StatusCode::METHOD_NOT_ALLOWED,
                format!("the {name} webhook takes POST\n"),
            )
        }
    };
    Router::new()
        .route(
            webhook::CONVERT_PATH,
            post(|body: Bytes| async move { answer(webhook::review_json(&body)) })
                .fallback(only_post("conversion")),
        )
        .route(
            admission::VALIDATE_PATH,
            post(|body: Bytes| async move { answer(admission::review_json(&body)) })
                .fallback(only_post("admission")),
        )
        .route_layer(axum::middleware::from_fn_with_state(metrics, instrumented))
        .fallback(super::not_found)
}

/// 200 with the answer review, or 400 naming what the body is not.
fn answer<E: std::fmt::Display>(review: Result<Vec<u8>, E>) -> Response {
    match review {
        Ok(json) => ([(header::CONTENT_TYPE, "application/json")], json).into_response(),
        Err(e) => text(StatusCode::BAD_REQUEST, e.to_string()),
    }
}
