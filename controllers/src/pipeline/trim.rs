//! What the caches keep of each object: the fields the controllers read, nothing else.
//!
//! The watches deserialise [`Slim`] projections: serde reads each object as it arrives and
//! skips what the controllers never read without building it (`managedFields` and the
//! annotations and labels of other controllers are passed over as the parser meets them), so
//! no watch event or list page ever holds a full copy of an object. Kubernetes metadata can be
//! much larger than what a reconcile needs: `managedFields`,
//! `kubectl.kubernetes.io/last-applied-configuration`, other controllers' labels and
//! annotations. What stays ([`Projected::KEEP`]):
//!
//! - our objects: the whole spec and status and every metadata field but `managedFields`
//!   (finalizers are written back whole when ours is removed), with only the annotations in
//!   [`READ_ANNOTATIONS`] and the labels their kind names ([`InfraKind::CACHED_LABELS`]): one
//!   cached copy is one consistent snapshot of everything a reconcile reads;
//! - Cluster API `Cluster`s and `Machine`s (never written): the partial spec and status of
//!   [`crate::capi`], their metadata without `managedFields`, annotations, finalizers and owner
//!   references, and for Machines the `cluster.x-k8s.io/cluster-name` label.
//!
//! How: [`Slim`] hands the kind's own `Deserialize` a deserializer that filters the keys of
//! `metadata` (and of its `annotations` and `labels`) before the kind's code sees them; every
//! other value is read by the kind's own code, unchanged.

use std::{borrow::Cow, collections::BTreeMap, fmt};

use capm_api::{
    names,
    v1beta1::{MailgunCluster, MailgunMachine},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::Resource;
use serde::{
    Deserialize, Deserializer,
    de::{
        self, DeserializeSeed, IgnoredAny, MapAccess, Visitor,
        value::{BorrowedStrDeserializer, StringDeserializer},
    },
    forward_to_deserialize_any,
};

use crate::{
    capi::{Cluster, Machine},
    kinds::InfraKind,
};

/// The annotations a reconcile reads (by key) on our objects.
pub const READ_ANNOTATIONS: [&str; 8] = [
    names::MAIL_ANNOTATION,
    names::DELETION_MAIL_ANNOTATION,
    names::MAIL_INTENT_ANNOTATION,
    names::MAIL_SENT_ANNOTATION,
    names::DELETION_MAIL_INTENT_ANNOTATION,
    names::DELETION_MAIL_SENT_ANNOTATION,
    names::PAUSED_ANNOTATION,
    names::MANAGED_BY_ANNOTATION,
];

/// The labels the controllers read on Cluster API `Machine`s.
const MACHINE_LABELS: [&str; 1] = [names::CLUSTER_NAME_LABEL];

/// What one kind keeps of its metadata (everything else is kept, but `managedFields`).
#[derive(Debug)]
pub struct Keep {
    /// The annotations kept, by key; none kept when empty.
    pub annotations: &'static [&'static str],
    /// The labels kept, by key; none kept when empty.
    pub labels: &'static [&'static str],
    /// Whether `finalizers` and `ownerReferences` are kept (our objects: they are written back).
    pub finalizers_and_owners: bool,
}

/// A kind the caches hold as a [`Slim`] projection.
pub trait Projected: Resource {
    /// What it keeps of its metadata.
    const KEEP: Keep;
    /// A typical object of the kind as the caches pack it (JSON, without name, namespace, UID
    /// and `resourceVersion`): the packed bodies refer back into it, so only what differs from
    /// it takes room ([`super::packed`]). Any text is correct; a closer one packs smaller.
    const DICTIONARY: &'static str;
}

