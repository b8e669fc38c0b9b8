//! The SMTP backend (lettre's SMTP client on Tokio over our own pooled sockets, rustls with the
//! ring provider).

mod pool;

use std::{fmt, sync::Arc, time::Duration};

use async_trait::async_trait;
use lettre::{
    message::header::{ContentType, HeaderName, HeaderValue},
    transport::smtp::{
        authentication::{Credentials, Mechanism},
        client::{Certificate, CertificateStore, TlsParameters},
        extension::ClientId,
    },
};
use rustls::pki_types::{CertificateDer, ServerName, pem::PemObject};

use crate::{
    ExposeSecret, Lookup, MailError, Mailer, Message, MessageId, SendReceipt,
    config::{ConfigError, SmtpConfig, SmtpEndpoint, Starttls},
};

const BACKEND: &str = "smtp";

/// Sends through an SMTP relay: plain, STARTTLS or implicit TLS, optional AUTH PLAIN/LOGIN,
/// pooled connections.
///
/// The `Message-ID` header is the caller's id. Tags go out as one `X-Mailgun-Tag` header each,
/// variables as one `X-Mailgun-Variables` JSON header (what Mailgun's relay understands).
///
/// # Error classification
/// | what happened | [`ErrorKind`](crate::ErrorKind) |
/// |---|---|
/// | 4xx reply | `Retryable` |
/// | 5xx reply (including 535 authentication failed) | `Permanent` |
/// | connect, TLS, STARTTLS or AUTH failed without a 5xx reply (nothing sent yet) | `Retryable` |
/// | connection lost, unreadable reply or no reply within `timeoutSeconds` after `MAIL FROM` | `UnknownOutcome` |
///
/// [`Mailer::lookup`] always answers [`Lookup::Unsupported`]: SMTP has no way to ask.
///
/// Sockets are opened here with `TCP_NODELAY` (lettre's own transport leaves Nagle on, which
/// costs ~40 ms a message against a peer with delayed ACKs); lettre speaks the protocol over
/// them. See `smtp/pool.rs`.
pub struct SmtpMailer {
    pool: Arc<pool::Pool>,
    endpoint: SmtpEndpoint,
    gate: crate::gate::Gate,
}

pub use pool::{MAX_REPLY_BYTES, MAX_REPLY_LINE_BYTES};

impl fmt::Debug for SmtpMailer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SmtpMailer")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

fn ca_error(reason: String) -> ConfigError {
    ConfigError::CaFile {
        field: "smtp.caFile".into(),
        reason,
    }
}

fn ca_path(config: &SmtpConfig) -> String {
    if config.ca_pem.is_some() {
        return "the CA bundle given".to_owned();
    }
    config
        .ca_file
        .as_ref()
        .map(|p| p.display().to_string())
        .unwrap_or_default()
}

/// The PEM of `smtp.caFile`, checked to hold a certificate.
fn read_ca_file(config: &SmtpConfig) -> Result<Option<Vec<u8>>, ConfigError> {
    if let Some(pem) = &config.ca_pem {
        if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
            return Err(ca_error(
                "the CA bundle given: no PEM certificate found".into(),
            ));
        }
        return Ok(Some(pem.clone()));
    }
    let Some(path) = &config.ca_file else {
        return Ok(None);
    };
    let pem =
        std::fs::read(path).map_err(|e| ca_error(format!("reading {}: {e}", path.display())))?;
    if !pem.windows(27).any(|w| w == b"-----BEGIN CERTIFICATE-----") {
        return Err(ca_error(format!(
            "{}: no PEM certificate found",
            path.display()
        )));
    }
    Ok(Some(pem))
}

/// lettre's TLS parameters, for STARTTLS.
fn tls_parameters(
    config: &SmtpConfig,
    ca: Option<&[u8]>,
    host: &str,
) -> Result<TlsParameters, ConfigError> {
    let mut builder = TlsParameters::builder(host.to_owned());
    if let Some(pem) = ca {
        let cert = Certificate::from_pem(pem)
            .map_err(|e| ca_error(format!("{}: {e}", ca_path(config))))?;
        builder = builder
            .certificate_store(CertificateStore::None)
            .add_root_certificate(cert);
    }
    builder.build_rustls().map_err(|e| ConfigError::Client {
        backend: BACKEND,
        source: Box::new(e),
    })
}

