//! A hostile SMTP relay: a TCP proxy in front of a real SMTP server that passes connections
//! through, or plays a relay that misbehaves ([`RelayMode`]). The `hostile-smtp-relay` binary
//! runs it as a process; [`crate::HostileSmtpRelay`] starts and controls that process.
//!
//! What it is for: the provider's bounds and text cleaning against a broken or compromised
//! relay (endless lines and replies, control characters in replies, drips, connections reset
//! mid-reply), and, once it behaves again ([`RelayMode::Pass`]), real deliveries to the server
//! behind it. Its own memory stays small whatever it sends: filler is 64 KiB sent again and
//! again as fast as the client reads, and what it reads is read a bounded line at a time.
//!
//! What it is not for: SMTP beyond what those scripts need. The hostile modes speak plain SMTP
//! only (no STARTTLS, no AUTH: a client must use `starttls: never` against them); nothing sent
//! to them is stored. Each connection is played by the mode set when it was accepted;
//! connections passing through are closed when the mode changes to a hostile one, so a
//! client's pooled connection cannot dodge it.

use std::{
    fmt,
    net::SocketAddr,
    str::FromStr,
    sync::{
        Arc, LazyLock,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use serde::{Deserialize, Serialize};
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::{TcpListener, TcpStream},
    sync::watch,
};

/// What the relay does with a new connection. The wire behaviour of each mode is exact (the
/// tests pin it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RelayMode {
    /// A transparent TCP proxy to the upstream server (connected anew for each connection):
    /// what the client sends reaches it, and it stores what it accepts.
    Pass,
    /// `220 ` and then `x` without end and never a CRLF, as fast as the client reads.
    EndlessGreeting,
    /// `220-` + 72 `y` + CRLF, again and again without end (never a last line `220 `).
    EndlessMultilineGreeting,
    /// The relay speaks SMTP itself: greeting `220 hostile ESMTP`, `EHLO` answered
    /// `250-hostile` / `250 8BITMIME` (no STARTTLS, no AUTH), `HELO` `250 hostile`, `MAIL`
    /// `250 2.1.0 OK`, every `RCPT` `550 5.1.1 ` + [`SMTP_CONTROL_TEXT`] +
    /// ` mailbox unavailable`, `DATA` (no recipient accepted) `554 5.5.1 no valid recipients`,
    /// `RSET` and `NOOP` `250 2.0.0 OK`, `QUIT` `221 2.0.0 bye` and close, anything else
    /// `502 5.5.2 command not implemented`. Nothing is stored.
    ControlTextOnRcpt,
    /// Greeting `220 ` + [`SMTP_CONTROL_TEXT`]; then as [`Self::ControlTextOnRcpt`] but `RCPT`
    /// answered `250 2.1.5 OK` and `DATA` refused with `554 5.7.1 ` + [`SMTP_CONTROL_TEXT`].
    ControlTextGreeting,
    /// The greeting `220 hostile ESMTP` + CRLF one byte at a time, a second apart (see
    /// [`Relay::set_drip`]); then as [`Self::ControlTextOnRcpt`] but `RCPT` answered
    /// `250 2.1.5 OK` and `DATA` refused with `451 4.3.0 try later`.
    Drip,
    /// Greeting and `EHLO` as [`Self::ControlTextOnRcpt`]; `MAIL` gets `25`, then, 200 ms
    /// later, a TCP reset (`SO_LINGER` 0, then close).
    ResetMidReply,
    /// A normal dialogue (`RCPT` `250 2.1.5 OK`, `DATA` `354 go ahead`); after the message's
    /// final `.` line, `250 ` and then `z` without end and never a CRLF. Nothing is stored
    /// (the client cannot know).
    EndlessReplyAfterData,
}

impl RelayMode {
    /// Every mode.
    pub const ALL: [Self; 8] = [
        Self::Pass,
        Self::EndlessGreeting,
        Self::EndlessMultilineGreeting,
        Self::ControlTextOnRcpt,
        Self::ControlTextGreeting,
        Self::Drip,
        Self::ResetMidReply,
        Self::EndlessReplyAfterData,
    ];

    /// Its name in the relay's `mode <name>` command: kebab case (`endless-greeting`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Pass => "pass",
            Self::EndlessGreeting => "endless-greeting",
            Self::EndlessMultilineGreeting => "endless-multiline-greeting",
            Self::ControlTextOnRcpt => "control-text-on-rcpt",
            Self::ControlTextGreeting => "control-text-greeting",
            Self::Drip => "drip",
            Self::ResetMidReply => "reset-mid-reply",
            Self::EndlessReplyAfterData => "endless-reply-after-data",
        }
    }
}

