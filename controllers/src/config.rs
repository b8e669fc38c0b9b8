//! What the controllers need to know besides the cluster and the mailer, and why they stop.

use std::time::Duration;

use capm_api::v1beta1::AllowedNamespaces;
use capm_mailer::AllowedHosts;

/// How long a release may wait for an unusable identity or a failing backend by default
/// ([`Tenancy::release_timeout`]; the binary's `--release-timeout` defaults to it).
pub const DEFAULT_RELEASE_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// What the controllers need to know besides the cluster and the mailer.
///
/// There is no `Default`: the binary's flags set every field (their defaults declared there, or
/// constants here such as [`DEFAULT_RELEASE_TIMEOUT`]).
#[derive(Debug, Clone)]
pub struct Config {
    /// Who receives the request mails (`MAIL_RECIPIENT`); at least one address.
    pub recipients: Vec<String>,
    /// The mails' `From` (`--mail-from`): an address of the sending side, on the domain the
    /// backend sends for, so that receivers' DMARC checks pass. The requester is `Reply-To`.
    pub mail_from: String,
    /// The domain of the deterministic Message-Ids (`<kind.uid@domain>`), usually the Mailgun
    /// sending domain.
    pub message_id_domain: String,
    /// The fulfilment page's links, put in request mails (`--fulfilment-url`); `None`: no link.
    pub fulfilment: Option<capm_api::link_token::Links>,
    /// Reconcile only this namespace (`--namespace`); `None` for all namespaces.
    pub namespace: Option<String>,
    /// Reconcile only objects whose `cluster.x-k8s.io/watch-filter` label has this value
    /// (`--watch-filter`).
    pub watch_filter: Option<String>,
    /// Reconciles running at once per controller (`--concurrency`), at least 1.
    pub concurrency: u16,
    /// First retry delay after an error; doubles per consecutive failure of one object.
    pub backoff_base: Duration,
    /// Ceiling of the per-object retry delay. Permanent errors are not retried on a timer: the
    /// object's next change (or the next sync period) reconciles it again.
    pub backoff_max: Duration,
    /// How long a backend lookup must keep answering "not found" for a mail whose outcome was
    /// unknown before it is sent again (event stores lag behind sends).
    pub lookup_grace: Duration,
    /// First wait between two questions to the backend about a request mail's delivery; doubles
    /// per question while the outcome is unknown.
    pub delivery_poll_base: Duration,
    /// Longest wait between two delivery questions.
    pub delivery_poll_max: Duration,
    /// How long the backend keeps its delivery events (Mailgun: by plan); after that the
    /// provider stops asking and reports the outcome as unknown.
    pub delivery_retention: Duration,
    /// Every object is reconciled at least once per period even when nothing triggers it
    /// (controller-runtime's `SyncPeriod`), spread evenly over the period.
    pub sync_period: Duration,
    /// The namespace whose Secrets `MailgunClusterIdentity` objects name: the provider's own.
    /// `None`: identities cannot be used (objects naming one are told so).
    pub identity_secret_namespace: Option<String>,
    /// What the operator lets tenants do: the default identity's namespaces, the hosts and
    /// Secrets identities may use, how long a release may wait.
    pub tenancy: Tenancy,
}

/// What the operator lets tenants do (docs/multi-tenancy.md): the namespaces the provider's own
/// configuration serves, whether an `identityRef` is required, the hosts an identity may reach
/// and how long a release may wait. Which Secrets an identity may name is the API's rule
/// (`MailgunClusterIdentity::check_claim`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenancy {
    /// The namespaces whose objects may mail through the provider's own configuration (no
    /// `identityRef`), in an identity's shape (`--default-identity-allowed-namespaces`; `{}`:
    /// all, a single team's install).
    pub default_allowed: AllowedNamespaces,
    /// Objects without an `identityRef` are refused (`IdentityRequired`, no mail)
    /// (`--require-identity-ref`).
    pub require_identity_ref: bool,
    /// The hosts an identity's Mailgun API URL and SMTP relay may name
    /// (`--identity-mailgun-hosts`, `--identity-smtp-hosts`).
    pub hosts: AllowedHosts,
    /// How long after its deletion an object whose release cannot go out (its identity gone,
    /// not allowed or unusable, its backend failing) gives the release up, so that the deletion
    /// finishes (`--release-timeout`).
    pub release_timeout: Duration,
}

