//! A release as users get it: a real OCI registry on loopback with TLS (the CNCF distribution
//! registry `make tools` builds), `hack/release.sh` pushing this build's image and chart to it,
//! and the clients a user runs against it (`helm` with `oci://`, `cosign verify`, `crane`).

use std::{
    collections::BTreeMap,
    fs,
    net::TcpStream,
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{Context, Result, ensure};
use capm_test_support::{image::Image, pki::CertificateAuthority, process};

use crate::{Proc, free_port, run};

/// The chart's name, in the registry under `<path>/charts/`.
pub const CHART: &str = "cluster-api-provider-mailgun";

/// A distribution registry serving HTTPS on `127.0.0.1:<port>`, its storage and log under a
/// scratch directory; stopped when dropped.
#[derive(Debug)]
pub struct Registry {
    proc: Proc,
    /// `127.0.0.1:<port>`.
    pub host: String,
    /// The CA that issued the registry's certificate (PEM).
    pub ca_pem: String,
    /// The same CA as a file, for `SSL_CERT_FILE`.
    pub ca_file: PathBuf,
}

impl Registry {
    /// Starts the registry (`bin/registry`) with a certificate for 127.0.0.1 from a throw-away
    /// CA; returns once it accepts connections.
    ///
    /// # Errors
    /// When the binary is missing, it exits, or it does not listen within 30 s.
    pub async fn start(dir: &Path) -> Result<Self> {
        let dir = dir.join("registry");
        fs::create_dir_all(&dir)?;
        let ca = CertificateAuthority::new("capm-e2e-registry-ca")?;
        let pair = ca.serving_cert("127.0.0.1", &[], &[])?;
        let (cert, key, ca_file) = (dir.join("tls.crt"), dir.join("tls.key"), dir.join("ca.crt"));
        fs::write(&cert, &pair.cert_pem)?;
        fs::write(&key, &pair.key_pem)?;
        fs::write(&ca_file, ca.cert_pem())?;
        let port = free_port()?;
        let host = format!("127.0.0.1:{port}");
        let config = dir.join("config.yml");
        fs::write(
            &config,
            format!(
                "version: 0.1\nlog:\n  level: info\n  accesslog:\n    disabled: false\n\
                 storage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\n\
                 http:\n  addr: {host}\n  secret: capm-e2e-registry-upload-secret\n  tls:\n    \
                 certificate: {}\n    key: {}\n",
                dir.join("data").display(),
                cert.display(),
                key.display()
            ),
        )?;
        let mut cmd = Command::new(process::binary("registry")?);
        cmd.arg("serve").arg(&config);
        let proc = Proc::spawn("registry", cmd, dir.join("registry.log"))?;
        let started = Instant::now();
        while TcpStream::connect(&host).is_err() {
            proc.check_alive()?;
            ensure!(
                started.elapsed() < Duration::from_secs(30),
                "the registry does not listen on {host} after 30 s:\n{}",
                proc.tail(20)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(Self {
            proc,
            host,
            ca_pem: ca.cert_pem().to_owned(),
            ca_file,
        })
    }

    /// The registry's log: every request it answered, with method and URI.
    pub fn log(&self) -> String {
        self.proc.log()
    }

    /// Fails when the registry has exited.
    ///
    /// # Errors
    /// When it exited, with the end of its log.
    pub fn check_alive(&self) -> Result<()> {
        self.proc.check_alive()
    }

    /// A command for one of the Go tools (`helm`, `crane`, `cosign`) that trusts this
    /// registry's CA and keeps its configuration and caches in `home`.
    ///
    /// # Errors
    /// When the tool is not built.
    pub fn client(&self, tool: &str, home: &Path) -> Result<Command> {
        let mut cmd = Command::new(process::binary(tool)?);
        self.client_env(&mut cmd, home);
        Ok(cmd)
    }

    /// The environment of [`Registry::client`]: `SSL_CERT_FILE` (Go's TLS roots) naming this
    /// registry's CA, `HOME` and the Docker and Helm configuration under `home`, cosign's key
    /// password empty, no `KUBECONFIG`.
    pub fn client_env(&self, cmd: &mut Command, home: &Path) {
        cmd.env("SSL_CERT_FILE", &self.ca_file)
            .env("HOME", home)
            .env("DOCKER_CONFIG", home.join("docker"))
            .env("HELM_CACHE_HOME", home.join("helm/cache"))
            .env("HELM_CONFIG_HOME", home.join("helm/config"))
            .env("HELM_DATA_HOME", home.join("helm/data"))
            .env("COSIGN_PASSWORD", "")
            .env_remove("KUBECONFIG");
    }
}

/// What `hack/release.sh` published, from its `release.txt`.
#[derive(Debug, Clone)]
pub struct Release {
    /// `x.y.z`.
    pub version: String,
    /// The image by digest, `<registry>/<path>/cluster-api-provider-mailgun@sha256:...`.
    pub image: String,
    /// The image's manifest digest, `sha256:...`.
    pub image_digest: String,
    /// `oci://<registry>/<path>/charts/cluster-api-provider-mailgun`.
    pub chart: String,
    /// The chart artifact's manifest digest.
    pub chart_digest: String,
    /// The release's `out/` folder.
    pub out: PathBuf,
}

/// Runs `hack/release.sh` (what `make release` runs once the tools are built) for this
/// workspace's version, pushing to `<registry>/<path>`: the image built from `binary` by the
/// project's image builder, the chart, the assets into `out`; signed with `cosign_key` when
/// given (its password empty).
///
/// # Errors
/// When the image cannot be built or the script fails (its output is in the error).
pub fn release(
    registry: &Registry,
    path: &str,
    binary: &Path,
    out: &Path,
    cosign_key: Option<&Path>,
) -> Result<Release> {
    let version = env!("CARGO_PKG_VERSION");
    let repository = format!("{}/{path}", registry.host);
    fs::create_dir_all(out)?;
    let archive = out.join("provider.oci.tar");
    let written = Image::provider(
        &format!("{repository}/cluster-api-provider-mailgun:{version}"),
        binary,
    )?
    .write_oci_archive(&archive)?;
    let mut cmd = Command::new(crate::chart_dir().join("../../hack/release.sh"));
    registry.client_env(&mut cmd, &out.join(".home"));
    cmd.env("VERSION", version)
        .env("REGISTRY", &repository)
        .env("OUT", out)
        .env("CAPM_RELEASE_IMAGE_ARCHIVE", &archive)
        .env(
            "COSIGN_KEY",
            cosign_key.map(Path::as_os_str).unwrap_or_default(),
        );
    let output = run(&mut cmd, "hack/release.sh")?;
    println!("hack/release.sh:\n{output}");
    let text = fs::read_to_string(out.join("release.txt"))?;
    let fields: BTreeMap<&str, &str> = text.lines().filter_map(|l| l.split_once(": ")).collect();
    let field = |k: &str| {
        fields
            .get(k)
            .map(|v| (*v).to_owned())
            .with_context(|| format!("release.txt has no {k}:\n{text}"))
    };
    let release = Release {
        version: field("version")?,
        image: field("image")?,
        image_digest: field("image")?
            .rsplit_once('@')
            .map(|(_, d)| d.to_owned())
            .context("the image is not by digest")?,
        chart: field("chart")?,
        chart_digest: field("chart-digest")?,
        out: out.to_owned(),
    };
    ensure!(
        release.image_digest == written.manifest_digest,
        "the released image {} is not the archive built ({})",
        release.image,
        written.manifest_digest
    );
    Ok(release)
}

/// `cosign generate-key-pair` (empty password) in `dir`: the private and the public key's paths.
///
/// # Errors
/// When cosign is missing or fails.
pub fn key_pair(registry: &Registry, dir: &Path) -> Result<(PathBuf, PathBuf)> {
    fs::create_dir_all(dir)?;
    let mut cmd = registry.client("cosign", dir)?;
    cmd.current_dir(dir).arg("generate-key-pair");
    run(&mut cmd, "cosign generate-key-pair")?;
    Ok((dir.join("cosign.key"), dir.join("cosign.pub")))
}

/// `cosign verify` of `reference` with the public key `public` (no transparency log, as the
/// release signs).
///
/// # Errors
/// When the signature does not verify.
pub fn verify_signature(registry: &Registry, public: &Path, reference: &str) -> Result<()> {
    let mut cmd = registry.client("cosign", &std::env::temp_dir().join("capm-e2e-cosign"))?;
    cmd.arg("verify")
        .arg("--key")
        .arg(public)
        .args(["--insecure-ignore-tlog=true", reference]);
    run(&mut cmd, &format!("cosign verify {reference}")).map(drop)
}
