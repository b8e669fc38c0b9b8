//! `clusterctl init --infrastructure mailgun` for real (issue 47, item 2): a clusterctl local
//! repository of this build's release assets (`hack/release-manifests.sh`:
//! `infrastructure-components.yaml`, `metadata.yaml`, the templates), a `clusterctl.yaml` whose
//! `providers:` entry names it, cert-manager (v1.21.1, built by `make tools`) already running,
//! and the Cluster API core provider already installed (its manager runs as a process, as in the
//! other tests; its inventory entry is what `clusterctl init` would have left, its
//! `metadata.yaml` in the local repository so that clusterctl can learn its contract offline).
//!
//! Then: `clusterctl init --infrastructure mailgun` installs the provider's components;
//! cert-manager issues the webhook certificate and injects its CA; the provider from this build
//! runs as the installed Deployment runs it (its arguments, its mounted Secrets, its
//! ServiceAccount's token); `clusterctl generate cluster` for the default and the `clusterclass`
//! flavors, applied, get one request mail per Mailgun object (the machine once the human has
//! answered its Cluster's mail); `clusterctl delete --infrastructure
//! mailgun` removes the provider and keeps the CRDs and the objects (no release mail).

use std::{
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};
use capm_e2e::{
    FULLNAME, RELEASE,
    cert_manager::{self, CertManager},
    clusterctl::{LocalRepository, cluster_api_module, yaml_docs},
    create_namespace, dynamic_api, eventually, free_port, fulfil_command, helm, helm_chart,
    ledger::{Kind, Which, parse_message_id},
    mailgun_ledger, mailgun_mails, run_with_input, service_account_kubeconfig,
    start_capi_manager_with, start_chart_provider, start_routed_chart_provider,
    topology::{self, TestProviders},
};
use capm_mail_servers::MailgunServer;
use capm_test_support::{ControlPlane, KUBERNETES_VERSION, Options};
use k8s_openapi::api::{apps::v1::Deployment, coordination::v1::Lease};
use kube::{Api, ResourceExt, api::ListParams};
use serde_json::json;

/// Where clusterctl installs the provider (the components' one Namespace).
const NS: &str = "capm-system";
/// The components' Deployment and ServiceAccount (`hack/release-manifests.sh`).
const NAME: &str = "capm-controller-manager";
const USER_NS: &str = "team-a";
const DOMAIN: &str = "mg.clusterctl.example.com";
const API_KEY: &str = "key-clusterctl-init-not-logged";
const INFRA: &str = "infrastructure.cluster.x-k8s.io";
/// The page's Deployment and ServiceAccount (`fulfilment-page-components.yaml`).
const PAGE: &str = "capm-controller-manager-fulfilment";
/// The links' key (32 bytes, base64).
const LINK_KEY: &str = "Y2x1c3RlcmN0bC1pbml0LWxpbmsta2V5LW9mLTMyLWI=";
/// The Lease every install method names by default (the binary's default).
const LEASE: &str = "cluster-api-provider-mailgun-leader";

/// Runs clusterctl (stdout and stderr, where it logs, both returned).
fn clusterctl(repo: &LocalRepository, args: &[&str], env: &[(&str, &str)]) -> Result<String> {
    let out = Command::new(capm_test_support::process::binary("clusterctl")?)
        .args(args)
        .env("CLUSTERCTL_DISABLE_VERSIONCHECK", "true")
        .env("XDG_CONFIG_HOME", &repo.home)
        .env("HOME", &repo.home)
        .envs(env.iter().copied())
        .output()
        .context("running clusterctl")?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(
        out.status.success(),
        "clusterctl {} failed ({}):\n{text}",
        args.join(" "),
        out.status
    );
    Ok(text)
}

