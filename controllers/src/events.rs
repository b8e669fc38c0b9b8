//! Kubernetes Events (`events.k8s.io/v1`) about our objects.
//!
//! What kube's `Recorder` does, with a compact series memory: an event repeated for the same
//! object version, type and reason within [`SERIES_TTL`] becomes a series (`series.count`) on the
//! first event instead of a new Event. kube's `Recorder` keeps a clone of every published Event
//! and its key (several KiB each, six minutes long), which made events the largest part of the
//! provider's heap while a backlog drains; this keeps the few strings a series patch needs.

use std::{
    collections::HashMap,
    sync::Mutex,
    time::{Duration, Instant},
};

use k8s_openapi::{
    api::{
        core::v1::ObjectReference,
        events::v1::{Event, EventSeries},
    },
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{Patch, PatchParams, PostParams},
};
use serde_json::json;

/// How long an event can grow into a series (as kube's `Recorder` and client-go).
pub const SERIES_TTL: Duration = Duration::from_secs(6 * 60);

/// Normal or Warning.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    /// Something expected happened.
    Normal,
    /// Something went wrong.
    Warning,
}

impl EventType {
    fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "Normal",
            Self::Warning => "Warning",
        }
    }
}

/// What makes two events about one object (by UID) the same (the reporter is the same for
/// every event of one publisher): the object's `resourceVersion`, the type and the reason.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SeriesKey {
    resource_version: Box<str>,
    type_: EventType,
    reason: &'static str,
}

/// The first event of a possible series: enough to patch it.
#[derive(Debug)]
struct SeriesEntry {
    namespace: Box<str>,
    name: Box<str>,
    count: i32,
    last_observed: Instant,
}

/// Longest object name the API server accepts (a DNS subdomain).
const MAX_NAME_LENGTH: usize = 253;
/// events.k8s.io/v1 `note`: at most 1 KiB.
const MAX_NOTE_BYTES: usize = 1024;

/// `<object name>.<nanoseconds in hex>`, as client-go names events, with the object name
/// shortened when the result would exceed [`MAX_NAME_LENGTH`]: cut to fit, then stripped of
/// trailing `.` and `-` so every label still ends in a letter or digit. Deterministic (the same
/// inputs give the same name), unlike client-go's fallback to a random UUID, and the event name
/// still starts with the object's. Object names are DNS subdomains already, so nothing else
/// needs escaping.
fn event_name(object: &str, nanos: i128) -> String {
    let suffix = format!(".{nanos:x}");
    let room = MAX_NAME_LENGTH.saturating_sub(suffix.len());
    let mut end = object.len().min(room);
    while !object.is_char_boundary(end) {
        end -= 1;
    }
    let prefix = object[..end].trim_end_matches(['.', '-']);
    format!("{prefix}{suffix}")
}

/// Publishes events for one reporting controller and instance.
pub struct Events {
    client: Client,
    controller: String,
    instance: String,
    series: Mutex<Series>,
}

#[derive(Default)]
struct Series {
    /// By the object's UID, so that a gone object's entries go at once ([`Events::forget`]).
    /// An object has one or two (one per version, type and reason it was told of): a short list
    /// each, not a table (a hash table of one entry took over 500 bytes).
    entries: HashMap<Box<str>, Vec<(SeriesKey, SeriesEntry)>>,
    pruned: Option<Instant>,
}

impl Series {
    fn get(&self, uid: &str, key: &SeriesKey) -> Option<&SeriesEntry> {
        self.entries
            .get(uid)?
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, e)| e)
    }

    fn get_mut(&mut self, uid: &str, key: &SeriesKey) -> Option<&mut SeriesEntry> {
        self.entries
            .get_mut(uid)?
            .iter_mut()
            .find(|(k, _)| k == key)
            .map(|(_, e)| e)
    }

    fn insert(&mut self, uid: String, key: SeriesKey, entry: SeriesEntry) {
        if let Some(e) = self.get_mut(&uid, &key) {
            *e = entry;
            return;
        }
        let of_object = self.entries.entry(uid.into_boxed_str()).or_default();
        of_object.reserve_exact(1);
        of_object.push((key, entry));
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.values().map(Vec::len).sum()
    }

    /// Drops the entries that can no longer grow, at most once per tenth of the TTL (lookups
    /// check the age themselves, so this only bounds memory).
    fn prune(&mut self, now: Instant) {
        if self
            .pruned
            .is_some_and(|at| now.duration_since(at) < SERIES_TTL / 10)
        {
            return;
        }
        self.entries.retain(|_, of_object| {
            of_object.retain(|(_, e)| now.duration_since(e.last_observed) < SERIES_TTL);
            of_object.shrink_to_fit();
            !of_object.is_empty()
        });
        if self.entries.capacity() > 2 * self.entries.len() + 16 {
            self.entries.shrink_to_fit();
        }
        self.pruned = Some(now);
    }
}

