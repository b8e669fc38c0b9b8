//! The mail backend's configuration: from its flags over the config file's `mailer` section.

use capm_mailer::{
    ConfigError, MailerConfig, MailgunConfig, MailgunEventsApi, MailgunRegion, SecretSource,
    SmtpConfig,
};

use std::path::PathBuf;

use clap::ValueEnum;

use super::{SettingsError, invalid, values::one_of};

/// Environment variable holding the Mailgun API key (the walkthrough's name).
pub const MAILGUN_API_KEY_ENV: &str = "MAILGUN_API_KEY";
/// Environment variable holding the SMTP password.
pub const SMTP_PASSWORD_ENV: &str = "SMTP_PASSWORD";

/// The mail backend's flags. The config file sets them in its `mailer` section, not by their
/// names (see `file::FLAG_ONLY`).
// The field docs are `--help` texts, written for a terminal, not for rustdoc.
#[allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]
#[derive(Debug, clap::Args)]
#[group(skip)]
pub struct Flags {
    /// Mail backend [default: mailgun when a Mailgun domain is set, else smtp when an SMTP URL is
    /// set].
    #[arg(long, env = "MAIL_BACKEND", value_enum)]
    pub mail_backend: Option<Backend>,

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
    #[arg(long, env = "MAILGUN_REGION", value_name = "REGION", value_parser = one_of(&MailgunRegion::ALL, MailgunRegion::name))]
    pub mailgun_region: Option<MailgunRegion>,

    /// Which Mailgun API answers "was this mail accepted?" and "was it delivered?": `logs`
    /// (one question covers up to 100 open mails; Mailgun deprecates the events API in its
    /// favour) or `events` (one question per mail, for accounts or proxies without the Logs API)
    /// [default: logs].
    #[arg(long, env = "MAILGUN_EVENTS_API", value_name = "API", value_parser = one_of(&MailgunEventsApi::ALL, MailgunEventsApi::name))]
    pub mailgun_events_api: Option<MailgunEventsApi>,

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
}

/// The mail backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Backend {
    /// Mailgun's HTTP API.
    Mailgun,
    /// Any SMTP relay.
    Smtp,
}

/// Maps a mailer configuration error to the flag that sets the field, when there is one.
pub fn mailer_error(error: ConfigError) -> SettingsError {
    let flag = |name: &str| match name {
        "mailgun.domain" => Some(field!(mailgun_domain)),
        "mailgun.apiKey" => Some(field!(mailgun_api_key_file).or_env(MAILGUN_API_KEY_ENV)),
        "mailgun.readApiKey" => Some(field!(mailgun_read_key_file)),
        "mailgun.baseUrl" => Some(field!(mailgun_base_url)),
        "smtp.url" => Some(field!(smtp_url)),
        "smtp.username" => Some(field!(smtp_username)),
        "smtp.password" => Some(field!(smtp_password_file).or_env(SMTP_PASSWORD_ENV)),
        "smtp.caFile" => Some(field!(smtp_ca_file)),
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

fn backend_of(config: &MailerConfig) -> Backend {
    match config {
        MailerConfig::Mailgun(_) => Backend::Mailgun,
        MailerConfig::Smtp(_) => Backend::Smtp,
    }
}

pub(super) fn resolve(
    args: &Flags,
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
                field!(mail_backend),
                format!(
                    "no mail backend configured: set {} for Mailgun or {} for SMTP",
                    field!(mailgun_domain),
                    field!(smtp_url)
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
                    invalid(field!(mailgun_domain), "required for the mailgun backend")
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
                    invalid(
                        field!(mailgun_api_key_file).or_env(MAILGUN_API_KEY_ENV),
                        "the Mailgun API key is required",
                    )
                })?;
            let mut config = base.unwrap_or_else(|| MailgunConfig::new(&domain, api_key.clone()));
            config.domain = domain;
            config.api_key = api_key;
            if let Some(path) = &args.mailgun_read_key_file {
                config.read_api_key = Some(SecretSource::File(path.clone()));
            }
            if let Some(region) = args.mailgun_region {
                config.region = region;
            }
            if let Some(url) = &args.mailgun_base_url {
                config.base_url = Some(url.clone());
            }
            if let Some(api) = args.mailgun_events_api {
                config.events_api = api;
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
                .ok_or_else(|| invalid(field!(smtp_url), "required for the smtp backend"))?;
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

pub(super) fn default_message_id_domain(mailer: &MailerConfig) -> Option<String> {
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
