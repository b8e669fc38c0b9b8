//! Delivery tracking of the request mail against the real API server, the Mailgun contract
//! server (its Logs API by default, the events API behind the flag: delivered / failed events,
//! paging, rate limits) and a real SMTP server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use capm_api::{names::reasons, v1beta1::MailState};
use capm_mail_servers::{
    DeliveryEvent, EventRule, FailureMode, FailureRule, FailureTarget, SmtpOptions, SmtpServer,
    SmtpTls,
};
use capm_mailer::{MailerConfig, MailgunEventsApi, SmtpConfig, Starttls};
use k8s_openapi::api::events::v1::Event;
use kube::{
    Api, ResourceExt,
    api::{ListParams, Patch, PatchParams},
};
use serde_json::json;
use support::{Env, PATIENCE, condition, eventually};

fn config(env: &Env) -> capm_controllers::Config {
    capm_controllers::Config {
        delivery_poll_base: Duration::from_millis(200),
        delivery_poll_max: Duration::from_secs(1),
        ..env.config()
    }
}

/// The `MailDelivered` condition's (status, reason, message) and the mail state of `name`.
async fn delivery(env: &Env, name: &str) -> (Option<(String, String, String)>, Option<MailState>) {
    let status = env
        .clusters()
        .get(name)
        .await
        .unwrap()
        .status
        .unwrap_or_default();
    let c = condition(&status.conditions, "MailDelivered")
        .map(|c| (c.status.clone(), c.reason.clone(), c.message.clone()));
    (c, status.mail.and_then(|m| m.state))
}

async fn wait_for_reason(env: &Env, name: &str, reason: &str) {
    eventually(
        PATIENCE,
        &format!("MailDelivered reason {reason}"),
        || async {
            delivery(env, name)
                .await
                .0
                .is_some_and(|(_, r, _)| r == reason)
        },
    )
    .await;
}

fn event(id: &str, event: DeliveryEvent) -> EventRule {
    EventRule {
        message_id: id.to_owned(),
        event,
        recipient: None,
        reason: None,
        code: None,
        message: None,
    }
}

/// Questions the contract server answered, through either API (failed ones included for Logs).
fn asked(env: &Env) -> u64 {
    let stats = env.mailgun.stats().unwrap();
    stats.events_requests + stats.logs_requests
}

/// Waits until `name` shows `reason`, then checks that over a few poll periods neither the
/// object is written nor the backend asked again.
async fn assert_settled(env: &Env, name: &str) {
    let rv = env.clusters().get(name).await.unwrap().resource_version();
    let before = asked(env);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        env.clusters().get(name).await.unwrap().resource_version(),
        rv,
        "status rewritten although nothing changed"
    );
    assert_eq!(asked(env), before, "asked again after a final outcome");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_then_delivered_is_shown_and_then_left_alone() {
    delayed_then_delivered("mgc-delivered", MailgunEventsApi::Logs).await;
}

/// The same through the deprecated events API (`--mailgun-events-api events`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delayed_then_delivered_through_the_events_api() {
    delayed_then_delivered("mgc-delivered-events", MailgunEventsApi::Events).await;
}

