//! API types of cluster-api-provider-mailgun: `MailgunCluster`, `MailgunMachine` and their
//! templates, in group `infrastructure.cluster.x-k8s.io`.
//!
//! What this crate is for:
//! - the served versions, one module each: [`v1alpha1`] (the Cluster API book walkthrough's
//!   shape, contract `v1beta1`) and [`v1beta1`] (the storage version, contract `v1beta2`);
//! - the names other crates share: annotation keys, finalizers, condition types and reasons
//!   ([`names`]), and the format of the provider's mail records in those annotations, with when
//!   one is believed ([`records`]);
//! - the same validation the CRD schema enforces, as Rust ([`validation`]), so a controller can
//!   report an invalid object that reached the cluster some other way (an older CRD, a restore);
//! - conversion between the versions ([`conversion`]: spec losslessly, status as far as
//!   `v1alpha1` can hold it) and a conversion webhook handler ([`webhook`]) that the manager
//!   binary serves, next to the admission webhook ([`admission`]) that holds writes made through
//!   `v1alpha1` to every `v1beta1` rule;
//! - the parts of Cluster API's own `Cluster` and `Machine` that the provider reads ([`capi`]);
//! - the fulfilment links' tokens, which the request mail carries and the manager's fulfilment
//!   page opens: their cryptography ([`link_token`]);
//! - the CustomResourceDefinitions themselves ([`crd`]), written to `config/crd/` by
//!   `cargo run -p capm-api --bin crdgen -- config/crd` and checked with `--check`.
//!
//! What it is not for: talking to a cluster or sending mail. It has no client code and no
//! runtime; the controllers crate does the reconciling, the mailer crate the sending.
//!
//! # Example
//! ```no_run
//! use capm_api::v1beta1::{MailgunCluster, MailgunClusterSpec, Priority};
//! use capm_api::validation::Validate;
//!
//! let cluster = MailgunCluster::new(
//!     "demo",
//!     MailgunClusterSpec {
//!         priority: Priority::Urgent,
//!         request: "Two control plane nodes, please.".into(),
//!         requester: "ops@example.com".into(),
//!         control_plane_endpoint: None,
//!         identity_ref: None,
//!     },
//! );
//! for error in cluster.validate() {
//!     eprintln!("{error}");
//! }
//! ```

pub mod admission;
pub mod capi;
pub mod conversion;
pub mod crd;
pub mod limits;
pub mod link_token;
pub mod names;
pub mod owner_remediated;
pub mod records;
pub mod v1alpha1;
pub mod v1beta1;
pub mod validation;
pub mod webhook;

/// The API group of every kind this provider serves.
pub const GROUP: &str = "infrastructure.cluster.x-k8s.io";

/// The storage version (and the one the controllers work with).
pub const STORAGE_VERSION: &str = "v1beta1";

/// Every served version, oldest first.
pub const VERSIONS: &[&str] = &["v1alpha1", "v1beta1"];
