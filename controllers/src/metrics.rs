//! Controller metrics under the names controller-runtime uses, so existing dashboards work.
//!
//! The `workqueue_*` series measure kube-runtime's scheduler at its edges: what enters it (the
//! triggers of objects in the store, folded while one waits: [`Metrics::added`]) and what leaves
//! it (a reconcile starting, then ending: [`Reconciling`]). Which object waits since when is
//! noted in the object's memory ([`crate::ledger`]), not here. What kube-runtime does not show (a
//! requeue coming due, the scheduler's own folding): docs/kube-runtime-workqueue.md; what each
//! series means: docs/observability.md, "The work queue series".

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::Instant,
};

use prometheus::{
    GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry,
    core::{Collector, Desc},
    proto::MetricFamily,
};

/// Reconcile-time buckets (seconds), as controller-runtime's.
const RECONCILE_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9,
    1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 15.0, 20.0,
    25.0, 30.0, 40.0, 50.0, 60.0,
];

/// The queue and work duration buckets, as controller-runtime's: 10 ns to 1000 s, by tens.
fn duration_buckets() -> Vec<f64> {
    (0..12).map(|i| 1e-8 * 10f64.powi(i)).collect()
}

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
    /// `capm_remediations_total{outcome}`.
    pub(crate) remediations: IntCounterVec,
    /// `capm_remediation_hand_backs_total{reason}`.
    pub(crate) hand_backs: IntCounterVec,
    pub(crate) remembered: IntGaugeVec,
    pub(crate) queue_depth: IntGaugeVec,
    queue_adds: IntCounterVec,
    queue_duration: HistogramVec,
    work_duration: HistogramVec,
    running: Running,
}

/// The controllers, and their running reconciles (at most `concurrency` each) by id: when each
/// started.
#[derive(Debug, Default)]
struct Reconciles {
    controllers: Vec<&'static str>,
    by_id: HashMap<u64, (&'static str, Instant)>,
    next_id: u64,
}

/// The running reconciles' series, computed when the registry is gathered.
#[derive(Debug, Clone)]
struct Running {
    reconciles: Arc<Mutex<Reconciles>>,
    unfinished: GaugeVec,
    longest: GaugeVec,
}

impl Collector for Running {
    fn desc(&self) -> Vec<&Desc> {
        [self.unfinished.desc(), self.longest.desc()].concat()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let now = Instant::now();
        let reconciles = crate::lock(&self.reconciles);
        for controller in &reconciles.controllers {
            let ages = (reconciles.by_id.values())
                .filter(|(c, _)| c == controller)
                .map(|(_, started)| now.saturating_duration_since(*started).as_secs_f64());
            let (sum, max) = ages.fold((0.0, 0.0), |(sum, max): (f64, f64), age| {
                (sum + age, max.max(age))
            });
            self.unfinished.with_label_values(&[controller]).set(sum);
            self.longest.with_label_values(&[controller]).set(max);
        }
        [self.unfinished.collect(), self.longest.collect()].concat()
    }
}

/// One reconcile, timed and counted as running until it is dropped (returned, failed, or dropped
/// half-way: shutdown, a lost Lease), so `active_workers` and the running work stay right.
#[must_use = "a reconcile is counted as running until its guard is dropped"]
pub(crate) struct Reconciling<'a> {
    metrics: &'a Metrics,
    controller: &'static str,
    /// Taken when the end is recorded.
    id: Option<u64>,
    started: Instant,
    /// `controller_runtime_reconcile_total`'s `result`.
    pub(crate) result: &'static str,
}

