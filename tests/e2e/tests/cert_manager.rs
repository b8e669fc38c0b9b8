//! The chart with `webhook.certManager.enabled`, against a real cert-manager (issue 47, item 1):
//! cert-manager v1.21.1's controller and cainjector (built by `make tools`) on a local control
//! plane; `helm install` of the chart; the Certificate issued by the chart's self-signed Issuer;
//! its CA injected by the cainjector into every CRD's conversion webhook and into the
//! v1alpha1-writes webhook configuration; the provider (this build, run as the chart's Deployment
//! runs it) serving the issued certificate; a MailgunCluster written as v1beta1 read as
//! v1alpha1 through the webhook. Then a renewal: cert-manager issues a new certificate (and,
//! self-signed, a new CA), the cainjector adds the new CA to every bundle, the mounted Secret
//! changes (as the kubelet updates it), the same provider process serves the new certificate
//! and the API server converts through it: no restart.
//!
//! The cainjector of cert-manager 1.21 *merges* a renewed CA into the bundle
//! (`CAInjectorMerging`, GA and on by default): the bundle holds the old and the new CA until
//! the old one expires, so the API server trusts the webhook before and after the provider picks
//! up the new certificate. The checks therefore ask whether a bundle *contains* a CA.
use std::{
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};
use capm_e2e::{
    CHART_NAMESPACE as NS, FULLNAME, RELEASE,
    cert_manager::{self, CertManager},
    create_cluster_pair, create_namespace, create_secret, dynamic_api, eventually, helm_chart,
    mailgun_values, refresh_secret_mounts, start_routed_chart_provider,
};
use capm_mail_servers::MailgunServer;
use capm_test_support::{ControlPlane, Options};
use k8s_openapi::{
    ByteString,
    api::{admissionregistration::v1::ValidatingWebhookConfiguration, core::v1::Secret},
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
};
use kube::{Api, Client, api::ListParams};

const USER_NS: &str = "team-a";
const DOMAIN: &str = "mg.cert-manager.example.com";
const SECRET: &str = "capm-cluster-api-provider-mailgun-webhook-cert";
const GROUP: &str = "infrastructure.cluster.x-k8s.io";

/// The certificates of a PEM text, each without line breaks (for comparing).
fn pem_certificates(text: &str) -> Vec<String> {
    text.split("-----END CERTIFICATE-----")
        .filter_map(|part| part.find("-----BEGIN CERTIFICATE-----").map(|i| &part[i..]))
        .map(|cert| cert.chars().filter(|c| !c.is_whitespace()).collect())
        .collect()
}

/// Whether the PEM bundle `bundle` holds every certificate of the PEM text `ca`.
fn bundle_holds(bundle: &[u8], ca: &str) -> bool {
    let held = pem_certificates(&String::from_utf8_lossy(bundle));
    let wanted = pem_certificates(ca);
    !wanted.is_empty() && wanted.iter().all(|c| held.contains(c))
}

/// Where each injected CA bundle stands: (object, whether its bundle holds `ca`).
async fn injected(client: &Client, ca: &str) -> Result<Vec<(String, bool)>> {
    let mut out = Vec::new();
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in crds.list(&ListParams::default()).await?.items {
        if crd.spec.group != GROUP {
            continue;
        }
        let Some(webhook) = crd
            .spec
            .conversion
            .as_ref()
            .and_then(|c| c.webhook.as_ref())
        else {
            continue;
        };
        let bundle = webhook
            .client_config
            .as_ref()
            .and_then(|c| c.ca_bundle.as_ref());
        out.push((
            format!("CRD {}", crd.metadata.name.unwrap_or_default()),
            bundle.is_some_and(|ByteString(b)| bundle_holds(b, ca)),
        ));
    }
    let configs: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let config = configs.get(&format!("{FULLNAME}-v1alpha1-writes")).await?;
    for webhook in config.webhooks.unwrap_or_default() {
        out.push((
            format!("ValidatingWebhookConfiguration webhook {}", webhook.name),
            webhook
                .client_config
                .ca_bundle
                .as_ref()
                .is_some_and(|ByteString(b)| bundle_holds(b, ca)),
        ));
    }
    Ok(out)
}

