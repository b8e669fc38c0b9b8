//! `capm-bench`: how fast the provider drains a backlog, and what it costs, beside the Go peer.
//!
//! One local control plane and one invocation. Each subject in turn (the Go peer from
//! `../shared/peer` with 1 and with 10 workers, then the provider) gets its own CRD, its own
//! namespace with N `Cluster` + `MailgunCluster` pairs (owner references set, as the Cluster API
//! core controller does) and its own Mailgun contract server, and is started as a process on
//! that backlog. For each the bench reports: seconds until every object is done (the peer:
//! `status.messageID` set; the provider: its "sent" record), objects/second, API writes per
//! object to our API group (from the API server's `apiserver_request_total`; Events counted
//! apart), mails accepted and duplicated, the process's peak RSS, writes while idle afterwards,
//! and the API server's raw write ceiling for that subject's own write mix (the peer: status
//! patches; the provider: two metadata patches and one status patch per object), with the
//! subject's write rate as a share of it. Then the ratios of the provider to each peer run.
//!
//! Not a test: it prints figures and fails only when a run itself goes wrong (a mail missing, a
//! mail duplicated, a process dying).
//!
//! ```text
//! make bench                       # N=1000, builds everything
//! target/release/capm-bench --objects 1000 --peer <goref binary>
//! ```

use std::{
    collections::{BTreeMap, HashSet},
    path::{Path, PathBuf},
    process::Stdio,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use capm_api::names;
use capm_mail_servers::MailgunServer;
use capm_test_support::{ControlPlane, Options};
use clap::Parser;
use futures::{StreamExt, TryStreamExt, stream};
use kube::{
    Api, Client, ResourceExt,
    api::{
        ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams,
        PostParams,
    },
    runtime::watcher,
};
use serde_json::json;

mod floor;
mod profile;
mod resync;
mod side_by_side;

#[derive(Parser)]
#[command(about = "Backlog benchmark: cluster-api-provider-mailgun beside the Go peer")]
struct Args {
    /// Cluster + MailgunCluster pairs in each backlog.
    #[arg(long, default_value_t = 1000)]
    objects: usize,
    /// The provider binary (build it with --release).
    #[arg(long, default_value_os_t = default_provider())]
    provider: PathBuf,
    /// The provider's --concurrency.
    #[arg(long, default_value_t = 10)]
    concurrency: u16,
    /// The Go peer's binary (`hack/build-peer.sh` builds it); without it only the provider runs.
    #[arg(long, env = "CAPM_PEER_BIN")]
    peer: Option<PathBuf>,
    /// The Go peer's CRD.
    #[arg(long, default_value_os_t = default_peer_crd())]
    peer_crd: PathBuf,
    /// The peer's worker counts, one run each.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 10])]
    peer_workers: Vec<u16>,
    /// Seconds to watch for API writes after each backlog is drained.
    #[arg(long, default_value_t = 120)]
    idle_seconds: u64,
    /// Concurrent writer counts tried when measuring the API server's raw ceiling (the best one
    /// counts): too few leave the server idle, too many queue on two cores.
    #[arg(long, value_delimiter = ',', default_values_t = [4, 10, 16, 32, 64])]
    ceiling_writers: Vec<usize>,
    /// Seconds of API server CPU profile taken from the start of each drain (0: none). The
    /// profiles are kept in --profile-dir for `go tool pprof`.
    #[arg(long, default_value_t = 8)]
    profile_seconds: u64,
    /// Also restart each subject over its finished backlog and time its first pass (the resync).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    resync: bool,
    /// Writes per ceiling measurement (each concurrency and mix).
    #[arg(long, default_value_t = 1000)]
    ceiling_writes: usize,
    /// Pairs over which the memory floor of kube-runtime's stores is measured (0: not measured).
    #[arg(long, default_value_t = 20_000)]
    floor_pairs: usize,
    /// The provider's --sync-period (e.g. 60s): with it, the idle watch also counts the
    /// provider's reconciles and API requests (its own metrics), the periodic resync's cost.
    #[arg(long)]
    sync_period: Option<String>,
    /// After the provider's run, run it again on a backlog of the same size whose objects are
    /// spread over this many `MailgunClusterIdentity` objects (each with its claimed Secret),
    /// and compare the two (0: no second run).
    #[arg(long, default_value_t = 10)]
    identities: u16,
    /// Where the API server's CPU profiles are written.
    #[arg(long, default_value = "target/bench")]
    profile_dir: PathBuf,
}

fn default_provider() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/release/cluster-api-provider-mailgun")
}

fn default_peer_crd() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/peer/goref/config/crd.yaml")
}

const DOMAIN: &str = "mg.bench.example.com";
/// The requester of every object: an address on the sending domain. The Go peer sends its mail
/// `From` the requester, as the book's tutorial did, and the contract server refuses a `From`
/// outside the sending domain (it would fail DMARC at real receivers): on another domain the
/// peer's every send is refused and its backlog never drains.
const REQUESTER: &str = "bench@mg.bench.example.com";
const API_KEY: &str = "key-bench";
const MGC_CRD: &str = "mailgunclusters.infrastructure.cluster.x-k8s.io";

/// What runs on a backlog.
#[derive(Clone, Copy)]
enum Subject {
    /// The Go peer with this many workers.
    Peer(u16),
    /// This project's provider.
    Provider,
    /// The provider, its objects spread over this many mail identities.
    Identities(u16),
}

/// The namespace of the identities' Secrets (the provider's own, as the chart's).
const SECRET_NAMESPACE: &str = "bench-identity-secrets";

