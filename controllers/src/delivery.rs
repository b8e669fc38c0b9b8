//! Was the request mail delivered? Sending is not delivery: after the backend accepted the
//! request mail, the process's delivery poller ([`crate::poller`]) asks it what became of it, and
//! a reconcile shows the answer in the `MailDelivered` condition and `status.mail.state`; a
//! delivery failure never leads to a resend. The schedule and what each answer shows:
//! docs/how-it-works.md, step 4.

use std::{sync::Arc, time::SystemTime};

use capm_api::{
    names::{conditions, reasons},
    v1beta1::MailState,
};
use capm_mailer::{Delivery, MessageId, Tracking};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use tracing::{debug, warn};

use crate::{
    context::Ctx, events::EventType, identity::Access::Recorded, kinds::Mailed, status::Status,
};

/// The final `MailDelivered` reasons: no more questions once one of them is shown.
const FINAL: &[&str] = &[
    reasons::DELIVERED,
    reasons::PARTLY_DELIVERED,
    reasons::DELIVERY_FAILED,
    reasons::DELIVERY_UNKNOWN,
    reasons::NOT_TRACKABLE,
];

/// The `status.mail.state` a final `MailDelivered` condition implies, if any.
pub(crate) fn final_state(status: &Status) -> Option<MailState> {
    let c = status.condition(conditions::MAIL_DELIVERED)?;
    match c.reason.as_str() {
        reasons::DELIVERED | reasons::PARTLY_DELIVERED => Some(MailState::Delivered),
        reasons::DELIVERY_FAILED => Some(MailState::Failed),
        _ => None,
    }
}

fn is_final(status: &Status) -> bool {
    status
        .condition(conditions::MAIL_DELIVERED)
        .is_some_and(|c| FINAL.contains(&c.reason.as_str()))
}

/// What one pass decided to show.
struct Shown {
    status: &'static str,
    reason: &'static str,
    message: String,
    /// `capm_mail_delivery_total`'s outcome label.
    outcome: &'static str,
}

/// Shows what is known of the delivery of the request mail `message_id`, accepted at
/// `sent_at`, in `status` (only what changed), and keeps the mail on the delivery poller's list
/// while its outcome is open; the poller wakes this object's reconcile when it learns news.
pub(crate) async fn track<K: Mailed>(
    obj: &K,
    ctx: &Ctx,
    status: &mut Status,
    message_id: &str,
    sent_at: Option<Timestamp>,
    identity: Option<&str>,
) {
    let uid = obj.uid().unwrap_or_default();
    // The backend the mail went through, and the poller asking it: the provider's own, or the
    // identity's (each identity's poller has its own budget).
    let (mailer, poller) = match identity {
        None => (Arc::clone(&ctx.mailer), Arc::clone(&ctx.poller)),
        Some(identity) => {
            let namespace = obj.namespace().unwrap_or_default();
            let route = ctx.identities.route(Some(identity), &namespace, Recorded);
            match route.await {
                Ok(route) => (route.mailer, route.poller),
                Err(error) => {
                    // Not final: the identity may be fixed; the next pass asks again.
                    debug!(identity, %error, "The identity of a sent mail cannot be asked about its delivery now");
                    if status.condition(conditions::MAIL_DELIVERED).is_none() {
                        let backend = ctx.mailer.backend();
                        show(obj, ctx, (backend, identity), status, &pending()).await;
                    }
                    return;
                }
            }
        }
    };
    if is_final(status) {
        ctx.ledger.mail_final(&uid);
        return;
    }
    let backend = mailer.backend();
    let via = (backend, identity.unwrap_or_default());
    if let Tracking::Untracked(why) = mailer.tracking() {
        ctx.ledger.mail_final(&uid);
        show(
            obj,
            ctx,
            via,
            status,
            &not_trackable(backend, why.as_deref()),
        )
        .await;
        return;
    }
    // The send time is in the durable record; without it (found by lookup after a crash), the
    // intent's time is the best bound. Without either (records of an older or foreign writer)
    // the retention cannot be bounded: do not ask at all.
    let Some(sent_at) = sent_at else {
        let why = "no send time is recorded for the mail; its delivery is not asked about";
        show(obj, ctx, via, status, &unknown(why.to_owned())).await;
        return;
    };
    let elapsed = crate::sendonce::execute::age(Timestamp::now(), sent_at);
    let retention = ctx.config.delivery_retention;
    if elapsed >= retention {
        ctx.ledger.mail_final(&uid);
        let why = format!(
            "{backend} accepted the mail but reported no delivery outcome within the {}s its \
             events are kept; no longer asking",
            retention.as_secs()
        );
        show(obj, ctx, via, status, &unknown(why)).await;
        return;
    }
    let id = match MessageId::parse(message_id) {
        Ok(id) => id,
        Err(error) => {
            warn!(%error, "The recorded Message-Id cannot be asked about");
            return;
        }
    };
    if !ctx.ledger.track(&uid, &poller) {
        return; // gone
    }
    match poller.track(obj, &uid, id, SystemTime::from(sent_at), elapsed) {
        Some(delivery) => show(obj, ctx, via, status, &shown(backend, delivery)).await,
        // Nothing learned yet (just sent, or this process just started): keep what status
        // shows, "pending" when it shows nothing.
        None if status.condition(conditions::MAIL_DELIVERED).is_none() => {
            show(obj, ctx, via, status, &pending()).await;
        }
        None => {}
    }
}

