//! Cluster API managed topologies (ClusterClass) for the end-to-end tests: a test-only control
//! plane provider and bootstrap provider that follow the Cluster API v1beta2 contracts, just far
//! enough for the core manager's topology, MachineDeployment, MachineSet and Machine controllers.
//!
//! A ClusterClass must name a control plane template, and each MachineDeployment class a
//! bootstrap template, so a topology Cluster needs both kinds of provider besides ours. Cluster
//! API's kubeadm providers were not used: the kubeadm control plane connects to the workload
//! cluster's API server, which a mailed cluster does not have until a human builds it, and they
//! would add two Go binaries to `make tools`. What the contracts ask of these two is small:
//!
//! - control plane: `status.version` (the topology controller and the MachineSet preflight
//!   checks hold workers back until it equals `spec.version`), the replica counts, and
//!   `status.initialization.controlPlaneInitialized`;
//! - bootstrap: a data Secret, named in `status.dataSecretName`, and
//!   `status.initialization.dataSecretCreated`, which the Machine controller copies into the
//!   Machine's `spec.bootstrap.dataSecretName` (what our MailgunMachines wait for).
//!
//! Their CRDs carry the contract label (`cluster.x-k8s.io/v1beta2: v1alpha1`) and keep whatever
//! fields Cluster API writes (`x-kubernetes-preserve-unknown-fields`).

use std::time::Duration;

use anyhow::{Context, Result};
use k8s_openapi::{
    ByteString,
    api::core::v1::Secret,
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference},
};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{DynamicObject, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};

use crate::dynamic_api;

/// The test control plane provider's API group.
pub const CONTROL_PLANE_GROUP: &str = "controlplane.e2e.capm.example.com";
/// The test bootstrap provider's API group.
pub const BOOTSTRAP_GROUP: &str = "bootstrap.e2e.capm.example.com";
/// The version both test providers serve.
pub const VERSION: &str = "v1alpha1";
const INFRA: &str = "infrastructure.cluster.x-k8s.io";

/// The spec of a MachineDeployment of `cluster` whose Machines carry `label: pool`, built from the
/// `MailgunMachineTemplate` and `TestBootstrapConfigTemplate` named `pool`, with the fields Cluster
/// API's defaulting webhook (not served to the tests' API server) would set.
pub fn machine_deployment(cluster: &str, label: &str, pool: &str, replicas: usize) -> Value {
    json!({
        "clusterName": cluster,
        "replicas": replicas,
        "selector": {"matchLabels": {label: pool}},
        "rollout": {"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}},
        "deletion": {"order": "Random"},
        "template": {
            "metadata": {"labels": {label: pool}},
            "spec": {
                "clusterName": cluster,
                "version": capm_test_support::KUBERNETES_VERSION,
                "bootstrap": {"configRef": {"apiGroup": BOOTSTRAP_GROUP, "kind": "TestBootstrapConfigTemplate", "name": pool}},
                "infrastructureRef": {"apiGroup": INFRA, "kind": "MailgunMachineTemplate", "name": pool},
            },
        },
    })
}

/// A Cluster `name` in `namespace` with its `MailgunCluster` (asking for `request` on behalf of
/// `requester`) and a one-replica `TestControlPlane`.
pub async fn create_cluster(
    client: &Client,
    namespace: &str,
    name: &str,
    request: &str,
    requester: &str,
) -> Result<()> {
    let create = |group: &str, version: &str, kind: &str, spec: Value| {
        crate::create_object(client, namespace, group, version, kind, name, spec)
    };
    create(
        CONTROL_PLANE_GROUP,
        VERSION,
        "TestControlPlane",
        json!({"version": capm_test_support::KUBERNETES_VERSION, "replicas": 1}),
    )
    .await?;
    create(
        INFRA,
        "v1beta1",
        "MailgunCluster",
        json!({"priority": "Urgent", "request": request, "requester": requester}),
    )
    .await?;
    create(
        "cluster.x-k8s.io",
        "v1beta2",
        "Cluster",
        json!({
            "infrastructureRef": {"apiGroup": INFRA, "kind": "MailgunCluster", "name": name},
            "controlPlaneRef": {"apiGroup": CONTROL_PLANE_GROUP, "kind": "TestControlPlane", "name": name},
        }),
    )
    .await?;
    Ok(())
}

/// (group, kind, plural, has a status) of every test CRD.
const KINDS: [(&str, &str, &str, bool); 4] = [
    (
        CONTROL_PLANE_GROUP,
        "TestControlPlane",
        "testcontrolplanes",
        true,
    ),
    (
        CONTROL_PLANE_GROUP,
        "TestControlPlaneTemplate",
        "testcontrolplanetemplates",
        false,
    ),
    (
        BOOTSTRAP_GROUP,
        "TestBootstrapConfig",
        "testbootstrapconfigs",
        true,
    ),
    (
        BOOTSTRAP_GROUP,
        "TestBootstrapConfigTemplate",
        "testbootstrapconfigtemplates",
        false,
    ),
];

fn crd(group: &str, kind: &str, plural: &str, status: bool) -> Result<CustomResourceDefinition> {
    let open = json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true});
    let mut properties = json!({"spec": open.clone()});
    if status {
        properties["status"] = open;
    }
    Ok(serde_json::from_value(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": format!("{plural}.{group}"),
            "labels": {"cluster.x-k8s.io/v1beta2": VERSION},
        },
        "spec": {
            "group": group,
            "names": {
                "kind": kind,
                "listKind": format!("{kind}List"),
                "plural": plural,
                "singular": kind.to_lowercase(),
            },
            "scope": "Namespaced",
            "versions": [{
                "name": VERSION,
                "served": true,
                "storage": true,
                "schema": {"openAPIV3Schema": {"type": "object", "properties": properties}},
                "subresources": if status { json!({"status": {}}) } else { json!({}) },
            }],
        },
    }))?)
}

