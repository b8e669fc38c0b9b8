//! The memory floor of the provider's caches: what its `MailgunCluster` and `Cluster` caches
//! (kube-runtime's reflector stores of objects trimmed as the watches trim them) cost per
//! Cluster + MailgunCluster pair when the objects carry nothing but a name, a namespace, a UID
//! and a `resourceVersion` (and the spec a MailgunCluster must have), and when they are
//! finished.
//!
//! Measured in this process, on the resident set (so the allocator's own overhead counts, as it
//! does for the provider): `pairs` objects of each kind are applied the way the watches apply
//! them, and the growth of `VmRSS` is divided by `pairs`. Every reflector `Store<K>` entry holds
//! an `Arc<K>` (the object with its whole `ObjectMeta`), an `ObjectRef` key with its own copies
//! of the name, namespace, UID and `resourceVersion`, and a hash-table slot: kube-runtime's
//! controller cannot read a smaller cache, whatever it trims.

use capm_api::{
    capi::{Cluster, ClusterSpec, ContractRef},
    v1beta1::MailgunCluster,
};
use kube::{
    api::ObjectMeta,
    runtime::{reflector, watcher},
};

use crate::object_name;

fn uid(i: usize) -> String {
    format!("00000000-0000-4000-8000-{i:012}")
}

/// The floor, in bytes per pair.
pub struct Floor {
    /// Pairs measured.
    pub pairs: usize,
    /// Resident bytes per pair for the two stores, objects with names only.
    pub bytes_per_pair: f64,
    /// The same with objects as the provider caches a finished pair (its `MailgunCluster`
    /// trimmed as the watch trims it: record, finalizer, owner, spec, status with five
    /// conditions and `status.mail`; its partial `Cluster` type with the infrastructure
    /// reference).
    pub finished_bytes_per_pair: f64,
}

/// A finished `MailgunCluster` as the provider reads it (the shape of
/// `target/bench/bench-provider-object.json` without `managedFields`), for object `i`.
fn finished(i: usize) -> serde_json::Value {
    let uid = uid(i);
    let id = format!("<mailguncluster.{uid}@mg.bench.example.com>");
    let at = format!("2026-11-23T19:{:02}:{:02}Z", (i / 60) % 60, i % 60);
    let condition = |type_: &str, status: &str, reason: &str, message: &str| {
        serde_json::json!({
            "lastTransitionTime": "2026-11-23T19:36:55Z", "message": message,
            "reason": reason, "status": status, "type": type_,
        })
    };
    serde_json::json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
        "kind": "MailgunCluster",
        "metadata": {
            "annotations": {
                "mailgun.infrastructure.cluster.x-k8s.io/mail": serde_json::json!({
                    "messageId": id, "state": "sent", "at": at
                }).to_string(),
            },
            "creationTimestamp": "2026-11-23T19:36:55Z",
            "finalizers": ["mailguncluster.infrastructure.cluster.x-k8s.io"],
            "generation": 1,
            "name": object_name(i),
            "namespace": "bench-provider",
            "ownerReferences": [{
                "apiVersion": "cluster.x-k8s.io/v1beta2", "blockOwnerDeletion": true,
                "controller": true, "kind": "Cluster", "name": object_name(i),
                "uid": format!("00000000-0000-4000-9000-{i:012}"),
            }],
            "resourceVersion": format!("{}", 100_000 + i),
            "uid": uid,
        },
        "spec": { "priority": "Urgent", "request": "One cluster please.", "requester": "bench@example.com" },
        "status": {
            "conditions": [
                condition("Paused", "False", "NotPaused", ""),
                condition("MailSent", "True", "MailSent", ""),
                condition("MailDelivered", "Unknown", "DeliveryPending", ""),
                condition("Provisioned", "False", "WaitingForFulfillment", ""),
                condition("Ready", "False", "WaitingForFulfillment", ""),
            ],
            "mail": { "messageID": id, "sentAt": "2026-11-23T19:36:55Z", "state": "Sent" },
            "observedGeneration": 1,
        },
    })
}

