//! Mail identities: which backend, sender and recipients an object's mails go through
//! (docs/multi-tenancy.md), within the operator's rules ([`Tenancy`]). Identities, their claimed
//! Secrets and namespaces' labels come from watched caches ([`Stores`], [`Namespaces`]): a
//! rotated key is used as soon as it is seen. A backend is built once per identity, rebuilt
//! when what it was built from changes, dropped with its poller when the identity is gone.

use std::{
    collections::{BTreeMap, HashMap},
    sync::{Arc, Mutex},
};

use capm_api::{
    names::{IDENTITY_SECRET_LABEL, reasons},
    v1beta1::{AllowedNamespaces, MailgunClusterIdentity, SecretKeyReference},
};
use capm_mailer::{
    CommitGate, InlineSecret, Mailer, MailerConfig, MailgunConfig, MailgunRegion, SecretSource,
    SmtpConfig,
};
use kube::{Client, runtime::reflector::ObjectRef};

pub(crate) use crate::kinds::Wanted;
use crate::{
    config::{Config, Tenancy},
    kinds::Stores,
    poller::Poller,
    watch::{Namespaces, NotListed, listed},
};

/// Why an identity gave no route.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// It cannot be used: the condition reason it shows (`IdentityNotFound`, `…NotAllowed`,
    /// `…Invalid`, `…Required`) and what is wrong (naming a field or Secret, never a value).
    #[error("{message}")]
    Unusable {
        reason: &'static str,
        message: String,
    },
    /// A cache it is read from has not been listed yet.
    #[error(transparent)]
    NotListed(#[from] NotListed),
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

/// A route for a new conversation (the namespace must be allowed now), or for one a record names
/// (a lookup, resend, release or delivery news: through the identity it began with, even after
/// the namespace lost access).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Access {
    New,
    Recorded,
}

/// The identities' backends, built on demand and kept while what they were built from holds.
pub(crate) struct Identities {
    stores: Stores,
    namespaces: Namespaces,
    secret_namespace: Option<String>,
    tenancy: Tenancy,
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
    /// Identities by `config`'s rules, their backends asking `gate` at each send's commit point.
    pub(crate) fn new(
        client: Client,
        stores: Stores,
        config: &Config,
        gate: Arc<dyn CommitGate>,
        default: Route,
    ) -> Self {
        Self {
            stores,
            // The watch ends with the controllers' run, as the delivery poller does.
            namespaces: Namespaces::new(client, default.poller.stop.child_token()),
            secret_namespace: config.identity_secret_namespace.clone(),
            tenancy: config.tenancy.clone(),
            gate,
            default,
            built: Mutex::new(HashMap::new()),
        }
    }

