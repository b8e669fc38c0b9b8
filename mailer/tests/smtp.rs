//! The SMTP backend against a real SMTP server (aiosmtpd, see `tests/mail-servers`).
#![allow(
    clippy::unwrap_used,
    reason = "helpers of tests: a failure is a test failure"
)]

use std::{net::TcpListener, path::Path, sync::Arc};

use capm_mail_servers::{SmtpOptions, SmtpServer, SmtpTls};
use capm_mailer::{
    ErrorKind, Lookup, Mailer, Message, MessageError, SecretSource, SmtpConfig, SmtpMailer,
    Starttls,
};

fn message(id: &str) -> Message {
    Message::builder()
        .from("Dev Eloper <dev@example.com>")
        .to("ops@example.com")
        .to("audit@example.com")
        .subject("[Urgent] New Cluster demo requested")
        .text("Hello! One cluster please.\n\n.leading dot and\nthree nodes")
        .message_id(id)
        .tag("cluster-request")
        .tag("urgent")
        .variable("cluster", "default/demo \"quoted\"")
        .build()
        .unwrap()
}

fn config(server: &SmtpServer, starttls: Option<Starttls>) -> SmtpConfig {
    let mut c = SmtpConfig::new(server.url());
    c.starttls = starttls;
    c.ca_file = server.ca_cert().map(Path::to_path_buf);
    c.timeout_seconds = 10.0;
    c
}

fn start(tls: SmtpTls) -> SmtpServer {
    SmtpServer::start(SmtpOptions { tls, auth: None }).unwrap()
}

#[tokio::test]
async fn plain_delivery_keeps_headers_message_id_and_body() {
    let server = start(SmtpTls::None);
    let mailer = SmtpMailer::new(&config(&server, Some(Starttls::Never))).unwrap();
    let receipt = mailer.send(&message("<plain-1@capm.test>")).await.unwrap();
    assert_eq!(receipt.message_id, "<plain-1@capm.test>");
    assert!(receipt.response.starts_with("250"), "{}", receipt.response);

    let mails = server.messages().unwrap();
    assert_eq!(mails.len(), 1);
    let mail = &mails[0];
    assert!(!mail.tls);
    assert_eq!(mail.mail_from, "dev@example.com");
    assert_eq!(mail.rcpt_tos, vec!["ops@example.com", "audit@example.com"]);
    assert_eq!(mail.header("Message-ID"), Some("<plain-1@capm.test>"));
    assert_eq!(
        mail.header("Subject"),
        Some("[Urgent] New Cluster demo requested")
    );
    assert!(mail.header("From").unwrap().contains("<dev@example.com>"));
    assert_eq!(
        mail.headers_named("X-Mailgun-Tag"),
        vec!["cluster-request", "urgent"]
    );
    let vars: serde_json::Value =
        serde_json::from_str(mail.header("X-Mailgun-Variables").unwrap()).unwrap();
    assert_eq!(vars["cluster"], "default/demo \"quoted\"");
    assert_eq!(
        mail.body.replace("\r\n", "\n").trim_end(),
        "Hello! One cluster please.\n\n.leading dot and\nthree nodes"
    );
    let counts = mail.header_counts();
    for name in ["message-id", "subject", "from", "to", "date"] {
        assert_eq!(counts.get(name), Some(&1), "{name}: {counts:?}");
    }
    assert_eq!(counts.get("bcc"), None);
    assert_eq!(
        mailer.lookup(message("<x@y>").message_id()).await.unwrap(),
        Lookup::Unsupported
    );
}

#[tokio::test]
async fn starttls_required_encrypts() {
    let server = start(SmtpTls::StarttlsRequired);
    let mailer = SmtpMailer::new(&config(&server, Some(Starttls::Required))).unwrap();
    mailer
        .send(&message("<starttls-1@capm.test>"))
        .await
        .unwrap();
    let mails = server.messages().unwrap();
    assert_eq!(mails.len(), 1);
    assert!(mails[0].tls, "the session was not encrypted");
}

