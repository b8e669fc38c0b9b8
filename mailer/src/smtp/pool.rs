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
        extension::ClientId,
        response::Response,
    },
};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
};
use tokio_rustls::{TlsConnector, client::TlsStream};

use super::{BACKEND, classify};
use crate::MailError;

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
    async fn connect_inner(&self) -> Result<AsyncSmtpConnection, MailError> {
        let tcp = open_tcp(&self.host, self.port).await?;
        let stream: Box<dyn AsyncTokioStream> = match &self.security {
            Security::Implicit { connector, name } => Box::new(ImplicitTls(
                connector.connect(name.clone(), tcp).await.map_err(|e| {
                    retryable(format!("Connection error: TLS handshake: {e}"), Some(e))
                })?,
            )),
            Security::None | Security::Starttls { .. } => Box::new(tcp),
        };
        let mut conn = AsyncSmtpConnection::connect_with_transport(stream, &self.hello)
            .await
            .map_err(before_sending)?;
        if let Security::Starttls { params, required } = &self.security
            && (*required || conn.can_starttls())
        {
            conn.starttls(params.clone(), &self.hello)
                .await
                .map_err(before_sending)?;
        }
        if let Some((credentials, mechanisms)) = &self.auth {
            conn.auth(mechanisms, credentials)
                .await
                .map_err(before_sending)?;
        }
        Ok(conn)
    }

    /// A new connection, ready for `MAIL FROM`.
    async fn connect(&self) -> Result<AsyncSmtpConnection, MailError> {
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
    conn: AsyncSmtpConnection,
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
    async fn checkout(&self) -> Result<AsyncSmtpConnection, MailError> {
        loop {
            let parked = self.idle().pop();
            let Some(Parked { mut conn, since }) = parked else {
                return self.connector.connect().await;
            };
            if since.elapsed() <= self.idle_timeout
                && tokio::time::timeout(self.connector.timeout, conn.test_connected())
                    .await
                    .unwrap_or(false)
            {
                return Ok(conn);
            }
            conn.abort().await;
        }
    }

    async fn recycle(&self, mut conn: AsyncSmtpConnection) {
        if conn.has_broken() {
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
        conn.abort().await;
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
    ) -> Result<Response, MailError> {
        let mut conn = self.checkout().await?;
        // On timeout the connection is dropped mid-transaction: it is never reused.
        match tokio::time::timeout(self.connector.timeout, conn.send(envelope, raw)).await {
            Ok(Ok(response)) => {
                self.recycle(conn).await;
                Ok(response)
            }
            Ok(Err(err)) => {
                self.recycle(conn).await;
                Err(classify(err))
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
            parked.conn.abort().await;
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
