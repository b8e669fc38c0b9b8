//! Repair requests (issue 56) made by the tests as a MachineHealthCheck makes them: a Machine
//! marked unhealthy, a `MailgunRemediation` for it, and its repair mail's link as the controller
//! mints it.

use anyhow::{Context, Result};
use capm_api::link_token::{DEFAULT_VALIDITY, KeyRing, Keys, Links};
use capm_test_support::ControlPlane;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{
    Client, ResourceExt,
    api::{DynamicObject, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};
use std::time::Duration;

use crate::{dynamic_api, dynamic_object, provider_username};

const INFRA: &str = "infrastructure.cluster.x-k8s.io";

/// The `MailgunRemediation`s of `namespace`.
fn remediations(client: &Client, namespace: &str) -> kube::Api<DynamicObject> {
    dynamic_api(client, namespace, INFRA, "v1beta1", "MailgunRemediation")
}

/// Marks the Machine `name` of `namespace` unhealthy as a MachineHealthCheck does:
/// `HealthCheckSucceeded=False` added to its v1beta2 conditions, the others kept (the core
/// manager writes them too: a conflict with its write is tried again). Returns the Machine.
///
/// # Errors
/// When the Machine cannot be read or patched within 30 s.
pub async fn fail_health_check(
    admin: &Client,
    namespace: &str,
    name: &str,
) -> Result<DynamicObject> {
    let machines = dynamic_api(
        admin,
        namespace,
        capm_api::capi::GROUP,
        "v1beta2",
        "Machine",
    );
    crate::eventually(
        Duration::from_secs(30),
        &format!("Machine {name} marked unhealthy"),
        || async {
            let live = machines.get(name).await?;
            let mut conditions: Vec<Value> = live.data["status"]["conditions"]
                .as_array()
                .cloned()
                .unwrap_or_default();
            conditions.retain(|c| c["type"] != "HealthCheckSucceeded");
            conditions.push(json!({"type": "HealthCheckSucceeded", "status": "False",
                "reason": "UnhealthyNode",
                "message": "Condition Ready on Node is reporting status Unknown for more than 15m0s",
                "lastTransitionTime": jiff::Timestamp::now().round(jiff::Unit::Second)?.to_string()}));
            let patch = json!({"metadata": {"resourceVersion": live.resource_version()},
                "status": {"conditions": conditions}});
            match machines
                .patch_status(name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                Ok(machine) => Ok(Some(machine)),
                Err(kube::Error::Api(e)) if e.code == 409 => Ok(None),
                Err(e) => Err(e.into()),
            }
        },
    )
    .await
}

/// Creates the `MailgunRemediation` `name` in `namespace` with `spec`. With `machine`, as a
/// MachineHealthCheck creates one for it: named like it (`name` is the Machine's), an
/// ownerReference to it and its cluster-name label.
///
/// # Errors
/// When the Machine has no UID or the API server refuses the object.
pub async fn create_remediation(
    admin: &Client,
    namespace: &str,
    name: &str,
    machine: Option<&DynamicObject>,
    spec: Value,
) -> Result<DynamicObject> {
    let mut object = dynamic_object(
        &format!("{INFRA}/v1beta1"),
        "MailgunRemediation",
        namespace,
        name,
        spec,
    )?;
    if let Some(machine) = machine {
        let cluster = machine.data["spec"]["clusterName"]
            .as_str()
            .context("the Machine's cluster")?;
        object.metadata.labels = Some(
            [(
                capm_api::names::CLUSTER_NAME_LABEL.to_owned(),
                cluster.to_owned(),
            )]
            .into(),
        );
        object.metadata.owner_references = Some(vec![OwnerReference {
            api_version: format!("{}/v1beta2", capm_api::capi::GROUP),
            kind: "Machine".into(),
            name: machine.name_any(),
            uid: machine.uid().context("the Machine's UID")?,
            ..OwnerReference::default()
        }]);
    }
    remediations(admin, namespace)
        .create(&PostParams::default(), &object)
        .await
        .with_context(|| format!("creating MailgunRemediation {name}"))
}

/// The link of the repair mail of `remediation` (as [`create_remediation`] returns it), as the
/// remediation controller mints it: its repair mail's record written as the provider's
/// ServiceAccount (the only writer the annotation policy lets add it), sent from `domain`, and
/// the link sealed with `key` for the page at `base_url`.
///
/// # Errors
/// When the record cannot be written or no link can be made.
pub async fn repair_link(
    cp: &ControlPlane,
    remediation: &DynamicObject,
    domain: &str,
    base_url: &str,
    key: &str,
) -> Result<String> {
    let (name, uid) = (
        remediation.name_any(),
        remediation.uid().context("the remediation's UID")?,
    );
    let namespace = remediation
        .namespace()
        .context("the remediation's namespace")?;
    let mut config = cp.config().await?;
    config.auth_info.impersonate = Some(provider_username());
    let as_provider = remediations(&Client::try_from(config)?, &namespace);
    let record = json!({
        "messageId": format!("<mailgunremediation.{uid}@{domain}>"), "state": "sent",
        "backendId": format!("<repair.{uid}@{domain}>"),
    });
    let recorded = as_provider
        .patch(
            &name,
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {"annotations": {capm_api::names::MAIL_ANNOTATION: record.to_string()}},
            })),
        )
        .await
        .context("the repair mail's record, as the provider")?;
    let links = Links {
        base_url: base_url.to_owned(),
        validity: DEFAULT_VALIDITY,
        keys: KeyRing::new(Keys::parse(key)?),
    };
    links
        .repair_link(&recorded.metadata, domain, std::time::SystemTime::now())
        .context("a repair link")
}
