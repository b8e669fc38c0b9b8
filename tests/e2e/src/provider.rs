//! The provider from this build run exactly as the chart's Deployment runs it (its arguments, its
//! mounted Secrets, a token of its ServiceAccount), and the human who fulfils its mails.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};
use capm_test_support::provider::Launch;
use k8s_openapi::{
    ByteString,
    api::{
        apps::v1::Deployment,
        core::v1::{ConfigMap, Secret},
    },
};
use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, GroupVersionKind, PostParams},
};

use crate::{Proc, free_port, host_ip, provider_binary};

/// Writes what the kubelet would mount for the Deployment's Secret volumes into `dir` and
/// returns (mountPath, local dir) pairs.
async fn emulate_secret_mounts(
    client: &Client,
    namespace: &str,
    deployment: &Deployment,
    dir: &Path,
) -> Result<Vec<(String, PathBuf)>> {
    let pod = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .context("pod template")?;
    let container = &pod.containers[0];
    let secrets: Api<Secret> = Api::namespaced(client.clone(), namespace);
    let mut mounts = Vec::new();
    for mount in container.volume_mounts.as_deref().unwrap_or_default() {
        let volume = pod
            .volumes
            .as_deref()
            .unwrap_or_default()
            .iter()
            .find(|v| v.name == mount.name)
            .context("volume of a mount")?;
        let source = volume
            .secret
            .as_ref()
            .context("only Secret volumes are expected")?;
        let name = source.secret_name.as_deref().context("secretName")?;
        let secret = match secrets.get_opt(name).await? {
            Some(secret) => secret,
            // As the kubelet: an optional volume of a missing Secret is not mounted.
            None if source.optional == Some(true) => continue,
            None => anyhow::bail!(
                "Secret {namespace}/{name} of volume {} not found",
                mount.name
            ),
        };
        let data = secret.data.unwrap_or_default();
        let local = dir.join("mounts").join(&mount.name);
        fs::create_dir_all(&local)?;
        // Without items, every key is a file of its own name.
        let items: Vec<(String, String)> = match source.items.as_deref() {
            Some(items) => items
                .iter()
                .map(|i| (i.key.clone(), i.path.clone()))
                .collect(),
            None => data.keys().map(|k| (k.clone(), k.clone())).collect(),
        };
        for (key, path) in items {
            let ByteString(bytes) = data
                .get(&key)
                .with_context(|| format!("key {key} in Secret of volume {}", mount.name))?;
            // As the kubelet updates a Secret volume: a new file put in place in one step.
            let tmp = local.join(format!(".{path}.tmp"));
            fs::write(&tmp, bytes)?;
            fs::rename(&tmp, local.join(&path))?;
        }
        mounts.push((mount.mount_path.clone(), local));
    }
    Ok(mounts)
}

/// Writes the current content of the Deployment `deployment`'s Secret volumes into the mounts
/// [`start_chart_provider`] emulated in `dir`, as the kubelet does when a mounted Secret changes
/// (it does so within its sync period, about a minute; here at once).
///
/// # Errors
/// When the Deployment or its Secrets cannot be read.
pub async fn refresh_secret_mounts(
    client: &Client,
    namespace: &str,
    deployment: &str,
    dir: &Path,
) -> Result<()> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let deployment = deployments.get(deployment).await?;
    emulate_secret_mounts(client, namespace, &deployment, dir).await?;
    Ok(())
}

/// The provider, run from this build with the chart Deployment's arguments.
#[derive(Debug)]
pub struct ChartProvider {
    /// The process.
    pub proc: Proc,
    /// Where its diagnostics endpoint (`/metrics`) listens.
    pub metrics: String,
    /// Its webhook port (on every address).
    pub webhook_port: u16,
    /// The arguments the chart gives the container.
    pub chart_args: Vec<String>,
    /// The kubeconfig it authenticates with.
    pub kubeconfig: PathBuf,
}

