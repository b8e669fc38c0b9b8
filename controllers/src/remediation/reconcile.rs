//! One pass of a `MailgunRemediation`: what is believed of its Machine, [`decide`] asked until
//! it says to wait, each answer performed (a mail through the send-once layer, the hand-back,
//! the finalizer), then one status write when something changed.

use std::{sync::Arc, time::Duration};

use capm_api::{
    names::{REMEDIATE_MACHINE_ANNOTATION, conditions, reasons},
    owner_remediated::HEALTH_CHECK_SUCCEEDED,
    v1beta1::{HandBackReason, MailgunRemediation},
};
use capm_mailer::text::clean;
use k8s_openapi::{apimachinery::pkg::apis::meta::v1::Time, jiff::Timestamp};
use kube::{Resource, ResourceExt, runtime::controller::Action};
use serde_json::{Value, json};

use super::{
    decide::{Brake, Mail, Next, decide, phase},
    handback, mail, mail_of,
    shown::{Pass, phase_reason},
    view::{Believed, believe},
};
use crate::{
    context::{Ctx, ReconcileError},
    delivery,
    events::EventType,
    kinds::Mailed,
    sendonce::{
        Which,
        decide::Withheld,
        execute::{OwnerCheck, Tracked, ensure_sent, patch_metadata},
    },
    status::Status,
};

/// How often a held hand-back asks the MachineHealthChecks again besides their watch (a
/// change to one wakes it within seconds): a safety net only.
const HOLD_RECHECK: Duration = Duration::from_secs(300);

/// One reconcile of a `MailgunRemediation`, measured as every kind's.
pub(crate) async fn reconcile(
    obj: Arc<MailgunRemediation>,
    ctx: Arc<Ctx>,
) -> Result<Action, ReconcileError> {
    crate::reconcile::measured(&*obj, &ctx, pass(&obj, &ctx)).await
}

async fn pass(obj: &MailgunRemediation, ctx: &Ctx) -> Result<Action, ReconcileError> {
    let deleting = obj.meta().deletion_timestamp.is_some();
    if deleting
        && !obj
            .finalizers()
            .iter()
            .any(|f| f == MailgunRemediation::FINALIZER)
    {
        return Ok(Action::await_change());
    }
    let original = obj.status.clone().unwrap_or_default();
    let mut pass = Pass {
        obj,
        ctx,
        shared: Status {
            conditions: original.conditions.clone(),
            mail: original.mail.clone(),
            observed_generation: obj.meta().generation,
            ..Status::default()
        },
        status: original.clone(),
        tracked: Tracked::of(obj, obj.annotations().clone()),
        now: Timestamp::now(),
        waiting: None,
        remediate_annotation: false,
    };
    let result = pass.steps(deleting).await;
    if matches!(result, Ok(None)) {
        // The finalizer is gone, and with it the object.
        ctx.forget(&obj.uid().unwrap_or_default());
        return Ok(Action::await_change());
    }
    let status = pass.finish();
    if serde_json::to_value(&status).ok() != serde_json::to_value(&original).ok() {
        ctx.patch(obj, json!({ "status": status }), "writing status")
            .await?;
    }
    result.map(|action| action.unwrap_or_else(Action::await_change))
}

