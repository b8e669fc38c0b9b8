//! `capm-bench`: how fast the provider drains a backlog, and what it costs.
//!
//! Starts a local control plane and the Mailgun contract server, creates N `Cluster` +
//! `MailgunCluster` pairs (owner references set, as the Cluster API core controller does), then
//! starts the provider binary and reports: seconds until every object has its mail sent and
//! recorded, objects/second, API writes per object (from the API server's
//! `apiserver_request_total`, every write verb except on Events), mails the server accepted,
//! the provider's peak RSS, API writes during an idle period afterwards, and the API server's raw
//! ceiling for status merge-patches on the same objects (no client-side rate limit), with the
//! provider's write rate as a share of it.
//!
//! Not a test: it prints figures and fails only when the run itself goes wrong (a mail missing,
//! a mail duplicated, the provider dying).
//!
//! ```text
//! cargo build --release -p cluster-api-provider-mailgun -p capm-bench
//! target/release/capm-bench --objects 1000
//! ```

use std::{
    collections::{BTreeMap, HashSet},
    path::PathBuf,
    process::Stdio,
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context, bail};
use capm_api::{names, v1beta1::MailgunCluster};
use capm_mail_servers::MailgunServer;
use capm_test_support::{ControlPlane, Options};
use clap::Parser;
use futures::{StreamExt, TryStreamExt, stream};
use kube::{
    Api, Client, ResourceExt,
    api::{ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams},
    core::PartialObjectMeta,
    runtime::watcher,
};
use serde_json::json;

#[derive(Parser)]
#[command(about = "Backlog benchmark for cluster-api-provider-mailgun")]
struct Args {
    /// Cluster + MailgunCluster pairs in the backlog.
    #[arg(long, default_value_t = 1000)]
    objects: usize,
    /// The provider binary (build it with --release).
    #[arg(long, default_value_os_t = default_provider())]
    provider: PathBuf,
    /// The provider's --concurrency.
    #[arg(long, default_value_t = 10)]
    concurrency: u16,
    /// Seconds to watch for API writes after the backlog is drained.
    #[arg(long, default_value_t = 120)]
    idle_seconds: u64,
    /// Concurrent writer counts tried when measuring the API server's raw ceiling (the best one
    /// counts): too few leave the server idle, too many queue on two cores.
    #[arg(long, value_delimiter = ',', default_values_t = [4, 10, 16, 32, 64])]
    ceiling_writers: Vec<usize>,
}

fn default_provider() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/release/cluster-api-provider-mailgun")
}

const NAMESPACE: &str = "bench";
const DOMAIN: &str = "mg.bench.example.com";
const API_KEY: &str = "key-bench";

/// Sums of `apiserver_request_total` for write verbs: every resource except Events, and our API
/// group alone (the provider writes nothing else with leader election off; the rest is the
/// control plane's own background, such as kube-apiserver renewing its leases).
#[derive(Clone, Copy, Default)]
struct Writes {
    all: f64,
    ours: f64,
}

impl std::ops::Sub for Writes {
    type Output = Writes;
    fn sub(self, rhs: Writes) -> Writes {
        Writes {
            all: self.all - rhs.all,
            ours: self.ours - rhs.ours,
        }
    }
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
        let write = [
            "\"POST\"",
            "\"PUT\"",
            "\"PATCH\"",
            "\"DELETE\"",
            "\"APPLY\"",
        ]
        .iter()
        .any(|v| labels.contains(&format!("verb={v}")));
        if write && !labels.contains("resource=\"events\"") {
            let value = value.parse::<f64>().unwrap_or(0.0);
            total.all += value;
            if labels.contains(&format!("group=\"{}\"", capm_api::GROUP)) {
                total.ours += value;
            }
        }
    }
    Ok(total)
}

/// A `/proc/<pid>/status` field in MiB (`VmHWM` is the peak resident set; `RssAnon` and
/// `RssFile` split the current one into heap/stacks and mapped files such as the binary).
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

