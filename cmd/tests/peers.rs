//! Hostile and broken network peers against the real binary (issue 24): a Mailgun endpoint that
//! answers a gigabyte, without end, with control characters or with what is not JSON; an SMTP
//! relay with endless lines and replies, control characters in its replies and resets; a
//! flood on the webhook port of concurrent 60 MiB bodies and then 4 000 idle connections under
//! a container's descriptor limit.
//!
//! Each row measures the provider's peak resident set while the peer misbehaves (`VmHWM`,
//! reset before the row through `/proc/<pid>/clear_refs`) and asserts it stays under 64 MiB,
//! that the provider is alive and ready, and that what the peer wrote reaches status, Events and
//! logs only cleaned. Once the peers behave again every object has exactly one mail.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use capm_api::{names, v1beta1::MailgunCluster};
use capm_mail_servers::{
    DeliveryEvent, EventRule, FailureMode, FailureRule, FailureTarget, FloodReport,
    HostileSmtpRelay, MailgunServer, RelayMode, SmtpOptions, SmtpServer, TestPki, idle_connections,
    post_bodies, raise_nofile_limit,
};
use capm_mailer::text::is_unsafe;
use capm_test_support::{TestNamespace, process::free_port};
use common::{Backend, DOMAIN, Launch, Provider, create_pair, delivered, namespace};
use k8s_openapi::api::{coordination::v1::Lease, events::v1::Event};
use kube::{Api, ResourceExt, api::ListParams};
use serde_json::Value;

const MIB: u64 = 1 << 20;
/// The bound of the issue: a provider with nothing else to do stays under it whatever a peer
/// sends (the chart's limit is 128 Mi).
const RSS_BOUND: u64 = 64 * MIB;
const LEASE: &str = "cluster-api-provider-mailgun-leader";

/// Backoff and polling short enough that a row sees several attempts in a few seconds.
fn quick_args() -> Vec<String> {
    [
        "--backoff-base",
        "500ms",
        "--backoff-max",
        "2s",
        "--delivery-poll-base",
        "1s",
        "--delivery-poll-max",
        "2s",
        "--lookup-grace",
        "1s",
        "--log-format",
        "json",
    ]
    .map(str::to_owned)
    .to_vec()
}

const LOG_FILTER: &str = "info,capm_controllers::poller=debug";

/// Resets the process's peak resident set (`VmHWM`) to its current one.
fn reset_peak(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").unwrap();
}

/// The process's peak resident set since the last [`reset_peak`], in bytes.
fn peak_rss(pid: u32) -> u64 {
    capm_test_support::process::status_bytes(pid, "VmHWM:").expect("VmHWM in /proc/<pid>/status")
}

/// One row of the table: what the peer did and the provider's peak resident set meanwhile.
struct Measured {
    row: &'static str,
    peak: u64,
}

fn print_table(title: &str, rows: &[Measured]) {
    eprintln!("\n{title}\n| peer behaviour | peak RSS |\n| --- | --- |");
    for m in rows {
        eprintln!("| {} | {:.1} MiB |", m.row, m.peak as f64 / MIB as f64);
    }
}

/// Fails on the first unsafe character in `text`, naming where it was.
fn assert_clean(text: &str, where_: &str) {
    if let Some(c) = text.chars().find(|&c| is_unsafe(c)) {
        panic!("{where_} carries U+{:04X}: {text:?}", u32::from(c));
    }
}

/// Every string in a JSON value, recursively.
fn strings(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::String(s) => out.push(s.clone()),
        Value::Array(items) => items.iter().for_each(|v| strings(v, out)),
        Value::Object(map) => {
            for (k, v) in map {
                out.push(k.clone());
                strings(v, out);
            }
        }
        _ => {}
    }
}

/// The object's conditions by type: (status, reason, message).
fn conditions(obj: &MailgunCluster) -> BTreeMap<String, (String, String, String)> {
    let value = serde_json::to_value(obj).unwrap();
    value["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            let s = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
            (s("type"), (s("status"), s("reason"), s("message")))
        })
        .collect()
}

