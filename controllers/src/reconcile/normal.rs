//! `reconcile_normal`: the object is wanted. One function per condition, in Cluster API's way.

use capm_api::{
    names::{self, conditions, reasons},
    v1beta1::{Initialization, MailState, MailStatus},
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use serde_json::json;
use tracing::debug;

use super::{Pass, Report};
use crate::{
    context::{Ctx, ReconcileError},
    delivery,
    events::EventType,
    identity::IdentityError,
    kinds::{InfraKind, MailText},
    sendonce::{
        Which,
        decide::Withheld,
        execute::{OwnerCheck, Tracked, ensure_sent, patch_metadata},
        records::read_records,
    },
    status::{Readiness, Status},
};

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
    ctx.publish(
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
pub(super) async fn reconcile_normal<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    report: &mut Report,
    owner: &K::Owner,
    check: &OwnerCheck,
) -> Result<Pass, ReconcileError> {
    check_spec(obj, report)?;
    let mut text = match obj.request_mail(&ctx.capi, owner) {
        Ok(text) => text,
        Err(wait) => {
            report.block(wait.reason, wait.message);
            return Ok(Pass::wait());
        }
    };
    if let Some(links) = &ctx.config.fulfilment {
        let (domain, now) = (&ctx.config.message_id_domain, std::time::SystemTime::now());
        (text.body).push_str(&links.mail_paragraph(K::KIND, obj.meta(), domain, now));
    }
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
    let wanted = obj.wanted_identity(&ctx.capi);
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
        Err(error @ ReconcileError::Identity(IdentityError::Unusable { reason, .. })) => {
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
        format!(
            "{error}; not retried automatically (a new value of the annotation {} retries once)",
            names::RETRY_ANNOTATION
        )
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
        ctx.publish(obj, EventType::Normal, reasons::PROVISIONED, message)
            .await;
    }
}
