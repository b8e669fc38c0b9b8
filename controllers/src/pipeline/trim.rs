//! What the caches keep of each object: the fields the controllers read, nothing else.
//!
//! Objects are trimmed on their way from the watch into the reflector stores, so every cached
//! copy (and every copy handed to a reconcile) is already small. Kubernetes metadata can be much
//! larger than what a reconcile needs: `managedFields`, `kubectl.kubernetes.io/last-applied-configuration`,
//! labels and annotations of other controllers. What stays:
//!
//! - our objects: name, namespace, UID, `resourceVersion`, generation, deletion timestamp,
//!   finalizers (written back whole when ours is removed), owner references, spec, status, the
//!   annotations in [`READ_ANNOTATIONS`] and the labels their kind names
//!   ([`InfraKind::CACHED_LABELS`]): one cached copy is one consistent snapshot of everything a
//!   reconcile reads;
//! - Cluster API `Cluster`s and `Machine`s (never written): name, namespace, UID,
//!   `resourceVersion`, generation, the partial spec and status of [`crate::capi`], and for
//!   Machines the `cluster.x-k8s.io/cluster-name` label.

use std::collections::BTreeMap;

use capm_api::names;
use kube::Resource;

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

fn retain_keys(map: &mut Option<BTreeMap<String, String>>, keep: &[&str]) {
    if let Some(m) = map {
        m.retain(|k, _| keep.contains(&k.as_str()));
        if m.is_empty() {
            *map = None;
        }
    }
}

/// Trims one of our objects before it enters the cache.
pub fn ours<K: InfraKind>(obj: &mut K) {
    let meta = obj.meta_mut();
    meta.managed_fields = None;
    retain_keys(&mut meta.annotations, &READ_ANNOTATIONS);
    retain_keys(&mut meta.labels, K::CACHED_LABELS);
}

fn trim_capi_meta(
    meta: &mut k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta,
    labels: &[&str],
) {
    meta.managed_fields = None;
    meta.annotations = None;
    meta.finalizers = None;
    meta.owner_references = None;
    retain_keys(&mut meta.labels, labels);
}

/// Trims a Cluster API `Cluster` before it enters the cache.
pub fn cluster(cluster: &mut Cluster) {
    trim_capi_meta(cluster.meta_mut(), &[]);
}

/// Trims a Cluster API `Machine` before it enters the cache.
pub fn machine(machine: &mut Machine) {
    trim_capi_meta(machine.meta_mut(), &MACHINE_LABELS);
}

#[cfg(test)]
mod tests {
    use super::*;
    use capm_api::v1beta1::{MailgunCluster, MailgunMachine};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ManagedFieldsEntry, ObjectMeta};

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
            managed_fields: Some(vec![ManagedFieldsEntry::default()]),
            ..ObjectMeta::default()
        }
    }

    fn json<T: serde::de::DeserializeOwned>(kind: &str) -> T {
        serde_json::from_value(serde_json::json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
            "kind": kind,
            "metadata": meta(),
            "spec": { "priority": "Urgent", "request": "r", "requester": "a@example.com" },
            "status": { "mail": { "messageID": "<a@b>", "state": "Sent" } },
        }))
        .expect("valid object")
    }

    #[test]
    fn our_objects_keep_what_a_reconcile_reads() {
        let mut mgc: MailgunCluster = json("MailgunCluster");
        let spec = mgc.spec.clone();
        let status = mgc.status.clone();
        ours(&mut mgc);
        assert_eq!(mgc.status, status, "the status stays with its object");
        let m = &mgc.metadata;
        assert_eq!(m.managed_fields, None);
        let annotations: Vec<_> = m.annotations.iter().flatten().map(|(k, _)| k).collect();
        assert_eq!(
            annotations,
            [names::PAUSED_ANNOTATION, names::MAIL_INTENT_ANNOTATION]
        );
        assert_eq!(m.labels, None);
        assert_eq!(m.finalizers, meta().finalizers);
        assert_eq!(
            (
                &m.name,
                &m.namespace,
                &m.uid,
                &m.resource_version,
                m.generation
            ),
            (
                &meta().name,
                &meta().namespace,
                &meta().uid,
                &meta().resource_version,
                Some(2)
            )
        );
        assert_eq!(mgc.spec, spec);

        let mut mgm: MailgunMachine = json("MailgunMachine");
        ours(&mut mgm);
        let labels: Vec<_> = mgm.metadata.labels.iter().flatten().collect();
        assert_eq!(
            labels,
            [(&names::CLUSTER_NAME_LABEL.to_owned(), &"c".to_owned())]
        );
    }

    #[test]
    fn cluster_api_objects_keep_names_and_the_cluster_label() {
        let mut cluster = Cluster::new("a", Default::default());
        cluster.metadata = meta();
        super::cluster(&mut cluster);
        let m = &cluster.metadata;
        assert_eq!(
            (&m.annotations, &m.labels, &m.finalizers, &m.managed_fields),
            (&None, &None, &None, &None)
        );
        assert_eq!(m.name.as_deref(), Some("a"));

        let mut machine = Machine::new("m", Default::default());
        machine.metadata = meta();
        super::machine(&mut machine);
        assert_eq!(machine.cluster_name().as_deref(), Some("c"));
        assert_eq!(machine.metadata.labels.as_ref().map(BTreeMap::len), Some(1));
    }
}
