//! The local control plane behaves like a real cluster in every way the provider relies on.
#![allow(clippy::unwrap_used)] // test helpers: a failed unwrap is a failed test

use std::time::Duration;

use futures::{StreamExt, TryStreamExt};

use k8s_openapi::{
    api::{
        apps::v1::{Deployment, ReplicaSet},
        authentication::v1::{TokenRequest, TokenRequestSpec},
        core::v1::{ConfigMap, Namespace, Pod, ServiceAccount},
        rbac::v1::{Role, RoleBinding},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, Client, ResourceExt,
    api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, PostParams},
    runtime::watcher,
};
use serde_json::json;

use capm_test_support::{
    KUBERNETES_VERSION, TestNamespace, install_crds, shared, wait::eventually,
};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn from_json<T: serde::de::DeserializeOwned>(value: serde_json::Value) -> T {
    serde_json::from_value(value).expect("valid object")
}

/// How long these tests wait for a controller of the control plane.
const PATIENCE: Duration = Duration::from_secs(60);

fn status_code(err: &kube::Error) -> Option<u16> {
    match err {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}

/// A namespaced CRD `gadgets.test.capm.dev` with a CEL rule: `spec.min <= spec.max`.
fn gadget_crd() -> CustomResourceDefinition {
    from_json(json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": { "name": "gadgets.test.capm.dev" },
        "spec": {
            "group": "test.capm.dev",
            "names": { "kind": "Gadget", "plural": "gadgets", "singular": "gadget", "listKind": "GadgetList" },
            "scope": "Namespaced",
            "versions": [{
                "name": "v1", "served": true, "storage": true,
                "schema": { "openAPIV3Schema": {
                    "type": "object",
                    "properties": { "spec": {
                        "type": "object",
                        "required": ["min", "max"],
                        "properties": {
                            "min": { "type": "integer" },
                            "max": { "type": "integer" }
                        },
                        "x-kubernetes-validations": [
                            { "rule": "self.min <= self.max", "message": "spec.min must not exceed spec.max" }
                        ]
                    }}
                }}
            }]
        }
    }))
}

fn gadget_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk("test.capm.dev", "v1", "Gadget"))
}

fn gadget(name: &str, min: i64, max: i64) -> DynamicObject {
    DynamicObject::new(name, &gadget_resource()).data(json!({ "spec": { "min": min, "max": max } }))
}

#[tokio::test]
async fn version_is_stamped() -> TestResult {
    let cp = shared()?;
    let client = cp.client().await?;
    let info = client.apiserver_version().await?;
    assert_eq!(info.git_version, KUBERNETES_VERSION);
    let kubectl = cp.kubectl_output(&["version", "--client", "-o", "json"])?;
    assert!(
        kubectl.contains(KUBERNETES_VERSION),
        "kubectl version: {kubectl}"
    );
    Ok(())
}

#[tokio::test]
async fn crd_established_and_custom_resources_watched() -> TestResult {
    let ns = TestNamespace::create("crd").await?;
    install_crds(&ns.client, &[gadget_crd()]).await?;

    let api: Api<DynamicObject> =
        Api::namespaced_with(ns.client.clone(), &ns.name, &gadget_resource());
    // One watch stream, polled until its initial list is done before anything changes: a
    // watcher is lazy, so an object created and deleted before the first poll would never show.
    let mut events = watcher(api.clone(), watcher::Config::default()).boxed();
    let mut next = async || -> Result<watcher::Event<DynamicObject>, Box<dyn std::error::Error>> {
        let event = tokio::time::timeout(Duration::from_secs(30), events.try_next()).await??;
        Ok(event.ok_or("watch stream ended")?)
    };
    while !matches!(next().await?, watcher::Event::InitDone) {}

    api.create(&PostParams::default(), &gadget("g1", 1, 3))
        .await?;
    match next().await? {
        watcher::Event::Apply(seen) => {
            assert_eq!(seen.name_any(), "g1");
            assert_eq!(seen.data["spec"]["max"], 3);
        }
        other => panic!("expected the creation, got {other:?}"),
    }
    api.delete("g1", &DeleteParams::default()).await?;
    match next().await? {
        watcher::Event::Delete(gone) => assert_eq!(gone.name_any(), "g1"),
        other => panic!("expected the deletion, got {other:?}"),
    }
    assert!(api.get_opt("g1").await?.is_none());
    Ok(())
}

