//! The shared watches: the Cluster API objects' and the reconciles of our objects their changes
//! ask for; the mail identities' and their claimed Secrets' (their changes as
//! [`IdentityNews`]).
//!
//! One reflector store per kind, shared by both controllers: it is what the reconciles read
//! ([`crate::kinds::Stores`]); no reconcile asks the API server for any of these objects. Each change is fanned out to the controllers as
//! it is applied ([`Heard`]), and each controller maps it to the objects of its kind that the
//! changed object names ([`Pipelined::capi_triggers`]). Not kube-runtime's shared reflector: its
//! subscribers stop after an object deleted right after it changed
//! (docs/kube-runtime-subscriber.md); here the changed objects themselves are sent.

use std::{collections::HashSet, future::Future, sync::Arc};

use capm_api::{
    capi::{Cluster, ContractRef, Machine, MachineHealthCheck},
    names,
    v1beta1::{MailgunCluster, MailgunClusterIdentity, MailgunMachine},
};
use futures::{
    StreamExt,
    channel::mpsc::{UnboundedSender, unbounded},
    stream::BoxStream,
};
use k8s_openapi::api::core::v1::Secret;
use kube::{
    Api, Client, Resource, ResourceExt,
    runtime::{
        WatchStreamExt,
        controller::Action,
        reflector::{self, ObjectRef, Store, store::Writer},
        watcher,
    },
};

use super::{identity_triggers::IdentityNews, trim};
use crate::{
    Config,
    context::{Ctx, ReconcileError},
    kinds::{Mailed, Stores},
    watch::{list_config, scoped, watch},
};

/// What a Cluster API store's change brings a subscriber.
#[derive(Clone)]
pub(crate) enum Heard<K> {
    /// One object changed (an `Apply`).
    Changed(Arc<K>),
    /// A list is complete: every object in the store may have changed.
    Listed,
}

/// Where one store's changes go: one channel per subscriber.
type Subscribers<K> = Arc<std::sync::Mutex<Vec<UnboundedSender<Heard<K>>>>>;

/// One Cluster API kind: its store, the store's writer until [`CapiWatches::run`] takes it,
/// and its subscribers.
struct Watched<K: Resource<DynamicType = ()> + Clone + 'static> {
    store: Store<K>,
    writer: Writer<K>,
    subscribers: Subscribers<K>,
}

impl<K> Watched<K>
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    fn new() -> Self {
        let (store, writer) = reflector::store();
        Self {
            store,
            writer,
            subscribers: Subscribers::default(),
        }
    }

    /// The store's objects as they change, and the whole store after each list.
    fn subscribe(&self) -> BoxStream<'static, Heard<K>> {
        let (tx, rx) = unbounded();
        crate::lock(&self.subscribers).push(tx);
        rx.boxed()
    }

    /// `events` trimmed by `trim`, applied to the store and fanned out to the subscribers.
    fn reflect(
        self,
        events: impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send,
        trim: fn(&mut K),
    ) -> impl futures::Stream<Item = ()> + Send {
        let Self {
            writer,
            subscribers,
            ..
        } = self;
        events.modify(trim).reflect(writer).map(move |event| {
            if let Ok(event) = &event {
                fan_out(event, &subscribers);
            }
        })
    }
}

/// Sends what `event` (already applied to the store) changed to every subscriber: the object
/// of an `Apply`, [`Heard::Listed`] after a list; nothing for a deletion.
fn fan_out<K>(event: &watcher::Event<K>, subscribers: &Subscribers<K>)
where
    K: Clone + Send + Sync + 'static,
{
    let heard = match event {
        watcher::Event::Apply(obj) => Heard::Changed(Arc::new(obj.clone())),
        watcher::Event::InitDone => Heard::Listed,
        _ => return,
    };
    // A subscriber gone (its controller stopped) is dropped.
    crate::lock(subscribers).retain(|tx| tx.unbounded_send(heard.clone()).is_ok());
}

