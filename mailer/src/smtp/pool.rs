//! Our own SMTP connections: lettre speaks the protocol, we open the sockets and pool them.
//!
//! lettre 0.11's transport opens its sockets itself and offers no way to set `TCP_NODELAY` on
//! them (its `Executor` trait, the only connection hook, is sealed). It writes a message and its
//! final `.` line in two writes, so with Nagle on the `.` waits for the peer's delayed ACK:
//! about 40 ms per message, even on loopback. Here the socket is ours, with `TCP_NODELAY` set,
//! and lettre's [`AsyncSmtpConnection`] runs over it: greeting, EHLO, STARTTLS, AUTH and the
//! transaction are still lettre's. Implicit TLS (`smtps://`) is set up here with tokio-rustls
//! before lettre reads the greeting; STARTTLS stays lettre's.
//!
//! The pool keeps what lettre's did: up to `max_idle` idle connections, newest reused first,
//! each checked with `NOOP` before reuse, closed (with `QUIT`) after `idle_timeout`.
//!
//! Every socket is wrapped in a [`Guarded`] stream under lettre, which
//! - bounds what the relay may send before lettre buffers it: at most [`MAX_REPLY_BYTES`] between
//!   two of our writes (one reply, encrypted or not) and, while the session is readable as text,
//!   at most [`MAX_REPLY_LINE_BYTES`] per line (lettre itself checks both only after buffering a
//!   whole line, so an endless line would grow its buffer without end);
//! - refuses to write the end-of-data line once the transaction's [`CommitGate`](crate::CommitGate)
//!   has refused: the transaction is driven here step by step (`MAIL`, `RCPT`, `DATA`, the
//!   message), and the gate is asked after the message and before its terminator `CRLF.CRLF`,
//!   SMTP's commit point. A refused gate poisons the stream, lettre's write of the terminator
//!   fails, and the connection is dropped without it.

use std::{
    fmt, io,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, Mutex, PoisonError, Weak},
    task::{Context, Poll},
    time::{Duration, Instant},
};

use lettre::{
    address::Envelope,
    transport::smtp::{
        authentication::{Credentials, Mechanism},
        client::{AsyncSmtpConnection, AsyncTokioStream, TlsParameters},
        commands::{Data, Mail, Rcpt},
        extension::{ClientId, Extension, MailBodyParameter, MailParameter},
        response::Response,
    },
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
};
use tokio_rustls::{TlsConnector, client::TlsStream};

use super::{BACKEND, classify};
use crate::{MailError, gate::Gate};

/// The most a relay may send between two of our writes: one reply (lettre's own total limit is
/// 100 000 bytes; a multi-line EHLO reply is a few hundred). Counted on the wire, so it also
/// bounds a TLS handshake's flight (certificates: a few KiB).
pub const MAX_REPLY_BYTES: usize = 64 * 1024;
/// The longest reply line read while the session is text (RFC 5321 §4.5.3.1.5 allows 512
/// octets; lettre refuses lines over 1000 once it has them).
pub const MAX_REPLY_LINE_BYTES: usize = 1024;

/// How the connection is secured.
pub(super) enum Security {
    /// Plain text.
    None,
    /// STARTTLS when the server offers it (`required: false`) or always.
    Starttls {
        params: TlsParameters,
        required: bool,
    },
    /// TLS from the first byte (`smtps://`).
    Implicit {
        connector: TlsConnector,
        name: rustls::pki_types::ServerName<'static>,
    },
}

/// Opens, secures and authenticates one connection.
pub(super) struct Connector {
    pub(super) host: String,
    pub(super) port: u16,
    pub(super) security: Security,
    /// Connect + handshake timeout, and the timeout of one send.
    pub(super) timeout: Duration,
    pub(super) hello: ClientId,
    pub(super) auth: Option<(Credentials, Vec<Mechanism>)>,
}

fn retryable(message: String, source: Option<io::Error>) -> MailError {
    MailError::Retryable {
        backend: BACKEND,
        code: None,
        retry_after: None,
        message,
        source: source.map(|e| Box::new(e) as _),
    }
}

/// Nothing was sent before the connection was ready: anything but a 5xx reply is retryable.
fn before_sending(err: lettre::transport::smtp::Error) -> MailError {
    match classify(err) {
        MailError::UnknownOutcome {
            code,
            message,
            source,
            ..
        } => MailError::Retryable {
            backend: BACKEND,
            code,
            retry_after: None,
            message,
            source,
        },
        other => other,
    }
}

