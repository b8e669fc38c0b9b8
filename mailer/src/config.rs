//! Backend configuration (serde, camelCase field names like Kubernetes objects), its validation
//! (each error names the field, never a secret) and the factory that turns it into an
//! `Arc<dyn Mailer>`.
//!
//! The file format is externally tagged by backend name, e.g. in YAML:
//! ```yaml
//! mailgun:
//!   domain: mg.example.com
//!   region: eu                 # us (default) or eu; or baseUrl: http://127.0.0.1:8025
//!   apiKey: {file: /etc/capm/mailgun/api-key}      # a domain sending key will do
//!   readApiKey: {file: /etc/capm/mailgun/read-key} # optional: a read-only account key
//! ```
//! ```yaml
//! smtp:
//!   url: smtp://relay.example.com:587   # smtp:// (default port 587) or smtps:// (465)
//!   starttls: required                  # required (default), opportunistic, never
//!   username: capm
//!   password: {env: SMTP_PASSWORD}
//!   caFile: /etc/capm/relay-ca.pem      # optional: trust only this CA
//! ```

use std::{path::PathBuf, sync::Arc, time::Duration};

use serde::{Deserialize, Serialize};

use crate::{
    Mailer, MailgunMailer, SmtpMailer,
    secret::{SecretError, SecretSource},
};

/// Why a configuration was refused or a backend could not be built. Never contains a secret.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A field has an invalid value; `field` is its dotted path (`smtp.url`).
    #[error("{field}: {reason}")]
    Invalid {
        /// Dotted path of the field.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// A secret could not be read.
    #[error("{field}: {source}")]
    Secret {
        /// Dotted path of the field (`mailgun.apiKey`).
        field: String,
        /// Why.
        #[source]
        source: SecretError,
    },
    /// The CA file could not be read or holds no usable certificate.
    #[error("{field}: {reason}")]
    CaFile {
        /// Dotted path of the field (`smtp.caFile`).
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// The TLS or HTTP client could not be set up.
    #[error("setting up the {backend} client: {source}")]
    Client {
        /// `mailgun` or `smtp`.
        backend: &'static str,
        /// The underlying error.
        #[source]
        source: crate::BoxError,
    },
}

pub(crate) fn invalid(field: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        field: field.to_owned(),
        reason: reason.into(),
    }
}

/// Which backend to use, and how.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum MailerConfig {
    /// Mailgun's HTTP API.
    Mailgun(MailgunConfig),
    /// An SMTP relay (which may be Mailgun's).
    Smtp(SmtpConfig),
}

impl MailerConfig {
    /// Checks every field without touching the network or reading secrets.
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first bad field, e.g. `smtp.url: scheme must be smtp or smtps`.
    pub fn validate(&self) -> Result<(), ConfigError> {
        match self {
            Self::Mailgun(c) => c.validate(),
            Self::Smtp(c) => c.validate().map(drop),
        }
    }
}

/// Builds the configured backend: validates, reads the secrets, sets up the connection pool.
///
/// Call it once at start-up and share the result.
///
/// # Errors
/// [`ConfigError`] when the configuration is invalid, a secret or CA file cannot be read, or the
/// client cannot be set up.
///
/// # Panics
/// The SMTP pool starts a background task: call this inside a Tokio runtime.
pub fn build(config: &MailerConfig) -> Result<Arc<dyn Mailer>, ConfigError> {
    build_with_gate(config, Arc::new(crate::AlwaysOpen))
}

/// As [`build`], with a [`CommitGate`](crate::CommitGate) asked right before each send's commit
/// point (see the gate's module).
///
/// # Errors
/// As [`build`].
///
/// # Panics
/// As [`build`].
pub fn build_with_gate(
    config: &MailerConfig,
    gate: Arc<dyn crate::CommitGate>,
) -> Result<Arc<dyn Mailer>, ConfigError> {
    Ok(match config {
        MailerConfig::Mailgun(c) => Arc::new(MailgunMailer::new(c)?.with_commit_gate(gate)),
        MailerConfig::Smtp(c) => Arc::new(SmtpMailer::new(c)?.with_commit_gate(gate)),
    })
}

