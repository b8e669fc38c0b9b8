//! The controllers' settings: their fields named by the flags that set them, and the namespace
//! of the identities' Secrets.

use super::{Field, SettingsError, in_cluster_namespace, invalid, values::namespace};

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
pub(super) fn controllers_error(
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
