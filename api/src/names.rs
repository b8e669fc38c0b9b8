//! Names shared by the API, the controllers and the tests: metadata keys, finalizers, condition
//! types and reasons, labels.
//!
//! Keeping them here (and not as string literals in the controllers) means a typo is a compile
//! error and `kubectl describe` output can be traced back to one documented constant.

/// Prefix of every annotation this provider owns.
pub const ANNOTATION_PREFIX: &str = "mailgun.infrastructure.cluster.x-k8s.io";

/// The durable record of the request mail, one annotation through the mail's whole life: written
/// **before** the mail is sent (state `sending`, with the deterministic `Message-Id` the mail
/// carries, see [`message_id`]), and rewritten once the backend accepted it (state `sent`).
///
/// Step 1 of the crash-safe send: the controller writes this annotation in one metadata update
/// guarded by the object's `resourceVersion` (a conflict means another writer won, so it
/// requeues), and only then talks to the mail backend. Metadata survives `clusterctl move` and
/// backups; status does not, which is why the record is not kept in status alone. A record still
/// `sending` means the process was interrupted between "decided to send" and "recorded as sent":
/// the controller asks the backend whether that `Message-Id` was accepted before sending again,
/// and re-sends with the **same** `Message-Id` when the backend cannot answer, so receivers can
/// de-duplicate.
pub const MAIL_ANNOTATION: &str = "mailgun.infrastructure.cluster.x-k8s.io/mail";

/// Like [`MAIL_ANNOTATION`], for the "no longer needed" mail sent while the object is deleted.
/// Its `Message-Id` comes from [`deletion_message_id`].
pub const DELETION_MAIL_ANNOTATION: &str = "mailgun.infrastructure.cluster.x-k8s.io/deletion-mail";

/// The durable records of a `MailgunRemediation`'s reminders 1 to 3, one annotation each, like
/// [`MAIL_ANNOTATION`] (which holds its repair mail's, and [`DELETION_MAIL_ANNOTATION`] its
/// "no longer needed" mail's). Their `Message-Id`s come from [`reminder_message_id`].
pub const REMINDER_MAIL_ANNOTATIONS: [&str; 3] = [
    "mailgun.infrastructure.cluster.x-k8s.io/reminder-1-mail",
    "mailgun.infrastructure.cluster.x-k8s.io/reminder-2-mail",
    "mailgun.infrastructure.cluster.x-k8s.io/reminder-3-mail",
];

/// The request's intent as release 0.1 wrote it (beside [`MAIL_SENT_ANNOTATION`]); still
/// read, never written: objects mailed by release 0.1 are not mailed again.
pub const MAIL_INTENT_ANNOTATION: &str = "mailgun.infrastructure.cluster.x-k8s.io/mail-intent";

/// The request's sent record as release 0.1 wrote it; still read, never written.
pub const MAIL_SENT_ANNOTATION: &str = "mailgun.infrastructure.cluster.x-k8s.io/mail-sent";

/// Like [`MAIL_INTENT_ANNOTATION`], for the release mail; still read, never written.
pub const DELETION_MAIL_INTENT_ANNOTATION: &str =
    "mailgun.infrastructure.cluster.x-k8s.io/deletion-mail-intent";

/// Like [`MAIL_SENT_ANNOTATION`], for the release mail; still read, never written.
pub const DELETION_MAIL_SENT_ANNOTATION: &str =
    "mailgun.infrastructure.cluster.x-k8s.io/deletion-mail-sent";

/// Whether the object's annotations say its request mail was accepted, in either record format
/// (a quick look for tests and tools; the controller believes a record only after checking its
/// shape).
pub fn request_recorded_sent(annotations: &std::collections::BTreeMap<String, String>) -> bool {
    annotations
        .get(MAIL_ANNOTATION)
        .is_some_and(|v| v.contains("\"state\":\"sent\""))
        || annotations.contains_key(MAIL_SENT_ANNOTATION)
}

/// Set (or changed) by a user, it retries the object's mail that the backend refused
/// permanently, once, without a restart: a refusal is remembered with this annotation's value,
/// and a new value lifts it. The value is any text, e.g. the time (`kubectl annotate --overwrite
/// mailguncluster NAME mailgun.infrastructure.cluster.x-k8s.io/retry="$(date +%s)"`). The
/// chart's admission policy lets tenants write it, unlike the provider's records under the same
/// prefix. The retry is recorded in a `MailRetried` Event.
pub const RETRY_ANNOTATION: &str = "mailgun.infrastructure.cluster.x-k8s.io/retry";

