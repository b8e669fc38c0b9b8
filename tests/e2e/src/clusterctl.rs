//! The real `clusterctl` against a clusterctl local repository of this build's release assets
//! (`hack/release-manifests.sh`), offline: the chart test checks what it renders, the
//! ClusterClass test runs a Cluster it generates.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result};
use serde::Deserialize as _;

/// A clusterctl local repository holding this version's release assets, and a clusterctl
/// configuration naming it as the `mailgun` infrastructure provider.
#[derive(Debug)]
pub struct LocalRepository {
    /// The assets: `<base>/repo/infrastructure-mailgun/v<version>/`.
    pub release: PathBuf,
    /// The clusterctl configuration file.
    pub config: String,
    /// `HOME` and `XDG_CONFIG_HOME` for clusterctl (its cache and overrides).
    pub home: PathBuf,
    /// `mailgun:v<version>`, for `--infrastructure`.
    pub provider: String,
}

impl LocalRepository {
    /// Renders the release assets with `hack/release-manifests.sh` under `base`.
    ///
    /// # Errors
    /// When the script (it needs `bin/helm`) or a write fails.
    pub fn new(base: &Path) -> Result<Self> {
        let version = format!("v{}", env!("CARGO_PKG_VERSION"));
        let release = base.join("repo/infrastructure-mailgun").join(&version);
        let script = crate::chart_dir().join("../../hack/release-manifests.sh");
        crate::run(
            Command::new(&script).arg(&release),
            "hack/release-manifests.sh",
        )?;
        let config = base.join("clusterctl.yaml");
        std::fs::write(
            &config,
            format!(
                "providers:\n  - name: mailgun\n    type: InfrastructureProvider\n    url: {}\n",
                release.join("infrastructure-components.yaml").display()
            ),
        )?;
        Ok(Self {
            release,
            config: config.to_string_lossy().into_owned(),
            home: base.join("home"),
            provider: format!("mailgun:{version}"),
        })
    }

    /// Adds the Cluster API core provider `version` to the repository, with only its
    /// `metadata.yaml` (from the module at `module_dir`): what clusterctl reads of an installed
    /// core provider to learn its contract, where it would otherwise download it from GitHub.
    /// Its `providers:` entry is appended to the configuration.
    ///
    /// # Errors
    /// When a file cannot be read or written.
    pub fn add_core_metadata(&self, module_dir: &Path, version: &str) -> Result<()> {
        let base = self
            .release
            .parent()
            .and_then(Path::parent)
            .context("the repository's base")?;
        let dir = base.join("cluster-api").join(version);
        std::fs::create_dir_all(&dir)?;
        std::fs::copy(module_dir.join("metadata.yaml"), dir.join("metadata.yaml"))?;
        let mut config = std::fs::read_to_string(&self.config)?;
        config.push_str(&format!(
            "  - name: cluster-api\n    type: CoreProvider\n    url: {}\n",
            dir.join("core-components.yaml").display()
        ));
        std::fs::write(&self.config, config)?;
        Ok(())
    }

    /// Runs `bin/clusterctl` offline (no version check, configuration under `home`) with `env`
    /// set; returns its standard output.
    ///
    /// # Errors
    /// When clusterctl is missing or fails.
    pub fn clusterctl(&self, args: &[&str], env: &[(&str, &str)]) -> Result<String> {
        let mut cmd = Command::new(capm_test_support::process::binary("clusterctl")?);
        cmd.args(args)
            .env("CLUSTERCTL_DISABLE_VERSIONCHECK", "true")
            .env("XDG_CONFIG_HOME", &self.home)
            .env("HOME", &self.home)
            .envs(env.iter().copied());
        crate::run(&mut cmd, &format!("clusterctl {}", args.join(" ")))
    }

    /// `clusterctl generate cluster <name> --flavor <flavor>` (the default template when
    /// `flavor` is empty) into `namespace`, with `env` as clusterctl's variables.
    ///
    /// # Errors
    /// When clusterctl fails (a required variable missing, among others).
    pub fn generate_cluster(
        &self,
        name: &str,
        flavor: &str,
        namespace: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<String> {
        let mut args = vec![
            "generate",
            "cluster",
            name,
            "--infrastructure",
            &self.provider,
            "--config",
            &self.config,
            "--target-namespace",
            namespace,
        ];
        if !flavor.is_empty() {
            args.extend(["--flavor", flavor]);
        }
        args.extend(extra);
        self.clusterctl(&args, env)
    }
}

/// The directory of the Cluster API module clusterctl was built from (`go mod download` finds
/// it in the module cache, where `make tools` put it) and its version, from
/// `hack/tools/cluster-api/go.mod`.
///
/// # Errors
/// When go.mod names no version or `go mod download` fails.
pub fn cluster_api_module() -> Result<(PathBuf, String)> {
    let go_mod = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../hack/tools/cluster-api/go.mod");
    let text = std::fs::read_to_string(&go_mod)?;
    let version = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("sigs.k8s.io/cluster-api v"))
        .and_then(|rest| rest.split_whitespace().next())
        .map(|v| format!("v{v}"))
        .context("the sigs.k8s.io/cluster-api version in hack/tools/cluster-api/go.mod")?;
    let out = crate::run(
        Command::new("go").args([
            "mod",
            "download",
            "-json",
            &format!("sigs.k8s.io/cluster-api@{version}"),
        ]),
        "go mod download sigs.k8s.io/cluster-api",
    )?;
    let info: serde_json::Value = serde_json::from_str(&out)?;
    let dir = info["Dir"]
        .as_str()
        .context("no Dir in go mod download's answer")?;
    Ok((PathBuf::from(dir), version))
}

/// The documents of a multi-document YAML text, as JSON, empty ones left out.
///
/// # Errors
/// When the text is not YAML.
pub fn yaml_docs(text: &str) -> Result<Vec<serde_json::Value>> {
    let mut out = Vec::new();
    for doc in serde_yaml_ng::Deserializer::from_str(text) {
        let v = serde_json::Value::deserialize(doc).context("a YAML document")?;
        if !v.is_null() {
            out.push(v);
        }
    }
    Ok(out)
}
