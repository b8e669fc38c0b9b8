//! The real binary as a child process of a test, and what the tests of this folder ask of it
//! (its metrics, probes, memory, logs), shared by `exactly_once.rs`, `peers.rs` and `upgrade.rs`.
// Each test crate uses its own part of this module.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use capm_api::{
    names,
    v1beta1::{MailgunCluster, MailgunMachine, MailgunRemediation},
};
use capm_mail_servers::{MailgunServer, SmtpServer};
use capm_test_support::{TestNamespace, provider};
use kube::{
    Api, ResourceExt,
    api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams},
};
use serde_json::json;

/// The provider binary: `$CAPM_PROVIDER_BIN` when set (a copy that a concurrent build in a shared
/// target directory cannot replace mid-run, as the end-to-end tests read it), else this build's.
pub fn bin() -> std::ffi::OsString {
    std::env::var_os("CAPM_PROVIDER_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_cluster-api-provider-mailgun").into())
}
pub const DOMAIN: &str = "mg.example.com";
pub const KEY: &str = "key-exactly-once";

pub async fn namespace(prefix: &str) -> TestNamespace {
    TestNamespace::create_with_crds(prefix, &capm_api::crd::crds().unwrap())
        .await
        .unwrap()
}

/// Where the provider sends its mail.
pub enum Backend<'a> {
    Mailgun(&'a MailgunServer),
    /// A server speaking plain SMTP at this URL (a real one, or a relay in front of it).
    Smtp(&'a SmtpServer),
    SmtpUrl(String),
}

/// How to start one provider process.
#[derive(Default)]
pub struct Launch<'a> {
    /// `CAPM_FAILPOINT` (crash or freeze at a step).
    pub failpoint: Option<&'a str>,
    /// `CAPM_FAILPOINT_FILE`: a freeze armed later, by writing `<step>:stop` into this file.
    pub failpoint_file: Option<&'a Path>,
    pub leader_elect: bool,
    /// More flags.
    pub args: Vec<String>,
    /// `RUST_LOG`; a default that shows sends when absent.
    pub log_filter: Option<&'a str>,
    /// Start under `prlimit --nofile=<soft>:<hard>` (as a container runtime sets it).
    pub nofile: Option<(u64, u64)>,
}

pub struct Provider {
    process: provider::Provider,
    pub metrics: SocketAddr,
    pub probes: SocketAddr,
    _config: Option<tempfile::NamedTempFile>,
    /// The process's output (its logs).
    _log: tempfile::NamedTempFile,
}

impl Provider {
    pub fn start(
        ns: &TestNamespace,
        backend: &Backend<'_>,
        failpoint: Option<&str>,
        leader_elect: bool,
    ) -> Self {
        Self::launch(
            ns,
            backend,
            &Launch {
                failpoint,
                leader_elect,
                ..Launch::default()
            },
        )
    }

    pub fn launch(ns: &TestNamespace, backend: &Backend<'_>, launch: &Launch<'_>) -> Self {
        let mut config_file = None;
        let (mut cmd, ports) = provider::Launch::new(bin(), ns.control_plane().kubeconfig())
            .on_free_ports()
            .unwrap();
        if let Some((soft, hard)) = launch.nofile {
            cmd = cmd.under([
                "prlimit".to_owned(),
                format!("--nofile={soft}:{hard}"),
                "--".to_owned(),
            ]);
        }
        cmd = cmd
            .env("MAIL_RECIPIENT", "ops@example.com")
            .env(
                "RUST_LOG",
                launch
                    .log_filter
                    .unwrap_or("warn,capm_controllers::sendonce::execute=info"),
            )
            .args([
                "--namespace",
                &ns.name,
                "--leader-election-namespace",
                &ns.name,
            ])
            .args(["--shutdown-timeout", "10s"])
            .arg(format!("--leader-elect={}", launch.leader_elect));
        if !launch.args.iter().any(|a| a.starts_with("--webhook-port")) {
            cmd = cmd.args(["--webhook-port", "0"]);
        }
        let smtp_url = match backend {
            Backend::Mailgun(server) => {
                cmd = cmd
                    .env("MAILGUN_DOMAIN", DOMAIN)
                    .env("MAILGUN_API_KEY", KEY)
                    .args(["--mailgun-base-url", &server.base_url()]);
                None
            }
            Backend::Smtp(server) => Some(server.url()),
            Backend::SmtpUrl(url) => Some(url.clone()),
        };
        if let Some(url) = smtp_url {
            // The test relay speaks plain SMTP; the binary's default is STARTTLS required.
            let file = tempfile::Builder::new().suffix(".json").tempfile().unwrap();
            let config = json!({
                "mailer": { "smtp": { "url": url, "starttls": "never" } },
                "mailFrom": format!("capm@{DOMAIN}"),
            });
            std::fs::write(file.path(), config.to_string()).unwrap();
            cmd = cmd
                .arg("--config")
                .arg(file.path())
                .args(["--message-id-domain", DOMAIN]);
            config_file = Some(file);
        }
        cmd = cmd.args(&launch.args);
        if let Some(step) = launch.failpoint {
            cmd = cmd.env("CAPM_FAILPOINT", step);
        }
        if let Some(file) = launch.failpoint_file {
            cmd = cmd.env("CAPM_FAILPOINT_FILE", file);
        }
        let log = tempfile::Builder::new().suffix(".log").tempfile().unwrap();
        let process = cmd.spawn(log.path()).unwrap();
        Self {
            process,
            metrics: ports.metrics,
            probes: ports.probes,
            _config: config_file,
            _log: log,
        }
    }

