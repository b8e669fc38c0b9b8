//! The validating admission webhook for writes made through `v1alpha1`.
//!
//! The API server checks an object only against the schema of the version the request was made
//! in. A write through `v1alpha1` is checked against the `v1alpha1` schema and then converted
//! ([`crate::conversion`]), so whatever the conversion restores from the
//! [`CONVERSION_DATA_ANNOTATION`] (the control plane endpoint, the identity, the failure domain,
//! addresses) would otherwise reach storage without meeting a single `v1beta1` rule.
//!
//! The chart registers [`review_json`] (at [`VALIDATE_PATH`]) for `v1beta1` only, with
//! `matchPolicy: Equivalent`, so the API server sends the converted `v1beta1` object and the
//! stored one, and with a `matchConditions` expression that limits it to requests made through
//! `v1alpha1`: `v1beta1` traffic never depends on the webhook. For those requests it:
//! - runs every `v1beta1` rule ([`Validate::validate`], and [`Validate::validate_update`]
//!   against the old object: immutable and set-once fields included);
//! - refuses, on update, any change to a field `v1alpha1` does not have: such a field can only
//!   change through a tampered annotation, since a `v1alpha1` client cannot see it.
//!
//! Anything else (another version, a kind or operation it does not handle, a request it cannot
//! decode) is refused with a message saying why: with `failurePolicy: Fail` a refusal is safer
//! than letting an unchecked object through.
//!
//! # Caveats
//! Status is not checked here: the annotation no longer carries status, so what a `v1alpha1`
//! write can put into status is what the `v1alpha1` schema admits (`ready`, `response`).

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::Value;

use crate::{
    STORAGE_VERSION,
    names::CONVERSION_DATA_ANNOTATION,
    v1beta1::{MailgunCluster, MailgunClusterTemplate, MailgunMachine, MailgunMachineTemplate},
    validation::{FieldError, Validate},
};

/// The path the chart registers the webhook at.
pub const VALIDATE_PATH: &str = "/validate";

/// Largest request body accepted: an `AdmissionReview` carries two objects, each within the API
/// server's request limit (3 MiB).
pub const MAX_REVIEW_BYTES: usize = 8 * 1024 * 1024;

/// Group, version and kind as an `AdmissionRequest` names them.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
pub struct Gvk {
    /// API group.
    #[serde(default)]
    pub group: String,
    /// Version.
    #[serde(default)]
    pub version: String,
    /// Kind.
    #[serde(default)]
    pub kind: String,
}

/// The fields of an `admission.k8s.io/v1` `AdmissionRequest` this webhook reads.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AdmissionRequest {
    /// Echoed in the response.
    pub uid: String,
    /// The kind of `object`: with `matchPolicy: Equivalent`, the converted version.
    pub kind: Gvk,
    /// The kind the client used.
    #[serde(default)]
    pub request_kind: Option<Gvk>,
    /// `status` for the status subresource.
    #[serde(default)]
    pub sub_resource: Option<String>,
    /// CREATE, UPDATE, DELETE or CONNECT.
    pub operation: String,
    /// The new object (absent on DELETE).
    #[serde(default)]
    pub object: Option<Value>,
    /// The stored object (UPDATE and DELETE).
    #[serde(default)]
    pub old_object: Option<Value>,
}

/// The review as the API server sends it.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct IncomingReview {
    api_version: String,
    kind: String,
    request: Option<AdmissionRequest>,
}

/// Why a write was refused, in the API server's `Status` shape.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Refusal {
    /// HTTP-like code shown to the client (422 for invalid objects, 400 for bad requests).
    pub code: u16,
    /// `Invalid` or `BadRequest`.
    pub reason: &'static str,
    /// What is wrong, naming each field by its JSON path.
    pub message: String,
}

/// The answer: allowed, or refused with a [`Refusal`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// The request's uid.
    pub uid: String,
    /// `None` when allowed.
    pub refusal: Option<Refusal>,
}

