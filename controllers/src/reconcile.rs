//! The reconcile loop shared by both kinds, in the order every Cluster API provider follows:
//! owner (matched by UID, and naming this object back) -> paused -> `reconcile_normal` /
//! `reconcile_delete`, then one status write at the end when something changed. The mails
//! themselves go through [`crate::sendonce`].

use std::{sync::Arc, time::Instant};

use capm_api::{
    names::{self, conditions, reasons},
    v1beta1::{Initialization, MailState, MailStatus},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{Api, Resource, ResourceExt, api::Patch, runtime::controller::Action};
use serde_json::json;
use tracing::{Instrument, debug, info, warn};

use crate::{
    capi,
    context::{Ctx, ReconcileError},
    delivery,
    events::EventType,
    kinds::{InfraKind, MailText},
    sendonce::{
        Which,
        decide::{Release, Withheld, release_needed},
        execute::{OwnerCheck, Tracked, ensure_sent, patch_metadata, publish, read_records},
        records::IntentState,
    },
    status::{Readiness, Status},
    workqueue::{self, Running},
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

/// Records one reconcile in the controller metrics when dropped, so a reconcile future that
/// is dropped half-way (shutdown, lost Lease) still leaves `active_workers` right.
struct MetricsGuard<'a> {
    ctx: &'a Ctx,
    controller: &'static str,
    started: Instant,
    result: &'static str,
    /// This reconcile in the `workqueue_*` bookkeeping.
    running: Running,
}

impl<'a> MetricsGuard<'a> {
    fn start(ctx: &'a Ctx, controller: &'static str, key: &str) -> Self {
        ctx.metrics
            .active_workers
            .with_label_values(&[controller])
            .inc();
        Self {
            ctx,
            controller,
            started: Instant::now(),
            result: "cancelled",
            running: ctx.metrics.workqueue.started(controller, key),
        }
    }
}

impl Drop for MetricsGuard<'_> {
    fn drop(&mut self) {
        let m = &self.ctx.metrics;
        m.workqueue.finished(&self.running);
        m.active_workers.with_label_values(&[self.controller]).dec();
        m.reconcile_time
            .with_label_values(&[self.controller])
            .observe(self.started.elapsed().as_secs_f64());
        m.reconcile_total
            .with_label_values(&[self.controller, self.result])
            .inc();
        if self.result == "error" {
            m.reconcile_errors
                .with_label_values(&[self.controller])
                .inc();
        }
    }
}

/// One reconcile of `obj`, with metrics around it.
pub async fn reconcile<K: InfraKind>(obj: Arc<K>, ctx: Arc<Ctx>) -> Result<Action, ReconcileError> {
    let key = workqueue::key(obj.namespace().as_deref(), &obj.name_any());
    let mut guard = MetricsGuard::start(&ctx, K::CONTROLLER, &key);
    let span = obj.span();
    let result = reconcile_inner(&*obj, &ctx).instrument(span.clone()).await;
    if !matches!(&result, Ok(action) if *action != Action::await_change()) {
        // The error policy records its own requeue; a pass that waits for a change has none.
        ctx.metrics.workqueue.no_requeue(K::CONTROLLER, &key);
    }
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
        ctx.memory.succeeded(&obj.uid().unwrap_or_default());
    }
    drop(guard);
    result
}

async fn reconcile_inner<K: InfraKind>(obj: &K, ctx: &Ctx) -> Result<Action, ReconcileError> {
    let uid = obj.uid().unwrap_or_default();
    if ctx.memory.is_stale(&uid, obj.resource_version().as_deref()) {
        // Our own newer write is on its way to the cache (or the object is gone); its event
        // triggers the next pass.
        debug!(resource_version = ?obj.resource_version(),
            "The cached copy predates this process's last write (or the object is gone): waiting for the newer one");
        return Ok(Action::await_change());
    }
    // An owner missing from a cache that has not finished its first list is not missing.
    ctx.owner_caches_ready().await;
    // A replica that cannot prove it leads writes nothing at all.
    ctx.ensure_leading()?;
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
        write_status(obj, ctx, &status).await?;
    }
    outcome.map(|p| p.action)
}

