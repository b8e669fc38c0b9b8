//! The binary against the real local API server: leader election between two processes,
//! `/metrics`, the probes, and the conversion webhook with certificate rotation.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::Path,
    process::ExitStatus,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use capm_test_support::{
    TestNamespace,
    pki::CertificateAuthority,
    process::free_port,
    provider::{Launch, Provider},
    wait::eventually,
};
use http_body_util::{BodyExt, Full};
use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::MicroTime,
    jiff::Timestamp,
};
use kube::api::{ObjectMeta, PostParams};
use serde_json::{Value, json};
use tokio::net::TcpStream;
use tokio_rustls::{
    TlsConnector,
    rustls::{
        ClientConfig, RootCertStore,
        crypto::ring,
        pki_types::{CertificateDer, ServerName, pem::PemObject},
    },
};

/// The provider binary: `$CAPM_PROVIDER_BIN` when set (a copy that a concurrent build in a shared
/// target directory cannot replace mid-run, as the end-to-end tests read it), else this build's.
fn bin() -> std::ffi::OsString {
    std::env::var_os("CAPM_PROVIDER_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_cluster-api-provider-mailgun").into())
}
const SECRET: &str = "key-9a8b7c6d5e4f-topsecret";

/// One manager process; killed when dropped.
struct Manager {
    name: String,
    process: Provider,
    metrics: SocketAddr,
    probes: SocketAddr,
}

impl Manager {
    fn start(name: &str, ns: &TestNamespace, dir: &Path, extra: &[&str]) -> Self {
        let (launch, ports) = Launch::new(bin(), ns.control_plane().kubeconfig())
            .on_free_ports()
            .expect("ports");
        let process = launch
            .env("MAILGUN_DOMAIN", "mg.example.com")
            .env("MAILGUN_API_KEY", SECRET)
            .env("MAIL_RECIPIENT", "ops@example.com")
            .env("POD_NAME", name)
            .env("RUST_LOG", "info,cluster_api_provider_mailgun=debug")
            .args([
                "--mailgun-base-url",
                "http://127.0.0.1:9",
                "--namespace",
                &ns.name,
                "--leader-election-namespace",
                &ns.name,
                "--shutdown-timeout",
                "10s",
            ])
            .args(extra)
            .spawn(&dir.join(format!("{name}.log")))
            .expect("start the manager");
        Self {
            name: name.to_owned(),
            process,
            metrics: ports.metrics,
            probes: ports.probes,
        }
    }

    fn logs(&self) -> String {
        self.process.tail(40)
    }

    fn running(&mut self) -> bool {
        self.process.running()
    }

    fn terminate(&self) {
        self.process.terminate().expect("kill -TERM");
    }

    async fn wait_exit(&mut self, within: Duration) -> ExitStatus {
        match self.process.wait_exit(within).await {
            Some(status) => status,
            None => panic!(
                "{} did not exit within {within:?}:\n{}",
                self.name,
                self.logs()
            ),
        }
    }

    async fn metric(&self, name: &str) -> Option<f64> {
        let (status, body) = get(self.metrics, "/metrics").await.ok()?;
        assert_eq!(status, 200);
        check_exposition(&body);
        body.lines()
            .find(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse().ok())
    }
}

impl Manager {
    /// Stops the process and checks what it logged: never the API key. Each test ends with it
    /// (a check in `Drop` would run while a failed test unwinds, and a second panic aborts).
    fn stop(mut self) {
        self.process.kill();
        assert!(
            !self.process.log().contains(SECRET),
            "{} logged the API key",
            self.name
        );
    }
}

async fn request(
    stream: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
    req: http::Request<Full<Bytes>>,
) -> Result<(u16, String), Box<dyn std::error::Error + Send + Sync>> {
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream)).await?;
    tokio::spawn(conn);
    let response = sender.send_request(req).await?;
    let status = response.status().as_u16();
    let body = response.into_body().collect().await?.to_bytes();
    Ok((status, String::from_utf8_lossy(&body).into_owned()))
}

