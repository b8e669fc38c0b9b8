//! Remediation by mail: Cluster API's external remediation, answered by a human.
//!
//! A `MachineHealthCheck` whose `spec.remediation.templateRef` names a
//! [`MailgunRemediationTemplate`] creates, for each unhealthy `Machine`, a [`MailgunRemediation`]
//! named and namespaced like the Machine (an ownerReference to it, the cluster-name label), and
//! deletes it when the Machine is healthy again. The provider mails one repair request, threaded
//! reminders after each `answerTimeout`, and, when the human cannot repair, nobody answers or the
//! repair does not take, hands the Machine back to its owner (the Machine's `OwnerRemediated`
//! condition), which replaces it.
//!
//! The strategy is immutable and the answer set once (CEL); a template carries neither an answer
//! nor the provider's own annotations (the records a copy would forge).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::{MailStatus, Priority, TemplateMetadata};
use crate::limits::{
    DURATION_PATTERN, MAX_ANSWER_MESSAGE_LENGTH, MAX_CONDITIONS, MAX_DURATION_LENGTH,
    MAX_OWNER_MESSAGE_LENGTH, MAX_REMINDERS, MAX_REQUEST_LENGTH, REQUEST_PATTERN,
};

/// The default of `strategy.answerTimeout`.
pub const DEFAULT_ANSWER_TIMEOUT: &str = "24h";
/// The default of `strategy.repairTimeout`.
pub const DEFAULT_REPAIR_TIMEOUT: &str = "1h";
/// The default of `strategy.reminders`.
pub const DEFAULT_REMINDERS: u8 = 1;

/// What to do with a Machine whose `MailgunMachine` was never fulfilled (nobody built it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum Unfulfilled {
    /// No mail, no hand-back: the machine request is still open, and a repair request would ask
    /// for the same machine twice (this ends the request storm of short startup timeouts).
    #[default]
    Wait,
    /// Hand the Machine back to its owner at once, without a mail.
    GiveUp,
}

/// How a remediation proceeds. Immutable.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct RemediationStrategy {
    /// answerTimeout (optional, default `24h`): how long to wait for an answer after the repair
    /// mail and after each reminder; a duration from `1m` to `720h` (`90m`, `1h30m`).
    #[serde(default = "default_answer_timeout")]
    #[schemars(
        length(min = 2, max = MAX_DURATION_LENGTH),
        pattern(DURATION_PATTERN),
        extend("x-kubernetes-validations" = [{
            "rule": "duration(self) >= duration('1m') && duration(self) <= duration('720h')",
            "message": "answerTimeout must be from 1m to 720h"
        }])
    )]
    pub answer_timeout: String,
    /// reminders (optional, default 1): threaded reminders sent when an answer is late, 0 to 3.
    #[serde(default = "default_reminders")]
    #[schemars(range(max = MAX_REMINDERS))]
    pub reminders: u8,
    /// repairTimeout (optional, default `1h`): after a `Repaired` answer, how long the Machine
    /// may stay unhealthy before it is handed back; a duration from `1m` to `720h`.
    #[serde(default = "default_repair_timeout")]
    #[schemars(
        length(min = 2, max = MAX_DURATION_LENGTH),
        pattern(DURATION_PATTERN),
        extend("x-kubernetes-validations" = [{
            "rule": "duration(self) >= duration('1m') && duration(self) <= duration('720h')",
            "message": "repairTimeout must be from 1m to 720h"
        }])
    )]
    pub repair_timeout: String,
    /// unfulfilled (optional, default `Wait`): a Machine whose `MailgunMachine` was never
    /// fulfilled: `Wait` (no mail, no hand-back) or `GiveUp` (hand back at once).
    #[serde(default)]
    pub unfulfilled: Unfulfilled,
}

fn default_answer_timeout() -> String {
    DEFAULT_ANSWER_TIMEOUT.to_owned()
}

