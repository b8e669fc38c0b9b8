//! Command line, environment and config file, resolved into one validated [`Settings`].
//!
//! Precedence, highest first: command-line flag, its environment variable, the `--config` file,
//! the built-in default. Secrets are never values here: the Mailgun API key and the SMTP password
//! are read by the mailer from a file (`--mailgun-api-key-file`, `--smtp-password-file`) or from
//! the environment variables `MAILGUN_API_KEY` / `SMTP_PASSWORD`, so neither `Debug` nor an error
//! message can show them.
//!
//! [`Args`] is the one declaration of every setting (its `--help` text, flag, variable, default
//! and parser); the modules below only read it: `file` turns the config file into flag
//! defaults, `mailer` assembles the mail backend, `values` holds the flags' value parsers. The
//! rules of the controllers' settings are theirs (`capm_controllers::Config::validate`): a
//! refused field is named here by its flag.

use std::{
    ffi::OsString,
    fmt,
    net::{Ipv4Addr, SocketAddr},
    path::PathBuf,
    sync::LazyLock,
    time::Duration,
};

use capm_mailer::{ConfigError, MailerConfig};
use clap::{
    Arg, Command, CommandFactory, FromArgMatches, Parser, ValueEnum,
    builder::BoolishValueParser,
    error::{ContextKind, ContextValue},
};

/// The [`Field`] of a field of [`Args`] (checked by the compiler), for an error message.
macro_rules! field {
    ($id:ident) => {{
        let _ = |args: &$crate::settings::Args| {
            let _ = &args.$id;
        };
        $crate::settings::Field::of(stringify!($id))
    }};
}
pub(crate) use field;

mod controllers;
mod file;
mod fulfilment;
mod mailer;
#[cfg(test)]
mod tests;
mod values;

