//! What identities are read from besides the shared watches' stores of the identities and their
//! claimed Secrets ([`crate::kinds::Stores`]): a watch of the namespaces' metadata, started only
//! when a selector first needs a namespace's labels. A reconcile asks the API server nothing.

use std::{collections::BTreeMap, time::Duration};

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Namespace;
use kube::{
    Api, Client, Resource,
    core::PartialObjectMeta,
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use tokio::sync::{OnceCell, watch as signal};

use crate::watch::{list_config, watch};

/// The longest a lookup waits for the namespaces' first list; past it the lookup fails
/// (retried).
const LIST_WAIT: Duration = Duration::from_secs(30);

/// A store that has not been listed yet: what it holds cannot be told from absence.
#[derive(Debug, thiserror::Error)]
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
#[derive(Default)]
pub(crate) struct Namespaces(
    OnceCell<(Store<PartialObjectMeta<Namespace>>, signal::Receiver<bool>)>,
);

impl Namespaces {
    /// The labels of namespace `name` (none when it is not known).
    pub(crate) async fn labels(
        &self,
        client: &Client,
        name: &str,
    ) -> Result<BTreeMap<String, String>, NotListed> {
        let (store, listed) = self
            .0
            .get_or_init(|| async {
                let (store, writer) = reflector::store();
                let (tx, listed) = signal::channel(false);
                let events = watch(Api::all(client.clone()), list_config());
                tokio::spawn(events.reflect(writer).for_each(move |event| {
                    if matches!(event, Ok(watcher::Event::InitDone)) {
                        tx.send_replace(true);
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
