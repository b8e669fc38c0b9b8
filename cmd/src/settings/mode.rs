//! What this process runs (`--mode`): everything, or only the fulfilment page.
//!
//! A page-only process (`--mode fulfilment-page`) serves the page, the probes and `/metrics`:
//! no mail backend, no leader election, no webhooks, no controllers. It may run with its own
//! ServiceAccount, which reads and patches the provider's kinds and never the mail credentials,
//! so a mail setting given to it is refused rather than ignored.

use std::net::SocketAddr;

use capm_mailer::MailerConfig;
use clap::ValueEnum;

use super::{
    Args, Field, SettingsError,
    controllers::Flags as ControllerFlags,
    fulfilment::{self, Flags as FulfilmentFlags, Fulfilment},
    invalid,
    mailer::{Flags as MailerFlags, MAILGUN_API_KEY_ENV, SMTP_PASSWORD_ENV},
};

/// What the process runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// The controllers, the webhooks, leader election and, with --fulfilment-url, the
    /// fulfilment links and page.
    #[default]
    All,
    /// Only the fulfilment page, the probes and /metrics: no mail backend, no leader election,
    /// no webhooks, no controllers.
    FulfilmentPage,
}

impl Mode {
    /// The flag's value.
    pub fn name(self) -> &'static str {
        match self {
            Self::All => "all",
            Self::FulfilmentPage => "fulfilment-page",
        }
    }
}

/// A page-only process's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageOnly {
    /// The page (URL, keys file, trusted proxies); its `bind` is `Some`.
    pub fulfilment: Fulfilment,
    /// Where the page listens.
    pub bind: SocketAddr,
    /// The provider's own recipients (`--mail-recipient`), named in the Event of a use of a
    /// link whose mail went to them; may be empty.
    pub recipients: Vec<String>,
}

/// The page-only settings: the page's URL, keys file and address required, every mail setting
/// refused.
pub(super) fn resolve_page_only(
    mail: &MailerFlags,
    controllers: &ControllerFlags,
    fulfilment: FulfilmentFlags,
    file_mailer: Option<&MailerConfig>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<PageOnly, SettingsError> {
    let no_mail = |field: Field, what: &str| {
        invalid(
            field,
            format!(
                "{what}with {} {}, which serves only the fulfilment page and holds no mail \
                 credentials: remove the mail settings from its flags, variables and config file",
                field!(mode in Args),
                Mode::FulfilmentPage.name()
            ),
        )
    };
    if let Some(field) = mail_flag_set(mail) {
        return Err(no_mail(field, "is set "));
    }
    if file_mailer.is_some() {
        return Err(no_mail(field!(config in Args), "has a `mailer` section "));
    }
    for variable in [MAILGUN_API_KEY_ENV, SMTP_PASSWORD_ENV] {
        if env(variable).is_some() {
            return Err(no_mail(Field::variable(variable), "is set "));
        }
    }
    let required = |field: Field, what: &str| {
        invalid(
            field,
            format!(
                "required with {} {}: {what}",
                field!(mode in Args),
                Mode::FulfilmentPage.name()
            ),
        )
    };
    if fulfilment
        .fulfilment_url
        .as_deref()
        .is_none_or(str::is_empty)
    {
        return Err(required(
            field!(fulfilment_url in FulfilmentFlags),
            "the page's public base URL",
        ));
    }
    if fulfilment.fulfilment_keys_file.is_none() {
        return Err(required(
            field!(fulfilment_keys_file in FulfilmentFlags),
            "the links' keys",
        ));
    }
    let Some(page) = fulfilment::resolve(fulfilment)? else {
        return Err(required(
            field!(fulfilment_url in FulfilmentFlags),
            "the page's public base URL",
        ));
    };
    let Some(bind) = page.bind else {
        return Err(required(
            field!(fulfilment_bind_address in FulfilmentFlags),
            "the page's address (not 0)",
        ));
    };
    Ok(PageOnly {
        fulfilment: page,
        bind,
        recipients: controllers.mail_recipients.clone().unwrap_or_default(),
    })
}

/// The first mail backend flag (or its variable) that is set.
fn mail_flag_set(flags: &MailerFlags) -> Option<Field> {
    let MailerFlags {
        mail_backend,
        mailgun_domain,
        mailgun_api_key_file,
        mailgun_read_key_file,
        mailgun_region,
        mailgun_events_api,
        mailgun_base_url,
        smtp_url,
        smtp_username,
        smtp_password_file,
        smtp_ca_file,
    } = flags;
    [
        (mail_backend.is_some(), field!(mail_backend in MailerFlags)),
        (
            mailgun_domain.is_some(),
            field!(mailgun_domain in MailerFlags),
        ),
        (
            mailgun_api_key_file.is_some(),
            field!(mailgun_api_key_file in MailerFlags),
        ),
        (
            mailgun_read_key_file.is_some(),
            field!(mailgun_read_key_file in MailerFlags),
        ),
        (
            mailgun_region.is_some(),
            field!(mailgun_region in MailerFlags),
        ),
        (
            mailgun_events_api.is_some(),
            field!(mailgun_events_api in MailerFlags),
        ),
        (
            mailgun_base_url.is_some(),
            field!(mailgun_base_url in MailerFlags),
        ),
        (smtp_url.is_some(), field!(smtp_url in MailerFlags)),
        (
            smtp_username.is_some(),
            field!(smtp_username in MailerFlags),
        ),
        (
            smtp_password_file.is_some(),
            field!(smtp_password_file in MailerFlags),
        ),
        (smtp_ca_file.is_some(), field!(smtp_ca_file in MailerFlags)),
    ]
    .into_iter()
    .find_map(|(set, field)| set.then_some(field))
}
