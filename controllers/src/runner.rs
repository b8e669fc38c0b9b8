//! Wiring: caches, watches, the two controllers, and graceful shutdown.

use std::{future::Future, sync::Arc};

use capm_api::{
    names,
    v1beta1::{MailgunCluster, MailgunMachine},
};
use capm_mailer::Mailer;
use futures::{FutureExt, StreamExt, TryStreamExt, future};
use kube::{
    Api, Client, Resource, ResourceExt,
    api::ListParams,
    runtime::{
        Controller, WatchStreamExt,
        controller::{self, Action},
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use tracing::{debug, info, warn};

use crate::{
    Config, Error, Metrics, cache,
    capi::{Cluster, ContractRef, Machine},
    context::{Ctx, ReconcileError},
    events::Events,
    kinds::InfraKind,
    reconcile::{key, reconcile},
};

/// Page size of initial lists: small pages keep the peak memory of a large list low.
const PAGE_SIZE: u32 = 50;

fn watcher_config(config: &Config) -> watcher::Config {
    let mut wc = watcher::Config::default().page_size(PAGE_SIZE);
    if let Some(filter) = &config.watch_filter {
        wc = wc.labels(&format!("{}={filter}", names::WATCH_FILTER_LABEL));
    }
    wc
}

fn scoped<K>(client: &Client, config: &Config) -> Api<K>
where
    K: Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope>,
{
    match &config.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Runs both controllers until `shutdown` resolves.
pub async fn run(
    client: Client,
    mailer: Arc<dyn Mailer>,
    config: Config,
    metrics: Metrics,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), Error> {
    config.validate()?;
    preflight(&client, &config).await?;

    let shutdown = shutdown.shared();
    let wc = watcher_config(&config);

    // Cluster API objects: one cache each, shared by both controllers' mappers. They are not
    // filtered by --watch-filter: our objects decide what is reconciled.
    let cluster_writer = reflector::store::Writer::<Cluster>::new_shared(1024, ());
    let clusters: Store<Cluster> = cluster_writer.as_reader();
    let machine_writer = reflector::store::Writer::<Machine>::new_shared(1024, ());
    let machines: Store<Machine> = machine_writer.as_reader();
    let no_subscription = || Error::Config("the Cluster API cache refused a subscriber".into());
    let cluster_sub_a = cluster_writer.subscribe().ok_or_else(no_subscription)?;
    let cluster_sub_b = cluster_writer.subscribe().ok_or_else(no_subscription)?;
    let machine_subscription = machine_writer.subscribe().ok_or_else(no_subscription)?;
    let capi_wc = watcher::Config::default().page_size(PAGE_SIZE);
    let cluster_events = watcher(scoped::<Cluster>(&client, &config), capi_wc.clone())
        .default_backoff()
        .modify(cache::trim_cluster)
        .reflect_shared(cluster_writer);
    let machine_events = watcher(scoped::<Machine>(&client, &config), capi_wc)
        .default_backoff()
        .modify(cache::trim_machine)
        .reflect_shared(machine_writer);

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
        metrics.clone(),
        clusters.clone(),
        machines.clone(),
    ));
    ctx.watch_owner_caches();
    for controller in [MailgunCluster::CONTROLLER, MailgunMachine::CONTROLLER] {
        metrics
            .max_concurrent
            .with_label_values(&[controller])
            .set(i64::from(config.concurrency));
    }
    let controller_config = controller::Config::default().concurrency(config.concurrency);
    let no_wakes = || Error::Config("the delivery poller's wake-ups were taken twice".into());
    let cluster_wakes = ctx
        .poller
        .take_wakes::<MailgunCluster>()
        .ok_or_else(no_wakes)?;
    let machine_wakes = ctx
        .poller
        .take_wakes::<MailgunMachine>()
        .ok_or_else(no_wakes)?;
    let poller = ctx.poller.clone().run(shutdown.clone());

    // MailgunCluster: its own objects, and Clusters mapped through spec.infrastructureRef.
    let (mgc_reader, mgc_writer) = reflector::store::<MailgunCluster>();
    let adds = metrics.queue_adds.clone();
    let mgc_stream = watcher(scoped::<MailgunCluster>(&client, &config), wc.clone())
        .default_backoff()
        .map_ok(stash_statuses::<MailgunCluster>(ctx.clone()))
        .modify(cache::trim_ours)
        .reflect(mgc_writer)
        .applied_objects()
        .inspect(move |_| adds.with_label_values(&[MailgunCluster::CONTROLLER]).inc());
    let adds = metrics.queue_adds.clone();
    let mgc_abort = abort_if_never_ready(shutdown.clone(), mgc_reader.clone());
    let cluster_controller = Controller::for_stream(mgc_stream, mgc_reader)
        .with_config(controller_config.clone())
        .reconcile_on(cluster_wakes)
        .watches_shared_stream(cluster_sub_a, move |cluster| {
            let target = infra_target(
                cluster.spec.infrastructure_ref.as_ref(),
                cluster.namespace(),
                MailgunCluster::KIND,
            );
            if target.is_some() {
                adds.with_label_values(&[MailgunCluster::CONTROLLER]).inc();
            }
            target
        })
        .graceful_shutdown_on(shutdown.clone())
        .run(
            reconcile::<MailgunCluster>,
            error_policy::<MailgunCluster>,
            ctx.clone(),
        )
        .take_until(mgc_abort)
        .for_each(|result| {
            log_result(MailgunCluster::CONTROLLER, result);
            future::ready(())
        });

    // MailgunMachine: its own objects, Machines through spec.infrastructureRef, and Clusters to
    // every MailgunMachine labelled with the Cluster's name (infrastructure readiness, pause).
    let (mgm_reader, mgm_writer) = reflector::store::<MailgunMachine>();
    let adds = metrics.queue_adds.clone();
    let mgm_stream = watcher(scoped::<MailgunMachine>(&client, &config), wc)
        .default_backoff()
        .map_ok(stash_statuses::<MailgunMachine>(ctx.clone()))
        .modify(cache::trim_ours)
        .reflect(mgm_writer)
        .applied_objects()
        .inspect(move |_| adds.with_label_values(&[MailgunMachine::CONTROLLER]).inc());
    let by_cluster = mgm_reader.clone();
    let adds_machines = metrics.queue_adds.clone();
    let adds_clusters = metrics.queue_adds.clone();
    let mgm_abort = abort_if_never_ready(shutdown.clone(), mgm_reader.clone());
    let machine_controller = Controller::for_stream(mgm_stream, mgm_reader)
        .with_config(controller_config)
        .reconcile_on(machine_wakes)
        .watches_shared_stream(machine_subscription, move |machine| {
            let target = infra_target(
                machine.spec.infrastructure_ref.as_ref(),
                machine.namespace(),
                MailgunMachine::KIND,
            );
            if target.is_some() {
                adds_machines
                    .with_label_values(&[MailgunMachine::CONTROLLER])
                    .inc();
            }
            target
        })
        .watches_shared_stream(cluster_sub_b, move |cluster| {
            let namespace = cluster.namespace().unwrap_or_default();
            let name = cluster.name_any();
            let targets: Vec<ObjectRef<MailgunMachine>> = by_cluster
                .state()
                .iter()
                .filter(|m| {
                    m.namespace().as_deref() == Some(namespace.as_str())
                        && m.labels().get(names::CLUSTER_NAME_LABEL) == Some(&name)
                })
                .map(|m| ObjectRef::from_obj(&**m))
                .collect();
            adds_clusters
                .with_label_values(&[MailgunMachine::CONTROLLER])
                .inc_by(targets.len() as u64);
            targets
        })
        .graceful_shutdown_on(shutdown.clone())
        .run(
            reconcile::<MailgunMachine>,
            error_policy::<MailgunMachine>,
            ctx.clone(),
        )
        .take_until(mgm_abort)
        .for_each(|result| {
            log_result(MailgunMachine::CONTROLLER, result);
            future::ready(())
        });

    // The shared Cluster API streams must be polled for their subscribers to see anything.
    let drive = |events: futures::stream::BoxStream<'static, ()>| {
        let shutdown = shutdown.clone();
        async move {
            futures::pin_mut!(events);
            let mut shutdown = std::pin::pin!(shutdown);
            loop {
                tokio::select! {
                    _ = &mut shutdown => break,
                    next = events.next() => if next.is_none() { break },
                }
            }
        }
    };
    let cluster_driver = drive(cluster_events.map(|_| ()).boxed());
    let machine_driver = drive(machine_events.map(|_| ()).boxed());
    info!(namespace = ?config.namespace, watch_filter = ?config.watch_filter, concurrency = config.concurrency, "controllers started");
    tokio::join!(
        cluster_controller,
        machine_controller,
        cluster_driver,
        machine_driver,
        poller
    );
    info!("controllers stopped");
    Ok(())
}

