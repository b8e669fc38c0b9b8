//! MachineHealthChecks and humans (issue 33, item 4; docs/machine-health-checks.md), measured with
//! the real Cluster API core manager: its MachineHealthCheck controller, its MachineSet
//! remediation and its cluster cache.
//!
//! A Cluster with an initialized control plane (the test control plane provider of
//! `capm_e2e::topology`) and a MachineDeployment of two workers, each mailed to a human who does
//! not build it; a MachineHealthCheck on the workers with a short `nodeStartupTimeoutSeconds`
//! (30 s, the shortest Cluster API's webhook accepts; the default is 10 minutes). The human
//! fulfils the cluster's request only, as a human would who builds the control plane first.
//!
//! - **The storm**: each worker without a Node is marked unhealthy when its timeout runs out,
//!   its MachineSet deletes it (the provider mails its release) and creates a new one (a new
//!   request mail). The test counts the mails per machine slot and per timeout.
//! - **Then** a 72-hour `nodeStartupTimeoutSeconds` ends it: the workers settle (no remediation
//!   under way for 10 s). That nothing is replaced later is Cluster API's timer, not the
//!   provider's, so it is not watched here; the fix docs/machine-health-checks.md gives is the remediation template,
//!   whose storm setup `remediation.rs` runs for three timeouts with no Machine replaced.
//!
//! The provider keeps its own promise all along: each object mailed one request, and one release
//! once it is gone (the mail ledger). The storm is the health check's setting, not a fault.
//!
//! The cluster cache the health check needs once the control plane is initialized (it reads the
//! workload cluster's Nodes) is given the management API server as the "workload" cluster, through
//! the `<cluster>-kubeconfig` Secret a control plane provider would write.

