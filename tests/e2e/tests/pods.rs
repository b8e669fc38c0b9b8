//! The chart's Deployment as real Pods (issue 15): a local node (containerd, runc, CNI bridge,
//! kubelet, kube-scheduler) and a release installed the way users install it (issue 36):
//! `hack/release.sh` pushes this build's image and the chart (the image pinned by digest) to a
//! real registry on loopback with TLS, `helm install oci://...` with 2 replicas into a namespace
//! enforcing Pod Security "restricted", and containerd pulls the image by digest through the
//! kubelet, trusting the registry's CA through its `hosts.toml`.
//! Then: both Pods become Ready through the chart's probes; exactly one holds the Lease; the API
//! server converts through the chart's webhook Service; Prometheus scrapes the Pods found through
//! the metrics Service; Clusters get exactly one mail each from the Mailgun contract server on
//! the host; deleting the leader hands over (the time is printed); a rolling upgrade keeps the
//! PDB's minimum; the memory limit holds with many objects. Needs root (`make test` runs as
//! root in CI); everything it creates is removed at the end, also on failure.

use std::{
    collections::BTreeMap,
    fs,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use capm_e2e::{
    CHART_NAMESPACE as NS, FULLNAME, Prometheus, RELEASE, create_cluster_pair, create_namespace,
    create_secret, dynamic_api, eventually, helm,
    pods::{check_no_restarts, leader, load_kubectl_image, on_a_node, provider_pods, ready},
    provider_binary,
    release::{Registry, Release, key_pair, release, verify_signature},
    start_capi_manager,
};
use capm_mail_servers::MailgunServer;
use capm_test_support::ControlPlane;
use k8s_openapi::api::{apps::v1::Deployment, coordination::v1::Lease, core::v1::Pod};
use kube::{
    Api,
    api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams},
};

const USER_NS: &str = "team-a";
const REQUESTER: &str = "pods@example.com";
/// The chart names the Lease as the binary does by default.
const LEASE: &str = "cluster-api-provider-mailgun-leader";
const DOMAIN: &str = "mg.e2e.example.com";
const RECIPIENT: &str = "infrastructure-team@example.com";
/// Objects of the memory check (`CAPM_PODS_OBJECTS` overrides): the Cluster + MailgunCluster
/// pairs alive at once while the chart's memory limit applies.
const MANY: usize = 1000;

/// Mails per Cluster name (from the subject "New Cluster <name> requested").
fn mails_per_cluster(server: &MailgunServer) -> Result<BTreeMap<String, usize>> {
    let mut counts = BTreeMap::new();
    for m in server.messages()? {
        if let Some(name) = m
            .subject
            .split_once("New Cluster ")
            .and_then(|(_, rest)| rest.split_once(" requested"))
            .map(|(name, _)| name.to_owned())
        {
            *counts.entry(name).or_insert(0) += 1;
        }
    }
    Ok(counts)
}

/// Waits until every name in `names` has exactly one mail and none has two.
async fn every_mail_once(server: &MailgunServer, names: &[String], wait: Duration) -> Result<()> {
    eventually(
        wait,
        &format!("one mail for each of {} Clusters", names.len()),
        || async {
            let counts = mails_per_cluster(server)?;
            if let Some((name, n)) = counts.iter().find(|(_, n)| **n > 1) {
                bail!("Cluster {name} got {n} mails");
            }
            Ok(names.iter().all(|n| counts.contains_key(n)).then_some(()))
        },
    )
    .await
}

/// The container's peak memory use from its cgroup (v1 `memory.max_usage_in_bytes` under
/// containerd's `k8s.io` parent, or v2 `memory.peak`), in bytes.
fn peak_memory(container_id: &str) -> Option<u64> {
    [
        format!("/sys/fs/cgroup/memory/k8s.io/{container_id}/memory.max_usage_in_bytes"),
        format!("/sys/fs/cgroup/k8s.io/{container_id}/memory.peak"),
    ]
    .iter()
    .find_map(|p| fs::read_to_string(p).ok())
    .and_then(|s| s.trim().parse().ok())
}