impl Subject {
    fn label(self) -> String {
        match self {
            Self::Peer(w) => format!("Go peer, {w} worker{}", if w == 1 { "" } else { "s" }),
            Self::Provider => "provider".into(),
            Self::Identities(k) => format!("provider, {k} identities"),
        }
    }

    /// The identity of the `i`-th object, if the subject spreads its objects over identities.
    fn identity_of(self, i: usize) -> Option<String> {
        match self {
            Self::Identities(k) => Some(format!("bench-identity-{}", i % usize::from(k))),
            _ => None,
        }
    }

    fn namespace(self) -> String {
        match self {
            Self::Peer(w) => format!("bench-peer-{w}"),
            Self::Provider => "bench-provider".into(),
            Self::Identities(_) => "bench-identities".into(),
        }
    }

    /// The MailgunCluster version the subject's CRD serves.
    fn version(self) -> &'static str {
        match self {
            Self::Peer(_) => "v1alpha1",
            Self::Provider | Self::Identities(_) => "v1beta1",
        }
    }

    /// Whether the subject is done with this object.
    fn done(self, o: &DynamicObject) -> bool {
        match self {
            Self::Peer(_) => o.data["status"]["messageID"].is_string(),
            Self::Provider | Self::Identities(_) => names::request_recorded_sent(o.annotations()),
        }
    }
}

/// Sums of `apiserver_request_total` for write verbs: on our API group (the subject writes
/// nothing else with leader election off), on Events, and on everything but Events (the rest
/// is the control plane's own background, such as kube-apiserver renewing its leases).
#[derive(Clone, Default)]
struct Writes {
    all: f64,
    ours: f64,
    events: f64,
    /// Writes to our API group by `VERB resource[/subresource]`.
    by_kind: BTreeMap<String, f64>,
}

impl std::ops::Sub for Writes {
    type Output = Writes;
    fn sub(self, rhs: Writes) -> Writes {
        let mut by_kind = self.by_kind;
        for (k, v) in rhs.by_kind {
            *by_kind.entry(k).or_default() -= v;
        }
        by_kind.retain(|_, v| *v != 0.0);
        Writes {
            all: self.all - rhs.all,
            ours: self.ours - rhs.ours,
            events: self.events - rhs.events,
            by_kind,
        }
    }
}

/// The value of `label="..."` in a metric's label set.
fn label<'a>(labels: &'a str, name: &str) -> &'a str {
    labels
        .split_once(&format!("{name}=\""))
        .and_then(|(_, rest)| rest.split_once('"'))
        .map_or("", |(value, _)| value)
}

async fn api_writes(client: &Client) -> anyhow::Result<Writes> {
    let req = http::Request::get("/metrics").body(Vec::new())?;
    let text = client.request_text(req).await?;
    let mut total = Writes::default();
    for line in text
        .lines()
        .filter(|l| l.starts_with("apiserver_request_total{"))
    {
        let Some((labels, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let write = ["POST", "PUT", "PATCH", "DELETE", "APPLY"]
            .iter()
            .any(|v| labels.contains(&format!("verb=\"{v}\"")));
        if !write {
            continue;
        }
        let value = value.parse::<f64>().unwrap_or(0.0);
        if labels.contains("resource=\"events\"") {
            total.events += value;
        } else {
            total.all += value;
            if labels.contains(&format!("group=\"{}\"", capm_api::GROUP)) {
                total.ours += value;
                let sub = label(labels, "subresource");
                let kind = format!(
                    "{} {}{}{sub}",
                    label(labels, "verb"),
                    label(labels, "resource"),
                    if sub.is_empty() { "" } else { "/" }
                );
                *total.by_kind.entry(kind).or_default() += value;
            }
        }
    }
    Ok(total)
}

/// A process's CPU seconds, user and system (`/proc/<pid>/stat` fields 14 and 15).
fn proc_cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    // USER_HZ is 100 on Linux.
    Some(ticks / 100.0)
}

/// A `/proc/<pid>/status` field in MiB (`VmHWM` is the peak resident set).
fn proc_status_mib(pid: u32, field: &str) -> Option<f64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

fn cluster_resource() -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(
        "cluster.x-k8s.io",
        "v1beta2",
        "Cluster",
    ))
}

fn mgc_resource(version: &str) -> ApiResource {
    ApiResource::from_gvk(&GroupVersionKind::gvk(
        capm_api::GROUP,
        version,
        "MailgunCluster",
    ))
}

/// Watches the subject's objects and returns, once every one of the `n` is done, the instant
/// the last one was. A watch, not polling: listing N objects every few milliseconds would load
/// the API server whose throughput is being measured.
fn watch_done(
    client: Client,
    subject: Subject,
    n: usize,
) -> tokio::task::JoinHandle<anyhow::Result<Instant>> {
    tokio::spawn(async move {
        let api: Api<DynamicObject> = Api::namespaced_with(
            client,
            &subject.namespace(),
            &mgc_resource(subject.version()),
        );
        let mut done: HashSet<String> = HashSet::with_capacity(n);
        let mut events = watcher(api, watcher::Config::default().page_size(500)).boxed();
        while let Some(event) = events.try_next().await? {
            let (watcher::Event::Apply(o) | watcher::Event::InitApply(o)) = event else {
                continue;
            };
            if subject.done(&o) {
                done.insert(o.name_any());
            }
            if done.len() == n {
                return Ok(Instant::now());
            }
        }
        bail!("the watch on MailgunClusters ended before every object was done")
    })
}

