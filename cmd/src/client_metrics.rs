//! `rest_client_requests_total{code, method, host}`: every answer the API server gave the
//! provider's Kubernetes client, counted the way client-go counts them, so dashboards made for Go
//! managers show this one's API traffic too.
//!
//! A tower layer on the client's service stack: it sees each request's method and the status of
//! its answer (for a watch, the answer's headers: the watch is counted once, when it starts).
//! A request that got no answer (connection refused, TLS, timeout) is counted with code
//! `<error>`, as client-go does. One difference: the layer wraps kube's whole stack, so a request
//! kube's own retry repeats (429, 503, 504) counts once, with its last answer; client-go counts
//! each attempt.

use std::{
    future::Future,
    pin::Pin,
    task::{Context, Poll},
};

use http::{Request, Response};
use prometheus::{IntCounterVec, Opts, Registry};
use tower::{Layer, Service};

/// The layer; one per client, with the host the client talks to.
#[derive(Debug, Clone)]
pub struct RequestCountLayer {
    counter: IntCounterVec,
    host: String,
}

impl RequestCountLayer {
    /// Registers `rest_client_requests_total` in `registry`, for requests to `host` (the API
    /// server's `host:port`, as client-go's label).
    ///
    /// # Errors
    /// When it is already registered.
    pub fn register(registry: &Registry, host: String) -> Result<Self, prometheus::Error> {
        let counter = IntCounterVec::new(
            Opts::new(
                "rest_client_requests_total",
                "Number of HTTP requests, partitioned by status code, method, and host.",
            ),
            &["code", "method", "host"],
        )?;
        registry.register(Box::new(counter.clone()))?;
        Ok(Self { counter, host })
    }
}

impl<S> Layer<S> for RequestCountLayer {
    type Service = RequestCount<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequestCount {
            inner,
            counter: self.counter.clone(),
            host: self.host.clone(),
        }
    }
}

/// The service [`RequestCountLayer`] wraps around the client's stack.
#[derive(Debug, Clone)]
pub struct RequestCount<S> {
    inner: S,
    counter: IntCounterVec,
    host: String,
}

impl<S, B, R> Service<Request<B>> for RequestCount<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let method = req.method().as_str().to_owned();
        let future = self.inner.call(req);
        let counter = self.counter.clone();
        let host = self.host.clone();
        Box::pin(async move {
            let result = future.await;
            let code = match &result {
                Ok(response) => response.status().as_str().to_owned(),
                Err(_) => "<error>".to_owned(),
            };
            counter.with_label_values(&[&code, &method, &host]).inc();
            result
        })
    }
}

/// The `host` label for a cluster URL: `host:port`, the port given or the scheme's.
pub fn host_label(url: &http::Uri) -> String {
    let host = url.host().unwrap_or_default();
    let port = url.port_u16().unwrap_or(match url.scheme_str() {
        Some("http") => 80,
        _ => 443,
    });
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use super::*;

    #[test]
    fn host_labels_carry_the_port() {
        let label = |s: &str| host_label(&s.parse().unwrap());
        assert_eq!(label("https://10.0.0.1"), "10.0.0.1:443");
        assert_eq!(label("https://127.0.0.1:6443"), "127.0.0.1:6443");
        assert_eq!(label("http://localhost"), "localhost:80");
    }

    #[tokio::test]
    async fn answers_and_failures_are_counted_by_code_and_method() {
        let registry = Registry::new();
        let layer = RequestCountLayer::register(&registry, "api:6443".into()).unwrap();
        let mut answering = layer.layer(tower::service_fn(|req: Request<()>| async move {
            let status = if req.uri().path() == "/missing" {
                404
            } else {
                200
            };
            let mut response = Response::new(());
            *response.status_mut() = http::StatusCode::from_u16(status).unwrap();
            Ok::<_, Infallible>(response)
        }));
        for (method, path) in [("GET", "/a"), ("GET", "/missing"), ("PATCH", "/a")] {
            let req = Request::builder()
                .method(method)
                .uri(path)
                .body(())
                .unwrap();
            answering.call(req).await.unwrap();
        }
        let mut failing = layer.layer(tower::service_fn(|_: Request<()>| async move {
            Err::<Response<()>, _>("connection refused")
        }));
        assert!(failing.call(Request::new(())).await.is_err());
        let count = |code: &str, method: &str| {
            layer
                .counter
                .with_label_values(&[code, method, "api:6443"])
                .get()
        };
        assert_eq!(count("200", "GET"), 1);
        assert_eq!(count("404", "GET"), 1);
        assert_eq!(count("200", "PATCH"), 1);
        assert_eq!(count("<error>", "GET"), 1);
    }
}