impl fmt::Display for RelayMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A [`RelayMode`] name that is not one.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no relay mode is called {0:?}")]
pub struct UnknownMode(pub String);

impl FromStr for RelayMode {
    type Err = UnknownMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|m| m.name() == s)
            .ok_or_else(|| UnknownMode(s.to_owned()))
    }
}

/// The control text of the hostile SMTP replies (UTF-8, no CR, LF or NUL): normal words around
/// a terminal colour escape (ESC `[31m`), BEL, DEL, the C1 control CSI (U+009B), the Unicode
/// line and paragraph separators (U+2028, U+2029), a right-to-left override (U+202E) and the
/// isolates U+2066 to U+2069.
pub const SMTP_CONTROL_TEXT: &str = "Recipient \u{1b}[31mred\u{1b}[0m bell\u{7} del\u{7f} \
     csi\u{9b}2J line\u{2028}para\u{2029} \u{202e}exe.txt \u{2066}lri\u{2069} \u{2067}rli\u{2069} \
     \u{2068}fsi\u{2069}";

/// What the relay has seen, from its `stats` command.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RelayStats {
    /// Connections accepted, in any mode.
    pub connections: u64,
    /// Connections passed through to the upstream server.
    pub passed: u64,
    /// Connections played by a hostile mode.
    pub hostile: u64,
    /// Bytes the hostile modes sent.
    pub hostile_bytes: u64,
}

#[derive(Debug, Default)]
struct Counters {
    connections: AtomicU64,
    passed: AtomicU64,
    hostile: AtomicU64,
    hostile_bytes: AtomicU64,
}

/// The size of one chunk of filler.
const CHUNK: usize = 64 * 1024;
/// [`RelayMode::EndlessGreeting`]'s filler.
static XS: [u8; CHUNK] = [b'x'; CHUNK];
/// [`RelayMode::EndlessReplyAfterData`]'s filler.
static ZS: [u8; CHUNK] = [b'z'; CHUNK];
/// [`RelayMode::EndlessMultilineGreeting`]'s lines, about 64 KiB of them.
static CONTINUATION_LINES: LazyLock<Vec<u8>> = LazyLock::new(|| {
    let line = format!("220-{}\r\n", "y".repeat(72));
    line.repeat(CHUNK / line.len()).into_bytes()
});
/// The longest command line the relay reads (RFC 5321: 512 bytes); a longer one ends the
/// session.
const MAX_COMMAND: u64 = 4096;
/// The longest message line read at once; a longer one is read in pieces.
const MAX_DATA_LINE: u64 = 64 * 1024;
/// How long [`RelayMode::ResetMidReply`] waits between `25` and the reset, so the `25` is
/// flushed to the client first.
const CUT_AFTER: Duration = Duration::from_millis(200);
/// How long a passing connection waits for the upstream server to accept it.
const UPSTREAM_CONNECT: Duration = Duration::from_secs(10);

/// The relay: its mode, its drip interval and its counts; [`Relay::serve`] runs it.
#[derive(Debug)]
pub struct Relay {
    upstream: SocketAddr,
    mode: watch::Sender<RelayMode>,
    drip: watch::Sender<Duration>,
    counters: Arc<Counters>,
}

impl Relay {
    /// A relay to `upstream`, in [`RelayMode::Pass`], dripping a byte a second.
    pub fn new(upstream: SocketAddr) -> Self {
        Self {
            upstream,
            mode: watch::Sender::new(RelayMode::Pass),
            drip: watch::Sender::new(Duration::from_secs(1)),
            counters: Arc::default(),
        }
    }

    /// What new connections get from now on; a hostile mode also closes the connections
    /// passing through.
    pub fn set_mode(&self, mode: RelayMode) {
        self.mode.send_replace(mode);
    }

    /// The current mode.
    pub fn mode(&self) -> RelayMode {
        *self.mode.borrow()
    }

    /// The time between two bytes of [`RelayMode::Drip`] for new connections (default 1 s).
    pub fn set_drip(&self, every: Duration) {
        self.drip.send_replace(every);
    }

    /// What it has seen so far.
    pub fn stats(&self) -> RelayStats {
        let c = &self.counters;
        RelayStats {
            connections: c.connections.load(Ordering::Relaxed),
            passed: c.passed.load(Ordering::Relaxed),
            hostile: c.hostile.load(Ordering::Relaxed),
            hostile_bytes: c.hostile_bytes.load(Ordering::Relaxed),
        }
    }

