//! Sends the provider's request mails. Knows nothing about Kubernetes.
//!
//! **Placeholder.** The `Mailer` trait and its backends arrive with the mailer issue.
