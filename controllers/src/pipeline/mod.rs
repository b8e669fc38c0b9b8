//! The watch/cache pipeline: one per kind, the same for both.
//!
//! For each of our kinds: watch (quick reconnects, [`watch_backoff`]) of slim projections
//! ([`trim`]), packed ([`packed`]) →
//! reflector store (one snapshot per object) → [`lists::AfterLists`] (a list's objects are
//! reconciled once the store holds the list) → kube-runtime's `Controller`, which also takes the
//! reconciles the Cluster API objects ask for ([`Pipelined::owner_triggers`]), the delivery
//! poller's wake-ups and the sync period's ([`resync`]). What a list asks for (of our objects or
//! of the Cluster API objects) waits in the [`paced::Pacer`] and enters the controller a window
//! at a time. The Cluster API caches ([`crate::compact::OwnerCache`]) are shared by both kinds
//! and listed before any reconcile judges an owner ([`OwnerCaches`]).

mod lists;
mod paced;
pub mod packed;
mod resync;
pub mod trim;

use std::{collections::HashSet, future::Future, sync::Arc, time::Duration};

use capm_api::{
    names,
    v1beta1::{MailgunCluster, MailgunMachine},
};
use capm_mailer::Mailer;
use futures::{FutureExt, StreamExt, TryStreamExt, future, stream::BoxStream};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::ListParams,
    runtime::{
        Controller, WatchStreamExt,
        controller::{self, Action},
        reflector::{self, ObjectRef, Store},
        utils::{Backoff, ResetTimerBackoff},
        watcher::{self, ExponentialBackoff},
    },
};
use tracing::{debug, info, warn};

use self::packed::Packed;
use crate::{
    Config, Error, Leadership, Metrics,
    capi::{Cluster, ContractRef, Machine, Owners},
    compact::{Key, OwnerCache},
    context::{Ctx, ReconcileError},
    events::Events,
    kinds::InfraKind,
    reconcile::reconcile,
    workqueue::{self, Workqueue},
};

/// Page size of lists: small pages keep the peak memory of a large list low.
const PAGE_SIZE: u32 = 50;

/// How a watch that failed tries again: from a quarter second, doubling to two seconds (plus up
/// to as much jitter), so that watches are back within a few seconds of the API server
/// answering again. kube-runtime's default climbs to 30 s, which after a partition of a minute
/// left new objects unmailed for half a minute more. Four watches at one request per two
/// seconds at most are no load for an API server that is coming back.
fn watch_backoff() -> impl Backoff {
    let exponential = backon::ExponentialBuilder::default()
        .with_min_delay(Duration::from_millis(250))
        .with_max_delay(Duration::from_secs(2))
        .with_factor(2.0)
        .with_jitter()
        .without_max_times();
    ResetTimerBackoff::new(
        ExponentialBackoff::from(exponential),
        Duration::from_secs(60),
    )
}

fn scoped<K>(client: &Client, config: &Config) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match &config.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// The watch of the objects in scope of `R`'s kind, each read as an `R`, reconnecting with
/// [`watch_backoff`].
fn watch_as<R>(
    client: &Client,
    config: &Config,
    wc: watcher::Config,
) -> impl futures::Stream<Item = Result<watcher::Event<R>, watcher::Error>> + Send + use<R>
where
    R: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    R: Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    watcher::watcher(scoped::<R>(client, config), wc).backoff(watch_backoff())
}

/// The watch of `K`'s objects in scope, read as [`trim::Slim`] projections and handed on as
/// `K`s, reconnecting with [`watch_backoff`].
fn watch<K>(
    client: &Client,
    config: &Config,
    wc: watcher::Config,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + use<K>
where
    K: trim::Projected + Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    watch_as::<trim::Slim<K>>(client, config, wc).map_ok(|event| match event {
        watcher::Event::Apply(obj) => watcher::Event::Apply(obj.0),
        watcher::Event::Delete(obj) => watcher::Event::Delete(obj.0),
        watcher::Event::Init => watcher::Event::Init,
        watcher::Event::InitApply(obj) => watcher::Event::InitApply(obj.0),
        watcher::Event::InitDone => watcher::Event::InitDone,
    })
}

