//! Remediation by mail: a `MailgunRemediation` owned by an unhealthy Machine whose
//! `MailgunMachine` was built gets exactly one repair mail, a threaded reminder after its
//! `answerTimeout`, and a `CannotRepair` answer hands the Machine back (`OwnerRemediated=False`,
//! every other condition as it was) without another mail; a hand-made one (its ownerReference's
//! UID not the Machine's) stays `Pending` and mails nobody. A `remediate-machine` annotation on
//! the Machine is reported, never removed; a reminder the backend refuses for good does not hold
//! the hand-back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use capm_api::{
    names,
    v1beta1::{HandBackReason, MailState, MailgunRemediation, RemediationPhase},
};
use capm_mail_servers::{FailureMode, FailureRule};
use kube::{
    Api, ResourceExt,
    api::{DynamicObject, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};
use support::{Env, PATIENCE, condition, eventually};

/// The shortest `answerTimeout` the CRD allows.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);

fn remediations(env: &Env) -> Api<MailgunRemediation> {
    Api::namespaced(env.ns.client.clone(), &env.ns.name)
}

/// A provider started as `manager` on an API server with our CRDs (remediation's too), Cluster
/// `c1`, and `MailgunMachine` `c1-m1`, built: it has a provider ID.
async fn started(manager: &str) -> Env {
    let crds = [
        capm_api::crd::crds().unwrap(),
        capm_api::crd::remediation_crds(),
    ]
    .concat();
    let mut env = Env::with_crds(manager, crds).await;
    env.start().await;
    env.create_cluster("c1", false).await;
    env.machines()
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunMachine",
                "metadata": { "name": "c1-m1", "labels": { names::CLUSTER_NAME_LABEL: "c1" } },
                "spec": { "priority": "Urgent", "request": "r", "requester": "dev@example.com", "providerID": "metal://rack-7/m1" },
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    env
}

/// A Machine of Cluster `c1` on `MailgunMachine` `infra`, unhealthy by the conditions a
/// MachineHealthCheck writes, beside other controllers' conditions (v1beta2 and v1beta1).
async fn unhealthy_machine(env: &Env, name: &str, infra: &str) -> DynamicObject {
    let machines = env.capi("Machine");
    let machine = serde_json::from_value(json!({
        "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
        "metadata": { "name": name, "labels": { names::CLUSTER_NAME_LABEL: "c1" } },
        "spec": { "clusterName": "c1", "bootstrap": {},
                  "infrastructureRef": { "apiGroup": capm_api::GROUP, "kind": "MailgunMachine", "name": infra } },
    }))
    .unwrap();
    machines
        .create(&PostParams::default(), &machine)
        .await
        .unwrap();
    let status = json!({ "status": {
        "nodeRef": { "name": format!("node-{name}") },
        "conditions": [
            { "type": "Ready", "status": "False", "reason": "NotReady", "message": "* NodeHealthy: not ready", "lastTransitionTime": "2026-11-28T10:00:00Z" },
            { "type": "HealthCheckSucceeded", "status": "False", "reason": "UnhealthyNode", "message": "Condition Ready on Node is reporting status Unknown for more than 5m0s", "lastTransitionTime": "2026-11-28T10:05:00Z" },
            { "type": "ExternallyRemediated", "status": "False", "reason": "WaitingForRemediation", "message": "", "lastTransitionTime": "2026-11-28T10:05:01Z" },
        ],
        "deprecated": { "v1beta1": { "conditions": [
            { "type": "Ready", "status": "False", "severity": "Warning", "reason": "NodeNotReady", "lastTransitionTime": "2026-11-28T10:00:00Z" },
        ]}},
    }});
    machines
        .patch_status(name, &PatchParams::default(), &Patch::Merge(status))
        .await
        .unwrap()
}

/// A `MailgunRemediation` named `machine`, owned by the Machine `owner` (name, UID): as a
/// MachineHealthCheck makes it when `owner` is that Machine.
async fn remediation(env: &Env, machine: &str, owner: (&str, &str)) -> MailgunRemediation {
    remediation_reminded(env, machine, owner, 1).await
}

/// [`remediation`] with this many reminders.
async fn remediation_reminded(
    env: &Env,
    machine: &str,
    owner: (&str, &str),
    reminders: u8,
) -> MailgunRemediation {
    let obj: MailgunRemediation = serde_json::from_value(json!({
        "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunRemediation",
        "metadata": {
            "name": machine,
            "labels": { names::CLUSTER_NAME_LABEL: "c1" },
            "ownerReferences": [{ "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
                                  "name": owner.0, "uid": owner.1 }],
        },
        "spec": { "request": "Power-cycle it, then check its disks.",
                  "strategy": { "answerTimeout": "1m", "reminders": reminders } },
    }))
    .unwrap();
    remediations(env)
        .create(&PostParams::default(), &obj)
        .await
        .unwrap()
}

async fn phase(env: &Env, name: &str) -> Option<RemediationPhase> {
    remediations(env).get(name).await.unwrap().status?.phase
}

/// The message of `Ready` on the remediation `name` (empty when none).
async fn ready_message(env: &Env, name: &str) -> String {
    let status = remediations(env).get(name).await.unwrap().status;
    let conditions = status.and_then(|s| s.conditions);
    condition(&conditions, "Ready").map_or_else(String::new, |c| c.message.clone())
}

/// The Machine's conditions in both lists but `OwnerRemediated`.
fn other_conditions(machine: &Value) -> (Vec<Value>, Vec<Value>) {
    let others = |pointer: &str| -> Vec<Value> {
        machine
            .pointer(pointer)
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter(|c| c["type"] != "OwnerRemediated")
            .cloned()
            .collect()
    };
    (
        others("/status/conditions"),
        others("/status/deprecated/v1beta1/conditions"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_repair_mail_a_threaded_reminder_then_cannot_repair_hands_the_machine_back() {
    let mut env = started("mgr").await;
    let machine = unhealthy_machine(&env, "m1", "c1-m1").await;
    let before = serde_json::to_value(&machine).unwrap();
    let created = remediation(&env, "m1", ("m1", &machine.uid().unwrap())).await;
    let uid = created.uid().unwrap();

    eventually(PATIENCE, "the repair mail", || async {
        !env.mails().is_empty()
    })
    .await;
    let asked = std::time::Instant::now();
    let mails = env.mails();
    assert_eq!(mails.len(), 1, "exactly one repair mail");
    let repair = &mails[0];
    assert_eq!(
        repair.subject,
        "[Urgent] Machine m1 of Cluster c1 needs repair"
    );
    let first_id = format!("<mailgunremediation.{uid}@{}>", support::DOMAIN);
    assert_eq!(repair.id, first_id);
    let text = repair.text.as_deref().unwrap();
    for needle in [
        "Power-cycle it, then check its disks.",
        "Node: node-m1",
        "Provider ID: metal://rack-7/m1",
        "UnhealthyNode: Condition Ready on Node is reporting status Unknown",
        r#"kubectl patch mailgunremediation m1 -n"#,
        r#"'{"spec":{"answer":{"result":"Repaired"}}}'"#,
    ] {
        assert!(text.contains(needle), "{needle:?} missing from:\n{text}");
    }
    eventually(PATIENCE, "WaitingForAnswer", || async {
        phase(&env, "m1").await == Some(RemediationPhase::WaitingForAnswer)
    })
    .await;
    let status = remediations(&env).get("m1").await.unwrap().status.unwrap();
    assert!(status.asked_at.is_some());
    assert_eq!(
        condition(&status.conditions, "MailSent").map(|c| c.status.as_str()),
        Some("True")
    );
    // Someone asks Cluster API to remediate the Machine by hand: reported, never removed.
    env.capi("Machine")
        .patch(
            "m1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "metadata": { "annotations": {
                names::REMEDIATE_MACHINE_ANNOTATION: ""
            } } })),
        )
        .await
        .unwrap();
    eventually(PATIENCE, "Ready naming remediate-machine", || async {
        ready_message(&env, "m1")
            .await
            .contains(names::REMEDIATE_MACHINE_ANNOTATION)
    })
    .await;

    // Nothing more before the answer timeout; the reminder right after it, threaded.
    tokio::time::sleep(ANSWER_TIMEOUT.saturating_sub(asked.elapsed() + Duration::from_secs(10)))
        .await;
    assert_eq!(env.mails().len(), 1, "no reminder before answerTimeout");
    eventually(PATIENCE, "the reminder", || async {
        env.mails().len() >= 2
    })
    .await;
    let mails = env.mails();
    assert_eq!(mails.len(), 2, "one reminder");
    let reminder = &mails[1];
    assert_eq!(
        reminder.id,
        format!("<mailgunremediation-reminder-1.{uid}@{}>", support::DOMAIN)
    );
    assert_eq!(reminder.subject, format!("Re: {}", repair.subject));
    assert_eq!(reminder.headers.get("In-Reply-To"), Some(&first_id));
    assert_eq!(reminder.headers.get("References"), Some(&first_id));
    assert!(
        reminder
            .text
            .as_deref()
            .unwrap()
            .starts_with("Reminder 1 of 1")
    );

    // The human cannot repair it: handed back at once, no mail.
    remediations(&env)
        .patch(
            "m1",
            &PatchParams::default(),
            &Patch::Merge(json!({ "spec": { "answer": {
                "result": "CannotRepair", "message": "The mainboard is dead."
            } } })),
        )
        .await
        .unwrap();
    eventually(PATIENCE, "HandedBack", || async {
        phase(&env, "m1").await == Some(RemediationPhase::HandedBack)
    })
    .await;
    let after = serde_json::to_value(env.capi("Machine").get("m1").await.unwrap()).unwrap();
    let owner_remediated = |pointer: &str| {
        after
            .pointer(pointer)
            .and_then(Value::as_array)
            .and_then(|c| c.iter().find(|c| c["type"] == "OwnerRemediated"))
            .cloned()
            .unwrap_or_default()
    };
    let v1beta2 = owner_remediated("/status/conditions");
    assert_eq!(v1beta2["status"], "False");
    assert_eq!(v1beta2["reason"], "ExternallyRemediatedByMail");
    let message = v1beta2["message"].as_str().unwrap();
    assert!(
        message.contains("m1") && message.contains("CannotRepair"),
        "{message}"
    );
    assert_eq!(
        owner_remediated("/status/deprecated/v1beta1/conditions")["status"],
        "False"
    );
    assert_eq!(
        other_conditions(&after),
        other_conditions(&before),
        "every other condition as it was"
    );
    assert!(
        after["metadata"]["annotations"]
            .get(names::REMEDIATE_MACHINE_ANNOTATION)
            .is_some(),
        "the annotation stays: {}",
        after["metadata"]
    );
    let ready = ready_message(&env, "m1").await;
    assert!(ready.contains("never does"), "{ready}");
    let status = remediations(&env).get("m1").await.unwrap().status.unwrap();
    assert!(status.handed_back_at.is_some() && status.answered_at.is_some());
    for (type_, reason) in [("HandedBack", "CannotRepair"), ("Answered", "CannotRepair")] {
        let c = condition(&status.conditions, type_).unwrap();
        assert_eq!((c.status.as_str(), c.reason.as_str()), ("True", reason));
    }
    assert_eq!(
        env.metric(
            "capm_remediation_hand_backs_total",
            Some(("reason", "CannotRepair"))
        ),
        1.0
    );
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        env.mails().len(),
        2,
        "an answer and a hand-back send no mail"
    );

    // A hand-made object for the unhealthy Machine m2, its ownerReference another Machine's
    // (one naming no live Machine is garbage-collected at once).
    let other = unhealthy_machine(&env, "m2", "c1-m1").await;
    remediation(&env, "m2", ("m1", &machine.uid().unwrap())).await;
    eventually(PATIENCE, "Pending", || async {
        phase(&env, "m2").await == Some(RemediationPhase::Pending)
    })
    .await;
    let status = remediations(&env).get("m2").await.unwrap().status.unwrap();
    let ready = condition(&status.conditions, "Ready").unwrap();
    assert_eq!(ready.reason, names::reasons::REMEDIATION_PENDING);
    assert!(ready.message.contains("UID"), "{}", ready.message);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(env.mails().len(), 2, "a hand-made remediation mails nobody");
    let untouched = serde_json::to_value(env.capi("Machine").get("m2").await.unwrap()).unwrap();
    assert_eq!(
        other_conditions(&untouched),
        other_conditions(&serde_json::to_value(&other).unwrap())
    );
    assert!(
        !untouched.to_string().contains("OwnerRemediated"),
        "not handed back"
    );

    // The Machine replaced, the object deleted: after a hand-back its finalizer goes, no mail.
    remediations(&env)
        .delete("m1", &kube::api::DeleteParams::default())
        .await
        .unwrap();
    eventually(PATIENCE, "m1 gone", || async {
        remediations(&env).get_opt("m1").await.unwrap().is_none()
    })
    .await;
    assert_eq!(
        env.mails().len(),
        2,
        "no 'no longer needed' after a hand-back"
    );
    env.stop().await;
}

