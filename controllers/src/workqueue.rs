//! controller-runtime's `workqueue_*` series for kube-runtime's scheduler, measured at its edges
//! (what goes in and what comes out), per controller and keyed by `namespace/name` as the
//! scheduler keys its slots. What each series means and where it differs from controller-runtime:
//! docs/observability.md, "The work queue series".
//!
//! Every requeue must go through [`Workqueue::requeue`] (the error policy and
//! [`crate::context::Ctx::requeue`] do): kube's `Action` does not tell its delay. A reconcile
//! that ends without one cancels what it asked for on the way ([`Workqueue::no_requeue`]).

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, Instant},
};

use prometheus::{
    GaugeVec, HistogramOpts, HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry,
    core::{Collector, Desc},
    proto::MetricFamily,
};

/// The most keys remembered per controller and map: far above the objects one provider holds.
pub const MAX_KEYS: usize = 100_000;

/// The queue and work duration buckets, as controller-runtime's: 10 ns to 1000 s, by tens.
fn duration_buckets() -> Vec<f64> {
    (0..12).map(|i| 1e-8 * 10f64.powi(i)).collect()
}

/// The scheduler's key for an object: `namespace/name`.
pub fn key(namespace: Option<&str>, name: &str) -> String {
    format!("{}/{name}", namespace.unwrap_or_default())
}

/// One running reconcile, for [`Workqueue::finished`].
#[derive(Debug)]
#[must_use = "a started reconcile is finished with its token"]
pub struct Running {
    controller: &'static str,
    id: u64,
}

