//! Our objects as the caches hold them: one store entry per object, its projection deflated.
//!
//! kube-runtime's reflector store keeps an `Arc` of each object it is handed. For our kinds that
//! object is a [`Packed`]: in the clear, what the pipeline reads without a reconcile (name,
//! namespace, UID, `resourceVersion`, and the labels its kind's triggers read), and the rest of
//! the [`Slim`] projection as one deflated JSON document, read back whole when a reconcile takes
//! the object ([`Packed::unpack`]). One entry is one watch event's object: spec, finalizers,
//! `resourceVersion` and status always come from the same snapshot, and nothing of it is kept
//! anywhere else.
//!
//! Why: as typed objects the caches spent most of their memory on the shape, not the content: a
//! finished `MailgunCluster` (about 1 400 bytes of JSON without `managedFields`) took about
//! 2 900 bytes as a `MailgunCluster` (a 360-byte `ObjectMeta` of empty options, a B-tree node of
//! 544 bytes for one annotation, five conditions of 128 bytes and their strings as separate
//! allocations). Deflated alone, the projection took about 600 bytes. Deflated after its kind's
//! [`Projected::DICTIONARY`] (a typical object: field names, condition words, our annotations'
//! keys), the body holds only what differs from it: about 200 bytes. The dictionary is passed
//! through the same compressor first and its output, always the same, is left out of the body
//! and put back before inflating ([`deflate`], [`inflate`]): deflate's preset dictionary, which
//! `miniz_oxide` does not offer, from a sync flush. Reading an object back costs a few
//! microseconds per reconcile, against milliseconds for each request the reconcile makes.

use std::{borrow::Cow, fmt, marker::PhantomData};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::{Resource, runtime::reflector::ObjectRef};
use serde::{Deserialize, Deserializer, Serialize, de::DeserializeOwned};

use super::trim::{Projected, Slim};
use crate::compact::{UnpackError, deflate, inflate};

/// One object of kind `K` as a cache keeps it (see the module docs).
///
/// A `Resource` like its kind, so `Api<Packed<K>>` lists and watches `K`'s endpoints and a
/// reflector store keys it by name and namespace; its metadata holds only what stays in the
/// clear.
pub struct Packed<K> {
    /// Name, namespace, UID, `resourceVersion`; the labels the kind's triggers read.
    meta: ObjectMeta,
    /// The rest of the projection: JSON, deflated.
    body: Box<[u8]>,
    kind: PhantomData<fn() -> K>,
}

impl<K> Clone for Packed<K> {
    fn clone(&self) -> Self {
        Self {
            meta: self.meta.clone(),
            body: self.body.clone(),
            kind: PhantomData,
        }
    }
}

impl<K> fmt::Debug for Packed<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Packed")
            .field("namespace", &self.meta.namespace)
            .field("name", &self.meta.name)
            .field("resource_version", &self.meta.resource_version)
            .field("packed_bytes", &self.body.len())
            .finish()
    }
}

impl<K: Projected + Serialize + DeserializeOwned> Packed<K> {
    /// Packs `obj` (a projection: [`Slim`]).
    ///
    /// # Errors
    /// When `obj` cannot be written as JSON (never for our kinds).
    pub fn pack(mut obj: K) -> Result<Self, serde_json::Error> {
        let all = obj.meta_mut();
        let meta = ObjectMeta {
            name: all.name.take(),
            namespace: all.namespace.take(),
            uid: all.uid.take(),
            resource_version: all.resource_version.take(),
            labels: if K::KEEP.labels.is_empty() {
                None
            } else {
                all.labels.take()
            },
            ..ObjectMeta::default()
        };
        let json = serde_json::to_vec(&obj)?;
        Ok(Self {
            meta,
            body: deflate(K::DICTIONARY.as_bytes(), &json).into_boxed_slice(),
            kind: PhantomData,
        })
    }

