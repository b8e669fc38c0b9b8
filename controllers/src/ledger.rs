//! The ledger: the one memory this process keeps about each object, by UID (retry counts and
//! backoff, the version its last write produced, when a mail's intent was first seen, refusals,
//! since when it waits in its controller's queue, the delivery poller asking about its mail,
//! whether its Events' series are open), and the tombstones of gone objects. Nothing here is durable: it only makes
//! retries slower, lookups patient, writes fewer and Events series. A gone object is forgotten in
//! one call ([`Ledger::forget`]) and its UID not remembered again for [`TOMBSTONE_TTL`] (far
//! longer than any cached copy lingers), so what a reconcile still in flight for it records is
//! dropped, not leaked.

use std::{
    collections::HashMap,
    hash::{BuildHasher, RandomState},
    sync::{Arc, LazyLock, Mutex},
    time::{Duration, Instant},
};

use capm_api::names::RETRY_ANNOTATION;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use prometheus::IntGaugeVec;

use crate::{events::Events, poller::Poller, sendonce::Which};

/// How long a gone object's UID is remembered, so stale cached copies of it are ignored.
pub const TOMBSTONE_TTL: Duration = Duration::from_secs(600);

/// What a permanent refusal is remembered against: a new generation or a new value of
/// [`RETRY_ANNOTATION`] (kept as a hash) lifts it, once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attempt {
    /// `metadata.generation`.
    pub generation: i64,
    /// The hash of the retry annotation's value (0 without one).
    pub retry: u64,
}

impl Attempt {
    /// The object's attempt now.
    pub fn of(meta: &ObjectMeta) -> Self {
        static HASH: LazyLock<RandomState> = LazyLock::new(RandomState::new);
        let retry = meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(RETRY_ANNOTATION));
        Self {
            generation: meta.generation.unwrap_or_default(),
            retry: retry.map_or(0, |v| HASH.hash_one(v)),
        }
    }
}

/// What this process remembers about one mail of one object.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct MailNotes {
    /// When this process first saw the mail's intent.
    first_seen: Option<Instant>,
    /// Since when lookups have answered "not found".
    not_found_since: Option<Instant>,
    /// When the backend refused this mail permanently: the object's [`Attempt`].
    refused_at: Option<Attempt>,
}

