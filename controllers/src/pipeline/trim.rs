//! What the caches keep of each object: what the controllers read. Each watch trims its objects
//! as they arrive (`WatchStreamExt::modify`), as controller-runtime's
//! `TransformStripManagedFields` does and more: no `managedFields` anywhere; our objects keep
//! only the annotations in [`READ_ANNOTATIONS`] and their kind's labels (finalizers and owner
//! references stay: they are written back); the Cluster API objects, partial types read and never
//! written, keep no finalizers or owner references, and of their annotations and labels only
//! a Machine's `cluster.x-k8s.io/remediate-machine` and `cluster.x-k8s.io/cluster-name`.

use std::collections::BTreeMap;

use capm_api::{
    capi::{Cluster, Machine, MachineHealthCheck, REMEDIATION_ALLOWED},
    names,
    v1beta1::MailgunClusterIdentity,
};
use k8s_openapi::{api::core::v1::Secret, apimachinery::pkg::apis::meta::v1::ObjectMeta};
use kube::Resource;

use crate::kinds::Mailed;

/// The annotations a reconcile reads (by key) on our objects.
pub const READ_ANNOTATIONS: [&str; 12] = [
    names::MAIL_ANNOTATION,
    names::REMINDER_MAIL_ANNOTATIONS[0],
    names::REMINDER_MAIL_ANNOTATIONS[1],
    names::REMINDER_MAIL_ANNOTATIONS[2],
    names::DELETION_MAIL_ANNOTATION,
    names::MAIL_INTENT_ANNOTATION,
    names::MAIL_SENT_ANNOTATION,
    names::DELETION_MAIL_INTENT_ANNOTATION,
    names::DELETION_MAIL_SENT_ANNOTATION,
    names::PAUSED_ANNOTATION,
    names::MANAGED_BY_ANNOTATION,
    names::RETRY_ANNOTATION,
];

/// One of our objects as its cache keeps it.
pub fn ours<K: Mailed>(obj: &mut K) {
    keep(obj.meta_mut(), &READ_ANNOTATIONS, K::CACHED_LABELS);
}

/// A Cluster API `Cluster` as its cache keeps it.
pub fn cluster(obj: &mut Cluster) {
    read_only(obj.meta_mut(), &[], &[]);
}

/// A Cluster API `Machine` as its cache keeps it: of its conditions, only the two a remediation
/// reads, `HealthCheckSucceeded` when it is `False` and `OwnerRemediated`; of its annotations,
/// only `cluster.x-k8s.io/remediate-machine` (a remediation reports it).
pub fn machine(obj: &mut Machine) {
    use capm_api::owner_remediated::{HEALTH_CHECK_SUCCEEDED, OWNER_REMEDIATED};
    read_only(
        obj.meta_mut(),
        &[names::REMEDIATE_MACHINE_ANNOTATION],
        &[names::CLUSTER_NAME_LABEL],
    );
    let conditions = obj.status.as_mut().and_then(|s| s.conditions.as_mut());
    if let Some(conditions) = conditions {
        conditions.retain(|c| {
            (c.type_ == HEALTH_CHECK_SUCCEEDED && c.status == "False")
                || c.type_ == OWNER_REMEDIATED
        });
    }
}

/// A `MachineHealthCheck` as its cache keeps it: its spec (the Machines it selects) and, of its
/// conditions, only `RemediationAllowed`.
pub fn health_check(obj: &mut MachineHealthCheck) {
    read_only(obj.meta_mut(), &[], &[]);
    let conditions = obj.status.as_mut().and_then(|s| s.conditions.as_mut());
    if let Some(conditions) = conditions {
        conditions.retain(|c| c.type_ == REMEDIATION_ALLOWED);
    }
}

/// A `MailgunClusterIdentity` as its cache keeps it.
pub fn identity(obj: &mut MailgunClusterIdentity) {
    read_only(obj.meta_mut(), &[], &[]);
}

/// A claimed Secret as its cache keeps it: the claim label and owner references are read; no
/// annotations (`kubectl apply` copies the whole Secret, values included, into one).
pub fn secret(obj: &mut Secret) {
    keep(obj.meta_mut(), &[], &[names::IDENTITY_SECRET_LABEL]);
}

/// An object the provider never writes: no finalizers or owner references either.
fn read_only(meta: &mut ObjectMeta, annotations: &[&str], labels: &[&str]) {
    keep(meta, annotations, labels);
    (meta.finalizers, meta.owner_references) = (None, None);
}

/// Drops `managedFields` and every annotation and label not named.
fn keep(meta: &mut ObjectMeta, annotations: &[&str], labels: &[&str]) {
    meta.managed_fields = None;
    only(&mut meta.annotations, annotations);
    only(&mut meta.labels, labels);
}

