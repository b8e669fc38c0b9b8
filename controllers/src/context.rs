//! Shared state of the controllers: clients, caches, and the per-object memory that keeps
//! retries slow and writes few.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use capm_mailer::{ErrorKind, MailError, Mailer, MessageError};
use kube::{Client, runtime::reflector::Store};

use crate::{
    Config, Metrics,
    capi::{Cluster, Machine},
    events::Events,
};

/// Why one reconcile failed; decides how soon it is retried.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    /// A Kubernetes API call failed.
    #[error("{context}: {source}")]
    Kube {
        /// What was being done.
        context: &'static str,
        /// The error.
        #[source]
        source: kube::Error,
    },
    /// A write lost an optimistic-concurrency race (HTTP 409); retried soon with fresh data.
    #[error("{0}: the object changed meanwhile (conflict); retrying with its new version")]
    Conflict(&'static str),
    /// The mail backend failed.
    #[error("mail backend: {0}")]
    Mail(#[source] MailError),
    /// The mail could not be built from the object (a value the schema should have refused).
    #[error("building the mail: {0}")]
    Message(#[source] MessageError),
    /// The object breaks a validation rule.
    #[error("invalid object: {0}")]
    InvalidSpec(String),
    /// The backend has no record of a mail whose outcome was unknown; wait before resending.
    #[error("no record yet of a mail whose outcome was unknown; checking again before resending")]
    AwaitingLookup(Duration),
}

impl ReconcileError {
    /// Permanent errors do not go away by retrying soon.
    pub fn is_permanent(&self) -> bool {
        match self {
            Self::Mail(e) => e.kind() == ErrorKind::Permanent,
            Self::Message(_) | Self::InvalidSpec(_) => true,
            Self::Kube { .. } | Self::Conflict(_) | Self::AwaitingLookup(_) => false,
        }
    }

    pub(crate) fn kube(context: &'static str) -> impl FnOnce(kube::Error) -> Self {
        move |source| Self::Kube { context, source }
    }

    pub(crate) fn from_write(context: &'static str) -> impl FnOnce(kube::Error) -> Self {
        move |source| match &source {
            kube::Error::Api(status) if status.code == 409 => Self::Conflict(context),
            _ => Self::Kube { context, source },
        }
    }
}

/// What this process knows about its own last send attempt for one mail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attempt {
    /// The backend certainly did not accept it (refused before or without accepting).
    NotSent,
    /// It may have been accepted (timeout after sending, 5xx).
    Unknown,
    /// A lookup found no record at this instant.
    NotFoundAt(Instant),
}

/// Everything a reconcile needs.
pub struct Ctx {
    /// API client.
    pub client: Client,
    /// The mail backend.
    pub mailer: Arc<dyn Mailer>,
    /// Event publisher.
    pub events: Events,
    /// Configuration.
    pub config: Config,
    /// Metrics.
    pub metrics: Metrics,
    /// Cached Cluster API `Cluster`s.
    pub clusters: Store<Cluster>,
    /// Cached Cluster API `Machine`s.
    pub machines: Store<Machine>,
    failures: Mutex<HashMap<String, u32>>,
    expected_versions: Mutex<HashMap<String, u64>>,
    attempts: Mutex<HashMap<String, Attempt>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Ctx {
    /// A context over the given parts.
    pub fn new(
        client: Client,
        mailer: Arc<dyn Mailer>,
        events: Events,
        config: Config,
        metrics: Metrics,
        clusters: Store<Cluster>,
        machines: Store<Machine>,
    ) -> Self {
        Self {
            client,
            mailer,
            events,
            config,
            metrics,
            clusters,
            machines,
            failures: Mutex::default(),
            expected_versions: Mutex::default(),
            attempts: Mutex::default(),
        }
    }

    /// The delay before retrying `key` after `error`: exponential per object
    /// (`backoff_base` doubling up to `backoff_max`), the maximum for permanent errors, never less
    /// than a backend's `Retry-After`.
    pub fn retry_delay(&self, key: &str, error: &ReconcileError) -> Duration {
        let max = self.config.backoff_max;
        if let ReconcileError::AwaitingLookup(wait) = error {
            return *wait;
        }
        if matches!(error, ReconcileError::Conflict(_)) {
            return self.config.backoff_base.min(max);
        }
        let failures = {
            let mut map = lock(&self.failures);
            let n = map.entry(key.to_owned()).or_insert(0);
            *n = n.saturating_add(1);
            *n
        };
        let exponential = self
            .config
            .backoff_base
            .saturating_mul(1u32 << (failures - 1).min(20))
            .min(max);
        let delay = if error.is_permanent() {
            max
        } else {
            exponential
        };
        match error {
            ReconcileError::Mail(e) => delay.max(e.retry_after().unwrap_or_default()),
            _ => delay,
        }
    }

    /// Forgets `key`'s failures after a successful reconcile.
    pub fn succeeded(&self, key: &str) {
        lock(&self.failures).remove(key);
    }

    /// Remembers the `resourceVersion` our own write produced, so a reconcile that starts from an
    /// older cached copy waits for the cache instead of acting on stale data.
    pub fn expect_version(&self, uid: &str, resource_version: Option<&str>) {
        if let Some(rv) = resource_version.and_then(|v| v.parse::<u64>().ok()) {
            lock(&self.expected_versions).insert(uid.to_owned(), rv);
        }
    }

    /// True when the cached copy predates our own last write.
    pub fn is_stale(&self, uid: &str, resource_version: Option<&str>) -> bool {
        let mut map = lock(&self.expected_versions);
        let Some(&expected) = map.get(uid) else {
            return false;
        };
        match resource_version.and_then(|v| v.parse::<u64>().ok()) {
            Some(seen) if seen < expected => true,
            _ => {
                map.remove(uid);
                false
            }
        }
    }

    /// The last attempt recorded for one mail.
    pub fn attempt(&self, mail_key: &str) -> Option<Attempt> {
        lock(&self.attempts).get(mail_key).copied()
    }

    /// Records (or with `None` forgets) the last attempt for one mail.
    pub fn set_attempt(&self, mail_key: &str, attempt: Option<Attempt>) {
        let mut map = lock(&self.attempts);
        match attempt {
            Some(a) => {
                map.insert(mail_key.to_owned(), a);
            }
            None => {
                map.remove(mail_key);
            }
        }
    }

    /// Forgets everything about an object that is gone.
    pub fn forget(&self, uid: &str) {
        lock(&self.expected_versions).remove(uid);
        lock(&self.attempts).retain(|k, _| !k.starts_with(uid));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capm_mailer::MockMailer;

    fn ctx() -> Ctx {
        let client =
            Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
        let events = Events::new(client.clone(), "t", "t");
        let config = Config {
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_secs(10),
            ..Config::default()
        };
        let metrics = Metrics::register(&prometheus::Registry::new()).unwrap();
        let (clusters, _) = kube::runtime::reflector::store();
        let (machines, _) = kube::runtime::reflector::store();
        Ctx::new(
            client,
            Arc::new(MockMailer::new()),
            events,
            config,
            metrics,
            clusters,
            machines,
        )
    }

    fn transient() -> ReconcileError {
        ReconcileError::Mail(MailError::Retryable {
            backend: "mock",
            message: "down".into(),
            code: None,
            retry_after: None,
            source: None,
        })
    }

    #[tokio::test]
    async fn backoff_doubles_per_object_caps_and_resets() {
        let ctx = ctx();
        let delays: Vec<_> = (0..10)
            .map(|_| ctx.retry_delay("ns/a", &transient()))
            .collect();
        assert_eq!(delays[0], Duration::from_millis(100));
        assert_eq!(delays[1], Duration::from_millis(200));
        assert_eq!(delays[3], Duration::from_millis(800));
        assert_eq!(delays[9], Duration::from_secs(10));
        // Another object has its own count.
        assert_eq!(
            ctx.retry_delay("ns/b", &transient()),
            Duration::from_millis(100)
        );
        ctx.succeeded("ns/a");
        assert_eq!(
            ctx.retry_delay("ns/a", &transient()),
            Duration::from_millis(100)
        );
    }

    #[tokio::test]
    async fn permanent_errors_wait_the_maximum_and_retry_after_is_honoured() {
        let ctx = ctx();
        assert_eq!(
            ctx.retry_delay("ns/a", &ReconcileError::InvalidSpec("x".into())),
            Duration::from_secs(10)
        );
        let limited = ReconcileError::Mail(MailError::Retryable {
            backend: "mock",
            message: "slow down".into(),
            code: Some(429),
            retry_after: Some(Duration::from_secs(7)),
            source: None,
        });
        assert_eq!(ctx.retry_delay("ns/c", &limited), Duration::from_secs(7));
        assert_eq!(
            ctx.retry_delay("ns/d", &ReconcileError::Conflict("x")),
            Duration::from_millis(100)
        );
    }

    #[tokio::test]
    async fn cache_older_than_our_write_is_stale() {
        let ctx = ctx();
        ctx.expect_version("u1", Some("120"));
        assert!(ctx.is_stale("u1", Some("100")));
        assert!(!ctx.is_stale("u1", Some("120")));
        // Once caught up, the expectation is gone.
        assert!(!ctx.is_stale("u1", Some("100")));
        assert!(!ctx.is_stale("u2", Some("1")));
    }
}