/// Starts the provider with the arguments of the Deployment `deployment` in `namespace` (as
/// `helm install` rendered it): mount paths mapped to emulated mounts in `dir`, listeners moved to
/// free ports, authenticated by `kubeconfig` (e.g. [`crate::service_account_kubeconfig`]).
///
/// # Errors
/// When the Deployment or its Secrets cannot be read, or the process cannot start.
pub async fn start_chart_provider(
    client: &Client,
    namespace: &str,
    deployment: &str,
    kubeconfig: &Path,
    dir: &Path,
) -> Result<ChartProvider> {
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    let deployment = deployments.get(deployment).await?;
    let mounts = emulate_secret_mounts(client, namespace, &deployment, dir).await?;
    let chart_args = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .and_then(|p| p.containers[0].args.clone())
        .context("container args")?;
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let webhook_port = free_port()?;
    // A path under a mount, moved to the emulated mount.
    let mounted = |value: &str| {
        mounts
            .iter()
            .find(|(path, _)| value == path || value.starts_with(&format!("{path}/")))
            .map(|(path, local)| value.replacen(path.as_str(), &local.to_string_lossy(), 1))
            .unwrap_or_else(|| value.to_owned())
    };
    let mut args = Vec::new();
    for arg in &chart_args {
        let (flag, value) = arg.split_once('=').unwrap_or((arg, ""));
        let value = match flag {
            "--diagnostics-address" => metrics.clone(),
            "--health-probe-bind-address" => format!("127.0.0.1:{}", free_port()?),
            "--webhook-port" => webhook_port.to_string(),
            // The chart's port kept (the public URL the test gave names it), on loopback.
            "--fulfilment-bind-address" if value.starts_with(':') => format!("127.0.0.1{value}"),
            _ => mounted(value),
        };
        args.push(format!("{flag}={value}"));
    }
    let mut launch = Launch::new(provider_binary()?, kubeconfig)
        .inherit_env()
        .env_remove("KUBECONFIG")
        .env_remove("MAILGUN_API_KEY")
        .env_remove("SMTP_PASSWORD")
        .env("POD_NAMESPACE", namespace);
    for (name, value) in container_env(client, namespace, &deployment).await? {
        launch = launch.env(name, mounted(&value));
    }
    let cmd = launch.args(&args).command();
    let proc = Proc::spawn("provider", cmd, dir.join("provider.log"))?;
    Ok(ChartProvider {
        proc,
        metrics,
        webhook_port,
        chart_args,
        kubeconfig: kubeconfig.to_path_buf(),
    })
}

/// The container's environment as the kubelet sets it: literal values and ConfigMap keys (an
/// optional key of a missing ConfigMap left unset); the field references (the Pod's namespace)
/// are set by [`start_chart_provider`] itself.
async fn container_env(
    client: &Client,
    namespace: &str,
    deployment: &Deployment,
) -> Result<Vec<(String, String)>> {
    let container = deployment
        .spec
        .as_ref()
        .and_then(|s| s.template.spec.as_ref())
        .map(|p| &p.containers[0])
        .context("the pod template's container")?;
    let maps: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let mut out = Vec::new();
    for var in container.env.as_deref().unwrap_or_default() {
        if let Some(value) = &var.value {
            out.push((var.name.clone(), value.clone()));
            continue;
        }
        let Some(from) = var
            .value_from
            .as_ref()
            .and_then(|f| f.config_map_key_ref.as_ref())
        else {
            continue;
        };
        let value = maps
            .get_opt(&from.name)
            .await?
            .and_then(|m| m.data.unwrap_or_default().remove(&from.key));
        match value {
            Some(value) => out.push((var.name.clone(), value)),
            None if from.optional == Some(true) => {}
            None => anyhow::bail!(
                "{}: ConfigMap {namespace}/{} has no key {}",
                var.name,
                from.name,
                from.key
            ),
        }
    }
    Ok(out)
}

/// Points the webhook Service `service` in `namespace` at a provider on this host's `port`:
/// without kube-proxy and a kubelet, the EndpointSlice the endpoint controllers would write is
/// written by hand.
///
/// # Errors
/// When the API server refuses it.
pub async fn route_webhook_service(
    client: &Client,
    namespace: &str,
    service: &str,
    port: u16,
) -> Result<()> {
    let ip = host_ip()?;
    let slice: DynamicObject = serde_json::from_value(serde_json::json!({
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": format!("{service}-local"),
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "ports": [{"name": "https", "port": port, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip.to_string()], "conditions": {"ready": true}}],
    }))?;
    let gvk = GroupVersionKind::gvk("discovery.k8s.io", "v1", "EndpointSlice");
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &ApiResource::from_gvk(&gvk));
    api.create(&PostParams::default(), &slice).await?;
    Ok(())
}

