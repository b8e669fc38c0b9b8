//! What a link names: a `MailgunCluster`, a `MailgunMachine` or a `MailgunRemediation`, what it
//! asks and what was recorded (the endpoint, the machine's provider ID, the human's answer to a
//! repair request), and the form's values turned into a patch the API's own rules accept.

use std::collections::HashMap;

use capm_api::{
    capi::{self, Machine},
    link_token::{Claims, Kind},
    owner_remediated::HEALTH_CHECK_SUCCEEDED,
    v1beta1::{
        AnswerResult, ApiEndpoint, MachineAddress, MailgunCluster, MailgunMachine,
        MailgunRemediation, RemediationAnswer, RemediationPhase,
    },
    validation::Validate,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::{
    Api, Client, Resource, ResourceExt,
    api::{Patch, PatchParams},
};

use super::{ADDRESS_ROWS, FIELD_MANAGER, html};

/// What the form sent (or shows), and what is wrong with it: (field name or `None`, problem).
#[derive(Debug, Clone, Default)]
pub(super) struct Form {
    pub(super) host: String,
    pub(super) port: String,
    pub(super) provider_id: String,
    /// (type, address) per row, empty addresses included.
    pub(super) addresses: Vec<(String, String)>,
    /// A repair request's answer: `Repaired` or `CannotRepair`.
    pub(super) result: String,
    /// The answer's message, its line breaks as `\n`.
    pub(super) message: String,
    pub(super) problems: Vec<(Option<String>, String)>,
}

impl Form {
    pub(super) fn from_fields(fields: &HashMap<String, String>) -> Self {
        let get = |k: &str| {
            fields
                .get(k)
                .map(|v| v.trim().to_owned())
                .unwrap_or_default()
        };
        Self {
            host: get("host"),
            port: get("port"),
            provider_id: get("provider-id"),
            addresses: (0..ADDRESS_ROWS)
                .map(|i| {
                    (
                        get(&format!("address-type-{i}")),
                        get(&format!("address-{i}")),
                    )
                })
                .collect(),
            result: get("result"),
            // A browser sends a text area's line breaks as CRLF.
            message: get("message").replace("\r\n", "\n"),
            problems: Vec::new(),
        }
    }

    pub(super) fn with(&self, problems: Vec<(Option<String>, String)>) -> Self {
        Self {
            problems,
            ..self.clone()
        }
    }
}

/// The object a token names.
pub(super) enum Target {
    Cluster(MailgunCluster),
    Machine(MailgunMachine),
    Remediation(MailgunRemediation),
}

/// How the page shows an answer's result.
fn result_label(result: AnswerResult) -> &'static str {
    match result {
        AnswerResult::Repaired => "Repaired",
        AnswerResult::CannotRepair => "Cannot repair",
    }
}

impl Target {
    pub(super) async fn get(client: &Client, claims: &Claims) -> Result<Option<Self>, kube::Error> {
        let (ns, name) = (claims.namespace.as_str(), claims.name.as_str());
        Ok(match claims.kind {
            Kind::MailgunCluster => Api::<MailgunCluster>::namespaced(client.clone(), ns)
                .get_opt(name)
                .await?
                .map(Self::Cluster),
            Kind::MailgunMachine => Api::<MailgunMachine>::namespaced(client.clone(), ns)
                .get_opt(name)
                .await?
                .map(Self::Machine),
            Kind::MailgunRemediation => Api::<MailgunRemediation>::namespaced(client.clone(), ns)
                .get_opt(name)
                .await?
                .map(Self::Remediation),
        })
    }

    pub(super) fn kind(&self) -> Kind {
        match self {
            Self::Cluster(_) => Kind::MailgunCluster,
            Self::Machine(_) => Kind::MailgunMachine,
            Self::Remediation(_) => Kind::MailgunRemediation,
        }
    }

    pub(super) fn meta(&self) -> &kube::api::ObjectMeta {
        match self {
            Self::Cluster(c) => c.meta(),
            Self::Machine(m) => m.meta(),
            Self::Remediation(r) => r.meta(),
        }
    }