fn default_repair_timeout() -> String {
    DEFAULT_REPAIR_TIMEOUT.to_owned()
}

fn default_reminders() -> u8 {
    DEFAULT_REMINDERS
}

fn default_priority() -> Priority {
    Priority::Urgent
}

impl Default for RemediationStrategy {
    fn default() -> Self {
        Self {
            answer_timeout: default_answer_timeout(),
            reminders: default_reminders(),
            repair_timeout: default_repair_timeout(),
            unfulfilled: Unfulfilled::default(),
        }
    }
}

/// The human's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum AnswerResult {
    /// The machine was repaired: the provider waits for the health check to find it healthy.
    Repaired,
    /// The machine cannot be repaired: it is handed back to its owner at once.
    CannotRepair,
}

impl AnswerResult {
    /// The JSON value.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Repaired => "Repaired",
            Self::CannotRepair => "CannotRepair",
        }
    }
}

/// The answer to a repair request. Set once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct RemediationAnswer {
    /// result (required): `Repaired` or `CannotRepair`.
    pub result: AnswerResult,
    /// message (optional): what was done or why it cannot be, at most 1024 characters; line
    /// breaks and tabs allowed, other control characters not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_ANSWER_MESSAGE_LENGTH), pattern(REQUEST_PATTERN))]
    pub message: Option<String>,
}

/// Desired state of a `MailgunRemediation`: what to ask a human, how long to wait, and the
/// answer.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1beta1",
    kind = "MailgunRemediation",
    plural = "mailgunremediations",
    singular = "mailgunremediation",
    namespaced,
    status = "MailgunRemediationStatus",
    derive = "PartialEq",
    shortname = "mgr",
    category = "cluster-api",
    doc = "MailgunRemediation asks a human, by mail, to repair an unhealthy Machine (Cluster API \
           external remediation); the human answers by setting spec.answer. Created by a \
           MachineHealthCheck from a MailgunRemediationTemplate, named like the Machine.",
    label("cluster.x-k8s.io/v1beta1", "v1beta1"),
    label("cluster.x-k8s.io/v1beta2", "v1beta1"),
    label("cluster.x-k8s.io/provider", "infrastructure-mailgun"),
    printcolumn(
        name = "Cluster",
        type_ = "string",
        json_path = ".metadata.labels['cluster\\.x-k8s\\.io/cluster-name']",
        description = "Cluster of the Machine"
    ),
    printcolumn(
        name = "Phase",
        type_ = "string",
        json_path = ".status.phase",
        description = "Where the remediation stands"
    ),
    printcolumn(
        name = "Answer",
        type_ = "string",
        json_path = ".spec.answer.result",
        description = "The human's answer"
    ),
    printcolumn(
        name = "Mail",
        type_ = "string",
        json_path = ".status.mail.state",
        description = "State of the repair mail"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [{
    "rule": "!has(oldSelf.answer) || (has(self.answer) && self.answer == oldSelf.answer)",
    "message": "answer is set-once: it can be set when empty but never changed or removed",
    "fieldPath": ".answer",
    "reason": "FieldValueForbidden"
}]))]
pub struct MailgunRemediationSpec {
    /// priority (optional, default `Urgent`, immutable): `Urgent`, `ExtremelyUrgent` or
    /// `BusinessCritical`; appears in the mail subject.
    #[serde(default = "default_priority")]
    #[schemars(extend("x-kubernetes-validations" = [{"rule": "self == oldSelf", "message": "priority is immutable"}]))]
    pub priority: Priority,
    /// request (required, immutable): what the human should do (the runbook), mailed with the
    /// Machine's details, 1 to 4096 characters; line breaks and tabs allowed, other control
    /// characters not.
    #[schemars(
        length(min = 1, max = MAX_REQUEST_LENGTH),
        pattern(REQUEST_PATTERN),
        extend("x-kubernetes-validations" = [{"rule": "self == oldSelf", "message": "request is immutable"}])
    )]
    pub request: String,
    /// strategy (optional, immutable): timeouts, reminders and what to do with a machine nobody
    /// built.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-validations" = [{"rule": "self == oldSelf", "message": "strategy is immutable"}]))]
    pub strategy: RemediationStrategy,
    /// answer (optional, set-once): the human's answer, through `kubectl patch` or the
    /// fulfilment page's link in the repair mail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answer: Option<RemediationAnswer>,
}