impl Config {
    /// Checks that this configuration can work: the one place each field's rule lives (the
    /// binary names a refused field by its flag, see [`Invalid`]).
    ///
    /// # Errors
    /// [`Invalid`] naming the first field that cannot work, in the fields' declaration order.
    pub fn validate(&self) -> Result<(), Invalid> {
        let refuse = |field, reason| Err(Invalid { field, reason });
        if self.recipients.is_empty() {
            return refuse(Field::Recipients, Reason::Missing);
        }
        if self.mail_from.trim().is_empty() {
            return refuse(Field::MailFrom, Reason::Missing);
        }
        // The rule the Message-Ids are built by.
        if capm_mailer::MessageId::new("x", &self.message_id_domain).is_err() {
            return refuse(
                Field::MessageIdDomain,
                Reason::NotADomain(self.message_id_domain.clone()),
            );
        }
        if self.concurrency == 0 {
            return refuse(Field::Concurrency, Reason::Zero);
        }
        if self.backoff_base.is_zero() {
            return refuse(Field::BackoffBase, Reason::Zero);
        }
        if self.backoff_base > self.backoff_max {
            return refuse(Field::BackoffBase, Reason::LongerThan(Field::BackoffMax));
        }
        if self.lookup_grace.is_zero() {
            return refuse(Field::LookupGrace, Reason::Zero);
        }
        if self.sync_period.is_zero() {
            return refuse(Field::SyncPeriod, Reason::Zero);
        }
        if self.delivery_poll_base.is_zero() || self.delivery_poll_base > self.delivery_poll_max {
            return refuse(
                Field::DeliveryPollBase,
                Reason::ZeroOrLongerThan(Field::DeliveryPollMax),
            );
        }
        if self.delivery_retention.is_zero() {
            return refuse(Field::DeliveryRetention, Reason::Zero);
        }
        Ok(())
    }
}

/// A [`Config`] field that [`Config::validate`] checks; each variant is the field of its name.
#[allow(missing_docs)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Field {
    Recipients,
    MailFrom,
    MessageIdDomain,
    Concurrency,
    BackoffBase,
    BackoffMax,
    LookupGrace,
    SyncPeriod,
    DeliveryPollBase,
    DeliveryPollMax,
    DeliveryRetention,
}

impl Field {
    /// The field's name in [`Config`].
    pub fn name(self) -> &'static str {
        match self {
            Self::Recipients => "recipients",
            Self::MailFrom => "mail_from",
            Self::MessageIdDomain => "message_id_domain",
            Self::Concurrency => "concurrency",
            Self::BackoffBase => "backoff_base",
            Self::BackoffMax => "backoff_max",
            Self::LookupGrace => "lookup_grace",
            Self::SyncPeriod => "sync_period",
            Self::DeliveryPollBase => "delivery_poll_base",
            Self::DeliveryPollMax => "delivery_poll_max",
            Self::DeliveryRetention => "delivery_retention",
        }
    }
}

/// What is wrong with a field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reason {
    /// Empty: no recipient, no sender.
    Missing,
    /// Not a domain the Message-Ids can be built on (the value given).
    NotADomain(String),
    /// Zero: a count must be at least 1, a duration positive.
    Zero,
    /// Longer than the other field, its ceiling.
    LongerThan(Field),
    /// Zero, or longer than the other field, its ceiling.
    ZeroOrLongerThan(Field),
}

/// A [`Config`] that cannot work: which field and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid {
    /// The first field found wrong.
    pub field: Field,
    /// What is wrong with it.
    pub reason: Reason,
}

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let reason = self.reason(|field| field.name().to_owned());
        write!(f, "{}: {reason}", self.field.name())
    }
}

impl std::error::Error for Invalid {}