impl Verdict {
    /// The `AdmissionReview` response JSON.
    pub fn to_review(&self) -> Value {
        let mut response =
            serde_json::json!({ "uid": self.uid, "allowed": self.refusal.is_none() });
        if let Some(refusal) = &self.refusal {
            response["status"] = serde_json::json!({
                "code": refusal.code,
                "reason": refusal.reason,
                "message": refusal.message,
            });
        }
        serde_json::json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "response": response,
        })
    }
}

fn bad_request(message: impl Into<String>) -> Refusal {
    Refusal {
        code: 400,
        reason: "BadRequest",
        message: message.into(),
    }
}

fn decode<T: DeserializeOwned>(what: &str, value: Option<&Value>) -> Result<T, Refusal> {
    let value = value.ok_or_else(|| bad_request(format!("the request has no {what}")))?;
    serde_json::from_value(value.clone())
        .map_err(|e| bad_request(format!("{what} does not decode as v1beta1: {e}")))
}

/// `(path, value)` of the fields `v1alpha1` cannot represent, per kind.
fn beta_only(kind: &str, object: &Value) -> Vec<(&'static str, Value)> {
    let at = |pointer: &str| object.pointer(pointer).cloned().unwrap_or(Value::Null);
    match kind {
        "MailgunCluster" => vec![
            (
                "spec.controlPlaneEndpoint",
                at("/spec/controlPlaneEndpoint"),
            ),
            ("spec.identityRef", at("/spec/identityRef")),
        ],
        "MailgunMachine" => vec![
            ("spec.failureDomain", at("/spec/failureDomain")),
            ("spec.addresses", at("/spec/addresses")),
        ],
        "MailgunClusterTemplate" => vec![
            (
                "spec.template.spec.controlPlaneEndpoint",
                at("/spec/template/spec/controlPlaneEndpoint"),
            ),
            (
                "spec.template.spec.identityRef",
                at("/spec/template/spec/identityRef"),
            ),
        ],
        "MailgunMachineTemplate" => vec![
            (
                "spec.template.spec.failureDomain",
                at("/spec/template/spec/failureDomain"),
            ),
            (
                "spec.template.spec.addresses",
                at("/spec/template/spec/addresses"),
            ),
        ],
        _ => Vec::new(),
    }
}

fn check<T: Validate + DeserializeOwned>(
    request: &AdmissionRequest,
) -> Result<Vec<String>, Refusal> {
    let new: T = decode("object", request.object.as_ref())?;
    let errors: Vec<FieldError> = match request.operation.as_str() {
        "CREATE" => new.validate(),
        "UPDATE" => {
            let old: T = decode("oldObject", request.old_object.as_ref())?;
            T::validate_update(&old, &new)
        }
        other => return Err(bad_request(format!("operation {other} is not handled"))),
    };
    Ok(errors.iter().map(ToString::to_string).collect())
}

/// Decides one request (see the [module docs](self)).
pub fn decide(request: &AdmissionRequest) -> Verdict {
    let refusal = match refuse(request) {
        Ok(messages) if messages.is_empty() => None,
        Ok(messages) => Some(Refusal {
            code: 422,
            reason: "Invalid",
            message: messages.join("; "),
        }),
        Err(refusal) => Some(refusal),
    };
    Verdict {
        uid: request.uid.clone(),
        refusal,
    }
}

