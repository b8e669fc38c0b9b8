//! One kind's pipeline: its watch into a reflector store, then kube-runtime's `Controller`.

use std::{future::Future, sync::Arc};

use capm_api::names;
use futures::{FutureExt, StreamExt, channel::mpsc, future};
use kube::{
    ResourceExt,
    runtime::{
        Controller, WatchStreamExt,
        controller::{self, Action},
        reflector::{ObjectRef, Store, store::Writer},
        watcher,
    },
};
use tracing::{debug, warn};

use super::{
    capi_triggers::{CapiWatches, Pipelined},
    identity_triggers, lists, resync, trim,
};
use crate::{
    context::{Ctx, ReconcileError},
    kinds::Mailed,
    watch::{NoTriggerBackoff, list_config, scoped, watch},
};

/// One kind's pipeline as a future that runs until `shutdown`: watch → trim → reflector store
/// → [`lists::AfterLists`] → kube-runtime's `Controller`, which also takes the reconciles the
/// Cluster API objects ask for ([`Pipelined::capi_triggers`]), the identities' changes
/// ([`identity_triggers`]), the delivery poller's wake-ups,
/// what each list asks for and the sync period's ([`resync`]).
pub(super) fn controller<K: Pipelined>(
    ctx: &Arc<Ctx>,
    capi: &CapiWatches,
    (store, writer): (Store<K>, Writer<K>),
    wakes: mpsc::UnboundedReceiver<ObjectRef<K>>,
    shutdown: impl Future<Output = ()> + Send + Sync + Clone + 'static,
) -> impl Future<Output = ()> + Send + 'static {
    let config = &ctx.config;
    let metrics = &ctx.metrics;
    let name = K::CONTROLLER;
    metrics.init(name, config.concurrency);
    let count = |counter: &prometheus::IntCounterVec| counter.with_label_values(&[name]);

    let mut wc = list_config();
    if let Some(filter) = &config.watch_filter {
        wc = wc.labels(&format!("{}={filter}", names::WATCH_FILTER_LABEL));
    }
    let (relisted, after_list) = mpsc::unbounded();
    let forgetting = Arc::clone(ctx);
    let retrying = Arc::clone(ctx);
    let mut after_lists = lists::AfterLists::new(
        store.clone(),
        move |r: &ObjectRef<K>| drop(relisted.unbounded_send(r.clone())),
        move |uid| forgetting.forget(uid),
        // An object whose reconciles failed while the API server was away (a partition, a
        // restart) would otherwise wait out the retry delay it built up, unchanged and so not
        // asked for.
        move |uid| retrying.ledger.has_failures(uid),
    );
    let (adds, lists_done) = (count(&metrics.triggers), count(&metrics.lists));
    let queueing = Arc::clone(ctx);
    let own = watch(scoped::<K>(&ctx.client, config), wc)
        .modify(trim::ours::<K>)
        .reflect(writer)
        .filter_map(move |event| {
            future::ready(match event {
                Ok(event) => {
                    if matches!(event, watcher::Event::InitDone) {
                        lists_done.inc();
                    }
                    after_lists.on_event(event).map(|obj| {
                        adds.inc();
                        queueing.queued::<K>(&obj.uid().unwrap_or_default());
                        Ok(obj)
                    })
                }
                Err(error) => Some(Err(error)),
            })
        });

    let mut triggers = K::capi_triggers(capi, &store);
    let (news, capi_stores) = (capi.identity_news(), ctx.capi.clone());
    triggers.push(identity_triggers::identity_triggers(
        news,
        store.clone(),
        capi_stores,
    ));
    let relabelled = ctx.identities.namespace_changes().boxed();
    triggers.push(identity_triggers::namespace_triggers(
        relabelled,
        store.clone(),
    ));
    triggers.push(after_list.boxed());
    triggers.push(resync::every_object(store.clone(), config.sync_period).boxed());
    triggers.push(wakes.boxed());
    let (adds, queueing, cached) = (count(&metrics.triggers), Arc::clone(ctx), store.clone());
    let triggers = futures::stream::select_all(triggers).inspect(move |obj| {
        adds.inc();
        // One not in the store is not reconciled (kube finds it missing at its turn).
        if let Some(uid) = cached.get(obj).and_then(|o| o.uid()) {
            queueing.queued::<K>(&uid);
        }
    });

    let abort = abort_if_never_ready(shutdown.clone(), store.clone());
    Controller::for_stream(own, store)
        .with_config(controller::Config::default().concurrency(config.concurrency))
        .trigger_backoff(NoTriggerBackoff)
        .reconcile_on(triggers)
        .graceful_shutdown_on(shutdown)
        .run(K::reconcile, error_policy::<K>, Arc::clone(ctx))
        .take_until(abort)
        .for_each(move |result| {
            log_result(K::CONTROLLER, result);
            future::ready(())
        })
}

/// What kube-runtime's `Controller` reports for each reconcile of `K`.
type Reconciled<K> =
    Result<(ObjectRef<K>, Action), controller::Error<ReconcileError, watcher::Error>>;

fn log_result<K: Mailed>(controller: &'static str, result: Reconciled<K>) {
    match result {
        // Logged by `reconcile`, in the object's span.
        Ok(_) | Err(controller::Error::ReconcilerFailed(..)) => {}
        // Deleted (or moved) between its trigger and its turn; or, during a re-list, not in
        // the store yet: the list's end asks for it again (`lists`).
        Err(controller::Error::ObjectNotFound(obj)) => {
            let key = crate::kinds::key(obj.namespace.as_deref(), &obj.name);
            let _object = K::log_span(&key).entered();
            debug!("Object not in the cache at its reconcile");
        }
        Err(error) => warn!(controller, %error, "Controller error"),
    }
}

fn error_policy<K: Mailed>(obj: Arc<K>, error: &ReconcileError, ctx: Arc<Ctx>) -> Action {
    if error.is_permanent() || matches!(error, ReconcileError::Gone) {
        // Retrying cannot help: the next change to the object (or the sync period) will.
        return Action::await_change();
    }
    let delay = ctx.retry_delay(&obj.uid().unwrap_or_default(), error);
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
