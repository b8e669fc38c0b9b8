//! The soak test's world: the control plane and Cluster API, the lanes (a backend, its mail
//! server, two provider replicas, a namespace), the plans and how a round runs and is judged.
//! The remediation lane's part: [`repair`].

mod repair;

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
    future::Future,
    path::{Path, PathBuf},
    pin::Pin,
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use capm_e2e::{Proc, http_get, provider_binary, start_capi_manager};
use capm_mail_servers::{
    FailureMode, FailureRule, FailureTarget, MailgunServer, SmtpOptions, SmtpServer,
};
use capm_test_support::{ControlPlane, Options, install_crds, provider::Launch};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::{
    Api, Client, ResourceExt,
    api::{
        ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
        PostParams,
    },
    core::ObjectMeta,
};
use rand::{RngExt as _, rngs::StdRng};
use serde_json::{Value, json};

use capm_e2e::ledger::{Backend, Kind, Ledger, Object, Received, Violation};

const DOMAIN: &str = "mg.soak.test";
const API_KEY: &str = "key-soak";
const RECIPIENT: &str = "ops@example.com";
const FIELD_MANAGER: &str = "capm-soak";
const MAX_CLUSTERS: usize = 3;
const MAX_REPLICAS: u32 = 3;
const SETTLE_TIMEOUT: Duration = Duration::from_secs(150);
const QUIET_WINDOW: Duration = Duration::from_secs(3);
const INFRA_GROUP: &str = "infrastructure.cluster.x-k8s.io";
const CAPI_GROUP: &str = "cluster.x-k8s.io";
/// The Mailgun lane's tenants: each a `MailgunClusterIdentity` on its own contract server (its
/// own domain and key), beside the provider's own configuration (the default identity).
const TENANTS: [&str; 2] = ["soak-tenant-a", "soak-tenant-b"];

/// The kinds whose objects a lane judges: the ledger's (a request and a release) and
/// `MailgunRemediation` (its mails judged apart: [`capm_e2e::ledger::Ledger::check_repairs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Judged {
    Ours(Kind),
    Remediation,
}

impl Judged {
    const ALL: [Judged; 3] = [
        Judged::Ours(Kind::Cluster),
        Judged::Ours(Kind::Machine),
        Judged::Remediation,
    ];

    fn name(self) -> &'static str {
        match self {
            Self::Ours(kind) => kind.name(),
            Self::Remediation => "MailgunRemediation",
        }
    }

    /// The `controller` label of its metrics.
    fn controller(self) -> &'static str {
        match self {
            Self::Ours(kind) => kind.controller(),
            Self::Remediation => "mailgunremediation",
        }
    }
}

/// The lane's view of a kind, for dynamic APIs.
fn resource(group: &str, version: &str, kind: &str) -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(group, version, kind))
}

type BoxFuture<'a> = Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;

/// Everything both lanes share.
pub struct World {
    cp: Arc<ControlPlane>,
    client: Client,
    capi: Proc,
    /// Logs of the core manager and the providers: inside the control plane's state
    /// directory, so its reaper removes them whatever happens to this test.
    dir: PathBuf,
}

impl World {
    /// Starts the control plane, installs the CRDs and starts the Cluster API core manager.
    pub async fn start() -> Result<Self> {
        let cp = ControlPlane::start(Options::default()).await?;
        let dir = cp
            .dir()
            .context("a started control plane has a directory")?
            .join("soak");
        std::fs::create_dir_all(&dir)?;
        cp.install_capi_crds().await?;
        let client = cp.client().await?;
        install_crds(&client, &capm_api::crd::crds()?).await?;
        let capi = start_capi_manager(cp.kubeconfig(), &dir)?;
        cp.adopt(capi.pid())?;
        Ok(Self {
            cp: Arc::new(cp),
            client,
            capi,
            dir,
        })
    }
}

impl World {
    /// Copies every log under the control plane's state directory (the API server's, etcd's,
    /// the Cluster API manager's, every replica's of both lanes, each generation) to
    /// `CARGO_TARGET_TMPDIR/soak-<what>`, keeping their paths: the reaper removes the state
    /// directory whatever happens, and a violation is read afterwards.
    fn keep_logs(&self, what: &str) -> Result<PathBuf> {
        let root = self
            .cp
            .dir()
            .context("a started control plane has a directory")?;
        let kept = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("soak-{what}"));
        capm_e2e::keep_logs(root, &kept)?;
        Ok(kept)
    }
}

/// A human's intent for one cluster of a lane.
#[derive(Debug, Clone)]
struct ClusterIntent {
    paused: bool,
    replicas: u32,
}

/// A backend fault.
#[derive(Debug, Clone, Copy)]
enum Fault {
    /// A definitive refusal before acceptance: nothing stored. Mailgun: 500 (the client cannot
    /// tell, the events API can) when `server_error`, else 429.
    Refuse { server_error: bool },
    /// Store, then never answer.
    Hang,
    /// Never greet a new connection (SMTP only): nothing stored.
    NoGreeting,
    /// Answer late, within the client timeout.
    Slow(Duration),
}

/// One planned operation of a lane.
#[derive(Debug, Clone)]
enum Op {
    Create {
        cluster: String,
        replicas: u32,
        /// The tenant (index into the lane's) whose identity its `MailgunCluster` names.
        tenant: Option<usize>,
    },
    Delete {
        cluster: String,
        unpause: bool,
    },
    Scale {
        cluster: String,
        replicas: u32,
    },
    Burst {
        cluster: String,
        up: u32,
        down: u32,
    },
    Pause {
        cluster: String,
    },
    Unpause {
        cluster: String,
    },
    Fault {
        fault: Fault,
        lasts: Duration,
    },
    KillLeader {
        restart_after: Duration,
    },
    FreezeLeader {
        lasts: Duration,
    },
    /// Cuts the leader off the API server (its proxy closes every connection) for a while.
    PartitionLeader {
        lasts: Duration,
    },
    /// The health check finds a Machine of `cluster` (the `pick`th of those whose request went
    /// out) unhealthy and makes its `MailgunRemediation` number `number`; `built`: the human
    /// built the Machine first.
    Remediate {
        number: u32,
        cluster: String,
        pick: u32,
        built: bool,
    },
    /// Remediation `number`'s fate (an answer, a recovery).
    Resolve {
        number: u32,
        fate: repair::Fate,
    },
    /// Rotates a tenant's key in its Secret (the account key and the domain sending key take
    /// turns; the server accepts both, as Mailgun does while both exist).
    RotateKey {
        tenant: usize,
    },
    /// Deletes a tenant's identity, then creates it again after a while.
    DeleteIdentity {
        tenant: usize,
        lasts: Duration,
    },
    Sleep(Duration),
}

/// A lane's operations for one round.
#[derive(Debug, Clone)]
pub struct Plan {
    ops: Vec<Op>,
}

/// One provider process.
struct Replica {
    proc: Proc,
    /// The only way it reaches the API server.
    proxy: capm_test_support::proxy::TcpProxy,
    metrics: String,
    name: String,
    frozen: bool,
    /// `capm_mail_resends_total` per kind at the last reading.
    resends: BTreeMap<Judged, u64>,
    /// Killed by the test: its resends are counted already, and it is replaced no earlier.
    killed: Option<Instant>,
}

enum Server {
    Mailgun(MailgunServer),
    Smtp(Mutex<SmtpServer>),
}

/// A tenant of the Mailgun lane: its identity, its Secret and its own contract server.
struct Tenant {
    identity: String,
    domain: String,
    server: MailgunServer,
    /// Clusters whose `MailgunCluster` names this tenant's identity.
    clusters: Mutex<BTreeSet<String>>,
    /// Whether the Secret holds the domain sending key now (else the account key).
    sending_key: Mutex<bool>,
}

impl Tenant {
    fn secret(&self) -> String {
        format!("{}-mailgun", self.identity)
    }

    fn owns(&self, object_name: &str) -> bool {
        lock(&self.clusters)
            .iter()
            .any(|c| object_name == c || object_name.starts_with(&format!("{c}-")))
    }
}