async fn write_status<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    status: &Status,
) -> Result<(), ReconcileError> {
    ctx.ensure_leading()?;
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    let written = api
        .patch_status(
            &obj.name_any(),
            &crate::context::patch_params(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .map_err(ReconcileError::kube("writing status"))?;
    ctx.memory.expect_version(
        &obj.uid().unwrap_or_default(),
        written.resource_version().as_deref(),
    );
    Ok(())
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
    let Some(owner) = K::owner_in_cache(&ctx.owners, &namespace, &reference.name) else {
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
                action: ctx.requeue::<K>(obj, OWNER_RECHECK),
                gone: false,
            });
        }
        Owner::Mismatch(message) => {
            report.block(reasons::OWNER_MISMATCH, message);
            return Ok(Pass::wait());
        }
    };

    let cluster = K::cluster_in_cache(&ctx.owners, obj, &owner);
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

/// Removes release records from an object that is not being deleted: we write them only during
/// deletion, so these were written by someone else (and would suppress the release later).
async fn strip_foreign_release_records<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    tracked: &mut Tracked,
) -> Result<(), ReconcileError> {
    let keys = [
        names::DELETION_MAIL_ANNOTATION,
        names::DELETION_MAIL_INTENT_ANNOTATION,
        names::DELETION_MAIL_SENT_ANNOTATION,
    ];
    let present: Vec<&str> = keys
        .into_iter()
        .filter(|k| tracked.annotations.contains_key(*k))
        .collect();
    if present.is_empty() {
        return Ok(());
    }
    let mut annotations = serde_json::Map::new();
    for k in &present {
        annotations.insert((*k).to_owned(), serde_json::Value::Null);
    }
    let metadata = json!({
        "resourceVersion": tracked.resource_version,
        "annotations": annotations,
    });
    patch_metadata(
        obj,
        ctx,
        tracked,
        metadata,
        "removing release records of an object not being deleted",
    )
    .await?;
    publish(
        ctx,
        obj,
        EventType::Warning,
        reasons::FOREIGN_RECORD,
        format!(
            "removed {} (written only while this provider deletes an object)",
            present.join(", ")
        ),
    )
    .await;
    Ok(())
}

/// The object is wanted: its spec checked, its request mailed (`MailSent`), its fulfilment
/// shown (`Provisioned`); `Ready` summarises them. One function per condition, in Cluster API's
/// way.
async fn reconcile_normal<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    report: &mut Report,
    owner: &K::Owner,
    check: &OwnerCheck,
) -> Result<Pass, ReconcileError> {
    check_spec(obj, report)?;
    let text = match obj.request_mail(&ctx.owners, owner) {
        Ok(text) => text,
        Err(wait) => {
            report.block(wait.reason, wait.message);
            return Ok(Pass::wait());
        }
    };
    if let Some(stop) = reconcile_mail_sent(obj, ctx, report, &text, check).await? {
        return Ok(stop);
    }
    reconcile_provisioned(obj, ctx, &mut report.status).await;
    report.ready = Readiness::Summary;
    // Delivery news comes from the poller, which wakes this object's reconcile.
    Ok(Pass::wait())
}

/// A spec the CRD's schema let through but the provider cannot use blocks `Ready`.
fn check_spec<K: InfraKind>(obj: &K, report: &mut Report) -> Result<(), ReconcileError> {
    let invalid = obj.validate();
    if invalid.is_empty() {
        return Ok(());
    }
    let message = invalid
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ");
    report.block(reasons::INVALID_SPEC, message.clone());
    Err(ReconcileError::InvalidSpec(message))
}

