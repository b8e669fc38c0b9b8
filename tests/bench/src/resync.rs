//! The resync: a subject restarted over its finished backlog, timed until it has reconciled
//! every object once (its `controller_runtime_reconcile_total`), with the writes it made.

use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use capm_mail_servers::MailgunServer;
use capm_test_support::ControlPlane;
use kube::Client;

use crate::{
    Args, Subject, Writes, api_writes, label, proc_cpu_seconds, proc_status_mib, profile, spawn,
};

/// What a restart over the recorded backlog costs.
pub(crate) struct Resync {
    /// From the process's start until its `controller_runtime_reconcile_total` for the
    /// MailgunCluster controller reached N (each object reconciled once).
    pub(crate) secs: f64,
    /// Writes to our objects from the restart until 5 s after that.
    pub(crate) writes: Writes,
    /// Peak RSS of the restarted process.
    pub(crate) peak_rss: f64,
    /// From the start until the first reconcile had finished (caches listed).
    pub(crate) first_secs: f64,
    /// The subject's own CPU seconds until the pass was complete.
    pub(crate) own_cpu: f64,
    /// The API server's CPU seconds over the same time.
    pub(crate) server_cpu: f64,
    /// Single-object reads (`GET` of a resource) the API server answered over the same time:
    /// what the reconciles of finished objects asked beyond their caches.
    pub(crate) gets: f64,
}

/// Restarts the subject over its backlog, all of it done, and times its first pass.
pub(crate) async fn resync(
    cp: &ControlPlane,
    client: &Client,
    subject: Subject,
    args: &Args,
    mailgun: &MailgunServer,
) -> anyhow::Result<Resync> {
    let port = capm_test_support::process::free_port()?;
    let before = api_writes(client).await?;
    let server_before = profile::server_counters(client).await?;
    let started = Instant::now();
    let mut child = spawn(subject, args, mailgun, cp.kubeconfig(), Some(port))?;
    let pid = child.id().context("pid")?;
    let n = args.objects as f64;
    let mut first = None;
    let secs = loop {
        if let Some(status) = child.try_wait()? {
            bail!("the {} exited during the resync: {status}", subject.label());
        }
        if started.elapsed() > Duration::from_secs(600) {
            bail!("{}: no full pass 600 s after the restart", subject.label());
        }
        let done = reconciles(port).await;
        if first.is_none() && done.is_some_and(|r| r > 0.0) {
            first = Some(started.elapsed().as_secs_f64());
        }
        if done.is_some_and(|r| r >= n) {
            break started.elapsed().as_secs_f64();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let own_cpu = proc_cpu_seconds(pid).unwrap_or(f64::NAN);
    let server = profile::server_counters(client).await? - server_before;
    let gets = server
        .latency
        .iter()
        .filter(|(kind, _)| kind.starts_with("GET ") && kind.len() > "GET ".len())
        .fold(0.0, |sum, (_, (_, count))| sum + count);
    tokio::time::sleep(Duration::from_secs(5)).await;
    let writes = api_writes(client).await? - before;
    let peak_rss = proc_status_mib(pid, "VmHWM").unwrap_or(f64::NAN);
    child.kill().await.ok();
    child.wait().await.ok();
    Ok(Resync {
        secs,
        first_secs: first.unwrap_or(f64::NAN),
        writes,
        peak_rss,
        own_cpu,
        server_cpu: server.cpu_seconds,
        gets,
    })
}

/// The sum of `controller_runtime_reconcile_total` for the MailgunCluster controller (both
/// subjects name it `mailguncluster`), read from plain-HTTP metrics on `port`.
/// The provider's MailgunCluster reconciles and its API client's requests so far.
pub(crate) async fn own_counters(port: u16) -> Option<(f64, f64)> {
    let text = scrape(port).await?;
    let requests = text
        .lines()
        .filter(|l| l.starts_with("rest_client_requests_total{"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    Some((reconciles_in(&text), requests))
}

async fn scrape(port: u16) -> Option<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    stream
        .write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await
        .ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).await.ok()?;
    Some(text)
}

fn reconciles_in(text: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with("controller_runtime_reconcile_total{"))
        .filter(|l| label(l, "controller").eq_ignore_ascii_case("mailguncluster"))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

async fn reconciles(port: u16) -> Option<f64> {
    Some(reconciles_in(&scrape(port).await?))
}
