//! The reconcile loop shared by both kinds, in the order every Cluster API provider follows:
//! owner (matched by UID, and naming this object back) -> paused -> `reconcile_normal` /
//! `reconcile_delete`, then one status write at the end when something changed. The mails
//! themselves go through [`crate::sendonce`].

mod delete;
mod normal;

use std::{sync::Arc, time::Instant};

use capm_api::{
    capi,
    names::{self, conditions, reasons},
};
use kube::{Resource, ResourceExt, runtime::controller::Action};
use serde_json::json;
use tracing::{Instrument, debug, warn};

use self::{delete::reconcile_delete, normal::reconcile_normal};
use crate::{
    context::{Ctx, ReconcileError},
    kinds::{InfraKind, Mailed},
    sendonce::execute::OwnerCheck,
    status::{Readiness, Status},
};

/// How soon an object whose owner is not in the cache yet is looked at again.
const OWNER_RECHECK: std::time::Duration = std::time::Duration::from_secs(2);

/// The status one pass computes, and what decides its `Ready` (set once, at the end).
struct Report {
    status: Status,
    ready: Readiness,
    /// The object's annotations a reconcile reads, as the pass found them.
    annotations: std::collections::BTreeMap<String, String>,
}

impl Report {
    /// The pass stopped for a reason no other condition records.
    fn block(&mut self, reason: &'static str, message: impl Into<String>) {
        self.ready = Readiness::Blocked {
            reason,
            message: message.into(),
        };
    }
}

/// The result of one pass, before the status write.
struct Pass {
    action: Action,
    /// The object no longer exists (finalizer removed): no status to write.
    gone: bool,
}

impl Pass {
    fn wait() -> Self {
        Self {
            action: Action::await_change(),
            gone: false,
        }
    }
}

/// One reconcile of `obj`, with metrics around it.
pub async fn reconcile<K: InfraKind>(obj: Arc<K>, ctx: Arc<Ctx>) -> Result<Action, ReconcileError> {
    measured(&*obj, &ctx, reconcile_inner(&*obj, &ctx)).await
}

/// The reconcile `pass` of `obj` (any kind's) with the controller metrics, its span and its
/// log line around it, after the checks every pass starts with: a cached copy older than this
/// process's last write waits for the newer one; the shared caches are listed once; only a
/// leader writes.
pub(crate) async fn measured<K: Mailed>(
    obj: &K,
    ctx: &Ctx,
    pass: impl Future<Output = Result<Action, ReconcileError>>,
) -> Result<Action, ReconcileError> {
    let uid = obj.uid().unwrap_or_default();
    let waited = ctx.ledger.dequeue(&uid);
    let mut guard = (ctx.metrics).reconciling(K::CONTROLLER, waited, Instant::now());
    let span = obj.span();
    let checked = async {
        if ctx.ledger.is_stale(&uid, obj.resource_version().as_deref()) {
            // Our own newer write is on its way to the cache (or the object is gone); its event
            // triggers the next pass.
            debug!(resource_version = ?obj.resource_version(),
                "The cached copy predates this process's last write (or the object is gone): waiting for the newer one");
            return Ok(Action::await_change());
        }
        // An owner missing from a cache that has not finished its first list is not missing.
        ctx.capi_listed().await;
        // A replica that cannot prove it leads writes nothing at all.
        ctx.ensure_leading()?;
        pass.await
    };
    let result = checked.instrument(span.clone()).await;
    if let Err(error) = &result {
        span.in_scope(|| {
            if error.is_wait() || error.is_not_found() {
                debug!(%error, "Reconcile waits");
            } else {
                warn!(%error, "Reconcile failed");
            }
        });
    }
    guard.result = match &result {
        Ok(_) => "success",
        Err(e) => e.metric_label(),
    };
    if result.is_ok() {
        ctx.ledger.succeeded(&uid);
    }
    drop(guard);
    result
}

async fn reconcile_inner<K: InfraKind>(obj: &K, ctx: &Ctx) -> Result<Action, ReconcileError> {
    let uid = obj.uid().unwrap_or_default();
    let deleting = obj.meta().deletion_timestamp.is_some();
    let has_finalizer = obj.finalizers().iter().any(|f| f == K::FINALIZER);
    // One snapshot: spec, metadata, annotations and status all come from the same cached copy.
    let managed_elsewhere = obj.annotations().contains_key(names::MANAGED_BY_ANNOTATION);
    if managed_elsewhere && !(deleting && has_finalizer) {
        // Someone else manages it; but our own finalizer, if we ever set it, is ours to release.
        debug!("Managed by another controller: nothing to do");
        return Ok(Action::await_change());
    }
    let original = obj.shared_status();
    let mut report = Report {
        status: original.clone(),
        ready: Readiness::Unchanged,
        annotations: obj.annotations().clone(),
    };
    report.status.observed_generation = obj.meta().generation;
    let outcome = if managed_elsewhere {
        reconcile_delete(obj, ctx, &mut report).await
    } else {
        steps(obj, ctx, &mut report).await
    };
    let gone = match &outcome {
        Ok(Pass { gone, .. }) => *gone,
        Err(ReconcileError::Gone) => true,
        Err(_) => false,
    };
    if gone {
        ctx.forget(&uid);
        return Ok(Action::await_change());
    }
    let Report {
        mut status, ready, ..
    } = report;
    status.set_ready(ready);
    status.drop_condition_generations();
    if status.differs_on_the_wire(&original) {
        ctx.patch(obj, json!({ "status": status }), "writing status")
            .await?;
    }
    outcome.map(|p| p.action)
}

