//! What is believed of a remediation's Machine: nothing the object says, only the caches.

use std::sync::Arc;

use capm_api::{
    capi::{self, Machine},
    names,
    owner_remediated::HEALTH_CHECK_SUCCEEDED,
    v1beta1::{MailgunMachine, MailgunRemediation},
};
use kube::{ResourceExt, runtime::reflector::ObjectRef};

use super::decide::MachineView;
use crate::kinds::{Mailed, Stores};

/// The Machine as believed, with what the mails say of it.
#[derive(Debug, Clone)]
pub struct Believed {
    pub view: MachineView,
    /// The object's Machine, when it is believed (paused or not).
    pub machine: Option<Arc<Machine>>,
    /// Its `MailgunMachine`'s `providerID` (another infrastructure's: the Machine's).
    pub provider_id: Option<String>,
}

/// The Machine named like `obj` in its namespace, believed only when one of `obj`'s
/// ownerReferences is that Machine by name and UID: a hand-made object, or one whose Machine was
/// replaced since (same name, new UID), is not. Then whether its Cluster is paused, whether it
/// is unhealthy by its own `HealthCheckSucceeded`, whether it was built.
pub fn believe(obj: &MailgunRemediation, capi: &Stores) -> Believed {
    let (name, namespace) = (obj.name_any(), obj.namespace().unwrap_or_default());
    let not = |why: String| Believed {
        view: MachineView::NotBelieved(why),
        machine: None,
        provider_id: None,
    };
    let Some(machine) = capi.machines.get(&ObjectRef::new(&name).within(&namespace)) else {
        return not(format!("no Machine {name} in namespace {namespace}"));
    };
    let uid = machine.uid().unwrap_or_default();
    let owned = obj.owner_references().iter().any(|r| {
        capi::owner(std::slice::from_ref(r), MailgunRemediation::OWNER_KIND).is_some()
            && r.name == name
            && r.uid == uid
    });
    if !owned {
        return not(format!(
            "no ownerReference names Machine {name} with its UID: not made for this Machine"
        ));
    }
    let provider_id = built(&machine, capi, &namespace);
    let paused = obj.annotations().contains_key(names::PAUSED_ANNOTATION)
        || machine.cluster_name().is_some_and(|c| {
            let cluster = capi.clusters.get(&ObjectRef::new(&c).within(&namespace));
            cluster.is_some_and(|c| c.paused())
        });
    let view = if paused {
        MachineView::Paused
    } else {
        MachineView::Believed {
            unhealthy: machine
                .condition(HEALTH_CHECK_SUCCEEDED)
                .is_some_and(|c| c.status == "False"),
            fulfilled: provider_id.is_some(),
        }
    };
    Believed {
        view,
        machine: Some(machine),
        provider_id,
    }
}

/// The provider ID of the Machine's infrastructure: its `MailgunMachine`'s once a human
/// fulfilled it; another infrastructure's as the Machine shows it.
fn built(machine: &Machine, capi: &Stores, namespace: &str) -> Option<String> {
    match machine.spec.infrastructure_ref.as_ref() {
        Some(r) if r.api_group == capm_api::GROUP && r.kind == MailgunMachine::KIND => {
            let infra = capi
                .mailgun_machines
                .get(&ObjectRef::new(&r.name).within(namespace));
            infra.and_then(|m| m.spec.provider_id.clone())
        }
        _ => machine.spec.provider_id.clone(),
    }
}

#[cfg(test)]
mod tests {
    use kube::runtime::{reflector, watcher::Event};
    use serde_json::json;

    use super::*;

    fn store<K>(objects: Vec<K>) -> kube::runtime::reflector::Store<K>
    where
        K: kube::Resource<DynamicType = ()> + Clone + 'static,
    {
        let (store, mut writer) = reflector::store();
        writer.apply_watcher_event(&Event::Init);
        for o in objects {
            writer.apply_watcher_event(&Event::InitApply(o));
        }
        writer.apply_watcher_event(&Event::InitDone);
        store
    }

    fn machine(health: &str, provider_id: Option<&str>) -> Machine {
        let mut m: Machine = serde_json::from_value(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine",
            "metadata": { "name": "m-0", "namespace": "ns", "uid": "machine-uid" },
            "spec": { "clusterName": "c", "providerID": provider_id,
                      "infrastructureRef": { "apiGroup": "x.example.com", "kind": "Other", "name": "m-0" } },
            "status": { "nodeRef": { "name": "node-0" }, "conditions": [
                { "type": HEALTH_CHECK_SUCCEEDED, "status": health, "reason": "UnhealthyNode" },
            ] },
        }))
        .unwrap();
        m.metadata.namespace = Some("ns".into());
        m
    }

    fn remediation(owner_uid: &str) -> MailgunRemediation {
        serde_json::from_value(json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunRemediation",
            "metadata": { "name": "m-0", "namespace": "ns", "ownerReferences": [
                { "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Machine", "name": "m-0", "uid": owner_uid },
            ] },
            "spec": { "request": "r" },
        }))
        .unwrap()
    }

    fn cluster(paused: bool) -> capm_api::capi::Cluster {
        serde_json::from_value(json!({
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": "Cluster",
            "metadata": { "name": "c", "namespace": "ns" }, "spec": { "paused": paused },
        }))
        .unwrap()
    }

    #[test]
    fn only_the_machine_of_the_owner_reference_s_uid_is_believed() {
        let capi = |m: Machine, paused| {
            crate::kinds::tests::stores(store(vec![cluster(paused)]), store(vec![m]))
        };
        let unhealthy = capi(machine("False", Some("metal://1")), false);
        fn view(obj: &MailgunRemediation, capi: &Stores) -> MachineView {
            believe(obj, capi).view
        }
        assert_eq!(
            view(&remediation("machine-uid"), &unhealthy),
            MachineView::Believed {
                unhealthy: true,
                fulfilled: true
            }
        );
        let believed = believe(&remediation("machine-uid"), &unhealthy);
        assert_eq!(believed.provider_id.as_deref(), Some("metal://1"));
        assert_eq!(believed.machine.unwrap().node_name(), Some("node-0"));
        assert!(matches!(
            view(&remediation("another-uid"), &unhealthy),
            MachineView::NotBelieved(why) if why.contains("UID")
        ));
        let nothing = crate::kinds::tests::stores(store(vec![]), store(vec![]));
        assert!(matches!(
            view(&remediation("machine-uid"), &nothing),
            MachineView::NotBelieved(_)
        ));
        assert_eq!(
            view(
                &remediation("machine-uid"),
                &capi(machine("True", None), false)
            ),
            MachineView::Believed {
                unhealthy: false,
                fulfilled: false
            }
        );
        assert_eq!(
            view(
                &remediation("machine-uid"),
                &capi(machine("False", None), true)
            ),
            MachineView::Paused
        );
    }
}
