//! Command line, environment and config file, resolved into one validated [`Settings`].
//!
//! Precedence, highest first: command-line flag, its environment variable, the `--config` file,
//! the built-in default. Secrets are never values here: the Mailgun API key and the SMTP password
//! are read by the mailer from a file (`--mailgun-api-key-file`, `--smtp-password-file`) or from
//! the environment variables `MAILGUN_API_KEY` / `SMTP_PASSWORD`, so neither `Debug` nor an error
//! message can show them.
//!
//! [`Args`] is the one declaration of every setting (its `--help` text, flag, variable, default
//! and parser), in groups of flags (`#[command(flatten)]`), each declared beside the code that
//! resolves it: `mailer` (the mail backend), `controllers` and `tenancy` (the controllers'
//! configuration), `endpoints` (diagnostics, probes, webhooks), `leader` (leader election) and
//! `fulfilment` (the links and page). `file` turns the config file into flag defaults, `values`
//! holds the flags' value parsers. A default that a library also needs is the library's
//! constant (`capm_controllers::DEFAULT_RELEASE_TIMEOUT`, `capm_api::link_token::DEFAULT_VALIDITY`,
//! `capm_mailer::AllowedHosts::default_mailgun`). The rules of the controllers' settings are
//! theirs (`capm_controllers::Config::validate`): a refused field is named here by its flag.

use std::{ffi::OsString, fmt, net::SocketAddr, path::PathBuf, sync::LazyLock, time::Duration};

use capm_mailer::{ConfigError, MailerConfig};
use clap::{
    Arg, Command, CommandFactory, FromArgMatches, Parser, ValueEnum,
    error::{ContextKind, ContextValue},
};

/// The [`Field`] of a flag, by its field in a group of flags (checked by the compiler): the
/// calling module's `Flags` (`field!(id)`), or another group (`field!(id in Type)`).
macro_rules! field {
    ($id:ident) => {
        $crate::settings::field!($id in Flags)
    };
    ($id:ident in $group:ty) => {{
        let _ = |flags: &$group| {
            let _ = &flags.$id;
        };
        $crate::settings::Field::of(stringify!($id))
    }};
}
pub(crate) use field;

mod controllers;
mod endpoints;
mod file;
mod fulfilment;
mod leader;
mod mailer;
mod mode;
mod tenancy;
#[cfg(test)]
mod tests;
mod values;

pub use endpoints::{Diagnostics, DiagnosticsSecurity, Flags as EndpointFlags, Webhook};
use file::{FLAG_ONLY, file_error, read_file, snake_to_camel};
pub use fulfilment::{Flags as FulfilmentFlags, Fulfilment};
pub use leader::LeaderElection;
pub use mailer::mailer_error;
pub use mode::{Mode, PageOnly};

/// Where Kubernetes mounts the pod's namespace.
const IN_CLUSTER_NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

/// The Cluster API infrastructure provider for Mailgun: mails a human for every cluster.
///
/// For each MailgunCluster and MailgunMachine it mails one request to --mail-recipient, through
/// Mailgun (--mailgun-domain and an API key) or an SMTP relay (--smtp-url), and reports in
/// status whether the mail was sent and delivered. Every flag can also be set by the environment
/// variable shown, or in the --config file (YAML or JSON, camelCase keys such as
/// `mailgunDomain`; the mail backend may also be given whole under `mailer`). A flag beats its
/// variable, which beats the file, which beats the default. Secrets are read only from files or
/// from MAILGUN_API_KEY / SMTP_PASSWORD.
// Each setting is declared once, in the group of flags beside the code that resolves it: its
// flag, variable, default and parser. The file's values become the flags' defaults (see
// `Settings::resolve`), so nothing else lists them. Every boolean flag takes the shape
// `values::switch` gives it. The field docs are `--help` texts, written for a terminal, not
// for rustdoc.
#[allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]
#[derive(Debug, Parser)]
#[command(name = "cluster-api-provider-mailgun", version, about, long_about)]
#[command(mut_args(values::switch))]
pub struct Args {
    /// Config file, YAML or JSON. Flags and environment variables override its values.
    #[arg(long, env = "CAPM_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// What the process runs: `all` (the controllers, webhooks and the fulfilment page), or
    /// `fulfilment-page` (only the page, the probes and /metrics; no mail settings, no leader
    /// election, no webhooks; needs --fulfilment-url and --fulfilment-keys-file).
    #[arg(long, env = "CAPM_MODE", value_enum, default_value_t)]
    pub mode: Mode,

    /// The mail backend.
    #[command(flatten)]
    pub mailer: mailer::Flags,

    /// The controllers.
    #[command(flatten)]
    pub controllers: controllers::Flags,

    /// What tenants may do.
    #[command(flatten)]
    pub tenancy: tenancy::Flags,

    /// Diagnostics, probes and webhooks.
    #[command(flatten)]
    pub endpoints: endpoints::Flags,

