//! `clusterctl move` with mail identities, for real (issue 33): two management clusters (two
//! local control planes), each with the chart installed (CRDs, admission policies, RBAC), the
//! provider run as the chart's ServiceAccount and the real Cluster API core manager; the real
//! `clusterctl move` between them. A tenant's `MailgunClusterIdentity` mails through its own
//! Mailgun contract server; each management cluster's own backend (the provider's default
//! identity) is a contract server of its own that must receive nothing.
//!
//! The story: in the source, a Cluster and a control-plane Machine of the tenant mail their
//! requests once through the identity and are fulfilled by the human; `clusterctl move -n
//! team-a` carries the identity and its Secret (owned by the identity) and the objects to the
//! target; the target sends no second request for them and the source no release while
//! clusterctl deletes its copies; a new Machine in the moved Cluster and a new Cluster in the
//! target mail once through the moved identity; deleting the moved Cluster in the target sends
//! each of its objects' releases once, through the identity.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};
use capm_api::names::MAIL_ANNOTATION;
use capm_e2e::{
    CHART_NAMESPACE as NS, ChartProvider, Proc, clusterctl::yaml_docs, create_namespace,
    create_secret, dynamic_api, dynamic_object, eventually, fulfil_command,
    install_chart_and_provider, mailgun_values, start_capi_manager,
};
use capm_mail_servers::{MailgunServer, StoredMessage};
use capm_test_support::{ControlPlane, Options, install_crds};
use k8s_openapi::api::core::v1::Secret;
use kube::{
    Api, Client, ResourceExt,
    api::{ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams},
};
use serde_json::{Value, json};

/// The tenant's namespace: what `clusterctl move -n` moves.
const TENANT_NS: &str = "team-a";
const IDENTITY: &str = "team-a-mail";
/// The identity's Secret, in the provider's namespace.
const IDENTITY_SECRET: &str = "team-a-mailgun";
const TENANT_DOMAIN: &str = "mg.team-a.example.com";
const TENANT_RECIPIENT: &str = "oncall@team-a.example.com";
const INFRA: &str = "infrastructure.cluster.x-k8s.io";
const CAPI: &str = "cluster.x-k8s.io";
const WAIT: Duration = Duration::from_secs(120);

/// One management cluster: a control plane with the Cluster API CRDs, the chart, the provider
/// as the chart's ServiceAccount, the Cluster API core manager, and its own default backend.
struct Management {
    name: &'static str,
    cp: ControlPlane,
    admin: Client,
    provider: ChartProvider,
    capi: Proc,
    /// The backend of the provider's own configuration (the default identity).
    default_backend: MailgunServer,
    dir: PathBuf,
}

impl Management {
    async fn start(name: &'static str, base: &Path) -> Result<Self> {
        let dir = base.join(name);
        fs::create_dir_all(&dir)?;
        let cp = ControlPlane::start(Options::default()).await?;
        cp.install_capi_crds().await?;
        let admin = cp.client().await?;
        let domain = format!("mg.{name}.example.com");
        let default_backend = MailgunServer::start(&format!("key-{name}-default"), &domain)?;

        // The chart, as a user installs it.
        let provider = install_chart_and_provider(
            &cp,
            default_backend.api_key(),
            &mailgun_values(
                &format!("ops@{name}.example.com"),
                &domain,
                &default_backend.base_url(),
            ),
            &dir,
        )
        .await?;
        cp.adopt(provider.proc.pid())?;
        let capi = start_capi_manager(cp.kubeconfig(), &dir)?;
        cp.adopt(capi.pid())?;
        let management = Self {
            name,
            cp,
            admin,
            provider,
            capi,
            default_backend,
            dir,
        };
        management.as_clusterctl_init_leaves_it().await?;
        Ok(management)
    }