/// Watches our objects' metadata and returns, once every one of the `n` carries the "sent"
/// record, the instant the last one got it. A watch, not polling: listing N objects every few
/// milliseconds would load the API server whose throughput is being measured.
fn watch_sent(
    api: Api<PartialObjectMeta<MailgunCluster>>,
    n: usize,
) -> tokio::task::JoinHandle<anyhow::Result<Instant>> {
    tokio::spawn(async move {
        let mut sent: HashSet<String> = HashSet::with_capacity(n);
        let mut events = watcher(api, watcher::Config::default().page_size(500)).boxed();
        while let Some(event) = events.try_next().await? {
            let (watcher::Event::Apply(o) | watcher::Event::InitApply(o)) = event else {
                continue;
            };
            if o.annotations().contains_key(names::MAIL_SENT_ANNOTATION) {
                sent.insert(o.name_any());
            }
            if sent.len() == n {
                return Ok(Instant::now());
            }
        }
        bail!("the watch on MailgunClusters ended before every object was recorded as sent")
    })
}

/// `count` status merge-patches over the objects in `names`, `writers` at a time. Each round
/// writes values of its own: a patch that changes nothing is not written to etcd at all.
async fn status_patches(
    api: &Api<MailgunCluster>,
    names: &Arc<Vec<String>>,
    writers: usize,
    count: usize,
    round: usize,
) -> anyhow::Result<()> {
    stream::iter(0..count)
        .map(|i| {
            let (api, names) = (api.clone(), names.clone());
            async move {
                api.patch_status(
                    &names[i % names.len()],
                    &PatchParams::default(),
                    &Patch::Merge(
                        json!({ "status": { "observedGeneration": round * 1_000_000 + i } }),
                    ),
                )
                .await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(writers)
        .try_collect::<Vec<_>>()
        .await?;
    Ok(())
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
    let n = args.objects;
    eprintln!("starting the local control plane");
    let cp = ControlPlane::start(Options::default()).await?;
    let client = cp.client().await?;
    capm_test_support::install_crds(&client, &capm_api::crd::crds()?).await?;
    cp.install_capi_crds().await?;
    cp.kubectl_output(&["create", "namespace", NAMESPACE])?;
    let mailgun = MailgunServer::start(API_KEY, DOMAIN)?;

    // The backlog.
    eprintln!("creating {n} Cluster + MailgunCluster pairs");
    let cluster_ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        "cluster.x-k8s.io",
        "v1beta2",
        "Cluster",
    ));
    let clusters: Api<DynamicObject> = Api::namespaced_with(client.clone(), NAMESPACE, &cluster_ar);
    let mgcs: Api<MailgunCluster> = Api::namespaced(client.clone(), NAMESPACE);
    let created = Instant::now();
    stream::iter(0..n)
        .map(|i| {
            let (clusters, mgcs, cluster_ar) = (clusters.clone(), mgcs.clone(), cluster_ar.clone());
            async move {
                let name = format!("bench-{i:05}");
                let cluster = DynamicObject::new(&name, &cluster_ar).data(json!({ "spec": {
                    "infrastructureRef": { "apiGroup": capm_api::GROUP, "kind": "MailgunCluster", "name": name }
                }}));
                let cluster = clusters.create(&PostParams::default(), &cluster).await?;
                let mgc: MailgunCluster = serde_json::from_value(json!({
                    "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
                    "kind": "MailgunCluster",
                    "metadata": {
                        "name": name,
                        "labels": { names::CLUSTER_NAME_LABEL: name },
                        "ownerReferences": [{
                            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster", "name": name,
                            "uid": cluster.metadata.uid, "controller": true, "blockOwnerDeletion": true
                        }]
                    },
                    "spec": { "priority": "Urgent", "request": "One cluster please.", "requester": "bench@example.com" }
                }))?;
                mgcs.create(&PostParams::default(), &mgc).await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;
    eprintln!(
        "backlog created in {:.1} s",
        created.elapsed().as_secs_f64()
    );

    // The provider, as its own process.
    let writes_before = api_writes(&client).await?;
    let started = Instant::now();
    let mut provider = tokio::process::Command::new(&args.provider)
        .env("MAILGUN_DOMAIN", DOMAIN)
        .env("MAILGUN_API_KEY", API_KEY)
        .env("MAIL_RECIPIENT", "ops@example.com")
        .args(["--mailgun-base-url", &mailgun.base_url()])
        .arg("--kubeconfig")
        .arg(cp.kubeconfig())
        .args([
            "--leader-elect=false",
            "--webhook-port",
            "0",
            "--diagnostics-address",
            "0",
        ])
        .args(["--health-probe-bind-address", "127.0.0.1:0"])
        .args([
            "--concurrency",
            &args.concurrency.to_string(),
            "--log-format",
            "json",
        ])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("starting the provider")?;
    let pid = provider.id().context("provider pid")?;
    let all_sent = watch_sent(Api::namespaced(client.clone(), NAMESPACE), n);
    let drained = tokio::select! {
        done = all_sent => done.context("the sent watcher panicked")??.duration_since(started),
        status = provider.wait() => bail!("the provider exited early: {}", status?),
        () = tokio::time::sleep(Duration::from_secs(600)) => bail!("not drained after 600 s"),
    };
    // Let the last status writes land before counting.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let writes_after = api_writes(&client).await?;
    let mails = mailgun.messages()?;
    let mut per_id: BTreeMap<&str, usize> = BTreeMap::new();
    for m in &mails {
        *per_id.entry(m.id.as_str()).or_default() += 1;
    }
    let duplicates = per_id.values().filter(|&&c| c > 1).count();

    eprintln!("watching {} s of idle", args.idle_seconds);
    let idle_start = api_writes(&client).await?;
    tokio::time::sleep(Duration::from_secs(args.idle_seconds)).await;
    let idle_writes = api_writes(&client).await? - idle_start;
    if let Some(status) = provider.try_wait()? {
        bail!("the provider exited while idle: {status}");
    }
    // VmHWM is the kernel's own high-water mark: one read covers the whole run.
    let [peak_rss, anon, file] =
        ["VmHWM", "RssAnon", "RssFile"].map(|f| proc_status_mib(pid, f).unwrap_or(f64::NAN));
    provider.kill().await.ok();

    // The API server's raw ceiling: concurrent status merge-patches on the same objects, at
    // several concurrencies, each on connections already warmed by a first round.
    let names_list: Arc<Vec<String>> = Arc::new((0..n).map(|i| format!("bench-{i:05}")).collect());
    let mut ceilings = Vec::new();
    for (round, &writers) in args.ceiling_writers.iter().enumerate() {
        status_patches(&mgcs, &names_list, writers, writers * 4, 2 * round + 1).await?;
        let patches = n.max(1000);
        let start = Instant::now();
        status_patches(&mgcs, &names_list, writers, patches, 2 * round + 2).await?;
        ceilings.push((writers, patches as f64 / start.elapsed().as_secs_f64()));
    }
    let (best_writers, ceiling) = ceilings
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .context("no ceiling measured: --ceiling-writers is empty")?;

    let writes = writes_after - writes_before;
    let secs = drained.as_secs_f64();
    let provider_write_rate = writes.ours / secs;
    println!("objects                      {n}");
    println!("drain time                   {secs:.2} s");
    println!("objects/second               {:.1}", n as f64 / secs);
    println!(
        "API writes per object        {:.2} to our objects ({} writes; {} API writes in all, Events excluded)",
        writes.ours / n as f64,
        writes.ours,
        writes.all
    );
    println!(
        "mails accepted               {} (expected {n}, duplicated ids {duplicates})",
        mails.len()
    );
    println!(
        "provider peak RSS            {peak_rss:.1} MiB (at the end: {anon:.1} MiB heap and stacks, {file:.1} MiB mapped files)"
    );
    println!(
        "API writes while idle        {} to our objects in {} s ({} in all: the control plane's own)",
        idle_writes.ours, args.idle_seconds, idle_writes.all
    );
    println!(
        "API server raw ceiling       {ceiling:.0} status writes/s (best at {best_writers} writers; {})",
        ceilings
            .iter()
            .map(|(w, r)| format!("{w}: {r:.0}/s"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    println!(
        "provider write rate          {provider_write_rate:.0} writes/s = {:.0}% of the ceiling",
        100.0 * provider_write_rate / ceiling
    );
    cp.stop();
    if mails.len() != n || duplicates > 0 {
        bail!(
            "expected exactly {n} mails, one per object; got {} with {duplicates} duplicated ids",
            mails.len()
        );
    }
    Ok(())
}
