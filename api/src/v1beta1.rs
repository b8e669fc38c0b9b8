//! Version `v1beta1`: the storage version, implementing Cluster API contract `v1beta2`.
//!
//! # Workflow
//! 1. Someone creates a `MailgunCluster` (usually through a Cluster API `Cluster` whose
//!    `spec.infrastructureRef` names it) with `priority`, `request` and `requester`.
//! 2. The controller mails the request once (see [`crate::names::MAIL_ANNOTATION`] for how
//!    "once" survives crashes) and records the outcome in `status.mail`.
//! 3. A human fulfils it by setting `spec.controlPlaneEndpoint` (cluster) or `spec.providerID`
//!    and optionally `spec.addresses` (machine). The controller then copies the addresses to
//!    `status.addresses` and sets `status.initialization.provisioned: true`.
//!
//! The request fields are immutable; the fulfilment fields are set-once (they may go from unset
//! to set, never change or disappear afterwards). The CRD schema enforces this with CEL rules,
//! and [`crate::validation::Validate`] enforces the same in Rust.

// Each `printcolumn(...)` repeats keys such as `type_`; clippy reads those as duplicated
// attributes.
#![allow(clippy::duplicated_attributes)]

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, ObjectMeta, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::limits::{
    ADDRESS_PATTERN, FAILURE_DOMAIN_PATTERN, HOST_PATTERN, MAX_ADDRESS_LENGTH, MAX_ADDRESSES,
    MAX_CONDITIONS, MAX_FAILURE_DOMAIN_LENGTH, MAX_HOST_LENGTH, MAX_MESSAGE_ID_LENGTH,
    MAX_PROVIDER_ID_LENGTH, MAX_REQUEST_LENGTH, MAX_REQUESTER_LENGTH, PROVIDER_ID_PATTERN,
    REQUEST_PATTERN, REQUESTER_LOCAL_PART_RULE, REQUESTER_PATTERN, string_map_schema,
};
use crate::names::IDENTITY_SECRET_LABEL;

mod remediation;
pub use remediation::*;

/// A DNS-1123 subdomain (object names).
const DNS_SUBDOMAIN_PATTERN: &str =
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
/// A Secret data key.
const SECRET_KEY_PATTERN: &str = r"^[-._a-zA-Z0-9]+$";

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

impl Priority {
    /// The JSON value, as it appears in the mail subject.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Urgent => "Urgent",
            Self::ExtremelyUrgent => "ExtremelyUrgent",
            Self::BusinessCritical => "BusinessCritical",
        }
    }
}

impl std::fmt::Display for Priority {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the cluster's API server can be reached (Cluster API `APIEndpoint`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ApiEndpoint {
    /// host (required): DNS name or IP address of the control plane endpoint, 1 to 253
    /// characters of letters, digits, `.`, `:` and `-`.
    #[schemars(length(min = 1, max = MAX_HOST_LENGTH), pattern(HOST_PATTERN))]
    pub host: String,
    /// port (required): TCP port of the control plane endpoint, 1 to 65535.
    #[schemars(range(min = 1, max = 65535))]
    pub port: i32,
}

/// The kind of a machine address (Cluster API `MachineAddressType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum MachineAddressType {
    /// The machine's host name.
    Hostname,
    /// An IP address reachable from outside the cluster's network.
    #[serde(rename = "ExternalIP")]
    ExternalIp,
    /// An IP address reachable inside the cluster's network.
    #[serde(rename = "InternalIP")]
    InternalIp,
    /// A DNS name resolving from outside the cluster's network.
    #[serde(rename = "ExternalDNS")]
    ExternalDns,
    /// A DNS name resolving inside the cluster's network.
    #[serde(rename = "InternalDNS")]
    InternalDns,
}

/// One address of a machine (Cluster API `MachineAddress`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MachineAddress {
    /// type (required): one of `Hostname`, `ExternalIP`, `InternalIP`, `ExternalDNS`,
    /// `InternalDNS`.
    #[serde(rename = "type")]
    pub type_: MachineAddressType,
    /// address (required): the address, 1 to 256 printable ASCII characters without spaces.
    #[schemars(length(min = 1, max = MAX_ADDRESS_LENGTH), pattern(ADDRESS_PATTERN))]
    pub address: String,
}