    /// The route of the identity `name` (`None`: the provider's own configuration) for an
    /// object in `namespace`; [`IdentityError::Unusable`] when it does not exist, does not allow
    /// `namespace` (checked for [`Access::New`] only), or cannot be used.
    pub(crate) async fn route(
        &self,
        name: Option<&str>,
        namespace: &str,
        access: Access,
    ) -> Result<Route, IdentityError> {
        let Some(name) = name else {
            if access == Access::New {
                self.check_default(namespace).await?;
            }
            return Ok(self.default.clone());
        };
        let identities = listed(&self.stores.identities, "MailgunClusterIdentity")?;
        // The backends and pollers of identities that are gone are dropped.
        self.built().retain(|built, (.., poller)| {
            let kept = identities.get(&ObjectRef::new(built)).is_some();
            if !kept {
                poller.stop.cancel();
            }
            kept
        });
        let Some(identity) = identities.get(&ObjectRef::new(name)) else {
            return Err(problem(
                reasons::IDENTITY_NOT_FOUND,
                format!("MailgunClusterIdentity {name} not found: no mail is sent"),
            ));
        };
        if access == Access::New {
            let allowed = identity.spec.allowed_namespaces.as_ref();
            if !self.allows(allowed, namespace).await? {
                return Err(not_allowed(
                    &format!("MailgunClusterIdentity {name}"),
                    namespace,
                ));
            }
        }
        let spec = &identity.spec;
        let secret = |field, reference| self.secret(&identity, field, reference);
        let (config, from) = match (&spec.mailgun, &spec.smtp) {
            (Some(m), None) => {
                let region: MailgunRegion = m.region.unwrap_or_default();
                // The host first: no Secret is read for an identity that may not reach it.
                let (field, url) = match &m.base_url {
                    Some(url) => ("spec.mailgun.baseURL", url.as_str()),
                    None => ("spec.mailgun.region", region.base_url()),
                };
                self.tenancy
                    .hosts
                    .check(field, url, false)
                    .map_err(|why| invalid(name, why))?;
                let api_key = secret("spec.mailgun.apiKeySecretRef", &m.api_key_secret_ref).await?;
                let mut config = MailgunConfig::new(&m.domain, value(api_key)?);
                config.region = region;
                config.base_url.clone_from(&m.base_url);
                if let Some(r) = &m.read_key_secret_ref {
                    let read = secret("spec.mailgun.readKeySecretRef", r).await?;
                    config.read_api_key = Some(value(read)?);
                }
                let from = spec
                    .from
                    .clone()
                    .unwrap_or_else(|| format!("cluster-api-provider-mailgun@{}", m.domain));
                (MailerConfig::Mailgun(config), from)
            }
            (None, Some(s)) => {
                self.tenancy
                    .hosts
                    .check("spec.smtp.url", &s.url, true)
                    .map_err(|why| invalid(name, why))?;
                let mut config = SmtpConfig::new(&s.url);
                config.username.clone_from(&s.username);
                if let Some(r) = &s.password_secret_ref {
                    let password = secret("spec.smtp.passwordSecretRef", r).await?;
                    config.password = Some(value(password)?);
                }
                if let Some(r) = &s.ca_secret_ref {
                    config.ca_pem = Some(secret("spec.smtp.caSecretRef", r).await?);
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

    /// Whether the provider's own configuration may serve `namespace` now.
    async fn check_default(&self, namespace: &str) -> Result<(), IdentityError> {
        if self.tenancy.require_identity_ref {
            return Err(problem(
                reasons::IDENTITY_REQUIRED,
                "an identityRef is required (the provider's own configuration serves no \
                 namespace): no mail is sent"
                    .to_owned(),
            ));
        }
        let allowed = self.allows(Some(&self.tenancy.default_allowed), namespace);
        let what = "the provider's own configuration";
        allowed
            .await?
            .then_some(())
            .ok_or_else(|| not_allowed(what, namespace))
    }

    /// Whether `allowed` allows `namespace` (absent: none).
    async fn allows(
        &self,
        allowed: Option<&AllowedNamespaces>,
        namespace: &str,
    ) -> Result<bool, IdentityError> {
        let Some(allowed) = allowed else {
            return Ok(false);
        };
        let labels = if allowed.reads_labels() {
            self.namespaces.labels(namespace).await?
        } else {
            BTreeMap::new()
        };
        Ok(allowed.allows(namespace, &labels))
    }

    /// The bytes of the key `reference` names (at most [`MAX_SECRET_VALUE_BYTES`]), from a
    /// Secret in the provider's namespace claimed for `identity`
    /// (`MailgunClusterIdentity::check_claim`).
    async fn secret(
        &self,
        identity: &MailgunClusterIdentity,
        field: &str,
        reference: &SecretKeyReference,
    ) -> Result<Vec<u8>, IdentityError> {
        let name = identity.metadata.name.as_deref().unwrap_or_default();
        let refuse = |why: String| invalid(name, format!("{field}: {why}"));
        let (secret, key) = (&reference.name, &reference.key);
        let namespace = self
            .secret_namespace
            .as_deref()
            .unwrap_or("(unknown: set --identity-secret-namespace or POD_NAMESPACE)");
        let found = match self.secret_namespace.as_deref() {
            Some(ns) => {
                listed(&self.stores.secrets, "Secret")?.get(&ObjectRef::new(secret).within(ns))
            }
            None => None,
        };
        let found = found.ok_or_else(|| {
            refuse(format!(
                "Secret {secret} not found in namespace {namespace} among the Secrets claimed \
                 for identities (label {IDENTITY_SECRET_LABEL}=<identity>)"
            ))
        })?;
        identity.check_claim(&found.metadata).map_err(refuse)?;
        found
            .data
            .as_ref()
            .and_then(|data| data.get(key))
            .map(|b| b.0.clone())
            .filter(|b| (1..=MAX_SECRET_VALUE_BYTES).contains(&b.len()))
            .ok_or_else(|| {
                refuse(format!(
                    "Secret {secret} has no key {key} with a value of 1 to \
                     {MAX_SECRET_VALUE_BYTES} bytes"
                ))
            })
    }

    /// The backend for `config` and its poller: the ones built before when nothing changed,
    /// else a new backend (the poller kept, asking the new backend from now on).
    fn mailer(
        &self,
        name: &str,
        config: MailerConfig,
    ) -> Result<(Arc<dyn Mailer>, Arc<Poller>), IdentityError> {
        let mut built = self.built();
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

    fn built(&self) -> std::sync::MutexGuard<'_, HashMap<String, Built>> {
        crate::lock(&self.built)
    }

    /// The names of namespaces whose labels may have changed (an identity's, or the provider's
    /// own, `allowedNamespaces` selector reads them): see [`Namespaces::changes`].
    pub(crate) fn namespace_changes(&self) -> futures::channel::mpsc::UnboundedReceiver<String> {
        self.namespaces.changes()
    }
}

fn not_allowed(what: &str, namespace: &str) -> IdentityError {
    problem(
        reasons::IDENTITY_NOT_ALLOWED,
        format!("{what} does not allow namespace {namespace} (allowedNamespaces): no mail is sent"),
    )
}

fn invalid(identity: &str, why: String) -> IdentityError {
    problem(
        reasons::IDENTITY_INVALID,
        format!("MailgunClusterIdentity {identity} cannot be used: {why}; no mail is sent"),
    )
}

/// A secret value for the mailer's configuration (UTF-8, one trailing newline removed).
fn value(bytes: Vec<u8>) -> Result<SecretSource, IdentityError> {
    let why = "a key of the identity's Secret is not UTF-8 text";
    InlineSecret::source(bytes).ok_or_else(|| problem(reasons::IDENTITY_INVALID, why.into()))
}

#[cfg(test)]
mod tests {
    use capm_mailer::MockMailer;
    use kube::runtime::reflector;

    use super::*;
    use crate::{Leadership, poller::Timings};

    /// Identities over an API server nobody answers: what they decide without asking it.
    fn identities(tenancy: Tenancy) -> Identities {
        let client =
            Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
        let leadership = Leadership::unelected("t");
        let timings = Timings {
            base: std::time::Duration::from_secs(1),
            max: std::time::Duration::from_secs(1),
            retention: std::time::Duration::from_secs(1),
        };
        let mailer: Arc<dyn Mailer> = Arc::new(MockMailer::new());
        let wakes = crate::poller::tests::wakes().0;
        let poller = Arc::new(Poller::new(
            Arc::clone(&mailer),
            leadership.clone(),
            timings,
            wakes,
        ));
        let default = Route {
            mailer,
            from: "capm@example.com".into(),
            recipients: vec!["ops@example.com".into()],
            identity: None,
            poller,
        };
        let (clusters, machines) = (reflector::store().0, reflector::store().0);
        let stores = crate::kinds::tests::stores(clusters, machines);
        let mut config = crate::config::tests::for_tests("example.com");
        config.tenancy = tenancy;
        Identities::new(client, stores, &config, Arc::new(leadership), default)
    }

    fn reason(result: Result<Route, IdentityError>) -> &'static str {
        match result {
            Ok(_) => "allowed",
            Err(IdentityError::Unusable { reason, .. }) => reason,
            Err(IdentityError::NotListed(_)) => "not listed",
        }
    }

    #[tokio::test]
    async fn the_default_identity_serves_only_what_the_operator_allows() {
        let list = |names: &[&str]| AllowedNamespaces {
            list: Some(names.iter().map(|n| (*n).to_owned()).collect()),
            selector: None,
        };
        let open = identities(crate::config::tests::tenancy());
        assert_eq!(
            reason(open.route(None, "any", Access::New).await),
            "allowed"
        );
        let listed = identities(Tenancy {
            default_allowed: list(&["platform"]),
            ..crate::config::tests::tenancy()
        });
        assert_eq!(
            reason(listed.route(None, "platform", Access::New).await),
            "allowed"
        );
        assert_eq!(
            reason(listed.route(None, "team-a", Access::New).await),
            reasons::IDENTITY_NOT_ALLOWED
        );
        // A conversation begun through the default goes on through it.
        assert_eq!(
            reason(listed.route(None, "team-a", Access::Recorded).await),
            "allowed"
        );
        let required = identities(Tenancy {
            require_identity_ref: true,
            ..crate::config::tests::tenancy()
        });
        let Err(error) = required.route(None, "platform", Access::New).await else {
            panic!("the default served an object without identityRef");
        };
        assert!(
            error.to_string().contains("an identityRef is required"),
            "{error}"
        );
        assert_eq!(
            reason(required.route(None, "platform", Access::Recorded).await),
            "allowed"
        );
    }
}