/// One backend, its server, its namespace and its two provider replicas.
pub struct Lane {
    backend: Backend,
    ns: String,
    client: Client,
    server: Server,
    /// The Mailgun lane's tenants (none for SMTP).
    tenants: Vec<Tenant>,
    /// Key rotations and identity deletions played so far.
    tenant_changes: Mutex<(u32, u32)>,
    /// Freezes aimed mid-send, and those that stopped the leader at its commit point.
    mid_send: Mutex<(u32, u32)>,
    /// Delivery news written in quiet windows, by object UID.
    delivery_news: Mutex<BTreeMap<String, u32>>,
    config: PathBuf,
    logs: PathBuf,
    /// The control plane: its reaper also stops the providers if this test dies.
    cp: Arc<ControlPlane>,
    replicas: Mutex<Vec<Replica>>,
    started: Mutex<usize>,
    /// Resends counted by processes that were killed (read right before).
    retired_resends: Mutex<BTreeMap<Judged, u64>>,
    /// Partitions played so far (a leader cut off the API server).
    partitions: Mutex<u32>,
    intent: BTreeMap<String, ClusterIntent>,
    deleted: BTreeSet<String>,
    next_cluster: usize,
    /// Remediations planned so far, and the fates planned for them: (round, number, fate).
    next_remedy: u32,
    fates: Vec<(u64, u32, repair::Fate)>,
    /// The remediations made, by number.
    remedies: Mutex<BTreeMap<u32, repair::Remedy>>,
    fulfilled: Mutex<BTreeSet<String>>,
    /// Deleted clusters whose MailgunCluster was left without owner (deleted by the test).
    orphans: Mutex<BTreeSet<String>>,
    /// Ledger violations already reported (with `SOAK_KEEP_GOING`, each is reported once).
    reported: Mutex<BTreeSet<String>>,
    log: Mutex<Vec<String>>,
    round_start: Mutex<Instant>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The samples of `name` in a Prometheus exposition, by their `controller` label (empty when
/// there is none).
fn samples(exposition: &str, name: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in exposition.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !rest.starts_with(['{', ' ']) {
            continue;
        }
        let Some((labels, value)) = rest.rsplit_once(' ') else {
            continue;
        };
        let controller = labels
            .split_once("controller=\"")
            .and_then(|(_, r)| r.split_once('"'))
            .map(|(c, _)| c.to_owned())
            .unwrap_or_default();
        if let Ok(v) = value.parse::<f64>() {
            *out.entry(controller).or_insert(0.0) += v;
        }
    }
    out
}

impl Replica {
    fn scrape(&self) -> Option<String> {
        match http_get(&self.metrics, "/metrics") {
            Ok((200, body)) => Some(body),
            _ => None,
        }
    }

    /// Reads `capm_mail_resends_total` (kept from the last reading when unreachable).
    fn read_resends(&mut self) {
        if self.frozen {
            return;
        }
        if let Some(text) = self.scrape() {
            let s = samples(&text, "capm_mail_resends_total");
            for kind in Judged::ALL {
                let v = s.get(kind.controller()).copied().unwrap_or(0.0);
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                self.resends.insert(kind, v as u64);
            }
        }
    }

    /// This process's resends: the larger of its last `capm_mail_resends_total` reading and
    /// the resend warnings in its log (a process that died on its own cannot be read any more).
    fn counted_resends(&self) -> BTreeMap<Judged, u64> {
        let log = self.proc.log();
        Judged::ALL
            .into_iter()
            .map(|kind| {
                let logged = log
                    .lines()
                    .filter(|l| l.contains("same Message-Id") && l.contains(kind.name()))
                    .count() as u64;
                let read = self.resends.get(&kind).copied().unwrap_or(0);
                (kind, read.max(logged))
            })
            .collect()
    }

    fn leads(&self) -> bool {
        !self.frozen
            && self.scrape().is_some_and(|t| {
                samples(&t, "leader_election_master_status")
                    .values()
                    .sum::<f64>()
                    >= 1.0
            })
    }
}

/// Decodes a quoted-printable body (soft breaks and `=XX`); other bodies pass unchanged.
fn decode_qp(body: &str, qp: bool) -> String {
    if !qp {
        return body.to_owned();
    }
    let joined = body.replace("=\r\n", "").replace("=\n", "");
    let bytes = joined.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'='
            && i + 2 < bytes.len()
            && let Ok(b) = u8::from_str_radix(&joined[i + 1..i + 3], 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The object name and namespace in the `kubectl patch <kind> <name> -n <ns>` line of a mail.
fn fulfil_target(body: &str) -> Option<(String, String)> {
    let line = body
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("kubectl patch "))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let name = words.get(3)?;
    let ns = words
        .iter()
        .position(|w| *w == "-n")
        .and_then(|i| words.get(i + 1))?;
    Some(((*name).to_owned(), (*ns).to_owned()))
}

/// A mail as the lane's server stored it, with its body for the fulfilling human.
struct Mail {
    received: Received,
    body: String,
    /// Which tenant's server stored it (`None`: the lane's own).
    server: Option<usize>,
}

/// Retries a Kubernetes call while the API server is away (a restart), up to 60 s.
async fn retry<T, F, Fut>(what: &str, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, kube::Error>>,
{
    let begun = Instant::now();
    loop {
        match f().await {
            Ok(v) => return Ok(v),
            Err(e) if begun.elapsed() < Duration::from_secs(60) => {
                let transient = !matches!(&e, kube::Error::Api(s) if s.code < 500 && s.code != 429);
                if !transient {
                    return Err(e).with_context(|| what.to_owned());
                }
                tokio::time::sleep(Duration::from_millis(300)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("{what} (for 60 s)")),
        }
    }
}

fn is_status(e: &anyhow::Error, code: u16) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<kube::Error>()
            .is_some_and(|k| matches!(k, kube::Error::Api(s) if s.code == code))
    })
}

impl Lane {
    /// Starts the lane's mail server and two provider replicas in a fresh namespace.
    pub async fn start(world: &World, backend: Backend) -> Result<Self> {
        let ns = format!("soak-{backend}");
        let namespaces: Api<Namespace> = Api::all(world.client.clone());
        namespaces
            .create(
                &PostParams::default(),
                &Namespace {
                    metadata: ObjectMeta {
                        name: Some(ns.clone()),
                        ..ObjectMeta::default()
                    },
                    ..Namespace::default()
                },
            )
            .await?;
        let logs = world.dir.join(backend.to_string());
        std::fs::create_dir_all(&logs)?;
        let config = logs.join("config.json");
        let (server, mailer) = match backend {
            Backend::Mailgun => {
                let server = MailgunServer::start(API_KEY, DOMAIN)?;
                let mailer = json!({"mailgun": {
                    "domain": DOMAIN, "baseUrl": server.base_url(), "apiKey": {"env": "MAILGUN_API_KEY"},
                    "connectTimeoutSeconds": 2, "requestTimeoutSeconds": 5,
                }});
                (Server::Mailgun(server), mailer)
            }
            Backend::Smtp => {
                let server = SmtpServer::start(SmtpOptions::default())?;
                let mailer = json!({"smtp": {"url": server.url(), "starttls": "never", "timeoutSeconds": 5}});
                (Server::Smtp(Mutex::new(server)), mailer)
            }
        };
        std::fs::write(
            &config,
            json!({ "mailer": mailer, "mailFrom": format!("capm@{DOMAIN}") }).to_string(),
        )?;
        let mut cfg = world.cp.config().await?;
        cfg.default_namespace = ns.clone();
        let client = Client::try_from(cfg)?;
        let mut tenants = Vec::new();
        if backend == Backend::Mailgun {
            for identity in TENANTS {
                let domain = format!("{identity}.soak.test");
                tenants.push(Tenant {
                    server: MailgunServer::start(&format!("key-{identity}"), &domain)?,
                    identity: identity.to_owned(),
                    domain,
                    clusters: Mutex::new(BTreeSet::new()),
                    sending_key: Mutex::new(false),
                });
            }
        }

        let lane = Self {
            backend,
            ns,
            client,
            server,
            tenants,
            tenant_changes: Mutex::new((0, 0)),
            delivery_news: Mutex::new(BTreeMap::new()),
            mid_send: Mutex::new((0, 0)),
            config,
            logs,
            cp: Arc::clone(&world.cp),
            replicas: Mutex::new(Vec::new()),
            started: Mutex::new(0),
            retired_resends: Mutex::new(BTreeMap::new()),
            partitions: Mutex::new(0),
            intent: BTreeMap::new(),
            deleted: BTreeSet::new(),
            next_cluster: 0,
            next_remedy: 0,
            fates: Vec::new(),
            remedies: Mutex::new(BTreeMap::new()),
            fulfilled: Mutex::new(BTreeSet::new()),
            orphans: Mutex::new(BTreeSet::new()),
            reported: Mutex::new(BTreeSet::new()),
            log: Mutex::new(Vec::new()),
            round_start: Mutex::new(Instant::now()),
        };
        for tenant in &lane.tenants {
            let secret: Secret = serde_json::from_value(json!({
                "metadata": {"name": tenant.secret(), "namespace": lane.ns,
                    "labels": {capm_api::names::IDENTITY_SECRET_LABEL: tenant.identity}},
                "stringData": {"api-key": tenant.server.api_key()},
            }))?;
            Api::<Secret>::namespaced(lane.client.clone(), &lane.ns)
                .create(&PostParams::default(), &secret)
                .await?;
            lane.create_identity(tenant).await?;
        }
        for _ in 0..2 {
            let replica = lane.spawn_replica()?;
            lock(&lane.replicas).push(replica);
        }
        Ok(lane)
    }

