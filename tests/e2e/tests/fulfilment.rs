//! Fulfilment without cluster credentials (issue 48), in a real browser: the chart installed with
//! `fulfilment.url`, the provider run as its Deployment runs it, the Cluster API core manager and
//! the test control plane and bootstrap providers; a Mailgun contract server receives the
//! request mails. A headless Chromium (Debian's `chromium`, driven by Playwright for Python:
//! `tests/e2e/browser/fulfil_page.py`) opens the link from each received mail, fills the form by
//! its labels and submits it: the `Cluster` reaches `Provisioned`, and so does a `MailgunMachine`
//! of a MachineDeployment, and the worker's repair request (issue 56: its Machine fails its
//! health check, the provider mails the repair request) is answered through its link. The screenshots of each page state go to the test's own directory, or
//! to `docs/fulfilment/` with `CAPM_SCREENSHOTS=docs` (`make screenshots`), so a test run leaves
//! the tree as it was.

use std::{
    fs,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context, Result, ensure};
use capm_e2e::{
    CHART_NAMESPACE as NS, FULLNAME, RELEASE,
    browser::{self, Visit, chromium, fulfilled_event, link_in, page_says},
    create_namespace, create_object, create_secret, dynamic_api, eventually, free_port, helm_chart,
    mailgun_mails, mailgun_values, remediation, start_capi_manager, start_routed_chart_provider,
    topology::{self, TestProviders},
};
use capm_mail_servers::MailgunServer;
use capm_test_support::{ControlPlane, Options};
use kube::{Client, api::DynamicObject};
use serde_json::{Value, json};

const USER_NS: &str = "team-web";
const DOMAIN: &str = "mg.web.example.com";
const RECIPIENT: &str = "datacentre-team@example.com";
const INFRA: &str = "infrastructure.cluster.x-k8s.io";
const CAPI: &str = "cluster.x-k8s.io";
const CLUSTER: &str = "web";
const WORKERS: &str = "web-workers";
/// A test key (32 bytes, base64): the links are sealed with it.
const KEY: &str = "ZnVsZmlsbWVudC1lMmUta2V5LW9mLXRoaXJ0eS10d28h";

/// Where the screenshots go: `docs/fulfilment/` when `CAPM_SCREENSHOTS=docs`, else `dir`.
fn screenshots_dir(dir: &Path) -> PathBuf {
    if std::env::var_os("CAPM_SCREENSHOTS").is_some_and(|v| v == "docs") {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/fulfilment")
    } else {
        dir.join("screenshots")
    }
}

/// The browser fulfils `link`, its screenshots in [`screenshots_dir`].
fn browse(
    dir: &Path,
    link: &str,
    prefix: &str,
    fill: &[(&str, &str)],
    select: &[(&str, &str)],
    refused: Option<&str>,
) -> Result<Value> {
    browser::browse(&Visit {
        link,
        screenshots: &screenshots_dir(dir),
        prefix,
        fill,
        select,
        refused,
        proxy: None,
    })
}

/// What the browser saw of one link (`report`), without JavaScript: the request page (its
/// title, and what it shows), "Recorded" showing `recorded`, and the page opened again (its
/// title, and what it shows).
fn pages_say(
    report: &Value,
    request: (&str, &[&str]),
    recorded: &[&str],
    again: (&str, &[&str]),
) -> Result<()> {
    ensure!(report["request"]["status"] == 200, "{report}");
    ensure!(
        report["scripts"] == 0,
        "the page has no JavaScript: {report}"
    );
    page_says(report, "request", request.0, request.1)?;
    page_says(report, "submitted", "Recorded", recorded)?;
    page_says(report, "again", again.0, again.1)
}

