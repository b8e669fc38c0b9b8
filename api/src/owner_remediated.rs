//! Handing a Machine back to its owner: the Machine's `OwnerRemediated=False` condition, written
//! as a JSON Patch that touches that one condition and nothing else.
//!
//! Cluster API's MachineSet and KubeadmControlPlane replace a Machine whose v1beta2 conditions
//! say `HealthCheckSucceeded=False` and `OwnerRemediated=False`; the deprecated v1beta1 copy is
//! written too, for readers of the old conditions. Other controllers own the Machine's other
//! conditions, so the patch never carries a whole list: it adds or replaces the one entry by its
//! index, guarded by `test` operations on the Machine's UID (the Machine the remediation was
//! made for, not a namesake made since) and its `resourceVersion` (the indexes were read from
//! that version: a write in between fails the patch, and the caller reads again). The v1beta2
//! list is keyed by `type` (server-side apply could own one entry), the deprecated v1beta1 list
//! is atomic (it could not): one guarded patch serves both.
//!
//! An `OwnerRemediated` already `False` is left as it is: the Machine was handed back already,
//! and its owner rewrites that condition with its own reasons (a remediation deferred by
//! `maxInFlight`, a Machine pending removal in a rollout): those are the owner's answer, read
//! back with [`owner_answer`], never overwritten.

use serde_json::{Value, json};

/// The condition's type, in both condition lists.
pub const OWNER_REMEDIATED: &str = "OwnerRemediated";
/// The reason this provider writes.
pub const HANDED_BACK_REASON: &str = "ExternallyRemediatedByMail";
/// Cluster API's `HealthCheckSucceeded` condition (set by the MachineHealthCheck).
pub const HEALTH_CHECK_SUCCEEDED: &str = "HealthCheckSucceeded";

/// Why no patch can be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum HandBackError {
    /// The object has no `metadata.uid` or `metadata.resourceVersion` (not read from the API).
    #[error("the Machine has no {0}: it was not read from the API server")]
    NotRead(&'static str),
}

/// The condition named `kind` in the list at `pointer` of `machine`, if any, and its index.
fn find<'a>(machine: &'a Value, pointer: &str, kind: &str) -> Option<(usize, &'a Value)> {
    machine
        .pointer(pointer)?
        .as_array()?
        .iter()
        .enumerate()
        .find(|(_, c)| c["type"] == kind)
}

/// Whether `machine`'s v1beta2 condition `kind` has `status`.
pub fn condition_is(machine: &Value, kind: &str, status: &str) -> bool {
    find(machine, "/status/conditions", kind).is_some_and(|(_, c)| c["status"] == status)
}

/// The owner's reason and message on an `OwnerRemediated=False` condition that is not ours:
/// what the MachineSet or control plane says about replacing the Machine.
pub fn owner_answer(machine: &Value) -> Option<(String, String)> {
    let (_, c) = find(machine, "/status/conditions", OWNER_REMEDIATED)?;
    let reason = c["reason"].as_str().unwrap_or_default();
    (c["status"] == "False" && reason != HANDED_BACK_REASON).then(|| {
        (
            reason.to_owned(),
            c["message"].as_str().unwrap_or_default().to_owned(),
        )
    })
}

/// The operations that set the condition in the list at `list` (a JSON pointer) of `machine`:
/// nothing when it is already `False`, a replace of its entry when it is `True`, an append when
/// the list exists, otherwise one `add` at the shallowest missing object on the way to it (its
/// value the rest of the path down to a list of the one condition).
fn set_ops(machine: &Value, list: &str, condition: Value) -> Vec<Value> {
    match find(machine, list, OWNER_REMEDIATED) {
        Some((_, c)) if c["status"] == "False" => Vec::new(),
        Some((i, _)) => {
            vec![json!({"op": "replace", "path": format!("{list}/{i}"), "value": condition})]
        }
        None if machine.pointer(list).is_some_and(Value::is_array) => {
            vec![json!({"op": "add", "path": format!("{list}/-"), "value": condition})]
        }
        None => {
            let keys: Vec<&str> = list.split('/').skip(1).collect();
            let missing = (1..=keys.len())
                .find(|&depth| {
                    machine
                        .pointer(&format!("/{}", keys[..depth].join("/")))
                        .is_none()
                })
                .unwrap_or(keys.len());
            let mut value = json!([condition]);
            for key in keys[missing..].iter().rev() {
                value = json!({ *key: value });
            }
            let path = format!("/{}", keys[..missing].join("/"));
            vec![json!({"op": "add", "path": path, "value": value})]
        }
    }
}

