//! A TCP proxy that can cut a process off its peer: a network partition on loopback.
//!
//! ```no_run
//! # async fn f(api: std::net::SocketAddr) -> std::io::Result<()> {
//! let proxy = capm_test_support::proxy::TcpProxy::start(api)?;
//! // Point the process under test at proxy.addr() instead of `api`.
//! proxy.cut(); // every open connection is closed; new ones are closed as soon as accepted
//! proxy.restore(); // connections go through again
//! proxy.drop_packets(); // nothing passes and nothing is closed
//! # Ok(()) }
//! ```
//!
//! A cut closes connections (the peer sees them end, as after a proxy or API server restart),
//! and refuses new ones by accepting and closing them (the client sees a connection reset or an
//! early EOF at once, as from a load balancer with no healthy backend).
//!
//! Dropping packets plays a load balancer that silently forgot its connections: open
//! connections go silent in both directions and stay so for good, even after the restore (their
//! bytes are read and discarded, nothing is ever closed by the proxy, so neither end learns
//! anything until its own timeout). New connections are accepted and held, unanswered, until the
//! restore, when they go through (as a retransmitted SYN would).

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use tokio::{
    io::AsyncReadExt,
    net::{TcpListener, TcpStream},
    sync::watch,
    task::JoinHandle,
};

/// What the proxy does with traffic now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Forwards.
    Open,
    /// Closes every connection.
    Cut,
    /// Forwards nothing and closes nothing.
    Dropping,
}

/// A running proxy (stopped when dropped).
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    mode: watch::Sender<Mode>,
    accepted: Arc<AtomicU64>,
    task: JoinHandle<()>,
}

impl TcpProxy {
    /// Listens on a free loopback port and forwards every connection to `upstream`. Called
    /// within a Tokio runtime, which runs it.
    ///
    /// # Errors
    /// When no port can be bound.
    pub fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(listener)?;
        let addr = listener.local_addr()?;
        let (mode, mode_rx) = watch::channel(Mode::Open);
        let accepted = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&accepted);
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                counter.fetch_add(1, Ordering::Relaxed);
                if *mode_rx.borrow() == Mode::Cut {
                    drop(client);
                    continue;
                }
                tokio::spawn(forward(client, upstream, mode_rx.clone()));
            }
        });
        Ok(Self {
            addr,
            mode,
            accepted,
            task,
        })
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Closes every open connection and every new one until [`Self::restore`].
    pub fn cut(&self) {
        self.mode.send_replace(Mode::Cut);
    }

    /// Silences every open connection for good and holds new ones until [`Self::restore`]
    /// (see the module's documentation).
    pub fn drop_packets(&self) {
        self.mode.send_replace(Mode::Dropping);
    }

    /// Lets new connections through again (and those held while dropping packets).
    pub fn restore(&self) {
        self.mode.send_replace(Mode::Open);
    }

    /// Whether the proxy is cut or dropping packets now.
    pub fn is_cut(&self) -> bool {
        *self.mode.borrow() != Mode::Open
    }

    /// How many connections it accepted so far (cut ones included).
    pub fn accepted(&self) -> u64 {
        self.accepted.load(Ordering::Relaxed)
    }
}

/// A proxy in front of `cp`'s API server, and a copy of `cp`'s kubeconfig at `kubeconfig` that
/// reaches the API server only through it. Called within a Tokio runtime.
///
/// # Errors
/// When the server address cannot be read, the kubeconfig does not name it, or a file or port
/// cannot be had.
pub fn in_front_of_api_server(
    cp: &crate::ControlPlane,
    kubeconfig: &std::path::Path,
) -> std::io::Result<TcpProxy> {
    let invalid = |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, what);
    let server = cp.server();
    let upstream: SocketAddr = server
        .trim_start_matches("https://")
        .parse()
        .map_err(|e| invalid(format!("the API server's address {server:?}: {e}")))?;
    let text = std::fs::read_to_string(cp.kubeconfig())?;
    if !text.contains(server) {
        return Err(invalid(format!("the kubeconfig does not name {server}")));
    }
    let proxy = TcpProxy::start(upstream)?;
    std::fs::write(
        kubeconfig,
        text.replace(server, &format!("https://{}", proxy.addr())),
    )?;
    Ok(proxy)
}

