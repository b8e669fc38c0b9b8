//! The webhooks' metrics, by webhook path, as controller-runtime exports them.

use axum::{
    extract::{MatchedPath, Request, State},
    middleware::Next,
    response::Response,
};
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

/// The webhook series controller-runtime exports, by webhook path (`/convert`, `/validate`):
///
/// - `controller_runtime_webhook_requests_total{code, webhook}`: answers by HTTP status code;
/// - `controller_runtime_webhook_latency_seconds{webhook}`: time to answer a request whose body
///   has been read (a histogram with Prometheus's default buckets, as controller-runtime's);
/// - `controller_runtime_webhook_requests_in_flight{webhook}`.
///
/// Only the two paths are labelled (any client can send any path; others are 404s and not
/// counted), and requests the server's [`Limits`](super::Limits) refused are counted in
/// `capm_http_rejected_total` instead. A denial or a failed conversion is an answer with status
/// 200, as in controller-runtime.
#[derive(Debug, Clone)]
pub struct WebhookMetrics {
    requests: IntCounterVec,
    latency: HistogramVec,
    in_flight: IntGaugeVec,
}

impl WebhookMetrics {
    /// Creates the series and registers them in `registry`.
    ///
    /// # Errors
    /// When one is already registered.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let requests = IntCounterVec::new(
            Opts::new(
                "controller_runtime_webhook_requests_total",
                "Total number of admission requests by HTTP status code.",
            ),
            &["code", "webhook"],
        )?;
        let latency = HistogramVec::new(
            HistogramOpts::new(
                "controller_runtime_webhook_latency_seconds",
                "Histogram of the latency of processing admission requests",
            ),
            &["webhook"],
        )?;
        let in_flight = IntGaugeVec::new(
            Opts::new(
                "controller_runtime_webhook_requests_in_flight",
                "Current number of admission requests being served.",
            ),
            &["webhook"],
        )?;
        registry.register(Box::new(requests.clone()))?;
        registry.register(Box::new(latency.clone()))?;
        registry.register(Box::new(in_flight.clone()))?;
        Ok(Self {
            requests,
            latency,
            in_flight,
        })
    }
}

/// One request in flight; leaves the gauge when dropped (also when the client goes away and
/// the request's future is dropped).
struct InFlight(prometheus::IntGauge);

impl InFlight {
    fn enter(gauge: prometheus::IntGauge) -> Self {
        gauge.inc();
        Self(gauge)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The middleware of the webhooks' routes (`route_layer`: only the two paths are labelled):
/// counts and times each answer by the route's path.
pub async fn instrumented(
    State(metrics): State<WebhookMetrics>,
    path: MatchedPath,
    req: Request,
    next: Next,
) -> Response {
    let webhook = path.as_str();
    let in_flight = InFlight::enter(metrics.in_flight.with_label_values(&[webhook]));
    let timer = metrics.latency.with_label_values(&[webhook]).start_timer();
    let response = next.run(req).await;
    timer.observe_duration();
    drop(in_flight);
    metrics
        .requests
        .with_label_values(&[response.status().as_str(), webhook])
        .inc();
    response
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use http::{Method, StatusCode};
    use prometheus::{Encoder, TextEncoder};
    use tower::ServiceExt;

    use super::*;

    #[tokio::test]
    async fn webhook_answers_are_counted_and_timed_by_path() {
        let registry = Registry::new();
        let metrics = WebhookMetrics::register(&registry).unwrap();
        let routes = crate::server::webhooks::webhook_routes(metrics.clone());
        let handler = |req: http::Request<Body>| routes.clone().oneshot(req);
        let request = |method: Method, path: &str| {
            http::Request::builder()
                .method(method)
                .uri(path)
                .body(Body::from("{}"))
                .unwrap()
        };
        let convert = capm_api::webhook::CONVERT_PATH;
        assert_eq!(
            handler(request(Method::GET, convert))
                .await
                .unwrap()
                .status(),
            StatusCode::METHOD_NOT_ALLOWED
        );
        let bad = handler(request(Method::POST, convert))
            .await
            .unwrap()
            .status();
        assert_eq!(bad, StatusCode::BAD_REQUEST);
        assert_eq!(
            handler(request(Method::POST, "/anything"))
                .await
                .unwrap()
                .status(),
            StatusCode::NOT_FOUND
        );
        let requests =
            |code: &str, webhook: &str| metrics.requests.with_label_values(&[code, webhook]).get();
        assert_eq!(requests("405", convert), 1);
        assert_eq!(requests("400", convert), 1);
        let exposition = {
            let mut out = Vec::new();
            TextEncoder::new()
                .encode(&registry.gather(), &mut out)
                .unwrap();
            String::from_utf8(out).unwrap()
        };
        assert!(!exposition.contains("/anything"), "{exposition}");
        assert!(
            exposition.contains(&format!(
                "controller_runtime_webhook_latency_seconds_count{{webhook=\"{convert}\"}} 2"
            )),
            "{exposition}"
        );
        assert!(
            exposition.contains(&format!(
                "controller_runtime_webhook_requests_in_flight{{webhook=\"{convert}\"}} 0"
            )),
            "{exposition}"
        );
    }
}