/// A TCP connection to `host:port` (each resolved address in turn) with `TCP_NODELAY` set.
pub(super) async fn open_tcp(host: &str, port: u16) -> Result<TcpStream, MailError> {
    let addrs = tokio::net::lookup_host((host, port))
        .await
        .map_err(|e| retryable(format!("Connection error: resolving {host}: {e}"), Some(e)))?;
    let mut last = None;
    for addr in addrs {
        match TcpStream::connect(addr).await {
            Ok(stream) => {
                stream.set_nodelay(true).map_err(|e| {
                    retryable(
                        format!("Connection error: setting TCP_NODELAY: {e}"),
                        Some(e),
                    )
                })?;
                return Ok(stream);
            }
            Err(e) => last = Some((addr, e)),
        }
    }
    Err(match last {
        Some((addr, e)) => retryable(
            format!("Connection error: connecting to {addr}: {e}"),
            Some(e),
        ),
        None => retryable(
            format!("Connection error: {host} resolved to no address"),
            None,
        ),
    })
}

impl Connector {
    async fn connect_inner(&self) -> Result<Conn, MailError> {
        let tcp = open_tcp(&self.host, self.port).await?;
        let guard = Arc::new(Guard::default());
        let stream: Box<dyn AsyncTokioStream> = match &self.security {
            // The handshake's bytes are bounded only by the timeout here: rustls reads records
            // of at most 16 KiB and refuses oversized handshake messages itself.
            Security::Implicit { connector, name } => Box::new(Guarded::new(
                ImplicitTls(connector.connect(name.clone(), tcp).await.map_err(|e| {
                    retryable(format!("Connection error: TLS handshake: {e}"), Some(e))
                })?),
                guard.clone(),
            )),
            Security::None | Security::Starttls { .. } => {
                Box::new(Guarded::new(tcp, guard.clone()))
            }
        };
        let mut conn = AsyncSmtpConnection::connect_with_transport(stream, &self.hello)
            .await
            .map_err(before_sending)?;
        if let Security::Starttls { params, required } = &self.security
            && (*required || conn.can_starttls())
        {
            // From here on the guard sees TLS records, not lines: only the reply bound holds.
            guard.set_encrypted();
            conn.starttls(params.clone(), &self.hello)
                .await
                .map_err(before_sending)?;
        }
        if let Some((credentials, mechanisms)) = &self.auth {
            conn.auth(mechanisms, credentials)
                .await
                .map_err(before_sending)?;
        }
        Ok(Conn { smtp: conn, guard })
    }

    /// A new connection, ready for `MAIL FROM`.
    async fn connect(&self) -> Result<Conn, MailError> {
        tokio::time::timeout(self.timeout, self.connect_inner())
            .await
            .unwrap_or_else(|_| {
                Err(retryable(
                    format!(
                        "Connection error: no ready connection to {}:{} within {:?}",
                        self.host, self.port, self.timeout
                    ),
                    None,
                ))
            })
    }
}

/// What a [`Guarded`] stream and its connection share.
#[derive(Debug, Default)]
struct Guard {
    state: Mutex<GuardState>,
}

#[derive(Debug, Default)]
struct GuardState {
    /// Bytes read since our last write.
    turn: usize,
    /// Bytes read since the last line feed (while the session is text).
    line: usize,
    /// A TLS layer above us: the bytes are records, not lines.
    encrypted: bool,
    /// The commit gate refused: no write may pass any more.
    abandoned: Option<String>,
}

impl Guard {
    fn state(&self) -> std::sync::MutexGuard<'_, GuardState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn set_encrypted(&self) {
        self.state().encrypted = true;
    }

    fn abandon(&self, reason: String) {
        self.state().abandoned = Some(reason);
    }

    fn abandoned(&self) -> Option<String> {
        self.state().abandoned.clone()
    }

    /// Before a read into a buffer of `room` bytes: how many may be read.
    fn allowance(&self, room: usize) -> io::Result<usize> {
        let state = self.state();
        let left = MAX_REPLY_BYTES.saturating_sub(state.turn);
        if left == 0 {
            return Err(io::Error::other(format!(
                "the relay's reply exceeds {MAX_REPLY_BYTES} bytes; not read"
            )));
        }
        Ok(room.min(left))
    }

    /// After a read of `bytes`.
    fn read(&self, bytes: &[u8]) -> io::Result<()> {
        let mut state = self.state();
        state.turn += bytes.len();
        if state.encrypted {
            return Ok(());
        }
        for &b in bytes {
            if b == b'\n' {
                state.line = 0;
            } else {
                state.line += 1;
                if state.line > MAX_REPLY_LINE_BYTES {
                    return Err(io::Error::other(format!(
                        "a reply line of the relay exceeds {MAX_REPLY_LINE_BYTES} bytes; not read"
                    )));
                }
            }
        }
        Ok(())
    }

    /// Before a write: refused once abandoned; otherwise a new reply may come.
    fn write(&self) -> io::Result<()> {
        let mut state = self.state();
        if state.abandoned.is_some() {
            return Err(io::Error::other(
                "the commit gate refused: the end of data is not sent",
            ));
        }
        state.turn = 0;
        Ok(())
    }
}