/// Labels and annotations that Cluster API copies from a template to the objects it creates
/// (Cluster API `ObjectMeta` in templates).
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

/// The provisioning flags of contract `v1beta2`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Initialization {
    /// provisioned (optional): true once the request was fulfilled; Cluster API reads it to
    /// mark the infrastructure ready. Never goes back to false.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub provisioned: Option<bool>,
}

/// state of the request mail: `Pending` (intent recorded, outcome not known yet), `Sent`
/// (accepted by the backend), `Delivered` (the backend reported it delivered) or `Failed`
/// (rejected permanently when sent, or reported undeliverable by the backend).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum MailState {
    /// The intent to send was recorded; whether the backend accepted the mail is not known yet.
    Pending,
    /// The backend accepted the mail.
    Sent,
    /// The backend reported the mail delivered to the recipients' mail server (Mailgun only;
    /// see the `MailDelivered` condition).
    Delivered,
    /// The mail failed for good. Either the backend rejected it when sent (the `MailSent`
    /// condition says why; not retried automatically: a new value of the annotation
    /// `mailgun.infrastructure.cluster.x-k8s.io/retry`, for example after fixing credentials,
    /// retries it once), or the backend accepted it and later
    /// reported it undeliverable (the `MailDelivered` condition says why; never resent: a human
    /// must act).
    Failed,
}

/// What happened to the request mail. Mirrors, for humans and `kubectl get`, what the
/// annotation [`crate::names::MAIL_ANNOTATION`] records for the controller: that, not this, is
/// the source of truth.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MailStatus {
    /// messageID (optional): the id of the request mail (the backend's id once sent).
    #[serde(rename = "messageID", default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_MESSAGE_ID_LENGTH))]
    pub message_id: Option<String>,
    /// state (optional): `Pending`, `Sent`, `Delivered` or `Failed`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<MailState>,
    /// sentAt (optional): when the backend accepted the mail; set once, never updated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sent_at: Option<Time>,
}

/// Desired state of a `MailgunCluster`: what to ask for, and (once fulfilled) where it is.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1beta1",
    kind = "MailgunCluster",
    plural = "mailgunclusters",
    singular = "mailguncluster",
    namespaced,
    status = "MailgunClusterStatus",
    derive = "PartialEq",
    shortname = "mgc",
    category = "cluster-api",
    doc = "MailgunCluster asks a human, by mail, for a cluster's infrastructure; the human fulfils \
           the request by setting spec.controlPlaneEndpoint.",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1beta1"),
    label("cluster.x-k8s.io/provider", "infrastructure-mailgun"),
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".metadata.labels['cluster\\.x-k8s\\.io/cluster-name']",
        description = "Cluster this MailgunCluster belongs to"
    ),
    printcolumn(
        name = "Priority",
        type_ = "string",
        json_path = ".spec.priority",
        description = "How urgent the request is"
    ),
    printcolumn(
        name = "Provisioned",
        type_ = "boolean",
        json_path = ".status.initialization.provisioned",
        description = "Whether the request was fulfilled"
    ),
    printcolumn(
        name = "Mail",
        type_ = "string",
        json_path = ".status.mail.state",
        description = "State of the request mail"
    ),
    printcolumn(
        name = "Endpoint",
        type_ = "string",
        json_path = ".spec.controlPlaneEndpoint.host",
        description = "Control plane endpoint host",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "!has(oldSelf.controlPlaneEndpoint) || (has(self.controlPlaneEndpoint) && self.controlPlaneEndpoint == oldSelf.controlPlaneEndpoint)",
    "message": "controlPlaneEndpoint is set-once: it can be set when empty but never changed or removed",
    "fieldPath": ".controlPlaneEndpoint",
    "reason": "FieldValueForbidden"
}]))]
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
    /// controlPlaneEndpoint (optional, set-once): set by the human who fulfils the request;
    /// Cluster API copies it to the `Cluster`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control_plane_endpoint: Option<ApiEndpoint>,
    /// identityRef (optional): the `MailgunClusterIdentity` whose mail backend, sender and
    /// recipients this cluster's requests (and its machines') go through; it must allow this
    /// namespace. Absent: the provider's own configuration. A mail already sent stays with the
    /// identity that sent it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity_ref: Option<IdentityReference>,
}