fn lock(m: &Mutex<Series>) -> std::sync::MutexGuard<'_, Series> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Events {
    /// A publisher reporting as `controller` / `instance`.
    pub fn new(client: Client, controller: impl Into<String>, instance: impl Into<String>) -> Self {
        Self {
            client,
            controller: controller.into(),
            instance: instance.into(),
            series: Mutex::default(),
        }
    }

    /// Publishes one event about `regarding` (action `Reconcile`), or counts it in the series of
    /// an identical recent one.
    ///
    /// # Errors
    /// The API server's refusal.
    pub async fn publish(
        &self,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &'static str,
        note: String,
    ) -> Result<(), kube::Error> {
        let uid = regarding.uid.clone().unwrap_or_default();
        let key = SeriesKey {
            resource_version: regarding
                .resource_version
                .as_deref()
                .unwrap_or_default()
                .into(),
            type_,
            reason,
        };
        // The API server refuses notes over 1 KiB; a peer's words in one are made inert here.
        let note = capm_mailer::text::clean(&note, MAX_NOTE_BYTES);
        let started = Instant::now();
        let repeat = {
            let mut series = lock(&self.series);
            series.prune(started);
            series
                .get(&uid, &key)
                .filter(|e| started.duration_since(e.last_observed) < SERIES_TTL)
                .map(|e| (e.namespace.clone(), e.name.clone(), e.count + 1))
        };
        let now = Timestamp::now();
        match repeat {
            Some((namespace, name, count)) => {
                let series = EventSeries {
                    count,
                    last_observed_time: MicroTime(now),
                };
                Api::<Event>::namespaced(self.client.clone(), &namespace)
                    .patch(
                        &name,
                        &PatchParams::default(),
                        &Patch::Merge(json!({ "series": series })),
                    )
                    .await?;
                let mut series = lock(&self.series);
                if let Some(entry) = series.get_mut(&uid, &key) {
                    entry.count = entry.count.max(count);
                    entry.last_observed = started;
                }
            }
            None => {
                let namespace = regarding
                    .namespace
                    .clone()
                    .unwrap_or_else(|| "default".to_owned());
                let name = event_name(
                    regarding.name.as_deref().unwrap_or(&self.controller),
                    now.as_nanosecond(),
                );
                let event = Event {
                    action: Some("Reconcile".into()),
                    reason: Some(reason.into()),
                    event_time: Some(MicroTime(now)),
                    regarding: Some(regarding.clone()),
                    note: Some(note),
                    metadata: ObjectMeta {
                        namespace: Some(namespace.clone()),
                        name: Some(name.clone()),
                        ..ObjectMeta::default()
                    },
                    reporting_controller: Some(self.controller.clone()),
                    reporting_instance: Some(self.instance.clone()),
                    type_: Some(type_.as_str().into()),
                    ..Event::default()
                };
                Api::<Event>::namespaced(self.client.clone(), &namespace)
                    .create(&PostParams::default(), &event)
                    .await?;
                lock(&self.series).insert(
                    uid,
                    key,
                    SeriesEntry {
                        namespace: namespace.into(),
                        name: name.into(),
                        count: 1,
                        last_observed: started,
                    },
                );
            }
        }
        Ok(())
    }

    /// The object with this UID is gone: its events can no longer grow into series.
    pub fn forget(&self, uid: &str) {
        lock(&self.series).entries.remove(uid);
    }

    #[cfg(test)]
    fn remembered(&self) -> usize {
        lock(&self.series).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key() -> SeriesKey {
        SeriesKey {
            resource_version: "1".into(),
            type_: EventType::Warning,
            reason: "MailFailed",
        }
    }

    fn entry(at: Instant) -> SeriesEntry {
        SeriesEntry {
            namespace: "ns".into(),
            name: "n.1".into(),
            count: 1,
            last_observed: at,
        }
    }

    #[test]
    fn event_names_fit_and_end_labels_in_alphanumerics() {
        assert_eq!(event_name("demo", 255), "demo.ff");
        let nanos = 0x18ea_a61c_bbc0_5adf_i128;
        for object in [
            "a".repeat(253),
            format!("{}.b", "a".repeat(235)),
            format!("{}-{}", "c".repeat(236), "d".repeat(16)),
        ] {
            let name = event_name(&object, nanos);
            assert!(name.len() <= MAX_NAME_LENGTH, "{name}");
            assert!(name.ends_with(".18eaa61cbbc05adf"), "{name}");
            let prefix = name.trim_end_matches(".18eaa61cbbc05adf");
            assert!(object.starts_with(prefix));
            assert!(!prefix.ends_with(['.', '-']), "{name}");
            assert_eq!(event_name(&object, nanos), name, "deterministic");
        }
    }

    #[test]
    fn prune_drops_expired_entries_and_is_rate_limited() {
        let start = Instant::now();
        let mut series = Series::default();
        series.insert("old".into(), key(), entry(start));
        series.prune(start);
        assert_eq!(series.len(), 1);
        let later = start + SERIES_TTL / 2;
        series.insert("new".into(), key(), entry(later));
        let expired = start + SERIES_TTL + Duration::from_secs(1);
        series.prune(expired);
        assert_eq!(series.len(), 1);
        assert!(series.get("new", &key()).is_some());
        assert!(
            !series.entries.contains_key("old"),
            "an emptied object goes"
        );
        // Within a tenth of the TTL of the last prune nothing is scanned.
        series.insert("old".into(), key(), entry(start));
        series.prune(expired + Duration::from_secs(1));
        assert_eq!(series.len(), 2);
    }

    #[tokio::test]
    async fn a_gone_objects_series_are_forgotten_at_once() {
        let client =
            Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
        let events = Events::new(client, "c", "i");
        let now = Instant::now();
        lock(&events.series).insert("a".into(), key(), entry(now));
        lock(&events.series).insert("b".into(), key(), entry(now));
        events.forget("a");
        assert_eq!(events.remembered(), 1);
        assert!(lock(&events.series).get("b", &key()).is_some());
    }

    /// Issue 14 item 7: a 253-character object name (the longest the API server allows) still
    /// gets its event, on the real API server.
    #[tokio::test]
    #[ignore = "needs the local control plane: `make test` runs it, `make unit` does not"]
    async fn events_about_objects_with_the_longest_names_are_accepted() {
        let ns = capm_test_support::TestNamespace::create("events-long")
            .await
            .unwrap();
        let events = Events::new(ns.client.clone(), "mailguncluster-controller", "i-1");
        for (i, name) in [
            "a".repeat(253),
            format!("{}.b", "a".repeat(236)),
            format!("{}-{}", "c".repeat(240), "d".repeat(12)),
        ]
        .into_iter()
        .enumerate()
        {
            let regarding = ObjectReference {
                api_version: Some("infrastructure.cluster.x-k8s.io/v1beta1".into()),
                kind: Some("MailgunCluster".into()),
                uid: Some(format!("uid-{i}")),
                name: Some(name.clone()),
                namespace: Some(ns.name.clone()),
                resource_version: Some("1".into()),
                ..ObjectReference::default()
            };
            events
                .publish(&regarding, EventType::Normal, "MailSent", "sent".into())
                .await
                .unwrap_or_else(|e| panic!("event about {} characters: {e}", name.len()));
        }
        let list = Api::<Event>::namespaced(ns.client.clone(), &ns.name)
            .list(&Default::default())
            .await
            .unwrap();
        assert_eq!(list.items.len(), 3);
        for event in &list.items {
            let name = event.metadata.name.clone().unwrap();
            assert!(name.len() <= 253, "{name}");
        }
    }

    #[tokio::test]
    async fn a_refused_event_is_not_remembered() {
        let client =
            Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().unwrap())).unwrap();
        let events = Events::new(client, "c", "i");
        let regarding = ObjectReference {
            uid: Some("u".into()),
            name: Some("n".into()),
            namespace: Some("ns".into()),
            resource_version: Some("1".into()),
            ..ObjectReference::default()
        };
        assert!(
            events
                .publish(&regarding, EventType::Normal, "MailSent", "x".into())
                .await
                .is_err()
        );
        assert_eq!(events.remembered(), 0);
    }
}