    /// The object, whole, as it was packed.
    ///
    /// # Errors
    /// When the body does not read back (a bug: it was written by [`Self::pack`]).
    pub fn unpack(&self) -> Result<K, UnpackError> {
        let json = inflate(K::DICTIONARY.as_bytes(), &self.body)?;
        let mut obj: K = serde_json::from_slice(&json)?;
        let all = obj.meta_mut();
        all.name.clone_from(&self.meta.name);
        all.namespace.clone_from(&self.meta.namespace);
        all.uid.clone_from(&self.meta.uid);
        all.resource_version.clone_from(&self.meta.resource_version);
        if !K::KEEP.labels.is_empty() {
            all.labels.clone_from(&self.meta.labels);
        }
        Ok(obj)
    }

    /// Bytes of the deflated body (what the entry holds beyond its identity).
    pub fn packed_len(&self) -> usize {
        self.body.len()
    }
}

/// The reference to the object `r` names, by name and namespace only, as the pipeline queues it:
/// a reconcile reads the store's copy, so the UID and `resourceVersion` kube's `ObjectRef` may
/// carry are not needed, and queued references can be many (a list of thousands waits in the
/// scheduler; the sync walk holds one per object for a whole period).
pub(crate) fn by_name<F: Resource, T: Resource<DynamicType = ()>>(
    r: &ObjectRef<F>,
) -> ObjectRef<T> {
    let mut reference = ObjectRef::new(&r.name);
    reference.namespace.clone_from(&r.namespace);
    reference
}

impl<K: Resource> Resource for Packed<K> {
    type DynamicType = K::DynamicType;
    type Scope = K::Scope;

    fn kind(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::kind(dt)
    }
    fn group(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::group(dt)
    }
    fn version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::version(dt)
    }
    fn api_version(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::api_version(dt)
    }
    fn plural(dt: &Self::DynamicType) -> Cow<'_, str> {
        K::plural(dt)
    }
    fn meta(&self) -> &ObjectMeta {
        &self.meta
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.meta
    }
}