/// A ClusterClass `templateRef`.
pub fn template_ref(api_version: &str, kind: &str, name: &str) -> Value {
    json!({"templateRef": {"apiVersion": api_version, "kind": kind, "name": name}})
}

/// The ClusterClass's MachineDeployment classes, workers from the MailgunMachineTemplate
/// `machines` and the test bootstrap template `test`.
pub fn class_workers(machines: &str) -> Value {
    json!({"machineDeployments": [{
        "class": "default-worker",
        "bootstrap": template_ref(&format!("{BOOTSTRAP_GROUP}/{VERSION}"), "TestBootstrapConfigTemplate", "test"),
        "infrastructure": template_ref(&format!("{INFRA}/v1beta1"), "MailgunMachineTemplate", machines),
    }]})
}

/// The topology's MachineDeployments: one, `name`, of `replicas`. Its Machines never get a Node
/// (nobody builds the mailed machines here), so they never become Available: a rollout that
/// waited for availability (maxUnavailable 0, the default) would never remove an old Machine.
pub fn topology_workers(name: &str, replicas: usize) -> Value {
    json!({"machineDeployments": [{
        "class": "default-worker",
        "name": name,
        "replicas": replicas,
        "rollout": {"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 2}}},
    }]})
}

/// The objects of clusterctl's `clusterclass` flavor (`generated`, rendered into `namespace`),
/// made runnable here: the kubeadm control plane and bootstrap templates (whose managers the
/// tests do not run) are left out and the ClusterClass names the test providers' templates
/// `test` instead (see [`create_templates`]); the topology's MachineDeployment `md` gets
/// `replicas` and a rollout that does not wait for Nodes. Everything of ours (the Mailgun
/// templates, the variables, the patches, the Cluster's variable values, the workers' health
/// check and the remediation template it names) is as rendered; the control plane's health
/// check goes with the kubeadm control plane (the test control plane has no machines, and
/// Cluster API refuses a control plane health check without `machineInfrastructure`).
///
/// # Errors
/// When the text is not YAML, holds an unexpected kind, an object outside `namespace`, or a
/// ClusterClass without variables and patches.
pub fn runnable_clusterclass(
    generated: &str,
    namespace: &str,
    md: &str,
    replicas: usize,
) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    for mut doc in crate::clusterctl::yaml_docs(generated)? {
        let kind = doc["kind"].as_str().unwrap_or_default().to_owned();
        match kind.as_str() {
            "KubeadmControlPlaneTemplate" | "KubeadmConfigTemplate" => continue,
            "ClusterClass" => {
                anyhow::ensure!(
                    doc["spec"]["variables"].is_array() && doc["spec"]["patches"].is_array(),
                    "the ClusterClass has no variables or patches"
                );
                doc["spec"]["controlPlane"] = template_ref(
                    &format!("{CONTROL_PLANE_GROUP}/{VERSION}"),
                    "TestControlPlaneTemplate",
                    "test",
                );
                let health_check =
                    doc["spec"]["workers"]["machineDeployments"][0]["healthCheck"].clone();
                doc["spec"]["workers"] = class_workers("mailgun-machines");
                if !health_check.is_null() {
                    doc["spec"]["workers"]["machineDeployments"][0]["healthCheck"] = health_check;
                }
            }
            "Cluster" => {
                doc["spec"]["topology"]["workers"] = topology_workers(md, replicas);
            }
            "MailgunClusterTemplate" | "MailgunMachineTemplate" | "MailgunRemediationTemplate" => {}
            other => anyhow::bail!("an unexpected {other} in clusterctl's output"),
        }
        anyhow::ensure!(
            doc["metadata"]["namespace"] == namespace,
            "clusterctl puts every object into the target namespace: {}",
            doc["metadata"]
        );
        out.push(doc);
    }
    Ok(out)
}

/// Installs the test providers' CRDs and waits until they are Established.
///
/// # Errors
/// When the API server refuses them.
pub async fn install_crds(client: &Client) -> Result<()> {
    let crds = KINDS
        .iter()
        .map(|(group, kind, plural, status)| crd(group, kind, plural, *status))
        .collect::<Result<Vec<_>>>()?;
    capm_test_support::install_crds(client, &crds).await?;
    Ok(())
}