/// The status conditions our kinds write, as the caches see them (see [`Projected::DICTIONARY`]).
macro_rules! conditions_dictionary {
    () => {
        r#""status":{"conditions":[{"lastTransitionTime":"2026-01-01T00:00:00Z","message":"","reason":"NotPaused","status":"False","type":"Paused"},{"lastTransitionTime":"2026-01-01T00:00:00Z","message":"","reason":"MailSent","status":"True","type":"MailSent"},{"lastTransitionTime":"2026-01-01T00:00:00Z","message":"","reason":"DeliveryPending","status":"Unknown","type":"MailDelivered"},{"lastTransitionTime":"2026-01-01T00:00:00Z","message":"","reason":"WaitingForFulfillment","status":"False","type":"Provisioned"},{"lastTransitionTime":"2026-01-01T00:00:00Z","message":"","reason":"WaitingForFulfillment","status":"False","type":"Ready"}],"observedGeneration":1,"initialization":{"provisioned":true},"mail":{"messageID":"<mailguncluster.00000000-0000-4000-8000-000000000000@","state":"Sent","sentAt":"2026-01-01T00:00:00Z","deliveredAt":"","failure":""}}}Delivered DeliveryDelayed DeliveryFailed PartlyDelivered DeliveryUnknown NotTrackable DeletionMailSent OwnerMismatch OwnerDeleting WaitingForOwner WaitingForClusterInfrastructure WaitingForBootstrapData MailPending MailFailed Deleting InvalidSpec IdentityNotFound"#
    };
}

impl Projected for MailgunCluster {
    const KEEP: Keep = Keep {
        annotations: &READ_ANNOTATIONS,
        labels: <Self as InfraKind>::CACHED_LABELS,
        finalizers_and_owners: true,
    };
    const DICTIONARY: &'static str = concat!(
        r#"{"apiVersion":"infrastructure.cluster.x-k8s.io/v1beta1","kind":"MailgunCluster","metadata":{"annotations":{"mailgun.infrastructure.cluster.x-k8s.io/mail":"{\"at\":\"2026-01-01T00:00:00Z\",\"messageId\":\"<mailguncluster.00000000-0000-4000-8000-000000000000@\",\"state\":\"sent\"}"},"creationTimestamp":"2026-01-01T00:00:00Z","finalizers":["mailguncluster.infrastructure.cluster.x-k8s.io"],"generation":1,"ownerReferences":[{"apiVersion":"cluster.x-k8s.io/v1beta2","blockOwnerDeletion":true,"controller":true,"kind":"Cluster","name":"","uid":"00000000-0000-4000-9000-000000000000"}]},"spec":{"priority":"Urgent","request":"One cluster please.","requester":"@example.com","controlPlaneEndpoint":{"host":"","port":6443},"identityRef":{"name":""}},"#,
        conditions_dictionary!()
    );
}

impl Projected for MailgunMachine {
    const KEEP: Keep = Keep {
        annotations: &READ_ANNOTATIONS,
        labels: <Self as InfraKind>::CACHED_LABELS,
        finalizers_and_owners: true,
    };
    const DICTIONARY: &'static str = concat!(
        r#"{"apiVersion":"infrastructure.cluster.x-k8s.io/v1beta1","kind":"MailgunMachine","metadata":{"annotations":{"mailgun.infrastructure.cluster.x-k8s.io/mail":"{\"at\":\"2026-01-01T00:00:00Z\",\"messageId\":\"<mailgunmachine.00000000-0000-4000-8000-000000000000@\",\"state\":\"sent\"}"},"creationTimestamp":"2026-01-01T00:00:00Z","finalizers":["mailgunmachine.infrastructure.cluster.x-k8s.io"],"generation":1,"ownerReferences":[{"apiVersion":"cluster.x-k8s.io/v1beta2","blockOwnerDeletion":true,"controller":true,"kind":"Machine","name":"","uid":"00000000-0000-4000-9000-000000000000"}]},"spec":{"priority":"Urgent","request":"One machine please.","requester":"@example.com","providerID":"","failureDomain":"","addresses":[{"type":"InternalIP","address":""}]},"#,
        conditions_dictionary!()
    );
}

