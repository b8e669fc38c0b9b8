//! The process's own endpoints: diagnostics (`/metrics`), the probes and the webhooks.

use std::{
    net::{Ipv4Addr, SocketAddr},
    path::PathBuf,
};

use super::{SettingsError, invalid, values::bind_address};

/// controller-runtime's default webhook certificate directory.
pub(super) const DEFAULT_WEBHOOK_CERT_DIR: &str = "/tmp/k8s-webhook-server/serving-certs";

/// The endpoints' flags.
// The field docs are `--help` texts, written for a terminal, not for rustdoc.
#[allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]
#[derive(Debug, clap::Args)]
#[group(skip)]
pub struct Flags {
    /// Address of the diagnostics endpoint (/metrics): HTTPS, each request authenticated
    /// (TokenReview) and authorized (SubjectAccessReview: `get` on the non-resource URL
    /// `/metrics`) by the API server; `0` disables it [default: :8443].
    #[arg(long, env = "DIAGNOSTICS_ADDRESS", value_name = "ADDR")]
    pub diagnostics_address: Option<String>,

    /// Serve diagnostics over plain HTTP without authentication or authorization [default:
    /// false].
    #[arg(long, env = "INSECURE_DIAGNOSTICS")]
    pub insecure_diagnostics: Option<bool>,

    /// Directory with the diagnostics endpoint's tls.crt and tls.key, re-read when they change
    /// [default: a self-signed certificate generated at start].
    #[arg(long, env = "DIAGNOSTICS_CERT_DIR", value_name = "DIR")]
    pub diagnostics_cert_dir: Option<PathBuf>,

    /// Deprecated: `--diagnostics-address ADDR --insecure-diagnostics` (plain HTTP, no
    /// authentication), as this flag always meant; not together with --diagnostics-address.
    #[arg(long, env = "METRICS_BIND_ADDRESS", value_name = "ADDR")]
    pub metrics_bind_address: Option<String>,

    /// Address of /healthz and /readyz; `0` disables them.
    #[arg(
        long,
        env = "HEALTH_PROBE_BIND_ADDRESS",
        value_name = "ADDR",
        default_value = "127.0.0.1:8081"
    )]
    pub health_probe_bind_address: String,

    /// Port of the webhooks (HTTPS, all interfaces): CRD conversion and the admission checks;
    /// `0` disables it.
    #[arg(
        long,
        env = "WEBHOOK_PORT",
        value_name = "PORT",
        default_value_t = 9443
    )]
    pub webhook_port: u16,

    /// Directory with the webhook's tls.crt and tls.key, re-read when they change.
    #[arg(long, env = "WEBHOOK_CERT_DIR", value_name = "DIR", default_value = DEFAULT_WEBHOOK_CERT_DIR)]
    pub webhook_cert_dir: PathBuf,
}

/// The conversion webhook's serving parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Webhook {
    /// Where it listens.
    pub bind: SocketAddr,
    /// Directory holding `tls.crt` and `tls.key`.
    pub cert_dir: PathBuf,
}

/// The diagnostics endpoint's serving parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Diagnostics {
    /// Where it listens.
    pub bind: SocketAddr,
    /// HTTPS with authentication and authorization, or plain HTTP for anyone.
    pub security: DiagnosticsSecurity,
}

/// How the diagnostics endpoint is protected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DiagnosticsSecurity {
    /// HTTPS; every request reviewed by the API server.
    Secure {
        /// Directory holding `tls.crt` and `tls.key`; `None`: self-signed, made at start.
        cert_dir: Option<PathBuf>,
    },
    /// Plain HTTP, no authentication (`--insecure-diagnostics`).
    Insecure,
}

/// The endpoints, checked.
pub(super) struct Endpoints {
    pub(super) diagnostics: Option<Diagnostics>,
    pub(super) probe_address: Option<SocketAddr>,
    pub(super) webhook: Option<Webhook>,
}

/// The endpoints; deprecated flags in use are added to `deprecations`.
pub(super) fn resolve(
    flags: Flags,
    deprecations: &mut Vec<String>,
) -> Result<Endpoints, SettingsError> {
    let diagnostics = resolve_diagnostics(
        flags.diagnostics_address,
        flags.insecure_diagnostics,
        flags.diagnostics_cert_dir,
        flags.metrics_bind_address,
        deprecations,
    )?;
    let probe_address = bind_address(
        field!(health_probe_bind_address),
        &flags.health_probe_bind_address,
    )?;
    let webhook = (flags.webhook_port != 0).then(|| Webhook {
        bind: SocketAddr::from((Ipv4Addr::UNSPECIFIED, flags.webhook_port)),
        cert_dir: flags.webhook_cert_dir,
    });
    Ok(Endpoints {
        diagnostics,
        probe_address,
        webhook,
    })
}

/// `--diagnostics-address` and friends, with `--metrics-bind-address` as the deprecated way to
/// ask for plain HTTP.
fn resolve_diagnostics(
    address: Option<String>,
    insecure: Option<bool>,
    cert_dir: Option<PathBuf>,
    metrics_bind_address: Option<String>,
    deprecations: &mut Vec<String>,
) -> Result<Option<Diagnostics>, SettingsError> {
    let (bind, insecure) = match (address, metrics_bind_address) {
        (Some(_), Some(_)) => {
            return Err(invalid(
                field!(metrics_bind_address),
                format!(
                    "deprecated and replaced by {}: set only that one",
                    field!(diagnostics_address)
                ),
            ));
        }
        (None, Some(old)) => {
            if insecure == Some(false) {
                return Err(invalid(
                    field!(metrics_bind_address),
                    format!(
                        "serves plain HTTP, which {} false forbids: use {} instead",
                        field!(insecure_diagnostics),
                        field!(diagnostics_address)
                    ),
                ));
            }
            deprecations.push(format!(
                "{} is deprecated: use {} with {} (or drop it for HTTPS with authentication)",
                field!(metrics_bind_address),
                field!(diagnostics_address),
                field!(insecure_diagnostics)
            ));
            (bind_address(field!(metrics_bind_address), &old)?, true)
        }
        (address, None) => (
            bind_address(
                field!(diagnostics_address),
                address.as_deref().unwrap_or(":8443"),
            )?,
            insecure.unwrap_or(false),
        ),
    };
    if insecure && let Some(dir) = &cert_dir {
        return Err(invalid(
            field!(diagnostics_cert_dir),
            format!(
                "{} is only used over HTTPS, and diagnostics are insecure (plain HTTP)",
                dir.display()
            ),
        ));
    }
    Ok(bind.map(|bind| Diagnostics {
        bind,
        security: if insecure {
            DiagnosticsSecurity::Insecure
        } else {
            DiagnosticsSecurity::Secure { cert_dir }
        },
    }))
}