async fn get(
    address: SocketAddr,
    path: &str,
) -> Result<(u16, String), Box<dyn std::error::Error + Send + Sync>> {
    let stream = TcpStream::connect(address).await?;
    let req = http::Request::get(path)
        .header("host", address.to_string())
        .body(Full::new(Bytes::new()))?;
    request(stream, req).await
}

/// A light check of the Prometheus text format: every sample line is `name{labels} value`,
/// every `# TYPE` precedes its samples.
fn check_exposition(body: &str) {
    let mut typed = std::collections::HashSet::new();
    for line in body.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split(' ');
            let name = parts.next().expect("name");
            let kind = parts.next().expect("type");
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{line}"
            );
            typed.insert(name.to_owned());
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        assert!(!line.starts_with('#'), "unexpected comment: {line}");
        let (series, value) = line.rsplit_once(' ').expect("sample has a value");
        assert!(
            value.parse::<f64>().is_ok() || ["+Inf", "-Inf", "NaN"].contains(&value),
            "{line}"
        );
        let name = series.split('{').next().expect("name");
        assert!(
            name.chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "{line}"
        );
        if let Some(labels) = series.strip_prefix(name) {
            assert!(
                labels.is_empty() || (labels.starts_with('{') && labels.ends_with('}')),
                "{line}"
            );
        }
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| typed.contains(*f)))
            .unwrap_or(name);
        assert!(typed.contains(family), "sample before its TYPE: {line}");
    }
}

async fn lease_holder(ns: &TestNamespace, name: &str) -> Option<String> {
    let lease: Lease = ns.api::<Lease>().get_opt(name).await.ok()??;
    lease.spec?.holder_identity.filter(|h| !h.is_empty())
}

const LEASE: &str = "cluster-api-provider-mailgun-leader";

#[tokio::test]
async fn one_leader_hands_over_on_sigterm() {
    let ns = TestNamespace::create_with_crds("capm-cmd-le", &capm_api::crd::crds().expect("crds"))
        .await
        .expect("namespace with CRDs");
    let dir = tempfile::tempdir().expect("tempdir");
    let no_webhook = ["--webhook-port=0"];
    let mut managers = [
        Manager::start("replica-a", &ns, dir.path(), &no_webhook),
        Manager::start("replica-b", &ns, dir.path(), &no_webhook),
    ];

    let holder = eventually(Duration::from_secs(30), "a Lease holder", || {
        lease_holder(&ns, LEASE)
    })
    .await;
    let leader = managers
        .iter()
        .position(|m| holder.starts_with(&format!("{}_", m.name)))
        .unwrap_or_else(|| panic!("holder {holder} is neither replica"));
    let standby = 1 - leader;

    for (i, m) in managers.iter().enumerate() {
        let want = if i == leader { 1.0 } else { 0.0 };
        eventually(
            Duration::from_secs(10),
            &format!("{} leader_election_master_status {want}", m.name),
            || async move {
                (m.metric("leader_election_master_status").await == Some(want)).then_some(())
            },
        )
        .await;
        eventually(
            Duration::from_secs(15),
            &format!("{} /readyz", m.name),
            || async move { matches!(get(m.probes, "/readyz").await, Ok((200, _))).then_some(()) },
        )
        .await;
        assert!(matches!(get(m.probes, "/healthz").await, Ok((200, _))));
        let (_, body) = get(m.metrics, "/metrics").await.expect("metrics");
        assert!(
            body.contains("process_resident_memory_bytes"),
            "process metrics:\n{body}"
        );
    }
    // The leader's controllers run and export controller-runtime's names.
    let m = &managers[leader];
    eventually(
        Duration::from_secs(10),
        "controller metrics on the leader",
        || async move {
            m.metric("controller_runtime_max_concurrent_reconciles")
                .await
                .filter(|v| *v == 10.0)
        },
    )
    .await;
    // Leadership is stable: the standby does not take over while the leader renews.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        managers[leader].running(),
        "the leader exited:\n{}",
        managers[leader].logs()
    );
    assert_eq!(
        lease_holder(&ns, LEASE).await.as_deref(),
        Some(holder.as_str())
    );

    managers[leader].terminate();
    let status = managers[leader].wait_exit(Duration::from_secs(15)).await;
    assert!(
        status.success(),
        "the leader exited with {status}:\n{}",
        managers[leader].logs()
    );
    let released = Instant::now();
    assert!(
        managers[leader]
            .logs()
            .contains("Released the leader Lease"),
        "{}",
        managers[leader].logs()
    );
    let new_holder = eventually(Duration::from_secs(6), "the standby to take over", || {
        let (ns, old) = (&ns, &holder);
        async move { lease_holder(ns, LEASE).await.filter(|h| h != old) }
    })
    .await;
    assert!(
        new_holder.starts_with(&format!("{}_", managers[standby].name)),
        "{new_holder}"
    );
    assert!(released.elapsed() < Duration::from_secs(6));
    let m = &managers[standby];
    eventually(Duration::from_secs(5), "the new leader's gauge", || async move {
        (m.metric("leader_election_master_status").await == Some(1.0)).then_some(())
    })
    .await;

    // Let the new leader's controllers get going: a SIGTERM within milliseconds of
    // `capm_controllers::run` starting is not honoured by `run` yet (reported to its owner).
    tokio::time::sleep(Duration::from_secs(2)).await;
    managers[standby].terminate();
    let status = managers[standby].wait_exit(Duration::from_secs(15)).await;
    assert!(status.success(), "{}", managers[standby].logs());
    assert_eq!(lease_holder(&ns, LEASE).await, None, "released on shutdown");
    for manager in managers {
        manager.stop();
    }
}

