//! The chart as real Pods on a local node (`Options { node: true }`): the setup and clean-up
//! checks every such test shares, and what they ask of the provider's Pods.

use std::{fs, path::Path, time::Duration};

use anyhow::{Context, Result, ensure};
use capm_test_support::{ControlPlane, Options};
use k8s_openapi::api::{coordination::v1::Lease, core::v1::Pod};
use kube::{Api, api::ListParams};

/// Whether this process runs as root (a node needs it).
pub fn is_root() -> bool {
    fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(2) == Some("0"))
        })
        .unwrap_or(false)
}

/// Starts a control plane with a node, runs `body` on it with a scratch directory, prints the
/// node's and the provider's logs (the Pods labelled `app.kubernetes.io/name=<chart>` in
/// `namespace`) when it fails, stops everything, and checks that nothing is left behind: no
/// process naming the state directory (containerd's shims outlive containerd), no bridge.
///
/// # Errors
/// When `body` fails, the node cannot start, or something is left behind.
pub async fn on_a_node(
    namespace: &str,
    body: impl AsyncFnOnce(&ControlPlane, &Path) -> Result<()>,
) -> Result<()> {
    ensure!(
        is_root(),
        "this test starts a kubelet, containerd and a bridge network and needs root \
         (run `make test` as root, as CI does)"
    );
    let work = tempfile::tempdir()?;
    let dir = work.path();
    let started = std::time::Instant::now();
    let cp = ControlPlane::start(Options {
        node: true,
        timeout: Duration::from_secs(180),
        ..Options::default()
    })
    .await?;
    println!("control plane + node Ready in {:.1?}", started.elapsed());
    let result = body(&cp, dir).await;
    if result.is_err() {
        if let Some(state) = cp.dir() {
            for name in ["kubelet", "containerd"] {
                let log = state.join("logs").join(format!("{name}.log"));
                eprintln!(
                    "--- last lines of {name}:\n{}",
                    capm_test_support::process::tail(&log, 30)
                );
            }
        }
        if let Ok(out) = cp.kubectl_output(&["get", "pods", "-A", "-o", "wide"]) {
            eprintln!("--- pods:\n{out}");
        }
        if let Ok(out) = cp.kubectl_output(&[
            "-n",
            namespace,
            "logs",
            "-l",
            "app.kubernetes.io/name=cluster-api-provider-mailgun",
            "--tail=30",
            "--prefix",
        ]) {
            eprintln!("--- provider logs:\n{out}");
        }
    }
    let bridge = cp
        .network()
        .map(|n| n.bridge.clone())
        .context("the node's network")?;
    let state = cp
        .dir()
        .map(|d| d.display().to_string())
        .context("the state directory")?;
    cp.stop();
    let mut left = Vec::new();
    for entry in fs::read_dir("/proc")?.flatten() {
        let cmdline = fs::read(entry.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(&state) {
            left.push(String::from_utf8_lossy(&cmdline).replace('\0', " "));
        }
    }
    ensure!(left.is_empty(), "processes left behind: {left:?}");
    let links = std::process::Command::new("ip")
        .args(["-o", "link"])
        .output()?;
    ensure!(
        !String::from_utf8_lossy(&links.stdout).contains(&format!(" {bridge}:")),
        "bridge {bridge} is still there after the control plane stopped"
    );
    result
}

/// Whether a Pod is Ready and not being deleted.
pub fn ready(pod: &Pod) -> bool {
    pod.metadata.deletion_timestamp.is_none()
        && pod
            .status
            .as_ref()
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The provider's Pods of the release `release` (any release when `None`).
///
/// # Errors
/// When the API server refuses the list.
pub async fn provider_pods(pods: &Api<Pod>, release: Option<&str>) -> Result<Vec<Pod>> {
    let mut selector = "app.kubernetes.io/name=cluster-api-provider-mailgun".to_owned();
    if let Some(release) = release {
        selector.push_str(&format!(",app.kubernetes.io/instance={release}"));
    }
    Ok(pods
        .list(&ListParams::default().labels(&selector))
        .await?
        .items)
}

/// The Pod name in the holder identity (`<pod>_<suffix>`) of the Lease `name`.
///
/// # Errors
/// When the API server refuses the read.
pub async fn leader(leases: &Api<Lease>, name: &str) -> Result<Option<String>> {
    Ok(leases
        .get_opt(name)
        .await?
        .and_then(|l| l.spec)
        .and_then(|s| s.holder_identity)
        .and_then(|h| h.rsplit_once('_').map(|(pod, _)| pod.to_owned())))
}

/// Fails when a provider container was OOM-killed or restarted.
///
/// # Errors
/// When one restarted, with its last termination.
pub fn check_no_restarts(pods: &[Pod]) -> Result<()> {
    for pod in pods {
        for c in pod
            .status
            .as_ref()
            .and_then(|s| s.container_statuses.as_ref())
            .into_iter()
            .flatten()
        {
            let last = c.last_state.as_ref().and_then(|s| s.terminated.as_ref());
            ensure!(
                c.restart_count == 0,
                "{} restarted {} times (last: {:?})",
                pod.metadata.name.as_deref().unwrap_or("?"),
                c.restart_count,
                last.map(|t| (t.reason.clone(), t.exit_code))
            );
        }
    }
    Ok(())
}

/// The image the chart's `helm test` Pod runs by default (values `tests.image`).
pub const KUBECTL_IMAGE: &str = "registry.k8s.io/kubectl:v1.36.4";

/// Loads an image holding only the static `kubectl` that `make tools` built (the same version
/// as upstream's `registry.k8s.io/kubectl`, whose entrypoint is kubectl too) into the node's
/// containerd as [`KUBECTL_IMAGE`]: the node pulls nothing from the internet.
///
/// # Errors
/// When no node runs here, kubectl is missing or `ctr` fails.
pub fn load_kubectl_image(cp: &ControlPlane) -> Result<()> {
    use capm_test_support::image::{self, Entry, Image, Kind};
    let dir = cp
        .dir()
        .context("the control plane has no state directory")?;
    let kubectl = capm_test_support::process::binary("kubectl")?;
    let img = Image {
        name: KUBECTL_IMAGE.to_owned(),
        entrypoint: vec!["/kubectl".to_owned()],
        user: "65532:65532".to_owned(),
        env: vec!["PATH=/".to_owned()],
        entries: vec![Entry {
            path: "/kubectl".to_owned(),
            mode: 0o755,
            uid: 0,
            gid: 0,
            kind: Kind::File(fs::read(&kubectl)?),
        }],
    };
    let archive = dir.join("kubectl.oci.tar");
    img.write_oci_archive(&archive)?;
    let ctr = capm_test_support::process::binary_in(&dir.join("bin"), "ctr")?;
    image::import(&ctr, &dir.join("containerd.sock"), &archive, KUBECTL_IMAGE)?;
    let _ = fs::remove_file(&archive);
    Ok(())
}