async fn delayed_then_delivered(prefix: &str, api: MailgunEventsApi) {
    let mut env = Env::new(prefix).await;
    // Small pages: the controller must page through the events.
    env.mailgun.set_page_size(1).unwrap();
    let mailer = env.mailer_on(api);
    env.start_with_mailer(config(&env), mailer).await;
    env.create_mailgun_cluster("d1").await;
    env.create_owner_cluster("d1", false).await;
    wait_for_reason(&env, "d1", reasons::DELIVERY_PENDING).await;
    let (c, state) = delivery(&env, "d1").await;
    assert_eq!(c.unwrap().0, "Unknown");
    assert_eq!(state, Some(MailState::Sent));
    let id = env.mails()[0].id.clone();

    env.mailgun
        .add_event(&EventRule {
            code: Some(421),
            message: Some("4.7.0 greylisted, try later".into()),
            ..event(&id, DeliveryEvent::TemporaryFailure)
        })
        .unwrap();
    wait_for_reason(&env, "d1", reasons::DELIVERY_DELAYED).await;
    let (c, _) = delivery(&env, "d1").await;
    let (status, _, message) = c.unwrap();
    assert_eq!(status, "Unknown");
    assert!(message.contains("421 4.7.0 greylisted"), "{message}");

    env.mailgun
        .add_event(&event(&id, DeliveryEvent::Delivered))
        .unwrap();
    wait_for_reason(&env, "d1", reasons::DELIVERED).await;
    let (c, state) = delivery(&env, "d1").await;
    assert_eq!(c.unwrap().0, "True");
    assert_eq!(state, Some(MailState::Delivered));
    // Informational: Ready keeps its meaning (waiting for a human).
    let status = env.clusters().get("d1").await.unwrap().status.unwrap();
    let ready = condition(&status.conditions, "Ready").unwrap();
    assert_eq!(
        (ready.status.as_str(), ready.reason.as_str()),
        ("False", reasons::WAITING_FOR_FULFILLMENT)
    );
    assert_eq!(
        env.metric("capm_mail_delivery_total", Some(("outcome", "delivered"))),
        1.0
    );
    assert_eq!(
        env.metric("capm_mail_delivery_total", Some(("outcome", "delayed"))),
        1.0
    );
    assert_settled(&env, "d1").await;

    // Fulfilment still works, and keeps the delivered state.
    env.fulfil_cluster("d1").await;
    eventually(PATIENCE, "Ready", || async {
        let status = env.clusters().get("d1").await.unwrap().status.unwrap();
        condition(&status.conditions, "Ready").is_some_and(|c| c.status == "True")
    })
    .await;
    assert_eq!(delivery(&env, "d1").await.1, Some(MailState::Delivered));
    assert_eq!(env.mails().len(), 1);
    env.stop().await;
}

