//! The hostile SMTP relay's modes as a client sees them on the wire, read with bounds: endless
//! greetings and replies stream (hundreds of MiB) while the relay's memory stays small,
//! control text in replies, a dripped greeting, a reply cut by a reset; and `Pass` delivers a
//! whole dialogue to the real server behind it, before and after it misbehaved.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    io::{BufRead, BufReader, ErrorKind, Read, Write},
    net::{SocketAddr, TcpStream},
    time::{Duration, Instant},
};

use capm_mail_servers::{HostileSmtpRelay, RelayMode, SMTP_CONTROL_TEXT, SmtpOptions, SmtpServer};

const MIB: u64 = 1 << 20;
/// The relay's resident memory must stay under this while it streams far more.
const SMALL_RSS: u64 = 64 * MIB;

/// Every control [`SMTP_CONTROL_TEXT`] must carry (UTF-8 encoded on the wire).
const CONTROLS: [&str; 11] = [
    "\u{1b}[31m",
    "\u{7}",
    "\u{7f}",
    "\u{9b}",
    "\u{2028}",
    "\u{2029}",
    "\u{202e}",
    "\u{2066}",
    "\u{2067}",
    "\u{2068}",
    "\u{2069}",
];

/// Where nothing listens: the upstream of relays that never pass.
fn nowhere() -> SocketAddr {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap()
}

/// The resident memory of process `pid`, from `/proc/<pid>/status`.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

/// A raw SMTP client reading bounded lines.
struct Client {
    reader: BufReader<TcpStream>,
    writer: TcpStream,
}

impl Client {
    fn connect(relay: &HostileSmtpRelay) -> Self {
        let stream = TcpStream::connect(relay.addr()).unwrap();
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        Self {
            reader: BufReader::new(stream.try_clone().unwrap()),
            writer: stream,
        }
    }

    /// One line of at most 8 KiB, as bytes.
    fn line(&mut self) -> std::io::Result<Vec<u8>> {
        let mut line = Vec::new();
        self.reader
            .by_ref()
            .take(8192)
            .read_until(b'\n', &mut line)?;
        Ok(line)
    }

    /// A whole (multi-line) reply, at most 20 lines.
    fn reply(&mut self) -> String {
        let mut text = Vec::new();
        for _ in 0..20 {
            let line = self.line().unwrap();
            assert!(line.ends_with(b"\r\n"), "an unfinished line: {line:?}");
            text.extend_from_slice(&line);
            if line.get(3) != Some(&b'-') {
                return String::from_utf8(text).unwrap();
            }
        }
        panic!("more than 20 reply lines");
    }

    fn send(&mut self, line: &str) {
        write!(self.writer, "{line}\r\n").unwrap();
    }

    fn command(&mut self, line: &str) -> String {
        self.send(line);
        self.reply()
    }

    /// Reads `total` bytes in pieces, checking each with `check`, sampling the relay's memory
    /// every 8 MiB; returns the most it saw.
    fn stream(&mut self, relay: &HostileSmtpRelay, total: u64, check: impl Fn(&[u8])) -> u64 {
        let mut buf = vec![0u8; 256 * 1024];
        let (mut read, mut next_sample, mut peak) = (0u64, 0u64, 0u64);
        while read < total {
            let want = buf.len().min((total - read) as usize);
            let n = self.reader.read(&mut buf[..want]).unwrap();
            assert!(n > 0, "the relay ended after {read} bytes");
            check(&buf[..n]);
            read += n as u64;
            if read >= next_sample {
                peak = peak.max(rss(relay.pid()));
                next_sample += 8 * MIB;
            }
        }
        peak
    }
}

/// A full dialogue up to the reply to the final dot.
fn deliver(client: &mut Client, subject: &str) -> String {
    assert!(client.reply().starts_with("220 "));
    assert!(client.command("EHLO client.test").starts_with("250"));
    assert!(client.command("MAIL FROM:<a@b.test>").starts_with("250"));
    assert!(client.command("RCPT TO:<c@d.test>").starts_with("250"));
    assert!(client.command("DATA").starts_with("354"));
    write!(
        client.writer,
        "Message-Id: <{subject}@b.test>\r\nSubject: {subject}\r\n\r\nbody\r\n.\r\n"
    )
    .unwrap();
    client.reply()
}

fn assert_controls(reply: &str) {
    for control in CONTROLS {
        assert!(reply.contains(control), "{control:?} in {reply:?}");
    }
    assert!(!reply.contains('\0'));
    assert_eq!(reply.matches("\r\n").count(), 1, "one line: {reply:?}");
}