/// The same trust as [`tls_parameters`] as a rustls config, for implicit TLS (which lettre's
/// connection cannot set up over a socket it did not open).
fn implicit_tls_config(
    config: &SmtpConfig,
    ca: Option<&[u8]>,
) -> Result<rustls::ClientConfig, ConfigError> {
    let client_error = |e: rustls::Error| ConfigError::Client {
        backend: BACKEND,
        source: Box::new(e),
    };
    let Some(pem) = ca else {
        return crate::tls::platform_client_config().map_err(client_error);
    };
    let path = ca_path(config);
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem) {
        let cert = cert.map_err(|e| ca_error(format!("{path}: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| ca_error(format!("{path}: {e}")))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    Ok(rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(client_error)?
        .with_root_certificates(roots)
        .with_no_client_auth())
}

impl SmtpMailer {
    /// Validates `config`, reads the password and CA file, and sets up the connection pool.
    /// Nothing connects until the first send.
    ///
    /// # Errors
    /// [`ConfigError`] naming the bad field, an unreadable secret or CA file, or a TLS set-up
    /// failure.
    ///
    /// # Panics
    /// The pool starts a background task: call this inside a Tokio runtime.
    pub fn new(config: &SmtpConfig) -> Result<Self, ConfigError> {
        let endpoint = config.endpoint()?;
        let ca = read_ca_file(config)?;
        let security = if endpoint.implicit_tls {
            let name =
                ServerName::try_from(endpoint.host.clone()).map_err(|e| ConfigError::Client {
                    backend: BACKEND,
                    source: Box::new(e),
                })?;
            pool::Security::Implicit {
                connector: tokio_rustls::TlsConnector::from(Arc::new(implicit_tls_config(
                    config,
                    ca.as_deref(),
                )?)),
                name,
            }
        } else {
            match config.starttls.unwrap_or_default() {
                Starttls::Never => pool::Security::None,
                starttls => pool::Security::Starttls {
                    params: tls_parameters(config, ca.as_deref(), &endpoint.host)?,
                    required: starttls == Starttls::Required,
                },
            }
        };
        let auth = match (&config.username, &config.password) {
            (Some(user), Some(password)) => {
                let password = password.read().map_err(|source| ConfigError::Secret {
                    field: "smtp.password".into(),
                    source,
                })?;
                Some((
                    Credentials::new(user.clone(), password.expose_secret().to_owned()),
                    vec![Mechanism::Plain, Mechanism::Login],
                ))
            }
            _ => None,
        };
        let connector = pool::Connector {
            host: endpoint.host.clone(),
            port: endpoint.port,
            security,
            timeout: Duration::from_secs_f64(config.timeout_seconds),
            hello: config
                .hello_name
                .clone()
                .map_or_else(ClientId::default, ClientId::Domain),
            auth,
        };
        // No idle connection kept: each message gets its own, closed after use.
        let max_idle = if config.pool.enabled {
            usize::try_from(config.pool.max_size).unwrap_or(usize::MAX)
        } else {
            0
        };
        let pool = pool::Pool::new(
            connector,
            max_idle,
            Duration::from_secs_f64(config.pool.idle_timeout_seconds),
        );
        Ok(Self {
            pool,
            endpoint,
            gate: crate::gate::open(),
        })
    }

    /// The same mailer, asking `gate` right before each send's commit point (the end-of-data
    /// line).
    #[must_use]
    pub fn with_commit_gate(mut self, gate: Arc<dyn crate::CommitGate>) -> Self {
        self.gate = gate;
        self
    }

    /// The message as sent on the wire, and its envelope.
    fn render(message: &Message) -> Result<(lettre::address::Envelope, Vec<u8>), MailError> {
        let mut builder = lettre::Message::builder()
            .from(message.from().clone())
            .subject(message.subject())
            .message_id(Some(message.message_id().to_string()))
            .header(ContentType::TEXT_PLAIN);
        for to in message.to() {
            builder = builder.to(to.clone());
        }
        if let Some(reply_to) = message.reply_to() {
            builder = builder.reply_to(reply_to.clone());
        }
        if let Some(first) = message.in_reply_to() {
            builder = builder
                .in_reply_to(first.to_string())
                .references(first.to_string());
        }
        if !message.variables().is_empty() {
            let json =
                serde_json::to_string(message.variables()).map_err(|e| MailError::Permanent {
                    backend: BACKEND,
                    code: None,
                    message: format!("encoding variables: {e}"),
                })?;
            builder = builder.raw_header(HeaderValue::new(
                HeaderName::new_from_ascii_str("X-Mailgun-Variables"),
                json,
            ));
        }
        let email = builder
            .body(message.text().to_owned())
            .map_err(|e| MailError::Permanent {
                backend: BACKEND,
                code: None,
                message: format!("building the message: {e}"),
            })?;
        // lettre keeps one header per name; tags need one each. They are validated printable
        // ASCII of at most 128 bytes, so each is one safe header line.
        let mut raw = Vec::new();
        for tag in message.tags() {
            raw.extend_from_slice(format!("X-Mailgun-Tag: {tag}\r\n").as_bytes());
        }
        raw.extend_from_slice(&email.formatted());
        Ok((email.envelope().clone(), raw))
    }
}

/// How much of a relay's reply ends up in an error message or receipt.
const MAX_ERROR_TEXT: usize = 300;

fn classify(err: lettre::transport::smtp::Error) -> MailError {
    let code = err.status().map(u16::from);
    // The relay's reply text, as a human will read it in conditions and Events.
    let message = crate::text::clean(&err.to_string(), MAX_ERROR_TEXT);
    // lettre has no public accessor for its "Connection" kind; its Display is stable and the
    // integration test with a stopped server pins it.
    let before_sending = message.starts_with("Connection error") || err.is_tls() || err.is_client();
    if err.is_permanent() {
        MailError::Permanent {
            backend: BACKEND,
            code,
            message,
        }
    } else if err.is_transient() || before_sending {
        MailError::Retryable {
            backend: BACKEND,
            code,
            retry_after: None,
            message,
            source: Some(Box::new(err)),
        }
    } else {
        MailError::UnknownOutcome {
            backend: BACKEND,
            code,
            message,
            source: Some(Box::new(err)),
        }
    }
}

#[async_trait]
impl Mailer for SmtpMailer {
    fn backend(&self) -> &'static str {
        BACKEND
    }

    async fn send(&self, message: &Message) -> Result<SendReceipt, MailError> {
        let (envelope, raw) = Self::render(message)?;
        let response = self.pool.send(&envelope, &raw, &self.gate).await?;
        Ok(SendReceipt {
            message_id: message.message_id().to_string(),
            response: crate::text::clean(
                &format!(
                    "{} {}",
                    u16::from(response.code()),
                    response.message().collect::<Vec<_>>().join(" ")
                ),
                MAX_ERROR_TEXT,
            ),
        })
    }

    async fn lookup(&self, _message_id: &MessageId) -> Result<Lookup, MailError> {
        Ok(Lookup::Unsupported)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rendered_message_has_our_headers_once() {
        let m = Message::builder()
            .from("Dev <dev@example.com>")
            .to("ops@example.com")
            .subject("Hello")
            .text("line 1\nline 2")
            .message_id("<id-1@capm.test>")
            .tag("a")
            .tag("b")
            .variable("cluster", "default/demo")
            .build()
            .unwrap();
        let (envelope, raw) = SmtpMailer::render(&m).unwrap();
        let text = String::from_utf8(raw).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.contains("Message-ID: <id-1@capm.test>\r\n"), "{head}");
        assert!(
            head.contains("X-Mailgun-Tag: a\r\nX-Mailgun-Tag: b\r\n"),
            "{head}"
        );
        assert!(
            head.contains(r#"X-Mailgun-Variables: {"cluster":"default/demo"}"#),
            "{head}"
        );
        assert_eq!(body, "line 1\r\nline 2");
        assert_eq!(envelope.to().len(), 1);
    }

    #[test]
    fn a_follow_up_names_the_first_mail_in_in_reply_to_and_references() {
        let m = Message::builder()
            .from("capm@example.com")
            .to("ops@example.com")
            .subject("Re: Machine m-0 needs repair")
            .text("Still unhealthy.")
            .message_id("<reminder-1@capm.test>")
            .in_reply_to("<repair@capm.test>")
            .build()
            .unwrap();
        let (_, raw) = SmtpMailer::render(&m).unwrap();
        let text = String::from_utf8(raw).unwrap();
        let (head, _) = text.split_once("\r\n\r\n").unwrap();
        assert!(
            head.contains("In-Reply-To: <repair@capm.test>\r\n"),
            "{head}"
        );
        assert!(
            head.contains("References: <repair@capm.test>\r\n"),
            "{head}"
        );
        assert_eq!(head.matches("In-Reply-To:").count(), 1, "{head}");
    }

    #[test]
    fn a_missing_ca_file_names_the_field() {
        let mut c = SmtpConfig::new("smtps://127.0.0.1:1");
        c.ca_file = Some("/nonexistent/ca.pem".into());
        let err = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(async { SmtpMailer::new(&c).unwrap_err() });
        assert!(err.to_string().starts_with("smtp.caFile: reading"), "{err}");
    }
}