/// A stream under lettre that bounds what is read and stops writes once a send is abandoned
/// (see the module documentation).
#[derive(Debug)]
struct Guarded<S> {
    inner: S,
    guard: Arc<Guard>,
}

impl<S> Guarded<S> {
    fn new(inner: S, guard: Arc<Guard>) -> Self {
        Self { inner, guard }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Guarded<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let allowed = self.guard.allowance(buf.remaining())?;
        // A view of at most `allowed` bytes (lettre's BufReader hands in an initialised buffer,
        // so initialising is free).
        let mut limited = ReadBuf::new(buf.initialize_unfilled_to(allowed));
        match Pin::new(&mut self.inner).poll_read(cx, &mut limited) {
            Poll::Ready(Ok(())) => {
                let n = limited.filled().len();
                self.guard.read(limited.filled())?;
                buf.advance(n);
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Guarded<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        self.guard.write()?;
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

impl<S: AsyncTokioStream> AsyncTokioStream for Guarded<S> {
    fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.inner.peer_addr()
    }
}

/// A connection and its stream's guard.
struct Conn {
    smtp: AsyncSmtpConnection,
    guard: Arc<Guard>,
}

/// The message, then (when the message is written) the commit gate's verdict: a refusal
/// abandons the stream before lettre writes the terminator.
struct Committing<'a> {
    message: Option<&'a [u8]>,
    gate: &'a Gate,
    guard: &'a Guard,
}

impl<'a> Iterator for Committing<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        if let Some(message) = self.message.take() {
            return Some(message);
        }
        if let Err(reason) = self.gate.may_commit() {
            self.guard.abandon(reason);
        }
        None
    }
}

/// An implicit-TLS stream as lettre wants it.
#[derive(Debug)]
struct ImplicitTls(TlsStream<TcpStream>);

impl AsyncRead for ImplicitTls {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for ImplicitTls {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl AsyncTokioStream for ImplicitTls {
    fn peer_addr(&self) -> io::Result<SocketAddr> {
        self.0.get_ref().0.peer_addr()
    }
}

struct Parked {
    conn: Conn,
    since: Instant,
}

/// Idle connections to one relay, reused newest first.
pub(super) struct Pool {
    connector: Connector,
    idle: Mutex<Vec<Parked>>,
    max_idle: usize,
    idle_timeout: Duration,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("max_idle", &self.max_idle)
            .field("idle_timeout", &self.idle_timeout)
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// A pool keeping up to `max_idle` idle connections (0: one connection per message).
    /// With `max_idle > 0` a task closes connections idle for longer than `idle_timeout`; it
    /// ends with the pool.
    ///
    /// # Panics
    /// With `max_idle > 0`, outside a Tokio runtime.
    pub(super) fn new(connector: Connector, max_idle: usize, idle_timeout: Duration) -> Arc<Self> {
        let pool = Arc::new(Self {
            connector,
            idle: Mutex::new(Vec::new()),
            max_idle,
            idle_timeout,
        });
        if max_idle > 0 {
            tokio::spawn(close_idle(Arc::downgrade(&pool)));
        }
        pool
    }

    fn idle(&self) -> std::sync::MutexGuard<'_, Vec<Parked>> {
        self.idle.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An idle connection that answers `NOOP`, else a new one.
    async fn checkout(&self) -> Result<Conn, MailError> {
        loop {
            let parked = self.idle().pop();
            let Some(Parked { mut conn, since }) = parked else {
                return self.connector.connect().await;
            };
            if since.elapsed() <= self.idle_timeout
                && tokio::time::timeout(self.connector.timeout, conn.smtp.test_connected())
                    .await
                    .unwrap_or(false)
            {
                return Ok(conn);
            }
            conn.smtp.abort().await;
        }
    }

    async fn recycle(&self, mut conn: Conn) {
        if conn.smtp.has_broken() || conn.guard.abandoned().is_some() {
            return;
        }
        {
            let mut idle = self.idle();
            if idle.len() < self.max_idle {
                idle.push(Parked {
                    conn,
                    since: Instant::now(),
                });
                return;
            }
        }
        conn.smtp.abort().await;
    }

