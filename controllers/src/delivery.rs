//! Was the request mail delivered? Sending is not delivery: after the backend accepted the
//! request mail, ask it (Mailgun's events) what became of it and show the answer in the
//! `MailDelivered` condition and `status.mail.state`.
//!
//! - First asked `delivery_poll_base` after the send (after a restart: spread over one base by
//!   UID), then with backoff (doubling to `delivery_poll_max`) only while the outcome is
//!   unknown; never after it is final (delivered, failed for good, not trackable) or once the
//!   backend's events have expired (`delivery_retention` after the send). Backends that cannot
//!   tell (SMTP) are never asked.
//! - A permanent failure is reported (condition False, a Warning event) and never leads to a
//!   resend: the send-once records are not touched, a human must act.
//! - `MailDelivered` is informational: it does not feed `Ready`.
//! - Only the request mail is followed; the release mail sent during deletion is not (the object
//!   is gone right after it).
//!
//! What it remembers between passes (the schedule of questions) lives in memory only; the
//! answers live in status. A new process (or a wiped status) asks again, at most until the
//! retention has passed.

use std::time::{Duration, SystemTime};

use capm_api::{
    names::{conditions, reasons},
    v1beta1::MailState,
};
use capm_mailer::{Delivery, MessageId};
use k8s_openapi::jiff::Timestamp;
use kube::ResourceExt;
use tracing::{debug, warn};

use crate::{
    context::Ctx, events::EventType, kinds::InfraKind, sendonce::execute::publish, status::Status,
};

/// The final `MailDelivered` reasons: no more questions once one of them is shown.
const FINAL: &[&str] = &[
    reasons::DELIVERED,
    reasons::DELIVERY_FAILED,
    reasons::DELIVERY_UNKNOWN,
    reasons::NOT_TRACKABLE,
];