/// Present on a `MailgunCluster` or `MailgunMachine` (any value), it revokes every fulfilment
/// link to the object: the page refuses them and writes nothing (docs/fulfilment.md). Outside
/// the provider's record prefix on purpose: it is a user's statement, and anyone who may patch
/// the object may set or remove it (they could fill in the fields themselves anyway).
pub const FULFILMENT_REVOKED_ANNOTATION: &str =
    "fulfilment.mailgun.infrastructure.cluster.x-k8s.io/revoked";

/// Annotation holding, as JSON, the fields an older API version cannot represent, so that a
/// round trip through that version loses nothing. Written by down-conversion, read and removed by
/// up-conversion; see [`crate::conversion`]. Not for humans to edit.
pub const CONVERSION_DATA_ANNOTATION: &str =
    "mailgun.infrastructure.cluster.x-k8s.io/conversion-data";

/// Finalizer on a `MailgunCluster` while the controller may still have work to do for it.
pub const CLUSTER_FINALIZER: &str = "mailguncluster.infrastructure.cluster.x-k8s.io";

/// Finalizer on a `MailgunMachine` while the controller may still have work to do for it.
pub const MACHINE_FINALIZER: &str = "mailgunmachine.infrastructure.cluster.x-k8s.io";

/// Finalizer on a `MailgunRemediation` once a mail was (or may have been) sent for it, until its
/// "no longer needed" mail is settled.
pub const REMEDIATION_FINALIZER: &str = "mailgunremediation.infrastructure.cluster.x-k8s.io";

/// Cluster API: the annotation that pauses reconciliation of one object.
pub const PAUSED_ANNOTATION: &str = "cluster.x-k8s.io/paused";

/// Cluster API: a person's request to remediate a Machine. Its MachineHealthCheck reports the
/// Machine unhealthy while it is there, and nothing in Cluster API removes it; the provider
/// reports it in a remediation's status and never removes it either (it has no `patch` on
/// Machines).
pub const REMEDIATE_MACHINE_ANNOTATION: &str = "cluster.x-k8s.io/remediate-machine";

/// Cluster API: objects carrying this annotation are managed by someone else; skip them.
pub const MANAGED_BY_ANNOTATION: &str = "cluster.x-k8s.io/managed-by";

/// Cluster API: label naming the `Cluster` an object belongs to (set by the core controllers).
pub const CLUSTER_NAME_LABEL: &str = "cluster.x-k8s.io/cluster-name";

/// Cluster API: label that selects which provider instance reconciles an object
/// (`--watch-filter`).
pub const WATCH_FILTER_LABEL: &str = "cluster.x-k8s.io/watch-filter";

/// Cluster API: label on every object and CRD of this provider.
pub const PROVIDER_LABEL: &str = "cluster.x-k8s.io/provider";

/// Value of [`PROVIDER_LABEL`].
pub const PROVIDER_NAME: &str = "infrastructure-mailgun";

/// CRD label telling Cluster API which of our versions implement contract `v1beta1`.
pub const CONTRACT_V1BETA1_LABEL: &str = "cluster.x-k8s.io/v1beta1";

/// CRD label telling Cluster API which of our versions implement contract `v1beta2`.
pub const CONTRACT_V1BETA2_LABEL: &str = "cluster.x-k8s.io/v1beta2";

/// Condition types set in `status.conditions`.
pub mod conditions {
    /// `Ready`: the summary condition Cluster API surfaces on the owning `Cluster` / `Machine`.
    /// True once the request has been mailed and fulfilled.
    pub const READY: &str = "Ready";
    /// `Paused`: True while reconciliation is paused (Cluster `spec.paused` or the
    /// `cluster.x-k8s.io/paused` annotation).
    pub const PAUSED: &str = "Paused";
    /// `MailSent`: True once the backend accepted the request mail.
    pub const MAIL_SENT: &str = "MailSent";
    /// `MailDelivered`: what the backend reported about the request mail after accepting it.
    /// True once delivered; False when it failed for good (never resent: a human must act);
    /// Unknown while no outcome is known, when the backend cannot tell (SMTP), or when the
    /// backend's events expired before an outcome. Informational: it does not feed `Ready`.
    pub const MAIL_DELIVERED: &str = "MailDelivered";
    /// `Provisioned`: True once a human fulfilled the request (`spec.controlPlaneEndpoint` on a
    /// cluster, `spec.providerID` on a machine).
    pub const PROVISIONED: &str = "Provisioned";
    /// `Answered` (a `MailgunRemediation`): True once `spec.answer` is set; its reason is the
    /// answer (`Repaired`, `CannotRepair`).
    pub const ANSWERED: &str = "Answered";
    /// `HandedBack` (a `MailgunRemediation`): True once the Machine was handed back to its owner
    /// (reason: why, a `HandBackReason`); False `HandBackHeld` while a timed hand-back waits
    /// for the MachineHealthCheck to allow remediation.
    pub const HANDED_BACK: &str = "HandedBack";
}