fn condition_true(object: &DynamicObject, kind: &str) -> bool {
    object.data["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|c| c["type"] == kind && c["status"] == "True")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_browser_fulfils_a_cluster_and_a_machine_from_the_mailed_links() -> Result<()> {
    let chromium = chromium()?;
    let work = tempfile::tempdir()?;
    let dir = work.path();
    let cp = ControlPlane::start(Options::default()).await?;
    cp.install_capi_crds().await?;
    let admin = cp.client().await?;
    topology::install_crds(&admin).await?;
    let mailgun = MailgunServer::start("key-fulfilment-e2e-not-logged", DOMAIN)?;
    let result = story(&cp, &admin, &mailgun, dir, &chromium).await;
    if let Err(e) = &result {
        capm_e2e::report_failure(e, dir, &["capi-manager.log", "provider.log"], 40);
    }
    result
}

async fn story(
    cp: &ControlPlane,
    admin: &Client,
    mailgun: &MailgunServer,
    dir: &Path,
    chromium: &Path,
) -> Result<()> {
    ensure!(chromium.exists());
    // The chart with the page on; its keys in a Secret, as docs/fulfilment.md says.
    let port = free_port()?;
    let url = format!("http://127.0.0.1:{port}");
    create_namespace(admin, NS, true).await?;
    create_secret(
        admin,
        NS,
        "mailgun-credentials",
        &[("api-key", mailgun.api_key())],
    )
    .await?;
    create_secret(admin, NS, "capm-fulfilment-keys", &[("keys", KEY)]).await?;
    let values = dir.join("values.yaml");
    fs::write(
        &values,
        format!(
            "{}fulfilment:\n  url: {url}\n  port: {port}\n  keysSecret: {{name: capm-fulfilment-keys}}\n",
            mailgun_values(RECIPIENT, DOMAIN, &mailgun.base_url())
        ),
    )?;
    helm_chart(cp.kubeconfig(), "install", RELEASE, NS, &values, &[])?;
    let provider = start_routed_chart_provider(cp, admin, NS, FULLNAME, dir).await?;
    ensure!(
        provider
            .chart_args
            .iter()
            .any(|a| a == &format!("--fulfilment-url={url}")),
        "{:?}",
        provider.chart_args
    );
    create_namespace(admin, USER_NS, false).await?;
    let capi = start_capi_manager(cp.kubeconfig(), dir)?;
    let _providers = TestProviders::start(admin, USER_NS);

    let create = |group: &str, version: &str, kind: &str, name: &str, spec: Value| {
        create_object(admin, USER_NS, group, version, kind, name, spec)
    };
    topology::create_templates(admin, USER_NS, WORKERS).await?;
    topology::create_cluster(
        admin,
        USER_NS,
        CLUSTER,
        "One cluster please.\nThree control plane nodes.",
        "web-admin@example.com",
    )
    .await?;

    // The cluster's request mail: the kubectl patch and, beside it, the link.
    let wait = Duration::from_secs(120);
    let body = eventually(wait, "the cluster request mail", || async {
        provider.proc.check_alive()?;
        capi.check_alive()?;
        Ok(mailgun_mails(mailgun)?
            .into_iter()
            .find(|(m, _)| {
                m.subject
                    .contains(&format!("New Cluster {CLUSTER} requested"))
            })
            .map(|(_, body)| body))
    })
    .await?;
    ensure!(body.contains("kubectl patch mailguncluster"), "{body}");
    let link = link_in(&body)?;
    ensure!(link.starts_with(&format!("{url}/fulfil/")), "{link}");
    ensure!(
        !link.contains(CLUSTER) && !link.contains(USER_NS),
        "the link names the object: {link}"
    );

    // An altered link: one character of the token changed.
    let mut altered = link.clone();
    let last = altered.pop().context("empty link")?;
    altered.push(if last == 'A' { 'B' } else { 'A' });
    let report = browse(
        dir,
        &link,
        "cluster",
        &[
            ("Control plane host", "api.web.example.com"),
            ("Control plane port", "6443"),
        ],
        &[],
        Some(&altered),
    )?;
    pages_say(
        &report,
        (
            "A cluster was requested",
            &[
                "MailgunCluster",
                CLUSTER,
                USER_NS,
                "Urgent",
                "Three control plane nodes.",
                "web-admin@example.com",
            ],
        ),
        &["api.web.example.com:6443"],
        ("Already fulfilled", &["api.web.example.com:6443"]),
    )?;
    ensure!(report["refused"]["status"] == 403, "{report}");
    page_says(
        &report,
        "refused",
        "This link cannot be used",
        &["Nothing was recorded"],
    )?;

    let clusters = dynamic_api(admin, USER_NS, CAPI, "v1beta2", "Cluster");
    eventually(
        wait,
        "Cluster InfrastructureReady, Provisioned, control plane initialized",
        || async {
            let c = clusters.get(CLUSTER).await?;
            let phase = c.data["status"]["phase"]
                .as_str()
                .unwrap_or_default()
                .to_owned();
            Ok((condition_true(&c, "InfrastructureReady")
                && condition_true(&c, "ControlPlaneInitialized")
                && phase == "Provisioned")
                .then_some(()))
        },
    )
    .await?;
    let note = fulfilled_event(admin, USER_NS, CLUSTER).await?;
    for want in [RECIPIENT, "127.0.0.1", "Chrome", "api.web.example.com:6443"] {
        ensure!(note.contains(want), "{want:?} not in the Event: {note}");
    }

    // A MachineDeployment of one worker: its MailgunMachine's mail, fulfilled in the browser.
    create(INFRA, "v1beta1", "MailgunMachineTemplate", WORKERS,
        json!({"template": {"spec": {"priority": "BusinessCritical", "request": "A worker please", "requester": "web-admin@example.com"}}})).await?;
    create(
        CAPI,
        "v1beta2",
        "MachineDeployment",
        WORKERS,
        topology::machine_deployment(CLUSTER, "e2e.capm.example.com/pool", WORKERS, 1),
    )
    .await?;
    let (subject, body) = eventually(wait, "the machine request mail", || async {
        provider.proc.check_alive()?;
        Ok(mailgun_mails(mailgun)?
            .into_iter()
            .find(|(m, _)| {
                m.subject.contains("New Machine")
                    && m.subject.contains(&format!("for Cluster {CLUSTER}"))
            })
            .map(|(m, body)| (m.subject, body)))
    })
    .await?;
    let machine = subject
        .split_whitespace()
        .skip_while(|w| *w != "Machine")
        .nth(1)
        .context("machine name in the subject")?
        .to_owned();
    let secret_line = body
        .lines()
        .find(|l| l.starts_with("Bootstrap data: Secret "))
        .with_context(|| format!("no bootstrap line:\n{body}"))?;
    let secret = secret_line
        .trim_start_matches("Bootstrap data: Secret ")
        .split_whitespace()
        .next()
        .unwrap_or_default()
        .to_owned();
    let link = link_in(&body)?;
    let report = browse(
        dir,
        &link,
        "machine",
        &[
            ("Provider ID", "datacentre://rack4/slot12"),
            ("Address", "192.0.2.10"),
        ],
        &[("address-type-0", "InternalIP")],
        None,
    )?;
    pages_say(
        &report,
        (
            "A machine was requested",
            &[
                "MailgunMachine",
                &machine,
                "BusinessCritical",
                "A worker please",
                "Bootstrap data",
                &secret,
            ],
        ),
        &["datacentre://rack4/slot12", "192.0.2.10"],
        ("Already fulfilled", &["datacentre://rack4/slot12"]),
    )?;

    let mailgun_machines = dynamic_api(admin, USER_NS, INFRA, "v1beta1", "MailgunMachine");
    let machines = dynamic_api(admin, USER_NS, CAPI, "v1beta2", "Machine");
    let machine_name = eventually(
        wait,
        "the MailgunMachine and its Machine provisioned",
        || async {
            let m = mailgun_machines.get(&machine).await?;
            let provisioned = m.data["status"]["initialization"]["provisioned"] == true
                && m.data["status"]["addresses"][0]["address"] == "192.0.2.10";
            let owner = m
                .metadata
                .owner_references
                .unwrap_or_default()
                .into_iter()
                .find(|o| o.kind == "Machine");
            let Some(owner) = owner else { return Ok(None) };
            let capi_machine = machines.get(&owner.name).await?;
            let infra = capi_machine.data["status"]["initialization"]["infrastructureProvisioned"]
                == true
                && capi_machine.data["spec"]["providerID"] == "datacentre://rack4/slot12";
            Ok((provisioned && infra).then_some(owner.name))
        },
    )
    .await?;
    let note = fulfilled_event(admin, USER_NS, &machine).await?;
    ensure!(
        note.contains("datacentre://rack4/slot12") && note.contains(RECIPIENT),
        "{note}"
    );
    repair_story(admin, mailgun, dir, &url, &machine_name).await?;
    println!("screenshots in {}", screenshots_dir(dir).display());
    Ok(())
}

/// Issue 56: the answer to a repair request, in the browser. The worker's Machine fails its
/// health check and gets a `MailgunRemediation`, both as a MachineHealthCheck makes them; the
/// provider mails the repair request with its link; the browser answers `Repaired` with a
/// message, and opening the link again shows the answer, not a form.
async fn repair_story(
    admin: &Client,
    mailgun: &MailgunServer,
    dir: &Path,
    url: &str,
    machine_name: &str,
) -> Result<()> {
    let machine = remediation::fail_health_check(admin, USER_NS, machine_name).await?;
    let spec =
        json!({"request": "The worker stopped answering.\nPower-cycle it and check its cable."});
    remediation::create_remediation(admin, USER_NS, machine_name, Some(&machine), spec).await?;
    let remediations = dynamic_api(admin, USER_NS, INFRA, "v1beta1", "MailgunRemediation");
    let subject = format!("Machine {machine_name} of Cluster {CLUSTER} needs repair");
    let body = eventually(
        Duration::from_secs(60),
        "the repair mail, its phase WaitingForAnswer",
        || async {
            let asked =
                remediations.get(machine_name).await?.data["status"]["phase"] == "WaitingForAnswer";
            let mail = mailgun_mails(mailgun)?
                .into_iter()
                .find(|(m, _)| m.subject.contains(&subject));
            Ok(mail.filter(|_| asked).map(|(_, body)| body))
        },
    )
    .await?;
    let link = link_in(&body)?;
    ensure!(link.starts_with(url), "a link elsewhere: {link}");
    ensure!(
        !link.contains(machine_name) && !link.contains(USER_NS),
        "the link names the object: {link}"
    );
    let report = browse(
        dir,
        &link,
        "repair",
        &[("Message", "Reseated the power cable.")],
        &[("result", "Repaired")],
        None,
    )?;
    pages_say(
        &report,
        (
            "A machine needs repair",
            &[
                "MailgunRemediation",
                machine_name,
                "Urgent",
                "Power-cycle it and check its cable.",
                CLUSTER,
                "datacentre://rack4/slot12",
                "UnhealthyNode",
                "WaitingForAnswer",
            ],
        ),
        &["Answer recorded", "Repaired", "Reseated the power cable."],
        (
            "Already answered",
            &["Repaired", "Reseated the power cable.", machine_name],
        ),
    )?;
    let stored = dynamic_api(admin, USER_NS, INFRA, "v1beta1", "MailgunRemediation")
        .get(machine_name)
        .await?;
    ensure!(
        stored.data["spec"]["answer"]
            == json!({"result": "Repaired", "message": "Reseated the power cable."}),
        "{}",
        stored.data
    );
    let note = browser::link_event(admin, USER_NS, machine_name, "AnsweredThroughLink").await?;
    for want in [RECIPIENT, "127.0.0.1", "Chrome", "Repaired"] {
        ensure!(note.contains(want), "{want:?} not in the Event: {note}");
    }
    Ok(())
}
