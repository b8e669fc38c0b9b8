//! The contract server's hostile modes as a client sees them on the wire, read with bounds: a
//! huge or endless body really streams (tens of MiB) while the server's own memory stays
//! small, control text carries every control, a body that is not JSON, a drip, a reply cut by
//! a reset; what each stores; and the normal contract once the rule is used up or cleared. The
//! Logs endpoint (`POST /v1/analytics/logs`) on the wire: the request and reply shapes it
//! accepts and gives, its tokens, its failures and its hostile pages.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    io::{BufRead, BufReader, ErrorKind, Read, Write},
    net::TcpStream,
    time::{Duration, Instant},
};

use base64::Engine as _;
use capm_mail_servers::{
    CONTROL_TEXT, FailureMode, FailureRule, FailureTarget, HOSTILE_BODY_BYTES, MailgunServer,
};

const KEY: &str = "key-hostile";
const DOMAIN: &str = "mg.example.test";
const MIB: u64 = 1 << 20;
/// The server's resident memory must stay under this while it streams more than this.
const SMALL_RSS: u64 = 64 * MIB;

/// Every control [`CONTROL_TEXT`] must carry.
const CONTROLS: [&str; 12] = [
    "\u{1b}[31m",
    "\u{7}",
    "\u{0}",
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

fn start() -> MailgunServer {
    MailgunServer::start(KEY, DOMAIN).unwrap()
}

fn rule(mode: FailureMode, target: FailureTarget) -> FailureRule {
    FailureRule {
        count: Some(1),
        target,
        ..FailureRule::new(mode)
    }
}

/// The resident memory of process `pid`, from `/proc/<pid>/status`.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

fn connect(server: &MailgunServer) -> TcpStream {
    let stream = TcpStream::connect(server.addr()).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    stream
}

fn auth() -> String {
    let key = base64::engine::general_purpose::STANDARD.encode(format!("api:{KEY}"));
    format!("Basic {key}")
}

/// Posts a message with Message-Id `<{id}>` to `ops@example.com`; the reply is to be read.
fn post(server: &MailgunServer, id: &str) -> BufReader<TcpStream> {
    let boundary = "hostile-boundary";
    let mut body = String::new();
    for (name, value) in [
        ("from", "capm@mg.example.test"),
        ("to", "ops@example.com"),
        ("subject", "hostile"),
        ("text", "body"),
        ("h:Message-Id", &format!("<{id}>")),
    ] {
        body.push_str(&format!(
            "--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"\r\n\r\n{value}\r\n"
        ));
    }
    body.push_str(&format!("--{boundary}--\r\n"));
    let mut stream = connect(server);
    write!(
        stream,
        "POST /v3/{DOMAIN}/messages HTTP/1.1\r\nHost: {}\r\nAuthorization: {}\r\n\
         Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: {}\r\n\
         Connection: close\r\n\r\n{body}",
        server.addr(),
        auth(),
        body.len()
    )
    .unwrap();
    BufReader::new(stream)
}

/// Asks the events of message `<{id}>`; the reply is to be read.
fn events(server: &MailgunServer, id: &str) -> BufReader<TcpStream> {
    let query: String = format!("<{id}>")
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'.' | b'-' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect();
    let mut stream = connect(server);
    write!(
        stream,
        "GET /v3/{DOMAIN}/events?message-id={query} HTTP/1.1\r\nHost: {}\r\n\
         Authorization: {}\r\nConnection: close\r\n\r\n",
        server.addr(),
        auth()
    )
    .unwrap();
    BufReader::new(stream)
}

/// Posts `body` to the Logs API, with the key unless `anonymous`; the reply is to be read.
fn logs(server: &MailgunServer, body: &serde_json::Value, anonymous: bool) -> BufReader<TcpStream> {
    let body = body.to_string();
    let auth = if anonymous {
        String::new()
    } else {
        format!("Authorization: {}\r\n", auth())
    };
    let mut stream = connect(server);
    write!(
        stream,
        "POST /v1/analytics/logs HTTP/1.1\r\nHost: {}\r\n{auth}\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        server.addr(),
        body.len()
    )
    .unwrap();
    BufReader::new(stream)
}

/// The status, headers and JSON body of a Logs reply to `body`.
fn logs_reply(server: &MailgunServer, body: &serde_json::Value) -> (Head, serde_json::Value) {
    let mut reply = logs(server, body, false);
    let head = read_head(&mut reply);
    let json = serde_json::from_slice(&small_body(&mut reply, &head)).unwrap();
    (head, json)
}

/// The documented query for the message ids `ids`, from an hour ago, oldest first.
fn logs_query(ids: &[&str], limit: u32, token: Option<&str>) -> serde_json::Value {
    let start = httpdate_minus_hour();
    let mut pagination = serde_json::json!({ "sort": "timestamp:asc", "limit": limit });
    if let Some(token) = token {
        pagination["token"] = token.into();
    }
    serde_json::json!({
        "start": start,
        "events": ["accepted", "delivered", "failed"],
        "filter": {"AND": [
            {"attribute": "domain", "comparator": "=", "values": [{"label": DOMAIN, "value": DOMAIN}]},
            {"attribute": "message-id", "comparator": "=",
             "values": ids.iter().map(|id| serde_json::json!({"label": id, "value": id})).collect::<Vec<_>>()},
        ]},
        "include_totals": true,
        "pagination": pagination,
    })
}

/// RFC 2822 for an hour ago.
fn httpdate_minus_hour() -> String {
    let at = jiff::Timestamp::now() - jiff::SignedDuration::from_hours(1);
    jiff::fmt::rfc2822::DateTimePrinter::new()
        .timestamp_to_string(&at)
        .unwrap()
}

/// A reply's status line and headers.
#[derive(Debug)]
struct Head {
    status: u16,
    headers: Vec<(String, String)>,
}

impl Head {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    fn content_length(&self) -> Option<u64> {
        self.header("content-length").map(|v| v.parse().unwrap())
    }

    fn chunked(&self) -> bool {
        self.header("transfer-encoding") == Some("chunked")
    }
}

/// Reads one line of at most 8 KiB.
fn line(reader: &mut BufReader<TcpStream>) -> std::io::Result<String> {
    let mut line = Vec::new();
    reader.by_ref().take(8192).read_until(b'\n', &mut line)?;
    Ok(String::from_utf8(line).unwrap())
}

fn read_head(reader: &mut BufReader<TcpStream>) -> Head {
    let status_line = line(reader).unwrap();
    let status = status_line.split(' ').nth(1).unwrap().parse().unwrap();
    let mut headers = Vec::new();
    for _ in 0..100 {
        let header = line(reader).unwrap();
        let header = header.trim_end();
        if header.is_empty() {
            return Head { status, headers };
        }
        let (name, value) = header.split_once(':').unwrap();
        headers.push((name.to_owned(), value.trim().to_owned()));
    }
    panic!("more than 100 header lines");
}

/// What was read of a body.
#[derive(Debug, Default)]
struct Body {
    /// Its first 64 KiB at most.
    start: Vec<u8>,
    /// Bytes read (after chunked decoding).
    read: u64,
    /// Whether it ended as it said it would (last chunk, or `Content-Length` reached).
    complete: bool,
    /// What stopped the reading early, if anything did.
    error: Option<std::io::Error>,
}

impl Body {
    fn take(&mut self, bytes: &[u8]) {
        let room = (64 * 1024usize).saturating_sub(self.start.len());
        self.start
            .extend_from_slice(&bytes[..bytes.len().min(room)]);
        self.read += bytes.len() as u64;
    }
}

/// Reads at most `limit` bytes of the body (chunked or with `Content-Length`), calling
/// `progress` with the bytes read so far after each 1 MiB.
fn read_body(
    reader: &mut BufReader<TcpStream>,
    head: &Head,
    limit: u64,
    mut progress: impl FnMut(u64),
) -> Body {
    let mut body = Body::default();
    let mut buf = vec![0u8; 64 * 1024];
    let mut next_progress = MIB;
    // Reads up to `n` bytes of content; false when the stream failed or ended.
    let mut content = |body: &mut Body, mut n: u64, reader: &mut BufReader<TcpStream>| {
        while n > 0 && body.read < limit {
            let want = n.min(buf.len() as u64).min(limit - body.read) as usize;
            match reader.read(&mut buf[..want]) {
                Ok(0) => {
                    body.error = Some(ErrorKind::UnexpectedEof.into());
                    return false;
                }
                Ok(got) => {
                    body.take(&buf[..got]);
                    n -= got as u64;
                }
                Err(e) => {
                    body.error = Some(e);
                    return false;
                }
            }
            if body.read >= next_progress {
                progress(body.read);
                next_progress += MIB;
            }
        }
        n == 0
    };
    if head.chunked() {
        loop {
            let size = match line(reader) {
                Ok(size) if !size.is_empty() => size,
                Ok(_) => {
                    body.error = Some(ErrorKind::UnexpectedEof.into());
                    return body;
                }
                Err(e) => {
                    body.error = Some(e);
                    return body;
                }
            };
            let size = u64::from_str_radix(size.trim(), 16).unwrap();
            if size == 0 {
                body.complete = line(reader).is_ok_and(|l| l == "\r\n");
                return body;
            }
            if !content(&mut body, size, reader) {
                return body;
            }
            assert_eq!(line(reader).unwrap(), "\r\n", "chunk end");
        }
    } else {
        let length = head.content_length().expect("a length or chunks");
        body.complete = content(&mut body, length, reader);
        body
    }
}

/// Reads a whole small body (at most 1 MiB).
fn small_body(reader: &mut BufReader<TcpStream>, head: &Head) -> Vec<u8> {
    let body = read_body(reader, head, MIB, |_| {});
    assert!(body.complete, "{body:?}");
    body.start
}

/// A normal send and lookup: the contract as usual.
fn assert_behaves(server: &MailgunServer, id: &str) {
    let mut reply = post(server, id);
    let head = read_head(&mut reply);
    assert_eq!(head.status, 200);
    let body: serde_json::Value = serde_json::from_slice(&small_body(&mut reply, &head)).unwrap();
    assert_eq!(body["id"], format!("<{id}>"));
    assert_eq!(body["message"], "Queued. Thank you.");
    let mut reply = events(server, id);
    let head = read_head(&mut reply);
    assert_eq!(head.status, 200);
    let page: serde_json::Value = serde_json::from_slice(&small_body(&mut reply, &head)).unwrap();
    assert_eq!(page["items"][0]["event"], "accepted");
    assert_eq!(page["items"][0]["message"]["headers"]["message-id"], id);
}

#[test]
fn huge_ok_streams_far_past_64_mib_with_a_small_server() {
    let server = start();
    server
        .set_failure(rule(FailureMode::HugeOk, FailureTarget::Messages))
        .unwrap();
    let mut reply = post(&server, "huge@b.test");
    let head = read_head(&mut reply);
    assert_eq!(head.status, 200);
    assert_eq!(head.header("content-type"), Some("application/json"));
    assert!(
        head.chunked() && head.content_length().is_none(),
        "{head:?}"
    );
    let mut peak = 0;
    let body = read_body(&mut reply, &head, 96 * MIB, |_| {
        peak = peak.max(rss(server.pid()));
    });
    assert!(body.error.is_none(), "{:?}", body.error);
    assert_eq!(body.read, 96 * MIB, "read 96 MiB and it went on");
    assert!(!body.complete);
    eprintln!("server RSS at most {} KiB", peak / 1024);
    assert!(peak > 0 && peak < SMALL_RSS, "server RSS {peak} bytes");
    let start = String::from_utf8(body.start).unwrap();
    let head_text = r#"{"id":"<huge@b.test>","message":"Queued. Thank you.""#;
    assert!(start.starts_with(head_text), "{:?}", &start[..100]);
    assert!(start[head_text.len()..].bytes().all(|b| b == b' '));
    drop(reply);
    let stored = server.messages().unwrap();
    assert_eq!(stored.len(), 1, "stored as accepted");
    assert_eq!(stored[0].id, "<huge@b.test>");
    // The rule was for one request.
    assert_behaves(&server, "after-huge@b.test");
}

#[test]
fn huge_ok_and_huge_error_are_body_bytes_long() {
    let server = start();
    let sized = |mode, target, bytes| FailureRule {
        body_bytes: Some(bytes),
        ..rule(mode, target)
    };

    server
        .set_failure(sized(
            FailureMode::HugeOk,
            FailureTarget::Messages,
            3 * MIB + 5,
        ))
        .unwrap();
    let mut reply = post(&server, "sized@b.test");
    let head = read_head(&mut reply);
    assert_eq!(head.status, 200);
    let body = read_body(&mut reply, &head, HOSTILE_BODY_BYTES, |_| {});
    assert!(body.complete, "{body:?}");
    assert_eq!(body.read, 3 * MIB + 5);

    server
        .set_failure(sized(FailureMode::HugeOk, FailureTarget::Events, 2 * MIB))
        .unwrap();
    let mut reply = events(&server, "sized@b.test");
    let head = read_head(&mut reply);
    assert_eq!(head.status, 200);
    assert!(head.chunked());
    let body = read_body(&mut reply, &head, HOSTILE_BODY_BYTES, |_| {});
    assert!(body.complete, "{body:?}");
    assert_eq!(body.read, 2 * MIB);
    assert!(body.start.starts_with(br#"{"items":["#));
    let mut items = serde_json::Deserializer::from_slice(&body.start[10..]).into_iter();
    let item: serde_json::Value = items.next().unwrap().unwrap();
    assert_eq!(item["event"], "accepted");
    assert_eq!(item["message"]["headers"]["message-id"], "sized@b.test");
    // Where the first item ends in the bytes the server sent (re-serializing the value
    // would not do: a float timestamp need not print back with the same digits).
    let first_end = 10 + items.byte_offset();
    assert_eq!(body.start[first_end], b',', "items go on");

    server
        .set_failure(sized(FailureMode::HugeError, FailureTarget::All, 2 * MIB))
        .unwrap();
    let mut reply = post(&server, "refused@b.test");
    let head = read_head(&mut reply);
    assert_eq!(head.status, 500);
    assert_eq!(head.header("content-type"), Some("application/json"));
    let body = read_body(&mut reply, &head, HOSTILE_BODY_BYTES, |_| {});
    assert!(body.complete, "{body:?}");
    assert_eq!(body.read, 2 * MIB);
    assert!(body.start.starts_with(br#"{"message":"xxxx"#));
    assert!(body.start[12..].iter().all(|b| *b == b'x'));

    let ids: Vec<_> = server
        .messages()
        .unwrap()
        .into_iter()
        .map(|m| m.id)
        .collect();
    assert_eq!(ids, ["<sized@b.test>"], "the huge error stored nothing");
}

#[test]
fn huge_error_default_streams_with_a_small_server() {
    let server = start();
    server
        .set_failure(rule(FailureMode::HugeError, FailureTarget::Events))
        .unwrap();
    let mut reply = events(&server, "nothing@b.test");
    let head = read_head(&mut reply);
    assert_eq!(head.status, 500);
    let mut peak = 0;
    let body = read_body(&mut reply, &head, 72 * MIB, |_| {
        peak = peak.max(rss(server.pid()));
    });
    assert_eq!(body.read, 72 * MIB);
    assert!(!body.complete);
    eprintln!("server RSS at most {} KiB", peak / 1024);
    assert!(peak > 0 && peak < SMALL_RSS, "server RSS {peak} bytes");
}

#[test]
fn endless_goes_on_until_the_client_hangs_up_then_the_server_behaves() {
    let server = start();
    let endless = FailureRule {
        target: FailureTarget::All,
        ..FailureRule::new(FailureMode::Endless)
    };
    server.set_failure(endless).unwrap();

    let mut reply = post(&server, "endless@b.test");
    let head = read_head(&mut reply);
    assert_eq!(head.status, 200);
    assert!(head.chunked());
    let mut peak = 0;
    let body = read_body(&mut reply, &head, 80 * MIB, |_| {
        peak = peak.max(rss(server.pid()));
    });
    assert_eq!(body.read, 80 * MIB);
    assert!(body.error.is_none() && !body.complete);
    eprintln!("server RSS at most {} KiB", peak / 1024);
    assert!(peak > 0 && peak < SMALL_RSS, "server RSS {peak} bytes");
    assert!(body.start.starts_with(br#"{"id":"<endless@b.test>","#));
    drop(reply);

    // Every request until cleared: events too.
    let mut reply = events(&server, "endless@b.test");
    let head = read_head(&mut reply);
    assert_eq!(head.status, 200);
    let body = read_body(&mut reply, &head, 8 * MIB, |_| {});
    assert_eq!(body.read, 8 * MIB);
    assert!(body.start.starts_with(br#"{"items":[{"#));
    drop(reply);

    assert_eq!(server.messages().unwrap().len(), 1, "stored as accepted");
    server.clear_failure().unwrap();
    assert_behaves(&server, "after-endless@b.test");
}

#[test]
fn control_text_in_an_error_and_in_an_event() {
    let server = start();
    for control in CONTROLS {
        assert!(CONTROL_TEXT.contains(control), "{control:?}");
    }
    assert!(CONTROL_TEXT.contains("Invalid recipient"));

    server
        .set_failure(rule(FailureMode::ControlText, FailureTarget::Messages))
        .unwrap();
    let mut reply = post(&server, "control@b.test");
    let head = read_head(&mut reply);
    assert_eq!(head.status, 400);
    let body: serde_json::Value = serde_json::from_slice(&small_body(&mut reply, &head)).unwrap();
    let message = body["message"].as_str().unwrap();
    assert_eq!(message, CONTROL_TEXT);
    for control in CONTROLS {
        assert!(message.contains(control), "{control:?} in {message:?}");
    }
    assert!(server.messages().unwrap().is_empty(), "400: nothing stored");

    // An accepted message whose event carries the control text.
    let mut reply = post(&server, "event@b.test");
    assert_eq!(read_head(&mut reply).status, 200);
    server
        .set_failure(rule(FailureMode::ControlText, FailureTarget::Events))
        .unwrap();
    let mut reply = events(&server, "event@b.test");
    let head = read_head(&mut reply);
    assert_eq!(head.status, 200);
    let page: serde_json::Value = serde_json::from_slice(&small_body(&mut reply, &head)).unwrap();
    let items = page["items"].as_array().unwrap();
    assert_eq!(items.len(), 1);
    let event = &items[0];
    assert_eq!(event["event"], "failed");
    assert_eq!(event["severity"], "permanent");
    assert_eq!(event["recipient"], "ops@example.com");
    assert_eq!(event["message"]["headers"]["message-id"], "event@b.test");
    assert!(
        page["paging"]["next"]
            .as_str()
            .unwrap()
            .starts_with("http://")
    );
    for text in [&event["reason"], &event["delivery-status"]["message"]] {
        let text = text.as_str().unwrap();
        for control in CONTROLS {
            assert!(text.contains(control), "{control:?} in {text:?}");
        }
    }
    // The rule was for one request: the real events are back.
    let mut reply = events(&server, "event@b.test");
    let head = read_head(&mut reply);
    let page: serde_json::Value = serde_json::from_slice(&small_body(&mut reply, &head)).unwrap();
    assert_eq!(page["items"][0]["event"], "accepted");
}

#[test]
fn bad_json_is_an_accepted_send_whose_reply_cannot_be_read() {
    let server = start();
    server
        .set_failure(FailureRule {
            count: Some(2),
            ..rule(FailureMode::BadJson, FailureTarget::All)
        })
        .unwrap();
    for reply in [post(&server, "bad@b.test"), events(&server, "bad@b.test")] {
        let mut reply = reply;
        let head = read_head(&mut reply);
        assert_eq!(head.status, 200);
        assert_eq!(head.header("content-type"), Some("application/json"));
        let body = small_body(&mut reply, &head);
        assert_eq!(body, b"<html>oops\x1b[2J</html>");
        assert!(serde_json::from_slice::<serde_json::Value>(&body).is_err());
    }
    assert_eq!(server.messages().unwrap().len(), 1, "the send was stored");
    assert_behaves(&server, "after-bad@b.test");
}

#[test]
fn drip_sends_a_valid_reply_a_byte_at_a_time() {
    let server = start();
    server
        .set_failure(FailureRule {
            drip_ms: Some(25),
            ..rule(FailureMode::Drip, FailureTarget::Messages)
        })
        .unwrap();
    let started = Instant::now();
    let mut reply = post(&server, "drip@b.test");
    let head = read_head(&mut reply);
    assert_eq!(head.status, 200);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "headers at once"
    );
    let length = head.content_length().unwrap();
    let mut first = [0u8; 1];
    reply.read_exact(&mut first).unwrap();
    let first_at = started.elapsed();
    let rest = small_body(
        &mut reply,
        &Head {
            status: 200,
            headers: vec![("content-length".into(), (length - 1).to_string())],
        },
    );
    let took = started.elapsed() - first_at;
    let expected = Duration::from_millis(25 * (length - 1));
    assert!(took >= expected * 9 / 10, "{took:?} for {length} bytes");
    let body: serde_json::Value =
        serde_json::from_slice(&[&first[..], &rest[..]].concat()).unwrap();
    assert_eq!(body["id"], "<drip@b.test>");
    assert_eq!(server.messages().unwrap().len(), 1, "stored first");

    // Events, at the default pace: a byte a second.
    server
        .set_failure(rule(FailureMode::Drip, FailureTarget::Events))
        .unwrap();
    let mut reply = events(&server, "drip@b.test");
    let head = read_head(&mut reply);
    assert_eq!(head.status, 200);
    let started = Instant::now();
    let mut two = [0u8; 2];
    reply.read_exact(&mut two).unwrap();
    assert_eq!(&two, b"{\"");
    assert!(
        started.elapsed() >= Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn reset_mid_reply_cuts_the_reply_with_a_reset() {
    let server = start();
    for target in [FailureTarget::Messages, FailureTarget::Events] {
        server
            .set_failure(rule(FailureMode::ResetMidReply, target))
            .unwrap();
        let mut reply = if target == FailureTarget::Messages {
            post(&server, "cut@b.test")
        } else {
            events(&server, "cut@b.test")
        };
        let head = read_head(&mut reply);
        assert_eq!(head.status, 200);
        let length = head.content_length().unwrap();
        let body = read_body(&mut reply, &head, MIB, |_| {});
        assert!(!body.complete);
        assert_eq!(body.read, length / 2, "half the body, then the cut");
        let error = body.error.unwrap();
        assert_eq!(error.kind(), ErrorKind::ConnectionReset, "{error}");
    }
    assert_eq!(server.messages().unwrap().len(), 1, "stored first");
    assert_behaves(&server, "after-cut@b.test");
}

#[test]
fn logs_accepts_the_documented_request_and_pages_with_tokens() {
    let server = start();
    for id in ["l1@b.test", "l2@b.test", "l3@b.test"] {
        assert_eq!(read_head(&mut post(&server, id)).status, 200);
    }
    // Without the key: 401, counted.
    let mut reply = logs(&server, &logs_query(&["l1@b.test"], 100, None), true);
    assert_eq!(read_head(&mut reply).status, 401);
    // One page of two: the documented reply, items of the asked ids only.
    let (head, page) = logs_reply(
        &server,
        &logs_query(&["l1@b.test", "<l3@b.test>"], 100, None),
    );
    assert_eq!(head.status, 200);
    for key in ["start", "end", "items", "pagination", "aggregates"] {
        assert!(page.get(key).is_some(), "{key} missing: {page}");
    }
    assert!(page["start"].as_str().unwrap().ends_with("-0000"), "{page}");
    let items = page["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{page}");
    for (item, id) in items.iter().zip(["l1@b.test", "l3@b.test"]) {
        assert_eq!(item["event"], "accepted");
        assert_eq!(item["message"]["headers"]["message-id"], id);
        assert_eq!(item["recipient"], "ops@example.com");
        assert_eq!(item["domain"]["name"], DOMAIN);
        assert!(
            item["@timestamp"].as_str().unwrap().ends_with('Z'),
            "{item}"
        );
        assert!(item.get("timestamp").is_none(), "{item}");
    }
    assert_eq!(page["pagination"]["total"], 2);
    assert!(
        page["pagination"].get("next").is_none(),
        "the last page has no next"
    );
    // Pages of one: a token to each next page, none after the last.
    let (_, first) = logs_reply(&server, &logs_query(&["l1@b.test", "l3@b.test"], 1, None));
    let token = first["pagination"]["next"].as_str().unwrap().to_owned();
    let (_, second) = logs_reply(
        &server,
        &logs_query(&["l1@b.test", "l3@b.test"], 1, Some(&token)),
    );
    assert_eq!(
        second["items"][0]["message"]["headers"]["message-id"],
        "l3@b.test"
    );
    assert!(second["pagination"].get("next").is_none(), "{second}");
    // Shapes the server refuses (400), each naming what is wrong.
    let bad = [
        (
            serde_json::json!({"pagination": {"limit": 300}}),
            "pagination.limit",
        ),
        (serde_json::json!({"start": "1720396800"}), "start"),
        (
            serde_json::json!({"filter": {"AND": [{"attribute": "message_id", "comparator": "=", "values": [{"label": "x", "value": "x"}]}]}}),
            "attribute",
        ),
        (serde_json::json!({"page": 2}), "unknown field"),
        (
            serde_json::json!({"pagination": {"token": "forged"}}),
            "token",
        ),
    ];
    for (body, named) in bad {
        let (head, reply) = logs_reply(&server, &body);
        assert_eq!(head.status, 400, "{body}");
        assert!(
            reply["message"].as_str().unwrap().contains(named),
            "{body}: {reply}"
        );
    }
    assert_eq!(server.stats().unwrap().logs_requests, 9);
}

#[test]
fn logs_failures_and_hostile_pages() {
    let server = start();
    assert_eq!(read_head(&mut post(&server, "lf@b.test")).status, 200);
    let query = logs_query(&["lf@b.test"], 100, None);
    server
        .set_failure(FailureRule {
            retry_after: Some(9),
            ..rule(FailureMode::RateLimited, FailureTarget::Logs)
        })
        .unwrap();
    let (head, _) = logs_reply(&server, &query);
    assert_eq!((head.status, head.header("retry-after")), (429, Some("9")));
    for (mode, status) in [
        (FailureMode::ServerError, 500),
        (FailureMode::Unauthorized, 401),
    ] {
        server.set_failure(rule(mode, FailureTarget::Logs)).unwrap();
        assert_eq!(logs_reply(&server, &query).0.status, status, "{mode:?}");
    }
    // A rule for the events API leaves the Logs API alone, and `all` covers it.
    server
        .set_failure(rule(FailureMode::ServerError, FailureTarget::Events))
        .unwrap();
    assert_eq!(logs_reply(&server, &query).0.status, 200);
    server.clear_failure().unwrap();
    // Control text in a Logs page: `pagination` with tokens, not `paging` with URLs.
    server
        .set_failure(rule(FailureMode::ControlText, FailureTarget::Logs))
        .unwrap();
    let (head, page) = logs_reply(&server, &query);
    assert_eq!(head.status, 200);
    let item = &page["items"][0];
    assert_eq!(item["message"]["headers"]["message-id"], "lf@b.test");
    assert!(item["reason"].as_str().unwrap().contains("\u{202e}"));
    let token = page["pagination"]["next"].as_str().unwrap().to_owned();
    assert!(!token.starts_with("http"), "{token}");
    // Its token asks again from the start, where the real events are.
    let (_, page) = logs_reply(&server, &logs_query(&["lf@b.test"], 100, Some(&token)));
    assert_eq!(page["items"][0]["event"], "accepted");
    // A huge page streams past any sane bound.
    server
        .set_failure(FailureRule {
            body_bytes: Some(8 * MIB),
            ..rule(FailureMode::HugeOk, FailureTarget::Logs)
        })
        .unwrap();
    let mut reply = logs(&server, &query, false);
    let head = read_head(&mut reply);
    assert!(head.chunked());
    let body = read_body(&mut reply, &head, 16 * MIB, |_| {});
    assert_eq!(body.read, 8 * MIB);
    assert!(body.start.starts_with(br#"{"items":["#));
}
