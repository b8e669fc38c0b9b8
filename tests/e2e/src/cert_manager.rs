//! A real cert-manager (v1.21.1: its controller and cainjector, built by `make tools` from the
//! source snapshot `hack/tools/build.sh` names) run as processes against a local control plane,
//! with its CRDs from the same snapshot. cert-manager's own admission webhook is not run: it
//! validates and defaults cert-manager's objects, which the tests write correctly; nothing here
//! depends on it (clusterctl's check that cert-manager is there only creates a test Issuer and
//! Certificate).

use std::{path::Path, process::Command, time::Duration};

use anyhow::{Context, Result, ensure};
use capm_test_support::process;
use k8s_openapi::ByteString;
use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, GroupVersionKind, PostParams},
};

use crate::{Proc, eventually, free_port};

/// The cert-manager controller and cainjector, stopped when dropped.
#[derive(Debug)]
pub struct CertManager {
    /// `cert-manager-controller`: issues Certificates into Secrets.
    pub controller: Proc,
    /// `cert-manager-cainjector`: copies a Certificate's CA into CRDs and webhook configurations
    /// annotated `cert-manager.io/inject-ca-from`.
    pub cainjector: Proc,
}

impl CertManager {
    /// Applies cert-manager's CRDs (`bin/cert-manager-crds`), waits until they are served and
    /// starts the controller and the cainjector with `kubeconfig` (an admin's: cert-manager's own
    /// RBAC is its chart's business, not what these tests check), logs in `dir`.
    ///
    /// # Errors
    /// When the binaries are missing (`make tools`), kubectl fails or a process cannot start.
    pub fn start(kubeconfig: &Path, dir: &Path) -> Result<Self> {
        let controller_bin = process::binary("cert-manager-controller")?;
        let cainjector_bin = process::binary("cert-manager-cainjector")?;
        let crds = process::bin_dir().join("cert-manager-crds");
        ensure!(
            crds.is_dir(),
            "{} not found: run `make tools`",
            crds.display()
        );
        let kubectl = process::binary("kubectl")?;
        let crds = crds.to_string_lossy().into_owned();
        crate::run(
            Command::new(&kubectl).env("KUBECONFIG", kubeconfig).args([
                "apply",
                "--server-side",
                "-f",
                &crds,
            ]),
            "kubectl apply cert-manager's CRDs",
        )?;
        crate::run(
            Command::new(&kubectl).env("KUBECONFIG", kubeconfig).args([
                "wait",
                "--for=condition=Established",
                "--timeout=60s",
                "-f",
                &crds,
            ]),
            "kubectl wait for cert-manager's CRDs",
        )?;
        let kubeconfig_path = kubeconfig;
        let kubeconfig = format!("--kubeconfig={}", kubeconfig.display());
        let mut controller = Command::new(controller_bin);
        controller.args([
            kubeconfig.as_str(),
            "--leader-elect=false",
            "--cluster-resource-namespace=kube-system",
            &format!("--metrics-listen-address=127.0.0.1:{}", free_port()?),
            &format!(
                "--internal-healthz-listen-address=127.0.0.1:{}",
                free_port()?
            ),
        ]);
        let controller = Proc::spawn(
            "cert-manager-controller",
            controller,
            dir.join("cert-manager-controller.log"),
        )?;
        let mut cainjector = Command::new(cainjector_bin);
        // Its client is controller-runtime's, which reads KUBECONFIG (the flag alone is not used).
        cainjector.env("KUBECONFIG", kubeconfig_path);
        cainjector.args([
            kubeconfig.as_str(),
            "--leader-elect=false",
            &format!("--metrics-listen-address=127.0.0.1:{}", free_port()?),
        ]);
        let cainjector = Proc::spawn(
            "cert-manager-cainjector",
            cainjector,
            dir.join("cert-manager-cainjector.log"),
        )?;
        Ok(Self {
            controller,
            cainjector,
        })
    }

    /// Fails when either process has exited.
    ///
    /// # Errors
    /// When one exited, with the end of its log.
    pub fn check_alive(&self) -> Result<()> {
        self.controller.check_alive()?;
        self.cainjector.check_alive()
    }
}

/// The API of cert-manager's `Certificate`s in `namespace`.
pub fn certificates(client: &Client, namespace: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("cert-manager.io", "v1", "Certificate");
    Api::namespaced_with(client.clone(), namespace, &ApiResource::from_gvk(&gvk))
}

/// The status condition `kind` of a cert-manager object, as (status, reason).
pub fn condition(object: &DynamicObject, kind: &str) -> Option<(String, String)> {
    object.data["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
        .map(|c| {
            (
                c["status"].as_str().unwrap_or_default().to_owned(),
                c["reason"].as_str().unwrap_or_default().to_owned(),
            )
        })
}

/// Waits until the Certificate `name` is `Ready=True` with `status.revision` at least
/// `revision`; returns it.
///
/// # Errors
/// On timeout, with the Certificate's conditions.
pub async fn wait_issued(
    client: &Client,
    namespace: &str,
    name: &str,
    revision: u64,
    timeout: Duration,
) -> Result<DynamicObject> {
    let api = certificates(client, namespace);
    eventually(
        timeout,
        &format!("Certificate {namespace}/{name} Ready at revision {revision}"),
        || async {
            let cert = api.get(name).await?;
            let ready = condition(&cert, "Ready").is_some_and(|(s, _)| s == "True");
            let at = cert.data["status"]["revision"].as_u64().unwrap_or(0);
            Ok((ready && at >= revision).then_some(cert))
        },
    )
    .await
}

/// Asks cert-manager to renew the Certificate `name` now, the way `cmctl renew` does: an
/// `Issuing=True` condition (reason `ManuallyTriggered`) in its status.
///
/// # Errors
/// When the API server refuses the status write.
pub async fn renew(client: &Client, namespace: &str, name: &str) -> Result<()> {
    let api = certificates(client, namespace);
    let mut cert = api.get_status(name).await?;
    let conditions = cert.data["status"]["conditions"]
        .as_array_mut()
        .context("the Certificate has no conditions yet")?;
    conditions.retain(|c| c["type"] != "Issuing");
    let generation = cert.metadata.generation.unwrap_or(1);
    conditions.push(serde_json::json!({
        "type": "Issuing",
        "status": "True",
        "reason": "ManuallyTriggered",
        "message": "renewal asked for by the test",
        "lastTransitionTime": jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%SZ").to_string(),
        "observedGeneration": generation,
    }));
    api.replace_status(name, &PostParams::default(), &cert)
        .await?;
    Ok(())
}

/// The value of `key` in a Secret's data, as text.
///
/// # Errors
/// When the key is missing or not UTF-8.
pub fn secret_text(secret: &k8s_openapi::api::core::v1::Secret, key: &str) -> Result<String> {
    let ByteString(bytes) = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .with_context(|| format!("no {key} in Secret {:?}", secret.metadata.name))?;
    Ok(String::from_utf8(bytes.clone())?)
}
