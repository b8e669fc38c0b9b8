//! What a link names: a `MailgunCluster` or a `MailgunMachine`, what it asks and what was
//! recorded, and the form's values turned into a patch the API's own rules accept.

use std::collections::HashMap;

use capm_api::{
    capi::{self, Machine},
    link_token::{Claims, Kind},
    v1beta1::{ApiEndpoint, MachineAddress, MailgunCluster, MailgunMachine},
    validation::Validate,
};
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
        })
    }

    pub(super) fn kind(&self) -> Kind {
        match self {
            Self::Cluster(_) => Kind::MailgunCluster,
            Self::Machine(_) => Kind::MailgunMachine,
        }
    }

    pub(super) fn meta(&self) -> &kube::api::ObjectMeta {
        match self {
            Self::Cluster(c) => c.meta(),
            Self::Machine(m) => m.meta(),
        }
    }

    pub(super) fn object_ref(&self) -> k8s_openapi::api::core::v1::ObjectReference {
        match self {
            Self::Cluster(c) => c.object_ref(&()),
            Self::Machine(m) => m.object_ref(&()),
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
                let owner = capi::owner(m.owner_references(), "Machine").map(|o| o.name.clone());
                let machine = match &owner {
                    Some(name) => Api::<Machine>::namespaced(client.clone(), &namespace)
                        .get_opt(name)
                        .await
                        .ok()
                        .flatten(),
                    None => None,
                };
                let unknown = || "unknown".to_owned();
                s.extra
                    .push(("Machine", owner.clone().unwrap_or_else(unknown)));
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
        let rv = self.meta().resource_version.clone();
        let patch = match self {
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
                let mut new = old.clone();
                new.spec.control_plane_endpoint = Some(endpoint.clone());
                if problems.is_empty() {
                    problems.extend(rule_problems(
                        MailgunCluster::validate_update(old, &new),
                        |path| {
                            if path.ends_with("port") {
                                "port"
                            } else {
                                "host"
                            }
                        },
                    ));
                }
                serde_json::json!({
                    "metadata": { "resourceVersion": rv },
                    "spec": { "controlPlaneEndpoint": endpoint },
                })
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
                let mut new = old.clone();
                new.spec.provider_id = Some(form.provider_id.clone());
                let list: Vec<MachineAddress> = addresses.iter().map(|(_, a)| a.clone()).collect();
                new.spec.addresses = (!list.is_empty())
                    .then(|| list.clone())
                    .or(old.spec.addresses.clone());
                if problems.is_empty() {
                    problems.extend(rule_problems(
                        MailgunMachine::validate_update(old, &new),
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
                    ));
                }
                let mut spec = serde_json::json!({ "providerID": form.provider_id });
                if !list.is_empty() {
                    spec["addresses"] = serde_json::json!(list);
                }
                serde_json::json!({
                    "metadata": { "resourceVersion": rv },
                    "spec": spec,
                })
            }
        };
        if problems.is_empty() {
            Ok(patch)
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
        })
    }
}

/// The API rules' refusals, each on the form field `field_of(path)` names.
fn rule_problems(
    errors: Vec<capm_api::validation::FieldError>,
    field_of: impl Fn(&str) -> &'static str,
) -> Vec<(Option<String>, String)> {
    errors
        .into_iter()
        .map(|e| (Some(field_of(e.path()).to_owned()), e.to_string()))
        .collect()
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
