//! The Cluster API core objects (`Cluster`, `Machine`) this provider reads.
//!
//! Partial types: only the fields the provider contract names are deserialised, so the provider
//! carries no copy of Cluster API's types and the caches hold little per object. Unknown fields
//! are ignored; the types are never written back.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, OwnerReference};
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
    /// `spec.providerID`: the machine's ID, copied from its infrastructure object.
    #[serde(default, rename = "providerID")]
    pub provider_id: Option<String>,
}

/// The fields of `Machine.status` this provider reads.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MachineStatus {
    /// `status.nodeRef`: the Node the machine became.
    #[serde(default)]
    pub node_ref: Option<NodeRef>,
    /// `status.conditions` (v1beta2), among them the MachineHealthCheck's
    /// `HealthCheckSucceeded` and the owner's `OwnerRemediated`.
    #[serde(default)]
    pub conditions: Option<Vec<Condition>>,
}

/// `Machine.status.nodeRef` (v1beta2: the Node's name).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeRef {
    /// `name`.
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

    /// `status.nodeRef.name`, once the machine joined its cluster.
    pub fn node_name(&self) -> Option<&str> {
        let name = &self.status.as_ref()?.node_ref.as_ref()?.name;
        (!name.is_empty()).then_some(name.as_str())
    }

    /// The `status.conditions` entry of `type_`.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.status
            .as_ref()?
            .conditions
            .iter()
            .flatten()
            .find(|c| c.type_ == type_)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_reads_what_a_repair_request_shows() {
        let machine: Machine = serde_json::from_value(serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": { "name": "m-0", "labels": { "cluster.x-k8s.io/cluster-name": "c" } },
            "spec": { "providerID": "dc://rack4/slot12", "version": "v1.34.0" },
            "status": {
                "nodeRef": { "name": "node-12" },
                "conditions": [{
                    "type": "HealthCheckSucceeded", "status": "False", "reason": "UnhealthyNode",
                    "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z",
                }],
                "phase": "Running",
            },
        }))
        .unwrap();
        assert_eq!(
            machine.spec.provider_id.as_deref(),
            Some("dc://rack4/slot12")
        );
        assert_eq!(machine.node_name(), Some("node-12"));
        assert_eq!(machine.cluster_name().as_deref(), Some("c"));
        let health = machine.condition("HealthCheckSucceeded").unwrap();
        assert_eq!(
            (&*health.status, &*health.reason),
            ("False", "UnhealthyNode")
        );
        assert!(machine.condition("OwnerRemediated").is_none());
        // Not yet a Node, no conditions: nothing to read, no error.
        let new: Machine = serde_json::from_value(serde_json::json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": { "name": "m-1" }, "spec": { "clusterName": "c" },
            "status": { "nodeRef": {} },
        }))
        .unwrap();
        assert_eq!(
            (new.node_name(), new.spec.provider_id.as_deref()),
            (None, None)
        );
        assert!(new.condition("HealthCheckSucceeded").is_none());
    }
}