/// The Cluster API core provider as `clusterctl init` would have left it: its CRDs labelled for
/// clusterctl, clusterctl's inventory CRD and a `Provider` entry for it.
fn core_provider_in_inventory(
    cp: &ControlPlane,
    module_dir: &std::path::Path,
    version: &str,
) -> Result<()> {
    let crds = cp.kubectl_output(&["get", "crd", "-o", "name"])?;
    for crd in crds.lines().filter_map(|l| l.rsplit('/').next()) {
        if crd.ends_with(".cluster.x-k8s.io") && !crd.ends_with(&format!(".{INFRA}")) {
            cp.kubectl_output(&[
                "label",
                "--overwrite",
                "crd",
                crd,
                "clusterctl.cluster.x-k8s.io=",
                "cluster.x-k8s.io/provider=cluster-api",
            ])?;
        }
    }
    let inventory_crd = module_dir.join("cmd/clusterctl/config/manifest/clusterctl-api.yaml");
    let crd = inventory_crd.to_string_lossy();
    cp.kubectl_output(&["apply", "--server-side", "-f", &crd])?;
    cp.kubectl_output(&[
        "wait",
        "--for=condition=Established",
        "--timeout=30s",
        "-f",
        &crd,
    ])?;
    let list = json!({"apiVersion": "v1", "kind": "List", "items": [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "capi-system"}},
        {"apiVersion": "clusterctl.cluster.x-k8s.io/v1alpha3", "kind": "Provider",
         "metadata": {"name": "cluster-api", "namespace": "capi-system", "labels": {
             "clusterctl.cluster.x-k8s.io": "",
             "clusterctl.cluster.x-k8s.io/core": "inventory",
             "cluster.x-k8s.io/provider": "cluster-api"}},
         "providerName": "cluster-api", "type": "CoreProvider", "version": version},
    ]});
    let mut kubectl = cp.kubectl()?;
    kubectl.args(["apply", "--server-side", "-f", "-"]);
    run_with_input(
        &mut kubectl,
        &list.to_string(),
        "the core provider's inventory entry",
    )?;
    Ok(())
}

/// Waits until every MailgunCluster and MailgunMachine in [`USER_NS`] (at least `objects`) has
/// exactly one request mail, and no object more; returns (kind, name) of each.
async fn one_request_each(
    client: &kube::Client,
    mailgun: &MailgunServer,
    objects: usize,
) -> Result<Vec<(String, String)>> {
    eventually(
        Duration::from_secs(120),
        &format!("{objects} objects mailed once each"),
        || async {
            let mut uids = Vec::new();
            for kind in ["MailgunCluster", "MailgunMachine"] {
                for o in dynamic_api(client, USER_NS, INFRA, "v1beta1", kind)
                    .list(&ListParams::default())
                    .await?
                    .items
                {
                    uids.push((kind.to_owned(), o.name_any(), o.uid().unwrap_or_default()));
                }
            }
            let ledger = mailgun_ledger(mailgun, DOMAIN)?;
            let requests = |uid: &str| {
                ledger
                    .entries
                    .iter()
                    .filter(|(o, _)| o.uid == uid)
                    .map(|(_, e)| e.requests.len())
                    .sum::<usize>()
            };
            ensure!(
                ledger.entries.values().all(|e| e.requests.len() <= 1),
                "a second request mail: {:?}",
                ledger.entries
            );
            let done = uids.len() >= objects && uids.iter().all(|(_, _, uid)| requests(uid) == 1);
            Ok(done.then(|| uids.into_iter().map(|(k, n, _)| (k, n)).collect()))
        },
    )
    .await
}