impl Projected for Cluster {
    const KEEP: Keep = Keep {
        annotations: &[],
        labels: &[],
        finalizers_and_owners: false,
    };
    const DICTIONARY: &'static str = r#"{"apiVersion":"cluster.x-k8s.io/v1beta2","kind":"Cluster","metadata":{"creationTimestamp":"2026-01-01T00:00:00Z","generation":1,"name":"","namespace":"","resourceVersion":"","uid":"00000000-0000-4000-9000-000000000000"},"spec":{"paused":null,"infrastructureRef":{"apiGroup":"infrastructure.cluster.x-k8s.io","kind":"MailgunCluster","name":""}},"status":{"initialization":{"infrastructureProvisioned":true}}}"#;
}

impl Projected for Machine {
    const KEEP: Keep = Keep {
        annotations: &[],
        labels: &MACHINE_LABELS,
        finalizers_and_owners: false,
    };
    const DICTIONARY: &'static str = r#"{"apiVersion":"cluster.x-k8s.io/v1beta2","kind":"Machine","metadata":{"creationTimestamp":"2026-01-01T00:00:00Z","generation":1,"labels":{"cluster.x-k8s.io/cluster-name":""},"name":"","namespace":"","resourceVersion":"","uid":"00000000-0000-4000-9000-000000000000"},"spec":{"clusterName":"","bootstrap":{"dataSecretName":""},"failureDomain":null,"infrastructureRef":{"apiGroup":"infrastructure.cluster.x-k8s.io","kind":"MailgunMachine","name":""}}}"#;
}

/// An object read as its kind's projection: what the watches deserialise and the caches hold.
///
/// A `Resource` like its kind (same group, version, kind and plural), so `Api<Slim<K>>` lists
/// and watches `K`'s endpoints; `.0` is the projected object.
#[derive(Clone, Debug)]
pub struct Slim<K>(pub K);

impl<K: Resource> Resource for Slim<K> {
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
        self.0.meta()
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        self.0.meta_mut()
    }
}

impl<'de, K> Deserialize<'de> for Slim<K>
where
    K: Projected + Deserialize<'de>,
{
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut obj = K::deserialize(Filtered {
            inner: deserializer,
            level: Level::Object,
            keep: &K::KEEP,
        })?;
        let meta = obj.meta_mut();
        // An object whose every annotation (label) was another controller's has none.
        for map in [&mut meta.annotations, &mut meta.labels] {
            if map.as_ref().is_some_and(BTreeMap::is_empty) {
                *map = None;
            }
        }
        Ok(Slim(obj))
    }
}

/// Where in the object a [`Filtered`] deserializer reads.
#[derive(Clone, Copy)]
enum Level {
    /// The object: `metadata` is filtered, the rest is read as is.
    Object,
    /// `metadata`: keys dropped or filtered by [`Keep`].
    Meta,
    /// A string map (annotations, labels): only these keys.
    Only(&'static [&'static str]),
}

/// What to do with a key met at a [`Level`].
enum Decision {
    /// Pass over the key and its value unread.
    Skip,
    /// Hand the key to the kind's code; its value read at this level (`None`: unfiltered).
    Pass(Option<Level>),
}

impl Level {
    fn decide(self, key: &str, keep: &Keep) -> Decision {
        match self {
            Level::Object if key == "metadata" => Decision::Pass(Some(Level::Meta)),
            Level::Object => Decision::Pass(None),
            Level::Meta => match key {
                "managedFields" => Decision::Skip,
                "annotations" | "labels" => {
                    let only = if key == "annotations" {
                        keep.annotations
                    } else {
                        keep.labels
                    };
                    if only.is_empty() {
                        Decision::Skip
                    } else {
                        Decision::Pass(Some(Level::Only(only)))
                    }
                }
                "finalizers" | "ownerReferences" if !keep.finalizers_and_owners => Decision::Skip,
                _ => Decision::Pass(None),
            },
            Level::Only(only) if only.contains(&key) => Decision::Pass(None),
            Level::Only(_) => Decision::Skip,
        }
    }
}

