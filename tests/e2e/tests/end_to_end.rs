//! End to end, with real parts only: the chart installed by Helm into a local control plane;
//! the provider run from this build exactly as the chart's Deployment runs it (its args, its
//! mounted Secrets, its ServiceAccount's token, so only the chart's RBAC applies); the real
//! Cluster API core manager; a real SMTP server (STARTTLS required, AUTH); the API server
//! calling the conversion webhook through the chart's Service and certificate; Debian's
//! Prometheus scraping the provider. A built Machine's repair by mail (issue 56: one repair
//! mail, a timed hand-back through the health checks' brake) makes the provider use its
//! remediation grants. The API server's audit log then shows that the chart's RBAC was
//! sufficient (no request of the provider was denied) and minimal (each permission it grants
//! was used, bar the ones listed with their reason). The fulfilment page runs apart
//! (`fulfilment.separateDeployment`), as the chart's second Deployment runs it (`--mode
//! fulfilment-page`, its own ServiceAccount); the links of two mails are used through it (curl,
//! as a browser: the page's cookie and form token), and the audit log shows the same of the
//! page's ServiceAccount: nothing denied, every permission used.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail, ensure};
use capm_e2e::{
    AUDIT_POLICY, CHART_NAMESPACE as NS, FULLNAME, HttpsScrape, Proc, Prometheus, RELEASE,
    audited_requests, create_cluster_pair, create_namespace, create_secret, dynamic_api,
    dynamic_object, eventually, free_port, helm_chart, https_get, promtool_check_metrics,
    provider_username, remediation, service_account_kubeconfig, start_capi_manager,
    start_chart_provider, start_routed_chart_provider,
};
use capm_mail_servers::{ReceivedMail, SmtpOptions, SmtpServer, SmtpTls};
use capm_test_support::pki::CertificateAuthority;
use k8s_openapi::api::{
    core::v1::ServiceAccount,
    rbac::v1::{ClusterRole, PolicyRule, Role},
};
use kube::{
    Api,
    api::{DynamicObject, Patch, PatchParams, PostParams},
    core::ObjectMeta,
};

const USER_NS: &str = "team-a";
const INFRA: &str = "infrastructure.cluster.x-k8s.io";
const CAPI: &str = "cluster.x-k8s.io";
const RECIPIENT: &str = "infrastructure-team@example.com";
/// The links' key (32 bytes, base64).
const LINK_KEY: &str = "ZW5kLXRvLWVuZC1saW5rLWtleS1vZi10aGlydHktdHdv";

/// controller-runtime's queue series (histograms by their count), present per controller.
const QUEUE_SERIES: [&str; 7] = [
    "workqueue_depth",
    "workqueue_adds_total",
    "workqueue_queue_duration_seconds_count",
    "workqueue_work_duration_seconds_count",
    "workqueue_unfinished_work_seconds",
    "workqueue_longest_running_processor_seconds",
    "workqueue_retries_total",
];

/// Series the shipped alerts and dashboard read that this run does not make the provider export
/// (a counter appears once it counts something), with where they are seen.
const NOT_IN_THIS_RUN: [(&str, &str); 1] = [(
    "capm_mail_resends_total",
    "counted only when a send's outcome was unknown and it went again; the soak test reads it",
)];