/// The MachineHealthCheck deletes the object (the Machine is healthy again) before anyone
/// answered: one "no longer needed" mail, threaded to the repair mail, then the finalizer goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthy_again_before_an_answer_one_no_longer_needed_mail() {
    let mut env = started("mgr-nln").await;
    let machine = unhealthy_machine(&env, "m1", "c1-m1").await;
    let created = remediation(&env, "m1", ("m1", &machine.uid().unwrap())).await;
    let uid = created.uid().unwrap();
    eventually(PATIENCE, "the repair mail", || async {
        !env.mails().is_empty()
    })
    .await;
    eventually(PATIENCE, "our finalizer", || async {
        let obj = remediations(&env).get("m1").await.unwrap();
        obj.finalizers()
            .iter()
            .any(|f| f == names::REMEDIATION_FINALIZER)
    })
    .await;
    remediations(&env)
        .delete("m1", &kube::api::DeleteParams::default())
        .await
        .unwrap();
    eventually(PATIENCE, "m1 gone", || async {
        remediations(&env).get_opt("m1").await.unwrap().is_none()
    })
    .await;
    let mails = env.mails();
    assert_eq!(mails.len(), 2, "the repair mail and one 'no longer needed'");
    let first_id = format!("<mailgunremediation.{uid}@{}>", support::DOMAIN);
    let done = &mails[1];
    assert_eq!(
        done.id,
        format!("<mailgunremediation-deleted.{uid}@{}>", support::DOMAIN)
    );
    assert_eq!(done.subject, format!("Re: {}", mails[0].subject));
    assert_eq!(done.headers.get("In-Reply-To"), Some(&first_id));
    assert!(done.text.as_deref().unwrap().contains("no longer needed"));
    assert_eq!(
        env.metric(
            "capm_remediations_total",
            Some(("outcome", "no_longer_needed"))
        ),
        1.0
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(env.mails().len(), 2);
    let machine = serde_json::to_value(env.capi("Machine").get("m1").await.unwrap()).unwrap();
    assert!(
        !machine.to_string().contains("OwnerRemediated"),
        "not handed back"
    );
    env.stop().await;
}