/// A deserializer that filters the map it reads at its [`Level`] before the reader sees it.
struct Filtered<D> {
    inner: D,
    level: Level,
    keep: &'static Keep,
}

impl<D> Filtered<D> {
    fn wrap<V>(&self, visitor: V) -> FilterVisitor<V> {
        FilterVisitor {
            inner: visitor,
            level: self.level,
            keep: self.keep,
        }
    }
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Filtered<D> {
    type Error = D::Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        let visitor = self.wrap(visitor);
        self.inner.deserialize_any(visitor)
    }
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        let visitor = self.wrap(visitor);
        self.inner.deserialize_struct(name, fields, visitor)
    }
    fn deserialize_map<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        let visitor = self.wrap(visitor);
        self.inner.deserialize_map(visitor)
    }
    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
        let visitor = self.wrap(visitor);
        self.inner.deserialize_option(visitor)
    }

    forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct newtype_struct seq tuple tuple_struct enum identifier ignored_any
    }
}

/// The reader's visitor, handed a filtered map.
struct FilterVisitor<V> {
    inner: V,
    level: Level,
    keep: &'static Keep,
}

impl<'de, V: Visitor<'de>> Visitor<'de> for FilterVisitor<V> {
    type Value = V::Value;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.inner.expecting(f)
    }
    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.inner.visit_map(FilterMap {
            inner: map,
            level: self.level,
            keep: self.keep,
            value_level: None,
        })
    }
    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<V::Value, D::Error> {
        self.inner.visit_some(Filtered {
            inner: deserializer,
            level: self.level,
            keep: self.keep,
        })
    }
    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_none()
    }
    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.inner.visit_unit()
    }
}

/// A map whose skipped entries the reader never sees.
struct FilterMap<A> {
    inner: A,
    level: Level,
    keep: &'static Keep,
    /// How the value of the key just handed out is read.
    value_level: Option<Level>,
}

/// A map key, borrowed from the input when it can be.
enum Key<'de> {
    Borrowed(&'de str),
    Owned(String),
}

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string key")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key::Borrowed(v))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key::Owned(v.to_owned()))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key::Owned(v))
            }
        }
        deserializer.deserialize_str(KeyVisitor)
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for FilterMap<A> {
    type Error = A::Error;

    fn next_key_seed<S: DeserializeSeed<'de>>(
        &mut self,
        seed: S,
    ) -> Result<Option<S::Value>, A::Error> {
        loop {
            let Some(key) = self.inner.next_key::<Key<'de>>()? else {
                return Ok(None);
            };
            let text = match &key {
                Key::Borrowed(k) => k,
                Key::Owned(k) => k.as_str(),
            };
            match self.level.decide(text, self.keep) {
                Decision::Skip => {
                    self.inner.next_value::<IgnoredAny>()?;
                }
                Decision::Pass(value_level) => {
                    self.value_level = value_level;
                    return match key {
                        Key::Borrowed(k) => seed.deserialize(BorrowedStrDeserializer::new(k)),
                        Key::Owned(k) => seed.deserialize(StringDeserializer::new(k)),
                    }
                    .map(Some);
                }
            }
        }
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, A::Error> {
        match self.value_level.take() {
            Some(level) => self.inner.next_value_seed(FilteredSeed {
                inner: seed,
                level,
                keep: self.keep,
            }),
            None => self.inner.next_value_seed(seed),
        }
    }
}