/// `helm <verb> capm oci://<registry>/.../cluster-api-provider-mailgun --version <version>`: the
/// released chart, fetched from the registry (trusting its CA).
fn helm_release(
    registry: &Registry,
    released: &Release,
    kubeconfig: &std::path::Path,
    verb: &str,
    values: &std::path::Path,
    extra: &[&str],
) -> Result<String> {
    let mut cmd = registry.client("helm", &released.out.join(".home"))?;
    cmd.env("KUBECONFIG", kubeconfig)
        .args([
            verb,
            RELEASE,
            &released.chart,
            "--version",
            &released.version,
        ])
        .args(["-n", NS, "-f"])
        .arg(values)
        .args(extra);
    capm_e2e::run(
        &mut cmd,
        &format!("helm {verb} {RELEASE} {}", released.chart),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn the_chart_runs_as_pods_from_the_projects_image() -> Result<()> {
    on_a_node(NS, run).await
}

async fn run(cp: &ControlPlane, dir: &std::path::Path) -> Result<()> {
    cp.install_capi_crds().await?;
    let admin = cp.client().await?;
    let net = cp.network().context("the node's network")?.clone();

    // The release: this build's provider as an image and the chart pinning its digest, pushed
    // to a registry on loopback (TLS) by the release script; the node's containerd trusts the
    // registry's CA (hosts.toml) and nothing is imported by hand.
    let binary =
        std::env::var_os("CAPM_IMAGE_BINARY").map_or_else(provider_binary, |p| Ok(p.into()))?;
    let t = Instant::now();
    let registry = Registry::start(dir).await?;
    let (key, _) = key_pair(&registry, &dir.join("keys"))?;
    let released = release(&registry, "capm", &binary, &dir.join("release"), Some(&key))?;
    cp.trust_registry(&registry.host, &registry.ca_pem)?;
    // What a user checks before installing: the image's signature, the SBOM beside the assets.
    verify_signature(&registry, &released.out.join("cosign.pub"), &released.image)?;
    let sbom = released.out.join(format!(
        "cluster-api-provider-mailgun-{}.cdx.json",
        released.version
    ));
    ensure!(sbom.is_file(), "no SBOM at {}", sbom.display());
    let image = released.image.clone();
    println!(
        "released {image} and {} {} in {:.1?}",
        released.chart,
        released.version,
        t.elapsed()
    );

    // The Mailgun contract server on the bridge's address, reachable from Pods.
    let api_key = "key-pods-e2e-not-logged";
    let mailgun = MailgunServer::start_on(net.gateway.into(), api_key, DOMAIN)?;

    create_namespace(&admin, NS, true).await?;
    create_namespace(&admin, USER_NS, false).await?;
    create_secret(&admin, NS, "mailgun-credentials", &[("api-key", api_key)]).await?;
    let values = dir.join("values.yaml");
    fs::write(
        &values,
        format!(
            "replicaCount: 2\n\
             mail:\n  recipient: {RECIPIENT}\n  backend: mailgun\n  mailgun:\n    domain: {DOMAIN}\n    \
             baseURL: {}\n    apiKeySecret: {{name: mailgun-credentials}}\n\
             metrics:\n  insecure: true\n",
            mailgun.base_url()
        ),
    )?;
    // Cluster API's core manager, on the host (it is not what this test is about).
    let _capi = start_capi_manager(cp.kubeconfig(), dir)?;
    let t = Instant::now();
    helm_release(
        &registry,
        &released,
        cp.kubeconfig(),
        "install",
        &values,
        &[],
    )?;

    let pods: Api<Pod> = Api::namespaced(admin.clone(), NS);
    let running = eventually(
        Duration::from_secs(180),
        "2 provider Pods Ready",
        || async {
            let list = provider_pods(&pods, None).await?;
            check_no_restarts(&list)?;
            Ok((list.iter().filter(|p| ready(p)).count() == 2).then_some(list))
        },
    )
    .await?;
    println!("helm install -> 2 Pods Ready in {:.1?}", t.elapsed());
    for pod in &running {
        let spec = pod.spec.as_ref().context("pod spec")?;
        let c = &spec.containers[0];
        ensure!(
            c.image.as_deref() == Some(image.as_str()),
            "image {:?}",
            c.image
        );
        let image_id = pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .and_then(|s| s.first())
            .map(|s| s.image_id.clone())
            .unwrap_or_default();
        ensure!(
            image_id.ends_with(&released.image_digest),
            "the container runs {image_id}, not {}",
            released.image_digest
        );
        let ip = pod
            .status
            .as_ref()
            .and_then(|s| s.pod_ip.clone())
            .context("pod IP")?;
        println!("  {} on {ip}", pod.metadata.name.as_deref().unwrap_or("?"));
    }

    // containerd pulled it from the registry: the manifest by its digest, in the access log.
    let pulled = registry
        .log()
        .lines()
        .filter(|l| {
            l.contains(&format!(
                "/v2/capm/cluster-api-provider-mailgun/manifests/{}",
                released.image_digest
            )) && l.contains("containerd")
        })
        .count();
    ensure!(
        pulled > 0,
        "the registry served no manifest to containerd:\n{}",
        registry.log()
    );

    // Exactly one holds the Lease.
    let leases: Api<Lease> = Api::namespaced(admin.clone(), NS);
    let names: Vec<String> = running
        .iter()
        .filter_map(|p| p.metadata.name.clone())
        .collect();
    let first_leader = eventually(
        Duration::from_secs(60),
        "a leader among the Pods",
        || async { Ok(leader(&leases, LEASE).await?.filter(|l| names.contains(l))) },
    )
    .await?;
    println!("leader: {first_leader}");

    // The API server converts through the chart's webhook Service (endpoints: the Pods).
    create_cluster_pair(&admin, USER_NS, "first", REQUESTER).await?;
    let old = dynamic_api(
        &admin,
        USER_NS,
        "infrastructure.cluster.x-k8s.io",
        "v1alpha1",
        "MailgunCluster",
    );
    let converted = eventually(
        Duration::from_secs(60),
        "a v1alpha1 read through the webhook",
        || async { Ok(old.get("first").await.ok()) },
    )
    .await?;
    ensure!(
        converted
            .types
            .as_ref()
            .is_some_and(|t| t.api_version.ends_with("/v1alpha1")),
        "conversion answered {:?}",
        converted.types
    );
    every_mail_once(&mailgun, &["first".to_owned()], Duration::from_secs(120)).await?;

    // `helm test`: the chart's test Pod checks /readyz of the Pods (through a Service of the
    // test and the API server's proxy) and the webhooks (a server-side dry run through v1alpha1).
    load_kubectl_image(cp)?;
    let t = Instant::now();
    let tested = helm(
        Some(cp.kubeconfig()),
        &["test", RELEASE, "-n", NS, "--logs", "--timeout", "3m"],
    )?;
    println!("helm test {RELEASE} ({:.1?}):\n{tested}", t.elapsed());
    ensure!(
        tested.contains("Phase:") && tested.contains("Succeeded"),
        "helm test did not succeed:\n{tested}"
    );
    ensure!(
        tested.contains("created (server dry run)"),
        "the test Pod's webhook check did not run:\n{tested}"
    );

    // Prometheus scrapes the Pods behind the metrics Service (its endpoints).
    let targets = eventually(
        Duration::from_secs(60),
        "2 endpoints behind the metrics Service",
        || async {
            let gvk = GroupVersionKind::gvk("discovery.k8s.io", "v1", "EndpointSlice");
            let slices: Api<DynamicObject> =
                Api::namespaced_with(admin.clone(), NS, &ApiResource::from_gvk(&gvk));
            let list = slices
                .list(
                    &ListParams::default()
                        .labels(&format!("kubernetes.io/service-name={FULLNAME}-metrics")),
                )
                .await?;
            let mut targets = Vec::new();
            for s in &list.items {
                let port = s.data["ports"][0]["port"].as_u64().unwrap_or(0);
                for e in s.data["endpoints"].as_array().into_iter().flatten() {
                    if e["conditions"]["ready"] == true {
                        for a in e["addresses"].as_array().into_iter().flatten() {
                            targets.push(format!("{}:{port}", a.as_str().unwrap_or("")));
                        }
                    }
                }
            }
            Ok((targets.len() == 2).then_some(targets))
        },
    )
    .await?;
    let mut prometheus = Prometheus::start(&dir.join("prometheus"), &targets, None).await?;
    let up = eventually(
        Duration::from_secs(60),
        "both Pods up in Prometheus",
        || {
            let v = prometheus.query("sum(up)");
            async move { Ok(v?.first().copied().filter(|v| *v >= 2.0)) }
        },
    )
    .await?;
    let reconciles = prometheus.query("sum(controller_runtime_reconcile_total)")?;
    println!(
        "Prometheus: sum(up) = {up}, sum(controller_runtime_reconcile_total) = {reconciles:?}"
    );
    ensure!(
        reconciles.first().is_some_and(|v| *v > 0.0),
        "no reconciles scraped"
    );
    drop(prometheus);

    // Failover: delete the leader Pod; the other takes the Lease. Clusters created meanwhile
    // get their mail once.
    let t = Instant::now();
    pods.delete(&first_leader, &DeleteParams::default()).await?;
    let mut during = Vec::new();
    for i in 0..5 {
        let name = format!("failover-{i}");
        create_cluster_pair(&admin, USER_NS, &name, REQUESTER).await?;
        during.push(name);
    }
    // The deleted leader releases the Lease as it stops; whichever live Pod asks first takes
    // it (the standby, or the Deployment's replacement Pod when it starts within the
    // standby's retry period).
    let new_leader = eventually(
        Duration::from_secs(90),
        "another Pod to take the Lease",
        || async { Ok(leader(&leases, LEASE).await?.filter(|l| *l != first_leader)) },
    )
    .await?;
    let live = provider_pods(&pods, None).await?;
    ensure!(
        live.iter()
            .any(|p| p.metadata.name.as_deref() == Some(new_leader.as_str())
                && p.metadata.deletion_timestamp.is_none()),
        "the new leader {new_leader} is not a live provider Pod"
    );
    println!(
        "failover: {first_leader} deleted -> {new_leader} leads after {:.1?}",
        t.elapsed()
    );
    let mut all = vec!["first".to_owned()];
    all.extend(during);
    every_mail_once(&mailgun, &all, Duration::from_secs(120)).await?;
    println!(
        "failover: every mail sent once, {:.1?} after the delete",
        t.elapsed()
    );
    eventually(
        Duration::from_secs(180),
        "the replacement Pod Ready",
        || async {
            let list = provider_pods(&pods, None).await?;
            Ok((list.iter().filter(|p| ready(p)).count() == 2).then_some(()))
        },
    )
    .await?;

    // A rolling upgrade changing a value: the Deployment never has fewer Ready Pods than the
    // PDB's minAvailable (1), and no mail is lost or doubled.
    let t = Instant::now();
    helm_release(
        &registry,
        &released,
        cp.kubeconfig(),
        "upgrade",
        &values,
        &["--set", "logging.level=debug"],
    )?;
    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), NS);
    let mut min_ready = usize::MAX;
    let mut round = 0;
    loop {
        let list = provider_pods(&pods, None).await?;
        min_ready = min_ready.min(list.iter().filter(|p| ready(p)).count());
        if round < 5 {
            let name = format!("upgrade-{round}");
            create_cluster_pair(&admin, USER_NS, &name, REQUESTER).await?;
            all.push(name);
        }
        round += 1;
        let d = deployments.get(FULLNAME).await?;
        let (generation, status) = (d.metadata.generation, d.status.unwrap_or_default());
        if status.observed_generation == generation
            && status.updated_replicas == Some(2)
            && status.ready_replicas == Some(2)
            && status.replicas == Some(2)
        {
            break;
        }
        ensure!(
            t.elapsed() < Duration::from_secs(240),
            "rollout not done after 240 s: {status:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "rolling upgrade done in {:.1?}; fewest Ready Pods seen: {min_ready}",
        t.elapsed()
    );
    ensure!(
        min_ready >= 1,
        "the rollout went below the PDB's minAvailable: {min_ready} Ready"
    );
    every_mail_once(&mailgun, &all, Duration::from_secs(120)).await?;

    // The memory limit of values.yaml holds with many objects: no OOM kill, no restart.
    let many = std::env::var("CAPM_PODS_OBJECTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(MANY);
    let t = Instant::now();
    let mut batch = Vec::new();
    for i in 0..many {
        let name = format!("many-{i}");
        create_cluster_pair(&admin, USER_NS, &name, REQUESTER).await?;
        batch.push(name);
    }
    println!(
        "{many} Cluster + MailgunCluster pairs created in {:.1?}",
        t.elapsed()
    );
    every_mail_once(&mailgun, &batch, Duration::from_secs(600)).await?;
    println!("{many} mails sent once each in {:.1?}", t.elapsed());
    let list = provider_pods(&pods, None).await?;
    check_no_restarts(&list)?;
    ensure!(
        list.iter().filter(|p| ready(p)).count() == 2,
        "a Pod is not Ready after {many} objects"
    );
    for pod in &list {
        for c in pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .into_iter()
            .flatten()
        {
            let id = c
                .container_id
                .as_deref()
                .unwrap_or("")
                .trim_start_matches("containerd://");
            println!(
                "{}: peak memory {} (limit in values.yaml: {})",
                pod.metadata.name.as_deref().unwrap_or("?"),
                peak_memory(id).map_or_else(
                    || "unknown".to_owned(),
                    |b| format!("{:.1} MiB", b as f64 / 1048576.0)
                ),
                pod.spec
                    .as_ref()
                    .and_then(|s| s.containers[0].resources.as_ref())
                    .and_then(|r| r.limits.as_ref())
                    .and_then(|l| l.get("memory"))
                    .map_or("none", |q| q.0.as_str()),
            );
        }
    }
    all.extend(batch);
    let counts = mails_per_cluster(&mailgun)?;
    ensure!(
        counts.len() == all.len(),
        "{} Clusters mailed, {} created",
        counts.len(),
        all.len()
    );

    helm(
        Some(cp.kubeconfig()),
        &["uninstall", RELEASE, "-n", NS, "--wait"],
    )?;
    Ok(())
}