/// The Cluster API caches, shared by both kinds: their writers until [`Self::drive`] runs them,
/// and the subscribers each change is fanned out to.
///
/// Not kube-runtime's shared reflector (`reflect_shared` + `subscribe`): its subscriber stream
/// looks each dispatched reference up in the store and, when the object is gone by then (deleted
/// right after it changed, a common thing here), answers `Pending` without asking to be woken
/// again (kube-runtime 5.0.0, `ReflectHandle::poll_next`). That subscriber then never yields
/// again: a controller stopped hearing of Clusters for good, and an unpaused Cluster never had its
/// request mailed (the partition test found it). Here the changed objects themselves are sent,
/// and after a list the keys of every object ([`Heard`]).
struct OwnerCaches {
    owners: Owners,
    cluster_subscribers: Subscribers<Cluster>,
    machine_subscribers: Subscribers<Machine>,
}

/// What a cache's change brings a subscriber.
enum Heard<K> {
    /// One object changed (an `Apply`).
    Changed(Arc<K>),
    /// A list is complete: the keys of every object it holds, read back from the cache one at a
    /// time as the subscriber gets to them, their reconciles paced ([`paced`]).
    Listed(Arc<[Key]>),
}

impl<K> Clone for Heard<K> {
    fn clone(&self) -> Self {
        match self {
            Self::Changed(obj) => Self::Changed(Arc::clone(obj)),
            Self::Listed(keys) => Self::Listed(Arc::clone(keys)),
        }
    }
}

/// Where one cache's changes go: one channel per subscriber.
type Subscribers<K> = Arc<std::sync::Mutex<Vec<futures::channel::mpsc::UnboundedSender<Heard<K>>>>>;

/// A new subscriber of `subscribers`.
fn subscribe<K: Send + Sync + 'static>(
    subscribers: &Subscribers<K>,
) -> BoxStream<'static, Heard<K>> {
    let (tx, rx) = futures::channel::mpsc::unbounded();
    subscribers
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(tx);
    rx.boxed()
}

/// Applies `event` to `cache` and sends what it changed to every subscriber: the object of an
/// `Apply`, the keys of every object after a list (`InitDone`); nothing for a deletion.
fn apply_and_fan_out<K>(
    event: &watcher::Event<K>,
    cache: &OwnerCache<K>,
    subscribers: &Subscribers<K>,
) where
    K: Resource<DynamicType = ()> + Clone + serde::Serialize + serde::de::DeserializeOwned,
    K: Send + Sync + 'static,
{
    cache.apply(event);
    let heard = match event {
        watcher::Event::Apply(obj) => Heard::Changed(Arc::new(obj.clone())),
        watcher::Event::InitDone => Heard::Listed(cache.keys().into()),
        _ => return,
    };
    let mut subscribers = subscribers.lock().unwrap_or_else(|e| e.into_inner());
    // A subscriber gone (its controller stopped) is dropped.
    subscribers.retain(|tx| tx.unbounded_send(heard.clone()).is_ok());
}

/// The reconciles `heard` asks for, by `target` (an object's infrastructure): the changed
/// object's, or each listed object's, read back from `cache` one at a time.
fn targets<K, T>(
    cache: OwnerCache<K>,
    heard: Heard<K>,
    target: impl Fn(&K) -> Option<T> + Send + 'static,
) -> impl futures::Stream<Item = (T, bool)> + Send + 'static
where
    K: Resource<DynamicType = ()> + serde::Serialize + serde::de::DeserializeOwned,
    K: Send + Sync + 'static,
    T: Send + 'static,
{
    let each: Box<dyn Iterator<Item = (T, bool)> + Send> = match heard {
        Heard::Changed(obj) => Box::new(target(&obj).map(|t| (t, false)).into_iter()),
        Heard::Listed(keys) => Box::new(
            (0..keys.len())
                .filter_map(move |i| cache.get_key(&keys[i]))
                .filter_map(move |obj| target(&obj))
                .map(|t| (t, true)),
        ),
    };
    futures::stream::iter(each)
}

