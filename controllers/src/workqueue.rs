//! controller-runtime's `workqueue_*` series for kube-runtime's scheduler, measured at its edges:
//! what enters it (the triggers of objects in the store, folded while one waits) and what leaves
//! it (a reconcile starting, then ending). Which object waits since when is noted in the object's
//! memory ([`crate::ledger`]), not here. What kube-runtime does not show (a requeue coming due,
//! the scheduler's own folding): docs/kube-runtime-workqueue.md; what each series means:
//! docs/observability.md, "The work queue series".

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

/// The queue and work duration buckets, as controller-runtime's: 10 ns to 1000 s, by tens.
fn duration_buckets() -> Vec<f64> {
    (0..12).map(|i| 1e-8 * 10f64.powi(i)).collect()
}

/// One running reconcile, for [`Workqueue::finished`].
#[derive(Debug)]
#[must_use = "a started reconcile is finished with its token"]
pub struct Running {
    controller: &'static str,
    id: u64,
    started: Instant,
}

#[derive(Debug, Clone)]
struct Series {
    depth: IntGaugeVec,
    adds: IntCounterVec,
    queue_duration: HistogramVec,
    work_duration: HistogramVec,
    unfinished: GaugeVec,
    longest: GaugeVec,
}

/// The controllers, and their running reconciles (at most `concurrency` each): when each started.
#[derive(Debug, Default)]
struct Reconciles {
    controllers: Vec<&'static str>,
    by_id: HashMap<u64, (&'static str, Instant)>,
    next_id: u64,
}

#[derive(Debug)]
struct Shared {
    running: Mutex<Reconciles>,
    series: Series,
}

/// The `workqueue_*` series of every controller (see the module docs). Cheap to clone.
#[derive(Debug, Clone)]
pub struct Workqueue {
    shared: Arc<Shared>,
}

/// Computes the running reconciles' gauges when the registry is gathered.
struct Scraped {
    shared: Arc<Shared>,
    descs: Vec<Desc>,
}

impl Collector for Scraped {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let s = &self.shared.series;
        let now = Instant::now();
        let reconciles = self.shared.lock();
        for controller in &reconciles.controllers {
            let ages = reconciles
                .by_id
                .values()
                .filter(|(c, _)| c == controller)
                .map(|(_, started)| now.saturating_duration_since(*started).as_secs_f64());
            let (sum, max) = ages.fold((0.0, 0.0), |(sum, max): (f64, f64), age| {
                (sum + age, max.max(age))
            });
            s.unfinished.with_label_values(&[controller]).set(sum);
            s.longest.with_label_values(&[controller]).set(max);
        }
        let mut out = s.unfinished.collect();
        out.extend(s.longest.collect());
        out
    }
}

impl Workqueue {
    /// Creates the series and registers them in `registry`.
    pub fn register(registry: &Registry) -> Result<Self, prometheus::Error> {
        let name = ["name"];
        let histogram = |metric: &str, help: &str| -> Result<HistogramVec, prometheus::Error> {
            let h = HistogramVec::new(
                HistogramOpts::new(metric, help).buckets(duration_buckets()),
                &name,
            )?;
            registry.register(Box::new(h.clone()))?;
            Ok(h)
        };
        let depth = IntGaugeVec::new(
            Opts::new("workqueue_depth", "Current depth of workqueue"),
            &name,
        )?;
        registry.register(Box::new(depth.clone()))?;
        let adds = IntCounterVec::new(
            Opts::new(
                "workqueue_adds_total",
                "Total number of adds handled by workqueue",
            ),
            &name,
        )?;
        registry.register(Box::new(adds.clone()))?;
        let series = Series {
            depth,
            adds,
            queue_duration: histogram(
                "workqueue_queue_duration_seconds",
                "How long in seconds an item stays in workqueue before being requested",
            )?,
            work_duration: histogram(
                "workqueue_work_duration_seconds",
                "How long in seconds processing an item from workqueue takes",
            )?,
            unfinished: GaugeVec::new(
                Opts::new(
                    "workqueue_unfinished_work_seconds",
                    "How many seconds of work has been done that is in progress and hasn't been \
                     observed by work_duration. Large values indicate stuck threads.",
                ),
                &name,
            )?,
            longest: GaugeVec::new(
                Opts::new(
                    "workqueue_longest_running_processor_seconds",
                    "How many seconds has the longest running processor for workqueue been running",
                ),
                &name,
            )?,
        };
        let descs = [series.unfinished.desc(), series.longest.desc()]
            .into_iter()
            .flatten()
            .cloned()
            .collect();
        let shared = Arc::new(Shared {
            running: Mutex::default(),
            series,
        });
        registry.register(Box::new(Scraped {
            shared: Arc::clone(&shared),
            descs,
        }))?;
        Ok(Self { shared })
    }

