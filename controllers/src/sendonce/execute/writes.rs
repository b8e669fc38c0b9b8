//! The writes of the protocol: the intent (the fence), the sent record, a refusal.

use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use serde_json::json;
use tracing::debug;

use super::Tracked;
use crate::{
    context::{Ctx, ReconcileError},
    identity::Route,
    kinds::Mailed,
    sendonce::{
        Which,
        records::{self, Intent, IntentState, Sent, read_records},
    },
};

/// The annotations of one write of a mail's record: the record, and removal of release 0.1's
/// annotations for that mail where the object still has them.
fn record_patch(tracked: &Tracked, which: Which, value: String) -> serde_json::Value {
    let mut annotations = serde_json::Map::new();
    annotations.insert(which.record_key().to_owned(), value.into());
    for legacy in [which.intent_key(), which.sent_key()].into_iter().flatten() {
        if tracked.annotations.contains_key(legacy) {
            annotations.insert(legacy.to_owned(), serde_json::Value::Null);
        }
    }
    serde_json::Value::Object(annotations)
}

/// Writes a fresh intent (`sending`, this process, now) with our finalizer, replacing whatever
/// record the mail had, in one write guarded by `resourceVersion`: the fence
/// between two processes that both believe they lead.
pub(super) async fn write_intent<K: Mailed>(
    obj: &K,
    ctx: &Ctx,
    tracked: &mut Tracked,
    which: Which,
    id: &str,
    route: &Route,
) -> Result<(), ReconcileError> {
    let intent = Intent {
        message_id: id.to_owned(),
        writer: Some(ctx.leadership.identity().to_owned()),
        at: Some(Timestamp::now()),
        state: IntentState::Sending,
        identity: route.identity.clone(),
    };
    let mut metadata = json!({
        "resourceVersion": tracked.resource_version,
        "annotations": record_patch(tracked, which, records::intent_value(&intent)),
    });
    if !tracked.has_finalizer(K::FINALIZER) {
        let mut finalizers = tracked.finalizers.clone();
        finalizers.push(K::FINALIZER.to_owned());
        metadata["finalizers"] = json!(finalizers);
    }
    patch_metadata(obj, ctx, tracked, metadata, "recording the mail intent").await
}

/// Merge-patches our object's metadata (guarded by `resourceVersion` when `metadata` carries
/// one) and adopts what the API server wrote.
pub(crate) async fn patch_metadata<K: Mailed>(
    obj: &K,
    ctx: &Ctx,
    tracked: &mut Tracked,
    metadata: serde_json::Value,
    what: &'static str,
) -> Result<(), ReconcileError> {
    let written = ctx
        .patch(obj, json!({ "metadata": metadata }), what)
        .await?;
    tracked.resource_version = written.resource_version();
    tracked.annotations = written.annotations().clone();
    tracked.finalizers = written.finalizers().to_vec();
    Ok(())
}

/// Records in the intent that the attempt just made was refused before anything was accepted,
/// so deletion knows no release is owed. Best effort: when it cannot be written the intent
/// stays `sending` ("may have gone out"), which errs on the side of a release.
pub(super) async fn mark_refused<K: Mailed>(
    obj: &K,
    ctx: &Ctx,
    tracked: &mut Tracked,
    which: Which,
) {
    let Some(mut intent) = read_records(&tracked.annotations, K::KIND, which).intent else {
        return;
    };
    intent.state = IntentState::Refused;
    let metadata = json!({
        "resourceVersion": tracked.resource_version,
        "annotations": record_patch(tracked, which, records::intent_value(&intent)),
    });
    if let Err(error) = patch_metadata(obj, ctx, tracked, metadata, "recording the refusal").await {
        debug!(%error, "Could not record the refusal; the intent stays 'sending'");
    }
}

pub(super) async fn record_sent<K: Mailed>(
    obj: &K,
    ctx: &Ctx,
    tracked: &mut Tracked,
    which: Which,
    sent: &Sent,
) -> Result<(), ReconcileError> {
    // No resourceVersion precondition: a concurrent change (Cluster API adding a label, a human
    // fulfilling) must not make us lose the record. Replacing the intent is safe without one:
    // every record of this mail names the same Message-Id, and that mail was accepted.
    let message_id = sent.message_id.as_deref().unwrap_or(&sent.backend_id);
    let metadata = json!({
        "annotations": record_patch(tracked, which, records::sent_value(message_id, sent)),
    });
    patch_metadata(obj, ctx, tracked, metadata, "recording the mail as sent").await
}
