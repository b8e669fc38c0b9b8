//! The watches: paged lists, quick reconnects, a bounded wait on a silent connection, and each
//! failure, list and return visible at debug level; whether a store has been listed; and the
//! namespaces' watch, started only when a selector first needs a namespace's labels and ended
//! with the controllers' run; the namespaces that change after its list, as news.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
    time::Duration,
};

use futures::{FutureExt, StreamExt, channel::mpsc};
use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, Client, Resource,
    core::PartialObjectMeta,
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        utils::{Backoff, ResetTimerBackoff},
        watcher::{self, ExponentialBackoff},
    },
};
use tokio::sync::{OnceCell, watch as signal};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::Config;

/// Page size of lists: small pages keep the peak memory of a large list low.
const PAGE_SIZE: u32 = 50;

/// How long the API server keeps one watch request open before ending it; the watcher then
/// resumes from where it was. kube-runtime treats a watch that sent nothing for this long plus
/// 5 s as a dead connection: a partition that drops packets instead of closing connections (a
/// load balancer that forgot them) is noticed within 35 s, where kube's default (290 s) would
/// wait almost five minutes. client-go notices the same in about 30 s with HTTP/2 pings;
/// kube-client speaks HTTP/1.1, which has none. The cost: one watch request per kind every 30 s.
const WATCH_TIMEOUT_SECS: u32 = 30;

/// The watcher configuration of every watch: paged lists, [`WATCH_TIMEOUT_SECS`].
pub(crate) fn list_config() -> watcher::Config {
    watcher::Config::default()
        .page_size(PAGE_SIZE)
        .timeout(WATCH_TIMEOUT_SECS)
}

/// How a watch that failed tries again: from a quarter second, doubling to two seconds (plus up
/// to as much jitter), so that watches are back within a few seconds of the API server
/// answering again; kube-runtime's default climbs to 30 s. Four watches at one request per two
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

/// The backoff kube's `Controller` puts on its trigger streams (`Controller::trigger_backoff`):
/// none. By default the Controller backs off the whole merged stream of triggers after any
/// error with client-go's 0.8 s doubling to 30 s, on top of the own watch's [`watch_backoff`]:
/// each wait of a partition's recovery was doubled (the own kind's first event came up to 12 s
/// after the API server answered again, against 3 s for the Cluster watch) and every other
/// trigger (Cluster API changes, the poller's wake-ups) waited with it. The own watch already
/// waits between its attempts, so the Controller does not add a wait.
/// `docs/kube-runtime-recorder.md` (report 4) reports it to kube-rs.
pub(crate) struct NoTriggerBackoff;

impl Iterator for NoTriggerBackoff {
    type Item = Duration;

    fn next(&mut self) -> Option<Duration> {
        // `None` would end the stream: an immediate retry is `Some(ZERO)`.
        Some(Duration::ZERO)
    }
}

impl Backoff for NoTriggerBackoff {
    fn reset(&mut self) {}
}

/// `K`'s endpoint in the configured scope: one namespace, or all.
pub(crate) fn scoped<K>(client: &Client, config: &Config) -> Api<K>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    match &config.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// The watch of `api`'s objects, reconnecting with [`watch_backoff`]. Each failure, each list's
/// start and end, and the first event after a failure are logged at debug level (target
/// `capm_controllers::watch`): what a partition costs can be read off the log.
pub(crate) fn watch<K>(
    api: Api<K>,
    wc: watcher::Config,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + use<K>
where
    K: Resource<DynamicType = ()>,
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    let kind = K::kind(&());
    // Whether the last thing seen was a failure: the next event then says the watch is back.
    let mut failed = false;
    watcher::watcher(api, wc)
        .inspect(move |event| match event {
            Ok(watcher::Event::Init) => {
                failed = false;
                debug!(target: "capm_controllers::watch", %kind, "Listing");
            }
            Ok(watcher::Event::InitDone) => {
                failed = false;
                debug!(target: "capm_controllers::watch", %kind, "List complete");
            }
            Err(error) => {
                failed = true;
                debug!(target: "capm_controllers::watch", %kind, %error, "Watch failed: backing off");
            }
            Ok(_) if failed => {
                failed = false;
                debug!(target: "capm_controllers::watch", %kind, "Watch resumed: first event");
            }
            Ok(_) => {}
        })
        .backoff(watch_backoff())
}

