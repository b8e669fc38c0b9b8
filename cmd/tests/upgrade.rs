//! Upgrade from release 0.1: objects it mailed (two record annotations per mail, conditions
//! with their own `observedGeneration`) are read by this binary, never mailed again, and
//! released once.
//!
//! The objects are made exactly as 0.1 leaves them: `fixtures/mailguncluster-mailed-by-0.1.json`
//! is a finished object the 0.1 binary wrote (dumped by `make bench` from commit 719253e), with
//! its UID and domain replaced by this test's. Its mails are put in the Mailgun server first, as
//! 0.1 sent them. Two states: mailed and recorded; and crashed after the send, before the sent
//! record (only the intent, `sending`, written by another process a while ago).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use capm_api::records::{self, Which};
use capm_api::{names, v1beta1::MailgunCluster};
use capm_mail_servers::MailgunServer;
use capm_mailer::{Mailer, MailgunConfig, MailgunMailer, Message, SecretSource};
use common::{
    Backend, DOMAIN, KEY, Provider, create_pair, delivered, namespace, poll_object, wait_recorded,
};
use kube::{
    Api, ResourceExt,
    api::{DeleteParams, Patch, PatchParams},
};
use serde_json::{Value, json};

const FIXTURE: &str = include_str!("fixtures/mailguncluster-mailed-by-0.1.json");

/// The fixture's annotations and status for an object of `uid`.
fn as_left_by_0_1(uid: &str) -> Value {
    let fixture: Value = serde_json::from_str(FIXTURE).unwrap();
    let source_uid = fixture["metadata"]["uid"].as_str().unwrap().to_owned();
    let text = FIXTURE
        .replace(&source_uid, uid)
        .replace("mg.bench.example.com", DOMAIN);
    serde_json::from_str(&text).unwrap()
}

/// Sends `id` to the Mailgun server as 0.1 did.
async fn sent_by_0_1(server: &MailgunServer, id: &str) {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, KEY).unwrap();
    let mut config = MailgunConfig::new(DOMAIN, SecretSource::File(key));
    config.base_url = Some(server.base_url());
    // 0.1 sent From the requester; the contract server now refuses a From off the sending
    // domain (DMARC), and what matters here is only that a mail of this Message-Id is stored.
    let message = Message::builder()
        .from(format!("capm@{DOMAIN}"))
        .to("ops@example.com")
        .subject("[Urgent] New Cluster requested")
        .text("Hello! One cluster please.")
        .message_id(id)
        .build()
        .unwrap();
    MailgunMailer::new(&config)
        .unwrap()
        .send(&message)
        .await
        .unwrap();
}

/// Writes 0.1's records (`annotations`) and status onto `name`, with no provider running.
async fn leave_as_0_1(api: &Api<MailgunCluster>, name: &str, annotations: Value, status: Value) {
    let params = PatchParams::default();
    api.patch(
        name,
        &params,
        &Patch::Merge(json!({ "metadata": {
            "annotations": annotations,
            "finalizers": [names::CLUSTER_FINALIZER],
        }})),
    )
    .await
    .unwrap();
    if !status.is_null() {
        api.patch_status(name, &params, &Patch::Merge(json!({ "status": status })))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objects_mailed_by_0_1_are_not_mailed_again_and_released_once() {
    let ns = namespace("upgrade").await;
    let mailgun = MailgunServer::start(KEY, DOMAIN).unwrap();
    let backend = Backend::Mailgun(&mailgun);
    let api = ns.api::<MailgunCluster>();

    // Mailed and recorded by 0.1: both annotations, its whole status.
    let mailed = create_pair(&ns, "mailed").await;
    let old = as_left_by_0_1(&mailed.uid().unwrap());
    let mailed_id = names::message_id("MailgunCluster", &mailed.uid().unwrap(), DOMAIN);
    sent_by_0_1(&mailgun, &mailed_id).await;
    leave_as_0_1(
        &api,
        "mailed",
        old["metadata"]["annotations"].clone(),
        old["status"].clone(),
    )
    .await;

    // 0.1 crashed after the send: only its intent, by another process, long ago; no status.
    let crashed = create_pair(&ns, "crashed").await;
    let old = as_left_by_0_1(&crashed.uid().unwrap());
    let crashed_id = names::message_id("MailgunCluster", &crashed.uid().unwrap(), DOMAIN);
    sent_by_0_1(&mailgun, &crashed_id).await;
    let intent = old["metadata"]["annotations"][names::MAIL_INTENT_ANNOTATION].clone();
    assert!(intent.as_str().unwrap().contains(&crashed_id));
    leave_as_0_1(
        &api,
        "crashed",
        json!({ names::MAIL_INTENT_ANNOTATION: intent }),
        Value::Null,
    )
    .await;
    let before = api.get("mailed").await.unwrap();
    assert_eq!(delivered(&backend).len(), 2);

    // The new binary.
    let provider = Provider::start(&ns, &backend, None, false);
    let crashed = wait_recorded(&ns, "crashed").await;
    let (_, sent) = records::parse_record(
        &crashed.annotations()[Which::Request.record_key()],
        "MailgunCluster",
        Which::Request,
    )
    .expect("its record in this release's format");
    assert_eq!(sent.expect("sent").backend_id, crashed_id);
    for legacy in [names::MAIL_INTENT_ANNOTATION, names::MAIL_SENT_ANNOTATION] {
        assert!(
            !crashed.annotations().contains_key(legacy),
            "{legacy} is replaced by the one record"
        );
    }
    // The mailed object: its status is rewritten once (no per-condition generations), its
    // records are left as they are (nothing about the mail changed).
    let mailed = poll_object(&ns, "mailed", Duration::from_secs(60), |obj| {
        let conditions = obj
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_deref())
            .unwrap_or_default();
        !conditions.is_empty() && conditions.iter().all(|c| c.observed_generation.is_none())
    })
    .await
    .expect("the status was rewritten within 60 s");
    assert_eq!(mailed.annotations(), before.annotations());
    let status = mailed.status.clone().unwrap();
    assert_eq!(
        status.mail.unwrap().message_id.as_deref(),
        Some(mailed_id.as_str())
    );
    let mail_sent = status
        .conditions
        .unwrap()
        .into_iter()
        .find(|c| c.type_ == "MailSent")
        .unwrap();
    assert_eq!(
        (mail_sent.status.as_str(), mail_sent.message.as_str()),
        ("True", "")
    );

    // Settled: nothing new was sent, nothing was resent.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        delivered(&backend),
        [mailed_id.clone(), crashed_id.clone()],
        "no second mail"
    );
    assert_eq!(provider.metric("capm_mail_resends_total"), 0.0);

    // Deleting either sends its release, once, and lets it go.
    for name in ["mailed", "crashed"] {
        api.delete(name, &DeleteParams::default()).await.unwrap();
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while api.get_opt("mailed").await.unwrap().is_some()
        || api.get_opt("crashed").await.unwrap().is_some()
    {
        assert!(Instant::now() < deadline, "not released");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut ids = delivered(&backend);
    ids.sort();
    let mut expected = vec![
        mailed_id.clone(),
        crashed_id.clone(),
        names::deletion_message_id("MailgunCluster", &mailed.uid().unwrap(), DOMAIN),
        names::deletion_message_id("MailgunCluster", &crashed.uid().unwrap(), DOMAIN),
    ];
    expected.sort();
    assert_eq!(ids, expected, "one request and one release each");
}