/// Polls `name` until `check` accepts its conditions; returns the object.
async fn wait_conditions(
    ns: &TestNamespace,
    name: &str,
    within: Duration,
    what: &str,
    check: impl Fn(&BTreeMap<String, (String, String, String)>) -> bool,
) -> MailgunCluster {
    common::poll_object(ns, name, within, |obj| check(&conditions(obj)))
        .await
        .unwrap_or_else(|last| {
            panic!(
                "{name}: {what} within {within:?}; conditions: {:#?}",
                conditions(&last)
            )
        })
}

fn mail_sent_is(conds: &BTreeMap<String, (String, String, String)>, status: &str) -> bool {
    conds
        .get(names::conditions::MAIL_SENT)
        // A refusal says why; an accepted mail's condition has nothing to add (its id is in
        // status.mail).
        .is_some_and(|(s, _, m)| s == status && (status == "True" || !m.is_empty()))
}

/// Every condition message of every MailgunCluster and every Event note in the namespace, and
/// every string of every log line of `provider`, are clean.
async fn assert_all_shown_clean(ns: &TestNamespace, provider: &Provider) -> usize {
    let mut checked = 0;
    for obj in ns
        .api::<MailgunCluster>()
        .list(&ListParams::default())
        .await
        .unwrap()
    {
        for (kind, (_, reason, message)) in conditions(&obj) {
            assert_clean(&message, &format!("{} condition {kind}", obj.name_any()));
            assert_clean(
                &reason,
                &format!("{} condition {kind} reason", obj.name_any()),
            );
            checked += 1;
        }
    }
    let events: Api<Event> = Api::namespaced(ns.client.clone(), &ns.name);
    for event in events.list(&ListParams::default()).await.unwrap() {
        let note = event.note.clone().unwrap_or_default();
        assert_clean(&note, &format!("Event {}", event.name_any()));
        checked += 1;
    }
    for (n, line) in provider.stderr_log().lines().enumerate() {
        let value: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("log line {n} is not JSON ({e}): {line:?}"));
        let mut texts = Vec::new();
        strings(&value, &mut texts);
        for text in texts {
            assert_clean(&text, &format!("log line {n}"));
        }
        checked += 1;
    }
    checked
}

/// The provider is alive and its readiness probe answers 200.
fn assert_alive_and_ready(provider: &mut Provider, row: &str) {
    assert!(provider.alive(), "{row}: the provider died");
    assert_eq!(provider.probe("/readyz"), Some(200), "{row}: not ready");
}

/// Exactly one copy of each object's request mail, by Message-Id.
async fn assert_one_mail_each(ns: &TestNamespace, ids: &[String]) {
    let mut want: Vec<String> = Vec::new();
    for obj in ns
        .api::<MailgunCluster>()
        .list(&ListParams::default())
        .await
        .unwrap()
    {
        want.push(names::message_id(
            "MailgunCluster",
            &obj.uid().unwrap(),
            DOMAIN,
        ));
    }
    want.sort();
    let mut got = ids.to_vec();
    got.sort();
    assert_eq!(got, want, "exactly one mail per object");
}

/// Every row's peak under [`RSS_BOUND`]; the table printed.
fn assert_bounded(title: &str, measured: &[Measured]) {
    print_table(title, measured);
    for m in measured {
        assert!(
            m.peak < RSS_BOUND,
            "{}: peak RSS {} MiB",
            m.row,
            m.peak / MIB
        );
    }
}

/// After the rows, with the peer behaving: everything shown so far is clean; a new process
/// (a refusal is retried only by a restart) mails the `refused` objects; then every object has
/// exactly one mail among `ids()` and the new process showed nothing unclean either.
async fn restart_and_settle(
    ns: &TestNamespace,
    provider: Provider,
    backend: &Backend<'_>,
    launch: &Launch<'_>,
    refused: &[&str],
    ids: impl Fn() -> Vec<String>,
) {
    let checked = assert_all_shown_clean(ns, &provider).await;
    assert!(checked > 10, "something was checked: {checked}");
    drop(provider);
    let provider = Provider::launch(ns, backend, launch);
    for name in refused {
        wait_conditions(ns, name, Duration::from_secs(60), "MailSent", |c| {
            mail_sent_is(c, "True")
        })
        .await;
    }
    assert_one_mail_each(ns, &ids()).await;
    assert_all_shown_clean(ns, &provider).await;
}

