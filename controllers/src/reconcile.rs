//! The reconcile loop shared by both kinds: owner -> paused -> `reconcile_normal` /
//! `reconcile_delete`, one status write at the end when something changed, and the crash-safe
//! "send exactly one mail" recipe.

use std::{collections::BTreeMap, sync::Arc, time::Instant};

use capm_api::{
    names::{self, conditions, reasons},
    v1beta1::{Initialization, MailState, MailStatus},
};
use capm_mailer::{ErrorKind, Lookup, Message, MessageId};
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::{
    Api, ResourceExt,
    api::{Patch, PatchParams},
    runtime::controller::Action,
};
use serde_json::json;
use tracing::{info, warn};

use crate::{
    capi,
    context::{Attempt, Ctx, ReconcileError},
    events::EventType,
    kinds::{InfraKind, MailText},
    status::Status,
};

/// Which of an object's two mails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    /// "One cluster please".
    Request,
    /// "No longer needed", sent during deletion if a request went out.
    Deletion,
}

impl Which {
    fn intent_key(self) -> &'static str {
        match self {
            Self::Request => names::MAIL_INTENT_ANNOTATION,
            Self::Deletion => names::DELETION_MAIL_INTENT_ANNOTATION,
        }
    }
    fn sent_key(self) -> &'static str {
        match self {
            Self::Request => names::MAIL_SENT_ANNOTATION,
            Self::Deletion => names::DELETION_MAIL_SENT_ANNOTATION,
        }
    }
    fn message_id(self, kind: &str, uid: &str, domain: &str) -> String {
        match self {
            Self::Request => names::message_id(kind, uid, domain),
            Self::Deletion => names::deletion_message_id(kind, uid, domain),
        }
    }
    fn label(self) -> &'static str {
        match self {
            Self::Request => "request",
            Self::Deletion => "deletion",
        }
    }
}

/// The object's metadata as this pass last wrote or read it.
struct Tracked {
    resource_version: Option<String>,
    annotations: BTreeMap<String, String>,
    finalizers: Vec<String>,
}

impl Tracked {
    fn of(obj: &impl ResourceExt) -> Self {
        Self {
            resource_version: obj.resource_version(),
            annotations: obj.annotations().clone(),
            finalizers: obj.finalizers().to_vec(),
        }
    }
}

/// The result of one pass, before the status write.
struct Pass {
    action: Action,
    /// The object no longer exists (finalizer removed): no status to write.
    gone: bool,
}

/// One reconcile of `obj`, with metrics around it.
pub async fn reconcile<K: InfraKind>(obj: Arc<K>, ctx: Arc<Ctx>) -> Result<Action, ReconcileError> {
    let metrics = &ctx.metrics;
    let controller = K::CONTROLLER;
    metrics
        .active_workers
        .with_label_values(&[controller])
        .inc();
    let started = Instant::now();
    let result = reconcile_inner(&*obj, &ctx).await;
    metrics
        .active_workers
        .with_label_values(&[controller])
        .dec();
    metrics
        .reconcile_time
        .with_label_values(&[controller])
        .observe(started.elapsed().as_secs_f64());
    let result_label = match &result {
        Ok(_) => "success",
        Err(_) => "error",
    };
    metrics
        .reconcile_total
        .with_label_values(&[controller, result_label])
        .inc();
    if result.is_ok() {
        ctx.succeeded(&key(&*obj));
    } else {
        metrics
            .reconcile_errors
            .with_label_values(&[controller])
            .inc();
    }
    result
}

/// Per-object key for backoff bookkeeping.
pub fn key(obj: &impl ResourceExt) -> String {
    format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any())
}

async fn reconcile_inner<K: InfraKind>(obj: &K, ctx: &Ctx) -> Result<Action, ReconcileError> {
    let uid = obj.uid().unwrap_or_default();
    if ctx.is_stale(&uid, obj.resource_version().as_deref()) {
        // Our own newer write is on its way to the cache; its event triggers the next pass.
        return Ok(Action::await_change());
    }
    if obj.annotations().contains_key(names::MANAGED_BY_ANNOTATION) {
        return Ok(Action::await_change());
    }
    let original = obj.current_status();
    let mut status = original.clone();
    status.observed_generation = obj.meta().generation;
    let outcome = steps(obj, ctx, &mut status).await;
    let gone = matches!(outcome, Ok(Pass { gone: true, .. }));
    if !gone && status != original {
        write_status(obj, ctx, &status).await?;
    }
    if gone {
        ctx.forget(&uid);
    }
    outcome.map(|p| p.action)
}

