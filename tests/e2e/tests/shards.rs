//! Sharding (issue 27): two releases of the chart, shard A and shard B, each a Deployment of 2
//! replicas running as real Pods on a local node (see `pods.rs`), each with its own
//! `watchFilter`, Lease and Mailgun contract server. Shard A installs the CRDs, the webhook and
//! the admission policies; shard B installs none of them and runs as A's ServiceAccount.
//!
//! Checked: objects labelled `cluster.x-k8s.io/watch-filter=shard-a` are mailed by A only, B's by
//! B only, unlabelled ones by neither (there is no default shard here: an unfiltered release
//! would be one); each shard's `mailer_messages_total` counts its own objects only; SIGKILL of
//! A's leader leaves B's Lease and B's objects alone while A's objects wait for A's new leader;
//! deleting everything releases every mailed object once. The drain rate of one shard and of two
//! is printed (`CAPM_SHARD_OBJECTS` pairs each, 200 by default). Needs root.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::Path,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};
use capm_e2e::{
    create_labelled_cluster_pair, create_namespace, create_secret, dynamic_api, eventually, helm,
    helm_chart, http_get,
    ledger::{Kind, Object},
    mailgun_ledger,
    pods::{leader, on_a_node, provider_pods, ready},
    provider_binary, run, start_capi_manager,
};
use capm_mail_servers::MailgunServer;
use capm_test_support::{ControlPlane, process};
use k8s_openapi::api::{coordination::v1::Lease, core::v1::Pod};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, ListParams},
};

const NS: &str = "capm-system";
const USER_NS: &str = "team-shards";
const REQUESTER: &str = "shards@example.com";
const IMAGE_REPOSITORY: &str = "capm.local/cluster-api-provider-mailgun";
const IMAGE_TAG: &str = "e2e";
const RECIPIENT: &str = "infrastructure-team@example.com";
const FILTER_LABEL: &str = "cluster.x-k8s.io/watch-filter";
/// Pairs per drain measurement (`CAPM_SHARD_OBJECTS` overrides).
const DRAIN: usize = 200;

/// One shard: a release of the chart with its own watch filter and mail server.
struct Shard {
    release: &'static str,
    filter: &'static str,
    server: MailgunServer,
}

impl Shard {
    fn fullname(&self) -> String {
        format!("{}-cluster-api-provider-mailgun", self.release)
    }

    /// The chart names the Lease after the filter.
    fn lease(&self) -> String {
        format!("cluster-api-provider-mailgun-{}-leader", self.filter)
    }

    fn domain(&self) -> &str {
        self.server.domain()
    }
}

/// The UIDs of the MailgunClusters matching `selector`.
async fn uids(client: &Client, selector: &str) -> Result<BTreeSet<String>> {
    dynamic_api(
        client,
        USER_NS,
        "infrastructure.cluster.x-k8s.io",
        "v1beta1",
        "MailgunCluster",
    )
    .list(&ListParams::default().labels(selector))
    .await?
    .items
    .iter()
    .map(|o| o.uid().context("no UID"))
    .collect()
}

/// The MailgunClusters with a request mail on `shard`'s server.
fn requested(shard: &Shard) -> Result<BTreeSet<String>> {
    let ledger = mailgun_ledger(&shard.server, shard.domain())?;
    Ok(ledger
        .entries
        .iter()
        .filter(|(o, e)| o.kind == Kind::Cluster && !e.requests.is_empty())
        .map(|(o, _)| o.uid.clone())
        .collect())
}

/// Creates `count` pairs named `<prefix>-<i>`, labelled for `filter` (unlabelled when `None`).
async fn create_pairs(
    client: &Client,
    prefix: &str,
    count: usize,
    filter: Option<&str>,
) -> Result<()> {
    for i in 0..count {
        let name = format!("{prefix}-{i}");
        match filter {
            Some(f) => {
                create_labelled_cluster_pair(
                    client,
                    USER_NS,
                    &name,
                    REQUESTER,
                    &[(FILTER_LABEL, f)],
                )
                .await?;
            }
            None => create_labelled_cluster_pair(client, USER_NS, &name, REQUESTER, &[]).await?,
        }
    }
    Ok(())
}

/// Waits until `shard`'s server holds a request mail for every object labelled for it, and for
/// nothing else.
async fn all_mailed(client: &Client, shard: &Shard, wait: Duration) -> Result<usize> {
    eventually(
        wait,
        &format!("every {} object mailed", shard.filter),
        || async {
            let own = uids(client, &format!("{FILTER_LABEL}={}", shard.filter)).await?;
            let mailed = requested(shard)?;
            let foreign: Vec<_> = mailed.difference(&own).collect();
            ensure!(
                foreign.is_empty(),
                "{} mailed objects that are not its own: {foreign:?}",
                shard.release
            );
            Ok((mailed == own).then_some(own.len()))
        },
    )
    .await
}