    pub fn pid(&self) -> u32 {
        self.process.pid()
    }

    /// What the process has logged so far.
    pub fn stderr_log(&self) -> String {
        self.process.log()
    }

    pub fn log_path(&self) -> PathBuf {
        self.process.log_path().to_owned()
    }

    /// How the process ended, if it ends within `within` (`None` when it still runs).
    pub async fn wait_exit(&mut self, within: Duration) -> Option<std::process::ExitStatus> {
        self.process.wait_exit(within).await
    }

    /// Waits (60 s) for the process to end on its own (a failpoint aborts it).
    pub async fn wait_for_crash(&mut self) {
        self.wait_for_crash_within(Duration::from_secs(60)).await;
    }

    /// Waits for the process to end on its own (a failpoint aborts it).
    pub async fn wait_for_crash_within(&mut self, within: Duration) {
        let status = self.process.wait_exit(within).await;
        let status = status.unwrap_or_else(|| {
            panic!("the provider did not reach its failpoint within {within:?}")
        });
        assert!(!status.success(), "the failpoint aborts: {status}");
    }

    /// Whether the process still runs.
    pub fn alive(&mut self) -> bool {
        self.process.running()
    }

    /// The status code of `GET <path>` on the probes port, if it answers within 5 s.
    pub fn probe(&self, path: &str) -> Option<u16> {
        let (status, _) = http_get(self.probes, path)?;
        Some(status)
    }

    /// Sum of a metric's samples whose line contains every one of `labels`, from the
    /// provider's /metrics.
    pub fn metric_with(&self, name: &str, labels: &[&str]) -> f64 {
        let Some((_, text)) = http_get(self.metrics, "/metrics") else {
            return 0.0;
        };
        text.lines()
            .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
            .filter(|l| labels.iter().all(|label| l.contains(label)))
            .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
            .sum()
    }

    /// Sum of a metric's samples, from the provider's /metrics.
    pub fn metric(&self, name: &str) -> f64 {
        self.metric_with(name, &[])
    }

    /// Polls `name` until it reaches `floor` (or 30 s pass) and returns the last value seen.
    pub async fn wait_metric_at_least(&self, name: &str, floor: f64) -> f64 {
        let mut value = self.metric(name);
        for _ in 0..300 {
            if value >= floor {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
            value = self.metric(name);
        }
        value
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        self.process.kill();
        if std::thread::panicking() {
            eprintln!("--- provider log ---\n{}", self.stderr_log());
        }
    }
}

/// `GET path` over HTTP/1.0: the status and the body, or `None` when nothing answers within 5 s.
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n").ok()?;
    let mut text = String::new();
    stream.read_to_string(&mut text).ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Some((status, body))
}

/// The namespace's objects of `kind` in `group`/`version`, and the kind's resource.
fn dynamic(ns: &TestNamespace, gvk: [&str; 3]) -> (Api<DynamicObject>, ApiResource) {
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(gvk[0], gvk[1], gvk[2]));
    (Api::namespaced_with(ns.client.clone(), &ns.name, &ar), ar)
}

/// A Cluster and its MailgunCluster, owner reference set as Cluster API does.
pub async fn create_pair(ns: &TestNamespace, name: &str) -> MailgunCluster {
    let (clusters, ar) = dynamic(ns, ["cluster.x-k8s.io", "v1beta2", "Cluster"]);
    let cluster = DynamicObject::new(name, &ar).data(json!({ "spec": {
        "infrastructureRef": { "apiGroup": capm_api::GROUP, "kind": "MailgunCluster", "name": name }
    }}));
    let cluster = clusters
        .create(&PostParams::default(), &cluster)
        .await
        .unwrap();
    let mgc: MailgunCluster = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
        "kind": "MailgunCluster",
        "metadata": { "name": name, "ownerReferences": [{
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster", "name": name,
            "uid": cluster.metadata.uid, "controller": true
        }]},
        "spec": { "priority": "Urgent", "request": "One cluster please.", "requester": "dev@example.com" }
    }))
    .unwrap();
    ns.api::<MailgunCluster>()
        .create(&PostParams::default(), &mgc)
        .await
        .unwrap()
}

