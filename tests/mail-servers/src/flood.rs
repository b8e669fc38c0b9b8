//! A flood client for an HTTP(S) server of the provider (its webhook port): many concurrent
//! `POST`s of large generated bodies, and many idle connections.
//!
//! What it is for: showing that a server's limits hold while a peer misbehaves (a body over
//! its limit answered 413 long before it was all sent, requests past a cap answered 503,
//! connections past a cap closed at once), with everything on this side bounded in time and
//! memory: bodies are generated while they are sent, answers are read up to their headers (at
//! most 16 KiB), every wait has a deadline. Raise the descriptor limit first
//! ([`raise_nofile_limit`]) to open thousands of connections.
//!
//! What it is not for: a general HTTP client (one request per connection, `Connection: close`,
//! nothing of the answer but its status), certificate checks (TLS accepts any certificate), or
//! measuring throughput.

use std::{
    collections::BTreeMap,
    io,
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use futures::StreamExt as _;
use rustls::{
    DigitallySignedStruct, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    crypto::{CryptoProvider, ring},
    pki_types::{CertificateDer, ServerName, UnixTime},
};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::TcpStream,
    time::Instant,
};
use tokio_rustls::TlsConnector;

/// Raises this process's soft `RLIMIT_NOFILE` to its hard limit and returns the new soft limit
/// (`u64::MAX` for unlimited).
///
/// # Errors
/// When the kernel refuses the new limit.
pub fn raise_nofile_limit() -> io::Result<u64> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    if limit.current != limit.maximum {
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: limit.maximum,
                maximum: limit.maximum,
            },
        )?;
    }
    Ok(getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX))
}

/// How long each client of [`post_bodies`] may take, from connecting to the answer's headers.
pub const FLOOD_TIMEOUT: Duration = Duration::from_secs(60);

/// How long connecting (and the TLS handshake) may take, within the client's deadline.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The most of an answer read: its status line and headers.
const MAX_ANSWER_HEAD: usize = 16 * 1024;

/// The size of one generated body chunk.
const CHUNK: usize = 64 * 1024;

/// The body's filler (between `{"pad":"` and `"}`).
static XS: [u8; CHUNK] = [b'x'; CHUNK];

/// What became of one client's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FloodOutcome {
    /// The server answered with this status (whether or not the body was all sent).
    Status(u16),
    /// The server reset the connection before answering.
    Reset,
    /// The server closed the connection before answering.
    Closed,
    /// The connection was refused.
    Refused,
    /// No answer within the deadline.
    Timeout,
    /// Anything else (a TLS failure, an answer that is not HTTP, a local error), described.
    Failed(String),
}

/// One client of [`post_bodies`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientReport {
    /// What became of its request.
    pub outcome: FloodOutcome,
    /// How many body bytes it wrote before the answer came or the connection failed. Written
    /// into the socket: the kernel's buffers on both sides (a few MiB at most) count too, so
    /// the server read somewhat less.
    pub body_bytes_sent: u64,
    /// From the start of connecting to the outcome.
    pub elapsed: Duration,
}

/// What [`post_bodies`] saw, one report per client.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FloodReport {
    /// In the order the clients were started.
    pub clients: Vec<ClientReport>,
}

impl FloodReport {
    /// How many clients got `outcome`.
    pub fn count(&self, outcome: &FloodOutcome) -> usize {
        self.clients
            .iter()
            .filter(|c| &c.outcome == outcome)
            .count()
    }

    /// How many clients got an answer with `status`.
    pub fn with_status(&self, status: u16) -> usize {
        self.count(&FloodOutcome::Status(status))
    }

    /// How many answers of each status.
    pub fn statuses(&self) -> BTreeMap<u16, usize> {
        let mut statuses = BTreeMap::new();
        for client in &self.clients {
            if let FloodOutcome::Status(status) = client.outcome {
                *statuses.entry(status).or_insert(0) += 1;
            }
        }
        statuses
    }

