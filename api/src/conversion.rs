//! Lossless conversion between [`crate::v1alpha1`] and [`crate::v1beta1`].
//!
//! `v1beta1` is the hub (the storage version). Going down to `v1alpha1`, the spec fields that
//! version cannot hold (the control plane endpoint, the failure domain, spec addresses) are
//! written as JSON to the [`CONVERSION_DATA_ANNOTATION`] annotation; going up, the annotation is
//! read, removed, and those fields restored.
//!
//! The annotation never carries status: anyone who may write the object may write the
//! annotation, and status is the controller's. Status converts up from what `v1alpha1` holds
//! (`ready`, `response`) and nothing else, so a write through `v1alpha1` leaves the rest of the
//! `v1beta1` status (conditions, mail state) empty until the controller, which rebuilds status
//! from metadata, writes it again. Restored spec fields are checked against every `v1beta1` rule,
//! and refused when they differ from the stored object, by the admission webhook
//! ([`crate::admission`]).
//!
//! The conversions are plain [`From`] implementations on the typed objects; [`convert`] does the
//! same on the JSON objects a `ConversionReview` carries (see [`crate::webhook`]).
//!
//! # Caveats
//! An annotation that is not valid JSON of the expected shape (someone edited it by hand) is
//! dropped: conversion never fails because of it, the fields it held are lost (and the admission
//! webhook refuses the write if that changes a stored field). A `status` key in it, written by an
//! earlier version of this provider or by hand, is ignored.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::Value;

use crate::{GROUP, names::CONVERSION_DATA_ANNOTATION, v1alpha1 as a, v1beta1 as b};

