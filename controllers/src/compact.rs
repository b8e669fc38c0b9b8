//! Compact forms of what the process keeps per object: one short key per reference, deflated
//! bodies, and the Cluster API caches built of both.
//!
//! - [`Key`]: a namespaced reference as one string, for the queues that hold thousands of
//!   references (the list's reconciles, the sync walk).
//! - [`deflate`] / [`inflate`]: a JSON document deflated after a dictionary (a typical document
//!   of its kind), so a body holds only what differs from it. The dictionary is passed through
//!   the same compressor first and its output, always the same, is left out of the body and put
//!   back before inflating: deflate's preset dictionary, which `miniz_oxide` does not offer,
//!   from a sync flush.
//! - [`OwnerCache`]: the `Cluster`s and `Machine`s the reconciles read, one deflated snapshot
//!   per object by key, applied from their watch as kube-runtime's reflector applies a store
//!   (a list replaces the contents when it is complete). A typed object in a reflector store
//!   cost about 700 bytes (a 360-byte `ObjectMeta` of empty options, the key's and the
//!   metadata's strings twice); here about 200.

use std::{
    cell::RefCell,
    collections::HashMap,
    marker::PhantomData,
    sync::{Arc, Mutex, RwLock},
};

use kube::{
    Resource,
    runtime::{reflector::ObjectRef, watcher},
};
use miniz_oxide::deflate::core::{
    CompressorOxide, TDEFLFlush, TDEFLStatus, compress_to_output, create_comp_flags_from_zip_params,
};
use serde::{Serialize, de::DeserializeOwned};

/// Deflate's level: the fastest. The objects are small; higher levels saved 20 bytes of 540.
const LEVEL: i32 = 1;

/// A namespaced object's reference in one allocation: `namespace/name` (neither may contain a
/// `/`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Key(Box<str>);

impl Key {
    /// The key of `r` (kind and any UID or `resourceVersion` dropped).
    pub fn of<K: Resource>(r: &ObjectRef<K>) -> Self {
        Self::new(r.namespace.as_deref().unwrap_or_default(), &r.name)
    }

    /// The key of `obj` (its name and namespace, borrowed from its metadata).
    pub fn of_object<K: Resource>(obj: &K) -> Self {
        let meta = obj.meta();
        Self::new(
            meta.namespace.as_deref().unwrap_or_default(),
            meta.name.as_deref().unwrap_or_default(),
        )
    }

    /// The key of the object `name` in `namespace`.
    pub fn new(namespace: &str, name: &str) -> Self {
        let mut key = String::with_capacity(namespace.len() + 1 + name.len());
        key.push_str(namespace);
        key.push('/');
        key.push_str(name);
        Self(key.into_boxed_str())
    }

    /// Namespace and name.
    pub fn parts(&self) -> (&str, &str) {
        self.0.split_once('/').unwrap_or(("", &self.0))
    }

    /// The reference this key names, as the controller of `K` takes it.
    pub fn to_ref<K: Resource<DynamicType = ()>>(&self) -> ObjectRef<K> {
        let (namespace, name) = self.parts();
        let reference = ObjectRef::new(name);
        if namespace.is_empty() {
            reference
        } else {
            reference.within(namespace)
        }
    }
}

/// A packed object could not be read back (it was written by [`deflate`]: a bug).
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// The deflated body is damaged.
    #[error("inflating a cached object: {0:?}")]
    Inflate(miniz_oxide::inflate::TINFLStatus),
    /// The JSON inside does not read as the kind.
    #[error("reading a cached object: {0}")]
    Json(#[from] serde_json::Error),
}

/// `input` deflated (raw deflate, no header) after `dictionary`, without the dictionary's own
/// output: the rest of a stream that [`inflate`] completes. Through one compressor per thread:
/// a compressor's tables take about 250 KiB, allocated once rather than per object.
pub(crate) fn deflate(dictionary: &[u8], input: &[u8]) -> Vec<u8> {
    with_compressor(|compressor| {
        if !dictionary.is_empty() {
            // Flushed to a byte boundary, so what follows starts a byte of its own.
            let (status, _) =
                compress_to_output(compressor, dictionary, TDEFLFlush::Sync, |_| true);
            debug_assert_eq!(status, TDEFLStatus::Okay);
        }
        let mut out = Vec::with_capacity(input.len() / 4);
        let (status, _) = compress_to_output(compressor, input, TDEFLFlush::Finish, |chunk| {
            out.extend_from_slice(chunk);
            true
        });
        debug_assert_eq!(status, TDEFLStatus::Done);
        out
    })
}

