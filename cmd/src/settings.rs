//! Command line, environment and config file, resolved into one validated [`Settings`].
//!
//! Precedence, highest first: command-line flag, its environment variable, the `--config` file,
//! the built-in default. Secrets are never values here: the Mailgun API key and the SMTP password
//! are read by the mailer from a file (`--mailgun-api-key-file`, `--smtp-password-file`) or from
//! the environment variables `MAILGUN_API_KEY` / `SMTP_PASSWORD`, so neither `Debug` nor an error
//! message can show them.
//!
//! Why this file is long: [`Args`] is the one declaration of every setting (its `--help` text,
//! flag, variable, default and parser), and a third of the file is tests pinning each error.

use std::{
    borrow::Cow,
    ffi::OsString,
    fmt,
    net::{Ipv4Addr, SocketAddr},
    path::{Path, PathBuf},
    sync::LazyLock,
    time::Duration,
};

use capm_mailer::{
    ConfigError, MailerConfig, MailgunConfig, MailgunRegion, SecretSource, SmtpConfig,
};
use clap::{
    Command, FromArgMatches, Parser, ValueEnum,
    builder::BoolishValueParser,
    error::{ContextKind, ContextValue},
};

/// Environment variable holding the Mailgun API key (the walkthrough's name).
pub const MAILGUN_API_KEY_ENV: &str = "MAILGUN_API_KEY";
/// Environment variable holding the SMTP password.
pub const SMTP_PASSWORD_ENV: &str = "SMTP_PASSWORD";
/// Where Kubernetes mounts the pod's namespace.
const IN_CLUSTER_NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";
/// controller-runtime's default webhook certificate directory.
const DEFAULT_WEBHOOK_CERT_DIR: &str = "/tmp/k8s-webhook-server/serving-certs";

/// The Cluster API infrastructure provider for Mailgun: mails a human for every cluster.
///
/// Every flag can also be set by the environment variable shown, or in the `--config` file
/// (camelCase keys, e.g. `metricsBindAddress`; the mail backend under `mailer`, in the format of
/// `capm_mailer::MailerConfig`). A flag beats its variable, which beats the file, which beats the
/// default.
///
/// Each setting is declared here once: its flag, variable, default and parser. The file's values
/// become the flags' defaults (see [`Settings::resolve`]), so nothing else lists the settings.
#[derive(Debug, Parser)]
#[command(name = "cluster-api-provider-mailgun", version, about, long_about)]
pub struct Args {
    /// Config file, YAML or JSON. Flags and environment variables override its values.
    #[arg(long, env = "CAPM_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Mail backend [default: mailgun when a Mailgun domain is set, else smtp when an SMTP URL is
    /// set].
    #[arg(long, env = "MAIL_BACKEND", value_enum)]
    pub mail_backend: Option<Backend>,

    /// Who receives the request mails; comma-separated for several (required).
    #[arg(
        long = "mail-recipient",
        env = "MAIL_RECIPIENT",
        value_delimiter = ',',
        value_name = "ADDRESS",
        value_parser = recipient
    )]
    pub mail_recipients: Option<Vec<String>>,

    /// Mailgun sending domain (required for the mailgun backend).
    #[arg(long, env = "MAILGUN_DOMAIN", value_name = "DOMAIN")]
    pub mailgun_domain: Option<String>,

    /// File holding the Mailgun API key [default: read the key from $MAILGUN_API_KEY].
    #[arg(long, env = "MAILGUN_API_KEY_FILE", value_name = "FILE")]
    pub mailgun_api_key_file: Option<PathBuf>,

    /// Mailgun API region [default: us].
    #[arg(long, env = "MAILGUN_REGION", value_enum)]
    pub mailgun_region: Option<Region>,

    /// Mailgun API base URL, overrides --mailgun-region (e.g. a test server).
    #[arg(long, env = "MAILGUN_BASE_URL", value_name = "URL")]
    pub mailgun_base_url: Option<String>,

    /// SMTP relay: smtp://host[:port] (STARTTLS, port 587) or smtps://host[:port] (TLS, 465)
    /// (required for the smtp backend).
    #[arg(long, env = "SMTP_URL", value_name = "URL")]
    pub smtp_url: Option<String>,

    /// SMTP AUTH user name (needs a password).
    #[arg(long, env = "SMTP_USERNAME", value_name = "USER")]
    pub smtp_username: Option<String>,

    /// File holding the SMTP password [default: read it from $SMTP_PASSWORD if set].
    #[arg(long, env = "SMTP_PASSWORD_FILE", value_name = "FILE")]
    pub smtp_password_file: Option<PathBuf>,

    /// PEM file with the CA(s) of a private SMTP relay; only these are trusted then [default:
    /// the system's roots].
    #[arg(long, env = "SMTP_CA_FILE", value_name = "FILE")]
    pub smtp_ca_file: Option<PathBuf>,

    /// Domain of the generated Message-Ids [default: the Mailgun domain, or the SMTP relay's
    /// host].
    #[arg(long, env = "MESSAGE_ID_DOMAIN", value_name = "DOMAIN")]
    pub message_id_domain: Option<String>,

    /// Reconcile only this namespace [default: all namespaces].
    #[arg(long, env = "WATCH_NAMESPACE", value_name = "NAMESPACE", value_parser = namespace)]
    pub namespace: Option<String>,

    /// Reconcile only objects labelled cluster.x-k8s.io/watch-filter=<VALUE> [default: all].
    #[arg(long, env = "WATCH_FILTER", value_name = "VALUE", value_parser = label_value)]
    pub watch_filter: Option<String>,

    /// Reconciles running at once per controller.
    #[arg(long, env = "CONCURRENCY", value_name = "N", default_value_t = 10)]
    pub concurrency: u16,

    /// First retry delay of an object after an error; doubles with each consecutive failure.
    #[arg(long, env = "BACKOFF_BASE", value_name = "DURATION", default_value = "500ms", value_parser = duration)]
    pub backoff_base: Duration,

    /// Longest retry delay of an object, also the delay after a permanent error.
    #[arg(long, env = "BACKOFF_MAX", value_name = "DURATION", default_value = "5m", value_parser = duration)]
    pub backoff_max: Duration,

    /// How long the mail backend must keep answering "not found" for a mail whose outcome was
    /// unknown before it is sent again (event stores lag behind sends).
    #[arg(long, env = "LOOKUP_GRACE", value_name = "DURATION", default_value = "10s", value_parser = duration)]
    pub lookup_grace: Duration,

    /// Address of the diagnostics endpoint (/metrics): HTTPS, each request authenticated
    /// (TokenReview) and authorized (SubjectAccessReview: `get` on the non-resource URL
    /// `/metrics`) by the API server; `0` disables it [default: :8443].
    #[arg(long, env = "DIAGNOSTICS_ADDRESS", value_name = "ADDR")]
    pub diagnostics_address: Option<String>,

    /// Serve diagnostics over plain HTTP without authentication or authorization [default:
    /// false].
    #[arg(
        long,
        env = "INSECURE_DIAGNOSTICS",
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_missing_value = "true",
        value_parser = BoolishValueParser::new()
    )]
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

    /// Elect a leader on a Lease so only one replica reconciles.
    #[arg(
        long,
        env = "LEADER_ELECT",
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_value = "true",
        default_missing_value = "true",
        value_parser = BoolishValueParser::new()
    )]
    pub leader_elect: bool,

    /// Namespace of the leader-election Lease [default: $POD_NAMESPACE, else the in-cluster
    /// namespace, else `default`].
    #[arg(long, env = "LEADER_ELECTION_NAMESPACE", value_name = "NAMESPACE")]
    pub leader_election_namespace: Option<String>,

    /// Name of the leader-election Lease.
    #[arg(
        long,
        env = "LEADER_ELECTION_ID",
        value_name = "NAME",
        default_value = "cluster-api-provider-mailgun-leader"
    )]
    pub leader_election_id: String,

    /// How long a Lease is valid after its last renewal; longer than the renew deadline.
    #[arg(long, env = "LEADER_ELECT_LEASE_DURATION", value_name = "DURATION", default_value = "15s", value_parser = duration)]
    pub leader_elect_lease_duration: Duration,

    /// How long the leader keeps trying to renew before it gives up; longer than the retry period.
    #[arg(long, env = "LEADER_ELECT_RENEW_DEADLINE", value_name = "DURATION", default_value = "10s", value_parser = duration)]
    pub leader_elect_renew_deadline: Duration,

    /// How often candidates try to acquire the Lease and the leader renews it.
    #[arg(long, env = "LEADER_ELECT_RETRY_PERIOD", value_name = "DURATION", default_value = "2s", value_parser = duration)]
    pub leader_elect_retry_period: Duration,

    /// Port of the conversion webhook (HTTPS, all interfaces); `0` disables it.
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

    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t)]
    pub log_format: LogFormat,

    /// Log filter: a level (`info`) or tracing directives (`info,kube=debug`).
    #[arg(long, env = "RUST_LOG", value_name = "FILTER", default_value = "info", value_parser = log_filter)]
    pub log_level: String,

    /// How long in-flight reconciles may take to finish after SIGTERM, e.g. `30s`, `2m`.
    #[arg(long, env = "SHUTDOWN_TIMEOUT", value_name = "DURATION", default_value = "30s", value_parser = duration)]
    pub shutdown_timeout: Duration,

    /// Kubeconfig file [default: $KUBECONFIG, the in-cluster service account, ~/.kube/config].
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
}