/// The kinds an `identityRef` may name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum IdentityKind {
    /// A cluster-scoped [`MailgunClusterIdentity`].
    MailgunClusterIdentity,
}

/// A reference to a mail identity (Cluster API providers' `identityRef` convention).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct IdentityReference {
    /// kind (required): `MailgunClusterIdentity`.
    pub kind: IdentityKind,
    /// name (required): the identity's name, a DNS subdomain.
    #[schemars(length(min = 1, max = 253), pattern(DNS_SUBDOMAIN_PATTERN))]
    pub name: String,
}

/// A key in a Secret in the provider's own namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SecretKeyReference {
    /// name (required): the Secret's name, in the namespace the provider runs in.
    #[schemars(length(min = 1, max = 253), pattern(DNS_SUBDOMAIN_PATTERN))]
    pub name: String,
    /// key (required): the key in the Secret's data.
    #[schemars(length(min = 1, max = 253), pattern(SECRET_KEY_PATTERN))]
    pub key: String,
}

/// Mailgun's two public API regions: the mailer's own type.
pub use capm_mailer::MailgunRegion;

/// An identity's Mailgun account.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IdentityMailgun {
    /// domain (required): the sending domain.
    #[schemars(length(min = 1, max = 253), pattern(HOST_PATTERN))]
    pub domain: String,
    /// region (optional, `us`): `us` or `eu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<MailgunRegion>,
    /// baseURL (optional): overrides the region's API URL (e.g. a proxy); `https://` or
    /// `http://`.
    #[serde(rename = "baseURL", default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 2048), pattern(r"^https?://[!-~]+$"))]
    pub base_url: Option<String>,
    /// apiKeySecretRef (required): the sending key (a domain sending key is enough).
    pub api_key_secret_ref: SecretKeyReference,
    /// readKeySecretRef (optional): a read-only account key for delivery tracking and the
    /// lookup after a crash. Absent: the API key reads, or delivery is not tracked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_key_secret_ref: Option<SecretKeyReference>,
}

/// An identity's SMTP relay.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct IdentitySmtp {
    /// url (required): `smtp://host[:port]` (STARTTLS required, port 587 by default) or
    /// `smtps://host[:port]` (TLS, 465).
    #[schemars(length(min = 1, max = 2048), pattern(r"^smtps?://[!-~]+$"))]
    pub url: String,
    /// username (optional): the AUTH user; needs `passwordSecretRef`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 256), pattern(r"^[!-~]+$"))]
    pub username: Option<String>,
    /// passwordSecretRef (optional): the AUTH password.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password_secret_ref: Option<SecretKeyReference>,
    /// caSecretRef (optional): a PEM CA bundle of a private relay; only it is trusted then.
    /// Absent: the system's roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_secret_ref: Option<SecretKeyReference>,
}

/// Which namespaces may use an identity (CAPA's reading). Absent: none; `{}` (neither `list`
/// nor `selector`): all.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct AllowedNamespaces {
    /// list (optional): namespaces by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 256), inner(length(min = 1, max = 63)))]
    pub list: Option<Vec<String>>,
    /// selector (optional): namespaces by label. With `list`, a namespace either names is
    /// allowed. An empty selector (`{}`) selects no namespace: it never opens the identity to
    /// all. Whoever may label a namespace may make it match.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<NamespaceSelector>,
}

/// A label selector of namespaces (Kubernetes `LabelSelector`, bounded).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NamespaceSelector {
    /// matchLabels (optional): labels a namespace must carry, each with this value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "string_map_schema")]
    pub match_labels: Option<BTreeMap<String, String>>,
    /// matchExpressions (optional): requirements a namespace's labels must meet, all of them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 32))]
    pub match_expressions: Option<Vec<SelectorRequirement>>,
}