/// Whether `url` starts with one of `schemes` (any case) and a colon: a URL parse error is then
/// about the rest, else about the scheme.
fn has_scheme(url: &str, schemes: &[&str]) -> bool {
    url.split_once(':')
        .is_some_and(|(scheme, _)| schemes.iter().any(|s| scheme.eq_ignore_ascii_case(s)))
}

fn check_seconds(field: &str, value: f64) -> Result<Duration, ConfigError> {
    if value.is_nan() || value <= 0.0 {
        return Err(invalid(field, "must be a positive number of seconds"));
    }
    Duration::try_from_secs_f64(value).map_err(|_| invalid(field, "too large"))
}

/// Mailgun's two public API regions.
// The one region type: the provider's flag, its config file and the identities' CRD field
// (`capm_api::v1beta1::MailgunRegion`, through the `schema` feature) all name these.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "lowercase")]
pub enum MailgunRegion {
    /// api.mailgun.net
    #[default]
    Us,
    /// api.eu.mailgun.net
    Eu,
}

impl MailgunRegion {
    /// Every region, in the order the defaults list them.
    pub const ALL: [Self; 2] = [Self::Us, Self::Eu];

    /// The API base URL of the region.
    pub fn base_url(self) -> &'static str {
        match self {
            Self::Us => "https://api.mailgun.net",
            Self::Eu => "https://api.eu.mailgun.net",
        }
    }

    /// The host of [`base_url`](Self::base_url).
    pub fn host(self) -> &'static str {
        let url = self.base_url();
        url.strip_prefix("https://").unwrap_or(url)
    }

    /// The region's name in configuration: `us` or `eu`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Us => "us",
            Self::Eu => "eu",
        }
    }
}

/// Which of Mailgun's event APIs answers lookups and delivery questions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum MailgunEventsApi {
    /// `POST /v1/analytics/logs` (the default): one query asks about many Message-Ids. Mailgun
    /// documents the events API as deprecated in its favour.
    #[default]
    Logs,
    /// `GET /v3/{domain}/events`, one query per Message-Id: for accounts or proxies that lack
    /// the Logs API.
    Events,
}

impl MailgunEventsApi {
    /// Both APIs, the default first.
    pub const ALL: [Self; 2] = [Self::Logs, Self::Events];

    /// The API's name in configuration: `logs` or `events`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Logs => "logs",
            Self::Events => "events",
        }
    }
}

fn default_connect_timeout() -> f64 {
    10.0
}
fn default_request_timeout() -> f64 {
    30.0
}

/// The Mailgun HTTP backend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MailgunConfig {
    /// `domain` (required): the sending domain, as in `/v3/<domain>/messages`.
    pub domain: String,
    /// `region` (optional, `us`): which public API to use.
    #[serde(default)]
    pub region: MailgunRegion,
    /// `baseUrl` (optional): overrides `region`, e.g. `http://127.0.0.1:8025` for a test server.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_url: Option<String>,
    /// `apiKey` (required): where to read the API key (`{file: ...}` or `{env: ...}`).
    pub api_key: SecretSource,
    /// `readApiKey` (optional): a separate key for the Logs/events APIs (an account key with a
    /// read-only role). Without it, reads use `apiKey`; when that key may not read (a domain
    /// sending key: 401), the backend stops asking and says delivery is not tracked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_api_key: Option<SecretSource>,
    /// `testMode` (optional, false): send `o:testmode=yes` (accepted, not delivered, billed).
    #[serde(default)]
    pub test_mode: bool,
    /// `eventsApi` (optional, `logs`): which API answers lookups and delivery questions, `logs`
    /// or `events` (deprecated by Mailgun; for accounts or proxies without the Logs API).
    #[serde(default)]
    pub events_api: MailgunEventsApi,
    /// `connectTimeoutSeconds` (optional, 10): TCP + TLS connect timeout.
    #[serde(default = "default_connect_timeout")]
    pub connect_timeout_seconds: f64,
    /// `requestTimeoutSeconds` (optional, 30): the whole request, connect included.
    #[serde(default = "default_request_timeout")]
    pub request_timeout_seconds: f64,
}

