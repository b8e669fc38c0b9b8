//! What the controllers need to know besides the cluster and the mailer, and why they stop.

use std::time::Duration;

/// What the controllers need to know besides the cluster and the mailer.
///
/// There is no `Default`: the defaults are the binary's (its flags), declared once there.
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
    /// `reportingInstance` of the events this process records (for example the pod name).
    pub instance: String,
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
}

impl Config {
    /// Checks that this configuration can work.
    ///
    /// # Errors
    /// [`Error::Config`] naming the field.
    pub fn validate(&self) -> Result<(), Error> {
        if self.recipients.is_empty() {
            return Err(Error::Config(
                "recipients: at least one recipient is required".into(),
            ));
        }
        if self.mail_from.trim().is_empty() {
            return Err(Error::Config(
                "mail_from: the sender address is required".into(),
            ));
        }
        if self.message_id_domain.is_empty()
            || self.message_id_domain.contains(['<', '>', '@', ' '])
        {
            return Err(Error::Config(format!(
                "message_id_domain: {:?} is not a domain",
                self.message_id_domain
            )));
        }
        if self.concurrency == 0 {
            return Err(Error::Config("concurrency: must be at least 1".into()));
        }
        if self.backoff_base.is_zero() || self.backoff_base > self.backoff_max {
            return Err(Error::Config(
                "backoff_base: must be positive and at most backoff_max".into(),
            ));
        }
        if self.delivery_poll_base.is_zero() || self.delivery_poll_base > self.delivery_poll_max {
            return Err(Error::Config(
                "delivery_poll_base: must be positive and at most delivery_poll_max".into(),
            ));
        }
        if self.sync_period.is_zero() {
            return Err(Error::Config("sync_period: must be positive".into()));
        }
        Ok(())
    }
}

/// Why the controllers stopped.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration cannot work.
    #[error("invalid controller configuration: {0}")]
    Config(String),
    /// The Kubernetes API refused something the controllers need to start.
    #[error("{context}: {source}")]
    Kube {
        /// What was being done.
        context: &'static str,
        /// The API error.
        #[source]
        source: kube::Error,
    },
}

/// A configuration for the crate's unit tests: one recipient, a sender and Message-Ids on
/// `domain`, short backoffs, the binary's other defaults.
#[cfg(test)]
pub(crate) fn for_tests(domain: &str) -> Config {
    Config {
        recipients: vec!["ops@example.com".into()],
        mail_from: "capm@example.com".into(),
        message_id_domain: domain.into(),
        namespace: None,
        watch_filter: None,
        concurrency: 10,
        backoff_base: Duration::from_millis(100),
        backoff_max: Duration::from_secs(10),
        instance: "t".into(),
        lookup_grace: Duration::from_secs(10),
        delivery_poll_base: Duration::from_secs(30),
        delivery_poll_max: Duration::from_secs(30 * 60),
        delivery_retention: Duration::from_secs(72 * 3600),
        sync_period: Duration::from_secs(10 * 3600),
        identity_secret_namespace: None,
    }
}