    /// The most body bytes any client wrote.
    pub fn max_body_bytes_sent(&self) -> u64 {
        self.clients
            .iter()
            .map(|c| c.body_bytes_sent)
            .max()
            .unwrap_or(0)
    }
}

/// `clients` concurrent connections to `addr`, each `POST`ing to `path` a body of
/// `body_bytes` bytes with `Content-Length` (`{"pad":"xxx…"}`, generated as it is sent), over
/// TLS without checking the certificate when `tls`. Each stops writing when the answer's
/// headers arrive and gives up after [`FLOOD_TIMEOUT`].
pub async fn post_bodies(
    addr: SocketAddr,
    tls: bool,
    clients: usize,
    body_bytes: u64,
    path: &str,
) -> FloodReport {
    post_bodies_within(addr, tls, clients, body_bytes, path, FLOOD_TIMEOUT).await
}

/// [`post_bodies`], each client giving up after `timeout`.
pub async fn post_bodies_within(
    addr: SocketAddr,
    tls: bool,
    clients: usize,
    body_bytes: u64,
    path: &str,
    timeout: Duration,
) -> FloodReport {
    let connector = match tls.then(insecure_tls_connector).transpose() {
        Ok(connector) => connector,
        Err(e) => {
            let failed = ClientReport {
                outcome: FloodOutcome::Failed(format!("TLS client configuration: {e}")),
                body_bytes_sent: 0,
                elapsed: Duration::ZERO,
            };
            return FloodReport {
                clients: vec![failed; clients],
            };
        }
    };
    let head: Arc<str> = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {body_bytes}\r\nConnection: close\r\n\r\n"
    )
    .into();
    let tasks: Vec<_> = (0..clients)
        .map(|_| {
            let connector = connector.clone();
            let head = head.clone();
            tokio::spawn(async move { post_one(addr, connector, &head, body_bytes, timeout).await })
        })
        .collect();
    let mut report = FloodReport::default();
    for task in tasks {
        report
            .clients
            .push(task.await.unwrap_or_else(|e| ClientReport {
                outcome: FloodOutcome::Failed(format!("the client task failed: {e}")),
                body_bytes_sent: 0,
                elapsed: Duration::ZERO,
            }));
    }
    report
}

/// One client: connect, send, read the answer's headers.
async fn post_one(
    addr: SocketAddr,
    connector: Option<TlsConnector>,
    head: &str,
    body_bytes: u64,
    timeout: Duration,
) -> ClientReport {
    let start = Instant::now();
    let deadline = start + timeout;
    let sent = AtomicU64::new(0);
    let exchange = async {
        let connect = tokio::time::timeout(CONNECT_TIMEOUT, async {
            let tcp = TcpStream::connect(addr).await?;
            let _ = tcp.set_nodelay(true);
            Ok::<_, io::Error>(tcp)
        });
        let tcp = match connect.await {
            Ok(Ok(tcp)) => tcp,
            Ok(Err(e)) => return outcome_of_error(&e, "connecting"),
            Err(_) => return FloodOutcome::Timeout,
        };
        match connector {
            None => post_on(tcp, head, body_bytes, &sent).await,
            Some(connector) => {
                let name = ServerName::IpAddress(addr.ip().into());
                match tokio::time::timeout(CONNECT_TIMEOUT, connector.connect(name, tcp)).await {
                    Ok(Ok(tls)) => post_on(tls, head, body_bytes, &sent).await,
                    Ok(Err(e)) => outcome_of_error(&e, "TLS handshake"),
                    Err(_) => FloodOutcome::Timeout,
                }
            }
        }
    };
    let outcome = tokio::time::timeout_at(deadline, exchange)
        .await
        .unwrap_or(FloodOutcome::Timeout);
    ClientReport {
        outcome,
        body_bytes_sent: sent.load(Ordering::Relaxed),
        elapsed: start.elapsed(),
    }
}