fn refuse(request: &AdmissionRequest) -> Result<Vec<String>, Refusal> {
    if request.kind.group != crate::GROUP || request.kind.version != STORAGE_VERSION {
        return Err(bad_request(format!(
            "expected an object of {}/{} (matchPolicy: Equivalent), got {}/{}",
            crate::GROUP,
            STORAGE_VERSION,
            request.kind.group,
            request.kind.version
        )));
    }
    if request
        .sub_resource
        .as_deref()
        .is_some_and(|s| !s.is_empty())
    {
        return Err(bad_request("subresources are not handled"));
    }
    let kind = request.kind.kind.as_str();
    let mut messages = match kind {
        "MailgunCluster" => check::<MailgunCluster>(request)?,
        "MailgunMachine" => check::<MailgunMachine>(request)?,
        "MailgunClusterTemplate" => check::<MailgunClusterTemplate>(request)?,
        "MailgunMachineTemplate" => check::<MailgunMachineTemplate>(request)?,
        other => return Err(bad_request(format!("kind {other} is not handled"))),
    };
    if let Some(object) = &request.object
        && object
            .pointer("/metadata/annotations")
            .and_then(|a| a.get(CONVERSION_DATA_ANNOTATION))
            .is_some()
    {
        messages.push(format!(
            "metadata.annotations[{CONVERSION_DATA_ANNOTATION}]: Forbidden: written and read by \
             the conversion webhook only"
        ));
    }
    let through_alpha = request
        .request_kind
        .as_ref()
        .is_some_and(|k| k.version != STORAGE_VERSION);
    if through_alpha
        && request.operation == "UPDATE"
        && let (Some(new), Some(old)) = (&request.object, &request.old_object)
    {
        for ((path, new), (_, old)) in beta_only(kind, new).into_iter().zip(beta_only(kind, old)) {
            if new != old {
                messages.push(format!(
                    "{path}: Forbidden: cannot be changed through {}, which does not have this \
                     field (only through its {CONVERSION_DATA_ANNOTATION} annotation, which is \
                     not for editing); change it through {STORAGE_VERSION}",
                    request
                        .request_kind
                        .as_ref()
                        .map_or("v1alpha1", |k| k.version.as_str()),
                ));
            }
        }
    }
    Ok(messages)
}

/// Why an HTTP request was not a usable `AdmissionReview`.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    /// The request was not a POST.
    #[error("method {0} not allowed: the admission webhook takes POST")]
    Method(Method),
    /// The body could not be read, or exceeded [`MAX_REVIEW_BYTES`].
    #[error("reading the request body: {0}")]
    Body(String),
    /// The body is not an `admission.k8s.io/v1` `AdmissionReview` with a request.
    #[error("the body is not an admission.k8s.io/v1 AdmissionReview request: {0}")]
    Decode(String),
}

impl crate::webhook::ReviewError for AdmissionError {
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

/// Parses a request body, decides, and encodes the response review.
///
/// # Errors
/// When the body is not an `admission.k8s.io/v1` `AdmissionReview` with a request.
pub fn review_json(body: &[u8]) -> Result<Vec<u8>, AdmissionError> {
    let review: IncomingReview =
        serde_json::from_slice(body).map_err(|e| AdmissionError::Decode(e.to_string()))?;
    if review.api_version != "admission.k8s.io/v1" || review.kind != "AdmissionReview" {
        return Err(AdmissionError::Decode(format!(
            "apiVersion {} kind {}",
            review.api_version, review.kind
        )));
    }
    let request = review
        .request
        .ok_or_else(|| AdmissionError::Decode("no request".into()))?;
    serde_json::to_vec(&decide(&request).to_review())
        .map_err(|e| AdmissionError::Decode(e.to_string()))
}

/// Serves one HTTP request: an `AdmissionReview` JSON body in, the verdict out.
///
/// Answers 200 with the review (refusals are inside it), 405 for anything but POST, 413 for a
/// body over [`MAX_REVIEW_BYTES`], 400 for a body that is not an `AdmissionReview` request;
/// error bodies are plain text.
pub async fn handle<B>(req: Request<B>) -> Response<Full<Bytes>>
where
    B: http_body::Body,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    crate::webhook::serve(req, MAX_REVIEW_BYTES, review_json).await
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn cluster(endpoint: Option<Value>) -> Value {
        let mut spec = json!({"priority": "Urgent", "request": "r", "requester": "a@b.co"});
        if let Some(e) = endpoint {
            spec["controlPlaneEndpoint"] = e;
        }
        json!({"apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunCluster",
               "metadata": {"name": "c"}, "spec": spec})
    }

    fn request(operation: &str, via: &str, object: Value, old: Option<Value>) -> AdmissionRequest {
        serde_json::from_value(json!({
            "uid": "u-1",
            "kind": {"group": crate::GROUP, "version": "v1beta1", "kind": "MailgunCluster"},
            "requestKind": {"group": crate::GROUP, "version": via, "kind": "MailgunCluster"},
            "operation": operation,
            "object": object,
            "oldObject": old,
        }))
        .expect("request")
    }

