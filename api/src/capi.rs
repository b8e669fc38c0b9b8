//! The Cluster API core objects (`Cluster`, `Machine`, `MachineHealthCheck`) this provider reads.
//!
//! Partial types: only the fields the provider contract names are deserialised, so the provider
//! carries no copy of Cluster API's types and the caches hold little per object. Unknown fields
//! are ignored; the types are never written back.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, OwnerReference};
use kube::CustomResource;
use serde::{Deserialize, Serialize};

/// The Cluster API core group.
pub const GROUP: &str = "cluster.x-k8s.io";

/// A contract-versioned reference (`spec.infrastructureRef` in v1beta2).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ContractRef {
    /// API group of the referenced object.
    #[serde(default)]
    pub api_group: String,
    /// Kind of the referenced object.
    #[serde(default)]
    pub kind: String,
    /// Name of the referenced object (same namespace).
    #[serde(default)]
    pub name: String,
}

/// The fields of `Cluster.spec` this provider reads.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "cluster.x-k8s.io",
    version = "v1beta2",
    kind = "Cluster",
    namespaced,
    status = "ClusterStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct ClusterSpec {
    /// `spec.paused`.
    #[serde(default)]
    pub paused: Option<bool>,
    /// `spec.infrastructureRef`.
    #[serde(default)]
    pub infrastructure_ref: Option<ContractRef>,
}

/// The fields of `Cluster.status` this provider reads.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// `status.initialization`.
    #[serde(default)]
    pub initialization: Option<ClusterInitialization>,
}

/// `Cluster.status.initialization`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterInitialization {
    /// `infrastructureProvisioned`.
    #[serde(default)]
    pub infrastructure_provisioned: Option<bool>,
}

/// The fields of `Machine.spec` this provider reads.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "cluster.x-k8s.io",
    version = "v1beta2",
    kind = "Machine",
    namespaced,
    status = "MachineStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct MachineSpec {
    /// `spec.clusterName`.
    #[serde(default)]
    pub cluster_name: Option<String>,
    /// `spec.bootstrap`.
    #[serde(default)]
    pub bootstrap: Option<Bootstrap>,
    /// `spec.failureDomain`.
    #[serde(default)]
    pub failure_domain: Option<String>,
    /// `spec.infrastructureRef`.
    #[serde(default)]
    pub infrastructure_ref: Option<ContractRef>,
    /// `spec.providerID`, copied by Cluster API from the infrastructure once it has one.
    #[serde(default, rename = "providerID")]
    pub provider_id: Option<String>,
}

/// The fields of `Machine.status` this provider reads (remediation by mail).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MachineStatus {
    /// `status.conditions` (v1beta2).
    #[serde(default)]
    pub conditions: Option<Vec<MachineCondition>>,
    /// `status.nodeRef`.
    #[serde(default)]
    pub node_ref: Option<NodeRef>,
}

/// One of `Machine.status.conditions`: the fields read.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MachineCondition {
    /// `type`.
    #[serde(rename = "type")]
    pub type_: String,
    /// `status`: `True`, `False` or `Unknown`.
    pub status: String,
    /// `reason`.
    #[serde(default)]
    pub reason: Option<String>,
    /// `message`.
    #[serde(default)]
    pub message: Option<String>,
}

/// `Machine.status.nodeRef`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeRef {
    /// The Node's name.
    #[serde(default)]
    pub name: String,
}

/// `Machine.spec.bootstrap`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Bootstrap {
    /// `dataSecretName`: the Secret holding the bootstrap data, once the bootstrap provider
    /// produced it.
    #[serde(default)]
    pub data_secret_name: Option<String>,
}

/// The fields of `MachineHealthCheck.spec` this provider reads: which Machines it selects (its
/// `RemediationAllowed` condition is the brake on timed hand-backs).
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[kube(
    group = "cluster.x-k8s.io",
    version = "v1beta2",
    kind = "MachineHealthCheck",
    namespaced,
    status = "MachineHealthCheckStatus",
    schema = "disabled"
)]
#[serde(rename_all = "camelCase")]
pub struct MachineHealthCheckSpec {
    /// `spec.clusterName`.
    #[serde(default)]
    pub cluster_name: Option<String>,
    /// `spec.selector`: the Machines of the Cluster it checks.
    #[serde(default)]
    pub selector: LabelSelector,
}

/// The fields of `MachineHealthCheck.status` this provider reads.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MachineHealthCheckStatus {
    /// `status.conditions` (v1beta2).
    #[serde(default)]
    pub conditions: Option<Vec<MachineCondition>>,
}

/// The MachineHealthCheck condition that is `False` while `maxUnhealthy`/`unhealthyRange` is
/// exceeded: no Machine may be remediated.
pub const REMEDIATION_ALLOWED: &str = "RemediationAllowed";

impl MachineHealthCheck {
    /// `RemediationAllowed` is `False`.
    pub fn holds_remediation(&self) -> bool {
        let conditions = self.status.as_ref().and_then(|s| s.conditions.as_ref());
        conditions.is_some_and(|c| {
            c.iter()
                .any(|c| c.type_ == REMEDIATION_ALLOWED && c.status == "False")
        })
    }
}

/// The owner reference of `kind` in group `cluster.x-k8s.io` (any version), if any.
pub fn owner<'a>(refs: &'a [OwnerReference], kind: &str) -> Option<&'a OwnerReference> {
    refs.iter()
        .find(|o| o.kind == kind && o.api_version.split_once('/').map(|(g, _)| g) == Some(GROUP))
}

impl Cluster {
    /// `spec.paused`.
    pub fn paused(&self) -> bool {
        self.spec.paused == Some(true)
    }

    /// `status.initialization.infrastructureProvisioned`.
    pub fn infrastructure_provisioned(&self) -> bool {
        self.status
            .as_ref()
            .and_then(|s| s.initialization.as_ref())
            .and_then(|i| i.infrastructure_provisioned)
            == Some(true)
    }
}

impl Machine {
    /// `spec.clusterName`, else the `cluster.x-k8s.io/cluster-name` label.
    pub fn cluster_name(&self) -> Option<String> {
        use kube::ResourceExt;
        self.spec
            .cluster_name
            .clone()
            .or_else(|| self.labels().get(crate::names::CLUSTER_NAME_LABEL).cloned())
    }

    /// `spec.bootstrap.dataSecretName`.
    pub fn bootstrap_secret(&self) -> Option<&str> {
        self.spec.bootstrap.as_ref()?.data_secret_name.as_deref()
    }

    /// The v1beta2 condition of this type, if any.
    pub fn condition(&self, type_: &str) -> Option<&MachineCondition> {
        let conditions = self.status.as_ref()?.conditions.as_ref()?;
        conditions.iter().find(|c| c.type_ == type_)
    }

    /// `status.nodeRef.name`.
    pub fn node_name(&self) -> Option<&str> {
        Some(self.status.as_ref()?.node_ref.as_ref()?.name.as_str()).filter(|n| !n.is_empty())
    }
}