/// The pass that sends shows "pending" without asking (an answer within milliseconds of the send
/// is all but always "no report yet", and the question would hold a reconcile slot); the first
/// question comes one `delivery_poll_base` later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_question_waits_one_poll_period_after_the_send() {
    let mut env = Env::new("mgc-first-question").await;
    let cfg = capm_controllers::Config {
        delivery_poll_base: Duration::from_secs(3),
        delivery_poll_max: Duration::from_secs(3),
        ..env.config()
    };
    env.start_with(cfg).await;
    env.create_mailgun_cluster("f1").await;
    env.create_owner_cluster("f1", false).await;
    wait_for_reason(&env, "f1", reasons::DELIVERY_PENDING).await;
    let (c, state) = delivery(&env, "f1").await;
    assert_eq!(c.unwrap().0, "Unknown");
    assert_eq!(state, Some(MailState::Sent));
    assert_eq!(asked(&env), 0, "asked in the pass that sent");
    let id = env.mails()[0].id.clone();
    env.mailgun
        .add_event(&event(&id, DeliveryEvent::Delivered))
        .unwrap();
    wait_for_reason(&env, "f1", reasons::DELIVERED).await;
    assert!(asked(&env) >= 1);
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permanent_failure_is_reported_once_and_never_resent() {
    let mut env = Env::new("mgc-undeliverable").await;
    env.start_with(config(&env)).await;
    env.create_mailgun_cluster("f1").await;
    env.create_owner_cluster("f1", false).await;
    wait_for_reason(&env, "f1", reasons::DELIVERY_PENDING).await;
    let id = env.mails()[0].id.clone();
    env.mailgun
        .add_event(&EventRule {
            reason: Some("bounce".into()),
            code: Some(550),
            message: Some("5.1.1 no such mailbox".into()),
            ..event(&id, DeliveryEvent::PermanentFailure)
        })
        .unwrap();
    wait_for_reason(&env, "f1", reasons::DELIVERY_FAILED).await;
    let (c, state) = delivery(&env, "f1").await;
    let (status, _, message) = c.unwrap();
    assert_eq!(status, "False");
    assert_eq!(state, Some(MailState::Failed));
    assert!(
        message.contains("bounce: 550 5.1.1 no such mailbox"),
        "{message}"
    );
    assert!(message.contains("a human must act"), "{message}");
    assert!(message.contains("never resends"), "{message}");
    let obj = env.clusters().get("f1").await.unwrap();
    let text = serde_json::to_string(&obj.status).unwrap();
    assert!(!text.contains(support::API_KEY), "{text}");
    // MailSent stays True: it was sent.
    let sent = condition(&obj.status.as_ref().unwrap().conditions, "MailSent").unwrap();
    assert_eq!(sent.status, "True");

    // One Warning event saying so.
    let events: Api<Event> = Api::namespaced(env.ns.client.clone(), &env.ns.name);
    eventually(PATIENCE, "the DeliveryFailed event", || async {
        events
            .list(&ListParams::default())
            .await
            .unwrap()
            .items
            .iter()
            .any(|e| {
                e.reason.as_deref() == Some(reasons::DELIVERY_FAILED)
                    && e.type_.as_deref() == Some("Warning")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("f1")
                    && e.note
                        .as_deref()
                        .is_some_and(|n| n.contains("human must act"))
            })
    })
    .await;
    assert_eq!(
        env.metric("capm_mail_delivery_total", Some(("outcome", "failed"))),
        1.0
    );
    assert_settled(&env, "f1").await;

    // Unrelated changes and a restart: no second mail, the outcome stays.
    for i in 0..3 {
        env.clusters()
            .patch(
                "f1",
                &PatchParams::default(),
                &Patch::Merge(json!({ "metadata": { "labels": { "poke": i.to_string() } } })),
            )
            .await
            .unwrap();
    }
    env.stop().await;
    env.start_with(config(&env)).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(env.mails().len(), 1, "a delivery failure led to a resend");
    assert_eq!(env.metric("capm_mail_resends_total", None), 0.0);
    assert_eq!(delivery(&env, "f1").await.1, Some(MailState::Failed));
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asking_stops_when_the_events_retention_has_passed() {
    let mut env = Env::new("mgc-retention").await;
    let cfg = capm_controllers::Config {
        delivery_retention: Duration::from_secs(3),
        ..config(&env)
    };
    env.start_with(cfg).await;
    env.create_mailgun_cluster("r1").await;
    env.create_owner_cluster("r1", false).await;
    wait_for_reason(&env, "r1", reasons::DELIVERY_PENDING).await;
    wait_for_reason(&env, "r1", reasons::DELIVERY_UNKNOWN).await;
    let (c, state) = delivery(&env, "r1").await;
    let (status, _, message) = c.unwrap();
    assert_eq!(status, "Unknown");
    assert!(message.contains("no longer asking"), "{message}");
    assert_eq!(state, Some(MailState::Sent));
    assert_eq!(
        env.metric("capm_mail_delivery_total", Some(("outcome", "unknown"))),
        1.0
    );
    assert_settled(&env, "r1").await;
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smtp_says_delivery_is_not_trackable() {
    let mut env = Env::new("mgc-smtp-delivery").await;
    let smtp = SmtpServer::start(SmtpOptions {
        tls: SmtpTls::None,
        auth: None,
    })
    .unwrap();
    let mut smtp_config = SmtpConfig::new(smtp.url());
    smtp_config.starttls = Some(Starttls::Never);
    smtp_config.timeout_seconds = 10.0;
    let mailer = capm_mailer::build(&MailerConfig::Smtp(smtp_config)).unwrap();
    env.start_with_mailer(config(&env), mailer).await;
    env.create_mailgun_cluster("s1").await;
    env.create_owner_cluster("s1", false).await;
    wait_for_reason(&env, "s1", reasons::NOT_TRACKABLE).await;
    let (c, state) = delivery(&env, "s1").await;
    let (status, _, message) = c.unwrap();
    assert_eq!(status, "Unknown");
    assert!(message.contains("smtp cannot tell whether"), "{message}");
    assert_eq!(state, Some(MailState::Sent));
    assert_eq!(smtp.messages().unwrap().len(), 1);
    assert_eq!(
        env.metric(
            "capm_mail_delivery_total",
            Some(("outcome", "not_trackable"))
        ),
        1.0
    );
    // Set once: no further writes.
    let rv = env.clusters().get("s1").await.unwrap().resource_version();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        env.clusters().get("s1").await.unwrap().resource_version(),
        rv
    );
    env.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_leading_process_asks() {
    let mut env = Env::new("mgc-delivery-leader").await;
    let leadership = capm_controllers::Leadership::elected(
        "test",
        Duration::from_secs(15),
        Duration::from_secs(10),
    );
    leadership.renewed(std::time::Instant::now());
    env.leadership = leadership.clone();
    env.start_with(config(&env)).await;
    env.create_mailgun_cluster("l1").await;
    env.create_owner_cluster("l1", false).await;
    wait_for_reason(&env, "l1", reasons::DELIVERY_PENDING).await;
    // Still open: a leader keeps asking (every second at most here).
    let before = asked(&env);
    eventually(PATIENCE, "another question", || async {
        asked(&env) > before
    })
    .await;

    leadership.lost();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = asked(&env);
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        asked(&env),
        before,
        "a process that does not lead asked about the delivery"
    );

    // Leading again, it picks up where it was.
    leadership.renewed(std::time::Instant::now());
    let id = env.mails()[0].id.clone();
    env.mailgun
        .add_event(&event(&id, DeliveryEvent::Delivered))
        .unwrap();
    wait_for_reason(&env, "l1", reasons::DELIVERED).await;
    assert_eq!(env.mails().len(), 1);
    env.stop().await;
}

/// A new generation (here: the request fulfilled) is said once, in `status.observedGeneration`,
/// in the same status write as the conditions: no condition carries a generation of its own
/// that could lag behind and need a write alone at the next delivery question (a write that says
/// nothing new, which the soak caught in its quiet window).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_generation_moves_every_condition_in_one_write() {
    let mut env = Env::new("mgc-generation").await;
    // The default poll (30 s): no delivery question comes between the two writes looked at.
    env.start().await;
    env.create_mailgun_cluster("g1").await;
    env.create_owner_cluster("g1", false).await;
    wait_for_reason(&env, "g1", reasons::DELIVERY_PENDING).await;
    env.fulfil_cluster("g1").await;
    eventually(PATIENCE, "provisioned", || async {
        let status = env.clusters().get("g1").await.unwrap().status.unwrap();
        condition(&status.conditions, "Provisioned").is_some_and(|c| c.status == "True")
    })
    .await;
    let status = env.clusters().get("g1").await.unwrap().status.unwrap();
    assert_eq!(status.observed_generation, Some(2));
    for c in status.conditions.as_deref().unwrap_or_default() {
        assert_eq!(c.observed_generation, None, "{} carries its own", c.type_);
    }
    env.stop().await;
}

