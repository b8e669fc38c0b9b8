//! The validating admission webhook for writes made through `v1alpha1`.
//!
//! The API server checks an object only against the schema of the version the request was made
//! in. A write through `v1alpha1` is checked against the `v1alpha1` schema and then converted
//! ([`crate::conversion`]), so whatever the conversion restores from the
//! [`CONVERSION_DATA_ANNOTATION`] (the control plane endpoint, the identity, the failure domain,
//! addresses) would otherwise reach storage without meeting a single `v1beta1` rule.
//!
//! The manager binary serves [`review_json`]; the chart registers it (at [`VALIDATE_PATH`]) for `v1beta1` only, with
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

use kube::core::{
    DynamicObject, Status,
    admission::{
        AdmissionRequest, AdmissionResponse, AdmissionReview, META_API_VERSION_V1, META_KIND,
        Operation,
    },
};
use serde::de::DeserializeOwned;
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

/// Why a write was refused, in the API server's `Status` shape.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Refusal {
    /// HTTP-like code shown to the client (422 for invalid objects, 400 for bad requests).
    code: u16,
    /// `Invalid` or `BadRequest`.
    reason: &'static str,
    /// What is wrong, naming each field by its JSON path.
    message: String,
}

fn bad_request(message: impl Into<String>) -> Refusal {
    Refusal {
        code: 400,
        reason: "BadRequest",
        message: message.into(),
    }
}

fn decode<T: DeserializeOwned>(what: &str, value: Option<&DynamicObject>) -> Result<T, Refusal> {
    let value = value.ok_or_else(|| bad_request(format!("the request has no {what}")))?;
    serde_json::to_value(value)
        .and_then(serde_json::from_value)
        .map_err(|e| bad_request(format!("{what} does not decode as v1beta1: {e}")))
}

/// An object of the request as JSON (`Null` when absent).
fn json(object: Option<&DynamicObject>) -> Value {
    object
        .and_then(|o| serde_json::to_value(o).ok())
        .unwrap_or(Value::Null)
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
    request: &AdmissionRequest<DynamicObject>,
) -> Result<Vec<String>, Refusal> {
    let new: T = decode("object", request.object.as_ref())?;
    let errors: Vec<FieldError> = match &request.operation {
        Operation::Create => new.validate(),
        Operation::Update => {
            let old: T = decode("oldObject", request.old_object.as_ref())?;
            T::validate_update(&old, &new)
        }
        other => {
            // As the API server spells it (`DELETE`, `CONNECT`).
            let name = serde_json::to_value(other).unwrap_or(Value::Null);
            return Err(bad_request(format!(
                "operation {} is not handled",
                name.as_str().unwrap_or("?")
            )));
        }
    };
    Ok(errors.iter().map(ToString::to_string).collect())
}

/// Decides one request (see the [module docs](self)): allowed, or refused with a `Status`
/// whose code is 422 (`Invalid`, the fields named by their JSON paths) or 400 (`BadRequest`).
pub fn decide(request: &AdmissionRequest<DynamicObject>) -> AdmissionResponse {
    let refusal = match refuse(request) {
        Ok(messages) if messages.is_empty() => None,
        Ok(messages) => Some(Refusal {
            code: 422,
            reason: "Invalid",
            message: messages.join("; "),
        }),
        Err(refusal) => Some(refusal),
    };
    let mut response = AdmissionResponse::from(request);
    if let Some(refusal) = refusal {
        response.allowed = false;
        response.result = Status::failure(&refusal.message, refusal.reason).with_code(refusal.code);
    }
    response
}

