//! Shared state of the controllers: clients, caches, and the per-object memory that keeps
//! retries slow and writes few.
//!
//! Long because each piece of per-object memory (backoff, expected versions, mail state,
//! tombstones) keeps its rules beside it; a third of the file is their tests.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use capm_mailer::{ErrorKind, MailError, Mailer, MessageError};
use kube::{Client, runtime::reflector::Store};
use tokio::sync::watch;

use crate::statuses::StatusCache;
use crate::{
    Config, Metrics,
    capi::{Cluster, Machine},
    events::Events,
    poller::{Poller, Timings},
    sendonce::decide::Withheld,
};

/// The field manager of every write to our objects, so `managedFields` (and whoever audits
/// them) can tell the provider's writes from others' (without it the API server records them
/// as "unknown").
pub const FIELD_MANAGER: &str = "cluster-api-provider-mailgun";

/// Patch parameters naming [`FIELD_MANAGER`].
pub fn patch_params() -> kube::api::PatchParams {
    kube::api::PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..kube::api::PatchParams::default()
    }
}

/// Why one reconcile failed (or waits); decides how soon it is retried.
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
    /// Another replica wrote the intent recently and may still be sending; wait it out.
    #[error(
        "another replica recorded the intent to send less than the lease hand-over window ago \
         and may still be sending; checking again in {0:?}"
    )]
    AwaitingHandover(Duration),
    /// A send was not started now (not leading, owner deleting, refused for good, backoff).
    #[error("mail withheld: {0:?}")]
    Withheld(Withheld),
    /// The object is gone: nothing more to do or write.
    #[error("the object is gone")]
    Gone,
}

impl ReconcileError {
    /// Permanent errors do not go away by retrying: they are not retried on a timer (the next
    /// change of the object reconciles it again; a refused mail waits for a provider restart).
    pub fn is_permanent(&self) -> bool {
        match self {
            Self::Mail(e) => e.kind() == ErrorKind::Permanent,
            Self::Message(_) | Self::InvalidSpec(_) => true,
            Self::Withheld(w) => *w == Withheld::PermanentlyRefused,
            Self::Kube { .. }
            | Self::Conflict(_)
            | Self::AwaitingLookup(_)
            | Self::AwaitingHandover(_)
            | Self::Gone => false,
        }
    }

    /// Waiting, not failing: no error metric, no backoff step, no reset of it either.
    pub fn is_wait(&self) -> bool {
        matches!(
            self,
            Self::AwaitingLookup(_) | Self::AwaitingHandover(_) | Self::Withheld(_) | Self::Gone
        )
    }

    /// The `result` label of `controller_runtime_reconcile_total`.
    pub fn metric_label(&self) -> &'static str {
        if self.is_wait() {
            "requeue_after"
        } else {
            "error"
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

    /// True for "the object does not exist" answers, which are normal during deletion and move.
    pub fn is_not_found(&self) -> bool {
        matches!(self, Self::Gone)
            || matches!(self, Self::Kube { source: kube::Error::Api(s), .. } if s.code == 404)
    }
}

/// What this process remembers about one mail of one object (never durable: only what makes
/// retries slower or lookups patient).
#[derive(Debug, Clone, Copy, Default)]
struct MailMemory {
    /// When this process first saw the mail's intent.
    first_seen: Option<Instant>,
    /// Since when lookups have answered "not found".
    not_found_since: Option<Instant>,
    /// The generation at which the backend refused this mail permanently.
    refused_at_generation: Option<i64>,
}

/// How long a deleted object's UID is remembered, so stale cached copies of it are ignored.
const TOMBSTONE_TTL: Duration = Duration::from_secs(600);

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
    /// The process's one delivery poller (its task is started by the runner).
    pub poller: Arc<Poller>,
    /// The statuses of the cached `MailgunCluster`s, packed ([`crate::statuses`]).
    pub(crate) cluster_statuses: StatusCache,
    /// The statuses of the cached `MailgunMachine`s, packed.
    pub(crate) machine_statuses: StatusCache,
    failures: Mutex<HashMap<String, (u32, Instant)>>,
    expected_versions: Mutex<HashMap<String, u64>>,
    mails: Mutex<HashMap<String, MailMemory>>,
    tombstones: Mutex<HashMap<String, Instant>>,
    /// True once the `Cluster` and `Machine` caches have finished their first list
    /// ([`Self::watch_owner_caches`]). A `watch` channel and not `Store::wait_until_ready` in
    /// each reconcile: kube-runtime's delayed init wakes only the last of several concurrent
    /// waiters, which would strand the others.
    owner_caches: watch::Sender<bool>,
}