/// A 429 with `Retry-After` pauses the one poller: no question about any open mail until it
/// has passed, then the outcomes arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_pauses_the_whole_poller() {
    let mut env = Env::new("mgc-rate-limited").await;
    env.mailgun
        .set_failure(FailureRule {
            count: Some(1),
            retry_after: Some(4),
            target: FailureTarget::Logs,
            ..FailureRule::new(FailureMode::RateLimited)
        })
        .unwrap();
    env.start_with(config(&env)).await;
    for name in ["p1", "p2", "p3"] {
        env.create_mailgun_cluster(name).await;
        env.create_owner_cluster(name, false).await;
    }
    for name in ["p1", "p2", "p3"] {
        wait_for_reason(&env, name, reasons::DELIVERY_PENDING).await;
    }
    for mail in env.mails() {
        env.mailgun
            .add_event(&event(&mail.id, DeliveryEvent::Delivered))
            .unwrap();
    }
    eventually(PATIENCE, "the first question (refused)", || async {
        asked(&env) >= 1
    })
    .await;
    let refused_at = std::time::Instant::now();
    // Every mail is due every 200 ms to 1 s; the pause holds them all for the 4 s asked.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(asked(&env), 1, "asked during the Retry-After pause");
    for name in ["p1", "p2", "p3"] {
        wait_for_reason(&env, name, reasons::DELIVERED).await;
    }
    assert!(refused_at.elapsed() >= Duration::from_secs(3));
    assert_eq!(env.mails().len(), 3);
    env.stop().await;
}

