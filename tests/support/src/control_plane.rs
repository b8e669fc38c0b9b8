//! Starting, reusing and stopping the local control plane.

use std::{
    net::{IpAddr, Ipv4Addr},
    path::{Path, PathBuf},
    process::Command,
    sync::{Mutex, OnceLock},
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::core::v1::ServiceAccount,
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams},
    config::{KubeConfigOptions, Kubeconfig},
    runtime::wait::{await_condition, conditions},
};

use crate::{
    Error,
    node::{self, Network},
    pki::{self, CertificateAuthority},
    process::{self, Component, Reaper},
};

/// The Kubernetes version the tools are built at (see `hack/tools/kubernetes`).
pub const KUBERNETES_VERSION: &str = "v1.36.4";

/// Controllers of kube-controller-manager that the provider's tests rely on.
const CONTROLLERS: &str = "namespace-controller,garbage-collector-controller,\
serviceaccount-controller,serviceaccount-token-controller,deployment-controller,\
replicaset-controller";

/// More controllers when Pods run: Services get endpoints (webhooks, scrapes), PDBs a status,
/// every namespace the `kube-root-ca.crt` ConfigMap that ServiceAccount token volumes mount, and
/// the node loses its `not-ready` taint once Ready (node lifecycle).
const NODE_CONTROLLERS: &str = "endpoints-controller,endpointslice-controller,\
disruption-controller,root-ca-certificate-publisher-controller,pod-garbage-collector-controller,\
node-lifecycle-controller";

/// How to start a control plane.
#[derive(Debug, Clone)]
pub struct Options {
    /// State directory. `None`: a fresh temporary directory.
    pub dir: Option<PathBuf>,
    /// Keep running after this process exits (no reaper); stop with [`ControlPlane::stop_detached`].
    pub detached: bool,
    /// The API server's port. `None`: a free port.
    pub api_port: Option<u16>,
    /// Start kube-controller-manager too.
    pub controller_manager: bool,
    /// How long start-up may take before giving up.
    pub timeout: Duration,
    /// Where the binaries are. `None`: [`process::bin_dir`].
    pub bin_dir: Option<PathBuf>,
    /// More kube-apiserver flags (e.g. an audit policy), after the defaults.
    pub apiserver_args: Vec<std::ffi::OsString>,
    /// Start a node too (a bridge network, containerd, kube-scheduler, a kubelet; see
    /// [`crate::node`]): Deployments then run as real Pods. Needs root. The API server then
    /// listens on the bridge's address instead of 127.0.0.1.
    pub node: bool,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            dir: None,
            detached: false,
            api_port: None,
            controller_manager: true,
            timeout: Duration::from_secs(90),
            bin_dir: None,
            apiserver_args: Vec::new(),
            node: false,
        }
    }
}

/// A running local control plane, or one started elsewhere and reused through its kubeconfig.
#[derive(Debug)]
pub struct ControlPlane {
    dir: Option<PathBuf>,
    kubeconfig: PathBuf,
    server: String,
    components: Mutex<Vec<Component>>,
    reaper: Mutex<Option<Reaper>>,
    started_in: Duration,
    /// How kube-apiserver was started (program, arguments), to start it again the same way.
    apiserver_recipe: Option<(std::ffi::OsString, Vec<std::ffi::OsString>)>,
    /// The node's network, when a node was started.
    network: Option<Network>,
}

/// Cleans up a half-started control plane when start-up fails.
struct StartGuard {
    dir: PathBuf,
    components: Vec<Component>,
    reaper: Option<Reaper>,
    armed: bool,
}

impl Drop for StartGuard {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        for c in &mut self.components {
            c.kill();
        }
        match self.reaper.take() {
            Some(reaper) => reaper.finish(),
            None => {
                let _ = process::cleanup_now(&self.dir);
            }
        }
    }
}

