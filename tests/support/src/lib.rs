//! A real local Kubernetes control plane for tests, benchmarks and the demo.
//!
//! This crate starts `etcd`, `kube-apiserver` and `kube-controller-manager` built from Go modules
//! (`hack/tools/build.sh`, binaries in `bin/` at the repository root or `$CAPM_BIN_DIR`) on
//! loopback, with free ports, a throw-away PKI, RBAC authorization and Pod Security admission.
//! Tests, the demo and a person at a shell all go through [`ControlPlane::start`]; the
//! `capm-env` binary (`up` / `down` / `env` / `run`) is a thin CLI over it.
//!
//! It is **not** a production installer: etcd runs without fsync on plain HTTP over loopback,
//! and every process and file lives only as long as the environment.
//!
//! # Tests
//! ```no_run
//! # async fn f() -> Result<(), capm_test_support::Error> {
//! use capm_test_support::TestNamespace;
//! // One control plane per test binary (or the one `CAPM_KUBECONFIG` names), a fresh
//! // namespace and client per test; the namespace is deleted when `ns` is dropped.
//! let ns = TestNamespace::create("my-test").await?;
//! let pods: kube::Api<k8s_openapi::api::core::v1::Pod> = ns.api();
//! # let _ = pods; Ok(()) }
//! ```
//!
//! # Cleanup
//! Nothing is left behind: an attached control plane (tests, `capm-env run`) has a reaper process
//! that removes every process and the state directory as soon as the owner exits, whether it
//! returned, panicked or was killed. A detached one (`capm-env up`) lives until `capm-env down`.

mod control_plane;
pub mod image;
mod namespace;
pub mod node;
pub mod pki;
pub mod process;
pub mod provider;
pub mod proxy;
pub mod wait;

pub use control_plane::{
    ControlPlane, KUBERNETES_VERSION, Options, client_from_kubeconfig, config_from_kubeconfig,
    install_crds, shared,
};
pub use namespace::TestNamespace;

use std::path::PathBuf;

/// Everything that can go wrong while starting or using a local environment.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A tool binary has not been built.
    #[error(
        "{name} not found at {}: build the tools with `make tools` (hack/tools/build.sh), \
         or point CAPM_BIN_DIR at a folder holding them",
        path.display()
    )]
    BinaryMissing {
        /// Binary name.
        name: String,
        /// Where it was looked for.
        path: PathBuf,
    },
    /// A requested port is taken.
    #[error(
        "port {port} on 127.0.0.1 is already in use: {source}; choose another or stop what holds it"
    )]
    PortInUse {
        /// The port.
        port: u16,
        /// Why binding failed.
        #[source]
        source: std::io::Error,
    },
    /// A binary could not be executed.
    #[error("could not start {name}: {source}")]
    Spawn {
        /// Component name.
        name: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A component exited while the environment was starting or running.
    #[error("{name} exited ({status}) during start; last lines of {}:\n{log_tail}", log.display())]
    ComponentExited {
        /// Component name.
        name: String,
        /// Its exit status.
        status: String,
        /// Its log file (removed with the environment).
        log: PathBuf,
        /// The end of its log.
        log_tail: String,
    },
    /// Something did not become ready in time.
    #[error("timed out after {seconds} s waiting for {what}; last lines of {}:\n{log_tail}", log.display())]
    Timeout {
        /// What was awaited.
        what: String,
        /// How long.
        seconds: u64,
        /// The log most likely to explain it.
        log: PathBuf,
        /// Its end.
        log_tail: String,
    },
    /// A detached environment already runs in that directory.
    #[error("a control plane already runs in {} (kubeconfig {}/kubeconfig): stop it with `capm-env down` first", dir.display(), dir.display())]
    AlreadyRunning {
        /// Its state directory.
        dir: PathBuf,
    },
    /// No environment in that directory.
    #[error("no control plane runs in {}: start one with `capm-env up`", dir.display())]
    NotRunning {
        /// The directory looked at.
        dir: PathBuf,
    },
    /// The cleanup script failed.
    #[error("cleaning up {} failed ({status})", dir.display())]
    Cleanup {
        /// The state directory.
        dir: PathBuf,
        /// The script's exit status.
        status: String,
    },
    /// Key material could not be generated.
    #[error(transparent)]
    Pki(#[from] pki::PkiError),
    /// A file-system or process operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The kubeconfig could not be loaded.
    #[error("loading kubeconfig {}: {source}", path.display())]
    Kubeconfig {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: kube::config::KubeconfigError,
    },
    /// A Kubernetes API call failed.
    #[error("{context}: {source}")]
    Kube {
        /// What was being done.
        context: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
    /// `kubectl` failed.
    #[error("`kubectl {args}` failed ({status}):\n{stderr}")]
    Kubectl {
        /// Its arguments.
        args: String,
        /// Its exit status.
        status: String,
        /// Its standard error.
        stderr: String,
    },
    /// Building or importing a container image failed.
    #[error("image: {0}")]
    Image(String),
    /// Setting up or running the local node (network, containerd, kubelet) failed.
    #[error("node: {0}")]
    Node(String),
    /// The shared control plane failed to start earlier in this process.
    #[error("the shared control plane failed to start: {0}")]
    Shared(String),
}

impl Error {
    pub(crate) fn io(context: &'static str) -> impl FnOnce(std::io::Error) -> Self {
        move |source| Self::Io { context, source }
    }

    pub(crate) fn kube(context: impl Into<String>) -> impl FnOnce(kube::Error) -> Self {
        let context = context.into();
        move |source| Self::Kube { context, source }
    }
}
