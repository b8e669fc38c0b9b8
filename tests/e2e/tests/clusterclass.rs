//! ClusterClass (issue 27): the real Cluster API core manager with its topology controller on
//! (`--feature-gates=ClusterTopology=true`), a ClusterClass naming our MailgunClusterTemplate and
//! MailgunMachineTemplate (with the test-only control plane and bootstrap providers of
//! `capm_e2e::topology`), and a topology Cluster with one MachineDeployment of 2 replicas. The
//! provider runs from this build as the chart's Deployment would (its arguments, its
//! ServiceAccount's token, the chart's CRDs and admission policies), against the Mailgun contract
//! server; a human fulfils each request with the command from its mail. The ClusterClass, its
//! Mailgun templates, variables and patches, and the Cluster come from the real `clusterctl
//! generate cluster --flavor clusterclass` of this build's release assets with clusterctl
//! variables set (only the kubeadm control plane and bootstrap templates are swapped for the
//! test providers'), so the shipped patches carry the Cluster's choices into our objects, and
//! the workers' health check names the shipped MailgunRemediationTemplate (issue 56).
//!
//! The story: request mails once each, with the request, priority and requester the Cluster's
//! variables chose; the Cluster `Provisioned` and the Machines' infrastructure ready; no writes to
//! our objects while the topology controller reconciles a settled Cluster again; a changed
//! variable (the machines' request) rotates the MailgunMachineTemplate and rolls the machines
//! (new ones request with the new text, old ones release); scaling through `spec.topology`;
//! deleting the Cluster. The mail ledger then shows exactly one request and one release per
//! object, and the API server's audit log what the topology controller sent our CRDs (dry-runs
//! and applies).

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use capm_e2e::{
    AuditedRequest, all_audited_requests,
    clusterctl::LocalRepository,
    create_namespace, dynamic_api, eventually, fulfil_command, install_chart_and_provider,
    ledger::{Kind, Ledger, Object, Received, Which, parse_message_id},
    mailgun_ledger, mailgun_mails, mailgun_values, start_capi_manager_with,
    topology::{self, TestProviders},
};
use capm_mail_servers::MailgunServer;
use capm_test_support::{ControlPlane, KUBERNETES_VERSION};
use kube::{
    Api, Client, ResourceExt,
    api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams},
};
use serde_json::json;

const USER_NS: &str = "team-topology";
const DOMAIN: &str = "mg.topology.example.com";
const RECIPIENT: &str = "infrastructure-team@example.com";
const INFRA: &str = "infrastructure.cluster.x-k8s.io";
const CAPI: &str = "cluster.x-k8s.io";
const CLUSTER: &str = "topo";
const MD: &str = "md-0";
/// What the Cluster's variables choose (through clusterctl's variables), none of it the
/// templates' own values.
const REQUESTER: &str = "capacity-planning@example.com";
const PRIORITY: &str = "ExtremelyUrgent";
const CLUSTER_REQUEST: &str = "One topology cluster, as the Cluster's variables say";
const MACHINE_REQUEST: &str = "A worker please";
const MACHINE_REQUEST_2: &str = "A bigger worker please";

/// Every request to our API group, whoever makes it, at level Metadata (with the request URI,
/// which carries `dryRun` and `fieldManager`).
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    resources: [{group: infrastructure.cluster.x-k8s.io}]
  - level: None
";

/// The objects and clients of the story.
struct World {
    cp: ControlPlane,
    admin: Client,
    mailgun: MailgunServer,
    audit_log: std::path::PathBuf,
    /// Request Message-Ids already fulfilled by the human.
    fulfilled: BTreeSet<String>,
    /// Every MailgunCluster and MailgunMachine seen, by UID.
    seen: BTreeMap<Object, String>,
}

fn api(client: &Client, group: &str, version: &str, kind: &str) -> Api<DynamicObject> {
    dynamic_api(client, USER_NS, group, version, kind)
}

fn infra(client: &Client, kind: &str) -> Api<DynamicObject> {
    api(client, INFRA, "v1beta1", kind)
}