impl MailgunConfig {
    /// A configuration with defaults for everything but the domain and key.
    pub fn new(domain: impl Into<String>, api_key: SecretSource) -> Self {
        Self {
            domain: domain.into(),
            region: MailgunRegion::Us,
            base_url: None,
            api_key,
            read_api_key: None,
            test_mode: false,
            events_api: MailgunEventsApi::Logs,
            connect_timeout_seconds: default_connect_timeout(),
            request_timeout_seconds: default_request_timeout(),
        }
    }

    /// The base URL to use: `baseUrl` without a trailing slash, or the region's.
    pub fn effective_base_url(&self) -> &str {
        self.base_url
            .as_deref()
            .map(|u| u.trim_end_matches('/'))
            .unwrap_or_else(|| self.region.base_url())
    }

    /// The connect timeout.
    ///
    /// # Errors
    /// When `connectTimeoutSeconds` is not positive.
    pub fn connect_timeout(&self) -> Result<Duration, ConfigError> {
        check_seconds(
            "mailgun.connectTimeoutSeconds",
            self.connect_timeout_seconds,
        )
    }

    /// The request timeout.
    ///
    /// # Errors
    /// When `requestTimeoutSeconds` is not positive.
    pub fn request_timeout(&self) -> Result<Duration, ConfigError> {
        check_seconds(
            "mailgun.requestTimeoutSeconds",
            self.request_timeout_seconds,
        )
    }

    /// Checks every field (no network, no secrets read).
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let d = &self.domain;
        if d.is_empty()
            || !d
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '.' || c == '-')
            || d.starts_with(['.', '-'])
            || d.ends_with(['.', '-'])
        {
            return Err(invalid(
                "mailgun.domain",
                "must be a DNS name (letters, digits, '-' and '.')",
            ));
        }
        if let Some(base) = &self.base_url {
            const FIELD: &str = "mailgun.baseUrl";
            let scheme = || invalid(FIELD, "scheme must be http or https");
            let shape = || {
                invalid(
                    FIELD,
                    "must be scheme://host[:port][/path] without credentials, query or fragment",
                )
            };
            let url = url::Url::parse(base).map_err(|_| {
                if has_scheme(base, &["http", "https"]) {
                    shape()
                } else {
                    scheme()
                }
            })?;
            if !matches!(url.scheme(), "http" | "https") {
                return Err(scheme());
            }
            if url.host().is_none()
                || !url.username().is_empty()
                || url.password().is_some()
                || url.query().is_some()
                || url.fragment().is_some()
            {
                return Err(shape());
            }
        }
        self.connect_timeout()?;
        self.request_timeout()?;
        Ok(())
    }
}

/// How an `smtp://` connection uses STARTTLS.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Starttls {
    /// Upgrade to TLS or fail (the default).
    #[default]
    Required,
    /// Upgrade when the server offers it; otherwise stay in plain text. Not allowed with
    /// credentials.
    Opportunistic,
    /// Plain text only: for a relay on the same host or in tests. Not allowed with credentials.
    Never,
}

fn default_true() -> bool {
    true
}
fn default_pool_max_size() -> u32 {
    10
}
fn default_pool_idle_timeout() -> f64 {
    60.0
}
fn default_smtp_timeout() -> f64 {
    30.0
}

/// SMTP connection pooling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SmtpPoolConfig {
    /// `enabled` (optional, true): keep connections open between messages. When false, every
    /// message opens and closes its own connection.
    #[serde(default = "default_true")]
    pub enabled: bool,
    /// `maxSize` (optional, 10): idle connections kept open.
    #[serde(default = "default_pool_max_size")]
    pub max_size: u32,
    /// `idleTimeoutSeconds` (optional, 60): close connections idle for longer.
    #[serde(default = "default_pool_idle_timeout")]
    pub idle_timeout_seconds: f64,
}

impl Default for SmtpPoolConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            max_size: default_pool_max_size(),
            idle_timeout_seconds: default_pool_idle_timeout(),
        }
    }
}