/// One connection: held while packets are dropped, then forwarded until a cut (closed) or a
/// drop (silenced for good).
async fn forward(mut client: TcpStream, upstream: SocketAddr, mut mode: watch::Receiver<Mode>) {
    match mode.wait_for(|m| *m != Mode::Dropping).await.map(|m| *m) {
        Ok(Mode::Open) => {}
        _ => return,
    }
    let Ok(mut server) = TcpStream::connect(upstream).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let ended = tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => Mode::Cut,
        m = mode.wait_for(|m| *m != Mode::Open) => m.map_or(Mode::Cut, |m| *m),
    };
    if ended == Mode::Dropping {
        // Silent for good: the client's bytes go nowhere, nothing comes back, nothing is closed
        // until the client gives up (or the proxy is cut or stopped).
        let mut sink = [0u8; 4096];
        loop {
            tokio::select! {
                read = client.read(&mut sink) => if matches!(read, Ok(0) | Err(_)) { break },
                _ = mode.wait_for(|m| *m == Mode::Cut) => break,
            }
        }
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.cut();
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn echo(stream: &mut TcpStream, text: &[u8]) -> std::io::Result<Vec<u8>> {
        stream.write_all(text).await?;
        let mut buf = vec![0u8; text.len()];
        stream.read_exact(&mut buf).await?;
        Ok(buf)
    }

    #[tokio::test]
    async fn a_cut_closes_open_connections_and_refuses_new_ones_until_restored() {
        let proxy = TcpProxy::start(echo_server().await).unwrap();
        let mut open = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(echo(&mut open, b"hello").await.unwrap(), b"hello");

        proxy.cut();
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(std::time::Duration::from_secs(5), open.read(&mut buf))
            .await
            .expect("the open connection ends at once");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
        let mut new = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(
            echo(&mut new, b"x").await.is_err(),
            "a new connection gets through"
        );

        proxy.restore();
        let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(echo(&mut again, b"back").await.unwrap(), b"back");
        assert_eq!(proxy.accepted(), 3);
    }

    #[tokio::test]
    async fn dropping_packets_silences_open_connections_for_good_and_holds_new_ones() {
        let quiet = std::time::Duration::from_millis(300);
        let proxy = TcpProxy::start(echo_server().await).unwrap();
        let mut open = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(echo(&mut open, b"hello").await.unwrap(), b"hello");

        proxy.drop_packets();
        tokio::task::yield_now().await;
        assert!(
            tokio::time::timeout(quiet, echo(&mut open, b"lost"))
                .await
                .is_err(),
            "an open connection neither answers nor ends"
        );
        let mut held = TcpStream::connect(proxy.addr()).await.unwrap();
        held.write_all(b"held").await.unwrap();
        let mut buf = [0u8; 4];
        assert!(
            tokio::time::timeout(quiet, held.read_exact(&mut buf))
                .await
                .is_err(),
            "a new connection is held, unanswered and open"
        );

        proxy.restore();
        let read =
            tokio::time::timeout(std::time::Duration::from_secs(5), held.read_exact(&mut buf))
                .await
                .expect("the held connection goes through on the restore");
        assert!(read.is_ok(), "{read:?}");
        assert_eq!(&buf, b"held");
        assert!(
            tokio::time::timeout(quiet, echo(&mut open, b"still"))
                .await
                .is_err(),
            "a connection silenced by the drop stays silent after the restore"
        );
        let mut again = TcpStream::connect(proxy.addr()).await.unwrap();
        assert_eq!(echo(&mut again, b"back").await.unwrap(), b"back");
    }
}
