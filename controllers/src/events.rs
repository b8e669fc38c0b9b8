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

/// What makes two events the same (the reporter is the same for every event of one publisher):
/// the object (by UID) at one `resourceVersion`, the type and the reason.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct SeriesKey {
    uid: String,
    resource_version: String,
    type_: EventType,
    reason: &'static str,
}

/// The first event of a possible series: enough to patch it.
#[derive(Debug)]
struct SeriesEntry {
    namespace: String,
    name: String,
    count: i32,
    last_observed: Instant,
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
    entries: HashMap<SeriesKey, SeriesEntry>,
    pruned: Option<Instant>,
}

impl Series {
    /// Drops the entries that can no longer grow, at most once per tenth of the TTL (lookups
    /// check the age themselves, so this only bounds memory).
    fn prune(&mut self, now: Instant) {
        if self
            .pruned
            .is_some_and(|at| now.duration_since(at) < SERIES_TTL / 10)
        {
            return;
        }
        self.entries
            .retain(|_, e| now.duration_since(e.last_observed) < SERIES_TTL);
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
        let key = SeriesKey {
            uid: regarding.uid.clone().unwrap_or_default(),
            resource_version: regarding.resource_version.clone().unwrap_or_default(),
            type_,
            reason,
        };
        let started = Instant::now();
        let repeat = {
            let mut series = lock(&self.series);
            series.prune(started);
            series
                .entries
                .get(&key)
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
                if let Some(entry) = lock(&self.series).entries.get_mut(&key) {
                    entry.count = entry.count.max(count);
                    entry.last_observed = started;
                }
            }
            None => {
                let namespace = regarding
                    .namespace
                    .clone()
                    .unwrap_or_else(|| "default".to_owned());
                let name = format!(
                    "{}.{:x}",
                    regarding.name.as_deref().unwrap_or(&self.controller),
                    now.as_nanosecond()
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
                lock(&self.series).entries.insert(
                    key,
                    SeriesEntry {
                        namespace,
                        name,
                        count: 1,
                        last_observed: started,
                    },
                );
            }
        }
        Ok(())
    }

    #[cfg(test)]
    fn remembered(&self) -> usize {
        lock(&self.series).entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(uid: &str) -> SeriesKey {
        SeriesKey {
            uid: uid.into(),
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
    fn prune_drops_expired_entries_and_is_rate_limited() {
        let start = Instant::now();
        let mut series = Series::default();
        series.entries.insert(key("old"), entry(start));
        series.prune(start);
        assert_eq!(series.entries.len(), 1);
        let later = start + SERIES_TTL / 2;
        series.entries.insert(key("new"), entry(later));
        let expired = start + SERIES_TTL + Duration::from_secs(1);
        series.prune(expired);
        assert_eq!(series.entries.len(), 1);
        assert!(series.entries.contains_key(&key("new")));
        // Within a tenth of the TTL of the last prune nothing is scanned.
        series.entries.insert(key("old"), entry(start));
        series.prune(expired + Duration::from_secs(1));
        assert_eq!(series.entries.len(), 2);
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