/// Everything remembered about one object.
#[derive(Default)]
struct Object {
    /// Consecutive failed reconciles.
    failures: u32,
    /// No send before this instant (the last failure's retry delay).
    not_before: Option<Instant>,
    /// The `resourceVersion` our own last write produced.
    expected_version: Option<u64>,
    /// The request mail, the release mail and a remediation's reminder in flight.
    mails: [MailNotes; 3],
    /// Waiting in a controller's queue (that controller's name) since.
    queued: Option<(&'static str, Instant)>,
    /// The delivery poller asking about its open request mail.
    poller: Option<Arc<Poller>>,
    /// It published an Event since its mail was last final: its series are open.
    in_series: bool,
}

impl Object {
    fn is_empty(&self) -> bool {
        self.failures == 0
            && self.not_before.is_none()
            && self.expected_version.is_none()
            && self.mails == [MailNotes::default(); 3]
            && self.queued.is_none()
            && self.poller.is_none()
            && !self.in_series
    }
}

fn slot(which: Which) -> usize {
    match which {
        Which::Request => 0,
        Which::Deletion => 1,
        // One reminder is in flight at a time (each follows the previous one's sent record),
        // and the notes of one are cleared when it is recorded sent.
        Which::Reminder(_) => 2,
    }
}

#[derive(Default)]
struct Inner {
    objects: HashMap<Box<str>, Object>,
    /// UIDs of gone objects, with when they went.
    tombstones: HashMap<Box<str>, Instant>,
    /// How many objects have their series open.
    in_series: usize,
}

/// The controllers' per-object notes, keyed by UID.
pub struct Ledger {
    inner: Mutex<Inner>,
    /// `capm_remembered_objects{state}`: `live` objects remembered, `tombstone` gone UIDs.
    gauge: IntGaugeVec,
    /// Whose series end when no object has one open.
    events: Events,
}

impl Ledger {
    /// A ledger whose size `gauge` (`{state}`: `live`, `tombstone`) shows, ending `events`'
    /// series when no object has one open.
    pub fn new(gauge: IntGaugeVec, events: Events) -> Self {
        gauge.with_label_values(&["live"]).set(0);
        gauge.with_label_values(&["tombstone"]).set(0);
        Self {
            inner: Mutex::default(),
            gauge,
            events,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        crate::lock(&self.inner)
    }

    fn count(&self, inner: &Inner) {
        let len = |n: usize| i64::try_from(n).unwrap_or(i64::MAX);
        let gauge = |state| self.gauge.with_label_values(&[state]);
        gauge("live").set(len(inner.objects.len()));
        gauge("tombstone").set(len(inner.tombstones.len()));
    }

    /// Reads `uid`'s notes (default ones when there is none).
    fn read<T>(&self, uid: &str, f: impl FnOnce(&Object) -> T) -> T {
        let inner = self.lock();
        f(inner.objects.get(uid).unwrap_or(&Object::default()))
    }

    /// Changes `uid`'s notes; nothing for a gone object; an entry left empty is removed.
    fn change<T>(&self, uid: &str, f: impl FnOnce(&mut Object) -> T) -> Option<T> {
        let mut guard = self.lock();
        let inner = &mut *guard;
        if inner.tombstones.contains_key(uid) {
            return None;
        }
        let before = inner.objects.len();
        let object = inner.objects.entry(uid.into()).or_default();
        let was_in_series = object.in_series;
        let out = f(object);
        let in_series = object.in_series;
        if object.is_empty() {
            inner.objects.remove(uid);
        }
        if inner.objects.len() != before {
            self.count(inner);
        }
        inner.in_series = (inner.in_series + usize::from(in_series)) - usize::from(was_in_series);
        let quiet = was_in_series && inner.in_series == 0;
        drop(guard);
        if quiet {
            self.end_series();
        }
        Some(out)
    }

    /// Counts one more failure of `uid` and returns its retry delay, `delay(count)` (a gone
    /// object's: `delay(1)`); with `gate_sends` (a mail backend's failure) no other trigger sends
    /// before it has passed.
    pub fn failed(
        &self,
        uid: &str,
        gate_sends: bool,
        mut delay: impl FnMut(u32) -> Duration,
    ) -> Duration {
        let failed = self.change(uid, |o| {
            o.failures = o.failures.saturating_add(1);
            let d = delay(o.failures);
            if gate_sends {
                o.not_before = Some(Instant::now() + d);
            }
            d
        });
        failed.unwrap_or_else(|| delay(1))
    }

    /// Whether `uid`'s last reconciles failed (it waits out a retry delay).
    pub fn has_failures(&self, uid: &str) -> bool {
        self.read(uid, |o| o.failures > 0)
    }

    /// How long sends of `uid` must still wait after its last failure (zero: none).
    pub fn backoff_left(&self, uid: &str) -> Duration {
        self.read(uid, |o| {
            o.not_before.map_or(Duration::ZERO, |at| {
                at.saturating_duration_since(Instant::now())
            })
        })
    }

    /// `uid` reconciled successfully: its failures are forgotten.
    pub fn succeeded(&self, uid: &str) {
        self.change(uid, |o| {
            o.failures = 0;
            o.not_before = None;
        });
    }

    /// Remembers the `resourceVersion` our own write produced, so a reconcile that starts from
    /// an older cached copy waits for the cache instead of acting on stale data.
    pub fn expect_version(&self, uid: &str, resource_version: Option<&str>) {
        if let Some(rv) = resource_version.and_then(|v| v.parse::<u64>().ok()) {
            self.change(uid, |o| o.expected_version = Some(rv));
        }
    }

    /// True when the cached copy predates our own last write, or the object is gone.
    pub fn is_stale(&self, uid: &str, resource_version: Option<&str>) -> bool {
        let seen = resource_version.and_then(|v| v.parse::<u64>().ok());
        self.change(uid, |o| match (o.expected_version, seen) {
            (Some(expected), Some(seen)) if seen < expected => true,
            _ => {
                o.expected_version = None;
                false
            }
        })
        .unwrap_or(true)
    }

    /// How long ago this process first saw the intent of `uid`'s mail (now, the first time).
    pub fn first_seen_ago(&self, uid: &str, which: Which) -> Duration {
        self.change(uid, |o| {
            o.mails[slot(which)]
                .first_seen
                .get_or_insert_with(Instant::now)
                .elapsed()
        })
        .unwrap_or(Duration::ZERO)
    }

    /// Since how long lookups answer "not found" for `uid`'s mail, if they do.
    pub fn not_found_for(&self, uid: &str, which: Which) -> Option<Duration> {
        self.read(uid, |o| o.mails[slot(which)].not_found_since)
            .map(|at| at.elapsed())
    }

    /// A lookup answered "not found" for the first time.
    pub fn start_not_found(&self, uid: &str, which: Which) {
        self.change(uid, |o| {
            o.mails[slot(which)].not_found_since = Some(Instant::now());
        });
    }

    /// The backend refused `uid`'s mail permanently at `attempt`.
    pub fn mark_permanently_refused(&self, uid: &str, which: Which, attempt: Attempt) {
        self.change(uid, |o| o.mails[slot(which)].refused_at = Some(attempt));
    }

    /// The [`Attempt`] at which the backend refused `uid`'s mail permanently, if it did.
    pub fn refused_at(&self, uid: &str, which: Which) -> Option<Attempt> {
        self.read(uid, |o| o.mails[slot(which)].refused_at)
    }

    /// The mail went out or was found: forget its attempts.
    pub fn clear_mail(&self, uid: &str, which: Which) {
        self.change(uid, |o| o.mails[slot(which)] = MailNotes::default());
    }

    /// `uid` entered `controller`'s queue now; false when it already waits (or is gone).
    pub fn queue(&self, uid: &str, controller: &'static str) -> bool {
        self.change(uid, |o| {
            o.queued
                .is_none()
                .then(|| o.queued = Some((controller, Instant::now())))
        })
        .flatten()
        .is_some()
    }

    /// `uid`'s reconcile starts: since when it waited, if it did.
    pub fn dequeue(&self, uid: &str) -> Option<Instant> {
        self.change(uid, |o| o.queued.take().map(|(_, since)| since))
            .flatten()
    }

    /// `poller` asks about `uid`'s open request mail from now on; false for a gone object
    /// (nothing to ask for).
    pub fn track(&self, uid: &str, poller: &Arc<Poller>) -> bool {
        let was = self.change(uid, |o| o.poller.replace(Arc::clone(poller)));
        match was {
            None => false,
            Some(Some(was)) if !Arc::ptr_eq(&was, poller) => {
                was.forget(uid);
                true
            }
            Some(_) => true,
        }
    }

    /// `uid`'s request mail shows its outcome for good: no poller asks about it, and its Events
    /// series end (a later Event opens them again).
    pub fn mail_final(&self, uid: &str) {
        let poller = self.change(uid, |o| {
            o.in_series = false;
            o.poller.take()
        });
        if let Some(poller) = poller.flatten() {
            poller.forget(uid);
        }
    }

    /// `uid` publishes an Event: its series are open. `false` for a gone object, whose Event
    /// must then go out without a series: no later forget would end it.
    pub fn in_series(&self, uid: &str) -> bool {
        self.change(uid, |o| o.in_series = true).is_some()
    }

    /// No object has its series open: every series ends (kube's `Recorder` cannot end one).
    fn end_series(&self) {
        self.events.end_series();
    }

    /// The object `uid` is gone: everything noted about it is forgotten (its poller told), and
    /// every cached copy stale for [`TOMBSTONE_TTL`]. Returns the controller whose queue it was
    /// waiting in, if it was.
    pub fn forget(&self, uid: &str) -> Option<&'static str> {
        let mut inner = self.lock();
        let object = inner.objects.remove(uid);
        let now = Instant::now();
        inner
            .tombstones
            .retain(|_, at| now.duration_since(*at) < TOMBSTONE_TTL);
        inner.tombstones.insert(uid.into(), now);
        if inner.objects.is_empty() {
            inner.objects.shrink_to_fit();
        }
        self.count(&inner);
        let object = object?;
        inner.in_series -= usize::from(object.in_series);
        let quiet = object.in_series && inner.in_series == 0;
        drop(inner);
        if quiet {
            self.end_series();
        }
        if let Some(poller) = &object.poller {
            poller.forget(uid);
        }
        object.queued.map(|(controller, _)| controller)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A ledger with a gauge and `Events` of its own (a client nothing answers: no Event is
    /// published here). Within a runtime: the client's buffer is a task.
    fn ledger() -> Ledger {
        let config = kube::Config::new("http://127.0.0.1:1".parse().expect("a URL"));
        let client = kube::Client::try_from(config).expect("a client");
        let gauge = IntGaugeVec::new(prometheus::Opts::new("g", "g"), &["state"]).expect("a gauge");
        Ledger::new(gauge, Events::new(client, "t", "t"))
    }

    impl Ledger {
        /// How many objects are remembered (gone ones not counted).
        pub(crate) fn len(&self) -> usize {
            self.lock().objects.len()
        }
    }

    #[tokio::test]
    async fn a_gone_object_stays_stale_whatever_copy_arrives_and_is_not_remembered_again() {
        let ledger = ledger();
        ledger.expect_version("u1", Some("120"));
        ledger.mark_permanently_refused("u1", Which::Request, at(3, 0));
        ledger.forget("u1");
        assert_eq!(ledger.len(), 0);
        assert!(ledger.is_stale("u1", Some("100")));
        assert!(ledger.is_stale("u1", Some("121")));
        assert!(!ledger.is_stale("u2", Some("1")));
        // A reconcile still in flight records nothing for it.
        ledger.failed("u1", true, |_| Duration::from_secs(1));
        ledger.start_not_found("u1", Which::Deletion);
        assert_eq!(ledger.len(), 0);
        assert_eq!(ledger.refused_at("u1", Which::Request), None);
    }

    fn at(generation: i64, retry: u64) -> Attempt {
        Attempt { generation, retry }
    }

    #[tokio::test]
    async fn permanent_refusals_are_remembered_per_mail_with_their_attempt() {
        let ledger = ledger();
        ledger.mark_permanently_refused("u", Which::Request, at(3, 7));
        assert_eq!(ledger.refused_at("u", Which::Request), Some(at(3, 7)));
        assert_eq!(ledger.refused_at("u", Which::Deletion), None);
        ledger.clear_mail("u", Which::Request);
        assert_eq!(ledger.refused_at("u", Which::Request), None);
        assert_eq!(ledger.len(), 0, "an entry left empty is removed");
    }

    #[test]
    fn an_attempt_changes_with_the_generation_or_the_retry_annotation() {
        let meta = |generation, retry: Option<&str>| ObjectMeta {
            generation: Some(generation),
            annotations: retry.map(|v| [(RETRY_ANNOTATION.to_owned(), v.to_owned())].into()),
            ..ObjectMeta::default()
        };
        let first = Attempt::of(&meta(3, None));
        assert_eq!(first, at(3, 0));
        assert_eq!(Attempt::of(&meta(3, None)), first);
        assert_ne!(Attempt::of(&meta(4, None)), first);
        let asked = Attempt::of(&meta(3, Some("1")));
        assert_ne!(asked, first);
        assert_eq!(
            Attempt::of(&meta(3, Some("1"))),
            asked,
            "the same value asks nothing new"
        );
        assert_ne!(Attempt::of(&meta(3, Some("2"))), asked);
    }

    #[tokio::test]
    async fn a_cache_older_than_our_write_is_stale_until_it_caught_up() {
        let ledger = ledger();
        ledger.expect_version("u1", Some("120"));
        assert!(ledger.is_stale("u1", Some("100")));
        assert!(!ledger.is_stale("u1", Some("120")));
        assert!(
            !ledger.is_stale("u1", Some("100")),
            "the expectation is gone"
        );
        assert_eq!(ledger.len(), 0);
    }

    #[tokio::test]
    async fn failures_count_per_object_and_gate_sends() {
        let ledger = ledger();
        let counts: Vec<u32> = (0..3)
            .map(|_| {
                let mut seen = 0;
                ledger.failed("a", true, |n| {
                    seen = n;
                    Duration::from_secs(5)
                });
                seen
            })
            .collect();
        assert_eq!(counts, [1, 2, 3]);
        assert!(ledger.backoff_left("a") > Duration::from_secs(4));
        assert_eq!(ledger.backoff_left("b"), Duration::ZERO);
        ledger.succeeded("a");
        assert_eq!(ledger.backoff_left("a"), Duration::ZERO);
        assert_eq!(ledger.len(), 0);
        // Counted, but no gate: the API server, not the mail backend, failed.
        ledger.failed("c", false, |_| Duration::from_secs(5));
        assert_eq!(ledger.backoff_left("c"), Duration::ZERO);
    }
}