/// The reconciles `heard` asks for, by `target` (an object's infrastructure): the changed
/// object's, or after a list every stored object's.
pub(super) fn targets<K, T>(
    store: &Store<K>,
    heard: Heard<K>,
    target: impl Fn(&K) -> Option<T>,
) -> futures::stream::Iter<std::vec::IntoIter<T>>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
    T: Send + 'static,
{
    let targets: Vec<T> = match heard {
        Heard::Changed(obj) => target(&obj).into_iter().collect(),
        Heard::Listed => store.state().iter().filter_map(|o| target(o)).collect(),
    };
    futures::stream::iter(targets)
}

/// The shared watches, for both kinds (see the module docs).
pub(crate) struct CapiWatches {
    clusters: Watched<Cluster>,
    machines: Watched<Machine>,
    identities: Watched<MailgunClusterIdentity>,
    secrets: Watched<Secret>,
    health_checks: Watched<MachineHealthCheck>,
}

impl CapiWatches {
    pub(crate) fn new() -> Self {
        Self {
            clusters: Watched::new(),
            machines: Watched::new(),
            identities: Watched::new(),
            secrets: Watched::new(),
            health_checks: Watched::new(),
        }
    }

    /// The Machines' store, and its changes as they come.
    pub(super) fn machine_changes(&self) -> (Store<Machine>, BoxStream<'static, Heard<Machine>>) {
        (self.machines.store.clone(), self.machines.subscribe())
    }

    /// The MachineHealthChecks' store, and its changes as they come.
    pub(super) fn health_check_changes(
        &self,
    ) -> (
        Store<MachineHealthCheck>,
        BoxStream<'static, Heard<MachineHealthCheck>>,
    ) {
        (
            self.health_checks.store.clone(),
            self.health_checks.subscribe(),
        )
    }

    /// The stores the reconciles read, with the `MailgunCluster` and `MailgunMachine`
    /// controllers'.
    pub(crate) fn stores(
        &self,
        mailgun_clusters: Store<MailgunCluster>,
        mailgun_machines: Store<MailgunMachine>,
    ) -> Stores {
        Stores {
            clusters: self.clusters.store.clone(),
            machines: self.machines.store.clone(),
            mailgun_clusters,
            mailgun_machines,
            identities: self.identities.store.clone(),
            secrets: self.secrets.store.clone(),
            health_checks: self.health_checks.store.clone(),
        }
    }

    /// What the identities' and their claimed Secrets' watches hear, as [`IdentityNews`]: a
    /// changed identity, a changed Secret's claim (its label), a re-list. The first list is
    /// not news: every object is reconciled at start.
    pub(crate) fn identity_news(&self) -> BoxStream<'static, IdentityNews> {
        fn after_first_list<K>(
            heard: BoxStream<'static, Heard<K>>,
            name: impl Fn(&K) -> Option<String> + Send + 'static,
        ) -> BoxStream<'static, IdentityNews>
        where
            K: Send + Sync + 'static,
        {
            let mut lists = 0_u64;
            heard
                .filter_map(move |heard| {
                    futures::future::ready(match heard {
                        Heard::Changed(obj) => name(&obj).map(IdentityNews::Changed),
                        Heard::Listed => {
                            lists += 1;
                            (lists > 1).then_some(IdentityNews::Relisted)
                        }
                    })
                })
                .boxed()
        }
        let identities = after_first_list(self.identities.subscribe(), |i| i.metadata.name.clone());
        let secrets = after_first_list(self.secrets.subscribe(), |s: &Secret| {
            s.labels().get(names::IDENTITY_SECRET_LABEL).cloned()
        });
        futures::stream::select(identities, secrets).boxed()
    }

    /// Runs the watches into their stores until `shutdown`. The Cluster API objects are not
    /// filtered by `--watch-filter`: our objects decide what is reconciled. The identities are
    /// cluster-scoped; their Secrets are the ones in `--identity-secret-namespace` that carry
    /// the claim label (none watched without that namespace). Where Cluster API has no
    /// MachineHealthCheck kind, its watch keeps failing quietly and its store stays unlisted.
    pub(crate) async fn run(
        self,
        client: Client,
        config: Config,
        shutdown: impl Future<Output = ()> + Send,
    ) {
        let clusters = self.clusters.reflect(
            watch(scoped::<Cluster>(&client, &config), list_config()),
            trim::cluster,
        );
        let machines = self.machines.reflect(
            watch(scoped::<Machine>(&client, &config), list_config()),
            trim::machine,
        );
        let identities = self.identities.reflect(
            watch(Api::all(client.clone()), list_config()),
            trim::identity,
        );
        let health_checks = self.health_checks.reflect(
            watch(
                scoped::<MachineHealthCheck>(&client, &config),
                list_config(),
            ),
            trim::health_check,
        );
        let mut all = vec![
            clusters.boxed(),
            machines.boxed(),
            identities.boxed(),
            health_checks.boxed(),
        ];
        if let Some(ns) = &config.identity_secret_namespace {
            let claimed = list_config().labels(names::IDENTITY_SECRET_LABEL);
            let api = Api::namespaced(client.clone(), ns);
            all.push(
                self.secrets
                    .reflect(watch(api, claimed), trim::secret)
                    .boxed(),
            );
        }
        let all = futures::stream::select_all(all).take_until(shutdown);
        all.for_each(|()| futures::future::ready(())).await;
    }
}

