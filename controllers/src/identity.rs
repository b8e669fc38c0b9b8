//! Mail identities: which backend, sender and recipients an object's mails go through
//! (docs/multi-tenancy.md). Identities and their Secrets are read with `get` when a mail is about to be sent
//! or looked up, never watched, so a rotated key is used from the next send on; a backend is
//! built once per identity and rebuilt when anything it was built from changes.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
};

use capm_api::{
    names::reasons,
    v1beta1::{
        MailgunCluster, MailgunClusterIdentity, MailgunRegion as ApiRegion, SecretKeyReference,
    },
};
use capm_mailer::{
    CommitGate, InlineSecret, Mailer, MailerConfig, MailgunConfig, MailgunRegion, SecretSource,
    SmtpConfig,
};
use k8s_openapi::api::core::v1::{Namespace, Secret};
use kube::{Api, Client};

pub(crate) use crate::kinds::Wanted;
use crate::poller::Poller;

/// Why an identity gave no route.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// It cannot be used: the condition reason it shows and what is wrong (naming the field or
    /// Secret, never a value).
    #[error("{message}")]
    Unusable {
        /// `IdentityNotFound`, `IdentityNotAllowed` or `IdentityInvalid`.
        reason: &'static str,
        message: String,
    },
    /// The API server could not be asked.
    #[error("{context}: {source}")]
    Kube {
        context: &'static str,
        #[source]
        source: kube::Error,
    },
}

fn kube(context: &'static str) -> impl FnOnce(kube::Error) -> IdentityError {
    move |source| IdentityError::Kube { context, source }
}

/// The most bytes of one Secret value an identity uses (keys and CA bundles are far smaller).
const MAX_SECRET_VALUE_BYTES: usize = 64 * 1024;

/// Where one object's mails go: backend, `From`, recipients.
#[derive(Clone)]
pub(crate) struct Route {
    pub mailer: Arc<dyn Mailer>,
    pub from: String,
    pub recipients: Vec<String>,
    /// The identity's name; `None` for the provider's own configuration.
    pub identity: Option<String>,
    /// The delivery poller asking this backend (each identity has its own budget).
    pub poller: Arc<Poller>,
}

/// The identities' backends, built on demand and kept while what they were built from holds.
pub(crate) struct Identities {
    client: Client,
    secret_namespace: Option<String>,
    gate: Arc<dyn CommitGate>,
    /// The provider's own configuration: objects without an identity.
    default: Route,
    built: Mutex<HashMap<String, Built>>,
}

/// A backend, the configuration it was built from and its delivery poller, by identity name.
type Built = (MailerConfig, Arc<dyn Mailer>, Arc<Poller>);

/// An identity that cannot be used, as a reconcile error with the condition reason it shows.
fn problem(reason: &'static str, message: String) -> IdentityError {
    IdentityError::Unusable { reason, message }
}

impl Identities {
    /// Identities whose Secrets live in `secret_namespace`, their backends asking `gate` at
    /// each send's commit point.
    pub(crate) fn new(
        client: Client,
        secret_namespace: Option<String>,
        gate: Arc<dyn CommitGate>,
        default: Route,
    ) -> Self {
        Self {
            client,
            secret_namespace,
            gate,
            default,
            built: Mutex::new(HashMap::new()),
        }
    }

    /// The name of the identity `wanted` stands for (`None`: the provider's own); an error when
    /// a machine's `MailgunCluster` could not be read.
    pub(crate) async fn wanted(
        &self,
        wanted: &Wanted,
        namespace: &str,
    ) -> Result<Option<String>, IdentityError> {
        match wanted {
            Wanted::Named(name) => Ok(name.clone()),
            Wanted::OfMailgunCluster(cluster) => {
                let infra = Api::<MailgunCluster>::namespaced(self.client.clone(), namespace)
                    .get_opt(cluster)
                    .await
                    .map_err(kube(
                        "reading the Cluster's MailgunCluster for its identity",
                    ))?;
                match infra {
                    Some(infra) => Ok(infra.spec.identity_ref.map(|r| r.name)),
                    // Its Cluster names a MailgunCluster that does not exist (any more): the
                    // provider's own configuration, never another tenant's.
                    None => {
                        tracing::debug!(
                            namespace,
                            cluster,
                            "The Cluster's MailgunCluster is not found; the machine's mails use the provider's own configuration"
                        );
                        Ok(None)
                    }
                }
            }
        }
    }