async fn write_status<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    status: &Status,
) -> Result<(), ReconcileError> {
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    let written = api
        .patch_status(
            &obj.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({ "status": status })),
        )
        .await
        .map_err(ReconcileError::kube("writing status"))?;
    ctx.expect_version(
        &obj.uid().unwrap_or_default(),
        written.resource_version().as_deref(),
    );
    Ok(())
}

async fn steps<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    status: &mut Status,
) -> Result<Pass, ReconcileError> {
    let generation = obj.meta().generation;
    let deleting = obj.meta().deletion_timestamp.is_some();
    let has_finalizer = obj.finalizers().iter().any(|f| f == K::FINALIZER);
    if deleting && !has_finalizer {
        return Ok(Pass {
            action: Action::await_change(),
            gone: false,
        });
    }
    let namespace = obj.namespace().unwrap_or_default();
    let owner = capi::owner(obj.owner_references(), K::OWNER_KIND)
        .and_then(|o| K::owner_in_cache(ctx, &namespace, &o.name));
    let Some(owner) = owner else {
        if deleting {
            // The owner is gone first (or never came): nothing can pause us; clean up.
            return reconcile_delete(obj, ctx, status).await;
        }
        let message = format!("waiting for Cluster API to set an owner {}", K::OWNER_KIND);
        status.set_condition(
            conditions::READY,
            false,
            reasons::WAITING_FOR_OWNER,
            &message,
            generation,
        );
        return Ok(Pass {
            action: Action::await_change(),
            gone: false,
        });
    };

    let cluster = K::cluster_in_cache(ctx, obj, &owner);
    let paused = obj.annotations().contains_key(names::PAUSED_ANNOTATION)
        || cluster.as_deref().is_some_and(capi::Cluster::paused);
    if paused {
        status.set_condition(
            conditions::PAUSED,
            true,
            reasons::PAUSED,
            "reconciliation is paused",
            generation,
        );
        return Ok(Pass {
            action: Action::await_change(),
            gone: false,
        });
    }
    status.set_condition(
        conditions::PAUSED,
        false,
        reasons::NOT_PAUSED,
        "",
        generation,
    );

    if deleting {
        reconcile_delete(obj, ctx, status).await
    } else {
        reconcile_normal(obj, ctx, status, &owner).await
    }
}

async fn reconcile_normal<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    status: &mut Status,
    owner: &K::Owner,
) -> Result<Pass, ReconcileError> {
    let generation = obj.meta().generation;
    let invalid = obj.validate();
    if !invalid.is_empty() {
        let message = invalid
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("; ");
        status.set_condition(
            conditions::READY,
            false,
            reasons::INVALID_SPEC,
            &message,
            generation,
        );
        return Err(ReconcileError::InvalidSpec(message));
    }
    let text = match obj.request_mail(ctx, owner) {
        Ok(text) => text,
        Err(wait) => {
            status.set_condition(
                conditions::READY,
                false,
                wait.reason,
                &wait.message,
                generation,
            );
            return Ok(Pass {
                action: Action::await_change(),
                gone: false,
            });
        }
    };

    let mut tracked = Tracked::of(obj);
    match ensure_sent(obj, ctx, &mut tracked, Which::Request, &text).await {
        Ok((id, just_sent)) => {
            let previous = status.mail.take().unwrap_or_default();
            status.mail = Some(MailStatus {
                message_id: Some(id.clone()),
                state: Some(MailState::Sent),
                sent_at: previous
                    .sent_at
                    .filter(|_| previous.message_id.as_deref() == Some(id.as_str()))
                    .or_else(|| just_sent.then(|| Time(Timestamp::now()))),
            });
            status.set_condition(
                conditions::MAIL_SENT,
                true,
                reasons::MAIL_SENT,
                format!("request mailed as {id}"),
                generation,
            );
        }
        Err(error) => {
            let pending = tracked
                .annotations
                .contains_key(Which::Request.intent_key());
            let state = if error.is_permanent() {
                MailState::Failed
            } else {
                MailState::Pending
            };
            let mail = status.mail.get_or_insert_with(MailStatus::default);
            mail.state = Some(state);
            if pending {
                mail.message_id = tracked
                    .annotations
                    .get(Which::Request.intent_key())
                    .cloned();
            }
            let reason = if error.is_permanent() {
                reasons::MAIL_FAILED
            } else {
                reasons::MAIL_PENDING
            };
            status.set_condition(
                conditions::MAIL_SENT,
                false,
                reason,
                error.to_string(),
                generation,
            );
            status.set_condition(
                conditions::READY,
                false,
                reason,
                error.to_string(),
                generation,
            );
            return Err(error);
        }
    }

    match obj.fulfilment() {
        Some(what) => {
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
                generation,
            );
            status.set_condition(
                conditions::READY,
                true,
                reasons::PROVISIONED,
                &message,
                generation,
            );
            if newly {
                publish(ctx, obj, EventType::Normal, reasons::PROVISIONED, message).await;
            }
        }
        None => {
            let message = "mailed; waiting for a human to fulfil the request";
            status.set_condition(
                conditions::PROVISIONED,
                false,
                reasons::WAITING_FOR_FULFILLMENT,
                message,
                generation,
            );
            status.set_condition(
                conditions::READY,
                false,
                reasons::WAITING_FOR_FULFILLMENT,
                message,
                generation,
            );
        }
    }
    Ok(Pass {
        action: Action::await_change(),
        gone: false,
    })
}