/// What differs between the kinds' pipelines: which Cluster API objects ask for their
/// reconciles, and the reconcile.
pub(crate) trait Pipelined: Mailed {
    /// Streams of this kind's objects to reconcile, mapped from Cluster API objects' changes.
    fn capi_triggers(
        watches: &CapiWatches,
        own: &Store<Self>,
    ) -> Vec<BoxStream<'static, ObjectRef<Self>>>;

    /// One reconcile of `obj`.
    fn reconcile(
        obj: Arc<Self>,
        ctx: Arc<Ctx>,
    ) -> impl Future<Output = Result<Action, ReconcileError>> + Send + 'static;
}

/// Every object of `own` labelled with the name of a `Cluster` that changed (its
/// infrastructure's readiness, its pause); one pass over `own`, however many Clusters a list
/// brought.
pub(super) fn by_cluster_label<K: Mailed>(
    watches: &CapiWatches,
    own: &Store<K>,
) -> BoxStream<'static, ObjectRef<K>> {
    let clusters = watches.clusters.store.clone();
    labelled(
        watches.clusters.subscribe(),
        clusters,
        own,
        |c: &Cluster| c.meta().name.clone(),
    )
}

/// Every object of `own` labelled with the Cluster name that `cluster` reads from a changed
/// object of `store` (in the same namespace); one pass over `own` per change or list.
pub(super) fn labelled<C, K>(
    heard: BoxStream<'static, Heard<C>>,
    store: Store<C>,
    own: &Store<K>,
    cluster: fn(&C) -> Option<String>,
) -> BoxStream<'static, ObjectRef<K>>
where
    C: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
    K: Mailed,
{
    let own = own.clone();
    heard
        .flat_map(move |heard| {
            let changed: Vec<Arc<C>> = match heard {
                Heard::Changed(c) => vec![c],
                Heard::Listed => store.state(),
            };
            let changed: HashSet<(String, String)> = changed
                .iter()
                .filter_map(|c| Some((c.meta().namespace.clone()?, cluster(c)?)))
                .collect();
            let targets: Vec<ObjectRef<K>> = own
                .state()
                .iter()
                .filter(|m| {
                    m.labels().get(names::CLUSTER_NAME_LABEL).is_some_and(|c| {
                        let namespace = m.meta().namespace.clone().unwrap_or_default();
                        changed.contains(&(namespace, c.clone()))
                    })
                })
                .map(|m| ObjectRef::from_obj(&**m))
                .collect();
            futures::stream::iter(targets)
        })
        .boxed()
}