impl Reconciling<'_> {
    /// Records the reconcile's end at `now` (once: dropping the guard records it then).
    pub(crate) fn end(&mut self, now: Instant) {
        let (m, controller) = (self.metrics, [self.controller]);
        let Some(id) = self.id.take() else {
            return;
        };
        crate::lock(&m.running.reconciles).by_id.remove(&id);
        let took = now.saturating_duration_since(self.started).as_secs_f64();
        m.work_duration.with_label_values(&controller).observe(took);
        m.reconcile_time
            .with_label_values(&controller)
            .observe(took);
        m.active_workers.with_label_values(&controller).dec();
        let result = [self.controller, self.result];
        m.reconcile_total.with_label_values(&result).inc();
        if self.result == "error" {
            m.reconcile_errors.with_label_values(&controller).inc();
        }
    }
}

impl Drop for Reconciling<'_> {
    fn drop(&mut self) {
        self.end(Instant::now());
    }
}

impl Metrics {
    /// Creates the metrics and registers them in `registry`.
    ///
    /// # Errors
    /// When a metric of the same name is already registered.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        fn registered<C: Collector + Clone + 'static>(
            registry: &Registry,
            c: C,
        ) -> Result<C, prometheus::Error> {
            registry.register(Box::new(c.clone()))?;
            Ok(c)
        }
        let counter = |name: &str, help: &str, labels: &[&str]| {
            registered(registry, IntCounterVec::new(Opts::new(name, help), labels)?)
        };
        let gauge = |name: &str, help: &str, label: &str| {
            registered(registry, IntGaugeVec::new(Opts::new(name, help), &[label])?)
        };
        let histogram = |name: &str, help: &str, label: &str, buckets: Vec<f64>| {
            let opts = HistogramOpts::new(name, help).buckets(buckets);
            registered(registry, HistogramVec::new(opts, &[label])?)
        };
        let seconds = |name: &str, help: &str| GaugeVec::new(Opts::new(name, help), &["name"]);
        let running = registered(
            registry,
            Running {
                reconciles: Arc::default(),
                unfinished: seconds(
                    "workqueue_unfinished_work_seconds",
                    "How many seconds of work has been done that is in progress and hasn't been \
                     observed by work_duration. Large values indicate stuck threads.",
                )?,
                longest: seconds(
                    "workqueue_longest_running_processor_seconds",
                    "How many seconds has the longest running processor for workqueue been running",
                )?,
            },
        )?;
        let releases_abandoned = counter(
            "capm_release_abandoned_total",
            "Release mails given up after --release-timeout because their identity could not be used (identity) or their backend kept failing (mail); the deletion went on without them",
            &["reason"],
        )?;
        // Both series exist from the start, so an alert on their increase sees the first one.
        for reason in ["identity", "mail"] {
            releases_abandoned.with_label_values(&[reason]);
        }
        let remediations = counter(
            "capm_remediations_total",
            "Remediations by mail by how they ended: handed_back (the Machine handed back to its owner), repaired (answered Repaired, the object deleted when the Machine was healthy again), no_longer_needed (healthy again before any answer: that mail sent)",
            &["outcome"],
        )?;
        let hand_backs = counter(
            "capm_remediation_hand_backs_total",
            "Machines handed back to their owner by remediation by mail, by reason: CannotRepair, NoAnswer, RepairTimedOut, NotFulfilled",
            &["reason"],
        )?;
        for outcome in ["handed_back", "repaired", "no_longer_needed"] {
            remediations.with_label_values(&[outcome]);
        }
        for reason in ["CannotRepair", "NoAnswer", "RepairTimedOut", "NotFulfilled"] {
            hand_backs.with_label_values(&[reason]);
        }
        Ok(Self {
            releases_abandoned,
            remediations,
            hand_backs,
            running,
            remembered: gauge(
                "capm_remembered_objects",
                "Objects in the per-object ledger (live) and UIDs of gone objects kept to ignore stale copies (tombstone)",
                "state",
            )?,
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
            reconcile_time: histogram(
                "controller_runtime_reconcile_time_seconds",
                "Length of time per reconciliation per controller",
                "controller",
                RECONCILE_BUCKETS.to_vec(),
            )?,
            active_workers: gauge(
                "controller_runtime_active_workers",
                "Number of currently used workers per controller",
                "controller",
            )?,
            max_concurrent: gauge(
                "controller_runtime_max_concurrent_reconciles",
                "Maximum number of concurrent reconciles per controller",
                "controller",
            )?,
            triggers: counter(
                "capm_reconcile_triggers_total",
                "Requests for a reconcile (watch events, Cluster API objects' changes, lists, the sync period, delivery wake-ups), including those folded into one already waiting (workqueue_adds_total does not count those)",
                &["name"],
            )?,
            queue_depth: gauge("workqueue_depth", "Current depth of workqueue", "name")?,
            queue_adds: counter(
                "workqueue_adds_total",
                "Total number of adds handled by workqueue",
                &["name"],
            )?,
            queue_duration: histogram(
                "workqueue_queue_duration_seconds",
                "How long in seconds an item stays in workqueue before being requested",
                "name",
                duration_buckets(),
            )?,
            work_duration: histogram(
                "workqueue_work_duration_seconds",
                "How long in seconds processing an item from workqueue takes",
                "name",
                duration_buckets(),
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

    /// Makes `controller`'s series present (at zero) before any work, with its `concurrency`.
    pub(crate) fn init(&self, controller: &'static str, concurrency: u16) {
        let l = [controller];
        (self.max_concurrent.with_label_values(&l)).set(i64::from(concurrency));
        self.queue_retries.with_label_values(&l);
        self.queue_depth.with_label_values(&l);
        self.queue_adds.with_label_values(&l);
        self.queue_duration.with_label_values(&l);
        self.work_duration.with_label_values(&l);
        self.running.unfinished.with_label_values(&l);
        self.running.longest.with_label_values(&l);
        let mut reconciles = crate::lock(&self.running.reconciles);
        if !reconciles.controllers.contains(&controller) {
            reconciles.controllers.push(controller);
        }
    }

    /// An object not already waiting entered `controller`'s queue.
    pub(crate) fn added(&self, controller: &'static str) {
        self.queue_adds.with_label_values(&[controller]).inc();
        self.queue_depth.with_label_values(&[controller]).inc();
    }

    /// A waiting object left `controller`'s queue unreconciled (it is gone).
    pub(crate) fn left(&self, controller: &'static str) {
        self.queue_depth.with_label_values(&[controller]).dec();
    }

    /// A reconcile of `controller` starts `now`; `waited`: since when its object waited, if it
    /// was added (a requeue of kube's scheduler is not seen coming due:
    /// docs/kube-runtime-workqueue.md).
    pub(crate) fn reconciling(
        &self,
        controller: &'static str,
        waited: Option<Instant>,
        now: Instant,
    ) -> Reconciling<'_> {
        if let Some(since) = waited {
            self.queue_depth.with_label_values(&[controller]).dec();
            let waited = now.saturating_duration_since(since).as_secs_f64();
            self.queue_duration
                .with_label_values(&[controller])
                .observe(waited);
        }
        self.active_workers.with_label_values(&[controller]).inc();
        let mut reconciles = crate::lock(&self.running.reconciles);
        let id = reconciles.next_id;
        reconciles.next_id = id.wrapping_add(1);
        reconciles.by_id.insert(id, (controller, now));
        Reconciling {
            metrics: self,
            controller,
            id: Some(id),
            started: now,
            result: "cancelled",
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus::proto::MetricType;

    use std::time::Duration;

    use super::*;

    const C: &str = "mailguncluster";

    /// The value of `name{name="mailguncluster"}` in a gather (histograms: their count).
    fn value(registry: &Registry, name: &str) -> f64 {
        let family = registry
            .gather()
            .into_iter()
            .find(|f| f.name() == name)
            .unwrap_or_else(|| panic!("{name} not gathered"));
        let m = family
            .get_metric()
            .iter()
            .find(|m| m.get_label().iter().any(|l| l.value() == C))
            .unwrap_or_else(|| panic!("{name} has no series for {C}"));
        match family.get_field_type() {
            MetricType::HISTOGRAM => m.get_histogram().get_sample_count() as f64,
            MetricType::GAUGE => m.get_gauge().get_value(),
            _ => m.get_counter().get_value(),
        }
    }

    fn histogram_sum(registry: &Registry, name: &str) -> f64 {
        registry
            .gather()
            .into_iter()
            .find(|f| f.name() == name)
            .and_then(|f| {
                f.get_metric()
                    .first()
                    .map(|m| m.get_histogram().get_sample_sum())
            })
            .unwrap_or(f64::NAN)
    }

    fn queue() -> (Registry, Metrics) {
        let registry = Registry::new();
        let q = Metrics::register(&registry).expect("registered once");
        q.init(C, 1);
        (registry, q)
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn every_series_is_present_at_zero_after_init() {
        let (registry, _) = queue();
        for name in [
            "workqueue_depth",
            "workqueue_adds_total",
            "workqueue_queue_duration_seconds",
            "workqueue_work_duration_seconds",
            "workqueue_unfinished_work_seconds",
            "workqueue_longest_running_processor_seconds",
        ] {
            assert_eq!(value(&registry, name), 0.0, "{name}");
        }
    }

    #[test]
    fn an_add_waits_until_its_reconcile_starts_and_the_reconcile_is_timed() {
        let (registry, q) = queue();
        let t0 = Instant::now();
        q.added(C);
        q.added(C);
        assert_eq!(value(&registry, "workqueue_adds_total"), 2.0);
        assert_eq!(value(&registry, "workqueue_depth"), 2.0);
        let mut running = q.reconciling(C, Some(t0), t0 + secs(3));
        assert_eq!(value(&registry, "workqueue_depth"), 1.0);
        assert_eq!(value(&registry, "workqueue_queue_duration_seconds"), 1.0);
        assert_eq!(
            histogram_sum(&registry, "workqueue_queue_duration_seconds"),
            3.0
        );
        running.end(t0 + secs(5));
        assert_eq!(value(&registry, "workqueue_work_duration_seconds"), 1.0);
        assert_eq!(
            histogram_sum(&registry, "workqueue_work_duration_seconds"),
            2.0
        );
        // A requeue of kube's scheduler: timed as work, not as a wait.
        q.reconciling(C, None, t0 + secs(6)).end(t0 + secs(6));
        assert_eq!(value(&registry, "workqueue_queue_duration_seconds"), 1.0);
        assert_eq!(value(&registry, "workqueue_work_duration_seconds"), 2.0);
        // The other waiting object is gone.
        q.left(C);
        assert_eq!(value(&registry, "workqueue_depth"), 0.0);
    }

    #[test]
    fn running_reconciles_show_as_unfinished_work_until_they_end() {
        let (registry, q) = queue();
        let t0 = Instant::now();
        let a = q.reconciling(C, None, t0 - secs(5));
        let b = q.reconciling(C, None, t0 - secs(2));
        let unfinished = value(&registry, "workqueue_unfinished_work_seconds");
        let longest = value(&registry, "workqueue_longest_running_processor_seconds");
        assert!((7.0..8.0).contains(&unfinished), "{unfinished}");
        assert!((5.0..6.0).contains(&longest), "{longest}");
        drop((a, b));
        assert_eq!(value(&registry, "workqueue_unfinished_work_seconds"), 0.0);
        assert_eq!(
            value(&registry, "workqueue_longest_running_processor_seconds"),
            0.0
        );
        assert_eq!(value(&registry, "workqueue_work_duration_seconds"), 2.0);
    }

    #[test]
    fn buckets_are_controller_runtimes() {
        let b = duration_buckets();
        assert_eq!(b.len(), 12);
        assert!((b[0] - 1e-8).abs() < 1e-20 && (b[11] - 1e3).abs() < 1e-9);
    }
}