impl OwnerCaches {
    fn new() -> Self {
        let owners = Owners {
            clusters: OwnerCache::new(<Cluster as trim::Projected>::DICTIONARY),
            machines: OwnerCache::new(<Machine as trim::Projected>::DICTIONARY),
        };
        Self {
            owners,
            cluster_subscribers: Subscribers::default(),
            machine_subscribers: Subscribers::default(),
        }
    }

    /// The `Cluster`s as they change, and all of them after each list.
    fn clusters(&self) -> Result<BoxStream<'static, Heard<Cluster>>, Error> {
        Ok(subscribe(&self.cluster_subscribers))
    }

    /// The `Machine`s, as [`Self::clusters`].
    fn machines(&self) -> Result<BoxStream<'static, Heard<Machine>>, Error> {
        Ok(subscribe(&self.machine_subscribers))
    }

    /// Runs both watches into their caches until `shutdown`. The Cluster API objects are not
    /// filtered by `--watch-filter`: our objects decide what is reconciled.
    async fn drive(
        self,
        client: Client,
        config: Config,
        shutdown: impl Future<Output = ()> + Send,
    ) {
        let wc = watcher::Config::default().page_size(PAGE_SIZE);
        let (cluster_cache, cluster_subscribers) =
            (self.owners.clusters.clone(), self.cluster_subscribers);
        let clusters = watch::<Cluster>(&client, &config, wc.clone()).map(move |event| {
            if let Ok(event) = &event {
                apply_and_fan_out(event, &cluster_cache, &cluster_subscribers);
            }
        });
        let (machine_cache, machine_subscribers) =
            (self.owners.machines.clone(), self.machine_subscribers);
        let machines = watch::<Machine>(&client, &config, wc).map(move |event| {
            if let Ok(event) = &event {
                apply_and_fan_out(event, &machine_cache, &machine_subscribers);
            }
        });
        let both = futures::stream::select(clusters, machines);
        futures::pin_mut!(both);
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            tokio::select! {
                _ = &mut shutdown => break,
                next = both.next() => if next.is_none() { break },
            }
        }
    }
}

/// A reconcile a Cluster API object asks for, and whether a list of them brought it (then it
/// waits its turn in the [`paced::Pacer`]).
type Trigger<K> = (ObjectRef<Packed<K>>, bool);

/// What differs between the kinds' pipelines: which Cluster API objects ask for their
/// reconciles.
trait Pipelined: InfraKind + trim::Projected {
    /// Streams of this kind's objects to reconcile, mapped from Cluster API objects' changes.
    fn owner_triggers(
        caches: &OwnerCaches,
        own: &Store<Packed<Self>>,
    ) -> Result<Vec<BoxStream<'static, Trigger<Self>>>, Error>;
}

/// `ObjectRef` of our object named by a Cluster API object's `spec.infrastructureRef`.
fn infra_target<K: InfraKind>(
    reference: Option<&ContractRef>,
    namespace: Option<String>,
) -> Option<ObjectRef<Packed<K>>> {
    let r = reference?;
    (r.api_group == capm_api::GROUP && r.kind == K::KIND)
        .then(|| ObjectRef::new(&r.name).within(&namespace.unwrap_or_default()))
}

impl Pipelined for MailgunCluster {
    /// A `Cluster` asks for the `MailgunCluster` its `spec.infrastructureRef` names.
    fn owner_triggers(
        caches: &OwnerCaches,
        _: &Store<Packed<Self>>,
    ) -> Result<Vec<BoxStream<'static, Trigger<Self>>>, Error> {
        let cache = caches.owners.clusters.clone();
        let by_cluster = caches
            .clusters()?
            .flat_map(move |heard| {
                targets(cache.clone(), heard, |c: &Cluster| {
                    infra_target(c.spec.infrastructure_ref.as_ref(), c.namespace())
                })
            })
            .boxed();
        Ok(vec![by_cluster])
    }
}