    fn spawn_replica(&self) -> Result<Replica> {
        let n = {
            let mut started = lock(&self.started);
            *started += 1;
            *started
        };
        let name = format!("{}-{n}", self.backend);
        let kubeconfig = self.logs.join(format!("{name}.kubeconfig"));
        let proxy = capm_test_support::proxy::in_front_of_api_server(&self.cp, &kubeconfig)?;
        let (launch, ports) = Launch::new(provider_binary()?, &kubeconfig).on_free_ports()?;
        let metrics = ports.metrics.to_string();
        let cmd = launch
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env("MAIL_RECIPIENT", RECIPIENT)
            .env("MAILGUN_API_KEY", API_KEY)
            .env("CAPM_FAILPOINT_FILE", self.failpoint_file(&name))
            .args([
                "--namespace",
                &self.ns,
                "--leader-election-namespace",
                &self.ns,
            ])
            .arg("--leader-elect=true")
            .args(["--webhook-port", "0", "--shutdown-timeout", "10s"])
            .args(["--message-id-domain", DOMAIN])
            .args(["--identity-secret-namespace", &self.ns])
            // The tenants' contract servers.
            .args(["--identity-mailgun-hosts", "127.0.0.1"])
            .arg("--config")
            .arg(&self.config)
            .command();
        let proc = Proc::spawn(&name, cmd, self.logs.join(format!("{name}.log")))?;
        self.cp.adopt(proc.pid())?;
        Ok(Replica {
            proc,
            proxy,
            metrics,
            name,
            frozen: false,
            resends: BTreeMap::new(),
            killed: None,
        })
    }

    fn api(&self, group: &str, version: &str, kind: &str) -> Api<DynamicObject> {
        Api::namespaced_with(
            self.client.clone(),
            &self.ns,
            &resource(group, version, kind),
        )
    }

    fn clusters(&self) -> Api<DynamicObject> {
        self.api(CAPI_GROUP, "v1beta2", "Cluster")
    }

    fn deployments(&self) -> Api<DynamicObject> {
        self.api(CAPI_GROUP, "v1beta2", "MachineDeployment")
    }

    fn identities(&self) -> Api<DynamicObject> {
        Api::all_with(
            self.client.clone(),
            &resource(INFRA_GROUP, "v1beta1", "MailgunClusterIdentity"),
        )
    }