impl Pass<'_> {
    /// The decisions and their work; `Ok(None)`: the finalizer was removed.
    async fn steps(&mut self, deleting: bool) -> Result<Option<Action>, ReconcileError> {
        let (obj, ctx) = (self.obj, self.ctx);
        let believed = believe(obj, &ctx.capi);
        self.remediate_annotation = (believed.machine.as_ref())
            .is_some_and(|m| m.annotations().contains_key(REMEDIATE_MACHINE_ANNOTATION));
        let strategy = self.strategy()?;
        self.answered();
        let mut brake = Brake::Unknown;
        let mut live: Option<Value> = None;
        for _ in 0..8 {
            self.sync_mails();
            let facts = self.facts(&believed, strategy, brake, deleting);
            let next = decide(&facts);
            match phase(&next) {
                Some(p) => self.status.phase = Some(p),
                None => {
                    if let Next::Idle(p) = next {
                        self.status.phase.get_or_insert(p);
                    }
                }
            }
            match next {
                Next::Pending(why) => self.wait(reasons::REMEDIATION_PENDING, why),
                Next::WaitForFulfilment => self.wait(
                    reasons::WAITING_FOR_FULFILMENT,
                    "the Machine's MailgunMachine was never fulfilled: no mail",
                ),
                Next::Wait { phase, until } => {
                    self.wait(phase_reason(phase), format!("until {until}"));
                    let left = until.duration_since(self.now);
                    let left = Duration::try_from(left).unwrap_or_default();
                    return Ok(Some(Action::requeue(left.max(Duration::from_secs(1)))));
                }
                Next::Idle(phase) => self.wait(phase_reason(phase), ""),
                Next::Send(which) => {
                    if !self.send(which, &believed).await? {
                        return Ok(Some(Action::await_change()));
                    }
                    continue;
                }
                Next::CheckBrake(_) => {
                    let Some(machine) = self.live(&mut live, &believed).await? else {
                        return Ok(Some(Action::await_change()));
                    };
                    brake = handback::brake(ctx, machine).await?;
                    continue;
                }
                Next::Hold(reason) => {
                    let message = format!(
                        "{reason:?}: held while the MachineHealthCheck reports \
                         RemediationAllowed=False"
                    );
                    (self.shared).set_condition(
                        conditions::HANDED_BACK,
                        false,
                        reasons::HAND_BACK_HELD,
                        &message,
                    );
                    self.wait(reasons::HAND_BACK_HELD, message);
                    return Ok(Some(Action::requeue(HOLD_RECHECK)));
                }
                Next::HandBack { reason, .. } => {
                    let Some(machine) = self.live(&mut live, &believed).await? else {
                        return Ok(Some(Action::await_change()));
                    };
                    self.hand_back(machine.clone(), reason).await?;
                    continue;
                }
                Next::HandedBack => self.owner_message(&believed),
                Next::Release => {
                    if self.status.hand_back_reason.is_none() && obj.spec.answer.is_some() {
                        self.outcome("repaired");
                    }
                    let mut remaining = self.tracked.finalizers.clone();
                    remaining.retain(|f| f != MailgunRemediation::FINALIZER);
                    let metadata = json!({
                        "resourceVersion": self.tracked.resource_version,
                        "finalizers": remaining,
                    });
                    let what = "removing the finalizer";
                    return match patch_metadata(obj, ctx, &mut self.tracked, metadata, what).await {
                        Ok(()) => Ok(None),
                        Err(e) if e.is_not_found() => Ok(None),
                        Err(e) => Err(e),
                    };
                }
            }
            return Ok(Some(Action::await_change()));
        }
        Err(ReconcileError::Conflict(
            "deciding the remediation's next step",
        ))
    }

    /// Sends `which` at most once. `Ok(true)`: decide again (sent, or a reminder refused for
    /// good); `Ok(false)`: withheld for a reason the status shows (the Machine is being deleted,
    /// the backend refused the repair mail for good).
    async fn send(&mut self, which: Which, believed: &Believed) -> Result<bool, ReconcileError> {
        let (obj, ctx) = (self.obj, self.ctx);
        let uid = obj.uid().unwrap_or_default();
        if matches!(which, Which::Reminder(_))
            && mail_of(&self.tracked.annotations, which, None, self.now) == Mail::None
        {
            // The reminders share the ledger's notes: the previous one's are done.
            ctx.ledger.clear_mail(&uid, which);
        }
        let (name, namespace) = (obj.name_any(), obj.namespace().unwrap_or_default());
        let cluster = super::kind::cluster_of(obj.labels());
        let mut about = super::kind::about(obj, &name, &namespace, cluster);
        let machine = believed.machine.as_deref();
        about.node = machine.and_then(|m| m.node_name());
        about.provider_id = believed.provider_id.as_deref();
        about.health = machine
            .and_then(|m| m.condition(HEALTH_CHECK_SUCCEEDED))
            .map(|c| {
                let reason = c.reason.as_deref().unwrap_or_default();
                (reason, c.message.as_deref().unwrap_or_default())
            });
        let link = page_link(ctx, obj, &self.tracked, which);
        about.link = link.as_deref();
        let text = mail::text(&about, which);
        let owner = machine
            .filter(|_| which != Which::Deletion)
            .map(|m| OwnerCheck {
                deleting_in_cache: m.meta().deletion_timestamp.is_some(),
                name: name.clone(),
                uid: m.uid().unwrap_or_default(),
            });
        let wanted = obj.wanted_identity(&ctx.capi);
        let sent = ensure_sent(
            obj,
            ctx,
            &mut self.tracked,
            which,
            &text,
            owner.as_ref(),
            &wanted,
        );
        match sent.await {
            Ok(outcome) => {
                if which == Which::Deletion {
                    self.outcome("no_longer_needed");
                }
                if which == Which::Request {
                    let sent_at = outcome
                        .at
                        .or_else(|| self.status.mail.as_ref()?.sent_at.as_ref().map(|t| t.0));
                    delivery::track(
                        obj,
                        ctx,
                        &mut self.shared,
                        &outcome.message_id,
                        sent_at,
                        outcome.identity.as_deref(),
                    )
                    .await;
                }
                Ok(true)
            }
            Err(ReconcileError::Withheld(Withheld::OwnerDeleting)) => {
                self.wait(
                    reasons::OWNER_DELETING,
                    "the Machine is being deleted: no mail",
                );
                Ok(false)
            }
            // A reminder refused for good does not hold the flow (its MailFailed Event and
            // `MailSent` say so): decided again, it waits out the answer it asked for.
            Err(error @ (ReconcileError::Withheld(_) | ReconcileError::Mail(_)))
                if matches!(which, Which::Reminder(_)) && error.is_permanent() =>
            {
                Ok(true)
            }
            Err(ReconcileError::Withheld(Withheld::PermanentlyRefused)) => Ok(false),
            Err(error) => {
                if which == Which::Request {
                    let reason = if error.is_permanent() {
                        reasons::MAIL_FAILED
                    } else {
                        reasons::MAIL_PENDING
                    };
                    let shared = &mut self.shared;
                    shared.set_condition(conditions::MAIL_SENT, false, reason, error.to_string());
                }
                Err(error)
            }
        }
    }

    /// The live Machine, read once per pass (`None`: gone, or not the believed one).
    async fn live<'v>(
        &self,
        live: &'v mut Option<Value>,
        believed: &Believed,
    ) -> Result<Option<&'v Value>, ReconcileError> {
        if live.is_none() {
            let namespace = self.obj.namespace().unwrap_or_default();
            *live = handback::live_machine(self.ctx, &namespace, &self.obj.name_any()).await?;
        }
        let uid = believed.machine.as_ref().and_then(|m| m.uid());
        Ok(live
            .as_ref()
            .filter(|m| m["metadata"]["uid"].as_str() == uid.as_deref()))
    }

    /// Machine first, our status second.
    async fn hand_back(
        &mut self,
        machine: Value,
        reason: HandBackReason,
    ) -> Result<(), ReconcileError> {
        let obj = self.obj;
        let answer = (obj.spec.answer.as_ref()).and_then(|a| a.message.as_deref());
        let message = clean(
            &format!(
                "Handed back by MailgunRemediation {}: {reason:?}{}",
                obj.name_any(),
                answer.map(|m| format!(" ({m})")).unwrap_or_default()
            ),
            crate::status::MAX_CONDITION_MESSAGE_BYTES,
        );
        handback::hand_back(self.ctx, &machine, &message).await?;
        self.status.handed_back_at = Some(Time(self.now));
        self.status.hand_back_reason = Some(reason);
        let reason_text = format!("{reason:?}");
        (self.shared).set_condition(conditions::HANDED_BACK, true, &reason_text, &message);
        let metrics = &self.ctx.metrics;
        metrics.hand_backs.with_label_values(&[&reason_text]).inc();
        self.outcome("handed_back");
        self.ctx
            .publish(obj, EventType::Normal, reasons::HANDED_BACK, message)
            .await;
        Ok(())
    }

    fn outcome(&self, outcome: &str) {
        self.ctx
            .metrics
            .remediations
            .with_label_values(&[outcome])
            .inc();
    }
}

/// The fulfilment page's link for this object's mail `which`, when the page is on: sealed for the
/// repair mail's record and expiring after the time the mail was first intended (its intent
/// record's, else now), so a mail composed again after a crash carries the same link and each
/// reminder's outlives the one before. The "no longer needed" mail has none: nothing is left to
/// answer.
fn page_link(
    ctx: &Ctx,
    obj: &MailgunRemediation,
    tracked: &Tracked,
    which: Which,
) -> Option<String> {
    let links = ctx.config.fulfilment.as_ref()?;
    if which == Which::Deletion {
        return None;
    }
    let intended = crate::sendonce::records::read_records(&tracked.annotations, super::KIND, which)
        .intent
        .and_then(|intent| intent.at)
        .map_or_else(std::time::SystemTime::now, std::time::SystemTime::from);
    links.repair_link(obj.meta(), &ctx.config.message_id_domain, intended)
}
