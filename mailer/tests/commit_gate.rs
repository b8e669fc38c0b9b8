//! The commit gate (issue 28): asked once per send, right before the commit point, and a refusal
//! leaves the backend with nothing whole: the Mailgun contract server stores nothing, the SMTP
//! server (aiosmtpd, plain and STARTTLS) delivers nothing.
#![allow(
    clippy::unwrap_used,
    reason = "helpers of tests: a failure is a test failure"
)]

use std::{
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use capm_mail_servers::{MailgunServer, SmtpOptions, SmtpServer, SmtpTls};
use capm_mailer::{
    CommitGate, ErrorKind, MailError, Mailer, MailgunConfig, MailgunMailer, Message, SecretSource,
    SmtpConfig, SmtpMailer, Starttls,
};

/// Opens or refuses on command, counting the questions.
#[derive(Default)]
struct Switch {
    refuse: AtomicBool,
    asked: AtomicUsize,
}

impl CommitGate for Switch {
    fn may_commit(&self) -> Result<(), String> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        if self.refuse.load(Ordering::SeqCst) {
            Err("this test says no".into())
        } else {
            Ok(())
        }
    }
}

fn message(id: &str) -> Message {
    Message::builder()
        .from("capm@mg.capm.test")
        .to("ops@example.com")
        .subject("One cluster please")
        .text(format!(
            "{}\n.\nthe line above is a lone dot",
            "x".repeat(100_000)
        ))
        .message_id(id)
        .build()
        .unwrap()
}

fn assert_abandoned(err: &MailError) {
    assert_eq!(err.kind(), ErrorKind::Abandoned, "{err}");
    assert!(err.to_string().contains("this test says no"), "{err}");
}

#[tokio::test]
async fn mailgun_refused_at_the_final_chunk_stores_nothing() {
    let server = MailgunServer::start("key-gate", "mg.capm.test").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, "key-gate").unwrap();
    let mut config = MailgunConfig::new("mg.capm.test", SecretSource::File(key));
    config.base_url = Some(server.base_url());
    let gate = Arc::new(Switch::default());
    let mailer = MailgunMailer::new(&config)
        .unwrap()
        .with_commit_gate(gate.clone());

    gate.refuse.store(true, Ordering::SeqCst);
    let err = mailer
        .send(&message("<gate-1@capm.test>"))
        .await
        .unwrap_err();
    assert_abandoned(&err);
    assert_eq!(gate.asked.load(Ordering::SeqCst), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        server.messages().unwrap().is_empty(),
        "an incomplete request is never accepted"
    );

    // The same mailer sends once the gate opens: the abandoned connection is not reused.
    gate.refuse.store(false, Ordering::SeqCst);
    mailer.send(&message("<gate-2@capm.test>")).await.unwrap();
    assert_eq!(gate.asked.load(Ordering::SeqCst), 2);
    let stored = server.messages().unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].id, "<gate-2@capm.test>");
    assert!(
        stored[0]
            .text
            .as_deref()
            .unwrap()
            .ends_with("\n.\nthe line above is a lone dot")
    );
}

async fn smtp_refused_before_the_end_of_data(tls: SmtpTls, starttls: Option<Starttls>) {
    let server = SmtpServer::start(SmtpOptions { tls, auth: None }).unwrap();
    let mut config = SmtpConfig::new(server.url());
    config.starttls = starttls;
    config.ca_file = server.ca_cert().map(Path::to_path_buf);
    let gate = Arc::new(Switch::default());
    let mailer = SmtpMailer::new(&config)
        .unwrap()
        .with_commit_gate(gate.clone());

    gate.refuse.store(true, Ordering::SeqCst);
    let err = mailer
        .send(&message("<gate-3@capm.test>"))
        .await
        .unwrap_err();
    assert_abandoned(&err);
    assert_eq!(gate.asked.load(Ordering::SeqCst), 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        server.messages().unwrap().is_empty(),
        "no message without CRLF.CRLF"
    );

    gate.refuse.store(false, Ordering::SeqCst);
    mailer.send(&message("<gate-4@capm.test>")).await.unwrap();
    let mails = server.messages().unwrap();
    assert_eq!(mails.len(), 1);
    assert_eq!(mails[0].header("Message-ID"), Some("<gate-4@capm.test>"));
    assert_eq!(mails[0].tls, tls != SmtpTls::None);
}

#[tokio::test]
async fn smtp_plain_refused_before_the_end_of_data_delivers_nothing() {
    smtp_refused_before_the_end_of_data(SmtpTls::None, Some(Starttls::Never)).await;
}

#[tokio::test]
async fn smtp_starttls_refused_before_the_end_of_data_delivers_nothing() {
    smtp_refused_before_the_end_of_data(SmtpTls::Starttls, Some(Starttls::Required)).await;
}

#[tokio::test]
async fn smtp_implicit_tls_refused_before_the_end_of_data_delivers_nothing() {
    smtp_refused_before_the_end_of_data(SmtpTls::Implicit, None).await;
}