/// The `status.mail.state` a final `MailDelivered` condition implies, if any.
pub(crate) fn final_state(status: &Status) -> Option<MailState> {
    let c = status.condition(conditions::MAIL_DELIVERED)?;
    match c.reason.as_str() {
        reasons::DELIVERED => Some(MailState::Delivered),
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

/// Follows the delivery of the request mail `message_id`, accepted at `sent_at`, and updates
/// `status` (only what changed). Returns when to look again, `None` when the outcome is final.
pub(crate) async fn track<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    status: &mut Status,
    message_id: &str,
    sent_at: Option<Timestamp>,
) -> Option<Duration> {
    let mail_key = format!("{}/delivery", obj.uid().unwrap_or_default());
    let generation = obj.meta().generation;
    // Every condition of a pass speaks for the generation the pass saw, this one too: it moves
    // with the others, in the same write, not alone at the next question (a status write that
    // says nothing new; the soak found it).
    if let Some(c) = status.conditions.as_mut().and_then(|cs| {
        cs.iter_mut()
            .find(|c| c.type_ == conditions::MAIL_DELIVERED)
    }) {
        c.observed_generation = generation;
    }
    if is_final(status) {
        return None;
    }
    let backend = ctx.mailer.backend();
    if !ctx.mailer.tracks_delivery() {
        show(obj, ctx, status, &not_trackable(backend), generation).await;
        return None;
    }
    let now = Timestamp::now();
    // The send time is in the durable record; without it (found by lookup after a crash), the
    // intent's time is the best bound. Without either (records of an older or foreign writer)
    // the retention cannot be bounded: do not ask at all.
    let Some(sent_at) = sent_at else {
        let unknown = Shown {
            status: "Unknown",
            reason: reasons::DELIVERY_UNKNOWN,
            message: "no send time is recorded for the mail; its delivery is not asked about"
                .to_owned(),
            outcome: "unknown",
        };
        show(obj, ctx, status, &unknown, generation).await;
        return None;
    };
    let elapsed = Duration::from_millis(
        u64::try_from(
            now.as_millisecond()
                .saturating_sub(sent_at.as_millisecond()),
        )
        .unwrap_or(0),
    );
    let retention = ctx.config.delivery_retention;
    let shown = if elapsed >= retention {
        Some(Shown {
            status: "Unknown",
            reason: reasons::DELIVERY_UNKNOWN,
            message: format!(
                "{backend} accepted the mail but reported no delivery outcome within the \
                 {}s its events are kept; no longer asking",
                retention.as_secs()
            ),
            outcome: "unknown",
        })
    } else {
        let first = first_question_in(
            ctx.config.delivery_poll_base,
            elapsed,
            &obj.uid().unwrap_or_default(),
        );
        let wait = ctx.delivery_wait(&mail_key, first);
        if !wait.is_zero() {
            if status.condition(conditions::MAIL_DELIVERED).is_none() {
                show(obj, ctx, status, &pending(backend), generation).await;
            }
            return Some(wait.min(retention - elapsed));
        }
        let id = match MessageId::parse(message_id) {
            Ok(id) => id,
            Err(error) => {
                warn!(kind = K::KIND, name = %obj.name_any(), %error, "the recorded Message-Id cannot be asked about");
                return None;
            }
        };
        match ctx
            .mailer
            .delivery_status(&id, SystemTime::from(sent_at))
            .await
        {
            Ok(Delivery::NotTrackable) => Some(not_trackable(backend)),
            Ok(Delivery::Delivered) => Some(Shown {
                status: "True",
                reason: reasons::DELIVERED,
                message: format!("{backend} delivered the mail to the recipients' mail server"),
                outcome: "delivered",
            }),
            Ok(Delivery::Failed { reason }) => Some(Shown {
                status: "False",
                reason: reasons::DELIVERY_FAILED,
                message: format!(
                    "{backend} could not deliver the mail: {reason}. The provider never \
                     resends because of a delivery failure: a human must act (fix the \
                     recipient or relay, then mail the request by hand or re-create the object)"
                ),
                outcome: "failed",
            }),
            Ok(Delivery::Pending { temporary_failure }) => {
                let wait = ctx.delivery_polled(&mail_key, None);
                let pending = match temporary_failure {
                    Some(why) => Shown {
                        status: "Unknown",
                        reason: reasons::DELIVERY_DELAYED,
                        message: format!(
                            "{backend} failed to deliver the mail for now and retries: {why}"
                        ),
                        outcome: "delayed",
                    },
                    None => pending(backend),
                };
                show(obj, ctx, status, &pending, generation).await;
                return Some(wait.min(retention - elapsed));
            }
            Err(error) => {
                // Asking changes nothing: keep what status shows and ask again later.
                let wait = ctx.delivery_polled(&mail_key, error.retry_after());
                debug!(kind = K::KIND, name = %obj.name_any(), %error, ?wait, "could not ask about the delivery");
                if status.condition(conditions::MAIL_DELIVERED).is_none() {
                    show(obj, ctx, status, &pending(backend), generation).await;
                }
                return Some(wait.min(retention - elapsed));
            }
        }
    };
    if let Some(shown) = shown {
        show(obj, ctx, status, &shown, generation).await;
    }
    ctx.clear_mail(&mail_key);
    None
}

fn not_trackable(backend: &str) -> Shown {
    Shown {
        status: "Unknown",
        reason: reasons::NOT_TRACKABLE,
        message: format!(
            "the {backend} backend reports only that it accepted the mail; whether it reached \
             the recipients cannot be known"
        ),
        outcome: "not_trackable",
    }
}

fn pending(backend: &str) -> Shown {
    Shown {
        status: "Unknown",
        reason: reasons::DELIVERY_PENDING,
        message: format!("{backend} accepted the mail; no delivery report yet"),
        outcome: "",
    }
}

/// When this process asks its first delivery question about a mail accepted `elapsed` ago:
/// never before `base` after the send (an answer within the send's own pass is all but always
/// "no report yet", and the question would sit on the reconcile's path), and, for mails found
/// already older (this process just started or took over), spread over one `base` by the
/// object's UID, so a restart does not ask about every open mail at once.
fn first_question_in(base: Duration, elapsed: Duration, uid: &str) -> Duration {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    uid.hash(&mut hasher);
    let spread = base.mul_f64((hasher.finish() % 1024) as f64 / 1024.0);
    base.saturating_sub(elapsed).max(spread)
}

/// Shows `shown` in the condition and the mail state; counts and announces it only when it is
/// news (a different reason than status showed).
async fn show<K: InfraKind>(
    obj: &K,
    ctx: &Ctx,
    status: &mut Status,
    shown: &Shown,
    generation: Option<i64>,
) {
    let news = status
        .condition(conditions::MAIL_DELIVERED)
        .is_none_or(|c| c.reason != shown.reason);
    status.set_condition_status(
        conditions::MAIL_DELIVERED,
        shown.status,
        shown.reason,
        shown.message.clone(),
        generation,
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
            .with_label_values(&[ctx.mailer.backend(), shown.outcome])
            .inc();
    }
    if shown.reason == reasons::DELIVERY_FAILED {
        warn!(kind = K::KIND, name = %obj.name_any(), "the request mail could not be delivered; not resent");
        publish(
            ctx,
            obj,
            EventType::Warning,
            reasons::DELIVERY_FAILED,
            shown.message.clone(),
        )
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_question_waits_a_base_after_the_send_and_spreads_a_restart() {
        let base = Duration::from_secs(30);
        // Just sent: one base, whatever the UID.
        for uid in ["a", "b", "c"] {
            assert_eq!(first_question_in(base, Duration::ZERO, uid), base);
        }
        // Found older (a restart): within one base, different objects at different times.
        let later: Vec<_> = (0..100)
            .map(|i| first_question_in(base, Duration::from_secs(3600), &format!("uid-{i}")))
            .collect();
        assert!(later.iter().all(|w| *w < base));
        let distinct: std::collections::HashSet<_> = later.iter().collect();
        assert!(distinct.len() > 50, "not spread: {distinct:?}");
        // Sent 20 s ago: at least the 10 s left of the base.
        assert!(first_question_in(base, Duration::from_secs(20), "a") >= Duration::from_secs(10));
        // The same object always gets the same slot (a replay behaves the same).
        assert_eq!(
            first_question_in(base, Duration::from_secs(3600), "x"),
            first_question_in(base, Duration::from_secs(3600), "x")
        );
    }
}