/// Where a remediation stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum RemediationPhase {
    /// Not (yet) believed: its Machine is not found, not its owner, not unhealthy, or its
    /// cluster is paused. Nothing is mailed.
    Pending,
    /// The Machine's `MailgunMachine` was never fulfilled and the strategy says `Wait`: no mail.
    WaitingForFulfilment,
    /// The repair mail (and perhaps reminders) sent; no answer yet.
    WaitingForAnswer,
    /// Answered `Repaired`: waiting for the health check to find the Machine healthy.
    WaitingForRepair,
    /// A timed hand-back waits while the MachineHealthCheck allows no remediation
    /// (`maxUnhealthy`/`unhealthyRange`).
    HandBackHeld,
    /// Handed back to the Machine's owner (`OwnerRemediated=False`): it replaces the Machine.
    HandedBack,
    /// The Machine became healthy before anyone answered: a "no longer needed" mail was sent.
    NoLongerNeeded,
}

/// Why a Machine was handed back to its owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
pub enum HandBackReason {
    /// The human answered `CannotRepair`.
    CannotRepair,
    /// No answer after the repair mail and every reminder.
    NoAnswer,
    /// Answered `Repaired`, but the Machine stayed unhealthy past `repairTimeout`.
    RepairTimedOut,
    /// The Machine was never built and the strategy says `GiveUp`.
    NotFulfilled,
}

/// Observed state of a `MailgunRemediation`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MailgunRemediationStatus {
    /// phase (optional): where the remediation stands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<RemediationPhase>,
    /// conditions (optional): `Ready`, `MailSent`, `MailDelivered`, `Answered`, `HandedBack`;
    /// one per type.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(max = MAX_CONDITIONS),
        extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"])
    )]
    pub conditions: Option<Vec<Condition>>,
    /// observedGeneration (optional): the `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// mail (optional): what happened to the repair mail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mail: Option<MailStatus>,
    /// reminders (optional): what happened to each reminder, in order; at most 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_REMINDERS))]
    pub reminders: Option<Vec<MailStatus>>,
    /// noLongerNeededMail (optional): what happened to the "no longer needed" mail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_longer_needed_mail: Option<MailStatus>,
    /// askedAt (optional): when the repair mail was accepted by the backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub asked_at: Option<Time>,
    /// answeredAt (optional): when the provider first saw the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub answered_at: Option<Time>,
    /// handedBackAt (optional): when the Machine was handed back to its owner.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub handed_back_at: Option<Time>,
    /// handBackReason (optional): why the Machine was handed back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hand_back_reason: Option<HandBackReason>,
    /// ownerMessage (optional): what the Machine's owner says about replacing it, when it will
    /// not (a control plane that keeps quorum, an old MachineSet); at most 1024 characters.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = MAX_OWNER_MESSAGE_LENGTH))]
    pub owner_message: Option<String>,
}

/// The object a `MailgunRemediationTemplate` stamps out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct MailgunRemediationTemplateResource {
    /// metadata (optional): labels and annotations for the created `MailgunRemediation`s; not
    /// the provider's own annotations (`mailgun.infrastructure.cluster.x-k8s.io/...`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metadata: Option<TemplateMetadata>,
    /// spec (required): the spec of the created `MailgunRemediation`s; `answer` must be unset.
    pub spec: MailgunRemediationSpec,
}