fn rss_bytes() -> anyhow::Result<f64> {
    let statm = std::fs::read_to_string("/proc/self/statm")?;
    let pages: f64 = statm
        .split_whitespace()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("no resident field in /proc/self/statm"))?
        .parse()?;
    Ok(pages * 4096.0)
}

fn meta(i: usize) -> ObjectMeta {
    ObjectMeta {
        // Names, UIDs and versions of the lengths the bench's objects have.
        name: Some(object_name(i)),
        namespace: Some("bench-provider".into()),
        uid: Some(uid(i)),
        resource_version: Some(format!("{}", 100_000 + i)),
        ..ObjectMeta::default()
    }
}

/// Measures the floor over `pairs` pairs, and the same stores holding finished pairs.
///
/// # Errors
/// When `/proc/self/statm` cannot be read, or an object cannot be built.
pub fn measure(pairs: usize) -> anyhow::Result<Floor> {
    // Each measurement's stores stay alive until both are done, so the second does not grow
    // into memory the first freed.
    let (bytes_per_pair, _minimal) = minimal(pairs)?;
    let (finished_bytes_per_pair, _finished) = with_finished_objects(pairs)?;
    Ok(Floor {
        pairs,
        bytes_per_pair,
        finished_bytes_per_pair,
    })
}

/// The stores a measurement filled, kept alive by the caller.
type Kept = (Box<dyn std::any::Any>, Box<dyn std::any::Any>);

fn with_finished_objects(pairs: usize) -> anyhow::Result<(f64, Kept)> {
    let (bytes, stores) = fill(
        pairs,
        move |i| Ok(serde_json::from_value::<MailgunCluster>(finished(i))?),
        |i| {
            let mut cluster = Cluster::new(
                &object_name(i),
                ClusterSpec {
                    paused: None,
                    infrastructure_ref: Some(ContractRef {
                        api_group: capm_api::GROUP.into(),
                        kind: "MailgunCluster".into(),
                        name: object_name(i),
                    }),
                },
            );
            cluster.metadata = meta(i);
            cluster.metadata.generation = Some(1);
            cluster
        },
    )?;
    Ok((bytes, stores))
}

fn minimal(pairs: usize) -> anyhow::Result<(f64, Kept)> {
    fill(
        pairs,
        |i| {
            let mut mgc: MailgunCluster = serde_json::from_value(serde_json::json!({
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1",
                "kind": "MailgunCluster",
                "metadata": {},
                "spec": { "priority": "Urgent", "request": "", "requester": "a@example.com" },
            }))?;
            mgc.metadata = meta(i);
            Ok(mgc)
        },
        |i| {
            let mut cluster = Cluster::new("", ClusterSpec::default());
            cluster.metadata = meta(i);
            cluster
        },
    )
}

/// Applies `pairs` pairs (after a first thousand) to two fresh stores, as the reflector applies
/// watch events, and returns the growth of the resident set per pair with the stores.
fn fill(
    pairs: usize,
    mgc: impl Fn(usize) -> anyhow::Result<MailgunCluster>,
    cluster: impl Fn(usize) -> Cluster,
) -> anyhow::Result<(f64, Kept)> {
    let (mgc_reader, mut mgc_writer) = reflector::store::<MailgunCluster>();
    let (cluster_reader, mut cluster_writer) = reflector::store::<Cluster>();
    // A first batch, so what grows once (the tables' first allocation, the allocator's arenas)
    // is not counted per pair.
    let warm = 1000;
    let mut before = 0.0;
    for i in 0..warm + pairs {
        if i == warm {
            before = rss_bytes()?;
        }
        mgc_writer.apply_watcher_event(&watcher::Event::Apply(mgc(i)?));
        cluster_writer.apply_watcher_event(&watcher::Event::Apply(cluster(i)));
    }
    let after = rss_bytes()?;
    anyhow::ensure!(
        mgc_reader.state().len() == warm + pairs && cluster_reader.state().len() == warm + pairs,
        "the caches do not hold every object"
    );
    Ok((
        (after - before) / pairs as f64,
        (Box::new(mgc_writer), Box::new(cluster_writer)),
    ))
}
