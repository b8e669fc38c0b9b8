//! Reconcilers that wire the `capm-api` types to a `capm-mailer` backend.
//!
//! What it is for: the `MailgunCluster` and `MailgunMachine` controllers (the Cluster API
//! infrastructure-provider contract: owner, pause, finalizer, `reconcile_normal` /
//! `reconcile_delete`), the crash-safe "send exactly one mail" recipe, conditions, events and
//! the controller-runtime-compatible metrics. [`run`] is the whole of it.
//!
//! What it is not for: configuration parsing, leader election, HTTP serving and process
//! lifecycle live in the `cluster-api-provider-mailgun` binary (`cmd/`).

mod cache;
pub mod capi;
mod config;
mod context;
mod delivery;
mod events;
pub mod failpoint;
mod kinds;
mod leadership;
mod metrics;
mod poller;
mod reconcile;
mod runner;
pub mod sendonce;
mod status;
mod statuses;

pub use config::{Config, Error};
pub use leadership::Leadership;
pub use metrics::Metrics;
pub use runner::run;
pub use statuses::{StatusCache, cache_mailgun_cluster};