/// `MailSent`: the request mailed exactly once ([`ensure_sent`]), `status.mail` and the
/// delivery tracking. `Ok(None)`: sent, go on; `Ok(Some(_))`: this pass stops here.
async fn reconcile_mail_sent<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    report: &mut Report,
    text: &MailText,
    check: &OwnerCheck,
) -> Result<Option<Pass>, ReconcileError> {
    let mut tracked = Tracked::of(obj, report.annotations.clone());
    strip_foreign_release_records(obj, ctx, &mut tracked).await?;
    let found = read_records(&tracked.annotations, K::KIND, Which::Request);
    for (key, why) in &found.ignored {
        debug!(key, %why, "Ignoring an annotation this provider did not write");
    }
    let wanted = obj.wanted_identity(&ctx.owners);
    let sent = ensure_sent(
        obj,
        ctx,
        &mut tracked,
        Which::Request,
        text,
        Some(check),
        &wanted,
    )
    .await;
    let status = &mut report.status;
    let outcome = match sent {
        Ok(outcome) => outcome,
        Err(ReconcileError::Withheld(Withheld::OwnerDeleting)) => {
            let message = format!(
                "the owner {} is being deleted: no request is mailed",
                K::OWNER_KIND
            );
            report.block(reasons::OWNER_DELETING, message);
            return Ok(Some(Pass::wait()));
        }
        Err(ReconcileError::Withheld(Withheld::PermanentlyRefused)) => {
            // Status already says MailFailed; nothing new until the object changes.
            report.ready = Readiness::Summary;
            return Ok(Some(Pass::wait()));
        }
        Err(error @ (ReconcileError::Withheld(_) | ReconcileError::Gone)) => return Err(error),
        Err(error @ ReconcileError::Identity { reason, .. }) => {
            // Nothing was written for the mail: it waits for a usable identity (retried with
            // backoff; creating or fixing the identity or its Secret lets it go out).
            status.set_condition(conditions::MAIL_SENT, false, reason, error.to_string());
            report.block(reason, error.to_string());
            return Err(error);
        }
        Err(error) => {
            let intent = read_records(&tracked.annotations, K::KIND, Which::Request).intent;
            mail_not_sent(status, intent.map(|i| i.message_id), &error);
            report.ready = Readiness::Summary;
            return Err(error);
        }
    };
    let previous = status.mail.take().unwrap_or_default();
    let same = previous.message_id.as_deref() == Some(outcome.message_id.as_str());
    // A delivery outcome already shown stays (it moves the state past `Sent`).
    let state = delivery::final_state(status)
        .filter(|_| same)
        .unwrap_or(MailState::Sent);
    status.mail = Some(MailStatus {
        message_id: Some(outcome.message_id.clone()),
        state: Some(state),
        sent_at: outcome
            .at
            .map(Time)
            .or_else(|| previous.sent_at.filter(|_| same)),
    });
    // The Message-Id is in status.mail.messageID, once.
    status.set_condition(conditions::MAIL_SENT, true, reasons::MAIL_SENT, "");
    let sent_at = status
        .mail
        .as_ref()
        .and_then(|m| m.sent_at.as_ref())
        .map(|t| t.0)
        .or_else(|| {
            read_records(&tracked.annotations, K::KIND, Which::Request)
                .intent
                .and_then(|i| i.at)
        });
    delivery::track(
        obj,
        ctx,
        status,
        &outcome.message_id,
        sent_at,
        outcome.identity.as_deref(),
    )
    .await;
    Ok(None)
}