/// What [`deflate`] was given, from what it returned: the dictionary's output ([`prefix_of`])
/// and `body` inflated as one stream, the dictionary cut off.
///
/// # Errors
/// When `body` does not inflate after the dictionary (not written by [`deflate`] with it).
pub(crate) fn inflate(dictionary: &'static [u8], body: &[u8]) -> Result<Vec<u8>, UnpackError> {
    let prefix = prefix_of(dictionary);
    let mut stream = Vec::with_capacity(prefix.len() + body.len());
    stream.extend_from_slice(&prefix);
    stream.extend_from_slice(body);
    let mut whole = miniz_oxide::inflate::decompress_to_vec(&stream)
        .map_err(|e| UnpackError::Inflate(e.status))?;
    if !whole.starts_with(dictionary) {
        return Err(UnpackError::Inflate(
            miniz_oxide::inflate::TINFLStatus::Failed,
        ));
    }
    whole.drain(..dictionary.len());
    Ok(whole)
}

/// The dictionary's own output, as [`deflate`] leaves it out: computed once per dictionary (a
/// handful of them, one per kind), not on every read.
fn prefix_of(dictionary: &'static [u8]) -> Arc<[u8]> {
    type Prefixes = Vec<(&'static [u8], Arc<[u8]>)>;
    static PREFIXES: Mutex<Prefixes> = Mutex::new(Vec::new());
    let mut prefixes = PREFIXES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, prefix)) = prefixes
        .iter()
        .find(|(known, _)| std::ptr::eq(*known, dictionary))
    {
        return Arc::clone(prefix);
    }
    let prefix: Arc<[u8]> = with_compressor(|compressor| {
        let mut prefix = Vec::with_capacity(dictionary.len() / 2);
        if !dictionary.is_empty() {
            compress_to_output(compressor, dictionary, TDEFLFlush::Sync, |chunk| {
                prefix.extend_from_slice(chunk);
                true
            });
        }
        prefix
    })
    .into();
    prefixes.push((dictionary, Arc::clone(&prefix)));
    prefix
}

/// Runs `f` with this thread's compressor, reset.
fn with_compressor<T>(f: impl FnOnce(&mut CompressorOxide) -> T) -> T {
    thread_local! {
        static COMPRESSOR: RefCell<Option<Box<CompressorOxide>>> = const { RefCell::new(None) };
    }
    COMPRESSOR.with_borrow_mut(|compressor| {
        let compressor = compressor.get_or_insert_with(|| {
            Box::new(CompressorOxide::new(create_comp_flags_from_zip_params(
                LEVEL, 0, 0,
            )))
        });
        compressor.reset();
        f(compressor)
    })
}

/// The objects of kind `K` in scope, one deflated snapshot each (see the module docs). Cloning
/// shares the cache.
pub struct OwnerCache<K> {
    inner: Arc<RwLock<Entries>>,
    ready: Arc<tokio::sync::watch::Sender<bool>>,
    dictionary: &'static [u8],
    kind: PhantomData<fn() -> K>,
}

impl<K> Clone for OwnerCache<K> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            ready: Arc::clone(&self.ready),
            dictionary: self.dictionary,
            kind: PhantomData,
        }
    }
}

#[derive(Default)]
struct Entries {
    objects: HashMap<Key, Box<[u8]>>,
    /// What a list brought so far, swapped in when it is complete.
    listing: Option<HashMap<Key, Box<[u8]>>>,
}