#[test]
fn pass_delivers_and_comes_back_after_misbehaving() {
    let server = SmtpServer::start(SmtpOptions::default()).unwrap();
    let relay = HostileSmtpRelay::start(server.addr()).unwrap();
    assert_eq!(relay.url(), format!("smtp://{}", relay.addr()));
    assert_eq!(relay.upstream(), server.addr());

    let mut client = Client::connect(&relay);
    assert!(deliver(&mut client, "first").starts_with("250"));
    assert!(client.command("QUIT").starts_with("221"));
    let stored = server.messages().unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!(stored[0].header("Subject"), Some("first"));
    assert_eq!(stored[0].rcpt_tos, ["c@d.test"]);

    // A passing connection is closed when the relay turns hostile, and new ones get the mode.
    let mut passing = Client::connect(&relay);
    assert!(passing.reply().starts_with("220 "));
    relay.set_mode(RelayMode::EndlessGreeting).unwrap();
    let closed = passing.line();
    assert!(
        matches!(&closed, Ok(l) if l.is_empty()) || closed.is_err(),
        "{closed:?}"
    );
    let mut hostile = Client::connect(&relay);
    let mut start = [0u8; 4];
    hostile.reader.read_exact(&mut start).unwrap();
    assert_eq!(&start, b"220 ");
    drop(hostile);

    relay.set_mode(RelayMode::Pass).unwrap();
    let mut client = Client::connect(&relay);
    assert!(deliver(&mut client, "second").starts_with("250"));
    let stored = server.messages().unwrap();
    assert_eq!(stored.len(), 2);
    assert_eq!(stored[1].header("Subject"), Some("second"));

    let stats = relay.stats().unwrap();
    assert_eq!(stats.connections, 4);
    assert_eq!(stats.passed, 3);
    assert_eq!(stats.hostile, 1);
}

#[test]
fn endless_greeting_streams_256_mib_with_a_small_relay() {
    let relay = HostileSmtpRelay::start(nowhere()).unwrap();
    relay.set_mode(RelayMode::EndlessGreeting).unwrap();
    let mut client = Client::connect(&relay);
    let mut start = [0u8; 4];
    client.reader.read_exact(&mut start).unwrap();
    assert_eq!(&start, b"220 ");
    let peak = client.stream(&relay, 256 * MIB, |bytes| {
        assert!(
            !bytes.contains(&b'\n') && !bytes.contains(&b'\r'),
            "never a line end"
        );
    });
    eprintln!("relay RSS at most {} KiB", peak / 1024);
    assert!(peak > 0 && peak < SMALL_RSS, "relay RSS {peak} bytes");
    assert!(relay.stats().unwrap().hostile_bytes >= 256 * MIB);
}

#[test]
fn endless_multiline_greeting_never_has_a_last_line() {
    let relay = HostileSmtpRelay::start(nowhere()).unwrap();
    relay.set_mode(RelayMode::EndlessMultilineGreeting).unwrap();
    let mut client = Client::connect(&relay);
    for _ in 0..100_000 {
        let line = client.line().unwrap();
        assert!(line.starts_with(b"220-"), "{line:?}");
        assert!(line.ends_with(b"\r\n"), "{line:?}");
    }
}

#[test]
fn control_text_on_rcpt() {
    let server = SmtpServer::start(SmtpOptions::default()).unwrap();
    let relay = HostileSmtpRelay::start(server.addr()).unwrap();
    relay.set_mode(RelayMode::ControlTextOnRcpt).unwrap();
    let mut client = Client::connect(&relay);
    assert_eq!(client.reply(), "220 hostile ESMTP\r\n");
    assert_eq!(
        client.command("EHLO client.test"),
        "250-hostile\r\n250 8BITMIME\r\n"
    );
    assert_eq!(
        client.command("STARTTLS"),
        "502 5.5.2 command not implemented\r\n"
    );
    assert_eq!(client.command("MAIL FROM:<a@b.test>"), "250 2.1.0 OK\r\n");
    let refused = client.command("RCPT TO:<c@d.test>");
    assert!(refused.starts_with("550 5.1.1 "), "{refused:?}");
    assert!(refused.ends_with(" mailbox unavailable\r\n"), "{refused:?}");
    assert_eq!(
        refused,
        format!("550 5.1.1 {SMTP_CONTROL_TEXT} mailbox unavailable\r\n")
    );
    assert_controls(&refused);
    assert!(client.command("DATA").starts_with("554 "));
    assert_eq!(client.command("RSET"), "250 2.0.0 OK\r\n");
    assert_eq!(client.command("NOOP"), "250 2.0.0 OK\r\n");
    assert_eq!(client.command("QUIT"), "221 2.0.0 bye\r\n");
    assert!(server.messages().unwrap().is_empty());
}

