//! The status-patch ceilings of the two CRDs side by side, in one phase of the API server.
//!
//! Each subject's own ceiling is measured after its drain, minutes apart: the peer's on a young
//! store, ours after two backlogs, 10 000 Events and a CRD deleted with its objects. The same
//! CRD on the same small objects just created measured 265 to 889 writes/s across runs of the
//! same code, so a ratio of two such figures says more about when each was taken than about the
//! objects. Here the peer's CRD is installed again under a group of its own, of the same length
//! (`infrastructure.goref00.x-k8s.io` for `infrastructure.cluster.x-k8s.io`: the objects'
//! `apiVersion`s weigh the same), objects of the peer's finished shape are made in it (the
//! bench's creator entry, the peer's `status.messageID` written by a field manager named as the
//! peer's), beside our finished objects and owned by the same Clusters, and the two are measured
//! in alternating rounds: the best of each is what compares.

use std::{collections::BTreeMap, sync::Arc};

use anyhow::Context;
use capm_test_support::ControlPlane;
use futures::{StreamExt, TryStreamExt, stream};
use kube::{
    Api, Client, ResourceExt,
    api::{
        ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams, PostParams,
    },
};
use serde_json::json;

use crate::{
    Args, DOMAIN, Mix, Subject, backlog_object, ceiling_round, cluster_resource, mean_json_bytes,
    mgc_resource, object_name,
};

/// The copy's group: as long as ours, so the objects' `apiVersion`s weigh the same.
const GROUP: &str = "infrastructure.goref00.x-k8s.io";
/// Rounds of the two, alternating.
const ROUNDS: usize = 3;

/// The two ceilings, measured in one phase.
pub struct SideBySide {
    /// Status patches per second on our finished objects (the best round).
    pub ours: f64,
    /// The same on the peer's shape, in the copy of its CRD.
    pub peer_shape: f64,
    /// Mean size of an object of the peer's shape as JSON, `managedFields` included.
    pub peer_shape_bytes: f64,
    /// Objects of each kind written.
    pub objects: usize,
}

impl SideBySide {
    pub fn print(&self) {
        println!(
            "  status-patch ceiling side by side (one phase, {} objects of each, {ROUNDS} alternating rounds): ours {:.0} writes/s, the peer's shape ({:.0} bytes) in a copy of its CRD {:.0} writes/s: {:.2}x",
            self.objects,
            self.ours,
            self.peer_shape_bytes,
            self.peer_shape,
            self.ours / self.peer_shape
        );
    }
}

/// Installs the copy of the peer's CRD, makes `--ceiling-writes` objects of the peer's finished
/// shape beside the provider's finished ones, measures, and removes the copy.
pub async fn measure(
    cp: &ControlPlane,
    client: &Client,
    args: &Args,
) -> anyhow::Result<SideBySide> {
    let crd = std::fs::read_to_string(&args.peer_crd)
        .with_context(|| format!("reading {}", args.peer_crd.display()))?
        .replace(capm_api::GROUP, GROUP);
    std::fs::create_dir_all(&args.profile_dir)?;
    let path = args.profile_dir.join("peer-crd-copy.yaml");
    std::fs::write(&path, crd)?;
    let path = path.to_str().context("the copy's path")?;
    cp.kubectl_output(&["apply", "-f", path])?;
    let crd_name = format!("crd/mailgunclusters.{GROUP}");
    cp.kubectl_output(&["wait", "--for=condition=Established", &crd_name])?;

    let ns = Subject::Provider.namespace();
    let m = args.ceiling_writes.min(args.objects);
    let clusters: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), &ns, &cluster_resource());
    let uids: BTreeMap<String, String> = clusters
        .list(&ListParams::default())
        .await?
        .items
        .into_iter()
        .filter_map(|c| Some((c.name_any(), c.uid()?)))
        .collect();
    let copy_ar =
        ApiResource::from_gvk(&GroupVersionKind::gvk(GROUP, "v1alpha1", "MailgunCluster"));
    let copies: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &copy_ar);
    let peer_manager = PatchParams {
        field_manager: Some("goref".into()),
        ..PatchParams::default()
    };
    stream::iter(0..m)
        .map(|i| {
            let (copies, copy_ar, peer_manager) = (copies.clone(), copy_ar.clone(), &peer_manager);
            let uid = uids.get(&object_name(i)).cloned();
            async move {
                let name = object_name(i);
                let uid = uid.with_context(|| format!("no Cluster {name}"))?;
                let o = backlog_object(&name, &copy_ar, &uid)?;
                copies.create(&PostParams::default(), &o).await?;
                // The peer's message ids: `<unix seconds>.<counter>@domain`.
                let id = format!("<{}.{i}@{DOMAIN}>", 1_795_962_273 + i);
                let status = json!({ "status": { "messageID": id } });
                copies
                    .patch_status(&name, peer_manager, &Patch::Merge(status))
                    .await?;
                anyhow::Ok(())
            }
        })
        .buffer_unordered(32)
        .try_collect::<Vec<_>>()
        .await?;
    let peer_shape_bytes = mean_json_bytes(&copies.list(&ListParams::default()).await?.items);

    let ours: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        &ns,
        &mgc_resource(Subject::Provider.version()),
    );
    let names: Arc<Vec<String>> = Arc::new((0..m).map(object_name).collect());
    let (mut best_ours, mut best_peer) = (f64::NAN, f64::NAN);
    let mut round = 300;
    for _ in 0..ROUNDS {
        for &writers in &args.ceiling_writers {
            for (api, subject, best) in [
                (&ours, Subject::Provider, &mut best_ours),
                (&copies, Subject::Peer(1), &mut best_peer),
            ] {
                let rate =
                    ceiling_round(api, subject, Mix::StatusOnly, &names, writers, args, round);
                *best = best.max(rate.await?);
                round += 2;
            }
        }
    }
    cp.kubectl_output(&[
        "delete",
        "crd",
        &format!("mailgunclusters.{GROUP}"),
        "--wait=false",
    ])?;
    Ok(SideBySide {
        ours: best_ours,
        peer_shape: best_peer,
        peer_shape_bytes,
        objects: m,
    })
}
