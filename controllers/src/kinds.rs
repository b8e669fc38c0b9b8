//! What differs between `MailgunCluster` and `MailgunMachine`; everything else is generic.

use std::{fmt::Debug, sync::Arc};

use capm_api::{
    capi::{Cluster, ContractRef, Machine},
    names,
    v1beta1::{MachineAddress, MailgunCluster, MailgunClusterIdentity, MailgunMachine, Priority},
    validation::Validate,
};
use kube::{
    ResourceExt,
    runtime::reflector::{ObjectRef, Store},
};

pub use self::mailed::Mailed;
use crate::{
    status::Status,
    watch::{NotListed, listed},
};

mod mailed;

/// The reflector stores the reconciles read: Cluster API's objects, the mail identities and their
/// claimed Secrets (never written), our `MailgunCluster`s (a machine's identity is its
/// cluster's) and `MailgunMachine`s.
#[derive(Clone)]
pub struct Stores {
    pub clusters: Store<Cluster>,
    pub machines: Store<Machine>,
    pub mailgun_clusters: Store<MailgunCluster>,
    /// The `MailgunMachine` controller's own store (a remediation reads whether its machine was
    /// built).
    pub mailgun_machines: Store<MailgunMachine>,
    pub identities: Store<MailgunClusterIdentity>,
    pub secrets: Store<k8s_openapi::api::core::v1::Secret>,
    /// The MachineHealthChecks (a timed hand-back reads their brake); never listed where the
    /// kind is not installed.
    pub health_checks: Store<capm_api::capi::MachineHealthCheck>,
}

/// Why a request cannot be mailed yet: the condition's reason and message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Wait {
    pub reason: &'static str,
    pub message: String,
}

/// The subject and plain-text body of one mail.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MailText {
    pub subject: String,
    pub body: String,
}

/// The mail identity an object wants now, by name (`None`: the provider's own configuration);
/// a machine's is read from a cache that may not have been listed yet.
pub type Wanted = Result<Option<String>, NotListed>;

/// An object's key in logs, as Cluster API's: `namespace/name`.
pub fn key(namespace: Option<&str>, name: &str) -> String {
    format!("{}/{name}", namespace.unwrap_or_default())
}

/// An infrastructure kind this provider reconciles: a [`Mailed`] kind with a request a human
/// fulfils.
pub trait InfraKind: Mailed + Validate {
    /// The object's status, as the shared [`Status`].
    fn shared_status(&self) -> Status;
    /// What the human provided, once they did.
    fn fulfilment(&self) -> Option<String>;
    /// Addresses to publish in status (machines).
    fn addresses(&self) -> Option<Vec<MachineAddress>> {
        None
    }
    /// True when the owner's `spec.infrastructureRef` names this object (what Cluster API
    /// guarantees for the objects it owns).
    fn owner_refers_to(owner: &Self::Owner, obj: &Self) -> bool;
    /// The owner object from the caches.
    fn owner_in_cache(capi: &Stores, namespace: &str, name: &str) -> Option<Arc<Self::Owner>>;
    /// The `Cluster` that pauses this object.
    fn cluster_in_cache(capi: &Stores, obj: &Self, owner: &Self::Owner) -> Option<Arc<Cluster>>;
    /// What must hold before the request is mailed; `Ok` carries the request mail.
    fn request_mail(&self, capi: &Stores, owner: &Self::Owner) -> Result<MailText, Wait>;
}

/// The identity of the `MailgunCluster` of the Cluster `cluster` in `namespace` (a machine's, a
/// remediation's). A Cluster not in the cache (gone, for a release whose request's identity is
/// gone too) or of another infrastructure, or a `MailgunCluster` that does not exist (any
/// more): the provider's own (if it serves the namespace), never another tenant's.
pub fn cluster_identity(capi: &Stores, namespace: &str, cluster: Option<&String>) -> Wanted {
    let cluster = cluster.and_then(|c| MailgunCluster::owner_in_cache(capi, namespace, c));
    match cluster
        .as_ref()
        .and_then(|c| c.spec.infrastructure_ref.as_ref())
    {
        Some(r) if r.api_group == capm_api::GROUP && r.kind == MailgunCluster::KIND => {
            let infra = ObjectRef::new(&r.name).within(namespace);
            let infra = listed(&capi.mailgun_clusters, "MailgunCluster")?.get(&infra);
            Ok(infra.and_then(|i| i.spec.identity_ref.clone().map(|r| r.name)))
        }
        _ => Ok(None),
    }
}

fn refers_to(reference: Option<&ContractRef>, kind: &str, obj: &impl ResourceExt) -> bool {
    reference.is_some_and(|r| {
        r.api_group == capm_api::GROUP && r.kind == kind && r.name == obj.name_any()
    })
}