/// A Lease another identity holds for an hour keeps the manager a standby: the webhook, metrics
/// and probes are served whatever the controllers do.
async fn hold_lease_elsewhere(ns: &TestNamespace, name: &str) {
    let lease = Lease {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some("someone-else".into()),
            lease_duration_seconds: Some(3600),
            renew_time: Some(MicroTime(Timestamp::now())),
            ..LeaseSpec::default()
        }),
    };
    ns.api::<Lease>()
        .create(&PostParams::default(), &lease)
        .await
        .expect("lease");
}

fn tls_client(ca_pem: &str) -> TlsConnector {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.expect("CA PEM")).expect("CA");
    }
    let config = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("protocols")
        .with_root_certificates(roots)
        .with_no_client_auth();
    TlsConnector::from(Arc::new(config))
}

/// Opens a new TLS connection; returns it and the leaf certificate the server presented.
async fn connect(
    connector: &TlsConnector,
    port: u16,
) -> Option<(
    tokio_rustls::client::TlsStream<TcpStream>,
    CertificateDer<'static>,
)> {
    let tcp = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await.ok()?;
    let name = ServerName::IpAddress(Ipv4Addr::LOCALHOST.into());
    let tls = connector.connect(name, tcp).await.ok()?;
    let leaf = tls
        .get_ref()
        .1
        .peer_certificates()?
        .first()?
        .clone()
        .into_owned();
    Some((tls, leaf))
}

fn write_pair(dir: &Path, cert: &str, key: &str) {
    // Written aside and renamed, as a Secret volume or cert-manager would update them.
    for (name, content) in [("tls.crt", cert), ("tls.key", key)] {
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, content).expect("write");
        std::fs::rename(&tmp, dir.join(name)).expect("rename");
    }
}

fn der(pem: &str) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem.as_bytes()).expect("PEM")
}

