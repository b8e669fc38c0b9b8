//! Helpers for the end-to-end tests: Helm, the provider binary run the way the chart runs it,
//! the Cluster API core manager, service-account kubeconfigs, Prometheus, the API server's
//! audit log. Every process is started on loopback and stopped when its handle drops.

use std::{
    fs,
    io::{Read, Write},
    net::{IpAddr, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use capm_test_support::{ControlPlane, Options, process};

pub mod browser;
pub mod cert_manager;
pub mod clusterctl;
pub mod ledger;
pub mod monitoring;
pub mod pods;
mod provider;
pub mod release;
pub mod remediation;
pub mod topology;

pub use provider::{
    CHART_NAMESPACE, ChartProvider, FULLNAME, RELEASE, fulfil_command, install_chart_and_provider,
    mailgun_values, refresh_secret_mounts, route_webhook_service, start_chart_provider,
    start_routed_chart_provider,
};

/// The provider's ServiceAccount (the chart's, in [`CHART_NAMESPACE`]) as the API server names
/// it.
pub fn provider_username() -> String {
    format!("system:serviceaccount:{CHART_NAMESPACE}:{FULLNAME}")
}

/// What a Mailgun contract server stored, as the ledger reads it (arrival order from 1), each
/// with its text body.
///
/// # Errors
/// When the server cannot be asked.
pub fn mailgun_mails(
    server: &capm_mail_servers::MailgunServer,
) -> Result<Vec<(ledger::Received, String)>> {
    Ok(server
        .messages()?
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            (
                ledger::Received {
                    seq: i + 1,
                    message_id: m.id,
                    subject: m.subject,
                },
                m.text.unwrap_or_default(),
            )
        })
        .collect())
}

/// The ledger of everything a Mailgun contract server stored, whose Message-Ids are under
/// `domain`.
///
/// # Errors
/// When the server cannot be asked.
pub fn mailgun_ledger(
    server: &capm_mail_servers::MailgunServer,
    domain: &str,
) -> Result<ledger::Ledger> {
    let mails: Vec<_> = mailgun_mails(server)?.into_iter().map(|(r, _)| r).collect();
    Ok(ledger::Ledger::build(
        ledger::Backend::Mailgun,
        domain,
        &mails,
    ))
}

/// The chart, relative to this crate.
pub fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/cluster-api-provider-mailgun")
}

/// `helm <verb> <release> <this project's chart> -n <namespace> -f <values> <extra...>`, the verb
/// `install` or `upgrade`.
///
/// # Errors
/// As [`helm`].
pub fn helm_chart(
    kubeconfig: &Path,
    verb: &str,
    release: &str,
    namespace: &str,
    values: &Path,
    extra: &[&str],
) -> Result<String> {
    let (chart, values) = (chart_dir(), values.to_string_lossy());
    let chart = chart.to_string_lossy();
    let mut args = vec![verb, release, &chart, "-n", namespace, "-f", &values];
    args.extend_from_slice(extra);
    helm(Some(kubeconfig), &args)
}

/// Runs `helm` (the one `make tools` built) against `kubeconfig` (or none) and returns stdout.
///
/// # Errors
/// When Helm is missing or exits non-zero; the error carries its stderr.
pub fn helm(kubeconfig: Option<&Path>, args: &[&str]) -> Result<String> {
    let mut cmd = Command::new(process::binary("helm")?);
    // Helm's caches and config in a throw-away place: nothing from the user's ~/.config.
    let home = std::env::temp_dir().join("capm-e2e-helm");
    cmd.env("HELM_CACHE_HOME", home.join("cache"))
        .env("HELM_CONFIG_HOME", home.join("config"))
        .env("HELM_DATA_HOME", home.join("data"))
        .env_remove("KUBECONFIG")
        .args(args);
    if let Some(kubeconfig) = kubeconfig {
        cmd.env("KUBECONFIG", kubeconfig);
    }
    run(&mut cmd, &format!("helm {}", args.join(" ")))
}

