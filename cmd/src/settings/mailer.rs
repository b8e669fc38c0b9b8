//! The mail backend's configuration: from its flags over the config file's `mailer` section.

use capm_mailer::{
    ConfigError, MailerConfig, MailgunConfig, MailgunEventsApi, MailgunRegion, SecretSource,
    SmtpConfig,
};

use super::{
    Args, Backend, EventsApi, MAILGUN_API_KEY_ENV, Region, SMTP_PASSWORD_ENV, SettingsError,
    invalid,
};

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

pub(super) fn resolve_mailer(
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
                config.region = match region {
                    Region::Us => MailgunRegion::Us,
                    Region::Eu => MailgunRegion::Eu,
                };
            }
            if let Some(url) = &args.mailgun_base_url {
                config.base_url = Some(url.clone());
            }
            if let Some(api) = args.mailgun_events_api {
                config.events_api = match api {
                    EventsApi::Logs => MailgunEventsApi::Logs,
                    EventsApi::Events => MailgunEventsApi::Events,
                };
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
