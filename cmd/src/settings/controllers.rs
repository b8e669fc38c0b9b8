//! The controllers' settings: their flags, their fields named by the flags that set them, and
//! the namespace of the identities' Secrets.

use std::time::Duration;

use capm_mailer::MailerConfig;

use super::{
    Field, SettingsError, in_cluster_namespace, invalid,
    mailer::default_message_id_domain,
    values::{duration, label_value, namespace, recipient},
};

/// The controllers' flags (the tenancy flags are [`super::tenancy::Flags`]).
// The field docs are `--help` texts, written for a terminal, not for rustdoc.
#[allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]
#[derive(Debug, clap::Args)]
#[group(skip)]
pub struct Flags {
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

    /// Namespace of the Secrets that MailgunClusterIdentities name (the provider's own; its Role
    /// may read Secrets there only) [default: $POD_NAMESPACE, else the in-cluster namespace;
    /// without one, identities cannot be used].
    #[arg(long, env = "IDENTITY_SECRET_NAMESPACE", value_name = "NAMESPACE")]
    pub identity_secret_namespace: Option<String>,
}

/// The controllers' configuration, validated by its own rules (`Config::validate`) and with
/// the backend's defaults for the sender and the Message-Id domain; the namespace of the
/// identities' Secrets is [`identity_secret_namespace`]'s, checked after the endpoints.
pub(super) fn resolve(
    flags: Flags,
    tenancy: capm_controllers::Tenancy,
    mailer: &MailerConfig,
) -> Result<(capm_controllers::Config, Option<String>), SettingsError> {
    // `None` where the backend has no default. Their rules are the controllers'.
    let mail_from = flags.mail_from.or_else(|| match mailer {
        MailerConfig::Mailgun(c) => Some(format!("cluster-api-provider-mailgun@{}", c.domain)),
        MailerConfig::Smtp(_) => None,
    });
    let message_id_domain = flags
        .message_id_domain
        .or_else(|| default_message_id_domain(mailer));
    let controllers = capm_controllers::Config {
        recipients: flags.mail_recipients.unwrap_or_default(),
        mail_from: mail_from.clone().unwrap_or_default(),
        message_id_domain: message_id_domain.clone().unwrap_or_default(),
        // The keys are read at start (see `app::run`); settings read no secret.
        fulfilment: None,
        namespace: flags.namespace,
        watch_filter: flags.watch_filter,
        concurrency: flags.concurrency,
        backoff_base: flags.backoff_base,
        backoff_max: flags.backoff_max,
        lookup_grace: flags.lookup_grace,
        delivery_poll_base: flags.delivery_poll_base,
        delivery_poll_max: flags.delivery_poll_max,
        delivery_retention: flags.mailgun_events_retention,
        sync_period: flags.sync_period,
        // Checked later, with the other namespaces.
        identity_secret_namespace: None,
        tenancy,
        // Known only once the process runs (see `app::run`).
    };
    controllers
        .validate()
        .map_err(|e| controllers_error(&e, mail_from.is_none(), message_id_domain.is_none()))?;
    Ok((controllers, flags.identity_secret_namespace))
}

/// The flag (and variable) that sets a field of the controllers' configuration.
pub(super) fn controllers_flag(field: capm_controllers::Field) -> Field {
    use capm_controllers::Field as C;
    match field {
        C::Recipients => field!(mail_recipients),
        C::MailFrom => field!(mail_from),
        C::MessageIdDomain => field!(message_id_domain),
        C::Concurrency => field!(concurrency),
        C::BackoffBase => field!(backoff_base),
        C::BackoffMax => field!(backoff_max),
        C::LookupGrace => field!(lookup_grace),
        C::SyncPeriod => field!(sync_period),
        C::DeliveryPollBase => field!(delivery_poll_base),
        C::DeliveryPollMax => field!(delivery_poll_max),
        C::DeliveryRetention => field!(mailgun_events_retention),
    }
}

/// The controllers' refusal of a field, named by its flag. A sender or Message-Id domain that
/// is missing because the backend gives no default (`*_defaulted_none`) says so.
fn controllers_error(
    error: &capm_controllers::Invalid,
    mail_from_defaulted_none: bool,
    message_id_domain_defaulted_none: bool,
) -> SettingsError {
    use capm_controllers::Field as C;
    let reason = match error.field {
        C::MailFrom if mail_from_defaulted_none => "required for the SMTP backend: an address on \
            the domain the relay sends for (a requester's address in From fails DMARC at the \
            receivers)"
            .to_owned(),
        C::MessageIdDomain if message_id_domain_defaulted_none => {
            "required: the SMTP relay's host cannot serve as Message-Id domain".to_owned()
        }
        _ => error.reason(|field| controllers_flag(field).to_string()),
    };
    invalid(controllers_flag(error.field), reason)
}

/// The namespace of the identities' Secrets (`--identity-secret-namespace`): the flag, else the
/// provider's own namespace (`POD_NAMESPACE`, or the in-cluster ServiceAccount's); `None`
/// outside a cluster without the flag.
pub(super) fn identity_secret_namespace(
    flag: Option<String>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<String>, SettingsError> {
    flag.or_else(|| env("POD_NAMESPACE"))
        .or_else(in_cluster_namespace)
        .map(|ns| namespace(&ns).map_err(|r| invalid(field!(identity_secret_namespace), r.0)))
        .transpose()
}