/// Moves each object's status and annotations out of the watch's events into the kind's packed cache
/// ([`crate::statuses`]) before the object enters the reflector store, and keeps that cache in
/// step with the watch: deletions remove, a completed (re-)list drops what it no longer has.
fn stash_statuses<K: InfraKind>(
    ctx: Arc<Ctx>,
) -> impl FnMut(watcher::Event<K>) -> watcher::Event<K> {
    move |mut event| {
        let statuses = K::statuses(&ctx);
        match &mut event {
            watcher::Event::Apply(obj) | watcher::Event::InitApply(obj) => statuses.keep(obj),
            watcher::Event::Delete(obj) => statuses.remove(&obj.uid().unwrap_or_default()),
            watcher::Event::Init => statuses.begin_list(),
            watcher::Event::InitDone => statuses.end_list(),
        }
        event
    }
}

/// `ObjectRef` of our object named by a Cluster API object's `spec.infrastructureRef`.
fn infra_target<K: InfraKind>(
    reference: Option<&ContractRef>,
    namespace: Option<String>,
    kind: &str,
) -> Option<ObjectRef<K>> {
    let r = reference?;
    (r.api_group == capm_api::GROUP && r.kind == kind)
        .then(|| ObjectRef::new(&r.name).within(&namespace.unwrap_or_default()))
}

fn log_result<K: InfraKind>(
    controller: &str,
    result: Result<(ObjectRef<K>, Action), controller::Error<ReconcileError, watcher::Error>>,
) {
    match result {
        Ok(_) => {}
        Err(controller::Error::ReconcilerFailed(error, obj)) => {
            if error.is_wait() || error.is_not_found() {
                debug!(controller, object = %obj, %error, "reconcile waits");
            } else {
                warn!(controller, object = %obj, %error, "reconcile failed");
            }
        }
        // The object was deleted (or moved) between its event and its turn: normal.
        Err(controller::Error::ObjectNotFound(obj)) => {
            debug!(controller, object = %obj, "object gone before its reconcile");
        }
        Err(error) => warn!(controller, %error, "controller error"),
    }
}

fn error_policy<K: InfraKind>(obj: Arc<K>, error: &ReconcileError, ctx: Arc<Ctx>) -> Action {
    if error.is_permanent() || matches!(error, ReconcileError::Gone) {
        // Retrying cannot help: the next change to the object (or a restart) will.
        return Action::await_change();
    }
    let delay = ctx.retry_delay(&key(&*obj), error);
    ctx.metrics
        .queue_retries
        .with_label_values(&[K::CONTROLLER])
        .inc();
    Action::requeue(delay)
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
