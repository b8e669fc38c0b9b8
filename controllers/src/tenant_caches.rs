//! What identities are read from: a watch of the `MailgunClusterIdentity` objects, one of the
//! claimed Secrets in the provider's namespace (label-selected, [`IDENTITY_SECRET_LABEL`]), and
//! one of the namespaces' metadata, started only when a selector first needs a namespace's
//! labels. Each starts on first use and is then kept current by its watch: a reconcile asks the
//! API server nothing, and a rotated key is used as soon as the watch delivers it.

use std::{collections::BTreeMap, fmt::Debug, sync::Arc, time::Duration};

use capm_api::{names::IDENTITY_SECRET_LABEL, v1beta1::MailgunClusterIdentity};
use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::{
    Api, Client, Resource,
    core::PartialObjectMeta,
    runtime::{
        WatchStreamExt,
        reflector::{self, ObjectRef, Store},
        watcher,
    },
};
use serde::de::DeserializeOwned;
use tokio::sync::{OnceCell, watch};

/// The longest a lookup waits for a cache's first list; past it the lookup fails (retried).
const LIST_WAIT: Duration = Duration::from_secs(30);

/// A store and whether it has been listed once (a `watch` channel: every waiter is woken, where
/// kube-runtime's delayed init wakes only the last of several).
struct Cache<K: Resource<DynamicType = ()> + 'static> {
    store: Store<K>,
    listed: watch::Receiver<bool>,
}

impl<K> Cache<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
{
    /// Starts the watch of `stream` into a new store.
    fn start<S>(stream: S) -> Self
    where
        S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
    {
        let (store, writer) = reflector::store();
        let (tx, listed) = watch::channel(false);
        let kind = K::kind(&()).into_owned();
        let events = reflector::reflector(writer, stream).default_backoff();
        tokio::spawn(events.for_each(move |event| {
            match event {
                Ok(watcher::Event::InitDone) => {
                    tx.send_replace(true);
                }
                Err(error) => {
                    tracing::debug!(%kind, %error, "Identity cache watch failed: backing off")
                }
                Ok(_) => {}
            }
            std::future::ready(())
        }));
        Self { store, listed }
    }
}

/// The caches of one process, each started on first use.
pub(crate) struct TenantCaches {
    client: Client,
    secret_namespace: Option<String>,
    identities: OnceCell<Cache<MailgunClusterIdentity>>,
    secrets: OnceCell<Cache<Secret>>,
    namespaces: OnceCell<Cache<PartialObjectMeta<Namespace>>>,
}

/// The watcher configuration: small pages, a watch request renewed every 30 s (as the
/// pipeline's, so a dead connection is noticed as soon).
fn config() -> watcher::Config {
    watcher::Config::default().page_size(50).timeout(30)
}

/// A cache that could not be listed within [`LIST_WAIT`].
#[derive(Debug, thiserror::Error)]
#[error("the {0} cache has not been listed yet")]
pub(crate) struct NotListed(String);

impl TenantCaches {
    pub(crate) fn new(client: Client, secret_namespace: Option<String>) -> Self {
        Self {
            client,
            secret_namespace,
            identities: OnceCell::new(),
            secrets: OnceCell::new(),
            namespaces: OnceCell::new(),
        }
    }

    /// The identity `name`, as last watched.
    pub(crate) async fn identity(
        &self,
        name: &str,
    ) -> Result<Option<Arc<MailgunClusterIdentity>>, NotListed> {
        let api = || Api::all(self.client.clone());
        let store = listed(&self.identities, || watcher::watcher(api(), config())).await?;
        Ok(store.get(&ObjectRef::new(name)))
    }

    /// The claimed Secret `name` in the provider's namespace (`None` without one, or when no
    /// Secret of that name carries the claim label).
    pub(crate) async fn secret(&self, name: &str) -> Result<Option<Arc<Secret>>, NotListed> {
        let Some(ns) = &self.secret_namespace else {
            return Ok(None);
        };
        let api = || Api::namespaced(self.client.clone(), ns);
        let claimed = || config().labels(IDENTITY_SECRET_LABEL);
        let store = listed(&self.secrets, || watcher::watcher(api(), claimed())).await?;
        Ok(store.get(&ObjectRef::new(name).within(ns)))
    }

    /// The labels of namespace `name` (none when it is not known).
    pub(crate) async fn namespace_labels(
        &self,
        name: &str,
    ) -> Result<BTreeMap<String, String>, NotListed> {
        let api = || Api::all(self.client.clone());
        let store = listed(&self.namespaces, || watcher::watcher(api(), config())).await?;
        let ns = store.get(&ObjectRef::new(name));
        Ok(ns
            .and_then(|ns| ns.metadata.labels.clone())
            .unwrap_or_default())
    }
}

/// The store of `cell`, its watch started with `stream` on first use, once listed.
async fn listed<K, S>(
    cell: &OnceCell<Cache<K>>,
    stream: impl FnOnce() -> S,
) -> Result<&Store<K>, NotListed>
where
    K: Resource<DynamicType = ()> + Clone + Debug + DeserializeOwned + Send + Sync + 'static,
    S: futures::Stream<Item = Result<watcher::Event<K>, watcher::Error>> + Send + 'static,
{
    let cache = cell.get_or_init(|| async { Cache::start(stream()) }).await;
    let mut done = cache.listed.clone();
    match tokio::time::timeout(LIST_WAIT, done.wait_for(|l| *l)).await {
        Ok(Ok(_)) => Ok(&cache.store),
        _ => Err(NotListed(K::kind(&()).into_owned())),
    }
}