fn fulfil_command(kind: &str, obj: &impl ResourceExt, patch: &str) -> String {
    format!(
        "kubectl patch {} {} -n {} --type merge -p '{patch}'",
        kind.to_ascii_lowercase(),
        obj.name_any(),
        obj.namespace().unwrap_or_default()
    )
}

impl Mailed for MailgunCluster {
    const KIND: &'static str = "MailgunCluster";
    const CONTROLLER: &'static str = "mailguncluster";
    const FINALIZER: &'static str = names::CLUSTER_FINALIZER;
    const OWNER_KIND: &'static str = "Cluster";
    const CACHED_LABELS: &'static [&'static str] = &[];
    type Owner = Cluster;

    fn log_span(key: &str) -> tracing::Span {
        tracing::error_span!(
            "reconcile",
            controller = Self::CONTROLLER,
            MailgunCluster = key,
            Cluster = tracing::field::Empty,
        )
    }

    fn priority(&self) -> Priority {
        self.spec.priority
    }
    fn wanted_identity(&self, _: &Stores) -> Wanted {
        Ok(self.spec.identity_ref.as_ref().map(|r| r.name.clone()))
    }
    fn deletion_mail(&self) -> MailText {
        let name = self.name_any();
        MailText {
            subject: format!("[{}] Cluster {name} no longer needed", self.spec.priority),
            body: format!(
                "Hello again! Cluster {name} (namespace {}) is no longer needed; its \
                 infrastructure can be released.\n",
                self.namespace().unwrap_or_default()
            ),
        }
    }
    fn reply_to(&self) -> Option<&str> {
        Some(&self.spec.requester)
    }
}

impl InfraKind for MailgunCluster {
    fn shared_status(&self) -> Status {
        self.status
            .as_ref()
            .map(|s| Status {
                initialization: s.initialization.clone(),
                conditions: s.conditions.clone(),
                observed_generation: s.observed_generation,
                addresses: None,
                mail: s.mail.clone(),
            })
            .unwrap_or_default()
    }
    fn fulfilment(&self) -> Option<String> {
        self.spec
            .control_plane_endpoint
            .as_ref()
            .map(|e| format!("control plane endpoint {}:{}", e.host, e.port))
    }
    fn owner_refers_to(owner: &Cluster, obj: &Self) -> bool {
        refers_to(owner.spec.infrastructure_ref.as_ref(), Self::KIND, obj)
    }
    fn owner_in_cache(capi: &Stores, namespace: &str, name: &str) -> Option<Arc<Cluster>> {
        capi.clusters.get(&ObjectRef::new(name).within(namespace))
    }
    fn cluster_in_cache(capi: &Stores, obj: &Self, owner: &Cluster) -> Option<Arc<Cluster>> {
        Self::owner_in_cache(
            capi,
            &obj.namespace().unwrap_or_default(),
            &owner.name_any(),
        )
    }
    fn request_mail(&self, _: &Stores, _: &Cluster) -> Result<MailText, Wait> {
        let name = self.name_any();
        Ok(MailText {
            subject: format!("[{}] New Cluster {name} requested", self.spec.priority),
            body: format!(
                "Hello! One cluster please.\n\n{}\n\n\
                 When the cluster's control plane is reachable, record its endpoint:\n\n  {}\n\n\
                 (namespace {}, requested by {})\n",
                self.spec.request,
                fulfil_command(
                    "mailguncluster",
                    self,
                    r#"{"spec":{"controlPlaneEndpoint":{"host":"<host>","port":6443}}}"#
                ),
                self.namespace().unwrap_or_default(),
                self.spec.requester,
            ),
        })
    }
}

impl Mailed for MailgunMachine {
    const KIND: &'static str = "MailgunMachine";
    const CONTROLLER: &'static str = "mailgunmachine";
    const FINALIZER: &'static str = names::MACHINE_FINALIZER;
    const OWNER_KIND: &'static str = "Machine";
    /// The `Cluster` → `MailgunMachine` mapping selects by this label.
    const CACHED_LABELS: &'static [&'static str] = &[names::CLUSTER_NAME_LABEL];
    type Owner = Machine;

    fn log_span(key: &str) -> tracing::Span {
        tracing::error_span!(
            "reconcile",
            controller = Self::CONTROLLER,
            MailgunMachine = key,
            Machine = tracing::field::Empty,
            Cluster = tracing::field::Empty,
        )
    }

    fn priority(&self) -> Priority {
        self.spec.priority
    }
    /// The identity of its Cluster's `MailgunCluster` ([`cluster_identity`]).
    fn wanted_identity(&self, capi: &Stores) -> Wanted {
        let cluster = self.labels().get(names::CLUSTER_NAME_LABEL);
        cluster_identity(capi, &self.namespace().unwrap_or_default(), cluster)
    }
    fn deletion_mail(&self) -> MailText {
        let name = self.name_any();
        MailText {
            subject: format!("[{}] Machine {name} no longer needed", self.spec.priority),
            body: format!(
                "Hello again! Machine {name} (namespace {}{}) is no longer needed; it can be \
                 released.\n",
                self.namespace().unwrap_or_default(),
                self.spec
                    .provider_id
                    .as_ref()
                    .map(|p| format!(", provider ID {p}"))
                    .unwrap_or_default()
            ),
        }
    }
    fn reply_to(&self) -> Option<&str> {
        Some(&self.spec.requester)
    }
}