/// One controller's queue, as seen from its edges.
#[derive(Debug, Default)]
struct Queue {
    /// Keys waiting for their reconcile: since when.
    waiting: HashMap<Box<str>, Instant>,
    /// Requeues asked for and not due yet: when due.
    scheduled: HashMap<Box<str>, Instant>,
    /// Running reconciles: when each started.
    running: HashMap<u64, Instant>,
    next_id: u64,
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

#[derive(Debug)]
struct Shared {
    queues: Mutex<HashMap<&'static str, Queue>>,
    series: Series,
}

/// The `workqueue_*` bookkeeping of every controller (see the module docs). Cheap to clone.
#[derive(Debug, Clone)]
pub struct Workqueue {
    shared: Arc<Shared>,
}

/// Computes the gauges (and the adds of requeues come due) when the registry is gathered.
struct Scraped {
    shared: Arc<Shared>,
    descs: Vec<Desc>,
}

impl Collector for Scraped {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.shared.refresh(Instant::now());
        let s = &self.shared.series;
        let mut out = s.depth.collect();
        out.extend(s.adds.collect());
        out.extend(s.unfinished.collect());
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
        let series = Series {
            depth: IntGaugeVec::new(
                Opts::new("workqueue_depth", "Current depth of workqueue"),
                &name,
            )?,
            adds: IntCounterVec::new(
                Opts::new(
                    "workqueue_adds_total",
                    "Total number of adds handled by workqueue",
                ),
                &name,
            )?,
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
        let descs = [
            series.depth.desc(),
            series.adds.desc(),
            series.unfinished.desc(),
            series.longest.desc(),
        ]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
        let shared = Arc::new(Shared {
            queues: Mutex::new(HashMap::new()),
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
        self.shared.with(controller, Instant::now(), |_, _| ());
    }

    /// A trigger for `key` entered `controller`'s queue.
    pub fn added(&self, controller: &'static str, key: &str, now: Instant) {
        self.shared.with(controller, now, |q, s| {
            if !q.waiting.contains_key(key) {
                s.adds.with_label_values(&[controller]).inc();
                if q.waiting.len() < MAX_KEYS {
                    q.waiting.insert(key.into(), now);
                }
            }
        });
    }

    /// `key`'s reconcile asked to run again after `delay`. The last request of a reconcile
    /// wins, as only the `Action` it ends with (or its error policy's) reaches kube.
    pub fn requeue(&self, controller: &'static str, key: &str, delay: Duration, now: Instant) {
        let due = now + delay;
        self.shared.with(controller, now, |q, _| {
            if let Some(at) = q.scheduled.get_mut(key) {
                *at = due;
            } else if q.scheduled.len() < MAX_KEYS {
                q.scheduled.insert(key.into(), due);
            }
        });
    }

    /// `key`'s reconcile ended without a requeue (it failed, or waits for a change): a requeue
    /// it asked for on the way is not what kube schedules.
    pub fn no_requeue(&self, controller: &'static str, key: &str) {
        self.shared.with(controller, Instant::now(), |q, _| {
            q.scheduled.remove(key);
        });
    }

    /// `key`'s reconcile starts: it leaves the queue (its requeue, if any, is the same slot in
    /// kube's scheduler, so it goes too).
    pub fn started(&self, controller: &'static str, key: &str, now: Instant) -> Running {
        self.shared.with(controller, now, |q, s| {
            leave(q, s, controller, key, now);
            let id = q.next_id;
            q.next_id = q.next_id.wrapping_add(1);
            q.running.insert(id, now);
            Running { controller, id }
        })
    }

    /// The reconcile `running` ended (returned, failed or was dropped).
    pub fn finished(&self, running: &Running, now: Instant) {
        self.shared.with(running.controller, now, |q, s| {
            if let Some(started) = q.running.remove(&running.id) {
                s.work_duration
                    .with_label_values(&[running.controller])
                    .observe(now.saturating_duration_since(started).as_secs_f64());
            }
        });
    }

    /// kube found `key` gone from the cache when its turn came: it leaves the queue unreconciled.
    pub fn dropped(&self, controller: &'static str, key: &str) {
        let now = Instant::now();
        self.shared
            .with(controller, now, |q, s| leave(q, s, controller, key, now));
    }
}

/// `key` leaves `q`: its wait is observed, its scheduled requeue forgotten.
fn leave(q: &mut Queue, s: &Series, controller: &'static str, key: &str, now: Instant) {
    q.scheduled.remove(key);
    if let Some(since) = q.waiting.remove(key) {
        s.queue_duration
            .with_label_values(&[controller])
            .observe(now.saturating_duration_since(since).as_secs_f64());
    }
}

impl Shared {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<&'static str, Queue>> {
        self.queues.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on `controller`'s queue, after moving the requeues due by `now` to the waiting
    /// keys, then updates its depth.
    fn with<T>(
        &self,
        controller: &'static str,
        now: Instant,
        f: impl FnOnce(&mut Queue, &Series) -> T,
    ) -> T {
        let mut queues = self.lock();
        let q = queues.entry(controller).or_default();
        promote(q, &self.series, controller, now);
        let out = f(q, &self.series);
        self.series
            .depth
            .with_label_values(&[controller])
            .set(i64::try_from(q.waiting.len()).unwrap_or(i64::MAX));
        out
    }

    /// Brings every controller's series up to `now` (for a scrape).
    fn refresh(&self, now: Instant) {
        let mut queues = self.lock();
        for (controller, q) in queues.iter_mut() {
            promote(q, &self.series, controller, now);
            let ages = q
                .running
                .values()
                .map(|started| now.saturating_duration_since(*started).as_secs_f64());
            let (sum, max) = ages.fold((0.0, 0.0), |(sum, max): (f64, f64), age| {
                (sum + age, max.max(age))
            });
            let l = [*controller];
            self.series
                .depth
                .with_label_values(&l)
                .set(i64::try_from(q.waiting.len()).unwrap_or(i64::MAX));
            self.series.unfinished.with_label_values(&l).set(sum);
            self.series.longest.with_label_values(&l).set(max);
        }
    }
}

/// Requeues due by `now` become waiting keys (an add each, unless the key already waits).
fn promote(q: &mut Queue, s: &Series, controller: &'static str, now: Instant) {
    if q.scheduled.is_empty() {
        return;
    }
    let due: Vec<(Box<str>, Instant)> = q
        .scheduled
        .iter()
        .filter(|(_, at)| **at <= now)
        .map(|(k, at)| (k.clone(), *at))
        .collect();
    for (key, at) in due {
        q.scheduled.remove(&key);
        match q.waiting.get_mut(&key) {
            Some(since) => *since = (*since).min(at),
            None => {
                s.adds.with_label_values(&[controller]).inc();
                if q.waiting.len() < MAX_KEYS {
                    q.waiting.insert(key, at);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus::proto::MetricType;

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
    fn triggers_for_a_waiting_key_fold_and_its_wait_counts_from_the_first() {
        let (registry, q) = queue();
        let t0 = Instant::now();
        q.added(C, "ns/a", t0);
        q.added(C, "ns/a", t0 + secs(1));
        q.added(C, "ns/b", t0 + secs(1));
        assert_eq!(value(&registry, "workqueue_adds_total"), 2.0);
        assert_eq!(value(&registry, "workqueue_depth"), 2.0);
        let running = q.started(C, "ns/a", t0 + secs(3));
        assert_eq!(value(&registry, "workqueue_depth"), 1.0);
        assert_eq!(value(&registry, "workqueue_queue_duration_seconds"), 1.0);
        assert_eq!(
            histogram_sum(&registry, "workqueue_queue_duration_seconds"),
            3.0
        );
        // A trigger while the key runs is an add: it runs again after.
        q.added(C, "ns/a", t0 + secs(4));
        assert_eq!(value(&registry, "workqueue_adds_total"), 3.0);
        assert_eq!(value(&registry, "workqueue_depth"), 2.0);
        q.finished(&running, t0 + secs(5));
        assert_eq!(value(&registry, "workqueue_work_duration_seconds"), 1.0);
        assert_eq!(
            histogram_sum(&registry, "workqueue_work_duration_seconds"),
            2.0
        );
    }

    #[test]
    fn a_requeue_is_an_add_when_due_and_waits_from_its_due_time() {
        let (registry, q) = queue();
        let t0 = Instant::now();
        q.added(C, "ns/a", t0);
        let r = q.started(C, "ns/a", t0);
        q.finished(&r, t0 + secs(1));
        q.requeue(C, "ns/a", secs(10), t0 + secs(1));
        // Not due: not in the queue.
        q.added(C, "ns/b", t0 + secs(5));
        assert_eq!(value(&registry, "workqueue_adds_total"), 2.0);
        assert_eq!(value(&registry, "workqueue_depth"), 1.0);
        // Due at t0+11; observed at t0+12 and started at t0+14.
        q.added(C, "ns/b", t0 + secs(12));
        assert_eq!(value(&registry, "workqueue_adds_total"), 3.0);
        assert_eq!(value(&registry, "workqueue_depth"), 2.0);
        let r = q.started(C, "ns/a", t0 + secs(14));
        q.finished(&r, t0 + secs(14));
        assert_eq!(
            histogram_sum(&registry, "workqueue_queue_duration_seconds"),
            3.0
        );
    }

    #[test]
    fn a_trigger_before_a_requeue_is_due_takes_its_slot() {
        let (registry, q) = queue();
        let t0 = Instant::now();
        q.requeue(C, "ns/a", secs(30), t0);
        q.added(C, "ns/a", t0 + secs(1));
        let r = q.started(C, "ns/a", t0 + secs(2));
        q.finished(&r, t0 + secs(3));
        // Past the old due time nothing comes back: kube ran the slot at the trigger.
        q.added(C, "ns/b", t0 + secs(40));
        assert_eq!(value(&registry, "workqueue_adds_total"), 2.0);
        assert_eq!(value(&registry, "workqueue_depth"), 1.0);
    }

    #[test]
    fn a_requeue_asked_for_by_a_pass_that_then_fails_is_not_waited_for() {
        let (registry, q) = queue();
        let t0 = Instant::now();
        let r = q.started(C, "ns/a", t0);
        // The owner recheck asks for 2 s; the status write then fails and the error policy
        // asks for 5 s: kube runs it at 5 s.
        q.requeue(C, "ns/a", secs(2), t0);
        q.finished(&r, t0);
        q.no_requeue(C, "ns/a");
        q.requeue(C, "ns/a", secs(5), t0);
        q.added(C, "ns/b", t0 + secs(3));
        assert_eq!(
            value(&registry, "workqueue_depth"),
            1.0,
            "only ns/b waits at 3 s"
        );
        q.added(C, "ns/b", t0 + secs(6));
        assert_eq!(value(&registry, "workqueue_depth"), 2.0);
        // A permanent error: no requeue at all, nothing comes due.
        let r = q.started(C, "ns/c", t0);
        q.requeue(C, "ns/c", secs(2), t0);
        q.finished(&r, t0);
        q.no_requeue(C, "ns/c");
        q.added(C, "ns/b", t0 + secs(60));
        assert_eq!(value(&registry, "workqueue_depth"), 2.0);
    }

    #[test]
    fn a_key_gone_from_the_cache_leaves_the_queue_and_nothing_stays() {
        let (registry, q) = queue();
        q.added(C, "ns/gone", Instant::now());
        q.requeue(C, "ns/gone", secs(60), Instant::now());
        q.dropped(C, "ns/gone");
        assert_eq!(value(&registry, "workqueue_depth"), 0.0);
        assert_eq!(value(&registry, "workqueue_queue_duration_seconds"), 1.0);
        assert_eq!(value(&registry, "workqueue_work_duration_seconds"), 0.0);
        let queues = q.shared.lock();
        let state = &queues[C];
        assert!(state.waiting.is_empty() && state.scheduled.is_empty() && state.running.is_empty());
    }

    #[test]
    fn running_reconciles_show_as_unfinished_work_until_they_end() {
        let (registry, q) = queue();
        let t0 = Instant::now();
        let a = q.started(C, "ns/a", t0 - secs(5));
        let b = q.started(C, "ns/b", t0 - secs(2));
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
    fn keys_past_the_cap_are_counted_but_not_kept() {
        let (registry, q) = queue();
        let t0 = Instant::now();
        for i in 0..=MAX_KEYS {
            q.added(C, &format!("ns/{i}"), t0);
        }
        assert_eq!(
            value(&registry, "workqueue_adds_total"),
            (MAX_KEYS + 1) as f64
        );
        assert_eq!(value(&registry, "workqueue_depth"), MAX_KEYS as f64);
    }

    #[test]
    fn buckets_are_controller_runtimes() {
        let b = duration_buckets();
        assert_eq!(b.len(), 12);
        assert!((b[0] - 1e-8).abs() < 1e-20 && (b[11] - 1e3).abs() < 1e-9);
    }
}