/// Runs a command, returning stdout; a non-zero exit is an error carrying stderr.
///
/// # Errors
/// When it cannot start or fails.
pub fn run(cmd: &mut Command, what: &str) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {what}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            stdout
        );
    }
    Ok(stdout)
}

/// Like [`run`] with `input` on stdin.
///
/// # Errors
/// When it cannot start or fails.
pub fn run_with_input(cmd: &mut Command, input: &str, what: &str) -> Result<String> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {what}"))?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(input.as_bytes())?;
    let out = child.wait_with_output()?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{what} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr),
            stdout
        );
    }
    Ok(stdout)
}

/// The provider binary from this workspace's build (`make test` builds it first).
///
/// # Errors
/// When it has not been built.
pub fn provider_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("CAPM_PROVIDER_BIN") {
        return Ok(PathBuf::from(path));
    }
    // Test executables live in target/<profile>/deps; binaries one level up.
    let exe = std::env::current_exe()?;
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .context("locating the target directory")?;
    let bin = profile_dir.join("cluster-api-provider-mailgun");
    ensure!(
        bin.is_file(),
        "{} not found: build it with `cargo build -p cluster-api-provider-mailgun` \
         (make test does) or set CAPM_PROVIDER_BIN",
        bin.display()
    );
    Ok(bin)
}

/// A child process stopped (SIGTERM, then SIGKILL) when dropped, with its output in a log file.
#[derive(Debug)]
pub struct Proc {
    name: String,
    child: std::sync::Mutex<Child>,
    log: PathBuf,
}

impl Proc {
    /// Spawns `cmd`, stdout and stderr to `log`.
    ///
    /// # Errors
    /// When it cannot start.
    pub fn spawn(name: &str, mut cmd: Command, log: PathBuf) -> Result<Self> {
        let file = fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(file.try_clone()?)
            .stderr(file)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        Ok(Self {
            name: name.to_owned(),
            child: std::sync::Mutex::new(child),
            log,
        })
    }

    /// The log so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines of the log.
    pub fn tail(&self, n: usize) -> String {
        process::tail(&self.log, n)
    }

    /// Fails when the process has exited.
    ///
    /// # Errors
    /// When it exited, with the end of its log.
    pub fn check_alive(&self) -> Result<()> {
        let status = self.child().try_wait()?;
        if let Some(status) = status {
            bail!("{} exited ({status}); log:\n{}", self.name, self.tail(30));
        }
        Ok(())
    }

    /// `Some(status)` once the process has exited.
    pub fn exit_status(&self) -> Option<std::process::ExitStatus> {
        self.child().try_wait().ok().flatten()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child().id()
    }

    /// Sends `signal` (a name `kill` knows: `STOP`, `CONT`, `KILL`, ...) to the process.
    ///
    /// # Errors
    /// When `kill` cannot be run or fails (the process is gone).
    pub fn signal(&self, signal: &str) -> Result<()> {
        let pid = self.pid().to_string();
        run(
            Command::new("kill").args([&format!("-{signal}"), &pid]),
            &format!("kill -{signal} {pid}"),
        )
        .map(drop)
    }

    /// SIGKILL now (a crash, no shutdown) and reap it.
    pub fn kill_now(&self) {
        let mut child = self.child();
        let _ = child.kill();
        let _ = child.wait();
    }

    /// SIGTERM, wait up to `grace`, then SIGKILL. Returns whether it exited by itself in time
    /// with status 0.
    pub fn terminate(&self, grace: Duration) -> bool {
        let mut child = self.child();
        if child.try_wait().ok().flatten().is_some() {
            return false;
        }
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = child.try_wait() {
                return status.success();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
        false
    }

    fn child(&self) -> std::sync::MutexGuard<'_, Child> {
        self.child
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.terminate(Duration::from_secs(5));
    }
}