/// Condition reasons (CamelCase, as `metav1.Condition` requires).
pub mod reasons {
    /// The object has no owner `Cluster` / `Machine` yet; nothing is sent until it has.
    pub const WAITING_FOR_OWNER: &str = "WaitingForOwner";
    /// A machine waits for its cluster's infrastructure to be provisioned.
    pub const WAITING_FOR_CLUSTER_INFRASTRUCTURE: &str = "WaitingForClusterInfrastructure";
    /// A machine waits for its bootstrap data secret.
    pub const WAITING_FOR_BOOTSTRAP_DATA: &str = "WaitingForBootstrapData";
    /// Reconciliation is paused.
    pub const PAUSED: &str = "Paused";
    /// Reconciliation is not paused.
    pub const NOT_PAUSED: &str = "NotPaused";
    /// The intent to send was recorded; the outcome is not known yet.
    pub const MAIL_PENDING: &str = "MailPending";
    /// The backend accepted the mail.
    pub const MAIL_SENT: &str = "MailSent";
    /// The backend rejected the mail permanently (a 5xx SMTP reply, Mailgun 400/401/403). It is
    /// not retried automatically, neither on a timer nor on unrelated changes: a new value of
    /// [`RETRY_ANNOTATION`](super::RETRY_ANNOTATION) (for example after fixing credentials or
    /// the relay's policy) or a restart of the provider retries it once; a refusal of the
    /// object's own data (its requester address) needs a new object. On
    /// deletion, a release mail refused permanently keeps the finalizer until then (remove it by
    /// hand to give up).
    pub const MAIL_FAILED: &str = "MailFailed";
    /// A refused mail is tried once more, as a new value of
    /// [`RETRY_ANNOTATION`](super::RETRY_ANNOTATION) asks (an Event's reason).
    pub const MAIL_RETRIED: &str = "MailRetried";
    /// The backend accepted the mail and reported nothing final yet (`MailDelivered` Unknown).
    pub const DELIVERY_PENDING: &str = "DeliveryPending";
    /// The backend failed to deliver the mail temporarily and retries by itself
    /// (`MailDelivered` Unknown).
    pub const DELIVERY_DELAYED: &str = "DeliveryDelayed";
    /// The backend delivered the mail to the recipients' mail server (`MailDelivered` True).
    pub const DELIVERED: &str = "Delivered";
    /// The backend gave up delivering the mail (`MailDelivered` False; also a Warning event).
    /// The provider never resends because of it: a human must act.
    pub const DELIVERY_FAILED: &str = "DeliveryFailed";
    /// Some recipients have the mail and the backend gave up on the others (`MailDelivered`
    /// True; also a Warning event naming those it could not reach).
    pub const PARTLY_DELIVERED: &str = "PartlyDelivered";
    /// The backend's events expired before they showed an outcome; the provider stopped
    /// asking (`MailDelivered` Unknown).
    pub const DELIVERY_UNKNOWN: &str = "DeliveryUnknown";
    /// The backend reports acceptance only (SMTP): delivery cannot be followed
    /// (`MailDelivered` Unknown).
    pub const NOT_TRACKABLE: &str = "NotTrackable";
    /// The "no longer needed" mail was accepted by the backend (an event reason).
    pub const DELETION_MAIL_SENT: &str = "DeletionMailSent";
    /// The ownerReference does not match the owner: its UID differs from the live owner's, or
    /// the owner's `spec.infrastructureRef` does not name this object. Nothing is mailed.
    pub const OWNER_MISMATCH: &str = "OwnerMismatch";
    /// The owner is being deleted: no request is started for infrastructure nobody will use.
    pub const OWNER_DELETING: &str = "OwnerDeleting";
    /// An annotation of this provider was found where this provider never writes it, and was
    /// removed (an event reason).
    pub const FOREIGN_RECORD: &str = "ForeignRecord";
    /// The mail went out; a human has not fulfilled the request yet.
    pub const WAITING_FOR_FULFILLMENT: &str = "WaitingForFulfillment";
    /// The request was fulfilled.
    pub const PROVISIONED: &str = "Provisioned";
    /// The object is being deleted.
    pub const DELETING: &str = "Deleting";
    /// The object violates a validation rule (it got past the CRD schema some other way).
    pub const INVALID_SPEC: &str = "InvalidSpec";
    /// `spec.identityRef` (the object's, or its Cluster's for a machine) names no
    /// `MailgunClusterIdentity`: no mail.
    pub const IDENTITY_NOT_FOUND: &str = "IdentityNotFound";
    /// The identity's `allowedNamespaces` does not allow the object's namespace: no mail.
    pub const IDENTITY_NOT_ALLOWED: &str = "IdentityNotAllowed";
    /// The identity cannot be used (a Secret or key missing, malformed or not claimed for it,
    /// an endpoint off the operator's allow-list, a bad field): no mail.
    pub const IDENTITY_INVALID: &str = "IdentityInvalid";
    /// The provider requires an `identityRef` (`--require-identity-ref`) and the object (or a
    /// machine's Cluster) names none: no mail.
    pub const IDENTITY_REQUIRED: &str = "IdentityRequired";
    /// Event: a release that could not go out for `--release-timeout` after the deletion was
    /// given up, so the deletion finishes; the note says why it could not go out.
    pub const RELEASE_ABANDONED: &str = "ReleaseAbandoned";
    /// A `MailgunRemediation` not believed (no live Machine of its name with its ownerReference's
    /// UID, a healthy Machine, a paused Cluster): nothing is mailed.
    pub const REMEDIATION_PENDING: &str = "Pending";
    /// A `MailgunRemediation`'s Machine was never built and its strategy says `Wait`.
    pub const WAITING_FOR_FULFILMENT: &str = "WaitingForFulfilment";
    /// A `MailgunRemediation` waits for a human's answer.
    pub const WAITING_FOR_ANSWER: &str = "WaitingForAnswer";
    /// A `MailgunRemediation` answered `Repaired` waits for the health check.
    pub const WAITING_FOR_REPAIR: &str = "WaitingForRepair";
    /// A timed hand-back waits while the MachineHealthCheck reports `RemediationAllowed=False`.
    pub const HAND_BACK_HELD: &str = "HandBackHeld";
    /// The Machine was handed back to its owner (an Event's reason too).
    pub const HANDED_BACK: &str = "HandedBack";
    /// The "no longer needed" mail of a `MailgunRemediation` was sent.
    pub const NO_LONGER_NEEDED: &str = "NoLongerNeeded";
    /// No answer yet (`Answered` False).
    pub const NOT_ANSWERED: &str = "NotAnswered";
}

