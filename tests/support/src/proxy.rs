//! A TCP proxy that can cut a process off its peer: a network partition on loopback.
//!
//! ```no_run
//! # async fn f(api: std::net::SocketAddr) -> std::io::Result<()> {
//! let proxy = capm_test_support::proxy::TcpProxy::start(api)?;
//! // Point the process under test at proxy.addr() instead of `api`.
//! proxy.cut(); // every open connection is closed; new ones are closed as soon as accepted
//! proxy.restore(); // connections go through again
//! # Ok(()) }
//! ```
//!
//! A cut closes connections (the peer sees them end, as after a proxy or API server restart),
//! and refuses new ones by accepting and closing them (the client sees a connection reset or an
//! early EOF at once, as from a load balancer with no healthy backend).

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use tokio::{
    net::{TcpListener, TcpStream},
    sync::watch,
    task::JoinHandle,
};

/// A running proxy (stopped when dropped).
#[derive(Debug)]
pub struct TcpProxy {
    addr: SocketAddr,
    /// `true` while cut.
    cut: watch::Sender<bool>,
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
        let (cut, cut_rx) = watch::channel(false);
        let accepted = Arc::new(AtomicU64::new(0));
        let counter = Arc::clone(&accepted);
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                counter.fetch_add(1, Ordering::Relaxed);
                if *cut_rx.borrow() {
                    drop(client);
                    continue;
                }
                let mut cut_rx = cut_rx.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (mut client, mut server) = (client, server);
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
                        _ = cut_rx.wait_for(|cut| *cut) => {}
                    }
                });
            }
        });
        Ok(Self {
            addr,
            cut,
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
        self.cut.send_replace(true);
    }

    /// Lets connections through again.
    pub fn restore(&self) {
        self.cut.send_replace(false);
    }

    /// Whether the proxy is cut now.
    pub fn is_cut(&self) -> bool {
        *self.cut.borrow()
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
}