/// Flags the config file cannot set: the file itself, and the mail backend's flags (the file
/// has its own `mailer` section for those).
const FLAG_ONLY: &[&str] = &[
    "help",
    "version",
    "config",
    "mail_backend",
    "mailgun_domain",
    "mailgun_api_key_file",
    "mailgun_region",
    "mailgun_base_url",
    "smtp_url",
    "smtp_username",
    "smtp_password_file",
    "smtp_ca_file",
    "kubeconfig",
];

/// The mail backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// Mailgun's HTTP API.
    Mailgun,
    /// Any SMTP relay.
    Smtp,
}

/// Mailgun's API regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Region {
    /// api.mailgun.net
    Us,
    /// api.eu.mailgun.net
    Eu,
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
    flag: Cow<'static, str>,
    env: Cow<'static, str>,
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "--{} ({})", self.flag, self.env)
    }
}

macro_rules! fields {
    ($($name:ident = $flag:literal, $env:literal;)*) => {
        $(#[allow(missing_docs)] pub const $name: Field =
            Field { flag: Cow::Borrowed($flag), env: Cow::Borrowed($env) };)*
    };
}

/// The fields that can be named in an error.
pub mod field {
    use super::Field;
    use std::borrow::Cow;
    fields! {
        CONFIG = "config", "CAPM_CONFIG";
        MAIL_BACKEND = "mail-backend", "MAIL_BACKEND";
        MAIL_RECIPIENT = "mail-recipient", "MAIL_RECIPIENT";
        MAILGUN_DOMAIN = "mailgun-domain", "MAILGUN_DOMAIN";
        MAILGUN_API_KEY = "mailgun-api-key-file", "MAILGUN_API_KEY_FILE, or MAILGUN_API_KEY";
        MAILGUN_BASE_URL = "mailgun-base-url", "MAILGUN_BASE_URL";
        SMTP_URL = "smtp-url", "SMTP_URL";
        SMTP_USERNAME = "smtp-username", "SMTP_USERNAME";
        SMTP_PASSWORD = "smtp-password-file", "SMTP_PASSWORD_FILE, or SMTP_PASSWORD";
        SMTP_CA_FILE = "smtp-ca-file", "SMTP_CA_FILE";
        MESSAGE_ID_DOMAIN = "message-id-domain", "MESSAGE_ID_DOMAIN";
        CONCURRENCY = "concurrency", "CONCURRENCY";
        DIAGNOSTICS_ADDRESS = "diagnostics-address", "DIAGNOSTICS_ADDRESS";
        INSECURE_DIAGNOSTICS = "insecure-diagnostics", "INSECURE_DIAGNOSTICS";
        DIAGNOSTICS_CERT_DIR = "diagnostics-cert-dir", "DIAGNOSTICS_CERT_DIR";
        METRICS_BIND_ADDRESS = "metrics-bind-address", "METRICS_BIND_ADDRESS";
        HEALTH_PROBE_BIND_ADDRESS = "health-probe-bind-address", "HEALTH_PROBE_BIND_ADDRESS";
        LEADER_ELECTION_NAMESPACE = "leader-election-namespace", "LEADER_ELECTION_NAMESPACE";
        LEADER_ELECTION_ID = "leader-election-id", "LEADER_ELECTION_ID";
        WEBHOOK_CERT_DIR = "webhook-cert-dir", "WEBHOOK_CERT_DIR";
        BACKOFF_BASE = "backoff-base", "BACKOFF_BASE";
        BACKOFF_MAX = "backoff-max", "BACKOFF_MAX";
        LOOKUP_GRACE = "lookup-grace", "LOOKUP_GRACE";
        LEADER_ELECT_LEASE_DURATION = "leader-elect-lease-duration", "LEADER_ELECT_LEASE_DURATION";
        LEADER_ELECT_RENEW_DEADLINE = "leader-elect-renew-deadline", "LEADER_ELECT_RENEW_DEADLINE";
        LEADER_ELECT_RETRY_PERIOD = "leader-elect-retry-period", "LEADER_ELECT_RETRY_PERIOD";
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
    #[error("{}: {}: {reason}", field::CONFIG, path.display())]
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
    #[error("{}: mailer.{source}", field::CONFIG)]
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

/// Maps a mailer configuration error to the flag that sets the field, when there is one.
pub fn mailer_error(error: ConfigError) -> SettingsError {
    let flag = |name: &str| match name {
        "mailgun.domain" => Some(field::MAILGUN_DOMAIN),
        "mailgun.apiKey" => Some(field::MAILGUN_API_KEY),
        "mailgun.baseUrl" => Some(field::MAILGUN_BASE_URL),
        "smtp.url" => Some(field::SMTP_URL),
        "smtp.username" => Some(field::SMTP_USERNAME),
        "smtp.password" => Some(field::SMTP_PASSWORD),
        "smtp.caFile" => Some(field::SMTP_CA_FILE),
        _ => None,
    };
    let named = match &error {
        ConfigError::Invalid { field, reason } | ConfigError::CaFile { field, reason } => {
            flag(field).map(|f| (f, reason.clone()))
        }
        ConfigError::Secret { field, source } => flag(field).map(|f| (f, source.to_string())),
        ConfigError::Client { .. } => None,
    };
    match named {
        Some((field, reason)) => invalid(field, reason),
        None => SettingsError::FileMailer { source: error },
    }
}

/// Leader-election parameters (controller-runtime's defaults).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaderElection {
    /// Namespace of the Lease.
    pub namespace: String,
    /// Name of the Lease.
    pub name: String,
    /// How long a Lease is valid after its last renewal: 15 s.
    pub lease_duration: Duration,
    /// How long the leader keeps trying to renew before it gives up: 10 s.
    pub renew_deadline: Duration,
    /// How often candidates try to acquire and the leader renews: 2 s.
    pub retry_period: Duration,
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

/// Everything the manager needs, validated. Holds no secret values (only where to read them).
#[derive(Debug, Clone)]
pub struct Settings {
    /// The mail backend.
    pub mailer: MailerConfig,
    /// The controllers' configuration (`instance` is filled in at start).
    pub controllers: capm_controllers::Config,
    /// The diagnostics endpoint (`/metrics`), if enabled.
    pub diagnostics: Option<Diagnostics>,
    /// Deprecated settings in use, one sentence each, for a warning at start.
    pub deprecations: Vec<String>,
    /// `/healthz` + `/readyz` address, if enabled.
    pub probe_address: Option<SocketAddr>,
    /// Leader election, if enabled.
    pub leader_election: Option<LeaderElection>,
    /// The conversion webhook, if enabled.
    pub webhook: Option<Webhook>,
    /// Log format.
    pub log_format: LogFormat,
    /// Log filter directives.
    pub log_level: String,
    /// Bound on the graceful shutdown.
    pub shutdown_timeout: Duration,
    /// Explicit kubeconfig file.
    pub kubeconfig: Option<PathBuf>,
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
        let mailer = resolve_mailer(&args, file_mailer, env)?;

        let recipients = args
            .mail_recipients
            .filter(|r| !r.is_empty())
            .ok_or_else(|| invalid(field::MAIL_RECIPIENT, "at least one recipient is required"))?;

        let message_id_domain = match args.message_id_domain {
            Some(domain) => domain,
            None => default_message_id_domain(&mailer).ok_or_else(|| {
                invalid(
                    field::MESSAGE_ID_DOMAIN,
                    "required: the SMTP relay's host cannot serve as Message-Id domain",
                )
            })?,
        };
        if capm_mailer::MessageId::new("x", &message_id_domain).is_err() {
            return Err(invalid(
                field::MESSAGE_ID_DOMAIN,
                format!("{message_id_domain:?} is not a domain (letters, digits, '-' and '.')"),
            ));
        }

        if args.concurrency == 0 {
            return Err(invalid(field::CONCURRENCY, "must be at least 1"));
        }
        if args.backoff_base.is_zero() {
            return Err(invalid(field::BACKOFF_BASE, "must be positive"));
        }
        if args.backoff_base > args.backoff_max {
            return Err(invalid(
                field::BACKOFF_BASE,
                format!("must not be longer than {}", field::BACKOFF_MAX),
            ));
        }
        if args.lookup_grace.is_zero() {
            return Err(invalid(field::LOOKUP_GRACE, "must be positive"));
        }

        let mut deprecations = Vec::new();
        let diagnostics = resolve_diagnostics(
            args.diagnostics_address,
            args.insecure_diagnostics,
            args.diagnostics_cert_dir,
            args.metrics_bind_address,
            &mut deprecations,
        )?;
        let probe_address = bind_address(
            field::HEALTH_PROBE_BIND_ADDRESS,
            &args.health_probe_bind_address,
        )?;

        let (lease_duration, renew_deadline, retry_period) = (
            args.leader_elect_lease_duration,
            args.leader_elect_renew_deadline,
            args.leader_elect_retry_period,
        );
        if renew_deadline >= lease_duration {
            return Err(invalid(
                field::LEADER_ELECT_RENEW_DEADLINE,
                format!(
                    "must be shorter than {}",
                    field::LEADER_ELECT_LEASE_DURATION
                ),
            ));
        }
        if retry_period.is_zero() || retry_period >= renew_deadline {
            return Err(invalid(
                field::LEADER_ELECT_RETRY_PERIOD,
                format!(
                    "must be positive and shorter than {}",
                    field::LEADER_ELECT_RENEW_DEADLINE
                ),
            ));
        }
        let leader_election = if args.leader_elect {
            let namespace = args
                .leader_election_namespace
                .or_else(|| env("POD_NAMESPACE"))
                .or_else(in_cluster_namespace)
                .unwrap_or_else(|| "default".to_owned());
            let namespace = self::namespace(&namespace)
                .map_err(|r| invalid(field::LEADER_ELECTION_NAMESPACE, r.0))?;
            check_dns_subdomain(field::LEADER_ELECTION_ID, &args.leader_election_id)?;
            Some(LeaderElection {
                namespace,
                name: args.leader_election_id,
                lease_duration,
                renew_deadline,
                retry_period,
            })
        } else {
            None
        };

        let webhook = (args.webhook_port != 0).then(|| Webhook {
            bind: SocketAddr::from((Ipv4Addr::UNSPECIFIED, args.webhook_port)),
            cert_dir: args.webhook_cert_dir,
        });

        Ok(Self {
            mailer,
            controllers: capm_controllers::Config {
                recipients,
                message_id_domain,
                namespace: args.namespace,
                watch_filter: args.watch_filter,
                concurrency: args.concurrency,
                backoff_base: args.backoff_base,
                backoff_max: args.backoff_max,
                lookup_grace: args.lookup_grace,
                // Both are known only once the process runs (see `app::run`).
                instance: String::new(),
                leadership: capm_controllers::Leadership::default(),
            },
            diagnostics,
            deprecations,
            probe_address,
            leader_election,
            webhook,
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
    let refused = std::error::Error::source(&error).and_then(|e| e.downcast_ref::<Refused>());
    // The declaration, not the caller's variant of it: tests turn the variables off.
    let command = <Args as clap::CommandFactory>::command();
    let arg = match error.get(ContextKind::InvalidArg) {
        Some(ContextValue::String(arg)) => {
            let long = arg.trim_start_matches("--").split([' ', '=']).next();
            command.get_arguments().find(|a| a.get_long() == long)
        }
        _ => None,
    };
    match (arg, refused) {
        (Some(arg), Some(Refused(reason))) => invalid(
            Field {
                flag: Cow::Owned(arg.get_long().unwrap_or_default().to_owned()),
                env: Cow::Owned(
                    arg.get_env()
                        .map(|e| e.to_string_lossy().into_owned())
                        .unwrap_or_default(),
                ),
            },
            reason.clone(),
        ),
        _ => SettingsError::Usage(error),
    }
}

fn file_error(path: &Path, reason: String) -> SettingsError {
    SettingsError::File {
        path: path.to_owned(),
        reason,
    }
}

fn snake_to_camel(id: &str) -> String {
    let mut parts = id.split('_');
    let mut out = parts.next().unwrap_or_default().to_owned();
    for part in parts {
        let mut chars = part.chars();
        if let Some(first) = chars.next() {
            out.extend(first.to_uppercase());
            out.push_str(chars.as_str());
        }
    }
    out
}

/// The file's `mailer` section and, for every other key, the flag it sets (by clap id,
/// snake_case) with its value(s) as the flag would take them.
type FileSettings = (Option<MailerConfig>, Vec<(String, Vec<String>)>);

fn read_file(path: &Path) -> Result<FileSettings, SettingsError> {
    let text = std::fs::read_to_string(path).map_err(|e| file_error(path, e.to_string()))?;
    if text.trim().is_empty() {
        return Ok((None, Vec::new()));
    }
    // YAML is a superset of JSON: one parser reads both. Going through a JSON value keeps the
    // mailer's `{mailgun: {...}}` form (serde_yaml_ng would want a `!mailgun` tag).
    let value: serde_json::Value =
        serde_yaml_ng::from_str(&text).map_err(|e| file_error(path, e.to_string()))?;
    let serde_json::Value::Object(mut map) = value else {
        return Err(file_error(path, "expected a map of settings".into()));
    };
    let mailer = match map.remove("mailer") {
        None | Some(serde_json::Value::Null) => None,
        Some(v) => Some(serde_json::from_value(v).map_err(|e| file_error(path, e.to_string()))?),
    };
    let mut defaults = Vec::new();
    for (key, value) in map {
        let scalar = |v: serde_json::Value| match v {
            serde_json::Value::String(s) => Ok(s),
            serde_json::Value::Bool(_) | serde_json::Value::Number(_) => Ok(v.to_string()),
            other => Err(file_error(
                path,
                format!("{key}: {other} is not a single value"),
            )),
        };
        let values = match value {
            serde_json::Value::Null => continue,
            serde_json::Value::Array(items) => {
                items.into_iter().map(scalar).collect::<Result<_, _>>()?
            }
            other => vec![scalar(other)?],
        };
        let id = key.chars().fold(String::new(), |mut id, c| {
            if c.is_ascii_uppercase() {
                id.push('_');
            }
            id.push(c.to_ascii_lowercase());
            id
        });
        defaults.push((id, values));
    }
    Ok((mailer, defaults))
}

fn backend_of(config: &MailerConfig) -> Backend {
    match config {
        MailerConfig::Mailgun(_) => Backend::Mailgun,
        MailerConfig::Smtp(_) => Backend::Smtp,
    }
}

fn resolve_mailer(
    args: &Args,
    from_file: Option<MailerConfig>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<MailerConfig, SettingsError> {
    let backend = args
        .mail_backend
        .or(from_file.as_ref().map(backend_of))
        .or(args.mailgun_domain.as_ref().map(|_| Backend::Mailgun))
        .or(args.smtp_url.as_ref().map(|_| Backend::Smtp))
        .ok_or_else(|| {
            invalid(
                field::MAIL_BACKEND,
                format!(
                    "no mail backend configured: set {} for Mailgun or {} for SMTP",
                    field::MAILGUN_DOMAIN,
                    field::SMTP_URL
                ),
            )
        })?;
    let config = match backend {
        Backend::Mailgun => {
            let base = match from_file {
                Some(MailerConfig::Mailgun(c)) => Some(c),
                _ => None,
            };
            let domain = args
                .mailgun_domain
                .clone()
                .or(base.as_ref().map(|c| c.domain.clone()))
                .ok_or_else(|| {
                    invalid(field::MAILGUN_DOMAIN, "required for the mailgun backend")
                })?;
            let api_key = args
                .mailgun_api_key_file
                .clone()
                .map(SecretSource::File)
                .or_else(|| {
                    env(MAILGUN_API_KEY_ENV)
                        .map(|_| SecretSource::Env(MAILGUN_API_KEY_ENV.to_owned()))
                })
                .or(base.as_ref().map(|c| c.api_key.clone()))
                .ok_or_else(|| {
                    invalid(field::MAILGUN_API_KEY, "the Mailgun API key is required")
                })?;
            let mut config = base.unwrap_or_else(|| MailgunConfig::new(&domain, api_key.clone()));
            config.domain = domain;
            config.api_key = api_key;
            if let Some(region) = args.mailgun_region {
                config.region = match region {
                    Region::Us => MailgunRegion::Us,
                    Region::Eu => MailgunRegion::Eu,
                };
            }
            if let Some(url) = &args.mailgun_base_url {
                config.base_url = Some(url.clone());
            }
            MailerConfig::Mailgun(config)
        }
        Backend::Smtp => {
            let base = match from_file {
                Some(MailerConfig::Smtp(c)) => Some(c),
                _ => None,
            };
            let url = args
                .smtp_url
                .clone()
                .or(base.as_ref().map(|c| c.url.clone()))
                .ok_or_else(|| invalid(field::SMTP_URL, "required for the smtp backend"))?;
            let mut config = base.unwrap_or_else(|| SmtpConfig::new(&url));
            config.url = url;
            if let Some(user) = &args.smtp_username {
                config.username = Some(user.clone());
            }
            if let Some(path) = &args.smtp_password_file {
                config.password = Some(SecretSource::File(path.clone()));
            } else if env(SMTP_PASSWORD_ENV).is_some() {
                config.password = Some(SecretSource::Env(SMTP_PASSWORD_ENV.to_owned()));
            }
            if let Some(path) = &args.smtp_ca_file {
                config.ca_file = Some(path.clone());
            }
            MailerConfig::Smtp(config)
        }
    };
    config.validate().map_err(mailer_error)?;
    Ok(config)
}

/// A plain address, the same rule as `MailgunCluster.spec.requester`.
static ADDRESS: LazyLock<Option<regex::Regex>> =
    LazyLock::new(|| regex::Regex::new(capm_api::validation::REQUESTER_PATTERN).ok());

/// Why one of this module's value parsers refused a value; the caller names the flag.
#[derive(Debug)]
struct Refused(String);

impl fmt::Display for Refused {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

fn recipient(value: &str) -> Result<String, Refused> {
    let address = value.trim();
    if ADDRESS.as_ref().is_some_and(|re| re.is_match(address)) {
        Ok(address.to_owned())
    } else {
        Err(Refused(format!("{address:?} is not an e-mail address")))
    }
}

fn default_message_id_domain(mailer: &MailerConfig) -> Option<String> {
    match mailer {
        MailerConfig::Mailgun(c) => Some(c.domain.clone()),
        MailerConfig::Smtp(c) => {
            let rest = c
                .url
                .strip_prefix("smtps://")
                .or_else(|| c.url.strip_prefix("smtp://"))?;
            let host = rest.split([':', '/']).next()?;
            (!host.is_empty() && !host.starts_with('[')).then(|| host.to_owned())
        }
    }
}

fn namespace(value: &str) -> Result<String, Refused> {
    let ok = !value.is_empty()
        && value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !value.starts_with('-')
        && !value.ends_with('-');
    if ok {
        Ok(value.to_owned())
    } else {
        Err(Refused(format!(
            "{value:?} is not a namespace name (lower-case letters, digits, '-')"
        )))
    }
}

fn check_dns_subdomain(field: Field, value: &str) -> Result<(), SettingsError> {
    let ok = !value.is_empty()
        && value.len() <= 253
        && value.split('.').all(|part| {
            !part.is_empty()
                && part
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        });
    if ok {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("{value:?} is not an object name (lower-case letters, digits, '-', '.')"),
        ))
    }
}

fn label_value(value: &str) -> Result<String, Refused> {
    let ok = value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && value.starts_with(|c: char| c.is_ascii_alphanumeric())
        && value.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        Ok(value.to_owned())
    } else {
        Err(Refused(format!(
            "{value:?} is not a label value (at most 63 letters, digits, '-', '_', '.')"
        )))
    }
}

fn log_filter(value: &str) -> Result<String, Refused> {
    match tracing_subscriber::EnvFilter::try_new(value) {
        Ok(_) => Ok(value.to_owned()),
        Err(e) => Err(Refused(format!("{value:?}: {e}"))),
    }
}

/// `0` disables; `:8080` means every interface, as in controller-runtime.
fn bind_address(field: Field, value: &str) -> Result<Option<SocketAddr>, SettingsError> {
    if value == "0" {
        return Ok(None);
    }
    let parsed = match value.strip_prefix(':') {
        Some(port) => port
            .parse::<u16>()
            .ok()
            .map(|port| SocketAddr::from((Ipv4Addr::UNSPECIFIED, port))),
        None => value.parse::<SocketAddr>().ok(),
    };
    parsed.map(Some).ok_or_else(|| {
        invalid(
            field,
            format!("{value:?} is not host:port (e.g. 127.0.0.1:8080 or :8080), or 0 to disable"),
        )
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
                field::METRICS_BIND_ADDRESS,
                format!(
                    "deprecated and replaced by {}: set only that one",
                    field::DIAGNOSTICS_ADDRESS
                ),
            ));
        }
        (None, Some(old)) => {
            if insecure == Some(false) {
                return Err(invalid(
                    field::METRICS_BIND_ADDRESS,
                    format!(
                        "serves plain HTTP, which {} false forbids: use {} instead",
                        field::INSECURE_DIAGNOSTICS,
                        field::DIAGNOSTICS_ADDRESS
                    ),
                ));
            }
            deprecations.push(format!(
                "{} is deprecated: use {} with {} (or drop it for HTTPS with authentication)",
                field::METRICS_BIND_ADDRESS,
                field::DIAGNOSTICS_ADDRESS,
                field::INSECURE_DIAGNOSTICS
            ));
            (bind_address(field::METRICS_BIND_ADDRESS, &old)?, true)
        }
        (address, None) => (
            bind_address(
                field::DIAGNOSTICS_ADDRESS,
                address.as_deref().unwrap_or(":8443"),
            )?,
            insecure.unwrap_or(false),
        ),
    };
    if insecure && let Some(dir) = &cert_dir {
        return Err(invalid(
            field::DIAGNOSTICS_CERT_DIR,
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

fn in_cluster_namespace() -> Option<String> {
    std::fs::read_to_string(IN_CLUSTER_NAMESPACE_FILE)
        .ok()
        .map(|ns| ns.trim().to_owned())
        .filter(|ns| !ns.is_empty())
}

/// `30s`, `2m`, `1h`, `500ms`, `1m30s` (jiff's friendly format, without calendar units: a day
/// is not always 24 hours) or plain seconds.
pub fn parse_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    if let Ok(seconds) = text.parse::<f64>() {
        return Duration::try_from_secs_f64(seconds).ok();
    }
    let signed: jiff::SignedDuration = text.parse().ok()?;
    Duration::try_from(signed).ok()
}

/// [`parse_duration`] as a flag's value parser.
fn duration(text: &str) -> Result<Duration, Refused> {
    parse_duration(text)
        .ok_or_else(|| Refused(format!("{text:?} is not a duration like 30s, 2m or 500ms")))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// Flags only: clap's environment fallbacks are turned off, so the tests do not depend on
    /// the variables of whoever runs them.
    fn flags_only() -> Command {
        use clap::CommandFactory;
        let mut command = Args::command();
        let ids: Vec<_> = command
            .get_arguments()
            .map(|a| a.get_id().clone())
            .collect();
        for id in ids {
            command = command.mut_arg(id, |a| a.env(None::<&str>));
        }
        command
    }

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn with_key(name: &str) -> Option<String> {
        (name == MAILGUN_API_KEY_ENV).then(|| "key-topsecret".to_owned())
    }

    const MAILGUN: &[&str] = &[
        "--mailgun-domain",
        "mg.example.com",
        "--mail-recipient",
        "ops@example.com",
    ];

    fn resolve(
        flags: &[&str],
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Settings, SettingsError> {
        let argv: Vec<OsString> = std::iter::once("capm")
            .chain(flags.iter().copied())
            .map(Into::into)
            .collect();
        Settings::resolve(flags_only(), &argv, env)
    }

    fn error(flags: &[&str], env: &dyn Fn(&str) -> Option<String>) -> String {
        resolve(flags, env).unwrap_err().to_string()
    }

    fn file(content: &str) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), content).unwrap();
        f
    }

    #[test]
    fn walkthrough_variables_alone_give_the_mailgun_defaults() {
        let s = resolve(MAILGUN, &with_key).unwrap();
        let MailerConfig::Mailgun(m) = &s.mailer else {
            panic!("{:?}", s.mailer)
        };
        assert_eq!(m.domain, "mg.example.com");
        assert_eq!(m.api_key, SecretSource::Env("MAILGUN_API_KEY".into()));
        assert_eq!(m.region, MailgunRegion::Us);
        assert_eq!(s.controllers.recipients, ["ops@example.com"]);
        assert_eq!(s.controllers.message_id_domain, "mg.example.com");
        assert_eq!(s.controllers.concurrency, 10);
        assert_eq!(
            s.diagnostics,
            Some(Diagnostics {
                bind: "0.0.0.0:8443".parse().unwrap(),
                security: DiagnosticsSecurity::Secure { cert_dir: None },
            })
        );
        assert!(s.deprecations.is_empty());
        assert_eq!(s.probe_address, Some("127.0.0.1:8081".parse().unwrap()));
        let le = s.leader_election.as_ref().unwrap();
        assert_eq!(le.name, "cluster-api-provider-mailgun-leader");
        assert_eq!(
            (le.lease_duration, le.renew_deadline, le.retry_period),
            (
                Duration::from_secs(15),
                Duration::from_secs(10),
                Duration::from_secs(2)
            )
        );
        let hook = s.webhook.as_ref().unwrap();
        assert_eq!(hook.bind.port(), 9443);
        assert_eq!(hook.cert_dir, Path::new(DEFAULT_WEBHOOK_CERT_DIR));
        assert_eq!(s.shutdown_timeout, Duration::from_secs(30));
        assert_eq!(s.log_format, LogFormat::Text);
        assert!(!format!("{s:?}").contains("topsecret"));
    }

    #[test]
    fn the_example_config_files_in_config_manager_are_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config/manager");
        let load = |name: &str| {
            let path = dir.join(name);
            resolve(&["--config", path.to_str().unwrap()], &no_env)
                .unwrap_or_else(|e| panic!("{name}: {e}"))
        };
        let s = load("mailgun.yaml");
        let MailerConfig::Mailgun(m) = &s.mailer else {
            panic!("{:?}", s.mailer)
        };
        assert_eq!(m.domain, "mg.example.com");
        assert_eq!(
            m.api_key,
            SecretSource::File("/etc/capm/mailgun/api-key".into())
        );
        assert_eq!(
            s.diagnostics,
            Some(Diagnostics {
                bind: "0.0.0.0:8443".parse().unwrap(),
                security: DiagnosticsSecurity::Secure {
                    cert_dir: Some("/etc/capm/diagnostics".into())
                },
            })
        );
        let s = load("smtp.yaml");
        let MailerConfig::Smtp(c) = &s.mailer else {
            panic!("{:?}", s.mailer)
        };
        assert_eq!(c.url, "smtp://smtp.example.com:587");
        assert_eq!(c.username.as_deref(), Some("capm"));
        assert_eq!(s.controllers.recipients.len(), 2);
    }

    #[test]
    fn flags_override_the_file_which_overrides_defaults() {
        let f = file(
            r#"
mailer:
  mailgun: {domain: file.example.com, region: eu, apiKey: {file: /run/key}, testMode: true}
mailRecipients: [file@example.com]
concurrency: 3
diagnosticsAddress: "0"
leaderElect: false
webhookPort: 0
logFormat: json
shutdownTimeout: 5s
"#,
        );
        let path = f.path().to_str().unwrap();
        let s = resolve(&["--config", path], &no_env).unwrap();
        let MailerConfig::Mailgun(m) = &s.mailer else {
            panic!()
        };
        assert_eq!(
            (m.domain.as_str(), m.region, m.test_mode),
            ("file.example.com", MailgunRegion::Eu, true)
        );
        assert_eq!(m.api_key, SecretSource::File("/run/key".into()));
        assert_eq!(s.controllers.recipients, ["file@example.com"]);
        assert_eq!(s.controllers.concurrency, 3);
        assert_eq!(s.diagnostics, None);
        assert!(s.leader_election.is_none());
        assert!(s.webhook.is_none());
        assert_eq!(s.log_format, LogFormat::Json);
        assert_eq!(s.shutdown_timeout, Duration::from_secs(5));

        // Flags win; the environment's API key beats the file's key source; file-only keys stay.
        let s = resolve(
            &[
                "--config",
                path,
                "--mailgun-domain",
                "flag.example.com",
                "--mail-recipient",
                "a@example.com,b@example.com",
                "--concurrency",
                "7",
                "--leader-elect",
                "--diagnostics-address",
                ":9090",
                "--insecure-diagnostics",
                "--mailgun-region",
                "us",
            ],
            &with_key,
        )
        .unwrap();
        let MailerConfig::Mailgun(m) = &s.mailer else {
            panic!()
        };
        assert_eq!(
            (m.domain.as_str(), m.region, m.test_mode),
            ("flag.example.com", MailgunRegion::Us, true)
        );
        assert_eq!(m.api_key, SecretSource::Env("MAILGUN_API_KEY".into()));
        assert_eq!(s.controllers.recipients, ["a@example.com", "b@example.com"]);
        assert_eq!(s.controllers.concurrency, 7);
        assert_eq!(
            s.diagnostics,
            Some(Diagnostics {
                bind: "0.0.0.0:9090".parse().unwrap(),
                security: DiagnosticsSecurity::Insecure,
            })
        );
        assert!(s.leader_election.is_some());
        let s = resolve(
            &["--config", path, "--mailgun-api-key-file", "/k"],
            &with_key,
        )
        .unwrap();
        let MailerConfig::Mailgun(m) = &s.mailer else {
            panic!()
        };
        assert_eq!(
            m.api_key,
            SecretSource::File("/k".into()),
            "the file flag beats the variable"
        );
    }

    #[test]
    fn smtp_from_flags_and_json_file() {
        let s = resolve(
            &[
                "--smtp-url",
                "smtps://relay.example.com",
                "--smtp-username",
                "capm",
                "--smtp-password-file",
                "/run/pw",
                "--mail-recipient",
                "ops@example.com",
            ],
            &no_env,
        )
        .unwrap();
        let MailerConfig::Smtp(c) = &s.mailer else {
            panic!()
        };
        assert_eq!(c.password, Some(SecretSource::File("/run/pw".into())));
        assert_eq!(s.controllers.message_id_domain, "relay.example.com");
        let f = file(
            r#"{"mailer": {"smtp": {"url": "smtp://relay.example.com:2525", "pool": {"enabled": false}}}, "mailRecipients": ["x@example.com"], "messageIdDomain": "capm.example.com"}"#,
        );
        let s = resolve(&["--config", f.path().to_str().unwrap()], &|n| {
            (n == SMTP_PASSWORD_ENV).then(|| "pw".to_owned())
        });
        // A password without a user name is refused, naming the user-name flag.
        assert_eq!(
            s.unwrap_err().to_string(),
            "--smtp-username (SMTP_USERNAME): required with password"
        );
        let s = resolve(&["--config", f.path().to_str().unwrap()], &no_env).unwrap();
        let MailerConfig::Smtp(c) = &s.mailer else {
            panic!()
        };
        assert!(!c.pool.enabled);
        assert_eq!(s.controllers.message_id_domain, "capm.example.com");
    }

    #[test]
    fn leader_election_namespace_precedence() {
        let pod = |n: &str| match n {
            "POD_NAMESPACE" => Some("capm-system".to_owned()),
            _ => with_key(n),
        };
        let s = resolve(MAILGUN, &pod).unwrap();
        assert_eq!(s.leader_election.unwrap().namespace, "capm-system");
        let mut flags = MAILGUN.to_vec();
        flags.extend([
            "--leader-election-namespace",
            "other",
            "--leader-election-id",
            "my.lease",
        ]);
        let le = resolve(&flags, &pod).unwrap().leader_election.unwrap();
        assert_eq!(
            (le.namespace.as_str(), le.name.as_str()),
            ("other", "my.lease")
        );
        let mut flags = MAILGUN.to_vec();
        flags.push("--leader-elect=false");
        assert!(resolve(&flags, &pod).unwrap().leader_election.is_none());
    }

    #[test]
    fn every_invalid_field_is_named() {
        let cases: &[(&[&str], &str)] = &[
            (
                &["--mail-recipient", "ops@example.com"],
                "--mail-backend (MAIL_BACKEND): no mail backend configured",
            ),
            (
                &[
                    "--mail-backend",
                    "mailgun",
                    "--mail-recipient",
                    "ops@example.com",
                ],
                "--mailgun-domain (MAILGUN_DOMAIN): required",
            ),
            (
                &[
                    "--mail-backend",
                    "smtp",
                    "--mail-recipient",
                    "ops@example.com",
                ],
                "--smtp-url (SMTP_URL): required",
            ),
            (
                &["--mailgun-domain", "mg.example.com"],
                "--mail-recipient (MAIL_RECIPIENT): at least one recipient",
            ),
            (
                &[
                    "--mailgun-domain",
                    "mg.example.com",
                    "--mail-recipient",
                    "x",
                ],
                "--mail-recipient (MAIL_RECIPIENT): \"x\" is not an e-mail address",
            ),
            (
                &[
                    "--mailgun-domain",
                    "mg.example.com",
                    "--mail-recipient",
                    "a@example.com,",
                ],
                "--mail-recipient (MAIL_RECIPIENT): \"\" is not an e-mail address",
            ),
            (
                &[
                    "--mailgun-domain",
                    "bad domain",
                    "--mail-recipient",
                    "a@example.com",
                ],
                "--mailgun-domain (MAILGUN_DOMAIN): must be a DNS name",
            ),
            (
                &["--mailgun-base-url", "ftp://x"],
                "--mailgun-base-url (MAILGUN_BASE_URL): scheme",
            ),
            (
                &["--smtp-url", "http://x", "--mail-backend", "smtp"],
                "--smtp-url (SMTP_URL): scheme must be smtp or smtps",
            ),
            (
                &["--smtp-url", "smtp://[::1]:25", "--mail-backend", "smtp"],
                "--message-id-domain (MESSAGE_ID_DOMAIN): required",
            ),
            (
                &["--message-id-domain", "a b"],
                "--message-id-domain (MESSAGE_ID_DOMAIN): \"a b\" is not a domain",
            ),
            (
                &["--namespace", "Capi"],
                "--namespace (WATCH_NAMESPACE): \"Capi\" is not a namespace name",
            ),
            (
                &["--watch-filter=-x"],
                "--watch-filter (WATCH_FILTER): \"-x\" is not a label value",
            ),
            (
                &["--concurrency", "0"],
                "--concurrency (CONCURRENCY): must be at least 1",
            ),
            (
                &["--metrics-bind-address", "localhost"],
                "--metrics-bind-address (METRICS_BIND_ADDRESS): \"localhost\" is not host:port",
            ),
            (
                &["--diagnostics-address", "localhost"],
                "--diagnostics-address (DIAGNOSTICS_ADDRESS): \"localhost\" is not host:port",
            ),
            (
                &[
                    "--diagnostics-address",
                    ":1",
                    "--metrics-bind-address",
                    ":2",
                ],
                "--metrics-bind-address (METRICS_BIND_ADDRESS): deprecated and replaced by --diagnostics-address",
            ),
            (
                &[
                    "--metrics-bind-address",
                    ":2",
                    "--insecure-diagnostics=false",
                ],
                "--metrics-bind-address (METRICS_BIND_ADDRESS): serves plain HTTP",
            ),
            (
                &["--insecure-diagnostics", "--diagnostics-cert-dir", "/d"],
                "--diagnostics-cert-dir (DIAGNOSTICS_CERT_DIR): /d is only used over HTTPS",
            ),
            (
                &["--health-probe-bind-address", ":x"],
                "--health-probe-bind-address (HEALTH_PROBE_BIND_ADDRESS): \":x\" is not host:port",
            ),
            (
                &["--leader-election-namespace", "a_b"],
                "--leader-election-namespace (LEADER_ELECTION_NAMESPACE): \"a_b\" is not a namespace name",
            ),
            (
                &["--leader-election-id", "A"],
                "--leader-election-id (LEADER_ELECTION_ID): \"A\" is not an object name",
            ),
            (
                &["--log-level", "info,[="],
                "--log-level (RUST_LOG): \"info,[=\"",
            ),
            (
                &["--shutdown-timeout", "soon"],
                "--shutdown-timeout (SHUTDOWN_TIMEOUT): \"soon\" is not a duration",
            ),
        ];
        for (extra, expected) in cases {
            let mut flags: Vec<&str> = Vec::new();
            if !extra.iter().any(|f| f.starts_with("--mail")) && !extra.contains(&"--smtp-url") {
                flags.extend(MAILGUN);
            } else if !extra.contains(&"--mail-recipient") && !extra.contains(&"--mailgun-domain") {
                flags.extend(["--mail-recipient", "ops@example.com"]);
            }
            if extra.contains(&"--mailgun-base-url") {
                flags.extend(["--mailgun-domain", "mg.example.com"]);
            }
            flags.extend(extra.iter());
            let err = error(&flags, &with_key);
            assert!(
                err.starts_with(expected),
                "{flags:?}:\n  got      {err}\n  expected {expected}"
            );
        }
        assert_eq!(
            error(MAILGUN, &no_env),
            "--mailgun-api-key-file (MAILGUN_API_KEY_FILE, or MAILGUN_API_KEY): the Mailgun API key is required"
        );
    }

    #[test]
    fn config_file_errors_name_the_file_and_key() {
        let err = error(&["--config", "/nonexistent/capm.yaml"], &no_env);
        assert!(
            err.starts_with("--config (CAPM_CONFIG): /nonexistent/capm.yaml: "),
            "{err}"
        );
        let f = file("mailer: {sendgrid: {}}\n");
        let err = error(&["--config", f.path().to_str().unwrap()], &no_env);
        assert!(err.contains("unknown variant `sendgrid`"), "{err}");
        let f = file("concurency: 3\n");
        let err = error(&["--config", f.path().to_str().unwrap()], &no_env);
        assert!(err.contains("unknown field `concurency`"), "{err}");
        let f = file(
            "mailer: {smtp: {url: 'smtp://h', timeoutSeconds: 0}}\nmailRecipients: [a@example.com]\n",
        );
        let err = error(&["--config", f.path().to_str().unwrap()], &no_env);
        assert!(
            err.starts_with("--config (CAPM_CONFIG): mailer.smtp.timeoutSeconds"),
            "{err}"
        );
    }

    #[test]
    fn timings_come_from_flags_the_file_or_the_defaults() {
        let s = resolve(MAILGUN, &with_key).unwrap();
        let c = &s.controllers;
        assert_eq!(
            (c.backoff_base, c.backoff_max, c.lookup_grace),
            (
                Duration::from_millis(500),
                Duration::from_secs(300),
                Duration::from_secs(10)
            )
        );
        let f =
            file("backoffBase: 1s\nbackoffMax: 1m\nlookupGrace: 30s\nleaderElectRetryPeriod: 3s\n");
        let mut flags = MAILGUN.to_vec();
        flags.extend(["--config", f.path().to_str().unwrap(), "--backoff-max=2m"]);
        flags.extend([
            "--leader-elect-lease-duration=1m",
            "--leader-elect-renew-deadline=40s",
        ]);
        let s = resolve(&flags, &with_key).unwrap();
        let c = &s.controllers;
        assert_eq!(
            (c.backoff_base, c.backoff_max, c.lookup_grace),
            (
                Duration::from_secs(1),
                Duration::from_secs(120),
                Duration::from_secs(30)
            )
        );
        let le = s.leader_election.unwrap();
        assert_eq!(
            (le.lease_duration, le.renew_deadline, le.retry_period),
            (
                Duration::from_secs(60),
                Duration::from_secs(40),
                Duration::from_secs(3)
            )
        );

        let cases: &[(&[&str], &str)] = &[
            (
                &["--backoff-base=0s"],
                "--backoff-base (BACKOFF_BASE): must be positive",
            ),
            (
                &["--backoff-base=10m"],
                "--backoff-base (BACKOFF_BASE): must not be longer than --backoff-max (BACKOFF_MAX)",
            ),
            (
                &["--backoff-max=soon"],
                "--backoff-max (BACKOFF_MAX): \"soon\" is not a duration",
            ),
            (
                &["--lookup-grace=0"],
                "--lookup-grace (LOOKUP_GRACE): must be positive",
            ),
            (
                &["--leader-elect-renew-deadline=15s"],
                "--leader-elect-renew-deadline (LEADER_ELECT_RENEW_DEADLINE): must be shorter than \
                 --leader-elect-lease-duration (LEADER_ELECT_LEASE_DURATION)",
            ),
            (
                &["--leader-elect-retry-period=10s"],
                "--leader-elect-retry-period (LEADER_ELECT_RETRY_PERIOD): must be positive and \
                 shorter than --leader-elect-renew-deadline (LEADER_ELECT_RENEW_DEADLINE)",
            ),
            (
                &["--leader-elect-lease-duration=-5s"],
                "--leader-elect-lease-duration (LEADER_ELECT_LEASE_DURATION): \"-5s\" is not",
            ),
        ];
        for (extra, expected) in cases {
            let mut flags = MAILGUN.to_vec();
            flags.extend(extra.iter());
            let err = error(&flags, &with_key);
            assert!(
                err.starts_with(expected),
                "{flags:?}:\n  got      {err}\n  expected {expected}"
            );
        }
        let f = file("lookupGrace: soon\n");
        let mut flags = MAILGUN.to_vec();
        flags.extend(["--config", f.path().to_str().unwrap()]);
        let err = error(&flags, &with_key);
        assert!(
            err.starts_with("--config (CAPM_CONFIG): ") && err.contains("--lookup-grace"),
            "{err}"
        );
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("7"), Some(Duration::from_secs(7)));
        assert_eq!(parse_duration("1h"), Some(Duration::from_secs(3600)));
        assert_eq!(parse_duration("x"), None);
        assert_eq!(parse_duration("5d"), None);
        assert_eq!(parse_duration("1m30s"), Some(Duration::from_secs(90)));
        assert_eq!(parse_duration("-1s"), None);
    }
}