/// Sum of `mailer_messages_total` over the shard's Pods, scraped over plain HTTP.
async fn mails_counted(pods: &Api<Pod>, shard: &Shard) -> Result<f64> {
    let mut total = 0.0;
    for pod in provider_pods(pods, Some(shard.release)).await? {
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .context("pod IP")?;
        let (status, body) = http_get(&format!("{ip}:8443"), "/metrics")?;
        ensure!(
            status == 200,
            "metrics of {}: HTTP {status}",
            pod.name_any()
        );
        total += body
            .lines()
            .filter(|l| l.starts_with("mailer_messages_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
    }
    Ok(total)
}

/// The Lease's whole holder identity (`<pod>_<suffix>`: a restarted container is a new holder).
async fn holder(leases: &Api<Lease>, name: &str) -> Result<Option<String>> {
    Ok(leases
        .get_opt(name)
        .await?
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity))
}

#[tokio::test(flavor = "multi_thread")]
async fn two_shards_mail_only_their_own_objects() -> Result<()> {
    on_a_node(NS, story).await
}

async fn story(cp: &ControlPlane, dir: &Path) -> Result<()> {
    cp.install_capi_crds().await?;
    let admin = cp.client().await?;
    let net = cp.network().context("the node's network")?.clone();
    let image = format!("{IMAGE_REPOSITORY}:{IMAGE_TAG}");
    cp.load_provider_image(&provider_binary()?, &image)?;

    let api_key = "key-shards-e2e-not-logged";
    let shards =
        [("capm-a", "shard-a"), ("capm-b", "shard-b")].map(|(release, filter)| -> Result<Shard> {
            Ok(Shard {
                release,
                filter,
                server: MailgunServer::start_on(
                    net.gateway.into(),
                    api_key,
                    &format!("mg.{filter}.example.com"),
                )?,
            })
        });
    let [a, b] = shards;
    let (a, b) = (a?, b?);
    create_namespace(&admin, NS, true).await?;
    create_namespace(&admin, USER_NS, false).await?;
    create_secret(&admin, NS, "mailgun-credentials", &[("api-key", api_key)]).await?;
    let _capi = start_capi_manager(cp.kubeconfig(), dir)?;

    // Shard A installs what all shards share; shard B only its Deployment, RBAC and Lease, and
    // runs as A's ServiceAccount (the identity the annotation policy lets write our records).
    for shard in [&a, &b] {
        let mut values = format!(
            "replicaCount: 2\nwatchFilter: {}\n\
             image:\n  repository: {IMAGE_REPOSITORY}\n  tag: {IMAGE_TAG}\n  pullPolicy: Never\n\
             mail:\n  recipient: {RECIPIENT}\n  backend: mailgun\n  mailgun:\n    domain: {}\n    \
             baseURL: {}\n    apiKeySecret: {{name: mailgun-credentials}}\n\
             metrics:\n  insecure: true\n",
            shard.filter,
            shard.domain(),
            shard.server.base_url()
        );
        if shard.release != a.release {
            values.push_str(&format!(
                "crds:\n  install: false\nserviceAccount:\n  create: false\n  name: {}\n",
                a.fullname()
            ));
        }
        let file = dir.join(format!("{}.yaml", shard.release));
        fs::write(&file, values)?;
        helm_chart(cp.kubeconfig(), "install", shard.release, NS, &file, &[])?;
    }
    let manifest = helm(
        Some(cp.kubeconfig()),
        &["get", "manifest", b.release, "-n", NS],
    )?;
    for kind in [
        "CustomResourceDefinition",
        "ValidatingWebhookConfiguration",
        "ValidatingAdmissionPolicy",
    ] {
        ensure!(
            !manifest.contains(&format!("kind: {kind}\n")),
            "shard B installed a {kind}"
        );
    }

    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let leases: Api<Lease> = Api::namespaced(admin.clone(), NS);
    let t = Instant::now();
    let mut leaders = BTreeMap::new();
    for shard in [&a, &b] {
        let names: Vec<String> = eventually(
            Duration::from_secs(180),
            &format!("2 Ready Pods of {}", shard.release),
            || async {
                let list = provider_pods(&pods, Some(shard.release)).await?;
                let ready: Vec<_> = list
                    .iter()
                    .filter(|p| ready(p))
                    .map(|p| p.name_any())
                    .collect();
                Ok((ready.len() == 2).then_some(ready))
            },
        )
        .await?;
        let lease = shard.lease();
        let l = eventually(
            Duration::from_secs(60),
            &format!("a leader of {}", shard.release),
            || async { Ok(leader(&leases, &lease).await?.filter(|l| names.contains(l))) },
        )
        .await?;
        println!(
            "{}: Pods {names:?}, Lease {lease} held by {l}",
            shard.release
        );
        leaders.insert(shard.release, l);
    }
    println!("both shards Ready and leading in {:.1?}", t.elapsed());

    // Ownership: A's objects by A, B's by B, unlabelled ones by neither.
    create_pairs(&admin, "a", 20, Some(a.filter)).await?;
    create_pairs(&admin, "b", 20, Some(b.filter)).await?;
    create_pairs(&admin, "none", 10, None).await?;
    for shard in [&a, &b] {
        let n = all_mailed(&admin, shard, Duration::from_secs(120)).await?;
        ensure!(n == 20, "{}: {n} objects", shard.release);
    }
    // The unlabelled ones: no shard filters them in. Waited for past the time both shards
    // took for theirs, and then some.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let unlabelled = uids(&admin, &format!("!{FILTER_LABEL}")).await?;
    ensure!(unlabelled.len() == 10, "{unlabelled:?}");
    for shard in [&a, &b] {
        let mailed = requested(shard)?;
        ensure!(
            mailed.is_disjoint(&unlabelled),
            "{} mailed an unlabelled object",
            shard.release
        );
    }
    let untouched = dynamic_api(
        &admin,
        USER_NS,
        "infrastructure.cluster.x-k8s.io",
        "v1beta1",
        "MailgunCluster",
    )
    .list(&ListParams::default().labels(&format!("!{FILTER_LABEL}")))
    .await?
    .items
    .iter()
    .all(|o| {
        o.finalizers().is_empty() && o.data.get("status").is_none_or(serde_json::Value::is_null)
    });
    ensure!(untouched, "an unlabelled MailgunCluster was reconciled");
    // Each shard's metrics count its own mails only (the standby's are 0).
    for shard in [&a, &b] {
        let counted = mails_counted(&pods, shard).await?;
        let mailed = requested(shard)?.len();
        ensure!(
            (counted - mailed as f64).abs() < 0.5,
            "{}: mailer_messages_total {counted}, its server holds {mailed}",
            shard.release
        );
    }
    println!("ownership: 20 + 20 mailed by their own shard, 10 unlabelled by neither");

    // Drain rates: N pairs for shard A alone, then N split over both shards. The pairs are
    // created under a filter no shard has, then relabelled at once (one `kubectl label` per
    // shard), so the time is the shards' and not the test's creating.
    let n = std::env::var("CAPM_SHARD_OBJECTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DRAIN);
    let relabel = |from: &str, to: &str| -> Result<()> {
        cp.kubectl_output(&[
            "-n",
            USER_NS,
            "label",
            "mailgunclusters.infrastructure.cluster.x-k8s.io",
            "-l",
            &format!("{FILTER_LABEL}={from}"),
            &format!("{FILTER_LABEL}={to}"),
            "--overwrite",
        ])?;
        Ok(())
    };
    create_pairs(&admin, "one", n, Some("parked-a")).await?;
    let t = Instant::now();
    relabel("parked-a", a.filter)?;
    all_mailed(&admin, &a, Duration::from_secs(600)).await?;
    let one = t.elapsed();
    create_pairs(&admin, "two-a", n / 2, Some("parked-a")).await?;
    create_pairs(&admin, "two-b", n - n / 2, Some("parked-b")).await?;
    let t = Instant::now();
    relabel("parked-a", a.filter)?;
    relabel("parked-b", b.filter)?;
    all_mailed(&admin, &a, Duration::from_secs(600)).await?;
    all_mailed(&admin, &b, Duration::from_secs(600)).await?;
    let two = t.elapsed();
    println!(
        "drain of {n} pairs (relabelled to mailed): one shard {:.1?} ({:.1} objects/s), two shards {:.1?} ({:.1} objects/s)",
        one,
        n as f64 / one.as_secs_f64(),
        two,
        n as f64 / two.as_secs_f64()
    );

    // SIGKILL of A's leader: A's objects wait for A's next leader; B's Lease and B's objects
    // carry on.
    let a_lease = a.lease();
    let b_lease = b.lease();
    let a_holder = holder(&leases, &a_lease)
        .await?
        .context("A's Lease holder")?;
    let b_holder = holder(&leases, &b_lease)
        .await?
        .context("B's Lease holder")?;
    let killed = leaders[a.release].clone();
    let container = pods
        .get(&killed)
        .await?
        .status
        .and_then(|s| s.container_statuses)
        .and_then(|c| c.into_iter().next())
        .and_then(|c| c.container_id)
        .context("the leader's container id")?;
    let socket = cp.dir().context("state dir")?.join("containerd.sock");
    let t = Instant::now();
    run(
        Command::new(process::binary("ctr")?)
            .arg("--address")
            .arg(&socket)
            .args(["-n", "k8s.io", "tasks", "kill", "--signal", "SIGKILL"])
            .arg(container.trim_start_matches("containerd://")),
        "ctr tasks kill",
    )?;
    create_pairs(&admin, "after-kill-a", 5, Some(a.filter)).await?;
    create_pairs(&admin, "after-kill-b", 5, Some(b.filter)).await?;
    all_mailed(&admin, &b, Duration::from_secs(60)).await?;
    let b_done = t.elapsed();
    let a_holder_when_b_done = holder(&leases, &a_lease).await?;
    all_mailed(&admin, &a, Duration::from_secs(120)).await?;
    let a_done = t.elapsed();
    let a_new = holder(&leases, &a_lease)
        .await?
        .context("A's Lease holder")?;
    println!(
        "A's leader {killed} killed: B's 5 objects mailed after {b_done:.1?} (A's Lease then held by {a_holder_when_b_done:?}), \
         A's after {a_done:.1?} by {a_new}"
    );
    ensure!(
        a_new != a_holder,
        "A's Lease is still held by the killed process"
    );
    ensure!(
        a_holder_when_b_done.as_deref() == Some(a_holder.as_str()),
        "B's objects were mailed only after A's Lease moved: B waited on A"
    );
    ensure!(
        holder(&leases, &b_lease).await?.as_deref() == Some(b_holder.as_str()),
        "B's Lease changed hands when A's leader was killed"
    );

    // Everything deleted: each mailed object released once, by its own shard.
    let own: BTreeMap<&str, BTreeSet<String>> = [
        (
            a.release,
            uids(&admin, &format!("{FILTER_LABEL}={}", a.filter)).await?,
        ),
        (
            b.release,
            uids(&admin, &format!("{FILTER_LABEL}={}", b.filter)).await?,
        ),
    ]
    .into();
    let t = Instant::now();
    let clusters = dynamic_api(&admin, USER_NS, "cluster.x-k8s.io", "v1beta2", "Cluster");
    let mailgun_clusters = dynamic_api(
        &admin,
        USER_NS,
        "infrastructure.cluster.x-k8s.io",
        "v1beta1",
        "MailgunCluster",
    );
    eventually(
        Duration::from_secs(600),
        "every Cluster and MailgunCluster gone",
        || async {
            let listed = clusters.list(&ListParams::default()).await?.items;
            // One delete of the whole collection; on a loaded machine the API server's request
            // timeout (60 s) can end it partway, so it is asked again for what is left.
            if listed
                .iter()
                .any(|c| c.metadata.deletion_timestamp.is_none())
                && let Err(e) = clusters
                    .delete_collection(&DeleteParams::default(), &ListParams::default())
                    .await
            {
                println!("deleting the Clusters: {e} (asked again)");
            }
            let left = listed.len()
                + mailgun_clusters
                    .list(&ListParams::default())
                    .await?
                    .items
                    .len();
            Ok((left == 0).then_some(()))
        },
    )
    .await?;
    println!(
        "{} objects deleted in {:.1?}",
        own.values().map(BTreeSet::len).sum::<usize>() + 10,
        t.elapsed()
    );
    for shard in [&a, &b] {
        let ledger = mailgun_ledger(&shard.server, shard.domain())?;
        let violations = ledger.check(&BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
        ensure!(
            violations.is_empty(),
            "{}: {}",
            shard.release,
            violations
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n")
        );
        let objects: BTreeSet<String> = ledger
            .entries
            .keys()
            .map(|o: &Object| o.uid.clone())
            .collect();
        ensure!(
            objects == own[shard.release],
            "{}: mailed objects differ from its own",
            shard.release
        );
        ensure!(
            ledger
                .entries
                .values()
                .all(|e| e.requests.len() == 1 && e.releases.len() == 1),
            "{}: an object without exactly one request and one release",
            shard.release
        );
        println!(
            "{}: {} objects, one request and one release each",
            shard.release,
            objects.len()
        );
    }
    for shard in [&b, &a] {
        helm(
            Some(cp.kubeconfig()),
            &["uninstall", shard.release, "-n", NS, "--wait"],
        )?;
    }
    Ok(())
}