/// Our object named by a Cluster API object's `spec.infrastructureRef`.
fn infra_target<K: Mailed>(
    reference: Option<&ContractRef>,
    namespace: Option<String>,
) -> Option<ObjectRef<K>> {
    let r = reference?;
    (r.api_group == capm_api::GROUP && r.kind == K::KIND)
        .then(|| ObjectRef::new(&r.name).within(&namespace.unwrap_or_default()))
}

impl Pipelined for MailgunCluster {
    /// A `Cluster` asks for the `MailgunCluster` its `spec.infrastructureRef` names.
    fn capi_triggers(
        watches: &CapiWatches,
        _: &Store<Self>,
    ) -> Vec<BoxStream<'static, ObjectRef<Self>>> {
        let store = watches.clusters.store.clone();
        let by_cluster = watches.clusters.subscribe().flat_map(move |heard| {
            targets(&store, heard, |c: &Cluster| {
                infra_target(c.spec.infrastructure_ref.as_ref(), c.namespace())
            })
        });
        vec![by_cluster.boxed()]
    }

    fn reconcile(
        obj: Arc<Self>,
        ctx: Arc<Ctx>,
    ) -> impl Future<Output = Result<Action, ReconcileError>> + Send + 'static {
        crate::reconcile::reconcile(obj, ctx)
    }
}

impl Pipelined for MailgunMachine {
    /// A `Machine` asks for the `MailgunMachine` its `spec.infrastructureRef` names; a `Cluster`
    /// (its infrastructure's readiness, its pause) for every `MailgunMachine` labelled with its
    /// name.
    fn capi_triggers(
        watches: &CapiWatches,
        own: &Store<Self>,
    ) -> Vec<BoxStream<'static, ObjectRef<Self>>> {
        let store = watches.machines.store.clone();
        let by_machine = watches.machines.subscribe().flat_map(move |heard| {
            targets(&store, heard, |m: &Machine| {
                infra_target(m.spec.infrastructure_ref.as_ref(), m.namespace())
            })
        });
        vec![by_machine.boxed(), by_cluster_label(watches, own)]
    }

    fn reconcile(
        obj: Arc<Self>,
        ctx: Arc<Ctx>,
    ) -> impl Future<Output = Result<Action, ReconcileError>> + Send + 'static {
        crate::reconcile::reconcile(obj, ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use super::super::tests::test_object;

    /// An object changed and deleted before its subscriber reads still reaches the subscriber,
    /// and the subscriber keeps hearing of later changes (kube-runtime's shared-store subscriber
    /// stopped for good in that case).
    #[tokio::test]
    async fn a_change_then_a_deletion_never_stops_a_subscriber() {
        let mut watched = Watched::<MailgunCluster>::new();
        let mut heard = futures::stream::select_all([watched.subscribe()]);
        let mut apply = |event: watcher::Event<MailgunCluster>| {
            watched.writer.apply_watcher_event(&event);
            fan_out(&event, &watched.subscribers);
        };
        apply(watcher::Event::Init);
        apply(watcher::Event::InitApply(test_object("a", "ua", "1")));
        apply(watcher::Event::InitDone);
        apply(watcher::Event::Apply(test_object("b", "ub", "2")));
        apply(watcher::Event::Delete(test_object("b", "ub", "2")));
        apply(watcher::Event::Apply(test_object("c", "uc", "3")));
        let mut names: Vec<Vec<String>> = Vec::new();
        for _ in 0..3 {
            let obj = tokio::time::timeout(Duration::from_secs(1), heard.next())
                .await
                .expect("the subscriber hears every change")
                .expect("open");
            let mut each: Vec<String> =
                targets(&watched.store, obj, |o: &MailgunCluster| Some(o.name_any()))
                    .collect()
                    .await;
            each.sort();
            names.push(each);
        }
        // After the list: what the store holds when the subscriber reads.
        assert_eq!(names, [vec!["a", "c"], vec!["b"], vec!["c"]], "each object");
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