/// A `TestControlPlaneTemplate` and a `TestBootstrapConfigTemplate` named `name` in `namespace`,
/// for a ClusterClass to reference.
///
/// # Errors
/// When the API server refuses them.
pub async fn create_templates(client: &Client, namespace: &str, name: &str) -> Result<()> {
    for (group, kind) in [
        (CONTROL_PLANE_GROUP, "TestControlPlaneTemplate"),
        (BOOTSTRAP_GROUP, "TestBootstrapConfigTemplate"),
    ] {
        let object: DynamicObject = serde_json::from_value(json!({
            "apiVersion": format!("{group}/{VERSION}"),
            "kind": kind,
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"template": {"spec": {}}},
        }))?;
        dynamic_api(client, namespace, group, VERSION, kind)
            .create(&PostParams::default(), &object)
            .await
            .with_context(|| format!("creating {kind} {namespace}/{name}"))?;
    }
    Ok(())
}

/// The test control plane and bootstrap providers, reconciling `namespace` every 250 ms until
/// dropped.
#[derive(Debug)]
pub struct TestProviders {
    task: tokio::task::JoinHandle<()>,
}

impl TestProviders {
    /// Starts both providers on `namespace`.
    pub fn start(client: &Client, namespace: &str) -> Self {
        let (client, namespace) = (client.clone(), namespace.to_owned());
        let task = tokio::spawn(async move {
            let control_planes = dynamic_api(
                &client,
                &namespace,
                CONTROL_PLANE_GROUP,
                VERSION,
                "TestControlPlane",
            );
            let configs = dynamic_api(
                &client,
                &namespace,
                BOOTSTRAP_GROUP,
                VERSION,
                "TestBootstrapConfig",
            );
            let secrets: Api<Secret> = Api::namespaced(client.clone(), &namespace);
            loop {
                // A conflict or a vanished object is retried on the next pass, as a controller's
                // requeue would.
                if let Err(e) = reconcile_control_planes(&control_planes).await {
                    eprintln!("test control plane provider: {e:#}");
                }
                if let Err(e) = reconcile_bootstrap_configs(&configs, &secrets).await {
                    eprintln!("test bootstrap provider: {e:#}");
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        });
        Self { task }
    }
}

impl Drop for TestProviders {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// What the control plane contract asks of `cp`'s status, given its spec: `None` when the
/// status says it already.
fn control_plane_status(cp: &DynamicObject) -> Option<Value> {
    let version = cp.data["spec"]["version"].as_str()?;
    let replicas = cp.data["spec"]["replicas"].as_i64().unwrap_or(1);
    let status = json!({
        "version": version,
        "replicas": replicas,
        "readyReplicas": replicas,
        "availableReplicas": replicas,
        "upToDateReplicas": replicas,
        "initialization": {"controlPlaneInitialized": true},
        "observedGeneration": cp.metadata.generation,
    });
    let current = &cp.data["status"];
    let same = status
        .as_object()?
        .iter()
        .all(|(k, v)| current.get(k) == Some(v));
    (!same).then_some(status)
}

async fn reconcile_control_planes(api: &Api<DynamicObject>) -> Result<()> {
    for cp in api.list(&ListParams::default()).await?.items {
        if cp.metadata.deletion_timestamp.is_some() {
            continue;
        }
        if let Some(status) = control_plane_status(&cp) {
            api.patch_status(
                &cp.name_any(),
                &PatchParams::default(),
                &Patch::Merge(json!({"status": status})),
            )
            .await?;
        }
    }
    Ok(())
}

async fn reconcile_bootstrap_configs(
    api: &Api<DynamicObject>,
    secrets: &Api<Secret>,
) -> Result<()> {
    for config in api.list(&ListParams::default()).await?.items {
        if config.metadata.deletion_timestamp.is_some()
            || config.data["status"]["initialization"]["dataSecretCreated"] == true
        {
            continue;
        }
        let name = config.name_any();
        let owner = OwnerReference {
            api_version: format!("{BOOTSTRAP_GROUP}/{VERSION}"),
            kind: "TestBootstrapConfig".into(),
            name: name.clone(),
            uid: config.uid().context("a config without a UID")?,
            controller: Some(true),
            ..OwnerReference::default()
        };
        let secret = Secret {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                labels: config.meta().labels.clone(),
                owner_references: Some(vec![owner]),
                ..ObjectMeta::default()
            },
            type_: Some("cluster.x-k8s.io/secret".into()),
            data: Some(
                [
                    (
                        "value".to_owned(),
                        ByteString(format!("#!/bin/sh\n# bootstrap data of {name}\n").into()),
                    ),
                    ("format".to_owned(), ByteString(b"cloud-config".to_vec())),
                ]
                .into(),
            ),
            ..Secret::default()
        };
        match secrets.create(&PostParams::default(), &secret).await {
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
        api.patch_status(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {
                "dataSecretName": name,
                "initialization": {"dataSecretCreated": true},
            }})),
        )
        .await?;
    }
    Ok(())
}