    /// Leader election.
    #[command(flatten)]
    pub leader: leader::Flags,

    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t)]
    pub log_format: LogFormat,

    /// Log filter: a level (`info`) or tracing directives (`info,kube=debug`).
    #[arg(long, env = "RUST_LOG", value_name = "FILTER", default_value = "info", value_parser = values::log_filter)]
    pub log_level: String,

    /// How long in-flight reconciles may take to finish after SIGTERM, e.g. `30s`, `2m`.
    #[arg(long, env = "SHUTDOWN_TIMEOUT", value_name = "DURATION", default_value = "30s", value_parser = values::duration)]
    pub shutdown_timeout: Duration,

    /// The fulfilment links and page.
    #[command(flatten)]
    pub fulfilment: fulfilment::Flags,

    /// Kubeconfig file [default: $KUBECONFIG, the in-cluster service account, ~/.kube/config].
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
}

/// Log output format.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// A configuration field as the user knows it: its flag and environment variable.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Field {
    flag: String,
    env: String,
}

impl Field {
    /// The flag declared by the field `id` of [`Args`] or of one of its groups (use the
    /// `field!` macro, which checks it).
    pub fn of(id: &str) -> Self {
        static COMMAND: LazyLock<Command> = LazyLock::new(Args::command);
        let arg = COMMAND.get_arguments().find(|a| a.get_id() == id);
        Self::from_arg(arg, id)
    }

    fn from_arg(arg: Option<&Arg>, id: &str) -> Self {
        Self {
            flag: arg.and_then(Arg::get_long).unwrap_or(id).to_owned(),
            env: arg
                .and_then(Arg::get_env)
                .map(|e| e.to_string_lossy().into_owned())
                .unwrap_or_default(),
        }
    }

    /// A variable that is no flag's (the secrets' fallbacks).
    pub fn variable(env: &str) -> Self {
        Self {
            flag: String::new(),
            env: env.to_owned(),
        }
    }

    /// The same field, also settable through the variable `env` (the secrets' fallbacks).
    pub fn or_env(mut self, env: &str) -> Self {
        self.env = format!("{}, or {env}", self.env);
        self
    }
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.flag.is_empty() {
            return f.write_str(&self.env);
        }
        write!(f, "--{} ({})", self.flag, self.env)
    }
}

/// Why the configuration was refused. Never contains a secret.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    /// A field has an unusable value.
    #[error("{field}: {reason}")]
    Invalid {
        /// The field, as flag and variable.
        field: Field,
        /// What is wrong.
        reason: String,
    },
    /// The config file could not be read or parsed.
    #[error("{}: {}: {reason}", field!(config in Args), path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// Not a command line (also `--help` and `--version`, which `main` lets clap print).
    #[error("{0}")]
    Usage(#[source] clap::Error),
    /// The config file's mailer section has an unusable value (a key without a flag).
    #[error("{}: mailer.{source}", field!(config in Args))]
    FileMailer {
        /// The mailer's own error, naming the key.
        #[source]
        source: ConfigError,
    },
}

fn invalid(field: Field, reason: impl Into<String>) -> SettingsError {
    SettingsError::Invalid {
        field,
        reason: reason.into(),
    }
}

/// Everything the process needs, validated. Holds no secret values (only where to read them).
#[derive(Debug, Clone)]
pub struct Settings {
    /// What runs: everything, or only the fulfilment page.
    pub role: Role,
    /// The diagnostics endpoint (`/metrics`), if enabled.
    pub diagnostics: Option<Diagnostics>,
    /// Deprecated settings in use, one sentence each, for a warning at start.
    pub deprecations: Vec<String>,
    /// `/healthz` + `/readyz` address, if enabled.
    pub probe_address: Option<SocketAddr>,
    /// Log format.
    pub log_format: LogFormat,
    /// Log filter directives.
    pub log_level: String,
    /// Bound on the graceful shutdown.
    pub shutdown_timeout: Duration,
    /// Explicit kubeconfig file.
    pub kubeconfig: Option<PathBuf>,
}

/// What the process runs (`--mode`), with the settings only that needs.
#[derive(Debug, Clone)]
pub enum Role {
    /// The controllers, the webhooks, leader election, the links and page (`--mode all`).
    All(Box<Manager>),
    /// Only the fulfilment page (`--mode fulfilment-page`).
    FulfilmentPage(PageOnly),
}

/// The settings of `--mode all`.
#[derive(Debug, Clone)]
pub struct Manager {
    /// The mail backend.
    pub mailer: MailerConfig,
    /// The controllers' configuration (`instance` is filled in at start).
    pub controllers: capm_controllers::Config,
    /// Leader election, if enabled.
    pub leader_election: Option<LeaderElection>,
    /// The conversion webhook, if enabled.
    pub webhook: Option<Webhook>,
    /// The fulfilment links and page, if configured.
    pub fulfilment: Option<Fulfilment>,
}