/// The label that claims a Secret in the provider's namespace for one `MailgunClusterIdentity`
/// (its value: the identity's name); only Secrets claimed so (or owned by the identity) can be
/// named by that identity.
pub const IDENTITY_SECRET_LABEL: &str = "mailgun.infrastructure.cluster.x-k8s.io/identity";

/// The deterministic `Message-Id` for the request mail of one object: `<kind.uid@domain>`, with
/// the kind lower-cased.
///
/// Derived only from the object's UID (stable for its lifetime, new for a re-created object), so
/// every attempt for the same object carries the same id and receivers can de-duplicate.
///
/// ```no_run
/// let id = capm_api::names::message_id("MailgunCluster", "0d1e2f", "mg.example.com");
/// assert_eq!(id, "<mailguncluster.0d1e2f@mg.example.com>");
/// ```
pub fn message_id(kind: &str, uid: &str, domain: &str) -> String {
    format!("<{}.{uid}@{domain}>", kind.to_ascii_lowercase())
}

/// The deterministic `Message-Id` of the "no longer needed" mail of one object:
/// `<kind-deleted.uid@domain>`. Distinct from [`message_id`], so receivers never fold the two.
pub fn deletion_message_id(kind: &str, uid: &str, domain: &str) -> String {
    format!("<{}-deleted.{uid}@{domain}>", kind.to_ascii_lowercase())
}

/// The deterministic `Message-Id` of reminder `n` of one object's request (a remediation's repair
/// mail): `<kind-reminder-n.uid@domain>`. Distinct from [`message_id`] and from every other
/// reminder's, so each is a mail of its own that receivers can de-duplicate.
pub fn reminder_message_id(kind: &str, n: u8, uid: &str, domain: &str) -> String {
    format!(
        "<{}-reminder-{n}.{uid}@{domain}>",
        kind.to_ascii_lowercase()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn annotation_keys_share_the_prefix() {
        for key in [
            MAIL_ANNOTATION,
            REMINDER_MAIL_ANNOTATIONS[0],
            REMINDER_MAIL_ANNOTATIONS[1],
            REMINDER_MAIL_ANNOTATIONS[2],
            DELETION_MAIL_ANNOTATION,
            MAIL_INTENT_ANNOTATION,
            MAIL_SENT_ANNOTATION,
            DELETION_MAIL_INTENT_ANNOTATION,
            DELETION_MAIL_SENT_ANNOTATION,
            CONVERSION_DATA_ANNOTATION,
        ] {
            assert_eq!(key.split_once('/').map(|(p, _)| p), Some(ANNOTATION_PREFIX));
        }
    }

    #[test]
    fn message_id_is_deterministic() {
        assert_eq!(
            message_id("MailgunMachine", "u-1", "d.example"),
            "<mailgunmachine.u-1@d.example>"
        );
    }
}