    pub(super) fn object_ref(&self) -> k8s_openapi::api::core::v1::ObjectReference {
        match self {
            Self::Cluster(c) => c.object_ref(&()),
            Self::Machine(m) => m.object_ref(&()),
            Self::Remediation(r) => r.object_ref(&()),
        }
    }

    /// True for a repair request (the page records an answer, not what was built).
    pub(super) fn is_repair(&self) -> bool {
        matches!(self, Self::Remediation(_))
    }

    /// Why the link can no longer be used although nothing was recorded through it: a repair
    /// request whose Machine was handed back to its owner or is healthy again.
    pub(super) fn closed(&self) -> Option<&'static str> {
        let Self::Remediation(r) = self else {
            return None;
        };
        if r.spec.answer.is_some() {
            return None;
        }
        match r.status.as_ref().and_then(|s| s.phase) {
            Some(RemediationPhase::HandedBack) => Some(
                "This repair request is closed: the machine was handed back to its owner, which replaces it.",
            ),
            Some(RemediationPhase::NoLongerNeeded) => {
                Some("This repair request is closed: the machine is healthy again.")
            }
            _ => None,
        }
    }

    /// What was recorded, once it was: (label, value) rows.
    pub(super) fn fulfilment(&self) -> Option<Vec<(String, String)>> {
        match self {
            Self::Cluster(c) => c.spec.control_plane_endpoint.as_ref().map(|e| {
                vec![(
                    "Control plane endpoint".into(),
                    format!("{}:{}", e.host, e.port),
                )]
            }),
            Self::Machine(m) => m.spec.provider_id.as_ref().map(|id| {
                let mut rows = vec![("Provider ID".to_owned(), id.clone())];
                for a in m.spec.addresses.iter().flatten() {
                    let t = serde_json::to_value(a.type_)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default();
                    rows.push((format!("Address ({t})"), a.address.clone()));
                }
                rows
            }),
            Self::Remediation(r) => r.spec.answer.as_ref().map(|a| {
                let mut rows = vec![("Answer".to_owned(), result_label(a.result).to_owned())];
                if let Some(message) = &a.message {
                    rows.push(("Message".to_owned(), message.clone()));
                }
                rows
            }),
        }
    }

    /// What was asked, as the mail said it.
    pub(super) async fn summary(&self, client: &Client) -> html::Summary {
        let meta = self.meta();
        let when = |sent: Option<&k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>| {
            sent.or(meta.creation_timestamp.as_ref())
                .map(|t| t.0.to_string())
                .unwrap_or_default()
        };
        let base = |priority: String, request: &str, requester: &str, when: String| html::Summary {
            kind: self.kind().as_str().to_owned(),
            name: meta.name.clone().unwrap_or_default(),
            namespace: meta.namespace.clone().unwrap_or_default(),
            priority,
            request: request.to_owned(),
            requester: requester.to_owned(),
            when,
            extra: Vec::new(),
        };
        match self {
            Self::Cluster(c) => {
                let sent = c
                    .status
                    .as_ref()
                    .and_then(|s| s.mail.as_ref())
                    .and_then(|m| m.sent_at.as_ref());
                base(
                    c.spec.priority.to_string(),
                    &c.spec.request,
                    &c.spec.requester,
                    when(sent),
                )
            }
            Self::Machine(m) => {
                let sent = m
                    .status
                    .as_ref()
                    .and_then(|s| s.mail.as_ref())
                    .and_then(|s| s.sent_at.as_ref());
                let mut s = base(
                    m.spec.priority.to_string(),
                    &m.spec.request,
                    &m.spec.requester,
                    when(sent),
                );
                let namespace = s.namespace.clone();
                let (owner, machine) =
                    owner_machine(client, &namespace, m.owner_references()).await;
                let unknown = || "unknown".to_owned();
                s.extra
                    .push(("Machine", owner.map_or_else(unknown, str::to_owned)));
                s.extra.push((
                    "Cluster",
                    machine
                        .as_ref()
                        .and_then(Machine::cluster_name)
                        .unwrap_or_else(unknown),
                ));
                s.extra.push((
                    "Failure domain",
                    m.spec
                        .failure_domain
                        .clone()
                        .or_else(|| machine.as_ref().and_then(|x| x.spec.failure_domain.clone()))
                        .unwrap_or_else(|| "any".to_owned()),
                ));
                // Named, never read: the page shows no secret.
                s.extra.push((
                    "Bootstrap data",
                    machine
                        .as_ref()
                        .and_then(Machine::bootstrap_secret)
                        .map(|secret| format!("Secret {namespace}/{secret} (key \"value\"); feed it to the machine at first boot"))
                        .unwrap_or_else(unknown),
                ));
                s
            }
            Self::Remediation(r) => {
                let status = r.status.as_ref();
                let sent = status
                    .and_then(|s| s.asked_at.as_ref())
                    .or_else(|| status.and_then(|s| s.mail.as_ref()?.sent_at.as_ref()));
                // Asked by the MachineHealthCheck that found the Machine unhealthy: no person.
                let mut s = base(r.spec.priority.to_string(), &r.spec.request, "", when(sent));
                s.extra = repair_rows(client, r).await;
                s
            }
        }
    }

    /// The merge patch of the form's values (with the object's resourceVersion as a
    /// precondition), or the problems: the form's own, then the API's rules
    /// (`Validate::validate_update`).
    pub(super) fn apply(
        &self,
        form: &Form,
    ) -> Result<serde_json::Value, Vec<(Option<String>, String)>> {
        let mut problems = Vec::new();
        let spec = match self {
            Self::Cluster(old) => {
                if form.host.is_empty() {
                    problems.push((Some("host".into()), "Enter the host.".into()));
                }
                let port = form
                    .port
                    .parse::<i32>()
                    .ok()
                    .filter(|p| (1..=65535).contains(p));
                if port.is_none() {
                    problems.push((Some("port".into()), "Enter a port from 1 to 65535.".into()));
                }
                let endpoint = ApiEndpoint {
                    host: form.host.clone(),
                    port: port.unwrap_or(0),
                };
                check_rules(
                    old,
                    |new| new.spec.control_plane_endpoint = Some(endpoint.clone()),
                    &mut problems,
                    field_or("port", "host"),
                );
                serde_json::json!({ "controlPlaneEndpoint": endpoint })
            }
            Self::Machine(old) => {
                if form.provider_id.is_empty() {
                    problems.push((Some("provider-id".into()), "Enter the provider ID.".into()));
                }
                let mut addresses = Vec::new();
                for (i, (type_, address)) in form.addresses.iter().enumerate() {
                    if address.is_empty() {
                        continue;
                    }
                    match serde_json::from_value(serde_json::Value::String(type_.clone())) {
                        Ok(t) => addresses.push((
                            i,
                            MachineAddress {
                                type_: t,
                                address: address.clone(),
                            },
                        )),
                        Err(_) => problems.push((
                            Some(format!("address-{i}")),
                            "Choose the address's type.".into(),
                        )),
                    }
                }
                let list: Vec<MachineAddress> = addresses.iter().map(|(_, a)| a.clone()).collect();
                check_rules(
                    old,
                    |new| {
                        new.spec.provider_id = Some(form.provider_id.clone());
                        if !list.is_empty() {
                            new.spec.addresses = Some(list.clone());
                        }
                    },
                    &mut problems,
                    |path| {
                        // spec.addresses[2].address → the form row of the third non-empty address.
                        path.strip_prefix("spec.addresses[")
                            .and_then(|rest| rest.split(']').next())
                            .and_then(|n| n.parse::<usize>().ok())
                            .and_then(|n| addresses.get(n))
                            .map_or("provider-id", |(row, _)| {
                                ["address-0", "address-1", "address-2", "address-3"]
                                    .get(*row)
                                    .copied()
                                    .unwrap_or("provider-id")
                            })
                    },
                );
                let mut spec = serde_json::json!({ "providerID": form.provider_id });
                if !list.is_empty() {
                    spec["addresses"] = serde_json::json!(list);
                }
                spec
            }
            Self::Remediation(old) => {
                let result = match form.result.as_str() {
                    "Repaired" => Some(AnswerResult::Repaired),
                    "CannotRepair" => Some(AnswerResult::CannotRepair),
                    _ => {
                        problems.push((
                            Some("result".into()),
                            "Choose repaired or cannot repair.".into(),
                        ));
                        None
                    }
                };
                let answer = RemediationAnswer {
                    result: result.unwrap_or(AnswerResult::CannotRepair),
                    message: (!form.message.is_empty()).then(|| form.message.clone()),
                };
                check_rules(
                    old,
                    |new| new.spec.answer = Some(answer.clone()),
                    &mut problems,
                    field_or("message", "result"),
                );
                serde_json::json!({ "answer": answer })
            }
        };
        if problems.is_empty() {
            Ok(serde_json::json!({
                "metadata": { "resourceVersion": self.meta().resource_version },
                "spec": spec,
            }))
        } else {
            Err(problems)
        }
    }

    /// Patches the object as the provider; `Ok` carries the object written.
    pub(super) async fn patch(
        &self,
        client: &Client,
        claims: &Claims,
        patch: serde_json::Value,
    ) -> Result<Self, kube::Error> {
        let (ns, name) = (claims.namespace.as_str(), claims.name.as_str());
        let params = PatchParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PatchParams::default()
        };
        Ok(match self {
            Self::Cluster(_) => Self::Cluster(
                Api::<MailgunCluster>::namespaced(client.clone(), ns)
                    .patch(name, &params, &Patch::Merge(&patch))
                    .await?,
            ),
            Self::Machine(_) => Self::Machine(
                Api::<MailgunMachine>::namespaced(client.clone(), ns)
                    .patch(name, &params, &Patch::Merge(&patch))
                    .await?,
            ),
            Self::Remediation(_) => Self::Remediation(
                Api::<MailgunRemediation>::namespaced(client.clone(), ns)
                    .patch(name, &params, &Patch::Merge(&patch))
                    .await?,
            ),
        })
    }
}