/// The longest a reconcile waits for the owner caches' first list before judging owners anyway.
const OWNER_CACHES_WAIT: Duration = Duration::from_secs(30);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Ctx {
    /// Checked right before every write and every send: a replica that cannot prove it still
    /// leads (monotonic clock, see [`crate::Leadership::may_act`]) writes nothing at all. A
    /// reconcile frozen half-way (SIGSTOP, a long GC pause) checks again when it resumes.
    ///
    /// # Errors
    /// [`Withheld::NotLeading`].
    pub fn ensure_leading(&self) -> Result<(), ReconcileError> {
        if self.config.leadership.may_act() {
            Ok(())
        } else {
            Err(ReconcileError::Withheld(Withheld::NotLeading))
        }
    }

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
        let poller = Arc::new(Poller::new(
            mailer.clone(),
            config.leadership.clone(),
            Timings {
                base: config.delivery_poll_base,
                max: config.delivery_poll_max,
                retention: config.delivery_retention,
            },
        ));
        Self {
            client,
            mailer,
            poller,
            cluster_statuses: StatusCache::default(),
            machine_statuses: StatusCache::default(),
            events,
            config,
            metrics,
            clusters,
            machines,
            failures: Mutex::default(),
            expected_versions: Mutex::default(),
            mails: Mutex::default(),
            tombstones: Mutex::default(),
            owner_caches: watch::Sender::new(false),
        }
    }

    /// Marks the owner caches ready once both have finished their first list. Called once by
    /// the runner; a newly elected leader starts its caches at election, and until the first
    /// list completes a missing owner means "not listed yet", not "absent".
    pub fn watch_owner_caches(self: &Arc<Self>) {
        let ctx = Arc::clone(self);
        tokio::spawn(async move {
            let listed = async {
                ctx.clusters.wait_until_ready().await.is_ok()
                    && ctx.machines.wait_until_ready().await.is_ok()
            };
            // Past the bound, reconciles go on as before this wait existed (a missing owner is
            // rechecked, never acted on destructively), rather than each waiting the bound.
            if !matches!(
                tokio::time::timeout(OWNER_CACHES_WAIT, listed).await,
                Ok(true)
            ) {
                tracing::warn!(
                    "the Cluster API caches have not finished their first list after \
                     {OWNER_CACHES_WAIT:?}; owners are judged from what they hold so far"
                );
            }
            ctx.owner_caches.send_replace(true);
        });
    }

    /// Waits (at most [`OWNER_CACHES_WAIT`]) until the owner caches have been listed once, so
    /// no reconcile judges an owner missing from a cache that has not been filled yet: that
    /// judgement flapped `Ready` to `WaitingForOwner` and back on every leader change.
    pub async fn owner_caches_ready(&self) {
        let mut rx = self.owner_caches.subscribe();
        if tokio::time::timeout(OWNER_CACHES_WAIT, rx.wait_for(|ready| *ready))
            .await
            .is_err()
        {
            tracing::debug!("owner caches not listed after {OWNER_CACHES_WAIT:?}; going on");
        }
    }

    /// The delay before retrying `key` after `error`: exponential per object
    /// (`backoff_base` doubling up to `backoff_max`), never less than a backend's `Retry-After`.
    /// Waits return their own delay and leave the count alone. The delay also gates sends:
    /// a reconcile triggered earlier by a watch event does not send before it ran out
    /// ([`Self::backoff_left`]).
    pub fn retry_delay(&self, key: &str, error: &ReconcileError) -> Duration {
        let max = self.config.backoff_max;
        match error {
            ReconcileError::AwaitingLookup(wait)
            | ReconcileError::AwaitingHandover(wait)
            | ReconcileError::Withheld(Withheld::Backoff(wait)) => return *wait,
            ReconcileError::Withheld(Withheld::NotLeading) => return self.config.backoff_base,
            ReconcileError::Conflict(_) => return self.config.backoff_base.min(max),
            _ => {}
        }
        let mut map = lock(&self.failures);
        let entry = map.entry(key.to_owned()).or_insert((0, Instant::now()));
        entry.0 = entry.0.saturating_add(1);
        let exponential = self
            .config
            .backoff_base
            .saturating_mul(1u32 << (entry.0 - 1).min(20))
            .min(max);
        let delay = match error {
            ReconcileError::Mail(e) => exponential.max(e.retry_after().unwrap_or_default()),
            _ => exponential,
        };
        entry.1 = Instant::now() + delay;
        delay
    }

    /// How long sends for `key` must still wait after its last failure (zero: none).
    pub fn backoff_left(&self, key: &str) -> Duration {
        lock(&self.failures)
            .get(key)
            .map_or(Duration::ZERO, |(_, not_before)| {
                not_before.saturating_duration_since(Instant::now())
            })
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

    /// True when the cached copy predates our own last write, or the object is known gone.
    pub fn is_stale(&self, uid: &str, resource_version: Option<&str>) -> bool {
        if lock(&self.tombstones).contains_key(uid) {
            return true;
        }
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

    fn with_mail<T>(&self, mail_key: &str, f: impl FnOnce(&mut MailMemory) -> T) -> T {
        f(lock(&self.mails).entry(mail_key.to_owned()).or_default())
    }

    /// How long ago this process first saw the intent of `mail_key` (now, the first time).
    pub fn first_seen_ago(&self, mail_key: &str) -> Duration {
        self.with_mail(mail_key, |m| {
            m.first_seen.get_or_insert_with(Instant::now).elapsed()
        })
    }

    /// Since how long lookups answer "not found" for `mail_key`, if they do.
    pub fn not_found_for(&self, mail_key: &str) -> Option<Duration> {
        lock(&self.mails)
            .get(mail_key)
            .and_then(|m| m.not_found_since)
            .map(|at| at.elapsed())
    }

    /// A lookup answered "not found" for the first time.
    pub fn start_not_found(&self, mail_key: &str) {
        self.with_mail(mail_key, |m| m.not_found_since = Some(Instant::now()));
    }

    /// The backend refused `mail_key` permanently at `generation`.
    pub fn mark_permanently_refused(&self, mail_key: &str, generation: i64) {
        self.with_mail(mail_key, |m| m.refused_at_generation = Some(generation));
    }

    /// True when the backend refused `mail_key` permanently at this `generation`.
    pub fn permanently_refused(&self, mail_key: &str, generation: i64) -> bool {
        lock(&self.mails)
            .get(mail_key)
            .is_some_and(|m| m.refused_at_generation == Some(generation))
    }

    /// The mail went out or was found: forget the attempts.
    pub fn clear_mail(&self, mail_key: &str) {
        lock(&self.mails).remove(mail_key);
    }

    /// The object with this UID is gone (its finalizer removed, or the API server says so):
    /// every cached copy of it is stale from now on. Remembered for [`TOMBSTONE_TTL`].
    pub fn gone(&self, uid: &str) {
        lock(&self.expected_versions).remove(uid);
        self.poller.forget(uid);
        lock(&self.mails).retain(|k, _| !k.starts_with(uid));
        let mut tombstones = lock(&self.tombstones);
        let now = Instant::now();
        tombstones.retain(|_, at| now.duration_since(*at) < TOMBSTONE_TTL);
        tombstones.insert(uid.to_owned(), now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capm_mailer::MockMailer;

    fn ctx() -> Ctx {
        ctx_over(
            kube::runtime::reflector::store().0,
            kube::runtime::reflector::store().0,
        )
    }

    fn ctx_over(clusters: Store<Cluster>, machines: Store<Machine>) -> Ctx {
        let client =
            Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
        let events = Events::new(client.clone(), "t", "t");
        let config = Config {
            recipients: vec!["ops@example.com".into()],
            message_id_domain: "example.com".into(),
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
            leadership: crate::Leadership::default(),
        };
        let metrics = Metrics::register(&prometheus::Registry::new()).unwrap();
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

    /// Many reconciles wait at once (the applier runs up to `concurrency` of them); every one of
    /// them must be released when both caches finish their first list, and none before.
    #[tokio::test]
    async fn reconciles_wait_for_both_owner_caches_first_list_and_all_are_released() {
        use kube::runtime::watcher::Event;
        let (clusters, mut cluster_writer) = kube::runtime::reflector::store::<Cluster>();
        let (machines, mut machine_writer) = kube::runtime::reflector::store::<Machine>();
        let ctx = Arc::new(ctx_over(clusters, machines));
        ctx.watch_owner_caches();
        let waiters: Vec<_> = (0..16)
            .map(|_| {
                let ctx = Arc::clone(&ctx);
                tokio::spawn(async move { ctx.owner_caches_ready().await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            waiters.iter().all(|w| !w.is_finished()),
            "released before any list"
        );
        cluster_writer.apply_watcher_event(&Event::Init);
        cluster_writer.apply_watcher_event(&Event::InitDone);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            waiters.iter().all(|w| !w.is_finished()),
            "released before the Machine list"
        );
        machine_writer.apply_watcher_event(&Event::Init);
        machine_writer.apply_watcher_event(&Event::InitDone);
        for waiter in waiters {
            tokio::time::timeout(Duration::from_secs(5), waiter)
                .await
                .expect("a waiter was stranded")
                .unwrap();
        }
        // Later reconciles do not wait at all.
        tokio::time::timeout(Duration::from_millis(50), ctx.owner_caches_ready())
            .await
            .expect("waited after the caches were listed");
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
    async fn retry_after_is_honoured_waits_keep_their_delay_and_backoff_gates_sends() {
        let ctx = ctx();
        let limited = ReconcileError::Mail(MailError::Retryable {
            backend: "mock",
            message: "slow down".into(),
            code: Some(429),
            retry_after: Some(Duration::from_secs(7)),
            source: None,
        });
        assert_eq!(ctx.retry_delay("ns/c", &limited), Duration::from_secs(7));
        let left = ctx.backoff_left("ns/c");
        assert!(
            left > Duration::from_secs(6) && left <= Duration::from_secs(7),
            "{left:?}"
        );
        // A wait does not move the count or the gate.
        let wait = Duration::from_secs(3);
        assert_eq!(
            ctx.retry_delay("ns/c", &ReconcileError::AwaitingLookup(wait)),
            wait
        );
        assert_eq!(
            ctx.retry_delay("ns/c", &ReconcileError::Withheld(Withheld::Backoff(wait))),
            wait
        );
        assert_eq!(
            ctx.retry_delay("ns/c", &transient()),
            Duration::from_millis(200)
        );
        assert_eq!(
            ctx.retry_delay("ns/d", &ReconcileError::Conflict("x")),
            Duration::from_millis(100)
        );
        assert_eq!(ctx.backoff_left("ns/d"), Duration::ZERO);
        ctx.succeeded("ns/c");
        assert_eq!(ctx.backoff_left("ns/c"), Duration::ZERO);
    }

    #[tokio::test]
    async fn a_gone_object_stays_stale_whatever_copy_arrives() {
        let ctx = ctx();
        ctx.expect_version("u1", Some("120"));
        ctx.gone("u1");
        assert!(ctx.is_stale("u1", Some("100")));
        assert!(ctx.is_stale("u1", Some("121")));
        assert!(!ctx.is_stale("u2", Some("1")));
    }

    #[tokio::test]
    async fn permanent_refusals_are_remembered_per_generation() {
        let ctx = ctx();
        ctx.mark_permanently_refused("u/request", 3);
        assert!(ctx.permanently_refused("u/request", 3));
        assert!(!ctx.permanently_refused("u/request", 4));
        assert!(!ctx.permanently_refused("u/deletion", 3));
        ctx.gone("u");
        assert!(!ctx.permanently_refused("u/request", 3));
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