/// One requirement of a [`NamespaceSelector`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "self.operator in ['In', 'NotIn'] ? has(self.values) && size(self.values) > 0 : !has(self.values) || size(self.values) == 0",
    "message": "values: required (not empty) for In and NotIn, empty for Exists and DoesNotExist",
    "fieldPath": ".values"
}]))]
pub struct SelectorRequirement {
    /// key (required): the label key.
    #[schemars(length(min = 1, max = 317))]
    pub key: String,
    /// operator (required): `In`, `NotIn`, `Exists` or `DoesNotExist`.
    pub operator: SelectorOperator,
    /// values (required for `In` and `NotIn`, not empty; absent for `Exists` and
    /// `DoesNotExist`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64), inner(length(max = 63)))]
    pub values: Option<Vec<String>>,
}

/// How a [`SelectorRequirement`] compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum SelectorOperator {
    /// The label's value is one of `values`.
    In,
    /// The label is absent or its value is none of `values`.
    NotIn,
    /// The label is present.
    Exists,
    /// The label is absent.
    DoesNotExist,
}

impl NamespaceSelector {
    /// Whether a namespace with `labels` is selected. An empty selector selects none (CAPA's
    /// reading for identities), and so does one with a requirement Kubernetes would refuse
    /// (`In`/`NotIn` without values, `Exists`/`DoesNotExist` with some).
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let requirements = self.match_expressions.iter().flatten();
        if self.is_empty() || requirements.clone().any(|r| !r.is_valid()) {
            return false;
        }
        let labels_match = self
            .match_labels
            .iter()
            .flatten()
            .all(|(k, v)| labels.get(k) == Some(v));
        labels_match
            && requirements.clone().all(|r| {
                let values = r.values.as_deref().unwrap_or_default();
                let value = labels.get(&r.key);
                match r.operator {
                    SelectorOperator::In => value.is_some_and(|v| values.contains(v)),
                    SelectorOperator::NotIn => value.is_none_or(|v| !values.contains(v)),
                    SelectorOperator::Exists => value.is_some(),
                    SelectorOperator::DoesNotExist => value.is_none(),
                }
            })
    }

    /// Neither labels nor requirements.
    pub fn is_empty(&self) -> bool {
        self.match_labels.as_ref().is_none_or(BTreeMap::is_empty)
            && self.match_expressions.as_ref().is_none_or(Vec::is_empty)
    }
}

impl SelectorRequirement {
    /// Kubernetes' rule: values for `In` and `NotIn`, none for `Exists` and `DoesNotExist`.
    pub fn is_valid(&self) -> bool {
        let has_values = self.values.as_ref().is_some_and(|v| !v.is_empty());
        match self.operator {
            SelectorOperator::In | SelectorOperator::NotIn => has_values,
            SelectorOperator::Exists | SelectorOperator::DoesNotExist => !has_values,
        }
    }
}

impl AllowedNamespaces {
    /// Whether the namespace `name` with `labels` may use the identity: named in `list`,
    /// selected by `selector`, or both absent (`{}`: every namespace).
    pub fn allows(&self, name: &str, labels: &BTreeMap<String, String>) -> bool {
        let listed = self.list.iter().flatten().any(|n| n == name);
        let selected = self.selector.as_ref().is_some_and(|s| s.matches(labels));
        let everyone = self.list.is_none() && self.selector.is_none();
        listed || selected || everyone
    }

    /// Whether [`Self::allows`] needs the namespace's labels (a selector that can match).
    pub fn reads_labels(&self) -> bool {
        self.selector.as_ref().is_some_and(|s| !s.is_empty())
    }
}