impl Pipelined for MailgunMachine {
    /// A `Machine` asks for the `MailgunMachine` its `spec.infrastructureRef` names; a `Cluster`
    /// (its infrastructure's readiness, its pause) for every `MailgunMachine` labelled with its
    /// name.
    fn owner_triggers(
        caches: &OwnerCaches,
        own: &Store<Packed<Self>>,
    ) -> Result<Vec<BoxStream<'static, Trigger<Self>>>, Error> {
        let cache = caches.owners.machines.clone();
        let by_machine = caches
            .machines()?
            .flat_map(move |heard| {
                targets(cache.clone(), heard, |m: &Machine| {
                    infra_target(m.spec.infrastructure_ref.as_ref(), m.namespace())
                })
            })
            .boxed();
        let own = own.clone();
        let by_cluster = caches
            .clusters()?
            .flat_map(move |heard| {
                // The Clusters' keys, and whether a list brought them.
                let (keys, listed): (Arc<[Key]>, bool) = match heard {
                    Heard::Changed(c) => (Arc::new([Key::of_object(&*c)]), false),
                    Heard::Listed(keys) => (keys, true),
                };
                // One pass over our objects, however many Clusters a list brought, looked up
                // by namespace and name as borrowed from each.
                let clusters: HashSet<(&str, &str)> = keys.iter().map(Key::parts).collect();
                let targets: Vec<Trigger<Self>> = own
                    .state()
                    .iter()
                    .filter(|m| {
                        m.labels().get(names::CLUSTER_NAME_LABEL).is_some_and(|c| {
                            clusters.contains(&(
                                m.meta().namespace.as_deref().unwrap_or_default(),
                                c.as_str(),
                            ))
                        })
                    })
                    .map(|m| (packed::by_name(&ObjectRef::from_obj(&**m)), listed))
                    .collect();
                futures::stream::iter(targets)
            })
            .boxed();
        Ok(vec![by_machine, by_cluster])
    }
}

/// Runs both controllers until `shutdown` resolves. `leadership` is consulted before every
/// write and send (an unelected process is its own leader: [`Leadership::unelected`]).
pub async fn run(
    client: Client,
    mailer: Arc<dyn Mailer>,
    config: Config,
    leadership: Leadership,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    config.validate()?;
    preflight(&client, &config).await?;
    let shutdown = shutdown.shared();

    let caches = OwnerCaches::new();
    let events = Events::new(
        client.clone(),
        "cluster-api-provider-mailgun",
        config.instance.clone(),
    );
    let ctx = Arc::new(Ctx::new(
        client.clone(),
        mailer,
        events,
        config.clone(),
        leadership,
        metrics,
        caches.owners.clone(),
    ));
    ctx.watch_owner_caches();
    let clusters = controller::<MailgunCluster>(&ctx, &caches, shutdown.clone())?;
    let machines = controller::<MailgunMachine>(&ctx, &caches, shutdown.clone())?;
    let owners = caches.drive(client, config.clone(), shutdown.clone());
    let poller = ctx.poller.clone().run(shutdown.clone());
    info!(namespace = ?config.namespace, watch_filter = ?config.watch_filter,
        concurrency = config.concurrency, sync_period = ?config.sync_period, "Controllers started");
    tokio::join!(clusters, machines, owners, poller);
    info!("Controllers stopped");
    Ok(())
}

