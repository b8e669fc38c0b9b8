//! `MailgunRemediation` as a [`Mailed`] kind: what the send-once layer, the pipeline and the
//! Events read of it.

use capm_api::{
    capi::Machine,
    names,
    v1beta1::{MailgunRemediation, Priority},
};
use kube::ResourceExt;

use super::mail::{About, text};
use crate::{
    kinds::{MailText, Mailed, Stores, Wanted, cluster_identity},
    sendonce::Which,
};

impl Mailed for MailgunRemediation {
    const KIND: &'static str = "MailgunRemediation";
    const CONTROLLER: &'static str = "mailgunremediation";
    const FINALIZER: &'static str = names::REMEDIATION_FINALIZER;
    const OWNER_KIND: &'static str = "Machine";
    /// The `Cluster` → `MailgunRemediation` mapping selects by this label.
    const CACHED_LABELS: &'static [&'static str] = &[names::CLUSTER_NAME_LABEL];
    const THREADED: bool = true;
    type Owner = Machine;

    fn priority(&self) -> Priority {
        self.spec.priority
    }
    /// The object names nobody: the replies go to the sender's side.
    fn reply_to(&self) -> Option<&str> {
        None
    }
    /// The "no longer needed" mail as the object alone tells it (the Machine may be gone).
    fn deletion_mail(&self) -> MailText {
        let (name, namespace) = (self.name_any(), self.namespace().unwrap_or_default());
        let labels = self.labels();
        let about = about(self, &name, &namespace, cluster_of(labels));
        text(&about, Which::Deletion)
    }
    /// The identity of its Machine's Cluster's `MailgunCluster`, as a machine's.
    fn wanted_identity(&self, capi: &Stores) -> Wanted {
        let cluster = self.labels().get(names::CLUSTER_NAME_LABEL);
        cluster_identity(capi, &self.namespace().unwrap_or_default(), cluster)
    }
    fn log_span(key: &str) -> tracing::Span {
        tracing::error_span!(
            "reconcile",
            controller = Self::CONTROLLER,
            MailgunRemediation = key,
            Machine = tracing::field::Empty,
            Cluster = tracing::field::Empty,
        )
    }
}

/// The Cluster the object's labels name (`""` when none).
pub(super) fn cluster_of(labels: &std::collections::BTreeMap<String, String>) -> &str {
    labels
        .get(names::CLUSTER_NAME_LABEL)
        .map_or("", String::as_str)
}

/// What the object itself says, for its mails; the Machine's details are the caller's to add.
pub(super) fn about<'a>(
    obj: &'a MailgunRemediation,
    name: &'a str,
    namespace: &'a str,
    cluster: &'a str,
) -> About<'a> {
    About {
        name,
        namespace,
        cluster,
        node: None,
        provider_id: None,
        health: None,
        priority: obj.spec.priority,
        request: &obj.spec.request,
        answer_timeout: &obj.spec.strategy.answer_timeout,
        reminders: obj.spec.strategy.reminders,
        link: None,
    }
}