/// What a ceiling round writes.
#[derive(Clone, Copy)]
enum Mix {
    /// The subject's own mix: the peer writes one status patch per object; the provider two
    /// metadata patches (its intent and its record) and one status patch.
    Own,
    /// Status patches only (the peer's mix), to compare the CRDs' cost per write.
    StatusOnly,
}

/// `count` writes over the objects in `names`, `writers` at a time, in `mix`. Each round
/// writes values of its own: a patch that changes nothing is not written to etcd at all.
async fn write_mix(
    api: &Api<DynamicObject>,
    subject: Subject,
    mix: Mix,
    names: &Arc<Vec<String>>,
    writers: usize,
    count: usize,
    round: usize,
) -> anyhow::Result<()> {
    stream::iter(0..count)
        .map(|i| {
            let (api, names) = (api.clone(), names.clone());
            async move {
                let name = &names[i % names.len()];
                let value = format!("{round}-{i}");
                let params = PatchParams::default();
                match (subject, mix, i % 3) {
                    (Subject::Provider | Subject::Identities(_), Mix::Own, 0 | 1) => {
                        let patch = json!({ "metadata": { "annotations": { "bench.example.com/mark": value } } });
                        api.patch(name, &params, &Patch::Merge(patch)).await?
                    }
                    (Subject::Provider | Subject::Identities(_), _, _) => {
                        let patch = json!({ "status": { "observedGeneration": round * 1_000_000 + i } });
                        api.patch_status(name, &params, &Patch::Merge(patch)).await?
                    }
                    (Subject::Peer(_), _, _) => {
                        let patch = json!({ "status": { "messageID": value } });
                        api.patch_status(name, &params, &Patch::Merge(patch)).await?
                    }
                };
                anyhow::Ok(())
            }
        })
        .buffer_unordered(writers)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
}

/// One ceiling measurement: a warming round of `writers * 4` writes on fresh connections (as
/// `round`), then `--ceiling-writes` writes (as `round + 1`); the writes per second of the second.
async fn ceiling_round(
    api: &Api<DynamicObject>,
    subject: Subject,
    mix: Mix,
    names: &Arc<Vec<String>>,
    writers: usize,
    args: &Args,
    round: usize,
) -> anyhow::Result<f64> {
    write_mix(api, subject, mix, names, writers, writers * 4, round).await?;
    let count = args.ceiling_writes;
    let start = Instant::now();
    write_mix(api, subject, mix, names, writers, count, round + 1).await?;
    Ok(count as f64 / start.elapsed().as_secs_f64())
}

/// One subject's figures.
struct Figures {
    label: String,
    n: usize,
    secs: f64,
    writes: Writes,
    mails: usize,
    duplicates: usize,
    peak_rss: f64,
    idle: Writes,
    idle_seconds: u64,
    ceiling: f64,
    ceilings: Vec<(usize, f64)>,
    /// The ceiling for status patches alone on this subject's CRD.
    status_ceiling: f64,
    /// What the drain moved on the API server's own counters.
    server: profile::ServerCounters,
    /// The subject's own CPU seconds (user + system) until it was stopped.
    own_cpu: f64,
    /// The API server's CPU profile over the start of the drain.
    profiled: Option<profile::Summary>,
    /// How long that profile ran.
    profile_seconds: u64,
    /// Resident set at the end of the idle watch.
    idle_rss: f64,
    /// Its anonymous part (heap and stacks; the rest is mapped files, mostly the binary's code).
    idle_rss_anon: f64,
    /// Peak and final resident set after running with no objects at all.
    empty_rss: (f64, f64),
    /// The restart over the finished backlog.
    resync: Option<resync::Resync>,
    /// Mean size of a finished object as JSON, `managedFields` included.
    object_bytes: f64,
    /// Our CRD's status-patch ceiling on objects just created (the provider's run only).
    fresh_status_ceiling: Option<f64>,
    /// Our finished objects' status-patch ceiling beside the peer's shape, in one phase (the
    /// provider's run, with a peer).
    side_by_side: Option<side_by_side::SideBySide>,
}

impl Figures {
    fn objects_per_second(&self) -> f64 {
        self.n as f64 / self.secs
    }