impl InfraKind for MailgunMachine {
    fn shared_status(&self) -> Status {
        self.status
            .as_ref()
            .map(|s| Status {
                initialization: s.initialization.clone(),
                conditions: s.conditions.clone(),
                observed_generation: s.observed_generation,
                addresses: s.addresses.clone(),
                mail: s.mail.clone(),
            })
            .unwrap_or_default()
    }
    fn fulfilment(&self) -> Option<String> {
        self.spec
            .provider_id
            .as_ref()
            .map(|id| format!("provider ID {id}"))
    }
    fn addresses(&self) -> Option<Vec<MachineAddress>> {
        self.spec.addresses.clone()
    }
    fn owner_refers_to(owner: &Machine, obj: &Self) -> bool {
        refers_to(owner.spec.infrastructure_ref.as_ref(), Self::KIND, obj)
    }
    fn owner_in_cache(capi: &Stores, namespace: &str, name: &str) -> Option<Arc<Machine>> {
        capi.machines.get(&ObjectRef::new(name).within(namespace))
    }
    fn cluster_in_cache(capi: &Stores, obj: &Self, owner: &Machine) -> Option<Arc<Cluster>> {
        let cluster = owner.cluster_name()?;
        MailgunCluster::owner_in_cache(capi, &obj.namespace().unwrap_or_default(), &cluster)
    }
    fn request_mail(&self, capi: &Stores, machine: &Machine) -> Result<MailText, Wait> {
        let Some(cluster_name) = machine.cluster_name() else {
            return Err(Wait {
                reason: names::reasons::WAITING_FOR_CLUSTER_INFRASTRUCTURE,
                message: "the owner Machine names no Cluster".into(),
            });
        };
        let provisioned = Self::cluster_in_cache(capi, self, machine)
            .is_some_and(|c| c.infrastructure_provisioned());
        if !provisioned {
            return Err(Wait {
                reason: names::reasons::WAITING_FOR_CLUSTER_INFRASTRUCTURE,
                message: format!(
                    "waiting for Cluster {cluster_name}'s infrastructure to be provisioned"
                ),
            });
        }
        let Some(secret) = machine.bootstrap_secret() else {
            return Err(Wait {
                reason: names::reasons::WAITING_FOR_BOOTSTRAP_DATA,
                message: "waiting for the Machine's spec.bootstrap.dataSecretName".into(),
            });
        };
        let namespace = self.namespace().unwrap_or_default();
        let failure_domain = self
            .spec
            .failure_domain
            .as_deref()
            .or(machine.spec.failure_domain.as_deref())
            .unwrap_or("any");
        let name = self.name_any();
        Ok(MailText {
            subject: format!(
                "[{}] New Machine {name} for Cluster {cluster_name} requested",
                self.spec.priority
            ),
            body: format!(
                "Hello! One machine please.\n\n{}\n\n\
                 Machine: {name} (Machine {}), namespace {namespace}\n\
                 Cluster: {cluster_name}\n\
                 Failure domain: {failure_domain}\n\
                 Bootstrap data: Secret {namespace}/{secret} (key \"value\"); feed it to the \
                 machine at first boot.\n\n\
                 When the machine is up, record it:\n\n  {}\n\n(requested by {})\n",
                self.spec.request,
                machine.name_any(),
                fulfil_command(
                    "mailgunmachine",
                    self,
                    r#"{"spec":{"providerID":"<scheme>://<id>","addresses":[{"type":"InternalIP","address":"<ip>"}]}}"#
                ),
                self.spec.requester,
            ),
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use capm_api::v1beta1::{MailgunClusterStatus, MailgunMachineStatus};
    use kube::Resource;
    use serde::de::DeserializeOwned;

    /// `clusters` and `machines`, beside listed and empty identity and Secret stores.
    pub(crate) fn stores(clusters: Store<Cluster>, machines: Store<Machine>) -> Stores {
        use kube::runtime::{reflector, watcher::Event};
        fn listed<K: Resource<DynamicType = ()> + Clone + 'static>() -> Store<K> {
            let (store, mut writer) = reflector::store();
            writer.apply_watcher_event(&Event::Init);
            writer.apply_watcher_event(&Event::InitDone);
            store
        }
        Stores {
            clusters,
            machines,
            mailgun_clusters: listed(),
            mailgun_machines: listed(),
            identities: listed(),
            secrets: listed(),
            health_checks: listed(),
        }
    }

    /// A status with every field the typed statuses have today set (a field added to them
    /// belongs here too, and then to `Status` and `take_status`).
    fn full<T: DeserializeOwned>(addresses: bool) -> T {
        let mut status = serde_json::json!({
            "initialization": { "provisioned": true },
            "conditions": [{
                "type": "Ready", "status": "False", "reason": "WaitingForFulfillment",
                "message": "mailed", "lastTransitionTime": "2026-11-23T19:36:55Z",
                "observedGeneration": 2,
            }],
            "observedGeneration": 2,
            "mail": { "messageID": "<a@b>", "state": "Sent", "sentAt": "2026-11-23T19:36:55Z" },
        });
        if addresses {
            status["addresses"] =
                serde_json::json!([{ "type": "InternalIP", "address": "10.0.0.1" }]);
        }
        serde_json::from_value(status).expect("a valid status")
    }

    #[test]
    fn shared_status_is_the_typed_status_field_by_field() {
        let mut mgc = MailgunCluster::new(
            "a",
            serde_json::from_value(serde_json::json!({
                "priority": "Urgent", "request": "r", "requester": "a@example.com",
            }))
            .expect("a valid spec"),
        );
        assert_eq!(mgc.shared_status(), Status::default());
        mgc.status = Some(full::<MailgunClusterStatus>(false));
        let typed = Status::from_typed(mgc.status.as_ref());
        let taken = mgc.shared_status();
        assert_eq!(taken, typed);
        assert!(taken.mail.is_some());

        let mut mgm = MailgunMachine::new(
            "m",
            serde_json::from_value(serde_json::json!({
                "priority": "Urgent", "request": "r", "requester": "a@example.com",
            }))
            .expect("a valid spec"),
        );
        mgm.status = Some(full::<MailgunMachineStatus>(true));
        let typed = Status::from_typed(mgm.status.as_ref());
        let taken = mgm.shared_status();
        assert_eq!(taken, typed);
        assert!(taken.addresses.is_some());
    }

    /// What a text-format log line inside `span` reads (tracing-subscriber's default format).
    fn text_line(span: impl FnOnce() -> tracing::Span) -> String {
        #[derive(Clone, Default)]
        struct Buffer(Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buffer {
            fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
                self.0
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .extend_from_slice(bytes);
                Ok(bytes.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .with_ansi(false)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            span().in_scope(|| tracing::info!("Finalizer removed"));
        });
        let bytes = buffer.0.lock().map(|b| b.clone()).unwrap_or_default();
        String::from_utf8(bytes).unwrap_or_default()
    }

    fn owned_by(kind: &str, name: &str) -> serde_json::Value {
        serde_json::json!([{
            "apiVersion": "cluster.x-k8s.io/v1beta2", "kind": kind, "name": name, "uid": "u",
        }])
    }

    #[test]
    fn a_reconcile_span_names_the_object_and_its_owners_the_cluster_api_way() {
        let spec = serde_json::json!({
            "priority": "Urgent", "request": "r", "requester": "a@example.com",
        });
        let mut mgm = MailgunMachine::new("m-0", serde_json::from_value(spec.clone()).unwrap());
        mgm.metadata.namespace = Some("team-a".into());
        mgm.metadata.owner_references = serde_json::from_value(owned_by("Machine", "m-0")).ok();
        mgm.metadata.labels = Some([(names::CLUSTER_NAME_LABEL.into(), "c".into())].into());
        let line = text_line(|| mgm.span());
        for expected in [
            r#"controller="mailgunmachine""#,
            r#"MailgunMachine="team-a/m-0""#,
            r#"Machine="team-a/m-0""#,
            r#"Cluster="team-a/c""#,
            ": Finalizer removed",
        ] {
            assert!(line.contains(expected), "{expected} not in {line}");
        }

        let mut mgc = MailgunCluster::new("c", serde_json::from_value(spec).unwrap());
        mgc.metadata.namespace = Some("team-a".into());
        mgc.metadata.owner_references = serde_json::from_value(owned_by("Cluster", "c")).ok();
        let line = text_line(|| mgc.span());
        assert!(
            line.contains(r#"MailgunCluster="team-a/c" Cluster="team-a/c""#),
            "{line}"
        );
        // Not owned yet: the owner key is left out rather than empty.
        mgc.metadata.owner_references = None;
        let line = text_line(|| mgc.span());
        assert!(
            line.contains(r#"reconcile{controller="mailguncluster" MailgunCluster="team-a/c"}"#),
            "{line}"
        );
    }
}