impl StartGuard {
    fn check_alive(&mut self) -> Result<(), Error> {
        for c in &mut self.components {
            if let Some(status) = c.exited() {
                return Err(c.died(Some(status)));
            }
        }
        Ok(())
    }

    fn log_of(&self, name: &str) -> PathBuf {
        self.components
            .iter()
            .find(|c| c.name == name)
            .map(|c| c.log.clone())
            .unwrap_or_default()
    }
}

fn write(path: &Path, contents: &str) -> Result<(), Error> {
    std::fs::write(path, contents).map_err(Error::io("writing control-plane files"))
}

fn kubeconfig_yaml(server: &str, dir: &Path, user: &str) -> String {
    let pki = dir.join("pki");
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: capm-local\n  cluster:\n    server: {server}\n    \
         certificate-authority: {ca}\nusers:\n- name: {user}\n  user:\n    client-certificate: {crt}\n    \
         client-key: {key}\ncontexts:\n- name: capm-local\n  context:\n    cluster: capm-local\n    \
         user: {user}\n    namespace: default\ncurrent-context: capm-local\n",
        ca = pki.join("ca.crt").display(),
        crt = pki.join(format!("{user}.crt")).display(),
        key = pki.join(format!("{user}.key")).display(),
    )
}

/// Builds a client from a kubeconfig file.
///
/// # Errors
/// When the file cannot be read or names no usable cluster.
pub async fn client_from_kubeconfig(path: &Path) -> Result<Client, Error> {
    Client::try_from(config_from_kubeconfig(path).await?).map_err(Error::kube("building a client"))
}

/// Loads a client configuration from a kubeconfig file.
///
/// # Errors
/// When the file cannot be read or names no usable cluster.
pub async fn config_from_kubeconfig(path: &Path) -> Result<kube::Config, Error> {
    let kubeconfig = Kubeconfig::read_from(path).map_err(|source| Error::Kubeconfig {
        path: path.to_owned(),
        source,
    })?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .map_err(|source| Error::Kubeconfig {
            path: path.to_owned(),
            source,
        })?;
    Ok(config)
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| {
                !s.rsplit(')')
                    .next()
                    .unwrap_or("")
                    .trim_start()
                    .starts_with('Z')
            })
            .unwrap_or(false)
}