    /// The route of the identity `name` (`None`: the provider's own configuration) for an
    /// object in `namespace`; [`IdentityError::Unusable`] when it does not exist, does not allow
    /// `namespace`, or cannot be used.
    pub(crate) async fn route(
        &self,
        name: Option<&str>,
        namespace: &str,
    ) -> Result<Route, IdentityError> {
        let Some(name) = name else {
            return Ok(self.default.clone());
        };
        let identity = Api::<MailgunClusterIdentity>::all(self.client.clone())
            .get_opt(name)
            .await
            .map_err(kube("reading the MailgunClusterIdentity"))?
            .ok_or_else(|| {
                problem(
                    reasons::IDENTITY_NOT_FOUND,
                    format!("MailgunClusterIdentity {name} not found: no mail is sent"),
                )
            })?;
        self.check_allowed(&identity, name, namespace).await?;
        let spec = &identity.spec;
        let (config, from) = match (&spec.mailgun, &spec.smtp) {
            (Some(m), None) => {
                let api_key = self
                    .secret(name, "spec.mailgun.apiKeySecretRef", &m.api_key_secret_ref)
                    .await?;
                let mut config = MailgunConfig::new(&m.domain, value(api_key)?);
                config.region = match m.region.unwrap_or_default() {
                    ApiRegion::Us => MailgunRegion::Us,
                    ApiRegion::Eu => MailgunRegion::Eu,
                };
                config.base_url.clone_from(&m.base_url);
                if let Some(r) = &m.read_key_secret_ref {
                    let read = self
                        .secret(name, "spec.mailgun.readKeySecretRef", r)
                        .await?;
                    config.read_api_key = Some(value(read)?);
                }
                let from = spec
                    .from
                    .clone()
                    .unwrap_or_else(|| format!("cluster-api-provider-mailgun@{}", m.domain));
                (MailerConfig::Mailgun(config), from)
            }
            (None, Some(s)) => {
                let mut config = SmtpConfig::new(&s.url);
                config.username.clone_from(&s.username);
                if let Some(r) = &s.password_secret_ref {
                    let password = self.secret(name, "spec.smtp.passwordSecretRef", r).await?;
                    config.password = Some(value(password)?);
                }
                if let Some(r) = &s.ca_secret_ref {
                    config.ca_pem = Some(self.secret(name, "spec.smtp.caSecretRef", r).await?);
                }
                let from = spec
                    .from
                    .clone()
                    .ok_or_else(|| invalid(name, "spec.from is required with smtp".to_owned()))?;
                (MailerConfig::Smtp(config), from)
            }
            _ => {
                return Err(invalid(
                    name,
                    "exactly one backend, spec.mailgun or spec.smtp, is required".to_owned(),
                ));
            }
        };
        let (mailer, poller) = self.mailer(name, config)?;
        Ok(Route {
            mailer,
            from,
            recipients: spec.recipients.clone(),
            identity: Some(name.to_owned()),
            poller,
        })
    }

    /// Whether the identity `name` allows `namespace` (absent `allowedNamespaces`: none).
    async fn check_allowed(
        &self,
        identity: &MailgunClusterIdentity,
        name: &str,
        namespace: &str,
    ) -> Result<(), IdentityError> {
        let not_allowed = || {
            problem(
                reasons::IDENTITY_NOT_ALLOWED,
                format!(
                    "MailgunClusterIdentity {name} does not allow namespace {namespace} \
                     (spec.allowedNamespaces): no mail is sent"
                ),
            )
        };
        let Some(allowed) = &identity.spec.allowed_namespaces else {
            return Err(not_allowed());
        };
        let labels = if allowed.selector.is_some() {
            Api::<Namespace>::all(self.client.clone())
                .get_opt(namespace)
                .await
                .map_err(kube("reading the namespace's labels"))?
                .and_then(|ns| ns.metadata.labels)
                .unwrap_or_default()
        } else {
            BTreeMap::new()
        };
        if allowed.allows(namespace, &labels) {
            Ok(())
        } else {
            Err(not_allowed())
        }
    }