impl<'de, K> Deserialize<'de> for Packed<K>
where
    K: Projected + Serialize + DeserializeOwned,
{
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let Slim(obj) = Slim::<K>::deserialize(deserializer)?;
        Packed::pack(obj).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capm_api::{
        names,
        v1beta1::{MailgunCluster, MailgunMachine},
    };
    use kube::ResourceExt;
    use serde_json::json;

    fn finished() -> serde_json::Value {
        let condition = |type_: &str, status: &str, reason: &str| {
            json!({ "lastTransitionTime": "2026-11-23T19:36:55Z", "message": "",
                "reason": reason, "status": status, "type": type_ })
        };
        json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
            "kind": "MailgunCluster",
            "metadata": {
                "annotations": {
                    names::MAIL_ANNOTATION: r#"{"at":"2026-11-23T19:00:00Z","messageId":"<m@x>","state":"sent"}"#,
                    "kubectl.kubernetes.io/last-applied-configuration": "{}",
                },
                "labels": { names::CLUSTER_NAME_LABEL: "c" },
                "creationTimestamp": "2026-11-23T19:36:55Z",
                "deletionTimestamp": "2026-11-23T19:40:00Z",
                "finalizers": [names::CLUSTER_FINALIZER],
                "generation": 3,
                "managedFields": [{ "manager": "kubectl" }],
                "name": "a", "namespace": "ns",
                "ownerReferences": [{ "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
                    "name": "a", "uid": "c", "controller": true }],
                "resourceVersion": "42", "uid": "u",
            },
            "spec": { "priority": "Urgent", "request": "r", "requester": "a@example.com" },
            "status": {
                "conditions": [condition("Paused", "False", "NotPaused"),
                    condition("Ready", "False", "WaitingForFulfillment")],
                "mail": { "messageID": "<m@x>", "sentAt": "2026-11-23T19:36:55Z", "state": "Sent" },
                "observedGeneration": 3,
            },
        })
    }

    #[test]
    fn an_object_unpacks_as_its_projection() {
        let text = serde_json::to_vec(&finished()).unwrap();
        let packed: Packed<MailgunCluster> = serde_json::from_slice(&text).unwrap();
        let slim = serde_json::from_slice::<Slim<MailgunCluster>>(&text)
            .unwrap()
            .0;
        assert_eq!(packed.unpack().unwrap(), slim);
        // In the clear: the identity only.
        assert_eq!(
            (
                packed.name_any(),
                packed.namespace(),
                packed.uid(),
                packed.resource_version()
            ),
            (
                "a".to_owned(),
                Some("ns".to_owned()),
                Some("u".to_owned()),
                Some("42".to_owned())
            )
        );
        assert_eq!(packed.meta().annotations, None);
        assert_eq!(packed.meta().finalizers, None);
        assert!(
            packed.packed_len() < text.len() / 4,
            "{}",
            packed.packed_len()
        );
    }

    #[test]
    fn a_body_is_smaller_after_the_dictionary_and_reads_back_only_with_it() {
        // The body as `pack` writes it: the projection without its identity.
        let full = serde_json::to_vec(&finished()).unwrap();
        let mut slim = serde_json::from_slice::<Slim<MailgunCluster>>(&full)
            .unwrap()
            .0;
        let meta = slim.meta_mut();
        (meta.name, meta.namespace, meta.uid, meta.resource_version) = (None, None, None, None);
        let text = serde_json::to_vec(&slim).unwrap();
        let dictionary = MailgunCluster::DICTIONARY.as_bytes();
        let alone = deflate(&[], &text);
        let after = deflate(dictionary, &text);
        assert!(
            after.len() * 2 < alone.len(),
            "{} bytes after the dictionary, {} alone",
            after.len(),
            alone.len()
        );
        assert_eq!(inflate(dictionary, &after).unwrap(), text);
        assert_eq!(inflate(&[], &alone).unwrap(), text);
        assert!(
            !inflate(&[], &after).is_ok_and(|t| t == text),
            "the body alone is not the object"
        );
    }

    #[test]
    fn a_machine_keeps_its_cluster_label_in_the_clear() {
        let mut value = finished();
        value["kind"] = "MailgunMachine".into();
        value["spec"] =
            json!({ "priority": "Urgent", "request": "r", "requester": "a@example.com" });
        value["status"] = json!({});
        let text = serde_json::to_vec(&value).unwrap();
        let packed: Packed<MailgunMachine> = serde_json::from_slice(&text).unwrap();
        assert_eq!(
            packed
                .labels()
                .get(names::CLUSTER_NAME_LABEL)
                .map(String::as_str),
            Some("c")
        );
        let slim = serde_json::from_slice::<Slim<MailgunMachine>>(&text)
            .unwrap()
            .0;
        assert_eq!(packed.unpack().unwrap(), slim);
    }

    #[test]
    fn the_compressor_is_reused_without_mixing_objects() {
        let mut value = finished();
        let mut packed = Vec::new();
        for i in 0..3 {
            value["spec"]["request"] = format!("request {i}").into();
            let text = serde_json::to_vec(&value).unwrap();
            packed.push(serde_json::from_slice::<Packed<MailgunCluster>>(&text).unwrap());
        }
        for (i, p) in packed.iter().enumerate() {
            assert_eq!(p.unpack().unwrap().spec.request, format!("request {i}"));
        }
    }

    #[test]
    fn a_packed_object_is_its_kinds_resource() {
        assert_eq!(
            (
                Packed::<MailgunCluster>::kind(&()),
                Packed::<MailgunCluster>::plural(&()),
                Packed::<MailgunCluster>::api_version(&())
            ),
            (
                MailgunCluster::kind(&()),
                MailgunCluster::plural(&()),
                MailgunCluster::api_version(&())
            )
        );
    }
}