/// The SMTP backend.
///
/// Tags and variables travel as `X-Mailgun-Tag` (one header per tag) and `X-Mailgun-Variables`
/// (a JSON object), the headers Mailgun's own SMTP relay reads; other relays pass them on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SmtpConfig {
    /// `url` (required): `smtp://host[:port]` (port 587 by default) or `smtps://host[:port]`
    /// (implicit TLS, port 465 by default). No credentials, path or query.
    pub url: String,
    /// `starttls` (optional, `required`): only for `smtp://` URLs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub starttls: Option<Starttls>,
    /// `username` (optional): AUTH PLAIN/LOGIN user; needs `password` and TLS.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub username: Option<String>,
    /// `password` (optional): where to read the password; needs `username`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub password: Option<SecretSource>,
    /// `helloName` (optional): the name sent in EHLO; defaults to `localhost`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hello_name: Option<String>,
    /// `caFile` (optional): PEM file with the CA(s) of a private relay. When set, ONLY these CAs
    /// are trusted; otherwise the system's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ca_file: Option<PathBuf>,
    /// A CA bundle (PEM) already read by the caller, e.g. from a mail identity's Secret;
    /// replaces `caFile`. Never in a configuration file.
    #[serde(skip)]
    pub ca_pem: Option<Vec<u8>>,
    /// `timeoutSeconds` (optional, 30): bounds getting a ready connection (TCP, TLS, EHLO,
    /// STARTTLS, AUTH; retryable when exceeded) and, separately, each message's transaction
    /// (an unknown outcome when exceeded).
    #[serde(default = "default_smtp_timeout")]
    pub timeout_seconds: f64,
    /// `pool` (optional): connection pooling.
    #[serde(default)]
    pub pool: SmtpPoolConfig,
}

/// A parsed `smtp.url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SmtpEndpoint {
    pub(crate) implicit_tls: bool,
    pub(crate) host: String,
    pub(crate) port: u16,
}

