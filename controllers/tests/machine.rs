//! The MailgunMachine controller: it waits for the Cluster's infrastructure and the bootstrap
//! data, mails once, and publishes the machine once a human records it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use capm_api::{names, v1beta1::MailgunMachine};
use kube::{
    ResourceExt,
    api::{
        ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
    },
};
use serde_json::json;
use support::{Env, PATIENCE, condition, eventually};

async fn ready_reason(env: &Env, name: &str) -> Option<String> {
    let status = env.machines().get(name).await.unwrap().status?;
    condition(&status.conditions, "Ready").map(|c| c.reason.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn machine_waits_for_infrastructure_and_bootstrap_then_mails_once() {
    let mut env = Env::new("mgm").await;
    env.start().await;
    env.create_cluster("c1", false).await;
    let mm: MailgunMachine = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
        "kind": "MailgunMachine",
        "metadata": { "name": "c1-m1", "labels": { names::CLUSTER_NAME_LABEL: "c1" } },
        "spec": { "priority": "BusinessCritical", "request": "A big one.", "requester": "dev@example.com" }
    }))
    .unwrap();
    let created = env
        .machines()
        .create(&PostParams::default(), &mm)
        .await
        .unwrap();
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "cluster.x-k8s.io",
        "v1beta2",
        "Machine",
    ));
    let machine = DynamicObject::new("m1", &ar).data(json!({
        "spec": {
            "clusterName": "c1",
            "failureDomain": "rack-7",
            "bootstrap": {},
            "infrastructureRef": { "apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "MailgunMachine", "name": "c1-m1" }
        }
    }));
    let machine = env
        .capi("Machine")
        .create(&PostParams::default(), &machine)
        .await
        .unwrap();
    env.set_owner("MailgunMachine", "c1-m1", &machine).await;

    eventually(PATIENCE, "WaitingForClusterInfrastructure", || async {
        ready_reason(&env, "c1-m1").await.as_deref()
            == Some(names::reasons::WAITING_FOR_CLUSTER_INFRASTRUCTURE)
    })
    .await;
    env.mark_infrastructure_provisioned("c1").await;
    eventually(PATIENCE, "WaitingForBootstrapData", || async {
        ready_reason(&env, "c1-m1").await.as_deref()
            == Some(names::reasons::WAITING_FOR_BOOTSTRAP_DATA)
    })
    .await;
    assert!(env.mails().is_empty());

    env.capi("Machine")
        .patch(
            "m1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "bootstrap": { "dataSecretName": "m1-bootstrap" } } })),
        )
        .await
        .unwrap();
    eventually(PATIENCE, "the machine request mail", || async {
        !env.mails().is_empty()
    })
    .await;
    let mails = env.mails();
    assert_eq!(mails.len(), 1);
    let mail = &mails[0];
    assert_eq!(
        mail.subject,
        "[BusinessCritical] New Machine c1-m1 for Cluster c1 requested"
    );
    assert_eq!(
        mail.id,
        format!(
            "<mailgunmachine.{}@{}>",
            created.uid().unwrap(),
            support::DOMAIN
        )
    );
    let text = mail.text.as_deref().unwrap();
    for needle in [
        "c1-m1",
        "Cluster: c1",
        "Failure domain: rack-7",
        &format!("Secret {}/m1-bootstrap", env.ns.name),
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }

    // The human records the machine.
    env.machines()
        .patch(
            "c1-m1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": {
                "providerID": "mailgun://rack-7/m1",
                "addresses": [{ "type": "InternalIP", "address": "10.0.7.1" }]
            } })),
        )
        .await
        .unwrap();
    eventually(PATIENCE, "provisioned with addresses", || async {
        let status = env
            .machines()
            .get("c1-m1")
            .await
            .unwrap()
            .status
            .unwrap_or_default();
        status.initialization.and_then(|i| i.provisioned) == Some(true)
            && status
                .addresses
                .as_ref()
                .is_some_and(|a| a.len() == 1 && a[0].address == "10.0.7.1")
    })
    .await;
    assert_eq!(env.mails().len(), 1);

    env.machines()
        .delete("c1-m1", &DeleteParams::default())
        .await
        .unwrap();
    eventually(PATIENCE, "the MailgunMachine to be gone", || async {
        env.machines().get_opt("c1-m1").await.unwrap().is_none()
    })
    .await;
    let mails = env.mails();
    assert_eq!(mails.len(), 2);
    assert!(
        mails[1]
            .text
            .as_deref()
            .unwrap()
            .contains("mailgun://rack-7/m1")
    );
    env.stop().await;
}