#[test]
fn control_text_greeting_and_data_refusal() {
    let relay = HostileSmtpRelay::start(nowhere()).unwrap();
    relay.set_mode(RelayMode::ControlTextGreeting).unwrap();
    let mut client = Client::connect(&relay);
    let greeting = client.reply();
    assert_eq!(greeting, format!("220 {SMTP_CONTROL_TEXT}\r\n"));
    assert_controls(&greeting);
    assert!(
        client
            .command("EHLO client.test")
            .starts_with("250-hostile")
    );
    assert_eq!(client.command("MAIL FROM:<a@b.test>"), "250 2.1.0 OK\r\n");
    assert_eq!(client.command("RCPT TO:<c@d.test>"), "250 2.1.5 OK\r\n");
    let refused = client.command("DATA");
    assert_eq!(refused, format!("554 5.7.1 {SMTP_CONTROL_TEXT}\r\n"));
    assert_controls(&refused);
}

#[test]
fn drip_greets_a_byte_at_a_time() {
    let relay = HostileSmtpRelay::start(nowhere()).unwrap();
    relay.set_mode(RelayMode::Drip).unwrap();
    let started = Instant::now();
    let mut client = Client::connect(&relay);
    let mut two = [0u8; 2];
    client.reader.read_exact(&mut two).unwrap();
    assert_eq!(&two, b"22");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1900),
        "a byte a second: {took:?}"
    );
    drop(client);

    relay.set_drip(Duration::from_millis(40)).unwrap();
    let started = Instant::now();
    let mut client = Client::connect(&relay);
    assert_eq!(client.reply(), "220 hostile ESMTP\r\n");
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(19 * 40 * 9 / 10), "{took:?}");
    assert!(client.command("EHLO client.test").starts_with("250"));
    assert!(client.command("MAIL FROM:<a@b.test>").starts_with("250"));
    assert!(client.command("RCPT TO:<c@d.test>").starts_with("250"));
    assert_eq!(client.command("DATA"), "451 4.3.0 try later\r\n");
}

#[test]
fn reset_mid_reply_cuts_the_mail_reply() {
    let relay = HostileSmtpRelay::start(nowhere()).unwrap();
    relay.set_mode(RelayMode::ResetMidReply).unwrap();
    let mut client = Client::connect(&relay);
    assert_eq!(client.reply(), "220 hostile ESMTP\r\n");
    assert!(client.command("EHLO client.test").starts_with("250"));
    client.send("MAIL FROM:<a@b.test>");
    let mut start = [0u8; 2];
    client.reader.read_exact(&mut start).unwrap();
    assert_eq!(&start, b"25");
    let mut rest = [0u8; 16];
    let error = client.reader.read(&mut rest).unwrap_err();
    assert_eq!(error.kind(), ErrorKind::ConnectionReset, "{error}");
}

#[test]
fn endless_reply_after_data_stores_nothing() {
    let server = SmtpServer::start(SmtpOptions::default()).unwrap();
    let relay = HostileSmtpRelay::start(server.addr()).unwrap();
    relay.set_mode(RelayMode::EndlessReplyAfterData).unwrap();
    let mut client = Client::connect(&relay);
    assert!(client.reply().starts_with("220 hostile"));
    assert!(client.command("EHLO client.test").starts_with("250"));
    assert!(client.command("MAIL FROM:<a@b.test>").starts_with("250"));
    assert!(client.command("RCPT TO:<c@d.test>").starts_with("250"));
    assert_eq!(client.command("DATA"), "354 go ahead\r\n");
    // A line that starts with a dot (stuffed) and one whose end is cut right before its final
    // ".\r\n" by the relay's 64 KiB reads are not the end.
    let long = "y".repeat(64 * 1024);
    write!(
        client.writer,
        "Subject: endless\r\n\r\n..not the end\r\n{long}.\r\n"
    )
    .unwrap();
    client
        .writer
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let early = client.reader.read(&mut [0u8; 1]).unwrap_err();
    assert!(
        matches!(early.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut),
        "{early}"
    );
    client
        .writer
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    client.send(".");
    let mut start = [0u8; 4];
    client.reader.read_exact(&mut start).unwrap();
    assert_eq!(&start, b"250 ");
    let peak = client.stream(&relay, 64 * MIB, |bytes| {
        assert!(
            bytes.iter().all(|b| *b == b'z'),
            "filler without a line end"
        );
    });
    assert!(peak > 0 && peak < SMALL_RSS, "relay RSS {peak} bytes");
    assert!(server.messages().unwrap().is_empty());
}