/// `MailSent=False` after a failed send: `Failed` for good or `Pending` (retried), with the
/// Message-Id of the intent when one was recorded.
fn mail_not_sent(status: &mut Status, message_id: Option<String>, error: &ReconcileError) {
    let (state, reason) = if error.is_permanent() {
        (MailState::Failed, reasons::MAIL_FAILED)
    } else {
        (MailState::Pending, reasons::MAIL_PENDING)
    };
    let mail = status.mail.get_or_insert_with(MailStatus::default);
    mail.state = Some(state);
    if let Some(id) = message_id {
        mail.message_id = Some(id);
    }
    let message = if error.is_permanent() {
        format!("{error}; not retried automatically (restart the provider to retry)")
    } else {
        error.to_string()
    };
    status.set_condition(conditions::MAIL_SENT, false, reason, &message);
}

/// `Provisioned`: what the human provided (`status.initialization`, the machines' addresses),
/// with an event the first time.
async fn reconcile_provisioned<K: InfraKind>(obj: &K, ctx: &Ctx, status: &mut Status) {
    let Some(what) = obj.fulfilment() else {
        // The reason says it; README and `kubectl explain` say how to fulfil.
        status.set_condition(
            conditions::PROVISIONED,
            false,
            reasons::WAITING_FOR_FULFILLMENT,
            "",
        );
        return;
    };
    status.initialization = Some(Initialization {
        provisioned: Some(true),
    });
    if let Some(addresses) = obj.addresses() {
        status.addresses = Some(addresses);
    }
    let message = format!("fulfilled: {what}");
    let newly = status
        .condition(conditions::PROVISIONED)
        .is_none_or(|c| c.status != "True");
    status.set_condition(
        conditions::PROVISIONED,
        true,
        reasons::PROVISIONED,
        &message,
    );
    if newly {
        publish(ctx, obj, EventType::Normal, reasons::PROVISIONED, message).await;
    }
}

async fn reconcile_delete<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    report: &mut Report,
) -> Result<Pass, ReconcileError> {
    let mut tracked = Tracked::of(obj, report.annotations.clone());
    // A request that went out, or may have (outcome unknown), is released. One that was never
    // attempted, or whose every attempt was refused (recorded durably in the intent), is not:
    // nothing reached the human.
    let request = read_records(&tracked.annotations, K::KIND, Which::Request);
    let release = release_needed(
        request.sent.is_some(),
        request.intent.as_ref().map(|i| i.state),
    );
    if release == Release::Needed {
        let text = obj.deletion_mail();
        let wanted = obj.wanted_identity(&ctx.owners);
        if let Err(error) = ensure_sent(
            obj,
            ctx,
            &mut tracked,
            Which::Deletion,
            &text,
            None,
            &wanted,
        )
        .await
        {
            let message = match &error {
                ReconcileError::Withheld(Withheld::PermanentlyRefused) => {
                    "the release mail was refused permanently; not retried automatically \
                     (restart the provider to retry, or remove the finalizer by hand to give up)"
                        .to_owned()
                }
                other => other.to_string(),
            };
            report.block(reasons::DELETING, message);
            return match error {
                ReconcileError::Withheld(Withheld::PermanentlyRefused) => Ok(Pass::wait()),
                other => Err(other),
            };
        }
    } else if request
        .intent
        .is_some_and(|i| i.state == IntentState::Refused)
    {
        debug!("The request was never accepted: no release mail");
    }
    let remaining: Vec<String> = tracked
        .finalizers
        .iter()
        .filter(|f| *f != K::FINALIZER)
        .cloned()
        .collect();
    ctx.ensure_leading()?;
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    match api
        .patch(
            &obj.name_any(),
            &crate::context::patch_params(),
            &Patch::Merge(json!({
                "metadata": { "resourceVersion": tracked.resource_version, "finalizers": remaining }
            })),
        )
        .await
    {
        Ok(_) => info!("Finalizer removed"),
        Err(kube::Error::Api(s)) if s.code == 404 => {
            debug!("Already gone");
        }
        Err(e) => return Err(ReconcileError::from_write("removing the finalizer")(e)),
    }
    Ok(Pass {
        action: Action::await_change(),
        gone: true,
    })
}

#[cfg(test)]
mod tests;