/// The reader's seed for a value read at a filtering [`Level`].
struct FilteredSeed<S> {
    inner: S,
    level: Level,
    keep: &'static Keep,
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for FilteredSeed<S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<S::Value, D::Error> {
        self.inner.deserialize(Filtered {
            inner: deserializer,
            level: self.level,
            keep: self.keep,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, OwnerReference};
    use kube::core::{ObjectList, WatchEvent};
    use serde_json::{Value, json};

    fn meta() -> ObjectMeta {
        ObjectMeta {
            name: Some("a".into()),
            namespace: Some("ns".into()),
            uid: Some("u".into()),
            resource_version: Some("7".into()),
            generation: Some(2),
            finalizers: Some(vec![
                "other/finalizer".into(),
                names::CLUSTER_FINALIZER.into(),
            ]),
            owner_references: Some(vec![OwnerReference {
                api_version: "cluster.x-k8s.io/v1beta2".into(),
                kind: "Cluster".into(),
                name: "a".into(),
                uid: "c".into(),
                ..OwnerReference::default()
            }]),
            annotations: Some(
                [
                    (names::MAIL_INTENT_ANNOTATION, "<id>"),
                    (names::PAUSED_ANNOTATION, ""),
                    (names::CONVERSION_DATA_ANNOTATION, "{}"),
                    ("kubectl.kubernetes.io/last-applied-configuration", "{...}"),
                ]
                .into_iter()
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect(),
            ),
            labels: Some(
                [(names::CLUSTER_NAME_LABEL, "c"), ("team", "x")]
                    .into_iter()
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect(),
            ),
            managed_fields: Some(vec![ManagedFieldsEntry {
                manager: Some("kubectl".into()),
                ..ManagedFieldsEntry::default()
            }]),
            ..ObjectMeta::default()
        }
    }

    fn object(kind: &str) -> Value {
        json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
            "kind": kind,
            "metadata": meta(),
            "spec": { "priority": "Urgent", "request": "r", "requester": "a@example.com" },
            "status": { "mail": { "messageID": "<a@b>", "state": "Sent" } },
        })
    }

    /// Parses `value` as JSON text, as the watches do (keys borrowed from the input).
    fn slim<K: Projected + serde::de::DeserializeOwned>(value: &Value) -> K {
        let text = serde_json::to_vec(value).expect("serialisable");
        serde_json::from_slice::<Slim<K>>(&text)
            .expect("valid object")
            .0
    }

    fn keys(map: Option<&BTreeMap<String, String>>) -> Vec<&str> {
        map.into_iter().flatten().map(|(k, _)| k.as_str()).collect()
    }

    #[test]
    fn our_objects_keep_what_a_reconcile_reads() {
        let full: MailgunCluster = serde_json::from_value(object("MailgunCluster")).unwrap();
        let mgc: MailgunCluster = slim(&object("MailgunCluster"));
        assert_eq!(mgc.spec, full.spec);
        assert_eq!(mgc.status, full.status, "the status stays with its object");
        let m = &mgc.metadata;
        assert_eq!(m.managed_fields, None);
        assert_eq!(
            keys(m.annotations.as_ref()),
            [names::PAUSED_ANNOTATION, names::MAIL_INTENT_ANNOTATION]
        );
        assert_eq!(
            m.annotations.as_ref().unwrap()[names::MAIL_INTENT_ANNOTATION],
            "<id>"
        );
        assert_eq!(m.labels, None, "no label of a MailgunCluster is read");
        assert_eq!(m.finalizers, meta().finalizers);
        assert_eq!(m.owner_references, meta().owner_references);
        let expected = meta();
        assert_eq!(
            (
                &m.name,
                &m.namespace,
                &m.uid,
                &m.resource_version,
                m.generation
            ),
            (
                &expected.name,
                &expected.namespace,
                &expected.uid,
                &expected.resource_version,
                Some(2)
            )
        );

        let mgm: MailgunMachine = slim(&object("MailgunMachine"));
        let labels: Vec<_> = mgm.metadata.labels.iter().flatten().collect();
        assert_eq!(
            labels,
            [(&names::CLUSTER_NAME_LABEL.to_owned(), &"c".to_owned())]
        );
    }