/// What an I/O error means for a request.
fn outcome_of_error(e: &io::Error, what: &str) -> FloodOutcome {
    match e.kind() {
        io::ErrorKind::ConnectionRefused => FloodOutcome::Refused,
        io::ErrorKind::ConnectionReset | io::ErrorKind::ConnectionAborted => FloodOutcome::Reset,
        io::ErrorKind::UnexpectedEof | io::ErrorKind::BrokenPipe => FloodOutcome::Closed,
        _ => FloodOutcome::Failed(format!("{what}: {e}")),
    }
}

/// Sends the request on `stream` while reading the answer; the answer ends it.
async fn post_on<S>(stream: S, head: &str, body_bytes: u64, sent: &AtomicU64) -> FloodOutcome
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    let (mut reader, mut writer) = tokio::io::split(stream);
    let write = async {
        writer.write_all(head.as_bytes()).await?;
        write_body(&mut writer, body_bytes, sent).await?;
        writer.flush().await
    };
    let read = read_status(&mut reader);
    tokio::pin!(write, read);
    let mut writing = true;
    loop {
        tokio::select! {
            // A failed write (the server closed or reset) may still leave its answer to read.
            _ = &mut write, if writing => writing = false,
            outcome = &mut read => return outcome,
        }
    }
}

/// Writes the body, counting each byte written.
async fn write_body<W>(writer: &mut W, body_bytes: u64, sent: &AtomicU64) -> io::Result<()>
where
    W: AsyncWrite + Unpin,
{
    let (open, close): (&[u8], &[u8]) = if body_bytes >= 10 {
        (br#"{"pad":""#, br#""}"#)
    } else {
        (b"", b"")
    };
    let mut filler = body_bytes - (open.len() + close.len()) as u64;
    let mut write = async |mut bytes: &[u8]| {
        while !bytes.is_empty() {
            let n = writer.write(bytes).await?;
            if n == 0 {
                return Err(io::ErrorKind::WriteZero.into());
            }
            sent.fetch_add(n as u64, Ordering::Relaxed);
            bytes = &bytes[n..];
        }
        Ok::<_, io::Error>(())
    };
    write(open).await?;
    while filler > 0 {
        let n = usize::try_from(filler).map_or(CHUNK, |f| f.min(CHUNK));
        write(&XS[..n]).await?;
        filler -= n as u64;
    }
    write(close).await
}

/// Reads the answer up to the end of its headers (at most [`MAX_ANSWER_HEAD`]) and returns its
/// status.
async fn read_status<R>(reader: &mut R) -> FloodOutcome
where
    R: AsyncRead + Unpin,
{
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 4096];
    loop {
        let failure = match reader.read(&mut buf).await {
            Ok(0) => None,
            Ok(n) => {
                head.extend_from_slice(&buf[..n]);
                if head.windows(4).any(|w| w == b"\r\n\r\n") || head.len() >= MAX_ANSWER_HEAD {
                    return status_of(&head).unwrap_or_else(|| not_http(&head));
                }
                continue;
            }
            Err(e) => Some(e),
        };
        // The connection ended: a status line that came whole still counts.
        if let Some(status) = status_of(&head) {
            return status;
        }
        return match failure {
            _ if !head.is_empty() => not_http(&head),
            None => FloodOutcome::Closed,
            Some(e) => outcome_of_error(&e, "reading the answer"),
        };
    }
}

/// The status of an answer whose status line is complete.
fn status_of(head: &[u8]) -> Option<FloodOutcome> {
    let end = head.windows(2).position(|w| w == b"\r\n")?;
    let line = std::str::from_utf8(&head[..end]).ok()?;
    let mut words = line.split(' ');
    let version = words.next()?;
    let status = words.next()?.parse().ok()?;
    version
        .starts_with("HTTP/1.")
        .then_some(FloodOutcome::Status(status))
}

