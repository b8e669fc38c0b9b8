//! The flood client against tiny local servers: bodies over a server's limit answered 413 long
//! before they were all sent, bodies within it arriving whole, over plain TCP and over TLS; a
//! server that never answers, one that hangs up, a port that refuses; idle connections past a
//! server's cap closed at once; the descriptor limit raised.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{net::SocketAddr, sync::Arc, time::Duration};

use axum::{
    Router, body::Bytes, extract::DefaultBodyLimit, http::StatusCode, routing::post,
    serve::Listener,
};
use capm_mail_servers::{
    FloodOutcome, idle_connections, post_bodies, post_bodies_within, raise_nofile_limit,
};
use rustls::{
    ServerConfig,
    crypto::ring,
    pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer},
};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, server::TlsStream};

const MIB: u64 = 1 << 20;
/// The test server's body limit.
const LIMIT: usize = 1 << 20;

/// 200 for a body that is the flood client's JSON, 400 for another; 413 past [`LIMIT`].
fn app() -> Router {
    async fn handle(body: Bytes) -> StatusCode {
        match serde_json::from_slice::<serde_json::Value>(&body) {
            Ok(value)
                if value["pad"]
                    .as_str()
                    .is_some_and(|p| p.bytes().all(|b| b == b'x')) =>
            {
                StatusCode::OK
            }
            _ => StatusCode::BAD_REQUEST,
        }
    }
    Router::new()
        .route("/convert", post(handle))
        .layer(DefaultBodyLimit::max(LIMIT))
}

async fn plain_server() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app()).await });
    addr
}

/// Accepts TLS connections with a throwaway self-signed certificate.
struct TlsListener {
    tcp: TcpListener,
    acceptor: TlsAcceptor,
}

impl Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((tcp, addr)) = self.tcp.accept().await else {
                continue;
            };
            if let Ok(tls) = self.acceptor.accept(tcp).await {
                return (tls, addr);
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

async fn tls_server() -> SocketAddr {
    let certified = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
    let cert = CertificateDer::from(certified.cert.der().to_vec());
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(
        certified.signing_key.serialize_der(),
    ));
    let config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![cert], key)
        .unwrap();
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let listener = TlsListener {
        tcp,
        acceptor: TlsAcceptor::from(Arc::new(config)),
    };
    tokio::spawn(async move { axum::serve(listener, app()).await });
    addr
}

#[tokio::test]
async fn bodies_within_the_limit_arrive_whole() {
    let addr = plain_server().await;
    let report = post_bodies(addr, false, 4, 64 * 1024, "/convert").await;
    assert_eq!(report.clients.len(), 4);
    assert_eq!(report.with_status(200), 4, "{report:?}");
    for client in &report.clients {
        assert_eq!(client.body_bytes_sent, 64 * 1024);
    }
    // A body too short for the JSON wrapper is sent as is.
    let report = post_bodies(addr, false, 1, 5, "/convert").await;
    assert_eq!(
        report.statuses().into_iter().collect::<Vec<_>>(),
        [(400, 1)]
    );
    assert_eq!(report.clients[0].body_bytes_sent, 5);
}

#[tokio::test]
async fn bodies_over_the_limit_get_413_long_before_they_are_sent() {
    let addr = plain_server().await;
    let report = post_bodies(addr, false, 8, 256 * MIB, "/convert").await;
    assert_eq!(report.with_status(413), 8, "{report:?}");
    eprintln!(
        "at most {} KiB sent of 256 MiB",
        report.max_body_bytes_sent() / 1024
    );
    // The server read 1 MiB; the kernel's buffers on both sides hold a few more.
    assert!(
        report.max_body_bytes_sent() < 64 * MIB,
        "sent {} bytes",
        report.max_body_bytes_sent()
    );
}