    #[test]
    fn cluster_api_objects_keep_names_and_the_cluster_label() {
        let mut value = object("Cluster");
        value["apiVersion"] = "cluster.x-k8s.io/v1beta2".into();
        value["spec"] = json!({ "paused": true, "topology": { "class": "big" } });
        let cluster: Cluster = slim(&value);
        let m = &cluster.metadata;
        assert_eq!(
            (&m.annotations, &m.labels, &m.finalizers, &m.managed_fields),
            (&None, &None, &None, &None)
        );
        assert_eq!(m.owner_references, None);
        assert_eq!(
            (m.name.as_deref(), cluster.spec.paused),
            (Some("a"), Some(true))
        );

        value["kind"] = "Machine".into();
        value["spec"] = json!({ "clusterName": "c" });
        let machine: Machine = slim(&value);
        assert_eq!(machine.cluster_name().as_deref(), Some("c"));
        assert_eq!(machine.metadata.labels.as_ref().map(BTreeMap::len), Some(1));
    }

    #[test]
    fn only_foreign_annotations_leave_none() {
        let mut value = object("MailgunCluster");
        value["metadata"]["annotations"] = json!({ "someone.else/x": "1" });
        let mgc: MailgunCluster = slim(&value);
        assert_eq!(mgc.metadata.annotations, None);
        value["metadata"]["annotations"] = Value::Null;
        let mgc: MailgunCluster = slim(&value);
        assert_eq!(mgc.metadata.annotations, None);
    }

    #[test]
    fn keys_that_cannot_be_borrowed_and_values_read_from_a_tree_are_filtered_alike() {
        // An escaped key is handed over owned; `from_value` hands every key owned.
        let text = serde_json::to_string(&object("MailgunCluster"))
            .unwrap()
            .replace("\"managedFields\"", "\"managed\\u0046ields\"")
            .replace("\"kubectl.kubernetes.io", "\"kubectl\\u002ekubernetes.io");
        let escaped = serde_json::from_str::<Slim<MailgunCluster>>(&text)
            .unwrap()
            .0;
        let owned = serde_json::from_value::<Slim<MailgunCluster>>(object("MailgunCluster"))
            .unwrap()
            .0;
        let borrowed: MailgunCluster = slim(&object("MailgunCluster"));
        for mgc in [&escaped, &owned] {
            assert_eq!(mgc.metadata, borrowed.metadata);
            assert_eq!(mgc.spec, borrowed.spec);
        }
    }

    #[test]
    fn list_pages_and_watch_events_are_read_through_the_projection() {
        let list = json!({
            "apiVersion": "v1", "kind": "List",
            "metadata": { "resourceVersion": "9" },
            "items": [object("MailgunCluster"), object("MailgunCluster")],
        });
        let page: ObjectList<Slim<MailgunCluster>> =
            serde_json::from_slice(&serde_json::to_vec(&list).unwrap()).unwrap();
        assert_eq!(page.items.len(), 2);
        assert!(
            page.items
                .iter()
                .all(|o| o.0.metadata.managed_fields.is_none())
        );

        // "object" before "type": serde buffers the object before it knows the variant.
        let text = format!(
            r#"{{"object":{},"type":"MODIFIED"}}"#,
            serde_json::to_string(&object("MailgunCluster")).unwrap()
        );
        let WatchEvent::Modified(obj) =
            serde_json::from_str::<WatchEvent<Slim<MailgunCluster>>>(&text).unwrap()
        else {
            panic!("a modification");
        };
        assert_eq!(obj.0.metadata.managed_fields, None);
        assert_eq!(keys(obj.0.metadata.annotations.as_ref()).len(), 2);
    }

    #[test]
    fn a_projection_is_its_kinds_resource() {
        assert_eq!(
            (
                Slim::<MailgunCluster>::kind(&()),
                Slim::<MailgunCluster>::plural(&()),
                Slim::<MailgunCluster>::api_version(&())
            ),
            (
                MailgunCluster::kind(&()),
                MailgunCluster::plural(&()),
                MailgunCluster::api_version(&())
            )
        );
    }
}