#[tokio::test]
async fn cel_rule_rejects_invalid_object() -> TestResult {
    let ns = TestNamespace::create("cel").await?;
    install_crds(&ns.client, &[gadget_crd()]).await?;
    let api: Api<DynamicObject> =
        Api::namespaced_with(ns.client.clone(), &ns.name, &gadget_resource());
    let err = api
        .create(&PostParams::default(), &gadget("bad", 5, 1))
        .await
        .expect_err("min > max must be rejected");
    assert_eq!(status_code(&err), Some(422), "{err}");
    assert!(
        err.to_string()
            .contains("spec.min must not exceed spec.max"),
        "{err}"
    );
    assert!(api.get_opt("bad").await?.is_none());
    api.create(&PostParams::default(), &gadget("good", 1, 5))
        .await?;
    Ok(())
}

#[tokio::test]
async fn namespace_deletion_collects_its_objects() -> TestResult {
    let ns = TestNamespace::create("gc").await?;
    let cms: Api<ConfigMap> = ns.api();
    cms.create(
        &PostParams::default(),
        &from_json(json!({ "metadata": { "name": "doomed" }, "data": { "a": "b" } })),
    )
    .await?;
    let namespaces: Api<Namespace> = Api::all(ns.client.clone());
    namespaces
        .delete(&ns.name, &DeleteParams::default())
        .await?;
    // The namespace controller empties the namespace, then the namespace itself disappears.
    eventually(PATIENCE, "the namespace to be deleted", || async {
        Ok::<_, kube::Error>(namespaces.get_opt(&ns.name).await?.is_none())
    })
    .await;
    let all_cms: Api<ConfigMap> = Api::all(ns.client.clone());
    let left = all_cms
        .list(&ListParams::default().fields(&format!("metadata.namespace={}", ns.name)))
        .await?;
    assert!(left.items.is_empty(), "left behind: {:?}", left.items);
    Ok(())
}

fn restricted_pod_spec() -> serde_json::Value {
    json!({
        "securityContext": { "runAsNonRoot": true, "runAsUser": 65532, "seccompProfile": { "type": "RuntimeDefault" } },
        "containers": [{
            "name": "pause",
            "image": "registry.k8s.io/pause:3.10",
            "securityContext": {
                "allowPrivilegeEscalation": false,
                "capabilities": { "drop": ["ALL"] }
            }
        }]
    })
}

#[tokio::test]
async fn deployment_creates_replicaset_and_pods() -> TestResult {
    let ns = TestNamespace::create("deploy").await?;
    // Pods are admitted only once the ServiceAccount controller has made `default`.
    let sas: Api<ServiceAccount> = ns.api();
    eventually(PATIENCE, "the default ServiceAccount", || async {
        Ok::<_, kube::Error>(sas.get_opt("default").await?.is_some())
    })
    .await;

    let deployments: Api<Deployment> = ns.api();
    deployments
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": { "name": "web" },
                "spec": {
                    "replicas": 2,
                    "selector": { "matchLabels": { "app": "web" } },
                    "template": { "metadata": { "labels": { "app": "web" } }, "spec": restricted_pod_spec() }
                }
            })),
        )
        .await?;
    let replicasets: Api<ReplicaSet> = ns.api();
    eventually(PATIENCE, "a ReplicaSet owned by the Deployment", || async {
        Ok::<_, kube::Error>(
            replicasets
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .any(|rs| {
                    rs.owner_references()
                        .iter()
                        .any(|o| o.kind == "Deployment" && o.name == "web")
                }),
        )
    })
    .await;
    let pods: Api<Pod> = ns.api();
    eventually(PATIENCE, "two Pods owned by the ReplicaSet", || async {
        let owned = pods
            .list(&ListParams::default().labels("app=web"))
            .await?
            .items
            .iter()
            .filter(|p| p.owner_references().iter().any(|o| o.kind == "ReplicaSet"))
            .count();
        Ok::<_, kube::Error>(owned == 2)
    })
    .await;
    Ok(())
}

