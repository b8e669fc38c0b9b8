//! The status both kinds share, and conditions that change only when they mean something new.

use capm_api::v1beta1::{Initialization, MachineAddress, MailStatus};
use k8s_openapi::{
    apimachinery::pkg::apis::meta::v1::{Condition, Time},
    jiff::Timestamp,
};
use serde::{Deserialize, Serialize};

/// The union of `MailgunClusterStatus` and `MailgunMachineStatus` (same JSON names), so one
/// reconciler computes both. `addresses` stays `None` for clusters.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Status {
    /// `status.initialization`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initialization: Option<Initialization>,
    /// `status.conditions`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conditions: Option<Vec<Condition>>,
    /// `status.observedGeneration`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `status.addresses` (machines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addresses: Option<Vec<MachineAddress>>,
    /// `status.mail`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mail: Option<MailStatus>,
}

impl Status {
    /// Reads a typed status through JSON (the field names are the same).
    pub fn from_typed<T: Serialize>(status: Option<&T>) -> Self {
        status
            .and_then(|s| serde_json::to_value(s).ok())
            .and_then(|v| serde_json::from_value(v).ok())
            .unwrap_or_default()
    }

    /// The condition of this type, if set.
    pub fn condition(&self, type_: &str) -> Option<&Condition> {
        self.conditions.as_ref()?.iter().find(|c| c.type_ == type_)
    }

    /// Sets a condition. `lastTransitionTime` changes only when `status` does, so a
    /// reconcile that learns nothing new writes nothing.
    pub fn set_condition(
        &mut self,
        type_: &str,
        status: bool,
        reason: &str,
        message: impl Into<String>,
        generation: Option<i64>,
    ) {
        let status = if status { "True" } else { "False" };
        self.set_condition_status(type_, status, reason, message, generation);
    }

    /// Sets a condition to `status` (`True`, `False` or `Unknown`), as [`Self::set_condition`].
    pub fn set_condition_status(
        &mut self,
        type_: &str,
        status: &str,
        reason: &str,
        message: impl Into<String>,
        generation: Option<i64>,
    ) {
        let message = message.into();
        let conditions = self.conditions.get_or_insert_with(Vec::new);
        match conditions.iter_mut().find(|c| c.type_ == type_) {
            Some(c) => {
                if c.status != status {
                    c.last_transition_time = Time(Timestamp::now());
                }
                c.status = status.into();
                c.reason = reason.into();
                c.message = message;
                c.observed_generation = generation;
            }
            None => conditions.push(Condition {
                type_: type_.into(),
                status: status.into(),
                reason: reason.into(),
                message,
                observed_generation: generation,
                last_transition_time: Time(Timestamp::now()),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transition_time_moves_only_when_status_flips() {
        let mut s = Status::default();
        s.set_condition("Ready", false, "Waiting", "waiting", Some(1));
        let first = s.condition("Ready").unwrap().last_transition_time.clone();
        std::thread::sleep(std::time::Duration::from_millis(5));
        s.set_condition("Ready", false, "StillWaiting", "still", Some(2));
        let c = s.condition("Ready").unwrap();
        assert_eq!(c.last_transition_time, first);
        assert_eq!(
            (c.reason.as_str(), c.observed_generation),
            ("StillWaiting", Some(2))
        );
        s.set_condition("Ready", true, "Done", "done", Some(2));
        assert_ne!(s.condition("Ready").unwrap().last_transition_time, first);
    }

    #[test]
    fn same_inputs_give_equal_status() {
        let mut a = Status::default();
        a.set_condition("Ready", true, "R", "m", Some(1));
        let mut b = a.clone();
        b.set_condition("Ready", true, "R", "m", Some(1));
        assert_eq!(a, b);
    }
}