/// One kind's pipeline (see the module docs), as a future that runs until `shutdown`.
fn controller<K: Pipelined>(
    ctx: &Arc<Ctx>,
    caches: &OwnerCaches,
    shutdown: impl Future<Output = ()> + Send + Sync + Clone + 'static,
) -> Result<impl Future<Output = ()> + Send + 'static, Error> {
    let config = &ctx.config;
    let metrics = &ctx.metrics;
    let name = K::CONTROLLER;
    metrics
        .max_concurrent
        .with_label_values(&[name])
        .set(i64::from(config.concurrency));
    let count = |counter: &prometheus::IntCounterVec| counter.with_label_values(&[name]);
    let queue = metrics.workqueue.clone();
    queue.init(name);
    // Present at zero before the first retry, as the other queue series.
    count(&metrics.queue_retries);

    let mut wc = watcher::Config::default().page_size(PAGE_SIZE);
    if let Some(filter) = &config.watch_filter {
        wc = wc.labels(&format!("{}={filter}", names::WATCH_FILTER_LABEL));
    }
    let (store, writer) = reflector::store::<Packed<K>>();
    // Enough to keep every worker busy while the next ones wait in the scheduler: a finished
    // object's reconcile takes well under a millisecond, about what handing the next one over
    // takes. A few hundred scheduler entries are a few hundred KB at most.
    let pacer = paced::Pacer::new(8 * usize::from(config.concurrency));
    // A list's reconcile is a trigger, and enters the queue's series, when it is asked for: the
    // `workqueue_*` series show the whole backlog, and its wait, as before the pacer.
    let asker = || {
        let (pacer, adds, queue) = (pacer.clone(), count(&metrics.triggers), queue.clone());
        move |r: &ObjectRef<Packed<K>>| {
            adds.inc();
            queue.added(name, &workqueue::key(r.namespace.as_deref(), &r.name));
            pacer.ask(r);
        }
    };
    let forgetting = Arc::clone(ctx);
    let retrying = Arc::clone(ctx);
    let mut after_lists =
        lists::AfterLists::new(store.clone(), asker(), move |uid| forgetting.forget(uid))
            // An object whose reconciles failed while the API server was away (a partition, a restart)
            // would otherwise wait out the retry delay it built up, unchanged and so not asked for.
            .retrying(move |uid| retrying.memory.has_failures(uid));
    let (adds, lists_done) = (count(&metrics.triggers), count(&metrics.lists));
    let own_queue = queue.clone();
    let own = watch_as::<Packed<K>>(&ctx.client, config, wc)
        .reflect(writer)
        .filter_map(move |event| {
            future::ready(match event {
                Ok(event) => {
                    if matches!(event, watcher::Event::InitDone) {
                        lists_done.inc();
                    }
                    after_lists.on_event(event).map(|obj| {
                        adds.inc();
                        own_queue.added(
                            name,
                            &workqueue::key(obj.namespace().as_deref(), &obj.name_any()),
                        );
                        Ok(obj)
                    })
                }
                Err(error) => Some(Err(error)),
            })
        });

    let ask = asker();
    let by_owners = futures::stream::select_all(K::owner_triggers(caches, &store)?).filter_map(
        move |(reference, listed)| {
            future::ready(if listed {
                ask(&reference);
                None
            } else {
                Some(reference)
            })
        },
    );
    let mut triggers = vec![by_owners.boxed()];
    triggers.push(resync::every_object(store.clone(), config.sync_period).boxed());
    let wakes = ctx.poller.take_wakes::<K>().ok_or(Error::Wiring(
        "the delivery poller's wake-ups were taken twice",
    ))?;
    triggers.push(wakes.map(|r| packed::by_name(&r)).boxed());
    let adds = count(&metrics.triggers);
    let trigger_queue = queue.clone();
    let triggers = futures::stream::select_all(triggers).inspect(move |obj| {
        adds.inc();
        trigger_queue.added(name, &workqueue::key(obj.namespace.as_deref(), &obj.name));
    });
    // Counted when asked for (`ask`).
    let triggers = futures::stream::select(triggers, pacer.stream());

    let abort = abort_if_never_ready(shutdown.clone(), store.clone());
    Ok(Controller::for_stream(own, store)
        .with_config(controller::Config::default().concurrency(config.concurrency))
        .reconcile_on(triggers)
        .graceful_shutdown_on(shutdown)
        .run(
            unpack_and_reconcile::<K>,
            error_policy::<K>,
            Arc::clone(ctx),
        )
        .take_until(abort)
        .for_each(move |result| {
            match &result {
                Ok((reference, _)) => pacer.finished(reference),
                Err(
                    controller::Error::ObjectNotFound(reference)
                    | controller::Error::ReconcilerFailed(_, reference),
                ) => pacer.finished(reference),
                Err(_) => {}
            }
            log_result(K::CONTROLLER, &queue, result);
            future::ready(())
        }))
}