/// 100 open mails found by a process that starts (the outcomes arrived while none ran): the
/// poller asks about them together, a handful of requests in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_open_mails_cost_a_handful_of_requests() {
    const N: usize = 100;
    let mut env = Env::new("mgc-batch").await;
    // No question while the objects are mailed.
    let quiet = capm_controllers::Config {
        delivery_poll_base: Duration::from_secs(600),
        delivery_poll_max: Duration::from_secs(600),
        ..env.config()
    };
    env.start_with(quiet).await;
    let names: Vec<String> = (0..N).map(|i| format!("b{i}")).collect();
    for name in &names {
        env.create_mailgun_cluster(name).await;
        env.create_owner_cluster(name, false).await;
    }
    eventually(PATIENCE, "every request mailed", || async {
        env.mails().len() == N
    })
    .await;
    for name in &names {
        wait_for_reason(&env, name, reasons::DELIVERY_PENDING).await;
    }
    env.stop().await;
    for mail in env.mails() {
        env.mailgun
            .add_event(&event(&mail.id, DeliveryEvent::Delivered))
            .unwrap();
    }
    // The process was down for one poll base at least: every mail is a base old.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let before = asked(&env);
    let cfg = capm_controllers::Config {
        delivery_poll_base: Duration::from_secs(4),
        delivery_poll_max: Duration::from_secs(4),
        ..env.config()
    };
    env.start_with(cfg).await;
    for name in &names {
        wait_for_reason(&env, name, reasons::DELIVERED).await;
    }
    let requests = asked(&env) - before;
    // 100 accepted and 100 delivered events: two pages of one question.
    println!("{N} open mails answered with {requests} Logs requests");
    assert!(requests <= 5, "{requests} requests for {N} open mails");
    assert_eq!(env.mails().len(), N);
    env.stop().await;
}

/// A Mailgun mailer with only the contract server's domain sending key (no read key).
fn sending_key_only(env: &Env) -> std::sync::Arc<dyn capm_mailer::Mailer> {
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("sending-key");
    std::fs::write(&key, env.mailgun.sending_key()).unwrap();
    let mut cfg =
        capm_mailer::MailgunConfig::new(env.mailgun.domain(), capm_mailer::SecretSource::File(key));
    cfg.base_url = Some(env.mailgun.base_url());
    cfg.request_timeout_seconds = 2.0;
    // Keys are read when the mailer is built: the file may go.
    capm_mailer::build(&MailerConfig::Mailgun(cfg)).unwrap()
}

/// With a domain sending key only: every mail goes out once, the first read is refused and
/// none follows, `MailDelivered` says why once; a send whose outcome was unknown is resent
/// with the same Message-Id after the backoff (the SMTP way), counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sending_key_alone_sends_once_and_says_it_cannot_track() {
    let mut env = Env::new("mgc-sending-key").await;
    let mailer = sending_key_only(&env);
    env.start_with_mailer(config(&env), mailer).await;
    env.create_mailgun_cluster("k1").await;
    env.create_owner_cluster("k1", false).await;
    wait_for_reason(&env, "k1", reasons::NOT_TRACKABLE).await;
    let (c, state) = delivery(&env, "k1").await;
    let (status, _, message) = c.unwrap();
    assert_eq!(status, "Unknown");
    assert!(
        message.contains("mailgun cannot tell whether") && message.contains("read role"),
        "{message}"
    );
    assert!(!message.contains(&env.mailgun.sending_key()));
    assert_eq!(state, Some(MailState::Sent));
    assert_eq!(env.mails().len(), 1);
    // One refused read at most (the poller's first question), then none: no retry loop.
    let refused = asked(&env);
    assert!(refused <= 1, "{refused} questions");
    assert_settled(&env, "k1").await;

    // An unknown outcome: stored, then a 500. No lookup can tell, so after the backoff it is
    // sent again with the same Message-Id: the receivers' copy to drop, counted.
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
    env.create_mailgun_cluster("k2").await;
    env.create_owner_cluster("k2", false).await;
    wait_for_reason(&env, "k2", reasons::NOT_TRACKABLE).await;
    let ids: Vec<String> = env
        .mails()
        .iter()
        .filter(|m| m.variables.get("name").is_some_and(|n| n == "k2"))
        .map(|m| m.id.clone())
        .collect();
    assert_eq!(
        ids.len(),
        2,
        "one resend after the unknown outcome: {ids:?}"
    );
    assert_eq!(ids[0], ids[1], "the resend keeps the Message-Id");
    assert_eq!(env.metric("capm_mail_resends_total", None), 1.0);
    assert_eq!(asked(&env), refused, "nothing read after the refusal");
    env.stop().await;
}
