//! What a remediation pass reads and shows: the facts for [`decide`](super::decide), the
//! status (the mails as their records say, `Answered`, the owner's answer, `Ready`).

use capm_api::{
    names::{conditions, reasons},
    owner_remediated::{HANDED_BACK_REASON, OWNER_REMEDIATED},
    v1beta1::{
        MailState, MailStatus, MailgunRemediation, MailgunRemediationStatus, RemediationPhase,
    },
};
use capm_mailer::text::clean;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::{Resource, ResourceExt};

use super::{
    decide::{Brake, Facts, Mail, Strategy, parse_duration},
    mail_of,
    view::Believed,
};
use crate::{
    context::{Ctx, ReconcileError},
    kinds::Mailed,
    ledger::Attempt,
    sendonce::{Which, execute::Tracked},
    status::Status,
};
use k8s_openapi::jiff::Timestamp;

/// What one pass changes: the typed status, and the conditions and repair mail through the
/// shared [`Status`] (its conditions' rules, the delivery tracking).
pub(super) struct Pass<'a> {
    pub(super) obj: &'a MailgunRemediation,
    pub(super) ctx: &'a Ctx,
    pub(super) status: MailgunRemediationStatus,
    pub(super) shared: Status,
    pub(super) tracked: Tracked,
    pub(super) now: Timestamp,
    /// Why `Ready` is not true, when it is not.
    pub(super) waiting: Option<(&'static str, String)>,
    /// The believed Machine carries `cluster.x-k8s.io/remediate-machine`: `Ready` says so.
    pub(super) remediate_annotation: bool,
}

/// What `Ready` adds when the Machine carries `cluster.x-k8s.io/remediate-machine`.
const REMEDIATE_ANNOTATION_NOTE: &str = "the Machine carries the annotation \
    cluster.x-k8s.io/remediate-machine: its MachineHealthCheck reports it unhealthy until \
    someone removes the annotation (the provider never does), even once it is repaired";