/// What kube-runtime's `Controller` reports for each reconcile of `K`.
type Reconciled<K> =
    Result<(ObjectRef<Packed<K>>, Action), controller::Error<ReconcileError, watcher::Error>>;

fn log_result<K: InfraKind>(controller: &'static str, queue: &Workqueue, result: Reconciled<K>) {
    match result {
        // Logged by `reconcile`, in the object's span.
        Ok(_) | Err(controller::Error::ReconcilerFailed(..)) => {}
        // Deleted (or moved) between its trigger and its turn; or, during a re-list, not in
        // the store yet: the list's end asks for it again (`lists`).
        Err(controller::Error::ObjectNotFound(obj)) => {
            let key = workqueue::key(obj.namespace.as_deref(), &obj.name);
            queue.dropped(controller, &key);
            let _object = K::log_span(&key).entered();
            debug!("Object not in the cache at its reconcile");
        }
        Err(error) => warn!(controller, %error, "Controller error"),
    }
}

/// Reads the cached object back whole and reconciles it.
async fn unpack_and_reconcile<K: Pipelined>(
    cached: Arc<Packed<K>>,
    ctx: Arc<Ctx>,
) -> Result<Action, ReconcileError> {
    let obj = cached
        .unpack()
        .map_err(|e| ReconcileError::Cache(e.to_string()))?;
    reconcile::<K>(Arc::new(obj), ctx).await
}

fn error_policy<K: Pipelined>(
    obj: Arc<Packed<K>>,
    error: &ReconcileError,
    ctx: Arc<Ctx>,
) -> Action {
    if error.is_permanent() || matches!(error, ReconcileError::Gone) {
        // Retrying cannot help: the next change to the object (or the sync period) will.
        return Action::await_change();
    }
    let delay = ctx.retry_delay(&obj.uid().unwrap_or_default(), error);
    ctx.metrics
        .queue_retries
        .with_label_values(&[K::CONTROLLER])
        .inc();
    ctx.requeue::<K>(&*obj, delay)
}

/// Resolves when `shutdown` has resolved while `store` never became ready: kube's applier holds
/// its runner until the store is ready, so a shutdown that cuts the watch before the first list
/// completed would otherwise wait forever. With a ready store it never resolves and the graceful
/// path (let in-flight reconciles finish) applies.
fn abort_if_never_ready<K>(
    shutdown: impl Future<Output = ()> + Send + 'static,
    store: Store<K>,
) -> impl Future<Output = ()> + Send + Sync + 'static
where
    K: kube::runtime::reflector::Lookup + Clone + Send + Sync + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        shutdown.await;
        if store.wait_until_ready().now_or_never().is_none() {
            let _ = tx.send(());
        }
    });
    async move {
        if rx.await.is_err() {
            // Ready when shutdown came: never force.
            future::pending::<()>().await;
        }
    }
}

/// A `MailgunCluster` in namespace `ns` for the pipeline's tests.
#[cfg(test)]
fn test_object(name: &str, uid: &str, rv: &str) -> MailgunCluster {
    let mut o = MailgunCluster::new(
        name,
        serde_json::from_value(serde_json::json!({
            "priority": "Urgent", "request": "r", "requester": "a@example.com",
        }))
        .expect("a valid spec"),
    );
    o.metadata.namespace = Some("ns".into());
    o.metadata.uid = Some(uid.into());
    o.metadata.resource_version = Some(rv.into());
    o
}

/// Fails start-up with a clear message when the CRDs are missing or not readable.
async fn preflight(client: &Client, config: &Config) -> Result<(), Error> {
    let lp = ListParams::default().limit(1);
    let check = |what: &'static str, result: Result<(), kube::Error>| {
        result.map_err(|source| Error::Kube {
            context: what,
            source,
        })
    };
    check(
        "listing MailgunClusters (are the provider's CRDs installed and is listing allowed?)",
        scoped::<MailgunCluster>(client, config)
            .list_metadata(&lp)
            .await
            .map(drop),
    )?;
    check(
        "listing MailgunMachines (are the provider's CRDs installed and is listing allowed?)",
        scoped::<MailgunMachine>(client, config)
            .list_metadata(&lp)
            .await
            .map(drop),
    )?;
    check(
        "listing cluster.x-k8s.io/v1beta2 Clusters (are the Cluster API CRDs installed?)",
        scoped::<Cluster>(client, config)
            .list_metadata(&lp)
            .await
            .map(drop),
    )?;
    check(
        "listing cluster.x-k8s.io/v1beta2 Machines (are the Cluster API CRDs installed?)",
        scoped::<Machine>(client, config)
            .list_metadata(&lp)
            .await
            .map(drop),
    )?;
    Ok(())
}