    /// Runs one control command and answers it with one line (no line break):
    /// - `mode <name>` ([`RelayMode::name`]): `ok`;
    /// - `drip <milliseconds>`: `ok`;
    /// - `stats`: [`RelayStats`] as JSON;
    /// - anything else: `error: ...`.
    pub fn command(&self, line: &str) -> String {
        let mut words = line.split_whitespace();
        match (words.next(), words.next(), words.next()) {
            (Some("mode"), Some(name), None) => match name.parse() {
                Ok(mode) => {
                    self.set_mode(mode);
                    "ok".into()
                }
                Err(e) => format!("error: {e}"),
            },
            (Some("drip"), Some(ms), None) => match ms.parse() {
                Ok(ms) => {
                    self.set_drip(Duration::from_millis(ms));
                    "ok".into()
                }
                Err(e) => format!("error: drip {ms:?}: {e}"),
            },
            (Some("stats"), None, None) => {
                serde_json::to_string(&self.stats()).unwrap_or_else(|e| format!("error: {e}"))
            }
            _ => format!("error: unknown command {line:?}"),
        }
    }

    /// Accepts connections on `listener` and plays each with the mode of the moment, until the
    /// future is dropped (connections already accepted live on in their own tasks until their
    /// client hangs up).
    pub async fn serve(&self, listener: TcpListener) {
        loop {
            let client = match listener.accept().await {
                Ok((client, _)) => client,
                // Out of descriptors or a connection gone before it was accepted: wait a
                // little rather than spin.
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = client.set_nodelay(true);
            let mode = *self.mode.borrow();
            let counters = self.counters.clone();
            counters.connections.fetch_add(1, Ordering::Relaxed);
            if mode == RelayMode::Pass {
                counters.passed.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(pass(client, self.upstream, self.mode.subscribe()));
            } else {
                counters.hostile.fetch_add(1, Ordering::Relaxed);
                let drip = *self.drip.borrow();
                let peer = Peer {
                    conn: BufReader::new(client),
                    counters,
                    drip,
                };
                // The session ends when the client hangs up; nothing to report.
                tokio::spawn(async move { drop(peer.play(mode).await) });
            }
        }
    }
}

/// Proxies until either side closes or the mode turns hostile.
async fn pass(mut client: TcpStream, upstream: SocketAddr, mut mode: watch::Receiver<RelayMode>) {
    let connected = tokio::time::timeout(UPSTREAM_CONNECT, TcpStream::connect(upstream)).await;
    let Ok(Ok(mut server)) = connected else {
        return;
    };
    let _ = server.set_nodelay(true);
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        _ = mode.wait_for(|m| *m != RelayMode::Pass) => {}
    }
}

/// One connection played by a hostile mode.
struct Peer {
    conn: BufReader<TcpStream>,
    counters: Arc<Counters>,
    drip: Duration,
}

impl Peer {
    /// Writes `bytes` and counts them.
    async fn send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        self.conn.get_mut().write_all(bytes).await?;
        self.counters
            .hostile_bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// `head`, then `filler` without end (until the client hangs up).
    async fn endless(&mut self, head: &[u8], filler: &[u8]) -> std::io::Result<()> {
        self.send(head).await?;
        loop {
            self.send(filler).await?;
        }
    }

    /// Plays `mode` until the client hangs up (or the mode ends the session).
    async fn play(mut self, mode: RelayMode) -> std::io::Result<()> {
        match mode {
            RelayMode::Pass => Ok(()),
            RelayMode::EndlessGreeting => self.endless(b"220 ", &XS).await,
            RelayMode::EndlessMultilineGreeting => self.endless(b"", &CONTINUATION_LINES).await,
            RelayMode::Drip => {
                for byte in b"220 hostile ESMTP\r\n" {
                    tokio::time::sleep(self.drip).await;
                    self.send(&[*byte]).await?;
                }
                self.dialogue(mode).await
            }
            RelayMode::ControlTextGreeting => {
                self.send(format!("220 {SMTP_CONTROL_TEXT}\r\n").as_bytes())
                    .await?;
                self.dialogue(mode).await
            }
            RelayMode::ControlTextOnRcpt
            | RelayMode::ResetMidReply
            | RelayMode::EndlessReplyAfterData => {
                self.send(b"220 hostile ESMTP\r\n").await?;
                self.dialogue(mode).await
            }
        }
    }