    /// What `clusterctl init` would have left (this test installs with Helm and runs the core
    /// manager as a process): the labels clusterctl puts on every provider CRD (`clusterctl
    /// move` discovers the kinds it moves by `clusterctl.cluster.x-k8s.io`; our chart's CRDs,
    /// like Cluster API's own CRD files, do not carry it), clusterctl's inventory CRD (from the
    /// Cluster API module `make tools` built clusterctl from) and one `Provider` per provider.
    async fn as_clusterctl_init_leaves_it(&self) -> Result<()> {
        let crds = self.cp.kubectl_output(&["get", "crd", "-o", "name"])?;
        for crd in crds.lines().filter_map(|l| l.rsplit('/').next()) {
            let provider = if crd.ends_with(&format!(".{INFRA}")) {
                "infrastructure-mailgun"
            } else if crd.ends_with(".x-k8s.io") && !crd.ends_with(".clusterctl.cluster.x-k8s.io") {
                "cluster-api"
            } else {
                continue;
            };
            self.cp.kubectl_output(&[
                "label",
                "--overwrite",
                "crd",
                crd,
                "clusterctl.cluster.x-k8s.io=",
                &format!("cluster.x-k8s.io/provider={provider}"),
            ])?;
        }
        let (module_dir, capi_version) = capm_e2e::clusterctl::cluster_api_module()?;
        let inventory_crd = module_dir.join("cmd/clusterctl/config/manifest/clusterctl-api.yaml");
        let crds = yaml_docs(&fs::read_to_string(&inventory_crd)?)?
            .into_iter()
            .map(serde_json::from_value)
            .collect::<Result<Vec<_>, _>>()?;
        install_crds(&self.admin, &crds).await?;
        let provider = |name: &str, namespace: &str, provider_name: &str, kind: &str, v: &str| {
            json!({
                "apiVersion": "clusterctl.cluster.x-k8s.io/v1alpha3", "kind": "Provider",
                "metadata": {"name": name, "namespace": namespace, "labels": {
                    "clusterctl.cluster.x-k8s.io": "",
                    "clusterctl.cluster.x-k8s.io/core": "inventory",
                    "cluster.x-k8s.io/provider": name,
                }},
                "providerName": provider_name, "type": kind, "version": v,
            })
        };
        let list = json!({"apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "capi-system"}},
            provider("cluster-api", "capi-system", "cluster-api", "CoreProvider", &capi_version),
            provider("infrastructure-mailgun", NS, "mailgun", "InfrastructureProvider",
                &format!("v{}", env!("CARGO_PKG_VERSION"))),
        ]});
        let mut kubectl = self.cp.kubectl()?;
        kubectl.args(["apply", "--server-side", "-f", "-"]);
        capm_e2e::run_with_input(&mut kubectl, &list.to_string(), "the clusterctl inventory")?;
        Ok(())
    }

    fn check_alive(&self) -> Result<()> {
        self.provider
            .proc
            .check_alive()
            .with_context(|| format!("the {} provider", self.name))?;
        self.capi
            .check_alive()
            .with_context(|| format!("the {} Cluster API manager", self.name))
    }

    fn api(&self, group: &str, version: &str, kind: &str) -> Api<DynamicObject> {
        dynamic_api(&self.admin, TENANT_NS, group, version, kind)
    }

    fn clusters(&self) -> Api<DynamicObject> {
        self.api(CAPI, "v1beta2", "Cluster")
    }

    fn machines(&self) -> Api<DynamicObject> {
        self.api(CAPI, "v1beta2", "Machine")
    }

    fn infra(&self, kind: &str) -> Api<DynamicObject> {
        self.api(INFRA, "v1beta1", kind)
    }

    fn identities(&self) -> Api<DynamicObject> {
        Api::all_with(
            self.admin.clone(),
            &ApiResource::from_gvk(&GroupVersionKind::gvk(
                INFRA,
                "v1beta1",
                "MailgunClusterIdentity",
            )),
        )
    }

    /// A Cluster and its MailgunCluster naming the tenant's identity.
    async fn create_cluster(&self, name: &str) -> Result<()> {
        let post = Default::default();
        self.infra("MailgunCluster")
            .create(
                &post,
                &dynamic_object(
                    &format!("{INFRA}/v1beta1"),
                    "MailgunCluster",
                    TENANT_NS,
                    name,
                    json!({"priority": "Urgent", "request": "One cluster please",
                        "requester": "dev@team-a.example.com",
                        "identityRef": {"kind": "MailgunClusterIdentity", "name": IDENTITY}}),
                )?,
            )
            .await?;
        self.clusters()
            .create(
                &post,
                &dynamic_object(
                    "cluster.x-k8s.io/v1beta2",
                    "Cluster",
                    TENANT_NS,
                    name,
                    json!({"infrastructureRef": {"apiGroup": INFRA, "kind": "MailgunCluster", "name": name}}),
                )?,
            )
            .await?;
        Ok(())
    }

    /// A Machine of Cluster `cluster` (a control-plane one when `control_plane`) and its
    /// MailgunMachine; the Machine carries the labels Cluster API's defaulting webhook would
    /// add (the webhook is not installed here).
    async fn create_machine(&self, cluster: &str, name: &str, control_plane: bool) -> Result<()> {
        let post = Default::default();
        self.infra("MailgunMachine")
            .create(
                &post,
                &dynamic_object(
                    &format!("{INFRA}/v1beta1"),
                    "MailgunMachine",
                    TENANT_NS,
                    name,
                    json!({"priority": "Urgent", "request": "A node please",
                        "requester": "dev@team-a.example.com"}),
                )?,
            )
            .await?;
        let mut machine = dynamic_object(
            "cluster.x-k8s.io/v1beta2",
            "Machine",
            TENANT_NS,
            name,
            json!({
                "clusterName": cluster,
                "bootstrap": {"dataSecretName": format!("{name}-bootstrap")},
                "infrastructureRef": {"apiGroup": INFRA, "kind": "MailgunMachine", "name": name},
            }),
        )?;
        let mut labels = BTreeMap::from([(
            "cluster.x-k8s.io/cluster-name".to_owned(),
            cluster.to_owned(),
        )]);
        if control_plane {
            labels.insert("cluster.x-k8s.io/control-plane".into(), String::new());
        }
        machine.metadata.labels = Some(labels);
        self.machines().create(&post, &machine).await?;
        Ok(())
    }

    /// Runs the `kubectl patch` a request mail gives its recipient, against this cluster.
    fn fulfil(&self, mail: &StoredMessage, fill: &[(&str, &str)]) -> Result<()> {
        let command = fulfil_command(mail.text.as_deref().unwrap_or_default(), fill)?;
        ensure!(command[0] == "kubectl", "{command:?}");
        let mut kubectl = self.cp.kubectl()?;
        kubectl.args(&command[1..]);
        capm_e2e::run(&mut kubectl, &command.join(" ")).map(drop)
    }

    /// The request record (`mailgun.infrastructure.cluster.x-k8s.io/mail`) of one of our objects.
    async fn record(&self, kind: &str, name: &str) -> Result<Value> {
        let obj = self.infra(kind).get(name).await?;
        let record = obj
            .annotations()
            .get(MAIL_ANNOTATION)
            .with_context(|| format!("{kind} {name} in {} has no mail record", self.name))?;
        Ok(serde_json::from_str(record)?)
    }

    fn logs(&self) -> String {
        ["provider.log", "capi-manager.log"]
            .iter()
            .map(|name| {
                format!(
                    "--- last lines of the {} {name}:\n{}",
                    self.name,
                    capm_test_support::process::tail(&self.dir.join(name), 40)
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// A condition of an object's `status.conditions`, as (status, reason).
fn condition(obj: &DynamicObject, type_: &str) -> Option<(String, String)> {
    obj.data["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == type_)
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_owned(),
                c["reason"].as_str().unwrap_or_default().to_owned(),
            )
        })
}

/// The one mail whose subject contains `subject`, once it is there (more than one is an error).
async fn one_mail(
    server: &MailgunServer,
    subject: &str,
    checks: &[&Management],
) -> Result<StoredMessage> {
    eventually(WAIT, &format!("the mail {subject:?}"), || async {
        for m in checks {
            m.check_alive()?;
        }
        let mut found: Vec<_> = server
            .messages()?
            .into_iter()
            .filter(|m| m.subject.contains(subject))
            .collect();
        ensure!(found.len() <= 1, "{} mails {subject:?}", found.len());
        Ok(found.pop())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clusterctl_move_carries_identities_and_their_mail_records() -> Result<()> {
    let work = tempfile::tempdir()?;
    let started = Instant::now();
    let tenant = MailgunServer::start("key-team-a-not-logged", TENANT_DOMAIN)?;
    let source = Management::start("source", work.path()).await?;
    let target = Management::start("target", work.path()).await?;
    println!(
        "two management clusters with the chart, the provider and Cluster API: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let result = story(&source, &target, &tenant).await;

    if let Err(e) = &result {
        eprintln!("failed: {e:#}\n{}\n{}", source.logs(), target.logs());
    }
    result
}

async fn story(source: &Management, target: &Management, tenant: &MailgunServer) -> Result<()> {
    let both = [source, target];
    let started = Instant::now();

    // The tenant's identity and its Secret in the provider's namespace. The Secret names the
    // identity as its owner, as docs/multi-tenancy.md tells users: `clusterctl move` then carries it with
    // the identity (it moves what a move-hierarchy object owns, and looks for Secrets in the
    // infrastructure providers' namespaces).
    create_namespace(&source.admin, TENANT_NS, false).await?;
    create_secret(
        &source.admin,
        NS,
        IDENTITY_SECRET,
        &[("api-key", tenant.api_key())],
    )
    .await?;
    capm_e2e::claim_secret(&source.admin, NS, IDENTITY_SECRET, IDENTITY).await?;
    let identity: DynamicObject = serde_json::from_value(json!({
        "apiVersion": format!("{INFRA}/v1beta1"), "kind": "MailgunClusterIdentity",
        "metadata": {"name": IDENTITY},
        "spec": {
            "mailgun": {"domain": TENANT_DOMAIN, "baseURL": tenant.base_url(),
                "apiKeySecretRef": {"name": IDENTITY_SECRET, "key": "api-key"}},
            "from": format!("capm@{TENANT_DOMAIN}"),
            "recipients": [TENANT_RECIPIENT],
            "allowedNamespaces": {"list": [TENANT_NS]},
        },
    }))?;
    let identity = source
        .identities()
        .create(&Default::default(), &identity)
        .await?;
    Api::<Secret>::namespaced(source.admin.clone(), NS)
        .patch(
            IDENTITY_SECRET,
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"ownerReferences": [{
                "apiVersion": format!("{INFRA}/v1beta1"), "kind": "MailgunClusterIdentity",
                "name": IDENTITY, "uid": identity.uid(),
            }]}})),
        )
        .await?;

    // 1. Before the move: a Cluster and a control-plane Machine of the tenant, each mailed once
    //    through the identity and fulfilled by the human.
    source.create_cluster("alpha").await?;
    let request = one_mail(tenant, "New Cluster alpha requested", &both).await?;
    ensure!(request.to == [TENANT_RECIPIENT], "{:?}", request.to);
    source.fulfil(&request, &[("<host>", "api.alpha.team-a.example.com")])?;
    eventually(
        WAIT,
        "the source Cluster's infrastructure provisioned",
        || async {
            source.check_alive()?;
            let c = source.clusters().get("alpha").await?;
            Ok(
                (c.data["status"]["initialization"]["infrastructureProvisioned"] == true)
                    .then_some(()),
            )
        },
    )
    .await?;
    source.create_machine("alpha", "alpha-cp-0", true).await?;
    let machine_request = one_mail(tenant, "New Machine alpha-cp-0", &both).await?;
    source.fulfil(
        &machine_request,
        &[
            ("<scheme>://<id>", "mailgun://alpha-cp-0"),
            ("<ip>", "192.0.2.10"),
        ],
    )?;
    eventually(
        WAIT,
        "the source Machine's infrastructure provisioned",
        || async {
            source.check_alive()?;
            let m = source.machines().get("alpha-cp-0").await?;
            Ok(
                (m.data["status"]["initialization"]["infrastructureProvisioned"] == true)
                    .then_some(()),
            )
        },
    )
    .await?;
    // The Node: Cluster API's machine controller sets `status.nodeRef` from the workload
    // cluster's Node with the Machine's providerID. A mailed cluster's API server is a
    // human's, not reachable from here, so the test sets what that Node would give; Cluster
    // API itself then marks the control plane initialized (a control-plane Machine with a
    // node), which `clusterctl move` checks with the nodeRef of every Machine.
    source.cp.kubectl_output(&[
        "-n",
        TENANT_NS,
        "patch",
        "machine",
        "alpha-cp-0",
        "--subresource=status",
        "--type=merge",
        "-p",
        r#"{"status":{"nodeRef":{"name":"alpha-cp-0"}}}"#,
    ])?;
    eventually(
        WAIT,
        "Cluster API: the control plane initialized",
        || async {
            source.check_alive()?;
            let c = source.clusters().get("alpha").await?;
            Ok(
                (condition(&c, "ControlPlaneInitialized").is_some_and(|(s, _)| s == "True"))
                    .then_some(()),
            )
        },
    )
    .await?;
    let source_uids = BTreeMap::from([
        (
            "MailgunCluster",
            source.infra("MailgunCluster").get("alpha").await?.uid(),
        ),
        (
            "MailgunMachine",
            source
                .infra("MailgunMachine")
                .get("alpha-cp-0")
                .await?
                .uid(),
        ),
    ]);
    let cluster_record = source.record("MailgunCluster", "alpha").await?;
    let machine_record = source.record("MailgunMachine", "alpha-cp-0").await?;
    ensure!(
        cluster_record["messageId"] == request.id.as_str()
            && cluster_record["identity"] == IDENTITY
            && request.id.starts_with(&format!(
                "<mailguncluster.{}@",
                source_uids["MailgunCluster"].as_deref().unwrap_or_default()
            )),
        "the request's Message-Id {} and its record {cluster_record}",
        request.id
    );
    ensure!(
        machine_record["messageId"] == machine_request.id.as_str()
            && machine_record["identity"] == IDENTITY,
        "the machine request {} and its record {machine_record}",
        machine_request.id
    );
    ensure!(tenant.messages()?.len() == 2, "{:?}", subjects(tenant)?);
    println!(
        "before the move: 2 requests through the identity, fulfilled, control plane initialized ({:.1} s)",
        started.elapsed().as_secs_f64()
    );

    // 2. The move, with the real clusterctl.
    let moved_at = Instant::now();
    let home = source.dir.join("clusterctl-home");
    fs::create_dir_all(&home)?;
    let out = Command::new(capm_test_support::process::binary("clusterctl")?)
        .args(["move", "--kubeconfig"])
        .arg(source.cp.kubeconfig())
        .arg("--to-kubeconfig")
        .arg(target.cp.kubeconfig())
        .args(["-n", TENANT_NS, "-v", "1"])
        .env("CLUSTERCTL_DISABLE_VERSIONCHECK", "true")
        .env("HOME", &home)
        .env("XDG_CONFIG_HOME", &home)
        .output()
        .context("running clusterctl move")?;
    // clusterctl logs to stderr.
    let log = String::from_utf8_lossy(&out.stderr);
    println!(
        "clusterctl move ({:.1} s, {}):\n{log}",
        moved_at.elapsed().as_secs_f64(),
        out.status
    );
    ensure!(out.status.success(), "clusterctl move failed");

    // The identity and its Secret (owned by the moved identity) are in the target; clusterctl
    // leaves global objects in the source.
    let moved_identity = target.identities().get(IDENTITY).await?;
    ensure!(
        moved_identity.data["spec"]["mailgun"]["domain"] == TENANT_DOMAIN,
        "{:?}",
        moved_identity.data
    );
    let moved_secret = Api::<Secret>::namespaced(target.admin.clone(), NS)
        .get(IDENTITY_SECRET)
        .await
        .context("the identity's Secret in the target")?;
    ensure!(
        moved_secret
            .owner_references()
            .iter()
            .any(|o| o.kind == "MailgunClusterIdentity"
                && Some(&o.uid) == moved_identity.uid().as_ref()),
        "the moved Secret is owned by the moved identity: {:?}",
        moved_secret.owner_references()
    );
    ensure!(source.identities().get_opt(IDENTITY).await?.is_some());
    // The source's copies are gone, the target's carry the mail records.
    for (kind, name) in [
        ("MailgunCluster", "alpha"),
        ("MailgunMachine", "alpha-cp-0"),
    ] {
        ensure!(
            source.infra(kind).get_opt(name).await?.is_none(),
            "{kind} {name} still in the source"
        );
    }
    ensure!(source.clusters().get_opt("alpha").await?.is_none());
    ensure!(
        target.record("MailgunCluster", "alpha").await?["messageId"] == cluster_record["messageId"]
    );
    ensure!(
        target.record("MailgunMachine", "alpha-cp-0").await?["messageId"]
            == machine_record["messageId"]
    );

    // 3. After the move: the target's provider takes the moved objects as mailed (status
    //    rebuilt from the records: `clusterctl move` does not carry status) and provisioned.
    for (kind, name) in [
        ("MailgunCluster", "alpha"),
        ("MailgunMachine", "alpha-cp-0"),
    ] {
        eventually(
            WAIT,
            &format!("the moved {kind} {name} Ready in the target"),
            || async {
                target.check_alive()?;
                let o = target.infra(kind).get(name).await?;
                let ready = condition(&o, "Ready").is_some_and(|(s, _)| s == "True");
                let sent = condition(&o, "MailSent").is_some_and(|(s, _)| s == "True");
                Ok(
                    (ready && sent && o.data["status"]["initialization"]["provisioned"] == true)
                        .then_some(()),
                )
            },
        )
        .await?;
    }
    eventually(
        WAIT,
        "the moved Cluster unpaused and provisioned in the target",
        || async {
            target.check_alive()?;
            let c = target.clusters().get("alpha").await?;
            Ok((c.data["spec"]["paused"] != true
                && c.data["status"]["initialization"]["infrastructureProvisioned"] == true)
                .then_some(()))
        },
    )
    .await?;

    // New objects in the target mail once through the moved identity (and its moved Secret):
    // a Machine of the moved Cluster, and a new Cluster.
    target.create_machine("alpha", "alpha-md-0", false).await?;
    target.create_cluster("beta").await?;
    let worker_request = one_mail(tenant, "New Machine alpha-md-0", &both).await?;
    let beta_request = one_mail(tenant, "New Cluster beta requested", &both).await?;
    for mail in [&worker_request, &beta_request] {
        ensure!(
            mail.to == [TENANT_RECIPIENT] && mail.from.contains(&format!("capm@{TENANT_DOMAIN}")),
            "{}: from {} to {:?}: not the moved identity's sender and recipients",
            mail.subject,
            mail.from,
            mail.to
        );
    }

    // Deleting the moved Cluster in the target: one release per object, through the identity.
    let target_uids = BTreeMap::from([
        (
            "MailgunCluster",
            target.infra("MailgunCluster").get("alpha").await?.uid(),
        ),
        (
            "MailgunMachine",
            target
                .infra("MailgunMachine")
                .get("alpha-cp-0")
                .await?
                .uid(),
        ),
    ]);
    target
        .clusters()
        .delete("alpha", &DeleteParams::default())
        .await?;
    eventually(WAIT, "the moved Cluster deleted in the target", || async {
        target.check_alive()?;
        Ok(target
            .clusters()
            .get_opt("alpha")
            .await?
            .is_none()
            .then_some(()))
    })
    .await?;
    for subject in [
        "Cluster alpha no longer needed",
        "Machine alpha-cp-0 no longer needed",
        "Machine alpha-md-0 no longer needed",
    ] {
        one_mail(tenant, subject, &both).await?;
    }

    // The whole mail record: on the tenant's server, each request once (the moved objects'
    // under their first UID: the record travelled), each release once under the target
    // object's UID, no release of the source's copies; nothing on either default backend.
    let mails = tenant.messages()?;
    for (kind, uid) in &source_uids {
        let uid = uid.as_deref().unwrap_or_default();
        let request = format!("<{}.{uid}@", kind.to_ascii_lowercase());
        let requests = mails.iter().filter(|m| m.id.starts_with(&request)).count();
        ensure!(
            requests == 1,
            "{kind} request {requests}: {:?}",
            subjects(tenant)?
        );
        ensure!(
            !mails
                .iter()
                .any(|m| m.id.contains(&format!("-deleted.{uid}@"))),
            "a release of the source's {kind}: {:?}",
            subjects(tenant)?
        );
    }
    for (kind, uid) in &target_uids {
        let uid = uid.as_deref().unwrap_or_default();
        let release = mails
            .iter()
            .filter(|m| {
                m.id.contains(&format!("{}-deleted.{uid}@", kind.to_ascii_lowercase()))
            })
            .count();
        ensure!(
            release == 1,
            "{kind} release under {uid}: {release}; {:?}",
            subjects(tenant)?
        );
    }
    ensure!(
        mails.len() == 7,
        "2 requests before the move, 2 after, 3 releases: {:?}",
        subjects(tenant)?
    );
    // The source's provider saw its copies paused and gone: it ran no deletion for them (its
    // log names every finalizer it removes).
    let source_log = source.provider.proc.log();
    ensure!(
        !source_log.contains("Finalizer removed"),
        "the source's provider ran a deletion:\n{source_log}"
    );
    for m in &both {
        let stray = m.default_backend.messages()?;
        ensure!(
            stray.is_empty(),
            "the {} default backend got mail: {:?}",
            m.name,
            stray.iter().map(|s| &s.subject).collect::<Vec<_>>()
        );
    }
    println!(
        "after the move: no second request, no release from the source, 2 new requests and 3 \
         releases through the moved identity ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn subjects(server: &MailgunServer) -> Result<Vec<(String, String)>> {
    Ok(server
        .messages()?
        .into_iter()
        .map(|m| (m.id, m.subject))
        .collect())
}
