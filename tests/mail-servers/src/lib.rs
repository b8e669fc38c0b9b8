//! Real mail servers for tests, benchmarks and the demo, and the hostile peers of the
//! provider's network bounds.
//!
//! What it is for:
//! - [`contract`]: a Mailgun API contract server (the `mailgun-contract-server` binary) that
//!   checks auth, domain and form fields like Mailgun documents, keeps messages in memory, answers
//!   the events and Logs APIs (accepted, delivered and failed events, paged), and fails on request (401,
//!   429 + `Retry-After`, 500, 500 after accepting, hanging) or answers late; and plays a
//!   hostile Mailgun on request (replies of a gigabyte or without end, [`CONTROL_TEXT`] in
//!   errors and events, bodies that are not JSON, drips, replies cut by a TCP reset), generated
//!   while sent so its own memory stays small.
//! - `smtp_server.py` (aiosmtpd; `pip install -r requirements.txt`): plain, STARTTLS and implicit
//!   TLS, AUTH PLAIN/LOGIN, 4xx/5xx on request, a slow DATA reply, storing and then never
//!   answering, never greeting; each message stored as an `.eml` file.
//! - [`hostile_smtp`]: a hostile SMTP relay (the `hostile-smtp-relay` binary) in front of a real
//!   server: endless greetings and replies, [`SMTP_CONTROL_TEXT`] in replies, a dripped
//!   greeting, a reply cut by a reset ([`RelayMode`]); it passes connections through to the
//!   real server once it behaves again.
//! - [`flood`]: a client that floods an HTTP(S) port (concurrent large bodies, idle
//!   connections) and reports what the server answered, all of it bounded in time.
//! - [`MailgunServer`], [`SmtpServer`] and [`HostileSmtpRelay`]: start them as child processes
//!   on free loopback ports, wait until they listen, control them, read back what they
//!   received, stop them on drop. A child also exits when its standard input closes, so a
//!   killed test never leaves one behind.
//!
//! What it is not for: production, or imitating Mailgun beyond the documented contract the
//! mailer relies on (no webhooks, no event filter expressions, no real delivery: tests say what
//! became of a message).

pub mod contract;
pub mod flood;
pub mod hostile_smtp;
pub mod pki;
mod process;

pub use contract::{
    CONTROL_TEXT, DEFAULT_DRIP_MS, DelayRule, DeliveryEvent, EventRule, FailureMode, FailureRule,
    FailureTarget, HOSTILE_BODY_BYTES, PagingRule, Stats, StoredMessage,
};
pub use flood::{
    ClientReport, FloodOutcome, FloodReport, IdleConnections, idle_connections,
    insecure_tls_connector, post_bodies, post_bodies_within, raise_nofile_limit,
};
pub use hostile_smtp::{RelayMode, RelayStats, SMTP_CONTROL_TEXT};
pub use pki::{PkiError, TestPki};
pub use process::{
    Error, HostileSmtpRelay, MailgunServer, ReceivedMail, SmtpOptions, SmtpServer, SmtpTls,
    contract_server_binary, hostile_smtp_relay_binary,
};
