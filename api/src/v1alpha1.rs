//! Version `v1alpha1`: the shape of the Cluster API book's Mailgun walkthrough, implementing
//! Cluster API contract `v1beta1` (`status.ready`).
//!
//! Served for existing clients; stored as [`crate::v1beta1`]. Fields `v1beta1` has and this
//! version lacks (the control plane endpoint, conditions, ...) survive a round trip through this
//! version in the [`crate::names::CONVERSION_DATA_ANNOTATION`] annotation; see
//! [`crate::conversion`].

// Each `printcolumn(...)` repeats keys such as `type_`; clippy reads those as duplicated
// attributes.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::limits::{
    MAX_MESSAGE_ID_LENGTH, MAX_PROVIDER_ID_LENGTH, MAX_REQUEST_LENGTH, MAX_REQUESTER_LENGTH,
    PROVIDER_ID_PATTERN, REQUEST_PATTERN, REQUESTER_LOCAL_PART_RULE, REQUESTER_PATTERN,
    string_map_schema,
};

/// How urgently the request should be handled; it appears in the mail subject.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Priority {
    /// Handle today.
    Urgent,
    /// Handle now.
    ExtremelyUrgent,
    /// The business stops without it.
    BusinessCritical,
}

/// Labels and annotations that Cluster API copies from a template to the objects it creates.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TemplateMetadata {
    /// labels (optional): labels for the created objects; at most 64 entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "string_map_schema")]
    pub labels: Option<BTreeMap<String, String>>,
    /// annotations (optional): annotations for the created objects; at most 64 entries.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "string_map_schema")]
    pub annotations: Option<BTreeMap<String, String>>,
}

/// Desired state of a `MailgunCluster`: what to ask for.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "MailgunCluster",
    plural = "mailgunclusters",
    singular = "mailguncluster",
    namespaced,
    status = "MailgunClusterStatus",
    derive = "PartialEq",
    shortname = "mgc",
    category = "cluster-api",
    doc = "MailgunCluster asks a human, by mail, for a cluster's infrastructure (walkthrough shape; \
           prefer v1beta1).",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1beta1"),
    label("cluster.x-k8s.io/provider", "infrastructure-mailgun"),
    printcolumn(
        name = "Priority",
        type_ = "string",
        json_path = ".spec.priority",
        description = "How urgent the request is"
    ),
    printcolumn(
        name = "Ready",
        type_ = "boolean",
        json_path = ".status.ready",
        description = "Whether the request was fulfilled"
    ),
    printcolumn(
        name = "Response",
        type_ = "string",
        json_path = ".status.response",
        description = "Id of the request mail"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
pub struct MailgunClusterSpec {
    /// priority (required, immutable): `Urgent`, `ExtremelyUrgent` or `BusinessCritical`;
    /// appears in the mail subject.
    #[schemars(extend("x-kubernetes-validations" = [{"rule": "self == oldSelf", "message": "priority is immutable"}]))]
    pub priority: Priority,
    /// request (required, immutable): free text mailed as the body, 1 to 4096 characters;
    /// line breaks and tabs allowed, other control characters not.
    #[schemars(
        length(min = 1, max = MAX_REQUEST_LENGTH),
        pattern(REQUEST_PATTERN),
        extend("x-kubernetes-validations" = [{"rule": "self == oldSelf", "message": "request is immutable"}])
    )]
    pub request: String,
    /// requester (required, immutable): e-mail address the request is sent from, at most 254
    /// characters.
    #[schemars(
        length(min = 3, max = MAX_REQUESTER_LENGTH),
        pattern(REQUESTER_PATTERN),
        extend("x-kubernetes-validations" = [
            {"rule": "self == oldSelf", "message": "requester is immutable"},
            {"rule": REQUESTER_LOCAL_PART_RULE, "message": "requester: the local part (before @) must have at most 64 characters"}
        ])
    )]
    pub requester: String,
}

/// Observed state of a `MailgunCluster`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MailgunClusterStatus {
    /// response (optional): the id of the request mail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_MESSAGE_ID_LENGTH))]
    pub response: Option<String>,
    /// ready (optional, default false): true once the request was fulfilled (contract
    /// `v1beta1`).
    #[serde(default)]
    pub ready: bool,
}

