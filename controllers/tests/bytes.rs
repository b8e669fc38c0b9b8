//! The bytes of a finished object: what the API server decodes, patches, validates, encodes and
//! stores on every write of it (issue 55: `make bench` showed its status-patch ceiling follows
//! the size). A `MailgunCluster` created as the bench creates its objects (its owner, the cluster
//! label), its request mailed, is measured as compact JSON, as a whole and per field manager
//! (printed: `--nocapture`); figures in docs/benchmarks.md, "Bytes per object".
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use capm_api::names;
use kube::api::{ApiResource, DynamicObject, GroupVersionKind, PostParams};
use serde_json::json;
use support::{Env, PATIENCE, condition, eventually};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "needs the local control plane: `make test` runs it, `make unit` does not"]
async fn a_finished_mailgun_cluster_in_bytes() {
    let mut env = Env::new("bytes").await;
    env.start().await;
    let name = "bench-00000042";
    let cluster = env.create_cluster(name, false).await;
    let ar = ApiResource::from_gvk(&GroupVersionKind::gvk(
        capm_api::GROUP,
        "v1beta1",
        "MailgunCluster",
    ));
    let mut mgc = DynamicObject::new(name, &ar).data(json!({ "spec": {
        "priority": "Urgent", "request": "One cluster please.", "requester": "bench@example.com",
    }}));
    mgc.metadata.labels = Some([(names::CLUSTER_NAME_LABEL.to_owned(), name.to_owned())].into());
    mgc.metadata.owner_references = Some(vec![
        serde_json::from_value(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster", "name": name,
            "uid": cluster.metadata.uid, "controller": true, "blockOwnerDeletion": true,
        }))
        .unwrap(),
    ]);
    let api = kube::Api::<DynamicObject>::namespaced_with(env.ns.client.clone(), &env.ns.name, &ar);
    api.create(&PostParams::default(), &mgc).await.unwrap();
    eventually(PATIENCE, "the request mailed", || async {
        let obj = env.clusters().get(name).await.unwrap();
        let status = obj.status.unwrap_or_default();
        condition(&status.conditions, "MailDelivered").is_some()
            && condition(&status.conditions, "Ready").is_some()
    })
    .await;
    let obj = api.get(name).await.unwrap();
    let whole = serde_json::to_vec(&obj).unwrap().len();
    let mut bare = obj.clone();
    let managed = bare.metadata.managed_fields.take().unwrap_or_default();
    let without = serde_json::to_vec(&bare).unwrap().len();
    eprintln!("finished MailgunCluster: {whole} B, {without} B without managedFields");
    for entry in &managed {
        eprintln!(
            "  managedFields {:?} {:?} {:?}: {} B",
            entry.manager,
            entry.operation,
            entry.subresource,
            serde_json::to_vec(entry).unwrap().len()
        );
    }
    // The conditions are still one per type (a map-list inside the atomic status).
    let twice = json!({ "status": { "conditions": [
        { "type": "Ready", "status": "True", "reason": "R", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z" },
        { "type": "Ready", "status": "False", "reason": "R", "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z" },
    ]}});
    let refused = api
        .patch_status(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(&twice),
        )
        .await;
    assert!(
        matches!(&refused, Err(kube::Error::Api(s)) if s.code == 422),
        "{refused:?}"
    );
    // One writer owns the status as a unit: its entry names `status`, no field inside it.
    let status = managed
        .iter()
        .find(|m| m.subresource.as_deref() == Some("status"))
        .expect("the status write's entry");
    assert_eq!(
        status.manager.as_deref(),
        Some("cluster-api-provider-mailgun")
    );
    assert_eq!(
        status.fields_v1.as_ref().map(|f| &f.0),
        Some(&json!({ "f:status": {} }))
    );
    env.stop().await;
}