/// The backend refuses the reminder for good: the flow does not stop there. The refusal shows in
/// status (the reminder `Failed`, `MailSent` saying so) and the Machine is handed back
/// (`NoAnswer`) an `answerTimeout` after the reminder was due, with no other mail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reminder_refused_for_good_does_not_hold_the_hand_back() {
    let mut env = started("mgr-refused").await;
    let machine = unhealthy_machine(&env, "m1", "c1-m1").await;
    remediation(&env, "m1", ("m1", &machine.uid().unwrap())).await;
    eventually(PATIENCE, "the repair mail", || async {
        !env.mails().is_empty()
    })
    .await;
    let asked = std::time::Instant::now();
    // From now on the backend refuses every message for good (401).
    env.mailgun
        .set_failure(FailureRule::new(FailureMode::Unauthorized))
        .unwrap();
    eventually(
        2 * ANSWER_TIMEOUT + PATIENCE,
        "HandedBack after the refused reminder",
        || async { phase(&env, "m1").await == Some(RemediationPhase::HandedBack) },
    )
    .await;
    assert!(
        asked.elapsed() >= 2 * ANSWER_TIMEOUT - Duration::from_secs(10),
        "handed back after {:?}: before the refused reminder's wait was over",
        asked.elapsed()
    );
    let status = remediations(&env).get("m1").await.unwrap().status.unwrap();
    assert_eq!(status.hand_back_reason, Some(HandBackReason::NoAnswer));
    let reminders = status.reminders.unwrap_or_default();
    assert_eq!(reminders.len(), 1, "{reminders:?}");
    assert_eq!(reminders[0].state, Some(MailState::Failed));
    let sent = condition(&status.conditions, "MailSent").unwrap();
    assert_eq!(sent.status, "True");
    assert!(
        sent.message.contains("reminder 1 refused"),
        "{}",
        sent.message
    );
    let handed = serde_json::to_value(env.capi("Machine").get("m1").await.unwrap()).unwrap();
    let owner_remediated = handed["status"]["conditions"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["type"] == "OwnerRemediated"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(owner_remediated["status"], "False", "{handed}");
    env.mailgun.clear_failure().unwrap();
    assert_eq!(env.mails().len(), 1, "only the repair mail went out");
    env.stop().await;
}