/// Desired state of a `MailgunMachine`: what to ask for, and (once fulfilled) which machine it is.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "MailgunMachine",
    plural = "mailgunmachines",
    singular = "mailgunmachine",
    namespaced,
    status = "MailgunMachineStatus",
    derive = "PartialEq",
    shortname = "mgm",
    category = "cluster-api",
    doc = "MailgunMachine asks a human, by mail, for one machine (walkthrough shape; prefer \
           v1beta1).",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1beta1"),
    label("cluster.x-k8s.io/provider", "infrastructure-mailgun"),
    printcolumn(
        name = "Priority",
        type_ = "string",
        json_path = ".spec.priority",
        description = "How urgent the request is"
    ),
    printcolumn(
        name = "Ready",
        type_ = "boolean",
        json_path = ".status.ready",
        description = "Whether the request was fulfilled"
    ),
    printcolumn(
        name = "ProviderID",
        type_ = "string",
        json_path = ".spec.providerID",
        description = "Provider ID of the machine"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "!has(oldSelf.providerID) || (has(self.providerID) && self.providerID == oldSelf.providerID)",
    "message": "providerID is set-once: it can be set when empty but never changed or removed",
    "fieldPath": ".providerID",
    "reason": "FieldValueForbidden"
}]))]
pub struct MailgunMachineSpec {
    /// priority (required, immutable): `Urgent`, `ExtremelyUrgent` or `BusinessCritical`;
    /// appears in the mail subject.
    #[schemars(extend("x-kubernetes-validations" = [{"rule": "self == oldSelf", "message": "priority is immutable"}]))]
    pub priority: Priority,
    /// request (required, immutable): free text mailed as the body, 1 to 4096 characters;
    /// line breaks and tabs allowed, other control characters not.
    #[schemars(
        length(min = 1, max = MAX_REQUEST_LENGTH),
        pattern(REQUEST_PATTERN),
        extend("x-kubernetes-validations" = [{"rule": "self == oldSelf", "message": "request is immutable"}])
    )]
    pub request: String,
    /// requester (required, immutable): e-mail address the request is sent from, at most 254
    /// characters.
    #[schemars(
        length(min = 3, max = MAX_REQUESTER_LENGTH),
        pattern(REQUESTER_PATTERN),
        extend("x-kubernetes-validations" = [
            {"rule": "self == oldSelf", "message": "requester is immutable"},
            {"rule": REQUESTER_LOCAL_PART_RULE, "message": "requester: the local part (before @) must have at most 64 characters"}
        ])
    )]
    pub requester: String,
    /// providerID (optional, set-once): `<scheme>://<id>`, at most 512 characters; set by the
    /// human who fulfils the request.
    #[serde(
        rename = "providerID",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(length(min = 1, max = MAX_PROVIDER_ID_LENGTH), pattern(PROVIDER_ID_PATTERN))]
    pub provider_id: Option<String>,
}

/// Observed state of a `MailgunMachine`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MailgunMachineStatus {
    /// ready (optional, default false): true once the request was fulfilled (contract
    /// `v1beta1`).
    #[serde(default)]
    pub ready: bool,
}

/// The object a `MailgunClusterTemplate` stamps out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MailgunClusterTemplateResource {
    /// metadata (optional): labels and annotations for the created `MailgunCluster`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateMetadata>,
    /// spec (required): the spec of the created `MailgunCluster`.
    pub spec: MailgunClusterSpec,
}

/// Desired state of a `MailgunClusterTemplate`.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "MailgunClusterTemplate",
    plural = "mailgunclustertemplates",
    singular = "mailgunclustertemplate",
    namespaced,
    derive = "PartialEq",
    shortname = "mgct",
    category = "cluster-api",
    doc = "MailgunClusterTemplate is the template ClusterClass stamps MailgunClusters from. \
           Immutable.",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1beta1"),
    label("cluster.x-k8s.io/provider", "infrastructure-mailgun"),
    printcolumn(
        name = "Priority",
        type_ = "string",
        json_path = ".spec.template.spec.priority",
        description = "How urgent the stamped requests are"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
pub struct MailgunClusterTemplateSpec {
    /// template (required, immutable): the `MailgunCluster` to create. Immutable through the
    /// chart's admission policy, not CEL: see `crd::drop_transition_rules`.
    pub template: MailgunClusterTemplateResource,
}

/// The object a `MailgunMachineTemplate` stamps out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MailgunMachineTemplateResource {
    /// metadata (optional): labels and annotations for the created `MailgunMachine`s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateMetadata>,
    /// spec (required): the spec of the created `MailgunMachine`s; `providerID` must be unset.
    pub spec: MailgunMachineSpec,
}

/// Desired state of a `MailgunMachineTemplate`.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1alpha1",
    kind = "MailgunMachineTemplate",
    plural = "mailgunmachinetemplates",
    singular = "mailgunmachinetemplate",
    namespaced,
    derive = "PartialEq",
    shortname = "mgmt",
    category = "cluster-api",
    doc = "MailgunMachineTemplate is the template MachineDeployments stamp MailgunMachines from. \
           Immutable.",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1beta1"),
    label("cluster.x-k8s.io/provider", "infrastructure-mailgun"),
    printcolumn(
        name = "Priority",
        type_ = "string",
        json_path = ".spec.template.spec.priority",
        description = "How urgent the stamped requests are"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
pub struct MailgunMachineTemplateSpec {
    /// template (required, immutable): the `MailgunMachine`s to create; `spec.providerID`
    /// must be unset.
    // Immutable through the chart's admission policy, not CEL: see `crd::drop_transition_rules`.
    #[schemars(extend("x-kubernetes-validations" = [
        {
            "rule": "!has(self.spec.providerID)",
            "message": "providerID must not be set in a template: every machine gets its own",
            "fieldPath": ".spec.providerID",
            "reason": "FieldValueForbidden"
        }
    ]))]
    pub template: MailgunMachineTemplateResource,
}