/// Reads the process environment (the few variables that are not flags' fallbacks).
pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

impl Settings {
    /// Parses `argv` with `command` (`Args::command()`, or a variant of it), applies the
    /// `--config` file, and validates everything. Touches no network and reads no secret.
    ///
    /// The file's values become the flags' defaults, so a flag still beats its variable, which
    /// beats the file, which beats the built-in default, and every value goes through its flag's
    /// parser.
    ///
    /// `env` looks up the variables that are not flag fallbacks: `MAILGUN_API_KEY` and
    /// `SMTP_PASSWORD` (only whether they are set) and `POD_NAMESPACE`.
    ///
    /// # Errors
    /// [`SettingsError`] naming the first field that is wrong; [`SettingsError::Usage`] for what
    /// is not a command line at all (and for `--help` and `--version`).
    pub fn resolve(
        command: Command,
        argv: &[OsString],
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, SettingsError> {
        let args = parse(command.clone(), argv).map_err(usage_error)?;
        let Some(path) = args.config.clone() else {
            return Self::from_args(args, None, env);
        };
        let (mailer, defaults) = read_file(&path)?;
        let mut command = command;
        for (id, values) in defaults {
            if !command.get_arguments().any(|a| a.get_id() == id.as_str())
                || FLAG_ONLY.contains(&id.as_str())
            {
                let key = snake_to_camel(&id);
                return Err(file_error(&path, format!("unknown field `{key}`")));
            }
            // `Arg` keeps `&'static str`s; the file is read once per process.
            let values: Vec<&'static str> = values.into_iter().map(|v| &*v.leak()).collect();
            command = command.mut_arg(id, |a| a.default_values(values));
        }
        let args = parse(command, argv).map_err(|e| {
            // clap's first line names the flag and the value; the rest is usage advice.
            let text = e.to_string();
            let line = text.lines().next().unwrap_or_default();
            file_error(&path, line.trim_start_matches("error: ").to_owned())
        })?;
        Self::from_args(args, mailer, env)
    }

    fn from_args(
        args: Args,
        file_mailer: Option<MailerConfig>,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Self, SettingsError> {
        let mut deprecations = Vec::new();
        let endpoints = endpoints::resolve(args.endpoints, &mut deprecations)?;
        let role = match args.mode {
            Mode::FulfilmentPage => Role::FulfilmentPage(mode::resolve_page_only(
                &args.mailer,
                &args.controllers,
                args.fulfilment,
                file_mailer.as_ref(),
                env,
            )?),
            Mode::All => {
                let mailer = mailer::resolve(&args.mailer, file_mailer, env)?;
                let (mut controllers, identity_secret_namespace) = controllers::resolve(
                    args.controllers,
                    tenancy::resolve(args.tenancy),
                    &mailer,
                )?;
                let leader_election = leader::resolve(args.leader, env)?;
                controllers.identity_secret_namespace =
                    controllers::identity_secret_namespace(identity_secret_namespace, env)?;
                Role::All(Box::new(Manager {
                    fulfilment: fulfilment::resolve(args.fulfilment)?,
                    mailer,
                    controllers,
                    leader_election,
                    webhook: endpoints.webhook,
                }))
            }
        };
        Ok(Self {
            role,
            diagnostics: endpoints.diagnostics,
            deprecations,
            probe_address: endpoints.probe_address,
            log_format: args.log_format,
            log_level: args.log_level,
            shutdown_timeout: args.shutdown_timeout,
            kubeconfig: args.kubeconfig,
        })
    }
}

fn parse(command: Command, argv: &[OsString]) -> Result<Args, clap::Error> {
    let mut matches = command.try_get_matches_from(argv)?;
    Args::from_arg_matches_mut(&mut matches)
}

/// A value one of this module's parsers refused names the flag and its variable, like every
/// other invalid setting (exit status 1); clap's own refusals stay usage errors (exit status 2).
fn usage_error(error: clap::Error) -> SettingsError {
    let refused =
        std::error::Error::source(&error).and_then(|e| e.downcast_ref::<values::Refused>());
    // The declaration, not the caller's variant of it: tests turn the variables off.
    let command = Args::command();
    let arg = match error.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(arg)) => {
            let long = arg.trim_start_matches("--").split([' ', '=']).next();
            command.get_arguments().find(|a| a.get_long() == long)
        }
        _ => None,
    };
    match (arg, refused) {
        (Some(arg), Some(values::Refused(reason))) => {
            invalid(Field::from_arg(Some(arg), ""), reason.clone())
        }
        _ => SettingsError::Usage(error),
    }
}

fn in_cluster_namespace() -> Option<String> {
    std::fs::read_to_string(IN_CLUSTER_NAMESPACE_FILE)
        .ok()
        .map(|ns| ns.trim().to_owned())
        .filter(|ns| !ns.is_empty())
}
