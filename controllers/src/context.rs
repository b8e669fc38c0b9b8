//! What every reconcile shares: the clients, the owner caches, the leadership, the per-object
//! memory ([`crate::memory`]) and why a reconcile failed.

use std::{sync::Arc, time::Duration};

use capm_mailer::{ErrorKind, MailError, Mailer, MessageError};
use kube::{Client, Resource, ResourceExt, runtime::controller::Action};
use tokio::sync::watch;

use crate::{
    Config, Leadership, Metrics,
    capi::Owners,
    events::Events,
    kinds::InfraKind,
    memory::Memory,
    poller::{Poller, Timings},
    sendonce::decide::Withheld,
    workqueue,
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
    /// The object's mail identity cannot be used (missing, not allowed, invalid): no mail.
    /// Retried with backoff: creating or fixing the identity or its Secret makes it usable.
    #[error("{message}")]
    Identity {
        /// The condition reason (`IdentityNotFound`, `IdentityNotAllowed`, `IdentityInvalid`).
        reason: &'static str,
        /// What is wrong, naming the field or Secret (never a value).
        message: String,
    },
    /// The object is gone: nothing more to do or write.
    #[error("the object is gone")]
    Gone,
    /// The cached copy of the object did not read back (a bug); the next change replaces it.
    #[error("reading the cached object: {0}")]
    Cache(String),
}

impl From<crate::identity::IdentityError> for ReconcileError {
    fn from(e: crate::identity::IdentityError) -> Self {
        match e {
            crate::identity::IdentityError::Unusable { reason, message } => {
                Self::Identity { reason, message }
            }
            crate::identity::IdentityError::Kube { context, source } => {
                Self::Kube { context, source }
            }
        }
    }
}

