//! What the send-once layer, the pipeline and the Events read of an object the provider mails
//! about: the infrastructure kinds ([`super::InfraKind`]) and `MailgunRemediation`.

use std::fmt::Debug;

use capm_api::{capi, names, v1beta1::Priority};
use k8s_openapi::NamespaceResourceScope;
use kube::{Resource, ResourceExt};
use serde::{Serialize, de::DeserializeOwned};

use super::{MailText, Stores, Wanted, key};

/// An object with send-once mail records (`crate::sendonce`): its mails, their records and
/// Message-Ids, its finalizer, its Events and its place in the pipeline.
pub trait Mailed:
    Resource<DynamicType = (), Scope = NamespaceResourceScope>
    + Clone
    + Debug
    + DeserializeOwned
    + Serialize
    + Send
    + Sync
    + 'static
{
    /// `MailgunCluster` / `MailgunMachine` / `MailgunRemediation`.
    const KIND: &'static str;
    /// The controller name in metrics and logs.
    const CONTROLLER: &'static str;
    const FINALIZER: &'static str;
    /// The Cluster API owner kind (`Cluster` / `Machine`).
    const OWNER_KIND: &'static str;
    /// The labels the controllers read on this kind; the cache drops the others.
    const CACHED_LABELS: &'static [&'static str];
    /// Whether its follow-up mails (the deletion mail, the reminders) answer its request mail
    /// (`In-Reply-To`/`References`), so that mail clients show them as one thread.
    const THREADED: bool = false;
    /// The Cluster API owner whose life a new request depends on.
    type Owner: Resource<DynamicType = (), Scope = NamespaceResourceScope>
        + Clone
        + Debug
        + DeserializeOwned
        + Send
        + Sync
        + 'static;

    fn priority(&self) -> Priority;
    /// Where replies to its mails go (`Reply-To`), if anywhere but the sender.
    fn reply_to(&self) -> Option<&str>;
    /// The "no longer needed" mail.
    fn deletion_mail(&self) -> MailText;
    /// The mail identity the object wants now (`spec.identityRef`; a machine: its Cluster's).
    fn wanted_identity(&self, capi: &Stores) -> Wanted;

    /// A span naming the object `key` (`namespace/name`) the way Cluster API's logs do: the
    /// kind as the key (`MailgunCluster="ns/name"`), with the `controller`, and `Cluster` (and
    /// `Machine`) left to record. At ERROR level so that no level filter drops it: the events
    /// inside would lose the object's name.
    fn log_span(key: &str) -> tracing::Span;

    /// [`Self::log_span`] for this object, its owner and its `Cluster` recorded as far as the
    /// object names them (ownerReference, `cluster.x-k8s.io/cluster-name` label).
    fn span(&self) -> tracing::Span {
        let namespace = self.namespace();
        let key = |name: &str| key(namespace.as_deref(), name);
        let span = Self::log_span(&key(&self.name_any()));
        if let Some(owner) = capi::owner(self.owner_references(), Self::OWNER_KIND) {
            span.record(Self::OWNER_KIND, key(&owner.name).as_str());
        }
        if let Some(cluster) = self.labels().get(names::CLUSTER_NAME_LABEL) {
            span.record("Cluster", key(cluster).as_str());
        }
        span
    }
}