async fn reconcile_delete<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    status: &mut Status,
) -> Result<Pass, ReconcileError> {
    let generation = obj.meta().generation;
    let mut tracked = Tracked::of(obj);
    // A request that may have gone out (sent, or an intent whose outcome is unknown) is
    // cancelled: a spurious "no longer needed" costs less than infrastructure nobody uses.
    // A request whose last attempt was refused permanently never went out: nothing to cancel,
    // and trying would fail the same way and keep the finalizer forever.
    let refused = !tracked.annotations.contains_key(Which::Request.sent_key())
        && status.mail.as_ref().and_then(|m| m.state) == Some(MailState::Failed);
    let requested = tracked
        .annotations
        .contains_key(Which::Request.intent_key())
        && !refused;
    if requested {
        let text = obj.deletion_mail();
        if let Err(error) = ensure_sent(obj, ctx, &mut tracked, Which::Deletion, &text).await {
            status.set_condition(
                conditions::READY,
                false,
                reasons::DELETING,
                error.to_string(),
                generation,
            );
            return Err(error);
        }
    }
    let remaining: Vec<String> = tracked
        .finalizers
        .iter()
        .filter(|f| *f != K::FINALIZER)
        .cloned()
        .collect();
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    api.patch(
        &obj.name_any(),
        &PatchParams::default(),
        &Patch::Merge(json!({
            "metadata": { "resourceVersion": tracked.resource_version, "finalizers": remaining }
        })),
    )
    .await
    .map_err(ReconcileError::from_write("removing the finalizer"))?;
    info!(kind = K::KIND, name = %obj.name_any(), "finalizer removed");
    Ok(Pass {
        action: Action::await_change(),
        gone: true,
    })
}

