//! The CRD conversion webhook's logic: a pure [`review`] function on kube's `ConversionReview`,
//! and [`review_json`] from a request body to the answer's. The manager binary serves it, behind
//! TLS, at [`CONVERT_PATH`]; the CRDs must point at it: see
//! [`crate::crd::with_webhook_conversion`].
//!
//! ```
//! let answer = capm_api::webhook::review_json(br#"{"apiVersion":"apiextensions.k8s.io/v1",
//!     "kind":"ConversionReview","request":{"uid":"u","desiredAPIVersion":
//!     "infrastructure.cluster.x-k8s.io/v1beta1","objects":[]}}"#).unwrap();
//! assert!(String::from_utf8(answer).unwrap().contains("\"Success\""));
//! ```

use kube::core::{
    Status,
    conversion::{ConversionRequest, ConversionResponse, ConversionReview},
};

use crate::conversion::convert;

/// The path the webhook is served at.
pub const CONVERT_PATH: &str = "/convert";

/// Largest request body accepted. The API server converts a whole list response in one review:
/// a finished MailgunCluster is about 4.3 KB of JSON with its managedFields, so this takes an
/// unpaged list of about 1 900 objects read through a version other than the stored one (a page
/// of kubectl's default 500 is about 2.1 MB). Larger lists must be paged (`--chunk-size`).
/// Chosen so that two reviews at once, parsed, stay within the chart's memory limit.
pub const MAX_REVIEW_BYTES: usize = 8 * 1024 * 1024;

/// Why a request body was not a usable `ConversionReview`.
#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
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
