//! Reconcilers that wire the `capm-api` types to a `capm-mailer` backend.
//!
//! **Placeholder.** Nothing is reconciled yet: the reconcilers arrive with the controllers issue.
