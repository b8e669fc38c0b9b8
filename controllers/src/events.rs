//! Kubernetes Events (`events.k8s.io/v1`) about our objects, through one kube `Recorder` for
//! the controllers and the fulfilment page, as controller-rs keeps one in its context.
//!
//! A series matters while an object is worked on; once its mail is final, or it is gone, it may
//! end. kube's `Recorder` keeps every Event it published for six minutes and cannot forget one
//! object's (docs/kube-runtime-recorder.md, report 2): the per-object ledger (`crate::ledger`)
//! notes which objects have a series open, and when none has, [`Events::end_series`] starts a
//! fresh `Recorder`, so a finished backlog or a churn of objects keeps none of their Events.
//! While objects are worked on the `Recorder` keeps at most [`MAX_KEPT_EVENTS`] Events (as
//! client-go's Event correlator keeps a bounded cache): past that a fresh one starts, and an
//! Event repeated after it starts a new Event instead of growing its series. A backlog of
//! 10 000 objects would otherwise hold each one's Event for six minutes (about 30 MiB).
//! Done here, not by the `Recorder`: a note from a peer is cleaned and cut to 1 KiB, and an object
//! whose name leaves no room for the `Recorder`'s `.<nanoseconds>` suffix (over 236 characters)
//! gets its Event under a shortened name, without a series (report 1: the API server refuses the
//! `Recorder`'s name).

use std::sync::{Arc, Mutex};