    fn print(&self) {
        let n = self.n as f64;
        println!("== {}", self.label);
        println!(
            "  drain                      {:.2} s, {:.1} objects/s",
            self.secs,
            self.objects_per_second()
        );
        println!(
            "  API writes per object      {:.2} to our objects (+ {:.2} Events; {} writes in all, Events excluded)",
            self.writes.ours / n,
            self.writes.events / n,
            self.writes.all
        );
        println!(
            "    by kind per object       {}",
            self.writes
                .by_kind
                .iter()
                .map(|(k, v)| format!("{k}: {:.2}", v / n))
                .collect::<Vec<_>>()
                .join(", ")
        );
        println!(
            "  mails accepted             {} (expected {}, objects mailed more than once: {})",
            self.mails, self.n, self.duplicates
        );
        println!(
            "  peak RSS                   {:.1} MiB ({:.1} MiB resident after the idle watch, {:.1} MiB of it anonymous)",
            self.peak_rss, self.idle_rss, self.idle_rss_anon
        );
        println!(
            "  RSS with nothing to do     {:.1} MiB peak, {:.1} MiB after {EMPTY_SECONDS} s (no objects of its kind)",
            self.empty_rss.0, self.empty_rss.1
        );
        println!(
            "  API writes while idle      {} to our objects, {} Events in {} s ({} in all: the control plane's own)",
            self.idle.ours, self.idle.events, self.idle_seconds, self.idle.all
        );
        let rate = self.writes.ours / self.secs;
        println!(
            "  write ceiling, its own mix {:.0} writes/s (best at {}); its write rate {rate:.0}/s = {:.0}% of it",
            self.ceiling,
            self.ceilings
                .iter()
                .map(|(w, r)| format!("{w}: {r:.0}/s"))
                .collect::<Vec<_>>()
                .join(", "),
            100.0 * rate / self.ceiling
        );
        println!(
            "  status-patch ceiling       {:.0} writes/s on this CRD (the peer's mix, best concurrency)",
            self.status_ceiling
        );
        if let Some(fresh) = self.fresh_status_ceiling {
            println!(
                "    on objects just created  {fresh:.0} writes/s (the same CRD; the finished objects reach {:.2}x of it)",
                self.status_ceiling / fresh
            );
        }
        if let Some(s) = &self.side_by_side {
            s.print();
        }
        println!(
            "  finished object            {:.0} bytes as JSON, managedFields included (mean)",
            self.object_bytes
        );
        println!(
            "  own CPU                    {:.2} s ({:.2} ms per object over the drain)",
            self.own_cpu,
            1000.0 * self.own_cpu / n
        );
        if let Some(r) = &self.resync {
            println!(
                "  resync after a restart     {:.2} s until every object was reconciled once; {} writes to our objects ({} Events); peak RSS {:.1} MiB",
                r.secs, r.writes.ours, r.writes.events, r.peak_rss
            );
            println!(
                "    CPU over the resync      its own {:.2} s, the API server's {:.2} s; the first reconcile had finished at {:.2} s",
                r.own_cpu, r.server_cpu, r.first_secs
            );
            println!(
                "    API GETs over the resync {:.0} ({:.3} per object; lists and watches not counted)",
                r.gets,
                r.gets / n
            );
        }
        self.server.print(self.n, self.secs);
        if let Some(p) = &self.profiled {
            p.print(self.profile_seconds, self.server.cpu_seconds / n);
        }
    }
}

/// The name of the bench's `i`th Cluster and MailgunCluster.
fn object_name(i: usize) -> String {
    format!("bench-{i:05}")
}

/// The object a mail is about: the first `bench-NNNNN` in its subject or text.
fn object_of(subject: &str, text: Option<&str>) -> Option<String> {
    [Some(subject), text].into_iter().flatten().find_map(|s| {
        let at = s.find("bench-")?;
        let digits = s.get(at + 6..at + 11)?;
        digits
            .bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| format!("bench-{digits}"))
    })
}

/// A MailgunCluster of the backlog: its spec, the Cluster name label and the Cluster (`uid`)
/// as its controller owner, as the Cluster API core controller leaves them.
fn backlog_object(name: &str, ar: &ApiResource, uid: &str) -> anyhow::Result<DynamicObject> {
    let mut o = DynamicObject::new(name, ar).data(json!({
        "spec": { "priority": "Urgent", "request": "One cluster please.", "requester": REQUESTER }
    }));
    o.metadata.labels = Some([(names::CLUSTER_NAME_LABEL.to_owned(), name.to_owned())].into());
    o.metadata.owner_references = Some(vec![serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster", "name": name,
        "uid": uid, "controller": true, "blockOwnerDeletion": true
    }))?]);
    Ok(o)
}

