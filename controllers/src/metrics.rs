//! Controller metrics under the names controller-runtime uses, so existing dashboards work.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

use crate::workqueue::Workqueue;

/// Reconcile-time buckets (seconds), as controller-runtime's.
const RECONCILE_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9,
    1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 15.0, 20.0,
    25.0, 30.0, 40.0, 50.0, 60.0,
];

/// The controllers' metrics, registered once per process.
///
/// - `controller_runtime_reconcile_total{controller, result}` (`success`, `error`, `requeue`,
///   `requeue_after`)
/// - `controller_runtime_reconcile_errors_total{controller}`
/// - `controller_runtime_reconcile_time_seconds{controller}`
/// - `controller_runtime_active_workers{controller}`
/// - `controller_runtime_max_concurrent_reconciles{controller}`
/// - `workqueue_retries_total{name}`: requeues after an error, as controller-runtime counts them
/// - `workqueue_depth`, `workqueue_adds_total`, `workqueue_queue_duration_seconds`,
///   `workqueue_work_duration_seconds`, `workqueue_unfinished_work_seconds`,
///   `workqueue_longest_running_processor_seconds` (all `{name}`): kube-runtime's scheduler
///   measured at its edges (what each means here: the `workqueue` module).
/// - `capm_reconcile_triggers_total{name}`: every request for a reconcile (watch events, Cluster
///   API objects' changes, a completed list's, the sync period's, the delivery poller's), including
///   those kube-runtime's scheduler folds into one already waiting (`workqueue_adds_total` does not
///   count those).
/// - `capm_watch_lists_total{name}`: completed lists of the kind's watch: the first, and one
///   per re-list (a watch that could not resume: `410 Gone`, a restarted API server).
/// - `capm_mail_resends_total{controller}`: mails sent again with the same Message-Id because
///   an earlier attempt's outcome could not be established.
/// - `capm_mail_withheld_total{controller, reason}`: sends not started (`not_leading`,
///   `owner_deleting`, `permanently_refused`, `backoff`, `handover`).
/// - `capm_mail_delivery_total{backend, identity, outcome}`: what became of request mails after the
///   backend accepted them, counted when the object's status first shows it: `delivered`,
///   `partly_delivered` (some recipients have it, the backend gave up on others), `failed` (for
///   good), `delayed` (a temporary failure; the backend retries), `unknown` (the
///   backend's events expired first), `not_trackable` (the backend cannot tell: SMTP).
/// - `capm_mail_orphan_releases_total{controller}`: release mails sent at once for an object that
///   vanished right after its request went out.
/// - `capm_mail_abandoned_total{backend}`: sends dropped before their commit point because this
///   process could no longer prove it leads (frozen or cut off mid-send); the backend accepted
///   nothing, and the replica that leads sends instead.
/// - `capm_remembered_objects{state}`: the per-object ledger's size: `live` objects remembered
///   (retry delays, expected versions, mails' lookup state), `tombstone` UIDs of gone objects
///   kept for ten minutes so stale copies are ignored. Both fall back when objects go: a `live`
///   count that only grows is a leak.
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
        Ok(Self {
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
