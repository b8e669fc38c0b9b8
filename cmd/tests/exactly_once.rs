//! Exactly one mail per object through the real binary: crashes at the two dangerous steps
//! (failpoints abort the process), a restart, and two replicas of which only the leader sends.
//! For a `MailgunCluster`'s request mail and for each mail of a `MailgunRemediation` (its repair
//! mail, a reminder, the "no longer needed" mail): they go through the same send-once layer, so
//! the same failpoints strike them.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use capm_api::records::{self, Which};
use capm_api::{names, v1beta1::MailgunCluster};
use capm_mail_servers::{MailgunServer, SmtpOptions, SmtpServer};
use capm_test_support::{TestNamespace, process::is_stopped};
use common::{
    Backend, DOMAIN, KEY, Launch, Provider, annotations_of, create_pair, create_remediation,
    delivered, namespace, signal, wait_recorded,
};
use kube::{ResourceExt, api::DeleteParams};

fn intent_of(obj: &MailgunCluster) -> records::Intent {
    records::parse_record(
        &obj.annotations()[Which::Request.record_key()],
        "MailgunCluster",
        Which::Request,
    )
    .unwrap()
    .0
}

/// The mail a test watches, of the object it creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watched {
    /// A `MailgunCluster`'s request.
    ClusterRequest,
    /// A `MailgunRemediation`'s repair mail.
    Repair,
    /// Its reminder 1, due an `answerTimeout` (1m) after the repair mail.
    Reminder,
    /// Its "no longer needed" mail, owed once the object is deleted after the repair mail.
    NoLongerNeeded,
}

