//! Reconcilers that wire the `capm-api` types to a `capm-mailer` backend.
//!
//! What it is for: the `MailgunCluster` and `MailgunMachine` controllers (the Cluster API
//! infrastructure-provider contract: owner, pause, finalizer, `reconcile_normal` /
//! `reconcile_delete`), remediation by mail (`MailgunRemediation`), the crash-safe "send exactly one mail" recipe, conditions, events and
//! the controller-runtime-compatible metrics. [`run`] is the whole of it.
//!
//! What it is not for: configuration parsing, leader election, HTTP serving and process
//! lifecycle live in the `cluster-api-provider-mailgun` binary (`cmd/`).

//!
//! The modules in layers, lowest first: each imports only its own layer's and lower layers'
//! modules, with no circle (`make lint` checks it, `hack/module-cycles.py`):
//! - `failpoint`, `config`, `watch`, `status`, `events`, `metrics`: how the
//!   provider watches (paged lists, quick reconnects) and reports (conditions, Events, the
//!   `workqueue_*` series for kube-runtime's scheduler, [`Metrics`]), its [`Config`] and the
//!   operator's rules for tenants ([`Tenancy`]);
//! - `kinds`: what differs between our two kinds, and the stores the reconciles read;
//! - `sendonce`: the send-once protocol's decision, pure (its records: `capm_api::records`);
//! - `leadership`, `ledger`, `poller`, `identity`: process state:
//!   [`Leadership`] (may this replica act), the per-object ledger (all the process notes about
//!   an object, by UID, and the tombstones), the delivery questions, the tenants' mail backends;
//! - `context`: what every reconcile shares;
//! - `sendonce::execute` and `delivery`: the work: one mail, crash-safely; delivery news;
//! - `reconcile`, `remediation`: one pass, in Cluster API's step order; the remediation's
//!   decision, mails and pass;
//! - `pipeline`: watch → store → triggers → controller, one per kind: [`run`].

mod config;
mod context;
mod delivery;
mod events;
mod failpoint;
mod identity;
mod kinds;
mod leadership;
mod ledger;
mod metrics;
mod pipeline;
mod poller;
mod reconcile;
mod remediation;
mod sendonce;
mod status;
mod watch;

pub use config::{Config, DEFAULT_RELEASE_TIMEOUT, Error, Field, Invalid, Reason, Tenancy};
pub use leadership::Leadership;
pub use metrics::Metrics;
pub use pipeline::run;

// The manager's fulfilment page records its Events through the controllers' `Events`.
pub use events::{EventType, Events};

/// Locks `m`, also after a panic while it was held: every critical section here leaves its
/// data whole, and a reconcile's panic must not stop the process's other work.
fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}