impl Pass<'_> {
    pub(super) fn strategy(&mut self) -> Result<Strategy, ReconcileError> {
        let s = &self.obj.spec.strategy;
        match (
            parse_duration(&s.answer_timeout),
            parse_duration(&s.repair_timeout),
        ) {
            (Some(answer_timeout), Some(repair_timeout)) => Ok(Strategy {
                answer_timeout,
                reminders: s.reminders.min(capm_api::limits::MAX_REMINDERS),
                repair_timeout,
                unfulfilled: s.unfulfilled,
            }),
            _ => {
                let message = "spec.strategy: a timeout is not a duration".to_owned();
                self.wait(reasons::INVALID_SPEC, message.clone());
                Err(ReconcileError::InvalidSpec(message))
            }
        }
    }

    /// `Answered` and `answeredAt` from `spec.answer` (the time it was first seen).
    pub(super) fn answered(&mut self) {
        let Some(answer) = &self.obj.spec.answer else {
            let shared = &mut self.shared;
            shared.set_condition(conditions::ANSWERED, false, reasons::NOT_ANSWERED, "");
            return;
        };
        self.status.answered_at.get_or_insert(Time(self.now));
        let message = answer.message.as_deref().unwrap_or_default();
        let (reason, shared) = (answer.result.as_str(), &mut self.shared);
        shared.set_condition(conditions::ANSWERED, true, reason, message);
    }

    pub(super) fn facts(
        &self,
        believed: &Believed,
        strategy: Strategy,
        brake: Brake,
        deleting: bool,
    ) -> Facts {
        let annotations = &self.tracked.annotations;
        let at = |m: Option<&MailStatus>| m.and_then(|m| m.sent_at.as_ref()).map(|t| t.0);
        let reminders = self.status.reminders.as_deref().unwrap_or_default();
        Facts {
            machine: believed.view.clone(),
            strategy,
            answer: (self.obj.spec.answer.as_ref()).map(|a| {
                let at = self.status.answered_at.as_ref().map_or(self.now, |t| t.0);
                (a.result, at)
            }),
            repair: mail_of(
                annotations,
                Which::Request,
                at(self.status.mail.as_ref()),
                self.now,
            ),
            reminders: (1..=strategy.reminders)
                .map(|n| {
                    let (which, shown) = (Which::Reminder(n), reminders.get(usize::from(n - 1)));
                    match mail_of(annotations, which, at(shown), self.now) {
                        Mail::Refused if self.refused_for_good(which) => Mail::GivenUp,
                        mail => mail,
                    }
                })
                .collect(),
            no_longer_needed: mail_of(
                annotations,
                Which::Deletion,
                at(self.status.no_longer_needed_mail.as_ref()),
                self.now,
            ),
            handed_back: self.status.handed_back_at.is_some(),
            brake,
            deleting,
            now: self.now,
        }
    }

    /// Whether this process saw the backend refuse `which` for good at the object's current
    /// attempt (its generation and retry annotation).
    fn refused_for_good(&self, which: Which) -> bool {
        let uid = self.obj.uid().unwrap_or_default();
        self.ctx.ledger.refused_at(&uid, which) == Some(Attempt::of(self.obj.meta()))
    }

    /// Shows in status each mail its record says was sent (sent here or by another process),
    /// and each reminder the backend refused as `Failed`.
    pub(super) fn sync_mails(&mut self) {
        let sent = |annotations, which, shown: Option<&MailStatus>, now| {
            let at = shown.and_then(|m| m.sent_at.as_ref()).map(|t| t.0);
            match mail_of(annotations, which, at, now) {
                Mail::Sent(at) => Some(MailStatus {
                    message_id: shown.and_then(|m| m.message_id.clone()),
                    state: Some(shown.and_then(|m| m.state).unwrap_or(MailState::Sent)),
                    sent_at: Some(Time(at)),
                }),
                _ => shown.cloned(),
            }
        };
        let (annotations, now) = (&self.tracked.annotations, self.now);
        let domain = &self.ctx.config.message_id_domain;
        let uid = self.obj.uid().unwrap_or_default();
        let id = |which: Which| which.message_id(MailgunRemediation::KIND, &uid, domain);
        let with_id = |m: Option<MailStatus>, which| {
            m.map(|mut m| {
                m.message_id.get_or_insert_with(|| id(which));
                m
            })
        };
        self.status.mail = with_id(
            sent(annotations, Which::Request, self.status.mail.as_ref(), now),
            Which::Request,
        );
        let (mut reminders, mut refused) = (Vec::new(), Vec::new());
        for n in 1..=capm_api::limits::MAX_REMINDERS {
            let which = Which::Reminder(n);
            let shown = (self.status.reminders.as_ref())
                .and_then(|r| r.get(usize::from(n - 1)))
                .filter(|m| m.state != Some(MailState::Failed));
            let mail = match mail_of(annotations, which, None, now) {
                Mail::Refused | Mail::GivenUp => {
                    refused.push(n.to_string());
                    Some(MailStatus {
                        state: Some(MailState::Failed),
                        ..MailStatus::default()
                    })
                }
                _ => sent(annotations, which, shown, now),
            };
            match with_id(mail, which) {
                Some(m) => reminders.push(m),
                None => break,
            }
        }
        self.status.reminders = (!reminders.is_empty()).then_some(reminders);
        self.status.no_longer_needed_mail = with_id(
            sent(
                annotations,
                Which::Deletion,
                self.status.no_longer_needed_mail.as_ref(),
                now,
            ),
            Which::Deletion,
        );
        if let Some(mail) = &self.status.mail {
            self.status.asked_at = mail.sent_at.clone();
            self.shared.mail = Some(mail.clone());
            let reminders = self.status.reminders.as_deref().unwrap_or_default();
            let sent = 1 + reminders.len() - refused.len();
            let mut message = format!("{sent} mail(s) asking for the repair sent");
            if !refused.is_empty() {
                message.push_str(&format!(
                    "; reminder {} refused by the mail backend (its MailFailed Event says why): \
                     the hand-back does not wait for it",
                    refused.join(", ")
                ));
            }
            (self.shared).set_condition(conditions::MAIL_SENT, true, reasons::MAIL_SENT, message);
        }
    }

    /// The owner's answer on the Machine (its own reasons on `OwnerRemediated`) in status.
    pub(super) fn owner_message(&mut self, believed: &Believed) {
        let condition = believed
            .machine
            .as_deref()
            .and_then(|m| m.condition(OWNER_REMEDIATED));
        if let Some(c) = condition
            .filter(|c| c.status == "False" && c.reason.as_deref() != Some(HANDED_BACK_REASON))
        {
            let text = format!(
                "{}: {}",
                c.reason.as_deref().unwrap_or_default(),
                c.message.as_deref().unwrap_or_default()
            );
            let max = capm_api::limits::MAX_OWNER_MESSAGE_LENGTH as usize;
            self.status.owner_message = Some(clean(&text, max));
        }
    }

    pub(super) fn wait(&mut self, reason: &'static str, message: impl Into<String>) {
        self.waiting = Some((reason, message.into()));
    }

    /// The typed status to write: the shared conditions and mail copied back, `Ready` set.
    pub(super) fn finish(mut self) -> MailgunRemediationStatus {
        let ready = matches!(
            self.status.phase,
            Some(RemediationPhase::HandedBack | RemediationPhase::NoLongerNeeded)
        );
        let noted = |message: String| match (self.remediate_annotation, message.is_empty()) {
            (false, _) => message,
            (true, true) => REMEDIATE_ANNOTATION_NOTE.to_owned(),
            (true, false) => format!("{message}; {REMEDIATE_ANNOTATION_NOTE}"),
        };
        match (ready, self.waiting.take()) {
            (true, _) => {
                let reason =
                    phase_reason(self.status.phase.unwrap_or(RemediationPhase::HandedBack));
                let message = noted(String::new());
                (self.shared).set_condition(conditions::READY, true, reason, message);
            }
            (false, Some((reason, message))) => {
                let message = noted(message);
                (self.shared).set_condition(conditions::READY, false, reason, message);
            }
            (false, None) => {}
        }
        self.shared.drop_condition_generations();
        let mut status = self.status;
        status.conditions = self.shared.conditions;
        if let (Some(shown), Some(tracked)) = (status.mail.as_mut(), self.shared.mail) {
            shown.state = tracked.state.or(shown.state);
        }
        status.observed_generation = self.shared.observed_generation;
        status
    }
}

pub(super) fn phase_reason(phase: RemediationPhase) -> &'static str {
    match phase {
        RemediationPhase::Pending => reasons::REMEDIATION_PENDING,
        RemediationPhase::WaitingForFulfilment => reasons::WAITING_FOR_FULFILMENT,
        RemediationPhase::WaitingForAnswer => reasons::WAITING_FOR_ANSWER,
        RemediationPhase::WaitingForRepair => reasons::WAITING_FOR_REPAIR,
        RemediationPhase::HandBackHeld => reasons::HAND_BACK_HELD,
        RemediationPhase::HandedBack => reasons::HANDED_BACK,
        RemediationPhase::NoLongerNeeded => reasons::NO_LONGER_NEEDED,
    }
}