fn not_http(head: &[u8]) -> FloodOutcome {
    let start = String::from_utf8_lossy(&head[..head.len().min(80)]).into_owned();
    FloodOutcome::Failed(format!("not an HTTP answer: {start:?}"))
}

/// A TLS client that accepts any certificate (handshake signatures are still checked).
/// A TLS connector that accepts every server certificate (ring, safe default protocol versions):
/// for test clients of servers with throwaway or self-signed certificates, never elsewhere.
///
/// # Errors
/// When rustls refuses the protocol versions for the provider.
pub fn insecure_tls_connector() -> Result<TlsConnector, rustls::Error> {
    let provider = Arc::new(ring::default_provider());
    let verifier = Arc::new(AnyCertificate(provider.clone()));
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(TlsConnector::from(Arc::new(config)))
}

/// Accepts every server certificate: a test client of a server with a throwaway certificate.
#[derive(Debug)]
struct AnyCertificate(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// How long connecting all of [`idle_connections`] may take in all.
pub const IDLE_CONNECT_DEADLINE: Duration = Duration::from_secs(30);

/// How long [`idle_connections`] waits after the last connection before it counts those the
/// server closed.
const SETTLE: Duration = Duration::from_millis(500);

/// How many connections [`idle_connections`] opens at once.
const CONNECTING_AT_ONCE: usize = 256;

/// Idle connections to a server, from [`idle_connections`]; dropping it closes them.
#[derive(Debug, Default)]
pub struct IdleConnections {
    /// The connections still open, as far as the last probe could tell.
    pub streams: Vec<TcpStream>,
    /// Connections that were established.
    pub connected: usize,
    /// Connections the server refused.
    pub refused: usize,
    /// Connections that could not be made in time (e.g. a full accept queue).
    pub timed_out: usize,
    /// Connections that failed otherwise (e.g. this process out of descriptors).
    pub failed: usize,
    /// The first of those other failures.
    pub first_error: Option<String>,
    /// Established connections the server closed, reset or wrote to (idle connections only
    /// hear from a server that is done with them) by the last probe.
    pub closed_by_server: usize,
}

impl IdleConnections {
    /// How many are still open (as of the last probe).
    pub fn open(&self) -> usize {
        self.streams.len()
    }

    /// Checks every connection without waiting, drops those the server closed, reset or wrote
    /// to (adding them to [`Self::closed_by_server`]) and returns how many are still open.
    pub fn probe(&mut self) -> usize {
        let before = self.streams.len();
        self.streams.retain(|stream| {
            let mut byte = [0u8; 1];
            matches!(stream.try_read(&mut byte), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
        });
        self.closed_by_server += before - self.streams.len();
        self.streams.len()
    }
}

/// Opens `count` TCP connections to `addr` (at most 256 connecting at once, each within 5 s,
/// all within [`IDLE_CONNECT_DEADLINE`]), keeps them idle, waits half a second and probes them
/// ([`IdleConnections::probe`]). The caller drops them when done.
pub async fn idle_connections(addr: SocketAddr, count: usize) -> IdleConnections {
    let deadline = Instant::now() + IDLE_CONNECT_DEADLINE;
    let attempts = futures::stream::iter(0..count)
        .map(|_| async move {
            let limit = deadline.min(Instant::now() + Duration::from_secs(5));
            tokio::time::timeout_at(limit, TcpStream::connect(addr)).await
        })
        .buffer_unordered(CONNECTING_AT_ONCE);
    tokio::pin!(attempts);
    let mut idle = IdleConnections::default();
    while let Some(attempt) = attempts.next().await {
        match attempt {
            Ok(Ok(stream)) => {
                idle.connected += 1;
                idle.streams.push(stream);
            }
            Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionRefused => idle.refused += 1,
            Ok(Err(e)) => {
                idle.failed += 1;
                idle.first_error.get_or_insert_with(|| e.to_string());
            }
            Err(_) => idle.timed_out += 1,
        }
    }
    tokio::time::sleep(SETTLE).await;
    idle.probe();
    idle
}