#[tokio::test]
async fn opportunistic_starttls_upgrades_when_offered() {
    let server = start(SmtpTls::Starttls);
    let mailer = SmtpMailer::new(&config(&server, Some(Starttls::Opportunistic))).unwrap();
    mailer.send(&message("<opp-1@capm.test>")).await.unwrap();
    assert!(server.messages().unwrap()[0].tls);
}

#[tokio::test]
async fn implicit_tls_encrypts() {
    let server = start(SmtpTls::Implicit);
    assert!(server.url().starts_with("smtps://"));
    let mailer = SmtpMailer::new(&config(&server, None)).unwrap();
    mailer.send(&message("<smtps-1@capm.test>")).await.unwrap();
    let mails = server.messages().unwrap();
    assert!(mails[0].tls);
    assert_eq!(mails[0].header("Message-ID"), Some("<smtps-1@capm.test>"));
}

#[tokio::test]
async fn required_starttls_not_offered_is_retryable_and_sends_nothing() {
    let server = start(SmtpTls::None);
    let mut c = config(&server, Some(Starttls::Required));
    // A CA is needed to build TLS parameters; any will do, the server never offers TLS.
    let other = start(SmtpTls::Implicit);
    c.ca_file = other.ca_cert().map(Path::to_path_buf);
    let mailer = SmtpMailer::new(&c).unwrap();
    let err = mailer
        .send(&message("<nostarttls@capm.test>"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Retryable, "{err}");
    assert!(server.messages().unwrap().is_empty());
}

#[tokio::test]
async fn an_untrusted_certificate_is_refused() {
    let server = start(SmtpTls::Implicit);
    let other = start(SmtpTls::Implicit);
    let mut c = config(&server, None);
    c.ca_file = other.ca_cert().map(Path::to_path_buf);
    let mailer = SmtpMailer::new(&c).unwrap();
    let err = mailer
        .send(&message("<untrusted@capm.test>"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Retryable, "{err}");
    assert!(server.messages().unwrap().is_empty());
}

fn auth_server() -> SmtpServer {
    SmtpServer::start(SmtpOptions {
        tls: SmtpTls::StarttlsRequired,
        auth: Some(("capm".into(), "s3cret-pw".into())),
    })
    .unwrap()
}

fn auth_config(server: &SmtpServer, password: &str, dir: &Path) -> SmtpConfig {
    let file = dir.join("password");
    std::fs::write(&file, format!("{password}\n")).unwrap();
    let mut c = config(server, Some(Starttls::Required));
    c.username = Some("capm".into());
    c.password = Some(SecretSource::File(file));
    c
}

#[tokio::test]
async fn auth_with_the_right_password_succeeds() {
    let server = auth_server();
    let dir = tempfile::tempdir().unwrap();
    let mailer = SmtpMailer::new(&auth_config(&server, "s3cret-pw", dir.path())).unwrap();
    mailer.send(&message("<auth-1@capm.test>")).await.unwrap();
    let mails = server.messages().unwrap();
    assert_eq!(mails[0].auth_user.as_deref(), Some("capm"));
    assert!(mails[0].tls);
}

#[tokio::test]
async fn auth_with_a_wrong_password_is_permanent_and_does_not_leak_it() {
    let server = auth_server();
    let dir = tempfile::tempdir().unwrap();
    let mailer = SmtpMailer::new(&auth_config(&server, "wrong-pw-123", dir.path())).unwrap();
    let err = mailer
        .send(&message("<auth-2@capm.test>"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Permanent, "{err}");
    assert_eq!(err.code(), Some(535));
    assert!(!format!("{err} {err:?} {mailer:?}").contains("wrong-pw-123"));
    assert!(server.messages().unwrap().is_empty());
}

#[tokio::test]
async fn without_credentials_an_auth_server_refuses() {
    let server = auth_server();
    let mailer = SmtpMailer::new(&config(&server, Some(Starttls::Required))).unwrap();
    let err = mailer
        .send(&message("<auth-3@capm.test>"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Permanent, "{err}");
    assert_eq!(err.code(), Some(530));
}

#[tokio::test]
async fn a_4xx_reply_is_retryable_and_the_retry_goes_through() {
    let mut server = start(SmtpTls::None);
    let mailer = SmtpMailer::new(&config(&server, Some(Starttls::Never))).unwrap();
    server.fail_next(451, 1).unwrap();
    let m = message("<tempfail@capm.test>");
    let err = mailer.send(&m).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Retryable, "{err}");
    assert_eq!(err.code(), Some(451));
    assert!(server.messages().unwrap().is_empty());
    mailer.send(&m).await.unwrap();
    assert_eq!(server.messages().unwrap().len(), 1);
}

#[tokio::test]
async fn a_5xx_reply_is_permanent() {
    let mut server = start(SmtpTls::None);
    let mailer = SmtpMailer::new(&config(&server, Some(Starttls::Never))).unwrap();
    server.fail_next(550, 1).unwrap();
    let err = mailer
        .send(&message("<permfail@capm.test>"))
        .await
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Permanent, "{err}");
    assert_eq!(err.code(), Some(550));
    assert_eq!(err.metric_label(), "permanent");
}

#[tokio::test]
async fn a_server_that_is_down_is_retryable() {
    let port = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut c = SmtpConfig::new(format!("smtp://127.0.0.1:{port}"));
    c.starttls = Some(Starttls::Never);
    let mailer = SmtpMailer::new(&c).unwrap();
    let err = mailer.send(&message("<down@capm.test>")).await.unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Retryable, "{err}");
    assert_eq!(err.code(), None);
}

#[tokio::test]
async fn header_injection_never_reaches_the_wire() {
    let server = start(SmtpTls::None);
    let mailer = SmtpMailer::new(&config(&server, Some(Starttls::Never))).unwrap();
    let attempts = [
        Message::builder()
            .from("dev@example.com")
            .to("ops@example.com")
            .subject("hello\r\nBcc: evil@example.com")
            .text("x")
            .message_id("<inj-1@capm.test>")
            .build(),
        Message::builder()
            .from("dev@example.com")
            .to("ops@example.com\r\nBcc: evil@example.com")
            .text("x")
            .message_id("<inj-2@capm.test>")
            .build(),
        Message::builder()
            .from("dev@example.com")
            .to("ops@example.com")
            .text("x")
            .message_id("<inj-3@capm.test>\r\nBcc: evil@example.com")
            .build(),
    ];
    for attempt in attempts {
        let err = attempt.unwrap_err();
        assert!(
            matches!(err, MessageError::ControlCharacter { .. }),
            "{err}"
        );
    }
    // Unicode and header-like text inside a single line stay inside that header.
    let m = Message::builder()
        .from("dev@example.com")
        .to("ops@example.com")
        .subject("Grüße: Bcc: evil@example.com")
        .text("Bcc: evil@example.com\r\n\r\nstill body")
        .message_id("<inj-4@capm.test>")
        .variable("note", "Bcc: evil@example.com ✓")
        .build()
        .unwrap();
    mailer.send(&m).await.unwrap();
    let mails = server.messages().unwrap();
    assert_eq!(mails.len(), 1);
    assert_eq!(
        mails[0].header_counts().get("bcc"),
        None,
        "{}",
        mails[0].raw
    );
    assert_eq!(mails[0].rcpt_tos, vec!["ops@example.com"]);
}

#[tokio::test]
async fn pooled_and_unpooled_transports_both_deliver() {
    let server = start(SmtpTls::None);
    for pooled in [true, false] {
        let mut c = config(&server, Some(Starttls::Never));
        c.pool.enabled = pooled;
        let mailer = Arc::new(SmtpMailer::new(&c).unwrap());
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..8 {
            let mailer = Arc::clone(&mailer);
            tasks.spawn(async move {
                mailer
                    .send(&message(&format!("<pool-{pooled}-{i}@capm.test>")))
                    .await
            });
        }
        while let Some(result) = tasks.join_next().await {
            result.unwrap().unwrap();
        }
    }
    assert_eq!(server.messages().unwrap().len(), 16);
}
