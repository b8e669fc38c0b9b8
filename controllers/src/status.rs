//! The status both kinds share, and conditions that change only when they mean something new.

use capm_api::{
    names::conditions,
    v1beta1::{Initialization, MachineAddress, MailStatus},
};
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};
use serde::{Deserialize, Serialize};

/// The longest condition message written: Cluster API's own messages stay far below it, and a
/// peer's text inside one is already cut to a few hundred bytes.
pub const MAX_CONDITION_MESSAGE_BYTES: usize = 1024;

/// The union of `MailgunClusterStatus` and `MailgunMachineStatus` (same JSON names), so one
/// reconciler computes both. `addresses` stays `None` for clusters.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<Initialization>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addresses: Option<Vec<MachineAddress>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mail: Option<MailStatus>,
}

impl Status {
    /// Whether writing `self` would change what the API server holds as `other`. Compared as
    /// JSON: a time kept to the nanosecond here is written to the second (every `metav1.Time`),
    /// so a fresh `sentAt` equal to the stored one to the second is no change.
    pub fn differs_on_the_wire(&self, other: &Self) -> bool {
        self != other && serde_json::to_value(self).ok() != serde_json::to_value(other).ok()
    }

    /// The condition of this type, if set.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.conditions.as_ref()?.iter().find(|c| c.type_ == type_)
    }

    /// Sets a condition. `lastTransitionTime` changes only when `status` does, so a reconcile
    /// that learns nothing new writes nothing. No `observedGeneration` per condition: all are
    /// computed in the same pass, so `status.observedGeneration` says it once for all of them.
    pub fn set_condition(
        &mut self,
        type_: &str,
        status: bool,
        reason: &str,
        message: impl Into<String>,
    ) {
        let status = if status { "True" } else { "False" };
        self.set_condition_status(type_, status, reason, message);
    }

    /// Sets a condition to `status` (`True`, `False` or `Unknown`), as [`Self::set_condition`].
    pub fn set_condition_status(
        &mut self,
        type_: &str,
        status: &str,
        reason: &str,
        message: impl Into<String>,
    ) {
        // Messages carry peers' and users' words (a relay's refusal, a backend's reason).
        let message = capm_mailer::text::clean(&message.into(), MAX_CONDITION_MESSAGE_BYTES);
        let conditions = self.conditions.get_or_insert_with(Vec::new);
        match conditions.iter_mut().find(|c| c.type_ == type_) {
            Some(c) => {
                if c.status != status {
                    c.last_transition_time = Time(Timestamp::now());
                }
                c.status = status.into();
                c.reason = reason.into();
                c.message = message;
                c.observed_generation = None;
            }
            None => conditions.push(Condition {
                type_: type_.into(),
                status: status.into(),
                reason: reason.into(),
                message,
                observed_generation: None,
                last_transition_time: Time(Timestamp::now()),
            }),
        }
    }
}

/// What decides `Ready` at the end of a pass: it is set in one place, from what the pass
/// found, never step by step.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// The pass learnt nothing that bears on it (paused, or a send withheld): `Ready` stays.
    #[default]
    Unchanged,
    /// The pass stopped for a reason no other condition records: the owner, the spec, a
    /// deletion in progress.
    Blocked {
        reason: &'static str,
        message: String,
    },
    /// The mail step ran: `Ready` summarizes `MailSent` and `Provisioned`.
    Summary,
    /// Reconciliation is paused: a ready object stays ready, any other is not ready: paused.
    Paused,
}

impl Status {
    /// Sets `Ready` from `readiness`: false with the blocker; or false with the reason and
    /// message of the first of `MailSent`, `Provisioned` that is not true; or true with
    /// `Provisioned`'s reason and no message (the details stay on `Provisioned`, once).
    pub fn set_ready(&mut self, readiness: Readiness) {
        let (ready, reason, message) = match readiness {
            Readiness::Unchanged => return,
            Readiness::Paused => {
                if self
                    .condition(conditions::READY)
                    .is_some_and(|c| c.status == "True")
                {
                    return;
                }
                (
                    false,
                    capm_api::names::reasons::PAUSED.to_owned(),
                    "reconciliation is paused".to_owned(),
                )
            }
            Readiness::Blocked { reason, message } => (false, reason.to_owned(), message),
            Readiness::Summary => {
                let parts = [conditions::MAIL_SENT, conditions::PROVISIONED]
                    .map(|type_| self.condition(type_).cloned());
                let [_, provisioned] = &parts;
                match (
                    parts.iter().flatten().find(|c| c.status != "True"),
                    provisioned,
                ) {
                    (Some(c), _) => (false, c.reason.clone(), c.message.clone()),
                    (None, Some(c)) => (true, c.reason.clone(), String::new()),
                    (None, None) => return,
                }
            }
        };
        self.set_condition(conditions::READY, ready, &reason, message);
    }

