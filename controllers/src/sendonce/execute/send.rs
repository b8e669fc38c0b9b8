//! The send itself, right after the leadership check, and what its answer means.

use capm_api::names::reasons;
use std::time::Duration;

use capm_mailer::{ErrorKind, MailError, Message};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use tracing::{info, warn};

use super::{
    Outcome, Tracked, withheld,
    writes::{mark_refused, record_sent},
};
use crate::{
    context::{Ctx, ReconcileError},
    events::EventType,
    identity::Route,
    kinds::{MailText, Mailed},
    ledger::Attempt,
    sendonce::{Which, decide::Withheld, records::Sent},
};

/// Sends, right after checking that this process still leads. `fresh`: this attempt follows
/// an intent this pass wrote or re-armed, so a refusal proves nothing was ever accepted.
#[allow(clippy::too_many_arguments)]
pub(super) async fn send<K: Mailed>(
    obj: &K,
    ctx: &Ctx,
    tracked: &mut Tracked,
    which: Which,
    text: &MailText,
    id: &str,
    fresh: bool,
    route: &Route,
) -> Result<Outcome, ReconcileError> {
    let uid = obj.uid().unwrap_or_default();
    let message = build_message(obj, route, text, (id, &ctx.config.message_id_domain), which)?;
    if !ctx.leadership.may_act() {
        return Err(withheld::<K>(ctx, Withheld::NotLeading));
    }
    match route.mailer.send(&message).await {
        Ok(receipt) => {
            ctx.ledger.clear_mail(&uid, which);
            crate::failpoint::hit("after-send");
            let sent = Sent {
                message_id: Some(id.to_owned()),
                backend_id: receipt.message_id.clone(),
                at: Some(Timestamp::now()),
                identity: route.identity.clone(),
            };
            match record_sent(obj, ctx, tracked, which, &sent).await {
                Ok(()) => {}
                Err(ReconcileError::Kube {
                    source: kube::Error::Api(s),
                    ..
                }) if s.code == 404 => {
                    return Err(vanished_after_send(obj, ctx, which, route).await);
                }
                Err(e) => return Err(e),
            }
            let reason = match which {
                Which::Request | Which::Reminder(_) => reasons::MAIL_SENT,
                Which::Deletion => reasons::DELETION_MAIL_SENT,
            };
            ctx.publish(
                obj,
                EventType::Normal,
                reason,
                format!("mailed {} as {}", which.label(), receipt.message_id),
            )
            .await;
            Ok(Outcome {
                message_id: id.to_owned(),
                at: sent.at,
                identity: sent.identity,
            })
        }
        Err(MailError::Abandoned { backend, reason }) => {
            // Frozen or cut off mid-send: the backend has nothing whole, and the intent stays
            // `sending` for the replica that leads now (it waits out the hand-over, then looks
            // the mail up or sends it). Nothing else may be written from here.
            ctx.metrics.abandoned.with_label_values(&[backend]).inc();
            info!(which = which.label(), %reason, "Abandoned the send before its commit point");
            Err(ReconcileError::Withheld(Withheld::NotLeading))
        }
        Err(error) => {
            match error.kind() {
                ErrorKind::UnknownOutcome | ErrorKind::Abandoned => {}
                ErrorKind::Permanent | ErrorKind::Retryable => {
                    if fresh {
                        mark_refused(obj, ctx, tracked, which).await;
                    }
                    if error.kind() == ErrorKind::Permanent {
                        let attempt = Attempt::of(obj.meta());
                        ctx.ledger.mark_permanently_refused(&uid, which, attempt);
                    }
                }
            }
            ctx.publish(
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

/// The request went out but the object is gone: Cluster API deleted it while (or just after)
/// the intent and finalizer were written, and the API server's delete decision predated our
/// finalizer. Nobody will ever reconcile it again, so the release goes out now (the request was
/// for infrastructure nobody will use). Nothing can be recorded: counted in
/// `capm_mail_orphan_releases_total`.
async fn vanished_after_send<K: Mailed>(
    obj: &K,
    ctx: &Ctx,
    which: Which,
    route: &Route,
) -> ReconcileError {
    if which == Which::Request {
        let uid = obj.uid().unwrap_or_default();
        let id = Which::Deletion.message_id(K::KIND, &uid, &ctx.config.message_id_domain);
        let text = obj.deletion_mail();
        info!("The object vanished right after its request went out; sending its release");
        let mut delay = Duration::from_millis(500);
        for attempt in 1..=4 {
            if !ctx.leadership.may_act() {
                break;
            }
            let result = match build_message(
                obj,
                route,
                &text,
                (&id, &ctx.config.message_id_domain),
                Which::Deletion,
            ) {
                Ok(message) => route.mailer.send(&message).await,
                Err(_) => break,
            };
            match result {
                Ok(_) => {
                    ctx.metrics
                        .orphan_releases
                        .with_label_values(&[K::CONTROLLER])
                        .inc();
                    break;
                }
                Err(e) if e.kind() == ErrorKind::Retryable && attempt < 4 => {
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                Err(MailError::Abandoned { backend, reason }) => {
                    ctx.metrics.abandoned.with_label_values(&[backend]).inc();
                    info!(%reason, "Abandoned the release of a vanished object before its commit point");
                    break;
                }
                Err(e) => {
                    warn!(error = %e, "The release of a vanished object could not be sent");
                    break;
                }
            }
        }
    }
    ReconcileError::Gone
}

/// The mail `which` of `obj` as the backend gets it; a follow-up of a [`Mailed::THREADED`] kind
/// answers the mail it follows (its Message-Id is derived, as every one is, from the UID and
/// `domain`).
fn build_message<K: Mailed>(
    obj: &K,
    route: &Route,
    text: &MailText,
    (id, domain): (&str, &str),
    which: Which,
) -> Result<Message, ReconcileError> {
    // From: the sending side (its domain is the one the backend signs for, so the mail passes
    // DMARC); the requester, whose domain would not, gets the replies.
    let mut builder = Message::builder().from(&route.from);
    if let Some(reply_to) = obj.reply_to() {
        builder = builder.reply_to(reply_to);
    }
    if let Some(first) = which.follows().filter(|_| K::THREADED) {
        let uid = obj.uid().unwrap_or_default();
        builder = builder.in_reply_to(first.message_id(K::KIND, &uid, domain));
    }
    let mut builder = builder
        .subject(&text.subject)
        .text(&text.body)
        .message_id(id)
        .tag(format!("{}-{}", K::CONTROLLER, which.label()))
        .variable("namespace", obj.namespace().unwrap_or_default())
        .variable("name", obj.name_any())
        .variable("priority", obj.priority().as_str());
    for to in &route.recipients {
        builder = builder.to(to);
    }
    builder.build().map_err(ReconcileError::Message)
}