/// Creates the namespace `name`; `restricted`: labelled to enforce Pod Security "restricted", as
/// a user installing the chart would.
pub async fn create_namespace(client: &kube::Client, name: &str, restricted: bool) -> Result<()> {
    use k8s_openapi::{api::core::v1::Namespace, apimachinery::pkg::apis::meta::v1::ObjectMeta};
    let labels = restricted.then(|| {
        [(
            "pod-security.kubernetes.io/enforce".to_owned(),
            "restricted".to_owned(),
        )]
        .into()
    });
    let ns = Namespace {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels,
            ..ObjectMeta::default()
        },
        ..Namespace::default()
    };
    kube::Api::<Namespace>::all(client.clone())
        .create(&kube::api::PostParams::default(), &ns)
        .await
        .with_context(|| format!("creating namespace {name}"))?;
    Ok(())
}

/// The API of any namespaced kind, by group, version and kind.
pub fn dynamic_api(
    client: &kube::Client,
    namespace: &str,
    group: &str,
    version: &str,
    kind: &str,
) -> kube::Api<kube::api::DynamicObject> {
    let gvk = kube::api::GroupVersionKind::gvk(group, version, kind);
    kube::Api::namespaced_with(
        client.clone(),
        namespace,
        &kube::api::ApiResource::from_gvk(&gvk),
    )
}

/// An object of any kind: its name and namespace, and `spec`.
///
/// # Errors
/// When the pieces do not make an object.
pub fn dynamic_object(
    api_version: &str,
    kind: &str,
    namespace: &str,
    name: &str,
    spec: serde_json::Value,
) -> Result<kube::api::DynamicObject> {
    Ok(serde_json::from_value(serde_json::json!({
        "apiVersion": api_version,
        "kind": kind,
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }))?)
}

/// Creates an object of any namespaced kind from its `spec` ([`dynamic_api`],
/// [`dynamic_object`]); the error names the kind and the name. The future owns what it needs, so
/// a closure over the client and namespace can return it.
pub fn create_object(
    client: &kube::Client,
    namespace: &str,
    group: &str,
    version: &str,
    kind: &str,
    name: &str,
    spec: serde_json::Value,
) -> impl std::future::Future<Output = Result<kube::api::DynamicObject>> + use<> {
    let api = dynamic_api(client, namespace, group, version, kind);
    let object = dynamic_object(&format!("{group}/{version}"), kind, namespace, name, spec);
    let what = format!("creating {kind} {name}");
    async move {
        api.create(&kube::api::PostParams::default(), &object?)
            .await
            .context(what)
    }
}

/// Prints a failed test's error and the last `lines` lines of each log `names` (paths below
/// `dir`), for the reader of a red run.
pub fn report_failure(error: &anyhow::Error, dir: &Path, names: &[&str], lines: usize) {
    eprintln!("failed: {error:#}");
    for name in names {
        eprintln!(
            "--- last lines of {name}:\n{}",
            process::tail(&dir.join(name), lines)
        );
    }
}

/// A MailgunCluster and the Cluster that names it in `spec.infrastructureRef`, as a user writes
/// them: no owner references (Cluster API's core manager adds them).
///
/// # Errors
/// When the API server refuses either.
pub async fn create_cluster_pair(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    requester: &str,
) -> Result<()> {
    create_labelled_cluster_pair(client, namespace, name, requester, &[]).await
}

/// [`create_cluster_pair`] with `labels` on both objects (e.g.
/// `cluster.x-k8s.io/watch-filter`, which picks the shard that reconciles them).
///
/// # Errors
/// When the API server refuses either.
pub async fn create_labelled_cluster_pair(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    requester: &str,
    labels: &[(&str, &str)],
) -> Result<()> {
    let post = kube::api::PostParams::default();
    let infra = "infrastructure.cluster.x-k8s.io";
    let labelled = |mut object: kube::api::DynamicObject| {
        if !labels.is_empty() {
            object.metadata.labels = Some(
                labels
                    .iter()
                    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                    .collect(),
            );
        }
        object
    };
    dynamic_api(client, namespace, infra, "v1beta1", "MailgunCluster")
        .create(
            &post,
            &labelled(dynamic_object(
                &format!("{infra}/v1beta1"),
                "MailgunCluster",
                namespace,
                name,
                serde_json::json!({"priority": "Urgent", "request": "One cluster please", "requester": requester}),
            )?),
        )
        .await
        .with_context(|| format!("creating MailgunCluster {namespace}/{name}"))?;
    dynamic_api(client, namespace, "cluster.x-k8s.io", "v1beta2", "Cluster")
        .create(
            &post,
            &labelled(dynamic_object(
                "cluster.x-k8s.io/v1beta2",
                "Cluster",
                namespace,
                name,
                serde_json::json!({"infrastructureRef": {"apiGroup": infra, "kind": "MailgunCluster", "name": name}}),
            )?),
        )
        .await
        .with_context(|| format!("creating Cluster {namespace}/{name}"))?;
    Ok(())
}