/// The owner as Cluster API guarantees it: the ownerReference's UID is the live owner's, and
/// the owner's `spec.infrastructureRef` names this object.
enum Owner<O> {
    /// No ownerReference of the owner kind: Cluster API sets it, and that event comes to us.
    Missing(String),
    /// The ownerReference names an owner not (yet) in the cache. Its arrival would trigger only
    /// the object its `infrastructureRef` names, so look again shortly.
    NotSeen(String),
    /// The ownerReference does not match what the owner says.
    Mismatch(String),
    /// The confirmed owner and its UID.
    Confirmed(Arc<O>, String),
}

fn owner_of<K: InfraKind>(obj: &K, ctx: &Ctx) -> Owner<K::Owner> {
    let namespace = obj.namespace().unwrap_or_default();
    let Some(reference) = capi::owner(obj.owner_references(), K::OWNER_KIND) else {
        return Owner::Missing(format!(
            "waiting for Cluster API to set an owner {}",
            K::OWNER_KIND
        ));
    };
    let Some(owner) = K::owner_in_cache(&ctx.capi, &namespace, &reference.name) else {
        return Owner::NotSeen(format!(
            "waiting for the owner {} {} to be seen",
            K::OWNER_KIND,
            reference.name
        ));
    };
    if owner.meta().uid.as_deref() != Some(reference.uid.as_str()) {
        return Owner::Mismatch(format!(
            "the ownerReference's UID is not that of {} {}",
            K::OWNER_KIND,
            reference.name
        ));
    }
    if !K::owner_refers_to(&owner, obj) {
        return Owner::Mismatch(format!(
            "{} {}'s spec.infrastructureRef does not name this {}",
            K::OWNER_KIND,
            reference.name,
            K::KIND
        ));
    }
    Owner::Confirmed(owner, reference.uid.clone())
}

async fn steps<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    report: &mut Report,
) -> Result<Pass, ReconcileError> {
    let deleting = obj.meta().deletion_timestamp.is_some();
    let has_finalizer = obj.finalizers().iter().any(|f| f == K::FINALIZER);
    if deleting && !has_finalizer {
        return Ok(Pass::wait());
    }
    let (owner, owner_uid) = match owner_of(obj, ctx) {
        Owner::Confirmed(owner, uid) => (owner, uid),
        // Nothing that is not our confirmed owner can pause a deletion: clean up.
        Owner::Missing(_) | Owner::NotSeen(_) | Owner::Mismatch(_) if deleting => {
            return reconcile_delete(obj, ctx, report).await;
        }
        Owner::Missing(message) => {
            report.block(reasons::WAITING_FOR_OWNER, message);
            return Ok(Pass::wait());
        }
        Owner::NotSeen(message) => {
            report.block(reasons::WAITING_FOR_OWNER, message);
            return Ok(Pass {
                action: Action::requeue(OWNER_RECHECK),
                gone: false,
            });
        }
        Owner::Mismatch(message) => {
            report.block(reasons::OWNER_MISMATCH, message);
            return Ok(Pass::wait());
        }
    };

    let cluster = K::cluster_in_cache(&ctx.capi, obj, &owner);
    let paused = report.annotations.contains_key(names::PAUSED_ANNOTATION)
        || cluster.as_deref().is_some_and(capi::Cluster::paused);
    if paused {
        report.status.set_condition(
            conditions::PAUSED,
            true,
            reasons::PAUSED,
            "reconciliation is paused",
        );
        // `Ready` says why nothing moves: a blocker of an earlier pass (the owner, say) is
        // not what holds the object now. A ready object stays ready: pausing unprovisions nothing.
        report.ready = Readiness::Paused;
        return Ok(Pass::wait());
    }
    report
        .status
        .set_condition(conditions::PAUSED, false, reasons::NOT_PAUSED, "");

    if deleting {
        reconcile_delete(obj, ctx, report).await
    } else {
        let check = OwnerCheck {
            deleting_in_cache: owner.meta().deletion_timestamp.is_some(),
            name: owner.meta().name.clone().unwrap_or_default(),
            uid: owner_uid,
        };
        reconcile_normal(obj, ctx, report, &owner, &check).await
    }
}

#[cfg(test)]
mod tests;