#[cfg(test)]
mod fan_out_tests {
    use super::*;
    use kube::runtime::reflector::store::Writer;

    /// An object changed and deleted before its subscriber reads still reaches the subscriber,
    /// and the subscriber keeps hearing of later changes (kube-runtime's shared-store subscriber
    /// stopped for good in that case).
    #[tokio::test]
    async fn a_change_then_a_deletion_never_stops_a_subscriber() {
        let cache = OwnerCache::<MailgunCluster>::new("");
        let subscribers = Subscribers::<MailgunCluster>::default();
        let mut heard = futures::stream::select_all([subscribe(&subscribers)]);
        let apply = |event: watcher::Event<MailgunCluster>| {
            apply_and_fan_out(&event, &cache, &subscribers);
        };
        apply(watcher::Event::Init);
        apply(watcher::Event::InitApply(test_object("a", "ua", "1")));
        apply(watcher::Event::InitDone);
        apply(watcher::Event::Apply(test_object("b", "ub", "2")));
        apply(watcher::Event::Delete(test_object("b", "ub", "2")));
        apply(watcher::Event::Apply(test_object("c", "uc", "3")));
        let mut names: Vec<(String, bool)> = Vec::new();
        for _ in 0..3 {
            let obj = tokio::time::timeout(Duration::from_secs(1), heard.next())
                .await
                .expect("the subscriber hears every change")
                .expect("open");
            names.extend(
                targets(cache.clone(), obj, |o: &MailgunCluster| Some(o.name_any()))
                    .collect::<Vec<_>>()
                    .await,
            );
        }
        assert_eq!(
            names,
            [("a".into(), true), ("b".into(), false), ("c".into(), false)],
            "each object, marked when a list brought it"
        );
    }

    /// The kube-runtime behaviour this module works around (docs/kube-runtime-subscriber.md):
    /// a shared store's subscriber that meets a reference to an object deleted meanwhile stops
    /// yielding, although later changes were dispatched to it. This test fails the day
    /// kube-runtime changes it.
    #[tokio::test]
    async fn kube_runtime_subscriber_stops_after_an_object_deleted_meanwhile() {
        let writer = Writer::<MailgunCluster>::new_shared(16, ());
        let subscriber = writer.subscribe().expect("a shared store");
        let events = futures::stream::iter([
            Ok(watcher::Event::Init),
            Ok(watcher::Event::InitDone),
            Ok(watcher::Event::Apply(test_object("b", "ub", "2"))),
            Ok(watcher::Event::Delete(test_object("b", "ub", "2"))),
            Ok(watcher::Event::Apply(test_object("c", "uc", "3"))),
        ]);
        // The reflector applies and dispatches everything before the subscriber reads.
        let applied: Vec<Result<watcher::Event<MailgunCluster>, watcher::Error>> =
            events.reflect_shared(writer).collect().await;
        assert_eq!(applied.len(), 5);
        // "c" was dispatched after "b", but the subscriber, finding "b" gone, answers `Pending`
        // without asking to be woken: among other trigger streams (`select_all`, as a
        // controller's triggers are), it is never polled again.
        let mut triggers = futures::stream::select_all([subscriber.boxed()]);
        let next = tokio::time::timeout(Duration::from_millis(300), triggers.next()).await;
        assert!(
            next.is_err(),
            "kube-runtime's subscriber went on after a deleted object: {:?}",
            next.map(|o| o.map(|o| o.name_any()))
        );
    }
}
