//! The Helm chart on its own: lint, values schema errors, a server-side dry run of its output,
//! an install into a namespace that enforces Pod Security "restricted", upgrade and uninstall.
//! Each cluster test starts its own control plane: the chart installs cluster-scoped CRDs.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use capm_e2e::{
    chart_dir,
    clusterctl::{LocalRepository, yaml_docs},
    eventually, helm, run_with_input,
};
use capm_test_support::{ControlPlane, Options};
use k8s_openapi::{
    api::{
        apps::v1::Deployment,
        core::v1::{Pod, Secret},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{Api, api::ListParams};
use serde::Deserialize as _;

fn ci_values(name: &str) -> String {
    chart_dir()
        .join("ci")
        .join(name)
        .to_string_lossy()
        .into_owned()
}

fn chart() -> String {
    chart_dir().to_string_lossy().into_owned()
}

#[test]
fn lint_is_clean_with_the_defaults_and_every_ci_values_file() -> Result<()> {
    // The defaults leave the required values empty: lint stays clean (Helm reports the chart's
    // `fail` instead of failing under lint), while rendering them is refused (next test).
    let chart = chart();
    let mailgun = ci_values("mailgun-values.yaml");
    let smtp = ci_values("smtp-values.yaml");
    let page = ci_values("page-values.yaml");
    for args in [
        vec!["lint", chart.as_str()],
        vec!["lint", "--strict", chart.as_str()],
        vec!["lint", "--strict", chart.as_str(), "-f", mailgun.as_str()],
        vec!["lint", "--strict", chart.as_str(), "-f", smtp.as_str()],
        vec!["lint", "--strict", chart.as_str(), "-f", page.as_str()],
    ] {
        let out = helm(None, &args)?;
        ensure!(
            out.contains("1 chart(s) linted, 0 chart(s) failed") && !out.contains("[WARNING]"),
            "{args:?}:\n{out}"
        );
    }
    Ok(())
}

/// Renders with `--set` values and returns the error text (the render must fail).
fn render_error(sets: &[&str]) -> String {
    let chart = chart();
    let mut args = vec!["template", "t", chart.as_str()];
    for set in sets {
        args.extend(["--set", set]);
    }
    match helm(None, &args) {
        Ok(out) => panic!("rendering with {sets:?} should fail, rendered:\n{out}"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn bad_values_are_refused_with_the_field_named() {
    // Nothing set: every missing value is named in one error.
    let err = render_error(&[]);
    assert!(err.contains("missing required values"), "{err}");
    assert!(err.contains("- mail.recipient:"), "{err}");
    assert!(err.contains("- mail.mailgun.domain:"), "{err}");
    assert!(err.contains("- mail.mailgun.apiKeySecret.name:"), "{err}");

    let ok = [
        "mail.recipient=ops@example.com",
        "mail.mailgun.domain=mg.example.com",
        "mail.mailgun.apiKeySecret.name=k",
    ];
    let with = |extra: &[&'static str]| {
        let mut v = ok.to_vec();
        v.extend_from_slice(extra);
        render_error(&v)
    };
    let err = with(&["mail.backend=sendmail"]);
    assert!(err.contains("/mail/backend"), "{err}");
    let err = with(&["replicaCount=-1"]);
    assert!(err.contains("/replicaCount"), "{err}");
    let err = with(&["recipient=ops@example.com"]);
    assert!(err.contains("recipient"), "unknown top-level key: {err}");
    let err = with(&["mail.backend=smtp"]);
    assert!(err.contains("- mail.smtp.url:"), "{err}");
    assert!(
        err.contains("- mail.from:"),
        "SMTP needs a sender on its domain: {err}"
    );
    assert!(!err.contains("- mail.mailgun"), "{err}");
    let err = with(&[
        "mail.backend=smtp",
        "mail.smtp.url=smtp://relay.example.com",
        "mail.smtp.username=capm",
    ]);
    assert!(err.contains("- mail.smtp.passwordSecret.name:"), "{err}");
    let err = with(&["fulfilment.url=https://capm.example.com"]);
    assert!(err.contains("/fulfilment/keysSecret/name"), "{err}");
    let err = with(&[
        "fulfilment.url=capm.example.com",
        "fulfilment.keysSecret.name=k",
    ]);
    assert!(err.contains("/fulfilment/url"), "{err}");
    // A NetworkPolicy for the page without peers would admit every client.
    let err = with(&[
        "fulfilment.url=https://capm.example.com",
        "fulfilment.keysSecret.name=k",
        "fulfilment.networkPolicy.enabled=true",
    ]);
    assert!(
        err.contains("fulfilment.networkPolicy.from must name"),
        "{err}"
    );
    // Issue 54: client addresses only from named proxies, and those only behind the policy.
    let page = [
        "fulfilment.url=https://capm.example.com",
        "fulfilment.keysSecret.name=k",
    ];
    let err = with(&[page[0], page[1], "fulfilment.ingress.enabled=true"]);
    assert!(
        err.contains("fulfilment.ingress.enabled needs fulfilment.trustedProxies"),
        "{err}"
    );
    let err = with(&[
        page[0],
        page[1],
        "fulfilment.trustedProxies={10.244.0.0/16}",
    ]);
    assert!(
        err.contains("fulfilment.trustedProxies needs fulfilment.networkPolicy.enabled=true"),
        "{err}"
    );
    let err = with(&["fulfilment.separateDeployment=true"]);
    assert!(
        err.contains("fulfilment.separateDeployment needs fulfilment.url"),
        "{err}"
    );
    let err = with(&[page[0], page[1], "fulfilment.trustForwardedFor=true"]);
    assert!(
        err.contains("fulfilment.trustForwardedFor was replaced by fulfilment.trustedProxies"),
        "{err}"
    );
    let err = with(&["leaderElection.enabled=false"]);
    assert!(
        err.contains("replicaCount > 1 needs leaderElection.enabled"),
        "{err}"
    );
    let err = with(&["mail.smtp.url=http://relay.example.com"]);
    assert!(err.contains("/mail/smtp/url"), "{err}");
}

/// `helm template` of the chart with the Mailgun CI values and `sets` (`--set`, or `--set-file`
/// for an item `@key=path`), written to `file`.
fn render_to(file: &std::path::Path, sets: &[&str]) -> Result<String> {
    let out = render_with("mailgun-values.yaml", sets)?;
    std::fs::write(file, &out)?;
    Ok(out)
}

/// `helm template` of the chart with the CI values file `values` and `sets` (as [`render_to`]).
fn render_with(values: &str, sets: &[&str]) -> Result<String> {
    let (chart, values) = (chart(), ci_values(values));
    let mut args = vec![
        "template",
        "capm",
        chart.as_str(),
        "-n",
        "capm-system",
        "-f",
        &values,
    ];
    for set in sets {
        match set.strip_prefix('@') {
            Some(file) => args.extend(["--set-file", file]),
            None => args.extend(["--set", set]),
        }
    }
    helm(None, &args)
}

/// `diff -u` of two renders: empty when they are identical.
fn diff(a: &std::path::Path, b: &std::path::Path) -> Result<String> {
    let out = std::process::Command::new("diff")
        .arg("-u")
        .arg(a)
        .arg(b)
        .output()
        .context("running diff")?;
    ensure!(
        out.status.code().is_some_and(|c| c <= 1),
        "diff failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[test]
fn gitops_settings_render_identically_twice() -> Result<()> {
    // What Argo CD and Flux (with post-renderers) do: `helm template`, no cluster to `lookup`.
    let work = tempfile::tempdir()?;
    let ca = capm_test_support::pki::CertificateAuthority::new("capm gitops test CA")?;
    let ca_file = work.path().join("ca.crt");
    std::fs::write(&ca_file, ca.cert_pem())?;
    let ca_set = format!("@webhook.caBundle={}", ca_file.display());
    let settings: [(&str, Vec<&str>); 2] = [
        ("cert-manager", vec!["webhook.certManager.enabled=true"]),
        (
            "own CA",
            vec![ca_set.as_str(), "webhook.certSecret=capm-webhook-tls"],
        ),
    ];
    for (name, sets) in &settings {
        let (a, b) = (work.path().join("a.yaml"), work.path().join("b.yaml"));
        let first = render_to(&a, sets)?;
        render_to(&b, sets)?;
        let d = diff(&a, &b)?;
        println!(
            "{name}: two renders, {} lines each, diff -u: {} lines",
            first.lines().count(),
            d.lines().count()
        );
        ensure!(d.is_empty(), "{name}: two renders differ:\n{d}");
        let docs = yaml_docs(&first)?;
        ensure!(
            !docs.iter().any(|d| d["kind"] == "Secret"),
            "{name}: the chart renders no Secret of its own"
        );
        let bundles: Vec<&serde_json::Value> = docs
            .iter()
            .filter(|d| d["kind"] == "CustomResourceDefinition")
            .filter_map(|d| d["spec"]["conversion"]["webhook"]["clientConfig"].get("caBundle"))
            .chain(
                docs.iter()
                    .filter(|d| d["kind"] == "ValidatingWebhookConfiguration")
                    .filter_map(|d| d["webhooks"][0]["clientConfig"].get("caBundle")),
            )
            .collect();
        let deployment = docs
            .iter()
            .find(|d| d["kind"] == "Deployment")
            .context("no Deployment")?;
        let volume = deployment["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .and_then(|v| v.iter().find(|v| v["name"] == "webhook-certs"))
            .context("no webhook-certs volume")?;
        if *name == "cert-manager" {
            // The cainjector fills the bundles in; the chart leaves them out (a diff Argo CD
            // must ignore otherwise: docs/configuration.md).
            ensure!(bundles.is_empty(), "{name}: caBundle rendered: {bundles:?}");
            ensure!(
                docs.iter().any(|d| d["kind"] == "Certificate"),
                "{name}: no Certificate"
            );
        } else {
            use base64::Engine as _;
            let want = base64::engine::general_purpose::STANDARD.encode(ca.cert_pem());
            ensure!(
                bundles.len() >= 2 && bundles.iter().all(|b| b.as_str() == Some(want.as_str())),
                "{name}: every conversion webhook and the webhook configuration carry the given CA: {bundles:?}"
            );
            ensure!(
                volume["secret"]["secretName"] == "capm-webhook-tls",
                "{name}: the Deployment mounts the given Secret: {volume}"
            );
        }
    }

    // The default (the chart's own self-signed CA, kept across upgrades by `lookup`) is not
    // for GitOps: without a cluster every render makes a new CA, which the diff shows.
    let (a, b) = (work.path().join("a.yaml"), work.path().join("b.yaml"));
    render_to(&a, &[])?;
    render_to(&b, &[])?;
    let d = diff(&a, &b)?;
    println!(
        "default self-signed: diff -u of two renders: {} lines",
        d.lines().count()
    );
    ensure!(
        d.contains("caBundle") && d.contains("tls.key"),
        "the default's renders were expected to differ in the CA and key:\n{d}"
    );

    // Half a CA, or both ways at once, is refused.
    for (sets, want) in [
        (vec![ca_set.as_str()], "- webhook.certSecret:"),
        (
            vec!["webhook.certSecret=capm-webhook-tls"],
            "- webhook.caBundle:",
        ),
        (
            vec![
                ca_set.as_str(),
                "webhook.certSecret=x",
                "webhook.certManager.enabled=true",
            ],
            "choose one",
        ),
    ] {
        let err = render_to(&work.path().join("refused.yaml"), &sets)
            .err()
            .with_context(|| format!("{sets:?} should be refused"))?;
        ensure!(format!("{err:#}").contains(want), "{sets:?}: {err:#}");
    }
    Ok(())
}

async fn control_plane() -> Result<ControlPlane> {
    Ok(ControlPlane::start(Options::default()).await?)
}

#[tokio::test(flavor = "multi_thread")]
async fn rendered_manifests_pass_a_server_side_dry_run() -> Result<()> {
    let cp = control_plane().await?;
    // smtp-values.yaml watches (and binds its role in) namespace `clusters`.
    for ns in ["capm-system", "clusters"] {
        cp.kubectl_output(&["create", "namespace", ns])?;
    }
    for values in [
        "mailgun-values.yaml",
        "smtp-values.yaml",
        "page-values.yaml",
    ] {
        // Without the `helm test` hook (its Pod names the hook's ServiceAccount, which a dry
        // run does not create): the Pods test runs `helm test`.
        let rendered = helm(
            None,
            &[
                "template",
                "capm",
                &chart(),
                "--skip-tests",
                "-n",
                "capm-system",
                "-f",
                &ci_values(values),
            ],
        )?;
        // cert-manager and prometheus-operator are not installed here: their objects are
        // checked for shape below, everything else by the API server.
        let mut ours = Vec::new();
        let mut foreign = Vec::new();
        for doc in serde_yaml_ng::Deserializer::from_str(&rendered) {
            let v = serde_json::Value::deserialize(doc)?;
            if v.is_null() {
                continue;
            }
            let api_version = v["apiVersion"].as_str().unwrap_or_default();
            if api_version.starts_with("cert-manager.io/")
                || api_version.starts_with("monitoring.coreos.com/")
            {
                foreign.push(v);
            } else {
                ours.push(v);
            }
        }
        dry_run_all(&cp, &ours, values)?;
        for kind in [
            "Deployment",
            "ClusterRole",
            "Role",
            "Service",
            "CustomResourceDefinition",
            "ValidatingWebhookConfiguration",
            "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding",
        ] {
            ensure!(
                ours.iter().any(|o| o["kind"] == kind),
                "{values}: no {kind} rendered"
            );
        }
        if values == "smtp-values.yaml" {
            let kinds: Vec<_> = foreign
                .iter()
                .map(|o| o["kind"].as_str().unwrap_or_default())
                .collect();
            ensure!(
                kinds.contains(&"Certificate")
                    && kinds.contains(&"Issuer")
                    && kinds.contains(&"ServiceMonitor")
                    && kinds.contains(&"PrometheusRule"),
                "cert-manager, ServiceMonitor and PrometheusRule objects expected, got {kinds:?}"
            );
            // The monitoring objects (accepted by the API server above): kube-state-metrics's
            // configuration and role, the dashboard for Grafana's sidecar, the alerts with the
            // configured wait.
            let named = |kind: &str, label: &str| {
                ours.iter()
                    .any(|o| o["kind"] == kind && o["metadata"]["labels"][label].is_string())
            };
            ensure!(named("ConfigMap", "kube-state-metrics/custom-resource"));
            // The fulfilment page: its Service and Ingress, its port, the machines' `get`.
            ensure!(
                ours.iter().any(|o| o["kind"] == "Ingress"
                    && o["spec"]["rules"][0]["http"]["paths"][0]["path"] == "/fulfil/"),
                "smtp-values.yaml: no fulfilment Ingress"
            );
            // Its paths hold links (bearer credentials): ingress-nginx logs none of them.
            ensure!(
                ours.iter().any(|o| o["kind"] == "Ingress"
                    && o["metadata"]["annotations"]["nginx.ingress.kubernetes.io/enable-access-log"]
                        == "false"),
                "smtp-values.yaml: the fulfilment Ingress keeps an access log of its links"
            );
            ensure!(
                ours.iter().any(|o| o["kind"] == "ClusterRole"
                    && o["rules"]
                        .as_array()
                        .into_iter()
                        .flatten()
                        .any(|r| r["resources"]
                            == serde_json::json!([
                                "mailgunclusters",
                                "mailgunmachines",
                                "mailgunremediations"
                            ])
                            && r["verbs"] == serde_json::json!(["get"]))),
                "smtp-values.yaml: the page may not read the objects links name"
            );
            // Its NetworkPolicy (accepted by the API server above): the page's port only from
            // the Ingress controller's namespace, the Pods' other ports as open as before.
            let policy = ours
                .iter()
                .find(|o| o["kind"] == "NetworkPolicy")
                .context("smtp-values.yaml: no fulfilment NetworkPolicy")?;
            let rules = &policy["spec"]["ingress"];
            ensure!(
                rules[0]["ports"] == serde_json::json!([{"port": "fulfilment", "protocol": "TCP"}])
                    && rules[0]["from"][0]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                        == "ingress-nginx"
                    && rules[1].get("from").is_none()
                    && rules[1]["ports"]
                        .as_array()
                        .is_some_and(|p| p.iter().any(|p| p["port"] == "webhook-server")
                            && p.iter().any(|p| p["port"] == "healthz")),
                "smtp-values.yaml: the NetworkPolicy's rules: {rules}"
            );
            ensure!(named(
                "ClusterRole",
                "kube-state-metrics/aggregate-to-manager"
            ));
            ensure!(named("ConfigMap", "grafana_dashboard"));
            let rule = foreign
                .iter()
                .find(|o| o["kind"] == "PrometheusRule")
                .context("PrometheusRule")?;
            ensure!(
                rule["spec"]["groups"][0]["rules"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|r| r["expr"].as_str().is_some_and(|e| e.contains("> 3600"))),
                "{rule}"
            );
            // The alerts read the provider's series only: the job and namespace the
            // ServiceMonitor and the PodMonitor give; each alert has its runbook.
            let selector =
                r#"job="capm-cluster-api-provider-mailgun-metrics", namespace="capm-system""#;
            let rules = rule["spec"]["groups"][0]["rules"]
                .as_array()
                .context("rules")?;
            ensure!(
                rules.iter().all(|r| r["annotations"]["runbook_url"]
                    .as_str()
                    .is_some_and(|u| u.contains("/docs/runbooks.md#capm"))),
                "{rule}"
            );
            // The others read kube-state-metrics's `capi_mailgun*` families (waiting for a
            // human, unanswered repairs, hand-backs not acted on), which carry no provider job.
            let (provider_rules, ksm): (Vec<_>, Vec<_>) = rules
                .iter()
                .filter_map(|r| r["expr"].as_str())
                .partition(|e| e.contains(selector));
            ensure!(
                provider_rules.len() + ksm.len() == rules.len()
                    && ksm.len() == 4
                    && ksm.iter().all(|e| e.contains("capi_mailgun")),
                "every rule selects {selector} but the four on kube-state-metrics's series: {rule}"
            );
            // Both monitors: `authorization` with the scraper's token Secret, TLS verified
            // against the chart's CA for the metrics Service's name; the job the rules select.
            let monitor = |kind: &str, endpoints: &str| -> Result<serde_json::Value> {
                let m = foreign
                    .iter()
                    .find(|o| o["kind"] == kind)
                    .with_context(|| format!("no {kind}"))?;
                Ok(m["spec"][endpoints][0].clone())
            };
            let sm = monitor("ServiceMonitor", "endpoints")?;
            let pm = monitor("PodMonitor", "podMetricsEndpoints")?;
            for endpoint in [&sm, &pm] {
                ensure!(
                    endpoint["scheme"] == "https"
                        && endpoint["bearerTokenFile"].is_null()
                        && endpoint["authorization"]["type"] == "Bearer"
                        && endpoint["authorization"]["credentials"]["name"]
                            == "capm-cluster-api-provider-mailgun-metrics-scraper-token"
                        && endpoint["tlsConfig"]["ca"]["secret"]["name"]
                            == "capm-cluster-api-provider-mailgun-webhook-cert"
                        && endpoint["tlsConfig"]["ca"]["secret"]["key"] == "ca.crt"
                        && endpoint["tlsConfig"]["serverName"]
                            == "capm-cluster-api-provider-mailgun-metrics.capm-system.svc"
                        && endpoint["tlsConfig"]["insecureSkipVerify"].is_null(),
                    "{endpoint}"
                );
            }
            ensure!(
                pm["relabelings"][0]["targetLabel"] == "job"
                    && pm["relabelings"][0]["replacement"]
                        == "capm-cluster-api-provider-mailgun-metrics",
                "{pm}"
            );
            ensure!(
                ours.iter().any(|o| o["kind"] == "Secret"
                    && o["type"] == "kubernetes.io/service-account-token"
                    && o["metadata"]["name"]
                        == "capm-cluster-api-provider-mailgun-metrics-scraper-token"),
                "the scraper's token Secret"
            );
            let cert = foreign
                .iter()
                .find(|o| o["kind"] == "Certificate")
                .context("Certificate")?;
            ensure!(
                cert["spec"]["dnsNames"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|n| n == "capm-cluster-api-provider-mailgun-metrics.capm-system.svc"),
                "the certificate names the metrics Service: {cert}"
            );
            ensure!(
                cert["spec"]["dnsNames"][0]
                    == "capm-cluster-api-provider-mailgun-webhook.capm-system.svc",
                "{cert}"
            );
            // With cert-manager the CRDs and the admission webhook get their CA injected
            // instead of a caBundle.
            for crd in ours.iter().filter(|o| {
                o["kind"] == "CustomResourceDefinition"
                    || o["kind"] == "ValidatingWebhookConfiguration"
            }) {
                ensure!(
                    crd["metadata"]["annotations"]["cert-manager.io/inject-ca-from"]
                        == "capm-system/capm-cluster-api-provider-mailgun-webhook-cert",
                    "{}",
                    crd["metadata"]["name"]
                );
            }
        }
    }
    cp.stop();
    Ok(())
}

async fn pods_of(api: &Api<Pod>) -> Result<Vec<Pod>> {
    Ok(api
        .list(&ListParams::default().labels("app.kubernetes.io/name=cluster-api-provider-mailgun"))
        .await?
        .items)
}

#[tokio::test(flavor = "multi_thread")]
async fn installs_into_a_restricted_namespace_upgrades_and_uninstalls() -> Result<()> {
    let cp = control_plane().await?;
    let kubeconfig = cp.kubeconfig().to_path_buf();
    let client = cp.client().await?;
    let ns = "capm-system";
    cp.kubectl_output(&["create", "namespace", ns])?;
    cp.kubectl_output(&[
        "label",
        "namespace",
        ns,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    ])?;
    cp.kubectl_output(&[
        "-n",
        ns,
        "create",
        "secret",
        "generic",
        "mailgun-api-key",
        "--from-literal=api-key=key-not-a-real-one",
    ])?;
    let install = |extra: &[&str]| -> Result<String> {
        let chart = chart();
        let values = ci_values("mailgun-values.yaml");
        let mut args = vec![
            "upgrade",
            "--install",
            "capm",
            &chart,
            "-n",
            ns,
            "-f",
            &values,
        ];
        args.extend_from_slice(extra);
        helm(Some(&kubeconfig), &args)
    };
    let notes = install(&[])?;
    ensure!(notes.contains("STATUS: deployed"), "{notes}");
    ensure!(
        notes.contains("kubectl -n capm-system rollout status"),
        "NOTES.txt: {notes}"
    );

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    let deployment = deployments.get("capm-cluster-api-provider-mailgun").await?;
    let spec = deployment.spec.context("spec")?;
    ensure!(spec.replicas == Some(2), "2 replicas by default");
    // There are no nodes here: Pods stay Pending, but the ReplicaSet controller can only create
    // them if Pod Security admission lets them in.
    let pods: Api<Pod> = Api::namespaced(client.clone(), ns);
    let created = eventually(Duration::from_secs(60), "2 Pods admitted", || async {
        let list = pods_of(&pods).await?;
        Ok((list.len() == 2).then_some(list))
    })
    .await?;
    for pod in &created {
        let c = &pod.spec.as_ref().context("pod spec")?.containers[0];
        ensure!(
            c.name == "manager",
            "clusterctl expects the container to be named manager"
        );
        let sc = c
            .security_context
            .as_ref()
            .context("container securityContext")?;
        ensure!(
            sc.read_only_root_filesystem == Some(true),
            "read-only root filesystem"
        );
        ensure!(
            c.resources
                .as_ref()
                .and_then(|r| r.limits.as_ref())
                .is_some(),
            "limits"
        );
        ensure!(
            c.liveness_probe.is_some() && c.readiness_probe.is_some(),
            "probes"
        );
    }
    // The namespace does enforce: a non-compliant variant of the same chart is refused.
    install(&["--set", "securityContext.allowPrivilegeEscalation=true"])?;
    let refused = eventually(Duration::from_secs(60), "a FailedCreate event", || async {
        let out = cp.kubectl_output(&[
            "-n",
            ns,
            "get",
            "events",
            "--field-selector",
            "reason=FailedCreate",
            "-o",
            "jsonpath={.items[*].message}",
        ])?;
        Ok(out
            .contains("violates PodSecurity \"restricted")
            .then_some(out))
    })
    .await?;
    ensure!(refused.contains("allowPrivilegeEscalation"), "{refused}");

    // Upgrades keep the webhook certificate, and the CRDs trust its CA.
    let secrets: Api<Secret> = Api::namespaced(client.clone(), ns);
    let secret_name = "capm-cluster-api-provider-mailgun-webhook-cert";
    let before = secrets.get(secret_name).await?.data.context("data")?;
    install(&["--set", "concurrency=5"])?;
    let after = secrets.get(secret_name).await?.data.context("data")?;
    ensure!(
        before == after,
        "helm upgrade rotated the webhook certificate"
    );
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = crds
        .get("mailgunclusters.infrastructure.cluster.x-k8s.io")
        .await?;
    let conversion = crd.spec.conversion.context("conversion")?;
    ensure!(conversion.strategy == "Webhook", "conversion strategy");
    let client_config = conversion
        .webhook
        .and_then(|w| w.client_config)
        .context("webhook clientConfig")?;
    ensure!(
        client_config.ca_bundle.map(|b| b.0) == after.get("ca.crt").map(|b| b.0.clone()),
        "the CRD's caBundle is not the webhook Secret's CA"
    );
    let svc = client_config.service.context("service")?;
    ensure!(
        svc.name == "capm-cluster-api-provider-mailgun-webhook" && svc.namespace == ns,
        "webhook service {svc:?}"
    );
    ensure!(
        crd.metadata
            .labels
            .unwrap_or_default()
            .get("cluster.x-k8s.io/v1beta2")
            == Some(&"v1beta1".to_owned()),
        "contract label"
    );

    // Uninstall removes the provider but keeps the CRDs (and with them every user object).
    helm(Some(&kubeconfig), &["uninstall", "capm", "-n", ns])?;
    ensure!(
        deployments
            .get_opt("capm-cluster-api-provider-mailgun")
            .await?
            .is_none(),
        "Deployment left after uninstall"
    );
    ensure!(
        crds.get_opt("mailgunclusters.infrastructure.cluster.x-k8s.io")
            .await?
            .is_some(),
        "uninstall deleted the CRDs"
    );
    cp.stop();
    Ok(())
}

/// `hack/check-clusterclass.sh` (`make lint-clusterctl`) passes the shipped ClusterClass file and
/// refuses one with a placeholder, one with a namespace and one without variables or patches.
#[test]
fn the_clusterclass_contract_check_refuses_placeholders_namespaces_and_missing_patches()
-> Result<()> {
    let script = chart_dir().join("../../hack/check-clusterclass.sh");
    let shipped = chart_dir().join("../../config/clusterctl/clusterclass-mailgun.yaml");
    let check = |file: &std::path::Path| {
        std::process::Command::new(&script)
            .arg(file)
            .output()
            .map(|o| {
                (
                    o.status.success(),
                    String::from_utf8_lossy(&o.stderr).into_owned(),
                )
            })
    };
    let (ok, err) = check(&shipped)?;
    ensure!(ok, "the shipped ClusterClass file fails the check:\n{err}");
    let text = std::fs::read_to_string(&shipped)?;
    let work = tempfile::tempdir()?;
    for (what, bad, expected) in [
        (
            "a placeholder",
            text.replace("name: mailgun\n", "name: ${CLASS_NAME}\n"),
            "${CLASS_NAME}",
        ),
        (
            "a namespace",
            text.replace(
                "  name: mailgun\n",
                "  name: mailgun\n  namespace: default\n",
            ),
            "namespace: default",
        ),
        (
            "no patches",
            text.replace("  patches:\n", "  unpatched:\n"),
            "no spec.patches",
        ),
    ] {
        ensure!(bad != text, "the edit for {what} changed nothing");
        let file = work.path().join("clusterclass-bad.yaml");
        std::fs::write(&file, &bad)?;
        let (ok, err) = check(&file)?;
        ensure!(
            !ok && err.contains(expected),
            "a file with {what} passes or is not named: {err}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn release_manifests_work_with_clusterctl_and_the_api_server() -> Result<()> {
    let work = tempfile::tempdir()?;
    // A clusterctl local repository: <base>/infrastructure-mailgun/<version>/<assets>.
    let repo = LocalRepository::new(work.path())?;
    let release = &repo.release;
    let version = format!("v{}", env!("CARGO_PKG_VERSION"));
    let metadata: serde_json::Value =
        serde_yaml_ng::from_str(&std::fs::read_to_string(release.join("metadata.yaml"))?)?;
    let series = metadata["releaseSeries"]
        .as_array()
        .context("releaseSeries")?;
    let (major, minor) = (
        env!("CARGO_PKG_VERSION_MAJOR").parse::<u64>()?,
        env!("CARGO_PKG_VERSION_MINOR").parse::<u64>()?,
    );
    ensure!(
        series
            .iter()
            .any(|s| s["major"] == major && s["minor"] == minor && s["contract"] == "v1beta2"),
        "metadata.yaml has no v1beta2 series for {version}: {metadata}"
    );
    // clusterctl's contract for ClusterClass files: no variables, no namespace.
    let class_file = std::fs::read_to_string(release.join("clusterclass-mailgun.yaml"))?;
    ensure!(
        !class_file.contains("${") && !class_file.contains("namespace:"),
        "clusterclass-mailgun.yaml uses a variable or sets a namespace"
    );
    let (config, provider) = (repo.config.clone(), repo.provider.clone());

    // clusterctl reads it: target namespace, the walkthrough's variables, our image.
    let describe = repo.clusterctl(
        &[
            "generate",
            "provider",
            "--infrastructure",
            &provider,
            "--config",
            &config,
            "--describe",
        ],
        &[],
    )?;
    ensure!(
        describe.contains("TargetNamespace:    capm-system"),
        "{describe}"
    );
    for var in [
        "MAILGUN_API_KEY",
        "MAILGUN_DOMAIN",
        "MAILGUN_REGION",
        "MAIL_RECIPIENT",
    ] {
        ensure!(
            describe.contains(&format!("  - {var}\n")),
            "variable {var}: {describe}"
        );
    }
    let vars = [
        ("MAIL_RECIPIENT", "ops@example.com"),
        ("MAILGUN_DOMAIN", "mg.example.com"),
        ("MAILGUN_API_KEY", "key-from-clusterctl"),
    ];
    let components = repo.clusterctl(
        &[
            "generate",
            "provider",
            "--infrastructure",
            &provider,
            "--config",
            &config,
        ],
        &vars,
    )?;
    ensure!(!components.contains("${"), "unsubstituted variables left");
    let docs = yaml_docs(&components)?;
    let namespaces: Vec<_> = docs.iter().filter(|d| d["kind"] == "Namespace").collect();
    ensure!(namespaces.len() == 1 && namespaces[0]["metadata"]["name"] == "capm-system");
    for doc in &docs {
        ensure!(
            doc["metadata"]["labels"]["cluster.x-k8s.io/provider"] == "infrastructure-mailgun",
            "{} {} lacks the provider label",
            doc["kind"],
            doc["metadata"]["name"]
        );
        ensure!(
            doc["metadata"]["labels"].get("helm.sh/chart").is_none(),
            "Helm labels left"
        );
    }
    let deployment = docs
        .iter()
        .find(|d| d["kind"] == "Deployment")
        .context("Deployment")?;
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    ensure!(container["name"] == "manager");
    let args: Vec<&str> = container["args"]
        .as_array()
        .context("args")?
        .iter()
        .filter_map(|a| a.as_str())
        .collect();
    ensure!(
        args.contains(&"--mail-recipient=ops@example.com")
            && args.contains(&"--mailgun-domain=mg.example.com")
            && args.contains(&"--mailgun-region=us"),
        "{args:?} (MAILGUN_REGION unset: us)"
    );
    // An EU account: MAILGUN_REGION=eu reaches the provider's flag.
    let vars_eu: Vec<_> = vars
        .iter()
        .copied()
        .chain([("MAILGUN_REGION", "eu")])
        .collect();
    let eu = repo.clusterctl(
        &[
            "generate",
            "provider",
            "--infrastructure",
            &provider,
            "--config",
            &config,
        ],
        &vars_eu,
    )?;
    ensure!(
        eu.contains("- --mailgun-region=eu") && !eu.contains("--mailgun-region=us"),
        "MAILGUN_REGION=eu is not the provider's region"
    );
    ensure!(
        components.contains("api-key: key-from-clusterctl"),
        "the API key Secret is filled from MAILGUN_API_KEY"
    );

    // The second asset, the fulfilment page apart from the keys, applied beside `clusterctl
    // init`: its variables, the page's grants exactly what the page does, and the provider's
    // own RBAC in the components no wider than the chart's default (config/rbac/rbac.yaml).
    let page_file = release.join("fulfilment-page-components.yaml");
    let page_file = page_file.to_string_lossy();
    let listed = repo.clusterctl(
        &["generate", "yaml", "--from", &page_file, "--list-variables"],
        &[],
    )?;
    for var in [
        "FULFILMENT_KEYS",
        "FULFILMENT_TRUSTED_PROXIES",
        "FULFILMENT_URL",
        "MAIL_RECIPIENT",
    ] {
        ensure!(listed.contains(var), "variable {var}: {listed}");
    }
    let page_yaml = repo.clusterctl(
        &["generate", "yaml", "--from", &page_file],
        &[
            ("FULFILMENT_URL", "https://capm.example.com"),
            (
                "FULFILMENT_KEYS",
                "a2V5LWZyb20tY2x1c3RlcmN0bC1vZi10aGlydHktdHdv",
            ),
            ("MAIL_RECIPIENT", "ops@example.com"),
        ],
    )?;
    ensure!(!page_yaml.contains("${"), "unsubstituted variables left");
    let page_docs = yaml_docs(&page_yaml)?;
    let page_sa = "capm-controller-manager-fulfilment";
    let page_grants: std::collections::BTreeSet<_> = granted_to(
        &[page_docs.clone(), docs.clone()].concat(),
        "capm-system",
        page_sa,
    )?
    .into_iter()
    .map(|(group, resource, verb, _)| (group, resource, verb))
    .collect();
    let want: std::collections::BTreeSet<_> = PAGE_RULES
        .iter()
        .map(|(g, r, v)| ((*g).to_owned(), (*r).to_owned(), (*v).to_owned()))
        .collect();
    ensure!(
        page_grants == want,
        "the clusterctl page's grants: {page_grants:#?}"
    );
    let page_args = deployment_container(&page_docs, page_sa)?["args"].to_string();
    ensure!(
        page_args.contains("--mode=fulfilment-page")
            && page_args.contains("--fulfilment-url=https://capm.example.com")
            && page_args.contains("--fulfilment-trusted-proxies=127.0.0.1\""),
        "{page_args}"
    );
    ensure!(
        page_docs.iter().all(|d| d["metadata"]["labels"]
            .get("cluster.x-k8s.io/provider")
            .is_none()),
        "the page's asset is the user's, not clusterctl's: no provider label"
    );
    let config_rbac = yaml_docs(&std::fs::read_to_string(
        chart_dir().join("../../config/rbac/rbac.yaml"),
    )?)?;
    let provider_sa = "capm-controller-manager";
    ensure!(
        granted_to(&docs, "capm-system", provider_sa)?
            == granted_to(&config_rbac, "capm-system", provider_sa)?,
        "the components' provider RBAC differs from config/rbac/rbac.yaml"
    );
    // The provider reads the links' settings from the asset's ConfigMap and Secret, optional.
    let manager = &deployment_container(&docs, provider_sa)?;
    let env = manager["env"].to_string();
    ensure!(
        env.contains("\"FULFILMENT_URL\"") && env.contains("\"optional\":true"),
        "{env}"
    );

    // The API server accepts it (cert-manager is not installed here: its objects are left out).
    let cp = ControlPlane::start(Options::default()).await?;
    cp.install_capi_crds().await?;
    let ours: Vec<_> = docs
        .iter()
        .filter(|d| {
            !d["apiVersion"]
                .as_str()
                .unwrap_or_default()
                .starts_with("cert-manager.io/")
        })
        .cloned()
        .collect();
    ensure!(
        docs.len() - ours.len() == 2,
        "a cert-manager Issuer and Certificate expected"
    );
    let mut kubectl = cp.kubectl()?;
    kubectl.args(["apply", "-f", "-"]);
    run_with_input(
        &mut kubectl,
        &serde_json::to_string(namespaces[0])?,
        "creating the namespace",
    )?;
    dry_run_all(&cp, &ours, "the components")?;
    dry_run_all(&cp, &page_docs, "the page's asset")?;

    // `clusterctl generate cluster` renders a Cluster + MailgunCluster, and a health check that
    // remediates by mail through its MailgunRemediationTemplate, which the API server accepts.
    let template = repo.generate_cluster(
        "hello",
        "",
        "default",
        &[],
        &[("MAILGUN_CLUSTER_REQUESTER", "me@example.com")],
    )?;
    let crds = chart_dir().join("files/crds");
    cp.kubectl_output(&["apply", "--server-side", "-f", &crds.to_string_lossy()])?;
    cp.kubectl_output(&[
        "wait",
        "--for=condition=established",
        "--timeout=60s",
        "-f",
        &crds.to_string_lossy(),
    ])?;
    let accepted = dry_run(&cp, &template, "the cluster template")?;
    expect_accepted(
        &accepted,
        &[
            "cluster.cluster.x-k8s.io/hello",
            "mailguncluster.infrastructure.cluster.x-k8s.io/hello",
            "machinehealthcheck.cluster.x-k8s.io/hello",
            "mailgunremediationtemplate.infrastructure.cluster.x-k8s.io/hello-repair",
        ],
    )?;
    let check = yaml_docs(&template)?
        .into_iter()
        .find(|d| d["kind"] == "MachineHealthCheck")
        .context("no MachineHealthCheck in the default flavor")?;
    ensure!(
        check["spec"]["remediation"]["templateRef"]["name"] == "hello-repair"
            && check["spec"]["checks"]["nodeStartupTimeoutSeconds"] == 259_200,
        "the default flavor's health check: {check}"
    );

    // `--flavor clusterclass`: a ClusterClass of our templates and the kubeadm providers', and
    // a topology Cluster, which the API server accepts (with the kubeadm template CRDs).
    let flavor = |env: &[(&str, &str)]| {
        repo.generate_cluster(
            "hello-class",
            "clusterclass",
            "default",
            &["--kubernetes-version", "v1.34.2"],
            env,
        )
    };
    let missing = flavor(&[]).expect_err("the requester is required");
    ensure!(
        format!("{missing:#}").contains("MAILGUN_CLUSTER_REQUESTER"),
        "{missing:#}"
    );
    let template = flavor(&[
        ("MAILGUN_CLUSTER_REQUESTER", "me@example.com"),
        ("MAILGUN_CLUSTER_PRIORITY", "BusinessCritical"),
        ("MAILGUN_CLUSTER_REQUEST", "Two racks, please"),
    ])?;
    let docs = yaml_docs(&template)?;
    let cluster = docs
        .iter()
        .find(|d| d["kind"] == "Cluster")
        .context("no Cluster")?;
    let variables: std::collections::BTreeMap<&str, &serde_json::Value> =
        cluster["spec"]["topology"]["variables"]
            .as_array()
            .context("the Cluster sets no topology variables")?
            .iter()
            .filter_map(|v| Some((v["name"].as_str()?, &v["value"])))
            .collect();
    let expected = serde_json::json!({
        "mailgunRequester": "me@example.com",
        "mailgunPriority": "BusinessCritical",
        "mailgunRequest": "Two racks, please",
        "mailgunMachineRequest": "One machine please",
    });
    ensure!(
        serde_json::to_value(&variables)? == expected,
        "the Cluster's variables: {variables:?}"
    );
    let class = docs
        .iter()
        .find(|d| d["kind"] == "ClusterClass")
        .context("clusterctl did not add the ClusterClass")?;
    ensure!(
        class["metadata"]["namespace"] == "default",
        "clusterctl puts the ClusterClass into the Cluster's namespace: {}",
        class["metadata"]
    );
    let declared: Vec<&str> = class["spec"]["variables"]
        .as_array()
        .context("the ClusterClass declares no variables")?
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    for name in variables.keys() {
        ensure!(
            declared.contains(name),
            "{name} is not a ClusterClass variable"
        );
    }
    let kubeadm = capm_test_support::process::bin_dir().join("capi-kubeadm-crds");
    cp.kubectl_output(&["apply", "--server-side", "-f", &kubeadm.to_string_lossy()])?;
    cp.kubectl_output(&[
        "wait",
        "--for=condition=established",
        "--timeout=60s",
        "-f",
        &kubeadm.to_string_lossy(),
    ])?;
    let accepted = dry_run(&cp, &template, "the clusterclass flavor")?;
    expect_accepted(
        &accepted,
        &[
            "clusterclass.cluster.x-k8s.io/mailgun",
            "mailgunclustertemplate.infrastructure.cluster.x-k8s.io/mailgun-cluster",
            "mailgunmachinetemplate.infrastructure.cluster.x-k8s.io/mailgun-machines",
            "kubeadmcontrolplanetemplate.controlplane.cluster.x-k8s.io/mailgun-control-plane",
            "kubeadmconfigtemplate.bootstrap.cluster.x-k8s.io/mailgun-workers",
            "mailgunremediationtemplate.infrastructure.cluster.x-k8s.io/mailgun-repair",
            "cluster.cluster.x-k8s.io/hello-class",
        ],
    )?;
    cp.stop();
    Ok(())
}

/// The page's ServiceAccount when run apart (`fulfilment.separateDeployment`), as the chart
/// names it for release `capm`.
const PAGE: &str = "capm-cluster-api-provider-mailgun-fulfilment";

/// Exactly what the page run apart may do (issue 54, item 7): get and patch the objects a link
/// names, get the Machine a MailgunMachine belongs to (the page names its Cluster and bootstrap
/// Secret), list identities (the Event names an identity's recipients), create its Event, and
/// review a scraper's token for /metrics. No Secret, no Lease, no status, no list or watch of
/// the objects.
const PAGE_RULES: [(&str, &str, &str); 11] = [
    ("infrastructure.cluster.x-k8s.io", "mailgunclusters", "get"),
    (
        "infrastructure.cluster.x-k8s.io",
        "mailgunclusters",
        "patch",
    ),
    ("infrastructure.cluster.x-k8s.io", "mailgunmachines", "get"),
    (
        "infrastructure.cluster.x-k8s.io",
        "mailgunmachines",
        "patch",
    ),
    (
        "infrastructure.cluster.x-k8s.io",
        "mailgunremediations",
        "get",
    ),
    (
        "infrastructure.cluster.x-k8s.io",
        "mailgunremediations",
        "patch",
    ),
    ("cluster.x-k8s.io", "machines", "get"),
    ("events.k8s.io", "events", "create"),
    (
        "infrastructure.cluster.x-k8s.io",
        "mailgunclusteridentities",
        "list",
    ),
    ("authentication.k8s.io", "tokenreviews", "create"),
    ("authorization.k8s.io", "subjectaccessreviews", "create"),
];

/// What the rendered `docs` grant the ServiceAccount `namespace`/`account`: (group, resource,
/// verb, where: `cluster` or the binding's namespace) for every rule of every role a binding
/// names it in; a rule's resourceNames follow its resource in brackets, a non-resource URL is
/// a resource of group "".
fn granted_to(
    docs: &[serde_json::Value],
    namespace: &str,
    account: &str,
) -> Result<std::collections::BTreeSet<(String, String, String, String)>> {
    let mut out = std::collections::BTreeSet::new();
    for binding in docs
        .iter()
        .filter(|d| d["kind"] == "RoleBinding" || d["kind"] == "ClusterRoleBinding")
    {
        let named = binding["subjects"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|s| {
                s["kind"] == "ServiceAccount" && s["name"] == account && s["namespace"] == namespace
            });
        if !named {
            continue;
        }
        let role_ref = &binding["roleRef"];
        let where_ = match binding["metadata"]["namespace"].as_str() {
            Some(ns) if binding["kind"] == "RoleBinding" => ns.to_owned(),
            _ => "cluster".to_owned(),
        };
        let role = docs
            .iter()
            .find(|d| {
                d["kind"] == role_ref["kind"]
                    && d["metadata"]["name"] == role_ref["name"]
                    && (d["kind"] == "ClusterRole"
                        || d["metadata"]["namespace"] == binding["metadata"]["namespace"])
            })
            .with_context(|| format!("the role {role_ref} is not rendered"))?;
        for rule in role["rules"].as_array().into_iter().flatten() {
            let list = |key: &str| -> Vec<String> {
                rule[key]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter_map(|v| v.as_str().map(str::to_owned))
                    .collect()
            };
            let names = list("resourceNames");
            let suffix = if names.is_empty() {
                String::new()
            } else {
                format!("[{}]", names.join(","))
            };
            for url in list("nonResourceURLs") {
                for verb in list("verbs") {
                    out.insert((String::new(), url.clone(), verb, where_.clone()));
                }
            }
            for group in list("apiGroups") {
                for resource in list("resources").iter().map(|r| format!("{r}{suffix}")) {
                    for verb in list("verbs") {
                        out.insert((group.clone(), resource.clone(), verb, where_.clone()));
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The container of the Deployment `name` in `docs`.
fn deployment_container<'a>(
    docs: &'a [serde_json::Value],
    name: &str,
) -> Result<&'a serde_json::Value> {
    docs.iter()
        .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == name)
        .map(|d| &d["spec"]["template"]["spec"]["containers"][0])
        .with_context(|| format!("no Deployment {name}"))
}

#[test]
fn the_page_apart_runs_under_a_service_account_granted_only_what_it_does() -> Result<()> {
    let render = |sets: &[&str]| yaml_docs(&render_with("page-values.yaml", sets)?);
    let provider = "capm-cluster-api-provider-mailgun";
    // Cluster-wide (no watchNamespace), and bound in the watched namespace only.
    for (watch, namespaced) in [(None, "cluster"), (Some("clusters"), "clusters")] {
        let set = watch.map(|ns| format!("watchNamespace={ns}"));
        let docs = render(
            set.as_slice()
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .as_slice(),
        )?;
        let grants = granted_to(&docs, "capm-system", PAGE)?;
        let want: std::collections::BTreeSet<_> = PAGE_RULES
            .iter()
            .map(|(group, resource, verb)| {
                let where_ = if *resource == "mailgunclusteridentities"
                    || group.ends_with("k8s.io") && group.starts_with("auth")
                {
                    "cluster"
                } else {
                    namespaced
                };
                (
                    (*group).to_owned(),
                    (*resource).to_owned(),
                    (*verb).to_owned(),
                    where_.to_owned(),
                )
            })
            .collect();
        for g in &grants {
            println!(
                "watch {watch:?}: {PAGE} may {} {}.{} ({})",
                g.2, g.1, g.0, g.3
            );
        }
        ensure!(
            grants == want,
            "watch {watch:?}: the page's ServiceAccount is granted\n{grants:#?}\nnot exactly\n{want:#?}"
        );
        let role = docs
            .iter()
            .find(|d| d["kind"] == "ClusterRole" && d["metadata"]["name"] == PAGE)
            .context("the page's ClusterRole")?;
        println!(
            "ClusterRole {PAGE}:\n{}",
            serde_yaml_ng::to_string(&role["rules"])?
        );

        // The page's Deployment: the page-only mode, its own ServiceAccount, the key volume
        // (0400) and nothing else mounted; no mail, leader election or webhook flag.
        let deployment = docs
            .iter()
            .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == PAGE)
            .context("the page's Deployment")?;
        let pod = &deployment["spec"]["template"]["spec"];
        ensure!(
            pod["serviceAccountName"] == PAGE,
            "{}",
            pod["serviceAccountName"]
        );
        let page = deployment_container(&docs, PAGE)?;
        let args: Vec<&str> = page["args"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str())
            .collect();
        ensure!(args.first() == Some(&"--mode=fulfilment-page"), "{args:?}");
        ensure!(
            args.contains(&"--fulfilment-bind-address=:8090")
                && args.contains(&"--fulfilment-trusted-proxies=10.244.0.0/16"),
            "{args:?}"
        );
        for refused in [
            "--mail-backend",
            "--mailgun",
            "--smtp",
            "--leader-elect",
            "--webhook",
            "--namespace",
        ] {
            ensure!(
                !args.iter().any(|a| a.starts_with(refused)),
                "the page is given {refused}: {args:?}"
            );
        }
        let volumes = pod["volumes"].as_array().context("volumes")?;
        ensure!(
            volumes.len() == 1
                && volumes[0]["secret"]["secretName"] == "capm-fulfilment-keys"
                && volumes[0]["secret"]["defaultMode"] == 0o400,
            "the page mounts only the links' keys, 0400: {volumes:?}"
        );
        // Its selector takes none of the provider's Pods, and the provider's none of its.
        let selector = &deployment["spec"]["selector"]["matchLabels"];
        let provider_deployment = docs
            .iter()
            .find(|d| d["kind"] == "Deployment" && d["metadata"]["name"] == provider)
            .context("the provider's Deployment")?;
        let provider_pod_labels = &provider_deployment["spec"]["template"]["metadata"]["labels"];
        let page_pod_labels = &deployment["spec"]["template"]["metadata"]["labels"];
        let matches = |selector: &serde_json::Value, labels: &serde_json::Value| {
            selector
                .as_object()
                .is_some_and(|s| s.iter().all(|(k, v)| labels[k] == *v))
        };
        ensure!(matches(selector, page_pod_labels) && !matches(selector, provider_pod_labels));
        let provider_selector = &provider_deployment["spec"]["selector"]["matchLabels"];
        ensure!(
            !matches(provider_selector, page_pod_labels),
            "{provider_selector}"
        );
        // The page's Service and NetworkPolicy select the page's Pods.
        for kind in ["Service", "NetworkPolicy"] {
            let object = docs
                .iter()
                .find(|d| d["kind"] == kind && d["metadata"]["name"] == PAGE)
                .with_context(|| format!("the page's {kind}"))?;
            let selector = if kind == "Service" {
                &object["spec"]["selector"]
            } else {
                &object["spec"]["podSelector"]["matchLabels"]
            };
            ensure!(
                selector == &deployment["spec"]["selector"]["matchLabels"],
                "{kind}: {selector}"
            );
        }

        // The provider still seals the links (the keys mounted, 0400) but serves no page, and
        // its role no longer reads the objects one by one.
        let manager = deployment_container(&docs, provider)?;
        let args: Vec<&str> = manager["args"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|a| a.as_str())
            .collect();
        ensure!(
            args.contains(&"--fulfilment-url=https://capm.example.com")
                && args.contains(&"--fulfilment-bind-address=0")
                && !args.iter().any(|a| a.starts_with("--mode")),
            "{args:?}"
        );
        ensure!(
            !manager["ports"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|p| p["name"] == "fulfilment"),
            "the provider still exposes the page's port"
        );
        let keys = provider_deployment["spec"]["template"]["spec"]["volumes"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|v| v["name"] == "fulfilment-keys")
            .context("the provider's key volume")?;
        ensure!(keys["secret"]["defaultMode"] == 0o400, "{keys}");
        let provider_grants = granted_to(&docs, "capm-system", provider)?;
        ensure!(
            !provider_grants
                .iter()
                .any(|(_, resource, verb, _)| resource.starts_with("mailgun") && verb == "get"),
            "the provider reads the objects one by one with the page apart: {provider_grants:#?}"
        );
    }

    // The page in the provider (the default): the provider's role reads the objects, and the
    // key volume is 0400 there too.
    let docs = render(&["fulfilment.separateDeployment=false"])?;
    ensure!(!docs.iter().any(|d| d["metadata"]["name"] == PAGE
        && d["kind"] != "Service"
        && d["kind"] != "Ingress"
        && d["kind"] != "NetworkPolicy"));
    let provider_grants = granted_to(&docs, "capm-system", provider)?;
    ensure!(provider_grants.contains(&(
        "infrastructure.cluster.x-k8s.io".into(),
        "mailgunclusters".into(),
        "get".into(),
        "cluster".into()
    )));
    let args = deployment_container(&docs, provider)?["args"].to_string();
    ensure!(args.contains("--fulfilment-bind-address=:8090"), "{args}");
    Ok(())
}

/// `kubectl apply --dry-run=server -o name` of `input` (YAML or JSON): the names the API server
/// accepted, one a line.
fn dry_run(cp: &ControlPlane, input: &str, what: &str) -> Result<String> {
    let mut kubectl = cp.kubectl()?;
    kubectl.args(["apply", "--dry-run=server", "-o", "name", "-f", "-"]);
    run_with_input(&mut kubectl, input, &format!("dry run of {what}"))
}

/// Every object of `names` (`kind.group/name`) is in a dry run's output `accepted`.
fn expect_accepted(accepted: &str, names: &[&str]) -> Result<()> {
    for name in names {
        ensure!(accepted.contains(name), "{name} not accepted: {accepted}");
    }
    Ok(())
}

/// [`dry_run`] of `items` as one List, each of which the API server must accept.
fn dry_run_all(cp: &ControlPlane, items: &[serde_json::Value], what: &str) -> Result<()> {
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
    let accepted = dry_run(cp, &list.to_string(), what)?;
    ensure!(
        accepted.lines().count() == items.len(),
        "{what}: {} objects rendered, the API server accepted:\n{accepted}",
        items.len()
    );
    Ok(())
}