use controllers::{controllers_error, identity_secret_namespace};
use file::{FLAG_ONLY, file_error, read_file, snake_to_camel};
pub use fulfilment::Fulfilment;
pub use mailer::mailer_error;
use mailer::{default_message_id_domain, resolve_mailer};
use values::{
    allowed_namespaces, bind_address, check_dns_subdomain, duration, host_entry, label_value,
    log_filter, namespace, recipient,
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
/// For each MailgunCluster and MailgunMachine it mails one request to --mail-recipient, through
/// Mailgun (--mailgun-domain and an API key) or an SMTP relay (--smtp-url), and reports in
/// status whether the mail was sent and delivered. Every flag can also be set by the environment
/// variable shown, or in the --config file (YAML or JSON, camelCase keys such as
/// `mailgunDomain`; the mail backend may also be given whole under `mailer`). A flag beats its
/// variable, which beats the file, which beats the default. Secrets are read only from files or
/// from MAILGUN_API_KEY / SMTP_PASSWORD.
// Each setting is declared here once: its flag, variable, default and parser. The file's
// values become the flags' defaults (see `Settings::resolve`), so nothing else lists them.
// The field docs are `--help` texts, written for a terminal, not for rustdoc.
#[allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]
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

    /// The mails' From: an address of the sending side, on the domain the backend sends and
    /// signs for, so that receivers' DMARC checks pass (the requester goes into Reply-To)
    /// [default: cluster-api-provider-mailgun@<the Mailgun domain>; required for SMTP].
    #[arg(long, env = "MAIL_FROM", value_name = "ADDRESS", value_parser = recipient)]
    pub mail_from: Option<String>,

    /// Mailgun sending domain (required for the mailgun backend).
    #[arg(long, env = "MAILGUN_DOMAIN", value_name = "DOMAIN")]
    pub mailgun_domain: Option<String>,

    /// File holding the Mailgun API key [default: read the key from $MAILGUN_API_KEY].
    #[arg(long, env = "MAILGUN_API_KEY_FILE", value_name = "FILE")]
    pub mailgun_api_key_file: Option<PathBuf>,

    /// File holding a separate Mailgun key for reading the Logs/events APIs (an account key with
    /// a read-only role, e.g. `Analyst`), so the sending key may be a domain sending key
    /// [default: read with the sending key; without read access, delivery is not tracked].
    #[arg(long, env = "MAILGUN_READ_KEY_FILE", value_name = "FILE")]
    pub mailgun_read_key_file: Option<PathBuf>,

    /// Mailgun API region [default: us].
    #[arg(long, env = "MAILGUN_REGION", value_enum)]
    pub mailgun_region: Option<Region>,

    /// Which Mailgun API answers "was this mail accepted?" and "was it delivered?": `logs`
    /// (one question covers up to 100 open mails; Mailgun deprecates the events API in its
    /// favour) or `events` (one question per mail, for accounts or proxies without the Logs API)
    /// [default: logs].
    #[arg(long, env = "MAILGUN_EVENTS_API", value_enum)]
    pub mailgun_events_api: Option<EventsApi>,

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

    /// Longest retry delay of an object after errors. Permanent errors are not retried on a
    /// timer: the object's next change, or the sync period, reconciles it again.
    #[arg(long, env = "BACKOFF_MAX", value_name = "DURATION", default_value = "5m", value_parser = duration)]
    pub backoff_max: Duration,

    /// Every object is reconciled at least once per this period even when no event asks for it
    /// (controller-runtime's SyncPeriod), spread evenly over the period; a reconcile that finds
    /// nothing changed writes nothing.
    #[arg(long, env = "SYNC_PERIOD", value_name = "DURATION", default_value = "10h", value_parser = duration)]
    pub sync_period: Duration,

    /// How long the mail backend must keep answering "not found" for a mail whose outcome was
    /// unknown before it is sent again (event stores lag behind sends).
    #[arg(long, env = "LOOKUP_GRACE", value_name = "DURATION", default_value = "10s", value_parser = duration)]
    pub lookup_grace: Duration,

    /// Wait after the send before first asking the mail backend whether a request mail was
    /// delivered (after a restart: spread over one such wait), doubling with each answer that
    /// leaves it open (Mailgun only; SMTP cannot tell).
    #[arg(long, env = "DELIVERY_POLL_BASE", value_name = "DURATION", default_value = "30s", value_parser = duration)]
    pub delivery_poll_base: Duration,

    /// Longest wait between two delivery questions about one mail.
    #[arg(long, env = "DELIVERY_POLL_MAX", value_name = "DURATION", default_value = "30m", value_parser = duration)]
    pub delivery_poll_max: Duration,

    /// How long Mailgun keeps the account's events (by plan; Mailgun documents at least 3
    /// days). Delivery is asked about at most this long after the send; then it is reported
    /// unknown.
    #[arg(long, env = "MAILGUN_EVENTS_RETENTION", value_name = "DURATION", default_value = "72h", value_parser = duration)]
    pub mailgun_events_retention: Duration,

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

    /// Namespace of the Secrets that MailgunClusterIdentities name (the provider's own; its Role
    /// may read Secrets there only) [default: $POD_NAMESPACE, else the in-cluster namespace;
    /// without one, identities cannot be used].
    #[arg(long, env = "IDENTITY_SECRET_NAMESPACE", value_name = "NAMESPACE")]
    pub identity_secret_namespace: Option<String>,

    /// The namespaces whose objects may mail through this provider's own configuration (the
    /// objects without an identityRef), as JSON in a MailgunClusterIdentity's allowedNamespaces
    /// shape: `{"list": [...], "selector": {...}}`; `{}` allows every namespace. Others get
    /// IdentityNotAllowed and no mail.
    #[arg(long, env = "DEFAULT_IDENTITY_ALLOWED_NAMESPACES", value_name = "JSON", default_value = "{}", value_parser = allowed_namespaces)]
    pub default_identity_allowed_namespaces: capm_api::v1beta1::AllowedNamespaces,

    /// Refuse objects without an identityRef (IdentityRequired, no mail): every tenant mails
    /// through an identity of its own.
    #[arg(
        long,
        env = "REQUIRE_IDENTITY_REF",
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_value = "false",
        default_missing_value = "true",
        value_parser = BoolishValueParser::new()
    )]
    pub require_identity_ref: bool,

    /// Hosts (`host` or `host:port`, comma-separated) a MailgunClusterIdentity's Mailgun API URL
    /// may name (its baseURL, or its region's host); `http://` only to a loopback host.
    #[arg(long, env = "IDENTITY_MAILGUN_HOSTS", value_name = "HOSTS", value_delimiter = ',', default_value = "api.mailgun.net,api.eu.mailgun.net", value_parser = host_entry)]
    pub identity_mailgun_hosts: Vec<String>,

    /// Hosts (`host` or `host:port`, comma-separated) a MailgunClusterIdentity's SMTP relay may
    /// be [default: none; SMTP identities are refused until the operator lists their relays].
    #[arg(long, env = "IDENTITY_SMTP_HOSTS", value_name = "HOSTS", value_delimiter = ',', value_parser = host_entry)]
    pub identity_smtp_hosts: Vec<String>,

    /// How long after an object's deletion a release mail that cannot go out (its identity
    /// gone, not allowed or unusable, its backend failing) is given up (a ReleaseAbandoned
    /// Event says why), so that the deletion finishes.
    #[arg(long, env = "RELEASE_TIMEOUT", value_name = "DURATION", default_value = "24h", value_parser = duration)]
    pub release_timeout: Duration,

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

    /// Log format.
    #[arg(long, env = "LOG_FORMAT", value_enum, default_value_t)]
    pub log_format: LogFormat,

    /// Log filter: a level (`info`) or tracing directives (`info,kube=debug`).
    #[arg(long, env = "RUST_LOG", value_name = "FILTER", default_value = "info", value_parser = log_filter)]
    pub log_level: String,

    /// How long in-flight reconciles may take to finish after SIGTERM, e.g. `30s`, `2m`.
    #[arg(long, env = "SHUTDOWN_TIMEOUT", value_name = "DURATION", default_value = "30s", value_parser = duration)]
    pub shutdown_timeout: Duration,

    /// Public base URL of the fulfilment page, scheme and host only (e.g.
    /// `https://capm.example.com`, served through an Ingress with TLS; `http` only on a
    /// loopback host): request mails then carry a link to a page where the human records
    /// what they built without cluster credentials (needs --fulfilment-keys-file) [default: no
    /// link, no page].
    #[arg(long, env = "FULFILMENT_URL", value_name = "URL")]
    pub fulfilment_url: Option<String>,

    /// File listing the fulfilment links' keys, one base64 key of at least 32 bytes per line,
    /// newest first (it signs; all are accepted); re-read when it changes.
    #[arg(long, env = "FULFILMENT_KEYS_FILE", value_name = "FILE")]
    pub fulfilment_keys_file: Option<PathBuf>,

    /// Address of the fulfilment page (plain HTTP; TLS at the Ingress), with --fulfilment-url;
    /// `0`: links in the mails, the page served elsewhere.
    #[arg(
        long,
        env = "FULFILMENT_BIND_ADDRESS",
        value_name = "ADDR",
        default_value = ":8090"
    )]
    pub fulfilment_bind_address: String,

    /// How long a fulfilment link is valid after its request mail (at most 2160h, 90 days).
    #[arg(long, env = "FULFILMENT_LINK_VALIDITY", value_name = "DURATION", default_value = "720h", value_parser = duration)]
    pub fulfilment_link_validity: Duration,

    /// Replaced by --fulfilment-trusted-proxies: `true` stops the provider at start-up saying so
    /// (it made any client able to choose its address).
    #[arg(
        long,
        env = "FULFILMENT_TRUST_FORWARDED_FOR",
        value_name = "BOOL",
        num_args = 0..=1,
        require_equals = true,
        default_value = "false",
        default_missing_value = "true",
        value_parser = BoolishValueParser::new()
    )]
    pub fulfilment_trust_forwarded_for: bool,

    /// The proxies in front of the fulfilment page (comma-separated CIDRs or addresses, e.g. the
    /// Ingress controller's Pod network): when the peer is one of them, the client address is
    /// the X-Forwarded-For entry read right to left past the trusted hops [default: none, the
    /// peer].
    #[arg(long, env = "FULFILMENT_TRUSTED_PROXIES", value_name = "CIDRS")]
    pub fulfilment_trusted_proxies: Option<String>,

    /// Kubeconfig file [default: $KUBECONFIG, the in-cluster service account, ~/.kube/config].
    #[arg(long, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
}

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

