//! Exactly one mail per object through the real binary: crashes at the two dangerous steps
//! (failpoints abort the process), a restart, and two replicas of which only the leader sends.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use capm_api::records::{self, Which};
use capm_api::{names, v1beta1::MailgunCluster};
use capm_mail_servers::{MailgunServer, SmtpOptions, SmtpServer};
use capm_test_support::process::is_stopped;
use common::{
    Backend, DOMAIN, KEY, Provider, create_pair, delivered, namespace, signal, wait_recorded,
};
use kube::ResourceExt;

fn intent_of(obj: &MailgunCluster) -> records::Intent {
    records::parse_record(
        &obj.annotations()[Which::Request.record_key()],
        "MailgunCluster",
        Which::Request,
    )
    .unwrap()
    .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_intent_then_restart_sends_exactly_one() {
    let ns = namespace("eo-intent").await;
    let mailgun = MailgunServer::start(KEY, DOMAIN).unwrap();
    let backend = Backend::Mailgun(&mailgun);
    let mut crashing = Provider::start(&ns, &backend, Some("after-intent"), false);
    let created = create_pair(&ns, "one").await;
    crashing.wait_for_crash();
    let obj = ns.api::<MailgunCluster>().get("one").await.unwrap();
    let id = names::message_id("MailgunCluster", &created.uid().unwrap(), DOMAIN);
    assert_eq!(intent_of(&obj).message_id, id);
    assert!(!names::request_recorded_sent(obj.annotations()));
    assert!(mailgun.messages().unwrap().is_empty());

    // The new process finds a pending intent, the backend has no record: it sends, once.
    let _provider = Provider::start(&ns, &backend, None, false);
    wait_recorded(&ns, "one").await;
    let mails = mailgun.messages().unwrap();
    assert_eq!(mails.len(), 1);
    assert_eq!(mails[0].id, id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_send_mailgun_lookup_finds_it() {
    let ns = namespace("eo-sent-mg").await;
    let mailgun = MailgunServer::start(KEY, DOMAIN).unwrap();
    let backend = Backend::Mailgun(&mailgun);
    let mut crashing = Provider::start(&ns, &backend, Some("after-send"), false);
    create_pair(&ns, "two").await;
    crashing.wait_for_crash();
    assert_eq!(
        mailgun.messages().unwrap().len(),
        1,
        "accepted before the crash"
    );
    let obj = ns.api::<MailgunCluster>().get("two").await.unwrap();
    assert!(!names::request_recorded_sent(obj.annotations()));

    let provider = Provider::start(&ns, &backend, None, false);
    let obj = wait_recorded(&ns, "two").await;
    assert_eq!(
        mailgun.messages().unwrap().len(),
        1,
        "the lookup found it: no second mail"
    );
    let sent = records::parse_record(
        &obj.annotations()[Which::Request.record_key()],
        "MailgunCluster",
        Which::Request,
    )
    .unwrap()
    .1
    .expect("recorded as sent");
    assert_eq!(sent.backend_id, mailgun.messages().unwrap()[0].id);
    assert_eq!(provider.metric("capm_mail_resends_total"), 0.0);
    assert!(provider.metric("mailer_lookups_total") >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_send_smtp_resends_the_same_message_id() {
    let ns = namespace("eo-sent-smtp").await;
    let smtp = SmtpServer::start(SmtpOptions::default()).unwrap();
    let backend = Backend::Smtp(&smtp);
    let mut crashing = Provider::start(&ns, &backend, Some("after-send"), false);
    let created = create_pair(&ns, "three").await;
    crashing.wait_for_crash();
    assert_eq!(smtp.messages().unwrap().len(), 1);

    // SMTP cannot be asked: the mail goes again with the same Message-Id, and that is counted.
    let provider = Provider::start(&ns, &backend, None, false);
    wait_recorded(&ns, "three").await;
    let mails = smtp.messages().unwrap();
    assert_eq!(mails.len(), 2);
    let id = names::message_id("MailgunCluster", &created.uid().unwrap(), DOMAIN);
    for mail in &mails {
        assert_eq!(
            mail.header("Message-ID").or(mail.header("Message-Id")),
            Some(id.as_str())
        );
    }
    assert_eq!(provider.metric("capm_mail_resends_total"), 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_only_the_leader_sends() {
    let ns = namespace("eo-replicas").await;
    let mailgun = MailgunServer::start(KEY, DOMAIN).unwrap();
    let backend = Backend::Mailgun(&mailgun);
    let a = Provider::start(&ns, &backend, None, true);
    let b = Provider::start(&ns, &backend, None, true);
    for i in 0..5 {
        create_pair(&ns, &format!("r{i}")).await;
    }
    for i in 0..5 {
        wait_recorded(&ns, &format!("r{i}")).await;
    }
    assert_eq!(mailgun.messages().unwrap().len(), 5);
    let (leader, standby) = if a.metric("leader_election_master_status") == 1.0 {
        (&a, &b)
    } else {
        (&b, &a)
    };
    assert_eq!(leader.metric("leader_election_master_status"), 1.0);
    assert_eq!(standby.metric("leader_election_master_status"), 0.0);
    // The sent annotation is written inside a reconcile; the reconcile is counted when it ends.
    assert!(
        leader
            .wait_metric_at_least("controller_runtime_reconcile_total", 5.0)
            .await
            >= 5.0
    );
    assert_eq!(leader.metric("mailer_messages_total"), 5.0);
    assert_eq!(standby.metric("controller_runtime_reconcile_total"), 0.0);
    assert_eq!(standby.metric("mailer_messages_total"), 0.0);
}

/// Issue 13, defect 1 (path a): the leader records its intent and is frozen (at `failpoint`)
/// before it sends; the standby takes the Lease over and sends; then the old leader resumes. It
/// must not send: it has not renewed its Lease within the renew deadline. Before the fix it sent
/// on resume (and, with SMTP, the new leader resent at once, not waiting for the hand-over
/// window).
///
/// Issue 28: with `before-commit:stop` the freeze comes in the middle of the send, with the
/// request on the wire (Mailgun: headers and all of the body but its final chunk; SMTP: the
/// message after `DATA`, without its end-of-data line). Before the commit gate the resumed
/// leader completed it, and the backend had two copies.
async fn frozen_leader_does_not_send_after_losing_its_lease(
    backend: Backend<'_>,
    prefix: &str,
    failpoint: &str,
) {
    let ns = namespace(prefix).await;
    let mut old = Provider::start(&ns, &backend, Some(failpoint), true);
    assert_eq!(
        old.wait_metric_at_least("leader_election_master_status", 1.0)
            .await,
        1.0,
        "the first replica leads"
    );
    let new = Provider::start(&ns, &backend, None, true);
    let created = create_pair(&ns, "frozen").await;
    let pid = old.pid();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !is_stopped(pid) {
        assert!(Instant::now() < deadline, "the leader never froze");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let obj = ns.api::<MailgunCluster>().get("frozen").await.unwrap();
    let intent = intent_of(&obj);
    assert!(
        intent.writer.is_some() && intent.at.is_some(),
        "the intent names its writer and time: {intent:?}"
    );
    // The standby takes over once the Lease has gone unrenewed for its duration (15 s)...
    assert_eq!(
        new.wait_metric_at_least("leader_election_master_status", 1.0)
            .await,
        1.0,
        "the standby takes the Lease over"
    );
    // ...and, once the old holder's attempt cannot be in flight any more, sends the mail.
    wait_recorded(&ns, "frozen").await;
    let id = names::message_id("MailgunCluster", &created.uid().unwrap(), DOMAIN);
    assert_eq!(delivered(&backend), vec![id.clone()]);
    // Now the old leader resumes right before its send.
    signal(pid, "-CONT");
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = old.exited() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the old leader did not give up within 30 s of resuming"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        !status.success(),
        "losing the Lease is a failure exit: {status}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        delivered(&backend),
        vec![id],
        "exactly one mail: the resumed old leader did not send"
    );
    if failpoint.starts_with("before-commit") {
        let log = old.stderr_log();
        assert!(
            log.contains("Abandoned the send before its commit point"),
            "the old leader says it abandoned the send: {log}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_leader_does_not_send_after_losing_its_lease_mailgun() {
    let mailgun = MailgunServer::start(KEY, DOMAIN).unwrap();
    frozen_leader_does_not_send_after_losing_its_lease(
        Backend::Mailgun(&mailgun),
        "eo-frozen-mg",
        "after-intent:stop",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_leader_does_not_send_after_losing_its_lease_smtp() {
    let smtp = SmtpServer::start(SmtpOptions::default()).unwrap();
    frozen_leader_does_not_send_after_losing_its_lease(
        Backend::Smtp(&smtp),
        "eo-frozen-smtp",
        "after-intent:stop",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_frozen_mid_send_abandons_it_on_resume_mailgun() {
    let mailgun = MailgunServer::start(KEY, DOMAIN).unwrap();
    frozen_leader_does_not_send_after_losing_its_lease(
        Backend::Mailgun(&mailgun),
        "eo-midsend-mg",
        "before-commit:stop",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_frozen_mid_send_abandons_it_on_resume_smtp() {
    let smtp = SmtpServer::start(SmtpOptions::default()).unwrap();
    frozen_leader_does_not_send_after_losing_its_lease(
        Backend::Smtp(&smtp),
        "eo-midsend-smtp",
        "before-commit:stop",
    )
    .await;
}
