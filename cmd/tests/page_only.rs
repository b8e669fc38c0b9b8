//! `--mode fulfilment-page` against the real local API server: the process starts without any
//! mail setting, serves the page (a link opens its form), the probes and `/metrics`, and runs
//! neither controllers, webhooks nor leader election.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::{
    net::{Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use capm_api::{
    link_token::{Claims, Keys, Kind},
    names,
    v1beta1::MailgunCluster,
};
use capm_test_support::{process::free_port, provider::Launch};
use kube::api::{Patch, PatchParams};

use common::{bin, create_pair, http_get, namespace};

const KEY: &str = "cGFnZS1vbmx5LXRlc3Qta2V5LW9mLXRoaXJ0eS10d28tYnl0ZXMh";

fn loopback() -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, free_port().unwrap()))
}

#[tokio::test]
async fn the_page_only_mode_serves_the_page_without_mail_settings() {
    let ns = namespace("capm-cmd-page").await;
    let dir = tempfile::tempdir().unwrap();
    let keys_file = dir.path().join("keys");
    std::fs::write(&keys_file, format!("{KEY}\n")).unwrap();
    let (page, probes, metrics) = (loopback(), loopback(), loopback());
    let mut provider = Launch::new(bin(), ns.control_plane().kubeconfig())
        .env("CAPM_MODE", "fulfilment-page")
        .env("RUST_LOG", "info")
        .args([
            "--fulfilment-url",
            &format!("http://{page}"),
            "--fulfilment-keys-file",
            keys_file.to_str().unwrap(),
            "--fulfilment-bind-address",
            &page.to_string(),
            "--health-probe-bind-address",
            &probes.to_string(),
            "--diagnostics-address",
            &metrics.to_string(),
            "--insecure-diagnostics",
        ])
        .spawn(&dir.path().join("page.log"))
        .expect("start the page");

    // A MailgunCluster as the controller leaves it after its request mail (its sent record).
    let name = "page-only";
    let created = create_pair(&ns, name).await;
    let uid = created.metadata.uid.clone().unwrap();
    let message_id = format!("<mailguncluster.{uid}@mg.example.com>");
    let record = serde_json::json!({
        "messageId": message_id, "state": "sent", "backendId": "<x@mg.example.com>",
    });
    ns.api::<MailgunCluster>()
        .patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "metadata": { "annotations": { names::MAIL_ANNOTATION: record.to_string() } }
            })),
        )
        .await
        .unwrap();
    let expires = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let claims = Claims::new(
        Kind::MailgunCluster,
        &ns.name,
        name,
        &uid,
        &message_id,
        expires,
    );
    let token = Keys::parse(KEY).unwrap().seal(&claims).unwrap();

    let start = Instant::now();
    let (status, body) = loop {
        match http_get(page, &format!("/fulfil/{token}")) {
            Some(answer) => break answer,
            None => {
                assert!(
                    provider.running() && start.elapsed() < Duration::from_secs(30),
                    "the page never answered\n{}",
                    provider.tail(40)
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(status, 200, "{body}\n{}", provider.tail(40));
    assert!(body.contains("<form"), "{body}");
    assert!(body.contains(name), "{body}");

    let (status, _) = http_get(probes, "/healthz").unwrap();
    assert_eq!(status, 200);
    let ready = Instant::now();
    while http_get(probes, "/readyz").map(|(s, _)| s) != Some(200) {
        assert!(ready.elapsed() < Duration::from_secs(30), "never ready");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, text) = http_get(metrics, "/metrics").unwrap();
    assert_eq!(status, 200);
    assert!(
        text.contains("capm_fulfilment_requests_total{result=\"form\"} 1"),
        "{text}"
    );
    // Neither the controllers, the mail backend nor the election are there.
    for absent in [
        "leader_election_master_status",
        "mailer_messages_total",
        "controller_runtime_reconcile_total",
    ] {
        assert!(!text.contains(absent), "{absent} in\n{text}");
    }
    let log = provider.log();
    assert!(log.contains("Serving only the fulfilment page"), "{log}");
    assert!(!log.contains("Mail backend ready"), "{log}");
    assert!(!log.contains("Starting the controllers"), "{log}");

    provider.terminate().unwrap();
    let status = provider.wait_exit(Duration::from_secs(10)).await;
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(0),
        "{}",
        provider.tail(20)
    );
}

#[test]
fn the_page_only_mode_refuses_a_mail_key_in_its_environment() {
    let output = std::process::Command::new(bin())
        .env_clear()
        .env("MAILGUN_API_KEY", "key-must-not-be-here")
        .args([
            "--mode",
            "fulfilment-page",
            "--fulfilment-url",
            "https://capm.example.com",
            "--fulfilment-keys-file",
            "/keys",
        ])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("MAILGUN_API_KEY: is set with --mode (CAPM_MODE) fulfilment-page"),
        "{stderr}"
    );
    assert!(!stderr.contains("key-must-not-be-here"), "{stderr}");
}
