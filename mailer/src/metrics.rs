//! Prometheus metrics for any [`Mailer`], as a decorator.

use std::{sync::Arc, time::Instant};

use async_trait::async_trait;
use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry};

use crate::{Lookup, MailError, Mailer, Message, MessageId, SendReceipt};

/// Buckets for send durations: a loopback relay answers in milliseconds, a slow API in seconds.
const DURATION_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The mailer's metrics, registered once into a caller-given registry.
///
/// - `mailer_messages_total{backend, identity, outcome}`: sends (`identity`: empty for the
///   process's own backend, else the tenant's, see [`Mailer::wrap_like_me`]), by `outcome` = `sent`, `permanent`,
///   `retryable` or `unknown_outcome`.
/// - `mailer_send_duration_seconds{backend}`: time per send, whatever the outcome.
/// - `mailer_lookups_total{backend, identity, result}`: lookups, by `result` = `accepted`, `not_found`,
///   `unsupported` or an error label.
#[derive(Debug, Clone)]
pub struct MailerMetrics {
    messages: IntCounterVec,
    send_duration: HistogramVec,
    lookups: IntCounterVec,
}

impl MailerMetrics {
    /// Creates the metrics and registers them.
    ///
    /// # Errors
    /// [`prometheus::Error`] when they are already registered in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let messages = IntCounterVec::new(
            Opts::new(
                "mailer_messages_total",
                "Messages handed to the mail backend, by outcome",
            ),
            &["backend", "identity", "outcome"],
        )?;
        let send_duration = HistogramVec::new(
            HistogramOpts::new(
                "mailer_send_duration_seconds",
                "Time to send one message, whatever the outcome",
            )
            .buckets(DURATION_BUCKETS.to_vec()),
            &["backend"],
        )?;
        let lookups = IntCounterVec::new(
            Opts::new(
                "mailer_lookups_total",
                "Message-Id lookups at the mail backend, by result",
            ),
            &["backend", "identity", "result"],
        )?;
        registry.register(Box::new(messages.clone()))?;
        registry.register(Box::new(send_duration.clone()))?;
        registry.register(Box::new(lookups.clone()))?;
        Ok(Self {
            messages,
            send_duration,
            lookups,
        })
    }
}

/// Wraps a [`Mailer`] and records [`MailerMetrics`] for every call.
#[derive(Clone)]
pub struct InstrumentedMailer {
    inner: Arc<dyn Mailer>,
    metrics: MailerMetrics,
    /// The `identity` label: empty for the process's own backend, a tenant's name otherwise
    /// (bounded by the number of tenants).
    identity: String,
}

impl std::fmt::Debug for InstrumentedMailer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InstrumentedMailer")
            .field("backend", &self.inner.backend())
            .finish_non_exhaustive()
    }
}

impl InstrumentedMailer {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn Mailer>, metrics: MailerMetrics) -> Self {
        Self {
            inner,
            metrics,
            identity: String::new(),
        }
    }
}

#[async_trait]
impl Mailer for InstrumentedMailer {
    fn backend(&self) -> &'static str {
        self.inner.backend()
    }

    fn tracking(&self) -> crate::Tracking {
        self.inner.tracking()
    }

    fn wrap_like_me(&self, sibling: Arc<dyn Mailer>, identity: &str) -> Arc<dyn Mailer> {
        Arc::new(Self {
            inner: sibling,
            metrics: self.metrics.clone(),
            identity: identity.to_owned(),
        })
    }

    async fn send(&self, message: &Message) -> Result<SendReceipt, MailError> {
        let backend = self.inner.backend();
        let start = Instant::now();
        let result = self.inner.send(message).await;
        self.metrics
            .send_duration
            .with_label_values(&[backend])
            .observe(start.elapsed().as_secs_f64());
        let outcome = match &result {
            Ok(_) => "sent",
            Err(e) => e.metric_label(),
        };
        self.metrics
            .messages
            .with_label_values(&[backend, &self.identity, outcome])
            .inc();
        result
    }

    async fn lookup(&self, message_id: &MessageId) -> Result<Lookup, MailError> {
        let result = self.inner.lookup(message_id).await;
        let label = match &result {
            Ok(Lookup::Accepted { .. }) => "accepted",
            Ok(Lookup::NotFound) => "not_found",
            Ok(Lookup::Unsupported) => "unsupported",
            Err(e) => e.metric_label(),
        };
        self.metrics
            .lookups
            .with_label_values(&[self.inner.backend(), &self.identity, label])
            .inc();
        result
    }

    fn delivery_batch_size(&self) -> usize {
        self.inner.delivery_batch_size()
    }

    async fn delivery_statuses(
        &self,
        mails: &[crate::OpenMail],
    ) -> Result<Vec<crate::Delivery>, MailError> {
        self.inner.delivery_statuses(mails).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MockMailer;

    fn message() -> Message {
        Message::builder()
            .from("a@example.com")
            .to("b@example.com")
            .text("hi")
            .message_id("<m1@capm.test>")
            .build()
            .unwrap()
    }

    #[tokio::test]
    async fn records_outcomes_and_passes_results_through() {
        let mut mock = MockMailer::new();
        mock.expect_backend().return_const("mock");
        let mut calls = 0;
        mock.expect_send().times(2).returning(move |m| {
            calls += 1;
            if calls == 1 {
                Ok(SendReceipt {
                    message_id: m.message_id().to_string(),
                    response: "ok".into(),
                })
            } else {
                Err(MailError::UnknownOutcome {
                    backend: "mock",
                    code: Some(500),
                    message: "boom".into(),
                    source: None,
                })
            }
        });
        mock.expect_lookup().returning(|_| Ok(Lookup::NotFound));
        let registry = Registry::new();
        let metrics = MailerMetrics::register(&registry).unwrap();
        let mailer: Arc<dyn Mailer> = Arc::new(InstrumentedMailer::new(Arc::new(mock), metrics));
        let m = message();
        assert_eq!(mailer.send(&m).await.unwrap().message_id, "<m1@capm.test>");
        assert_eq!(mailer.send(&m).await.unwrap_err().code(), Some(500));
        assert_eq!(
            mailer.lookup(m.message_id()).await.unwrap(),
            Lookup::NotFound
        );

        let families = registry.gather();
        let find = |name: &str| families.iter().find(|f| f.name() == name).unwrap();
        let counts: Vec<(String, u64)> = find("mailer_messages_total")
            .get_metric()
            .iter()
            .map(|m| {
                let outcome = m
                    .get_label()
                    .iter()
                    .find(|l| l.name() == "outcome")
                    .unwrap()
                    .value()
                    .to_owned();
                (outcome, m.get_counter().get_value() as u64)
            })
            .collect();
        assert!(counts.contains(&("sent".into(), 1)), "{counts:?}");
        assert!(
            counts.contains(&("unknown_outcome".into(), 1)),
            "{counts:?}"
        );
        let hist = &find("mailer_send_duration_seconds").get_metric()[0];
        assert_eq!(hist.get_histogram().get_sample_count(), 2);
        assert_eq!(find("mailer_lookups_total").get_metric().len(), 1);
        assert!(MailerMetrics::register(&registry).is_err());
    }
}
