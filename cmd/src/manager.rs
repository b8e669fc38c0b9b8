//! The process's one manager: its servers ([`Manager::add_server`]) and tasks
//! ([`Manager::add_task`]) under one [`CancellationToken`], cancelled by the first SIGTERM or
//! SIGINT (a second one ends the process at once with status 1, as controller-runtime does) or
//! by the first task that fails (a lost leader Lease is such a failure). Then the servers stop
//! accepting and finish their open requests, and the tasks get the shutdown timeout to return.
//!
//! `kubert` (linkerd's runtime) was considered and not used: it builds on kube 1.1,
//! k8s-openapi 0.25 and prometheus-client (this tree: kube 5, k8s-openapi 0.29, prometheus), so
//! its client and registry are not ours; its admin server is plain HTTP with fixed `/ready` and
//! `/live` routes and an unbounded task per connection (no TLS, no TokenReview on `/metrics`, no
//! connection cap or header deadline); its shutdown is a `drain` channel on signals only, not a
//! failed task or a lost Lease; its Lease task publishes a `Claim` on a watch channel (a standby
//! waits for the claim it read to expire; the holder retries its renewal within a grace period,
//! not client-go's renew deadline), with no gate the mailer could check at its commit point.

use std::{future::Future, net::SocketAddr, time::Duration};

use anyhow::anyhow;
use prometheus::{IntCounterVec, Registry};
use tokio::task::{JoinHandle, JoinSet};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::server::{self, Endpoint};

/// How long a server may take to finish its open requests after shutdown.
const SERVER_GRACE: Duration = Duration::from_secs(5);

/// The servers and tasks of one process.
pub struct Manager {
    stop: CancellationToken,
    max_connections: usize,
    rejected: IntCounterVec,
    servers: Vec<JoinHandle<()>>,
    tasks: JoinSet<(&'static str, anyhow::Result<()>)>,
}

impl Manager {
    /// A manager for at most `servers` servers, which share the open files limit (raised to its
    /// hard limit first) equally; their refusals are counted in `registry`.
    ///
    /// # Errors
    /// When the signal handlers cannot be installed or the counter is already registered.
    pub fn new(registry: &Registry, servers: u64) -> anyhow::Result<Self> {
        let stop = CancellationToken::new();
        on_signals(stop.clone())?;
        let (open_files, raise_error) = server::raise_open_files_limit();
        if let Some(e) = raise_error {
            warn!(error = %e, open_files, "Could not raise the open files limit to its hard limit");
        }
        let max_connections = server::connection_cap(open_files, servers);
        info!(
            open_files,
            connections_per_server = max_connections,
            "Open files limit"
        );
        Ok(Self {
            stop,
            max_connections,
            rejected: server::rejected_counter(registry)?,
            servers: Vec::new(),
            tasks: JoinSet::new(),
        })
    }

    /// Binds `bind` and serves `endpoint` there (over `tls` when given) until shutdown.
    ///
    /// # Errors
    /// When the address cannot be bound.
    pub async fn add_server(
        &mut self,
        name: &'static str,
        bind: SocketAddr,
        tls: Option<TlsAcceptor>,
        endpoint: Endpoint,
    ) -> anyhow::Result<()> {
        let listener = server::bind(name, bind).await?;
        let server = server::Server {
            name,
            listener,
            tls,
            max_connections: self.max_connections,
            rejected: self.rejected.clone(),
        };
        self.servers
            .push(server::serve(server, endpoint, self.stop.clone()));
        Ok(())
    }

    /// Runs `task` with the manager's token: it should return when the token fires. An error
    /// (before or after) stops the process with it.
    pub fn add_task<F, Fut>(&mut self, name: &'static str, task: F)
    where
        F: FnOnce(CancellationToken) -> Fut,
        Fut: Future<Output = anyhow::Result<()>> + Send + 'static,
    {
        let run = task(self.stop.clone());
        self.tasks.spawn(async move { (name, run.await) });
    }

    /// Runs until shutdown is asked for or a task fails, then stops everything: the tasks within
    /// `timeout`, the servers within [`SERVER_GRACE`]. `Ok` after a clean shutdown.
    ///
    /// # Errors
    /// The first task's failure, or tasks that did not stop within `timeout`.
    pub async fn run(mut self, timeout: Duration) -> anyhow::Result<()> {
        let mut failure = None;
        loop {
            tokio::select! {
                () = self.stop.cancelled() => break,
                Some(joined) = self.tasks.join_next() => {
                    if let Some(e) = failed(joined) {
                        failure = Some(e);
                        break;
                    }
                }
            }
        }
        self.stop.cancel();
        let stopping = async {
            while let Some(joined) = self.tasks.join_next().await {
                if let Some(e) = failed(joined) {
                    failure.get_or_insert(e);
                }
            }
        };
        if tokio::time::timeout(timeout + SERVER_GRACE, stopping)
            .await
            .is_err()
        {
            self.tasks.abort_all();
            failure.get_or_insert(anyhow!(
                "the process did not stop within the shutdown timeout ({timeout:?})"
            ));
        }
        for server in self.servers {
            let _ = tokio::time::timeout(SERVER_GRACE, server).await;
        }
        failure.map_or(Ok(()), Err)
    }
}

/// A task's failure, if it failed.
fn failed(
    joined: Result<(&'static str, anyhow::Result<()>), tokio::task::JoinError>,
) -> Option<anyhow::Error> {
    match joined {
        Ok((_, Ok(()))) => None,
        Ok((name, Err(e))) => {
            error!(task = name, error = %format!("{e:#}"), "A task failed; stopping");
            Some(e)
        }
        Err(e) => Some(anyhow!("a task panicked or was aborted: {e}")),
    }
}

/// Cancels `stop` on the first SIGTERM or SIGINT; a second one ends the process at once with
/// status 1.
fn on_signals(stop: CancellationToken) -> anyhow::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        let name = tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        };
        info!(signal = name, "Shutting down");
        stop.cancel();
        tokio::select! {
            _ = term.recv() => {},
            _ = int.recv() => {},
        }
        warn!("Second signal: exiting immediately");
        std::process::exit(1);
    });
    Ok(())
}