impl ReconcileError {
    /// Permanent errors do not go away by retrying: they are not retried on a timer (the next
    /// change of the object reconciles it again; a refused mail waits for a provider restart).
    pub fn is_permanent(&self) -> bool {
        match self {
            Self::Mail(e) => e.kind() == ErrorKind::Permanent,
            Self::Message(_) | Self::InvalidSpec(_) | Self::Cache(_) => true,
            Self::Withheld(w) => *w == Withheld::PermanentlyRefused,
            Self::Kube { .. }
            | Self::Conflict(_)
            | Self::AwaitingLookup(_)
            | Self::AwaitingHandover(_)
            | Self::Identity { .. }
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

/// Everything a reconcile needs.
pub struct Ctx {
    /// API client.
    pub client: Client,
    /// The mail backend.
    pub mailer: Arc<dyn Mailer>,
    /// Event publisher.
    pub events: Events,
    /// The mail identities' backends (`spec.identityRef`).
    pub(crate) identities: crate::identity::Identities,
    /// Configuration.
    pub config: Config,
    /// Metrics.
    pub metrics: Metrics,
    /// The Cluster API caches.
    pub owners: Owners,
    /// This process's standing as leader, consulted right before every write and send; its
    /// identity is recorded with every mail intent.
    pub leadership: Leadership,
    /// The process's one delivery poller (its task is started by the runner).
    pub poller: Arc<Poller>,
    /// What this process remembers about each object, by UID.
    pub(crate) memory: Memory,
    /// True once the `Cluster` and `Machine` caches have finished their first list
    /// ([`Self::watch_owner_caches`]). A `watch` channel and not `Store::wait_until_ready` in
    /// each reconcile: kube-runtime's delayed init wakes only the last of several concurrent
    /// waiters, which would strand the others.
    owner_caches: watch::Sender<bool>,
}

/// The longest a reconcile waits for the owner caches' first list before judging owners anyway.
const OWNER_CACHES_WAIT: Duration = Duration::from_secs(30);

impl Ctx {
    /// Checked right before every write and every send: a replica that cannot prove it still
    /// leads (monotonic clock, see [`crate::Leadership::may_act`]) writes nothing at all. A
    /// reconcile frozen half-way (SIGSTOP, a long GC pause) checks again when it resumes.
    ///
    /// # Errors
    /// [`Withheld::NotLeading`].
    pub fn ensure_leading(&self) -> Result<(), ReconcileError> {
        if self.leadership.may_act() {
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
        leadership: Leadership,
        metrics: Metrics,
        owners: Owners,
    ) -> Self {
        let poller = Arc::new(Poller::new(
            mailer.clone(),
            leadership.clone(),
            Timings {
                base: config.delivery_poll_base,
                max: config.delivery_poll_max,
                retention: config.delivery_retention,
            },
        ));
        let identities = crate::identity::Identities::new(
            client.clone(),
            config.identity_secret_namespace.clone(),
            Arc::new(leadership.clone()),
            crate::identity::Route {
                mailer: mailer.clone(),
                from: config.mail_from.clone(),
                recipients: config.recipients.clone(),
                identity: None,
                poller: poller.clone(),
            },
        );
        Self {
            client,
            mailer,
            identities,
            poller,
            leadership,
            memory: Memory::counted(metrics.remembered.clone()),
            events,
            config,
            metrics,
            owners,
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
                ctx.owners.clusters.wait_until_ready().await;
                ctx.owners.machines.wait_until_ready().await;
                true
            };
            // Past the bound, reconciles go on as before this wait existed (a missing owner is
            // rechecked, never acted on destructively), rather than each waiting the bound.
            if !matches!(
                tokio::time::timeout(OWNER_CACHES_WAIT, listed).await,
                Ok(true)
            ) {
                tracing::warn!(
                    "The Cluster API caches have not finished their first list after \
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
            tracing::debug!("Owner caches not listed after {OWNER_CACHES_WAIT:?}; going on");
        }
    }

    /// `Action::requeue(delay)` for `obj`, recorded for the `workqueue_*` series (kube's
    /// `Action` does not tell its delay afterwards). Every requeue goes through here.
    pub fn requeue<K: InfraKind>(&self, obj: &impl Resource, delay: Duration) -> Action {
        self.metrics.workqueue.requeue(
            K::CONTROLLER,
            &workqueue::key(obj.namespace().as_deref(), &obj.name_any()),
            delay,
        );
        Action::requeue(delay)
    }

    /// The delay before retrying the object `uid` after `error`: exponential per object
    /// (`backoff_base` doubling up to `backoff_max`), never less than a backend's `Retry-After`.
    /// Waits return their own delay and leave the count alone. After a mail backend's failure
    /// the delay also gates sends: a reconcile triggered earlier by a watch event does not send
    /// before it ran out ([`Memory::backoff_left`]).
    pub fn retry_delay(&self, uid: &str, error: &ReconcileError) -> Duration {
        let (base, max) = (self.config.backoff_base, self.config.backoff_max);
        match error {
            ReconcileError::AwaitingLookup(wait)
            | ReconcileError::AwaitingHandover(wait)
            | ReconcileError::Withheld(Withheld::Backoff(wait)) => return *wait,
            ReconcileError::Withheld(Withheld::NotLeading) => return base,
            ReconcileError::Conflict(_) => return base.min(max),
            _ => {}
        }
        // Only a mail backend's failure holds back the next send: after the API server failed
        // (a partition, a restart) the next trigger may send at once, or a cut of a minute
        // would delay every mail by the backoff it built up.
        let gate_sends = matches!(error, ReconcileError::Mail(_));
        self.memory.failed(uid, gate_sends, |failures| {
            let exponential = base
                .saturating_mul(1u32 << (failures.max(1) - 1).min(20))
                .min(max);
            match error {
                ReconcileError::Mail(e) => exponential.max(e.retry_after().unwrap_or_default()),
                _ => exponential,
            }
        })
    }

    /// The object with this UID is gone (its finalizer removed, the watch or a list says so):
    /// everything remembered about it is forgotten, in one place, and every cached copy of it
    /// is stale from now on.
    pub fn forget(&self, uid: &str) {
        self.memory.forget(uid);
        self.poller.forget(uid);
        self.identities.forget(uid);
        self.events.forget(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capm_mailer::MockMailer;

    fn ctx() -> Ctx {
        ctx_over(
            crate::compact::OwnerCache::new(""),
            crate::compact::OwnerCache::new(""),
        )
    }

    use crate::capi::{Cluster, Machine};

    fn ctx_over(
        clusters: crate::compact::OwnerCache<Cluster>,
        machines: crate::compact::OwnerCache<Machine>,
    ) -> Ctx {
        let client =
            Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
        let events = Events::new(client.clone(), "t", "t");
        let config = crate::config::for_tests("example.com");
        let metrics = Metrics::register(&prometheus::Registry::new()).unwrap();
        Ctx::new(
            client,
            Arc::new(MockMailer::new()),
            events,
            config,
            Leadership::unelected("t"),
            metrics,
            Owners { clusters, machines },
        )
    }

    /// Many reconciles wait at once (the applier runs up to `concurrency` of them); every one of
    /// them must be released when both caches finish their first list, and none before.
    #[tokio::test]
    async fn reconciles_wait_for_both_owner_caches_first_list_and_all_are_released() {
        use kube::runtime::watcher::Event;
        let clusters = crate::compact::OwnerCache::<Cluster>::new("");
        let cluster_writer = clusters.clone();
        let machines = crate::compact::OwnerCache::<Machine>::new("");
        let machine_writer = machines.clone();
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
        cluster_writer.apply(&Event::Init);
        cluster_writer.apply(&Event::InitDone);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(
            waiters.iter().all(|w| !w.is_finished()),
            "released before the Machine list"
        );
        machine_writer.apply(&Event::Init);
        machine_writer.apply(&Event::InitDone);
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
            .map(|_| ctx.retry_delay("a", &transient()))
            .collect();
        assert_eq!(delays[0], Duration::from_millis(100));
        assert_eq!(delays[1], Duration::from_millis(200));
        assert_eq!(delays[3], Duration::from_millis(800));
        assert_eq!(delays[9], Duration::from_secs(10));
        // Another object has its own count.
        assert_eq!(
            ctx.retry_delay("b", &transient()),
            Duration::from_millis(100)
        );
        ctx.memory.succeeded("a");
        assert_eq!(
            ctx.retry_delay("a", &transient()),
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
        assert_eq!(ctx.retry_delay("c", &limited), Duration::from_secs(7));
        let left = ctx.memory.backoff_left("c");
        assert!(
            left > Duration::from_secs(6) && left <= Duration::from_secs(7),
            "{left:?}"
        );
        // A wait does not move the count or the gate.
        let wait = Duration::from_secs(3);
        assert_eq!(
            ctx.retry_delay("c", &ReconcileError::AwaitingLookup(wait)),
            wait
        );
        assert_eq!(
            ctx.retry_delay("c", &ReconcileError::Withheld(Withheld::Backoff(wait))),
            wait
        );
        assert_eq!(
            ctx.retry_delay("c", &transient()),
            Duration::from_millis(200)
        );
        assert_eq!(
            ctx.retry_delay("d", &ReconcileError::Conflict("x")),
            Duration::from_millis(100)
        );
        assert_eq!(ctx.memory.backoff_left("d"), Duration::ZERO);
        ctx.memory.succeeded("c");
        assert_eq!(ctx.memory.backoff_left("c"), Duration::ZERO);
    }

    #[tokio::test]
    async fn an_api_server_failure_backs_off_the_retry_but_not_the_next_send() {
        let ctx = ctx();
        let cut_off = ReconcileError::Kube {
            context: "writing status",
            source: kube::Error::Api(Box::new(
                kube::core::Status::failure("unavailable", "ServiceUnavailable").with_code(503),
            )),
        };
        assert_eq!(ctx.retry_delay("p", &cut_off), Duration::from_millis(100));
        assert_eq!(ctx.retry_delay("p", &cut_off), Duration::from_millis(200));
        assert_eq!(ctx.memory.backoff_left("p"), Duration::ZERO);
        ctx.retry_delay("p", &transient());
        assert!(ctx.memory.backoff_left("p") > Duration::ZERO);
    }

    #[tokio::test]
    async fn forgetting_an_object_clears_its_backoff_and_its_delivery_tracking() {
        let ctx = ctx();
        ctx.retry_delay("u", &transient());
        assert!(ctx.memory.backoff_left("u") > Duration::ZERO);
        ctx.forget("u");
        assert_eq!(ctx.memory.backoff_left("u"), Duration::ZERO);
        assert_eq!(ctx.memory.len(), 0);
        assert!(ctx.memory.is_stale("u", Some("1")));
    }
}
