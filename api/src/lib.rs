//! API types of cluster-api-provider-mailgun: `MailgunCluster`, `MailgunMachine` and their
//! templates, in group `infrastructure.cluster.x-k8s.io`.
//!
//! **Placeholder.** The versioned types, validation, conversion and CRD generation arrive with the
//! api issue; until then this crate only fixes the API group name.

/// The API group of every kind this provider serves.
pub const GROUP: &str = "infrastructure.cluster.x-k8s.io";