/// Waits until the bundle of every CRD conversion webhook of our group (at least one) and of the
/// webhook configuration holds `ca`.
async fn wait_injected(client: &Client, ca: &str, what: &str) -> Result<Vec<String>> {
    eventually(Duration::from_secs(90), what, || async {
        let all = injected(client, ca).await?;
        let crds = all.iter().filter(|(o, _)| o.starts_with("CRD ")).count();
        let ok = crds > 0 && all.len() > crds && all.iter().all(|(_, ok)| *ok);
        Ok(ok.then(|| all.into_iter().map(|(o, _)| o).collect()))
    })
    .await
}

/// The first certificate of a PEM text, without line breaks (for comparing).
fn first_pem(text: &str) -> Result<String> {
    pem_certificates(text)
        .into_iter()
        .next()
        .context("no certificate in PEM text")
}

/// The certificate the provider's webhook serves on `port`, as `openssl s_client` sees it.
fn served_certificate(port: u16) -> Result<String> {
    let out = Command::new("openssl")
        .args([
            "s_client",
            "-connect",
            &format!("127.0.0.1:{port}"),
            "-servername",
            &format!("{FULLNAME}-webhook.{NS}.svc"),
        ])
        .stdin(std::process::Stdio::null())
        .output()
        .context("running openssl s_client")?;
    first_pem(&String::from_utf8_lossy(&out.stdout))
}

