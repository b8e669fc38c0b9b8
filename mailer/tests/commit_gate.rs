//! The commit gate (issue 28): asked once per send, right before the commit point, and a refusal
//! leaves the backend with nothing whole: the Mailgun contract server stores nothing, the SMTP
//! server (aiosmtpd, plain and STARTTLS) delivers nothing. Against a raw TCP server: when the
//! Mailgun backend asks, all of the request but its final chunk is on the wire.
#![allow(
    clippy::unwrap_used,
    reason = "helpers of tests: a failure is a test failure"
)]

use std::{
    path::Path,
    sync::{
        Arc, Condvar, Mutex,
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

/// What a raw TCP server has received so far, with a signal each time more arrives.
#[derive(Default)]
struct Wire {
    received: Mutex<Vec<u8>>,
    more: Condvar,
}

/// Where a received request's final chunk, the closing delimiter `--<boundary>--\r\n`, starts
/// and where the request ends, once its headers are in.
fn request_bounds(request: &[u8]) -> Option<(usize, usize)> {
    let head_end = request.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    let head = std::str::from_utf8(&request[..head_end]).ok()?;
    let header = |name: &str| {
        head.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim()
                .eq_ignore_ascii_case(name)
                .then(|| value.trim().to_owned())
        })
    };
    let length: usize = header("content-length")?.parse().ok()?;
    let content_type = header("content-type")?;
    let (_, boundary) = content_type.split_once("boundary=")?;
    let end = head_end + length;
    Some((end - format!("--{boundary}--\r\n").len(), end))
}

/// A gate that, when asked, waits (5 s at most) for all of the request before its final chunk to
/// arrive at the server, then records what had arrived, and opens.
struct Recorder {
    wire: Arc<Wire>,
    at_question: Mutex<Option<Vec<u8>>>,
}

impl CommitGate for Recorder {
    fn may_commit(&self) -> Result<(), String> {
        let received = self.wire.received.lock().unwrap();
        let (received, _) = self
            .wire
            .more
            .wait_timeout_while(received, Duration::from_secs(5), |r| {
                request_bounds(r).is_none_or(|(tail, _)| r.len() < tail)
            })
            .unwrap();
        *self.at_question.lock().unwrap() = Some(received.clone());
        Ok(())
    }
}

/// A raw HTTP/1.1 server on its own thread and runtime (so a gate that waits does not stop it):
/// it keeps every byte of one request and answers 200 once the request is whole.
fn raw_server(wire: Arc<Wire>) -> std::net::SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let address = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buffer = [0u8; 4096];
            loop {
                let read = socket.read(&mut buffer).await.unwrap();
                if read == 0 {
                    return;
                }
                let whole = {
                    let mut received = wire.received.lock().unwrap();
                    received.extend_from_slice(&buffer[..read]);
                    wire.more.notify_all();
                    request_bounds(&received).is_some_and(|(_, end)| received.len() >= end)
                };
                if whole {
                    let body = r#"{"id": "<flush-1@capm.test>", "message": "Queued. Thank you."}"#;
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    socket.write_all(reply.as_bytes()).await.unwrap();
                    return;
                }
            }
        });
    });
    address
}

/// The commit gate's flush assumption, pinned: `GatedBody` yields the body before its final
/// chunk, then is pending once so that hyper writes it out, and only then asks the gate. When the
/// gate is asked, the server has everything before the final chunk and nothing of it; the final
/// chunk arrives once the gate opens. A hyper that held the body back until its end (or wrote
/// ahead) fails here.
#[tokio::test]
async fn mailgun_asks_the_gate_with_all_but_the_final_chunk_on_the_wire() {
    let wire = Arc::new(Wire::default());
    let address = raw_server(Arc::clone(&wire));
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("key");
    std::fs::write(&key, "key-flush").unwrap();
    let mut config = MailgunConfig::new("mg.capm.test", SecretSource::File(key));
    config.base_url = Some(format!("http://{address}"));
    let gate = Arc::new(Recorder {
        wire: Arc::clone(&wire),
        at_question: Mutex::new(None),
    });
    let mailer = MailgunMailer::new(&config)
        .unwrap()
        .with_commit_gate(gate.clone());
    let message = Message::builder()
        .from("capm@mg.capm.test")
        .to("ops@example.com")
        .subject("One cluster please")
        .text("x".repeat(8 * 1024))
        .message_id("<flush-1@capm.test>")
        .build()
        .unwrap();

    let receipt = mailer.send(&message).await.unwrap();
    assert_eq!(receipt.message_id, "<flush-1@capm.test>");

    let at_question = gate.at_question.lock().unwrap().clone();
    let at_question = at_question.expect("the gate was asked");
    let (tail, end) = request_bounds(&at_question).expect("the request's headers had arrived");
    assert!(
        at_question.len() >= tail,
        "only {} of the {tail} bytes before the final chunk had arrived when the gate was asked",
        at_question.len()
    );
    assert_eq!(
        at_question.len(),
        tail,
        "part of the final chunk had arrived before the gate was asked"
    );
    let received = wire.received.lock().unwrap().clone();
    assert_eq!(
        received.len(),
        end,
        "the final chunk arrived after the gate opened"
    );
    assert_eq!(received[..tail], at_question[..]);
    assert!(received.ends_with(b"--\r\n"));
}