impl MailgunClusterIdentity {
    /// Whether the Secret `secret` is claimed for this identity: labelled with its name
    /// ([`crate::names::IDENTITY_SECRET_LABEL`]; the provider watches only labelled Secrets) and
    /// owned by no other identity (an ownerReference to this one, by its UID, is welcome:
    /// `clusterctl move` sets it).
    ///
    /// # Errors
    /// Why not, naming the Secret, never a value.
    pub fn check_claim(&self, secret: &ObjectMeta) -> Result<(), String> {
        use kube::Resource;
        let (name, uid) = (self.meta().name.as_deref(), self.meta().uid.as_deref());
        let secret_name = secret.name.as_deref().unwrap_or_default();
        let foreign = secret.owner_references.iter().flatten().any(|o| {
            o.kind == Self::kind(&())
                && o.api_version.split('/').next() == Some(crate::GROUP)
                && (Some(o.name.as_str()) != name || Some(o.uid.as_str()) != uid)
        });
        let label = secret
            .labels
            .as_ref()
            .and_then(|l| l.get(IDENTITY_SECRET_LABEL));
        match label {
            _ if foreign => Err(format!(
                "Secret {secret_name} is claimed by another identity"
            )),
            Some(l) if Some(l.as_str()) != name => Err(format!(
                "Secret {secret_name} is claimed by another identity"
            )),
            Some(_) => Ok(()),
            None => Err(format!(
                "Secret {secret_name} is not claimed for this identity (label \
                 {IDENTITY_SECRET_LABEL}=<identity>)"
            )),
        }
    }
}

/// A mail identity: a tenant's mail backend (Mailgun or SMTP), sender and recipients, and the
/// namespaces whose clusters may use it. Its Secrets live in the provider's own namespace.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1beta1",
    kind = "MailgunClusterIdentity",
    plural = "mailgunclusteridentities",
    singular = "mailgunclusteridentity",
    derive = "PartialEq",
    shortname = "mgci",
    category = "cluster-api",
    doc = "MailgunClusterIdentity is a tenant's mail identity: the backend, sender and recipients \
           that MailgunClusters naming it in spec.identityRef are mailed through.",
    label("cluster.x-k8s.io/v1beta2", "v1beta1"),
    label("cluster.x-k8s.io/provider", "infrastructure-mailgun"),
    label("clusterctl.cluster.x-k8s.io/move-hierarchy", ""),
    printcolumn(
        name = "Backend",
        type_ = "string",
        json_path = ".spec.mailgun.domain",
        description = "Mailgun sending domain (empty for SMTP)"
    ),
    printcolumn(
        name = "SMTP",
        type_ = "string",
        json_path = ".spec.smtp.url",
        description = "SMTP relay (empty for Mailgun)"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.mailgun) != has(self.smtp)", "message": "exactly one backend: mailgun or smtp"},
    {"rule": "!has(self.smtp) || has(self.from)", "message": "from is required with smtp: an address on the domain the relay sends for", "fieldPath": ".from"},
    {"rule": "!has(self.smtp) || !has(self.smtp.username) || has(self.smtp.passwordSecretRef)", "message": "smtp.username needs smtp.passwordSecretRef", "fieldPath": ".smtp.passwordSecretRef"}
]))]
pub struct MailgunClusterIdentitySpec {
    /// mailgun (one of mailgun or smtp): a Mailgun account.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mailgun: Option<IdentityMailgun>,
    /// smtp (one of mailgun or smtp): an SMTP relay.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub smtp: Option<IdentitySmtp>,
    /// from (optional with mailgun, required with smtp): the mails' From, an address on the
    /// sending domain (DMARC). Default with mailgun: `cluster-api-provider-mailgun@<domain>`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 3, max = MAX_REQUESTER_LENGTH), pattern(REQUESTER_PATTERN))]
    pub from: Option<String>,
    /// recipients (required): who receives the requests, 1 to 16 addresses.
    #[schemars(length(min = 1, max = 16), inner(length(min = 3, max = MAX_REQUESTER_LENGTH), pattern(REQUESTER_PATTERN)))]
    pub recipients: Vec<String>,
    /// allowedNamespaces (optional): the namespaces whose MailgunClusters may use it. Absent:
    /// none may; `{}`: every namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allowed_namespaces: Option<AllowedNamespaces>,
}

