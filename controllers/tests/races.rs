//! Issue 13: the races Kubernetes and Cluster API really produce, played deterministically
//! against the real API server: an owner deleted before the request, an object deleted under
//! its request, requests that were never accepted, and a moved object.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::{sync::Arc, time::Duration};

use async_trait::async_trait;
use capm_api::records::{self, IntentState, Which};
use capm_api::{names, v1beta1::MailgunMachine};
use capm_mail_servers::{FailureMode, FailureRule, FailureTarget};
use capm_mailer::{Lookup, MailError, Mailer, Message, MessageId, SendReceipt};
use kube::{
    Api, ResourceExt,
    api::{
        ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams,
    },
};
use serde_json::json;
use support::{Env, PATIENCE, condition, eventually};

fn machine_ar() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(
        "cluster.x-k8s.io",
        "v1beta2",
        "Machine",
    ))
}

/// A provisioned Cluster `c`, a Machine `m` with bootstrap data (and a finalizer of its own, so
/// that deleting it leaves it in place with a deletionTimestamp), and its MailgunMachine `mm`.
async fn machine_setup(env: &Env) -> (MailgunMachine, DynamicObject) {
    env.create_cluster("c", false).await;
    env.mark_infrastructure_provisioned("c").await;
    let mm: MailgunMachine = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
        "kind": "MailgunMachine",
        "metadata": { "name": "mm", "labels": { names::CLUSTER_NAME_LABEL: "c" } },
        "spec": { "priority": "Urgent", "request": "One box.", "requester": "dev@example.com" }
    }))
    .unwrap();
    let mm = env
        .machines()
        .create(&PostParams::default(), &mm)
        .await
        .unwrap();
    let machine = DynamicObject::new("m", &machine_ar()).data(json!({
        "spec": {
            "clusterName": "c",
            "bootstrap": { "dataSecretName": "m-bootstrap" },
            "infrastructureRef": { "apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "MailgunMachine", "name": "mm" }
        }
    }));
    let mut machine = machine;
    machine.metadata.finalizers = Some(vec!["test.example.com/hold".into()]);
    let machine = env
        .capi("Machine")
        .create(&PostParams::default(), &machine)
        .await
        .unwrap();
    (mm, machine)
}

async fn release_machine_hold(env: &Env) {
    env.capi("Machine")
        .patch(
            "m",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "finalizers": null } })),
        )
        .await
        .unwrap();
}

/// Defect 2, first half: Cluster API deletes a Machine (scale down right after scale up) before
/// the provider started its MailgunMachine's request. No request is started for an object whose
/// owner is being deleted. Before the fix the request went out (and, with the delete racing the
/// finalizer, never got its release).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_request_for_a_machine_whose_owner_is_being_deleted() {
    let mut env = Env::new("race-owner-deleting").await;
    let (_, machine) = machine_setup(&env).await;
    env.capi("Machine")
        .delete("m", &DeleteParams::default())
        .await
        .unwrap();
    env.set_owner("MailgunMachine", "mm", &machine).await;
    env.start().await;
    eventually(PATIENCE, "Ready=False OwnerDeleting", || async {
        let status = env.machines().get("mm").await.unwrap().status;
        status.is_some_and(|s| {
            condition(&s.conditions, "Ready")
                .is_some_and(|c| c.reason == names::reasons::OWNER_DELETING)
        })
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(env.mails().is_empty(), "{:#?}", env.mails());
    assert!(
        env.metric(
            "capm_mail_withheld_total",
            Some(("reason", "owner_deleting"))
        ) >= 1.0
    );
    // Cluster API then deletes the MailgunMachine: it goes without any mail.
    env.machines()
        .delete("mm", &DeleteParams::default())
        .await
        .unwrap();
    eventually(PATIENCE, "the MailgunMachine to be gone", || async {
        env.machines().get_opt("mm").await.unwrap().is_none()
    })
    .await;
    release_machine_hold(&env).await;
    assert!(env.mails().is_empty());
    env.stop().await;
}

/// Plays the API server deleting the object while its request is being sent (its delete
/// decision predated our finalizer): the object is gone, finalizer and all, when the mailer
/// returns.
struct DeletesDuringSend {
    inner: Arc<dyn Mailer>,
    objects: Api<MailgunMachine>,
}

#[async_trait]
impl Mailer for DeletesDuringSend {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }
    fn tracking(&self) -> capm_mailer::Tracking {
        self.inner.tracking()
    }
    async fn send(&self, message: &Message) -> Result<SendReceipt, MailError> {
        if !message.message_id().as_str().contains("-deleted.") {
            self.objects
                .patch(
                    "mm",
                    &PatchParams::default(),
                    &Patch::Merge(json!({ "metadata": { "finalizers": null } })),
                )
                .await
                .unwrap();
            self.objects
                .delete("mm", &DeleteParams::default())
                .await
                .unwrap();
        }
        self.inner.send(message).await
    }
    async fn lookup(&self, message_id: &MessageId) -> Result<Lookup, MailError> {
        self.inner.lookup(message_id).await
    }
}