#[tokio::test]
async fn pod_security_restricted_rejects_noncompliant_pod() -> TestResult {
    let ns = TestNamespace::create_with_labels(
        "psa",
        &[("pod-security.kubernetes.io/enforce", "restricted")],
    )
    .await?;
    let sas: Api<ServiceAccount> = ns.api();
    eventually(PATIENCE, "the default ServiceAccount", || async {
        Ok::<_, kube::Error>(sas.get_opt("default").await?.is_some())
    })
    .await;
    let pods: Api<Pod> = ns.api();
    // Baseline-compliant, but runs as root with privilege escalation and all capabilities.
    let noncompliant: Pod = from_json(json!({
        "metadata": { "name": "noncompliant" },
        "spec": { "containers": [{ "name": "c", "image": "registry.k8s.io/pause:3.10" }] }
    }));
    let err = pods
        .create(&PostParams::default(), &noncompliant)
        .await
        .expect_err("a Pod breaking the restricted profile must be rejected");
    assert_eq!(status_code(&err), Some(403), "{err}");
    assert!(
        err.to_string()
            .contains("violates PodSecurity \"restricted"),
        "{err}"
    );
    // The same namespace admits a compliant Pod: the rejection is Pod Security, not something else.
    pods.create(
        &PostParams::default(),
        &from_json(json!({ "metadata": { "name": "compliant" }, "spec": restricted_pod_spec() })),
    )
    .await?;
    Ok(())
}

#[tokio::test]
async fn rbac_denies_unbound_user_and_allows_bound_service_account() -> TestResult {
    let ns = TestNamespace::create("rbac").await?;
    let cp = ns.control_plane();

    // A user with no binding at all (the admin impersonates it).
    let mut jane = cp.config().await?;
    jane.auth_info.impersonate = Some("jane".into());
    let jane = Client::try_from(jane)?;
    let err = Api::<ConfigMap>::namespaced(jane, &ns.name)
        .list(&ListParams::default())
        .await
        .expect_err("an unbound user must be denied");
    assert_eq!(status_code(&err), Some(403), "{err}");

    // A ServiceAccount authenticated by a token from the TokenRequest API.
    let sas: Api<ServiceAccount> = ns.api();
    sas.create(
        &PostParams::default(),
        &from_json(json!({ "metadata": { "name": "reader" } })),
    )
    .await?;
    let token = sas
        .create_token_request(
            "reader",
            &PostParams::default(),
            &TokenRequest {
                spec: Some(TokenRequestSpec {
                    expiration_seconds: Some(600),
                    ..TokenRequestSpec::default()
                }),
                ..TokenRequest::default()
            },
        )
        .await?
        .status
        .and_then(|s| s.token)
        .expect("a token in the TokenRequest status");
    let mut config = cp.config().await?;
    config.auth_info = kube::config::AuthInfo {
        token: Some(token.into()),
        ..kube::config::AuthInfo::default()
    };
    let reader = Client::try_from(config)?;
    let reader_cms = Api::<ConfigMap>::namespaced(reader.clone(), &ns.name);
    let err = reader_cms
        .list(&ListParams::default())
        .await
        .expect_err("denied before the RoleBinding exists");
    assert_eq!(status_code(&err), Some(403), "{err}");

    let roles: Api<Role> = ns.api();
    roles
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": { "name": "configmap-reader" },
                "rules": [{ "apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"] }]
            })),
        )
        .await?;
    let bindings: Api<RoleBinding> = ns.api();
    bindings
        .create(
            &PostParams::default(),
            &from_json(json!({
                "metadata": { "name": "reader" },
                "roleRef": { "apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "configmap-reader" },
                "subjects": [{ "kind": "ServiceAccount", "name": "reader", "namespace": ns.name }]
            })),
        )
        .await?;
    eventually(PATIENCE, "the RoleBinding to take effect", || async {
        match reader_cms.list(&ListParams::default()).await {
            Ok(_) => Ok(true),
            Err(e) if status_code(&e) == Some(403) => Ok(false),
            Err(e) => Err(e),
        }
    })
    .await;
    // Only what the Role grants: Secrets stay forbidden.
    let err = Api::<k8s_openapi::api::core::v1::Secret>::namespaced(reader, &ns.name)
        .list(&ListParams::default())
        .await
        .expect_err("secrets are not granted");
    assert_eq!(status_code(&err), Some(403), "{err}");
    Ok(())
}
