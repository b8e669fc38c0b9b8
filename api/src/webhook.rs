//! The CRD conversion webhook: a pure [`review`] function and an HTTP [`handle`]r around it.
//!
//! The handler is framework-neutral (`http::Request` in, `http::Response` out), so the manager
//! binary can mount it in a hyper `service_fn` or an axum route, behind TLS, at [`CONVERT_PATH`].
//! The CRDs must point at it: see [`crate::crd::with_webhook_conversion`].
//!
//! ```no_run
//! # async fn f(req: http::Request<http_body_util::Full<bytes::Bytes>>) {
//! let response = capm_api::webhook::handle(req).await;
//! assert_eq!(response.status(), http::StatusCode::OK);
//! # }
//! ```

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use kube::core::{
    Status,
    conversion::{ConversionRequest, ConversionResponse, ConversionReview},
};

use crate::conversion::convert;

/// The path the webhook is conventionally served at (the handler itself answers on any path).
pub const CONVERT_PATH: &str = "/convert";

/// Largest request body accepted. The API server converts a whole list response in one review:
/// a finished MailgunCluster is about 4.3 KB of JSON with its managedFields, so this takes an
/// unpaged list of about 1 900 objects read through a version other than the stored one (a page
/// of kubectl's default 500 is about 2.1 MB). Larger lists must be paged (`--chunk-size`).
/// Chosen so that two reviews at once, parsed, stay within the chart's memory limit.
pub const MAX_REVIEW_BYTES: usize = 8 * 1024 * 1024;

/// Why an HTTP request was not a usable `ConversionReview`.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    /// The request was not a POST.
    #[error("method {0} not allowed: the conversion webhook takes POST")]
    Method(Method),
    /// The body could not be read, or exceeded [`MAX_REVIEW_BYTES`].
    #[error("reading the request body: {0}")]
    Body(String),
    /// The body is not a `ConversionReview` with a request.
    #[error("the body is not a ConversionReview request: {0}")]
    Decode(String),
}

/// Converts every object of a `ConversionReview` request and returns the response review.
///
/// All objects convert or none do: on the first failure the response carries a `Failure`
/// status naming the object, and no objects (as the API server requires).
pub fn review(review: ConversionReview) -> ConversionReview {
    let request = match ConversionRequest::from_review(review) {
        Ok(request) => request,
        Err(e) => {
            return ConversionResponse::invalid(Status::failure(&e.to_string(), "BadRequest"))
                .into_review();
        }
    };
    let desired = request.desired_api_version.clone();
    let objects = request.objects.clone();
    let response = ConversionResponse::for_request(request);
    let mut converted = Vec::with_capacity(objects.len());
    for (i, object) in objects.into_iter().enumerate() {
        let name = describe(&object);
        match convert(object, &desired) {
            Ok(object) => converted.push(object),
            Err(e) => {
                let message = format!("converting object {i} ({name}) to {desired}: {e}");
                return response
                    .failure(Status::failure(&message, "ConversionFailed"))
                    .into_review();
            }
        }
    }
    response.success(converted).into_review()
}

fn describe(object: &serde_json::Value) -> String {
    let field = |path: &[&str]| {
        path.iter()
            .try_fold(object, |v, key| v.get(key))
            .and_then(serde_json::Value::as_str)
            .unwrap_or("?")
            .to_owned()
    };
    format!(
        "{} {}/{}",
        field(&["kind"]),
        field(&["metadata", "namespace"]),
        field(&["metadata", "name"])
    )
}

/// Parses a request body, runs [`review`], and encodes the answer.
///
/// # Errors
/// When the body is not a `ConversionReview` with a request.
pub fn review_json(body: &[u8]) -> Result<Vec<u8>, WebhookError> {
    let parsed: ConversionReview =
        serde_json::from_slice(body).map_err(|e| WebhookError::Decode(e.to_string()))?;
    if parsed.types.api_version != "apiextensions.k8s.io/v1"
        || parsed.types.kind != "ConversionReview"
    {
        return Err(WebhookError::Decode(format!(
            "apiVersion {:?} kind {:?} (expected apiextensions.k8s.io/v1 ConversionReview)",
            parsed.types.api_version, parsed.types.kind
        )));
    }
    if parsed.request.is_none() {
        return Err(WebhookError::Decode("no request".into()));
    }
    serde_json::to_vec(&review(parsed)).map_err(|e| WebhookError::Decode(e.to_string()))
}

/// What a webhook's errors must offer for [`serve`]: build the two transport failures and say
/// which HTTP status each error gets.
pub(crate) trait ReviewError: std::fmt::Display {
    /// The request was not a POST.
    fn method(method: Method) -> Self;
    /// The body could not be read, or exceeded the webhook's limit.
    fn body(detail: String) -> Self;
    /// The HTTP status the error is answered with.
    fn status_code(&self) -> StatusCode;
}

impl ReviewError for WebhookError {
    fn method(method: Method) -> Self {
        Self::Method(method)
    }
    fn body(detail: String) -> Self {
        Self::Body(detail)
    }
    fn status_code(&self) -> StatusCode {
        match self {
            Self::Method(_) => StatusCode::METHOD_NOT_ALLOWED,
            Self::Body(_) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Decode(_) => StatusCode::BAD_REQUEST,
        }
    }
}

/// Serves one webhook request: a POSTed JSON review of at most `max_bytes` in, `review_json`'s
/// answer out (200, JSON), or the error as plain text with its status. Shared by the conversion
/// and admission webhooks.
pub(crate) async fn serve<B, E>(
    req: Request<B>,
    max_bytes: usize,
    review_json: impl FnOnce(&[u8]) -> Result<Vec<u8>, E>,
) -> Response<Full<Bytes>>
where
    B: http_body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    E: ReviewError,
{
    let answer = async {
        if req.method() != Method::POST {
            return Err(E::method(req.method().clone()));
        }
        let body = Limited::new(req.into_body(), max_bytes)
            .collect()
            .await
            .map_err(|e| E::body(e.to_string()))?
            .to_bytes();
        review_json(&body)
    };
    let (status, content_type, body) = match answer.await {
        Ok(body) => (StatusCode::OK, "application/json", body),
        Err(e) => (
            e.status_code(),
            "text/plain; charset=utf-8",
            e.to_string().into_bytes(),
        ),
    };
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    if let Ok(value) = header::HeaderValue::from_str(content_type) {
        response.headers_mut().insert(header::CONTENT_TYPE, value);
    }
    response
}

/// Serves one HTTP request: a `ConversionReview` JSON body in, the converted review out.
///
/// Answers 200 with the review (conversion failures are reported inside it, as the API server
/// expects), 405 for anything but POST, 413 for a body over [`MAX_REVIEW_BYTES`], 400 for a body
/// that is not a `ConversionReview` request; error bodies are plain text.
pub async fn handle<B>(req: Request<B>) -> Response<Full<Bytes>>
where
    B: http_body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    serve(req, MAX_REVIEW_BYTES, review_json).await
}