    /// Creates `tenant`'s identity: its contract server, its Secret, this lane's namespace only.
    async fn create_identity(&self, tenant: &Tenant) -> Result<()> {
        let identity: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunClusterIdentity",
            "metadata": {"name": tenant.identity},
            "spec": {
                "mailgun": {"domain": tenant.domain, "baseURL": tenant.server.base_url(),
                    "apiKeySecretRef": {"name": tenant.secret(), "key": "api-key"}},
                "recipients": [RECIPIENT],
                "allowedNamespaces": {"list": [self.ns]},
            },
        }))?;
        let (api, pp) = (self.identities(), PostParams::default());
        match retry("creating an identity", || api.create(&pp, &identity)).await {
            Err(e) if is_status(&e, 409) => Ok(()),
            other => other.map(drop),
        }
    }

    /// The account key and the domain sending key take turns in `tenant`'s Secret.
    async fn rotate_key(&self, tenant: &Tenant) -> Result<()> {
        let sending = {
            let mut sending = lock(&tenant.sending_key);
            *sending = !*sending;
            *sending
        };
        let key = if sending {
            tenant.server.sending_key()
        } else {
            tenant.server.api_key().to_owned()
        };
        lock(&self.tenant_changes).0 += 1;
        self.note(format!(
            "rotate {}'s key to its {} key",
            tenant.identity,
            if sending { "sending" } else { "account" }
        ));
        let api = Api::<Secret>::namespaced(self.client.clone(), &self.ns);
        let patch = json!({"stringData": {"api-key": key}});
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        let (name, patch) = (tenant.secret(), Patch::Merge(&patch));
        retry("rotating a key", || api.patch(&name, &params, &patch))
            .await
            .map(drop)
    }

    /// Deletes `tenant`'s identity, and creates it again after `lasts`.
    async fn delete_identity(&self, tenant: &Tenant, lasts: Duration) -> Result<()> {
        lock(&self.tenant_changes).1 += 1;
        self.note(format!(
            "delete identity {} for {:.1} s",
            tenant.identity,
            lasts.as_secs_f64()
        ));
        let (api, dp) = (self.identities(), DeleteParams::default());
        match retry("deleting an identity", || api.delete(&tenant.identity, &dp)).await {
            Err(e) if is_status(&e, 404) => {}
            other => {
                other?;
            }
        }
        tokio::time::sleep(lasts).await;
        self.create_identity(tenant).await?;
        self.note(format!("identity {} back", tenant.identity));
        Ok(())
    }

    fn infra(&self, kind: Kind) -> Api<DynamicObject> {
        self.api(INFRA_GROUP, "v1beta1", kind.name())
    }

    fn note(&self, what: impl AsRef<str>) {
        let at = lock(&self.round_start).elapsed().as_secs_f64();
        lock(&self.log).push(format!("  +{at:6.2}s [{}] {}", self.backend, what.as_ref()));
    }

    // ---- planning -----------------------------------------------------------------------

    /// Plans a round from the seed only, updating the lane's intent.
    pub fn plan(&mut self, rng: &mut StdRng, round: u64) -> Plan {
        let mut ops = Vec::new();
        let n = rng.random_range(2..=5);
        let fault_at = rng.random_bool(0.35).then(|| rng.random_range(0..n));
        let chaos = rng.random_range(0..100u32);
        let chaos_at = rng.random_range(0..n);
        for i in 0..n {
            if fault_at == Some(i) {
                let fault = match (rng.random_range(0..4u32), self.backend) {
                    (0, _) => Fault::Refuse {
                        server_error: rng.random_bool(0.5),
                    },
                    (1, _) => Fault::Hang,
                    (2, Backend::Smtp) => Fault::NoGreeting,
                    _ => Fault::Slow(Duration::from_millis(rng.random_range(500..2500))),
                };
                ops.push(Op::Fault {
                    fault,
                    lasts: Duration::from_millis(rng.random_range(2000..6000)),
                });
            }
            // The remediation lane's pool is its own: never scaled, paused or deleted here.
            let live: Vec<String> = (self.intent.keys())
                .filter(|c| c.as_str() != repair::REPAIR_POOL)
                .cloned()
                .collect();
            let pick = |rng: &mut StdRng| live[rng.random_range(0..live.len())].clone();
            let choice = rng.random_range(0..100u32);
            let op = if live.is_empty() || (choice < 25 && live.len() < MAX_CLUSTERS) {
                self.next_cluster += 1;
                let cluster = format!("r{round}c{}", self.next_cluster);
                let replicas = rng.random_range(0..=MAX_REPLICAS);
                self.intent.insert(
                    cluster.clone(),
                    ClusterIntent {
                        paused: false,
                        replicas,
                    },
                );
                // A third of the clusters each: the default identity and each tenant's.
                let tenant = (!self.tenants.is_empty())
                    .then(|| rng.random_range(0..=self.tenants.len()))
                    .and_then(|t| t.checked_sub(1));
                Op::Create {
                    cluster,
                    replicas,
                    tenant,
                }
            } else if choice < 40 {
                let cluster = pick(rng);
                let intent = self.intent.remove(&cluster);
                self.deleted.insert(cluster.clone());
                Op::Delete {
                    cluster,
                    unpause: intent.is_some_and(|i| i.paused),
                }
            } else if choice < 60 {
                let cluster = pick(rng);
                let replicas = rng.random_range(0..=MAX_REPLICAS);
                if let Some(i) = self.intent.get_mut(&cluster) {
                    i.replicas = replicas;
                }
                Op::Scale { cluster, replicas }
            } else if choice < 85 {
                let cluster = pick(rng);
                let up = rng.random_range(2..=MAX_REPLICAS);
                let down = rng.random_range(0..up);
                if let Some(i) = self.intent.get_mut(&cluster) {
                    i.replicas = down;
                }
                Op::Burst { cluster, up, down }
            } else {
                let cluster = pick(rng);
                let paused = self.intent.get(&cluster).is_some_and(|i| i.paused);
                if let Some(i) = self.intent.get_mut(&cluster) {
                    i.paused = !paused;
                }
                if paused {
                    Op::Unpause { cluster }
                } else {
                    Op::Pause { cluster }
                }
            };
            ops.push(op);
            if chaos_at == i && (34..50).contains(&chaos) && !self.tenants.is_empty() {
                // A tenant's key rotated, or its identity deleted, while its mails are in
                // flight.
                let tenant = rng.random_range(0..self.tenants.len());
                ops.push(Op::Sleep(Duration::from_millis(rng.random_range(0..400))));
                ops.push(if chaos < 42 {
                    Op::RotateKey { tenant }
                } else {
                    Op::DeleteIdentity {
                        tenant,
                        lasts: Duration::from_millis(rng.random_range(2000..8000)),
                    }
                });
            }
            if chaos_at == i && (24..34).contains(&chaos) {
                // A partition: the leader's watches end, its writes and Lease renewals fail;
                // longer than the renew deadline, the standby takes over.
                ops.push(Op::Sleep(Duration::from_millis(rng.random_range(0..400))));
                ops.push(Op::PartitionLeader {
                    lasts: Duration::from_secs(rng.random_range(3..=20)),
                });
            }
            if chaos_at == i && chaos < 24 {
                // Strike while the operation's mails are in flight; a freeze often comes with
                // a slow backend, so that sends are still waiting for their answer.
                if chaos < 12 && fault_at.is_none() && rng.random_bool(0.6) {
                    ops.push(Op::Fault {
                        fault: Fault::Slow(Duration::from_millis(rng.random_range(1000..3000))),
                        lasts: Duration::from_millis(rng.random_range(3000..6000)),
                    });
                }
                ops.push(Op::Sleep(Duration::from_millis(rng.random_range(0..400))));
                ops.push(if chaos < 12 {
                    Op::FreezeLeader {
                        lasts: Duration::from_secs(rng.random_range(15..=25)),
                    }
                } else {
                    Op::KillLeader {
                        restart_after: Duration::from_millis(rng.random_range(0..2000)),
                    }
                });
            }
            ops.push(Op::Sleep(Duration::from_millis(rng.random_range(0..1200))));
        }
        Plan { ops }
    }

    /// The last plan: every cluster unpaused and deleted.
    pub fn plan_teardown(&mut self) -> Plan {
        let ops = std::mem::take(&mut self.intent)
            .into_iter()
            .map(|(cluster, intent)| {
                self.deleted.insert(cluster.clone());
                Op::Delete {
                    cluster,
                    unpause: intent.paused,
                }
            })
            .collect();
        Plan { ops }
    }

    // ---- executing ----------------------------------------------------------------------

    async fn create(&self, cluster: &str, replicas: u32, tenant: Option<usize>) -> Result<()> {
        let mut spec = json!({"priority": "Urgent", "request": format!("Soak cluster {cluster}, please."), "requester": "soak@example.com"});
        if let Some(t) = tenant {
            let tenant = &self.tenants[t];
            lock(&tenant.clusters).insert(cluster.to_owned());
            spec["identityRef"] =
                json!({"kind": "MailgunClusterIdentity", "name": tenant.identity});
        }
        // One template per cluster: Cluster API makes the Cluster an owner of the templates its
        // MachineDeployments use, so a shared one would be collected with the last Cluster.
        let objects = [
            (
                self.api(INFRA_GROUP, "v1beta1", "MailgunMachineTemplate"),
                json!({
                    "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunMachineTemplate",
                    "metadata": {"name": cluster, "namespace": self.ns},
                    "spec": {"template": {"spec": {"priority": "Urgent", "request": format!("One worker for {cluster}, please."), "requester": "soak@example.com"}}},
                }),
            ),
            (
                self.infra(Kind::Cluster),
                json!({
                    "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunCluster",
                    "metadata": {"name": cluster, "namespace": self.ns},
                    "spec": spec,
                }),
            ),
            (
                self.clusters(),
                json!({
                    "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
                    "metadata": {"name": cluster, "namespace": self.ns},
                    "spec": {"infrastructureRef": {"apiGroup": INFRA_GROUP, "kind": "MailgunCluster", "name": cluster}},
                }),
            ),
            (
                self.deployments(),
                json!({
                    "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineDeployment",
                    // The cluster-name label is what Cluster API's defaulting webhook would add;
                    // without it an unpaused Cluster does not wake a MachineDeployment that was
                    // created while it was paused (the Cluster → MachineDeployment mapping
                    // selects by it).
                    "metadata": {"name": cluster, "namespace": self.ns, "labels": {"cluster.x-k8s.io/cluster-name": cluster}},
                    "spec": {
                        "clusterName": cluster,
                        "replicas": replicas,
                        // What Cluster API's defaulting webhook would set (its webhooks are not
                        // registered with this API server).
                        "rollout": {"strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}},
                        "selector": {"matchLabels": {"soak.capm.test/pool": cluster}},
                        "template": {
                            "metadata": {"labels": {"soak.capm.test/pool": cluster}},
                            "spec": {
                                "clusterName": cluster,
                                "bootstrap": {"dataSecretName": format!("{cluster}-bootstrap")},
                                "infrastructureRef": {"apiGroup": INFRA_GROUP, "kind": "MailgunMachineTemplate", "name": cluster},
                            },
                        },
                    },
                }),
            ),
        ];
        let pp = PostParams::default();
        for (api, object) in objects {
            let object: DynamicObject = serde_json::from_value(object)?;
            let created = retry("creating", || api.create(&pp, &object)).await;
            match created {
                Ok(_) => {}
                Err(e) if is_status(&e, 409) => {} // a retry after the API server took it
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    async fn patch(&self, api: &Api<DynamicObject>, name: &str, patch: Value) -> Result<()> {
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.into()),
            ..PatchParams::default()
        };
        let patch = Patch::Merge(&patch);
        retry("patching", || api.patch(name, &params, &patch))
            .await
            .map(drop)
    }

    async fn set_paused(&self, cluster: &str, paused: bool) -> Result<()> {
        self.patch(
            &self.clusters(),
            cluster,
            json!({"spec": {"paused": paused}}),
        )
        .await
    }

    async fn scale(&self, cluster: &str, replicas: u32) -> Result<()> {
        self.patch(
            &self.deployments(),
            cluster,
            json!({"spec": {"replicas": replicas}}),
        )
        .await
    }

    async fn delete(&self, cluster: &str) -> Result<()> {
        let (api, dp) = (self.clusters(), DeleteParams::default());
        match retry("deleting", || api.delete(cluster, &dp)).await {
            Err(e) if is_status(&e, 404) => Ok(()),
            other => other.map(drop),
        }
    }

    /// The replica that leads now (waits up to 5 s for one to say so).
    async fn leader(&self) -> Option<usize> {
        for _ in 0..20 {
            let found = {
                let replicas = lock(&self.replicas);
                replicas.iter().position(Replica::leads)
            };
            if found.is_some() {
                return found;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        None
    }

    async fn kill_leader(&self, restart_after: Duration) -> Result<()> {
        let Some(i) = self.leader().await else {
            self.note("kill: no replica leads; skipped");
            return Ok(());
        };
        {
            let mut replicas = lock(&self.replicas);
            let victim = &mut replicas[i];
            victim.read_resends();
            victim.proc.kill_now();
            victim.killed = Some(Instant::now() + restart_after);
            let mut retired = lock(&self.retired_resends);
            for (kind, n) in victim.counted_resends() {
                *retired.entry(kind).or_insert(0) += n;
            }
            self.note(format!(
                "SIGKILL leader {} (pid {})",
                victim.name,
                victim.proc.pid()
            ));
        }
        Ok(())
    }

    async fn partition_leader(&self, lasts: Duration) -> Result<()> {
        let Some(i) = self.leader().await else {
            self.note("partition: no replica leads; skipped");
            return Ok(());
        };
        let name = {
            let replicas = lock(&self.replicas);
            replicas[i].proxy.cut();
            replicas[i].name.clone()
        };
        self.note(format!(
            "partition: {name} cut off the API server for {lasts:?}"
        ));
        *lock(&self.partitions) += 1;
        tokio::time::sleep(lasts).await;
        // The replica may have exited (a lost Lease) and been replaced meanwhile: its proxy
        // went with it.
        if let Some(r) = lock(&self.replicas).iter().find(|r| r.name == name) {
            r.proxy.restore();
        }
        self.note(format!("partition: {name} reconnected"));
        Ok(())
    }

    async fn freeze_leader(&self, lasts: Duration) -> Result<()> {
        let Some(i) = self.leader().await else {
            self.note("freeze: no replica leads; skipped");
            return Ok(());
        };
        // Odd lengths strike mid-send (a plan's shape does not depend on it, so seeds replay).
        let mid_send = lasts.as_secs() % 2 == 1;
        let (name, pid, failpoint) = {
            let mut replicas = lock(&self.replicas);
            let victim = &mut replicas[i];
            victim.read_resends();
            (
                victim.name.clone(),
                victim.proc.pid(),
                self.failpoint_file(&victim.name),
            )
        };
        let mut how = "SIGSTOP";
        if mid_send {
            std::fs::write(&failpoint, "before-commit:stop")?;
            let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
            while !capm_test_support::process::is_stopped(pid)
                && tokio::time::Instant::now() < deadline
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            // Disarmed either way: the replica removes the file when it stops on it.
            let _ = std::fs::remove_file(&failpoint);
            let hit = capm_test_support::process::is_stopped(pid);
            if hit {
                how = "stopped itself mid-send (before its commit point):";
            }
            let mut tried = lock(&self.mid_send);
            tried.0 += 1;
            tried.1 += u32::from(hit);
        }
        {
            let mut replicas = lock(&self.replicas);
            let victim = &mut replicas[i];
            if !capm_test_support::process::is_stopped(pid) {
                victim.proc.signal("STOP")?;
            }
            victim.frozen = true;
        }
        self.note(format!(
            "{how} leader {name} for {:.0} s",
            lasts.as_secs_f64()
        ));
        tokio::time::sleep(lasts).await;
        {
            let mut replicas = lock(&self.replicas);
            let victim = &mut replicas[i];
            victim.proc.signal("CONT")?;
            victim.frozen = false;
        }
        self.note(format!("SIGCONT {name}"));
        Ok(())
    }

    /// The file that arms a replica's failpoints while it runs (`CAPM_FAILPOINT_FILE`).
    fn failpoint_file(&self, replica: &str) -> PathBuf {
        self.logs.join(format!("{replica}.failpoint"))
    }

    async fn fault(&self, fault: Fault, lasts: Duration) -> Result<()> {
        self.note(format!(
            "backend fault {fault:?} for {:.1} s",
            lasts.as_secs_f64()
        ));
        match &self.server {
            Server::Mailgun(server) => match fault {
                Fault::Refuse { server_error } => server.set_failure(FailureRule {
                    mode: if server_error {
                        FailureMode::ServerError
                    } else {
                        FailureMode::RateLimited
                    },
                    count: None,
                    retry_after: Some(1),
                    target: FailureTarget::Messages,
                    body_bytes: None,
                    drip_ms: None,
                })?,
                Fault::Hang | Fault::NoGreeting => server.set_failure(FailureRule {
                    mode: FailureMode::AcceptThenHang,
                    count: Some(2),
                    retry_after: None,
                    target: FailureTarget::Messages,
                    body_bytes: None,
                    drip_ms: None,
                })?,
                Fault::Slow(delay) => server.set_delay(delay, None)?,
            },
            Server::Smtp(server) => {
                let mut server = lock(server);
                match fault {
                    Fault::Refuse { .. } => server.fail_next(451, 100_000)?,
                    Fault::Hang => server.hang_after_data(2)?,
                    Fault::NoGreeting => server.no_greeting(100_000)?,
                    Fault::Slow(delay) => server.slow_data(delay, 100_000)?,
                }
            }
        }
        tokio::time::sleep(lasts).await;
        match &self.server {
            Server::Mailgun(server) => {
                server.clear_failure()?;
                server.clear_delay()?;
            }
            Server::Smtp(server) => lock(server).reset()?,
        }
        self.note(format!("backend fault {fault:?} over"));
        Ok(())
    }

    /// Runs a plan: operations in order, faults and freezes alongside, the human fulfilling
    /// request mails all the while.
    async fn execute(&self, plan: Plan) -> Result<()> {
        let mut background: Vec<BoxFuture<'_>> = Vec::new();
        let work = async {
            for op in plan.ops {
                match op {
                    Op::Sleep(d) => tokio::time::sleep(d).await,
                    Op::Create {
                        cluster,
                        replicas,
                        tenant,
                    } => {
                        let through = tenant.map_or("the default identity", |t| {
                            self.tenants[t].identity.as_str()
                        });
                        self.note(format!(
                            "create {cluster} with {replicas} machines, mailed through {through}"
                        ));
                        self.create(&cluster, replicas, tenant).await?;
                    }
                    Op::RotateKey { tenant } => self.rotate_key(&self.tenants[tenant]).await?,
                    Op::DeleteIdentity { tenant, lasts } => background
                        .push(Box::pin(self.delete_identity(&self.tenants[tenant], lasts))),
                    Op::Delete { cluster, unpause } => {
                        if unpause {
                            self.note(format!("unpause {cluster} to delete it"));
                            self.set_paused(&cluster, false).await?;
                        }
                        self.note(format!("delete {cluster}"));
                        self.delete(&cluster).await?;
                    }
                    Op::Scale { cluster, replicas } => {
                        self.note(format!("scale {cluster} to {replicas}"));
                        self.scale(&cluster, replicas).await?;
                    }
                    Op::Burst { cluster, up, down } => {
                        self.note(format!("scale {cluster} to {up}, then at once to {down}"));
                        self.scale(&cluster, up).await?;
                        self.scale(&cluster, down).await?;
                    }
                    Op::Remediate {
                        number,
                        cluster,
                        pick,
                        built,
                    } => self.remediate(number, &cluster, pick, built).await?,
                    Op::Resolve { number, fate } => self.resolve(number, fate).await?,
                    Op::Pause { cluster } => {
                        self.note(format!("pause {cluster}"));
                        self.set_paused(&cluster, true).await?;
                    }
                    Op::Unpause { cluster } => {
                        self.note(format!("unpause {cluster}"));
                        self.set_paused(&cluster, false).await?;
                    }
                    Op::Fault { fault, lasts } => {
                        background.push(Box::pin(self.fault(fault, lasts)))
                    }
                    Op::KillLeader { restart_after } => {
                        background.push(Box::pin(self.kill_leader(restart_after)));
                    }
                    Op::FreezeLeader { lasts } => {
                        background.push(Box::pin(self.freeze_leader(lasts)))
                    }
                    Op::PartitionLeader { lasts } => {
                        background.push(Box::pin(self.partition_leader(lasts)))
                    }
                }
            }
            Ok::<_, anyhow::Error>(background)
        };
        // The human reads mail while the operations run.
        let background = tokio::select! {
            r = work => r?,
            r = self.fulfil_forever() => return r,
        };
        let all = futures::future::try_join_all(background);
        tokio::select! {
            r = all => r.map(drop),
            r = self.fulfil_forever() => r,
        }
    }

    // ---- the mail servers and the human --------------------------------------------------

    /// Every mail the lane's servers stored: its own server's first, then each tenant's (their
    /// sequence numbers after the first's, so each server's keep their order).
    fn mails(&self) -> Result<Vec<Mail>> {
        let mut mails = self.own_mails()?;
        for (t, tenant) in self.tenants.iter().enumerate() {
            let base = (t + 1) * 1_000_000;
            mails.extend(
                tenant
                    .server
                    .messages()?
                    .into_iter()
                    .enumerate()
                    .map(|(i, m)| Mail {
                        received: Received {
                            seq: base + i + 1,
                            message_id: m.id,
                            subject: m.subject,
                        },
                        body: m.text.unwrap_or_default(),
                        server: Some(t),
                    }),
            );
        }
        Ok(mails)
    }

    /// Of `mails`, those on a server other than the one of the identity their object's cluster
    /// names.
    fn wrong_backends(&self, mails: &[Mail]) -> Vec<String> {
        let mut wrong = Vec::new();
        for mail in mails {
            let Some(name) = subject_name(&mail.received.subject) else {
                continue;
            };
            let expected = self.tenants.iter().position(|t| t.owns(&name));
            if expected != mail.server {
                let server = |s: Option<usize>| {
                    s.map_or("the default identity's server".to_owned(), |t| {
                        format!("{}'s server", self.tenants[t].identity)
                    })
                };
                wrong.push(format!(
                    "WrongBackend: {:?} ({}) reached {}, expected {}",
                    mail.received.subject,
                    mail.received.message_id,
                    server(mail.server),
                    server(expected)
                ));
            }
        }
        wrong
    }

    fn own_mails(&self) -> Result<Vec<Mail>> {
        Ok(match &self.server {
            Server::Mailgun(server) => server
                .messages()?
                .into_iter()
                .enumerate()
                .map(|(i, m)| Mail {
                    received: Received {
                        seq: i + 1,
                        message_id: m.id,
                        subject: m.subject,
                    },
                    body: m.text.unwrap_or_default(),
                    server: None,
                })
                .collect(),
            Server::Smtp(server) => lock(server)
                .messages()?
                .into_iter()
                .enumerate()
                .map(|(i, m)| {
                    let qp = m
                        .header("Content-Transfer-Encoding")
                        .is_some_and(|e| e.eq_ignore_ascii_case("quoted-printable"));
                    Mail {
                        received: Received {
                            seq: i + 1,
                            message_id: m.header("Message-ID").unwrap_or_default().to_owned(),
                            subject: m.header("Subject").unwrap_or_default().to_owned(),
                        },
                        body: decode_qp(&m.body, qp),
                        server: None,
                    }
                })
                .collect(),
        })
    }

    fn ledger(&self) -> Result<Ledger> {
        Ok(self.ledger_of(&self.mails()?))
    }

    /// The ledger of `mails` (what [`Self::mails`] returned).
    fn ledger_of(&self, mails: &[Mail]) -> Ledger {
        let received: Vec<Received> = mails.iter().map(|m| m.received.clone()).collect();
        Ledger::build(self.backend, DOMAIN, &received)
    }

    /// Number of mails the lane's server stored.
    pub fn mail_count(&self) -> usize {
        self.mails().map(|m| m.len()).unwrap_or(0)
    }

    /// What the human does with new request mails of clusters: runs the command they give.
    async fn fulfil(&self) -> Result<()> {
        for mail in self.mails()? {
            let id = &mail.received.message_id;
            let Some((object, capm_e2e::ledger::Which::Request)) =
                capm_e2e::ledger::parse_message_id(id, DOMAIN)
            else {
                continue;
            };
            if object.kind != Kind::Cluster || lock(&self.fulfilled).contains(id) {
                continue;
            }
            let Some((name, ns)) = fulfil_target(&mail.body) else {
                bail!("no kubectl command in mail {id}:\n{}", mail.body);
            };
            if ns != self.ns {
                bail!("mail {id} names namespace {ns}, expected {}", self.ns);
            }
            let patch = json!({"spec": {"controlPlaneEndpoint": {"host": format!("{name}.soak.example"), "port": 6443}}});
            let params = PatchParams {
                field_manager: Some(FIELD_MANAGER.into()),
                ..PatchParams::default()
            };
            match self
                .infra(Kind::Cluster)
                .patch(&name, &params, &Patch::Merge(&patch))
                .await
            {
                Ok(obj) if obj.uid().as_deref() != Some(object.uid.as_str()) => {
                    // A newer object of the same name: this mail is not its request.
                }
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(_) => continue, // the API server is away: next time
            }
            lock(&self.fulfilled).insert(id.clone());
        }
        Ok(())
    }

    async fn fulfil_forever(&self) -> Result<()> {
        loop {
            self.supervise()?;
            self.fulfil().await?;
            tokio::time::sleep(Duration::from_millis(400)).await;
        }
    }

    // ---- judging ---------------------------------------------------------------------------

    async fn list(&self, api: &Api<DynamicObject>) -> Option<Vec<DynamicObject>> {
        api.list(&ListParams::default()).await.ok().map(|l| l.items)
    }

    /// What is still missing before the round's intent is reached (empty: settled).
    async fn unsettled(&self) -> Result<Vec<String>> {
        self.supervise()?;
        self.fulfil().await?;
        let (Some(clusters), Some(mgcs), Some(mgms), Some(machines), Some(deployments)) = (
            self.list(&self.clusters()).await,
            self.list(&self.infra(Kind::Cluster)).await,
            self.list(&self.infra(Kind::Machine)).await,
            self.list(&self.api(CAPI_GROUP, "v1beta2", "Machine")).await,
            self.list(&self.deployments()).await,
        ) else {
            return Ok(vec!["the API server does not answer".into()]);
        };
        let ledger = self.ledger()?;
        let requested = |kind: Kind, o: &DynamicObject| {
            ledger.requested(&Object {
                kind,
                uid: o.uid().unwrap_or_default(),
            })
        };
        // The mail server's copy is not the provider's knowledge: a backend that hangs stores
        // the request and never answers, and the provider learns of it only when its own
        // timeout and lookup end and it records the send (then shows it in status, its last
        // write of the pass). Until then the object is still being worked on.
        let recorded = |o: &DynamicObject| {
            capm_api::names::request_recorded_sent(o.annotations())
                && o.data["status"]["mail"]["messageID"].is_string()
        };
        let cluster_of = |m: &DynamicObject| {
            m.labels()
                .get("cluster.x-k8s.io/cluster-name")
                .cloned()
                .unwrap_or_default()
        };
        let mut missing = Vec::new();
        for name in &self.deleted {
            let cluster_gone = !clusters.iter().any(|c| c.name_any() == *name);
            if !cluster_gone {
                missing.push(format!("Cluster {name} not deleted yet"));
            }
            for o in mgcs.iter().filter(|o| o.name_any() == *name) {
                // A Cluster deleted before Cluster API adopted its MailgunCluster (no owner
                // reference, no finalizer yet) goes at once and leaves the MailgunCluster behind:
                // Kubernetes semantics, not the provider's doing. The human deletes it.
                let orphan = cluster_gone
                    && o.owner_references().is_empty()
                    && o.metadata.deletion_timestamp.is_none();
                if orphan && !lock(&self.orphans).contains(name) {
                    lock(&self.orphans).insert(name.clone());
                    self.note(format!(
                        "MailgunCluster {name} was left without owner; deleting it"
                    ));
                    let dp = DeleteParams::default();
                    let _ = self.infra(Kind::Cluster).delete(name, &dp).await;
                    let _ = self.deployments().delete(name, &dp).await;
                }
                missing.push(format!(
                    "MailgunCluster {name} ({}) of a deleted Cluster still there, finalizers {:?}",
                    o.uid().unwrap_or_default(),
                    o.finalizers()
                ));
            }
            for o in mgms.iter().filter(|o| cluster_of(o) == *name) {
                missing.push(format!(
                    "MailgunMachine {} ({}) of deleted Cluster {name} still there, finalizers {:?}",
                    o.name_any(),
                    o.uid().unwrap_or_default(),
                    o.finalizers()
                ));
            }
        }
        let paused_condition = |o: &DynamicObject| {
            o.data["status"]["conditions"]
                .as_array()
                .and_then(|cs| cs.iter().find(|c| c["type"] == "Paused"))
                .map(|c| c["status"] == "True")
        };
        for (name, intent) in &self.intent {
            if intent.paused {
                // Nothing moves while paused, but the provider still reports the pause: a
                // lane whose leader changed hands is not settled until the new one has
                // caught up (else its late `Paused` write lands in the quiet window).
                // (Only once Cluster API has set the owner reference: a Cluster paused before
                // that never adopts it, and the provider waits for its owner instead.)
                if let Some(o) = mgcs.iter().find(|o| o.name_any() == *name)
                    && o.owner_references().iter().any(|r| r.kind == "Cluster")
                    && paused_condition(o) != Some(true)
                {
                    missing.push(format!("MailgunCluster {name} not reported Paused yet"));
                }
                continue;
            }
            let provisioned = clusters.iter().any(|c| {
                c.name_any() == *name
                    && c.data["status"]["initialization"]["infrastructureProvisioned"] == true
            });
            match mgcs.iter().find(|o| o.name_any() == *name) {
                None => missing.push(format!("MailgunCluster {name} missing")),
                Some(o) if !requested(Kind::Cluster, o) => {
                    missing.push(format!(
                        "MailgunCluster {name} ({}) not requested",
                        o.uid().unwrap_or_default()
                    ));
                }
                Some(o) if !recorded(o) => missing.push(format!(
                    "MailgunCluster {name} ({}) requested, not yet recorded by the provider",
                    o.uid().unwrap_or_default()
                )),
                Some(_) if !provisioned => missing.push(format!("Cluster {name} not provisioned")),
                Some(_) => {}
            }
            // Cluster API's side first: a MachineDeployment scaled down and up again at once can
            // keep an old MailgunMachine that still counts while its Machine set is replaced,
            // and the new one then comes in the quiet window (seed 4, round 194).
            let capi_machines: Vec<&DynamicObject> = machines
                .iter()
                .filter(|m| m.data["spec"]["clusterName"] == name.as_str())
                .collect();
            let capi_deleting = capi_machines
                .iter()
                .filter(|m| m.metadata.deletion_timestamp.is_some())
                .count();
            if capi_deleting > 0 || capi_machines.len() != intent.replicas as usize {
                missing.push(format!(
                    "Cluster {name}: {} Machines (+{capi_deleting} being deleted), want {}",
                    capi_machines.len() - capi_deleting,
                    intent.replicas
                ));
            }
            if let Some(md) = deployments.iter().find(|d| d.name_any() == *name) {
                let generation = md.metadata.generation.unwrap_or_default();
                let observed = md.data["status"]["observedGeneration"]
                    .as_i64()
                    .unwrap_or_default();
                let replicas = md.data["status"]["replicas"].as_i64().unwrap_or(0);
                if observed < generation || replicas != i64::from(intent.replicas) {
                    missing.push(format!(
                        "MachineDeployment {name}: observed generation {observed} of {generation}, \
                         {replicas} replicas, want {}",
                        intent.replicas
                    ));
                }
            }
            let machines: Vec<&DynamicObject> =
                mgms.iter().filter(|o| cluster_of(o) == *name).collect();
            let deleting = machines
                .iter()
                .filter(|o| o.metadata.deletion_timestamp.is_some())
                .count();
            let live = machines.len() - deleting;
            if deleting > 0 || live != intent.replicas as usize {
                missing.push(format!(
                    "Cluster {name}: {live} MailgunMachines (+{deleting} being deleted), want {}",
                    intent.replicas
                ));
            }
            for o in machines {
                if o.metadata.deletion_timestamp.is_none() && !requested(Kind::Machine, o) {
                    missing.push(format!(
                        "MailgunMachine {} ({}) not requested",
                        o.name_any(),
                        o.uid().unwrap_or_default()
                    ));
                } else if o.metadata.deletion_timestamp.is_none() && !recorded(o) {
                    missing.push(format!(
                        "MailgunMachine {} ({}) requested, not yet recorded by the provider",
                        o.name_any(),
                        o.uid().unwrap_or_default()
                    ));
                } else if o.data["spec"]["providerID"].is_string()
                    && o.data["status"]["initialization"]["provisioned"] != true
                {
                    missing.push(format!(
                        "MailgunMachine {} ({}) built for a remediation, not shown provisioned yet",
                        o.name_any(),
                        o.uid().unwrap_or_default()
                    ));
                }
            }
        }
        let paused = (self.intent.iter())
            .map(|(name, intent)| (name.clone(), intent.paused))
            .collect();
        missing.extend(self.remediations_unsettled(&paused).await);
        Ok(missing)
    }

    /// Our objects (every judged kind): UID → (kind, the object).
    /// Each list retried while the API server is away, as the other calls are (a failed list
    /// used to end the run).
    async fn snapshot(&self) -> Result<BTreeMap<String, (Judged, DynamicObject)>> {
        let mut out = BTreeMap::new();
        let lp = ListParams::default();
        for kind in Judged::ALL {
            let api = self.api(INFRA_GROUP, "v1beta1", kind.name());
            for o in retry(kind.name(), || api.list(&lp)).await? {
                out.insert(o.uid().unwrap_or_default(), (kind, o));
            }
        }
        Ok(out)
    }

    fn resends(&self) -> BTreeMap<Judged, u64> {
        let mut total = lock(&self.retired_resends).clone();
        let mut replicas = lock(&self.replicas);
        for r in replicas.iter_mut().filter(|r| r.killed.is_none()) {
            r.read_resends();
            for (kind, n) in r.counted_resends() {
                *total.entry(kind).or_insert(0) += n;
            }
        }
        total
    }

    /// Plays the Deployment: a replica that exited (it lost its Lease, or crashed) is replaced
    /// by a new process.
    fn supervise(&self) -> Result<()> {
        let mut replicas = lock(&self.replicas);
        for slot in replicas.iter_mut() {
            let Some(status) = slot.proc.exit_status() else {
                continue;
            };
            match slot.killed {
                Some(restart_at) if Instant::now() < restart_at => continue,
                Some(_) => {}
                None => {
                    let mut retired = lock(&self.retired_resends);
                    for (kind, n) in slot.counted_resends() {
                        *retired.entry(kind).or_insert(0) += n;
                    }
                }
            }
            let replacement = self.spawn_replica()?;
            let why = if slot.killed.is_some() {
                "killed".to_owned()
            } else {
                format!("exited by itself: {status}")
            };
            self.note(format!(
                "replica {} {why}; started {} in its place",
                slot.name, replacement.name
            ));
            *slot = replacement;
        }
        Ok(())
    }

    /// Provider log lines naming any of `needles`, at most `max`.
    fn log_lines(&self, needles: &[String], max: usize) -> String {
        let mut out = String::new();
        let mut n = 0;
        let Ok(dir) = std::fs::read_dir(&self.logs) else {
            return out;
        };
        let mut files: Vec<PathBuf> = dir.filter_map(|e| e.ok().map(|e| e.path())).collect();
        files.sort();
        for file in files
            .iter()
            .filter(|f| f.extension().is_some_and(|x| x == "log"))
        {
            let text = std::fs::read_to_string(file).unwrap_or_default();
            let label = file.file_stem().and_then(|s| s.to_str()).unwrap_or("?");
            for line in text
                .lines()
                .filter(|l| needles.iter().any(|n| l.contains(n.as_str())))
            {
                if n == max {
                    let _ = writeln!(out, "      ... (more)");
                    return out;
                }
                let line: String = strip_ansi(line).chars().take(400).collect();
                let _ = writeln!(out, "      {label}: {line}");
                n += 1;
            }
        }
        out
    }

    /// One line about the lane's mail.
    pub fn summary(&self) -> String {
        let mut tenants = String::new();
        for t in &self.tenants {
            let _ = write!(
                tenants,
                "; {}: {} mails",
                t.identity,
                t.server.messages().map_or(0, |m| m.len())
            );
        }
        if !self.tenants.is_empty() {
            let (rotations, deletions) = *lock(&self.tenant_changes);
            let _ = write!(
                tenants,
                "; {rotations} key rotations, {deletions} identity deletions"
            );
        }
        let (tried, hit) = *lock(&self.mid_send);
        match self.ledger() {
            Ok(l) => format!(
                "{}: {} mails for {} objects, {:?} resends counted, {} partitions, {hit} of {tried} \
                 mid-send freezes at the commit point{tenants}; {}",
                self.backend,
                self.mail_count(),
                l.entries.len(),
                self.resends(),
                *lock(&self.partitions),
                self.remediation_summary(&l)
            ),
            Err(e) => format!("{}: {e}", self.backend),
        }
    }

    /// Why the run proves less than it says, if it does: freezes aimed mid-send that never
    /// stopped a leader at its commit point mean a provider binary without its failpoints.
    pub fn weakened(&self) -> Option<String> {
        let (tried, hit) = *lock(&self.mid_send);
        (tried >= 3 && hit == 0).then(|| {
            format!(
                "{}: none of {tried} freezes aimed mid-send stopped the leader at its commit point: \
                 the provider binary lacks its failpoints (build it with \
                 `--features capm-controllers/failpoints`, as `make soak` does)",
                self.backend
            )
        })
    }

    /// Stops the providers (a frozen one is thawed first so it can be stopped at once).
    pub fn stop(&self) {
        let replicas = std::mem::take(&mut *lock(&self.replicas));
        for r in &replicas {
            let _ = r.proc.signal("CONT");
            r.proc.kill_now();
        }
    }
}

/// `text` without terminal colour escapes.
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// What a lane's judgement found.
struct Verdict {
    violations: Vec<String>,
    needles: Vec<String>,
}

/// Waits for the lane's intent, watches for writes, and checks the ledger.
async fn judge(lane: &Lane) -> Result<Verdict> {
    let mut violations = Vec::new();
    let mut needles = Vec::new();
    let begun = Instant::now();
    let mut missing = lane.unsettled().await?;
    loop {
        while !missing.is_empty() && begun.elapsed() < SETTLE_TIMEOUT {
            tokio::time::sleep(Duration::from_millis(500)).await;
            missing = lane.unsettled().await?;
        }
        // A remediation's deadline (a reminder, a timed hand-back) in the quiet window would
        // write in it: let it pass, then settle again.
        let window = QUIET_WINDOW + Duration::from_secs(3);
        let Some(left) = lane.deadline_within(window).await else {
            break;
        };
        if !missing.is_empty() || begun.elapsed() >= SETTLE_TIMEOUT {
            break;
        }
        lane.note(format!(
            "a remediation's deadline in {:.1} s: waiting it out",
            left.as_secs_f64()
        ));
        tokio::time::sleep(left + Duration::from_secs(2)).await;
        missing = lane.unsettled().await?;
    }
    if missing.is_empty() {
        lane.note(format!(
            "settled after {:.1} s",
            begun.elapsed().as_secs_f64()
        ));
        tokio::time::sleep(Duration::from_secs(1)).await;
        let before = lane.snapshot().await.context("listing our objects")?;
        tokio::time::sleep(QUIET_WINDOW).await;
        let after = lane.snapshot().await.context("listing our objects")?;
        for (uid, (kind, new)) in &after {
            let old = before.get(uid).map(|(_, o)| o);
            if old.and_then(|o| o.resource_version()) == new.resource_version() {
                continue;
            }
            let what = changes(old, new);
            if old.is_some()
                && what.iter().all(|c| {
                    c.starts_with("condition MailDelivered:") || c.starts_with("status.mail:")
                })
            {
                // Delivery news comes on the poller's own schedule, not the round's: an
                // outcome, or a backend that can no longer tell (a tenant's key rotated to a
                // sending key). One write per change; more than three for one object over the
                // run is a flapping outcome.
                let news = {
                    let mut counts = lock(&lane.delivery_news);
                    let n = counts.entry(uid.clone()).or_default();
                    *n += 1;
                    *n
                };
                if news > 3 {
                    violations.push(format!(
                        "DeliveryFlap: {} {} ({uid}): delivery news written {news} times; now {}",
                        kind.name(),
                        new.name_any(),
                        what.join("; ")
                    ));
                    needles.push(new.name_any());
                    continue;
                }
                lane.note(format!(
                    "delivery news for {} {} in the quiet window: {}",
                    kind.name(),
                    new.name_any(),
                    what.join("; ")
                ));
                continue;
            }
            let writers = writers(old, new);
            violations.push(format!(
                "WritesWhenQuiet: {} {} ({uid}) written in the {:.0} s after settling (resourceVersion {:?} -> {:?}) by {writers:?}; changed: {}",
                kind.name(),
                new.name_any(),
                QUIET_WINDOW.as_secs_f64(),
                old.and_then(|o| o.resource_version()),
                new.resource_version(),
                what.join("; "),
            ));
            needles.push(new.name_any());
        }
    } else {
        violations.push(format!(
            "NotSettled: the round's intent was not reached within {} s:\n    {}",
            SETTLE_TIMEOUT.as_secs(),
            missing.join("\n    ")
        ));
    }
    let snapshot = lane.snapshot().await.context("listing our objects")?;
    let objects = |deleting: bool| -> BTreeSet<Object> {
        snapshot
            .iter()
            .filter(|(_, (_, o))| o.metadata.deletion_timestamp.is_some() == deleting)
            .filter_map(|(uid, (kind, _))| match kind {
                Judged::Ours(kind) => Some(Object {
                    kind: *kind,
                    uid: uid.clone(),
                }),
                Judged::Remediation => None,
            })
            .collect()
    };
    let (live, pending) = (objects(false), objects(true));
    // One read of the servers for both checks, so they judge the same mails.
    let mails = lane.mails()?;
    for wrong in lane.wrong_backends(&mails) {
        if lock(&lane.reported).insert(wrong.clone()) {
            violations.push(wrong);
        }
    }
    let ledger = lane.ledger_of(&mails);
    let resends = lane.resends();
    let repair_resends = resends.get(&Judged::Remediation).copied().unwrap_or(0);
    for v in ledger.check_repairs(&lane.repair_facts(), repair_resends) {
        if lock(&lane.reported).insert(v.to_string()) {
            needles.push(v.uid.clone());
            violations.push(v.to_string());
        }
    }
    let resends: BTreeMap<Kind, u64> = (resends.into_iter())
        .filter_map(|(kind, n)| match kind {
            Judged::Ours(kind) => Some((kind, n)),
            Judged::Remediation => None,
        })
        .collect();
    for v in ledger.check(&live, &pending, &resends) {
        let key = match &v {
            Violation::Object { rule, object, .. } => format!("{rule:?} {object}"),
            Violation::UnaccountedResends { kind, extra, .. } => {
                format!("resends {kind:?} {extra}")
            }
            Violation::Foreign(m) => format!("foreign {}", m.seq),
        };
        if !lock(&lane.reported).insert(key) {
            continue;
        }
        match &v {
            Violation::Object { object, entry, .. } => {
                needles.push(object.uid.clone());
                needles.extend(subject_name(&entry.subject));
            }
            Violation::UnaccountedResends { duplicated, .. } => {
                for (object, entry) in duplicated {
                    needles.push(object.uid.clone());
                    needles.extend(subject_name(&entry.subject));
                }
            }
            Violation::Foreign(_) => {}
        }
        violations.push(v.to_string());
    }
    Ok(Verdict {
        violations,
        needles,
    })
}

/// The object name in one of our subjects (`New Cluster X requested`, `Machine X no longer
/// needed`, ...).
fn subject_name(subject: &str) -> Option<String> {
    let mut words = subject
        .split_whitespace()
        .skip_while(|w| *w != "Cluster" && *w != "Machine");
    words.next()?;
    words.next().map(str::to_owned)
}

/// Field managers whose `managedFields` entries changed between two versions of an object.
/// What a write changed, for the report: each status field, condition, annotation, label and
/// finalizer list that differs, with its old and new value.
fn changes(old: Option<&DynamicObject>, new: &DynamicObject) -> Vec<String> {
    let Some(old) = old else {
        return vec!["(the object is new)".into()];
    };
    let mut out = Vec::new();
    let conditions = |o: &DynamicObject| -> BTreeMap<String, serde_json::Value> {
        o.data["status"]["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| (c["type"].as_str().unwrap_or("?").to_owned(), c.clone()))
            .collect()
    };
    let (a, b) = (conditions(old), conditions(new));
    for key in a.keys().chain(b.keys()).collect::<BTreeSet<_>>() {
        if a.get(key) != b.get(key) {
            out.push(format!(
                "condition {key}: {} -> {}",
                a.get(key).map_or("none".into(), ToString::to_string),
                b.get(key).map_or("none".into(), ToString::to_string)
            ));
        }
    }
    let fields = |o: &DynamicObject| o.data["status"].as_object().cloned().unwrap_or_default();
    let (a, b) = (fields(old), fields(new));
    for key in a.keys().chain(b.keys()).collect::<BTreeSet<_>>() {
        if key != "conditions" && a.get(key) != b.get(key) {
            out.push(format!(
                "status.{key}: {:?} -> {:?}",
                a.get(key),
                b.get(key)
            ));
        }
    }
    if old.annotations() != new.annotations() {
        out.push(format!(
            "annotations: {:?} -> {:?}",
            old.annotations(),
            new.annotations()
        ));
    }
    if old.labels() != new.labels() {
        out.push(format!("labels: {:?} -> {:?}", old.labels(), new.labels()));
    }
    if old.finalizers() != new.finalizers() {
        out.push(format!(
            "finalizers: {:?} -> {:?}",
            old.finalizers(),
            new.finalizers()
        ));
    }
    if out.is_empty() {
        out.push("nothing a reconciler reads (spec, managedFields or another field)".into());
    }
    out
}

fn writers(old: Option<&DynamicObject>, new: &DynamicObject) -> Vec<String> {
    let entries = |o: &DynamicObject| {
        o.metadata
            .managed_fields
            .clone()
            .unwrap_or_default()
            .into_iter()
            .map(|e| {
                (
                    (
                        e.manager.clone().unwrap_or_default(),
                        e.operation.clone().unwrap_or_default(),
                        e.subresource.clone().unwrap_or_default(),
                    ),
                    (
                        e.time.map(|t| t.0.to_string()),
                        e.fields_v1.map(|f| f.0.to_string()),
                    ),
                )
            })
            .collect::<BTreeMap<_, _>>()
    };
    let before = old.map(entries).unwrap_or_default();
    let mut out: Vec<String> = entries(new)
        .into_iter()
        .filter(|(k, v)| before.get(k) != Some(v))
        .map(|((manager, op, sub), _)| {
            if sub.is_empty() {
                format!("{manager} ({op})")
            } else {
                format!("{manager} ({op} {sub})")
            }
        })
        .collect();
    if out.is_empty() {
        out.push("an unattributed writer (no managedFields entry moved)".into());
    }
    out
}

/// Which round this is and how to report it.
#[derive(Debug, Clone, Copy)]
pub struct Round {
    /// The run's seed.
    pub seed: u64,
    /// The round's number (for the teardown: the number of rounds before it).
    pub number: u64,
    /// The last round: every cluster deleted.
    pub teardown: bool,
    /// Report and carry on instead of failing.
    pub keep_going: bool,
}

/// Runs one round on every lane (and the API server restart, if planned), then judges each
/// lane. Returns the round's wall time; fails with the report on a violation.
pub async fn run_round(
    world: &World,
    lanes: &[Lane],
    plans: Vec<Plan>,
    restart: Option<Duration>,
    round: &Round,
) -> Result<(Duration, bool)> {
    let begun = Instant::now();
    for lane in lanes {
        lock(&lane.log).clear();
        *lock(&lane.round_start) = begun;
    }
    let restart = async {
        if let Some(at) = restart {
            tokio::time::sleep(at).await;
            for lane in lanes {
                lane.note("kube-apiserver: SIGKILL and start again");
            }
            let took = world.cp.restart_apiserver(Duration::from_secs(90)).await?;
            for lane in lanes {
                lane.note(format!(
                    "kube-apiserver ready again after {:.1} s",
                    took.as_secs_f64()
                ));
            }
        }
        Ok::<_, anyhow::Error>(())
    };
    let runs = futures::future::try_join_all(lanes.iter().zip(plans).map(|(l, p)| l.execute(p)));
    let (runs, restart) = tokio::join!(runs, restart);
    runs?;
    restart?;
    world.capi.check_alive()?;
    let ops = begun.elapsed();
    let verdicts = futures::future::try_join_all(lanes.iter().map(judge)).await?;
    let took = begun.elapsed();
    let mails: Vec<String> = lanes
        .iter()
        .map(|l| format!("{} {}", l.backend, l.mail_count()))
        .collect();
    let Round {
        seed,
        number: round,
        teardown,
        keep_going,
    } = *round;
    let label = if teardown {
        "teardown".to_owned()
    } else {
        format!("round {round}")
    };
    println!(
        "soak: {label}: {:.1} s (operations {:.1} s); mails so far: {}",
        took.as_secs_f64(),
        ops.as_secs_f64(),
        mails.join(", ")
    );
    if verdicts.iter().all(|v| v.violations.is_empty()) {
        return Ok((took, true));
    }
    let mut report = format!(
        "soak: VIOLATION in {label} with seed {seed} (replay: SOAK_SEED={seed} SOAK_ROUNDS={round})\n"
    );
    for lane in lanes {
        let _ = writeln!(report, "action log of {label} ({}):", lane.backend);
        for line in lock(&lane.log).iter() {
            let _ = writeln!(report, "{line}");
        }
    }
    for (lane, verdict) in lanes.iter().zip(&verdicts) {
        if verdict.violations.is_empty() {
            continue;
        }
        let _ = writeln!(report, "violations ({}):", lane.backend);
        for v in &verdict.violations {
            let _ = writeln!(report, "  - {v}");
        }
        let lines = lane.log_lines(&verdict.needles, 60);
        if !lines.is_empty() {
            let _ = writeln!(report, "  provider log lines naming them:\n{lines}");
        }
    }
    match world.keep_logs(&format!("seed{seed}-{}", label.replace(' ', ""))) {
        Ok(kept) => {
            let _ = writeln!(
                report,
                "every log (control plane, replicas) kept in {}",
                kept.display()
            );
        }
        Err(e) => {
            let _ = writeln!(report, "the logs could not be kept: {e:#}");
        }
    }
    println!("{report}");
    if keep_going {
        return Ok((took, false));
    }
    bail!("{report}")
}