impl SmtpConfig {
    /// A configuration with defaults for everything but the URL.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            starttls: None,
            username: None,
            password: None,
            hello_name: None,
            ca_file: None,
            ca_pem: None,
            timeout_seconds: default_smtp_timeout(),
            pool: SmtpPoolConfig::default(),
        }
    }

    /// Checks every field (no network, no secrets read).
    ///
    /// # Errors
    /// [`ConfigError::Invalid`] naming the first bad field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.endpoint().map(drop)
    }

    pub(crate) fn endpoint(&self) -> Result<SmtpEndpoint, ConfigError> {
        const URL: &str = "smtp.url";
        let scheme = || invalid(URL, "scheme must be smtp or smtps");
        let no_host = || invalid(URL, "missing or invalid host");
        // The URL parser drops blanks and line breaks; here they make the URL invalid.
        if self
            .url
            .chars()
            .any(|c| c.is_whitespace() || c.is_control())
        {
            return Err(invalid(
                URL,
                "must not contain blanks or control characters",
            ));
        }
        let url = url::Url::parse(&self.url).map_err(|e| {
            if !has_scheme(&self.url, &["smtp", "smtps"]) {
                return scheme();
            }
            match e {
                url::ParseError::InvalidPort => {
                    invalid(URL, "port must be a number from 1 to 65535")
                }
                url::ParseError::InvalidIpv6Address => invalid(URL, "invalid IPv6 host in [ ]"),
                _ => no_host(),
            }
        })?;
        let implicit_tls = match url.scheme() {
            "smtps" => true,
            "smtp" => false,
            _ => return Err(scheme()),
        };
        if !url.username().is_empty()
            || url.password().is_some()
            || !matches!(url.path(), "" | "/")
            || url.query().is_some()
            || url.fragment().is_some()
        {
            return Err(invalid(
                URL,
                "must be scheme://host[:port] (credentials go in username/password)",
            ));
        }
        let host = match url.host() {
            Some(url::Host::Domain(name)) if !name.is_empty() => name.to_owned(),
            Some(url::Host::Ipv4(address)) => address.to_string(),
            Some(url::Host::Ipv6(address)) => address.to_string(),
            _ => return Err(no_host()),
        };
        let port = match url.port() {
            Some(0) => return Err(invalid(URL, "port must be a number from 1 to 65535")),
            Some(port) => port,
            None if implicit_tls => 465,
            None => 587,
        };
        if implicit_tls && self.starttls.is_some() {
            return Err(invalid(
                "smtp.starttls",
                "only applies to smtp:// URLs (smtps:// is TLS from the start)",
            ));
        }
        match (&self.username, &self.password) {
            (Some(_), None) => return Err(invalid("smtp.password", "required with username")),
            (None, Some(_)) => return Err(invalid("smtp.username", "required with password")),
            (Some(user), Some(_)) => {
                if user.is_empty() || user.chars().any(char::is_control) {
                    return Err(invalid(
                        "smtp.username",
                        "must be non-empty without control characters",
                    ));
                }
                if !implicit_tls && self.starttls.unwrap_or_default() != Starttls::Required {
                    return Err(invalid(
                        "smtp.username",
                        "credentials need TLS: use smtps:// or starttls: required",
                    ));
                }
            }
            (None, None) => {}
        }
        if let Some(name) = &self.hello_name
            && (name.is_empty() || name.chars().any(|c| c.is_whitespace() || c.is_control()))
        {
            return Err(invalid(
                "smtp.helloName",
                "must be a host name without spaces",
            ));
        }
        check_seconds("smtp.timeoutSeconds", self.timeout_seconds)?;
        check_seconds(
            "smtp.pool.idleTimeoutSeconds",
            self.pool.idle_timeout_seconds,
        )?;
        Ok(SmtpEndpoint {
            implicit_tls,
            host,
            port,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn smtp(url: &str) -> SmtpConfig {
        SmtpConfig::new(url)
    }

    #[test]
    fn smtp_urls() {
        let e = smtp("smtp://relay.example.com").endpoint().unwrap();
        assert_eq!(
            (e.implicit_tls, e.host.as_str(), e.port),
            (false, "relay.example.com", 587)
        );
        let e = smtp("smtps://relay.example.com").endpoint().unwrap();
        assert_eq!((e.implicit_tls, e.port), (true, 465));
        let e = smtp("smtp://127.0.0.1:2525/").endpoint().unwrap();
        assert_eq!((e.host.as_str(), e.port), ("127.0.0.1", 2525));
        let e = smtp("smtp://[::1]:25").endpoint().unwrap();
        assert_eq!((e.host.as_str(), e.port), ("::1", 25));
        let cases = [
            ("http://x", "smtp.url: scheme must be smtp or smtps"),
            ("smtp://", "smtp.url: missing or invalid host"),
            ("smtp://h:0", "smtp.url: port must be"),
            ("smtp://h:x", "smtp.url: port must be"),
            ("smtp://u:p@h", "smtp.url: must be scheme://host[:port]"),
        ];
        for (url, msg) in cases {
            let err = smtp(url).validate().unwrap_err().to_string();
            assert!(err.starts_with(msg), "{url}: {err}");
        }
    }

    #[test]
    fn smtp_urls_are_read_whole_and_never_echoed() {
        let e = smtp("SMTPS://Relay.Example.com:2465").endpoint().unwrap();
        assert_eq!((e.implicit_tls, e.port), (true, 2465));
        let cases = [
            ("smtp://h/inbox", "smtp.url: must be scheme://host[:port]"),
            ("smtp://h?x=1", "smtp.url: must be scheme://host[:port]"),
            ("smtp://h#x", "smtp.url: must be scheme://host[:port]"),
            ("smtp://h:99999", "smtp.url: port must be"),
            ("smtp://[::1", "smtp.url: invalid IPv6 host"),
            ("smtp://h x", "smtp.url: must not contain blanks"),
            (" smtp://h", "smtp.url: must not contain blanks"),
            (
                "relay.example.com:25",
                "smtp.url: scheme must be smtp or smtps",
            ),
            ("relay", "smtp.url: scheme must be smtp or smtps"),
        ];
        for (url, msg) in cases {
            let err = smtp(url).validate().unwrap_err().to_string();
            assert!(err.starts_with(msg), "{url}: {err}");
        }
        let err = smtp("smtps://capm:hunter2@relay:465")
            .validate()
            .unwrap_err()
            .to_string();
        assert!(!err.contains("hunter2"), "{err}");
    }

    #[test]
    fn smtp_credentials_need_both_halves_and_tls() {
        let mut c = smtp("smtp://h");
        c.username = Some("u".into());
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .starts_with("smtp.password: required")
        );
        c.password = Some(SecretSource::Env("X".into()));
        c.validate().unwrap();
        c.starttls = Some(Starttls::Never);
        let err = c.validate().unwrap_err().to_string();
        assert!(
            err.starts_with("smtp.username: credentials need TLS"),
            "{err}"
        );
        c.starttls = Some(Starttls::Opportunistic);
        assert!(c.validate().is_err());
        let mut c = smtp("smtps://h");
        c.starttls = Some(Starttls::Required);
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .starts_with("smtp.starttls")
        );
        let mut c = smtp("smtp://h");
        c.timeout_seconds = 0.0;
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .starts_with("smtp.timeoutSeconds")
        );
    }

    #[test]
    fn mailgun_validation() {
        let mut c = MailgunConfig::new("mg.example.com", SecretSource::Env("K".into()));
        c.validate().unwrap();
        assert_eq!(c.effective_base_url(), "https://api.mailgun.net");
        c.region = MailgunRegion::Eu;
        assert_eq!(c.effective_base_url(), "https://api.eu.mailgun.net");
        c.base_url = Some("http://127.0.0.1:8080/".into());
        assert_eq!(c.effective_base_url(), "http://127.0.0.1:8080");
        c.validate().unwrap();
        c.base_url = Some("ftp://x".into());
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .starts_with("mailgun.baseUrl: scheme")
        );
        c.base_url = Some("https://user:pw@x".into());
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .starts_with("mailgun.baseUrl")
        );
        c.base_url = None;
        c.domain = "bad domain".into();
        assert!(
            c.validate()
                .unwrap_err()
                .to_string()
                .starts_with("mailgun.domain")
        );
        c.domain = "mg.example.com".into();
        c.request_timeout_seconds = -1.0;
        let err = c.validate().unwrap_err().to_string();
        assert!(err.starts_with("mailgun.requestTimeoutSeconds"), "{err}");
    }

    #[test]
    fn config_files_parse_and_refuse_unknown_fields() {
        let c: MailerConfig = serde_json::from_str(
            r#"{"smtp": {"url": "smtps://relay:465", "username": "u",
                "password": {"file": "/run/pw"}, "pool": {"enabled": false}}}"#,
        )
        .unwrap();
        c.validate().unwrap();
        let MailerConfig::Smtp(s) = &c else {
            panic!("{c:?}")
        };
        assert!(!s.pool.enabled);
        assert_eq!(s.pool.max_size, 10);
        let c: MailerConfig = serde_json::from_str(
            r#"{"mailgun": {"domain": "mg.example.com", "region": "eu", "apiKey": {"env": "K"}}}"#,
        )
        .unwrap();
        c.validate().unwrap();
        for bad in [
            r#"{"mailgun": {"domain": "d", "apiKey": {"env": "K"}, "apikey": 1}}"#,
            r#"{"smtp": {"url": "smtp://h", "pool": {"size": 1}}}"#,
            r#"{"mailgun": {"domain": "d", "apiKey": {"value": "k"}}}"#,
            r#"{"sendgrid": {}}"#,
        ] {
            assert!(serde_json::from_str::<MailerConfig>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn debug_and_errors_never_show_secrets() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        std::fs::write(&key, "key-topsecret-1234\n").unwrap();
        let mut c = MailgunConfig::new("mg.example.com", SecretSource::File(key));
        c.base_url = Some("http://127.0.0.1:1".into());
        let mailer = MailgunMailer::new(&c).unwrap();
        assert!(!format!("{c:?}").contains("topsecret"));
        assert!(!format!("{mailer:?}").contains("topsecret"));
        let mut s = SmtpConfig::new("smtps://h");
        s.username = Some("u".into());
        s.password = Some(SecretSource::File(dir.path().join("nope")));
        let err = SmtpMailer::new(&s).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("smtp.password: reading secret file"),
            "{err}"
        );
    }
}