/// Copies every `*.log` file under `from` (recursively, keeping their paths below it) to `to`:
/// the control plane's reaper removes its state directory whatever happens, and a failure is
/// read afterwards.
///
/// # Errors
/// When a directory cannot be read or a file cannot be copied.
pub fn keep_logs(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    let mut dirs = vec![from.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir)?.flatten() {
            let path = entry.path();
            if entry.file_type()?.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|x| x == "log") {
                let kept = to.join(path.strip_prefix(from)?);
                std::fs::create_dir_all(kept.parent().unwrap_or(to))?;
                std::fs::copy(&path, &kept)?;
            }
        }
    }
    Ok(())
}

/// Claims Secret `namespace/name` for the `MailgunClusterIdentity` `identity` (its label): only
/// then may that identity name it.
///
/// # Errors
/// When the API server refuses the patch.
pub async fn claim_secret(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    identity: &str,
) -> Result<()> {
    use k8s_openapi::api::core::v1::Secret;
    // `capm_api::names::IDENTITY_SECRET_LABEL`: this library does not depend on the API crate.
    let patch = serde_json::json!({"metadata": {"labels": {
        "mailgun.infrastructure.cluster.x-k8s.io/identity": identity}}});
    kube::Api::<Secret>::namespaced(client.clone(), namespace)
        .patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&patch),
        )
        .await
        .with_context(|| format!("claiming Secret {namespace}/{name} for {identity}"))?;
    Ok(())
}

/// Creates the Secret `name` in `namespace` from `(key, value)` pairs of text.
pub async fn create_secret(
    client: &kube::Client,
    namespace: &str,
    name: &str,
    data: &[(&str, &str)],
) -> Result<()> {
    use k8s_openapi::{api::core::v1::Secret, apimachinery::pkg::apis::meta::v1::ObjectMeta};
    let secret = Secret {
        metadata: ObjectMeta {
            name: Some(name.into()),
            ..ObjectMeta::default()
        },
        string_data: Some(
            data.iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        ),
        ..Secret::default()
    };
    kube::Api::<Secret>::namespaced(client.clone(), namespace)
        .create(&kube::api::PostParams::default(), &secret)
        .await
        .with_context(|| format!("creating Secret {namespace}/{name}"))?;
    Ok(())
}

/// The number in the environment variable `name` (a seed, a count), if it is set.
///
/// # Errors
/// When it is set but not a number.
pub fn env_u64(name: &str) -> Result<Option<u64>> {
    match std::env::var(name) {
        Ok(v) if !v.trim().is_empty() => {
            Ok(Some(v.trim().parse().with_context(|| {
                format!("{name}={v:?} is not a number")
            })?))
        }
        _ => Ok(None),
    }
}

/// A free loopback port.
///
/// # Errors
/// When none can be found.
pub fn free_port() -> Result<u16> {
    Ok(process::free_port()?)
}

/// An IPv4 address of this host that is not loopback: Kubernetes refuses loopback endpoints,
/// and the API server reaches a webhook through its Service's endpoints.
///
/// # Errors
/// When the host has none.
pub fn host_ip() -> Result<IpAddr> {
    let out = run(Command::new("hostname").arg("-I"), "hostname -I")?;
    out.split_whitespace()
        .filter_map(|s| s.parse::<IpAddr>().ok())
        .find(|ip| ip.is_ipv4() && !ip.is_loopback())
        .context(
            "this host has no non-loopback IPv4 address; the API server cannot reach a \
             webhook endpoint on loopback",
        )
}