async fn create_backlog(
    client: &Client,
    subject: Subject,
    n: usize,
    cp: &ControlPlane,
) -> anyhow::Result<()> {
    let ns = subject.namespace();
    cp.kubectl_output(&["create", "namespace", &ns])?;
    let cluster_ar = cluster_resource();
    let mgc_ar = mgc_resource(subject.version());
    let clusters: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &cluster_ar);
    let mgcs: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &mgc_ar);
    let created = Instant::now();
    stream::iter(0..n)
        .map(|i| {
            let (clusters, mgcs) = (clusters.clone(), mgcs.clone());
            let (cluster_ar, mgc_ar) = (cluster_ar.clone(), mgc_ar.clone());
            async move {
                let name = object_name(i);
                let cluster = DynamicObject::new(&name, &cluster_ar).data(json!({ "spec": {
                    "infrastructureRef": { "apiGroup": capm_api::GROUP, "kind": "MailgunCluster", "name": name }
                }}));
                let cluster = clusters.create(&PostParams::default(), &cluster).await?;
                let uid = cluster.metadata.uid.context("a Cluster without a UID")?;
                let mut mgc = backlog_object(&name, &mgc_ar, &uid)?;
                if let Some(identity) = subject.identity_of(i) {
                    mgc.data["spec"]["identityRef"] =
                        json!({ "kind": "MailgunClusterIdentity", "name": identity });
                }
                mgcs.create(&PostParams::default(), &mgc).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;
    eprintln!(
        "{}: backlog of {n} pairs created in {:.1} s",
        subject.label(),
        created.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Starts the subject; with `metrics_port`, its metrics are served there over plain HTTP.
fn spawn(
    subject: Subject,
    args: &Args,
    mailgun: &MailgunServer,
    kubeconfig: &Path,
    metrics_port: Option<u16>,
) -> anyhow::Result<tokio::process::Child> {
    let metrics = metrics_port.map_or_else(|| "0".to_owned(), |p| format!("127.0.0.1:{p}"));
    let mut command = match subject {
        Subject::Peer(workers) => {
            let peer = args.peer.as_ref().context("no peer binary")?;
            let mut c = tokio::process::Command::new(peer);
            c.env("MAILGUN_API_BASE", format!("{}/v3", mailgun.base_url()))
                .env("KUBECONFIG", kubeconfig)
                .args(["-concurrency", &workers.to_string()])
                .args(["-metrics-bind-address", &metrics]);
            c
        }
        Subject::Provider | Subject::Identities(_) => {
            let mut c = tokio::process::Command::new(&args.provider);
            c.args(["--mailgun-base-url", &mailgun.base_url()])
                // Each provider run watches its own namespace: the next one does not reconcile
                // the finished backlog of the one before.
                .args(["--namespace", &subject.namespace()])
                .args(["--identity-secret-namespace", SECRET_NAMESPACE])
                .args(["--identity-mailgun-hosts", &mailgun.addr().to_string()])
                .arg("--kubeconfig")
                .arg(kubeconfig)
                .args(["--leader-elect=false", "--webhook-port", "0"])
                .args(["--diagnostics-address", &metrics])
                .args(if metrics_port.is_some() {
                    &["--insecure-diagnostics"][..]
                } else {
                    &[]
                })
                .args(["--health-probe-bind-address", "127.0.0.1:0"])
                .args(["--concurrency", &args.concurrency.to_string()])
                .args(["--log-format", "json"])
                .env("RUST_LOG", "warn");
            if let Some(period) = &args.sync_period {
                c.args(["--sync-period", period]);
            }
            c
        }
    };
    command
        .env("MAILGUN_DOMAIN", DOMAIN)
        .env("MAILGUN_API_KEY", API_KEY)
        .env("MAIL_RECIPIENT", "ops@example.com")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .kill_on_drop(true)
        .spawn()
        .with_context(|| format!("starting the {}", subject.label()))
}

/// Seconds the subject runs with nothing to do before its resident set is read.
const EMPTY_SECONDS: u64 = 10;

/// The subject's resident set (peak, and at the end) after [`EMPTY_SECONDS`] with no objects:
/// its CRD installed, nothing of its kind in the cluster.
async fn empty_rss(
    subject: Subject,
    args: &Args,
    mailgun: &MailgunServer,
    cp: &ControlPlane,
) -> anyhow::Result<(f64, f64)> {
    let mut child = spawn(subject, args, mailgun, cp.kubeconfig(), None)?;
    let pid = child.id().context("pid")?;
    tokio::time::sleep(Duration::from_secs(EMPTY_SECONDS)).await;
    if let Some(status) = child.try_wait()? {
        bail!(
            "the {} exited with nothing to do: {status}",
            subject.label()
        );
    }
    let rss = (
        proc_status_mib(pid, "VmHWM").unwrap_or(f64::NAN),
        proc_status_mib(pid, "VmRSS").unwrap_or(f64::NAN),
    );
    child.kill().await.ok();
    child.wait().await.ok();
    Ok(rss)
}

async fn run(
    cp: &ControlPlane,
    client: &Client,
    subject: Subject,
    args: &Args,
) -> anyhow::Result<Figures> {
    let n = args.objects;
    // The subject's CRD (the previous subject's was removed with its objects).
    match subject {
        Subject::Peer(_) => {
            let path = args.peer_crd.to_str().context("peer CRD path")?;
            cp.kubectl_output(&["apply", "-f", path])?;
        }
        Subject::Provider => {
            capm_test_support::install_crds(client, &capm_api::crd::crds()?).await?;
        }
        Subject::Identities(_) => {}
    }
    cp.kubectl_output(&[
        "wait",
        "--for=condition=Established",
        &format!("crd/{MGC_CRD}"),
    ])?;
    let mailgun = MailgunServer::start(API_KEY, DOMAIN)?;
    let empty = empty_rss(subject, args, &mailgun, cp).await?;
    if let Subject::Identities(k) = subject {
        create_identities(client, cp, k, &mailgun, &subject.namespace()).await?;
    }
    create_backlog(client, subject, n, cp).await?;

    let writes_before = api_writes(client).await?;
    let server_before = profile::server_counters(client).await?;
    let started = Instant::now();
    // With a sync period, the provider's metrics are read over the idle watch.
    let metrics_port = match subject {
        Subject::Provider | Subject::Identities(_) if args.sync_period.is_some() => {
            Some(capm_test_support::process::free_port()?)
        }
        _ => None,
    };
    let mut child = spawn(subject, args, &mailgun, cp.kubeconfig(), metrics_port)?;
    let pid = child.id().context("pid")?;
    let cpu_profile =
        (args.profile_seconds > 0).then(|| profile::start(client.clone(), args.profile_seconds));
    let all_done = watch_done(client.clone(), subject, n);
    let drained = tokio::select! {
        done = all_done => done.context("the watcher panicked")??.duration_since(started),
        status = child.wait() => bail!("the {} exited early: {}", subject.label(), status?),
        () = tokio::time::sleep(Duration::from_secs(900)) => bail!("not drained after 900 s"),
    };
    // Let the last status writes land before counting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let writes = api_writes(client).await? - writes_before;
    let server = profile::server_counters(client).await? - server_before;
    let object_bytes = mean_object_bytes(client, subject, &args.profile_dir).await?;
    let own_cpu = proc_cpu_seconds(pid).unwrap_or(f64::NAN);
    let profiled = match cpu_profile {
        Some(task) => {
            let bytes = task.await.context("the profile task panicked")??;
            let name = subject.label().replace([' ', ','], "-");
            let (path, summary) = profile::save_and_summarize(&args.profile_dir, &name, &bytes)?;
            eprintln!(
                "{}: API server CPU profile in {}",
                subject.label(),
                path.display()
            );
            summary
        }
        None => None,
    };
    let mails = mailgun.messages()?;
    let mut per_object: BTreeMap<String, usize> = BTreeMap::new();
    for m in &mails {
        let object = object_of(&m.subject, m.text.as_deref()).unwrap_or_else(|| m.id.clone());
        *per_object.entry(object).or_default() += 1;
    }
    let duplicates = per_object.values().filter(|&&c| c > 1).count();

    eprintln!(
        "{}: drained; watching {} s of idle",
        subject.label(),
        args.idle_seconds
    );
    let idle_start = api_writes(client).await?;
    let own_before = match metrics_port {
        Some(port) => resync::own_counters(port).await,
        None => None,
    };
    tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
    let idle = api_writes(client).await? - idle_start;
    if let (Some(port), Some((r0, q0)), Some(period)) =
        (metrics_port, own_before, args.sync_period.as_deref())
        && let Some((r1, q1)) = resync::own_counters(port).await
    {
        let (reconciles, requests) = (r1 - r0, q1 - q0);
        println!(
            "provider, sync period {period}, {} s idle over {n} objects: {reconciles:.0} reconciles \
             ({:.2} per object), {requests:.0} API requests by the provider (watches and the Lease \
             included; {:.3} per reconcile), {} writes to our objects",
            args.idle_seconds,
            reconciles / n as f64,
            if reconciles > 0.0 {
                requests / reconciles
            } else {
                0.0
            },
            idle.ours
        );
    }
    if let Some(status) = child.try_wait()? {
        bail!("the {} exited while idle: {status}", subject.label());
    }
    let peak_rss = proc_status_mib(pid, "VmHWM").unwrap_or(f64::NAN);
    let idle_rss = proc_status_mib(pid, "VmRSS").unwrap_or(f64::NAN);
    let idle_rss_anon = proc_status_mib(pid, "RssAnon").unwrap_or(f64::NAN);
    child.kill().await.ok();
    child.wait().await.ok();

    let resync = if args.resync {
        Some(resync::resync(cp, client, subject, args, &mailgun).await?)
    } else {
        None
    };

    // The API server's raw ceiling for this subject's write mix on its own objects, at several
    // concurrencies, each on connections already warmed by a first round.
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &subject.namespace(),
        &mgc_resource(subject.version()),
    );
    let names_list: Arc<Vec<String>> = Arc::new((0..n).map(object_name).collect());
    let mut ceilings = Vec::new();
    let mut status_ceilings = Vec::new();
    // The identities' run shares the provider's objects' shape: its ceilings are the provider's.
    let ceiling_writers: &[usize] = match subject {
        Subject::Identities(_) => &[],
        _ => &args.ceiling_writers,
    };
    for (round, &writers) in ceiling_writers.iter().enumerate() {
        for (mix, out, round) in [
            (Mix::Own, &mut ceilings, 4 * round),
            (Mix::StatusOnly, &mut status_ceilings, 4 * round + 2),
        ] {
            let rate = ceiling_round(&api, subject, mix, &names_list, writers, args, round + 1);
            out.push((writers, rate.await?));
        }
    }
    let status_ceiling = status_ceilings.iter().map(|c| c.1).fold(f64::NAN, f64::max);
    let ceiling = ceilings.iter().map(|c| c.1).fold(f64::NAN, f64::max);
    // Our CRD again, on objects just created (spec only, no conditions, records or our
    // managedFields): set beside the finished objects' ceiling and the peer's, it separates what
    // the CRD's schema costs from what the objects' size costs.
    let fresh_status_ceiling = match subject {
        Subject::Provider => Some(fresh_status_ceiling(cp, client, args).await?),
        Subject::Peer(_) | Subject::Identities(_) => None,
    };
    let side_by_side = match subject {
        Subject::Provider if args.peer.is_some() => {
            Some(side_by_side::measure(cp, client, args).await?)
        }
        _ => None,
    };

    // Clear the stage for the next subject (the provider runs last; its objects keep their
    // finalizers once it is stopped): the peer's CRD (and with it every MailgunCluster), and the
    // Clusters, which the provider would otherwise cache.
    if let Subject::Peer(_) = subject {
        cp.kubectl_output(&["delete", "crd", MGC_CRD, "--wait=true"])?;
        // One delete-collection request (kubectl deletes one object per request).
        let clusters: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), &subject.namespace(), &cluster_resource());
        clusters
            .delete_collection(&DeleteParams::default(), &ListParams::default())
            .await?;
        while !clusters
            .list_metadata(&ListParams::default().limit(1))
            .await?
            .items
            .is_empty()
        {
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // The control plane goes on working after the objects are gone (the garbage collector's
        // graph, watch caches, etcd compaction); the next subject starts on a quiet server, not
        // on this subject's leftovers.
        let waited = settle(client).await?;
        eprintln!(
            "{}: stage cleared; the API server was quiet after {waited:.1} s",
            subject.label()
        );
    }

    Ok(Figures {
        label: subject.label(),
        n,
        secs: drained.as_secs_f64(),
        writes,
        mails: mails.len(),
        duplicates,
        peak_rss,
        idle,
        idle_seconds: args.idle_seconds,
        ceiling,
        ceilings,
        status_ceiling,
        server,
        own_cpu,
        profiled,
        profile_seconds: args.profile_seconds,
        idle_rss,
        idle_rss_anon,
        empty_rss: empty,
        resync,
        object_bytes,
        fresh_status_ceiling,
        side_by_side,
    })
}

/// Waits (at most 120 s) until the API server uses less than 5% of a core over 2 s; returns the
/// seconds waited.
async fn settle(client: &Client) -> anyhow::Result<f64> {
    const WINDOW: Duration = Duration::from_secs(2);
    let started = Instant::now();
    let mut last = profile::server_counters(client).await?.cpu_seconds;
    while started.elapsed() < Duration::from_secs(120) {
        tokio::time::sleep(WINDOW).await;
        let now = profile::server_counters(client).await?.cpu_seconds;
        if (now - last) / WINDOW.as_secs_f64() < 0.05 {
            break;
        }
        last = now;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// The status-patch ceiling of our CRD on `--ceiling-writes` objects just created.
async fn fresh_status_ceiling(
    cp: &ControlPlane,
    client: &Client,
    args: &Args,
) -> anyhow::Result<f64> {
    let ns = "bench-fresh";
    cp.kubectl_output(&["create", "namespace", ns])?;
    let ar = mgc_resource(Subject::Provider.version());
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &ar);
    let names: Arc<Vec<String>> = Arc::new(
        (0..args.ceiling_writes)
            .map(|i| format!("fresh-{i:05}"))
            .collect(),
    );
    stream::iter(names.iter().cloned())
        .map(|name| {
            let (api, ar) = (api.clone(), ar.clone());
            async move {
                let mgc = DynamicObject::new(&name, &ar).data(json!({
                    "spec": { "priority": "Urgent", "request": "One cluster please.", "requester": REQUESTER }
                }));
                api.create(&PostParams::default(), &mgc).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;
    let mut best = f64::NAN;
    for (round, &writers) in args.ceiling_writers.iter().enumerate() {
        let (mix, round) = (Mix::StatusOnly, 100 + 2 * round);
        let rate = ceiling_round(&api, Subject::Provider, mix, &names, writers, args, round);
        best = best.max(rate.await?);
    }
    Ok(best)
}

/// `k` identities `bench-identity-<j>` for the objects in `namespace`, each with a claimed
/// Secret holding the contract server's key in [`SECRET_NAMESPACE`] and the contract server as
/// its API URL.
async fn create_identities(
    client: &Client,
    cp: &ControlPlane,
    k: u16,
    mailgun: &MailgunServer,
    namespace: &str,
) -> anyhow::Result<()> {
    cp.kubectl_output(&["create", "namespace", SECRET_NAMESPACE])?;
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(client.clone(), SECRET_NAMESPACE);
    let identities: Api<capm_api::v1beta1::MailgunClusterIdentity> = Api::all(client.clone());
    for j in 0..k {
        let name = format!("bench-identity-{j}");
        let secret = serde_json::from_value(json!({
            "metadata": { "name": name, "labels": { names::IDENTITY_SECRET_LABEL: name } },
            "stringData": { "api-key": API_KEY },
        }))?;
        secrets.create(&PostParams::default(), &secret).await?;
        let identity = serde_json::from_value(json!({
            "apiVersion": format!("{}/v1beta1", capm_api::GROUP),
            "kind": "MailgunClusterIdentity",
            "metadata": { "name": name },
            "spec": {
                "mailgun": { "domain": DOMAIN, "baseURL": mailgun.base_url(),
                             "apiKeySecretRef": { "name": name, "key": "api-key" } },
                "recipients": [format!("ops-{j}@example.com")],
                "allowedNamespaces": { "list": [namespace] },
            },
        }))?;
        identities.create(&PostParams::default(), &identity).await?;
    }
    Ok(())
}

/// The provider's run with identities beside its run without, on the same control plane.
fn print_identities(provider: &Figures, ids: &Figures) {
    let cpu = |f: &Figures| f.server.cpu_seconds / f.n as f64;
    let gets = |f: &Figures| f.resync.as_ref().map_or(f64::NAN, |r| r.gets / f.n as f64);
    println!(
        "== identities ({} / {}, same control plane, same N)",
        ids.label, provider.label
    );
    println!(
        "  objects/s {:.2}x ({:.1} vs {:.1})   API server CPU per object {:.2}x ({:.2} ms vs {:.2} ms)",
        ids.objects_per_second() / provider.objects_per_second(),
        ids.objects_per_second(),
        provider.objects_per_second(),
        cpu(ids) / cpu(provider),
        1000.0 * cpu(ids),
        1000.0 * cpu(provider),
    );
    println!(
        "  API GETs per reconcile of a finished object (the resync pass): {:.3} with identities, {:.3} without",
        gets(ids),
        gets(provider),
    );
}

/// The mean size of the subject's objects as JSON, `managedFields` included: what the API
/// server decodes, patches, validates, encodes and stores on every write. One of them is saved,
/// pretty-printed, as `<dir>/<namespace>-object.json`, to read where the bytes go.
async fn mean_object_bytes(client: &Client, subject: Subject, dir: &Path) -> anyhow::Result<f64> {
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &subject.namespace(),
        &mgc_resource(subject.version()),
    );
    let list = api.list(&ListParams::default()).await?;
    if let Some(one) = list.items.first() {
        std::fs::create_dir_all(dir)?;
        let path = dir.join(format!("{}-object.json", subject.namespace()));
        std::fs::write(&path, serde_json::to_vec_pretty(one)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(mean_json_bytes(&list.items))
}

/// Mean size of `objects` as JSON, `managedFields` included.
fn mean_json_bytes(objects: &[DynamicObject]) -> f64 {
    let total: usize = objects
        .iter()
        .map(|o| serde_json::to_vec(o).map_or(0, |v| v.len()))
        .sum();
    total as f64 / objects.len().max(1) as f64
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if !args.provider.is_file() {
        bail!(
            "provider binary {} not found: cargo build --release -p cluster-api-provider-mailgun",
            args.provider.display()
        );
    }
    let mut subjects: Vec<Subject> = Vec::new();
    match &args.peer {
        Some(peer) if peer.is_file() => {
            subjects.extend(args.peer_workers.iter().map(|&w| Subject::Peer(w)));
        }
        Some(peer) => bail!(
            "peer binary {} not found: hack/build-peer.sh builds it",
            peer.display()
        ),
        None => eprintln!("no --peer (CAPM_PEER_BIN): the provider runs alone, without ratios"),
    }
    subjects.push(Subject::Provider);
    if args.identities > 0 {
        subjects.push(Subject::Identities(args.identities));
    }

    // First, before anything else grows this process: the stores' floor.
    let floor = (args.floor_pairs > 0)
        .then(|| floor::measure(args.floor_pairs))
        .transpose()?;

    eprintln!("starting the local control plane");
    // Profiling on: the drain's API server CPU profile says where the time goes.
    let cp = ControlPlane::start(Options {
        apiserver_args: vec!["--profiling=true".into()],
        ..Options::default()
    })
    .await?;
    let client = cp.client().await?;
    cp.install_capi_crds().await?;

    let mut figures = Vec::new();
    for subject in subjects {
        let f = run(&cp, &client, subject, &args).await?;
        f.print();
        figures.push(f);
    }
    cp.stop();

    let with_identities = match figures.last() {
        Some(f) if args.identities > 0 => Some(f),
        _ => None,
    };
    let runs = figures.len() - usize::from(with_identities.is_some());
    let provider = figures[..runs].last().context("no provider run")?;
    if let Some(ids) = with_identities {
        print_identities(provider, ids);
    }
    if runs > 1 {
        println!("== ratios (provider / peer run, same control plane, same N)");
        for peer in &figures[..runs - 1] {
            println!(
                "  vs {:<18} objects/s {:.2}x   peak RSS {:.2}x   writes/object {:.2} vs {:.2}   share of own ceiling {:.0}% vs {:.0}%   status-patch ceiling of the CRDs {:.2}x",
                peer.label,
                provider.objects_per_second() / peer.objects_per_second(),
                provider.peak_rss / peer.peak_rss,
                provider.writes.ours / provider.n as f64,
                peer.writes.ours / peer.n as f64,
                100.0 * provider.writes.ours / provider.secs / provider.ceiling,
                100.0 * peer.writes.ours / peer.secs / peer.ceiling,
                provider.status_ceiling / peer.status_ceiling,
            );
            println!(
                "  {:<21} API server CPU per object {:.2}x   finished object size {:.2}x   status-patch ceiling, our CRD on new objects vs the peer's {:.2}x",
                "",
                (provider.server.cpu_seconds / provider.n as f64)
                    / (peer.server.cpu_seconds / peer.n as f64),
                provider.object_bytes / peer.object_bytes,
                provider.fresh_status_ceiling.unwrap_or(f64::NAN) / peer.status_ceiling,
            );
            if let Some(s) = &provider.side_by_side {
                println!(
                    "  {:<21} status-patch ceiling side by side, our finished objects vs the peer's shape {:.2}x (one phase; the ratio above takes each CRD's minutes apart)",
                    "",
                    s.ours / s.peer_shape,
                );
            }
            if let (Some(ours), Some(theirs)) = (&provider.resync, &peer.resync) {
                println!(
                    "  {:<21} resync {:.2}x faster ({:.2} s vs {:.2} s)   peak RSS after the restart {:.2}x   idle RSS {:.2}x",
                    "",
                    theirs.secs / ours.secs,
                    ours.secs,
                    theirs.secs,
                    ours.peak_rss / theirs.peak_rss,
                    provider.idle_rss / peer.idle_rss,
                );
            }
        }
    }
    if let Some(floor) = floor {
        println!(
            "== memory floor: the provider's caches (measured in this process over {} pairs)",
            floor.pairs
        );
        println!(
            "  a Cluster + MailgunCluster pair with only a name, namespace, UID and resourceVersion: {:.0} bytes in the two caches",
            floor.bytes_per_pair
        );
        println!(
            "  the same caches holding finished pairs as the provider caches them: {:.0} bytes per pair",
            floor.finished_bytes_per_pair
        );
        // The bars of issue 34: 0.42x of the 1-worker peer's peak at N=1000, 0.5x at N=10 000.
        let one_worker = figures.first().filter(|_| runs > 1);
        if let Some(peer) = one_worker {
            let share = if provider.n >= 10_000 { 0.5 } else { 0.42 };
            let bar = peer.peak_rss * share;
            let room = (bar - provider.empty_rss.0) * 1024.0 * 1024.0 / provider.n as f64;
            println!(
                "  the RSS bar at N={}: {bar:.1} MiB ({share}x the 1-worker peer's peak); the provider with nothing to do peaks at {:.1} MiB, leaving {room:.0} bytes per pair: the caches' floor alone is {:.2}x that, the caches with finished pairs {:.2}x",
                provider.n,
                provider.empty_rss.0,
                floor.bytes_per_pair / room,
                floor.finished_bytes_per_pair / room
            );
        }
    }
    for f in &figures {
        if f.mails != f.n || f.duplicates > 0 {
            bail!(
                "{}: expected exactly {} mails, one per object; got {} with {} objects mailed more than once",
                f.label,
                f.n,
                f.mails,
                f.duplicates
            );
        }
    }
    Ok(())
}