    /// Makes `controller`'s series present (at zero) before any work.
    pub fn init(&self, controller: &'static str) {
        let s = &self.shared.series;
        let l = [controller];
        s.depth.with_label_values(&l);
        s.adds.with_label_values(&l);
        s.queue_duration.with_label_values(&l);
        s.work_duration.with_label_values(&l);
        s.unfinished.with_label_values(&l);
        s.longest.with_label_values(&l);
        let mut reconciles = self.shared.lock();
        if !reconciles.controllers.contains(&controller) {
            reconciles.controllers.push(controller);
        }
    }

    /// An object not already waiting entered `controller`'s queue.
    pub fn added(&self, controller: &'static str) {
        let s = &self.shared.series;
        s.adds.with_label_values(&[controller]).inc();
        s.depth.with_label_values(&[controller]).inc();
    }

    /// A waiting object left `controller`'s queue unreconciled (it is gone).
    pub fn left(&self, controller: &'static str) {
        self.shared
            .series
            .depth
            .with_label_values(&[controller])
            .dec();
    }

    /// A reconcile starts; `waited`: since when its object waited, if it was added (a requeue
    /// of kube's scheduler is not seen coming due: docs/kube-runtime-workqueue.md).
    pub fn started(
        &self,
        controller: &'static str,
        waited: Option<Instant>,
        now: Instant,
    ) -> Running {
        if let Some(since) = waited {
            let s = &self.shared.series;
            s.depth.with_label_values(&[controller]).dec();
            s.queue_duration
                .with_label_values(&[controller])
                .observe(now.saturating_duration_since(since).as_secs_f64());
        }
        let mut running = self.shared.lock();
        let id = running.next_id;
        running.next_id = id.wrapping_add(1);
        running.by_id.insert(id, (controller, now));
        Running {
            controller,
            id,
            started: now,
        }
    }

    /// The reconcile `running` ended (returned, failed or was dropped).
    pub fn finished(&self, running: &Running, now: Instant) {
        self.shared.lock().by_id.remove(&running.id);
        self.shared
            .series
            .work_duration
            .with_label_values(&[running.controller])
            .observe(now.saturating_duration_since(running.started).as_secs_f64());
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, Reconciles> {
        self.running.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use prometheus::proto::MetricType;

    use std::time::Duration;

    use super::*;

    const C: &str = "mailguncluster";

    impl Workqueue {
        /// `workqueue_depth` of `controller`.
        pub(crate) fn depth(&self, controller: &str) -> i64 {
            self.shared
                .series
                .depth
                .with_label_values(&[controller])
                .get()
        }
    }

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

    fn queue() -> (Registry, Workqueue) {
        let registry = Registry::new();
        let q = Workqueue::register(&registry).expect("registered once");
        q.init(C);
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
        let running = q.started(C, Some(t0), t0 + secs(3));
        assert_eq!(value(&registry, "workqueue_depth"), 1.0);
        assert_eq!(value(&registry, "workqueue_queue_duration_seconds"), 1.0);
        assert_eq!(
            histogram_sum(&registry, "workqueue_queue_duration_seconds"),
            3.0
        );
        q.finished(&running, t0 + secs(5));
        assert_eq!(value(&registry, "workqueue_work_duration_seconds"), 1.0);
        assert_eq!(
            histogram_sum(&registry, "workqueue_work_duration_seconds"),
            2.0
        );
        // A requeue of kube's scheduler: timed as work, not as a wait.
        let running = q.started(C, None, t0 + secs(6));
        q.finished(&running, t0 + secs(6));
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
        let a = q.started(C, None, t0 - secs(5));
        let b = q.started(C, None, t0 - secs(2));
        let unfinished = value(&registry, "workqueue_unfinished_work_seconds");
        let longest = value(&registry, "workqueue_longest_running_processor_seconds");
        assert!((7.0..8.0).contains(&unfinished), "{unfinished}");
        assert!((5.0..6.0).contains(&longest), "{longest}");
        q.finished(&a, Instant::now());
        q.finished(&b, Instant::now());
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
