//! Reconcilers that wire the `capm-api` types to a `capm-mailer` backend.
//!
//! What it is for: the `MailgunCluster` and `MailgunMachine` controllers (the Cluster API
//! infrastructure-provider contract: owner, pause, finalizer, `reconcile_normal` /
//! `reconcile_delete`), the crash-safe "send exactly one mail" recipe, conditions, events and
//! the controller-runtime-compatible metrics. [`run`] is the whole of it.
//!
//! What it is not for: configuration parsing, leader election, HTTP serving and process
//! lifecycle live in the `cluster-api-provider-mailgun` binary (`cmd/`).

//!
//! The modules, each importing only those listed before it (`make lint` checks it):
//! - how objects are kept: `compact` (short keys, deflated bodies, the Cluster API caches);
//! - what the provider reads and how it reports: [`capi`] (Cluster API's objects), `kinds` (what
//!   differs between our two kinds), `status`, `events`, `workqueue` (controller-runtime's queue
//!   series for kube-runtime's scheduler), [`Metrics`], [`Config`];
//! - process state: [`Leadership`] (may this replica act), `memory` (per-object memory, by UID),
//!   `poller` (delivery questions), `identity` (the tenants' mail backends), `context` (what every
//!   reconcile shares);
//! - the work: [`sendonce`] (one mail, crash-safely), `delivery`, `reconcile` (one pass, in Cluster
//!   API's step order);
//! - the wiring: `pipeline` (watch → cache → triggers → controller, one per kind): [`run`].

pub mod capi;
pub mod compact;
mod config;
mod context;
mod delivery;
mod events;
pub mod failpoint;
mod identity;
mod kinds;
mod leadership;
mod memory;
mod metrics;
mod pipeline;
mod poller;
mod reconcile;
pub mod sendonce;
mod status;
mod workqueue;

pub use config::{Config, Error, Field, Invalid, Reason};
pub use leadership::Leadership;
pub use metrics::Metrics;
pub use pipeline::{packed, run, trim};