/// Reads the MailgunCluster `name` through v1alpha1 (the API server converts it through the
/// webhook) until that works; returns the apiVersion it came back as.
async fn read_as_v1alpha1(client: &Client, name: &str, what: &str) -> Result<String> {
    let old = dynamic_api(client, USER_NS, GROUP, "v1alpha1", "MailgunCluster");
    let converted = eventually(Duration::from_secs(60), what, || async {
        Ok(old.get(name).await.ok())
    })
    .await?;
    Ok(converted.types.map(|t| t.api_version).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chart_webhook_certificate_from_cert_manager() -> Result<()> {
    let work = tempfile::tempdir()?;
    let dir = work.path();
    let cp = ControlPlane::start(Options::default()).await?;
    cp.install_capi_crds().await?;
    let admin = cp.client().await?;

    let t0 = Instant::now();
    let cm = CertManager::start(cp.kubeconfig(), dir)?;
    cp.adopt(cm.controller.pid())?;
    cp.adopt(cm.cainjector.pid())?;
    println!(
        "cert-manager: CRDs served, controller and cainjector started in {:.1} s",
        t0.elapsed().as_secs_f64()
    );

    // The chart as a user installs it beside cert-manager.
    let mailgun = MailgunServer::start("key-cert-manager-e2e", DOMAIN)?;
    create_namespace(&admin, NS, true).await?;
    create_namespace(&admin, USER_NS, false).await?;
    create_secret(
        &admin,
        NS,
        "mailgun-credentials",
        &[("api-key", mailgun.api_key())],
    )
    .await?;
    let values = dir.join("values.yaml");
    std::fs::write(
        &values,
        format!(
            "{}webhook:\n  certManager:\n    enabled: true\n",
            mailgun_values("ops@example.com", DOMAIN, &mailgun.base_url())
        ),
    )?;
    let t0 = Instant::now();
    helm_chart(cp.kubeconfig(), "install", RELEASE, NS, &values, &[])?;

    // 1. Issued.
    let cert = cert_manager::wait_issued(&admin, NS, SECRET, 1, Duration::from_secs(120))
        .await
        .with_context(|| format!("cert-manager-controller log:\n{}", cm.controller.tail(30)))?;
    println!(
        "Certificate {SECRET} Ready ({:?}), revision {}, {:.1} s after helm install",
        cert_manager::condition(&cert, "Ready"),
        cert.data["status"]["revision"],
        t0.elapsed().as_secs_f64()
    );
    let secrets: Api<Secret> = Api::namespaced(admin.clone(), NS);
    let secret = secrets.get(SECRET).await?;
    let (ca1, tls1) = (
        cert_manager::secret_text(&secret, "ca.crt")?,
        cert_manager::secret_text(&secret, "tls.crt")?,
    );
    ensure!(
        secret.type_.as_deref() == Some("kubernetes.io/tls"),
        "the Secret's type: {:?}",
        secret.type_
    );

    // 2. The CA injected into the CRDs' conversion webhooks and the webhook configuration.
    let objects = wait_injected(&admin, &ca1, "the CA injected")
        .await
        .with_context(|| format!("cainjector log:\n{}", cm.cainjector.tail(30)))?;
    println!(
        "CA injected, {:.1} s after helm install, into: {objects:?}",
        t0.elapsed().as_secs_f64()
    );

    // 3. The provider serves the issued certificate, and a v1alpha1 read converts through it.
    let provider = start_routed_chart_provider(&cp, &admin, NS, FULLNAME, dir).await?;
    cp.adopt(provider.proc.pid())?;
    let port = provider.webhook_port;
    eventually(
        Duration::from_secs(30),
        "the webhook serving the issued certificate",
        || async { Ok((served_certificate(port).ok() == Some(first_pem(&tls1)?)).then_some(())) },
    )
    .await
    .with_context(|| format!("provider log:\n{}", provider.proc.tail(30)))?;
    create_cluster_pair(&admin, USER_NS, "first", "cert-manager@example.com").await?;
    let version = read_as_v1alpha1(&admin, "first", "a v1alpha1 read through the webhook").await?;
    ensure!(
        version.ends_with("/v1alpha1"),
        "conversion answered {version}"
    );
    println!("read as {version} through the webhook with cert-manager's certificate");

    // 4. A renewal, picked up by the same process.
    let pid = provider.proc.pid();
    let t0 = Instant::now();
    cert_manager::renew(&admin, NS, SECRET).await?;
    let cert = cert_manager::wait_issued(&admin, NS, SECRET, 2, Duration::from_secs(120))
        .await
        .with_context(|| format!("cert-manager-controller log:\n{}", cm.controller.tail(30)))?;
    let secret = secrets.get(SECRET).await?;
    let (ca2, tls2) = (
        cert_manager::secret_text(&secret, "ca.crt")?,
        cert_manager::secret_text(&secret, "tls.crt")?,
    );
    ensure!(
        tls2 != tls1,
        "the renewal left the same certificate in the Secret"
    );
    println!(
        "renewed: revision {}, {:.1} s after asking; new CA: {}",
        cert.data["status"]["revision"],
        t0.elapsed().as_secs_f64(),
        ca2 != ca1
    );
    ensure!(ca2 != ca1, "the renewal kept the CA");
    let objects = wait_injected(&admin, &ca2, "the renewed CA injected")
        .await
        .with_context(|| format!("cainjector log:\n{}", cm.cainjector.tail(30)))?;
    let old_kept = injected(&admin, &ca1).await?.iter().all(|(_, ok)| *ok);
    println!(
        "renewed CA injected, {:.1} s after asking, into: {objects:?}; the old CA kept beside it: {old_kept}",
        t0.elapsed().as_secs_f64()
    );
    // The kubelet updates the mounted Secret; here the test writes it as the kubelet would.
    refresh_secret_mounts(&admin, NS, FULLNAME, dir).await?;
    eventually(
        Duration::from_secs(30),
        "the webhook serving the renewed certificate",
        || async { Ok((served_certificate(port).ok() == Some(first_pem(&tls2)?)).then_some(())) },
    )
    .await
    .with_context(|| format!("provider log:\n{}", provider.proc.tail(30)))?;
    provider.proc.check_alive()?;
    ensure!(provider.proc.pid() == pid, "the provider was restarted");
    let log = provider.proc.log();
    ensure!(
        log.contains("Reloaded a serving certificate"),
        "the provider did not log the reload:\n{}",
        provider.proc.tail(30)
    );
    println!(
        "renewed certificate served {:.1} s after asking, same process (pid {pid})",
        t0.elapsed().as_secs_f64()
    );
    // The API server converts through the renewed certificate, trusting the injected bundle.
    create_cluster_pair(&admin, USER_NS, "second", "cert-manager@example.com").await?;
    for name in ["first", "second"] {
        let version = read_as_v1alpha1(&admin, name, "a v1alpha1 read after the renewal").await?;
        ensure!(
            version.ends_with("/v1alpha1"),
            "conversion of {name} after the renewal answered {version}"
        );
    }
    println!("read as v1alpha1 through the webhook serving the renewed certificate");
    cm.check_alive()?;
    Ok(())
}
