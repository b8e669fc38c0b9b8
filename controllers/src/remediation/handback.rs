//! Handing a Machine back to its owner, and the brake on timed hand-backs.
//!
//! Both read the live Machine (not the cache: the guarded patch needs the version it was built
//! from, and the selector needs the Machine's labels, which the cache drops); the brake reads
//! the watched MachineHealthChecks (a change to one wakes its Cluster's held hand-backs). The hand-back is
//! the JSON Patch of [`capm_api::owner_remediated`] on `machines/status` only, guarded by the
//! Machine's UID and `resourceVersion`: no other condition is touched, a Machine written in
//! between makes it fail whole (retried with a fresh read). The brake is the
//! `RemediationAllowed` condition of the MachineHealthChecks that select the Machine (its
//! `maxUnhealthy`/`unhealthyRange`): a timer must not release what it holds.

use std::sync::Arc;

use capm_api::{capi::MachineHealthCheck, owner_remediated::hand_back_patch};
use futures::FutureExt;
use k8s_openapi::jiff::Timestamp;
use kube::{
    Api, ResourceExt,
    api::{ApiResource, DynamicObject, GroupVersionKind, ListParams, Patch, PatchParams},
};
use serde_json::Value;

use super::decide::Brake;
use crate::context::{Ctx, FIELD_MANAGER, ReconcileError};

/// A Cluster API v1beta2 kind, dynamically (the provider reads these whole only here).
fn capi_api(ctx: &Ctx, namespace: &str, kind: &str, plural: &str) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk(capm_api::capi::GROUP, "v1beta2", kind);
    let resource = ApiResource::from_gvk_with_plural(&gvk, plural);
    Api::namespaced_with(ctx.client.clone(), namespace, &resource)
}

/// The Machine as the API server has it now, as JSON (`None`: gone).
pub(super) async fn live_machine(
    ctx: &Ctx,
    namespace: &str,
    name: &str,
) -> Result<Option<Value>, ReconcileError> {
    let machine = capi_api(ctx, namespace, "Machine", "machines")
        .get_opt(name)
        .await
        .map_err(ReconcileError::kube("reading the Machine"))?;
    Ok(machine.and_then(|m| serde_json::to_value(m).ok()))
}

/// Whether the MachineHealthChecks selecting `machine` (same Cluster, selector matching its
/// labels) allow remediation now: [`Brake::Held`] when one reports `RemediationAllowed=False`.
/// Read from the watched store; until that is listed (or where Cluster API has no
/// MachineHealthCheck kind, so it never is) from the API server.
pub(super) async fn brake(ctx: &Ctx, machine: &Value) -> Result<Brake, ReconcileError> {
    let namespace = machine["metadata"]["namespace"]
        .as_str()
        .unwrap_or_default();
    let store = &ctx.capi.health_checks;
    let checks: Vec<Arc<MachineHealthCheck>> = if store
        .wait_until_ready()
        .now_or_never()
        .is_some_and(|r| r.is_ok())
    {
        let state = store.state().into_iter();
        state
            .filter(|c| c.namespace().as_deref() == Some(namespace))
            .collect()
    } else {
        let api = Api::<MachineHealthCheck>::namespaced(ctx.client.clone(), namespace);
        match api.list(&ListParams::default()).await {
            Ok(list) => list.items.into_iter().map(Arc::new).collect(),
            // No MachineHealthCheck kind: nothing selects the Machine, nothing holds it.
            Err(kube::Error::Api(s)) if s.code == 404 => return Ok(Brake::Released),
            Err(e) => return Err(ReconcileError::kube("listing MachineHealthChecks")(e)),
        }
    };
    let held = checks.iter().any(|check| {
        let selector = serde_json::to_value(&check.spec.selector).unwrap_or_default();
        check.spec.cluster_name.as_deref() == machine["spec"]["clusterName"].as_str()
            && selects(&selector, &machine["metadata"]["labels"])
            && check.holds_remediation()
    });
    Ok(if held { Brake::Held } else { Brake::Released })
}

/// Whether the label selector `selector` (`matchLabels`, `matchExpressions`) selects `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let label = |key: &str| labels.get(key).and_then(Value::as_str);
    let matching = selector["matchLabels"]
        .as_object()
        .is_none_or(|m| m.iter().all(|(k, v)| label(k) == v.as_str()));
    let empty = Vec::new();
    let expressions = selector["matchExpressions"].as_array().unwrap_or(&empty);
    matching
        && expressions.iter().all(|e| {
            let value = label(e["key"].as_str().unwrap_or_default());
            let listed = |v: &str| {
                e["values"]
                    .as_array()
                    .is_some_and(|vs| vs.iter().any(|x| x == v))
            };
            match e["operator"].as_str() {
                Some("In") => value.is_some_and(listed),
                Some("NotIn") => !value.is_some_and(listed),
                Some("Exists") => value.is_some(),
                Some("DoesNotExist") => value.is_none(),
                _ => false,
            }
        })
}

/// Sets `machine`'s `OwnerRemediated=False` with `message` (nothing when it already says so),
/// on `machines/status`, guarded by the UID and `resourceVersion` it was read with.
pub(super) async fn hand_back(
    ctx: &Ctx,
    machine: &Value,
    message: &str,
) -> Result<(), ReconcileError> {
    let now = Timestamp::now().round(k8s_openapi::jiff::Unit::Second);
    let patch = hand_back_patch(
        machine,
        message,
        &now.map_or_else(|_| String::new(), |t| t.to_string()),
    )
    .map_err(|e| ReconcileError::InvalidSpec(e.to_string()))?;
    let Some(patch) = patch else {
        return Ok(());
    };
    let patch: json_patch::Patch =
        serde_json::from_value(patch).map_err(|e| ReconcileError::InvalidSpec(e.to_string()))?;
    let metadata = &machine["metadata"];
    let (namespace, name) = (
        metadata["namespace"].as_str().unwrap_or_default(),
        metadata["name"].as_str().unwrap_or_default(),
    );
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PatchParams::default()
    };
    ctx.ensure_leading()?;
    let written = capi_api(ctx, namespace, "Machine", "machines")
        .patch_status(name, &params, &Patch::<()>::Json(patch))
        .await;
    match written {
        Ok(_) => Ok(()),
        // A `test` failed: the Machine changed since it was read (or is another one now).
        Err(kube::Error::Api(s)) if s.code == 422 || s.code == 409 => {
            Err(ReconcileError::Conflict("handing the Machine back"))
        }
        Err(e) => Err(ReconcileError::kube("handing the Machine back")(e)),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::selects;

    #[test]
    fn label_selectors_as_kubernetes_reads_them() {
        let labels = json!({"pool": "workers", "zone": "a"});
        for (selector, selected) in [
            (json!({}), true),
            (json!({"matchLabels": {"pool": "workers"}}), true),
            (json!({"matchLabels": {"pool": "cp"}}), false),
            (
                json!({"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a", "b"]}]}),
                true,
            ),
            (
                json!({"matchExpressions": [{"key": "zone", "operator": "NotIn", "values": ["a"]}]}),
                false,
            ),
            (
                json!({"matchExpressions": [{"key": "gpu", "operator": "DoesNotExist"}]}),
                true,
            ),
            (
                json!({"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}),
                false,
            ),
            (
                json!({"matchLabels": {"pool": "workers"}, "matchExpressions": [{"key": "zone", "operator": "Bogus"}]}),
                false,
            ),
        ] {
            assert_eq!(selects(&selector, &labels), selected, "{selector}");
        }
    }
}