/// The Machine that owns an object (its ownerReference's name, and the Machine if it is still
/// the one named, checked by its UID).
async fn owner_machine<'a>(
    client: &Client,
    namespace: &str,
    owners: &'a [OwnerReference],
) -> (Option<&'a str>, Option<Machine>) {
    let Some(owner) = capi::owner(owners, "Machine") else {
        return (None, None);
    };
    let machine = Api::<Machine>::namespaced(client.clone(), namespace)
        .get_opt(&owner.name)
        .await
        .ok()
        .flatten()
        .filter(|m| m.metadata.uid.as_deref() == Some(owner.uid.as_str()));
    (Some(owner.name.as_str()), machine)
}

/// What happened to the Machine of a repair request, read from the Machine itself (the owner
/// the MachineHealthCheck set): its Cluster, Node and provider ID, why its health check failed,
/// and where the repair stands.
async fn repair_rows(client: &Client, r: &MailgunRemediation) -> Vec<(&'static str, String)> {
    let namespace = r.namespace().unwrap_or_default();
    let (owner, machine) = owner_machine(client, &namespace, r.owner_references()).await;
    let machine = machine.as_ref();
    let unknown = || "unknown".to_owned();
    let known = |value: Option<&str>| value.map_or_else(unknown, str::to_owned);
    let health = machine
        .and_then(|m| m.condition(HEALTH_CHECK_SUCCEEDED))
        .filter(|c| c.status == "False")
        .map(|c| {
            let reason = c.reason.clone().unwrap_or_default();
            match c.message.as_deref().unwrap_or_default() {
                "" => reason,
                message => format!("{reason}: {message}"),
            }
        });
    let phase = r
        .status
        .as_ref()
        .and_then(|s| s.phase)
        .and_then(|p| serde_json::to_value(p).ok())
        .and_then(|v| v.as_str().map(str::to_owned));
    vec![
        ("Machine", known(owner)),
        (
            "Cluster",
            machine
                .and_then(Machine::cluster_name)
                .or_else(|| r.labels().get(capm_api::names::CLUSTER_NAME_LABEL).cloned())
                .unwrap_or_else(unknown),
        ),
        ("Node", known(machine.and_then(Machine::node_name))),
        (
            "Provider ID",
            known(machine.and_then(|m| m.spec.provider_id.as_deref())),
        ),
        (
            "Health check",
            health.unwrap_or_else(|| "no failed health check on the Machine now".to_owned()),
        ),
        ("Phase", phase.unwrap_or_else(|| "Pending".to_owned())),
    ]
}