#[tokio::test]
async fn webhook_converts_over_tls_and_picks_up_new_certificates() {
    let ns = TestNamespace::create("capm-cmd-hook")
        .await
        .expect("namespace");
    hold_lease_elsewhere(&ns, LEASE).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let certs = dir.path().join("certs");
    std::fs::create_dir(&certs).expect("mkdir");
    let ca = CertificateAuthority::new("capm cmd test CA").expect("CA");
    let first = ca.serving_cert("webhook one", &[], &[]).expect("cert");
    write_pair(&certs, &first.cert_pem, &first.key_pem);
    let port = free_port().expect("port");
    let manager = Manager::start(
        "hook",
        &ns,
        dir.path(),
        &[
            "--webhook-port",
            &port.to_string(),
            "--webhook-cert-dir",
            certs.to_str().expect("utf-8"),
        ],
    );
    let connector = tls_client(ca.cert_pem());
    let (tls, leaf) = eventually(Duration::from_secs(20), "the webhook", || {
        connect(&connector, port)
    })
    .await;
    assert_eq!(leaf, der(&first.cert_pem));

    let review = json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "ConversionReview",
        "request": {
            "uid": "3f0c6a3e-1111-4a4a-9c9c-0123456789ab",
            "desiredAPIVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
            "objects": [{
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1alpha1",
                "kind": "MailgunCluster",
                "metadata": {"name": "hello", "namespace": ns.name},
                "spec": {"priority": "Urgent", "request": "One cluster please.",
                         "requester": "admin@example.com"},
            }],
        },
    });
    let req = http::Request::post("/convert")
        .header("host", format!("127.0.0.1:{port}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(review.to_string())))
        .expect("request");
    let (status, body) = request(tls, req).await.expect("POST /convert");
    assert_eq!(status, 200, "{body}");
    let out: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(
        out["response"]["uid"],
        "3f0c6a3e-1111-4a4a-9c9c-0123456789ab"
    );
    assert_eq!(out["response"]["result"]["status"], "Success", "{out}");
    let converted = &out["response"]["convertedObjects"][0];
    assert_eq!(
        converted["apiVersion"],
        "infrastructure.cluster.x-k8s.io/v1beta1"
    );
    assert_eq!(converted["metadata"]["name"], "hello");

    let second = ca.serving_cert("webhook two", &[], &[]).expect("cert");
    write_pair(&certs, &second.cert_pem, &second.key_pem);
    let want = der(&second.cert_pem);
    eventually(Duration::from_secs(5), "the new certificate", || {
        let (connector, want) = (&connector, &want);
        async move {
            let (_, leaf) = connect(connector, port).await?;
            (leaf == *want).then_some(())
        }
    })
    .await;

    // The standby serves metrics in Prometheus text format, with the controller-runtime names
    // registered by this process.
    let (status, body) = get(manager.metrics, "/metrics").await.expect("metrics");
    assert_eq!(status, 200);
    check_exposition(&body);
    assert!(
        body.contains(
            "leader_election_master_status{name=\"cluster-api-provider-mailgun-leader\"} 0"
        ),
        "{body}"
    );
    let (status, _) = get(manager.metrics, "/nope").await.expect("404");
    assert_eq!(status, 404);
    manager.stop();
}

/// Like controller-runtime: a leader whose Lease is taken stops its controllers and exits
/// non-zero (its Deployment restarts it as a standby).
#[tokio::test]
async fn a_leader_that_loses_the_lease_exits_non_zero() {
    let ns =
        TestNamespace::create_with_crds("capm-cmd-lost", &capm_api::crd::crds().expect("crds"))
            .await
            .expect("namespace with CRDs");
    let dir = tempfile::tempdir().expect("tempdir");
    let mut manager = Manager::start("solo", &ns, dir.path(), &["--webhook-port=0"]);
    eventually(Duration::from_secs(30), "leadership", || {
        let ns = &ns;
        async move {
            lease_holder(ns, LEASE)
                .await
                .filter(|h| h.starts_with("solo_"))
        }
    })
    .await;

    let api = ns.api::<Lease>();
    let mut lease = api.get(LEASE).await.expect("lease");
    let spec = lease.spec.get_or_insert_with(LeaseSpec::default);
    spec.holder_identity = Some("thief".into());
    spec.lease_duration_seconds = Some(3600);
    spec.renew_time = Some(MicroTime(Timestamp::now()));
    api.replace(LEASE, &PostParams::default(), &lease)
        .await
        .expect("take the lease");

    let status = manager.wait_exit(Duration::from_secs(15)).await;
    let logs = manager.logs();
    assert_eq!(status.code(), Some(1), "{logs}");
    assert!(
        logs.contains("leader election lost: the Lease is now held by thief"),
        "{logs}"
    );
    assert_eq!(
        lease_holder(&ns, LEASE).await.as_deref(),
        Some("thief"),
        "not released"
    );
    manager.stop();
}