/// The JSON Patch (RFC 6902) that hands `machine` (as read, with its UID and resourceVersion)
/// back to its owner: `OwnerRemediated=False` with `message`, in the v1beta2 conditions and
/// the deprecated v1beta1 ones (severity `Warning`), at time `now` (RFC 3339). `None` when
/// both already say `False`.
///
/// # Errors
/// When the Machine was not read from the API server (no UID or resourceVersion).
pub fn hand_back_patch(
    machine: &Value,
    message: &str,
    now: &str,
) -> Result<Option<Value>, HandBackError> {
    let uid = machine["metadata"]["uid"]
        .as_str()
        .ok_or(HandBackError::NotRead("metadata.uid"))?;
    let version = machine["metadata"]["resourceVersion"]
        .as_str()
        .ok_or(HandBackError::NotRead("metadata.resourceVersion"))?;
    let v1beta2 = json!({
        "type": OWNER_REMEDIATED, "status": "False", "reason": HANDED_BACK_REASON,
        "message": message, "lastTransitionTime": now,
    });
    let v1beta1 = json!({
        "type": OWNER_REMEDIATED, "status": "False", "reason": HANDED_BACK_REASON,
        "severity": "Warning", "message": message, "lastTransitionTime": now,
    });
    // Below an existing status the two lists' operations are independent (neither adds
    // `/status`); without one, one operation adds it with both.
    let ops = if machine.pointer("/status").is_some_and(Value::is_object) {
        let mut ops = set_ops(machine, "/status/conditions", v1beta2);
        ops.extend(set_ops(
            machine,
            "/status/deprecated/v1beta1/conditions",
            v1beta1,
        ));
        ops
    } else {
        vec![json!({"op": "add", "path": "/status", "value": {
            "conditions": [v1beta2], "deprecated": {"v1beta1": {"conditions": [v1beta1]}},
        }})]
    };
    if ops.is_empty() {
        return Ok(None);
    }
    let mut patch = vec![
        json!({"op": "test", "path": "/metadata/uid", "value": uid}),
        json!({"op": "test", "path": "/metadata/resourceVersion", "value": version}),
    ];
    patch.extend(ops);
    Ok(Some(Value::Array(patch)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn machine(status: Value) -> Value {
        json!({
            "metadata": {"name": "m-0", "namespace": "ns", "uid": "u-1", "resourceVersion": "42"},
            "status": status,
        })
    }

    /// Applies a JSON Patch the way the API server does, for the operations used here.
    fn apply(mut doc: Value, patch: &Value) -> Value {
        for op in patch.as_array().expect("array") {
            let path = op["path"].as_str().expect("path");
            match op["op"].as_str().expect("op") {
                "test" => assert_eq!(doc.pointer(path), Some(&op["value"]), "{path}"),
                "replace" => *doc.pointer_mut(path).expect("replace target") = op["value"].clone(),
                "add" => {
                    let (parent, key) = path.rsplit_once('/').expect("parent");
                    let parent = doc.pointer_mut(parent).expect("add parent");
                    match parent {
                        Value::Array(items) if key == "-" => items.push(op["value"].clone()),
                        Value::Object(map) => {
                            map.insert(key.to_owned(), op["value"].clone());
                        }
                        other => panic!("add into {other}"),
                    }
                }
                other => panic!("op {other}"),
            }
        }
        doc
    }

    fn others() -> Value {
        json!([
            {"type": "Ready", "status": "False", "reason": "NotReady", "message": "", "lastTransitionTime": "t0"},
            {"type": HEALTH_CHECK_SUCCEEDED, "status": "False", "reason": "UnhealthyNode", "message": "Node not ready", "lastTransitionTime": "t1"},
        ])
    }

    #[test]
    fn the_condition_is_appended_beside_the_others_under_both_guards() {
        let m = machine(
            json!({"conditions": others(), "deprecated": {"v1beta1": {"conditions": [
            {"type": "Ready", "status": "False", "severity": "Info", "lastTransitionTime": "t0"}]}}}),
        );
        let patch = hand_back_patch(&m, "handed back", "t2").unwrap().unwrap();
        assert_eq!(
            patch[0],
            json!({"op": "test", "path": "/metadata/uid", "value": "u-1"})
        );
        assert_eq!(
            patch[1],
            json!({"op": "test", "path": "/metadata/resourceVersion", "value": "42"})
        );
        let after = apply(m.clone(), &patch);
        let conditions = after["status"]["conditions"].as_array().unwrap();
        assert_eq!(&conditions[..2], others().as_array().unwrap().as_slice());
        assert_eq!(conditions[2]["type"], OWNER_REMEDIATED);
        assert_eq!(conditions[2]["status"], "False");
        assert_eq!(conditions[2]["message"], "handed back");
        let old = after["status"]["deprecated"]["v1beta1"]["conditions"]
            .as_array()
            .unwrap();
        assert_eq!(old.len(), 2);
        assert_eq!(old[0]["type"], "Ready");
        assert_eq!(old[1]["severity"], "Warning");
        assert!(condition_is(&after, OWNER_REMEDIATED, "False"));
        assert_eq!(
            owner_answer(&after),
            None,
            "our own reason is no owner's answer"
        );
    }

    #[test]
    fn missing_lists_and_parents_are_created() {
        let m = machine(json!({"conditions": others()}));
        let after = apply(m.clone(), &hand_back_patch(&m, "x", "t").unwrap().unwrap());
        assert_eq!(
            after["status"]["deprecated"]["v1beta1"]["conditions"][0]["type"],
            OWNER_REMEDIATED
        );
        let bare = json!({"metadata": {"uid": "u", "resourceVersion": "1"}});
        let after = apply(
            bare.clone(),
            &hand_back_patch(&bare, "x", "t").unwrap().unwrap(),
        );
        assert_eq!(after["status"]["conditions"][0]["type"], OWNER_REMEDIATED);
        assert_eq!(
            after["status"]["deprecated"]["v1beta1"]["conditions"][0]["type"],
            OWNER_REMEDIATED
        );
    }

    #[test]
    fn a_true_condition_is_replaced_in_place_and_a_false_one_left_alone() {
        let mut conditions = others();
        conditions.as_array_mut().unwrap().insert(
            1,
            json!({"type": OWNER_REMEDIATED, "status": "True", "reason": "Done", "message": "", "lastTransitionTime": "t0"}),
        );
        let m = machine(json!({"conditions": conditions}));
        let patch = hand_back_patch(&m, "again", "t3").unwrap().unwrap();
        assert!(
            patch
                .as_array()
                .unwrap()
                .iter()
                .any(|op| op["op"] == "replace" && op["path"] == "/status/conditions/1"),
            "{patch}"
        );
        let after = apply(m, &patch);
        assert_eq!(after["status"]["conditions"].as_array().unwrap().len(), 3);
        assert_eq!(after["status"]["conditions"][1]["status"], "False");

        let deferred = json!({"type": OWNER_REMEDIATED, "status": "False", "reason": "MachineRemediationDeferred",
            "message": "Waiting because there are already too many remediations in progress", "lastTransitionTime": "t4"});
        let m = machine(
            json!({"conditions": [deferred.clone()], "deprecated": {"v1beta1": {"conditions": [
            {"type": OWNER_REMEDIATED, "status": "False", "lastTransitionTime": "t4"}]}}}),
        );
        assert_eq!(hand_back_patch(&m, "x", "t").unwrap(), None);
        assert_eq!(
            owner_answer(&m),
            Some((
                "MachineRemediationDeferred".to_owned(),
                "Waiting because there are already too many remediations in progress".to_owned()
            ))
        );
    }

    #[test]
    fn a_machine_not_read_from_the_api_server_gets_no_patch() {
        let err = hand_back_patch(&json!({"metadata": {"uid": "u"}}), "x", "t").unwrap_err();
        assert_eq!(err, HandBackError::NotRead("metadata.resourceVersion"));
    }
}