/// Defect 2, second half: recording "sent" finds the object gone right after its request went
/// out. The release goes out at once (nobody will ever reconcile it again), counted. Before the
/// fix: a request and never a release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_object_deleted_under_its_request_gets_its_release() {
    let mut env = Env::new("race-vanish").await;
    let (mm, machine) = machine_setup(&env).await;
    env.set_owner("MailgunMachine", "mm", &machine).await;
    let mailer = Arc::new(DeletesDuringSend {
        inner: env.mailer(),
        objects: env.machines(),
    });
    env.start_with_mailer(env.config(), mailer).await;
    eventually(PATIENCE, "two mails", || async { env.mails().len() >= 2 }).await;
    let uid = mm.uid().unwrap();
    let ids: Vec<String> = env.mails().into_iter().map(|m| m.id).collect();
    assert_eq!(
        ids,
        vec![
            names::message_id("MailgunMachine", &uid, support::DOMAIN),
            names::deletion_message_id("MailgunMachine", &uid, support::DOMAIN),
        ]
    );
    assert_eq!(env.metric("capm_mail_orphan_releases_total", None), 1.0);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(env.mails().len(), 2);
    release_machine_hold(&env).await;
    env.stop().await;
}

/// Defect 3: every attempt at the request was refused (429, nothing accepted). That knowledge is
/// durable (the intent says `refused`), survives a restart, and deleting the objects sends no
/// release, even once the backend accepts again. Before the fix both got "no longer needed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_never_accepted_are_not_released_even_after_a_restart() {
    let mut env = Env::new("race-refused").await;
    env.mailgun
        .set_failure(FailureRule {
            mode: FailureMode::RateLimited,
            count: None,
            retry_after: Some(1),
            target: FailureTarget::Messages,
            body_bytes: None,
            drip_ms: None,
        })
        .unwrap();
    env.start().await;
    for name in ["r1", "r2"] {
        env.create_mailgun_cluster(name).await;
        env.create_owner_cluster(name, false).await;
    }
    for name in ["r1", "r2"] {
        eventually(PATIENCE, "the intent to say refused", || async {
            let obj = env.clusters().get(name).await.unwrap();
            obj.annotations()
                .get(names::MAIL_ANNOTATION)
                .and_then(|v| records::parse_record(v, "MailgunCluster", Which::Request).ok())
                .is_some_and(|(i, sent)| i.state == IntentState::Refused && sent.is_none())
        })
        .await;
    }
    env.stop().await;
    env.start().await;
    for name in ["r1", "r2"] {
        env.clusters()
            .delete(name, &DeleteParams::default())
            .await
            .unwrap();
    }
    env.mailgun.clear_failure().unwrap();
    for name in ["r1", "r2"] {
        eventually(PATIENCE, "the object to be gone", || async {
            env.clusters().get_opt(name).await.unwrap().is_none()
        })
        .await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(env.mails().is_empty(), "{:#?}", env.mails());
    env.stop().await;
}

/// Moved by `clusterctl move` with an intent but no sent record: the retry carries the
/// Message-Id recorded in the intent (derived from the source object's UID), so receivers can
/// fold it with a copy that may have gone out before the move. Before the fix it was derived
/// from the new UID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moved_object_is_retried_under_the_message_id_of_its_intent() {
    let mut env = Env::new("race-moved").await;
    let old_id = format!(
        "<mailguncluster.7f0c1d2e-0000-4000-8000-00000000abcd@{}>",
        support::DOMAIN
    );
    let intent = json!({
        "messageId": old_id,
        "writer": "source-cluster_abcdefghij",
        "at": "2026-01-01T00:00:00Z",
        "state": "sending",
    })
    .to_string();
    let obj = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
        "kind": "MailgunCluster",
        "metadata": {
            "name": "moved",
            "annotations": { names::MAIL_INTENT_ANNOTATION: intent },
            "finalizers": [names::CLUSTER_FINALIZER],
        },
        "spec": { "priority": "Urgent", "request": "Moved.", "requester": "dev@example.com" }
    }))
    .unwrap();
    env.clusters()
        .create(&PostParams::default(), &obj)
        .await
        .unwrap();
    env.create_owner_cluster("moved", false).await;
    env.start().await;
    eventually(PATIENCE, "the request mail", || async {
        !env.mails().is_empty()
    })
    .await;
    let mails = env.mails();
    assert_eq!(mails.len(), 1);
    assert_eq!(mails[0].id, old_id);
    eventually(PATIENCE, "MailSent=True under the old id", || async {
        let status = env.clusters().get("moved").await.unwrap().status;
        status
            .and_then(|s| s.mail)
            .and_then(|m| m.message_id)
            .as_deref()
            == Some(old_id.as_str())
    })
    .await;
    assert_eq!(env.metric("capm_mail_resends_total", None), 1.0);
    env.stop().await;
}
