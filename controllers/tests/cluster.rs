//! The MailgunCluster controller against the real API server and the Mailgun contract server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use capm_api::names;
use capm_api::records::{self, Which};
use kube::{
    ResourceExt,
    api::{DeleteParams, Patch, PatchParams},
};
use serde_json::json;
use support::{Env, PATIENCE, condition, eventually};

async fn sent_status(env: &Env, name: &str) -> bool {
    let obj = env.clusters().get(name).await.unwrap();
    obj.status
        .as_ref()
        .and_then(|s| s.mail.as_ref())
        .and_then(|m| m.state)
        == Some(capm_api::v1beta1::MailState::Sent)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_mailed_once_then_fulfilled_then_cancelled_on_delete() {
    let mut env = Env::new("mgc-lifecycle").await;
    env.start().await;
    let created = env.create_mailgun_cluster("alpha").await;

    // No owner yet: wait, say so, send nothing.
    eventually(PATIENCE, "WaitingForOwner", || async {
        let obj = env.clusters().get("alpha").await.unwrap();
        let status = obj.status.unwrap_or_default();
        condition(&status.conditions, "Ready")
            .is_some_and(|c| c.reason == names::reasons::WAITING_FOR_OWNER)
    })
    .await;
    assert!(env.mails().is_empty());

    // Cluster API sets the owner reference after creation.
    env.create_owner_cluster("alpha", false).await;
    eventually(PATIENCE, "the request mail", || async {
        sent_status(&env, "alpha").await
    })
    .await;
    let mails = env.mails();
    assert_eq!(mails.len(), 1, "{mails:#?}");
    let mail = &mails[0];
    let uid = created.uid().unwrap();
    assert_eq!(mail.subject, "[Urgent] New Cluster alpha requested");
    // DMARC: From is the sending side, the requester gets the replies.
    assert_eq!(mail.from, format!("capm@{}", support::DOMAIN));
    assert_eq!(
        mail.headers.get("Reply-To").map(String::as_str),
        Some("dev@example.com")
    );
    assert_eq!(mail.to, vec![support::RECIPIENT.to_string()]);
    assert_eq!(
        mail.id,
        format!("<mailguncluster.{uid}@{}>", support::DOMAIN)
    );
    let text = mail.text.as_deref().unwrap();
    assert!(
        text.starts_with("Hello! One cluster please.\n\nThree nodes, please."),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "kubectl patch mailguncluster alpha -n {}",
            env.ns.name
        )),
        "{text}"
    );

    let obj = env.clusters().get("alpha").await.unwrap();
    let (intent, sent) = records::parse_record(
        &obj.annotations()[names::MAIL_ANNOTATION],
        "MailgunCluster",
        Which::Request,
    )
    .unwrap();
    assert_eq!(intent.message_id, mail.id);
    let sent = sent.expect("the one record says sent");
    assert_eq!(sent.backend_id, mail.id);
    assert!(sent.at.is_some());
    for legacy in [names::MAIL_INTENT_ANNOTATION, names::MAIL_SENT_ANNOTATION] {
        assert!(
            !obj.annotations().contains_key(legacy),
            "{legacy} is not written"
        );
    }
    assert!(
        obj.finalizers()
            .contains(&names::CLUSTER_FINALIZER.to_string())
    );
    let status = obj.status.clone().unwrap();
    assert_eq!(
        condition(&status.conditions, "MailSent").unwrap().status,
        "True"
    );
    assert_eq!(
        condition(&status.conditions, "Ready").unwrap().reason,
        names::reasons::WAITING_FOR_FULFILLMENT
    );
    assert_eq!(status.observed_generation, obj.metadata.generation);

    // Unrelated changes trigger more reconciles; none sends again.
    for i in 0..5 {
        env.clusters()
            .patch(
                "alpha",
                &PatchParams::default(),
                &Patch::Merge(json!({ "metadata": { "labels": { "poke": i.to_string() } } })),
            )
            .await
            .unwrap();
    }
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert_eq!(env.mails().len(), 1);

    // The human fulfils the request.
    env.fulfil_cluster("alpha").await;
    eventually(PATIENCE, "provisioned", || async {
        let obj = env.clusters().get("alpha").await.unwrap();
        let status = obj.status.unwrap_or_default();
        status.initialization.and_then(|i| i.provisioned) == Some(true)
            && condition(&status.conditions, "Ready").is_some_and(|c| c.status == "True")
    })
    .await;
    assert!(
        env.metric(
            "controller_runtime_reconcile_total",
            Some(("controller", "mailguncluster"))
        ) > 0.0
    );

    // Deletion: one "no longer needed" mail, then the finalizer goes and the object with it.
    env.clusters()
        .delete("alpha", &DeleteParams::default())
        .await
        .unwrap();
    eventually(PATIENCE, "the object to be gone", || async {
        env.clusters().get_opt("alpha").await.unwrap().is_none()
    })
    .await;
    let mails = env.mails();
    assert_eq!(mails.len(), 2, "{mails:#?}");
    assert_eq!(mails[1].subject, "[Urgent] Cluster alpha no longer needed");
    assert_eq!(
        mails[1].id,
        format!("<mailguncluster-deleted.{uid}@{}>", support::DOMAIN)
    );
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_cluster_sends_nothing_until_unpaused() {
    let mut env = Env::new("mgc-paused").await;
    env.start().await;
    env.create_mailgun_cluster("beta").await;
    env.create_owner_cluster("beta", true).await;
    eventually(PATIENCE, "Paused=True", || async {
        let status = env
            .clusters()
            .get("beta")
            .await
            .unwrap()
            .status
            .unwrap_or_default();
        condition(&status.conditions, "Paused").is_some_and(|c| c.status == "True")
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert!(env.mails().is_empty());

    env.patch_cluster_spec("beta", json!({ "paused": false }))
        .await;
    eventually(PATIENCE, "the request mail", || async {
        sent_status(&env, "beta").await
    })
    .await;
    let status = env.clusters().get("beta").await.unwrap().status.unwrap();
    assert_eq!(
        condition(&status.conditions, "Paused").unwrap().status,
        "False"
    );
    assert_eq!(env.mails().len(), 1);
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_and_wiped_status_send_no_second_mail() {
    let mut env = Env::new("mgc-restart").await;
    env.start().await;
    env.create_mailgun_cluster("gamma").await;
    env.create_owner_cluster("gamma", false).await;
    eventually(PATIENCE, "the request mail", || async {
        sent_status(&env, "gamma").await
    })
    .await;
    let sent_at = env
        .clusters()
        .get("gamma")
        .await
        .unwrap()
        .status
        .unwrap()
        .mail
        .unwrap()
        .sent_at;
    assert!(sent_at.is_some());
    env.stop().await;

    // Wipe the status, as `clusterctl move` does, and start a new controller process.
    env.clusters()
        .patch_status(
            "gamma",
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": null })),
        )
        .await
        .unwrap();
    assert!(
        env.clusters()
            .get("gamma")
            .await
            .unwrap()
            .status
            .is_none_or(|s| s.mail.is_none())
    );
    env.start().await;
    eventually(PATIENCE, "the status rebuilt from metadata", || async {
        sent_status(&env, "gamma").await
    })
    .await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    assert_eq!(env.mails().len(), 1);
    assert_eq!(env.metric("capm_mail_resends_total", None), 0.0);
    // Issue 13: the time it was sent is part of the durable record, not lost with status.
    let rebuilt = env
        .clusters()
        .get("gamma")
        .await
        .unwrap()
        .status
        .unwrap()
        .mail
        .unwrap();
    assert_eq!(rebuilt.sent_at, sent_at);
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backend_down_then_up_delivers_once() {
    use capm_mail_servers::{FailureMode, FailureRule, FailureTarget};
    let mut env = Env::new("mgc-down").await;
    // Every send answers 500 without storing: outcome unknown, so the controller looks up
    // before each new attempt and finds nothing.
    env.mailgun
        .set_failure(FailureRule {
            mode: FailureMode::ServerError,
            count: None,
            retry_after: None,
            target: FailureTarget::Messages,
            body_bytes: None,
            drip_ms: None,
        })
        .unwrap();
    env.start().await;
    env.create_mailgun_cluster("delta").await;
    env.create_owner_cluster("delta", false).await;
    eventually(
        PATIENCE,
        "MailSent=False with the failure reported",
        || async {
            let status = env
                .clusters()
                .get("delta")
                .await
                .unwrap()
                .status
                .unwrap_or_default();
            condition(&status.conditions, "MailSent")
                .is_some_and(|c| c.status == "False" && c.message.contains("500"))
        },
    )
    .await;
    assert!(env.mails().is_empty());
    env.mailgun.clear_failure().unwrap();
    eventually(PATIENCE, "the request mail", || async {
        sent_status(&env, "delta").await
    })
    .await;
    assert_eq!(env.mails().len(), 1);
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accepted_despite_error_is_found_by_lookup_not_resent() {
    use capm_mail_servers::{FailureMode, FailureRule, FailureTarget};
    let mut env = Env::new("mgc-lookup").await;
    // The backend stores the mail but answers 500 once: the controller must find it by lookup.
    env.mailgun
        .set_failure(FailureRule {
            mode: FailureMode::AcceptThenServerError,
            count: Some(1),
            retry_after: None,
            target: FailureTarget::Messages,
            body_bytes: None,
            drip_ms: None,
        })
        .unwrap();
    env.start().await;
    env.create_mailgun_cluster("epsilon").await;
    env.create_owner_cluster("epsilon", false).await;
    eventually(PATIENCE, "the request mail recorded", || async {
        sent_status(&env, "epsilon").await
    })
    .await;
    assert_eq!(env.mails().len(), 1);
    assert_eq!(env.metric("capm_mail_resends_total", None), 0.0);
    env.stop().await;
}

/// Makes the backend refuse everything with 401, starts the controllers, creates `name` with its
/// owner Cluster, and waits until the refusal shows as `MailFailed`.
async fn refuse_and_wait_for_mail_failed(env: &mut Env, name: &str) {
    use capm_mail_servers::{FailureMode, FailureRule, FailureTarget};
    env.mailgun
        .set_failure(FailureRule {
            mode: FailureMode::Unauthorized,
            count: None,
            retry_after: None,
            target: FailureTarget::All,
            body_bytes: None,
            drip_ms: None,
        })
        .unwrap();
    env.start().await;
    env.create_mailgun_cluster(name).await;
    env.create_owner_cluster(name, false).await;
    eventually(PATIENCE, "MailFailed", || async {
        let status = env
            .clusters()
            .get(name)
            .await
            .unwrap()
            .status
            .unwrap_or_default();
        condition(&status.conditions, "MailSent")
            .is_some_and(|c| c.reason == names::reasons::MAIL_FAILED)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permanent_failure_is_reported_and_not_retried_until_a_restart() {
    let mut env = Env::new("mgc-401").await;
    refuse_and_wait_for_mail_failed(&mut env, "zeta").await;
    let status = env.clusters().get("zeta").await.unwrap().status.unwrap();
    assert_eq!(
        status.mail.unwrap().state,
        Some(capm_api::v1beta1::MailState::Failed)
    );
    let failed = condition(&status.conditions, "MailSent")
        .unwrap()
        .message
        .clone();
    assert!(failed.contains("not retried automatically"), "{failed}");
    // No secret in what users see.
    let text = serde_json::to_string(&status.conditions).unwrap();
    assert!(!text.contains(support::API_KEY), "{text}");
    // Not retried automatically: the backend accepts again, yet nothing is sent, even when
    // unrelated changes trigger reconciles (before the fix: retried at once, then on a timer).
    let errors = env.metric("controller_runtime_reconcile_errors_total", None);
    env.mailgun.clear_failure().unwrap();
    for i in 0..3 {
        env.clusters()
            .patch(
                "zeta",
                &PatchParams::default(),
                &Patch::Merge(json!({ "metadata": { "labels": { "poke": i.to_string() } } })),
            )
            .await
            .unwrap();
    }
    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
    assert!(env.mails().is_empty(), "a permanent refusal was retried");
    assert_eq!(
        env.metric("controller_runtime_reconcile_errors_total", None),
        errors,
        "no further send attempt"
    );
    // A restart of the provider (after fixing its credentials) retries, once.
    env.stop().await;
    env.start().await;
    eventually(PATIENCE, "the request mail", || async {
        sent_status(&env, "zeta").await
    })
    .await;
    assert_eq!(env.mails().len(), 1);
    env.stop().await;
}

/// The number of `MailRetried` Events about `name`.
async fn retried_events(env: &Env, name: &str) -> usize {
    let events: kube::Api<k8s_openapi::api::events::v1::Event> =
        kube::Api::namespaced(env.ns.client.clone(), &env.ns.name);
    let list = events.list(&Default::default()).await.unwrap().items;
    list.iter()
        .filter(|e| {
            e.reason.as_deref() == Some(names::reasons::MAIL_RETRIED)
                && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name)
        })
        .map(|e| e.series.as_ref().map_or(1, |s| s.count as usize))
        .sum()
}

async fn annotate_retry(env: &Env, name: &str, value: &str) {
    let patch = json!({ "metadata": { "annotations": { names::RETRY_ANNOTATION: value } } });
    let params = PatchParams::default();
    env.clusters()
        .patch(name, &params, &Patch::Merge(patch))
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retry_annotation_retries_a_refused_mail_once_without_a_restart() {
    let mut env = Env::new("mgc-retry").await;
    refuse_and_wait_for_mail_failed(&mut env, "iota").await;
    // A failed reconcile is a send the backend refused (a withheld one is no error).
    let errors = || env.metric("controller_runtime_reconcile_errors_total", None);
    let before = errors();
    // Still refused: the annotation retries once, and the retry is refused.
    annotate_retry(&env, "iota", "1").await;
    eventually(PATIENCE, "one retry, refused", || async {
        errors() > before && retried_events(&env, "iota").await == 1
    })
    .await;
    // The same value asks nothing more, whatever else changes.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let after = errors();
    let labels = json!({ "metadata": { "labels": { "poke": "1" } } });
    env.clusters()
        .patch("iota", &PatchParams::default(), &Patch::Merge(labels))
        .await
        .unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert_eq!(errors(), after, "retried without a new value");
    assert_eq!(retried_events(&env, "iota").await, 1);
    assert!(env.mails().is_empty());
    // Fixed at the backend, a new value: one mail, no restart.
    env.mailgun.clear_failure().unwrap();
    annotate_retry(&env, "iota", "2").await;
    eventually(PATIENCE, "the request mail", || async {
        sent_status(&env, "iota").await
    })
    .await;
    assert_eq!(env.mails().len(), 1);
    assert_eq!(retried_events(&env, "iota").await, 2);
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_before_start_returns_promptly() {
    // Promptly: well within the 30 s `Env::stop` allows any shutdown.
    const PROMPTLY: std::time::Duration = std::time::Duration::from_secs(5);
    let mut env = Env::new("mgc-early-stop").await;
    // The stop signal is already there when the controllers come up.
    env.start().await;
    let stopping = std::time::Instant::now();
    env.stop().await;
    assert!(stopping.elapsed() < PROMPTLY, "{:?}", stopping.elapsed());
    env.start().await;
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    let stopping = std::time::Instant::now();
    env.stop().await;
    assert!(stopping.elapsed() < PROMPTLY, "{:?}", stopping.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_refused_for_good_does_not_block_deletion() {
    let mut env = Env::new("mgc-refused-delete").await;
    refuse_and_wait_for_mail_failed(&mut env, "eta").await;
    // Nothing went out, so nothing is cancelled: the finalizer goes without a mail.
    env.clusters()
        .delete("eta", &DeleteParams::default())
        .await
        .unwrap();
    eventually(PATIENCE, "the object to be gone", || async {
        env.clusters().get_opt("eta").await.unwrap().is_none()
    })
    .await;
    assert!(env.mails().is_empty());
    env.stop().await;
}

/// The sync period's safety net (issue 37): with nothing changing, every object is reconciled
/// again each period, and such a reconcile writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sync_period_reconciles_every_object_and_writes_nothing() {
    let mut env = Env::new("mgc-resync").await;
    let mut config = env.config();
    config.sync_period = std::time::Duration::from_secs(2);
    env.start_with(config).await;
    for name in ["r1", "r2", "r3"] {
        env.create_mailgun_cluster(name).await;
        env.create_owner_cluster(name, false).await;
    }
    for name in ["r1", "r2", "r3"] {
        eventually(PATIENCE, "the request mail", || async {
            sent_status(&env, name).await
        })
        .await;
    }
    // Settled: what each object is now.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let versions = |env: &Env| {
        let api = env.clusters();
        async move {
            let mut out = Vec::new();
            for name in ["r1", "r2", "r3"] {
                out.push(api.get(name).await.unwrap().resource_version());
            }
            out
        }
    };
    let before = versions(&env).await;
    let reconciles = env.metric(
        "controller_runtime_reconcile_total",
        Some(("controller", "mailguncluster")),
    );
    // Three periods: each of the three objects about three times more.
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    let more = env.metric(
        "controller_runtime_reconcile_total",
        Some(("controller", "mailguncluster")),
    ) - reconciles;
    assert!(
        more >= 6.0,
        "{more} reconciles in three sync periods of three objects"
    );
    assert_eq!(versions(&env).await, before, "a resync wrote to an object");
    assert_eq!(env.mails().len(), 3, "one mail each");
    env.stop().await;
}
