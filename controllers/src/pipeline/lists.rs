//! Reconciles that follow each list of a kind's watch, against the list's snapshot.
//!
//! kube-runtime's reflector swaps a list's objects into the store only at its end (`InitDone`),
//! but passes each one downstream as it arrives: a controller fed by those looks it up in the old
//! store, drops the reconcile of an object created while the watch was down and reconciles one
//! deleted meanwhile against its old copy, and nothing triggers either again after the swap
//! (docs/kube-runtime-relist.md).
//!
//! [`AfterLists`] sits after the reflector and holds back what a list brings: it notes each
//! listed object whose `resourceVersion` differs from the copy in the store before the list
//! (new or changed), and when the list is complete (the store swapped) asks for exactly those
//! reconciles, which then read the new snapshot. Objects the list no longer has are forgotten.
//! Watch events after the list pass straight through: the reflector has applied them to the
//! store before they arrive here.

use std::collections::{HashMap, HashSet};

use kube::{
    Resource, ResourceExt,
    runtime::{
        reflector::{ObjectRef, Store},
        watcher,
    },
};

/// What the store held when a list began, and what the list brought so far.
struct Listing<K: Resource<DynamicType = ()> + 'static> {
    /// Each object of the old snapshot: its UID and `resourceVersion`.
    before: HashMap<ObjectRef<K>, (String, Option<String>)>,
    /// Listed objects that are new or changed since the old snapshot.
    changed: Vec<ObjectRef<K>>,
    /// UIDs of every listed object.
    seen: HashSet<String>,
}

/// A predicate on objects' UIDs.
type UidFilter = Box<dyn Fn(&str) -> bool + Send + Sync>;

/// Where reconciles are asked for.
type Ask<K> = Box<dyn Fn(&ObjectRef<K>) + Send + Sync>;

/// Turns a reflected watch stream's events into the objects to reconcile (see the module docs).
pub(crate) struct AfterLists<K: Resource<DynamicType = ()> + 'static> {
    store: Store<K>,
    listing: Option<Listing<K>>,
    /// Asks for the reconciles a completed list needs (the controller's triggers).
    relisted: Ask<K>,
    /// Called with the UID of each object that is gone (a deletion, or absent from a list).
    forget: Box<dyn Fn(&str) + Send + Sync>,
    /// Whether an unchanged object is asked for too after a list: one waiting out a retry
    /// delay built up while the API server was away.
    retry: UidFilter,
}

