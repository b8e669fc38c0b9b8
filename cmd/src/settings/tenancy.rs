//! What the operator lets tenants do (`--default-identity-allowed-namespaces`,
//! `--require-identity-ref`, `--identity-*-hosts`, `--release-timeout`).

use std::{sync::LazyLock, time::Duration};

use capm_controllers::Tenancy;
use capm_mailer::AllowedHosts;

use super::values::{allowed_namespaces, duration, duration_text, host_entry};

/// `--identity-mailgun-hosts`' default, as the flag takes it (comma-separated).
static MAILGUN_HOSTS: LazyLock<String> =
    LazyLock::new(|| AllowedHosts::default_mailgun().join(","));

/// `--release-timeout`'s default, as the flag shows it.
static RELEASE_TIMEOUT: LazyLock<String> =
    LazyLock::new(|| duration_text(capm_controllers::DEFAULT_RELEASE_TIMEOUT));

/// The tenancy flags.
// The field docs are `--help` texts, written for a terminal, not for rustdoc.
#[allow(rustdoc::broken_intra_doc_links, rustdoc::invalid_html_tags)]
#[derive(Debug, clap::Args)]
#[group(skip)]
pub struct Flags {
    /// The namespaces whose objects may mail through this provider's own configuration (the
    /// objects without an identityRef), as JSON in a MailgunClusterIdentity's allowedNamespaces
    /// shape: `{"list": [...], "selector": {...}}`; `{}` allows every namespace. Others get
    /// IdentityNotAllowed and no mail.
    #[arg(long, env = "DEFAULT_IDENTITY_ALLOWED_NAMESPACES", value_name = "JSON", default_value = "{}", value_parser = allowed_namespaces)]
    pub default_identity_allowed_namespaces: capm_api::v1beta1::AllowedNamespaces,

    /// Refuse objects without an identityRef (IdentityRequired, no mail): every tenant mails
    /// through an identity of its own.
    #[arg(long, env = "REQUIRE_IDENTITY_REF", default_value_t = false)]
    pub require_identity_ref: bool,

    /// Hosts (`host` or `host:port`, comma-separated) a MailgunClusterIdentity's Mailgun API URL
    /// may name (its baseURL, or its region's host); `http://` only to a loopback host.
    #[arg(long, env = "IDENTITY_MAILGUN_HOSTS", value_name = "HOSTS", value_delimiter = ',', default_value = MAILGUN_HOSTS.as_str(), value_parser = host_entry)]
    pub identity_mailgun_hosts: Vec<String>,

    /// Hosts (`host` or `host:port`, comma-separated) a MailgunClusterIdentity's SMTP relay may
    /// be [default: none; SMTP identities are refused until the operator lists their relays].
    #[arg(long, env = "IDENTITY_SMTP_HOSTS", value_name = "HOSTS", value_delimiter = ',', value_parser = host_entry)]
    pub identity_smtp_hosts: Vec<String>,

    /// How long after an object's deletion a release mail that cannot go out (its identity
    /// gone, not allowed or unusable, its backend failing) is given up (a ReleaseAbandoned
    /// Event says why), so that the deletion finishes.
    #[arg(long, env = "RELEASE_TIMEOUT", value_name = "DURATION", default_value = RELEASE_TIMEOUT.as_str(), value_parser = duration)]
    pub release_timeout: Duration,
}

/// The tenancy flags as the controllers take them; their values were checked by the parsers.
pub(super) fn resolve(flags: Flags) -> Tenancy {
    Tenancy {
        default_allowed: flags.default_identity_allowed_namespaces,
        require_identity_ref: flags.require_identity_ref,
        hosts: AllowedHosts {
            mailgun: flags.identity_mailgun_hosts,
            smtp: flags.identity_smtp_hosts,
        },
        release_timeout: flags.release_timeout,
    }
}