#[tokio::test]
async fn over_tls_too() {
    let addr = tls_server().await;
    let report = post_bodies(addr, true, 3, 32 * 1024, "/convert").await;
    assert_eq!(report.with_status(200), 3, "{report:?}");
    let report = post_bodies(addr, true, 3, 128 * MIB, "/convert").await;
    assert_eq!(report.with_status(413), 3, "{report:?}");
    assert!(report.max_body_bytes_sent() < 64 * MIB);
    // Plain HTTP to a TLS port is not answered with HTTP.
    let report = post_bodies_within(addr, false, 1, 1024, "/convert", Duration::from_secs(3)).await;
    assert_ne!(report.clients[0].outcome, FloodOutcome::Status(200));
}

#[tokio::test]
async fn silence_hang_ups_and_refusals() {
    // Accepts and never reads: the client's writes stall, then its deadline ends it.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((stream, _)) = silent.accept().await {
            held.push(stream);
        }
    });
    let report = post_bodies_within(addr, false, 2, 512 * MIB, "/", Duration::from_secs(2)).await;
    for client in &report.clients {
        assert_eq!(client.outcome, FloodOutcome::Timeout);
        assert!(client.elapsed >= Duration::from_secs(2));
        assert!(client.elapsed < Duration::from_secs(10));
        assert!(client.body_bytes_sent > 0 && client.body_bytes_sent < 512 * MIB);
    }
    held.abort();

    // Accepts and hangs up at once.
    let rude = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = rude.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = rude.accept().await {
            drop(stream);
        }
    });
    let report = post_bodies(addr, false, 3, 16 * MIB, "/").await;
    for client in &report.clients {
        assert!(
            matches!(client.outcome, FloodOutcome::Closed | FloodOutcome::Reset),
            "{client:?}"
        );
    }

    // Nothing listens.
    let gone = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = gone.local_addr().unwrap();
    drop(gone);
    let report = post_bodies(addr, false, 2, 1024, "/").await;
    assert_eq!(report.count(&FloodOutcome::Refused), 2, "{report:?}");
}

#[tokio::test]
async fn idle_connections_past_a_cap_are_closed() {
    // Keeps the first 10 connections, closes the others as soon as they are accepted, and
    // closes the kept ones when told.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let mut kept = Vec::new();
        while kept.len() < 10 {
            let (stream, _) = listener.accept().await.unwrap();
            kept.push(stream);
        }
        let refuse = async {
            while let Ok((stream, _)) = listener.accept().await {
                drop(stream);
            }
        };
        tokio::select! {
            () = refuse => {}
            _ = released => {}
        }
        drop(kept);
        // The listener stays open (and accepts nothing more) until the test ends.
        std::future::pending::<()>().await;
    });
    let mut idle = idle_connections(addr, 30).await;
    assert_eq!(idle.connected, 30, "{idle:?}");
    assert_eq!((idle.refused, idle.timed_out, idle.failed), (0, 0, 0));
    assert_eq!(idle.closed_by_server, 20);
    assert_eq!(idle.open(), 10);
    // Still open a while later.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(idle.probe(), 10);

    release.send(()).unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(idle.probe(), 0);
    assert_eq!(idle.closed_by_server, 30);

    let gone = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = gone.local_addr().unwrap();
    drop(gone);
    let idle = idle_connections(addr, 5).await;
    assert_eq!((idle.connected, idle.refused), (0, 5));
}

#[test]
fn the_descriptor_limit_is_raised_to_the_hard_limit() {
    let soft = raise_nofile_limit().unwrap();
    let limits = std::fs::read_to_string("/proc/self/limits").unwrap();
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap();
    let words: Vec<&str> = line.split_whitespace().collect();
    let value = |w: &str| {
        if w == "unlimited" {
            u64::MAX
        } else {
            w.parse().unwrap()
        }
    };
    assert_eq!(value(words[3]), soft, "{line}");
    assert_eq!(value(words[4]), soft, "{line}");
    assert_eq!(raise_nofile_limit().unwrap(), soft, "again: the same");
}