/// What status shows for what the backend said.
fn shown(backend: &str, delivery: Delivery) -> Shown {
    match delivery {
        Delivery::NotTrackable => not_trackable(backend, None),
        Delivery::Delivered => Shown {
            status: "True",
            reason: reasons::DELIVERED,
            message: format!("{backend} delivered the mail to the recipients' mail server"),
            outcome: "delivered",
        },
        Delivery::PartlyDelivered { failed } => Shown {
            status: "True",
            reason: reasons::PARTLY_DELIVERED,
            message: format!(
                "{backend} delivered the mail to some recipients but not to others: {failed}. \
                 The provider never resends because of a delivery failure: a human must act \
                 (fix the recipient, then forward the request)"
            ),
            outcome: "partly_delivered",
        },
        Delivery::Failed { reason } => Shown {
            status: "False",
            reason: reasons::DELIVERY_FAILED,
            message: format!(
                "{backend} could not deliver the mail: {reason}. The provider never \
                 resends because of a delivery failure: a human must act (fix the \
                 recipient or relay, then mail the request by hand or re-create the object)"
            ),
            outcome: "failed",
        },
        Delivery::Pending {
            temporary_failure: Some(why),
        } => Shown {
            status: "Unknown",
            reason: reasons::DELIVERY_DELAYED,
            message: format!("{backend} failed to deliver the mail for now and retries: {why}"),
            outcome: "delayed",
        },
        Delivery::Pending {
            temporary_failure: None,
        } => pending(),
    }
}

fn not_trackable(backend: &str, why: Option<&str>) -> Shown {
    let message = format!("{backend} cannot tell whether the mail reached the recipients");
    Shown {
        status: "Unknown",
        reason: reasons::NOT_TRACKABLE,
        message: match why {
            Some(why) => format!("{message}: {why}"),
            None => message,
        },
        outcome: "not_trackable",
    }
}

fn unknown(message: String) -> Shown {
    Shown {
        status: "Unknown",
        reason: reasons::DELIVERY_UNKNOWN,
        message,
        outcome: "unknown",
    }
}

fn pending() -> Shown {
    Shown {
        status: "Unknown",
        reason: reasons::DELIVERY_PENDING,
        // The reason says it all; `status.mail.state` shows `Sent`.
        message: String::new(),
        outcome: "",
    }
}

/// Shows `shown` in the condition and the mail state; counts and announces it only when it is
/// news (a different reason than status showed).
async fn show<K: Mailed>(
    obj: &K,
    ctx: &Ctx,
    (backend, identity): (&str, &str),
    status: &mut Status,
    shown: &Shown,
) {
    let news = status
        .condition(conditions::MAIL_DELIVERED)
        .is_none_or(|c| c.reason != shown.reason);
    status.set_condition_status(
        conditions::MAIL_DELIVERED,
        shown.status,
        shown.reason,
        shown.message.clone(),
    );
    if let Some(state) = final_state(status)
        && let Some(mail) = status.mail.as_mut()
    {
        mail.state = Some(state);
    }
    if !news {
        return;
    }
    if !shown.outcome.is_empty() {
        ctx.metrics
            .delivery
            .with_label_values(&[backend, identity, shown.outcome])
            .inc();
    }
    if shown.reason == reasons::DELIVERY_FAILED || shown.reason == reasons::PARTLY_DELIVERED {
        warn!(
            reason = shown.reason,
            "The request mail could not be delivered to every recipient; not resent"
        );
        ctx.publish(obj, EventType::Warning, shown.reason, shown.message.clone())
            .await;
    }
}