use k8s_openapi::{
    api::{core::v1::ObjectReference, events::v1::Event as K8sEvent},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
pub use kube::runtime::events::EventType;
use kube::{
    Api, Client,
    api::PostParams,
    runtime::events::{Event, Recorder, Reporter},
};

/// Longest object name the API server accepts (a DNS subdomain).
const MAX_NAME_LENGTH: usize = 253;
/// Room the Recorder's suffix takes: a dot and up to 16 hexadecimal digits.
const SUFFIX_LENGTH: usize = 17;
/// events.k8s.io/v1 `note`: at most 1 KiB.
const MAX_NOTE_BYTES: usize = 1024;
/// The action of every Event: what a controller does.
const ACTION: &str = "Reconcile";
/// Most Events one `Recorder` is handed before a fresh one takes over (each costs it about
/// 2 KiB for six minutes; client-go's correlator keeps 4 096).
pub(crate) const MAX_KEPT_EVENTS: usize = 1024;

/// Publishes Events for one reporting controller and instance. Cheap to clone: clones share
/// the `Recorder`.
#[derive(Clone)]
pub struct Events {
    client: Client,
    reporter: Reporter,
    current: Arc<Mutex<Current>>,
}

/// The `Recorder` of the series open now, and how many Events it was handed.
struct Current {
    recorder: Recorder,
    handed: usize,
}

impl Events {
    /// A publisher reporting as `controller` / `instance`.
    pub fn new(client: Client, controller: impl Into<String>, instance: impl Into<String>) -> Self {
        let reporter = Reporter {
            controller: controller.into(),
            instance: Some(instance.into()),
        };
        let recorder = Recorder::new(client.clone(), reporter.clone());
        let current = Arc::new(Mutex::new(Current {
            recorder,
            handed: 0,
        }));
        Self {
            client,
            reporter,
            current,
        }
    }

    /// Ends every series: the next Event of each object starts a new one (the old `Recorder`
    /// and the Events it kept go).
    pub(crate) fn end_series(&self) {
        self.restart(&mut crate::lock(&self.current));
    }

    /// A fresh `Recorder` in `current`, handed nothing yet.
    fn restart(&self, current: &mut Current) {
        current.recorder = Recorder::new(self.client.clone(), self.reporter.clone());
        current.handed = 0;
    }

    /// Publishes one Event about `regarding`, or counts it in the series of an identical
    /// recent one; an error is the API server's refusal.
    pub async fn publish(
        &self,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &'static str,
        note: &str,
    ) -> Result<(), kube::Error> {
        self.publish_in(Some(self.recorder()), regarding, type_, reason, note)
            .await
    }

    /// The `Recorder` of the series open now, for one Event; after [`MAX_KEPT_EVENTS`] a fresh
    /// one. Taken before an object's series is noted open, an Event published through it goes
    /// to the `Recorder` that a later end of every series drops.
    pub(crate) fn recorder(&self) -> Recorder {
        let mut current = crate::lock(&self.current);
        if current.handed == MAX_KEPT_EVENTS {
            self.restart(&mut current);
        }
        current.handed += 1;
        current.recorder.clone()
    }

    /// [`Events::publish`] through `recorder`; with none, an Event no `Recorder` keeps: for an
    /// object that is gone (its series would outlive it: nothing would end them). So is the Event
    /// of an object whose name leaves no room for the `Recorder`'s suffix (named here, shortened).
    pub(crate) async fn publish_in(
        &self,
        recorder: Option<Recorder>,
        regarding: &ObjectReference,
        type_: EventType,
        reason: &'static str,
        note: &str,
    ) -> Result<(), kube::Error> {
        let note = capm_mailer::text::clean(note, MAX_NOTE_BYTES);
        let name = regarding.name.as_deref().unwrap_or_default();
        if let Some(recorder) = recorder.filter(|_| name.len() + SUFFIX_LENGTH <= MAX_NAME_LENGTH) {
            let event = Event {
                type_,
                reason: reason.into(),
                note: Some(note),
                action: ACTION.into(),
                secondary: None,
            };
            return recorder.publish(&event, regarding).await;
        }
        let now = Timestamp::now();
        let event = K8sEvent {
            action: Some(ACTION.into()),
            reason: Some(reason.into()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            note: Some(note),
            metadata: ObjectMeta {
                name: Some(short_name(name, now.as_nanosecond())),
                ..ObjectMeta::default()
            },
            reporting_controller: Some(self.reporter.controller.clone()),
            reporting_instance: self.reporter.instance.clone(),
            type_: Some(format!("{type_:?}")),
            ..K8sEvent::default()
        };
        let namespace = regarding.namespace.as_deref().unwrap_or("default");
        Api::<K8sEvent>::namespaced(self.client.clone(), namespace)
            .create(&PostParams::default(), &event)
            .await
            .map(drop)
    }
}

/// `<object name>.<nanoseconds in hex>` with the object name cut to fit [`MAX_NAME_LENGTH`]
/// and stripped of trailing `.` and `-`, so every label still ends in a letter or digit.
fn short_name(object: &str, nanos: i128) -> String {
    let suffix = format!(".{nanos:x}");
    let mut end = object.len().min(MAX_NAME_LENGTH - suffix.len());
    while !object.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{suffix}", object[..end].trim_end_matches(['.', '-']))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use http::{Request, Response};
    use kube::client::Body;

    /// A client whose API server takes every write (answering it with its body), and the
    /// method of each request, in order.
    pub(crate) fn answering_client() -> (Client, Arc<Mutex<Vec<String>>>) {
        let log = Arc::new(Mutex::new(Vec::new()));
        let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let logging = Arc::clone(&log);
        tokio::spawn(async move {
            while let Some((request, respond)) = handle.next_request().await {
                logging.lock().unwrap().push(request.method().to_string());
                let body = request.into_body().collect_bytes().await.unwrap();
                respond.send_response(
                    Response::builder()
                        .status(200)
                        .body(Body::from(body.to_vec()))
                        .unwrap(),
                );
            }
        });
        (Client::new(service, "default"), log)
    }

    /// A repeat joins its Event's series (a patch) until the series end; then it is new.
    #[tokio::test]
    async fn a_repeat_is_a_series_until_the_series_end() {
        let (client, log) = answering_client();
        let events = Events::new(client, "c", "i");
        let regarding = ObjectReference {
            name: Some("a".into()),
            namespace: Some("ns".into()),
            uid: Some("u".into()),
            ..ObjectReference::default()
        };
        for _ in 0..2 {
            events
                .publish(&regarding, EventType::Normal, "R", "n")
                .await
                .unwrap();
        }
        events.end_series();
        events
            .publish(&regarding, EventType::Normal, "R", "n")
            .await
            .unwrap();
        assert_eq!(*log.lock().unwrap(), ["POST", "PATCH", "POST"]);
    }

    /// A `Recorder` is handed at most `MAX_KEPT_EVENTS` Events: past them a repeat of the first
    /// object's Event is new, so a backlog's Events are not all kept.
    #[tokio::test]
    async fn a_recorder_keeps_a_bounded_number_of_events() {
        let (client, log) = answering_client();
        let events = Events::new(client, "c", "i");
        let object = |i: usize| ObjectReference {
            name: Some(format!("o-{i}")),
            namespace: Some("ns".into()),
            uid: Some(format!("u-{i}")),
            ..ObjectReference::default()
        };
        for i in 0..MAX_KEPT_EVENTS - 1 {
            events
                .publish(&object(i), EventType::Normal, "R", "n")
                .await
                .unwrap();
        }
        let writes = |log: &Arc<Mutex<Vec<String>>>| log.lock().unwrap().clone();
        events
            .publish(&object(0), EventType::Normal, "R", "n")
            .await
            .unwrap();
        assert_eq!(
            writes(&log).last().unwrap(),
            "PATCH",
            "within the bound: a series"
        );
        events
            .publish(&object(1), EventType::Normal, "R", "n")
            .await
            .unwrap();
        assert_eq!(
            writes(&log).last().unwrap(),
            "POST",
            "past it: a fresh Recorder"
        );
        let posts = writes(&log).iter().filter(|m| *m == "POST").count();
        assert_eq!(
            posts, MAX_KEPT_EVENTS,
            "one new Event per object, and the one past the bound"
        );
    }

    #[test]
    fn short_names_fit_and_end_labels_in_alphanumerics() {
        let nanos = 0x18ea_a61c_bbc0_5adf_i128;
        for object in [
            "a".repeat(253),
            format!("{}.b", "a".repeat(235)),
            format!("{}-{}", "c".repeat(236), "d".repeat(16)),
        ] {
            let name = short_name(&object, nanos);
            assert!(name.len() <= MAX_NAME_LENGTH, "{name}");
            let prefix = name.strip_suffix(".18eaa61cbbc05adf").expect("the suffix");
            assert!(object.starts_with(prefix));
            assert!(!prefix.ends_with(['.', '-']), "{name}");
        }
    }

    /// A 253-character object name (the longest the API server allows) still gets its Event,
    /// on the real API server, and a short name's repeat becomes a series.
    #[tokio::test]
    #[ignore = "needs the local control plane: `make test` runs it, `make unit` does not"]
    async fn events_about_objects_with_the_longest_names_are_accepted() {
        let ns = capm_test_support::TestNamespace::create("events-long")
            .await
            .unwrap();
        let events = Events::new(ns.client.clone(), "mailguncluster-controller", "i-1");
        let names = [
            "a".repeat(253),
            format!("{}.b", "a".repeat(236)),
            format!("{}-{}", "c".repeat(240), "d".repeat(12)),
            "short".to_owned(),
        ];
        for (i, name) in names.iter().enumerate() {
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
                .publish(&regarding, EventType::Normal, "MailSent", "sent")
                .await
                .unwrap_or_else(|e| panic!("event about {} characters: {e}", name.len()));
        }
        let short = ObjectReference {
            uid: Some("uid-3".into()),
            name: Some("short".into()),
            namespace: Some(ns.name.clone()),
            api_version: Some("infrastructure.cluster.x-k8s.io/v1beta1".into()),
            kind: Some("MailgunCluster".into()),
            resource_version: Some("1".into()),
            ..ObjectReference::default()
        };
        events
            .publish(&short, EventType::Normal, "MailSent", "sent")
            .await
            .unwrap();
        let list = Api::<K8sEvent>::namespaced(ns.client.clone(), &ns.name)
            .list(&Default::default())
            .await
            .unwrap();
        assert_eq!(list.items.len(), 4, "one Event per object");
        for event in &list.items {
            let name = event.metadata.name.clone().unwrap();
            assert!(name.len() <= MAX_NAME_LENGTH, "{name}");
            assert_eq!(event.reporting_instance.as_deref(), Some("i-1"));
        }
        let series = list
            .items
            .iter()
            .find(|e| e.metadata.name.as_deref().unwrap().starts_with("short."))
            .and_then(|e| e.series.as_ref())
            .map(|s| s.count);
        assert_eq!(series, Some(2), "the repeat is a series");
    }
}