use std::{
    collections::BTreeSet,
    fs,
    path::Path,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use capm_e2e::{
    create_namespace, create_object, dynamic_api, fulfil_command, install_chart_and_provider,
    ledger::{Kind, Ledger, Object, Which, parse_message_id},
    mailgun_ledger, mailgun_mails, mailgun_values, start_capi_manager,
    topology::{self, TestProviders},
};
use capm_mail_servers::MailgunServer;
use capm_test_support::{ControlPlane, Options};
use k8s_openapi::api::core::v1::Event;
use kube::{
    Api, Client, ResourceExt,
    api::{DynamicObject, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};

const USER_NS: &str = "team-health";
const DOMAIN: &str = "mg.health.example.com";
const RECIPIENT: &str = "infrastructure-team@example.com";
const INFRA: &str = "infrastructure.cluster.x-k8s.io";
const CAPI: &str = "cluster.x-k8s.io";
const CLUSTER: &str = "storm";
const WORKERS: &str = "storm-workers";
const CHECK: &str = "storm-node-startup";
const POOL_LABEL: &str = "e2e.capm.example.com/pool";
const REPLICAS: usize = 2;
/// The shortest node startup timeout Cluster API's webhook accepts.
const STORM_TIMEOUT_SECONDS: u64 = 30;
/// The setting docs/machine-health-checks.md gives: 72 hours.
const SAFE_TIMEOUT_SECONDS: u64 = 259_200;
/// Remediations per machine slot the storm phase waits for.
const STORM_CYCLES: usize = 2;

struct World {
    cp: ControlPlane,
    admin: Client,
    mailgun: MailgunServer,
    cluster_fulfilled: bool,
}

fn api(client: &Client, group: &str, version: &str, kind: &str) -> Api<DynamicObject> {
    dynamic_api(client, USER_NS, group, version, kind)
}

fn condition_true(object: &DynamicObject, kind: &str) -> bool {
    object.data["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == kind && c["status"] == "True")
}

impl World {
    fn ledger(&self) -> Result<Ledger> {
        mailgun_ledger(&self.mailgun, DOMAIN)
    }

    /// The human: fulfils the cluster's request once its mail is there, and no machine's.
    fn fulfil_cluster(&mut self) -> Result<()> {
        if self.cluster_fulfilled {
            return Ok(());
        }
        for (mail, body) in mailgun_mails(&self.mailgun)? {
            if let Some((object, Which::Request)) = parse_message_id(&mail.message_id, DOMAIN)
                && object.kind == Kind::Cluster
            {
                let command = fulfil_command(&body, &[("<host>", "api.storm.example.com")])?;
                ensure!(command[0] == "kubectl", "{command:?}");
                let mut kubectl = self.cp.kubectl()?;
                kubectl.args(&command[1..]);
                capm_e2e::run(&mut kubectl, &command.join(" "))?;
                self.cluster_fulfilled = true;
            }
        }
        Ok(())
    }

    /// Machine request and release mails so far.
    fn machine_mails(&self) -> Result<(usize, usize)> {
        let ledger = self.ledger()?;
        let machines = ledger
            .entries
            .iter()
            .filter(|(o, _)| o.kind == Kind::Machine);
        Ok(machines.fold((0, 0), |(req, rel), (_, e)| {
            (req + e.requests.len(), rel + e.releases.len())
        }))
    }

    /// The health check's `MachineMarkedUnhealthy` Events so far (their counts summed).
    async fn marked_unhealthy(&self) -> Result<i32> {
        let events: Api<Event> = Api::namespaced(self.admin.clone(), USER_NS);
        Ok(events
            .list(&ListParams::default())
            .await?
            .items
            .iter()
            .filter(|e| e.reason.as_deref() == Some("MachineMarkedUnhealthy"))
            .map(|e| e.count.unwrap_or(1).max(1))
            .sum())
    }

    /// UIDs of the Machines, with whether any is being deleted or marked for remediation, and of
    /// the MailgunMachines, with whether any is being deleted.
    async fn machines(&self) -> Result<Settled> {
        let machines = api(&self.admin, CAPI, "v1beta2", "Machine")
            .list(&ListParams::default())
            .await?
            .items;
        let infra = api(&self.admin, INFRA, "v1beta1", "MailgunMachine")
            .list(&ListParams::default())
            .await?
            .items;
        let busy = machines.iter().any(|m| {
            m.metadata.deletion_timestamp.is_some()
                || m.data["status"]["conditions"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["type"] == "OwnerRemediated")
        }) || infra
            .iter()
            .any(|m| m.metadata.deletion_timestamp.is_some());
        Ok(Settled {
            machines: machines.iter().filter_map(ResourceExt::uid).collect(),
            infra: infra.iter().filter_map(ResourceExt::uid).collect(),
            busy,
        })
    }
}

#[derive(Debug, PartialEq, Eq)]
struct Settled {
    machines: BTreeSet<String>,
    infra: BTreeSet<String>,
    busy: bool,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_startup_check_remediates_unbuilt_machines_until_a_long_timeout_ends_it()
-> Result<()> {
    let work = tempfile::tempdir()?;
    let dir = work.path();
    let cp = ControlPlane::start(Options::default()).await?;
    cp.install_capi_crds().await?;
    let admin = cp.client().await?;
    topology::install_crds(&admin).await?;
    let mailgun = MailgunServer::start("key-health-e2e-not-logged", DOMAIN)?;
    let mut world = World {
        cp,
        admin,
        mailgun,
        cluster_fulfilled: false,
    };
    let result = story(&mut world, dir).await;
    if let Err(e) = &result {
        capm_e2e::report_failure(e, dir, &["capi-manager.log", "provider.log"], 40);
    }
    world.cp.stop();
    result
}

async fn story(world: &mut World, dir: &Path) -> Result<()> {
    let admin = world.admin.clone();
    let kubeconfig = world.cp.kubeconfig().to_owned();
    let post = PostParams::default();

    // The chart and the provider as its ServiceAccount; Cluster API; the test control plane and
    // bootstrap providers.
    let provider = install_chart_and_provider(
        &world.cp,
        world.mailgun.api_key(),
        &mailgun_values(RECIPIENT, DOMAIN, &world.mailgun.base_url()),
        dir,
    )
    .await?;
    create_namespace(&admin, USER_NS, false).await?;
    let capi = start_capi_manager(&kubeconfig, dir)?;
    let _providers = TestProviders::start(&admin, USER_NS);

    // The "workload" cluster's kubeconfig, as a control plane provider writes it: the management
    // API server plays the workload cluster (it has no Node for any of the Machines).
    let workload = fs::read_to_string(&kubeconfig)?;
    let mut secret: k8s_openapi::api::core::v1::Secret = serde_json::from_value(json!({
        "metadata": {"name": format!("{CLUSTER}-kubeconfig"), "labels": {"cluster.x-k8s.io/cluster-name": CLUSTER}},
        "type": "cluster.x-k8s.io/secret",
    }))?;
    secret.string_data = Some([("value".to_owned(), workload)].into());
    Api::<k8s_openapi::api::core::v1::Secret>::namespaced(admin.clone(), USER_NS)
        .create(&post, &secret)
        .await?;

    // The Cluster: its MailgunCluster and a test control plane.
    topology::create_templates(&admin, USER_NS, WORKERS).await?;
    let create = |group: &str, version: &str, kind: &str, name: &str, spec: Value| {
        create_object(&admin, USER_NS, group, version, kind, name, spec)
    };
    topology::create_cluster(
        &admin,
        USER_NS,
        CLUSTER,
        "One cluster please",
        "cluster-admin@example.com",
    )
    .await?;
    let clusters = api(&admin, CAPI, "v1beta2", "Cluster");
    let t = Instant::now();
    loop {
        world.fulfil_cluster()?;
        let cluster = clusters.get(CLUSTER).await?;
        if condition_true(&cluster, "InfrastructureReady")
            && condition_true(&cluster, "ControlPlaneInitialized")
        {
            break;
        }
        if t.elapsed() > Duration::from_secs(90) {
            bail!(
                "the Cluster not ready with an initialized control plane after 90 s: {}",
                cluster.data["status"]
            );
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    println!(
        "Cluster fulfilled, control plane initialized in {:.1?}",
        t.elapsed()
    );

    // Two workers and the health check on them, with a short node startup timeout.
    create(
        INFRA,
        "v1beta1",
        "MailgunMachineTemplate",
        WORKERS,
        json!({"template": {"spec": {"priority": "Urgent", "request": "A worker please", "requester": "cluster-admin@example.com"}}}),
    )
    .await?;
    create(
        CAPI,
        "v1beta2",
        "MachineDeployment",
        WORKERS,
        topology::machine_deployment(CLUSTER, POOL_LABEL, WORKERS, REPLICAS),
    )
    .await?;
    create(
        CAPI,
        "v1beta2",
        "MachineHealthCheck",
        CHECK,
        json!({
            "clusterName": CLUSTER,
            "selector": {"matchLabels": {POOL_LABEL: WORKERS}},
            "checks": {"nodeStartupTimeoutSeconds": STORM_TIMEOUT_SECONDS},
        }),
    )
    .await?;

    // The storm: wait for STORM_CYCLES remediations per slot, counting from the first machine
    // request mail.
    let t = Instant::now();
    let first_request = loop {
        if world.machine_mails()?.0 > 0 {
            break Instant::now();
        }
        ensure!(
            t.elapsed() < Duration::from_secs(90),
            "no machine request mail after 90 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    println!(
        "first machine request mail {:.1?} after the MachineDeployment",
        t.elapsed()
    );
    let wanted = STORM_CYCLES * REPLICAS;
    let budget = Duration::from_secs(STORM_TIMEOUT_SECONDS * (STORM_CYCLES as u64 + 2) + 60);
    let (requests, releases) = loop {
        provider.proc.check_alive()?;
        capi.check_alive()?;
        let (requests, releases) = world.machine_mails()?;
        if releases >= wanted {
            break (requests, releases);
        }
        if first_request.elapsed() > budget {
            bail!(
                "{releases} machine release mails (of {wanted} awaited) {:.0?} after the first \
                 request: the health check did not remediate as documented",
                first_request.elapsed()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let storm = first_request.elapsed();
    let marked = world.marked_unhealthy().await?;
    ensure!(
        usize::try_from(marked)? >= releases,
        "{releases} release mails but only {marked} MachineMarkedUnhealthy Events: something \
         other than the health check replaced the Machines"
    );
    // Each remediation is one release and one new request mail.
    #[allow(clippy::cast_precision_loss)]
    let cycle = storm.as_secs_f64() / (releases as f64 / REPLICAS as f64);
    println!(
        "storm (nodeStartupTimeoutSeconds {STORM_TIMEOUT_SECONDS}): {releases} remediations of \
         {REPLICAS} unbuilt workers ({marked} MachineMarkedUnhealthy Events) in {storm:.1?} after \
         the first request, {requests} request and {releases} release mails so far: each worker \
         released and requested anew every {cycle:.1} s, 2 mails per machine per timeout \
         (the timeout plus {:.1} s)",
        cycle - STORM_TIMEOUT_SECONDS as f64
    );

    // A long startup timeout ends the storm (the remediation template is the fix: remediation.rs);
    // the workers settle, so that the ledger can be judged on a live set that holds still.
    api(&admin, CAPI, "v1beta2", "MachineHealthCheck")
        .patch(
            CHECK,
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"checks": {"nodeStartupTimeoutSeconds": SAFE_TIMEOUT_SECONDS}}}),
            ),
        )
        .await?;
    // Remediations already under way finish; then the workers are steady for 10 s.
    let t = Instant::now();
    let mut steady_since: Option<(Instant, Settled, (usize, usize))> = None;
    let (settled, mails) = loop {
        let now = world.machines().await?;
        let mails = world.machine_mails()?;
        let ok = !now.busy && now.machines.len() == REPLICAS && now.infra.len() == REPLICAS;
        match &steady_since {
            Some((since, before, m)) if ok && *before == now && *m == mails => {
                if since.elapsed() > Duration::from_secs(10) {
                    break (now, mails);
                }
            }
            _ => steady_since = ok.then(|| (Instant::now(), now, mails)),
        }
        ensure!(
            t.elapsed() < Duration::from_secs(120),
            "the workers did not settle within 120 s of the 72-hour timeout"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    let ledger = world.ledger()?;
    for uid in &settled.infra {
        ensure!(
            ledger.requested(&Object {
                kind: Kind::Machine,
                uid: uid.clone()
            }),
            "the worker's MailgunMachine {uid} was never mailed"
        );
    }
    println!(
        "a 72-hour startup timeout (nodeStartupTimeoutSeconds {SAFE_TIMEOUT_SECONDS}): the workers \
         settled in {:.1?} (no remediation under way for 10 s), {} request and {} release mails",
        t.elapsed(),
        mails.0,
        mails.1
    );
    provider.proc.check_alive()?;
    capi.check_alive()?;

    // The provider's own promise held through the storm: one request per object, one release per
    // object gone, none for a live one.
    let mut live: BTreeSet<Object> = settled
        .infra
        .iter()
        .map(|uid| Object {
            kind: Kind::Machine,
            uid: uid.clone(),
        })
        .collect();
    for mc in api(&admin, INFRA, "v1beta1", "MailgunCluster")
        .list(&ListParams::default())
        .await?
        .items
    {
        live.insert(Object {
            kind: Kind::Cluster,
            uid: mc.uid().context("no UID")?,
        });
    }
    let violations = ledger.check(&live, &BTreeSet::new(), &Default::default());
    ensure!(
        violations.is_empty(),
        "the mail ledger: {}",
        violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ")
    );
    Ok(())
}