    /// Sends one message on a pooled or new connection.
    ///
    /// # Errors
    /// As [`classify`] says; failures before `MAIL FROM` are never
    /// [`UnknownOutcome`](MailError::UnknownOutcome), a send that outlives the timeout is.
    pub(super) async fn send(
        &self,
        envelope: &Envelope,
        raw: &[u8],
        gate: &Gate,
    ) -> Result<Response, MailError> {
        let mut conn = self.checkout().await?;
        // On timeout the connection is dropped mid-transaction: it is never reused.
        match tokio::time::timeout(
            self.connector.timeout,
            self.transaction(&mut conn, envelope, raw, gate),
        )
        .await
        {
            Ok(Ok(response)) => {
                self.recycle(conn).await;
                Ok(response)
            }
            Ok(Err(err)) => {
                if let Some(reason) = conn.guard.abandoned() {
                    // Dropped without the terminator (and without QUIT, which could be taken
                    // for it): the relay discards the transaction.
                    return Err(MailError::Abandoned {
                        backend: BACKEND,
                        reason,
                    });
                }
                // lettre aborts a connection whose transaction failed; so does this.
                if !conn.smtp.has_broken() {
                    conn.smtp.abort().await;
                }
                Err(err)
            }
            Err(_) => Err(MailError::UnknownOutcome {
                backend: BACKEND,
                code: None,
                message: format!(
                    "no reply to the message within {:?}",
                    self.connector.timeout
                ),
                source: None,
            }),
        }
    }

    /// `MAIL`, `RCPT`, `DATA` and the message, as lettre's `send` does, with the commit gate
    /// asked between the message and its terminator.
    async fn transaction(
        &self,
        conn: &mut Conn,
        envelope: &Envelope,
        raw: &[u8],
        gate: &Gate,
    ) -> Result<Response, MailError> {
        let smtp = &mut conn.smtp;
        let unsupported = |what: &str| MailError::Permanent {
            backend: BACKEND,
            code: None,
            message: format!("the relay does not offer {what}, which this message needs"),
        };
        let mut options = vec![];
        let non_ascii = envelope
            .from()
            .into_iter()
            .chain(envelope.to())
            .any(|a| !AsRef::<str>::as_ref(a).is_ascii());
        if non_ascii {
            if !smtp.server_info().supports_feature(Extension::SmtpUtfEight) {
                return Err(unsupported("SMTPUTF8"));
            }
            options.push(MailParameter::SmtpUtfEight);
        }
        if !raw.is_ascii() {
            if !smtp.server_info().supports_feature(Extension::EightBitMime) {
                return Err(unsupported("8BITMIME"));
            }
            options.push(MailParameter::Body(MailBodyParameter::EightBitMime));
        }
        smtp.command(Mail::new(envelope.from().cloned(), options))
            .await
            .map_err(classify)?;
        for to in envelope.to() {
            smtp.command(Rcpt::new(to.clone(), vec![]))
                .await
                .map_err(classify)?;
        }
        smtp.command(Data).await.map_err(classify)?;
        smtp.message_iter(Committing {
            message: Some(raw),
            gate,
            guard: &conn.guard,
        })
        .await
        .map_err(classify)
    }
}

/// Closes connections idle for longer than the pool's idle timeout, until the pool is gone.
async fn close_idle(pool: Weak<Pool>) {
    let period = match pool.upgrade() {
        Some(pool) => pool.idle_timeout.max(Duration::from_secs(1)),
        None => return,
    };
    loop {
        tokio::time::sleep(period).await;
        let Some(pool) = pool.upgrade() else { return };
        let expired: Vec<Parked> = {
            let mut idle = pool.idle();
            let (expired, kept) = std::mem::take(&mut *idle)
                .into_iter()
                .partition(|p| p.since.elapsed() > pool.idle_timeout);
            *idle = kept;
            expired
        };
        drop(pool);
        for mut parked in expired {
            parked.conn.smtp.abort().await;
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[tokio::test]
    async fn sockets_have_nagle_off() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let stream = open_tcp("127.0.0.1", port).await.unwrap();
        assert!(stream.nodelay().unwrap());
    }

    #[tokio::test]
    async fn a_closed_port_is_retryable() {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let err = open_tcp("127.0.0.1", port).await.unwrap_err();
        assert_eq!(err.kind(), crate::ErrorKind::Retryable, "{err}");
        assert!(err.to_string().contains("Connection error"), "{err}");
    }
}
