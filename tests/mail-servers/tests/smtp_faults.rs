//! The SMTP server's fault modes as a client sees them on the wire: refusing stores nothing,
//! hanging stores and never answers, a connection that is never greeted stores nothing, a slow
//! answer still arrives and stores.
#![allow(clippy::unwrap_used)]

use std::{
    io::{BufRead, BufReader, ErrorKind, Write},
    net::TcpStream,
    time::Duration,
};

use capm_mail_servers::{SmtpOptions, SmtpServer};

/// One SMTP session up to the reply to the message's final dot; `None` when no reply came
/// within `wait`.
fn send(server: &SmtpServer, wait: Duration) -> Option<String> {
    let stream = TcpStream::connect(server.addr()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut reader = BufReader::new(stream.try_clone().unwrap());
    let mut writer = stream;
    let mut reply = || {
        let mut text = String::new();
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            text.push_str(&line);
            if line.len() < 4 || line.as_bytes()[3] != b'-' {
                return text;
            }
        }
    };
    assert!(reply().starts_with("220"));
    for command in [
        "EHLO client.test",
        "MAIL FROM:<a@b.test>",
        "RCPT TO:<c@d.test>",
        "DATA",
    ] {
        writeln!(writer, "{command}\r").unwrap();
        reply();
    }
    write!(
        writer,
        "Message-Id: <x@b.test>\r\nSubject: s\r\n\r\nbody\r\n.\r\n"
    )
    .unwrap();
    writer.set_read_timeout(Some(wait)).unwrap();
    let mut line = String::new();
    match reader.read_line(&mut line) {
        Ok(_) => Some(line),
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => None,
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn refuse_hang_slow_and_no_greeting() {
    let mut server = SmtpServer::start(SmtpOptions::default()).unwrap();
    let wait = Duration::from_secs(10);

    server.fail_next(451, 1).unwrap();
    assert!(send(&server, wait).unwrap().starts_with("451"));
    assert_eq!(
        server.messages().unwrap().len(),
        0,
        "refused: nothing stored"
    );

    server.hang_after_data(1).unwrap();
    assert_eq!(send(&server, Duration::from_millis(500)), None, "no answer");
    assert_eq!(server.messages().unwrap().len(), 1, "stored all the same");

    server.slow_data(Duration::from_secs(3), 1).unwrap();
    assert_eq!(
        send(&server, Duration::from_millis(200)),
        None,
        "not answered at once"
    );
    server.slow_data(Duration::from_millis(300), 1).unwrap();
    assert!(send(&server, wait).unwrap().starts_with("250"));

    server.no_greeting(1).unwrap();
    let silent = TcpStream::connect(server.addr()).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut line = String::new();
    let greeted = BufReader::new(silent).read_line(&mut line);
    assert!(greeted.is_err() || line.is_empty(), "greeted: {line:?}");

    server.reset().unwrap();
    assert!(send(&server, wait).unwrap().starts_with("250"));
}
