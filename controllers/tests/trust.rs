//! Issue 14, controller side: what a user who may write MailgunClusters/MailgunMachines can make
//! the controller believe. Owners are confirmed by UID and back-reference; our own annotations
//! are believed only in our shape; `managed-by` never strands our finalizer.
//!
//! The objects here are created by the test's admin identity, which the chart's admission
//! policy lets through (as it does `clusterctl move`): this is the controller's own line of
//! defence, behind admission.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use capm_api::{
    names,
    v1beta1::{MailState, MailgunCluster, MailgunMachine},
};
use kube::{
    ResourceExt,
    api::{
        ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
    },
};
use serde_json::{Value, json};
use support::{Env, PATIENCE, condition, eventually};

async fn create_with(env: &Env, name: &str, metadata: Value) -> MailgunCluster {
    let mut meta = json!({ "name": name });
    if let (Some(m), Some(extra)) = (meta.as_object_mut(), metadata.as_object()) {
        m.extend(extra.clone());
    }
    let obj: MailgunCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
        "kind": "MailgunCluster",
        "metadata": meta,
        "spec": { "priority": "Urgent", "request": "Three nodes, please.", "requester": "dev@example.com" }
    }))
    .unwrap();
    env.clusters()
        .create(&PostParams::default(), &obj)
        .await
        .unwrap()
}

async fn ready_reason(env: &Env, name: &str) -> Option<String> {
    let status = env.clusters().get(name).await.ok()?.status?;
    condition(&status.conditions, "Ready").map(|c| c.reason.clone())
}

async fn mail_state(env: &Env, name: &str) -> Option<MailState> {
    env.clusters().get(name).await.ok()?.status?.mail?.state
}

fn ids(env: &Env) -> Vec<String> {
    env.mails().into_iter().map(|m| m.id).collect()
}

/// Item 4: an ownerReference the owner does not confirm (its infrastructureRef names another
/// object; or the reference's UID is not the owner's) is not an owner. Before the fix both were
/// mailed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owners_are_confirmed_by_uid_and_back_reference() {
    let mut env = Env::new("trust-owner").await;
    env.start().await;
    // Two Clusters: "spoofed" (created first) and "real". Once "real" is mailed, the controller's
    // Cluster cache holds both (one watch delivers them in order), so what follows is judged
    // against cached owners. (An ownerReference seen before its Cluster reaches the cache reads
    // WaitingForOwner until the object's next event; no mail either way.)
    let other = env.create_cluster("spoofed", false).await;
    let real = env.create_cluster("real", false).await;
    env.create_mailgun_cluster("real").await;
    env.set_owner("MailgunCluster", "real", &real).await;
    eventually(PATIENCE, "the real one mailed", || async {
        mail_state(&env, "real").await == Some(MailState::Sent)
    })
    .await;
    // "squatter" claims "real" (right UID) as its owner; "real" does not name it back.
    env.create_mailgun_cluster("squatter").await;
    env.set_owner("MailgunCluster", "squatter", &real).await;
    // "spoofed" names its Cluster with a forged UID.
    env.create_mailgun_cluster("spoofed").await;
    let mut forged = other.clone();
    forged.metadata.uid = Some("00000000-0000-4000-8000-000000000000".into());
    env.set_owner("MailgunCluster", "spoofed", &forged).await;

    eventually(PATIENCE, "OwnerMismatch", || async {
        ready_reason(&env, "squatter").await.as_deref() == Some(names::reasons::OWNER_MISMATCH)
    })
    .await;
    // The garbage collector sees no owner with the forged UID and may delete "spoofed" first;
    // either way it was never mailed (and, holding no finalizer of ours, needs no release).
    eventually(PATIENCE, "OwnerMismatch or garbage-collected", || async {
        match env.clusters().get_opt("spoofed").await.unwrap() {
            None => true,
            Some(_) => {
                ready_reason(&env, "spoofed").await.as_deref()
                    == Some(names::reasons::OWNER_MISMATCH)
            }
        }
    })
    .await;
    let status = env
        .clusters()
        .get("squatter")
        .await
        .unwrap()
        .status
        .unwrap();
    let message = &condition(&status.conditions, "Ready").unwrap().message;
    assert!(message.contains("infrastructureRef"), "{message}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        env.mails().len(),
        1,
        "only the confirmed owner's object: {:?}",
        ids(&env)
    );
    env.stop().await;
}