impl<K> AfterLists<K>
where
    K: Resource<DynamicType = ()> + Clone + Send + Sync + 'static,
{
    /// An adapter over the reflector store `store`; the reconciles it asks for after each list
    /// (also of the unchanged objects `retry` names by UID) are asked of `relisted`.
    pub(crate) fn new(
        store: Store<K>,
        relisted: impl Fn(&ObjectRef<K>) + Send + Sync + 'static,
        forget: impl Fn(&str) + Send + Sync + 'static,
        retry: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> Self {
        Self {
            store,
            listing: None,
            relisted: Box::new(relisted),
            forget: Box::new(forget),
            retry: Box::new(retry),
        }
    }

    /// One event, already applied by the reflector. Returns the object to reconcile now, if any.
    pub(crate) fn on_event(&mut self, event: watcher::Event<K>) -> Option<K> {
        match event {
            watcher::Event::Apply(obj) => Some(obj),
            watcher::Event::Delete(obj) => {
                (self.forget)(&obj.uid().unwrap_or_default());
                None
            }
            watcher::Event::Init => {
                // The reflector has only cleared its buffer: the store still shows the old
                // snapshot.
                let before = self
                    .store
                    .state()
                    .iter()
                    .map(|o| {
                        (
                            ObjectRef::from_obj(&**o),
                            (o.uid().unwrap_or_default(), o.resource_version()),
                        )
                    })
                    .collect();
                self.listing = Some(Listing {
                    before,
                    changed: Vec::new(),
                    seen: HashSet::new(),
                });
                None
            }
            watcher::Event::InitApply(obj) => {
                let listing = self.listing.get_or_insert_with(|| Listing {
                    before: HashMap::new(),
                    changed: Vec::new(),
                    seen: HashSet::new(),
                });
                let uid = obj.uid().unwrap_or_default();
                let reference = ObjectRef::from_obj(&obj);
                let unchanged = listing
                    .before
                    .get(&reference)
                    .is_some_and(|(u, rv)| *u == uid && *rv == obj.resource_version());
                if !unchanged {
                    listing.changed.push(reference);
                }
                listing.seen.insert(uid);
                None
            }
            watcher::Event::InitDone => {
                // The store now holds the list's snapshot.
                if let Some(listing) = self.listing.take() {
                    for (uid, _) in listing.before.values() {
                        if !listing.seen.contains(uid) {
                            (self.forget)(uid);
                        }
                    }
                    let changed: HashSet<ObjectRef<K>> = listing.changed.iter().cloned().collect();
                    let waiting: Vec<ObjectRef<K>> = self
                        .store
                        .state()
                        .iter()
                        .filter(|o| (self.retry)(&o.uid().unwrap_or_default()))
                        .map(|o| ObjectRef::from_obj(&**o))
                        .filter(|r| !changed.contains(r))
                        .collect();
                    tracing::debug!(
                        kind = K::kind(&()).as_ref(),
                        listed = listing.seen.len(),
                        changed = listing.changed.len(),
                        retried = waiting.len(),
                        first = ?listing.changed.iter().chain(&waiting).take(20).map(|r| r.name.as_str()).collect::<Vec<_>>(),
                        "A list is complete: reconciling what it changed"
                    );
                    for reference in listing.changed.iter().chain(&waiting) {
                        (self.relisted)(reference);
                    }
                }
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use capm_api::v1beta1::MailgunCluster;
    use futures::{StreamExt, channel::mpsc};
    use kube::runtime::reflector;

    use super::*;

    use super::super::tests::test_object as object;

    /// Feeds `events` through a reflector writer and the adapter, as the pipeline does; returns
    /// what passed straight through, what the lists asked for (with what the store held for
    /// each when asked) and what was forgotten.
    struct Rig {
        writer: reflector::store::Writer<MailgunCluster>,
        store: Store<MailgunCluster>,
        adapter: AfterLists<MailgunCluster>,
        relisted: mpsc::UnboundedReceiver<ObjectRef<MailgunCluster>>,
        forgotten: Arc<Mutex<Vec<String>>>,
    }

    impl Rig {
        fn new() -> Self {
            let (store, writer) = reflector::store();
            let (tx, relisted) = mpsc::unbounded();
            let forgotten = Arc::new(Mutex::new(Vec::new()));
            let f = forgotten.clone();
            let forget = move |uid: &str| f.lock().unwrap().push(uid.to_owned());
            let adapter = AfterLists::new(store.clone(), asker(tx), forget, |_| false);
            Self {
                writer,
                store,
                adapter,
                relisted,
                forgotten,
            }
        }

        fn feed(&mut self, event: watcher::Event<MailgunCluster>) -> Option<String> {
            self.writer.apply_watcher_event(&event);
            self.adapter.on_event(event).map(|o| o.name_any())
        }

        /// The reconciles asked for so far, each with the `resourceVersion` the store gives
        /// for it now (what the reconcile would read).
        fn asked(&mut self) -> Vec<(String, Option<String>)> {
            let mut out = Vec::new();
            while let Ok(r) = self.relisted.try_recv() {
                let rv = self.store.get(&r).and_then(|o| o.resource_version());
                out.push((r.name.clone(), rv));
            }
            out
        }
    }

    /// What the controller's triggers would be sent, sent to a channel.
    fn asker(
        tx: mpsc::UnboundedSender<ObjectRef<MailgunCluster>>,
    ) -> impl Fn(&ObjectRef<MailgunCluster>) + Send + Sync + 'static {
        move |r| tx.unbounded_send(r.clone()).expect("the test reads")
    }

    fn list(rig: &mut Rig, objects: &[MailgunCluster]) {
        use watcher::Event::*;
        rig.feed(Init);
        for o in objects {
            assert_eq!(rig.feed(InitApply(o.clone())), None, "held back");
        }
        assert!(
            rig.asked().is_empty(),
            "nothing before the list is complete"
        );
        rig.feed(InitDone);
    }

    #[test]
    fn the_first_list_asks_for_every_object_once_the_store_has_it() {
        let mut rig = Rig::new();
        list(&mut rig, &[object("a", "ua", "1"), object("b", "ub", "2")]);
        assert_eq!(
            rig.asked(),
            [
                ("a".into(), Some("1".into())),
                ("b".into(), Some("2".into()))
            ]
        );
    }

    #[test]
    fn a_relist_asks_for_new_and_changed_objects_against_the_new_snapshot_and_forgets_the_gone() {
        use watcher::Event::*;
        let mut rig = Rig::new();
        list(
            &mut rig,
            &[
                object("same", "u1", "1"),
                object("changed", "u2", "2"),
                object("deleted", "u3", "3"),
                object("recreated", "u5", "5"),
            ],
        );
        rig.asked();
        assert_eq!(
            rig.feed(Apply(object("same", "u1", "1"))),
            Some("same".into())
        );
        // The watch could not resume; the re-list brings one unchanged object, one changed
        // (now being deleted, say), one new, none of the deleted one, and another object
        // under an old name with the same version number (a new UID).
        list(
            &mut rig,
            &[
                object("same", "u1", "1"),
                object("changed", "u2", "20"),
                object("new", "u4", "21"),
                object("recreated", "u6", "5"),
            ],
        );
        let mut asked = rig.asked();
        asked.sort();
        assert_eq!(
            asked,
            [
                ("changed".into(), Some("20".into())),
                ("new".into(), Some("21".into())),
                ("recreated".into(), Some("5".into())),
            ],
            "only new or changed objects, each read from the new snapshot"
        );
        let mut forgotten = rig.forgotten.lock().unwrap().clone();
        forgotten.sort();
        assert_eq!(forgotten, ["u3", "u5"]);
    }

    #[test]
    fn a_relist_also_asks_for_unchanged_objects_waiting_out_a_retry() {
        let mut rig = Rig::new();
        let (tx, relisted) = mpsc::unbounded();
        rig.relisted = relisted;
        rig.adapter = AfterLists::new(rig.store.clone(), asker(tx), |_| {}, |uid| uid == "u2");
        list(&mut rig, &[object("a", "u1", "1"), object("b", "u2", "2")]);
        rig.asked();
        list(&mut rig, &[object("a", "u1", "1"), object("b", "u2", "2")]);
        assert_eq!(rig.asked(), [("b".into(), Some("2".into()))]);
    }

    #[test]
    fn a_deletion_event_forgets_the_object() {
        use watcher::Event::*;
        let mut rig = Rig::new();
        list(&mut rig, &[object("a", "ua", "1")]);
        assert_eq!(rig.feed(Delete(object("a", "ua", "2"))), None);
        assert_eq!(*rig.forgotten.lock().unwrap(), ["ua"]);
    }

    /// The behaviour this adapter works around, as kube-runtime 5.0 has it: a listed object
    /// reaches the stream before the store has it (`docs/kube-runtime-relist.md`). When this
    /// fails, kube-runtime changed: read the doc again.
    #[tokio::test]
    async fn kube_runtime_passes_a_listed_object_on_before_its_store_has_it() {
        use kube::runtime::WatchStreamExt;
        let (store, writer) = reflector::store::<MailgunCluster>();
        let events = futures::stream::iter([
            Ok(watcher::Event::Init),
            Ok(watcher::Event::InitApply(object("a", "ua", "1"))),
            Ok(watcher::Event::InitDone),
        ]);
        let mut applied = events.reflect(writer).applied_objects().boxed();
        let first = applied.next().await.expect("an object").expect("no error");
        assert_eq!(first.name_any(), "a");
        assert!(
            store.get(&ObjectRef::from_obj(&first)).is_none(),
            "the store does not have the object its reconcile would look up"
        );
        assert!(applied.next().await.is_none());
        assert!(
            store.get(&ObjectRef::from_obj(&first)).is_some(),
            "only after InitDone"
        );
    }
}