/// Desired state of a `MailgunRemediationTemplate` (named by a `MachineHealthCheck`'s
/// `spec.remediation.templateRef`).
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "infrastructure.cluster.x-k8s.io",
    version = "v1beta1",
    kind = "MailgunRemediationTemplate",
    plural = "mailgunremediationtemplates",
    singular = "mailgunremediationtemplate",
    namespaced,
    derive = "PartialEq",
    shortname = "mgrt",
    category = "cluster-api",
    doc = "MailgunRemediationTemplate is the template a MachineHealthCheck's \
           remediation.templateRef names: it stamps a MailgunRemediation for each unhealthy \
           Machine. Immutable.",
    label("cluster.x-k8s.io/v1beta1", "v1beta1"),
    label("cluster.x-k8s.io/v1beta2", "v1beta1"),
    label("cluster.x-k8s.io/provider", "infrastructure-mailgun"),
    printcolumn(
        name = "Priority",
        type_ = "string",
        json_path = ".spec.template.spec.priority",
        description = "How urgent the stamped requests are"
    ),
    printcolumn(
        name = "AnswerTimeout",
        type_ = "string",
        json_path = ".spec.template.spec.strategy.answerTimeout",
        description = "How long each mail waits for an answer"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
pub struct MailgunRemediationTemplateSpec {
    /// template (required, immutable): the `MailgunRemediation`s to create; no `spec.answer`,
    /// no provider annotations.
    // Immutable through the chart's admission policy, not CEL: see `crd::drop_transition_rules`.
    #[schemars(extend("x-kubernetes-validations" = [
        {
            "rule": "!has(self.spec.answer)",
            "message": "answer must not be set in a template: every remediation gets its own",
            "fieldPath": ".spec.answer",
            "reason": "FieldValueForbidden"
        },
        {
            "rule": "!has(self.metadata) || !has(self.metadata.annotations) || !self.metadata.annotations.exists(k, k.startsWith('mailgun.infrastructure.cluster.x-k8s.io/'))",
            "message": "the provider's own annotations (mailgun.infrastructure.cluster.x-k8s.io/...) must not be set in a template: they are its records",
            "fieldPath": ".metadata.annotations",
            "reason": "FieldValueForbidden"
        }
    ]))]
    pub template: MailgunRemediationTemplateResource,
}

#[cfg(test)]
mod tests {
    use kube::CustomResourceExt;

    use super::*;

    #[test]
    fn an_empty_spec_takes_every_default() {
        let spec: MailgunRemediationSpec =
            serde_json::from_value(serde_json::json!({"request": "Power-cycle it."}))
                .expect("a spec with only its request");
        assert_eq!(spec.priority, Priority::Urgent);
        assert_eq!(spec.strategy, RemediationStrategy::default());
        assert_eq!(spec.strategy.answer_timeout, "24h");
        assert_eq!(spec.strategy.repair_timeout, "1h");
        assert_eq!(spec.strategy.reminders, 1);
        assert_eq!(spec.strategy.unfulfilled, Unfulfilled::Wait);
        assert_eq!(spec.answer, None);
    }

    #[test]
    fn the_schema_carries_the_defaults_the_api_server_applies() {
        let crd = serde_json::to_value(MailgunRemediation::crd()).expect("CRD as JSON");
        let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
        assert_eq!(spec["properties"]["priority"]["default"], "Urgent");
        let strategy = &spec["properties"]["strategy"];
        assert_eq!(strategy["default"]["answerTimeout"], DEFAULT_ANSWER_TIMEOUT);
        assert_eq!(strategy["default"]["reminders"], DEFAULT_REMINDERS);
        assert_eq!(strategy["default"]["repairTimeout"], DEFAULT_REPAIR_TIMEOUT);
        assert_eq!(strategy["default"]["unfulfilled"], "Wait");
        assert_eq!(strategy["properties"]["reminders"]["maximum"], 3.0);
        let rules = spec["x-kubernetes-validations"].to_string();
        assert!(rules.contains("answer is set-once"), "{rules}");
    }
}
