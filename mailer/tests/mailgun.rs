//! The Mailgun backend against the contract server (`mailgun-contract-server`).
#![allow(
    clippy::unwrap_used,
    reason = "helpers of tests: a failure is a test failure"
)]

use std::{
    net::TcpListener,
    sync::Arc,
    time::{Duration, Instant, SystemTime},
};

use capm_mail_servers::{
    DeliveryEvent, EventRule, FailureMode, FailureRule, FailureTarget, MailgunServer,
};
use capm_mailer::{
    Delivery, ErrorKind, InstrumentedMailer, LOGS_BATCH, Lookup, Mailer, MailerConfig,
    MailerMetrics, MailgunConfig, MailgunEventsApi, MailgunMailer, Message, MessageId, OpenMail,
    SecretSource, Tracking, build,
};

const KEY: &str = "key-contract-test-0123";
const DOMAIN: &str = "mg.capm.test";

struct Fixture {
    server: MailgunServer,
    _dir: tempfile::TempDir,
    config: MailgunConfig,
}

fn fixture() -> Fixture {
    let server = MailgunServer::start(KEY, DOMAIN).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let key_file = dir.path().join("api-key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let mut config = MailgunConfig::new(DOMAIN, SecretSource::File(key_file));
    config.base_url = Some(server.base_url());
    config.request_timeout_seconds = 5.0;
    Fixture {
        server,
        _dir: dir,
        config,
    }
}

impl Fixture {
    fn mailer(&self) -> MailgunMailer {
        MailgunMailer::new(&self.config).unwrap()
    }

    fn fail(&self, mode: FailureMode, count: Option<u32>) {
        self.server
            .set_failure(FailureRule {
                mode,
                count,
                retry_after: None,
                target: FailureTarget::Messages,
                body_bytes: None,
                drip_ms: None,
            })
            .unwrap();
    }
}

fn message(id: &str) -> Message {
    Message::builder()
        .from(format!("Cluster requests <capm@{DOMAIN}>"))
        .reply_to("dev@example.com")
        .to("ops@example.com")
        .to("audit@example.com")
        .subject("[Urgent] New Cluster demo requested")
        .text("Hello! One cluster please.\n\nthree nodes")
        .message_id(id)
        .tag("cluster-request")
        .variable("cluster", "default/demo")
        .build()
        .unwrap()
}

#[tokio::test]
async fn send_posts_every_field_and_returns_our_id() {
    let mut f = fixture();
    f.config.test_mode = true;
    let receipt = f.mailer().send(&message("<mg-1@capm.test>")).await.unwrap();
    assert_eq!(receipt.message_id, "<mg-1@capm.test>");
    assert_eq!(receipt.response, "Queued. Thank you.");

    let stored = f.server.messages().unwrap();
    assert_eq!(stored.len(), 1);
    let m = &stored[0];
    assert_eq!(m.id, "<mg-1@capm.test>");
    assert_eq!(m.headers["Message-Id"], "<mg-1@capm.test>");
    assert_eq!(m.from, format!("Cluster requests <capm@{DOMAIN}>"));
    assert_eq!(m.headers["Reply-To"], "dev@example.com");
    assert_eq!(m.to, vec!["ops@example.com", "audit@example.com"]);
    assert_eq!(m.subject, "[Urgent] New Cluster demo requested");
    assert_eq!(
        m.text.as_deref(),
        Some("Hello! One cluster please.\n\nthree nodes")
    );
    assert_eq!(m.tags, vec!["cluster-request"]);
    assert_eq!(m.variables["cluster"], "default/demo");
    assert_eq!(m.options["testmode"], "yes");
}

#[tokio::test]
async fn a_follow_up_is_threaded_under_the_first_mail() {
    let f = fixture();
    let first = message("<mg-first@capm.test>");
    let follow_up = Message::builder()
        .from(format!("Cluster requests <capm@{DOMAIN}>"))
        .to("ops@example.com")
        .subject("Re: [Urgent] New Cluster demo requested")
        .text("A reminder.")
        .message_id("<mg-reminder@capm.test>")
        .in_reply_to(first.message_id().as_str())
        .build()
        .unwrap();
    f.mailer().send(&first).await.unwrap();
    f.mailer().send(&follow_up).await.unwrap();
    let stored = f.server.messages().unwrap();
    assert_eq!(stored.len(), 2);
    assert!(
        !stored[0].headers.contains_key("In-Reply-To"),
        "{:?}",
        stored[0].headers
    );
    assert_eq!(stored[1].headers["In-Reply-To"], "<mg-first@capm.test>");
    assert_eq!(stored[1].headers["References"], "<mg-first@capm.test>");
}

#[tokio::test]
async fn a_from_off_the_sending_domain_is_refused_by_the_contract_server() {
    let f = fixture();
    let off_domain = Message::builder()
        .from("dev@example.com")
        .to("ops@example.com")
        .subject("s")
        .text("t")
        .message_id("<mg-dmarc@capm.test>")
        .build()
        .unwrap();
    let err = f.mailer().send(&off_domain).await.unwrap_err();
    assert!(err.to_string().contains("DMARC"), "{err}");
    assert!(f.server.messages().unwrap().is_empty());
}

#[tokio::test]
async fn a_wrong_api_key_is_permanent_and_never_printed() {
    let mut f = fixture();
    let dir = tempfile::tempdir().unwrap();
    let wrong = dir.path().join("wrong");
    std::fs::write(&wrong, "key-wrong-secret-999").unwrap();
    f.config.api_key = SecretSource::File(wrong);
    let mailer = f.mailer();
    let err = mailer
        .send(&message("<mg-401@capm.test>"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Permanent, "{err}");
    assert_eq!(err.code(), Some(401));
    assert!(!format!("{err} {err:?} {mailer:?} {:?}", f.config).contains("secret-999"));
    assert!(f.server.messages().unwrap().is_empty());
}

#[tokio::test]
async fn injected_401_is_permanent() {
    let f = fixture();
    f.fail(FailureMode::Unauthorized, Some(1));
    let mailer = f.mailer();
    let err = mailer
        .send(&message("<mg-401b@capm.test>"))
        .await
        .unwrap_err();
    assert_eq!((err.kind(), err.code()), (ErrorKind::Permanent, Some(401)));
    // Only one request failed.
    mailer.send(&message("<mg-401b@capm.test>")).await.unwrap();
}

#[tokio::test]
async fn rate_limiting_is_retryable_with_retry_after() {
    let f = fixture();
    f.server
        .set_failure(FailureRule {
            mode: FailureMode::RateLimited,
            count: Some(1),
            retry_after: Some(7),
            target: FailureTarget::Messages,
            body_bytes: None,
            drip_ms: None,
        })
        .unwrap();
    let err = f
        .mailer()
        .send(&message("<mg-429@capm.test>"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Retryable, "{err}");
    assert_eq!(err.code(), Some(429));
    assert_eq!(err.retry_after(), Some(Duration::from_secs(7)));
}

#[tokio::test]
async fn a_500_is_an_unknown_outcome() {
    let f = fixture();
    f.fail(FailureMode::ServerError, None);
    let err = f
        .mailer()
        .send(&message("<mg-500@capm.test>"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::UnknownOutcome, "{err}");
    assert_eq!(err.code(), Some(500));
    assert_eq!(err.metric_label(), "unknown_outcome");
}

#[tokio::test]
async fn after_a_500_that_was_accepted_the_lookup_finds_the_message() {
    let f = fixture();
    f.fail(FailureMode::AcceptThenServerError, Some(1));
    let mailer = f.mailer();
    let m = message("<mg-500-accepted@capm.test>");
    let err = mailer.send(&m).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::UnknownOutcome);
    assert_eq!(
        mailer.lookup(m.message_id()).await.unwrap(),
        Lookup::Accepted {
            event: "accepted".into()
        }
    );
}

#[tokio::test]
async fn a_hanging_server_times_out_as_unknown_outcome() {
    let mut f = fixture();
    f.config.request_timeout_seconds = 0.5;
    f.fail(FailureMode::Hang, None);
    let start = Instant::now();
    let err = f
        .mailer()
        .send(&message("<mg-hang@capm.test>"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::UnknownOutcome, "{err}");
    assert_eq!(err.code(), None);
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn lookup_finds_sent_ids_and_not_others() {
    for api in [MailgunEventsApi::Logs, MailgunEventsApi::Events] {
        let mut f = fixture();
        f.config.events_api = api;
        lookup_finds(&f).await;
    }
}

async fn lookup_finds(f: &Fixture) {
    let mailer = f.mailer();
    // Characters that need encoding in a query string.
    let m = message("<mg+look=up&1@capm.test>");
    mailer.send(&m).await.unwrap();
    assert_eq!(
        mailer.lookup(m.message_id()).await.unwrap(),
        Lookup::Accepted {
            event: "accepted".into()
        }
    );
    let other = MessageId::parse("<never-sent@capm.test>").unwrap();
    assert_eq!(mailer.lookup(&other).await.unwrap(), Lookup::NotFound);
    let prefix = MessageId::parse("<mg+look@capm.test>").unwrap();
    assert_eq!(mailer.lookup(&prefix).await.unwrap(), Lookup::NotFound);
}

#[tokio::test]
async fn lookup_failures_are_retryable() {
    let f = fixture();
    f.server
        .set_failure(FailureRule {
            mode: FailureMode::ServerError,
            count: Some(1),
            retry_after: None,
            target: FailureTarget::All,
            body_bytes: None,
            drip_ms: None,
        })
        .unwrap();
    let id = MessageId::parse("<x@capm.test>").unwrap();
    let err = f.mailer().lookup(&id).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Retryable, "{err}");
}

#[tokio::test]
async fn connection_refused_is_retryable() {
    let mut f = fixture();
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    f.config.base_url = Some(format!("http://127.0.0.1:{port}"));
    let err = f
        .mailer()
        .send(&message("<mg-down@capm.test>"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Retryable, "{err}");
}

#[tokio::test]
async fn an_unknown_domain_is_retryable_404() {
    let mut f = fixture();
    f.config.domain = "other.capm.test".into();
    let err = f
        .mailer()
        .send(&message("<mg-404@capm.test>"))
        .await
        .unwrap_err();
    assert_eq!((err.kind(), err.code()), (ErrorKind::Retryable, Some(404)));
}

#[tokio::test]
async fn factory_and_metrics_with_concurrent_senders() {
    let f = fixture();
    let config = MailerConfig::Mailgun(f.config.clone());
    config.validate().unwrap();
    let registry = prometheus::Registry::new();
    let metrics = MailerMetrics::register(&registry).unwrap();
    let mailer: Arc<dyn Mailer> =
        Arc::new(InstrumentedMailer::new(build(&config).unwrap(), metrics));
    assert_eq!(mailer.backend(), "mailgun");
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..32 {
        let mailer = Arc::clone(&mailer);
        tasks.spawn(async move { mailer.send(&message(&format!("<c-{i}@capm.test>"))).await });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap().unwrap();
    }
    assert_eq!(f.server.messages().unwrap().len(), 32);
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .unwrap();
    assert!(
        text.contains(r#"mailer_messages_total{backend="mailgun",identity="",outcome="sent"} 32"#),
        "{text}"
    );
    assert!(
        text.contains(r#"mailer_send_duration_seconds_count{backend="mailgun"} 32"#),
        "{text}"
    );
    // A sibling backend (a tenant's) wrapped like this one counts in the same metrics.
    let sibling = mailer.wrap_like_me(build(&config).unwrap(), "tenant-a");
    sibling
        .send(&message("<c-sibling@capm.test>"))
        .await
        .unwrap();
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .unwrap();
    assert!(
        text.contains(
            r#"mailer_messages_total{backend="mailgun",identity="tenant-a",outcome="sent"} 1"#
        ),
        "{text}"
    );
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

/// What became of one mail: a question about a batch of one.
async fn delivery_status(
    mailer: &dyn Mailer,
    message_id: &MessageId,
    sent_at: SystemTime,
) -> Result<Delivery, capm_mailer::MailError> {
    let mail = OpenMail {
        message_id: message_id.clone(),
        sent_at,
    };
    let mut answers = mailer
        .delivery_statuses(std::slice::from_ref(&mail))
        .await?;
    assert_eq!(answers.len(), 1, "one answer per mail");
    Ok(answers.remove(0))
}

/// Sends `id` through the contract server; returns the mailer and the send time.
async fn sent(f: &Fixture, id: &str) -> (MailgunMailer, MessageId, SystemTime) {
    let mailer = f.mailer();
    let m = message(id);
    let at = SystemTime::now();
    mailer.send(&m).await.unwrap();
    (mailer, m.message_id().clone(), at)
}

#[tokio::test]
async fn accepted_only_is_pending_then_delivered() {
    let f = fixture();
    let (mailer, id, at) = sent(&f, "<dl-1@capm.test>").await;
    assert_eq!(
        delivery_status(&mailer, &id, at).await.unwrap(),
        Delivery::Pending {
            temporary_failure: None
        }
    );
    f.server
        .add_event(&event("<dl-1@capm.test>", DeliveryEvent::Delivered))
        .unwrap();
    assert_eq!(
        delivery_status(&mailer, &id, at).await.unwrap(),
        Delivery::Delivered
    );
    // Another message's outcome is not this one's.
    let (_, other, _) = sent(&f, "<dl-1-other@capm.test>").await;
    assert_eq!(
        delivery_status(&mailer, &other, at).await.unwrap(),
        Delivery::Pending {
            temporary_failure: None
        }
    );
}

#[tokio::test]
async fn a_permanent_failure_reports_reason_and_reply_without_the_key() {
    let f = fixture();
    let (mailer, id, at) = sent(&f, "<dl-2@capm.test>").await;
    f.server
        .add_event(&EventRule {
            reason: Some("bounce".into()),
            code: Some(550),
            message: Some("5.1.1 mailbox does not exist".into()),
            ..event("dl-2@capm.test", DeliveryEvent::PermanentFailure)
        })
        .unwrap();
    let Delivery::Failed { reason } = delivery_status(&mailer, &id, at).await.unwrap() else {
        panic!("not failed");
    };
    assert!(
        reason.contains("ops@example.com: bounce: 550 5.1.1 mailbox does not exist"),
        "{reason}"
    );
    assert!(reason.contains("audit@example.com"), "{reason}");
    assert!(!reason.contains(KEY), "{reason}");
}

#[tokio::test]
async fn temporary_failures_stay_pending_until_delivered() {
    let f = fixture();
    let (mailer, id, at) = sent(&f, "<dl-3@capm.test>").await;
    f.server
        .add_event(&EventRule {
            reason: Some("generic".into()),
            code: Some(421),
            message: Some("try again later".into()),
            ..event("<dl-3@capm.test>", DeliveryEvent::TemporaryFailure)
        })
        .unwrap();
    let Delivery::Pending {
        temporary_failure: Some(why),
    } = delivery_status(&mailer, &id, at).await.unwrap()
    else {
        panic!("not pending with a temporary failure");
    };
    assert!(why.contains("421 try again later"), "{why}");
    f.server
        .add_event(&event("<dl-3@capm.test>", DeliveryEvent::Delivered))
        .unwrap();
    assert_eq!(
        delivery_status(&mailer, &id, at).await.unwrap(),
        Delivery::Delivered
    );
}

#[tokio::test]
async fn a_failure_to_one_recipient_is_reported_although_the_other_has_the_mail() {
    let f = fixture();
    let (mailer, id, at) = sent(&f, "<dl-4@capm.test>").await;
    f.server
        .add_event(&EventRule {
            recipient: Some("audit@example.com".into()),
            ..event("<dl-4@capm.test>", DeliveryEvent::PermanentFailure)
        })
        .unwrap();
    // One recipient failed, the other is still on its way.
    assert_eq!(
        delivery_status(&mailer, &id, at).await.unwrap(),
        Delivery::Pending {
            temporary_failure: None
        }
    );
    f.server
        .add_event(&EventRule {
            recipient: Some("ops@example.com".into()),
            ..event("<dl-4@capm.test>", DeliveryEvent::Delivered)
        })
        .unwrap();
    let Delivery::PartlyDelivered { failed } = delivery_status(&mailer, &id, at).await.unwrap()
    else {
        panic!("not partly delivered");
    };
    assert!(failed.starts_with("audit@example.com: generic"), "{failed}");
    assert!(!failed.contains("ops@example.com"), "{failed}");
}

#[tokio::test]
async fn the_outcome_on_a_later_page_is_found_with_the_events_api() {
    let mut f = fixture();
    f.config.events_api = MailgunEventsApi::Events;
    // Page size 1: two accepted, four temporary failures (two per recipient), then the
    // delivery on page 7.
    f.server.set_page_size(1).unwrap();
    let (mailer, id, at) = sent(&f, "<dl-5@capm.test>").await;
    for _ in 0..2 {
        f.server
            .add_event(&event("<dl-5@capm.test>", DeliveryEvent::TemporaryFailure))
            .unwrap();
    }
    // Unrelated traffic in between.
    sent(&f, "<dl-5-noise@capm.test>").await;
    f.server
        .add_event(&event("<dl-5@capm.test>", DeliveryEvent::Delivered))
        .unwrap();
    let before = f.server.stats().unwrap().events_requests;
    assert_eq!(
        delivery_status(&mailer, &id, at).await.unwrap(),
        Delivery::Delivered
    );
    // 8 items, one per page, and the empty page that ends it.
    assert_eq!(f.server.stats().unwrap().events_requests - before, 9);
}

#[tokio::test]
async fn events_failures_are_retryable() {
    let mut f = fixture();
    f.config.events_api = MailgunEventsApi::Events;
    let (mailer, id, at) = sent(&f, "<dl-6@capm.test>").await;
    f.server
        .set_failure(FailureRule {
            mode: FailureMode::ServerError,
            count: Some(1),
            retry_after: None,
            target: FailureTarget::Events,
            body_bytes: None,
            drip_ms: None,
        })
        .unwrap();
    let err = delivery_status(&mailer, &id, at).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Retryable, "{err}");
    assert!(!format!("{err} {err:?}").contains(KEY));
}

#[tokio::test]
async fn events_before_the_send_time_are_not_asked_for() {
    let f = fixture();
    let (mailer, id, _) = sent(&f, "<dl-7@capm.test>").await;
    f.server
        .add_event(&event("<dl-7@capm.test>", DeliveryEvent::Delivered))
        .unwrap();
    // A send time far in the future (beyond the clock slack): nothing is in range.
    let later = SystemTime::now() + Duration::from_secs(3600);
    assert_eq!(
        delivery_status(&mailer, &id, later).await.unwrap(),
        Delivery::Pending {
            temporary_failure: None
        }
    );
}

/// Sends `count` mails (two recipients each) and returns them as open mails.
async fn open_mails(f: &Fixture, prefix: &str, count: usize) -> Vec<OpenMail> {
    let mailer = f.mailer();
    let mut mails = Vec::new();
    for i in 0..count {
        let m = message(&format!("<{prefix}-{i}@capm.test>"));
        let sent_at = SystemTime::now();
        mailer.send(&m).await.unwrap();
        mails.push(OpenMail {
            message_id: m.message_id().clone(),
            sent_at,
        });
    }
    mails
}

fn logs_requests(f: &Fixture) -> u64 {
    f.server.stats().unwrap().logs_requests
}

#[tokio::test]
async fn a_batch_of_100_open_mails_is_answered_with_a_handful_of_logs_requests() {
    let f = fixture();
    let mails = open_mails(&f, "batch", 100).await;
    // Every fifth delivered to one recipient and failed for good for the other, every other
    // third delivered to both, the rest open.
    for (i, mail) in mails.iter().enumerate() {
        let id = mail.message_id.as_str();
        if i % 5 == 0 {
            for (recipient, what) in [
                ("ops@example.com", DeliveryEvent::Delivered),
                ("audit@example.com", DeliveryEvent::PermanentFailure),
            ] {
                f.server
                    .add_event(&EventRule {
                        recipient: Some(recipient.into()),
                        ..event(id, what)
                    })
                    .unwrap();
            }
        } else if i % 3 == 0 {
            f.server
                .add_event(&event(id, DeliveryEvent::Delivered))
                .unwrap();
        }
    }
    let mailer = f.mailer();
    assert_eq!(mailer.delivery_batch_size(), LOGS_BATCH);
    let before = logs_requests(&f);
    let answers = mailer.delivery_statuses(&mails).await.unwrap();
    let asked = logs_requests(&f) - before;
    // 200 accepted, 74 delivered and 20 failed events: three pages of 100.
    println!("100 open mails answered with {asked} Logs requests");
    assert!(asked <= 5, "{asked} requests for 100 mails");
    assert_eq!(answers.len(), 100);
    for (i, answer) in answers.iter().enumerate() {
        let expected = if i % 5 == 0 {
            "partly"
        } else if i % 3 == 0 {
            "delivered"
        } else {
            "pending"
        };
        let got = match answer {
            Delivery::PartlyDelivered { failed } => {
                assert!(failed.contains("audit@example.com"), "{failed}");
                "partly"
            }
            Delivery::Delivered => "delivered",
            Delivery::Pending { .. } => "pending",
            other => panic!("mail {i}: {other:?}"),
        };
        assert_eq!(got, expected, "mail {i}");
    }
    // The same question through the events API costs a request per mail at least.
    let mut events = fixture();
    events.config.events_api = MailgunEventsApi::Events;
    let mails = open_mails(&events, "batch-events", 10).await;
    let mailer = events.mailer();
    assert_eq!(mailer.delivery_batch_size(), 1);
    let before = events.server.stats().unwrap().events_requests;
    assert_eq!(mailer.delivery_statuses(&mails).await.unwrap().len(), 10);
    assert!(events.server.stats().unwrap().events_requests - before >= 10);
}

#[tokio::test]
async fn the_logs_pagination_token_is_followed_to_the_outcome() {
    let f = fixture();
    f.server.set_page_size(1).unwrap();
    let (mailer, id, at) = sent(&f, "<lg-1@capm.test>").await;
    for _ in 0..2 {
        f.server
            .add_event(&event("<lg-1@capm.test>", DeliveryEvent::TemporaryFailure))
            .unwrap();
    }
    sent(&f, "<lg-1-noise@capm.test>").await;
    f.server
        .add_event(&event("<lg-1@capm.test>", DeliveryEvent::Delivered))
        .unwrap();
    let before = logs_requests(&f);
    assert_eq!(
        delivery_status(&mailer, &id, at).await.unwrap(),
        Delivery::Delivered
    );
    // 2 accepted, 4 temporary failures, 2 deliveries: one item a page, the last without a token.
    assert_eq!(logs_requests(&f) - before, 8);
}

#[tokio::test]
async fn logs_failures_keep_their_classes_and_retry_after() {
    let f = fixture();
    let (mailer, id, at) = sent(&f, "<lg-2@capm.test>").await;
    let fail = |mode, retry_after| {
        f.server
            .set_failure(FailureRule {
                count: Some(1),
                retry_after,
                target: FailureTarget::Logs,
                ..FailureRule::new(mode)
            })
            .unwrap();
    };
    fail(FailureMode::RateLimited, Some(7));
    let err = delivery_status(&mailer, &id, at).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Retryable, "{err}");
    assert_eq!(err.code(), Some(429));
    assert_eq!(err.retry_after(), Some(Duration::from_secs(7)));
    fail(FailureMode::ServerError, None);
    let err = mailer.lookup(&id).await.unwrap_err();
    assert_eq!((err.kind(), err.code()), (ErrorKind::Retryable, Some(500)));
    // Used up: the Logs API answers again.
    assert_eq!(
        mailer.lookup(&id).await.unwrap(),
        Lookup::Accepted {
            event: "accepted".into()
        }
    );
    // A refusal of the key is not retried: reading stops, and says why (without the key).
    fail(FailureMode::Unauthorized, None);
    assert_eq!(
        delivery_status(&mailer, &id, at).await.unwrap(),
        Delivery::NotTrackable
    );
    let Tracking::Untracked(Some(why)) = mailer.tracking() else {
        panic!("tracking still on after a 401");
    };
    assert!(why.contains("401") && !why.contains(KEY), "{why}");
    assert_eq!(mailer.lookup(&id).await.unwrap(), Lookup::Unsupported);
}

#[tokio::test]
async fn hostile_logs_replies_are_bounded_and_cleaned() {
    let f = fixture();
    let (mailer, id, at) = sent(&f, "<lg-3@capm.test>").await;
    let hostile = |mode| {
        f.server
            .set_failure(FailureRule {
                count: Some(1),
                target: FailureTarget::Logs,
                body_bytes: Some(64 << 20),
                ..FailureRule::new(mode)
            })
            .unwrap();
    };
    hostile(FailureMode::HugeOk);
    let started = std::time::Instant::now();
    let err = delivery_status(&mailer, &id, at).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Retryable, "{err}");
    assert!(err.to_string().contains("larger than"), "{err}");
    assert!(started.elapsed() < Duration::from_secs(5));
    hostile(FailureMode::BadJson);
    let err = mailer.lookup(&id).await.unwrap_err();
    assert!(err.to_string().contains("unreadable logs reply"), "{err}");
    hostile(FailureMode::ControlText);
    // The hostile page says the first recipient failed, with control text, and its token asks
    // again from the start, where the real events say the other has the mail.
    f.server
        .add_event(&EventRule {
            recipient: Some("audit@example.com".into()),
            ..event("<lg-3@capm.test>", DeliveryEvent::Delivered)
        })
        .unwrap();
    let answer = delivery_status(&mailer, &id, at).await.unwrap();
    let Delivery::PartlyDelivered { failed: reason } = answer else {
        panic!("{answer:?}");
    };
    assert!(reason.contains("mailbox unavailable"), "{reason}");
    assert!(
        !reason
            .chars()
            .any(|c| c.is_control() || ('\u{2028}'..='\u{202e}').contains(&c)),
        "{reason:?}"
    );
}

impl Fixture {
    /// The fixture's configuration with `key` as the (sending) API key and `read_key`, if any,
    /// as the read key, each from a file of its own (a key file is re-read when it changes, so
    /// two mailers must not share one).
    fn with_keys(&self, key: &str, read_key: Option<&str>, api: MailgunEventsApi) -> MailgunConfig {
        static FILES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let write = |name: &str, value: &str| {
            let n = FILES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path = self._dir.path().join(format!("{name}-{n}"));
            std::fs::write(&path, value).unwrap();
            SecretSource::File(path)
        };
        let mut config = self.config.clone();
        config.api_key = write("scoped-key", key);
        config.read_api_key = read_key.map(|k| write("scoped-read-key", k));
        config.events_api = api;
        config
    }
}

#[tokio::test]
async fn the_contract_server_gives_keys_mailgun_scopes() {
    let f = fixture();
    let sending = f.server.sending_key();
    let read = f.server.read_key();
    for api in [MailgunEventsApi::Logs, MailgunEventsApi::Events] {
        // A read-only key may not send: a permanent refusal, nothing stored.
        let reader = MailgunMailer::new(&f.with_keys(&read, None, api)).unwrap();
        let err = reader
            .send(&message("<scope-read-send@capm.test>"))
            .await
            .unwrap_err();
        assert_eq!((err.kind(), err.code()), (ErrorKind::Permanent, Some(401)));
        // A sending key sends; reading with it is refused (401, as Mailgun answers).
        let sender = MailgunMailer::new(&f.with_keys(&sending, None, api)).unwrap();
        let m = message(&format!("<scope-send-{api:?}@capm.test>"));
        sender.send(&m).await.unwrap();
        assert_eq!(
            f.server.messages().unwrap().len(),
            if api == MailgunEventsApi::Logs { 1 } else { 2 }
        );
        // ... and the read-only key reads what the sending key sent.
        assert!(matches!(
            reader.lookup(m.message_id()).await.unwrap(),
            Lookup::Accepted { .. }
        ));
    }
    // A sending key is its domain's: another domain is refused, not "not found".
    let mut other = f.with_keys(&sending, None, MailgunEventsApi::Logs);
    other.domain = "other.capm.test".into();
    let err = MailgunMailer::new(&other)
        .unwrap()
        .send(
            &Message::builder()
                .from("capm@other.capm.test")
                .to("ops@example.com")
                .subject("s")
                .text("t")
                .message_id("<scope-other@capm.test>")
                .build()
                .unwrap(),
        )
        .await
        .unwrap_err();
    assert_eq!(err.code(), Some(401), "{err}");
}

#[tokio::test]
async fn with_only_a_sending_key_reads_stop_after_the_first_refusal_and_say_why() {
    let f = fixture();
    for api in [MailgunEventsApi::Logs, MailgunEventsApi::Events] {
        let mailer = MailgunMailer::new(&f.with_keys(&f.server.sending_key(), None, api)).unwrap();
        assert_eq!(mailer.tracking(), Tracking::Tracked, "nothing refused yet");
        let m = message(&format!("<only-sending-{api:?}@capm.test>"));
        let at = SystemTime::now();
        mailer.send(&m).await.unwrap();
        let before = (logs_requests(&f), f.server.stats().unwrap().events_requests);
        // The first read is refused; the mailer answers as a backend without a log would.
        assert_eq!(
            mailer.lookup(m.message_id()).await.unwrap(),
            Lookup::Unsupported
        );
        let Tracking::Untracked(Some(why)) = mailer.tracking() else {
            panic!("tracking still on after a refusal");
        };
        assert!(
            why.contains("read role") && why.contains("readApiKey"),
            "{why}"
        );
        assert!(
            !why.contains(&f.server.sending_key()),
            "the key is never shown"
        );
        // From then on nothing is asked: no retry loop against a key that cannot read.
        let mails = [OpenMail {
            message_id: m.message_id().clone(),
            sent_at: at,
        }];
        for _ in 0..3 {
            assert_eq!(
                mailer.delivery_statuses(&mails).await.unwrap(),
                vec![Delivery::NotTrackable]
            );
            assert_eq!(
                mailer.lookup(m.message_id()).await.unwrap(),
                Lookup::Unsupported
            );
        }
        let after = (logs_requests(&f), f.server.stats().unwrap().events_requests);
        // (The contract server counts refused Logs requests, and answered events requests.)
        let refused = u64::from(api == MailgunEventsApi::Logs);
        assert_eq!(
            after.0 + after.1,
            before.0 + before.1 + refused,
            "one refused read, then none"
        );
    }
}

#[tokio::test]
async fn a_sending_key_with_a_read_key_tracks_delivery() {
    let f = fixture();
    for api in [MailgunEventsApi::Logs, MailgunEventsApi::Events] {
        let config = f.with_keys(&f.server.sending_key(), Some(&f.server.read_key()), api);
        let mailer = MailgunMailer::new(&config).unwrap();
        let id = format!("<read-key-{api:?}@capm.test>");
        let m = message(&id);
        let at = SystemTime::now();
        mailer.send(&m).await.unwrap();
        assert!(matches!(
            mailer.lookup(m.message_id()).await.unwrap(),
            Lookup::Accepted { .. }
        ));
        f.server
            .add_event(&event(&id, DeliveryEvent::Delivered))
            .unwrap();
        assert_eq!(
            delivery_status(&mailer, m.message_id(), at).await.unwrap(),
            Delivery::Delivered
        );
        assert_eq!(mailer.tracking(), Tracking::Tracked);
    }
    // A read key that may not read (here: a sending key given as the read key) is named.
    let config = f.with_keys(
        &f.server.sending_key(),
        Some(&f.server.sending_key()),
        MailgunEventsApi::Logs,
    );
    let mailer = MailgunMailer::new(&config).unwrap();
    assert_eq!(
        mailer
            .lookup(&MessageId::parse("<nobody@capm.test>").unwrap())
            .await
            .unwrap(),
        Lookup::Unsupported
    );
    let Tracking::Untracked(Some(why)) = mailer.tracking() else {
        panic!("tracking still on after a refusal");
    };
    assert!(why.contains("the read key"), "{why}");
}

#[tokio::test]
async fn a_key_file_rotated_in_place_is_used_without_a_new_mailer() {
    let f = fixture();
    let config = f.with_keys("key-revoked", None, MailgunEventsApi::Logs);
    let mailer = MailgunMailer::new(&config).unwrap();
    let err = mailer
        .send(&message("<rotate-before@capm.test>"))
        .await
        .unwrap_err();
    assert_eq!((err.kind(), err.code()), (ErrorKind::Permanent, Some(401)));
    // The kubelet's way: the new file written beside, then renamed over the old name.
    let SecretSource::File(path) = &config.api_key else {
        unreachable!("with_keys writes files")
    };
    let next = path.with_extension("new");
    std::fs::write(&next, format!("{KEY}\n")).unwrap();
    std::fs::rename(&next, path).unwrap();
    mailer
        .send(&message("<rotate-after@capm.test>"))
        .await
        .unwrap();
    assert_eq!(f.server.messages().unwrap().len(), 1);
}