impl<K> OwnerCache<K>
where
    K: Resource<DynamicType = ()> + Serialize + DeserializeOwned,
{
    /// An empty cache, not ready, whose bodies are deflated after `dictionary`.
    pub fn new(dictionary: &'static str) -> Self {
        Self {
            inner: Arc::default(),
            ready: Arc::new(tokio::sync::watch::Sender::new(false)),
            dictionary: dictionary.as_bytes(),
            kind: PhantomData,
        }
    }

    fn pack(&self, obj: &K) -> Option<Box<[u8]>> {
        match serde_json::to_vec(obj) {
            Ok(json) => Some(deflate(self.dictionary, &json).into_boxed_slice()),
            // Never for the Cluster API kinds (plain data); the object is then missing from
            // the cache, which the reconciles treat as "not seen yet".
            Err(error) => {
                tracing::error!(%error, "An object could not be cached");
                None
            }
        }
    }

    /// Applies one event of the kind's watch, as kube-runtime's reflector does.
    pub fn apply(&self, event: &watcher::Event<K>) {
        let mut entries = self.inner.write().unwrap_or_else(|e| e.into_inner());
        match event {
            watcher::Event::Apply(obj) => {
                if let Some(body) = self.pack(obj) {
                    entries.objects.insert(Key::of_object(obj), body);
                }
            }
            watcher::Event::Delete(obj) => {
                entries.objects.remove(&Key::of_object(obj));
            }
            watcher::Event::Init => entries.listing = Some(HashMap::new()),
            watcher::Event::InitApply(obj) => {
                if let Some(body) = self.pack(obj) {
                    entries
                        .listing
                        .get_or_insert_with(HashMap::new)
                        .insert(Key::of_object(obj), body);
                }
            }
            watcher::Event::InitDone => {
                let mut listed = entries.listing.take().unwrap_or_default();
                listed.shrink_to_fit();
                entries.objects = listed;
                drop(entries);
                self.ready.send_replace(true);
            }
        }
    }

    /// The object `key` names, read back whole.
    pub fn get_key(&self, key: &Key) -> Option<Arc<K>> {
        let entries = self.inner.read().unwrap_or_else(|e| e.into_inner());
        let body = entries.objects.get(key)?;
        match inflate(self.dictionary, body)
            .and_then(|json| serde_json::from_slice::<K>(&json).map_err(UnpackError::from))
        {
            Ok(obj) => Some(Arc::new(obj)),
            Err(error) => {
                tracing::error!(%error, "A cached object could not be read back");
                None
            }
        }
    }

    /// The object `r` names, read back whole.
    pub fn get(&self, r: &ObjectRef<K>) -> Option<Arc<K>> {
        self.get_key(&Key::of(r))
    }

    /// The keys of every object held.
    pub fn keys(&self) -> Vec<Key> {
        let entries = self.inner.read().unwrap_or_else(|e| e.into_inner());
        entries.objects.keys().cloned().collect()
    }

    /// Resolves once the first list is complete.
    pub async fn wait_until_ready(&self) {
        let mut ready = self.ready.subscribe();
        // The sender lives in `self`: never closed while this waits.
        let _ = ready.wait_for(|ready| *ready).await;
    }

    /// Whether the first list is complete.
    pub fn is_ready(&self) -> bool {
        *self.ready.borrow()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::capi::{Cluster, ClusterSpec, ContractRef};
    use futures::FutureExt;

    fn cluster(name: &str, infra: &str) -> Cluster {
        let mut c = Cluster::new(
            name,
            ClusterSpec {
                paused: None,
                infrastructure_ref: Some(ContractRef {
                    api_group: "infrastructure.cluster.x-k8s.io".into(),
                    kind: "MailgunCluster".into(),
                    name: infra.into(),
                }),
            },
        );
        c.metadata.namespace = Some("ns".into());
        c.metadata.uid = Some(format!("uid-{name}"));
        c.metadata.resource_version = Some("1".into());
        c
    }

    const DICTIONARY: &str = r#"{"apiVersion":"cluster.x-k8s.io/v1beta2","kind":"Cluster","#;

    #[test]
    fn keys_name_namespaced_objects_and_read_back() {
        let reference = ObjectRef::<Cluster>::new("a").within("team-a");
        let key = Key::of(&reference);
        assert_eq!(key.parts(), ("team-a", "a"));
        assert_eq!(key.to_ref::<Cluster>(), reference);
    }

    #[test]
    fn a_body_reads_back_only_after_its_dictionary() {
        let text = br#"{"apiVersion":"cluster.x-k8s.io/v1beta2","kind":"Cluster","spec":{}}"#;
        let body = deflate(DICTIONARY.as_bytes(), text);
        assert_eq!(inflate(DICTIONARY.as_bytes(), &body).unwrap(), text);
        assert!(!inflate(b"another dictionary", &body).is_ok_and(|t| t == text));
        assert_eq!(inflate(&[], &deflate(&[], text)).unwrap(), text);
    }

    #[test]
    fn the_cache_applies_a_watch_as_a_reflector_does() {
        use watcher::Event::*;
        let cache = OwnerCache::<Cluster>::new(DICTIONARY);
        assert!(!cache.is_ready());
        assert!(cache.wait_until_ready().now_or_never().is_none());
        cache.apply(&Init);
        cache.apply(&InitApply(cluster("a", "ma")));
        assert!(
            cache.get(&ObjectRef::new("a").within("ns")).is_none(),
            "not before the list is complete"
        );
        cache.apply(&InitDone);
        assert!(cache.is_ready());
        assert!(cache.wait_until_ready().now_or_never().is_some());
        let a = cache.get(&ObjectRef::new("a").within("ns")).unwrap();
        assert_eq!(
            (a.metadata.uid.as_deref(), &a.spec),
            (Some("uid-a"), &cluster("a", "ma").spec)
        );
        cache.apply(&Apply(cluster("b", "mb")));
        cache.apply(&Apply(cluster("a", "ma2")));
        assert_eq!(
            cache.get(&ObjectRef::new("a").within("ns")).unwrap().spec,
            cluster("a", "ma2").spec
        );
        let mut keys = cache.keys();
        keys.sort_by(|x, y| x.parts().cmp(&y.parts()));
        assert_eq!(keys, [Key::new("ns", "a"), Key::new("ns", "b")]);
        cache.apply(&Delete(cluster("a", "ma2")));
        assert!(cache.get(&ObjectRef::new("a").within("ns")).is_none());
        // A re-list: the old contents stay until it is complete, then only the listed remain.
        cache.apply(&Init);
        cache.apply(&InitApply(cluster("c", "mc")));
        assert!(cache.get(&ObjectRef::new("b").within("ns")).is_some());
        cache.apply(&InitDone);
        assert!(cache.get(&ObjectRef::new("b").within("ns")).is_none());
        assert!(cache.get(&ObjectRef::new("c").within("ns")).is_some());
    }
}