/// A kubeconfig that authenticates as a ServiceAccount with a token from the TokenRequest API.
///
/// # Errors
/// When the token cannot be issued.
pub fn service_account_kubeconfig(
    cp: &ControlPlane,
    namespace: &str,
    service_account: &str,
    dir: &Path,
) -> Result<PathBuf> {
    let token = cp.kubectl_output(&[
        "-n",
        namespace,
        "create",
        "token",
        service_account,
        "--duration",
        "2h",
    ])?;
    let ca = cp.ca_file().context("the control plane's CA file")?;
    let path = dir.join(format!("{service_account}.kubeconfig"));
    let config = serde_json::json!({
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": cp.server(), "certificate-authority": ca}}],
        "users": [{"name": service_account, "user": {"token": token.trim()}}],
        "contexts": [{"name": "sa", "context": {"cluster": "local", "user": service_account, "namespace": namespace}}],
        "current-context": "sa",
    });
    fs::write(&path, serde_json::to_vec_pretty(&config)?)?;
    Ok(path)
}

/// The Cluster API core manager (built by `make tools`) against `kubeconfig`, as an admin:
/// it is Cluster API, not the provider under test.
///
/// # Errors
/// When it is not built or cannot start.
pub fn start_capi_manager(kubeconfig: &Path, dir: &Path) -> Result<Proc> {
    start_capi_manager_with(kubeconfig, dir, &[])
}

/// [`start_capi_manager`] with more flags, e.g. `--feature-gates=ClusterTopology=true`.
///
/// # Errors
/// When it is not built or cannot start.
pub fn start_capi_manager_with(kubeconfig: &Path, dir: &Path, extra: &[&str]) -> Result<Proc> {
    let certs = dir.join("capi-webhook-certs");
    fs::create_dir_all(&certs)?;
    let ca = capm_test_support::pki::CertificateAuthority::new("capi-webhook-ca")?;
    let pair = ca.serving_cert("localhost", &["localhost"], &[])?;
    fs::write(certs.join("tls.crt"), &pair.cert_pem)?;
    fs::write(certs.join("tls.key"), &pair.key_pem)?;
    let mut cmd = Command::new(process::binary("capi-manager")?);
    cmd.arg("--kubeconfig")
        .arg(kubeconfig)
        .arg("--leader-elect=false")
        .args(["--webhook-port", &free_port()?.to_string()])
        .arg("--webhook-cert-dir")
        .arg(&certs)
        .args(["--health-addr", &format!("127.0.0.1:{}", free_port()?)])
        .args([
            "--diagnostics-address",
            &format!("127.0.0.1:{}", free_port()?),
        ])
        .arg("--insecure-diagnostics")
        .args(extra);
    Proc::spawn("capi-manager", cmd, dir.join("capi-manager.log"))
}