/// Decodes a quoted-printable body (soft breaks and `=XX`); other bodies pass unchanged.
fn body_text(mail: &ReceivedMail) -> String {
    let qp = mail
        .header("Content-Transfer-Encoding")
        .is_some_and(|e| e.eq_ignore_ascii_case("quoted-printable"));
    if !qp {
        return mail.body.clone();
    }
    let joined = mail.body.replace("=\r\n", "").replace("=\n", "");
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

/// The first mail at `smtp` whose subject contains `subject`, waited for while `provider` runs.
async fn mail_about(smtp: &SmtpServer, provider: &Proc, subject: &str) -> Result<ReceivedMail> {
    let what = format!("a mail about {subject:?}");
    eventually(Duration::from_secs(120), &what, || async {
        provider.check_alive()?;
        Ok(smtp
            .messages()?
            .into_iter()
            .find(|m| m.header("Subject").is_some_and(|s| s.contains(subject))))
    })
    .await
}

/// The `MailgunRemediation` `name` once its phase is `phase` and `also` holds of it.
async fn in_phase(
    remediations: &Api<DynamicObject>,
    name: &str,
    phase: &str,
    also: impl Fn(&DynamicObject) -> bool,
) -> Result<DynamicObject> {
    let what = format!("MailgunRemediation {name} in phase {phase}");
    eventually(Duration::from_secs(60), &what, || async {
        let r = remediations.get(name).await?;
        Ok((r.data["status"]["phase"] == phase && also(&r)).then_some(r))
    })
    .await
}

/// The `kubectl ...` line the mail gives its recipient, placeholders filled in.
fn fulfil_command(mail: &ReceivedMail, fill: &[(&str, &str)]) -> Result<Vec<String>> {
    capm_e2e::fulfil_command(&body_text(mail), fill)
}

/// Granted (group, resource, verb) triples of a rule list.
fn granted(rules: &[PolicyRule]) -> BTreeSet<(String, String, String)> {
    let mut out = BTreeSet::new();
    for rule in rules {
        for group in rule.api_groups.as_deref().unwrap_or_default() {
            for resource in rule.resources.as_deref().unwrap_or_default() {
                for verb in &rule.verbs {
                    out.insert((group.clone(), resource.clone(), verb.clone()));
                }
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chart_provider_and_cluster_api_end_to_end() -> Result<()> {
    let work = tempfile::tempdir()?;
    let dir = work.path();
    // A control plane of its own, with an audit log of every ServiceAccount's requests.
    let (cp, audit_log) = capm_e2e::audited_control_plane(dir, AUDIT_POLICY).await?;
    let admin = cp.client().await?;

    // A real SMTP relay: STARTTLS required, AUTH, a private CA.
    let smtp_password = "e2e-smtp-password-not-logged";
    let mut smtp = SmtpServer::start(SmtpOptions {
        tls: SmtpTls::StarttlsRequired,
        auth: Some(("capm".into(), smtp_password.into())),
    })?;
    let smtp_ca = fs::read_to_string(smtp.ca_cert().context("SMTP CA")?)?;
    // The diagnostics endpoint's certificate, from a CA Prometheus is given.
    let diagnostics_ca = CertificateAuthority::new("capm e2e diagnostics CA")?;
    let diagnostics_cert = diagnostics_ca.serving_cert("diagnostics", &[], &[])?;
    let diagnostics_ca_file = dir.join("diagnostics-ca.crt");
    fs::write(&diagnostics_ca_file, diagnostics_ca.cert_pem())?;

    // The chart, as a user installs it: namespace enforcing "restricted", Secrets first.
    create_namespace(&admin, NS, true).await?;
    create_namespace(&admin, USER_NS, false).await?;
    create_secret(
        &admin,
        NS,
        "smtp-credentials",
        &[("password", smtp_password)],
    )
    .await?;
    create_secret(&admin, NS, "smtp-ca", &[("ca.crt", &smtp_ca)]).await?;
    create_secret(
        &admin,
        NS,
        "diagnostics-cert",
        &[
            ("tls.crt", &diagnostics_cert.cert_pem),
            ("tls.key", &diagnostics_cert.key_pem),
        ],
    )
    .await?;
    // The page apart from the keys: links in the mails, the page its own Deployment.
    create_secret(&admin, NS, "capm-fulfilment-keys", &[("keys", LINK_KEY)]).await?;
    let page_port = free_port()?;
    let page_url = format!("http://127.0.0.1:{page_port}");
    let values = dir.join("values.yaml");
    fs::write(
        &values,
        format!(
            "mail:\n  recipient: {RECIPIENT}\n  from: capm@capm.e2e.example.com\n  backend: smtp\n  messageIdDomain: capm.e2e.example.com\n  \
             smtp:\n    url: {}\n    username: capm\n    passwordSecret: {{name: smtp-credentials}}\n    \
             caSecret: {{name: smtp-ca}}\n\
             tenancy:\n  smtpHosts: [\"127.0.0.1\"]\n\
             metrics:\n  certSecret: diagnostics-cert\n  \
             reader:\n    serviceAccounts: [{{name: prometheus, namespace: {USER_NS}}}]\n\
             fulfilment:\n  url: {page_url}\n  port: {page_port}\n  keysSecret: {{name: capm-fulfilment-keys}}\n  \
             separateDeployment: true\n",
            smtp.url()
        ),
    )?;
    helm_chart(cp.kubeconfig(), "install", RELEASE, NS, &values, &[])?;

    // The provider as the chart's ServiceAccount, the core manager as Cluster API.
    let provider = start_routed_chart_provider(&cp, &admin, NS, FULLNAME, dir).await?;
    ensure!(
        provider
            .chart_args
            .iter()
            .any(|a| a == "--leader-elect=true"),
        "the chart runs with leader election: {:?}",
        provider.chart_args
    );
    ensure!(
        provider
            .chart_args
            .iter()
            .any(|a| a == "--fulfilment-bind-address=0"),
        "the provider seals the links and serves no page: {:?}",
        provider.chart_args
    );
    // The page as its Deployment runs it, as its own ServiceAccount.
    let page_dir = dir.join("page");
    fs::create_dir_all(&page_dir)?;
    let page_account = format!("{FULLNAME}-fulfilment");
    let page_kubeconfig = service_account_kubeconfig(&cp, NS, &page_account, &page_dir)?;
    let page = start_chart_provider(&admin, NS, &page_account, &page_kubeconfig, &page_dir).await?;
    ensure!(
        page.chart_args.first().map(String::as_str) == Some("--mode=fulfilment-page"),
        "the page's Deployment: {:?}",
        page.chart_args
    );
    let capi = start_capi_manager(cp.kubeconfig(), dir)?;

    // The relay refuses the first two attempts (451, try again later): the provider reports
    // it, backs off, and the mail still arrives once.
    smtp.fail_next(451, 2)?;

    // A Cluster and its MailgunCluster, as a user writes them: no owner references.
    create_cluster_pair(&admin, USER_NS, "e2e", "e2e@example.com").await?;
    let clusters = dynamic_api(&admin, USER_NS, "cluster.x-k8s.io", "v1beta2", "Cluster");
    let mailgun_clusters = dynamic_api(
        &admin,
        USER_NS,
        "infrastructure.cluster.x-k8s.io",
        "v1beta1",
        "MailgunCluster",
    );

    let wait = Duration::from_secs(120);
    let request = eventually(wait, "the cluster request mail", || async {
        provider.proc.check_alive()?;
        capi.check_alive()?;
        let mails = smtp.messages()?;
        Ok(mails.into_iter().find(|m| {
            m.header("Subject")
                .is_some_and(|s| s.contains("New Cluster e2e requested"))
        }))
    })
    .await?;
    ensure!(
        request.tls && request.auth_user.as_deref() == Some("capm"),
        "STARTTLS + AUTH"
    );
    ensure!(request.rcpt_tos == [RECIPIENT], "{:?}", request.rcpt_tos);
    let owner = mailgun_clusters
        .get("e2e")
        .await?
        .metadata
        .owner_references
        .unwrap_or_default();
    ensure!(
        owner.iter().any(|o| o.kind == "Cluster" && o.name == "e2e"),
        "Cluster API set the owner reference: {owner:?}"
    );

    // The recipient fulfils the request with the command from the mail.
    let command = fulfil_command(&request, &[("<host>", "api.e2e.example.com")])?;
    ensure!(command[0] == "kubectl", "{command:?}");
    let mut kubectl = cp.kubectl()?;
    kubectl.args(&command[1..]);
    capm_e2e::run(&mut kubectl, &command.join(" "))?;
    eventually(
        wait,
        "Cluster InfrastructureReady=True and phase Provisioned",
        || async {
            let c = clusters.get("e2e").await?;
            let status = &c.data["status"];
            let ready = status["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "InfrastructureReady" && c["status"] == "True");
            Ok((ready && status["phase"] == "Provisioned").then_some(()))
        },
    )
    .await?;

    // A Machine: waits for the Cluster's infrastructure (now ready) and its bootstrap data.
    let machines = dynamic_api(&admin, USER_NS, "cluster.x-k8s.io", "v1beta2", "Machine");
    let mailgun_machines = dynamic_api(
        &admin,
        USER_NS,
        "infrastructure.cluster.x-k8s.io",
        "v1beta1",
        "MailgunMachine",
    );
    mailgun_machines
        .create(
            &PostParams::default(),
            &dynamic_object(
                "infrastructure.cluster.x-k8s.io/v1beta1",
                "MailgunMachine",
                USER_NS,
                "e2e-cp-0",
                serde_json::json!({"priority": "Urgent", "request": "A control plane node please", "requester": "e2e@example.com"}),
            )?,
        )
        .await?;
    machines
        .create(
            &PostParams::default(),
            &dynamic_object(
                "cluster.x-k8s.io/v1beta2",
                "Machine",
                USER_NS,
                "e2e-cp-0",
                serde_json::json!({
                    "clusterName": "e2e",
                    "bootstrap": {"dataSecretName": "e2e-cp-0-bootstrap"},
                    "infrastructureRef": {"apiGroup": "infrastructure.cluster.x-k8s.io", "kind": "MailgunMachine", "name": "e2e-cp-0"},
                }),
            )?,
        )
        .await?;
    let machine_mail = eventually(wait, "the machine request mail", || async {
        provider.proc.check_alive()?;
        Ok(smtp.messages()?.into_iter().find(|m| {
            m.header("Subject")
                .is_some_and(|s| s.contains("Machine e2e-cp-0") && !s.contains("no longer"))
        }))
    })
    .await?;
    let text = body_text(&machine_mail);
    ensure!(
        text.contains("e2e-cp-0-bootstrap"),
        "the mail names the bootstrap Secret:\n{text}"
    );
    // The recipient fulfils this one through the mailed link: the page (its own Deployment and
    // ServiceAccount) reads the MailgunMachine and its Machine, patches it and records an Event.
    let link = capm_e2e::browser::link_in(&text)?;
    let (status, answer) = capm_e2e::browser::fulfil_through_link(
        dir,
        &page_url,
        &link,
        &[
            ("provider-id", "mailgun://e2e-cp-0"),
            ("address-type-0", "InternalIP"),
            ("address-0", "192.0.2.10"),
        ],
    )?;
    ensure!(
        status == 200 && answer.contains("Recorded"),
        "the machine's link: HTTP {status}:\n{answer}\npage log:\n{}",
        page.proc.tail(20)
    );
    let note = capm_e2e::browser::fulfilled_event(&admin, USER_NS, "e2e-cp-0").await?;
    ensure!(
        note.starts_with("From 127.0.0.1") && note.contains(RECIPIENT),
        "the machine's FulfilledThroughLink Event: {note}"
    );
    eventually(wait, "the Machine's infrastructure provisioned", || async {
        let m = mailgun_machines.get("e2e-cp-0").await?;
        Ok((m.data["status"]["initialization"]["provisioned"] == true).then_some(()))
    })
    .await?;

    // The API server converts through the chart's Service, EndpointSlice and certificate.
    let old = dynamic_api(
        &admin,
        USER_NS,
        "infrastructure.cluster.x-k8s.io",
        "v1alpha1",
        "MailgunCluster",
    )
    .get("e2e")
    .await
    .context("reading v1alpha1: the conversion webhook")?;
    ensure!(
        old.types
            .as_ref()
            .is_some_and(|t| t.api_version.ends_with("/v1alpha1"))
    );
    ensure!(
        old.data["status"]["ready"] == true,
        "v1alpha1 status.ready: {}",
        old.data["status"]
    );

    // Prometheus scrapes the provider over TLS with its ServiceAccount's token, which the
    // chart's metrics-reader ClusterRole lets through; promtool accepts the exposition.
    let prometheus_token = dir.join("prometheus.token");
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), USER_NS);
    accounts
        .create(
            &PostParams::default(),
            &ServiceAccount {
                metadata: ObjectMeta {
                    name: Some("prometheus".into()),
                    ..ObjectMeta::default()
                },
                ..ServiceAccount::default()
            },
        )
        .await?;
    let token = cp.kubectl_output(&["-n", USER_NS, "create", "token", "prometheus"])?;
    fs::write(&prometheus_token, token.trim())?;
    let scrape = HttpsScrape {
        ca_file: diagnostics_ca_file.clone(),
        server_name: "localhost".into(),
        token_file: prometheus_token,
    };
    let mut prometheus = Prometheus::start(
        &dir.join("prometheus"),
        std::slice::from_ref(&provider.metrics),
        Some(&scrape),
    )
    .await?;
    let reconciles = eventually(
        Duration::from_secs(60),
        "controller_runtime_reconcile_total in Prometheus",
        || {
            let v = prometheus.query("sum(controller_runtime_reconcile_total)");
            async move { Ok(v?.first().copied().filter(|v| *v > 0.0)) }
        },
    )
    .await?;
    let sent = prometheus
        .query("sum(mailer_messages_total)")
        .unwrap_or_default();
    println!(
        "Prometheus: sum(controller_runtime_reconcile_total) = {reconciles}, sum(mailer_messages_total) = {sent:?}"
    );
    let (status, exposition) = https_get(&provider.metrics, "/metrics", &scrape, true)?;
    ensure!(status == 200, "metrics HTTP {status}");
    let (status, _) = https_get(&provider.metrics, "/metrics", &scrape, false)?;
    ensure!(status == 401, "metrics without a token: HTTP {status}");
    let complaints = promtool_check_metrics(&exposition)?;
    ensure!(
        complaints.is_empty(),
        "promtool check metrics:\n{complaints}"
    );

    // The series dashboards made for Go managers read: the API client's requests and the
    // webhook's, present and moving when work happens. Printed with those the alerts read (the
    // shapes config/prometheus/rules_test.yaml copies).
    let alerting: BTreeSet<String> = capm_e2e::monitoring::rule_expressions(
        &capm_e2e::monitoring::config_dir().join("prometheus/rules.yaml"),
    )?
    .iter()
    .flat_map(|(_, expr)| capm_e2e::monitoring::series_names(expr))
    .collect();
    for line in exposition.lines().filter(|l| {
        let name = l.split(['{', ' ']).next().unwrap_or_default();
        name == "rest_client_requests_total"
            || name.starts_with("controller_runtime_webhook_") && !name.ends_with("_bucket")
            || alerting.contains(name)
    }) {
        println!("scrape: {line}");
    }
    let api_requests = "sum(rest_client_requests_total)";
    let conversions =
        r#"sum(controller_runtime_webhook_requests_total{webhook="/convert", code="200"})"#;
    let conversion_times =
        r#"sum(controller_runtime_webhook_latency_seconds_count{webhook="/convert"})"#;
    let before = eventually(
        Duration::from_secs(30),
        "the API client's and the webhook's series in Prometheus",
        || {
            let values: Result<Vec<Vec<f64>>> = [api_requests, conversions, conversion_times]
                .iter()
                .map(|q| prometheus.query(q))
                .collect();
            async move {
                let values = values?;
                Ok(values
                    .iter()
                    .all(|v| v.first().is_some_and(|v| *v > 0.0))
                    .then(|| values.iter().map(|v| v[0]).collect::<Vec<_>>()))
            }
        },
    )
    .await?;
    for (query, at_least) in [
        (
            r#"sum(rest_client_requests_total{method="GET", code="200"})"#,
            1.0,
        ),
        (
            r#"sum(rest_client_requests_total{method="PATCH", code="200"})"#,
            1.0,
        ),
        (
            r#"count(count by (host) (rest_client_requests_total))"#,
            1.0,
        ),
        (r#"sum(controller_runtime_webhook_requests_in_flight)"#, 0.0),
    ] {
        let v = prometheus.query(query)?;
        ensure!(
            v.first().is_some_and(|v| *v >= at_least),
            "{query} = {v:?}, expected at least {at_least}"
        );
    }
    // Work: three reads through v1alpha1 (each converted by the webhook); the provider's own
    // requests go on (the readiness check, status writes).
    for _ in 0..3 {
        dynamic_api(
            &admin,
            USER_NS,
            "infrastructure.cluster.x-k8s.io",
            "v1alpha1",
            "MailgunCluster",
        )
        .get("e2e")
        .await?;
    }
    let after = eventually(
        Duration::from_secs(30),
        "rest_client_requests_total and the webhook series to move",
        || {
            let values: Result<Vec<Vec<f64>>> = [api_requests, conversions, conversion_times]
                .iter()
                .map(|q| prometheus.query(q))
                .collect();
            let before = before.clone();
            async move {
                let values: Vec<f64> = values?
                    .iter()
                    .map(|v| v.first().copied().unwrap_or_default())
                    .collect();
                let moved = values[0] > before[0]
                    && values[1] >= before[1] + 3.0
                    && values[2] >= before[2] + 3.0;
                Ok(moved.then_some(values))
            }
        },
    )
    .await?;
    println!(
        "Prometheus: {api_requests}, {conversions}, {conversion_times}: {before:?} -> {after:?}"
    );

    // controller-runtime's queue series, for both controllers, and moving when work happens:
    // an annotation on the MailgunCluster is a watch event, so an add, a wait and a reconcile.
    // Depth and the running reconciles' ages come back to zero once it is done (no key left
    // waiting); how they move during a reconcile is pinned by the unit tests
    // (controllers/src/workqueue.rs), a scrape every second cannot catch it reliably.
    for controller in ["mailguncluster", "mailgunmachine"] {
        for series in QUEUE_SERIES {
            let prefix = format!("{series}{{name=\"{controller}\"}} ");
            ensure!(
                exposition.lines().any(|l| l.starts_with(&prefix)),
                "{prefix}not in the scrape"
            );
        }
    }
    for line in exposition
        .lines()
        .filter(|l| l.starts_with("workqueue_") && !l.contains("_bucket"))
    {
        println!("scrape: {line}");
    }
    let queue = |series: &str| format!(r#"sum({series}{{name="mailguncluster"}})"#);
    let moving = [
        queue("workqueue_adds_total"),
        queue("workqueue_queue_duration_seconds_count"),
        queue("workqueue_work_duration_seconds_count"),
    ];
    let before = eventually(
        Duration::from_secs(30),
        "the workqueue series in Prometheus",
        || {
            let values: Result<Vec<Vec<f64>>> =
                moving.iter().map(|q| prometheus.query(q)).collect();
            async move {
                let values = values?;
                Ok(values
                    .iter()
                    .all(|v| v.first().is_some_and(|v| *v > 0.0))
                    .then(|| values.iter().map(|v| v[0]).collect::<Vec<_>>()))
            }
        },
    )
    .await?;
    mailgun_clusters
        .patch(
            "e2e",
            &PatchParams::default(),
            &Patch::Merge(serde_json::json!({
                "metadata": {"annotations": {"e2e.example.com/poke": "1"}}
            })),
        )
        .await?;
    let after = eventually(
        Duration::from_secs(30),
        "workqueue_adds_total, queue and work duration counts to move",
        || {
            let values: Result<Vec<Vec<f64>>> =
                moving.iter().map(|q| prometheus.query(q)).collect();
            let before = before.clone();
            async move {
                let values: Vec<f64> = values?
                    .iter()
                    .map(|v| v.first().copied().unwrap_or_default())
                    .collect();
                let moved = values.iter().zip(&before).all(|(now, was)| now > was);
                Ok(moved.then_some(values))
            }
        },
    )
    .await?;
    println!("Prometheus: {moving:?}: {before:?} -> {after:?}");
    let idle = [
        queue("workqueue_depth"),
        queue("workqueue_unfinished_work_seconds"),
        queue("workqueue_longest_running_processor_seconds"),
    ];
    eventually(
        Duration::from_secs(30),
        "the queue empty and no reconcile running",
        || {
            let values: Result<Vec<Vec<f64>>> = idle.iter().map(|q| prometheus.query(q)).collect();
            async move {
                let values = values?;
                Ok(values.iter().all(|v| v.first() == Some(&0.0)).then_some(()))
            }
        },
    )
    .await?;

    // Every series of the provider's that the shipped alerts and dashboard read is one it
    // exports (kube-state-metrics's are checked against its configuration in monitoring.rs).
    let exported = capm_e2e::monitoring::exposition_names(&exposition);
    let not_seen: BTreeMap<&str, &str> = BTreeMap::from(NOT_IN_THIS_RUN);
    let missing: Vec<_> = capm_e2e::monitoring::shipped_series_names()?
        .into_iter()
        .filter(|(name, _)| {
            !name.starts_with("capi_")
                // Written by Prometheus for every target it scrapes (the target-down alert).
                && name != "up"
                && !exported.contains(name)
                && !not_seen.contains_key(name.as_str())
        })
        .collect();
    ensure!(
        missing.is_empty(),
        "read by the shipped alerts or dashboard but not in the provider's scrape: {missing:?}"
    );

    // Remediation by mail (issue 56), for the audit below to see the provider use the grants
    // the chart gives it for that. The built Machine fails its health check (marked as a
    // MachineHealthCheck marks it), a health check selects it (the core manager counts it as a
    // target and allows remediation: no Node, so it judges nothing) and the MailgunRemediation
    // is made as that health check makes it: one repair mail. The human answers `Repaired` with
    // the mail's command and the Machine stays unhealthy past `repairTimeout`: a timed
    // hand-back, so the provider first reads the brake (its watch of the health checks), then writes
    // the Machine's `OwnerRemediated=False` (machines/status), then its own status. The shortest
    // `repairTimeout` the CRD takes is 1m: rather than wait, the answer is dated two minutes
    // back (`status.answeredAt`, which the provider keeps as when it first saw the answer).
    let story = Instant::now();
    let unhealthy = remediation::fail_health_check(&admin, USER_NS, "e2e-cp-0").await?;
    let health_checks = dynamic_api(&admin, USER_NS, CAPI, "v1beta2", "MachineHealthCheck");
    let check = serde_json::json!({
        "clusterName": "e2e",
        "selector": {"matchLabels": {capm_api::names::CLUSTER_NAME_LABEL: "e2e"}},
        "checks": {"unhealthyNodeConditions": [
            {"type": "Ready", "status": "Unknown", "timeoutSeconds": 300},
        ]},
    });
    capm_e2e::create_object(
        &admin,
        USER_NS,
        CAPI,
        "v1beta2",
        "MachineHealthCheck",
        "e2e",
        check,
    )
    .await?;
    let targeted = || async {
        let check = health_checks.get("e2e").await?;
        let allowed = capm_e2e::cert_manager::condition(&check, "RemediationAllowed")
            .is_some_and(|(status, _)| status == "True");
        let targets = &check.data["status"]["targets"];
        Ok((allowed && *targets == serde_json::json!(["e2e-cp-0"])).then_some(()))
    };
    eventually(
        wait,
        "the health check's target, remediation allowed",
        targeted,
    )
    .await?;
    let spec =
        serde_json::json!({"request": "Power-cycle it.", "strategy": {"repairTimeout": "1m"}});
    remediation::create_remediation(&admin, USER_NS, "e2e-cp-0", Some(&unhealthy), spec).await?;
    let repair = mail_about(
        &smtp,
        &provider.proc,
        "Machine e2e-cp-0 of Cluster e2e needs repair",
    )
    .await?;
    let remediations = dynamic_api(&admin, USER_NS, INFRA, "v1beta1", "MailgunRemediation");
    let two_minutes_ago = jiff::Timestamp::now() - jiff::SignedDuration::from_mins(2);
    let answered_at = two_minutes_ago.round(jiff::Unit::Second)?.to_string();
    let status = serde_json::json!({"status": {"answeredAt": answered_at}});
    remediations
        .patch_status("e2e-cp-0", &PatchParams::default(), &Patch::Merge(status))
        .await?;
    let command = fulfil_command(&repair, &[])?;
    let mut kubectl = cp.kubectl()?;
    kubectl.args(&command[1..]);
    capm_e2e::run(&mut kubectl, &command.join(" "))?;
    let handed_back = in_phase(&remediations, "e2e-cp-0", "HandedBack", |_| true)
        .await
        .with_context(|| format!("provider log:\n{}", provider.proc.tail(30)))?;
    ensure!(
        handed_back.data["status"]["handBackReason"] == "RepairTimedOut",
        "{}",
        handed_back.data["status"]
    );
    let machine = machines.get("e2e-cp-0").await?;
    let owner_remediated = machine.data["status"]["conditions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["type"] == "OwnerRemediated")
        .cloned()
        .unwrap_or_default();
    ensure!(
        owner_remediated["status"] == "False"
            && owner_remediated["message"]
                .as_str()
                .is_some_and(|m| m.contains("MailgunRemediation e2e-cp-0: RepairTimedOut")),
        "the Machine's OwnerRemediated: {owner_remediated}"
    );
    println!("the remediation story took {:?}", story.elapsed());

    // Deleting the Cluster: Cluster API deletes the Machine and the MailgunCluster; each gets
    // its "no longer needed" mail before its finalizer goes. The MailgunRemediation goes with
    // its Machine, without one: it was handed back.
    clusters.delete("e2e", &Default::default()).await?;
    eventually(
        Duration::from_secs(180),
        "the Cluster and its infrastructure gone",
        || async {
            provider.proc.check_alive()?;
            let gone = clusters.get_opt("e2e").await?.is_none()
                && mailgun_clusters.get_opt("e2e").await?.is_none()
                && mailgun_machines.get_opt("e2e-cp-0").await?.is_none()
                && remediations.get_opt("e2e-cp-0").await?.is_none();
            Ok(gone.then_some(()))
        },
    )
    .await
    .with_context(|| {
        format!(
            "core manager log:\n{}\nprovider log:\n{}",
            capi.tail(30),
            provider.proc.tail(30)
        )
    })?;
    let mails = smtp.messages()?;
    let subjects: Vec<&str> = mails.iter().filter_map(|m| m.header("Subject")).collect();
    let count = |needle: &str| subjects.iter().filter(|s| s.contains(needle)).count();
    ensure!(
        mails.len() == 5
            && count("New Cluster e2e requested") == 1
            && count("Machine e2e-cp-0 of Cluster e2e needs repair") == 1
            && count("Cluster e2e no longer needed") == 1
            && count("Machine e2e-cp-0 no longer needed") == 1,
        "expected exactly one request and one deletion mail per object and one repair mail, \
         got {subjects:?}"
    );
    let ids: BTreeSet<_> = mails
        .iter()
        .filter_map(|m| m.header("Message-ID"))
        .collect();
    ensure!(ids.len() == 5, "distinct Message-Ids: {ids:?}");

    // A tenant's cluster, mailed through its own identity (the same relay, its own sender and
    // recipient), as the chart's ServiceAccount: the identity read (get), its Secrets read
    // (get, in the provider's namespace), the namespace's labels read for its selector.
    let identity = dynamic_object(
        "infrastructure.cluster.x-k8s.io/v1beta1",
        "MailgunClusterIdentity",
        "",
        "e2e-tenant",
        serde_json::json!({
            "smtp": { "url": smtp.url(), "username": "capm",
                "passwordSecretRef": { "name": "smtp-credentials", "key": "password" },
                "caSecretRef": { "name": "smtp-ca", "key": "ca.crt" } },
            "from": "tenant@capm.e2e.example.com",
            "recipients": ["tenant-oncall@example.com"],
            "allowedNamespaces": { "selector": { "matchLabels": { "kubernetes.io/metadata.name": USER_NS } } },
        }),
    )?;
    let identities = Api::<kube::api::DynamicObject>::all_with(
        admin.clone(),
        &kube::api::ApiResource::from_gvk(&kube::api::GroupVersionKind::gvk(
            "infrastructure.cluster.x-k8s.io",
            "v1beta1",
            "MailgunClusterIdentity",
        )),
    );
    let mut identity = identity;
    identity.metadata.namespace = None;
    identities.create(&Default::default(), &identity).await?;
    // The operator lends the relay's Secrets to the tenant's identity.
    for secret in ["smtp-credentials", "smtp-ca"] {
        capm_e2e::claim_secret(&admin, NS, secret, "e2e-tenant").await?;
    }
    create_cluster_pair(&admin, USER_NS, "e2e-tenant", "tenant@example.com").await?;
    mailgun_clusters
        .patch(
            "e2e-tenant",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(serde_json::json!({ "spec": { "identityRef": {
                "kind": "MailgunClusterIdentity", "name": "e2e-tenant" } } })),
        )
        .await?;
    let tenant = mail_about(&smtp, &provider.proc, "New Cluster e2e-tenant requested").await?;
    ensure!(
        tenant.rcpt_tos == ["tenant-oncall@example.com"]
            && tenant.header("From") == Some("tenant@capm.e2e.example.com"),
        "the tenant's mail went to {:?} from {:?}",
        tenant.rcpt_tos,
        tenant.header("From")
    );
    // Fulfilled through its link: the page names the identity's recipients in the Event.
    let link = capm_e2e::browser::link_in(&body_text(&tenant))?;
    let (status, answer) = capm_e2e::browser::fulfil_through_link(
        dir,
        &page_url,
        &link,
        &[("host", "api.e2e-tenant.example.com"), ("port", "6443")],
    )?;
    ensure!(
        status == 200 && answer.contains("Recorded"),
        "the tenant's link: HTTP {status}:\n{answer}\npage log:\n{}",
        page.proc.tail(20)
    );
    let note = capm_e2e::browser::fulfilled_event(&admin, USER_NS, "e2e-tenant").await?;
    ensure!(
        note.contains("tenant-oncall@example.com"),
        "the tenant's FulfilledThroughLink Event names the identity's recipients: {note}"
    );
    // Issue 56: a repair request answered through its link, by the page run apart (its
    // ServiceAccount reads and patches the MailgunRemediation). Made by hand, owned by no
    // Machine, its repair mail's record written as the provider's ServiceAccount and its link
    // minted as the provider mints them (the repair above went by the provider's own mail). The
    // provider believes no Machine for it: it sees the answer, stays `Pending`, mails nobody and
    // hands nothing back.
    let created = remediation::create_remediation(
        &admin,
        USER_NS,
        "e2e-repair",
        None,
        serde_json::json!({"request": "Power-cycle it."}),
    )
    .await?;
    let link = remediation::repair_link(&cp, &created, "capm.e2e.example.com", &page_url, LINK_KEY)
        .await?;
    let (status, answer) = capm_e2e::browser::fulfil_through_link(
        dir,
        &page_url,
        &link,
        &[
            ("result", "CannotRepair"),
            ("message", "The+board+is+burnt."),
        ],
    )?;
    ensure!(
        status == 200 && answer.contains("Answer recorded") && answer.contains("handed back"),
        "the repair link: HTTP {status}:\n{answer}\npage log:\n{}",
        page.proc.tail(20)
    );
    let stored = remediations.get("e2e-repair").await?;
    ensure!(
        stored.data["spec"]["answer"]
            == serde_json::json!({"result": "CannotRepair", "message": "The board is burnt."}),
        "{}",
        stored.data
    );
    capm_e2e::browser::link_event(&admin, USER_NS, "e2e-repair", "AnsweredThroughLink").await?;
    let seen = in_phase(&remediations, "e2e-repair", "Pending", |r| {
        capm_e2e::cert_manager::condition(r, "Answered").is_some_and(|(s, _)| s == "True")
    })
    .await?;
    ensure!(
        seen.data["status"]["handedBackAt"].is_null()
            && !smtp.messages()?.iter().any(|m| m
                .header("Subject")
                .is_some_and(|s| s.contains("e2e-repair"))),
        "the hand-made remediation was handed back or mailed: {}",
        seen.data["status"]
    );

    // The page's /metrics, as the provider's: the scraper's token reviewed.
    let (status, _) = https_get(&page.metrics, "/metrics", &scrape, true)?;
    ensure!(status == 200, "the page's metrics: HTTP {status}");
    let (status, _) = https_get(&page.metrics, "/metrics", &scrape, false)?;
    ensure!(
        status == 401,
        "the page's metrics without a token: HTTP {status}"
    );

    // RBAC, sufficient: nothing the provider asked for was denied. Minimal: everything the
    // chart grants was used (events patch by the repeated failure above), except what is
    // listed here with its reason.
    ensure!(
        provider.proc.terminate(Duration::from_secs(40)),
        "provider did not exit 0 on SIGTERM:\n{}",
        provider.proc.tail(20)
    );
    let username = provider_username();
    let requests = audited_requests(&audit_log, &username)?;
    let denied: Vec<_> = requests.iter().filter(|r| r.code == 403).collect();
    ensure!(
        denied.is_empty(),
        "the chart's RBAC denied the provider: {denied:#?}"
    );
    // Any answer but 403 means the permission was checked and granted (a 404 `get` of the
    // Lease before it exists included).
    let used: BTreeSet<_> = requests
        .iter()
        .filter(|r| r.code != 403)
        .map(|r| (r.group.clone(), r.resource.clone(), r.verb.clone()))
        .collect();
    let cluster_role = Api::<ClusterRole>::all(admin.clone())
        .get(&format!("{FULLNAME}-manager"))
        .await?;
    let role = Api::<Role>::namespaced(admin.clone(), NS)
        .get(&format!("{FULLNAME}-leader-election"))
        .await?;
    let diagnostics_role = Api::<ClusterRole>::all(admin.clone())
        .get(&format!("{FULLNAME}-diagnostics-auth"))
        .await?;
    let identities_role = Api::<ClusterRole>::all(admin.clone())
        .get(&format!("{FULLNAME}-identities"))
        .await?;
    let secrets_role = Api::<Role>::namespaced(admin.clone(), NS)
        .get(&format!("{FULLNAME}-identity-secrets"))
        .await?;
    let mut grants = granted(cluster_role.rules.as_deref().unwrap_or_default());
    grants.extend(granted(role.rules.as_deref().unwrap_or_default()));
    grants.extend(granted(
        diagnostics_role.rules.as_deref().unwrap_or_default(),
    ));
    grants.extend(granted(
        identities_role.rules.as_deref().unwrap_or_default(),
    ));
    grants.extend(granted(secrets_role.rules.as_deref().unwrap_or_default()));
    let not_exercised: BTreeMap<(&str, &str, &str), &str> = BTreeMap::from([
        (
            (INFRA, "mailgunclusters/finalizers", "update"),
            "checked by the OwnerReferencesPermissionEnforcement admission plugin (OpenShift enables it), not used by our merge patches",
        ),
        (
            (INFRA, "mailgunmachines/finalizers", "update"),
            "as for mailgunclusters/finalizers",
        ),
        (
            (INFRA, "mailgunremediations/finalizers", "update"),
            "as for mailgunclusters/finalizers",
        ),
    ]);
    let mut unused = Vec::new();
    for (group, resource, verb) in &grants {
        let was_used = used.contains(&(group.clone(), resource.clone(), verb.clone()));
        if !was_used
            && !not_exercised.contains_key(&(group.as_str(), resource.as_str(), verb.as_str()))
        {
            unused.push(format!("{verb} {resource}.{group}"));
        }
    }
    ensure!(
        unused.is_empty(),
        "granted but never used by the provider: {unused:?}\nused: {used:#?}"
    );

    // And what the chart does not grant is refused.
    let sa = format!("--kubeconfig={}", provider.kubeconfig.display());
    for args in [
        vec!["get", "secrets", "--all-namespaces"],
        // The identities' Secrets are watched (list, watch), never read one by one.
        vec!["get", "secret", "smtp-credentials", "-n", NS],
        vec!["get", "configmaps", "-n", USER_NS],
        vec!["delete", "mailgunclusters", "e2e", "-n", USER_NS],
        vec!["create", "namespace", "forbidden"],
        // Not `patch`: kubectl reads the object first, which the chart allows (the provider
        // reads an owner fresh before mailing), and answers NotFound for a missing one.
        vec!["delete", "clusters.cluster.x-k8s.io", "x", "-n", USER_NS],
        vec!["delete", "machines.cluster.x-k8s.io", "x", "-n", USER_NS],
    ] {
        let mut cmd = Command::new(capm_test_support::process::binary("kubectl")?);
        cmd.arg(&sa).args(&args).env_remove("KUBECONFIG");
        match capm_e2e::run(&mut cmd, &args.join(" ")) {
            Ok(out) => bail!(
                "`kubectl {}` as the provider succeeded: {out}",
                args.join(" ")
            ),
            Err(e) => ensure!(
                format!("{e:#}").contains("Forbidden"),
                "`kubectl {}`: {e:#}",
                args.join(" ")
            ),
        }
    }

    // The page's ServiceAccount: nothing denied, every permission its roles grant used, and
    // what they do not grant refused.
    ensure!(
        page.proc.terminate(Duration::from_secs(40)),
        "the page did not exit 0 on SIGTERM:\n{}",
        page.proc.tail(20)
    );
    let page_requests = audited_requests(
        &audit_log,
        &format!("system:serviceaccount:{NS}:{page_account}"),
    )?;
    let denied: Vec<_> = page_requests.iter().filter(|r| r.code == 403).collect();
    ensure!(
        denied.is_empty(),
        "the chart's RBAC denied the page: {denied:#?}"
    );
    let page_used: BTreeSet<_> = page_requests
        .iter()
        .map(|r| (r.group.clone(), r.resource.clone(), r.verb.clone()))
        .collect();
    let mut page_grants = BTreeSet::new();
    for role in [page_account.clone(), format!("{page_account}-identities")] {
        let role = Api::<ClusterRole>::all(admin.clone()).get(&role).await?;
        page_grants.extend(granted(role.rules.as_deref().unwrap_or_default()));
    }
    // The provider's diagnostics-auth ClusterRole, bound to the page's ServiceAccount too.
    let binding = Api::<k8s_openapi::api::rbac::v1::ClusterRoleBinding>::all(admin.clone())
        .get(&format!("{page_account}-diagnostics-auth"))
        .await?;
    ensure!(
        binding.role_ref.name == format!("{FULLNAME}-diagnostics-auth"),
        "{binding:?}"
    );
    ensure!(
        binding
            .subjects
            .iter()
            .flatten()
            .any(|s| s.name == page_account && s.namespace.as_deref() == Some(NS)),
        "the diagnostics-auth binding does not name the page: {binding:?}"
    );
    page_grants.extend(granted(
        diagnostics_role.rules.as_deref().unwrap_or_default(),
    ));
    let unused: Vec<_> = page_grants.difference(&page_used).collect();
    ensure!(
        unused.is_empty(),
        "granted to the page but never used: {unused:?}\nused: {page_used:#?}"
    );
    let more: Vec<_> = page_used.difference(&page_grants).collect();
    ensure!(
        more.is_empty(),
        "the page asked for more than it is granted: {more:?}"
    );
    println!("the page's ServiceAccount used exactly what it is granted: {page_used:?}");
    let sa = format!("--kubeconfig={}", page.kubeconfig.display());
    for args in [
        vec!["get", "secrets", "-n", NS],
        vec!["get", "secret", "capm-fulfilment-keys", "-n", NS],
        vec!["get", "secret", "smtp-credentials", "-n", NS],
        vec!["get", "leases", "-n", NS],
        vec!["get", "mailgunclusters", "-n", USER_NS],
        vec!["get", "mailgunclusteridentities", "e2e-tenant"],
        vec!["delete", "mailgunclusters", "e2e-tenant", "-n", USER_NS],
        vec![
            "get",
            "clusters.cluster.x-k8s.io",
            "e2e-tenant",
            "-n",
            USER_NS,
        ],
    ] {
        let mut cmd = Command::new(capm_test_support::process::binary("kubectl")?);
        cmd.arg(&sa).args(&args).env_remove("KUBECONFIG");
        match capm_e2e::run(&mut cmd, &args.join(" ")) {
            Ok(out) => bail!("`kubectl {}` as the page succeeded: {out}", args.join(" ")),
            Err(e) => ensure!(
                format!("{e:#}").contains("Forbidden"),
                "`kubectl {}` as the page: {e:#}",
                args.join(" ")
            ),
        }
    }
    let page_log = page.proc.log();
    ensure!(
        !page_log.contains(LINK_KEY) && !page_log.contains("ERROR"),
        "the page's log holds the key or an error:\n{}",
        page.proc.tail(40)
    );

    // Secrets never reach the logs.
    let log = provider.proc.log();
    // Logged in Cluster API's conventions (the chart's default JSON format): the object by
    // kind, its owner and its Cluster as top-level keys with `namespace/name` values.
    let removed: Vec<serde_json::Value> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| l["message"] == "Finalizer removed")
        .collect();
    for line in &removed {
        println!("log: {line}");
    }
    let cluster = format!("{USER_NS}/e2e");
    let machine = format!("{USER_NS}/e2e-cp-0");
    for (kind, owner_kind, object) in [
        ("MailgunCluster", "Cluster", &cluster),
        ("MailgunMachine", "Machine", &machine),
    ] {
        ensure!(
            removed.iter().any(|l| l[kind] == **object
                && l[owner_kind] == **object
                && l["Cluster"] == *cluster),
            "no \"Finalizer removed\" line with {kind}={object:?}, {owner_kind}={object:?}, \
             Cluster={cluster:?}: {removed:#?}"
        );
    }
    ensure!(
        !log.contains(smtp_password),
        "the SMTP password is in the provider's log"
    );
    ensure!(
        !log.contains("ERROR"),
        "errors in the provider's log:\n{}",
        provider.proc.tail(40)
    );
    drop(prometheus);
    drop(capi);
    cp.stop();
    Ok(())
}