impl World {
    fn mails(&self) -> Result<Vec<(Received, String)>> {
        mailgun_mails(&self.mailgun)
    }

    fn ledger(&self) -> Result<Ledger> {
        mailgun_ledger(&self.mailgun, DOMAIN)
    }

    /// The human: runs the command of every request mail not yet fulfilled.
    fn fulfil(&mut self) -> Result<()> {
        for (mail, body) in self.mails()? {
            let Some((object, Which::Request)) = parse_message_id(&mail.message_id, DOMAIN) else {
                continue;
            };
            if self.fulfilled.contains(&mail.message_id) {
                continue;
            }
            let short = &object.uid[..8.min(object.uid.len())];
            let fill = match object.kind {
                Kind::Cluster => vec![("<host>".to_owned(), format!("api-{short}.example.com"))],
                Kind::Machine => vec![
                    ("<scheme>://<id>".to_owned(), format!("mailgun://{short}")),
                    ("<ip>".to_owned(), "192.0.2.10".to_owned()),
                ],
            };
            let fill: Vec<(&str, &str)> =
                fill.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
            let command = fulfil_command(&body, &fill)?;
            ensure!(command[0] == "kubectl", "{command:?}");
            let mut kubectl = self.cp.kubectl()?;
            kubectl.args(&command[1..]);
            match capm_e2e::run(&mut kubectl, &command.join(" ")) {
                Ok(_) => {}
                // Deleted before the human got to it (a scale-down).
                Err(e) if format!("{e:#}").contains("NotFound") => {}
                Err(e) => return Err(e),
            }
            self.fulfilled.insert(mail.message_id);
        }
        Ok(())
    }

    /// Records the MailgunClusters and MailgunMachines that exist now.
    async fn note_objects(&mut self) -> Result<()> {
        for (kind, api_kind) in [
            (Kind::Cluster, "MailgunCluster"),
            (Kind::Machine, "MailgunMachine"),
        ] {
            for o in infra(&self.admin, api_kind)
                .list(&ListParams::default())
                .await?
                .items
            {
                let uid = o.uid().context("an object without a UID")?;
                self.seen.insert(Object { kind, uid }, o.name_any());
            }
        }
        Ok(())
    }