/// Observed state of a `MailgunCluster`, written whole by the provider.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
// Owned as a unit by its one writer: `managedFields` then names `status`, not every field of
// every condition, a third of a finished object's bytes (docs/benchmarks.md, "Bytes per object").
#[schemars(extend("x-kubernetes-map-type" = "atomic"))]
pub struct MailgunClusterStatus {
    /// initialization (optional): provisioning flags read by Cluster API (contract `v1beta2`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<Initialization>,
    /// conditions (optional): `Ready`, `Paused`, `MailSent`, `MailDelivered`, `Provisioned`;
    /// one per type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(max = MAX_CONDITIONS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"])
    )]
    pub conditions: Option<Vec<Condition>>,
    /// observedGeneration (optional): the `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// mail (optional): what happened to the request mail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mail: Option<MailStatus>,
}

/// Desired state of a `MailgunMachine`: what to ask for, and (once fulfilled) which machine it is.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1beta1",
    kind = "MailgunMachine",
    plural = "mailgunmachines",
    singular = "mailgunmachine",
    namespaced,
    status = "MailgunMachineStatus",
    derive = "PartialEq",
    shortname = "mgm",
    category = "cluster-api",
    doc = "MailgunMachine asks a human, by mail, for one machine; the human fulfils the request \
           by setting spec.providerID (and optionally spec.addresses).",
    label("cluster.x-k8s.io/v1beta1", "v1alpha1"),
    label("cluster.x-k8s.io/v1beta2", "v1beta1"),
    label("cluster.x-k8s.io/provider", "infrastructure-mailgun"),
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".metadata.labels['cluster\\.x-k8s\\.io/cluster-name']",
        description = "Cluster this MailgunMachine belongs to"
    ),
    printcolumn(
        name = "Priority",
        type_ = "string",
        json_path = ".spec.priority",
        description = "How urgent the request is"
    ),
    printcolumn(
        name = "Provisioned",
        type_ = "boolean",
        json_path = ".status.initialization.provisioned",
        description = "Whether the request was fulfilled"
    ),
    printcolumn(
        name = "Mail",
        type_ = "string",
        json_path = ".status.mail.state",
        description = "State of the request mail"
    ),
    printcolumn(
        name = "ProviderID",
        type_ = "string",
        json_path = ".spec.providerID",
        description = "Provider ID of the machine",
        priority = 1
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {
        "rule": "!has(oldSelf.providerID) || (has(self.providerID) && self.providerID == oldSelf.providerID)",
        "message": "providerID is set-once: it can be set when empty but never changed or removed",
        "fieldPath": ".providerID",
        "reason": "FieldValueForbidden"
    },
    {
        "rule": "!has(oldSelf.failureDomain) || (has(self.failureDomain) && self.failureDomain == oldSelf.failureDomain)",
        "message": "failureDomain is set-once: it can be set when empty but never changed or removed",
        "fieldPath": ".failureDomain",
        "reason": "FieldValueForbidden"
    }
]))]
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
    /// human who fulfils the request. Cluster API matches it against the Node's
    /// `spec.providerID`.
    #[serde(
        rename = "providerID",
        default,
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(length(min = 1, max = MAX_PROVIDER_ID_LENGTH), pattern(PROVIDER_ID_PATTERN))]
    pub provider_id: Option<String>,
    /// failureDomain (optional, set-once): the failure domain the machine should be (or was)
    /// placed in, at most 256 printable characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = MAX_FAILURE_DOMAIN_LENGTH),
        pattern(FAILURE_DOMAIN_PATTERN)
    )]
    pub failure_domain: Option<String>,
    /// addresses (optional, mutable): the machine's addresses as the human who fulfils the
    /// request knows them; the controller copies them to `status.addresses`, where Cluster API
    /// reads them. At most 16.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_ADDRESSES))]
    pub addresses: Option<Vec<MachineAddress>>,
}

/// Observed state of a `MailgunMachine`, written whole by the provider.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
// Owned as a unit by its one writer: `managedFields` then names `status`, not every field of
// every condition, a third of a finished object's bytes (docs/benchmarks.md, "Bytes per object").
#[schemars(extend("x-kubernetes-map-type" = "atomic"))]
pub struct MailgunMachineStatus {
    /// initialization (optional): provisioning flags read by Cluster API (contract `v1beta2`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<Initialization>,
    /// conditions (optional): `Ready`, `Paused`, `MailSent`, `MailDelivered`, `Provisioned`;
    /// one per type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(max = MAX_CONDITIONS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"])
    )]
    pub conditions: Option<Vec<Condition>>,
    /// observedGeneration (optional): the `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// addresses (optional): the machine's addresses, copied from `spec.addresses`; Cluster API
    /// copies them to the `Machine`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_ADDRESSES))]
    pub addresses: Option<Vec<MachineAddress>>,
    /// mail (optional): what happened to the request mail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mail: Option<MailStatus>,
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