/// Sends one of the object's mails at most once, crash-safely:
/// 1. record the intent (deterministic Message-Id) in metadata, guarded by `resourceVersion`
///    (also adds the finalizer);
/// 2. send with that Message-Id;
/// 3. record "sent" in metadata.
///
/// An intent without "sent" found later means an earlier attempt's outcome is unknown: the
/// backend is asked first; one that cannot answer gets the mail again with the same Message-Id.
/// Returns the backend's id and whether it was sent in this call.
async fn ensure_sent<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    tracked: &mut Tracked,
    which: Which,
    text: &MailText,
) -> Result<(String, bool), ReconcileError> {
    if let Some(sent) = tracked.annotations.get(which.sent_key()) {
        return Ok((sent.clone(), false));
    }
    let uid = obj.uid().unwrap_or_default();
    let mail_key = format!("{uid}/{}", which.label());
    let id = which.message_id(K::KIND, &uid, &ctx.config.message_id_domain);
    let message_id = MessageId::parse(&id).map_err(ReconcileError::Message)?;
    let api: Api<K> = Api::namespaced(ctx.client.clone(), &obj.namespace().unwrap_or_default());
    let name = obj.name_any();

    let mut resend = false;
    if tracked.annotations.contains_key(which.intent_key()) {
        match ctx.attempt(&mail_key) {
            // Our own last attempt was refused outright: just try again.
            Some(Attempt::NotSent) => {}
            previous => match ctx
                .mailer
                .lookup(&message_id)
                .await
                .map_err(ReconcileError::Mail)?
            {
                Lookup::Accepted { event } => {
                    info!(kind = K::KIND, %name, %id, %event, "the backend already accepted the pending mail");
                    record_sent(obj, ctx, &api, tracked, which, &id).await?;
                    return Ok((id, false));
                }
                Lookup::NotFound => {
                    // Event stores lag: trust "not found" only after a grace period.
                    let grace = ctx.config.lookup_grace;
                    match previous {
                        Some(Attempt::NotFoundAt(at)) if at.elapsed() >= grace => resend = true,
                        Some(Attempt::NotFoundAt(at)) => {
                            return Err(ReconcileError::AwaitingLookup(
                                grace.saturating_sub(at.elapsed()),
                            ));
                        }
                        _ => {
                            ctx.set_attempt(&mail_key, Some(Attempt::NotFoundAt(Instant::now())));
                            return Err(ReconcileError::AwaitingLookup(grace));
                        }
                    }
                }
                Lookup::Unsupported => resend = true,
            },
        }
    } else {
        let mut annotations = serde_json::Map::new();
        annotations.insert(which.intent_key().into(), id.clone().into());
        let mut metadata = json!({
            "resourceVersion": tracked.resource_version,
            "annotations": annotations,
        });
        if !tracked.finalizers.iter().any(|f| f == K::FINALIZER) {
            let mut finalizers = tracked.finalizers.clone();
            finalizers.push(K::FINALIZER.to_owned());
            metadata["finalizers"] = json!(finalizers);
        }
        let written = api
            .patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(json!({ "metadata": metadata })),
            )
            .await
            .map_err(ReconcileError::from_write("recording the mail intent"))?;
        adopt(ctx, tracked, &written);
    }

    crate::failpoint::hit("after-intent");
    let message = build_message(obj, ctx, text, &id, which)?;
    if resend {
        ctx.metrics
            .resends
            .with_label_values(&[K::CONTROLLER])
            .inc();
        warn!(kind = K::KIND, %name, %id, "sending again with the same Message-Id: the earlier outcome is unknown");
    }
    match ctx.mailer.send(&message).await {
        Ok(receipt) => {
            ctx.set_attempt(&mail_key, None);
            crate::failpoint::hit("after-send");
            record_sent(obj, ctx, &api, tracked, which, &receipt.message_id).await?;
            let reason = match which {
                Which::Request => reasons::MAIL_SENT,
                Which::Deletion => "DeletionMailSent",
            };
            publish(
                ctx,
                obj,
                EventType::Normal,
                reason,
                format!("mailed {} as {}", which.label(), receipt.message_id),
            )
            .await;
            Ok((receipt.message_id, true))
        }
        Err(error) => {
            let attempt = match error.kind() {
                ErrorKind::UnknownOutcome => Attempt::Unknown,
                ErrorKind::Permanent | ErrorKind::Retryable => Attempt::NotSent,
            };
            ctx.set_attempt(&mail_key, Some(attempt));
            publish(
                ctx,
                obj,
                EventType::Warning,
                reasons::MAIL_FAILED,
                format!("{} mail: {error}", which.label()),
            )
            .await;
            Err(ReconcileError::Mail(error))
        }
    }
}

async fn record_sent<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    api: &Api<K>,
    tracked: &mut Tracked,
    which: Which,
    id: &str,
) -> Result<(), ReconcileError> {
    // Adding one annotation clobbers nothing, so no resourceVersion precondition: a concurrent
    // change (Cluster API adding a label, a human fulfilling) must not make us lose the record.
    let written = api
        .patch(
            &obj.name_any(),
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "annotations": { which.sent_key(): id } } })),
        )
        .await
        .map_err(ReconcileError::kube("recording the mail as sent"))?;
    adopt(ctx, tracked, &written);
    Ok(())
}

fn adopt<K: InfraKind>(ctx: &Ctx, tracked: &mut Tracked, written: &K) {
    tracked.resource_version = written.resource_version();
    tracked.annotations = written.annotations().clone();
    tracked.finalizers = written.finalizers().to_vec();
    ctx.expect_version(
        &written.uid().unwrap_or_default(),
        written.resource_version().as_deref(),
    );
}

fn build_message<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    text: &MailText,
    id: &str,
    which: Which,
) -> Result<Message, ReconcileError> {
    let mut builder = Message::builder()
        .from(obj.requester())
        .subject(&text.subject)
        .text(&text.body)
        .message_id(id)
        .tag(format!("{}-{}", K::CONTROLLER, which.label()))
        .variable("namespace", obj.namespace().unwrap_or_default())
        .variable("name", obj.name_any())
        .variable("priority", obj.priority().as_str());
    for to in &ctx.config.recipients {
        builder = builder.to(to);
    }
    builder.build().map_err(ReconcileError::Message)
}

async fn publish<K: InfraKind>(
    ctx: &Ctx,
    obj: &K,
    type_: EventType,
    reason: &'static str,
    note: String,
) {
    if let Err(e) = ctx
        .events
        .publish(&obj.object_ref(&()), type_, reason, note)
        .await
    {
        warn!(kind = K::KIND, name = %obj.name_any(), error = %e, "could not record an event");
    }
}