fn refuse(request: &AdmissionRequest<DynamicObject>) -> Result<Vec<String>, Refusal> {
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
            .metadata
            .annotations
            .as_ref()
            .is_some_and(|a| a.contains_key(CONVERSION_DATA_ANNOTATION))
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
        && request.operation == Operation::Update
        && request.object.is_some()
        && request.old_object.is_some()
    {
        let (new, old) = (
            json(request.object.as_ref()),
            json(request.old_object.as_ref()),
        );
        for ((path, new), (_, old)) in beta_only(kind, &new).into_iter().zip(beta_only(kind, &old))
        {
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

/// Why a request body was not a usable `AdmissionReview`.
#[derive(Debug, thiserror::Error)]
pub enum AdmissionError {
    /// The body is not an `admission.k8s.io/v1` `AdmissionReview` with a request.
    #[error("the body is not an admission.k8s.io/v1 AdmissionReview request: {0}")]
    Decode(String),
}

/// Parses a request body, decides, and encodes the response review.
///
/// # Errors
/// When the body is not an `admission.k8s.io/v1` `AdmissionReview` with a request.
pub fn review_json(body: &[u8]) -> Result<Vec<u8>, AdmissionError> {
    let review: AdmissionReview<DynamicObject> =
        serde_json::from_slice(body).map_err(|e| AdmissionError::Decode(e.to_string()))?;
    if review.types.api_version != META_API_VERSION_V1 || review.types.kind != META_KIND {
        return Err(AdmissionError::Decode(format!(
            "apiVersion {} kind {}",
            review.types.api_version, review.types.kind
        )));
    }
    // The request carries the review's apiVersion and kind, which the response echoes.
    let request: AdmissionRequest<DynamicObject> = review
        .try_into()
        .map_err(|_| AdmissionError::Decode("no request".into()))?;
    serde_json::to_vec(&decide(&request).into_review())
        .map_err(|e| AdmissionError::Decode(e.to_string()))
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

    /// A request as the API server sends it (`resource` and `userInfo` included).
    fn request(
        operation: &str,
        via: &str,
        object: Value,
        old: Option<Value>,
    ) -> AdmissionRequest<DynamicObject> {
        serde_json::from_value(json!({
            "uid": "u-1",
            "kind": {"group": crate::GROUP, "version": "v1beta1", "kind": "MailgunCluster"},
            "resource": {"group": crate::GROUP, "version": "v1beta1", "resource": "mailgunclusters"},
            "requestKind": {"group": crate::GROUP, "version": via, "kind": "MailgunCluster"},
            "operation": operation,
            "userInfo": {"username": "tester"},
            "object": object,
            "oldObject": old,
        }))
        .expect("request")
    }

    /// The refusal's message and code; `None` when allowed.
    fn refusal(response: &AdmissionResponse) -> Option<(String, u16)> {
        (!response.allowed).then(|| (response.result.message.clone(), response.result.code))
    }

    #[test]
    fn set_once_and_v1beta1_rules_apply_to_writes_through_v1alpha1() {
        let set = cluster(Some(json!({"host": "api.example.com", "port": 6443})));
        let changed = cluster(Some(json!({"host": "api.evil.example", "port": 1})));
        let verdict = decide(&request("UPDATE", "v1alpha1", changed, Some(set.clone())));
        let message = refusal(&verdict).expect("refused").0;
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
            refusal(&decide(&request(
                "UPDATE",
                "v1alpha1",
                removed,
                Some(set.clone())
            )))
            .is_some()
        );

        let bad = cluster(Some(
            json!({"host": "bad host\r\nBcc: x@evil.example", "port": 0}),
        ));
        let message = refusal(&decide(&request("CREATE", "v1alpha1", bad, None)))
            .expect("refused")
            .0;
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
            refusal(&decide(&request(
                "UPDATE",
                "v1alpha1",
                set.clone(),
                Some(set.clone())
            ))),
            None
        );
        assert_eq!(
            refusal(&decide(&request("CREATE", "v1alpha1", set, None))),
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
            let message = refusal(&verdict).expect(what).0;
            assert!(
                message.contains("spec.identityRef: Forbidden")
                    && message.contains("cannot be changed through v1alpha1"),
                "{what}: {message}"
            );
        }
        // Kept, through v1alpha1; changed, through v1beta1; set at creation through v1alpha1.
        let kept = with_ref(Some("team-a"));
        assert_eq!(
            refusal(&decide(&request(
                "UPDATE",
                "v1alpha1",
                kept.clone(),
                Some(kept.clone())
            ))),
            None
        );
        assert_eq!(
            refusal(&decide(&request(
                "UPDATE",
                "v1beta1",
                with_ref(None),
                Some(kept.clone())
            ))),
            None
        );
        assert_eq!(
            refusal(&decide(&request("CREATE", "v1alpha1", kept, None))),
            None
        );
    }

    #[test]
    fn the_answer_is_an_admission_review_with_the_requests_uid_and_a_status() {
        let bad = cluster(Some(json!({"host": "bad host", "port": 0})));
        let review = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": request("CREATE", "v1alpha1", bad, None),
        });
        let answer: Value =
            serde_json::from_slice(&review_json(review.to_string().as_bytes()).expect("answered"))
                .expect("JSON");
        assert_eq!(answer["apiVersion"], "admission.k8s.io/v1", "{answer}");
        assert_eq!(answer["kind"], "AdmissionReview", "{answer}");
        let response = &answer["response"];
        assert_eq!(response["uid"], "u-1", "{answer}");
        assert_eq!(response["allowed"], false, "{answer}");
        assert_eq!(response["status"]["code"], 422, "{answer}");
        assert_eq!(response["status"]["reason"], "Invalid", "{answer}");
        let message = response["status"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("spec.controlPlaneEndpoint.port"),
            "{answer}"
        );

        let good = cluster(Some(json!({"host": "api.example.com", "port": 6443})));
        let review = json!({
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": request("CREATE", "v1alpha1", good, None),
        });
        let answer: Value =
            serde_json::from_slice(&review_json(review.to_string().as_bytes()).expect("answered"))
                .expect("JSON");
        assert_eq!(answer["response"]["allowed"], true, "{answer}");
        assert_eq!(answer["response"]["uid"], "u-1", "{answer}");
    }

    #[test]
    fn unexpected_requests_are_refused_not_waved_through() {
        let mut r = request("CREATE", "v1alpha1", cluster(None), None);
        r.kind.version = "v1alpha1".into();
        assert_eq!(refusal(&decide(&r)).expect("refused").1, 400);
        let mut r = request("CREATE", "v1alpha1", cluster(None), None);
        r.kind.kind = "Secret".into();
        assert_eq!(refusal(&decide(&r)).expect("refused").1, 400);
        let mut r = request("UPDATE", "v1alpha1", cluster(None), None);
        r.old_object = None;
        assert_eq!(refusal(&decide(&r)).expect("refused").1, 400);
        let mut r = request("DELETE", "v1alpha1", cluster(None), None);
        r.old_object = None;
        let (message, code) = refusal(&decide(&r)).expect("refused");
        assert_eq!(
            (message.as_str(), code),
            ("operation DELETE is not handled", 400)
        );
        assert!(review_json(b"{}").is_err());
        assert!(review_json(br#"{"apiVersion":"admission.k8s.io/v1beta1","kind":"AdmissionReview","request":{}}"#).is_err());
    }
}