    /// Drops the per-condition `observedGeneration` that releases up to 0.1 wrote on conditions
    /// this pass did not touch, so a status written by them is rewritten once, whole.
    pub fn drop_condition_generations(&mut self) {
        for c in self.conditions.iter_mut().flatten() {
            c.observed_generation = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Status {
        /// Reads a typed status through JSON (the field names are the same): what each kind's
        /// field-by-field `shared_status` must agree with.
        pub(crate) fn from_typed<T: Serialize>(status: Option<&T>) -> Self {
            status
                .and_then(|s| serde_json::to_value(s).ok())
                .and_then(|v| serde_json::from_value(v).ok())
                .unwrap_or_default()
        }
    }

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let mut s = Status::default();
        s.set_condition("Ready", false, "Waiting", "waiting");
        let first = s.condition("Ready").unwrap().last_transition_time.clone();
        std::thread::sleep(std::time::Duration::from_millis(5));
        s.set_condition("Ready", false, "StillWaiting", "still");
        let c = s.condition("Ready").unwrap();
        assert_eq!(c.last_transition_time, first);
        assert_eq!(
            (c.reason.as_str(), c.observed_generation),
            ("StillWaiting", None)
        );
        s.set_condition("Ready", true, "Done", "done");
        assert_ne!(s.condition("Ready").unwrap().last_transition_time, first);
    }

    #[test]
    fn a_paused_object_is_not_ready_for_being_paused_unless_it_was_ready() {
        let mut s = Status::default();
        s.set_ready(Readiness::Blocked {
            reason: "WaitingForOwner",
            message: "waiting for Cluster API to set an owner Cluster".into(),
        });
        s.set_ready(Readiness::Paused);
        let c = s.condition(conditions::READY).unwrap();
        assert_eq!(
            (c.status.as_str(), c.reason.as_str(), c.message.as_str()),
            ("False", "Paused", "reconciliation is paused")
        );
        let mut ready = Status::default();
        ready.set_condition(conditions::READY, true, "Provisioned", "");
        let before = ready.clone();
        ready.set_ready(Readiness::Paused);
        assert_eq!(ready, before, "pausing unprovisions nothing");
    }

    #[test]
    fn ready_is_the_blocker_or_the_first_condition_that_is_not_true() {
        let ready = |s: &Status| {
            let c = s.condition(conditions::READY).unwrap();
            (c.status.clone(), c.reason.clone(), c.message.clone())
        };
        let mut s = Status::default();
        s.set_ready(Readiness::Summary);
        assert!(
            s.condition(conditions::READY).is_none(),
            "nothing to summarize"
        );
        s.set_condition(conditions::MAIL_SENT, false, "MailPending", "timeout");
        s.set_ready(Readiness::Summary);
        assert_eq!(
            ready(&s),
            ("False".into(), "MailPending".into(), "timeout".into())
        );
        s.set_condition(conditions::MAIL_SENT, true, "MailSent", "mailed");
        s.set_condition(conditions::PROVISIONED, false, "WaitingForFulfillment", "w");
        s.set_ready(Readiness::Summary);
        assert_eq!(
            ready(&s),
            ("False".into(), "WaitingForFulfillment".into(), "w".into())
        );
        s.set_condition(conditions::PROVISIONED, true, "Provisioned", "done");
        s.set_ready(Readiness::Summary);
        assert_eq!(
            ready(&s),
            ("True".into(), "Provisioned".into(), String::new()),
            "the details stay on Provisioned"
        );
        s.set_ready(Readiness::Unchanged);
        assert_eq!(ready(&s).0, "True");
        let blocked = Readiness::Blocked {
            reason: "OwnerMismatch",
            message: "uid".into(),
        };
        s.set_ready(blocked);
        assert_eq!(
            ready(&s),
            ("False".into(), "OwnerMismatch".into(), "uid".into())
        );
    }

    #[test]
    fn times_are_compared_as_written() {
        let stored: Status = serde_json::from_value(serde_json::json!({
            "mail": {"messageId": "<a@b>", "state": "Sent", "sentAt": "2026-11-23T14:00:01Z"}
        }))
        .unwrap();
        let mut fresh = stored.clone();
        let at: Timestamp = "2026-11-23T14:00:01.987654321Z".parse().unwrap();
        fresh.mail.as_mut().unwrap().sent_at = Some(Time(at));
        assert_ne!(fresh, stored, "the values differ in memory");
        assert!(!fresh.differs_on_the_wire(&stored), "but not as written");
        fresh.mail.as_mut().unwrap().sent_at = Some(Time("2026-11-23T14:00:02Z".parse().unwrap()));
        assert!(fresh.differs_on_the_wire(&stored));
    }

    #[test]
    fn same_inputs_give_equal_status() {
        let mut a = Status::default();
        a.set_condition("Ready", true, "R", "m");
        let mut b = a.clone();
        b.set_condition("Ready", true, "R", "m");
        assert_eq!(a, b);
    }
}