/// A plain HTTP GET (HTTP/1.0, one connection): status code and body.
///
/// # Errors
/// On connection or protocol errors.
pub fn http_get(addr: &str, path: &str) -> Result<(u16, String)> {
    let mut stream = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nAccept: */*\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("an HTTP response without a header end")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("an HTTP response without a status")?;
    Ok((status, body.to_owned()))
}

/// How to reach a secured diagnostics endpoint: its CA, the name its certificate carries, and
/// a bearer token (in a file, as Prometheus reads it).
#[derive(Debug, Clone)]
pub struct HttpsScrape {
    /// PEM file of the CA that signed the serving certificate.
    pub ca_file: PathBuf,
    /// The name to verify the certificate against.
    pub server_name: String,
    /// File holding the bearer token.
    pub token_file: PathBuf,
}

/// `GET path` over TLS (verified against `scrape.ca_file` and `scrape.server_name`), with the
/// bearer token when `with_token`: (status, body).
///
/// # Errors
/// When the connection, the handshake or the response fails.
pub fn https_get(
    addr: &str,
    path: &str,
    scrape: &HttpsScrape,
    with_token: bool,
) -> Result<(u16, String)> {
    use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(&scrape.ca_file)? {
        roots.add(cert?)?;
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = ServerName::try_from(scrape.server_name.clone())?;
    let conn = rustls::ClientConnection::new(Arc::new(config), name)?;
    let tcp = TcpStream::connect(addr).with_context(|| format!("connecting to {addr}"))?;
    tcp.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut tls = rustls::StreamOwned::new(conn, tcp);
    let auth = if with_token {
        format!(
            "Authorization: Bearer {}\r\n",
            fs::read_to_string(&scrape.token_file)?.trim()
        )
    } else {
        String::new()
    };
    write!(
        tls,
        "GET {path} HTTP/1.0\r\nHost: {addr}\r\nAccept: */*\r\n{auth}\r\n"
    )?;
    let mut response = Vec::new();
    match tls.read_to_end(&mut response) {
        Ok(_) => {}
        // A server that closes without close_notify after a complete HTTP/1.0 response.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && !response.is_empty() => {}
        Err(e) => return Err(e.into()),
    }
    let response = String::from_utf8_lossy(&response);
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("an HTTP response without a header end")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .context("an HTTP response without a status")?;
    Ok((status, body.to_owned()))
}

/// [`capm_test_support::wait::try_eventually`] with this crate's checks: they use `?` on
/// `anyhow` errors, so the error type is named here for inference. An error from `check` (a
/// process died, the API refused) ends the wait at once.
///
/// # Errors
/// On timeout, or when `check` fails.
pub async fn eventually<T, F, Fut>(timeout: Duration, what: &str, check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    Ok(capm_test_support::wait::try_eventually(timeout, what, check).await?)
}

/// Debian's Prometheus (`apt-get install prometheus`), scraping `targets` every second.
#[derive(Debug)]
pub struct Prometheus {
    proc: Proc,
    addr: String,
}

