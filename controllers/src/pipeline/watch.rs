//! The watches: paged lists, quick reconnects, each reconnect and list visible at debug level.

use std::time::Duration;

use futures::StreamExt;
use kube::{
    Api, Client, Resource,
    runtime::{
        WatchStreamExt,
        utils::{Backoff, ResetTimerBackoff},
        watcher::{self, ExponentialBackoff},
    },
};
use tracing::debug;

use crate::Config;

/// Page size of lists: small pages keep the peak memory of a large list low.
const PAGE_SIZE: u32 = 50;

/// The watcher configuration of every watch: paged lists.
pub(crate) fn list_config() -> watcher::Config {
    watcher::Config::default().page_size(PAGE_SIZE)
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

/// The watch of `K`'s objects in scope, reconnecting with [`watch_backoff`]. Each list's start
/// and end, and each failure, is logged at debug level (target `capm_controllers::watch`).
pub(crate) fn watch<K>(
    client: &Client,
    config: &Config,
    wc: watcher::Config,
) -> impl futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + use<K>
where
    K: Resource<DynamicType = (), Scope = k8s_openapi::NamespaceResourceScope>,
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    let kind = K::kind(&());
    watcher::watcher(scoped::<K>(client, config), wc)
        .inspect(move |event| match event {
            Ok(watcher::Event::Init) => {
                debug!(target: "capm_controllers::watch", %kind, "Listing");
            }
            Ok(watcher::Event::InitDone) => {
                debug!(target: "capm_controllers::watch", %kind, "List complete");
            }
            Err(error) => {
                debug!(target: "capm_controllers::watch", %kind, %error, "Watch failed: backing off");
            }
            Ok(_) => {}
        })
        .backoff(watch_backoff())
}