/// Item 4: a MailgunMachine claiming another team's Machine (whose infrastructureRef names their
/// own MailgunMachine) gets nothing, and certainly not the victim's bootstrap Secret name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_machine_claiming_another_teams_machine_gets_no_mail() {
    let mut env = Env::new("trust-machine").await;
    env.start().await;
    env.create_cluster("c", false).await;
    env.mark_infrastructure_provisioned("c").await;
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "cluster.x-k8s.io",
        "v1beta2",
        "Machine",
    ));
    let victim = DynamicObject::new("victim", &ar).data(json!({
        "spec": {
            "clusterName": "c",
            "bootstrap": { "dataSecretName": "victim-bootstrap-secret" },
            "infrastructureRef": { "apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "MailgunMachine", "name": "theirs" }
        }
    }));
    let victim = env
        .capi("Machine")
        .create(&PostParams::default(), &victim)
        .await
        .unwrap();
    let thief: MailgunMachine = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
        "kind": "MailgunMachine",
        "metadata": { "name": "mine", "labels": { names::CLUSTER_NAME_LABEL: "c" } },
        "spec": { "priority": "Urgent", "request": "Give me theirs.", "requester": "dev@example.com" }
    }))
    .unwrap();
    env.machines()
        .create(&PostParams::default(), &thief)
        .await
        .unwrap();
    env.set_owner("MailgunMachine", "mine", &victim).await;
    eventually(PATIENCE, "OwnerMismatch", || async {
        let status = env.machines().get("mine").await.unwrap().status;
        status.is_some_and(|s| {
            condition(&s.conditions, "Ready")
                .is_some_and(|c| c.reason == names::reasons::OWNER_MISMATCH)
        })
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(env.mails().is_empty(), "{:#?}", env.mails());
    env.stop().await;
}

/// Item 5: values in our annotations that we did not write are not believed. A forged "sent"
/// record without an intent, an over-long value, and release records on an object that is not
/// being deleted. Before the fix: no mail but `MailSent=True` as the forged id; every status
/// write refused forever; the release suppressed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_records_are_not_believed() {
    let mut env = Env::new("trust-forged").await;
    env.start().await;
    let forged_sent = create_with(
        &env,
        "forged-sent",
        json!({ "annotations": {
            names::MAIL_SENT_ANNOTATION: "<forged@evil.example>",
            names::MAIL_ANNOTATION: r#"{"messageId":"<forged@evil.example>","state":"sent"}"#,
        } }),
    )
    .await;
    let huge = create_with(
        &env,
        "huge",
        json!({ "annotations": { names::MAIL_INTENT_ANNOTATION: "x".repeat(1500) } }),
    )
    .await;
    let no_release = create_with(
        &env,
        "no-release",
        json!({ "annotations": {
            names::DELETION_MAIL_INTENT_ANNOTATION: "<mailguncluster-deleted.x@mg.example.com>",
            names::DELETION_MAIL_SENT_ANNOTATION: "<mailguncluster-deleted.x@mg.example.com>",
            names::DELETION_MAIL_ANNOTATION:
                r#"{"messageId":"<mailguncluster-deleted.x@mg.example.com>","state":"sent"}"#,
        } }),
    )
    .await;
    for name in ["forged-sent", "huge", "no-release"] {
        env.create_owner_cluster(name, false).await;
    }
    for (name, obj) in [
        ("forged-sent", &forged_sent),
        ("huge", &huge),
        ("no-release", &no_release),
    ] {
        eventually(PATIENCE, &format!("mailed for real: {name}"), || async {
            mail_state(&env, name).await == Some(MailState::Sent)
        })
        .await;
        let status = env.clusters().get(name).await.unwrap().status.unwrap();
        let id = names::message_id("MailgunCluster", &obj.uid().unwrap(), support::DOMAIN);
        assert_eq!(status.mail.unwrap().message_id, Some(id.clone()));
        assert!(ids(&env).contains(&id), "{name}: {:?}", ids(&env));
        let message = &condition(&status.conditions, "MailSent").unwrap().message;
        assert!(!message.contains("evil"), "{message}");
    }
    let obj = env.clusters().get("no-release").await.unwrap();
    assert!(
        !obj.annotations()
            .contains_key(names::DELETION_MAIL_SENT_ANNOTATION)
    );
    assert!(
        !obj.annotations()
            .contains_key(names::DELETION_MAIL_INTENT_ANNOTATION)
    );
    assert!(
        !obj.annotations()
            .contains_key(names::DELETION_MAIL_ANNOTATION)
    );
    env.clusters()
        .delete("no-release", &DeleteParams::default())
        .await
        .unwrap();
    eventually(PATIENCE, "gone after its release", || async {
        env.clusters()
            .get_opt("no-release")
            .await
            .unwrap()
            .is_none()
    })
    .await;
    let release = names::deletion_message_id(
        "MailgunCluster",
        &no_release.uid().unwrap(),
        support::DOMAIN,
    );
    assert!(ids(&env).contains(&release), "{:?}", ids(&env));
    assert_eq!(env.mails().len(), 4);
    env.stop().await;
}