    /// Waits (fulfilling requests as they come) until the Cluster is `Provisioned` with its
    /// infrastructure ready and exactly `replicas` Machines exist, none deleting, each with its
    /// infrastructure provisioned (phase `Provisioned`). Returns the MailgunMachines' UIDs.
    async fn settle(&mut self, replicas: usize, timeout: Duration) -> Result<BTreeSet<String>> {
        let clusters = api(&self.admin, CAPI, "v1beta2", "Cluster");
        let machines = api(&self.admin, CAPI, "v1beta2", "Machine");
        let mailgun_machines = infra(&self.admin, "MailgunMachine");
        let deadline = Instant::now() + timeout;
        loop {
            self.fulfil()?;
            self.note_objects().await?;
            let cluster = clusters.get(CLUSTER).await?;
            let status = &cluster.data["status"];
            let cluster_ready = status["phase"] == "Provisioned"
                && status["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "InfrastructureReady" && c["status"] == "True");
            let list = machines.list(&ListParams::default()).await?.items;
            let provisioned = list
                .iter()
                .filter(|m| {
                    m.metadata.deletion_timestamp.is_none()
                        && m.data["status"]["phase"] == "Provisioned"
                        && m.data["status"]["initialization"]["infrastructureProvisioned"] == true
                })
                .count();
            let infra_list = mailgun_machines.list(&ListParams::default()).await?.items;
            if cluster_ready
                && list.len() == replicas
                && provisioned == replicas
                && infra_list.len() == replicas
            {
                return infra_list
                    .iter()
                    .map(|m| m.uid().context("no UID"))
                    .collect();
            }
            if Instant::now() > deadline {
                let phases: Vec<_> = list
                    .iter()
                    .map(|m| {
                        format!(
                            "{}: {} deleting={}",
                            m.name_any(),
                            m.data["status"]["phase"],
                            m.metadata.deletion_timestamp.is_some()
                        )
                    })
                    .collect();
                bail!(
                    "not settled at {replicas} replicas after {timeout:?}: Cluster phase {} \
                     (infrastructure ready: {cluster_ready}), Machines {phases:?}, \
                     {} MailgunMachines",
                    status["phase"],
                    infra_list.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    /// The `resourceVersion` of every object of our kinds in the namespace.
    async fn versions(&self) -> Result<BTreeMap<String, String>> {
        let mut out = BTreeMap::new();
        for kind in [
            "MailgunCluster",
            "MailgunMachine",
            "MailgunClusterTemplate",
            "MailgunMachineTemplate",
        ] {
            for o in infra(&self.admin, kind)
                .list(&ListParams::default())
                .await?
                .items
            {
                out.insert(
                    format!("{kind}/{}", o.name_any()),
                    o.resource_version().unwrap_or_default(),
                );
            }
        }
        Ok(out)
    }

    /// Objects of our kinds that still name a Secret among their owners (Cluster API's shim).
    async fn shim_references(&self) -> Result<Vec<String>> {
        let mut out = Vec::new();
        for kind in [
            "MailgunCluster",
            "MailgunMachine",
            "MailgunClusterTemplate",
            "MailgunMachineTemplate",
        ] {
            for o in infra(&self.admin, kind)
                .list(&ListParams::default())
                .await?
                .items
            {
                if o.owner_references().iter().any(|r| r.kind == "Secret") {
                    out.push(format!("{kind}/{}", o.name_any()));
                }
            }
        }
        Ok(out)
    }

    /// The requests to our kinds the audit log holds so far.
    fn audit(&self) -> Result<Vec<AuditedRequest>> {
        all_audited_requests(&self.audit_log)
    }
}

fn is_write(r: &AuditedRequest) -> bool {
    matches!(r.verb.as_str(), "create" | "update" | "patch" | "delete")
}

/// Counts of the writes (dry runs apart) in `requests`, by field manager (or user agent's
/// program), verb and resource.
fn summary(requests: &[AuditedRequest]) -> BTreeMap<String, usize> {
    let mut out = BTreeMap::new();
    for r in requests.iter().filter(|r| is_write(r)) {
        let who = if r.field_manager.is_empty() {
            r.user_agent
                .split('/')
                .next()
                .unwrap_or_default()
                .to_owned()
        } else {
            r.field_manager.clone()
        };
        let key = format!(
            "{who} {}{} {} -> {}",
            r.verb,
            if r.dry_run { " (dry run)" } else { "" },
            r.resource,
            r.code
        );
        *out.entry(key).or_insert(0) += 1;
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clusterclass_topology_mails_each_object_once() -> Result<()> {
    let work = tempfile::tempdir()?;
    let dir = work.path();
    let started = Instant::now();
    let (cp, audit_log) = capm_e2e::audited_control_plane(dir, AUDIT_POLICY).await?;
    let admin = cp.client().await?;
    topology::install_crds(&admin).await?;
    let api_key = "key-topology-e2e-not-logged";
    let mailgun = MailgunServer::start(api_key, DOMAIN)?;
    let mut world = World {
        cp,
        admin: admin.clone(),
        mailgun,
        audit_log,
        fulfilled: BTreeSet::new(),
        seen: BTreeMap::new(),
    };
    let result = story(&mut world, dir, started).await;
    if let Err(e) = &result {
        capm_e2e::report_failure(e, dir, &["capi-manager.log", "provider.log"], 40);
    }
    world.cp.stop();
    result
}

async fn story(world: &mut World, dir: &Path, started: Instant) -> Result<()> {
    let admin = world.admin.clone();
    let kubeconfig = world.cp.kubeconfig().to_owned();

    // The chart (CRDs, admission policies, RBAC), the provider as its ServiceAccount.
    let provider = install_chart_and_provider(
        &world.cp,
        api_key(world),
        &mailgun_values(RECIPIENT, DOMAIN, &world.mailgun.base_url()),
        dir,
    )
    .await?;
    create_namespace(&admin, USER_NS, false).await?;
    let capi =
        start_capi_manager_with(&kubeconfig, dir, &["--feature-gates=ClusterTopology=true"])?;
    let _providers = TestProviders::start(&admin, USER_NS);

    // The ClusterClass and the Cluster, as `clusterctl generate cluster --flavor clusterclass`
    // renders them from the release assets with the clusterctl variables a user sets.
    topology::create_templates(&admin, USER_NS, "test").await?;
    let repo = LocalRepository::new(&dir.join("clusterctl"))?;
    let generated = repo.generate_cluster(
        CLUSTER,
        "clusterclass",
        USER_NS,
        &["--kubernetes-version", KUBERNETES_VERSION],
        &[
            ("MAILGUN_CLUSTER_REQUESTER", REQUESTER),
            ("MAILGUN_CLUSTER_PRIORITY", PRIORITY),
            ("MAILGUN_CLUSTER_REQUEST", CLUSTER_REQUEST),
            ("MAILGUN_MACHINE_REQUEST", MACHINE_REQUEST),
        ],
    )?;
    let objects = topology::runnable_clusterclass(&generated, USER_NS, MD, 2)?;
    let mut kubectl = world.cp.kubectl()?;
    kubectl.args(["apply", "--server-side", "-o", "name", "-f", "-"]);
    let applied = capm_e2e::run_with_input(
        &mut kubectl,
        &json!({"apiVersion": "v1", "kind": "List", "items": objects}).to_string(),
        "applying clusterctl's Cluster and ClusterClass",
    )?;
    println!("from clusterctl generate cluster --flavor clusterclass:\n{applied}");
    let clusters = api(&admin, CAPI, "v1beta2", "Cluster");
    let machine_templates = infra(&admin, "MailgunMachineTemplate");
    let t = Instant::now();
    let first = world
        .settle(2, Duration::from_secs(180))
        .await
        .context("the topology Cluster and its 2 machines")?;
    println!(
        "topology Cluster provisioned, 2 machines provisioned, in {:.1?} ({:.1?} since start)",
        t.elapsed(),
        started.elapsed()
    );
    provider.proc.check_alive()?;
    capi.check_alive()?;
    expect_remediation_by_mail(&admin).await?;
    let mailgun_clusters = infra(&admin, "MailgunCluster")
        .list(&ListParams::default())
        .await?;
    ensure!(mailgun_clusters.items.len() == 1, "one MailgunCluster");
    let mc = &mailgun_clusters.items[0];
    ensure!(
        mc.labels().get("topology.cluster.x-k8s.io/owned").is_some(),
        "the MailgunCluster was made by the topology controller: {:?}",
        mc.labels()
    );
    // The Cluster's variables reached the MailgunCluster through the ClusterClass's patches,
    // and from there the mails: the cluster's and the first two machines'.
    let spec = &mc.data["spec"];
    ensure!(
        spec["request"] == CLUSTER_REQUEST
            && spec["priority"] == PRIORITY
            && spec["requester"] == REQUESTER,
        "the MailgunCluster's spec is not what the Cluster's variables chose: {spec}"
    );
    let ledger = world.ledger()?;
    let cluster_uid = mc.uid().context("no UID")?;
    expect_request_mail(world, &ledger, Kind::Cluster, &cluster_uid, CLUSTER_REQUEST)?;
    for uid in &first {
        expect_request_mail(world, &ledger, Kind::Machine, uid, MACHINE_REQUEST)?;
    }

    // The topology controller creates our objects owned by a temporary "shim" Secret and deletes
    // it once the Cluster owns them; the garbage collector then removes the dangling reference
    // (a patch by kube-controller-manager, up to its next resource discovery, 30 s, after the CRDs
    // appeared). Wait for that before watching for writes.
    let t = Instant::now();
    let w = &*world;
    eventually(
        Duration::from_secs(90),
        "the shim Secret's owner references removed by the garbage collector",
        || async { Ok(w.shim_references().await?.is_empty().then_some(())) },
    )
    .await?;
    println!(
        "shim owner references gone {:.1?} after provisioning",
        t.elapsed()
    );

    // Settled: the topology controller reconciles the Cluster again (each change of the Cluster
    // triggers it) and writes nothing to our objects, nor does the provider.
    let before = world.versions().await?;
    let mailgun_cluster_api = infra(&admin, "MailgunCluster");
    let meta_before =
        serde_json::to_value(&mailgun_cluster_api.get(&mc.name_any()).await?.metadata)?;
    let audit_before = world.audit()?.len();
    let merge = PatchParams::default();
    for i in 0..3 {
        clusters
            .patch(
                CLUSTER,
                &merge,
                &Patch::Merge(json!({"metadata": {"annotations": {"e2e.capm.example.com/poke": i.to_string()}}})),
            )
            .await?;
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    tokio::time::sleep(Duration::from_secs(6)).await;
    let after = world.versions().await?;
    let window: Vec<_> = world.audit()?.into_iter().skip(audit_before).collect();
    let writes: Vec<_> = window
        .iter()
        .filter(|r| is_write(r) && !r.dry_run)
        .collect();
    println!(
        "settled window (3 Cluster changes, 12 s): {} requests to our kinds, {} dry runs, {} writes",
        window.len(),
        window.iter().filter(|r| r.dry_run).count(),
        writes.len()
    );
    // Nothing changes, and neither the provider nor the topology controller writes. Elsewhere in
    // Cluster API, the MachineSet controller's metadata propagation (field manager
    // `capi-machineset-metadata`) may send a server-side apply that changes nothing (the versions
    // stay the same) when its cache of applied requests has no entry for the object; reported,
    // not failed.
    let ours_or_topology: Vec<_> = writes
        .iter()
        .filter(|r| {
            ["cluster-api-provider-mailgun", "capi-topology"].contains(&r.field_manager.as_str())
        })
        .collect();
    for other in writes.iter().filter(|r| !ours_or_topology.contains(r)) {
        println!(
            "  a write that changed nothing: {} {} {} by {}",
            other.verb, other.resource, other.name, other.field_manager
        );
    }
    let meta_after =
        serde_json::to_value(&mailgun_cluster_api.get(&mc.name_any()).await?.metadata)?;
    ensure!(
        before == after && ours_or_topology.is_empty(),
        "writes to our objects once settled: {writes:#?}\nbefore: {before:?}\nafter: {after:?}\n\
         the MailgunCluster's metadata before: {meta_before:#}\nafter: {meta_after:#}"
    );

    // A rollout: the Cluster changes a variable, the patched MailgunMachineTemplate differs, and
    // the topology controller rotates it (a new clone); the MachineDeployment replaces both
    // machines.
    let t = Instant::now();
    let cluster = clusters.get(CLUSTER).await?;
    let mut variables = cluster.data["spec"]["topology"]["variables"].clone();
    let changed = variables
        .as_array_mut()
        .context("the Cluster has no variables")?
        .iter_mut()
        .find(|v| v["name"] == "mailgunMachineRequest")
        .context("no mailgunMachineRequest variable")?;
    changed["value"] = json!(MACHINE_REQUEST_2);
    clusters
        .patch(
            CLUSTER,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"topology": {"variables": variables}}})),
        )
        .await?;
    let rolled = loop {
        provider.proc.check_alive()?;
        capi.check_alive()?;
        let now = world.settle(2, Duration::from_secs(240)).await?;
        if now.is_disjoint(&first) {
            break now;
        }
        ensure!(
            t.elapsed() < Duration::from_secs(240),
            "the machines were not replaced after 240 s"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    println!("rollout: 2 machines replaced in {:.1?}", t.elapsed());
    let ledger = world.ledger()?;
    for uid in &first {
        let entry = ledger.entries.get(&Object {
            kind: Kind::Machine,
            uid: uid.clone(),
        });
        ensure!(
            entry.is_some_and(|e| e.requests.len() == 1 && e.releases.len() == 1),
            "an old machine {uid}: {entry:?}"
        );
    }
    for uid in &rolled {
        let entry = ledger.entries.get(&Object {
            kind: Kind::Machine,
            uid: uid.clone(),
        });
        ensure!(
            entry.is_some_and(|e| e.requests.len() == 1 && e.releases.is_empty()),
            "a new machine {uid}: {entry:?}"
        );
        expect_request_mail(world, &ledger, Kind::Machine, uid, MACHINE_REQUEST_2)?;
    }

    // Scaling through the topology: up to 3, down to 1.
    for replicas in [3, 1] {
        let t = Instant::now();
        clusters
            .patch(
                CLUSTER,
                &PatchParams::default(),
                &Patch::Merge(
                    json!({"spec": {"topology": {"workers": topology::topology_workers(MD, replicas)}}}),
                ),
            )
            .await?;
        world
            .settle(replicas, Duration::from_secs(180))
            .await
            .with_context(|| format!("scaling to {replicas}"))?;
        println!("scaled to {replicas} in {:.1?}", t.elapsed());
    }

    // Deleting the Cluster: every object released once, nothing left.
    let t = Instant::now();
    clusters.delete(CLUSTER, &DeleteParams::default()).await?;
    let mailgun_machines = infra(&admin, "MailgunMachine");
    let mailgun_clusters = infra(&admin, "MailgunCluster");
    eventually(
        Duration::from_secs(180),
        "the Cluster and our objects gone",
        || async {
            provider.proc.check_alive()?;
            let gone = clusters.get_opt(CLUSTER).await?.is_none()
                && mailgun_clusters
                    .list(&ListParams::default())
                    .await?
                    .items
                    .is_empty()
                && mailgun_machines
                    .list(&ListParams::default())
                    .await?
                    .items
                    .is_empty();
            Ok(gone.then_some(()))
        },
    )
    .await?;
    println!("Cluster deleted in {:.1?}", t.elapsed());
    // The clones the topology controller made are the Cluster's, collected with it; the
    // ClusterClass's own templates (clusterctl's) stay.
    eventually(
        Duration::from_secs(60),
        "the cloned templates collected",
        || async {
            let left: BTreeSet<String> = machine_templates
                .list(&ListParams::default())
                .await?
                .items
                .iter()
                .map(ResourceExt::name_any)
                .chain(
                    infra(&admin, "MailgunClusterTemplate")
                        .list(&ListParams::default())
                        .await?
                        .items
                        .iter()
                        .map(ResourceExt::name_any),
                )
                .collect();
            let expected: BTreeSet<String> = ["mailgun-machines", "mailgun-cluster"]
                .map(str::to_owned)
                .into();
            Ok((left == expected).then_some(()))
        },
    )
    .await?;

    // The ledger: exactly one request and one release per object, nothing else.
    let ledger = world.ledger()?;
    let violations = ledger.check(&BTreeSet::new(), &BTreeSet::new(), &BTreeMap::new());
    ensure!(
        violations.is_empty(),
        "ledger violations:\n{}",
        violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
    let seen: BTreeSet<&Object> = world.seen.keys().collect();
    let mailed: BTreeSet<&Object> = ledger.entries.keys().collect();
    ensure!(
        seen == mailed,
        "objects seen {seen:?}, objects mailed {mailed:?}"
    );
    for (object, entry) in &ledger.entries {
        ensure!(
            entry.requests.len() == 1 && entry.releases.len() == 1,
            "{object} ({}): {entry:?}",
            world.seen.get(object).map_or("?", String::as_str)
        );
    }
    let machines = ledger
        .entries
        .keys()
        .filter(|o| o.kind == Kind::Machine)
        .count();
    ensure!(
        machines == 5,
        "5 machines (2, 2 rolled, 1 scaled up): {machines}"
    );
    println!(
        "ledger: {} objects (1 MailgunCluster, {machines} MailgunMachines), one request and one release each",
        ledger.entries.len()
    );

    // What the topology controller (field manager capi-topology) and everyone else sent our
    // kinds over the whole story.
    let all = world.audit()?;
    println!("writes to our kinds, by field manager or client, verb and resource:");
    for (key, n) in summary(&all) {
        println!("  {n:>4}  {key}");
    }
    // Not refusals: 404 (deleting what is gone), 409 (a stale write, retried), 415 (the
    // garbage collector's strategic merge patch, which custom resources do not take; it falls
    // back to a merge patch at once).
    let refused: Vec<_> = all
        .iter()
        .filter(|r| is_write(r) && r.code >= 400 && ![404, 409, 415].contains(&r.code))
        .collect();
    ensure!(
        refused.is_empty(),
        "writes to our kinds refused: {refused:#?}"
    );
    let log = provider.proc.log();
    ensure!(
        !log.contains(api_key(world)),
        "the API key is in the provider's log"
    );
    drop(capi);
    Ok(())
}

/// The workers' MachineHealthCheck, as the topology controller made it from the ClusterClass:
/// human-sized timeouts, and remediation by mail through the class's MailgunRemediationTemplate,
/// which clusterctl put into the Cluster's namespace beside the class.
async fn expect_remediation_by_mail(admin: &Client) -> Result<()> {
    let checks = api(admin, CAPI, "v1beta2", "MachineHealthCheck");
    let check = eventually(
        Duration::from_secs(30),
        "the topology's MachineHealthCheck of md-0",
        || async {
            Ok(checks
                .list(&ListParams::default())
                .await?
                .items
                .into_iter()
                .find(|c| {
                    let spec = &c.data["spec"];
                    spec["clusterName"] == CLUSTER
                        && spec["selector"]["matchLabels"]
                            ["topology.cluster.x-k8s.io/deployment-name"]
                            == MD
                }))
        },
    )
    .await?;
    let spec = &check.data["spec"];
    ensure!(
        spec["remediation"]["templateRef"]
            == json!({"apiVersion": format!("{INFRA}/v1beta1"),
                "kind": "MailgunRemediationTemplate", "name": "mailgun-repair"})
            && spec["checks"]["nodeStartupTimeoutSeconds"] == 259_200,
        "the workers' health check does not remediate by mail with human-sized timeouts: {spec:#}"
    );
    let template = infra(admin, "MailgunRemediationTemplate")
        .get("mailgun-repair")
        .await
        .context("the ClusterClass's remediation template in the Cluster's namespace")?;
    ensure!(
        template.data["spec"]["template"]["spec"]["strategy"]["unfulfilled"] == "Wait",
        "a machine nobody built would be handed back: {}",
        template.data["spec"]
    );
    println!(
        "MachineHealthCheck {}: remediation by MailgunRemediationTemplate mailgun-repair",
        check.name_any()
    );
    Ok(())
}

fn api_key(world: &World) -> &str {
    world.mailgun.api_key()
}

/// Checks the one request mail of `uid`: the Cluster's priority in its subject, `request` in its
/// body, sent for the Cluster's requester.
fn expect_request_mail(
    world: &World,
    ledger: &Ledger,
    kind: Kind,
    uid: &str,
    request: &str,
) -> Result<()> {
    let entry = ledger
        .entries
        .get(&Object {
            kind,
            uid: uid.to_owned(),
        })
        .with_context(|| format!("no mail for {kind:?} {uid}"))?;
    ensure!(entry.requests.len() == 1, "{kind:?} {uid}: {entry:?}");
    let messages = world.mailgun.messages()?;
    let mail = messages
        .get(entry.requests[0] - 1)
        .context("the ledger's mail is not in the server's store")?;
    let text = mail.text.as_deref().unwrap_or_default();
    let for_requester = mail.from.contains(REQUESTER)
        || mail
            .headers
            .get("Reply-To")
            .is_some_and(|h| h.contains(REQUESTER));
    ensure!(
        mail.subject.contains(&format!("[{PRIORITY}]")) && text.contains(request) && for_requester,
        "{kind:?} {uid}: the mail does not carry the Cluster's variables (priority {PRIORITY}, \
         request {request:?}, requester {REQUESTER}): from {:?}, subject {:?}, body:\n{text}",
        mail.from,
        mail.subject
    );
    Ok(())
}