    /// Reads one line of at most `max` bytes into `line` (cleared first); `false` at the end of
    /// the stream.
    async fn read_line(&mut self, line: &mut Vec<u8>, max: u64) -> std::io::Result<bool> {
        line.clear();
        let n = (&mut self.conn).take(max).read_until(b'\n', line).await?;
        Ok(n > 0)
    }

    /// The SMTP dialogue after the greeting, as `mode` plays it.
    async fn dialogue(&mut self, mode: RelayMode) -> std::io::Result<()> {
        let mut line = Vec::new();
        let mut recipients = 0u32;
        loop {
            if !self.read_line(&mut line, MAX_COMMAND).await? {
                return Ok(());
            }
            if !line.ends_with(b"\n") {
                self.send(b"500 5.5.2 line too long\r\n").await?;
                return Ok(());
            }
            let verb = line
                .split(|b| b.is_ascii_whitespace())
                .next()
                .unwrap_or_default()
                .to_ascii_uppercase();
            let reply = match verb.as_slice() {
                b"EHLO" => "250-hostile\r\n250 8BITMIME\r\n".to_owned(),
                b"HELO" => "250 hostile\r\n".to_owned(),
                b"MAIL" if mode == RelayMode::ResetMidReply => {
                    self.send(b"25").await?;
                    self.conn.get_mut().flush().await?;
                    tokio::time::sleep(CUT_AFTER).await;
                    // Dropping the stream with SO_LINGER 0 resets it.
                    return self.conn.get_ref().set_zero_linger();
                }
                b"MAIL" => "250 2.1.0 OK\r\n".to_owned(),
                b"RCPT" if mode == RelayMode::ControlTextOnRcpt => {
                    format!("550 5.1.1 {SMTP_CONTROL_TEXT} mailbox unavailable\r\n")
                }
                b"RCPT" => {
                    recipients += 1;
                    "250 2.1.5 OK\r\n".to_owned()
                }
                b"DATA" if recipients == 0 => "554 5.5.1 no valid recipients\r\n".to_owned(),
                b"DATA" if mode == RelayMode::ControlTextGreeting => {
                    format!("554 5.7.1 {SMTP_CONTROL_TEXT}\r\n")
                }
                b"DATA" if mode == RelayMode::Drip => "451 4.3.0 try later\r\n".to_owned(),
                b"DATA" => {
                    self.send(b"354 go ahead\r\n").await?;
                    if !self.skip_message().await? {
                        return Ok(());
                    }
                    return self.endless(b"250 ", &ZS).await;
                }
                b"RSET" => {
                    recipients = 0;
                    "250 2.0.0 OK\r\n".to_owned()
                }
                b"NOOP" => "250 2.0.0 OK\r\n".to_owned(),
                b"QUIT" => {
                    self.send(b"221 2.0.0 bye\r\n").await?;
                    return Ok(());
                }
                _ => "502 5.5.2 command not implemented\r\n".to_owned(),
            };
            self.send(reply.as_bytes()).await?;
        }
    }

    /// Reads (and forgets) a message up to its final `.` line; `false` when the stream ended
    /// first.
    async fn skip_message(&mut self) -> std::io::Result<bool> {
        let mut line = Vec::new();
        let mut at_line_start = true;
        loop {
            if !self.read_line(&mut line, MAX_DATA_LINE).await? {
                return Ok(false);
            }
            if at_line_start && (line == b".\r\n" || line == b".\n") {
                return Ok(true);
            }
            at_line_start = line.ends_with(b"\n");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mode_names_round_trip() {
        for mode in RelayMode::ALL {
            assert_eq!(mode.name().parse::<RelayMode>(), Ok(mode));
            assert_eq!(mode.to_string(), mode.name());
        }
        assert!("Pass".parse::<RelayMode>().is_err());
    }

    #[test]
    fn commands_answer_one_line() {
        let relay = Relay::new(SocketAddr::from(([127, 0, 0, 1], 25)));
        assert_eq!(relay.command("mode drip"), "ok");
        assert_eq!(relay.mode(), RelayMode::Drip);
        assert_eq!(relay.command("drip 20"), "ok");
        assert!(relay.command("mode nonsense").starts_with("error: "));
        assert!(relay.command("drip soon").starts_with("error: "));
        assert!(relay.command("dance").starts_with("error: "));
        let stats: RelayStats = serde_json::from_str(&relay.command("stats")).unwrap();
        assert_eq!(stats, RelayStats::default());
    }

    #[test]
    fn the_control_text_fits_on_one_smtp_line() {
        assert!(!SMTP_CONTROL_TEXT.contains(['\r', '\n', '\0']));
        assert!(SMTP_CONTROL_TEXT.len() < 400);
    }
}