impl Watched {
    fn kind(self) -> &'static str {
        match self {
            Self::ClusterRequest => "MailgunCluster",
            _ => "MailgunRemediation",
        }
    }

    fn which(self) -> Which {
        match self {
            Self::ClusterRequest | Self::Repair => Which::Request,
            Self::Reminder => Which::Reminder(1),
            Self::NoLongerNeeded => Which::Deletion,
        }
    }

    /// The watched mail comes after the object's request mail.
    fn follows_the_request(self) -> bool {
        self.which() != Which::Request
    }

    /// How long after the request mail the watched one is due, at most.
    fn due_within(self) -> Duration {
        match self {
            Self::Reminder => Duration::from_secs(120),
            _ => Duration::from_secs(30),
        }
    }

    /// Creates the object `name` (and what it needs); returns its UID.
    async fn create(self, ns: &TestNamespace, name: &str) -> String {
        match self {
            Self::ClusterRequest => create_pair(ns, name).await.uid(),
            // Reminder 1 comes only where it is watched: the cases run side by side (joined),
            // and a case blocked waiting for its process's crash must not see an unwatched
            // reminder fall due meanwhile.
            Self::Reminder => create_remediation(ns, name, "1m").await.uid(),
            _ => create_remediation(ns, name, "1h").await.uid(),
        }
        .unwrap()
    }

    fn message_id(self, uid: &str) -> String {
        self.which().message_id(self.kind(), uid, DOMAIN)
    }

    /// Every Message-Id the backend should hold once, in the order they are sent.
    fn all_ids(self, uid: &str) -> Vec<String> {
        let mut ids = vec![Which::Request.message_id(self.kind(), uid, DOMAIN)];
        if self.follows_the_request() {
            ids.push(self.message_id(uid));
        }
        ids
    }

    /// The records of `which` of the object `name` (`None`: the object is gone).
    async fn records_of(
        self,
        ns: &TestNamespace,
        name: &str,
        which: Which,
    ) -> Option<records::Records> {
        let annotations = annotations_of(ns, self.kind(), name).await?;
        Some(records::read_records(&annotations, self.kind(), which))
    }

    /// Waits until `which` of `name` is recorded as sent (the "no longer needed" mail: until
    /// the object is gone, its finalizer removed after the record).
    async fn wait_sent(self, ns: &TestNamespace, name: &str, which: Which, within: Duration) {
        let deadline = Instant::now() + within;
        loop {
            match self.records_of(ns, name, which).await {
                Some(r) if r.sent.is_some() => return,
                None if which == Which::Deletion => return,
                None => panic!("{name} is gone"),
                Some(_) => {}
            }
            assert!(
                Instant::now() < deadline,
                "{} of {name} not recorded as sent within {within:?}",
                which.label()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until the watched mail is recorded as sent.
    async fn wait_recorded(self, ns: &TestNamespace, name: &str) {
        let within = self.due_within() + Duration::from_secs(60);
        self.wait_sent(ns, name, self.which(), within).await;
    }

    /// Waits until the request mail of `name` is recorded as sent.
    async fn wait_request_recorded(self, ns: &TestNamespace, name: &str) {
        self.wait_sent(ns, name, Which::Request, Duration::from_secs(60))
            .await;
    }

    /// What makes the watched mail due once the request is recorded: for the "no longer
    /// needed" mail, the object's deletion (the MachineHealthCheck found the Machine healthy
    /// again).
    async fn make_due(self, ns: &TestNamespace, name: &str) {
        if self == Self::NoLongerNeeded {
            let api = ns.api::<capm_api::v1beta1::MailgunRemediation>();
            api.delete(name, &DeleteParams::default()).await.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_intent_then_restart_sends_exactly_one() {
    let ns = namespace("eo-intent").await;
    let mailgun = MailgunServer::start(KEY, DOMAIN).unwrap();
    let backend = Backend::Mailgun(&mailgun);
    let mut crashing = Provider::start(&ns, &backend, Some("after-intent"), false);
    let created = create_pair(&ns, "one").await;
    crashing.wait_for_crash().await;
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

/// The process dies after the backend accepted the watched mail and before its record: the
/// next process asks Mailgun, finds it, and records it without sending again. The mails
/// before the watched one come from a process without failpoints, stopped once they are
/// recorded.
async fn crash_after_send_lookup_finds_it(watched: Watched, prefix: &str) {
    let ns = namespace(prefix).await;
    let mailgun = MailgunServer::start(KEY, DOMAIN).unwrap();
    let backend = Backend::Mailgun(&mailgun);
    let name = "two";
    let uid = watched.create(&ns, name).await;
    if watched.follows_the_request() {
        let earlier = Provider::start(&ns, &backend, None, false);
        watched.wait_request_recorded(&ns, name).await;
        drop(earlier);
        watched.make_due(&ns, name).await;
    }
    let mut crashing = Provider::start(&ns, &backend, Some("after-send"), false);
    crashing
        .wait_for_crash_within(watched.due_within() + Duration::from_secs(30))
        .await;
    let id = watched.message_id(&uid);
    assert_eq!(
        delivered(&backend),
        watched.all_ids(&uid),
        "accepted before the crash"
    );
    let pending = watched
        .records_of(&ns, name, watched.which())
        .await
        .unwrap();
    assert!(pending.intent.is_some() && pending.sent.is_none());

    let provider = Provider::start(&ns, &backend, None, false);
    watched.wait_recorded(&ns, name).await;
    assert_eq!(
        delivered(&backend),
        watched.all_ids(&uid),
        "the lookup found it: no second mail"
    );
    if let Some(records) = watched.records_of(&ns, name, watched.which()).await {
        let sent = records.sent.expect("recorded as sent");
        assert_eq!(sent.backend_id, id);
    }
    assert_eq!(provider.metric("capm_mail_resends_total"), 0.0);
    assert!(provider.metric("mailer_lookups_total") >= 1.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_send_mailgun_lookup_finds_it() {
    crash_after_send_lookup_finds_it(Watched::ClusterRequest, "eo-sent-mg").await;
}

/// Each of a `MailgunRemediation`'s mails, each in its own namespace, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_send_of_each_remediation_mail_mailgun_lookup_finds_it() {
    futures::join!(
        crash_after_send_lookup_finds_it(Watched::Repair, "eo-sent-repair"),
        crash_after_send_lookup_finds_it(Watched::Reminder, "eo-sent-reminder"),
        crash_after_send_lookup_finds_it(Watched::NoLongerNeeded, "eo-sent-nln"),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crash_after_send_smtp_resends_the_same_message_id() {
    let ns = namespace("eo-sent-smtp").await;
    let smtp = SmtpServer::start(SmtpOptions::default()).unwrap();
    let backend = Backend::Smtp(&smtp);
    let mut crashing = Provider::start(&ns, &backend, Some("after-send"), false);
    let created = create_pair(&ns, "three").await;
    crashing.wait_for_crash().await;
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
///
/// A watched mail after the request (a reminder) is frozen the same way: the failpoint is armed
/// (through `CAPM_FAILPOINT_FILE`) once the leader has recorded the request mail.
async fn frozen_leader_does_not_send_after_losing_its_lease(
    backend: Backend<'_>,
    prefix: &str,
    failpoint: &str,
    watched: Watched,
) {
    let ns = namespace(prefix).await;
    let armed_later = watched.follows_the_request();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("failpoint");
    let launch = Launch {
        failpoint: (!armed_later).then_some(failpoint),
        failpoint_file: Some(&file),
        leader_elect: true,
        ..Launch::default()
    };
    let mut old = Provider::launch(&ns, &backend, &launch);
    assert_eq!(
        old.wait_metric_at_least("leader_election_master_status", 1.0)
            .await,
        1.0,
        "the first replica leads"
    );
    let new = Provider::start(&ns, &backend, None, true);
    let name = "frozen";
    let uid = watched.create(&ns, name).await;
    if armed_later {
        watched.wait_request_recorded(&ns, name).await;
        watched.make_due(&ns, name).await;
        std::fs::write(&file, failpoint).unwrap();
    }
    let pid = old.pid();
    let deadline = Instant::now() + watched.due_within();
    while !is_stopped(pid) {
        assert!(Instant::now() < deadline, "the leader never froze");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let records = watched.records_of(&ns, name, watched.which()).await;
    let intent = records.and_then(|r| r.intent).expect("an intent");
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
    watched.wait_recorded(&ns, name).await;
    let ids = watched.all_ids(&uid);
    assert_eq!(delivered(&backend), ids);
    // Now the old leader resumes right before its send.
    signal(pid, "-CONT");
    let status = old
        .wait_exit(Duration::from_secs(30))
        .await
        .expect("the old leader gives up within 30 s of resuming");
    assert!(
        !status.success(),
        "losing the Lease is a failure exit: {status}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        delivered(&backend),
        ids,
        "exactly one mail each: the resumed old leader did not send"
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
        Watched::ClusterRequest,
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
        Watched::ClusterRequest,
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
        Watched::ClusterRequest,
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
        Watched::ClusterRequest,
    )
    .await;
}

/// A `MailgunRemediation`'s repair mail and its reminder, each frozen after its intent and
/// mid-send, over either backend: each in its own namespace with its own server, at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_leader_sends_no_remediation_mail_after_losing_its_lease() {
    let servers: Vec<_> = [Watched::Repair, Watched::Reminder]
        .into_iter()
        .map(|watched| {
            let smtp = SmtpServer::start(SmtpOptions::default()).unwrap();
            (watched, smtp, MailgunServer::start(KEY, DOMAIN).unwrap())
        })
        .collect();
    let mut runs = Vec::new();
    for (watched, smtp, mailgun) in &servers {
        let (smtp, mailgun) = (Backend::Smtp(smtp), Backend::Mailgun(mailgun));
        let frozen = frozen_leader_does_not_send_after_losing_its_lease;
        runs.push(frozen(smtp, "eo-frozen-rem", "after-intent:stop", *watched));
        runs.push(frozen(
            mailgun,
            "eo-midsend-rem",
            "before-commit:stop",
            *watched,
        ));
    }
    futures::future::join_all(runs).await;
}