    /// The bytes of the key `reference` names, from the provider's namespace.
    async fn secret(
        &self,
        identity: &str,
        field: &str,
        reference: &SecretKeyReference,
    ) -> Result<Vec<u8>, IdentityError> {
        let Some(namespace) = &self.secret_namespace else {
            return Err(invalid(
                identity,
                "the provider does not know its own namespace, where the identities' Secrets \
                 are read (set --identity-secret-namespace or POD_NAMESPACE)"
                    .to_owned(),
            ));
        };
        let secret = Api::<Secret>::namespaced(self.client.clone(), namespace)
            .get_opt(&reference.name)
            .await
            .map_err(kube("reading an identity's Secret"))?
            .ok_or_else(|| {
                invalid(
                    identity,
                    format!(
                        "{field}: Secret {} not found in namespace {namespace}",
                        reference.name
                    ),
                )
            })?;
        let bytes = secret
            .data
            .and_then(|mut data| data.remove(&reference.key))
            .map(|b| b.0)
            .filter(|b| !b.is_empty())
            .ok_or_else(|| {
                invalid(
                    identity,
                    format!(
                        "{field}: Secret {} has no (or an empty) key {}",
                        reference.name, reference.key
                    ),
                )
            })?;
        if bytes.len() > MAX_SECRET_VALUE_BYTES {
            return Err(invalid(
                identity,
                format!(
                    "{field}: the value of key {} in Secret {} is larger than {MAX_SECRET_VALUE_BYTES} bytes",
                    reference.key, reference.name
                ),
            ));
        }
        Ok(bytes)
    }

    /// The backend for `config` and its poller: the ones built before when nothing changed,
    /// else a new backend (the poller kept, asking the new backend from now on).
    fn mailer(
        &self,
        name: &str,
        config: MailerConfig,
    ) -> Result<(Arc<dyn Mailer>, Arc<Poller>), IdentityError> {
        let mut built = self.built.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((was, mailer, poller)) = built.get(name)
            && *was == config
        {
            return Ok((Arc::clone(mailer), Arc::clone(poller)));
        }
        // The factory's errors name a field (`mailgun.baseUrl: ...`), never a secret.
        let mailer = capm_mailer::build_with_gate(&config, Arc::clone(&self.gate))
            .map_err(|e| invalid(name, format!("spec.{e}")))?;
        // Counted in the same mailer metrics as the provider's own backend.
        let mailer = self.default.mailer.wrap_like_me(mailer, name);
        let poller = match built.get(name) {
            Some((_, _, poller)) => {
                poller.set_mailer(Arc::clone(&mailer));
                Arc::clone(poller)
            }
            None => self.default.poller.sibling(Arc::clone(&mailer)),
        };
        built.insert(
            name.to_owned(),
            (config, Arc::clone(&mailer), Arc::clone(&poller)),
        );
        Ok((mailer, poller))
    }

    /// Forgets object `uid`'s open mail in every identity's poller.
    pub(crate) fn forget(&self, uid: &str) {
        for (_, _, poller) in self
            .built
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
        {
            poller.forget(uid);
        }
    }
}

fn invalid(identity: &str, why: String) -> IdentityError {
    problem(
        reasons::IDENTITY_INVALID,
        format!("MailgunClusterIdentity {identity} cannot be used: {why}; no mail is sent"),
    )
}

/// A secret value for the mailer's configuration: UTF-8, one trailing newline removed (as a
/// mounted file's is).
fn value(bytes: Vec<u8>) -> Result<SecretSource, IdentityError> {
    let text = String::from_utf8(bytes).map_err(|_| {
        problem(
            reasons::IDENTITY_INVALID,
            "a key of the identity's Secret is not UTF-8 text".to_owned(),
        )
    })?;
    let text = text
        .strip_suffix('\n')
        .map(|t| t.strip_suffix('\r').unwrap_or(t).to_owned())
        .unwrap_or(text);
    Ok(SecretSource::Value(InlineSecret::new(text)))
}