/// Mailgun's APIs for lookups and delivery questions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EventsApi {
    /// POST /v1/analytics/logs: many mails per question.
    Logs,
    /// GET /v3/{domain}/events (deprecated by Mailgun): one mail per question.
    Events,
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
    /// The field declared by the [`Args`] field `id` (use the `field!` macro, which checks it).
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

    /// The same field, also settable through the variable `env` (the secrets' fallbacks).
    pub fn or_env(mut self, env: &str) -> Self {
        self.env = format!("{}, or {env}", self.env);
        self
    }
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
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
    #[error("{}: {}: {reason}", field!(config), path.display())]
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
    #[error("{}: mailer.{source}", field!(config))]
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
        let mailer = resolve_mailer(&args, file_mailer, env)?;

        // The binary's defaults for the sender and the Message-Id domain come from the backend;
        // `None` where it has none. Their rules are the controllers' (`Config::validate`).
        let mail_from = args.mail_from.or_else(|| match &mailer {
            MailerConfig::Mailgun(c) => Some(format!("cluster-api-provider-mailgun@{}", c.domain)),
            MailerConfig::Smtp(_) => None,
        });
        let message_id_domain = args
            .message_id_domain
            .or_else(|| default_message_id_domain(&mailer));
        let mut controllers = capm_controllers::Config {
            recipients: args.mail_recipients.unwrap_or_default(),
            mail_from: mail_from.clone().unwrap_or_default(),
            message_id_domain: message_id_domain.clone().unwrap_or_default(),
            // The keys are read at start (see `app::run`); settings read no secret.
            fulfilment: None,
            namespace: args.namespace,
            watch_filter: args.watch_filter,
            concurrency: args.concurrency,
            backoff_base: args.backoff_base,
            backoff_max: args.backoff_max,
            lookup_grace: args.lookup_grace,
            delivery_poll_base: args.delivery_poll_base,
            delivery_poll_max: args.delivery_poll_max,
            delivery_retention: args.mailgun_events_retention,
            sync_period: args.sync_period,
            // Checked below, with the other namespaces.
            identity_secret_namespace: None,
            tenancy: capm_controllers::Tenancy {
                default_allowed: args.default_identity_allowed_namespaces,
                require_identity_ref: args.require_identity_ref,
                hosts: capm_mailer::AllowedHosts {
                    mailgun: args.identity_mailgun_hosts,
                    smtp: args.identity_smtp_hosts,
                },
                release_timeout: args.release_timeout,
            },
            // Known only once the process runs (see `app::run`).
            instance: String::new(),
        };
        controllers
            .validate()
            .map_err(|e| controllers_error(&e, mail_from.is_none(), message_id_domain.is_none()))?;

        let mut deprecations = Vec::new();
        let diagnostics = resolve_diagnostics(
            args.diagnostics_address,
            args.insecure_diagnostics,
            args.diagnostics_cert_dir,
            args.metrics_bind_address,
            &mut deprecations,
        )?;
        let probe_address = bind_address(
            field!(health_probe_bind_address),
            &args.health_probe_bind_address,
        )?;

        let (lease_duration, renew_deadline, retry_period) = (
            args.leader_elect_lease_duration,
            args.leader_elect_renew_deadline,
            args.leader_elect_retry_period,
        );
        if renew_deadline >= lease_duration {
            return Err(invalid(
                field!(leader_elect_renew_deadline),
                format!(
                    "must be shorter than {}",
                    field!(leader_elect_lease_duration)
                ),
            ));
        }
        if retry_period.is_zero() || retry_period >= renew_deadline {
            return Err(invalid(
                field!(leader_elect_retry_period),
                format!(
                    "must be positive and shorter than {}",
                    field!(leader_elect_renew_deadline)
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
                .map_err(|r| invalid(field!(leader_election_namespace), r.0))?;
            check_dns_subdomain(field!(leader_election_id), &args.leader_election_id)?;
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

        controllers.identity_secret_namespace =
            identity_secret_namespace(args.identity_secret_namespace, env)?;

        let webhook = (args.webhook_port != 0).then(|| Webhook {
            bind: SocketAddr::from((Ipv4Addr::UNSPECIFIED, args.webhook_port)),
            cert_dir: args.webhook_cert_dir,
        });

        let fulfilment = fulfilment::resolve(
            args.fulfilment_url,
            args.fulfilment_keys_file,
            &args.fulfilment_bind_address,
            args.fulfilment_link_validity,
            args.fulfilment_trust_forwarded_for,
            args.fulfilment_trusted_proxies.as_deref(),
        )?;

        Ok(Self {
            fulfilment,
            mailer,
            controllers,
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

fn in_cluster_namespace() -> Option<String> {
    std::fs::read_to_string(IN_CLUSTER_NAMESPACE_FILE)
        .ok()
        .map(|ns| ns.trim().to_owned())
        .filter(|ns| !ns.is_empty())
}