impl Invalid {
    /// What is wrong, in words, naming another field (a ceiling) as `name` says: by its name in
    /// [`Config`] here, by its flag in the binary.
    pub fn reason(&self, name: impl Fn(Field) -> String) -> String {
        match &self.reason {
            Reason::Missing if self.field == Field::Recipients => {
                "at least one recipient is required".to_owned()
            }
            Reason::Missing => "required".to_owned(),
            Reason::NotADomain(value) => {
                format!("{value:?} is not a domain (letters, digits, '-' and '.')")
            }
            Reason::Zero if self.field == Field::Concurrency => "must be at least 1".to_owned(),
            Reason::Zero => "must be positive".to_owned(),
            Reason::LongerThan(ceiling) => format!("must not be longer than {}", name(*ceiling)),
            Reason::ZeroOrLongerThan(ceiling) => {
                format!("must be positive and not longer than {}", name(*ceiling))
            }
        }
    }
}

/// Why the controllers stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration cannot work.
    #[error("invalid controller configuration: {0}")]
    Config(#[from] Invalid),
    /// The Kubernetes API refused something the controllers need to start.
    #[error("{context}: {source}")]
    Kube {
        /// What was being done.
        context: String,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The binary's tenancy defaults: everything as a single-team install had it, Mailgun's two
    /// API hosts, no SMTP host, a day for a release.
    pub(crate) fn tenancy() -> Tenancy {
        Tenancy {
            default_allowed: AllowedNamespaces::default(),
            require_identity_ref: false,
            hosts: AllowedHosts {
                mailgun: AllowedHosts::default_mailgun(),
                smtp: Vec::new(),
            },
            release_timeout: DEFAULT_RELEASE_TIMEOUT,
        }
    }

    /// A configuration for the crate's unit tests: one recipient, a sender and Message-Ids on
    /// `domain`, short backoffs, the binary's other defaults.
    pub(crate) fn for_tests(domain: &str) -> Config {
        Config {
            recipients: vec!["ops@example.com".into()],
            mail_from: "capm@example.com".into(),
            message_id_domain: domain.into(),
            fulfilment: None,
            namespace: None,
            watch_filter: None,
            concurrency: 10,
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            lookup_grace: Duration::from_secs(10),
            delivery_poll_base: Duration::from_secs(30),
            delivery_poll_max: Duration::from_secs(30 * 60),
            delivery_retention: Duration::from_secs(72 * 3600),
            sync_period: Duration::from_secs(10 * 3600),
            identity_secret_namespace: None,
            tenancy: tenancy(),
        }
    }

    /// A unit-test configuration changed by `change` is refused with `expected`, also as the
    /// controllers' error.
    fn refused(change: impl FnOnce(&mut Config), expected: &str) {
        let mut config = for_tests("capm.example.com");
        change(&mut config);
        let error = config.validate().unwrap_err();
        assert_eq!(error.to_string(), expected);
        let stopped = Error::from(error).to_string();
        assert_eq!(
            stopped,
            format!("invalid controller configuration: {expected}")
        );
    }

    #[test]
    fn each_rule_names_its_field() {
        for_tests("capm.example.com").validate().unwrap();
        let recipients = "recipients: at least one recipient is required";
        refused(|c| c.recipients.clear(), recipients);
        refused(|c| c.mail_from = " ".into(), "mail_from: required");
        let domain = r#"message_id_domain: "a b" is not a domain (letters, digits, '-' and '.')"#;
        refused(|c| c.message_id_domain = "a b".into(), domain);
        refused(|c| c.concurrency = 0, "concurrency: must be at least 1");
        let backoff = "backoff_base: must not be longer than backoff_max";
        refused(|c| c.backoff_base = c.backoff_max * 2, backoff);
        let poll = "delivery_poll_base: must be positive and not longer than delivery_poll_max";
        refused(|c| c.delivery_poll_base = Duration::ZERO, poll);
        refused(|c| c.delivery_poll_base = c.delivery_poll_max * 2, poll);
        /// A duration field of a configuration.
        type FieldOf = fn(&mut Config) -> &mut Duration;
        let positive: [(FieldOf, &str); 4] = [
            (|c| &mut c.backoff_base, "backoff_base"),
            (|c| &mut c.lookup_grace, "lookup_grace"),
            (|c| &mut c.sync_period, "sync_period"),
            (|c| &mut c.delivery_retention, "delivery_retention"),
        ];
        for (field, name) in positive {
            let expected = format!("{name}: must be positive");
            refused(|c| *field(c) = Duration::ZERO, &expected);
        }
    }
}