/// True when `dir` holds a control plane whose processes still run.
pub(crate) fn is_running(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("pids"))
        .map(|pids| {
            pids.lines()
                .filter_map(|l| l.trim().parse().ok())
                .any(pid_alive)
        })
        .unwrap_or(false)
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver and (optionally) kube-controller-manager, writes
    /// `<dir>/kubeconfig` for an admin user (`system:masters`), and returns once `/readyz`
    /// passes and the controller manager has created the `default` ServiceAccount.
    ///
    /// # Errors
    /// A missing binary, a taken port, a component that dies during start (with the end of its
    /// log), or a timeout. Whatever was started is stopped and removed before returning.
    pub async fn start(opts: Options) -> Result<Self, Error> {
        let begun = Instant::now();
        let bin_dir = opts.bin_dir.clone().unwrap_or_else(process::bin_dir);
        let etcd_bin = process::binary_in(&bin_dir, "etcd")?;
        let apiserver_bin = process::binary_in(&bin_dir, "kube-apiserver")?;
        let kcm_bin = if opts.controller_manager {
            Some(process::binary_in(&bin_dir, "kube-controller-manager")?)
        } else {
            None
        };
        if let Some(port) = opts.api_port {
            process::check_port_free(port)?;
        }

        let dir = match &opts.dir {
            Some(dir) => {
                if is_running(dir) {
                    return Err(Error::AlreadyRunning { dir: dir.clone() });
                }
                if dir.exists() {
                    process::cleanup_now(dir)?;
                }
                std::fs::create_dir_all(dir).map_err(Error::io("creating the state directory"))?;
                dir.canonicalize()
                    .map_err(Error::io("resolving the state directory"))?
            }
            None => tempfile::Builder::new()
                .prefix("capm-cp-")
                .tempdir()
                .map_err(Error::io("creating a temporary directory"))?
                .keep(),
        };
        let mut guard = StartGuard {
            reaper: if opts.detached {
                None
            } else {
                Some(Reaper::start(&dir)?)
            },
            dir: dir.clone(),
            components: Vec::new(),
            armed: true,
        };

        let network = if opts.node {
            Some(Network::create(&dir)?)
        } else {
            None
        };
        let address = network
            .as_ref()
            .map_or(Ipv4Addr::LOCALHOST, |n| n.gateway)
            .to_string();

        // PKI
        let pki_dir = dir.join("pki");
        std::fs::create_dir_all(&pki_dir).map_err(Error::io("creating the PKI directory"))?;
        let ca = CertificateAuthority::new("capm-local-ca")?;
        let serving = ca.serving_cert(
            "kube-apiserver",
            &["kubernetes", "kubernetes.default", "kubernetes.default.svc"],
            &[
                IpAddr::V4(Ipv4Addr::new(10, 0, 0, 1)),
                network
                    .as_ref()
                    .map_or(IpAddr::V4(Ipv4Addr::LOCALHOST), |n| IpAddr::V4(n.gateway)),
            ],
        )?;
        let admin = ca.client_cert("capm-admin", &["system:masters"])?;
        let kcm = ca.client_cert("system:kube-controller-manager", &["system:masters"])?;
        let (sa_key, sa_pub) = pki::service_account_key()?;
        write(&pki_dir.join("ca.crt"), ca.cert_pem())?;
        write(&pki_dir.join("apiserver.crt"), &serving.cert_pem)?;
        write(&pki_dir.join("apiserver.key"), &serving.key_pem)?;
        write(&pki_dir.join("admin.crt"), &admin.cert_pem)?;
        write(&pki_dir.join("admin.key"), &admin.key_pem)?;
        write(&pki_dir.join("controller-manager.crt"), &kcm.cert_pem)?;
        write(&pki_dir.join("controller-manager.key"), &kcm.key_pem)?;
        if network.is_some() {
            let kubelet = ca.client_cert(
                &format!("system:node:{}", node::NODE_NAME),
                &["system:nodes", "system:masters"],
            )?;
            write(&pki_dir.join("kubelet.crt"), &kubelet.cert_pem)?;
            write(&pki_dir.join("kubelet.key"), &kubelet.key_pem)?;
        }
        write(&pki_dir.join("sa.key"), &sa_key)?;
        write(&pki_dir.join("sa.pub"), &sa_pub)?;

        // etcd
        let (etcd_port, peer_port) = (process::free_port()?, process::free_port()?);
        let api_port = match opts.api_port {
            Some(p) => p,
            None => process::free_port()?,
        };
        let etcd_url = format!("http://127.0.0.1:{etcd_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let mut etcd = Command::new(etcd_bin);
        etcd.args(["--name", "capm", "--data-dir"])
            .arg(dir.join("etcd"))
            .args([
                "--listen-client-urls",
                &etcd_url,
                "--advertise-client-urls",
                &etcd_url,
            ])
            .args([
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
            ])
            .args(["--initial-cluster", &format!("capm={peer_url}")])
            .args(["--unsafe-no-fsync", "--log-level", "warn"]);
        guard.components.push(Component::spawn(&dir, "etcd", etcd)?);

        // kube-apiserver
        let server = format!("https://{address}:{api_port}");
        let p = |name: &str| pki_dir.join(name);
        let mut apiserver = Command::new(apiserver_bin);
        apiserver
            .args(["--etcd-servers", &etcd_url])
            .args(["--bind-address", &address, "--advertise-address", &address])
            .args(["--secure-port", &api_port.to_string()])
            .arg("--tls-cert-file")
            .arg(p("apiserver.crt"))
            .arg("--tls-private-key-file")
            .arg(p("apiserver.key"))
            .arg("--client-ca-file")
            .arg(p("ca.crt"))
            .args(["--authorization-mode", "RBAC"])
            .args(["--service-cluster-ip-range", "10.0.0.0/24"])
            .args(["--service-account-issuer", &server])
            .arg("--service-account-key-file")
            .arg(p("sa.pub"))
            .arg("--service-account-signing-key-file")
            .arg(p("sa.key"))
            // Webhooks and aggregated APIs are reached through their Service's endpoints rather
            // than its ClusterIP: there is no kube-proxy here, so a test can point an
            // EndpointSlice at a process on this host.
            .arg("--enable-aggregator-routing=true")
            .args(["--profiling=false", "--v=1"])
            // The node's name does not resolve: logs and exec go to its InternalIP.
            .args(if network.is_some() {
                &["--kubelet-preferred-address-types=InternalIP"][..]
            } else {
                &[]
            })
            .args(&opts.apiserver_args);
        let apiserver_recipe = (
            apiserver.get_program().to_owned(),
            apiserver.get_args().map(ToOwned::to_owned).collect(),
        );
        guard
            .components
            .push(Component::spawn(&dir, "kube-apiserver", apiserver)?);

        let kubeconfig = dir.join("kubeconfig");
        write(&kubeconfig, &kubeconfig_yaml(&server, &dir, "admin"))?;
        let kcm_kubeconfig = dir.join("controller-manager.kubeconfig");
        write(
            &kcm_kubeconfig,
            &kubeconfig_yaml(&server, &dir, "controller-manager"),
        )?;

        let deadline = begun + opts.timeout;
        let client = client_from_kubeconfig(&kubeconfig).await?;
        loop {
            guard.check_alive()?;
            let req = http::Request::get("/readyz")
                .body(Vec::new())
                .map_err(|e| Error::Shared(e.to_string()))?;
            if matches!(client.request_text(req).await.as_deref(), Ok("ok")) {
                break;
            }
            if Instant::now() > deadline {
                let log = guard.log_of("kube-apiserver");
                return Err(Error::Timeout {
                    what: format!("{server}/readyz"),
                    seconds: opts.timeout.as_secs(),
                    log_tail: process::tail(&log, 25),
                    log,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }

        if let Some(kcm_bin) = kcm_bin {
            let mut kcm = Command::new(kcm_bin);
            kcm.arg("--kubeconfig")
                .arg(&kcm_kubeconfig)
                .args(["--leader-elect=false", "--secure-port=0"])
                .arg("--controllers")
                .arg(if network.is_some() {
                    format!("{CONTROLLERS},{NODE_CONTROLLERS}")
                } else {
                    CONTROLLERS.to_owned()
                })
                .arg("--root-ca-file")
                .arg(p("ca.crt"))
                .arg("--service-account-private-key-file")
                .arg(p("sa.key"))
                .args(["--concurrent-gc-syncs=5", "--v=1"]);
            guard
                .components
                .push(Component::spawn(&dir, "kube-controller-manager", kcm)?);
            // The serviceaccount controller creating `default` shows the controllers are running;
            // Pods cannot be admitted before it exists.
            let sas: Api<ServiceAccount> = Api::namespaced(client.clone(), "default");
            loop {
                guard.check_alive()?;
                if matches!(sas.get_opt("default").await, Ok(Some(_))) {
                    break;
                }
                if Instant::now() > deadline {
                    let log = guard.log_of("kube-controller-manager");
                    return Err(Error::Timeout {
                        what: "kube-controller-manager to create ServiceAccount default/default"
                            .into(),
                        seconds: opts.timeout.as_secs(),
                        log_tail: process::tail(&log, 25),
                        log,
                    });
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }

        if let Some(net) = &network {
            net.route_kubernetes_service(api_port)?;
            let kubelet_kubeconfig = dir.join("kubelet.kubeconfig");
            write(
                &kubelet_kubeconfig,
                &kubeconfig_yaml(&server, &dir, "kubelet"),
            )?;
            node::start(
                &node::NodeStart {
                    dir: &dir,
                    bin_dir: &bin_dir,
                    net,
                    kubelet_kubeconfig: &kubelet_kubeconfig,
                    scheduler_kubeconfig: &kubeconfig,
                    deadline,
                },
                &client,
                &mut guard.components,
            )
            .await?;
        }

        guard.armed = false;
        Ok(Self {
            dir: Some(dir),
            kubeconfig,
            server,
            components: Mutex::new(std::mem::take(&mut guard.components)),
            reaper: Mutex::new(guard.reaper.take()),
            started_in: begun.elapsed(),
            apiserver_recipe: Some(apiserver_recipe),
            network,
        })
    }

    /// Uses a control plane that is already running, named by its kubeconfig. Nothing is stopped
    /// when it is dropped.
    ///
    /// # Errors
    /// When the kubeconfig cannot be loaded.
    pub async fn existing(kubeconfig: PathBuf) -> Result<Self, Error> {
        // Fails early with a clear message when the file is unusable.
        client_from_kubeconfig(&kubeconfig).await?;
        let kc = Kubeconfig::read_from(&kubeconfig).map_err(|source| Error::Kubeconfig {
            path: kubeconfig.clone(),
            source,
        })?;
        let server = kc
            .clusters
            .first()
            .and_then(|c| c.cluster.as_ref())
            .and_then(|c| c.server.clone())
            .unwrap_or_default();
        Ok(Self {
            dir: None,
            kubeconfig,
            server,
            components: Mutex::new(Vec::new()),
            reaper: Mutex::new(None),
            started_in: Duration::ZERO,
            apiserver_recipe: None,
            network: None,
        })
    }

    /// Stops a detached control plane running in `dir` (what `capm-env down` does).
    ///
    /// # Errors
    /// [`Error::NotRunning`] when nothing is there; a failing cleanup.
    pub fn stop_detached(dir: &Path) -> Result<(), Error> {
        if !dir.join("pids").exists() {
            return Err(Error::NotRunning {
                dir: dir.to_owned(),
            });
        }
        process::cleanup_now(dir)
    }

    /// The node's network, when this control plane was started with a node.
    pub fn network(&self) -> Option<&Network> {
        self.network.as_ref()
    }

    /// Builds the provider's container image from `binary` and loads it into the node's
    /// containerd as `name` (a `repository:tag` the chart can then use with any pull policy but
    /// `Always`). Returns the image's manifest digest.
    ///
    /// # Errors
    /// [`Error::Node`] when no node runs here; image or `ctr` failures.
    pub fn load_provider_image(&self, binary: &Path, name: &str) -> Result<String, Error> {
        let (Some(dir), Some(_)) = (&self.dir, &self.network) else {
            return Err(Error::Node("this control plane has no node".into()));
        };
        node::load_provider_image(dir, &dir.join("bin"), binary, name)
    }

    /// Lets the node's containerd pull from the HTTPS registry at `host` (`<ip>:<port>`),
    /// trusting `ca_pem` (a `hosts.toml` of containerd's registry configuration).
    ///
    /// # Errors
    /// [`Error::Node`] when no node runs here; write failures.
    pub fn trust_registry(&self, host: &str, ca_pem: &str) -> Result<(), Error> {
        let (Some(dir), Some(_)) = (&self.dir, &self.network) else {
            return Err(Error::Node("this control plane has no node".into()));
        };
        node::trust_registry(dir, host, ca_pem)
    }

    /// The admin kubeconfig file.
    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// The API server URL, `https://127.0.0.1:<port>`.
    pub fn server(&self) -> &str {
        &self.server
    }

    /// The state directory (`None` for a reused control plane).
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The cluster CA certificate file (`None` for a reused control plane).
    pub fn ca_file(&self) -> Option<PathBuf> {
        self.dir.as_ref().map(|d| d.join("pki/ca.crt"))
    }

    /// How long start-up took.
    pub fn started_in(&self) -> Duration {
        self.started_in
    }

    /// A new admin client. Build one per async runtime (per test): a client's connection pool
    /// belongs to the runtime it was created on.
    ///
    /// # Errors
    /// When the kubeconfig cannot be loaded.
    pub async fn client(&self) -> Result<Client, Error> {
        client_from_kubeconfig(&self.kubeconfig).await
    }

    /// The admin client configuration, to adapt (other credentials, impersonation, namespace).
    ///
    /// # Errors
    /// When the kubeconfig cannot be loaded.
    pub async fn config(&self) -> Result<kube::Config, Error> {
        config_from_kubeconfig(&self.kubeconfig).await
    }

    /// A `kubectl` command (from `bin/`) pointed at this control plane.
    ///
    /// # Errors
    /// When kubectl has not been built.
    pub fn kubectl(&self) -> Result<Command, Error> {
        let mut cmd = Command::new(process::binary("kubectl")?);
        cmd.env("KUBECONFIG", &self.kubeconfig);
        Ok(cmd)
    }

    /// Runs kubectl with `args` and returns its standard output.
    ///
    /// # Errors
    /// When it cannot be run or exits non-zero (the error carries its stderr).
    pub fn kubectl_output(&self, args: &[&str]) -> Result<String, Error> {
        let out = self
            .kubectl()?
            .args(args)
            .output()
            .map_err(Error::io("running kubectl"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(Error::Kubectl {
                args: args.join(" "),
                status: out.status.to_string(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            })
        }
    }

    /// Installs the Cluster API CRDs copied out of the `sigs.k8s.io/cluster-api` module by
    /// `hack/tools/build.sh cluster-api` (in `bin/capi-crds/`) and waits until they are
    /// Established.
    ///
    /// # Errors
    /// When the CRDs are missing, kubectl fails or they do not become Established.
    pub async fn install_capi_crds(&self) -> Result<(), Error> {
        let crds = process::bin_dir().join("capi-crds");
        if !crds.is_dir() {
            return Err(Error::BinaryMissing {
                name: "the Cluster API CRDs".into(),
                path: crds,
            });
        }
        let crds = crds.to_string_lossy().into_owned();
        let names = self.kubectl_output(&[
            "apply",
            "--server-side",
            "--force-conflicts",
            "-o",
            "name",
            "-f",
            &crds,
        ])?;
        let client = self.client().await?;
        let api: Api<CustomResourceDefinition> = Api::all(client);
        for name in names.lines().filter_map(|l| l.rsplit('/').next()) {
            wait_established(&api, name).await?;
        }
        Ok(())
    }

    /// Puts `pid` (a process the caller started against this control plane) in the reaper's
    /// list, so it is stopped with the control plane even when the owner dies without cleaning
    /// up. No-op for a reused control plane.
    ///
    /// # Errors
    /// When the list cannot be written.
    pub fn adopt(&self, pid: u32) -> Result<(), Error> {
        let Some(dir) = &self.dir else {
            return Ok(());
        };
        let mut pids = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join("pids"))
            .map_err(Error::io("recording a PID"))?;
        std::io::Write::write_all(&mut pids, format!("{pid}\n").as_bytes())
            .map_err(Error::io("recording a PID"))
    }

    /// Kills kube-apiserver (SIGKILL, as a crash would) and starts it again with the same
    /// flags, port and certificates; etcd and its data stay. Returns once `/readyz` passes again
    /// (within `timeout`). Clients reconnect by themselves; watches see their streams end.
    ///
    /// # Errors
    /// [`Error::NotRunning`] for a reused control plane; a start failure or a timeout, with the
    /// end of the new kube-apiserver's log.
    pub async fn restart_apiserver(&self, timeout: Duration) -> Result<Duration, Error> {
        let begun = Instant::now();
        let (Some(dir), Some((program, args))) = (&self.dir, &self.apiserver_recipe) else {
            return Err(Error::NotRunning {
                dir: self.kubeconfig.clone(),
            });
        };
        {
            let mut components = self.components.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(i) = components.iter().position(|c| c.name == "kube-apiserver") {
                let mut old = components.remove(i);
                old.kill();
            }
            let mut cmd = Command::new(program);
            cmd.args(args);
            components.push(Component::spawn(dir, "kube-apiserver", cmd)?);
        }
        let client = self.client().await?;
        loop {
            {
                let mut components = self.components.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(c) = components.iter_mut().find(|c| c.name == "kube-apiserver")
                    && let Some(status) = c.exited()
                {
                    return Err(c.died(Some(status)));
                }
            }
            let req = http::Request::get("/readyz")
                .body(Vec::new())
                .map_err(|e| Error::Shared(e.to_string()))?;
            if matches!(client.request_text(req).await.as_deref(), Ok("ok")) {
                return Ok(begun.elapsed());
            }
            if begun.elapsed() > timeout {
                let log = dir.join("logs/kube-apiserver.log");
                return Err(Error::Timeout {
                    what: format!("{}/readyz after a restart", self.server),
                    seconds: timeout.as_secs(),
                    log_tail: process::tail(&log, 25),
                    log,
                });
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops everything and removes the state directory (no-op for a reused control plane).
    pub fn stop(&self) {
        let mut components = self.components.lock().unwrap_or_else(|e| e.into_inner());
        for c in components.iter_mut().rev() {
            c.kill();
        }
        components.clear();
        if let Some(reaper) = self.reaper.lock().unwrap_or_else(|e| e.into_inner()).take() {
            reaper.finish();
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Applies CRDs (server-side apply) and waits until each is Established.
///
/// # Errors
/// When applying fails or a CRD is not Established within 30 s.
pub async fn install_crds(client: &Client, crds: &[CustomResourceDefinition]) -> Result<(), Error> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let params = PatchParams::apply("capm-test-support").force();
    for crd in crds {
        let name = crd.name_any();
        api.patch(&name, &params, &Patch::Apply(crd))
            .await
            .map_err(Error::kube(format!("applying CRD {name}")))?;
    }
    for crd in crds {
        wait_established(&api, &crd.name_any()).await?;
    }
    Ok(())
}

async fn wait_established(api: &Api<CustomResourceDefinition>, name: &str) -> Result<(), Error> {
    let established = await_condition(api.clone(), name, conditions::is_crd_established());
    match tokio::time::timeout(Duration::from_secs(30), established).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(e)) => Err(Error::Shared(format!("waiting for CRD {name}: {e}"))),
        Err(_) => Err(Error::Timeout {
            what: format!("CRD {name} to become Established"),
            seconds: 30,
            log: PathBuf::new(),
            log_tail: String::new(),
        }),
    }
}

static SHARED: OnceLock<Result<ControlPlane, String>> = OnceLock::new();

/// The control plane shared by every test in this process: the one named by `$CAPM_KUBECONFIG`
/// if set, otherwise one started on first use (on its own thread and runtime, so it outlives any
/// single test's runtime) and removed by its reaper when the process exits.
///
/// Blocking; fine to call from `#[tokio::test]` functions.
///
/// # Errors
/// Why start-up failed (every later call returns the same message).
pub fn shared() -> Result<&'static ControlPlane, Error> {
    SHARED
        .get_or_init(|| {
            std::thread::spawn(|| {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(|e| e.to_string())?;
                rt.block_on(async {
                    match std::env::var_os("CAPM_KUBECONFIG") {
                        Some(path) => ControlPlane::existing(PathBuf::from(path)).await,
                        None => ControlPlane::start(Options::default()).await,
                    }
                })
                .map_err(|e| e.to_string())
            })
            .join()
            .unwrap_or_else(|_| Err("the start-up thread panicked".into()))
        })
        .as_ref()
        .map_err(|e| Error::Shared(e.clone()))
}