/// A MachineHealthCheck of Cluster `c1` selecting its Machines, whose `RemediationAllowed` is
/// `allowed`.
async fn health_check(env: &Env, allowed: bool) {
    let checks = env.capi("MachineHealthCheck");
    let status = json!({ "status": { "conditions": [{
        "type": "RemediationAllowed", "status": if allowed { "True" } else { "False" },
        "reason": if allowed { "RemediationAllowed" } else { "TooManyUnhealthy" },
        "message": "", "lastTransitionTime": "2026-11-29T08:00:00Z",
    }] } });
    if checks.get_opt("c1-workers").await.unwrap().is_none() {
        let check = serde_json::from_value(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "MachineHealthCheck",
            "metadata": { "name": "c1-workers" },
            "spec": { "clusterName": "c1",
                      "selector": { "matchLabels": { names::CLUSTER_NAME_LABEL: "c1" } } },
        }))
        .unwrap();
        checks.create(&PostParams::default(), &check).await.unwrap();
    }
    checks
        .patch_status("c1-workers", &PatchParams::default(), &Patch::Merge(status))
        .await
        .unwrap();
}

/// A timed hand-back waits while the MachineHealthCheck reports `RemediationAllowed=False`, and
/// goes through within seconds of it allowing remediation again (its watch wakes the held
/// remediation; no timer).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_hand_back_goes_through_when_the_brake_releases() {
    let mut env = started("mgr-brake").await;
    let machine = unhealthy_machine(&env, "m1", "c1-m1").await;
    health_check(&env, false).await;
    remediation_reminded(&env, "m1", ("m1", &machine.uid().unwrap()), 0).await;
    eventually(
        ANSWER_TIMEOUT + PATIENCE,
        "HandBackHeld after the answer timeout",
        || async { phase(&env, "m1").await == Some(RemediationPhase::HandBackHeld) },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        phase(&env, "m1").await,
        Some(RemediationPhase::HandBackHeld)
    );
    health_check(&env, true).await;
    let released = std::time::Instant::now();
    eventually(
        Duration::from_secs(5),
        "HandedBack once released",
        || async { phase(&env, "m1").await == Some(RemediationPhase::HandedBack) },
    )
    .await;
    eprintln!("handed back {:?} after the release", released.elapsed());
    let status = remediations(&env).get("m1").await.unwrap().status.unwrap();
    assert_eq!(status.hand_back_reason, Some(HandBackReason::NoAnswer));
    assert_eq!(env.mails().len(), 1, "only the repair mail");
    env.stop().await;
}