fn hostile(mode: FailureMode, target: FailureTarget) -> FailureRule {
    FailureRule {
        target,
        ..FailureRule::new(mode)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_mailgun_is_read_with_bounds_and_shown_clean() {
    let ns = namespace("peers-mg").await;
    let mailgun = MailgunServer::start(common::KEY, DOMAIN).unwrap();
    let backend = Backend::Mailgun(&mailgun);
    let launch = Launch {
        args: quick_args(),
        log_filter: Some(LOG_FILTER),
        ..Launch::default()
    };
    let mut provider = Provider::launch(&ns, &backend, &launch);
    let pid = provider.pid();
    let mut measured = Vec::new();
    let mut refused = Vec::new();

    // A send answered 200 with a body of 1 GiB (or without end, or not JSON): an accepted send
    // under our Message-Id, read no further than 64 KiB.
    for (row, name, mode) in [
        (
            "send answered 200 with 1 GiB",
            "ok-huge",
            FailureMode::HugeOk,
        ),
        (
            "send answered 200 without end",
            "ok-endless",
            FailureMode::Endless,
        ),
        (
            "send answered 200, not JSON",
            "ok-bad-json",
            FailureMode::BadJson,
        ),
    ] {
        reset_peak(pid);
        mailgun
            .set_failure(hostile(mode, FailureTarget::Messages))
            .unwrap();
        create_pair(&ns, name).await;
        let obj = wait_conditions(&ns, name, Duration::from_secs(60), "MailSent", |c| {
            mail_sent_is(c, "True")
        })
        .await;
        assert!(names::request_recorded_sent(obj.annotations()));
        measured.push(Measured {
            row,
            peak: peak_rss(pid),
        });
        assert_alive_and_ready(&mut provider, row);
        mailgun.clear_failure().unwrap();
    }

    // A send answered 500 with a body of 1 GiB, again and again: retried with backoff, the
    // first KiBs shown; once Mailgun behaves, one mail.
    let row = "send answered 500 with 1 GiB";
    reset_peak(pid);
    mailgun
        .set_failure(hostile(FailureMode::HugeError, FailureTarget::Messages))
        .unwrap();
    create_pair(&ns, "error-huge").await;
    let before = provider.metric("mailer_messages_total");
    wait_conditions(
        &ns,
        "error-huge",
        Duration::from_secs(60),
        "MailSent False",
        |c| mail_sent_is(c, "False"),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while provider.metric("mailer_messages_total") < before + 3.0 {
        assert!(
            Instant::now() < deadline,
            "{row}: three attempts within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    measured.push(Measured {
        row,
        peak: peak_rss(pid),
    });
    assert_alive_and_ready(&mut provider, row);
    mailgun.clear_failure().unwrap();
    wait_conditions(
        &ns,
        "error-huge",
        Duration::from_secs(90),
        "MailSent",
        |c| mail_sent_is(c, "True"),
    )
    .await;

    // A 400 whose message carries terminal escapes, separators and bidi controls: a
    // permanent refusal, shown cleaned.
    let row = "send answered 400 with control characters";
    reset_peak(pid);
    mailgun
        .set_failure(hostile(FailureMode::ControlText, FailureTarget::Messages))
        .unwrap();
    create_pair(&ns, "error-control").await;
    let obj = wait_conditions(
        &ns,
        "error-control",
        Duration::from_secs(60),
        "MailFailed",
        |c| {
            c.get(names::conditions::MAIL_SENT)
                .is_some_and(|(s, r, _)| s == "False" && r == "MailFailed")
        },
    )
    .await;
    let message = &conditions(&obj)[names::conditions::MAIL_SENT].2;
    assert!(
        message.contains("Invalid recipient") && message.contains("mailbox unavailable"),
        "the peer's text is shown, cleaned: {message:?}"
    );
    assert_clean(message, "MailSent of error-control");
    measured.push(Measured {
        row,
        peak: peak_rss(pid),
    });
    mailgun.clear_failure().unwrap();
    refused.push("error-control");

    // The Logs endpoint (the default events API) answers a page of 1 GiB (then 500 with 1 GiB):
    // the delivery question fails with an error naming the limit and is asked again later.
    for (row, name, mode) in [
        ("Logs page of 1 GiB", "events-huge", FailureMode::HugeOk),
        (
            "Logs answered 500 with 1 GiB",
            "events-error",
            FailureMode::HugeError,
        ),
    ] {
        reset_peak(pid);
        mailgun
            .set_failure(hostile(mode, FailureTarget::Logs))
            .unwrap();
        let lines_before = provider.stderr_log().lines().count();
        create_pair(&ns, name).await;
        wait_conditions(&ns, name, Duration::from_secs(60), "MailSent", |c| {
            mail_sent_is(c, "True")
        })
        .await;
        let deadline = Instant::now() + Duration::from_secs(60);
        let complaint = loop {
            let log = provider.stderr_log();
            if let Some(line) = log
                .lines()
                .skip(lines_before)
                .find(|l| l.contains("Could not ask about deliveries"))
            {
                break line.to_owned();
            }
            assert!(
                Instant::now() < deadline,
                "{row}: no failed question in 60 s"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        if mode == FailureMode::HugeOk {
            assert!(
                complaint.contains("4194304") || complaint.contains("4 MiB"),
                "the error names the limit: {complaint}"
            );
        }
        measured.push(Measured {
            row,
            peak: peak_rss(pid),
        });
        assert_alive_and_ready(&mut provider, row);
        mailgun.clear_failure().unwrap();
        // Once the endpoint behaves, the next question gets the answer.
        let obj = ns.api::<MailgunCluster>().get(name).await.unwrap();
        let id = names::message_id("MailgunCluster", &obj.uid().unwrap(), DOMAIN);
        mailgun
            .add_event(&EventRule {
                message_id: id,
                event: DeliveryEvent::Delivered,
                recipient: None,
                reason: None,
                code: None,
                message: None,
            })
            .unwrap();
        wait_conditions(&ns, name, Duration::from_secs(60), "MailDelivered", |c| {
            c.get(names::conditions::MAIL_DELIVERED)
                .is_some_and(|(s, _, _)| s == "True")
        })
        .await;
    }

    // A failed event whose reason and delivery status carry control characters.
    let row = "Logs items with control characters";
    reset_peak(pid);
    mailgun
        .set_failure(hostile(FailureMode::ControlText, FailureTarget::Logs))
        .unwrap();
    create_pair(&ns, "events-control").await;
    let obj = wait_conditions(
        &ns,
        "events-control",
        Duration::from_secs(60),
        "DeliveryFailed",
        |c| {
            c.get(names::conditions::MAIL_DELIVERED)
                .is_some_and(|(s, _, _)| s == "False")
        },
    )
    .await;
    let message = &conditions(&obj)[names::conditions::MAIL_DELIVERED].2;
    assert!(
        message.contains("Invalid recipient"),
        "the peer's text is shown, cleaned: {message:?}"
    );
    measured.push(Measured {
        row,
        peak: peak_rss(pid),
    });
    assert_alive_and_ready(&mut provider, row);
    mailgun.clear_failure().unwrap();

    assert_bounded("Mailgun peers (one provider process)", &measured);
    // A refusal is retried only by a restart: with Mailgun behaving, the new process mails it.
    restart_and_settle(&ns, provider, &backend, &launch, &refused, || {
        delivered(&backend)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_smtp_relay_is_read_with_bounds_and_shown_clean() {
    let ns = namespace("peers-smtp").await;
    let smtp = SmtpServer::start(SmtpOptions::default()).unwrap();
    let relay = HostileSmtpRelay::start(smtp.addr()).unwrap();
    let via_relay = Backend::SmtpUrl(relay.url());
    let launch = Launch {
        args: quick_args(),
        log_filter: Some(LOG_FILTER),
        ..Launch::default()
    };
    let mut provider = Provider::launch(&ns, &via_relay, &launch);
    let pid = provider.pid();
    let mut measured = Vec::new();
    let mut refused = Vec::new();

    for (row, name, mode, permanent) in [
        (
            "greeting: one endless line",
            "endless-greeting",
            RelayMode::EndlessGreeting,
            false,
        ),
        (
            "greeting: endless continuation lines",
            "endless-multiline",
            RelayMode::EndlessMultilineGreeting,
            false,
        ),
        (
            "RCPT answered 550 with control characters",
            "control-rcpt",
            RelayMode::ControlTextOnRcpt,
            true,
        ),
        (
            "greeting and DATA refusal with control characters",
            "control-greeting",
            RelayMode::ControlTextGreeting,
            true,
        ),
        (
            "reply cut by a TCP reset",
            "reset-mid-reply",
            RelayMode::ResetMidReply,
            false,
        ),
        (
            "reply after the message without end",
            "endless-after-data",
            RelayMode::EndlessReplyAfterData,
            false,
        ),
    ] {
        reset_peak(pid);
        relay.set_mode(mode).unwrap();
        let hostile_before = relay.stats().unwrap().hostile;
        create_pair(&ns, name).await;
        let obj = wait_conditions(&ns, name, Duration::from_secs(60), "MailSent False", |c| {
            mail_sent_is(c, "False")
        })
        .await;
        let message = conditions(&obj)[names::conditions::MAIL_SENT].2.clone();
        assert_clean(&message, &format!("MailSent of {name}"));
        if permanent {
            assert!(
                message.contains("Recipient") && message.contains("exe.txt"),
                "{row}: the relay's text is shown, cleaned: {message:?}"
            );
            refused.push(name);
        } else {
            // Retried with backoff: the relay sees more connections.
            let deadline = Instant::now() + Duration::from_secs(60);
            while relay.stats().unwrap().hostile < hostile_before + 2 {
                assert!(Instant::now() < deadline, "{row}: retried within 60 s");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        measured.push(Measured {
            row,
            peak: peak_rss(pid),
        });
        assert_alive_and_ready(&mut provider, row);
        // The relay behaves again: a retried mail goes through (once) before the next row, so
        // no object meets two hostile modes.
        relay.set_mode(RelayMode::Pass).unwrap();
        if !permanent {
            wait_conditions(&ns, name, Duration::from_secs(90), "MailSent", |c| {
                mail_sent_is(c, "True")
            })
            .await;
        }
    }
    let stats = relay.stats().unwrap();
    assert!(
        stats.hostile_bytes > 64 * 1024,
        "the relay really streamed: {stats:?}"
    );

    assert_bounded("SMTP relay peers (one provider process)", &measured);
    restart_and_settle(&ns, provider, &via_relay, &launch, &refused, || {
        delivered(&Backend::Smtp(&smtp))
    })
    .await;
}

/// The Lease's last renewal, as the API server has it.
async fn renewed_at(ns: &TestNamespace) -> String {
    let leases: Api<Lease> = Api::namespaced(ns.client.clone(), &ns.name);
    let lease = leases.get(LEASE).await.unwrap();
    serde_json::to_string(&lease.spec.unwrap().renew_time).unwrap()
}

/// While something floods the webhook, a new object is mailed and the Lease renewed: whether
/// each happened within 60 s.
async fn mailed_and_leading_during(ns: &TestNamespace, name: &str) -> (bool, bool) {
    let renewed = renewed_at(ns).await;
    create_pair(ns, name).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut mailed, mut lease_moved) = (false, false);
    while !(mailed && lease_moved) && Instant::now() < deadline {
        if !mailed {
            let obj = ns.api::<MailgunCluster>().get(name).await.unwrap();
            mailed = names::request_recorded_sent(obj.annotations());
        }
        if !lease_moved {
            lease_moved = renewed_at(ns).await != renewed;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (mailed, lease_moved)
}

/// Rounds of `clients` concurrent `POST`s of `body_bytes` to `/convert` over TLS, one after
/// the other until `stop` is set: the server answers each body at once (413), so one round alone
/// is over in milliseconds.
fn flood_until(
    webhook: SocketAddr,
    clients: usize,
    body_bytes: u64,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<FloodReport>> {
    tokio::spawn(async move {
        let mut rounds = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            rounds.push(post_bodies(webhook, true, clients, body_bytes, "/convert").await);
        }
        rounds
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_flood_leaves_the_provider_mailing_and_leading() {
    const BODIES: usize = 32;
    const BODY_BYTES: u64 = 60 * MIB;
    const IDLE: usize = 4000;
    // As in many containers: soft and hard limit 1 024, so raising the soft one gains nothing
    // and the connection caps must leave room for the API server.
    const NOFILE: u64 = 1024;

    let own_limit = raise_nofile_limit().unwrap();
    assert!(
        own_limit >= (IDLE as u64) + 256,
        "the test needs {IDLE} descriptors: {own_limit}"
    );
    let ns = namespace("peers-flood").await;
    let mailgun = MailgunServer::start(common::KEY, DOMAIN).unwrap();
    let backend = Backend::Mailgun(&mailgun);
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::generate(dir.path()).unwrap();
    let certs = dir.path().join("webhook");
    std::fs::create_dir(&certs).unwrap();
    std::fs::copy(&pki.server_cert, certs.join("tls.crt")).unwrap();
    std::fs::copy(&pki.server_key, certs.join("tls.key")).unwrap();
    let port = free_port().unwrap();
    let webhook = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut args = quick_args();
    args.extend([
        format!("--webhook-port={port}"),
        format!("--webhook-cert-dir={}", certs.display()),
    ]);
    let launch = Launch {
        args,
        log_filter: Some(LOG_FILTER),
        leader_elect: true,
        nofile: Some((NOFILE, NOFILE)),
        ..Launch::default()
    };
    let mut provider = Provider::launch(&ns, &backend, &launch);
    assert_eq!(
        provider
            .wait_metric_at_least("leader_election_master_status", 1.0)
            .await,
        1.0
    );
    let pid = provider.pid();
    let mut measured = Vec::new();

    // 32 clients POST 60 MiB bodies to /convert at once, over TLS, no client certificate.
    reset_peak(pid);
    let stop = Arc::new(AtomicBool::new(false));
    let flood = flood_until(webhook, BODIES, BODY_BYTES, stop.clone());
    let (mailed, leading) = mailed_and_leading_during(&ns, "during-bodies").await;
    stop.store(true, Ordering::SeqCst);
    let rounds = flood.await.unwrap();
    let row = "32 clients POST 60 MiB to /convert at once, round after round";
    measured.push(Measured {
        row,
        peak: peak_rss(pid),
    });
    assert!(mailed, "{row}: a new object was mailed meanwhile");
    assert!(leading, "{row}: the Lease was renewed meanwhile");
    assert_alive_and_ready(&mut provider, row);
    assert!(
        rounds.len() >= 2,
        "the flood lasted: {} rounds",
        rounds.len()
    );
    let mut statuses = BTreeMap::new();
    for report in &rounds {
        for (status, n) in report.statuses() {
            *statuses.entry(status).or_insert(0) += n;
        }
        assert!(
            report.max_body_bytes_sent() < BODY_BYTES,
            "no body was read whole"
        );
    }
    let refused: usize = [413, 503].iter().filter_map(|s| statuses.get(s)).sum();
    eprintln!(
        "{} rounds of {BODIES} bodies: answers {statuses:?}",
        rounds.len()
    );
    assert_eq!(
        refused,
        rounds.len() * BODIES,
        "every body is refused (413 past the limit, 503 past the budget): {statuses:?}"
    );

    // 4 000 idle connections: past the webhook's share of descriptors they are closed at once;
    // the API server's connections, the mail backend's and the probes' are not starved.
    reset_peak(pid);
    let mut idle = idle_connections(webhook, IDLE).await;
    let (mailed, leading) = mailed_and_leading_during(&ns, "during-idle").await;
    let open = idle.probe();
    let row = "4 000 idle connections to the webhook port (limit 1 024 descriptors)";
    measured.push(Measured {
        row,
        peak: peak_rss(pid),
    });
    assert!(mailed, "{row}: a new object was mailed meanwhile");
    assert!(leading, "{row}: the Lease was renewed meanwhile");
    assert_alive_and_ready(&mut provider, row);
    assert!(
        open < 1024,
        "{row}: the webhook held {open} of {IDLE} connections ({idle:?})",
        idle = (
            idle.connected,
            idle.refused,
            idle.timed_out,
            idle.closed_by_server
        )
    );
    assert!(
        idle.closed_by_server > 0 || idle.refused + idle.timed_out > 0,
        "connections past the cap were refused or closed"
    );
    drop(idle);
    assert!(
        provider.metric_with("capm_http_rejected_total", &["server=\"webhook\""]) >= 1.0,
        "refusals are counted"
    );
    let log = provider.stderr_log();
    assert!(
        !log.contains("Too many open files"),
        "the process ran out of descriptors"
    );

    assert_bounded("Webhook flood (one provider process)", &measured);
    assert_one_mail_each(&ns, &delivered(&backend)).await;
    assert_all_shown_clean(&ns, &provider).await;
}
