//! What every reconcile shares: the clients, the Cluster API stores, the leadership, what the
//! process notes per object ([`crate::ledger`]) and why a reconcile failed.

use std::{sync::Arc, time::Duration};

use capm_mailer::{ErrorKind, MailError, Mailer, MessageError};
use kube::{
    Api, Client, ResourceExt,
    api::{Patch, PatchParams},
};
use tokio::sync::watch;

use crate::{
    Config, Leadership, Metrics,
    events::{EventType, Events},
    identity::IdentityError,
    kinds::{Mailed, Stores},
    ledger::Ledger,
    poller::{Poller, Timings, WakeSenders},
    sendonce::decide::Withheld,
};

/// The field manager of every write to our objects, so `managedFields` (and whoever audits
/// them) can tell the provider's writes from others' (not "unknown").
pub const FIELD_MANAGER: &str = "cluster-api-provider-mailgun";

/// Why one reconcile failed (or waits); decides how soon it is retried.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("{context}: {source}")]
    Kube {
        context: &'static str,
        #[source]
        source: kube::Error,
    },
    /// A write lost an optimistic-concurrency race (HTTP 409); retried soon with fresh data.
    #[error("{0}: the object changed meanwhile (conflict); retrying with its new version")]
    Conflict(&'static str),
    #[error("mail backend: {0}")]
    Mail(#[source] MailError),
    /// The mail could not be built from the object (a value the schema should have refused).
    #[error("building the mail: {0}")]
    Message(#[source] MessageError),
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
    /// The object's mail identity cannot be used (missing, not allowed, invalid: no mail), or
    /// could not be read. Retried with backoff: creating or fixing the identity or its Secret
    /// makes it usable.
    #[error(transparent)]
    Identity(#[from] IdentityError),
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
            | Self::Identity(_)
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

    /// The API server's error while `context`: a lost race (409) is a [`Self::Conflict`].
    pub(crate) fn kube(context: &'static str) -> impl FnOnce(kube::Error) -> Self {
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
    pub client: Client,
    /// The provider's own mail backend; an identity's is in [`Self::identities`].
    pub mailer: Arc<dyn Mailer>,
    pub events: Events,
    /// The mail identities' backends (`spec.identityRef`).
    pub(crate) identities: crate::identity::Identities,
    pub config: Config,
    pub metrics: Metrics,
    pub capi: Stores,
    /// This process's standing as leader, consulted right before every write and send; its
    /// identity is recorded with every mail intent.
    pub leadership: Leadership,
    /// The process's one delivery poller (its task is started by the runner).
    pub poller: Arc<Poller>,
    /// What the process notes about each object, by UID, and the tombstones of gone ones.
    pub(crate) ledger: Ledger,
    /// True once the shared stores have finished their first list. A `watch` channel, not
    /// `Store::wait_until_ready` per reconcile: kube-runtime's wakes only the last of several
    /// concurrent waiters (report 5 in docs/kube-runtime-recorder.md).
    capi_listed: watch::Sender<bool>,
}

/// The longest a reconcile waits for the shared stores' first list.
const CAPI_LIST_WAIT: Duration = Duration::from_secs(30);

impl Ctx {
    /// Checked right before every write and every send: a replica that cannot prove it still
    /// leads (monotonic clock, see [`crate::Leadership::may_act`]) writes nothing at all. A
    /// reconcile frozen half-way (SIGSTOP, a long GC pause) checks again when it resumes.
    pub fn ensure_leading(&self) -> Result<(), ReconcileError> {
        if self.leadership.may_act() {
            Ok(())
        } else {
            Err(ReconcileError::Withheld(Withheld::NotLeading))
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub fn new(
        client: Client,
        mailer: Arc<dyn Mailer>,
        events: Events,
        config: Config,
        leadership: Leadership,
        metrics: Metrics,
        capi: Stores,
        wakes: WakeSenders,
    ) -> Self {
        let poller = Arc::new(Poller::new(
            mailer.clone(),
            leadership.clone(),
            Timings {
                base: config.delivery_poll_base,
                max: config.delivery_poll_max,
                retention: config.delivery_retention,
            },
            wakes,
        ));
        let identities = crate::identity::Identities::new(
            client.clone(),
            capi.clone(),
            &config,
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
            ledger: Ledger::new(metrics.remembered.clone(), events.clone()),
            events,
            config,
            metrics,
            capi,
            capi_listed: watch::Sender::new(false),
        }
    }

    /// Marks the shared stores listed once each has finished its first list (called once, by the
    /// runner): until then a missing owner or identity means "not listed yet", not "absent".
    pub fn wait_for_capi_lists(self: &Arc<Self>) {
        let ctx = Arc::clone(self);
        tokio::spawn(async move {
            // An error: a store's writer is gone (shutting down). No Secret store without a
            // namespace for it.
            let secrets = ctx.config.identity_secret_namespace.is_some();
            let listed = async {
                ctx.capi.clusters.wait_until_ready().await.is_ok()
                    && ctx.capi.machines.wait_until_ready().await.is_ok()
                    && ctx.capi.identities.wait_until_ready().await.is_ok()
                    && (!secrets || ctx.capi.secrets.wait_until_ready().await.is_ok())
            };
            // Past the bound, reconciles judge owners from what the stores hold (a missing owner
            // is rechecked, never acted on destructively; an identity lookup fails until its
            // store is listed), rather than each waiting the bound.
            if !matches!(tokio::time::timeout(CAPI_LIST_WAIT, listed).await, Ok(true)) {
                tracing::warn!(
                    "The shared caches (Cluster API's objects, the identities) have not finished \
                     their first list after {CAPI_LIST_WAIT:?}; owners are judged from what they \
                     hold so far"
                );
            }
            ctx.capi_listed.send_replace(true);
        });
    }

    /// Waits (at most [`CAPI_LIST_WAIT`]) until the shared stores have been listed once, so no
    /// reconcile judges an owner missing from a store not filled yet (a new leader would flap
    /// `Ready` to `WaitingForOwner` and back).
    pub async fn capi_listed(&self) {
        let mut rx = self.capi_listed.subscribe();
        let listed = tokio::time::timeout(CAPI_LIST_WAIT, rx.wait_for(|ready| *ready));
        if listed.await.is_err() {
            tracing::debug!("Shared stores not listed after {CAPI_LIST_WAIT:?}; going on");
        }
    }

    /// Merge-patches our object `obj` with `body`, `{"metadata": …}` or `{"status": …}` (then
    /// its status subresource), as [`FIELD_MANAGER`] and only while leading
    /// ([`Self::ensure_leading`]); the version written is remembered, so that a reconcile that
    /// starts from an older cached copy waits for the cache ([`Ledger::expect_version`]).
    pub(crate) async fn patch<K: Mailed>(
        &self,
        obj: &K,
        body: serde_json::Value,
        what: &'static str,
    ) -> Result<K, ReconcileError> {
        self.ensure_leading()?;
        let api: Api<K> =
            Api::namespaced(self.client.clone(), &obj.namespace().unwrap_or_default());
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        let (name, patch) = (obj.name_any(), Patch::Merge(&body));
        let written = if body.get("status").is_some() {
            api.patch_status(&name, &params, &patch).await
        } else {
            api.patch(&name, &params, &patch).await
        };
        let written = written.map_err(ReconcileError::kube(what))?;
        let uid = obj.uid().unwrap_or_default();
        (self.ledger).expect_version(&uid, written.resource_version().as_deref());
        Ok(written)
    }

    /// Publishes an Event about `obj` (its series open until its mail is final); a refusal is
    /// logged, never fails the reconcile.
    pub async fn publish<K: Mailed>(
        &self,
        obj: &K,
        type_: EventType,
        reason: &'static str,
        note: String,
    ) {
        let regarding = obj.object_ref(&());
        // The Recorder first: if every series ends between the two, this Event goes to the
        // Recorder dropped, not into the fresh one where nothing would end it.
        let recorder = self.events.recorder();
        let series = self
            .ledger
            .in_series(regarding.uid.as_deref().unwrap_or_default());
        let recorder = series.then_some(recorder);
        let published = self
            .events
            .publish_in(recorder, &regarding, type_, reason, &note);
        if let Err(e) = published.await {
            tracing::warn!(error = %e, "Could not record an event");
        }
    }

    /// A trigger for the object `uid` entered `K`'s queue: an add unless it already waits.
    pub fn queued<K: Mailed>(&self, uid: &str) {
        if self.ledger.queue(uid, K::CONTROLLER) {
            self.metrics.added(K::CONTROLLER);
        }
    }

    /// The delay before retrying the object `uid` after `error`: exponential per object
    /// (`backoff_base` doubling up to `backoff_max`), never less than a backend's `Retry-After`.
    /// Waits return their own delay and leave the count alone. After a mail backend's failure
    /// the delay also gates sends: a reconcile triggered earlier by a watch event does not send
    /// before it ran out ([`Ledger::backoff_left`]).
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
        self.ledger.failed(uid, gate_sends, |failures| {
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
    /// everything noted about it is forgotten, in one place.
    pub fn forget(&self, uid: &str) {
        if let Some(controller) = self.ledger.forget(uid) {
            self.metrics.left(controller);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capm_mailer::MockMailer;

    fn ctx() -> Ctx {
        ctx_over(reflector::store().0, reflector::store().0)
    }

    use capm_api::capi::{Cluster, Machine};
    use kube::runtime::reflector::{self, Store};

    fn ctx_over(clusters: Store<Cluster>, machines: Store<Machine>) -> Ctx {
        let client =
            Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
        let events = Events::new(client.clone(), "t", "t");
        let config = crate::config::tests::for_tests("example.com");
        let metrics = Metrics::register(&prometheus::Registry::new()).unwrap();
        Ctx::new(
            client,
            Arc::new(MockMailer::new()),
            events,
            config,
            Leadership::unelected("t"),
            metrics,
            crate::kinds::tests::stores(clusters, machines),
            crate::poller::tests::wakes().0,
        )
    }

    /// Many reconciles wait at once (the applier runs up to `concurrency` of them); every one of
    /// them must be released when both caches finish their first list, and none before.
    #[tokio::test]
    async fn reconciles_wait_for_both_capi_stores_first_list_and_all_are_released() {
        use kube::runtime::watcher::Event;
        let (clusters, mut cluster_writer) = reflector::store::<Cluster>();
        let (machines, mut machine_writer) = reflector::store::<Machine>();
        let ctx = Arc::new(ctx_over(clusters, machines));
        ctx.wait_for_capi_lists();
        let waiters: Vec<_> = (0..16)
            .map(|_| {
                let ctx = Arc::clone(&ctx);
                tokio::spawn(async move { ctx.capi_listed().await })
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
        tokio::time::timeout(Duration::from_millis(50), ctx.capi_listed())
            .await
            .expect("waited after the caches were listed");
    }

    /// Pins the kube-runtime shortfall the `capi_listed` channel exists for (report 5 in
    /// docs/kube-runtime-recorder.md): of several tasks awaiting one store's
    /// `wait_until_ready`, the list's end wakes only the one that polled last. When this fails,
    /// kube-runtime wakes them all and `capi_listed` can go.
    #[tokio::test]
    async fn kube_runtime_wait_until_ready_wakes_only_the_last_concurrent_waiter() {
        use kube::runtime::watcher::Event;
        let (store, mut writer) = reflector::store::<Cluster>();
        let first = tokio::spawn({
            let store = store.clone();
            async move { store.wait_until_ready().await }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        let last = tokio::spawn(async move { store.wait_until_ready().await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        writer.apply_watcher_event(&Event::Init);
        writer.apply_watcher_event(&Event::InitDone);
        tokio::time::timeout(Duration::from_secs(5), last)
            .await
            .expect("the last waiter is woken")
            .unwrap()
            .unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !first.is_finished(),
            "kube-runtime now wakes every waiter: the capi_listed channel can go"
        );
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
        ctx.ledger.succeeded("a");
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
        let left = ctx.ledger.backoff_left("c");
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
        assert_eq!(ctx.ledger.backoff_left("d"), Duration::ZERO);
        ctx.ledger.succeeded("c");
        assert_eq!(ctx.ledger.backoff_left("c"), Duration::ZERO);
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
        assert_eq!(ctx.ledger.backoff_left("p"), Duration::ZERO);
        ctx.retry_delay("p", &transient());
        assert!(ctx.ledger.backoff_left("p") > Duration::ZERO);
    }

    /// Every note of an object (backoff, last version, mail notes, queue wait, Event series,
    /// its poller's registration, an identity's poller included) goes with one `forget`, and
    /// what a reconcile still in flight notes after it is dropped.
    #[tokio::test]
    async fn forgetting_an_object_leaves_no_note_of_it_anywhere() {
        use crate::{ledger::Attempt, poller::tests as poller, sendonce::Which};
        use capm_api::v1beta1::MailgunCluster;
        let ctx = ctx();
        let depth = || {
            ctx.metrics
                .queue_depth
                .with_label_values(&[MailgunCluster::CONTROLLER])
                .get()
        };
        let (uid, cluster) = ("u", poller::cluster("u"));
        let track = |p: &Arc<Poller>| {
            let now = std::time::SystemTime::now();
            ctx.ledger.track(uid, p)
                && p.track(&cluster, uid, poller::id(1), now, Duration::ZERO)
                    .is_none()
        };
        ctx.retry_delay(uid, &transient());
        ctx.ledger.expect_version(uid, Some("7"));
        let at = Attempt {
            generation: 1,
            retry: 0,
        };
        ctx.ledger.mark_permanently_refused(uid, Which::Request, at);
        ctx.ledger.first_seen_ago(uid, Which::Deletion);
        ctx.queued::<MailgunCluster>(uid);
        assert_eq!(depth(), 1);
        ctx.ledger.in_series(uid);
        let identity = ctx.poller.sibling(Arc::new(MockMailer::new()));
        assert!(track(&ctx.poller) && track(&identity));
        assert!(!ctx.poller.holds(uid), "moved to the identity's poller");
        assert!(identity.holds(uid));
        assert_eq!(ctx.ledger.len(), 1);

        ctx.forget(uid);
        assert_eq!(ctx.ledger.len(), 0);
        assert!(!identity.holds(uid) && !ctx.poller.holds(uid));
        assert_eq!(depth(), 0);
        assert_eq!(ctx.ledger.backoff_left(uid), Duration::ZERO);
        assert!(
            ctx.ledger.is_stale(uid, Some("8")),
            "a copy of a gone object is stale"
        );

        ctx.retry_delay(uid, &transient());
        ctx.queued::<MailgunCluster>(uid);
        ctx.ledger.in_series(uid);
        assert!(!ctx.ledger.track(uid, &identity));
        assert_eq!(ctx.ledger.len(), 0);
        assert_eq!(depth(), 0);
    }

    #[tokio::test]
    async fn a_final_mail_leaves_its_poller_and_ends_its_event_series() {
        let ctx = ctx();
        let cluster = crate::poller::tests::cluster("f");
        let now = std::time::SystemTime::now();
        assert!(ctx.ledger.track("f", &ctx.poller));
        let id = crate::poller::tests::id(2);
        ctx.poller.track(&cluster, "f", id, now, Duration::ZERO);
        ctx.ledger.in_series("f");
        ctx.ledger.mail_final("f");
        assert!(!ctx.poller.holds("f"));
        assert_eq!(ctx.ledger.len(), 0, "nothing else was noted");
    }

    /// The one `Recorder`'s series end once no object has one open: when the last object's
    /// mail is final or it is gone, not before.
    #[tokio::test]
    async fn series_end_when_no_object_is_worked_on() {
        use crate::poller::tests::cluster;
        let (client, log) = crate::events::tests::answering_client();
        let mut ctx = ctx();
        ctx.events = Events::new(client, "t", "t");
        ctx.ledger = Ledger::new(ctx.metrics.remembered.clone(), ctx.events.clone());
        let (a, b) = (cluster("a"), cluster("b"));
        let posts = || log.lock().unwrap().iter().filter(|m| *m == "POST").count();
        for obj in [&a, &b, &a] {
            ctx.publish(obj, EventType::Normal, "R", "n".into()).await;
        }
        assert_eq!(posts(), 2, "a's repeat is a series");
        ctx.ledger.mail_final("a");
        ctx.publish(&a, EventType::Normal, "R", "n".into()).await;
        assert_eq!(posts(), 2, "b is still worked on: a's series goes on");
        ctx.ledger.mail_final("a");
        ctx.forget("b");
        ctx.publish(&a, EventType::Normal, "R", "n".into()).await;
        assert_eq!(posts(), 3, "nobody worked on: the series ended");
    }
}