/// Desired state of a `MailgunClusterTemplate` (used by Cluster API `ClusterClass`).
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1beta1",
    kind = "MailgunClusterTemplate",
    plural = "mailgunclustertemplates",
    singular = "mailgunclustertemplate",
    namespaced,
    derive = "PartialEq",
    shortname = "mgct",
    category = "cluster-api",
    doc = "MailgunClusterTemplate is the template Cluster API ClusterClass stamps MailgunClusters \
           from. Immutable.",
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

/// Desired state of a `MailgunMachineTemplate` (used by `MachineDeployment`s and `MachineSet`s).
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1beta1",
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

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn requirement(
        key: &str,
        operator: SelectorOperator,
        values: Option<&[&str]>,
    ) -> SelectorRequirement {
        SelectorRequirement {
            key: key.to_owned(),
            operator,
            values: values.map(|v| v.iter().map(|s| (*s).to_owned()).collect()),
        }
    }

    fn expressions(requirements: Vec<SelectorRequirement>) -> NamespaceSelector {
        NamespaceSelector {
            match_labels: None,
            match_expressions: Some(requirements),
        }
    }

    #[test]
    fn selector_requirements_case_by_case() {
        use SelectorOperator::{DoesNotExist, Exists, In, NotIn};
        let team_a = labels(&[("team", "a")]);
        let team_b = labels(&[("team", "b")]);
        let none = labels(&[]);
        // (requirement, matches team=a, team=b, no label)
        let table = [
            (requirement("team", In, Some(&["a"])), [true, false, false]),
            (
                requirement("team", In, Some(&["a", "b"])),
                [true, true, false],
            ),
            (
                requirement("team", NotIn, Some(&["a"])),
                [false, true, true],
            ),
            (requirement("team", Exists, None), [true, true, false]),
            (
                requirement("team", DoesNotExist, None),
                [false, false, true],
            ),
            // What Kubernetes refuses selects nothing, never everything.
            (requirement("team", In, None), [false, false, false]),
            (requirement("team", In, Some(&[])), [false, false, false]),
            (requirement("team", NotIn, None), [false, false, false]),
            (requirement("team", NotIn, Some(&[])), [false, false, false]),
            (
                requirement("team", Exists, Some(&["a"])),
                [false, false, false],
            ),
            (
                requirement("team", DoesNotExist, Some(&["a"])),
                [false, false, false],
            ),
        ];
        for (r, want) in table {
            let selector = expressions(vec![r.clone()]);
            let got = [&team_a, &team_b, &none].map(|l| selector.matches(l));
            assert_eq!(got, want, "{r:?}");
            assert_eq!(r.is_valid(), want.iter().any(|m| *m), "{r:?}");
        }
        // One invalid requirement spoils the whole selector.
        let mixed = expressions(vec![
            requirement("team", Exists, None),
            requirement("x", NotIn, None),
        ]);
        assert!(!mixed.matches(&team_a));
    }

    #[test]
    fn match_labels_and_expressions_must_all_hold() {
        let selector = NamespaceSelector {
            match_labels: Some(labels(&[("team", "a")])),
            match_expressions: Some(vec![requirement(
                "env",
                SelectorOperator::In,
                Some(&["prod"]),
            )]),
        };
        assert!(selector.matches(&labels(&[("team", "a"), ("env", "prod")])));
        assert!(!selector.matches(&labels(&[("team", "a"), ("env", "dev")])));
        assert!(!selector.matches(&labels(&[("team", "b"), ("env", "prod")])));
        assert!(!selector.matches(&labels(&[("env", "prod")])));
    }

    #[test]
    fn an_empty_selector_selects_nothing() {
        let any = labels(&[("team", "a")]);
        assert!(!NamespaceSelector::default().matches(&any));
        let empty_parts = NamespaceSelector {
            match_labels: Some(BTreeMap::new()),
            match_expressions: Some(Vec::new()),
        };
        assert!(!empty_parts.matches(&any));
        assert!(empty_parts.is_empty());
    }

    #[test]
    fn allowed_namespaces_case_by_case() {
        let list = |names: &[&str]| Some(names.iter().map(|n| (*n).to_owned()).collect());
        let by_label = Some(NamespaceSelector {
            match_labels: Some(labels(&[("team", "a")])),
            match_expressions: None,
        });
        let a = labels(&[("team", "a")]);
        let plain = labels(&[]);
        let allowed = |list, selector| AllowedNamespaces { list, selector };
        // (allowedNamespaces, allows "x" with team=a, "x" unlabelled, "listed" unlabelled, reads labels)
        let table = [
            (allowed(None, None), [true, true, true], false),
            (
                allowed(list(&["listed"]), None),
                [false, false, true],
                false,
            ),
            (allowed(list(&[]), None), [false, false, false], false),
            (allowed(None, by_label.clone()), [true, false, false], true),
            (
                allowed(list(&["listed"]), by_label.clone()),
                [true, false, true],
                true,
            ),
            // CAPA's reading: an empty selector opens nothing, beside a list or alone.
            (
                allowed(None, Some(NamespaceSelector::default())),
                [false, false, false],
                false,
            ),
            (
                allowed(list(&["listed"]), Some(NamespaceSelector::default())),
                [false, false, true],
                false,
            ),
            (
                allowed(list(&[]), Some(NamespaceSelector::default())),
                [false, false, false],
                false,
            ),
        ];
        for (allowed, want, reads) in table {
            let got = [
                allowed.allows("x", &a),
                allowed.allows("x", &plain),
                allowed.allows("listed", &plain),
            ];
            assert_eq!(got, want, "{allowed:?}");
            assert_eq!(allowed.reads_labels(), reads, "{allowed:?}");
        }
    }

    fn identity_claiming(name: &str, uid: &str) -> MailgunClusterIdentity {
        let mut i = MailgunClusterIdentity::new(
            name,
            MailgunClusterIdentitySpec {
                mailgun: None,
                smtp: None,
                from: None,
                recipients: vec!["a@b.co".into()],
                allowed_namespaces: None,
            },
        );
        i.metadata.uid = Some(uid.into());
        i
    }

    fn claimed_secret(label: Option<&str>, owner: Option<(&str, &str)>) -> ObjectMeta {
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
        ObjectMeta {
            name: Some("key".into()),
            labels: label
                .map(|l| BTreeMap::from([(IDENTITY_SECRET_LABEL.to_owned(), l.to_owned())])),
            owner_references: owner.map(|(name, uid)| {
                vec![OwnerReference {
                    api_version: format!("{}/v1beta1", crate::GROUP),
                    kind: "MailgunClusterIdentity".into(),
                    name: name.into(),
                    uid: uid.into(),
                    ..OwnerReference::default()
                }]
            }),
            ..ObjectMeta::default()
        }
    }

    #[test]
    fn secrets_claimed_by_label_and_never_by_another() {
        let a = identity_claiming("team-a", "uid-a");
        let s = claimed_secret;
        for (meta, ok) in [
            (s(Some("team-a"), None), true),
            // Owned alone is not claimed: only labelled Secrets are watched.
            (s(None, Some(("team-a", "uid-a"))), false),
            (s(Some("team-a"), Some(("team-a", "uid-a"))), true),
            (s(None, None), false),
            (s(Some("team-b"), None), false),
            (s(None, Some(("team-b", "uid-b"))), false),
            // An identity of the same name re-created: the old one's claim is not its.
            (s(None, Some(("team-a", "uid-old"))), false),
            (s(Some("team-a"), Some(("team-b", "uid-b"))), false),
        ] {
            let got = a.check_claim(&meta);
            assert_eq!(got.is_ok(), ok, "{meta:?}: {got:?}");
            if let Err(why) = got {
                assert!(why.starts_with("Secret key is "), "{why}");
            }
        }
    }
}