impl Prometheus {
    /// Starts it with a fresh TSDB in `dir`, scraping `targets` over plain HTTP or, with
    /// `https`, over verified TLS with a bearer token.
    ///
    /// # Errors
    /// When it is not installed or does not become ready.
    pub async fn start(
        dir: &Path,
        targets: &[String],
        https: Option<&HttpsScrape>,
    ) -> Result<Self> {
        let targets = targets
            .iter()
            .map(|t| format!("\"{t}\""))
            .collect::<Vec<_>>()
            .join(", ");
        let security = match https {
            None => String::new(),
            Some(s) => format!(
                "    scheme: https\n    authorization:\n      credentials_file: {}\n    \
                 tls_config:\n      ca_file: {}\n      server_name: {}\n",
                s.token_file.display(),
                s.ca_file.display(),
                s.server_name
            ),
        };
        let text = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
             scrape_configs:\n  - job_name: cluster-api-provider-mailgun\n{security}    \
             static_configs:\n      - targets: [{targets}]\n"
        );
        Self::start_with_config(dir, &text).await
    }

    /// Starts it with a fresh TSDB in `dir` and `config` as its configuration file (scrape jobs,
    /// rule files: paths in it are as written).
    ///
    /// # Errors
    /// When it is not installed, refuses the configuration or does not become ready.
    pub async fn start_with_config(dir: &Path, config_text: &str) -> Result<Self> {
        let bin = which("prometheus").context(
            "prometheus not found: install Debian's package (`make deps` does: apt-get install prometheus)",
        )?;
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let config = dir.join("prometheus.yml");
        fs::write(&config, config_text)?;
        let addr = format!("127.0.0.1:{}", free_port()?);
        let mut cmd = Command::new(bin);
        cmd.arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn");
        let proc = Proc::spawn("prometheus", cmd, dir.join("prometheus.log"))?;
        let started = Instant::now();
        loop {
            proc.check_alive()?;
            if matches!(http_get(&addr, "/-/ready"), Ok((200, _))) {
                break;
            }
            ensure!(
                started.elapsed() < Duration::from_secs(60),
                "prometheus not ready after 60 s; log:\n{}",
                proc.tail(20)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok(Self { proc, addr })
    }

    /// `GET /api/v1/<path>` of its HTTP API: the `data` of the answer.
    ///
    /// # Errors
    /// When Prometheus died or the answer is not a success.
    pub fn api(&self, path: &str) -> Result<serde_json::Value> {
        self.proc.check_alive()?;
        let (status, body) = http_get(&self.addr, &format!("/api/v1/{path}"))?;
        ensure!(status == 200, "{path}: HTTP {status}: {body}");
        let mut v: serde_json::Value = serde_json::from_str(&body)?;
        ensure!(v["status"] == "success", "{path}: {body}");
        Ok(v["data"].take())
    }

    /// An instant PromQL query; each sample's labels and value.
    ///
    /// # Errors
    /// When the query fails.
    pub fn query_labelled(
        &self,
        promql: &str,
    ) -> Result<Vec<(std::collections::BTreeMap<String, String>, f64)>> {
        let data = self.api(&format!("query?query={}", url_encode(promql)))?;
        data["result"]
            .as_array()
            .context("no data.result in the query response")?
            .iter()
            .map(|r| {
                let labels = serde_json::from_value(r["metric"].clone())?;
                let value = r["value"][1]
                    .as_str()
                    .and_then(|s| s.parse::<f64>().ok())
                    .context("a sample without a value")?;
                Ok((labels, value))
            })
            .collect()
    }

    /// An instant PromQL query; the samples' values.
    ///
    /// # Errors
    /// When the query fails.
    pub fn query(&mut self, promql: &str) -> Result<Vec<f64>> {
        self.proc.check_alive()?;
        let (status, body) = http_get(
            &self.addr,
            &format!("/api/v1/query?query={}", url_encode(promql)),
        )?;
        ensure!(status == 200, "query {promql:?}: HTTP {status}: {body}");
        let v: serde_json::Value = serde_json::from_str(&body)?;
        let results = v["data"]["result"]
            .as_array()
            .context("no data.result in the query response")?;
        results
            .iter()
            .map(|r| {
                r["value"][1]
                    .as_str()
                    .and_then(|s| s.parse::<f64>().ok())
                    .context("a sample without a value")
            })
            .collect()
    }
}

/// `promtool check metrics` on an exposition; its complaints, empty when clean.
///
/// # Errors
/// When promtool is not installed.
pub fn promtool_check_metrics(exposition: &str) -> Result<String> {
    let bin = which("promtool").context("promtool not found (Debian's prometheus package)")?;
    let mut child = Command::new(bin)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(exposition.as_bytes())?;
    let out = child.wait_with_output()?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    if out.status.success() {
        Ok(text.trim().to_owned())
    } else {
        Ok(format!(
            "promtool exited with {}: {}",
            out.status,
            text.trim()
        ))
    }
}

/// Runs `promtool <args>`: whether it succeeded, and its output (stdout then stderr).
///
/// # Errors
/// When promtool is not installed or cannot start.
pub fn promtool(args: &[&str]) -> Result<(bool, String)> {
    let bin = which("promtool")
        .context("promtool not found: install Debian's prometheus package (`make deps` does)")?;
    let out = Command::new(bin)
        .args(args)
        .output()
        .context("running promtool")?;
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    Ok((out.status.success(), text))
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|dir| dir.join(name))
            .find(|p| p.is_file())
    })
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One request from the API server's audit log (JSON lines, level Metadata).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct AuditedRequest {
    /// `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`, ...
    pub verb: String,
    /// API group; empty for the core group.
    pub group: String,
    /// Resource, with `/subresource` when there is one.
    pub resource: String,
    /// HTTP status of the response.
    pub code: u16,
    /// The client's User-Agent.
    pub user_agent: String,
    /// Who made it.
    pub username: String,
    /// The object's name; empty for collections.
    pub name: String,
    /// Whether it was a dry run (`dryRun=All` in the request URI).
    pub dry_run: bool,
    /// The `fieldManager` of a write, from the request URI; empty when not given.
    pub field_manager: String,
}

