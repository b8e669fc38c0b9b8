//! Real mail servers for tests, benchmarks and the demo.
//!
//! What it is for:
//! - [`contract`]: a Mailgun API contract server (the `mailgun-contract-server` binary) that
//!   checks auth, domain and form fields like Mailgun documents, keeps messages in memory, answers
//!   the events API (accepted, delivered and failed events, paged), and fails on request (401, 429 + `Retry-After`, 500, 500 after accepting,
//!   hanging) or answers late.
//! - `smtp_server.py` (aiosmtpd; `pip install -r requirements.txt`): plain, STARTTLS and implicit
//!   TLS, AUTH PLAIN/LOGIN, 4xx/5xx on request, a slow DATA reply, storing and then never
//!   answering, never greeting; each message stored as an `.eml` file.
//! - [`MailgunServer`] and [`SmtpServer`]: start them as child processes on free loopback ports,
//!   wait until they listen, read back what they received, stop them on drop. A child also exits
//!   when its standard input closes, so a killed test never leaves one behind.
//!
//! What it is not for: production, or imitating Mailgun beyond the documented contract the
//! mailer relies on (no webhooks, no event filter expressions, no real delivery: tests say what became of a message).

pub mod contract;
pub mod pki;
mod process;

pub use contract::{
    DelayRule, DeliveryEvent, EventRule, FailureMode, FailureRule, FailureTarget, PagingRule,
    Stats, StoredMessage,
};
pub use pki::{PkiError, TestPki};
pub use process::{
    Error, MailgunServer, ReceivedMail, SmtpOptions, SmtpServer, SmtpTls, contract_server_binary,
};