fn only(map: &mut Option<BTreeMap<String, String>>, keys: &[&str]) {
    if let Some(m) = map {
        m.retain(|k, _| keys.contains(&k.as_str()));
    }
    if map.as_ref().is_some_and(BTreeMap::is_empty) {
        *map = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use capm_api::v1beta1::{MailgunCluster, MailgunMachine};
    use serde_json::json;

    fn metadata() -> serde_json::Value {
        json!({
            "name": "a", "namespace": "ns", "uid": "u", "resourceVersion": "42",
            "annotations": {
                names::MAIL_ANNOTATION: "{}",
                "kubectl.kubernetes.io/last-applied-configuration": "{}",
            },
            "labels": { names::CLUSTER_NAME_LABEL: "c", "team": "x" },
            "finalizers": ["f"],
            "managedFields": [{ "manager": "kubectl" }],
            "ownerReferences": [{ "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
                "name": "a", "uid": "c" }],
        })
    }

    fn spec() -> serde_json::Value {
        json!({ "priority": "Urgent", "request": "r", "requester": "a@example.com" })
    }

    #[test]
    fn our_objects_keep_what_a_reconcile_reads() {
        let mut mc: MailgunCluster =
            serde_json::from_value(json!({ "metadata": metadata(), "spec": spec() })).unwrap();
        ours(&mut mc);
        let meta = &mc.metadata;
        assert_eq!(meta.managed_fields, None);
        let annotations: Vec<_> = meta.annotations.iter().flatten().map(|(k, _)| k).collect();
        assert_eq!(annotations, [names::MAIL_ANNOTATION]);
        assert_eq!(meta.labels, None, "a MailgunCluster reads no label");
        assert_eq!(meta.finalizers.as_deref(), Some(&["f".to_owned()][..]));
        assert_eq!(meta.owner_references.as_ref().map(Vec::len), Some(1));
        assert_eq!(mc.spec.request, "r");

        let mut mm: MailgunMachine =
            serde_json::from_value(json!({ "metadata": metadata(), "spec": spec() })).unwrap();
        ours(&mut mm);
        let labels: Vec<_> = mm
            .metadata
            .labels
            .iter()
            .flatten()
            .map(|(k, _)| k)
            .collect();
        assert_eq!(labels, [names::CLUSTER_NAME_LABEL]);
    }

    #[test]
    fn cluster_api_objects_keep_their_identity_and_what_is_read() {
        let mut c: Cluster = serde_json::from_value(json!({ "metadata": metadata(),
            "spec": { "paused": true } }))
        .unwrap();
        cluster(&mut c);
        let meta = &c.metadata;
        assert_eq!(
            (meta.annotations.as_ref(), meta.labels.as_ref()),
            (None, None)
        );
        assert_eq!((&meta.finalizers, &meta.owner_references), (&None, &None));
        assert_eq!(meta.managed_fields, None);
        assert_eq!(meta.uid.as_deref(), Some("u"));
        assert!(c.paused());

        let mut asked = metadata();
        asked["annotations"][names::REMEDIATE_MACHINE_ANNOTATION] = json!("");
        let mut m: Machine = serde_json::from_value(json!({ "metadata": asked, "spec": {},
            "status": { "nodeRef": { "name": "n" }, "conditions": [
                { "type": "Ready", "status": "False", "message": "long" },
                { "type": "HealthCheckSucceeded", "status": "False", "reason": "UnhealthyNode" },
                { "type": "OwnerRemediated", "status": "False", "reason": "MachineDeleting" },
            ] } }))
        .unwrap();
        machine(&mut m);
        let kept: Vec<_> = (m.status.as_ref().and_then(|s| s.conditions.as_ref()))
            .into_iter()
            .flatten()
            .map(|c| c.type_.as_str())
            .collect();
        assert_eq!(kept, ["HealthCheckSucceeded", "OwnerRemediated"]);
        assert_eq!(m.node_name(), Some("n"));
        let mut healthy: Machine = serde_json::from_value(json!({ "metadata": metadata(),
            "spec": {}, "status": { "conditions": [
                { "type": "HealthCheckSucceeded", "status": "True" },
            ] } }))
        .unwrap();
        machine(&mut healthy);
        assert_eq!(
            healthy.condition("HealthCheckSucceeded"),
            None,
            "a healthy one keeps none"
        );
        assert_eq!(m.cluster_name().as_deref(), Some("c"));
        assert_eq!(m.metadata.labels.as_ref().map(BTreeMap::len), Some(1));
        let annotations: Vec<_> = m.metadata.annotations.iter().flatten().collect();
        assert_eq!(
            annotations,
            [(
                &names::REMEDIATE_MACHINE_ANNOTATION.to_owned(),
                &String::new()
            )]
        );
        assert_eq!(healthy.metadata.annotations, None);

        let mut check: MachineHealthCheck = serde_json::from_value(json!({
            "metadata": metadata(),
            "spec": { "clusterName": "c", "selector": { "matchLabels": { "pool": "workers" } } },
            "status": { "conditions": [
                { "type": "Ready", "status": "True" },
                { "type": "RemediationAllowed", "status": "False", "reason": "TooManyUnhealthy" },
            ] } }))
        .unwrap();
        health_check(&mut check);
        assert_eq!(
            (
                check.metadata.annotations.as_ref(),
                check.metadata.labels.as_ref()
            ),
            (None, None)
        );
        assert_eq!(check.spec.cluster_name.as_deref(), Some("c"));
        assert!(check.spec.selector.match_labels.is_some(), "its selector");
        assert!(check.holds_remediation(), "its brake");
        assert_eq!(
            check.status.and_then(|s| s.conditions).map(|c| c.len()),
            Some(1)
        );
    }
}