/// Item 5: an intent present at creation without our finalizer (pre-set by hand) does not skip
/// the finalizer: it is added before any mail, so deletion still sends the release. Before the
/// fix the object was deleted without a release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_preset_intent_does_not_skip_the_finalizer() {
    let mut env = Env::new("trust-preset-intent").await;
    env.start().await;
    let id = format!(
        "<mailguncluster.0a0a0a0a-0000-4000-8000-000000000001@{}>",
        support::DOMAIN
    );
    create_with(
        &env,
        "preset",
        json!({ "annotations": { names::MAIL_INTENT_ANNOTATION: id } }),
    )
    .await;
    env.create_owner_cluster("preset", false).await;
    eventually(PATIENCE, "mailed", || async {
        mail_state(&env, "preset").await == Some(MailState::Sent)
    })
    .await;
    let obj = env.clusters().get("preset").await.unwrap();
    assert!(
        obj.finalizers()
            .contains(&names::CLUSTER_FINALIZER.to_owned())
    );
    env.clusters()
        .delete("preset", &DeleteParams::default())
        .await
        .unwrap();
    eventually(PATIENCE, "gone after its release", || async {
        env.clusters().get_opt("preset").await.unwrap().is_none()
    })
    .await;
    let mails = env.mails();
    assert_eq!(mails.len(), 2, "request and release: {:?}", ids(&env));
    assert!(mails[1].subject.contains("no longer needed"));
    env.stop().await;
}

/// Item 6: `cluster.x-k8s.io/managed-by` added to an object that carries our finalizer does not
/// block its deletion; the release goes out because the request did. Before the fix the
/// object stayed forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn managed_by_does_not_strand_our_finalizer() {
    let mut env = Env::new("trust-managed-by").await;
    env.start().await;
    env.create_mailgun_cluster("handed-over").await;
    env.create_owner_cluster("handed-over", false).await;
    eventually(PATIENCE, "mailed", || async {
        mail_state(&env, "handed-over").await == Some(MailState::Sent)
    })
    .await;
    env.clusters()
        .patch(
            "handed-over",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "annotations": { names::MANAGED_BY_ANNOTATION: "someone-else" } } })),
        )
        .await
        .unwrap();
    env.clusters()
        .delete("handed-over", &DeleteParams::default())
        .await
        .unwrap();
    eventually(PATIENCE, "gone", || async {
        env.clusters()
            .get_opt("handed-over")
            .await
            .unwrap()
            .is_none()
    })
    .await;
    let mails = env.mails();
    assert_eq!(mails.len(), 2, "{:?}", ids(&env));
    assert!(mails[1].subject.contains("no longer needed"));
    env.stop().await;
}