/// A Machine `name` that was built (its `MailgunMachine` has a provider ID, and no owner: it
/// mails nothing) and is unhealthy by the condition a MachineHealthCheck writes, and the
/// `MailgunRemediation` the health check makes for it (same name, an ownerReference to it):
/// the provider owes its repair mail at once and reminder 1 an `answer_timeout` after it (1m
/// is the shortest the CRD allows). No Cluster: none is needed for the mails.
pub async fn create_remediation(
    ns: &TestNamespace,
    name: &str,
    answer_timeout: &str,
) -> MailgunRemediation {
    let labels = json!({ names::CLUSTER_NAME_LABEL: "c1" });
    let infra: MailgunMachine = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunMachine",
        "metadata": { "name": name, "labels": labels },
        "spec": { "priority": "Urgent", "request": "r", "requester": "dev@example.com",
                  "providerID": format!("metal://rack-1/{name}") },
    }))
    .unwrap();
    let pp = PostParams::default();
    ns.api::<MailgunMachine>()
        .create(&pp, &infra)
        .await
        .unwrap();
    let (machines, ar) = dynamic(ns, ["cluster.x-k8s.io", "v1beta2", "Machine"]);
    let mut machine = DynamicObject::new(name, &ar).data(json!({
        "spec": { "clusterName": "c1", "bootstrap": {},
                  "infrastructureRef": { "apiGroup": capm_api::GROUP, "kind": "MailgunMachine", "name": name } },
    }));
    machine.metadata.labels = serde_json::from_value(labels.clone()).unwrap();
    let machine = machines.create(&pp, &machine).await.unwrap();
    let unhealthy = json!({ "status": { "conditions": [{
        "type": "HealthCheckSucceeded", "status": "False", "reason": "UnhealthyNode",
        "message": "Condition Ready on Node is reporting status False for more than 1s",
        "lastTransitionTime": "2026-11-29T08:00:00Z",
    }]}});
    machines
        .patch_status(name, &PatchParams::default(), &Patch::Merge(unhealthy))
        .await
        .unwrap();
    let remediation: MailgunRemediation = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunRemediation",
        "metadata": { "name": name, "labels": labels, "ownerReferences": [{
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine", "name": name,
            "uid": machine.metadata.uid,
        }]},
        "spec": { "request": "Power-cycle it.", "strategy": { "answerTimeout": answer_timeout, "reminders": 1 } },
    }))
    .unwrap();
    ns.api::<MailgunRemediation>()
        .create(&pp, &remediation)
        .await
        .unwrap()
}

/// The annotations of our object `name` of `kind` (`None`: it is gone).
pub async fn annotations_of(
    ns: &TestNamespace,
    kind: &str,
    name: &str,
) -> Option<std::collections::BTreeMap<String, String>> {
    let (api, _) = dynamic(ns, [capm_api::GROUP, "v1beta1", kind]);
    let obj = api.get_opt(name).await.unwrap()?;
    Some(obj.annotations().clone())
}

/// Waits (60 s) until `name` carries the durable sent record.
pub async fn wait_recorded(ns: &TestNamespace, name: &str) -> MailgunCluster {
    wait_recorded_within(ns, name, Duration::from_secs(60)).await
}

/// Waits until `name` carries the durable sent record.
pub async fn wait_recorded_within(
    ns: &TestNamespace,
    name: &str,
    within: Duration,
) -> MailgunCluster {
    poll_object(ns, name, within, |obj| {
        names::request_recorded_sent(obj.annotations())
    })
    .await
    .unwrap_or_else(|_| panic!("{name} was not recorded as sent within {within:?}"))
}

/// Reads `name` every 100 ms until `check` accepts it: `Ok` with that object, or `Err` with the
/// last one read once `within` has passed (for the caller's message).
pub async fn poll_object(
    ns: &TestNamespace,
    name: &str,
    within: Duration,
    check: impl Fn(&MailgunCluster) -> bool,
) -> Result<MailgunCluster, Box<MailgunCluster>> {
    let api = ns.api::<MailgunCluster>();
    let deadline = Instant::now() + within;
    loop {
        let obj = api.get(name).await.unwrap();
        if check(&obj) {
            return Ok(obj);
        }
        if Instant::now() >= deadline {
            return Err(Box::new(obj));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

pub fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {sig} {pid}");
}

/// The Message-Ids the backend has, one per copy.
pub fn delivered(backend: &Backend<'_>) -> Vec<String> {
    match backend {
        Backend::Mailgun(server) => server
            .messages()
            .unwrap()
            .into_iter()
            .map(|m| m.id)
            .collect(),
        Backend::Smtp(server) => server
            .messages()
            .unwrap()
            .iter()
            .map(|m| {
                m.header("Message-ID")
                    .or(m.header("Message-Id"))
                    .unwrap_or_default()
                    .to_owned()
            })
            .collect(),
        Backend::SmtpUrl(_) => panic!("ask the server behind the relay"),
    }
}