/// The human for every MailgunCluster's request mail but those of `done` (uids): runs its
/// `kubectl patch`, so that the Cluster's infrastructure is provisioned and its machines may ask.
fn fulfil_cluster_requests(
    cp: &ControlPlane,
    mailgun: &MailgunServer,
    done: &[String],
) -> Result<()> {
    for (mail, body) in mailgun_mails(mailgun)? {
        let Some((object, Which::Request)) = parse_message_id(&mail.message_id, DOMAIN) else {
            continue;
        };
        if object.kind != Kind::Cluster || done.contains(&object.uid) {
            continue;
        }
        let host = format!("api-{}.example.com", &object.uid[..8.min(object.uid.len())]);
        let command = fulfil_command(&body, &[("<host>", &host)])?;
        let mut kubectl = cp.kubectl()?;
        kubectl.args(&command[1..]);
        capm_e2e::run(&mut kubectl, &command.join(" "))?;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clusterctl_init_generate_and_delete() -> Result<()> {
    let work = tempfile::tempdir()?;
    let dir = work.path();
    let started = Instant::now();
    let cp = ControlPlane::start(Options::default()).await?;
    cp.install_capi_crds().await?;
    let admin = cp.client().await?;
    topology::install_crds(&admin).await?;

    // Cluster API's core provider, installed (its manager as a process, with ClusterClass).
    let (module_dir, capi_version) = cluster_api_module()?;
    core_provider_in_inventory(&cp, &module_dir, &capi_version)?;
    let capi = start_capi_manager_with(
        cp.kubeconfig(),
        dir,
        &["--feature-gates=ClusterTopology=true"],
    )?;
    cp.adopt(capi.pid())?;

    // cert-manager, running before clusterctl init.
    let cm = CertManager::start(cp.kubeconfig(), dir)?;
    cp.adopt(cm.controller.pid())?;
    cp.adopt(cm.cainjector.pid())?;

    // The local repository and clusterctl.yaml (`providers:`), as the README shows them with
    // the release's URL.
    let repo = LocalRepository::new(&dir.join("clusterctl"))?;
    repo.add_core_metadata(&module_dir, &capi_version)?;
    let config = std::fs::read_to_string(&repo.config)?;
    println!("clusterctl.yaml:\n{config}");

    // 1. clusterctl init --infrastructure mailgun.
    let kubeconfig = cp.kubeconfig().to_string_lossy().into_owned();
    let mailgun = MailgunServer::start(API_KEY, DOMAIN)?;
    let t0 = Instant::now();
    let init = clusterctl(
        &repo,
        &[
            "init",
            "--infrastructure",
            "mailgun",
            "--config",
            &repo.config,
            "--kubeconfig",
            &kubeconfig,
        ],
        &[
            ("MAIL_RECIPIENT", "infrastructure-team@example.com"),
            ("MAILGUN_DOMAIN", DOMAIN),
            ("MAILGUN_API_KEY", API_KEY),
        ],
    )?;
    println!(
        "clusterctl init ({:.1} s):\n{init}",
        t0.elapsed().as_secs_f64()
    );
    ensure!(
        init.contains("Skipping installing cert-manager as it is already installed"),
        "clusterctl accepted the running cert-manager:\n{init}"
    );
    ensure!(
        !init.contains(API_KEY),
        "the API key is in clusterctl's output"
    );
    let providers = cp.kubectl_output(&["get", "providers.clusterctl.cluster.x-k8s.io", "-A"])?;
    println!("{providers}");
    ensure!(
        providers.contains("infrastructure-mailgun")
            && providers.contains(&format!("v{}", env!("CARGO_PKG_VERSION"))),
        "the inventory has the provider:\n{providers}"
    );

    // 2. cert-manager issues the webhook certificate and injects its CA.
    let secret = format!("{NAME}-webhook-cert");
    cert_manager::wait_issued(&admin, NS, &secret, 1, Duration::from_secs(120))
        .await
        .with_context(|| format!("cert-manager-controller log:\n{}", cm.controller.tail(30)))?;
    let ca_injected = eventually(Duration::from_secs(60), "the CA in the CRDs", || async {
        let bundle = cp.kubectl_output(&[
            "get",
            "crd",
            "mailgunclusters.infrastructure.cluster.x-k8s.io",
            "-o",
            "jsonpath={.spec.conversion.webhook.clientConfig.caBundle}",
        ])?;
        Ok((!bundle.trim().is_empty()).then_some(bundle))
    })
    .await?;
    println!(
        "webhook certificate issued, CA injected ({} base64 characters) {:.1} s after init",
        ca_injected.trim().len(),
        t0.elapsed().as_secs_f64()
    );

    let deployments: Api<Deployment> = Api::namespaced(admin.clone(), NS);
    // 2b. The fulfilment page apart, the release's second asset applied beside init as
    //     docs/fulfilment.md says: the provider reads the links' URL and keys file from its
    //     ConfigMap and Secret. The page's port is moved to a free one (the URL names it).
    let page_port = free_port()?;
    let page_url = format!("http://127.0.0.1:{page_port}");
    let page_asset = repo.release.join("fulfilment-page-components.yaml");
    let page_yaml = repo.clusterctl(
        &["generate", "yaml", "--from", &page_asset.to_string_lossy()],
        &[
            ("FULFILMENT_URL", &page_url),
            ("FULFILMENT_KEYS", LINK_KEY),
            ("MAIL_RECIPIENT", "infrastructure-team@example.com"),
        ],
    )?;
    let mut kubectl = cp.kubectl()?;
    kubectl.args(["apply", "-f", "-"]);
    println!(
        "{}",
        run_with_input(&mut kubectl, &page_yaml, "applying the page's asset")?
    );
    let page_args: Vec<String> = deployments
        .get(PAGE)
        .await?
        .spec
        .and_then(|s| s.template.spec)
        .and_then(|p| p.containers[0].args.clone())
        .context("the page's args")?
        .into_iter()
        .map(|a| {
            if a.starts_with("--fulfilment-bind-address=") {
                format!("--fulfilment-bind-address=:{page_port}")
            } else {
                a
            }
        })
        .collect();
    let patch = json!([{
        "op": "replace",
        "path": "/spec/template/spec/containers/0/args",
        "value": page_args,
    }])
    .to_string();
    cp.kubectl_output(&[
        "-n",
        NS,
        "patch",
        "deployment",
        PAGE,
        "--type=json",
        "-p",
        &patch,
    ])?;

    // 3. The provider as the installed Deployment runs it. The test's Mailgun is the contract
    //    server: the one change to the Deployment, `--mailgun-base-url` (a user never needs it).
    let patch = json!([{
        "op": "add",
        "path": "/spec/template/spec/containers/0/args/-",
        "value": format!("--mailgun-base-url={}", mailgun.base_url()),
    }])
    .to_string();
    cp.kubectl_output(&[
        "-n",
        NS,
        "patch",
        "deployment",
        NAME,
        "--type=json",
        "-p",
        &patch,
    ])?;
    let provider = start_routed_chart_provider(&cp, &admin, NS, NAME, dir).await?;
    cp.adopt(provider.proc.pid())?;
    // And the page, as its Deployment runs it, as its own ServiceAccount.
    let page_dir = dir.join("page");
    std::fs::create_dir_all(&page_dir)?;
    let page_kubeconfig = service_account_kubeconfig(&cp, NS, PAGE, &page_dir)?;
    let page = start_chart_provider(&admin, NS, PAGE, &page_kubeconfig, &page_dir).await?;
    cp.adopt(page.proc.pid())?;

    // 4. clusterctl generate cluster, both flavors, applied as a user would.
    create_namespace(&admin, USER_NS, false).await?;
    let _providers = TestProviders::start(&admin, USER_NS);
    topology::create_templates(&admin, USER_NS, "test").await?;
    let vars = [("MAILGUN_CLUSTER_REQUESTER", "clusterctl@example.com")];
    let default = repo.generate_cluster("plain", "", USER_NS, &[], &vars)?;
    let mut kubectl = cp.kubectl()?;
    kubectl.args(["apply", "-f", "-"]);
    println!(
        "{}",
        run_with_input(&mut kubectl, &default, "applying the default flavor")?
    );
    let mailed = one_request_each(&admin, &mailgun, 1)
        .await
        .with_context(|| format!("provider log:\n{}", provider.proc.tail(30)))?;
    println!("default flavor: one request mail each: {mailed:?}");
    // Its mail carries a link (the provider read the asset's ConfigMap), fulfilled through
    // the page apart.
    let (mail, body) = mailgun_mails(&mailgun)?
        .into_iter()
        .find(|(m, _)| {
            parse_message_id(&m.message_id, DOMAIN)
                .is_some_and(|(o, w)| o.kind == Kind::Cluster && w == Which::Request)
        })
        .context("the plain cluster's request mail")?;
    let (object, _) = parse_message_id(&mail.message_id, DOMAIN).context("its Message-Id")?;
    let link = capm_e2e::browser::link_in(&body)?;
    ensure!(link.starts_with(&format!("{page_url}/fulfil/")), "{link}");
    let (status, answer) = capm_e2e::browser::fulfil_through_link(
        &page_dir,
        &page_url,
        &link,
        &[("host", "api-plain.example.com"), ("port", "6443")],
    )?;
    ensure!(
        status == 200 && answer.contains("Recorded"),
        "the plain cluster's link: HTTP {status}:\n{answer}\npage log:\n{}",
        page.proc.tail(20)
    );
    let note = capm_e2e::browser::fulfilled_event(&admin, USER_NS, "plain").await?;
    println!("fulfilled through the page apart: {note}");
    let through_link = vec![object.uid];

    let generated = repo.generate_cluster(
        "topo",
        "clusterclass",
        USER_NS,
        &["--kubernetes-version", KUBERNETES_VERSION],
        &[
            ("MAILGUN_CLUSTER_REQUESTER", "clusterctl@example.com"),
            ("MAILGUN_MACHINE_REQUEST", "A worker please"),
        ],
    )?;
    let objects = topology::runnable_clusterclass(&generated, USER_NS, "md-0", 1)?;
    let mut kubectl = cp.kubectl()?;
    kubectl.args(["apply", "--server-side", "-f", "-"]);
    println!(
        "{}",
        run_with_input(
            &mut kubectl,
            &json!({"apiVersion": "v1", "kind": "List", "items": objects}).to_string(),
            "applying the clusterclass flavor",
        )?
    );
    // The topology Cluster's MailgunCluster asks first; its machine waits for the Cluster's
    // infrastructure, provisioned once the human has answered.
    one_request_each(&admin, &mailgun, 2)
        .await
        .with_context(|| format!("provider log:\n{}", provider.proc.tail(30)))?;
    fulfil_cluster_requests(&cp, &mailgun, &through_link)?;
    // The default Cluster's MailgunCluster, the topology Cluster's and its one machine's.
    let mailed = one_request_each(&admin, &mailgun, 3)
        .await
        .with_context(|| {
            format!(
                "provider log:\n{}\ncapi log:\n{}",
                provider.proc.tail(30),
                capi.tail(30)
            )
        })?;
    println!("both flavors: one request mail each: {mailed:?}");
    ensure!(
        mailed.iter().filter(|(k, _)| k == "MailgunCluster").count() == 2
            && mailed.iter().filter(|(k, _)| k == "MailgunMachine").count() == 1,
        "two MailgunClusters and one MailgunMachine: {mailed:?}"
    );

    // 5. A second install by another method into the same namespace (Helm, as a second release
    //    beside clusterctl's: its CRDs and ServiceAccount) names the same Lease and stands by:
    //    one Lease, one leader, one mail for a new Cluster.
    let helm_dir = dir.join("helm");
    std::fs::create_dir_all(&helm_dir)?;
    let values = helm_dir.join("values.yaml");
    std::fs::write(
        &values,
        format!(
            "mail:\n  recipient: ops@example.com\n  backend: mailgun\n  mailgun:\n    domain: {DOMAIN}\n    \
             baseURL: {}\n    apiKeySecret: {{name: capm-mailgun-api-key}}\n\
             crds:\n  install: false\n\
             serviceAccount:\n  create: false\n  name: {NAME}\n",
            mailgun.base_url()
        ),
    )?;
    helm_chart(cp.kubeconfig(), "install", RELEASE, NS, &values, &[])?;
    let second =
        start_chart_provider(&admin, NS, FULLNAME, &provider.kubeconfig, &helm_dir).await?;
    cp.adopt(second.proc.pid())?;
    let lease_arg = |args: &[String]| {
        args.iter()
            .find(|a| a.starts_with("--leader-election-id="))
            .cloned()
            .unwrap_or_default()
    };
    println!(
        "clusterctl's Deployment: {}; Helm's: {}",
        lease_arg(&provider.chart_args),
        lease_arg(&second.chart_args)
    );
    ensure!(
        lease_arg(&provider.chart_args) == format!("--leader-election-id={LEASE}")
            && lease_arg(&second.chart_args) == lease_arg(&provider.chart_args),
        "both installs name the Lease {LEASE}"
    );
    eventually(
        Duration::from_secs(30),
        "the Helm install standing by",
        || async {
            Ok(second
                .proc
                .log()
                .contains("Another replica leads; standing by")
                .then_some(()))
        },
    )
    .await
    .with_context(|| format!("Helm install's provider log:\n{}", second.proc.tail(20)))?;
    let leases: Api<Lease> = Api::namespaced(admin.clone(), NS);
    let names: Vec<String> = leases
        .list(&ListParams::default())
        .await?
        .items
        .iter()
        .map(ResourceExt::name_any)
        .collect();
    let holder = leases
        .get(LEASE)
        .await?
        .spec
        .and_then(|s| s.holder_identity)
        .unwrap_or_default();
    ensure!(names == [LEASE], "one Lease in {NS}: {names:?}");
    ensure!(
        provider.proc.log().contains("Acquired the leader Lease")
            && provider.proc.log().contains(&holder)
            && !second.proc.log().contains("Acquired the leader Lease"),
        "clusterctl's install leads ({holder}), Helm's does not"
    );
    let default = repo.generate_cluster("third", "", USER_NS, &[], &vars)?;
    let mut kubectl = cp.kubectl()?;
    kubectl.args(["apply", "-f", "-"]);
    run_with_input(&mut kubectl, &default, "applying a third Cluster")?;
    let mailed = one_request_each(&admin, &mailgun, 4).await?;
    println!("two installs, one Lease ({LEASE}, held by {holder}), one mail each: {mailed:?}");
    drop(second);
    helm(
        Some(cp.kubeconfig()),
        &["uninstall", RELEASE, "-n", NS, "--wait"],
    )?;
    let before_delete = mailgun_ledger(&mailgun, DOMAIN)?.entries.len();

    // 6. clusterctl delete --infrastructure mailgun: the provider goes, the CRDs and the
    //    objects stay (no --include-crd), nothing is released.
    let delete = clusterctl(
        &repo,
        &[
            "delete",
            "--infrastructure",
            "mailgun",
            "--config",
            &repo.config,
            "--kubeconfig",
            &kubeconfig,
        ],
        &[],
    )?;
    println!("clusterctl delete:\n{delete}");
    // The kubelet would stop the deleted Deployment's Pods.
    drop(provider);
    eventually(Duration::from_secs(60), "the Deployment gone", || async {
        Ok(deployments.get_opt(NAME).await?.is_none().then_some(()))
    })
    .await?;
    let providers = cp.kubectl_output(&["get", "providers.clusterctl.cluster.x-k8s.io", "-A"])?;
    ensure!(
        !providers.contains("infrastructure-mailgun"),
        "the inventory entry is gone:\n{providers}"
    );
    let left = dynamic_api(&admin, USER_NS, INFRA, "v1beta1", "MailgunCluster")
        .list(&ListParams::default())
        .await?;
    ensure!(left.items.len() == 3, "the MailgunClusters are kept");
    let ledger = mailgun_ledger(&mailgun, DOMAIN)?;
    ensure!(
        ledger.entries.len() == before_delete
            && ledger.entries.values().all(|e| e.releases.is_empty()),
        "no mail after the delete: {:?}",
        ledger.entries
    );
    ensure!(
        ledger
            .entries
            .keys()
            .filter(|o| o.kind == Kind::Cluster)
            .count()
            == 3,
        "{:?}",
        ledger.entries
    );
    let kept: Vec<String> = yaml_docs(&cp.kubectl_output(&["get", "crd", "-o", "yaml"])?)?
        .iter()
        .flat_map(|l| l["items"].as_array().cloned().unwrap_or_default())
        .filter_map(|c| c["metadata"]["name"].as_str().map(str::to_owned))
        .filter(|n| n.ends_with(&format!(".{INFRA}")) && n.starts_with("mailgun"))
        .collect();
    println!(
        "kept CRDs: {kept:?}; the whole test {:.1} s",
        started.elapsed().as_secs_f64()
    );
    ensure!(kept.len() == 7, "our seven CRDs are kept: {kept:?}");
    cm.check_alive()?;
    capi.check_alive()?;
    Ok(())
}