/// Why an object in a `ConversionReview` could not be converted.
#[derive(Debug, thiserror::Error)]
pub enum ConversionError {
    /// The object lacks `apiVersion` or `kind`.
    #[error("object has no {0}")]
    MissingField(&'static str),
    /// The object or the desired version belongs to another API group.
    #[error("API version {0} is not in group {GROUP}")]
    WrongGroup(String),
    /// A version this provider does not serve.
    #[error("unknown version {0} (served: v1alpha1, v1beta1)")]
    UnknownVersion(String),
    /// A kind this provider does not serve.
    #[error("unknown kind {0}")]
    UnknownKind(String),
    /// The object does not match its declared version's schema.
    #[error("decoding {kind} {api_version}: {source}")]
    Decode {
        /// The object's kind.
        kind: String,
        /// The object's apiVersion.
        api_version: String,
        /// What serde reported.
        #[source]
        source: serde_json::Error,
    },
    /// The converted object could not be encoded (a bug).
    #[error("encoding the converted object: {0}")]
    Encode(#[source] serde_json::Error),
}

/// What `v1alpha1` cannot hold, as stored in [`CONVERSION_DATA_ANNOTATION`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ConversionData {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    control_plane_endpoint: Option<b::ApiEndpoint>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    failure_domain: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    addresses: Option<Vec<b::MachineAddress>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    identity_ref: Option<b::IdentityReference>,
}

/// Removes the annotation and returns what it held (default when absent or unreadable).
fn take_data(meta: &mut ObjectMeta) -> ConversionData {
    let Some(annotations) = meta.annotations.as_mut() else {
        return ConversionData::default();
    };
    let Some(raw) = annotations.remove(CONVERSION_DATA_ANNOTATION) else {
        return ConversionData::default();
    };
    if annotations.is_empty() {
        meta.annotations = None;
    }
    serde_json::from_str(&raw).unwrap_or_default()
}

/// Writes the annotation, replacing a stale one; writes nothing when nothing would be lost.
fn put_data(meta: &mut ObjectMeta, data: &ConversionData) {
    if let Some(annotations) = meta.annotations.as_mut()
        && annotations.remove(CONVERSION_DATA_ANNOTATION).is_some()
        && annotations.is_empty()
    {
        meta.annotations = None;
    }
    if *data == ConversionData::default() {
        return;
    }
    if let Ok(json) = serde_json::to_string(data) {
        meta.annotations
            .get_or_insert_with(BTreeMap::new)
            .insert(CONVERSION_DATA_ANNOTATION.to_owned(), json);
    }
}

impl From<a::Priority> for b::Priority {
    fn from(p: a::Priority) -> Self {
        match p {
            a::Priority::Urgent => Self::Urgent,
            a::Priority::ExtremelyUrgent => Self::ExtremelyUrgent,
            a::Priority::BusinessCritical => Self::BusinessCritical,
        }
    }
}

impl From<b::Priority> for a::Priority {
    fn from(p: b::Priority) -> Self {
        match p {
            b::Priority::Urgent => Self::Urgent,
            b::Priority::ExtremelyUrgent => Self::ExtremelyUrgent,
            b::Priority::BusinessCritical => Self::BusinessCritical,
        }
    }
}

impl From<a::TemplateMetadata> for b::TemplateMetadata {
    fn from(m: a::TemplateMetadata) -> Self {
        Self {
            labels: m.labels,
            annotations: m.annotations,
        }
    }
}

impl From<b::TemplateMetadata> for a::TemplateMetadata {
    fn from(m: b::TemplateMetadata) -> Self {
        Self {
            labels: m.labels,
            annotations: m.annotations,
        }
    }
}

fn provisioned(init: Option<&b::Initialization>) -> bool {
    init.and_then(|i| i.provisioned).unwrap_or(false)
}

fn cluster_status_down(s: &b::MailgunClusterStatus) -> a::MailgunClusterStatus {
    a::MailgunClusterStatus {
        response: s.mail.as_ref().and_then(|m| m.message_id.clone()),
        ready: provisioned(s.initialization.as_ref()),
    }
}

fn cluster_status_up(s: &a::MailgunClusterStatus) -> b::MailgunClusterStatus {
    b::MailgunClusterStatus {
        initialization: Some(b::Initialization {
            provisioned: Some(s.ready),
        }),
        mail: s.response.clone().map(|id| b::MailStatus {
            message_id: Some(id),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn machine_status_down(s: &b::MailgunMachineStatus) -> a::MailgunMachineStatus {
    a::MailgunMachineStatus {
        ready: provisioned(s.initialization.as_ref()),
    }
}

fn machine_status_up(s: &a::MailgunMachineStatus) -> b::MailgunMachineStatus {
    b::MailgunMachineStatus {
        initialization: Some(b::Initialization {
            provisioned: Some(s.ready),
        }),
        ..Default::default()
    }
}

impl From<b::MailgunCluster> for a::MailgunCluster {
    fn from(obj: b::MailgunCluster) -> Self {
        let b::MailgunCluster {
            mut metadata,
            spec,
            status,
        } = obj;
        let data = ConversionData {
            control_plane_endpoint: spec.control_plane_endpoint,
            identity_ref: spec.identity_ref,
            ..Default::default()
        };
        let status = status.as_ref().map(cluster_status_down);
        put_data(&mut metadata, &data);
        Self {
            metadata,
            spec: a::MailgunClusterSpec {
                priority: spec.priority.into(),
                request: spec.request,
                requester: spec.requester,
            },
            status,
        }
    }
}

impl From<a::MailgunCluster> for b::MailgunCluster {
    fn from(obj: a::MailgunCluster) -> Self {
        let a::MailgunCluster {
            mut metadata,
            spec,
            status,
        } = obj;
        let data = take_data(&mut metadata);
        let status = status.as_ref().map(cluster_status_up);
        Self {
            metadata,
            spec: b::MailgunClusterSpec {
                priority: spec.priority.into(),
                request: spec.request,
                requester: spec.requester,
                control_plane_endpoint: data.control_plane_endpoint,
                identity_ref: data.identity_ref,
            },
            status,
        }
    }
}

impl From<b::MailgunMachine> for a::MailgunMachine {
    fn from(obj: b::MailgunMachine) -> Self {
        let b::MailgunMachine {
            mut metadata,
            spec,
            status,
        } = obj;
        let data = ConversionData {
            failure_domain: spec.failure_domain,
            addresses: spec.addresses,
            ..Default::default()
        };
        let status = status.as_ref().map(machine_status_down);
        put_data(&mut metadata, &data);
        Self {
            metadata,
            spec: a::MailgunMachineSpec {
                priority: spec.priority.into(),
                request: spec.request,
                requester: spec.requester,
                provider_id: spec.provider_id,
            },
            status,
        }
    }
}

impl From<a::MailgunMachine> for b::MailgunMachine {
    fn from(obj: a::MailgunMachine) -> Self {
        let a::MailgunMachine {
            mut metadata,
            spec,
            status,
        } = obj;
        let data = take_data(&mut metadata);
        let status = status.as_ref().map(machine_status_up);
        Self {
            metadata,
            spec: b::MailgunMachineSpec {
                priority: spec.priority.into(),
                request: spec.request,
                requester: spec.requester,
                provider_id: spec.provider_id,
                failure_domain: data.failure_domain,
                addresses: data.addresses,
            },
            status,
        }
    }
}

impl From<b::MailgunClusterTemplate> for a::MailgunClusterTemplate {
    fn from(obj: b::MailgunClusterTemplate) -> Self {
        let b::MailgunClusterTemplate { mut metadata, spec } = obj;
        let b::MailgunClusterTemplateResource {
            metadata: template_meta,
            spec,
        } = spec.template;
        let data = ConversionData {
            control_plane_endpoint: spec.control_plane_endpoint,
            identity_ref: spec.identity_ref,
            ..Default::default()
        };
        put_data(&mut metadata, &data);
        Self {
            metadata,
            spec: a::MailgunClusterTemplateSpec {
                template: a::MailgunClusterTemplateResource {
                    metadata: template_meta.map(Into::into),
                    spec: a::MailgunClusterSpec {
                        priority: spec.priority.into(),
                        request: spec.request,
                        requester: spec.requester,
                    },
                },
            },
        }
    }
}

impl From<a::MailgunClusterTemplate> for b::MailgunClusterTemplate {
    fn from(obj: a::MailgunClusterTemplate) -> Self {
        let a::MailgunClusterTemplate { mut metadata, spec } = obj;
        let data = take_data(&mut metadata);
        let a::MailgunClusterTemplateResource {
            metadata: template_meta,
            spec,
        } = spec.template;
        Self {
            metadata,
            spec: b::MailgunClusterTemplateSpec {
                template: b::MailgunClusterTemplateResource {
                    metadata: template_meta.map(Into::into),
                    spec: b::MailgunClusterSpec {
                        priority: spec.priority.into(),
                        request: spec.request,
                        requester: spec.requester,
                        control_plane_endpoint: data.control_plane_endpoint,
                        identity_ref: data.identity_ref,
                    },
                },
            },
        }
    }
}

impl From<b::MailgunMachineTemplate> for a::MailgunMachineTemplate {
    fn from(obj: b::MailgunMachineTemplate) -> Self {
        let b::MailgunMachineTemplate { mut metadata, spec } = obj;
        let b::MailgunMachineTemplateResource {
            metadata: template_meta,
            spec,
        } = spec.template;
        let data = ConversionData {
            failure_domain: spec.failure_domain,
            addresses: spec.addresses,
            ..Default::default()
        };
        put_data(&mut metadata, &data);
        Self {
            metadata,
            spec: a::MailgunMachineTemplateSpec {
                template: a::MailgunMachineTemplateResource {
                    metadata: template_meta.map(Into::into),
                    spec: a::MailgunMachineSpec {
                        priority: spec.priority.into(),
                        request: spec.request,
                        requester: spec.requester,
                        provider_id: spec.provider_id,
                    },
                },
            },
        }
    }
}

impl From<a::MailgunMachineTemplate> for b::MailgunMachineTemplate {
    fn from(obj: a::MailgunMachineTemplate) -> Self {
        let a::MailgunMachineTemplate { mut metadata, spec } = obj;
        let data = take_data(&mut metadata);
        let a::MailgunMachineTemplateResource {
            metadata: template_meta,
            spec,
        } = spec.template;
        Self {
            metadata,
            spec: b::MailgunMachineTemplateSpec {
                template: b::MailgunMachineTemplateResource {
                    metadata: template_meta.map(Into::into),
                    spec: b::MailgunMachineSpec {
                        priority: spec.priority.into(),
                        request: spec.request,
                        requester: spec.requester,
                        provider_id: spec.provider_id,
                        failure_domain: data.failure_domain,
                        addresses: data.addresses,
                    },
                },
            },
        }
    }
}

fn via<F, T>(object: Value, kind: &str, api_version: &str) -> Result<Value, ConversionError>
where
    F: DeserializeOwned,
    T: From<F> + Serialize,
{
    let from: F = serde_json::from_value(object).map_err(|source| ConversionError::Decode {
        kind: kind.to_owned(),
        api_version: api_version.to_owned(),
        source,
    })?;
    serde_json::to_value(T::from(from)).map_err(ConversionError::Encode)
}

fn version_of(api_version: &str) -> Result<&str, ConversionError> {
    match api_version.split_once('/') {
        Some((group, version)) if group == GROUP => {
            if crate::VERSIONS.contains(&version) {
                Ok(version)
            } else {
                Err(ConversionError::UnknownVersion(version.to_owned()))
            }
        }
        _ => Err(ConversionError::WrongGroup(api_version.to_owned())),
    }
}

/// Converts one object (JSON, as found in a `ConversionReview`) to `desired_api_version`
/// (`infrastructure.cluster.x-k8s.io/<version>`).
///
/// An object already in the desired version is returned unchanged. Otherwise the object's
/// `metadata` is kept exactly as it came, except `annotations` (the only metadata a conversion may
/// change besides labels).
///
/// # Errors
/// When the object has no `apiVersion`/`kind`, names a group, version or kind this provider does
/// not serve, or does not decode as its declared version.
pub fn convert(object: Value, desired_api_version: &str) -> Result<Value, ConversionError> {
    let api_version = object
        .get("apiVersion")
        .and_then(Value::as_str)
        .ok_or(ConversionError::MissingField("apiVersion"))?
        .to_owned();
    let kind = object
        .get("kind")
        .and_then(Value::as_str)
        .ok_or(ConversionError::MissingField("kind"))?
        .to_owned();
    let from = version_of(&api_version)?;
    let to = version_of(desired_api_version)?;
    if !matches!(
        kind.as_str(),
        "MailgunCluster" | "MailgunMachine" | "MailgunClusterTemplate" | "MailgunMachineTemplate"
    ) {
        return Err(ConversionError::UnknownKind(kind));
    }
    if from == to {
        return Ok(object);
    }
    let original_metadata = object.get("metadata").cloned();
    let up = from == "v1alpha1";
    let (k, v) = (kind.as_str(), api_version.as_str());
    let mut converted = match (k, up) {
        ("MailgunCluster", true) => via::<a::MailgunCluster, b::MailgunCluster>(object, k, v),
        ("MailgunCluster", false) => via::<b::MailgunCluster, a::MailgunCluster>(object, k, v),
        ("MailgunMachine", true) => via::<a::MailgunMachine, b::MailgunMachine>(object, k, v),
        ("MailgunMachine", false) => via::<b::MailgunMachine, a::MailgunMachine>(object, k, v),
        ("MailgunClusterTemplate", true) => {
            via::<a::MailgunClusterTemplate, b::MailgunClusterTemplate>(object, k, v)
        }
        ("MailgunClusterTemplate", false) => {
            via::<b::MailgunClusterTemplate, a::MailgunClusterTemplate>(object, k, v)
        }
        ("MailgunMachineTemplate", true) => {
            via::<a::MailgunMachineTemplate, b::MailgunMachineTemplate>(object, k, v)
        }
        _ => via::<b::MailgunMachineTemplate, a::MailgunMachineTemplate>(object, k, v),
    }?;
    if let (Some(Value::Object(mut meta)), Some(out)) =
        (original_metadata, converted.as_object_mut())
    {
        match out
            .get("metadata")
            .and_then(|m| m.get("annotations"))
            .cloned()
        {
            Some(annotations) => meta.insert("annotations".into(), annotations),
            None => meta.remove("annotations"),
        };
        out.insert("metadata".into(), Value::Object(meta));
    }
    Ok(converted)
}
