//! Controller metrics under the names controller-runtime uses, so existing dashboards work.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use crate::workqueue::Workqueue;

/// Reconcile-time buckets (seconds), as controller-runtime's.
const RECONCILE_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9,
    1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 15.0, 20.0,
    25.0, 30.0, 40.0, 50.0, 60.0,
];

/// The controllers' metrics, registered once per process; each series and its labels:
/// docs/observability.md, "The provider's own series".
#[derive(Debug, Clone)]
pub struct Metrics {
    pub(crate) reconcile_total: IntCounterVec,
    pub(crate) reconcile_errors: IntCounterVec,
    pub(crate) reconcile_time: HistogramVec,
    pub(crate) active_workers: IntGaugeVec,
    pub(crate) max_concurrent: IntGaugeVec,
    pub(crate) triggers: IntCounterVec,
    pub(crate) queue_retries: IntCounterVec,
    pub(crate) lists: IntCounterVec,
    pub(crate) resends: IntCounterVec,
    pub(crate) withheld: IntCounterVec,
    pub(crate) orphan_releases: IntCounterVec,
    pub(crate) delivery: IntCounterVec,
    pub(crate) abandoned: IntCounterVec,
    pub(crate) releases_abandoned: IntCounterVec,
    pub(crate) remembered: IntGaugeVec,
    pub(crate) workqueue: Workqueue,
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    ///
    /// # Errors
    /// When a metric of the same name is already registered.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let counter =
            |name: &str, help: &str, labels: &[&str]| -> Result<IntCounterVec, prometheus::Error> {
                let c = IntCounterVec::new(Opts::new(name, help), labels)?;
                registry.register(Box::new(c.clone()))?;
                Ok(c)
            };
        let gauge = |name: &str, help: &str| -> Result<IntGaugeVec, prometheus::Error> {
            let g = IntGaugeVec::new(Opts::new(name, help), &["controller"])?;
            registry.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let reconcile_time = HistogramVec::new(
            HistogramOpts::new(
                "controller_runtime_reconcile_time_seconds",
                "Length of time per reconciliation per controller",
            )
            .buckets(RECONCILE_BUCKETS.to_vec()),
            &["controller"],
        )?;
        registry.register(Box::new(reconcile_time.clone()))?;
        let remembered = IntGaugeVec::new(
            Opts::new(
                "capm_remembered_objects",
                "Objects in the per-object ledger (live) and UIDs of gone objects kept to ignore stale copies (tombstone)",
            ),
            &["state"],
        )?;
        registry.register(Box::new(remembered.clone()))?;
        let releases_abandoned = counter(
            "capm_release_abandoned_total",
            "Release mails given up after --release-timeout because their identity could not be used (identity) or their backend kept failing (mail); the deletion went on without them",
            &["reason"],
        )?;
        // Both series exist from the start, so an alert on their increase sees the first one.
        for reason in ["identity", "mail"] {
            releases_abandoned.with_label_values(&[reason]);
        }
        Ok(Self {
            releases_abandoned,
            remembered,
            workqueue: Workqueue::register(registry)?,
            reconcile_total: counter(
                "controller_runtime_reconcile_total",
                "Total number of reconciliations per controller",
                &["controller", "result"],
            )?,
            reconcile_errors: counter(
                "controller_runtime_reconcile_errors_total",
                "Total number of reconciliation errors per controller",
                &["controller"],
            )?,
            reconcile_time,
            active_workers: gauge(
                "controller_runtime_active_workers",
                "Number of currently used workers per controller",
            )?,
            max_concurrent: gauge(
                "controller_runtime_max_concurrent_reconciles",
                "Maximum number of concurrent reconciles per controller",
            )?,
            triggers: counter(
                "capm_reconcile_triggers_total",
                "Requests for a reconcile (watch events, Cluster API objects' changes, lists, the sync period, delivery wake-ups), including those folded into one already waiting (workqueue_adds_total does not count those)",
                &["name"],
            )?,
            queue_retries: counter(
                "workqueue_retries_total",
                "Total number of retries handled by workqueue",
                &["name"],
            )?,
            lists: counter(
                "capm_watch_lists_total",
                "Completed lists of the kind's watch: the first, and each re-list after a watch could not resume",
                &["name"],
            )?,
            resends: counter(
                "capm_mail_resends_total",
                "Mails sent again with the same Message-Id because an earlier attempt's outcome was unknown",
                &["controller"],
            )?,
            withheld: counter(
                "capm_mail_withheld_total",
                "Sends not started: not leading, owner deleting, refused for good, backoff, another replica's hand-over window",
                &["controller", "reason"],
            )?,
            orphan_releases: counter(
                "capm_mail_orphan_releases_total",
                "Release mails sent at once because the object vanished right after its request went out",
                &["controller"],
            )?,
            abandoned: counter(
                "capm_mail_abandoned_total",
                "Sends dropped before their commit point because this process could no longer prove it leads",
                &["backend"],
            )?,
            delivery: counter(
                "capm_mail_delivery_total",
                "What became of request mails after the backend accepted them (delivered, partly_delivered, failed, delayed, unknown, not_trackable), by backend and mail identity (empty: the provider's own)",
                &["backend", "identity", "outcome"],
            )?,
        })
    }
}