/// The completed requests of `username` in an audit log.
///
/// # Errors
/// When the log cannot be read.
pub fn audited_requests(log: &Path, username: &str) -> Result<Vec<AuditedRequest>> {
    Ok(all_audited_requests(log)?
        .into_iter()
        .filter(|r| r.username == username)
        .collect())
}

/// Every completed request to a resource in an audit log, whoever made it.
///
/// # Errors
/// When the log cannot be read.
pub fn all_audited_requests(log: &Path) -> Result<Vec<AuditedRequest>> {
    let text = fs::read_to_string(log).with_context(|| format!("reading {}", log.display()))?;
    let mut out = Vec::new();
    for line in text.lines() {
        let Ok(event) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if event["stage"] != "ResponseComplete" {
            continue;
        }
        let obj = &event["objectRef"];
        let Some(resource) = obj["resource"].as_str() else {
            continue; // non-resource URLs (/api, /version, ...)
        };
        let uri = event["requestURI"].as_str().unwrap_or_default();
        let resource = match obj["subresource"].as_str() {
            Some(sub) => format!("{resource}/{sub}"),
            None => resource.to_owned(),
        };
        out.push(AuditedRequest {
            verb: event["verb"].as_str().unwrap_or_default().to_owned(),
            group: obj["apiGroup"].as_str().unwrap_or_default().to_owned(),
            resource,
            code: event["responseStatus"]["code"]
                .as_u64()
                .and_then(|c| u16::try_from(c).ok())
                .unwrap_or(0),
            user_agent: event["userAgent"].as_str().unwrap_or_default().to_owned(),
            username: event["user"]["username"]
                .as_str()
                .unwrap_or_default()
                .to_owned(),
            name: obj["name"].as_str().unwrap_or_default().to_owned(),
            dry_run: uri.contains("dryRun=All"),
            field_manager: uri
                .split(['?', '&'])
                .find_map(|p| p.strip_prefix("fieldManager="))
                .unwrap_or_default()
                .to_owned(),
        });
    }
    Ok(out)
}

/// An audit policy that logs, at level Metadata, every request made by a ServiceAccount.
pub const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    userGroups: [\"system:serviceaccounts\"]
  - level: None
";

/// A control plane of its own whose API server writes what the audit `policy` selects to
/// `<dir>/audit.log` (blocking mode: an entry is written before the request is answered, so a
/// test reads everything that happened before it looks), with the Cluster API CRDs installed.
/// Returns it and the log's path.
///
/// # Errors
/// When a file cannot be written or the control plane does not start.
pub async fn audited_control_plane(dir: &Path, policy: &str) -> Result<(ControlPlane, PathBuf)> {
    let policy_file = dir.join("audit-policy.yaml");
    fs::write(&policy_file, policy)?;
    let audit_log = dir.join("audit.log");
    let cp = ControlPlane::start(Options {
        apiserver_args: vec![
            format!("--audit-policy-file={}", policy_file.display()).into(),
            format!("--audit-log-path={}", audit_log.display()).into(),
            "--audit-log-mode=blocking".into(),
        ],
        ..Options::default()
    })
    .await?;
    cp.install_capi_crds().await?;
    Ok((cp, audit_log))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_logs_copies_every_log_below_with_its_path_and_nothing_else() {
        let from = tempfile::tempdir().unwrap();
        let to = tempfile::tempdir().unwrap();
        let lane = from.path().join("soak/mailgun");
        fs::create_dir_all(&lane).unwrap();
        fs::write(from.path().join("kube-apiserver.log"), "api").unwrap();
        fs::write(lane.join("replica-0-1.log"), "replica").unwrap();
        fs::write(lane.join("config.json"), "{}").unwrap();
        let kept = to.path().join("kept");
        keep_logs(from.path(), &kept).unwrap();
        let read = |p: &str| fs::read_to_string(kept.join(p)).unwrap();
        assert_eq!(read("kube-apiserver.log"), "api");
        assert_eq!(read("soak/mailgun/replica-0-1.log"), "replica");
        assert!(!kept.join("soak/mailgun/config.json").exists());
    }
}