/// The `kubectl ...` line a mail's (decoded) `body` gives its recipient, placeholders filled in,
/// split into words the way the recipient's shell would.
///
/// # Errors
/// When the body has no `kubectl patch` line or `sh` fails.
pub fn fulfil_command(body: &str, fill: &[(&str, &str)]) -> Result<Vec<String>> {
    let line = body
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("kubectl patch"))
        .with_context(|| format!("no kubectl command in the mail:\n{body}"))?;
    let mut line = line.to_owned();
    for (placeholder, value) in fill {
        line = line.replace(placeholder, value);
    }
    shell_words(&line)
}

/// Splits a shell line with `sh` itself (quotes as the recipient's shell would treat them).
fn shell_words(line: &str) -> Result<Vec<String>> {
    let out = crate::run(
        Command::new("sh").args([
            "-c",
            &format!("for a in {line}; do printf '%s\\0' \"$a\"; done"),
        ]),
        "sh",
    )?;
    Ok(out
        .split('\0')
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect())
}

/// The namespace the tests install the chart into (the provider's namespace).
pub const CHART_NAMESPACE: &str = "capm-system";
/// The Helm release name the tests install the chart as.
pub const RELEASE: &str = "capm";
/// The chart's full name for [`RELEASE`]: its Deployment, ServiceAccount and Services.
pub const FULLNAME: &str = "capm-cluster-api-provider-mailgun";

/// The chart's values for a Mailgun backend: `recipient`, the contract server at `base_url` for
/// `domain`, its key in the Secret `mailgun-credentials` of the release's namespace; identities
/// may reach Mailgun contract servers on loopback (`tenancy.mailgunHosts`).
pub fn mailgun_values(recipient: &str, domain: &str, base_url: &str) -> String {
    format!(
        "mail:\n  recipient: {recipient}\n  backend: mailgun\n  mailgun:\n    domain: {domain}\n    \
         baseURL: {base_url}\n    apiKeySecret: {{name: mailgun-credentials}}\n\
         tenancy:\n  mailgunHosts: [\"127.0.0.1\"]\n"
    )
}

/// What a test installs as a user would: `helm install` [`RELEASE`] of the chart into
/// [`CHART_NAMESPACE`] (created, restricted) with `values` (YAML), the Secret
/// `mailgun-credentials` holding `api_key` beside it; then the provider run from this build as
/// the chart's Deployment [`FULLNAME`] runs it (its ServiceAccount's token, see [`start_chart_provider`]) with the
/// webhook Service routed to it.
///
/// # Errors
/// When Helm, the API server or the provider fails.
pub async fn install_chart_and_provider(
    cp: &capm_test_support::ControlPlane,
    api_key: &str,
    values: &str,
    dir: &Path,
) -> Result<ChartProvider> {
    let (namespace, release, fullname) = (CHART_NAMESPACE, RELEASE, FULLNAME);
    let admin = cp.client().await?;
    crate::create_namespace(&admin, namespace, true).await?;
    crate::create_secret(
        &admin,
        namespace,
        "mailgun-credentials",
        &[("api-key", api_key)],
    )
    .await?;
    let values_file = dir.join("values.yaml");
    fs::write(&values_file, values)?;
    crate::helm_chart(
        cp.kubeconfig(),
        "install",
        release,
        namespace,
        &values_file,
        &[],
    )?;
    start_routed_chart_provider(cp, &admin, namespace, fullname, dir).await
}

/// The provider from this build as the installed chart's Deployment `fullname` in `namespace`
/// runs it, authenticated as its ServiceAccount ([`crate::service_account_kubeconfig`], see
/// [`start_chart_provider`]), with the webhook Service `<fullname>-webhook` routed to it.
///
/// # Errors
/// When the ServiceAccount's token, the Deployment or the Service cannot be had, or the process
/// cannot start.
pub async fn start_routed_chart_provider(
    cp: &capm_test_support::ControlPlane,
    admin: &Client,
    namespace: &str,
    fullname: &str,
    dir: &Path,
) -> Result<ChartProvider> {
    let sa_kubeconfig = crate::service_account_kubeconfig(cp, namespace, fullname, dir)?;
    let provider = start_chart_provider(admin, namespace, fullname, &sa_kubeconfig, dir).await?;
    route_webhook_service(
        admin,
        namespace,
        &format!("{fullname}-webhook"),
        provider.webhook_port,
    )
    .await?;
    Ok(provider)
}