/// The form field of a refusal: `field` for a path ending in its name, else `otherwise`.
fn field_or(field: &'static str, otherwise: &'static str) -> impl Fn(&str) -> &'static str {
    move |path| {
        if path.ends_with(field) {
            field
        } else {
            otherwise
        }
    }
}

/// Adds to `problems`, when the form itself had none, the API's rules' refusals of `old`
/// changed by `change` (`Validate::validate_update`), each on the form field `field_of(path)`
/// names.
fn check_rules<K: Validate + Clone>(
    old: &K,
    change: impl FnOnce(&mut K),
    problems: &mut Vec<(Option<String>, String)>,
    field_of: impl Fn(&str) -> &'static str,
) {
    if !problems.is_empty() {
        return;
    }
    let mut new = old.clone();
    change(&mut new);
    problems.extend(
        K::validate_update(old, &new)
            .into_iter()
            .map(|e| (Some(field_of(e.path()).to_owned()), e.to_string())),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cluster() -> Target {
        Target::Cluster(MailgunCluster::new(
            "c",
            serde_json::from_value(serde_json::json!({
                "priority": "Urgent", "request": "r", "requester": "a@example.com",
            }))
            .unwrap(),
        ))
    }

    fn machine() -> Target {
        Target::Machine(MailgunMachine::new(
            "m",
            serde_json::from_value(serde_json::json!({
                "priority": "Urgent", "request": "r", "requester": "a@example.com",
            }))
            .unwrap(),
        ))
    }

    fn remediation(phase: Option<&str>, answer: Option<serde_json::Value>) -> Target {
        let mut object = serde_json::json!({
            "apiVersion": "infrastructure.cluster.x-k8s.io/v1beta1", "kind": "MailgunRemediation",
            "metadata": { "name": "m-0", "namespace": "ns", "resourceVersion": "7" },
            "spec": { "request": "Fix it." },
        });
        if let Some(phase) = phase {
            object["status"] = serde_json::json!({ "phase": phase });
        }
        if let Some(answer) = answer {
            object["spec"]["answer"] = answer;
        }
        Target::Remediation(serde_json::from_value(object).unwrap())
    }

    #[test]
    fn a_repair_answer_is_one_of_two_with_a_bounded_clean_message() {
        let ok = remediation(None, None)
            .apply(&fields(&[
                ("result", "CannotRepair"),
                ("message", " Burnt.\r\nGone. "),
            ]))
            .unwrap();
        assert_eq!(
            ok,
            serde_json::json!({
                "metadata": { "resourceVersion": "7" },
                "spec": { "answer": { "result": "CannotRepair", "message": "Burnt.\nGone." } },
            })
        );
        let ok = remediation(None, None)
            .apply(&fields(&[("result", "Repaired"), ("message", "")]))
            .unwrap();
        assert_eq!(
            ok["spec"],
            serde_json::json!({"answer": {"result": "Repaired"}})
        );
        assert_eq!(
            problems(&remediation(None, None), &[("message", "m")]),
            [Some("result".into())]
        );
        assert_eq!(
            problems(
                &remediation(None, None),
                &[("result", "Repaired"), ("message", "a\u{202e}b")]
            ),
            [Some("message".into())]
        );
        // Answered already: the rule's own refusal (the page shows "already answered" first).
        let answered = remediation(None, Some(serde_json::json!({"result": "Repaired"})));
        assert_eq!(
            problems(&answered, &[("result", "CannotRepair")]),
            [Some("result".into())]
        );
        assert!(answered.fulfilment().is_some());
    }

    #[test]
    fn a_closed_repair_request_takes_no_answer() {
        assert!(remediation(Some("HandedBack"), None).closed().is_some());
        assert!(remediation(Some("NoLongerNeeded"), None).closed().is_some());
        assert!(
            remediation(Some("WaitingForAnswer"), None)
                .closed()
                .is_none()
        );
        assert!(remediation(None, None).closed().is_none());
        // Answered and handed back (CannotRepair): "already answered", not closed.
        let answered = serde_json::json!({"result": "CannotRepair"});
        assert!(
            remediation(Some("HandedBack"), Some(answered))
                .closed()
                .is_none()
        );
        assert!(cluster().closed().is_none() && machine().closed().is_none());
    }

    fn fields(pairs: &[(&str, &str)]) -> Form {
        Form::from_fields(
            &pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        )
    }

    fn problems(target: &Target, pairs: &[(&str, &str)]) -> Vec<Option<String>> {
        target
            .apply(&fields(pairs))
            .err()
            .unwrap_or_default()
            .into_iter()
            .map(|(f, _)| f)
            .collect()
    }

    #[test]
    fn the_form_is_judged_by_the_api_rules_on_its_own_fields() {
        let ok = cluster()
            .apply(&fields(&[("host", " api.example.com "), ("port", "6443")]))
            .unwrap();
        assert_eq!(
            ok["spec"],
            serde_json::json!({"controlPlaneEndpoint": {"host": "api.example.com", "port": 6443}})
        );
        assert_eq!(
            problems(&cluster(), &[("port", "6443")]),
            [Some("host".into())]
        );
        assert_eq!(
            problems(&cluster(), &[("host", "h"), ("port", "70000")]),
            [Some("port".into())]
        );
        // The API's own pattern, not the form's.
        let bad = cluster()
            .apply(&fields(&[("host", "bad host!"), ("port", "1")]))
            .unwrap_err();
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].0.as_deref(), Some("host"));
        assert!(
            bad[0].1.contains("spec.controlPlaneEndpoint.host"),
            "{bad:?}"
        );

        let ok = machine()
            .apply(&fields(&[
                ("provider-id", "dc://rack/1"),
                ("address-type-1", "ExternalIP"),
                ("address-1", "192.0.2.1"),
            ]))
            .unwrap();
        assert_eq!(
            ok["spec"],
            serde_json::json!({"providerID": "dc://rack/1", "addresses": [{"type": "ExternalIP", "address": "192.0.2.1"}]})
        );
        assert_eq!(
            problems(
                &machine(),
                &[("address-0", "10.0.0.1"), ("address-type-0", "InternalIP")]
            ),
            [Some("provider-id".into())]
        );
        assert_eq!(
            problems(&machine(), &[("provider-id", "no-scheme")]),
            [Some("provider-id".into())]
        );
        // The API's refusal of the second non-empty address lands on its row.
        assert_eq!(
            problems(
                &machine(),
                &[
                    ("provider-id", "dc://1"),
                    ("address-type-0", "InternalIP"),
                    ("address-0", "10.0.0.1"),
                    ("address-type-2", "Hostname"),
                    ("address-2", "two words"),
                ]
            ),
            [Some("address-2".into())]
        );
        assert_eq!(
            problems(
                &machine(),
                &[
                    ("provider-id", "dc://1"),
                    ("address-type-3", "Bogus"),
                    ("address-3", "x")
                ]
            ),
            [Some("address-3".into())]
        );
    }
}