    #[test]
    fn set_once_and_v1beta1_rules_apply_to_writes_through_v1alpha1() {
        let set = cluster(Some(json!({"host": "api.example.com", "port": 6443})));
        let changed = cluster(Some(json!({"host": "api.evil.example", "port": 1})));
        let verdict = decide(&request("UPDATE", "v1alpha1", changed, Some(set.clone())));
        let message = verdict.refusal.expect("refused").message;
        assert!(
            message
                .contains("spec.controlPlaneEndpoint: Forbidden: controlPlaneEndpoint is set-once"),
            "{message}"
        );
        assert!(
            message.contains("cannot be changed through v1alpha1"),
            "{message}"
        );

        let removed = cluster(None);
        assert!(
            decide(&request("UPDATE", "v1alpha1", removed, Some(set.clone())))
                .refusal
                .is_some()
        );

        let bad = cluster(Some(
            json!({"host": "bad host\r\nBcc: x@evil.example", "port": 0}),
        ));
        let message = decide(&request("CREATE", "v1alpha1", bad, None))
            .refusal
            .expect("refused")
            .message;
        assert!(
            message.contains("spec.controlPlaneEndpoint.host"),
            "{message}"
        );
        assert!(
            message.contains("spec.controlPlaneEndpoint.port"),
            "{message}"
        );

        // Unchanged, and a valid create: allowed.
        assert_eq!(
            decide(&request(
                "UPDATE",
                "v1alpha1",
                set.clone(),
                Some(set.clone())
            ))
            .refusal,
            None
        );
        assert_eq!(
            decide(&request("CREATE", "v1alpha1", set, None)).refusal,
            None
        );
    }

    #[test]
    fn identity_ref_cannot_change_through_v1alpha1() {
        let with_ref = |name: Option<&str>| {
            let mut c = cluster(None);
            if let Some(name) = name {
                c["spec"]["identityRef"] = json!({"kind": "MailgunClusterIdentity", "name": name});
            }
            c
        };
        for (what, old, new) in [
            ("dropped", Some("team-a"), None),
            ("changed", Some("team-a"), Some("team-b")),
            ("added", None, Some("team-b")),
        ] {
            let verdict = decide(&request(
                "UPDATE",
                "v1alpha1",
                with_ref(new),
                Some(with_ref(old)),
            ));
            let message = verdict.refusal.expect(what).message;
            assert!(
                message.contains("spec.identityRef: Forbidden")
                    && message.contains("cannot be changed through v1alpha1"),
                "{what}: {message}"
            );
        }
        // Kept, through v1alpha1; changed, through v1beta1; set at creation through v1alpha1.
        let kept = with_ref(Some("team-a"));
        assert_eq!(
            decide(&request(
                "UPDATE",
                "v1alpha1",
                kept.clone(),
                Some(kept.clone())
            ))
            .refusal,
            None
        );
        assert_eq!(
            decide(&request(
                "UPDATE",
                "v1beta1",
                with_ref(None),
                Some(kept.clone())
            ))
            .refusal,
            None
        );
        assert_eq!(
            decide(&request("CREATE", "v1alpha1", kept, None)).refusal,
            None
        );
    }

    #[test]
    fn unexpected_requests_are_refused_not_waved_through() {
        let mut r = request("CREATE", "v1alpha1", cluster(None), None);
        r.kind.version = "v1alpha1".into();
        assert_eq!(decide(&r).refusal.expect("refused").code, 400);
        let mut r = request("CREATE", "v1alpha1", cluster(None), None);
        r.kind.kind = "Secret".into();
        assert_eq!(decide(&r).refusal.expect("refused").code, 400);
        let mut r = request("UPDATE", "v1alpha1", cluster(None), None);
        r.old_object = None;
        assert_eq!(decide(&r).refusal.expect("refused").code, 400);
        assert!(review_json(b"{}").is_err());
        assert!(review_json(br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{}}"#).is_err());
    }
}