/// The longest a lookup waits for the namespaces' first list; past it it fails (retried).
const LIST_WAIT: Duration = Duration::from_secs(30);

/// A store that has not been listed yet: what it holds cannot be told from absence.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the {0} cache has not been listed yet")]
pub(crate) struct NotListed(&'static str);

/// `store`, once listed (the reconciles wait for the shared lists first, but only so long).
pub(crate) fn listed<'s, K>(
    store: &'s Store<K>,
    kind: &'static str,
) -> Result<&'s Store<K>, NotListed>
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    match store.wait_until_ready().now_or_never() {
        Some(Ok(())) => Ok(store),
        _ => Err(NotListed(kind)),
    }
}

/// The namespaces' metadata, and whether it has been listed once (a `watch` channel: every
/// waiter is woken, where kube-runtime's `wait_until_ready` wakes only the last of several,
/// report 5 in docs/kube-runtime-recorder.md). Started on first use.
pub(crate) struct Namespaces {
    client: Client,
    cache: OnceCell<(Store<PartialObjectMeta<Namespace>>, signal::Receiver<bool>)>,
    /// Where the names of namespaces that changed after the first list go ([`Self::changes`]).
    subscribers: Arc<Mutex<Vec<mpsc::UnboundedSender<String>>>>,
    /// Ends the watch with the controllers' run (a process that runs them again starts anew).
    stop: CancellationToken,
}

impl Namespaces {
    /// The namespaces' cache, its watch (once started) ending when `stop` is cancelled.
    pub(crate) fn new(client: Client, stop: CancellationToken) -> Self {
        let cache = OnceCell::new();
        let subscribers = Arc::default();
        Self {
            client,
            cache,
            subscribers,
            stop,
        }
    }

    /// The names of the namespaces that change (their labels may decide an identity's scope)
    /// once the watch has been started and has listed; a re-list is no news.
    pub(crate) fn changes(&self) -> mpsc::UnboundedReceiver<String> {
        let (tx, rx) = mpsc::unbounded();
        crate::lock(&self.subscribers).push(tx);
        rx
    }

    /// The labels of namespace `name` (none when it is not known).
    pub(crate) async fn labels(&self, name: &str) -> Result<BTreeMap<String, String>, NotListed> {
        let (store, listed) = self
            .cache
            .get_or_init(|| async {
                let (store, writer) = reflector::store::<PartialObjectMeta<Namespace>>();
                let (tx, listed) = signal::channel(false);
                let events = watch(Api::all(self.client.clone()), list_config());
                let subscribers = Arc::clone(&self.subscribers);
                let events = events.take_until(self.stop.clone().cancelled_owned());
                tokio::spawn(events.reflect(writer).for_each(move |event| {
                    match event {
                        Ok(watcher::Event::InitDone) => {
                            tx.send_replace(true);
                        }
                        Ok(watcher::Event::Apply(ns)) if *tx.borrow() => {
                            let name = ns.metadata.name.unwrap_or_default();
                            crate::lock(&subscribers)
                                .retain(|s| s.unbounded_send(name.clone()).is_ok());
                        }
                        _ => {}
                    }
                    std::future::ready(())
                }));
                (store, listed)
            })
            .await;
        match tokio::time::timeout(LIST_WAIT, listed.clone().wait_for(|l| *l)).await {
            Ok(Ok(_)) => Ok(store
                .get(&ObjectRef::new(name))
                .and_then(|ns| ns.metadata.labels.clone())
                .unwrap_or_default()),
            _ => Err(NotListed("Namespace")),
        }
    }
}
